/* The llama variants kvserve claims beyond SmolLM2, on tiny random-weight models
 * (tests/golden/arch, made by scripts/ref/make_tiny_models.py): separate output.weight, linear
 * and llama3 RoPE scaling (from rope_freqs.weight and from metadata alone), no GQA and MQA, and
 * the K-quant, 32-block and F16/BF16 weight types. Each model's logits are compared with the
 * exact float64 forward and llama.cpp's, and shown to disagree with the exact forward that
 * ignores the RoPE scaling, so the scaling is proven applied. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/model.h"
#include "tests/unit/ref_logits.h"

#define DIR "tests/golden/arch/"

/* Ignoring the scaling moves the logits by ~0.4-0.8 on average: at least this many times the
 * engine's distance from the scaled reference. */
#define MIN_NOSCALE_RATIO 5.0

/* What a variant's hyperparameters must say. */
typedef struct arch_expect {
    const char *name;
    bool tied;
    rope_scaling scaling;
    float factor;
    int n_head, n_kv_head, dim;
    bool has_llama;        /* golden carries llama.cpp's reference */
    double max_mean_delta; /* bound on mean |delta logit| over either reference's top-16 */
} arch_expect;

static void check_variant(const arch_expect *ex) {
    char path[256];
    kv_error err = {{0}};
    snprintf(path, sizeof path, DIR "%s.gguf", ex->name);
    model_load_opts opts = {.chat_template = "chatml"}; /* the tiny files carry none */
    model *m = model_load(path, &opts, &err);
    cr_assert_not_null(m, "%s: %s", path, err.msg);
    const model_hparams *hp = &m->hp;
    cr_expect_eq(hp->tied_output, ex->tied, "%s: tied_output", ex->name);
    cr_expect_eq(hp->rope_scaling_type, ex->scaling, "%s: rope scaling type", ex->name);
    cr_expect_float_eq(hp->rope_factor, ex->factor, 1e-6, "%s: rope factor", ex->name);
    cr_expect_eq(hp->n_head, ex->n_head);
    cr_expect_eq(hp->n_kv_head, ex->n_kv_head, "%s: n_kv_head", ex->name);
    cr_expect_eq(hp->dim, ex->dim);
    cr_expect_eq(hp->head_dim, 64);
    cr_expect_eq(hp->n_layer, 2);
    cr_expect_eq(hp->n_vocab, 1000);

    backend *b = backend_cpu_create(2, &err);
    cr_assert_not_null(b, "%s", err.msg);
    kv_pool *pool = kv_pool_create(b, m, 256, 16, &err);
    cr_assert_not_null(pool, "%s", err.msg);
    forward_ctx *f = forward_ctx_create(m, b, pool, 128, 1, &err);
    cr_assert_not_null(f, "%s", err.msg);
    float *logits = malloc(sizeof(float) * 128 * (size_t)hp->n_vocab);
    cr_assert_not_null(logits);

    snprintf(path, sizeof path, DIR "%s.json", ex->name);
    json_error_t jerr;
    json_t *root = json_load_file(path, 0, &jerr);
    cr_assert_not_null(root, "%s: %s", path, jerr.text);
    json_t *cases = json_object_get(root, "cases");
    cr_assert_geq(json_array_size(cases), 2);
    ref_stats exact = {0}, llama = {0}, noscale = {0};
    for (size_t c = 0; c < json_array_size(cases); c++) {
        json_t *jc = json_array_get(cases, c);
        json_t *jt = json_object_get(jc, "tokens");
        int n = (int)json_array_size(jt);
        cr_assert(n >= 48 && n <= 128);
        int32_t ids[128], pos[128];
        for (int i = 0; i < n; i++) {
            ids[i] = (int32_t)json_integer_value(json_array_get(jt, (size_t)i));
            pos[i] = i;
        }
        kv_seq s;
        kv_seq_init(&s);
        cr_assert_eq(kv_seq_reserve(pool, &s, n, &err), 0, "%s", err.msg);
        batch_seq bs = {
            .seq = &s, .n_tok = n, .tokens = ids, .pos = pos, .kv_start = 0, .all_logits = true};
        int r = model_forward(f, &bs, 1, NULL, logits, &err);
        cr_assert_eq(r, n, "forward: %s", err.msg);
        for (int p = 0; p < n; p++) {
            const float *lg = logits + (size_t)p * hp->n_vocab;
            ref_compare(&exact, lg, hp->n_vocab,
                        json_array_get(json_object_get(jc, "exact_top_ids"), (size_t)p),
                        json_array_get(json_object_get(jc, "exact_top_logits"), (size_t)p));
            if (json_object_get(jc, "top_ids"))
                ref_compare(&llama, lg, hp->n_vocab,
                            json_array_get(json_object_get(jc, "top_ids"), (size_t)p),
                            json_array_get(json_object_get(jc, "top_logits"), (size_t)p));
            if (json_object_get(jc, "noscale_top_ids"))
                ref_compare(&noscale, lg, hp->n_vocab,
                            json_array_get(json_object_get(jc, "noscale_top_ids"), (size_t)p),
                            json_array_get(json_object_get(jc, "noscale_top_logits"), (size_t)p));
        }
        kv_seq_release(pool, &s);
    }
    json_decref(root);

    ref_report(ex->name, "exact f64", &exact);
    cr_expect_eq(exact.decisive_agree, exact.decisive, "%s: decisive top-1 vs exact", ex->name);
    cr_expect_lt(ref_mean_delta(&exact), ex->max_mean_delta, "%s: mean |delta| vs exact", ex->name);
    cr_expect_eq(llama.n_pos > 0, ex->has_llama, "%s: llama.cpp reference present", ex->name);
    if (llama.n_pos > 0) {
        ref_report(ex->name, "llama.cpp", &llama);
        cr_expect_eq(llama.decisive_agree, llama.decisive, "%s: decisive top-1 vs llama.cpp",
                     ex->name);
        cr_expect_lt(ref_mean_delta(&llama), ex->max_mean_delta, "%s: mean |delta| vs llama.cpp",
                     ex->name);
    }
    cr_expect_eq(noscale.n_pos > 0, ex->scaling != ROPE_SCALING_NONE);
    if (noscale.n_pos > 0) {
        ref_report(ex->name, "unscaled", &noscale);
        cr_expect_gt(ref_mean_delta(&noscale), MIN_NOSCALE_RATIO * ref_mean_delta(&exact),
                     "%s: logits match the unscaled reference: RoPE scaling not applied", ex->name);
    }
    free(logits);
    forward_ctx_destroy(f);
    kv_pool_destroy(pool);
    backend_destroy(b);
    model_free(m);
}

