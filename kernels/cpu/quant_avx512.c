/* AVX-512 (F/BW/VL/DQ + VNNI) variants of the quantized kernels; compiled with the AVX-512 flags
 * (Makefile) and reached only through the dispatcher in quant.c on CPUs that have them. The row
 * kernels (quant_rows.inc) and the tiles' loops (quant_tile_parts.inc, quant_simd.inc) are
 * written once for both levels against the intrinsics block below; what is AVX-512's own
 * follows it.
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

#define QUANT_ISA avx512
#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 16")

/* ---------------------------------------------------------------- the intrinsics
 * A vector is 16 lanes: vf 16 floats, vi 16 int32s, vh 16 fp16 or bf16 values; an activation
 * group's 16 lanes are V_PARTS = 1 vector. */

#define V_LANES 16
#define V_PARTS 1
typedef __m512 vf;
typedef __m512i vi;
typedef __m256i vh;

ALWAYS_INLINE vf vf_zero(void) { return _mm512_setzero_ps(); }
ALWAYS_INLINE vf vf_set1(float x) { return _mm512_set1_ps(x); }
ALWAYS_INLINE vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
ALWAYS_INLINE void vf_store(float *p, vf v) { _mm512_storeu_ps(p, v); }
ALWAYS_INLINE vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
ALWAYS_INLINE vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
ALWAYS_INLINE vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
ALWAYS_INLINE vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
ALWAYS_INLINE vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); } /* b where either is NaN */
ALWAYS_INLINE vf vf_min(vf a, vf b) { return _mm512_min_ps(a, b); } /* b where either is NaN */
ALWAYS_INLINE vf vf_from_vi(vi v) { return _mm512_cvtepi32_ps(v); }
ALWAYS_INLINE vi vi_round(vf v) { return _mm512_cvtps_epi32(v); } /* MXCSR: nearest even */
/* |v| with NaN as 0 */
ALWAYS_INLINE vf vf_abs_nonan(vf v) {
    const __m512 a = _mm512_castsi512_ps(
        _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7fffffff)));
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), a);
}
ALWAYS_INLINE float vf_hmax(vf v) { return _mm512_reduce_max_ps(v); }

