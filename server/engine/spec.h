/* Speculation from the context (internal to the engine): draft tokens proposed from what the
 * sequence already holds (its prompt and its output so far) and from a request's predicted
 * output (OpenAI's Predicted Outputs), and the per-sequence controller that sets how many to
 * draft. The engine verifies a draft as extra rows of the sequence in its next batched step
 * (speculate.c); nothing here touches the model or the KV pool.
 *
 * The draft source is prompt lookup (Saxena 2023; llama.cpp's ngram speculation, vLLM's ngram
 * proposer): the longest earlier occurrence of the sequence's last tokens, found through hash
 * chains over SPEC_NGRAM-token windows as zlib's LZ77 matcher finds its matches (one head per
 * hash, one link per position, a bounded walk from the most recent), proposes the tokens that
 * followed it. */
#ifndef KVSERVE_SPEC_H
#define KVSERVE_SPEC_H

#include <stdbool.h>
#include <stdint.h>

/* Draft tokens verified in one step, at most. With its pending token, a sequence's verify rows
 * then fill two of the CPU matmul's 4-row tiles; a ninth row takes a third tile (a step's cost by
 * rows on a 2-core AMD EPYC, SmolLM2-135M: 4 rows 8.0 ms, 5 10.0, 7 11.9, 8 12.8, 9 14.8: the
 * ninth costs more than the token it may save). Draft lengths grow 1, 3, 7 (spec_ctl) for the
 * same reason: 2, 4 or 8 rows with the pending token (and on CUDA up to 4 rows take its
 * one-pass GEMV kernels). */
#define SPEC_MAX_DRAFT 7
/* Rows a step's matmul tiles take at once (the CPU's DOT_TILE_MAX_X): a step's decode and draft
 * rows together are made a multiple of it where the draft budget allows. */
#define SPEC_ROW_TILE 4
/* Decode stops being bound by reading the weights once this many sequences decode together:
 * each weight row read then serves that many rows already, and a draft row costs compute
 * (a full row through every layer) instead of riding along with the weights' read. From this
 * width on, no sequence drafts. */
#define SPEC_MAX_BATCH 8
/* Draft rows one step verifies at most, shared by its decoding sequences (spec_step_drafts:
 * one alone drafts up to SPEC_MAX_DRAFT, two up to 3 each, four up to 2): a draft row pays for
 * itself when the chance it is kept beats the share of the step's cost a row adds, and that
 * share grows with the rows already in the step (on a CPU a decode row costs about a fifth of a
 * one-row step). */
#define SPEC_STEP_DRAFTS 8
/* The draft rows a step of n_dec decoding sequences shares: up to SPEC_STEP_DRAFTS, cut so that
 * the step's rows (n_dec + drafts) fill whole SPEC_ROW_TILE tiles. */
static inline int spec_step_drafts(int n_dec) {
    int rows = (n_dec + SPEC_STEP_DRAFTS) / SPEC_ROW_TILE * SPEC_ROW_TILE;
    return rows > n_dec ? rows - n_dec : 0;
}
#define SPEC_NGRAM 2       /* tokens hashed per window: the shortest match looked up */
#define SPEC_MIN_CONTEXT 3 /* a match in the sequence's own tokens is this long at least */
#define SPEC_MAX_MATCH 64  /* a match is measured this far back at most */
#define SPEC_CHAIN 32      /* earlier occurrences compared per lookup, most recent first */
#define SPEC_HASH_BITS 12

/* The hash chains over one token stream, read through the caller's array (it may move between
 * calls: the index holds positions, never pointers). */
typedef struct spec_index {
    int32_t *head; /* [1 << SPEC_HASH_BITS] the latest window end with this hash, or -1 */
    int32_t *prev; /* [cap] the previous window end with the same hash, or -1 */
    int cap;
    int n; /* tokens indexed: window ends SPEC_NGRAM - 1 .. n - 1 */
} spec_index;

void spec_index_init(spec_index *ix);
void spec_index_free(spec_index *ix);
/* Indexes toks[ix->n .. n) (toks[0 .. ix->n) must be what was indexed before). -1 when out of
 * memory (the index then stays as it was). */
int spec_index_add(spec_index *ix, const int32_t *toks, int n);
/* The longest match (at least min_match tokens, at most SPEC_MAX_MATCH) of q's last tokens
 * q[nq - len .. nq) in toks[0 .. ix->n) that ends before `before` (a window end) and is followed
 * by at least one token; the tokens after it (up to max_draft, not past ix->n) go to out.
 * Returns how many, 0 when nothing matches; *match_len receives the match's length. */
int spec_index_draft(const spec_index *ix, const int32_t *toks, const int32_t *q, int nq,
                     int before, int min_match, int max_draft, int32_t *out, int *match_len);

/* How many tokens a sequence drafts: grows (1, 3, 7: twice plus one) after a step whose draft was
 * accepted in full, shrinks to what was accepted plus one after a rejection. A sequence whose
 * acceptance stays poor (rolling rate under SPEC_OFF_RATE) stops drafting for a while, twice as
 * long each time it fails again (from SPEC_OFF_STEPS up to SPEC_OFF_MAX), and then tries again. */
#define SPEC_OFF_RATE 0.3
#define SPEC_OFF_STEPS 16
#define SPEC_OFF_MAX 512
typedef struct spec_ctl {
    int k;         /* draft length now, 1..SPEC_MAX_DRAFT */
    int off;       /* decode steps left without drafting */
    int backoff;   /* the next switch-off's length */
    int verified;  /* verify steps since the last (re)start */
    double rate;   /* rolling acceptance per drafted token */
    bool disabled; /* the request said "speculative": false, or the server --spec off */
} spec_ctl;

void spec_ctl_init(spec_ctl *c, bool enabled);
/* The draft length for this step (0: none); counts a step down while switched off. */
int spec_ctl_len(spec_ctl *c);
/* A verify step drafted `drafted` tokens of which the first `accepted` were kept. */
void spec_ctl_update(spec_ctl *c, int drafted, int accepted);

/* A sequence's drafting: its own tokens' index and, when the request predicted its output, the
 * prediction's. */
typedef struct spec_seq {
    spec_ctl ctl;
    spec_index ctx;
    const int32_t *pred; /* [n_pred] the predicted output's tokens (the request's), or NULL */
    int n_pred;
    spec_index pred_ix;
    bool drafted_pred; /* the draft being verified came from the prediction */
    int match;         /* the last context draft's match length (0: the draft is not one) */
} spec_seq;

/* enabled false: the sequence never drafts. pred (NULL: none) must outlive ss. -1 when out of
 * memory (ss is then freed). */
int spec_seq_init(spec_seq *ss, bool enabled, const int32_t *pred, int n_pred);
void spec_seq_free(spec_seq *ss);

/* Proposes up to max_draft tokens to follow hist[0 .. n_hist) (the last n_gen of them
 * generated): from the prediction first (its start while the output so far is the prediction's
 * beginning, else the longest match of the output's last tokens in it), else from the sequence's
 * own tokens (no more than the match's length less one: a short match predicts little; the
 * match's length goes to ss->match). *from_pred says which. Returns how many (0: none, also when
 * out of memory). */
int spec_propose(spec_seq *ss, const int32_t *hist, int n_hist, int n_gen, int max_draft,
                 int32_t *out, bool *from_pred);

#endif
