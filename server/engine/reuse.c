/* KV a prompt need not compute: the context cache's longest cached prefix and blend's reused
 * spans (cache/plan.h), taken when a sequence starts, and the blended entries of a step; Prompt
 * Cache's modules (cache/schema/schema.h), imported from their records or blended, and a
 * precompute's records stored. The step loop (sched.c) calls in. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "server/engine/engine_impl.h"

/* ---------------------------------------------------------------- context cache */

/* Gives s (holding no KV) its longest cached prefix and plans its blend (cache/plan.h). At
 * least the last token is left to compute, so its logits are fresh (its block, if shared, is
 * copied when written). Prompt scoring needs every prompt row's logits and reuses nothing. */
void eseq_reuse_prefix(engine *e, eseq *s) {
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

/* Copying the content records takes about 2 ms a prompt of SmolLM2 on 2 cores: the first token
 * does not wait for it (DESIGN: write-back is never on the response's critical path). */
void eseq_store_content(engine *e, eseq *s) {
    if (!s->content_pending) return;
    s->content_pending = false;
    gen_request *r = s->req;
    if (!s->done && eseq_cache_on(e, s))
        plan_store_content(e->plan, &s->ps, &r->plan, &s->kv, r->prompt, s->n_computed,
                           s->choice == 0);
}

/* True when s has reused spans at or after its next token. */
bool eseq_blending(const eseq *s) {
    return s->ps.n_spans > 0 &&
           s->ps.spans[s->ps.n_spans - 1].slot + s->ps.spans[s->ps.n_spans - 1].n > s->n_computed;
}

/* How many pending tokens a blended prefill of s takes this step: a reused token costs two
 * layers plus its share of recompute, a new token every layer; within budget (counted in new
 * tokens' worth: *cost) and blend_chunk. */
int eseq_blend_take(const engine *e, const eseq *s, int budget, int *cost) {
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
int engine_blend_entries(engine *e, int n_b) {
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

/* ---------------------------------------------------------------- Prompt Cache */

/* True while s waits for its schema KV (the import did not fit the pool yet): none of its
 * tokens may be computed before, or it would become a full prefill. */
bool eseq_schema_waiting(const eseq *s) {
    const schema_kv *k = s->req->skv;
    return k && k->fixup < 0 && k->n_slots > 0 && s->n_computed == 0;
}

/* A Prompt Cache sequence starting (or restarting after preemption): its first slots get the
 * modules' KV from their records, copied into fresh blocks. With the fix-up its prompt is laid
 * out as a full prefill's and the modules' KV become blend spans instead (the fusor loads them
 * layer by layer, moved to their new positions, and recomputes the most deviating tokens). */
void eseq_schema_start(engine *e, eseq *s) {
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
    int64_t need = engine_blocks_for(e, s->n_hist + 1);
    kv_error err = {{0}};
    uint64_t t0 = clock_now_ns();
    if (engine_room(e, need) < engine_blocks_for(e, k->n_slots) ||
        schema_kv_import(k, e->pool, &s->kv, &err)) {
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
void eseq_schema_done(engine *e, eseq *s) {
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
