/* The engine's requests and sequences: gen_request's life (engine.h) and a sequence's creation,
 * finish and destruction, which every room of the engine uses (engine_impl.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/engine/engine_impl.h"

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

void gen_request_wait(gen_request *r, int timeout_ms) {
    struct timespec ts = engine_deadline_in(CLOCK_MONOTONIC, (int64_t)timeout_ms * 1000000L);
    pthread_cond_timedwait(&r->cv, &r->mu, &ts);
}

void gen_request_watch(gen_request *r, void (*fn)(void *arg, const gen_request *r), void *arg) {
    pthread_mutex_lock(&r->mu);
    r->notify = fn;
    r->notify_arg = arg;
    pthread_mutex_unlock(&r->mu);
}

/* Wakes whoever waits on r (call with r->mu held). */
void gen_request_changed(gen_request *r) {
    pthread_cond_broadcast(&r->cv);
    if (r->notify) r->notify(r->notify_arg, r);
}

/* Ends every choice of a request still waiting in the queue (no sequences exist yet). */
void gen_request_fail(gen_request *r, int status, const char *msg) {
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

/* ---------------------------------------------------------------- sequences */

void eseq_destroy(engine *e, eseq *s) {
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

eseq *eseq_create(engine *e, gen_request *r, int choice, kv_error *err) {
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

/* Ends one choice: publishes the finish (and, for errors, the request's error) and wakes the
 * reader. The sequence's KV is released at once. */
void eseq_finish(engine *e, eseq *s, gen_finish fin, int status, const char *msg) {
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
    eseq_store_content(e, s);
    if (!s->done && eseq_cache_on(e, s)) {
        plan_keep_partial(e->plan, &s->ps, &r->plan, &s->kv, s->hist, s->n_computed);
        plan_store_tail(e->plan, &s->ps, &r->plan, &s->kv, true);
    }
    kv_seq_release(e->pool, &s->kv);
    if (e->draft) draft_seq_release(e->draft, &s->dkv);
    s->done = true;
}
