/* CPU attention over the paged KV pool, and the pool's f16 <-> f32 copies.
 *
 * Work items are (sequence, kv head, block of query rows, range of key slots). Prefill-sized
 * sequences split by query rows; decode-sized ones (a few rows over a long history) split their
 * keys into ranges whose partial softmax states (max, sum, weighted V) are merged afterwards,
 * as in flash-decoding, so both threads work on a single sequence's step. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu.h"

#define ATTN_ROWS 16        /* query rows per work item (prefill) */
#define ATTN_MIN_SPLIT 256  /* fewest keys worth a separate work item (decode) */

size_t kv_layout_block_bytes(const kv_layout *l) {
    return (size_t)l->n_layer * 2 * l->n_kv_head * l->block_tokens * l->head_dim * 2;
}

size_t kv_layout_offset(const kv_layout *l, int layer, int kv, int head) {
    return ((((size_t)layer * 2 + kv) * l->n_kv_head + head) * l->block_tokens) * l->head_dim * 2;
}

void *backend_kv_alloc(backend *b, const kv_layout *l) {
    (void)b;
    size_t bytes;
    if (size_mul(kv_layout_block_bytes(l), (size_t)l->n_blocks, &bytes)) return NULL;
    void *p = kv_aligned_alloc(bytes);
    if (p) memset(p, 0, bytes);
    return p;
}

void backend_kv_free(backend *b, void *pool) {
    (void)b;
    kv_aligned_free(pool);
}

/* The f16 row of (layer, kv, head) at a sequence's slot. */
static inline uint16_t *kv_row(const void *pool, const kv_layout *l, int layer, int kv, int head,
                               const int32_t *block_table, int32_t slot) {
    int32_t blk = block_table[slot / l->block_tokens];
    int off = slot % l->block_tokens;
    return (uint16_t *)((uint8_t *)pool + (size_t)blk * kv_layout_block_bytes(l) +
                        kv_layout_offset(l, layer, kv, head)) +
           (size_t)off * l->head_dim;
}

void backend_kv_store(backend *b, void *pool, const kv_layout *l, int layer,
                      const int32_t *block_table, const int32_t *slots, int n_tok, const float *k,
                      const float *v) {
    (void)b;
    int hd = l->head_dim;
    for (int t = 0; t < n_tok; t++)
        for (int h = 0; h < l->n_kv_head; h++) {
            size_t src = ((size_t)t * l->n_kv_head + h) * hd;
            fp32_to_fp16_row(k + src, kv_row(pool, l, layer, 0, h, block_table, slots[t]), hd);
            fp32_to_fp16_row(v + src, kv_row(pool, l, layer, 1, h, block_table, slots[t]), hd);
        }
}

void backend_kv_load(backend *b, const void *pool, const kv_layout *l, int layer, int kv,
                     const int32_t *block_table, const int32_t *slots, int n_tok, float *out) {
    (void)b;
    int hd = l->head_dim;
    for (int t = 0; t < n_tok; t++)
        for (int h = 0; h < l->n_kv_head; h++)
            fp16_to_fp32_row(kv_row(pool, l, layer, kv, h, block_table, slots[t]),
                             out + ((size_t)t * l->n_kv_head + h) * hd, hd);
}

void backend_kv_copy_block(backend *b, void *pool, const kv_layout *l, int32_t dst, int32_t src) {
    (void)b;
    size_t bb = kv_layout_block_bytes(l);
    memcpy((uint8_t *)pool + (size_t)dst * bb, (const uint8_t *)pool + (size_t)src * bb, bb);
}

/* ---------------------------------------------------------------- the kernel */

typedef struct attn_item {
    int seq;
    int kv_head;
    int r0, r1;    /* query rows */
    int k0, k1;    /* key slots */
    int split;     /* index of the key range, or -1 when the item covers all keys */
} attn_item;

typedef struct attn_job {
    const void *pool;
    const kv_layout *l;
    int layer;
    int n_head;
    float scale;
    const attn_seq *seqs;
    attn_item *items;
    int n_items;
    _Atomic int next;
    float **scratch;
    /* decode splits: per (seq, row, head, split): max, sum, then head_dim weighted V */
    float **partial;
    int *n_splits;
} attn_job;

/* One work item: for every (row, head) of the group, scores over keys [k0, min(k1, slot + 1)),
 * softmax, weighted sum of V. hd is a multiple of 16 (checked at model load). */
