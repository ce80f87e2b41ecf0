/* The compute backend: the ops the forward pass is made of, behind one C interface. Backends are
 * chosen at run time (DESIGN.md, "Backends are chosen at run time"): each is a table of ops
 * (kernels/backend_impl.h) behind the functions below, so the CPU backend (kernels/cpu/, the
 * reference) and the CUDA backend (kernels/cuda/) live in one binary and tests run both on the
 * same input.
 *
 * Memory. Every pointer an op reads or writes is backend memory (backend_alloc: device memory on
 * CUDA, host memory on the CPU; weights through backend_weight_data) unless its comment says host.
 * Structs passed by pointer (weight, kv_layout, rope_table, attn_seq arrays) are host memory read
 * before the call returns; the data they point to is backend memory. backend_upload and
 * backend_download move bytes between the two.
 *
 * Order. Ops run in call order on the backend's compute stream. On the CPU an op has finished when
 * it returns; on CUDA it has been queued, and its results reach the host through backend_download
 * (which waits for everything queued before it) or after backend_sync. Other streams (copies that
 * overlap compute) are ordered against the compute stream with events.
 *
 * Errors. Ops return 0, or -1 when the backend fails (out of reserved scratch, a CUDA error: both
 * logged); outputs are then undefined. Scratch is reserved up front (backend_reserve, called when a
 * forward context is created): no op allocates backend memory.
 *
 * Inputs are trusted here: model/ validates shapes when it loads a file, and ranges (token ids,
 * positions, slots) where they enter. */
#ifndef KVSERVE_BACKEND_H
#define KVSERVE_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/quant.h"
#include "kernels/rope.h"
#include "util/util.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Helpers below are also compiled into CUDA device code (kernels/cuda/). */
#if defined(__CUDACC__)
#define BACKEND_INLINE __host__ __device__ static inline
#else
#define BACKEND_INLINE static inline
#endif

typedef struct backend backend;

/* A weight matrix W where the backend reads it (the mmapped GGUF on the CPU, a device copy on
 * CUDA: backend_weight_data): n_out rows of n_in elements of `type`, row i at
 * data + i * row_bytes. */
typedef struct weight {
    tensor_type type;
    int64_t n_in;
    int64_t n_out;
    size_t row_bytes;
    const void *data;
} weight;

/* ---------------------------------------------------------------- the KV pool's layout */

/* The paged KV pool's memory layout. The pool is n_blocks blocks; a block holds block_tokens
 * (a multiple of 16) token slots for every layer:
 *   block: [n_layer][2 (K, V)][n_kv_head] regions of block_tokens * head_dim f16
 *   K region: [head_dim][block_tokens] (transposed: one vector load gives a dim of 16 keys)
 *   V region: [block_tokens][head_dim]
 * K is stored rotated (RoPE applied at the token's position). Cache records hold whole blocks in
 * this layout (their level 0, cache/store/record.h). The helpers below are the only definition of
 * it: the CPU backend and the CUDA kernels both use them. */
typedef struct kv_layout {
    int n_layer;
    int n_kv_head;
    int head_dim;
    int block_tokens;
    int64_t n_blocks;
} kv_layout;

/* Bytes of one block. */
BACKEND_INLINE size_t kv_layout_block_bytes(const kv_layout *l) {
    return (size_t)l->n_layer * 2 * l->n_kv_head * l->block_tokens * l->head_dim * 2;
}
/* The offset of the region (layer, kv = 0 K / 1 V, head) inside a block. */
BACKEND_INLINE size_t kv_layout_offset(const kv_layout *l, int layer, int kv, int head) {
    return ((((size_t)layer * 2 + kv) * l->n_kv_head + head) * l->block_tokens) * l->head_dim * 2;
}
/* The f16 region (layer, kv, head) of the block holding a sequence's slot. */
BACKEND_INLINE uint16_t *kv_layout_region(const void *pool, const kv_layout *l, int layer, int kv,
                                          int head, const int32_t *block_table, int32_t slot) {
    int32_t blk = block_table[slot / l->block_tokens];
    return (uint16_t *)((uint8_t *)pool + (size_t)blk * kv_layout_block_bytes(l) +
                        kv_layout_offset(l, layer, kv, head));
}

