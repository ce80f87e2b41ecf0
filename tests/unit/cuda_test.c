/* The CUDA backend against the CPU backend, op by op, on the same inputs. In `make test` the CUDA
 * backend's kernels run under the CPU emulator (kernels/cuda/emu.h); `make test-gpu` builds this
 * file with -DKVSERVE_TEST_GPU against the device build and runs the same comparisons on a GPU
 * (skipped, visibly, without one).
 *
 * Tolerances (the CPU backend in MATMUL_PRECISION_F32 is the reference, but for the int8 path):
 *   matmul, int8 path (quantized weights, <= 8 rows, MATMUL_PRECISION_Q8): against the CPU at
 *       MATMUL_PRECISION_Q8, which quantizes the activations to the same codes and scales:
 *       |d| <= 32 * 2^-23 * sum|w xq| + 1e-6 (float sums in another order; see tolerance_of);
 *       bit for bit where every float operation is exact (power-of-two scales, small codes);
 *       its quantized activations: the CPU's quantize_row_act codes and scales, bit for bit
 *   matmul, GEMV path (<= 4 rows, f32 activations): |d| <= 1e-5 * sum|w x| + 1e-6 per output
 *   matmul, GEMM path (f16 tiles on tensor cores):   |d| <= 2e-3 * sum|w x| + 1e-6 (f16 rounding
 *       of activations and weights, 2^-11 each); F32 and BF16 weights (f32 GEMM) 1e-5
 *   embed, gather, add, rope_cs, kv_write / kv_store / kv_store_serial / kv_load / kv_rope /
 *       block and row copies: bit for bit
 *   rope_angles, rope at positions: |d| <= 2e-7 (double cos/sin rounded once; bit for bit under
 *       emulation, where both call the same libm)
 *   rmsnorm: relative 1e-5; swiglu: relative 1e-5 (expf vs the CPU's vector exp); softmax:
 *       relative 1e-5
 *   top-k: the same ids and values (ties to the lower id, NaN last)
 *   attention (prefill rows, GQA, out-of-order blocks, split decode keys): |d| <= 2e-5 (V rows in
 *       [-1, 1]; online softmax sums in another order); sequences of 16 rows or more, on tensor
 *       cores with Q and P as two f16 parts each: |d| <= max|v| (e^(2 ds) - 1 + 2^-22 + n 2^-25)
 *       + 2e-5, ds the bound on a score's error (tc_bounds), about 1e-5 here */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/backend.h"
#include "tests/unit/model_fixture.h"

#ifndef KVSERVE_TEST_GPU
long cuda_emu_live_allocations(void); /* kernels/cuda/emu.cc */
long cuda_emu_live_graphs(void);
#endif

static backend *g_cpu, *g_gpu;

static void setup(void) {
    kv_error err = {{0}};
    g_cpu = backend_cpu_create(2, &err);
    cr_assert_not_null(g_cpu, "%s", err.msg);
    backend_set_precision(g_cpu, MATMUL_PRECISION_F32);
    g_gpu = cuda_under_test(&err);
    if (!g_gpu) cr_skip_test("no CUDA device: %s", err.msg);
    backend_limits lim = {
        .max_tokens = 128, .max_seqs = 4, .max_n_in = 4352, .n_head = 8, .head_dim = 128};
    cr_assert_eq(backend_reserve(g_gpu, &lim, &err), 0, "%s", err.msg);
    cr_assert_eq(backend_reserve(g_cpu, &lim, &err), 0, "%s", err.msg);
}

static void teardown(void) {
    backend_destroy(g_gpu);
    backend_destroy(g_cpu);
    g_gpu = g_cpu = NULL;
}

TestSuite(cuda, .init = setup, .fini = teardown, .timeout = 300);

/* ---------------------------------------------------------------- helpers */

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void) {
    g_rng = g_rng * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(g_rng >> 33);
}
static float rndf(float lo, float hi) {
    return lo + (hi - lo) * (float)(rnd() & 0xffffff) / 16777216.0f;
}

/* Backend memory holding a copy of host. */
static void *put(backend *b, const void *host, size_t bytes) {
    void *d = backend_alloc(b, bytes);
    cr_assert_not_null(d);
    cr_assert_eq(backend_upload(b, d, host, bytes), 0);
    return d;
}

static void get(backend *b, void *host, const void *dev, size_t bytes) {
    cr_assert_eq(backend_download(b, host, dev, bytes), 0);
}

/* max |a - b| / (rel * |scale_i| + abs), must be <= 1; reported. */
static void expect_close(const char *what, const float *a, const float *b, const double *scale,
                         size_t n, double rel, double abs_tol) {
    double worst = 0, worst_d = 0;
    size_t at = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        double tol = rel * (scale ? scale[i] : fabs((double)b[i])) + abs_tol;
        double ratio = isnan(a[i]) != isnan(b[i]) ? INFINITY : isnan(d) ? 0 : d / tol;
        if (ratio > worst) worst = ratio, worst_d = d, at = i;
    }
    cr_log_info("%s: max |delta| %.3g (%.3f of the tolerance)", what, worst_d, worst);
    cr_expect_leq(worst, 1.0, "%s: element %zu: cuda %.9g cpu %.9g", what, at, (double)a[at],
                  (double)b[at]);
}

static void expect_same(const char *what, const void *a, const void *b, size_t bytes) {
    const uint8_t *x = a, *y = b;
    size_t i = 0;
    while (i < bytes && x[i] == y[i]) i++;
    cr_expect_eq(i, bytes, "%s: first difference at byte %zu of %zu", what, i, bytes);
}

/* A random weight matrix of type t: valid blocks with random codes and small scales. */
static uint8_t *random_weight(tensor_type t, int64_t n_in, int64_t n_out, size_t *row_bytes) {
    const tensor_type_traits *tr = tensor_type_get((int)t);
    size_t rb = tensor_row_size(t, n_in), total = rb * (size_t)n_out;
    uint8_t *w = malloc(total);
    cr_assert_not_null(w);
    for (size_t i = 0; i < total; i++) w[i] = (uint8_t)rnd();
    size_t nb = total / tr->type_size;
    for (size_t k = 0; k < nb; k++) {
        uint8_t *blk = w + k * tr->type_size;
        uint16_t d = fp32_to_fp16(rndf(0.002f, 0.02f)), m = fp32_to_fp16(rndf(-0.05f, 0.05f));
        switch (t) {
        case TENSOR_TYPE_F32: {
            float f = rndf(-1, 1);
            memcpy(blk, &f, 4);
            break;
        }
        case TENSOR_TYPE_F16: {
            uint16_t h = fp32_to_fp16(rndf(-1, 1));
            memcpy(blk, &h, 2);
            break;
        }
        case TENSOR_TYPE_BF16: {
            float f = rndf(-1, 1);
            uint32_t u;
            memcpy(&u, &f, 4);
            uint16_t h = (uint16_t)(u >> 16);
            memcpy(blk, &h, 2);
            break;
        }
        case TENSOR_TYPE_Q6_K:
            memcpy(blk + 208, &d, 2);
            break;
        case TENSOR_TYPE_Q4_1:
        case TENSOR_TYPE_Q5_1:
            memcpy(blk, &d, 2);
            memcpy(blk + 2, &m, 2);
            break;
        case TENSOR_TYPE_Q4_K:
        case TENSOR_TYPE_Q5_K:
            memcpy(blk, &d, 2);
            d = fp32_to_fp16(rndf(0.001f, 0.01f));
            memcpy(blk + 2, &d, 2);
            break;
        default: /* Q4_0, Q5_0, Q8_0 */
            memcpy(blk, &d, 2);
            break;
        }
    }
    *row_bytes = rb;
    return w;
}

static const tensor_type WEIGHT_TYPES[] = {
    TENSOR_TYPE_F32,  TENSOR_TYPE_F16,  TENSOR_TYPE_BF16, TENSOR_TYPE_Q4_0,
    TENSOR_TYPE_Q4_1, TENSOR_TYPE_Q5_0, TENSOR_TYPE_Q5_1, TENSOR_TYPE_Q8_0,
    TENSOR_TYPE_Q4_K, TENSOR_TYPE_Q5_K, TENSOR_TYPE_Q6_K,
};
#define N_WEIGHT_TYPES (sizeof WEIGHT_TYPES / sizeof *WEIGHT_TYPES)

/* ---------------------------------------------------------------- matmul and embed */

/* Power-of-two scales (and mins a small multiple of one), Q6_K's sub-block scales in -32..31:
 * with exact_activations, every product and sum of a matmul is exact in float. */
