/* AVX-512 (F/BW/VL/DQ + VNNI) variants of the quantized kernels; compiled with the AVX-512 flags
 * (Makefile) and reached only through the dispatcher in quant.c on CPUs that have them.
 *
 * Dot tiles: one 32-bit lane per block (act32, Q8_1 activations) or per 16-element sub-block
 * (actK, Q8_K activations), see quant_impl.h. Per group of 16 blocks a weight row is transposed
 * into 8 rows of unsigned 8-bit codes (vpermt2d / inserts + a 4x4 transpose inside 128-bit
 * lanes), then for every activation row of the tile vpdpbusd sums each block in its lane and
 * one convert + fma scales all 16 blocks. The unsigned codes are q + offset (Q4_0: q+8 is the
 * nibble itself, Q8_0: q xor 0x80 = q+128); the offset times the activation block's sum
 * initialises the integer accumulator, so every block sum is exact. */
#include <immintrin.h>
#include <string.h>

#include "kernels/cpu/quant_impl.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 16")

static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

static inline uint16_t rd16(const void *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* ---------------------------------------------------------------- conversions */

static void avx512_fp16_to_fp32_row(const uint16_t *src, float *dst, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(src + i))));
    if (i < n) {
        const __mmask16 k = (__mmask16)((1u << (n - i)) - 1);
        _mm512_mask_storeu_ps(dst + i, k, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, src + i)));
    }
}

static void avx512_fp32_to_fp16_row(const float *src, uint16_t *dst, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((void *)(dst + i),
                            _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    if (i < n) {
        const __mmask16 k = (__mmask16)((1u << (n - i)) - 1);
        _mm256_mask_storeu_epi16(
            dst + i, k,
            _mm512_cvtps_ph(_mm512_maskz_loadu_ps(k, src + i), _MM_FROUND_TO_NEAREST_INT));
    }
}

/* ---------------------------------------------------------------- dequantize
 * Same float operation order as the scalar reference (quant.c), so results are identical. Every
 * product that is then added to (d*q + m, d1*q - m1) is exact in float (an fp16 scale, or fp16
 * times a 6-bit sub-scale, times a code below 32), so the FMA contraction the Makefile allows
 * (-ffp-contract=fast) cannot change a result either. */

static void avx512_dequantize_f16(const void *src, float *dst, int64_t n) {
    avx512_fp16_to_fp32_row(src, dst, n);
}

static void avx512_dequantize_bf16(const void *src, float *dst, int64_t n) {
    const uint16_t *s = src;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)(s + i)));
        _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
    }
    if (i < n) {
        const __mmask16 k = (__mmask16)((1u << (n - i)) - 1);
        __m512i v = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, s + i));
        _mm512_mask_storeu_ps(dst + i, k, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
    }
}

/* Elements 0..15 and 16..31 of a 4-bit block as int32 lanes. */
ALWAYS_INLINE void nibbles_epi32(const uint8_t *qs, __m512i *lo, __m512i *hi) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const void *)qs));
    *lo = _mm512_and_si512(v, _mm512_set1_epi32(0xF));
    *hi = _mm512_srli_epi32(v, 4);
}

static void avx512_dequantize_q4_0(const void *src, float *dst, int64_t n) {
    const block_q4_0 *b = src;
    for (int64_t i = 0; i < n / QK32; i++, dst += QK32) {
        const __m512 d = _mm512_set1_ps(_cvtsh_ss(b[i].d));
        const __m512i eight = _mm512_set1_epi32(8);
        __m512i lo, hi;
        nibbles_epi32(b[i].qs, &lo, &hi);
        _mm512_storeu_ps(dst, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(lo, eight))));
        _mm512_storeu_ps(dst + 16,
                         _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(hi, eight))));
    }
}

static void avx512_dequantize_q4_1(const void *src, float *dst, int64_t n) {
    const block_q4_1 *b = src;
    for (int64_t i = 0; i < n / QK32; i++, dst += QK32) {
        const __m512 d = _mm512_set1_ps(_cvtsh_ss(b[i].d)), m = _mm512_set1_ps(_cvtsh_ss(b[i].m));
        __m512i lo, hi;
        nibbles_epi32(b[i].qs, &lo, &hi);
        _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(lo)), m));
        _mm512_storeu_ps(dst + 16, _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(hi)), m));
    }
}

/* Adds bit 4 from the 32 high bits qh to the nibbles of a Q5 block. */
ALWAYS_INLINE void q5_values(const uint8_t *qh, const uint8_t *qs, __m512i *lo, __m512i *hi) {
    uint32_t h;
    memcpy(&h, qh, 4);
    nibbles_epi32(qs, lo, hi);
    const __m512i sixteen = _mm512_set1_epi32(16);
    *lo = _mm512_mask_or_epi32(*lo, (__mmask16)(h & 0xFFFF), *lo, sixteen);
    *hi = _mm512_mask_or_epi32(*hi, (__mmask16)(h >> 16), *hi, sixteen);
}

static void avx512_dequantize_q5_0(const void *src, float *dst, int64_t n) {
    const block_q5_0 *b = src;
    for (int64_t i = 0; i < n / QK32; i++, dst += QK32) {
        const __m512 d = _mm512_set1_ps(_cvtsh_ss(b[i].d));
        const __m512i sixteen = _mm512_set1_epi32(16);
        __m512i lo, hi;
        q5_values(b[i].qh, b[i].qs, &lo, &hi);
        _mm512_storeu_ps(dst, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(lo, sixteen))));
        _mm512_storeu_ps(dst + 16,
                         _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(hi, sixteen))));
    }
}

static void avx512_dequantize_q5_1(const void *src, float *dst, int64_t n) {
    const block_q5_1 *b = src;
    for (int64_t i = 0; i < n / QK32; i++, dst += QK32) {
        const __m512 d = _mm512_set1_ps(_cvtsh_ss(b[i].d)), m = _mm512_set1_ps(_cvtsh_ss(b[i].m));
        __m512i lo, hi;
        q5_values(b[i].qh, b[i].qs, &lo, &hi);
        _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(lo)), m));
        _mm512_storeu_ps(dst + 16, _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(hi)), m));
    }
}

static void avx512_dequantize_q8_0(const void *src, float *dst, int64_t n) {
    const block_q8_0 *b = src;
    for (int64_t i = 0; i < n / QK32; i++, dst += QK32) {
        const __m512 d = _mm512_set1_ps(_cvtsh_ss(b[i].d));
        for (int h = 0; h < 2; h++) {
            __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const void *)(b[i].qs + 16 * h)));
            _mm512_storeu_ps(dst + 16 * h, _mm512_mul_ps(d, _mm512_cvtepi32_ps(v)));
        }
    }
}

