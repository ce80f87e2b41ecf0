/* AVX2 (+ FMA, F16C) variants of the quantized kernels; compiled with the AVX2 flags (Makefile)
 * and reached only through the dispatcher in quant.c on CPUs that have them. The row kernels
 * (quant_rows.inc) and the tiles' loops (quant_tile_parts.inc, quant_simd.inc) are written once
 * for both levels against the intrinsics block below; what is AVX2's own follows it.
 *
 * The dot tiles read the same interleaved activations as the AVX-512 ones (quant_impl.h): the
 * 16 lanes of an activation row are two 8-lane parts here. Weight rows are brought into lane
 * order with loads and in-register transposes (32-element types) or shuffles (K-quants). AVX2
 * has no vpdpbusd: vpmaddubsw multiplies unsigned codes by int8 activations into int16 pairs,
 * which are summed in int16 over as many rows as cannot overflow (|pair| <= 2 * max_code * 127)
 * before one vpmaddwd widens them. Q8_0's codes need 8 bits, so it keeps signed codes and uses
 * the sign trick (|w| times x with w's sign), one row at a time. */
#include <immintrin.h>
#include <string.h>

#include "kernels/cpu/quant_impl.h"

#define QUANT_ISA avx2
#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 16")

/* ---------------------------------------------------------------- the intrinsics
 * A vector is 8 lanes: vf 8 floats, vi 8 int32s, vh 8 fp16 or bf16 values; an activation
 * group's 16 lanes are V_PARTS = 2 vectors. */

#define V_LANES 8
#define V_PARTS 2
typedef __m256 vf;
typedef __m256i vi;
typedef __m128i vh;

ALWAYS_INLINE vf vf_zero(void) { return _mm256_setzero_ps(); }
ALWAYS_INLINE vf vf_set1(float x) { return _mm256_set1_ps(x); }
ALWAYS_INLINE vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
ALWAYS_INLINE void vf_store(float *p, vf v) { _mm256_storeu_ps(p, v); }
ALWAYS_INLINE vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
ALWAYS_INLINE vf vf_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
ALWAYS_INLINE vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
ALWAYS_INLINE vf vf_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
ALWAYS_INLINE vf vf_max(vf a, vf b) { return _mm256_max_ps(a, b); } /* b where either is NaN */
ALWAYS_INLINE vf vf_min(vf a, vf b) { return _mm256_min_ps(a, b); } /* b where either is NaN */
ALWAYS_INLINE vf vf_from_vi(vi v) { return _mm256_cvtepi32_ps(v); }
ALWAYS_INLINE vi vi_round(vf v) { return _mm256_cvtps_epi32(v); } /* MXCSR: nearest even */
/* |v| with NaN as 0 */
ALWAYS_INLINE vf vf_abs_nonan(vf v) {
    const __m256 a = _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)));
    return _mm256_and_ps(a, _mm256_cmp_ps(v, v, _CMP_ORD_Q));
}
ALWAYS_INLINE float vf_hmax(vf v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

ALWAYS_INLINE vh vh_load(const void *p) { return _mm_loadu_si128(p); }
ALWAYS_INLINE void vh_store(void *p, vh v) { _mm_storeu_si128(p, v); }
ALWAYS_INLINE vf vf_from_h(vh v) { return _mm256_cvtph_ps(v); }
ALWAYS_INLINE vh vh_from_f(vf v) { return _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT); }
ALWAYS_INLINE vf vf_from_bf16(vh v) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}
/* The first n < 8 values (the rest 0), through a buffer: AVX2 has no masked 16-bit moves. */
ALWAYS_INLINE vf vf_load_n(const float *p, int n) {
    float b[8] = {0};
    memcpy(b, p, 4 * (size_t)n);
    return vf_load(b);
}
ALWAYS_INLINE void vf_store_n(float *p, vf v, int n) {
    float b[8];
    vf_store(b, v);
    memcpy(p, b, 4 * (size_t)n);
}
ALWAYS_INLINE vh vh_load_n(const void *p, int n) {
    uint16_t b[8] = {0};
    memcpy(b, p, 2 * (size_t)n);
    return vh_load(b);
}
ALWAYS_INLINE void vh_store_n(void *p, vh v, int n) {
    uint16_t b[8];
    vh_store(b, v);
    memcpy(p, b, 2 * (size_t)n);
}

