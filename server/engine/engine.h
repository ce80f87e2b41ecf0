/* The engine: one thread that owns the backend, the KV pool and the running batch, and serves
 * generation requests by continuous batching. Every step runs one forward pass over all running
 * sequences (one decode token each) plus up to prefill_chunk prompt tokens of sequences still
 * prefilling, so a long prompt is interleaved with decode instead of stalling the streams.
 *
 * HTTP threads build a gen_request, submit it, and read its choices as they grow (under the
 * request's mutex; at every change the condition variable is signalled and the request's notify
 * hook, if any, is called, which is how a suspended connection is resumed). A request is
 * reference counted: the submitter holds one reference, the engine another until it is done
 * with it. */
#ifndef KVSERVE_ENGINE_H
#define KVSERVE_ENGINE_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "cache/blend/blend.h"
#include "cache/cache.h"
#include "cache/plan.h"
#include "cache/quality.h"
#include "cache/schema/schema.h"
#include "model/grammar/grammar.h"
#include "model/model.h"
#include "model/sampler.h"
#include "server/metrics/metrics.h"

#define GEN_MAX_TOP_LOGPROBS 20

typedef enum gen_pooling {
    GEN_POOL_NONE = 0, /* not an embedding request */
    GEN_POOL_MEAN,
    GEN_POOL_LAST, /* e5-mistral-style models */
    GEN_POOL_CLS,  /* the first token */
} gen_pooling;

typedef enum gen_finish {
    GEN_RUNNING = 0,
    GEN_FINISH_STOP,   /* end-of-generation token or a stop string */
    GEN_FINISH_LENGTH, /* max_tokens or the context's end */
    GEN_FINISH_ERROR,  /* see gen_request.error */
} gen_finish;

/* A sampled token with its log-probability (under the model's unmodified distribution) and
 * the most likely alternatives. */
typedef struct gen_logprob {
    int32_t token;
    float logprob;
    int n_top;
    int32_t top_ids[GEN_MAX_TOP_LOGPROBS];
    float top_lps[GEN_MAX_TOP_LOGPROBS];
} gen_logprob;

/* One choice's output so far. Written by the engine under the request's mutex. */
typedef struct gen_choice {
    char *text; /* text released so far (never a possible stop-string prefix), NUL-terminated */
    size_t len, cap;
    gen_logprob *lps; /* one per generated token, when the request asked for logprobs */
    int n_lps, cap_lps;
    int n_tokens; /* completion tokens (including an end-of-generation token) */
    gen_finish finish;
    int stop_string; /* a stop finish on a stop string: 1 + its index in the request's; else 0 */
} gen_choice;

