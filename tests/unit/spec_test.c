/* Speculation from the context: the draft index proposes what followed the longest earlier
 * match of the sequence's last tokens (or the prediction's next tokens); the controller grows,
 * shrinks and switches off the draft length; the sampler's accept/resample rule keeps the
 * distribution it samples from (a chi-square test over many seeds); and a verify step's
 * rollback on the real model leaves the KV pool as a plain decode step leaves it, never
 * writing a block shared with another sequence. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model/sampler.h"
#include "server/engine/spec.h"
#include "tests/unit/model_fixture.h"

/* ---------------------------------------------------------------- the index */

static int draft_own(const int32_t *toks, int n, int max, int32_t *out, int *len) {
    spec_index ix;
    spec_index_init(&ix);
    cr_assert_eq(spec_index_add(&ix, toks, n), 0);
    int k = spec_index_draft(&ix, toks, toks, n, n - 1, SPEC_MIN_CONTEXT, max, out, len);
    spec_index_free(&ix);
    return k;
}

Test(spec, the_longest_earlier_match_proposes_what_followed_it) {
    /* "5 6 7" occurs twice before the end; the occurrence after "4" matches 4 tokens */
    int32_t toks[] = {1, 5, 6, 7, 20, 21, 22, 4, 5, 6, 7, 30, 31, 32, 33, 9, 9, 4, 5, 6, 7};
    int n = sizeof toks / sizeof *toks, len = 0;
    int32_t out[SPEC_MAX_DRAFT];
    int k = draft_own(toks, n, 3, out, &len);
    cr_assert_eq(k, 3);
    cr_assert_eq(len, 4);
    cr_assert_eq(out[0], 30);
    cr_assert_eq(out[1], 31);
    cr_assert_eq(out[2], 32);
}

Test(spec, of_equally_long_matches_the_most_recent_wins) {
    int32_t toks[] = {8, 5, 6, 7, 20, 21, 8, 5, 6, 7, 40, 41, 9, 5, 6, 7};
    int n = sizeof toks / sizeof *toks, len = 0;
    int32_t out[SPEC_MAX_DRAFT];
    cr_assert_eq(draft_own(toks, n, 2, out, &len), 2);
    cr_assert_eq(len, 3);
    cr_assert_eq(out[0], 40);
}

Test(spec, short_matches_and_the_query_itself_propose_nothing) {
    /* "6 7" repeats but only 2 tokens long: under SPEC_MIN_CONTEXT */
    int32_t toks[] = {1, 6, 7, 8, 2, 3, 6, 7};
    int32_t out[SPEC_MAX_DRAFT];
    int len = 0;
    cr_assert_eq(draft_own(toks, 8, 4, out, &len), 0);
    /* no repetition at all */
    int32_t plain[] = {1, 2, 3, 4, 5, 6, 7, 8, 9};
    cr_assert_eq(draft_own(plain, 9, 4, out, &len), 0);
    /* too short to hash */
    cr_assert_eq(draft_own(plain, 1, 4, out, &len), 0);
}

Test(spec, a_proposal_stops_at_the_end_of_what_was_indexed) {
    /* a period-3 pattern: the longest match ends 3 tokens back, so 3 tokens follow it */
    int32_t toks[] = {1, 2, 3, 1, 2, 3, 1, 2, 3};
    int32_t out[SPEC_MAX_DRAFT];
    int len = 0;
    int k = draft_own(toks, 9, 8, out, &len);
    cr_assert_eq(k, 3);
    cr_assert_eq(len, 6);
    cr_assert_eq(out[0], 1);
    cr_assert_eq(out[2], 3);
}

