/* Anthropic's Messages API (POST /v1/messages, POST /v1/messages/count_tokens), internal to
 * server/. A request body is validated (anthropic_req.c) into the chat request the OpenAI
 * endpoints run (api_request: messages, tools, sampling), so both APIs share the templates, tool
 * formats, grammars, the engine and the context cache; what is Anthropic's own is kept beside
 * it: the cache_control markers, whose prefixes become leases in the chunk store, and the reply
 * (anthropic.c: the message, its usage, the named SSE events, Anthropic's error JSON).
 *
 * Mapping (Anthropic -> chat messages): `system` (a string or text blocks) is the system
 * message; a user message's tool_result blocks become tool messages (one each, in order), its
 * text blocks one user message after them; an assistant message's text blocks are its content
 * and its tool_use blocks its tool_calls (arguments: the input object as JSON text). Several
 * text blocks are joined with a blank line between them. Every field Anthropic documents is
 * either taken or refused with a 400 that names it (images, documents, thinking, server tools,
 * an assistant prefill, ...); a field Anthropic does not know is refused as Anthropic refuses
 * it ("Extra inputs are not permitted"). */
#ifndef KVSERVE_ANTHROPIC_H
#define KVSERVE_ANTHROPIC_H

#include <stddef.h>

#include "server/api/api.h"

#define ANTHROPIC_MAX_MARKERS 4 /* cache_control blocks per request, as Anthropic */
#define ANTHROPIC_TTL_5M 300    /* seconds: cache_control's default ttl "5m" */
#define ANTHROPIC_TTL_1H 3600   /* "1h" */

/* A cache_control marker: the prompt's prefix up to the end of its block is kept (leased in
 * the chunk store) for ttl seconds. */
typedef struct anthropic_marker {
    int msg;        /* the chat message its block went into; -1: the tools */
    bool text;      /* a text block: content[a..e) of that message is its text */
    size_t a, e;    /* (tool_use and tool_result blocks: the prefix ends with the message) */
    int ttl;        /* seconds */
    char param[64]; /* where it was given ("system.0.cache_control") */
} anthropic_marker;

typedef struct anthropic_request {
    api_request rq; /* the chat request (API_CHAT); its model, messages, tools, sampling */
    anthropic_marker markers[ANTHROPIC_MAX_MARKERS]; /* in prompt order: tools, system, messages */
    int n_markers;
} anthropic_request;

/* Parses a /v1/messages body (count: a /v1/messages/count_tokens body, which has no max_tokens
 * nor sampling fields). Returns 0, or -1 with err (400 with the field's path, Anthropic's way:
 * "messages.1.content.0.type: ..."). On failure *out is left empty, so anthropic_request_free
 * on it is a no-op. */
int anthropic_parse(const char *body, size_t len, bool count, anthropic_request *out,
                    api_error *err);
void anthropic_request_free(anthropic_request *r);

/* Anthropic's error type for an HTTP status (400 invalid_request_error, 401
 * authentication_error, 403 permission_error, 404 not_found_error, 413 request_too_large, 429
 * rate_limit_error, 503 and 529 overloaded_error, else api_error). */
const char *anthropic_error_type(int status);
/* {"type": "error", "error": {"type": ..., "message": ...}} as a malloc'd string (NULL when out
 * of memory). */
char *anthropic_error_json(const api_error *err);

#endif