ALWAYS_INLINE vh vh_load(const void *p) { return _mm256_loadu_si256(p); }
ALWAYS_INLINE void vh_store(void *p, vh v) { _mm256_storeu_si256(p, v); }
ALWAYS_INLINE vf vf_from_h(vh v) { return _mm512_cvtph_ps(v); }
ALWAYS_INLINE vh vh_from_f(vf v) { return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT); }
ALWAYS_INLINE vf vf_from_bf16(vh v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
/* The first n < 16 values (the rest 0), masked. */
ALWAYS_INLINE __mmask16 first_n(int n) { return (__mmask16)((1u << n) - 1); }
ALWAYS_INLINE vf vf_load_n(const float *p, int n) { return _mm512_maskz_loadu_ps(first_n(n), p); }
ALWAYS_INLINE void vf_store_n(float *p, vf v, int n) { _mm512_mask_storeu_ps(p, first_n(n), v); }
ALWAYS_INLINE vh vh_load_n(const void *p, int n) { return _mm256_maskz_loadu_epi16(first_n(n), p); }
ALWAYS_INLINE void vh_store_n(void *p, vh v, int n) { _mm256_mask_storeu_epi16(p, first_n(n), v); }

ALWAYS_INLINE vi vi_zero(void) { return _mm512_setzero_si512(); }
ALWAYS_INLINE vi vi_set1(int x) { return _mm512_set1_epi32(x); }
ALWAYS_INLINE vi vi_add(vi a, vi b) { return _mm512_add_epi32(a, b); }
ALWAYS_INLINE vi vi_sub(vi a, vi b) { return _mm512_sub_epi32(a, b); }
ALWAYS_INLINE vi vi_mullo(vi a, vi b) { return _mm512_mullo_epi32(a, b); }
ALWAYS_INLINE vi vi_and(vi a, vi b) { return _mm512_and_si512(a, b); }
ALWAYS_INLINE vi vi_or(vi a, vi b) { return _mm512_or_si512(a, b); }
ALWAYS_INLINE vi vi_xor(vi a, vi b) { return _mm512_xor_si512(a, b); }
ALWAYS_INLINE vi vi_srli(vi v, int n) { return _mm512_srli_epi32(v, (unsigned)n); }
ALWAYS_INLINE vi vi_slli(vi v, int n) { return _mm512_slli_epi32(v, (unsigned)n); }
ALWAYS_INLINE vi vi_srlv(vi v, vi n) { return _mm512_srlv_epi32(v, n); }
ALWAYS_INLINE vi vi_unpacklo32(vi a, vi b) { return _mm512_unpacklo_epi32(a, b); }
ALWAYS_INLINE vi vi_unpackhi32(vi a, vi b) { return _mm512_unpackhi_epi32(a, b); }
ALWAYS_INLINE vi vi_unpacklo64(vi a, vi b) { return _mm512_unpacklo_epi64(a, b); }
ALWAYS_INLINE vi vi_unpackhi64(vi a, vi b) { return _mm512_unpackhi_epi64(a, b); }
ALWAYS_INLINE vi vi_load(const uint8_t *p) { return _mm512_loadu_si512((const void *)p); }
/* 16 bytes at p zero- or sign-extended; 16 int16 sign-extended */
ALWAYS_INLINE vi vi_load_u8(const uint8_t *p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const void *)p));
}
ALWAYS_INLINE vi vi_load_i8(const int8_t *p) {
    return _mm512_cvtepi8_epi32(_mm_loadu_si128((const void *)p));
}
ALWAYS_INLINE vi vi_from_i16(vh v) { return _mm512_cvtepi16_epi32(v); }
/* The 16 bytes of b as int32 (at: 0). */
ALWAYS_INLINE vi vi_widen_u8(__m128i b, int at) {
    (void)at;
    return _mm512_cvtepu8_epi32(b);
}
ALWAYS_INLINE int vi_hsum(vi v) { return _mm512_reduce_add_epi32(v); }
/* v | 16 in each lane k whose bit k of bits is set (Q5's bit 4). */
ALWAYS_INLINE vi vi_or16_where(vi v, uint32_t bits) {
    return _mm512_mask_or_epi32(v, (__mmask16)bits, v, _mm512_set1_epi32(16));
}
/* The g (1, 2, 4, 8) 16-bit values at p repeated across the 16 lanes (vh_repeat), or in lanes
 * 0..g-1 with 0 elsewhere (vh_first). Loads of exactly 2g bytes. */
ALWAYS_INLINE vh vh_repeat(const uint8_t *p, const int g) {
    if (g == 8) return _mm256_broadcastsi128_si256(_mm_loadu_si128((const void *)p));
    if (g == 4) {
        int64_t v;
        memcpy(&v, p, 8);
        return _mm256_set1_epi64x(v);
    }
    if (g == 2) {
        int32_t v;
        memcpy(&v, p, 4);
        return _mm256_set1_epi32(v);
    }
    uint16_t v;
    memcpy(&v, p, 2);
    return _mm256_set1_epi16((short)v);
}
ALWAYS_INLINE vh vh_first(const uint8_t *p, const int g, int h) {
    (void)h; /* one part */
    return _mm256_maskz_loadu_epi16(first_n(g), p);
}
/* The 8 dwords at p as 16 lanes: their low nibbles in lanes 0..7, their high ones in 8..15. */
ALWAYS_INLINE vi vi_nibble_lanes(const uint8_t *p, int h) {
    (void)h; /* one part */
    const __m256i e = _mm256_loadu_si256((const void *)p);
    return _mm512_and_si512(
        _mm512_inserti64x4(_mm512_castsi256_si512(e), _mm256_srli_epi16(e, 4), 1),
        _mm512_set1_epi8(0x0F));
}
/* 32 int32 in -127..127 as int8, in element order. */
ALWAYS_INLINE void vi_pack32_i8(const vi v[2], int8_t *q) {
    _mm_storeu_si128((void *)q, _mm512_cvtsepi32_epi8(v[0]));
    _mm_storeu_si128((void *)(q + 16), _mm512_cvtsepi32_epi8(v[1]));
}

#include "kernels/cpu/quant_rows.inc"

