/* The Responses API's endpoints (responses.h): POST /v1/responses over the chat endpoint's job,
 * its answer as output items (whole, or streamed as the API's semantic events), and the stored
 * responses behind GET and DELETE /v1/responses/{id} and previous_response_id.
 *
 * Streamed, a response is `event: TYPE\ndata: {"type": TYPE, ..., "sequence_number": N}\n\n`
 * events: response.created and response.in_progress; per output item output_item.added, then
 * for a message content_part.added, output_text.delta pieces, output_text.done and
 * content_part.done, for a function call function_call_arguments.delta pieces and
 * function_call_arguments.done; output_item.done; and last response.completed (or
 * response.incomplete when max_output_tokens cut the answer, response.failed on an error), which
 * carries the whole response object, as a non-streamed request gets it. */
#include <errno.h>
#include <openssl/sha.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cache/store/redis_state.h"
#include "server/api/job.h"
#include "server/api/responses.h"

/* The Responses state of a job (job.ext). */
typedef struct resp_job {
    char id[64]; /* resp_<48 hex>, random */
    /* output items' ids: SHA-256(item_key, kind, index), from random bytes drawn apart from the
     * id's, so an item id says nothing of the response's id (the key to GET, DELETE or continue
     * it) and no two items of a response share one, however many there are */
    uint8_t item_key[32];
    long created;
    json_t *echo;         /* the request's settings the response object repeats */
    json_t *conversation; /* canonical items before this turn's output (stored turns, input) */
    bool store;
    cache_key ns;
    /* streaming */
    int64_t seq;
    int n_items; /* output items begun */
    int open;    /* the item in progress: 0 none, ITEM_MESSAGE, ITEM_CALL */
    int call;    /* the open call's index among the answer's calls */
    char *name;  /* the open call's function */
    /* the open item's text or arguments so far: acc_f writes them into acc (acc_len bytes,
     * NUL-terminated once flushed) */
    FILE *acc_f;
    char *acc;
    size_t acc_len;
} resp_job;

enum { ITEM_MESSAGE = 1, ITEM_CALL };

static void resp_job_free(void *ud) {
    resp_job *rj = ud;
    if (!rj) return;
    json_decref(rj->echo);
    json_decref(rj->conversation);
    free(rj->name);
    if (rj->acc_f) fclose(rj->acc_f);
    free(rj->acc);
    free(rj);
}

/* msg_<48 hex> or fc_<48 hex>: the item at output index `index`, as the stream and the whole
 * response both number them. */
static void item_id(const resp_job *rj, bool call, int index, char *out, size_t cap) {
    uint8_t in[sizeof rj->item_key + 5], d[SHA256_DIGEST_LENGTH];
    memcpy(in, rj->item_key, sizeof rj->item_key);
    in[sizeof rj->item_key] = call ? 'f' : 'm';
    le_put_u32(in + sizeof rj->item_key + 1, (uint32_t)index);
    SHA256(in, sizeof in, d);
    char hex[49];
    kv_hex_encode(d, 24, hex);
    snprintf(out, cap, "%s_%s", call ? "fc" : "msg", hex);
}

/* ---------------------------------------------------------------- the response object */

/* Arguments a client can parse: a call that max_output_tokens cut is "incomplete". */
static bool args_complete(const char *args) {
    json_t *v = json_loads(args, JSON_DECODE_ANY, NULL);
    json_decref(v);
    return v != NULL;
}

static json_t *message_item(const resp_job *rj, int index, const char *text, size_t len,
                            const char *status) {
    char id[80];
    item_id(rj, false, index, id, sizeof id);
    return json_pack("{s:s,s:s,s:s,s:s,s:[{s:s,s:s%,s:[]}]}", "id", id, "type", "message", "status",
                     status, "role", "assistant", "content", "type", "output_text", "text", text,
                     len, "annotations");
}

static json_t *call_item(const resp_job *rj, int index, const char *call_id, const char *name,
                         const char *args, const char *status) {
    char id[80];
    item_id(rj, true, index, id, sizeof id);
    return json_pack("{s:s,s:s,s:s,s:s,s:s,s:s}", "id", id, "type", "function_call", "call_id",
                     call_id, "name", name, "arguments", args, "status", status);
}

/* The finished answer as output items: a message, or (tools) the function calls it made; an
 * answer max_output_tokens cut is "incomplete" (and so is a call cut short). *conv gets the
 * items the conversation keeps, canonical (a cut call is left out: it was never made). */
