/* The CUDA backend's speed against the device's limits (make bench-gpu), on a synthesized model
 * of Llama 3 8B's shape (dim 4096, 32 layers, 32/8 heads of 128, FFN 14336, vocabulary 128256;
 * Q4_K weights and a Q6_K output, as a Q4_K_M file has them; random codes, so the text is
 * noise and the speed is real):
 *   decode tokens/s at batch 1 and 32, against the bandwidth roofline (the weights read once per
 *     step at the device's measured copy bandwidth); at batch 1 also with the steps' kernels
 *     launched one by one, and the speed-up of replaying them as CUDA graphs;
 *   prefill tokens/s of a 2048-token prompt, against the measured f16 GEMM rate (the backend's
 *     own F16 matmul of 4096 x 4096 x 2048, which is cuBLAS GemmEx on tensor cores);
 *   prefill attention of 2048 rows alone, the tensor-core kernel against the warp kernel on the
 *     same rows (attention_times), as a ratio;
 *   prefill-shaped matmuls on the int8 tensor-core tiles against dequantized tiles and cuBLAS,
 *     16 to 2048 rows: the crossover between the two.
 * `gpu_bench --probe` only says whether a usable CUDA device is there (exit 0) or why not (1):
 * make test-gpu and bench-gpu skip, visibly, without one.
 *
 *   make bench-gpu        (or: build/gpu_bench [--layers N] [--steps N])
 */
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/model.h"

typedef struct synth {
    model m;
    uint8_t **blobs; /* every weight's host bytes */
    int n_blobs;
    float *norms; /* [2 n_layer + 1][dim] ones */
    float inv_freq[64];
} synth;

static uint64_t g_state = 0x2545f4914f6cdd1dull;
static uint64_t next64(void) {
    g_state ^= g_state << 13;
    g_state ^= g_state >> 7;
    g_state ^= g_state << 17;
    return g_state;
}

/* An n_out x n_in matrix of type t: random codes with small positive scales in every block's d
 * (and dmin, or a Q4_1/Q5_1 min); NULL when out of memory. */
static uint8_t *random_blocks(tensor_type t, int64_t n_in, int64_t n_out) {
    const tensor_type_traits *tr = tensor_type_get((int)t);
    size_t bytes = tensor_row_size(t, n_in) * (size_t)n_out;
    uint8_t *p = malloc(bytes);
    if (!p) return NULL;
    uint64_t *q = (uint64_t *)p;
    for (size_t i = 0; i < bytes / 8; i++) q[i] = next64();
    uint16_t d = fp32_to_fp16(0.002f), dmin = fp32_to_fp16(0.001f);
    for (size_t b = 0; b < bytes / tr->type_size; b++) {
        uint8_t *blk = p + b * tr->type_size;
        if (t == TENSOR_TYPE_Q6_K) {
            memcpy(blk + 208, &d, 2);
        } else {
            memcpy(blk, &d, 2);
            memcpy(blk + 2, &dmin, 2);
        }
    }
    return p;
}

static int synth_weight(synth *s, tensor_type t, int64_t n_in, int64_t n_out, weight *w) {
    uint8_t *p = random_blocks(t, n_in, n_out);
    if (!p) return -1;
    s->blobs[s->n_blobs++] = p;
    *w = (weight){t, n_in, n_out, tensor_row_size(t, n_in), p};
    return 0;
}

