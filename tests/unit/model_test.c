/* The forward pass on the real model: logits against llama.cpp's (tests/golden/logits, made by
 * scripts/ref/make_logits_goldens.py), and the contract DESIGN.md fixes for the cache work:
 * explicit positions, row subsets through the layer hooks, batches of sequences, the paged pool. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/model.h"
#include "tests/unit/model_fixture.h"
#include "tests/unit/ref_logits.h"

#define GOLDEN "tests/golden/logits/smollm2.json"

static model_fixture g_fx;
static model *g_m;
static backend *g_b;
static kv_pool *g_pool;
static forward_ctx *g_f;
static float *g_logits;

static void setup(void) {
    model_fixture_open(&g_fx, 2, 4096, 512, 4);
    g_m = g_fx.m;
    g_b = g_fx.b;
    g_pool = g_fx.pool;
    g_f = g_fx.f;
    g_logits = malloc(sizeof(float) * 512 * (size_t)g_m->hp.n_vocab);
}

static void teardown(void) {
    free(g_logits);
    model_fixture_close(&g_fx);
}

TestSuite(model, .init = setup, .fini = teardown, .timeout = 600);

/* Runs tokens [0, n) as one prefill of a fresh sequence at positions 0..n-1. */
static int run_prefill(kv_seq *s, const int32_t *ids, int n, bool all, float *logits) {
    kv_error err = {{0}};
    int32_t *pos = malloc(sizeof(int32_t) * (size_t)n);
    for (int i = 0; i < n; i++) pos[i] = s->n_tokens + i;
    cr_assert_eq(kv_seq_reserve(g_pool, s, s->n_tokens + n, &err), 0, "%s", err.msg);
    batch_seq bs = {.seq = s,
                    .n_tok = n,
                    .tokens = ids,
                    .pos = pos,
                    .kv_start = s->n_tokens,
                    .all_logits = all};
    int r = model_forward(g_f, &bs, 1, NULL, logits, &err);
    cr_assert_geq(r, 0, "forward: %s", err.msg);
    free(pos);
    return r;
}

Test(model, hparams) {
    const model_hparams *hp = &g_m->hp;
    cr_expect_eq(hp->n_layer, 30);
    cr_expect_eq(hp->dim, 576);
    cr_expect_eq(hp->n_head, 9);
    cr_expect_eq(hp->n_kv_head, 3);
    cr_expect_eq(hp->head_dim, 64);
    cr_expect_eq(hp->ffn_dim, 1536);
    cr_expect_eq(hp->n_vocab, 49152);
    cr_expect_eq(hp->n_ctx_train, 8192);
    cr_expect(hp->tied_output);
    cr_expect_float_eq(hp->rope_base, 100000.0f, 1e-3);
    cr_expect_float_eq(hp->norm_eps, 1e-5f, 1e-9);
    cr_expect_eq(g_m->chat.kind, CHAT_TEMPLATE_CHATML);
}

/* Agreement with one reference over every golden position. */

/* Runs every golden prompt and compares the logits with both references. */
static void compare_goldens(ref_stats *llama, ref_stats *exact, int *n_cases) {
    json_error_t jerr;
    json_t *root = json_load_file(GOLDEN, 0, &jerr);
    cr_assert_not_null(root, "%s: %s", GOLDEN, jerr.text);
    json_t *cases = json_object_get(root, "cases");
    *n_cases = (int)json_array_size(cases);
    for (int c = 0; c < *n_cases; c++) {
        json_t *jc = json_array_get(cases, (size_t)c);
        json_t *jt = json_object_get(jc, "tokens");
        int n = (int)json_array_size(jt);
        int32_t *ids = malloc(sizeof(int32_t) * (size_t)n);
        for (int i = 0; i < n; i++)
            ids[i] = (int32_t)json_integer_value(json_array_get(jt, (size_t)i));
        kv_seq s;
        kv_seq_init(&s);
        cr_assert_eq(run_prefill(&s, ids, n, true, g_logits), n);
        for (int p = 0; p < n; p++) {
            const float *lg = g_logits + (size_t)p * g_m->hp.n_vocab;
            ref_compare(llama, lg, g_m->hp.n_vocab,
                        json_array_get(json_object_get(jc, "top_ids"), (size_t)p),
                        json_array_get(json_object_get(jc, "top_logits"), (size_t)p));
            ref_compare(exact, lg, g_m->hp.n_vocab,
                        json_array_get(json_object_get(jc, "exact_top_ids"), (size_t)p),
                        json_array_get(json_object_get(jc, "exact_top_logits"), (size_t)p));
        }
        kv_seq_release(g_pool, &s);
        free(ids);
    }
    json_decref(root);
}

