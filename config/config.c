/* config: one table of options, applied in layers: defaults < JSON file < KVSERVE_* environment
 * < command-line flags.
 *
 * Every option is one row of OPTIONS below; its flag (--ctx-size), variable (KVSERVE_CTX_SIZE)
 * and JSON key (ctx_size) are derived from the row's key, and one text parser per type serves
 * both the environment and the flags, so the two layers accept exactly the same values.
 *
 * String ownership: config_defaults stores pointers to the table's static text (defaults and
 * enum choices); every other string in a kv_config is heap-allocated by config_load. The
 * setters and config_free free a string only when it is not one of the row's static strings,
 * so a defaulted struct needs no allocation and config_free is safe on it.
 *
 * Lists (api_keys, alias): a flag may be repeated and a variable holds a comma-separated list;
 * the first value a layer gives replaces the list of the layers below instead of adding to it.
 *
 * Empty values: for numbers, booleans, enums and the required strings (model, host) an empty
 * value is an error in every layer; for the optional values (alias, chat_template) an empty
 * value (or JSON null) resets the option to "automatic"; KVSERVE_API_KEYS="" is an error rather
 * than "no keys", so an unset shell variable cannot silently turn authentication off. */
#include "config/config.h"
#include "util/json.h"

#include <ctype.h>
#include <errno.h>
#include <jansson.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>

/* ---------------------------------------------------------------- the option table */

typedef enum opt_type {
    OPT_STRING,      /* char *; `nullable` rows accept "" / null as NULL */
    OPT_STRING_LIST, /* char ** + int count; `nullable` rows accept "" / null as the empty list
                        and, in the JSON file, one string as a list of one */
    OPT_INT,         /* int */
    OPT_INT64,       /* int64_t */
    OPT_BOOL,        /* bool */
    OPT_ENUM,        /* char * pointing at one of `choices` (static) */
} opt_type;

typedef enum opt_group {
    GROUP_MODEL,
    GROUP_HTTP,
    GROUP_ENGINE,
    GROUP_CACHE,
    GROUP_LOGGING,
    GROUP_COUNT,
} opt_group;

static const char *const GROUP_NAMES[GROUP_COUNT] = {"Model", "HTTP server", "Engine",
                                                     "Context cache", "Logging"};

typedef struct opt_row {
    const char *key;  /* JSON key, snake_case; the flag and variable names derive from it */
    const char *flag; /* long flag without "--" when it is not the derived one, else NULL */
    char short_flag;  /* 0: none */
    opt_type type;
    opt_group group;     /* heading in the usage text */
    size_t offset;       /* offsetof(kv_config, field) */
    size_t count_offset; /* OPT_STRING_LIST: offsetof the int count */
    int64_t min, max;    /* numbers: the accepted range */
    bool zero_ok;        /* numbers: 0 is accepted outside [min, max] ("0: automatic") */
    bool size_suffix;    /* numbers: K, M, G (binary) suffixes accepted */
    bool nullable;       /* strings and lists: "" or JSON null reset the option */
    const char *item;    /* OPT_STRING_LIST: what one value is, for messages */
    bool comma;          /* OPT_STRING_LIST: a flag's value is a comma-separated list too */
    /* OPT_STRING_LIST: refuses a bad value (not an empty one: every list refuses those) with a
     * message that does not quote it, or NULL: any value */
    int (*check_item)(const char *value, size_t len, kv_error *err);
    const char *const *choices; /* OPT_ENUM: NULL-terminated */
    const char *def;            /* default as text (parsed by config_defaults); NULL: none */
    const char *metavar;        /* value placeholder in the usage; NULL for booleans */
    const char *help;
} opt_row;

/* cache_enc_name's names of the encodings a tier holds (cache/cache.h), codec levels up to
 * CODEC_MAX_LEVELS */
static const char *const RAM_ENCODINGS[] = {"lossless", "q8",     "codec0", "codec1",
                                            "codec2",   "codec3", "codec4", "codec5",
                                            "codec6",   "codec7", NULL};
static const char *const LOG_LEVELS[] = {"error", "warn", "info", "debug", NULL};
static const char *const POOLINGS[] = {"auto", "mean", "last", "cls", NULL};
static const char *const SIMD_LEVELS[] = {"auto", "avx512", "avx2", "scalar", NULL};
static const char *const DEVICES[] = {"auto", "cuda", "cpu", NULL};
static const char *const SPEC_MODES[] = {"off", "context", NULL};
/* GET /get_load's shape: the router in front (server/api/router_api.c) */
static const char *const LOAD_FORMATS[] = {"sglang", "vllm", NULL};
/* blend_policy_name's names (cache/blend/blend.h) */
static const char *const BLEND_POLICIES[] = {"hkvd", "legolink", "hybrid", NULL};

/* A usable Bearer key: printable, no spaces (RFC 6750 token68 has none). Keys are secrets: the
 * message never quotes one. */
static int check_api_key(const char *value, size_t len, kv_error *err) {
    for (size_t i = 0; i < len; i++) {
        unsigned char ch = (unsigned char)value[i];
        if (ch <= ' ' || ch == 0x7f)
            return kv_fail(err, "API key contains a space or control character");
    }
    return 0;
}

/* An origin as browsers send it: "*" (any), "null", or scheme://host[:port] with no path (a
 * trailing "/", as an address bar shows it, is taken). */
static int check_origin(const char *value, size_t len, kv_error *err) {
    if ((len == 1 && value[0] == '*') || (len == 4 && memcmp(value, "null", 4) == 0)) return 0;
    size_t i = 0;
    while (i < len && (isalnum((unsigned char)value[i]) || strchr("+.-", value[i]))) i++;
    if (i == 0 || len - i < 4 || memcmp(value + i, "://", 3) != 0)
        return kv_fail(err,
                       "origin '%.*s' is not scheme://host[:port] (e.g. http://localhost:3000)",
                       (int)len, value);
    for (i += 3; i < len; i++)
        if ((value[i] == '/' && i + 1 < len) || (unsigned char)value[i] <= ' ' || value[i] == 0x7f)
            return kv_fail(err,
                           "origin '%.*s' has a path or a space: an origin is "
                           "scheme://host[:port] only",
                           (int)len, value);
    return 0;
}

