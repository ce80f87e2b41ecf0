/* `kvserve generate`: one prompt, streamed to stdout. The smallest complete use of the engine:
 * template, tokenize, prefill in slices, sample, detokenize incrementally, stop. */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/model.h"
#include "server/cli.h"
#include "server/cli_common.h"

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
        "      --chat-template NAME  chatml | llama3 | llama2 | mistral (default: from GGUF)\n"
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
        "                            (float-accurate, 2-4x slower; default: 8-bit activations)\n"
        "      --log-level LEVEL     error | warn | info | debug (default warn)\n");
}

typedef struct gen_opts {
    const char *model;
    const char *prompt;
    const char *file;
    const char *system;
    const char *chat_template;
    bool chat;
    bool ignore_eos;
    bool precise;
    int max_tokens;
    int ctx;
    int threads;
    sampler_params sp;
    const char *stops[MAX_STOPS];
    int n_stops;
    logit_bias bias[MAX_BIAS];
} gen_opts;

static int parse_generate(int argc, char **argv, gen_opts *o) {
    enum {
        O_CHAT = 1000,
        O_SYSTEM,
        O_TEMPLATE,
        O_TEMP,
        O_TOPK,
        O_TOPP,
        O_MINP,
        O_REP,
        O_REPN,
        O_FREQ,
        O_PRES,
        O_BIAS,
        O_STOP,
        O_IGNORE_EOS,
        O_LOG,
        O_PRECISE
    };
    static const struct option longopts[] = {{"model", required_argument, 0, 'm'},
                                             {"prompt", required_argument, 0, 'p'},
                                             {"file", required_argument, 0, 'f'},
                                             {"chat", no_argument, 0, O_CHAT},
                                             {"system", required_argument, 0, O_SYSTEM},
                                             {"chat-template", required_argument, 0, O_TEMPLATE},
                                             {"max-tokens", required_argument, 0, 'n'},
                                             {"ctx", required_argument, 0, 'c'},
                                             {"threads", required_argument, 0, 't'},
                                             {"temp", required_argument, 0, O_TEMP},
                                             {"top-k", required_argument, 0, O_TOPK},
                                             {"top-p", required_argument, 0, O_TOPP},
                                             {"min-p", required_argument, 0, O_MINP},
                                             {"repeat-penalty", required_argument, 0, O_REP},
                                             {"repeat-last-n", required_argument, 0, O_REPN},
                                             {"frequency-penalty", required_argument, 0, O_FREQ},
                                             {"presence-penalty", required_argument, 0, O_PRES},
                                             {"logit-bias", required_argument, 0, O_BIAS},
                                             {"seed", required_argument, 0, 's'},
                                             {"stop", required_argument, 0, O_STOP},
                                             {"ignore-eos", no_argument, 0, O_IGNORE_EOS},
                                             {"log-level", required_argument, 0, O_LOG},
                                             {"precise", no_argument, 0, O_PRECISE},
                                             {"help", no_argument, 0, 'h'},
                                             {0, 0, 0, 0}};
    memset(o, 0, sizeof *o);
    o->max_tokens = 256;
    o->threads = 2;
    sampler_params_default(&o->sp);
    /* llama.cpp's command-line defaults, which CLI users expect (the API keeps OpenAI's). */
    o->sp.temperature = 0.8f;
    o->sp.top_k = 40;
    o->sp.top_p = 0.95f;
    o->sp.min_p = 0.05f;
    o->sp.bias = o->bias;
    int c;
    long long ll;
    double d;
    optind = 1;
    while ((c = getopt_long(argc, argv, "m:p:f:n:c:t:s:h", longopts, NULL)) != -1) {
        switch (c) {
        case 'm':
            o->model = optarg;
            break;
        case 'p':
            o->prompt = optarg;
            break;
        case 'f':
            o->file = optarg;
            break;
        case O_CHAT:
            o->chat = true;
            break;
        case O_SYSTEM:
            o->system = optarg;
            break;
        case O_TEMPLATE:
            o->chat_template = optarg;
            break;
        case 'n':
            if (cli_parse_int("--max-tokens", optarg, 1, 1 << 20, &ll)) return -1;
            o->max_tokens = (int)ll;
            break;
        case 'c':
            if (cli_parse_int("--ctx", optarg, 16, 1 << 24, &ll)) return -1;
            o->ctx = (int)ll;
            break;
        case 't':
            if (cli_parse_int("--threads", optarg, 1, 256, &ll)) return -1;
            o->threads = (int)ll;
            break;
        case 's':
            if (cli_parse_int("--seed", optarg, 0, INT64_MAX, &ll)) return -1;
            o->sp.seed = (uint64_t)ll;
            break;
        case O_TEMP:
            if (cli_parse_float("--temp", optarg, 0, 100, &d)) return -1;
            o->sp.temperature = (float)d;
            break;
        case O_TOPK:
            if (cli_parse_int("--top-k", optarg, 0, 1 << 24, &ll)) return -1;
            o->sp.top_k = (int)ll;
            break;
        case O_TOPP:
            if (cli_parse_float("--top-p", optarg, 0, 1, &d)) return -1;
            o->sp.top_p = (float)d;
            break;
        case O_MINP:
            if (cli_parse_float("--min-p", optarg, 0, 1, &d)) return -1;
            o->sp.min_p = (float)d;
            break;
        case O_REP:
            if (cli_parse_float("--repeat-penalty", optarg, 0, 100, &d)) return -1;
            o->sp.repeat_penalty = (float)d;
            break;
        case O_REPN:
            if (cli_parse_int("--repeat-last-n", optarg, -1, 1 << 24, &ll)) return -1;
            o->sp.repeat_last_n = (int)ll;
            break;
        case O_FREQ:
            if (cli_parse_float("--frequency-penalty", optarg, -2, 2, &d)) return -1;
            o->sp.frequency_penalty = (float)d;
            break;
        case O_PRES:
            if (cli_parse_float("--presence-penalty", optarg, -2, 2, &d)) return -1;
            o->sp.presence_penalty = (float)d;
            break;
        case O_BIAS: {
            const char *eq = strchr(optarg, '=');
            if (!eq || o->sp.n_bias >= MAX_BIAS) {
                fprintf(stderr, "kvserve: --logit-bias wants ID=VALUE (at most %d)\n", MAX_BIAS);
                return -1;
            }
            char id[32];
            size_t n = (size_t)(eq - optarg);
            if (n == 0 || n >= sizeof id) {
                fprintf(stderr, "kvserve: --logit-bias: bad token id in '%s'\n", optarg);
                return -1;
            }
            memcpy(id, optarg, n);
            id[n] = '\0';
            if (cli_parse_int("--logit-bias token", id, 0, INT32_MAX, &ll)) return -1;
            if (strcmp(eq + 1, "-inf") == 0) {
                d = -INFINITY;
            } else if (cli_parse_float("--logit-bias value", eq + 1, -100, 100, &d)) {
                return -1;
            }
            o->bias[o->sp.n_bias++] = (logit_bias){(int32_t)ll, (float)d};
            break;
        }
        case O_STOP:
            if (o->n_stops >= MAX_STOPS) {
                fprintf(stderr, "kvserve: at most %d --stop strings\n", MAX_STOPS);
                return -1;
            }
            o->stops[o->n_stops++] = optarg;
            break;
        case O_PRECISE:
            o->precise = true;
            break;
        case O_IGNORE_EOS:
            o->ignore_eos = true;
            break;
        case O_LOG: {
            log_level lv;
            if (log_level_parse(optarg, &lv)) {
                fprintf(stderr, "kvserve: --log-level: '%s' is not error|warn|info|debug\n",
                        optarg);
                return -1;
            }
            log_set_level(lv);
            break;
        }
        case 'h':
            generate_usage(stdout);
            exit(0);
        default:
            generate_usage(stderr);
            return -1;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "kvserve: unexpected argument '%s'\n", argv[optind]);
        return -1;
    }
    if (!o->model || (!o->prompt == !o->file)) {
        fprintf(stderr, "kvserve generate: need -m MODEL and one of -p PROMPT or -f FILE\n");
        return -1;
    }
    return 0;
}

