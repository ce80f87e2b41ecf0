/* libmicrohttpd glue: epoll with a small thread pool. No handler blocks: a completion's
 * connection is suspended (MHD_suspend_connection) while its stream or reply has nothing to
 * send and resumed by the engine's notification (MHD_resume_connection), so thousands of idle,
 * slow or waiting clients cost memory, not threads. Sockets with no complete request close after
 * --idle-timeout; clients over --max-connections are refused at once. Bodies are collected up to
 * max_body_bytes; routes, methods and API keys are checked before any handler runs; every
 * failure is OpenAI's error JSON with the matching status, logged with the request's id. */
#include <arpa/inet.h>
#include <jansson.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <openssl/crypto.h>
#include <openssl/sha.h>
#include <poll.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

#include "server/server.h"

/* A body larger than the limit is still read (and dropped) up to this many bytes, so the client
 * gets its 413 rather than a reset connection; beyond it the connection is closed at once. */
#define DISCARD_CEILING ((int64_t)64 << 20)

/* ---------------------------------------------------------------- replies */

void http_reply_json(http_reply *out, int status, json_t *v) {
    char *s = v ? json_dumps(v, JSON_COMPACT) : NULL;
    json_decref(v);
    if (!s) {
        static const char oom[] =
            "{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\",\"param\":null,"
            "\"code\":null}}";
        s = strdup(oom);
        status = 500;
    }
    out->status = status;
    out->body = s;
    out->len = s ? strlen(s) : 0;
    out->content_type = "application/json";
}

void http_reply_error(http_reply *out, const api_error *err) {
    char *s = api_error_json(err);
    out->status = err->status;
    out->body = s ? s : strdup("{\"error\":{\"message\":\"out of memory\"}}");
    out->len = out->body ? strlen(out->body) : 0;
    out->content_type = "application/json";
}

bool http_client_gone(int fd) {
    if (fd < 0) return false;
    struct pollfd p = {.fd = fd, .events = 0};
    if (poll(&p, 1, 0) <= 0) return false;
    return (p.revents & (POLLHUP | POLLERR | POLLNVAL)) != 0;
}

/* ---------------------------------------------------------------- per-request state */

typedef struct conn_req {
    server *s;
    struct MHD_Connection *conn;
    char *body;
    size_t len, cap;
    int64_t limit;
    bool too_big;
    const char *route; /* the endpoint name for metrics */
    const char *allow; /* the method the route takes (405's Allow header) */
    int status;        /* what was answered, for metrics */
    char method[8];
    uint64_t t_start;
    /* An error found from the headers alone (404, 405, 401): answered once the body has been
     * read and dropped, so the client reads the reply rather than a reset connection. */
    api_error early;
    char id[HTTP_REQUEST_ID_MAX];
    char error[256];      /* the message of a 4xx or 5xx answer, for the access log */
    bool anthropic;       /* an Anthropic route: errors in Anthropic's JSON */
    bool counted;         /* in s->in_flight */
    http_pending pending; /* a reply the engine works on (.ud NULL: none) */
    /* The connection sleeps (suspended) while its stream or pending reply has nothing; wake
     * resumes it. `news` keeps a wake that came while it was awake, so one that lands between
     * "nothing yet" and the suspension is not lost. Lock order: a request's mu, then this. */
    pthread_mutex_t mu;
    bool suspended, news;
    atomic_int refs; /* the connection's, and its stream's (a stream may outlive the request) */
} conn_req;

static void conn_req_unref(conn_req *cr) {
    if (atomic_fetch_sub(&cr->refs, 1) != 1) return;
    pthread_mutex_destroy(&cr->mu);
    free(cr->body);
    free(cr);
}

/* Any thread, never blocks: the engine calls it (under the request's mutex) when it publishes. */
static void conn_wake(void *arg) {
    conn_req *cr = arg;
    pthread_mutex_lock(&cr->mu);
    cr->news = true;
    if (cr->suspended) {
        cr->suspended = false;
        MHD_resume_connection(cr->conn);
    }
    pthread_mutex_unlock(&cr->mu);
}

/* Before looking for output: forget earlier wakes. */
static void conn_look(conn_req *cr) {
    pthread_mutex_lock(&cr->mu);
    cr->news = false;
    pthread_mutex_unlock(&cr->mu);
}

