/* Quantized kernels (kernels/quant.h) against an independent reference and against each other.
 *
 * The goldens (tests/golden/quant, from scripts/ref/make_quant_goldens.py) come from the PyPI
 * gguf package: blocks of every weight type, gguf's dequantization of them, activation rows and
 * float64 dot products. Checks:
 *   - dequantize_row equals gguf bit for bit, at every SIMD level;
 *   - fp16/bf16 conversions equal numpy's (all 65536 halves; ties, overflow, subnormals, NaN);
 *   - quantize_row_act gives the same bytes at every level and stays within half a step;
 *   - the scalar dot reference equals the float64 dot of gguf's dequantized weights with the
 *     dequantized activation (what the kernel is asked to compute, up to float rounding), and
 *     the f32-activation golden within the activation quantization error;
 *   - dot_tile at every level and every (nw, nx) in 1..4 x 1..4, with odd strides, equals the
 *     scalar reference within a float-rounding bound. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/backend.h"
#include "kernels/quant.h"

#define GOLDEN_DIR "tests/golden/quant/"

/* ---------------------------------------------------------------- helpers */

typedef struct golden {
    tensor_type type;
    int n, rows, nx;
    size_t row_bytes;
    uint8_t *w;    /* [rows][row_bytes] */
    float *deq;    /* [rows][n] */
    float *x;      /* [nx][n] */
    double *dot;   /* [nx][rows] */
    uint8_t *file; /* owns the above */
} golden;

static uint8_t *read_file(const char *path, size_t *size) {
    FILE *f = fopen(path, "rb");
    cr_assert(f, "cannot open %s (run from the repository root)", path);
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *buf = malloc((size_t)len);
    cr_assert(buf && fread(buf, 1, (size_t)len, f) == (size_t)len, "cannot read %s", path);
    fclose(f);
    *size = (size_t)len;
    return buf;
}

static uint32_t rd32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static golden golden_load(tensor_type t) {
    char path[256];
    snprintf(path, sizeof path, GOLDEN_DIR "%s.bin", tensor_type_get((int)t)->name);
    size_t size;
    golden g = {.type = t};
    g.file = read_file(path, &size);
    cr_assert(size >= 24 && memcmp(g.file, "KVQG", 4) == 0 && rd32(g.file + 4) == 1, "%s", path);
    cr_assert_eq(rd32(g.file + 8), (uint32_t)t);
    g.n = (int)rd32(g.file + 12);
    g.rows = (int)rd32(g.file + 16);
    g.nx = (int)rd32(g.file + 20);
    g.row_bytes = tensor_row_size(t, g.n);
    cr_assert(g.row_bytes > 0 && g.rows >= 4 && g.nx >= 4);
    size_t off = 24;
    g.w = g.file + off;
    off += (size_t)g.rows * g.row_bytes;
    /* The f32/f64 sections are copied out: the file offsets need not be aligned. */
    size_t deq_bytes = (size_t)g.rows * g.n * 4, x_bytes = (size_t)g.nx * g.n * 4;
    size_t dot_bytes = (size_t)g.nx * g.rows * 8;
    cr_assert_eq(size, off + deq_bytes + x_bytes + dot_bytes, "%s size", path);
    g.deq = malloc(deq_bytes);
    g.x = malloc(x_bytes);
    g.dot = malloc(dot_bytes);
    memcpy(g.deq, g.file + off, deq_bytes);
    memcpy(g.x, g.file + off + deq_bytes, x_bytes);
    memcpy(g.dot, g.file + off + deq_bytes + x_bytes, dot_bytes);
    return g;
}

static void golden_free(golden *g) {
    free(g->file);
    free(g->deq);
    free(g->x);
    free(g->dot);
}

static const tensor_type WEIGHT_TYPES[] = {
    TENSOR_TYPE_F32,  TENSOR_TYPE_F16,  TENSOR_TYPE_BF16, TENSOR_TYPE_Q4_0,
    TENSOR_TYPE_Q4_1, TENSOR_TYPE_Q5_0, TENSOR_TYPE_Q5_1, TENSOR_TYPE_Q8_0,
    TENSOR_TYPE_Q4_K, TENSOR_TYPE_Q5_K, TENSOR_TYPE_Q6_K,
};
#define N_WEIGHT_TYPES (int)(sizeof WEIGHT_TYPES / sizeof WEIGHT_TYPES[0])

static uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Deterministic xorshift for the tests' own random data. */
static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint32_t rng_u32(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 16);
}
static float rng_normal(void) {
    float s = 0;
    for (int i = 0; i < 4; i++) s += (float)(rng_u32() % 100000) / 100000.0f - 0.5f;
    return s * 1.7f;
}

static simd_level max_level(void) { return simd_level_detect(); }

static void restore_level(void) { simd_level_set(simd_level_detect()); }

/* ---------------------------------------------------------------- level selection */

Test(quant, simd_level_set_clamps_and_names) {
    simd_level max = simd_level_detect();
    cr_assert_eq(simd_level_set(SIMD_LEVEL_SCALAR), SIMD_LEVEL_SCALAR);
    cr_assert_eq(simd_level_get(), SIMD_LEVEL_SCALAR);
    cr_assert_eq(simd_level_set(SIMD_LEVEL_AVX512), max);
    cr_assert_eq(simd_level_get(), max);
    cr_assert_str_eq(simd_level_name(SIMD_LEVEL_SCALAR), "scalar");
    cr_assert_str_eq(simd_level_name(SIMD_LEVEL_AVX2), "avx2");
    cr_assert_str_eq(simd_level_name(SIMD_LEVEL_AVX512), "avx512");
    cr_log_info("quant: this CPU supports %s", simd_level_name(max));
    restore_level();
}

/* ---------------------------------------------------------------- conversions */

Test(quant, fp16_bf16_conversions_match_numpy) {
    size_t size;
    uint8_t *f = read_file(GOLDEN_DIR "conv.bin", &size);
    cr_assert(memcmp(f, "KVQC", 4) == 0 && rd32(f + 4) == 1);
    const uint32_t m = rd32(f + 8);
    cr_assert_eq(size, 12 + 65536 * 4 + (size_t)m * 6);
    const uint8_t *h2f = f + 12, *fin = h2f + 65536 * 4, *hout = fin + (size_t)m * 4;

    uint16_t *halves = malloc(65536 * 2);
    float *got = malloc(65536 * 4);
    for (uint32_t h = 0; h < 65536; h++) halves[h] = (uint16_t)h;
    for (uint32_t h = 0; h < 65536; h++) {
        uint32_t want = rd32(h2f + 4 * h), have = f32_bits(fp16_to_fp32((uint16_t)h));
        if (isnan(bits_f32(want)))
            cr_assert(isnan(bits_f32(have)), "half %04x", h);
        else
            cr_assert_eq(have, want, "half %04x: %08x want %08x", h, have, want);
        /* bf16 is the top half of an f32 */
        cr_assert_eq(f32_bits(bf16_to_fp32((uint16_t)h)), h << 16);
    }
    for (int l = SIMD_LEVEL_SCALAR; l <= (int)max_level(); l++) {
        simd_level_set((simd_level)l);
        fp16_to_fp32_row(halves, got, 65536);
        for (uint32_t h = 0; h < 65536; h++) {
            uint32_t want = rd32(h2f + 4 * h), have = f32_bits(got[h]);
            if (isnan(bits_f32(want)))
                cr_assert(isnan(got[h]));
            else
                cr_assert_eq(have, want, "level %d half %04x", l, h);
        }
    }

    float *in = malloc((size_t)m * 4);
    uint16_t *out = malloc((size_t)m * 2);
    for (uint32_t i = 0; i < m; i++) in[i] = bits_f32(rd32(fin + 4 * i));
    for (int l = SIMD_LEVEL_SCALAR; l <= (int)max_level(); l++) {
        simd_level_set((simd_level)l);
        /* Odd lengths and offsets exercise the SIMD remainders. */
        fp32_to_fp16_row(in, out, 1);
        fp32_to_fp16_row(in + 1, out + 1, m - 1);
        for (uint32_t i = 0; i < m; i++) {
            uint16_t want;
            memcpy(&want, hout + 2 * i, 2);
            uint16_t one = fp32_to_fp16(in[i]);
            if (isnan(in[i])) {
                cr_assert((one & 0x7c00) == 0x7c00 && (one & 0x3ff), "nan -> %04x", one);
                cr_assert((out[i] & 0x7c00) == 0x7c00 && (out[i] & 0x3ff));
                continue;
            }
            cr_assert_eq(one, want, "%a: %04x want %04x", (double)in[i], one, want);
            cr_assert_eq(out[i], want, "level %d %a: %04x want %04x", l, (double)in[i], out[i],
                         want);
        }
    }
    free(in);
    free(out);
    free(halves);
    free(got);
    free(f);
    restore_level();
}

