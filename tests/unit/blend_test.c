/* CacheBlend (cache/blend/blend.h) on the real model: content-defined chunks find a passage
 * wherever it sits, the RoPE delta rotation moves K exactly as rotating at the new position would,
 * the fusor at ratio 1 is a full prefill bit for bit, and the HKVD selection finds the tokens whose
 * reused KV is wrong. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cache/blend/blend.h"
#include "kernels/quant.h"
#include "tests/unit/model_fixture.h"

#define MAX_TOK 512

static model_fixture g_fx;
static model *g_m;
static backend *g_b;
static kv_pool *g_pool;
static forward_ctx *g_f;
static blend_fusor *g_fus;
static float *g_logits;
static int g_kvd;

static void setup(void) {
    kv_error err = {{0}};
    model_fixture_open(&g_fx, 2, 4096, MAX_TOK, 4);
    g_m = g_fx.m;
    g_b = g_fx.b;
    g_pool = g_fx.pool;
    g_f = g_fx.f;
    g_fus = blend_fusor_create(g_m, g_b, g_pool, MAX_TOK, &err);
    cr_assert_not_null(g_fus, "%s", err.msg);
    g_logits = malloc(sizeof(float) * 4 * (size_t)g_m->hp.n_vocab);
    g_kvd = g_m->hp.n_kv_head * g_m->hp.head_dim;
}

static void teardown(void) {
    free(g_logits);
    blend_fusor_destroy(g_fus);
    model_fixture_close(&g_fx);
}

TestSuite(blend, .init = setup, .fini = teardown, .timeout = 600);

static int tokenize(const char *text, int32_t **ids) {
    kv_error err = {{0}};
    int n = tokenizer_encode(g_m->tok, text, strlen(text), false, false, ids, &err);
    cr_assert_gt(n, 0, "%s", err.msg);
    return n;
}

static const char *PASSAGE =
    "The licenses for most software and other practical works are designed\n"
    "to take away your freedom to share and change the works. By contrast,\n"
    "the GNU General Public License is intended to guarantee your freedom to\n"
    "share and change all versions of a program--to make sure it remains free\n"
    "software for all its users. We, the Free Software Foundation, use the\n"
    "GNU General Public License for most of our software; it applies also to\n"
    "any other work released this way by its authors. You can apply it to\n"
    "your programs, too.\n";

/* Runs ids[0..n) of s at slots (= positions) s->n_tokens.. as one entry, with hooks; returns
 * the last token's logits in g_logits. */
static void run(kv_seq *s, const int32_t *ids, int n, const forward_hooks *hooks, blend_entry *ents,
                int n_ents) {
    kv_error err = {{0}};
    int32_t *pos = malloc(sizeof(int32_t) * (size_t)n);
    for (int i = 0; i < n; i++) pos[i] = s->n_tokens + i;
    cr_assert_eq(kv_seq_reserve(g_pool, s, s->n_tokens + n, &err), 0, "%s", err.msg);
    batch_seq bs = {.seq = s, .n_tok = n, .tokens = ids, .pos = pos, .kv_start = s->n_tokens};
    forward_hooks h;
    if (ents) {
        cr_assert_eq(blend_fusor_begin(g_fus, &bs, 1, ents, n_ents, &h, &err), 0, "%s", err.msg);
        hooks = &h;
    }
    int n_out = model_forward(g_f, &bs, 1, hooks, g_logits, &err);
    if (ents) blend_fusor_end(g_fus);
    cr_assert_eq(n_out, 1, "%s", err.msg);
    free(pos);
}

/* s's KV at slots a..a+n-1 as a content record computed at position a. */
static content_rec *export_rec(const kv_seq *s, int a, int n) {
    cache_key key = {{0}}, ns = {{0}};
    content_rec *r = content_rec_create(g_m->hp.n_layer, g_kvd, n, &key, &ns, a);
    cr_assert_not_null(r);
    int32_t slots[MAX_TOK];
    float *rows = malloc(sizeof(float) * (size_t)n * (size_t)g_kvd);
    for (int j = 0; j < n; j++) slots[j] = a + j;
    for (int l = 0; l < g_m->hp.n_layer; l++)
        for (int kv = 0; kv < 2; kv++) {
            backend_kv_load(g_b, kv_pool_memory(g_pool), kv_pool_layout(g_pool), l, kv, s->blocks,
                            slots, n, rows);
            fp32_to_fp16_row(rows, (uint16_t *)content_rec_rows(r, l, kv), (int64_t)n * g_kvd);
        }
    free(rows);
    return r;
}

