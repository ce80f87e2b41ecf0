/* cache/plan.h: the reuse planner (DESIGN.md "One request, end to end", step 2). For each
 * sequence it decides what of the prompt's KV comes from the cache, and from where: the pool
 * tier's blocks by reference, records the submitting thread fetched from RAM, disk or Redis
 * (copied into fresh blocks), and chunks found by content anywhere in the prompt (blend spans
 * for the fusor). Once KV is computed it keeps what the cache should keep: prefix blocks in
 * the pool tier, whole and trailing chunks in the store, content records. The engine only
 * schedules: it asks the planner at admission, after each step and when a sequence ends.
 *
 * Threads: plan_prepare runs on the submitting thread (its disk and Redis reads block that
 * thread, not the engine); the functions taking a plan_seq, plan_shared_blocks and
 * planner_pool's table on the engine thread; clears and stats on any. */
#ifndef KVSERVE_CACHE_PLAN_H
#define KVSERVE_CACHE_PLAN_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "cache/blend/blend.h"
#include "cache/cache.h"
#include "cache/store/content.h"
#include "cache/store/pool_cache.h"
#include "model/model.h"

/* What a prompt does with reuse by content (blend). */
typedef enum plan_blend_mode {
    PLAN_BLEND_OFF = 0,   /* nothing: "blend": false */
    PLAN_BLEND_STORE = 1, /* its chunks are kept for later prompts, none reused in it (the
                             quality budget keeps blend off for requests that ask nothing) */
    PLAN_BLEND_ON = 2,    /* kept, and chunks found by content reused */
} plan_blend_mode;

typedef struct plan_opts {
    cache_store *store; /* RAM/disk/Redis tiers, or NULL */
    int chunk_tokens;   /* a record's tokens (a multiple of the pool's block) */
    bool pool_tier;     /* keep computed blocks in the pool, found by prefix key */
    /* Chunks fetched for queued prompts are held outside the store's caps until admission: at
     * most this many bytes (0: 1 GiB). Beyond it a prompt recomputes instead. */
    int64_t prefetch_bytes;
    int64_t ttft_budget_ms; /* Redis fetches: the default budget (0: none, lossless) */
    /* blend: the content store's cap in bytes (0: no blend), the least recompute ratio the
     * loading controller picks, and content records on disk (the caller's, or NULL) */
    int64_t blend_bytes;
    float blend_ratio;
    blend_policy blend_policy; /* which reused tokens are recomputed (blend.h) */
    content_disk *blend_disk;
    /* lossy encodings fetches may not choose by budget (cache_fetch_policy's barred: the quality
     * budget rules them out on this model) */
    uint32_t levels_barred;
    /* The disk's backlog (bytes queued or being written) at or over which an ending sequence's
     * tail record waits in the pool tier for plan_drain_tails: 0, any (a tail is copied only
     * while nothing waits for the disk); negative, always (stored only as the engine stops:
     * tests). */
    int64_t tail_backlog;
} plan_opts;

/* A chunk of the prompt found in the store's tiers: its tokens, tier and encoding (cache.h's
 * CACHE_TIER_*, CACHE_ENC_*). */
typedef struct plan_fetched {
    int tokens;
    int tier;
    int enc;
} plan_fetched;

/* What one prompt asks of the planner and what plan_prepare found for it. The submitter sets
 * the request's fields, plan_prepare the rest; read-only once the prompt is queued, but for
 * the fetched records, which the first choice's plan_reuse uses up. */
