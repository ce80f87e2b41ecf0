/* Server metrics in Prometheus' text exposition format (GET /metrics): request counts by
 * endpoint and status, token counts, time-to-first-token (also split by what the context cache
 * gave the prompt), inter-token latency and end-to-end latency histograms, and the engine's gauges
 * (queue depth, running sequences, KV pool use). Updated from HTTP threads and the engine thread;
 * one mutex, held only to add a sample. */
#ifndef KVSERVE_METRICS_H
#define KVSERVE_METRICS_H

#include <stddef.h>
#include <stdint.h>

typedef struct metrics metrics;

metrics *metrics_create(void);
void metrics_destroy(metrics *m);

/* One finished HTTP request (endpoint as routed, e.g. "/v1/chat/completions"). */
void metrics_request(metrics *m, const char *endpoint, int status);
void metrics_tokens(metrics *m, int64_t prompt_tokens, int64_t generated_tokens);
/* What the context cache gave a request's prompt, for TTFT with and without reuse. */
typedef enum metrics_reuse {
    METRICS_REUSE_NONE = 0, /* every prompt token computed */
    METRICS_REUSE_CACHED,   /* some tokens' KV reused as stored (a prefix, schema modules) */
    METRICS_REUSE_BLEND,    /* some tokens reused by content (blend), maybe with cached ones */
    METRICS_REUSE_COUNT,
} metrics_reuse;

/* A request's first token: in the overall TTFT histogram and in the one of its reuse class. */
void metrics_ttft(metrics *m, double seconds, metrics_reuse reuse);
void metrics_itl(metrics *m, double seconds);
void metrics_e2e(metrics *m, double seconds);
void metrics_preemption(metrics *m);
/* One blended prefill step: prompt tokens reused by content, and how many of them were
 * recomputed up to the last layer. */
void metrics_blend(metrics *m, int64_t reused, int64_t recomputed);
/* One verify step of speculation: draft tokens verified, and how many the model kept. */
void metrics_spec(metrics *m, int64_t drafted, int64_t accepted);
/* One step's drafting by the draft model (--draft-model): the seconds it took. */
void metrics_spec_model(metrics *m, double seconds);

typedef struct metrics_engine {
    int waiting;              /* requests queued, not yet admitted */
    int running;              /* sequences in the batch */
    int64_t kv_blocks_used;   /* held by sequences (cached blocks no sequence uses: free) */
    int64_t kv_blocks_cached; /* held by the context cache's pool tier (some also in use) */
    int64_t kv_blocks_total;
    int kv_block_tokens;
    int64_t draft_blocks_used, draft_blocks_total; /* the draft model's pool (0: none) */
} metrics_engine;

void metrics_set_engine(metrics *m, const metrics_engine *e);
/* The gauges as the engine last set them (all 0 before it first did). */
void metrics_get_engine(metrics *m, metrics_engine *out);

/* The exposition text, malloc'd (length in *len), or NULL when out of memory. */
char *metrics_render(metrics *m, size_t *len);

#endif