static int synth_create(synth *s, int n_layer) {
    memset(s, 0, sizeof *s);
    model_hparams *hp = &s->m.hp;
    *hp = (model_hparams){.n_vocab = 128256,
                          .n_ctx_train = 8192,
                          .dim = 4096,
                          .n_layer = n_layer,
                          .n_head = 32,
                          .n_kv_head = 8,
                          .head_dim = 128,
                          .ffn_dim = 14336,
                          .n_rot = 128,
                          .norm_eps = 1e-5f,
                          .rope_base = 500000.0f};
    s->m.name = "synthetic llama-3-8B shape";
    s->blobs = calloc((size_t)(9 * n_layer + 2), sizeof *s->blobs);
    s->m.layers = calloc((size_t)n_layer, sizeof *s->m.layers);
    s->norms = malloc(sizeof(float) * (size_t)(2 * n_layer + 1) * hp->dim);
    if (!s->blobs || !s->m.layers || !s->norms) return -1;
    for (int64_t i = 0; i < (int64_t)(2 * n_layer + 1) * hp->dim; i++) s->norms[i] = 1.0f;
    const tensor_type q = TENSOR_TYPE_Q4_K;
    int qd = hp->n_head * hp->head_dim, kvd = hp->n_kv_head * hp->head_dim;
    if (synth_weight(s, q, hp->dim, hp->n_vocab, &s->m.tok_embd) ||
        synth_weight(s, TENSOR_TYPE_Q6_K, hp->dim, hp->n_vocab, &s->m.output))
        return -1;
    s->m.output_norm = s->norms + (size_t)2 * n_layer * hp->dim;
    for (int l = 0; l < n_layer; l++) {
        layer_weights *L = &s->m.layers[l];
        L->attn_norm = s->norms + (size_t)2 * l * hp->dim;
        L->ffn_norm = s->norms + (size_t)(2 * l + 1) * hp->dim;
        if (synth_weight(s, q, hp->dim, qd, &L->wq) || synth_weight(s, q, hp->dim, kvd, &L->wk) ||
            synth_weight(s, q, hp->dim, kvd, &L->wv) || synth_weight(s, q, qd, hp->dim, &L->wo) ||
            synth_weight(s, q, hp->dim, hp->ffn_dim, &L->w_gate) ||
            synth_weight(s, q, hp->dim, hp->ffn_dim, &L->w_up) ||
            synth_weight(s, q, hp->ffn_dim, hp->dim, &L->w_down))
            return -1;
    }
    for (int i = 0; i < hp->n_rot / 2; i++)
        s->inv_freq[i] = (float)pow(hp->rope_base, -2.0 * i / hp->n_rot);
    s->m.rope = (rope_table){hp->n_rot, s->inv_freq};
    return 0;
}

static void synth_free(synth *s) {
    for (int i = 0; i < s->n_blobs; i++) free(s->blobs[i]);
    free(s->blobs);
    free(s->m.layers);
    free(s->norms);
}

/* Bytes a decode step reads: every layer's matrices and the output head. */
static double step_bytes(const synth *s) {
    double b = (double)s->m.output.row_bytes * s->m.output.n_out;
    for (int l = 0; l < s->m.hp.n_layer; l++) {
        const layer_weights *L = &s->m.layers[l];
        const weight *w[7] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down};
        for (int i = 0; i < 7; i++) b += (double)w[i]->row_bytes * w[i]->n_out;
    }
    return b;
}

/* Device copy bandwidth (read + write), GB/s: the decode roofline. */
static double copy_bandwidth(void) {
    size_t bytes = (size_t)1 << 30;
    void *a = NULL, *b = NULL;
    cudaEvent_t e0, e1;
    float ms = 0;
    if (cudaMalloc(&a, bytes) != cudaSuccess || cudaMalloc(&b, bytes) != cudaSuccess) return -1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice); /* warm-up */
    cudaEventRecord(e0, 0);
    for (int i = 0; i < 10; i++) cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice);
    cudaEventRecord(e1, 0);
    cudaEventSynchronize(e1);
    cudaEventElapsedTime(&ms, e0, e1);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaFree(a);
    cudaFree(b);
    return 10.0 * 2.0 * (double)bytes / (ms / 1e3) / 1e9;
}

