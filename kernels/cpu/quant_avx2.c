/* AVX2 (+ FMA, F16C) variants of the quantized kernels; compiled with the AVX2 flags (Makefile)
 * and reached only through the dispatcher in quant.c on CPUs that have them.
 *
 * The dot tiles read the same interleaved activations as the AVX-512 ones (quant_impl.h): the
 * 16 lanes of an activation row are two 8-lane halves here. Weight rows are brought into lane
 * order with gathers (32-element types) or shuffles (K-quants). AVX2 has no vpdpbusd:
 * vpmaddubsw multiplies unsigned codes by int8 activations into int16 pairs, which are summed in
 * int16 over as many rows as cannot overflow (|pair| <= 2 * max_code * 127) before one
 * vpmaddwd widens them. Q8_0's codes need 8 bits, so it keeps signed codes and uses the sign
 * trick (|w| times x with w's sign), one row at a time. */
#include <immintrin.h>
#include <string.h>

#include "kernels/cpu/quant_impl.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 16")

static inline uint16_t rd16(const void *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

/* ---------------------------------------------------------------- conversions */

static void avx2_fp16_to_fp32_row(const uint16_t *src, float *dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const void *)(src + i))));
    for (; i < n; i++) dst[i] = half_to_float(src[i]);
}

static void avx2_fp32_to_fp16_row(const float *src, uint16_t *dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((void *)(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) {
        const __m128i h = _mm_cvtps_ph(_mm_set_ss(src[i]), _MM_FROUND_TO_NEAREST_INT);
        dst[i] = (uint16_t)_mm_extract_epi16(h, 0);
    }
}

/* ---------------------------------------------------------------- dequantize
 * Same float operation order as the scalar reference (quant.c), so results are identical. Every
 * product that is then added to (d*q + m, d1*q - m1) is exact in float (an fp16 scale, or fp16
 * times a 6-bit sub-scale, times a code below 32), so the FMA contraction the Makefile allows
 * (-ffp-contract=fast) cannot change a result either. */

static void avx2_dequantize_f16(const void *src, float *dst, int64_t n) {
    avx2_fp16_to_fp32_row(src, dst, n);
}

static void avx2_dequantize_bf16(const void *src, float *dst, int64_t n) {
    const uint16_t *s = src;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const void *)(s + i)));
        _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
    }
    for (; i < n; i++) {
        uint32_t b = (uint32_t)s[i] << 16;
        memcpy(dst + i, &b, 4);
    }
}

/* The 32 values of a 32-element block of unsigned codes as 4 x 8 int32: elements 0..15 from
 * the low nibbles of qs[0..15], 16..31 from the high ones, plus bit 4 from qh (Q5). */
ALWAYS_INLINE void codes32(const uint8_t *qs, const uint8_t *qh, __m256i v[4]) {
    const __m128i q = _mm_loadu_si128((const void *)qs);
    const __m128i lo = _mm_and_si128(q, _mm_set1_epi8(0x0F));
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(0x0F));
    v[0] = _mm256_cvtepu8_epi32(lo);
    v[1] = _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8));
    v[2] = _mm256_cvtepu8_epi32(hi);
    v[3] = _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8));
    if (qh) {
        uint32_t h;
        memcpy(&h, qh, 4);
        const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
        for (int k = 0; k < 4; k++) {
            const __m256i b =
                _mm256_and_si256(_mm256_set1_epi32((int)((h >> (8 * k)) & 0xFF)), bits);
            const __m256i set = _mm256_cmpeq_epi32(b, bits);
            v[k] = _mm256_or_si256(v[k], _mm256_and_si256(set, _mm256_set1_epi32(16)));
        }
    }
}

/* dst = d * (v - offset) (offset != 0) or d * v + m. */
ALWAYS_INLINE void store32(float *dst, const __m256i v[4], float d, float m, int offset) {
    const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
    for (int k = 0; k < 4; k++) {
        __m256 f;
        if (offset)
            f = _mm256_mul_ps(
                dv, _mm256_cvtepi32_ps(_mm256_sub_epi32(v[k], _mm256_set1_epi32(offset))));
        else
            f = _mm256_add_ps(_mm256_mul_ps(dv, _mm256_cvtepi32_ps(v[k])), mv);
        _mm256_storeu_ps(dst + 8 * k, f);
    }
}

static void avx2_dequantize_q4_0(const void *src, float *dst, int64_t n) {
    const block_q4_0 *b = src;
    for (int64_t i = 0; i < n / QK32; i++, dst += QK32) {
        __m256i v[4];
        codes32(b[i].qs, NULL, v);
        store32(dst, v, half_to_float(b[i].d), 0, 8);
    }
}

static void avx2_dequantize_q4_1(const void *src, float *dst, int64_t n) {
    const block_q4_1 *b = src;
    for (int64_t i = 0; i < n / QK32; i++, dst += QK32) {
        __m256i v[4];
        codes32(b[i].qs, NULL, v);
        store32(dst, v, half_to_float(b[i].d), half_to_float(b[i].m), 0);
    }
}

static void avx2_dequantize_q5_0(const void *src, float *dst, int64_t n) {
    const block_q5_0 *b = src;
    for (int64_t i = 0; i < n / QK32; i++, dst += QK32) {
        __m256i v[4];
        codes32(b[i].qs, b[i].qh, v);
        store32(dst, v, half_to_float(b[i].d), 0, 16);
    }
}

static void avx2_dequantize_q5_1(const void *src, float *dst, int64_t n) {
    const block_q5_1 *b = src;
    for (int64_t i = 0; i < n / QK32; i++, dst += QK32) {
        __m256i v[4];
        codes32(b[i].qs, b[i].qh, v);
        store32(dst, v, half_to_float(b[i].d), half_to_float(b[i].m), 0);
    }
}

static void avx2_dequantize_q8_0(const void *src, float *dst, int64_t n) {
    const block_q8_0 *b = src;
    for (int64_t i = 0; i < n / QK32; i++, dst += QK32) {
        const __m256 d = _mm256_set1_ps(half_to_float(b[i].d));
        for (int k = 0; k < 4; k++) {
            const __m256i v =
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const void *)(b[i].qs + 8 * k)));
            _mm256_storeu_ps(dst + 8 * k, _mm256_mul_ps(d, _mm256_cvtepi32_ps(v)));
        }
    }
}