/* ---------------------------------------------------------------- dequantize */

static int same_float(float a, float b) {
    return (isnan(a) && isnan(b)) || f32_bits(a) == f32_bits(b);
}

Test(quant, dequantize_row_matches_gguf_at_every_level) {
    for (int ti = 0; ti < N_WEIGHT_TYPES; ti++) {
        golden g = golden_load(WEIGHT_TYPES[ti]);
        const int bs = tensor_type_get((int)g.type)->block_size;
        float *out = malloc((size_t)g.rows * g.n * 4 + 64);
        for (int l = SIMD_LEVEL_SCALAR; l <= (int)max_level(); l++) {
            simd_level_set((simd_level)l);
            /* Whole rows, then one block only, then all rows as a single long row. */
            for (int r = 0; r < g.rows; r++)
                dequantize_row(g.type, g.w + r * g.row_bytes, out + (size_t)r * g.n, g.n);
            for (int64_t e = 0; e < (int64_t)g.rows * g.n; e++)
                cr_assert(same_float(out[e], g.deq[e]), "%s level %s element %lld: %a want %a",
                          tensor_type_get((int)g.type)->name, simd_level_name((simd_level)l),
                          (long long)e, (double)out[e], (double)g.deq[e]);
            memset(out, 0xff, (size_t)bs * 4 + 4);
            dequantize_row(g.type, g.w, out, bs);
            for (int e = 0; e < bs; e++) cr_assert(same_float(out[e], g.deq[e]));
            cr_assert_eq(f32_bits(out[bs]), 0xffffffffu, "wrote past n");
            dequantize_row(g.type, g.w, out, (int64_t)g.rows * g.n);
            for (int64_t e = 0; e < (int64_t)g.rows * g.n; e++)
                cr_assert(same_float(out[e], g.deq[e]));
        }
        free(out);
        golden_free(&g);
    }
    restore_level();
}

/* ---------------------------------------------------------------- activation quantization */

static const tensor_type ACT_TYPES[] = {TENSOR_TYPE_Q8_0, TENSOR_TYPE_Q8_1, TENSOR_TYPE_Q8_K,
                                        TENSOR_TYPE_F32, TENSOR_TYPE_F16};