#define W32_Q8_0_SHIFT 7 /* Q8_0's codes are q xor 0x80 = q + 128 */
#include "kernels/cpu/quant_tile_parts.inc"

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

/* Q4_1's full group: 4 blocks = 80 bytes = 20 dwords [dm q0 q1 q2 q3] x 4; two loads and one
 * vpermt2d gather the 16 qs dwords, the dm dwords stay in z[] for the scales. */
ALWAYS_INLINE void w32_load16_q4_1(const uint8_t *p, w32_group *o) {
    const __m512i idx_qs =
        _mm512_setr_epi32(1, 2, 3, 4, 6, 7, 8, 9, 11, 12, 13, 14, 28, 29, 30, 31);
    __m512i z[4], r[4], u[4];
    UNROLL for (int a = 0; a < 4; a++) {
        z[a] = _mm512_loadu_si512((const void *)(p + 80 * a));
        const __m512i z2 = _mm512_loadu_si512((const void *)(p + 80 * a + 16));
        r[a] = _mm512_permutex2var_epi32(z[a], idx_qs, z2);
    }
    transpose4x4_lanes(r, u);
    nibble_rows(u, o->q);
    /* Lane p = 4L + a takes dword 5L of unit a. */
    const __m512i i01 = _mm512_setr_epi32(0, 16, 0, 0, 5, 21, 0, 0, 10, 26, 0, 0, 15, 31, 0, 0);
    const __m512i i23 = _mm512_setr_epi32(0, 0, 0, 16, 0, 0, 5, 21, 0, 0, 10, 26, 0, 0, 15, 31);
    const __m512i dm = _mm512_mask_blend_epi32(0xCCCC, _mm512_permutex2var_epi32(z[0], i01, z[1]),
                                               _mm512_permutex2var_epi32(z[2], i23, z[3]));
    split_dm(dm, &o->d, &o->m);
}

/* Q8_0's full group: per unit a, blocks 4a..4a+3, qs halves h -> rows 4h..4h+3. */
ALWAYS_INLINE void w32_load16_q8_0(const uint8_t *p, w32_group *o) {
    const size_t bs = w32_bytes(W32_Q8_0);
    __m512i r[4], r1[4];
    UNROLL for (int a = 0; a < 4; a++) {
        const uint8_t *b = p + bs * 4 * (size_t)a + 2;
        __m512i w01 = _mm512_castsi256_si512(_mm256_loadu_si256((const void *)b));
        w01 = _mm512_inserti64x4(w01, _mm256_loadu_si256((const void *)(b + bs)), 1);
        __m512i w23 = _mm512_castsi256_si512(_mm256_loadu_si256((const void *)(b + 2 * bs)));
        w23 = _mm512_inserti64x4(w23, _mm256_loadu_si256((const void *)(b + 3 * bs)), 1);
        r[a] = _mm512_shuffle_i64x2(w01, w23, 0x88);
        r1[a] = _mm512_shuffle_i64x2(w01, w23, 0xDD);
    }
    transpose4x4_lanes(r, o->q);
    transpose4x4_lanes(r1, o->q + 4);
    UNROLL for (int t = 0; t < 8; t++) o->q[t] = w32_q8_codes(o->q[t]);
    split_dm(_mm512_i32gather_epi32(sigma_offsets((int)bs, 0), p, 1), &o->d, NULL);
}

