/* The transport (http.h): libmicrohttpd in epoll mode with a small thread pool. No handler
 * blocks: a completion's connection is suspended (MHD_suspend_connection) while its stream or
 * reply has nothing to send and resumed by the engine's notification (MHD_resume_connection), so
 * thousands of idle, slow or waiting clients cost memory, not threads. Sockets with no complete
 * request close after --idle-timeout; clients over --max-connections are refused at once. The
 * request line and headers are checked against the limits, the server's route table (route,
 * method, API key) before any body is read; bodies are collected up to max_body_bytes; then the
 * route's handler runs. Every failure is OpenAI's error JSON (or the route's format) with the
 * matching status, logged with the request's id. */
#include <arpa/inet.h>
#include <errno.h>
#include <jansson.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <openssl/crypto.h>
#include <openssl/sha.h>
#include <poll.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "server/http/http.h"
#include "server/metrics/metrics.h"

/* A body larger than the limit is still read (and dropped) up to this many bytes, so the client
 * gets its 413 rather than a reset connection; beyond it the connection is closed at once. */
#define DISCARD_CEILING ((int64_t)64 << 20)

/* The request line and headers a request may have, as nginx's and llama-server's defaults allow
 * (8 KiB lines, 100 headers): over them the answer is 414 or 431 in OpenAI's error JSON. For
 * these answers to be ours, libmicrohttpd's per-connection pool (which holds the request line
 * and headers, and refuses itself what does not fit) is raised from its 32 KiB to
 * CONN_POOL_BYTES: mapped lazily, so an idle connection still costs a few pages. A header block
 * over the pool is still the library's 431 (in the error JSON: mhd_pages.c). */
#define MAX_URL_BYTES 8192
#define MAX_HEADER_COUNT 100
#define MAX_HEADER_BYTES (64 << 10)
#define CONN_POOL_BYTES (256u << 10)

/* ---------------------------------------------------------------- per-request state */

typedef struct conn_req {
    http_transport *t;
    struct MHD_Connection *conn;
    char *body;
    size_t len, cap;
    int64_t limit;
    bool too_big;
    const http_route *rt; /* NULL: no route (answered 404) */
    const char *tail;     /* a prefix route's rest of the URL */
    const char *route;    /* the endpoint name for metrics */
    char allow[24];       /* the methods the route takes (405's Allow header) */
    int status;           /* what was answered, for metrics */
    char method[8];
    uint64_t t_start;
    /* An error found from the headers alone (404, 405, 401): answered once the body has been
     * read and dropped, so the client reads the reply rather than a reset connection. */
    api_error early;
    char id[HTTP_REQUEST_ID_MAX];
    char error[256]; /* the message of a 4xx or 5xx answer, for the access log */
    void (*error_format)(http_reply *r); /* the route's error format (NULL: OpenAI's) */
    const char *origin; /* the request's Origin when it is allowed (answered with CORS), or NULL */
    bool preflight;     /* a CORS preflight (OPTIONS), answered once its body is dropped */
    bool counted;       /* in t->in_flight */
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
 * new random one. false when the kernel gives no random bytes for it (the id is then "-"). */
static bool request_id(struct MHD_Connection *conn, char *out, size_t size) {
    const char *h = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "X-Request-Id");
    size_t n = h ? strlen(h) : 0;
    bool ok = n > 0 && n <= 64;
    for (size_t i = 0; ok && i < n; i++) ok = h[i] > ' ' && h[i] < 0x7f;
    if (ok) {
        snprintf(out, size, "%s", h);
        return true;
    }
    uint8_t v[12];
    char hex[2 * sizeof v + 1];
    if (kv_random(v, sizeof v)) {
        snprintf(out, size, "-");
        return false;
    }
    kv_hex_encode(v, sizeof v, hex);
    snprintf(out, size, "req-%s", hex);
    return true;
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

/* Headers every answer carries: the request id, (draining) Connection: close, so that
 * keep-alive clients go elsewhere, and for a page of an allowed origin, CORS's: the page may
 * read the answer and its request id. */
static void common_headers(struct MHD_Response *resp, const conn_req *cr) {
    MHD_add_response_header(resp, "x-request-id", cr->id);
    if (atomic_load(&cr->t->draining))
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CONNECTION, "close");
    if (cr->origin) {
        MHD_add_response_header(resp, MHD_HTTP_HEADER_ACCESS_CONTROL_ALLOW_ORIGIN, cr->origin);
        MHD_add_response_header(resp, "Access-Control-Expose-Headers", "x-request-id, Retry-After");
        MHD_add_response_header(resp, MHD_HTTP_HEADER_VARY, "Origin");
    }
}

