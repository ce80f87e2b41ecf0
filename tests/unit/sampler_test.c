/* Sampler and stop-string tests: exact values for the deterministic steps (greedy, bias,
 * penalties, logprob, validation, stop matching) and statistical bounds for the random ones. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model/sampler.h"

/* ---------------------------------------------------------------- helpers */

static sampler *make(const sampler_params *p, int32_t n_vocab) {
    kv_error err = {{0}};
    sampler *s = sampler_create(p, n_vocab, &err);
    cr_assert_not_null(s, "sampler_create failed: %s", err.msg);
    return s;
}

/* Fills logits with log(probs), so softmax(logits) == probs at T = 1. */
static void logits_from_probs(float *logits, const double *probs, int n) {
    for (int i = 0; i < n; i++) logits[i] = (float)log(probs[i]);
}

/* Deterministic pseudo-random logits for the large-vocabulary tests (an LCG is enough here). */
static void logits_random(float *logits, int n, uint32_t seed, float scale) {
    uint32_t x = seed;
    for (int i = 0; i < n; i++) {
        x = x * 1664525u + 1013904223u;
        logits[i] = scale * ((float)(x >> 8) / 16777216.0f);
    }
}

/* Draws n_draws tokens (logits copied each time, since the sampler may modify them). */
static void draw_many(sampler *s, const float *logits, int n_vocab, int n_draws, int *counts) {
    float *work = malloc((size_t)n_vocab * sizeof *work);
    cr_assert_not_null(work);
    memset(counts, 0, (size_t)n_vocab * sizeof *counts);
    for (int d = 0; d < n_draws; d++) {
        memcpy(work, logits, (size_t)n_vocab * sizeof *work);
        int32_t t = sampler_sample(s, work, NULL, 0, NULL);
        cr_assert(t >= 0 && t < n_vocab, "token %d out of range", (int)t);
        counts[t]++;
    }
    free(work);
}

/* Pearson chi-square of observed counts against expected probabilities. */
static double chi_square(const int *counts, const double *probs, int n, int n_draws) {
    double chi = 0.0;
    for (int i = 0; i < n; i++) {
        double e = probs[i] * n_draws;
        if (e == 0.0) {
            cr_assert_eq(counts[i], 0, "token %d has probability 0 but was drawn", i);
            continue;
        }
        chi += (counts[i] - e) * (counts[i] - e) / e;
    }
    return chi;
}

/* Index order by (logit desc, id asc), the sampler's own tie rule. */
static const float *g_sort_logits;
static int cmp_desc(const void *a, const void *b) {
    int ia = *(const int *)a, ib = *(const int *)b;
    float la = g_sort_logits[ia], lb = g_sort_logits[ib];
    if (la != lb) return la > lb ? -1 : 1;
    return ia - ib;
}
static int *order_desc(const float *logits, int n) {
    int *idx = malloc((size_t)n * sizeof *idx);
    cr_assert_not_null(idx);
    for (int i = 0; i < n; i++) idx[i] = i;
    g_sort_logits = logits;
    qsort(idx, (size_t)n, sizeof *idx, cmp_desc);
    return idx;
}

/* ---------------------------------------------------------------- greedy, seeds */

Test(sampler, greedy_is_argmax) {
    sampler_params p;
    sampler_params_default(&p);
    p.temperature = 0.0f;
    enum { N = 1000 };
    float logits[N];
    logits_random(logits, N, 7, 10.0f);
    logits[613] = 11.0f;
    sampler *s = make(&p, N);
    float lp;
    for (int i = 0; i < 5; i++) cr_assert_eq(sampler_sample(s, logits, NULL, 0, &lp), 613);
    /* ties go to the lowest id */
    logits[17] = 11.0f;
    cr_assert_eq(sampler_sample(s, logits, NULL, 0, NULL), 17);
    sampler_destroy(s);
}

Test(sampler, greedy_ignores_nan) {
    sampler_params p;
    sampler_params_default(&p);
    p.temperature = 0.0f;
    float logits[4] = {NAN, 1.0f, NAN, 2.0f};
    sampler *s = make(&p, 4);
    cr_assert_eq(sampler_sample(s, logits, NULL, 0, NULL), 3);
    sampler_destroy(s);
}