/* Q4_K / Q5_K: d1 * q - m1 per sub-block of 32, as the scalar reference. */
ALWAYS_INLINE void dequantize_k45(const uint8_t *scales, const uint8_t *qs, const uint8_t *qh,
                                  float d, float dmin, float *dst) {
    for (int s = 0; s < 8; s++) {
        int sc, m;
        quant_k4_scale_min(scales, s, &sc, &m);
        const __m512 d1 = _mm512_set1_ps(d * (float)sc), m1 = _mm512_set1_ps(dmin * (float)m);
        for (int h = 0; h < 2; h++) {
            __m512i q =
                _mm512_cvtepu8_epi32(_mm_loadu_si128((const void *)(qs + 32 * (s / 2) + 16 * h)));
            q = _mm512_and_si512(_mm512_srli_epi32(q, 4 * (s % 2)), _mm512_set1_epi32(0xF));
            if (qh) {
                __m512i hb = _mm512_cvtepu8_epi32(_mm_loadu_si128((const void *)(qh + 16 * h)));
                hb = _mm512_and_si512(_mm512_srli_epi32(hb, s), _mm512_set1_epi32(1));
                q = _mm512_or_si512(q, _mm512_slli_epi32(hb, 4));
            }
            _mm512_storeu_ps(dst + 32 * s + 16 * h,
                             _mm512_sub_ps(_mm512_mul_ps(d1, _mm512_cvtepi32_ps(q)), m1));
        }
    }
}

static void avx512_dequantize_q4_K(const void *src, float *dst, int64_t n) {
    const block_q4_K *b = src;
    for (int64_t i = 0; i < n / QK_K; i++, dst += QK_K)
        dequantize_k45(b[i].scales, b[i].qs, NULL, _cvtsh_ss(b[i].d), _cvtsh_ss(b[i].dmin), dst);
}

static void avx512_dequantize_q5_K(const void *src, float *dst, int64_t n) {
    const block_q5_K *b = src;
    for (int64_t i = 0; i < n / QK_K; i++, dst += QK_K)
        dequantize_k45(b[i].scales, b[i].qs, b[i].qh, _cvtsh_ss(b[i].d), _cvtsh_ss(b[i].dmin), dst);
}

static void avx512_dequantize_q6_K(const void *src, float *dst, int64_t n) {
    const block_q6_K *b = src;
    for (int64_t i = 0; i < n / QK_K; i++, dst += QK_K) {
        const float d = _cvtsh_ss(b[i].d);
        for (int e = 0; e < QK_K; e += 16) {
            const int h = e / 128, k = (e % 128) / 32, l = e % 32;
            __m512i ql = _mm512_cvtepu8_epi32(
                _mm_loadu_si128((const void *)(b[i].ql + 64 * h + l + 32 * (k & 1))));
            __m512i qh =
                _mm512_cvtepu8_epi32(_mm_loadu_si128((const void *)(b[i].qh + 32 * h + l)));
            ql = _mm512_and_si512(_mm512_srli_epi32(ql, 4 * (k >> 1)), _mm512_set1_epi32(0xF));
            qh = _mm512_and_si512(_mm512_srli_epi32(qh, 2 * k), _mm512_set1_epi32(3));
            __m512i q = _mm512_sub_epi32(_mm512_or_si512(ql, _mm512_slli_epi32(qh, 4)),
                                         _mm512_set1_epi32(32));
            const __m512 ds = _mm512_set1_ps(d * (float)b[i].scales[e / 16]);
            _mm512_storeu_ps(dst + e, _mm512_mul_ps(ds, _mm512_cvtepi32_ps(q)));
        }
    }
}

/* ---------------------------------------------------------------- quantize (activations)
 * The same arithmetic as the scalar reference (quant.c: amax with NaN as 0, d = amax/127, 1/d,
 * clamp, round half to even), so the bytes are identical at every level. */

/* |v| with NaN as 0. */
ALWAYS_INLINE __m512 abs_nonan(__m512 v) {
    const __m512 a = _mm512_castsi512_ps(
        _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7fffffff)));
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), a);
}

/* round(clamp(v * id, -127, 127)) as int32; max/min return the second operand on NaN. */
ALWAYS_INLINE __m512i q8_round16(__m512 v, __m512 id) {
    v = _mm512_max_ps(_mm512_mul_ps(v, id), _mm512_set1_ps(-127.0f));
    v = _mm512_min_ps(v, _mm512_set1_ps(127.0f));
    return _mm512_cvtps_epi32(v); /* MXCSR rounding: nearest even */
}

static void avx512_quantize_q8_1(const float *src, void *dst, int64_t n) {
    const int64_t nb = n / QK32;
    uint8_t *y = dst;
    for (int64_t b0 = 0, g; b0 < nb; b0 += g) {
        g = act32_group_blocks(nb - b0);
        for (int k = 0; k < (int)g; k++) {
            const float *x = src + QK32 * (b0 + k);
            const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(abs_nonan(a), abs_nonan(b)));
            uint16_t dh = (uint16_t)_cvtss_sh(amax / 127.0f, _MM_FROUND_TO_NEAREST_INT);
            if ((dh & 0x7fff) >= 0x7c00) dh = 0x7bff;
            const float d = _cvtsh_ss(dh);
            const __m512 id = _mm512_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
            const __m512i qa = q8_round16(a, id), qb = q8_round16(b, id);
            int8_t q[32];
            _mm_storeu_si128((void *)q, _mm512_cvtsepi32_epi8(qa));
            _mm_storeu_si128((void *)(q + 16), _mm512_cvtsepi32_epi8(qb));
            act32_put_block(y + ACT32_BLOCK_BYTES * b0, (int)g, k, q, dh,
                            _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb)));
        }
    }
}

static void avx512_quantize_q8_K(const float *src, void *dst, int64_t n) {
    uint8_t *y = dst;
    for (int64_t i = 0; i < n / QK_K; i++, src += QK_K, y += ACTK_BLOCK_BYTES) {
        __m512 m = _mm512_setzero_ps();
        for (int e = 0; e < QK_K; e += 16)
            m = _mm512_max_ps(abs_nonan(_mm512_loadu_ps(src + e)), m);
        const float d = _mm512_reduce_max_ps(m) / 127.0f;
        const __m512 id = _mm512_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
        int8_t q[QK_K];
        for (int e = 0; e < QK_K; e += 16)
            _mm_storeu_si128((void *)(q + e),
                             _mm512_cvtsepi32_epi8(q8_round16(_mm512_loadu_ps(src + e), id)));
        actk_put(y, q, d);
    }
}

/* ---------------------------------------------------------------- tile plumbing */