/* A Host name (or address) without scheme, path or port: "*" (any), "myhost", "10.0.0.5". */
static int check_host_name(const char *value, size_t len, kv_error *err) {
    for (size_t i = 0; i < len; i++) {
        unsigned char ch = (unsigned char)value[i];
        if (ch <= ' ' || ch == 0x7f || ch == '/' || (ch == ':' && value[0] != '['))
            return kv_fail(err, "host '%.*s' is not a host name (no scheme, path or port)",
                           (int)len, value);
    }
    return 0;
}

#define KIB (INT64_C(1) << 10)
#define MIB (INT64_C(1) << 20)
#define GIB (INT64_C(1) << 30)

/* One macro per kind keeps each row to a line or two. */
#define STR(k, sh, def_, nullable_, meta, help_)                                                   \
    {                                                                                              \
        .key = #k, .short_flag = sh, .type = OPT_STRING, .group = GROUP, .nullable = nullable_,    \
        .offset = offsetof(kv_config, k), .def = def_, .metavar = meta, .help = help_              \
    }
#define NUM(k, sh, t, lo, hi, zero, suffix, def_, meta, help_)                                     \
    {                                                                                              \
        .key = #k, .short_flag = sh, .type = t, .group = GROUP, .offset = offsetof(kv_config, k),  \
        .min = lo, .max = hi, .zero_ok = zero, .size_suffix = suffix, .def = def_,                 \
        .metavar = meta, .help = help_                                                             \
    }
#define BOOL(k, def_, help_)                                                                       \
    {                                                                                              \
        .key = #k, .type = OPT_BOOL, .group = GROUP, .offset = offsetof(kv_config, k),             \
        .def = def_, .help = help_                                                                 \
    }

