/* The command-line tools' shared helpers (server/cli/cli_common.h): the table-driven option
 * parser every subcommand (serve, generate, bench, calibrate, codec-eval) reads its argv with,
 * its number parsers, and the value checks of the model options they share (--device, --simd). */
#include "server/cli/cli_common.h"

#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- options */

int cli_parse_int(const char *opt, const char *s, long long lo, long long hi, long long *out,
                  kv_error *err) {
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end != '\0' || v < lo || v > hi)
        return kv_fail(err, "%s: '%s' is not an integer in [%lld, %lld]", opt, s, lo, hi);
    *out = v;
    return 0;
}

int cli_parse_float(const char *opt, const char *s, double lo, double hi, double *out,
                    kv_error *err) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end != '\0' || !isfinite(v) || v < lo || v > hi)
        return kv_fail(err, "%s: '%s' is not a number in [%g, %g]", opt, s, lo, hi);
    *out = v;
    return 0;
}

/* Stores one option's value (NULL for a flag) where its row says. */
static int opt_store(const cli_opt *o, const char *value, kv_error *err) {
    char name[64];
    long long ll;
    double d;
    snprintf(name, sizeof name, "--%s", o->name);
    switch (o->type) {
    case CLI_OPT_FLAG:
        *(bool *)o->dst = true;
        return 0;
    case CLI_OPT_STRING:
        *(const char **)o->dst = value;
        return 0;
    case CLI_OPT_INT:
        if (cli_parse_int(name, value, o->min, o->max, &ll, err)) return -1;
        *(int *)o->dst = (int)ll;
        return 0;
    case CLI_OPT_INT64:
        if (cli_parse_int(name, value, o->min, o->max, &ll, err)) return -1;
        *(int64_t *)o->dst = ll;
        return 0;
    case CLI_OPT_FLOAT:
        if (cli_parse_float(name, value, o->fmin, o->fmax, &d, err)) return -1;
        *(float *)o->dst = (float)d;
        return 0;
    case CLI_OPT_FN:
        return o->fn(o->dst, value, err);
    }
    return kv_fail(err, "%s: unknown option type %d", name, (int)o->type);
}

/* getopt_long does the scanning (its messages name argv[0], the command, for an unknown option
 * or a missing value); the table gives it long options with values 256 + row and short ones as
 * themselves. */
int cli_parse(const cli_command *cmd, int argc, char **argv) {
    int n = cmd->n_opts, rc = -1, c;
    struct option *longopts = calloc((size_t)n + 2, sizeof *longopts);
    char *shortopts = malloc(2 * (size_t)n + 2);
    bool *seen = calloc((size_t)n + 1, sizeof *seen);
    if (!longopts || !shortopts || !seen) {
        fprintf(stderr, "%s: out of memory\n", cmd->name);
        rc = 2;
        goto done;
    }
    char *sp = shortopts;
    for (int i = 0; i < n; i++) {
        const cli_opt *o = &cmd->opts[i];
        int has_arg = o->type == CLI_OPT_FLAG ? no_argument : required_argument;
        longopts[i] = (struct option){o->name, has_arg, NULL, 256 + i};
        if (o->short_name) {
            *sp++ = o->short_name;
            if (has_arg == required_argument) *sp++ = ':';
        }
    }
    longopts[n] = (struct option){"help", no_argument, NULL, 'h'};
    *sp++ = 'h';
    *sp = '\0';

    char *argv0 = argv[0];
    argv[0] = (char *)cmd->name;
    optind = 0; /* glibc: start afresh (a second parse in one process, as in the unit tests) */
    while (rc < 0 && (c = getopt_long(argc, argv, shortopts, longopts, NULL)) != -1) {
        int i = -1;
        if (c >= 256) {
            i = c - 256;
        } else if (c != 'h' && c != '?') {
            for (int k = 0; k < n && i < 0; k++)
                if (cmd->opts[k].short_name == c) i = k;
        }
        if (c == 'h') {
            cmd->usage(stdout);
            rc = 0;
        } else if (i < 0) { /* getopt_long said why */
            cmd->usage(stderr);
            rc = 2;
        } else {
            kv_error err = {{0}};
            if (opt_store(&cmd->opts[i], optarg, &err)) {
                fprintf(stderr, "%s: %s\n", cmd->name, err.msg);
                rc = 2;
            }
            seen[i] = true;
        }
    }
    argv[0] = argv0;
    if (rc >= 0) goto done;
    if (optind < argc) {
        fprintf(stderr, "%s: unexpected argument '%s'\n", cmd->name, argv[optind]);
        cmd->usage(stderr);
        rc = 2;
        goto done;
    }
    for (int i = 0; i < n; i++) {
        const cli_opt *o = &cmd->opts[i];
        if (o->required && !seen[i]) {
            if (o->short_name)
                fprintf(stderr, "%s: need -%c %s\n", cmd->name, o->short_name, o->required);
            else
                fprintf(stderr, "%s: need --%s %s\n", cmd->name, o->name, o->required);
            cmd->usage(stderr);
            rc = 2;
            goto done;
        }
    }
done:
    free(longopts);
    free(shortopts);
    free(seen);
    return rc;
}

/* ---------------------------------------------------------------- the shared model options */

int cli_parse_device(void *dst, const char *value, kv_error *err) {
    if (strcmp(value, "auto") && strcmp(value, "cuda") && strcmp(value, "cpu"))
        return kv_fail(err, "--device: '%s' is not auto, cuda or cpu", value);
    *(const char **)dst = value;
    return 0;
}

int cli_parse_simd(void *dst, const char *value, kv_error *err) {
    simd_level l;
    if (simd_level_from_name(value, &l) != 0)
        return kv_fail(err, "--simd: '%s' is not auto, avx512, avx2 or scalar", value);
    *(const char **)dst = value;
    return 0;
}
