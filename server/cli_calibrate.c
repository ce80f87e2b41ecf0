/* `kvserve calibrate`: profiles the CacheGen codec's table for a model from the model's own KV
 * (channel scales and entropy models per level; cache/codec.h) and writes it beside the model
 * (MODEL.kvcodec), where the server and `kvserve codec-eval` find it.
 *
 * The calibration text is a file (--text), or, by default, text the model writes itself: a
 * seeded sample (temperature 0.8) continued from a few opening lines, with end-of-generation
 * tokens banned so it runs to the requested length. The model's own text needs no corpus in the
 * repository and follows the model's distribution; the table is deterministic for a model and
 * seed. The KV of the text (one sequence, positions 0..n-1) is cut into chunks of --chunk
 * tokens. */
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/codec.h"
#include "model/model.h"
#include "server/cli.h"
#include "server/cli_common.h"

#define CALIB_DEFAULT_TOKENS 2048
#define CALIB_DEFAULT_CHUNK 256

static const char CALIB_OPENING[] =
    "The following is a collection of short pieces: a news report, a recipe, a letter to a "
    "friend, notes from a science lecture, a story for children and a conversation between "
    "two colleagues about a software project.\n\nPart 1.\n";

static void usage(FILE *out) {
    fprintf(out,
            "usage: kvserve calibrate -m MODEL [options]\n\n"
            "Profiles the CacheGen codec's table (channel scales, entropy models per level)\n"
            "from the model's own KV and writes it beside the model.\n\n"
            "  -m, --model PATH     GGUF model (required)\n"
            "  -o, --out PATH       table file (default: MODEL.kvcodec)\n"
            "      --text FILE      calibration text (default: text the model writes itself)\n"
            "  -n, --tokens N       calibration tokens (default %d; at most the context)\n"
            "      --chunk N        tokens per chunk (default %d)\n"
            "      --seed N         seed of the self-written text (default 1)\n"
            "  -t, --threads N      compute threads (default 2)\n"
            "  -h, --help           this text\n",
            CALIB_DEFAULT_TOKENS, CALIB_DEFAULT_CHUNK);
}

/* The model's own text: n tokens in ids (prefilled into e as they are written). */
static int self_text(engine_single *e, int32_t *ids, int n, uint64_t seed, kv_error *err) {
    const model *m = e->m;
    int32_t *open = NULL;
    int n_open = tokenizer_encode(m->tok, CALIB_OPENING, strlen(CALIB_OPENING),
                                  tokenizer_add_bos(m->tok), false, &open, err);
    if (n_open < 0) return -1;
    if (n_open >= n) n_open = n - 1;
    memcpy(ids, open, sizeof(int32_t) * (size_t)n_open);
    free(open);
    /* End-of-generation tokens are banned so the text runs on. */
    int n_vocab = m->hp.n_vocab, n_ban = 0;
    logit_bias *ban = malloc(sizeof *ban * (size_t)n_vocab);
    if (!ban) return kv_fail(err, "out of memory");
    for (int32_t t = 0; t < n_vocab; t++)
        if (tokenizer_is_eog(m->tok, t)) ban[n_ban++] = (logit_bias){t, -INFINITY};
    sampler_params sp;
    sampler_params_default(&sp);
    sp.temperature = 0.8f;
    sp.top_p = 0.95f;
    sp.repeat_penalty = 1.1f;
    sp.repeat_last_n = 256;
    sp.seed = seed;
    sp.bias = ban;
    sp.n_bias = n_ban;
    sampler *smp = sampler_create(&sp, n_vocab, err);
    int rc = -1;
    if (!smp || engine_single_prefill(e, ids, n_open, err)) goto done;
    for (int i = n_open; i < n; i++) {
        ids[i] = sampler_sample(smp, e->logits, ids, i, NULL);
        /* The last token's KV is needed too: every token is prefilled. */
        if (engine_single_decode(e, ids[i], err)) goto done;
    }
    rc = 0;
done:
    sampler_destroy(smp);
    free(ban);
    return rc;
}

/* Four levels from near-lossless to aggressive. Bins are in units of each channel's scale and
 * grow by half from the first layer to the last (deeper layers tolerate coarser KV: CacheGen
 * section 5.1, layer-wise sensitivity); groups of 10 tokens, an anchor and 9 deltas. */
static void default_levels(int n_layer, codec_level *lv, int *n_levels) {
    static const float ANCHOR[4] = {0.05f, 0.05f, 0.05f, 0.1f};
    static const float DELTA[4] = {0.1f, 0.2f, 0.5f, 0.8f};
    *n_levels = 4;
    for (int k = 0; k < 4; k++) {
        memset(&lv[k], 0, sizeof lv[k]);
        lv[k].group = 10;
        for (int l = 0; l < n_layer; l++) {
            float depth = n_layer > 1 ? 1.0f + 0.5f * (float)l / (float)(n_layer - 1) : 1.0f;
            for (int kv = 0; kv < 2; kv++) {
                lv[k].anchor_bin[l][kv] = ANCHOR[k] * depth;
                lv[k].delta_bin[l][kv] = DELTA[k] * depth;
            }
        }
    }
}

