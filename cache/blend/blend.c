/* The fusor (cache/blend/blend.h): CacheBlend's selective KV recompute as forward-pass hooks.
 *
 * Per blended batch entry, every token is computed at layer 0 (ratio 0 aside); the reused
 * tokens' KV of each layer is written into the pool just before the layer runs, so the tokens a
 * layer does not compute attend with, and are attended through, the reused KV. Once a layer has
 * written the fresh K and V of the reused tokens it computes, they are ranked by how far those
 * moved from the reused ones (HKVD) and only the most deviating go on through the layer's
 * attention and feed-forward to the next layer: the others keep their fresh KV of this layer,
 * and their hidden state would feed nothing. Tokens that were not cached are always
 * computed; so is every row of an entry that does not blend. */
#include "cache/blend/blend.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/quant.h"

/* Layers the loader may run ahead of the computing one: reads from disk come in bursts. */
#define BLEND_AHEAD 3

struct blend_fusor {
    const model *m;
    backend *b;
    kv_pool *pool;
    int max_tokens;
    int kvd;
    /* [BLEND_AHEAD + 1][max_tokens][kvd] reused K (rotated to its slot) and V of layer l in
     * buffer l % (BLEND_AHEAD + 1): the loader fills the next layers' while this layer's are
     * ranked against */
    float *rk[BLEND_AHEAD + 1], *rv[BLEND_AHEAD + 1];
    float *fk, *fv;   /* [max_tokens][kvd] the fresh rows read back */
    int32_t *slots;   /* [max_tokens] slot of each reused token */
    int32_t *delta;   /* [max_tokens] position shift of each reused token */
    float *dcs;       /* [max_tokens][n_rot] its RoPE angles, computed once per pass */
    int32_t *cand;    /* [max_tokens] reused index of a current row, per candidate */
    int32_t *c_slots; /* [max_tokens] their slots */
    float *dev;       /* [max_tokens] */
    int *order;       /* [max_tokens] */
    int *keep;        /* [max_tokens] rows kept */
    int32_t *ridx;    /* [max_tokens] per flattened token: its reused index, or -1 */
    int32_t *tok_ent; /* [max_tokens] per flattened token: its blend entry, or -1 */
    uint8_t *forced;  /* [max_tokens] per reused index: recomputed at every layer */
    int *first;       /* [n_ents] reused index of each entry's first reused token */
    int *n_forced;    /* [n_ents] its forced tokens */
    int cap_ents;
    /* the pass */
    const batch_seq *seqs;
    blend_entry *ents;
    int n_ents;
    int n_reused;
    double load_ns; /* per token and layer, moving average */
    /* The loader thread (CacheBlend section 5.2, pipelining): while layer l computes, it writes
     * the reused KV of layers l + 1 .. l + BLEND_AHEAD into the pool (a layer's compute touches
     * only that layer's regions), reading it from disk first where a record is there. */
    pthread_t loader;
    bool loader_started;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool active;   /* a pass is under way: the loader may run ahead of `computing` */
    int computing; /* layer the pass is at */
    int loaded;    /* last layer written this pass, -1: none */
    bool busy;     /* the loader is writing a layer */
    bool quit;
};

double blend_fusor_load_ns(const blend_fusor *f) { return f->load_ns; }

