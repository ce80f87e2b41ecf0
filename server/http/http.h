/* The HTTP transport (http.c): libmicrohttpd in epoll mode with a small thread pool, connection
 * limits, bodies up to --max-body-bytes, API keys, request ids, the access log and SSE. It knows
 * no endpoint: a server's route table (server/api/routes.c builds it) names each path's methods,
 * whether it needs a key, and its handler, and the transport calls the handler through the table.
 * A handler never blocks on the engine: it answers at once, or hands back a stream or a pending
 * reply, and its connection is suspended while there is nothing to send and resumed when the
 * engine publishes, so a waiting client costs memory, not a thread.
 *
 * Handlers answer with the reply helpers (reply.c), never with the transport's internals; every
 * error, the transport's own included, is OpenAI's error JSON (a route can reformat them).
 *
 * Requests from web pages (browser.c): a request whose Origin is not allowed, or (listening on a
 * loopback address) whose Host is not one of the server's names, is a 403; a POST's body must
 * be declared application/json (else 415); allowed origins get CORS headers, preflights
 * (OPTIONS) included. Routes that tokenize or render on an HTTP thread share a budget of body
 * bytes in work at once: over it, a 429 as the engine's full queue gives. */
#ifndef KVSERVE_HTTP_H
#define KVSERVE_HTTP_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

#include "config/config.h"
#include "server/http/error.h"
#include "util/util.h"

typedef struct server server; /* the application the handlers serve (server/server.h) */
typedef struct metrics metrics;

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

/* What a handler hands back: which of out's members it filled. */
typedef enum http_result {
    HTTP_REPLIED = 0, /* out->reply */
    HTTP_STREAMING,   /* out->stream: an SSE stream */
    HTTP_PENDING,     /* out->pending: the engine is working on it */
} http_result;

typedef struct http_out {
    http_reply reply;
    http_stream stream;
    http_pending pending;
} http_out;

/* Request ids: the client's X-Request-Id when it is 1..64 printable characters, else one made
 * here; returned in the x-request-id header and written in every log line about the request. */
#define HTTP_REQUEST_ID_MAX 72

/* What a handler gets: the request line, the connection's socket (to notice a client that went
 * away), the body, and wake(wake_arg), which any thread may call (it never blocks) when a stream
 * or pending reply may have made progress. */
