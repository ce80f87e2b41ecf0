/* The engine's public side (engine.h): create, stop and destroy; submitting a request or a
 * group; the figures the stats read; the context cache's interface. The engine thread itself is
 * sched.c's engine_main; engine_impl.h lists the engine's other rooms. */
#include <stdlib.h>
#include <string.h>

#include "server/engine/engine_impl.h"

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
    pthread_mutex_init(&e->check.mu, NULL);
    e->check.mon = o->monitor;
    if (o->quality_sample <= 0) e->check.mon.on = false; /* no check: nothing steps */
    pthread_cond_init(&e->cv, NULL);
    if (!(e->b = backend_create(o->device, o->threads, err))) goto fail;
    backend_set_precision(e->b, o->precise ? MATMUL_PRECISION_F32 : MATMUL_PRECISION_Q8);
    if (o->no_cuda_graphs) backend_set_graphs(e->b, false);
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
    int n_tenants = o->n_tenants > 1 ? o->n_tenants : 1;
    int q_share = (int)kv_tenant_share(o->max_queue, o->tenant_queue_share, n_tenants, 1);
    bool q_ok = fairq_init(&e->queue, n_tenants, o->max_queue, q_share) == 0;
    e->t_running = calloc((size_t)n_tenants, sizeof *e->t_running);
    e->run = calloc((size_t)o->max_seqs, sizeof *e->run);
    e->batch = calloc((size_t)o->max_seqs, sizeof *e->batch);
    e->batch_seqs = calloc((size_t)o->max_seqs, sizeof *e->batch_seqs);
    e->batch_pos = calloc((size_t)max_tokens, sizeof *e->batch_pos);
    if (!e->logits || !e->work || !q_ok || !e->t_running || !e->run || !e->batch ||
        !e->batch_seqs || !e->batch_pos) {
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
    fairq_free(&e->queue);
    free(e->t_running);
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
    for (int i = 0; i < e->check.n_shadows; i++) {
        free(e->check.shadows[i].prompt);
        free(e->check.shadows[i].bounds);
    }
    pthread_mutex_destroy(&e->mu);
    pthread_mutex_destroy(&e->check.mu);
    pthread_cond_destroy(&e->cv);
    free(e);
}

/* ---------------------------------------------------------------- submission */

/* Checks r as engine_submit must before queueing it: false with err. */
static bool request_valid(engine *e, gen_request *r, kv_error *err) {
    int n_vocab = e->m->hp.n_vocab;
    if (r->tenant < 0 || r->tenant >= e->queue.n_tenants) {
        kv_fail(err, "tenant %d is not one of the server's %d", r->tenant, e->queue.n_tenants);
        return false;
    }
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
        if (rs[i]->tenant != rs[0]->tenant) {
            kv_fail(err, "request %d of a group is another tenant's", i);
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
    } else {
        fairq_status qs = fairq_push(&e->queue, rs[0]->tenant, rs[0]);
        st = qs == FAIRQ_OK          ? ENGINE_SUBMIT_OK
             : qs == FAIRQ_NO_MEMORY ? ENGINE_SUBMIT_NO_MEMORY
                                     : ENGINE_SUBMIT_QUEUE_FULL;
        if (qs == FAIRQ_FULL)
            kv_fail(err, "the server is busy: %d requests are waiting; retry later",
                    fairq_total(&e->queue));
        else if (qs == FAIRQ_TENANT_FULL)
            kv_fail(err,
                    "the server is busy: %d of your requests are waiting, your share of the "
                    "queue (--tenant-queue-share); retry later",
                    fairq_len(&e->queue, rs[0]->tenant));
        else if (qs == FAIRQ_NO_MEMORY)
            kv_fail(err, "out of memory for the queue");
        for (int i = 0; i < n && st == ENGINE_SUBMIT_OK; i++) {
            atomic_fetch_add(&rs[i]->refs, 1);
            rs[i]->group_next = i + 1 < n ? rs[i + 1] : NULL;
        }
        if (st == ENGINE_SUBMIT_OK) pthread_cond_signal(&e->cv);
    }
    pthread_mutex_unlock(&e->mu);
    return st;
}

engine_submit_status engine_submit(engine *e, gen_request *r, kv_error *err) {
    return engine_submit_group(e, &r, 1, err);
}

/* ---------------------------------------------------------------- settings and figures */

void engine_tenant_stats_get(engine *e, int t, engine_tenant_stats *out) {
    *out = (engine_tenant_stats){0};
    pthread_mutex_lock(&e->mu);
    if (t >= 0 && t < e->queue.n_tenants)
        *out = (engine_tenant_stats){fairq_len(&e->queue, t), e->t_running[t], e->queue.cap_tenant};
    pthread_mutex_unlock(&e->mu);
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
    bool queue_full = r->tenant < 0 || r->tenant >= e->queue.n_tenants ||
                      fairq_room(&e->queue, r->tenant) != FAIRQ_OK;
    pthread_mutex_unlock(&e->mu);
    /* a Prompt Cache prompt's KV is not a plain prefix's: no prefix key may name it */
    return plan_prepare(e->plan, &r->plan, ns, r->prompt, r->n_prompt, r->pos || r->skv,
                        r->prompt_logprobs, r->t_arrival, fetch && !queue_full);
}

int64_t engine_cache_clear(engine *e, const cache_key *ns) {
    return engine_pool_tier(e) ? pool_cache_clear(engine_pool_tier(e), ns) : 0;
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
    pool_cache *pc = engine_pool_tier(e);
    if (!pc) return;
    pool_cache_stats ps;
    pool_cache_stats_get(pc, &ps);
    out->pool_entries = ps.entries;
    out->pool_blocks = ps.blocks;
    out->pool_hits = ps.hits;
    out->pool_misses = ps.misses;
    out->pool_evictions = ps.evictions;
    out->pool_partial = ps.partial;
    out->pool_partial_hits = ps.partial_hits;
}
