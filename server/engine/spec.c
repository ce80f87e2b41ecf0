/* Speculation from the context: the draft index (hash chains over token windows) and the
 * per-sequence draft-length controller. See spec.h. */
#include "server/engine/spec.h"

#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- the index */

#define SPEC_HASH_SIZE (1 << SPEC_HASH_BITS)

/* The window of SPEC_NGRAM tokens ending at toks[p] (Fibonacci hashing of each id). */
static uint32_t window_hash(const int32_t *toks, int p) {
    uint32_t h = 0;
    for (int i = SPEC_NGRAM - 1; i >= 0; i--) h = (h ^ (uint32_t)toks[p - i]) * 0x9E3779B1u;
    return h >> (32 - SPEC_HASH_BITS);
}

void spec_index_init(spec_index *ix) { memset(ix, 0, sizeof *ix); }

void spec_index_free(spec_index *ix) {
    free(ix->head);
    free(ix->prev);
    spec_index_init(ix);
}

int spec_index_add(spec_index *ix, const int32_t *toks, int n) {
    if (n <= ix->n) return 0;
    if (!ix->head) {
        if (!(ix->head = malloc(sizeof *ix->head * SPEC_HASH_SIZE))) return -1;
        for (int i = 0; i < SPEC_HASH_SIZE; i++) ix->head[i] = -1;
    }
    if (n > ix->cap) {
        int cap = ix->cap ? ix->cap : 64;
        while (cap < n) cap *= 2;
        int32_t *p = realloc(ix->prev, sizeof *p * (size_t)cap);
        if (!p) return -1;
        ix->prev = p;
        ix->cap = cap;
    }
    for (int p = ix->n; p < n; p++) {
        if (p < SPEC_NGRAM - 1) {
            ix->prev[p] = -1;
            continue;
        }
        uint32_t h = window_hash(toks, p);
        ix->prev[p] = ix->head[h];
        ix->head[h] = p;
    }
    ix->n = n;
    return 0;
}

int spec_index_draft(const spec_index *ix, const int32_t *toks, const int32_t *q, int nq,
                     int before, int min_match, int max_draft, int32_t *out, int *match_len) {
    *match_len = 0;
    if (!ix->head || nq < SPEC_NGRAM || max_draft < 1 || min_match < SPEC_NGRAM) return 0;
    int best = -1, best_len = 0;
    int walked = 0;
    for (int p = ix->head[window_hash(q, nq - 1)]; p >= 0 && walked < SPEC_CHAIN; p = ix->prev[p]) {
        /* positions past `before` or with nothing after them are skipped, not counted */
        if (p >= before || p + 1 >= ix->n) continue;
        walked++;
        int len = 0;
        while (len < SPEC_MAX_MATCH && len <= p && len < nq && toks[p - len] == q[nq - 1 - len])
            len++;
        /* the most recent of equally long matches: the chain runs newest first */
        if (len > best_len) {
            best_len = len;
            best = p;
        }
    }
    if (best < 0 || best_len < min_match) return 0;
    int n = ix->n - (best + 1);
    if (n > max_draft) n = max_draft;
    memcpy(out, toks + best + 1, sizeof *out * (size_t)n);
    *match_len = best_len;
    return n;
}

/* ---------------------------------------------------------------- the controller */

void spec_ctl_init(spec_ctl *c, bool enabled) {
    memset(c, 0, sizeof *c);
    c->k = 3;
    c->backoff = SPEC_OFF_STEPS;
    c->disabled = !enabled;
}

int spec_ctl_len(spec_ctl *c) {
    if (c->disabled) return 0;
    if (c->off > 0) {
        c->off--;
        return 0;
    }
    return c->k;
}

void spec_ctl_update(spec_ctl *c, int drafted, int accepted) {
    if (drafted <= 0) return;
    double r = (double)accepted / drafted;
    c->rate = c->verified == 0 ? r : 0.8 * c->rate + 0.2 * r;
    c->verified++;
    if (accepted == drafted)
        c->k = c->k * 2 + 1 < SPEC_MAX_DRAFT ? c->k * 2 + 1 : SPEC_MAX_DRAFT;
    else
        c->k = accepted + 1 < c->k ? accepted + 1 : c->k;
    if (c->verified < 8) return;
    if (c->rate < SPEC_OFF_RATE) {
        /* not paying for its rows here: off for a while, longer each time it fails again */
        c->off = c->backoff;
        c->backoff = c->backoff * 2 < SPEC_OFF_MAX ? c->backoff * 2 : SPEC_OFF_MAX;
        c->verified = 0;
        c->k = 3;
    } else if (c->rate >= 0.5) {
        c->backoff = SPEC_OFF_STEPS;
    }
}

/* ---------------------------------------------------------------- proposals */

int spec_seq_init(spec_seq *ss, bool enabled, const int32_t *pred, int n_pred) {
    memset(ss, 0, sizeof *ss);
    spec_ctl_init(&ss->ctl, enabled);
    spec_index_init(&ss->ctx);
    spec_index_init(&ss->pred_ix);
    if (!enabled || !pred || n_pred <= 0) return 0;
    ss->pred = pred;
    ss->n_pred = n_pred;
    if (spec_index_add(&ss->pred_ix, pred, n_pred)) {
        spec_seq_free(ss);
        return -1;
    }
    return 0;
}

void spec_seq_free(spec_seq *ss) {
    spec_index_free(&ss->ctx);
    spec_index_free(&ss->pred_ix);
}

int spec_propose(spec_seq *ss, const int32_t *hist, int n_hist, int n_gen, int max_draft,
                 int32_t *out, bool *from_pred) {
    *from_pred = false;
    ss->match = 0;
    if (max_draft > SPEC_MAX_DRAFT) max_draft = SPEC_MAX_DRAFT;
    if (max_draft < 1 || n_gen < 0 || n_gen > n_hist) return 0;
    int len = 0, n = 0;
    if (ss->pred && ss->n_pred > 0) {
        /* the output so far is the prediction's beginning: its next tokens */
        if (n_gen < ss->n_pred &&
            memcmp(hist + n_hist - n_gen, ss->pred, sizeof *hist * (size_t)n_gen) == 0) {
            n = ss->n_pred - n_gen < max_draft ? ss->n_pred - n_gen : max_draft;
            memcpy(out, ss->pred + n_gen, sizeof *out * (size_t)n);
        } else {
            n = spec_index_draft(&ss->pred_ix, ss->pred, hist, n_hist, ss->n_pred, SPEC_NGRAM,
                                 max_draft, out, &len);
        }
        if (n > 0) {
            *from_pred = true;
            return n;
        }
    }
    if (spec_index_add(&ss->ctx, hist, n_hist)) return 0;
    /* the last window is the query itself: only matches that end before it */
    n = spec_index_draft(&ss->ctx, hist, hist, n_hist, n_hist - 1, SPEC_MIN_CONTEXT, max_draft, out,
                         &len);
    /* a short match predicts little: its draft is as long as the match less one */
    ss->match = n > 0 ? len : 0;
    return n <= 0 ? 0 : n < len - 1 ? n : len - 1;
}
