/* The engine on the real model: continuous batching gives every request the output it gets
 * alone (greedy), also when the KV pool is too small for all of them and sequences are preempted
 * and recomputed; n choices fork one prompt; cancellation frees KV at once; the queue limit,
 * groups, invalid requests and shutdown answer as engine.h says. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "server/engine/engine.h"
#include "tests/unit/model_fixture.h"

static model *g_m;
/* The test's engine, also stopped by teardown: a failed assertion leaves the test early, and the
 * engine thread must not outlive the model it computes with. */
static engine *g_e;
static metrics *g_mx;
/* The draft model the next start_with gives the engine (NULL: none). */
static const model *g_draft;

static void setup(void) { g_m = model_fixture_load(); }

static void stop_engine(void) {
    engine_destroy(g_e);
    metrics_destroy(g_mx);
    g_e = NULL;
    g_mx = NULL;
}

static void teardown(void) {
    stop_engine();
    model_free(g_m);
}

TestSuite(engine, .init = setup, .fini = teardown, .timeout = 900);

/* ---------------------------------------------------------------- helpers */

/* chunk > 0: with the context cache's pool tier (no RAM or disk store); spec: speculation from
 * the context on. */
static engine *start_with(int ctx, int64_t pool, int max_seqs, int max_queue, int chunk, bool spec,
                          metrics **mx) {
    kv_error err = {{0}};
    *mx = metrics_create();
    cr_assert_not_null(*mx);
    engine_opts o = {.threads = 2,
                     .ctx = ctx,
                     .kv_pool_tokens = pool,
                     .max_seqs = max_seqs,
                     .max_queue = max_queue,
                     .prefill_chunk = 64,
                     .chunk_tokens = chunk,
                     .pool_cache = chunk > 0,
                     .spec = spec,
                     .draft = g_draft};
    engine *e = engine_create(g_m, &o, *mx, &err);
    cr_assert_not_null(e, "engine_create: %s", err.msg);
    g_e = e;
    g_mx = *mx;
    return e;
}

static engine *start_cached(int ctx, int64_t pool, int max_seqs, int max_queue, int chunk,
                            metrics **mx) {
    return start_with(ctx, pool, max_seqs, max_queue, chunk, false, mx);
}

static engine *start(int ctx, int64_t pool, int max_seqs, int max_queue, metrics **mx) {
    return start_cached(ctx, pool, max_seqs, max_queue, 0, mx);
}

/* A greedy (temp 0) or sampled request over text, generating exactly max_tokens tokens. */
static gen_request *request(const char *text, int n, int max_tokens, float temp, uint64_t seed) {
    gen_request *r = gen_request_create(n);
    cr_assert_not_null(r);
    kv_error err = {{0}};
    r->n_prompt = tokenizer_encode(g_m->tok, text, strlen(text), true, false, &r->prompt, &err);
    cr_assert_gt(r->n_prompt, 0, "%s", err.msg);
    r->max_tokens = max_tokens;
    r->ignore_eos = true;
    r->sp.temperature = temp;
    r->sp.seed = seed;
    r->t_arrival = clock_now_ns();
    return r;
}

static void submit_ok(engine *e, gen_request *r) {
    kv_error err = {{0}};
    cr_assert_eq(engine_submit(e, r, &err), ENGINE_SUBMIT_OK, "submit: %s", err.msg);
}

static void wait_done(gen_request *r) {
    pthread_mutex_lock(&r->mu);
    while (r->n_finished < r->n_choices) gen_request_wait(r, 100);
    pthread_mutex_unlock(&r->mu);
}

static void wait_first_token(gen_request *r) {
    pthread_mutex_lock(&r->mu);
    while (r->choices[0].n_tokens == 0 && r->n_finished < r->n_choices) gen_request_wait(r, 100);
    pthread_mutex_unlock(&r->mu);
}

/* The value of an unlabelled metric in the exposition text. */
static double metric(metrics *mx, const char *name) {
    size_t len;
    char *text = metrics_render(mx, &len);
    cr_assert_not_null(text);
    char key[128];
    snprintf(key, sizeof key, "\n%s ", name);
    const char *p = strstr(text, key);
    cr_assert_not_null(p, "metric %s missing", name);
    double v = strtod(p + strlen(key), NULL);
    free(text);
    return v;
}

/* Waits (up to 2 s) until a gauge is positive: the engine publishes them after each step, so a
 * reader that saw a token may still see the previous step's values for a moment. */