Test(sampler, extreme_inputs_stay_finite) {
    /* +inf logits, NaN logits and a temperature whose inverse overflows still give a token from
     * the best ones, never NaN arithmetic (UBSan would flag float-to-int of NaN). */
    enum { V = 6, DRAWS = 200 };
    float logits[V] = {1.0f, INFINITY, NAN, 0.5f, INFINITY, -INFINITY};
    sampler_params p;
    sampler_params_default(&p);
    p.temperature = 1e-45f;
    p.top_p = 0.5f;
    sampler *s = make(&p, V);
    int counts[V];
    draw_many(s, logits, V, DRAWS, counts);
    cr_assert_eq(counts[1], DRAWS, "token 1 (first +inf, top-p 0.5 of two ties) must win");
    sampler_destroy(s);
    p.temperature = 1.0f;
    p.top_p = 1.0f;
    s = make(&p, V);
    draw_many(s, logits, V, DRAWS, counts);
    cr_assert_eq(counts[1] + counts[4], DRAWS);
    cr_assert(counts[1] > 0 && counts[4] > 0);
    float work[V];
    memcpy(work, logits, sizeof work);
    float lp;
    int32_t t = sampler_sample(s, work, NULL, 0, &lp);
    cr_assert(t == 1 || t == 4);
    cr_assert_float_eq(lp, -logf(2.0f), 1e-6);
    sampler_destroy(s);
}

static void sequence(uint64_t seed, int32_t *out, int n) {
    sampler_params p;
    sampler_params_default(&p);
    p.seed = seed;
    p.top_k = 50;
    p.top_p = 0.95f;
    enum { V = 2000 };
    float base[V], work[V];
    logits_random(base, V, 3, 4.0f);
    sampler *s = make(&p, V);
    for (int i = 0; i < n; i++) {
        memcpy(work, base, sizeof work);
        out[i] = sampler_sample(s, work, NULL, 0, NULL);
    }
    sampler_destroy(s);
}

Test(sampler, same_seed_same_sequence) {
    int32_t a[64], b[64], c[64];
    sequence(42, a, 64);
    sequence(42, b, 64);
    sequence(43, c, 64);
    cr_assert_arr_eq(a, b, sizeof a, "same seed gave different tokens");
    int diff = 0;
    for (int i = 0; i < 64; i++) diff += a[i] != c[i];
    cr_assert_gt(diff, 10, "seeds 42 and 43 gave nearly the same sequence (%d differences)", diff);
}

Test(sampler, seed_zero_is_usable) {
    int32_t a[64];
    sequence(0, a, 64);
    int distinct = 0;
    for (int i = 0; i < 64; i++) {
        bool seen = false;
        for (int j = 0; j < i; j++) seen |= a[j] == a[i];
        distinct += !seen;
    }
    cr_assert_gt(distinct, 10);
}

Test(sampler, top_k_1_is_greedy) {
    enum { V = 5000 };
    float base[V], work[V];
    sampler_params g, k1;
    sampler_params_default(&g);
    g.temperature = 0.0f;
    sampler_params_default(&k1);
    k1.top_k = 1;
    k1.temperature = 1.5f;
    sampler *sg = make(&g, V), *sk = make(&k1, V);
    for (uint32_t trial = 0; trial < 50; trial++) {
        logits_random(base, V, trial + 100, 3.0f);
        memcpy(work, base, sizeof work);
        int32_t want = sampler_sample(sg, work, NULL, 0, NULL);
        memcpy(work, base, sizeof work);
        cr_assert_eq(sampler_sample(sk, work, NULL, 0, NULL), want);
    }
    sampler_destroy(sg);
    sampler_destroy(sk);
}

/* ---------------------------------------------------------------- truncation */

Test(sampler, top_k_stays_in_set) {
    enum { V = 10, DRAWS = 5000 };
    float logits[V] = {0.1f, 2.0f, -1.0f, 1.9f, 0.5f, 1.8f, -3.0f, 1.0f, 0.0f, 1.7f};
    sampler_params p;
    sampler_params_default(&p);
    p.top_k = 3;
    p.temperature = 3.0f; /* flatten, so a leak outside the set would show */
    sampler *s = make(&p, V);
    int counts[V];
    draw_many(s, logits, V, DRAWS, counts);
    for (int i = 0; i < V; i++) {
        bool allowed = i == 1 || i == 3 || i == 5;
        if (allowed)
            cr_assert_gt(counts[i], 0, "token %d in the top-k was never drawn", i);
        else
            cr_assert_eq(counts[i], 0, "token %d outside the top-k drawn %d times", i, counts[i]);
    }
    sampler_destroy(s);
}

Test(sampler, top_p_stays_in_set) {
    enum { V = 5, DRAWS = 5000 };
    const double probs[V] = {0.05, 0.5, 0.05, 0.3, 0.1};
    float logits[V];
    logits_from_probs(logits, probs, V);
    sampler_params p;
    sampler_params_default(&p);
    int counts[V];

    p.top_p = 0.75f; /* 0.5 < 0.75 <= 0.8: {1, 3} */
    sampler *s = make(&p, V);
    draw_many(s, logits, V, DRAWS, counts);
    cr_assert_eq(counts[0] + counts[2] + counts[4], 0);
    cr_assert_gt(counts[1], 0);
    cr_assert_gt(counts[3], 0);
    /* renormalised: 0.5 / 0.8 = 0.625 */
    cr_assert_lt(fabs(counts[1] / (double)DRAWS - 0.625), 0.03);
    sampler_destroy(s);

    p.top_p = 0.85f; /* adds token 4 */
    s = make(&p, V);
    draw_many(s, logits, V, DRAWS, counts);
    cr_assert_eq(counts[0] + counts[2], 0);
    cr_assert_gt(counts[4], 0);
    sampler_destroy(s);
}

