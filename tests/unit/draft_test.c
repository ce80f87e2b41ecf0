/* The draft model runner (server/engine/draft.h) on the real model drafting for itself: its
 * drafts are the model's greedy continuation, a draft KV cut back after a verify step goes on
 * as a fresh one computed from scratch would, blocks come back to its pool, a sequence whose
 * KV does not fit drafts nothing, and a model of another vocabulary is refused. */
#include <criterion/criterion.h>
#include <string.h>

#include "model/sampler.h"
#include "server/engine/draft.h"
#include "tests/unit/model_fixture.h"

static model_fixture fx;

static void setup(void) { model_fixture_open(&fx, 2, 1024, 128, 1); }
static void teardown(void) { model_fixture_close(&fx); }

TestSuite(draft, .init = setup, .fini = teardown, .timeout = 300);

/* A prompt the model goes on counting (64 tokens over the catch-up budget: twice). */
static const char COUNT[] = "one two three four five six seven eight nine ten eleven twelve "
                            "thirteen fourteen fifteen sixteen seventeen eighteen nineteen twenty "
                            "one two three four five six seven eight nine ten eleven twelve";

static int encode(const char *text, int32_t *ids, int cap) {
    int32_t *t = NULL;
    kv_error err = {{0}};
    int n = tokenizer_encode(fx.m->tok, text, strlen(text), true, false, &t, &err);
    cr_assert(n > 0 && n <= cap, "%s", err.msg);
    memcpy(ids, t, sizeof *t * (size_t)n);
    free(t);
    return n;
}

/* The model's greedy continuation of ids[0 .. n), k tokens, through the fixture's own pool. */
static void greedy(const int32_t *ids, int n, int k, int32_t *out) {
    kv_error err = {{0}};
    kv_seq seq;
    kv_seq_init(&seq);
    int32_t tok[128], pos[128];
    memcpy(tok, ids, sizeof *tok * (size_t)n);
    float *logits = malloc(sizeof(float) * (size_t)fx.m->hp.n_vocab);
    cr_assert_not_null(logits);
    for (int i = 0, at = 0, len = n; i < k; i++) {
        cr_assert_eq(kv_seq_reserve(fx.pool, &seq, at + len, &err), 0, "%s", err.msg);
        for (int j = 0; j < len; j++) pos[j] = at + j;
        batch_seq bs = {.seq = &seq, .n_tok = len, .tokens = tok + at, .pos = pos, .kv_start = at};
        cr_assert_eq(model_forward(fx.f, &bs, 1, NULL, logits, &err), 1, "%s", err.msg);
        at += len;
        len = 1;
        tok[at] = out[i] = sampler_argmax(logits, fx.m->hp.n_vocab);
    }
    kv_seq_release(fx.pool, &seq);
    free(logits);
}

static draft_model *make(int64_t pool_tokens) {
    kv_error err = {{0}};
    draft_model *d = draft_create(fx.m, fx.m, fx.b, pool_tokens, 2, 64, &err);
    cr_assert_not_null(d, "%s", err.msg);
    return d;
}

Test(draft, drafts_are_the_model_greedy_continuation) {
    int32_t ids[96], ref[8], out[8];
    int n = encode(COUNT, ids, 96);
    greedy(ids, n, 8, ref);
    draft_model *d = make(1024);
    draft_seq ds;
    draft_seq_init(&ds);
    draft_job j = {.ds = &ds, .hist = ids, .n_hist = n, .k = 8, .out = out};
    kv_error err = {{0}};
    cr_assert_eq(draft_run(d, &j, 1, &err), 0, "%s", err.msg);
    cr_assert_eq(j.n, 8);
    for (int i = 0; i < 8; i++) cr_assert_eq(out[i], ref[i], "draft token %d", i);
    /* its KV holds the history and every draft token but the last (never fed) */
    cr_assert_eq(ds.n, n + 7);
    cr_assert_eq(ds.kv.n_tokens, n + 7);
    draft_seq_release(d, &ds);
    cr_assert_eq(draft_blocks_free(d), draft_blocks_total(d));
    draft_destroy(d);
}

/* A verify step kept 2 of the draft's tokens and the model chose the third itself: the draft KV
 * cut back to the kept tokens drafts on exactly as one computed from scratch over the new
 * history, and the blocks the rejected tokens took are free again. */