Test(spec, indexing_in_steps_equals_indexing_at_once) {
    enum { N = 3000 };
    int32_t *toks = malloc(sizeof *toks * N);
    uint32_t x = 12345;
    for (int i = 0; i < N; i++) {
        x = x * 1664525u + 1013904223u;
        toks[i] = (int32_t)(x >> 24) % 50; /* a small alphabet: many chains and collisions */
    }
    spec_index a, b;
    spec_index_init(&a);
    spec_index_init(&b);
    cr_assert_eq(spec_index_add(&a, toks, N), 0);
    for (int n = 1; n <= N; n += 7) cr_assert_eq(spec_index_add(&b, toks, n), 0);
    cr_assert_eq(spec_index_add(&b, toks, N), 0);
    for (int n = 50; n <= N; n += 97) {
        int32_t oa[SPEC_MAX_DRAFT], ob[SPEC_MAX_DRAFT];
        int la, lb;
        int ka = spec_index_draft(&a, toks, toks, n, n - 1, SPEC_MIN_CONTEXT, 8, oa, &la);
        int kb = spec_index_draft(&b, toks, toks, n, n - 1, SPEC_MIN_CONTEXT, 8, ob, &lb);
        cr_assert_eq(ka, kb);
        cr_assert_eq(la, lb);
        cr_assert_eq(memcmp(oa, ob, sizeof *oa * (size_t)ka), 0);
        /* whatever is proposed follows a real match of the query's last la tokens */
        for (int i = 0; i < ka; i++) cr_assert(oa[i] >= 0 && oa[i] < 50);
    }
    spec_index_free(&a);
    spec_index_free(&b);
    free(toks);
}

Test(spec, a_prediction_drafts_its_start_then_where_the_output_matches_it) {
    int32_t pred[] = {10, 11, 12, 13, 14, 15, 16, 17};
    spec_seq ss;
    cr_assert_eq(spec_seq_init(&ss, true, pred, 8), 0);
    int32_t out[SPEC_MAX_DRAFT];
    bool from_pred = false;
    /* prompt 1 2 3, output 10 11: the prediction's beginning */
    int32_t h1[] = {1, 2, 3, 10, 11};
    int k = spec_propose(&ss, h1, 5, 2, 4, out, &from_pred);
    cr_assert_eq(k, 4);
    cr_assert(from_pred);
    cr_assert_eq(out[0], 12);
    cr_assert_eq(out[3], 15);
    /* the output left it (99) and came back to it (13 14): what follows 13 14 there */
    int32_t h2[] = {1, 2, 3, 10, 99, 13, 14};
    k = spec_propose(&ss, h2, 7, 4, 8, out, &from_pred);
    cr_assert_eq(k, 3);
    cr_assert(from_pred);
    cr_assert_eq(out[0], 15);
    cr_assert_eq(out[2], 17);
    /* nothing in the prediction: the sequence's own tokens, as many as the match is long less
     * one (a 3-token match: 2) */
    int32_t h3[] = {7, 8, 9, 50, 51, 7, 8, 9};
    k = spec_propose(&ss, h3, 8, 3, 8, out, &from_pred);
    cr_assert_eq(k, 2);
    cr_assert(!from_pred);
    cr_assert_eq(out[0], 50);
    spec_seq_free(&ss);
}

/* ---------------------------------------------------------------- the controller */

Test(spec, draft_length_grows_on_full_acceptance_and_shrinks_on_rejection) {
    spec_ctl c;
    spec_ctl_init(&c, true);
    int k = spec_ctl_len(&c);
    cr_assert_gt(k, 0);
    spec_ctl_update(&c, k, k);
    cr_assert_gt(spec_ctl_len(&c), k);
    for (int i = 0; i < 5; i++) spec_ctl_update(&c, spec_ctl_len(&c), spec_ctl_len(&c));
    cr_assert_eq(spec_ctl_len(&c), SPEC_MAX_DRAFT);
    spec_ctl_update(&c, SPEC_MAX_DRAFT, 2);
    cr_assert_eq(spec_ctl_len(&c), 3);
    spec_ctl_init(&c, false);
    cr_assert_eq(spec_ctl_len(&c), 0, "a request that opted out never drafts");
}

/* With its pending token a sequence's draft fills whole 4-row tiles: 3 + 1 rows, then 7 + 1; and
 * a step's draft rows are cut so that all its rows do too. */
Test(spec, drafts_fill_whole_row_tiles) {
    spec_ctl c;
    spec_ctl_init(&c, true);
    int seen[4], n = 0;
    for (int i = 0; i < 4; i++) {
        seen[n++] = spec_ctl_len(&c);
        spec_ctl_update(&c, seen[n - 1], seen[n - 1]);
    }
    for (int i = 0; i < n; i++)
        cr_expect_eq((seen[i] + 1) % SPEC_ROW_TILE, 0, "draft %d of length %d", i, seen[i]);
    cr_expect_eq(seen[n - 1], SPEC_MAX_DRAFT);
    for (int n_dec = 1; n_dec < SPEC_MAX_BATCH; n_dec++) {
        int d = spec_step_drafts(n_dec);
        cr_expect(d >= 0 && d <= SPEC_STEP_DRAFTS, "%d sequences: %d draft rows", n_dec, d);
        cr_expect_eq((n_dec + d) % SPEC_ROW_TILE, 0, "%d sequences: %d draft rows", n_dec, d);
    }
    cr_expect_eq(spec_step_drafts(1), SPEC_MAX_DRAFT);
}

