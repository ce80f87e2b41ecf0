/* Sampling and output: a sequence's next token sampled (under its grammar, verifying a draft),
 * its logprobs, its text detokenized and released past stop strings and the tool-call guard,
 * published to the request's reader; jump-forward over forced grammar text; prompt scoring; a
 * request's choices forked from the first. The step loop (sched.c) and speculation call in. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "server/engine/engine_impl.h"

/* ---------------------------------------------------------------- logprobs */

/* The k most likely tokens and their log-probabilities under softmax(logits); returns the
 * log-sum-exp, so a given token's logprob is logits[t] - lse. */
static double log_sum_exp(const float *logits, int n);

double engine_top_logprobs(const float *logits, int n_vocab, int k, gen_logprob *out) {
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
void eseq_score_prompt_rows(engine *e, eseq *s, int kv_start, int n, const float *rows) {
    gen_request *r = s->req;
    size_t n_vocab = (size_t)e->m->hp.n_vocab;
    for (int k = 0; k < n; k++) {
        int t = kv_start + k + 1;
        if (t >= r->n_prompt) break;
        const float *row = rows + (size_t)k * n_vocab;
        gen_logprob *lp = &r->prompt_lps[t];
        memset(lp, 0, sizeof *lp);
        double lse = engine_top_logprobs(row, (int)n_vocab, r->top_logprobs, lp);
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

/* ---------------------------------------------------------------- text and history */

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
int eseq_hist_reserve(eseq *s, int extra) {
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
    if (eseq_hist_reserve(s, 1)) return -1;
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

/* ---------------------------------------------------------------- publishing */

/* Appends to a choice (under r->mu). Returns -1 when out of memory. */
static int choice_append_text(gen_choice *c, const char *s, size_t n) {
    if (kv_array_reserve((void **)&c->text, &c->cap, c->len + n + 1, 1, 64)) return -1;
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

/* ---------------------------------------------------------------- sampling */

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
bool eseq_sample(engine *e, eseq *s, float *logits, int32_t draft) {
    gen_request *r = s->req;
    gen_logprob lp = {0};
    if (r->logprobs && r->top_logprobs > 0)
        engine_top_logprobs(logits, e->m->hp.n_vocab, r->top_logprobs, &lp);
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
void eseq_fork_siblings(engine *e, eseq *first, const float *logits) {
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