/* After finding none: suspends the connection unless a wake came since conn_look (then the
 * caller looks again). Only from the access handler or the content reader, as MHD requires. */
static bool conn_sleep(conn_req *cr) {
    pthread_mutex_lock(&cr->mu);
    bool sleep = !cr->news;
    if (sleep) {
        cr->suspended = true;
        MHD_suspend_connection(cr->conn);
    }
    pthread_mutex_unlock(&cr->mu);
    return sleep;
}

/* The client's X-Request-Id when it is 1..64 printable ASCII characters without spaces, else a
 * new random one. */
static void request_id(struct MHD_Connection *conn, char *out, size_t size) {
    const char *h = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "X-Request-Id");
    size_t n = h ? strlen(h) : 0;
    bool ok = n > 0 && n <= 64;
    for (size_t i = 0; ok && i < n; i++) ok = h[i] > ' ' && h[i] < 0x7f;
    if (ok) {
        snprintf(out, size, "%s", h);
        return;
    }
    uint64_t v[2];
    if (getrandom(v, sizeof v, 0) != (ssize_t)sizeof v) {
        v[0] = clock_now_ns() * 0x9E3779B97F4A7C15ull;
        v[1] = (uint64_t)(uintptr_t)out;
    }
    snprintf(out, size, "req-%016llx%08llx", (unsigned long long)v[0],
             (unsigned long long)(v[1] & 0xffffffffu));
}

/* The message of an error reply (OpenAI's error JSON, or the body as it is), one line. */
static void reply_message(const http_reply *r, char *out, size_t size) {
    json_error_t je;
    json_t *v = r->body && r->len ? json_loadb(r->body, r->len, 0, &je) : NULL;
    const char *m = json_string_value(json_object_get(json_object_get(v, "error"), "message"));
    if (m)
        snprintf(out, size, "%s", m);
    else
        snprintf(out, size, "%.*s", (int)(r->len < 200 ? r->len : 200), r->body ? r->body : "");
    json_decref(v);
    for (char *p = out; *p; p++) /* the log is one line per request */
        if ((unsigned char)*p < ' ' || *p == 0x7f) *p = ' ';
}

/* Headers every answer carries: the request id, and (draining) Connection: close, so that
 * keep-alive clients go elsewhere. */
static void common_headers(struct MHD_Response *resp, const conn_req *cr) {
    MHD_add_response_header(resp, "x-request-id", cr->id);
    if (atomic_load(&cr->s->draining))
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CONNECTION, "close");
}

static enum MHD_Result send_reply(struct MHD_Connection *conn, conn_req *cr, http_reply *r) {
    if (r->status >= 400 && cr->anthropic) anthropic_reply_error(r);
    struct MHD_Response *resp =
        MHD_create_response_from_buffer(r->len, r->body, MHD_RESPMEM_MUST_FREE);
    if (!resp) {
        free(r->body);
        return MHD_NO;
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, r->content_type);
    common_headers(resp, cr);
    if (r->status >= 400) reply_message(r, cr->error, sizeof cr->error);
    if (r->retry_after > 0) {
        char v[16];
        snprintf(v, sizeof v, "%d", r->retry_after);
        MHD_add_response_header(resp, MHD_HTTP_HEADER_RETRY_AFTER, v);
    }
    for (int i = 0; i < HTTP_REPLY_HEADERS && r->headers[i].name; i++)
        MHD_add_response_header(resp, r->headers[i].name, r->headers[i].value);
    if (r->status == 401) MHD_add_response_header(resp, MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer");
    if (r->status == 405 && cr->allow)
        MHD_add_response_header(resp, MHD_HTTP_HEADER_ALLOW, cr->allow);
    cr->status = r->status;
    enum MHD_Result ok = MHD_queue_response(conn, (unsigned)r->status, resp);
    MHD_destroy_response(resp);
    return ok;
}

static enum MHD_Result send_error(struct MHD_Connection *conn, conn_req *cr, int status,
                                  const char *type, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 6, 7)));
static enum MHD_Result send_error(struct MHD_Connection *conn, conn_req *cr, int status,
                                  const char *type, const char *code, const char *fmt, ...) {
    api_error e = {.status = status, .type = type, .code = code};
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e.message, sizeof e.message, fmt, ap);
    va_end(ap);
    http_reply r = {0};
    http_reply_error(&r, &e);
    return send_reply(conn, cr, &r);
}

