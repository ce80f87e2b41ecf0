/* 16-lane float vectors for the float kernels in float_ops.inc, one implementation per
 * instruction set. Each float_ops_*.c translation unit is compiled for one set (the Makefile's
 * flags), and the type follows it:
 *   AVX-512   one __m512, masks in __mmask16
 *   AVX2      two __m256 (lo: lanes 0-7, hi: 8-15), masks as two all-ones/zero __m256
 *   baseline  GCC vector extensions, lowered to SSE2
 * The kernels use these functions rather than operators on a 64-byte GCC vector: on AVX2, GCC
 * lowers such a vector to 128-bit pieces through the stack, which made attention there several
 * times slower than two 256-bit registers. Every operation rounds as the operator form did:
 * v16f_fma is a fused multiply-add where the unit has FMA (the operator form was contracted to
 * one under -ffp-contract=fast) and a product then a sum in the baseline unit.
 * Helpers are always_inline and never cross an ABI boundary, so the -Wpsabi notes about vector
 * arguments do not apply. */
#ifndef KVSERVE_VEC_H
#define KVSERVE_VEC_H

#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "kernels/quant.h"

#define VEC_INLINE static inline __attribute__((always_inline))

#if defined(__AVX512F__)
/* ---------------------------------------------------------------- AVX-512 */

typedef __m512 v16f;
typedef __mmask16 v16m;

VEC_INLINE v16f v16f_load(const float *p) { return _mm512_loadu_ps(p); }
VEC_INLINE void v16f_store(float *p, v16f x) { _mm512_storeu_ps(p, x); }
VEC_INLINE v16f v16f_splat(float x) { return _mm512_set1_ps(x); }
VEC_INLINE v16f v16f_iota(void) {
    return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
VEC_INLINE v16f v16f_add(v16f a, v16f b) { return _mm512_add_ps(a, b); }
VEC_INLINE v16f v16f_sub(v16f a, v16f b) { return _mm512_sub_ps(a, b); }
VEC_INLINE v16f v16f_mul(v16f a, v16f b) { return _mm512_mul_ps(a, b); }
VEC_INLINE v16f v16f_div(v16f a, v16f b) { return _mm512_div_ps(a, b); }
VEC_INLINE v16f v16f_fma(v16f a, v16f b, v16f c) { return _mm512_fmadd_ps(a, b, c); }
VEC_INLINE v16f v16f_fnma(v16f a, v16f b, v16f c) { return _mm512_fnmadd_ps(a, b, c); }
VEC_INLINE v16m v16f_gt(v16f a, v16f b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
VEC_INLINE v16m v16f_lt(v16f a, v16f b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
VEC_INLINE v16m v16f_eq(v16f a, v16f b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
VEC_INLINE v16f v16f_select(v16m m, v16f a, v16f b) { return _mm512_mask_blend_ps(m, b, a); }
VEC_INLINE v16f v16f_load_h(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)p));
}
VEC_INLINE void v16f_store_h(uint16_t *p, v16f x) {
    _mm256_storeu_si256((__m256i *)(void *)p, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
}
/* 2^n for integral n in [-126, 127], from the exponent bits. */
VEC_INLINE v16f v16f_exp2i(v16f n) {
    __m512i e = _mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127));
    return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
}
VEC_INLINE void v16f_spill(v16f x, float out[16]) { _mm512_storeu_ps(out, x); }

#elif defined(__AVX2__)
/* ---------------------------------------------------------------- AVX2 */

typedef struct v16f {
    __m256 lo, hi;
} v16f;
typedef v16f v16m;

#define V16_MAP2(fn, a, b) ((v16f){fn((a).lo, (b).lo), fn((a).hi, (b).hi)})

