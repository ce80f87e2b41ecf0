/* kvserve: one binary, subcommands. */
#include <stdio.h>
#include <string.h>

#include "server/cli/cli.h"

static void usage(FILE *out) {
    fprintf(out, "usage: kvserve <command> [options]\n\n"
                 "commands:\n"
                 "  serve      the OpenAI-compatible HTTP server\n"
                 "  generate   run a prompt through a model and stream the answer\n"
                 "  bench      measure prefill and decode speed (pp512, pp2048, tg128, tg64@4096)\n"
                 "  calibrate  profile the CacheGen codec's table for a model (MODEL.kvcodec)\n"
                 "  codec-eval size, speed and quality of the codec's levels and baselines\n\n"
                 "`kvserve <command> --help` lists a command's options.\n");
}

int main(int argc, char **argv) {
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (strcmp(argv[1], "serve") == 0) return cli_serve(argc - 1, argv + 1);
    if (strcmp(argv[1], "generate") == 0) return cli_generate(argc - 1, argv + 1);
    if (strcmp(argv[1], "bench") == 0) return cli_bench(argc - 1, argv + 1);
    if (strcmp(argv[1], "calibrate") == 0) return cli_calibrate(argc - 1, argv + 1);
    if (strcmp(argv[1], "codec-eval") == 0) return cli_codec_eval(argc - 1, argv + 1);
    if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
        usage(stdout);
        return 0;
    }
    fprintf(stderr, "kvserve: unknown command '%s'\n", argv[1]);
    usage(stderr);
    return 2;
}