ALWAYS_INLINE void dequantize_k45(const uint8_t *scales, const uint8_t *qs, const uint8_t *qh,
                                  float d, float dmin, float *dst) {
    for (int s = 0; s < 8; s++) {
        int sc, m;
        quant_k4_scale_min(scales, s, &sc, &m);
        const __m256 d1 = _mm256_set1_ps(d * (float)sc), m1 = _mm256_set1_ps(dmin * (float)m);
        for (int k = 0; k < 4; k++) {
            __m256i q =
                _mm256_cvtepu8_epi32(_mm_loadl_epi64((const void *)(qs + 32 * (s / 2) + 8 * k)));
            q = _mm256_and_si256(_mm256_srli_epi32(q, 4 * (s % 2)), _mm256_set1_epi32(0xF));
            if (qh) {
                __m256i hb = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const void *)(qh + 8 * k)));
                hb = _mm256_and_si256(_mm256_srli_epi32(hb, s), _mm256_set1_epi32(1));
                q = _mm256_or_si256(q, _mm256_slli_epi32(hb, 4));
            }
            _mm256_storeu_ps(dst + 32 * s + 8 * k,
                             _mm256_sub_ps(_mm256_mul_ps(d1, _mm256_cvtepi32_ps(q)), m1));
        }
    }
}

static void avx2_dequantize_q4_K(const void *src, float *dst, int64_t n) {
    const block_q4_K *b = src;
    for (int64_t i = 0; i < n / QK_K; i++, dst += QK_K)
        dequantize_k45(b[i].scales, b[i].qs, NULL, half_to_float(b[i].d), half_to_float(b[i].dmin),
                       dst);
}

static void avx2_dequantize_q5_K(const void *src, float *dst, int64_t n) {
    const block_q5_K *b = src;
    for (int64_t i = 0; i < n / QK_K; i++, dst += QK_K)
        dequantize_k45(b[i].scales, b[i].qs, b[i].qh, half_to_float(b[i].d),
                       half_to_float(b[i].dmin), dst);
}

static void avx2_dequantize_q6_K(const void *src, float *dst, int64_t n) {
    const block_q6_K *b = src;
    for (int64_t i = 0; i < n / QK_K; i++, dst += QK_K) {
        const float d = half_to_float(b[i].d);
        for (int e = 0; e < QK_K; e += 8) {
            const int h = e / 128, k = (e % 128) / 32, l = e % 32;
            __m256i ql = _mm256_cvtepu8_epi32(
                _mm_loadl_epi64((const void *)(b[i].ql + 64 * h + l + 32 * (k & 1))));
            __m256i qh =
                _mm256_cvtepu8_epi32(_mm_loadl_epi64((const void *)(b[i].qh + 32 * h + l)));
            ql = _mm256_and_si256(_mm256_srli_epi32(ql, 4 * (k >> 1)), _mm256_set1_epi32(0xF));
            qh = _mm256_and_si256(_mm256_srli_epi32(qh, 2 * k), _mm256_set1_epi32(3));
            const __m256i q = _mm256_sub_epi32(_mm256_or_si256(ql, _mm256_slli_epi32(qh, 4)),
                                               _mm256_set1_epi32(32));
            const __m256 ds = _mm256_set1_ps(d * (float)b[i].scales[e / 16]);
            _mm256_storeu_ps(dst + e, _mm256_mul_ps(ds, _mm256_cvtepi32_ps(q)));
        }
    }
}

/* ---------------------------------------------------------------- quantize (activations)
 * The same arithmetic as the scalar reference (quant.c), so the bytes are identical. */

ALWAYS_INLINE __m256 abs_nonan(__m256 v) {
    const __m256 a = _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)));
    return _mm256_and_ps(a, _mm256_cmp_ps(v, v, _CMP_ORD_Q));
}

