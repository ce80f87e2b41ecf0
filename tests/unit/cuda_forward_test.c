/* The whole forward pass on the CUDA backend against the CPU backend at the same matmul precision
 * (MATMUL_PRECISION_F32, the float-accurate reference, and MATMUL_PRECISION_Q8, which quantizes
 * activations to the same int8 codes on both): the synthesized llama models of tests/golden/arch
 * (every weight type: Q4_K/Q5_K/Q6_K, Q4_0/Q5_0/Q5_1/Q8_0, F16/BF16; tied and separate outputs;
 * GQA, MQA, no GQA; linear and llama3 RoPE scaling) and the default model's first layers (Q4_1
 * weights, SmolLM2's 9/3 heads). Each runs a prefill long enough for the GEMM path (40 rows, every
 * row's logits), then single-token decode steps, then a batch of two sequences (a 6-token prompt
 * beside a decode step: 7 rows), and must give the CPU's top-1 at every position; the largest logit
 * difference is reported. The CUDA backend runs each model at both matmul precisions: at
 * MATMUL_PRECISION_Q8 quantized weights take the int8 kernels, decode-sized matmuls (the steps
 * and the 7-row batch) the dot-product ones, the prefill the tensor-core tiles; at
 * MATMUL_PRECISION_F32 the f32 GEMV kernels (up to 4 rows; 7 rows are a GEMM there) and the f16
 * GEMMs through cuBLAS. In `make test`
 * the kernels run under the CPU emulator; `make test-gpu` runs this file on the device
 * (-DKVSERVE_TEST_GPU), where positions whose CPU top-1 leads by less than the logit bound are
 * counted rather than required to agree (cuBLAS sums in its own order). */
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/model.h"
#include "tests/unit/model_fixture.h"

#define PREFILL 40
#define DECODE 8
#define SECOND 6 /* tokens of the second sequence's prompt */

/* One backend's engine over the model. */
typedef struct side {
    backend *b;
    kv_pool *pool;
    forward_ctx *f;
    kv_seq s[2];
    kv_seq s3[3]; /* the graph test's three sequences */
    float *logits;
} side;

static void side_open(side *sd, backend *b, const model *m) {
    kv_error err = {{0}};
    sd->b = b;
    sd->pool = kv_pool_create(b, m, 256, 16, &err);
    cr_assert_not_null(sd->pool, "%s", err.msg);
    sd->f = forward_ctx_create(m, b, sd->pool, 64, 2, &err);
    cr_assert_not_null(sd->f, "%s", err.msg);
    kv_seq_init(&sd->s[0]);
    kv_seq_init(&sd->s[1]);
    sd->logits = malloc(sizeof(float) * 64 * (size_t)m->hp.n_vocab);
    cr_assert_not_null(sd->logits);
}

static void side_close(side *sd) {
    kv_seq_release(sd->pool, &sd->s[0]);
    kv_seq_release(sd->pool, &sd->s[1]);
    forward_ctx_destroy(sd->f);
    kv_pool_destroy(sd->pool);
    backend_destroy(sd->b);
    free(sd->logits);
}

typedef struct verdict {
    double bound; /* the largest |delta logit| allowed */
    int positions, top1_agree, near_ties;
    double max_delta;  /* largest |cuda - cpu| logit */
    double min_margin; /* the CPU's smallest lead of its top-1 over its runner-up */
} verdict;

static int argmax(const float *x, int n, float *margin) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    float second = -INFINITY;
    for (int i = 0; i < n; i++)
        if (i != best && x[i] > second) second = x[i];
    *margin = x[best] - second;
    return best;
}

