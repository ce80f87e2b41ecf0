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
#include "kernels/cuda/quant.cuh"

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

/* ---------------------------------------------------------------- weight units */

/* 4 * N bytes at p as little-endian words; A (2, 4, 8 or 16) the alignment p is known to have.
 * At 2-byte alignment the words are funnel-shifted out of the aligned words around them. */
template <int A, int N> __device__ __forceinline__ void ld_words(const uint8_t *p, uint32_t *w) {
    if (A >= 16 && N % 4 == 0) {
        KV_UNROLL
        for (int i = 0; i < N / 4; i++) {
            const uint4 v = reinterpret_cast<const uint4 *>(p)[i];
            w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
        }
    } else if (A >= 8 && N % 2 == 0) {
        KV_UNROLL
        for (int i = 0; i < N / 2; i++) {
            const uint2 v = reinterpret_cast<const uint2 *>(p)[i];
            w[2 * i] = v.x, w[2 * i + 1] = v.y;
        }
    } else if (A >= 4) {
        KV_UNROLL
        for (int i = 0; i < N; i++) w[i] = reinterpret_cast<const uint32_t *>(p)[i];
    } else {
        /* the aligned words around p, and the last 2 bytes on their own: no byte outside
         * p .. p + 4N - 1 but the 2 before p, which lie in the same block */
        const int off = (int)(reinterpret_cast<uintptr_t>(p) & 3); /* 0 or 2 */
        const uint32_t *a = reinterpret_cast<const uint32_t *>(p - off);
        KV_UNROLL
        for (int i = 0; i < N; i++) {
            const uint32_t hi = i + 1 < N ? a[i + 1] : (uint32_t)ld16(p + 4 * N - 2);
            w[i] = __funnelshift_r(a[i], hi, 8u * (unsigned)off);
        }
    }
}

/* Byte k of each word's 4-bit field at bit `shift` of bits (bit 4k + shift: Q5's bit 4 of
 * elements 4i..4i+3 of a block) moved to bit 4 of byte k: the multiply copies bit k to bit
 * k + 7j without carries, so byte k's bit 0 holds it. */
__device__ __forceinline__ uint32_t q5_bit4(uint32_t bits4) {
    return ((bits4 * 0x00204081u) & 0x01010101u) << 4;
}

/* One thread's share of a weight row: the codes of 32 elements as signed bytes (w[0..3]: the
 * first 16 elements, w[4..7] the second 16), with what scales them. The activations the halves
 * meet start at elements e[0] and e[1] of the row. */
struct wunit {
    uint32_t w[8];
    int e[2];
    float d, m; /* scale and min (32-element types with a min; K-quants: d and dmin) */
    int sc[2];  /* K-quants: the halves' sub-block scales */
    int mn[2];  /* Q4_K, Q5_K: the halves' sub-block mins */
};

