/* The unit tests' model and the set built over it (tests/unit/model_fixture.h): loading
 * TEST_MODEL_PATH or another file, and a CPU backend, KV pool and forward context for the tests
 * that compute with it. Failures are Criterion assertions. */
#include "tests/unit/model_fixture.h"

#include <criterion/criterion.h>
#include <string.h>

model *model_fixture_load(void) {
    kv_error err = {{0}};
    model *m = model_load(TEST_MODEL_PATH, NULL, &err);
    cr_assert_not_null(m, "load %s: %s (run `make model`)", TEST_MODEL_PATH, err.msg);
    return m;
}

model *model_fixture_load_path(const char *path) {
    kv_error err = {{0}};
    model *m = model_load(path, NULL, &err);
    cr_assert_not_null(m, "load %s: %s (run `make model`)", path, err.msg);
    return m;
}

void model_fixture_open(model_fixture *fx, int threads, int pool_tokens, int max_tok,
                        int max_seqs) {
    kv_error err = {{0}};
    memset(fx, 0, sizeof *fx);
    fx->m = model_fixture_load();
    fx->b = backend_cpu_create(threads, &err);
    cr_assert_not_null(fx->b, "%s", err.msg);
    fx->pool = kv_pool_create(fx->b, fx->m, pool_tokens, 16, &err);
    cr_assert_not_null(fx->pool, "%s", err.msg);
    if (max_tok > 0) {
        fx->f = forward_ctx_create(fx->m, fx->b, fx->pool, max_tok, max_seqs, &err);
        cr_assert_not_null(fx->f, "%s", err.msg);
    }
}

void model_fixture_close(model_fixture *fx) {
    forward_ctx_destroy(fx->f);
    kv_pool_destroy(fx->pool);
    backend_destroy(fx->b);
    model_free(fx->m);
    memset(fx, 0, sizeof *fx);
}
