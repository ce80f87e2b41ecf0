/* `kvserve codec-eval`: size, speed and quality of the CacheGen codec's levels and of the
 * baselines (fp16, 8-bit and 4-bit per-token uniform quantization) on a model's real KV.
 *
 * The text's first --ctx tokens are the context: their KV is computed once, cut into chunks, and
 * for each method every chunk is encoded and decoded (timed; decode on --threads threads). The
 * decoded KV then replaces the context's KV in the pool and two quality measures run over it:
 *   perplexity  of the --heldout tokens that follow the context in the text, each predicted from
 *               the decoded context plus the true tokens before it;
 *   agreement   over 64 tokens the model generates greedily from the exact context: fed those
 *               tokens (teacher-forced), the share of positions where the argmax over the
 *               decoded context equals the argmax over the exact context. Free-running
 *               generation is all or nothing (one early difference changes every later token),
 *               so it is reported only as the length of the common prefix.
 * With --windows W the text is cut into W consecutive (context, held-out) windows and every
 * figure sums over them: a single window's perplexity moves by a percent or two between settings
 * that should rank the other way. Relative figures compare with the exact KV in the same run. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/codec/codec.h"
#include "model/model.h"
#include "model/sampler.h"
#include "server/cli/cli.h"
#include "server/cli/cli_common.h"

#define EVAL_GEN 64
/* The baselines, methods 0..N_UNIFORM-1: per-token uniform quantization at these bits (16:
 * fp16); the table's levels follow. */
#define N_UNIFORM 3
static const int UNIFORM_BITS[N_UNIFORM] = {16, 8, 4};

/* The command line. */
typedef struct eval_args {
    engine_model_opts mo;
    const char *text_path;
    const char *table_path; /* NULL: MODEL.kvcodec */
    int n_ctx, n_held, chunk, n_win;
} eval_args;

/* Sums over windows. */
typedef struct eval_result {
    double nll;   /* held-out negative log-likelihood */
    int n_scored; /* held-out tokens scored */
    int agree;    /* teacher-forced argmax matches */
    int n_agree;  /* positions compared */
    int prefix;   /* free-running common prefix tokens */
    size_t bytes;
    uint64_t t_enc, t_dec;
} eval_result;

/* One run: the engine, the text, the KV buffers and the sums. */
typedef struct eval_ctx {
    engine_single e;
    const model *m;
    int n_ctx, n_held, chunk, nl, nc;
    int n_win, n_chunks; /* windows; chunks per context */
    const char *table_path;
    char *auto_table; /* table_path when none was given (owned) */
    codec_table table;
    codec_shape sh;   /* one chunk */
    size_t ce;        /* floats in one chunk's KV: [layer][kv][token][channel] */
    int32_t *all_ids; /* text tokens (owned): every window's context then held-out */
    int32_t *ids;     /* the current window's, in all_ids */
    float *ref;       /* [n_chunks][layer][kv][token][channel] f32: the exact context's KV */
    float *dec;       /* the same for the KV a method decoded */
    uint8_t *buf;     /* [cap] one coded chunk */
    size_t cap;
    int32_t gen[EVAL_GEN];
    /* The argmax at each of the 64 teacher-forced positions over the exact KV: agreement is
     * measured against these, computed the same way, so exact KV agrees 100% by construction
     * (the free-running tokens came from one-token decode steps, whose float summation order
     * differs from a batched pass). */
    int32_t ref_am[EVAL_GEN];
    bool have_ref;
    int n_meth; /* N_UNIFORM + the table's levels */
    eval_result exact, res[N_UNIFORM + CODEC_MAX_LEVELS];
    uint64_t t_prefill; /* the exact contexts' prefills, all windows */
} eval_ctx;

