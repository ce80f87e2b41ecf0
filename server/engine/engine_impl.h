/* The engine's inside: its structs and the functions its rooms share. Internal to
 * server/engine/ (the rest of the server uses engine.h, the contract).
 *
 * The engine thread admits requests, batches their sequences continuously, and samples and
 * publishes their output. A sequence (one choice of a request) holds its whole token history,
 * prompt and generated, and how much of it has KV in the pool (n_computed). Each step gives
 * every sequence with one token pending (decode) that token, and shares prefill_chunk tokens
 * among sequences with more pending (prefill), oldest first. A sequence whose pending tokens all
 * ran samples its next token from the step's logits. The same rule covers preemption: when the
 * pool is full, the youngest sequence's KV is dropped (n_computed = 0) and it re-prefills its
 * history later, as vLLM's recompute preemption does, so its output is unchanged.
 *
 * The n choices of a request prefill the prompt once: the first choice computes it, the others
 * fork its KV blocks (shared by reference count) when it samples its first token.
 *
 * The rooms, each calling only rooms listed after it:
 *   engine.c     create, stop, destroy; submission; the public figures; the context cache's
 *                interface (engine.h)
 *   fairq.c      the queue: a lane per tenant, admitted in turn
 *   sched.c      the engine thread (engine_main): admission, preemption, each step's batch,
 *                its forward pass, every entry's output consumed
 *   speculate.c  speculation in the step: drafts staged after a sequence's history (from its
 *                prediction, its context or the draft model) and verified
 *   check.c      the live check and its repairs: full prefills for the idle engine
 *   reuse.c      KV a prompt need not compute: the context cache's prefix and blend, Prompt
 *                Cache's modules
 *   embed.c      embeddings: the prompt's last hidden states pooled and normalized
 *   output.c     sampling and output: logprobs, detokenization, stop strings, the tool-call
 *                guard, the grammar, jump-forward, a request's choices forked
 *   request.c    gen_request (engine.h) and the engine's sequences: create, finish, destroy */
#ifndef KVSERVE_ENGINE_IMPL_H
#define KVSERVE_ENGINE_IMPL_H

#include <time.h>

#include "server/engine/draft.h"
#include "server/engine/engine.h"
#include "server/engine/fairq.h"
#include "server/engine/spec.h"

/* ---------------------------------------------------------------- structs */

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
    bool reuse_tried;     /* looked up since it last held no KV */
    bool content_pending; /* its prompt's content records are still to store (eseq_store_content) */
    plan_seq ps;          /* the context cache's and blend's side of it (cache/plan.h) */
    spec_seq spec;        /* its drafting (server/engine/spec.h) */
    draft_seq dkv;        /* the draft model's KV of its history (server/engine/draft.h) */
    int n_draft;          /* this step: draft tokens staged after its history */
    bool want_model;      /* this step: its draft is the draft model's to make */
    bool by_model;        /* the draft being verified is the draft model's */
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

/* The live check and its repairs (check.c): entries waiting for an idle engine (oldest first),
 * the running one's request (NULL: none), the share of blended requests picked so far; the
 * monitor and the counters under mu (the stats read them). Engine thread only, but for those. */
typedef struct live_check {
    shadow shadows[SHADOW_CAP];
    int n_shadows;
    gen_request *req;
    double acc;
    pthread_mutex_t mu;
    quality_monitor mon;
    int64_t sampled, checked, dropped, abandoned;
    int64_t repaired, repair_dropped;
    double kl_sum, top1_sum;
    char last_step[300];
} live_check;

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
    fairq queue;    /* waiting requests, a lane per tenant */
    int *t_running; /* [n_tenants] sequences running per tenant, as last published */
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
    /* the live check and its repair queue (check.c) */
    live_check check;
};

/* ---------------------------------------------------------------- helpers any room may use */

/* The pool tier, or NULL. */
static inline pool_cache *engine_pool_tier(const engine *e) {
    return e->plan ? planner_pool(e->plan) : NULL;
}

/* True when s's request takes part in the context cache. */
static inline bool eseq_cache_on(const engine *e, const eseq *s) {
    return e->plan && s->req->plan.cache;
}

static inline int64_t engine_blocks_for(const engine *e, int64_t n_tokens) {
    int bt = kv_pool_layout(e->pool)->block_tokens;
    return (n_tokens + bt - 1) / bt;
}

/* Free blocks after evicting idle cached chunks used before stamp keep_from, as far as needed
 * to reach need (and only if that reaches it). */
static inline int64_t engine_room_keep(engine *e, int64_t need, uint64_t keep_from) {
    pool_cache *pc = engine_pool_tier(e);
    if (pc && kv_pool_free_blocks(e->pool) < need) return pool_cache_make_room(pc, need, keep_from);
    return kv_pool_free_blocks(e->pool);
}

static inline int64_t engine_room(engine *e, int64_t need) {
    return engine_room_keep(e, need, UINT64_MAX);
}

