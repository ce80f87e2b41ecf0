/* Internals of the CPU backend: the thread pool and the portable vector helpers its float ops
 * are written with. Not part of the kernels/ contract (that is kernels/backend.h). */
#ifndef KVSERVE_CPU_H
#define KVSERVE_CPU_H

#include <stdatomic.h>
#include <stdint.h>

#include "kernels/backend.h"

/* ---------------------------------------------------------------- thread pool */

/* A fixed set of workers that run one function at a time on every thread, the caller being
 * thread 0. Workers spin briefly between jobs (ops in a decode step last microseconds, too short
 * for a sleep/wake round trip) and then sleep on a condition variable. */
typedef struct threadpool threadpool;
typedef void (*threadpool_fn)(void *ctx, int ith, int nth);

threadpool *threadpool_create(int n_threads, kv_error *err);
void threadpool_destroy(threadpool *tp);
int threadpool_size(const threadpool *tp);
/* Runs fn(ctx, ith, nth) for ith in 0..nth-1 and returns when all have finished. */
void threadpool_run(threadpool *tp, threadpool_fn fn, void *ctx);

/* Splits n items evenly: thread ith takes [*lo, *hi). */
static inline void split_range(int64_t n, int ith, int nth, int64_t *lo, int64_t *hi) {
    int64_t per = n / nth, rem = n % nth;
    *lo = ith * per + (ith < rem ? ith : rem);
    *hi = *lo + per + (ith < rem ? 1 : 0);
}

/* ---------------------------------------------------------------- the backend */

struct backend {
    threadpool *tp;
    int n_threads;
    /* matmul: activations converted to the weight type's activation format */
    void *act_buf;
    size_t act_cap;
    /* attention: per-thread f32 scratch for K and V rows */
    float **attn_scratch;
    size_t attn_scratch_floats;
};

/* Grows b->act_buf to at least n bytes; -1 when out of memory. */
int cpu_act_reserve(backend *b, size_t n);

/* ---------------------------------------------------------------- vectors */

/* GCC vector extensions: one body per op, compiled for AVX-512, AVX2 and baseline x86-64 by the
 * CPU_MULTIVERSION wrappers and dispatched on simd_level_get(). The helpers are always_inline
 * and never cross an ABI boundary, so the -Wpsabi notes about vector arguments do not apply. */
#pragma GCC diagnostic ignored "-Wpsabi"

typedef float v16f __attribute__((vector_size(64), aligned(4)));
typedef int32_t v16i __attribute__((vector_size(64), aligned(4)));
typedef _Float16 v16h __attribute__((vector_size(32), aligned(2)));

#define CPU_INLINE static inline __attribute__((always_inline))
#define CPU_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
#define CPU_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))

CPU_INLINE v16f v16f_load(const float *p) { return *(const v16f *)p; }
CPU_INLINE void v16f_store(float *p, v16f x) { *(v16f *)p = x; }
CPU_INLINE v16f v16f_splat(float x) { return (v16f){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
CPU_INLINE v16f v16f_load_h(const uint16_t *p) {
    return __builtin_convertvector(*(const v16h *)(const void *)p, v16f);
}
CPU_INLINE void v16f_store_h(uint16_t *p, v16f x) {
    *(v16h *)(void *)p = __builtin_convertvector(x, v16h);
}
CPU_INLINE float v16f_sum(v16f x) {
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += x[i];
    return s;
}
CPU_INLINE float v16f_max_lane(v16f x) {
    float m = x[0];
    for (int i = 1; i < 16; i++) m = x[i] > m ? x[i] : m;
    return m;
}
CPU_INLINE v16f v16f_select(v16i mask, v16f a, v16f b) { /* mask ? a : b */
    return (v16f)(((v16i)a & mask) | ((v16i)b & ~mask));
}
CPU_INLINE v16f v16f_max(v16f a, v16f b) { return v16f_select(a > b, a, b); }

/* e^x for x in float range: Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2, then a degree-6
 * Taylor polynomial (relative error < 2e-7) scaled by 2^n built in the exponent bits. Inputs
 * are clamped to [-87.3, 88] so 2^n stays a normal float; below, e^x ~ 1e-38 instead of 0, which
 * no softmax or SiLU can tell apart. */
CPU_INLINE v16f v16f_exp(v16f x) {
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

/* Defines `ret name(params)` that calls name##_body(args) compiled for the best SIMD level. */
#define CPU_MULTIVERSION(ret, name, params, args)                                                \
    CPU_TARGET_AVX512 static ret name##_avx512 params { return name##_body args; }              \
    CPU_TARGET_AVX2 static ret name##_avx2 params { return name##_body args; }                  \
    static ret name##_base params { return name##_body args; }                                   \
    static ret name params {                                                                     \
        switch (simd_level_get()) {                                                              \
        case SIMD_LEVEL_AVX512: return name##_avx512 args;                                       \
        case SIMD_LEVEL_AVX2: return name##_avx2 args;                                           \
        default: return name##_base args;                                                        \
        }                                                                                        \
    }

#endif
