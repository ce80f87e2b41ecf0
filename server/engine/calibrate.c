/* The CacheGen codec's table for a model, calibrated from the model's own KV (calibrate.h).
 *
 * The calibration text is a file, or, by default, text the model writes itself: a seeded sample
 * (temperature 0.8) continued from a few opening lines, with end-of-generation tokens banned so
 * it runs to the requested length. The model's own text needs no corpus in the repository and
 * follows the model's distribution; the table is deterministic for a model and seed. The KV of
 * the text (one sequence, positions 0..n-1) is cut into chunks of co->chunk tokens. */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/codec/codec.h"
#include "model/model.h"
#include "model/sampler.h"
#include "server/engine/calibrate.h"

static const char CALIB_OPENING[] =
    "The following is a collection of short pieces: a news report, a recipe, a letter to a "
    "friend, notes from a science lecture, a story for children and a conversation between "
    "two colleagues about a software project.\n\nPart 1.\n";

/* The model's own text: n tokens in ids (prefilled into e as they are written). */
static int self_text(engine_single *e, int32_t *ids, int n, uint64_t seed, kv_error *err) {
    const model *m = e->m;
    int32_t *open = NULL;
    int n_open = tokenizer_encode(m->tok, CALIB_OPENING, strlen(CALIB_OPENING),
                                  tokenizer_add_bos(m->tok), false, &open, err);
    if (n_open < 0) return -1;
    if (n_open >= n) n_open = n - 1;
    memcpy(ids, open, sizeof(int32_t) * (size_t)n_open);
    free(open);
    /* End-of-generation tokens are banned so the text runs on. */
    int n_vocab = m->hp.n_vocab, n_ban = 0;
    logit_bias *ban = malloc(sizeof *ban * (size_t)n_vocab);
    if (!ban) return kv_fail(err, "out of memory");
    for (int32_t t = 0; t < n_vocab; t++)
        if (tokenizer_is_eog(m->tok, t)) ban[n_ban++] = (logit_bias){t, -INFINITY};
    sampler_params sp;
    sampler_params_default(&sp);
    sp.temperature = 0.8f;
    sp.top_p = 0.95f;
    sp.repeat_penalty = 1.1f;
    sp.repeat_last_n = 256;
    sp.seed = seed;
    sp.bias = ban;
    sp.n_bias = n_ban;
    sampler *smp = sampler_create(&sp, n_vocab, err);
    int rc = -1;
    if (!smp || engine_single_prefill(e, ids, n_open, err)) goto done;
    for (int i = n_open; i < n; i++) {
        ids[i] = sampler_sample(smp, e->logits, ids, i, NULL);
        /* The last token's KV is needed too: every token is prefilled. */
        if (engine_single_decode(e, ids[i], err)) goto done;
    }
    rc = 0;
done:
    sampler_destroy(smp);
    free(ban);
    return rc;
}

/* ---------------------------------------------------------------- channel importance */

/* How much a unit of error in each KV channel costs (codec_table_calibrate's weight), from the
 * model itself. K: an error e in key channel c moves the attention logit of query q by q_c e,
 * so its cost is the mean energy of the queries that read c (the query heads of its group),
 * measured on the calibration text; RoPE pairs channels (2i, 2i+1) and rotates their energy
 * between them with position, so both get the pair's mean. V: an error e in value channel c
 * reaches the residual stream through the output projection's column of c in each query head
 * of its group, so its cost is those columns' squared norm. */
typedef struct importance {
    const model *m;
    backend *b;
    double *q_energy; /* [n_layer][n_head * head_dim] sum of q^2 over the rows seen */
    double *q_sum;    /* [n_layer][n_head * head_dim] sum of q (before RoPE) */
    double rows;      /* per layer */
    float *xn, *q;    /* scratch [ENGINE_SLICE][dim], [ENGINE_SLICE][n_head * head_dim] */
} importance;

static int importance_before_layer(void *ud, forward_state *st, int layer) {
    importance *im = ud;
    const model_hparams *hp = &im->m->hp;
    const layer_weights *L = &im->m->layers[layer];
    int n = forward_state_n_rows(st), qd = hp->n_head * hp->head_dim;
    if (n < 1) return 0;
    backend_rmsnorm(im->b, forward_state_hidden(st, 0), L->attn_norm, im->xn, n, hp->dim,
                    hp->norm_eps);
    if (backend_matmul(im->b, &L->wq, im->xn, n, im->q)) return -1;
    double *acc = im->q_energy + (size_t)layer * qd;
    for (int r = 0; r < n; r++)
        for (int i = 0; i < qd; i++) {
            double v = im->q[(size_t)r * qd + i];
            acc[i] += v * v;
            im->q_sum[(size_t)layer * qd + i] += v;
        }
    if (layer == 0) im->rows += n;
    return 0;
}

/* weight[layer][kv][kv_head * head_dim + d] from the query energies and the output projection
 * (its columns read as W_o times one-hot rows, which any weight format computes exactly). */
