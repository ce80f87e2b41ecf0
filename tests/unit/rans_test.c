/* rANS coder tests: round trips over skewed and uniform models with per-symbol contexts, the
 * compressed size against the ideal cost, model normalisation (optimality and edge cases), model
 * validation, and every decoder failure path: truncation at each cut point, trailing bytes, bad
 * states and contexts, and random single-byte flips (the final-state check must catch >= 99%).
 * Speeds are printed, not asserted. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/codec/rans.h"

/* ---------------------------------------------------------------- helpers */

/* xorshift64: deterministic data for every test. */
static uint64_t rng_next(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static void build(rans_model *m, const uint64_t *counts, int n) {
    kv_error err = {{0}};
    cr_assert_eq(rans_model_build(m, counts, n, &err), 0, "rans_model_build: %s", err.msg);
    cr_assert_eq(rans_model_check(m, &err), 0, "built model fails its check: %s", err.msg);
}

/* Counts shaped like quantized KV deltas: two-sided geometric around symbol 0 (symbols
 * 0, 1, 2, ... = deltas 0, +1, -1, ...), decay d per step. */
static void build_laplace(rans_model *m, int n, double d) {
    uint64_t counts[RANS_MAX_SYMBOLS];
    for (int s = 0; s < n; s++) counts[s] = (uint64_t)(1e9 * exp(-d * ((s + 1) / 2)));
    build(m, counts, n);
}

static void build_uniform(rans_model *m, int n) {
    uint64_t counts[RANS_MAX_SYMBOLS];
    for (int s = 0; s < n; s++) counts[s] = 1;
    build(m, counts, n);
}

/* A mix of the shapes the codec will meet: 8 models, from 1 symbol to 256. */
#define N_MIX 8
static void build_mix(rans_model *models) {
    build_laplace(&models[0], 16, 0.7); /* ~2.9 bits */
    build_laplace(&models[1], 64, 0.2); /* ~4.8 bits */
    build_laplace(&models[2], 8, 3.5);  /* ~0.2 bits: one dominant symbol */
    build_uniform(&models[3], 256);     /* 8 bits */
    build_uniform(&models[4], 3);
    build_uniform(&models[5], 1); /* zero bits */
    build_uniform(&models[6], 2);
    build_laplace(&models[7], 256, 0.05);
}

/* A symbol drawn from m's own distribution (a uniform slot's owner). */
static uint8_t draw(const rans_model *m, uint64_t *rng) {
    uint32_t slot = (uint32_t)(rng_next(rng) % RANS_PROB_SCALE);
    int s = 0;
    while (m->cum[s + 1] <= slot) s++;
    return (uint8_t)s;
}

/* Contexts drawn from choices[0..n_choices) (all of [0, n_choices) when choices is NULL) and
 * symbols drawn from each symbol's model. */
static void make_data_from(const rans_model *models, const uint32_t *choices, int n_choices,
                           size_t n, uint64_t seed, uint8_t *syms, uint32_t *ctx) {
    uint64_t rng = seed;
    for (size_t i = 0; i < n; i++) {
        uint32_t k = (uint32_t)(rng_next(&rng) % (uint64_t)n_choices);
        ctx[i] = choices ? choices[k] : k;
        syms[i] = draw(&models[ctx[i]], &rng);
    }
}

static void make_data(const rans_model *models, int n_models, size_t n, uint64_t seed,
                      uint8_t *syms, uint32_t *ctx) {
    make_data_from(models, NULL, n_models, n, seed, syms, ctx);
}

/* Encodes, checks the length against the bound, decodes and compares. Returns the length and
 * leaves the stream in *stream (caller frees). */
static int64_t round_trip(const uint8_t *syms, const uint32_t *ctx, size_t n,
                          const rans_model *models, size_t n_models, uint8_t **stream) {
    kv_error err = {{0}};
    size_t cap = rans_encode_bound(n);
    uint8_t *out = malloc(cap);
    uint8_t *back = malloc(n ? n : 1);
    cr_assert(out && back);
    int64_t len = rans_encode(syms, ctx, n, models, n_models, out, cap, &err);
    cr_assert_geq(len, RANS_STATE_BYTES, "encode of %zu symbols: %s", n, err.msg);
    cr_assert_leq((size_t)len, cap);
    cr_assert_eq(rans_decode(out, (size_t)len, ctx, n, models, n_models, back, &err), 0,
                 "decode of %zu symbols: %s", n, err.msg);
    cr_assert(n == 0 || memcmp(syms, back, n) == 0, "round trip of %zu symbols differs", n);
    free(back);
    if (stream)
        *stream = out;
    else
        free(out);
    return len;
}

/* The ideal cost in bits of syms under their contexts' models (per-model counts). */
static double ideal_bits(const uint8_t *syms, const uint32_t *ctx, size_t n,
                         const rans_model *models, int n_models) {
    uint64_t *counts = calloc((size_t)n_models * RANS_MAX_SYMBOLS, sizeof *counts);
    cr_assert_not_null(counts);
    for (size_t i = 0; i < n; i++) counts[(ctx ? ctx[i] : 0) * RANS_MAX_SYMBOLS + syms[i]]++;
    double bits = 0.0;
    for (int k = 0; k < n_models; k++)
        bits += rans_cost_bits(&models[k], &counts[(size_t)k * RANS_MAX_SYMBOLS]);
    free(counts);
    return bits;
}

/* ---------------------------------------------------------------- round trips */

Test(rans, round_trip_sizes_with_contexts) {
    rans_model models[N_MIX];
    build_mix(models);
    const size_t sizes[] = {0, 1, 2, 3, 1000, 1000000};
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
        size_t n = sizes[k];
        uint8_t *syms = malloc(n + 1);
        uint32_t *ctx = malloc((n + 1) * sizeof *ctx);
        cr_assert(syms && ctx);
        make_data(models, N_MIX, n, 1234 + k, syms, ctx);
        int64_t len = round_trip(syms, ctx, n, models, N_MIX, NULL);
        if (n == 0) cr_assert_eq(len, RANS_STATE_BYTES, "an empty stream is the two states");
        free(syms);
        free(ctx);
    }
}