Test(sampler, min_p_stays_in_set) {
    enum { V = 5, DRAWS = 5000 };
    const double probs[V] = {0.05, 0.5, 0.05, 0.3, 0.1};
    float logits[V];
    logits_from_probs(logits, probs, V);
    sampler_params p;
    sampler_params_default(&p);
    p.min_p = 0.15f; /* threshold 0.075: {1, 3, 4} */
    sampler *s = make(&p, V);
    int counts[V];
    draw_many(s, logits, V, DRAWS, counts);
    cr_assert_eq(counts[0] + counts[2], 0);
    cr_assert(counts[1] > 0 && counts[3] > 0 && counts[4] > 0);
    sampler_destroy(s);
}

Test(sampler, top_p_applies_before_min_p) {
    /* probs 0.4 0.3 0.2 0.1. top-p 0.75 over all: 0.4, 0.7, 0.9 -> {0,1,2}; then min-p 0.4 (cut
     * below 0.16) keeps {0,1,2}. The other order would differ: min-p first leaves mass 0.9, and
     * top-p 0.75 of that (0.675) stops at {0,1}. */
    enum { V = 4, DRAWS = 4000 };
    const double probs[V] = {0.4, 0.3, 0.2, 0.1};
    float logits[V];
    logits_from_probs(logits, probs, V);
    sampler_params p;
    sampler_params_default(&p);
    p.top_p = 0.75f;
    p.min_p = 0.4f;
    sampler *s = make(&p, V);
    int counts[V];
    draw_many(s, logits, V, DRAWS, counts);
    cr_assert_gt(counts[2], 0, "token 2 must survive top-p (measured before min-p)");
    cr_assert_eq(counts[3], 0);
    sampler_destroy(s);
}

/* Reference nucleus on a large vocabulary, computed by full sort in double precision. */
static int nucleus_size(const float *logits, const int *order, int n, float temp, float top_p) {
    float max = logits[order[0]];
    double total = 0.0;
    for (int i = 0; i < n; i++) total += exp((double)((logits[i] - max) * (1.0f / temp)));
    double cum = 0.0;
    for (int i = 0; i < n; i++) {
        cum += exp((double)((logits[order[i]] - max) * (1.0f / temp)));
        if (cum >= top_p * total) return i + 1;
    }
    return n;
}

static void check_large_top_p(float scale, float top_p, int min_nucleus) {
    enum { V = 49152, DRAWS = 600 };
    float *logits = malloc(V * sizeof *logits);
    int *counts = malloc(V * sizeof *counts);
    cr_assert(logits && counts);
    logits_random(logits, V, 99, scale);
    int *order = order_desc(logits, V);
    int ns = nucleus_size(logits, order, V, 0.8f, top_p);
    cr_assert_geq(ns, min_nucleus, "fixture should need a nucleus of >= %d (got %d)", min_nucleus,
                  ns);
    sampler_params p;
    sampler_params_default(&p);
    p.temperature = 0.8f;
    p.top_p = top_p;
    sampler *s = make(&p, V);
    draw_many(s, logits, V, DRAWS, counts);
    /* one token of slack at the boundary for summation-order rounding */
    for (int r = ns + 1; r < V; r++)
        cr_assert_eq(counts[order[r]], 0, "rank %d (nucleus %d) drawn", r, ns);
    sampler_destroy(s);
    free(order);
    free(logits);
    free(counts);
}

Test(sampler, top_p_large_vocab_small_nucleus) { check_large_top_p(40.0f, 0.9f, 20); }
Test(sampler, top_p_large_vocab_large_nucleus) { check_large_top_p(2.0f, 0.5f, 5000); }

/* The nucleus boundary on a large vocabulary: the token that crosses top_p must be in, the tail
 * out. Outliers at -1000 and -inf stretch the logit range, so the first histogram level lumps the
 * head together and the cut needs refining. */
