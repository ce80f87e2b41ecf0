/* The engine thread: admission, continuous batching, sampling and output of every sequence.
 *
 * A sequence (one choice of a request) holds its whole token history, prompt and generated, and
 * how much of it has KV in the pool (n_computed). Each step gives every sequence with one token
 * pending (decode) that token, and shares prefill_chunk tokens among sequences with more pending
 * (prefill), oldest first. A sequence whose pending tokens all ran samples its next token from
 * the step's logits. The same rule covers preemption: when the pool is full, the youngest
 * sequence's KV is dropped (n_computed = 0) and it re-prefills its history later, as vLLM's
 * recompute preemption does, so its output is unchanged.
 *
 * The n choices of a request prefill the prompt once: the first choice computes it, the others
 * fork its KV blocks (shared by reference count) when it samples its first token. */
#include "server/engine/engine.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "server/engine/draft.h"
#include "server/engine/spec.h"

/* ---------------------------------------------------------------- requests */

gen_request *gen_request_create(int n_choices) {
    if (n_choices < 1) return NULL;
    gen_request *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    plan_req_init(&r->plan);
    if (!(r->choices = calloc((size_t)n_choices, sizeof *r->choices))) {
        free(r);
        return NULL;
    }
    r->n_choices = n_choices;
    pthread_mutex_init(&r->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&r->cv, &ca);
    pthread_condattr_destroy(&ca);
    atomic_init(&r->cancelled, false);
    atomic_init(&r->refs, 1);
    sampler_params_default(&r->sp);
    r->speculative = true;
    return r;
}

void gen_request_unref(gen_request *r) {
    if (!r || atomic_fetch_sub(&r->refs, 1) != 1) return;
    for (int i = 0; i < r->n_choices; i++) {
        free(r->choices[i].text);
        free(r->choices[i].lps);
    }
    free(r->choices);
    free(r->prompt_lps);
    free(r->prompt);
    free(r->prediction);
    free(r->pos);
    schema_kv_free(r->skv);
    plan_req_free(&r->plan);
    free(r->bias);
    free(r->embedding);
    stop_set_free(&r->stops);
    gmatch_destroy(r->gm);
    grammar_destroy(r->grammar);
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
    free(r);
}

/* The time ns nanoseconds from now on clock c: a pthread_cond_timedwait deadline. */
static struct timespec deadline_in(clockid_t c, int64_t ns) {
    struct timespec ts;
    clock_gettime(c, &ts);
    ns += ts.tv_nsec;
    ts.tv_sec += (time_t)(ns / 1000000000L);
    ts.tv_nsec = (long)(ns % 1000000000L);
    return ts;
}

void gen_request_wait(gen_request *r, int timeout_ms) {
    struct timespec ts = deadline_in(CLOCK_MONOTONIC, (int64_t)timeout_ms * 1000000L);
    pthread_cond_timedwait(&r->cv, &r->mu, &ts);
}

void gen_request_watch(gen_request *r, void (*fn)(void *arg, const gen_request *r), void *arg) {
    pthread_mutex_lock(&r->mu);
    r->notify = fn;
    r->notify_arg = arg;
    pthread_mutex_unlock(&r->mu);
}

/* Wakes whoever waits on r (call with r->mu held). */
static void gen_request_changed(gen_request *r) {
    pthread_cond_broadcast(&r->cv);
    if (r->notify) r->notify(r->notify_arg, r);
}

/* Appends to a choice (under r->mu). Returns -1 when out of memory. */
static int choice_append_text(gen_choice *c, const char *s, size_t n) {
    if (c->len + n + 1 > c->cap) {
        size_t cap = (c->len + n + 1) * 2;
        char *t = realloc(c->text, cap);
        if (!t) return -1;
        c->text = t;
        c->cap = cap;
    }
    memcpy(c->text + c->len, s, n);
    c->len += n;
    c->text[c->len] = '\0';
    return 0;
}

static int choice_append_logprob(gen_choice *c, const gen_logprob *lp) {
    if (c->n_lps == c->cap_lps) {
        int cap = c->cap_lps ? c->cap_lps * 2 : 16;
        gen_logprob *t = realloc(c->lps, sizeof *t * (size_t)cap);
        if (!t) return -1;
        c->lps = t;
        c->cap_lps = cap;
    }
    c->lps[c->n_lps++] = *lp;
    return 0;
}

/* ---------------------------------------------------------------- sequences */

typedef struct eseq {
    gen_request *req; /* one reference held */
    int choice;
    kv_seq kv;
    bool wait_fork; /* a sibling choice waiting for the first choice's prompt KV */
    bool forked;    /* first choice: its siblings have been forked */
    int32_t *hist;  /* prompt + generated tokens */
    int32_t *pos;   /* their positions (Prompt Cache), or NULL: token i at position i */
    int n_hist, cap_hist;
    int n_computed; /* leading tokens of hist whose KV is in the pool */
    sampler *smp;
    /* the grammar's state after hist's generated tokens: preemption keeps them (it recomputes
     * their KV only), so the state needs no rollback */
    int32_t gstate;
    chat_tool_guard *guard; /* the request's guard_calls, or NULL */
    double *pooled; /* embedding: [dim] sum (mean) or the chosen row of normed hidden states */
    detok_state ds;
    char *gen; /* everything detokenized so far (the stop-string scan reads it) */
    size_t gen_len, gen_cap, emitted;
    int n_gen;
    uint64_t t_last_token;
    uint64_t admit_order; /* older sequences have priority for KV */
    bool preempted;       /* its KV was dropped; it has not yet recomputed its history */
    bool done;
    bool reuse_tried; /* looked up since it last held no KV */
    plan_seq ps;      /* the context cache's and blend's side of it (cache/plan.h) */
    spec_seq spec;    /* its drafting (server/engine/spec.h) */
    draft_seq dkv;    /* the draft model's KV of its history (server/engine/draft.h) */
    int n_draft;      /* this step: draft tokens staged after its history */
    bool want_model;  /* this step: its draft is the draft model's to make */
    bool by_model;    /* the draft being verified is the draft model's */
} eseq;

/* Work for the idle engine: the live check (cache/quality.h), where a request picked for it
 * leaves its prompt and its first token's top logprobs here until the engine is idle, when the
 * prompt is computed again as a full prefill and the two compared; and repairs (engine_opts'
 * blend_repair), where a prompt that blended is computed again in full and its chunks stored,
 * so a repeat of it reuses its whole KV exactly. One full prefill serves both. */
#define SHADOW_CAP 8
/* A check's prefill steps are this short: the longest a client request arriving meanwhile
 * waits before the check gives way to it. */
#define SHADOW_STEP 128

typedef struct shadow {
    int32_t *prompt; /* [n_prompt], owned */
    int n_prompt;
    bool check;        /* compared with first */
    gen_logprob first; /* the blended request's first token: its top logprobs */
    bool repair;       /* its chunks stored, in namespace ns, cut at bounds (owned) as before */
    cache_key ns;
    int *bounds;
    int n_bounds;
} shadow;

struct engine {
    const model *m;
    engine_opts o;
    metrics *mx;
    backend *b;
    kv_pool *pool;
    forward_ctx *fwd;
    float *logits; /* [max_seqs][n_vocab] one row per batch entry */
    float *work;   /* [n_vocab] a sibling's copy of the logits */

    pthread_t thread;
    bool thread_started;
    pthread_mutex_t mu; /* guards the queue and stopping */
    pthread_cond_t cv;
    gen_request **queue; /* FIFO ring of waiting requests */
    int q_head, q_len, q_cap;
    bool stopping;

    /* engine thread only */
    eseq **run; /* admitted sequences in admission order */
    int n_run;
    uint64_t admit_counter;
    planner *plan;              /* the context cache's reuse planner, or NULL: no cache */
    atomic_llong reused_tokens; /* prompt tokens served from the cache */
    atomic_llong spec_drafted, spec_accepted;
    draft_model *draft;                         /* --draft-model, or NULL */
    atomic_llong draft_ns;                      /* time its drafting took */
    atomic_llong model_drafted, model_accepted; /* of spec_drafted/accepted, its tokens */
    draft_job *djobs;                           /* [max_seqs] this step's draft-model drafts */
    eseq **dseqs;                               /* [max_seqs] their sequences */
    batch_seq *batch;                           /* [max_seqs] */
    eseq **batch_seqs;                          /* [max_seqs] */
    int32_t *batch_pos;                         /* [fwd_tokens] */
    int fwd_tokens;                             /* tokens one step may hold */
    /* blend */
    blend_fusor *fus;   /* NULL: no blend */
    blend_entry *bents; /* [max_seqs] this step's blended entries */
    blend_span *bspans; /* [bspans_cap] their spans, clipped to the step */
    int bspans_cap;
    atomic_llong blended_tokens, recomputed_tokens;
    int n_batch; /* entries in this step's batch (the pooling hook reads it) */
    /* the live check: checks waiting for an idle engine (oldest first), the running one's
     * request (NULL: none), the share picked so far; the monitor and the counters under qmu
     * (the stats read them) */
    shadow shadows[SHADOW_CAP];
    int n_shadows;
    gen_request *shadow_req;
    double q_acc;
    pthread_mutex_t qmu;
    quality_monitor mon;
    int64_t q_sampled, q_checked, q_dropped, q_abandoned;
    int64_t repaired, repair_dropped;
    double q_kl_sum, q_top1_sum;
    char q_last_step[300];
};

/* The pool tier, or NULL. */
static pool_cache *pool_tier(const engine *e) { return e->plan ? planner_pool(e->plan) : NULL; }

/* True when batch entry i blended in this step's pass and the pass failed it (plan_settle). */
static bool blend_failed(const engine *e, int i, int n_be) {
    for (int k = 0; k < n_be; k++)
        if (e->bents[k].entry == i) return e->bents[k].failed;
    return false;
}

static void eseq_destroy(engine *e, eseq *s) {
    if (!s) return;
    kv_seq_release(e->pool, &s->kv);
    if (e->draft) draft_seq_release(e->draft, &s->dkv);
    sampler_destroy(s->smp);
    plan_seq_free(&s->ps);
    spec_seq_free(&s->spec);
    free(s->pooled);
    free(s->hist);
    free(s->pos);
    free(s->gen);
    if (s->guard) chat_tool_guard_free(s->guard);
    free(s->guard);
    gen_request_unref(s->req);
    free(s);
}

static eseq *eseq_create(engine *e, gen_request *r, int choice, kv_error *err) {
    eseq *s = calloc(1, sizeof *s);
    if (!s) goto oom;
    kv_seq_init(&s->kv);
    draft_seq_init(&s->dkv);
    s->req = r;
    atomic_fetch_add(&r->refs, 1);
    s->choice = choice;
    s->wait_fork = choice > 0;
    s->cap_hist = r->n_prompt + 64;
    if (!(s->hist = malloc(sizeof(int32_t) * (size_t)s->cap_hist))) goto oom;
    memcpy(s->hist, r->prompt, sizeof(int32_t) * (size_t)r->n_prompt);
    s->n_hist = r->n_prompt;
    if (r->pos) {
        if (!(s->pos = malloc(sizeof(int32_t) * (size_t)s->cap_hist))) goto oom;
        memcpy(s->pos, r->pos, sizeof(int32_t) * (size_t)r->n_prompt);
    }
    if (plan_seq_init(&s->ps, &r->plan)) goto oom;
    /* embeddings and prompt-only requests generate nothing to draft */
    if (spec_seq_init(&s->spec, e->o.spec && r->speculative && r->max_tokens > 0, r->prediction,
                      r->n_prediction))
        goto oom;
    sampler_params sp = r->sp;
    sp.seed += (uint64_t)choice; /* n choices from one seed differ, reproducibly */
    if (!(s->smp = sampler_create(&sp, e->m->hp.n_vocab, err))) {
        eseq_destroy(e, s);
        return NULL;
    }
    detok_init(&s->ds);
    if (r->guard_calls) {
        if (!(s->guard = malloc(sizeof *s->guard))) goto oom;
        chat_tool_guard_init(s->guard, r->call_format);
    }
    if (r->pooling && !(s->pooled = calloc((size_t)e->m->hp.dim, sizeof *s->pooled))) goto oom;
    if (r->gm && (s->gstate = gmatch_start(r->gm)) < 0) {
        kv_fail(err, "the grammar is too complex to match");
        eseq_destroy(e, s);
        return NULL;
    }
    s->admit_order = e->admit_counter++;
    return s;
oom:
    kv_fail(err, "out of memory");
    eseq_destroy(e, s);
    return NULL;
}

