/* `kvserve generate`: one prompt, streamed to stdout. The smallest complete use of the engine:
 * template, tokenize, prefill in slices, sample, detokenize incrementally, stop. */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/model.h"
#include "model/sampler.h"
#include "server/cli/cli.h"
#include "server/cli/cli_common.h"

#define MAX_STOPS 16
#define MAX_BIAS 256

static void generate_usage(FILE *out) {
    fprintf(
        out,
        "usage: kvserve generate -m MODEL -p PROMPT [options]\n\n"
        "  -m, --model PATH          GGUF model file\n"
        "  -p, --prompt TEXT         prompt text (special tokens like <|im_start|> allowed)\n"
        "  -f, --file PATH           read the prompt from a file\n"
        "      --chat                wrap the prompt as a user message in the chat template\n"
        "      --system TEXT         system message (with --chat)\n"
        "      --chat-template NAME  " CHAT_TEMPLATE_NAMES " (default: from GGUF)\n"
        "  -n, --max-tokens N        tokens to generate (default 256)\n"
        "  -c, --ctx N               context size in tokens (default min(model, 4096))\n"
        "  -t, --threads N           compute threads (default 2)\n"
        "      --temp X              temperature (default 0.8; 0 = greedy)\n"
        "      --top-k N             (default 40; 0 = off)\n"
        "      --top-p X             (default 0.95; 1 = off)\n"
        "      --min-p X             (default 0.05; 0 = off)\n"
        "      --repeat-penalty X    (default 1.0 = off)\n"
        "      --repeat-last-n N     (default 64; -1 = whole context)\n"
        "      --frequency-penalty X (default 0)\n"
        "      --presence-penalty X  (default 0)\n"
        "      --logit-bias ID=X     add X to token ID's logit (repeatable)\n"
        "  -s, --seed N              sampling seed (default 0)\n"
        "      --stop TEXT           stop string (repeatable)\n"
        "      --ignore-eos          keep generating past end-of-generation tokens\n"
        "      --precise             f32 activations and dequantized weights in matmuls\n"
        "      --simd LEVEL          kernels: auto (the CPU's best), avx512, avx2, scalar\n"
        "      --device DEV          auto (CUDA when a GPU is present), cuda, cpu\n"
        "                            (float-accurate, 2-4x slower; default: 8-bit activations)\n"
        "      --log-level LEVEL     error | warn | info | debug (default warn)\n");
}

typedef struct gen_opts {
    engine_model_opts mo;
    const char *prompt;
    const char *file;
    const char *system;
    bool chat;
    bool ignore_eos;
    int max_tokens;
    int ctx;
    sampler_params sp;
    const char *stops[MAX_STOPS];
    int n_stops;
    logit_bias bias[MAX_BIAS];
} gen_opts;

/* --logit-bias ID=X (repeatable; X may be -inf). */
static int parse_bias(void *dst, const char *arg, kv_error *err) {
    gen_opts *o = dst;
    long long id;
    double d;
    const char *eq = strchr(arg, '=');
    if (!eq || o->sp.n_bias >= MAX_BIAS)
        return kv_fail(err, "--logit-bias wants ID=VALUE (at most %d)", MAX_BIAS);
    char text[32];
    size_t n = (size_t)(eq - arg);
    if (n == 0 || n >= sizeof text) return kv_fail(err, "--logit-bias: bad token id in '%s'", arg);
    memcpy(text, arg, n);
    text[n] = '\0';
    if (cli_parse_int("--logit-bias token", text, 0, INT32_MAX, &id, err)) return -1;
    if (strcmp(eq + 1, "-inf") == 0)
        d = -INFINITY;
    else if (cli_parse_float("--logit-bias value", eq + 1, -100, 100, &d, err))
        return -1;
    o->bias[o->sp.n_bias++] = (logit_bias){(int32_t)id, (float)d};
    return 0;
}

/* --stop TEXT (repeatable). */
static int parse_stop(void *dst, const char *arg, kv_error *err) {
    gen_opts *o = dst;
    if (o->n_stops >= MAX_STOPS) return kv_fail(err, "at most %d --stop strings", MAX_STOPS);
    o->stops[o->n_stops++] = arg;
    return 0;
}