/* The backend's F16 matmul (x 4096 -> 4096 for 2048 rows: cuBLAS GemmEx), TFLOP/s. */
static double gemm_rate(backend *b) {
    const int n = 4096, t = 2048;
    kv_error err = {{0}};
    uint16_t *w = malloc(sizeof(uint16_t) * n * n);
    if (!w) return -1;
    for (size_t i = 0; i < (size_t)n * n; i++) w[i] = fp32_to_fp16((float)(i % 13) * 0.01f);
    backend_limits lim = {
        .max_tokens = t, .max_seqs = 1, .max_n_in = n, .n_head = 1, .head_dim = 128};
    weight wt = {TENSOR_TYPE_F16, n, n, (size_t)n * 2, NULL};
    float *x = backend_alloc(b, sizeof(float) * (size_t)t * n);
    float *y = backend_alloc(b, sizeof(float) * (size_t)t * n);
    double best = -1;
    if (backend_reserve(b, &lim, &err) == 0 && x && y &&
        (wt.data = backend_weight_data(b, w, (size_t)n * n * 2, &err))) {
        for (int r = 0; r < 4; r++) {
            backend_sync(b);
            uint64_t t0 = clock_now_ns();
            if (backend_matmul(b, &wt, x, t, y) || backend_sync(b)) break;
            double s = (double)(clock_now_ns() - t0) / 1e9;
            double tf = 2.0 * n * (double)n * t / s / 1e12;
            if (r > 0 && tf > best) best = tf; /* the first run warms up */
        }
        backend_weight_release(b, w);
    }
    backend_free(b, x);
    backend_free(b, y);
    free(w);
    return best;
}

/* One weight's matmul over n_tok activation rows (at MATMUL_PRECISION_Q8 on quantized weights:
 * the int8 dot-product kernels up to 8 rows, the int8 tensor-core tiles beyond; at
 * MATMUL_PRECISION_F32 the f32 GEMV kernels up to 4, dequantized tiles through cuBLAS beyond):
 * the best of 5 timed runs of `reps` calls (after one to warm up), seconds per call; -1 on error.
 */
static double matmul_seconds(backend *b, const weight *host_w, int n_tok, int reps) {
    kv_error err = {{0}};
    weight w = *host_w;
    size_t bytes = w.row_bytes * (size_t)w.n_out;
    float *x = backend_alloc(b, sizeof(float) * (size_t)n_tok * w.n_in);
    float *y = backend_alloc(b, sizeof(float) * (size_t)n_tok * w.n_out);
    double best = -1;
    if (x && y && (w.data = backend_weight_data(b, host_w->data, bytes, &err))) {
        for (int r = 0; r < 6; r++) {
            backend_sync(b);
            uint64_t t0 = clock_now_ns();
            for (int i = 0; i < reps; i++)
                if (backend_matmul(b, &w, x, n_tok, y)) goto done;
            if (backend_sync(b)) goto done;
            double sec = (double)(clock_now_ns() - t0) / 1e9 / reps;
            if (r > 0 && (best < 0 || sec < best)) best = sec; /* the first run warms up */
        }
    done:
        backend_weight_release(b, host_w->data);
    }
    backend_free(b, x);
    backend_free(b, y);
    return best;
}

/* The same as the weight's bytes read per second, GB/s: the kernel alone against the copy
 * bandwidth. */
static double gemv_rate(backend *b, const weight *w, int n_tok) {
    const double sec = matmul_seconds(b, w, n_tok, 10);
    return sec > 0 ? (double)w->row_bytes * (double)w->n_out / sec / 1e9 : -1;
}

typedef struct engine {
    backend *b;
    kv_pool *pool;
    forward_ctx *f;
    kv_seq seq[32];
    float *logits;
} engine;

/* n_seqs sequences that hold ctx tokens each, then `steps` decode steps of all of them in one
 * batch: tokens/s. */
static double decode_rate(engine *e, const model *m, int n_seqs, int ctx, int steps) {
    kv_error err = {{0}};
    /* positions run past the context by the steps (at most 256) */
    int32_t tok[512 + 256], pos[512 + 256];
    if (ctx + steps > 512 + 256) return -1;
    for (int i = 0; i < 512 + 256; i++)
        tok[i] = (int32_t)(next64() % (uint64_t)m->hp.n_vocab), pos[i] = i;
    batch_seq bs[32];
    for (int s = 0; s < n_seqs; s++) {
        kv_seq_truncate(e->pool, &e->seq[s], 0);
        if (kv_seq_reserve(e->pool, &e->seq[s], ctx + steps, &err)) goto fail;
        bs[0] = (batch_seq){.seq = &e->seq[s], .n_tok = ctx, .tokens = tok, .pos = pos};
        if (model_forward(e->f, bs, 1, NULL, e->logits, &err) < 0) goto fail;
    }
    double best = 0;
    for (int r = 0; r < steps; r++) {
        for (int s = 0; s < n_seqs; s++)
            bs[s] = (batch_seq){.seq = &e->seq[s],
                                .n_tok = 1,
                                .tokens = tok + r,
                                .pos = pos + ctx + r,
                                .kv_start = ctx + r,
                                .decode = true};
        uint64_t t0 = clock_now_ns();
        if (model_forward(e->f, bs, n_seqs, NULL, e->logits, &err) < 0) goto fail;
        double tps = n_seqs / ((double)(clock_now_ns() - t0) / 1e9);
        best = r > 0 && tps > best ? tps : best; /* logits are downloaded: the step is done */
    }
    return best;
fail:
    fprintf(stderr, "gpu_bench: %s\n", err.msg);
    return -1;
}