/* A CORS preflight (OPTIONS) of an allowed origin, or a plain OPTIONS: 204 with the route's
 * methods; with an Origin, the methods and headers its page may use, cached ten minutes. */
static enum MHD_Result send_preflight(struct MHD_Connection *conn, conn_req *cr) {
    struct MHD_Response *resp = MHD_create_response_from_buffer(0, NULL, MHD_RESPMEM_PERSISTENT);
    if (!resp) return MHD_NO;
    common_headers(resp, cr);
    MHD_add_response_header(resp, MHD_HTTP_HEADER_ALLOW, cr->allow);
    if (cr->origin) {
        const char *asked =
            MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Access-Control-Request-Headers");
        MHD_add_response_header(resp, "Access-Control-Allow-Methods", cr->allow);
        MHD_add_response_header(resp, "Access-Control-Allow-Headers",
                                http_preflight_headers(asked));
        MHD_add_response_header(resp, "Access-Control-Max-Age", "600");
    }
    cr->status = MHD_HTTP_NO_CONTENT;
    enum MHD_Result ok = MHD_queue_response(conn, MHD_HTTP_NO_CONTENT, resp);
    MHD_destroy_response(resp);
    return ok;
}

static enum MHD_Result send_reply(struct MHD_Connection *conn, conn_req *cr, http_reply *r) {
    if (r->status >= 400 && cr->error_format) cr->error_format(r);
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
    if (r->status == 405 && cr->allow[0])
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
static bool key_ok(const http_transport *t, const char *presented) {
    if (t->n_keys == 0) return true;
    if (!presented) return false;
    uint8_t d[32];
    SHA256((const unsigned char *)presented, strlen(presented), d);
    bool ok = false;
    for (int i = 0; i < t->n_keys; i++) ok |= CRYPTO_memcmp(d, t->key_digests[i], 32) == 0;
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

static unsigned method_bit(const char *method) {
    if (strcmp(method, MHD_HTTP_METHOD_GET) == 0) return HTTP_GET;
    if (strcmp(method, MHD_HTTP_METHOD_POST) == 0) return HTTP_POST;
    if (strcmp(method, MHD_HTTP_METHOD_DELETE) == 0) return HTTP_DELETE;
    return 0;
}

/* A 405's Allow header: the route's methods. */
static void methods_text(unsigned methods, char *out, size_t size) {
    static const struct {
        unsigned bit;
        const char *name;
    } M[] = {{HTTP_GET, "GET"}, {HTTP_POST, "POST"}, {HTTP_DELETE, "DELETE"}};
    size_t n = 0;
    out[0] = '\0';
    for (size_t i = 0; i < sizeof M / sizeof M[0]; i++)
        if (methods & M[i].bit)
            n += (size_t)snprintf(out + n, n < size ? size - n : 0, "%s%s", n ? ", " : "",
                                  M[i].name);
}

/* The route for url: a whole path first, else the prefix route it continues (*tail: the rest,
 * never empty). NULL when none. */
static const http_route *route_find(const http_transport *t, const char *url, const char **tail) {
    *tail = "";
    for (int i = 0; i < t->n_routes; i++)
        if (!t->routes[i].prefix && strcmp(url, t->routes[i].path) == 0) return &t->routes[i];
    for (int i = 0; i < t->n_routes; i++) {
        const http_route *rt = &t->routes[i];
        size_t n = strlen(rt->path);
        if (rt->prefix && strncmp(url, rt->path, n) == 0 && url[n]) {
            *tail = url + n;
            return rt;
        }
    }
    return NULL;
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

static enum MHD_Result handle(http_transport *t, struct MHD_Connection *conn, conn_req *cr,
                              const char *url) {
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    http_call call = {
        .method = cr->method,
        .url = url,
        .tail = cr->tail,
        .fd = ci ? ci->connect_fd : -1,
        .body = cr->body ? cr->body : "",
        .len = cr->len,
        .api_key = bearer_token(conn),
        .request_id = cr->id,
        .query_salt = MHD_lookup_connection_value(conn, MHD_GET_ARGUMENT_KIND, "cache_salt"),
        .if_none_match =
            MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_IF_NONE_MATCH),
        .wake = conn_wake,
        .wake_arg = cr};
    cr->counted = true;
    atomic_fetch_add(&t->in_flight, 1);
    if (!cr->rt->always) {
        if (atomic_load(&t->draining) || atomic_load(&t->stopping)) {
            http_reply r = {.retry_after = 1};
            api_error e = {.status = 503, .type = "server_error"};
            snprintf(e.message, sizeof e.message,
                     "the server is shutting down: running requests finish, new ones go "
                     "elsewhere");
            http_reply_error(&r, &e);
            return send_reply(conn, cr, &r);
        }
        if (!atomic_load(&t->ready))
            return send_error(conn, cr, 503, "server_error", "model_loading",
                              "the model is still loading; retry shortly");
    }
    /* at least a byte: an empty body's request holds the budget too while it works */
    int64_t work = cr->rt->tokenizes ? (int64_t)cr->len + 1 : 0;
    if (work && !http_work_take(t, work)) {
        http_reply r = {.retry_after = 1};
        api_error e = {.status = 429, .type = "rate_limit_error", .code = "server_busy"};
        snprintf(e.message, sizeof e.message,
                 "the server is busy: requests holding %lld bytes are being tokenized; retry "
                 "later",
                 (long long)atomic_load(&t->work_bytes));
        http_reply_error(&r, &e);
        return send_reply(conn, cr, &r);
    }
    http_out out = {0};
    http_result res = cr->rt->handler(t->app, &call, &out);
    if (work) http_work_release(t, work);
    switch (res) {
    case HTTP_STREAMING:
        return send_stream(conn, cr, &out.stream);
    case HTTP_PENDING:
        cr->pending = out.pending;
        return pending_step(conn, cr, false);
    case HTTP_REPLIED:
        break;
    }
    return send_reply(conn, cr, &out.reply);
}

bool http_work_take(http_transport *t, int64_t bytes) {
    int64_t held = atomic_fetch_add(&t->work_bytes, bytes);
    if (t->work_budget <= 0 || held == 0 || held + bytes <= t->work_budget) return true;
    atomic_fetch_sub(&t->work_bytes, bytes);
    return false;
}

void http_work_release(http_transport *t, int64_t bytes) {
    atomic_fetch_sub(&t->work_bytes, bytes);
}

/* Sums the size and count of a request's headers or query arguments (the iterator of
 * MHD_get_connection_values): about what they took on the wire. */
typedef struct header_tally {
    size_t bytes;
    int count;
} header_tally;

static enum MHD_Result tally_header(void *cls, enum MHD_ValueKind kind, const char *key,
                                    const char *value) {
    (void)kind;
    header_tally *t = cls;
    t->bytes += strlen(key) + (value ? strlen(value) : 0) + 4; /* ": " and CRLF */
    t->count++;
    return MHD_YES;
}

/* A POST's body is JSON, declared so: a Content-Type other than application/json (or the
 * route's body_type) is a 415, and so is a body sent without one (a page's "simple"
 * cross-origin POST is text/plain, or a form). A POST without a body needs none (curl -X POST). */
static void check_content_type(struct MHD_Connection *conn, const http_route *rt, api_error *e) {
    const char *type =
        MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_TYPE);
    if (http_content_type_is(type, "application/json") ||
        (rt->body_type && http_content_type_is(type, rt->body_type)))
        return;
    const char *cl =
        MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
    bool body = (cl && strtoll(cl, NULL, 10) != 0) ||
                MHD_lookup_connection_value(conn, MHD_HEADER_KIND,
                                            MHD_HTTP_HEADER_TRANSFER_ENCODING) != NULL;
    if (type)
        api_fail(e, 415, "invalid_request_error", "unsupported_media_type", NULL,
                 "Content-Type '%.100s' is not supported: send the body as JSON, with "
                 "'Content-Type: application/json'",
                 type);
    else if (body)
        api_fail(e, 415, "invalid_request_error", "unsupported_media_type", NULL,
                 "the request body has no Content-Type: send it as JSON, with 'Content-Type: "
                 "application/json'");
}

/* A request from a web page the server does not serve: a Host that is not one of its names on a
 * loopback listener (a DNS-rebinding page), or an Origin not allowed; into e (403), and true.
 * An allowed Origin goes to cr->origin, for the CORS headers. */
static bool check_browser(const http_transport *t, struct MHD_Connection *conn, conn_req *cr,
                          api_error *e) {
    const char *host = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_HOST);
    const char *origin = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_ORIGIN);
    if (!http_browser_host_ok(&t->browser, host))
        api_fail(e, 403, "permission_error", "host_not_allowed", NULL,
                 "Host '%.100s' is not a name of this server: on the loopback address %s it "
                 "answers localhost, 127.0.0.1, [::1] and its address (a page under another name "
                 "may be a DNS rebinding attack); --allowed-hosts names others",
                 host, t->cfg->host);
    else if (!http_browser_origin_ok(&t->browser, origin))
        api_fail(e, 403, "permission_error", "origin_not_allowed", NULL,
                 "Origin '%.100s' may not call this server: pages of other origins are refused "
                 "unless --allowed-origins names them (clients that send no Origin are not)",
                 origin);
    else
        cr->origin = origin;
    return e->status != 0;
}