/* Every layer's K and V of slots [a, a + n) of x and y are the same bits. */
static bool same_kv(const kv_seq *x, const kv_seq *y, int a, int n) {
    float *rx = malloc(sizeof(float) * (size_t)n * (size_t)g_kvd);
    float *ry = malloc(sizeof(float) * (size_t)n * (size_t)g_kvd);
    int32_t slots[MAX_TOK];
    for (int j = 0; j < n; j++) slots[j] = a + j;
    bool same = true;
    for (int l = 0; l < g_m->hp.n_layer && same; l++)
        for (int kv = 0; kv < 2 && same; kv++) {
            const kv_layout *kl = kv_pool_layout(g_pool);
            backend_kv_load(g_b, kv_pool_memory(g_pool), kl, l, kv, x->blocks, slots, n, rx);
            backend_kv_load(g_b, kv_pool_memory(g_pool), kl, l, kv, y->blocks, slots, n, ry);
            same = memcmp(rx, ry, sizeof(float) * (size_t)n * (size_t)g_kvd) == 0;
        }
    free(rx);
    free(ry);
    return same;
}

/* ---------------------------------------------------------------- chunking */

/* The chunks of tokens [from, to) of a cut: their ends, relative to from. */
static int chunks_within(const int *ends, int n_ends, int from, int to, int *out) {
    int n = 0;
    for (int i = 0; i < n_ends; i++)
        if (ends[i] > from && ends[i] <= to) out[n++] = ends[i] - from;
    return n;
}