/* clang-format off */
static const opt_row OPTIONS[] = {
#define GROUP GROUP_MODEL
    STR(model, 'm', "models/SmolLM2-135M-Instruct.Q4_1.gguf", false, "PATH",
        "GGUF model file to serve"),
    {.key = "alias", .type = OPT_STRING_LIST, .group = GROUP, .nullable = true,
     .offset = offsetof(kv_config, aliases), .count_offset = offsetof(kv_config, n_aliases),
     .item = "alias", .metavar = "NAME",
     .help = "model name served, repeatable; first one reported (none: file name)"},
    BOOL(accept_any_model, "false",
         "answer requests naming any model, not only the served names"),
    STR(chat_template, 0, NULL, true, "NAME",
        "chat template name (none: detected from the model)"),
    BOOL(precise, "false", "f32 matmuls over dequantized weights (slower, more exact)"),
    {.key = "pooling", .type = OPT_ENUM, .group = GROUP, .offset = offsetof(kv_config, pooling),
     .choices = POOLINGS, .def = "auto", .metavar = "HOW",
     .help = "embedding pooling: mean, last, cls, auto (GGUF pooling_type)"},
    {.key = "simd", .type = OPT_ENUM, .group = GROUP, .offset = offsetof(kv_config, simd),
     .choices = SIMD_LEVELS, .def = "auto", .metavar = "LEVEL",
     .help = "CPU kernels: auto (the CPU's best), avx512, avx2, scalar"},
    {.key = "device", .type = OPT_ENUM, .group = GROUP, .offset = offsetof(kv_config, device),
     .choices = DEVICES, .def = "auto", .metavar = "DEV",
     .help = "compute backend: auto (CUDA if a GPU is present), cuda, cpu"},
    BOOL(cuda_graphs, "true", "CUDA: decode steps replayed as graphs (off: launched one by one)"),
#undef GROUP
#define GROUP GROUP_HTTP
    STR(host, 0, "127.0.0.1", false, "ADDR", "address to listen on"),
    NUM(port, 0, OPT_INT, 1, 65535, false, false, "8080", "PORT", "TCP port to listen on"),
    {.key = "api_keys", .flag = "api-key", .type = OPT_STRING_LIST, .group = GROUP,
     .offset = offsetof(kv_config, api_keys), .count_offset = offsetof(kv_config, n_api_keys),
     .item = "API key", .check_item = check_api_key, .metavar = "KEY",
     .help = "accepted Bearer key, repeatable (none: no authentication)"},
    NUM(max_body_bytes, 0, OPT_INT64, KIB, GIB, false, true, "8M", "BYTES",
        "largest request body accepted (K, M, G suffixes)"),
    NUM(max_connections, 0, OPT_INT, 1, 1 << 20, false, false, "4096", "N",
        "open HTTP connections (capped by the fd limit); more are refused"),
    NUM(http_threads, 0, OPT_INT, 1, 64, false, false, "4", "N",
        "HTTP threads (epoll; connections wait without holding one)"),
    NUM(idle_timeout, 0, OPT_INT, 1, 86400, false, false, "30", "SECONDS",
        "close connections idle this long with no complete request"),
    NUM(shutdown_timeout, 0, OPT_INT, 0, 86400, false, false, "30", "SECONDS",
        "on SIGTERM, time running requests get to finish"),
    NUM(drain_grace, 0, OPT_INT, 0, 3600, false, false, "0", "SECONDS",
        "on SIGTERM, time requests are still taken while /health says 503"),
    {.key = "get_load_format", .type = OPT_ENUM, .group = GROUP,
     .offset = offsetof(kv_config, get_load_format), .choices = LOAD_FORMATS, .def = "sglang",
     .metavar = "ROUTER", .help = "GET /get_load's shape for the router in front: sglang, vllm"},
    BOOL(webui, "true", "the web page at / (chat and a live view of the cache)"),
    {.key = "allowed_origins", .type = OPT_STRING_LIST, .group = GROUP, .nullable = true,
     .comma = true, .offset = offsetof(kv_config, allowed_origins),
     .count_offset = offsetof(kv_config, n_allowed_origins), .item = "origin",
     .check_item = check_origin, .metavar = "ORIGINS",
     .help = "other origins whose pages may call the API, comma-separated (*: all)"},
    {.key = "allowed_hosts", .type = OPT_STRING_LIST, .group = GROUP, .nullable = true,
     .comma = true, .offset = offsetof(kv_config, allowed_hosts),
     .count_offset = offsetof(kv_config, n_allowed_hosts), .item = "host",
     .check_item = check_host_name, .metavar = "NAMES",
     .help = "Host names a loopback listener answers too, comma-separated (*: all)"},
    NUM(responses_store, 0, OPT_INT, 1, 1 << 24, true, false, "1024", "N",
        "Responses API: stored responses kept, all keys (0: none stored)"),
    NUM(responses_store_bytes, 0, OPT_INT64, MIB, INT64_C(1) << 33, false, true, "64M", "BYTES",
        "Responses API: bytes of stored responses kept"),
    NUM(tenant_store_share, 0, OPT_INT, 1, 100, true, false, "0", "PCT",
        "stored responses each API key keeps for sure (0: an equal part)"),
#undef GROUP
#define GROUP GROUP_ENGINE
    NUM(threads, 't', OPT_INT, 1, 256, false, false, "2", "N",
        "CPU threads for the forward pass"),
    NUM(ctx_size, 'c', OPT_INT, 16, INT64_C(1) << 24, true, false, "0", "N",
        "context per sequence in tokens (0: the model's training context)"),
    NUM(kv_pool_tokens, 0, OPT_INT64, 16, INT64_C(1) << 30, true, false, "0", "N",
        "KV cache pool size in tokens (0: 4 x ctx-size)"),
    NUM(max_seqs, 0, OPT_INT, 1, 256, false, false, "16", "N",
        "sequences decoding at once (each choice of n counts)"),
    NUM(max_queue, 0, OPT_INT, 1, 100000, false, false, "64", "N",
        "requests waiting for a slot before 429"),
    NUM(tenant_queue_share, 0, OPT_INT, 1, 100, true, false, "0", "PCT",
        "share of max-queue one API key may fill (0: an equal part)"),
    NUM(prefill_chunk, 0, OPT_INT, 16, 8192, false, false, "256", "N",
        "prompt tokens prefilled per engine step, between decode steps"),
    NUM(max_tokens_limit, 0, OPT_INT, 0, INT64_C(1) << 24, false, false, "0", "N",
        "cap on a request's max_tokens (0: the context size)"),
    {.key = "spec", .type = OPT_ENUM, .group = GROUP, .offset = offsetof(kv_config, spec),
     .choices = SPEC_MODES, .def = "context", .metavar = "MODE",
     .help = "speculative decoding: context (drafts from prompt and output), off"},
    STR(draft_model, 0, NULL, true, "FILE",
        "draft model for speculation: a smaller GGUF, same vocabulary (none)"),
#undef GROUP
#define GROUP GROUP_CACHE
    BOOL(cache, "true", "reuse cached prompt prefixes and store new chunks"),
    NUM(cache_chunk_tokens, 0, OPT_INT, 16, 4096, false, false, "256", "N",
        "tokens per cached chunk (a multiple of 16)"),
    NUM(cache_ram_bytes, 0, OPT_INT64, 0, INT64_C(1) << 40, true, true, "2G", "BYTES",
        "RAM tier capacity (0: no RAM tier)"),
    {.key = "cache_ram_encoding", .type = OPT_ENUM, .group = GROUP,
     .offset = offsetof(kv_config, cache_ram_encoding), .choices = RAM_ENCODINGS,
     .def = "lossless", .metavar = "ENC",
     .help = "RAM tier holds chunks as lossless, q8 or codec0..7 (lossy: more fit)"},
    STR(cache_dir, 0, "auto", false, "DIR",
        "disk tier directory (auto: ~/.cache/kvserve or $XDG_CACHE_HOME; off)"),
    NUM(cache_disk_bytes, 0, OPT_INT64, MIB, INT64_C(1) << 44, false, true, "4G", "BYTES",
        "disk tier capacity"),
    BOOL(cache_disk_encoded, "false",
         "disk tier keeps chunks' q8 and codec levels too"),
    NUM(pin_bytes, 0, OPT_INT64, MIB, INT64_C(1) << 44, false, true, "1G", "BYTES",
        "pinned and cache_control-leased chunks at most, per tier"),
    NUM(tenant_pin_share, 0, OPT_INT, 1, 100, true, false, "0", "PCT",
        "share of pin-bytes one API key may hold (0: an equal part)"),
    STR(redis, 0, NULL, true, "URL",
        "Redis tier: redis://[:PASS@]HOST[:PORT][/DB] or unix:///PATH"),
    NUM(redis_ttl, 0, OPT_INT64, 1, INT64_C(1) << 31, true, false, "86400", "SECONDS",
        "expiry of the keys the Redis tier writes (0: none)"),
    NUM(redis_timeout_ms, 0, OPT_INT, 1, 60000, false, false, "200", "MS",
        "each Redis connect, send or receive waits at most this long"),
    STR(redis_codec, 0, "auto", false, "auto|off|PATH",
        "codec table of Redis and disk levels (auto: found or calibrated)"),
    NUM(ttft_budget_ms, 0, OPT_INT64, 1, 3600000, true, false, "0", "MS",
        "time to load reused KV in (Redis, disk); levels adapt (0: lossless)"),
    BOOL(blend, "true",
         "reuse chunks found by content anywhere in a prompt (CacheBlend)"),
    NUM(blend_recompute, 0, OPT_INT, 0, 100, true, false, "15", "PCT",
        "least percentage of blended tokens recomputed"),
    {.key = "blend_policy", .type = OPT_ENUM, .group = GROUP,
     .offset = offsetof(kv_config, blend_policy), .choices = BLEND_POLICIES, .def = "hkvd",
     .metavar = "HOW", .help = "blended tokens recomputed: hkvd, legolink (chunk starts), hybrid"},
    NUM(blend_ram_bytes, 0, OPT_INT64, MIB, INT64_C(1) << 40, true, true, "0", "BYTES",
        "blend content store capacity (0: a quarter of cache-ram-bytes)"),
    NUM(blend_disk_bytes, 0, OPT_INT64, MIB, INT64_C(1) << 40, true, true, "0", "BYTES",
        "blend records on disk (0: a quarter of cache-disk-bytes)"),
    NUM(blend_chunk, 0, OPT_INT, 16, 16384, false, false, "2048", "N",
        "most prompt tokens in one blended prefill step"),
    STR(reuse_quality, 0, "floor", false, "BUDGET",
        "approximate reuse's budget: floor, balanced, fast, a KL, none"),
    STR(reuse_calibration, 0, "auto", false, "auto|PATH",
        "the model's reuse-quality calibration (auto: MODEL.kvquality.json)"),
    NUM(quality_sample, 0, OPT_INT, 0, 100, true, false, "2", "PCT",
        "blended requests checked against a full prefill (0: no live check)"),
    BOOL(blend_repair, "false",
         "blended prompts computed again in full when idle, stored for repeats"),
    BOOL(schema_fixup, "false",
         "Prompt Cache's fix-up by default"),
    NUM(schema_fixup_recompute, 0, OPT_INT, 0, 100, true, false, "15", "PCT",
        "fix-up: percentage of module tokens recomputed"),
    NUM(schema_max, 0, OPT_INT, 1, 100000, false, false, "256", "N",
        "Prompt Cache schemas kept (all namespaces)"),
#undef GROUP
#define GROUP GROUP_LOGGING
    {.key = "log_level", .type = OPT_ENUM, .group = GROUP,
     .offset = offsetof(kv_config, log_level), .choices = LOG_LEVELS, .def = "info",
     .metavar = "LEVEL", .help = "error, warn, info or debug"},
#undef GROUP
};
/* clang-format on */