/* ---------------------------------------------------------------- streams */

/* A stream and the connection it wakes (the stream holds a reference to it). */
typedef struct stream_box {
    http_stream st;
    conn_req *cr;
} stream_box;

/* Returning 0 with the connection suspended is how a content reader waits (MHD's docs). */
static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max) {
    (void)pos;
    stream_box *b = cls;
    for (;;) {
        conn_look(b->cr);
        long n = b->st.read(b->st.ud, buf, max);
        if (n > 0) return (ssize_t)n;
        if (n == 0) return MHD_CONTENT_READER_END_OF_STREAM;
        if (n != HTTP_WAIT) return MHD_CONTENT_READER_END_WITH_ERROR;
        if (conn_sleep(b->cr)) return 0;
    }
}

static void stream_free(void *cls) {
    stream_box *b = cls;
    b->st.close(b->st.ud);
    conn_req_unref(b->cr);
    free(b);
}

static enum MHD_Result send_stream(struct MHD_Connection *conn, conn_req *cr,
                                   const http_stream *src) {
    stream_box *b = malloc(sizeof *b);
    if (!b) {
        src->close(src->ud);
        return MHD_NO;
    }
    b->st = *src;
    b->cr = cr;
    atomic_fetch_add(&cr->refs, 1);
    struct MHD_Response *resp =
        MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 << 10, stream_read, b, stream_free);
    if (!resp) {
        stream_free(b);
        return MHD_NO;
    }
    common_headers(resp, cr);
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    cr->status = 200;
    enum MHD_Result ok = MHD_queue_response(conn, MHD_HTTP_OK, resp);
    MHD_destroy_response(resp);
    return ok;
}

/* ---------------------------------------------------------------- authentication */

/* Keys are compared as SHA-256 digests with CRYPTO_memcmp: the time taken depends neither on
 * where a wrong key differs nor on its length. */
static bool key_ok(const server *s, const char *presented) {
    if (s->n_keys == 0) return true;
    if (!presented) return false;
    uint8_t d[32];
    SHA256((const unsigned char *)presented, strlen(presented), d);
    bool ok = false;
    for (int i = 0; i < s->n_keys; i++) ok |= CRYPTO_memcmp(d, s->key_digests[i], 32) == 0;
    return ok;
}

/* The key presented: a Bearer token, else x-api-key (Anthropic's clients send that). */
static const char *bearer_token(struct MHD_Connection *conn) {
    const char *h = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Authorization");
    if (!h || strncasecmp(h, "Bearer ", 7) != 0)
        return MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "x-api-key");
    h += 7;
    while (*h == ' ') h++;
    return h;
}

/* ---------------------------------------------------------------- routing */

typedef enum route_kind {
    ROUTE_NONE = 0,
    ROUTE_HEALTH,
    ROUTE_METRICS,
    ROUTE_MODELS,
    ROUTE_CHAT,
    ROUTE_COMPLETIONS,
    ROUTE_TOKENIZE,
    ROUTE_DETOKENIZE,
    ROUTE_EMBEDDINGS,
    ROUTE_CACHE_STATS,
    ROUTE_CACHE_CLEAR,
    ROUTE_CACHE_PIN,
    ROUTE_CACHE_UNPIN,
    ROUTE_SCHEMAS,   /* /v1/schemas: GET lists, POST registers */
    ROUTE_SCHEMA,    /* /v1/schemas/{name}: GET, DELETE */
    ROUTE_WEBUI,     /* / and /webui/{file}: the web page (gone with --no-webui) */
    ROUTE_ANTHROPIC, /* /v1/messages, /v1/messages/count_tokens */
    /* /v1/responses: POST; /v1/responses/{id}: GET, DELETE */
    ROUTE_RESPONSES,
    ROUTE_RESPONSE,
} route_kind;

typedef struct route {
    const char *path;
    route_kind kind;
    bool post;
    bool public_; /* no API key needed */
} route;

