/* The HTTP server: libmicrohttpd in epoll mode with a small thread pool (http.c): routes,
 * authentication, limits, request ids and the access log. A handler never blocks on the engine:
 * a completion hands back a stream or a pending reply, and its connection is suspended while
 * there is nothing to send and resumed when the engine publishes, so a waiting client costs
 * memory, not a thread. The OpenAI endpoints over the engine are openai.c and openai_stream.c. */
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
#include "model/model.h"
#include "server/api.h"
#include "server/engine.h"
#include "server/metrics.h"

typedef struct server server;
typedef struct schema_registry schema_registry;
typedef struct resp_store resp_store;

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
    int ctx;                    /* per-sequence context */
    int max_tokens_limit;       /* cap on max_tokens */
    cache_store *store;         /* RAM and disk tiers of the context cache, or NULL */
    schema_registry *schemas;   /* Prompt Cache schemas (schemas.c), or NULL */
    resp_store *responses;      /* the Responses API's stored responses, or NULL: none kept */
    content_disk *blend_disk;   /* blend's content records on disk, or NULL */
    server_reuse reuse;         /* approximate reuse's quality budget and what it chose */
    uint8_t (*key_digests)[32]; /* SHA-256 of each API key */
    int n_keys;
    long started;                    /* start time (Unix seconds) */
    atomic_bool ready;               /* model loaded, engine running */
    atomic_bool draining;            /* SIGTERM: running work finishes; new requests get 503 */
    atomic_bool stopping;            /* the engine is stopped */
    atomic_int in_flight;            /* requests handed to a handler and not yet completed */
    atomic_int connections;          /* open HTTP connections */
    atomic_llong refused;            /* connections refused over --max-connections */
    atomic_ullong refusal_logged_ns; /* when a refusal was last logged (once a second) */
    struct MHD_Daemon *daemon;
};

/* Starts listening (GET /health answers 503 until ready is set). */
int server_start(server *s, kv_error *err);
/* Stops accepting and closes every connection. Call with no connection waiting on the engine
 * (after engine_stop every request has finished and woken its connection). */
void server_stop(server *s);

/* ---------------------------------------------------------------- handler interface */

/* A response header whose name and value outlive the reply (static text). */
typedef struct http_header {
    const char *name, *value;
} http_header;

#define HTTP_REPLY_HEADERS 6

/* A finished response: status, body (malloc'd, owned), content type, extra headers. */
typedef struct http_reply {
    int status;
    char *body;
    size_t len;
    const char *content_type;
    int retry_after;                         /* seconds, 0: no header */
    http_header headers[HTTP_REPLY_HEADERS]; /* more headers, up to the first NULL name */
} http_reply;

/* What a stream's read returns when it has nothing to send yet. */
#define HTTP_WAIT (-2)

/* A streamed response: read() fills buf with up to max bytes without blocking; returns the
 * count, 0 at the end of the stream, -1 to abort the connection, or HTTP_WAIT when nothing is
 * ready (the connection sleeps until the call's wake). close() runs once, when the connection
 * ends (however it ends). */
typedef struct http_stream {
    void *ud;
    long (*read)(void *ud, char *buf, size_t max);
    void (*close)(void *ud);
} http_stream;

/* A reply that is not ready yet (a completion without stream): poll() fills *out and returns 1
 * once it is, else 0 (the connection sleeps until the call's wake). close() runs once, when the
 * connection ends. */
typedef struct http_pending {
    void *ud;
    int (*poll)(void *ud, http_reply *out);
    void (*close)(void *ud);
} http_pending;

/* Request ids: the client's X-Request-Id when it is 1..64 printable characters, else one made
 * here; returned in the x-request-id header and written in every log line about the request. */
#define HTTP_REQUEST_ID_MAX 72

/* What a handler gets: the connection's socket (to notice a client that went away), the body,
 * and wake(wake_arg), which any thread may call (it never blocks) when a stream or pending
 * reply may have made progress. */
