/* model/: the public contract of the model layer. A llama-family model loaded from GGUF, its
 * tokenizer and chat template, the paged KV pool and the forward pass (the sampler and grammars:
 * sampler.h, grammar.h).
 *
 * The forward pass follows DESIGN.md: explicit per-token positions, layer-by-layer execution with
 * hooks between layers, computing a subset of token rows while attending over all KV rows, a
 * paged ref-counted KV pool, and batches over several sequences. */
#ifndef KVSERVE_MODEL_H
#define KVSERVE_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/backend.h"
#include "model/chat/chat.h"
#include "model/gguf.h"
#include "model/tokenizer/tokenizer.h"
#include "util/util.h"

/* ---------------------------------------------------------------- hyperparameters */

typedef enum rope_scaling {
    ROPE_SCALING_NONE = 0,
    ROPE_SCALING_LINEAR,
    ROPE_SCALING_LLAMA3,
} rope_scaling;

typedef struct model_hparams {
    int n_vocab;
    int n_ctx_train; /* llama.context_length */
    int dim;         /* embedding_length */
    int n_layer;
    int n_head;
    int n_kv_head;
    int head_dim;
    int ffn_dim;
    int n_rot; /* rope.dimension_count (default head_dim) */
    float norm_eps;
    float rope_base;
    rope_scaling rope_scaling_type;
    float rope_factor;           /* linear: positions divided by it; llama3: the factor */
    float rope_low_freq_factor;  /* llama3 */
    float rope_high_freq_factor; /* llama3 */
    int rope_orig_ctx;           /* llama3: original_context_length */
    bool tied_output;            /* output.weight absent: token_embd reused */
} model_hparams;

/* ---------------------------------------------------------------- weights */

typedef struct layer_weights {
    const float *attn_norm; /* [dim] f32 */
    weight wq;              /* [n_head * head_dim][dim] */
    weight wk;              /* [n_kv_head * head_dim][dim] */
    weight wv;              /* [n_kv_head * head_dim][dim] */
    weight wo;              /* [dim][n_head * head_dim] */
    const float *ffn_norm;  /* [dim] f32 */
    weight w_gate;          /* [ffn_dim][dim] */
    weight w_up;            /* [ffn_dim][dim] */
    weight w_down;          /* [dim][ffn_dim] */
} layer_weights;

typedef struct model {
    gguf_file *gguf; /* the mapping every weight points into (the CPU backend repacks Q4_0, Q4_1
                      * and Q8_0 matmul weights into copies: model/forward.c bind_weight) */
    model_hparams hp;
    char *name; /* general.name, or the file name */
    char *path;
    uint8_t identity[32];     /* SHA-256 over arch, hyperparameters, layout, data samples */
    weight tok_embd;          /* [n_vocab][dim] */
    const float *output_norm; /* [dim] f32 */
    weight output;            /* [n_vocab][dim] (tok_embd when tied) */
    layer_weights *layers;    /* [n_layer] */
    float *norm_f32;          /* norms converted from F16/BF16 when the file stores them so */
    tokenizer *tok;
    chat_template chat;
    rope_table rope;
} model;

typedef struct model_load_opts {
    const char *chat_template; /* name overriding detection, or NULL */
} model_load_opts;

model *model_load(const char *path, const model_load_opts *opts, kv_error *err);
void model_free(model *m);
/* Bytes of the mapped weights and of the KV of one token (f16, all layers). */
size_t model_weight_bytes(const model *m);
size_t model_kv_bytes_per_token(const model *m);

/* ---------------------------------------------------------------- KV pool */

/* Fixed-size blocks with reference counts. A sequence owns a block table; sequences that share
 * a prefix share its full blocks (kv_seq_fork) and a block is written only while its count is 1
 * (copy on write at the first partly-shared block). */
typedef struct kv_pool kv_pool;

typedef struct kv_seq {
    int32_t *blocks; /* block table */
    int n_blocks;
    int cap_blocks;
    int n_tokens; /* slots holding KV */
} kv_seq;

kv_pool *kv_pool_create(backend *b, const model *m, int64_t n_tokens, int block_tokens,
                        kv_error *err);
void kv_pool_destroy(kv_pool *p);
const kv_layout *kv_pool_layout(const kv_pool *p);
void *kv_pool_memory(kv_pool *p);
int64_t kv_pool_free_blocks(const kv_pool *p);
int64_t kv_pool_total_blocks(const kv_pool *p);

void kv_seq_init(kv_seq *s);
/* Makes room for slots up to n_tokens (allocating blocks, copying a shared last block before it
 * is written). -1 with err when the pool is full; nothing changes then. */
int kv_seq_reserve(kv_pool *p, kv_seq *s, int n_tokens, kv_error *err);
/* dst shares src's first n_tokens slots (whole blocks by reference; the partial last block is
 * shared too and copied on the first write). dst must be empty. */
int kv_seq_fork(kv_pool *p, kv_seq *dst, const kv_seq *src, int n_tokens, kv_error *err);
/* Drops slots from n_tokens on (blocks no longer needed are released). */
void kv_seq_truncate(kv_pool *p, kv_seq *s, int n_tokens);
void kv_seq_release(kv_pool *p, kv_seq *s);
int kv_pool_block_refs(const kv_pool *p, int32_t block);