/* Every symbol value of every model, in runs and alternating, so each (model, symbol) pair and
 * both states see the extremes (freq 1 symbols next to a dominant one). */
Test(rans, round_trip_every_symbol) {
    rans_model models[N_MIX];
    build_mix(models);
    size_t n = 0, cap = N_MIX * RANS_MAX_SYMBOLS * 3;
    uint8_t *syms = malloc(cap);
    uint32_t *ctx = malloc(cap * sizeof *ctx);
    for (int k = 0; k < N_MIX; k++)
        for (int rep = 0; rep < 3; rep++)
            for (int s = 0; s < models[k].n_symbols; s++) {
                ctx[n] = (uint32_t)k;
                syms[n++] = (uint8_t)(rep == 1 ? models[k].n_symbols - 1 - s : s);
            }
    round_trip(syms, ctx, n, models, N_MIX, NULL);
    free(syms);
    free(ctx);
}

Test(rans, null_ctx_uses_model_zero) {
    rans_model m;
    build_laplace(&m, 32, 0.5);
    size_t n = 10001;
    uint8_t *syms = malloc(n);
    uint64_t rng = 99;
    for (size_t i = 0; i < n; i++) syms[i] = draw(&m, &rng);
    round_trip(syms, NULL, n, &m, 1, NULL);
    free(syms);
}

/* A 1-symbol alphabet costs nothing: any count of symbols is the 8 state bytes. */
Test(rans, one_symbol_alphabet) {
    rans_model m;
    uint64_t count = 77;
    build(&m, &count, 1);
    cr_assert_eq(m.freq[0], RANS_PROB_SCALE);
    const size_t sizes[] = {0, 1, 2, 7, 100000};
    for (size_t k = 0; k < 5; k++) {
        uint8_t *syms = calloc(sizes[k] + 1, 1);
        cr_assert_eq(round_trip(syms, NULL, sizes[k], &m, 1, NULL), RANS_STATE_BYTES);
        free(syms);
    }
}

/* ---------------------------------------------------------------- compression efficiency */

/* For 10^6 symbols drawn from each model (alone, and mixed by context), the stream is within 1%
 * (plus the 8 state bytes and a few bytes of flush) of the ideal cost of those exact symbols. */
Test(rans, size_within_one_percent_of_ideal) {
    rans_model models[N_MIX];
    build_mix(models);
    size_t n = 1000000;
    uint8_t *syms = malloc(n);
    uint32_t *ctx = malloc(n * sizeof *ctx);
    cr_assert(syms && ctx);
    for (int k = 0; k <= N_MIX; k++) {
        const rans_model *ms = k < N_MIX ? &models[k] : models;
        int n_models = k < N_MIX ? 1 : N_MIX;
        make_data(ms, n_models, n, 77 + (uint64_t)k, syms, ctx);
        int64_t len = round_trip(syms, ctx, n, ms, (size_t)n_models, NULL);
        double ideal = ideal_bits(syms, ctx, n, ms, n_models) / 8.0;
        double slack = ideal * 0.01 + RANS_STATE_BYTES + 4;
        cr_expect_leq((double)len, ideal + slack, "model %d: %lld bytes, ideal %.1f (%.3f%% over)",
                      k, (long long)len, ideal, 100.0 * (len - ideal) / ideal);
        fprintf(stderr,
                "rans efficiency: %s: %.4f bits/symbol, %lld bytes vs ideal %.1f (%+.3f%%)\n",
                k < N_MIX ? "single model" : "8 models mixed", ideal * 8 / n, (long long)len, ideal,
                ideal > 0 ? 100.0 * (len - ideal) / ideal : 0.0);
    }
    free(syms);
    free(ctx);
}