Test(sampler, top_p_large_vocab_exact_boundary) {
    enum { V = 20000, DRAWS = 2000 };
    float *logits = malloc(V * sizeof *logits);
    int *counts = malloc(V * sizeof *counts);
    cr_assert(logits && counts);
    for (int i = 0; i < V; i++) logits[i] = logf(0.05f);
    for (int i = 0; i < 10; i++) logits[1000 + 37 * i] = logf(10.0f); /* head: mass 100 */
    const int boundary = 15000;
    logits[boundary] = logf(9.0f); /* crosses the target */
    logits[3] = -1000.0f;
    logits[4] = -INFINITY;
    /* total ~ 100 + 9 + 0.05 * 19989 = 1108.4; target 105 lies inside the boundary token */
    sampler_params p;
    sampler_params_default(&p);
    p.top_p = (float)(105.0 / (100.0 + 9.0 + 0.05 * (V - 13)));
    sampler *s = make(&p, V);
    draw_many(s, logits, V, DRAWS, counts);
    int head = 0;
    for (int i = 0; i < 10; i++) head += counts[1000 + 37 * i];
    cr_assert_gt(counts[boundary], 0, "the token crossing top_p was cut");
    cr_assert_eq(head + counts[boundary], DRAWS, "%d draws from the tail",
                 DRAWS - head - counts[boundary]);
    /* renormalised over the nucleus: 9 / 109 */
    cr_assert_lt(fabs(counts[boundary] / (double)DRAWS - 9.0 / 109.0), 0.025);
    sampler_destroy(s);
    free(logits);
    free(counts);
}

/* Equal logits at the boundary: the nucleus takes them in id order, like a stable sort. */
Test(sampler, top_p_ties_break_by_id) {
    enum { V = 10000, DRAWS = 3000 };
    float *logits = malloc(V * sizeof *logits);
    int *counts = malloc(V * sizeof *counts);
    cr_assert(logits && counts);
    for (int i = 0; i < V; i++) logits[i] = logf(0.001f);
    logits[9000] = logf(10.0f);
    const int tied[5] = {19, 3, 15, 7, 11};
    for (int i = 0; i < 5; i++) logits[tied[i]] = 0.0f; /* weight 1 each */
    /* total = 10 + 5 + 0.001 * 9994 = 24.994; target 12.5 needs 3 of the 5 tied: 3, 7, 11 */
    sampler_params p;
    sampler_params_default(&p);
    p.top_p = (float)(12.5 / (15.0 + 0.001 * (V - 6)));
    sampler *s = make(&p, V);
    draw_many(s, logits, V, DRAWS, counts);
    cr_assert(counts[3] > 0 && counts[7] > 0 && counts[11] > 0);
    cr_assert_eq(counts[15] + counts[19], 0, "ties past the cut drawn: %d %d", counts[15],
                 counts[19]);
    cr_assert_eq(counts[9000] + counts[3] + counts[7] + counts[11], DRAWS);
    sampler_destroy(s);
    free(logits);
    free(counts);
}

Test(sampler, top_k_large_vocab) {
    enum { V = 128256, K = 40, DRAWS = 400 };
    float *logits = malloc(V * sizeof *logits);
    int *counts = malloc(V * sizeof *counts);
    cr_assert(logits && counts);
    logits_random(logits, V, 5, 8.0f);
    int *order = order_desc(logits, V);
    sampler_params p;
    sampler_params_default(&p);
    p.top_k = K;
    p.temperature = 5.0f;
    sampler *s = make(&p, V);
    draw_many(s, logits, V, DRAWS, counts);
    int in_set = 0;
    for (int r = 0; r < K; r++) in_set += counts[order[r]];
    cr_assert_eq(in_set, DRAWS, "%d of %d draws outside the top-%d", DRAWS - in_set, DRAWS, K);
    sampler_destroy(s);
    free(order);
    free(logits);
    free(counts);
}

/* ---------------------------------------------------------------- distribution */

/* With 4 degrees of freedom, P(chi2 > 18.47) = 0.001; the seed is fixed, so this is
 * deterministic, and a wrong distribution (e.g. T ignored) gives chi2 in the hundreds. */
#define CHI2_4DOF_P001 18.47

Test(sampler, frequencies_match_softmax_over_temperature) {
    enum { V = 5, DRAWS = 20000 };
    float logits[V] = {1.0f, 0.5f, 0.0f, -0.5f, -1.0f};
    const float temps[] = {0.7f, 1.0f, 2.0f};
    for (size_t ti = 0; ti < sizeof temps / sizeof temps[0]; ti++) {
        float t = temps[ti];
        double probs[V], z = 0.0;
        for (int i = 0; i < V; i++) z += probs[i] = exp(logits[i] / t);
        for (int i = 0; i < V; i++) probs[i] /= z;
        sampler_params p;
        sampler_params_default(&p);
        p.temperature = t;
        p.seed = 1234 + ti;
        sampler *s = make(&p, V);
        int counts[V];
        draw_many(s, logits, V, DRAWS, counts);
        double chi = chi_square(counts, probs, V, DRAWS);
        cr_assert_lt(chi, CHI2_4DOF_P001, "T=%g: chi2 %g", (double)t, chi);
        sampler_destroy(s);
    }
}