#undef STR
#undef NUM
#undef BOOL

#define N_OPTIONS ((int)(sizeof OPTIONS / sizeof OPTIONS[0]))
#define ENV_PREFIX "KVSERVE_"
#define ENV_CONFIG "KVSERVE_CONFIG"
#define ENV_API_KEY "KVSERVE_API_KEY" /* one key, besides the comma-separated KVSERVE_API_KEYS */
/* Longest key, flag or variable name handled; longer names are unknown by construction. */
#define NAME_MAX_LEN 64
/* Values are quoted in error messages up to this many bytes. */
#define QUOTE_MAX 80

/* ---------------------------------------------------------------- names */

/* "ctx_size" -> "ctx-size" (or the row's own flag). */
static void row_flag(const opt_row *r, char *buf, size_t size) {
    const char *src = r->flag ? r->flag : r->key;
    size_t i = 0;
    for (; src[i] && i + 1 < size; i++) buf[i] = src[i] == '_' ? '-' : src[i];
    buf[i] = '\0';
}

/* "ctx_size" -> "KVSERVE_CTX_SIZE". */
static void row_env(const opt_row *r, char *buf, size_t size) {
    size_t n = strlen(ENV_PREFIX);
    memcpy(buf, ENV_PREFIX, n);
    size_t i = 0;
    for (; r->key[i] && n + i + 1 < size; i++) buf[n + i] = (char)toupper((unsigned char)r->key[i]);
    buf[n + i] = '\0';
}

static const opt_row *row_by_key(const char *key) {
    for (int i = 0; i < N_OPTIONS; i++)
        if (strcmp(OPTIONS[i].key, key) == 0) return &OPTIONS[i];
    return NULL;
}

/* The row whose long flag is name[0..len), or NULL. */
static const opt_row *row_by_flag(const char *name, size_t len) {
    char buf[NAME_MAX_LEN];
    for (int i = 0; i < N_OPTIONS; i++) {
        row_flag(&OPTIONS[i], buf, sizeof buf);
        if (strlen(buf) == len && memcmp(buf, name, len) == 0) return &OPTIONS[i];
    }
    return NULL;
}

static const opt_row *row_by_env(const char *name, size_t len) {
    char buf[NAME_MAX_LEN];
    for (int i = 0; i < N_OPTIONS; i++) {
        row_env(&OPTIONS[i], buf, sizeof buf);
        if (strlen(buf) == len && memcmp(buf, name, len) == 0) return &OPTIONS[i];
    }
    return NULL;
}

/* Levenshtein distance, for "did you mean" hints; names longer than NAME_MAX_LEN get none. */
static int edit_distance(const char *a, size_t na, const char *b, size_t nb) {
    if (na >= NAME_MAX_LEN || nb >= NAME_MAX_LEN) return NAME_MAX_LEN;
    int prev[NAME_MAX_LEN + 1], cur[NAME_MAX_LEN + 1];
    for (size_t j = 0; j <= nb; j++) prev[j] = (int)j;
    for (size_t i = 1; i <= na; i++) {
        cur[0] = (int)i;
        for (size_t j = 1; j <= nb; j++) {
            int sub = prev[j - 1] + (a[i - 1] != b[j - 1]);
            int del = prev[j] + 1, ins = cur[j - 1] + 1;
            cur[j] = sub < del ? (sub < ins ? sub : ins) : (del < ins ? del : ins);
        }
        memcpy(prev, cur, (nb + 1) * sizeof prev[0]);
    }
    return prev[nb];
}

typedef enum name_kind { NAME_KEY, NAME_FLAG, NAME_ENV } name_kind;

/* Writes " (did you mean 'X'?)" into hint when a row's name is within two edits of name, else
 * "". The flag and env forms also know the names that are not rows. */
static void suggest(name_kind kind, const char *name, size_t len, char *hint, size_t size) {
    static const char *const extra_flags[] = {"config", "help", NULL};
    static const char *const extra_env[] = {ENV_CONFIG, ENV_API_KEY, NULL};
    char best[NAME_MAX_LEN] = "", buf[NAME_MAX_LEN];
    int best_d = 3;
    for (int i = 0; i < N_OPTIONS; i++) {
        if (kind == NAME_KEY)
            snprintf(buf, sizeof buf, "%s", OPTIONS[i].key);
        else if (kind == NAME_FLAG)
            row_flag(&OPTIONS[i], buf, sizeof buf);
        else
            row_env(&OPTIONS[i], buf, sizeof buf);
        int d = edit_distance(name, len, buf, strlen(buf));
        if (d < best_d) {
            best_d = d;
            memcpy(best, buf, sizeof best);
        }
    }
    const char *const *extra = kind == NAME_FLAG  ? extra_flags
                               : kind == NAME_ENV ? extra_env
                                                  : NULL;
    for (; extra && *extra; extra++) {
        int d = edit_distance(name, len, *extra, strlen(*extra));
        if (d < best_d) {
            best_d = d;
            snprintf(best, sizeof best, "%s", *extra);
        }
    }
    if (best_d > 2 || best_d == 0) {
        hint[0] = '\0';
        return;
    }
    snprintf(hint, size, " (did you mean '%s%s'?)", kind == NAME_FLAG ? "--" : "", best);
}

