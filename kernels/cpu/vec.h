/* Portable 16-lane float vectors (GCC vector extensions) for the float kernels in
 * float_ops.inc. Each float_ops_*.c translation unit is compiled for one instruction set, so the
 * f16 conversions below use vcvtph2ps / vcvtps2ph where the unit's flags allow and an exact
 * integer emulation in the baseline unit. Helpers are always_inline and never cross an ABI
 * boundary, so the -Wpsabi notes about 64-byte vector arguments do not apply. */
#ifndef KVSERVE_VEC_H
#define KVSERVE_VEC_H

#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "kernels/quant.h"

typedef float v16f __attribute__((vector_size(64), aligned(4)));
typedef int32_t v16i __attribute__((vector_size(64), aligned(4)));
typedef uint16_t v16u16 __attribute__((vector_size(32), aligned(2)));

#define VEC_INLINE static inline __attribute__((always_inline))

VEC_INLINE v16f v16f_load(const float *p) { return *(const v16f *)p; }
VEC_INLINE void v16f_store(float *p, v16f x) { *(v16f *)p = x; }
VEC_INLINE v16f v16f_splat(float x) {
    return (v16f){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
}
VEC_INLINE float v16f_sum(v16f x) {
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += x[i];
    return s;
}
VEC_INLINE float v16f_max_lane(v16f x) {
    float m = x[0];
    for (int i = 1; i < 16; i++) m = x[i] > m ? x[i] : m;
    return m;
}
VEC_INLINE v16f v16f_select(v16i mask, v16f a, v16f b) { /* mask ? a : b */
    return (v16f)(((v16i)a & mask) | ((v16i)b & ~mask));
}
VEC_INLINE v16f v16f_max(v16f a, v16f b) { return v16f_select(a > b, a, b); }

/* 16 f16 values to f32. */
VEC_INLINE v16f v16f_load_h(const uint16_t *p) {
    v16f r;
#if defined(__AVX512F__)
    __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)p));
    memcpy(&r, &v, sizeof r);
#elif defined(__F16C__)
    __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)p));
    __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(p + 8)));
    memcpy(&r, &lo, 32);
    memcpy((char *)&r + 32, &hi, 32);
#else
    /* Exact: shift the exponent and mantissa into place and rescale by 2^112 (which also turns
     * f16 subnormals into the right f32 values); inf and NaN keep an all-ones exponent. */
    v16u16 h16 = *(const v16u16 *)(const void *)p;
    v16i h = __builtin_convertvector(h16, v16i);
    v16i mag = (h & 0x7fff) << 13;
    v16f f = (v16f)mag * v16f_splat(0x1p112f);
    v16i special = (h & 0x7c00) == 0x7c00;
    v16i bits = ((v16i)f & ~special) | ((mag | 0x7f800000) & special);
    r = (v16f)(bits | ((h & 0x8000) << 16));
#endif
    return r;
}

/* 16 f32 values to f16, round to nearest even. */
VEC_INLINE void v16f_store_h(uint16_t *p, v16f x) {
#if defined(__AVX512F__)
    __m512 v;
    memcpy(&v, &x, sizeof v);
    _mm256_storeu_si256((__m256i *)(void *)p, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
#else
    float tmp[16];
    memcpy(tmp, &x, sizeof tmp);
    fp32_to_fp16_row(tmp, p, 16);
#endif
}

/* e^x for x in float range: Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2, then a degree-6
 * Taylor polynomial (relative error < 2e-7) scaled by 2^n built in the exponent bits. Inputs
 * are clamped to [-87.3, 88] so 2^n stays a normal float; below, e^x ~ 1e-38 instead of 0, which
 * no softmax or SiLU can tell apart. */
VEC_INLINE v16f v16f_exp(v16f x) {
    const v16f lo = v16f_splat(-87.3f), hi = v16f_splat(88.0f);
    x = v16f_select(x < lo, lo, x);
    x = v16f_select(x > hi, hi, x);
    const v16f magic = v16f_splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to integer */
    v16f t = x * v16f_splat(1.44269504088896341f) + magic;
    v16f n = t - magic;
    v16f r = x - n * v16f_splat(0.693145751953125f) - n * v16f_splat(1.428606765330187e-06f);
    v16f p = v16f_splat(1.0f / 720);
    p = p * r + v16f_splat(1.0f / 120);
    p = p * r + v16f_splat(1.0f / 24);
    p = p * r + v16f_splat(1.0f / 6);
    p = p * r + v16f_splat(0.5f);
    p = p * r + v16f_splat(1.0f);
    p = p * r + v16f_splat(1.0f);
    v16i ni = __builtin_convertvector(n, v16i);
    v16f scale = (v16f)((ni + 127) << 23);
    return p * scale;
}

#endif
