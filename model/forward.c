/* The forward pass (DESIGN.md, "The forward pass contract"): a batch of sequences, each with new
 * tokens at explicit positions written to explicit KV slots; executed layer by layer with hooks
 * between layers; the set of token rows being computed may shrink between layers while
 * attention still reads every KV slot of each sequence. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model/model.h"

/* Where things live. The hidden states, the activations of a layer and the tables ops read
 * (token ids, positions, row slots, block tables) are backend memory (device memory on CUDA);
 * the host keeps its own copy of the small integer tables (which rows, which slots) and uploads
 * them once per pass, and again only when a hook drops rows: no op waits for a host round trip.
 * Row compaction is a gather into a second buffer (a GPU cannot move rows in place in
 * parallel). */
struct forward_state {
    backend *b;
    int n_rows;
    int dim;
    int32_t *rows;     /* host: [n_rows] index of each computed row in the flattened batch */
    int32_t *row_slot; /* host: [n_rows] its KV slot */
    float *x;          /* backend: [n_rows][dim] hidden state, row-compacted */
    float *x_alt;      /* backend: the gather target that becomes x */
    /* Inside a layer (after_kv), the rows' queries are compacted with them. */
    bool in_layer;
    float *q, *q_alt;    /* backend: [n_rows][q_dim], the layer's rotated queries */
    int q_dim;           /* n_head * head_dim */
    int32_t *d_rows;     /* backend copies of rows and row_slot (in the pass's upload, d_meta) */
    int32_t *d_row_slot; /* backend */
    int32_t *d_keep;     /* backend: [max_tokens] gather indices */
    float *host_x;       /* host: [max_tokens][dim] rows read back by forward_state_hidden (only
                            when backend memory is not host memory) */
};

struct forward_ctx {
    const model *m;
    backend *b;
    kv_pool *pool;
    int max_tokens;
    int max_seqs;
    forward_state st;
    /* the model's weights where the backend reads them (backend_weight_data: the mmapped file on
     * the CPU, uploaded once on CUDA and shared by every context of that backend; or the
     * backend's lane-order copy, backend_weight_repack, one per context) */
    weight tok_embd, output;
    const float *output_norm;
    layer_weights *lw;  /* [n_layer] */
    rope_table rope;    /* inv_freq: backend */
    const void **bound; /* [n_bound] host ranges acquired with backend_weight_data */
    int n_bound;
    void **repacked; /* [n_repacked] the backend's own copies (backend_weight_repack) */
    int n_repacked;
    /* host, per flattened token */
    int32_t *tok_seq;  /* [max_tokens] which batch_seq */
    int32_t *tok_slot; /* [max_tokens] KV slot */
    int *keep;         /* [max_tokens] rows kept at the last layer */
    int32_t *meta;     /* [meta_len] what goes up per pass, in one upload: for its n tokens,
                          ids [n] | pos [n] | rows [n] | row_slot [n] | block tables */
    int32_t meta_len;
    int32_t *table_off; /* [max_seqs] offset of each sequence's block table in meta's tables */
    int32_t max_table;  /* block table entries the tables hold */
    /* backend memory */
    int32_t *d_meta; /* [meta_len] meta's backend copy */
    int32_t *d_ids, *d_pos,
        *d_tables;   /* this pass's parts of d_meta (and st's d_rows, d_row_slot) */
    float *tok_cs;   /* [max_tokens][n_rot] each token's RoPE angles (cos, sin), every layer's */
    float *xn;       /* [max_tokens][dim] normalised input */
    float *k;        /* [max_tokens][n_kv_head * head_dim] */
    float *v;        /* [max_tokens][n_kv_head * head_dim] */
    float *att;      /* [max_tokens][n_head * head_dim] */
    float *tmp;      /* [max_tokens][dim] */
    float *gate;     /* [max_tokens][ffn_dim] */
    float *up;       /* [max_tokens][ffn_dim] */
    float *d_logits; /* [LOGIT_ROWS][n_vocab] (when backend memory is not host memory) */
    attn_seq *aseq;  /* host: [max_seqs] */
};

