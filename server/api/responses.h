/* The OpenAI Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.
 *
 * A request is translated onto the chat request (api_request of kind API_CHAT) and runs through
 * the chat endpoint's job (openai.c: template, tokenizer, cache, engine, tool guard): its input
 * items become chat messages (instructions the first system message, function_call items an
 * assistant turn's tool_calls, function_call_output items tool messages), text.format the
 * output's grammar, tools and tool_choice the chat's. The answer comes back as output items
 * (a message, or function calls), whole or as the API's semantic stream events.
 *
 * Conversations are kept in one canonical item form, whatever shape the client sent them in:
 *   {"type": "message", "role": "system"|"user"|"assistant", "content": ["text part", ...]}
 *   {"type": "function_call", "call_id", "name", "arguments": "JSON text"}
 *   {"type": "function_call_output", "call_id", "output": "text"}
 * A stored response keeps the conversation through its own output in that form, so a request
 * naming it in previous_response_id renders the earlier turns exactly as they ran (the prompt
 * then starts with the earlier prompt, and the context cache reuses its KV); so does a client
 * that sends the earlier output items back itself.
 *
 * responses_parse.c parses and translates (no model needed; fuzzed), responses_store.c keeps
 * stored responses, responses.c serves the endpoints. */
#ifndef KVSERVE_RESPONSES_H
#define KVSERVE_RESPONSES_H

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>

#include "cache/cache.h"
#include "server/api/api.h"

#define RESP_MAX_METADATA 16        /* metadata pairs, as OpenAI */
#define RESP_MAX_METADATA_KEY 64    /* bytes of a key */
#define RESP_MAX_METADATA_VALUE 512 /* bytes of a value */
#define RESP_MAX_ID 128             /* bytes of a previous_response_id */

/* ---------------------------------------------------------------- requests (responses_parse.c) */

typedef struct resp_request {
    api_request rq;             /* kind API_CHAT, n 1; messages: resp_conversation's */
    char *instructions;         /* or NULL */
    json_t *input;              /* the input items, canonical (an array, never empty) */
    char *previous_response_id; /* or NULL */
    bool store;                 /* default true */
    /* The request's settings as the response object repeats them (instructions, tools,
     * tool_choice, text, temperature, top_p, max_output_tokens, metadata, store, ...). */
    json_t *echo;
} resp_request;

/* Parses and validates a body of len bytes. Returns 0, or -1 with err (400 naming the field:
 * malformed JSON, a wrong type or range, a missing model or input, an input item of a kind this
 * server does not run (images, files, reasoning, built-in tools' calls), a field of the API it
 * does not support set to anything but its default (background, conversation, include, prompt,
 * reasoning effort, truncation "auto", ...), a chat field sent by mistake (messages,
 * response_format, max_tokens: the message says what the Responses API calls it)). Fields the
 * API does not have are otherwise ignored, as the chat endpoint ignores them. On failure *out
 * is left empty, so resp_request_free on it is a no-op. */
int resp_parse(const char *body, size_t len, resp_request *out, api_error *err);
/* Fills r->rq.messages: the instructions (as a system message), then prev (the canonical items
 * of a stored conversation, or NULL), then the input; a function_call_output must answer a call
 * made before it (and each call gets its output before the conversation goes on), as OpenAI
 * words it: -1 with err otherwise. */
int resp_conversation(resp_request *r, const json_t *prev, api_error *err);
void resp_request_free(resp_request *r);

/* ---------------------------------------------------------------- the store (responses_store.c)
 *
 * Stored responses live in memory, per namespace (the KV cache's: the caller's API key and the
 * request's cache_salt, so a response is found only with the key and salt that created it), at
 * most max_count of them and max_bytes of their JSON; past either bound the least recently used
 * of the tenant furthest over its share go (a GET or a continuation counts as a use). Each of
 * n_tenants tenants (the API keys, in --api-key order; one without keys) keeps share_pct percent
 * of both bounds for sure (0: an equal part): it may hold more while there is room, but those are
 * the first to go when another tenant needs it, so one key's flood of requests evicts its own
 * oldest responses, never another's within its share. A restart empties it. Thread-safe. */

typedef struct resp_store resp_store;

/* NULL when out of memory. */
resp_store *resp_store_create(int max_count, int64_t max_bytes, int n_tenants, int share_pct);
void resp_store_destroy(resp_store *st);
/* Keeps copies of response (the object GET returns) and conversation (the canonical items
 * through this response's output, as JSON text) under (ns, id) for tenant (below n_tenants; one
 * out of range counts as tenant 0), replacing what was there. Returns 0, 1 when the entry alone
 * is over max_bytes (nothing kept), -1 when out of memory. */
int resp_store_put(resp_store *st, int tenant, const cache_key *ns, const char *id,
                   const char *response, const char *conversation);
/* Copies (malloc'd) of what (ns, id) holds, into whichever of response and conversation is
 * non-NULL, and marks it used. false when there is none (or out of memory). */
bool resp_store_get(resp_store *st, const cache_key *ns, const char *id, char **response,
                    char **conversation);
/* Removes (ns, id); false when there was none. */
bool resp_store_delete(resp_store *st, const cache_key *ns, const char *id);

typedef struct resp_store_stats {
    int64_t count, bytes, evictions;
} resp_store_stats;
void resp_store_stats_get(resp_store *st, resp_store_stats *out);
/* Tenant t's entries, bytes and evictions (zero for one out of range). */
void resp_store_tenant_stats(resp_store *st, int t, resp_store_stats *out);

#endif
