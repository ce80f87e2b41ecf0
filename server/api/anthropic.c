/* Anthropic's Messages API over the engine (server/api/anthropic.h): a request runs as the chat job
 * the OpenAI endpoint would run (openai.c's job_start: template, tools, grammar, cache), and its
 * answer is given back as Anthropic's message, whole or as the named SSE events.
 *
 * Prompt caching. Each cache_control marker's prefix is located in the prompt's tokens (where
 * its block ends in the rendered prompt) and, once the prompt is computed (its chunks are in the
 * store by then), the records holding that prefix are leased in the chunk store for the marker's
 * ttl, in the request's namespace (the key's); a request with the same prefix refreshes the
 * lease, as Anthropic refreshes an entry it reads. Leases count against the key's share of the
 * pinned bytes (--tenant-pin-share): past it, that key's markers lease nothing new (and report
 * no cache creation) while other keys' still do. usage counts what the prompt reused
 * (cache_read_input_tokens: every cached token, marked or not), what the leases newly kept
 * (cache_creation_input_tokens: the marked prefix past what was read, as far as it could be
 * leased), and the rest (input_tokens).
 *
 * Streamed, the answer goes through the stream driver every API shares (stream.c) in this file's
 * format (ANTHROPIC_FORMAT): message_start once the prompt is computed (its usage is known
 * then), ping, then content_block_start / content_block_delta (text_delta, or input_json_delta
 * for a tool call's input) / content_block_stop per block, message_delta with the stop reason
 * and the usage, and message_stop. An error after the stream began is an error event. */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "server/api/anthropic.h"
#include "server/api/job.h"

/* The Messages state of a /v1/messages request's chat job (job.ext; the job has one prompt and
 * one choice, whose tool parser is the job's, tp[0]). */
typedef struct amsg {
    anthropic_marker markers[ANTHROPIC_MAX_MARKERS];
    int n_markers;
    int pos[ANTHROPIC_MAX_MARKERS]; /* the prompt tokens up to each marker's block's end */
    char id[40];                    /* msg_... */
    /* usage, fixed once the prompt is computed (leased) */
    bool leased;
    int read, creation, creation_1h;
    /* streaming */
    int n_blocks; /* content blocks begun */
    int open;     /* the open block: 0 none, 1 text, 2 tool_use */
} amsg;

static void reply_error(http_reply *out, const api_error *err) {
    char *s = anthropic_error_json(err);
    out->status = err->status;
    out->body = s;
    out->len = s ? strlen(s) : 0;
    out->content_type = "application/json";
    if (!s) http_reply_error(out, err); /* out of memory: whatever can be said */
    if (err->status == 429) out->retry_after = 1;
}

void anthropic_reply_error(http_reply *r) {
    json_error_t je;
    json_t *v = r->body && r->len ? json_loadb(r->body, r->len, 0, &je) : NULL;
    const char *type = json_string_value(json_object_get(v, "type"));
    if (!v || (type && !strcmp(type, "error"))) { /* Anthropic's already, or not JSON */
        json_decref(v);
        return;
    }
    api_error e = {.status = r->status};
    const char *m = json_string_value(json_object_get(json_object_get(v, "error"), "message"));
    snprintf(e.message, sizeof e.message, "%s", m ? m : "error");
    json_decref(v);
    char *s = anthropic_error_json(&e);
    if (!s) return;
    free(r->body);
    r->body = s;
    r->len = strlen(s);
}

/* ---------------------------------------------------------------- markers */

static size_t common_prefix(const char *a, const char *b) {
    size_t n = 0;
    while (a[n] && a[n] == b[n]) n++;
    return n;
}

static size_t common_suffix(const char *a, size_t la, const char *b, size_t lb) {
    size_t n = 0;
    while (n < la && n < lb && a[la - 1 - n] == b[lb - 1 - n]) n++;
    return n;
}

/* Where the conversation's message i ends in the rendered prompt full: how much of it the
 * rendering of messages 0..i alone (no generation prompt) shares. A template that moves text
 * around (Mistral's system message into the last user turn) shares less: the prefix stays a
 * prefix of the prompt, only shorter. */
static size_t message_end(const model *m, const api_request *rq, int i, const char *full) {
    bool tools = rq->tool_choice != CHAT_TOOL_NONE, add_bos;
    api_error err;
    char *part = job_render(m, rq->messages, i + 1, tools ? rq->tools : NULL,
                            tools ? rq->n_tools : 0, false, &add_bos, &err);
    size_t n = part ? common_prefix(full, part) : strlen(full);
    free(part);
    return n;
}