CPU_INLINE void attn_item_run_body(const attn_job *j, const attn_item *it, float *sc) {
    const kv_layout *l = j->l;
    const attn_seq *s = &j->seqs[it->seq];
    const int hd = l->head_dim, gs = j->n_head / l->n_kv_head, nv = hd / 16;
    const int nk = it->k1 - it->k0, nq = (it->r1 - it->r0) * gs;
    /* scores: [nq][nk] */
    for (int k = it->k0; k < it->k1; k++) {
        const uint16_t *kr = kv_row(j->pool, l, j->layer, 0, it->kv_head, s->block_table, k);
        v16f kv[8];
        for (int c = 0; c < nv; c++) kv[c] = v16f_load_h(kr + 16 * c);
        for (int r = it->r0; r < it->r1; r++) {
            for (int g = 0; g < gs; g++) {
                float *dst = sc + ((size_t)(r - it->r0) * gs + g) * nk + (k - it->k0);
                if (k > s->q_slot[r]) {
                    *dst = -INFINITY;
                    continue;
                }
                const float *q = s->q + ((size_t)r * j->n_head + it->kv_head * gs + g) * hd;
                v16f acc = v16f_load(q) * kv[0];
                for (int c = 1; c < nv; c++) acc += v16f_load(q + 16 * c) * kv[c];
                *dst = v16f_sum(acc) * j->scale;
            }
        }
    }
    /* softmax per query (unnormalised when this is one split of several) */
    float mx[ATTN_ROWS * 8], sum[ATTN_ROWS * 8];
    for (int q = 0; q < nq; q++) {
        float *row = sc + (size_t)q * nk;
        float m = -INFINITY;
        for (int k = 0; k < nk; k++) m = row[k] > m ? row[k] : m;
        double ssum = 0;
        if (m > -INFINITY) {
            int k = 0;
            for (; k + 16 <= nk; k += 16) {
                v16f e = v16f_exp(v16f_load(row + k) - v16f_splat(m));
                /* exp(-inf - m) must be exactly 0: masked keys */
                e = v16f_select(v16f_load(row + k) == v16f_splat(-INFINITY), v16f_splat(0.0f), e);
                v16f_store(row + k, e);
                ssum += v16f_sum(e);
            }
            for (; k < nk; k++) {
                row[k] = row[k] == -INFINITY ? 0.0f : expf(row[k] - m);
                ssum += row[k];
            }
        }
        mx[q] = m;
        sum[q] = (float)ssum;
    }
    /* weighted V: out[q] = sum_k p[q][k] v[k] */
    v16f acc[ATTN_ROWS * 8][8];
    for (int q = 0; q < nq; q++)
        for (int c = 0; c < nv; c++) acc[q][c] = v16f_splat(0.0f);
    for (int k = it->k0; k < it->k1; k++) {
        const uint16_t *vr = kv_row(j->pool, l, j->layer, 1, it->kv_head, s->block_table, k);
        v16f vv[8];
        for (int c = 0; c < nv; c++) vv[c] = v16f_load_h(vr + 16 * c);
        for (int q = 0; q < nq; q++) {
            float p = sc[(size_t)q * nk + (k - it->k0)];
            if (p == 0.0f) continue;
            v16f pv = v16f_splat(p);
            for (int c = 0; c < nv; c++) acc[q][c] += pv * vv[c];
        }
    }
    for (int q = 0; q < nq; q++) {
        int r = it->r0 + q / gs, h = it->kv_head * gs + q % gs;
        if (it->split < 0) {
            float *o = s->out + ((size_t)r * j->n_head + h) * hd;
            v16f inv = v16f_splat(sum[q] > 0 ? 1.0f / sum[q] : 0.0f);
            for (int c = 0; c < nv; c++) v16f_store(o + 16 * c, acc[q][c] * inv);
        } else {
            int ns = j->n_splits[it->seq];
            float *p = j->partial[it->seq] + (((size_t)r * j->n_head + h) * ns + it->split) * (hd + 2);
            p[0] = mx[q];
            p[1] = sum[q];
            for (int c = 0; c < nv; c++) v16f_store(p + 2 + 16 * c, acc[q][c]);
        }
    }
}
CPU_MULTIVERSION(void, attn_item_run, (const attn_job *j, const attn_item *it, float *sc),
                 (j, it, sc))

static void attn_task(void *ctx, int ith, int nth) {
    (void)nth;
    attn_job *j = ctx;
    for (;;) {
        int i = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        if (i >= j->n_items) return;
        attn_item_run(j, &j->items[i], j->scratch[ith]);
    }
}

