/* The single-sequence engine: a model, one backend, a KV pool, one sequence and a forward
 * context, run from the calling thread. The command-line tools (generate, bench, calibrate,
 * codec-eval) and the codec calibration the server runs at start use it; the server's batching
 * engine is engine.h. */
#ifndef KVSERVE_ENGINE_SINGLE_H
#define KVSERVE_ENGINE_SINGLE_H

#include <stdbool.h>

#include "model/model.h"

/* What a tool that runs a model loads and how (the command line's -m, -t, --precise, --simd,
 * --device, --chat-template; the tool sets the defaults). */
typedef struct engine_model_opts {
    const char *path;          /* -m, --model: the GGUF file */
    const char *chat_template; /* --chat-template (NULL: the GGUF's) */
    int threads;               /* -t, --threads */
    bool precise;              /* --precise: f32 matmuls instead of 8-bit activations */
    const char *simd;          /* --simd: auto|avx512|avx2|scalar (NULL: auto) */
    const char *device;        /* --device: auto|cuda|cpu (NULL: cpu, for tools without it) */
} engine_model_opts;

/* Makes `name`'s SIMD level (NULL: auto) the one the kernels use; a level the CPU cannot run is
 * lowered to what it can, with a warning. -1 with err for an unknown name. */
int engine_simd_apply(const char *name, kv_error *err);

/* Prompts are prefilled in slices of this many tokens (the forward context's batch size). */
#define ENGINE_SLICE 512

typedef struct engine_single {
    model *m; /* owned */
    int threads;
    bool precise;
    const char *device; /* backend_create's name */
    backend *b;
    kv_pool *pool;
    forward_ctx *fwd;
    kv_seq seq;
    int ctx;
    float *logits;              /* [n_vocab] logits of the last token run */
    float *rows;                /* [ENGINE_ROWS][n_vocab] for engine_single_rows (lazily) */
    const forward_hooks *hooks; /* passed to every forward pass (NULL: none) */
} engine_single;

/* engine_single_rows runs this many tokens per forward pass. */
#define ENGINE_ROWS 128
/* Receives row i's logits ([n_vocab]) from engine_single_rows; nonzero stops the run. */
typedef int (*engine_row_fn)(void *ud, int i, const float *logits);

/* Loads o's model into e (zeroed first), which owns it from then on. The engine itself starts
 * with engine_single_start, once the tool knows the context it needs (often from the model). */
int engine_single_load(engine_single *e, const engine_model_opts *o, kv_error *err);
/* A backend with o's threads and precision, a KV pool of ctx tokens and a forward context. On
 * failure e holds what was made: engine_single_free frees it. */
int engine_single_start(engine_single *e, int ctx, kv_error *err);
/* The engine and the model; safe on a zeroed or partly made engine. */
void engine_single_free(engine_single *e);
/* Appends tokens to the sequence (positions continue from its length) in slices. */
int engine_single_prefill(engine_single *e, const int32_t *ids, int n, kv_error *err);
int engine_single_decode(engine_single *e, int32_t id, kv_error *err);
/* The sequence's KV of tokens [0, n_chunks * chunk) as f32, chunk by chunk: out is
 * [chunk][layer][kv][token][channel] (channel = kv head * head_dim + d), the codec's order.
 * -1 with err when out of memory. */
int engine_single_read_kv(engine_single *e, int n_chunks, int chunk, float *out, kv_error *err);
/* The inverse of engine_single_read_kv: the sequence becomes tokens [0, n) whose KV is kv's
 * (same layout, ceil(n / chunk) chunks; a last partial chunk's tail is not read). */
int engine_single_write_kv(engine_single *e, int n, int chunk, const float *kv, kv_error *err);
/* Truncates the sequence to `from` tokens, runs tokens[from..to) at positions from.. over it
 * and hands every row's logits to fn (i = position - from), in order. The tokens' KV stays in
 * the sequence. Hooks are not called. */
int engine_single_rows(engine_single *e, const int32_t *tokens, int from, int to, engine_row_fn fn,
                       void *ud, kv_error *err);
/* Drops the sequence's KV. */
void engine_single_reset(engine_single *e);

#endif