Test(model, logits_match_references) {
    ref_stats llama = {0}, exact = {0};
    int n_cases = 0;
    compare_goldens(&llama, &exact, &n_cases);
    ref_report("logits", "llama.cpp", &llama);
    ref_report("logits", "exact f64", &exact);
    cr_assert_geq(n_cases, 5);
    cr_assert_geq(llama.n_pos, 5 * 64);
    const ref_stats *refs[2] = {&llama, &exact};
    for (int r = 0; r < 2; r++) {
        const ref_stats *st = refs[r];
        cr_assert_eq(st->decisive_agree, st->decisive, "a decisive top-1 differs");
        cr_assert_geq(st->decisive, st->n_pos / 2, "too few decisive positions to mean much");
        cr_assert_geq((double)st->top1 / st->n_pos, 0.95);
        cr_assert_lt(ref_mean_delta(st), 0.3);
        cr_assert_lt(st->max_delta, 3.0);
    }
}

/* With f32 matmuls the forward pass is the exact computation up to float rounding: top-1 agrees
 * with the float64 reference wherever it is not a tie at float precision. */
Test(model, precise_logits_match_exact) {
    ref_stats llama = {0}, exact = {0};
    int n_cases = 0;
    backend_set_precision(g_b, MATMUL_PRECISION_F32);
    compare_goldens(&llama, &exact, &n_cases);
    backend_set_precision(g_b, MATMUL_PRECISION_Q8);
    ref_report("logits (f32 matmuls)", "exact f64", &exact);
    ref_report("logits (f32 matmuls)", "llama.cpp", &llama);
    cr_assert_geq(exact.n_pos, 5 * 64);
    cr_assert_geq((double)exact.top1 / exact.n_pos, 0.99, "top-1 %d/%d", exact.top1, exact.n_pos);
    cr_assert_lt(ref_mean_delta(&exact), 0.02);
    cr_assert_lt(exact.max_delta, 0.1);
}

/* A prefix computed once and continued must equal one prefill of the whole (exact reuse). */
Test(model, continued_prefill_equals_full) {
    int32_t ids[100];
    for (int i = 0; i < 100; i++) ids[i] = (int32_t)((i * 7919 + 13) % 49152);
    float *full = malloc(sizeof(float) * (size_t)g_m->hp.n_vocab);
    kv_seq a, b;
    kv_seq_init(&a);
    kv_seq_init(&b);
    run_prefill(&a, ids, 100, false, full);
    run_prefill(&b, ids, 37, false, g_logits);
    run_prefill(&b, ids + 37, 63, false, g_logits);
    double md = 0;
    for (int i = 0; i < g_m->hp.n_vocab; i++) md = fmax(md, fabs(full[i] - g_logits[i]));
    cr_expect_lt(md, 2e-3, "max delta %g", md);
    kv_seq_release(g_pool, &a);
    kv_seq_release(g_pool, &b);
    free(full);
}

typedef struct keep_last {
    int keep;
    int calls;
} keep_last;