blend_fusor *blend_fusor_create(const model *m, backend *b, kv_pool *pool, int max_tokens,
                                kv_error *err) {
    blend_fusor *f = calloc(1, sizeof *f);
    if (!f) goto oom;
    f->m = m;
    f->b = b;
    f->pool = pool;
    f->max_tokens = max_tokens;
    f->kvd = m->hp.n_kv_head * m->hp.head_dim;
    size_t nt = (size_t)max_tokens, rows = nt * (size_t)f->kvd;
    bool bufs = true;
    for (int i = 0; i <= BLEND_AHEAD; i++) {
        f->rk[i] = kv_aligned_alloc(sizeof(float) * rows);
        f->rv[i] = kv_aligned_alloc(sizeof(float) * rows);
        bufs = bufs && f->rk[i] && f->rv[i];
    }
    f->fk = kv_aligned_alloc(sizeof(float) * rows);
    f->fv = kv_aligned_alloc(sizeof(float) * rows);
    f->slots = malloc(sizeof(int32_t) * nt);
    f->delta = malloc(sizeof(int32_t) * nt);
    f->dcs = malloc(sizeof(float) * nt * (size_t)m->hp.n_rot);
    f->cand = malloc(sizeof(int32_t) * nt);
    f->c_slots = malloc(sizeof(int32_t) * nt);
    f->dev = malloc(sizeof(float) * nt);
    f->order = malloc(sizeof(int) * nt);
    f->keep = malloc(sizeof(int) * nt);
    f->ridx = malloc(sizeof(int32_t) * nt);
    f->tok_ent = malloc(sizeof(int32_t) * nt);
    f->forced = malloc(nt);
    if (!bufs || !f->fk || !f->fv || !f->slots || !f->delta || !f->dcs || !f->cand || !f->c_slots ||
        !f->dev || !f->order || !f->keep || !f->ridx || !f->tok_ent || !f->forced)
        goto oom;
    return f;
oom:
    blend_fusor_destroy(f);
    kv_fail(err, "out of memory for the blend fusor (%d tokens)", max_tokens);
    return NULL;
}

void blend_fusor_destroy(blend_fusor *f) {
    if (!f) return;
    if (f->loader_started) {
        pthread_mutex_lock(&f->mu);
        f->quit = true;
        pthread_cond_broadcast(&f->cv);
        pthread_mutex_unlock(&f->mu);
        pthread_join(f->loader, NULL);
        pthread_mutex_destroy(&f->mu);
        pthread_cond_destroy(&f->cv);
    }
    for (int i = 0; i <= BLEND_AHEAD; i++) {
        kv_aligned_free(f->rk[i]);
        kv_aligned_free(f->rv[i]);
    }
    kv_aligned_free(f->fk);
    kv_aligned_free(f->fv);
    free(f->slots);
    free(f->delta);
    free(f->dcs);
    free(f->cand);
    free(f->c_slots);
    free(f->dev);
    free(f->order);
    free(f->keep);
    free(f->ridx);
    free(f->tok_ent);
    free(f->forced);
    free(f->first);
    free(f->n_forced);
    free(f);
}

/* Writes layer il of every span into the pool: f16 rows to f32 (kept in buffer il % 2 for the
 * ranking), K turned by its delta. Runs on the loader thread, so it uses no backend thread. */
static void load_layer(blend_fusor *f, int il) {
    uint64_t t0 = clock_now_ns();
    const kv_layout *kl = kv_pool_layout(f->pool);
    const model_hparams *hp = &f->m->hp;
    void *pool = kv_pool_memory(f->pool);
    int kvd = f->kvd;
    float *rk = f->rk[il % (BLEND_AHEAD + 1)], *rv = f->rv[il % (BLEND_AHEAD + 1)];
    for (int e = 0; e < f->n_ents; e++) {
        blend_entry *be = &f->ents[e];
        int k = f->first[e];
        bool skipped = false;
        for (int s = 0; s < be->n_spans; s++) {
            const blend_span *sp = &be->spans[s];
            if (content_rec_read_layer(sp->rec, il) != 0) {
                /* Not in the pool: the pass goes on (the other entries are right), the caller
                 * runs this entry's tokens again without the span. */
                be->failed = true;
                skipped = true;
                k += sp->n;
                continue;
            }
            const uint16_t *K = content_rec_rows(sp->rec, il, 0) + (size_t)sp->off * kvd;
            const uint16_t *V = content_rec_rows(sp->rec, il, 1) + (size_t)sp->off * kvd;
            fp16_to_fp32_row(K, rk + (size_t)k * kvd, (int64_t)sp->n * kvd);
            fp16_to_fp32_row(V, rv + (size_t)k * kvd, (int64_t)sp->n * kvd);
            for (int i = k; i < k + sp->n; i++)
                rope_rotate(rk + (size_t)i * kvd, hp->n_kv_head, hp->head_dim, hp->n_rot,
                            f->dcs + (size_t)i * hp->n_rot, false);
            k += sp->n;
        }
        k = f->first[e];
        if (!skipped)
            backend_kv_store_serial(f->b, pool, kl, il, f->seqs[be->entry].seq->blocks,
                                    f->slots + k, be->n_reused, rk + (size_t)k * kvd,
                                    rv + (size_t)k * kvd);
    }
    if (f->n_reused > 0) {
        double ns = (double)(clock_now_ns() - t0) / f->n_reused;
        f->load_ns = f->load_ns > 0 ? 0.9 * f->load_ns + 0.1 * ns : ns;
    }
}

