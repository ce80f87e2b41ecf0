/* The route table: every endpoint the server answers, its methods, whether it needs an API key
 * and whether it answers before the model is ready; plus the two endpoints that are about the
 * server itself, GET /health and GET /metrics. */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "server/api/handlers.h"

static http_result health(server *s, const http_call *c, http_out *out) {
    (void)c;
    bool draining = atomic_load(&s->leaving) || atomic_load(&s->http.draining) ||
                    atomic_load(&s->http.stopping);
    bool up = atomic_load(&s->http.ready) && !draining;
    json_t *v = json_pack("{s:s}", "status", up ? "ok" : draining ? "draining" : "loading");
    if (up) json_object_set_new(v, "reuse_quality", cache_api_reuse_json(s));
    if (up) {
        /* speculative decoding (--spec), and its draft tokens verified and kept so far */
        engine_spec_stats st;
        engine_spec_stats_get(s->eng, &st);
        json_t *sp =
            json_pack("{s:s,s:I,s:I,s:f}", "mode", st.on ? "context" : "off", "drafted",
                      (json_int_t)st.drafted, "accepted", (json_int_t)st.accepted, "acceptance",
                      st.drafted ? (double)st.accepted / (double)st.drafted : 0.0);
        /* the draft model (--draft-model) when one drafts, and the time it took */
        json_object_set_new(sp, "draft_model",
                            st.draft_model ? json_string(st.draft_model) : json_null());
        json_object_set_new(sp, "draft_model_seconds", json_real(st.draft_seconds));
        json_object_set_new(sp, "draft_model_drafted", json_integer(st.model_drafted));
        json_object_set_new(sp, "draft_model_accepted", json_integer(st.model_accepted));
        json_object_set_new(v, "speculation", sp);
    }
    http_reply_json(&out->reply, up ? 200 : 503, v);
    if (!up) out->reply.retry_after = 1;
    return HTTP_REPLIED;
}

/* Appends the connection gauges to the Prometheus text (malloc'd, len bytes; freed here). NULL
 * when out of memory. */
static char *connection_metrics(server *s, char *text, size_t *len) {
    char more[1280];
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
        "# TYPE kvserve_http_requests_in_flight gauge\nkvserve_http_requests_in_flight %d\n"
        "# HELP kvserve_http_tokenizing_bytes Bytes of request bodies being rendered or tokenized "
        "on HTTP threads now.\n"
        "# TYPE kvserve_http_tokenizing_bytes gauge\nkvserve_http_tokenizing_bytes %lld\n"
        "# HELP kvserve_http_tokenizing_budget_bytes Bytes of bodies they may hold at once (over "
        "it: 429).\n"
        "# TYPE kvserve_http_tokenizing_budget_bytes gauge\n"
        "kvserve_http_tokenizing_budget_bytes %lld\n",
        atomic_load(&s->http.connections), (long long)atomic_load(&s->http.refused),
        atomic_load(&s->http.in_flight), (long long)atomic_load(&s->http.work_bytes),
        (long long)s->http.work_budget);
    char *t = realloc(text, *len + (size_t)n + 1);
    if (!t) {
        free(text);
        return NULL;
    }
    memcpy(t + *len, more, (size_t)n + 1);
    *len += (size_t)n;
    return t;
}

static http_result prometheus(server *s, const http_call *c, http_out *out) {
    (void)c;
    size_t len = 0;
    char *text = metrics_render(s->mx, &len);
    if (text && atomic_load(&s->http.ready)) text = cache_api_metrics(s, text, &len);
    if (text) text = connection_metrics(s, text, &len);
    if (!text) {
        api_error e = {.status = 500, .type = "server_error", .message = "out of memory"};
        http_reply_error(&out->reply, &e);
        return HTTP_REPLIED;
    }
    http_reply_text(&out->reply, 200, "text/plain; version=0.0.4; charset=utf-8", text, len);
    return HTTP_REPLIED;
}