static void make_scales_exact(tensor_type t, uint8_t *w, size_t total) {
    const tensor_type_traits *tr = tensor_type_get((int)t);
    for (size_t k = 0; k < total / tr->type_size; k++) {
        uint8_t *blk = w + k * tr->type_size;
        uint16_t d = fp32_to_fp16(rnd() % 2 ? 0x1p-7f : 0x1p-8f);
        uint16_t m = fp32_to_fp16((float)((int)(rnd() % 31) - 15) * 0x1p-8f);
        switch (t) {
        case TENSOR_TYPE_Q6_K:
            memcpy(blk + 208, &d, 2);
            for (int i = 0; i < 16; i++) blk[192 + i] = (uint8_t)((int8_t)blk[192 + i] / 4);
            break;
        case TENSOR_TYPE_Q4_K:
        case TENSOR_TYPE_Q5_K:
            m = fp32_to_fp16(0x1p-8f);
            /* fall through */
        case TENSOR_TYPE_Q4_1:
        case TENSOR_TYPE_Q5_1:
            memcpy(blk, &d, 2);
            memcpy(blk + 2, &m, 2);
            break;
        default: /* Q4_0, Q5_0, Q8_0 */
            memcpy(blk, &d, 2);
            break;
        }
    }
}

/* k * 2^-6 with k in -2..2, and one +-127 * 2^-6 in every 32: every block's scale is 2^-6 and
 * its codes are the k. */
static void exact_activations(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = (float)((int)(rnd() % 5) - 2) * 0x1p-6f;
    for (int64_t b = 0; b < n / 32; b++)
        x[32 * b + rnd() % 32] = (rnd() % 2 ? 127 : -127) * 0x1p-6f;
}

/* The most rows the CUDA backend multiplies with its int8 dot-product kernels (MMVQ_MAX_TOKENS,
 * quantized weights at MATMUL_PRECISION_Q8), then with its int8 tensor-core tiles
 * (MMQ_MAX_TOKENS, the same weights and precision), and with its f32 GEMV kernels
 * (GEMV_MAX_TOKENS, other weights or MATMUL_PRECISION_F32); kernels/cuda/cuda.h, a C++ header.
 * More go through cuBLAS. */
enum { INT8_MAX_ROWS = 8, INT8_TILES_MAX_ROWS = 1 << 30, GEMV_MAX_ROWS = 4 };

typedef enum matmul_path { PATH_INT8, PATH_INT8_TILES, PATH_GEMV, PATH_GEMM } matmul_path;
static const char *const PATH_NAMES[] = {"int8", "int8 tiles", "GEMV", "GEMM"};

typedef struct matmul_case {
    tensor_type t;
    int64_t n_in;
    int n_tok;
    matmul_precision precision; /* the CUDA backend's */
    bool exact; /* make_scales_exact and exact_activations: the int8 path bit for bit */
} matmul_case;

static matmul_path path_of(const matmul_case *c) {
    const bool quantized = tensor_type_get((int)c->t)->block_size > 1;
    if (quantized && c->precision == MATMUL_PRECISION_Q8 && c->n_tok <= INT8_MAX_ROWS)
        return PATH_INT8;
    if (quantized && c->precision == MATMUL_PRECISION_Q8 && c->n_tok <= INT8_TILES_MAX_ROWS)
        return PATH_INT8_TILES;
    return c->n_tok <= GEMV_MAX_ROWS ? PATH_GEMV : PATH_GEMM;
}

/* Tolerance per output, relative to sum |w x| (x as the path sees it: the int8 paths' quantized
 * activations). The int8 paths against the CPU backend at MATMUL_PRECISION_Q8 (the same codes and
 * scales, each block's term rounded alike; the tiles' K-quant terms per sub-block, the CPU's per
 * super-block): float sums in another order, the CPU's own tiles within (8 + n / 64) u of its
 * scalar reference (quant_test), the kernel's sums (over its threads, or the tiles' 8 blocks a
 * step then the steps: (8 + n / 256) u) a few u more, u = 2^-23; 32 u in all. */
static double tolerance_of(const matmul_case *c) {
    switch (path_of(c)) {
    case PATH_INT8:
    case PATH_INT8_TILES:
        return 32 * 0x1p-23;
    case PATH_GEMV:
        return 1e-5;
    default:
        return c->t == TENSOR_TYPE_F32 || c->t == TENSOR_TYPE_BF16 ? 1e-5 : 2e-3;
    }
}

/* The int8 tiles against a double sum of the dequantized weights and activations (the same int8
 * codes and scales; a dequantized value is within u of its codes' exact value): each block's
 * float term rounded two or three times (scale products, then the integer sum), the mins' part
 * apart, the step's 8 terms and the steps summed in f32, (8 + n / 256) u; 16 u for the shapes
 * here, relative to sum |w x|. */
#define TILES_REF_TOL (16 * 0x1p-23)

/* The double sums of x W^T for the n_out rows of w, [n_tok][n_out], as the case's path sees
 * its inputs (the int8 paths' activations quantized and dequantized again), and the sums of
 * their products' magnitudes (scale). */
static void reference_sums(const matmul_case *c, const uint8_t *w, size_t rb, int64_t n_out,
                           const float *x, double *scale, double *exact) {
    const tensor_type t = c->t, at = tensor_type_get((int)t)->act_type;
    const int64_t n_in = c->n_in;
    const int n_tok = c->n_tok;
    const matmul_path path = path_of(c);
    float *wf = malloc(sizeof(float) * n_out * n_in), *xs = malloc(sizeof(float) * n_tok * n_in);
    uint8_t *xq = malloc(tensor_row_size(at, n_in));
    cr_assert(wf && xs && xq);
    for (int tk = 0; tk < n_tok; tk++) {
        const float *xr = x + tk * n_in;
        float *sr = xs + tk * n_in;
        if (path == PATH_INT8 || path == PATH_INT8_TILES) {
            quantize_row_act(at, xr, xq, n_in);
            dequantize_row_act(at, xq, sr, n_in);
        } else {
            memcpy(sr, xr, sizeof(float) * n_in);
        }
    }
    for (int64_t o = 0; o < n_out; o++) dequantize_row(t, w + o * rb, wf + o * n_in, n_in);
    for (int tk = 0; tk < n_tok; tk++)
        for (int64_t o = 0; o < n_out; o++)
            for (int64_t i = 0; i < n_in; i++) {
                const double p = (double)wf[o * n_in + i] * xs[tk * n_in + i];
                scale[tk * n_out + o] += fabs(p);
                exact[tk * n_out + o] += p;
            }
    free(xq);
    free(xs);
    free(wf);
}

/* y = x W^T on both backends (the CPU at MATMUL_PRECISION_Q8 for the int8 path, else F32),
 * compared against sum |w x| per output; exact cases bit for bit, and the CPU's outputs first
 * equal to the exact sums (the inputs are what they claim). Two weights through matmul_multi
 * (the second one 16 rows shorter) check the shared activation conversion. */
static void check_matmul_case(const matmul_case *c) {
    const tensor_type t = c->t;
    const int64_t n_in = c->n_in, n_out = 67;
    const int n_tok = c->n_tok;
    const matmul_path path = path_of(c);
    size_t rb;
    uint8_t *w = random_weight(t, n_in, n_out, &rb);
    if (c->exact) make_scales_exact(t, w, rb * (size_t)n_out);
    float *x = malloc(sizeof(float) * n_tok * n_in);
    float *yc[2], *yg[2];
    double *scale = calloc((size_t)n_tok * n_out, sizeof(double));
    double *exact = calloc((size_t)n_tok * n_out, sizeof(double));
    if (c->exact)
        exact_activations(x, n_tok * n_in);
    else
        for (int64_t i = 0; i < n_tok * n_in; i++) x[i] = rndf(-1, 1);
    reference_sums(c, w, rb, n_out, x, scale, exact);

    weight wc[2], wg[2];
    kv_error err = {{0}};
    for (int k = 0; k < 2; k++) {
        wc[k] = (weight){t, n_in, n_out - 16 * k, rb, w};
        wg[k] = wc[k];
        wg[k].data = backend_weight_data(g_gpu, w, rb * (size_t)n_out, &err);
        cr_assert_not_null(wg[k].data, "%s", err.msg);
        yc[k] = malloc(sizeof(float) * n_tok * n_out);
        yg[k] = malloc(sizeof(float) * n_tok * n_out);
    }
    cr_expect_eq(wg[1].data, wg[0].data, "a weight is uploaded once");
    const weight *pc[2] = {&wc[0], &wc[1]}, *pg[2] = {&wg[0], &wg[1]};
    float *dx = put(g_gpu, x, sizeof(float) * n_tok * n_in);
    float *dy[2] = {backend_alloc(g_gpu, sizeof(float) * n_tok * n_out),
                    backend_alloc(g_gpu, sizeof(float) * n_tok * n_out)};
    const bool int8 = path == PATH_INT8 || path == PATH_INT8_TILES;
    backend_set_precision(g_cpu, int8 ? MATMUL_PRECISION_Q8 : MATMUL_PRECISION_F32);
    backend_set_precision(g_gpu, c->precision);
    cr_assert_eq(backend_matmul_multi(g_cpu, 2, pc, x, n_tok, yc), 0);
    cr_assert_eq(backend_matmul_multi(g_gpu, 2, pg, dx, n_tok, dy), 0);
    backend_set_precision(g_cpu, MATMUL_PRECISION_F32);
    backend_set_precision(g_gpu, MATMUL_PRECISION_Q8);
    for (int k = 0; k < 2; k++) {
        const size_t n_y = (size_t)n_tok * wc[k].n_out;
        get(g_gpu, yg[k], dy[k], sizeof(float) * n_y);
        char what[128];
        snprintf(what, sizeof what, "matmul %s, %lld x %d rows (%s%s), weight %d",
                 tensor_type_get((int)t)->name, (long long)n_in, n_tok, PATH_NAMES[path],
                 c->exact ? ", exact" : "", k);
        /* the second weight's outputs are its rows' prefix of the first's scale rows */
        double *sc = malloc(sizeof(double) * n_y);
        for (int tk = 0; tk < n_tok; tk++)
            for (int64_t o = 0; o < wc[k].n_out; o++) {
                sc[tk * wc[k].n_out + o] = scale[tk * n_out + o];
                if (c->exact)
                    cr_assert_eq((double)yc[k][tk * wc[k].n_out + o], exact[tk * n_out + o],
                                 "%s: the CPU's output %d/%lld is not the exact sum", what, tk,
                                 (long long)o);
            }
        if (c->exact)
            expect_same(what, yg[k], yc[k], sizeof(float) * n_y);
        else
            expect_close(what, yg[k], yc[k], sc, n_y, tolerance_of(c), 1e-6);
        if (path == PATH_INT8_TILES && !c->exact) {
            /* against the double sums of the same codes and scales (see TILES_REF_TOL) */
            float *ref = malloc(sizeof(float) * n_y);
            for (int tk = 0; tk < n_tok; tk++)
                for (int64_t o = 0; o < wc[k].n_out; o++)
                    ref[tk * wc[k].n_out + o] = (float)exact[tk * n_out + o];
            strncat(what, ", double reference", sizeof what - strlen(what) - 1);
            expect_close(what, yg[k], ref, sc, n_y, TILES_REF_TOL, 1e-6);
            free(ref);
        }
        free(sc);
        backend_free(g_gpu, dy[k]);
        backend_weight_release(g_gpu, w);
        free(yc[k]);
        free(yg[k]);
    }
    backend_free(g_gpu, dx);
    free(exact);
    free(scale);
    free(x);
    free(w);
}