static bool cache_on(const engine *e, const eseq *s);

/* Ends one choice: publishes the finish (and, for errors, the request's error) and wakes the
 * reader. The sequence's KV is released at once. */
static void eseq_finish(engine *e, eseq *s, gen_finish fin, int status, const char *msg) {
    gen_request *r = s->req;
    pthread_mutex_lock(&r->mu);
    gen_choice *c = &r->choices[s->choice];
    bool last = false;
    if (c->finish == GEN_RUNNING) {
        c->finish = fin;
        last = ++r->n_finished == r->n_choices;
        if (fin == GEN_FINISH_ERROR && !r->error_status) {
            r->error_status = status;
            snprintf(r->error, sizeof r->error, "%s", msg);
        }
    }
    gen_request_changed(r);
    pthread_mutex_unlock(&r->mu);
    if (last) metrics_e2e(e->mx, (double)(clock_now_ns() - r->t_arrival) / 1e9);
    if (!s->done && cache_on(e, s)) plan_store_tail(e->plan, &s->ps, &r->plan, &s->kv, true);
    kv_seq_release(e->pool, &s->kv);
    if (e->draft) draft_seq_release(e->draft, &s->dkv);
    s->done = true;
}

/* Ends every choice of a request still waiting in the queue (no sequences exist yet). */
static void request_fail(gen_request *r, int status, const char *msg) {
    pthread_mutex_lock(&r->mu);
    for (int i = 0; i < r->n_choices; i++)
        if (r->choices[i].finish == GEN_RUNNING) {
            r->choices[i].finish = GEN_FINISH_ERROR;
            r->n_finished++;
        }
    r->error_status = status;
    snprintf(r->error, sizeof r->error, "%s", msg);
    gen_request_changed(r);
    pthread_mutex_unlock(&r->mu);
}

/* ---------------------------------------------------------------- sampling and output */

/* The k most likely tokens and their log-probabilities under softmax(logits); returns the
 * log-sum-exp, so a given token's logprob is logits[t] - lse. */
static double log_sum_exp(const float *logits, int n);

static double top_logprobs(const float *logits, int n_vocab, int k, gen_logprob *out) {
    double lse = log_sum_exp(logits, n_vocab);
    int n = sampler_top_ids(logits, n_vocab, k, out->top_ids);
    out->n_top = n;
    for (int i = 0; i < n; i++) out->top_lps[i] = (float)(logits[out->top_ids[i]] - lse);
    return lse;
}

static double log_sum_exp(const float *logits, int n) {
    float mx = -INFINITY;
    for (int i = 0; i < n; i++)
        if (logits[i] > mx) mx = logits[i];
    double sum = 0;
    for (int i = 0; i < n; i++) sum += exp((double)logits[i] - mx);
    return mx + log(sum);
}

/* Prompt scoring: rows [0, n) are the logits after prompt tokens kv_start.. kv_start + n - 1,
 * so row k gives the logprob of the prompt token that follows it. Published (under the
 * request's mutex) once the whole prompt has been scored. */
static void score_prompt_rows(engine *e, eseq *s, int kv_start, int n, const float *rows) {
    gen_request *r = s->req;
    size_t n_vocab = (size_t)e->m->hp.n_vocab;
    for (int k = 0; k < n; k++) {
        int t = kv_start + k + 1;
        if (t >= r->n_prompt) break;
        const float *row = rows + (size_t)k * n_vocab;
        gen_logprob *lp = &r->prompt_lps[t];
        memset(lp, 0, sizeof *lp);
        double lse = top_logprobs(row, (int)n_vocab, r->top_logprobs, lp);
        lp->token = r->prompt[t];
        lp->logprob = (float)(row[lp->token] - lse);
    }
    if (kv_start + n >= r->n_prompt) {
        pthread_mutex_lock(&r->mu);
        r->prompt_lps_ready = true;
        gen_request_changed(r);
        pthread_mutex_unlock(&r->mu);
    }
}

static int gen_reserve(eseq *s, size_t extra) {
    if (s->gen_len + extra + 1 <= s->gen_cap) return 0;
    size_t cap = (s->gen_len + extra + 1) * 2;
    char *g = realloc(s->gen, cap);
    if (!g) return -1;
    s->gen = g;
    s->gen_cap = cap;
    return 0;
}

/* Room in s's history for extra more tokens; -1 when out of memory. */
static int hist_reserve(eseq *s, int extra) {
    if (s->n_hist + extra > s->cap_hist) {
        int cap = s->cap_hist * 2;
        while (cap < s->n_hist + extra) cap *= 2;
        int32_t *h = realloc(s->hist, sizeof(int32_t) * (size_t)cap);
        if (!h) return -1;
        s->hist = h;
        if (s->pos) {
            int32_t *p = realloc(s->pos, sizeof(int32_t) * (size_t)cap);
            if (!p) return -1;
            s->pos = p;
        }
        s->cap_hist = cap;
    }
    return 0;
}

/* Appends t to s's history; -1 when out of memory. */
static int hist_push(eseq *s, int32_t t) {
    if (hist_reserve(s, 1)) return -1;
    /* a generated token follows the last one's position */
    if (s->pos) s->pos[s->n_hist] = s->n_hist ? s->pos[s->n_hist - 1] + 1 : 0;
    s->hist[s->n_hist++] = t;
    return 0;
}

/* Detokenizes s's new token t (not an end-of-generation token) and scans for stop strings:
 * returns how far s->gen may be released (a possible start of a stop string is held back) and
 * sets *stopped on a match. -1 when out of memory. */
static int64_t detok_step(engine *e, eseq *s, int32_t t, bool *stopped) {
    const tokenizer *tok = e->m->tok;
    /* A piece can be up to the longest token plus pending bytes; see detok_push. */
    size_t need = 16 + 3 * tokenizer_max_token_len(tok);
    if (gen_reserve(s, need)) return -1;
    int nb = detok_push(tok, &s->ds, t, s->gen + s->gen_len, need);
    if (nb > 0) s->gen_len += (size_t)nb;
    /* Text before `emitted` cannot start a stop string (a possible start is held back), so only
     * the new tail is scanned. */
    return (int64_t)(s->emitted + stop_set_scan(&s->req->stops, s->gen + s->emitted,
                                                s->gen_len - s->emitted, stopped));
}

/* Ends s's text without a stop-string match: the held-back tail and the detokenizer's pending
 * bytes are part of the answer. Returns the new release end, -1 when out of memory. */
static int64_t detok_finish(eseq *s) {
    if (gen_reserve(s, 16)) return -1;
    int nb = detok_flush(&s->ds, s->gen + s->gen_len, 16);
    if (nb > 0) s->gen_len += (size_t)nb;
    return (int64_t)s->gen_len;
}

/* The call guard on s's text (released up to release_end so far): returns how far it may be
 * released, and on a repeated call cuts the text after the calls before it, closes them as the
 * format does and sets *ended. -1 when out of memory. */
static int64_t guard_step(eseq *s, int64_t release_end, bool *ended) {
    size_t release, cut;
    int rc = chat_tool_guard_scan(s->guard, s->gen, s->gen_len, &release, &cut);
    if (rc < 0) return -1;
    if (rc == 0) return (int64_t)release < release_end ? (int64_t)release : release_end;
    const char *close = chat_tools_closing(s->req->call_format);
    s->gen_len = cut;
    if (gen_reserve(s, strlen(close))) return -1;
    memcpy(s->gen + s->gen_len, close, strlen(close) + 1);
    s->gen_len += strlen(close);
    *ended = true;
    return (int64_t)s->gen_len;
}

/* Publishes s's text up to release_end and the token's logprob (none for an end-of-generation
 * token) to its reader, under the request's mutex; the request's first token sets its TTFT.
 * -1 when out of memory. */
static int publish_token(engine *e, eseq *s, size_t release_end, const gen_logprob *lp, bool eog,
                         uint64_t now) {
    gen_request *r = s->req;
    pthread_mutex_lock(&r->mu);
    gen_choice *c = &r->choices[s->choice];
    int rc = choice_append_text(c, s->gen + s->emitted, release_end - s->emitted);
    /* An end-of-generation token has no text, so it has no logprobs entry either (OpenAI and
     * vLLM leave it out); it still counts as a completion token. */
    if (r->logprobs && !eog && rc == 0) rc = choice_append_logprob(c, lp);
    c->n_tokens = s->n_gen;
    if (!r->t_first_token) {
        r->t_first_token = now;
        metrics_reuse reuse = r->blended_tokens > 0  ? METRICS_REUSE_BLEND
                              : r->cached_tokens > 0 ? METRICS_REUSE_CACHED
                                                     : METRICS_REUSE_NONE;
        metrics_ttft(e->mx, (double)(now - r->t_arrival) / 1e9, reuse);
    }
    gen_request_changed(r);
    pthread_mutex_unlock(&r->mu);
    s->emitted = release_end;
    metrics_tokens(e->mx, 0, 1);
    return rc;
}

/* Appends token t (with its logprob) to s's history and publishes the text that became safe to
 * release; ends s on a stop, a repeated tool call, a complete grammar, its length limit, or an
 * error. Returns true when s ended. */
static bool eseq_push(engine *e, eseq *s, int32_t t, const gen_logprob *lp) {
    gen_request *r = s->req;
    if (hist_push(s, t)) {
        eseq_finish(e, s, GEN_FINISH_ERROR, 500, "out of memory");
        return true;
    }
    s->n_gen++;
    uint64_t now = clock_now_ns();
    if (s->t_last_token) metrics_itl(e->mx, (double)(now - s->t_last_token) / 1e9);
    s->t_last_token = now;

    bool eog = !r->ignore_eos && tokenizer_is_eog(e->m->tok, t), stopped = false;
    int64_t release_end = eog ? (int64_t)s->emitted : detok_step(e, s, t, &stopped);
    int stop_string = 0; /* which one ended it (Anthropic's stop_sequence names it) */
    if (stopped && release_end >= 0)
        stop_string = 1 + stop_set_match_at(&r->stops, s->gen + release_end,
                                            s->gen_len - (size_t)release_end);
    if (release_end >= 0 && !eog && !stopped && s->guard)
        release_end = guard_step(s, release_end, &stopped);
    gen_finish fin = eog || stopped ? GEN_FINISH_STOP : GEN_RUNNING;
    if (fin == GEN_RUNNING && r->gm && gmatch_is_final(r->gm, s->gstate)) fin = GEN_FINISH_STOP;
    if (fin == GEN_RUNNING && (s->n_gen >= r->max_tokens || s->n_hist >= e->o.ctx))
        fin = GEN_FINISH_LENGTH;
    if (release_end >= 0 && fin != GEN_RUNNING && !stopped) release_end = detok_finish(s);
    if (release_end < 0 || publish_token(e, s, (size_t)release_end, lp, eog, now)) {
        eseq_finish(e, s, GEN_FINISH_ERROR, 500, "out of memory");
        return true;
    }
    if (stop_string) {
        pthread_mutex_lock(&r->mu);
        r->choices[s->choice].stop_string = stop_string;
        pthread_mutex_unlock(&r->mu);
    }
    if (fin != GEN_RUNNING) eseq_finish(e, s, fin, 0, NULL);
    return fin != GEN_RUNNING;
}

