/* Speculation in the step: how many draft tokens a decoding sequence stages after its history
 * this step, proposed from its prediction or its context (server/engine/spec.h) or by the draft
 * model (server/engine/draft.h), fitted to its grammar and the pool; and a verify step's rows
 * settled, each draft token kept or the rest rolled back. The step loop (sched.c) calls in. */
#include <string.h>

#include "server/engine/engine_impl.h"

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
int eseq_spec_len(engine *e, eseq *s, int budget) {
    const gen_request *r = s->req;
    if (s->n_gen == 0 || s->n_computed < r->n_prompt || s->preempted) return 0;
    int k = spec_ctl_len(&s->spec.ctl);
    if (k > budget) k = budget;
    if (k > r->max_tokens - s->n_gen - 1) k = r->max_tokens - s->n_gen - 1;
    if (k > e->o.ctx - s->n_hist) k = e->o.ctx - s->n_hist;
    return k <= 0 || eseq_hist_reserve(s, k + 1) ? 0 : k;
}

/* Proposes up to k tokens for s from its prediction or its context, staged at hist[n_hist ..);
 * returns how many. With a draft model, s->want_model says the draft model should draft
 * instead: when neither the prediction nor a long context match did (SPEC_MODEL_MATCH), and s
 * runs at the slots' positions (a Prompt Cache sequence's are its own: the draft model's KV
 * would not be the context the target sees). */
int eseq_spec_propose(engine *e, eseq *s, int k) {
    int32_t *d = s->hist + s->n_hist;
    int n = spec_propose(&s->spec, s->hist, s->n_hist, s->n_gen, k, d, &s->spec.drafted_pred);
    s->want_model =
        e->draft && !s->pos && !s->spec.drafted_pred && s->spec.match < SPEC_MODEL_MATCH;
    return n < 0 ? 0 : n;
}

/* Cuts s's staged draft of n tokens to what its grammar allows (at the first token it does
 * not) and to no block more than the pool has free beyond one per running sequence, so a draft
 * never makes a sequence give way; sets the draft tokens' positions. Returns the length. */
int eseq_spec_fit(engine *e, eseq *s, int n) {
    const gen_request *r = s->req;
    const int32_t *d = s->hist + s->n_hist;
    if (r->gm)
        for (int32_t i = 0, st = s->gstate; i < n; i++)
            if ((st = gmatch_accept_token(r->gm, st, d[i])) < 0) n = i;
    int64_t spare = kv_pool_free_blocks(e->pool) - e->n_run;
    while (n > 0 && engine_blocks_for(e, s->n_hist + n) - engine_blocks_for(e, s->n_hist) > spare)
        n--;
    for (int i = 0; s->pos && i < n; i++) s->pos[s->n_hist + i] = s->pos[s->n_hist - 1] + 1 + i;
    return n;
}

/* The draft model drafts for the sequences that want it (dseqs[0 .. n), djobs[i].k tokens
 * each at most), batched (server/engine/draft.h). One that it gives no draft (still catching up
 * with its history, its draft pool full, a grammar allowing nothing) keeps its context draft,
 * proposed again. */
void engine_spec_draft_model(engine *e, int n) {
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
        if (s->n_draft == 0) s->n_draft = eseq_spec_propose(e, s, e->djobs[i].k);
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
void eseq_spec_settle(engine *e, eseq *s, int kv_start, int n_draft, float *rows) {
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
        if (eseq_cache_on(e, s))
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