static double prefill_rate(engine *e, const model *m, int n) {
    kv_error err = {{0}};
    int32_t *tok = malloc(sizeof(int32_t) * n), *pos = malloc(sizeof(int32_t) * n);
    double best = -1;
    if (!tok || !pos) goto done;
    for (int i = 0; i < n; i++) tok[i] = (int32_t)(next64() % (uint64_t)m->hp.n_vocab), pos[i] = i;
    for (int r = 0; r < 3; r++) {
        kv_seq_truncate(e->pool, &e->seq[0], 0);
        if (kv_seq_reserve(e->pool, &e->seq[0], n, &err)) break;
        batch_seq bs = {.seq = &e->seq[0], .n_tok = n, .tokens = tok, .pos = pos};
        uint64_t t0 = clock_now_ns();
        if (model_forward(e->f, &bs, 1, NULL, e->logits, &err) < 0) break;
        double tps = n / ((double)(clock_now_ns() - t0) / 1e9);
        if (r > 0 && tps > best) best = tps;
    }
    if (best < 0) fprintf(stderr, "gpu_bench: %s\n", err.msg);
done:
    free(tok);
    free(pos);
    return best;
}

/* Prefill attention alone, Llama 3 8B's shape (32 heads over 8 KV heads of 128): n causal rows
 * over a pool of 16-slot blocks, as one sequence (the tensor-core kernel, from
 * ATTN_TC_MIN_ROWS = 16 rows) and as the same rows handed over in 8-row pieces, each its own
 * attn_seq over the same blocks (below the threshold: the warp kernel), so both kernels do the
 * same work in one run. Seconds per call, best of 5 after a warm-up, into ms[0] (tensor cores)
 * and ms[1] (warps); -1 on failure. */