/* Horizontal sums of four vectors, as [sum a, sum b, sum c, sum d]. */
ALWAYS_INLINE __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    /* 512 -> 256 per vector, pairing vectors so that every add works on full registers. */
    const __m512 ab =
        _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    const __m512 cd =
        _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
    /* ab: a.lo a.hi b.lo b.hi (128-bit parts of the 256-bit halves); fold once more. */
    const __m512 abcd =
        _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
    /* abcd: 128-bit lane k holds 4 partial sums of vector k (a, b, c, d). */
    const __m512 s1 = _mm512_add_ps(abcd, _mm512_permute_ps(abcd, 0x4E));
    const __m512 s2 = _mm512_add_ps(s1, _mm512_permute_ps(s1, 0xB1));
    /* Lane 4k holds vector k's sum. */
    return _mm512_castps512_ps128(_mm512_permutexvar_ps(
        _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), s2));
}

/* out[j * os + i] = sum of acc[i][j]. */
ALWAYS_INLINE void tile_store(const int NW, const int NX, __m512 acc[4][4], float *out, size_t os) {
    if (NW == 4) {
        UNROLL for (int j = 0; j < NX; j++) {
            _mm_storeu_ps(out + (size_t)j * os, hsum4(acc[0][j], acc[1][j], acc[2][j], acc[3][j]));
        }
        return;
    }
    UNROLL for (int i = 0; i < NW; i++) {
        UNROLL for (int j = 0; j < NX; j++) out[(size_t)j * os + (size_t)i] =
            _mm512_reduce_add_ps(acc[i][j]);
    }
}

/* ---------------------------------------------------------------- act32 weight loaders */

/* The 32-element weight types, as the act32 tile sees them. */
enum w32_kind { W32_Q4_0, W32_Q4_1, W32_Q5_0, W32_Q5_1, W32_Q8_0 };

ALWAYS_INLINE size_t w32_bytes(int kind) {
    return kind == W32_Q4_0   ? sizeof(block_q4_0)
           : kind == W32_Q4_1 ? sizeof(block_q4_1)
           : kind == W32_Q5_0 ? sizeof(block_q5_0)
           : kind == W32_Q5_1 ? sizeof(block_q5_1)
                              : sizeof(block_q8_0);
}
/* Offset of qs (the low 4 bits, or the int8 values) and of qh inside the block. */
ALWAYS_INLINE int w32_qs_off(int kind) {
    return kind == W32_Q4_0   ? 2
           : kind == W32_Q4_1 ? 4
           : kind == W32_Q5_0 ? 6
           : kind == W32_Q5_1 ? 8
                              : 2;
}
ALWAYS_INLINE int w32_qh_off(int kind) { return kind == W32_Q5_0 ? 2 : 4; }
ALWAYS_INLINE int w32_has_min(int kind) { return kind == W32_Q4_1 || kind == W32_Q5_1; }
/* log2 of the offset the unsigned codes carry (8, 16, 128); 0 for the types with a min. */
ALWAYS_INLINE int w32_offset_shift(int kind) {
    return kind == W32_Q4_0 ? 3 : kind == W32_Q5_0 ? 4 : kind == W32_Q8_0 ? 7 : 0;
}

/* One weight row's group: R rows of unsigned codes in the act32 lane order, and per-lane block
 * scale d and min m (types with a min). */
typedef struct w32_group {
    __m512i q[8];
    __m512 d, m;
} w32_group;

/* 4x4 transpose of 32-bit elements inside each 128-bit lane: r[a] lane L = block 4a+L's four
 * dwords -> u[t] lane L position a = dword t of block 4a+L, i.e. lane p holds block sigma(p). */
ALWAYS_INLINE void transpose4x4_epi32(const __m512i r[4], __m512i u[4]) {
    const __m512i t0 = _mm512_unpacklo_epi32(r[0], r[1]), t1 = _mm512_unpackhi_epi32(r[0], r[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(r[2], r[3]), t3 = _mm512_unpackhi_epi32(r[2], r[3]);
    u[0] = _mm512_unpacklo_epi64(t0, t2);
    u[1] = _mm512_unpackhi_epi64(t0, t2);
    u[2] = _mm512_unpacklo_epi64(t1, t3);
    u[3] = _mm512_unpackhi_epi64(t1, t3);
}

/* Rows t and t+4 of a 4-bit group from the 16 bytes u of each block: low and high nibbles. */
ALWAYS_INLINE void nibble_rows(const __m512i u[4], __m512i q[8]) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    UNROLL for (int t = 0; t < 4; t++) {
        q[t] = _mm512_and_si512(u[t], m4);
        q[t + 4] = _mm512_and_si512(_mm512_srli_epi16(u[t], 4), m4);
    }
}

/* 16 bytes at p + stride*(4a + L) + off into 128-bit lane L of r[a]. */
ALWAYS_INLINE void load_4x4_xmm(const uint8_t *p, size_t stride, int off, __m512i r[4]) {
    UNROLL for (int a = 0; a < 4; a++) {
        const uint8_t *b = p + stride * 4 * (size_t)a + off;
        __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const void *)b));
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const void *)(b + stride)), 1);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const void *)(b + 2 * stride)), 2);
        r[a] = _mm512_inserti32x4(v, _mm_loadu_si128((const void *)(b + 3 * stride)), 3);
    }
}

/* Byte offsets of the 16 blocks in act32 lane order (sigma), times a block size. */
ALWAYS_INLINE __m512i sigma_offsets(int bytes, int add) {
    const __m512i sigma = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_add_epi32(_mm512_mullo_epi32(sigma, _mm512_set1_epi32(bytes)),
                            _mm512_set1_epi32(add));
}

/* d (and m) from fp16 pairs: the low 16 bits of each dword are d, the high 16 bits m. */
ALWAYS_INLINE void split_dm(__m512i dm, __m512 *d, __m512 *m) {
    *d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
    if (m) *m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16)));
}

/* Adds bit 4 of the Q5 codes: row r holds elements 4r..4r+3 of its lane's block, whose bits 4
 * are bits 4r..4r+3 of the block's qh (one dword per lane). */
ALWAYS_INLINE void q5_high_rows(__m512i qh, __m512i q[8]) {
    UNROLL for (int r = 0; r < 8; r++) {
        /* Byte r/2 of each dword to all four of its bytes, then bit 4(r%2) + k of byte k. */
        const __m512i ctrl =
            _mm512_add_epi8(_mm512_set4_epi32(0x0C0C0C0C, 0x08080808, 0x04040404, 0),
                            _mm512_set1_epi8((char)(r / 2)));
        const __m512i bit = _mm512_set1_epi32(r % 2 ? (int)0x80402010 : 0x08040201);
        const __mmask64 k = _mm512_test_epi8_mask(_mm512_shuffle_epi8(qh, ctrl), bit);
        q[r] = _mm512_mask_add_epi8(q[r], k, q[r], _mm512_set1_epi8(16));
    }
}