ALWAYS_INLINE float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* 32 floats -> 32 int8 round(clamp(x * id)) in element order; returns their sum. */
ALWAYS_INLINE int q8_round32(const float *x, __m256 id, int8_t *q) {
    __m256i v[4];
    for (int k = 0; k < 4; k++) {
        __m256 f =
            _mm256_max_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * k), id), _mm256_set1_ps(-127.0f));
        f = _mm256_min_ps(f, _mm256_set1_ps(127.0f));
        v[k] = _mm256_cvtps_epi32(f);
    }
    const __m256i s = _mm256_add_epi32(_mm256_add_epi32(v[0], v[1]), _mm256_add_epi32(v[2], v[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    /* packs interleave 128-bit lanes; the final permute restores element order */
    const __m256i p16 =
        _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    _mm256_storeu_si256(
        (void *)q, _mm256_permutevar8x32_epi32(p16, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    return _mm_cvtsi128_si32(s4);
}

static void avx2_quantize_q8_1(const float *src, void *dst, int64_t n) {
    const int64_t nb = n / QK32;
    uint8_t *y = dst;
    for (int64_t b0 = 0, g; b0 < nb; b0 += g) {
        g = act32_group_blocks(nb - b0);
        for (int k = 0; k < (int)g; k++) {
            const float *x = src + QK32 * (b0 + k);
            __m256 m = abs_nonan(_mm256_loadu_ps(x));
            for (int e = 8; e < 32; e += 8) m = _mm256_max_ps(abs_nonan(_mm256_loadu_ps(x + e)), m);
            uint16_t dh = (uint16_t)_cvtss_sh(hmax8(m) / 127.0f, _MM_FROUND_TO_NEAREST_INT);
            if ((dh & 0x7fff) >= 0x7c00) dh = 0x7bff;
            const float d = half_to_float(dh);
            int8_t q[32];
            const int sum = q8_round32(x, _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f), q);
            act32_put_block(y + ACT32_BLOCK_BYTES * b0, (int)g, k, q, dh, sum);
        }
    }
}

static void avx2_quantize_q8_K(const float *src, void *dst, int64_t n) {
    uint8_t *y = dst;
    for (int64_t i = 0; i < n / QK_K; i++, src += QK_K, y += ACTK_BLOCK_BYTES) {
        __m256 m = _mm256_setzero_ps();
        for (int e = 0; e < QK_K; e += 8) m = _mm256_max_ps(abs_nonan(_mm256_loadu_ps(src + e)), m);
        const float d = hmax8(m) / 127.0f;
        const __m256 id = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
        int8_t q[QK_K];
        for (int e = 0; e < QK_K; e += 32) q8_round32(src + e, id, q + e);
        actk_put(y, q, d);
    }
}

/* ---------------------------------------------------------------- tile plumbing */

ALWAYS_INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* out[j * os + i] = sum of acc[i][j]. */
ALWAYS_INLINE void tile_store(const int NW, const int NX, __m256 acc[4][4], float *out, size_t os) {
    UNROLL for (int i = 0; i < NW; i++) {
        UNROLL for (int j = 0; j < NX; j++) out[(size_t)j * os + (size_t)i] = hsum8(acc[i][j]);
    }
}

/* Sum of an int16 pair vector into int32 lanes (4 products per lane, as vpdpbusd). */
ALWAYS_INLINE __m256i widen16(__m256i v) { return _mm256_madd_epi16(v, _mm256_set1_epi16(1)); }

/* e[r] = [c0[r] c1[r] c2[r] c3[r] | c0[r+4] c1[r+4] c2[r+4] c3[r+4]] of four 8-dword chunks. */
ALWAYS_INLINE void transpose4x8(const __m256i c[4], __m256i e[4]) {
    const __m256i t0 = _mm256_unpacklo_epi32(c[0], c[1]), t1 = _mm256_unpackhi_epi32(c[0], c[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(c[2], c[3]), t3 = _mm256_unpackhi_epi32(c[2], c[3]);
    e[0] = _mm256_unpacklo_epi64(t0, t2);
    e[1] = _mm256_unpackhi_epi64(t0, t2);
    e[2] = _mm256_unpacklo_epi64(t1, t3);
    e[3] = _mm256_unpackhi_epi64(t1, t3);
}

/* ---------------------------------------------------------------- act32 */

enum w32_kind { W32_Q4_0, W32_Q4_1, W32_Q5_0, W32_Q5_1, W32_Q8_0 };

ALWAYS_INLINE int w32_bytes(int kind) {
    return kind == W32_Q4_0   ? 18
           : kind == W32_Q4_1 ? 20
           : kind == W32_Q5_0 ? 22
           : kind == W32_Q5_1 ? 24
                              : 34;
}
ALWAYS_INLINE int w32_qs_off(int kind) {
    return kind == W32_Q4_0   ? 2
           : kind == W32_Q4_1 ? 4
           : kind == W32_Q5_0 ? 6
           : kind == W32_Q5_1 ? 8
                              : 2;
}
ALWAYS_INLINE int w32_qh_off(int kind) { return kind == W32_Q5_0 ? 2 : 4; }
ALWAYS_INLINE int w32_has_min(int kind) { return kind == W32_Q4_1 || kind == W32_Q5_1; }
ALWAYS_INLINE int w32_is_q5(int kind) { return kind == W32_Q5_0 || kind == W32_Q5_1; }
ALWAYS_INLINE int w32_offset_shift(int kind) {
    return kind == W32_Q4_0 ? 3 : kind == W32_Q5_0 ? 4 : 0;
}
/* Rows whose int16 pair sums can be added before widening: 2*max_code*127 per row. */
ALWAYS_INLINE int w32_rows16(int kind) { return kind == W32_Q8_0 ? 1 : w32_is_q5(kind) ? 4 : 8; }

/* One weight row's group in act32 lane order, two halves of 8 lanes. Q8_0 keeps its signed
 * codes in q (their magnitudes are taken where they are multiplied: the sign trick). */
typedef struct w32_group {
    __m256i q[8][2];
    __m256 d[2], m[2];
} w32_group;

/* Block and element dword of lane p in row r of a group of g blocks (quant_impl.h). */
ALWAYS_INLINE void w32_lane(int g, int p, int r, int *blk, int *t) {
    if (g == 16) {
        *blk = act32_sigma(p);
        *t = r;
    } else {
        *blk = p % g;
        *t = r + act32_rows(g) * (p / g);
    }
}

/* The element dword t of each lane of half h, row r (a remainder group's Q5 bits). */
ALWAYS_INLINE __m256i lane_dword(int g, int h, int r) {
    int v[8];
    for (int k = 0; k < 8; k++) {
        int blk;
        w32_lane(g, 8 * h + k, r, &blk, &v[k]);
    }
    return _mm256_setr_epi32(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]);
}

/* Dwords 0..3 of the 16 bytes at `off` in each of the 8 blocks of half h of a 16-block group,
 * in lane order: c[t] lane k = dword t of block act32_sigma(8h + k). The low 128 bits of a half
 * are blocks 2h, 2h+4, 2h+8, 2h+12 and the high 128 bits blocks 2h+1, 2h+5, ..., so four
 * two-block loads and a 4x4 dword transpose inside each 128-bit half put them there: no
 * gathers (vpgatherdd costs 8 to 20 cycles on the AMD and older Intel cores AVX2 runs on). */
ALWAYS_INLINE void w32_transpose16(int kind, const uint8_t *p, int h, int off, __m256i e[4]) {
    const size_t bb = (size_t)w32_bytes(kind);
    __m256i c[4];
    UNROLL for (int i = 0; i < 4; i++) {
        const uint8_t *b = p + bb * (size_t)(2 * h + 4 * i) + off;
        c[i] = _mm256_loadu2_m128i((const void *)(b + bb), (const void *)b);
    }
    transpose4x8(c, e);
}

/* Half h of a 16-block group's code rows (row r: elements 4r..4r+3 of each lane's block). */
ALWAYS_INLINE void w32_rows_full(int kind, const uint8_t *p, int h, __m256i qh, w32_group *o) {
    __m256i e[4];
    if (kind == W32_Q8_0) {
        /* rows 0..3 from qs[0..15], rows 4..7 from qs[16..31] */
        UNROLL for (int half = 0; half < 2; half++) {
            w32_transpose16(kind, p, h, 2 + 16 * half, e);
            UNROLL for (int t = 0; t < 4; t++) o->q[t + 4 * half][h] = e[t];
        }
        return;
    }
    /* row t < 4: low nibbles of qs dword t; row t + 4: its high nibbles */
    w32_transpose16(kind, p, h, w32_qs_off(kind), e);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    UNROLL for (int t = 0; t < 4; t++) {
        o->q[t][h] = _mm256_and_si256(e[t], m4);
        o->q[t + 4][h] = _mm256_and_si256(_mm256_srli_epi32(e[t], 4), m4);
    }
    if (w32_is_q5(kind)) UNROLL for (int r = 0; r < 8; r++) {
            /* bits 4r..4r+3 of qh, one per byte (as in w32_load) */
            __m256i h4 = _mm256_and_si256(_mm256_srli_epi32(qh, 4 * r), _mm256_set1_epi32(0xF));
            h4 = _mm256_and_si256(_mm256_mullo_epi32(h4, _mm256_set1_epi32(0x00204081)),
                                  _mm256_set1_epi32(0x01010101));
            o->q[r][h] = _mm256_or_si256(o->q[r][h], _mm256_slli_epi32(h4, 4));
        }
}

/* The 16 bytes of block b whose dwords are elements 4t..4t+3 for t in [4s, 4s + 4): Q8_0's
 * codes 16s..16s+15; the 4-bit types' qs, whose nibble s they are (w32_codes takes it). */
ALWAYS_INLINE __m128i w32_src(int kind, const uint8_t *p, int b, int s) {
    const int off = kind == W32_Q8_0 ? 2 + 16 * s : w32_qs_off(kind);
    return _mm_loadu_si128((const void *)(p + (size_t)w32_bytes(kind) * (size_t)b + off));
}

/* Stores row r of half h from dwords v whose lanes in the 128-bit half j hold nibble s_j (4-bit
 * types) or the codes themselves (Q8_0's signed codes). */
ALWAYS_INLINE void w32_codes(int kind, __m256i v, int s0, int s1, int r, int h, w32_group *o) {
    if (kind == W32_Q8_0) {
        o->q[r][h] = v;
        return;
    }
    v = _mm256_srlv_epi32(
        v, _mm256_setr_epi32(4 * s0, 4 * s0, 4 * s0, 4 * s0, 4 * s1, 4 * s1, 4 * s1, 4 * s1));
    o->q[r][h] = _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
}

/* Half h of a remainder group's code rows (g < 16; lanes as w32_lane says), from loads and
 * in-register transposes. Every lane of half h takes t in [4h, 4h + 4), except for g = 1,
 * whose one half spans t = 0..7. */
ALWAYS_INLINE void w32_rows_part(int kind, const uint8_t *p, const int g, int h, w32_group *o) {
    if (g == 1) { /* lane k: element dword k of the block */
        w32_codes(kind,
                  _mm256_set_m128i(w32_src(kind, p, 0, kind == W32_Q8_0), w32_src(kind, p, 0, 0)),
                  0, 1, 0, h, o);
        return;
    }
    if (g == 2) { /* lane k: dword 4h + k/2 of block k % 2 */
        const __m128i x0 = w32_src(kind, p, 0, h), x1 = w32_src(kind, p, 1, h);
        w32_codes(kind, _mm256_set_m128i(_mm_unpackhi_epi32(x0, x1), _mm_unpacklo_epi32(x0, x1)), h,
                  h, 0, h, o);
        return;
    }
    if (g == 4) { /* row r, lane k: dword 4h + r + 2(k/4) of block k % 4 */
        const __m128i x0 = w32_src(kind, p, 0, h), x1 = w32_src(kind, p, 1, h);
        const __m128i x2 = w32_src(kind, p, 2, h), x3 = w32_src(kind, p, 3, h);
        const __m128i t0 = _mm_unpacklo_epi32(x0, x1), t1 = _mm_unpackhi_epi32(x0, x1);
        const __m128i t2 = _mm_unpacklo_epi32(x2, x3), t3 = _mm_unpackhi_epi32(x2, x3);
        const __m128i f0 = _mm_unpacklo_epi64(t0, t2), f1 = _mm_unpackhi_epi64(t0, t2);
        const __m128i f2 = _mm_unpacklo_epi64(t1, t3), f3 = _mm_unpackhi_epi64(t1, t3);
        w32_codes(kind, _mm256_set_m128i(f2, f0), h, h, 0, h, o);
        w32_codes(kind, _mm256_set_m128i(f3, f1), h, h, 1, h, o);
        return;
    }
    /* g = 8: row r, lane k: dword 4h + r of block k */
    __m256i c[4], e[4];
    UNROLL for (int i = 0; i < 4; i++) c[i] =
        _mm256_set_m128i(w32_src(kind, p, i + 4, h), w32_src(kind, p, i, h));
    transpose4x8(c, e);
    UNROLL for (int r = 0; r < 4; r++) w32_codes(kind, e[r], h, h, r, h, o);
}

/* The 4 bytes at `off` of each lane's block in half h (lanes as w32_lane says): for a full group
 * the first dword of w32_transpose16's rows (16-byte loads, at most 20 bytes into a block); a
 * remainder group's lanes repeat its g blocks (lane k: block k % g), so g loads make them. */
ALWAYS_INLINE __m256i w32_block_dwords(int kind, const uint8_t *p, const int g, int h, int off) {
    if (g == 16) { /* dword 0 of w32_transpose16's rows; vpgatherdd here stalled the loop */
        const size_t bb = (size_t)w32_bytes(kind);
        __m256i c[4];
        UNROLL for (int i = 0; i < 4; i++) {
            const uint8_t *b = p + bb * (size_t)(2 * h + 4 * i) + off;
            c[i] = _mm256_loadu2_m128i((const void *)(b + bb), (const void *)b);
        }
        return _mm256_unpacklo_epi64(_mm256_unpacklo_epi32(c[0], c[1]),
                                     _mm256_unpacklo_epi32(c[2], c[3]));
    }
    /* in registers: a wide load of narrower stores would stall on store forwarding */
    uint32_t v[8] = {0};
    for (int k = 0; k < g && k < 8; k++) memcpy(&v[k], p + (size_t)w32_bytes(kind) * k + off, 4);
    if (g == 1) return _mm256_set1_epi32((int)v[0]);
    if (g == 2) return _mm256_set1_epi64x((long long)((uint64_t)v[1] << 32 | v[0]));
    if (g == 4)
        return _mm256_broadcastsi128_si256(
            _mm_setr_epi32((int)v[0], (int)v[1], (int)v[2], (int)v[3]));
    return _mm256_setr_epi32((int)v[0], (int)v[1], (int)v[2], (int)v[3], (int)v[4], (int)v[5],
                             (int)v[6], (int)v[7]);
}

/* Half h of a lane-order group (*_L16, kernels/cpu/quant_impl.h): loads, and the nibbles split
 * into rows t and t + 4. */
ALWAYS_INLINE void w32_load_lanes(int kind, const uint8_t *p, const int h, w32_group *o) {
    o->d[h] = _mm256_cvtph_ps(_mm_loadu_si128((const void *)(p + 16 * h)));
    if (w32_has_min(kind))
        o->m[h] = _mm256_cvtph_ps(_mm_loadu_si128((const void *)(p + 32 + 16 * h)));
    const uint8_t *q = p + (w32_has_min(kind) ? 64 : 32) + 32 * h;
    if (kind == W32_Q8_0) {
        UNROLL for (int r = 0; r < 8; r++) o->q[r][h] =
            _mm256_loadu_si256((const void *)(q + L16_ROW_BYTES * r));
        return;
    }
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    UNROLL for (int t = 0; t < 4; t++) {
        const __m256i e = _mm256_loadu_si256((const void *)(q + L16_ROW_BYTES * t));
        o->q[t][h] = _mm256_and_si256(e, m4);
        o->q[t + 4][h] = _mm256_and_si256(_mm256_srli_epi16(e, 4), m4);
    }
}

/* Half h of one weight row's group (a group has g == 1 ? 1 : 2 halves). A half at a time: a
 * whole group's codes take all 16 ymm registers, and the spills cost more than the loads. */
ALWAYS_INLINE void w32_load(int kind, const uint8_t *p, const int g, const int h, w32_group *o) {
    const int R = act32_rows(g);
    do {
        const __m256i dm = w32_block_dwords(kind, p, g, h, 0);
        /* low 16 bits d, high 16 bits m */
        const __m256i lo16 = _mm256_and_si256(dm, _mm256_set1_epi32(0xFFFF));
        const __m128i dpk =
            _mm_packus_epi32(_mm256_castsi256_si128(lo16), _mm256_extracti128_si256(lo16, 1));
        o->d[h] = _mm256_cvtph_ps(dpk);
        if (w32_has_min(kind)) {
            const __m256i hi16 = _mm256_srli_epi32(dm, 16);
            o->m[h] = _mm256_cvtph_ps(
                _mm_packus_epi32(_mm256_castsi256_si128(hi16), _mm256_extracti128_si256(hi16, 1)));
        }
        __m256i qh = _mm256_setzero_si256();
        if (w32_is_q5(kind)) qh = w32_block_dwords(kind, p, g, h, w32_qh_off(kind));
        if (g == 16) {
            w32_rows_full(kind, p, h, qh, o);
            break;
        }
        w32_rows_part(kind, p, g, h, o);
        if (w32_is_q5(kind)) UNROLL for (int r = 0; r < 8; r++) {
                if (r >= R) break;
                /* bits 4t..4t+3 of qh, one per byte: the multiply copies bit k to bits k + 7j
                 * (no carries), so bit 8k holds bit k */
                const __m256i t = lane_dword(g, h, r);
                __m256i h4 = _mm256_and_si256(_mm256_srlv_epi32(qh, _mm256_slli_epi32(t, 2)),
                                              _mm256_set1_epi32(0xF));
                h4 = _mm256_and_si256(_mm256_mullo_epi32(h4, _mm256_set1_epi32(0x00204081)),
                                      _mm256_set1_epi32(0x01010101));
                o->q[r][h] = _mm256_or_si256(o->q[r][h], _mm256_slli_epi32(h4, 4));
            }
    } while (0);
}

/* The activation side of one group for one activation row, per half. */
typedef struct x32_group {
    const uint8_t *qs;
    __m256 d[2], s[2];
    __m256i c[2];
} x32_group;

/* g int16 values at p in the low lanes of a vector, the rest zero; or (repeat) repeated across
 * its 8 lanes (8 is a multiple of g). Loads of exactly 2g bytes. */
ALWAYS_INLINE __m128i x32_halves(const uint8_t *p, const int g, int repeat) {
    if (g == 8) return _mm_loadu_si128((const void *)p);
    if (g == 4) {
        int64_t v;
        memcpy(&v, p, 8);
        return repeat ? _mm_set1_epi64x(v) : _mm_cvtsi64_si128(v);
    }
    if (g == 2) {
        int32_t v;
        memcpy(&v, p, 4);
        return repeat ? _mm_set1_epi32(v) : _mm_cvtsi32_si128(v);
    }
    const int v = (int)rd16(p);
    return repeat ? _mm_set1_epi16((short)v) : _mm_cvtsi32_si128(v);
}

/* Half h of a remainder group of g = 8, 4 or 2 blocks in lane order (l16_pack_tail): the scales
 * repeat every g lanes as the activations' do; a 4-bit row's half 1 is its half 0's high
 * nibbles. */
ALWAYS_INLINE void w32_load_tail_lanes(int kind, const uint8_t *p, const int g, const int h,
                                       w32_group *o) {
    o->d[h] = _mm256_cvtph_ps(x32_halves(p, g, 1));
    if (w32_has_min(kind)) o->m[h] = _mm256_cvtph_ps(x32_halves(p + 2 * g, g, 1));
    const uint8_t *q = p + (w32_has_min(kind) ? 4 : 2) * g;
    UNROLL for (int r = 0; r < 8; r++) {
        if (r >= act32_rows(g)) break;
        if (kind == W32_Q8_0) {
            o->q[r][h] = _mm256_loadu_si256((const void *)(q + 64 * r + 32 * h));
            continue;
        }
        __m256i e = _mm256_loadu_si256((const void *)(q + 32 * r));
        if (h) e = _mm256_srli_epi16(e, 4);
        o->q[r][h] = _mm256_and_si256(e, _mm256_set1_epi8(0x0F));
    }
}

ALWAYS_INLINE void x32_prepare(int kind, const uint8_t *grp, const int g, x32_group *o) {
    o->qs = grp;
    __m128i dh[2], sum[2];
    if (g == 16) {
        UNROLL for (int h = 0; h < 2; h++) {
            dh[h] = _mm_loadu_si128((const void *)(grp + 512 + 16 * h));
            sum[h] = _mm_loadu_si128((const void *)(grp + 544 + 16 * h));
        }
    } else {
        /* lane p holds block p % g: the scales repeat every g lanes; each block's sum is
         * counted once, in lane p < g */
        dh[0] = dh[1] = x32_halves(grp + 32 * g, g, 1);
        sum[0] = x32_halves(grp + 34 * g, g, 0);
        sum[1] = _mm_setzero_si128();
    }
    UNROLL for (int h = 0; h < 2; h++) {
        o->d[h] = _mm256_cvtph_ps(dh[h]);
        const __m256i s = _mm256_cvtepi16_epi32(sum[h]);
        o->s[h] = _mm256_mul_ps(o->d[h], _mm256_cvtepi32_ps(s));
        o->c[h] =
            _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(s, w32_offset_shift(kind)));
    }
}

ALWAYS_INLINE __m256i x32_row(const x32_group *x, int g, int r, int h) {
    return _mm256_loadu_si256((const void *)(x->qs + (g == 1 ? 0 : 64 * r) + 32 * h));
}

/* Half h of a group: acc[j] += weight row . activation row j. */
ALWAYS_INLINE void w32_pairs(int kind, const int NX, const w32_group *w, const x32_group *x,
                             const int g, const int h, __m256 acc[4]) {
    const int R = act32_rows(g), rows16 = w32_rows16(kind);
    {
        __m256i isum[4], p16[4];
        UNROLL for (int j = 0; j < NX; j++) isum[j] =
            w32_offset_shift(kind) ? x[j].c[h] : _mm256_setzero_si256();
        UNROLL for (int r = 0; r < 8; r++) {
            if (r >= R) break;
            const __m256i wq = kind == W32_Q8_0 ? _mm256_abs_epi8(w->q[r][h]) : w->q[r][h];
            UNROLL for (int j = 0; j < NX; j++) {
                __m256i xr = x32_row(&x[j], g, r, h);
                if (kind == W32_Q8_0) xr = _mm256_sign_epi8(xr, w->q[r][h]);
                const __m256i p = _mm256_maddubs_epi16(wq, xr);
                p16[j] = r % rows16 == 0 ? p : _mm256_add_epi16(p16[j], p);
                if (r % rows16 == rows16 - 1 || r == R - 1)
                    isum[j] = _mm256_add_epi32(isum[j], widen16(p16[j]));
            }
        }
        UNROLL for (int j = 0; j < NX; j++) {
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[j]), _mm256_mul_ps(w->d[h], x[j].d[h]),
                                     acc[j]);
            if (w32_has_min(kind)) acc[j] = _mm256_fmadd_ps(w->m[h], x[j].s[h], acc[j]);
        }
    }
}

ALWAYS_INLINE void w32_group_step(int kind, const int lanes, const int NW, const int NX,
                                  const int g, const uint8_t *w, size_t ws, const uint8_t *x,
                                  size_t xs, int64_t b0, __m256 acc[4][4]) {
    x32_group xg[4];
    UNROLL for (int j = 0; j < NX; j++)
        x32_prepare(kind, x + (size_t)j * xs + ACT32_BLOCK_BYTES * (size_t)b0, g, &xg[j]);
    UNROLL for (int i = 0; i < NW; i++) for (int h = 0; h < (g == 1 ? 1 : 2); h++) {
        w32_group wg;
        const uint8_t *p = w + (size_t)i * ws + (size_t)w32_bytes(kind) * (size_t)b0;
        if (lanes && g == 16)
            w32_load_lanes(kind, p, h, &wg);
        else if (lanes && g >= 2)
            w32_load_tail_lanes(kind, p, g, h, &wg);
        else
            w32_load(kind, p, g, h, &wg);
        w32_pairs(kind, NX, &wg, xg, g, h, acc[i]);
    }
}

/* A remainder group (g < 16): out of line, once per type, with nw and nx as loop bounds. Each
 * activation row's group is prepared once for all the weight rows. */
ALWAYS_INLINE void w32_tail_g(int kind, const int g, int nw, int nx, const uint8_t *w, size_t ws,
                              const uint8_t *x, size_t xs, __m256 acc[4][4]) {
    x32_group xg[4];
    for (int j = 0; j < nx; j++) x32_prepare(kind, x + (size_t)j * xs, g, &xg[j]);
    for (int i = 0; i < nw; i++)
        for (int h = 0; h < (g == 1 ? 1 : 2); h++) {
            w32_group wg;
            w32_load(kind, w + (size_t)i * ws, g, h, &wg);
            for (int j = 0; j < nx; j++) w32_pairs(kind, 1, &wg, &xg[j], g, h, &acc[i][j]);
        }
}

ALWAYS_INLINE void w32_tail(int kind, int g, int nw, int nx, const uint8_t *w, size_t ws,
                            const uint8_t *x, size_t xs, __m256 acc[4][4]) {
    switch (g) {
    case 8:
        w32_tail_g(kind, 8, nw, nx, w, ws, x, xs, acc);
        break;
    case 4:
        w32_tail_g(kind, 4, nw, nx, w, ws, x, xs, acc);
        break;
    case 2:
        w32_tail_g(kind, 2, nw, nx, w, ws, x, xs, acc);
        break;
    default:
        w32_tail_g(kind, 1, nw, nx, w, ws, x, xs, acc);
        break;
    }
}

#define W32_TAIL(KIND, NAME)                                                                       \
    static __attribute__((noinline)) void w32_tail_##NAME(int g, int nw, int nx, const uint8_t *w, \
                                                          size_t ws, const uint8_t *x, size_t xs,  \
                                                          __m256 acc[4][4]) {                      \
        w32_tail(KIND, g, nw, nx, w, ws, x, xs, acc);                                              \
    }
