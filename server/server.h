/* The HTTP server: libmicrohttpd in thread-per-connection mode (a handler may block while the
 * engine works; streams block between tokens), routes, authentication and limits (http.c), the
 * OpenAI endpoints over the engine (openai.c, openai_stream.c). */
#ifndef KVSERVE_SERVER_H
#define KVSERVE_SERVER_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

#include "cache/cache.h"
#include "config/config.h"
#include "model/model.h"
#include "server/api.h"
#include "server/engine.h"
#include "server/metrics.h"

typedef struct server server;

struct server {
    const kv_config *cfg;
    const model *m;        /* NULL while loading */
    engine *eng;           /* NULL while loading */
    grammar_vocab *gvocab; /* the vocabulary's token trie for constrained decoding */
    gen_pooling pooling;   /* embeddings */
    metrics *mx;
    char **model_ids; /* the names /v1/models lists and requests may name; responses name [0] */
    int n_model_ids;
    int ctx;                    /* per-sequence context */
    int max_tokens_limit;       /* cap on max_tokens */
    cache_store *store;         /* RAM and disk tiers of the context cache, or NULL */
    uint8_t (*key_digests)[32]; /* SHA-256 of each API key */
    int n_keys;
    long started;      /* start time (Unix seconds) */
    atomic_bool ready; /* model loaded, engine running */
    atomic_bool stopping;
    struct MHD_Daemon *daemon;
};

/* Starts listening (GET /health answers 503 until ready is set). */
int server_start(server *s, kv_error *err);
/* Stops accepting, waits for every connection to finish. */
void server_stop(server *s);

/* ---------------------------------------------------------------- handler interface */

/* A finished response: status, body (malloc'd, owned), content type, extra headers. */
typedef struct http_reply {
    int status;
    char *body;
    size_t len;
    const char *content_type;
    int retry_after; /* seconds, 0: no header */
} http_reply;

/* A streamed response: read() fills buf with up to max bytes, blocking until there is some;
 * returns the count, 0 at the end of the stream, -1 to abort the connection. close() runs
 * once, when the connection ends (however it ends). */
typedef struct http_stream {
    void *ud;
    long (*read)(void *ud, char *buf, size_t max);
    void (*close)(void *ud);
} http_stream;

/* What a handler gets: the connection's socket (to notice a client that went away), the body. */
typedef struct http_call {
    int fd;
    const char *body;
    size_t len;
    const char *api_key; /* the Bearer token presented, or NULL */
} http_call;

/* True when the peer closed or reset the connection. */
bool http_client_gone(int fd);

/* Replies with OpenAI's error JSON. */
void http_reply_error(http_reply *out, const api_error *err);
/* Replies with a JSON value (takes the reference). */
void http_reply_json(http_reply *out, int status, json_t *v);

/* The endpoints (openai.c). Each fills *out, or (streaming) *stream and returns 1. */
int openai_chat(server *s, const http_call *c, http_reply *out, http_stream *stream);
int openai_completions(server *s, const http_call *c, http_reply *out, http_stream *stream);
/* The model list, or (id non-NULL: /v1/models/{id}) that one model or a 404. */
void openai_models(server *s, const char *id, http_reply *out);
void openai_tokenize(server *s, const http_call *c, http_reply *out);
void openai_detokenize(server *s, const http_call *c, http_reply *out);
void openai_embeddings(server *s, const http_call *c, http_reply *out);

/* The context cache's namespace for a request: the API key presented (when the server requires
 * keys) and the request's cache_salt. */
void server_cache_namespace(const server *s, const http_call *c, const char *salt, cache_key *ns);
/* The cache endpoints (cache_api.c): GET /v1/cache/stats, POST /v1/cache/clear, /pin, /unpin. */
void cache_api_stats(server *s, http_reply *out);
void cache_api_clear(server *s, const http_call *c, http_reply *out);
void cache_api_pin(server *s, const http_call *c, http_reply *out, bool pin);
/* Appends the cache's Prometheus metrics to text (malloc'd, len bytes; freed here). Returns the
 * new text, or NULL when out of memory. */
char *cache_api_metrics(server *s, char *text, size_t *len);

#endif
