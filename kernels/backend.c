/* The public backend functions: each calls the backend's table of ops (kernels/backend_impl.h),
 * and backend_create picks a backend by name. */
#include <string.h>

#include "kernels/backend_impl.h"

/* ---------------------------------------------------------------- choosing a backend */

#ifdef KVSERVE_CUDA
bool backend_cuda_built(void) { return true; }
#else
bool backend_cuda_built(void) { return false; }

backend *backend_cuda_create(kv_error *err) {
    kv_fail(err, "kvserve was built without the CUDA backend (no nvcc at build time)");
    return NULL;
}
#endif

backend *backend_create(const char *device, int n_threads, kv_error *err) {
    if (device && !strcmp(device, "cpu")) return backend_cpu_create(n_threads, err);
    if (device && !strcmp(device, "cuda")) return backend_cuda_create(err);
    if (device && strcmp(device, "auto") != 0) {
        kv_fail(err, "device '%s' is not cuda, cpu or auto", device);
        return NULL;
    }
    kv_error why = {{0}};
    backend *b = backend_cuda_create(&why);
    if (b) return b;
    log_info("no CUDA backend (%s): using the CPU", why.msg);
    return backend_cpu_create(n_threads, err);
}

/* ---------------------------------------------------------------- lifetime */

void backend_destroy(backend *b) {
    if (b) b->ops->destroy(b);
}
const char *backend_name(const backend *b) { return b->ops->name(b); }
int backend_n_threads(const backend *b) { return b->ops->n_threads(b); }
bool backend_host_memory(const backend *b) { return b->host_memory; }
void backend_set_precision(backend *b, matmul_precision p) { b->ops->set_precision(b, p); }
int backend_reserve(backend *b, const backend_limits *lim, kv_error *err) {
    return b->ops->reserve(b, lim, err);
}

/* ---------------------------------------------------------------- memory */

void *backend_alloc(backend *b, size_t bytes) { return b->ops->alloc(b, bytes); }
void backend_free(backend *b, void *p) {
    if (p) b->ops->free(b, p);
}
const void *backend_weight_data(backend *b, const void *host, size_t bytes, kv_error *err) {
    return b->ops->weight_data(b, host, bytes, err);
}
void backend_weight_release(backend *b, const void *host) {
    if (host) b->ops->weight_release(b, host);
}
int backend_weight_repack(backend *b, const weight *host, weight *out, kv_error *err) {
    return b->ops->weight_repack ? b->ops->weight_repack(b, host, out, err) : 0;
}
int backend_upload(backend *b, void *dst, const void *src, size_t bytes) {
    return bytes ? b->ops->upload(b, dst, src, bytes) : 0;
}
int backend_download(backend *b, void *dst, const void *src, size_t bytes) {
    return bytes ? b->ops->download(b, dst, src, bytes) : 0;
}
int backend_sync(backend *b) { return b->ops->sync(b); }
void *backend_host_alloc(backend *b, size_t bytes) { return b->ops->host_alloc(b, bytes); }
void backend_host_free(backend *b, void *p) {
    if (p) b->ops->host_free(b, p);
}
backend_stream *backend_stream_create(backend *b, kv_error *err) {
    return b->ops->stream_create(b, err);
}
void backend_stream_destroy(backend *b, backend_stream *s) {
    if (s) b->ops->stream_destroy(b, s);
}
backend_event *backend_event_create(backend *b, kv_error *err) {
    return b->ops->event_create(b, err);
}
void backend_event_destroy(backend *b, backend_event *e) {
    if (e) b->ops->event_destroy(b, e);
}
int backend_event_record(backend *b, backend_event *e, backend_stream *s) {
    return b->ops->event_record(b, e, s);
}
int backend_stream_wait(backend *b, backend_stream *s, backend_event *e) {
    return b->ops->stream_wait(b, s, e);
}
int backend_event_sync(backend *b, backend_event *e) { return b->ops->event_sync(b, e); }

/* ---------------------------------------------------------------- ops */

int backend_matmul(backend *b, const weight *w, const float *x, int n_tok, float *y) {
    return b->ops->matmul_multi(b, 1, &w, x, n_tok, &y);
}
int backend_matmul_multi(backend *b, int n_w, const weight *const *w, const float *x, int n_tok,
                         float *const *y) {
    return b->ops->matmul_multi(b, n_w, w, x, n_tok, y);
}
int backend_embed(backend *b, const weight *w, const int32_t *ids, int n, float *out) {
    return b->ops->embed(b, w, ids, n, out);
}
int backend_gather_rows(backend *b, float *dst, const float *src, const int32_t *idx, int n,
                        int width) {
    return b->ops->gather_rows(b, dst, src, idx, n, width);
}
int backend_rmsnorm(backend *b, const float *x, const float *gamma, float *y, int n_tok, int dim,
                    float eps) {
    return b->ops->rmsnorm(b, x, gamma, y, n_tok, dim, eps);
}
int backend_rope(backend *b, float *x, const int32_t *pos, int n_tok, int n_head, int head_dim,
                 const rope_table *rope) {
    return b->ops->rope(b, x, pos, n_tok, n_head, head_dim, rope);
}
int backend_rope_angles(backend *b, const rope_table *rope, const int32_t *pos, int n_tok,
                        float *cs) {
    return b->ops->rope_angles(b, rope, pos, n_tok, cs);
}
int backend_rope_cs(backend *b, float *x, const float *cs, const int32_t *idx, int n_tok,
                    int n_head, int head_dim, int n_rot) {
    return b->ops->rope_cs(b, x, cs, idx, n_tok, n_head, head_dim, n_rot);
}
int backend_swiglu(backend *b, const float *gate, const float *up, float *out, int64_t n) {
    return b->ops->swiglu(b, gate, up, out, n);
}
int backend_add(backend *b, float *y, const float *x, int64_t n) { return b->ops->add(b, y, x, n); }
int backend_softmax(backend *b, float *x, int n_rows, int n) {
    return b->ops->softmax(b, x, n_rows, n);
}
int backend_topk(backend *b, const float *x, int n_rows, int n, int k, float *val, int32_t *idx) {
    if (k < 1 || k > n || k > BACKEND_TOPK_MAX) {
        log_error("top-k: k = %d out of range for rows of %d", k, n);
        return -1;
    }
    return b->ops->topk(b, x, n_rows, n, k, val, idx);
}

