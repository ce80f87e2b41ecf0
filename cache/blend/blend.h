/* cache/blend/blend.h: reuse by content (DESIGN.md "Segments, content keys and blend"), after
 * CacheBlend (EuroSys'25).
 *
 * A prompt is cut into content-defined chunks over its token ids, so that the same passage
 * yields the same chunks wherever it sits; each chunk's KV, computed in whatever context came
 * first, is kept as a content record under its content key (not chained: it finds the chunk
 * after any prefix; the record and its RAM, disk and Redis tiers are cache/store/content.h's).
 * A later prompt that holds the chunk elsewhere takes that KV, moves its K to
 * the new positions by a RoPE delta rotation, and the fusor recomputes, layer by layer, only the
 * tokens whose KV deviates most from what a full prefill would give (gradual filtering of the
 * high-KV-deviation tokens), while the tokens that were not cached are computed in full.
 *
 * Here: the chunker (cdc.c), the fusor (blend.c) and its selection policies (blend_policy.c);
 * the planner (cache/plan.c) and the engine's step use them. */
#ifndef KVSERVE_CACHE_BLEND_H
#define KVSERVE_CACHE_BLEND_H

#include <stdbool.h>
#include <stdint.h>

#include "cache/cache.h"
#include "cache/store/content.h"
#include "model/model.h"

/* ---------------------------------------------------------------- content-defined chunks */

typedef struct cache_cdc_params {
    int min_tokens; /* no cut before a chunk has this many (hard cuts aside) */
    int avg_tokens; /* the rolling hash cuts about once per (avg - min) tokens past min */
    int max_tokens; /* a cut at this length at the latest */
} cache_cdc_params;

/* What a token means to the chunker (a table over the vocabulary, model_token_kinds). */
enum {
    CACHE_TOKEN_PLAIN = 0,
    CACHE_TOKEN_SOFT = 1, /* holds a line break: a cut follows it once the chunk is long enough */
    CACHE_TOKEN_HARD = 2, /* a control token (message boundaries): a cut before and after it */
};

/* The per-token kinds of a vocabulary: [n_vocab] bytes, malloc'd (NULL when out of memory). */
uint8_t *cache_token_kinds(const tokenizer *t);

/* Cuts tokens[0..n) into chunks: ends[i] is the end (exclusive) of chunk i; returns the count
 * (the last end is n; at most max_ends, the rest left uncut). A cut comes after a SOFT token
 * once the chunk holds min_tokens, where a gear hash of the last 16 ids hits (about every
 * avg - min tokens past min), at max_tokens, before and after every HARD token, and before
 * every segment bound (bounds[0..n_bounds), ascending token indices: where the request's
 * content parts begin and end); after a HARD token or a bound the hash restarts. Cuts depend
 * only on the tokens shortly before them and the last cut, so a passage cuts the same way
 * wherever it sits a few cuts into it, and a content part from its first token on. kinds and
 * bounds may be NULL. */
int cache_cdc_cut(const int32_t *tokens, int n, const uint8_t *kinds, int n_vocab,
                  const cache_cdc_params *p, const int *bounds, int n_bounds, int *ends,
                  int max_ends);

/* ---------------------------------------------------------------- the fusor */

/* Tokens at KV slots slot .. slot + n - 1 of a blended batch entry take their KV from rec's
 * tokens off .. off + n - 1 (computed at rec->pos0 + off + i), their K rotated to the slot's
 * position. The first `forced` of them are recomputed at every layer whatever their deviation
 * (the selection policy's chunk-start tokens, below). */
typedef struct blend_span {
    int slot;
    int n;
    int off;
    int forced;
    content_rec *rec; /* borrowed: the caller keeps it alive through the pass */
} blend_span;

/* Sets spans[i].forced for policy at ratio (spans in slot order, as the planner found them):
 * a run is a stretch of spans adjacent both in the prompt and in the positions their records
 * were computed at (one earlier context); its first k tokens are forced, k the same for every
 * run. Returns k (0 for HKVD). */
int blend_force_run_starts(blend_span *spans, int n_spans, blend_policy policy, float ratio);

/* A batch entry that blends: seqs[entry] of the batch, its reused spans (inside its slots, in
 * slot order; positions equal slots), and the recompute ratio. The pass fills the counts. */
typedef struct blend_entry {
    int entry;
    const blend_span *spans;
    int n_spans;
    float ratio; /* 0: full reuse (even layer 0 reuses); 1: every token computed, a full prefill */
    /* false: the reused tokens not forced go through layers 0 and 1 and HKVD ranks them for
     * what the forced ones leave of the budget; true: they are reused as they are from layer 0
     * on, and only the forced ones are recomputed (LegoLink) */
    bool only_forced;
    /* out */
    int n_reused;     /* tokens of the spans */
    int n_recomputed; /* of them, computed at the last layer */
    /* A span's record could not be read from disk at some layer: the entry's KV and logits of
     * this pass are wrong; the caller drops the failed spans and runs the tokens again. */
    bool failed;
} blend_entry;

typedef struct blend_fusor blend_fusor;

/* Scratch for up to max_tokens reused tokens per pass. */
blend_fusor *blend_fusor_create(const model *m, backend *b, kv_pool *pool, int max_tokens,
                                kv_error *err);
void blend_fusor_destroy(blend_fusor *f);
/* Readies the hooks for one model_forward over seqs (whose blended entries are listed; the
 * others pass through untouched): before layer l, the spans' layer-l KV is written into the
 * pool (K re-rotated); once layer l has written the fresh K and V of the reused rows it computes,
 * they are ranked by the deviation from the reused ones and the most deviating go on through
 * the layer to layer l + 1: every reused token through layer 1 (layer 0's KV does not depend on the
 * context, so layer 1 is where deviation shows), then ratio * (1 + 1 / (l - 1)^2) of them at
 * layer l >= 2 (gradual filtering, never more than the layer before computed), so from layer 5
 * on about ratio of them are computed (rows dropped at layer l skip its attention and
 * feed-forward: after_kv). A span's forced tokens are computed at every layer and spend their
 * share of each layer's count first; an entry with only_forced computes no other reused token,
 * not even at layer 0. A loader thread writes layer l + 1's reused KV into the pool while
 * layer l computes (CacheBlend's pipelining). -1 with err when the spans do not fit. */
int blend_fusor_begin(blend_fusor *f, const batch_seq *seqs, int n_seqs, blend_entry *entries,
                      int n_entries, forward_hooks *hooks, kv_error *err);
/* Ends the pass begun last (after model_forward, whether it succeeded or not): waits for the
 * loader thread to finish the layer it is writing, so the spans' records may be released. */
void blend_fusor_end(blend_fusor *f);
/* Measured time to load one reused token's KV for one layer (conversion, rotation, pool
 * write), in nanoseconds, averaged over recent passes; 0 before the first. */
double blend_fusor_load_ns(const blend_fusor *f);
/* Recompute rows of layer `layer` for `reused` reused tokens at ratio r (the schedule above). */
int blend_rows_at_layer(float ratio, int reused, int layer);

#endif