Test(quant, quantize_row_act_same_bytes_at_every_level_and_half_step_round_trip) {
    const int n = 256 * 11; /* 88 blocks of 32: act32 groups 16 x 5, 8; 11 super-blocks */
    float *x = malloc(n * 4), *back = malloc(n * 4);
    for (int e = 0; e < n; e++) x[e] = rng_normal() * (e % 97 == 0 ? 40.0f : 1.0f);
    for (int e = 64; e < 96; e++) x[e] = 0.0f;           /* an all-zero block */
    for (int e = 96; e < 128; e++) x[e] = 1e-30f * x[e]; /* a block below fp16's range */
    for (int e = 128; e < 160; e++) x[e] = 1e4f * x[e];  /* large values (still finite in fp16) */
    x[300] = -1e-3f;
    /* Non-finite inputs (the last two super-blocks) only have to give the same bytes at every
     * level, not a meaningful round trip. */
    const int n_finite = n - 512;
    x[n_finite + 3] = NAN;
    x[n_finite + 40] = INFINITY;
    x[n_finite + 300] = -INFINITY;
    x[n_finite + 301] = NAN;
    for (size_t ai = 0; ai < sizeof ACT_TYPES / sizeof ACT_TYPES[0]; ai++) {
        const tensor_type at = ACT_TYPES[ai];
        const int bs = tensor_type_get((int)at)->block_size;
        const size_t bytes = tensor_row_size(at, n);
        cr_assert(bytes > 0);
        uint8_t *ref = malloc(bytes + 1), *got = malloc(bytes + 1);
        simd_level_set(SIMD_LEVEL_SCALAR);
        ref[bytes] = 0xA5;
        quantize_row_act(at, x, ref, n);
        cr_assert_eq(ref[bytes], 0xA5, "wrote past the row");
        for (int l = SIMD_LEVEL_AVX2; l <= (int)max_level(); l++) {
            simd_level_set((simd_level)l);
            quantize_row_act(at, x, got, n);
            cr_assert(memcmp(got, ref, bytes) == 0, "%s differs at level %s",
                      tensor_type_get((int)at)->name, simd_level_name((simd_level)l));
            /* One block alone: the same bytes, except Q8_1 whose group layout depends on n. */
            quantize_row_act(at, x, got, bs);
            if (at != TENSOR_TYPE_Q8_1) cr_assert(memcmp(got, ref, tensor_row_size(at, bs)) == 0);
        }
        dequantize_row_act(at, ref, back, n);
        for (int b = 0; b < n_finite / bs; b++) {
            float amax = 0;
            for (int e = 0; e < bs; e++) amax = fmaxf(amax, fabsf(x[b * bs + e]));
            for (int e = 0; e < bs; e++) {
                const float v = x[b * bs + e], r = back[b * bs + e];
                float bound;
                if (at == TENSOR_TYPE_F32)
                    bound = 0;
                else if (at == TENSOR_TYPE_F16)
                    bound = fmaxf(fabsf(v) * 0x1p-11f, 0x1p-25f);
                else
                    bound = 0.5f * amax / 127.0f * 1.002f + 1e-37f;
                /* fp16 scales of Q8_0/Q8_1 flush blocks below ~1e-7 to zero */
                if (at != TENSOR_TYPE_Q8_K && amax < 1e-6f) bound = amax;
                cr_assert(fabsf(v - r) <= bound, "%s block %d elem %d: %g -> %g (bound %g)",
                          tensor_type_get((int)at)->name, b, e, (double)v, (double)r,
                          (double)bound);
            }
        }
        free(ref);
        free(got);
    }
    free(x);
    free(back);
    restore_level();
}

/* ---------------------------------------------------------------- dot products */

/* An activation matrix converted to the weight type's act_type, with row stride xs. */
static uint8_t *act_rows(tensor_type wt, const float *x, int nx, int n, size_t xs) {
    const tensor_type at = tensor_type_get((int)wt)->act_type;
    /* Exactly up to the end of the last row, so that AddressSanitizer sees any over-read. */
    const size_t arow = tensor_row_size(at, n);
    uint8_t *a = calloc(1, (size_t)(nx - 1) * xs + arow);
    for (int j = 0; j < nx; j++) quantize_row_act(at, x + (size_t)j * n, a + j * xs, n);
    return a;
}

/* The first `bytes` bytes of each of `rows` rows (source stride src_stride) copied at stride ws,
 * the buffer ending right after the last row (AddressSanitizer then sees any over-read). */
static uint8_t *strided_rows(const uint8_t *w, size_t src_stride, size_t bytes, int rows,
                             size_t ws) {
    const size_t total = (size_t)(rows - 1) * ws + bytes;
    uint8_t *o = malloc(total);
    memset(o, 0x5A, total);
    for (int i = 0; i < rows; i++) memcpy(o + i * ws, w + i * src_stride, bytes);
    return o;
}

/* Every SIMD level and every tile shape against the scalar reference on n elements of the
 * rows (w: rows of `row_bytes` bytes, x: f32 activations [4][xn], only the first n used). */