/* 16 in byte k of each lane where bit 4t + k of the lane's qh is set (t per lane): the multiply
 * copies bit k of the nibble to bits k + 7j without carries, so bit 8k holds bit k. */
ALWAYS_INLINE __m512i q5_high_bytes(__m512i qh, __m512i t) {
    __m512i h4 =
        _mm512_and_si512(_mm512_srlv_epi32(qh, _mm512_slli_epi32(t, 2)), _mm512_set1_epi32(0xF));
    h4 = _mm512_and_si512(_mm512_mullo_epi32(h4, _mm512_set1_epi32(0x00204081)),
                          _mm512_set1_epi32(0x01010101));
    return _mm512_slli_epi32(h4, 4);
}

/* A full group of 16 blocks at p. */
ALWAYS_INLINE void w32_load16(int kind, const uint8_t *p, w32_group *o) {
    __m512i r[4], u[4];
    if (kind == W32_Q4_1) {
        /* 4 blocks = 80 bytes = 20 dwords [dm q0 q1 q2 q3] x 4: two loads and one vpermt2d
         * gather the 16 qs dwords; the dm dwords stay in z[] for the scales. */
        const __m512i idx_qs =
            _mm512_setr_epi32(1, 2, 3, 4, 6, 7, 8, 9, 11, 12, 13, 14, 28, 29, 30, 31);
        __m512i z[4];
        UNROLL for (int a = 0; a < 4; a++) {
            z[a] = _mm512_loadu_si512((const void *)(p + 80 * a));
            const __m512i z2 = _mm512_loadu_si512((const void *)(p + 80 * a + 16));
            r[a] = _mm512_permutex2var_epi32(z[a], idx_qs, z2);
        }
        transpose4x4_epi32(r, u);
        nibble_rows(u, o->q);
        /* Lane p = 4L + a takes dword 5L of unit a. */
        const __m512i i01 = _mm512_setr_epi32(0, 16, 0, 0, 5, 21, 0, 0, 10, 26, 0, 0, 15, 31, 0, 0);
        const __m512i i23 = _mm512_setr_epi32(0, 0, 0, 16, 0, 0, 5, 21, 0, 0, 10, 26, 0, 0, 15, 31);
        const __m512i dm =
            _mm512_mask_blend_epi32(0xCCCC, _mm512_permutex2var_epi32(z[0], i01, z[1]),
                                    _mm512_permutex2var_epi32(z[2], i23, z[3]));
        split_dm(dm, &o->d, &o->m);
        return;
    }
    const size_t bs = w32_bytes(kind);
    if (kind == W32_Q8_0) {
        /* Per unit a: blocks 4a..4a+3, qs halves h -> rows 4h..4h+3. */
        __m512i r1[4];
        UNROLL for (int a = 0; a < 4; a++) {
            const uint8_t *b = p + bs * 4 * (size_t)a + 2;
            __m512i w01 = _mm512_castsi256_si512(_mm256_loadu_si256((const void *)b));
            w01 = _mm512_inserti64x4(w01, _mm256_loadu_si256((const void *)(b + bs)), 1);
            __m512i w23 = _mm512_castsi256_si512(_mm256_loadu_si256((const void *)(b + 2 * bs)));
            w23 = _mm512_inserti64x4(w23, _mm256_loadu_si256((const void *)(b + 3 * bs)), 1);
            r[a] = _mm512_shuffle_i64x2(w01, w23, 0x88);
            r1[a] = _mm512_shuffle_i64x2(w01, w23, 0xDD);
        }
        transpose4x4_epi32(r, o->q);
        transpose4x4_epi32(r1, o->q + 4);
        const __m512i x80 = _mm512_set1_epi8((char)0x80);
        UNROLL for (int t = 0; t < 8; t++) o->q[t] = _mm512_xor_si512(o->q[t], x80);
        split_dm(_mm512_i32gather_epi32(sigma_offsets((int)bs, 0), p, 1), &o->d, NULL);
        return;
    }
    /* Q4_0, Q5_0, Q5_1: 16-byte qs loaded four to a register; scales (and qh) gathered. */
    load_4x4_xmm(p, bs, w32_qs_off(kind), r);
    transpose4x4_epi32(r, u);
    nibble_rows(u, o->q);
    const __m512i dm = _mm512_i32gather_epi32(sigma_offsets((int)bs, 0), p, 1);
    split_dm(dm, &o->d, w32_has_min(kind) ? &o->m : NULL);
    if (kind == W32_Q5_0 || kind == W32_Q5_1)
        q5_high_rows(_mm512_i32gather_epi32(sigma_offsets((int)bs, w32_qh_off(kind)), p, 1), o->q);
}

/* A lane-order group (*_L16, kernels/cpu/quant_impl.h): loads only. */
ALWAYS_INLINE void w32_load16_lanes(int kind, const uint8_t *p, w32_group *o) {
    o->d = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)p));
    if (w32_has_min(kind)) o->m = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(p + 32)));
    const uint8_t *q = p + (w32_has_min(kind) ? 64 : 32);
    if (kind == W32_Q8_0) {
        const __m512i x80 = _mm512_set1_epi8((char)0x80);
        UNROLL for (int r = 0; r < 8; r++) o->q[r] =
            _mm512_xor_si512(_mm512_loadu_si512((const void *)(q + L16_ROW_BYTES * r)), x80);
        return;
    }
    __m512i u[4];
    UNROLL for (int t = 0; t < 4; t++) u[t] =
        _mm512_loadu_si512((const void *)(q + L16_ROW_BYTES * t));
    nibble_rows(u, o->q);
}

/* A remainder group of g < 16 blocks (lane p: block p % g, element dword t = r + R*(p/g)) by
 * gathers, g a constant after inlining. */