static const route ROUTES[] = {
    {"/health", ROUTE_HEALTH, false, true},
    {"/metrics", ROUTE_METRICS, false, true},
    {"/v1/models", ROUTE_MODELS, false, false},
    {"/v1/chat/completions", ROUTE_CHAT, true, false},
    {"/v1/completions", ROUTE_COMPLETIONS, true, false},
    {"/tokenize", ROUTE_TOKENIZE, true, false},
    {"/detokenize", ROUTE_DETOKENIZE, true, false},
    {"/v1/embeddings", ROUTE_EMBEDDINGS, true, false},
    {"/embeddings", ROUTE_EMBEDDINGS, true, false}, /* llama-server's path */
    {"/v1/cache/stats", ROUTE_CACHE_STATS, false, false},
    {"/v1/cache/clear", ROUTE_CACHE_CLEAR, true, false},
    {"/v1/cache/pin", ROUTE_CACHE_PIN, true, false},
    {"/v1/cache/unpin", ROUTE_CACHE_UNPIN, true, false},
    {"/", ROUTE_WEBUI, false, true},
    {"/webui/", ROUTE_WEBUI, false, true},
    {"/v1/schemas", ROUTE_SCHEMAS, true, false},
    {"/v1/messages", ROUTE_ANTHROPIC, true, false},
    {"/v1/messages/count_tokens", ROUTE_ANTHROPIC, true, false},
    {"/v1/schemas/", ROUTE_SCHEMA, false, false},
    {"/v1/responses", ROUTE_RESPONSES, true, false},
    {"/v1/responses/", ROUTE_RESPONSE, false, false},
};

/* Routes that take more than one method (the table's post flag aside). */
static bool route_method_ok(const route *rt, const char *method) {
    if (rt->kind == ROUTE_SCHEMAS)
        return strcmp(method, MHD_HTTP_METHOD_GET) == 0 ||
               strcmp(method, MHD_HTTP_METHOD_POST) == 0;
    if (rt->kind == ROUTE_SCHEMA || rt->kind == ROUTE_RESPONSE)
        return strcmp(method, MHD_HTTP_METHOD_GET) == 0 ||
               strcmp(method, MHD_HTTP_METHOD_DELETE) == 0;
    return strcmp(method, rt->post ? MHD_HTTP_METHOD_POST : MHD_HTTP_METHOD_GET) == 0;
}

static const char *route_allow(const route *rt) {
    if (rt->kind == ROUTE_SCHEMAS) return "GET, POST";
    if (rt->kind == ROUTE_SCHEMA || rt->kind == ROUTE_RESPONSE) return "GET, DELETE";
    return rt->post ? "POST" : "GET";
}

static const route *route_of(route_kind kind) {
    for (size_t i = 0; i < sizeof ROUTES / sizeof ROUTES[0]; i++)
        if (ROUTES[i].kind == kind) return &ROUTES[i];
    return NULL;
}

static const route *route_find(const server *s, const char *url) {
    if (!s->cfg->webui && (strcmp(url, "/") == 0 || strncmp(url, "/webui/", 7) == 0)) return NULL;
    if (strncmp(url, "/webui/", 7) == 0) url = "/webui/"; /* its files: /webui/{file} */
    for (size_t i = 0; i < sizeof ROUTES / sizeof ROUTES[0]; i++)
        if (strcmp(url, ROUTES[i].path) == 0) return &ROUTES[i];
    /* /v1/models/{id} */
    if (strncmp(url, "/v1/models/", 11) == 0) return &ROUTES[2];
    /* /v1/schemas/{name} */
    if (strncmp(url, "/v1/schemas/", 12) == 0 && url[12]) return route_of(ROUTE_SCHEMA);
    /* /v1/responses/{id} */
    if (strncmp(url, "/v1/responses/", 14) == 0 && url[14]) return route_of(ROUTE_RESPONSE);
    return NULL;
}

/* Appends the connection gauges to the Prometheus text (malloc'd, len bytes; freed here). NULL
 * when out of memory. */
static char *http_metrics(server *s, char *text, size_t *len) {
    char more[768];
    int n = snprintf(
        more, sizeof more,
        "# HELP kvserve_http_connections Open HTTP connections.\n"
        "# TYPE kvserve_http_connections gauge\nkvserve_http_connections %d\n"
        "# HELP kvserve_http_connections_refused_total Connections refused over "
        "--max-connections.\n"
        "# TYPE kvserve_http_connections_refused_total counter\n"
        "kvserve_http_connections_refused_total %lld\n"
        "# HELP kvserve_http_requests_in_flight Requests being answered or streamed (this one "
        "included).\n"
        "# TYPE kvserve_http_requests_in_flight gauge\nkvserve_http_requests_in_flight %d\n",
        atomic_load(&s->connections), (long long)atomic_load(&s->refused),
        atomic_load(&s->in_flight));
    char *t = realloc(text, *len + (size_t)n + 1);
    if (!t) {
        free(text);
        return NULL;
    }
    memcpy(t + *len, more, (size_t)n + 1);
    *len += (size_t)n;
    return t;
}

