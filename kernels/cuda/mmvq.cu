/* Decode-sized matmuls on int8 dot products (llama.cpp's mmvq): 1 to MMVQ_MAX_TOKENS activation
 * rows against a weight of a quantized type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K).
 * - kernel_quantize_q8: the activations, once per op, to int8 blocks as the CPU backend's
 *   quantize_row_act makes them (kernels/cpu/quant.c), the same codes and scales bit for bit:
 *   blocks of 32 with an fp16 scale for the 32-element weight types (the CPU's Q8_1), blocks of
 *   256 with an f32 scale for the K-quants (Q8_K). Layout here: codes [n_tok][n_in] int8, and per
 *   32 elements a q8_ds (the block's scale, or its super-block's, and the 32 codes' sum).
 * - kernel_mmvq: the weight read once in its GGUF blocks for every activation row. A thread
 *   takes a unit of 32 elements at a time (a 32-element block; a K-quant super-block is 8 units
 *   of two 16-element halves), loads its codes with the widest loads the block's alignment
 *   allows (16-byte loads for Q4_K and Q5_K), turns them into signed bytes, and multiplies them
 *   with __dp4a against each row's codes. Integer sums are exact; each unit's float term takes
 *   the CPU scalar reference's operations in its order (scale products first, __fmul_rn: no FMA
 *   contraction), the very term of a 32-element block, and for a K-quant its super-block's
 *   products applied to the unit's share of the integer sums. The terms are summed in f32, lane
 *   by lane then across the block: a row differs from the CPU's (a double sum in block order,
 *   or its SIMD tiles' f32 lanes) by rounding order alone, and not at all where every float
 *   operation is exact.
 *   A block of MMVQ_WARPS warps works on one weight row at batch 1 and on two from 2 rows on. */
#include "kernels/cuda/cuda.h"
#include "kernels/cuda/q8_unit.cuh"