static void check_tiles(tensor_type wt, const uint8_t *w, size_t row_bytes, int n, const float *x,
                        int xn, const float *deq, int deq_stride, const char *what) {
    const tensor_type at = tensor_type_get((int)wt)->act_type;
    const size_t arow = tensor_row_size(at, n);
    const size_t wrow = tensor_row_size(wt, n);
    const size_t ws = wrow + 3, xs = arow + 5, os = 7; /* odd strides */
    float *xr = malloc((size_t)4 * n * 4);
    for (int j = 0; j < 4; j++) memcpy(xr + (size_t)j * n, x + (size_t)j * xn, (size_t)n * 4);
    simd_level_set(SIMD_LEVEL_SCALAR);
    uint8_t *a = act_rows(wt, xr, 4, n, xs);
    uint8_t *wr = strided_rows(w, row_bytes, wrow, 4, ws);

    /* The scalar reference, and the scale S_ij = sum |w x| the tolerances are relative to. */
    float ref[4][4];
    double mag[4][4];
    float *xd = malloc((size_t)n * 4);
    for (int j = 0; j < 4; j++) {
        dequantize_row_act(at, a + j * xs, xd, n);
        for (int i = 0; i < 4; i++) {
            dot_tile(wt, n, wr + i * ws, ws, 1, a + j * xs, xs, 1, &ref[j][i], 1);
            double exact = 0, m = 0;
            for (int e = 0; e < n; e++) {
                double p = (double)deq[(size_t)i * deq_stride + e] * xd[e];
                exact += p;
                m += fabs(p);
            }
            mag[j][i] = m;
            /* The scalar reference against gguf's values, in units u = 2^-23 * sum |w x|: exact
             * integer block sums, one float rounding per block term (<= u/2 in all), a double
             * accumulator, the final float (<= u/2); K-quants: gguf rounds each dequantized
             * element once in float (<= u/2). Measured: <= 0.3 u. */
            const double tol = 2.0 * 0x1p-23 * m + 1e-30;
            cr_assert(fabs((double)ref[j][i] - exact) <= tol,
                      "%s %s scalar row %d x %d: %.9g, exact %.9g (tol %.3g)", what,
                      tensor_type_get((int)wt)->name, i, j, (double)ref[j][i], exact, tol);
        }
    }

    float out[4 * 7 + 4];
    for (int l = SIMD_LEVEL_SCALAR; l <= (int)max_level(); l++) {
        simd_level_set((simd_level)l);
        for (int nw = 1; nw <= 4; nw++)
            for (int nx = 1; nx <= 4; nx++) {
                for (int k = 0; k < (int)(sizeof out / 4); k++) out[k] = -12345.0f;
                dot_tile(wt, n, wr, ws, nw, a, xs, nx, out, os);
                for (int j = 0; j < 4; j++)
                    for (int i = 0; i < (int)os; i++) {
                        const float v = out[j * os + i];
                        if (j >= nx || i >= nw) {
                            cr_assert_eq(v, -12345.0f, "tile wrote outside");
                            continue;
                        }
                        /* Float lane sums, fma, 16-lane reduction: a few u plus one rounding
                         * per float add along a lane (n/16 for the float types). Measured:
                         * <= 2.3 u. */
                        const double tol = (8.0 + n / 64.0) * 0x1p-23 * mag[j][i] + 1e-30;
                        cr_assert(fabs((double)v - ref[j][i]) <= tol,
                                  "%s %s level %s tile %dx%d (%d,%d): %.9g want %.9g", what,
                                  tensor_type_get((int)wt)->name, simd_level_name((simd_level)l),
                                  nw, nx, i, j, (double)v, (double)ref[j][i]);
                    }
            }
    }
    free(xd);
    free(xr);
    free(a);
    free(wr);
}

