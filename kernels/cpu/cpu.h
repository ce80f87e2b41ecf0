/* Internals of the CPU backend: the thread pool and the portable vector helpers its float ops
 * are written with. Not part of the kernels/ contract (that is kernels/backend.h). */
#ifndef KVSERVE_CPU_H
#define KVSERVE_CPU_H

#include <stdatomic.h>
#include <stdint.h>

#include "kernels/backend_impl.h"

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

typedef struct cpu_backend {
    backend base; /* ops: cpu_backend_ops */
    threadpool *tp;
    int n_threads;
    /* matmul: activations converted to the weight type's activation format */
    void *act_buf;
    size_t act_cap;
    matmul_precision precision;
    /* MATMUL_PRECISION_F32: per-thread f32 copies of the weight rows of one work item */
    float **wdq;
    size_t wdq_floats;
    /* attention: per-thread f32 scratch for K and V rows */
    float **attn_scratch;
    size_t attn_scratch_floats;
} cpu_backend;

static inline cpu_backend *cpu_of(backend *b) { return (cpu_backend *)b; }

/* Grows b->act_buf to at least n bytes; -1 when out of memory. */
int cpu_act_reserve(cpu_backend *b, size_t n);

/* The KV pool's ops (attention.c), entries of cpu_backend_ops (backend_cpu.c). */
void *cpu_kv_alloc(backend *b, const kv_layout *l);
void cpu_kv_free(backend *b, void *pool);
int cpu_kv_write(backend *b, void *pool, const kv_layout *l, int layer, const int32_t *block_table,
                 const int32_t *slots, int n_tok, const float *k, const float *v);
int cpu_kv_store_serial(backend *b, void *pool, const kv_layout *l, int layer,
                        const int32_t *block_table, const int32_t *slots, int n_tok, const float *k,
                        const float *v);
int cpu_kv_load(backend *b, const void *pool, const kv_layout *l, int layer, int kv,
                const int32_t *block_table, const int32_t *slots, int n_tok, float *out);
int cpu_kv_rope(backend *b, void *pool, const kv_layout *l, int layer, const int32_t *block_table,
                const int32_t *slots, int n_tok, const float *cs, int n_rot);
int cpu_kv_copy_block(backend *b, void *pool, const kv_layout *l, int32_t dst, int32_t src);
int cpu_kv_read_blocks(backend *b, const void *pool, const kv_layout *l, const int32_t *blocks,
                       int n, void *host, backend_stream *s, bool wait);
int cpu_kv_write_blocks(backend *b, void *pool, const kv_layout *l, const int32_t *blocks, int n,
                        const void *host, backend_stream *s, bool wait);
int cpu_kv_read_rows(backend *b, const void *pool, const kv_layout *l, const int32_t *block_table,
                     int slot, int n, void *host, int host_slot);
int cpu_kv_write_rows(backend *b, void *pool, const kv_layout *l, const int32_t *block_table,
                      int slot, int n, const void *host, int host_slot);
int cpu_attention(backend *b, const void *pool, const kv_layout *l, int layer, int n_head,
                  float scale, const attn_seq *seqs, int n_seqs);

/* ---------------------------------------------------------------- attention work items */

typedef struct attn_item {
    int seq;
    int kv_head;
    int r0, r1; /* query rows */
    int k0, k1; /* key slots; k0 a multiple of 16 */
    int split;  /* index of the key range, or -1 when the item covers all keys */
} attn_item;

typedef struct attn_job {
    const void *pool;
    const kv_layout *l;
    int layer;
    int n_head;
    float scale;
    const attn_seq *seqs;
    attn_item *items;
    int n_items;
    _Atomic int next;
    float **scratch;
    /* decode splits: per (seq, row, head, split): max, sum, then head_dim weighted V */
    float **partial;
    int *n_splits;
} attn_job;

#define ATTN_ROWS 16 /* query rows per work item (prefill) */
#define ATTN_SPAN 64 /* most slots between the first and last row of a prefill work item */
/* keys per pass of the weighted V sum: the V rows of a pass (32 KiB at head_dim 64) stay in L1
 * while every query group uses them */
#define ATTN_V_CHUNK 256
/* Keys ahead of the one being read whose K and V regions are asked for (float_ops.inc):
 * tg64@4096 on a 2-core AMD EPYC (Zen 4), SmolLM2-135M, 89 -> 126 tok/s; 32 keys 124, 128 120. */
#define ATTN_PREFETCH_KEYS 64
/* The widest head the KV copies stage on the stack (model/llama.c refuses wider heads). */
#define MAX_KV_HEAD_DIM 128

/* ---------------------------------------------------------------- float kernels */

/* The float ops' inner kernels, compiled once per instruction set from one body
 * (float_ops.inc in float_ops_{base,avx2,avx512}.c) and chosen on simd_level_get(). */
typedef struct cpu_float_ops {
    void (*rmsnorm_row)(const float *x, const float *g, float *y, int dim, float eps);
    void (*swiglu_range)(const float *g, const float *u, float *o, int64_t n);
    void (*attn_item)(const attn_job *j, const attn_item *it, float *scratch);
} cpu_float_ops;

extern const cpu_float_ops cpu_float_ops_base;
extern const cpu_float_ops cpu_float_ops_avx2;
extern const cpu_float_ops cpu_float_ops_avx512;

static inline const cpu_float_ops *cpu_float_ops_get(void) {
    switch (simd_level_get()) {
    case SIMD_LEVEL_AVX512:
        return &cpu_float_ops_avx512;
    case SIMD_LEVEL_AVX2:
        return &cpu_float_ops_avx2;
    default:
        return &cpu_float_ops_base;
    }
}

#endif