Test(blend, a_passage_cuts_the_same_wherever_it_sits) {
    uint8_t *kinds = cache_token_kinds(g_m->tok);
    cr_assert_not_null(kinds);
    int32_t *p, *a, *b;
    int np = tokenize(PASSAGE, &p);
    int na = tokenize("Answer from the documents below.\n\nDocument 2: ", &a);
    int nb = tokenize("Some other system prompt, much longer than the first one, about cats and "
                      "dogs and what they eat.\n\nDocument 5: ",
                      &b);
    int32_t x[MAX_TOK], y[MAX_TOK];
    memcpy(x, a, sizeof *a * (size_t)na);
    memcpy(x + na, p, sizeof *p * (size_t)np);
    memcpy(y, b, sizeof *b * (size_t)nb);
    memcpy(y + nb, p, sizeof *p * (size_t)np);
    cache_cdc_params prm = {.min_tokens = 8, .avg_tokens = 64, .max_tokens = 256};
    int ex[MAX_TOK], ey[MAX_TOK];
    int n_ex = cache_cdc_cut(x, na + np, kinds, g_m->hp.n_vocab, &prm, NULL, 0, ex, MAX_TOK);
    int n_ey = cache_cdc_cut(y, nb + np, kinds, g_m->hp.n_vocab, &prm, NULL, 0, ey, MAX_TOK);
    cr_assert_eq(ex[n_ex - 1], na + np);
    cr_assert_eq(ey[n_ey - 1], nb + np);
    int cx[MAX_TOK], cy[MAX_TOK];
    int kx = chunks_within(ex, n_ex, na, na + np, cx),
        ky = chunks_within(ey, n_ey, nb, nb + np, cy);
    cr_assert_geq(kx, 4, "the passage's line breaks cut it (%d chunks)", kx);
    /* a few cuts into the passage (the hash's 16 tokens and a line), the cuts are the same */
    int from = 0;
    while (from < kx && cx[from] < 32) from++;
    int shared = 0;
    for (int i = from; i < kx; i++)
        for (int j = 0; j < ky; j++) shared += cx[i] == cy[j];
    cr_expect_eq(shared, kx - from, "%d of the %d cuts past token 32 agree", shared, kx - from);
    cr_expect_geq(kx - from, 3);
    /* a chunk is never longer than max_tokens, nor shorter than min_tokens unless cut by a
     * control token or the end */
    int32_t flat[600];
    for (int i = 0; i < 600; i++) flat[i] = 1000 + i % 7;
    int ef[600];
    int nf = cache_cdc_cut(flat, 600, kinds, g_m->hp.n_vocab, &prm, NULL, 0, ef, 600);
    for (int i = 0, s = 0; i < nf; s = ef[i++]) {
        cr_expect_leq(ef[i] - s, prm.max_tokens);
        cr_expect(ef[i] - s >= prm.min_tokens || ef[i] == 600);
    }
    /* a control token stands alone */
    int32_t im_start = tokenizer_find(g_m->tok, "<|im_start|>");
    cr_assert_geq(im_start, 0);
    int32_t z[40];
    for (int i = 0; i < 40; i++) z[i] = 1000 + i;
    z[20] = im_start;
    int ez[40];
    int nz = cache_cdc_cut(z, 40, kinds, g_m->hp.n_vocab, &prm, NULL, 0, ez, 40);
    cr_assert_eq(nz, 3);
    cr_expect_eq(ez[0], 20);
    cr_expect_eq(ez[1], 21);
    /* a segment bound cuts before it and restarts the hash: the tokens from the bound on cut
     * as they do at the start of a prompt, whatever came before */
    int bounds[] = {7, 29};
    nz = cache_cdc_cut(z, 40, kinds, g_m->hp.n_vocab, &prm, bounds, 2, ez, 40);
    cr_assert_eq(nz, 5);
    cr_expect_eq(ez[0], 7);
    cr_expect_eq(ez[1], 20);
    cr_expect_eq(ez[2], 21);
    cr_expect_eq(ez[3], 29);
    cr_expect_eq(ez[4], 40);
    int ea[MAX_TOK], eb[MAX_TOK], bound_a = na, bound_b = nb;
    int n_ea = cache_cdc_cut(x, na + np, kinds, g_m->hp.n_vocab, &prm, &bound_a, 1, ea, MAX_TOK);
    int n_eb = cache_cdc_cut(y, nb + np, kinds, g_m->hp.n_vocab, &prm, &bound_b, 1, eb, MAX_TOK);
    int ka = chunks_within(ea, n_ea, na, na + np, cx),
        kb = chunks_within(eb, n_eb, nb, nb + np, cy);
    cr_assert_eq(ka, kb, "a passage that is a segment cuts alike after either prompt");
    for (int i = 0; i < ka; i++) cr_expect_eq(cx[i], cy[i]);
    /* ... also where a line break already cut there, and as it cuts alone */
    int32_t *l;
    int nl = tokenize("A line of some other text before it.\n", &l);
    int32_t w[MAX_TOK];
    memcpy(w, l, sizeof *l * (size_t)nl);
    memcpy(w + nl, p, sizeof *p * (size_t)np);
    int ew[MAX_TOK], ep[MAX_TOK];
    cache_cdc_params fine = {.min_tokens = 1, .avg_tokens = 4, .max_tokens = 256}; /* hash-cut */
    int n_ew = cache_cdc_cut(w, nl + np, kinds, g_m->hp.n_vocab, &fine, &nl, 1, ew, MAX_TOK);
    int n_ep = cache_cdc_cut(p, np, kinds, g_m->hp.n_vocab, &fine, NULL, 0, ep, MAX_TOK);
    cr_assert_gt(n_ep, 8);
    int kw = chunks_within(ew, n_ew, nl, nl + np, cx);
    cr_assert_eq(kw, n_ep);
    for (int i = 0; i < kw; i++) cr_expect_eq(cx[i], ep[i]);
    free(l);
    free(kinds);
    free(p);
    free(a);
    free(b);
}

/* ---------------------------------------------------------------- re-rotation */

Test(blend, rotated_k_moves_to_a_new_position_within_f16_rounding) {
    const model_hparams *hp = &g_m->hp;
    int d = hp->n_kv_head * hp->head_dim;
    float *k = malloc(sizeof(float) * (size_t)d), *moved = malloc(sizeof(float) * (size_t)d),
          *direct = malloc(sizeof(float) * (size_t)d);
    uint16_t *h = malloc(sizeof(uint16_t) * (size_t)d);
    srand(7);
    const int32_t cases[][2] = {{0, 5}, {17, 300}, {4000, -3900}, {123, -123}, {2000, 6000}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        int32_t p = cases[c][0], delta = cases[c][1], pd = p + delta;
        for (int i = 0; i < d; i++) k[i] = (float)rand() / RAND_MAX * 4 - 2;
        memcpy(direct, k, sizeof(float) * (size_t)d);
        backend_rope(g_b, direct, &pd, 1, hp->n_kv_head, hp->head_dim, &g_m->rope);
        /* rotated at p, stored as f16 (the pool and the records), moved by delta */
        memcpy(moved, k, sizeof(float) * (size_t)d);
        backend_rope(g_b, moved, &p, 1, hp->n_kv_head, hp->head_dim, &g_m->rope);
        fp32_to_fp16_row(moved, h, d);
        fp16_to_fp32_row(h, moved, d);
        backend_rope(g_b, moved, &delta, 1, hp->n_kv_head, hp->head_dim, &g_m->rope);
        for (int i = 0; i < d; i++)
            cr_expect(fabsf(moved[i] - direct[i]) <= 2e-3f, "p %d delta %d dim %d: %g vs %g", p,
                      delta, i, moved[i], direct[i]);
    }
    free(k);
    free(moved);
    free(direct);
    free(h);
}