/* Jump-forward (SGLang's compressed finite-state decoding): the bytes the grammar forces next
 * are tokenized and appended as generated tokens, so the next step computes them as one
 * prefill instead of one decode step each. Stops short of max_tokens and the context. */
static void jump_forward(engine *e, eseq *s) {
    gen_request *r = s->req;
    char buf[256];
    int32_t next;
    size_t n = gmatch_forced(r->gm, s->gstate, buf, sizeof buf, &next);
    if (n == 0) return;
    int32_t *ids = NULL;
    kv_error err = {{0}};
    int k = tokenizer_encode(e->m->tok, buf, n, false, false, &ids, &err);
    int room = r->max_tokens - s->n_gen;
    if (e->o.ctx - s->n_hist < room) room = e->o.ctx - s->n_hist;
    if (k > room) k = room;
    for (int i = 0; i < k && !s->done; i++) {
        int32_t st = gmatch_accept_token(r->gm, s->gstate, ids[i]);
        if (st < 0) break; /* not reached: the bytes are forced */
        s->gstate = st;
        gen_logprob lp = {.token = ids[i]};
        if (eseq_push(e, s, ids[i], &lp)) break;
    }
    free(ids);
}

/* A draft token of s was verified and kept: counted in its request, the metrics and the engine's
 * totals before the token is pushed (the choice may end with it, and a client that has read its
 * usage may read /metrics next: both then count it). */
static void spec_note_accepted(engine *e, eseq *s) {
    gen_request *r = s->req;
    pthread_mutex_lock(&r->mu);
    r->spec_accepted++;
    if (s->spec.drafted_pred) {
        r->pred_accepted++;
        r->pred_rejected--;
    }
    pthread_mutex_unlock(&r->mu);
    metrics_spec(e->mx, 0, 1);
    atomic_fetch_add(&e->spec_accepted, 1);
    if (s->by_model) atomic_fetch_add(&e->model_accepted, 1);
}

/* Samples s's next token from logits (modified in place), under its grammar if it has one, and
 * appends it (eseq_push). With a draft token (>= 0: a verify step's row) the sampler verifies
 * it (sampler_sample_draft); returns true when the token taken is the draft and s goes on, so
 * the next row's logits, computed after the draft, hold. */
static bool eseq_sample(engine *e, eseq *s, float *logits, int32_t draft) {
    gen_request *r = s->req;
    gen_logprob lp = {0};
    if (r->logprobs && r->top_logprobs > 0)
        top_logprobs(logits, e->m->hp.n_vocab, r->top_logprobs, &lp);
    /* Logprobs stay under the model's unmodified distribution: the sampler reports them under
     * the masked one, which the two normalizers convert. */
    double lse_model = 0, lse_masked = 0;
    if (r->gm && r->logprobs) lse_model = log_sum_exp(logits, e->m->hp.n_vocab);
    if (r->gm) {
        kv_error err = {{0}};
        int allowed = gmatch_apply(r->gm, s->gstate, logits, &err);
        if (allowed < 0) {
            eseq_finish(e, s, GEN_FINISH_ERROR, 500, err.msg);
            return false;
        }
        if (allowed == 0) {
            if (gmatch_can_end(r->gm, s->gstate))
                eseq_finish(e, s, GEN_FINISH_STOP, 0, NULL);
            else
                eseq_finish(e, s, GEN_FINISH_ERROR, 500,
                            "no token of the vocabulary continues the grammar");
            return false;
        }
        if (r->logprobs) lse_masked = log_sum_exp(logits, e->m->hp.n_vocab);
    }
    /* The log-softmax behind a logprob costs a pass over the vocabulary: only when asked. */
    bool accepted = false;
    int32_t t = sampler_sample_draft(s->smp, logits, s->hist, s->n_hist, draft,
                                     r->logprobs ? &lp.logprob : NULL, &accepted);
    lp.token = t;
    if (r->gm && r->logprobs) lp.logprob += (float)(lse_masked - lse_model);
    if (r->gm && (s->gstate = gmatch_accept_token(r->gm, s->gstate, t)) < 0) {
        eseq_finish(e, s, GEN_FINISH_ERROR, 500, "the sampled token left the grammar");
        return false;
    }
    if (accepted) spec_note_accepted(e, s);
    if (eseq_push(e, s, t, &lp)) return false;
    /* forced text after the step's last token only: it would overwrite the staged draft */
    if (accepted) return true;
    if (r->gm && r->jump_forward) jump_forward(e, s);
    return false;
}

/* The first choice computed the prompt: its waiting siblings share its KV and sample their
 * first token from the same logits. */
static void fork_siblings(engine *e, eseq *first, const float *logits) {
    first->forked = true;
    for (int i = 0; i < e->n_run; i++) {
        eseq *s = e->run[i];
        if (s->req != first->req || !s->wait_fork || s->done) continue;
        kv_error err = {{0}};
        if (kv_seq_fork(e->pool, &s->kv, &first->kv, first->n_computed, &err)) {
            eseq_finish(e, s, GEN_FINISH_ERROR, 500, err.msg);
            continue;
        }
        s->wait_fork = false;
        s->n_computed = first->n_computed;
        /* the shared KV is as exact as the first choice's: no further */
        plan_seq_share(&s->ps, &first->ps);
        memcpy(e->work, logits, sizeof(float) * (size_t)e->m->hp.n_vocab);
        eseq_sample(e, s, e->work, -1);
    }
}

/* ---------------------------------------------------------------- scheduling */

static int64_t blocks_for(const engine *e, int64_t n_tokens) {
    int bt = kv_pool_layout(e->pool)->block_tokens;
    return (n_tokens + bt - 1) / bt;
}

/* Drops a sequence's KV; it re-prefills its whole history (prompt and generated tokens) when
 * the pool has room again, so its output is the same. */
static void preempt(engine *e, eseq *v) {
    log_info("KV pool full: preempting a sequence of %d tokens (it will be recomputed)",
             v->n_computed);
    kv_seq_release(e->pool, &v->kv);
    /* the draft KV is cheap to catch up with, and its pool may be what another sequence needs */
    if (e->draft) draft_seq_release(e->draft, &v->dkv);
    v->n_computed = 0;
    v->preempted = true;
    if (v->pooled) /* an embedding pools its prompt again from the start */
        memset(v->pooled, 0, sizeof *v->pooled * (size_t)e->m->hp.dim);
    v->reuse_tried = false;
    /* A sibling that never forked computes the prompt itself now. */
    v->wait_fork = false;
    metrics_preemption(e->mx);
}

/* The youngest sequence holding KV that is younger than s, or NULL. Only younger sequences
 * give way, so the oldest always makes progress (the pool holds at least one context) and two
 * sequences cannot take turns preempting each other. */
static eseq *youngest_holder_after(const engine *e, const eseq *s) {
    eseq *v = NULL;
    for (int i = 0; i < e->n_run; i++) {
        eseq *t = e->run[i];
        if (t == s || t->done || t->kv.n_blocks == 0 || t->admit_order < s->admit_order) continue;
        if (!v || t->admit_order > v->admit_order) v = t;
    }
    return v;
}

/* Free blocks after evicting idle cached chunks used before stamp keep_from, as far as needed
 * to reach need (and only if that reaches it). */
static int64_t room_keep(engine *e, int64_t need, uint64_t keep_from) {
    pool_cache *pc = pool_tier(e);
    if (pc && kv_pool_free_blocks(e->pool) < need) return pool_cache_make_room(pc, need, keep_from);
    return kv_pool_free_blocks(e->pool);
}

static int64_t room(engine *e, int64_t need) { return room_keep(e, need, UINT64_MAX); }

static bool any_preempted(const engine *e) {
    for (int i = 0; i < e->n_run; i++)
        if (e->run[i]->preempted && !e->run[i]->done) return true;
    return false;
}

/* Takes the queue's head request out. Its group's next request, if any, stays queued: behind
 * every entry when the head had its turn (was admitted), else in the head's place (the head
 * was cancelled, or the queue is being emptied). Called with e->mu held. */
static void queue_pop(engine *e, bool had_turn) {
    gen_request *r = e->queue[e->q_head], *next = r->group_next;
    r->group_next = NULL;
    if (next && !had_turn) {
        e->queue[e->q_head] = next;
        return;
    }
    e->q_head = (e->q_head + 1) % e->q_cap;
    e->q_len--;
    if (next) e->queue[(e->q_head + e->q_len++) % e->q_cap] = next;
}

/* Moves requests from the queue into the batch while there are sequence slots and KV blocks
 * for their prompts (plus one block of growth per running sequence). FIFO: the head waits
 * rather than being overtaken; a group (engine_submit_group) gets one request admitted per
 * turn and then waits behind the entries queued after it, so every client request in the queue
 * is admitted at the pace of the others. Called with e->mu held. */
static void admit(engine *e) {
    /* Preempted sequences come back before anything new is admitted. */
    bool blocked = any_preempted(e);
    while (e->q_len > 0) {
        gen_request *r = e->queue[e->q_head];
        bool cancelled = atomic_load(&r->cancelled);
        if (!cancelled) {
            if (blocked) break;
            if (e->n_run + r->n_choices > e->o.max_seqs) break;
            /* Leading blocks already in the pool are shared, not allocated; they become the
             * most recently used, so making room does not evict them. */
            pool_cache *pc = pool_tier(e);
            uint64_t keep_from = pc ? pool_cache_clock(pc) : UINT64_MAX;
            int64_t shared =
                e->plan ? plan_shared_blocks(e->plan, &r->plan, r->prompt_logprobs) : 0;
            int64_t need = blocks_for(e, r->n_prompt + 1) - shared + e->n_run;
            if (e->n_run > 0 && room_keep(e, need, keep_from) < need) break;
        }
        queue_pop(e, !cancelled);
        if (cancelled) {
            gen_request_unref(r);
            continue;
        }
        metrics_tokens(e->mx, r->n_prompt, 0);
        for (int i = 0; i < r->n_choices; i++) {
            kv_error err = {{0}};
            eseq *s = eseq_create(e, r, i, &err);
            if (!s) {
                /* The choices already admitted end with the rest: nothing may write to a
                 * request its reader considers finished. */
                request_fail(r, 500, err.msg);
                for (int k = 0; k < e->n_run; k++)
                    if (e->run[k]->req == r) e->run[k]->done = true;
                break;
            }
            e->run[e->n_run++] = s;
        }
        gen_request_unref(r); /* the queue's reference; the sequences hold their own */
    }
}

/* Frees finished and cancelled sequences, keeping admission order. A choice waiting to fork
 * from a first choice that ended early (an error) computes its prompt itself. */
static void reap(engine *e) {
    int n = 0;
    for (int i = 0; i < e->n_run; i++) {
        eseq *s = e->run[i];
        if (!s->done && atomic_load(&s->req->cancelled)) s->done = true;
        if (s->done)
            eseq_destroy(e, s);
        else
            e->run[n++] = s;
    }
    e->n_run = n;
    for (int i = 0; i < n; i++) {
        eseq *s = e->run[i];
        if (!s->wait_fork) continue;
        bool first_alive = false;
        for (int k = 0; k < n && !first_alive; k++)
            first_alive = e->run[k]->req == s->req && e->run[k]->choice == 0;
        if (!first_alive) s->wait_fork = false;
    }
}

/* Adds s to the step's batch with n_tok pending tokens, reserving their KV slots. When the pool
 * is full, younger sequences give way; if there are none, s steps back itself (or, being new,
 * waits). Returns false when s does not run this step. */
