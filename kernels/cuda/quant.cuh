/* GGML's weight formats on the device: dq8<T>(row, u, v) dequantizes elements 8u .. 8u + 7 of a
 * row of type T (a tensor_type) into v, with the CPU's float operations in the CPU's order
 * (kernels/cpu/quant.c, as GGML's dequantize_row_*): __fmul_rn / __fadd_rn keep nvcc from
 * fusing them into FMAs, so a dequantized weight is the CPU's bit for bit. Block layouts as in
 * ggml-common.h (kernels/quant_traits.c gives their sizes). Fields are read with the widest load
 * their alignment allows (qtraits<T>::align): a weight's rows start in a cudaMalloc'd copy at
 * multiples of the block size, so a field's alignment is known at compile time. Byte-wise loads
 * cost the GEMV kernels an instruction per byte (on an H200, 19% of the bandwidth at batch 1). */
#ifndef KVSERVE_CUDA_QUANT_CUH
#define KVSERVE_CUDA_QUANT_CUH

#include "kernels/cuda/cuda_rt.h"

namespace KV_CUDA_NS {

/* A little-endian half at a 2-byte aligned address (every block and its fields are). */
__device__ __forceinline__ uint16_t ld16(const uint8_t *p) {
    return *reinterpret_cast<const uint16_t *>(p);
}

/* 8 bytes at an A-byte aligned address (A = 2, 4 or 8), as a little-endian pair of words. */
template <int A> __device__ __forceinline__ uint2 ld8(const uint8_t *p) {
    if (A >= 8) return *reinterpret_cast<const uint2 *>(p);
    if (A >= 4) {
        const uint32_t *q = reinterpret_cast<const uint32_t *>(p);
        return make_uint2(q[0], q[1]);
    }
    const uint16_t *q = reinterpret_cast<const uint16_t *>(p);
    return make_uint2((uint32_t)q[0] | (uint32_t)q[1] << 16, (uint32_t)q[2] | (uint32_t)q[3] << 16);
}

/* Byte j (0..7) of ld8's pair. */
__device__ __forceinline__ int byte8(uint2 w, int j) {
    return (int)(((j < 4 ? w.x : w.y) >> (8 * (j & 3))) & 0xFF);
}

/* GGML's get_scale_min_k4: the 6-bit scale and min of sub-block j of a Q4_K / Q5_K block, from
 * its 12 scale bytes as q(i) gives them. */
template <class B> __device__ __forceinline__ void k4_scale_min_of(B q, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = q(j) & 63;
        *m = q(j + 4) & 63;
    } else {
        *sc = (q(j + 4) & 0xF) | ((q(j - 4) >> 6) << 4);
        *m = (q(j + 4) >> 4) | ((q(j) >> 6) << 4);
    }
}

/* The same from the bytes at q. */
__device__ __forceinline__ void k4_scale_min(const uint8_t *q, int j, int *sc, int *m) {
    k4_scale_min_of([q](int i) { return (int)q[i]; }, j, sc, m);
}

/* Block bytes and elements per block of each weight type; align: the alignment every block
 * start has (the block size's largest power-of-two factor, up to 16). */
template <int T> struct qtraits;
template <> struct qtraits<TENSOR_TYPE_F32> { static const int bytes = 4, elems = 1, align = 4; };
template <> struct qtraits<TENSOR_TYPE_F16> { static const int bytes = 2, elems = 1, align = 2; };
template <> struct qtraits<TENSOR_TYPE_BF16> { static const int bytes = 2, elems = 1, align = 2; };
template <> struct qtraits<TENSOR_TYPE_Q4_0> {
    static const int bytes = 18, elems = 32, align = 2;
};
template <> struct qtraits<TENSOR_TYPE_Q4_1> {
    static const int bytes = 20, elems = 32, align = 4;
};
template <> struct qtraits<TENSOR_TYPE_Q5_0> {
    static const int bytes = 22, elems = 32, align = 2;
};
template <> struct qtraits<TENSOR_TYPE_Q5_1> {
    static const int bytes = 24, elems = 32, align = 8;
};
template <> struct qtraits<TENSOR_TYPE_Q8_0> {
    static const int bytes = 34, elems = 32, align = 2;
};
template <> struct qtraits<TENSOR_TYPE_Q4_K> {
    static const int bytes = 144, elems = 256, align = 16;
};
template <> struct qtraits<TENSOR_TYPE_Q5_K> {
    static const int bytes = 176, elems = 256, align = 16;
};
template <> struct qtraits<TENSOR_TYPE_Q6_K> {
    static const int bytes = 210, elems = 256, align = 2;
};