/* The next layer the loader may write, or -1 (under mu). */
static int loader_next(const blend_fusor *f) {
    int next = f->loaded + 1;
    return f->active && next < f->m->hp.n_layer && next <= f->computing + BLEND_AHEAD ? next : -1;
}

static void *loader_main(void *arg) {
    blend_fusor *f = arg;
    pthread_mutex_lock(&f->mu);
    for (;;) {
        int il;
        while ((il = loader_next(f)) < 0 && !f->quit) pthread_cond_wait(&f->cv, &f->mu);
        if (f->quit) break;
        f->busy = true;
        pthread_mutex_unlock(&f->mu);
        load_layer(f, il);
        pthread_mutex_lock(&f->mu);
        f->busy = false;
        f->loaded = il;
        pthread_cond_broadcast(&f->cv);
    }
    pthread_mutex_unlock(&f->mu);
    return NULL;
}

/* The pass is at layer il: waits until its reused KV is in the pool, and lets the loader run
 * on to il + BLEND_AHEAD. */
static void loader_reach(blend_fusor *f, int il) {
    pthread_mutex_lock(&f->mu);
    f->active = true;
    f->computing = il;
    pthread_cond_broadcast(&f->cv);
    while (f->loaded < il) pthread_cond_wait(&f->cv, &f->mu);
    pthread_mutex_unlock(&f->mu);
}

void blend_fusor_end(blend_fusor *f) {
    if (!f || !f->loader_started) return;
    pthread_mutex_lock(&f->mu);
    f->active = false; /* no further layer: the pass is over */
    while (f->busy) pthread_cond_wait(&f->cv, &f->mu);
    pthread_mutex_unlock(&f->mu);
}

static int cmp_dev_desc(const void *a, const void *b, void *ud) {
    const float *dev = ud;
    int i = *(const int *)a, j = *(const int *)b;
    if (dev[i] != dev[j]) return dev[i] > dev[j] ? -1 : 1;
    return (i > j) - (i < j);
}

/* Keeps, per entry, the rows that are not reused and the `want` reused rows that deviate most by
 * the fresh KV of layer il, for the rest of the layer and the next (at the last layer, when
 * computing is false, only counts them: the forward pass keeps the rows that give logits). */