static void check_matmul(tensor_type t, int n_tok, matmul_precision precision) {
    check_matmul_case(&(matmul_case){t, 512, n_tok, precision, false});
}

static bool is_quantized(tensor_type t) { return tensor_type_get((int)t)->block_size > 1; }

/* The f32 GEMV kernels: float weights, and quantized ones at MATMUL_PRECISION_F32. */
Test(cuda, matmul_gemv_every_type) {
    for (size_t i = 0; i < N_WEIGHT_TYPES; i++) {
        check_matmul(WEIGHT_TYPES[i], 1, MATMUL_PRECISION_F32);
        check_matmul(WEIGHT_TYPES[i], 3, MATMUL_PRECISION_F32);
        check_matmul(WEIGHT_TYPES[i], GEMV_MAX_ROWS, MATMUL_PRECISION_Q8);
    }
}

/* cuBLAS: every type at MATMUL_PRECISION_F32 (quantized weights through dequantized tiles),
 * float weights at either precision; quantized ones at Q8 take the int8 tiles. */
Test(cuda, matmul_gemm_every_type) {
    for (size_t i = 0; i < N_WEIGHT_TYPES; i++) {
        check_matmul(WEIGHT_TYPES[i], GEMV_MAX_ROWS + 1, MATMUL_PRECISION_F32);
        check_matmul(WEIGHT_TYPES[i], 40, MATMUL_PRECISION_F32);
        check_matmul(WEIGHT_TYPES[i], INT8_MAX_ROWS + 1, MATMUL_PRECISION_Q8);
        check_matmul(WEIGHT_TYPES[i], 40, MATMUL_PRECISION_Q8);
    }
}

/* The int8 kernels, 1 to 8 rows, every quantized type: within the tolerance on random scales,
 * bit for bit where every float operation is exact (the integer dot products, the codes' offsets
 * and mins, the blocks' scales all show). */
Test(cuda, matmul_int8_every_type_and_row_count) {
    for (size_t i = 0; i < N_WEIGHT_TYPES; i++) {
        if (!is_quantized(WEIGHT_TYPES[i])) continue;
        for (int n_tok = 1; n_tok <= INT8_MAX_ROWS; n_tok++) {
            check_matmul(WEIGHT_TYPES[i], n_tok, MATMUL_PRECISION_Q8);
            check_matmul_case(
                &(matmul_case){WEIGHT_TYPES[i], 512, n_tok, MATMUL_PRECISION_Q8, true});
        }
    }
}

/* Rows of a single block (the smallest legal K), and rows of more units than a block has
 * threads (4352 = 17 x 256: 136 units, the last pass partial). */
Test(cuda, matmul_int8_odd_shapes) {
    for (size_t i = 0; i < N_WEIGHT_TYPES; i++) {
        const tensor_type t = WEIGHT_TYPES[i];
        if (!is_quantized(t)) continue;
        const int64_t k_min = tensor_type_get((int)t)->block_size;
        for (int n_tok = 1; n_tok <= INT8_MAX_ROWS; n_tok += 3) {
            check_matmul_case(&(matmul_case){t, k_min, n_tok, MATMUL_PRECISION_Q8, false});
            check_matmul_case(&(matmul_case){t, k_min, n_tok, MATMUL_PRECISION_Q8, true});
        }
        check_matmul_case(&(matmul_case){t, 4352, 3, MATMUL_PRECISION_Q8, false});
        check_matmul_case(&(matmul_case){t, 4352, 8, MATMUL_PRECISION_Q8, true});
    }
}

/* The int8 tensor-core tiles (more than 8 rows), every quantized type: token counts that fill
 * 32- and 64-token tiles partly (9, 17, 33, 100) and 67 weight rows (the second weight 51),
 * neither a multiple of the 64-row tile; within the tolerance on random scales, bit for bit
 * where every float operation is exact. */
Test(cuda, matmul_int8_tiles_every_type_and_row_count) {
    static const int counts[] = {9, 17, 33, 100};
    for (size_t i = 0; i < N_WEIGHT_TYPES; i++) {
        if (!is_quantized(WEIGHT_TYPES[i])) continue;
        for (size_t k = 0; k < sizeof counts / sizeof *counts; k++) {
            check_matmul(WEIGHT_TYPES[i], counts[k], MATMUL_PRECISION_Q8);
            check_matmul_case(
                &(matmul_case){WEIGHT_TYPES[i], 512, counts[k], MATMUL_PRECISION_Q8, true});
        }
    }
}

/* The tiles' steps of 256 elements: rows of a single block, a last step of one block of 32
 * (288) or a K-quant's third super-block (768), and rows of 17 steps (4352). */
Test(cuda, matmul_int8_tiles_odd_shapes) {
    for (size_t i = 0; i < N_WEIGHT_TYPES; i++) {
        const tensor_type t = WEIGHT_TYPES[i];
        if (!is_quantized(t)) continue;
        const int64_t k_min = tensor_type_get((int)t)->block_size;
        const int64_t partial = k_min == 32 ? 288 : 768;
        check_matmul_case(&(matmul_case){t, k_min, 9, MATMUL_PRECISION_Q8, false});
        check_matmul_case(&(matmul_case){t, k_min, 17, MATMUL_PRECISION_Q8, true});
        check_matmul_case(&(matmul_case){t, partial, 33, MATMUL_PRECISION_Q8, false});
        check_matmul_case(&(matmul_case){t, partial, 9, MATMUL_PRECISION_Q8, true});
        check_matmul_case(&(matmul_case){t, 4352, 9, MATMUL_PRECISION_Q8, false});
        check_matmul_case(&(matmul_case){t, 4352, 40, MATMUL_PRECISION_Q8, true});
    }
}

/* Row r of an n x n identity in type t (Q8_0: d 1, code 1 at r; Q6_K: d 1, sub-block scales 1,
 * code 33 at r and 32 elsewhere): y = x W^T is then each activation's quantized value, d * q,
 * one product rounded once on either backend. */
static uint8_t *identity_weight(tensor_type t, int64_t n, size_t *row_bytes) {
    const size_t rb = tensor_row_size(t, n);
    uint8_t *w = calloc((size_t)n, rb);
    cr_assert_not_null(w);
    const uint16_t one = fp32_to_fp16(1.0f);
    for (int64_t r = 0; r < n; r++) {
        uint8_t *row = w + (size_t)r * rb;
        if (t == TENSOR_TYPE_Q8_0) {
            for (int64_t b = 0; b < n / 32; b++) memcpy(row + 34 * b, &one, 2);
            row[34 * (r / 32) + 2 + r % 32] = 1;
            continue;
        }
        for (int64_t b = 0; b < n / 256; b++) {
            uint8_t *blk = row + 210 * b;
            memset(blk + 128, 0xAA, 64); /* every element's high 2 bits: 2, so 32 + low nibble */
            memset(blk + 192, 1, 16);
            memcpy(blk + 208, &one, 2);
        }
        const int e = (int)(r % 256), h = e / 128, k = (e % 128) / 32, l = e % 32;
        row[210 * (r / 256) + 64 * h + l + 32 * (k & 1)] = k < 2 ? 0x01 : 0x10;
    }
    *row_bytes = rb;
    return w;
}