ALWAYS_INLINE void w32_gather_tail(int kind, const uint8_t *p, const int g, w32_group *o) {
    const int R = act32_rows(g), lg = g == 8 ? 3 : g == 4 ? 2 : g == 2 ? 1 : 0;
    const int bs = (int)w32_bytes(kind);
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i blk_off =
        _mm512_mullo_epi32(_mm512_and_si512(iota, _mm512_set1_epi32(g - 1)), _mm512_set1_epi32(bs));
    const __m512i hi = _mm512_srli_epi32(iota, lg);
    /* g == 1 has 8 lanes only. */
    const __mmask16 live = g == 1 ? 0x00FF : 0xFFFF;
    const __m512i zero = _mm512_setzero_si512();
    split_dm(_mm512_mask_i32gather_epi32(zero, live, blk_off, p, 1), &o->d,
             w32_has_min(kind) ? &o->m : NULL);
    __m512i qh = zero;
    if (kind == W32_Q5_0 || kind == W32_Q5_1)
        qh = _mm512_mask_i32gather_epi32(
            zero, live, _mm512_add_epi32(blk_off, _mm512_set1_epi32(w32_qh_off(kind))), p, 1);
    UNROLL for (int r = 0; r < R; r++) {
        const __m512i t =
            _mm512_add_epi32(_mm512_set1_epi32(r), _mm512_slli_epi32(hi, lg ? lg - 1 : 0));
        __m512i v;
        if (kind == W32_Q8_0) {
            const __m512i off = _mm512_add_epi32(
                blk_off, _mm512_add_epi32(_mm512_slli_epi32(t, 2), _mm512_set1_epi32(2)));
            v = _mm512_xor_si512(_mm512_mask_i32gather_epi32(zero, live, off, p, 1),
                                 _mm512_set1_epi8((char)0x80));
        } else {
            /* dword t & 3 of qs, high nibbles for t >= 4 */
            const __m512i off = _mm512_add_epi32(
                blk_off,
                _mm512_add_epi32(_mm512_slli_epi32(_mm512_and_si512(t, _mm512_set1_epi32(3)), 2),
                                 _mm512_set1_epi32(w32_qs_off(kind))));
            v = _mm512_mask_i32gather_epi32(zero, live, off, p, 1);
            v = _mm512_srlv_epi32(v, _mm512_slli_epi32(_mm512_srli_epi32(t, 2), 2));
            v = _mm512_and_si512(v, _mm512_set1_epi8(0x0F));
            if (kind == W32_Q5_0 || kind == W32_Q5_1) v = _mm512_or_si512(v, q5_high_bytes(qh, t));
        }
        o->q[r] = v;
    }
    for (int r = R; r < 8; r++) o->q[r] = zero; /* unused; keeps the tile's reads defined */
}

/* A remainder group of 2 blocks (one row: lane p = block p & 1, dword p >> 1), the one
 * SmolLM2's n = 576 ends with: the two blocks are loaded whole and permuted into place. */
ALWAYS_INLINE void w32_permute_tail2(int kind, const uint8_t *p, w32_group *o) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i blk = _mm512_and_si512(lane, _mm512_set1_epi32(1));
    const __m512i t = _mm512_srli_epi32(lane, 1);
    const __m512i t3 = _mm512_and_si512(t, _mm512_set1_epi32(3));
    const __m512i nib_shift = _mm512_slli_epi32(_mm512_srli_epi32(t, 2), 2);
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    if (kind == W32_Q4_1 || kind == W32_Q5_1) {
        /* dword-aligned blocks of 5 / 6 dwords: [dm (qh) qs0..qs3] */
        const int bd = kind == W32_Q4_1 ? 5 : 6, qs0 = kind == W32_Q4_1 ? 1 : 2;
        const __m512i z = _mm512_maskz_loadu_epi32((__mmask16)((1u << (2 * bd)) - 1), p);
        const __m512i base = _mm512_mullo_epi32(blk, _mm512_set1_epi32(bd));
        __m512i v = _mm512_permutexvar_epi32(
            _mm512_add_epi32(base, _mm512_add_epi32(t3, _mm512_set1_epi32(qs0))), z);
        v = _mm512_and_si512(_mm512_srlv_epi32(v, nib_shift), m4);
        split_dm(_mm512_permutexvar_epi32(base, z), &o->d, &o->m);
        if (kind == W32_Q5_1) {
            const __m512i qh =
                _mm512_permutexvar_epi32(_mm512_add_epi32(base, _mm512_set1_epi32(1)), z);
            v = _mm512_or_si512(v, q5_high_bytes(qh, t));
        }
        o->q[0] = v;
        return;
    }
    /* 2-byte aligned blocks: permute 16-bit words. Word 2p + h of the result is word
     * wb*blk + first + 2*dword + h of the loaded blocks. */
    const int wb = (int)w32_bytes(kind) / 2;
    const __m512i word = _mm512_set1_epi32(0x00010000); /* +0, +1 in the two words of a dword */
    /* per-dword index of the first word, repeated in both words of the dword */
    const __m512i base = _mm512_mullo_epi32(blk, _mm512_set1_epi32(wb * 0x10001));
    const __m512i d_idx = base;
    if (kind == W32_Q8_0) {
        const __m512i z0 = _mm512_loadu_si512((const void *)p);
        const __m512i z1 = _mm512_maskz_loadu_epi16(0x3, p + 64);
        const __m512i qi = _mm512_add_epi16(
            _mm512_add_epi16(base, word),
            _mm512_add_epi16(_mm512_set1_epi16(1),
                             _mm512_mullo_epi32(t, _mm512_set1_epi32(2 * 0x10001))));
        o->q[0] =
            _mm512_xor_si512(_mm512_permutex2var_epi16(z0, qi, z1), _mm512_set1_epi8((char)0x80));
        split_dm(_mm512_permutex2var_epi16(z0, d_idx, z1), &o->d, NULL);
        return;
    }
    /* Q4_0 (qs at word 1), Q5_0 (qh at words 1-2, qs at word 3): 36 / 44 bytes */
    const int qs_w = kind == W32_Q4_0 ? 1 : 3;
    const __m512i z = _mm512_maskz_loadu_epi16((__mmask32)((1u << (2 * wb)) - 1), p);
    const __m512i qi =
        _mm512_add_epi16(_mm512_add_epi16(base, word),
                         _mm512_add_epi16(_mm512_set1_epi16((short)qs_w),
                                          _mm512_mullo_epi32(t3, _mm512_set1_epi32(2 * 0x10001))));
    __m512i v = _mm512_permutexvar_epi16(qi, z);
    v = _mm512_and_si512(_mm512_srlv_epi32(v, nib_shift), m4);
    split_dm(_mm512_permutexvar_epi16(d_idx, z), &o->d, NULL);
    if (kind == W32_Q5_0) {
        const __m512i qh = _mm512_permutexvar_epi16(
            _mm512_add_epi16(_mm512_add_epi16(base, word), _mm512_set1_epi16(1)), z);
        v = _mm512_or_si512(v, q5_high_bytes(qh, t));
    }
    o->q[0] = v;
}

/* A remainder group of g = 8, 4 or 2 blocks in lane order (l16_pack_tail): the scales repeat
 * every g lanes; a 4-bit row's lanes 8..15 are lanes 0..7's high nibbles. */
/* g fp16 values at s repeated across 16 lanes, as floats. */
ALWAYS_INLINE __m512 repeat_halves(const uint8_t *s, const int g) {
    if (g == 8)
        return _mm512_cvtph_ps(_mm256_broadcastsi128_si256(_mm_loadu_si128((const void *)s)));
    if (g == 4) {
        int64_t v;
        memcpy(&v, s, 8);
        return _mm512_cvtph_ps(_mm256_set1_epi64x(v));
    }
    int32_t v;
    memcpy(&v, s, 4);
    return _mm512_cvtph_ps(_mm256_set1_epi32(v));
}