/* --log-level takes effect at once. */
static int parse_log_level(void *dst, const char *arg, kv_error *err) {
    (void)dst;
    log_level lv;
    if (log_level_parse(arg, &lv))
        return kv_fail(err, "--log-level: '%s' is not error|warn|info|debug", arg);
    log_set_level(lv);
    return 0;
}

/* -1 to go on, else the exit status (cli_parse). */
static int parse_generate(int argc, char **argv, gen_opts *o) {
    memset(o, 0, sizeof *o);
    o->max_tokens = 256;
    o->mo.threads = 2;
    o->mo.device = "auto";
    sampler_params_default(&o->sp);
    /* llama.cpp's command-line defaults, which CLI users expect (the API keeps OpenAI's). */
    o->sp.temperature = 0.8f;
    o->sp.top_k = 40;
    o->sp.top_p = 0.95f;
    o->sp.min_p = 0.05f;
    o->sp.bias = o->bias;
    int64_t seed = 0;
    const cli_opt opts[] = {
        CLI_MODEL_OPT(&o->mo),
        {"prompt", 'p', CLI_OPT_STRING, .dst = &o->prompt},
        {"file", 'f', CLI_OPT_STRING, .dst = &o->file},
        {"chat", 0, CLI_OPT_FLAG, .dst = &o->chat},
        {"system", 0, CLI_OPT_STRING, .dst = &o->system},
        {"chat-template", 0, CLI_OPT_STRING, .dst = &o->mo.chat_template},
        {"max-tokens", 'n', CLI_OPT_INT, .dst = &o->max_tokens, .min = 1, .max = 1 << 20},
        {"ctx", 'c', CLI_OPT_INT, .dst = &o->ctx, .min = 16, .max = 1 << 24},
        CLI_THREADS_OPT(&o->mo),
        {"temp", 0, CLI_OPT_FLOAT, .dst = &o->sp.temperature, .fmin = 0, .fmax = 100},
        {"top-k", 0, CLI_OPT_INT, .dst = &o->sp.top_k, .min = 0, .max = 1 << 24},
        {"top-p", 0, CLI_OPT_FLOAT, .dst = &o->sp.top_p, .fmin = 0, .fmax = 1},
        {"min-p", 0, CLI_OPT_FLOAT, .dst = &o->sp.min_p, .fmin = 0, .fmax = 1},
        {"repeat-penalty", 0, CLI_OPT_FLOAT, .dst = &o->sp.repeat_penalty, .fmin = 0, .fmax = 100},
        {"repeat-last-n", 0, CLI_OPT_INT, .dst = &o->sp.repeat_last_n, .min = -1, .max = 1 << 24},
        {"frequency-penalty", 0, CLI_OPT_FLOAT, .dst = &o->sp.frequency_penalty, .fmin = -2,
         .fmax = 2},
        {"presence-penalty", 0, CLI_OPT_FLOAT, .dst = &o->sp.presence_penalty, .fmin = -2,
         .fmax = 2},
        {"logit-bias", 0, CLI_OPT_FN, .dst = o, .fn = parse_bias},
        {"seed", 's', CLI_OPT_INT64, .dst = &seed, .min = 0, .max = INT64_MAX},
        {"stop", 0, CLI_OPT_FN, .dst = o, .fn = parse_stop},
        {"ignore-eos", 0, CLI_OPT_FLAG, .dst = &o->ignore_eos},
        {"log-level", 0, CLI_OPT_FN, .fn = parse_log_level},
        {"precise", 0, CLI_OPT_FLAG, .dst = &o->mo.precise},
        CLI_SIMD_OPT(&o->mo),
        CLI_DEVICE_OPT(&o->mo),
    };
    const cli_command cmd = {"kvserve generate", generate_usage, opts,
                             sizeof opts / sizeof opts[0]};
    int rc = cli_parse(&cmd, argc, argv);
    if (rc >= 0) return rc;
    o->sp.seed = (uint64_t)seed;
    if (!o->prompt == !o->file) {
        fprintf(stderr, "kvserve generate: need one of -p PROMPT or -f FILE\n");
        return 2;
    }
    return -1;
}