W32_TAIL(W32_Q4_0, q4_0)
W32_TAIL(W32_Q4_1, q4_1)
W32_TAIL(W32_Q5_0, q5_0)
W32_TAIL(W32_Q5_1, q5_1)
W32_TAIL(W32_Q8_0, q8_0)

/* lanes: the row's groups of 2 blocks or more are in lane order (*_L16); a last single block is
 * GGUF's. */
ALWAYS_INLINE void tile_w32_rows(int kind, const int lanes, const int NW, const int NX, int64_t n,
                                 const uint8_t *w, size_t ws, const uint8_t *x, size_t xs,
                                 float *out, size_t os) {
    __m256 acc[4][4];
    UNROLL for (int i = 0; i < NW; i++) UNROLL for (int j = 0; j < NX; j++) acc[i][j] =
        _mm256_setzero_ps();
    const int64_t nb = n / QK32;
    int64_t b0 = 0;
    for (; nb - b0 >= 16; b0 += 16) w32_group_step(kind, lanes, NW, NX, 16, w, ws, x, xs, b0, acc);
    for (int g; b0 < nb; b0 += g) {
        g = act32_group_blocks(nb - b0);
        if (lanes && g >= 2) { /* a few loads: inline, the accumulators kept in registers */
            if (g == 8)
                w32_group_step(kind, lanes, NW, NX, 8, w, ws, x, xs, b0, acc);
            else if (g == 4)
                w32_group_step(kind, lanes, NW, NX, 4, w, ws, x, xs, b0, acc);
            else
                w32_group_step(kind, lanes, NW, NX, 2, w, ws, x, xs, b0, acc);
            continue;
        }
        const uint8_t *wt = w + (size_t)w32_bytes(kind) * (size_t)b0;
        const uint8_t *xt = x + ACT32_BLOCK_BYTES * (size_t)b0;
        switch (kind) {
        case W32_Q4_0:
            w32_tail_q4_0(g, NW, NX, wt, ws, xt, xs, acc);
            break;
        case W32_Q4_1:
            w32_tail_q4_1(g, NW, NX, wt, ws, xt, xs, acc);
            break;
        case W32_Q5_0:
            w32_tail_q5_0(g, NW, NX, wt, ws, xt, xs, acc);
            break;
        case W32_Q5_1:
            w32_tail_q5_1(g, NW, NX, wt, ws, xt, xs, acc);
            break;
        default:
            w32_tail_q8_0(g, NW, NX, wt, ws, xt, xs, acc);
            break;
        }
    }
    tile_store(NW, NX, acc, out, os);
}

