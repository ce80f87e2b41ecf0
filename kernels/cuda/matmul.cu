/* Matmul kernels of the CUDA backend, per weight type (quant.cuh); quantized weights' decode-sized
 * matmuls take the int8 kernels of mmvq.cu instead, but at MATMUL_PRECISION_F32:
 * - kernel_gemv: f32 decode-sized matmuls (2 to GEMV_MAX_TOKENS rows, cuda.h) read each weight
 *   row once from its GGUF blocks and multiply it with up to GEMV_TOKENS f32 activation rows: a
 *   warp per 1-2 output rows, lanes over 8-element groups, one scattering warp reduction for all
 *   its sums. Bandwidth-bound, as decode is.
 * - kernel_gemv1: one row (decode at batch 1): a block per output row, its GEMV_WARPS warps over
 *   the row's groups, so that a step keeps n_out x GEMV_WARPS warps' loads in flight.
 * - kernel_dequant: prefill's weight rows dequantized to f16 (f32 for F32/BF16 weights) tiles that
 *   cuBLAS multiplies on tensor cores (backend_cuda.cu), with the activations converted once by
 *   kernel_to_f16.
 * - kernel_embed: rows of a weight by token id (the embedding lookup), the CPU's values bit for
 *   bit. */
#include <type_traits>

#include "kernels/cuda/cuda.h"
#include "kernels/cuda/quant.cuh"

namespace KV_CUDA_NS {

#define GEMV_TOKENS 8 /* activation rows per warp pass */
#define GEMV_WARPS 4  /* warps per block */

/* Calls launch(std::integral_constant<int, T>) for weight w's type T; -1 with a log line naming
 * what (op) when there is no kernel for it. */
template <typename F> static int by_weight_type(const weight *w, const char *op, F &&launch) {
    switch ((int)w->type) {
#define X(T)                                                                                       \
    case T:                                                                                        \
        launch(std::integral_constant<int, T>{});                                                  \
        return 0;
        KV_WEIGHT_TYPES(X)
#undef X
    default:
        log_error("cuda %s: no kernel for weight type %d", op, (int)w->type);
        return -1;
    }
}

/* A warp computes R weight rows against NT activation rows; lanes take 8-element groups of the
 * rows in turn. y[t][row] for the block's rows, tokens t0 + t. */
template <int T, int NT, int R>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
    kernel_gemv(const uint8_t *w, size_t row_bytes, int n_in, int n_out, const float *x, int n_tok,
                float *y) {
    const int lane = threadIdx.x & 31;
    const int row0 = (blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5)) * R;
    const int t0 = blockIdx.y * NT;
    if (row0 >= n_out) return; /* the whole warp: no barrier follows that it would miss */
    const int nt = n_tok - t0 < NT ? n_tok - t0 : NT;
    const float *xr = x + (size_t)t0 * n_in;
    float acc[R * NT];
    KV_UNROLL
    for (int i = 0; i < R * NT; i++) acc[i] = 0.0f;
    for (int u = lane; u < n_in / 8; u += 32) {
        KV_UNROLL
        for (int r = 0; r < R; r++) {
            if (row0 + r >= n_out) break;
            float v[8];
            dq8<T>(w + (size_t)(row0 + r) * row_bytes, u, v);
            KV_UNROLL
            for (int t = 0; t < NT; t++) {
                if (t >= nt) break;
                const float4 *xp = reinterpret_cast<const float4 *>(xr + (size_t)t * n_in + 8 * u);
                const float4 a = xp[0], b = xp[1];
                acc[r * NT + t] += v[0] * a.x + v[1] * a.y + v[2] * a.z + v[3] * a.w + v[4] * b.x +
                                   v[5] * b.y + v[6] * b.z + v[7] * b.w;
            }
        }
    }
    const float s = warp_sum_scatter<R * NT>(acc, lane);
    const int vi = gemv_value<R * NT>(lane), r = vi / NT, t = vi % NT;
    if (lane % (32 / (R * NT)) == 0 && row0 + r < n_out && t < nt)
        y[(size_t)(t0 + t) * n_out + row0 + r] = s;
}

