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

#define ATTN_MIN_SPLIT 256 /* fewest keys worth a separate work item (decode) */

void *cpu_kv_alloc(backend *b, const kv_layout *l) {
    (void)b;
    size_t bytes;
    if (size_mul(kv_layout_block_bytes(l), (size_t)l->n_blocks, &bytes)) return NULL;
    /* Zeroed (the score loops read whole 16-slot groups, so unwritten slots must hold finite
     * values), and committed page by page as sequences first reach them. */
    return kv_zeroed_alloc(bytes);
}

void cpu_kv_free(backend *b, void *pool) {
    (void)b;
    kv_zeroed_free(pool);
}

/* K goes into the transposed [head_dim][block_tokens] regions one column per token, V into
 * [block_tokens][head_dim] rows; each head's row is converted as a whole (f16 rounding as
 * fp32_to_fp16) and then placed. Long runs (prefill, a blended layer's reused tokens) are split
 * over the threads by token: tokens own distinct slots. */
typedef struct kv_copy_job {
    void *pool;
    const kv_layout *l;
    int layer;
    int kv; /* load: which of K (0) and V (1) */
    const int32_t *block_table;
    const int32_t *slots;
    int n_tok;
    const float *k, *v; /* store */
    float *out;         /* load */
} kv_copy_job;

static void kv_store_task(void *ctx, int ith, int nth) {
    const kv_copy_job *j = ctx;
    const kv_layout *l = j->l;
    int hd = l->head_dim, bt = l->block_tokens;
    uint16_t row[MAX_KV_HEAD_DIM];
    int64_t lo, hi;
    split_range(j->n_tok, ith, nth, &lo, &hi);
    for (int64_t t = lo; t < hi; t++) {
        int off = j->slots[t] % bt;
        for (int h = 0; h < l->n_kv_head; h++) {
            size_t src = ((size_t)t * l->n_kv_head + h) * hd;
            uint16_t *kr =
                kv_layout_region(j->pool, l, j->layer, 0, h, j->block_table, j->slots[t]);
            fp32_to_fp16_row(j->k + src, row, hd);
            for (int d = 0; d < hd; d++) kr[(size_t)d * bt + off] = row[d];
            uint16_t *vr =
                kv_layout_region(j->pool, l, j->layer, 1, h, j->block_table, j->slots[t]);
            fp32_to_fp16_row(j->v + src, vr + (size_t)off * hd, hd);
        }
    }
}

static void kv_load_task(void *ctx, int ith, int nth) {
    const kv_copy_job *j = ctx;
    const kv_layout *l = j->l;
    int hd = l->head_dim, bt = l->block_tokens;
    uint16_t row[MAX_KV_HEAD_DIM];
    int64_t lo, hi;
    split_range(j->n_tok, ith, nth, &lo, &hi);
    for (int64_t t = lo; t < hi; t++) {
        int off = j->slots[t] % bt;
        for (int h = 0; h < l->n_kv_head; h++) {
            const uint16_t *r =
                kv_layout_region(j->pool, l, j->layer, j->kv, h, j->block_table, j->slots[t]);
            float *o = j->out + ((size_t)t * l->n_kv_head + h) * hd;
            if (j->kv == 0) {
                for (int d = 0; d < hd; d++) row[d] = r[(size_t)d * bt + off];
                fp16_to_fp32_row(row, o, hd);
            } else {
                fp16_to_fp32_row(r + (size_t)off * hd, o, hd);
            }
        }
    }
}

/* Fewer tokens than this are copied on the calling thread (a decode step's row). */
#define KV_COPY_SERIAL 32

static int kv_store_run(backend *b, void *pool, const kv_layout *l, int layer,
                        const int32_t *block_table, const int32_t *slots, int n_tok, const float *k,
                        const float *v, bool serial) {
    kv_copy_job j = {.pool = pool,
                     .l = l,
                     .layer = layer,
                     .block_table = block_table,
                     .slots = slots,
                     .n_tok = n_tok,
                     .k = k,
                     .v = v};
    if (serial || n_tok < KV_COPY_SERIAL)
        kv_store_task(&j, 0, 1);
    else
        threadpool_run(cpu_of(b)->tp, kv_store_task, &j);
    return 0;
}

int cpu_kv_write(backend *b, void *pool, const kv_layout *l, int layer, const int32_t *block_table,
                 const int32_t *slots, int n_tok, const float *k, const float *v) {
    return kv_store_run(b, pool, l, layer, block_table, slots, n_tok, k, v, false);
}