/* A full group of 16 blocks at p (one part, h = 0). */
ALWAYS_INLINE void w32_load16(int kind, const uint8_t *p, const int h, w32_group *o) {
    (void)h;
    if (kind == W32_Q4_1) {
        w32_load16_q4_1(p, o);
        return;
    }
    if (kind == W32_Q8_0) {
        w32_load16_q8_0(p, o);
        return;
    }
    /* Q4_0, Q5_0, Q5_1: 16-byte qs loaded four to a register; scales (and qh) gathered. */
    const size_t bs = w32_bytes(kind);
    __m512i r[4], u[4];
    load_4x4_xmm(p, bs, w32_qs_off(kind), r);
    transpose4x4_lanes(r, u);
    nibble_rows(u, o->q);
    const __m512i dm = _mm512_i32gather_epi32(sigma_offsets((int)bs, 0), p, 1);
    split_dm(dm, &o->d, w32_has_min(kind) ? &o->m : NULL);
    if (w32_is_q5(kind))
        q5_high_rows(_mm512_i32gather_epi32(sigma_offsets((int)bs, w32_qh_off(kind)), p, 1), o->q);
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
    if (w32_is_q5(kind))
        qh = _mm512_mask_i32gather_epi32(
            zero, live, _mm512_add_epi32(blk_off, _mm512_set1_epi32(w32_qh_off(kind))), p, 1);
    UNROLL for (int r = 0; r < R; r++) {
        const __m512i t =
            _mm512_add_epi32(_mm512_set1_epi32(r), _mm512_slli_epi32(hi, lg ? lg - 1 : 0));
        __m512i v;
        if (kind == W32_Q8_0) {
            const __m512i off = _mm512_add_epi32(
                blk_off, _mm512_add_epi32(_mm512_slli_epi32(t, 2), _mm512_set1_epi32(2)));
            v = w32_q8_codes(_mm512_mask_i32gather_epi32(zero, live, off, p, 1));
        } else {
            /* dword t & 3 of qs, high nibbles for t >= 4 */
            const __m512i off = _mm512_add_epi32(
                blk_off,
                _mm512_add_epi32(_mm512_slli_epi32(_mm512_and_si512(t, _mm512_set1_epi32(3)), 2),
                                 _mm512_set1_epi32(w32_qs_off(kind))));
            v = _mm512_mask_i32gather_epi32(zero, live, off, p, 1);
            v = _mm512_srlv_epi32(v, _mm512_slli_epi32(_mm512_srli_epi32(t, 2), 2));
            v = _mm512_and_si512(v, _mm512_set1_epi8(0x0F));
            if (w32_is_q5(kind)) v = _mm512_or_si512(v, q5_high_bytes(qh, t));
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
        o->q[0] = w32_q8_codes(_mm512_permutex2var_epi16(z0, qi, z1));
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

/* ---------------------------------------------------------------- act32 dot products */

ALWAYS_INLINE __m512i x32_row(const x32_group *x, int g, int r) {
    if (g == 1) return _mm512_zextsi256_si512(_mm256_loadu_si256((const void *)x->qs));
    return _mm512_loadu_si512((const void *)(x->qs + 64 * r));
}

/* acc[j] += the group's dot products of one weight row with activation rows j < NX, per lane.
 * The vpdpbusd chains of the NX rows are interleaved (5-cycle latency); with one or two rows,
 * each is split into two chains. */
ALWAYS_INLINE void w32_pairs(int kind, const int NX, const w32_group *w, const x32_group *x, int g,
                             const int h, __m512 acc[4]) {
    const int R = act32_rows(g), split = NX <= 2 && R == 8;
    __m512i s0[4], s1[4];
    UNROLL for (int j = 0; j < NX; j++) {
        s0[j] = w32_has_min(kind) ? _mm512_setzero_si512() : x[j].c[h];
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
        acc[j] = w32_scale(kind, isum, w, &x[j], h, acc[j]);
    }
}

/* A remainder group (g < 16) in GGUF's layout, inline: one load per weight row. */
ALWAYS_INLINE void w32_rest(int kind, int g, const int NW, const int NX, const uint8_t *w,
                            size_t ws, const uint8_t *x, size_t xs, __m512 acc[4][4]) {
    x32_group xg[4];
    UNROLL for (int j = 0; j < NX; j++) x32_prepare(kind, x + (size_t)j * xs, g, &xg[j]);
    UNROLL for (int i = 0; i < NW; i++) {
        w32_group wg;
        const uint8_t *wp = w + (size_t)i * ws;
        if (g == 2) { /* g a constant in the products: SmolLM2's n = 576 ends with this group */
            w32_permute_tail2(kind, wp, &wg);
            w32_pairs(kind, NX, &wg, xg, 2, 0, acc[i]);
        } else {
            w32_load_tail(kind, wp, g, &wg);
            w32_pairs(kind, NX, &wg, xg, g, 0, acc[i]);
        }
    }
}

/* ---------------------------------------------------------------- K-quants */

ALWAYS_INLINE void wk_load_q6(const uint8_t *p, wk_group *o) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i s = _mm512_and_si512(lane, _mm512_set1_epi32(7));         /* sub-block of 32 */
    const __m512i half4 = _mm512_slli_epi32(_mm512_srli_epi32(lane, 3), 2); /* 4 * (p / 8) */
    /* byte offsets, not the struct: tiles take rows at any alignment */
    const uint8_t *ql = p + offsetof(block_q6_K, ql), *qhp = p + offsetof(block_q6_K, qh);
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
        lo = _mm512_and_si512(_mm512_srlv_epi32(lo, ql_shift), _mm512_set1_epi8(0x0F));
        __m512i hi = _mm512_permutexvar_epi32(_mm512_add_epi32(qh_base, rr), qh);
        hi = _mm512_and_si512(_mm512_srlv_epi32(hi, qh_shift), _mm512_set1_epi8(3));
        o->q[r][0] = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 4));
    }
    const __m128i sc = q6k_lane_scales(p + offsetof(block_q6_K, scales));
    o->d[0] = _mm512_mul_ps(_mm512_set1_ps(d6), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
    o->m[0] = _mm512_setzero_ps();
}