ALWAYS_INLINE void w32_load_tail_lanes_g(int kind, const uint8_t *p, const int g, w32_group *o) {
    const int R = act32_rows(g);
    o->d = repeat_halves(p, g);
    if (w32_has_min(kind)) o->m = repeat_halves(p + 2 * g, g);
    const uint8_t *q = p + (w32_has_min(kind) ? 4 : 2) * g;
    const __m512i zero = _mm512_setzero_si512();
    UNROLL for (int r = 0; r < 8; r++) {
        if (r >= R) {
            o->q[r] = zero; /* unused; keeps the tile's reads defined */
            continue;
        }
        if (kind == W32_Q8_0) {
            o->q[r] = _mm512_xor_si512(_mm512_loadu_si512((const void *)(q + 64 * r)),
                                       _mm512_set1_epi8((char)0x80));
            continue;
        }
        const __m256i e = _mm256_loadu_si256((const void *)(q + 32 * r));
        o->q[r] = _mm512_and_si512(
            _mm512_inserti64x4(_mm512_castsi256_si512(e), _mm256_srli_epi16(e, 4), 1),
            _mm512_set1_epi8(0x0F));
    }
}

/* The other remainder groups (8, 4, 1): out of line, they run once per weight row and row tail. */
static void w32_load_tail(int kind, const uint8_t *p, int g, w32_group *o) {
    switch (g) {
    case 8:
        w32_gather_tail(kind, p, 8, o);
        break;
    case 4:
        w32_gather_tail(kind, p, 4, o);
        break;
    default:
        w32_gather_tail(kind, p, 1, o);
        break;
    }
}

/* ---------------------------------------------------------------- act32 tile */

/* The activation side of one group for one activation row. */
typedef struct x32_group {
    const uint8_t *qs; /* R rows of 64 bytes (32 for g == 1) */
    __m512 d;          /* per-lane block scale */
    __m512 s;          /* types with a min: d * sum, lanes p < g (else 0) */
    __m512i c;         /* offset types: -offset * sum, lanes p < g (else 0) */
} x32_group;

ALWAYS_INLINE void x32_prepare(int kind, const uint8_t *grp, int g, x32_group *o) {
    o->qs = grp;
    __m512i sum;
    if (g == 16) {
        o->d = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(grp + 512)));
        sum = _mm512_cvtepi16_epi32(_mm256_loadu_si256((const void *)(grp + 544)));
    } else {
        const __mmask16 k = (__mmask16)((1u << g) - 1);
        const __m512i dup = _mm512_and_si512(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
            _mm512_set1_epi32(g - 1));
        o->d =
            _mm512_permutexvar_ps(dup, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, grp + 32 * g)));
        sum = _mm512_cvtepi16_epi32(_mm256_maskz_loadu_epi16(k, grp + 34 * g));
    }
    if (w32_has_min(kind)) {
        o->s = _mm512_mul_ps(o->d, _mm512_cvtepi32_ps(sum));
        o->c = _mm512_setzero_si512();
    } else {
        o->s = _mm512_setzero_ps();
        o->c = _mm512_sub_epi32(_mm512_setzero_si512(),
                                _mm512_slli_epi32(sum, w32_offset_shift(kind)));
    }
}

ALWAYS_INLINE __m512i x32_row(const x32_group *x, int g, int r) {
    if (g == 1) return _mm512_zextsi256_si512(_mm256_loadu_si256((const void *)x->qs));
    return _mm512_loadu_si512((const void *)(x->qs + 64 * r));
}

/* acc[j] += the group's dot products of one weight row with activation rows j < NX, per lane.
 * The vpdpbusd chains of the NX rows are interleaved (5-cycle latency); with one or two rows,
 * each is split into two chains. */
ALWAYS_INLINE void w32_pairs(int kind, const int NX, const w32_group *w, const x32_group *x, int g,
                             int R, __m512 acc[4]) {
    const int split = NX <= 2 && R == 8;
    __m512i s0[4], s1[4];
    UNROLL for (int j = 0; j < NX; j++) {
        s0[j] = w32_has_min(kind) ? _mm512_setzero_si512() : x[j].c;
        s1[j] = _mm512_setzero_si512();
    }
    UNROLL for (int r = 0; r < 8; r++) {
        if (r >= R) break;
        UNROLL for (int j = 0; j < NX; j++) {
            if (split && (r & 1))
                s1[j] = _mm512_dpbusd_epi32(s1[j], w->q[r], x32_row(&x[j], g, r));
            else
                s0[j] = _mm512_dpbusd_epi32(s0[j], w->q[r], x32_row(&x[j], g, r));
        }
    }
    UNROLL for (int j = 0; j < NX; j++) {
        const __m512i isum = split ? _mm512_add_epi32(s0[j], s1[j]) : s0[j];
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(w->d, x[j].d), acc[j]);
        if (w32_has_min(kind)) acc[j] = _mm512_fmadd_ps(w->m, x[j].s, acc[j]);
    }
}

/* A remainder group of g = 8, 4 or 2 blocks in lane order, for NW weight rows and NX activation
 * rows. */
ALWAYS_INLINE void w32_tail_lanes_step(int kind, const int NW, const int NX, const int g,
                                       const uint8_t *w, size_t ws, const uint8_t *x, size_t xs,
                                       int64_t b0, __m512 acc[4][4]) {
    x32_group xg[4];
    UNROLL for (int j = 0; j < NX; j++)
        x32_prepare(kind, x + (size_t)j * xs + ACT32_BLOCK_BYTES * (size_t)b0, g, &xg[j]);
    UNROLL for (int i = 0; i < NW; i++) {
        w32_group wg;
        w32_load_tail_lanes_g(kind, w + (size_t)i * ws + w32_bytes(kind) * (size_t)b0, g, &wg);
        w32_pairs(kind, NX, &wg, xg, g, act32_rows(g), acc[i]);
    }
}

/* lanes: the row's groups of 2 blocks or more are in lane order (*_L16); a last single block is
 * GGUF's. */