/* ---------------------------------------------------------------- values */

static bool row_is_static(const opt_row *r, const char *p) {
    if (p == NULL) return true;
    if (p == r->def) return true;
    for (const char *const *ch = r->choices; ch && *ch; ch++)
        if (p == *ch) return true;
    return false;
}

static char **str_field(kv_config *c, const opt_row *r) { return (char **)((char *)c + r->offset); }

/* Replaces a string field, freeing the old value when config_load allocated it. */
static void set_string(kv_config *c, const opt_row *r, char *value) {
    char **f = str_field(c, r);
    if (!row_is_static(r, *f)) free(*f);
    *f = value;
}

static void list_clear(kv_config *c, const opt_row *r) {
    char ***list = (char ***)((char *)c + r->offset);
    int *n = (int *)((char *)c + r->count_offset);
    for (int i = 0; i < *n; i++) free((*list)[i]);
    free(*list);
    *list = NULL;
    *n = 0;
}

/* Appends a copy of value[0..len) to a string list after the row's checks. */
static int list_append(kv_config *c, const opt_row *r, const char *value, size_t len,
                       kv_error *err) {
    if (len == 0) return kv_fail(err, "empty %s", r->item);
    if (r->check_item && r->check_item(value, len, err) != 0) return -1;
    char ***list = (char ***)((char *)c + r->offset);
    int *n = (int *)((char *)c + r->count_offset);
    if (*n >= 4096) return kv_fail(err, "more than 4096 values");
    char **grown = realloc(*list, (size_t)(*n + 1) * sizeof *grown);
    if (!grown) return kv_fail(err, "out of memory");
    *list = grown;
    char *copy = strndup(value, len);
    if (!copy) return kv_fail(err, "out of memory");
    grown[(*n)++] = copy;
    return 0;
}

/* "an integer in [1, 65535]", "0 or an integer in [16, 16777216]", ... */
static void describe(const opt_row *r, char *buf, size_t size) {
    switch (r->type) {
    case OPT_INT:
    case OPT_INT64:
        snprintf(buf, size, "%s%s in [%lld, %lld]%s", r->zero_ok ? "0 or " : "",
                 r->size_suffix ? "a size" : "an integer", (long long)r->min, (long long)r->max,
                 r->size_suffix ? " (suffixes K, M, G allowed)" : "");
        break;
    case OPT_BOOL:
        snprintf(buf, size, "a boolean");
        break;
    case OPT_STRING:
        snprintf(buf, size, "%s", r->nullable ? "a string or null" : "a string");
        break;
    case OPT_STRING_LIST:
        snprintf(buf, size, "%s",
                 r->nullable ? "a string, an array of strings or null" : "an array of strings");
        break;
    case OPT_ENUM: {
        size_t n = (size_t)snprintf(buf, size, "one of");
        for (const char *const *ch = r->choices; *ch && n < size; ch++)
            n += (size_t)snprintf(buf + n, size - n, "%s %s", ch == r->choices ? "" : ",", *ch);
        break;
    }
    }
}

/* Strict decimal integer: the whole string, no sign other than '-', no spaces, no base prefix;
 * with `suffix`, one of K, M, G (optionally KiB, MiB, GiB; any case) multiplies by 2^10, 2^20,
 * 2^30. Returns -1 on anything else, overflow included. */
static int parse_int(const char *s, bool suffix, int64_t *out) {
    if (!(isdigit((unsigned char)s[0]) || (s[0] == '-' && isdigit((unsigned char)s[1])))) return -1;
    errno = 0;
    char *end;
    long long v = strtoll(s, &end, 10);
    if (errno != 0) return -1;
    if (suffix && *end) {
        int shift = 0;
        switch (toupper((unsigned char)*end)) {
        case 'K':
            shift = 10;
            break;
        case 'M':
            shift = 20;
            break;
        case 'G':
            shift = 30;
            break;
        default:
            return -1;
        }
        end++;
        if (strcasecmp(end, "iB") == 0) end += 2;
        int64_t scaled;
        if (__builtin_mul_overflow((int64_t)v, INT64_C(1) << shift, &scaled)) return -1;
        v = scaled;
    }
    if (*end) return -1;
    *out = v;
    return 0;
}

static bool in_range(const opt_row *r, int64_t v) {
    return (r->zero_ok && v == 0) || (v >= r->min && v <= r->max);
}

static void set_number(kv_config *c, const opt_row *r, int64_t v) {
    if (r->type == OPT_INT)
        *(int *)((char *)c + r->offset) = (int)v;
    else
        *(int64_t *)((char *)c + r->offset) = v;
}

/* 1/0, true/false, yes/no, on/off, any case. */
static int parse_bool(const char *s, bool *out) {
    static const char *const yes[] = {"1", "true", "yes", "on"};
    static const char *const no[] = {"0", "false", "no", "off"};
    for (int i = 0; i < 4; i++) {
        if (strcasecmp(s, yes[i]) == 0 || strcasecmp(s, no[i]) == 0) {
            *out = strcasecmp(s, yes[i]) == 0;
            return 0;
        }
    }
    return -1;
}

static int apply_env_list(kv_config *c, const opt_row *r, const char *s, kv_error *err);

/* Applies one text value (an environment variable or a flag) to a scalar row. The message does
 * not name the source; the caller prefixes it. */
