/* The draft model (internal to the engine): a smaller model of the same vocabulary
 * (--draft-model) that proposes the tokens a sequence's next verify step checks (Leviathan et
 * al. 2023, "Fast Inference from Transformers via Speculative Decoding"; llama.cpp's and vLLM's
 * draft-model speculation). It runs on the engine's backend (its thread pool, or its CUDA
 * stream) with a forward context and a KV pool of its own: its layers and heads are not the
 * target's, so its KV cannot live in the target's pool.
 *
 * Each drafting sequence keeps a draft_seq: the draft model's KV of the leading tokens of its
 * history. Drafting k tokens for a batch of sequences takes k forward calls, one row per
 * sequence after the first: the first call feeds each sequence the tokens of its history that
 * the draft KV does not hold yet (those kept since its last draft, at least the pending one),
 * and every call's greedy choice is the next draft token. After verification the engine cuts the
 * draft KV back to the tokens kept (draft_seq_truncate); the draft tokens are greedy, so the
 * draft is a deterministic proposal and the sampler's accept/resample rule
 * (sampler_sample_draft) keeps the target's distribution without the draft's probabilities. */
#ifndef KVSERVE_ENGINE_DRAFT_H
#define KVSERVE_ENGINE_DRAFT_H

#include <stdint.h>

#include "model/grammar/grammar.h"
#include "model/model.h"

typedef struct draft_model draft_model;

/* The draft model dm (the caller's; it outlives the runner) for target: refused (NULL, err
 * naming both files) unless both give every token id the same token. Its KV pool holds
 * pool_tokens tokens; one draft call takes up to max_seqs sequences and, in its first call,
 * catchup + max_seqs tokens (a sequence further behind catches up over several steps). */
draft_model *draft_create(const model *target, const model *dm, backend *b, int64_t pool_tokens,
                          int max_seqs, int catchup, kv_error *err);
void draft_destroy(draft_model *d);
const model *draft_model_of(const draft_model *d);
/* Blocks of its KV pool in all, and free. */
int64_t draft_blocks_total(const draft_model *d);
int64_t draft_blocks_free(const draft_model *d);

/* A sequence's draft KV: the draft model's KV of hist[0 .. n). */
typedef struct draft_seq {
    kv_seq kv;
    int n;
} draft_seq;

void draft_seq_init(draft_seq *ds);
void draft_seq_release(draft_model *d, draft_seq *ds);
/* Keeps the draft KV of the first n tokens at most (the history's tokens from n on changed). */
void draft_seq_truncate(draft_model *d, draft_seq *ds, int n);

/* One sequence's request: up to k tokens to follow hist[0 .. n_hist) (hist[n_hist - 1] is the
 * token the verify step computes first), written to out[0 .. k), which may be hist + n_hist.
 * With a grammar (gm non-NULL), each draft token is the draft model's best that gm allows from
 * gstate on. n: how many were drafted (0: none, e.g. while the sequence still catches up). */
typedef struct draft_job {
    draft_seq *ds;
    const int32_t *hist;
    int n_hist;
    int k;
    int32_t *out;
    gmatch *gm;
    int32_t gstate;
    int n;
} draft_job;

/* Drafts for jobs[0 .. n_jobs) (n_jobs <= max_seqs) in one batched run. A job whose draft KV
 * cannot grow (the draft pool full) drafts nothing. -1 with err when a forward call fails: every
 * job then drafts nothing and keeps the draft KV it had. */
int draft_run(draft_model *d, draft_job *jobs, int n_jobs, kv_error *err);

#endif