/* One sequence's part of an attention call. Query row r sits at KV slot q_slot[r] and attends
 * to slots 0..q_slot[r] (causal by slot, not by position value, so positions may be
 * discontinuous). Slots map to pool blocks by block_table[slot / block_tokens]. The pointers are
 * backend memory; n_kv and n_q are the host's. */
typedef struct attn_seq {
    const int32_t *block_table; /* [ceil(n_kv / block_tokens)] block ids */
    int n_kv;                   /* slots of the sequence that hold KV (>= max q_slot + 1) */
    int n_q;                    /* query rows */
    const int32_t *q_slot;      /* [n_q] */
    const float *q;             /* [n_q][n_head][head_dim] f32, rotated */
    float *out;                 /* [n_q][n_head][head_dim] f32 */
    bool
        split_keys; /* a decode step: keys may be split across threads (another summation
                       order; rows that are not split are the same whatever else is in the batch) */
} attn_seq;

/* ---------------------------------------------------------------- lifetime */

backend *backend_cpu_create(int n_threads, kv_error *err);
/* The CUDA backend on device 0 (kernels/cuda/); NULL with err when kvserve was built without
 * nvcc, no device is present or cuBLAS cannot be loaded. */
backend *backend_cuda_create(kv_error *err);
/* The CUDA backend's kernels run by the CPU emulator (kernels/cuda/emu.h): in the test programs
 * only (build/libkvserve_emu.a), to compare every kernel with the CPU backend without a GPU. */
backend *backend_cuda_emu_create(kv_error *err);
/* By name: "cpu", "cuda", or "auto"/NULL (CUDA when a device is present, else the CPU with a log
 * line saying why). n_threads is the CPU backend's. */
backend *backend_create(const char *device, int n_threads, kv_error *err);
/* Whether this build has the CUDA backend (nvcc was found). */
bool backend_cuda_built(void);

void backend_destroy(backend *b);
const char *backend_name(const backend *b);
int backend_n_threads(const backend *b);
/* True when backend memory is host memory (the CPU backend): callers may skip staging copies. */
bool backend_host_memory(const backend *b);

/* How matmuls treat activations. Q8 (the default) converts them to 8-bit blocks of 32 as ggml's
 * Q8_0/Q8_1/Q8_K formats do and multiplies in integers: fast, and about 0.2 logits from an exact
 * computation on a small model, like llama.cpp. F32 dequantizes weight rows to f32 and keeps
 * activations f32: 2-4x slower, float-accurate (for evaluation and for checking an engine). The
 * CUDA backend: Q8 runs matmuls on quantized weights in int8 (the CPU's codes; dot products up
 * to 8 rows, tensor-core tiles beyond), F32 keeps their activations f32 (GEMV, up to 4 rows) or
 * runs f16 tensor-core GEMMs; float weights take the f32 GEMV or the f16 GEMMs at either. */
typedef enum matmul_precision {
    MATMUL_PRECISION_Q8 = 0,
    MATMUL_PRECISION_F32 = 1,
} matmul_precision;

void backend_set_precision(backend *b, matmul_precision p);

/* The largest op a caller will issue: the backend reserves its scratch for it (the CUDA
 * backend's f16 GEMM tiles and attention partials). Reservations only grow. */
typedef struct backend_limits {
    int max_tokens;   /* rows of a matmul, attention query rows over all sequences */
    int max_seqs;     /* sequences of an attention call */
    int64_t max_n_in; /* widest matmul input */
    int n_head;       /* attention heads */
    int head_dim;
} backend_limits;

int backend_reserve(backend *b, const backend_limits *lim, kv_error *err);

/* ---------------------------------------------------------------- memory */

/* Backend memory, 64-byte aligned, uninitialised; NULL when out of memory. */
void *backend_alloc(backend *b, size_t bytes);
void backend_free(backend *b, void *p);

/* The backend's copy of constant host data (weights, norms, RoPE frequencies): made on the first
 * request for a host range, shared by every later request for it (a model's weights are uploaded
 * once however many forward contexts use them), freed when each request has been released (the
 * host memory may then go: a freed model's address can come back holding another). The CPU
 * backend returns host itself (the mmapped file). NULL with err when out of memory. */