VEC_INLINE v16f v16f_load(const float *p) {
    return (v16f){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
}
VEC_INLINE void v16f_store(float *p, v16f x) {
    _mm256_storeu_ps(p, x.lo);
    _mm256_storeu_ps(p + 8, x.hi);
}
VEC_INLINE v16f v16f_splat(float x) { return (v16f){_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
VEC_INLINE v16f v16f_iota(void) {
    return (v16f){_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7),
                  _mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15)};
}
VEC_INLINE v16f v16f_add(v16f a, v16f b) { return V16_MAP2(_mm256_add_ps, a, b); }
VEC_INLINE v16f v16f_sub(v16f a, v16f b) { return V16_MAP2(_mm256_sub_ps, a, b); }
VEC_INLINE v16f v16f_mul(v16f a, v16f b) { return V16_MAP2(_mm256_mul_ps, a, b); }
VEC_INLINE v16f v16f_div(v16f a, v16f b) { return V16_MAP2(_mm256_div_ps, a, b); }
VEC_INLINE v16f v16f_fma(v16f a, v16f b, v16f c) {
    return (v16f){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
VEC_INLINE v16f v16f_fnma(v16f a, v16f b, v16f c) {
    return (v16f){_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
VEC_INLINE v16m v16f_gt(v16f a, v16f b) {
    return (v16m){_mm256_cmp_ps(a.lo, b.lo, _CMP_GT_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_GT_OQ)};
}
VEC_INLINE v16m v16f_lt(v16f a, v16f b) {
    return (v16m){_mm256_cmp_ps(a.lo, b.lo, _CMP_LT_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_LT_OQ)};
}
VEC_INLINE v16m v16f_eq(v16f a, v16f b) {
    return (v16m){_mm256_cmp_ps(a.lo, b.lo, _CMP_EQ_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_EQ_OQ)};
}
VEC_INLINE v16f v16f_select(v16m m, v16f a, v16f b) {
    return (v16f){_mm256_blendv_ps(b.lo, a.lo, m.lo), _mm256_blendv_ps(b.hi, a.hi, m.hi)};
}
VEC_INLINE v16f v16f_load_h(const uint16_t *p) {
    return (v16f){_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)p)),
                  _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(p + 8)))};
}
VEC_INLINE void v16f_store_h(uint16_t *p, v16f x) {
    _mm_storeu_si128((__m128i *)(void *)p, _mm256_cvtps_ph(x.lo, _MM_FROUND_TO_NEAREST_INT));
    _mm_storeu_si128((__m128i *)(void *)(p + 8), _mm256_cvtps_ph(x.hi, _MM_FROUND_TO_NEAREST_INT));
}
VEC_INLINE __m256 v8f_exp2i(__m256 n) {
    __m256i e = _mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}
VEC_INLINE v16f v16f_exp2i(v16f n) { return (v16f){v8f_exp2i(n.lo), v8f_exp2i(n.hi)}; }
VEC_INLINE void v16f_spill(v16f x, float out[16]) { v16f_store(out, x); }

#undef V16_MAP2

#else
/* ---------------------------------------------------------------- baseline (GCC vectors) */

typedef float v16f __attribute__((vector_size(64), aligned(4)));
typedef int32_t v16i __attribute__((vector_size(64), aligned(4)));
typedef v16i v16m;
typedef uint16_t v16u16 __attribute__((vector_size(32), aligned(2)));

