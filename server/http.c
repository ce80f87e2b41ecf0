/* libmicrohttpd glue: one thread per connection, so a handler can block while the engine works
 * and a stream can block between tokens. Bodies are collected up to max_body_bytes; routes,
 * methods and API keys are checked before any handler runs; every failure is OpenAI's error
 * JSON with the matching status. */
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
    struct pollfd p = {.fd = fd, .events = POLLRDHUP};
    if (poll(&p, 1, 0) <= 0) return false;
    return (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

/* ---------------------------------------------------------------- per-request state */

typedef struct conn_req {
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
} conn_req;

static enum MHD_Result send_reply(struct MHD_Connection *conn, conn_req *cr, http_reply *r) {
    struct MHD_Response *resp =
        MHD_create_response_from_buffer(r->len, r->body, MHD_RESPMEM_MUST_FREE);
    if (!resp) {
        free(r->body);
        return MHD_NO;
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, r->content_type);
    if (r->retry_after > 0) {
        char v[16];
        snprintf(v, sizeof v, "%d", r->retry_after);
        MHD_add_response_header(resp, MHD_HTTP_HEADER_RETRY_AFTER, v);
    }
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

static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max) {
    (void)pos;
    http_stream *st = cls;
    long n = st->read(st->ud, buf, max);
    if (n > 0) return (ssize_t)n;
    return n == 0 ? MHD_CONTENT_READER_END_OF_STREAM : MHD_CONTENT_READER_END_WITH_ERROR;
}

static void stream_free(void *cls) {
    http_stream *st = cls;
    st->close(st->ud);
    free(st);
}

static enum MHD_Result send_stream(struct MHD_Connection *conn, conn_req *cr,
                                   const http_stream *src) {
    http_stream *st = malloc(sizeof *st);
    if (!st) {
        src->close(src->ud);
        return MHD_NO;
    }
    *st = *src;
    struct MHD_Response *resp =
        MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 << 10, stream_read, st, stream_free);
    if (!resp) {
        stream_free(st);
        return MHD_NO;
    }
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

static const char *bearer_token(struct MHD_Connection *conn) {
    const char *h = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Authorization");
    if (!h || strncasecmp(h, "Bearer ", 7) != 0) return NULL;
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
};

static const route *route_find(const char *url) {
    for (size_t i = 0; i < sizeof ROUTES / sizeof ROUTES[0]; i++)
        if (strcmp(url, ROUTES[i].path) == 0) return &ROUTES[i];
    /* /v1/models/{id} */
    if (strncmp(url, "/v1/models/", 11) == 0) return &ROUTES[2];
    return NULL;
}

static enum MHD_Result handle(server *s, struct MHD_Connection *conn, conn_req *cr, const route *rt,
                              const char *url) {
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    http_call call = {.fd = ci ? ci->connect_fd : -1,
                      .body = cr->body ? cr->body : "",
                      .len = cr->len,
                      .api_key = bearer_token(conn)};
    http_reply r = {0};
    http_stream st = {0};
    switch (rt->kind) {
    case ROUTE_HEALTH: {
        bool up = atomic_load(&s->ready) && !atomic_load(&s->stopping);
        json_t *v = json_pack("{s:s}", "status", up ? "ok" : "loading");
        if (atomic_load(&s->stopping)) json_object_set_new(v, "status", json_string("stopping"));
        http_reply_json(&r, up ? 200 : 503, v);
        if (!up) r.retry_after = 1;
        return send_reply(conn, cr, &r);
    }
    case ROUTE_METRICS: {
        size_t len = 0;
        char *text = metrics_render(s->mx, &len);
        if (text && atomic_load(&s->ready)) text = cache_api_metrics(s, text, &len);
        if (!text) return send_error(conn, cr, 500, "server_error", NULL, "out of memory");
        r = (http_reply){.status = 200,
                         .body = text,
                         .len = len,
                         .content_type = "text/plain; version=0.0.4; charset=utf-8"};
        return send_reply(conn, cr, &r);
    }
    default:
        break;
    }
    if (!atomic_load(&s->ready))
        return send_error(conn, cr, 503, "server_error", "model_loading",
                          "the model is still loading; retry shortly");
    if (atomic_load(&s->stopping))
        return send_error(conn, cr, 503, "server_error", NULL, "the server is shutting down");
    switch (rt->kind) {
    case ROUTE_MODELS:
        openai_models(s, strncmp(url, "/v1/models/", 11) == 0 ? url + 11 : NULL, &r);
        return send_reply(conn, cr, &r);
    case ROUTE_CHAT:
        if (openai_chat(s, &call, &r, &st) == 1) return send_stream(conn, cr, &st);
        return send_reply(conn, cr, &r);
    case ROUTE_COMPLETIONS:
        if (openai_completions(s, &call, &r, &st) == 1) return send_stream(conn, cr, &st);
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
        cr->limit = s->cfg->max_body_bytes;
        const route *rt = route_find(url);
        cr->route = rt ? rt->path : "other";
        cr->allow = rt ? (rt->post ? "POST" : "GET") : NULL;
        cr->t_start = clock_now_ns();
        snprintf(cr->method, sizeof cr->method, "%s", method);
        bool post = strcmp(method, MHD_HTTP_METHOD_POST) == 0;
        bool get = strcmp(method, MHD_HTTP_METHOD_GET) == 0;
        if (!rt)
            api_fail(&cr->early, 404, "invalid_request_error", "not_found", NULL,
                     "no endpoint %s %s", method, url);
        else if ((rt->post && !post) || (!rt->post && !get))
            api_fail(&cr->early, 405, "invalid_request_error", "method_not_allowed", NULL,
                     "%s takes %s, not %s", rt->path, rt->post ? "POST" : "GET", method);
        else if (!rt->public_ && !key_ok(s, bearer_token(conn)))
            api_fail(&cr->early, 401, "invalid_request_error", "invalid_api_key", NULL,
                     "Incorrect API key provided. Pass it as 'Authorization: Bearer KEY'.");
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
    return handle(s, conn, cr, route_find(url), url);
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                         enum MHD_RequestTerminationCode toe) {
    (void)conn;
    server *s = cls;
    conn_req *cr = *con_cls;
    if (!cr) return;
    if (cr->status) metrics_request(s->mx, cr->route, cr->status);
    /* The access log: one line per request, at info (health checks and scrapes at debug). */
    bool quiet = strcmp(cr->route, "/health") == 0 || strcmp(cr->route, "/metrics") == 0;
    log_msg(quiet ? LOG_LEVEL_DEBUG : LOG_LEVEL_INFO, "%s %s %d %.1f ms%s", cr->method, cr->route,
            cr->status, (double)(clock_now_ns() - cr->t_start) / 1e6,
            toe == MHD_REQUEST_TERMINATED_COMPLETED_OK ? "" : " (connection ended early)");
    free(cr->body);
    free(cr);
    *con_cls = NULL;
}

static void on_mhd_log(void *cls, const char *fmt, va_list ap) {
    (void)cls;
    char msg[512];
    vsnprintf(msg, sizeof msg, fmt, ap);
    size_t n = strlen(msg);
    while (n > 0 && msg[n - 1] == '\n') msg[--n] = '\0';
    log_warn("http: %s", msg);
}

/* ---------------------------------------------------------------- lifecycle */

int server_start(server *s, kv_error *err) {
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)s->cfg->port)};
    if (inet_pton(AF_INET, s->cfg->host, &addr.sin_addr) != 1)
        return kv_fail(err, "host: '%s' is not an IPv4 address", s->cfg->host);
    /* ITC lets MHD_quiesce_daemon stop the listener while connections finish. */
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ITC |
                     MHD_USE_ERROR_LOG;
    s->daemon = MHD_start_daemon(flags, (uint16_t)s->cfg->port, NULL, NULL, on_request, s,
                                 MHD_OPTION_EXTERNAL_LOGGER, on_mhd_log, NULL, MHD_OPTION_SOCK_ADDR,
                                 &addr, MHD_OPTION_NOTIFY_COMPLETED, on_completed, s,
                                 MHD_OPTION_CONNECTION_LIMIT, (unsigned)s->cfg->max_connections,
                                 MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)600, MHD_OPTION_END);
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
