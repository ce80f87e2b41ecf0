/* Helpers shared by the command-line tools: strict argument parsing and a single-sequence
 * engine (one backend, KV pool, sequence and forward context). */
#ifndef KVSERVE_CLI_COMMON_H
#define KVSERVE_CLI_COMMON_H

#include "model/model.h"

/* Parse the whole string as a number in [lo, hi]; on failure print a message naming opt. */
int cli_parse_int(const char *opt, const char *s, long long lo, long long hi, long long *out);
int cli_parse_float(const char *opt, const char *s, double lo, double hi, double *out);
/* Whole file as a NUL-terminated string, or NULL with err. */
char *cli_read_file(const char *path, kv_error *err);

/* Prompts are prefilled in slices of this many tokens (the forward context's batch size). */
#define ENGINE_SLICE 512

typedef struct engine_single {
    const model *m;
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

int engine_single_init(engine_single *e, const model *m, int threads, int ctx, bool precise,
                       kv_error *err);
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