/* The byte of the rendered prompt full where marker k's prefix ends: the end of its text block
 * where the block's text is found in its message; else (a tool call or result, written in the
 * tool format, or text the template changed) the end of its message; for the tools, the end of
 * the tool list (where the renderings with and without tools agree again). */
static size_t marker_end(const model *m, const api_request *rq, const anthropic_marker *mk,
                         const char *full, size_t len) {
    bool tools = rq->tool_choice != CHAT_TOOL_NONE, add_bos;
    api_error err;
    if (mk->msg < 0) {
        if (!tools) return 0; /* tool_choice none: no tools in the prompt */
        char *bare = job_render(m, rq->messages, rq->n_messages, NULL, 0, true, &add_bos, &err);
        size_t end = bare ? len - common_suffix(full, len, bare, strlen(bare)) : len;
        free(bare);
        return end;
    }
    size_t end = message_end(m, rq, mk->msg, full);
    if (!mk->text) return end;
    size_t from = mk->msg > 0 ? message_end(m, rq, mk->msg - 1, full) : 0, n_hit;
    const char *c = rq->messages[mk->msg].content;
    const char *hit = from <= len ? job_find_part(full, len, from, c, mk->a, mk->e, &n_hit) : NULL;
    return hit ? (size_t)(hit - full) + n_hit : end;
}

/* pos[k]: the prompt tokens (ids[0..n)) up to marker k's end. Tokens that spell the text map
 * bytes to tokens exactly; otherwise the text up to there is tokenized again. */
static int marker_positions(const model *m, const anthropic_request *ar, const int32_t *ids, int n,
                            int *pos, api_error *err) {
    const api_request *rq = &ar->rq;
    bool tools = rq->tool_choice != CHAT_TOOL_NONE, add_bos;
    char *full = job_render(m, rq->messages, rq->n_messages, tools ? rq->tools : NULL,
                            tools ? rq->n_tools : 0, true, &add_bos, err);
    if (!full) return -1;
    size_t len = strlen(full);
    size_t *starts = malloc(sizeof *starts * (size_t)(n > 0 ? n : 1));
    bool exact = starts && tokenizer_token_starts(m->tok, ids, n, add_bos, full, len, starts);
    for (int k = 0; k < ar->n_markers; k++) {
        size_t end = marker_end(m, rq, &ar->markers[k], full, len);
        int t = 0;
        if (exact) {
            while (t < n && starts[t] < end) t++;
        } else if (end > 0) {
            int32_t *pre = NULL;
            kv_error ke = {{0}};
            t = tokenizer_encode(m->tok, full, end, add_bos, true, &pre, &ke);
            free(pre);
            if (t < 0) t = 0;
        }
        pos[k] = t < n ? t : n;
    }
    free(starts);
    free(full);
    return 0;
}

/* Once the prompt is computed: leases each marker's prefix and fixes the usage. */
static void amsg_lease(job *j) {
    amsg *a = j->ext;
    if (a->leased) return;
    a->leased = true;
    server *s = j->s;
    gen_request *r = j->reqs[0];
    pthread_mutex_lock(&r->mu);
    a->read = r->cached_tokens;
    pthread_mutex_unlock(&r->mu);
    if (!s->store || !r->plan.cache || !r->plan.keys || a->n_markers == 0) return;
    int bt = cache_store_layout(s->store)->block_tokens, kept = 0, kept_1h = 0;
    int64_t now = cache_store_now(s->store);
    for (int k = 0; k < a->n_markers; k++) {
        int blocks = a->pos[k] / bt;
        if (blocks > r->plan.n_keys) blocks = r->plan.n_keys;
        int held =
            cache_store_lease(s->store, j->tenant, r->plan.keys, blocks, now + a->markers[k].ttl) *
            bt;
        shared_pins_record(s, &r->plan.ns, r->plan.keys, held / bt, now + a->markers[k].ttl);
        if (held > kept) kept = held;
        if (a->markers[k].ttl == ANTHROPIC_TTL_1H && held > kept_1h) kept_1h = held;
    }
    a->creation = kept > a->read ? kept - a->read : 0;
    a->creation_1h = kept_1h > a->read ? kept_1h - a->read : 0;
}