/* The same batch on both sides; n_out logit rows compared. */
static void run_both(side sd[2], batch_seq bs[2][2], int n_seqs, int n_vocab, verdict *v) {
    kv_error err = {{0}};
    int n_out[2];
    for (int k = 0; k < 2; k++) {
        for (int s = 0; s < n_seqs; s++) {
            bs[k][s].seq = &sd[k].s[s];
            cr_assert_eq(
                kv_seq_reserve(sd[k].pool, &sd[k].s[s], bs[k][s].kv_start + bs[k][s].n_tok, &err),
                0, "%s", err.msg);
        }
        n_out[k] = model_forward(sd[k].f, bs[k], n_seqs, NULL, sd[k].logits, &err);
        cr_assert_gt(n_out[k], 0, "%s forward: %s", backend_name(sd[k].b), err.msg);
    }
    cr_assert_eq(n_out[0], n_out[1]);
    for (int r = 0; r < n_out[0]; r++) {
        const float *lc = sd[0].logits + (size_t)r * n_vocab,
                    *lg = sd[1].logits + (size_t)r * n_vocab;
        float mc, mg;
        int tc = argmax(lc, n_vocab, &mc), tg = argmax(lg, n_vocab, &mg);
        v->positions++;
        v->top1_agree += tc == tg;
#ifdef KVSERVE_TEST_GPU
        /* the device sums in its own order: a top-1 closer than the bound to its runner-up may
         * go either way (counted); under emulation every position must agree */
        if (mc < v->bound) {
            v->near_ties++;
            continue;
        }
#endif
        cr_expect_eq(tg, tc, "position %d of the batch: cuda top-1 %d, cpu %d (cpu margin %.4f)", r,
                     tg, tc, (double)mc);
        v->min_margin = mc < v->min_margin ? mc : v->min_margin;
        for (int i = 0; i < n_vocab; i++) {
            double d = fabs((double)lc[i] - lg[i]);
            v->max_delta = d > v->max_delta ? d : v->max_delta;
        }
    }
}

/* Prefill PREFILL tokens (all logits), DECODE single steps, then a second sequence's prompt in one
 * batch with another decode step of the first. The tokens: tok, or text's. */
static void compare(const char *path, int keep_layers, const int32_t *tok, const char *text,
                    matmul_precision precision, double max_delta) {
    kv_error err = {{0}};
    model_load_opts opts = {.chat_template = "chatml"};
    model *m = model_load(path, &opts, &err);
    cr_assert_not_null(m, "%s: %s", path, err.msg);
    int32_t *ids = NULL;
    if (!tok) {
        int n = tokenizer_encode(m->tok, text, strlen(text), false, false, &ids, &err);
        cr_assert_geq(n, PREFILL + DECODE + 1, "%s", err.msg);
        tok = ids;
    }
    if (keep_layers > 0 && keep_layers < m->hp.n_layer)
        m->hp.n_layer = keep_layers; /* the first layers, then the output head */
    side sd[2] = {{0}};
    backend *cpu = backend_cpu_create(2, &err), *gpu;
    cr_assert_not_null(cpu, "%s", err.msg);
    backend_set_precision(cpu, precision);
    if (!(gpu = cuda_under_test(&err))) {
        backend_destroy(cpu);
        model_free(m);
        cr_skip_test("no CUDA device: %s", err.msg);
    }
    backend_set_precision(gpu, precision);
    side_open(&sd[0], cpu, m);
    side_open(&sd[1], gpu, m);
    const int nv = m->hp.n_vocab;
    verdict v = {.bound = max_delta, .min_margin = INFINITY};
    int32_t pos[64];
    for (int i = 0; i < 64; i++) pos[i] = i;

    batch_seq bs[2][2] = {{{0}}};
    for (int k = 0; k < 2; k++)
        bs[k][0] = (batch_seq){.n_tok = PREFILL, .tokens = tok, .pos = pos, .all_logits = true};
    run_both(sd, bs, 1, nv, &v);
    for (int t = PREFILL; t < PREFILL + DECODE; t++) {
        for (int k = 0; k < 2; k++)
            bs[k][0] = (batch_seq){
                .n_tok = 1, .tokens = tok + t, .pos = pos + t, .kv_start = t, .decode = true};
        run_both(sd, bs, 1, nv, &v);
    }
    /* the second sequence's prompt at discontinuous positions (as a schema's module) */
    int32_t pos2[SECOND];
    for (int i = 0; i < SECOND; i++) pos2[i] = 3 * i + (i > 2 ? 100 : 0);
    const int t = PREFILL + DECODE;
    for (int k = 0; k < 2; k++) {
        bs[k][0] = (batch_seq){.n_tok = 1, .tokens = tok + t, .pos = pos + t, .kv_start = t};
        bs[k][1] = (batch_seq){.n_tok = SECOND, .tokens = tok + 3, .pos = pos2, .all_logits = true};
    }
    run_both(sd, bs, 2, nv, &v);

    cr_log_info("%s (%d layers, cuda %s): %d positions, top-1 agrees at %d (%d near ties not "
                "required), max |delta logit| %.4f, smallest CPU top-1 margin %.4f",
                path, m->hp.n_layer, precision == MATMUL_PRECISION_Q8 ? "Q8" : "F32", v.positions,
                v.top1_agree, v.near_ties, v.max_delta, v.min_margin);
    cr_expect_lt(v.max_delta, max_delta, "%s: logits differ by %.4f", path, v.max_delta);
    side_close(&sd[0]);
    side_close(&sd[1]);
    free(ids);
    model_free(m);
}