static int hook_keep_last(void *ud, forward_state *st, int layer) {
    keep_last *k = ud;
    k->calls++;
    if (layer != 0) return 0;
    int n = forward_state_n_rows(st), keep[16];
    for (int i = 0; i < k->keep; i++) keep[i] = n - k->keep + i;
    return forward_state_keep_rows(st, keep, k->keep);
}

/* Recomputing only a subset of rows after layer 0, attending over KV the pool already holds for
 * the others, gives the same last-token logits as computing every row (the CacheBlend shape). */
Test(model, row_subset_attends_all_kv) {
    int32_t ids[80];
    for (int i = 0; i < 80; i++) ids[i] = (int32_t)((i * 104729 + 7) % 49152);
    float *full = malloc(sizeof(float) * (size_t)g_m->hp.n_vocab);
    kv_seq s;
    kv_seq_init(&s);
    run_prefill(&s, ids, 80, false, full);
    int32_t pos[80];
    for (int i = 0; i < 80; i++) pos[i] = i;
    keep_last k = {.keep = 5};
    forward_hooks hooks = {.ud = &k, .after_layer = hook_keep_last};
    batch_seq bs = {.seq = &s, .n_tok = 80, .tokens = ids, .pos = pos, .kv_start = 0};
    kv_error err = {{0}};
    int n_out = model_forward(g_f, &bs, 1, &hooks, g_logits, &err);
    cr_assert_eq(n_out, 1, "%s", err.msg);
    cr_expect_eq(k.calls, g_m->hp.n_layer);
    double md = 0;
    for (int i = 0; i < g_m->hp.n_vocab; i++) md = fmax(md, fabs(full[i] - g_logits[i]));
    cr_expect_lt(md, 2e-3, "max delta %g", md);
    kv_seq_release(g_pool, &s);
    free(full);
}

/* Runs ids[0..n) at positions 0.. into a fresh sequence with the given hooks (and all_rows),
 * leaving the last token's logits in out and the sequence's KV in place. */
static void run_hooked(kv_seq *s, const int32_t *ids, int n, const forward_hooks *hooks,
                       bool all_rows, float *out) {
    int32_t pos[128];
    cr_assert_leq(n, 128);
    for (int i = 0; i < n; i++) pos[i] = i;
    kv_seq_init(s);
    kv_error err = {{0}};
    cr_assert_eq(kv_seq_reserve(g_pool, s, n, &err), 0, "%s", err.msg);
    batch_seq bs = {
        .seq = s, .n_tok = n, .tokens = ids, .pos = pos, .kv_start = 0, .all_rows = all_rows};
    cr_assert_eq(model_forward(g_f, &bs, 1, hooks, out, &err), 1, "%s", err.msg);
}

/* Layer `layer`'s K and V (f32, [n][kv_dim] each) of slots 0..n-1 of s. */
static void read_layer_kv(const kv_seq *s, int layer, int n, float *k, float *v) {
    int32_t slots[128];
    for (int i = 0; i < n; i++) slots[i] = i;
    const kv_layout *l = kv_pool_layout(g_pool);
    backend_kv_load(g_b, kv_pool_memory(g_pool), l, layer, 0, s->blocks, slots, n, k);
    backend_kv_load(g_b, kv_pool_memory(g_pool), l, layer, 1, s->blocks, slots, n, v);
}

typedef struct drop_at {
    int layer;
    int keep; /* the last `keep` rows stay */
} drop_at;

static int hook_drop_at(void *ud, forward_state *st, int layer) {
    const drop_at *d = ud;
    if (layer != d->layer) return 0;
    int n = forward_state_n_rows(st), keep[16];
    for (int i = 0; i < d->keep; i++) keep[i] = n - d->keep + i;
    return forward_state_keep_rows(st, keep, d->keep);
}

/* Rows dropped once a layer has written their KV (after_kv) skip its attention and feed-forward,
 * which only their own hidden state would use: the same KV and logits, bit for bit, as rows
 * dropped after the whole layer. And the last layer computing only the row that gives logits
 * (all_rows off) changes no bit either. */
