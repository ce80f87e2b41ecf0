/* Microbenchmark of constrained decoding's per-token cost on a model's vocabulary: for each
 * grammar, a valid answer is tokenized and walked token by token, timing the mask (the state's
 * allowed tokens applied to a logits row of n_vocab floats) and the token's acceptance.
 *
 *   make build/grammar_bench && build/grammar_bench models/SmolLM2-135M-Instruct.Q4_1.gguf
 *
 * "cold" is the first walk with a fresh matcher (states determinized and masks computed as they
 * are reached: what the first request with a new schema pays); "warm" walks again with the same
 * matcher (every mask cached: what later tokens in the same state, and choices sharing the
 * request's matcher, pay). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/grammar/grammar.h"
#include "model/model.h"

typedef struct walk_stats {
    double mean_us, max_us;
    int n_tokens;
} walk_stats;

static int walk(gmatch *m, const int32_t *ids, int n, float *logits, int32_t n_vocab,
                walk_stats *st) {
    int32_t s = gmatch_start(m);
    double total = 0, mx = 0;
    for (int i = 0; i < n; i++) {
        for (int32_t k = 0; k < n_vocab; k++) logits[k] = 0.0f;
        kv_error err = {{0}};
        uint64_t t0 = clock_now_ns();
        int allowed = gmatch_apply(m, s, logits, &err);
        int32_t next = gmatch_accept_token(m, s, ids[i]);
        double us = (double)(clock_now_ns() - t0) / 1e3;
        if (allowed < 0 || next < 0) {
            fprintf(stderr, "token %d (%d) refused: %s\n", i, ids[i], err.msg);
            return -1;
        }
        s = next;
        total += us;
        if (us > mx) mx = us;
    }
    st->mean_us = total / n;
    st->max_us = mx;
    st->n_tokens = n;
    return 0;
}

static int bench(const char *name, const char *gbnf, const char *answer, const model *mdl,
                 const grammar_vocab *v, float *logits) {
    kv_error err = {{0}};
    grammar *g = grammar_parse(gbnf, strlen(gbnf), &err);
    if (!g) {
        fprintf(stderr, "%s: %s\n", name, err.msg);
        return -1;
    }
    int32_t *ids = NULL;
    int n = tokenizer_encode(mdl->tok, answer, strlen(answer), false, false, &ids, &err);
    gmatch *m = gmatch_create(g, v, &err);
    walk_stats cold, warm;
    int rc = n > 0 && m && !walk(m, ids, n, logits, mdl->hp.n_vocab, &cold) &&
                     !walk(m, ids, n, logits, mdl->hp.n_vocab, &warm)
                 ? 0
                 : -1;
    if (!rc) {
        int64_t states, masks, bytes;
        gmatch_stats(m, &states, &masks, &bytes);
        printf("| %-22s | %6d | %9.1f | %9.1f | %9.1f | %7lld | %8.1f |\n", name, n, cold.mean_us,
               cold.max_us, warm.mean_us, (long long)states, (double)bytes / 1048576.0);
    }
    gmatch_destroy(m);
    free(ids);
    grammar_destroy(g);
    return rc;
}

static char *schema_gbnf(const char *schema) {
    kv_error err = {{0}};
    char *g = json_schema_to_gbnf(schema, strlen(schema), &err);
    if (!g) fprintf(stderr, "schema: %s\n", err.msg);
    return g;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: grammar_bench MODEL.gguf\n");
        return 2;
    }
    kv_error err = {{0}};
    model_load_opts lo = {0};
    model *mdl = model_load(argv[1], &lo, &err);
    if (!mdl) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    uint64_t t0 = clock_now_ns();
    grammar_vocab *v = grammar_vocab_create(mdl->tok, &err);
    double build_ms = (double)(clock_now_ns() - t0) / 1e6;
    if (!v) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    printf("vocabulary: %d tokens, trie of %lld nodes built in %.1f ms\n\n", mdl->hp.n_vocab,
           (long long)grammar_vocab_n_nodes(v), build_ms);
    float *logits = malloc(sizeof *logits * (size_t)mdl->hp.n_vocab);

    /* a large enum: 1000 distinct strings */
    size_t cap = 64 * 1024;
    char *big = malloc(cap), *enum_answer = "\"tag-777-delta\"";
    const char *words[] = {"alpha", "beta", "gamma", "delta", "omega"};
    size_t n = (size_t)snprintf(big, cap, "{\"enum\":[");
    for (int i = 0; i < 1000; i++)
        n += (size_t)snprintf(big + n, cap - n, "%s\"tag-%d-%s\"", i ? "," : "", i,
                              words[i % 5 == 2 ? 3 : i % 5]);
    snprintf(big + n, cap - n, "]}");
    /* a deep schema: eight nested objects with long fixed keys, a string and a number each */
    char deep[8192] = "", tail[256] = "";
    char deep_answer[4096] = "";
    for (int d = 0; d < 8; d++) {
        char part[256];
        snprintf(part, sizeof part,
                 "{\"type\":\"object\",\"properties\":{\"description_of_level_%d\":{\"type\":"
                 "\"string\",\"maxLength\":40},\"measurement_value_%d\":{\"type\":\"number\"}%s",
                 d, d, d < 7 ? ",\"nested_child_object\":" : "");
        strcat(deep, part);
        snprintf(part, sizeof part,
                 "{\"description_of_level_%d\": \"the level %d text\", "
                 "\"measurement_value_%d\": %d.5%s",
                 d, d, d, d * 3, d < 7 ? ", \"nested_child_object\": " : "");
        strcat(deep_answer, part);
    }
    for (int d = 0; d < 8; d++) {
        strcat(deep, "},\"additionalProperties\":false}");
        strcat(tail, "}");
    }
    strcat(deep_answer, tail);
    char *enum_g = schema_gbnf(big), *deep_g = schema_gbnf(deep);
    const char *json_answer =
        "{\"name\": \"Ada Lovelace\", \"born\": 1815, \"languages\": [\"English\", \"French\"], "
        "\"notes\": {\"first_program\": true, \"machine\": \"Analytical Engine\", \"score\": "
        "9.75e1}, \"quote\": \"That brain of mine is something more than merely mortal.\"}";
    printf("| grammar                | tokens | cold µs/t | cold max  | warm µs/t | states  | "
           "memo MiB |\n");
    printf("|------------------------|-------:|----------:|----------:|----------:|--------:|"
           "---------:|\n");
    int rc = 0;
    rc |= bench("JSON (json_object)", json_object_gbnf(), json_answer, mdl, v, logits);
    rc |= enum_g ? bench("enum of 1000 strings", enum_g, enum_answer, mdl, v, logits) : -1;
    rc |= deep_g ? bench("8-level nested schema", deep_g, deep_answer, mdl, v, logits) : -1;
    free(enum_g);
    free(deep_g);
    free(big);
    free(logits);
    grammar_vocab_destroy(v);
    model_free(mdl);
    return rc ? 1 : 0;
}
