/* The compute backend: the ops the forward pass is made of, behind one C interface.
 * The CPU backend (kernels/cpu/) is the reference; a CUDA backend implements the same ops.
 * Every op runs to completion before returning (the CPU backend parallelises inside an op over
 * its thread pool). Inputs are trusted here: model/ validates shapes when it loads a file. */
#ifndef KVSERVE_BACKEND_H
#define KVSERVE_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/quant.h"
#include "kernels/rope.h"
#include "util/util.h"

typedef struct backend backend;

/* A weight matrix W where it lies (the mmapped GGUF on the CPU): n_out rows of n_in elements of
 * `type`, row i at data + i * row_bytes. */
typedef struct weight {
    tensor_type type;
    int64_t n_in;
    int64_t n_out;
    size_t row_bytes;
    const void *data;
} weight;

/* The paged KV pool's memory layout. The pool is n_blocks blocks; a block holds block_tokens
 * (a multiple of 16) token slots for every layer:
 *   block: [n_layer][2 (K, V)][n_kv_head] regions of block_tokens * head_dim f16
 *   K region: [head_dim][block_tokens] (transposed: one vector load gives a dim of 16 keys)
 *   V region: [block_tokens][head_dim]
 * K is stored rotated (RoPE applied at the token's position). Only the backend reads regions;
 * everything else goes through backend_kv_store / backend_kv_load. */
typedef struct kv_layout {
    int n_layer;
    int n_kv_head;
    int head_dim;
    int block_tokens;
    int64_t n_blocks;
} kv_layout;

/* Bytes of one block, and the offset of (layer, kv = 0 K / 1 V, head) inside a block. */
size_t kv_layout_block_bytes(const kv_layout *l);
size_t kv_layout_offset(const kv_layout *l, int layer, int kv, int head);

/* One sequence's part of an attention call. Query row r sits at KV slot q_slot[r] and attends
 * to slots 0..q_slot[r] (causal by slot, not by position value, so positions may be
 * discontinuous). Slots map to pool blocks by block_table[slot / block_tokens]. */
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
void backend_destroy(backend *b);
const char *backend_name(const backend *b);
int backend_n_threads(const backend *b);

/* How matmuls treat activations. Q8 (the default) converts them to 8-bit blocks of 32 as ggml's
 * Q8_0/Q8_1/Q8_K formats do and multiplies in integers: fast, and about 0.2 logits from an exact
 * computation on a small model, like llama.cpp. F32 dequantizes weight rows to f32 and keeps
 * activations f32: 2-4x slower, float-accurate (for evaluation and for checking an engine). */
typedef enum matmul_precision {
    MATMUL_PRECISION_Q8 = 0,
    MATMUL_PRECISION_F32 = 1,
} matmul_precision;

void backend_set_precision(backend *b, matmul_precision p);

/* Memory for the KV pool, zero-filled (host memory on the CPU backend). */
void *backend_kv_alloc(backend *b, const kv_layout *l);
void backend_kv_free(backend *b, void *pool);

/* ---------------------------------------------------------------- ops */

/* y[t][o] = sum_i x[t][i] * W[o][i] for t < n_tok.  x: [n_tok][n_in] f32, y: [n_tok][n_out] f32.
 * The ops that need scratch memory (matmul, attention) return 0, or -1 when it cannot be
 * allocated (logged; y is then undefined and the caller must not use it). */
int backend_matmul(backend *b, const weight *w, const float *x, int n_tok, float *y);

/* n_w matmuls over the same x (Q/K/V, gate/up): x is converted once. All W share n_in and type's
 * activation format. */
int backend_matmul_multi(backend *b, int n_w, const weight *const *w, const float *x, int n_tok,
                         float *const *y);

/* y[t] = x[t] / rms(x[t]) * gamma, rms over dim with eps.  x, y: [n_tok][dim]; may alias. */
void backend_rmsnorm(backend *b, const float *x, const float *gamma, float *y, int n_tok, int dim,
                     float eps);