/* ---------------------------------------------------------------- model building */

static double model_cost(const uint32_t *f, const uint64_t *counts, int n) {
    double bits = 0.0;
    for (int s = 0; s < n; s++)
        if (counts[s]) bits += (double)counts[s] * (RANS_PROB_BITS - log2((double)f[s]));
    return bits;
}

/* No single slot moved from one symbol to another lowers the cost: for a separable convex cost
 * that is the global optimum. A move from j to i changes only those two terms. */
static void assert_optimal(const rans_model *m, const uint64_t *counts) {
    int n = m->n_symbols;
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++) {
            if (i == j || m->freq[j] == 1) continue;
            double fi = m->freq[i], fj = m->freq[j];
            double ci = (double)counts[i], cj = (double)counts[j];
            double saved = ci * (log2(fi + 1) - log2(fi)) - cj * (log2(fj) - log2(fj - 1));
            double scale = ci * log2(fi + 1) + cj * log2(fj) + 1.0;
            cr_assert_leq(saved, 1e-12 * scale, "moving a slot from %d to %d saves %.6g bits", j, i,
                          saved);
        }
}

Test(rans_model, build_is_optimal_for_random_counts) {
    uint64_t rng = 5;
    for (int trial = 0; trial < 40; trial++) {
        int n = 1 + (int)(rng_next(&rng) % (trial < 20 ? 12 : 256));
        uint64_t counts[RANS_MAX_SYMBOLS];
        for (int s = 0; s < n; s++) {
            /* Mixed magnitudes: zeros, small and large counts. */
            uint64_t r = rng_next(&rng);
            counts[s] = (r & 3) == 0 ? 0 : (r >> 8) % (1ull << (r % 40));
        }
        rans_model m;
        build(&m, counts, n);
        cr_assert_eq(m.n_symbols, n);
        assert_optimal(&m, counts);
        uint32_t f[RANS_MAX_SYMBOLS] = {0};
        for (int s = 0; s < n; s++) f[s] = m.freq[s];
        cr_assert_float_eq(rans_cost_bits(&m, counts), model_cost(f, counts, n), 1e-6);
    }
}

/* The optimum also beats (or ties) the obvious rounding it replaces. */
Test(rans_model, build_beats_proportional_rounding) {
    uint64_t counts[16] = {100000, 50000, 25000, 12000, 6000, 3000, 1500, 700,
                           300,    150,   70,    30,    10,   3,    1,    0};
    rans_model m;
    build(&m, counts, 16);
    uint32_t naive[16], sum = 0;
    uint64_t total = 0;
    for (int s = 0; s < 16; s++) total += counts[s];
    for (int s = 0; s < 16; s++) {
        naive[s] = (uint32_t)((double)counts[s] * RANS_PROB_SCALE / (double)total);
        if (naive[s] == 0) naive[s] = 1;
        sum += naive[s];
    }
    naive[0] += RANS_PROB_SCALE - sum; /* the remainder to the largest */
    cr_assert_leq(rans_cost_bits(&m, counts), model_cost(naive, counts, 16) + 1e-9);
    assert_optimal(&m, counts);
}

Test(rans_model, all_zero_counts_give_uniform) {
    uint64_t zeros[RANS_MAX_SYMBOLS] = {0};
    rans_model m;
    build(&m, zeros, 3);
    cr_assert_eq(m.freq[0] + m.freq[1] + m.freq[2], RANS_PROB_SCALE);
    for (int s = 0; s < 3; s++) cr_assert(m.freq[s] == 5461 || m.freq[s] == 5462);
    build(&m, zeros, RANS_MAX_SYMBOLS);
    for (int s = 0; s < RANS_MAX_SYMBOLS; s++) cr_assert_eq(m.freq[s], RANS_PROB_SCALE / 256);
}