/* ---------------------------------------------------------------- the fusor */

/* A question after a passage computed after another prefix: the passage's KV comes from a
 * context where it sat elsewhere. */
typedef struct scene {
    int32_t *ctx_a, *ctx_b;
    int n_a, n_b; /* prompts */
    int x_a, x_b; /* where the passage starts in each */
    int n_x;      /* passage tokens */
} scene;

static void scene_make(scene *sc) {
    int32_t *p, *pre_a, *pre_b, *q;
    sc->n_x = tokenize(PASSAGE, &p);
    int na = tokenize("You answer questions.\n\n", &pre_a);
    int nb = tokenize("Here are some documents about software freedom, in no order:\n\n", &pre_b);
    int nq = tokenize("\nQuestion: what does the license guarantee?", &q);
    sc->ctx_a = malloc(sizeof(int32_t) * MAX_TOK);
    sc->ctx_b = malloc(sizeof(int32_t) * MAX_TOK);
    memcpy(sc->ctx_a, pre_a, sizeof(int32_t) * (size_t)na);
    memcpy(sc->ctx_a + na, p, sizeof(int32_t) * (size_t)sc->n_x);
    sc->n_a = na + sc->n_x;
    memcpy(sc->ctx_b, pre_b, sizeof(int32_t) * (size_t)nb);
    memcpy(sc->ctx_b + nb, p, sizeof(int32_t) * (size_t)sc->n_x);
    memcpy(sc->ctx_b + nb + sc->n_x, q, sizeof(int32_t) * (size_t)nq);
    sc->n_b = nb + sc->n_x + nq;
    sc->x_a = na;
    sc->x_b = nb;
    free(p);
    free(pre_a);
    free(pre_b);
    free(q);
}

static void scene_free(scene *sc) {
    free(sc->ctx_a);
    free(sc->ctx_b);
}

/* Runs prompt b with the passage blended from rec at ratio under policy, as the planner and
 * the engine set it up; logits in out; counts in *be. */
static void run_policy(const scene *sc, content_rec *rec, float ratio, blend_policy policy,
                       kv_seq *s, float *out, blend_entry *be) {
    kv_seq_init(s);
    blend_span sp = {.slot = sc->x_b, .n = sc->n_x, .off = 0, .rec = rec};
    blend_force_run_starts(&sp, 1, policy, ratio);
    *be = (blend_entry){.entry = 0,
                        .spans = &sp,
                        .n_spans = 1,
                        .ratio = ratio,
                        .only_forced = policy == BLEND_POLICY_LEGOLINK};
    run(s, sc->ctx_b, sc->n_b, NULL, be, 1);
    memcpy(out, g_logits, sizeof(float) * (size_t)g_m->hp.n_vocab);
}

static void run_blended(const scene *sc, content_rec *rec, float ratio, kv_seq *s, float *out,
                        blend_entry *be) {
    run_policy(sc, rec, ratio, BLEND_POLICY_HKVD, s, out, be);
}

