/* Helpers shared by the command-line tools: a table-driven option parser, the options every
 * model-running tool shares, and a single-sequence engine (the model, one backend, KV pool,
 * sequence and forward context). */
#ifndef KVSERVE_CLI_COMMON_H
#define KVSERVE_CLI_COMMON_H

#include <stdio.h>

#include "model/model.h"

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
/* Whole file as a NUL-terminated string, or NULL with err. */
char *cli_read_file(const char *path, kv_error *err);

/* The options of every tool that runs a model; the tool sets the defaults. */
typedef struct cli_model_opts {
    const char *path;          /* -m, --model: the GGUF file */
    const char *chat_template; /* --chat-template (NULL: the GGUF's) */
    int threads;               /* -t, --threads */
    bool precise;              /* --precise: f32 matmuls instead of 8-bit activations */
    const char *simd;          /* --simd: auto|avx512|avx2|scalar (NULL: auto) */
    const char *device;        /* --device: auto|cuda|cpu (NULL: cpu, for tools without it) */
} cli_model_opts;

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
/* Makes `name`'s SIMD level (NULL: auto) the one the kernels use; a level the CPU cannot run is
 * lowered to what it can, with a warning. -1 with err for an unknown name. */
int cli_simd_apply(const char *name, kv_error *err);

/* ---------------------------------------------------------------- single-sequence engine */

/* Prompts are prefilled in slices of this many tokens (the forward context's batch size). */
#define ENGINE_SLICE 512

typedef struct engine_single {
    model *m; /* owned */
    int threads;
    bool precise;
    const char *device; /* backend_create's name */
    backend *b;
    kv_pool *pool;
    forward_ctx *fwd;
    kv_seq seq;
    int ctx;
    float *logits;              /* [n_vocab] logits of the last token run */
    float *rows;                /* [ENGINE_ROWS][n_vocab] for engine_single_rows (lazily) */
    const forward_hooks *hooks; /* passed to every forward pass (NULL: none) */
} engine_single;

/* engine_single_rows runs this many tokens per forward pass. */
#define ENGINE_ROWS 128
/* Receives row i's logits ([n_vocab]) from engine_single_rows; nonzero stops the run. */
typedef int (*engine_row_fn)(void *ud, int i, const float *logits);

/* Loads o's model into e (zeroed first), which owns it from then on. The engine itself starts
 * with engine_single_start, once the tool knows the context it needs (often from the model). */
int engine_single_load(engine_single *e, const cli_model_opts *o, kv_error *err);
/* A backend with o's threads and precision, a KV pool of ctx tokens and a forward context. On
 * failure e holds what was made: engine_single_free frees it. */
int engine_single_start(engine_single *e, int ctx, kv_error *err);
/* The engine and the model; safe on a zeroed or partly made engine. */
void engine_single_free(engine_single *e);
/* Appends tokens to the sequence (positions continue from its length) in slices. */
int engine_single_prefill(engine_single *e, const int32_t *ids, int n, kv_error *err);
int engine_single_decode(engine_single *e, int32_t id, kv_error *err);
/* The sequence's KV of tokens [0, n_chunks * chunk) as f32, chunk by chunk: out is
 * [chunk][layer][kv][token][channel] (channel = kv head * head_dim + d), the codec's order.
 * -1 with err when out of memory. */
int engine_single_read_kv(engine_single *e, int n_chunks, int chunk, float *out, kv_error *err);
/* The inverse of engine_single_read_kv: the sequence becomes tokens [0, n) whose KV is kv's
 * (same layout, ceil(n / chunk) chunks; a last partial chunk's tail is not read). */
int engine_single_write_kv(engine_single *e, int n, int chunk, const float *kv, kv_error *err);
/* Truncates the sequence to `from` tokens, runs tokens[from..to) at positions from.. over it
 * and hands every row's logits to fn (i = position - from), in order. The tokens' KV stays in
 * the sequence. Hooks are not called. */
int engine_single_rows(engine_single *e, const int32_t *tokens, int from, int to, engine_row_fn fn,
                       void *ud, kv_error *err);
/* Drops the sequence's KV. */
void engine_single_reset(engine_single *e);

#endif