Test(spec, poor_acceptance_switches_drafting_off_and_it_retries_later) {
    spec_ctl c;
    spec_ctl_init(&c, true);
    for (int i = 0; i < 8; i++) spec_ctl_update(&c, spec_ctl_len(&c), 0);
    int off = 0;
    while (spec_ctl_len(&c) == 0 && off < 10000) off++;
    cr_assert_eq(off, SPEC_OFF_STEPS);
    /* failing again: off twice as long */
    for (int i = 0; i < 8; i++) spec_ctl_update(&c, spec_ctl_len(&c), 0);
    off = 0;
    while (spec_ctl_len(&c) == 0 && off < 10000) off++;
    cr_assert_eq(off, 2 * SPEC_OFF_STEPS);
    /* drafts that pay keep it on */
    for (int i = 0; i < 40; i++) {
        int k = spec_ctl_len(&c);
        cr_assert_gt(k, 0);
        spec_ctl_update(&c, k, k);
    }
}

/* ---------------------------------------------------------------- accept/resample */

/* Draws n tokens with seeds 0..n-1 verifying draft, tallies them, and returns the chi-square
 * statistic against the distribution sampler_sample draws from (estimated from its own draws
 * would be circular: p is given). accepted counts the draws that kept the draft. */
static double chi_square(const sampler_params *sp, const float *logits, int n_vocab,
                         const double *p, int32_t draft, int n, int *accepted) {
    int *count = calloc((size_t)n_vocab, sizeof *count);
    float *work = malloc(sizeof *work * (size_t)n_vocab);
    *accepted = 0;
    for (int s = 0; s < n; s++) {
        sampler_params q = *sp;
        q.seed = (uint64_t)s;
        kv_error err = {{0}};
        sampler *smp = sampler_create(&q, n_vocab, &err);
        cr_assert_not_null(smp, "%s", err.msg);
        memcpy(work, logits, sizeof *work * (size_t)n_vocab);
        bool acc = false;
        int32_t t = sampler_sample_draft(smp, work, NULL, 0, draft, NULL, &acc);
        cr_assert(t >= 0 && t < n_vocab);
        if (acc) {
            cr_assert_eq(t, draft);
            (*accepted)++;
        }
        count[t]++;
        sampler_destroy(smp);
    }
    double chi = 0;
    for (int i = 0; i < n_vocab; i++) {
        if (p[i] == 0) {
            cr_assert_eq(count[i], 0, "token %d is outside the distribution", i);
            continue;
        }
        double want = p[i] * n;
        chi += (count[i] - want) * (count[i] - want) / want;
    }
    free(count);
    free(work);
    return chi;
}

Test(spec, verified_sampling_keeps_the_distribution) {
    enum { V = 8, N = 40000 };
    const float logits[V] = {2.0f, 1.5f, 1.0f, 0.5f, 0.0f, -0.5f, -1.0f, -3.0f};
    sampler_params sp;
    sampler_params_default(&sp);
    sp.temperature = 0.8f;
    double p[V], z = 0;
    for (int i = 0; i < V; i++) z += (p[i] = exp(logits[i] / 0.8));
    for (int i = 0; i < V; i++) p[i] /= z;
    /* chi-square with 7 degrees of freedom: 24.32 is its 0.999 quantile */
    int acc;
    double chi_plain = chi_square(&sp, logits, V, p, -1, N, &acc);
    cr_assert_lt(chi_plain, 24.32, "plain sampling: chi-square %g", chi_plain);
    cr_assert_eq(acc, 0);
    int32_t drafts[] = {0, 3, 7};
    for (int d = 0; d < 3; d++) {
        double chi = chi_square(&sp, logits, V, p, drafts[d], N, &acc);
        cr_assert_lt(chi, 24.32, "draft %d: chi-square %g", drafts[d], chi);
        /* accepted about p(draft) of the time (binomial, 5 standard deviations) */
        double want = p[drafts[d]] * N, sd = sqrt(N * p[drafts[d]] * (1 - p[drafts[d]]));
        cr_assert(fabs(acc - want) < 5 * sd + 1, "draft %d kept %d times, expected %.0f", drafts[d],
                  acc, want);
    }
}