/* A reply the engine works on: answered when ready, else the connection sleeps until the engine
 * wakes it and MHD calls the access handler again.
 *
 * Not on the handler's first call (may_sleep false): that call comes from the read that
 * completed the request, and libmicrohttpd 0.9.75 does not update a suspended connection's
 * event state, so the connection would stay "waiting to read" and, resumed (always marked
 * readable), read again. A client that half-closed after its request (shutdown(SHUT_WR)) then
 * reads as end-of-file and the connection is closed unanswered. Returning without a response
 * once lets MHD mark the connection as waiting on the application and call the handler again
 * at once; suspended from there, it is never read while it waits. */
static enum MHD_Result pending_step(struct MHD_Connection *conn, conn_req *cr, bool may_sleep) {
    for (;;) {
        conn_look(cr);
        http_reply r = {0};
        if (cr->pending.poll(cr->pending.ud, &r)) return send_reply(conn, cr, &r);
        if (!may_sleep || conn_sleep(cr)) return MHD_YES;
    }
}

static enum MHD_Result handle(server *s, struct MHD_Connection *conn, conn_req *cr, const route *rt,
                              const char *url) {
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    http_call call = {.fd = ci ? ci->connect_fd : -1,
                      .body = cr->body ? cr->body : "",
                      .len = cr->len,
                      .api_key = bearer_token(conn),
                      .request_id = cr->id,
                      .query_salt =
                          MHD_lookup_connection_value(conn, MHD_GET_ARGUMENT_KIND, "cache_salt"),
                      .wake = conn_wake,
                      .wake_arg = cr};
    http_reply r = {0};
    http_stream st = {0};
    http_pending pend = {0};
    cr->counted = true;
    atomic_fetch_add(&s->in_flight, 1);
    bool draining = atomic_load(&s->draining) || atomic_load(&s->stopping);
    switch (rt->kind) {
    case ROUTE_HEALTH: {
        bool up = atomic_load(&s->ready) && !draining;
        json_t *v = json_pack("{s:s}", "status", up ? "ok" : draining ? "draining" : "loading");
        if (up) json_object_set_new(v, "reuse_quality", cache_api_reuse_json(s));
        http_reply_json(&r, up ? 200 : 503, v);
        if (!up) r.retry_after = 1;
        return send_reply(conn, cr, &r);
    }
    case ROUTE_METRICS: {
        size_t len = 0;
        char *text = metrics_render(s->mx, &len);
        if (text && atomic_load(&s->ready)) text = cache_api_metrics(s, text, &len);
        if (text) text = http_metrics(s, text, &len);
        if (!text) return send_error(conn, cr, 500, "server_error", NULL, "out of memory");
        r = (http_reply){.status = 200,
                         .body = text,
                         .len = len,
                         .content_type = "text/plain; version=0.0.4; charset=utf-8"};
        return send_reply(conn, cr, &r);
    }
    case ROUTE_WEBUI: /* static: served while the model loads */
        call.if_none_match =
            MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_IF_NONE_MATCH);
        webui_get(&call, url, &r);
        return send_reply(conn, cr, &r);
    default:
        break;
    }
    if (!atomic_load(&s->ready))
        return send_error(conn, cr, 503, "server_error", "model_loading",
                          "the model is still loading; retry shortly");
    if (draining) {
        r.retry_after = 1;
        api_error e = {.status = 503, .type = "server_error"};
        snprintf(e.message, sizeof e.message,
                 "the server is shutting down: running requests finish, new ones go elsewhere");
        http_reply_error(&r, &e);
        return send_reply(conn, cr, &r);
    }
    int rc = 0;
    switch (rt->kind) {
    case ROUTE_MODELS:
        openai_models(s, strncmp(url, "/v1/models/", 11) == 0 ? url + 11 : NULL, &r);
        return send_reply(conn, cr, &r);
    case ROUTE_CHAT:
    case ROUTE_COMPLETIONS:
    case ROUTE_RESPONSES:
        rc = rt->kind == ROUTE_CHAT          ? openai_chat(s, &call, &r, &st, &pend)
             : rt->kind == ROUTE_COMPLETIONS ? openai_completions(s, &call, &r, &st, &pend)
                                             : responses_create(s, &call, &r, &st, &pend);
        if (rc == 1) return send_stream(conn, cr, &st);
        if (rc == 2) {
            cr->pending = pend;
            return pending_step(conn, cr, false);
        }
        return send_reply(conn, cr, &r);
    case ROUTE_TOKENIZE:
        openai_tokenize(s, &call, &r);
        return send_reply(conn, cr, &r);
    case ROUTE_DETOKENIZE:
        openai_detokenize(s, &call, &r);
        return send_reply(conn, cr, &r);
    case ROUTE_EMBEDDINGS:
        openai_embeddings(s, &call, &r);
        return send_reply(conn, cr, &r);
    case ROUTE_CACHE_STATS:
        cache_api_stats(s, &r);
        return send_reply(conn, cr, &r);
    case ROUTE_CACHE_CLEAR:
        cache_api_clear(s, &call, &r);
        return send_reply(conn, cr, &r);
    case ROUTE_CACHE_PIN:
    case ROUTE_CACHE_UNPIN:
        cache_api_pin(s, &call, &r, rt->kind == ROUTE_CACHE_PIN);
        return send_reply(conn, cr, &r);
    case ROUTE_SCHEMAS:
    case ROUTE_SCHEMA:
        schemas_api(s, &call, cr->method, rt->kind == ROUTE_SCHEMA ? url + 12 : NULL, &r);
        return send_reply(conn, cr, &r);
    case ROUTE_RESPONSE:
        responses_api(s, &call, cr->method, url + 14, &r);
        return send_reply(conn, cr, &r);
    case ROUTE_ANTHROPIC:
        rc = anthropic_api(s, &call, url, &r, &st, &pend);
        if (rc == 1) return send_stream(conn, cr, &st);
        if (rc == 2) {
            cr->pending = pend;
            return pending_step(conn, cr, false);
        }
        return send_reply(conn, cr, &r);
    default:
        return send_error(conn, cr, 500, "server_error", NULL, "unrouted request");
    }
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
                                  const char *method, const char *version, const char *upload,
                                  size_t *upload_size, void **con_cls) {
    (void)version;
    server *s = cls;
    conn_req *cr = *con_cls;
    if (!cr) {
        /* First call: headers only. Route, method and key are checked before any body is
         * read, and a declared body over the limit is refused at once. */
        if (!(cr = calloc(1, sizeof *cr))) return MHD_NO;
        *con_cls = cr;
        cr->s = s;
        cr->conn = conn;
        pthread_mutex_init(&cr->mu, NULL);
        atomic_init(&cr->refs, 1);
        request_id(conn, cr->id, sizeof cr->id);
        cr->limit = s->cfg->max_body_bytes;
        const route *rt = route_find(s, url);
        cr->route = rt ? rt->path : "other";
        cr->allow = rt ? route_allow(rt) : NULL;
        cr->anthropic = rt && rt->kind == ROUTE_ANTHROPIC;
        cr->t_start = clock_now_ns();
        snprintf(cr->method, sizeof cr->method, "%s", method);
        if (!rt)
            api_fail(&cr->early, 404, "invalid_request_error", "not_found", NULL,
                     "no endpoint %s %s", method, url);
        else if (!route_method_ok(rt, method))
            api_fail(&cr->early, 405, "invalid_request_error", "method_not_allowed", NULL,
                     "%s takes %s, not %s", rt->path, route_allow(rt), method);
        else if (!rt->public_ && !key_ok(s, bearer_token(conn)))
            api_fail(&cr->early, 401, "invalid_request_error", "invalid_api_key", NULL,
                     "Incorrect API key provided. Pass it as 'Authorization: Bearer KEY' (or "
                     "'x-api-key: KEY').");
        const char *cl =
            MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
        long long declared = cl ? strtoll(cl, NULL, 10) : 0;
        if (declared > DISCARD_CEILING && (cr->early.status || declared > cr->limit)) {
            /* too large even to drop: answer now (the connection closes after it) */
            if (!cr->early.status)
                api_fail(&cr->early, 413, "invalid_request_error", "request_too_large", NULL,
                         "the body of %lld bytes exceeds the limit of %lld bytes", declared,
                         (long long)cr->limit);
            http_reply r = {0};
            http_reply_error(&r, &cr->early);
            return send_reply(conn, cr, &r);
        }
        return MHD_YES;
    }
    if (cr->pending.ud) return pending_step(conn, cr, true); /* again, or resumed */
    if (cr->status) {
        /* Already answered: drop whatever body follows. */
        *upload_size = 0;
        return MHD_YES;
    }
    if (*upload_size > 0) {
        size_t n = *upload_size;
        *upload_size = 0;
        if (cr->early.status || cr->too_big || (int64_t)(cr->len + n) > cr->limit) {
            cr->too_big = true;
            cr->len += n; /* counted, not kept */
            if ((int64_t)cr->len > DISCARD_CEILING) return MHD_NO;
            return MHD_YES;
        }
        if (cr->len + n + 1 > cr->cap) {
            size_t cap = (cr->len + n + 1) * 2;
            if ((int64_t)cap > cr->limit + 1) cap = (size_t)cr->limit + 1;
            char *b = realloc(cr->body, cap);
            if (!b) return MHD_NO;
            cr->body = b;
            cr->cap = cap;
        }
        memcpy(cr->body + cr->len, upload, n);
        cr->len += n;
        cr->body[cr->len] = '\0';
        return MHD_YES;
    }
    if (cr->early.status) {
        http_reply r = {0};
        http_reply_error(&r, &cr->early);
        return send_reply(conn, cr, &r);
    }
    if (cr->too_big)
        return send_error(conn, cr, 413, "invalid_request_error", "request_too_large",
                          "the request body of %zu bytes exceeds the limit of %lld bytes", cr->len,
                          (long long)cr->limit);
    /* Bodies are JSON text: a raw NUL is never valid, and a parser reading a C string would
     * silently drop everything after it. */
    const char *nul = cr->len ? memchr(cr->body, '\0', cr->len) : NULL;
    if (nul)
        return send_error(conn, cr, 400, "invalid_request_error", NULL,
                          "the request body contains a NUL byte at byte offset %zu (JSON text "
                          "cannot; write it as \\u0000 inside a string)",
                          (size_t)(nul - cr->body));
    return handle(s, conn, cr, route_find(s, url), url);
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                         enum MHD_RequestTerminationCode toe) {
    (void)conn;
    server *s = cls;
    conn_req *cr = *con_cls;
    if (!cr) return;
    if (cr->status) metrics_request(s->mx, cr->route, cr->status);
    /* The access log: one line per request with its id, and the message of an error answer; at
     * info (5xx at warn; health checks and scrapes at debug). */
    bool quiet = strcmp(cr->route, "/health") == 0 || strcmp(cr->route, "/metrics") == 0;
    log_level lv = quiet ? LOG_LEVEL_DEBUG : cr->status >= 500 ? LOG_LEVEL_WARN : LOG_LEVEL_INFO;
    const char *end = toe == MHD_REQUEST_TERMINATED_COMPLETED_OK      ? ""
                      : toe == MHD_REQUEST_TERMINATED_TIMEOUT_REACHED ? " (idle timeout)"
                                                                      : " (connection ended early)";
    log_msg(lv, "%s %s %d %.1f ms id=%s%s%s%s", cr->method, cr->route, cr->status,
            (double)(clock_now_ns() - cr->t_start) / 1e6, cr->id, end, cr->error[0] ? ": " : "",
            cr->error);
    if (cr->pending.ud) cr->pending.close(cr->pending.ud); /* no wake comes after this */
    if (cr->counted) atomic_fetch_sub(&s->in_flight, 1);
    *con_cls = NULL;
    conn_req_unref(cr);
}

