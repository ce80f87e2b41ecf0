/* The draft model: its KV pool and forward context on the engine's backend, and the batched
 * greedy drafting of draft_run. See draft.h. */
#include "server/engine/draft.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "model/sampler.h"

struct draft_model {
    const model *m; /* the caller's */
    kv_pool *pool;
    forward_ctx *fwd;
    int max_seqs;
    int max_tokens; /* tokens one call takes: the catch-up budget plus one per sequence */
    batch_seq *bs;  /* [max_seqs] this call's entries */
    int *job;       /* [max_seqs] the job of each entry */
    bool *going;    /* [max_seqs] the jobs whose draft goes on in the next call */
    int32_t *pos;   /* [max_tokens] their positions: the slots (token i at position i) */
    float *logits;  /* [max_seqs][n_vocab] one row per entry */
};

draft_model *draft_create(const model *target, const model *dm, backend *b, int64_t pool_tokens,
                          int max_seqs, int catchup, kv_error *err) {
    kv_error why = {{0}};
    if (tokenizer_same_vocab(target->tok, dm->tok, &why) || dm->hp.n_vocab != target->hp.n_vocab) {
        kv_fail(err,
                "the draft model %s does not share the vocabulary of the model %s (%s): a draft "
                "model must have the same tokenizer",
                dm->path, target->path, why.msg[0] ? why.msg : "the logits' sizes differ");
        return NULL;
    }
    draft_model *d = calloc(1, sizeof *d);
    if (!d) {
        kv_fail(err, "out of memory");
        return NULL;
    }
    d->m = dm;
    d->max_seqs = max_seqs;
    d->max_tokens = catchup + max_seqs;
    if (!(d->pool = kv_pool_create(b, dm, (pool_tokens + 15) / 16 * 16, 16, err))) goto fail;
    if (!(d->fwd = forward_ctx_create(dm, b, d->pool, d->max_tokens, max_seqs, err))) goto fail;
    d->bs = calloc((size_t)max_seqs, sizeof *d->bs);
    d->job = calloc((size_t)max_seqs, sizeof *d->job);
    d->going = calloc((size_t)max_seqs, sizeof *d->going);
    d->pos = calloc((size_t)d->max_tokens, sizeof *d->pos);
    d->logits = kv_aligned_alloc(sizeof(float) * (size_t)dm->hp.n_vocab * (size_t)max_seqs);
    if (!d->bs || !d->job || !d->going || !d->pos || !d->logits) {
        kv_fail(err, "out of memory for the draft model's buffers");
        goto fail;
    }
    return d;
fail:
    kv_fail_wrap(err, "draft model %s", dm->path);
    draft_destroy(d);
    return NULL;
}

void draft_destroy(draft_model *d) {
    if (!d) return;
    forward_ctx_destroy(d->fwd);
    kv_pool_destroy(d->pool);
    free(d->bs);
    free(d->job);
    free(d->going);
    free(d->pos);
    kv_aligned_free(d->logits);
    free(d);
}

const model *draft_model_of(const draft_model *d) { return d->m; }
int64_t draft_blocks_total(const draft_model *d) { return kv_pool_total_blocks(d->pool); }
int64_t draft_blocks_free(const draft_model *d) { return kv_pool_free_blocks(d->pool); }

void draft_seq_init(draft_seq *ds) {
    kv_seq_init(&ds->kv);
    ds->n = 0;
}

void draft_seq_release(draft_model *d, draft_seq *ds) {
    kv_seq_release(d->pool, &ds->kv);
    ds->n = 0;
}

void draft_seq_truncate(draft_model *d, draft_seq *ds, int n) {
    if (n >= ds->n) return;
    ds->n = n < 0 ? 0 : n;
    kv_seq_truncate(d->pool, &ds->kv, ds->n);
}

/* ---------------------------------------------------------------- drafting */

/* Adds job j's next n_tok tokens (from tokens, at its draft KV's end) to the call; false when
 * the draft pool has no room for them. */
