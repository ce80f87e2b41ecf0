/* Helpers shared by the command-line tools: a table-driven option parser and the option rows
 * every model-running tool shares (their values: engine_model_opts, server/engine/single.h). */
#ifndef KVSERVE_CLI_COMMON_H
#define KVSERVE_CLI_COMMON_H

#include <stdio.h>

#include "model/model.h"
#include "server/engine/single.h"

/* ---------------------------------------------------------------- options */

/* What an option's value is, and what dst points to. */
typedef enum cli_opt_type {
    CLI_OPT_FLAG,   /* bool *: set when the option is given (no value) */
    CLI_OPT_STRING, /* const char **: the value as given */
    CLI_OPT_INT,    /* int *: a whole integer in [min, max] (within int) */
    CLI_OPT_INT64,  /* int64_t *: a whole integer in [min, max] */
    CLI_OPT_FLOAT,  /* float *: a finite number in [fmin, fmax] (checked as a double) */
    CLI_OPT_FN,     /* fn(dst, value, err): anything else (lists, enumerations) */
} cli_opt_type;

/* One row of a tool's option table; -h/--help is implicit. */
typedef struct cli_opt {
    const char *name; /* long name, without the dashes */
    char short_name;  /* 0: none */
    cli_opt_type type;
    void *dst;
    long long min, max; /* CLI_OPT_INT, CLI_OPT_INT64 */
    double fmin, fmax;  /* CLI_OPT_FLOAT */
    int (*fn)(void *dst, const char *value, kv_error *err);
    const char *required; /* non-NULL: the option must be given; names its value ("MODEL") */
} cli_opt;

/* A tool's command line. */
typedef struct cli_command {
    const char *name;         /* "kvserve generate": starts every message */
    void (*usage)(FILE *out); /* the --help text */
    const cli_opt *opts;
    int n_opts;
} cli_command;

/* Parses argv[1..argc) (argv[0] is the command's own name) into the table's destinations, which
 * hold the defaults beforehand. Returns -1 when the tool goes on, else the exit status it returns
 * at once: 0 after --help (usage on stdout), 2 after a message on stderr (an unknown option, a
 * missing or bad value, a required option left out or an argument that is not an option; usage
 * follows, except for a bad value, where the message says what is wanted). */
int cli_parse(const cli_command *cmd, int argc, char **argv);

/* Parse the whole string as a number in [lo, hi]; the message names opt. */
int cli_parse_int(const char *opt, const char *s, long long lo, long long hi, long long *out,
                  kv_error *err);
int cli_parse_float(const char *opt, const char *s, double lo, double hi, double *out,
                    kv_error *err);

/* Their table rows (--chat-template and --precise are the tool's own: not every tool has them). */
#define CLI_MODEL_OPT(mo)                                                                          \
    { "model", 'm', CLI_OPT_STRING, .dst = &(mo)->path, .required = "MODEL" }
#define CLI_THREADS_OPT(mo)                                                                        \
    { "threads", 't', CLI_OPT_INT, .dst = &(mo)->threads, .min = 1, .max = 256 }
#define CLI_SIMD_OPT(mo)                                                                           \
    { "simd", 0, CLI_OPT_FN, .dst = &(mo)->simd, .fn = cli_parse_simd }
#define CLI_DEVICE_OPT(mo)                                                                         \
    { "device", 0, CLI_OPT_FN, .dst = &(mo)->device, .fn = cli_parse_device }
/* --device's value: auto, cuda or cpu. */
int cli_parse_device(void *dst, const char *value, kv_error *err);
/* --simd's value: one simd_level_from_name knows. */
int cli_parse_simd(void *dst, const char *value, kv_error *err);

#endif