Test(blend, ratio_one_is_a_full_prefill_bit_for_bit) {
    scene sc;
    scene_make(&sc);
    size_t nv = (size_t)g_m->hp.n_vocab;
    kv_seq a, full, bl;
    kv_seq_init(&a);
    kv_seq_init(&full);
    run(&a, sc.ctx_a, sc.n_a, NULL, NULL, 0);
    content_rec *rec = export_rec(&a, sc.x_a, sc.n_x);
    run(&full, sc.ctx_b, sc.n_b, NULL, NULL, 0);
    float *ref = malloc(sizeof(float) * nv), *got = malloc(sizeof(float) * nv);
    memcpy(ref, g_logits, sizeof(float) * nv);
    blend_entry be;
    for (int p = 0; p < BLEND_POLICY_COUNT; p++) {
        run_policy(&sc, rec, 1.0f, (blend_policy)p, &bl, got, &be);
        cr_expect_eq(be.n_reused, sc.n_x);
        cr_expect_eq(be.n_recomputed, sc.n_x);
        cr_expect(memcmp(ref, got, sizeof(float) * nv) == 0, "%s: ratio 1 logits differ",
                  blend_policy_name((blend_policy)p));
        cr_expect(same_kv(&full, &bl, 0, sc.n_b), "%s: ratio 1 KV differs from a full prefill",
                  blend_policy_name((blend_policy)p));
        kv_seq_release(g_pool, &bl);
    }
    /* full reuse takes the other context's KV as is: not the same */
    run_blended(&sc, rec, 0.0f, &bl, got, &be);
    cr_expect_eq(be.n_recomputed, 0);
    cr_expect(memcmp(ref, got, sizeof(float) * nv) != 0, "full reuse equals full prefill");
    kv_seq_release(g_pool, &bl);
    kv_seq_release(g_pool, &a);
    kv_seq_release(g_pool, &full);
    content_rec_unref(rec);
    free(ref);
    free(got);
    scene_free(&sc);
}

/* Prompt b computed in full into *full: its last token's logits in *ref; *got has room for as
 * many (both malloc'd). */
static size_t full_prefill(const scene *sc, kv_seq *full, float **ref, float **got) {
    size_t nv = (size_t)g_m->hp.n_vocab;
    kv_seq_init(full);
    run(full, sc->ctx_b, sc->n_b, NULL, NULL, 0);
    *ref = malloc(sizeof(float) * nv);
    *got = malloc(sizeof(float) * nv);
    memcpy(*ref, g_logits, sizeof(float) * nv);
    return nv;
}

/* The passage's exact KV (exported from the full prefill of the same prompt) with the KV of the
 * listed tokens spoiled at every layer. */
static content_rec *spoiled_rec(const scene *sc, const kv_seq *full, const int *bad, int n_bad) {
    content_rec *rec = export_rec(full, sc->x_b, sc->n_x);
    for (int l = 0; l < g_m->hp.n_layer; l++)
        for (int kv = 0; kv < 2; kv++)
            for (int i = 0; i < n_bad; i++) {
                uint16_t *row = (uint16_t *)content_rec_rows(rec, l, kv) + (size_t)bad[i] * g_kvd;
                for (int j = 0; j < g_kvd; j++)
                    row[j] = fp32_to_fp16(fp16_to_fp32(row[j]) + (j % 2 ? 3.0f : -3.0f));
            }
    return rec;
}

Test(blend, selection_recomputes_the_tokens_whose_kv_deviates) {
    scene sc;
    scene_make(&sc);
    kv_seq full, bl;
    float *ref, *got;
    size_t nv = full_prefill(&sc, &full, &ref, &got);
    /* the passage's own KV from the same prompt (exact), with a few tokens' KV spoiled */
    const int bad[] = {3, 11, 20, 31, 42};
    const int n_bad = (int)(sizeof bad / sizeof bad[0]);
    content_rec *rec = spoiled_rec(&sc, &full, bad, n_bad);
    /* full reuse serves the spoiled KV: the answer changes */
    blend_entry be;
    run_blended(&sc, rec, 0.0f, &bl, got, &be);
    cr_expect(memcmp(ref, got, sizeof(float) * nv) != 0);
    kv_seq_release(g_pool, &bl);
    /* a ratio that recomputes about n_bad tokens at the last layers finds exactly those: the
     * rest is exact, so the result is the full prefill's, bit for bit */
    float ratio = (float)(n_bad + 1) / (float)sc.n_x;
    cr_assert_geq(blend_rows_at_layer(ratio, sc.n_x, g_m->hp.n_layer - 1), n_bad);
    run_blended(&sc, rec, ratio, &bl, got, &be);
    cr_expect_lt(be.n_recomputed, sc.n_x / 4);
    cr_expect(memcmp(ref, got, sizeof(float) * nv) == 0,
              "the spoiled tokens were not all recomputed");
    cr_expect(same_kv(&full, &bl, 0, sc.n_b));
    kv_seq_release(g_pool, &bl);
    kv_seq_release(g_pool, &full);
    content_rec_unref(rec);
    free(ref);
    free(got);
    scene_free(&sc);
}

