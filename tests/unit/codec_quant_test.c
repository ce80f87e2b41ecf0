/* CacheGen's quantization stage: anchor + delta round trips within each element's bound, exact
 * escapes, the locality that makes deltas small, corrupt input refused; and the uniform
 * per-token baselines (fp16 exact, 8 and 4 bits within half a step). */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cache/codec/codec_quant.h"
#include "kernels/quant.h"

static uint64_t g_rng = 0x9E3779B97F4A7C15ull;
static double uniform01(void) {
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (double)(g_rng >> 11) / 9007199254740992.0;
}
static double gauss(void) {
    double u = uniform01() + 1e-12, v = uniform01();
    return sqrt(-2 * log(u)) * cos(6.283185307179586 * v);
}

/* KV-like data: per channel a level and a scale, tokens a slow random walk around it (token-wise
 * locality), values rounded to f16 as the pool stores them. */
static float *make_chunk(const codec_shape *sh, float *scale, double walk) {
    size_t n = (size_t)codec_shape_elems(sh);
    float *x = malloc(n * sizeof *x);
    cr_assert_not_null(x);
    for (int l = 0; l < sh->n_layer; l++)
        for (int kv = 0; kv < 2; kv++)
            for (int c = 0; c < sh->n_chan; c++) {
                float s = (float)(0.2 + 2 * uniform01());
                scale[((size_t)l * 2 + kv) * sh->n_chan + c] = s;
                double v = gauss() * s;
                for (int t = 0; t < sh->n_tok; t++) {
                    v += gauss() * s * walk;
                    size_t i = (((size_t)l * 2 + kv) * sh->n_tok + t) * sh->n_chan + c;
                    x[i] = fp16_to_fp32(fp32_to_fp16((float)v));
                }
            }
    return x;
}

static void level_fill(codec_level *lv, int group, float anchor, float delta, float growth,
                       int n_layer) {
    memset(lv, 0, sizeof *lv);
    lv->group = group;
    for (int l = 0; l < n_layer; l++)
        for (int kv = 0; kv < 2; kv++) {
            float g = 1 + growth * (float)l / (float)n_layer; /* coarser with depth */
            lv->anchor_bin[l][kv] = anchor * g;
            lv->delta_bin[l][kv] = delta * g;
        }
}

typedef struct round_trip {
    size_t n_esc;
    double center_share; /* delta symbols that are 0 */
} round_trip;

static round_trip check_round_trip(const codec_shape *sh, const float *x, const float *scale,
                                   const codec_level *lv) {
    size_t n = (size_t)codec_shape_elems(sh);
    uint8_t *sym = malloc(n);
    uint16_t *esc = malloc(n * sizeof *esc);
    float *y = malloc(n * sizeof *y);
    kv_error err = {{0}};
    int64_t n_esc = codec_quantize(x, sh, scale, NULL, lv, NULL, sym, esc, n, &err);
    cr_assert_geq(n_esc, 0, "%s", err.msg);
    cr_assert_eq(codec_dequantize(sym, esc, (size_t)n_esc, sh, scale, NULL, lv, y, &err), 0, "%s",
                 err.msg);
    size_t deltas = 0, centered = 0;
    for (int l = 0; l < sh->n_layer; l++)
        for (int kv = 0; kv < 2; kv++)
            for (int t = 0; t < sh->n_tok; t++)
                for (int c = 0; c < sh->n_chan; c++) {
                    size_t i = (((size_t)l * 2 + kv) * sh->n_tok + t) * sh->n_chan + c;
                    float bound = codec_error_bound(sh, scale, lv, l, kv, t, c);
                    float e = fabsf(y[i] - x[i]);
                    /* float rounding of v / step and q * step: a few ulps of the value */
                    cr_assert_leq(e, bound * (1 + 1e-5f) + fabsf(x[i]) * 1e-6f,
                                  "layer %d kv %d token %d chan %d: |%g - %g| > %g", l, kv, t, c,
                                  y[i], x[i], bound);
                    if (!codec_is_anchor(t, lv->group)) {
                        deltas++;
                        centered += sym[i] == CODEC_DELTA_RADIUS;
                    }
                }
    free(sym);
    free(esc);
    free(y);
    return (round_trip){(size_t)n_esc, deltas ? (double)centered / (double)deltas : 0};
}

