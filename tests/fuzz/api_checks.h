/* Checks the fuzz targets of the OpenAI-shaped request parsers share (api_fuzz.c,
 * responses_fuzz.c), over fuzz_check.h's CHECK and use_str: a failed check traps, so libFuzzer
 * keeps the input. Header-only, as each target is one translation unit (the Makefile's fuzz
 * rule). */
#ifndef KVSERVE_TESTS_FUZZ_API_CHECKS_H
#define KVSERVE_TESTS_FUZZ_API_CHECKS_H

#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/api/api.h"
#include "tests/fuzz/fuzz_check.h"

static inline uint64_t use_messages(const chat_message *m, int n) {
    uint64_t sink = 0;
    CHECK(n >= 1 && m != NULL);
    for (int i = 0; i < n; i++) {
        bool assistant = !strcmp(m[i].role, "assistant"), tool = !strcmp(m[i].role, "tool");
        CHECK(!strcmp(m[i].role, "system") || !strcmp(m[i].role, "user") || assistant || tool);
        sink += use_str(m[i].content);
        /* calls only on assistant turns, each with a name and arguments that are JSON text */
        CHECK(m[i].n_tool_calls >= 0 && (m[i].n_tool_calls == 0 || assistant));
        for (int k = 0; k < m[i].n_tool_calls; k++) {
            const chat_tool_call *c = &m[i].tool_calls[k];
            sink += use_str(c->name) + (c->id ? use_str(c->id) : 0);
            if (c->arguments && *c->arguments) {
                json_t *a = json_loads(c->arguments, JSON_DECODE_ANY, NULL);
                CHECK(a != NULL);
                json_decref(a);
            }
        }
        CHECK(tool || (!m[i].tool_call_id && !m[i].name));
        if (m[i].tool_call_id) sink += use_str(m[i].tool_call_id);
        if (m[i].name) sink += use_str(m[i].name);
    }
    return sink;
}

/* The error must be well-formed and its JSON must parse back. */
static inline void check_error(const api_error *err) {
    CHECK(err->status >= 400 && err->status < 600);
    CHECK(err->type != NULL && err->message[0] != '\0');
    char *s = api_error_json(err);
    CHECK(s != NULL);
    json_t *root = json_loads(s, 0, NULL);
    CHECK(root != NULL);
    json_decref(root);
    free(s);
}

#endif