int cpu_kv_store_serial(backend *b, void *pool, const kv_layout *l, int layer,
                        const int32_t *block_table, const int32_t *slots, int n_tok, const float *k,
                        const float *v) {
    return kv_store_run(b, pool, l, layer, block_table, slots, n_tok, k, v, true);
}

int cpu_kv_load(backend *b, const void *pool, const kv_layout *l, int layer, int kv,
                const int32_t *block_table, const int32_t *slots, int n_tok, float *out) {
    kv_copy_job j = {.pool = (void *)(uintptr_t)pool,
                     .l = l,
                     .layer = layer,
                     .kv = kv,
                     .block_table = block_table,
                     .slots = slots,
                     .n_tok = n_tok,
                     .out = out};
    if (n_tok < KV_COPY_SERIAL)
        kv_load_task(&j, 0, 1);
    else
        threadpool_run(cpu_of(b)->tp, kv_load_task, &j);
    return 0;
}

/* CacheBlend's re-rotation in place: a token's K column of each head gathered to f32, turned
 * (kernels/rope.c) and written back rounded as kv_write rounds. */
int cpu_kv_rope(backend *b, void *pool, const kv_layout *l, int layer, const int32_t *block_table,
                const int32_t *slots, int n_tok, const float *cs, int n_rot) {
    (void)b;
    int hd = l->head_dim, bt = l->block_tokens;
    float row[MAX_KV_HEAD_DIM];
    for (int t = 0; t < n_tok; t++) {
        int off = slots[t] % bt;
        for (int h = 0; h < l->n_kv_head; h++) {
            uint16_t *kr = kv_layout_region(pool, l, layer, 0, h, block_table, slots[t]);
            for (int d = 0; d < hd; d++) row[d] = fp16_to_fp32(kr[(size_t)d * bt + off]);
            rope_rotate(row, 1, hd, n_rot, cs + (size_t)t * n_rot, false);
            for (int d = 0; d < hd; d++) kr[(size_t)d * bt + off] = fp32_to_fp16(row[d]);
        }
    }
    return 0;
}

int cpu_kv_copy_block(backend *b, void *pool, const kv_layout *l, int32_t dst, int32_t src) {
    (void)b;
    size_t bb = kv_layout_block_bytes(l);
    memcpy((uint8_t *)pool + (size_t)dst * bb, (const uint8_t *)pool + (size_t)src * bb, bb);
    return 0;
}

/* Streams do not exist on the CPU: every copy is done when queued. */
int cpu_kv_read_blocks(backend *b, const void *pool, const kv_layout *l, const int32_t *blocks,
                       int n, void *host, backend_stream *s, bool wait) {
    (void)b, (void)s, (void)wait;
    size_t bb = kv_layout_block_bytes(l);
    for (int i = 0; i < n; i++)
        memcpy((uint8_t *)host + (size_t)i * bb, (const uint8_t *)pool + (size_t)blocks[i] * bb,
               bb);
    return 0;
}

int cpu_kv_write_blocks(backend *b, void *pool, const kv_layout *l, const int32_t *blocks, int n,
                        const void *host, backend_stream *s, bool wait) {
    (void)b, (void)s, (void)wait;
    size_t bb = kv_layout_block_bytes(l);
    for (int i = 0; i < n; i++)
        memcpy((uint8_t *)pool + (size_t)blocks[i] * bb, (const uint8_t *)host + (size_t)i * bb,
               bb);
    return 0;
}

/* One token's rows from block region a (slot sa) to b (slot sb), every layer, head and kv. */
static void copy_token(const kv_layout *l, uint8_t *db, int sd, const uint8_t *sb_, int ss) {
    int bt = l->block_tokens, hd = l->head_dim;
    for (int il = 0; il < l->n_layer; il++)
        for (int h = 0; h < l->n_kv_head; h++) {
            uint16_t *dk = (uint16_t *)(void *)(db + kv_layout_offset(l, il, 0, h));
            const uint16_t *sk =
                (const uint16_t *)(const void *)(sb_ + kv_layout_offset(l, il, 0, h));
            for (int d = 0; d < hd; d++) dk[(size_t)d * bt + sd] = sk[(size_t)d * bt + ss];
            memcpy(db + kv_layout_offset(l, il, 1, h) + (size_t)sd * hd * 2,
                   sb_ + kv_layout_offset(l, il, 1, h) + (size_t)ss * hd * 2, (size_t)hd * 2);
        }
}