/* What the request line and headers alone say is wrong, into cr->early (status 0: nothing):
 * a URL or header block over the limits (414, 431), a page the server does not serve (403),
 * no route (404), a method the route does not take (405), no valid key (401), a body that is
 * not JSON (415). An OPTIONS is a preflight, answered without a key. */
static void check_headers(const http_transport *t, struct MHD_Connection *conn, conn_req *cr,
                          const char *url) {
    api_error *e = &cr->early;
    header_tally q = {strlen(url), 0}, h = {0}; /* the query's arguments count to the URL */
    MHD_get_connection_values(conn, MHD_GET_ARGUMENT_KIND, tally_header, &q);
    MHD_get_connection_values(conn, MHD_HEADER_KIND, tally_header, &h);
    size_t n = q.bytes;
    if (n > MAX_URL_BYTES)
        api_fail(e, 414, "invalid_request_error", "uri_too_long", NULL,
                 "the URL of %zu bytes exceeds the limit of %d bytes", n, MAX_URL_BYTES);
    else if (h.count > MAX_HEADER_COUNT)
        api_fail(e, 431, "invalid_request_error", "headers_too_large", NULL,
                 "%d header fields exceed the limit of %d", h.count, MAX_HEADER_COUNT);
    else if (h.bytes > MAX_HEADER_BYTES)
        api_fail(e, 431, "invalid_request_error", "headers_too_large", NULL,
                 "the header fields' %zu bytes exceed the limit of %d bytes", h.bytes,
                 MAX_HEADER_BYTES);
    else if (check_browser(t, conn, cr, e))
        return;
    else if (!cr->rt)
        api_fail(e, 404, "invalid_request_error", "not_found", NULL, "no endpoint %s %s",
                 cr->method, url);
    else if (strcmp(cr->method, MHD_HTTP_METHOD_OPTIONS) == 0)
        cr->preflight = true;
    else if (!(cr->rt->methods & method_bit(cr->method)))
        api_fail(e, 405, "invalid_request_error", "method_not_allowed", NULL, "%s takes %s, not %s",
                 cr->rt->path, cr->allow, cr->method);
    else if (!cr->rt->public_ && !key_ok(t, bearer_token(conn)))
        api_fail(e, 401, "invalid_request_error", "invalid_api_key", NULL,
                 "Incorrect API key provided. Pass it as 'Authorization: Bearer KEY' (or "
                 "'x-api-key: KEY').");
    else if (method_bit(cr->method) == HTTP_POST)
        check_content_type(conn, cr->rt, e);
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
                                  const char *method, const char *version, const char *upload,
                                  size_t *upload_size, void **con_cls) {
    (void)version;
    http_transport *t = cls;
    conn_req *cr = *con_cls;
    if (!cr) {
        /* First call: headers only. Route, method and key are checked before any body is
         * read, and a declared body over the limit is refused at once. */
        if (!(cr = calloc(1, sizeof *cr))) return MHD_NO;
        *con_cls = cr;
        cr->t = t;
        cr->conn = conn;
        pthread_mutex_init(&cr->mu, NULL);
        atomic_init(&cr->refs, 1);
        bool have_id = request_id(conn, cr->id, sizeof cr->id);
        cr->limit = t->cfg->max_body_bytes;
        const http_route *rt = cr->rt = route_find(t, url, &cr->tail);
        cr->route = rt ? rt->path : "other";
        if (rt) methods_text(rt->methods, cr->allow, sizeof cr->allow);
        cr->error_format = rt ? rt->error_format : NULL;
        cr->t_start = clock_now_ns();
        snprintf(cr->method, sizeof cr->method, "%s", method);
        check_headers(t, conn, cr, url);
        if (!have_id)
            api_fail(&cr->early, 500, "server_error", NULL, NULL,
                     "no random bytes for the request's id (getrandom: %s)", strerror(errno));
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
    if (cr->preflight) return send_preflight(conn, cr);
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
    return handle(t, conn, cr, url);
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                         enum MHD_RequestTerminationCode toe) {
    (void)conn;
    http_transport *t = cls;
    conn_req *cr = *con_cls;
    if (!cr) return;
    if (cr->status) metrics_request(t->mx, cr->route, cr->status);
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
    if (cr->counted) atomic_fetch_sub(&t->in_flight, 1);
    *con_cls = NULL;
    conn_req_unref(cr);
}

/* libmicrohttpd's own messages. The answers it gives itself (a malformed request line or header,
 * headers over its memory pool, an unsupported HTTP version, bad chunked encoding: answered in
 * the error JSON by mhd_pages.c) are error answers like ours, at info; a client that leaves or
 * idles out is routine (thousands of them with a slowloris), at debug; anything else at warn. */
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
    http_transport *t = cls;
    atomic_fetch_add(&t->connections, toe == MHD_CONNECTION_NOTIFY_STARTED ? 1 : -1);
}