Test(model, rows_dropped_after_kv_skip_only_work_nobody_reads) {
    enum { N = 80, LAYER = 3 };
    int32_t ids[N];
    for (int i = 0; i < N; i++) ids[i] = (int32_t)((i * 6151 + 3) % 49152);
    size_t nv = (size_t)g_m->hp.n_vocab;
    int kvd = g_m->hp.n_kv_head * g_m->hp.head_dim;
    float *la = malloc(sizeof(float) * nv), *lb = malloc(sizeof(float) * nv);
    float *ka = malloc(sizeof(float) * N * kvd), *va = malloc(sizeof(float) * N * kvd),
          *kb = malloc(sizeof(float) * N * kvd), *vb = malloc(sizeof(float) * N * kvd);
    drop_at d = {LAYER, 5};
    forward_hooks after_layer = {.ud = &d, .after_layer = hook_drop_at};
    forward_hooks after_kv = {.ud = &d, .after_kv = hook_drop_at};
    kv_seq a, b;
    run_hooked(&a, ids, N, &after_layer, false, la);
    run_hooked(&b, ids, N, &after_kv, false, lb);
    cr_expect_eq(memcmp(la, lb, sizeof(float) * nv), 0, "logits differ");
    for (int l = 0; l <= LAYER; l++) {
        read_layer_kv(&a, l, N, ka, va);
        read_layer_kv(&b, l, N, kb, vb);
        cr_expect_eq(memcmp(ka, kb, sizeof(float) * N * kvd), 0, "layer %d: K differs", l);
        cr_expect_eq(memcmp(va, vb, sizeof(float) * N * kvd), 0, "layer %d: V differs", l);
    }
    kv_seq_release(g_pool, &a);
    kv_seq_release(g_pool, &b);

    run_hooked(&a, ids, N, NULL, true, la);
    run_hooked(&b, ids, N, NULL, false, lb);
    cr_expect_eq(memcmp(la, lb, sizeof(float) * nv), 0, "logits differ without all_rows");
    for (int l = 0; l < g_m->hp.n_layer; l++) {
        read_layer_kv(&a, l, N, ka, va);
        read_layer_kv(&b, l, N, kb, vb);
        cr_expect_eq(memcmp(ka, kb, sizeof(float) * N * kvd), 0, "layer %d: K differs", l);
        cr_expect_eq(memcmp(va, vb, sizeof(float) * N * kvd), 0, "layer %d: V differs", l);
    }
    kv_seq_release(g_pool, &a);
    kv_seq_release(g_pool, &b);
    free(la);
    free(lb);
    free(ka);
    free(va);
    free(kb);
    free(vb);
}

/* Several sequences in one batch give what each gives alone. */
Test(model, batch_equals_alone) {
    enum { NS = 3 };
    int lens[NS] = {17, 1, 40};
    int32_t ids[NS][40], pos[NS][40];
    float *alone = malloc(sizeof(float) * NS * (size_t)g_m->hp.n_vocab);
    kv_seq seqs[NS];
    batch_seq bs[NS];
    for (int s = 0; s < NS; s++) {
        for (int i = 0; i < lens[s]; i++) {
            ids[s][i] = (int32_t)((s * 1000 + i * 31 + 5) % 49152);
            pos[s][i] = i;
        }
        kv_seq tmp;
        kv_seq_init(&tmp);
        run_prefill(&tmp, ids[s], lens[s], false, alone + (size_t)s * g_m->hp.n_vocab);
        kv_seq_release(g_pool, &tmp);
        kv_seq_init(&seqs[s]);
        kv_error err = {{0}};
        cr_assert_eq(kv_seq_reserve(g_pool, &seqs[s], lens[s], &err), 0);
        bs[s] = (batch_seq){.seq = &seqs[s], .n_tok = lens[s], .tokens = ids[s], .pos = pos[s]};
    }
    kv_error err = {{0}};
    cr_assert_eq(model_forward(g_f, bs, NS, NULL, g_logits, &err), NS, "%s", err.msg);
    for (int s = 0; s < NS; s++) {
        double md = 0;
        for (int i = 0; i < g_m->hp.n_vocab; i++)
            md = fmax(md, fabs(alone[(size_t)s * g_m->hp.n_vocab + i] -
                               g_logits[(size_t)s * g_m->hp.n_vocab + i]));
        cr_expect_lt(md, 2e-3, "sequence %d: max delta %g", s, md);
        kv_seq_release(g_pool, &seqs[s]);
    }
    free(alone);
}

