/* The forward pass (DESIGN.md, "The forward pass contract"): a batch of sequences, each with new
 * tokens at explicit positions written to explicit KV slots; executed layer by layer with hooks
 * between layers; the set of token rows being computed may shrink between layers while
 * attention still reads every KV slot of each sequence. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model/model.h"

struct forward_state {
    int n_rows;
    int32_t *rows; /* [n_rows] index of each computed row in the flattened batch */
    float *x;      /* [n_rows][dim] hidden state, row-compacted */
    int dim;
    /* Inside a layer (after_kv), the rows' queries and slots are compacted with them. */
    bool in_layer;
    float *q;          /* forward_ctx's q: [n_rows][q_dim] */
    int q_dim;         /* n_head * head_dim */
    int32_t *row_slot; /* forward_ctx's row_slot: [n_rows] */
};

struct forward_ctx {
    const model *m;
    backend *b;
    kv_pool *pool;
    int max_tokens;
    int max_seqs;
    forward_state st;
    /* per flattened token */
    int32_t *tok_seq;  /* [max_tokens] which batch_seq */
    int32_t *tok_slot; /* [max_tokens] KV slot */
    int32_t *tok_pos;  /* [max_tokens] RoPE position */
    float *tok_cs;     /* [max_tokens][n_rot] its RoPE angles (cos, sin), shared by every layer */
    /* per computed row, row-compacted like st.x; all f32, host */
    int32_t *row_slot; /* [max_tokens] */
    int *keep;         /* [max_tokens] rows kept at the last layer */
    float *xn;         /* [max_tokens][dim] normalised input */
    float *q;          /* [max_tokens][n_head * head_dim] */
    float *k;          /* [max_tokens][n_kv_head * head_dim] */
    float *v;          /* [max_tokens][n_kv_head * head_dim] */
    float *att;        /* [max_tokens][n_head * head_dim] */
    float *tmp;        /* [max_tokens][dim] */
    float *gate;       /* [max_tokens][ffn_dim] */
    float *up;         /* [max_tokens][ffn_dim] */
    attn_seq *aseq;    /* [max_seqs] */
};

/* ---------------------------------------------------------------- state */

int forward_state_n_rows(const forward_state *st) { return st->n_rows; }
const int32_t *forward_state_rows(const forward_state *st) { return st->rows; }
const float *forward_state_hidden(const forward_state *st, int r) {
    return st->x + (size_t)r * st->dim;
}

int forward_state_keep_rows(forward_state *st, const int *keep, int n_keep) {
    if (n_keep < 0 || n_keep > st->n_rows) return -1;
    for (int i = 0; i < n_keep; i++) {
        int r = keep[i];
        if (r < 0 || r >= st->n_rows || (i > 0 && r <= keep[i - 1])) return -1;
        if (r != i) {
            st->rows[i] = st->rows[r];
            memmove(st->x + (size_t)i * st->dim, st->x + (size_t)r * st->dim,
                    sizeof(float) * st->dim);
            if (st->in_layer) {
                memmove(st->q + (size_t)i * st->q_dim, st->q + (size_t)r * st->q_dim,
                        sizeof(float) * st->q_dim);
                st->row_slot[i] = st->row_slot[r];
            }
        }
    }
    st->n_rows = n_keep;
    return 0;
}

/* ---------------------------------------------------------------- context */