/* Group g of G activations (a block of 32, or a K-quant super-block of 256), one kind each:
 * random; ties (127 sets the scale to 1, then 2.5, -2.5, 3.5, 0.5, -0.5, 126.5, -126.5, 1.5:
 * half to even); zeros; 1e-30 (fp16 scales flush to 0); NaNs among randoms (code -127); 1e7
 * (the fp16 scale clamps to 65504); subnormals (a Q8_K scale whose inverse overflows). */
static void special_activations(float *x, int64_t n, int G) {
    static const float ties[8] = {2.5f, -2.5f, 3.5f, 0.5f, -0.5f, 126.5f, -126.5f, 1.5f};
    for (int64_t i = 0; i < n; i++) {
        const int64_t g = i / G, j = i % G;
        const float r = rndf(-1, 1);
        switch (g % 7) {
        case 1:
            x[i] = j == 0 ? 127.0f : ties[j % 8];
            break;
        case 2:
            x[i] = 0.0f;
            break;
        case 3:
            x[i] = 1e-30f * r;
            break;
        case 4:
            x[i] = j % 5 == 1 ? NAN : r;
            break;
        case 5:
            x[i] = 1e7f * r;
            break;
        case 6:
            x[i] = 1e-40f * r;
            break;
        default:
            x[i] = r;
            break;
        }
    }
}

/* The int8 path's activations are the CPU's codes and scales (quantize_row_act), bit for bit, on
 * the special cases of special_activations: identity weights show each quantized activation. */
Test(cuda, matmul_int8_quantizes_activations_as_the_cpu) {
    const tensor_type types[2] = {TENSOR_TYPE_Q8_0, TENSOR_TYPE_Q6_K};
    const int64_t sizes[2] = {7 * 32, 7 * 256};
    for (int i = 0; i < 2; i++) {
        const tensor_type t = types[i], at = tensor_type_get((int)t)->act_type;
        const int64_t n = sizes[i];
        const int n_tok = 2, G = t == TENSOR_TYPE_Q8_0 ? 32 : 256;
        size_t rb;
        uint8_t *w = identity_weight(t, n, &rb);
        float *x = malloc(sizeof(float) * n_tok * n), *want = malloc(sizeof(float) * n_tok * n);
        float *yg = malloc(sizeof(float) * n_tok * n);
        uint8_t *xq = malloc(tensor_row_size(at, n));
        special_activations(x, n, G);
        for (int64_t e = 0; e < n; e++) x[n + e] = -0.75f * x[(e + G) % n]; /* other kinds' order */
        for (int tk = 0; tk < n_tok; tk++) {
            quantize_row_act(at, x + tk * n, xq, n);
            dequantize_row_act(at, xq, want + tk * n, n);
        }
        kv_error err = {{0}};
        weight wg = {t, n, n, rb, backend_weight_data(g_gpu, w, rb * (size_t)n, &err)};
        cr_assert_not_null(wg.data, "%s", err.msg);
        float *dx = put(g_gpu, x, sizeof(float) * n_tok * n);
        float *dy = backend_alloc(g_gpu, sizeof(float) * n_tok * n);
        cr_assert_eq(backend_matmul(g_gpu, &wg, dx, n_tok, dy), 0);
        get(g_gpu, yg, dy, sizeof(float) * n_tok * n);
        expect_same(tensor_type_get((int)t)->name, yg, want, sizeof(float) * n_tok * n);
        backend_free(g_gpu, dx);
        backend_free(g_gpu, dy);
        backend_weight_release(g_gpu, w);
        free(xq);
        free(yg);
        free(want);
        free(x);
        free(w);
    }
}

Test(cuda, matmul_beyond_reserved_scratch_fails) {
    size_t rb;
    const int64_t wide = 8192; /* > the 4352 reserved */
    uint8_t *w = random_weight(TENSOR_TYPE_Q8_0, wide, 8, &rb);
    kv_error err = {{0}};
    weight wg = {TENSOR_TYPE_Q8_0, 4352, 8, rb, backend_weight_data(g_gpu, w, rb * 8, &err)};
    float *dx = backend_alloc(g_gpu, sizeof(float) * 200 * wide);
    float *dy = backend_alloc(g_gpu, sizeof(float) * 200 * 8);
    cr_expect_eq(backend_matmul(g_gpu, &wg, dx, 200, dy), -1, "200 int8 rows > the 128 reserved");
    backend_set_precision(g_gpu, MATMUL_PRECISION_F32);
    cr_expect_eq(backend_matmul(g_gpu, &wg, dx, 200, dy), -1, "200 GEMM rows > the 128 reserved");
    backend_set_precision(g_gpu, MATMUL_PRECISION_Q8);
    wg.n_in = wide;
    cr_expect_eq(backend_matmul(g_gpu, &wg, dx, 100, dy), -1,
                 "100 int8 rows of 8192: more codes than the 128 x 4352 reserved");
    backend_weight_release(g_gpu, w);
    backend_free(g_gpu, dx);
    backend_free(g_gpu, dy);
    free(w);
}

Test(cuda, embed_every_type_bit_for_bit) {
    const int64_t n_in = 256, n_rows = 50;
    const int n = 9;
    int32_t ids[9] = {3, 0, 49, 3, 17, 17, 2, 48, 25};
    for (size_t i = 0; i < N_WEIGHT_TYPES; i++) {
        tensor_type t = WEIGHT_TYPES[i];
        size_t rb;
        uint8_t *w = random_weight(t, n_in, n_rows, &rb);
        kv_error err = {{0}};
        weight wc = {t, n_in, n_rows, rb, w}, wg = wc;
        wg.data = backend_weight_data(g_gpu, w, rb * n_rows, &err);
        float yc[9 * 256], yg[9 * 256];
        int32_t *did = put(g_gpu, ids, sizeof ids);
        float *dy = backend_alloc(g_gpu, sizeof yg);
        cr_assert_eq(backend_embed(g_cpu, &wc, ids, n, yc), 0);
        cr_assert_eq(backend_embed(g_gpu, &wg, did, n, dy), 0);
        get(g_gpu, yg, dy, sizeof yg);
        expect_same(tensor_type_get((int)t)->name, yg, yc, sizeof yc);
        backend_free(g_gpu, did);
        backend_free(g_gpu, dy);
        backend_weight_release(g_gpu, w);
        free(w);
    }
}

/* ---------------------------------------------------------------- row and elementwise ops */

Test(cuda, rmsnorm_swiglu_add_gather) {
    const int n_tok = 5, dim = 576;
    const size_t n = (size_t)n_tok * dim, bytes = sizeof(float) * n;
    float *x = malloc(bytes), *g = malloc(sizeof(float) * dim), *u = malloc(bytes);
    float *yc = malloc(bytes), *yg = malloc(bytes);
    for (size_t i = 0; i < n; i++) x[i] = rndf(-3, 3), u[i] = rndf(-2, 2);
    for (int i = 0; i < dim; i++) g[i] = rndf(0.5f, 1.5f);
    float *dx = put(g_gpu, x, bytes), *dg = put(g_gpu, g, sizeof(float) * dim);
    float *du = put(g_gpu, u, bytes), *dy = backend_alloc(g_gpu, bytes);

    cr_assert_eq(backend_rmsnorm(g_cpu, x, g, yc, n_tok, dim, 1e-5f), 0);
    cr_assert_eq(backend_rmsnorm(g_gpu, dx, dg, dy, n_tok, dim, 1e-5f), 0);
    get(g_gpu, yg, dy, bytes);
    expect_close("rmsnorm", yg, yc, NULL, n, 1e-5, 1e-7);

    cr_assert_eq(backend_swiglu(g_cpu, x, u, yc, (int64_t)n), 0);
    cr_assert_eq(backend_swiglu(g_gpu, dx, du, dy, (int64_t)n), 0);
    get(g_gpu, yg, dy, bytes);
    expect_close("swiglu", yg, yc, NULL, n, 1e-5, 1e-7);

    memcpy(yc, x, bytes);
    cr_assert_eq(backend_add(g_cpu, yc, u, (int64_t)n), 0);
    cr_assert_eq(backend_add(g_gpu, dx, du, (int64_t)n), 0);
    get(g_gpu, yg, dx, bytes);
    expect_same("add", yg, yc, bytes);

    int32_t idx[3] = {4, 0, 2};
    int32_t *didx = put(g_gpu, idx, sizeof idx);
    cr_assert_eq(backend_gather_rows(g_cpu, yc, u, idx, 3, dim), 0);
    cr_assert_eq(backend_gather_rows(g_gpu, dy, du, didx, 3, dim), 0);
    get(g_gpu, yg, dy, sizeof(float) * 3 * dim);
    expect_same("gather_rows", yg, yc, sizeof(float) * 3 * dim);

    backend_free(g_gpu, didx);
    backend_free(g_gpu, dx);
    backend_free(g_gpu, dg);
    backend_free(g_gpu, du);
    backend_free(g_gpu, dy);
    free(x), free(g), free(u), free(yc), free(yg);
}