static json_t *usage_json(const job *j, int output) {
    const amsg *a = j->ext;
    int input = j->prompt_tokens - a->read - a->creation;
    return json_pack("{s:i,s:i,s:i,s:i,s:{s:i,s:i},s:s}", "input_tokens", input > 0 ? input : 0,
                     "cache_creation_input_tokens", a->creation, "cache_read_input_tokens", a->read,
                     "output_tokens", output, "cache_creation", "ephemeral_5m_input_tokens",
                     a->creation - a->creation_1h, "ephemeral_1h_input_tokens", a->creation_1h,
                     "service_tier", "standard");
}

/* ---------------------------------------------------------------- the answer */

static void tool_use_id(const job *j, int call, char *out, size_t cap) {
    snprintf(out, cap, "toolu_%08x%04x", (unsigned)j->call_salt, (unsigned)call & 0xffff);
}

/* stop_reason (and *seq, the stop sequence that ended it, or NULL) of a finished answer, once
 * the job's tool parser has read all of it. */
static const char *stop_reason(const job *j, gen_finish f, int stop_string, const char **seq) {
    *seq = NULL;
    if (f == GEN_FINISH_LENGTH) return "max_tokens";
    gen_request *r = j->reqs[0];
    if (stop_string > 0 && stop_string <= r->stops.n) {
        *seq = r->stops.strs[stop_string - 1];
        return "stop_sequence";
    }
    const chat_tool_parser *tp = j->tools ? &j->tp[0] : NULL;
    if (tp && tp->mode == 2 && tp->complete && tp->n_calls > 0) return "tool_use";
    return "end_turn";
}

/* The whole reply's content as the answer's pieces build it: text blocks, and tool_use blocks
 * whose input gathers as "_args". */
typedef struct content_builder {
    const job *j;
    json_t *content;
} content_builder;

static int piece_block(void *ud, const chat_tool_event *ev) {
    const content_builder *b = ud;
    json_t *content = b->content, *last = json_array_get(content, json_array_size(content) - 1);
    const char *kind = json_string_value(json_object_get(last, "type"));
    if (ev->kind == CHAT_TOOL_EVENT_CALL) {
        char id[48];
        tool_use_id(b->j, ev->index, id, sizeof id);
        return json_array_append_new(content,
                                     json_pack("{s:s,s:s,s:s%,s:s}", "type", "tool_use", "id", id,
                                               "name", ev->s, ev->n, "_args", ""));
    }
    const char *key = ev->kind == CHAT_TOOL_EVENT_ARGS ? "_args" : "text";
    if (ev->kind == CHAT_TOOL_EVENT_CONTENT && !(kind && !strcmp(kind, "text")))
        return json_array_append_new(content,
                                     json_pack("{s:s,s:s%}", "type", "text", "text", ev->s, ev->n));
    if (!last) return 0;
    const char *was = json_string_value(json_object_get(last, key));
    size_t lw = was ? strlen(was) : 0;
    char *both = malloc(lw + ev->n + 1);
    if (!both) return -1;
    memcpy(both, was ? was : "", lw);
    memcpy(both + lw, ev->s, ev->n);
    int rc = json_object_set_new(last, key, json_stringn(both, lw + ev->n));
    free(both);
    return rc;
}

/* The tool_use blocks' gathered input as objects; a call cut short (max_tokens) is dropped. */
static void content_finish(json_t *content) {
    for (size_t i = json_array_size(content); i-- > 0;) {
        json_t *b = json_array_get(content, i);
        const char *args = json_string_value(json_object_get(b, "_args"));
        if (!args) continue;
        json_t *input = json_loads(args, 0, NULL);
        if (!json_is_object(input)) {
            json_decref(input);
            json_array_remove(content, i);
            continue;
        }
        json_object_set_new(b, "input", input);
        json_object_del(b, "_args");
    }
}

static json_t *message_json(const job *j, json_t *content, const char *stop, const char *seq,
                            int output) {
    const amsg *a = j->ext;
    return json_pack("{s:s,s:s,s:s,s:s,s:o,s:s?,s:s?,s:o}", "id", a->id, "type", "message", "role",
                     "assistant", "model", j->s->model_ids[0], "content", content, "stop_reason",
                     stop, "stop_sequence", seq, "usage", usage_json(j, output));
}