static void usage(FILE *out) {
    fprintf(out, "usage: kvserve codec-eval -m MODEL --text FILE [options]\n\n"
                 "  -m, --model PATH     GGUF model (required)\n"
                 "      --text FILE      text: the context, then the held-out continuation\n"
                 "      --table PATH     codec table (default: MODEL.kvcodec, from calibrate)\n"
                 "      --ctx N          context tokens (default 1024; whole chunks)\n"
                 "      --heldout N      held-out tokens for perplexity (default 256)\n"
                 "      --chunk N        tokens per chunk (default 256)\n"
                 "      --windows N      consecutive windows of the text to sum over (default 1)\n"
                 "  -t, --threads N      threads (default 2)\n");
}

/* -1 to go on, else the exit status (cli_parse). */
static int parse_args(int argc, char **argv, eval_args *a) {
    *a = (eval_args){.mo = {.threads = 2}, .n_ctx = 1024, .n_held = 256, .chunk = 256, .n_win = 1};
    const cli_opt opts[] = {
        CLI_MODEL_OPT(&a->mo),
        {"text", 0, CLI_OPT_STRING, .dst = &a->text_path, .required = "FILE"},
        {"table", 0, CLI_OPT_STRING, .dst = &a->table_path},
        {"ctx", 0, CLI_OPT_INT, .dst = &a->n_ctx, .min = 16, .max = 1 << 20},
        {"heldout", 0, CLI_OPT_INT, .dst = &a->n_held, .min = 2, .max = 1 << 20},
        {"chunk", 0, CLI_OPT_INT, .dst = &a->chunk, .min = 16, .max = 65536},
        CLI_THREADS_OPT(&a->mo),
        {"windows", 0, CLI_OPT_INT, .dst = &a->n_win, .min = 1, .max = 1000},
    };
    const cli_command cmd = {"kvserve codec-eval", usage, opts, sizeof opts / sizeof opts[0]};
    return cli_parse(&cmd, argc, argv);
}

/* ---------------------------------------------------------------- scoring */

/* What engine_single_rows' rows add up to in run_scored. */
typedef struct scored {
    const int32_t *next; /* token after row i (-1: not scored) */
    int n_vocab;
    double nll;
    int n;
    int32_t *am; /* each row's argmax, or NULL */
} scored;

static int score_row(void *ud, int i, const float *row) {
    scored *sc = ud;
    int32_t am = sampler_argmax(row, sc->n_vocab);
    float mx = row[am];
    if (sc->am) sc->am[i] = am;
    if (sc->next[i] < 0) return 0;
    double sum = 0;
    for (int v = 0; v < sc->n_vocab; v++) sum += exp((double)row[v] - mx);
    sc->nll += mx + log(sum) - row[sc->next[i]];
    sc->n++;
    return 0;
}

/* Runs tokens [from, to) of seq (KV before `from` already in the pool) and adds the negative
 * log-likelihood of each next token next[i] (i = row - from; -1: not scored) to *nll; am_out
 * (NULL: not wanted) receives each row's argmax. */
static int run_scored(eval_ctx *c, const int32_t *seq, int from, int to, const int32_t *next,
                      double *nll, int *n_scored, int32_t *am_out, kv_error *err) {
    scored sc = {.next = next, .n_vocab = c->m->hp.n_vocab, .am = am_out};
    if (engine_single_rows(&c->e, seq, from, to, score_row, &sc, err)) return -1;
    *nll += sc.nll;
    *n_scored += sc.n;
    return 0;
}

/* Puts kv (f32 [chunk][layer][kv][token][channel] for the first n_ctx - 1 tokens' chunks) into
 * the pool as the sequence's KV for slots 0..n_ctx-2; the last context token is recomputed by
 * the scored run, so its logits come from the decoded KV. */
static int load_kv(eval_ctx *c, const float *kv, kv_error *err) {
    return engine_single_write_kv(&c->e, c->n_ctx - 1, c->chunk, kv, err);
}

