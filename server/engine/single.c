/* The single-sequence engine (single.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/engine/single.h"

int engine_simd_apply(const char *name, kv_error *err) {
    simd_level want;
    if (!name) name = "auto";
    if (simd_level_from_name(name, &want) != 0)
        return kv_fail(err, "simd: '%s' is not auto, avx512, avx2 or scalar", name);
    simd_level got = simd_level_set(want);
    if (got != want)
        log_warn("simd %s: this CPU runs %s at most; using %s", name, simd_level_name(got),
                 simd_level_name(got));
    return 0;
}

int engine_single_load(engine_single *e, const engine_model_opts *o, kv_error *err) {
    memset(e, 0, sizeof *e);
    kv_seq_init(&e->seq);
    e->threads = o->threads;
    e->precise = o->precise;
    e->device = o->device ? o->device : "cpu";
    if (engine_simd_apply(o->simd, err) != 0) return -1;
    model_load_opts lo = {.chat_template = o->chat_template};
    return (e->m = model_load(o->path, &lo, err)) ? 0 : -1;
}

int engine_single_start(engine_single *e, int ctx, kv_error *err) {
    const model *m = e->m;
    e->ctx = ctx;
    if (!(e->b = backend_create(e->device, e->threads, err))) return -1;
    backend_set_precision(e->b, e->precise ? MATMUL_PRECISION_F32 : MATMUL_PRECISION_Q8);
    /* Round the pool up to whole blocks so ctx slots always fit. */
    if (!(e->pool = kv_pool_create(e->b, m, ((int64_t)ctx + 15) / 16 * 16, 16, err))) return -1;
    if (!(e->fwd = forward_ctx_create(m, e->b, e->pool, ENGINE_SLICE, 1, err))) return -1;
    if (!(e->logits = malloc(sizeof(float) * (size_t)m->hp.n_vocab)))
        return kv_fail(err, "out of memory");
    log_info("model %s: %d layers, %.1f MiB of weights mapped from %s; backend %s, %d threads, "
             "SIMD %s, %s matmuls; KV pool %lld tokens (%.1f MiB)",
             m->name, m->hp.n_layer, model_weight_bytes(m) / 1048576.0, m->path, backend_name(e->b),
             e->threads, simd_level_name(simd_level_get()), e->precise ? "f32" : "8-bit activation",
             (long long)(kv_pool_total_blocks(e->pool) * kv_pool_layout(e->pool)->block_tokens),
             kv_pool_total_blocks(e->pool) * kv_layout_block_bytes(kv_pool_layout(e->pool)) /
                 1048576.0);
    return 0;
}

void engine_single_free(engine_single *e) {
    if (e->pool) kv_seq_release(e->pool, &e->seq);
    forward_ctx_destroy(e->fwd);
    kv_pool_destroy(e->pool);
    backend_destroy(e->b);
    free(e->logits);
    free(e->rows);
    model_free(e->m);
    memset(e, 0, sizeof *e);
}

static int forward_slices(engine_single *e, const int32_t *ids, int n, bool decode, kv_error *err) {
    int32_t pos[ENGINE_SLICE];
    if (e->seq.n_tokens + n > e->ctx)
        return kv_fail(err, "%d tokens do not fit the context of %d (%d in use)", n, e->ctx,
                       e->seq.n_tokens);
    for (int done = 0; done < n;) {
        int len = n - done < ENGINE_SLICE ? n - done : ENGINE_SLICE;
        int start = e->seq.n_tokens;
        if (kv_seq_reserve(e->pool, &e->seq, start + len, err)) return -1;
        for (int i = 0; i < len; i++) pos[i] = start + i;
        batch_seq bs = {.seq = &e->seq,
                        .n_tok = len,
                        .tokens = ids + done,
                        .pos = pos,
                        .kv_start = start,
                        .decode = decode};
        if (model_forward(e->fwd, &bs, 1, e->hooks, e->logits, err) < 0) return -1;
        done += len;
    }
    return 0;
}

int engine_single_prefill(engine_single *e, const int32_t *ids, int n, kv_error *err) {
    return forward_slices(e, ids, n, false, err);
}

