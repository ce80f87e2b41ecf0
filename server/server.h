/* The server: what `kvserve serve` sets up (server/cli/cli_serve.c) and every room of server/
 * shares. The transport (http/) listens on its route table, the endpoints (api/) answer from
 * its model, engine, cache tiers and registries, and the engine (engine/) runs the model. */
#ifndef KVSERVE_SERVER_H
#define KVSERVE_SERVER_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include <jansson.h>

#include "cache/cache.h"
#include "cache/quality.h"
#include "config/config.h"
#include "model/grammar/grammar.h"
#include "model/model.h"
#include "server/engine/engine.h"
#include "server/http/http.h"
#include "server/metrics/metrics.h"

typedef struct schema_registry schema_registry;
typedef struct resp_store resp_store;
typedef struct redis_state redis_state;

/* Approximate reuse under the quality budget (cache/quality.h), as decided at start. */
typedef struct server_reuse {
    quality_budget budget;
    quality_choice choice;
    char budget_name[32];    /* --reuse-quality as given */
    char bounds[96];         /* what the budget allows on this model, in words */
    char calibration[512];   /* the calibration's path, or "" with none */
    char calib_error[600];   /* why a calibration found was not used, or "" */
    quality_monitor monitor; /* the live check's, as it starts (the engine keeps it after) */
} server_reuse;

struct server {
    const kv_config *cfg;
    const model *m;        /* NULL while loading */
    engine *eng;           /* NULL while loading */
    grammar_vocab *gvocab; /* the vocabulary's token trie for constrained decoding */
    gen_pooling pooling;   /* embeddings */
    metrics *mx;
    char **model_ids; /* the names /v1/models lists and requests may name; responses name [0] */
    int n_model_ids;
    int ctx;                  /* per-sequence context */
    int max_tokens_limit;     /* cap on max_tokens */
    cache_store *store;       /* RAM and disk tiers of the context cache, or NULL */
    schema_registry *schemas; /* Prompt Cache schemas (cache/schema/registry.c), or NULL */
    resp_store *responses;    /* the Responses API's stored responses, or NULL: none kept */
    content_disk *blend_disk; /* blend's content records on disk, or NULL */
    /* with --redis: what clients leave here (responses, schemas, pins, leases) shared with the
     * other instances (cache/store/redis_state.h), or NULL */
    redis_state *shared;
    server_reuse reuse; /* approximate reuse's quality budget and what it chose */
    long started;       /* start time (Unix seconds) */
    /* SIGTERM was taken: GET /health answers 503 "draining" from here on, also while, for
     * --drain-grace seconds, requests are still taken (http.draining refuses them after) */
    atomic_bool leaving;
    http_transport http; /* the transport: routes, limits, keys, connection counters */
};

#endif