static void attention_times(backend *b, int n, double ms[2]) {
    enum { N_HEAD = 32, N_KV = 8, HD = 128, BT = 16, PIECE = 8 };
    kv_error err = {{0}};
    kv_layout l = {1, N_KV, HD, BT, n / BT};
    const int n_pieces = n / PIECE;
    backend_limits lim = {
        .max_tokens = n, .max_seqs = n_pieces, .max_n_in = HD, .n_head = N_HEAD, .head_dim = HD};
    size_t qn = (size_t)n * N_HEAD * HD, kn = (size_t)n * N_KV * HD;
    float *hq = malloc(sizeof(float) * qn), *hk = malloc(sizeof(float) * kn);
    float *hv = malloc(sizeof(float) * kn);
    int32_t *table = malloc(sizeof(int32_t) * (n / BT)), *slot = malloc(sizeof(int32_t) * n);
    attn_seq *pieces = malloc(sizeof(attn_seq) * n_pieces);
    void *pool = backend_kv_alloc(b, &l);
    float *q = backend_alloc(b, sizeof(float) * qn), *out = backend_alloc(b, sizeof(float) * qn);
    int32_t *dtable = backend_alloc(b, sizeof(int32_t) * (n / BT));
    int32_t *dslot = backend_alloc(b, sizeof(int32_t) * n);
    ms[0] = ms[1] = -1;
    if (!hq || !hk || !hv || !table || !slot || !pieces || !pool || !q || !out || !dtable ||
        !dslot || backend_reserve(b, &lim, &err))
        goto done;
    for (size_t i = 0; i < qn; i++) hq[i] = (float)(next64() % 2001) / 1000.0f - 1.0f;
    for (size_t i = 0; i < kn; i++) {
        hk[i] = (float)(next64() % 2001) / 1000.0f - 1.0f;
        hv[i] = (float)(next64() % 2001) / 1000.0f - 1.0f;
    }
    for (int i = 0; i < n / BT; i++) table[i] = n / BT - 1 - i; /* blocks out of order */
    for (int i = 0; i < n; i++) slot[i] = i;
    if (backend_kv_store(b, pool, &l, 0, table, slot, n, hk, hv) ||
        backend_upload(b, q, hq, sizeof(float) * qn) ||
        backend_upload(b, dtable, table, sizeof(int32_t) * (n / BT)) ||
        backend_upload(b, dslot, slot, sizeof(int32_t) * n))
        goto done;
    attn_seq whole = {dtable, n, n, dslot, q, out, false};
    for (int i = 0; i < n_pieces; i++) {
        size_t r0 = (size_t)i * PIECE;
        pieces[i] = (attn_seq){dtable,     (int)r0 + PIECE,      PIECE,
                               dslot + r0, q + r0 * N_HEAD * HD, out + r0 * N_HEAD * HD,
                               false};
    }
    const float scale = 1.0f / sqrtf((float)HD);
    for (int k = 0; k < 2; k++) {
        const attn_seq *seqs = k == 0 ? &whole : pieces;
        const int n_seqs = k == 0 ? 1 : n_pieces;
        for (int r = 0; r < 6; r++) {
            if (backend_sync(b)) goto done;
            uint64_t t0 = clock_now_ns();
            if (backend_attention(b, pool, &l, 0, N_HEAD, scale, seqs, n_seqs) || backend_sync(b))
                goto done;
            double t = (double)(clock_now_ns() - t0) / 1e6;
            if (r > 0 && (ms[k] < 0 || t < ms[k])) ms[k] = t; /* the first run warms up */
        }
    }
done:
    if (ms[0] < 0 || ms[1] < 0) fprintf(stderr, "gpu_bench: attention: %s\n", err.msg);
    backend_kv_free(b, pool);
    backend_free(b, q), backend_free(b, out), backend_free(b, dtable), backend_free(b, dslot);
    free(hq), free(hk), free(hv), free(table), free(slot), free(pieces);
}

/* The matmul kernels' rates on one weight's shape: Q4_K at 1-32 rows (int8 dot products up to
 * 8, then int8 tensor-core tiles), the f32 GEMV kernels the int8 ones replace (still
 * MATMUL_PRECISION_F32's), and the int8 kernels of every quantized type at 1 and 8 rows. */
static void print_matmul_rates(backend *b, const weight *ffn, double bw) {
    const int rows[] = {1, 2, 4, 8, 9, 16, 32};
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        double g = gemv_rate(b, ffn, rows[i]);
        printf("matmul Q4_K %lld x %lld, %2d rows (%s): %4.0f GB/s of weights (%.0f%% of the "
               "copy bandwidth)\n",
               (long long)ffn->n_in, (long long)ffn->n_out, rows[i],
               rows[i] > 8 ? "int8 tiles" : "int8", g, 100 * g / bw); /* MMVQ_MAX_TOKENS */
    }
    backend_set_precision(b, MATMUL_PRECISION_F32);
    for (int r = 1; r <= 4; r *= 4)
        printf("matmul Q4_K, %d rows (f32 GEMV, MATMUL_PRECISION_F32): %4.0f GB/s\n", r,
               gemv_rate(b, ffn, r));
    backend_set_precision(b, MATMUL_PRECISION_Q8);
    const tensor_type types[] = {TENSOR_TYPE_Q4_0, TENSOR_TYPE_Q4_1, TENSOR_TYPE_Q5_0,
                                 TENSOR_TYPE_Q5_1, TENSOR_TYPE_Q8_0, TENSOR_TYPE_Q4_K,
                                 TENSOR_TYPE_Q5_K, TENSOR_TYPE_Q6_K};
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        weight w = {types[i], ffn->n_in, ffn->n_out, tensor_row_size(types[i], ffn->n_in),
                    random_blocks(types[i], ffn->n_in, ffn->n_out)};
        if (!w.data) break;
        printf("matmul %s (int8): %4.0f GB/s at 1 row, %4.0f at 8\n",
               tensor_type_get((int)types[i])->name, gemv_rate(b, &w, 1), gemv_rate(b, &w, 8));
        free((void *)w.data);
    }
}

