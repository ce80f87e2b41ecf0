/* `kvserve bench`: prefill and decode throughput in llama-bench's terms. ppN prefills N tokens
 * into an empty context (in ENGINE_SLICE slices); tgN decodes N tokens one at a time from an
 * empty context; ppN@D and tgN@D do so after D tokens of context (pp16@1024 is the step a warm
 * request with a cached 1K-token prefix pays for its question). -T runs any such test. Tokens are
 * pseudo-random ids: the speed of a dense model does not depend on which tokens run. One warm-up
 * run, then the mean and standard deviation over the repetitions. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/model.h"
#include "server/cli/cli.h"
#include "server/cli/cli_common.h"

typedef struct bench_test {
    const char *name;
    int n_prompt; /* prefill tokens timed */
    int n_gen;    /* decode steps timed */
    int depth;    /* context filled before timing */
} bench_test;

#define BENCH_MAX_CTX 32768

static const bench_test TESTS[] = {
    {"pp512", 512, 0, 0},
    {"pp2048", 2048, 0, 0},
    {"tg128", 0, 128, 0},
    {"tg64@4096", 0, 64, 4096},
};

static void fill_tokens(int32_t *ids, int n, int n_vocab, uint64_t *state) {
    for (int i = 0; i < n; i++) {
        *state = *state * 6364136223846793005ull + 1442695040888963407ull;
        ids[i] = (int32_t)((*state >> 33) % (uint64_t)n_vocab);
    }
}

/* Fills the context of test t (D tokens; the runs of a test share it). */
static int bench_fill(engine_single *e, const bench_test *t, int32_t *ids, kv_error *err) {
    uint64_t rng = 42;
    engine_single_reset(e);
    fill_tokens(ids, t->depth, e->m->hp.n_vocab, &rng);
    return t->depth > 0 ? engine_single_prefill(e, ids, t->depth, err) : 0;
}

/* Seconds for one run of the test over its filled context, or a negative value on error. */
static double bench_run(engine_single *e, const bench_test *t, int32_t *ids, kv_error *err) {
    uint64_t rng = 7;
    kv_seq_truncate(e->pool, &e->seq, t->depth);
    fill_tokens(ids, t->n_prompt + t->n_gen, e->m->hp.n_vocab, &rng);
    uint64_t t0 = clock_now_ns();
    if (t->n_prompt > 0 && engine_single_prefill(e, ids, t->n_prompt, err)) return -1;
    for (int i = 0; i < t->n_gen; i++)
        if (engine_single_decode(e, ids[t->n_prompt + i], err)) return -1;
    return (clock_now_ns() - t0) / 1e9;
}

/* ---------------------------------------------------------------- read bandwidth
 *
 * Decode at batch 1 reads every weight once per token, so its bound is the memory's read
 * bandwidth: `--read-bandwidth` measures it with the same thread count, each thread summing its
 * slice of a buffer well beyond any cache (best of 5 passes). */

#define BW_BYTES ((size_t)1 << 30)

typedef struct bw_slice {
    const uint64_t *p;
    size_t n;
    uint64_t sum;
} bw_slice;

static void *bw_read(void *arg) {
    bw_slice *s = arg;
    uint64_t a = 0, b = 0, c = 0, d = 0;
    for (size_t i = 0; i + 4 <= s->n; i += 4) {
        a += s->p[i];
        b += s->p[i + 1];
        c += s->p[i + 2];
        d += s->p[i + 3];
    }
    s->sum = a + b + c + d;
    return NULL;
}

/* GB/s (1e9 bytes), or a negative value when out of memory or threads. */
static double bench_read_bandwidth(int threads) {
    uint64_t *buf = malloc(BW_BYTES);
    if (!buf || threads > 256) {
        free(buf);
        return -1;
    }
    size_t words = BW_BYTES / 8;
    for (size_t i = 0; i < words; i++) buf[i] = i; /* committed, not the zero page */
    double best = 0;
    for (int pass = 0; pass < 5; pass++) {
        pthread_t th[256];
        bw_slice sl[256];
        uint64_t t0 = clock_now_ns();
        int started = 0;
        for (int t = 0; t < threads; t++) {
            sl[t] = (bw_slice){buf + words / threads * t, words / threads, 0};
            if (pthread_create(&th[t], NULL, bw_read, &sl[t]) != 0) break;
            started++;
        }
        for (int t = 0; t < started; t++) pthread_join(th[t], NULL);
        double s = (clock_now_ns() - t0) / 1e9;
        if (started < threads) {
            free(buf);
            return -1;
        }
        uint64_t check = 0;
        for (int t = 0; t < threads; t++) check += sl[t].sum;
        if (check == 0) s = 0; /* keeps the sums alive; never true for this buffer */
        double gbs = (double)(words / threads * threads * 8) / s / 1e9;
        best = gbs > best ? gbs : best;
    }
    free(buf);
    return best;
}