/* y[row] = W[row] . x for one activation row x: the block's threads take the row's 8-element
 * groups in turn, and the warps' sums meet in shared memory. (Four rows per warp, as kernel_gemv
 * would take them, left 96% of an H200's bandwidth unused at batch 1: too few loads in flight.) */
template <int T>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
    kernel_gemv1(const uint8_t *w, size_t row_bytes, int n_in, const float *x, float *y) {
    __shared__ float part[GEMV_WARPS];
    const uint8_t *wr = w + (size_t)blockIdx.x * row_bytes;
    float acc = 0.0f;
    for (int u = threadIdx.x; u < n_in / 8; u += GEMV_WARPS * 32) {
        float v[8];
        dq8<T>(wr, u, v);
        const float4 *xp = reinterpret_cast<const float4 *>(x + 8 * u);
        const float4 a = xp[0], b = xp[1];
        acc += v[0] * a.x + v[1] * a.y + v[2] * a.z + v[3] * a.w + v[4] * b.x + v[5] * b.y +
               v[6] * b.z + v[7] * b.w;
    }
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        float s = 0.0f;
        KV_UNROLL
        for (int i = 0; i < GEMV_WARPS; i++) s += part[i];
        y[blockIdx.x] = s;
    }
}

/* out[r][i] = W[r0 + r][i] as f16 (or f32): one thread per 8 elements. */
template <int T, typename O>
__global__ void kernel_dequant(const uint8_t *w, size_t row_bytes, int n_in, int64_t r0,
                               int64_t rows, O *out) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t upr = n_in / 8;
    if (i >= rows * upr) return;
    const int64_t r = i / upr, u = i % upr;
    float v[8];
    dq8<T>(w + (size_t)(r0 + r) * row_bytes, u, v);
    /* one 16-byte store per 8 halves (two per 8 floats): element stores would write each 16-byte
     * group in 8 pieces, which made dequantizing slower than the GEMM it feeds */
    O *o = out + r * n_in + 8 * u; /* 16-byte aligned: n_in % 8 == 0 */
    if (sizeof(O) == 2) {
        uint32_t p[4];
        KV_UNROLL
        for (int j = 0; j < 4; j++)
            p[j] = (uint32_t)f2h(v[2 * j]) | ((uint32_t)f2h(v[2 * j + 1]) << 16);
        *reinterpret_cast<uint4 *>(o) = make_uint4(p[0], p[1], p[2], p[3]);
    } else {
        float4 *o4 = reinterpret_cast<float4 *>(o);
        o4[0] = make_float4(v[0], v[1], v[2], v[3]);
        o4[1] = make_float4(v[4], v[5], v[6], v[7]);
    }
}

template <int T>
__global__ void kernel_embed(const uint8_t *w, size_t row_bytes, int n_in, const int32_t *ids,
                             int n, float *out) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t upr = n_in / 8;
    if (i >= (int64_t)n * upr) return;
    const int64_t t = i / upr, u = i % upr;
    float v[8];
    dq8<T>(w + (size_t)ids[t] * row_bytes, u, v);
    for (int j = 0; j < 8; j++) out[t * n_in + 8 * u + j] = v[j];
}

__global__ void kernel_to_f16(const float *x, uint16_t *y, int64_t n) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = f2h(x[i]);
}

/* ---------------------------------------------------------------- launch wrappers */

/* Rows per warp: 2 for up to 4 tokens, 1 for up to 8 (8 sums per warp at most). */
template <int T, int NT, int R>
static void gemv_launch_nt(cudaStream_t s, const weight *w, const float *x, int n_tok, float *y) {
    const int n_out = (int)w->n_out;
    const int rows_per_block = GEMV_WARPS * R;
    dim3 grid((n_out + rows_per_block - 1) / rows_per_block, (n_tok + NT - 1) / NT);
    void (*k)(const uint8_t *, size_t, int, int, const float *, int, float *) =
        kernel_gemv<T, NT, R>;
    KV_LAUNCH(k, grid, dim3(GEMV_WARPS * 32), 0, s, static_cast<const uint8_t *>(w->data),
              w->row_bytes, (int)w->n_in, n_out, x, n_tok, y);
}

