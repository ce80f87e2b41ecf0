/* The int8 matmuls' weight units (mmvq.cu for decode, mmq.cu for prefill): 32 elements of a
 * quantized weight row read from their GGUF blocks (quant.cuh) as signed bytes with what scales
 * them, and a unit's float term from its integer sums, with the CPU scalar reference's float
 * operations in its order (kernels/cpu/quant.c, scalar_dot_row_*). Internal to kernels/cuda/. */
#ifndef KVSERVE_CUDA_Q8_UNIT_CUH
#define KVSERVE_CUDA_Q8_UNIT_CUH

#include <type_traits>

#include "kernels/cuda/quant.cuh"

namespace KV_CUDA_NS {

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

/* The K-quants: sub-block scales (and Q4_K's, Q5_K's mins) per 16-element half. */
template <int T> struct is_kquant {
    static const bool value =
        T == TENSOR_TYPE_Q4_K || T == TENSOR_TYPE_Q5_K || T == TENSOR_TYPE_Q6_K;
};

/* The float term of a unit (or any run of 32-element blocks sharing its scales) against one
 * activation row from its integer sums: s the code dot product (K-quants: already weighted by
 * the sub-block scales), d and m the weight's scale and min (K-quants: d and dmin), dx the
 * activations' scale; `msum` the K-quants' min-weighted activation code sums, or the activation
 * block's code sum for the 32-element types with a min. The CPU scalar reference's operations
 * (quant.c, scalar_dot_row_*) in its order, __fmul_rn: no FMA contraction. */
template <int T>
__device__ __forceinline__ float unit_term(float d, float m, float dx, int s, int msum) {
    const float t = __fmul_rn(__fmul_rn(d, dx), (float)s);
    if (T == TENSOR_TYPE_Q4_K || T == TENSOR_TYPE_Q5_K)
        return __fsub_rn(t, __fmul_rn(__fmul_rn(m, dx), (float)msum));
    if (T == TENSOR_TYPE_Q4_1 || T == TENSOR_TYPE_Q5_1)
        return __fadd_rn(t, __fmul_rn(m, __fmul_rn(dx, (float)msum)));
    return t;
}

/* A unit's term against one activation row: x its 8 code words (the halves at e[0], e[1]), dx
 * the scale and xsum the code sum of the activation block of e[0]. Integer sums are exact. */
template <int T>
__device__ __forceinline__ float unit_dot(const wunit &u, const uint32_t *x, float dx, int xsum) {
    int s0 = 0, s1 = 0;
    KV_UNROLL
    for (int i = 0; i < 4; i++) {
        s0 = __dp4a((int)u.w[i], (int)x[i], s0);
        s1 = __dp4a((int)u.w[4 + i], (int)x[4 + i], s1);
    }
    if (is_kquant<T>::value) {
        const int summ =
            T == TENSOR_TYPE_Q6_K ? 0 : u.mn[0] * byte_sum4(x) + u.mn[1] * byte_sum4(x + 4);
        return unit_term<T>(u.d, u.m, dx, u.sc[0] * s0 + u.sc[1] * s1, summ);
    }
    return unit_term<T>(u.d, u.m, dx, s0 + s1, xsum);
}

/* Calls f(std::integral_constant<int, T>()) for t's type T when t is a quantized weight type
 * (KV_Q8_WEIGHT_TYPES), so that a launch wrapper instantiates its kernel per type once; false
 * for another type. */
template <class F> static bool q8_type_switch(int t, F f) {
    switch (t) {
#define X(T)                                                                                       \
    case T:                                                                                        \
        f(std::integral_constant<int, T>());                                                       \
        return true;
        KV_Q8_WEIGHT_TYPES(X)
#undef X
    }
    return false;
}

} // namespace KV_CUDA_NS

#endif