ALWAYS_INLINE void tile_w32_rows(int kind, const int lanes, const int NW, const int NX, int64_t n,
                                 const uint8_t *w, size_t ws, const uint8_t *x, size_t xs,
                                 float *out, size_t os) {
    __m512 acc[4][4];
    UNROLL for (int i = 0; i < NW; i++) UNROLL for (int j = 0; j < NX; j++) acc[i][j] =
        _mm512_setzero_ps();
    const int64_t nb = n / QK32;
    const size_t bs = w32_bytes(kind);
    int64_t b0 = 0;
    for (; nb - b0 >= 16; b0 += 16) {
        x32_group xg[4];
        UNROLL for (int j = 0; j < NX; j++)
            x32_prepare(kind, x + (size_t)j * xs + ACT32_BLOCK_BYTES * (size_t)b0, 16, &xg[j]);
        UNROLL for (int i = 0; i < NW; i++) {
            w32_group wg;
            if (lanes)
                w32_load16_lanes(kind, w + (size_t)i * ws + bs * (size_t)b0, &wg);
            else
                w32_load16(kind, w + (size_t)i * ws + bs * (size_t)b0, &wg);
            w32_pairs(kind, NX, &wg, xg, 16, 8, acc[i]);
        }
    }
    for (int g; b0 < nb; b0 += g) {
        g = act32_group_blocks(nb - b0);
        if (lanes && g >= 2) { /* a few loads: inline, g a constant */
            if (g == 8)
                w32_tail_lanes_step(kind, NW, NX, 8, w, ws, x, xs, b0, acc);
            else if (g == 4)
                w32_tail_lanes_step(kind, NW, NX, 4, w, ws, x, xs, b0, acc);
            else
                w32_tail_lanes_step(kind, NW, NX, 2, w, ws, x, xs, b0, acc);
            continue;
        }
        const int R = act32_rows(g);
        x32_group xg[4];
        UNROLL for (int j = 0; j < NX; j++)
            x32_prepare(kind, x + (size_t)j * xs + ACT32_BLOCK_BYTES * (size_t)b0, g, &xg[j]);
        UNROLL for (int i = 0; i < NW; i++) {
            w32_group wg;
            const uint8_t *wp = w + (size_t)i * ws + bs * (size_t)b0;
            if (g == 2) {
                w32_permute_tail2(kind, wp, &wg);
                w32_pairs(kind, NX, &wg, xg, 2, 1, acc[i]);
            } else {
                w32_load_tail(kind, wp, g, &wg);
                w32_pairs(kind, NX, &wg, xg, g, R, acc[i]);
            }
        }
    }
    tile_store(NW, NX, acc, out, os);
}

/* ---------------------------------------------------------------- K-quant tile */

enum wk_kind { WK_Q4_K, WK_Q5_K, WK_Q6_K };

/* One super-block of one weight row in actK lane order (lane p: 16 elements of sub-block p % 8,
 * half p / 8): 4 rows of unsigned codes, per-lane scale d*sc and (Q4_K/Q5_K) bias -dmin*m. */
typedef struct wk_group {
    __m512i q[4];
    __m512 d, m;
} wk_group;

/* Sub-block scales and mins of Q4_K/Q5_K as floats [sc0..sc7, m0..m7] (GGML's utmp unpacking of
 * the 12-byte 6-bit fields). */
ALWAYS_INLINE __m512 k4_scales_mins(const uint8_t *scales) {
    uint32_t u[4];
    memcpy(u, scales, 12);
    const uint32_t kmask1 = 0x3f3f3f3f, kmask2 = 0x0f0f0f0f, kmask3 = 0x03030303;
    u[3] = ((u[2] >> 4) & kmask2) | (((u[1] >> 6) & kmask3) << 4);
    const uint32_t uaux = u[1] & kmask1;
    u[1] = (u[2] & kmask2) | (((u[0] >> 6) & kmask3) << 4);
    u[2] = uaux;
    u[0] &= kmask1;
    return _mm512_cvtepi32_ps(
        _mm512_cvtepu8_epi32(_mm_setr_epi32((int)u[0], (int)u[1], (int)u[2], (int)u[3])));
}

ALWAYS_INLINE void wk_load(int kind, const uint8_t *p, wk_group *o) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i s = _mm512_and_si512(lane, _mm512_set1_epi32(7));         /* sub-block of 32 */
    const __m512i half4 = _mm512_slli_epi32(_mm512_srli_epi32(lane, 3), 2); /* 4 * (p / 8) */
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    if (kind == WK_Q6_K) {
        /* byte offsets, not the struct: tiles take rows at any alignment */
        const uint8_t *ql = p + offsetof(block_q6_K, ql), *qhp = p + offsetof(block_q6_K, qh);
        const uint8_t *scales = p + offsetof(block_q6_K, scales);
        const float d6 = half_to_float(rd16(p + offsetof(block_q6_K, d)));
        const __m512i ql0 = _mm512_loadu_si512((const void *)ql);
        const __m512i ql1 = _mm512_loadu_si512((const void *)(ql + 64));
        const __m512i qh = _mm512_loadu_si512((const void *)qhp);
        /* s = 4H + k: ql dword 16H + 8(k&1) + t, nibble k>>1; qh dword 8H + t, bits 2k. */
        const __m512i H = _mm512_srli_epi32(s, 2), k = _mm512_and_si512(s, _mm512_set1_epi32(3));
        const __m512i ql_base = _mm512_add_epi32(
            _mm512_add_epi32(_mm512_slli_epi32(H, 4),
                             _mm512_slli_epi32(_mm512_and_si512(k, _mm512_set1_epi32(1)), 3)),
            half4);
        const __m512i qh_base = _mm512_add_epi32(_mm512_slli_epi32(H, 3), half4);
        const __m512i ql_shift = _mm512_slli_epi32(_mm512_srli_epi32(k, 1), 2);
        const __m512i qh_shift = _mm512_slli_epi32(k, 1);
        UNROLL for (int r = 0; r < 4; r++) {
            const __m512i rr = _mm512_set1_epi32(r);
            __m512i lo = _mm512_permutex2var_epi32(ql0, _mm512_add_epi32(ql_base, rr), ql1);
            lo = _mm512_and_si512(_mm512_srlv_epi32(lo, ql_shift), m4);
            __m512i hi = _mm512_permutexvar_epi32(_mm512_add_epi32(qh_base, rr), qh);
            hi = _mm512_and_si512(_mm512_srlv_epi32(hi, qh_shift), _mm512_set1_epi8(3));
            o->q[r] = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 4));
        }
        /* lane p: scales[2 (p%8) + p/8] */
        const __m128i sc =
            _mm_shuffle_epi8(_mm_loadu_si128((const void *)scales),
                             _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
        o->d = _mm512_mul_ps(_mm512_set1_ps(d6), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
        o->m = _mm512_setzero_ps();
        return;
    }
    const int five = kind == WK_Q5_K;
    const uint8_t *qs = p + (five ? 48 : 16);
    const __m512i z0 = _mm512_loadu_si512((const void *)qs),
                  z1 = _mm512_loadu_si512((const void *)(qs + 64));
    /* qs dword 8 (s/2) + t, nibble s % 2 */
    const __m512i base = _mm512_add_epi32(_mm512_slli_epi32(_mm512_srli_epi32(s, 1), 3), half4);
    const __m512i shift = _mm512_slli_epi32(_mm512_and_si512(s, _mm512_set1_epi32(1)), 2);
    __m512i qh = _mm512_setzero_si512();
    if (five) qh = _mm512_castsi256_si512(_mm256_loadu_si256((const void *)(p + 16)));
    UNROLL for (int r = 0; r < 4; r++) {
        const __m512i rr = _mm512_set1_epi32(r);
        __m512i v = _mm512_permutex2var_epi32(z0, _mm512_add_epi32(base, rr), z1);
        v = _mm512_and_si512(_mm512_srlv_epi32(v, shift), m4);
        if (five) {
            /* qh dword t, bit s of each byte */
            __m512i h = _mm512_permutexvar_epi32(_mm512_add_epi32(half4, rr), qh);
            h = _mm512_and_si512(_mm512_srlv_epi32(h, s), _mm512_set1_epi8(1));
            v = _mm512_or_si512(v, _mm512_slli_epi32(h, 4));
        }
        o->q[r] = v;
    }
    const __m512 scm = k4_scales_mins(p + 4);
    const __m512i lo8 = s, hi8 = _mm512_add_epi32(s, _mm512_set1_epi32(8));
    o->d = _mm512_mul_ps(_mm512_set1_ps(_cvtsh_ss(rd16(p))), _mm512_permutexvar_ps(lo8, scm));
    o->m = _mm512_mul_ps(_mm512_set1_ps(-_cvtsh_ss(rd16(p + 2))), _mm512_permutexvar_ps(hi8, scm));
}