Test(sampler, frequencies_after_top_k_renormalise) {
    enum { V = 8, DRAWS = 20000 };
    float logits[V] = {0.0f, 1.2f, -2.0f, 0.9f, 0.3f, -1.0f, 0.6f, 1.5f};
    /* top-5 by logit: ids 7, 1, 3, 6, 4 -> 4 degrees of freedom */
    const int keep[5] = {7, 1, 3, 6, 4};
    double probs[V] = {0}, z = 0.0;
    for (int i = 0; i < 5; i++) z += probs[keep[i]] = exp(logits[keep[i]] / 0.9);
    for (int i = 0; i < V; i++) probs[i] /= z;
    sampler_params p;
    sampler_params_default(&p);
    p.temperature = 0.9f;
    p.top_k = 5;
    p.seed = 77;
    sampler *s = make(&p, V);
    int counts[V];
    draw_many(s, logits, V, DRAWS, counts);
    double chi = chi_square(counts, probs, V, DRAWS);
    cr_assert_lt(chi, CHI2_4DOF_P001, "chi2 %g", chi);
    sampler_destroy(s);
}

/* ---------------------------------------------------------------- penalties, bias */

Test(sampler, penalties_exact_values) {
    sampler_params p;
    sampler_params_default(&p);
    p.temperature = 0.0f;
    p.repeat_penalty = 2.0f;
    p.frequency_penalty = 0.5f;
    p.presence_penalty = 0.25f;
    p.repeat_last_n = -1;
    sampler *s = make(&p, 5);
    float logits[5] = {2.0f, -1.0f, 0.5f, 3.0f, 0.0f};
    const int32_t hist[] = {0, 1, 1, 2, 4, 4, 4};
    sampler_sample(s, logits, hist, 7, NULL);
    /* positive: divided; negative and zero: multiplied; then count*f + presence subtracted */
    cr_assert_float_eq(logits[0], 2.0f / 2 - (1 * 0.5f + 0.25f), 1e-6);  /* 0.25 */
    cr_assert_float_eq(logits[1], -1.0f * 2 - (2 * 0.5f + 0.25f), 1e-6); /* -3.25 */
    cr_assert_float_eq(logits[2], 0.5f / 2 - (1 * 0.5f + 0.25f), 1e-6);  /* -0.5 */
    cr_assert_float_eq(logits[3], 3.0f, 1e-6);                           /* not in history */
    cr_assert_float_eq(logits[4], 0.0f * 2 - (3 * 0.5f + 0.25f), 1e-6);  /* -1.75 */
    /* counts are per call: the same call again gives the same values from fresh logits */
    float again[5] = {2.0f, -1.0f, 0.5f, 3.0f, 0.0f};
    sampler_sample(s, again, hist, 7, NULL);
    cr_assert_arr_eq(again, logits, sizeof again);
    sampler_destroy(s);
}

Test(sampler, penalty_window) {
    sampler_params p;
    sampler_params_default(&p);
    p.temperature = 0.0f;
    p.frequency_penalty = 1.0f;
    p.repeat_last_n = 3;
    sampler *s = make(&p, 4);
    float logits[4] = {1.0f, 1.0f, 1.0f, 1.0f};
    const int32_t hist[] = {0, 0, 1, 2, 2, 3}; /* window: 2, 2, 3 */
    sampler_sample(s, logits, hist, 6, NULL);
    cr_assert_float_eq(logits[0], 1.0f, 1e-6);
    cr_assert_float_eq(logits[1], 1.0f, 1e-6);
    cr_assert_float_eq(logits[2], -1.0f, 1e-6);
    cr_assert_float_eq(logits[3], 0.0f, 1e-6);
    sampler_destroy(s);

    /* repeat_last_n = 0 turns all three penalties off */
    p.repeat_last_n = 0;
    p.repeat_penalty = 3.0f;
    s = make(&p, 4);
    float l2[4] = {1.0f, 1.0f, 1.0f, 1.0f};
    sampler_sample(s, l2, hist, 6, NULL);
    for (int i = 0; i < 4; i++) cr_assert_float_eq(l2[i], 1.0f, 1e-6);
    sampler_destroy(s);
}

Test(sampler, penalties_skip_out_of_range_history) {
    sampler_params p;
    sampler_params_default(&p);
    p.temperature = 0.0f;
    p.presence_penalty = 1.0f;
    p.repeat_last_n = -1;
    sampler *s = make(&p, 3);
    float logits[3] = {0.0f, 0.0f, 0.0f};
    const int32_t hist[] = {-5, 1, 3, 1000000};
    cr_assert_eq(sampler_sample(s, logits, hist, 4, NULL), 0);
    cr_assert_float_eq(logits[1], -1.0f, 1e-6);
    cr_assert_float_eq(logits[0], 0.0f, 1e-6);
    cr_assert_float_eq(logits[2], 0.0f, 1e-6);
    sampler_destroy(s);
}

Test(sampler, penalty_steers_greedy) {
    sampler_params p;
    sampler_params_default(&p);
    p.temperature = 0.0f;
    p.repeat_penalty = 1.5f;
    sampler *s = make(&p, 3);
    float logits[3] = {1.0f, 0.9f, 0.1f};
    const int32_t hist[] = {0};
    cr_assert_eq(sampler_sample(s, logits, hist, 1, NULL), 1);
    sampler_destroy(s);
}

