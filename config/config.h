/* config/: the server's configuration as one plain struct. Every option is one row of a table
 * (config.c) that names its JSON key, environment variable and command-line flag, so the layers
 * defaults < JSON config file < KVSERVE_* environment < command-line flags are applied the same
 * way for every option, and `kvserve serve --help` lists them all.
 *
 * Naming: the JSON key "ctx_size" is the flag --ctx-size and the variable KVSERVE_CTX_SIZE. */
#ifndef KVSERVE_CONFIG_H
#define KVSERVE_CONFIG_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "util/util.h"

typedef struct kv_config {
    /* ---- model */
    char *model;    /* GGUF path */
    char **aliases; /* model names the API serves, the first reported in responses; none:
                       the file name without .gguf */
    int n_aliases;
    bool accept_any_model; /* requests may name any model (answered by this one) */
    char *chat_template;   /* template name overriding detection, or NULL */
    bool precise;          /* f32 matmuls over dequantized weights */
    char *pooling;         /* embeddings: auto|mean|last|cls */
    char *simd;            /* kernels' instruction set: auto|avx512|avx2|scalar */
    char *device;     /* compute backend: auto|cuda|cpu (auto: CUDA when a device is present) */
    bool cuda_graphs; /* CUDA: decode steps recorded once per shape and replayed as graphs */
    /* ---- HTTP */
    char *host;
    int port;
    char **api_keys; /* Bearer keys accepted; none: no authentication */
    int n_api_keys;
    int64_t max_body_bytes;
    int max_connections;  /* open connections; more are refused at once */
    int http_threads;     /* libmicrohttpd's thread pool */
    int idle_timeout;     /* seconds a connection may wait with no complete request */
    int shutdown_timeout; /* seconds running requests get to finish after SIGTERM */
    bool webui;           /* the web page at / and its files under /webui/ */
    /* Requests from web pages: the origins (scheme://host[:port]) whose pages may call the API,
     * beside the server's own ("*": any), and the Host names a loopback listener answers beside
     * its own (DNS rebinding; "*": any) */
    char **allowed_origins;
    int n_allowed_origins;
    char **allowed_hosts;
    int n_allowed_hosts;
    /* Responses API: stored responses (in memory), least recently used evicted over either bound */
    int responses_store;           /* at most this many (0: none stored) */
    int64_t responses_store_bytes; /* and this many bytes of their JSON */
    int tenant_store_share; /* percent of both each tenant keeps for sure (0: an equal part) */
    /* on SIGTERM, seconds requests are still taken while GET /health answers 503, so that the
     * routers in front take the server out first */
    int drain_grace;
    /* GET /get_load's shape, for the router in front: sglang-router's or vllm-router's */
    char *get_load_format;
    /* ---- engine */
    int threads;
    int ctx_size;           /* per-sequence context in tokens; 0: the model's training context */
    int64_t kv_pool_tokens; /* KV pool size in tokens; 0: 4 x ctx_size */
    int max_seqs;           /* sequences decoding at once (each choice of n counts) */
    int max_queue;          /* requests waiting for a slot before 429 */
    int tenant_queue_share; /* percent of max_queue one tenant may fill (0: an equal part) */
    int prefill_chunk;      /* prompt tokens prefilled per engine step, between decode steps */
    int max_tokens_limit;   /* cap on a request's max_tokens; 0: the context size */
    char *spec;             /* speculative decoding: off | context (drafts from the context) */
    char *draft_model;      /* GGUF of a draft model with the same vocabulary, or NULL: none */
    /* ---- context cache */
    bool cache;               /* reuse cached prefixes and store new chunks */
    int cache_chunk_tokens;   /* tokens per chunk (multiple of 16) */
    int64_t cache_ram_bytes;  /* RAM tier cap; 0: no RAM tier */
    char *cache_ram_encoding; /* what the RAM tier holds: lossless, q8 or codec0..7 (cache.h) */
    char *cache_dir;          /* disk tier directory; "auto": $XDG_CACHE_HOME or ~/.cache, /kvserve;
                                 "off": no disk tier */
    int64_t cache_disk_bytes; /* disk tier cap */
    bool cache_disk_encoded;  /* the disk tier keeps each chunk's q8 and codec levels too */
    int64_t pin_bytes;        /* pinned and leased chunks (Anthropic's cache_control) at most, per
                                 tier, beside half of each tier */
    int tenant_pin_share;     /* percent of pin_bytes one tenant may hold (0: an equal part) */
    char *redis;              /* Redis tier URL (cache/store/redis.h), or NULL for none */
    int64_t redis_ttl;        /* seconds the Redis tier's keys live; 0: no expiry */
    int redis_timeout_ms;     /* each Redis connect, send or receive */
    char *redis_codec;        /* codec table for Redis's levels: auto, off or a path */
    int64_t ttft_budget_ms;   /* default budget of Redis fetches (0: none, lossless) */
    bool blend;               /* reuse chunks found by content anywhere in a prompt (CacheBlend) */
    int blend_recompute;      /* least recompute ratio of blended tokens, percent */
    char *blend_policy;       /* which reused tokens are recomputed: hkvd, legolink, hybrid */
    int64_t blend_ram_bytes;  /* content store cap */
    int64_t blend_disk_bytes; /* content records on disk: cap (in the cache directory) */
    char *reuse_quality;      /* approximate reuse's budget: none, floor, balanced, fast, a KL */
    char *reuse_calibration;  /* the model's reuse-quality calibration: auto or a path */
    int quality_sample;       /* percent of blended requests the live check computes again */
    bool blend_repair;        /* blended prompts computed again in full when idle, and stored */
    int blend_chunk;          /* most prompt tokens one blended prefill step takes */
    bool schema_fixup;        /* Prompt Cache: the fix-up by default */
    int schema_fixup_recompute; /* its recompute ratio, percent */
    int schema_max;             /* schemas registered at most */
    /* ---- logging */
    char *log_level; /* error|warn|info|debug */
} kv_config;

/* Fills the defaults. */
void config_defaults(kv_config *c);

typedef enum config_status {
    CONFIG_OK = 0,
    CONFIG_HELP = 1,   /* --help was given: the usage was printed to `out`; exit 0 */
    CONFIG_ERROR = -1, /* err names the key and the source ("--port", "KVSERVE_PORT",
                          "file.json: key 'port'") */
} config_status;

/* Builds the configuration from defaults, then the JSON file named by --config or
 * KVSERVE_CONFIG (if any), then KVSERVE_* variables from envp (NULL-terminated "K=V" strings),
 * then argv[1..argc) flags. argv[0] is the command name used in the usage text. */
config_status config_load(kv_config *c, int argc, char **argv, char **envp, FILE *out,
                          kv_error *err);

/* Frees the strings config_load allocated (safe on a defaulted struct, on one config_load left
 * partly filled after an error, and twice). The defaults are the table's static strings, which
 * config_free recognizes and leaves alone; any other string must come from malloc.
 *
 * Empty values: an error for numbers, booleans, log_level, model, host and the key lists
 * (KVSERVE_API_KEYS="" is refused so an unset shell variable cannot turn authentication off);
 * for alias and chat_template, "" (or JSON null) resets the option to automatic (no aliases,
 * chat_template NULL). */
void config_free(kv_config *c);

/* Writes the option list (flag, variable, default, help) to out. */
void config_usage(FILE *out, const char *cmd);

#endif