static json_t *output_items(const job *j, const resp_job *rj, json_t **conv, bool *cut) {
    const gen_choice *c = &j->reqs[0]->choices[0];
    *cut = c->finish == GEN_FINISH_LENGTH;
    const char *status = *cut ? "incomplete" : "completed";
    json_t *out = json_array(), *msg = NULL;
    *conv = json_array();
    const char *text = c->text ? c->text : "";
    size_t len = c->len;
    if (j->tools) {
        const char *finish = NULL;
        msg = job_message_json(j, 0, c, &finish);
        const json_t *content = json_object_get(msg, "content");
        text = json_is_string(content) ? json_string_value(content) : NULL;
        len = json_string_length(content);
    }
    /* ids by output index, as the stream numbers its items */
    if (text) {
        json_array_append_new(out, message_item(rj, (int)json_array_size(out), text, len, status));
        json_array_append_new(*conv, json_pack("{s:s,s:s,s:[s%]}", "type", "message", "role",
                                               "assistant", "content", text, len));
    }
    size_t k;
    json_t *tc;
    json_array_foreach(json_object_get(msg, "tool_calls"), k, tc) {
        const char *id = json_string_value(json_object_get(tc, "id"));
        const json_t *fn = json_object_get(tc, "function");
        const char *name = json_string_value(json_object_get(fn, "name"));
        const char *args = json_string_value(json_object_get(fn, "arguments"));
        bool whole = args_complete(args);
        json_array_append_new(out, call_item(rj, (int)json_array_size(out), id, name, args,
                                             whole ? "completed" : "incomplete"));
        if (whole)
            json_array_append_new(*conv, json_pack("{s:s,s:s,s:s,s:s}", "type", "function_call",
                                                   "call_id", id, "name", name, "arguments", args));
    }
    json_decref(msg);
    return out;
}

/* job_usage in the Responses API's names (kvserve's extensions kept as they are). */
static json_t *usage_json(const job *j) {
    json_t *u = job_usage(j);
    if (!u) return NULL;
    json_t *v =
        json_pack("{s:O,s:O,s:O,s:{s:i},s:O}", "input_tokens", json_object_get(u, "prompt_tokens"),
                  "input_tokens_details", json_object_get(u, "prompt_tokens_details"),
                  "output_tokens", json_object_get(u, "completion_tokens"), "output_tokens_details",
                  "reasoning_tokens", 0, "total_tokens", json_object_get(u, "total_tokens"));
    json_t *chunks = json_object_get(u, "kv_chunks");
    if (v && chunks) json_object_set(v, "kv_chunks", chunks);
    json_decref(u);
    return v;
}

/* The response object: status, output (taken), usage (taken, or NULL), error (or NULL). */
static json_t *response_json(const server *s, const resp_job *rj, const char *status,
                             json_t *output, json_t *usage, const api_error *error) {
    json_t *v = json_pack("{s:s,s:s,s:I,s:s,s:n,s:n,s:s}", "id", rj->id, "object", "response",
                          "created_at", (json_int_t)rj->created, "status", status, "error",
                          "incomplete_details", "model", s->model_ids[0]);
    if (!v || json_object_update(v, rj->echo)) {
        json_decref(v);
        json_decref(output);
        json_decref(usage);
        return NULL;
    }
    if (!strcmp(status, "incomplete"))
        json_object_set_new(v, "incomplete_details",
                            json_pack("{s:s}", "reason", "max_output_tokens"));
    if (error)
        json_object_set_new(v, "error",
                            json_pack("{s:s,s:s}", "code",
                                      error->code ? error->code : "server_error", "message",
                                      error->message));
    json_object_set_new(v, "output", output ? output : json_array());
    json_object_set_new(v, "usage", usage ? usage : json_null());
    return v;
}

/* ---------------------------------------------------------------- shared through Redis
 *
 * With --redis a stored response is also written to Redis (cache/store/redis_state.h, kind
 * "resp", the same namespace) before it is answered, so the next turn finds it on any instance:
 * a local miss reads it from there (and keeps it locally), a DELETE removes it from both and
 * leaves a tombstone that makes the other instances drop their copies when next asked. The
 * value: {"response": the object GET returns, "conversation": the canonical items}; one whose
 * response names another id, or whose parts are of the wrong types, is refused (a miss). */