static bool call_add(draft_model *d, draft_job *jobs, int j, const int32_t *tokens, int n_tok,
                     int *n_b, int *n_pos) {
    draft_seq *ds = jobs[j].ds;
    kv_error err = {{0}};
    if (kv_seq_reserve(d->pool, &ds->kv, ds->n + n_tok, &err)) return false;
    for (int i = 0; i < n_tok; i++) d->pos[*n_pos + i] = ds->n + i;
    d->bs[*n_b] = (batch_seq){.seq = &ds->kv,
                              .n_tok = n_tok,
                              .tokens = tokens,
                              .pos = d->pos + *n_pos,
                              .kv_start = ds->n};
    d->job[(*n_b)++] = j;
    *n_pos += n_tok;
    return true;
}

/* The draft model's token after a row of logits (modified: the grammar masks it): its most
 * likely one that j's grammar allows, appended to j's draft. False when the draft ends before it
 * (no token allowed) or with it (an end of generation: nothing follows it; or k reached).
 *
 * No draft is cut where the draft model is unsure of its token (llama.cpp's --draft-p-min): a
 * small model's best is often under a third of its mass where it is still right (SmolLM2-135M
 * counting: 0.24-0.34), and the controller (spec_ctl) already shortens the drafts of a sequence
 * whose tokens are not kept. */
static bool call_pick(draft_model *d, draft_job *j, float *row) {
    if (j->gm) {
        kv_error err = {{0}};
        if (gmatch_apply(j->gm, j->gstate, row, &err) <= 0) return false;
    }
    int32_t t = sampler_argmax(row, d->m->hp.n_vocab);
    if (j->gm && (j->gstate = gmatch_accept_token(j->gm, j->gstate, t)) < 0) return false;
    j->out[j->n++] = t;
    return !tokenizer_is_eog(d->m->tok, t) && j->n < j->k;
}

/* Runs the call's entries and picks each one's token; -1 with err when the forward pass fails
 * (the entries' draft KV is then dropped: what the pass wrote is unknown). */
static int call_run(draft_model *d, draft_job *jobs, int n_b, kv_error *err) {
    int n_out = model_forward(d->fwd, d->bs, n_b, NULL, d->logits, err);
    if (n_out != n_b) {
        for (int i = 0; i < n_b; i++) draft_seq_release(d, jobs[d->job[i]].ds);
        return -1;
    }
    for (int i = 0; i < n_b; i++) {
        draft_job *j = &jobs[d->job[i]];
        j->ds->n += d->bs[i].n_tok;
        /* a sequence that only caught up part of the way has no draft this step */
        d->going[d->job[i]] = j->ds->n == j->n_hist + j->n &&
                              call_pick(d, j, d->logits + (size_t)i * (size_t)d->m->hp.n_vocab);
    }
    return 0;
}

int draft_run(draft_model *d, draft_job *jobs, int n_jobs, kv_error *err) {
    bool *going = d->going;
    if (n_jobs > d->max_seqs) n_jobs = d->max_seqs;
    int n_b = 0, n_pos = 0, budget = d->max_tokens - d->max_seqs;
    /* the first call: each job's history from where its draft KV ends, the pending token last */
    for (int j = 0; j < n_jobs; j++) {
        draft_job *jb = &jobs[j];
        jb->n = 0;
        going[j] = false;
        if (jb->k < 1 || jb->n_hist < 1) continue;
        /* what the KV holds past the pending token was never confirmed */
        draft_seq_truncate(d, jb->ds, jb->n_hist - 1);
        int feed = jb->n_hist - jb->ds->n;
        if (feed - 1 > budget) feed = 1 + budget;
        if (call_add(d, jobs, j, jb->hist + jb->ds->n, feed, &n_b, &n_pos)) budget -= feed - 1;
    }
    if (n_b > 0 && call_run(d, jobs, n_b, err)) goto fail;
    /* then one token per call for each draft still going, its last token fed */
    for (;;) {
        n_b = n_pos = 0;
        for (int j = 0; j < n_jobs; j++)
            if (going[j] && !call_add(d, jobs, j, &jobs[j].out[jobs[j].n - 1], 1, &n_b, &n_pos))
                going[j] = false;
        if (n_b == 0) return 0;
        if (call_run(d, jobs, n_b, err)) goto fail;
    }
fail:
    for (int j = 0; j < n_jobs; j++) jobs[j].n = 0;
    return -1;
}