/* Merges the split partial states of a decode-sized sequence into its output rows. */
static void attn_merge(const attn_job *j, int si) {
    const attn_seq *s = &j->seqs[si];
    int hd = j->l->head_dim, ns = j->n_splits[si];
    for (int r = 0; r < s->n_q; r++)
        for (int h = 0; h < j->n_head; h++) {
            const float *p = j->partial[si] + ((size_t)r * j->n_head + h) * ns * (hd + 2);
            float m = -INFINITY;
            for (int k = 0; k < ns; k++) m = p[k * (hd + 2)] > m ? p[k * (hd + 2)] : m;
            float *o = s->out + ((size_t)r * j->n_head + h) * hd;
            memset(o, 0, sizeof(float) * hd);
            double total = 0;
            for (int k = 0; k < ns; k++) {
                const float *pk = p + k * (hd + 2);
                if (pk[0] == -INFINITY) continue;
                float w = expf(pk[0] - m);
                total += (double)w * pk[1];
                for (int d = 0; d < hd; d++) o[d] += w * pk[2 + d];
            }
            float inv = total > 0 ? (float)(1.0 / total) : 0.0f;
            for (int d = 0; d < hd; d++) o[d] *= inv;
        }
}

void backend_attention(backend *b, const void *pool, const kv_layout *l, int layer, int n_head,
                       float scale, const attn_seq *seqs, int n_seqs) {
    attn_job j = {.pool = pool, .l = l, .layer = layer, .n_head = n_head, .scale = scale,
                  .seqs = seqs};
    int gs = n_head / l->n_kv_head;
    int max_items = 0;
    for (int s = 0; s < n_seqs; s++) {
        int rb = (seqs[s].n_q + ATTN_ROWS - 1) / ATTN_ROWS;
        int sp = seqs[s].n_kv / ATTN_MIN_SPLIT + 1;
        max_items += l->n_kv_head * (rb > sp ? rb : sp);
    }
    j.items = malloc(sizeof *j.items * (size_t)(max_items ? max_items : 1));
    j.partial = calloc((size_t)n_seqs, sizeof *j.partial);
    j.n_splits = calloc((size_t)n_seqs, sizeof *j.n_splits);
    if (!j.items || !j.partial || !j.n_splits) goto oom;

    size_t scratch_need = 0;
    for (int s = 0; s < n_seqs; s++) {
        const attn_seq *sq = &seqs[s];
        if (sq->n_q == 0) continue;
        /* decode-sized: one row block, keys split so every thread has work */
        int ns = 1;
        if (sq->n_q <= 4) {
            int want = (2 * b->n_threads + l->n_kv_head - 1) / l->n_kv_head;
            int can = sq->n_kv / ATTN_MIN_SPLIT;
            ns = want < can ? want : can;
            if (ns < 1) ns = 1;
        }
        j.n_splits[s] = ns;
        if (ns > 1) {
            j.partial[s] = malloc(sizeof(float) * (size_t)sq->n_q * n_head * ns * (l->head_dim + 2));
            if (!j.partial[s]) goto oom;
        }
        int rows = ns > 1 ? sq->n_q : ATTN_ROWS;
        for (int g = 0; g < l->n_kv_head; g++)
            for (int r0 = 0; r0 < sq->n_q; r0 += rows) {
                int r1 = r0 + rows < sq->n_q ? r0 + rows : sq->n_q;
                int kmax = 0; /* keys the rows can see */
                for (int r = r0; r < r1; r++) kmax = sq->q_slot[r] + 1 > kmax ? sq->q_slot[r] + 1 : kmax;
                for (int k = 0; k < ns; k++) {
                    attn_item *it = &j.items[j.n_items++];
                    *it = (attn_item){s, g, r0, r1, (int)((int64_t)kmax * k / ns),
                                      (int)((int64_t)kmax * (k + 1) / ns), ns > 1 ? k : -1};
                    size_t need = (size_t)(r1 - r0) * gs * (it->k1 - it->k0);
                    scratch_need = need > scratch_need ? need : scratch_need;
                }
            }
    }
    if (scratch_need > b->attn_scratch_floats) {
        for (int t = 0; t < b->n_threads; t++) {
            kv_aligned_free(b->attn_scratch[t]);
            b->attn_scratch[t] = kv_aligned_alloc(scratch_need * sizeof(float));
            if (!b->attn_scratch[t]) {
                b->attn_scratch_floats = 0;
                goto oom;
            }
        }
        b->attn_scratch_floats = scratch_need;
    }
    j.scratch = b->attn_scratch;
    atomic_store(&j.next, 0);
    if (j.n_items == 1)
        attn_task(&j, 0, 1);
    else if (j.n_items > 1)
        threadpool_run(b->tp, attn_task, &j);
    for (int s = 0; s < n_seqs; s++)
        if (j.n_splits[s] > 1) attn_merge(&j, s);
    goto done;
oom:
    log_error("attention: out of memory (layer %d)", layer);
    for (int s = 0; s < n_seqs; s++)
        memset(seqs[s].out, 0, sizeof(float) * (size_t)seqs[s].n_q * n_head * l->head_dim);
done:
    if (j.partial)
        for (int s = 0; s < n_seqs; s++) free(j.partial[s]);
    free(j.partial);
    free(j.n_splits);
    free(j.items);
}