/* Quality of the context KV now in the pool (slots 0..n_ctx-2). */
static int measure(eval_ctx *c, eval_result *out, kv_error *err) {
    /* perplexity of the held-out tokens */
    double nll = 0;
    int n = 0;
    const int32_t *held_next = c->ids + c->n_ctx; /* token after position n_ctx - 1 + i */
    int32_t *next = malloc(sizeof(int32_t) * (size_t)c->n_held);
    if (!next) return kv_fail(err, "out of memory");
    for (int i = 0; i < c->n_held; i++) next[i] = i < c->n_held - 1 ? held_next[i] : -1;
    int rc =
        run_scored(c, c->ids, c->n_ctx - 1, c->n_ctx - 1 + c->n_held, next, &nll, &n, NULL, err);
    free(next);
    if (rc) return -1;
    out->nll += nll;
    out->n_scored += n;
    /* teacher-forced agreement with the exact context's greedy tokens: the last context token
     * then the generated ones, each row scored on the next */
    int32_t want[EVAL_GEN + 1], am[EVAL_GEN + 1];
    memcpy(want, c->gen, sizeof c->gen);
    want[EVAL_GEN] = -1;
    n = 0;
    nll = 0;
    int32_t *full = malloc(sizeof(int32_t) * (size_t)(c->n_ctx + EVAL_GEN));
    if (!full) return kv_fail(err, "out of memory");
    memcpy(full, c->ids, sizeof(int32_t) * (size_t)c->n_ctx);
    memcpy(full + c->n_ctx, c->gen, sizeof c->gen);
    rc = run_scored(c, full, c->n_ctx - 1, c->n_ctx + EVAL_GEN - 1, want, &nll, &n, am, err);
    free(full);
    if (rc) return -1;
    if (!c->have_ref) {
        memcpy(c->ref_am, am, sizeof c->ref_am);
        c->have_ref = true;
    }
    int ok = 0;
    for (int i = 0; i < EVAL_GEN; i++) ok += am[i] == c->ref_am[i];
    out->agree += ok;
    out->n_agree += EVAL_GEN;
    /* free-running common prefix */
    kv_seq_truncate(c->e.pool, &c->e.seq, c->n_ctx - 1);
    int32_t t = c->ids[c->n_ctx - 1];
    for (int i = 0; i < EVAL_GEN; i++) {
        if (engine_single_decode(&c->e, t, err)) return -1;
        t = sampler_argmax(c->e.logits, c->m->hp.n_vocab);
        if (t != c->gen[i]) break;
        out->prefix++;
    }
    return 0;
}

/* ---------------------------------------------------------------- setup */

/* The model, its codec table, the text's tokens (enough for every window), the engine and the
 * buffers; on failure c holds what was made, for eval_close. */
static int eval_open(eval_ctx *c, const eval_args *a, kv_error *err) {
    c->chunk = a->chunk;
    c->n_ctx = a->n_ctx / a->chunk * a->chunk;
    c->n_held = a->n_held;
    c->n_win = a->n_win;
    if (c->n_ctx < c->chunk)
        return kv_fail(err, "--ctx must hold at least one chunk of %d tokens", c->chunk);
    if (engine_single_load(&c->e, &a->mo, err)) return -1;
    const model *m = c->m = c->e.m;
    c->nl = m->hp.n_layer;
    c->nc = m->hp.n_kv_head * m->hp.head_dim;
    c->table_path = a->table_path;
    if (!c->table_path) {
        if (asprintf(&c->auto_table, "%s.kvcodec", a->mo.path) < 0) {
            c->auto_table = NULL;
            return kv_fail(err, "out of memory");
        }
        c->table_path = c->auto_table;
    }
    if (codec_table_load(&c->table, c->table_path, m->identity, err))
        return kv_fail_wrap(err, "%s (run `kvserve calibrate -m %s` first)", c->table_path,
                            a->mo.path);
    char *text = kv_read_file(a->text_path, SIZE_MAX, NULL, err);
    if (!text) return -1;
    int n_text = tokenizer_encode(m->tok, text, strlen(text), tokenizer_add_bos(m->tok), false,
                                  &c->all_ids, err);
    free(text);
    if (n_text < 0) return -1;
    int win = c->n_ctx + c->n_held;
    if (n_text < (int64_t)win * c->n_win)
        return kv_fail(err, "%s has %d tokens: %d windows of --ctx %d + --heldout %d are needed",
                       a->text_path, n_text, c->n_win, c->n_ctx, c->n_held);
    if (engine_single_start(&c->e, win + EVAL_GEN + 16, err)) return -1;
    c->n_chunks = c->n_ctx / c->chunk;
    c->ce = (size_t)c->nl * 2 * (size_t)c->chunk * (size_t)c->nc;
    c->sh = (codec_shape){c->nl, c->chunk, c->nc};
    c->cap = codec_encode_bound(&c->table, c->chunk);
    size_t ucap = codec_uniform_bytes(&c->sh, 16);
    if (ucap > c->cap) c->cap = ucap;
    c->n_meth = N_UNIFORM + c->table.n_levels;
    if (!(c->buf = malloc(c->cap)) ||
        !(c->ref = malloc(sizeof(float) * c->ce * (size_t)c->n_chunks)) ||
        !(c->dec = malloc(sizeof(float) * c->ce * (size_t)c->n_chunks)))
        return kv_fail(err, "out of memory");
    return 0;
}