VEC_INLINE v16f v16f_load(const float *p) { return *(const v16f *)p; }
VEC_INLINE void v16f_store(float *p, v16f x) { *(v16f *)p = x; }
VEC_INLINE v16f v16f_splat(float x) {
    return (v16f){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
}
VEC_INLINE v16f v16f_iota(void) {
    return (v16f){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
}
VEC_INLINE v16f v16f_add(v16f a, v16f b) { return a + b; }
VEC_INLINE v16f v16f_sub(v16f a, v16f b) { return a - b; }
VEC_INLINE v16f v16f_mul(v16f a, v16f b) { return a * b; }
VEC_INLINE v16f v16f_div(v16f a, v16f b) { return a / b; }
VEC_INLINE v16f v16f_fma(v16f a, v16f b, v16f c) { return a * b + c; }
VEC_INLINE v16f v16f_fnma(v16f a, v16f b, v16f c) { return c - a * b; }
VEC_INLINE v16m v16f_gt(v16f a, v16f b) { return a > b; }
VEC_INLINE v16m v16f_lt(v16f a, v16f b) { return a < b; }
VEC_INLINE v16m v16f_eq(v16f a, v16f b) { return a == b; }
VEC_INLINE v16f v16f_select(v16m mask, v16f a, v16f b) { /* mask ? a : b */
    return (v16f)(((v16i)a & mask) | ((v16i)b & ~mask));
}
/* Exact: shift the exponent and mantissa into place and rescale by 2^112 (which also turns f16
 * subnormals into the right f32 values); inf and NaN keep an all-ones exponent. */
VEC_INLINE v16f v16f_load_h(const uint16_t *p) {
    v16u16 h16 = *(const v16u16 *)(const void *)p;
    v16i h = __builtin_convertvector(h16, v16i);
    v16i mag = (h & 0x7fff) << 13;
    v16f f = (v16f)mag * v16f_splat(0x1p112f);
    v16i special = (h & 0x7c00) == 0x7c00;
    v16i bits = ((v16i)f & ~special) | ((mag | 0x7f800000) & special);
    return (v16f)(bits | ((h & 0x8000) << 16));
}
VEC_INLINE void v16f_store_h(uint16_t *p, v16f x) {
    float tmp[16];
    memcpy(tmp, &x, sizeof tmp);
    fp32_to_fp16_row(tmp, p, 16);
}
VEC_INLINE v16f v16f_exp2i(v16f n) {
    v16i ni = __builtin_convertvector(n, v16i);
    return (v16f)((ni + 127) << 23);
}
VEC_INLINE void v16f_spill(v16f x, float out[16]) { memcpy(out, &x, sizeof x); }

#endif

/* ---------------------------------------------------------------- common */

VEC_INLINE v16f v16f_max(v16f a, v16f b) { return v16f_select(v16f_gt(a, b), a, b); }

/* Lanes summed in order 0..15 (the same result at every level). */
VEC_INLINE float v16f_sum(v16f x) {
    float l[16];
    v16f_spill(x, l);
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += l[i];
    return s;
}

VEC_INLINE float v16f_max_lane(v16f x) {
    float l[16];
    v16f_spill(x, l);
    float m = l[0];
    for (int i = 1; i < 16; i++) m = l[i] > m ? l[i] : m;
    return m;
}

/* e^x for x in float range: Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2, then a degree-6
 * Taylor polynomial (relative error < 2e-7) scaled by 2^n built in the exponent bits. Inputs
 * are clamped to [-87.3, 88] so 2^n stays a normal float; below, e^x ~ 1e-38 instead of 0, which
 * no softmax or SiLU can tell apart. */
VEC_INLINE v16f v16f_exp(v16f x) {
    const v16f lo = v16f_splat(-87.3f), hi = v16f_splat(88.0f);
    x = v16f_select(v16f_lt(x, lo), lo, x);
    x = v16f_select(v16f_gt(x, hi), hi, x);
    const v16f magic = v16f_splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to integer */
    v16f t = v16f_fma(x, v16f_splat(1.44269504088896341f), magic);
    v16f n = v16f_sub(t, magic);
    v16f r = v16f_fnma(n, v16f_splat(0.693145751953125f), x);
    r = v16f_fnma(n, v16f_splat(1.428606765330187e-06f), r);
    v16f p = v16f_splat(1.0f / 720);
    p = v16f_fma(p, r, v16f_splat(1.0f / 120));
    p = v16f_fma(p, r, v16f_splat(1.0f / 24));
    p = v16f_fma(p, r, v16f_splat(1.0f / 6));
    p = v16f_fma(p, r, v16f_splat(0.5f));
    p = v16f_fma(p, r, v16f_splat(1.0f));
    p = v16f_fma(p, r, v16f_splat(1.0f));
    return v16f_mul(p, v16f_exp2i(n));
}

#endif