typedef struct http_call {
    int fd;
    const char *body;
    size_t len;
    const char *api_key;       /* the Bearer token presented, or NULL */
    const char *request_id;    /* never NULL */
    const char *query_salt;    /* the URL's ?cache_salt=, or NULL */
    const char *if_none_match; /* the If-None-Match header, or NULL */
    void (*wake)(void *arg);
    void *wake_arg;
} http_call;

/* True when the connection is reset or broken. A peer that only closed its sending side (a
 * half-close, as `nc -N` does after a request) is still waiting for the answer, and TCP cannot
 * tell that from a peer that left until something is written to it: that is not "gone". */
bool http_client_gone(int fd);

/* Replies with OpenAI's error JSON. */
void http_reply_error(http_reply *out, const api_error *err);
/* Replies with a JSON value (takes the reference). */
void http_reply_json(http_reply *out, int status, json_t *v);

/* The completion endpoints (openai.c): each fills *out and returns 0, or fills *stream and
 * returns 1, or fills *pending (the engine is working on it) and returns 2. */
int openai_chat(server *s, const http_call *c, http_reply *out, http_stream *stream,
                http_pending *pending);
int openai_completions(server *s, const http_call *c, http_reply *out, http_stream *stream,
                       http_pending *pending);
/* Anthropic's Messages API (anthropic.c): POST /v1/messages (returns as the completion
 * endpoints do) and /v1/messages/count_tokens, by url. */
int anthropic_api(server *s, const http_call *c, const char *url, http_reply *out,
                  http_stream *stream, http_pending *pending);
/* Rewrites an error reply made in OpenAI's error JSON (by the HTTP layer: 401, 405, 413, 503)
 * into Anthropic's, for the Anthropic routes; a body already in Anthropic's is kept. */
void anthropic_reply_error(http_reply *r);
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
/* What the quality budget lets approximate reuse do, and why (GET /health, /v1/cache/stats). */
json_t *cache_api_reuse_json(const server *s);
void cache_api_clear(server *s, const http_call *c, http_reply *out);
void cache_api_pin(server *s, const http_call *c, http_reply *out, bool pin);
/* Prompt Cache (schemas.c): the registry and its builder thread, started once the engine runs
 * (dir: where definitions are kept, or NULL), stopped before the engine; /v1/schemas (name
 * NULL: POST registers, GET lists) and /v1/schemas/{name} (GET, DELETE); and a request's
 * schema_prompt assembled into out (-1 with err: 400 for a prompt that does not fit its
 * schema, 404 for an unknown schema, 409 for one not ready). */
int schemas_start(server *s, const char *dir, kv_error *err);
void schemas_stop(server *s);
void schemas_api(server *s, const http_call *c, const char *method, const char *name,
                 http_reply *out);
int schemas_prompt(server *s, const api_request *rq, const http_call *c, schema_prompt *out,
                   api_error *err);

/* The web page (webui.c): GET / and /webui/{file}, with its security and caching headers (a
 * 304 when If-None-Match names the file's ETag), or a 404 for a file it does not have. */
void webui_get(const http_call *c, const char *url, http_reply *out);
/* The Responses API (responses.c): POST /v1/responses (as openai_chat: 0 reply, 1 stream,
 * 2 pending), GET and DELETE /v1/responses/{id}, and its store's Prometheus metrics (written
 * with the cache's, by cache_api_metrics). */
int responses_create(server *s, const http_call *c, http_reply *out, http_stream *stream,
                     http_pending *pending);
void responses_api(server *s, const http_call *c, const char *method, const char *id,
                   http_reply *out);
void responses_metrics(const server *s, FILE *f);

/* Appends the cache's Prometheus metrics (and the Responses API store's) to text (malloc'd, len
 * bytes; freed here). Returns the new text, or NULL when out of memory. */
char *cache_api_metrics(server *s, char *text, size_t *len);

#endif