static void shared_put(server *s, const cache_key *ns, const char *id, const json_t *response,
                       const json_t *conversation) {
    if (!s->shared) return;
    json_t *v = json_pack("{s:O,s:O}", "response", response, "conversation", conversation);
    char *text = v ? json_dumps(v, JSON_COMPACT) : NULL;
    json_decref(v);
    if (text && redis_state_put(s->shared, REDIS_STATE_RESPONSE, ns, id, text, strlen(text), 0))
        log_debug("responses: %s not shared (Redis unreachable, or over its bounds)", id);
    free(text);
}

/* The stored response (ns, id): copies of its object's and conversation's texts (either
 * pointer NULL: not wanted), from this instance, or else from Redis (then kept here for
 * tenant). */
static bool stored_get(server *s, int tenant, const cache_key *ns, const char *id, char **response,
                       char **conversation) {
    if (!s->responses) return false;
    if (resp_store_get(s->responses, ns, id, response, conversation)) {
        /* deleted on another instance: this copy goes too */
        if (!s->shared || redis_state_deleted(s->shared, REDIS_STATE_RESPONSE, ns, id) != 1)
            return true;
        resp_store_delete(s->responses, ns, id);
        if (response) free(*response), *response = NULL;
        if (conversation) free(*conversation), *conversation = NULL;
        return false;
    }
    char *text = NULL;
    size_t len = 0;
    if (!s->shared || redis_state_get(s->shared, REDIS_STATE_RESPONSE, ns, id, &text, &len) != 1)
        return false;
    json_t *v = json_loadb(text, len, 0, NULL);
    free(text);
    json_t *obj = json_object_get(v, "response"), *conv = json_object_get(v, "conversation");
    const char *claimed = json_string_value(json_object_get(obj, "id"));
    char *rt = NULL, *ct = NULL;
    bool ok = json_is_object(obj) && json_is_array(conv) && claimed && !strcmp(claimed, id) &&
              (rt = json_dumps(obj, JSON_COMPACT)) && (ct = json_dumps(conv, JSON_COMPACT)) &&
              resp_store_put(s->responses, tenant, ns, id, rt, ct) >= 0;
    if (!ok && v) log_warn("responses: the shared copy of %.128s is not a stored response", id);
    json_decref(v);
    if (ok && response) *response = rt, rt = NULL;
    if (ok && conversation) *conversation = ct, ct = NULL;
    free(rt);
    free(ct);
    return ok;
}

/* Removes (ns, id) here and from Redis: true when either held it. */
static bool stored_delete(server *s, const cache_key *ns, const char *id) {
    bool here = s->responses && resp_store_delete(s->responses, ns, id);
    bool shared = s->shared && redis_state_delete(s->shared, REDIS_STATE_RESPONSE, ns, id) == 1;
    return here || shared;
}

/* ---------------------------------------------------------------- the final object */

/* The finished job's response object, stored when asked (the conversation through this answer
 * goes with it; "store" says false when it could not be kept). NULL when out of memory. */
static json_t *response_final(job *j) {
    resp_job *rj = j->ext;
    json_t *conv_out = NULL;
    bool cut;
    json_t *output = output_items(j, rj, &conv_out, &cut);
    json_t *v =
        response_json(j->s, rj, cut ? "incomplete" : "completed", output, usage_json(j), NULL);
    if (!v || !rj->store) {
        json_decref(conv_out);
        return v;
    }
    json_t *conv = json_copy(rj->conversation);
    char *resp_text = json_dumps(v, JSON_COMPACT);
    char *conv_text =
        conv && !json_array_extend(conv, conv_out) ? json_dumps(conv, JSON_COMPACT) : NULL;
    int rc = resp_text && conv_text
                 ? resp_store_put(j->s->responses, j->tenant, &rj->ns, rj->id, resp_text, conv_text)
                 : -1;
    if (rc == 0) shared_put(j->s, &rj->ns, rj->id, v, conv);
    if (rc != 0) {
        log_warn("responses: %s not stored: %s", rj->id,
                 rc > 0 ? "larger than --responses-store-bytes" : "out of memory");
        json_object_set_new(v, "store", json_false());
    }
    free(resp_text);
    free(conv_text);
    json_decref(conv);
    json_decref(conv_out);
    return v;
}

/* ---------------------------------------------------------------- streaming */

/* Queues `event: TYPE` with data {"type": TYPE, fields..., "sequence_number": N} (fields
 * taken). */