/* path, prefix, methods, public, always (before the model is ready), handler, error format,
 * tokenizes (on the HTTP thread: within the transport's work budget), a POST body's type taken
 * beside JSON */
static const http_route ROUTES[] = {
    {"/health", false, HTTP_GET, true, true, health, NULL, false, NULL},
    {"/metrics", false, HTTP_GET, true, true, prometheus, NULL, false, NULL},
    {"/v1/models", false, HTTP_GET, false, false, openai_models, NULL, false, NULL},
    {"/v1/models/", true, HTTP_GET, false, false, openai_models, NULL, false, NULL},
    {"/v1/chat/completions", false, HTTP_POST, false, false, openai_chat, NULL, true, NULL},
    {"/v1/completions", false, HTTP_POST, false, false, openai_completions, NULL, true, NULL},
    {"/tokenize", false, HTTP_POST, false, false, openai_tokenize, NULL, true, NULL},
    {"/detokenize", false, HTTP_POST, false, false, openai_detokenize, NULL, true, NULL},
    {"/v1/embeddings", false, HTTP_POST, false, false, openai_embeddings, NULL, true, NULL},
    /* llama-server's path */
    {"/embeddings", false, HTTP_POST, false, false, openai_embeddings, NULL, true, NULL},
    {"/v1/messages", false, HTTP_POST, false, false, anthropic_messages, anthropic_reply_error,
     true, NULL},
    {"/v1/messages/count_tokens", false, HTTP_POST, false, false, anthropic_count_tokens,
     anthropic_reply_error, true, NULL},
    {"/v1/responses", false, HTTP_POST, false, false, responses_create, NULL, true, NULL},
    {"/v1/responses/", true, HTTP_GET | HTTP_DELETE, false, false, responses_api, NULL, false,
     NULL},
    /* what SGLang's and vLLM's routers ask of a worker (router_api.c): public, as /metrics is
     * (the server's own facts, nothing of a tenant's), so that a router without a key (in front
     * of several tenants' keys) registers the model; the load is answered while draining too: a
     * router that reads no load for an instance (-1) may take it for the least loaded and send
     * it every retry */
    {"/server_info", false, HTTP_GET, true, false, router_server_info, NULL, false, NULL},
    {"/get_server_info", false, HTTP_GET, true, false, router_server_info, NULL, false, NULL},
    {"/model_info", false, HTTP_GET, true, false, router_model_info, NULL, false, NULL},
    {"/get_model_info", false, HTTP_GET, true, false, router_model_info, NULL, false, NULL},
    {"/get_load", false, HTTP_GET, true, true, router_get_load, NULL, false, NULL},
    {"/v1/cache/stats", false, HTTP_GET, false, false, cache_api_stats, NULL, false, NULL},
    {"/v1/cache/clear", false, HTTP_POST, false, false, cache_api_clear, NULL, false, NULL},
    {"/v1/cache/pin", false, HTTP_POST, false, false, cache_api_pin, NULL, true, NULL},
    {"/v1/cache/unpin", false, HTTP_POST, false, false, cache_api_unpin, NULL, true, NULL},
    /* a schema's PML may come as it is */
    {"/v1/schemas", false, HTTP_GET | HTTP_POST, false, false, schemas_api, NULL, true,
     "application/xml"},
    {"/v1/schemas/", true, HTTP_GET | HTTP_DELETE, false, false, schemas_api, NULL, false, NULL},
    /* the web page: static, public, served while the model loads; gone with --no-webui */
    {"/", false, HTTP_GET, true, true, webui_get, NULL, false, NULL},
    {"/webui/", true, HTTP_GET, true, true, webui_get, NULL, false, NULL},
};

int api_routes(const kv_config *cfg, http_route *out, int cap) {
    int n = 0;
    for (size_t i = 0; i < sizeof ROUTES / sizeof ROUTES[0] && n < cap; i++) {
        if (ROUTES[i].handler == webui_get && !cfg->webui) continue;
        out[n++] = ROUTES[i];
    }
    return n;
}