/* The whole reply, once the answer has finished: its text through the tool parser (as the
 * stream reads it, job_tool_events) with tools, else one text block. */
static void amsg_reply(job *j, http_reply *out) {
    amsg_lease(j);
    const gen_choice *c = &j->reqs[0]->choices[0];
    const char *text = c->text ? c->text : "";
    content_builder b = {.j = j, .content = json_array()};
    chat_tool_event all = {.kind = CHAT_TOOL_EVENT_CONTENT, .s = text, .n = c->len};
    int rc = j->tools     ? job_tool_events(&j->tp[0], text, c->len, c->finish, piece_block, &b)
             : c->len > 0 ? piece_block(&b, &all)
                          : 0;
    if (rc) {
        json_decref(b.content);
        api_error err;
        api_fail(&err, 500, "api_error", NULL, NULL, "out of memory");
        reply_error(out, &err);
        return;
    }
    content_finish(b.content);
    const char *seq, *stop = stop_reason(j, c->finish, c->stop_string, &seq);
    http_reply_json(out, 200, message_json(j, b.content, stop, seq, c->n_tokens));
}

/* ---------------------------------------------------------------- streaming (ANTHROPIC_FORMAT) */

static int block_stop(job *j) {
    amsg *a = j->ext;
    if (!a->open) return 0;
    a->open = 0;
    return job_sse_json(
        j, "content_block_stop",
        json_pack("{s:s,s:i}", "type", "content_block_stop", "index", a->n_blocks - 1));
}

static int block_start(job *j, int kind, json_t *block) {
    amsg *a = j->ext;
    if (block_stop(j)) {
        json_decref(block);
        return -1;
    }
    a->open = kind;
    return job_sse_json(j, "content_block_start",
                        json_pack("{s:s,s:i,s:o}", "type", "content_block_start", "index",
                                  a->n_blocks++, "content_block", block));
}

static int delta(job *j, json_t *d) {
    const amsg *a = j->ext;
    return job_sse_json(j, "content_block_delta",
                        json_pack("{s:s,s:i,s:o}", "type", "content_block_delta", "index",
                                  a->n_blocks - 1, "delta", d));
}

/* message_start and ping, once the prompt is computed (or the answer ended without a token). An
 * answer that failed by then opens with nothing: amsg_close sends the error. */
static int amsg_open(job *j) {
    gen_request *r = j->reqs[0];
    pthread_mutex_lock(&r->mu);
    bool ready = r->t_first_token || r->n_finished == r->n_choices;
    pthread_mutex_unlock(&r->mu);
    if (!ready) return 0;
    api_error err = {0};
    if (job_error(j, &err)) return 1;
    amsg_lease(j);
    json_t *m = message_json(j, json_array(), NULL, NULL, 0);
    if (job_sse_json(j, "message_start",
                     json_pack("{s:s,s:o}", "type", "message_start", "message", m)) ||
        job_sse_json(j, "ping", json_pack("{s:s}", "type", "ping")))
        return -1;
    return 1;
}

/* Text as text_delta events, in a text block begun unless one is open; the finish ends the
 * message in amsg_close. */
static int amsg_text(job *j, int index, const char *s, size_t n, json_t *logprobs,
                     const char *finish) {
    (void)index;
    json_decref(logprobs); /* none asked for: Anthropic's API has none */
    if (n == 0 && finish) return 0;
    const amsg *a = j->ext;
    if (a->open != 1 && block_start(j, 1, json_pack("{s:s,s:s}", "type", "text", "text", "")))
        return -1;
    return delta(j, json_pack("{s:s,s:s%}", "type", "text_delta", "text", s, n));
}

/* A call begins a tool_use block; its arguments are input_json_delta events. */
static int amsg_call(job *j, int index, const chat_tool_event *ev) {
    (void)index;
    if (ev->kind == CHAT_TOOL_EVENT_CALL) {
        char id[48];
        tool_use_id(j, ev->index, id, sizeof id);
        return block_start(j, 2,
                           json_pack("{s:s,s:s,s:s%,s:{}}", "type", "tool_use", "id", id, "name",
                                     ev->s, ev->n, "input"));
    }
    const amsg *a = j->ext;
    return a->open == 2 ? delta(j, json_pack("{s:s,s:s%}", "type", "input_json_delta",
                                             "partial_json", ev->s, ev->n))
                        : 0;
}