typedef struct gen_request {
    /* ---- input: set before engine_submit, read-only afterwards */
    int32_t *prompt; /* [n_prompt] ids, owned */
    int n_prompt;
    int n_choices;
    int max_tokens;    /* >= 0 (0: score the prompt only); also stops at the context's end */
    sampler_params sp; /* sp.bias points at bias */
    logit_bias *bias;  /* owned */
    stop_set stops;    /* owned */
    bool logprobs;     /* record gen_logprob for each token */
    int top_logprobs;  /* 0..GEN_MAX_TOP_LOGPROBS */
    bool ignore_eos;   /* keep going past end-of-generation tokens */
    /* Constrained decoding: every token is masked by the grammar (owned; the engine thread is
     * the matcher's only user once submitted). The choice ends (stop) when the grammar is
     * complete. With jump_forward, bytes the grammar forces go in as one prefill step. */
    grammar *grammar;
    gmatch *gm;
    bool jump_forward;
    /* Tool calls in this format are guarded (chat_tool_guard): a call that repeats an earlier
     * one of the answer ends it instead, after the calls before it (stop). */
    bool guard_calls;
    chat_tool_format call_format;
    /* Embedding (max_tokens 0, one choice): the prompt's final hidden states (after the output
     * norm) pooled, L2-normalized into embedding (malloc'd [dim] by the submitter, written before
     * the choice finishes); the sequence keeps no KV afterwards and stores nothing in the cache. */
    gen_pooling pooling;
    float *embedding;
    /* Score the prompt: prompt_lps[i] (i >= 1) is token i's logprob given the tokens before it,
     * with top_logprobs alternatives; written before prompt_lps_ready is set (under mu). */
    bool prompt_logprobs;
    uint64_t t_arrival; /* clock_now_ns() at arrival, for TTFT */
    /* The tenant it came from (DESIGN.md "Tenants": its API key's index, 0 without keys), below
     * engine_opts' n_tenants: whose share of the queue it takes, and whose turn admits it. */
    int tenant;
    /* Speculation (server/engine/spec.h): false keeps this request's choices from drafting
     * (the server's --spec off does for all). prediction: OpenAI's Predicted Outputs, the
     * expected output's tokens (owned, or NULL), drafted from where the output matches it. */
    bool speculative;
    int32_t *prediction;
    int n_prediction;
    /* Context cache and blend: the request's choices (kv_level, kv_lossless, ttft_budget_ms,
     * blend, blend_ratio, bounds), then what engine_prepare_cache found (cache/plan.h; the engine
     * must outlive the request, whose fetched records count against its budget). */
    plan_req plan;
    /* Prompt Cache (cache/schema/schema.h): the prompt tokens' RoPE positions (NULL: token i at
     * position i) and the KV its first skv->n_slots slots take from schema records at
     * admission instead of computing it (or, with skv->fixup >= 0, blend). A precompute
     * (max_tokens 0) stores its skv's export slots as records once computed; export_failed
     * says it could not. A sequence with positions stores no prefix keys. Both owned. */
    int32_t *pos;
    schema_kv *skv;

    /* ---- shared with the engine, under mu */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    gen_choice *choices; /* [n_choices] */
    int n_finished;
    int error_status; /* HTTP status for GEN_FINISH_ERROR (500, 503) */
    char error[256];
    uint64_t t_first_token;
    gen_logprob *prompt_lps; /* [n_prompt] when prompt_logprobs; entry 0 is unused */
    bool prompt_lps_ready;
    int cached_tokens;      /* prompt tokens whose KV came from the cache */
    int blended_tokens;     /* of the prompt, tokens reused by content (blend) */
    int recomputed_tokens;  /* of those, recomputed up to the last layer */
    float blend_ratio_used; /* the recompute ratio the blend ran at */
    int blend_policy_used;  /* the selection policy it ran (blend_policy) */
    bool export_failed;     /* a precompute's records could not be stored (error says why) */
    /* Speculation over every choice: draft tokens verified and kept, and of those the ones
     * that came from the prediction (OpenAI's accepted/rejected_prediction_tokens) */
    int spec_drafted, spec_accepted;
    int pred_accepted, pred_rejected;
    atomic_bool cancelled; /* the client went away: the engine frees its sequences */
    atomic_int refs;
    /* Called (under mu, from the engine thread) after every change, beside the condition
     * variable: the HTTP side resumes the connection waiting on the request. Must not block. */
    void (*notify)(void *arg, const struct gen_request *r);
    void *notify_arg;

    /* ---- the engine's, under its queue lock: the next request of the group r was submitted
     * in (engine_submit_group), admitted after r */
    struct gen_request *group_next;
} gen_request;

/* A request with n_choices empty choices and one reference; NULL when out of memory. The
 * caller fills prompt, sampling and the rest, then submits. */
gen_request *gen_request_create(int n_choices);
void gen_request_unref(gen_request *r);
/* Waits (up to timeout_ms) for a change to r; call with r->mu held. */
void gen_request_wait(gen_request *r, int timeout_ms);
/* Sets (fn non-NULL) or clears r's change notification. Once cleared, fn is never called again
 * (the engine calls it under r->mu, which this takes). */
void gen_request_watch(gen_request *r, void (*fn)(void *arg, const gen_request *r), void *arg);