Test(quant, dot_tile_matches_reference_on_goldens) {
    for (int ti = 0; ti < N_WEIGHT_TYPES; ti++) {
        golden g = golden_load(WEIGHT_TYPES[ti]);
        const int bs = tensor_type_get((int)g.type)->block_size;
        check_tiles(g.type, g.w, g.row_bytes, g.n, g.x, g.n, g.deq, g.n, "full rows");
        check_tiles(g.type, g.w, g.row_bytes, bs, g.x, g.n, g.deq, g.n, "one block");
        if (bs == 1) {
            check_tiles(g.type, g.w, g.row_bytes, 17, g.x, g.n, g.deq, g.n, "n=17");
            check_tiles(g.type, g.w, g.row_bytes, 32, g.x, g.n, g.deq, g.n, "n=32");
        }
        if (bs == 32) /* groups of 2 and 1 only, and 16 + 2 as SmolLM2's n = 576 */
            for (int nb = 2; nb <= 18; nb++)
                check_tiles(g.type, g.w, g.row_bytes, 32 * nb, g.x, g.n, g.deq, g.n, "blocks");

        /* Against the f32-activation golden: the difference is the activation's quantization
         * error, bounded by sum |w| * |x - x_q|. */
        simd_level_set(max_level());
        const tensor_type at = tensor_type_get((int)g.type)->act_type;
        const size_t arow = tensor_row_size(at, g.n);
        uint8_t *a = act_rows(g.type, g.x, g.nx, g.n, arow);
        float *xd = malloc((size_t)g.n * 4);
        for (int j = 0; j < g.nx; j++) {
            dequantize_row_act(at, a + j * arow, xd, g.n);
            for (int i = 0; i < g.rows; i++) {
                float v;
                dot_tile(g.type, g.n, g.w + i * g.row_bytes, g.row_bytes, 1, a + j * arow, arow, 1,
                         &v, 1);
                double err = 0, m = 0;
                for (int e = 0; e < g.n; e++) {
                    const double wd = g.deq[(size_t)i * g.n + e];
                    err += fabs(wd) * fabs((double)g.x[(size_t)j * g.n + e] - xd[e]);
                    m += fabs(wd * g.x[(size_t)j * g.n + e]);
                }
                const double tol = err + (g.n / 32.0 + 32) * 0x1p-23 * m + 1e-30;
                const double want = g.dot[(size_t)j * g.rows + i];
                cr_assert(fabs(v - want) <= tol, "%s row %d x %d: %.9g want %.9g (tol %.3g)",
                          tensor_type_get((int)g.type)->name, i, j, (double)v, want, tol);
            }
        }
        free(xd);
        free(a);
        golden_free(&g);
    }
    restore_level();
}

/* Random but valid blocks (finite small scales) of a weight type, for long rows. */
static void random_blocks(tensor_type t, uint8_t *w, size_t bytes) {
    for (size_t k = 0; k < bytes; k++) w[k] = (uint8_t)rng_u32();
    const tensor_type_traits *tr = tensor_type_get((int)t);
    for (size_t b = 0; b < bytes / tr->type_size; b++) {
        uint8_t *blk = w + b * tr->type_size;
        uint16_t h1 = fp32_to_fp16((float)(rng_u32() % 1000 + 1) * 1e-5f);
        uint16_t h2 = fp32_to_fp16((float)((int)(rng_u32() % 2001) - 1000) * 1e-5f);
        switch (t) {
        case TENSOR_TYPE_F32:
        case TENSOR_TYPE_F16:
        case TENSOR_TYPE_BF16:
            break;
        case TENSOR_TYPE_Q6_K:
            memcpy(blk + 208, &h1, 2);
            break;
        case TENSOR_TYPE_Q4_1:
        case TENSOR_TYPE_Q5_1:
        case TENSOR_TYPE_Q4_K:
        case TENSOR_TYPE_Q5_K:
            memcpy(blk, &h1, 2);
            memcpy(blk + 2, &h2, 2);
            break;
        default:
            memcpy(blk, &h1, 2);
            break;
        }
    }
    if (t == TENSOR_TYPE_F32)
        for (size_t k = 0; k < bytes / 4; k++) {
            float v = rng_normal();
            memcpy(w + 4 * k, &v, 4);
        }
    if (t == TENSOR_TYPE_F16 || t == TENSOR_TYPE_BF16)
        for (size_t k = 0; k < bytes / 2; k++) {
            float v = rng_normal();
            uint16_t h = t == TENSOR_TYPE_F16 ? fp32_to_fp16(v) : (uint16_t)(f32_bits(v) >> 16);
            memcpy(w + 2 * k, &h, 2);
        }
}