/* Rotates, in place, the first n_rot dims of each head of x: [n_tok][n_head][head_dim] by
 * angle pos[t] * inv_freq[i]. A negative or delta position rotates back or re-rotates. */
void backend_rope(backend *b, float *x, const int32_t *pos, int n_tok, int n_head, int head_dim,
                  const rope_table *rope);
/* The same rotation in two parts, for positions used more than once (every layer of a forward
 * pass turns its rows by the same angles): backend_rope_angles writes cs: [n_tok][n_rot] f32, the
 * cosine and sine of each pair's angle at pos[t] (rope_angles); backend_rope_cs turns row t of x
 * ([n_tok][n_head][head_dim]) by the angles of cs row idx[t] (idx NULL: row t). The result is
 * backend_rope's, bit for bit. */
void backend_rope_angles(backend *b, const rope_table *rope, const int32_t *pos, int n_tok,
                         float *cs);
void backend_rope_cs(backend *b, float *x, const float *cs, const int32_t *idx, int n_tok,
                     int n_head, int head_dim, int n_rot);

/* out[i] = silu(gate[i]) * up[i] for i < n. */
void backend_swiglu(backend *b, const float *gate, const float *up, float *out, int64_t n);

/* y[i] += x[i] for i < n. */
void backend_add(backend *b, float *y, const float *x, int64_t n);

/* Writes K and V rows (f32, [n_tok][n_kv_head][head_dim]) of one layer into the pool at the given
 * slots of a sequence (converted to f16). */
void backend_kv_store(backend *b, void *pool, const kv_layout *l, int layer,
                      const int32_t *block_table, const int32_t *slots, int n_tok, const float *k,
                      const float *v);

/* backend_kv_store on the calling thread alone, never the backend's threads: a loader thread
 * writes a later layer's KV with it while the backend computes this one (the CPU's stand-in for
 * a copy stream; a layer's compute reads and writes only that layer's regions). */
void backend_kv_store_serial(backend *b, void *pool, const kv_layout *l, int layer,
                             const int32_t *block_table, const int32_t *slots, int n_tok,
                             const float *k, const float *v);

/* Copies one whole block (every layer's K and V) inside the pool: copy on write. */
void backend_kv_copy_block(backend *b, void *pool, const kv_layout *l, int32_t dst, int32_t src);

/* Copies whole blocks between the pool and host memory, bit for bit (cache records): host
 * holds n blocks back to back, kv_layout_block_bytes each, in the pool's own layout. */
void backend_kv_read_blocks(backend *b, const void *pool, const kv_layout *l, const int32_t *blocks,
                            int n, void *host);
void backend_kv_write_blocks(backend *b, void *pool, const kv_layout *l, const int32_t *blocks,
                             int n, const void *host);

/* Copies n token rows (every layer's K and V, bit for bit) between the pool's slots
 * slot.. of a sequence (block_table) and host blocks in the pool's layout back to back (a cache
 * record's payload), host slot h being slot h % block_tokens of block h / block_tokens: read
 * goes pool to host, write host to pool. Prompt Cache places module KV at any slot this way. */
void backend_kv_read_rows(backend *b, const void *pool, const kv_layout *l,
                          const int32_t *block_table, int slot, int n, void *host, int host_slot);
void backend_kv_write_rows(backend *b, void *pool, const kv_layout *l, const int32_t *block_table,
                           int slot, int n, const void *host, int host_slot);

/* Reads K or V rows back as f32 (for cache export, CacheBlend deviation, tests). */
void backend_kv_load(backend *b, const void *pool, const kv_layout *l, int layer, int kv,
                     const int32_t *block_table, const int32_t *slots, int n_tok, float *out);

/* Attention for several sequences at one layer: softmax(q k^T * scale) v per head, GQA mapping
 * head h to kv head h / (n_head / n_kv_head). */
int backend_attention(backend *b, const void *pool, const kv_layout *l, int layer, int n_head,
                      float scale, const attn_seq *seqs, int n_seqs);

#endif