Test(cuda, rope_angles_positions_and_precomputed) {
    const int n_tok = 7, n_head = 3, head_dim = 64, n_rot = 48; /* n_rot < head_dim */
    float inv[24];
    for (int i = 0; i < n_rot / 2; i++) inv[i] = powf(10000.0f, -2.0f * i / n_rot);
    rope_table rc = {n_rot, inv}, rg = {n_rot, put(g_gpu, inv, sizeof inv)};
    int32_t pos[7] = {0, 1, 5, 4096, -3, 77, 131071};
    int32_t idx[7] = {6, 0, 3, 3, 1, 2, 5};
    const size_t n = (size_t)n_tok * n_head * head_dim, bytes = sizeof(float) * n;
    float x[7 * 3 * 64], yc[7 * 3 * 64], yg[7 * 3 * 64], csc[7 * 48], csg[7 * 48];
    for (size_t i = 0; i < n; i++) x[i] = rndf(-2, 2);
    int32_t *dpos = put(g_gpu, pos, sizeof pos), *didx = put(g_gpu, idx, sizeof idx);
    float *dx = put(g_gpu, x, bytes), *dcs = backend_alloc(g_gpu, sizeof csg);

    cr_assert_eq(backend_rope_angles(g_cpu, &rc, pos, n_tok, csc), 0);
    cr_assert_eq(backend_rope_angles(g_gpu, &rg, dpos, n_tok, dcs), 0);
    get(g_gpu, csg, dcs, sizeof csg);
    expect_close("rope_angles", csg, csc, NULL, sizeof csc / 4, 0, 2e-7);

    memcpy(yc, x, bytes);
    cr_assert_eq(backend_rope(g_cpu, yc, pos, n_tok, n_head, head_dim, &rc), 0);
    cr_assert_eq(backend_rope(g_gpu, dx, dpos, n_tok, n_head, head_dim, &rg), 0);
    get(g_gpu, yg, dx, bytes);
    expect_close("rope at positions", yg, yc, NULL, n, 0, 2e-6);

    /* the same angles on both sides: the rotation itself is bit for bit */
    cr_assert_eq(backend_upload(g_gpu, dcs, csc, sizeof csc), 0);
    cr_assert_eq(backend_upload(g_gpu, dx, x, bytes), 0);
    memcpy(yc, x, bytes);
    cr_assert_eq(backend_rope_cs(g_cpu, yc, csc, idx, n_tok, n_head, head_dim, n_rot), 0);
    cr_assert_eq(backend_rope_cs(g_gpu, dx, dcs, didx, n_tok, n_head, head_dim, n_rot), 0);
    get(g_gpu, yg, dx, bytes);
    expect_same("rope_cs", yg, yc, bytes);

    backend_free(g_gpu, rg.inv_freq);
    backend_free(g_gpu, dpos);
    backend_free(g_gpu, didx);
    backend_free(g_gpu, dx);
    backend_free(g_gpu, dcs);
}

Test(cuda, softmax_and_topk) {
    const int rows = 4, n = 1000, k = 50;
    float *x = malloc(sizeof(float) * rows * n), *yc = malloc(sizeof(float) * rows * n);
    float *yg = malloc(sizeof(float) * rows * n);
    for (int i = 0; i < rows * n; i++) x[i] = rndf(-8, 8);
    /* row 1: ties (values repeat every 7 ids); row 2: NaN and infinities among them */
    for (int i = 0; i < n; i++) x[n + i] = (float)(i % 7);
    x[2 * n + 5] = NAN, x[2 * n + 9] = INFINITY, x[2 * n + 11] = -INFINITY, x[2 * n + 13] = NAN;
    float *dx = put(g_gpu, x, sizeof(float) * rows * n);
    float vc[4 * 50], vg[4 * 50];
    int32_t ic[4 * 50], ig[4 * 50];
    float *dv = backend_alloc(g_gpu, sizeof vg);
    int32_t *di = backend_alloc(g_gpu, sizeof ig);
    cr_assert_eq(backend_topk(g_cpu, x, rows, n, k, vc, ic), 0);
    cr_assert_eq(backend_topk(g_gpu, dx, rows, n, k, dv, di), 0);
    get(g_gpu, vg, dv, sizeof vg);
    get(g_gpu, ig, di, sizeof ig);
    expect_same("topk ids", ig, ic, sizeof ic);
    expect_same("topk values", vg, vc, sizeof vc);
    cr_expect_eq(ic[50], 6, "ties: the lowest id of the largest value first");
    cr_expect_eq(ic[2 * 50], 9, "+inf first");
    cr_expect_eq(backend_topk(g_gpu, dx, rows, n, n + 1, dv, di), -1, "k > n is refused");

    /* softmax without the NaN row */
    memcpy(yc, x, sizeof(float) * 2 * n);
    cr_assert_eq(backend_softmax(g_cpu, yc, 2, n), 0);
    cr_assert_eq(backend_softmax(g_gpu, dx, 2, n), 0);
    get(g_gpu, yg, dx, sizeof(float) * 2 * n);
    expect_close("softmax", yg, yc, NULL, (size_t)2 * n, 1e-5, 1e-12);

    backend_free(g_gpu, dx);
    backend_free(g_gpu, dv);
    backend_free(g_gpu, di);
    free(x), free(yc), free(yg);
}

/* ---------------------------------------------------------------- the KV pool */

typedef struct pools {
    kv_layout l;
    void *pc, *pg; /* CPU pool, CUDA pool */
    size_t bytes;
} pools;

static pools pools_make(int n_layer, int n_kv_head, int head_dim, int block_tokens, int n_blocks) {
    pools p = {.l = {n_layer, n_kv_head, head_dim, block_tokens, n_blocks}};
    p.pc = backend_kv_alloc(g_cpu, &p.l);
    p.pg = backend_kv_alloc(g_gpu, &p.l);
    cr_assert(p.pc && p.pg);
    p.bytes = kv_layout_block_bytes(&p.l) * (size_t)n_blocks;
    return p;
}

static void pools_expect_same(const char *what, const pools *p) {
    uint8_t *hg = malloc(p->bytes);
    int32_t *all = malloc(sizeof(int32_t) * p->l.n_blocks);
    for (int i = 0; i < p->l.n_blocks; i++) all[i] = i;
    cr_assert_eq(backend_kv_read_blocks(g_gpu, p->pg, &p->l, all, (int)p->l.n_blocks, hg), 0);
    expect_same(what, hg, p->pc, p->bytes);
    free(all);
    free(hg);
}

static void pools_free(pools *p) {
    backend_kv_free(g_cpu, p->pc);
    backend_kv_free(g_gpu, p->pg);
}

/* How pools_write reaches the CUDA pool: the op on backend memory, or a host-facing store. */
typedef enum write_path { WRITE_OP, WRITE_STORE, WRITE_STORE_SERIAL } write_path;

/* Writes n_tok rows of K and V at slots through a block table on both backends. */
static void pools_write(pools *p, int layer, const int32_t *table, int n_table,
                        const int32_t *slots, int n_tok, write_path path) {
    size_t kvd = (size_t)p->l.n_kv_head * p->l.head_dim, bytes = sizeof(float) * n_tok * kvd;
    float *k = malloc(bytes), *v = malloc(bytes);
    for (size_t i = 0; i < n_tok * kvd; i++) k[i] = rndf(-1, 1), v[i] = rndf(-1, 1);
    cr_assert_eq(backend_kv_write(g_cpu, p->pc, &p->l, layer, table, slots, n_tok, k, v), 0);
    if (path == WRITE_STORE) {
        cr_assert_eq(backend_kv_store(g_gpu, p->pg, &p->l, layer, table, slots, n_tok, k, v), 0);
    } else if (path == WRITE_STORE_SERIAL) {
        cr_assert_eq(backend_kv_store_serial(g_gpu, p->pg, &p->l, layer, table, slots, n_tok, k, v),
                     0);
    } else {
        int32_t *dt = put(g_gpu, table, sizeof(int32_t) * n_table);
        int32_t *ds = put(g_gpu, slots, sizeof(int32_t) * n_tok);
        float *dk = put(g_gpu, k, bytes), *dv = put(g_gpu, v, bytes);
        cr_assert_eq(backend_kv_write(g_gpu, p->pg, &p->l, layer, dt, ds, n_tok, dk, dv), 0);
        backend_free(g_gpu, dt), backend_free(g_gpu, ds), backend_free(g_gpu, dk);
        backend_free(g_gpu, dv);
    }
    free(k), free(v);
}