const void *backend_weight_data(backend *b, const void *host, size_t bytes, kv_error *err);
void backend_weight_release(backend *b, const void *host);
/* A copy of a host weight in the layout this backend's matmul reads fastest, where it has one:
 * the CPU backend repacks Q4_0, Q4_1 and Q8_0 into its dot tiles' lane order (kernels/quant.h;
 * the same products bit for bit, for less work per weight). 1: *out is the copy, its data
 * backend memory the caller frees with backend_free; 0: no such layout (use backend_weight_data);
 * -1 with err when out of memory. */
int backend_weight_repack(backend *b, const weight *host, weight *out, kv_error *err);

/* host -> backend memory, queued on the compute stream; src (host) may be reused on return. */
int backend_upload(backend *b, void *dst, const void *src, size_t bytes);
/* backend -> host memory, after every op queued before it; returns when dst (host) holds it. */
int backend_download(backend *b, void *dst, const void *src, size_t bytes);
/* Waits for everything queued on every stream. */
int backend_sync(backend *b);

/* Host memory the device copies from and to asynchronously (page-locked on CUDA). */
void *backend_host_alloc(backend *b, size_t bytes);
void backend_host_free(backend *b, void *p);

/* Streams and events: work queued on one stream runs in order; an event marks a point of a
 * stream that another stream (backend_stream_wait) or the host (backend_event_sync) waits for.
 * A NULL stream is the compute stream. On the CPU everything has run when queued: these are
 * no-ops. */
typedef struct backend_stream backend_stream;
typedef struct backend_event backend_event;

backend_stream *backend_stream_create(backend *b, kv_error *err);
void backend_stream_destroy(backend *b, backend_stream *s);
backend_event *backend_event_create(backend *b, kv_error *err);
void backend_event_destroy(backend *b, backend_event *e);
int backend_event_record(backend *b, backend_event *e, backend_stream *s);
int backend_stream_wait(backend *b, backend_stream *s, backend_event *e);
int backend_event_sync(backend *b, backend_event *e);

/* ---------------------------------------------------------------- ops */

/* y[t][o] = sum_i x[t][i] * W[o][i] for t < n_tok.  x: [n_tok][n_in] f32, y: [n_tok][n_out] f32. */
int backend_matmul(backend *b, const weight *w, const float *x, int n_tok, float *y);

/* n_w matmuls over the same x (Q/K/V, gate/up): x is converted once. All W share n_in and type's
 * activation format. n_w <= 8. */
int backend_matmul_multi(backend *b, int n_w, const weight *const *w, const float *x, int n_tok,
                         float *const *y);

/* out[t] = row ids[t] of W dequantized to f32 (the embedding lookup), bit for bit
 * dequantize_row's.  ids: [n] (in range: checked by the caller), out: [n][n_in] f32. */
int backend_embed(backend *b, const weight *w, const int32_t *ids, int n, float *out);

/* dst[t] = src[idx[t]] for t < n, rows of width floats (compacting the rows a forward pass keeps).
 * dst and src do not overlap. */
int backend_gather_rows(backend *b, float *dst, const float *src, const int32_t *idx, int n,
                        int width);

/* y[t] = x[t] / rms(x[t]) * gamma, rms over dim with eps.  x, y: [n_tok][dim]; may alias. */
int backend_rmsnorm(backend *b, const float *x, const float *gamma, float *y, int n_tok, int dim,
                    float eps);

/* Rotates, in place, the first n_rot dims of each head of x: [n_tok][n_head][head_dim] by
 * angle pos[t] * inv_freq[i]. A negative or delta position rotates back or re-rotates.
 * rope->inv_freq is backend memory (backend_weight_data of the model's table). */
int backend_rope(backend *b, float *x, const int32_t *pos, int n_tok, int n_head, int head_dim,
                 const rope_table *rope);