static bool batch_add(engine *e, eseq *s, int n_tok, int *n_b, int *n_pos) {
    kv_error err = {{0}};
    while (kv_seq_reserve(e->pool, &s->kv, s->n_computed + n_tok, &err)) {
        /* Idle cached blocks give way before any sequence does. */
        int64_t free0 = kv_pool_free_blocks(e->pool);
        pool_cache *pc = pool_tier(e);
        if (pc && pool_cache_make_room(pc, free0 + 1, UINT64_MAX) > free0) continue;
        eseq *v = youngest_holder_after(e, s);
        if (!v) {
            bool others = false;
            for (int i = 0; i < e->n_run && !others; i++)
                others = e->run[i] != s && !e->run[i]->done && e->run[i]->kv.n_blocks > 0;
            if (!others) {
                /* Alone and still no room: the pool is smaller than one context (the
                 * configuration prevents this); end the sequence rather than spin. */
                eseq_finish(e, s, GEN_FINISH_LENGTH, 0, NULL);
            } else if (s->kv.n_blocks > 0) {
                preempt(e, s);
            }
            return false;
        }
        preempt(e, v);
        /* The victim may already be in this step's batch: take it out. */
        for (int i = 0; i < *n_b; i++)
            if (e->batch_seqs[i] == v) {
                *n_pos -= e->batch[i].n_tok;
                memmove(&e->batch[i], &e->batch[i + 1], sizeof *e->batch * (size_t)(*n_b - i - 1));
                memmove(&e->batch_seqs[i], &e->batch_seqs[i + 1],
                        sizeof *e->batch_seqs * (size_t)(*n_b - i - 1));
                (*n_b)--;
                break;
            }
    }
    e->batch_seqs[*n_b] = s;
    /* The first choice of a prompt-scoring request takes logits for every prompt row. */
    const gen_request *r = s->req;
    bool score =
        r->prompt_logprobs && !r->prompt_lps_ready && s->choice == 0 && s->n_computed < r->n_prompt;
    e->batch[*n_b] = (batch_seq){.seq = &s->kv,
                                 .n_tok = n_tok,
                                 .tokens = s->hist + s->n_computed,
                                 .pos = NULL,
                                 .kv_start = s->n_computed,
                                 .all_logits = score,
                                 .all_rows = r->pooling != GEN_POOL_NONE};
    /* .decode stays false: a generated token's KV and logits are then computed exactly as a
     * prompt token's, so KV reused later (the next turn of a chat holds this answer) is the same
     * bits a cold prefill computes, and cached output equals uncached output. */
    (*n_b)++;
    *n_pos += n_tok;
    return true;
}

/* ---------------------------------------------------------------- speculation */

/* A context match at least this long drafts before the draft model does. Drafting from the
 * context costs a hash lookup; the draft model costs a forward call per draft token. Where the
 * answer copies its context (RAG quoting its passage, an edit of a given text) a long match
 * proposes the copy, as the draft model given that context would: in bench-spec's RAG set with
 * SmolLM2's Q8_0 copy drafting (README), these drafts were kept at 93%, the draft model's at 82%.
 * Shorter matches are the common phrases of free text, where a draft model knows better. */
#define SPEC_MODEL_MATCH 8

/* How many tokens s may draft this step: what its controller allows (server/engine/spec.h),
 * within budget, its max_tokens and the context; 0 for none. Room for them and the model's own
 * next token is made after its history (hist_push writes the kept ones there too). */
static int spec_len(engine *e, eseq *s, int budget) {
    const gen_request *r = s->req;
    if (s->n_gen == 0 || s->n_computed < r->n_prompt || s->preempted) return 0;
    int k = spec_ctl_len(&s->spec.ctl);
    if (k > budget) k = budget;
    if (k > r->max_tokens - s->n_gen - 1) k = r->max_tokens - s->n_gen - 1;
    if (k > e->o.ctx - s->n_hist) k = e->o.ctx - s->n_hist;
    return k <= 0 || hist_reserve(s, k + 1) ? 0 : k;
}

/* Proposes up to k tokens for s from its prediction or its context, staged at hist[n_hist ..);
 * returns how many. With a draft model, s->want_model says the draft model should draft
 * instead: when neither the prediction nor a long context match did (SPEC_MODEL_MATCH), and s
 * runs at the slots' positions (a Prompt Cache sequence's are its own: the draft model's KV
 * would not be the context the target sees). */
static int spec_propose_from_context(engine *e, eseq *s, int k) {
    int32_t *d = s->hist + s->n_hist;
    int n = spec_propose(&s->spec, s->hist, s->n_hist, s->n_gen, k, d, &s->spec.drafted_pred);
    s->want_model =
        e->draft && !s->pos && !s->spec.drafted_pred && s->spec.match < SPEC_MODEL_MATCH;
    return n < 0 ? 0 : n;
}

/* Cuts s's staged draft of n tokens to what its grammar allows (at the first token it does
 * not) and to no block more than the pool has free beyond one per running sequence, so a draft
 * never makes a sequence give way; sets the draft tokens' positions. Returns the length. */
static int spec_fit(engine *e, eseq *s, int n) {
    const gen_request *r = s->req;
    const int32_t *d = s->hist + s->n_hist;
    if (r->gm)
        for (int32_t i = 0, st = s->gstate; i < n; i++)
            if ((st = gmatch_accept_token(r->gm, st, d[i])) < 0) n = i;
    int64_t spare = kv_pool_free_blocks(e->pool) - e->n_run;
    while (n > 0 && blocks_for(e, s->n_hist + n) - blocks_for(e, s->n_hist) > spare) n--;
    for (int i = 0; s->pos && i < n; i++) s->pos[s->n_hist + i] = s->pos[s->n_hist - 1] + 1 + i;
    return n;
}

/* The draft model drafts for the sequences that want it (dseqs[0 .. n), djobs[i].k tokens
 * each at most), batched (server/engine/draft.h). One that it gives no draft (still catching up
 * with its history, its draft pool full, a grammar allowing nothing) keeps its context draft,
 * proposed again. */
static void spec_draft_model(engine *e, int n) {
    for (int i = 0; i < n; i++) {
        eseq *s = e->dseqs[i];
        int k = e->djobs[i].k;
        e->djobs[i] = (draft_job){.ds = &s->dkv,
                                  .hist = s->hist,
                                  .n_hist = s->n_hist,
                                  .k = k,
                                  .out = s->hist + s->n_hist,
                                  .gm = s->req->gm,
                                  .gstate = s->gstate};
    }
    kv_error err = {{0}};
    uint64_t t0 = clock_now_ns();
    if (draft_run(e->draft, e->djobs, n, &err))
        log_warn("draft model: %s; drafting from the context this step", err.msg);
    uint64_t dt = clock_now_ns() - t0;
    atomic_fetch_add(&e->draft_ns, (long long)dt);
    metrics_spec_model(e->mx, (double)dt / 1e9);
    for (int i = 0; i < n; i++) {
        eseq *s = e->dseqs[i];
        s->n_draft = e->djobs[i].n;
        s->by_model = s->n_draft > 0;
        if (s->n_draft == 0) s->n_draft = spec_propose_from_context(e, s, e->djobs[i].k);
    }
}

/* A verify step's entry for s: its pending token at slot kv_start and n_draft draft tokens after
 * it; rows[i] ([n_vocab] f32 each) are the logits after the pending token and the first i draft
 * tokens. Row by row the sampler takes a token verifying the draft token that row is for
 * (eseq_sample); the first it does not keep ends the step (that token, chosen by the model, is
 * the last pushed), and the draft rows after it are rolled back: s's KV is cut to the tokens its
 * history holds and the blocks taken only for them go back to the pool. Blocks shared with other
 * sequences were never written: drafts extend past s's length, into blocks it holds alone
 * (kv_seq_reserve copies a shared last block first; model_forward refuses a shared one). Every
 * token goes through eseq_push as in a plain step, so stop strings, max_tokens, end of
 * generation, grammars and logprobs see the same tokens in the same order. */
static void spec_settle(engine *e, eseq *s, int kv_start, int n_draft, float *rows) {
    gen_request *r = s->req;
    size_t n_vocab = (size_t)e->m->hp.n_vocab;
    int32_t draft[SPEC_MAX_DRAFT];
    memcpy(draft, s->hist + kv_start + 1, sizeof *draft * (size_t)n_draft);
    /* counted as rejected until kept (spec_note_accepted), so the usage is right whenever the
     * choice ends */
    pthread_mutex_lock(&r->mu);
    r->spec_drafted += n_draft;
    if (s->spec.drafted_pred) r->pred_rejected += n_draft;
    pthread_mutex_unlock(&r->mu);
    metrics_spec(e->mx, n_draft, 0);
    atomic_fetch_add(&e->spec_drafted, n_draft);
    if (s->by_model) atomic_fetch_add(&e->model_drafted, n_draft);
    int n_gen0 = s->n_gen;
    for (int i = 0; i <= n_draft && !s->done; i++) {
        /* the pending token and the i draft tokens kept so far hold KV */
        s->n_computed = kv_start + 1 + i;
        if (cache_on(e, s))
            plan_write_back(e->plan, &s->ps, &r->plan, &s->kv, s->hist, s->n_computed);
        if (!eseq_sample(e, s, rows + (size_t)i * n_vocab, i < n_draft ? draft[i] : -1)) break;
    }
    if (!s->done) kv_seq_truncate(e->pool, &s->kv, s->n_computed);
    int accepted = 0;
    while (accepted < n_draft && accepted < s->n_gen - n_gen0 &&
           s->hist[kv_start + 1 + accepted] == draft[accepted])
        accepted++;
    /* the draft model's KV holds the tokens it was fed: those kept stay */
    if (e->draft && !s->done) draft_seq_truncate(e->draft, &s->dkv, kv_start + 1 + accepted);
    spec_ctl_update(&s->spec.ctl, n_draft, accepted);
}

/* ---------------------------------------------------------------- context cache */

static bool cache_on(const engine *e, const eseq *s) { return e->plan && s->req->plan.cache; }

/* Gives s (holding no KV) its longest cached prefix and plans its blend (cache/plan.h). At
 * least the last token is left to compute, so its logits are fresh (its block, if shared, is
 * copied when written). Prompt scoring needs every prompt row's logits and reuses nothing. */
static void reuse_prefix(engine *e, eseq *s) {
    gen_request *r = s->req;
    s->reuse_tried = true;
    double load_ns = e->fus ? blend_fusor_load_ns(e->fus) : 0;
    int reused = plan_reuse(e->plan, &s->ps, &r->plan, &s->kv, s->hist, s->n_hist, r->n_prompt,
                            s->choice == 0, r->prompt_logprobs, load_ns);
    s->n_computed = reused;
    if (reused > 0) atomic_fetch_add(&e->reused_tokens, reused);
    if (s->choice == 0 && !s->preempted) {
        pthread_mutex_lock(&r->mu);
        r->cached_tokens = reused < r->n_prompt ? reused : r->n_prompt - 1;
        pthread_mutex_unlock(&r->mu);
    }
}

/* True when s has reused spans at or after its next token. */
static bool blending(const eseq *s) {
    return s->ps.n_spans > 0 &&
           s->ps.spans[s->ps.n_spans - 1].slot + s->ps.spans[s->ps.n_spans - 1].n > s->n_computed;
}

/* How many pending tokens a blended prefill of s takes this step: a reused token costs two
 * layers plus its share of recompute, a new token every layer; within budget (counted in new
 * tokens' worth: *cost) and blend_chunk. */
static int blend_take(const engine *e, const eseq *s, int budget, int *cost) {
    int pending = s->n_hist - s->n_computed;
    int cap = pending < e->o.blend_chunk ? pending : e->o.blend_chunk;
    /* LegoLink's reused tokens skip layers 0 and 1 too */
    double w_reused = (s->ps.blend_policy == BLEND_POLICY_LEGOLINK ? 0 : 2.0 / e->m->hp.n_layer) +
                      1.5 * s->ps.blend_ratio,
           c = 0;
    int n = 0, sp = 0;
    while (n < cap) {
        int t = s->n_computed + n;
        while (sp < s->ps.n_spans && s->ps.spans[sp].slot + s->ps.spans[sp].n <= t) sp++;
        bool reused = sp < s->ps.n_spans && s->ps.spans[sp].slot <= t;
        double w = reused ? (w_reused < 1 ? w_reused : 1) : 1;
        if (n > 0 && c + w > budget) break;
        c += w;
        n++;
    }
    *cost = (int)ceil(c);
    return n;
}

