/* libFuzzer target for the GBNF parser and the JSON Schema compiler: the bytes go to
 * grammar_parse as GBNF and to json_schema_to_gbnf as a schema; whatever GBNF the compiler
 * produces must parse (the compiler never emits a grammar the parser refuses). A grammar that
 * parses is matched against a small vocabulary: the start state's mask and a walk over the
 * input's own bytes must stay in bounds. Seeds: tests/fuzz/corpus/grammar_fuzz/. */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/grammar/grammar.h"

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "grammar_fuzz: check failed: %s (line %d)\n", #cond, __LINE__);        \
            __builtin_trap();                                                                      \
        }                                                                                          \
    } while (0)

static void exercise(const grammar *g, const uint8_t *data, size_t size) {
    static const char *toks[] = {"a",    "b",    "{", "}", "\"", "ab",
                                 "\xc3", "\xa9", " ", "1", "[",  "]"};
    size_t lens[13];
    bool eog[13] = {0};
    const char *t[13];
    for (int i = 0; i < 12; i++) {
        t[i] = toks[i];
        lens[i] = strlen(toks[i]);
    }
    t[12] = "";
    lens[12] = 0;
    eog[12] = true;
    kv_error err = {{0}};
    grammar_vocab *v = grammar_vocab_create_raw(t, lens, eog, 13, &err);
    CHECK(v != NULL);
    gmatch *m = gmatch_create(g, v, &err);
    CHECK(m != NULL);
    int32_t s = gmatch_start(m);
    if (s >= 0) {
        const uint64_t *mask = gmatch_mask(m, s, &err);
        CHECK(mask != NULL || err.msg[0]);
        char buf[64];
        int32_t next;
        size_t n = gmatch_forced(m, s, buf, sizeof buf, &next);
        CHECK(n <= sizeof buf);
        for (size_t i = 0; i < size && s >= 0 && i < 256; i++)
            s = gmatch_accept_token(m, s, data[i] % 13);
    }
    gmatch_destroy(m);
    grammar_vocab_destroy(v);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    kv_error err = {{0}};
    grammar *g = grammar_parse((const char *)data, size, &err);
    if (g) {
        exercise(g, data, size);
        grammar_destroy(g);
    } else {
        CHECK(err.msg[0] != '\0');
    }
    memset(&err, 0, sizeof err);
    char *gbnf = json_schema_to_gbnf((const char *)data, size, &err);
    if (gbnf) {
        grammar *cg = grammar_parse(gbnf, strlen(gbnf), &err);
        if (!cg) fprintf(stderr, "compiled grammar refused: %s\n%s\n", err.msg, gbnf);
        CHECK(cg != NULL);
        grammar_destroy(cg);
        free(gbnf);
    } else {
        CHECK(err.msg[0] != '\0');
    }
    return 0;
}