typedef struct plan_req {
    /* ---- the request's */
    /* How chunks come from the Redis tier (cache_fetch_policy): kv_level forces an encoding
     * (CACHE_ENC_ANY: none; CACHE_ENC_TEXT: none from Redis), kv_lossless insists on exact KV,
     * ttft_budget_ms lets the fetch trade precision for time (< 0: the server's budget). */
    int kv_level;
    bool kv_lossless;
    int64_t ttft_budget_ms;
    /* Blend: keep the prompt's chunks by content and reuse those found anywhere in it,
     * recomputing a share of them (blend_ratio in 0..1; negative: the loading controller picks,
     * from the server's least ratio). */
    plan_blend_mode blend;
    float blend_ratio;
    int blend_policy; /* blend_policy; -1: the server's */
    /* Segment bounds (cache_cdc_cut): ascending token indices where the request's content parts
     * begin and end. Owned; NULL when none. */
    int *bounds;
    int n_bounds;
    /* ---- plan_prepare's */
    bool cache; /* the prompt may reuse and store KV, under namespace ns */
    cache_key ns;
    cache_key *keys; /* [n_keys] prefix keys of the prompt's full KV blocks, owned */
    int n_keys;
    cache_chunk **loaded; /* [n_loaded] records fetched from RAM, disk or Redis, in order, one
                             reference each; dropped at admission */
    int n_loaded;
    cache_fetch_src *loaded_src; /* [n_loaded] where each came from, in what encoding */
    int loaded_from;             /* the first block they continue (the pool held the ones before) */
    int loaded_blocks;           /* blocks from loaded_from on that they hold for this prompt */
    int64_t loaded_bytes;        /* their payload bytes, charged to *loaded_budget */
    atomic_llong *loaded_budget; /* the planner's count of fetched bytes not yet admitted */
    /* What the fetch brought, for usage: one entry per chunk from the store's tiers, then one per
     * chunk Redis held that the fetch left to text (enc CACHE_ENC_TEXT). */
    plan_fetched *fetched;
    int n_fetched;
    int redis_held_blocks; /* the prompt's blocks [0, this) Redis holds (computed ones are not
                              written there again) */
} plan_req;

/* Defaults: no forced level, the server's budget, no blend. */
void plan_req_init(plan_req *pr);
/* Frees what pr owns, returning its fetched records' bytes to the budget. */
void plan_req_free(plan_req *pr);

/* One sequence's side of the plan (engine thread). */
typedef struct plan_seq {
    /* prefix keys of the history's full blocks computed so far, how many leading blocks have
     * been registered in the pool tier (and their full chunks stored), and up to which block a
     * trailing partial chunk was last stored */
    cache_key *keys;
    int n_keys, cap_keys;
    int n_stored;
    int tail_stored;
    /* blend: the prompt's content-defined chunk ends, the spans planned to come from the
     * content store (a record reference each), and the first slot whose KV is not what a full
     * prefill computes (prefix keys are stored only before it) */
    int *cuts;
    int n_cuts;
    blend_span *spans;
    int n_spans;
    int exact_end;
    int lossy_from; /* the first token whose KV came lossy from the Redis tier (INT_MAX: none) */
    float blend_ratio;
    blend_policy blend_policy;
    int blended, recomputed; /* tokens reused by content so far, and recomputed of them */
} plan_seq;

/* An empty plan with the prompt's prefix keys (pr's, copied). -1 when out of memory. */
int plan_seq_init(plan_seq *ps, const plan_req *pr);
void plan_seq_free(plan_seq *ps);
/* Forgets the blend spans (their KV is computed instead). */
void plan_seq_drop_spans(plan_seq *ps);
/* A sibling sharing `from`'s KV: exact no further than it. */
void plan_seq_share(plan_seq *ps, const plan_seq *from);

typedef struct planner planner;

/* The pool tier (with o->pool_tier) and, with o->blend_bytes, the content store. NULL with
 * err. */
planner *planner_create(const model *m, backend *b, kv_pool *pool, const plan_opts *o,
                        kv_error *err);
void planner_destroy(planner *p);
/* The pool tier, or NULL: the engine makes room in the pool with it. */
pool_cache *planner_pool(planner *p);
/* The content store, or NULL when blend is off. */
content_store *planner_content(planner *p);
/* A prefill step took dt_ns for n_tokens tokens: compute per token and layer, for the loading
 * controller and the Redis fetch's text cost (prefill-sized steps only). */