/* -T TEST: ppN, tgN, ppN@D or tgN@D (N >= 1, N + D <= BENCH_MAX_CTX). */
static int parse_test(void *dst, const char *arg, kv_error *err) {
    bench_test *t = dst;
    int n = 0, d = 0, used = 0;
    char kind[3] = {0};
    if (sscanf(arg, "%2[a-z]%d%n", kind, &n, &used) != 2 ||
        (strcmp(kind, "pp") != 0 && strcmp(kind, "tg") != 0))
        return kv_fail(err, "--test: '%s' is not ppN, tgN, ppN@D or tgN@D", arg);
    int more = 0;
    if (arg[used] == '@' && sscanf(arg + used + 1, "%d%n", &d, &more) == 1) used += 1 + more;
    if (arg[used] != '\0' || n < 1 || d < 0 || n > BENCH_MAX_CTX - d)
        return kv_fail(err,
                       "--test: '%s' is not ppN, tgN, ppN@D or tgN@D with N >= 1 and N + D "
                       "<= %d",
                       arg, BENCH_MAX_CTX);
    *t = (bench_test){arg, kind[0] == 'p' ? n : 0, kind[0] == 't' ? n : 0, d};
    return 0;
}

static void usage(FILE *out) {
    fprintf(out, "usage: kvserve bench -m MODEL [-t THREADS] [-r REPETITIONS] [-T TEST] "
                 "[--precise] [--simd auto|avx512|avx2|scalar] [--device auto|cuda|cpu] "
                 "[--read-bandwidth]\n"
                 "tests: pp512 pp2048 tg128 tg64@4096 (default), or any ppN, tgN, ppN@D, tgN@D\n"
                 "--read-bandwidth: also the memory's read bandwidth with THREADS threads\n");
}

int cli_bench(int argc, char **argv) {
    log_set_level(LOG_LEVEL_WARN);
    engine_model_opts mo = {.threads = 2, .device = "auto"};
    bench_test only = {0};
    int reps = 3;
    bool read_bw = false;
    const cli_opt opts[] = {
        CLI_MODEL_OPT(&mo),
        CLI_THREADS_OPT(&mo),
        {"repetitions", 'r', CLI_OPT_INT, .dst = &reps, .min = 1, .max = 100},
        {"test", 'T', CLI_OPT_FN, .dst = &only, .fn = parse_test},
        {"precise", 'P', CLI_OPT_FLAG, .dst = &mo.precise},
        CLI_SIMD_OPT(&mo),
        CLI_DEVICE_OPT(&mo),
        {"read-bandwidth", 0, CLI_OPT_FLAG, .dst = &read_bw},
    };
    const cli_command cmd = {"kvserve bench", usage, opts, sizeof opts / sizeof opts[0]};
    int rc = cli_parse(&cmd, argc, argv);
    if (rc >= 0) return rc;
    rc = 1;
    kv_error err = {{0}};
    engine_single e = {0};
    const bench_test *tests = only.name ? &only : TESTS;
    int n_tests = only.name ? 1 : (int)(sizeof TESTS / sizeof TESTS[0]);
    int ctx = 0;
    for (int ti = 0; ti < n_tests; ti++) {
        int need = tests[ti].depth + tests[ti].n_prompt + tests[ti].n_gen;
        ctx = need > ctx ? need : ctx;
    }
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)ctx);
    if (!ids) {
        kv_fail(&err, "out of memory");
        goto done;
    }
    if (engine_single_load(&e, &mo, &err) || engine_single_start(&e, ctx, &err)) goto done;
    const model *m = e.m;
    int64_t n_params = 0;
    for (int64_t i = 0; i < gguf_tensor_count(m->gguf); i++) {
        const gguf_tensor *t = gguf_tensor_at(m->gguf, i);
        n_params += t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3];
    }
    printf("| model | size | params | backend | threads | SIMD | test | t/s |\n");
    printf("| --- | ---: | ---: | --- | ---: | --- | ---: | ---: |\n");
    for (int ti = 0; ti < n_tests; ti++) {
        const bench_test *t = &tests[ti];
        if (bench_fill(&e, t, ids, &err) || bench_run(&e, t, ids, &err) < 0)
            goto done; /* warm-up */
        double sum = 0, sum2 = 0;
        for (int r = 0; r < reps; r++) {
            double s = bench_run(&e, t, ids, &err);
            if (s < 0) goto done;
            double tps = (t->n_prompt + t->n_gen) / s;
            sum += tps;
            sum2 += tps * tps;
        }
        double mean = sum / reps,
               sd = reps > 1 ? sqrt(fmax(0, (sum2 - sum * mean) / (reps - 1))) : 0;
        printf("| %s | %.1f MiB | %.1f M | %s | %d | %s | %s | %.2f ± %.2f |\n", m->name,
               model_weight_bytes(m) / 1048576.0, n_params / 1e6, backend_name(e.b), mo.threads,
               simd_level_name(simd_level_get()), t->name, mean, sd);
        fflush(stdout);
    }
    if (read_bw) {
        double gbs = bench_read_bandwidth(mo.threads);
        if (gbs < 0) {
            kv_fail(&err, "read bandwidth: out of memory or threads");
            goto done;
        }
        printf("read bandwidth: %.2f GB/s with %d threads\n", gbs, mo.threads);
    }
    rc = 0;
done:
    if (rc) fprintf(stderr, "kvserve bench: %s\n", err.msg);
    engine_single_free(&e);
    free(ids);
    return rc;
}