static int importance_weights(importance *im, float *out, kv_error *err) {
    const model_hparams *hp = &im->m->hp;
    const int hd = hp->head_dim, nkv = hp->n_kv_head, group = hp->n_head / hp->n_kv_head;
    const int qd = hp->n_head * hd, nc = nkv * hd;
    if (im->rows < 1) return kv_fail(err, "calibrate: no query rows were seen");
    float *onehot = calloc((size_t)ENGINE_SLICE * qd, sizeof *onehot);
    float *cols = malloc(sizeof(float) * (size_t)ENGINE_SLICE * hp->dim);
    double *col_sq = malloc(sizeof(double) * (size_t)qd);
    if (!onehot || !cols || !col_sq) {
        free(onehot);
        free(cols);
        free(col_sq);
        return kv_fail(err, "out of memory");
    }
    int rc = 0;
    for (int l = 0; l < hp->n_layer && !rc; l++) {
        for (int c0 = 0; c0 < qd && !rc; c0 += ENGINE_SLICE) {
            int n = qd - c0 < ENGINE_SLICE ? qd - c0 : ENGINE_SLICE;
            memset(onehot, 0, sizeof(float) * (size_t)n * qd);
            for (int r = 0; r < n; r++) onehot[(size_t)r * qd + c0 + r] = 1.0f;
            if (backend_matmul(im->b, &im->m->layers[l].wo, onehot, n, cols)) {
                rc = kv_fail(err, "calibrate: output projection of layer %d failed", l);
                break;
            }
            for (int r = 0; r < n; r++) {
                double s = 0;
                for (int i = 0; i < hp->dim; i++) {
                    double v = cols[(size_t)r * hp->dim + i];
                    s += v * v;
                }
                col_sq[c0 + r] = s;
            }
        }
        const double *qe = im->q_energy + (size_t)l * qd;
        float *wk = out + (size_t)l * 2 * nc, *wv = wk + nc;
        for (int h = 0; h < nkv; h++)
            for (int d = 0; d < hd; d++) {
                double k = 0, v = 0;
                for (int g = 0; g < group; g++) {
                    const int qh = (h * group + g) * hd;
                    int pair = d & ~1;
                    k += d < hp->n_rot ? (qe[qh + pair] + qe[qh + pair + 1]) / 2 : qe[qh + d];
                    v += col_sq[qh + d];
                }
                wk[h * hd + d] = (float)(k / im->rows);
                wv[h * hd + d] = (float)v;
            }
        /* A channel nothing reads still needs a finite step: floor at 1e-6 of the mean. */
        for (int kv = 0; kv < 2; kv++) {
            float *w = wk + (size_t)kv * nc;
            double mean = 0;
            for (int c = 0; c < nc; c++) mean += w[c];
            mean /= nc;
            for (int c = 0; c < nc; c++)
                if (!(w[c] > 1e-6 * mean)) w[c] = (float)(1e-6 * mean > 0 ? 1e-6 * mean : 1e-30);
        }
    }
    free(onehot);
    free(cols);
    free(col_sq);
    return rc;
}

/* The levels from --bins: one level per bin, from near-lossless to aggressive, in units of each
 * channel's step unit (importance-weighted: codec_table_calibrate), the same for every layer and
 * for K and V (the units already carry the weighting; on SmolLM2 a ramp with depth lost more
 * quality than it saved bits, and bins scaled by each layer's measured sensitivity, the KL
 * divergence of held-out predictions when that layer's K or V alone is coarsened, did no
 * better than uniform ones: the sensitivities span only 4x once heavy hitters are kept exact
 * and keys are coded before RoPE). Group 0 by default: every token is coded against its channel's
 * centre with the channel's own model. On SmolLM2, deltas to an anchor cost more bits than that
 * at the same error (+14% at group 10: nearby tokens' KV is not close enough to beat the
 * channel's distribution); --group takes CacheGen's anchors and deltas, anchors at the same bin.
 * Fills layer 0's bins (the caller copies them to every layer). */
static int parse_bins(const char *arg, int group, codec_level *lv, int *n_levels, kv_error *err) {
    int n = 0;
    const char *p = arg;
    while (*p) {
        char *end;
        errno = 0;
        double b = strtod(p, &end);
        if (end == p || errno || !(b > 0) || !isfinite(b) || b > 1e4 || (*end && *end != ','))
            return kv_fail(err, "--bins: '%s' is not a comma-separated list of positive bins", arg);
        if (n == CODEC_MAX_LEVELS)
            return kv_fail(err, "--bins: at most %d levels", CODEC_MAX_LEVELS);
        if (n > 0 && b <= lv[n - 1].delta_bin[0][0])
            return kv_fail(err, "--bins: levels go from fine to coarse (%s)", arg);
        memset(&lv[n], 0, sizeof lv[n]);
        lv[n].group = group;
        lv[n].anchor_bin[0][0] = lv[n].anchor_bin[0][1] = (float)b;
        lv[n].delta_bin[0][0] = lv[n].delta_bin[0][1] = (float)b;
        n++;
        p = *end ? end + 1 : end;
    }
    if (!n) return kv_fail(err, "--bins: no levels given");
    *n_levels = n;
    return 0;
}

