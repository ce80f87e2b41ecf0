/* The live check and its repairs: work for the idle engine. A blended prompt picked for a check
 * (engine_opts' quality_sample) or a repair (blend_repair) waits in e->check's queue until no
 * client request runs or waits; it is then computed again as a full prefill, in short steps that
 * give way to a client request, and a check compares its first-token distribution with the
 * blended one (cache/quality.h) while a repair stores its chunks. The step loop (sched.c) calls
 * in; engine_quality_stats_get (engine.h) reads the figures. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/engine/engine_impl.h"

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
void live_check_probe(engine *e, const eseq *s, const float *row) {
    live_check *lc = &e->check;
    const gen_request *r = s->req;
    if (s->choice != 0 || s->n_gen > 0 || s->ps.blended == 0 || r->skv || r == lc->req) return;
    bool check = false;
    if (lc->mon.on && r->plan.blend_ratio < 0 && r->plan.blend_policy < 0) {
        lc->acc += e->o.quality_sample;
        if (lc->acc >= 1) {
            lc->acc -= 1;
            check = true;
        }
    }
    bool repair = e->o.blend_repair && eseq_cache_on(e, s);
    /* a prompt already waiting for its repair needs no second one */
    for (int i = 0; i < lc->n_shadows && repair && !check; i++)
        if (lc->shadows[i].repair && lc->shadows[i].n_prompt == r->n_prompt &&
            memcmp(lc->shadows[i].prompt, r->prompt, sizeof(int32_t) * (size_t)r->n_prompt) == 0)
            return;
    if (!check && !repair) return;
    /* repairs alone leave half the queue to checks */
    int cap = check ? SHADOW_CAP : SHADOW_CAP / 2;
    shadow *sh = lc->n_shadows < cap ? &lc->shadows[lc->n_shadows] : NULL;
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
        if (check) engine_top_logprobs(row, e->m->hp.n_vocab, GEN_MAX_TOP_LOGPROBS, &sh->first);
        sh->repair = repair;
        sh->ns = r->plan.ns;
        sh->n_bounds = repair ? r->plan.n_bounds : 0;
        lc->n_shadows++;
    }
    pthread_mutex_lock(&lc->mu);
    if (check) lc->sampled++;
    if (check && !sh) lc->dropped++;
    if (repair && !sh) lc->repair_dropped++;
    pthread_mutex_unlock(&lc->mu);
}

/* Drops the oldest entry of the idle engine's queue. */
static void shadow_pop(engine *e) {
    live_check *lc = &e->check;
    shadow *sh = &lc->shadows[0];
    free(sh->prompt);
    free(sh->bounds);
    memmove(&lc->shadows[0], &lc->shadows[1], sizeof *sh * (size_t)--lc->n_shadows);
}

/* The engine is idle (nothing running, nothing queued): the oldest entry starts, a full
 * prefill of its prompt. A check alone reuses and stores nothing; a repair reuses the exact
 * prefix the pool holds, nothing by content, and stores its chunks as any prompt does. */
void live_check_start(engine *e) {
    live_check *lc = &e->check;
    shadow *sh = &lc->shadows[0];
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
    lc->req = r; /* the creation's reference */
}

/* Ends the running check's sequence (quietly: no client reads it). */
void live_check_stop(engine *e) {
    live_check *lc = &e->check;
    for (int i = 0; i < e->n_run; i++)
        if (e->run[i]->req == lc->req) {
            kv_seq_release(e->pool, &e->run[i]->kv);
            e->run[i]->done = true;
        }
    gen_request_unref(lc->req);
    lc->req = NULL;
}

/* A client request came while a check runs: the check gives way (and runs again later). */
void live_check_yield(engine *e) {
    live_check *lc = &e->check;
    if (!lc->req) return;
    bool client = fairq_total(&e->queue) > 0;
    for (int i = 0; i < e->n_run && !client; i++)
        client = e->run[i]->req != lc->req && !e->run[i]->done;
    if (!client) return;
    live_check_stop(e);
    pthread_mutex_lock(&lc->mu);
    lc->abandoned++;
    pthread_mutex_unlock(&lc->mu);
}

/* The entry's full prefill is done (row: its last token's logits; a repair's chunks are
 * stored): a check compares the two first-token distributions and tells the monitor; a step
 * changes the ratio blended prompts that name none get. */
void live_check_done(engine *e, const float *row) {
    live_check *lc = &e->check;
    shadow *sh = &lc->shadows[0];
    char why[300];
    int step = 0;
    float ratio = 0;
    double kl = 0;
    bool top1 = false;
    if (sh->check) {
        gen_logprob full = {0};
        engine_top_logprobs(row, e->m->hp.n_vocab, GEN_MAX_TOP_LOGPROBS, &full);
        kl = quality_kl_topk(full.top_ids, full.top_lps, full.n_top, sh->first.top_ids,
                             sh->first.top_lps, sh->first.n_top);
        top1 = full.n_top > 0 && sh->first.n_top > 0 && full.top_ids[0] == sh->first.top_ids[0];
    }
    pthread_mutex_lock(&lc->mu);
    if (sh->check) {
        lc->checked++;
        lc->kl_sum += kl;
        lc->top1_sum += top1;
        step = quality_monitor_add(&lc->mon, kl, top1, why, sizeof why);
        ratio = quality_monitor_ratio(&lc->mon);
        if (step) snprintf(lc->last_step, sizeof lc->last_step, "%s", why);
    }
    if (sh->repair) lc->repaired++;
    pthread_mutex_unlock(&lc->mu);
    if (step) {
        if (e->plan) planner_set_blend_ratio(e->plan, ratio);
        log_warn("reuse quality: live check: blend %s", why);
    }
    shadow_pop(e);
    live_check_stop(e);
}

void engine_quality_stats_get(engine *e, engine_quality_stats *out) {
    live_check *lc = &e->check;
    memset(out, 0, sizeof *out);
    pthread_mutex_lock(&lc->mu);
    out->on = lc->mon.on;
    out->ratio = quality_monitor_ratio(&lc->mon);
    out->policy = lc->mon.policy;
    out->sample = e->o.quality_sample;
    out->sampled = lc->sampled;
    out->checked = lc->checked;
    out->dropped = lc->dropped;
    out->abandoned = lc->abandoned;
    out->mean_kl = lc->checked ? lc->kl_sum / (double)lc->checked : 0;
    out->mean_top1 = lc->checked ? lc->top1_sum / (double)lc->checked : 0;
    out->rolling_kl = lc->mon.last_kl;
    out->rolling_top1 = lc->mon.last_top1;
    out->steps_up = lc->mon.steps_up;
    out->steps_down = lc->mon.steps_down;
    snprintf(out->last_step, sizeof out->last_step, "%s", lc->last_step);
    out->repaired = lc->repaired;
    out->repair_dropped = lc->repair_dropped;
    pthread_mutex_unlock(&lc->mu);
}