Test(cuda, kv_write_store_load_rope_and_blocks) {
    pools p = pools_make(2, 3, 64, 16, 6);
    int32_t table[4] = {5, 2, 0, 3};
    int32_t slots[40];
    for (int i = 0; i < 40; i++) slots[i] = (i * 7) % 61; /* scattered over 4 blocks */
    pools_write(&p, 1, table, 4, slots, 40, WRITE_OP);
    pools_write(&p, 0, table, 4, slots, 23, WRITE_STORE);
    pools_write(&p, 0, table, 4, slots + 23, 17, WRITE_STORE_SERIAL);
    pools_expect_same("kv_write / kv_store / kv_store_serial", &p);

    size_t kvd = 3 * 64;
    float *lc = malloc(sizeof(float) * 40 * kvd), *lg = malloc(sizeof(float) * 40 * kvd);
    for (int kv = 0; kv < 2; kv++) {
        cr_assert_eq(backend_kv_load(g_cpu, p.pc, &p.l, 1, kv, table, slots, 40, lc), 0);
        cr_assert_eq(backend_kv_load(g_gpu, p.pg, &p.l, 1, kv, table, slots, 40, lg), 0);
        expect_same(kv ? "kv_load V" : "kv_load K", lg, lc, sizeof(float) * 40 * kvd);
    }

    /* K re-rotated by position deltas, as CacheBlend moves reused keys */
    float inv[32], cs[40 * 64];
    for (int i = 0; i < 32; i++) inv[i] = powf(10000.0f, -2.0f * i / 64);
    rope_table rt = {64, inv};
    int32_t delta[40];
    for (int i = 0; i < 40; i++) delta[i] = 100 - 9 * i;
    cr_assert_eq(backend_rope_angles(g_cpu, &rt, delta, 40, cs), 0);
    int32_t *dt = put(g_gpu, table, sizeof table), *ds = put(g_gpu, slots, sizeof slots);
    float *dcs = put(g_gpu, cs, sizeof cs);
    cr_assert_eq(backend_kv_rope(g_cpu, p.pc, &p.l, 1, table, slots, 40, cs, 64), 0);
    cr_assert_eq(backend_kv_rope(g_gpu, p.pg, &p.l, 1, dt, ds, 40, dcs, 64), 0);
    pools_expect_same("kv_rope", &p);

    /* copy on write, and records out and back in: sync and on a stream with an event */
    cr_assert_eq(backend_kv_copy_block(g_cpu, p.pc, &p.l, 1, 5), 0);
    cr_assert_eq(backend_kv_copy_block(g_gpu, p.pg, &p.l, 1, 5), 0);
    pools_expect_same("kv_copy_block", &p);
    size_t bb = kv_layout_block_bytes(&p.l);
    int32_t out_ids[2] = {0, 3}, in_ids[2] = {4, 1};
    uint8_t *hc = malloc(2 * bb);
    cr_assert_eq(backend_kv_read_blocks(g_cpu, p.pc, &p.l, out_ids, 2, hc), 0);
    cr_assert_eq(backend_kv_write_blocks(g_cpu, p.pc, &p.l, in_ids, 2, hc), 0);
    kv_error err = {{0}};
    backend_stream *s = backend_stream_create(g_gpu, &err);
    backend_event *e = backend_event_create(g_gpu, &err);
    uint8_t *pinned = backend_host_alloc(g_gpu, 2 * bb);
    cr_assert(s && e && pinned, "%s", err.msg);
    cr_assert_eq(backend_event_record(g_gpu, e, NULL), 0);
    cr_assert_eq(backend_stream_wait(g_gpu, s, e), 0);
    cr_assert_eq(backend_kv_read_blocks_async(g_gpu, p.pg, &p.l, out_ids, 2, pinned, s), 0);
    cr_assert_eq(backend_event_record(g_gpu, e, s), 0);
    cr_assert_eq(backend_event_sync(g_gpu, e), 0);
    expect_same("kv_read_blocks_async", pinned, hc, 2 * bb);
    cr_assert_eq(backend_kv_write_blocks_async(g_gpu, p.pg, &p.l, in_ids, 2, pinned, s), 0);
    cr_assert_eq(backend_event_record(g_gpu, e, s), 0);
    cr_assert_eq(backend_stream_wait(g_gpu, NULL, e), 0);
    cr_assert_eq(backend_sync(g_gpu), 0);
    pools_expect_same("kv_write_blocks_async", &p);

    /* token rows at any slot to and from a record's blocks (Prompt Cache's placement): 30 rows
     * from host slot 7 to pool slots 5.., then 25 rows from pool slot 3 into host slot 11.. of a
     * buffer whose other rows must stay as they were */
    uint8_t *rows = malloc(3 * bb), *rc = malloc(3 * bb), *rg = malloc(3 * bb);
    for (size_t i = 0; i < 3 * bb; i++) rows[i] = (uint8_t)rnd(), rc[i] = rg[i] = (uint8_t)i;
    for (size_t i = 0; i < 3 * bb; i += 2) rows[i + 1] &= 0x3b; /* finite f16 */
    cr_assert_eq(backend_kv_write_rows(g_cpu, p.pc, &p.l, table, 5, 30, rows, 7), 0);
    cr_assert_eq(backend_kv_write_rows(g_gpu, p.pg, &p.l, table, 5, 30, rows, 7), 0);
    pools_expect_same("kv_write_rows", &p);
    cr_assert_eq(backend_kv_read_rows(g_cpu, p.pc, &p.l, table, 3, 25, rc, 11), 0);
    cr_assert_eq(backend_kv_read_rows(g_gpu, p.pg, &p.l, table, 3, 25, rg, 11), 0);
    expect_same("kv_read_rows", rg, rc, 3 * bb);
    free(rows), free(rc), free(rg);

    backend_host_free(g_gpu, pinned);
    backend_event_destroy(g_gpu, e);
    backend_stream_destroy(g_gpu, s);
    backend_free(g_gpu, dt), backend_free(g_gpu, ds), backend_free(g_gpu, dcs);
    free(hc), free(lc), free(lg);
    pools_free(&p);
}

/* ---------------------------------------------------------------- attention */

/* Sequences over one pool: KV written on both backends, queries f32, then both attentions. */
typedef struct attn_case {
    int n_head, n_kv_head, head_dim;
    int n_seqs;
    int n_kv[3]; /* slots holding KV */
    int n_q[3];  /* query rows: the last n_q slots, or every other slot when scattered */
    bool split[3];
    bool scattered[3];
    float q_amp;      /* queries in [-q_amp, q_amp] (0: 1); larger ones make the softmax peaky */
    int block_tokens; /* the pool's block size (0: 16) */
} attn_case;

/* Sequences of this many rows go to the tensor-core kernel (ATTN_TC_MIN_ROWS, cuda.h). */
#define TC_MIN_ROWS 16

/* The tensor-core kernel's bound per output (attention.cu, "Precision"): Q and P enter the mma as
 * two f16 parts each, within 2^-22 |x| + 2^-25 of f32; K and V are exact. With ds the most a
 * row's score can move (natural log units),
 *   |d| <= max|v| (e^(2 ds) - 1 + 2^-22 + n_keys 2^-25) + 2e-5,
 * the exponential term from each softmax weight moving by a factor within e^(+-2 ds) after
 * normalization, the next two from P's parts against a row sum >= 1, and 2e-5 for f32 sums in
 * another order as elsewhere. ds = (2^-22 + (hd + 2) 2^-24) scale sum_i |q_i k_i| + ln 2 2^-25
 * sum_i |k_i|: Q's parts, the f32 products and sums of hd terms, over the row's keys. k and v:
 * [n_kv][n_kv_head][head_dim] f32 as the pool holds them. */
static void tc_bounds(const attn_case *c, const float *q, const int32_t *q_slot, int n_q,
                      const float *k, const float *v, float scale, double *bound) {
    const int hd = c->head_dim, grp = c->n_head / c->n_kv_head;
    for (int r = 0; r < n_q; r++)
        for (int h = 0; h < c->n_head; h++) {
            const float *qr = q + ((size_t)r * c->n_head + h) * hd;
            double ds = 0, vmax = 0;
            for (int j = 0; j <= q_slot[r]; j++) {
                const float *kj = k + ((size_t)j * c->n_kv_head + h / grp) * hd;
                const float *vj = v + ((size_t)j * c->n_kv_head + h / grp) * hd;
                double qk = 0, ka = 0;
                for (int i = 0; i < hd; i++) {
                    qk += fabs((double)qr[i] * kj[i]);
                    ka += fabs((double)kj[i]);
                    vmax = fmax(vmax, fabs((double)vj[i]));
                }
                ds = fmax(ds, (ldexp(1, -22) + ldexp(hd + 2, -24)) * scale * qk +
                                  log(2.0) * ldexp(ka, -25));
            }
            double b = vmax * (expm1(2 * ds) + ldexp(1, -22) + ldexp(q_slot[r] + 1, -25)) + 2e-5;
            for (int i = 0; i < hd; i++) bound[((size_t)r * c->n_head + h) * hd + i] = b;
        }
}