/* keep lists (int, from hooks) are gather indices (int32_t) as they are */
_Static_assert(sizeof(int) == sizeof(int32_t), "int is not 32 bits");

/* Logit rows computed per matmul when they go through backend memory to the caller's. */
#define LOGIT_ROWS 64

/* ---------------------------------------------------------------- state */

int forward_state_n_rows(const forward_state *st) { return st->n_rows; }
const int32_t *forward_state_rows(const forward_state *st) { return st->rows; }
const float *forward_state_hidden(const forward_state *st, int r) {
    const float *x = st->x + (size_t)r * st->dim;
    if (!st->host_x) return x;
    float *h = st->host_x + (size_t)r * st->dim;
    if (backend_download(st->b, h, x, sizeof(float) * st->dim))
        log_error("forward: reading back hidden row %d failed", r);
    return h;
}

/* Uploads the host's rows and row_slot tables after they change. */
static int state_upload_rows(forward_state *st) {
    return backend_upload(st->b, st->d_rows, st->rows, sizeof(int32_t) * st->n_rows) ||
           backend_upload(st->b, st->d_row_slot, st->row_slot, sizeof(int32_t) * st->n_rows);
}

int forward_state_keep_rows(forward_state *st, const int *keep, int n_keep) {
    if (n_keep < 0 || n_keep > st->n_rows) return -1;
    for (int i = 0; i < n_keep; i++) {
        int r = keep[i];
        if (r < 0 || r >= st->n_rows || (i > 0 && r <= keep[i - 1])) return -1;
    }
    /* keep[i] >= i: the host tables compact in place */
    for (int i = 0; i < n_keep; i++) {
        st->rows[i] = st->rows[keep[i]];
        st->row_slot[i] = st->row_slot[keep[i]];
    }
    st->n_rows = n_keep;
    if (n_keep == 0) return 0;
    backend *b = st->b;
    float *t;
    if (backend_upload(b, st->d_keep, keep, sizeof(int32_t) * n_keep) ||
        backend_gather_rows(b, st->x_alt, st->x, st->d_keep, n_keep, st->dim))
        return -1;
    t = st->x, st->x = st->x_alt, st->x_alt = t;
    if (st->in_layer) {
        if (backend_gather_rows(b, st->q_alt, st->q, st->d_keep, n_keep, st->q_dim)) return -1;
        t = st->q, st->q = st->q_alt, st->q_alt = t;
    }
    return state_upload_rows(st) ? -1 : 0;
}

/* ---------------------------------------------------------------- context */

/* The backend's copy of host data (backend_weight_data), released with the context. */
static const void *bind(forward_ctx *f, const void *host, size_t bytes, kv_error *err) {
    const void *d = backend_weight_data(f->b, host, bytes, err);
    if (d) f->bound[f->n_bound++] = host;
    return d;
}

/* A matmul weight: the backend's repacked copy where it has one (the file's pages then leave
 * the resident set: the copy takes their place), else its copy of the host data. */
static int bind_weight(forward_ctx *f, const weight *host, weight *out, kv_error *err) {
    const size_t bytes = host->row_bytes * (size_t)host->n_out;
    const int r = backend_weight_repack(f->b, host, out, err);
    if (r < 0) return -1;
    if (r > 0) {
        f->repacked[f->n_repacked++] = (void *)out->data;
        gguf_release_pages(f->m->gguf, host->data, bytes);
        return 0;
    }
    *out = *host;
    out->data = bind(f, host->data, bytes, err);
    return out->data ? 0 : -1;
}

static int bind_norm(forward_ctx *f, const float *host, int dim, const float **out, kv_error *err) {
    *out = bind(f, host, sizeof(float) * (size_t)dim, err);
    return *out ? 0 : -1;
}