/* libmicrohttpd's own messages. The answers it gives itself (a malformed request line or header,
 * headers over its memory pool, an unsupported HTTP version, bad chunked encoding: cases the
 * library has no hook for) are error answers like ours, at info; a client that leaves or idles
 * out is routine (thousands of them with a slowloris), at debug; anything else at warn. */
static void on_mhd_log(void *cls, const char *fmt, va_list ap) {
    (void)cls;
    char msg[512];
    vsnprintf(msg, sizeof msg, fmt, ap);
    size_t n = strlen(msg);
    while (n > 0 && msg[n - 1] == '\n') msg[--n] = '\0';
    log_level lv = LOG_LEVEL_WARN;
    if (strstr(msg, "HTTP response code is"))
        lv = LOG_LEVEL_INFO;
    else if (strstr(msg, "closed by remote side") || strstr(msg, "timed out") ||
             strstr(msg, "Connection reset") || strstr(msg, "Broken pipe"))
        lv = LOG_LEVEL_DEBUG;
    log_msg(lv, "http: %s", msg);
}

/* ---------------------------------------------------------------- connections */

/* Counts open connections (MHD's own limit stops polling the listener, so clients over it would
 * wait in the kernel's backlog behind idle ones; the accept policy refuses them instead). */
static void on_connection(void *cls, struct MHD_Connection *conn, void **socket_context,
                          enum MHD_ConnectionNotificationCode toe) {
    (void)conn;
    (void)socket_context;
    server *s = cls;
    atomic_fetch_add(&s->connections, toe == MHD_CONNECTION_NOTIFY_STARTED ? 1 : -1);
}