static int event(job *j, const char *type, json_t *fields) {
    resp_job *rj = j->ext;
    json_t *v = json_pack("{s:s}", "type", type);
    if (v && fields && !json_object_update(v, fields) &&
        !json_object_set_new(v, "sequence_number", json_integer(rj->seq++))) {
        json_decref(fields);
        return job_sse_json(j, type, v);
    }
    json_decref(v);
    json_decref(fields);
    return -1;
}

/* Starts the open item's text afresh. -1 when out of memory. */
static int acc_begin(resp_job *rj) {
    if (rj->acc_f) fclose(rj->acc_f);
    free(rj->acc);
    rj->acc = NULL;
    rj->acc_len = 0;
    rj->acc_f = open_memstream(&rj->acc, &rj->acc_len);
    return rj->acc_f && fflush(rj->acc_f) == 0 ? 0 : -1;
}

static int acc_put(resp_job *rj, const char *s, size_t n) {
    return fwrite(s, 1, n, rj->acc_f) == n && fflush(rj->acc_f) == 0 ? 0 : -1;
}

static int resp_open(job *j) {
    resp_job *rj = j->ext;
    json_t *v = response_json(j->s, rj, "in_progress", NULL, NULL, NULL);
    if (!v || event(j, "response.created", json_pack("{s:O}", "response", v))) {
        json_decref(v);
        return -1;
    }
    return event(j, "response.in_progress", json_pack("{s:o}", "response", v)) ? -1 : 1;
}

static int open_message(job *j) {
    resp_job *rj = j->ext;
    char id[80];
    int index = rj->n_items++;
    item_id(rj, false, index, id, sizeof id);
    rj->open = ITEM_MESSAGE;
    if (acc_begin(rj) || event(j, "response.output_item.added",
                               json_pack("{s:i,s:{s:s,s:s,s:s,s:s,s:[]}}", "output_index", index,
                                         "item", "id", id, "type", "message", "status",
                                         "in_progress", "role", "assistant", "content")))
        return -1;
    return event(j, "response.content_part.added",
                 json_pack("{s:s,s:i,s:i,s:{s:s,s:s,s:[]}}", "item_id", id, "output_index", index,
                           "content_index", 0, "part", "type", "output_text", "text", "",
                           "annotations"));
}

/* Ends the item in progress (finish: the answer's, when it ends with it). */
static int close_item(job *j, const char *finish) {
    resp_job *rj = j->ext;
    int index = rj->n_items - 1, kind = rj->open;
    char id[80];
    item_id(rj, kind == ITEM_CALL, index, id, sizeof id);
    rj->open = 0;
    if (kind == ITEM_MESSAGE) {
        const char *status = finish && !strcmp(finish, "length") ? "incomplete" : "completed";
        if (event(j, "response.output_text.done",
                  json_pack("{s:s,s:i,s:i,s:s%,s:[]}", "item_id", id, "output_index", index,
                            "content_index", 0, "text", rj->acc, rj->acc_len, "logprobs")) ||
            event(j, "response.content_part.done",
                  json_pack("{s:s,s:i,s:i,s:{s:s,s:s%,s:[]}}", "item_id", id, "output_index", index,
                            "content_index", 0, "part", "type", "output_text", "text", rj->acc,
                            rj->acc_len, "annotations")))
            return -1;
        return event(j, "response.output_item.done",
                     json_pack("{s:i,s:o}", "output_index", index, "item",
                               message_item(rj, index, rj->acc, rj->acc_len, status)));
    }
    char call_id[48];
    job_call_id(j, 0, rj->call, call_id, sizeof call_id);
    const char *status = args_complete(rj->acc) ? "completed" : "incomplete";
    if (event(j, "response.function_call_arguments.done",
              json_pack("{s:s,s:i,s:s,s:s}", "item_id", id, "output_index", index, "name", rj->name,
                        "arguments", rj->acc)))
        return -1;
    return event(j, "response.output_item.done",
                 json_pack("{s:i,s:o}", "output_index", index, "item",
                           call_item(rj, index, call_id, rj->name, rj->acc, status)));
}

static int resp_text(job *j, int index, const char *s, size_t n, json_t *logprobs,
                     const char *finish) {
    (void)index;
    json_decref(logprobs); /* none asked for: the Responses API's come through include */
    resp_job *rj = j->ext;
    if (n > 0) {
        if (rj->open == ITEM_CALL && close_item(j, NULL)) return -1;
        if (rj->open != ITEM_MESSAGE && open_message(j)) return -1;
        char id[80];
        item_id(rj, false, rj->n_items - 1, id, sizeof id);
        if (acc_put(rj, s, n) ||
            event(j, "response.output_text.delta",
                  json_pack("{s:s,s:i,s:i,s:s%,s:[]}", "item_id", id, "output_index",
                            rj->n_items - 1, "content_index", 0, "delta", s, n, "logprobs")))
            return -1;
    }
    if (!finish) return 0;
    /* an empty answer is an empty message, as the whole response has it */
    if (rj->n_items == 0 && open_message(j)) return -1;
    return rj->open ? close_item(j, finish) : 0;
}