typedef struct engine_opts {
    const char *device; /* backend_create's name: auto|cuda|cpu (NULL: auto) */
    int threads;
    bool precise;
    bool no_cuda_graphs;    /* CUDA: every decode step's kernels launched one by one */
    int ctx;                /* per-sequence context in tokens */
    int64_t kv_pool_tokens; /* pool size; at least ctx */
    int max_seqs;
    int max_queue;
    /* Tenants (0 or 1: one): each queues at most tenant_queue_share percent of max_queue (0: an
     * equal part, at least one request), and they are admitted in turn (server/engine/fairq.h). */
    int n_tenants;
    int tenant_queue_share;
    int prefill_chunk;
    bool spec; /* speculation from the context (--spec context); requests may opt out */
    /* The draft model (--draft-model; the caller's, outliving the engine), or NULL: with spec,
     * it drafts where a request's prediction and a long context match do not (speculate.c's
     * eseq_spec_propose). engine_create refuses one whose vocabulary is not the model's. */
    const model *draft;
    /* context cache */
    cache_store *store; /* RAM/disk tiers, or NULL */
    int chunk_tokens;   /* 0: no context cache */
    bool pool_cache;    /* keep cached chunks' blocks in the pool */
    /* Chunks fetched for queued requests are held outside the store's caps until admission:
     * at most this many bytes (0: 1 GiB). Beyond it a request recomputes instead. */
    int64_t prefetch_bytes;
    /* blend: the content store's cap in bytes (0: no blend), the least recompute ratio the
     * loading controller picks, and the most tokens one blended prefill step takes */
    int64_t blend_bytes;
    float blend_ratio;
    blend_policy blend_policy; /* which reused tokens are recomputed */
    int blend_chunk;
    content_disk *blend_disk; /* content records on disk (the caller's), or NULL */
    int64_t ttft_budget_ms;   /* Redis fetches: the default budget (0: none, lossless) */
    uint32_t levels_barred;   /* lossy encodings a budget may not choose (cache_fetch_policy) */
    /* The live check (cache/quality.h): this share (0..1) of the requests that blended at the
     * server's setting is computed again as a full prefill while no client request runs or
     * waits, and their first-token distributions compared; the monitor (started at the
     * server's setting; off: no check) steps the blend ratio when the rolling figures leave the
     * budget, and back when they return. */
    double quality_sample;
    quality_monitor monitor;
    /* Repairs: a prompt that blended (its blended KV is never stored, so a repeat of it would
     * blend again) is computed again as a full prefill when the engine is idle, as a check is,
     * and its chunks stored as any exact prompt's are; a repeat then reuses its whole KV. */
    bool blend_repair;
} engine_opts;

typedef struct engine engine;

/* Creates the backend, pool and forward context and starts the engine thread. */
engine *engine_create(const model *m, const engine_opts *o, metrics *mx, kv_error *err);
/* Stops the thread: running and queued requests end with a 503 error, later submissions are
 * refused. Idempotent; the engine stays valid until engine_destroy. */
void engine_stop(engine *e);
/* Stops (if still running) and frees everything. */
void engine_destroy(engine *e);

typedef enum engine_submit_status {
    ENGINE_SUBMIT_OK = 0,
    ENGINE_SUBMIT_QUEUE_FULL,    /* 429: try again later */
    ENGINE_SUBMIT_SHUTTING_DOWN, /* 503 */
    ENGINE_SUBMIT_INVALID,       /* 400: err says why (n over max_seqs, context, token ids) */
    ENGINE_SUBMIT_NO_MEMORY,     /* 503: the queue could not grow */
} engine_submit_status;

/* Queues r (the engine takes its own reference). A tenant whose share of the queue is full gets
 * ENGINE_SUBMIT_QUEUE_FULL while the others still get in. */