/* Unit u (0 .. n_in / 32) of a row of type T (quant.cuh's block layouts). */
template <int T> __device__ __forceinline__ void unit_load(const uint8_t *row, int u, wunit &o) {
    if (T == TENSOR_TYPE_Q8_0) {
        /* half d; int8 qs[32] */
        const uint8_t *b = row + (size_t)u * qtraits<T>::bytes;
        ld_words<2, 8>(b + 2, o.w);
        o.d = h2f(ld16(b));
        o.e[0] = 32 * u, o.e[1] = 32 * u + 16;
    } else if (T == TENSOR_TYPE_Q4_0 || T == TENSOR_TYPE_Q4_1 || T == TENSOR_TYPE_Q5_0 ||
               T == TENSOR_TYPE_Q5_1) {
        /* half d[, m]; [Q5: u32 qh]; nibbles[16]: element j low nibble of qs[j], 16 + j high;
         * codes without a min are offset by 8 (Q4_0) or 16 (Q5_0). The nibbles' alignment:
         * Q5_1's 8, Q4_1's 4, Q4_0's and Q5_0's 2 */
        constexpr bool has_min = T == TENSOR_TYPE_Q4_1 || T == TENSOR_TYPE_Q5_1;
        constexpr bool five = T == TENSOR_TYPE_Q5_0 || T == TENSOR_TYPE_Q5_1;
        const uint8_t *b = row + (size_t)u * qtraits<T>::bytes;
        const uint8_t *qs = b + (has_min ? 4 : 2) + (five ? 4 : 0);
        constexpr int QA = T == TENSOR_TYPE_Q5_1 ? 8 : T == TENSOR_TYPE_Q4_1 ? 4 : 2;
        uint32_t q[4], h = 0;
        ld_words<QA, 4>(qs, q);
        if (five) ld_words<has_min ? 4 : 2, 1>(b + (has_min ? 4 : 2), &h);
        const uint32_t off = five ? (has_min ? 0u : 0x10101010u) : (has_min ? 0u : 0x08080808u);
        KV_UNROLL
        for (int i = 0; i < 4; i++) {
            uint32_t lo = q[i] & 0x0F0F0F0Fu, hi = (q[i] >> 4) & 0x0F0F0F0Fu;
            if (five) {
                lo |= q5_bit4((h >> (4 * i)) & 0xF);
                hi |= q5_bit4((h >> (16 + 4 * i)) & 0xF);
            }
            o.w[i] = __vsubss4(lo, off);
            o.w[4 + i] = __vsubss4(hi, off);
        }
        o.d = h2f(ld16(b));
        o.m = has_min ? h2f(ld16(b + 2)) : 0.0f;
        o.e[0] = 32 * u, o.e[1] = 32 * u + 16;
    } else if (T == TENSOR_TYPE_Q4_K || T == TENSOR_TYPE_Q5_K) {
        /* half d, dmin; scales[12]; [Q5_K: qh[32]]; nibbles[128]: qs[32c + l] holds element
         * 64c + l (low nibble, sub-block 2c) and 64c + 32 + l (high, 2c + 1). Unit k of a
         * super-block: c = k / 2, l = 16 (k % 2) .. + 15: one 16-byte load of each field. */
        constexpr bool five = T == TENSOR_TYPE_Q5_K;
        const uint8_t *b = row + (size_t)(u / 8) * qtraits<T>::bytes;
        const int k = u % 8, c = k / 2, l0 = 16 * (k % 2);
        uint32_t q[4], h[4];
        ld_words<16, 4>(b + (five ? 48 : 16) + 32 * c + l0, q);
        if (five) ld_words<16, 4>(b + 16 + l0, h);
        KV_UNROLL
        for (int i = 0; i < 4; i++) {
            o.w[i] = q[i] & 0x0F0F0F0Fu;
            o.w[4 + i] = (q[i] >> 4) & 0x0F0F0F0Fu;
            if (five) {
                o.w[i] |= ((h[i] >> (2 * c)) & 0x01010101u) << 4;
                o.w[4 + i] |= ((h[i] >> (2 * c + 1)) & 0x01010101u) << 4;
            }
        }
        uint32_t sw[3]; /* the 12 scale bytes in 3 loads, not a byte load per field */
        ld_words<4, 3>(b + 4, sw);
        const auto scale_byte = [&sw](int i) {
            const uint32_t v = i < 4 ? sw[0] : i < 8 ? sw[1] : sw[2]; /* no indexed registers */
            return (int)((v >> (8 * (i & 3))) & 0xFF);
        };
        k4_scale_min_of(scale_byte, 2 * c, &o.sc[0], &o.mn[0]);
        k4_scale_min_of(scale_byte, 2 * c + 1, &o.sc[1], &o.mn[1]);
        const uint32_t dm = *reinterpret_cast<const uint32_t *>(b);
        o.d = h2f((uint16_t)dm);
        o.m = h2f((uint16_t)(dm >> 16));
        o.e[0] = 256 * (u / 8) + 64 * c + l0;
        o.e[1] = o.e[0] + 32;
    } else if (T == TENSOR_TYPE_Q6_K) {
        /* ql[128]; qh[64]; int8 scales[16]; half d (quant.cuh): in half hf, ql[64 hf + 32 j + l]
         * holds the low 4 bits of elements 128 hf + 32 j + l (low nibble) and + 64 (high), and
         * qh[32 hf + l] their 2 high bits at bits 2j and 2j + 4. Unit k: hf = k / 4, j = k / 2
         * % 2, l = 16 (k % 2) .. + 15; codes offset by 32. */
        const uint8_t *b = row + (size_t)(u / 8) * qtraits<T>::bytes;
        const int k = u % 8, hf = k / 4, j = (k / 2) % 2, l0 = 16 * (k % 2);
        uint32_t ql[4], qh[4];
        ld_words<2, 4>(b + 64 * hf + 32 * j + l0, ql);
        ld_words<2, 4>(b + 128 + 32 * hf + l0, qh);
        KV_UNROLL
        for (int i = 0; i < 4; i++) {
            const uint32_t lo = (ql[i] & 0x0F0F0F0Fu) | ((qh[i] >> (2 * j)) & 0x03030303u) << 4;
            const uint32_t hi =
                ((ql[i] >> 4) & 0x0F0F0F0Fu) | ((qh[i] >> (2 * j + 4)) & 0x03030303u) << 4;
            o.w[i] = __vsubss4(lo, 0x20202020u);
            o.w[4 + i] = __vsubss4(hi, 0x20202020u);
        }
        o.e[0] = 256 * (u / 8) + 128 * hf + 32 * j + l0;
        o.e[1] = o.e[0] + 64;
        o.sc[0] = (int8_t)b[192 + o.e[0] % 256 / 16];
        o.sc[1] = (int8_t)b[192 + o.e[1] % 256 / 16];
        o.d = h2f(ld16(b + 208));
    }
}