Test(rans_model, one_huge_count_keeps_others_encodable) {
    uint64_t counts[RANS_MAX_SYMBOLS] = {0};
    counts[7] = UINT64_MAX;
    rans_model m;
    build(&m, counts, RANS_MAX_SYMBOLS);
    cr_assert_eq(m.freq[7], RANS_PROB_SCALE - (RANS_MAX_SYMBOLS - 1));
    for (int s = 0; s < RANS_MAX_SYMBOLS; s++)
        if (s != 7) cr_assert_eq(m.freq[s], 1, "symbol %d", s);
    /* A never-seen symbol still round-trips. */
    uint8_t syms[4] = {7, 0, 255, 7};
    round_trip(syms, NULL, 4, &m, 1, NULL);
}

/* Counts whose sum overflows 64 bits (and ones near the top of uint64_t) still normalise
 * to the right proportions. */
Test(rans_model, counts_summing_past_uint64) {
    uint64_t half[3] = {1ull << 63, 1ull << 63, 1ull << 62};
    rans_model m;
    build(&m, half, 3);
    /* 0.4, 0.4, 0.2 of 16384 = 6553.6, 6553.6, 3276.8 */
    cr_assert(abs((int)m.freq[0] - 6554) <= 1 && abs((int)m.freq[1] - 6554) <= 1, "%u %u",
              m.freq[0], m.freq[1]);
    cr_assert(abs((int)m.freq[2] - 3277) <= 1, "%u", m.freq[2]);
    assert_optimal(&m, half);
    uint64_t maxes[RANS_MAX_SYMBOLS];
    for (int s = 0; s < RANS_MAX_SYMBOLS; s++) maxes[s] = UINT64_MAX;
    build(&m, maxes, RANS_MAX_SYMBOLS);
    for (int s = 0; s < RANS_MAX_SYMBOLS; s++) cr_assert_eq(m.freq[s], 64);
    maxes[0] = UINT64_MAX - 1;
    maxes[1] = 1;
    build(&m, maxes, RANS_MAX_SYMBOLS);
    cr_assert_eq(m.freq[1], 1);
}

Test(rans_model, two_hundred_fifty_six_symbols_skewed) {
    uint64_t counts[RANS_MAX_SYMBOLS];
    for (int s = 0; s < RANS_MAX_SYMBOLS; s++) counts[s] = (uint64_t)1 << (s % 50);
    rans_model m;
    build(&m, counts, RANS_MAX_SYMBOLS);
    assert_optimal(&m, counts);
}

Test(rans_model, build_rejects_bad_sizes) {
    uint64_t counts[RANS_MAX_SYMBOLS + 1] = {0};
    rans_model m;
    kv_error err = {{0}};
    cr_assert_eq(rans_model_build(&m, counts, 0, &err), -1);
    cr_assert(strstr(err.msg, "0 symbols") != NULL, "%s", err.msg);
    cr_assert_eq(rans_model_build(&m, counts, -3, &err), -1);
    cr_assert_eq(rans_model_build(&m, counts, RANS_MAX_SYMBOLS + 1, &err), -1);
    cr_assert(strstr(err.msg, "257 symbols") != NULL, "%s", err.msg);
}

Test(rans_model, from_freqs_matches_build) {
    rans_model a, b;
    build_laplace(&a, 40, 0.3);
    kv_error err = {{0}};
    cr_assert_eq(rans_model_from_freqs(&b, a.freq, a.n_symbols, &err), 0, "%s", err.msg);
    cr_assert_eq(memcmp(&a, &b, sizeof a), 0);
    uint16_t bad[3] = {8192, 8192, 0};
    cr_assert_eq(rans_model_from_freqs(&b, bad, 3, &err), -1);
    cr_assert(strstr(err.msg, "frequency 0") != NULL, "%s", err.msg);
    uint16_t short_sum[2] = {8192, 8191};
    cr_assert_eq(rans_model_from_freqs(&b, short_sum, 2, &err), -1);
    cr_assert(strstr(err.msg, "sum") != NULL, "%s", err.msg);
    cr_assert_eq(rans_model_from_freqs(&b, short_sum, 0, &err), -1);
    cr_assert_eq(rans_model_from_freqs(&b, short_sum, RANS_MAX_SYMBOLS + 1, &err), -1);
}