ALWAYS_INLINE vi vi_zero(void) { return _mm256_setzero_si256(); }
ALWAYS_INLINE vi vi_set1(int x) { return _mm256_set1_epi32(x); }
ALWAYS_INLINE vi vi_add(vi a, vi b) { return _mm256_add_epi32(a, b); }
ALWAYS_INLINE vi vi_sub(vi a, vi b) { return _mm256_sub_epi32(a, b); }
ALWAYS_INLINE vi vi_mullo(vi a, vi b) { return _mm256_mullo_epi32(a, b); }
ALWAYS_INLINE vi vi_and(vi a, vi b) { return _mm256_and_si256(a, b); }
ALWAYS_INLINE vi vi_or(vi a, vi b) { return _mm256_or_si256(a, b); }
ALWAYS_INLINE vi vi_xor(vi a, vi b) { return _mm256_xor_si256(a, b); }
ALWAYS_INLINE vi vi_srli(vi v, int n) { return _mm256_srli_epi32(v, n); }
ALWAYS_INLINE vi vi_slli(vi v, int n) { return _mm256_slli_epi32(v, n); }
ALWAYS_INLINE vi vi_srlv(vi v, vi n) { return _mm256_srlv_epi32(v, n); }
ALWAYS_INLINE vi vi_unpacklo32(vi a, vi b) { return _mm256_unpacklo_epi32(a, b); }
ALWAYS_INLINE vi vi_unpackhi32(vi a, vi b) { return _mm256_unpackhi_epi32(a, b); }
ALWAYS_INLINE vi vi_unpacklo64(vi a, vi b) { return _mm256_unpacklo_epi64(a, b); }
ALWAYS_INLINE vi vi_unpackhi64(vi a, vi b) { return _mm256_unpackhi_epi64(a, b); }
ALWAYS_INLINE vi vi_load(const uint8_t *p) { return _mm256_loadu_si256((const void *)p); }
/* 8 bytes at p zero- or sign-extended; 8 int16 sign-extended */
ALWAYS_INLINE vi vi_load_u8(const uint8_t *p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const void *)p));
}
ALWAYS_INLINE vi vi_load_i8(const int8_t *p) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const void *)p));
}
ALWAYS_INLINE vi vi_from_i16(vh v) { return _mm256_cvtepi16_epi32(v); }
/* Bytes at .. at + 7 (at: 0 or 8) of b as int32. */
ALWAYS_INLINE vi vi_widen_u8(__m128i b, int at) {
    return _mm256_cvtepu8_epi32(at ? _mm_srli_si128(b, 8) : b);
}
ALWAYS_INLINE int vi_hsum(vi v) {
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    return _mm_cvtsi128_si32(s4);
}
/* v | 16 in each lane k whose bit k of bits is set (Q5's bit 4). */
ALWAYS_INLINE vi vi_or16_where(vi v, uint32_t bits) {
    const __m256i lane_bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i b = _mm256_and_si256(_mm256_set1_epi32((int)(bits & 0xFF)), lane_bits);
    const __m256i set = _mm256_cmpeq_epi32(b, lane_bits);
    return _mm256_or_si256(v, _mm256_and_si256(set, _mm256_set1_epi32(16)));
}
/* The g (1, 2, 4, 8) 16-bit values at p repeated across the 8 lanes (vh_repeat), or in lanes
 * 0..g-1 of part 0 with 0 elsewhere (vh_first). Loads of exactly 2g bytes. */