/* Prefill-shaped matmuls, Llama 3 8B's (q/o: 4096 -> 4096, gate/up: 4096 -> 14336, down:
 * 14336 -> 4096), on the int8 tensor-core tiles (MATMUL_PRECISION_Q8) against dequantized f16
 * tiles through cuBLAS (MATMUL_PRECISION_F32 beyond 4 rows: the path every prefill took before
 * the tiles), TFLOP/s of each and their ratio per row count: where the ratio falls below 1 is
 * the crossover (cuda.h's MMQ_MAX_TOKENS). Needs scratch reserved for 2048 rows of 14336. */
static void print_prefill_matmuls(backend *b) {
    static const struct {
        tensor_type t;
        int64_t n_in, n_out;
    } shapes[] = {{TENSOR_TYPE_Q4_K, 4096, 4096},  {TENSOR_TYPE_Q4_K, 4096, 14336},
                  {TENSOR_TYPE_Q4_K, 14336, 4096}, {TENSOR_TYPE_Q6_K, 14336, 4096},
                  {TENSOR_TYPE_Q8_0, 4096, 14336}, {TENSOR_TYPE_Q4_0, 4096, 14336}};
    static const int rows[] = {16, 64, 256, 512, 2048};
    printf("\n| prefill matmul | rows | int8 tiles TFLOP/s | dequant + cuBLAS TFLOP/s | ratio |\n"
           "| --- | ---: | ---: | ---: | ---: |\n");
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        const tensor_type t = shapes[i].t;
        weight w = {t, shapes[i].n_in, shapes[i].n_out, tensor_row_size(t, shapes[i].n_in),
                    random_blocks(t, shapes[i].n_in, shapes[i].n_out)};
        if (!w.data) break;
        for (size_t r = 0; r < sizeof rows / sizeof rows[0]; r++) {
            const double flop = 2.0 * (double)w.n_in * (double)w.n_out * rows[r];
            backend_set_precision(b, MATMUL_PRECISION_Q8);
            const double q8 = matmul_seconds(b, &w, rows[r], 3);
            backend_set_precision(b, MATMUL_PRECISION_F32);
            const double blas = matmul_seconds(b, &w, rows[r], 3);
            printf("| %s %lld x %lld | %d | %.1f | %.1f | %.2f |\n", tensor_type_get((int)t)->name,
                   (long long)w.n_in, (long long)w.n_out, rows[r], flop / q8 / 1e12,
                   flop / blas / 1e12, blas / q8);
        }
        free((void *)w.data);
    }
    backend_set_precision(b, MATMUL_PRECISION_Q8);
}

/* The command line into *n_layer, *steps and *probe; false (said on stderr) where it is off. */
static bool parse_args(int argc, char **argv, int *n_layer, int *steps, bool *probe) {
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--probe"))
            *probe = true;
        else if (!strcmp(argv[i], "--layers") && i + 1 < argc)
            *n_layer = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--steps") && i + 1 < argc)
            *steps = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: gpu_bench [--probe] [--layers N] [--steps N]\n");
            return false;
        }
    }
    if (*n_layer < 1 || *n_layer > 128 || *steps < 2 || *steps > 256) {
        fprintf(stderr, "gpu_bench: --layers 1..128, --steps 2..256\n");
        return false;
    }
    return true;
}