static int bind_layers(forward_ctx *f, kv_error *err) {
    const model *m = f->m;
    const model_hparams *hp = &m->hp;
    for (int il = 0; il < hp->n_layer; il++) {
        const layer_weights *L = &m->layers[il];
        layer_weights *D = &f->lw[il];
        if (bind_norm(f, L->attn_norm, hp->dim, &D->attn_norm, err) ||
            bind_norm(f, L->ffn_norm, hp->dim, &D->ffn_norm, err) ||
            bind_weight(f, &L->wq, &D->wq, err) || bind_weight(f, &L->wk, &D->wk, err) ||
            bind_weight(f, &L->wv, &D->wv, err) || bind_weight(f, &L->wo, &D->wo, err) ||
            bind_weight(f, &L->w_gate, &D->w_gate, err) ||
            bind_weight(f, &L->w_up, &D->w_up, err) || bind_weight(f, &L->w_down, &D->w_down, err))
            return -1;
    }
    f->rope.n_rot = m->rope.n_rot;
    f->rope.inv_freq =
        (float *)bind(f, m->rope.inv_freq, sizeof(float) * (size_t)(m->rope.n_rot / 2), err);
    return f->rope.inv_freq ? 0 : -1;
}

static int bind_weights(forward_ctx *f, kv_error *err) {
    const model *m = f->m;
    const model_hparams *hp = &m->hp;
    f->lw = calloc((size_t)hp->n_layer, sizeof *f->lw);
    f->bound = malloc(sizeof *f->bound * (size_t)(4 + 9 * hp->n_layer));
    f->repacked = malloc(sizeof *f->repacked * (size_t)(1 + 7 * hp->n_layer));
    if (!f->lw || !f->bound || !f->repacked) return kv_fail(err, "out of memory");
    if (bind_weight(f, &m->output, &f->output, err) ||
        bind_norm(f, m->output_norm, hp->dim, &f->output_norm, err))
        return -1;
    /* The embedding table is read a row per token (backend_embed). Tied to the output matrix, it
     * is that matrix as bound: a repacked copy is read there (its file pages were released, and
     * reading rows of the mapping would bring them back 64 KiB of fault-around at a time). */
    if (hp->tied_output && m->tok_embd.data == m->output.data) {
        f->tok_embd = f->output;
    } else {
        f->tok_embd = m->tok_embd;
        f->tok_embd.data =
            bind(f, m->tok_embd.data, m->tok_embd.row_bytes * (size_t)m->tok_embd.n_out, err);
        if (!f->tok_embd.data) return -1;
    }
    return bind_layers(f, err);
}

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
    if (bind_weights(f, err)) goto fail;
    int64_t max_in = hp->dim > hp->ffn_dim ? hp->dim : hp->ffn_dim;
    max_in = (int64_t)qd > max_in ? (int64_t)qd : max_in;
    backend_limits lim = {.max_tokens = max_tokens,
                          .max_seqs = max_seqs,
                          .max_n_in = max_in,
                          .n_head = hp->n_head,
                          .head_dim = hp->head_dim};
    if (backend_reserve(b, &lim, err)) goto fail;

    forward_state *st = &f->st;
    st->b = b;
    st->dim = hp->dim;
    st->q_dim = (int)qd;
    st->rows = malloc(sizeof(int32_t) * nt);
    st->row_slot = malloc(sizeof(int32_t) * nt);
    f->tok_seq = malloc(sizeof(int32_t) * nt);
    f->tok_slot = malloc(sizeof(int32_t) * nt);
    f->keep = malloc(sizeof(int) * nt);
    f->table_off = malloc(sizeof(int32_t) * (size_t)max_seqs);
    f->aseq = calloc((size_t)max_seqs, sizeof *f->aseq);
    /* a sequence's table never exceeds the pool's blocks */
    int64_t tables = (int64_t)max_seqs * kv_pool_total_blocks(pool);
    if (tables > INT32_MAX / 2) tables = INT32_MAX / 2;
    f->max_table = (int32_t)tables;
    f->meta_len = 4 * max_tokens + f->max_table;
    f->meta = calloc((size_t)f->meta_len, sizeof(int32_t)); /* a graph step uploads the gaps
                                                              between its strided tables too */
    if (!st->rows || !st->row_slot || !f->tok_seq || !f->tok_slot || !f->keep || !f->table_off ||
        !f->aseq || !f->meta)
        goto oom;
    if (!backend_host_memory(b)) {
        st->host_x = malloc(sizeof(float) * nt * hp->dim);
        f->d_logits = backend_alloc(b, sizeof(float) * LOGIT_ROWS * (size_t)hp->n_vocab);
        if (!st->host_x || !f->d_logits) goto oom;
    }
    st->x = backend_alloc(b, sizeof(float) * nt * hp->dim);
    st->x_alt = backend_alloc(b, sizeof(float) * nt * hp->dim);
    st->q = backend_alloc(b, sizeof(float) * nt * qd);
    st->q_alt = backend_alloc(b, sizeof(float) * nt * qd);
    st->d_keep = backend_alloc(b, sizeof(int32_t) * nt);
    f->d_meta = backend_alloc(b, sizeof(int32_t) * (size_t)f->meta_len);
    f->tok_cs = backend_alloc(b, sizeof(float) * nt * (size_t)hp->n_rot);
    f->xn = backend_alloc(b, sizeof(float) * nt * hp->dim);
    f->k = backend_alloc(b, sizeof(float) * nt * kvd);
    f->v = backend_alloc(b, sizeof(float) * nt * kvd);
    f->att = backend_alloc(b, sizeof(float) * nt * qd);
    f->tmp = backend_alloc(b, sizeof(float) * nt * hp->dim);
    f->gate = backend_alloc(b, sizeof(float) * nt * hp->ffn_dim);
    f->up = backend_alloc(b, sizeof(float) * nt * hp->ffn_dim);
    if (!st->x || !st->x_alt || !st->q || !st->q_alt || !st->d_keep || !f->d_meta || !f->tok_cs ||
        !f->xn || !f->k || !f->v || !f->att || !f->tmp || !f->gate || !f->up)
        goto oom;
    return f;