/* ---------------------------------------------------------------- K-quants */

enum wk_kind { WK_Q4_K, WK_Q5_K, WK_Q6_K };

/* One super-block of one weight row in actK lane order: 4 rows x 2 halves of unsigned codes,
 * per-lane scale and (Q4_K/Q5_K) bias. */
typedef struct wk_group {
    __m256i q[4][2];
    __m256 d[2], m[2];
} wk_group;

ALWAYS_INLINE __m256 k4_scales_mins(const uint8_t *scales, int mins) {
    uint32_t u[4];
    memcpy(u, scales, 12);
    const uint32_t kmask1 = 0x3f3f3f3f, kmask2 = 0x0f0f0f0f, kmask3 = 0x03030303;
    u[3] = ((u[2] >> 4) & kmask2) | (((u[1] >> 6) & kmask3) << 4);
    const uint32_t uaux = u[1] & kmask1;
    u[1] = (u[2] & kmask2) | (((u[0] >> 6) & kmask3) << 4);
    u[2] = uaux;
    u[0] &= kmask1;
    const __m128i v = mins ? _mm_setr_epi32((int)u[2], (int)u[3], 0, 0)
                           : _mm_setr_epi32((int)u[0], (int)u[1], 0, 0);
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
}

ALWAYS_INLINE void wk_load(int kind, const uint8_t *p, wk_group *o) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    if (kind == WK_Q6_K) {
        /* byte offsets, not the struct: tiles take rows at any alignment */
        const uint8_t *ql = p + offsetof(block_q6_K, ql), *qhp = p + offsetof(block_q6_K, qh);
        const uint8_t *scales = p + offsetof(block_q6_K, scales);
        const float d6 = half_to_float(rd16(p + offsetof(block_q6_K, d)));
        __m256i c[4], e[4];
        for (int k = 0; k < 4; k++) c[k] = _mm256_loadu_si256((const void *)(ql + 32 * k));
        transpose4x8(c, e);
        const __m256i qh0 = _mm256_loadu_si256((const void *)qhp),
                      qh1 = _mm256_loadu_si256((const void *)(qhp + 32));
        /* lane s: ql chunk 2(s/4) + (s&1), nibble (s/2)&1; qh half s/4, bits 2(s%4) */
        const __m256i ql_shift = _mm256_setr_epi32(0, 0, 4, 4, 0, 0, 4, 4);
        const __m256i qh_shift = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
        UNROLL for (int r = 0; r < 4; r++) UNROLL for (int h = 0; h < 2; h++) {
            const int t = r + 4 * h;
            __m256i lo = _mm256_permutevar8x32_epi32(
                e[r], _mm256_add_epi32(_mm256_setr_epi32(0, 1, 0, 1, 2, 3, 2, 3),
                                       _mm256_set1_epi32(4 * h)));
            lo = _mm256_and_si256(_mm256_srlv_epi32(lo, ql_shift), m4);
            const __m256i tv = _mm256_set1_epi32(t);
            __m256i hi = _mm256_blend_epi32(_mm256_permutevar8x32_epi32(qh0, tv),
                                            _mm256_permutevar8x32_epi32(qh1, tv), 0xF0);
            hi = _mm256_and_si256(_mm256_srlv_epi32(hi, qh_shift), _mm256_set1_epi8(3));
            o->q[r][h] = _mm256_or_si256(lo, _mm256_slli_epi32(hi, 4));
        }
        /* lane 8h + s: scales[2s + h] */
        const __m128i sc =
            _mm_shuffle_epi8(_mm_loadu_si128((const void *)scales),
                             _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
        const __m256 d = _mm256_set1_ps(d6);
        o->d[0] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
        o->d[1] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))));
        o->m[0] = o->m[1] = _mm256_setzero_ps();
        return;
    }
    const int five = kind == WK_Q5_K;
    const uint8_t *qs = p + (five ? 48 : 16);
    __m256i c[4], e[4];
    for (int k = 0; k < 4; k++) c[k] = _mm256_loadu_si256((const void *)(qs + 32 * k));
    transpose4x8(c, e);
    const __m256i shift = _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4);
    const __m256i qh = five ? _mm256_loadu_si256((const void *)(p + 16)) : _mm256_setzero_si256();
    const __m256i sbits = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    UNROLL for (int r = 0; r < 4; r++) UNROLL for (int h = 0; h < 2; h++) {
        /* lane s: chunk s/2, dword r + 4h, nibble s%2 */
        __m256i v = _mm256_permutevar8x32_epi32(
            e[r],
            _mm256_add_epi32(_mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), _mm256_set1_epi32(4 * h)));
        v = _mm256_and_si256(_mm256_srlv_epi32(v, shift), m4);
        if (five) {
            __m256i hb = _mm256_permutevar8x32_epi32(qh, _mm256_set1_epi32(r + 4 * h));
            hb = _mm256_and_si256(_mm256_srlv_epi32(hb, sbits), _mm256_set1_epi8(1));
            v = _mm256_or_si256(v, _mm256_slli_epi32(hb, 4));
        }
        o->q[r][h] = v;
    }
    const __m256 d =
        _mm256_mul_ps(_mm256_set1_ps(half_to_float(rd16(p))), k4_scales_mins(p + 4, 0));
    const __m256 m =
        _mm256_mul_ps(_mm256_set1_ps(-half_to_float(rd16(p + 2))), k4_scales_mins(p + 4, 1));
    o->d[0] = o->d[1] = d;
    o->m[0] = o->m[1] = m;
}