int main(int argc, char **argv) {
    int n_layer = 32, steps = 16;
    bool probe = false;
    if (!parse_args(argc, argv, &n_layer, &steps, &probe)) return 2;
    log_set_level(LOG_LEVEL_WARN);
    kv_error err = {{0}};
    backend *b = backend_cuda_create(&err);
    if (!b) {
        printf("no usable CUDA device: %s\n", err.msg);
        return 1;
    }
    if (probe) {
        log_set_level(LOG_LEVEL_INFO);
        backend_destroy(b);
        b = backend_cuda_create(&err); /* the log line names the device */
        backend_destroy(b);
        return 0;
    }

    int rc = 1;
    synth s;
    memset(&s, 0, sizeof s);
    engine e = {.b = b};
    double bw = copy_bandwidth(), tf = gemm_rate(b);
    printf("device copy bandwidth %.0f GB/s, f16 GEMM (4096 x 4096 x 2048) %.1f TFLOP/s\n", bw, tf);
    if (synth_create(&s, n_layer)) {
        fprintf(stderr, "gpu_bench: out of host memory for the model\n");
        goto done;
    }
    const model *m = &s.m;
    double bytes = step_bytes(&s);
    /* 32 sequences of up to 512 + steps tokens, or one of 2048 */
    if (!(e.pool = kv_pool_create(b, m, 32 * 640, 16, &err)) ||
        !(e.f = forward_ctx_create(m, b, e.pool, 2048, 32, &err)) ||
        !(e.logits = malloc(sizeof(float) * 32 * (size_t)m->hp.n_vocab))) {
        fprintf(stderr, "gpu_bench: %s\n", err.msg[0] ? err.msg : "out of memory");
        goto done;
    }
    for (int i = 0; i < 32; i++) kv_seq_init(&e.seq[i]);
    double params = 0;
    for (int l = 0; l < n_layer; l++) {
        const layer_weights *L = &m->layers[l];
        params += (double)L->wq.n_in * (L->wq.n_out + L->wk.n_out + L->wv.n_out) +
                  (double)L->wo.n_in * L->wo.n_out + 3.0 * L->w_gate.n_in * L->w_gate.n_out;
    }
    printf("model: %s, %d layers, %.2f GB of weights read per decode step\n", m->name, n_layer,
           bytes / 1e9);
    const weight *ffn = &m->layers[0].w_gate;
    print_matmul_rates(b, ffn, bw);
    print_prefill_matmuls(b);
    printf("\n| test | tokens/s | roofline | share |\n| --- | ---: | ---: | ---: |\n");
    for (int batch = 1; batch <= 32; batch *= 32) {
        double tps = decode_rate(&e, m, batch, 512, steps);
        double roof = batch * bw * 1e9 / bytes;
        printf("| decode, batch %d, context 512 | %.1f | %.1f (bandwidth) | %.0f%% |\n", batch, tps,
               roof, 100 * tps / roof);
    }
    /* the same steps with every kernel launched one by one (--no-cuda-graphs) */
    backend_set_graphs(b, false);
    double direct = decode_rate(&e, m, 1, 512, steps);
    backend_set_graphs(b, true);
    double graphs = decode_rate(&e, m, 1, 512, steps);
    printf("| decode, batch 1, context 512, no graphs | %.1f | graphs %.1f | %.2fx |\n", direct,
           graphs, direct > 0 ? graphs / direct : 0.0);
    double pp = prefill_rate(&e, m, 2048);
    /* the matmuls' FLOPs per token (the output head only for the last row) and attention's */
    double flops = 2 * params * 2048 + 2.0 * (double)m->hp.dim * m->hp.n_vocab +
                   2.0 * 2 * n_layer * (double)m->hp.n_head * m->hp.head_dim * 2048.0 * 2048 / 2;
    double roof_pp = tf * 1e12 / (flops / 2048);
    printf("| prefill, 2048 tokens | %.1f | %.1f (f16 GEMM rate) | %.0f%% |\n", pp, roof_pp,
           100 * pp / roof_pp);
    double at[2];
    attention_times(b, 2048, at);
    /* causal: QK^T and PV over n^2 / 2 (row, key) pairs, 2 FLOPs a multiply-add */
    double attn_flops = 2.0 * 2 * 32 * 128 * 2048.0 * 2048 / 2;
    printf(
        "\nattention, prefill 2048 rows, 32/8 heads of 128: tensor cores %.3f ms (%.1f TFLOP/s), "
        "warps %.3f ms (%.1f TFLOP/s): %.1fx\n",
        at[0], attn_flops / (at[0] / 1e3) / 1e12, at[1], attn_flops / (at[1] / 1e3) / 1e12,
        at[1] / at[0]);
    rc = pp > 0 && at[0] > 0 ? 0 : 1;
done:
    for (int i = 0; e.pool && i < 32; i++) kv_seq_release(e.pool, &e.seq[i]);
    forward_ctx_destroy(e.f);
    kv_pool_destroy(e.pool);
    free(e.logits);
    synth_free(&s);
    backend_destroy(b);
    return rc;
}
