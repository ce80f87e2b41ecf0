/* Prefill-sized matmuls on int8 tensor cores (llama.cpp's mmq): more than MMVQ_MAX_TOKENS
 * activation rows against a weight of a quantized type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
 * Q6_K), without a dequantized copy of the weight.
 * - The activations come quantized once per op by cuda_quantize_q8 (mmvq.cu): the CPU's codes
 *   and scales, int8 codes [n_tok][n_in] and a q8_ds {scale, code sum} per 32 elements.
 * - A block of MMQ_WARPS warps computes an MMQ_ROWS x NT tile of y (weight rows x tokens). It
 *   walks n_in in steps of MMQ_K elements (a K-quant super-block, or 8 blocks of 32): the
 *   threads unpack the step's weight units to signed bytes in shared memory with q8_unit.cuh's
 *   unit_load (the decoding mmvq uses; each half of a unit stored at its element's place, so the
 *   tile holds the row's codes in order), with their scales and mins, and copy the activations'
 *   codes and q8_ds beside them. Each warp then multiplies its 16 weight rows with the NT tokens,
 *   one 32-element block at a time, on mma_s8_16x8x32 (mma.cuh): the block's exact integer dot
 *   products, turned into the block's float term by unit_term (the CPU scalar reference's float
 *   operations, as mmvq's). Q6_K's sub-blocks are 16 elements with their own scales: its blocks
 *   take two products, each with the other half's weight registers zeroed.
 * - Sums: a step's (at most 8) block terms in f32, then the steps' sums in f32, in k order: a
 *   result differs from the CPU's (a double sum in block order, or its SIMD tiles' f32 lanes) by
 *   rounding order, K-quant terms per sub-block rather than per super-block (mmvq's per unit),
 *   and not at all where every float operation is exact.
 * Rows past n_out and tokens past n_tok read the last valid row or token and are not stored.
 * Not yet measured on a GPU: no double buffering of the tiles (cp.async) yet. */
#include "kernels/cuda/cuda.h"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/q8_unit.cuh"