template <int T>
static void gemv_launch(cudaStream_t s, const weight *w, const float *x, int n_tok, float *y) {
    if (n_tok == 1) {
        KV_LAUNCH(kernel_gemv1<T>, dim3((unsigned)w->n_out), dim3(GEMV_WARPS * 32), 0, s,
                  static_cast<const uint8_t *>(w->data), w->row_bytes, (int)w->n_in, x, y);
    } else if (n_tok <= 4)
        gemv_launch_nt<T, 4, 2>(s, w, x, n_tok, y);
    else
        gemv_launch_nt<T, GEMV_TOKENS, 1>(s, w, x, n_tok, y);
}

int cuda_gemv(cudaStream_t s, const weight *w, const float *x, int n_tok, float *y) {
    if (by_weight_type(w, "matmul",
                       [&](auto t) { gemv_launch<decltype(t)::value>(s, w, x, n_tok, y); }))
        return -1;
    CUDA_CHECK_LAUNCH("gemv");
    return 0;
}

template <int T>
static void dequant_launch(cudaStream_t s, const weight *w, int64_t r0, int64_t rows, void *out,
                           bool f32) {
    const uint8_t *wd = static_cast<const uint8_t *>(w->data);
    const int64_t units = rows * (w->n_in / 8);
    dim3 grid((unsigned)((units + 255) / 256)), block(256);
    if (f32) {
        void (*k)(const uint8_t *, size_t, int, int64_t, int64_t, float *) =
            kernel_dequant<T, float>;
        KV_LAUNCH(k, grid, block, 0, s, wd, w->row_bytes, (int)w->n_in, r0, rows,
                  static_cast<float *>(out));
    } else {
        void (*k)(const uint8_t *, size_t, int, int64_t, int64_t, uint16_t *) =
            kernel_dequant<T, uint16_t>;
        KV_LAUNCH(k, grid, block, 0, s, wd, w->row_bytes, (int)w->n_in, r0, rows,
                  static_cast<uint16_t *>(out));
    }
}

int cuda_dequant(cudaStream_t s, const weight *w, int64_t r0, int64_t rows, void *out, bool f32) {
    if (by_weight_type(w, "matmul", [&](auto t) {
            dequant_launch<decltype(t)::value>(s, w, r0, rows, out, f32);
        }))
        return -1;
    CUDA_CHECK_LAUNCH("dequant");
    return 0;
}

int cuda_to_f16(cudaStream_t s, const float *x, uint16_t *y, int64_t n) {
    KV_LAUNCH(kernel_to_f16, dim3((unsigned)((n + 255) / 256)), dim3(256), 0, s, x, y, n);
    CUDA_CHECK_LAUNCH("to_f16");
    return 0;
}

template <int T>
static void embed_launch(cudaStream_t s, const weight *w, const int32_t *ids, int n, float *out) {
    const int64_t units = (int64_t)n * (w->n_in / 8);
    void (*k)(const uint8_t *, size_t, int, const int32_t *, int, float *) = kernel_embed<T>;
    KV_LAUNCH(k, dim3((unsigned)((units + 255) / 256)), dim3(256), 0, s,
              static_cast<const uint8_t *>(w->data), w->row_bytes, (int)w->n_in, ids, n, out);
}

int cuda_embed(cudaStream_t s, const weight *w, const int32_t *ids, int n, float *out) {
    if (by_weight_type(w, "embed",
                       [&](auto t) { embed_launch<decltype(t)::value>(s, w, ids, n, out); }))
        return -1;
    CUDA_CHECK_LAUNCH("embed");
    return 0;
}

} // namespace KV_CUDA_NS