Test(spec, verified_sampling_keeps_the_truncated_distribution) {
    enum { V = 8, N = 40000 };
    const float logits[V] = {2.0f, 1.5f, 1.0f, 0.5f, 0.0f, -0.5f, -1.0f, -3.0f};
    sampler_params sp;
    sampler_params_default(&sp);
    sp.temperature = 1.0f;
    sp.top_k = 4; /* tokens 4..7 are out: a draft among them is never kept */
    double p[V] = {0}, z = 0;
    for (int i = 0; i < 4; i++) z += (p[i] = exp(logits[i]));
    for (int i = 0; i < 4; i++) p[i] /= z;
    int acc;
    /* 3 degrees of freedom: 16.27 is its 0.999 quantile */
    double chi = chi_square(&sp, logits, V, p, 6, N, &acc);
    cr_assert_lt(chi, 16.27, "chi-square %g", chi);
    cr_assert_eq(acc, 0);
    chi = chi_square(&sp, logits, V, p, 1, N, &acc);
    cr_assert_lt(chi, 16.27, "chi-square %g", chi);
}

Test(spec, greedy_verification_keeps_the_argmax_only) {
    const float logits[4] = {0.1f, 3.0f, 2.9f, -1.0f};
    sampler_params sp;
    sampler_params_default(&sp);
    sp.temperature = 0;
    kv_error err = {{0}};
    sampler *smp = sampler_create(&sp, 4, &err);
    cr_assert_not_null(smp);
    for (int32_t d = -1; d < 4; d++) {
        float w[4];
        memcpy(w, logits, sizeof w);
        bool acc = true;
        cr_assert_eq(sampler_sample_draft(smp, w, NULL, 0, d, NULL, &acc), 1);
        cr_assert_eq(acc, d == 1);
    }
    sampler_destroy(smp);
}

/* ---------------------------------------------------------------- rollback on the model */

/* s's slots [slot, slot + n) as bytes (malloc'd): whole blocks' worth of host rows. */
static uint8_t *rows_of(kv_pool *p, const kv_seq *s, int slot, int n, size_t *bytes) {
    const kv_layout *l = kv_pool_layout(p);
    int nb = (n + l->block_tokens - 1) / l->block_tokens;
    *bytes = kv_layout_block_bytes(l) * (size_t)nb;
    uint8_t *h = calloc(1, *bytes);
    kv_error err = {{0}};
    cr_assert_eq(kv_seq_export_rows(p, s, slot, n, h, 0, &err), 0, "%s", err.msg);
    return h;
}

static void forward_rows(model_fixture *fx, kv_seq *s, const int32_t *toks, int start, int n,
                         bool all, float *logits) {
    int32_t pos[64];
    for (int i = 0; i < n; i++) pos[i] = start + i;
    kv_error err = {{0}};
    cr_assert_eq(kv_seq_reserve(fx->pool, s, start + n, &err), 0, "%s", err.msg);
    batch_seq bs = {
        .seq = s, .n_tok = n, .tokens = toks, .pos = pos, .kv_start = start, .all_logits = all};
    cr_assert_eq(model_forward(fx->f, &bs, 1, NULL, logits, &err), all ? n : 1, "%s", err.msg);
}

/* A prompt shared by two sequences (a fork: its partial last block is shared); one of them runs
 * a verify step of 8 draft tokens across a block boundary, keeps 2 and rolls the rest back. The
 * pool then holds what a plain decode of the same 3 tokens leaves: the same free blocks and
 * reference counts, the other sequence's KV unchanged bit for bit (the shared block was copied,
 * never written), and the kept rows' KV and logits equal to one-token steps'. */
