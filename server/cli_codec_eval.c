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
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/codec.h"
#include "model/model.h"
#include "server/cli.h"
#include "server/cli_common.h"

#define EVAL_GEN 64

typedef struct eval_ctx {
    engine_single e;
    const model *m;
    int n_ctx, n_held, chunk, nl, nc;
    int32_t *ids; /* text tokens: context then held-out */
    int32_t gen[EVAL_GEN];
    /* The argmax at each of the 64 teacher-forced positions over the exact KV: agreement is
     * measured against these, computed the same way, so exact KV agrees 100% by construction
     * (the free-running tokens came from one-token decode steps, whose float summation order
     * differs from a batched pass). */
    int32_t ref_am[EVAL_GEN];
    bool have_ref;
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
    float mx = -INFINITY;
    int am = 0;
    for (int v = 0; v < sc->n_vocab; v++)
        if (row[v] > mx) mx = row[v], am = v;
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
        t = (int32_t)backend_argmax(c->e.logits, c->m->hp.n_vocab);
        if (t != c->gen[i]) break;
        out->prefix++;
    }
    return 0;
}

int cli_codec_eval(int argc, char **argv) {
    cli_model_opts mo = {.threads = 2};
    const char *text_path = NULL, *table_path = NULL;
    int n_ctx = 1024, n_held = 256, chunk = 256, n_win = 1;
    const cli_opt opts[] = {
        CLI_MODEL_OPT(&mo),
        {"text", 0, CLI_OPT_STRING, .dst = &text_path, .required = "FILE"},
        {"table", 0, CLI_OPT_STRING, .dst = &table_path},
        {"ctx", 0, CLI_OPT_INT, .dst = &n_ctx, .min = 16, .max = 1 << 20},
        {"heldout", 0, CLI_OPT_INT, .dst = &n_held, .min = 2, .max = 1 << 20},
        {"chunk", 0, CLI_OPT_INT, .dst = &chunk, .min = 16, .max = 65536},
        CLI_THREADS_OPT(&mo),
        {"windows", 0, CLI_OPT_INT, .dst = &n_win, .min = 1, .max = 1000},
    };
    const cli_command cmd = {"kvserve codec-eval", usage, opts, sizeof opts / sizeof opts[0]};
    int rc = cli_parse(&cmd, argc, argv);
    if (rc >= 0) return rc;
    log_set_level(LOG_LEVEL_WARN);
    kv_error err = {{0}};
    eval_ctx c = {0};
    char *text = NULL, *auto_table = NULL;
    codec_table table = {0};
    float *ref = NULL, *dec = NULL;
    uint8_t *buf = NULL;
    rc = 1;
    n_ctx = n_ctx / chunk * chunk;
    if (n_ctx < chunk) {
        kv_fail(&err, "--ctx must hold at least one chunk of %d tokens", chunk);
        goto done;
    }
    if (engine_single_load(&c.e, &mo, &err)) goto done;
    const model *m = c.m = c.e.m;
    c.n_ctx = n_ctx;
    c.n_held = n_held;
    c.chunk = chunk;
    c.nl = m->hp.n_layer;
    c.nc = m->hp.n_kv_head * m->hp.head_dim;
    if (!table_path) {
        if (asprintf(&auto_table, "%s.kvcodec", mo.path) < 0) goto oom;
        table_path = auto_table;
    }
    if (codec_table_load(&table, table_path, m->identity, &err)) {
        kv_fail_wrap(&err, "%s (run `kvserve calibrate -m %s` first)", table_path, mo.path);
        goto done;
    }
    if (!(text = cli_read_file(text_path, &err))) goto done;
    int n_text = tokenizer_encode(m->tok, text, strlen(text), tokenizer_add_bos(m->tok), false,
                                  &c.ids, &err);
    if (n_text < 0) goto done;
    int win = c.n_ctx + c.n_held;
    if (n_text < (int64_t)win * n_win) {
        kv_fail(&err, "%s has %d tokens: %d windows of --ctx %d + --heldout %d are needed",
                text_path, n_text, n_win, c.n_ctx, c.n_held);
        goto done;
    }
    if (engine_single_start(&c.e, win + EVAL_GEN + 16, &err)) goto done;
    int n_chunks = c.n_ctx / c.chunk;
    size_t ce = (size_t)c.nl * 2 * (size_t)c.chunk * (size_t)c.nc;
    codec_shape sh = {c.nl, c.chunk, c.nc};
    size_t cap = codec_encode_bound(&table, c.chunk);
    size_t ucap = codec_uniform_bytes(&sh, 16);
    if (ucap > cap) cap = ucap;
    int n_meth = 3 + table.n_levels;
    eval_result exact = {0}, res[3 + CODEC_MAX_LEVELS] = {{0}};
    if (!(buf = malloc(cap)) || !(ref = malloc(sizeof(float) * ce * (size_t)n_chunks)) ||
        !(dec = malloc(sizeof(float) * ce * (size_t)n_chunks)))
        goto oom;
    int32_t *all_ids = c.ids;
    static const int BITS[3] = {16, 8, 4};
    uint64_t t_prefill = 0; /* the exact contexts' prefills, all windows */
    for (int w = 0; w < n_win; w++) {
        c.ids = all_ids + (size_t)w * (size_t)win;
        /* the exact context: its KV, and 64 greedy tokens from it */
        engine_single_reset(&c.e);
        uint64_t tp = clock_now_ns();
        if (engine_single_prefill(&c.e, c.ids, c.n_ctx, &err)) break;
        t_prefill += clock_now_ns() - tp;
        int i = 0;
        for (; i < EVAL_GEN; i++) {
            c.gen[i] = (int32_t)backend_argmax(c.e.logits, m->hp.n_vocab);
            if (engine_single_decode(&c.e, c.gen[i], &err)) break;
        }
        if (i < EVAL_GEN) break;
        if (engine_single_read_kv(&c.e, n_chunks, c.chunk, ref, &err)) break;
        c.have_ref = false;
        if (load_kv(&c, ref, &err) || measure(&c, &exact, &err)) break;
        /* methods: fp16, 8-bit, 4-bit baselines, then the table's levels */
        int meth = 0;
        for (; meth < n_meth; meth++) {
            eval_result *r = &res[meth];
            int k = 0;
            for (; k < n_chunks; k++) {
                const float *x = ref + (size_t)k * ce;
                float *y = dec + (size_t)k * ce;
                uint64_t t0 = clock_now_ns();
                int64_t len;
                if (meth < 3)
                    len = codec_uniform_encode(x, &sh, BITS[meth], buf, &err)
                              ? -1
                              : (int64_t)codec_uniform_bytes(&sh, BITS[meth]);
                else
                    len = codec_encode_chunk(&table, meth - 3, x, c.chunk, k * c.chunk, buf, cap,
                                             &err);
                uint64_t t1 = clock_now_ns();
                if (len < 0) break;
                int drc = meth < 3
                              ? codec_uniform_decode(buf, (size_t)len, &sh, BITS[meth], y, &err)
                              : codec_decode_chunk(&table, buf, (size_t)len, y, mo.threads, &err);
                uint64_t t2 = clock_now_ns();
                if (drc) break;
                r->bytes += (size_t)len;
                r->t_enc += t1 - t0;
                r->t_dec += t2 - t1;
            }
            if (k < n_chunks || load_kv(&c, dec, &err) || measure(&c, r, &err)) break;
        }
        if (meth < n_meth) break;
        if (n_win > 1) fprintf(stderr, "window %d/%d done\n", w + 1, n_win);
    }
    c.ids = all_ids;
    if (err.msg[0]) goto done;

    double fp16_bpt = (double)ucap / c.chunk;
    double q8_bpt = (double)codec_uniform_bytes(&sh, 8) / c.chunk;
    double exact_ppl = exp(exact.nll / exact.n_scored);
    printf("codec-eval: %s; %d window(s) of %d context tokens (%d chunks of %d), %d held-out "
           "and %d generated tokens; table %s\n",
           m->name, n_win, c.n_ctx, n_chunks, c.chunk, c.n_held, EVAL_GEN, table_path);
    printf("exact KV: perplexity %.4f\n\n", exact_ppl);
    printf(
        "| method | bytes/token | vs fp16 | vs 8-bit | encode MB/s | decode MB/s | decode ms/chunk "
        "| vs prefill | perplexity | ppl vs exact | agreement | free-run prefix |\n");
    printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    double prefill_ms = (double)t_prefill / 1e6 / ((double)n_chunks * (double)n_win);
    for (int meth = 0; meth < n_meth; meth++) {
        const eval_result *r = &res[meth];
        double bpt = (double)r->bytes / ((double)c.n_ctx * (double)n_win);
        double mb = (double)ce * 2 * n_chunks * (double)n_win / 1e6; /* as f16 */
        double ppl = exp(r->nll / r->n_scored);
        char name[32];
        if (meth < 3)
            snprintf(name, sizeof name, meth == 0 ? "fp16" : "%d-bit per token", BITS[meth]);
        else
            snprintf(name, sizeof name, "level %d", meth - 3);
        double dec_ms = (double)r->t_dec / 1e6 / ((double)n_chunks * (double)n_win);
        printf(
            "| %s | %.0f | %.2fx | %.2fx | %.0f | %.0f | %.1f | %.1f%% | %.4f | %+.2f%% | %.1f%% "
            "| %.1f/%d |\n",
            name, bpt, fp16_bpt / bpt, q8_bpt / bpt, mb / ((double)r->t_enc / 1e9),
            mb / ((double)r->t_dec / 1e9), dec_ms, 100 * dec_ms / prefill_ms, ppl,
            100 * (ppl / exact_ppl - 1), 100.0 * r->agree / r->n_agree,
            (double)r->prefix / (double)n_win, EVAL_GEN);
    }
    printf("\nMB/s count the KV as f16 (%.2f MB per chunk); decode on %d threads; prefill "
           "(computing a chunk's KV from its text, as the context's prefill over its chunks) "
           "%.1f ms per chunk.\n",
           (double)ce * 2 / 1e6, mo.threads, prefill_ms);
    rc = 0;
    goto done;
oom:
    kv_fail(&err, "out of memory");
done:
    if (rc) fprintf(stderr, "kvserve codec-eval: %s\n", err.msg);
    codec_table_free(&table);
    free(ref);
    free(dec);
    free(buf);
    free(c.ids);
    free(text);
    free(auto_table);
    engine_single_free(&c.e);
    return rc;
}