namespace KV_CUDA_NS {

#define MMQ_WARPS 4               /* warps per block, 16 weight rows each */
#define MMQ_ROWS (16 * MMQ_WARPS) /* weight rows per block */
#define MMQ_K 256                 /* elements per step: 8 blocks of 32 */
/* Bytes per tile row: 68 words, so lane (g, t) of a fragment load reads bank 4g + t, no two
 * lanes the same bank. */
#define MMQ_STRIDE (MMQ_K + 16)

/* A word of int8 codes in a shared tile. */
__device__ __forceinline__ uint32_t tile_word(const int8_t *p) {
    return *reinterpret_cast<const uint32_t *>(p);
}

/* y[n][r] = W[r] . x[n] for the block's MMQ_ROWS rows and NT tokens (see the file's opening). */
template <int T, int NT>
__global__ void __launch_bounds__(MMQ_WARPS * 32)
    kernel_mmq(const uint8_t *w, size_t row_bytes, int n_in, int n_out, const int8_t *xq,
               const q8_ds *xd, int n_tok, float *y) {
    constexpr bool kq = is_kquant<T>::value;
    constexpr int NJ = NT / 8;                                 /* mma tiles of 8 tokens */
    __align__(16) __shared__ int8_t ws[MMQ_ROWS * MMQ_STRIDE]; /* weight codes [row][k] */
    __align__(16) __shared__ int8_t xs[NT * MMQ_STRIDE];       /* activation codes [token][k] */
    __shared__ float wd[MMQ_ROWS][MMQ_K / 32];   /* per row and block: d (K-quants: [0] only) */
    __shared__ float wm[MMQ_ROWS][MMQ_K / 32];   /* and the min (K-quants: dmin, [0] only) */
    __shared__ int8_t wsc[MMQ_ROWS][MMQ_K / 16]; /* K-quants: per 16 elements, sub-block scale */
    __shared__ int8_t wmn[MMQ_ROWS][MMQ_K / 16]; /* and Q4_K's, Q5_K's sub-block min */
    __shared__ q8_ds xds[NT][MMQ_K / 32];        /* the activations' q8_ds per token and block */

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane / 4, t = lane % 4;
    const int row0 = blockIdx.x * MMQ_ROWS, tok0 = blockIdx.y * NT;
    const int units = n_in / 32;
    float acc[4 * NJ]; /* [j][i]: mma tile j's c[i] */
    KV_UNROLL
    for (int q = 0; q < 4 * NJ; q++) acc[q] = 0.0f;

    for (int k0 = 0; k0 < n_in; k0 += MMQ_K) {
        const int u0 = k0 / 32, nu = units - u0 < MMQ_K / 32 ? units - u0 : MMQ_K / 32;
        /* the weight units: consecutive threads take one row's units in turn */
        for (int i = tid; i < MMQ_ROWS * (MMQ_K / 32); i += MMQ_WARPS * 32) {
            const int r = i / (MMQ_K / 32), p = i % (MMQ_K / 32);
            if (p >= nu) continue;
            const int row = row0 + r < n_out ? row0 + r : n_out - 1;
            wunit wu;
            unit_load<T>(w + (size_t)row * row_bytes, u0 + p, wu);
            KV_UNROLL
            for (int h = 0; h < 2; h++) {
                const int e = wu.e[h] - k0;
                uint4 *dst = reinterpret_cast<uint4 *>(ws + r * MMQ_STRIDE + e);
                *dst = make_uint4(wu.w[4 * h], wu.w[4 * h + 1], wu.w[4 * h + 2], wu.w[4 * h + 3]);
                if (kq) {
                    wsc[r][e / 16] = (int8_t)wu.sc[h];
                    if (T != TENSOR_TYPE_Q6_K) wmn[r][e / 16] = (int8_t)wu.mn[h];
                }
            }
            if (!kq || p == 0) {
                wd[r][p] = wu.d;
                if (T == TENSOR_TYPE_Q4_1 || T == TENSOR_TYPE_Q5_1 || T == TENSOR_TYPE_Q4_K ||
                    T == TENSOR_TYPE_Q5_K)
                    wm[r][p] = wu.m;
            }
        }
        /* the activations: 16-byte pieces of each token's step, and its blocks' q8_ds */
        for (int i = tid; i < NT * (MMQ_K / 16); i += MMQ_WARPS * 32) {
            const int n = i / (MMQ_K / 16), c = i % (MMQ_K / 16);
            if (c >= 2 * nu) continue;
            const int tok = tok0 + n < n_tok ? tok0 + n : n_tok - 1;
            *reinterpret_cast<uint4 *>(xs + n * MMQ_STRIDE + 16 * c) =
                *reinterpret_cast<const uint4 *>(xq + (size_t)tok * n_in + k0 + 16 * c);
        }
        for (int i = tid; i < NT * (MMQ_K / 32); i += MMQ_WARPS * 32) {
            const int n = i / (MMQ_K / 32), p = i % (MMQ_K / 32);
            const int tok = tok0 + n < n_tok ? tok0 + n : n_tok - 1;
            if (p < nu) xds[n][p] = xd[(size_t)tok * units + u0 + p];
        }
        __syncthreads();

        /* the warp's rows rr[0] (g) and rr[1] (g + 8) against every token, block by block */
        const int rr[2] = {16 * warp + g, 16 * warp + g + 8};
        float part[4 * NJ]; /* the step's sums, as acc */
        KV_UNROLL
        for (int q = 0; q < 4 * NJ; q++) part[q] = 0.0f;
        for (int p = 0; p < nu; p++) {
            const int8_t *wa = ws + 32 * p + 4 * t;
            const uint32_t a[4] = {
                tile_word(wa + rr[0] * MMQ_STRIDE), tile_word(wa + rr[1] * MMQ_STRIDE),
                tile_word(wa + rr[0] * MMQ_STRIDE + 16), tile_word(wa + rr[1] * MMQ_STRIDE + 16)};
            float d[2], m[2] = {0.0f, 0.0f};
            int sc[2][2] = {{1, 1}, {1, 1}}, mn[2] = {0, 0};
            KV_UNROLL
            for (int h = 0; h < 2; h++) {
                d[h] = wd[rr[h]][kq ? 0 : p];
                if (T == TENSOR_TYPE_Q4_1 || T == TENSOR_TYPE_Q5_1 || T == TENSOR_TYPE_Q4_K ||
                    T == TENSOR_TYPE_Q5_K)
                    m[h] = wm[rr[h]][kq ? 0 : p];
                if (kq) {
                    sc[h][0] = wsc[rr[h]][2 * p];
                    sc[h][1] = wsc[rr[h]][2 * p + 1];
                }
                if (T == TENSOR_TYPE_Q4_K || T == TENSOR_TYPE_Q5_K) mn[h] = wmn[rr[h]][2 * p];
            }
            KV_UNROLL
            for (int j = 0; j < NJ; j++) {
                const int8_t *xb = xs + (8 * j + g) * MMQ_STRIDE + 32 * p + 4 * t;
                const uint32_t b[2] = {tile_word(xb), tile_word(xb + 16)};
                int s[4];
                if (T == TENSOR_TYPE_Q6_K) {
                    /* the two 16-element sub-blocks' products apart */
                    const uint32_t a0[4] = {a[0], a[1], 0u, 0u}, a1[4] = {0u, 0u, a[2], a[3]};
                    int c0[4] = {0, 0, 0, 0}, c1[4] = {0, 0, 0, 0};
                    mma_s8_16x8x32(c0, a0, b);
                    mma_s8_16x8x32(c1, a1, b);
                    KV_UNROLL
                    for (int i = 0; i < 4; i++) s[i] = sc[i / 2][0] * c0[i] + sc[i / 2][1] * c1[i];
                } else {
                    int c[4] = {0, 0, 0, 0};
                    mma_s8_16x8x32(c, a, b);
                    KV_UNROLL
                    for (int i = 0; i < 4; i++) s[i] = kq ? sc[i / 2][0] * c[i] : c[i];
                }
                KV_UNROLL
                for (int i = 0; i < 4; i++) {
                    const q8_ds ds = xds[8 * j + 2 * t + (i % 2)][p];
                    const int msum = kq ? mn[i / 2] * ds.sum : ds.sum;
                    part[4 * j + i] += unit_term<T>(d[i / 2], m[i / 2], ds.d, s[i], msum);
                }
            }
        }
        KV_UNROLL
        for (int q = 0; q < 4 * NJ; q++) acc[q] += part[q];
        __syncthreads(); /* the tiles are rewritten by the next step */
    }

    KV_UNROLL
    for (int q = 0; q < 4 * NJ; q++) {
        const int j = q / 4, i = q % 4;
        const int r = row0 + 16 * warp + g + 8 * (i / 2), n = tok0 + 8 * j + 2 * t + (i % 2);
        if (r < n_out && n < n_tok) y[(size_t)n * n_out + r] = acc[q];
    }
}

/* ---------------------------------------------------------------- launch wrappers */

/* 32-token tiles up to 32 tokens (less padding, twice the blocks), 64 from there. */
template <int T>
static void mmq_launch(cudaStream_t s, const weight *w, const int8_t *xq, const q8_ds *xd,
                       int n_tok, float *y) {
    const int n_out = (int)w->n_out;
    const unsigned gx = (unsigned)((n_out + MMQ_ROWS - 1) / MMQ_ROWS);
    const int nt = n_tok <= 32 ? 32 : 64;
    void (*k)(const uint8_t *, size_t, int, int, const int8_t *, const q8_ds *, int, float *) =
        nt == 32 ? kernel_mmq<T, 32> : kernel_mmq<T, 64>;
    KV_LAUNCH(k, dim3(gx, (unsigned)((n_tok + nt - 1) / nt)), dim3(MMQ_WARPS * 32), 0, s,
              static_cast<const uint8_t *>(w->data), w->row_bytes, (int)w->n_in, n_out, xq, xd,
              n_tok, y);
}

int cuda_mmq(cudaStream_t s, const weight *w, const int8_t *xq, const q8_ds *xd, int n_tok,
             float *y) {
    const int group = cuda_q8_group(w->type);
    if (n_tok < 1 || (n_tok + 63) / 64 > 65535 || !group || w->n_in % group != 0 || w->n_out < 1) {
        log_error("cuda mmq: no int8 tile kernel for %d rows of weight type %d", n_tok,
                  (int)w->type);
        return -1;
    }
    q8_type_switch((int)w->type,
                   [&](auto T) { mmq_launch<decltype(T)::value>(s, w, xq, xd, n_tok, y); });
    CUDA_CHECK_LAUNCH("mmq");
    return 0;
}

} // namespace KV_CUDA_NS