Test(spec, rollback_leaves_the_pool_as_a_plain_decode_does) {
    model_fixture fx;
    model_fixture_open(&fx, 2, 1024, 64, 2);
    size_t nv = (size_t)fx.m->hp.n_vocab;
    float *logits = malloc(sizeof(float) * nv * 16), *one = malloc(sizeof(float) * nv);
    enum { NP = 44, ND = 8, KEEP = 2 };
    int32_t prompt[NP];
    for (int i = 0; i < NP; i++) prompt[i] = 200 + 37 * i % 3000;
    kv_seq a, b, c;
    kv_seq_init(&a);
    kv_seq_init(&b);
    kv_seq_init(&c);
    kv_error err = {{0}};
    forward_rows(&fx, &a, prompt, 0, NP, false, logits);
    cr_assert_eq(kv_seq_fork(fx.pool, &b, &a, NP, &err), 0);
    cr_assert_eq(kv_seq_fork(fx.pool, &c, &a, NP, &err), 0);
    int32_t shared = a.blocks[NP / 16];
    cr_assert_eq(kv_pool_block_refs(fx.pool, shared), 3);
    size_t nbytes;
    uint8_t *b_before = rows_of(fx.pool, &b, 0, NP, &nbytes);

    /* the verify step: pending token + 8 drafts at slots 44..52, across blocks 2 and 3 */
    int32_t step[1 + ND] = {901, 902, 903, 904, 905, 906, 907, 908, 909};
    int64_t free0 = kv_pool_free_blocks(fx.pool);
    forward_rows(&fx, &a, step, NP, 1 + ND, true, logits);
    cr_assert_neq(a.blocks[NP / 16], shared, "the shared block was written in place");
    cr_assert_eq(kv_pool_free_blocks(fx.pool), free0 - 2, "a copy and one new block");
    kv_seq_truncate(fx.pool, &a, NP + 1 + KEEP);

    /* the plain path: the same three tokens one step at a time on c */
    for (int i = 0; i <= KEEP; i++) {
        forward_rows(&fx, &c, step + i, NP + i, 1, false, one);
        cr_assert_eq(memcmp(one, logits + (size_t)i * nv, sizeof(float) * nv), 0,
                     "row %d's logits differ from a one-token step's", i);
    }
    cr_assert_eq(a.n_tokens, c.n_tokens);
    cr_assert_eq(a.n_blocks, c.n_blocks);
    cr_assert_eq(kv_pool_free_blocks(fx.pool), free0 - 2, "a and c hold one private block each");
    cr_assert_eq(kv_pool_block_refs(fx.pool, shared), 1, "b alone holds the prompt's last block");
    for (int i = 0; i < NP / 16; i++)
        cr_assert_eq(kv_pool_block_refs(fx.pool, b.blocks[i]), 3, "full prompt block %d", i);
    for (int i = NP / 16; i < a.n_blocks; i++)
        cr_assert_eq(kv_pool_block_refs(fx.pool, a.blocks[i]), 1);
    size_t n1, n2;
    uint8_t *ka = rows_of(fx.pool, &a, 0, a.n_tokens, &n1);
    uint8_t *kc = rows_of(fx.pool, &c, 0, c.n_tokens, &n2);
    cr_assert_eq(memcmp(ka, kc, n1), 0, "the kept rows' KV differs from one-token steps'");
    uint8_t *b_after = rows_of(fx.pool, &b, 0, NP, &n1);
    cr_assert_eq(memcmp(b_before, b_after, nbytes), 0, "a draft wrote into b's KV");

    /* a block another sequence holds is refused outright, never written */
    batch_seq bad = {.seq = &b,
                     .n_tok = 1,
                     .tokens = step,
                     .pos = (int32_t[]){NP},
                     .kv_start = NP,
                     .all_logits = true};
    kv_seq d;
    kv_seq_init(&d);
    cr_assert_eq(kv_seq_fork(fx.pool, &d, &b, NP, &err), 0);
    cr_assert_eq(model_forward(fx.f, &bad, 1, NULL, logits, &err), -1);
    cr_assert(strstr(err.msg, "shared"), "%s", err.msg);

    kv_seq_release(fx.pool, &a);
    kv_seq_release(fx.pool, &b);
    kv_seq_release(fx.pool, &c);
    kv_seq_release(fx.pool, &d);
    cr_assert_eq(kv_pool_free_blocks(fx.pool), kv_pool_total_blocks(fx.pool));
    free(b_before);
    free(b_after);
    free(ka);
    free(kc);
    free(logits);
    free(one);
    model_fixture_close(&fx);
}