typedef struct xk_group {
    const uint8_t *qs;
    __m256 d, s[2];
    __m256i c[2];
} xk_group;

ALWAYS_INLINE void xk_prepare(const uint8_t *blk, xk_group *o) {
    float d;
    memcpy(&d, blk + ACTK_D_OFFSET, 4);
    o->qs = blk;
    o->d = _mm256_set1_ps(d);
    UNROLL for (int h = 0; h < 2; h++) {
        const __m256i s =
            _mm256_cvtepi16_epi32(_mm_loadu_si128((const void *)(blk + ACTK_BSUM_OFFSET + 16 * h)));
        o->s[h] = _mm256_mul_ps(o->d, _mm256_cvtepi32_ps(s));
        o->c[h] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(s, 5));
    }
}

ALWAYS_INLINE void wk_pairs(int kind, const int NX, const wk_group *w, const xk_group *x,
                            __m256 acc[4]) {
    /* codes up to 15 / 31 sum 4 rows in int16, Q6_K's up to 63 two rows */
    const int rows16 = kind == WK_Q6_K ? 2 : 4;
    UNROLL for (int h = 0; h < 2; h++) {
        __m256i isum[4], p16[4];
        UNROLL for (int j = 0; j < NX; j++) isum[j] =
            kind == WK_Q6_K ? x[j].c[h] : _mm256_setzero_si256();
        UNROLL for (int r = 0; r < 4; r++) UNROLL for (int j = 0; j < NX; j++) {
            const __m256i xr = _mm256_loadu_si256((const void *)(x[j].qs + 64 * r + 32 * h));
            const __m256i p = _mm256_maddubs_epi16(w->q[r][h], xr);
            p16[j] = r % rows16 == 0 ? p : _mm256_add_epi16(p16[j], p);
            if (r % rows16 == rows16 - 1) isum[j] = _mm256_add_epi32(isum[j], widen16(p16[j]));
        }
        UNROLL for (int j = 0; j < NX; j++) {
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[j]), _mm256_mul_ps(w->d[h], x[j].d),
                                     acc[j]);
            if (kind != WK_Q6_K) acc[j] = _mm256_fmadd_ps(w->m[h], x[j].s[h], acc[j]);
        }
    }
}