/* The blended entries of the step's batch: each sequence whose tokens this step meet its
 * spans, with the spans clipped to them. Returns how many (0 when out of memory: the step
 * then computes those tokens in full, which is always correct). */
static int blend_entries(engine *e, int n_b) {
    int n_be = 0, n_sp = 0;
    for (int i = 0; i < n_b; i++) {
        eseq *s = e->batch_seqs[i];
        const batch_seq *bs = &e->batch[i];
        int lo = bs->kv_start, hi = bs->kv_start + bs->n_tok, first = n_sp;
        for (int k = 0; k < s->ps.n_spans; k++) {
            blend_span sp = s->ps.spans[k];
            /* the entry's last token is computed: its logits row is the step's output */
            int a = sp.slot > lo ? sp.slot : lo,
                b = sp.slot + sp.n < hi - 1 ? sp.slot + sp.n : hi - 1;
            if (a >= b) continue;
            if (n_sp == e->bspans_cap) {
                int cap = e->bspans_cap ? e->bspans_cap * 2 : 64;
                blend_span *t = realloc(e->bspans, sizeof *t * (size_t)cap);
                if (!t) return 0;
                e->bspans = t;
                e->bspans_cap = cap;
            }
            /* the span's forced tokens that fall in the step */
            int forced = sp.slot + sp.forced - a;
            e->bspans[n_sp++] = (blend_span){.slot = a,
                                             .n = b - a,
                                             .off = sp.off + a - sp.slot,
                                             .forced = forced < 0       ? 0
                                                       : forced < b - a ? forced
                                                                        : b - a,
                                             .rec = sp.rec};
        }
        if (n_sp > first)
            e->bents[n_be++] =
                (blend_entry){.entry = i,
                              .n_spans = n_sp - first,
                              .ratio = s->ps.blend_ratio,
                              .only_forced = s->ps.blend_policy == BLEND_POLICY_LEGOLINK,
                              .spans = (const blend_span *)(intptr_t)first};
    }
    /* the span array may have moved while growing: offsets become pointers now */
    for (int k = 0; k < n_be; k++) e->bents[k].spans = e->bspans + (intptr_t)e->bents[k].spans;
    return n_be;
}

/* ---------------------------------------------------------------- the live check */

/* A malloc'd copy of bounds[0, n) (NULL for none; *ok false when out of memory). */
static int *bounds_dup(const int *bounds, int n, bool *ok) {
    int *d = n > 0 ? malloc(sizeof *d * (size_t)n) : NULL;
    *ok = n <= 0 || d;
    if (d) memcpy(d, bounds, sizeof *d * (size_t)n);
    return d;
}

/* s (a first choice) has computed its prompt, and blended: it waits for the idle engine when
 * it blended at the server's setting, the monitor watches that setting and s's turn in the
 * sample has come (a check: its prompt and first token's distribution, row), or when repairs
 * are on and its KV may be stored (a repair). */
static void shadow_probe(engine *e, const eseq *s, const float *row) {
    const gen_request *r = s->req;
    if (s->choice != 0 || s->n_gen > 0 || s->ps.blended == 0 || r->skv || r == e->shadow_req)
        return;
    bool check = false;
    if (e->mon.on && r->plan.blend_ratio < 0 && r->plan.blend_policy < 0) {
        e->q_acc += e->o.quality_sample;
        if (e->q_acc >= 1) {
            e->q_acc -= 1;
            check = true;
        }
    }
    bool repair = e->o.blend_repair && cache_on(e, s);
    /* a prompt already waiting for its repair needs no second one */
    for (int i = 0; i < e->n_shadows && repair && !check; i++)
        if (e->shadows[i].repair && e->shadows[i].n_prompt == r->n_prompt &&
            memcmp(e->shadows[i].prompt, r->prompt, sizeof(int32_t) * (size_t)r->n_prompt) == 0)
            return;
    if (!check && !repair) return;
    /* repairs alone leave half the queue to checks */
    int cap = check ? SHADOW_CAP : SHADOW_CAP / 2;
    shadow *sh = e->n_shadows < cap ? &e->shadows[e->n_shadows] : NULL;
    if (sh) {
        memset(sh, 0, sizeof *sh);
        bool ok = true;
        sh->prompt = malloc(sizeof(int32_t) * (size_t)r->n_prompt);
        if (repair) sh->bounds = bounds_dup(r->plan.bounds, r->plan.n_bounds, &ok);
        if (!sh->prompt || !ok) {
            free(sh->prompt);
            free(sh->bounds);
            sh = NULL;
        }
    }
    if (sh) {
        memcpy(sh->prompt, r->prompt, sizeof(int32_t) * (size_t)r->n_prompt);
        sh->n_prompt = r->n_prompt;
        sh->check = check;
        if (check) top_logprobs(row, e->m->hp.n_vocab, GEN_MAX_TOP_LOGPROBS, &sh->first);
        sh->repair = repair;
        sh->ns = r->plan.ns;
        sh->n_bounds = repair ? r->plan.n_bounds : 0;
        e->n_shadows++;
    }
    pthread_mutex_lock(&e->qmu);
    if (check) e->q_sampled++;
    if (check && !sh) e->q_dropped++;
    if (repair && !sh) e->repair_dropped++;
    pthread_mutex_unlock(&e->qmu);
}

/* Drops the oldest entry of the idle engine's queue. */
static void shadow_pop(engine *e) {
    shadow *sh = &e->shadows[0];
    free(sh->prompt);
    free(sh->bounds);
    memmove(&e->shadows[0], &e->shadows[1], sizeof *sh * (size_t)--e->n_shadows);
}

/* The engine is idle (nothing running, nothing queued): the oldest entry starts, a full
 * prefill of its prompt. A check alone reuses and stores nothing; a repair reuses the exact
 * prefix the pool holds, nothing by content, and stores its chunks as any prompt does. */
static void shadow_start(engine *e) {
    shadow *sh = &e->shadows[0];
    gen_request *r = gen_request_create(1);
    kv_error err = {{0}};
    eseq *s = NULL;
    if (r && (r->prompt = malloc(sizeof(int32_t) * (size_t)sh->n_prompt))) {
        memcpy(r->prompt, sh->prompt, sizeof(int32_t) * (size_t)sh->n_prompt);
        r->n_prompt = sh->n_prompt;
        r->t_arrival = clock_now_ns();
        int rc = 0;
        if (sh->repair && e->plan) {
            /* a copy: the entry keeps its own for a run again after giving way to a client */
            bool ok;
            r->plan.blend = PLAN_BLEND_STORE;
            r->plan.bounds = bounds_dup(sh->bounds, sh->n_bounds, &ok);
            r->plan.n_bounds = r->plan.bounds ? sh->n_bounds : 0;
            rc = !ok ? -1
                     : plan_prepare(e->plan, &r->plan, &sh->ns, r->prompt, r->n_prompt, false,
                                    false, r->t_arrival, false);
        }
        if (rc == 0) s = eseq_create(e, r, 0, &err);
    }
    if (!s) { /* out of memory: this entry is dropped */
        gen_request_unref(r);
        shadow_pop(e);
        return;
    }
    e->run[e->n_run++] = s;
    e->shadow_req = r; /* the creation's reference */
}

/* Ends the running check's sequence (quietly: no client reads it). */
static void shadow_stop(engine *e) {
    for (int i = 0; i < e->n_run; i++)
        if (e->run[i]->req == e->shadow_req) {
            kv_seq_release(e->pool, &e->run[i]->kv);
            e->run[i]->done = true;
        }
    gen_request_unref(e->shadow_req);
    e->shadow_req = NULL;
}

/* A client request came while a check runs: the check gives way (and runs again later). */
static void shadow_yield(engine *e) {
    if (!e->shadow_req) return;
    bool client = e->q_len > 0;
    for (int i = 0; i < e->n_run && !client; i++)
        client = e->run[i]->req != e->shadow_req && !e->run[i]->done;
    if (!client) return;
    shadow_stop(e);
    pthread_mutex_lock(&e->qmu);
    e->q_abandoned++;
    pthread_mutex_unlock(&e->qmu);
}

/* The entry's full prefill is done (row: its last token's logits; a repair's chunks are
 * stored): a check compares the two first-token distributions and tells the monitor; a step
 * changes the ratio blended prompts that name none get. */
static void shadow_done(engine *e, const float *row) {
    shadow *sh = &e->shadows[0];
    char why[300];
    int step = 0;
    float ratio = 0;
    double kl = 0;
    bool top1 = false;
    if (sh->check) {
        gen_logprob full = {0};
        top_logprobs(row, e->m->hp.n_vocab, GEN_MAX_TOP_LOGPROBS, &full);
        kl = quality_kl_topk(full.top_ids, full.top_lps, full.n_top, sh->first.top_ids,
                             sh->first.top_lps, sh->first.n_top);
        top1 = full.n_top > 0 && sh->first.n_top > 0 && full.top_ids[0] == sh->first.top_ids[0];
    }
    pthread_mutex_lock(&e->qmu);
    if (sh->check) {
        e->q_checked++;
        e->q_kl_sum += kl;
        e->q_top1_sum += top1;
        step = quality_monitor_add(&e->mon, kl, top1, why, sizeof why);
        ratio = quality_monitor_ratio(&e->mon);
        if (step) snprintf(e->q_last_step, sizeof e->q_last_step, "%s", why);
    }
    if (sh->repair) e->repaired++;
    pthread_mutex_unlock(&e->qmu);
    if (step) {
        if (e->plan) planner_set_blend_ratio(e->plan, ratio);
        log_warn("reuse quality: live check: blend %s", why);
    }
    shadow_pop(e);
    shadow_stop(e);
}

void engine_quality_stats_get(engine *e, engine_quality_stats *out) {
    memset(out, 0, sizeof *out);
    pthread_mutex_lock(&e->qmu);
    out->on = e->mon.on;
    out->ratio = quality_monitor_ratio(&e->mon);
    out->policy = e->mon.policy;
    out->sample = e->o.quality_sample;
    out->sampled = e->q_sampled;
    out->checked = e->q_checked;
    out->dropped = e->q_dropped;
    out->abandoned = e->q_abandoned;
    out->mean_kl = e->q_checked ? e->q_kl_sum / (double)e->q_checked : 0;
    out->mean_top1 = e->q_checked ? e->q_top1_sum / (double)e->q_checked : 0;
    out->rolling_kl = e->mon.last_kl;
    out->rolling_top1 = e->mon.last_top1;
    out->steps_up = e->mon.steps_up;
    out->steps_down = e->mon.steps_down;
    snprintf(out->last_step, sizeof out->last_step, "%s", e->q_last_step);
    out->repaired = e->repaired;
    out->repair_dropped = e->repair_dropped;
    pthread_mutex_unlock(&e->qmu);
}

/* ---------------------------------------------------------------- Prompt Cache */

/* True while s waits for its schema KV (the import did not fit the pool yet): none of its
 * tokens may be computed before, or it would become a full prefill. */
static bool schema_waiting(const eseq *s) {
    const schema_kv *k = s->req->skv;
    return k && k->fixup < 0 && k->n_slots > 0 && s->n_computed == 0;
}

/* A Prompt Cache sequence starting (or restarting after preemption): its first slots get the
 * modules' KV from their records, copied into fresh blocks. With the fix-up its prompt is laid
 * out as a full prefill's and the modules' KV become blend spans instead (the fusor loads them
 * layer by layer, moved to their new positions, and recomputes the most deviating tokens). */