int cli_calibrate(int argc, char **argv) {
    static const struct option longopts[] = {{"model", required_argument, 0, 'm'},
                                             {"out", required_argument, 0, 'o'},
                                             {"text", required_argument, 0, 'T'},
                                             {"tokens", required_argument, 0, 'n'},
                                             {"chunk", required_argument, 0, 'C'},
                                             {"seed", required_argument, 0, 'S'},
                                             {"threads", required_argument, 0, 't'},
                                             {"help", no_argument, 0, 'h'},
                                             {0, 0, 0, 0}};
    const char *model_path = NULL, *out_path = NULL, *text_path = NULL;
    long long n_tokens = CALIB_DEFAULT_TOKENS, chunk = CALIB_DEFAULT_CHUNK, seed = 1, threads = 2;
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "m:o:n:t:h", longopts, NULL)) != -1) {
        switch (c) {
        case 'm':
            model_path = optarg;
            break;
        case 'o':
            out_path = optarg;
            break;
        case 'T':
            text_path = optarg;
            break;
        case 'n':
            if (cli_parse_int("--tokens", optarg, 16, 1 << 20, &n_tokens)) return 2;
            break;
        case 'C':
            if (cli_parse_int("--chunk", optarg, 16, 65536, &chunk)) return 2;
            break;
        case 'S':
            if (cli_parse_int("--seed", optarg, 0, INT64_MAX, &seed)) return 2;
            break;
        case 't':
            if (cli_parse_int("--threads", optarg, 1, 256, &threads)) return 2;
            break;
        case 'h':
            usage(stdout);
            return 0;
        default:
            usage(stderr);
            return 2;
        }
    }
    if (!model_path || optind < argc) {
        usage(stderr);
        return 2;
    }
    kv_error err = {{0}};
    model *m = NULL;
    engine_single e = {0};
    char *text = NULL, *auto_out = NULL;
    int32_t *ids = NULL;
    float *kv = NULL;
    codec_table table = {0};
    int rc = 1;
    if (!(m = model_load(model_path, NULL, &err))) goto done;
    if (n_tokens > m->hp.n_ctx_train) n_tokens = m->hp.n_ctx_train;
    if (engine_single_init(&e, m, (int)threads, (int)n_tokens, false, &err)) goto done;
    int n = (int)n_tokens;
    if (text_path) {
        int32_t *tok = NULL;
        if (!(text = cli_read_file(text_path, &err))) goto done;
        int nt = tokenizer_encode(m->tok, text, strlen(text), tokenizer_add_bos(m->tok), false,
                                  &tok, &err);
        if (nt < 0) goto done;
        if (nt < chunk) {
            free(tok);
            kv_fail(&err, "%s has %d tokens; calibration needs at least one chunk (%lld)",
                    text_path, nt, chunk);
            goto done;
        }
        if (nt < n) n = nt;
        ids = tok;
        if (engine_single_prefill(&e, ids, n, &err)) goto done;
    } else {
        if (!(ids = malloc(sizeof *ids * (size_t)n))) goto oom;
        log_info("calibrate: the model writes %d tokens of calibration text", n);
        if (self_text(&e, ids, n, (uint64_t)seed, &err)) goto done;
    }

    /* The KV as f32 [chunk][layer][kv][token][channel]. */
    int n_chunks = n / (int)chunk, nl = m->hp.n_layer;
    int nc = m->hp.n_kv_head * m->hp.head_dim;
    size_t chunk_elems = (size_t)nl * 2 * (size_t)chunk * (size_t)nc;
    if (!(kv = malloc(sizeof(float) * chunk_elems * (size_t)n_chunks))) goto oom;
    if (engine_single_read_kv(&e, n_chunks, (int)chunk, kv, &err)) goto done;

    codec_level levels[CODEC_MAX_LEVELS];
    int n_levels;
    default_levels(nl, levels, &n_levels);
    if (codec_table_init(&table, m->identity, nl, nc, levels, n_levels, &err) ||
        codec_table_calibrate(&table, kv, n_chunks, (int)chunk, &err))
        goto done;
    if (!out_path) {
        if (asprintf(&auto_out, "%s.kvcodec", model_path) < 0) goto oom;
        out_path = auto_out;
    }
    if (codec_table_save(&table, out_path, &err)) goto done;
    printf("calibrated %d chunks of %lld tokens (%d layers, %d KV channels, %d levels): %s\n",
           n_chunks, chunk, nl, nc, n_levels, out_path);
    rc = 0;
    goto done;
oom:
    kv_fail(&err, "out of memory");
done:
    if (rc) fprintf(stderr, "kvserve calibrate: %s\n", err.msg);
    codec_table_free(&table);
    free(kv);
    free(ids);
    free(text);
    free(auto_out);
    engine_single_free(&e);
    model_free(m);
    return rc;
}