/* Elements 8u .. 8u + 7 of a row. F32, F16 and BF16 groups are 16-byte aligned: rows are
 * n_in % 8 == 0 elements wide (checked where the ops start). */
template <int T> __device__ __forceinline__ void dq8(const uint8_t *row, int64_t u, float v[8]) {
    if (T == TENSOR_TYPE_F32) {
        const float4 *r = reinterpret_cast<const float4 *>(row) + 2 * u;
        const float4 a = r[0], b = r[1];
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z,
        v[7] = b.w;
    } else if (T == TENSOR_TYPE_F16 || T == TENSOR_TYPE_BF16) {
        const uint4 r = reinterpret_cast<const uint4 *>(row)[u];
        const uint32_t w[4] = {r.x, r.y, r.z, r.w};
        for (int j = 0; j < 8; j++) {
            const uint16_t h = (uint16_t)(w[j / 2] >> (16 * (j & 1)));
            v[j] = T == TENSOR_TYPE_F16 ? h2f(h) : bf2f(h);
        }
    } else if (T == TENSOR_TYPE_Q4_0 || T == TENSOR_TYPE_Q4_1) {
        /* half d[, m]; nibbles[16]: element j low nibble of qs[j], element 16 + j high */
        const bool has_min = T == TENSOR_TYPE_Q4_1;
        const uint8_t *b = row + (u >> 2) * qtraits<T>::bytes;
        const int g = (int)(u & 3), shift = g < 2 ? 0 : 4;
        const uint2 qs = ld8<qtraits<T>::align>(b + (has_min ? 4 : 2) + 8 * (g & 1));
        const float d = h2f(ld16(b));
        const float m = has_min ? h2f(ld16(b + 2)) : 0.0f;
        for (int j = 0; j < 8; j++) {
            int q = (byte8(qs, j) >> shift) & 0xF;
            v[j] = has_min ? __fadd_rn(__fmul_rn(d, (float)q), m) : __fmul_rn(d, (float)(q - 8));
        }
    } else if (T == TENSOR_TYPE_Q5_0 || T == TENSOR_TYPE_Q5_1) {
        /* half d[, m]; qh u32 (bit e = bit 4 of element e); nibbles[16] as Q4 (Q5_1's qh is
         * 4-byte aligned and its nibbles 8-byte; Q5_0's are 2-byte) */
        const bool has_min = T == TENSOR_TYPE_Q5_1;
        const uint8_t *b = row + (u >> 2) * qtraits<T>::bytes;
        const int g = (int)(u & 3), shift = g < 2 ? 0 : 4;
        const uint8_t *qh = b + (has_min ? 4 : 2);
        const uint2 qs = ld8<(T == TENSOR_TYPE_Q5_1 ? 8 : 2)>(qh + 4 + 8 * (g & 1));
        const uint32_t h = has_min ? *reinterpret_cast<const uint32_t *>(qh)
                                   : (uint32_t)ld16(qh) | (uint32_t)ld16(qh + 2) << 16;
        const float d = h2f(ld16(b));
        const float m = has_min ? h2f(ld16(b + 2)) : 0.0f;
        for (int j = 0; j < 8; j++) {
            int e = 8 * g + j;
            int q = ((byte8(qs, j) >> shift) & 0xF) | (int)((h >> e) & 1) << 4;
            v[j] = has_min ? __fadd_rn(__fmul_rn(d, (float)q), m) : __fmul_rn(d, (float)(q - 16));
        }
    } else if (T == TENSOR_TYPE_Q8_0) {
        const uint8_t *b = row + (u >> 2) * qtraits<T>::bytes;
        const uint2 qs = ld8<2>(b + 2 + 8 * (u & 3));
        const float d = h2f(ld16(b));
        for (int j = 0; j < 8; j++) v[j] = __fmul_rn(d, (float)(int8_t)byte8(qs, j));
    } else if (T == TENSOR_TYPE_Q4_K || T == TENSOR_TYPE_Q5_K) {
        /* half d, dmin; scales[12]; [Q5_K: qh[32]]; nibbles[128]: sub-block s (32 elements)
         * is the low (even s) or high (odd s) nibbles of qs[32 (s / 2) ..]; blocks are 16-byte
         * aligned, a group's nibbles and high bits 8-byte */
        const bool five = T == TENSOR_TYPE_Q5_K;
        const uint8_t *b = row + (u >> 5) * qtraits<T>::bytes;
        const int e0 = (int)(u & 31) * 8, s = e0 / 32, l0 = e0 % 32;
        const uint2 qs = ld8<8>(b + (five ? 48 : 16) + 32 * (s / 2) + l0);
        const uint2 qh = five ? ld8<8>(b + 16 + l0) : make_uint2(0, 0);
        int sc, mn;
        k4_scale_min(b + 4, s, &sc, &mn);
        const uint32_t dm = *reinterpret_cast<const uint32_t *>(b);
        const float d1 = __fmul_rn(h2f((uint16_t)dm), (float)sc);
        const float m1 = __fmul_rn(h2f((uint16_t)(dm >> 16)), (float)mn);
        for (int j = 0; j < 8; j++) {
            int q = (byte8(qs, j) >> (4 * (s & 1))) & 0xF;
            if (five) q |= ((byte8(qh, j) >> s) & 1) << 4;
            v[j] = __fsub_rn(__fmul_rn(d1, (float)q), m1);
        }
    } else if (T == TENSOR_TYPE_Q6_K) {
        /* ql[128]; qh[64]; int8 scales[16]; half d: element e of a half h = e / 128, quarter
         * k = (e % 128) / 32, l = e % 32: low 4 bits from ql[64 h + l + 32 (k & 1)] (low nibble
         * for k < 2), high 2 bits from qh[32 h + l] >> 2k; value d * scale[e / 16] * (q - 32) */
        const uint8_t *b = row + (u >> 5) * qtraits<T>::bytes;
        const int e0 = (int)(u & 31) * 8, h = e0 / 128, k = (e0 % 128) / 32, l0 = e0 % 32;
        const uint2 ql = ld8<2>(b + 64 * h + l0 + 32 * (k & 1)), qh = ld8<2>(b + 128 + 32 * h + l0);
        const float d = h2f(ld16(b + 208));
        const float ds = __fmul_rn(d, (float)(int8_t)b[192 + e0 / 16]);
        for (int j = 0; j < 8; j++) {
            int lo = k < 2 ? (byte8(ql, j) & 0xF) : (byte8(ql, j) >> 4);
            int q = lo | ((byte8(qh, j) >> (2 * k)) & 3) << 4;
            v[j] = __fmul_rn(ds, (float)(q - 32));
        }
    }
}

/* X(T) for every weight type the kernels take; KV_Q8_WEIGHT_TYPES: the quantized ones, which
 * also have int8 dot-product kernels (mmvq.cu). */
#define KV_Q8_WEIGHT_TYPES(X)                                                                      \
    X(TENSOR_TYPE_Q4_0)                                                                            \
    X(TENSOR_TYPE_Q4_1)                                                                            \
    X(TENSOR_TYPE_Q5_0)                                                                            \
    X(TENSOR_TYPE_Q5_1)                                                                            \
    X(TENSOR_TYPE_Q8_0)                                                                            \
    X(TENSOR_TYPE_Q4_K)                                                                            \
    X(TENSOR_TYPE_Q5_K)                                                                            \
    X(TENSOR_TYPE_Q6_K)
#define KV_WEIGHT_TYPES(X)                                                                         \
    X(TENSOR_TYPE_F32)                                                                             \
    X(TENSOR_TYPE_F16)                                                                             \
    X(TENSOR_TYPE_BF16)                                                                            \
    KV_Q8_WEIGHT_TYPES(X)

} // namespace KV_CUDA_NS

#endif