Test(blend, legolink_recomputes_the_first_tokens_of_a_run_and_nothing_else) {
    scene sc;
    scene_make(&sc);
    kv_seq full, bl;
    float *ref, *got;
    size_t nv = full_prefill(&sc, &full, &ref, &got);
    /* a budget of 6 tokens on one run: its first 6 */
    float ratio = 6.0f / (float)sc.n_x;
    blend_entry be;
    const int head[] = {0, 1, 2, 5};
    content_rec *rec = spoiled_rec(&sc, &full, head, 4);
    run_policy(&sc, rec, ratio, BLEND_POLICY_LEGOLINK, &bl, got, &be);
    cr_expect_eq(be.n_recomputed, 6, "%d", be.n_recomputed);
    cr_expect(memcmp(ref, got, sizeof(float) * nv) == 0, "the run's first tokens were reused");
    cr_expect(same_kv(&full, &bl, 0, sc.n_b));
    kv_seq_release(g_pool, &bl);
    content_rec_unref(rec);
    /* spoiled past the run's start: LegoLink does not look there */
    const int mid[] = {20};
    rec = spoiled_rec(&sc, &full, mid, 1);
    run_policy(&sc, rec, ratio, BLEND_POLICY_LEGOLINK, &bl, got, &be);
    cr_expect_eq(be.n_recomputed, 6, "%d", be.n_recomputed);
    cr_expect(memcmp(ref, got, sizeof(float) * nv) != 0);
    kv_seq_release(g_pool, &bl);
    content_rec_unref(rec);
    kv_seq_release(g_pool, &full);
    free(ref);
    free(got);
    scene_free(&sc);
}

Test(blend, hybrid_forces_the_run_start_and_ranks_the_rest) {
    scene sc;
    scene_make(&sc);
    kv_seq full, bl;
    float *ref, *got;
    size_t nv = full_prefill(&sc, &full, &ref, &got);
    /* spoiled at the run's start and twice past the hybrid's BLEND_HYBRID_K forced tokens */
    const int bad[] = {0, 3, 20, 31};
    content_rec *rec = spoiled_rec(&sc, &full, bad, 4);
    float ratio = (float)(BLEND_HYBRID_K + 3) / (float)sc.n_x;
    blend_entry be;
    /* LegoLink's budget stops short of 20 and 31; the hybrid's HKVD part finds them */
    run_policy(&sc, rec, ratio, BLEND_POLICY_LEGOLINK, &bl, got, &be);
    cr_expect(memcmp(ref, got, sizeof(float) * nv) != 0);
    kv_seq_release(g_pool, &bl);
    run_policy(&sc, rec, ratio, BLEND_POLICY_HYBRID, &bl, got, &be);
    cr_expect_lt(be.n_recomputed, sc.n_x / 3);
    cr_expect(memcmp(ref, got, sizeof(float) * nv) == 0, "a spoiled token was not recomputed");
    cr_expect(same_kv(&full, &bl, 0, sc.n_b));
    kv_seq_release(g_pool, &bl);
    content_rec_unref(rec);
    kv_seq_release(g_pool, &full);
    free(ref);
    free(got);
    scene_free(&sc);
}

/* Spans over records computed at pos0 (one layer, one channel: only positions matter here). */
static void make_spans(blend_span *sp, content_rec **recs, const int *slot, const int *n,
                       const int *pos0, int count) {
    cache_key key = {{0}};
    for (int i = 0; i < count; i++) {
        recs[i] = content_rec_create(1, 1, n[i], &key, &key, pos0[i]);
        cr_assert_not_null(recs[i]);
        sp[i] = (blend_span){.slot = slot[i], .n = n[i], .rec = recs[i]};
    }
}