/* The sum of the 4 signed bytes of each of 4 words. */
__device__ __forceinline__ int byte_sum4(const uint32_t *x) {
    int s = 0;
    KV_UNROLL
    for (int i = 0; i < 4; i++) s = __dp4a((int)x[i], 0x01010101, s);
    return s;
}

/* A unit's term against one activation row: x its 8 code words (the halves at e[0], e[1]), dx
 * the scale and xsum the code sum of the activation block of e[0]. Integer sums are exact; the
 * floats are the CPU scalar reference's (quant.c, scalar_dot_row_*) for the unit's blocks. */
template <int T>
__device__ __forceinline__ float unit_dot(const wunit &u, const uint32_t *x, float dx, int xsum) {
    int s0 = 0, s1 = 0;
    KV_UNROLL
    for (int i = 0; i < 4; i++) {
        s0 = __dp4a((int)u.w[i], (int)x[i], s0);
        s1 = __dp4a((int)u.w[4 + i], (int)x[4 + i], s1);
    }
    if (T == TENSOR_TYPE_Q4_K || T == TENSOR_TYPE_Q5_K || T == TENSOR_TYPE_Q6_K) {
        const int sumi = u.sc[0] * s0 + u.sc[1] * s1;
        const float t = __fmul_rn(__fmul_rn(u.d, dx), (float)sumi);
        if (T == TENSOR_TYPE_Q6_K) return t;
        const int summ = u.mn[0] * byte_sum4(x) + u.mn[1] * byte_sum4(x + 4);
        return __fsub_rn(t, __fmul_rn(__fmul_rn(u.m, dx), (float)summ));
    }
    const float t = __fmul_rn(__fmul_rn(u.d, dx), (float)(s0 + s1));
    if (T == TENSOR_TYPE_Q4_1 || T == TENSOR_TYPE_Q5_1)
        return __fadd_rn(t, __fmul_rn(u.m, __fmul_rn(dx, (float)xsum)));
    return t;
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
    switch ((int)w->type) {
#define X(T)                                                                                       \
    case T:                                                                                        \
        mmvq_launch<T>(s, w, xq, xd, n_tok, y);                                                    \
        break;
        KV_Q8_WEIGHT_TYPES(X)
#undef X
    }
    CUDA_CHECK_LAUNCH("mmvq");
    return 0;
}

} // namespace KV_CUDA_NS