forward_ctx *forward_ctx_create(const model *m, backend *b, kv_pool *pool, int max_tokens,
                                int max_seqs, kv_error *err) {
    if (max_tokens < 1 || max_seqs < 1) {
        kv_fail(err, "forward context needs max_tokens and max_seqs >= 1");
        return NULL;
    }
    forward_ctx *f = calloc(1, sizeof *f);
    if (!f) goto oom;
    const model_hparams *hp = &m->hp;
    size_t nt = (size_t)max_tokens, qd = (size_t)hp->n_head * hp->head_dim,
           kvd = (size_t)hp->n_kv_head * hp->head_dim;
    f->m = m;
    f->b = b;
    f->pool = pool;
    f->max_tokens = max_tokens;
    f->max_seqs = max_seqs;
    f->st.dim = hp->dim;
    f->st.rows = malloc(sizeof(int32_t) * nt);
    f->st.x = kv_aligned_alloc(sizeof(float) * nt * hp->dim);
    f->tok_seq = malloc(sizeof(int32_t) * nt);
    f->tok_slot = malloc(sizeof(int32_t) * nt);
    f->tok_pos = malloc(sizeof(int32_t) * nt);
    f->tok_cs = malloc(sizeof(float) * nt * (size_t)hp->n_rot);
    f->row_slot = malloc(sizeof(int32_t) * nt);
    f->keep = malloc(sizeof(int) * nt);
    f->xn = kv_aligned_alloc(sizeof(float) * nt * hp->dim);
    f->q = kv_aligned_alloc(sizeof(float) * nt * qd);
    f->k = kv_aligned_alloc(sizeof(float) * nt * kvd);
    f->v = kv_aligned_alloc(sizeof(float) * nt * kvd);
    f->att = kv_aligned_alloc(sizeof(float) * nt * qd);
    f->tmp = kv_aligned_alloc(sizeof(float) * nt * hp->dim);
    f->gate = kv_aligned_alloc(sizeof(float) * nt * hp->ffn_dim);
    f->up = kv_aligned_alloc(sizeof(float) * nt * hp->ffn_dim);
    f->aseq = calloc((size_t)max_seqs, sizeof *f->aseq);
    f->st.q = f->q;
    f->st.q_dim = (int)qd;
    f->st.row_slot = f->row_slot;
    if (!f->st.rows || !f->st.x || !f->tok_seq || !f->tok_slot || !f->tok_pos || !f->tok_cs ||
        !f->row_slot || !f->keep || !f->xn || !f->q || !f->k || !f->v || !f->att || !f->tmp ||
        !f->gate || !f->up || !f->aseq)
        goto oom;
    return f;
oom:
    forward_ctx_destroy(f);
    kv_fail(err, "out of memory for a forward context of %d tokens", max_tokens);
    return NULL;
}

void forward_ctx_destroy(forward_ctx *f) {
    if (!f) return;
    free(f->st.rows);
    kv_aligned_free(f->st.x);
    free(f->tok_seq);
    free(f->tok_slot);
    free(f->tok_pos);
    free(f->tok_cs);
    free(f->row_slot);
    free(f->keep);
    kv_aligned_free(f->xn);
    kv_aligned_free(f->q);
    kv_aligned_free(f->k);
    kv_aligned_free(f->v);
    kv_aligned_free(f->att);
    kv_aligned_free(f->tmp);
    kv_aligned_free(f->gate);
    kv_aligned_free(f->up);
    free(f->aseq);
    free(f);
}

/* ---------------------------------------------------------------- helpers */

/* Matmuls over one input: together (one activation conversion) when the weights share an
 * activation format, else one by one. */
static int matmul_group(backend *b, int n, const weight *const *w, const float *x, int n_tok,
                        float *const *y) {
    tensor_type act = tensor_type_get((int)w[0]->type)->act_type;
    bool same = true;
    for (int i = 1; i < n; i++)
        same =
            same && tensor_type_get((int)w[i]->type)->act_type == act && w[i]->n_in == w[0]->n_in;
    if (same) return backend_matmul_multi(b, n, w, x, n_tok, y);
    for (int i = 0; i < n; i++)
        if (backend_matmul(b, w[i], x, n_tok, y[i])) return -1;
    return 0;
}

static int validate_batch(const forward_ctx *f, const batch_seq *seqs, int n_seqs, int *total,
                          kv_error *err) {
    const kv_layout *l = kv_pool_layout(f->pool);
    if (n_seqs < 1 || n_seqs > f->max_seqs)
        return kv_fail(err, "batch of %d sequences (1..%d)", n_seqs, f->max_seqs);
    int n = 0;
    for (int s = 0; s < n_seqs; s++) {
        const batch_seq *bs = &seqs[s];
        if (bs->n_tok < 1) return kv_fail(err, "sequence %d of the batch has no tokens", s);
        if (bs->n_tok > f->max_tokens - n)
            return kv_fail(err, "batch exceeds %d tokens", f->max_tokens);
        n += bs->n_tok;
        if (bs->kv_start < 0 || bs->kv_start > bs->seq->n_tokens)
            return kv_fail(err, "sequence %d: KV start %d leaves a gap after %d cached slots", s,
                           bs->kv_start, bs->seq->n_tokens);
        int64_t end = (int64_t)bs->kv_start + bs->n_tok;
        if (end > (int64_t)bs->seq->n_blocks * l->block_tokens)
            return kv_fail(err, "sequence %d: slots up to %lld are not reserved", s,
                           (long long)end);
        for (int b = bs->kv_start / l->block_tokens;
             b < (end + l->block_tokens - 1) / l->block_tokens; b++)
            if (kv_pool_block_refs(f->pool, bs->seq->blocks[b]) != 1)
                return kv_fail(err, "sequence %d: KV block %d is shared and cannot be written", s,
                               b);
        for (int t = 0; t < bs->n_tok; t++) {
            if (bs->tokens[t] < 0 || bs->tokens[t] >= f->m->hp.n_vocab)
                return kv_fail(err, "token id %d is out of range [0, %d)", bs->tokens[t],
                               f->m->hp.n_vocab);
            if (bs->pos[t] < 0) return kv_fail(err, "negative position %d", bs->pos[t]);
        }
        for (int s2 = 0; s2 < s; s2++)
            if (seqs[s2].seq == bs->seq)
                return kv_fail(err, "a sequence appears twice in one batch");
    }
    *total = n;
    return 0;
}