Test(sampler, bias_bans_and_boosts) {
    enum { V = 6, DRAWS = 3000 };
    float logits[V] = {5.0f, 1.0f, 1.0f, 1.0f, 1.0f, 0.0f};
    logit_bias b[2] = {{0, -INFINITY}, {5, 0.5f}};
    sampler_params p;
    sampler_params_default(&p);
    p.bias = b;
    p.n_bias = 2;
    sampler *s = make(&p, V);
    int counts[V];
    draw_many(s, logits, V, DRAWS, counts);
    cr_assert_eq(counts[0], 0, "banned token drawn %d times", counts[0]);
    for (int i = 1; i < V; i++) cr_assert_gt(counts[i], 0);
    /* the sampler copied the bias: changing the caller's array has no effect */
    b[0].bias = 0.0f;
    draw_many(s, logits, V, 500, counts);
    cr_assert_eq(counts[0], 0);
    sampler_destroy(s);

    /* greedy: the ban applies before the argmax; logits[] comes back biased */
    b[0].bias = -INFINITY;
    p.temperature = 0.0f;
    s = make(&p, V);
    float work[V];
    memcpy(work, logits, sizeof work);
    cr_assert_eq(sampler_sample(s, work, NULL, 0, NULL), 1);
    cr_assert(isinf(work[0]) && work[0] < 0);
    cr_assert_float_eq(work[5], 0.5f, 1e-6);
    sampler_destroy(s);
}

Test(sampler, bias_all_banned_still_returns_a_token) {
    logit_bias b[3] = {{0, -INFINITY}, {1, -INFINITY}, {2, -INFINITY}};
    sampler_params p;
    sampler_params_default(&p);
    p.bias = b;
    p.n_bias = 3;
    p.top_p = 0.9f;
    sampler *s = make(&p, 3);
    float logits[3] = {1.0f, 2.0f, 3.0f};
    int32_t t = sampler_sample(s, logits, NULL, 0, NULL);
    cr_assert(t >= 0 && t < 3);
    sampler_destroy(s);
}

/* ---------------------------------------------------------------- logprob */

static double log_softmax_at(const float *logits, int n, int i) {
    double m = -INFINITY, z = 0.0;
    for (int j = 0; j < n; j++) m = fmax(m, logits[j]);
    for (int j = 0; j < n; j++) z += exp(logits[j] - m);
    return logits[i] - m - log(z);
}

Test(sampler, logprob_under_unmodified_distribution) {
    enum { V = 300 };
    float orig[V], work[V];
    logits_random(orig, V, 11, 6.0f);
    logit_bias b[2] = {{7, 100.0f}, {8, -2.0f}};
    sampler_params p;
    sampler_params_default(&p);
    p.temperature = 0.0f;
    p.bias = b;
    p.n_bias = 2;
    p.repeat_penalty = 1.3f;
    p.presence_penalty = 0.4f;
    const int32_t hist[] = {7, 7, 3, 8};
    sampler *s = make(&p, V);
    memcpy(work, orig, sizeof work);
    float lp = 0.0f;
    int32_t t = sampler_sample(s, work, hist, 4, &lp);
    cr_assert_eq(t, 7, "the +100 bias should win");
    cr_assert_float_eq(lp, (float)log_softmax_at(orig, V, 7), 1e-5);
    sampler_destroy(s);

    /* sampled path, several tokens */
    p.temperature = 1.3f;
    p.top_k = 20;
    p.n_bias = 0;
    s = make(&p, V);
    for (int i = 0; i < 20; i++) {
        memcpy(work, orig, sizeof work);
        t = sampler_sample(s, work, hist, 4, &lp);
        cr_assert_float_eq(lp, (float)log_softmax_at(orig, V, t), 1e-5, "token %d", (int)t);
    }
    sampler_destroy(s);
}

Test(sampler, logprob_of_certain_token_is_zero) {
    float logits[3] = {-INFINITY, 4.0f, -INFINITY};
    sampler_params p;
    sampler_params_default(&p);
    sampler *s = make(&p, 3);
    float lp = 1.0f;
    cr_assert_eq(sampler_sample(s, logits, NULL, 0, &lp), 1);
    cr_assert_float_eq(lp, 0.0f, 1e-7);
    sampler_destroy(s);
}

/* ---------------------------------------------------------------- validation */

static void expect_invalid(const sampler_params *p, int32_t n_vocab, const char *name) {
    kv_error err = {{0}};
    sampler *s = sampler_create(p, n_vocab, &err);
    cr_assert_null(s, "%s: accepted", name);
    cr_assert_not_null(strstr(err.msg, name), "message '%s' does not name %s", err.msg, name);
}

