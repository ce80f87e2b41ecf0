/* The endpoints: every handler the route table (routes.c) names, one file per API, and what the
 * server's start-up and the other endpoints use of them. A handler has the transport's shape
 * (server/http/http.h): it reads the call and fills one member of *out, which its result names. */
#ifndef KVSERVE_HANDLERS_H
#define KVSERVE_HANDLERS_H

#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "server/api/api.h"
#include "server/http/http.h"
#include "server/server.h"

/* The route table for cfg (the web page's rows only with cfg->webui) into out; returns the rows
 * written (at most cap). */
int api_routes(const kv_config *cfg, http_route *out, int cap);

/* OpenAI's API (openai.c): POST /v1/chat/completions and /v1/completions (a reply, a stream
 * or a pending reply), GET /v1/models and /v1/models/{id}, POST /tokenize, /detokenize and
 * /v1/embeddings (/embeddings, llama-server's path). */
http_result openai_chat(server *s, const http_call *c, http_out *out);
http_result openai_completions(server *s, const http_call *c, http_out *out);
http_result openai_models(server *s, const http_call *c, http_out *out);
http_result openai_tokenize(server *s, const http_call *c, http_out *out);
http_result openai_detokenize(server *s, const http_call *c, http_out *out);
http_result openai_embeddings(server *s, const http_call *c, http_out *out);

/* Anthropic's Messages API (anthropic.c): POST /v1/messages (as the completion endpoints) and
 * /v1/messages/count_tokens. */
http_result anthropic_messages(server *s, const http_call *c, http_out *out);
http_result anthropic_count_tokens(server *s, const http_call *c, http_out *out);
/* Rewrites an error reply made in OpenAI's error JSON (by the transport: 401, 405, 413, 503)
 * into Anthropic's, for the Anthropic routes; a body already in Anthropic's is kept. */
void anthropic_reply_error(http_reply *r);

/* The Responses API (responses.c): POST /v1/responses (as openai_chat), GET and DELETE
 * /v1/responses/{id}, and its store's Prometheus metrics (written with the cache's, by
 * cache_api_metrics). */
http_result responses_create(server *s, const http_call *c, http_out *out);
http_result responses_api(server *s, const http_call *c, http_out *out);
void responses_metrics(const server *s, FILE *f);

/* What existing routers ask of a worker (router_api.c): GET /server_info and /model_info (and
 * their older names /get_server_info, /get_model_info) and GET /get_load. */
http_result router_server_info(server *s, const http_call *c, http_out *out);
http_result router_model_info(server *s, const http_call *c, http_out *out);
http_result router_get_load(server *s, const http_call *c, http_out *out);

/* The context cache's namespace for a request: the API key presented (when the server requires
 * keys) and the request's cache_salt. */
static inline void server_cache_namespace(const server *s, const http_call *c, const char *salt,
                                          cache_key *ns) {
    const char *key = s->http.n_keys > 0 && c->api_key ? c->api_key : NULL;
    cache_namespace((const uint8_t *)key, key ? strlen(key) : 0, salt, ns);
}
/* The most bytes of text a prompt of the server's context can have: no token spans more than
 * the vocabulary's longest. Longer text cannot fit, and is refused before it is tokenized, so
 * what an HTTP thread tokenizes for one request is bounded (server_check_text). */
static inline size_t server_text_limit(const server *s) {
    return (size_t)s->ctx * tokenizer_max_token_len(s->m->tok);
}
/* -1 with err (400 context_length_exceeded, naming param) when len bytes of text cannot fit
 * the context (over server_text_limit): what every route checks before it tokenizes text
 * (limits.c). */
int server_check_text(const server *s, size_t len, const char *param, api_error *err);

/* Tenants (tenants.c; DESIGN.md "Tenants"): the tenant a request comes from, the index of its API
 * key in --api-key order (0 on a server without keys, and for a request without a valid key,
 * which only public routes answer); and their Prometheus gauges, labelled by that index, never
 * by the key (written with the cache's, by cache_api_metrics). */
int server_tenant(const server *s, const http_call *c);
void tenant_metrics(server *s, FILE *f);
/* Pins and leases shared through Redis with --redis (shared_pins.c; nothing without): each
 * record of a sequence's blocks bkeys[0..n_blocks) in namespace ns pinned (until 0) or leased
 * until then (Unix seconds) is recorded in Redis and its chunks are kept there as long; forget
 * removes the pins (not the leases) from Redis and returns how many were there. */
void shared_pins_record(server *s, const cache_key *ns, const cache_key *bkeys, int n_blocks,
                        int64_t until);
int shared_pins_forget(server *s, const cache_key *ns, const cache_key *bkeys, int n_blocks);
/* Ends here the pins of namespace ns (among the n local records held, any namespace) that
 * another instance unpinned (their tombstones in Redis); returns how many. */
int shared_pins_sync(server *s, const cache_key *ns, const cache_pin_info *local, int n);
/* Namespace ns's shared pins and leases that this instance does not hold (local: the n_local
 * records it holds, any namespace), as GET /v1/cache/stats lists them ("tiers": ["redis"]). A
 * new array. */
json_t *shared_pins_json(server *s, const cache_key *ns, const cache_pin_info *local, int n_local);

/* The cache endpoints (cache_api.c): GET /v1/cache/stats, POST /v1/cache/clear, /pin, /unpin. */
http_result cache_api_stats(server *s, const http_call *c, http_out *out);
http_result cache_api_clear(server *s, const http_call *c, http_out *out);
http_result cache_api_pin(server *s, const http_call *c, http_out *out);
http_result cache_api_unpin(server *s, const http_call *c, http_out *out);
/* What the quality budget lets approximate reuse do, and why (GET /health, /v1/cache/stats). */
json_t *cache_api_reuse_json(const server *s);
/* Appends the cache's Prometheus metrics (and the Responses API store's) to text (malloc'd, len
 * bytes; freed here). Returns the new text, or NULL when out of memory. */
char *cache_api_metrics(server *s, char *text, size_t *len);

/* Prompt Cache (schemas.c): the schema registry (cache/schema/schema.h) and its builder thread,
 * which precomputes modules through the engine, started once the engine runs (dir: where
 * definitions are kept, or NULL), stopped before the engine; /v1/schemas (POST
 * registers, GET lists) and /v1/schemas/{name} (GET, DELETE); and a request's schema_prompt
 * assembled into out (-1 with err: 400 for a prompt that does not fit its schema, 404 for an
 * unknown schema, 409 for one not ready). */
int schemas_start(server *s, const char *dir, kv_error *err);
void schemas_stop(server *s);
http_result schemas_api(server *s, const http_call *c, http_out *out);
int schemas_prompt(server *s, const api_request *rq, const http_call *c, schema_prompt *out,
                   api_error *err);

/* The web page (webui.c): GET / and /webui/{file}, with its security and caching headers (a
 * 304 when If-None-Match names the file's ETag), or a 404 for a file it does not have. Static:
 * served while the model loads. */
http_result webui_get(server *s, const http_call *c, http_out *out);

#endif