int engine_single_decode(engine_single *e, int32_t id, kv_error *err) {
    return forward_slices(e, &id, 1, true, err);
}

int engine_single_write_kv(engine_single *e, int n, int chunk, const float *kv, kv_error *err) {
    const kv_layout *lay = kv_pool_layout(e->pool);
    size_t nc = (size_t)lay->n_kv_head * (size_t)lay->head_dim;
    size_t ce = (size_t)lay->n_layer * 2 * (size_t)chunk * nc;
    kv_seq_truncate(e->pool, &e->seq, 0);
    if (n > e->ctx) return kv_fail(err, "%d tokens do not fit the context of %d", n, e->ctx);
    if (kv_seq_reserve(e->pool, &e->seq, n, err)) return -1;
    int32_t *slots = malloc(sizeof(int32_t) * (size_t)chunk);
    if (!slots) return kv_fail(err, "out of memory");
    for (int k = 0; k * chunk < n; k++) {
        int len = n - k * chunk < chunk ? n - k * chunk : chunk;
        for (int t = 0; t < len; t++) slots[t] = k * chunk + t;
        for (int l = 0; l < lay->n_layer; l++) {
            const float *base = kv + (size_t)k * ce + (size_t)l * 2 * (size_t)chunk * nc;
            backend_kv_store(e->b, kv_pool_memory(e->pool), lay, l, e->seq.blocks, slots, len, base,
                             base + (size_t)chunk * nc);
        }
    }
    free(slots);
    e->seq.n_tokens = n;
    return 0;
}

int engine_single_rows(engine_single *e, const int32_t *tokens, int from, int to, engine_row_fn fn,
                       void *ud, kv_error *err) {
    size_t n_vocab = (size_t)e->m->hp.n_vocab;
    int32_t pos[ENGINE_ROWS];
    if (to > e->ctx) return kv_fail(err, "%d tokens do not fit the context of %d", to, e->ctx);
    if (!e->rows && !(e->rows = malloc(sizeof(float) * ENGINE_ROWS * n_vocab)))
        return kv_fail(err, "out of memory");
    kv_seq_truncate(e->pool, &e->seq, from);
    for (int s = from; s < to; s += ENGINE_ROWS) {
        int len = to - s < ENGINE_ROWS ? to - s : ENGINE_ROWS;
        if (kv_seq_reserve(e->pool, &e->seq, s + len, err)) return -1;
        for (int i = 0; i < len; i++) pos[i] = s + i;
        batch_seq bs = {.seq = &e->seq,
                        .n_tok = len,
                        .tokens = tokens + s,
                        .pos = pos,
                        .kv_start = s,
                        .all_logits = true};
        if (model_forward(e->fwd, &bs, 1, NULL, e->rows, err) != len) return -1;
        for (int i = 0; i < len; i++)
            if (fn(ud, s + i - from, e->rows + (size_t)i * n_vocab))
                return kv_fail(err, "stopped at row %d", s + i - from);
    }
    return 0;
}

void engine_single_reset(engine_single *e) { kv_seq_truncate(e->pool, &e->seq, 0); }

int engine_single_read_kv(engine_single *e, int n_chunks, int chunk, float *out, kv_error *err) {
    const kv_layout *l = kv_pool_layout(e->pool);
    size_t row = (size_t)chunk * (size_t)l->n_kv_head * (size_t)l->head_dim;
    int32_t *slots = malloc(sizeof(int32_t) * (size_t)chunk);
    if (!slots) return kv_fail(err, "out of memory");
    for (int k = 0; k < n_chunks; k++) {
        for (int t = 0; t < chunk; t++) slots[t] = k * chunk + t;
        for (int layer = 0; layer < l->n_layer; layer++)
            for (int kv = 0; kv < 2; kv++) {
                float *dst =
                    out + (((size_t)k * (size_t)l->n_layer + (size_t)layer) * 2 + kv) * row;
                backend_kv_load(e->b, kv_pool_memory(e->pool), l, layer, kv, e->seq.blocks, slots,
                                chunk, dst);
            }
    }
    free(slots);
    return 0;
}