Test(sampler, invalid_params_rejected) {
    sampler_params p;
#define BAD(field, value, name)                                                                    \
    do {                                                                                           \
        sampler_params_default(&p);                                                                \
        p.field = value;                                                                           \
        expect_invalid(&p, 100, name);                                                             \
    } while (0)
    BAD(temperature, -0.1f, "temperature");
    BAD(temperature, NAN, "temperature");
    BAD(temperature, INFINITY, "temperature");
    BAD(top_k, -1, "top_k");
    BAD(top_p, 0.0f, "top_p");
    BAD(top_p, 1.5f, "top_p");
    BAD(top_p, NAN, "top_p");
    BAD(min_p, -0.1f, "min_p");
    BAD(min_p, 1.1f, "min_p");
    BAD(repeat_penalty, 0.0f, "repeat_penalty");
    BAD(repeat_penalty, -1.0f, "repeat_penalty");
    BAD(repeat_penalty, INFINITY, "repeat_penalty");
    BAD(repeat_last_n, -2, "repeat_last_n");
    BAD(frequency_penalty, NAN, "frequency_penalty");
    BAD(frequency_penalty, -INFINITY, "frequency_penalty");
    BAD(presence_penalty, INFINITY, "presence_penalty");
#undef BAD
    logit_bias out_of_range = {100, 1.0f}, negative = {-1, 1.0f}, nan_bias = {3, NAN},
               pos_inf = {3, INFINITY};
    const logit_bias *bad[] = {&out_of_range, &negative, &nan_bias, &pos_inf};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        sampler_params_default(&p);
        p.bias = bad[i];
        p.n_bias = 1;
        expect_invalid(&p, 100, "logit_bias");
    }
    sampler_params_default(&p);
    expect_invalid(&p, 0, "n_vocab");

    /* the edges of each range are accepted */
    sampler_params_default(&p);
    p.temperature = 0.0f;
    p.top_p = 1.0f;
    p.min_p = 1.0f;
    p.top_k = 0;
    p.repeat_last_n = -1;
    logit_bias ban = {99, -INFINITY};
    p.bias = &ban;
    p.n_bias = 1;
    sampler_destroy(make(&p, 100));
}

/* ---------------------------------------------------------------- stop strings */

static stop_set stops_make(const char *const *strs, int n) {
    stop_set s;
    kv_error err = {{0}};
    cr_assert_eq(stop_set_init(&s, strs, n, &err), 0, "%s", err.msg);
    return s;
}

static size_t scan(const stop_set *s, const char *text, bool *matched) {
    return stop_set_scan(s, text, strlen(text), matched);
}

Test(stop, match_in_middle_and_at_end) {
    const char *strs[] = {"STOP"};
    stop_set s = stops_make(strs, 1);
    bool m;
    cr_assert_eq(scan(&s, "hello STOP world", &m), 6);
    cr_assert(m);
    cr_assert_eq(scan(&s, "hello STOP", &m), 6);
    cr_assert(m);
    cr_assert_eq(scan(&s, "STOP", &m), 0);
    cr_assert(m);
    cr_assert_eq(scan(&s, "hello world", &m), 11);
    cr_assert(!m);
    stop_set_free(&s);
}

Test(stop, partial_hold_back) {
    const char *strs[] = {"</answer>"};
    stop_set s = stops_make(strs, 1);
    bool m;
    cr_assert_eq(scan(&s, "the answer is 4 </ans", &m), 16);
    cr_assert(!m);
    cr_assert_eq(scan(&s, "the answer is 4 <", &m), 16);
    cr_assert_eq(scan(&s, "the answer is 4 </answer", &m), 16);
    cr_assert(!m);
    /* a '<' that cannot start the stop string any more is released */
    cr_assert_eq(scan(&s, "a <b", &m), 4);
    cr_assert_eq(scan(&s, "", &m), 0);
    cr_assert(!m);
    /* NULL matched is allowed */
    cr_assert_eq(stop_set_scan(&s, "x </", 4, NULL), 2);
    stop_set_free(&s);
}

Test(stop, multiple_stops_earliest_wins) {
    const char *strs[] = {"world", "lo w", "\n\n"};
    stop_set s = stops_make(strs, 3);
    bool m;
    cr_assert_eq(scan(&s, "hello world", &m), 3); /* "lo w" starts before "world" */
    cr_assert(m);
    cr_assert_eq(scan(&s, "a\n\nhello world", &m), 1);
    cr_assert(m);
    /* hold back is the longest tail over all stops */
    cr_assert_eq(scan(&s, "xx wor", &m), 3);
    cr_assert_eq(scan(&s, "xx\n", &m), 2);
    cr_assert(!m);
    stop_set_free(&s);
}