typedef struct xk_group {
    const uint8_t *qs;
    __m512 d;  /* broadcast */
    __m512 s;  /* Q4_K/Q5_K: d * lane sum */
    __m512i c; /* Q6_K: -32 * lane sum */
} xk_group;

ALWAYS_INLINE void xk_prepare(int kind, const uint8_t *blk, xk_group *o) {
    float d;
    memcpy(&d, blk + ACTK_D_OFFSET, 4);
    o->qs = blk;
    o->d = _mm512_set1_ps(d);
    const __m512i sum =
        _mm512_cvtepi16_epi32(_mm256_loadu_si256((const void *)(blk + ACTK_BSUM_OFFSET)));
    if (kind == WK_Q6_K) {
        o->c = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sum, 5));
        o->s = _mm512_setzero_ps();
    } else {
        o->c = _mm512_setzero_si512();
        o->s = _mm512_mul_ps(o->d, _mm512_cvtepi32_ps(sum));
    }
}

ALWAYS_INLINE __m512 wk_pair(int kind, const wk_group *w, const xk_group *x, __m512 acc) {
    __m512i isum = x->c;
    UNROLL for (int r = 0; r < 4; r++) isum =
        _mm512_dpbusd_epi32(isum, w->q[r], _mm512_loadu_si512((const void *)(x->qs + 64 * r)));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(w->d, x->d), acc);
    if (kind != WK_Q6_K) acc = _mm512_fmadd_ps(w->m, x->s, acc);
    return acc;
}

ALWAYS_INLINE size_t wk_bytes(int kind) {
    return kind == WK_Q4_K   ? sizeof(block_q4_K)
           : kind == WK_Q5_K ? sizeof(block_q5_K)
                             : sizeof(block_q6_K);
}

ALWAYS_INLINE void tile_wk(int kind, const int NW, const int NX, int64_t n, const uint8_t *w,
                           size_t ws, const uint8_t *x, size_t xs, float *out, size_t os) {
    __m512 acc[4][4];
    UNROLL for (int i = 0; i < NW; i++) UNROLL for (int j = 0; j < NX; j++) acc[i][j] =
        _mm512_setzero_ps();
    const size_t bs = wk_bytes(kind);
    for (int64_t b = 0; b < n / QK_K; b++) {
        xk_group xg[4];
        UNROLL for (int j = 0; j < NX; j++)
            xk_prepare(kind, x + (size_t)j * xs + ACTK_BLOCK_BYTES * (size_t)b, &xg[j]);
        UNROLL for (int i = 0; i < NW; i++) {
            wk_group wg;
            wk_load(kind, w + (size_t)i * ws + bs * (size_t)b, &wg);
            UNROLL for (int j = 0; j < NX; j++) acc[i][j] = wk_pair(kind, &wg, &xg[j], acc[i][j]);
        }
    }
    tile_store(NW, NX, acc, out, os);
}

/* ---------------------------------------------------------------- float tile */

enum wf_kind { WF_F32, WF_F16, WF_BF16 };

ALWAYS_INLINE __m512 wf_load(int kind, const uint8_t *p, __mmask16 k, int full) {
    if (kind == WF_F32) return full ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(k, p);
    const __m256i h = full ? _mm256_loadu_si256((const void *)p) : _mm256_maskz_loadu_epi16(k, p);
    if (kind == WF_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

ALWAYS_INLINE void tile_wf(int kind, const int NW, const int NX, int64_t n, const uint8_t *w,
                           size_t ws, const uint8_t *x, size_t xs, float *out, size_t os) {
    __m512 acc[4][4];
    UNROLL for (int i = 0; i < NW; i++) UNROLL for (int j = 0; j < NX; j++) acc[i][j] =
        _mm512_setzero_ps();
    const size_t es = kind == WF_F32 ? 4 : 2;
    int64_t e = 0;
    for (; e + 16 <= n; e += 16) {
        __m512 xv[4];
        UNROLL for (int j = 0; j < NX; j++) xv[j] =
            _mm512_loadu_ps((const float *)(const void *)(x + (size_t)j * xs) + e);
        UNROLL for (int i = 0; i < NW; i++) {
            const __m512 wv = wf_load(kind, w + (size_t)i * ws + es * (size_t)e, 0, 1);
            UNROLL for (int j = 0; j < NX; j++) acc[i][j] = _mm512_fmadd_ps(wv, xv[j], acc[i][j]);
        }
    }
    if (e < n) {
        const __mmask16 k = (__mmask16)((1u << (n - e)) - 1);
        __m512 xv[4];
        UNROLL for (int j = 0; j < NX; j++) xv[j] =
            _mm512_maskz_loadu_ps(k, (const float *)(const void *)(x + (size_t)j * xs) + e);
        UNROLL for (int i = 0; i < NW; i++) {
            const __m512 wv = wf_load(kind, w + (size_t)i * ws + es * (size_t)e, k, 0);
            UNROLL for (int j = 0; j < NX; j++) acc[i][j] = _mm512_fmadd_ps(wv, xv[j], acc[i][j]);
        }
    }
    tile_store(NW, NX, acc, out, os);
}

/* ---------------------------------------------------------------- instantiation */

#define QUANT_ISA avx512
#include "kernels/cpu/quant_simd.inc"