static double wait_metric_positive(metrics *mx, const char *name) {
    double v = 0;
    for (int i = 0; i < 200 && (v = metric(mx, name)) <= 0; i++) {
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    return v;
}

/* Waits until the engine has no running sequence and no KV block in use. */
static void wait_idle(metrics *mx) {
    for (int i = 0; i < 200; i++) {
        if (metric(mx, "kvserve_running_sequences") == 0 &&
            metric(mx, "kvserve_kv_pool_blocks_used") == 0)
            return;
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    cr_assert_fail("the engine did not go idle: %g sequences, %g blocks",
                   metric(mx, "kvserve_running_sequences"),
                   metric(mx, "kvserve_kv_pool_blocks_used"));
}

static const char *const PROMPTS[] = {
    "The old lighthouse keeper looked at the sea and",
    "Here is a recipe for a simple tomato soup:",
    "The three most important rules of chess are",
    "Once upon a time, in a small village in the mountains,",
};
#define N_PROMPTS 4

/* ---------------------------------------------------------------- batching */

Test(engine, batched_and_preempted_outputs_equal_alone) {
    metrics *mx;
    /* 4 sequences of ~12 + 120 tokens need ~530 slots: a 256-token pool forces preemption. */
    engine *e = start(256, 256, 4, 8, &mx);
    gen_request *together[N_PROMPTS];
    for (int i = 0; i < N_PROMPTS; i++) {
        together[i] = request(PROMPTS[i], 1, 120, 0, 0);
        submit_ok(e, together[i]);
    }
    for (int i = 0; i < N_PROMPTS; i++) wait_done(together[i]);
    cr_assert_gt(metric(mx, "kvserve_preemptions_total"), 0, "the pool never filled");
    for (int i = 0; i < N_PROMPTS; i++) {
        gen_request *alone = request(PROMPTS[i], 1, 120, 0, 0);
        submit_ok(e, alone);
        wait_done(alone);
        const gen_choice *a = &alone->choices[0], *t = &together[i]->choices[0];
        cr_assert_eq(t->finish, GEN_FINISH_LENGTH);
        cr_assert_eq(t->n_tokens, 120);
        cr_assert_str_eq(t->text, a->text, "prompt %d: batched/preempted output differs", i);
        gen_request_unref(alone);
        gen_request_unref(together[i]);
    }
    wait_idle(mx);
    stop_engine();
}

/* The same under preemption with the pool tier on: cached chunks give way before sequences,
 * restarted sequences take their prefix back from the pool, and nothing changes the output. */
Test(engine, preempted_outputs_equal_alone_with_the_pool_tier) {
    metrics *mx;
    engine *e = start_cached(256, 256, 4, 8, 32, &mx);
    cache_key ns;
    cache_namespace(NULL, 0, NULL, &ns);
    gen_request *together[N_PROMPTS];
    for (int i = 0; i < N_PROMPTS; i++) {
        together[i] = request(PROMPTS[i], 1, 120, 0, 0);
        cr_assert_eq(engine_prepare_cache(e, together[i], &ns, true), 0);
        submit_ok(e, together[i]);
    }
    for (int i = 0; i < N_PROMPTS; i++) wait_done(together[i]);
    cr_assert_gt(metric(mx, "kvserve_preemptions_total"), 0, "the pool never filled");
    for (int i = 0; i < N_PROMPTS; i++) {
        gen_request *alone = request(PROMPTS[i], 1, 120, 0, 0); /* no cache */
        submit_ok(e, alone);
        wait_done(alone);
        cr_assert_str_eq(together[i]->choices[0].text, alone->choices[0].text, "prompt %d", i);
        gen_request_unref(alone);
        gen_request_unref(together[i]);
    }
    wait_idle(mx);
    stop_engine();
}

/* A greedy answer of max_tokens to text with the context cache on (the server's namespace, in
 * *ns), its token ids recorded (logprobs), done. */
static gen_request *cached_answer(engine *e, cache_key *ns, const char *text, int max_tokens) {
    cache_namespace(NULL, 0, NULL, ns);
    gen_request *r = request(text, 1, max_tokens, 0, 0);
    r->logprobs = true; /* for the generated token ids */
    cr_assert_eq(engine_prepare_cache(e, r, ns, true), 0);
    submit_ok(e, r);
    wait_done(r);
    return r;
}

/* Reuse to the token under pressure: prompts that share part of a cached sequence's blocks
 * take those rows (cached_tokens to the token), copy the blocks they write, are preempted (their
 * own last blocks kept as they step back) while cached blocks are evicted, and every output
 * equals the same prompt computed alone without the cache. */
Test(engine, rows_shared_to_the_token_survive_preemption_and_eviction) {
    metrics *mx;
    engine *e = start_cached(256, 256, 4, 8, 32, &mx);
    cache_key ns;
    gen_request *first = cached_answer(e, &ns, PROMPTS[0], 20);
    /* the first sequence's computed history: its prompt and all but its last token */
    int n_first = first->n_prompt + 19;
    int32_t hist[256];
    memcpy(hist, first->prompt, sizeof(int32_t) * (size_t)first->n_prompt);
    for (int i = 0; i < 19; i++) hist[first->n_prompt + i] = first->choices[0].lps[i].token;
    static const char *const ENDINGS[N_PROMPTS] = {" the", " a ship", " saw", " thought of home"};
    gen_request *together[N_PROMPTS];
    char text[N_PROMPTS][256];
    for (int i = 0; i < N_PROMPTS; i++) {
        snprintf(text[i], sizeof text[i], "%s%s", PROMPTS[0], ENDINGS[i]);
        together[i] = request(text[i], 1, 120, 0, 0);
        cr_assert_eq(engine_prepare_cache(e, together[i], &ns, true), 0);
        submit_ok(e, together[i]);
    }
    for (int i = 0; i < N_PROMPTS; i++) wait_done(together[i]);
    cr_assert_gt(metric(mx, "kvserve_preemptions_total"), 0, "the pool never filled");
    engine_cache_stats st;
    engine_cache_stats_get(e, &st);
    cr_assert_geq(st.pool_partial_hits, N_PROMPTS);
    cr_assert_gt(st.pool_evictions, 0, "no cached block was evicted");
    for (int i = 0; i < N_PROMPTS; i++) {
        const gen_request *t = together[i];
        int lcp = 0;
        while (lcp < n_first && lcp < t->n_prompt && t->prompt[lcp] == hist[lcp]) lcp++;
        cr_assert_eq(t->cached_tokens, lcp < t->n_prompt ? lcp : t->n_prompt - 1,
                     "prompt %d: cached %d, shares %d", i, t->cached_tokens, lcp);
        gen_request *alone = request(text[i], 1, 120, 0, 0); /* no cache */
        submit_ok(e, alone);
        wait_done(alone);
        cr_assert_str_eq(t->choices[0].text, alone->choices[0].text, "prompt %d", i);
        gen_request_unref(alone);
    }
    for (int i = 0; i < N_PROMPTS; i++) gen_request_unref(together[i]);
    gen_request_unref(first);
    wait_idle(mx);
    stop_engine();
}

/* Chunks of generated text are stored too: a follow-up prompt made of the prompt and the
 * generated tokens reuses them, and its output equals the uncached computation. */
Test(engine, generated_chunks_are_reused) {
    metrics *mx;
    engine *e = start_cached(1024, 2048, 4, 8, 32, &mx);
    cache_key ns;
    gen_request *first = cached_answer(e, &ns, PROMPTS[1], 100);
    cr_assert_eq(first->choices[0].n_lps, 100);
    int n = first->n_prompt + 100;
    gen_request *next[2];
    for (int k = 0; k < 2; k++) {
        next[k] = request(PROMPTS[1], 1, 24, 0, 0);
        int32_t *ids = realloc(next[k]->prompt, sizeof(int32_t) * (size_t)n);
        cr_assert_not_null(ids);
        for (int i = 0; i < 100; i++) ids[first->n_prompt + i] = first->choices[0].lps[i].token;
        next[k]->prompt = ids;
        next[k]->n_prompt = n;
        if (k == 0) cr_assert_eq(engine_prepare_cache(e, next[k], &ns, true), 0);
        submit_ok(e, next[k]);
        wait_done(next[k]);
    }
    /* every token the first sequence computed: its last block's rows were kept as it ended */
    cr_assert_eq(next[0]->cached_tokens, n - 1, "cached %d of %d", next[0]->cached_tokens, n);
    cr_assert_eq(next[1]->cached_tokens, 0);
    cr_assert_str_eq(next[0]->choices[0].text, next[1]->choices[0].text);
    engine_cache_stats st;
    engine_cache_stats_get(e, &st);
    cr_assert_geq(st.pool_hits, (n - 1) / 32);
    for (int k = 0; k < 2; k++) gen_request_unref(next[k]);
    gen_request_unref(first);
    wait_idle(mx);
    stop_engine();
}

Test(engine, n_choices_fork_one_prompt) {
    metrics *mx;
    engine *e = start(512, 2048, 8, 8, &mx);
    gen_request *one = request(PROMPTS[0], 1, 24, 0, 0);
    gen_request *three = request(PROMPTS[0], 3, 24, 0, 0);
    submit_ok(e, one);
    submit_ok(e, three);
    wait_done(one);
    wait_done(three);
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(three->choices[i].n_tokens, 24);
        cr_assert_str_eq(three->choices[i].text, one->choices[0].text, "greedy choice %d", i);
    }
    /* sampled: the choices differ from each other, and the same seed repeats them */
    gen_request *s1 = request(PROMPTS[1], 3, 24, 1.0f, 42);
    gen_request *s2 = request(PROMPTS[1], 3, 24, 1.0f, 42);
    submit_ok(e, s1);
    wait_done(s1);
    submit_ok(e, s2);
    wait_done(s2);
    for (int i = 0; i < 3; i++) cr_assert_str_eq(s1->choices[i].text, s2->choices[i].text);
    cr_assert(strcmp(s1->choices[0].text, s1->choices[1].text) != 0 ||
                  strcmp(s1->choices[0].text, s1->choices[2].text) != 0,
              "three sampled choices are identical");
    gen_request_unref(one);
    gen_request_unref(three);
    gen_request_unref(s1);
    gen_request_unref(s2);
    wait_idle(mx);
    stop_engine();
}

Test(engine, logprobs_are_recorded_per_token) {
    metrics *mx;
    engine *e = start(512, 512, 2, 4, &mx);
    gen_request *r = request(PROMPTS[2], 1, 8, 0, 0);
    r->logprobs = true;
    r->top_logprobs = 5;
    submit_ok(e, r);
    wait_done(r);
    const gen_choice *c = &r->choices[0];
    cr_assert_eq(c->n_lps, 8);
    for (int i = 0; i < c->n_lps; i++) {
        const gen_logprob *lp = &c->lps[i];
        cr_assert_leq(lp->logprob, 0.0f);
        cr_assert_eq(lp->n_top, 5);
        /* greedy: the chosen token is the most likely one */
        cr_assert_eq(lp->top_ids[0], lp->token);
        cr_assert_float_eq(lp->top_lps[0], lp->logprob, 1e-4);
        for (int k = 1; k < lp->n_top; k++) cr_assert_leq(lp->top_lps[k], lp->top_lps[k - 1]);
    }
    gen_request_unref(r);
    stop_engine();
}

/* ---------------------------------------------------------------- speculation */

/* Prompts whose continuations repeat what they hold, so drafts from the context get kept. */
static const char *const SPEC_PROMPTS[] = {
    "Copy the list.\nList: apples, pears, plums, cherries, grapes, lemons, limes, figs, dates, "
    "kiwis, mangos, melons, peaches.\nCopy: apples, pears, plums,",
    "one two three four five six seven eight nine ten one two three four five six seven eight "
    "nine ten one two three",
    "The old lighthouse keeper looked at the sea and",
};
#define N_SPEC 3

typedef struct spec_run {
    char *text[N_SPEC];
    gen_logprob *lps[N_SPEC];
    int n_tokens[N_SPEC];
    engine_cache_stats cache;
    engine_spec_stats spec;
} spec_run;

/* Every SPEC_PROMPT greedy, one at a time, with logprobs, on an engine with or without
 * speculation and the pool tier; the pool is idle after. */
static void spec_outputs(bool spec, spec_run *out) {
    metrics *mx;
    engine *e = start_with(1024, 4096, 4, 8, 32, spec, &mx);
    cache_key ns;
    cache_namespace(NULL, 0, NULL, &ns);
    for (int i = 0; i < N_SPEC; i++) {
        gen_request *r = request(SPEC_PROMPTS[i], 1, 100, 0, 0);
        r->logprobs = true;
        r->top_logprobs = 3;
        cr_assert_eq(engine_prepare_cache(e, r, &ns, true), 0);
        submit_ok(e, r);
        wait_done(r);
        const gen_choice *c = &r->choices[0];
        cr_assert_eq(c->finish, GEN_FINISH_LENGTH);
        out->text[i] = strdup(c->text);
        out->n_tokens[i] = c->n_tokens;
        out->lps[i] = malloc(sizeof *c->lps * (size_t)c->n_lps);
        memcpy(out->lps[i], c->lps, sizeof *c->lps * (size_t)c->n_lps);
        if (!spec) cr_assert_eq(r->spec_drafted, 0);
        gen_request_unref(r);
    }
    wait_idle(mx);
    if (spec) {
        double drafted = metric(mx, "kvserve_spec_draft_tokens_total"),
               kept = metric(mx, "kvserve_spec_accepted_tokens_total");
        cr_assert_gt(kept, 0, "no draft was kept (%g drafted)", drafted);
        cr_assert_leq(kept, drafted);
    }
    engine_cache_stats_get(e, &out->cache);
    engine_spec_stats_get(e, &out->spec);
    stop_engine();
}

/* The two runs gave the same tokens, logprobs and cached chunks; their texts are freed. */
static void spec_runs_equal(spec_run *off, spec_run *on) {
    for (int i = 0; i < N_SPEC; i++) {
        cr_assert_eq(on->n_tokens[i], off->n_tokens[i]);
        cr_assert_str_eq(on->text[i], off->text[i], "prompt %d: speculation changed the output", i);
        for (int k = 0; k < off->n_tokens[i]; k++) {
            const gen_logprob *a = &off->lps[i][k], *b = &on->lps[i][k];
            cr_assert_eq(a->token, b->token, "prompt %d token %d", i, k);
            cr_assert_eq(a->logprob, b->logprob, "prompt %d token %d", i, k);
            cr_assert_eq(a->n_top, b->n_top);
            cr_assert_eq(memcmp(a->top_ids, b->top_ids, sizeof(int32_t) * (size_t)a->n_top), 0);
        }
        free(on->text[i]);
        free(off->text[i]);
        free(on->lps[i]);
        free(off->lps[i]);
    }
    cr_assert_eq(on->cache.pool_entries, off->cache.pool_entries);
    cr_assert_eq(on->cache.pool_blocks, off->cache.pool_blocks);
}

/* Greedy output with speculation is token for token what plain decoding gives, logprobs
 * included, and the pool tier ends up holding the same chunks (rejected rows stored nothing). */
Test(engine, speculation_keeps_greedy_outputs_logprobs_and_cached_chunks) {
    spec_run off, on;
    spec_outputs(false, &off);
    spec_outputs(true, &on);
    spec_runs_equal(&off, &on);
}

/* Two sampled requests (2 choices, seed 9) with speculation on: drafts were made and the seed
 * repeats the output. */
static void expect_seeded_repeat(engine *e, const char *prompt) {
    gen_request *s1 = request(prompt, 2, 60, 0.7f, 9);
    gen_request *s2 = request(prompt, 2, 60, 0.7f, 9);
    submit_ok(e, s1);
    wait_done(s1);
    submit_ok(e, s2);
    wait_done(s2);
    cr_assert_gt(s1->spec_drafted, 0);
    for (int i = 0; i < 2; i++) cr_assert_str_eq(s1->choices[i].text, s2->choices[i].text);
    gen_request_unref(s1);
    gen_request_unref(s2);
}

/* Four greedy requests of max_tokens tokens at once (speculating, in a pool small enough that
 * sequences are preempted), then each alone without speculation: the same outputs. */
static void expect_together_as_alone(engine *e, metrics *mx, const char *const prompts[4],
                                     int max_tokens) {
    gen_request *together[4];
    for (int i = 0; i < 4; i++) {
        together[i] = request(prompts[i], 1, max_tokens, 0, 0);
        submit_ok(e, together[i]);
    }
    for (int i = 0; i < 4; i++) wait_done(together[i]);
    cr_assert_gt(metric(mx, "kvserve_preemptions_total"), 0, "the pool never filled");
    for (int i = 0; i < 4; i++) {
        gen_request *alone = request(prompts[i], 1, max_tokens, 0, 0);
        alone->speculative = false;
        submit_ok(e, alone);
        wait_done(alone);
        cr_assert_eq(alone->spec_drafted, 0);
        cr_assert_eq(together[i]->choices[0].n_tokens, max_tokens);
        cr_assert_str_eq(together[i]->choices[0].text, alone->choices[0].text, "prompt %d", i);
        gen_request_unref(alone);
        gen_request_unref(together[i]);
    }
}

/* Four speculating sequences in a pool too small for them: sequences are preempted between
 * and during verify steps (a victim already in the step's batch leaves it, drafts and all), and
 * every output equals the plain one computed alone. */
Test(engine, speculation_under_preemption_equals_plain_decoding_alone) {
    metrics *mx;
    engine *e = start_with(256, 256, 4, 8, 0, true, &mx);
    const char *prompts[4] = {SPEC_PROMPTS[0], SPEC_PROMPTS[1], SPEC_PROMPTS[2], PROMPTS[1]};
    expect_together_as_alone(e, mx, prompts, 120);
    cr_assert_gt(metric(mx, "kvserve_spec_accepted_tokens_total"), 0);
    /* sampled with speculation: a seed repeats its output */
    expect_seeded_repeat(e, SPEC_PROMPTS[1]);
    wait_idle(mx);
    stop_engine();
}

/* ---------------------------------------------------------------- the draft model */

/* The model drafting for itself (the same file): every token it drafts is kept, and the
 * output, logprobs and cached chunks are those of plain decoding; its KV pool is empty after. */
Test(engine, a_draft_model_of_the_same_file_keeps_every_draft_and_the_output) {
    spec_run off, on;
    spec_outputs(false, &off);
    g_draft = g_m;
    spec_outputs(true, &on);
    g_draft = NULL;
    cr_assert_str_eq(on.spec.draft_model, TEST_MODEL_PATH);
    cr_assert_gt(on.spec.model_drafted, 100, "%lld", (long long)on.spec.model_drafted);
    cr_assert_eq(on.spec.model_accepted, on.spec.model_drafted);
    cr_assert_gt(on.spec.draft_seconds, 0);
    spec_runs_equal(&off, &on);
}

/* The model requantized (Q8_0) drafting for it, four sequences at once in a pool too small for
 * them (preempted between and during verify steps, draft KV dropped and caught up again): every
 * greedy output equals plain decoding's alone, most drafted tokens are kept (89% measured: the
 * two quantizations part on near-ties under the 8-bit activation matmuls), a sampled
 * request's seed repeats its output, and both pools are empty once the engine is idle. */
Test(engine, a_requantized_draft_model_keeps_greedy_outputs_under_preemption) {
    model *dm = model_fixture_load_path(TEST_DRAFT_MODEL_PATH);
    metrics *mx;
    g_draft = dm;
    engine *e = start_with(320, 320, 4, 8, 0, true, &mx);
    g_draft = NULL;
    const char *prompts[4] = {SPEC_PROMPTS[0], PROMPTS[0], SPEC_PROMPTS[2], PROMPTS[1]};
    expect_together_as_alone(e, mx, prompts, 150);
    engine_spec_stats st;
    engine_spec_stats_get(e, &st);
    cr_assert_gt(st.model_drafted, 100, "%lld", (long long)st.model_drafted);
    cr_assert_geq((double)st.model_accepted, 0.85 * (double)st.model_drafted, "%lld of %lld kept",
                  (long long)st.model_accepted, (long long)st.model_drafted);
    expect_seeded_repeat(e, PROMPTS[2]);
    wait_idle(mx);
    cr_assert_eq(metric(mx, "kvserve_draft_kv_pool_blocks_used"), 0);
    stop_engine();
    model_free(dm);
}

/* A draft model of another vocabulary is refused, naming both files; with --spec off no draft
 * model is used at all. */
Test(engine, a_draft_model_of_another_vocabulary_is_refused) {
    model *other = model_fixture_load_path(TEST_OTHER_VOCAB_PATH);
    kv_error err = {{0}};
    metrics *mx = metrics_create();
    engine_opts o = {.threads = 2,
                     .ctx = 256,
                     .kv_pool_tokens = 256,
                     .max_seqs = 2,
                     .max_queue = 2,
                     .prefill_chunk = 64,
                     .spec = true,
                     .draft = other};
    cr_assert_null(engine_create(g_m, &o, mx, &err));
    cr_assert(strstr(err.msg, TEST_OTHER_VOCAB_PATH) && strstr(err.msg, TEST_MODEL_PATH) &&
                  strstr(err.msg, "vocabulary"),
              "%s", err.msg);
    metrics_destroy(mx);
    g_draft = g_m;
    engine *e = start_with(256, 256, 2, 2, 0, false, &mx);
    g_draft = NULL;
    engine_spec_stats st;
    engine_spec_stats_get(e, &st);
    cr_assert_null(st.draft_model);
    stop_engine();
    model_free(other);
}

/* ---------------------------------------------------------------- lifecycle */

Test(engine, cancel_frees_the_sequence) {
    metrics *mx;
    engine *e = start(4096, 4096, 2, 4, &mx);
    gen_request *r = request(PROMPTS[3], 1, 4000, 0, 0);
    submit_ok(e, r);
    wait_first_token(r);
    cr_assert_gt(wait_metric_positive(mx, "kvserve_kv_pool_blocks_used"), 0);
    atomic_store(&r->cancelled, true);
    wait_idle(mx);
    cr_assert_lt(r->choices[0].n_tokens, 4000);
    gen_request_unref(r);
    stop_engine();
}

Test(engine, queue_limit_and_invalid_requests) {
    metrics *mx;
    engine *e = start(256, 256, 1, 1, &mx);
    kv_error err = {{0}};
    gen_request *a = request(PROMPTS[0], 1, 200, 0, 0);
    submit_ok(e, a);
    wait_first_token(a); /* a runs: the one sequence slot is taken */
    gen_request *b = request(PROMPTS[1], 1, 8, 0, 0);
    submit_ok(e, b); /* waits in the queue */
    gen_request *c = request(PROMPTS[2], 1, 8, 0, 0);
    cr_assert_eq(engine_submit(e, c, &err), ENGINE_SUBMIT_QUEUE_FULL);
    cr_assert(strstr(err.msg, "busy"), "%s", err.msg);

    gen_request *two = request(PROMPTS[2], 2, 8, 0, 0);
    cr_assert_eq(engine_submit(e, two, &err), ENGINE_SUBMIT_INVALID);
    cr_assert(strstr(err.msg, "n = 2"), "%s", err.msg);
    gen_request *bad_id = request(PROMPTS[2], 1, 8, 0, 0);
    bad_id->prompt[1] = g_m->hp.n_vocab;
    cr_assert_eq(engine_submit(e, bad_id, &err), ENGINE_SUBMIT_INVALID);
    cr_assert(strstr(err.msg, "outside the vocabulary"), "%s", err.msg);
    gen_request *bad_p = request(PROMPTS[2], 1, 8, 0, 0);
    bad_p->sp.top_p = 2.0f;
    cr_assert_eq(engine_submit(e, bad_p, &err), ENGINE_SUBMIT_INVALID);
    gen_request *long_p = gen_request_create(1);
    long_p->n_prompt = 256;
    long_p->prompt = calloc(256, sizeof(int32_t));
    long_p->max_tokens = 1;
    cr_assert_eq(engine_submit(e, long_p, &err), ENGINE_SUBMIT_INVALID);
    cr_assert(strstr(err.msg, "256 tokens"), "%s", err.msg);

    atomic_store(&a->cancelled, true);
    wait_done(b); /* the queued request runs once a's slot is free */
    cr_assert_eq(b->choices[0].finish, GEN_FINISH_LENGTH);
    wait_idle(mx);
    gen_request *reqs[] = {a, b, c, two, bad_id, bad_p, long_p};
    for (size_t i = 0; i < sizeof reqs / sizeof reqs[0]; i++) gen_request_unref(reqs[i]);
    stop_engine();
}

Test(engine, a_group_takes_one_place_in_the_queue_and_takes_turns) {
    metrics *mx;
    engine *e = start(256, 256, 1, 2, &mx);
    kv_error err = {{0}};
    gen_request *a = request(PROMPTS[0], 1, 200, 0, 0);
    submit_ok(e, a);
    wait_first_token(a); /* a runs: the one sequence slot is taken */
    /* three prompts, more than the queue holds, in one place of it */
    gen_request *g[3];
    for (int i = 0; i < 3; i++) g[i] = request(PROMPTS[i + 1], 1, 8, 0, 0);
    cr_assert_eq(engine_submit_group(e, g, 3, &err), ENGINE_SUBMIT_OK, "%s", err.msg);
    gen_request *b = request(PROMPTS[2], 1, 8, 0, 0);
    submit_ok(e, b); /* the second place */
    gen_request *c = request(PROMPTS[3], 1, 8, 0, 0);
    cr_assert_eq(engine_submit(e, c, &err), ENGINE_SUBMIT_QUEUE_FULL);
    /* a group with an invalid member is refused whole, naming it */
    gen_request *bad[2] = {request(PROMPTS[1], 1, 8, 0, 0), request(PROMPTS[2], 1, 8, 0, 0)};
    bad[1]->prompt[0] = -1;
    cr_assert_eq(engine_submit_group(e, bad, 2, &err), ENGINE_SUBMIT_INVALID);
    cr_assert(strstr(err.msg, "request 1 of 2"), "%s", err.msg);

    atomic_store(&a->cancelled, true);
    for (int i = 0; i < 3; i++) wait_done(g[i]);
    wait_done(b);
    /* each alone gives the same text (the slot is taken one request at a time) */
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(g[i]->choices[0].finish, GEN_FINISH_LENGTH);
        gen_request *alone = request(PROMPTS[i + 1], 1, 8, 0, 0);
        submit_ok(e, alone);
        wait_done(alone);
        cr_assert_str_eq(g[i]->choices[0].text, alone->choices[0].text);
        gen_request_unref(alone);
    }
    /* b, queued after the group, went in after its first request, not after its last */
    cr_assert_lt(g[0]->t_first_token, b->t_first_token);
    cr_assert_lt(b->t_first_token, g[1]->t_first_token);
    cr_assert_lt(g[1]->t_first_token, g[2]->t_first_token);
    wait_idle(mx);
    gen_request *reqs[] = {a, g[0], g[1], g[2], b, c, bad[0], bad[1]};
    for (size_t i = 0; i < sizeof reqs / sizeof reqs[0]; i++) gen_request_unref(reqs[i]);
    stop_engine();
}