/* Lane-order rows (*_L16): at every level and tile shape, the products of a repacked row are its
 * GGUF row's bit for bit, and it dequantizes to the same values; rows of whole groups, with each
 * remainder group (8, 4, 2, 1 blocks), and narrower than a group. */
Test(quant, lane_order_rows_equal_their_gguf_rows_bit_for_bit) {
    static const tensor_type bases[] = {TENSOR_TYPE_Q4_0, TENSOR_TYPE_Q4_1, TENSOR_TYPE_Q8_0};
    static const int widths[] = {32 * 87, 576, 512, 1024, 32 * 9, 32 * 14, 32 * 6, 64, 32};
    for (int bi = 0; bi < 3; bi++)
        for (int wi = 0; wi < (int)(sizeof widths / sizeof widths[0]); wi++) {
            const tensor_type t = bases[bi];
            const int n = widths[wi];
            const size_t rb = tensor_row_size(t, n);
            tensor_type lt = TENSOR_TYPE_Q4_0_L16;
            if (t == TENSOR_TYPE_Q4_1) lt = TENSOR_TYPE_Q4_1_L16;
            if (t == TENSOR_TYPE_Q8_0) lt = TENSOR_TYPE_Q8_0_L16;
            cr_assert_eq(quant_lanes_base(lt), t);
            cr_assert_eq(tensor_row_size(lt, n), rb);
            uint8_t *w = malloc(4 * rb), *wl = malloc(4 * rb);
            random_blocks(t, w, 4 * rb);
            cr_assert_eq(quant_repack_lanes(t, w, wl, n, 4, rb), 0);
            /* every group of 2 blocks or more changes; a single block is left as it is */
            cr_assert_eq(memcmp(w, wl, 4 * rb) != 0, n >= 64, "%s n=%d",
                         tensor_type_get((int)t)->name, n);
            float *x = malloc((size_t)4 * n * 4), *d0 = malloc((size_t)n * 4),
                  *d1 = malloc((size_t)n * 4);
            for (int e = 0; e < 4 * n; e++) x[e] = rng_normal();
            const size_t xs = tensor_row_size(TENSOR_TYPE_Q8_1, n);
            for (int l = SIMD_LEVEL_SCALAR; l <= (int)max_level(); l++) {
                simd_level_set((simd_level)l);
                cr_assert_eq(quant_lanes_type(t), l == SIMD_LEVEL_SCALAR ? t : lt);
                uint8_t *a = act_rows(t, x, 4, n, xs);
                for (int i = 0; i < 4; i++) {
                    dequantize_row(t, w + i * rb, d0, n);
                    dequantize_row(lt, wl + i * rb, d1, n);
                    cr_assert_eq(memcmp(d0, d1, (size_t)n * 4), 0, "%s n=%d row %d level %s",
                                 tensor_type_get((int)lt)->name, n, i,
                                 simd_level_name((simd_level)l));
                }
                for (int nw = 1; nw <= 4; nw++)
                    for (int nx = 1; nx <= 4; nx++) {
                        float o0[16], o1[16];
                        dot_tile(t, n, w, rb, nw, a, xs, nx, o0, 4);
                        dot_tile(lt, n, wl, rb, nw, a, xs, nx, o1, 4);
                        for (int j = 0; j < nx; j++)
                            for (int i = 0; i < nw; i++)
                                cr_assert_eq(f32_bits(o0[4 * j + i]), f32_bits(o1[4 * j + i]),
                                             "%s n=%d level %s tile %dx%d (%d,%d): %.9g vs %.9g",
                                             tensor_type_get((int)lt)->name, n,
                                             simd_level_name((simd_level)l), nw, nx, i, j,
                                             (double)o1[4 * j + i], (double)o0[4 * j + i]);
                    }
                free(a);
            }
            free(w);
            free(wl);
            free(x);
            free(d0);
            free(d1);
        }
    cr_assert_eq(quant_repack_lanes(TENSOR_TYPE_Q4_K, NULL, NULL, 256, 1, 144), -1);
    cr_assert_eq(quant_lanes_type(TENSOR_TYPE_Q6_K), TENSOR_TYPE_Q6_K);
    restore_level();
}

