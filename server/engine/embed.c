/* Embeddings: an embedding request's prompt rows after the last layer, normed as the logits see
 * them, pooled (mean, last or first token) into the sequence's vector while the prompt is
 * computed, then L2-normalized into the request. The step loop (sched.c) calls in. */
#include <math.h>

#include "server/engine/engine_impl.h"

/* After the last layer: each embedding sequence's rows, normed with the output norm as the
 * logits see them, are summed (mean), or its last (last) or first (cls) prompt row kept. */
int embed_pool_hidden(void *ud, forward_state *st, int layer) {
    engine *e = ud;
    const model_hparams *hp = &e->m->hp;
    if (layer != hp->n_layer - 1) return 0;
    int n = forward_state_n_rows(st);
    const int32_t *rows = forward_state_rows(st);
    for (int r = 0; r < n; r++) {
        /* the row's batch entry: tokens are flattened in batch order */
        int tok = rows[r], b = 0;
        while (b < e->n_batch && tok >= e->batch[b].n_tok) tok -= e->batch[b++].n_tok;
        if (b >= e->n_batch) continue;
        eseq *s = e->batch_seqs[b];
        gen_pooling how = s->req->pooling;
        int slot = e->batch[b].kv_start + tok;
        if (how == GEN_POOL_NONE || (how == GEN_POOL_CLS && slot != 0) ||
            (how == GEN_POOL_LAST && slot != s->n_hist - 1))
            continue;
        const float *h = forward_state_hidden(st, r);
        double ss = 0;
        for (int k = 0; k < hp->dim; k++) ss += (double)h[k] * h[k];
        double scale = 1.0 / sqrt(ss / hp->dim + hp->norm_eps);
        for (int k = 0; k < hp->dim; k++)
            s->pooled[k] += (double)h[k] * scale * e->m->output_norm[k];
    }
    return 0;
}

/* The prompt is computed: the pooled vector is normalized (L2) into the request and the choice
 * ends, releasing its KV. */
void embed_finish(engine *e, eseq *s) {
    gen_request *r = s->req;
    int dim = e->m->hp.dim;
    double norm = 0;
    for (int k = 0; k < dim; k++) norm += s->pooled[k] * s->pooled[k];
    norm = norm > 0 ? 1.0 / sqrt(norm) : 0;
    pthread_mutex_lock(&r->mu);
    for (int k = 0; k < dim; k++) r->embedding[k] = (float)(s->pooled[k] * norm);
    pthread_mutex_unlock(&r->mu);
    eseq_finish(e, s, GEN_FINISH_STOP, 0, NULL);
}