ALWAYS_INLINE int wk_bytes(int kind) { return kind == WK_Q4_K ? 144 : kind == WK_Q5_K ? 176 : 210; }

ALWAYS_INLINE void tile_wk(int kind, const int NW, const int NX, int64_t n, const uint8_t *w,
                           size_t ws, const uint8_t *x, size_t xs, float *out, size_t os) {
    __m256 acc[4][4];
    UNROLL for (int i = 0; i < NW; i++) UNROLL for (int j = 0; j < NX; j++) acc[i][j] =
        _mm256_setzero_ps();
    for (int64_t b = 0; b < n / QK_K; b++) {
        xk_group xg[4];
        UNROLL for (int j = 0; j < NX; j++)
            xk_prepare(x + (size_t)j * xs + ACTK_BLOCK_BYTES * (size_t)b, &xg[j]);
        UNROLL for (int i = 0; i < NW; i++) {
            wk_group wg;
            wk_load(kind, w + (size_t)i * ws + (size_t)wk_bytes(kind) * (size_t)b, &wg);
            wk_pairs(kind, NX, &wg, xg, acc[i]);
        }
    }
    tile_store(NW, NX, acc, out, os);
}

/* ---------------------------------------------------------------- float tile */

enum wf_kind { WF_F32, WF_F16, WF_BF16 };