/* Rows of sequence s among the current rows: [*lo, *hi) (rows stay grouped by sequence). */
static void seq_rows(const forward_ctx *f, int s, int *lo, int *hi) {
    const forward_state *st = &f->st;
    int r = 0;
    while (r < st->n_rows && f->tok_seq[st->rows[r]] < s) r++;
    *lo = r;
    while (r < st->n_rows && f->tok_seq[st->rows[r]] == s) r++;
    *hi = r;
}

/* ---------------------------------------------------------------- one layer */

/* At the last layer, the rows that give logits (or whose hidden state a hook reads): the
 * others' attention and feed-forward output would feed nothing. */
static int keep_output_rows(forward_ctx *f, const batch_seq *seqs) {
    forward_state *st = &f->st;
    int n_keep = 0;
    for (int r = 0; r < st->n_rows; r++) {
        int t = st->rows[r], s = f->tok_seq[t];
        const batch_seq *bs = &seqs[s];
        if (bs->all_logits || bs->all_rows || f->tok_slot[t] == bs->kv_start + bs->n_tok - 1)
            f->keep[n_keep++] = r;
    }
    return n_keep == st->n_rows ? 0 : forward_state_keep_rows(st, f->keep, n_keep);
}

/* Returns -1 when the backend runs out of scratch memory, -2 when a hook aborts. */
static int layer_forward(forward_ctx *f, const batch_seq *seqs, int n_seqs, int il,
                         const forward_hooks *hooks) {
    const model *m = f->m;
    const model_hparams *hp = &m->hp;
    const layer_weights *L = &m->layers[il];
    backend *b = f->b;
    forward_state *st = &f->st;
    int n = st->n_rows;
    int qd = hp->n_head * hp->head_dim, kvd = hp->n_kv_head * hp->head_dim;
    const kv_layout *kl = kv_pool_layout(f->pool);
    void *pool = kv_pool_memory(f->pool);

    for (int r = 0; r < n; r++) f->row_slot[r] = f->tok_slot[st->rows[r]];

    /* attention block: this layer's K and V of every row go to the pool first */
    backend_rmsnorm(b, st->x, L->attn_norm, f->xn, n, hp->dim, hp->norm_eps);
    const weight *qkv[3] = {&L->wq, &L->wk, &L->wv};
    float *qkv_out[3] = {f->q, f->k, f->v};
    if (matmul_group(b, 3, qkv, f->xn, n, qkv_out)) return -1;
    backend_rope_cs(b, f->q, f->tok_cs, st->rows, n, hp->n_head, hp->head_dim, hp->n_rot);
    backend_rope_cs(b, f->k, f->tok_cs, st->rows, n, hp->n_kv_head, hp->head_dim, hp->n_rot);
    for (int s = 0; s < n_seqs; s++) {
        int lo, hi;
        seq_rows(f, s, &lo, &hi);
        if (hi > lo)
            backend_kv_store(b, pool, kl, il, seqs[s].seq->blocks, f->row_slot + lo, hi - lo,
                             f->k + (size_t)lo * kvd, f->v + (size_t)lo * kvd);
    }
    /* rows dropped from here on skip the rest of the layer (their queries and slots move with
     * the rows that stay) */
    st->in_layer = true;
    int rc = 0;
    if (hooks && hooks->after_kv && hooks->after_kv(hooks->ud, st, il) != 0) rc = -2;
    if (rc == 0 && il == hp->n_layer - 1 && keep_output_rows(f, seqs)) rc = -1;
    st->in_layer = false;
    if (rc) return rc;
    n = st->n_rows;
    if (n == 0) return 0;

    int n_attn = 0;
    for (int s = 0; s < n_seqs; s++) {
        int lo, hi;
        seq_rows(f, s, &lo, &hi);
        if (hi == lo) continue;
        int max_slot = 0;
        for (int r = lo; r < hi; r++)
            max_slot = f->row_slot[r] > max_slot ? f->row_slot[r] : max_slot;
        f->aseq[n_attn++] = (attn_seq){.block_table = seqs[s].seq->blocks,
                                       .n_kv = max_slot + 1,
                                       .n_q = hi - lo,
                                       .q_slot = f->row_slot + lo,
                                       .q = f->q + (size_t)lo * qd,
                                       .out = f->att + (size_t)lo * qd,
                                       .split_keys = seqs[s].decode};
    }
    if (backend_attention(b, pool, kl, il, hp->n_head, 1.0f / sqrtf((float)hp->head_dim), f->aseq,
                          n_attn) ||
        backend_matmul(b, &L->wo, f->att, n, f->tmp))
        return -1;
    backend_add(b, st->x, f->tmp, (int64_t)n * hp->dim);

    /* feed-forward block: down(silu(gate(x)) * up(x)) */
    backend_rmsnorm(b, st->x, L->ffn_norm, f->xn, n, hp->dim, hp->norm_eps);
    const weight *gu[2] = {&L->w_gate, &L->w_up};
    float *gu_out[2] = {f->gate, f->up};
    if (matmul_group(b, 2, gu, f->xn, n, gu_out)) return -1;
    backend_swiglu(b, f->gate, f->up, f->gate, (int64_t)n * hp->ffn_dim);
    if (backend_matmul(b, &L->w_down, f->gate, n, f->tmp)) return -1;
    backend_add(b, st->x, f->tmp, (int64_t)n * hp->dim);
    return 0;
}