static int apply_text(kv_config *c, const opt_row *r, const char *s, kv_error *err) {
    switch (r->type) {
    case OPT_INT:
    case OPT_INT64: {
        int64_t v;
        if (parse_int(s, r->size_suffix, &v) != 0 || !in_range(r, v)) {
            char want[160];
            describe(r, want, sizeof want);
            return kv_fail(err, "'%.*s' is not %s", QUOTE_MAX, s, want);
        }
        set_number(c, r, v);
        return 0;
    }
    case OPT_BOOL: {
        bool b;
        if (parse_bool(s, &b) != 0)
            return kv_fail(err, "'%.*s' is not a boolean (1/0, true/false, yes/no, on/off)",
                           QUOTE_MAX, s);
        *(bool *)((char *)c + r->offset) = b;
        return 0;
    }
    case OPT_STRING: {
        if (s[0] == '\0') {
            if (!r->nullable) return kv_fail(err, "empty value");
            set_string(c, r, NULL);
            return 0;
        }
        char *copy = strdup(s);
        if (!copy) return kv_fail(err, "out of memory");
        set_string(c, r, copy);
        return 0;
    }
    case OPT_ENUM: {
        /* Stored as the table's own spelling, so the value is always canonical lower case. */
        for (const char *const *ch = r->choices; *ch; ch++) {
            if (strcasecmp(s, *ch) == 0) {
                set_string(c, r, (char *)*ch);
                return 0;
            }
        }
        char want[160];
        describe(r, want, sizeof want);
        return kv_fail(err, "'%.*s' is not %s", QUOTE_MAX, s, want);
    }
    case OPT_STRING_LIST:
        if (s[0] == '\0' && r->nullable) {
            list_clear(c, r);
            return 0;
        }
        return r->comma ? apply_env_list(c, r, s, err) : list_append(c, r, s, strlen(s), err);
    }
    return kv_fail(err, "internal: bad option type");
}

/* ---------------------------------------------------------------- defaults and free */

void config_defaults(kv_config *c) {
    memset(c, 0, sizeof *c);
    for (int i = 0; i < N_OPTIONS; i++) {
        const opt_row *r = &OPTIONS[i];
        if (r->def == NULL) continue; /* NULL / empty list / 0 from the memset */
        if (r->type == OPT_STRING) {
            *str_field(c, r) = (char *)r->def; /* static: see row_is_static */
            continue;
        }
        /* Numbers, booleans and enums go through the same parser as the user's values, so the
         * table's defaults are range-checked too; only a broken table can fail here. */
        kv_error err;
        if (apply_text(c, r, r->def, &err) != 0) {
            log_error("config: default of '%s': %s", r->key, err.msg);
            abort();
        }
    }
}

void config_free(kv_config *c) {
    if (!c) return;
    for (int i = 0; i < N_OPTIONS; i++) {
        const opt_row *r = &OPTIONS[i];
        if (r->type == OPT_STRING || r->type == OPT_ENUM)
            set_string(c, r, NULL);
        else if (r->type == OPT_STRING_LIST)
            list_clear(c, r);
    }
}

/* ---------------------------------------------------------------- JSON file layer */

/* Applies one key's JSON value; messages name neither the file nor the key (caller adds). */
static int apply_json(kv_config *c, const opt_row *r, const json_t *v, kv_error *err) {
    char want[160];
    describe(r, want, sizeof want);
    switch (r->type) {
    case OPT_INT:
    case OPT_INT64:
        if (json_is_integer(v)) {
            json_int_t n = json_integer_value(v);
            if (!in_range(r, (int64_t)n)) return kv_fail(err, "%lld is not %s", (long long)n, want);
            set_number(c, r, (int64_t)n);
            return 0;
        }
        /* Sizes may be written "8M" in the file as on the command line. */
        if (r->size_suffix && json_is_string(v)) return apply_text(c, r, json_string_value(v), err);
        break;
    case OPT_BOOL:
        if (json_is_boolean(v)) {
            *(bool *)((char *)c + r->offset) = json_is_true(v);
            return 0;
        }
        break;
    case OPT_STRING:
        if (json_is_null(v) && r->nullable) {
            set_string(c, r, NULL);
            return 0;
        }
        /* Strings hold no NUL: jansson rejects \u0000 without JSON_ALLOW_NUL. */
        if (json_is_string(v)) return apply_text(c, r, json_string_value(v), err);
        break;
    case OPT_ENUM:
        if (json_is_string(v)) return apply_text(c, r, json_string_value(v), err);
        break;
    case OPT_STRING_LIST: {
        if (r->nullable && (json_is_null(v) || json_is_string(v))) {
            list_clear(c, r);
            return json_is_null(v) ? 0 : apply_text(c, r, json_string_value(v), err);
        }
        if (!json_is_array(v)) break;
        list_clear(c, r);
        size_t i;
        json_t *item;
        json_array_foreach(v, i, item) {
            if (!json_is_string(item))
                return kv_fail(err, "expected %s, got %s at index %zu", want, json_type_name(item),
                               i);
            if (list_append(c, r, json_string_value(item), json_string_length(item), err) != 0)
                return kv_fail_wrap(err, "index %zu", i);
        }
        return 0;
    }
    }
    return kv_fail(err, "expected %s, got %s", want, json_type_name(v));
}

static int load_file(kv_config *c, const char *path, kv_error *err) {
    FILE *f = fopen(path, "rb");
    if (!f) return kv_fail(err, "%s: cannot open: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fileno(f), &st) == 0 && S_ISDIR(st.st_mode)) {
        fclose(f);
        return kv_fail(err, "%s: is a directory", path);
    }
    json_error_t jerr;
    json_t *root = json_loadf(f, JSON_REJECT_DUPLICATES, &jerr);
    fclose(f);
    if (!root)
        return kv_fail(err, "%s:%d:%d: invalid JSON: %s", path, jerr.line, jerr.column, jerr.text);
    int rc = 0;
    if (!json_is_object(root)) {
        rc = kv_fail(err, "%s: expected a JSON object at the top level, got %s", path,
                     json_type_name(root));
        goto done;
    }
    const char *key;
    json_t *v;
    json_object_foreach(root, key, v) {
        const opt_row *r = row_by_key(key);
        if (!r) {
            char hint[NAME_MAX_LEN + 32];
            suggest(NAME_KEY, key, strlen(key), hint, sizeof hint);
            rc = kv_fail(err, "%s: unknown key '%.*s'%s", path, QUOTE_MAX, key, hint);
            goto done;
        }
        if (apply_json(c, r, v, err) != 0) {
            rc = kv_fail_wrap(err, "%s: key '%s'", path, key);
            goto done;
        }
    }
done:
    json_decref(root);
    return rc;
}