static void schema_start(engine *e, eseq *s) {
    gen_request *r = s->req;
    const schema_kv *k = r->skv;
    s->reuse_tried = true;
    if (k->fixup >= 0) {
        if (s->ps.spans) return; /* after a preemption: the spans are still there */
        kv_error err = {{0}};
        int rc = e->fus ? schema_kv_blend_spans(k, kv_pool_layout(e->pool), &s->ps.spans,
                                                &s->ps.n_spans, &err)
                        : kv_fail(&err, "blend is off");
        if (rc == 0) {
            s->ps.blend_ratio = k->fixup;
            s->ps.exact_end = 0;
        } else {
            /* its layout is a full prefill's: computed in full, slower but right */
            log_warn("schema: no fix-up (%s): computing the prompt in full", err.msg);
        }
        return;
    }
    if (k->n_slots == 0) return;
    int64_t need = blocks_for(e, s->n_hist + 1);
    kv_error err = {{0}};
    uint64_t t0 = clock_now_ns();
    if (room(e, need) < blocks_for(e, k->n_slots) || schema_kv_import(k, e->pool, &s->kv, &err)) {
        if (err.msg[0]) log_warn("schema: cannot import %d slots yet: %s", k->n_slots, err.msg);
        s->reuse_tried = false; /* tried again next step */
        return;
    }
    log_debug("schema: %d slots imported in %.2f ms", k->n_slots,
              (double)(clock_now_ns() - t0) / 1e6);
    s->n_computed = k->n_slots;
    atomic_fetch_add(&e->reused_tokens, k->n_slots);
    if (s->choice == 0 && !s->preempted) {
        pthread_mutex_lock(&r->mu);
        r->cached_tokens = k->n_slots;
        pthread_mutex_unlock(&r->mu);
    }
}

/* A Prompt Cache sequence's prompt is computed: a precompute stores its records; the fix-up's
 * counts go to the request. */
static void schema_done(engine *e, eseq *s) {
    gen_request *r = s->req;
    const schema_kv *k = r->skv;
    if (s->choice != 0) return;
    if (k->export_blocks > 0) {
        kv_error err = {{0}};
        int rc = e->o.store ? schema_kv_export(k, e->o.store, e->pool, &s->kv, &err)
                            : kv_fail(&err, "the context cache has no RAM or disk tier");
        if (rc) {
            log_warn("schema: %s", err.msg);
            pthread_mutex_lock(&r->mu);
            r->export_failed = true;
            snprintf(r->error, sizeof r->error, "%.200s", err.msg);
            pthread_mutex_unlock(&r->mu);
        }
    }
    if (s->ps.blended > 0) {
        pthread_mutex_lock(&r->mu);
        r->blended_tokens = s->ps.blended;
        r->recomputed_tokens = s->ps.recomputed;
        r->blend_ratio_used = s->ps.blend_ratio;
        r->blend_policy_used = s->ps.blend_policy;
        r->cached_tokens = s->ps.blended - s->ps.recomputed;
        pthread_mutex_unlock(&r->mu);
    }
}

/* ---------------------------------------------------------------- embeddings */

/* After the last layer: each embedding sequence's rows, normed with the output norm as the
 * logits see them, are summed (mean), or its last (last) or first (cls) prompt row kept. */
static int pool_hidden(void *ud, forward_state *st, int layer) {
    engine *e = ud;
    const model_hparams *hp = &e->m->hp;
    if (layer != hp->n_layer - 1) return 0;
    int n = forward_state_n_rows(st);
    const int32_t *rows = forward_state_rows(st);
    for (int r = 0; r < n; r++) {
        /* the row's batch entry: tokens are flattened in batch order */
        int tok = rows[r], b = 0;
        while (b < e->n_batch && tok >= e->batch[b].n_tok) tok -= e->batch[b++].n_tok;
        if (b >= e->n_batch) continue;
        eseq *s = e->batch_seqs[b];
        gen_pooling how = s->req->pooling;
        int slot = e->batch[b].kv_start + tok;
        if (how == GEN_POOL_NONE || (how == GEN_POOL_CLS && slot != 0) ||
            (how == GEN_POOL_LAST && slot != s->n_hist - 1))
            continue;
        const float *h = forward_state_hidden(st, r);
        double ss = 0;
        for (int k = 0; k < hp->dim; k++) ss += (double)h[k] * h[k];
        double scale = 1.0 / sqrt(ss / hp->dim + hp->norm_eps);
        for (int k = 0; k < hp->dim; k++)
            s->pooled[k] += (double)h[k] * scale * e->m->output_norm[k];
    }
    return 0;
}

/* The prompt is computed: the pooled vector is normalized (L2) into the request and the choice
 * ends, releasing its KV. */
static void embed_finish(engine *e, eseq *s) {
    gen_request *r = s->req;
    int dim = e->m->hp.dim;
    double norm = 0;
    for (int k = 0; k < dim; k++) norm += s->pooled[k] * s->pooled[k];
    norm = norm > 0 ? 1.0 / sqrt(norm) : 0;
    pthread_mutex_lock(&r->mu);
    for (int k = 0; k < dim; k++) r->embedding[k] = (float)(s->pooled[k] * norm);
    pthread_mutex_unlock(&r->mu);
    eseq_finish(e, s, GEN_FINISH_STOP, 0, NULL);
}

/* A step's hooks: the fusor's for blended entries, then embedding pooling after the last
 * layer (blend narrows no row at the last layer, and embedding entries keep every row through
 * it: batch_seq.all_rows, so pooling sees every row it needs). */
typedef struct step_hooks {
    forward_hooks blend;
    engine *e;
    bool embed;
} step_hooks;

static int step_before(void *ud, forward_state *st, int layer) {
    step_hooks *h = ud;
    return h->blend.before_layer ? h->blend.before_layer(h->blend.ud, st, layer) : 0;
}

static int step_kv(void *ud, forward_state *st, int layer) {
    step_hooks *h = ud;
    return h->blend.after_kv ? h->blend.after_kv(h->blend.ud, st, layer) : 0;
}

static int step_after(void *ud, forward_state *st, int layer) {
    step_hooks *h = ud;
    int rc = h->blend.after_layer ? h->blend.after_layer(h->blend.ud, st, layer) : 0;
    return rc == 0 && h->embed ? pool_hidden(h->e, st, layer) : rc;
}

/* One continuous-batching step. */
/* Sequences starting (or restarting after preemption) take their cached prefix first. */
static void step_reuse(engine *e) {
    for (int i = 0; i < e->n_run; i++) {
        eseq *s = e->run[i];
        if (s->req->skv && !s->done && !s->wait_fork && !s->reuse_tried && s->n_computed == 0 &&
            s->kv.n_blocks == 0)
            schema_start(e, s);
        if (s->done || s->wait_fork || s->reuse_tried || s->n_computed > 0 || s->kv.n_blocks > 0 ||
            !cache_on(e, s))
            continue;
        /* A preempted sequence restarts only when its whole history fits (below): taking its
         * prefix back before that would only make it step back again. */
        int64_t whole = blocks_for(e, s->n_hist + 1);
        if (s->preempted && room(e, whole) < whole) continue;
        reuse_prefix(e, s);
    }
}

/* True when s decodes this step: one pending token. */
static bool decoding(const eseq *s) {
    return !s->done && !s->wait_fork && s->n_hist - s->n_computed == 1 && !schema_waiting(s);
}

/* Decode rows: every sequence with exactly one pending token, and (while the batch is narrower
 * than SPEC_MAX_BATCH) its draft as extra rows, taken from the prefill budget and sharing
 * spec_step_drafts rows. Drafts are made first, all of them: the draft model drafts for every
 * sequence that wants it at once, a forward call per draft position. Returns the budget left
 * for prefill. */
static int step_decode(engine *e, int *n_b, int *n_pos) {
    int budget = e->o.prefill_chunk, n_dec = 0, n_model = 0;
    for (int i = 0; i < e->n_run; i++) n_dec += decoding(e->run[i]);
    int share = n_dec > 0 ? spec_step_drafts(n_dec) / n_dec : 0, left = budget;
    for (int i = 0; i < e->n_run; i++) {
        eseq *s = e->run[i];
        s->n_draft = 0;
        s->by_model = false;
        if (!decoding(s) || n_dec >= SPEC_MAX_BATCH || share == 0) continue;
        int k = spec_len(e, s, left < share ? left : share);
        if (k <= 0) continue;
        left -= k;
        s->n_draft = spec_propose_from_context(e, s, k);
        if (s->want_model) {
            e->dseqs[n_model] = s;
            e->djobs[n_model++].k = k;
        }
    }
    if (n_model > 0) spec_draft_model(e, n_model);
    for (int i = 0; i < e->n_run; i++) {
        eseq *s = e->run[i];
        if (!decoding(s)) continue;
        int k = s->n_draft > 0 ? spec_fit(e, s, s->n_draft) : 0;
        if (batch_add(e, s, 1 + k, n_b, n_pos) && k > 0) {
            e->batch[*n_b - 1].all_logits = true; /* a row of logits per draft token */
            budget -= k;
        }
    }
    return budget;
}

/* Prefill rows: the budget left shared among sequences with more pending, oldest first. */
static void step_prefill(engine *e, int budget, int *n_b, int *n_pos) {
    for (int i = 0; i < e->n_run && budget > 0; i++) {
        eseq *s = e->run[i];
        int pending = s->n_hist - s->n_computed;
        if (s->done || s->wait_fork || pending <= 1 || schema_waiting(s)) continue;
        /* A preempted sequence restarts only when its whole history fits, so it does not
         * step back again halfway. */
        if (s->preempted && s->n_computed == 0 &&
            room(e, blocks_for(e, s->n_hist + 1)) < blocks_for(e, s->n_hist + 1))
            continue;
        int n = pending < budget ? pending : budget, cost = n;
        if (blending(s) && s->n_computed < s->ps.spans[0].slot) {
            /* up to the first reused token as any prefill, so blended steps start there */
            if (n > s->ps.spans[0].slot - s->n_computed)
                n = cost = s->ps.spans[0].slot - s->n_computed;
        } else if (blending(s)) {
            /* A blended step's tokens depend on s alone, never on what else runs, so its rows
             * are ranked over the same tokens alone or in any batch: it takes the whole budget,
             * as the step's first prefill, or waits for the next step. */
            if (budget < e->o.prefill_chunk) continue;
            n = blend_take(e, s, budget, &cost);
            if (n > e->fwd_tokens - *n_pos) continue;
        } else if (n > e->fwd_tokens - *n_pos) {
            n = e->fwd_tokens - *n_pos;
        }
        if (s->req == e->shadow_req && n > SHADOW_STEP) n = cost = SHADOW_STEP;
        if (n > 0 && batch_add(e, s, n, n_b, n_pos)) budget -= cost < budget ? cost : budget;
    }
}

/* The batch's positions: the slots (every sequence's tokens sit at 0..n_hist-1), except a
 * Prompt Cache sequence's, which carries its own. */
static void step_positions(engine *e, int n_b) {
    int off = 0;
    for (int i = 0; i < n_b; i++) {
        batch_seq *bs = &e->batch[i];
        const int32_t *sp = e->batch_seqs[i]->pos;
        for (int j = 0; j < bs->n_tok; j++)
            e->batch_pos[off + j] = sp ? sp[bs->kv_start + j] : bs->kv_start + j;
        bs->pos = e->batch_pos + off;
        off += bs->n_tok;
    }
}

/* The forward pass over the batch, with blend's hooks where entries blend (*n_blended: how many
 * entries do; they settle here): the logits rows, or -1 with err. */