TestSuite(arch, .timeout = 300);

/* The mean |delta| bounds are ~2x what was measured (exact f64 / llama.cpp): linear_kq
 * 0.040 / 0.031, llama3 0.020 / 0.022, f16_bf16 0.0002 / 0.0025. */

/* Separate output.weight, linear RoPE scaling x4, 4/4 heads, Q4_K/Q5_K/Q6_K. */
Test(arch, linear_kquant) {
    arch_expect ex = {"linear_kq", false, ROPE_SCALING_LINEAR, 4.0f, 4, 4, 256, true, 0.08};
    check_variant(&ex);
}

/* Llama 3.1 layout: rope_freqs.weight, llama3 metadata, GQA 4/2, Q8_0/Q4_0/Q5_0/Q5_1. */
Test(arch, llama3_rope_freqs) {
    arch_expect ex = {"llama3_q", true, ROPE_SCALING_LLAMA3, 8.0f, 4, 2, 256, true, 0.045};
    check_variant(&ex);
}

/* The same weights without rope_freqs.weight: the frequencies come from the metadata. */
Test(arch, llama3_from_metadata) {
    arch_expect ex = {"llama3_meta", true, ROPE_SCALING_LLAMA3, 8.0f, 4, 2, 256, false, 0.045};
    check_variant(&ex);
}

/* F16 and BF16 matrices, F32 norms, tied output, MQA 2/1. */
Test(arch, f16_bf16) {
    arch_expect ex = {"f16_bf16", true, ROPE_SCALING_NONE, 1.0f, 2, 1, 128, true, 0.006};
    check_variant(&ex);
}