/* The same rotation in two parts, for positions used more than once (every layer of a forward
 * pass turns its rows by the same angles): backend_rope_angles writes cs: [n_tok][n_rot] f32, the
 * cosine and sine of each pair's angle at pos[t] (rope_angles); backend_rope_cs turns row t of x
 * ([n_tok][n_head][head_dim]) by the angles of cs row idx[t] (idx NULL: row t). The result is
 * backend_rope's, bit for bit on the CPU. */
int backend_rope_angles(backend *b, const rope_table *rope, const int32_t *pos, int n_tok,
                        float *cs);
int backend_rope_cs(backend *b, float *x, const float *cs, const int32_t *idx, int n_tok,
                    int n_head, int head_dim, int n_rot);

/* out[i] = silu(gate[i]) * up[i] for i < n. */
int backend_swiglu(backend *b, const float *gate, const float *up, float *out, int64_t n);

/* y[i] += x[i] for i < n. */
int backend_add(backend *b, float *y, const float *x, int64_t n);

/* In place, per row of n: x[r] = softmax(x[r]).  x: [n_rows][n] f32. */
int backend_softmax(backend *b, float *x, int n_rows, int n);

/* The k largest values of each row (sampling's top-k), largest first, ties to the lower index;
 * NaN ranks below every number.  x: [n_rows][n], val: [n_rows][k] f32, idx: [n_rows][k];
 * 1 <= k <= min(n, BACKEND_TOPK_MAX). */
#define BACKEND_TOPK_MAX 256
int backend_topk(backend *b, const float *x, int n_rows, int n, int k, float *val, int32_t *idx);

/* ---------------------------------------------------------------- the KV pool */

/* Memory for the KV pool, zero-filled (host memory on the CPU backend). */
void *backend_kv_alloc(backend *b, const kv_layout *l);
void backend_kv_free(backend *b, void *pool);

/* Writes K and V rows (f32, [n_tok][n_kv_head][head_dim]) of one layer into the pool at the given
 * slots of a sequence (converted to f16). All arguments backend memory: the forward pass's op. */
int backend_kv_write(backend *b, void *pool, const kv_layout *l, int layer,
                     const int32_t *block_table, const int32_t *slots, int n_tok, const float *k,
                     const float *v);

/* backend_kv_write from host memory (block_table, slots, k, v all host): for callers that build
 * KV rows on the host (cache loads, tools). Synchronous. */
int backend_kv_store(backend *b, void *pool, const kv_layout *l, int layer,
                     const int32_t *block_table, const int32_t *slots, int n_tok, const float *k,
                     const float *v);

/* Reads K or V rows back as f32 into host memory (cache export, CacheBlend deviation, tests):
 * block_table, slots and out are host memory. Synchronous. */
int backend_kv_load(backend *b, const void *pool, const kv_layout *l, int layer, int kv,
                    const int32_t *block_table, const int32_t *slots, int n_tok, float *out);

/* Turns the K of the given slots of one layer in place by the angles of cs rows ([n_tok][n_rot]
 * from backend_rope_angles, e.g. of position deltas: CacheBlend's re-rotation of reused keys),
 * in f32 and back to f16. Backend memory. */
int backend_kv_rope(backend *b, void *pool, const kv_layout *l, int layer,
                    const int32_t *block_table, const int32_t *slots, int n_tok, const float *cs,
                    int n_rot);

/* backend_kv_store on the calling thread alone, never the backend's threads: a loader thread
 * writes a later layer's KV with it while the backend computes this one (the CPU's stand-in for
 * a copy stream; a layer's compute reads and writes only that layer's regions). On CUDA it runs
 * on the transfer stream without waiting for queued compute. Host memory, synchronous. */
int backend_kv_store_serial(backend *b, void *pool, const kv_layout *l, int layer,
                            const int32_t *block_table, const int32_t *slots, int n_tok,
                            const float *k, const float *v);

/* Copies one whole block (every layer's K and V) inside the pool: copy on write. */
int backend_kv_copy_block(backend *b, void *pool, const kv_layout *l, int32_t dst, int32_t src);

/* Copies whole blocks between the pool and host memory, bit for bit (cache records): host
 * holds n blocks back to back, kv_layout_block_bytes each, in the pool's own layout. blocks is
 * host memory. Synchronous. */