/* ---------------------------------------------------------------- environment layer */

/* Splits a comma-separated list (spaces around items are trimmed) into the row's list. Empty
 * items are errors: "a,,b" or a trailing comma is more likely a mistake than intent. An empty
 * value resets a nullable list and is an error for the others. */
static int apply_env_list(kv_config *c, const opt_row *r, const char *s, kv_error *err) {
    if (s[0] == '\0') {
        if (!r->nullable) return kv_fail(err, "empty list (unset the variable instead)");
        list_clear(c, r);
        return 0;
    }
    for (int idx = 0;; idx++) {
        const char *comma = strchr(s, ',');
        const char *end = comma ? comma : s + strlen(s);
        const char *a = s, *b = end;
        while (a < b && isspace((unsigned char)*a)) a++;
        while (b > a && isspace((unsigned char)b[-1])) b--;
        if (list_append(c, r, a, (size_t)(b - a), err) != 0)
            return kv_fail_wrap(err, "item %d", idx + 1);
        if (!comma) return 0;
        s = comma + 1;
    }
}

/* True when envp[0..i) already holds a variable named name[0..len). */
static bool env_seen_before(char **envp, int i, const char *name, size_t len) {
    for (int j = 0; j < i; j++)
        if (strncmp(envp[j], name, len) == 0 && envp[j][len] == '=') return true;
    return false;
}

static int load_env(kv_config *c, char **envp, kv_error *err) {
    const size_t plen = strlen(ENV_PREFIX);
    bool replaced[N_OPTIONS] = {false}; /* per list: this layer's first value replaces the file's */
    for (int i = 0; envp && envp[i]; i++) {
        const char *e = envp[i];
        const char *eq = strchr(e, '=');
        if (!eq || strncmp(e, ENV_PREFIX, plen) != 0) continue;
        size_t len = (size_t)(eq - e);
        const char *value = eq + 1;
        if (len == strlen(ENV_CONFIG) && memcmp(e, ENV_CONFIG, len) == 0) continue;
        const opt_row *r;
        bool single_key = len == strlen(ENV_API_KEY) && memcmp(e, ENV_API_KEY, len) == 0;
        r = single_key ? row_by_key("api_keys") : row_by_env(e, len);
        if (!r) {
            /* Other tools (the test drivers, scripts) share the prefix: warn, do not fail. */
            if (!env_seen_before(envp, i, e, len)) {
                char hint[NAME_MAX_LEN + 32];
                suggest(NAME_ENV, e, len, hint, sizeof hint);
                log_warn("config: ignoring unknown environment variable %.*s%s", (int)len, e, hint);
            }
            continue;
        }
        int rc;
        if (r->type == OPT_STRING_LIST) {
            if (!replaced[r - OPTIONS]) {
                list_clear(c, r);
                replaced[r - OPTIONS] = true;
            }
            rc = single_key ? list_append(c, r, value, strlen(value), err)
                            : apply_env_list(c, r, value, err);
        } else {
            rc = apply_text(c, r, value, err);
        }
        if (rc != 0) return kv_fail_wrap(err, "%.*s", (int)len, e);
    }
    return 0;
}

/* ---------------------------------------------------------------- command-line layer */

typedef enum arg_kind { ARG_OPTION, ARG_CONFIG } arg_kind;

typedef struct flag_arg {
    arg_kind kind;
    const opt_row *row; /* ARG_OPTION */
    const char *name;   /* the flag as typed, for messages: name[0..name_len) */
    int name_len;
    const char *value; /* NULL: a bare boolean flag */
} flag_arg;

/* A value taken from the next argument must not look like a flag: `--model --port 1` is more
 * likely a forgotten value than a model named "--port". `--model=-x` still works. */
static bool looks_like_flag(const char *s) { return s[0] == '-' && s[1] != '\0'; }

/* Turns argv into a list of flags (no values applied yet, so --config can be read first). */
static int parse_args(int argc, char **argv, flag_arg *out, int *n_out, kv_error *err) {
    int n = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        flag_arg *f = &out[n];
        f->kind = ARG_OPTION;
        f->row = NULL;
        f->name = a;
        f->value = NULL;
        bool bare_bool_ok = false, negated = false;
        if (a[0] == '-' && a[1] == '-' && a[2] != '\0') {
            const char *name = a + 2;
            const char *eq = strchr(name, '=');
            size_t len = eq ? (size_t)(eq - name) : strlen(name);
            f->name_len = (int)(len + 2);
            if (eq) f->value = eq + 1;
            if (len == 6 && memcmp(name, "config", 6) == 0) {
                f->kind = ARG_CONFIG;
            } else if ((f->row = row_by_flag(name, len)) != NULL) {
                bare_bool_ok = f->row->type == OPT_BOOL;
            } else if (len > 3 && memcmp(name, "no-", 3) == 0 &&
                       (f->row = row_by_flag(name + 3, len - 3)) != NULL &&
                       f->row->type == OPT_BOOL) {
                negated = true;
            } else {
                char hint[NAME_MAX_LEN + 32];
                suggest(NAME_FLAG, name, len, hint, sizeof hint);
                return kv_fail(err, "unknown option '%.*s'%s", QUOTE_MAX, a, hint);
            }
        } else if (a[0] == '-' && a[1] != '\0' && a[1] != '-' && a[2] == '\0') {
            f->name_len = 2;
            for (int k = 0; k < N_OPTIONS; k++)
                if (OPTIONS[k].short_flag == a[1]) f->row = &OPTIONS[k];
            if (!f->row) return kv_fail(err, "unknown option '%s'", a);
        } else if (a[0] == '-' && a[1] != '\0') {
            return kv_fail(err, "unknown option '%.*s'", QUOTE_MAX, a);
        } else {
            return kv_fail(err, "unexpected argument '%.*s' (options start with --)", QUOTE_MAX, a);
        }
        if (negated) {
            if (f->value) return kv_fail(err, "%.*s: takes no value", f->name_len, f->name);
            f->value = "false";
        } else if (!f->value && !bare_bool_ok) {
            if (i + 1 >= argc || looks_like_flag(argv[i + 1])) {
                if (f->name_len == 2) return kv_fail(err, "%.*s: missing value", 2, f->name);
                return kv_fail(err,
                               "%.*s: missing value (write %.*s=VALUE for a value that "
                               "starts with '-')",
                               f->name_len, f->name, f->name_len, f->name);
            }
            f->value = argv[++i];
        }
        n++;
    }
    *n_out = n;
    return 0;
}