int cpu_kv_read_rows(backend *b, const void *pool, const kv_layout *l, const int32_t *block_table,
                     int slot, int n, void *host, int host_slot) {
    (void)b;
    size_t bb = kv_layout_block_bytes(l);
    int bt = l->block_tokens;
    for (int i = 0; i < n; i++) {
        int s = slot + i, h = host_slot + i;
        copy_token(l, (uint8_t *)host + (size_t)(h / bt) * bb, h % bt,
                   (const uint8_t *)pool + (size_t)block_table[s / bt] * bb, s % bt);
    }
    return 0;
}

int cpu_kv_write_rows(backend *b, void *pool, const kv_layout *l, const int32_t *block_table,
                      int slot, int n, const void *host, int host_slot) {
    (void)b;
    size_t bb = kv_layout_block_bytes(l);
    int bt = l->block_tokens;
    for (int i = 0; i < n; i++) {
        int s = slot + i, h = host_slot + i;
        copy_token(l, (uint8_t *)pool + (size_t)block_table[s / bt] * bb, s % bt,
                   (const uint8_t *)host + (size_t)(h / bt) * bb, h % bt);
    }
    return 0;
}

/* ---------------------------------------------------------------- the kernel */

static void attn_task(void *ctx, int ith, int nth) {
    (void)nth;
    attn_job *j = ctx;
    const cpu_float_ops *ops = cpu_float_ops_get();
    for (;;) {
        int i = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        if (i >= j->n_items) return;
        ops->attn_item(j, &j->items[i], j->scratch[ith]);
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

/* Allocates j's work items (room for the most n_seqs sequences can need: a row block per row or
 * a key range per ATTN_MIN_SPLIT keys, whichever is more, per kv head) and its per-sequence
 * split counts and partial states (zeroed). 0, or -1 when out of memory (the caller frees). */
static int attn_job_alloc(attn_job *j, int n_seqs) {
    int max_items = 0;
    for (int s = 0; s < n_seqs; s++) {
        int rb = j->seqs[s].n_q; /* row blocks: at most one per row (see ATTN_SPAN) */
        int sp = j->seqs[s].n_kv / ATTN_MIN_SPLIT + 1;
        max_items += j->l->n_kv_head * (rb > sp ? rb : sp);
    }
    j->items = malloc(sizeof *j->items * (size_t)(max_items ? max_items : 1));
    j->partial = calloc((size_t)n_seqs, sizeof *j->partial);
    j->n_splits = calloc((size_t)n_seqs, sizeof *j->n_splits);
    return j->items && j->partial && j->n_splits ? 0 : -1;
}

/* How many key ranges sequence sq splits into: decode-sized (a few rows), one row block with
 * its keys split so every thread has work; otherwise 1. */
static inline int attn_key_splits(const cpu_backend *b, const kv_layout *l, const attn_seq *sq) {
    int ns = 1;
    if (sq->split_keys && sq->n_q <= 4) {
        int want = (2 * b->n_threads + l->n_kv_head - 1) / l->n_kv_head;
        int can = sq->n_kv / ATTN_MIN_SPLIT;
        ns = want < can ? want : can;
        if (ns < 1) ns = 1;
    }
    return ns;
}

/* Query rows per block of sequence sq, split into ns key ranges. Prefill-sized: row blocks of
 * ATTN_ROWS, fewer rows per block when that leaves threads idle (a warm request's question is a
 * 16-row step over a long history). A row's result does not depend on which rows share its
 * block. Split keys: all rows in one block. */
static inline int attn_block_rows(const cpu_backend *b, const kv_layout *l, const attn_seq *sq,
                                  int ns) {
    int rows = ATTN_ROWS;
    while (rows > 4 && l->n_kv_head * ((sq->n_q + rows - 1) / rows) < 4 * b->n_threads) rows /= 2;
    if (ns > 1) rows = sq->n_q;
    return rows;
}

/* Appends sequence s's work items to j->items: for every kv head, its blocks of at most rows
 * query rows, each over ns key ranges (split k of ns when ns > 1). Returns the scratch floats
 * the largest item needs. */
static inline size_t attn_seq_items(attn_job *j, int s, int ns, int rows) {
    const attn_seq *sq = &j->seqs[s];
    const kv_layout *l = j->l;
    int gs = j->n_head / l->n_kv_head;
    size_t scratch_need = 0;
    for (int g = 0; g < l->n_kv_head; g++)
        for (int r0 = 0, r1; r0 < sq->n_q; r0 = r1) {
            /* A block's rows all score the keys up to its last visible one, masked past their
             * own: rows far apart (a blended layer's scattered recomputed tokens) start a new
             * block rather than score keys they cannot see. */
            int kmax = sq->q_slot[r0] + 1; /* keys the rows can see */
            for (r1 = r0 + 1; r1 < sq->n_q && r1 - r0 < rows; r1++) {
                if (ns == 1 && (sq->q_slot[r1] < sq->q_slot[r0] ||
                                sq->q_slot[r1] - sq->q_slot[r0] >= ATTN_SPAN))
                    break;
                kmax = sq->q_slot[r1] + 1 > kmax ? sq->q_slot[r1] + 1 : kmax;
            }
            for (int k = 0; k < ns; k++) {
                attn_item *it = &j->items[j->n_items++];
                /* key ranges start on multiples of 16: the score loop's vector width */
                int ka = (int)((int64_t)kmax * k / ns) & ~15;
                int kz = k + 1 == ns ? kmax : (int)((int64_t)kmax * (k + 1) / ns) & ~15;
                *it = (attn_item){s, g, r0, r1, ka, kz, ns > 1 ? k : -1};
                /* scores [queries][keys], then the weighted V sums [queries][hd] at
                 * attn_item_kernel's acc_buf: both with the query count rounded up to 4 */
                size_t nq4 = ((size_t)(r1 - r0) * gs + 3) & ~(size_t)3;
                size_t need = nq4 * ((size_t)((kz - ka + 15) & ~15) + (size_t)l->head_dim);
                scratch_need = need > scratch_need ? need : scratch_need;
            }
        }
    return scratch_need;
}

/* Plans j's work items over its n_seqs sequences (their key splits, the partial states of split
 * ones, their row blocks); *scratch_need gets the floats of scratch the largest item needs. 0,
 * or -1 when out of memory. */
static int attn_plan(const cpu_backend *b, attn_job *j, int n_seqs, size_t *scratch_need) {
    const kv_layout *l = j->l;
    *scratch_need = 0;
    for (int s = 0; s < n_seqs; s++) {
        const attn_seq *sq = &j->seqs[s];
        if (sq->n_q == 0) continue;
        int ns = attn_key_splits(b, l, sq);
        j->n_splits[s] = ns;
        if (ns > 1) {
            j->partial[s] =
                malloc(sizeof(float) * (size_t)sq->n_q * j->n_head * ns * (l->head_dim + 2));
            if (!j->partial[s]) return -1;
        }
        size_t need = attn_seq_items(j, s, ns, attn_block_rows(b, l, sq, ns));
        *scratch_need = need > *scratch_need ? need : *scratch_need;
    }
    return 0;
}

/* Grows every thread's attention scratch to floats (scratch only grows). 0, or -1 when out of
 * memory (the scratch is then marked empty). */
static int attn_scratch_reserve(cpu_backend *b, size_t floats) {
    if (floats <= b->attn_scratch_floats) return 0;
    for (int t = 0; t < b->n_threads; t++) {
        kv_aligned_free(b->attn_scratch[t]);
        b->attn_scratch[t] = kv_aligned_alloc(floats * sizeof(float));
        if (!b->attn_scratch[t]) {
            b->attn_scratch_floats = 0;
            return -1;
        }
    }
    b->attn_scratch_floats = floats;
    return 0;
}

int cpu_attention(backend *bk, const void *pool, const kv_layout *l, int layer, int n_head,
                  float scale, const attn_seq *seqs, int n_seqs) {
    cpu_backend *b = cpu_of(bk);
    attn_job j = {
        .pool = pool, .l = l, .layer = layer, .n_head = n_head, .scale = scale, .seqs = seqs};
    size_t scratch_need = 0;
    int rc = -1;
    if (attn_job_alloc(&j, n_seqs) || attn_plan(b, &j, n_seqs, &scratch_need) ||
        attn_scratch_reserve(b, scratch_need)) {
        log_error("attention: out of memory (layer %d)", layer);
        goto done;
    }
    j.scratch = b->attn_scratch;
    atomic_store(&j.next, 0);
    if (j.n_items == 1)
        attn_task(&j, 0, 1);
    else if (j.n_items > 1)
        threadpool_run(b->tp, attn_task, &j);
    for (int s = 0; s < n_seqs; s++)
        if (j.n_splits[s] > 1) attn_merge(&j, s);
    rc = 0;
done:
    if (j.partial)
        for (int s = 0; s < n_seqs; s++) free(j.partial[s]);
    free(j.partial);
    free(j.n_splits);
    free(j.items);
    return rc;
}