/* The first prompt of a tiny model's golden file (56 random ids). */
static void arch_tokens(const char *name, int32_t *tok) {
    char p[256];
    snprintf(p, sizeof p, "tests/golden/arch/%s.json", name);
    json_error_t jerr;
    json_t *root = json_load_file(p, 0, &jerr);
    cr_assert_not_null(root, "%s: %s", p, jerr.text);
    json_t *jt = json_object_get(json_array_get(json_object_get(root, "cases"), 0), "tokens");
    cr_assert_geq(json_array_size(jt), PREFILL + DECODE + 1);
    for (size_t i = 0; i < PREFILL + DECODE + 1; i++)
        tok[i] = (int32_t)json_integer_value(json_array_get(jt, i));
    json_decref(root);
}

TestSuite(cuda_forward, .timeout = 600);

/* The bounds on |delta logit| are 2-3x what the emulator measured. The CUDA backend at
 * MATMUL_PRECISION_F32 (f32 GEMV decode): f16 activations and weights in the prefill's GEMMs move
 * logits by a few thousandths (measured 0.008-0.04). At MATMUL_PRECISION_Q8, the default, both
 * backends quantize every quantized weight's activations to the same int8 codes, but a float
 * difference elsewhere (attention, norms: summation order) that moves an activation across a
 * rounding boundary changes its code, and the layers after amplify it: measured 0.07
 * (llama3_q), 0.13 (linear_kq) and 0.45 (SmolLM2's 4 layers). Against the f32 reference the
 * Q8 error itself is 0.14, 0.26 and 0.66 on the CPU, whose Q8 top-1 differs from its F32 one at
 * 1 of the 55 positions of two of these models: hence the comparison at the same precision. */
static void compare_both(const char *path, int keep_layers, const int32_t *tok, const char *text,
                         double bound_f32, double bound_q8) {
    compare(path, keep_layers, tok, text, MATMUL_PRECISION_F32, bound_f32);
    compare(path, keep_layers, tok, text, MATMUL_PRECISION_Q8, bound_q8);
}

Test(cuda_forward, tiny_k_quants) {
    int32_t tok[64];
    arch_tokens("linear_kq", tok);
    compare_both("tests/golden/arch/linear_kq.gguf", 0, tok, NULL, 0.05, 0.4);
}

Test(cuda_forward, tiny_32_blocks_llama3) {
    int32_t tok[64];
    arch_tokens("llama3_q", tok);
    compare_both("tests/golden/arch/llama3_q.gguf", 0, tok, NULL, 0.05, 0.2);
}