/* Positions are explicit: the same tokens at shifted positions give different logits, and a
 * sequence forked from a shared prefix continues exactly like the original. */
Test(model, fork_shares_blocks_and_continues) {
    int32_t ids[50];
    for (int i = 0; i < 50; i++) ids[i] = (int32_t)((i * 211 + 3) % 49152);
    float *ref = malloc(sizeof(float) * (size_t)g_m->hp.n_vocab);
    kv_seq a, b;
    kv_seq_init(&a);
    kv_seq_init(&b);
    run_prefill(&a, ids, 50, false, ref);
    kv_seq_truncate(g_pool, &a, 40); /* drop the tail: blocks 0..2 stay (40 slots) */
    kv_error err = {{0}};
    int64_t free_before = kv_pool_free_blocks(g_pool);
    cr_assert_eq(kv_seq_fork(g_pool, &b, &a, 40, &err), 0, "%s", err.msg);
    cr_expect_eq(kv_pool_free_blocks(g_pool), free_before, "fork copies nothing");
    cr_expect_eq(kv_pool_block_refs(g_pool, a.blocks[0]), 2);
    /* b writes slot 40, inside the shared third block: it gets its own copy */
    run_prefill(&b, ids + 40, 10, false, g_logits);
    cr_expect_neq(a.blocks[2], b.blocks[2]);
    cr_expect_eq(a.blocks[1], b.blocks[1]);
    double md = 0;
    for (int i = 0; i < g_m->hp.n_vocab; i++) md = fmax(md, fabs(ref[i] - g_logits[i]));
    cr_expect_lt(md, 2e-3, "max delta %g", md);
    kv_seq_release(g_pool, &a);
    kv_seq_release(g_pool, &b);
    cr_expect_eq(kv_pool_free_blocks(g_pool), kv_pool_total_blocks(g_pool));
    free(ref);
}

Test(model, pool_full_and_bad_input_are_errors) {
    kv_seq s;
    kv_seq_init(&s);
    kv_error err = {{0}};
    cr_expect_eq(kv_seq_reserve(g_pool, &s, 4096 + 16, &err), -1);
    cr_expect(strstr(err.msg, "KV pool full") != NULL, "%s", err.msg);
    cr_expect_eq(s.n_blocks, 0, "a failed reservation changes nothing");
    int32_t bad = 49152, pos = 0;
    cr_assert_eq(kv_seq_reserve(g_pool, &s, 1, &err), 0);
    batch_seq bs = {.seq = &s, .n_tok = 1, .tokens = &bad, .pos = &pos};
    cr_expect_eq(model_forward(g_f, &bs, 1, NULL, g_logits, &err), -1);
    cr_expect(strstr(err.msg, "out of range") != NULL, "%s", err.msg);
    kv_seq_release(g_pool, &s);
}

Test(model, missing_and_wrong_files_are_errors) {
    kv_error err = {{0}};
    cr_expect_null(model_load("models/does-not-exist.gguf", NULL, &err));
    cr_expect(strlen(err.msg) > 0);
    cr_expect_null(model_load("Makefile", NULL, &err));
    cr_expect(strlen(err.msg) > 0, "%s", err.msg);
}