int backend_kv_read_blocks(backend *b, const void *pool, const kv_layout *l, const int32_t *blocks,
                           int n, void *host);
int backend_kv_write_blocks(backend *b, void *pool, const kv_layout *l, const int32_t *blocks,
                            int n, const void *host);
/* The same, queued on stream s (a copy stream, so cache loads overlap compute): host must be
 * backend_host_alloc memory and stays in use until s passes the copy (record an event after it;
 * the compute stream waits for it with backend_stream_wait before reading the blocks). */
int backend_kv_read_blocks_async(backend *b, const void *pool, const kv_layout *l,
                                 const int32_t *blocks, int n, void *host, backend_stream *s);
int backend_kv_write_blocks_async(backend *b, void *pool, const kv_layout *l, const int32_t *blocks,
                                  int n, const void *host, backend_stream *s);

/* Copies n token rows (every layer's K and V, bit for bit) between the pool's slots
 * slot.. of a sequence (block_table) and host blocks in the pool's layout back to back (a cache
 * record's payload), host slot h being slot h % block_tokens of block h / block_tokens: read
 * goes pool to host, write host to pool. Prompt Cache places module KV at any slot this way.
 * block_table and host are host memory. Synchronous. */
int backend_kv_read_rows(backend *b, const void *pool, const kv_layout *l,
                         const int32_t *block_table, int slot, int n, void *host, int host_slot);
int backend_kv_write_rows(backend *b, void *pool, const kv_layout *l, const int32_t *block_table,
                          int slot, int n, const void *host, int host_slot);

/* Attention for several sequences at one layer: softmax(q k^T * scale) v per head, GQA mapping
 * head h to kv head h / (n_head / n_kv_head). */
int backend_attention(backend *b, const void *pool, const kv_layout *l, int layer, int n_head,
                      float scale, const attn_seq *seqs, int n_seqs);

/* ---------------------------------------------------------------- step graphs */

/* A step whose ops repeat with the same arguments (a decode step of the continuous batch at one
 * width: the same buffers, sizes and grids; only the contents of its input tables change) is
 * recorded once and replayed as one launch (CUDA graphs; decode at small batch is bound by
 * kernel launches). The caller names the shape with a key (bytes it compares) and an owner (the
 * buffers the ops read, e.g. its forward context), uploads what changes before beginning, and
 * brackets the ops:
 *   mode = backend_graph_begin(b, owner, &key, sizeof key);
 *   if (mode != BACKEND_GRAPH_REPLAY) issue the step's ops;
 *   if (mode != BACKEND_GRAPH_DIRECT && backend_graph_end(b)) issue them again (recording failed);
 * Two steps with one key and owner must issue the same ops with the same arguments: everything
 * that differs goes into the key. Inside a step no op may need the host (uploads, downloads,
 * the host-facing KV copies, frees): recording refuses them. Backends without graphs (the CPU)
 * always answer DIRECT. */
typedef enum backend_graph_mode {
    BACKEND_GRAPH_DIRECT = 0, /* issue the ops; no backend_graph_end */
    BACKEND_GRAPH_RECORD = 1, /* issue the ops: recorded, they run at backend_graph_end */
    BACKEND_GRAPH_REPLAY = 2, /* issue nothing: backend_graph_end queues the recorded step */
} backend_graph_mode;

#define BACKEND_GRAPH_KEY_MAX 64 /* bytes of a key */

/* Whether this backend records steps now (the caller may lay out its tables for them). */
bool backend_graphs(const backend *b);
/* Turns step graphs on (the default where the backend has them) or off (config cuda_graphs). */
void backend_set_graphs(backend *b, bool on);
backend_graph_mode backend_graph_begin(backend *b, const void *owner, const void *key,
                                       size_t key_bytes);
/* Queues the recorded or replayed step on the compute stream. -1 when recording failed (an op
 * could not be recorded; none of the step's ops ran: issue them directly). Graphs stay off
 * after a failed recording. */
int backend_graph_end(backend *b);
/* Drops owner's graphs (before its buffers are freed). */
void backend_graph_forget(backend *b, const void *owner);

#ifdef __cplusplus
}
#endif

#endif