/* A client over --max-connections is closed at once (its connect succeeded in the kernel; it
 * reads end-of-file). Logged at most once a second. */
static enum MHD_Result on_accept(void *cls, const struct sockaddr *addr, socklen_t addrlen) {
    (void)addr;
    (void)addrlen;
    server *s = cls;
    int open = atomic_load(&s->connections);
    if (open < s->cfg->max_connections) return MHD_YES;
    long long n = atomic_fetch_add(&s->refused, 1) + 1;
    uint64_t now = clock_now_ns(), last = atomic_load(&s->refusal_logged_ns);
    if (now - last >= 1000000000ull &&
        atomic_compare_exchange_strong(&s->refusal_logged_ns, &last, now))
        log_warn("http: refusing connections: %d open (--max-connections %d); %lld refused so far",
                 open, s->cfg->max_connections, n);
    return MHD_NO;
}

/* ---------------------------------------------------------------- lifecycle */

int server_start(server *s, kv_error *err) {
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)s->cfg->port)};
    if (inet_pton(AF_INET, s->cfg->host, &addr.sin_addr) != 1)
        return kv_fail(err, "host: '%s' is not an IPv4 address", s->cfg->host);
    /* Suspend/resume brings the ITC (an eventfd) that wakes a worker for a resumed connection;
     * it also lets MHD_quiesce_daemon stop the listener. */
    unsigned flags = MHD_USE_EPOLL_INTERNAL_THREAD | MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ERROR_LOG;
    /* MHD's limit (split between its threads) sits above ours, so that on_accept, which sees
     * the total, is the one that refuses. */
    unsigned mhd_limit = (unsigned)s->cfg->max_connections + 64u * (unsigned)s->cfg->http_threads;
    s->daemon = MHD_start_daemon(
        flags, (uint16_t)s->cfg->port, on_accept, s, on_request, s, MHD_OPTION_EXTERNAL_LOGGER,
        on_mhd_log, NULL, MHD_OPTION_SOCK_ADDR, &addr, MHD_OPTION_NOTIFY_COMPLETED, on_completed, s,
        MHD_OPTION_NOTIFY_CONNECTION, on_connection, s, MHD_OPTION_THREAD_POOL_SIZE,
        (unsigned)s->cfg->http_threads, MHD_OPTION_CONNECTION_LIMIT, mhd_limit,
        MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)s->cfg->idle_timeout, MHD_OPTION_END);
    if (!s->daemon)
        return kv_fail(err, "cannot listen on %s:%d (in use, or not permitted)", s->cfg->host,
                       s->cfg->port);
    return 0;
}

void server_stop(server *s) {
    if (!s->daemon) return;
    /* The listening socket quiesce hands back is ours to close: new clients are refused at once
     * instead of waiting in the backlog while open connections finish. */
    MHD_socket fd = MHD_quiesce_daemon(s->daemon);
    if (fd != MHD_INVALID_SOCKET) close(fd);
    MHD_stop_daemon(s->daemon);
    s->daemon = NULL;
}