/* References held outside any sequence: the engine's prefix cache keeps the blocks of cached
 * chunks alive this way (a block returns to the free list when its last reference goes). */
void kv_pool_block_ref(kv_pool *p, int32_t block);
void kv_pool_block_unref(kv_pool *p, int32_t block);
/* Appends n existing blocks to s by reference: s must hold whole blocks only (n_tokens a
 * multiple of block_tokens, no reserved slots beyond); its n_tokens grows by n blocks. */
int kv_seq_append_blocks(kv_pool *p, kv_seq *s, const int32_t *blocks, int n, kv_error *err);
/* Appends n fresh blocks to s (as kv_seq_append_blocks requires) and fills them, bit for bit,
 * from host ([n] blocks of kv_layout_block_bytes, the pool's layout: a cache record's payload).
 * -1 with err when the pool is full; nothing changes then. */
int kv_seq_import_blocks(kv_pool *p, kv_seq *s, int n, const void *host, kv_error *err);
/* Copies s's blocks [first, first + n) to host, bit for bit. */
void kv_seq_export_blocks(kv_pool *p, const kv_seq *s, int first, int n, void *host);
/* The same for the pool blocks blocks[0..n) (held by the caller, as the pool tier holds them). */
void kv_pool_export_blocks(kv_pool *p, const int32_t *blocks, int n, void *host);
/* KV placed at any token slot (Prompt Cache assembles modules whose KV sits at other slots in
 * the records that hold it). host is blocks in the pool's layout back to back (a cache record's
 * payload); host slot h is slot h % block_tokens of its block h / block_tokens. Export copies
 * s's slots [slot, slot + n) to host slots host_slot.., import the other way into s's slots
 * (reserved, in blocks s alone holds). Bit for bit; whole blocks are copied as blocks where the
 * two sides line up. -1 with err when a range is out of bounds or out of memory. */
int kv_seq_export_rows(kv_pool *p, const kv_seq *s, int slot, int n, void *host, int host_slot,
                       kv_error *err);
int kv_seq_import_rows(kv_pool *p, kv_seq *s, int slot, int n, const void *host, int host_slot,
                       kv_error *err);

/* ---------------------------------------------------------------- forward pass */

/* One sequence's part of a batch: n_tok new tokens at explicit positions, written to KV slots
 * kv_start .. kv_start + n_tok - 1 of seq (reserved by the caller). */
typedef struct batch_seq {
    kv_seq *seq;
    int n_tok;
    const int32_t *tokens; /* [n_tok] */
    const int32_t *pos;    /* [n_tok] RoPE positions */
    int kv_start;
    bool all_logits; /* logits for every token (else only the last) */
    /* Every row through the last layer, for hooks that read their final hidden states
     * (embedding pooling). Otherwise the last layer computes attention and feed-forward only for
     * the rows that give logits: the others' output feeds nothing (their KV is still written). */
    bool all_rows;
    /* A single decode row whose attention may split its keys across threads (flash-decoding),
     * which sums in another order. Without it a row's KV and logits do not depend on what else is
     * in the batch, how the prompt was sliced into steps or how much of it was cached: the
     * server never sets it (cached KV must equal a cold prefill's); the one-sequence CLI tools
     * (generate, bench) do. */
    bool decode;
} batch_seq;

typedef struct forward_state forward_state;

/* Hooks between layers (any may be NULL). before_layer runs before layer `layer` computes (load
 * its KV); after_kv runs once the layer has written the current rows' K and V to the pool and
 * before their attention (read the fresh KV; rows dropped here skip the rest of the layer, which
 * only their own hidden state would use); after_layer runs after it (read what it wrote, choose
 * rows). Nonzero return aborts. */
typedef struct forward_hooks {
    void *ud;
    int (*before_layer)(void *ud, forward_state *st, int layer);
    int (*after_kv)(void *ud, forward_state *st, int layer);
    int (*after_layer)(void *ud, forward_state *st, int layer);
} forward_hooks;

/* The rows being computed: row r is token tok_index[r] of the flattened batch (sequences in
 * order, n_tok each). Starts as every token. */
int forward_state_n_rows(const forward_state *st);
const int32_t *forward_state_rows(const forward_state *st);
/* Keeps only the listed rows (indices into the current rows, increasing) for the remaining
 * layers. Dropped tokens' KV in later layers is whatever the pool holds (loaded or cached). */
int forward_state_keep_rows(forward_state *st, const int *keep, int n_keep);
/* The hidden state of current row r ([dim] f32) after the last finished layer. */
const float *forward_state_hidden(const forward_state *st, int r);

typedef struct forward_ctx forward_ctx;

/* Scratch buffers for batches of up to max_tokens tokens over up to max_seqs sequences. */
forward_ctx *forward_ctx_create(const model *m, backend *b, kv_pool *pool, int max_tokens,
                                int max_seqs, kv_error *err);
void forward_ctx_destroy(forward_ctx *f);

/* Runs the batch. logits receives [n_out][n_vocab] f32 rows in batch order: per sequence, every
 * token's row (all_logits) or the last token's; rows of tokens dropped by keep_rows are not
 * produced (n_out counts what was). Returns n_out, or -1 with err (bad token id, capacity). */
int model_forward(forward_ctx *f, const batch_seq *seqs, int n_seqs, const forward_hooks *hooks,
                  float *logits, kv_error *err);

#endif