ALWAYS_INLINE __m256 wf_load8(int kind, const uint8_t *p) {
    if (kind == WF_F32) return _mm256_loadu_ps((const float *)(const void *)p);
    const __m128i h = _mm_loadu_si128((const void *)p);
    if (kind == WF_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

ALWAYS_INLINE float wf_load1(int kind, const uint8_t *p) {
    if (kind == WF_F32) {
        float f;
        memcpy(&f, p, 4);
        return f;
    }
    if (kind == WF_F16) return half_to_float(rd16(p));
    uint32_t b = (uint32_t)rd16(p) << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

ALWAYS_INLINE void tile_wf(int kind, const int NW, const int NX, int64_t n, const uint8_t *w,
                           size_t ws, const uint8_t *x, size_t xs, float *out, size_t os) {
    __m256 acc[4][4];
    UNROLL for (int i = 0; i < NW; i++) UNROLL for (int j = 0; j < NX; j++) acc[i][j] =
        _mm256_setzero_ps();
    const size_t es = kind == WF_F32 ? 4 : 2;
    int64_t e = 0;
    for (; e + 8 <= n; e += 8) {
        __m256 xv[4];
        UNROLL for (int j = 0; j < NX; j++) xv[j] =
            _mm256_loadu_ps((const float *)(const void *)(x + (size_t)j * xs) + e);
        UNROLL for (int i = 0; i < NW; i++) {
            const __m256 wv = wf_load8(kind, w + (size_t)i * ws + es * (size_t)e);
            UNROLL for (int j = 0; j < NX; j++) acc[i][j] = _mm256_fmadd_ps(wv, xv[j], acc[i][j]);
        }
    }
    float tail[4][4] = {{0}};
    for (; e < n; e++)
        for (int i = 0; i < NW; i++)
            for (int j = 0; j < NX; j++)
                tail[i][j] += wf_load1(kind, w + (size_t)i * ws + es * (size_t)e) *
                              wf_load1(WF_F32, x + (size_t)j * xs + 4 * (size_t)e);
    UNROLL for (int i = 0; i < NW; i++) UNROLL for (int j = 0; j < NX; j++)
        out[(size_t)j * os + (size_t)i] = hsum8(acc[i][j]) + tail[i][j];
}

#define QUANT_ISA avx2
#include "kernels/cpu/quant_simd.inc"