ALWAYS_INLINE void wk_load(int kind, const uint8_t *p, wk_group *o) {
    if (kind == WK_Q6_K) {
        wk_load_q6(p, o);
        return;
    }
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i s = _mm512_and_si512(lane, _mm512_set1_epi32(7));         /* sub-block of 32 */
    const __m512i half4 = _mm512_slli_epi32(_mm512_srli_epi32(lane, 3), 2); /* 4 * (p / 8) */
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
        v = _mm512_and_si512(_mm512_srlv_epi32(v, shift), _mm512_set1_epi8(0x0F));
        if (five) {
            /* qh dword t, bit s of each byte */
            __m512i h = _mm512_permutexvar_epi32(_mm512_add_epi32(half4, rr), qh);
            h = _mm512_and_si512(_mm512_srlv_epi32(h, s), _mm512_set1_epi8(1));
            v = _mm512_or_si512(v, _mm512_slli_epi32(h, 4));
        }
        o->q[r][0] = v;
    }
    /* [sc0..sc7, m0..m7] as floats */
    uint32_t u[4];
    k4_scales_mins(p + 4, u);
    const __m512 scm = _mm512_cvtepi32_ps(
        _mm512_cvtepu8_epi32(_mm_setr_epi32((int)u[0], (int)u[1], (int)u[2], (int)u[3])));
    const __m512i lo8 = s, hi8 = _mm512_add_epi32(s, _mm512_set1_epi32(8));
    o->d[0] =
        _mm512_mul_ps(_mm512_set1_ps(half_to_float(rd16(p))), _mm512_permutexvar_ps(lo8, scm));
    o->m[0] =
        _mm512_mul_ps(_mm512_set1_ps(-half_to_float(rd16(p + 2))), _mm512_permutexvar_ps(hi8, scm));
}

ALWAYS_INLINE void wk_pairs(int kind, const int NX, const wk_group *w, const xk_group *x,
                            __m512 acc[4]) {
    UNROLL for (int j = 0; j < NX; j++) {
        __m512i isum = x[j].c[0];
        UNROLL for (int r = 0; r < 4; r++) isum = _mm512_dpbusd_epi32(
            isum, w->q[r][0], _mm512_loadu_si512((const void *)(x[j].qs + 64 * r)));
        acc[j] = wk_scale(kind, isum, w, &x[j], 0, acc[j]);
    }
}

/* ---------------------------------------------------------------- float tile */

/* The last n % 16 elements as one masked step, then the lane sums. */
ALWAYS_INLINE void wf_finish(int kind, const int NW, const int NX, int64_t e, int64_t n,
                             const uint8_t *w, size_t ws, const uint8_t *x, size_t xs,
                             __m512 acc[4][4], float *out, size_t os) {
    if (e < n) wf_step(kind, NW, NX, w, ws, x, xs, e, 0, (int)(n - e), acc);
    tile_store(NW, NX, acc, out, os);
}

#include "kernels/cpu/quant_simd.inc"