/* A client over --max-connections is closed at once (its connect succeeded in the kernel; it
 * reads end-of-file). Logged at most once a second. */
static enum MHD_Result on_accept(void *cls, const struct sockaddr *addr, socklen_t addrlen) {
    (void)addr;
    (void)addrlen;
    http_transport *t = cls;
    int open = atomic_load(&t->connections);
    if (open < t->cfg->max_connections) return MHD_YES;
    long long n = atomic_fetch_add(&t->refused, 1) + 1;
    uint64_t now = clock_now_ns(), last = atomic_load(&t->refusal_logged_ns);
    if (now - last >= 1000000000ull &&
        atomic_compare_exchange_strong(&t->refusal_logged_ns, &last, now))
        log_warn("http: refusing connections: %d open (--max-connections %d); %lld refused so far",
                 open, t->cfg->max_connections, n);
    return MHD_NO;
}

/* ---------------------------------------------------------------- lifecycle */

int http_start(http_transport *t, kv_error *err) {
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)t->cfg->port)};
    if (inet_pton(AF_INET, t->cfg->host, &addr.sin_addr) != 1)
        return kv_fail(err, "host: '%s' is not an IPv4 address", t->cfg->host);
    if (http_browser_init(&t->browser, t->cfg, err)) return -1;
    /* Suspend/resume brings the ITC (an eventfd) that wakes a worker for a resumed connection;
     * it also lets MHD_quiesce_daemon stop the listener. */
    unsigned flags = MHD_USE_EPOLL_INTERNAL_THREAD | MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ERROR_LOG;
    /* MHD's limit (split between its threads) sits above ours, so that on_accept, which sees
     * the total, is the one that refuses. */
    unsigned mhd_limit = (unsigned)t->cfg->max_connections + 64u * (unsigned)t->cfg->http_threads;
    t->daemon = MHD_start_daemon(
        flags, (uint16_t)t->cfg->port, on_accept, t, on_request, t, MHD_OPTION_EXTERNAL_LOGGER,
        on_mhd_log, NULL, MHD_OPTION_SOCK_ADDR, &addr, MHD_OPTION_NOTIFY_COMPLETED, on_completed, t,
        MHD_OPTION_NOTIFY_CONNECTION, on_connection, t, MHD_OPTION_THREAD_POOL_SIZE,
        (unsigned)t->cfg->http_threads, MHD_OPTION_CONNECTION_LIMIT, mhd_limit,
        MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)t->cfg->idle_timeout,
        MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)CONN_POOL_BYTES, MHD_OPTION_END);
    if (!t->daemon) {
        http_browser_free(&t->browser);
        return kv_fail(err, "cannot listen on %s:%d (in use, or not permitted)", t->cfg->host,
                       t->cfg->port);
    }
    return 0;
}

void http_stop(http_transport *t) {
    if (!t->daemon) return;
    /* The listening socket quiesce hands back is ours. Shutting it down refuses new clients at
     * once instead of leaving them in the backlog while open connections finish. It is closed
     * only after MHD's threads have stopped: each of them takes it out of its epoll set when it
     * sees the quiesce, and a descriptor closed before that makes MHD abort ("Failed to remove
     * listen FD from epoll set"). */
    MHD_socket fd = MHD_quiesce_daemon(t->daemon);
    if (fd != MHD_INVALID_SOCKET) shutdown(fd, SHUT_RDWR);
    MHD_stop_daemon(t->daemon);
    if (fd != MHD_INVALID_SOCKET) close(fd);
    t->daemon = NULL;
    http_browser_free(&t->browser); /* no thread reads it any more */
}
