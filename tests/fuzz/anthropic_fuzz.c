/* libFuzzer target for the Anthropic Messages request parser (server/api/anthropic_req.c): the same
 * bytes are parsed as a /v1/messages body and as a /v1/messages/count_tokens body. On success
 * the chat request is read end to end (ASan checks every string) and its invariants checked: one
 * system message at most and first, roles the chat templates know, tool calls only on assistant
 * turns with arguments that are JSON objects, every marker inside its message's content, at most
 * four with a 1h one never after a 5m one; on failure the error carries a status and a message
 * whose Anthropic JSON parses back. Seeds: tests/fuzz/corpus/anthropic_fuzz/. */
#include <jansson.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/api/anthropic.h"
#include "tests/fuzz/fuzz_check.h"

static uint64_t use_request(const anthropic_request *ar, bool count) {
    const api_request *r = &ar->rq;
    uint64_t sink = use_str(r->model);
    CHECK(r->kind == API_CHAT && r->n_messages >= 1);
    CHECK(count ? r->max_tokens == -1 : r->max_tokens >= 0);
    for (int i = 0; i < r->n_messages; i++) {
        const chat_message *m = &r->messages[i];
        bool sys = !strcmp(m->role, "system"), assistant = !strcmp(m->role, "assistant");
        bool tool = !strcmp(m->role, "tool");
        CHECK(sys || assistant || tool || !strcmp(m->role, "user"));
        CHECK(!sys || i == 0);
        sink += use_str(m->content);
        CHECK(m->n_tool_calls == 0 || assistant);
        for (int k = 0; k < m->n_tool_calls; k++) {
            sink += use_str(m->tool_calls[k].id) + use_str(m->tool_calls[k].name);
            json_t *a = json_loads(m->tool_calls[k].arguments, 0, NULL);
            CHECK(json_is_object(a));
            json_decref(a);
        }
        CHECK(tool == (m->tool_call_id != NULL));
        if (tool) sink += use_str(m->tool_call_id);
        for (int k = 0; k < m->n_parts; k++) CHECK(m->part_ends[k] <= strlen(m->content));
    }
    CHECK(r->n_tools >= 0 && r->n_tools <= API_MAX_TOOLS);
    for (int i = 0; i < r->n_tools; i++) sink += use_str(r->tools[i].name);
    CHECK(r->tool_choice == CHAT_TOOL_NONE || r->n_tools > 0);
    CHECK(r->tool_choice != CHAT_TOOL_NAMED || r->tool_choice_name);
    CHECK(r->n_stops >= 0 && r->n_stops <= API_MAX_STOPS);
    for (int i = 0; i < r->n_stops; i++) CHECK(use_str(r->stops[i]) > 0);
    const sampler_params *s = &r->sampling;
    CHECK(s->temperature >= 0 && s->temperature <= 1 && s->top_p >= 0 && s->top_p <= 1);
    CHECK(ar->n_markers >= 0 && ar->n_markers <= ANTHROPIC_MAX_MARKERS);
    for (int k = 0; k < ar->n_markers; k++) {
        const anthropic_marker *m = &ar->markers[k];
        CHECK(m->ttl == ANTHROPIC_TTL_5M || m->ttl == ANTHROPIC_TTL_1H);
        CHECK(k == 0 || m->ttl <= ar->markers[k - 1].ttl);
        CHECK(m->msg >= -1 && m->msg < r->n_messages);
        if (m->msg < 0) CHECK(!m->text);
        if (m->text) CHECK(m->a <= m->e && m->e <= strlen(r->messages[m->msg].content));
    }
    return sink;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    volatile uint64_t sink = 0;
    for (int count = 0; count < 2; count++) {
        anthropic_request r;
        api_error err;
        if (anthropic_parse((const char *)data, size, count, &r, &err) == 0) {
            sink += use_request(&r, count);
        } else {
            CHECK(err.status >= 400 && err.status < 600 && err.message[0]);
            CHECK(r.rq.model == NULL && r.rq.messages == NULL && r.n_markers == 0);
            char *s = anthropic_error_json(&err);
            CHECK(s != NULL);
            json_t *v = json_loads(s, 0, NULL);
            CHECK(v != NULL);
            json_decref(v);
            free(s);
        }
        anthropic_request_free(&r);
    }
    (void)sink;
    return 0;
}