/* ---------------------------------------------------------------- the KV pool */

void *backend_kv_alloc(backend *b, const kv_layout *l) { return b->ops->kv_alloc(b, l); }
void backend_kv_free(backend *b, void *pool) {
    if (pool) b->ops->kv_free(b, pool);
}
int backend_kv_write(backend *b, void *pool, const kv_layout *l, int layer,
                     const int32_t *block_table, const int32_t *slots, int n_tok, const float *k,
                     const float *v) {
    return b->ops->kv_write(b, pool, l, layer, block_table, slots, n_tok, k, v);
}
int backend_kv_store(backend *b, void *pool, const kv_layout *l, int layer,
                     const int32_t *block_table, const int32_t *slots, int n_tok, const float *k,
                     const float *v) {
    return b->ops->kv_store(b, pool, l, layer, block_table, slots, n_tok, k, v);
}
int backend_kv_store_serial(backend *b, void *pool, const kv_layout *l, int layer,
                            const int32_t *block_table, const int32_t *slots, int n_tok,
                            const float *k, const float *v) {
    return b->ops->kv_store_serial(b, pool, l, layer, block_table, slots, n_tok, k, v);
}
int backend_kv_load(backend *b, const void *pool, const kv_layout *l, int layer, int kv,
                    const int32_t *block_table, const int32_t *slots, int n_tok, float *out) {
    return b->ops->kv_load(b, pool, l, layer, kv, block_table, slots, n_tok, out);
}
int backend_kv_rope(backend *b, void *pool, const kv_layout *l, int layer,
                    const int32_t *block_table, const int32_t *slots, int n_tok, const float *cs,
                    int n_rot) {
    return b->ops->kv_rope(b, pool, l, layer, block_table, slots, n_tok, cs, n_rot);
}
int backend_kv_copy_block(backend *b, void *pool, const kv_layout *l, int32_t dst, int32_t src) {
    return b->ops->kv_copy_block(b, pool, l, dst, src);
}
int backend_kv_read_blocks(backend *b, const void *pool, const kv_layout *l, const int32_t *blocks,
                           int n, void *host) {
    return b->ops->kv_read_blocks(b, pool, l, blocks, n, host, NULL, true);
}
int backend_kv_write_blocks(backend *b, void *pool, const kv_layout *l, const int32_t *blocks,
                            int n, const void *host) {
    return b->ops->kv_write_blocks(b, pool, l, blocks, n, host, NULL, true);
}
int backend_kv_read_blocks_async(backend *b, const void *pool, const kv_layout *l,
                                 const int32_t *blocks, int n, void *host, backend_stream *s) {
    return b->ops->kv_read_blocks(b, pool, l, blocks, n, host, s, false);
}
int backend_kv_write_blocks_async(backend *b, void *pool, const kv_layout *l, const int32_t *blocks,
                                  int n, const void *host, backend_stream *s) {
    return b->ops->kv_write_blocks(b, pool, l, blocks, n, host, s, false);
}
int backend_kv_read_rows(backend *b, const void *pool, const kv_layout *l,
                         const int32_t *block_table, int slot, int n, void *host, int host_slot) {
    return b->ops->kv_read_rows(b, pool, l, block_table, slot, n, host, host_slot);
}
int backend_kv_write_rows(backend *b, void *pool, const kv_layout *l, const int32_t *block_table,
                          int slot, int n, const void *host, int host_slot) {
    return b->ops->kv_write_rows(b, pool, l, block_table, slot, n, host, host_slot);
}
int backend_attention(backend *b, const void *pool, const kv_layout *l, int layer, int n_head,
                      float scale, const attn_seq *seqs, int n_seqs) {
    return b->ops->attention(b, pool, l, layer, n_head, scale, seqs, n_seqs);
}

/* ---------------------------------------------------------------- step graphs */

bool backend_graphs(const backend *b) { return b->ops->graphs && b->ops->graphs(b); }
void backend_set_graphs(backend *b, bool on) {
    if (b->ops->set_graphs) b->ops->set_graphs(b, on);
}
backend_graph_mode backend_graph_begin(backend *b, const void *owner, const void *key,
                                       size_t key_bytes) {
    if (!b->ops->graph_begin || key_bytes > BACKEND_GRAPH_KEY_MAX) return BACKEND_GRAPH_DIRECT;
    return b->ops->graph_begin(b, owner, key, key_bytes);
}
int backend_graph_end(backend *b) { return b->ops->graph_end ? b->ops->graph_end(b) : 0; }
void backend_graph_forget(backend *b, const void *owner) {
    if (b->ops->graph_forget) b->ops->graph_forget(b, owner);
}