ALWAYS_INLINE vh vh_halves(const uint8_t *p, const int g, int repeat) {
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
    uint16_t v;
    memcpy(&v, p, 2);
    return repeat ? _mm_set1_epi16((short)v) : _mm_cvtsi32_si128(v);
}
ALWAYS_INLINE vh vh_repeat(const uint8_t *p, const int g) { return vh_halves(p, g, 1); }
ALWAYS_INLINE vh vh_first(const uint8_t *p, const int g, int h) {
    return h ? _mm_setzero_si128() : vh_halves(p, g, 0);
}
/* Part h of the 8 dwords at p as 16 lanes: their low nibbles (part 0), their high ones (1). */
ALWAYS_INLINE vi vi_nibble_lanes(const uint8_t *p, int h) {
    __m256i e = _mm256_loadu_si256((const void *)p);
    if (h) e = _mm256_srli_epi16(e, 4);
    return _mm256_and_si256(e, _mm256_set1_epi8(0x0F));
}
/* 32 int32 in -127..127 as int8, in element order: the packs interleave 128-bit lanes, the
 * permute restores the order. */
ALWAYS_INLINE void vi_pack32_i8(const vi v[4], int8_t *q) {
    const __m256i p16 =
        _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    _mm256_storeu_si256(
        (void *)q, _mm256_permutevar8x32_epi32(p16, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

#include "kernels/cpu/quant_rows.inc"

#define W32_Q8_0_SHIFT 0 /* Q8_0 keeps its signed codes: the sign trick in w32_pairs */
#include "kernels/cpu/quant_tile_parts.inc"

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

/* ---------------------------------------------------------------- act32 weight loaders */

/* Rows whose int16 pair sums can be added before widening: 2*max_code*127 per row. */
ALWAYS_INLINE int w32_rows16(int kind) { return kind == W32_Q8_0 ? 1 : w32_is_q5(kind) ? 4 : 8; }

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

/* The element dword t of each lane of part h, row r (a remainder group's Q5 bits). */
ALWAYS_INLINE __m256i lane_dword(int g, int h, int r) {
    int v[8];
    for (int k = 0; k < 8; k++) {
        int blk;
        w32_lane(g, 8 * h + k, r, &blk, &v[k]);
    }
    return _mm256_setr_epi32(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]);
}

/* Four two-block loads at `off` of part h of a 16-block group: c[i] holds the 16 bytes of
 * blocks 2h + 4i (low 128 bits) and 2h + 4i + 1 (high 128 bits). */
ALWAYS_INLINE void w32_load16_pairs(int kind, const uint8_t *p, int h, int off, __m256i c[4]) {
    const size_t bb = w32_bytes(kind);
    UNROLL for (int i = 0; i < 4; i++) {
        const uint8_t *b = p + bb * (size_t)(2 * h + 4 * i) + off;
        c[i] = _mm256_loadu2_m128i((const void *)(b + bb), (const void *)b);
    }
}

/* Dwords 0..3 of the 16 bytes at `off` in each of the 8 blocks of part h of a 16-block group,
 * in lane order: e[t] lane k = dword t of block act32_sigma(8h + k). The low 128 bits of a part
 * are blocks 2h, 2h+4, 2h+8, 2h+12 and the high 128 bits blocks 2h+1, 2h+5, ..., so four
 * two-block loads and a 4x4 dword transpose inside each 128-bit half put them there: no
 * gathers (vpgatherdd costs 8 to 20 cycles on the AMD and older Intel cores AVX2 runs on). */
ALWAYS_INLINE void w32_transpose16(int kind, const uint8_t *p, int h, int off, __m256i e[4]) {
    __m256i c[4];
    w32_load16_pairs(kind, p, h, off, c);
    transpose4x4_lanes(c, e);
}

/* Part h of a 16-block group's code rows (row r: elements 4r..4r+3 of each lane's block). */
ALWAYS_INLINE void w32_rows_full(int kind, const uint8_t *p, int h, __m256i qh, w32_group *o) {
    __m256i e[4];
    if (kind == W32_Q8_0) {
        /* rows 0..3 from qs[0..15], rows 4..7 from qs[16..31] */
        UNROLL for (int half = 0; half < 2; half++) {
            w32_transpose16(kind, p, h, 2 + 16 * half, e);
            UNROLL for (int t = 0; t < 4; t++) o->q[t + 4 * half] = e[t];
        }
        return;
    }
    /* row t < 4: low nibbles of qs dword t; row t + 4: its high nibbles */
    w32_transpose16(kind, p, h, w32_qs_off(kind), e);
    nibble_rows(e, o->q);
    if (w32_is_q5(kind)) UNROLL for (int r = 0; r < 8; r++) {
            /* bits 4r..4r+3 of qh, one per byte */
            const __m256i h4 = vi_and(vi_srli(qh, 4 * r), vi_set1(0xF));
            o->q[r] = vi_or(o->q[r], q5_nibble_bytes(h4));
        }
}

/* The 16 bytes of block b whose dwords are elements 4t..4t+3 for t in [4s, 4s + 4): Q8_0's
 * codes 16s..16s+15; the 4-bit types' qs, whose nibble s they are (w32_codes takes it). */
ALWAYS_INLINE __m128i w32_src(int kind, const uint8_t *p, int b, int s) {
    const int off = kind == W32_Q8_0 ? 2 + 16 * s : w32_qs_off(kind);
    return _mm_loadu_si128((const void *)(p + w32_bytes(kind) * (size_t)b + off));
}

/* Stores row r from dwords v whose lanes in the 128-bit half j hold nibble s_j (4-bit types)
 * or the codes themselves (Q8_0's signed codes). */
ALWAYS_INLINE void w32_codes(int kind, __m256i v, int s0, int s1, int r, w32_group *o) {
    if (kind == W32_Q8_0) {
        o->q[r] = v;
        return;
    }
    v = _mm256_srlv_epi32(
        v, _mm256_setr_epi32(4 * s0, 4 * s0, 4 * s0, 4 * s0, 4 * s1, 4 * s1, 4 * s1, 4 * s1));
    o->q[r] = _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
}

/* Part h of a remainder group's code rows (g < 16; lanes as w32_lane says), from loads and
 * in-register transposes. Every lane of part h takes t in [4h, 4h + 4), except for g = 1,
 * whose one part spans t = 0..7. */
ALWAYS_INLINE void w32_rows_part(int kind, const uint8_t *p, const int g, int h, w32_group *o) {
    if (g == 1) { /* lane k: element dword k of the block */
        w32_codes(kind,
                  _mm256_set_m128i(w32_src(kind, p, 0, kind == W32_Q8_0), w32_src(kind, p, 0, 0)),
                  0, 1, 0, o);
        return;
    }
    if (g == 2) { /* lane k: dword 4h + k/2 of block k % 2 */
        const __m128i x0 = w32_src(kind, p, 0, h), x1 = w32_src(kind, p, 1, h);
        w32_codes(kind, _mm256_set_m128i(_mm_unpackhi_epi32(x0, x1), _mm_unpacklo_epi32(x0, x1)), h,
                  h, 0, o);
        return;
    }
    if (g == 4) { /* row r, lane k: dword 4h + r + 2(k/4) of block k % 4 */
        const __m128i x0 = w32_src(kind, p, 0, h), x1 = w32_src(kind, p, 1, h);
        const __m128i x2 = w32_src(kind, p, 2, h), x3 = w32_src(kind, p, 3, h);
        const __m128i t0 = _mm_unpacklo_epi32(x0, x1), t1 = _mm_unpackhi_epi32(x0, x1);
        const __m128i t2 = _mm_unpacklo_epi32(x2, x3), t3 = _mm_unpackhi_epi32(x2, x3);
        const __m128i f0 = _mm_unpacklo_epi64(t0, t2), f1 = _mm_unpackhi_epi64(t0, t2);
        const __m128i f2 = _mm_unpacklo_epi64(t1, t3), f3 = _mm_unpackhi_epi64(t1, t3);
        w32_codes(kind, _mm256_set_m128i(f2, f0), h, h, 0, o);
        w32_codes(kind, _mm256_set_m128i(f3, f1), h, h, 1, o);
        return;
    }
    /* g = 8: row r, lane k: dword 4h + r of block k */
    __m256i c[4], e[4];
    UNROLL for (int i = 0; i < 4; i++) c[i] =
        _mm256_set_m128i(w32_src(kind, p, i + 4, h), w32_src(kind, p, i, h));
    transpose4x4_lanes(c, e);
    UNROLL for (int r = 0; r < 4; r++) w32_codes(kind, e[r], h, h, r, o);
}

/* The 4 bytes at `off` of each lane's block in part h (lanes as w32_lane says): for a full group
 * the first dword of w32_transpose16's rows (16-byte loads, at most 20 bytes into a block); a
 * remainder group's lanes repeat its g blocks (lane k: block k % g), so g loads make them. */
ALWAYS_INLINE __m256i w32_block_dwords(int kind, const uint8_t *p, const int g, int h, int off) {
    if (g == 16) { /* dword 0 of w32_transpose16's rows; vpgatherdd here stalled the loop */
        __m256i c[4];
        w32_load16_pairs(kind, p, h, off, c);
        return _mm256_unpacklo_epi64(_mm256_unpacklo_epi32(c[0], c[1]),
                                     _mm256_unpacklo_epi32(c[2], c[3]));
    }
    /* in registers: a wide load of narrower stores would stall on store forwarding */
    uint32_t v[8] = {0};
    for (int k = 0; k < g && k < 8; k++) memcpy(&v[k], p + w32_bytes(kind) * k + off, 4);
    if (g == 1) return _mm256_set1_epi32((int)v[0]);
    if (g == 2) return _mm256_set1_epi64x((long long)((uint64_t)v[1] << 32 | v[0]));
    if (g == 4)
        return _mm256_broadcastsi128_si256(
            _mm_setr_epi32((int)v[0], (int)v[1], (int)v[2], (int)v[3]));
    return _mm256_setr_epi32((int)v[0], (int)v[1], (int)v[2], (int)v[3], (int)v[4], (int)v[5],
                             (int)v[6], (int)v[7]);
}

/* fp16 pairs as floats: the low 16 bits of each dword (d), or the high 16 bits (m). */
ALWAYS_INLINE __m256 w32_halves_ps(__m256i dm, int high) {
    const __m256i v = high ? _mm256_srli_epi32(dm, 16) : _mm256_and_si256(dm, vi_set1(0xFFFF));
    return vf_from_h(_mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
}

/* Part h of one weight row's group in GGUF's layout (a group has g == 1 ? 1 : 2 parts). A part
 * at a time: a whole group's codes take all 16 ymm registers, and the spills cost more than the
 * loads. */
ALWAYS_INLINE void w32_load(int kind, const uint8_t *p, const int g, const int h, w32_group *o) {
    const int R = act32_rows(g);
    const __m256i dm = w32_block_dwords(kind, p, g, h, 0);
    o->d = w32_halves_ps(dm, 0);
    if (w32_has_min(kind)) o->m = w32_halves_ps(dm, 1);
    __m256i qh = _mm256_setzero_si256();
    if (w32_is_q5(kind)) qh = w32_block_dwords(kind, p, g, h, w32_qh_off(kind));
    if (g == 16) {
        w32_rows_full(kind, p, h, qh, o);
        return;
    }
    w32_rows_part(kind, p, g, h, o);
    if (w32_is_q5(kind)) UNROLL for (int r = 0; r < 8; r++) {
            if (r >= R) break;
            o->q[r] = vi_or(o->q[r], q5_high_bytes(qh, lane_dword(g, h, r)));
        }
}

/* Part h of a group of 16 blocks in GGUF's layout. */
ALWAYS_INLINE void w32_load16(int kind, const uint8_t *p, const int h, w32_group *o) {
    w32_load(kind, p, 16, h, o);
}

/* ---------------------------------------------------------------- act32 dot products */

ALWAYS_INLINE __m256i x32_row(const x32_group *x, int g, int r, int h) {
    return _mm256_loadu_si256((const void *)(x->qs + (g == 1 ? 0 : 64 * r) + 32 * h));
}

/* Part h of a group: acc[j] += weight row . activation row j. */
ALWAYS_INLINE void w32_pairs(int kind, const int NX, const w32_group *w, const x32_group *x,
                             const int g, const int h, __m256 acc[4]) {
    const int R = act32_rows(g), rows16 = w32_rows16(kind);
    __m256i isum[4], p16[4];
    UNROLL for (int j = 0; j < NX; j++) isum[j] =
        w32_offset_shift(kind) ? x[j].c[h] : _mm256_setzero_si256();
    UNROLL for (int r = 0; r < 8; r++) {
        if (r >= R) break;
        const __m256i wq = kind == W32_Q8_0 ? _mm256_abs_epi8(w->q[r]) : w->q[r];
        UNROLL for (int j = 0; j < NX; j++) {
            __m256i xr = x32_row(&x[j], g, r, h);
            if (kind == W32_Q8_0) xr = _mm256_sign_epi8(xr, w->q[r]);
            const __m256i p = _mm256_maddubs_epi16(wq, xr);
            p16[j] = r % rows16 == 0 ? p : _mm256_add_epi16(p16[j], p);
            if (r % rows16 == rows16 - 1 || r == R - 1)
                isum[j] = _mm256_add_epi32(isum[j], widen16(p16[j]));
        }
    }
    UNROLL for (int j = 0; j < NX; j++) acc[j] = w32_scale(kind, isum[j], w, &x[j], h, acc[j]);
}

/* A remainder group (g < 16) in GGUF's layout: out of line, once per type, with nw and nx as
 * loop bounds. Each activation row's group is prepared once for all the weight rows. */
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

ALWAYS_INLINE void w32_rest(int kind, int g, const int NW, const int NX, const uint8_t *w,
                            size_t ws, const uint8_t *x, size_t xs, __m256 acc[4][4]) {
    switch (kind) {
    case W32_Q4_0:
        w32_tail_q4_0(g, NW, NX, w, ws, x, xs, acc);
        break;
    case W32_Q4_1:
        w32_tail_q4_1(g, NW, NX, w, ws, x, xs, acc);
        break;
    case W32_Q5_0:
        w32_tail_q5_0(g, NW, NX, w, ws, x, xs, acc);
        break;
    case W32_Q5_1:
        w32_tail_q5_1(g, NW, NX, w, ws, x, xs, acc);
        break;
    default:
        w32_tail_q8_0(g, NW, NX, w, ws, x, xs, acc);
        break;
    }
}

/* ---------------------------------------------------------------- K-quants */

/* Q4_K/Q5_K's 8 sub-block scales (mins = 0) or mins (1) as floats. */
ALWAYS_INLINE __m256 k4_scales_ps(const uint8_t *scales, int mins) {
    uint32_t u[4];
    k4_scales_mins(scales, u);
    const __m128i v = mins ? _mm_setr_epi32((int)u[2], (int)u[3], 0, 0)
                           : _mm_setr_epi32((int)u[0], (int)u[1], 0, 0);
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
}

ALWAYS_INLINE void wk_load_q6(const uint8_t *p, wk_group *o) {
    /* byte offsets, not the struct: tiles take rows at any alignment */
    const uint8_t *ql = p + offsetof(block_q6_K, ql), *qhp = p + offsetof(block_q6_K, qh);
    const float d6 = half_to_float(rd16(p + offsetof(block_q6_K, d)));
    __m256i c[4], e[4];
    for (int k = 0; k < 4; k++) c[k] = _mm256_loadu_si256((const void *)(ql + 32 * k));
    transpose4x4_lanes(c, e);
    const __m256i qh0 = _mm256_loadu_si256((const void *)qhp),
                  qh1 = _mm256_loadu_si256((const void *)(qhp + 32));
    /* lane s: ql chunk 2(s/4) + (s&1), nibble (s/2)&1; qh half s/4, bits 2(s%4) */
    const __m256i ql_shift = _mm256_setr_epi32(0, 0, 4, 4, 0, 0, 4, 4);
    const __m256i qh_shift = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    UNROLL for (int r = 0; r < 4; r++) UNROLL for (int h = 0; h < 2; h++) {
        const int t = r + 4 * h;
        __m256i lo = _mm256_permutevar8x32_epi32(
            e[r],
            _mm256_add_epi32(_mm256_setr_epi32(0, 1, 0, 1, 2, 3, 2, 3), _mm256_set1_epi32(4 * h)));
        lo = _mm256_and_si256(_mm256_srlv_epi32(lo, ql_shift), m4);
        const __m256i tv = _mm256_set1_epi32(t);
        __m256i hi = _mm256_blend_epi32(_mm256_permutevar8x32_epi32(qh0, tv),
                                        _mm256_permutevar8x32_epi32(qh1, tv), 0xF0);
        hi = _mm256_and_si256(_mm256_srlv_epi32(hi, qh_shift), _mm256_set1_epi8(3));
        o->q[r][h] = _mm256_or_si256(lo, _mm256_slli_epi32(hi, 4));
    }
    const __m128i sc = q6k_lane_scales(p + offsetof(block_q6_K, scales));
    const __m256 d = _mm256_set1_ps(d6);
    o->d[0] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
    o->d[1] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))));
    o->m[0] = o->m[1] = _mm256_setzero_ps();
}