Test(codec_quant, round_trip_within_bounds_at_every_level) {
    codec_shape sh = {.n_layer = 6, .n_tok = 57, .n_chan = 48};
    float *scale = malloc(sizeof(float) * 6 * 2 * 48);
    float *x = make_chunk(&sh, scale, 0.05);
    const float bins[][2] = {{0.01f, 0.02f}, {0.02f, 0.1f}, {0.05f, 0.3f}, {0.1f, 0.8f}};
    for (int k = 0; k < 4; k++)
        for (int group = 0; group <= 16; group += 5) {
            codec_level lv;
            level_fill(&lv, group, bins[k][0], bins[k][1], 1.0f, sh.n_layer);
            check_round_trip(&sh, x, scale, &lv);
        }
    free(x);
    free(scale);
}

Test(codec_quant, group_zero_codes_against_centres_and_exact_tokens_are_exact) {
    codec_shape sh = {.n_layer = 2, .n_tok = 30, .n_chan = 16};
    float scale[2 * 2 * 16], center[2 * 2 * 16];
    float *x = make_chunk(&sh, scale, 0.3);
    for (int i = 0; i < 2 * 2 * 16; i++) center[i] = (float)(i % 7) - 3.0f;
    for (int l = 0; l < 2; l++) /* move every channel to its centre */
        for (int kv = 0; kv < 2; kv++)
            for (int t = 0; t < 30; t++)
                for (int c = 0; c < 16; c++) {
                    float *v = &x[(((size_t)l * 2 + kv) * 30 + t) * 16 + c];
                    *v = fp16_to_fp32(fp32_to_fp16(*v + center[(l * 2 + kv) * 16 + c]));
                }
    codec_level lv;
    level_fill(&lv, 0, 0.5f, 0.5f, 0, 2);
    size_t n = (size_t)codec_shape_elems(&sh);
    uint8_t *sym = malloc(n), *sym0 = malloc(n);
    uint16_t *esc = malloc(n * sizeof *esc);
    float *y = malloc(n * sizeof *y);
    kv_error err = {{0}};
    uint8_t exact[30] = {1, 1}; /* tokens 0 and 1 */
    int64_t n_esc = codec_quantize(x, &sh, scale, center, &lv, exact, sym, esc, n, &err);
    cr_assert_geq(n_esc, 2 * 2 * 2 * 16, "%s", err.msg); /* two tokens of every (layer, kv) */
    cr_assert_eq(codec_dequantize(sym, esc, (size_t)n_esc, &sh, scale, center, &lv, y, &err), 0,
                 "%s", err.msg);
    size_t near = 0, coded = 0;
    for (int l = 0; l < 2; l++)
        for (int kv = 0; kv < 2; kv++)
            for (int t = 0; t < 30; t++)
                for (int c = 0; c < 16; c++) {
                    size_t i = (((size_t)l * 2 + kv) * 30 + t) * 16 + c;
                    if (t < 2) {
                        cr_assert_eq(y[i], x[i], "token %d not exact", t);
                        cr_assert_eq(sym[i], CODEC_DELTA_ESCAPE);
                        continue;
                    }
                    cr_assert_leq(fabsf(y[i] - x[i]),
                                  0.25f * scale[(l * 2 + kv) * 16 + c] * 1.0001f);
                    coded++;
                    near += abs((int)sym[i] - CODEC_DELTA_RADIUS) <= 3;
                }
    /* symbols count steps from the centre: without the centres the same data lands farther
     * from the middle of the alphabet (the channels sit up to 3 away from 0) */
    int64_t n0 = codec_quantize(x, &sh, scale, NULL, &lv, NULL, sym0, esc, n, &err);
    cr_assert_geq(n0, 0);
    long with = 0, without = 0;
    for (size_t i = 0; i < n; i++) {
        if (sym[i] != CODEC_DELTA_ESCAPE) with += abs((int)sym[i] - CODEC_DELTA_RADIUS);
        if (sym0[i] != CODEC_DELTA_ESCAPE) without += abs((int)sym0[i] - CODEC_DELTA_RADIUS);
    }
    cr_assert_lt(with * 3, without * 2, "distance from the middle: %ld with centres, %ld without",
                 with, without);
    cr_assert_gt(near, 0);
    free(sym);
    free(sym0);
    free(esc);
    free(y);
    free(x);
}

