/* Anthropic's Messages API, the request side (server/api/anthropic.h): a body validated field by
 * field into the chat request the engine runs, and the cache_control markers beside it.
 *
 * Ranges and rules follow Anthropic's API reference: max_tokens >= 1 (required), temperature
 * [0, 1], top_p [0, 1], top_k >= 0, roles user and assistant, content a string or blocks, a
 * tool_result answering a tool_use of the message before by its id (and coming first in its
 * message), up to 4 cache_control blocks with a "1h" one never after a "5m" one. Where
 * Anthropic refuses a field it does not know ("Extra inputs are not permitted"), so do we. */
#include <jansson.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/api/anthropic.h"
#include "server/api/api_impl.h"

#define PATH 64         /* bytes of a field's path ("messages.12.content.3.cache_control.ttl") */
#define TEXT_SEP "\n\n" /* between the text blocks of one message */

/* A 400 naming the field as Anthropic does: "path: what is wrong". */
static int bad(api_error *err, const char *path, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int bad(api_error *err, const char *path, const char *fmt, ...) {
    char what[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    return api_fail(err, 400, "invalid_request_error", NULL, path, "%s: %s", path, what);
}

static int oom(api_error *err) {
    return api_fail(err, 500, "server_error", NULL, NULL, "out of memory");
}

/* Writes a field's path into out (PATH bytes: a deeper one is cut, as it only names the field
 * in a message). */
static void path_fmt(char *out, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void path_fmt(char *out, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(out, PATH, fmt, ap);
    va_end(ap);
}

/* path.key, or key at the top level. */
static void sub(char *out, const char *path, const char *key) {
    path_fmt(out, "%s%s%s", path, *path ? "." : "", key);
}

static void sub_i(char *out, const char *path, const char *key, size_t i) {
    path_fmt(out, "%s%s%s.%zu", path, *path ? "." : "", key, i);
}

/* Refuses a key of obj that allowed (NULL-terminated) lacks, in Anthropic's words. */
static int only_keys(const json_t *obj, const char *path, const char *const *allowed,
                     api_error *err) {
    const char *key;
    const json_t *v;
    json_object_foreach((json_t *)obj, key, v) {
        int k = 0;
        while (allowed[k] && strcmp(allowed[k], key) != 0) k++;
        if (allowed[k]) continue;
        char p[PATH];
        path_fmt(p, "%s%s%.40s", path, *path ? "." : "", key);
        return bad(err, p, "Extra inputs are not permitted");
    }
    return 0;
}

/* A string field that must be one of values (NULL-terminated); its index, or -1 with err. */
static int one_of(const json_t *v, const char *path, const char *const *values, api_error *err) {
    if (!json_is_string(v)) return api_type_error(err, path, "a string", v);
    for (int k = 0; values[k]; k++)
        if (!strcmp(json_string_value(v), values[k])) return k;
    char list[160] = "";
    size_t used = 0;
    for (int k = 0; values[k] && used < sizeof list; k++)
        used +=
            (size_t)snprintf(list + used, sizeof list - used, "%s'%s'", k ? ", " : "", values[k]);
    return bad(err, path, "Input should be %s, got '%.40s'", list, json_string_value(v));
}

/* ---------------------------------------------------------------- the parse */

typedef struct parse_ctx {
    anthropic_request *out;
    api_request *rq;
    int cap_msgs;
    /* per chat message: the Anthropic message it came from (-1: system) and, for a tool
     * message, the tool_result block; for the turn errors' paths */
    int *src_msg, *src_block;
    api_error *err;
} parse_ctx;

/* A new chat message of role (its strings to be filled), or NULL with err. */
static chat_message *msg_add(parse_ctx *c, const char *role, int src, int block) {
    api_request *rq = c->rq;
    if (rq->n_messages == c->cap_msgs) { /* sized by the caller: cannot happen */
        api_fail(c->err, 500, "server_error", NULL, NULL, "too many messages");
        return NULL;
    }
    chat_message *m = &rq->messages[rq->n_messages];
    if (!(m->role = strdup(role))) {
        oom(c->err);
        return NULL;
    }
    c->src_msg[rq->n_messages] = src;
    c->src_block[rq->n_messages] = block;
    rq->n_messages++;
    return m;
}

/* cache_control on the block at path (in chat message msg; a text block: content[a..e)). */
static int parse_cache_control(parse_ctx *c, const json_t *cc, const char *path, int msg, bool text,
                               size_t a, size_t e) {
    char p[PATH];
    sub(p, path, "cache_control");
    if (!json_is_object(cc)) return api_type_error(c->err, p, "an object", cc);
    static const char *const keys[] = {"type", "ttl", NULL};
    if (only_keys(cc, p, keys, c->err)) return -1;
    char pp[PATH];
    sub(pp, p, "type");
    static const char *const types[] = {"ephemeral", NULL};
    const json_t *type = json_object_get(cc, "type");
    if (!type) return bad(c->err, pp, "Field required");
    if (one_of(type, pp, types, c->err) < 0) return -1;
    int ttl = ANTHROPIC_TTL_5M;
    const json_t *t = api_field(cc, "ttl");
    if (t) {
        sub(pp, p, "ttl");
        static const char *const ttls[] = {"5m", "1h", NULL};
        int k = one_of(t, pp, ttls, c->err);
        if (k < 0) return -1;
        ttl = k ? ANTHROPIC_TTL_1H : ANTHROPIC_TTL_5M;
    }
    anthropic_request *r = c->out;
    if (r->n_markers == ANTHROPIC_MAX_MARKERS)
        return bad(c->err, p,
                   "A maximum of %d blocks with cache_control may be provided. Found %d.",
                   ANTHROPIC_MAX_MARKERS, ANTHROPIC_MAX_MARKERS + 1);
    /* Markers come in prompt order (tools, system, messages): a longer-lived prefix inside a
     * shorter-lived one could not outlive it. */
    if (ttl == ANTHROPIC_TTL_1H && r->n_markers > 0 &&
        r->markers[r->n_markers - 1].ttl == ANTHROPIC_TTL_5M)
        return bad(c->err, p,
                   "a ttl='1h' cache_control block must not come after a ttl='5m' one (%s)",
                   r->markers[r->n_markers - 1].param);
    anthropic_marker *m = &r->markers[r->n_markers++];
    *m = (anthropic_marker){.msg = msg, .text = text, .a = a, .e = e, .ttl = ttl};
    snprintf(m->param, sizeof m->param, "%s", p);
    return 0;
}

/* Text collected from blocks into one message's content. */
typedef struct text_acc {
    char *s;
    size_t len;
    size_t *ends; /* each block's end */
    int n;
} text_acc;

static int acc_add(text_acc *t, const char *s, size_t n, size_t *a, size_t *e) {
    size_t sep = t->n ? strlen(TEXT_SEP) : 0;
    char *grown = realloc(t->s, t->len + sep + n + 1);
    size_t *ends = realloc(t->ends, sizeof *ends * (size_t)(t->n + 1));
    if (grown) t->s = grown;
    if (ends) t->ends = ends;
    if (!grown || !ends) return -1;
    memcpy(t->s + t->len, TEXT_SEP, sep);
    memcpy(t->s + t->len + sep, s, n);
    *a = t->len + sep;
    t->len += sep + n;
    *e = t->len;
    t->s[t->len] = '\0';
    t->ends[t->n++] = t->len;
    return 0;
}

static void acc_free(text_acc *t) {
    free(t->s);
    free(t->ends);
    *t = (text_acc){0};
}

/* Moves t into m's content (and its parts' ends, when several). */
static void acc_give(text_acc *t, chat_message *m) {
    m->content = t->s;
    if (t->n > 1) {
        m->part_ends = t->ends;
        m->n_parts = t->n;
    } else {
        free(t->ends);
    }
    *t = (text_acc){0};
}

/* A text block's text (checked non-empty, as Anthropic requires). */
static const json_t *block_text(const json_t *b, const char *path, api_error *err) {
    static const char *const keys[] = {"type", "text", "cache_control", "citations", NULL};
    if (only_keys(b, path, keys, err)) return NULL;
    char p[PATH];
    sub(p, path, "citations");
    const json_t *cit = api_field(b, "citations");
    if (cit && !(json_is_array(cit) && json_array_size(cit) == 0)) {
        bad(err, p, "citations are not supported by this server");
        return NULL;
    }
    sub(p, path, "text");
    const json_t *text = json_object_get(b, "text");
    if (!text) {
        bad(err, p, "Field required");
        return NULL;
    }
    if (!json_is_string(text)) {
        api_type_error(err, p, "a string", text);
        return NULL;
    }
    if (json_string_length(text) == 0) {
        bad(err, path, "text content blocks must be non-empty");
        return NULL;
    }
    if (memchr(json_string_value(text), '\0', json_string_length(text))) {
        bad(err, p, "must not contain NUL characters (\\u0000)");
        return NULL;
    }
    return text;
}

/* The block's type, checked to be a string (NULL with err). */
static const char *block_type(const json_t *b, const char *path, api_error *err) {
    if (!json_is_object(b)) {
        api_type_error(err, path, "an object", b);
        return NULL;
    }
    char p[PATH];
    sub(p, path, "type");
    const json_t *t = json_object_get(b, "type");
    if (!t) {
        bad(err, p, "Field required");
        return NULL;
    }
    if (!json_is_string(t)) {
        api_type_error(err, p, "a string", t);
        return NULL;
    }
    return json_string_value(t);
}

/* The 400 for a block type this server does not take (Anthropic's other block types). */
static int unsupported_block(const char *type, const char *path, api_error *err) {
    char p[PATH];
    sub(p, path, "type");
    if (!strcmp(type, "image") || !strcmp(type, "document"))
        return bad(err, p, "%s blocks are not supported by this server (the model reads text only)",
                   type);
    if (!strcmp(type, "thinking") || !strcmp(type, "redacted_thinking"))
        return bad(err, p, "%s blocks are not supported by this server (no extended thinking)",
                   type);
    return bad(err, p, "content blocks of type '%.40s' are not supported by this server", type);
}

/* A tool_result's content: a string, or text blocks (joined), or absent (an empty result). */
static int tool_result_text(const json_t *content, const char *path, char **out, api_error *err) {
    char p[PATH];
    sub(p, path, "content");
    if (!content) return (*out = strdup("")) ? 0 : oom(err);
    if (json_is_string(content)) return api_str_copy(content, p, out, err);
    if (!json_is_array(content))
        return api_type_error(err, p, "a string or an array of content blocks", content);
    text_acc t = {0};
    size_t i, a, e;
    const json_t *b;
    json_array_foreach(content, i, b) {
        char bp[PATH];
        path_fmt(bp, "%s.%zu", p, i);
        const char *type = block_type(b, bp, err);
        const json_t *text = NULL;
        if (!type || (strcmp(type, "text") != 0 && unsupported_block(type, bp, err)) ||
            !(text = block_text(b, bp, err)) ||
            (api_field(b, "cache_control") &&
             bad(err, bp, "cache_control goes on the tool_result block, not inside its content"))) {
            acc_free(&t);
            return -1;
        }
        if (acc_add(&t, json_string_value(text), json_string_length(text), &a, &e)) {
            acc_free(&t);
            return oom(err);
        }
    }
    free(t.ends);
    *out = t.s ? t.s : strdup("");
    return *out ? 0 : oom(err);
}

/* A text block at path into t (and its cache_control's marker, in chat message msg). */
static int text_block(parse_ctx *c, const json_t *b, const char *path, text_acc *t, int msg) {
    const json_t *text = block_text(b, path, c->err), *cc = api_field(b, "cache_control");
    size_t a, e;
    if (!text) return -1;
    if (acc_add(t, json_string_value(text), json_string_length(text), &a, &e)) return oom(c->err);
    return cc ? parse_cache_control(c, cc, path, msg, true, a, e) : 0;
}

/* A block other than text of a message's content (j: its index, at path; t: the message's text
 * so far); ud is the role's. */
typedef int (*block_fn)(parse_ctx *c, const json_t *b, const char *path, const char *type, size_t j,
                        const text_acc *t, void *ud);

/* Walks a message's content: text blocks go into t (their markers in chat message text_msg),
 * the others to other. */
static int each_block(parse_ctx *c, const json_t *content, const char *path, text_acc *t,
                      int text_msg, block_fn other, void *ud) {
    size_t j;
    const json_t *b;
    json_array_foreach(content, j, b) {
        char bp[PATH];
        path_fmt(bp, "%s.%zu", path, j);
        const char *type = block_type(b, bp, c->err);
        if (!type) return -1;
        if (!strcmp(type, "text") ? text_block(c, b, bp, t, text_msg)
                                  : other(c, b, bp, type, j, t, ud))
            return -1;
    }
    return 0;
}

typedef struct user_msg {
    int i;         /* the Anthropic message */
    int n_results; /* its tool_result blocks */
} user_msg;

/* A user message's tool_result block: a tool message (before any text, as Anthropic requires). */
static int user_block(parse_ctx *c, const json_t *b, const char *bp, const char *type, size_t j,
                      const text_acc *t, void *ud) {
    user_msg *u = ud;
    char p[PATH];
    if (!strcmp(type, "tool_use")) {
        sub(p, bp, "type");
        return bad(c->err, p, "tool_use blocks are an assistant's: not allowed in a user message");
    }
    if (strcmp(type, "tool_result") != 0) return unsupported_block(type, bp, c->err);
    if (t->n > 0)
        return bad(c->err, bp,
                   "tool_result blocks must come first in a user message's content, before any "
                   "text");
    static const char *const keys[] = {"type",     "tool_use_id",   "content",
                                       "is_error", "cache_control", NULL};
    if (only_keys(b, bp, keys, c->err)) return -1;
    chat_message *m = msg_add(c, "tool", u->i, (int)j);
    if (!m) return -1;
    u->n_results++;
    sub(p, bp, "tool_use_id");
    const json_t *id = json_object_get(b, "tool_use_id");
    if (!id) return bad(c->err, p, "Field required");
    if (api_str_copy(id, p, (char **)&m->tool_call_id, c->err)) return -1;
    char *text = NULL;
    bool is_error = false;
    if (tool_result_text(api_field(b, "content"), bp, &text, c->err)) return -1;
    if (api_opt_bool(b, "is_error", &is_error, c->err) < 0) {
        free(text);
        return -1;
    }
    /* The tool formats have no error flag: the result says so in words. */
    if (is_error) {
        char *both = malloc(strlen(text) + 8);
        if (both) snprintf(both, strlen(text) + 8, "Error: %s", text);
        free(text);
        if (!(text = both)) return oom(c->err);
    }
    m->content = text;
    const json_t *cc = api_field(b, "cache_control");
    return cc ? parse_cache_control(c, cc, bp, c->rq->n_messages - 1, false, 0, 0) : 0;
}

/* A user message: its tool_result blocks as tool messages, first, then its text blocks as one
 * user message. */
static int parse_user_blocks(parse_ctx *c, const json_t *content, int i, const char *path) {
    text_acc t = {0};
    user_msg u = {.i = i};
    /* markers on text blocks wait for the user message's index (after the tool messages) */
    int first_marker = c->out->n_markers, rc = -1;
    if (each_block(c, content, path, &t, -1, user_block, &u)) goto done;
    if (t.n > 0) {
        chat_message *m = msg_add(c, "user", i, -1);
        if (!m) goto done;
        acc_give(&t, m);
        for (int k = first_marker; k < c->out->n_markers; k++)
            if (c->out->markers[k].msg < 0 && c->out->markers[k].text)
                c->out->markers[k].msg = c->rq->n_messages - 1;
    } else if (u.n_results == 0) {
        bad(c->err, path, "the content must not be empty");
        goto done;
    }
    rc = 0;
done:
    acc_free(&t);
    return rc;
}

/* An assistant message's tool_use block: a call of the message (ud, the chat message). */
static int assistant_block(parse_ctx *c, const json_t *b, const char *bp, const char *type,
                           size_t j, const text_acc *t, void *ud) {
    (void)j;
    (void)t;
    chat_message *m = ud;
    char p[PATH];
    if (!strcmp(type, "tool_result")) {
        sub(p, bp, "type");
        return bad(c->err, p,
                   "tool_result blocks are a user's: not allowed in an assistant message");
    }
    if (strcmp(type, "tool_use") != 0) return unsupported_block(type, bp, c->err);
    static const char *const keys[] = {"type", "id", "name", "input", "cache_control", NULL};
    if (only_keys(b, bp, keys, c->err)) return -1;
    chat_tool_call *tc = (chat_tool_call *)&m->tool_calls[m->n_tool_calls++];
    sub(p, bp, "id");
    const json_t *id = json_object_get(b, "id");
    if (!id) return bad(c->err, p, "Field required");
    if (api_str_copy(id, p, (char **)&tc->id, c->err)) return -1;
    sub(p, bp, "name");
    const json_t *name = json_object_get(b, "name");
    if (!json_is_string(name) ||
        !api_tool_name_ok(json_string_value(name), json_string_length(name)))
        return bad(c->err, p, "String should match pattern '^[a-zA-Z0-9_-]{1,64}$'");
    if (api_str_copy(name, p, (char **)&tc->name, c->err)) return -1;
    sub(p, bp, "input");
    const json_t *input = json_object_get(b, "input");
    if (!json_is_object(input)) return api_type_error(c->err, p, "an object", input);
    if (!(tc->arguments = json_dumps(input, JSON_COMPACT))) return oom(c->err);
    const json_t *cc = api_field(b, "cache_control");
    return cc ? parse_cache_control(c, cc, bp, (int)(m - c->rq->messages), false, 0, 0) : 0;
}

/* An assistant message: text blocks as its content, tool_use blocks as its calls. */
static int parse_assistant_blocks(parse_ctx *c, const json_t *content, int i, const char *path) {
    size_t n = json_array_size(content);
    chat_message *m = msg_add(c, "assistant", i, -1);
    if (!m) return -1;
    if (!(m->tool_calls = calloc(n ? n : 1, sizeof *m->tool_calls))) return oom(c->err);
    text_acc t = {0};
    int rc = -1;
    if (each_block(c, content, path, &t, c->rq->n_messages - 1, assistant_block, m)) goto done;
    if (t.n == 0 && m->n_tool_calls == 0) {
        bad(c->err, path, "the content must not be empty");
        goto done;
    }
    if (t.n > 0)
        acc_give(&t, m);
    else if (!(m->content = strdup(""))) {
        oom(c->err);
        goto done;
    }
    rc = 0;
done:
    acc_free(&t);
    return rc;
}

static int parse_message(parse_ctx *c, const json_t *msg, int i, bool last) {
    char path[PATH], p[PATH];
    path_fmt(path, "messages.%d", i);
    if (!json_is_object(msg)) return api_type_error(c->err, path, "an object", msg);
    static const char *const keys[] = {"role", "content", NULL};
    if (only_keys(msg, path, keys, c->err)) return -1;
    sub(p, path, "role");
    static const char *const roles[] = {"user", "assistant", NULL};
    const json_t *role = json_object_get(msg, "role");
    if (!role) return bad(c->err, p, "Field required");
    int r = one_of(role, p, roles, c->err);
    if (r < 0) return -1;
    if (r == 1 && last)
        return bad(c->err, p,
                   "a final assistant message (a prefill the answer continues) is not supported "
                   "by this server");
    sub(p, path, "content");
    const json_t *content = json_object_get(msg, "content");
    if (!content) return bad(c->err, p, "Field required");
    if (json_is_string(content)) {
        if (json_string_length(content) == 0)
            return bad(c->err, p, "text content must be non-empty");
        chat_message *m = msg_add(c, roles[r], i, -1);
        if (!m) return -1;
        return api_str_copy(content, p, (char **)&m->content, c->err);
    }
    if (!json_is_array(content))
        return api_type_error(c->err, p, "a string or an array of content blocks", content);
    if (json_array_size(content) == 0) return bad(c->err, p, "the content must not be empty");
    return r == 0 ? parse_user_blocks(c, content, i, p) : parse_assistant_blocks(c, content, i, p);
}

/* system: a string, or text blocks (each may carry cache_control). */
static int parse_system(parse_ctx *c, const json_t *sys) {
    if (json_is_string(sys)) {
        if (json_string_length(sys) == 0) return 0; /* as absent */
        chat_message *m = msg_add(c, "system", -1, -1);
        return m ? api_str_copy(sys, "system", (char **)&m->content, c->err) : -1;
    }
    if (!json_is_array(sys))
        return api_type_error(c->err, "system", "a string or text blocks", sys);
    if (json_array_size(sys) == 0) return 0;
    chat_message *m = msg_add(c, "system", -1, -1);
    if (!m) return -1;
    text_acc t = {0};
    size_t j;
    const json_t *b;
    json_array_foreach(sys, j, b) {
        char bp[PATH];
        path_fmt(bp, "system.%zu", j);
        const char *type = block_type(b, bp, c->err);
        if (!type || (strcmp(type, "text") != 0 && unsupported_block(type, bp, c->err)) ||
            text_block(c, b, bp, &t, c->rq->n_messages - 1))
            goto fail;
    }
    acc_give(&t, m);
    return 0;
fail:
    acc_free(&t);
    return -1;
}

static int parse_tools(parse_ctx *c, const json_t *tools) {
    api_request *rq = c->rq;
    if (!json_is_array(tools)) return api_type_error(c->err, "tools", "an array", tools);
    size_t n = json_array_size(tools);
    if (n > API_MAX_TOOLS)
        return bad(c->err, "tools", "%zu tools, more than this server's limit of %d", n,
                   API_MAX_TOOLS);
    if (n > 0 && !(rq->tools = calloc(n, sizeof *rq->tools))) return oom(c->err);
    for (size_t i = 0; i < n; i++) {
        const json_t *t = json_array_get(tools, i);
        char tp[PATH], p[PATH];
        sub_i(tp, "", "tools", i);
        if (!json_is_object(t)) return api_type_error(c->err, tp, "an object", t);
        const json_t *type = api_field(t, "type");
        sub(p, tp, "type");
        if (type && !(json_is_string(type) && !strcmp(json_string_value(type), "custom"))) {
            if (!json_is_string(type)) return api_type_error(c->err, p, "a string", type);
            return bad(c->err, p,
                       "server tool '%.40s' is not supported by this server (client tools only: "
                       "name, description, input_schema)",
                       json_string_value(type));
        }
        static const char *const keys[] = {"type",         "name",          "description",
                                           "input_schema", "cache_control", NULL};
        if (only_keys(t, tp, keys, c->err)) return -1;
        chat_tool *ct = &rq->tools[i];
        rq->n_tools = (int)i + 1;
        sub(p, tp, "name");
        const json_t *name = json_object_get(t, "name");
        if (!name) return bad(c->err, p, "Field required");
        if (!json_is_string(name) ||
            !api_tool_name_ok(json_string_value(name), json_string_length(name)))
            return bad(c->err, p, "String should match pattern '^[a-zA-Z0-9_-]{1,64}$'");
        for (size_t k = 0; k < i; k++)
            if (!strcmp(rq->tools[k].name, json_string_value(name)))
                return bad(c->err, p, "Tool names must be unique: '%s' is given twice",
                           json_string_value(name));
        if (api_str_copy(name, p, (char **)&ct->name, c->err)) return -1;
        sub(p, tp, "description");
        const json_t *desc = api_field(t, "description");
        if (desc && api_str_copy(desc, p, (char **)&ct->description, c->err)) return -1;
        sub(p, tp, "input_schema");
        const json_t *schema = json_object_get(t, "input_schema");
        if (!schema) return bad(c->err, p, "Field required");
        if (api_tool_schema(schema, p, (char **)&ct->parameters, c->err)) return -1;
        const json_t *cc = api_field(t, "cache_control");
        if (cc && parse_cache_control(c, cc, tp, -1, false, 0, 0)) return -1;
    }
    return 0;
}

/* tool_choice: {"type": "auto" | "any" | "tool" | "none", "name", "disable_parallel_tool_use"}. */
static int parse_tool_choice(parse_ctx *c, const json_t *tc) {
    api_request *rq = c->rq;
    rq->tool_choice = rq->n_tools > 0 ? CHAT_TOOL_AUTO : CHAT_TOOL_NONE;
    rq->parallel_tool_calls = true;
    if (!tc) return 0;
    if (!json_is_object(tc)) return api_type_error(c->err, "tool_choice", "an object", tc);
    static const char *const keys[] = {"type", "name", "disable_parallel_tool_use", NULL};
    if (only_keys(tc, "tool_choice", keys, c->err)) return -1;
    static const char *const types[] = {"auto", "any", "tool", "none", NULL};
    const json_t *type = json_object_get(tc, "type");
    if (!type) return bad(c->err, "tool_choice.type", "Field required");
    int k = one_of(type, "tool_choice.type", types, c->err);
    if (k < 0) return -1;
    bool no_parallel = false;
    if (api_opt_bool(tc, "disable_parallel_tool_use", &no_parallel, c->err) < 0) {
        snprintf(c->err->param, sizeof c->err->param, "tool_choice.disable_parallel_tool_use");
        return -1;
    }
    rq->parallel_tool_calls = !no_parallel;
    const json_t *name = api_field(tc, "name");
    if (name && k != 2)
        return bad(c->err, "tool_choice.name", "only a tool_choice of type 'tool' names a tool");
    if (k == 3) {
        rq->tool_choice = CHAT_TOOL_NONE;
        return 0;
    }
    if (k == 0) return 0;
    if (rq->n_tools == 0)
        return bad(c->err, "tool_choice.type", "tool_choice '%s' needs tools", types[k]);
    if (k == 1) {
        rq->tool_choice = CHAT_TOOL_REQUIRED;
        return 0;
    }
    if (!name) return bad(c->err, "tool_choice.name", "Field required");
    if (api_str_copy(name, "tool_choice.name", &rq->tool_choice_name, c->err)) return -1;
    for (int i = 0; i < rq->n_tools; i++)
        if (!strcmp(rq->tools[i].name, rq->tool_choice_name)) {
            rq->tool_choice = CHAT_TOOL_NAMED;
            return 0;
        }
    return bad(c->err, "tool_choice.name", "no tool is named '%.64s'", rq->tool_choice_name);
}

/* The tool turns (chat_check_tool_turns), in Anthropic's words and paths. */
static int check_turns(parse_ctx *c) {
    const chat_message *msgs = c->rq->messages;
    int n = c->rq->n_messages;
    chat_turn_check t;
    if (chat_check_tool_turns(msgs, n, &t) == CHAT_TURNS_OK) return 0;
    char p[PATH];
    path_fmt(p, "messages.%d.content.%d", c->src_msg[t.msg], c->src_block[t.msg]);
    const char *id = msgs[t.msg].tool_call_id ? msgs[t.msg].tool_call_id : "";
    switch (t.problem) {
    case CHAT_TURNS_RESULT_WITHOUT_CALLS:
    case CHAT_TURNS_UNKNOWN_ID:
        return bad(c->err, p,
                   "unexpected `tool_use_id` found in `tool_result` blocks: %.64s. Each "
                   "`tool_result` block must have a corresponding `tool_use` block in the "
                   "previous message.",
                   id);
    case CHAT_TURNS_ANSWERED_TWICE:
        return bad(c->err, p, "`tool_use_id` %.64s is answered twice in the `tool_result` blocks",
                   id);
    default: {
        char ids[256];
        chat_unanswered_ids(msgs, n, t.msg, t.call, ids, sizeof ids);
        path_fmt(p, "messages.%d", c->src_msg[t.msg]);
        return bad(c->err, p,
                   "`tool_use` ids were found without `tool_result` blocks immediately after: "
                   "%s. Each `tool_use` block must have a corresponding `tool_result` block in "
                   "the next message.",
                   ids);
    }
    }
}

/* The sampling and output fields of a /v1/messages body. */
static int parse_generation(parse_ctx *c, const json_t *root) {
    api_request *rq = c->rq;
    const json_t *mt = json_object_get(root, "max_tokens");
    if (!mt || json_is_null(mt)) return bad(c->err, "max_tokens", "Field required");
    int64_t v;
    /* 0 computes the prompt into the cache and answers nothing (Anthropic's pre-warming) */
    if (api_opt_int(root, "max_tokens", 0, INT32_MAX, &v, c->err) < 0) return -1;
    rq->max_tokens = (int)v;
    if (api_opt_bool(root, "stream", &rq->stream, c->err) < 0) return -1;
    sampler_params *sp = &rq->sampling;
    if (api_opt_number(root, "temperature", 0, 1, false, &sp->temperature, c->err) < 0) return -1;
    if (api_opt_number(root, "top_p", 0, 1, false, &sp->top_p, c->err) < 0) return -1;
    int got = api_opt_int(root, "top_k", 0, INT32_MAX, &v, c->err);
    if (got < 0) return -1;
    if (got) sp->top_k = (int)v;
    const json_t *stops = api_field(root, "stop_sequences");
    if (stops) {
        if (!json_is_array(stops))
            return api_type_error(c->err, "stop_sequences", "an array of strings", stops);
        if (json_array_size(stops) > API_MAX_STOPS)
            return bad(c->err, "stop_sequences", "%zu stop sequences, more than this server's %d",
                       json_array_size(stops), API_MAX_STOPS);
        size_t i;
        const json_t *s;
        json_array_foreach(stops, i, s) {
            char p[PATH];
            sub_i(p, "", "stop_sequences", i);
            if (json_is_string(s) && json_string_length(s) == 0)
                return bad(c->err, p, "stop sequences must be non-empty");
            if (api_str_copy(s, p, &rq->stops[i], c->err)) return -1;
            rq->n_stops = (int)i + 1;
        }
    }
    const json_t *meta = api_field(root, "metadata");
    if (meta) {
        if (!json_is_object(meta)) return api_type_error(c->err, "metadata", "an object", meta);
        static const char *const keys[] = {"user_id", NULL};
        if (only_keys(meta, "metadata", keys, c->err)) return -1;
        const json_t *user = api_field(meta, "user_id");
        if (user && api_str_copy(user, "metadata.user_id", &rq->user, c->err)) return -1;
    }
    const json_t *tier = api_field(root, "service_tier");
    static const char *const tiers[] = {"auto", "standard_only", NULL};
    /* one tier here: both mean "this server" */
    return tier && one_of(tier, "service_tier", tiers, c->err) < 0 ? -1 : 0;
}

/* speed: "standard" is this server's; "fast" would be a promise it cannot keep. */
static int parse_speed(parse_ctx *c, const json_t *speed) {
    static const char *const speeds[] = {"standard", "fast", NULL};
    int k = speed ? one_of(speed, "speed", speeds, c->err) : 0;
    if (k < 0) return -1;
    return k == 1 ? bad(c->err, "speed", "fast mode is not supported by this server") : 0;
}

/* thinking: "disabled" is what this server does; anything else would be silently ignored. */
static int parse_thinking(parse_ctx *c, const json_t *th) {
    if (!th) return 0;
    if (!json_is_object(th)) return api_type_error(c->err, "thinking", "an object", th);
    const json_t *type = json_object_get(th, "type");
    if (json_is_string(type) && !strcmp(json_string_value(type), "disabled")) {
        static const char *const keys[] = {"type", NULL};
        return only_keys(th, "thinking", keys, c->err);
    }
    return bad(c->err, "thinking",
               "extended thinking is not supported by this server (only "
               "{\"type\": \"disabled\"})");
}

static int parse_fields(parse_ctx *c, const json_t *root, bool count) {
    static const char *const create_keys[] = {
        "model",    "messages",     "max_tokens", "system",        "metadata", "stop_sequences",
        "stream",   "temperature",  "top_p",      "top_k",         "tools",    "tool_choice",
        "thinking", "service_tier", "speed",      "cache_control", NULL};
    static const char *const count_keys[] = {"model", "messages",      "system",
                                             "tools", "tool_choice",   "thinking",
                                             "speed", "cache_control", NULL};
    /* fields of Anthropic's whose features this server lacks: named, not "extra" */
    static const char *const refused[] = {
        "container",   "mcp_servers",   "context_management", "output_config", "output_format",
        "diagnostics", "inference_geo", "user_profile_id",    "workspace_id",  NULL};
    for (int k = 0; refused[k]; k++)
        if (json_object_get(root, refused[k]))
            return bad(c->err, refused[k], "not supported by this server");
    if (only_keys(root, "", count ? count_keys : create_keys, c->err)) return -1;
    const json_t *model = json_object_get(root, "model");
    if (!model) return bad(c->err, "model", "Field required");
    if (api_str_copy(model, "model", &c->rq->model, c->err)) return -1;
    if (!count && parse_generation(c, root)) return -1;
    if (parse_thinking(c, api_field(root, "thinking"))) return -1;
    if (parse_speed(c, api_field(root, "speed"))) return -1;
    /* tools first: their markers come first in the prompt order */
    const json_t *tools = api_field(root, "tools");
    if (tools && parse_tools(c, tools)) return -1;
    if (parse_tool_choice(c, api_field(root, "tool_choice"))) return -1;

    const json_t *msgs = json_object_get(root, "messages"), *sys = api_field(root, "system");
    if (!msgs) return bad(c->err, "messages", "Field required");
    if (!json_is_array(msgs)) return api_type_error(c->err, "messages", "an array", msgs);
    size_t n = json_array_size(msgs);
    if (n == 0) return bad(c->err, "messages", "at least one message is required");
    /* chat messages at most: the system message, and per message one for each block and one */
    size_t cap = 1, i;
    const json_t *m;
    json_array_foreach(msgs, i, m) {
        const json_t *content = json_object_get(m, "content");
        cap += 1 + (json_is_array(content) ? json_array_size(content) : 0);
        if (cap > INT_MAX / 4) return bad(c->err, "messages", "too many messages and blocks");
    }
    api_request *rq = c->rq;
    rq->messages = calloc(cap, sizeof *rq->messages);
    c->src_msg = malloc(sizeof *c->src_msg * cap);
    c->src_block = malloc(sizeof *c->src_block * cap);
    if (!rq->messages || !c->src_msg || !c->src_block) return oom(c->err);
    c->cap_msgs = (int)cap;
    if (sys && parse_system(c, sys)) return -1;
    for (i = 0; i < n; i++)
        if (parse_message(c, json_array_get(msgs, i), (int)i, i == n - 1)) return -1;
    /* Anthropic's automatic caching: a marker on the request's last block */
    const json_t *cc = api_field(root, "cache_control");
    if (cc && parse_cache_control(c, cc, "", rq->n_messages - 1, false, 0, 0)) return -1;
    return check_turns(c);
}

int anthropic_parse(const char *body, size_t len, bool count, anthropic_request *out,
                    api_error *err) {
    memset(out, 0, sizeof *out);
    api_request *rq = &out->rq;
    api_request_init(API_CHAT, rq); /* for the fields Anthropic lacks */
    json_t *root = api_parse_body(body, len, err);
    if (!root) return -1;
    parse_ctx c = {.out = out, .rq = rq, .err = err};
    int rc = parse_fields(&c, root, count);
    json_decref(root);
    free(c.src_msg);
    free(c.src_block);
    if (rc) anthropic_request_free(out);
    return rc;
}

void anthropic_request_free(anthropic_request *r) {
    if (!r) return;
    api_request_free(&r->rq);
    memset(r, 0, sizeof *r);
}

/* ---------------------------------------------------------------- errors */

const char *anthropic_error_type(int status) {
    switch (status) {
    case 400:
        return "invalid_request_error";
    case 401:
        return "authentication_error";
    case 403:
        return "permission_error";
    case 404:
        return "not_found_error";
    case 413:
        return "request_too_large";
    case 429:
        return "rate_limit_error";
    case 503:
    case 529:
        return "overloaded_error";
    default:
        return status >= 400 && status < 500 ? "invalid_request_error" : "api_error";
    }
}

char *anthropic_error_json(const api_error *err) {
    /* api_error_json's sanitizing of the message (UTF-8), through its JSON */
    char *openai = api_error_json(err);
    json_t *o = openai ? json_loads(openai, 0, NULL) : NULL;
    free(openai);
    const char *msg = json_string_value(json_object_get(json_object_get(o, "error"), "message"));
    json_t *v = json_pack("{s:s,s:{s:s,s:s}}", "type", "error", "error", "type",
                          anthropic_error_type(err->status), "message", msg ? msg : "error");
    json_decref(o);
    char *s = v ? json_dumps(v, JSON_COMPACT) : NULL;
    json_decref(v);
    return s;
}