/* ---------------------------------------------------------------- a run */

/* One run: the engine, the prompt's tokens, the sampler and the text generated so far. */
typedef struct gen_run {
    const gen_opts *o;
    engine_single e;
    const model *m;
    int ctx;
    char *file_text, *rendered;
    int32_t *ids; /* the prompt's tokens */
    int n_prompt;
    int32_t *hist; /* [ctx]: the prompt's tokens, then those generated */
    int n_hist, n_gen;
    sampler *smp;
    stop_set stops;
    char *gen; /* the generated text, [gen_cap] */
    size_t gen_cap, gen_len;
    size_t emitted; /* gen[0..emitted) is on stdout */
    detok_state ds;
    const char *finish; /* "length", "context" or "stop" */
    bool stop_matched;
} gen_run;

/* The prompt (with --chat, the messages in the model's template) as tokens, into r->ids; it must
 * leave room in the context for one token. */
static int generate_tokenize(gen_run *r, const char *prompt, kv_error *err) {
    const model *m = r->m;
    bool add_bos = tokenizer_add_bos(m->tok);
    if (r->o->chat) {
        chat_message msgs[2];
        int n = 0;
        if (r->o->system) msgs[n++] = (chat_message){.role = "system", .content = r->o->system};
        msgs[n++] = (chat_message){.role = "user", .content = prompt};
        int32_t bos = tokenizer_bos(m->tok);
        const char *bos_text = bos >= 0 ? tokenizer_token_text(m->tok, bos) : NULL;
        if (!(r->rendered = chat_render(&m->chat, msgs, n, NULL, 0, true, bos_text, err)))
            return -1;
        /* Templates that spell BOS out must not get a second one. */
        if (bos_text && strncmp(r->rendered, bos_text, strlen(bos_text)) == 0) add_bos = false;
        prompt = r->rendered;
    }
    r->n_prompt = tokenizer_encode(m->tok, prompt, strlen(prompt), add_bos, true, &r->ids, err);
    if (r->n_prompt < 0) return -1;
    if (r->n_prompt == 0) return kv_fail(err, "the prompt is empty");
    if (r->n_prompt >= r->ctx)
        return kv_fail(err, "prompt of %d tokens does not fit the context of %d tokens",
                       r->n_prompt, r->ctx);
    return 0;
}

/* The sampler, the stop strings, the token history (the prompt first) and the text buffer. */
static int generate_prepare(gen_run *r, kv_error *err) {
    if (!(r->smp = sampler_create(&r->o->sp, r->m->hp.n_vocab, err))) return -1;
    if (stop_set_init(&r->stops, r->o->stops, r->o->n_stops, err)) return -1;
    r->hist = malloc(sizeof(int32_t) * (size_t)r->ctx);
    r->gen_cap = 4096;
    r->gen = malloc(r->gen_cap);
    if (!r->hist || !r->gen) return kv_fail(err, "out of memory");
    memcpy(r->hist, r->ids, sizeof(int32_t) * (size_t)r->n_prompt);
    r->n_hist = r->n_prompt;
    return 0;
}

/* Appends piece[0..n) to the generated text. */
static int generate_append(gen_run *r, const char *piece, size_t n, kv_error *err) {
    if (r->gen_len + n + 1 > r->gen_cap) {
        r->gen_cap = (r->gen_len + n + 1) * 2;
        char *g2 = realloc(r->gen, r->gen_cap);
        if (!g2) return kv_fail(err, "out of memory");
        r->gen = g2;
    }
    memcpy(r->gen + r->gen_len, piece, n);
    r->gen_len += n;
    return 0;
}

/* Writes the text that can no longer be part of a stop string; true when one matched. */
static bool generate_emit(gen_run *r) {
    bool matched = false;
    /* Text before `emitted` cannot hold the start of a stop string (a possible start is held
     * back), so each step scans only the new tail: linear in the output, not quadratic. */
    size_t safe = r->emitted +
                  stop_set_scan(&r->stops, r->gen + r->emitted, r->gen_len - r->emitted, &matched);
    if (safe > r->emitted) {
        fwrite(r->gen + r->emitted, 1, safe - r->emitted, stdout);
        fflush(stdout);
        r->emitted = safe;
    }
    return matched;
}