Test(codec_quant, locality_makes_deltas_small) {
    codec_shape sh = {.n_layer = 2, .n_tok = 100, .n_chan = 64};
    float scale[2 * 2 * 64];
    float *smooth = make_chunk(&sh, scale, 0.01);
    codec_level lv;
    level_fill(&lv, 10, 0.02f, 0.2f, 0, sh.n_layer);
    round_trip a = check_round_trip(&sh, smooth, scale, &lv);
    float *rough = make_chunk(&sh, scale, 0.5);
    round_trip b = check_round_trip(&sh, rough, scale, &lv);
    cr_assert_gt(a.center_share, 0.5, "smooth data: %.2f of deltas at 0", a.center_share);
    cr_assert_lt(b.center_share, a.center_share / 2, "rough %.2f vs smooth %.2f", b.center_share,
                 a.center_share);
    free(smooth);
    free(rough);
}

Test(codec_quant, outliers_escape_exactly) {
    codec_shape sh = {.n_layer = 1, .n_tok = 20, .n_chan = 8};
    float scale[16];
    float *x = make_chunk(&sh, scale, 0.01);
    x[3] = 60000.0f;                  /* anchor far out of range */
    x[(size_t)5 * 8 + 2] = -30000.0f; /* a delta far out of range */
    x[(size_t)20 * 8 + 1] = NAN;      /* V anchor: not finite */
    codec_level lv;
    level_fill(&lv, 10, 0.02f, 0.2f, 0, 1);
    size_t n = (size_t)codec_shape_elems(&sh);
    uint8_t sym[320];
    uint16_t esc[320];
    float y[320];
    kv_error err = {{0}};
    int64_t n_esc = codec_quantize(x, &sh, scale, NULL, &lv, NULL, sym, esc, n, &err);
    cr_assert_geq(n_esc, 3, "%s", err.msg);
    cr_assert_eq(sym[3], CODEC_ANCHOR_ESCAPE);
    cr_assert_eq(sym[5 * 8 + 2], CODEC_DELTA_ESCAPE);
    cr_assert_eq(codec_dequantize(sym, esc, (size_t)n_esc, &sh, scale, NULL, &lv, y, &err), 0);
    cr_assert_eq(y[3], 60000.0f);
    cr_assert_eq(y[5 * 8 + 2], -30000.0f);
    cr_assert(isnan(y[20 * 8 + 1]));
    /* a too-small escape buffer is an error, not an overflow */
    cr_assert_eq(codec_quantize(x, &sh, scale, NULL, &lv, NULL, sym, esc, 1, &err), -1);
    free(x);
}

