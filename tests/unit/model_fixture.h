/* The unit tests' model: SmolLM2-135M (`make model` fetches it) and, for the tests that compute
 * with it, a CPU backend, a paged KV pool and a forward context over it. One place names the
 * file and builds the set, so the tests that use it (model, blend, plan, schema, engine, gguf,
 * cuda) do not each repeat them. Failures are Criterion assertions. */
#ifndef KVSERVE_MODEL_FIXTURE_H
#define KVSERVE_MODEL_FIXTURE_H

#include "model/model.h"

#define TEST_MODEL_PATH "models/SmolLM2-135M-Instruct.Q4_1.gguf"
/* The same model requantized to Q8_0 (`make model` writes it with scripts/make_draft_model.py):
 * a draft model whose greedy tokens almost always agree with TEST_MODEL_PATH's. */
#define TEST_DRAFT_MODEL_PATH "models/SmolLM2-135M-Instruct.Q8_0.gguf"
/* A tiny model of another vocabulary (1000 tokens; scripts/ref/make_tiny_models.py). */
#define TEST_OTHER_VOCAB_PATH "tests/golden/arch/linear_kq.gguf"

typedef struct model_fixture {
    model *m;
    backend *b;     /* CPU */
    kv_pool *pool;  /* 16-token blocks */
    forward_ctx *f; /* NULL when not asked for */
} model_fixture;

/* TEST_MODEL_PATH loaded with default options. */
model *model_fixture_load(void);
/* Another model file, loaded as a draft model is (the test fails when it cannot be). */
model *model_fixture_load_path(const char *path);
/* The model, a CPU backend of threads, a pool of pool_tokens and, when max_tok > 0, a forward
 * context for max_tok tokens of up to max_seqs sequences. */
void model_fixture_open(model_fixture *fx, int threads, int pool_tokens, int max_tok, int max_seqs);
/* The CUDA backend under test: the emulator, or the device in `make test-gpu` (which defines
 * KVSERVE_TEST_GPU for the tests it builds). Inline, so each test's own definition decides. */
static inline backend *cuda_under_test(kv_error *err) {
#ifdef KVSERVE_TEST_GPU
    return backend_cuda_create(err);
#else
    return backend_cuda_emu_create(err);
#endif
}

/* Frees what model_fixture_open made (any part may be NULL), in reverse order. */
void model_fixture_close(model_fixture *fx);

#endif
