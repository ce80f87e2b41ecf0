/* `kvserve calibrate`: profiles the CacheGen codec's table for a model from the model's own KV
 * (channel scales and entropy models per level; cache/codec/codec.h) and writes it beside the model
 * (MODEL.kvcodec), where the server and `kvserve codec-eval` find it. The calibration itself is
 * server/engine/calibrate.c. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/codec/codec.h"
#include "model/model.h"
#include "server/cli/cli.h"
#include "server/cli/cli_common.h"
#include "server/engine/calibrate.h"

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
            "      --bins LIST      bins per level, comma-separated, in step units\n"
            "                       (default 0.4,0.7,1,1.3)\n"
            "      --group N        tokens per anchor group; 0: no anchors (default 0)\n"
            "      --units U        step units: importance (default) or sd (each channel's\n"
            "                       standard deviation, no weighting)\n"
            "      --margin L       keep exact the tokens the mean query scores L logits\n"
            "                       above a chunk's median (default 4; 0: only position 0)\n"
            "  -t, --threads N      compute threads (default 2)\n"
            "  -h, --help           this text\n",
            CALIB_DEFAULT_TOKENS, CALIB_DEFAULT_CHUNK);
}

/* --units importance|sd: *dst is true for sd. */
static int parse_units(void *dst, const char *arg, kv_error *err) {
    if (strcmp(arg, "importance") && strcmp(arg, "sd"))
        return kv_fail(err, "--units is importance or sd, not '%s'", arg);
    *(bool *)dst = !strcmp(arg, "sd");
    return 0;
}

int cli_calibrate(int argc, char **argv) {
    engine_model_opts mo = {.threads = 2};
    const char *out_path = NULL;
    calib_opts co = CALIB_DEFAULTS;
    int64_t seed = 1;
    const cli_opt opts[] = {
        CLI_MODEL_OPT(&mo),
        {"out", 'o', CLI_OPT_STRING, .dst = &out_path},
        {"text", 0, CLI_OPT_STRING, .dst = &co.text_path},
        {"tokens", 'n', CLI_OPT_INT, .dst = &co.n_tokens, .min = 16, .max = 1 << 20},
        {"chunk", 0, CLI_OPT_INT, .dst = &co.chunk, .min = 16, .max = 65536},
        {"seed", 0, CLI_OPT_INT64, .dst = &seed, .min = 0, .max = INT64_MAX},
        {"bins", 0, CLI_OPT_STRING, .dst = &co.bins},
        {"group", 0, CLI_OPT_INT, .dst = &co.group, .min = 0, .max = CODEC_MAX_TOKENS},
        {"units", 0, CLI_OPT_FN, .dst = &co.sd_units, .fn = parse_units},
        CLI_THREADS_OPT(&mo),
        {"margin", 0, CLI_OPT_FLOAT, .dst = &co.margin, .fmin = 0, .fmax = 1000},
    };
    const cli_command cmd = {"kvserve calibrate", usage, opts, sizeof opts / sizeof opts[0]};
    int rc = cli_parse(&cmd, argc, argv);
    if (rc >= 0) return rc;
    co.seed = (uint64_t)seed;
    kv_error err = {{0}};
    codec_table table = {0};
    char *auto_out = NULL;
    rc = 1;
    int n_chunks = 0;
    if (calibrate_codec_table(&mo, &co, &table, &n_chunks, &err)) goto done;
    if (!out_path) {
        if (asprintf(&auto_out, "%s.kvcodec", mo.path) < 0) {
            kv_fail(&err, "out of memory");
            goto done;
        }
        out_path = auto_out;
    }
    if (codec_table_save(&table, out_path, &err)) goto done;
    printf("calibrated %d chunks of %d tokens (%d layers, %d KV channels, %d levels): %s\n",
           n_chunks, co.chunk, table.n_layer, table.n_chan, table.n_levels, out_path);
    rc = 0;
done:
    if (rc) fprintf(stderr, "kvserve calibrate: %s\n", err.msg);
    codec_table_free(&table);
    free(auto_out);
    return rc;
}