Test(codec_quant, corrupt_input_is_refused) {
    codec_shape sh = {.n_layer = 1, .n_tok = 12, .n_chan = 4};
    float scale[8];
    float *x = make_chunk(&sh, scale, 0.05);
    codec_level lv;
    level_fill(&lv, 4, 0.02f, 0.2f, 0, 1);
    uint8_t sym[96];
    uint16_t esc[96];
    float y[96];
    kv_error err = {{0}};
    int64_t n_esc = codec_quantize(x, &sh, scale, NULL, &lv, NULL, sym, esc, 96, &err);
    cr_assert_eq(n_esc, 0, "%s", err.msg);
    uint8_t bad[96];
    memcpy(bad, sym, sizeof bad);
    bad[5] = CODEC_DELTA_ESCAPE + 1; /* token 1 is a delta: out of its alphabet */
    cr_assert_eq(codec_dequantize(bad, esc, 0, &sh, scale, NULL, &lv, y, &err), -1);
    cr_assert(strstr(err.msg, "out of range"), "%s", err.msg);
    memcpy(bad, sym, sizeof bad);
    bad[5] = CODEC_DELTA_ESCAPE; /* an escape with none stored */
    cr_assert_eq(codec_dequantize(bad, esc, 0, &sh, scale, NULL, &lv, y, &err), -1);
    cr_assert(strstr(err.msg, "more escapes"), "%s", err.msg);
    cr_assert_eq(codec_dequantize(sym, esc, 2, &sh, scale, NULL, &lv, y, &err), -1); /* unused */
    codec_level zero = lv;
    zero.delta_bin[0][1] = 0;
    cr_assert_eq(codec_dequantize(sym, esc, 0, &sh, scale, NULL, &zero, y, &err), -1);
    scale[3] = -1;
    cr_assert_eq(codec_dequantize(sym, esc, 0, &sh, scale, NULL, &lv, y, &err), -1);
    codec_shape big = {.n_layer = CODEC_MAX_LAYERS + 1, .n_tok = 1, .n_chan = 1};
    cr_assert_eq(codec_shape_elems(&big), -1);
    free(x);
}

Test(codec_quant, uniform_baselines) {
    codec_shape sh = {.n_layer = 3, .n_tok = 16, .n_chan = 33};
    float scale[3 * 2 * 33];
    float *x = make_chunk(&sh, scale, 0.2);
    size_t n = (size_t)codec_shape_elems(&sh);
    float *y = malloc(n * sizeof *y);
    const int bits[] = {16, 8, 4};
    size_t rows = (size_t)3 * 2 * 16;
    cr_assert_eq(codec_uniform_bytes(&sh, 16), n * 2);
    cr_assert_eq(codec_uniform_bytes(&sh, 8), rows * (4 + 33));
    cr_assert_eq(codec_uniform_bytes(&sh, 4), rows * (4 + 17));
    cr_assert_eq(codec_uniform_bytes(&sh, 3), 0);
    for (int k = 0; k < 3; k++) {
        size_t len = codec_uniform_bytes(&sh, bits[k]);
        uint8_t *buf = malloc(len);
        kv_error err = {{0}};
        cr_assert_eq(codec_uniform_encode(x, &sh, bits[k], buf, &err), 0, "%s", err.msg);
        cr_assert_eq(codec_uniform_decode(buf, len, &sh, bits[k], y, &err), 0, "%s", err.msg);
        cr_assert_eq(codec_uniform_decode(buf, len - 1, &sh, bits[k], y, &err), -1);
        for (size_t r = 0; r < rows; r++) {
            const float *xr = x + r * 33, *yr = y + r * 33;
            float lo = xr[0], hi = xr[0];
            for (int c = 1; c < 33; c++) {
                lo = fminf(lo, xr[c]);
                hi = fmaxf(hi, xr[c]);
            }
            /* half a step, plus the f16 rounding of min and step */
            float tol = bits[k] == 16 ? 0
                                      : (hi - lo) / (float)((1 << bits[k]) - 1) * 0.51f +
                                            (fabsf(lo) + fabsf(hi)) * 2e-3f;
            for (int c = 0; c < 33; c++)
                cr_assert_leq(fabsf(yr[c] - xr[c]), tol, "%d bits row %zu chan %d: %g vs %g",
                              bits[k], r, c, yr[c], xr[c]);
        }
        free(buf);
    }
    free(x);
    free(y);
}