engine_submit_status engine_submit(engine *e, gen_request *r, kv_error *err);
/* Queues rs[0..n) (a client request's embedding inputs or prompts) as one group: it takes one
 * place in the queue, whatever n, so one request is one admission, and --max-queue bounds the
 * client requests waiting, not their inputs. The group's requests are admitted in order as
 * sequence slots and KV allow, one per turn: after each, the rest of the group goes back
 * behind the requests queued after it, so a group of many inputs shares the batch with them
 * instead of holding it until its last input is admitted. All are queued, or (any invalid, the
 * queue full, shutting down) none; err then names the first invalid one by its index. */
engine_submit_status engine_submit_group(engine *e, gen_request *const *rs, int n, kv_error *err);

/* Context cache. On the submitting thread, before engine_submit: computes r's prefix keys in
 * namespace ns and (fetch) fetches the chunks the pool does not hold from the store (RAM, or
 * disk in parallel reads: this blocks on I/O here, not on the engine thread), within the
 * prefetch budget and not when the queue is full (the submission would be refused). No-op when
 * the engine has no context cache. -1 when out of memory. */
int engine_prepare_cache(engine *e, gen_request *r, const cache_key *ns, bool fetch);
/* Drops the pool tier's chunks of namespace ns (NULL: all); returns how many. */
int64_t engine_cache_clear(engine *e, const cache_key *ns);
/* Drops blend's content records of namespace ns (NULL: all) from RAM and/or disk. */
void engine_blend_clear(engine *e, const cache_key *ns, bool ram, bool disk, int64_t *n_ram,
                        int64_t *n_disk);
typedef struct engine_cache_stats {
    bool enabled;
    int chunk_tokens;
    int64_t pool_entries, pool_blocks, pool_hits, pool_misses, pool_evictions;
    int64_t pool_partial, pool_partial_hits; /* reuse to the token (pool_cache.h) */
    int64_t reused_tokens;
    int64_t blended_tokens, recomputed_tokens;
    int64_t tails_dropped;         /* last records the pool evicted before the disk took them */
    cache_tier_stats content;      /* the blend content store (RAM) */
    cache_tier_stats content_disk; /* its records on disk */
} engine_cache_stats;
void engine_cache_stats_get(engine *e, engine_cache_stats *out);

/* The live check's figures. */
typedef struct engine_quality_stats {
    bool on;     /* a blend setting is watched */
    float ratio; /* the blend ratio in force */
    blend_policy policy;
    double sample;                   /* the share of blended requests checked */
    int64_t sampled;                 /* requests picked for a check */
    int64_t checked;                 /* checks done (a full prefill compared) */
    int64_t dropped;                 /* picked with the check queue full */
    int64_t abandoned;               /* checks given up for a client request (retried later) */
    double mean_kl, mean_top1;       /* over every check */
    double rolling_kl, rolling_top1; /* the last full window's (0 before one) */
    int64_t steps_up, steps_down;
    char last_step[300];    /* the last step, with its numbers, or "" */
    int64_t repaired;       /* blended prompts computed again in full and stored */
    int64_t repair_dropped; /* blended prompts not repaired: the queue was full */
} engine_quality_stats;
void engine_quality_stats_get(engine *e, engine_quality_stats *out);

/* Tenant t's requests waiting in the queue and sequences running (0 for one out of range), and
 * the most requests its share lets it queue. */
typedef struct engine_tenant_stats {
    int waiting, running, queue_share;
} engine_tenant_stats;
void engine_tenant_stats_get(engine *e, int t, engine_tenant_stats *out);

int engine_ctx(const engine *e);
int engine_max_seqs(const engine *e);
const char *engine_backend_name(const engine *e);
int64_t engine_kv_pool_tokens(const engine *e);
int engine_threads(const engine *e);

/* Speculation: on (--spec context), and draft tokens verified and kept since the start; the
 * draft model's file (NULL: none), the seconds its drafting took and, of the draft tokens,
 * those it drafted and those of them kept. */
typedef struct engine_spec_stats {
    bool on;
    int64_t drafted, accepted;
    const char *draft_model;
    double draft_seconds;
    int64_t model_drafted, model_accepted;
} engine_spec_stats;
void engine_spec_stats_get(engine *e, engine_spec_stats *out);

#endif