int cli_generate(int argc, char **argv) {
    log_set_level(LOG_LEVEL_WARN);
    gen_opts o;
    if (parse_generate(argc, argv, &o)) return 2;
    int rc = 1;
    kv_error err = {{0}};
    model *m = NULL;
    engine_single e = {0};
    char *file_text = NULL, *rendered = NULL, *gen = NULL;
    int32_t *ids = NULL, *hist = NULL;
    sampler *smp = NULL;
    stop_set stops = {0};

    if (o.file && !(file_text = cli_read_file(o.file, &err))) goto fail;
    const char *prompt = o.file ? file_text : o.prompt;
    model_load_opts lo = {.chat_template = o.chat_template};
    if (!(m = model_load(o.model, &lo, &err))) goto fail;
    int ctx = o.ctx ? o.ctx : (m->hp.n_ctx_train < 4096 ? m->hp.n_ctx_train : 4096);
    if (engine_single_init(&e, m, o.threads, ctx, o.precise, &err)) goto fail;

    bool add_bos = tokenizer_add_bos(m->tok);
    if (o.chat) {
        chat_message msgs[2];
        int n = 0;
        if (o.system) msgs[n++] = (chat_message){"system", o.system};
        msgs[n++] = (chat_message){"user", prompt};
        int32_t bos = tokenizer_bos(m->tok);
        const char *bos_text = bos >= 0 ? tokenizer_token_text(m->tok, bos) : NULL;
        if (!(rendered = chat_render(&m->chat, msgs, n, true, bos_text, &err))) goto fail;
        /* Templates that spell BOS out must not get a second one. */
        if (bos_text && strncmp(rendered, bos_text, strlen(bos_text)) == 0) add_bos = false;
        prompt = rendered;
    }
    int n_prompt = tokenizer_encode(m->tok, prompt, strlen(prompt), add_bos, true, &ids, &err);
    if (n_prompt < 0) goto fail;
    if (n_prompt == 0) {
        kv_fail(&err, "the prompt is empty");
        goto fail;
    }
    if (n_prompt >= ctx) {
        kv_fail(&err, "prompt of %d tokens does not fit the context of %d tokens", n_prompt, ctx);
        goto fail;
    }
    if (!(smp = sampler_create(&o.sp, m->hp.n_vocab, &err))) goto fail;
    if (stop_set_init(&stops, o.stops, o.n_stops, &err)) goto fail;
    hist = malloc(sizeof(int32_t) * (size_t)ctx);
    size_t gen_cap = 4096, gen_len = 0, emitted = 0;
    gen = malloc(gen_cap);
    if (!hist || !gen) {
        kv_fail(&err, "out of memory");
        goto fail;
    }
    memcpy(hist, ids, sizeof(int32_t) * (size_t)n_prompt);

    uint64_t t0 = clock_now_ns();
    if (engine_single_prefill(&e, ids, n_prompt, &err)) goto fail;
    uint64_t t1 = clock_now_ns();
    detok_state ds;
    detok_init(&ds);
    int n_hist = n_prompt, n_gen = 0;
    const char *finish = "length";
    bool stop_matched = false;
    char piece[512];
    while (n_gen < o.max_tokens) {
        if (n_hist >= ctx) {
            finish = "context";
            break;
        }
        int32_t tok = sampler_sample(smp, e.logits, hist, n_hist, NULL);
        hist[n_hist++] = tok;
        n_gen++;
        if (!o.ignore_eos && tokenizer_is_eog(m->tok, tok)) {
            finish = "stop";
            break;
        }
        int nb = detok_push(m->tok, &ds, tok, piece, sizeof piece);
        if (nb < 0) nb = 0;
        if (gen_len + (size_t)nb + 1 > gen_cap) {
            gen_cap = (gen_len + (size_t)nb + 1) * 2;
            char *g2 = realloc(gen, gen_cap);
            if (!g2) {
                kv_fail(&err, "out of memory");
                goto fail;
            }
            gen = g2;
        }
        memcpy(gen + gen_len, piece, (size_t)nb);
        gen_len += (size_t)nb;
        bool matched = false;
        /* Text before `emitted` cannot hold the start of a stop string (a possible start is
         * held back), so each step scans only the new tail: linear in the output, not quadratic. */
        size_t safe = emitted + stop_set_scan(&stops, gen + emitted, gen_len - emitted, &matched);
        if (safe > emitted) {
            fwrite(gen + emitted, 1, safe - emitted, stdout);
            fflush(stdout);
            emitted = safe;
        }
        if (matched) {
            finish = "stop";
            stop_matched = true;
            break;
        }
        if (n_gen == o.max_tokens) break;
        if (engine_single_decode(&e, tok, &err)) goto fail;
    }
    /* Text held back as a possible stop-string prefix is the answer's end after all. */
    if (!stop_matched) {
        fwrite(gen + emitted, 1, gen_len - emitted, stdout);
        int nb = detok_flush(&ds, piece, sizeof piece);
        if (nb > 0) fwrite(piece, 1, (size_t)nb, stdout);
    }
    fputc('\n', stdout);
    uint64_t t2 = clock_now_ns();
    fprintf(stderr,
            "\n[kvserve] prompt %d tokens, %.1f tok/s | generated %d tokens, %.1f tok/s | "
            "finish: %s\n",
            n_prompt, n_prompt / ((t1 - t0) / 1e9), n_gen,
            n_gen > 0 ? n_gen / ((t2 - t1) / 1e9) : 0.0, finish);
    rc = 0;
fail:
    if (rc) fprintf(stderr, "kvserve: %s\n", err.msg);
    stop_set_free(&stops);
    sampler_destroy(smp);
    free(hist);
    free(gen);
    free(ids);
    free(rendered);
    free(file_text);
    engine_single_free(&e);
    model_free(m);
    return rc;
}