Test(stop, overlapping_prefixes) {
    /* "abab" inside "ababab": the first start counts; partial tails that overlap themselves
     * (tail "aba" is a prefix of "abab" and so is "a") hold back the longest. */
    const char *strs[] = {"abab", "abc"};
    stop_set s = stops_make(strs, 2);
    bool m;
    cr_assert_eq(scan(&s, "xababab", &m), 1);
    cr_assert(m);
    cr_assert_eq(scan(&s, "xxaba", &m), 2);
    cr_assert(!m);
    cr_assert_eq(scan(&s, "xxab", &m), 2);
    cr_assert_eq(scan(&s, "xxaab", &m), 3);
    cr_assert_eq(scan(&s, "abab", &m), 0);
    cr_assert(m);
    cr_assert_eq(scan(&s, "aabc", &m), 1);
    cr_assert(m);
    stop_set_free(&s);
}

Test(stop, utf8_stop_strings) {
    const char *strs[] = {"\xe2\x86\x92 end", "\xe3\x80\x82"}; /* "→ end", "。" */
    stop_set s = stops_make(strs, 2);
    bool m;
    cr_assert_eq(scan(&s, "caf\xc3\xa9 \xe2\x86\x92 end!", &m), 6);
    cr_assert(m);
    cr_assert_eq(scan(&s, "\xe4\xbd\xa0\xe5\xa5\xbd\xe3\x80\x82\xe5\x86\x8d", &m), 6);
    cr_assert(m);
    /* the first bytes of a multi-byte stop are held back, never emitted half */
    cr_assert_eq(scan(&s, "caf\xc3\xa9 \xe2\x86", &m), 6);
    cr_assert(!m);
    cr_assert_eq(scan(&s, "caf\xc3\xa9 \xe3", &m), 6);
    cr_assert_eq(scan(&s, "caf\xc3\xa9 \xe2\x86\x92 en", &m), 6);
    cr_assert(!m);
    stop_set_free(&s);
}

Test(stop, init_errors_and_empty_set) {
    stop_set s;
    kv_error err = {{0}};
    const char *with_empty[] = {"ok", ""};
    cr_assert_eq(stop_set_init(&s, with_empty, 2, &err), -1);
    cr_assert_not_null(strstr(err.msg, "empty"), "%s", err.msg);
    cr_assert_eq(s.n, 0);
    cr_assert_null(s.strs);
    const char *with_null[] = {NULL};
    cr_assert_eq(stop_set_init(&s, with_null, 1, &err), -1);
    cr_assert_eq(stop_set_init(&s, NULL, -1, &err), -1);

    cr_assert_eq(stop_set_init(&s, NULL, 0, &err), 0);
    bool m = true;
    cr_assert_eq(scan(&s, "anything", &m), 8);
    cr_assert(!m);
    stop_set_free(&s);
    stop_set_free(&s); /* freeing twice is safe: free zeroes the set */
}

Test(stop, strings_are_copied) {
    char buf[8] = "END";
    const char *strs[] = {buf};
    stop_set s = stops_make(strs, 1);
    strcpy(buf, "XYZ");
    bool m;
    cr_assert_eq(scan(&s, "abc END", &m), 4);
    cr_assert(m);
    stop_set_free(&s);
}

Test(sampler, argmax_and_top_ids_order_ties_by_id) {
    const float l[8] = {1.0f, 3.0f, NAN, 3.0f, -INFINITY, 2.0f, 3.0f, 0.5f};
    cr_assert_eq(sampler_argmax(l, 8), 1, "the lowest id of the tied best; NaN never wins");
    int32_t ids[SAMPLER_MAX_TOP_IDS];
    cr_assert_eq(sampler_top_ids(l, 8, 5, ids), 5);
    const int32_t want[5] = {1, 3, 6, 5, 0};
    for (int i = 0; i < 5; i++) cr_assert_eq(ids[i], want[i], "rank %d: %d", i, ids[i]);
    /* k beyond n gives every id, NaN and -inf last */
    cr_assert_eq(sampler_top_ids(l, 8, 20, ids), 8);
    cr_assert_eq(ids[6] == 2 || ids[6] == 4, true);
    cr_assert_eq(sampler_top_ids(l, 8, 0, ids), 0);
    /* the same order as a full sort over a long random row */
    enum { N = 5000 };
    static float row[N];
    uint64_t s = 42;
    for (int i = 0; i < N; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        row[i] = (float)((s >> 40) % 97) / 7.0f; /* many ties */
    }
    int n = sampler_top_ids(row, N, 20, ids);
    cr_assert_eq(n, 20);
    for (int i = 1; i < n; i++)
        cr_assert(row[ids[i - 1]] > row[ids[i]] ||
                      (row[ids[i - 1]] == row[ids[i]] && ids[i - 1] < ids[i]),
                  "rank %d out of order", i);
    for (int i = 0; i < N; i++) {
        bool in = false;
        for (int k = 0; k < n; k++) in |= ids[k] == i;
        if (!in)
            cr_assert(row[i] < row[ids[n - 1]] || (row[i] == row[ids[n - 1]] && i > ids[n - 1]));
    }
}