/* F16 and BF16 weights take the f32 GEMV kernels at either precision. */
Test(cuda_forward, tiny_f16_bf16_mqa) {
    int32_t tok[64];
    arch_tokens("f16_bf16", tok);
    compare("tests/golden/arch/f16_bf16.gguf", 0, tok, NULL, MATMUL_PRECISION_Q8, 0.05);
}

/* SmolLM2-135M's first 4 of 30 layers, then its output head, over English text. */
Test(cuda_forward, default_model_first_layers) {
    compare_both(TEST_MODEL_PATH, 4, NULL,
                 "The capital of France is Paris. The capital of Germany is Berlin. The capital of "
                 "Italy is Rome. The capital of Spain is Madrid. The capital of Portugal is "
                 "Lisbon. The capital of Austria is Vienna. The capital of Poland is Warsaw.",
                 0.1, 1.0);
}

/* ---------------------------------------------------------------- decode steps as graphs */

#ifndef KVSERVE_TEST_GPU
long cuda_emu_live_graphs(void); /* kernels/cuda/emu.cc */
#endif

/* The graph test's two sides: a CUDA backend with step graphs (sd[0]) and one without (sd[1]),
 * each with a pool and a context for three sequences. False when there is no device. */
static bool graph_sides_open(side sd[2], const model *m, matmul_precision precision) {
    kv_error err = {{0}};
    for (int k = 0; k < 2; k++) {
        backend *b = cuda_under_test(&err);
        if (!b) {
            if (k == 1) backend_destroy(sd[0].b);
            return false;
        }
        backend_set_graphs(b, k == 0);
        backend_set_precision(b, precision);
        cr_assert_eq(backend_graphs(b), k == 0);
        sd[k].b = b;
        sd[k].pool = kv_pool_create(b, m, 64 * 16, 16, &err);
        cr_assert_not_null(sd[k].pool, "%s", err.msg);
        sd[k].f = forward_ctx_create(m, b, sd[k].pool, 64, 3, &err);
        cr_assert_not_null(sd[k].f, "%s", err.msg);
        for (int s = 0; s < 3; s++) kv_seq_init(&sd[k].s3[s]);
        sd[k].logits = malloc(sizeof(float) * 64 * (size_t)m->hp.n_vocab);
        cr_assert_not_null(sd[k].logits);
    }
    return true;
}

static void graph_sides_close(side sd[2]) {
    for (int k = 0; k < 2; k++) {
        for (int s = 0; s < 3; s++) kv_seq_release(sd[k].pool, &sd[k].s3[s]);
        forward_ctx_destroy(sd[k].f);
        kv_pool_destroy(sd[k].pool);
        backend_destroy(sd[k].b);
        free(sd[k].logits);
    }
}

/* One pass of n entries on both sides (bs[k]: side k's, sequences set here from seq[]); the
 * logits must be the same bits. */
static void graph_pass(side sd[2], const model *m, batch_seq bs[2][3], const int *seq, int n,
                       const char *what, int step) {
    kv_error err = {{0}};
    for (int k = 0; k < 2; k++) {
        for (int i = 0; i < n; i++) {
            bs[k][i].seq = &sd[k].s3[seq[i]];
            cr_assert_eq(
                kv_seq_reserve(sd[k].pool, bs[k][i].seq, bs[k][i].kv_start + bs[k][i].n_tok, &err),
                0, "%s", err.msg);
        }
        cr_assert_eq(model_forward(sd[k].f, bs[k], n, NULL, sd[k].logits, &err), n, "%s %d: %s",
                     what, step, err.msg);
    }
    const size_t row = sizeof(float) * (size_t)m->hp.n_vocab;
    for (int i = 0; i < n; i++)
        cr_expect_eq(memcmp(sd[0].logits + (size_t)i * m->hp.n_vocab,
                            sd[1].logits + (size_t)i * m->hp.n_vocab, row),
                     0, "%s %d (%d wide), sequence %d at slot %d: graph and direct differ", what,
                     step, n, seq[i], bs[0][i].kv_start);
}