oom:
    kv_fail(err, "out of memory for a forward context of %d tokens", max_tokens);
fail:
    forward_ctx_destroy(f);
    return NULL;
}

void forward_ctx_destroy(forward_ctx *f) {
    if (!f) return;
    backend *b = f->b;
    forward_state *st = &f->st;
    backend_graph_forget(b, f); /* its recorded steps read the buffers below */
    free(st->rows);
    free(st->row_slot);
    free(st->host_x);
    float *bufs[] = {st->x, st->x_alt, st->q,  st->q_alt, f->tok_cs, f->xn,      f->k,
                     f->v,  f->att,    f->tmp, f->gate,   f->up,     f->d_logits};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) backend_free(b, bufs[i]);
    backend_free(b, st->d_keep);
    backend_free(b, f->d_meta);
    free(f->tok_seq);
    free(f->tok_slot);
    free(f->keep);
    free(f->meta);
    free(f->table_off);
    free(f->aseq);
    for (int i = 0; i < f->n_bound; i++) backend_weight_release(b, f->bound[i]);
    free(f->bound);
    for (int i = 0; i < f->n_repacked; i++) backend_free(b, f->repacked[i]);
    free(f->repacked);
    free(f->lw);
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

/* Sequence s's block table in backend memory. */
static const int32_t *seq_table(const forward_ctx *f, int s) {
    return f->d_tables + f->table_off[s];
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

/* How a layer ended. */
typedef enum layer_result {
    LAYER_OK = 0,
    LAYER_BACKEND_FAILED, /* an op failed: this batch's KV slots of the layer are undefined */
    LAYER_HOOK_ABORTED,   /* the after_kv hook stopped the pass */
} layer_result;

static layer_result layer_forward(forward_ctx *f, const batch_seq *seqs, int n_seqs, int il,
                                  const forward_hooks *hooks) {
    const model_hparams *hp = &f->m->hp;
    const layer_weights *L = &f->lw[il];
    backend *b = f->b;
    forward_state *st = &f->st;
    int n = st->n_rows;
    int qd = hp->n_head * hp->head_dim, kvd = hp->n_kv_head * hp->head_dim;
    const kv_layout *kl = kv_pool_layout(f->pool);
    void *pool = kv_pool_memory(f->pool);

    /* attention block: this layer's K and V of every row go to the pool first */
    const weight *qkv[3] = {&L->wq, &L->wk, &L->wv};
    float *qkv_out[3] = {st->q, f->k, f->v};
    if (backend_rmsnorm(b, st->x, L->attn_norm, f->xn, n, hp->dim, hp->norm_eps) ||
        matmul_group(b, 3, qkv, f->xn, n, qkv_out) ||
        backend_rope_cs(b, st->q, f->tok_cs, st->d_rows, n, hp->n_head, hp->head_dim, hp->n_rot) ||
        backend_rope_cs(b, f->k, f->tok_cs, st->d_rows, n, hp->n_kv_head, hp->head_dim, hp->n_rot))
        return LAYER_BACKEND_FAILED;
    for (int s = 0; s < n_seqs; s++) {
        int lo, hi;
        seq_rows(f, s, &lo, &hi);
        if (hi > lo && backend_kv_write(b, pool, kl, il, seq_table(f, s), st->d_row_slot + lo,
                                        hi - lo, f->k + (size_t)lo * kvd, f->v + (size_t)lo * kvd))
            return LAYER_BACKEND_FAILED;
    }
    /* rows dropped from here on skip the rest of the layer (their queries and slots move with
     * the rows that stay) */
    st->in_layer = true;
    layer_result rc = LAYER_OK;
    if (hooks && hooks->after_kv && hooks->after_kv(hooks->ud, st, il) != 0)
        rc = LAYER_HOOK_ABORTED;
    if (rc == LAYER_OK && il == hp->n_layer - 1 && keep_output_rows(f, seqs))
        rc = LAYER_BACKEND_FAILED;
    st->in_layer = false;
    if (rc) return rc;
    n = st->n_rows;
    if (n == 0) return LAYER_OK;

    int n_attn = 0;
    for (int s = 0; s < n_seqs; s++) {
        int lo, hi;
        seq_rows(f, s, &lo, &hi);
        if (hi == lo) continue;
        int max_slot = 0;
        for (int r = lo; r < hi; r++)
            max_slot = st->row_slot[r] > max_slot ? st->row_slot[r] : max_slot;
        f->aseq[n_attn++] = (attn_seq){.block_table = seq_table(f, s),
                                       .n_kv = max_slot + 1,
                                       .n_q = hi - lo,
                                       .q_slot = st->d_row_slot + lo,
                                       .q = st->q + (size_t)lo * qd,
                                       .out = f->att + (size_t)lo * qd,
                                       .split_keys = seqs[s].decode};
    }
    if (backend_attention(b, pool, kl, il, hp->n_head, 1.0f / sqrtf((float)hp->head_dim), f->aseq,
                          n_attn) ||
        backend_matmul(b, &L->wo, f->att, n, f->tmp) ||
        backend_add(b, st->x, f->tmp, (int64_t)n * hp->dim))
        return LAYER_BACKEND_FAILED;

    /* feed-forward block: down(silu(gate(x)) * up(x)) */
    const weight *gu[2] = {&L->w_gate, &L->w_up};
    float *gu_out[2] = {f->gate, f->up};
    if (backend_rmsnorm(b, st->x, L->ffn_norm, f->xn, n, hp->dim, hp->norm_eps) ||
        matmul_group(b, 2, gu, f->xn, n, gu_out) ||
        backend_swiglu(b, f->gate, f->up, f->gate, (int64_t)n * hp->ffn_dim) ||
        backend_matmul(b, &L->w_down, f->gate, n, f->tmp) ||
        backend_add(b, st->x, f->tmp, (int64_t)n * hp->dim))
        return LAYER_BACKEND_FAILED;
    return LAYER_OK;
}

/* ---------------------------------------------------------------- the pass */

/* The batch's token ids, positions and block tables (host), uploaded at once with the rows.
 * Tables lie back to back, or table_stride entries apart (a recorded step: their addresses then
 * depend on the key alone). */
static int upload_batch(forward_ctx *f, const batch_seq *seqs, int n_seqs, int n_total,
                        int32_t table_stride, kv_error *err) {
    forward_state *st = &f->st;
    int bt = kv_pool_layout(f->pool)->block_tokens;
    int32_t *ids = f->meta, *pos = ids + n_total, *rows = pos + n_total, *slot = rows + n_total,
            *tables = slot + n_total;
    int t = 0, n_table = 0;
    for (int s = 0; s < n_seqs; s++) {
        const batch_seq *bs = &seqs[s];
        int nb = (bs->kv_start + bs->n_tok + bt - 1) / bt;
        if (table_stride) n_table = s * table_stride; /* graph_table_stride checked the room */
        if (nb > f->max_table - n_table)
            return kv_fail(err, "the batch's block tables exceed %d entries", f->max_table);
        f->table_off[s] = n_table;
        memcpy(tables + n_table, bs->seq->blocks, sizeof(int32_t) * nb);
        n_table += nb;
        for (int i = 0; i < bs->n_tok; i++, t++) {
            f->tok_seq[t] = s;
            f->tok_slot[t] = bs->kv_start + i;
            ids[t] = bs->tokens[i];
            pos[t] = bs->pos[i];
            st->rows[t] = rows[t] = t;
            st->row_slot[t] = slot[t] = f->tok_slot[t];
        }
    }
    st->n_rows = n_total;
    f->d_ids = f->d_meta, f->d_pos = f->d_ids + n_total, st->d_rows = f->d_pos + n_total;
    st->d_row_slot = st->d_rows + n_total, f->d_tables = st->d_row_slot + n_total;
    if (backend_upload(f->b, f->d_meta, f->meta, sizeof(int32_t) * (4 * (size_t)n_total + n_table)))
        return kv_fail(err, "uploading the batch failed");
    return 0;
}

/* The final norm and the output matmul for rows idx[0..n_out) of the hidden state, into the
 * caller's host logits: straight there when backend memory is host memory, else LOGIT_ROWS rows
 * at a time through backend memory. */
static int compute_logits(forward_ctx *f, int n_out, float *logits) {
    const model_hparams *hp = &f->m->hp;
    backend *b = f->b;
    forward_state *st = &f->st;
    if (backend_upload(b, st->d_keep, f->keep, sizeof(int32_t) * n_out) ||
        backend_gather_rows(b, f->tmp, st->x, st->d_keep, n_out, hp->dim) ||
        backend_rmsnorm(b, f->tmp, f->output_norm, f->xn, n_out, hp->dim, hp->norm_eps))
        return -1;
    if (!f->d_logits) return backend_matmul(b, &f->output, f->xn, n_out, logits);
    for (int r = 0; r < n_out; r += LOGIT_ROWS) {
        int n = n_out - r < LOGIT_ROWS ? n_out - r : LOGIT_ROWS;
        size_t bytes = sizeof(float) * (size_t)n * hp->n_vocab;
        if (backend_matmul(b, &f->output, f->xn + (size_t)r * hp->dim, n, f->d_logits) ||
            backend_download(b, logits + (size_t)r * hp->n_vocab, f->d_logits, bytes))
            return -1;
    }
    return 0;
}

/* ---------------------------------------------------------------- recorded steps */

/* A decode step of the continuous batch is recorded once per shape and replayed
 * (backend_graph_begin): one token per sequence, all of them decode rows or none (whether
 * attention may split keys), no hook between layers (hooks read rows on the host). Its ops'
 * arguments then depend on the sequences' count, the tables' stride and the decode flag alone
 * (a pass starts from the same row and query buffers, model_forward); tables lie a power-of-two
 * stride apart (at least the longest table), so a table that grows a block keeps its address
 * and a stride lasts a doubling of the context. Returns the stride, or 0 where the step runs
 * directly. */
static int32_t graph_table_stride(const forward_ctx *f, const batch_seq *seqs, int n_seqs,
                                  const forward_hooks *hooks) {
    if (hooks && (hooks->before_layer || hooks->after_kv || hooks->after_layer)) return 0;
    if (!backend_graphs(f->b)) return 0;
    const int bt = kv_pool_layout(f->pool)->block_tokens;
    int32_t max_nb = 1, stride = 16;
    for (int s = 0; s < n_seqs; s++) {
        if (seqs[s].n_tok != 1 || seqs[s].decode != seqs[0].decode) return 0;
        int32_t nb = (seqs[s].kv_start + 1 + bt - 1) / bt;
        max_nb = nb > max_nb ? nb : max_nb;
    }
    while (stride < max_nb) stride *= 2;
    return (int64_t)stride * n_seqs <= f->max_table ? stride : 0;
}

/* What a recorded step's ops depend on besides the context (the key's owner). */
typedef struct graph_key {
    int32_t n_seqs;
    int32_t table_stride;
    int32_t decode; /* every row's batch_seq.decode (attention may split its keys) */
} graph_key;

/* Embeds the batch's tokens, every layer's RoPE angles, then the layers. */
static int forward_layers(forward_ctx *f, const batch_seq *seqs, int n_seqs, int n_total,
                          const forward_hooks *hooks, kv_error *err) {
    const model_hparams *hp = &f->m->hp;
    forward_state *st = &f->st;
    if (backend_embed(f->b, &f->tok_embd, f->d_ids, n_total, st->x) ||
        backend_rope_angles(f->b, &f->rope, f->d_pos, n_total, f->tok_cs))
        return kv_fail(err, "embedding the batch failed");

    for (int il = 0; il < hp->n_layer; il++) {
        if (hooks && hooks->before_layer && hooks->before_layer(hooks->ud, st, il) != 0)
            return kv_fail(err, "forward aborted by a hook before layer %d", il);
        /* A failed layer leaves this batch's KV slots undefined: the sequences' lengths are
         * not advanced, so nothing reads them as valid. */
        layer_result rc = st->n_rows > 0 ? layer_forward(f, seqs, n_seqs, il, hooks) : LAYER_OK;
        if (rc == LAYER_HOOK_ABORTED)
            return kv_fail(err, "forward aborted by a hook in layer %d", il);
        if (rc == LAYER_BACKEND_FAILED)
            return kv_fail(err, "the backend failed in layer %d of the forward pass", il);
        if (hooks && hooks->after_layer && hooks->after_layer(hooks->ud, st, il) != 0)
            return kv_fail(err, "forward aborted by a hook after layer %d", il);
    }
    return 0;
}

int model_forward(forward_ctx *f, const batch_seq *seqs, int n_seqs, const forward_hooks *hooks,
                  float *logits, kv_error *err) {
    int n_total = 0;
    if (validate_batch(f, seqs, n_seqs, &n_total, err)) return -1;

    /* flatten the batch and upload it; then the step: directly, or recorded, or replayed */
    forward_state *st = &f->st;
    /* a pass starts from the same buffers whatever keep_rows left (their contents are
     * rewritten), so a recorded step's key does not depend on what the last pass dropped */
    float *t;
    if ((uintptr_t)st->x > (uintptr_t)st->x_alt) t = st->x, st->x = st->x_alt, st->x_alt = t;
    if ((uintptr_t)st->q > (uintptr_t)st->q_alt) t = st->q, st->q = st->q_alt, st->q_alt = t;
    const int32_t stride = graph_table_stride(f, seqs, n_seqs, hooks);
    if (upload_batch(f, seqs, n_seqs, n_total, stride, err)) return -1;
    backend_graph_mode mode = BACKEND_GRAPH_DIRECT;
    if (stride) {
        graph_key key;
        memset(&key, 0, sizeof key);
        key.n_seqs = n_seqs, key.table_stride = stride, key.decode = seqs[0].decode;
        mode = backend_graph_begin(f->b, f, &key, sizeof key);
    }
    int rc =
        mode == BACKEND_GRAPH_REPLAY ? 0 : forward_layers(f, seqs, n_seqs, n_total, hooks, err);
    if (mode != BACKEND_GRAPH_DIRECT && backend_graph_end(f->b)) {
        if (mode == BACKEND_GRAPH_REPLAY) return kv_fail(err, "replaying a decode step failed");
        rc = forward_layers(f, seqs, n_seqs, n_total, hooks, err); /* nothing of it ran */
    }
    if (rc) return -1;

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
            if (seqs[s].all_logits || st->rows[r] == t_last) f->keep[n_out++] = r;
        t_first += seqs[s].n_tok;
    }
    if (n_out == 0 || !logits) return n_out;
    if (compute_logits(f, n_out, logits)) return kv_fail(err, "the backend failed on the logits");
    return n_out;
}