Test(engine, a_cancelled_group_leaves_the_queue) {
    metrics *mx;
    engine *e = start(256, 256, 1, 1, &mx);
    kv_error err = {{0}};
    gen_request *a = request(PROMPTS[0], 1, 200, 0, 0);
    submit_ok(e, a);
    wait_first_token(a);
    gen_request *g[3];
    for (int i = 0; i < 3; i++) g[i] = request(PROMPTS[i + 1], 1, 8, 0, 0);
    cr_assert_eq(engine_submit_group(e, g, 3, &err), ENGINE_SUBMIT_OK, "%s", err.msg);
    for (int i = 0; i < 3; i++) atomic_store(&g[i]->cancelled, true); /* the client went away */
    atomic_store(&a->cancelled, true);
    gen_request *b = request(PROMPTS[1], 1, 8, 0, 0);
    engine_submit_status st = ENGINE_SUBMIT_QUEUE_FULL;
    for (int i = 0; i < 200; i++) { /* the group's place frees once the engine drops it */
        if ((st = engine_submit(e, b, &err)) == ENGINE_SUBMIT_OK) break;
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    cr_assert_eq(st, ENGINE_SUBMIT_OK, "the cancelled group kept its place: %s", err.msg);
    wait_done(b);
    cr_assert_eq(b->choices[0].finish, GEN_FINISH_LENGTH);
    for (int i = 0; i < 3; i++) cr_assert_eq(g[i]->choices[0].n_tokens, 0);
    wait_idle(mx);
    gen_request *reqs[] = {a, g[0], g[1], g[2], b};
    for (size_t i = 0; i < sizeof reqs / sizeof reqs[0]; i++) gen_request_unref(reqs[i]);
    stop_engine();
}

Test(engine, stop_ends_streams_with_an_error) {
    metrics *mx;
    engine *e = start(4096, 4096, 1, 4, &mx);
    gen_request *run = request(PROMPTS[0], 1, 4000, 0, 0);
    gen_request *queued = request(PROMPTS[1], 1, 8, 0, 0);
    submit_ok(e, run);
    wait_first_token(run);
    submit_ok(e, queued);
    gen_request *g[2] = {request(PROMPTS[2], 1, 8, 0, 0), request(PROMPTS[3], 1, 8, 0, 0)};
    kv_error gerr = {{0}};
    cr_assert_eq(engine_submit_group(e, g, 2, &gerr), ENGINE_SUBMIT_OK, "%s", gerr.msg);
    engine_stop(e);
    gen_request *ended[] = {run, queued, g[0], g[1]};
    for (int i = 0; i < 4; i++) {
        gen_request *r = ended[i];
        wait_done(r);
        cr_assert_eq(r->choices[0].finish, GEN_FINISH_ERROR);
        cr_assert_eq(r->error_status, 503);
        cr_assert(strstr(r->error, "shutting down"), "%s", r->error);
    }
    kv_error err = {{0}};
    gen_request *late = request(PROMPTS[2], 1, 8, 0, 0);
    cr_assert_eq(engine_submit(e, late, &err), ENGINE_SUBMIT_SHUTTING_DOWN);
    for (int i = 0; i < 4; i++) gen_request_unref(ended[i]);
    gen_request_unref(late);
    stop_engine();
}