/* The CPU backend repacks the types that have a lane twin (where the CPU runs AVX2 or better), and
 * its matmul over the copy gives the GGUF weight's outputs bit for bit; other types stay. */
Test(quant, cpu_backend_repacks_weights_and_matmul_is_unchanged) {
    kv_error err;
    backend *b = backend_cpu_create(2, &err);
    cr_assert(b, "%s", err.msg);
    static const tensor_type types[] = {TENSOR_TYPE_Q4_0, TENSOR_TYPE_Q4_1, TENSOR_TYPE_Q8_0,
                                        TENSOR_TYPE_Q6_K};
    const int n_out = 37, max_tok = 7; /* odd: edge tiles of 1 and 2 rows */
    for (int ti = 0; ti < 4; ti++) {
        const tensor_type t = types[ti];
        const int n_in = t == TENSOR_TYPE_Q6_K ? 768 : 576;
        const size_t rb = tensor_row_size(t, n_in);
        uint8_t *data = malloc(rb * n_out);
        random_blocks(t, data, rb * n_out);
        const weight host = {t, n_in, n_out, rb, data};
        weight lw;
        const int r = backend_weight_repack(b, &host, &lw, &err);
        const int want = t != TENSOR_TYPE_Q6_K && simd_level_get() != SIMD_LEVEL_SCALAR;
        cr_assert_eq(r, want, "%s: %d", tensor_type_get((int)t)->name, r);
        if (!r) {
            free(data);
            continue;
        }
        cr_assert_eq(lw.type, quant_lanes_type(t));
        cr_assert_neq((const void *)lw.data, (const void *)data);
        float *x = malloc(sizeof(float) * (size_t)max_tok * n_in);
        float *y0 = malloc(sizeof(float) * (size_t)max_tok * n_out);
        float *y1 = malloc(sizeof(float) * (size_t)max_tok * n_out);
        for (int e = 0; e < max_tok * n_in; e++) x[e] = rng_normal();
        for (int n_tok = 1; n_tok <= max_tok; n_tok += 2) {
            cr_assert_eq(backend_matmul(b, &host, x, n_tok, y0), 0);
            cr_assert_eq(backend_matmul(b, &lw, x, n_tok, y1), 0);
            cr_assert_eq(memcmp(y0, y1, sizeof(float) * (size_t)n_tok * n_out), 0, "%s n_tok=%d",
                         tensor_type_get((int)t)->name, n_tok);
        }
        backend_free(b, (void *)lw.data);
        free(x);
        free(y0);
        free(y1);
        free(data);
    }
    backend_destroy(b);
}

Test(quant, dot_tile_long_rows_random_blocks) {
    for (int ti = 0; ti < N_WEIGHT_TYPES; ti++) {
        const tensor_type t = WEIGHT_TYPES[ti];
        const int bs = tensor_type_get((int)t)->block_size;
        /* 5 groups of 16 + 4 + 2 + 1 blocks of 32; 11 super-blocks; an odd float length. */
        const int n = bs == 32 ? 32 * 87 : bs == 256 ? 256 * 11 : 1531;
        const size_t rb = tensor_row_size(t, n);
        uint8_t *w = malloc(4 * rb);
        random_blocks(t, w, 4 * rb);
        float *deq = malloc((size_t)4 * n * 4), *x = malloc((size_t)4 * n * 4);
        for (int i = 0; i < 4; i++) dequantize_row(t, w + i * rb, deq + (size_t)i * n, n);
        for (int e = 0; e < 4 * n; e++) x[e] = rng_normal();
        check_tiles(t, w, rb, n, x, n, deq, n, "long rows");
        free(w);
        free(deq);
        free(x);
    }
    restore_level();
}