static int narrow(blend_fusor *f, forward_state *st, int il, bool computing) {
    const kv_layout *kl = kv_pool_layout(f->pool);
    const void *pool = kv_pool_memory(f->pool);
    int n_rows = forward_state_n_rows(st);
    const int32_t *rows = forward_state_rows(st);
    int kvd = f->kvd;
    /* keep[r] = 1 for rows that stay; reused rows start dropped, but for the forced ones */
    for (int r = 0; r < n_rows; r++) {
        int k = f->ridx[rows[r]];
        f->keep[r] = k < 0 || f->forced[k];
    }
    for (int e = 0; e < f->n_ents; e++) {
        blend_entry *be = &f->ents[e];
        int n_c = 0, n_f = 0;
        int lo = -1;
        /* candidates: the entry's reused rows still computed that are not forced */
        for (int r = 0; r < n_rows; r++) {
            int k = f->ridx[rows[r]];
            if (f->tok_ent[rows[r]] != e || k < 0) continue;
            if (f->forced[k]) {
                n_f++;
                continue;
            }
            if (lo < 0) lo = r;
            f->cand[n_c] = k;
            f->c_slots[n_c++] = f->slots[k];
        }
        if (!computing) be->n_recomputed = n_c + n_f; /* the last layer: nothing narrows */
        if (n_c == 0 || !computing) continue;
        /* the forced tokens spend their share of the layer's budget first */
        int want = blend_rows_at_layer(be->ratio, be->n_reused, il + 1) - f->n_forced[e];
        /* order[c] becomes 1 for the candidates kept */
        if (want >= n_c || want <= 0) {
            for (int c = 0; c < n_c; c++) f->order[c] = want > 0;
        } else {
            const int32_t *bt = f->seqs[be->entry].seq->blocks;
            backend_kv_load(f->b, pool, kl, il, 0, bt, f->c_slots, n_c, f->fk);
            backend_kv_load(f->b, pool, kl, il, 1, bt, f->c_slots, n_c, f->fv);
            for (int c = 0; c < n_c; c++) {
                const float *rk = f->rk[il % (BLEND_AHEAD + 1)] + (size_t)f->cand[c] * kvd,
                            *rv = f->rv[il % (BLEND_AHEAD + 1)] + (size_t)f->cand[c] * kvd;
                const float *fk = f->fk + (size_t)c * kvd, *fv = f->fv + (size_t)c * kvd;
                double d = 0;
                for (int j = 0; j < kvd; j++) {
                    double dk = (double)fk[j] - rk[j], dv = (double)fv[j] - rv[j];
                    d += dk * dk + dv * dv;
                }
                f->dev[c] = isfinite(d) ? (float)d : INFINITY;
                f->order[c] = c;
            }
            qsort_r(f->order, (size_t)n_c, sizeof *f->order, cmp_dev_desc, f->dev);
            for (int c = 0; c < want; c++) f->dev[f->order[c]] = -1; /* selected */
            for (int c = 0; c < n_c; c++) f->order[c] = f->dev[c] == -1;
        }
        /* the candidates are the entry's reused rows not forced in row order, from lo */
        for (int r = lo, c = 0; r < n_rows && c < n_c; r++)
            if (f->tok_ent[rows[r]] == e && f->ridx[rows[r]] >= 0 && !f->forced[f->ridx[rows[r]]])
                f->keep[r] = f->order[c++];
    }
    if (!computing) return 0;
    int n_keep = 0;
    for (int r = 0; r < n_rows; r++)
        if (f->keep[r]) f->keep[n_keep++] = r;
    return n_keep == n_rows ? 0 : forward_state_keep_rows(st, f->keep, n_keep);
}

/* True when entry e's reused tokens that are not forced are reused as they are from layer 0 on:
 * full reuse (ratio 0), or a policy that ranks none of them (LegoLink). */
static bool reused_from_layer0(const blend_entry *be) { return be->ratio <= 0 || be->only_forced; }

static int before_layer(void *ud, forward_state *st, int il) {
    blend_fusor *f = ud;
    loader_reach(f, il);
    bool any = false;
    for (int e = 0; e < f->n_ents; e++) any |= reused_from_layer0(&f->ents[e]);
    if (il == 0 && any) {
        int n_rows = forward_state_n_rows(st);
        const int32_t *rows = forward_state_rows(st);
        int n_keep = 0;
        for (int r = 0; r < n_rows; r++) {
            int e = f->tok_ent[rows[r]], k = f->ridx[rows[r]];
            if (e < 0 || k < 0 || f->forced[k] || !reused_from_layer0(&f->ents[e]))
                f->keep[n_keep++] = r;
        }
        if (n_keep < n_rows) return forward_state_keep_rows(st, f->keep, n_keep);
    }
    return 0;
}

static int after_kv(void *ud, forward_state *st, int il) {
    return narrow(ud, st, il, il + 1 < ((blend_fusor *)ud)->m->hp.n_layer);
}

