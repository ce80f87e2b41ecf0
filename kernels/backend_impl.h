/* The table of ops behind kernels/backend.h: what a backend implements. Only the backends
 * (kernels/cpu/, kernels/cuda/) and the dispatcher (kernels/backend.c) include this header. Each
 * backend's struct begins with a `struct backend` whose ops point at its table; the public
 * backend_* functions call through it (one indirect call per op, none inside an op's loops).
 * Every entry has the signature and meaning of the public function of the same name. */
#ifndef KVSERVE_BACKEND_IMPL_H
#define KVSERVE_BACKEND_IMPL_H

#include "kernels/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct backend_ops {
    /* lifetime */
    void (*destroy)(backend *b);
    const char *(*name)(const backend *b);
    int (*n_threads)(const backend *b);
    void (*set_precision)(backend *b, matmul_precision p);
    int (*reserve)(backend *b, const backend_limits *lim, kv_error *err);

    /* memory */
    void *(*alloc)(backend *b, size_t bytes);
    void (*free)(backend *b, void *p);
    const void *(*weight_data)(backend *b, const void *host, size_t bytes, kv_error *err);
    void (*weight_release)(backend *b, const void *host);
    int (*weight_repack)(backend *b, const weight *host, weight *out,
                         kv_error *err); /* NULL: none */
    int (*upload)(backend *b, void *dst, const void *src, size_t bytes);
    int (*download)(backend *b, void *dst, const void *src, size_t bytes);
    int (*sync)(backend *b);
    void *(*host_alloc)(backend *b, size_t bytes);
    void (*host_free)(backend *b, void *p);
    backend_stream *(*stream_create)(backend *b, kv_error *err);
    void (*stream_destroy)(backend *b, backend_stream *s);
    backend_event *(*event_create)(backend *b, kv_error *err);
    void (*event_destroy)(backend *b, backend_event *e);
    int (*event_record)(backend *b, backend_event *e, backend_stream *s);
    int (*stream_wait)(backend *b, backend_stream *s, backend_event *e);
    int (*event_sync)(backend *b, backend_event *e);

    /* ops */
    int (*matmul_multi)(backend *b, int n_w, const weight *const *w, const float *x, int n_tok,
                        float *const *y);
    int (*embed)(backend *b, const weight *w, const int32_t *ids, int n, float *out);
    int (*gather_rows)(backend *b, float *dst, const float *src, const int32_t *idx, int n,
                       int width);
    int (*rmsnorm)(backend *b, const float *x, const float *gamma, float *y, int n_tok, int dim,
                   float eps);
    int (*rope)(backend *b, float *x, const int32_t *pos, int n_tok, int n_head, int head_dim,
                const rope_table *rope);
    int (*rope_angles)(backend *b, const rope_table *rope, const int32_t *pos, int n_tok,
                       float *cs);
    int (*rope_cs)(backend *b, float *x, const float *cs, const int32_t *idx, int n_tok, int n_head,
                   int head_dim, int n_rot);
    int (*swiglu)(backend *b, const float *gate, const float *up, float *out, int64_t n);
    int (*add)(backend *b, float *y, const float *x, int64_t n);
    int (*softmax)(backend *b, float *x, int n_rows, int n);
    int (*topk)(backend *b, const float *x, int n_rows, int n, int k, float *val, int32_t *idx);

    /* the KV pool */
    void *(*kv_alloc)(backend *b, const kv_layout *l);
    void (*kv_free)(backend *b, void *pool);
    int (*kv_write)(backend *b, void *pool, const kv_layout *l, int layer,
                    const int32_t *block_table, const int32_t *slots, int n_tok, const float *k,
                    const float *v);
    int (*kv_store)(backend *b, void *pool, const kv_layout *l, int layer,
                    const int32_t *block_table, const int32_t *slots, int n_tok, const float *k,
                    const float *v);
    int (*kv_store_serial)(backend *b, void *pool, const kv_layout *l, int layer,
                           const int32_t *block_table, const int32_t *slots, int n_tok,
                           const float *k, const float *v);
    int (*kv_load)(backend *b, const void *pool, const kv_layout *l, int layer, int kv,
                   const int32_t *block_table, const int32_t *slots, int n_tok, float *out);
    int (*kv_rope)(backend *b, void *pool, const kv_layout *l, int layer,
                   const int32_t *block_table, const int32_t *slots, int n_tok, const float *cs,
                   int n_rot);
    int (*kv_copy_block)(backend *b, void *pool, const kv_layout *l, int32_t dst, int32_t src);
    /* queued on s (NULL: the compute stream); wait: returns when the copy is done */
    int (*kv_read_blocks)(backend *b, const void *pool, const kv_layout *l, const int32_t *blocks,
                          int n, void *host, backend_stream *s, bool wait);
    int (*kv_write_blocks)(backend *b, void *pool, const kv_layout *l, const int32_t *blocks, int n,
                           const void *host, backend_stream *s, bool wait);
    int (*kv_read_rows)(backend *b, const void *pool, const kv_layout *l,
                        const int32_t *block_table, int slot, int n, void *host, int host_slot);
    int (*kv_write_rows)(backend *b, void *pool, const kv_layout *l, const int32_t *block_table,
                         int slot, int n, const void *host, int host_slot);
    int (*attention)(backend *b, const void *pool, const kv_layout *l, int layer, int n_head,
                     float scale, const attn_seq *seqs, int n_seqs);

    /* step graphs: NULL where a backend has none (every step then runs directly) */
    void (*set_graphs)(backend *b, bool on);
    bool (*graphs)(const backend *b);
    backend_graph_mode (*graph_begin)(backend *b, const void *owner, const void *key,
                                      size_t key_bytes);
    int (*graph_end)(backend *b);
    void (*graph_forget)(backend *b, const void *owner);
} backend_ops;

struct backend {
    const backend_ops *ops;
    bool host_memory; /* backend memory is host memory */
};

#ifdef __cplusplus
}
#endif

#endif