Test(rans_model, check_rejects_each_inconsistency) {
    rans_model good, m;
    build_laplace(&good, 20, 0.4);
    kv_error err = {{0}};
    cr_assert_eq(rans_model_check(&good, &err), 0);

#define EXPECT_BAD(mutation, word)                                                                 \
    do {                                                                                           \
        m = good;                                                                                  \
        mutation;                                                                                  \
        err.msg[0] = '\0';                                                                         \
        cr_assert_eq(rans_model_check(&m, &err), -1, "accepted: " #mutation);                      \
        cr_assert(strstr(err.msg, word) != NULL, "%s: %s", #mutation, err.msg);                    \
    } while (0)

    EXPECT_BAD(m.n_symbols = 0, "symbols");
    EXPECT_BAD(m.n_symbols = RANS_MAX_SYMBOLS + 1, "symbols");
    EXPECT_BAD(m.n_symbols = 19, "sum"); /* cum checks pass, total short */
    EXPECT_BAD(m.n_symbols = 21, "frequency 0");
    EXPECT_BAD((m.freq[3] = 0, m.cum[4] = m.cum[3]), "frequency 0");
    EXPECT_BAD(m.freq[5]++, "cum");
    EXPECT_BAD((m.freq[5]++, m.freq[6]--), "cum");
    EXPECT_BAD(m.cum[0] = 1, "cum[0]");
    EXPECT_BAD(m.cum[20] = 0, "cum");
    EXPECT_BAD(m.coarse[200] = (uint8_t)(m.coarse[200] + 1), "coarse");
    EXPECT_BAD(m.coarse[0] = 5, "coarse");
    /* Frequencies whose sum wraps 16 bits back to exactly the scale (4 x 2^14 + 2^14), with cum
     * following them modulo 2^16: the sum is checked in 32 bits. */
    EXPECT_BAD((m.n_symbols = 5, m.freq[0] = m.freq[1] = m.freq[2] = m.freq[3] = m.freq[4] = 16384,
                m.cum[1] = 16384, m.cum[2] = 32768, m.cum[3] = 49152, m.cum[4] = 0,
                m.cum[5] = 16384),
               "cum");
#undef EXPECT_BAD
}

Test(rans_model, cost_bits) {
    rans_model m;
    build_uniform(&m, 4);
    uint64_t counts[4] = {1, 2, 3, 4};
    cr_assert_float_eq(rans_cost_bits(&m, counts), 20.0, 1e-9);
    uint64_t none[4] = {0};
    cr_assert_float_eq(rans_cost_bits(&m, none), 0.0, 1e-12);
}

/* ---------------------------------------------------------------- encoder errors */

Test(rans_encode, rejects_bad_ctx_and_symbol) {
    rans_model models[2];
    build_uniform(&models[0], 4);
    build_uniform(&models[1], 16);
    uint8_t out[64];
    kv_error err = {{0}};
    uint8_t syms[3] = {1, 9, 2};
    uint32_t ctx_ok[3] = {0, 1, 0}, ctx_bad[3] = {0, 2, 0}, ctx_small[3] = {0, 0, 0};
    cr_assert_gt(rans_encode(syms, ctx_ok, 3, models, 2, out, sizeof out, &err), 0, "%s", err.msg);
    cr_assert_eq(rans_encode(syms, ctx_bad, 3, models, 2, out, sizeof out, &err), -1);
    cr_assert(strstr(err.msg, "ctx[1] = 2") != NULL, "%s", err.msg);
    cr_assert_eq(rans_encode(syms, ctx_small, 3, models, 2, out, sizeof out, &err), -1);
    cr_assert(strstr(err.msg, "symbol 1 = 9") != NULL, "%s", err.msg);
    cr_assert_eq(rans_encode(syms, NULL, 3, models, 0, out, sizeof out, &err), -1);
    cr_assert(strstr(err.msg, "0 models") != NULL, "%s", err.msg);
}

/* Every capacity below the stream's length fails cleanly (never writes outside out[0..cap):
 * ASan checks the exact-size buffers); the exact length succeeds with the same bytes. */
Test(rans_encode, capacity_too_small_at_every_size) {
    rans_model models[N_MIX];
    build_mix(models);
    size_t n = 300;
    uint8_t syms[300];
    uint32_t ctx[300];
    make_data(models, N_MIX, n, 3, syms, ctx);
    uint8_t *ref;
    int64_t len = round_trip(syms, ctx, n, models, N_MIX, &ref);
    kv_error err = {{0}};
    for (size_t cap = 0; cap <= (size_t)len; cap++) {
        uint8_t *out = malloc(cap ? cap : 1);
        int64_t got = rans_encode(syms, ctx, n, models, N_MIX, out, cap, &err);
        if (cap < (size_t)len) {
            cr_assert_eq(got, -1, "capacity %zu of %lld accepted", cap, (long long)len);
            cr_assert(strstr(err.msg, "capacity") != NULL, "%s", err.msg);
        } else {
            cr_assert_eq(got, len);
            cr_assert_eq(memcmp(out, ref, (size_t)len), 0);
        }
        free(out);
    }
    free(ref);
}

Test(rans_encode, bound) {
    cr_assert_eq(rans_encode_bound(0), RANS_STATE_BYTES);
    cr_assert_eq(rans_encode_bound(10), 28);
    cr_assert_eq(rans_encode_bound(SIZE_MAX / 2), SIZE_MAX);
    /* The worst case: a stream of freq-1 symbols (14 bits each) stays within the bound. */
    uint64_t counts[2] = {UINT64_MAX, 0};
    rans_model m;
    build(&m, counts, 2);
    uint8_t syms[1000];
    memset(syms, 1, sizeof syms);
    int64_t len = round_trip(syms, NULL, 1000, &m, 1, NULL);
    cr_assert_leq((size_t)len, rans_encode_bound(1000));
    cr_assert_geq(len, 1000 * 14 / 8);
}

/* ---------------------------------------------------------------- decoder errors */

struct stream_fixture {
    rans_model models[N_MIX];
    size_t n;
    uint8_t *syms;
    uint32_t *ctx;
    uint8_t *stream;
    size_t len;
    uint8_t *back;
};

/* Which of the mix's models the fixture's contexts use: all 8, or only the Laplace-shaped ones
 * (calibrated KV statistics), leaving out the power-of-two uniform ones. */
enum fixture_models { ALL_MODELS, LAPLACE_ONLY };

static void fixture_make(struct stream_fixture *f, size_t n, uint64_t seed,
                         enum fixture_models which) {
    build_mix(f->models);
    f->n = n;
    f->syms = malloc(n);
    f->ctx = malloc(n * sizeof *f->ctx);
    f->back = malloc(n);
    cr_assert(f->syms && f->ctx && f->back);
    static const uint32_t laplace[4] = {0, 1, 2, 7};
    if (which == LAPLACE_ONLY)
        make_data_from(f->models, laplace, 4, n, seed, f->syms, f->ctx);
    else
        make_data(f->models, N_MIX, n, seed, f->syms, f->ctx);
    f->len = (size_t)round_trip(f->syms, f->ctx, n, f->models, N_MIX, &f->stream);
}

static void fixture_free(struct stream_fixture *f) {
    free(f->syms);
    free(f->ctx);
    free(f->stream);
    free(f->back);
}

/* Decodes a private copy of exactly len bytes, so ASan sees any read past the end. */
static int decode_copy(struct stream_fixture *f, const uint8_t *bytes, size_t len, size_t n,
                       kv_error *err) {
    uint8_t *copy = malloc(len ? len : 1);
    memcpy(copy, bytes, len);
    int rc = rans_decode(copy, len, f->ctx, n, f->models, N_MIX, f->back, err);
    free(copy);
    return rc;
}

Test(rans_decode, truncated_at_every_cut_point) {
    struct stream_fixture f;
    fixture_make(&f, 200, 11, ALL_MODELS);
    int rejected = 0;
    for (size_t cut = 0; cut < f.len; cut++) {
        kv_error err = {{0}};
        int rc = decode_copy(&f, f.stream, cut, f.n, &err);
        cr_assert(rc == 0 || rc == -1);
        if (rc == -1) {
            rejected++;
            cr_assert(err.msg[0] != '\0', "cut %zu: no message", cut);
        }
    }
    /* Decoding a prefix would need a different symbol sequence with this exact encoding. */
    cr_assert_eq(rejected, (int)f.len, "only %d of %zu truncations rejected", rejected, f.len);
    kv_error err = {{0}};
    decode_copy(&f, f.stream, 5, f.n, &err);
    cr_assert(strstr(err.msg, "truncated") != NULL, "%s", err.msg);
    decode_copy(&f, f.stream, f.len - 1, f.n, &err);
    cr_assert(strstr(err.msg, "truncated") != NULL || strstr(err.msg, "final state") != NULL, "%s",
              err.msg);
    fixture_free(&f);
}

Test(rans_decode, trailing_bytes) {
    struct stream_fixture f;
    fixture_make(&f, 500, 12, ALL_MODELS);
    uint8_t *longer = malloc(f.len + 3);
    memcpy(longer, f.stream, f.len);
    memset(longer + f.len, 0, 3);
    kv_error err = {{0}};
    cr_assert_eq(decode_copy(&f, longer, f.len + 3, f.n, &err), -1);
    cr_assert(strstr(err.msg, "3 trailing bytes") != NULL, "%s", err.msg);
    free(longer);
    fixture_free(&f);
}

Test(rans_decode, bad_initial_state) {
    struct stream_fixture f;
    fixture_make(&f, 100, 13, ALL_MODELS);
    uint8_t *bad = malloc(f.len);
    kv_error err = {{0}};
    memcpy(bad, f.stream, f.len);
    bad[3] = 0x80; /* state 0 >= 2^31 */
    cr_assert_eq(decode_copy(&f, bad, f.len, f.n, &err), -1);
    cr_assert(strstr(err.msg, "out of range") != NULL, "%s", err.msg);
    memcpy(bad, f.stream, f.len);
    memset(bad + 4, 0, 4); /* state 1 = 0 */
    cr_assert_eq(decode_copy(&f, bad, f.len, f.n, &err), -1);
    cr_assert(strstr(err.msg, "out of range") != NULL, "%s", err.msg);
    free(bad);
    fixture_free(&f);
}

Test(rans_decode, ctx_out_of_range) {
    struct stream_fixture f;
    fixture_make(&f, 1000, 14, ALL_MODELS);
    const size_t where[] = {0, 1, 500, 998, 999}; /* main loop, both states, checked tail */
    for (size_t k = 0; k < 5; k++) {
        uint32_t saved = f.ctx[where[k]];
        f.ctx[where[k]] = N_MIX;
        kv_error err = {{0}};
        cr_assert_eq(decode_copy(&f, f.stream, f.len, f.n, &err), -1);
        char want[64];
        snprintf(want, sizeof want, "ctx[%zu] = %d out of range", where[k], N_MIX);
        cr_assert(strstr(err.msg, want) != NULL, "%s", err.msg);
        f.ctx[where[k]] = saved;
    }
    fixture_free(&f);
}

/* Decoding with another n, or other contexts, than the encoder used fails. */
Test(rans_decode, mismatched_count_or_contexts) {
    struct stream_fixture f;
    fixture_make(&f, 1000, 15, ALL_MODELS);
    kv_error err = {{0}};
    cr_assert_eq(decode_copy(&f, f.stream, f.len, f.n - 1, &err), -1);
    cr_assert_eq(decode_copy(&f, f.stream, f.len, f.n - 2, &err), -1);
    uint8_t *more = realloc(f.back, f.n + 1);
    cr_assert_not_null(more);
    f.back = more;
    uint32_t *ctx = realloc(f.ctx, (f.n + 1) * sizeof *ctx);
    cr_assert_not_null(ctx);
    f.ctx = ctx;
    f.ctx[f.n] = 0;
    cr_assert_eq(decode_copy(&f, f.stream, f.len, f.n + 1, &err), -1);
    for (size_t i = 0; i < f.n; i++) f.ctx[i] = (f.ctx[i] + 1) % N_MIX;
    cr_assert_eq(decode_copy(&f, f.stream, f.len, f.n, &err), -1);
    fixture_free(&f);
}

/* 1000 random single-byte flips of a 10^4-symbol stream coded with KV-shaped (Laplace) models:
 * the final-state and length checks must reject at least 99%. A flip passes only when the
 * decoder's states merge back, which takes two symbols of equal frequency (their slots differ
 * by a translation the flip can hit). An undetected flip still decodes n symbols in range. */
static int count_detected_flips(struct stream_fixture *f, int trials, uint64_t seed) {
    uint8_t *bad = malloc(f->len);
    uint64_t rng = seed;
    int detected = 0;
    for (int t = 0; t < trials; t++) {
        memcpy(bad, f->stream, f->len);
        size_t pos = rng_next(&rng) % f->len;
        bad[pos] ^= (uint8_t)(1 + rng_next(&rng) % 255);
        kv_error err = {{0}};
        if (decode_copy(f, bad, f->len, f->n, &err) == -1) {
            detected++;
            cr_assert(err.msg[0] != '\0');
        } else {
            for (size_t i = 0; i < f->n; i++)
                cr_assert_lt(f->back[i], f->models[f->ctx[i]].n_symbols);
        }
    }
    free(bad);
    return detected;
}

Test(rans_decode, detects_single_byte_flips) {
    struct stream_fixture f;
    fixture_make(&f, 10000, 16, LAPLACE_ONLY);
    int trials = 1000, detected = count_detected_flips(&f, trials, 2024);
    fprintf(stderr, "rans corruption: %d of %d single-byte flips detected (%zu-byte stream)\n",
            detected, trials, f.len);
    cr_assert_geq(detected, trials * 99 / 100, "only %d of %d flips detected", detected, trials);
    fixture_free(&f);
}

/* The limit of that check: a uniform model over a power of two is raw bits (decoding takes
 * log2(n) bits out of the state and leaves the rest as it was), so a flip inside them only
 * changes symbols. The mix below spends ~1/3 of its bits in such models; flips are still
 * decoded safely (in-range output) or rejected. A record that needs integrity needs a checksum. */
Test(rans_decode, flips_in_raw_bits_pass_unnoticed) {
    struct stream_fixture f;
    fixture_make(&f, 10000, 18, ALL_MODELS);
    int trials = 1000, detected = count_detected_flips(&f, trials, 77);
    fprintf(stderr,
            "rans corruption: %d of %d single-byte flips detected with power-of-two uniform "
            "models in the mix\n",
            detected, trials);
    cr_assert_lt(detected, trials, "raw bits cannot all be checked");
    cr_assert_gt(detected, trials / 2);
    fixture_free(&f);
}

/* Random bytes of every small length, decoded as 0..64 symbols: never a crash or a read out of
 * bounds (ASan), and almost always rejected. */
Test(rans_decode, random_garbage) {
    struct stream_fixture f;
    fixture_make(&f, 64, 17, ALL_MODELS);
    uint64_t rng = 31337;
    uint8_t buf[256];
    int accepted = 0;
    for (int t = 0; t < 20000; t++) {
        size_t len = rng_next(&rng) % sizeof buf;
        for (size_t i = 0; i < len; i++) buf[i] = (uint8_t)rng_next(&rng);
        /* In-range states half the time, so the decoder gets past them. */
        if (len >= 8 && (t & 1))
            for (int k = 0; k < 2; k++) {
                uint32_t x = RANS_L + (uint32_t)(rng_next(&rng) % (255u * RANS_L));
                for (int b = 0; b < 4; b++) buf[4 * k + b] = (uint8_t)(x >> (8 * b));
            }
        size_t n = rng_next(&rng) % (f.n + 1);
        kv_error err = {{0}};
        if (decode_copy(&f, buf, len, n, &err) == 0) accepted++;
    }
    cr_assert_lt(accepted, 20, "%d random streams accepted", accepted);
    fixture_free(&f);
}

/* ---------------------------------------------------------------- speed (reported only) */

static void report_speed(const char *name, const rans_model *models, int n_models, int ctx_mode,
                         size_t n) {
    uint8_t *syms = malloc(n), *back = malloc(n);
    uint32_t *ctx = malloc(n * sizeof *ctx);
    size_t cap = rans_encode_bound(n);
    uint8_t *out = malloc(cap);
    cr_assert(syms && back && ctx && out);
    uint64_t rng = 4242;
    for (size_t i = 0; i < n; i++) {
        /* 0: one model; 1: cycling through all models (token-major order over channels). */
        ctx[i] = ctx_mode == 0 ? 0 : (uint32_t)(i % (size_t)n_models);
        syms[i] = draw(&models[ctx[i]], &rng);
    }
    kv_error err = {{0}};
    uint64_t best_enc = UINT64_MAX, best_dec = UINT64_MAX;
    int64_t len = 0;
    for (int rep = 0; rep < 5; rep++) {
        uint64_t t0 = clock_now_ns();
        len = rans_encode(syms, ctx, n, models, (size_t)n_models, out, cap, &err);
        uint64_t t1 = clock_now_ns();
        cr_assert_gt(len, 0, "%s", err.msg);
        cr_assert_eq(rans_decode(out, (size_t)len, ctx, n, models, (size_t)n_models, back, &err), 0,
                     "%s", err.msg);
        uint64_t t2 = clock_now_ns();
        if (t1 - t0 < best_enc) best_enc = t1 - t0;
        if (t2 - t1 < best_dec) best_dec = t2 - t1;
    }
    cr_assert_eq(memcmp(syms, back, n), 0);
    double ideal = ideal_bits(syms, ctx, n, models, n_models);
    fprintf(stderr,
            "rans speed: %-34s %.3f bits/symbol (%+.3f%% vs ideal): encode %.1f M symbols/s, "
            "decode %.1f M symbols/s\n",
            name, len * 8.0 / n, ideal > 0 ? 100.0 * (len * 8.0 - ideal) / ideal : 0.0,
            n / (best_enc / 1e9) / 1e6, n / (best_dec / 1e9) / 1e6);
    free(syms);
    free(back);
    free(ctx);
    free(out);
}

Test(rans_speed, encode_decode, .timeout = 120) {
    size_t n = 4000000;
    rans_model *models = malloc(4096 * sizeof *models);
    cr_assert_not_null(models);
    build_laplace(&models[0], 16, 0.7);
    report_speed("16-symbol Laplace, one model", models, 1, 0, n);
    build_laplace(&models[0], 32, 3.0);
    report_speed("32-symbol skewed, one model", models, 1, 0, n);
    build_uniform(&models[0], 256);
    report_speed("256-symbol uniform, one model", models, 1, 0, n);
    build_laplace(&models[0], 256, 0.05);
    report_speed("256-symbol Laplace, one model", models, 1, 0, n);
    for (int k = 0; k < 4096; k++) build_laplace(&models[k], 16, 0.5 + 0.4 * (k % 7) / 6.0);
    report_speed("16-symbol, 4096 models cycling", models, 4096, 1, n);
    free(models);
}
