/* The engine thread (engine_main): admission from the queue, preemption when the pool is full,
 * and each continuous-batching step: cached prefixes taken, the batch chosen (decode rows and
 * their drafts, then prefill), one forward pass, every entry's output consumed. The rooms it
 * calls hold the rest: output.c, speculate.c, reuse.c, embed.c, check.c, request.c. */
#include <string.h>

#include "server/engine/engine_impl.h"

/* ---------------------------------------------------------------- admission and preemption */

/* Drops a sequence's KV; it re-prefills its whole history (prompt and generated tokens) when
 * the pool has room again, so its output is the same. */
static void preempt(engine *e, eseq *v) {
    log_info("KV pool full: preempting a sequence of %d tokens (it will be recomputed)",
             v->n_computed);
    /* its last block's rows stay findable: coming back, it takes them to the token */
    if (eseq_cache_on(e, v))
        plan_keep_partial(e->plan, &v->ps, &v->req->plan, &v->kv, v->hist, v->n_computed);
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

static bool any_preempted(const engine *e) {
    for (int i = 0; i < e->n_run; i++)
        if (e->run[i]->preempted && !e->run[i]->done) return true;
    return false;
}

/* Moves requests from the queue into the batch while there are sequence slots and KV blocks
 * for their prompts (plus one block of growth per running sequence). The tenants take turns
 * (fairq.h); the head whose turn it is waits rather than being overtaken, so a large request is
 * never starved by smaller ones behind it. A group (engine_submit_group) gets one request
 * admitted per turn and then waits behind its tenant's entries queued after it, so every client
 * request in the queue is admitted at the pace of the others. Called with e->mu held. */
static void admit(engine *e) {
    /* Preempted sequences come back before anything new is admitted. */
    bool blocked = any_preempted(e);
    int t = 0;
    gen_request *r;
    while ((r = fairq_peek(&e->queue, &t))) {
        bool cancelled = atomic_load(&r->cancelled);
        if (!cancelled) {
            if (blocked) break;
            if (e->n_run + r->n_choices > e->o.max_seqs) break;
            /* Leading blocks already in the pool are shared, not allocated; they become the
             * most recently used, so making room does not evict them. */
            pool_cache *pc = engine_pool_tier(e);
            uint64_t keep_from = pc ? pool_cache_clock(pc) : UINT64_MAX;
            int64_t shared =
                e->plan ? plan_shared_blocks(e->plan, &r->plan, r->prompt_logprobs) : 0;
            int64_t need = engine_blocks_for(e, r->n_prompt + 1) - shared + e->n_run;
            if (e->n_run > 0 && engine_room_keep(e, need, keep_from) < need) break;
        }
        /* its group's next request stays queued (fairq_pop says where) */
        gen_request *next = r->group_next;
        r->group_next = NULL;
        fairq_pop(&e->queue, t, !cancelled, next);
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
                gen_request_fail(r, 500, err.msg);
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
        pool_cache *pc = engine_pool_tier(e);
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

/* ---------------------------------------------------------------- the step */

/* True when batch entry i blended in this step's pass and the pass failed it (plan_settle). */
static bool blend_failed(const engine *e, int i, int n_be) {
    for (int k = 0; k < n_be; k++)
        if (e->bents[k].entry == i) return e->bents[k].failed;
    return false;
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
    return rc == 0 && h->embed ? embed_pool_hidden(h->e, st, layer) : rc;
}

/* Sequences starting (or restarting after preemption) take their cached prefix first. */
static void step_reuse(engine *e) {
    for (int i = 0; i < e->n_run; i++) {
        eseq *s = e->run[i];
        if (s->req->skv && !s->done && !s->wait_fork && !s->reuse_tried && s->n_computed == 0 &&
            s->kv.n_blocks == 0)
            eseq_schema_start(e, s);
        if (s->done || s->wait_fork || s->reuse_tried || s->n_computed > 0 || s->kv.n_blocks > 0 ||
            !eseq_cache_on(e, s))
            continue;
        /* A preempted sequence restarts only when its whole history fits (below): taking its
         * prefix back before that would only make it step back again. */
        int64_t whole = engine_blocks_for(e, s->n_hist + 1);
        if (s->preempted && engine_room(e, whole) < whole) continue;
        eseq_reuse_prefix(e, s);
    }
}

/* True when s decodes this step: one pending token. */
static bool decoding(const eseq *s) {
    return !s->done && !s->wait_fork && s->n_hist - s->n_computed == 1 && !eseq_schema_waiting(s);
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
        int k = eseq_spec_len(e, s, left < share ? left : share);
        if (k <= 0) continue;
        left -= k;
        s->n_draft = eseq_spec_propose(e, s, k);
        if (s->want_model) {
            e->dseqs[n_model] = s;
            e->djobs[n_model++].k = k;
        }
    }
    if (n_model > 0) engine_spec_draft_model(e, n_model);
    for (int i = 0; i < e->n_run; i++) {
        eseq *s = e->run[i];
        if (!decoding(s)) continue;
        int k = s->n_draft > 0 ? eseq_spec_fit(e, s, s->n_draft) : 0;
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
        if (s->done || s->wait_fork || pending <= 1 || eseq_schema_waiting(s)) continue;
        /* A preempted sequence restarts only when its whole history fits, so it does not
         * step back again halfway. */
        if (s->preempted && s->n_computed == 0 &&
            engine_room(e, engine_blocks_for(e, s->n_hist + 1)) <
                engine_blocks_for(e, s->n_hist + 1))
            continue;
        int n = pending < budget ? pending : budget, cost = n;
        if (eseq_blending(s) && s->n_computed < s->ps.spans[0].slot) {
            /* up to the first reused token as any prefill, so blended steps start there */
            if (n > s->ps.spans[0].slot - s->n_computed)
                n = cost = s->ps.spans[0].slot - s->n_computed;
        } else if (eseq_blending(s)) {
            /* A blended step's tokens depend on s alone, never on what else runs, so its rows
             * are ranked over the same tokens alone or in any batch: it takes the whole budget,
             * as the step's first prefill, or waits for the next step. */
            if (budget < e->o.prefill_chunk) continue;
            n = eseq_blend_take(e, s, budget, &cost);
            if (n > e->fwd_tokens - *n_pos) continue;
        } else if (n > e->fwd_tokens - *n_pos) {
            n = e->fwd_tokens - *n_pos;
        }
        if (s->req == e->check.req && n > SHADOW_STEP) n = cost = SHADOW_STEP;
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
    int n_be = *n_blended = e->fus ? engine_blend_entries(e, n_b) : 0;
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
        if (!s->done) eseq_spec_settle(e, s, bs->kv_start, n_draft, rows);
        return;
    }
    if (bs->all_logits) eseq_score_prompt_rows(e, s, bs->kv_start, bs->n_tok, rows);
    float *row = rows + (size_t)(entry_rows(bs) - 1) * (size_t)e->m->hp.n_vocab; /* the last's */
    if (blend_failed(e, i, n_be)) return; /* the same tokens again, next step */
    s->n_computed += bs->n_tok;
    if (!s->done && eseq_cache_on(e, s))
        plan_write_back(e->plan, &s->ps, &s->req->plan, &s->kv, s->hist, s->n_computed);
    if (s->n_computed < s->n_hist) return; /* more prompt to go */
    if (s->n_gen == 0 && !s->done && s->req->skv) eseq_schema_done(e, s);
    if (s->n_gen == 0 && !s->done && eseq_cache_on(e, s)) {
        gen_request *r = s->req;
        plan_store_tail(e->plan, &s->ps, &r->plan, &s->kv, false);
        s->content_pending = true; /* once the first token is out (step) */
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
    if (s->req == e->check.req) {
        live_check_done(e, row);
        return;
    }
    live_check_probe(e, s, row);
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
    if (s->choice == 0 && !s->forked && s->req->n_choices > 1) eseq_fork_siblings(e, s, row);
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
    for (int i = 0; i < n_b; i++) eseq_store_content(e, e->batch_seqs[i]);
}

/* ---------------------------------------------------------------- the engine thread */

/* The sequences running per tenant, for engine_tenant_stats_get (under e->mu). */
static void publish_tenants(engine *e) {
    pthread_mutex_lock(&e->mu);
    memset(e->t_running, 0, sizeof *e->t_running * (size_t)e->queue.n_tenants);
    for (int i = 0; i < e->n_run; i++) {
        int t = e->run[i]->req->tenant;
        if (!e->run[i]->done && t >= 0 && t < e->queue.n_tenants) e->t_running[t]++;
    }
    pthread_mutex_unlock(&e->mu);
}

static void publish_gauges(engine *e, int waiting) {
    publish_tenants(e);
    pool_cache_stats ps = {0};
    pool_cache *pc = engine_pool_tier(e);
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

void *engine_main(void *arg) {
    engine *e = arg;
    publish_gauges(e, 0); /* the pool's size, before the first request (GET /get_load) */
    for (;;) {
        pthread_mutex_lock(&e->mu);
        /* idle: a check waiting runs now */
        while (!e->stopping && fairq_total(&e->queue) == 0 && e->n_run == 0 &&
               (e->check.n_shadows == 0 || e->check.req)) {
            if (!tails_waiting(e)) {
                pthread_cond_wait(&e->cv, &e->mu);
                continue;
            }
            /* ended sequences' tail records wait for the disk: polled while idle */
            pthread_mutex_unlock(&e->mu);
            plan_drain_tails(e->plan, false);
            pthread_mutex_lock(&e->mu);
            if (tails_waiting(e)) {
                struct timespec until = engine_deadline_in(CLOCK_REALTIME, TAIL_POLL_NS);
                pthread_cond_timedwait(&e->cv, &e->mu, &until); /* e->cv: the default clock */
            }
        }
        if (e->stopping) {
            pthread_mutex_unlock(&e->mu);
            break;
        }
        if (engine_pool_tier(e)) pool_cache_reclaim(engine_pool_tier(e));
        admit(e);
        int waiting = fairq_total(&e->queue);
        live_check_yield(e);
        if (e->n_run == 0 && waiting == 0 && e->check.n_shadows > 0 && !e->check.req)
            live_check_start(e);
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
    if (e->check.req) live_check_stop(e);
    for (int i = 0; i < e->n_run; i++)
        if (!e->run[i]->done)
            eseq_finish(e, e->run[i], GEN_FINISH_ERROR, 503, "the server is shutting down");
    reap(e);
    if (e->plan)
        plan_drain_tails(e->plan, true); /* kept across a restart, as when the disk kept up */
    pthread_mutex_lock(&e->mu);
    int t = 0;
    gen_request *r;
    while ((r = fairq_peek(&e->queue, &t))) {
        fairq_pop(&e->queue, t, false, r->group_next);
        r->group_next = NULL;
        gen_request_fail(r, 503, "the server is shutting down");
        gen_request_unref(r);
    }
    pthread_mutex_unlock(&e->mu);
    return NULL;
}