ALWAYS_INLINE void wk_load(int kind, const uint8_t *p, wk_group *o) {
    if (kind == WK_Q6_K) {
        wk_load_q6(p, o);
        return;
    }
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const int five = kind == WK_Q5_K;
    const uint8_t *qs = p + (five ? 48 : 16);
    __m256i c[4], e[4];
    for (int k = 0; k < 4; k++) c[k] = _mm256_loadu_si256((const void *)(qs + 32 * k));
    transpose4x4_lanes(c, e);
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
    const __m256 d = _mm256_mul_ps(_mm256_set1_ps(half_to_float(rd16(p))), k4_scales_ps(p + 4, 0));
    const __m256 m =
        _mm256_mul_ps(_mm256_set1_ps(-half_to_float(rd16(p + 2))), k4_scales_ps(p + 4, 1));
    o->d[0] = o->d[1] = d;
    o->m[0] = o->m[1] = m;
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
        UNROLL for (int j = 0; j < NX; j++) acc[j] = wk_scale(kind, isum[j], w, &x[j], h, acc[j]);
    }
}

/* ---------------------------------------------------------------- float tile */

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

/* The last n % 8 elements in scalar sums, added to the lane sums. */
ALWAYS_INLINE void wf_finish(int kind, const int NW, const int NX, int64_t e, int64_t n,
                             const uint8_t *w, size_t ws, const uint8_t *x, size_t xs,
                             __m256 acc[4][4], float *out, size_t os) {
    const size_t es = kind == WF_F32 ? 4 : 2;
    float tail[4][4] = {{0}};
    for (; e < n; e++)
        for (int i = 0; i < NW; i++)
            for (int j = 0; j < NX; j++)
                tail[i][j] += wf_load1(kind, w + (size_t)i * ws + es * (size_t)e) *
                              wf_load1(WF_F32, x + (size_t)j * xs + 4 * (size_t)e);
    UNROLL for (int i = 0; i < NW; i++) UNROLL for (int j = 0; j < NX; j++)
        out[(size_t)j * os + (size_t)i] = hsum8(acc[i][j]) + tail[i][j];
}

#include "kernels/cpu/quant_simd.inc"