int calibrate_codec_table(const engine_model_opts *mo, const calib_opts *co, codec_table *table,
                          int *n_chunks_out, kv_error *err) {
    int rc = -1;
    engine_single e = {0};
    char *text = NULL;
    int32_t *ids = NULL;
    float *kv = NULL, *imp = NULL, *qmean = NULL;
    importance im = {0};
    codec_level levels[CODEC_MAX_LEVELS];
    int n_levels = 0, n_tokens = co->n_tokens, chunk = co->chunk;
    memset(table, 0, sizeof *table);
    if (parse_bins(co->bins, co->group, levels, &n_levels, err)) goto done;
    if (engine_single_load(&e, mo, err)) goto done;
    const model *m = e.m;
    if (n_tokens > m->hp.n_ctx_train) n_tokens = m->hp.n_ctx_train;
    if (engine_single_start(&e, n_tokens, err)) goto done;
    const model_hparams *hp = &m->hp;
    const forward_hooks hooks = {.ud = &im, .before_layer = importance_before_layer};
    im.m = m;
    im.b = e.b;
    im.q_energy = calloc((size_t)hp->n_layer * hp->n_head * hp->head_dim, sizeof(double));
    im.q_sum = calloc((size_t)hp->n_layer * hp->n_head * hp->head_dim, sizeof(double));
    im.xn = malloc(sizeof(float) * ENGINE_SLICE * (size_t)hp->dim);
    im.q = malloc(sizeof(float) * ENGINE_SLICE * (size_t)hp->n_head * hp->head_dim);
    if (!im.q_energy || !im.q_sum || !im.xn || !im.q) goto oom;
    e.hooks = &hooks;
    int n = n_tokens;
    if (co->text_path) {
        int32_t *tok = NULL;
        if (!(text = kv_read_file(co->text_path, SIZE_MAX, NULL, err))) goto done;
        int nt = tokenizer_encode(m->tok, text, strlen(text), tokenizer_add_bos(m->tok), false,
                                  &tok, err);
        if (nt < 0) goto done;
        if (nt < chunk) {
            free(tok);
            kv_fail(err, "%s has %d tokens; calibration needs at least one chunk (%d)",
                    co->text_path, nt, chunk);
            goto done;
        }
        if (nt < n) n = nt;
        ids = tok;
        if (engine_single_prefill(&e, ids, n, err)) goto done;
    } else {
        if (!(ids = malloc(sizeof *ids * (size_t)n))) goto oom;
        log_info("calibrate: the model writes %d tokens of calibration text", n);
        if (self_text(&e, ids, n, co->seed, err)) goto done;
    }

    /* The KV as f32 [chunk][layer][kv][token][channel]. */
    int n_chunks = n / chunk, nl = m->hp.n_layer;
    int nc = m->hp.n_kv_head * m->hp.head_dim;
    size_t chunk_elems = (size_t)nl * 2 * (size_t)chunk * (size_t)nc;
    if (!(kv = malloc(sizeof(float) * chunk_elems * (size_t)n_chunks))) goto oom;
    if (engine_single_read_kv(&e, n_chunks, chunk, kv, err)) goto done;

    if (!(imp = malloc(sizeof(float) * (size_t)nl * 2 * (size_t)nc))) goto oom;
    if (importance_weights(&im, imp, err)) goto done;
    for (int v = 0; v < n_levels; v++) /* parse_bins filled layer 0 */
        for (int l = 1; l < nl; l++)
            for (int k = 0; k < 2; k++)
                levels[v].anchor_bin[l][k] = levels[v].delta_bin[l][k] = levels[v].delta_bin[0][0];
    if (codec_table_init(table, m->identity, nl, nc, levels, n_levels, err)) goto done;
    /* the mean query of each layer and head, before RoPE; the table also takes the RoPE from
     * here, to code K before it (margin 0: no heavy hitters) */
    size_t n_q = (size_t)nl * hp->n_head * hp->head_dim;
    if (!(qmean = malloc(sizeof(float) * n_q))) goto oom;
    for (size_t i = 0; i < n_q; i++) qmean[i] = (float)(im.q_sum[i] / im.rows);
    if (codec_table_set_attention(table, hp->n_head, hp->head_dim, m->rope.n_rot, m->rope.inv_freq,
                                  qmean, co->margin, err))
        goto done;
    if (codec_table_calibrate(table, kv, n_chunks, chunk, co->sd_units ? NULL : imp, err))
        goto done;
    log_info("calibrate: %d chunks of %d tokens (%d layers, %d KV channels, %d levels)", n_chunks,
             chunk, nl, nc, n_levels);
    if (n_chunks_out) *n_chunks_out = n_chunks;
    rc = 0;
    goto done;
oom:
    kv_fail(err, "out of memory");
done:
    if (rc) codec_table_free(table);
    free(imp);
    free(qmean);
    free(im.q_energy);
    free(im.q_sum);
    free(im.xn);
    free(im.q);
    free(kv);
    free(ids);
    free(text);
    engine_single_free(&e);
    return rc;
}