static int apply_args(kv_config *c, const flag_arg *args, int n, kv_error *err) {
    bool replaced[N_OPTIONS] = {false}; /* per list: the first flag replaces the lower layers' */
    for (int i = 0; i < n; i++) {
        const flag_arg *f = &args[i];
        if (f->kind != ARG_OPTION) continue;
        const opt_row *r = f->row;
        int rc;
        if (r->type == OPT_BOOL && !f->value) {
            *(bool *)((char *)c + r->offset) = true;
            continue;
        }
        if (r->type == OPT_STRING_LIST && !replaced[r - OPTIONS]) {
            list_clear(c, r);
            replaced[r - OPTIONS] = true;
        }
        rc = apply_text(c, r, f->value, err);
        if (rc != 0) return kv_fail_wrap(err, "%.*s", f->name_len, f->name);
    }
    return 0;
}

/* ---------------------------------------------------------------- load */

config_status config_load(kv_config *c, int argc, char **argv, char **envp, FILE *out,
                          kv_error *err) {
    config_defaults(c);
    /* --help wins over every other problem (a broken config file included). A value never
     * equals "-h" or "--help" as its own argument (looks_like_flag), so this is exact. */
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            config_usage(out ? out : stdout, argc > 0 ? argv[0] : NULL);
            return CONFIG_HELP;
        }
    }
    flag_arg *args = NULL;
    int n_args = 0;
    config_status st = CONFIG_ERROR;
    if (argc > 1) {
        args = calloc((size_t)argc, sizeof *args);
        if (!args) {
            kv_fail(err, "out of memory");
            return CONFIG_ERROR;
        }
        if (parse_args(argc, argv, args, &n_args, err) != 0) goto done;
    }

    /* The file: the last --config, else KVSERVE_CONFIG. */
    const char *path = NULL, *path_source = NULL;
    for (int i = 0; i < n_args; i++)
        if (args[i].kind == ARG_CONFIG) path = args[i].value, path_source = "--config";
    for (int i = 0; !path && envp && envp[i]; i++) {
        size_t n = strlen(ENV_CONFIG);
        if (strncmp(envp[i], ENV_CONFIG, n) == 0 && envp[i][n] == '=')
            path = envp[i] + n + 1, path_source = ENV_CONFIG;
    }
    if (path) {
        if (path[0] == '\0') {
            kv_fail(err, "%s: empty path", path_source);
            goto done;
        }
        if (load_file(c, path, err) != 0) goto done;
    }
    if (load_env(c, envp, err) != 0) goto done;
    if (apply_args(c, args, n_args, err) != 0) goto done;
    st = CONFIG_OK;
done:
    free(args);
    return st;
}

/* ---------------------------------------------------------------- usage */

/* "  -m, --model PATH" / "      --precise, --no-precise" */
static void usage_flag(const opt_row *r, char *buf, size_t size) {
    char flag[NAME_MAX_LEN];
    row_flag(r, flag, sizeof flag);
    char sh[8] = "    ";
    if (r->short_flag) snprintf(sh, sizeof sh, "-%c, ", r->short_flag);
    if (r->type == OPT_BOOL)
        snprintf(buf, size, "  %s--%s, --no-%s", sh, flag, flag);
    else
        snprintf(buf, size, "  %s--%s %s", sh, flag, r->metavar);
}

/* The help column: after the widest flag that leaves the help texts this much room; a wider
 * flag has its help on the next line. */
#define USAGE_COLUMN_MAX 32

void config_usage(FILE *out, const char *cmd) {
    char buf[2 * NAME_MAX_LEN + 64];
    int width = 0;
    for (int i = 0; i < N_OPTIONS; i++) {
        usage_flag(&OPTIONS[i], buf, sizeof buf);
        int n = (int)strlen(buf) + 2;
        if (n > width && n <= USAGE_COLUMN_MAX) width = n;
    }
    fprintf(out, "Usage: %s [options]\n\n", cmd ? cmd : "kvserve");
    fprintf(out,
            "Each option is read from, lowest precedence first: its default < the JSON config\n"
            "file (keys as below with '_', e.g. \"ctx_size\") < its KVSERVE_* environment\n"
            "variable < its command-line flag (--flag VALUE or --flag=VALUE).\n\n");
    fprintf(out, "%-*s%s\n", width, "  --config PATH", "JSON object of options to read");
    fprintf(out, "%-*s%s\n", width, "", "env KVSERVE_CONFIG; default none");
    fprintf(out, "%-*s%s\n", width, "  -h, --help", "print this list and exit");
    for (int g = 0; g < GROUP_COUNT; g++) {
        fprintf(out, "\n%s:\n", GROUP_NAMES[g]);
        for (int i = 0; i < N_OPTIONS; i++) {
            const opt_row *r = &OPTIONS[i];
            if ((int)r->group != g) continue;
            char env[NAME_MAX_LEN];
            row_env(r, env, sizeof env);
            usage_flag(r, buf, sizeof buf);
            if ((int)strlen(buf) + 2 > width)
                fprintf(out, "%s\n%-*s", buf, width, "");
            else
                fprintf(out, "%-*s", width, buf);
            fprintf(out, "%s\n", r->help);
            fprintf(out, "%-*senv %s", width, "", env);
            if (r->type == OPT_STRING_LIST) fprintf(out, " (a,b,...)");
            if (strcmp(r->key, "api_keys") == 0) fprintf(out, " or %s", ENV_API_KEY);
            fprintf(out, "; default %s", r->def ? r->def : "none");
            if (r->type == OPT_INT || r->type == OPT_INT64)
                fprintf(out, "; %s%lld..%lld", r->zero_ok ? "0 or " : "", (long long)r->min,
                        (long long)r->max);
            fputc('\n', out);
        }
    }
}