static void check_attention(const char *what, const attn_case *c) {
    const int bt = c->block_tokens > 0 ? c->block_tokens : 16;
    int n_blocks = 0;
    for (int s = 0; s < c->n_seqs; s++) n_blocks += (c->n_kv[s] + bt - 1) / bt;
    pools p = pools_make(2, c->n_kv_head, c->head_dim, bt, n_blocks + 1);
    const int layer = 1, hd = c->head_dim;
    attn_seq sc[3], sg[3];
    float *qs[3], *oc[3];
    void *dev[3][4];
    /* blocks handed out in reverse, interleaved between sequences */
    int next = n_blocks;
    int32_t tables[3][256];
    for (int s = 0; s < c->n_seqs; s++)
        for (int b = 0; b < (c->n_kv[s] + bt - 1) / bt; b++) tables[s][b] = next--;
    for (int s = 0; s < c->n_seqs; s++) {
        int nb = (c->n_kv[s] + bt - 1) / bt;
        int32_t *slots = malloc(sizeof(int32_t) * c->n_kv[s]);
        for (int i = 0; i < c->n_kv[s]; i++) slots[i] = i;
        pools_write(&p, layer, tables[s], nb, slots, c->n_kv[s], s % 2 ? WRITE_STORE : WRITE_OP);
        int nq = c->n_q[s];
        int32_t *q_slot = malloc(sizeof(int32_t) * nq);
        for (int r = 0; r < nq; r++)
            q_slot[r] = c->scattered[s] ? c->n_kv[s] - 1 - 2 * (nq - 1 - r) : c->n_kv[s] - nq + r;
        size_t qn = (size_t)nq * c->n_head * hd;
        qs[s] = malloc(sizeof(float) * qn);
        oc[s] = malloc(sizeof(float) * qn);
        const float amp = c->q_amp > 0 ? c->q_amp : 1.0f;
        for (size_t i = 0; i < qn; i++) qs[s][i] = rndf(-amp, amp);
        sc[s] = (attn_seq){tables[s], c->n_kv[s], nq, q_slot, qs[s], oc[s], c->split[s]};
        dev[s][0] = put(g_gpu, tables[s], sizeof(int32_t) * nb);
        dev[s][1] = put(g_gpu, q_slot, sizeof(int32_t) * nq);
        dev[s][2] = put(g_gpu, qs[s], sizeof(float) * qn);
        dev[s][3] = backend_alloc(g_gpu, sizeof(float) * qn);
        sg[s] = (attn_seq){dev[s][0], c->n_kv[s], nq, dev[s][1], dev[s][2], dev[s][3], c->split[s]};
        free(slots);
    }
    float scale = 1.0f / sqrtf((float)hd);
    cr_assert_eq(backend_attention(g_cpu, p.pc, &p.l, layer, c->n_head, scale, sc, c->n_seqs), 0);
    cr_assert_eq(backend_attention(g_gpu, p.pg, &p.l, layer, c->n_head, scale, sg, c->n_seqs), 0);
    for (int s = 0; s < c->n_seqs; s++) {
        size_t qn = (size_t)c->n_q[s] * c->n_head * hd;
        float *og = malloc(sizeof(float) * qn);
        get(g_gpu, og, dev[s][3], sizeof(float) * qn);
        char name[96];
        snprintf(name, sizeof name, "attention %s, sequence %d%s", what, s,
                 c->n_q[s] >= TC_MIN_ROWS ? " (tensor cores)" : "");
        if (c->n_q[s] >= TC_MIN_ROWS) {
            size_t kn = (size_t)c->n_kv[s] * c->n_kv_head * hd;
            float *k = malloc(sizeof(float) * kn), *v = malloc(sizeof(float) * kn);
            double *bound = malloc(sizeof(double) * qn);
            int32_t *slots = malloc(sizeof(int32_t) * c->n_kv[s]);
            for (int i = 0; i < c->n_kv[s]; i++) slots[i] = i;
            cr_assert_eq(
                backend_kv_load(g_cpu, p.pc, &p.l, layer, 0, tables[s], slots, c->n_kv[s], k), 0);
            cr_assert_eq(
                backend_kv_load(g_cpu, p.pc, &p.l, layer, 1, tables[s], slots, c->n_kv[s], v), 0);
            tc_bounds(c, qs[s], sc[s].q_slot, c->n_q[s], k, v, scale, bound);
            expect_close(name, og, oc[s], bound, qn, 1, 0);
            free(k), free(v), free(bound), free(slots);
        } else {
            expect_close(name, og, oc[s], NULL, qn, 0, 2e-5);
        }
        free(og);
        for (int i = 0; i < 4; i++) backend_free(g_gpu, dev[s][i]);
        free((void *)sc[s].q_slot);
        free(qs[s]), free(oc[s]);
    }
    pools_free(&p);
}

Test(cuda, attention_prefill_gqa) {
    /* SmolLM2's 9 heads over 3 kv heads; a 37-row prompt, a 5-row step after 60 cached slots,
     * and scattered rows (a blended layer's recomputed tokens) */
    attn_case c = {.n_head = 9,
                   .n_kv_head = 3,
                   .head_dim = 64,
                   .n_seqs = 3,
                   .n_kv = {37, 65, 50},
                   .n_q = {37, 5, 9},
                   .scattered = {false, false, true}};
    check_attention("prefill GQA 9/3", &c);
}

Test(cuda, attention_decode_split_keys) {
    /* decode rows over 1500 slots (32 ranges of 46-47 keys: ATTN_MAX_SPLIT), over 300 (9 ranges,
     * the last tile of each holding 1-2 keys) and over 40 (not split: under 2 x 32 keys);
     * head_dim 128, MQA-like 8/1 */
    attn_case c = {.n_head = 8,
                   .n_kv_head = 1,
                   .head_dim = 128,
                   .n_seqs = 3,
                   .n_kv = {1500, 300, 40},
                   .n_q = {1, 2, 1},
                   .split = {true, true, true}};
    check_attention("decode, split keys", &c);
}

/* The tensor-core kernel (sequences of TC_MIN_ROWS rows or more) beside the warps: a prompt
 * from slot 0, a prefill continuing after cached history (rows from slot 79 on, keys over 7 pool
 * blocks handed out in reverse), and rows at every other slot; row counts that fill no 64-row
 * tile evenly, at GQA ratios 1, 2 and 4. */
static void check_tc_ratios(int head_dim, float q_amp) {
    const int heads[3][2] = {{4, 4}, {8, 4}, {8, 2}};
    for (int i = 0; i < 3; i++) {
        attn_case c = {.n_head = heads[i][0],
                       .n_kv_head = heads[i][1],
                       .head_dim = head_dim,
                       .n_seqs = 3,
                       .n_kv = {37, 100, 90},
                       .n_q = {37, 21, 30},
                       .scattered = {false, false, true},
                       .q_amp = q_amp};
        char what[64];
        snprintf(what, sizeof what, "head_dim %d, %d/%d heads, q in +-%g", head_dim, c.n_head,
                 c.n_kv_head, (double)q_amp);
        check_attention(what, &c);
    }
}

Test(cuda, attention_tensor_cores_gqa_ratios_head_dim_64) { check_tc_ratios(64, 1); }

Test(cuda, attention_tensor_cores_peaky_softmax) {
    /* scores spread over several units: the running max moves and rescales the sums */
    check_tc_ratios(64, 6);
}

Test(cuda, attention_tensor_cores_head_dim_128) {
    /* Llama 3 8B's 32/8 heads as 8/2; 150 keys (3 tiles of 64) beside a 70-row prompt */
    attn_case c = {.n_head = 8,
                   .n_kv_head = 2,
                   .head_dim = 128,
                   .n_seqs = 2,
                   .n_kv = {150, 70},
                   .n_q = {45, 70}};
    check_attention("head_dim 128, 8/2 heads", &c);
}

Test(cuda, attention_tensor_cores_odd_head_dims) {
    /* 48 (3 k-steps) beside a decode row on the warps, and 96 over 2 pool blocks */
    attn_case a = {.n_head = 6,
                   .n_kv_head = 2,
                   .head_dim = 48,
                   .n_seqs = 2,
                   .n_kv = {80, 40},
                   .n_q = {50, 1},
                   .split = {false, true}};
    check_attention("head_dim 48, 6/2 heads", &a);
    attn_case b = {
        .n_head = 2, .n_kv_head = 1, .head_dim = 96, .n_seqs = 1, .n_kv = {30}, .n_q = {17}};
    check_attention("head_dim 96, 2/1 heads", &b);
}

Test(cuda, attention_decode_gqa_groups_share_tiles) {
    /* the warp kernel's blocks are heads of one KV group (up to 8: 16/1 takes two blocks per
     * group): GQA 1, 2, 4 and 16, split decode rows over 200 and 75 keys beside 5 rows not split */
    const int heads[4][2] = {{4, 4}, {8, 4}, {8, 2}, {16, 1}};
    for (int i = 0; i < 4; i++) {
        attn_case c = {.n_head = heads[i][0],
                       .n_kv_head = heads[i][1],
                       .head_dim = 64,
                       .n_seqs = 3,
                       .n_kv = {200, 75, 30},
                       .n_q = {1, 2, 5},
                       .split = {true, true, false}};
        char what[64];
        snprintf(what, sizeof what, "decode, %d/%d heads", c.n_head, c.n_kv_head);
        check_attention(what, &c);
    }
}

Test(cuda, attention_blocks_of_48_slots) {
    /* 32-key tiles that straddle pool blocks at slots 48, 96 and 144 (both kernels) */
    attn_case c = {.n_head = 8,
                   .n_kv_head = 2,
                   .head_dim = 64,
                   .n_seqs = 2,
                   .n_kv = {100, 150},
                   .n_q = {40, 1},
                   .split = {false, true},
                   .block_tokens = 48};
    check_attention("48-slot blocks, 8/2 heads", &c);
}