static int step_forward(engine *e, int n_b, int n_pos, int *n_blended, kv_error *err) {
    forward_hooks hooks, *hk = NULL;
    int n_be = *n_blended = e->fus ? blend_entries(e, n_b) : 0;
    if (n_be > 0) {
        if (blend_fusor_begin(e->fus, e->batch, n_b, e->bents, n_be, &hooks, err) == 0) {
            hk = &hooks;
        } else {
            /* computed in full instead: slower, never wrong */
            log_warn("blend: %s; computing those tokens", err->msg);
            for (int k = 0; k < n_be; k++)
                plan_seq_drop_spans(&e->batch_seqs[e->bents[k].entry]->ps);
            n_be = *n_blended = 0;
        }
    }
    uint64_t t0 = clock_now_ns();
    bool embed = false;
    for (int i = 0; i < n_b; i++) embed |= e->batch_seqs[i]->req->pooling != GEN_POOL_NONE;
    step_hooks sh = {.blend = hk ? *hk : (forward_hooks){0}, .e = e, .embed = embed};
    forward_hooks both = {
        .ud = &sh, .before_layer = step_before, .after_kv = step_kv, .after_layer = step_after};
    e->n_batch = n_b;
    int n_out = model_forward(e->fwd, e->batch, n_b, hk || embed ? &both : NULL, e->logits, err);
    if (hk) blend_fusor_end(e->fus);
    uint64_t dt = clock_now_ns() - t0;
    log_debug("step: %d sequences, %d tokens (%d blended), forward %.2f ms", n_b, n_pos, n_be,
              (double)dt / 1e6);
    /* compute per token and layer, for the loading controller */
    if (n_out >= 0 && n_be == 0 && e->plan) planner_note_step(e->plan, dt, n_pos);
    for (int k = 0; k < n_be && n_out >= 0; k++) {
        eseq *s = e->batch_seqs[e->bents[k].entry];
        if (plan_settle(e->plan, &s->ps, e->bents[k].failed)) continue;
        log_debug("blend: entry of %d tokens: %d reused, %d recomputed (ratio %.2f); loading "
                  "%.0f ns, compute %.0f ns per token and layer",
                  e->batch[e->bents[k].entry].n_tok, e->bents[k].n_reused, e->bents[k].n_recomputed,
                  e->bents[k].ratio, blend_fusor_load_ns(e->fus), planner_ns_token_layer(e->plan));
        s->ps.blended += e->bents[k].n_reused;
        s->ps.recomputed += e->bents[k].n_recomputed;
        atomic_fetch_add(&e->blended_tokens, e->bents[k].n_reused);
        atomic_fetch_add(&e->recomputed_tokens, e->bents[k].n_recomputed);
        metrics_blend(e->mx, e->bents[k].n_reused, e->bents[k].n_recomputed);
    }
    return n_out;
}

/* The logits rows a batch entry gets: every row for a draft or a scored prompt, else its last
 * token's. */
static int entry_rows(const batch_seq *bs) { return bs->all_logits ? bs->n_tok : 1; }

/* Batch entry i's output: rows are its logits rows (every row of a draft or a scored prompt,
 * else its last token's). A draft is settled; a prompt step written back to the cache; a
 * finished prompt's first token sampled (or its embedding pooled, its score kept). */
static void step_output(engine *e, int i, float *rows, int n_be) {
    eseq *s = e->batch_seqs[i];
    const batch_seq *bs = &e->batch[i];
    int n_draft = bs->kv_start + bs->n_tok - s->n_hist; /* tokens past its history */
    if (n_draft > 0) {
        if (!s->done) spec_settle(e, s, bs->kv_start, n_draft, rows);
        return;
    }
    if (bs->all_logits) score_prompt_rows(e, s, bs->kv_start, bs->n_tok, rows);
    float *row = rows + (size_t)(entry_rows(bs) - 1) * (size_t)e->m->hp.n_vocab; /* the last's */
    if (blend_failed(e, i, n_be)) return; /* the same tokens again, next step */
    s->n_computed += bs->n_tok;
    if (!s->done && cache_on(e, s))
        plan_write_back(e->plan, &s->ps, &s->req->plan, &s->kv, s->hist, s->n_computed);
    if (s->n_computed < s->n_hist) return; /* more prompt to go */
    if (s->n_gen == 0 && !s->done && s->req->skv) schema_done(e, s);
    if (s->n_gen == 0 && !s->done && cache_on(e, s)) {
        gen_request *r = s->req;
        plan_store_tail(e->plan, &s->ps, &r->plan, &s->kv, false);
        plan_store_content(e->plan, &s->ps, &r->plan, &s->kv, r->prompt, s->n_computed,
                           s->choice == 0);
        if (s->choice == 0 && s->ps.blended > 0) {
            pthread_mutex_lock(&r->mu);
            r->blended_tokens = s->ps.blended;
            r->recomputed_tokens = s->ps.recomputed;
            r->blend_ratio_used = s->ps.blend_ratio;
            r->blend_policy_used = s->ps.blend_policy;
            r->cached_tokens += s->ps.blended - s->ps.recomputed;
            pthread_mutex_unlock(&r->mu);
        }
    }
    s->preempted = false;
    if (s->req == e->shadow_req) {
        shadow_done(e, row);
        return;
    }
    shadow_probe(e, s, row);
    if (s->req->pooling != GEN_POOL_NONE) {
        embed_finish(e, s);
        return;
    }
    if (s->req->max_tokens == 0) {
        /* Prompt only (echo, scoring): every choice ends without a token. */
        for (int k = 0; k < e->n_run; k++)
            if (e->run[k]->req == s->req && !e->run[k]->done)
                eseq_finish(e, e->run[k], GEN_FINISH_LENGTH, 0, NULL);
        return;
    }
    if (s->choice == 0 && !s->forked && s->req->n_choices > 1) fork_siblings(e, s, row);
    eseq_sample(e, s, row, -1);
}

/* One step of continuous batching: cached prefixes taken, the batch chosen (decode rows and
 * their drafts first, then prefill), one forward pass, every entry's output consumed. */
static void step(engine *e) {
    int n_b = 0, n_pos = 0;
    step_reuse(e);
    int budget = step_decode(e, &n_b, &n_pos);
    step_prefill(e, budget, &n_b, &n_pos);
    if (n_b == 0) return;
    step_positions(e, n_b);
    kv_error err = {{0}};
    int n_be = 0;
    int n_out = step_forward(e, n_b, n_pos, &n_be, &err);
    int n_rows = 0; /* one logits row per entry, every row for prompt scoring */
    for (int i = 0; i < n_b; i++) n_rows += entry_rows(&e->batch[i]);
    if (n_out != n_rows) {
        log_error("forward pass failed: %s", err.msg);
        for (int i = 0; i < n_b; i++)
            eseq_finish(e, e->batch_seqs[i], GEN_FINISH_ERROR, 500, "inference failed");
        return;
    }
    float *rows = e->logits;
    for (int i = 0; i < n_b; i++) {
        step_output(e, i, rows, n_be);
        rows += (size_t)entry_rows(&e->batch[i]) * (size_t)e->m->hp.n_vocab;
    }
}

static void publish_gauges(engine *e, int waiting) {
    pool_cache_stats ps = {0};
    pool_cache *pc = pool_tier(e);
    if (pc) pool_cache_stats_get(pc, &ps);
    metrics_engine g = {
        .waiting = waiting,
        .running = e->n_run,
        .kv_blocks_total = kv_pool_total_blocks(e->pool),
        .kv_blocks_used = kv_pool_total_blocks(e->pool) - kv_pool_free_blocks(e->pool) -
                          (pc ? pool_cache_idle_blocks(pc) : 0),
        .kv_blocks_cached = ps.blocks,
        .kv_block_tokens = kv_pool_layout(e->pool)->block_tokens,
        .draft_blocks_total = e->draft ? draft_blocks_total(e->draft) : 0,
        .draft_blocks_used =
            e->draft ? draft_blocks_total(e->draft) - draft_blocks_free(e->draft) : 0,
    };
    metrics_set_engine(e->mx, &g);
}

/* While idle with tail records waiting for the disk (plan_drain_tails), how often the engine
 * looks again (a record's write takes a few milliseconds). */
#define TAIL_POLL_NS 2000000L

static bool tails_waiting(const engine *e) { return e->plan && plan_tails_pending(e->plan); }

static void *engine_main(void *arg) {
    engine *e = arg;
    for (;;) {
        pthread_mutex_lock(&e->mu);
        /* idle: a check waiting runs now */
        while (!e->stopping && e->q_len == 0 && e->n_run == 0 &&
               (e->n_shadows == 0 || e->shadow_req)) {
            if (!tails_waiting(e)) {
                pthread_cond_wait(&e->cv, &e->mu);
                continue;
            }
            /* ended sequences' tail records wait for the disk: polled while idle */
            pthread_mutex_unlock(&e->mu);
            plan_drain_tails(e->plan, false);
            pthread_mutex_lock(&e->mu);
            if (tails_waiting(e)) {
                struct timespec until = deadline_in(CLOCK_REALTIME, TAIL_POLL_NS);
                pthread_cond_timedwait(&e->cv, &e->mu, &until); /* e->cv: the default clock */
            }
        }
        if (e->stopping) {
            pthread_mutex_unlock(&e->mu);
            break;
        }
        if (pool_tier(e)) pool_cache_reclaim(pool_tier(e));
        admit(e);
        int waiting = e->q_len;
        shadow_yield(e);
        if (e->n_run == 0 && e->q_len == 0 && e->n_shadows > 0 && !e->shadow_req) shadow_start(e);
        pthread_mutex_unlock(&e->mu);
        reap(e);
        publish_gauges(e, waiting);
        if (e->n_run == 0) {
            /* The queue head is waiting for room that only finishing sequences free; with none
             * running it was admitted above, so an empty batch means everything was cancelled. */
            continue;
        }
        step(e);
        reap(e);
        if (e->plan) plan_drain_tails(e->plan, false);
        publish_gauges(e, waiting);
    }
    /* Shutting down: end every stream with an error the client can see. */
    if (e->shadow_req) shadow_stop(e);
    for (int i = 0; i < e->n_run; i++)
        if (!e->run[i]->done)
            eseq_finish(e, e->run[i], GEN_FINISH_ERROR, 503, "the server is shutting down");
    reap(e);
    if (e->plan)
        plan_drain_tails(e->plan, true); /* kept across a restart, as when the disk kept up */
    pthread_mutex_lock(&e->mu);
    while (e->q_len > 0) {
        gen_request *r = e->queue[e->q_head];
        queue_pop(e, false);
        request_fail(r, 503, "the server is shutting down");
        gen_request_unref(r);
    }
    pthread_mutex_unlock(&e->mu);
    return NULL;
}

/* ---------------------------------------------------------------- lifecycle */

/* The draft model on e's backend, with its per-step job and sequence lists. */
static int engine_create_draft(engine *e, kv_error *err) {
    const engine_opts *o = &e->o;
    /* its prompt catch-up takes a prefill step's worth of tokens a step at most */
    if (!(e->draft = draft_create(e->m, o->draft, e->b, o->kv_pool_tokens, o->max_seqs,
                                  o->prefill_chunk, err)))
        return -1;
    e->djobs = calloc((size_t)o->max_seqs, sizeof *e->djobs);
    e->dseqs = calloc((size_t)o->max_seqs, sizeof *e->dseqs);
    if (!e->djobs || !e->dseqs) return kv_fail(err, "out of memory");
    return 0;
}