void planner_note_step(planner *p, uint64_t dt_ns, int n_tokens);
/* The least blend ratio of prompts that name none (the quality monitor's steps). */
void planner_set_blend_ratio(planner *p, float ratio);
double planner_ns_token_layer(const planner *p);
/* Any thread: ending sequences' last records not stored because the pool tier evicted their
 * blocks while they waited for the disk (plan_drain_tails). */
int64_t planner_tails_dropped(const planner *p);

/* Submitting thread: pr's keys over prompt[0..n_prompt) in namespace ns, and, with fetch, the
 * records that continue its prefix past the pool tier (RAM, disk, Redis, within the prefetch
 * budget and pr's policy; t_arrival starts the TTFT budget) and its content records from Redis.
 * A prompt with its own positions (Prompt Cache) or a scoring one (score: every row's logits)
 * reuses nothing. -1 when out of memory. */
int plan_prepare(planner *p, plan_req *pr, const cache_key *ns, const int32_t *prompt, int n_prompt,
                 bool positioned, bool score, uint64_t t_arrival, bool fetch);
/* Admission: the prompt's leading blocks the pool tier holds (shared, not allocated). */
int64_t plan_shared_blocks(planner *p, const plan_req *pr, bool score);

/* Gives a sequence holding no KV its longest cached prefix, to the token, into kv: pool blocks
 * by reference, then (first: the prompt's first choice, which uses them up) pr's fetched
 * records copied, then the pool tier's block that matches the most of the next tokens (by
 * reference, copied when written); at least the last of hist's n_hist tokens is left to
 * compute. Then plans the
 * blend of the prompt (hist[0..n_prompt)) past it: load_ns is the fusor's measured load time
 * per token and layer. Returns the tokens reused. */
int plan_reuse(planner *p, plan_seq *ps, plan_req *pr, kv_seq *kv, const int32_t *hist, int n_hist,
               int n_prompt, bool first, bool score, double load_ns);
/* After a step computed KV up to n_computed: registers the new full blocks in the pool tier and
 * stores each chunk they complete. */
void plan_write_back(planner *p, plan_seq *ps, const plan_req *pr, kv_seq *kv, const int32_t *hist,
                     int n_computed);
/* A sequence about to release its KV (ending, or preempted) with n_computed rows computed:
 * its partly filled last block goes to the pool tier with the rows it holds, so a prompt that
 * shares part of it reuses them (plan_reuse). Before plan_store_tail, which makes the prefix's
 * whole blocks more recently used than this one. */
void plan_keep_partial(planner *p, const plan_seq *ps, const plan_req *pr, const kv_seq *kv,
                       const int32_t *hist, int n_computed);
/* Stores the trailing partial chunk (when the prompt is computed, and before the sequence's KV
 * is released: ending), so the same prompt reuses it once the pool has let it go. As the
 * sequence ends, onto disk and not into RAM where there is a disk tier (the pool tier holds its
 * blocks). */
void plan_store_tail(planner *p, plan_seq *ps, const plan_req *pr, kv_seq *kv, bool ending);
/* Stores the ending sequences' tail records that wait for the disk's backlog to go down, oldest
 * first, while it stays under a chunk's record (all: every one, as the engine stops). Engine
 * thread. */
void plan_drain_tails(planner *p, bool all);
/* True while tail records wait (the engine then polls plan_drain_tails when idle). */
bool plan_tails_pending(const planner *p);
/* The prompt is computed (n_computed tokens): the KV of its content-defined chunks that a full
 * prefill computed goes to the content store (and its disk and Redis copies). first: the
 * prompt's first choice (the others share its KV). */
void plan_store_content(planner *p, plan_seq *ps, const plan_req *pr, kv_seq *kv,
                        const int32_t *prompt, int n_computed, bool first);
/* After a blended pass: records read whole from disk go to the RAM content store; when one
 * failed (failed: the pass's KV and logits are wrong), its spans are dropped and true returned:
 * the step runs the same tokens again, those spans computed. */
bool plan_settle(planner *p, plan_seq *ps, bool failed);

#endif