Test(draft, a_cut_back_draft_goes_on_as_a_fresh_one) {
    int32_t hist[128], out[8], fresh_out[8];
    int n = encode(COUNT, hist, 96);
    draft_model *d = make(1024);
    draft_seq ds, fresh;
    draft_seq_init(&ds);
    draft_seq_init(&fresh);
    kv_error err = {{0}};
    draft_job j = {.ds = &ds, .hist = hist, .n_hist = n, .k = 8, .out = hist + n};
    cr_assert_eq(draft_run(d, &j, 1, &err), 0, "%s", err.msg);
    cr_assert_eq(j.n, 8);
    int64_t free_drafted = draft_blocks_free(d);
    /* kept: hist[n], hist[n + 1]; the model's own token after them replaces hist[n + 2] */
    draft_seq_truncate(d, &ds, n + 2);
    cr_assert_eq(ds.n, n + 2);
    cr_assert_geq(draft_blocks_free(d), free_drafted);
    hist[n + 2] =
        tokenizer_find(fx.m->tok, "Ġapple") >= 0 ? tokenizer_find(fx.m->tok, "Ġapple") : hist[3];
    draft_job a[2] = {{.ds = &ds, .hist = hist, .n_hist = n + 3, .k = 4, .out = out},
                      {.ds = &fresh, .hist = hist, .n_hist = n + 3, .k = 4, .out = fresh_out}};
    cr_assert_eq(draft_run(d, a, 2, &err), 0, "%s", err.msg);
    cr_assert_eq(a[0].n, a[1].n);
    cr_assert_eq(memcmp(out, fresh_out, sizeof *out * (size_t)a[0].n), 0);
    cr_assert_eq(ds.n, fresh.n);
    cr_assert_eq(ds.kv.n_blocks, fresh.kv.n_blocks);
    /* nothing is kept: only the pending token's predecessors stay */
    draft_seq_truncate(d, &ds, 16);
    cr_assert_eq(ds.kv.n_blocks, 1);
    draft_seq_release(d, &ds);
    draft_seq_release(d, &fresh);
    cr_assert_eq(draft_blocks_free(d), draft_blocks_total(d));
    draft_destroy(d);
}

/* A history longer than the catch-up budget (64 tokens a call here) is fed over several runs,
 * drafting nothing until it is all in; a pool too small for it drafts nothing and takes
 * nothing. */
Test(draft, long_histories_catch_up_and_a_full_pool_drafts_nothing) {
    int32_t hist[160], out[4];
    int n = encode(COUNT, hist, 50);
    for (int k = 0; k < 2; k++) /* the count three times */
        memcpy(hist + n + k * (n - 1), hist + 1, sizeof *hist * (size_t)(n - 1));
    n = 3 * n - 2;
    /* one call takes 64 tokens and one per sequence: this takes two */
    cr_assert(n > 65 && n <= 130, "%d tokens", n);
    draft_model *d = make(1024);
    draft_seq ds;
    draft_seq_init(&ds);
    kv_error err = {{0}};
    draft_job j = {.ds = &ds, .hist = hist, .n_hist = n, .k = 4, .out = out};
    cr_assert_eq(draft_run(d, &j, 1, &err), 0, "%s", err.msg);
    cr_assert_eq(j.n, 0);
    cr_assert_eq(ds.n, 65);
    cr_assert_eq(draft_run(d, &j, 1, &err), 0, "%s", err.msg);
    cr_assert_gt(j.n, 0);
    cr_assert_eq(ds.n, n + j.n - 1);
    draft_seq_release(d, &ds);
    draft_destroy(d);

    d = make(32);
    cr_assert_eq(draft_run(d, &j, 1, &err), 0, "%s", err.msg);
    cr_assert_eq(j.n, 0);
    cr_assert_eq(ds.n, 0);
    cr_assert_eq(draft_blocks_free(d), draft_blocks_total(d));
    draft_seq_release(d, &ds);
    draft_destroy(d);
}

Test(draft, a_model_of_another_vocabulary_is_refused) {
    model *other = model_fixture_load_path(TEST_OTHER_VOCAB_PATH);
    kv_error err = {{0}};
    cr_assert_null(draft_create(fx.m, other, fx.b, 256, 1, 16, &err));
    cr_assert(strstr(err.msg, TEST_OTHER_VOCAB_PATH) && strstr(err.msg, TEST_MODEL_PATH) &&
                  strstr(err.msg, "vocabulary"),
              "%s", err.msg);
    model_free(other);
}