/* ---------------------------------------------------------------- the pass */

int model_forward(forward_ctx *f, const batch_seq *seqs, int n_seqs, const forward_hooks *hooks,
                  float *logits, kv_error *err) {
    const model *m = f->m;
    const model_hparams *hp = &m->hp;
    int n_total = 0;
    if (validate_batch(f, seqs, n_seqs, &n_total, err)) return -1;

    /* flatten the batch; embed every token */
    forward_state *st = &f->st;
    int t = 0;
    for (int s = 0; s < n_seqs; s++)
        for (int i = 0; i < seqs[s].n_tok; i++, t++) {
            f->tok_seq[t] = s;
            f->tok_slot[t] = seqs[s].kv_start + i;
            f->tok_pos[t] = seqs[s].pos[i];
            st->rows[t] = t;
            const weight *e = &m->tok_embd;
            dequantize_row(e->type,
                           (const uint8_t *)e->data + (size_t)seqs[s].tokens[i] * e->row_bytes,
                           st->x + (size_t)t * hp->dim, hp->dim);
        }
    st->n_rows = n_total;
    backend_rope_angles(f->b, &m->rope, f->tok_pos, n_total, f->tok_cs);

    for (int il = 0; il < hp->n_layer; il++) {
        if (hooks && hooks->before_layer && hooks->before_layer(hooks->ud, st, il) != 0)
            return kv_fail(err, "forward aborted by a hook before layer %d", il);
        /* A failed layer leaves this batch's KV slots undefined: the sequences' lengths are
         * not advanced, so nothing reads them as valid. */
        int rc = st->n_rows > 0 ? layer_forward(f, seqs, n_seqs, il, hooks) : 0;
        if (rc == -2) return kv_fail(err, "forward aborted by a hook in layer %d", il);
        if (rc) return kv_fail(err, "out of memory in layer %d of the forward pass", il);
        if (hooks && hooks->after_layer && hooks->after_layer(hooks->ud, st, il) != 0)
            return kv_fail(err, "forward aborted by a hook after layer %d", il);
    }

    for (int s = 0; s < n_seqs; s++) {
        int end = seqs[s].kv_start + seqs[s].n_tok;
        if (end > seqs[s].seq->n_tokens) seqs[s].seq->n_tokens = end;
    }

    /* output rows: every computed row of all_logits sequences, else each sequence's last token */
    int n_out = 0;
    int t_first = 0;
    for (int s = 0, r = 0; s < n_seqs; s++) {
        int t_last = t_first + seqs[s].n_tok - 1;
        for (; r < st->n_rows && f->tok_seq[st->rows[r]] == s; r++)
            if (seqs[s].all_logits || st->rows[r] == t_last) {
                memcpy(f->tmp + (size_t)n_out * hp->dim, st->x + (size_t)r * hp->dim,
                       sizeof(float) * hp->dim);
                n_out++;
            }
        t_first += seqs[s].n_tok;
    }
    if (n_out == 0 || !logits) return n_out;
    backend_rmsnorm(f->b, f->tmp, m->output_norm, f->xn, n_out, hp->dim, hp->norm_eps);
    if (backend_matmul(f->b, &m->output, f->xn, n_out, logits))
        return kv_fail(err, "out of memory computing logits");
    return n_out;
}