static void eval_close(eval_ctx *c) {
    codec_table_free(&c->table);
    free(c->ref);
    free(c->dec);
    free(c->buf);
    free(c->all_ids);
    free(c->auto_table);
    engine_single_free(&c->e);
}

/* ---------------------------------------------------------------- one window */

/* The exact context of window w: its KV (prefill timed) in c->ref, 64 greedy tokens from it in
 * c->gen, and its quality as the reference. */
static int eval_exact(eval_ctx *c, int w, kv_error *err) {
    c->ids = c->all_ids + (size_t)w * (size_t)(c->n_ctx + c->n_held);
    engine_single_reset(&c->e);
    uint64_t tp = clock_now_ns();
    if (engine_single_prefill(&c->e, c->ids, c->n_ctx, err)) return -1;
    c->t_prefill += clock_now_ns() - tp;
    for (int i = 0; i < EVAL_GEN; i++) {
        c->gen[i] = sampler_argmax(c->e.logits, c->m->hp.n_vocab);
        if (engine_single_decode(&c->e, c->gen[i], err)) return -1;
    }
    if (engine_single_read_kv(&c->e, c->n_chunks, c->chunk, c->ref, err)) return -1;
    c->have_ref = false;
    if (load_kv(c, c->ref, err)) return -1;
    return measure(c, &c->exact, err);
}

/* Method meth codes every chunk of c->ref and decodes it into c->dec (each step timed). */
static int eval_code(eval_ctx *c, int meth, eval_result *r, kv_error *err) {
    for (int k = 0; k < c->n_chunks; k++) {
        const float *x = c->ref + (size_t)k * c->ce;
        float *y = c->dec + (size_t)k * c->ce;
        uint64_t t0 = clock_now_ns();
        int64_t len;
        if (meth < N_UNIFORM)
            len = codec_uniform_encode(x, &c->sh, UNIFORM_BITS[meth], c->buf, err)
                      ? -1
                      : (int64_t)codec_uniform_bytes(&c->sh, UNIFORM_BITS[meth]);
        else
            len = codec_encode_chunk(&c->table, meth - N_UNIFORM, x, c->chunk, k * c->chunk, c->buf,
                                     c->cap, err);
        uint64_t t1 = clock_now_ns();
        if (len < 0) return -1;
        int rc = meth < N_UNIFORM
                     ? codec_uniform_decode(c->buf, (size_t)len, &c->sh, UNIFORM_BITS[meth], y, err)
                     : codec_decode_chunk(&c->table, c->buf, (size_t)len, y, c->e.threads, err);
        uint64_t t2 = clock_now_ns();
        if (rc) return -1;
        r->bytes += (size_t)len;
        r->t_enc += t1 - t0;
        r->t_dec += t2 - t1;
    }
    return 0;
}

/* Window w: the exact context, then every method's decoded context in its place. */
static int eval_window(eval_ctx *c, int w, kv_error *err) {
    if (eval_exact(c, w, err)) return -1;
    for (int meth = 0; meth < c->n_meth; meth++) {
        eval_result *r = &c->res[meth];
        if (eval_code(c, meth, r, err) || load_kv(c, c->dec, err) || measure(c, r, err)) return -1;
    }
    return 0;
}