engine *engine_create(const model *m, const engine_opts *o, metrics *mx, kv_error *err) {
    if (o->ctx < 16 || o->max_seqs < 1 || o->prefill_chunk < 1 || o->max_queue < 1 ||
        o->kv_pool_tokens < o->ctx) {
        kv_fail(err,
                "engine options out of range (ctx %d, max_seqs %d, prefill_chunk %d, "
                "max_queue %d, kv_pool_tokens %lld: the pool must hold one context)",
                o->ctx, o->max_seqs, o->prefill_chunk, o->max_queue, (long long)o->kv_pool_tokens);
        return NULL;
    }
    engine *e = calloc(1, sizeof *e);
    if (!e) {
        kv_fail(err, "out of memory");
        return NULL;
    }
    e->m = m;
    e->o = *o;
    e->mx = mx;
    pthread_mutex_init(&e->mu, NULL);
    pthread_mutex_init(&e->qmu, NULL);
    e->mon = o->monitor;
    if (o->quality_sample <= 0) e->mon.on = false; /* no check: nothing steps */
    pthread_cond_init(&e->cv, NULL);
    if (!(e->b = backend_create(o->device, o->threads, err))) goto fail;
    backend_set_precision(e->b, o->precise ? MATMUL_PRECISION_F32 : MATMUL_PRECISION_Q8);
    if (!(e->pool = kv_pool_create(e->b, m, (o->kv_pool_tokens + 15) / 16 * 16, 16, err)))
        goto fail;
    bool blend = o->chunk_tokens > 0 && o->blend_bytes > 0;
    if (blend && (o->blend_chunk < 16 || o->blend_ratio < 0 || o->blend_ratio > 1)) {
        kv_fail(err, "blend options out of range (chunk %d, ratio %g)", o->blend_chunk,
                (double)o->blend_ratio);
        goto fail;
    }
    int step_tokens =
        blend && o->blend_chunk > o->prefill_chunk ? o->blend_chunk : o->prefill_chunk;
    int max_tokens = o->max_seqs + step_tokens;
    e->fwd_tokens = max_tokens;
    if (!(e->fwd = forward_ctx_create(m, e->b, e->pool, max_tokens, o->max_seqs, err))) goto fail;
    atomic_init(&e->blended_tokens, 0);
    atomic_init(&e->recomputed_tokens, 0);
    if (blend) {
        if (!(e->bents = calloc((size_t)o->max_seqs, sizeof *e->bents))) {
            kv_fail(err, "out of memory for blend");
            goto fail;
        }
        if (!(e->fus = blend_fusor_create(m, e->b, e->pool, max_tokens, err))) goto fail;
    }
    if (o->draft && o->spec && engine_create_draft(e, err)) goto fail;
    atomic_init(&e->draft_ns, 0);
    atomic_init(&e->model_drafted, 0);
    atomic_init(&e->model_accepted, 0);
    atomic_init(&e->reused_tokens, 0);
    atomic_init(&e->spec_drafted, 0);
    atomic_init(&e->spec_accepted, 0);
    if (o->chunk_tokens > 0) {
        plan_opts po = {.store = o->store,
                        .chunk_tokens = o->chunk_tokens,
                        .pool_tier = o->pool_cache,
                        .prefetch_bytes = o->prefetch_bytes,
                        .ttft_budget_ms = o->ttft_budget_ms,
                        .blend_bytes = blend ? o->blend_bytes : 0,
                        .blend_ratio = o->blend_ratio,
                        .blend_policy = o->blend_policy,
                        .blend_disk = o->blend_disk,
                        .levels_barred = o->levels_barred};
        if (!(e->plan = planner_create(m, e->b, e->pool, &po, err))) goto fail;
    }
    size_t n_vocab = (size_t)m->hp.n_vocab;
    /* One row per sequence, or every prompt row of a scoring request: pages are touched only
     * by the rows a step uses. */
    e->logits = kv_aligned_alloc(sizeof(float) * n_vocab * (size_t)max_tokens);
    e->work = kv_aligned_alloc(sizeof(float) * n_vocab);
    e->q_cap = o->max_queue;
    e->queue = calloc((size_t)e->q_cap, sizeof *e->queue);
    e->run = calloc((size_t)o->max_seqs, sizeof *e->run);
    e->batch = calloc((size_t)o->max_seqs, sizeof *e->batch);
    e->batch_seqs = calloc((size_t)o->max_seqs, sizeof *e->batch_seqs);
    e->batch_pos = calloc((size_t)max_tokens, sizeof *e->batch_pos);
    if (!e->logits || !e->work || !e->queue || !e->run || !e->batch || !e->batch_seqs ||
        !e->batch_pos) {
        kv_fail(err, "out of memory for the engine's buffers");
        goto fail;
    }
    int rc = pthread_create(&e->thread, NULL, engine_main, e);
    if (rc) {
        kv_fail(err, "cannot start the engine thread: %s", strerror(rc));
        goto fail;
    }
    e->thread_started = true;
    return e;
fail:
    engine_destroy(e);
    return NULL;
}

void engine_stop(engine *e) {
    pthread_mutex_lock(&e->mu);
    e->stopping = true;
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
    if (e->thread_started) {
        pthread_join(e->thread, NULL);
        e->thread_started = false;
    }
}

void engine_destroy(engine *e) {
    if (!e) return;
    engine_stop(e);
    free(e->queue);
    free(e->run);
    free(e->batch);
    free(e->batch_seqs);
    free(e->batch_pos);
    kv_aligned_free(e->logits);
    kv_aligned_free(e->work);
    forward_ctx_destroy(e->fwd);
    blend_fusor_destroy(e->fus);
    draft_destroy(e->draft);
    free(e->djobs);
    free(e->dseqs);
    free(e->bents);
    free(e->bspans);
    planner_destroy(e->plan);
    kv_pool_destroy(e->pool);
    backend_destroy(e->b);
    for (int i = 0; i < e->n_shadows; i++) {
        free(e->shadows[i].prompt);
        free(e->shadows[i].bounds);
    }
    pthread_mutex_destroy(&e->mu);
    pthread_mutex_destroy(&e->qmu);
    pthread_cond_destroy(&e->cv);
    free(e);
}

/* Checks r as engine_submit must before queueing it: false with err. */
static bool request_valid(engine *e, gen_request *r, kv_error *err) {
    int n_vocab = e->m->hp.n_vocab;
    if (r->n_choices > e->o.max_seqs) {
        kv_fail(err, "n = %d exceeds the server's %d concurrent sequences", r->n_choices,
                e->o.max_seqs);
        return false;
    }
    if (r->n_prompt < 1 || r->n_prompt >= e->o.ctx) {
        kv_fail(err, "the prompt has %d tokens; it must have 1 to %d", r->n_prompt, e->o.ctx - 1);
        return false;
    }
    if (r->logprobs && (r->top_logprobs < 0 || r->top_logprobs > GEN_MAX_TOP_LOGPROBS)) {
        kv_fail(err, "top_logprobs must be in [0, %d]", GEN_MAX_TOP_LOGPROBS);
        return false;
    }
    if (r->max_tokens < 0) {
        kv_fail(err, "max_tokens must not be negative");
        return false;
    }
    if (r->pooling != GEN_POOL_NONE &&
        (!r->embedding || r->n_choices != 1 || r->max_tokens != 0 || r->prompt_logprobs)) {
        kv_fail(err, "an embedding request has one choice, no tokens to generate and a vector");
        return false;
    }
    if (r->prompt_logprobs && !r->prompt_lps &&
        !(r->prompt_lps = calloc((size_t)r->n_prompt, sizeof *r->prompt_lps))) {
        kv_fail(err, "out of memory for the prompt's logprobs");
        return false;
    }
    for (int i = 0; i < r->n_prompt; i++)
        if (r->prompt[i] < 0 || r->prompt[i] >= n_vocab) {
            kv_fail(err, "token id %d at prompt position %d is outside the vocabulary [0, %d)",
                    r->prompt[i], i, n_vocab);
            return false;
        }
    r->sp.bias = r->bias;
    sampler *probe = sampler_create(&r->sp, n_vocab, err); /* validates the parameters */
    if (!probe) return false;
    sampler_destroy(probe);
    return true;
}

engine_submit_status engine_submit_group(engine *e, gen_request *const *rs, int n, kv_error *err) {
    if (n < 1) {
        kv_fail(err, "a group holds at least one request, not %d", n);
        return ENGINE_SUBMIT_INVALID;
    }
    for (int i = 0; i < n; i++)
        if (!request_valid(e, rs[i], err)) {
            if (n > 1) kv_fail_wrap(err, "request %d of %d", i, n);
            return ENGINE_SUBMIT_INVALID;
        }
    pthread_mutex_lock(&e->mu);
    engine_submit_status st = ENGINE_SUBMIT_OK;
    if (e->stopping) {
        st = ENGINE_SUBMIT_SHUTTING_DOWN;
        kv_fail(err, "the server is shutting down");
    } else if (e->q_len == e->q_cap) {
        st = ENGINE_SUBMIT_QUEUE_FULL;
        kv_fail(err, "the server is busy: %d requests are waiting; retry later", e->q_len);
    } else {
        for (int i = 0; i < n; i++) {
            atomic_fetch_add(&rs[i]->refs, 1);
            rs[i]->group_next = i + 1 < n ? rs[i + 1] : NULL;
        }
        e->queue[(e->q_head + e->q_len) % e->q_cap] = rs[0];
        e->q_len++;
        pthread_cond_signal(&e->cv);
    }
    pthread_mutex_unlock(&e->mu);
    return st;
}

engine_submit_status engine_submit(engine *e, gen_request *r, kv_error *err) {
    return engine_submit_group(e, &r, 1, err);
}

int engine_ctx(const engine *e) { return e->o.ctx; }
int engine_max_seqs(const engine *e) { return e->o.max_seqs; }
const char *engine_backend_name(const engine *e) { return backend_name(e->b); }
int64_t engine_kv_pool_tokens(const engine *e) {
    return kv_pool_total_blocks(e->pool) * kv_pool_layout(e->pool)->block_tokens;
}
int engine_threads(const engine *e) { return backend_n_threads(e->b); }

void engine_spec_stats_get(engine *e, engine_spec_stats *out) {
    out->on = e->o.spec;
    out->drafted = atomic_load(&e->spec_drafted);
    out->accepted = atomic_load(&e->spec_accepted);
    out->draft_model = e->draft ? draft_model_of(e->draft)->path : NULL;
    out->draft_seconds = (double)atomic_load(&e->draft_ns) / 1e9;
    out->model_drafted = atomic_load(&e->model_drafted);
    out->model_accepted = atomic_load(&e->model_accepted);
}

/* ---------------------------------------------------------------- context cache interface */

int engine_prepare_cache(engine *e, gen_request *r, const cache_key *ns, bool fetch) {
    if (!e->plan) return 0;
    pthread_mutex_lock(&e->mu);
    bool queue_full = e->q_len >= e->q_cap;
    pthread_mutex_unlock(&e->mu);
    /* a Prompt Cache prompt's KV is not a plain prefix's: no prefix key may name it */
    return plan_prepare(e->plan, &r->plan, ns, r->prompt, r->n_prompt, r->pos || r->skv,
                        r->prompt_logprobs, r->t_arrival, fetch && !queue_full);
}

int64_t engine_cache_clear(engine *e, const cache_key *ns) {
    return pool_tier(e) ? pool_cache_clear(pool_tier(e), ns) : 0;
}

void engine_blend_clear(engine *e, const cache_key *ns, bool ram, bool disk, int64_t *n_ram,
                        int64_t *n_disk) {
    content_store *cs = e->plan ? planner_content(e->plan) : NULL;
    *n_ram = ram && cs ? content_store_clear(cs, ns) : 0;
    *n_disk = disk ? content_disk_clear(e->o.blend_disk, ns) : 0;
}

void engine_cache_stats_get(engine *e, engine_cache_stats *out) {
    memset(out, 0, sizeof *out);
    out->enabled = e->o.chunk_tokens > 0;
    out->chunk_tokens = e->o.chunk_tokens;
    out->reused_tokens = atomic_load(&e->reused_tokens);
    out->blended_tokens = atomic_load(&e->blended_tokens);
    out->recomputed_tokens = atomic_load(&e->recomputed_tokens);
    out->tails_dropped = e->plan ? planner_tails_dropped(e->plan) : 0;
    content_store *cs = e->plan ? planner_content(e->plan) : NULL;
    if (cs) content_store_stats(cs, &out->content);
    content_disk_stats(e->o.blend_disk, &out->content_disk);
    pool_cache *pc = pool_tier(e);
    if (!pc) return;
    pool_cache_stats ps;
    pool_cache_stats_get(pc, &ps);
    out->pool_entries = ps.entries;
    out->pool_blocks = ps.blocks;
    out->pool_hits = ps.hits;
    out->pool_misses = ps.misses;
    out->pool_evictions = ps.evictions;
}