Test(blend, run_starts_are_where_the_earlier_context_breaks) {
    /* A and B: one run of 40 (adjacent in the prompt and where they were computed); C: 5 tokens
     * computed elsewhere; D: adjacent to nothing in the prompt. 85 reused tokens. */
    const int slot[] = {10, 30, 50, 60}, n[] = {20, 20, 5, 40}, pos0[] = {100, 120, 7, 300};
    blend_span sp[4];
    content_rec *recs[4];
    make_spans(sp, recs, slot, n, pos0, 4);
    /* 26 tokens (30%): k = 11 spends it (11 + 5 + 11 = 27; 10 would give 25) */
    cr_expect_eq(blend_force_run_starts(sp, 4, BLEND_POLICY_LEGOLINK, 0.3f), 11);
    int want[][4] = {{11, 0, 5, 11}, {8, 0, 5, 8}, {20, 16, 5, 36}, {20, 20, 5, 40}};
    for (int i = 0; i < 4; i++) cr_expect_eq(sp[i].forced, want[0][i], "span %d", i);
    /* the hybrid forces at most BLEND_HYBRID_K of each run */
    cr_expect_eq(blend_force_run_starts(sp, 4, BLEND_POLICY_HYBRID, 0.3f), BLEND_HYBRID_K);
    for (int i = 0; i < 4; i++) cr_expect_eq(sp[i].forced, want[1][i], "span %d", i);
    /* a k past a span's end goes on in the next span of its run */
    cr_expect_eq(blend_force_run_starts(sp, 4, BLEND_POLICY_LEGOLINK, 0.9f), 36);
    for (int i = 0; i < 4; i++) cr_expect_eq(sp[i].forced, want[2][i], "span %d", i);
    /* ratio 1 forces everything, under LegoLink and the hybrid alike */
    for (int p = BLEND_POLICY_LEGOLINK; p <= BLEND_POLICY_HYBRID; p++) {
        blend_force_run_starts(sp, 4, (blend_policy)p, 1.0f);
        for (int i = 0; i < 4; i++) cr_expect_eq(sp[i].forced, want[3][i], "span %d", i);
    }
    /* HKVD, and ratio 0, force nothing */
    cr_expect_eq(blend_force_run_starts(sp, 4, BLEND_POLICY_HKVD, 0.5f), 0);
    for (int i = 0; i < 4; i++) cr_expect_eq(sp[i].forced, 0);
    cr_expect_eq(blend_force_run_starts(sp, 4, BLEND_POLICY_LEGOLINK, 0.0f), 0);
    for (int i = 0; i < 4; i++) cr_expect_eq(sp[i].forced, 0);
    cr_expect_str_eq(blend_policy_name(BLEND_POLICY_HYBRID), "hybrid");
    cr_expect_eq(blend_policy_parse("legolink"), BLEND_POLICY_LEGOLINK);
    cr_expect_eq(blend_policy_parse("LegoLink"), -1);
    for (int i = 0; i < 4; i++) content_rec_unref(recs[i]);
}

Test(blend, spans_that_do_not_fit_are_refused) {
    scene sc;
    scene_make(&sc);
    cache_key key = {{0}};
    content_rec *wrong = content_rec_create(g_m->hp.n_layer - 1, g_kvd, sc.n_x, &key, &key, 0);
    content_rec *right = content_rec_create(g_m->hp.n_layer, g_kvd, sc.n_x, &key, &key, 0);
    int32_t pos[MAX_TOK];
    for (int i = 0; i < sc.n_b; i++) pos[i] = i;
    kv_seq s;
    kv_seq_init(&s);
    batch_seq bs = {.seq = &s, .n_tok = sc.n_b, .tokens = sc.ctx_b, .pos = pos, .kv_start = 0};
    forward_hooks h;
    kv_error err = {{0}};
    blend_span sp = {.slot = sc.x_b, .n = sc.n_x, .rec = wrong};
    blend_entry be = {.entry = 0, .spans = &sp, .n_spans = 1, .ratio = 0.15f};
    cr_expect_eq(blend_fusor_begin(g_fus, &bs, 1, &be, 1, &h, &err), -1); /* another model */
    sp = (blend_span){.slot = sc.x_b, .n = sc.n_x + 1, .rec = right};
    cr_expect_eq(blend_fusor_begin(g_fus, &bs, 1, &be, 1, &h, &err), -1); /* past the record */
    sp = (blend_span){.slot = sc.n_b - sc.n_x, .n = sc.n_x, .rec = right};
    cr_expect_eq(blend_fusor_begin(g_fus, &bs, 1, &be, 1, &h, &err), -1); /* the last token */
    sp = (blend_span){.slot = sc.x_b, .n = sc.n_x, .rec = right};
    cr_expect_eq(blend_fusor_begin(g_fus, &bs, 1, &be, 1, &h, &err), 0, "%s", err.msg);
    content_rec_unref(wrong);
    content_rec_unref(right);
    scene_free(&sc);
}