/* Samples, writes and decodes token after token until the end of generation, a stop string,
 * --max-tokens or the context's end (r->finish says which); then writes the text held back. */
static int generate_tokens(gen_run *r, kv_error *err) {
    const model *m = r->m;
    detok_init(&r->ds);
    r->finish = "length";
    char piece[512];
    while (r->n_gen < r->o->max_tokens) {
        if (r->n_hist >= r->ctx) {
            r->finish = "context";
            break;
        }
        int32_t tok = sampler_sample(r->smp, r->e.logits, r->hist, r->n_hist, NULL);
        r->hist[r->n_hist++] = tok;
        r->n_gen++;
        if (!r->o->ignore_eos && tokenizer_is_eog(m->tok, tok)) {
            r->finish = "stop";
            break;
        }
        int nb = detok_push(m->tok, &r->ds, tok, piece, sizeof piece);
        if (nb < 0) nb = 0;
        if (generate_append(r, piece, (size_t)nb, err)) return -1;
        if (generate_emit(r)) {
            r->finish = "stop";
            r->stop_matched = true;
            break;
        }
        if (r->n_gen == r->o->max_tokens) break;
        if (engine_single_decode(&r->e, tok, err)) return -1;
    }
    /* Text held back as a possible stop-string prefix is the answer's end after all. */
    if (!r->stop_matched) {
        fwrite(r->gen + r->emitted, 1, r->gen_len - r->emitted, stdout);
        int nb = detok_flush(&r->ds, piece, sizeof piece);
        if (nb > 0) fwrite(piece, 1, (size_t)nb, stdout);
    }
    fputc('\n', stdout);
    return 0;
}

/* Frees what the run holds, whichever step it reached. */
static void generate_run_free(gen_run *r) {
    stop_set_free(&r->stops);
    sampler_destroy(r->smp);
    free(r->hist);
    free(r->gen);
    free(r->ids);
    free(r->rendered);
    free(r->file_text);
    engine_single_free(&r->e);
}

int cli_generate(int argc, char **argv) {
    log_set_level(LOG_LEVEL_WARN);
    gen_opts o;
    int rc = parse_generate(argc, argv, &o);
    if (rc >= 0) return rc;
    rc = 1;
    kv_error err = {{0}};
    gen_run r = {.o = &o};

    if (o.file && !(r.file_text = kv_read_file(o.file, SIZE_MAX, NULL, &err))) goto fail;
    if (engine_single_load(&r.e, &o.mo, &err)) goto fail;
    r.m = r.e.m;
    r.ctx = o.ctx ? o.ctx : (r.m->hp.n_ctx_train < 4096 ? r.m->hp.n_ctx_train : 4096);
    if (engine_single_start(&r.e, r.ctx, &err)) goto fail;
    if (generate_tokenize(&r, o.file ? r.file_text : o.prompt, &err)) goto fail;
    if (generate_prepare(&r, &err)) goto fail;

    uint64_t t0 = clock_now_ns();
    if (engine_single_prefill(&r.e, r.ids, r.n_prompt, &err)) goto fail;
    uint64_t t1 = clock_now_ns();
    if (generate_tokens(&r, &err)) goto fail;
    uint64_t t2 = clock_now_ns();
    fprintf(stderr,
            "\n[kvserve] prompt %d tokens, %.1f tok/s | generated %d tokens, %.1f tok/s | "
            "finish: %s\n",
            r.n_prompt, r.n_prompt / ((t1 - t0) / 1e9), r.n_gen,
            r.n_gen > 0 ? r.n_gen / ((t2 - t1) / 1e9) : 0.0, r.finish);
    rc = 0;
fail:
    if (rc) fprintf(stderr, "kvserve generate: %s\n", err.msg);
    generate_run_free(&r);
    return rc;
}
