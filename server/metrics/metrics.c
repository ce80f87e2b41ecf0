/* Prometheus metrics (server/metrics/metrics.h): the histograms, the registry the HTTP threads
 * (server/http/http.c) and the engine thread add samples to under one mutex, and its rendering
 * in Prometheus' text format for GET /metrics (server/api/routes.c). */
#include "server/metrics/metrics.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util/util.h"

/* ---------------------------------------------------------------- histograms */

#define HIST_MAX_BUCKETS 16

typedef struct histogram {
    const char *name;
    const char *help;
    const double *bounds; /* upper bounds (le), increasing; +Inf is implicit */
    int n_bounds;
    uint64_t counts[HIST_MAX_BUCKETS]; /* per bucket, not cumulative */
    uint64_t count;
    double sum;
} histogram;

/* Bucket bounds in seconds: TTFT spans cache hits (ms) to long CPU prefills (s); inter-token
 * latency is tens of ms per step on the CPU. */
static const double TTFT_BOUNDS[] = {0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
static const double ITL_BOUNDS[] = {0.005, 0.01, 0.02, 0.04, 0.06, 0.08,
                                    0.1,   0.15, 0.25, 0.5,  1,    2.5};
static const double E2E_BOUNDS[] = {0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300};

#define N_ELEMS(a) ((int)(sizeof(a) / sizeof((a)[0])))

static void hist_observe(histogram *h, double v) {
    int b = 0;
    while (b < h->n_bounds && v > h->bounds[b]) b++;
    h->counts[b]++;
    h->count++;
    h->sum += v;
}

/* ---------------------------------------------------------------- the registry */

#define MAX_REQUEST_SERIES 64

typedef struct request_series {
    char endpoint[48];
    int status;
    uint64_t count;
} request_series;

struct metrics {
    pthread_mutex_t mu;
    request_series req[MAX_REQUEST_SERIES];
    int n_req;
    uint64_t prompt_tokens, generated_tokens, preemptions;
    uint64_t blended_tokens, recomputed_tokens;
    uint64_t spec_drafted, spec_accepted;
    double spec_model_seconds;
    histogram ttft, itl, e2e;
    histogram ttft_reuse[METRICS_REUSE_COUNT]; /* one series per reuse class, same bounds */
    metrics_engine eng;
};

metrics *metrics_create(void) {
    metrics *m = calloc(1, sizeof *m);
    if (!m) return NULL;
    pthread_mutex_init(&m->mu, NULL);
    m->ttft = (histogram){.name = "kvserve_time_to_first_token_seconds",
                          .help = "Time from request arrival to its first generated token.",
                          .bounds = TTFT_BOUNDS,
                          .n_bounds = N_ELEMS(TTFT_BOUNDS)};
    for (int i = 0; i < METRICS_REUSE_COUNT; i++)
        m->ttft_reuse[i] = (histogram){
            .name = "kvserve_time_to_first_token_by_reuse_seconds",
            .help = "Time to first token by what the context cache gave the prompt: none, "
                    "cached (KV reused as stored), blend (reused by content).",
            .bounds = TTFT_BOUNDS,
            .n_bounds = N_ELEMS(TTFT_BOUNDS)};
    m->itl = (histogram){.name = "kvserve_inter_token_latency_seconds",
                         .help = "Time between consecutive tokens of one sequence.",
                         .bounds = ITL_BOUNDS,
                         .n_bounds = N_ELEMS(ITL_BOUNDS)};
    m->e2e = (histogram){.name = "kvserve_request_latency_seconds",
                         .help = "Time from request arrival to its last token.",
                         .bounds = E2E_BOUNDS,
                         .n_bounds = N_ELEMS(E2E_BOUNDS)};
    return m;
}

void metrics_destroy(metrics *m) {
    if (!m) return;
    pthread_mutex_destroy(&m->mu);
    free(m);
}

void metrics_request(metrics *m, const char *endpoint, int status) {
    pthread_mutex_lock(&m->mu);
    int i = 0;
    for (; i < m->n_req; i++)
        if (m->req[i].status == status && strcmp(m->req[i].endpoint, endpoint) == 0) break;
    if (i == m->n_req && m->n_req < MAX_REQUEST_SERIES) {
        /* Endpoints are the router's fixed names, so the series stay few; an overflow (never
         * expected) is folded into the last series rather than growing without bound. */
        snprintf(m->req[i].endpoint, sizeof m->req[i].endpoint, "%s", endpoint);
        m->req[i].status = status;
        m->n_req++;
    }
    if (i == MAX_REQUEST_SERIES) i--;
    m->req[i].count++;
    pthread_mutex_unlock(&m->mu);
}

void metrics_tokens(metrics *m, int64_t prompt_tokens, int64_t generated_tokens) {
    pthread_mutex_lock(&m->mu);
    m->prompt_tokens += (uint64_t)prompt_tokens;
    m->generated_tokens += (uint64_t)generated_tokens;
    pthread_mutex_unlock(&m->mu);
}

static void observe(metrics *m, histogram *h, double v) {
    pthread_mutex_lock(&m->mu);
    hist_observe(h, v);
    pthread_mutex_unlock(&m->mu);
}

void metrics_ttft(metrics *m, double seconds, metrics_reuse reuse) {
    if ((int)reuse < 0 || reuse >= METRICS_REUSE_COUNT) reuse = METRICS_REUSE_NONE;
    pthread_mutex_lock(&m->mu);
    hist_observe(&m->ttft, seconds);
    hist_observe(&m->ttft_reuse[reuse], seconds);
    pthread_mutex_unlock(&m->mu);
}
void metrics_itl(metrics *m, double seconds) { observe(m, &m->itl, seconds); }
void metrics_e2e(metrics *m, double seconds) { observe(m, &m->e2e, seconds); }

void metrics_preemption(metrics *m) {
    pthread_mutex_lock(&m->mu);
    m->preemptions++;
    pthread_mutex_unlock(&m->mu);
}

void metrics_blend(metrics *m, int64_t reused, int64_t recomputed) {
    pthread_mutex_lock(&m->mu);
    m->blended_tokens += (uint64_t)reused;
    m->recomputed_tokens += (uint64_t)recomputed;
    pthread_mutex_unlock(&m->mu);
}

void metrics_spec(metrics *m, int64_t drafted, int64_t accepted) {
    pthread_mutex_lock(&m->mu);
    m->spec_drafted += (uint64_t)drafted;
    m->spec_accepted += (uint64_t)accepted;
    pthread_mutex_unlock(&m->mu);
}

void metrics_spec_model(metrics *m, double seconds) {
    pthread_mutex_lock(&m->mu);
    m->spec_model_seconds += seconds;
    pthread_mutex_unlock(&m->mu);
}

void metrics_set_engine(metrics *m, const metrics_engine *e) {
    pthread_mutex_lock(&m->mu);
    m->eng = *e;
    pthread_mutex_unlock(&m->mu);
}

void metrics_get_engine(metrics *m, metrics_engine *out) {
    pthread_mutex_lock(&m->mu);
    *out = m->eng;
    pthread_mutex_unlock(&m->mu);
}

/* ---------------------------------------------------------------- rendering */

static void render_hist_head(kv_buf *b, const histogram *h) {
    kv_buf_printf(b, "# HELP %s %s\n# TYPE %s histogram\n", h->name, h->help, h->name);
}

/* One series of a histogram; labels: "" or `key="value"` (put before le). */
static void render_hist_series(kv_buf *b, const histogram *h, const char *labels) {
    const char *sep = labels[0] ? "," : "";
    uint64_t cum = 0;
    for (int i = 0; i < h->n_bounds; i++) {
        cum += h->counts[i];
        kv_buf_printf(b, "%s_bucket{%s%sle=\"%g\"} %llu\n", h->name, labels, sep, h->bounds[i],
                      (unsigned long long)cum);
    }
    kv_buf_printf(b, "%s_bucket{%s%sle=\"+Inf\"} %llu\n", h->name, labels, sep,
                  (unsigned long long)h->count);
    if (labels[0])
        kv_buf_printf(b, "%s_sum{%s} %.6f\n%s_count{%s} %llu\n", h->name, labels, h->sum, h->name,
                      labels, (unsigned long long)h->count);
    else
        kv_buf_printf(b, "%s_sum %.6f\n%s_count %llu\n", h->name, h->sum, h->name,
                      (unsigned long long)h->count);
}

static void render_hist(kv_buf *b, const histogram *h) {
    render_hist_head(b, h);
    render_hist_series(b, h, "");
}

static void render_counter(kv_buf *b, const char *name, const char *help, uint64_t v) {
    kv_buf_printf(b, "# HELP %s %s\n# TYPE %s counter\n%s %llu\n", name, help, name, name,
                  (unsigned long long)v);
}

static void render_gauge(kv_buf *b, const char *name, const char *help, double v) {
    kv_buf_printf(b, "# HELP %s %s\n# TYPE %s gauge\n%s %.17g\n", name, help, name, name, v);
}

char *metrics_render(metrics *m, size_t *len) {
    kv_buf b = {0};
    kv_buf_puts(&b, ""); /* the text exists (NUL-terminated) even with no line in it */
    pthread_mutex_lock(&m->mu);
    kv_buf_printf(&b, "# HELP kvserve_requests_total HTTP requests by endpoint and status.\n"
                      "# TYPE kvserve_requests_total counter\n");
    for (int i = 0; i < m->n_req; i++)
        kv_buf_printf(&b, "kvserve_requests_total{endpoint=\"%s\",status=\"%d\"} %llu\n",
                      m->req[i].endpoint, m->req[i].status, (unsigned long long)m->req[i].count);
    render_counter(&b, "kvserve_prompt_tokens_total", "Prompt tokens processed.", m->prompt_tokens);
    render_counter(&b, "kvserve_generation_tokens_total", "Tokens generated.", m->generated_tokens);
    render_counter(&b, "kvserve_preemptions_total",
                   "Sequences whose KV was dropped for lack of pool space and recomputed.",
                   m->preemptions);
    render_counter(&b, "kvserve_blend_tokens_total",
                   "Prompt tokens whose KV was reused by content (blend).", m->blended_tokens);
    render_counter(&b, "kvserve_blend_recomputed_tokens_total",
                   "Blended tokens recomputed up to the last layer.", m->recomputed_tokens);
    render_counter(&b, "kvserve_spec_draft_tokens_total",
                   "Draft tokens verified by speculation (context, prediction, draft model).",
                   m->spec_drafted);
    render_counter(&b, "kvserve_spec_accepted_tokens_total",
                   "Draft tokens the model kept (each one a decode step saved).", m->spec_accepted);
    render_gauge(&b, "kvserve_spec_acceptance_ratio",
                 "Share of draft tokens kept since the start (0 before any draft).",
                 m->spec_drafted ? (double)m->spec_accepted / (double)m->spec_drafted : 0);
    kv_buf_printf(&b,
                  "# HELP kvserve_spec_draft_model_seconds_total Time the draft model "
                  "(--draft-model) spent drafting.\n"
                  "# TYPE kvserve_spec_draft_model_seconds_total counter\n"
                  "kvserve_spec_draft_model_seconds_total %.17g\n",
                  m->spec_model_seconds);
    render_hist(&b, &m->ttft);
    static const char *const REUSE_LABELS[METRICS_REUSE_COUNT] = {
        "reuse=\"none\"", "reuse=\"cached\"", "reuse=\"blend\""};
    render_hist_head(&b, &m->ttft_reuse[0]);
    for (int i = 0; i < METRICS_REUSE_COUNT; i++)
        render_hist_series(&b, &m->ttft_reuse[i], REUSE_LABELS[i]);
    render_hist(&b, &m->itl);
    render_hist(&b, &m->e2e);
    const metrics_engine *e = &m->eng;
    render_gauge(&b, "kvserve_queue_depth", "Requests waiting for a batch slot.", e->waiting);
    render_gauge(&b, "kvserve_running_sequences", "Sequences in the running batch.", e->running);
    render_gauge(&b, "kvserve_kv_pool_blocks_used", "KV pool blocks in use.",
                 (double)e->kv_blocks_used);
    render_gauge(&b, "kvserve_kv_pool_blocks_cached",
                 "KV pool blocks holding cached chunks (evictable unless also in use).",
                 (double)e->kv_blocks_cached);
    render_gauge(&b, "kvserve_kv_pool_blocks_total", "KV pool blocks in all.",
                 (double)e->kv_blocks_total);
    render_gauge(&b, "kvserve_kv_pool_usage_ratio", "Share of the KV pool in use (0..1).",
                 e->kv_blocks_total ? (double)e->kv_blocks_used / (double)e->kv_blocks_total : 0);
    render_gauge(&b, "kvserve_kv_block_tokens", "Tokens per KV pool block.", e->kv_block_tokens);
    if (e->draft_blocks_total > 0)
        render_gauge(&b, "kvserve_draft_kv_pool_blocks_used",
                     "Blocks of the draft model's KV pool in use (--draft-model).",
                     (double)e->draft_blocks_used);
    pthread_mutex_unlock(&m->mu);
    if (b.oom) {
        free(b.p);
        return NULL;
    }
    *len = b.len;
    return b.p;
}