/* The open block's end, then message_delta with the stop reason and the usage, and
 * message_stop; or, after an error, the error event. */
static int amsg_close(job *j, const api_error *err) {
    if (err) {
        char *e = anthropic_error_json(err);
        int rc = block_stop(j) || job_sse_event(j, "error", e);
        free(e);
        return rc ? -1 : 0;
    }
    gen_request *r = j->reqs[0];
    pthread_mutex_lock(&r->mu);
    gen_finish f = r->choices[0].finish;
    int stop_string = r->choices[0].stop_string, output = r->choices[0].n_tokens;
    pthread_mutex_unlock(&r->mu);
    const char *seq, *stop = stop_reason(j, f, stop_string, &seq);
    if (block_stop(j)) return -1;
    json_t *d = json_pack("{s:s,s:{s:s,s:s?},s:o}", "type", "message_delta", "delta", "stop_reason",
                          stop, "stop_sequence", seq, "usage", usage_json(j, output));
    if (job_sse_json(j, "message_delta", d) ||
        job_sse_json(j, "message_stop", json_pack("{s:s}", "type", "message_stop")))
        return -1;
    return 0;
}

static const job_format ANTHROPIC_FORMAT = {amsg_open,  amsg_text,   amsg_call,     amsg_close,
                                            amsg_reply, reply_error, "/v1/messages"};

/* ---------------------------------------------------------------- endpoints */

http_result anthropic_messages(server *s, const http_call *c, http_out *out) {
    anthropic_request ar;
    api_error err = {0};
    job *j = NULL;
    if (anthropic_parse(c->body, c->len, false, &ar, &err)) goto fail;
    if (!(j = job_start(s, &ar.rq, c, true, &err))) goto fail;
    amsg *a = calloc(1, sizeof *a);
    if (!a) {
        api_fail(&err, 500, "api_error", NULL, NULL, "out of memory");
        goto fail;
    }
    j->ext = a;
    j->ext_free = free;
    gen_request *r = j->reqs[0];
    a->n_markers = ar.n_markers;
    memcpy(a->markers, ar.markers, sizeof ar.markers);
    if (marker_positions(s->m, &ar, r->prompt, r->n_prompt, a->pos, &err)) goto fail;
    /* the job's random id, as Anthropic's: msg_... */
    snprintf(a->id, sizeof a->id, "msg_%s", strchr(j->id, '-') + 1);
    bool streaming = ar.rq.stream;
    anthropic_request_free(&ar);
    return job_answer(j, &ANTHROPIC_FORMAT, streaming, out);
fail:
    anthropic_request_free(&ar);
    job_free(j);
    reply_error(&out->reply, &err);
    return HTTP_REPLIED;
}

/* {"input_tokens": N}: the prompt's tokens as /v1/messages would compute them (tools included).
 * The count may pass the context's limit, not the text it is counted on: a rendered prompt over
 * server_text_limit (which cannot fit) is a 400, before it is tokenized. */
http_result anthropic_count_tokens(server *s, const http_call *c, http_out *o) {
    http_reply *out = &o->reply;
    anthropic_request ar;
    api_error err = {0};
    if (anthropic_parse(c->body, c->len, true, &ar, &err) ||
        job_model_check(s, ar.rq.model, &err)) {
        anthropic_request_free(&ar);
        reply_error(out, &err);
        return HTTP_REPLIED;
    }
    const api_request *rq = &ar.rq;
    bool tools = rq->tool_choice != CHAT_TOOL_NONE, add_bos;
    char *text = job_render(s->m, rq->messages, rq->n_messages, tools ? rq->tools : NULL,
                            tools ? rq->n_tools : 0, true, &add_bos, &err);
    int32_t *ids = NULL;
    kv_error ke = {{0}};
    size_t len = text ? strlen(text) : 0;
    bool fits = text && server_check_text(s, len, "messages", &err) == 0;
    int n = fits ? tokenizer_encode(s->m->tok, text, len, add_bos, true, &ids, &ke) : -1;
    if (fits && n < 0) api_fail(&err, 400, "invalid_request_error", NULL, "messages", "%s", ke.msg);
    free(ids);
    free(text);
    anthropic_request_free(&ar);
    if (n < 0)
        reply_error(out, &err);
    else
        http_reply_json(out, 200, json_pack("{s:i}", "input_tokens", n));
    return HTTP_REPLIED;
}