Test(cuda, attention_beyond_reserved_sequences_fails) {
    pools p = pools_make(1, 1, 64, 16, 1);
    attn_seq s[5] = {{0}};
    cr_expect_eq(backend_attention(g_gpu, p.pg, &p.l, 0, 1, 1.0f, s, 5), -1, "5 > 4 reserved");
    pools_free(&p);
}

/* ---------------------------------------------------------------- step graphs */

/* A recorded step replays its ops on the data its buffers hold when it replays; the key and the
 * owner tell steps apart. */
Test(cuda, a_recorded_step_replays_on_current_data) {
    const int n = 1000;
    float x[1000], y[1000], out[1000];
    for (int i = 0; i < n; i++) x[i] = (float)i, y[i] = 0.5f;
    float *dx = put(g_gpu, x, sizeof x), *dy = put(g_gpu, y, sizeof y);
    int owner, key = 1;
    cr_assert(backend_graphs(g_gpu));
    cr_assert_eq(backend_graph_begin(g_gpu, &owner, &key, sizeof key), BACKEND_GRAPH_RECORD);
    cr_assert_eq(backend_add(g_gpu, dy, dx, n), 0);
    cr_assert_eq(backend_swiglu(g_gpu, dy, dx, dy, n), 0);
    cr_assert_eq(backend_graph_end(g_gpu), 0, "recorded, then run");
    get(g_gpu, out, dy, sizeof out);
    for (int round = 0; round < 3; round++) {
        float want[1000];
        for (int i = 0; i < n; i++) {
            float a = y[i] + x[i];
            want[i] = a / (1.0f + expf(-a)) * x[i];
        }
        for (int i = 0; i < n; i++)
            cr_assert_float_eq(out[i], want[i], 1e-4f * fabsf(want[i]) + 1e-6f,
                               "round %d, [%d]: %g, want %g", round, i, out[i], want[i]);
        /* new inputs, uploaded before the step; the same key replays */
        for (int i = 0; i < n; i++) x[i] = (float)(round + 1) * 0.01f * (float)(i % 37), y[i] = -1;
        cr_assert_eq(backend_upload(g_gpu, dx, x, sizeof x), 0);
        cr_assert_eq(backend_upload(g_gpu, dy, y, sizeof y), 0);
        cr_assert_eq(backend_graph_begin(g_gpu, &owner, &key, sizeof key), BACKEND_GRAPH_REPLAY);
        cr_assert_eq(backend_graph_end(g_gpu), 0);
        get(g_gpu, out, dy, sizeof out);
    }
    /* another key, or another owner, is another step */
    int key2 = 2, owner2;
    cr_expect_eq(backend_graph_begin(g_gpu, &owner, &key2, sizeof key2), BACKEND_GRAPH_RECORD);
    cr_expect_eq(backend_graph_end(g_gpu), 0, "an empty step");
    cr_expect_eq(backend_graph_begin(g_gpu, &owner2, &key, sizeof key), BACKEND_GRAPH_RECORD);
    cr_expect_eq(backend_graph_end(g_gpu), 0);
    backend_graph_forget(g_gpu, &owner);
    cr_expect_eq(backend_graph_begin(g_gpu, &owner, &key, sizeof key), BACKEND_GRAPH_RECORD,
                 "forgotten");
    cr_expect_eq(backend_graph_end(g_gpu), 0);
    backend_free(g_gpu, dx), backend_free(g_gpu, dy);
}

#ifndef KVSERVE_TEST_GPU
/* The backend keeps a bounded number of graphs: the least recently begun one makes room, and
 * comes back recorded anew. */
Test(cuda, graphs_are_bounded_least_recently_used_first) {
    const long before = cuda_emu_live_graphs();
    float *x = backend_alloc(g_gpu, 64);
    int owner;
    for (int key = 0; key < 70; key++) {
        cr_assert_eq(backend_graph_begin(g_gpu, &owner, &key, sizeof key), BACKEND_GRAPH_RECORD);
        cr_assert_eq(backend_add(g_gpu, x, x, 16), 0);
        cr_assert_eq(backend_graph_end(g_gpu), 0);
        /* key 1 stays in use */
        int one = 1;
        if (key >= 1) {
            cr_assert_eq(backend_graph_begin(g_gpu, &owner, &one, sizeof one), BACKEND_GRAPH_REPLAY,
                         "key 1 after key %d", key);
            cr_assert_eq(backend_graph_end(g_gpu), 0);
        }
    }
    cr_expect_leq(cuda_emu_live_graphs() - before, 64, "%ld graphs kept",
                  cuda_emu_live_graphs() - before);
    int zero = 0, last = 69;
    cr_expect_eq(backend_graph_begin(g_gpu, &owner, &zero, sizeof zero), BACKEND_GRAPH_RECORD,
                 "the least recently used went first");
    cr_expect_eq(backend_graph_end(g_gpu), 0);
    cr_expect_eq(backend_graph_begin(g_gpu, &owner, &last, sizeof last), BACKEND_GRAPH_REPLAY);
    cr_expect_eq(backend_graph_end(g_gpu), 0);
    backend_graph_forget(g_gpu, &owner);
    cr_expect_eq(cuda_emu_live_graphs(), before, "forgotten: destroyed");
    backend_free(g_gpu, x);
}
#endif

/* A host wait inside a step cannot be recorded (the device would replay the step without it):
 * the recording fails, nothing of it ran, and the backend runs steps directly from then on. The
 * backend refuses an upload itself (a replay would copy whatever the pinned slot holds by then);
 * a download's stream synchronisation is refused by the runtime. */
Test(cuda, a_host_wait_inside_a_recorded_step_fails_the_recording) {
    for (int c = 0; c < 2; c++) {
        kv_error err = {{0}};
        backend *b = cuda_under_test(&err);
        cr_assert_not_null(b, "%s", err.msg);
        backend_limits lim = {
            .max_tokens = 8, .max_seqs = 2, .max_n_in = 256, .n_head = 2, .head_dim = 64};
        cr_assert_eq(backend_reserve(b, &lim, &err), 0, "%s", err.msg);
        float x[64], y[64];
        for (int i = 0; i < 64; i++) x[i] = 1, y[i] = 2;
        float *dx = put(b, x, sizeof x), *dy = put(b, y, sizeof y);
        int owner, key = 7;
        cr_assert_eq(backend_graph_begin(b, &owner, &key, sizeof key), BACKEND_GRAPH_RECORD);
        cr_assert_eq(backend_add(b, dy, dx, 64), 0);
        if (c == 0)
            cr_expect_neq(backend_upload(b, dx, x, sizeof x), 0, "an upload inside a step");
        else
            cr_expect_neq(backend_download(b, x, dx, sizeof x), 0, "a download inside a step");
        cr_expect_eq(backend_graph_end(b), -1, "case %d: the recording fails", c);
        cr_expect(!backend_graphs(b), "graphs are off from then on");
        cr_expect_eq(backend_graph_begin(b, &owner, &key, sizeof key), BACKEND_GRAPH_DIRECT);
        get(b, y, dy, sizeof y);
        cr_expect_eq(y[0], 2.0f, "case %d: nothing of the step ran", c);
        backend_free(b, dx), backend_free(b, dy);
        backend_destroy(b);
    }
}

#ifndef KVSERVE_TEST_GPU
/* Every allocation the emulated backend made is freed by backend_destroy. */
Test(cuda_lifetime, no_device_memory_leaks) {
    kv_error err = {{0}};
    long before = cuda_emu_live_allocations();
    backend *b = backend_cuda_emu_create(&err);
    cr_assert_not_null(b, "%s", err.msg);
    backend_limits lim = {
        .max_tokens = 64, .max_seqs = 4, .max_n_in = 256, .n_head = 4, .head_dim = 64};
    cr_assert_eq(backend_reserve(b, &lim, &err), 0);
    float w[64 * 256];
    for (int i = 0; i < 64 * 256; i++) w[i] = 1;
    cr_assert_not_null(backend_weight_data(b, w, sizeof w, &err));
    cr_assert_not_null(backend_weight_data(b, w, sizeof w, &err));
    backend_weight_release(b, w);
    kv_layout l = {2, 1, 64, 16, 4};
    void *pool = backend_kv_alloc(b, &l);
    void *x = backend_alloc(b, 1024);
    cr_assert(pool && x);
    /* a recorded step, left for backend_destroy to free */
    const long graphs_before = cuda_emu_live_graphs();
    int owner, key = 3;
    cr_assert_eq(backend_graph_begin(b, &owner, &key, sizeof key), BACKEND_GRAPH_RECORD);
    cr_assert_eq(backend_add(b, x, x, 16), 0);
    cr_assert_eq(backend_graph_end(b), 0);
    cr_expect_eq(cuda_emu_live_graphs(), graphs_before + 1);
    cr_expect_gt(cuda_emu_live_allocations(), before);
    backend_weight_release(b, w);
    backend_free(b, x);
    backend_kv_free(b, pool);
    backend_destroy(b);
    cr_expect_eq(cuda_emu_live_allocations(), before);
    cr_expect_eq(cuda_emu_live_graphs(), graphs_before);
}
#endif