/* ---------------------------------------------------------------- report */

static void method_name(int meth, char *name, size_t size) {
    if (meth == 0)
        snprintf(name, size, "fp16");
    else if (meth < N_UNIFORM)
        snprintf(name, size, "%d-bit per token", UNIFORM_BITS[meth]);
    else
        snprintf(name, size, "level %d", meth - N_UNIFORM);
}

/* The markdown table: one row per method, sizes against fp16 and 8-bit, speeds, quality
 * against the exact KV. */
static void eval_print(const eval_ctx *c) {
    double n_win = c->n_win, n_chunks = c->n_chunks;
    double fp16_bpt = (double)codec_uniform_bytes(&c->sh, 16) / c->chunk;
    double q8_bpt = (double)codec_uniform_bytes(&c->sh, 8) / c->chunk;
    double exact_ppl = exp(c->exact.nll / c->exact.n_scored);
    printf("codec-eval: %s; %d window(s) of %d context tokens (%d chunks of %d), %d held-out "
           "and %d generated tokens; table %s\n",
           c->m->name, c->n_win, c->n_ctx, c->n_chunks, c->chunk, c->n_held, EVAL_GEN,
           c->table_path);
    printf("exact KV: perplexity %.4f\n\n", exact_ppl);
    printf(
        "| method | bytes/token | vs fp16 | vs 8-bit | encode MB/s | decode MB/s | decode ms/chunk "
        "| vs prefill | perplexity | ppl vs exact | agreement | free-run prefix |\n");
    printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    double prefill_ms = (double)c->t_prefill / 1e6 / (n_chunks * n_win);
    for (int meth = 0; meth < c->n_meth; meth++) {
        const eval_result *r = &c->res[meth];
        double bpt = (double)r->bytes / ((double)c->n_ctx * n_win);
        double mb = (double)c->ce * 2 * c->n_chunks * n_win / 1e6; /* as f16 */
        double ppl = exp(r->nll / r->n_scored);
        char name[32];
        method_name(meth, name, sizeof name);
        double dec_ms = (double)r->t_dec / 1e6 / (n_chunks * n_win);
        printf(
            "| %s | %.0f | %.2fx | %.2fx | %.0f | %.0f | %.1f | %.1f%% | %.4f | %+.2f%% | %.1f%% "
            "| %.1f/%d |\n",
            name, bpt, fp16_bpt / bpt, q8_bpt / bpt, mb / ((double)r->t_enc / 1e9),
            mb / ((double)r->t_dec / 1e9), dec_ms, 100 * dec_ms / prefill_ms, ppl,
            100 * (ppl / exact_ppl - 1), 100.0 * r->agree / r->n_agree, (double)r->prefix / n_win,
            EVAL_GEN);
    }
    printf("\nMB/s count the KV as f16 (%.2f MB per chunk); decode on %d threads; prefill "
           "(computing a chunk's KV from its text, as the context's prefill over its chunks) "
           "%.1f ms per chunk.\n",
           (double)c->ce * 2 / 1e6, c->e.threads, prefill_ms);
}

int cli_codec_eval(int argc, char **argv) {
    eval_args a;
    int rc = parse_args(argc, argv, &a);
    if (rc >= 0) return rc;
    log_set_level(LOG_LEVEL_WARN);
    kv_error err = {{0}};
    eval_ctx c = {0};
    rc = eval_open(&c, &a, &err);
    for (int w = 0; w < c.n_win && !rc; w++) {
        rc = eval_window(&c, w, &err);
        if (!rc && c.n_win > 1) fprintf(stderr, "window %d/%d done\n", w + 1, c.n_win);
    }
    if (rc)
        fprintf(stderr, "kvserve codec-eval: %s\n", err.msg);
    else
        eval_print(&c);
    eval_close(&c);
    return rc ? 1 : 0;
}