int blend_fusor_begin(blend_fusor *f, const batch_seq *seqs, int n_seqs, blend_entry *entries,
                      int n_entries, forward_hooks *hooks, kv_error *err) {
    int n_tok = 0;
    for (int s = 0; s < n_seqs; s++) n_tok += seqs[s].n_tok;
    if (n_tok > f->max_tokens)
        return kv_fail(err, "a blended batch of %d tokens exceeds the fusor's %d", n_tok,
                       f->max_tokens);
    if (n_entries > f->cap_ents) {
        int *first = realloc(f->first, sizeof *first * (size_t)n_entries);
        if (first) f->first = first;
        int *n_forced = realloc(f->n_forced, sizeof *n_forced * (size_t)n_entries);
        if (n_forced) f->n_forced = n_forced;
        if (!first || !n_forced) return kv_fail(err, "out of memory");
        f->cap_ents = n_entries;
    }
    for (int t = 0; t < n_tok; t++) f->ridx[t] = f->tok_ent[t] = -1;
    int k = 0;
    for (int e = 0; e < n_entries; e++) {
        blend_entry *be = &entries[e];
        if (be->entry < 0 || be->entry >= n_seqs)
            return kv_fail(err, "blend entry %d names batch entry %d", e, be->entry);
        const batch_seq *bs = &seqs[be->entry];
        int t0 = 0;
        for (int s = 0; s < be->entry; s++) t0 += seqs[s].n_tok;
        for (int i = 0; i < bs->n_tok; i++) f->tok_ent[t0 + i] = e;
        f->first[e] = k;
        f->n_forced[e] = 0;
        be->n_reused = be->n_recomputed = 0;
        be->failed = false;
        int prev_end = bs->kv_start;
        for (int s = 0; s < be->n_spans; s++) {
            const blend_span *sp = &be->spans[s];
            const content_rec *r = sp->rec;
            if (sp->n < 1 || sp->slot < prev_end || sp->slot + sp->n > bs->kv_start + bs->n_tok ||
                sp->off < 0 || sp->off + sp->n > r->n_tok || sp->forced < 0 || sp->forced > sp->n ||
                r->n_layer != f->m->hp.n_layer || r->kv_dim != f->kvd)
                return kv_fail(err, "blend span %d of entry %d does not fit its batch entry", s, e);
            prev_end = sp->slot + sp->n;
            for (int i = 0; i < sp->n; i++, k++) {
                int t = t0 + sp->slot - bs->kv_start + i;
                f->ridx[t] = k;
                f->slots[k] = sp->slot + i;
                f->forced[k] = i < sp->forced;
                /* K moves from where the record computed it to the token's position (Prompt
                 * Cache's fix-up reuses KV at the position it was computed at: delta 0) */
                f->delta[k] = bs->pos[sp->slot - bs->kv_start + i] - (r->pos0 + sp->off + i);
            }
            be->n_reused += sp->n;
            f->n_forced[e] += sp->forced;
        }
        /* the last token's logits are always computed */
        int t_last = t0 + bs->n_tok - 1;
        if (f->ridx[t_last] >= 0)
            return kv_fail(err, "entry %d: its last token cannot be reused", e);
    }
    f->seqs = seqs;
    f->ents = entries;
    f->n_ents = n_entries;
    f->n_reused = k;
    /* the angles are the loader's (host) input: the backend's op where its memory is the host's,
     * kernels/rope.c's loop otherwise (the same numbers) */
    if (backend_host_memory(f->b))
        backend_rope_angles(f->b, &f->m->rope, f->delta, k, f->dcs);
    else
        for (int i = 0; i < k; i++)
            rope_angles(&f->m->rope, f->delta[i], f->dcs + (size_t)i * f->m->rope.n_rot);
    if (!f->loader_started) {
        if (pthread_mutex_init(&f->mu, NULL)) return kv_fail(err, "blend loader: mutex");
        if (pthread_cond_init(&f->cv, NULL)) {
            pthread_mutex_destroy(&f->mu);
            return kv_fail(err, "blend loader: condition variable");
        }
        if (pthread_create(&f->loader, NULL, loader_main, f)) {
            pthread_cond_destroy(&f->cv);
            pthread_mutex_destroy(&f->mu);
            return kv_fail(err, "blend loader: cannot start its thread");
        }
        f->loader_started = true;
    }
    pthread_mutex_lock(&f->mu);
    f->active = false;
    f->computing = 0;
    f->loaded = -1;
    pthread_mutex_unlock(&f->mu);
    *hooks = (forward_hooks){.ud = f, .before_layer = before_layer, .after_kv = after_kv};
    return 0;
}