static int resp_call(job *j, int index, const chat_tool_event *ev) {
    (void)index;
    resp_job *rj = j->ext;
    char id[80];
    if (ev->kind == CHAT_TOOL_EVENT_ARGS) {
        item_id(rj, true, rj->n_items - 1, id, sizeof id);
        if (acc_put(rj, ev->s, ev->n)) return -1;
        return event(j, "response.function_call_arguments.delta",
                     json_pack("{s:s,s:i,s:s%}", "item_id", id, "output_index", rj->n_items - 1,
                               "delta", ev->s, ev->n));
    }
    if (rj->open && close_item(j, NULL)) return -1;
    int at = rj->n_items++;
    char call_id[48];
    job_call_id(j, 0, ev->index, call_id, sizeof call_id);
    item_id(rj, true, at, id, sizeof id);
    free(rj->name);
    if (!(rj->name = strndup(ev->s, ev->n))) return -1;
    rj->open = ITEM_CALL;
    rj->call = ev->index;
    if (acc_begin(rj)) return -1;
    return event(j, "response.output_item.added",
                 json_pack("{s:i,s:o}", "output_index", at, "item",
                           call_item(rj, at, call_id, rj->name, "", "in_progress")));
}

static int resp_close(job *j, const api_error *err) {
    resp_job *rj = j->ext;
    if (err) {
        json_t *v = response_json(j->s, rj, "failed", NULL, NULL, err);
        return v ? event(j, "response.failed", json_pack("{s:o}", "response", v)) : -1;
    }
    json_t *v = response_final(j);
    if (!v) return -1;
    const char *type = strcmp(json_string_value(json_object_get(v, "status")), "incomplete")
                           ? "response.completed"
                           : "response.incomplete";
    return event(j, type, json_pack("{s:o}", "response", v));
}

/* The whole response object. */
static void resp_reply(job *j, http_reply *out) {
    json_t *v = response_final(j);
    if (v)
        http_reply_json(out, 200, v);
    else
        http_reply_error(
            out, &(api_error){.status = 500, .type = "server_error", .message = "out of memory"});
}

static const job_format RESP_FORMAT = {resp_open,  resp_text,        resp_call,      resp_close,
                                       resp_reply, http_reply_error, "/v1/responses"};

/* ---------------------------------------------------------------- endpoints */

/* The job's Responses state: a new id, the request's settings, and the conversation before this
 * answer (prev's items, then the input). NULL with err (500) when out of memory, or when the
 * kernel gives no random bytes for the ids. */
static resp_job *resp_job_create(server *s, resp_request *r, const json_t *prev,
                                 const cache_key *ns, api_error *err) {
    resp_job *rj = calloc(1, sizeof *rj);
    uint8_t b[24];
    if (!rj || kv_random(b, sizeof b) || kv_random(rj->item_key, sizeof rj->item_key)) {
        if (rj)
            api_fail(err, 500, "server_error", NULL, NULL,
                     "no random bytes for the response's ids (getrandom: %s)", strerror(errno));
        else
            api_fail(err, 500, "server_error", NULL, NULL, "out of memory");
        free(rj);
        return NULL;
    }
    char hex[2 * sizeof b + 1];
    kv_hex_encode(b, sizeof b, hex);
    snprintf(rj->id, sizeof rj->id, "resp_%s", hex);
    rj->created = (long)time(NULL);
    rj->ns = *ns;
    rj->store = r->store && s->responses;
    rj->echo = json_incref(r->echo);
    rj->conversation = prev ? json_copy((json_t *)prev) : json_array();
    if (!rj->conversation || json_array_extend(rj->conversation, r->input) ||
        json_object_set_new(rj->echo, "store", json_boolean(rj->store))) {
        resp_job_free(rj);
        api_fail(err, 500, "server_error", NULL, NULL, "out of memory");
        return NULL;
    }
    return rj;
}