typedef struct http_call {
    const char *method; /* "GET", "POST", "DELETE" */
    const char *url;    /* the path, without the query */
    const char *tail;   /* a prefix route's rest of the path ("{id}"), or "" */
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

typedef http_result (*http_handler)(server *s, const http_call *c, http_out *out);

/* A route's methods, or'ed. */
typedef enum http_method {
    HTTP_GET = 1,
    HTTP_POST = 2,
    HTTP_DELETE = 4,
} http_method;

/* One row of a route table. */
typedef struct http_route {
    const char *path; /* the whole path; with prefix, what it starts with (ending in '/') */
    bool prefix;      /* path + a non-empty rest (c->tail) */
    unsigned methods; /* http_method bits; others get 405 with an Allow header */
    bool public_;     /* answered without an API key */
    bool always;      /* answered while the model loads and while draining (else 503) */
    http_handler handler;
    /* Rewrites an error reply the transport makes (401, 404, 405, 413, 503, ...) into the
     * route's API's error format, or NULL: OpenAI's error JSON. */
    void (*error_format)(http_reply *r);
    /* The handler tokenizes or renders the body on the HTTP thread: it runs within the work
     * budget (http_work_take). */
    bool tokenizes;
    /* A POST body's media type taken beside application/json, or NULL. Never one a page may
     * send without a preflight (text/plain, a form's). */
    const char *body_type;
} http_route;

/* The most rows a route table has. */
#define HTTP_MAX_ROUTES 32

/* Which web pages may call the server and which Host names it answers (browser.c), from the
 * configuration's --host, --port, --allowed-origins and --allowed-hosts. */
typedef struct http_browser {
    char **origins; /* the server's own origins, then --allowed-origins */
    int n_origins;
    bool any_origin; /* "*" among them */
    char **hosts;    /* the Host names answered: the server's own, then --allowed-hosts */
    int n_hosts;
    bool check_host; /* listening on a loopback address, and no "*" among them */
} http_browser;

/* The transport's state: the routes it serves, the limits and keys it checks, its counters and
 * the daemon. The application holds one (server.http) and fills the first block before
 * http_start; every handler is called with app. */
typedef struct http_transport {
    server *app;                        /* handed to every handler */
    const kv_config *cfg;               /* host, port, threads and the connection limits */
    metrics *mx;                        /* requests counted per route and status */
    uint8_t (*key_digests)[32];         /* SHA-256 of each API key */
    int n_keys;                         /* 0: no key needed */
    http_route routes[HTTP_MAX_ROUTES]; /* the route table (server/api/routes.c) */
    int n_routes;
    /* Bytes of bodies the "tokenizes" routes may work on at once (0: no bound): set with the
     * model, from the most text a prompt can have (server/cli/cli_serve.c). */
    int64_t work_budget;
    atomic_llong work_bytes;         /* held now */
    http_browser browser;            /* filled by http_start */
    atomic_bool ready;               /* model loaded, engine running (else "always" routes) */
    atomic_bool draining;            /* SIGTERM: running work finishes; new requests get 503 */
    atomic_bool stopping;            /* the engine is stopped */
    atomic_int in_flight;            /* requests handed to a handler and not yet completed */
    atomic_int connections;          /* open HTTP connections */
    atomic_llong refused;            /* connections refused over --max-connections */
    atomic_ullong refusal_logged_ns; /* when a refusal was last logged (once a second) */
    struct MHD_Daemon *daemon;
} http_transport;

/* Starts listening on t's routes (routes not marked "always" answer 503 until t->ready). */
int http_start(http_transport *t, kv_error *err);
/* Stops accepting and closes every connection. Call with no connection waiting on the engine
 * (after engine_stop every request has finished and woken its connection). */
void http_stop(http_transport *t);

/* Takes bytes of t's work budget for a request of a "tokenizes" route: false (nothing taken)
 * when that would pass the budget while other such requests hold some of it. A request alone
 * is always taken, whatever its size (its handler bounds what it tokenizes). */
bool http_work_take(http_transport *t, int64_t bytes);
void http_work_release(http_transport *t, int64_t bytes);

/* ---------------------------------------------------------------- browser requests (browser.c) */

/* Fills b from cfg (the server's own origins and names, then the allowed ones); -1 with err when
 * cfg->host is not an IPv4 address or out of memory. */
int http_browser_init(http_browser *b, const kv_config *cfg, kv_error *err);
void http_browser_free(http_browser *b);
/* True when origin is allowed (NULL, as curl and the SDKs send none, is). Origins compare as
 * whole strings, ignoring case: "http://localhost:3000" does not allow port 3001. */
bool http_browser_origin_ok(const http_browser *b, const char *origin);
/* True when host (a Host header: name or [IPv6], an optional :port) is one b answers: any when
 * b does not check, and a request without Host. */
bool http_browser_host_ok(const http_browser *b, const char *host);
/* True when a Content-Type (NULL: none) is of the media type `media` ("application/json"),
 * parameters (charset) allowed. */
bool http_content_type_is(const char *type, const char *media);
/* What a preflight allows in Access-Control-Allow-Headers: the headers it asks for (a list of
 * header names), else the ones the API reads. */
const char *http_preflight_headers(const char *requested);

/* ---------------------------------------------------------------- reply helpers (reply.c) */

/* Replies with OpenAI's error JSON. */
void http_reply_error(http_reply *out, const api_error *err);
/* Replies with a JSON value (takes the reference). */
void http_reply_json(http_reply *out, int status, json_t *v);
/* A reply of text the caller made (malloc'd, owned from here). */
void http_reply_text(http_reply *out, int status, const char *content_type, char *text, size_t len);
/* True when the connection is reset or broken. A peer that only closed its sending side (a
 * half-close, as `nc -N` does after a request) is still waiting for the answer, and TCP cannot
 * tell that from a peer that left until something is written to it: that is not "gone". */
bool http_client_gone(int fd);

#endif