/* The time ns nanoseconds from now on clock c: a pthread_cond_timedwait deadline. */
static inline struct timespec engine_deadline_in(clockid_t c, int64_t ns) {
    struct timespec ts;
    clock_gettime(c, &ts);
    ns += ts.tv_nsec;
    ts.tv_sec += (time_t)(ns / 1000000000L);
    ts.tv_nsec = (long)(ns % 1000000000L);
    return ts;
}

/* ---------------------------------------------------------------- request.c: requests and seqs */

/* Wakes whoever waits on r (call with r->mu held). */
void gen_request_changed(gen_request *r);
/* Ends every choice of a request still waiting in the queue (no sequences exist yet). */
void gen_request_fail(gen_request *r, int status, const char *msg);
/* Choice `choice` of r, holding a reference to r; NULL with err. */
eseq *eseq_create(engine *e, gen_request *r, int choice, kv_error *err);
void eseq_destroy(engine *e, eseq *s);
/* Ends one choice (publishes the finish and wakes the reader) and releases its KV. */
void eseq_finish(engine *e, eseq *s, gen_finish fin, int status, const char *msg);

/* ---------------------------------------------------------------- output.c: sampling, output */

/* The k most likely tokens and their logprobs into out; returns the log-sum-exp. */
double engine_top_logprobs(const float *logits, int n_vocab, int k, gen_logprob *out);
/* Prompt scoring: rows [0, n) are the logits after prompt tokens kv_start.. kv_start + n - 1. */
void eseq_score_prompt_rows(engine *e, eseq *s, int kv_start, int n, const float *rows);
/* Room in s's history for extra more tokens; -1 when out of memory. */
int eseq_hist_reserve(eseq *s, int extra);
/* Samples s's next token from logits (verifying draft when >= 0) and publishes it; true when
 * the draft was kept and s goes on. */
bool eseq_sample(engine *e, eseq *s, float *logits, int32_t draft);
/* The first choice computed the prompt: its waiting siblings share its KV and sample. */
void eseq_fork_siblings(engine *e, eseq *first, const float *logits);

/* ---------------------------------------------------------------- speculate.c: speculation */

/* How many tokens s may draft this step (0: none), room made after its history. */
int eseq_spec_len(engine *e, eseq *s, int budget);
/* Stages up to k draft tokens for s from its prediction or context; returns how many. */
int eseq_spec_propose(engine *e, eseq *s, int k);
/* Cuts s's staged draft of n tokens to its grammar and the pool; returns the length. */
int eseq_spec_fit(engine *e, eseq *s, int n);
/* The draft model drafts for dseqs[0 .. n). */
void engine_spec_draft_model(engine *e, int n);
/* A verify step's entry for s: the draft's rows sampled, kept or rolled back. */
void eseq_spec_settle(engine *e, eseq *s, int kv_start, int n_draft, float *rows);

/* ---------------------------------------------------------------- check.c: the live check */

/* s (a first choice) computed its prompt, blended: queued for a check or a repair if due. */
void live_check_probe(engine *e, const eseq *s, const float *row);
/* The idle engine: the oldest entry's full prefill starts. */
void live_check_start(engine *e);
/* Ends the running entry's sequence quietly. */
void live_check_stop(engine *e);
/* A client request came while an entry runs: it gives way (and runs again later). */
void live_check_yield(engine *e);
/* The running entry's full prefill is done (row: its last token's logits). */
void live_check_done(engine *e, const float *row);

/* ---------------------------------------------------------------- reuse.c: reused KV */

/* Gives s (holding no KV) its longest cached prefix and plans its blend. */
/* Stores the prompt's content records (plan_store_content) when they are pending: after the
 * step that computed the prompt has published its first token, or as the sequence ends. */
void eseq_store_content(engine *e, eseq *s);
void eseq_reuse_prefix(engine *e, eseq *s);
/* True when s has reused spans at or after its next token. */
bool eseq_blending(const eseq *s);
/* How many pending tokens a blended prefill of s takes this step (*cost: their weight). */
int eseq_blend_take(const engine *e, const eseq *s, int budget, int *cost);
/* The blended entries of the step's batch (e->bents); returns how many. */
int engine_blend_entries(engine *e, int n_b);
/* True while s waits for its schema KV. */
bool eseq_schema_waiting(const eseq *s);
/* A Prompt Cache sequence starting: its modules' KV imported (or planned as blend spans). */
void eseq_schema_start(engine *e, eseq *s);
/* A Prompt Cache sequence's prompt is computed: records stored, counts published. */
void eseq_schema_done(engine *e, eseq *s);

/* ---------------------------------------------------------------- embed.c: embeddings */

/* The forward pass's after-layer hook (ud: the engine): embedding rows pooled at the last. */
int embed_pool_hidden(void *ud, forward_state *st, int layer);
/* The prompt is computed: the pooled vector normalized into the request; the choice ends. */
void embed_finish(engine *e, eseq *s);

/* ---------------------------------------------------------------- sched.c: the engine thread */

/* The engine thread's body (engine_create starts it; arg: the engine). */
void *engine_main(void *arg);

#endif