/* The chat request's parameter names, in the Responses API's words. */
static void rename_param(api_error *err) {
    static const char *const NAMES[][2] = {{"messages", "input"},
                                           {"max_tokens", "max_output_tokens"}};
    for (size_t i = 0; i < sizeof NAMES / sizeof NAMES[0]; i++)
        if (!strcmp(err->param, NAMES[i][0]))
            snprintf(err->param, sizeof err->param, "%s", NAMES[i][1]);
}

http_result responses_create(server *s, const http_call *c, http_out *out) {
    resp_request r;
    api_error err = {0};
    json_t *prev = NULL;
    job *j = NULL;
    cache_key ns;
    if (resp_parse(c->body, c->len, &r, &err)) goto fail;
    /* stored responses live in the KV cache's namespace: the key's, split by cache_salt */
    server_cache_namespace(s, c, r.rq.cache_salt, &ns);
    if (r.previous_response_id) {
        char *text = NULL;
        if (!stored_get(s, server_tenant(s, c), &ns, r.previous_response_id, NULL, &text)) {
            api_fail(&err, 400, "invalid_request_error", "previous_response_not_found",
                     "previous_response_id", "Previous response with id '%.128s' not found.",
                     r.previous_response_id);
            goto fail;
        }
        prev = json_loads(text, 0, NULL);
        free(text);
        if (!json_is_array(prev)) {
            api_fail(&err, 500, "server_error", NULL, NULL, "out of memory");
            goto fail;
        }
    }
    if (resp_conversation(&r, prev, &err)) goto fail;
    resp_job *rj = resp_job_create(s, &r, prev, &ns, &err);
    if (!rj) goto fail;
    if (!(j = job_start(s, &r.rq, c, true, &err))) {
        resp_job_free(rj);
        rename_param(&err);
        goto fail;
    }
    j->ext = rj;
    j->ext_free = resp_job_free;
    bool streaming = r.rq.stream;
    resp_request_free(&r);
    json_decref(prev);
    return job_answer(j, &RESP_FORMAT, streaming, out);
fail:
    resp_request_free(&r);
    json_decref(prev);
    http_reply_error(&out->reply, &err);
    if (err.status == 429) out->reply.retry_after = 1;
    return HTTP_REPLIED;
}

/* GET and DELETE /v1/responses/{id}, in the namespace of ?cache_salt= (the salt it was created
 * with). */
http_result responses_api(server *s, const http_call *c, http_out *o) {
    http_reply *out = &o->reply;
    const char *method = c->method, *id = c->tail;
    cache_key ns;
    server_cache_namespace(s, c, c->query_salt, &ns);
    bool del = strcmp(method, "DELETE") == 0;
    char *text = NULL;
    bool found = s->responses && !strchr(id, '/') &&
                 (del ? stored_delete(s, &ns, id)
                      : stored_get(s, server_tenant(s, c), &ns, id, &text, NULL));
    if (!found) {
        api_error err;
        if (strchr(id, '/'))
            api_fail(&err, 404, "invalid_request_error", "not_found", NULL,
                     "no endpoint %s /v1/responses/%.128s", method, id);
        else
            api_fail(&err, 404, "invalid_request_error", "not_found", NULL,
                     "Response with id '%.128s' not found.", id);
        http_reply_error(out, &err);
        return HTTP_REPLIED;
    }
    if (del) {
        http_reply_json(out, 200,
                        json_pack("{s:s,s:s,s:b}", "id", id, "object", "response", "deleted", 1));
        return HTTP_REPLIED;
    }
    http_reply_text(out, 200, "application/json", text, strlen(text));
    return HTTP_REPLIED;
}

void responses_metrics(const server *s, FILE *f) {
    resp_store_stats st = {0};
    if (s->responses) resp_store_stats_get(s->responses, &st);
    fprintf(
        f,
        "# HELP kvserve_responses_stored Responses API: stored responses held.\n"
        "# TYPE kvserve_responses_stored gauge\nkvserve_responses_stored %lld\n"
        "# HELP kvserve_responses_stored_bytes Responses API: bytes of stored responses held.\n"
        "# TYPE kvserve_responses_stored_bytes gauge\nkvserve_responses_stored_bytes %lld\n"
        "# HELP kvserve_responses_evicted_total Responses API: stored responses evicted over "
        "--responses-store or --responses-store-bytes.\n"
        "# TYPE kvserve_responses_evicted_total counter\nkvserve_responses_evicted_total %lld\n",
        (long long)st.count, (long long)st.bytes, (long long)st.evictions);
}