/* Two CUDA backends, step graphs on and off, run the same continuous batch: three prompts (one
 * in two chunks), then decode steps whose width goes 1, 2, 3 and back to 1, so each width is
 * recorded once and replayed with other positions, other block tables (the sequences' blocks
 * interleave as they grow), a table that grows a block (slots 64, 32 and 96 start new ones) and
 * decode rows whose keys cross a split boundary (64 keys: 2 ranges, 96: 3) inside one graph.
 * Every step's logits must be the same bits: a replay is the same kernels on the same data. At
 * MATMUL_PRECISION_F32 a last-bit difference in any op reaches the logits (8-bit activations
 * would round most of them away). */
static void graphs_against_direct(matmul_precision precision, bool decode) {
    kv_error err = {{0}};
    model_load_opts opts = {.chat_template = "chatml"};
    model *m = model_load("tests/golden/arch/llama3_q.gguf", &opts, &err);
    cr_assert_not_null(m, "%s", err.msg);
    int32_t arch[64], tok[128], pos[128];
    arch_tokens("llama3_q", arch);
    for (int i = 0; i < 128; i++) tok[i] = arch[i % (PREFILL + DECODE + 1)], pos[i] = i;
#ifndef KVSERVE_TEST_GPU
    const long graphs_before = cuda_emu_live_graphs();
#endif
    side sd[2] = {{0}};
    if (!graph_sides_open(sd, m, precision)) {
        model_free(m);
        cr_skip_test("no CUDA device");
    }
    batch_seq bs[2][3];
    /* prompts: 60, 30 and 94 (45 + 49) tokens */
    const int prompt[4][3] = {{0, 0, 60}, {1, 0, 30}, {2, 0, 45}, {2, 45, 49}};
    int len[3] = {0, 0, 0};
    for (int p = 0; p < 4; p++) {
        const int s = prompt[p][0], start = prompt[p][1], n = prompt[p][2];
        for (int k = 0; k < 2; k++)
            bs[k][0] = (batch_seq){
                .n_tok = n, .tokens = tok + start, .pos = pos + start, .kv_start = start};
        graph_pass(sd, m, bs, &s, 1, "prompt", p);
        len[s] = start + n;
    }
    /* decode steps: the batch's widths */
    const int width[12] = {1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 1, 1}, seq[3] = {0, 1, 2};
    for (int step = 0; step < 12; step++) {
        for (int k = 0; k < 2; k++)
            for (int s = 0; s < width[step]; s++)
                bs[k][s] = (batch_seq){.n_tok = 1,
                                       .tokens = tok + len[s],
                                       .pos = pos + len[s],
                                       .kv_start = len[s],
                                       .decode = decode};
        graph_pass(sd, m, bs, seq, width[step], "step", step);
        for (int s = 0; s < width[step]; s++) len[s]++;
    }
    cr_expect(backend_graphs(sd[0].b), "no recording failed");
#ifndef KVSERVE_TEST_GPU
    cr_expect_eq(cuda_emu_live_graphs(), graphs_before + 3, "one graph per width, replayed: %ld",
                 cuda_emu_live_graphs() - graphs_before);
#endif
    graph_sides_close(sd);
#ifndef KVSERVE_TEST_GPU
    cr_expect_eq(cuda_emu_live_graphs(), graphs_before, "the graphs are destroyed");
#endif
    model_free(m);
}

Test(cuda_forward, decode_graphs_match_direct_launches_bit_for_bit) {
    graphs_against_direct(MATMUL_PRECISION_F32, true);
    graphs_against_direct(MATMUL_PRECISION_Q8, true);
    /* the server's steps: decode false (KV computed as a prompt's, attention unsplit) */
    graphs_against_direct(MATMUL_PRECISION_F32, false);
}