namespace KV_CUDA_NS {

#define MMVQ_WARPS 4 /* warps per block */

/* ---------------------------------------------------------------- activations */

/* Quantizes G-element groups (32: fp16 scale; 256: f32 scale) of row blockIdx.y, a warp per
 * group, each lane G / 32 consecutive elements; the CPU's arithmetic (quant.c: q8_block32,
 * scalar_quantize_q8_K): amax with NaN as 0, d = amax / 127 (fp16-rounded and clamped to the
 * largest finite fp16 for G = 32), id = 1 / d, each code round-half-even of x * id clamped to
 * +-127 (a NaN product to -127, as the CPU's max/min order gives). */
template <int G>
__global__ void __launch_bounds__(MMVQ_WARPS * 32)
    kernel_quantize_q8(const float *x, int n_in, int8_t *xq, q8_ds *xd) {
    constexpr int E = G / 32; /* elements per lane */
    const int lane = threadIdx.x & 31;
    const int64_t g = (int64_t)blockIdx.x * MMVQ_WARPS + (threadIdx.x >> 5);
    if (g >= n_in / G) return; /* the whole warp */
    const int64_t e0 = (int64_t)blockIdx.y * n_in + g * G + (int64_t)lane * E;
    float v[E];
    float amax = 0.0f;
    KV_UNROLL
    for (int i = 0; i < E; i++) {
        v[i] = x[e0 + i];
        const float a = fabsf(v[i]);
        amax = a > amax ? a : amax;
    }
    amax = warp_max(amax);
    float d = __fdiv_rn(amax, 127.0f);
    if (G == 32) {
        uint16_t dh = f2h(d);
        if ((dh & 0x7fff) >= 0x7c00) dh = 0x7bff;
        d = h2f(dh);
    }
    const float id = d > 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
    uint32_t packed[(E + 3) / 4] = {0};
    int sum = 0;
    KV_UNROLL
    for (int i = 0; i < E; i++) {
        float f = __fmul_rn(v[i], id);
        f = f > -127.0f ? f : -127.0f;
        f = f < 127.0f ? f : 127.0f;
        const int q = __float2int_rn(f);
        sum += q;
        packed[i / 4] |= (uint32_t)(q & 0xFF) << (8 * (i % 4));
    }
    /* the lanes of each 32 elements (32 / E of them) add their sums */
    for (int o = 1; o < 32 / E; o <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (E == 8)
        *reinterpret_cast<uint2 *>(xq + e0) = make_uint2(packed[0], packed[1]);
    else
        xq[e0] = (int8_t)(packed[0] & 0xFF);
    if (lane % (32 / E) == 0) xd[e0 / 32] = q8_ds{d, sum};
}

/* ---------------------------------------------------------------- the matmul */

/* y[t][row] = W[row] . x[t] for R rows per block and up to NT activation rows (nt of them): the
 * block's threads take the rows' 32-element units in turn, each unit's weight codes loaded once
 * for all nt rows. Sums: per thread, across the warp (warp_sum_scatter), across the warps. */
template <int T, int NT, int R>
__global__ void __launch_bounds__(MMVQ_WARPS * 32)
    kernel_mmvq(const uint8_t *w, size_t row_bytes, int n_in, int n_out, const int8_t *xq,
                const q8_ds *xd, int nt, float *y) {
    __shared__ float part[MMVQ_WARPS][R * NT];
    const int row0 = blockIdx.x * R, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int units = n_in / 32;
    float acc[R * NT];
    KV_UNROLL
    for (int i = 0; i < R * NT; i++) acc[i] = 0.0f;
    for (int u = threadIdx.x; u < units; u += MMVQ_WARPS * 32) {
        wunit wu[R];
        KV_UNROLL
        for (int r = 0; r < R; r++)
            unit_load<T>(w + (size_t)(row0 + (row0 + r < n_out ? r : 0)) * row_bytes, u, wu[r]);
        KV_UNROLL
        for (int t = 0; t < NT; t++) {
            if (t >= nt) break;
            const int8_t *xr = xq + (size_t)t * n_in;
            uint32_t x[8];
            ld_words<16, 4>(reinterpret_cast<const uint8_t *>(xr + wu[0].e[0]), x);
            ld_words<16, 4>(reinterpret_cast<const uint8_t *>(xr + wu[0].e[1]), x + 4);
            const q8_ds ds = xd[(size_t)t * units + wu[0].e[0] / 32];
            KV_UNROLL
            for (int r = 0; r < R; r++) acc[r * NT + t] += unit_dot<T>(wu[r], x, ds.d, ds.sum);
        }
    }
    const float s = warp_sum_scatter<R * NT>(acc, lane);
    const int vi = gemv_value<R * NT>(lane);
    if (lane % (32 / (R * NT)) == 0) part[warp][vi] = s;
    __syncthreads();
    if (threadIdx.x < R * NT) {
        const int r = threadIdx.x / NT, t = threadIdx.x % NT;
        float sum = 0.0f;
        KV_UNROLL
        for (int i = 0; i < MMVQ_WARPS; i++) sum += part[i][threadIdx.x];
        if (row0 + r < n_out && t < nt) y[(size_t)t * n_out + row0 + r] = sum;
    }
}

/* ---------------------------------------------------------------- launch wrappers */

/* The activation groups a weight type's units meet: 256 for the K-quants, else 32; 0 where
 * there is no int8 kernel (F32, F16, BF16). */
static int q8_group(tensor_type t) {
    switch (t) {
    case TENSOR_TYPE_Q4_0:
    case TENSOR_TYPE_Q4_1:
    case TENSOR_TYPE_Q5_0:
    case TENSOR_TYPE_Q5_1:
    case TENSOR_TYPE_Q8_0:
        return 32;
    case TENSOR_TYPE_Q4_K:
    case TENSOR_TYPE_Q5_K:
    case TENSOR_TYPE_Q6_K:
        return 256;
    default:
        return 0;
    }
}

int cuda_q8_group(tensor_type t) { return q8_group(t); }

int cuda_quantize_q8(cudaStream_t s, int group, const float *x, int n_tok, int64_t n_in, int8_t *xq,
                     q8_ds *xd) {
    if ((group != 32 && group != 256) || n_in % group != 0) {
        log_error("cuda quantize: rows of %lld in groups of %d", (long long)n_in, group);
        return -1;
    }
    const dim3 grid((unsigned)((n_in / group + MMVQ_WARPS - 1) / MMVQ_WARPS), (unsigned)n_tok);
    if (group == 32)
        KV_LAUNCH(kernel_quantize_q8<32>, grid, dim3(MMVQ_WARPS * 32), 0, s, x, (int)n_in, xq, xd);
    else
        KV_LAUNCH(kernel_quantize_q8<256>, grid, dim3(MMVQ_WARPS * 32), 0, s, x, (int)n_in, xq, xd);
    CUDA_CHECK_LAUNCH("quantize_q8");
    return 0;
}

/* One row per block for one activation row (a step keeps n_out blocks' loads in flight), two
 * from 2 rows on (each unit's activations then serve two weight rows). */
template <int T, int NT>
static void mmvq_launch_nt(cudaStream_t s, const weight *w, const int8_t *xq, const q8_ds *xd,
                           int n_tok, float *y) {
    constexpr int R = NT == 1 ? 1 : 2;
    const int n_out = (int)w->n_out;
    void (*k)(const uint8_t *, size_t, int, int, const int8_t *, const q8_ds *, int, float *) =
        kernel_mmvq<T, NT, R>;
    KV_LAUNCH(k, dim3((unsigned)((n_out + R - 1) / R)), dim3(MMVQ_WARPS * 32), 0, s,
              static_cast<const uint8_t *>(w->data), w->row_bytes, (int)w->n_in, n_out, xq, xd,
              n_tok, y);
}

template <int T>
static void mmvq_launch(cudaStream_t s, const weight *w, const int8_t *xq, const q8_ds *xd,
                        int n_tok, float *y) {
    if (n_tok == 1)
        mmvq_launch_nt<T, 1>(s, w, xq, xd, n_tok, y);
    else if (n_tok == 2)
        mmvq_launch_nt<T, 2>(s, w, xq, xd, n_tok, y);
    else if (n_tok <= 4)
        mmvq_launch_nt<T, 4>(s, w, xq, xd, n_tok, y);
    else
        mmvq_launch_nt<T, MMVQ_MAX_TOKENS>(s, w, xq, xd, n_tok, y);
}

int cuda_mmvq(cudaStream_t s, const weight *w, const int8_t *xq, const q8_ds *xd, int n_tok,
              float *y) {
    if (n_tok < 1 || n_tok > MMVQ_MAX_TOKENS || !q8_group(w->type) || w->n_in % 32 != 0) {
        log_error("cuda mmvq: no int8 kernel for %d rows of weight type %d", n_tok, (int)w->type);
        return -1;
    }
    q8_type_switch((int)w->type,
                   [&](auto T) { mmvq_launch<decltype(T)::value>(s, w, xq, xd, n_tok, y); });
    CUDA_CHECK_LAUNCH("mmvq");
    return 0;
}

} // namespace KV_CUDA_NS
