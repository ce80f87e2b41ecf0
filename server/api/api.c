/* The OpenAI API's request side: request bodies parsed with jansson and validated field by field
 * into api_request, and OpenAI's error object.
 *
 * Ranges follow OpenAI's API reference where it gives one (temperature [0, 2], top_p [0, 1],
 * penalties [-2, 2], logit_bias [-100, 100], up to 4 stop strings, top_logprobs 0..20, completions
 * logprobs 0..5) and vLLM's sampling extensions otherwise (top_k -1 = off, min_p [0, 1],
 * repetition_penalty (0, 100]). null stands for "not given" on every optional field, as the
 * OpenAI Python client sends it. Integer fields accept a float with no fractional part (2.0),
 * as pydantic's lax mode in vLLM does.
 *
 * Every string is checked for NUL (we hand out NUL-terminated C strings, so "a\u0000b" would be
 * silently cut) and copied: the request owns all its memory and outlives the JSON tree. */
#include "server/api/api.h"
#include "cache/cache.h"
#include "model/grammar/grammar.h"
#include "server/api/api_impl.h"
#include "util/json.h"
#include "util/utf8.h"

#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- JSON helpers */

int api_type_error(api_error *err, const char *param, const char *want, const json_t *got) {
    if (!got) return API_BAD(err, param, "'%s' is required: %s", param, want);
    return API_BAD(err, param, "'%s' must be %s, got %s", param, want, json_type_name(got));
}

/* A field of obj, or NULL when absent or null (an optional field's "not given"). */
json_t *api_field(const json_t *obj, const char *key) {
    json_t *v = json_object_get(obj, key);
    return v && !json_is_null(v) ? v : NULL;
}

/* An integer, or a float with no fractional part within +-2^53 (exact in a double). */
static bool json_as_int64(const json_t *v, int64_t *out) {
    if (json_is_integer(v)) {
        *out = (int64_t)json_integer_value(v);
        return true;
    }
    if (json_is_real(v)) {
        double d = json_real_value(v);
        if (isfinite(d) && fabs(d) <= 9007199254740992.0 && floor(d) == d) {
            *out = (int64_t)d;
            return true;
        }
    }
    return false;
}

/* The optional fields of the request body. Each returns 1 when the field was given (and stores
 * it), 0 when it was absent or null (out untouched), -1 with err on a wrong type or range. */

int api_opt_bool(const json_t *obj, const char *key, bool *out, api_error *err) {
    json_t *v = api_field(obj, key);
    if (!v) return 0;
    if (!json_is_boolean(v)) return api_type_error(err, key, "a boolean", v);
    *out = json_is_true(v);
    return 1;
}

/* A number in [lo, hi], or (lo, hi] when lo_open. */
int api_opt_number(const json_t *obj, const char *key, double lo, double hi, bool lo_open,
                   float *out, api_error *err) {
    json_t *v = api_field(obj, key);
    if (!v) return 0;
    if (!json_is_number(v)) return api_type_error(err, key, "a number", v);
    double d = json_number_value(v);
    if (!(lo_open ? d > lo : d >= lo) || !(d <= hi))
        return API_BAD(err, key, "'%s' must be %s %g and %g, got %g", key,
                       lo_open ? "greater than" : "between", lo, hi, d);
    *out = (float)d;
    return 1;
}

static int int_check(const json_t *v, const char *param, int64_t lo, int64_t hi, int64_t *out,
                     api_error *err) {
    if (!json_as_int64(v, out)) return api_type_error(err, param, "an integer", v);
    if (*out >= lo && *out <= hi) return 0;
    /* Limits that only guard the int conversion are left out of the message. */
    if (hi >= INT32_MAX && *out < lo)
        return API_BAD(err, param, "'%s' must be at least %lld, got %lld", param, (long long)lo,
                       (long long)*out);
    if (hi >= INT32_MAX)
        return API_BAD(err, param, "'%s' must be at most %lld, got %lld", param, (long long)hi,
                       (long long)*out);
    return API_BAD(err, param, "'%s' must be between %lld and %lld, got %lld", param, (long long)lo,
                   (long long)hi, (long long)*out);
}

int api_opt_int(const json_t *obj, const char *key, int64_t lo, int64_t hi, int64_t *out,
                api_error *err) {
    json_t *v = api_field(obj, key);
    if (!v) return 0;
    return int_check(v, key, lo, hi, out, err) ? -1 : 1;
}

/* Copies a string value (non-NULL v) into *out; param names it in errors. */
int api_str_copy(const json_t *v, const char *param, char **out, api_error *err) {
    if (!json_is_string(v)) return api_type_error(err, param, "a string", v);
    const char *s = json_string_value(v);
    size_t len = json_string_length(v);
    if (memchr(s, '\0', len))
        return API_BAD(err, param, "'%s' must not contain NUL characters (\\u0000)", param);
    *out = malloc(len + 1);
    if (!*out) return api_fail(err, 500, "server_error", NULL, param, "out of memory");
    memcpy(*out, s, len + 1);
    return 0;
}

int api_opt_string(const json_t *obj, const char *key, char **out, api_error *err) {
    json_t *v = api_field(obj, key);
    if (!v) return 0;
    return api_str_copy(v, key, out, err) ? -1 : 1;
}

int api_oom(api_error *err) {
    return api_fail(err, 500, "server_error", NULL, "", "out of memory");
}

/* Validates the body's encoding and parses it. Returns the root object or NULL with err. */
json_t *api_parse_body(const char *body, size_t len, api_error *err) {
    if (!body || len == 0) { /* jansson would say "wrong arguments" for a NULL buffer */
        API_BAD(err, "", "the request body is empty (expected a JSON object)");
        return NULL;
    }
    /* Our own UTF-8 check first, so the message says what is wrong and where; jansson would
     * refuse the body too, with "unable to decode byte". */
    size_t bad = utf8_validate((const uint8_t *)body, len);
    if (bad < len) {
        API_BAD(err, "", "invalid UTF-8 in the request body at byte offset %zu (byte 0x%02x)", bad,
                (unsigned)(uint8_t)body[bad]);
        return NULL;
    }
    json_error_t jerr;
    /* JSON_ALLOW_NUL: NUL in a string value is refused later by str_copy, which names the
     * parameter; jansson itself still refuses it in object keys. */
    json_t *root =
        json_loadb(body, len, JSON_REJECT_DUPLICATES | JSON_DECODE_ANY | JSON_ALLOW_NUL, &jerr);
    if (!root) {
        enum json_error_code code = json_error_code(&jerr);
        if (code == json_error_invalid_utf8)
            API_BAD(err, "", "invalid UTF-8 in the request body at line %d, column %d: %s",
                    jerr.line, jerr.column, jerr.text);
        else if (code == json_error_null_byte_in_key || code == json_error_null_character)
            API_BAD(err, "", "NUL characters (\\u0000) are not allowed, at line %d, column %d: %s",
                    jerr.line, jerr.column, jerr.text);
        else
            API_BAD(err, "", "malformed JSON at line %d, column %d: %s", jerr.line, jerr.column,
                    jerr.text);
        return NULL;
    }
    if (!json_is_object(root)) {
        API_BAD(err, "", "the request body must be a JSON object, got %s", json_type_name(root));
        json_decref(root);
        return NULL;
    }
    return root;
}

/* ---------------------------------------------------------------- messages */

/* content: a string, or an array of {"type": "text", "text": ..} parts joined with nothing
 * between them (as vLLM and llama.cpp join text parts); m->part_ends records where each part
 * ends when there are several. */
static int parse_content(const json_t *v, int i, chat_message *m, api_error *err) {
    char param[64];
    snprintf(param, sizeof param, "messages[%d].content", i);
    if (json_is_string(v)) return api_str_copy(v, param, (char **)&m->content, err);
    if (!json_is_array(v))
        return api_type_error(err, param, "a string or an array of content parts", v);

    size_t n = json_array_size(v), total = 0;
    for (size_t j = 0; j < n; j++) {
        const json_t *part = json_array_get(v, j);
        char pp[64];
        snprintf(pp, sizeof pp, "messages[%d].content[%zu]", i, j);
        if (!json_is_object(part)) return api_type_error(err, pp, "an object", part);
        const json_t *type = json_object_get(part, "type");
        snprintf(pp, sizeof pp, "messages[%d].content[%zu].type", i, j);
        if (!type) return API_BAD(err, pp, "'%s' is required", pp);
        if (!json_is_string(type)) return api_type_error(err, pp, "a string", type);
        if (strcmp(json_string_value(type), "text") != 0 ||
            json_string_length(type) != strlen("text"))
            return API_BAD(err, pp, "content part type '%.40s' is not supported (only 'text')",
                           json_string_value(type));
        const json_t *text = json_object_get(part, "text");
        snprintf(pp, sizeof pp, "messages[%d].content[%zu].text", i, j);
        if (!text) return API_BAD(err, pp, "'%s' is required", pp);
        if (!json_is_string(text)) return api_type_error(err, pp, "a string", text);
        size_t len = json_string_length(text);
        if (memchr(json_string_value(text), '\0', len))
            return API_BAD(err, pp, "'%s' must not contain NUL characters (\\u0000)", pp);
        if (size_add(total, len, &total)) return api_oom(err);
    }
    char *s = malloc(total + 1);
    if (!s) return api_oom(err);
    m->content = s;
    size_t *ends = n > 1 ? malloc(sizeof *ends * n) : NULL;
    if (n > 1 && !ends) return api_oom(err);
    m->part_ends = ends;
    m->n_parts = ends ? (int)n : 0;
    size_t off = 0;
    for (size_t j = 0; j < n; j++) {
        const json_t *text = json_object_get(json_array_get(v, j), "text");
        size_t len = json_string_length(text);
        memcpy(s + off, json_string_value(text), len);
        off += len;
        if (ends) ends[j] = off;
    }
    s[off] = '\0';
    return 0;
}

static char *dup_str(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = malloc(n);
    if (d) memcpy(d, s, n);
    return d;
}

/* OpenAI's function names: 1 to 64 of a-z, A-Z, 0-9, _ and -. */
bool api_tool_name_ok(const char *s, size_t len) {
    if (len == 0 || len > 64) return false;
    for (size_t i = 0; i < len; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '_' || c == '-'))
            return false;
    }
    return true;
}
/* An assistant turn's tool_calls ({"id", "type": "function", "function": {"name", "arguments"}}),
 * kept for the chat template to write in its tool format. The arguments stay the JSON text the
 * client sent (templates receive them parsed, so they must parse); an empty list is no calls. */
static int parse_tool_calls(const json_t *calls, int i, chat_message *msg, api_error *err) {
    char param[64];
    snprintf(param, sizeof param, "messages[%d].tool_calls", i);
    if (!json_is_array(calls)) return api_type_error(err, param, "an array", calls);
    size_t n = json_array_size(calls);
    if (n > API_MAX_TOOLS)
        return API_BAD(err, param, "'%s' has %zu calls, more than the limit of %d", param, n,
                       API_MAX_TOOLS);
    if (n == 0) return 0;
    chat_tool_call *tc = calloc(n, sizeof *tc);
    if (!tc) return api_oom(err);
    msg->tool_calls = tc;
    msg->n_tool_calls = (int)n;
    for (size_t k = 0; k < n; k++) {
        const json_t *c = json_array_get(calls, k);
        snprintf(param, sizeof param, "messages[%d].tool_calls[%zu]", i, k);
        if (!json_is_object(c)) return api_type_error(err, param, "an object", c);
        const json_t *id = api_field(c, "id");
        snprintf(param, sizeof param, "messages[%d].tool_calls[%zu].id", i, k);
        if (id && api_str_copy(id, param, (char **)&tc[k].id, err)) return -1;
        const json_t *fn = json_object_get(c, "function");
        snprintf(param, sizeof param, "messages[%d].tool_calls[%zu].function", i, k);
        if (!json_is_object(fn)) return api_type_error(err, param, "an object", fn);
        const json_t *name = json_object_get(fn, "name");
        snprintf(param, sizeof param, "messages[%d].tool_calls[%zu].function.name", i, k);
        if (!json_is_string(name) ||
            !api_tool_name_ok(json_string_value(name), json_string_length(name)))
            return API_BAD(err, param, "'%s' must be 1 to 64 of a-z, A-Z, 0-9, _ and -", param);
        if (api_str_copy(name, param, (char **)&tc[k].name, err)) return -1;
        const json_t *args = api_field(fn, "arguments");
        snprintf(param, sizeof param, "messages[%d].tool_calls[%zu].function.arguments", i, k);
        if (args) {
            if (!json_is_string(args))
                return api_type_error(err, param, "a string (JSON text)", args);
            if (api_str_copy(args, param, (char **)&tc[k].arguments, err)) return -1;
            json_error_t je;
            json_t *parsed = *tc[k].arguments ? json_loads(tc[k].arguments, JSON_DECODE_ANY, &je)
                                              : json_object();
            if (!parsed) return API_BAD(err, param, "'%s' is not JSON: %s", param, je.text);
            json_decref(parsed);
        }
        snprintf(param, sizeof param, "messages[%d].tool_calls[%zu].id", i, k);
        if (!tc[k].id)
            return API_BAD(err, param, "'%s' is required: tool messages answer it", param);
    }
    return 0;
}

/* The conversation's tool turns (chat_check_tool_turns) in OpenAI's words: its messages for a
 * result that follows no calls (its spelling of "preceeding" included), for an id the calls lack
 * and for calls left without results. */
static int check_tool_turns(const chat_message *msgs, int n, api_error *err) {
    chat_turn_check c;
    if (chat_check_tool_turns(msgs, n, &c) == CHAT_TURNS_OK) return 0;
    char param[64];
    const char *id = msgs[c.msg].tool_call_id ? msgs[c.msg].tool_call_id : "";
    snprintf(param, sizeof param, "messages[%d].tool_call_id", c.msg);
    switch (c.problem) {
    case CHAT_TURNS_RESULT_WITHOUT_CALLS:
        snprintf(param, sizeof param, "messages[%d].role", c.msg);
        return API_BAD(err, param,
                       "Invalid parameter: messages with role 'tool' must be a response to a "
                       "preceeding message with 'tool_calls'.");
    case CHAT_TURNS_UNKNOWN_ID:
        return API_BAD(err, param,
                       "Invalid parameter: 'tool_call_id' of '%.64s' not found in 'tool_calls' "
                       "of previous message.",
                       id);
    case CHAT_TURNS_ANSWERED_TWICE:
        return API_BAD(err, param,
                       "Invalid parameter: 'tool_call_id' of '%.64s' was already answered by "
                       "messages[%d].",
                       id, c.other);
    default: {
        /* every call of that message without a result, as OpenAI lists them */
        char ids[256];
        chat_unanswered_ids(msgs, n, c.msg, c.call, ids, sizeof ids);
        snprintf(param, sizeof param, "messages[%d].role", c.msg);
        return API_BAD(err, param,
                       "An assistant message with 'tool_calls' must be followed by tool messages "
                       "responding to each 'tool_call_id'. The following tool_call_ids did not "
                       "have response messages: %s",
                       ids);
    }
    }
}

/* Fills *msgs (allocated here, *n set as soon as it is, so the caller frees a partial list). */
static int parse_messages(const json_t *v, chat_message **msgs, int *n_msgs, api_error *err) {
    if (!json_is_array(v)) return api_type_error(err, "messages", "an array", v);
    size_t n = json_array_size(v);
    if (n == 0) return API_BAD(err, "messages", "'messages' must not be empty");
    if (n > INT_MAX / 2) return API_BAD(err, "messages", "too many messages (%zu)", n);
    *msgs = calloc(n, sizeof **msgs);
    if (!*msgs) return api_oom(err);
    *n_msgs = (int)n;

    for (int i = 0; i < (int)n; i++) {
        const json_t *m = json_array_get(v, (size_t)i);
        char param[64];
        snprintf(param, sizeof param, "messages[%d]", i);
        if (!json_is_object(m)) return api_type_error(err, param, "an object", m);

        snprintf(param, sizeof param, "messages[%d].role", i);
        const json_t *role = json_object_get(m, "role");
        if (!role) return API_BAD(err, param, "'%s' is required", param);
        if (!json_is_string(role)) return api_type_error(err, param, "a string", role);
        const char *r = json_string_value(role);
        if (strlen(r) != json_string_length(role))
            return API_BAD(err, param, "'%s' must not contain NUL characters (\\u0000)", param);
        const char *canon;
        if (!strcmp(r, "system") || !strcmp(r, "developer")) {
            canon = "system"; /* OpenAI's o-series name for the system role */
        } else if (!strcmp(r, "user") || !strcmp(r, "assistant")) {
            canon = r;
        } else if (!strcmp(r, "tool")) {
            canon = "tool";
        } else if (!strcmp(r, "function")) {
            return API_BAD(err, param, "role 'function' is deprecated; use 'tool'");
        } else {
            return API_BAD(
                err, param,
                "unknown role '%.40s' (expected system, developer, user, assistant or tool)", r);
        }
        bool assistant = !strcmp(canon, "assistant");

        const json_t *calls = api_field(m, "tool_calls");
        if (calls && !assistant) {
            snprintf(param, sizeof param, "messages[%d].tool_calls", i);
            return API_BAD(err, param, "only assistant messages have tool_calls");
        }
        if (api_field(m, "function_call")) {
            snprintf(param, sizeof param, "messages[%d].function_call", i);
            return API_BAD(err, param, "function calls are not supported");
        }

        (*msgs)[i].role = dup_str(canon);
        if (!(*msgs)[i].role) return api_oom(err);
        const json_t *content = api_field(m, "content");
        if (content) {
            if (parse_content(content, i, &(*msgs)[i], err)) return -1;
        } else if (assistant) {
            /* an assistant turn that only called tools has no content */
            if (!((*msgs)[i].content = dup_str(""))) return api_oom(err);
        } else {
            snprintf(param, sizeof param, "messages[%d].content", i);
            return API_BAD(err, param, "'%s' is required for role '%s'", param, canon);
        }
        if (calls && parse_tool_calls(calls, i, &(*msgs)[i], err)) return -1;
        if (strcmp(canon, "tool") != 0) continue;
        const json_t *id = api_field(m, "tool_call_id");
        snprintf(param, sizeof param, "messages[%d].tool_call_id", i);
        if (!id) return API_BAD(err, param, "'%s' is required for role 'tool'", param);
        if (api_str_copy(id, param, (char **)&(*msgs)[i].tool_call_id, err)) return -1;
        const json_t *name = api_field(m, "name"); /* else the template finds it by the id */
        snprintf(param, sizeof param, "messages[%d].name", i);
        if (name && api_str_copy(name, param, (char **)&(*msgs)[i].name, err)) return -1;
    }
    return check_tool_turns(*msgs, *n_msgs, err);
}

static void messages_free(chat_message *msgs, int n) {
    for (int i = 0; i < n; i++) {
        chat_message *m = &msgs[i];
        free((char *)m->role);
        free((char *)m->content);
        free((void *)m->part_ends);
        for (int k = 0; k < m->n_tool_calls; k++) {
            free((char *)m->tool_calls[k].id);
            free((char *)m->tool_calls[k].name);
            free((char *)m->tool_calls[k].arguments);
        }
        free((void *)m->tool_calls);
        free((char *)m->tool_call_id);
        free((char *)m->name);
    }
    free(msgs);
}

/* ---------------------------------------------------------------- prompts and token lists */

/* A JSON array of token ids into a malloc'd int32 array (NULL when empty); param names it. */
static int parse_token_array(const json_t *v, const char *param, int32_t **out, int *n_out,
                             api_error *err) {
    size_t n = json_array_size(v);
    if (n > API_MAX_TOKENS)
        return API_BAD(err, param, "'%s' has %zu tokens, more than the limit of %d", param, n,
                       API_MAX_TOKENS);
    int32_t *t = NULL;
    if (n > 0) {
        t = malloc(n * sizeof *t);
        if (!t) return api_oom(err);
    }
    for (size_t i = 0; i < n; i++) {
        char pp[64];
        snprintf(pp, sizeof pp, "%s[%zu]", param, i);
        int64_t id;
        if (int_check(json_array_get(v, i), pp, 0, INT32_MAX, &id, err)) {
            free(t);
            return -1;
        }
        t[i] = (int32_t)id;
    }
    *out = t;
    *n_out = (int)n;
    return 0;
}

/* prompt (or embeddings' input): "text" | ["text", ..] | [id, ..] | [[id, ..], ..], at most max
 * of them. The first element decides which array shape it is; any element of another type is an
 * error. */
static int parse_prompts(const json_t *v, const char *key, int max, api_prompt **out, int *n_out,
                         api_error *err) {
    if (json_is_string(v)) {
        *out = calloc(1, sizeof **out);
        if (!*out) return api_oom(err);
        *n_out = 1;
        return api_str_copy(v, key, &(*out)[0].text, err);
    }
    if (!json_is_array(v))
        return api_type_error(err, key, "a string, an array of strings or an array of token ids",
                              v);
    size_t n = json_array_size(v);
    if (n == 0) return API_BAD(err, key, "'%s' must not be empty", key);
    const json_t *first = json_array_get(v, 0);
    int64_t dummy;
    char pp[64];
    if (json_as_int64(first, &dummy)) { /* one prompt of token ids */
        *out = calloc(1, sizeof **out);
        if (!*out) return api_oom(err);
        *n_out = 1;
        return parse_token_array(v, key, &(*out)[0].tokens, &(*out)[0].n_tokens, err);
    }
    snprintf(pp, sizeof pp, "%s[0]", key);
    if (!json_is_string(first) && !json_is_array(first))
        return api_type_error(err, pp, "a string, an array of token ids or a token id", first);
    if (n > (size_t)max)
        return API_BAD(err, key, "'%s' has %zu %ss, more than the limit of %d", key, n, key, max);
    *out = calloc(n, sizeof **out);
    if (!*out) return api_oom(err);
    *n_out = (int)n;
    bool strings = json_is_string(first);
    for (size_t i = 0; i < n; i++) {
        const json_t *p = json_array_get(v, i);
        snprintf(pp, sizeof pp, "%s[%zu]", key, i);
        if (strings) {
            if (api_str_copy(p, pp, &(*out)[i].text, err)) return -1;
            continue;
        }
        if (!json_is_array(p))
            return api_type_error(err, pp, "an array of token ids (as the first one)", p);
        if (json_array_size(p) == 0) return API_BAD(err, pp, "'%s' must not be empty", pp);
        if (parse_token_array(p, pp, &(*out)[i].tokens, &(*out)[i].n_tokens, err)) return -1;
    }
    return 0;
}

/* ---------------------------------------------------------------- sampling fields */

static int parse_logit_bias(const json_t *obj, api_request *r, api_error *err) {
    const json_t *v = api_field(obj, "logit_bias");
    if (!v) return 0;
    if (!json_is_object(v))
        return api_type_error(err, "logit_bias", "an object of token id -> bias", v);
    size_t n = json_object_size(v);
    if (n == 0) return 0;
    if (n > API_MAX_LOGIT_BIAS)
        return API_BAD(err, "logit_bias", "'logit_bias' has %zu entries, more than the limit of %d",
                       n, API_MAX_LOGIT_BIAS);
    r->bias = calloc(n, sizeof *r->bias);
    if (!r->bias) return api_oom(err);
    const char *key;
    const json_t *val;
    int k = 0;
    json_object_foreach((json_t *)v, key, val) {
        /* Keys are decimal token ids ("50256"), as OpenAI's tokenizer ids are sent. */
        size_t len = strlen(key);
        int64_t id = 0;
        bool ok = len > 0 && len <= 10;
        for (size_t i = 0; ok && i < len; i++) {
            if (key[i] < '0' || key[i] > '9')
                ok = false;
            else
                id = id * 10 + (key[i] - '0');
        }
        if (!ok || id > INT32_MAX)
            return API_BAD(err, "logit_bias",
                           "'logit_bias' keys must be token ids (non-negative integers), got "
                           "'%.40s'",
                           key);
        for (int j = 0; j < k; j++)
            if (r->bias[j].token == (int32_t)id)
                return API_BAD(err, "logit_bias", "'logit_bias' gives token %lld twice",
                               (long long)id);
        if (!json_is_number(val))
            return API_BAD(err, "logit_bias",
                           "'logit_bias' values must be numbers, got %s for '%.40s'",
                           json_type_name(val), key);
        double b = json_number_value(val);
        if (!(b >= -100.0 && b <= 100.0))
            return API_BAD(err, "logit_bias",
                           "'logit_bias' values must be between -100 and 100, got %g for '%.40s'",
                           b, key);
        r->bias[k].token = (int32_t)id;
        r->bias[k].bias = (float)b;
        k++;
    }
    r->sampling.bias = r->bias;
    r->sampling.n_bias = k;
    return 0;
}

static int parse_stop(const json_t *obj, api_request *r, api_error *err) {
    const json_t *v = api_field(obj, "stop");
    if (!v) return 0;
    if (json_is_string(v)) {
        if (json_string_length(v) == 0)
            return API_BAD(err, "stop", "'stop' must not be an empty string");
        if (api_str_copy(v, "stop", &r->stops[0], err)) return -1;
        r->n_stops = 1;
        return 0;
    }
    if (!json_is_array(v)) return api_type_error(err, "stop", "a string or an array of strings", v);
    size_t n = json_array_size(v);
    if (n > API_MAX_STOPS)
        return API_BAD(err, "stop", "'stop' has %zu strings, more than the limit of %d", n,
                       API_MAX_STOPS);
    for (size_t i = 0; i < n; i++) {
        const json_t *s = json_array_get(v, i);
        char pp[64];
        snprintf(pp, sizeof pp, "stop[%zu]", i);
        if (json_is_string(s) && json_string_length(s) == 0)
            return API_BAD(err, pp, "'%s' must not be an empty string", pp);
        if (api_str_copy(s, pp, &r->stops[i], err)) return -1;
        r->n_stops = (int)i + 1;
    }
    return 0;
}

int api_parse_sampling(const json_t *obj, api_request *r, api_error *err) {
    sampler_params *p = &r->sampling;
    if (api_opt_number(obj, "temperature", 0, 2, false, &p->temperature, err) < 0) return -1;
    if (api_opt_number(obj, "top_p", 0, 1, false, &p->top_p, err) < 0) return -1;
    if (api_opt_number(obj, "min_p", 0, 1, false, &p->min_p, err) < 0) return -1;
    if (api_opt_number(obj, "presence_penalty", -2, 2, false, &p->presence_penalty, err) < 0)
        return -1;
    if (api_opt_number(obj, "frequency_penalty", -2, 2, false, &p->frequency_penalty, err) < 0)
        return -1;
    if (api_opt_number(obj, "repetition_penalty", 0, 100, true, &p->repeat_penalty, err) < 0)
        return -1;
    int64_t v;
    int got = api_opt_int(obj, "top_k", -1, INT32_MAX, &v, err);
    if (got < 0) return -1;
    if (got) p->top_k = v < 0 ? 0 : (int)v; /* vLLM's -1 and our 0 both mean off */
    got = api_opt_int(obj, "seed", INT64_MIN, INT64_MAX, &v, err);
    if (got < 0) return -1;
    if (got) {
        p->seed = (uint64_t)v;
        r->seed_given = true;
    }
    if (parse_logit_bias(obj, r, err)) return -1;
    return parse_stop(obj, r, err);
}

/* logprobs: chat takes a bool plus top_logprobs; completions takes one integer (the legacy
 * API's "logprobs": 5 means five alternatives per token). */
static int parse_logprobs(const json_t *obj, api_request *r, api_error *err) {
    int64_t v;
    if (r->kind == API_COMPLETION) {
        int got = api_opt_int(obj, "logprobs", 0, 5, &v, err);
        if (got < 0) return -1;
        if (got) {
            r->logprobs = true;
            r->top_logprobs = (int)v;
        }
        return 0;
    }
    if (api_opt_bool(obj, "logprobs", &r->logprobs, err) < 0) return -1;
    int got = api_opt_int(obj, "top_logprobs", 0, API_MAX_TOP_LOGPROBS, &v, err);
    if (got < 0) return -1;
    if (got) {
        if (!r->logprobs)
            return API_BAD(err, "top_logprobs", "'top_logprobs' requires 'logprobs' to be true");
        r->top_logprobs = (int)v;
    }
    return 0;
}

/* ---------------------------------------------------------------- constrained decoding */

/* Sets the request's grammar (gbnf, owned from here) after checking it parses. Two fields that
 * both constrain the output are refused rather than one silently winning. */
int api_set_gbnf(api_request *r, const char *param, char *gbnf, api_error *err) {
    if (r->gbnf) {
        free(gbnf);
        return API_BAD(err, param, "'%s' and '%s' both constrain the output; give one of them",
                       r->gbnf_param, param);
    }
    kv_error ke = {{0}};
    grammar *g = grammar_parse(gbnf, strlen(gbnf), &ke);
    if (!g) {
        free(gbnf);
        return API_BAD(err, param, "'%s': %s", param, ke.msg);
    }
    grammar_destroy(g);
    r->gbnf = gbnf;
    snprintf(r->gbnf_param, sizeof r->gbnf_param, "%s", param);
    return 0;
}

static int gbnf_field(const json_t *obj, const char *key, api_request *r, api_error *err) {
    char *text = NULL;
    int got = api_opt_string(obj, key, &text, err);
    if (got <= 0) return got;
    return api_set_gbnf(r, key, text, err) ? -1 : 1;
}

/* A JSON Schema (an object, true, or for vLLM's guided_json a string holding one) compiled to
 * GBNF; an unsupported keyword is a 400 naming it. */
static int schema_field(const json_t *schema, const char *param, bool string_ok, api_request *r,
                        api_error *err) {
    char *text;
    if (string_ok && json_is_string(schema)) {
        text = malloc(json_string_length(schema) + 1);
        if (text) memcpy(text, json_string_value(schema), json_string_length(schema) + 1);
    } else if (json_is_object(schema) || json_is_true(schema)) {
        text = json_dumps(schema, JSON_COMPACT | JSON_ENCODE_ANY);
    } else {
        return api_type_error(err, param, "a JSON Schema object", schema);
    }
    if (!text) return api_oom(err);
    kv_error ke = {{0}};
    char *gbnf = json_schema_to_gbnf(text, strlen(text), &ke);
    free(text);
    if (!gbnf) return API_BAD(err, param, "'%s': %s", param, ke.msg);
    return api_set_gbnf(r, param, gbnf, err);
}

/* response_format: {"type": "text" | "json_object" | "json_schema", "json_schema": {"name",
 * "schema", "strict"}} as OpenAI defines it; llama-server's {"type": "json_object", "schema"}
 * too. */
static int parse_response_format(const json_t *v, api_request *r, api_error *err) {
    const char *P = "response_format";
    if (!json_is_object(v)) return api_type_error(err, P, "an object", v);
    const json_t *type = json_object_get(v, "type");
    if (!type) return API_BAD(err, "response_format.type", "'response_format.type' is required");
    if (!json_is_string(type)) return api_type_error(err, "response_format.type", "a string", type);
    const char *t = json_string_value(type);
    if (!strcmp(t, "text")) return 0;
    if (!strcmp(t, "json_object")) {
        const json_t *schema = api_field(v, "schema");
        if (schema) return schema_field(schema, "response_format.schema", false, r, err);
        char *g = dup_str(json_object_gbnf());
        return g ? api_set_gbnf(r, P, g, err) : api_oom(err);
    }
    if (strcmp(t, "json_schema") != 0)
        return API_BAD(err, "response_format.type",
                       "'response_format.type' must be 'text', 'json_object' or 'json_schema', "
                       "got '%.40s'",
                       t);
    const json_t *js = api_field(v, "json_schema");
    if (!js)
        return API_BAD(err, "response_format.json_schema",
                       "'response_format.json_schema' is required for type 'json_schema'");
    if (!json_is_object(js))
        return api_type_error(err, "response_format.json_schema", "an object", js);
    const json_t *strict = api_field(js, "strict");
    if (strict && !json_is_boolean(strict))
        return api_type_error(err, "response_format.json_schema.strict", "a boolean", strict);
    const json_t *name = api_field(js, "name");
    if (name && !json_is_string(name))
        return api_type_error(err, "response_format.json_schema.name", "a string", name);
    const json_t *schema = api_field(js, "schema");
    if (!schema) { /* no schema: any JSON object */
        char *g = dup_str(json_object_gbnf());
        return g ? api_set_gbnf(r, "response_format.json_schema", g, err) : api_oom(err);
    }
    return schema_field(schema, "response_format.json_schema.schema", false, r, err);
}

/* A GBNF string literal of s. */
static void literal_put(char *out, size_t *n, const char *s, size_t len) {
    out[(*n)++] = '"';
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\') {
            out[(*n)++] = '\\';
            out[(*n)++] = (char)c;
        } else if (c < 0x20 || c == 0x7f) {
            *n += (size_t)sprintf(out + *n, "\\x%02X", c);
        } else {
            out[(*n)++] = (char)c;
        }
    }
    out[(*n)++] = '"';
}

/* vLLM's guided_choice: the answer is one of the strings. */
static int parse_guided_choice(const json_t *v, api_request *r, api_error *err) {
    const char *P = "guided_choice";
    if (!json_is_array(v) || json_array_size(v) == 0)
        return api_type_error(err, P, "a non-empty array of strings", v);
    size_t total = 16, i;
    const json_t *c;
    json_array_foreach(v, i, c) {
        if (!json_is_string(c) || json_string_length(c) == 0)
            return API_BAD(err, P, "'guided_choice' must hold non-empty strings");
        if (json_string_length(c) > GRAMMAR_MAX_TEXT / 4)
            return API_BAD(err, P, "'guided_choice' holds a string that is too long");
        total += json_string_length(c) * 4 + 8;
    }
    char *g = malloc(total);
    if (!g) return api_oom(err);
    size_t n = (size_t)sprintf(g, "root ::= ");
    json_array_foreach(v, i, c) {
        if (i) n += (size_t)sprintf(g + n, " | ");
        literal_put(g, &n, json_string_value(c), json_string_length(c));
    }
    g[n] = '\0';
    return api_set_gbnf(r, P, g, err);
}

static int parse_constraints(const json_t *root, api_request *r, api_error *err) {
    const json_t *v;
    if ((v = api_field(root, "response_format")) && parse_response_format(v, r, err)) return -1;
    if (gbnf_field(root, "grammar", r, err) < 0) return -1;
    if (gbnf_field(root, "guided_grammar", r, err) < 0) return -1;
    if ((v = api_field(root, "json_schema")) && schema_field(v, "json_schema", false, r, err))
        return -1;
    if ((v = api_field(root, "guided_json")) && schema_field(v, "guided_json", true, r, err))
        return -1;
    if ((v = api_field(root, "guided_choice")) && parse_guided_choice(v, r, err)) return -1;
    return api_opt_bool(root, "jump_forward", &r->jump_forward, err) < 0 ? -1 : 0;
}

/* ---------------------------------------------------------------- tools */

/* One function ({name, description, parameters}) at param pp (tools[i].function, or the legacy
 * functions[i]) into r->tools[i]. */
int api_parse_function(const json_t *fn, const char *pp, size_t i, api_request *r, api_error *err) {
    char p[64];
    if (!json_is_object(fn)) return api_type_error(err, pp, "an object", fn);
    chat_tool *ct = &r->tools[i];
    r->n_tools = (int)i + 1;
    snprintf(p, sizeof p, "%s.name", pp);
    const json_t *name = json_object_get(fn, "name");
    if (!json_is_string(name) ||
        !api_tool_name_ok(json_string_value(name), json_string_length(name)))
        return API_BAD(err, p, "'%s' must be 1 to 64 of a-z, A-Z, 0-9, _ and -", p);
    for (size_t k = 0; k < i; k++)
        if (!strcmp(r->tools[k].name, json_string_value(name)))
            return API_BAD(err, p, "two tools are named '%s'", json_string_value(name));
    if (api_str_copy(name, p, (char **)&ct->name, err)) return -1;
    snprintf(p, sizeof p, "%s.description", pp);
    if (api_opt_string(fn, "description", (char **)&ct->description, err) < 0) return -1;
    const json_t *params = api_field(fn, "parameters");
    if (!params) return 0;
    snprintf(p, sizeof p, "%s.parameters", pp);
    return api_tool_schema(params, p, (char **)&ct->parameters, err);
}

/* tools, or the legacy functions (key "functions": the functions themselves, not wrapped). */
static int parse_tool_list(const json_t *v, const char *key, api_request *r, api_error *err) {
    bool legacy = !strcmp(key, "functions");
    if (!json_is_array(v)) return api_type_error(err, key, "an array", v);
    size_t n = json_array_size(v);
    if (n > API_MAX_TOOLS)
        return API_BAD(err, key, "'%s' has %zu tools, more than the limit of %d", key, n,
                       API_MAX_TOOLS);
    if (n > 0 && !(r->tools = calloc(n, sizeof *r->tools))) return api_oom(err);
    for (size_t i = 0; i < n; i++) {
        const json_t *t = json_array_get(v, i);
        char pp[64];
        snprintf(pp, sizeof pp, "%s[%zu]", key, i);
        if (legacy) {
            if (api_parse_function(t, pp, i, r, err)) return -1;
            continue;
        }
        if (!json_is_object(t)) return api_type_error(err, pp, "an object", t);
        const json_t *type = json_object_get(t, "type");
        if (!json_is_string(type) || strcmp(json_string_value(type), "function") != 0)
            return API_BAD(err, pp, "'%s.type' must be 'function'", pp);
        snprintf(pp, sizeof pp, "tools[%zu].function", i);
        if (api_parse_function(json_object_get(t, "function"), pp, i, r, err)) return -1;
    }
    return 0;
}

/* tool_choice, or the legacy function_call ("none", "auto" or {"name"}; key says which). */
static int parse_tool_choice(const json_t *tc, const char *key, api_request *r, api_error *err) {
    bool legacy = !strcmp(key, "function_call");
    if (json_is_string(tc)) {
        const char *c = json_string_value(tc);
        if (!strcmp(c, "none"))
            r->tool_choice = CHAT_TOOL_NONE;
        else if (!strcmp(c, "auto"))
            r->tool_choice = r->n_tools > 0 ? CHAT_TOOL_AUTO : CHAT_TOOL_NONE;
        else if (!strcmp(c, "required") && !legacy)
            r->tool_choice = CHAT_TOOL_REQUIRED;
        else if (legacy)
            return API_BAD(err, key, "'%s' must be 'none', 'auto' or {\"name\": ...}, got '%.40s'",
                           key, c);
        else
            return API_BAD(err, key,
                           "'%s' must be 'none', 'auto', 'required' or a function, got '%.40s'",
                           key, c);
        return 0;
    }
    if (!json_is_object(tc)) return api_type_error(err, key, "a string or an object", tc);
    const json_t *fn = legacy ? tc : json_object_get(tc, "function");
    const json_t *name = json_is_object(fn) ? json_object_get(fn, "name") : NULL;
    if (!json_is_string(name))
        return API_BAD(err, key, "'%s' must be %s", key,
                       legacy ? "{\"name\": ...}"
                              : "{\"type\": \"function\", \"function\": {\"name\": ...}}");
    if (api_str_copy(name, key, &r->tool_choice_name, err)) return -1;
    bool found = false;
    for (int i = 0; i < r->n_tools; i++) found |= !strcmp(r->tools[i].name, r->tool_choice_name);
    if (!found)
        return API_BAD(err, key, "'%s' names '%.64s', which is not in '%s'", key,
                       r->tool_choice_name, legacy ? "functions" : "tools");
    r->tool_choice = CHAT_TOOL_NAMED;
    return 0;
}

/* tools and tool_choice, or the legacy functions and function_call that OpenAI still takes
 * (mapped onto tools: one call per answer, given back as message.function_call). */
static int parse_tools(const json_t *root, api_request *r, api_error *err) {
    const json_t *tools = api_field(root, "tools"), *functions = api_field(root, "functions");
    const json_t *choice = api_field(root, "tool_choice"), *call = api_field(root, "function_call");
    if (tools && functions)
        return API_BAD(err, "functions",
                       "'functions' is the deprecated form of 'tools': give one of them");
    if (choice && call)
        return API_BAD(err, "function_call",
                       "'function_call' is the deprecated form of 'tool_choice': give one of them");
    r->legacy_functions = functions || (call && !tools);
    r->parallel_tool_calls = !r->legacy_functions;
    if (api_opt_bool(root, "parallel_tool_calls", &r->parallel_tool_calls, err) < 0) return -1;
    if (r->legacy_functions) r->parallel_tool_calls = false; /* one function_call per answer */
    if (tools && parse_tool_list(tools, "tools", r, err)) return -1;
    if (functions && parse_tool_list(functions, "functions", r, err)) return -1;
    r->tool_choice = r->n_tools > 0 ? CHAT_TOOL_AUTO : CHAT_TOOL_NONE;
    if (choice && parse_tool_choice(choice, "tool_choice", r, err)) return -1;
    if (call && parse_tool_choice(call, "function_call", r, err)) return -1;
    if (r->tool_choice == CHAT_TOOL_REQUIRED && r->n_tools == 0)
        return API_BAD(err, "tool_choice", "'tool_choice' is 'required' but there are no 'tools'");
    return 0;
}

/* ---------------------------------------------------------------- requests */

/* kvserve's own fields: the context cache's choices and vLLM's ignore_eos. */
int api_parse_extensions(const json_t *root, api_request *r, api_error *err) {
    if (api_opt_bool(root, "cache", &r->cache, err) < 0) return -1;
    if (api_opt_bool(root, "ignore_eos", &r->ignore_eos, err) < 0) return -1;
    if (api_opt_bool(root, "speculative", &r->speculative, err) < 0) return -1;
    if (api_opt_string(root, "cache_salt", &r->cache_salt, err) < 0) return -1;
    if (r->cache_salt && strlen(r->cache_salt) > API_MAX_CACHE_SALT)
        return API_BAD(err, "cache_salt", "'cache_salt' is longer than %d bytes",
                       API_MAX_CACHE_SALT);
    bool blend = false;
    int got_blend = api_opt_bool(root, "blend", &blend, err);
    if (got_blend < 0) return -1;
    if (got_blend) r->blend = blend;
    if (api_opt_number(root, "blend_ratio", 0, 1, false, &r->blend_ratio, err) < 0) return -1;
    char *policy = NULL;
    if (api_opt_string(root, "blend_policy", &policy, err) < 0) return -1;
    if (policy) {
        r->blend_policy = blend_policy_parse(policy);
        free(policy);
        if (r->blend_policy < 0)
            return API_BAD(err, "blend_policy", "'blend_policy' must be hkvd, legolink or hybrid");
    }
    if (api_opt_bool(root, "kv_lossless", &r->kv_lossless, err) < 0) return -1;
    if (api_opt_int(root, "ttft_budget_ms", 0, 3600000, &r->ttft_budget_ms, err) < 0) return -1;
    char *level = NULL;
    if (api_opt_string(root, "kv_level", &level, err) < 0) return -1;
    if (level) {
        r->kv_level = cache_enc_parse(level);
        free(level);
        if (r->kv_level == CACHE_ENC_ANY)
            return API_BAD(err, "kv_level",
                           "'kv_level' must be lossless, q8, codec0 to codec%d, or text",
                           CACHE_ENC_MAX - CACHE_ENC_CODEC - 1);
    }
    bool fixup = false;
    int got_fixup = api_opt_bool(root, "fixup", &fixup, err);
    if (got_fixup < 0) return -1;
    if (got_fixup) r->fixup = fixup;
    if (api_opt_number(root, "fixup_ratio", 0, 1, false, &r->fixup_ratio, err) < 0) return -1;
    return 0;
}

/* OpenAI's Predicted Outputs: {"type": "content", "content": a string or text parts}. */
static int parse_prediction(const json_t *v, api_request *r, api_error *err) {
    if (!json_is_object(v)) return api_type_error(err, "prediction", "an object", v);
    const json_t *type = json_object_get(v, "type"), *content = json_object_get(v, "content");
    if (!type) return API_BAD(err, "prediction.type", "'prediction.type' is required");
    if (!json_is_string(type) || strcmp(json_string_value(type), "content") != 0 ||
        json_string_length(type) != strlen("content"))
        return API_BAD(err, "prediction.type", "'prediction.type' must be 'content'");
    if (!content) return API_BAD(err, "prediction.content", "'prediction.content' is required");
    if (json_is_string(content))
        return api_str_copy(content, "prediction.content", &r->prediction, err);
    if (!json_is_array(content))
        return api_type_error(err, "prediction.content", "a string or an array of text parts",
                              content);
    size_t n = json_array_size(content), total = 0;
    for (size_t j = 0; j < n; j++) {
        const json_t *part = json_array_get(content, j);
        char pp[64];
        snprintf(pp, sizeof pp, "prediction.content[%zu]", j);
        const json_t *pt = json_is_object(part) ? json_object_get(part, "type") : NULL;
        const json_t *text = json_is_object(part) ? json_object_get(part, "text") : NULL;
        if (!json_is_string(pt) || strcmp(json_string_value(pt), "text") != 0 ||
            !json_is_string(text))
            return API_BAD(err, pp, "'%s' must be {\"type\": \"text\", \"text\": a string}", pp);
        size_t len = json_string_length(text);
        if (memchr(json_string_value(text), '\0', len))
            return API_BAD(err, pp, "'%s' must not contain NUL characters (\\u0000)", pp);
        if (size_add(total, len, &total)) return api_oom(err);
    }
    if (!(r->prediction = malloc(total + 1))) return api_oom(err);
    size_t off = 0;
    for (size_t j = 0; j < n; j++) {
        const json_t *text = json_object_get(json_array_get(content, j), "text");
        memcpy(r->prediction + off, json_string_value(text), json_string_length(text));
        off += json_string_length(text);
    }
    r->prediction[off] = '\0';
    return 0;
}

static int parse_request_fields(const json_t *root, api_request *r, api_error *err) {
    const json_t *model = api_field(root, "model");
    if (!model) return API_BAD(err, "model", "'model' is required");
    if (api_str_copy(model, "model", &r->model, err)) return -1;

    /* Prompt Cache: a prompt in PML (a string) or its JSON form (an object); messages or prompt
     * then add free text after it and may be left out */
    const json_t *sp = api_field(root, "schema_prompt");
    if (sp && json_is_string(sp)) {
        if (api_str_copy(sp, "schema_prompt", &r->schema_prompt, err)) return -1;
    } else if (sp && json_is_object(sp)) {
        if (!(r->schema_prompt = json_dumps(sp, JSON_COMPACT | JSON_PRESERVE_ORDER)))
            return api_fail(err, 500, "server_error", NULL, "schema_prompt", "out of memory");
        r->schema_prompt_json = true;
    } else if (sp) {
        return api_type_error(err, "schema_prompt", "a PML string or an object", sp);
    }
    if (r->kind == API_CHAT) {
        const json_t *msgs = api_field(root, "messages");
        if (!msgs && !sp) return API_BAD(err, "messages", "'messages' is required");
        if (msgs && !(sp && json_is_array(msgs) && json_array_size(msgs) == 0) &&
            parse_messages(msgs, &r->messages, &r->n_messages, err))
            return -1;
    } else {
        const json_t *prompt = api_field(root, "prompt");
        if (!prompt && !sp) return API_BAD(err, "prompt", "'prompt' is required");
        if (prompt &&
            parse_prompts(prompt, "prompt", API_MAX_PROMPTS, &r->prompts, &r->n_prompts, err))
            return -1;
        if (api_opt_bool(root, "echo", &r->echo, err) < 0) return -1;
    }

    /* max_tokens 0 is meaningful only with echo: the prompt back (with its logprobs), the way
     * evaluation harnesses score text. */
    const int64_t min_tokens = r->kind == API_COMPLETION && r->echo ? 0 : 1;
    int64_t v;
    int got = api_opt_int(root, "max_tokens", min_tokens, INT32_MAX, &v, err);
    if (got < 0) return -1;
    if (got) r->max_tokens = (int)v;
    got = api_opt_int(root, "max_completion_tokens", min_tokens, INT32_MAX, &v, err);
    if (got < 0) return -1;
    if (got) r->max_tokens = (int)v; /* OpenAI's newer name wins over the deprecated one */
    got = api_opt_int(root, "n", 1, API_MAX_N, &v, err);
    if (got < 0) return -1;
    if (got) r->n = (int)v;

    if (api_opt_bool(root, "stream", &r->stream, err) < 0) return -1;
    const json_t *so = api_field(root, "stream_options");
    if (so) {
        if (!json_is_object(so)) return api_type_error(err, "stream_options", "an object", so);
        const json_t *iu = api_field(so, "include_usage");
        if (iu && !json_is_boolean(iu))
            return api_type_error(err, "stream_options.include_usage", "a boolean", iu);
        /* OpenAI refuses stream_options without stream; we ignore them, as vLLM does. */
        r->include_usage = r->stream && iu && json_is_true(iu);
    }

    if (parse_logprobs(root, r, err)) return -1;
    if (api_parse_sampling(root, r, err)) return -1;
    if (api_opt_string(root, "user", &r->user, err) < 0) return -1;
    if (api_parse_extensions(root, r, err)) return -1;
    const json_t *pred = api_field(root, "prediction");
    if (pred && parse_prediction(pred, r, err)) return -1;
    if (parse_constraints(root, r, err)) return -1;
    if (r->kind == API_CHAT && parse_tools(root, r, err)) return -1;
    /* The calls' grammar depends on the model's tool format: openai.c builds it. */
    if (r->tool_choice != CHAT_TOOL_NONE && r->gbnf)
        return API_BAD(err, "tool_choice",
                       "tools may be called only without '%s' (or with tool_choice 'none')",
                       r->gbnf_param);
    return 0;
}

void api_request_init(api_kind kind, api_request *out) {
    memset(out, 0, sizeof *out);
    out->kind = kind;
    out->max_tokens = -1;
    out->n = 1;
    out->cache = true;
    out->blend = -1;
    out->blend_ratio = -1;
    out->blend_policy = -1;
    out->kv_level = CACHE_ENC_ANY;
    out->ttft_budget_ms = -1;
    out->fixup = -1;
    out->fixup_ratio = -1;
    out->jump_forward = true;
    out->speculative = true;
    sampler_params_default(&out->sampling);
}

int api_parse_request(api_kind kind, const char *body, size_t len, api_request *out,
                      api_error *err) {
    api_request_init(kind, out);
    if (kind != API_CHAT && kind != API_COMPLETION)
        return api_fail(err, 500, "server_error", NULL, "", "unknown request kind %d", (int)kind);

    json_t *root = api_parse_body(body, len, err);
    if (!root) return -1;
    int rc = parse_request_fields(root, out, err);
    json_decref(root);
    if (rc) api_request_free(out);
    return rc;
}

void api_request_free(api_request *r) {
    if (!r) return;
    free(r->model);
    messages_free(r->messages, r->n_messages);
    for (int i = 0; i < r->n_prompts; i++) {
        free(r->prompts[i].text);
        free(r->prompts[i].tokens);
    }
    free(r->prompts);
    free(r->bias);
    for (int i = 0; i < API_MAX_STOPS; i++) free(r->stops[i]);
    free(r->user);
    free(r->cache_salt);
    free(r->schema_prompt);
    free(r->prediction);
    free(r->gbnf);
    for (int i = 0; i < r->n_tools; i++) {
        free((char *)r->tools[i].name);
        free((char *)r->tools[i].description);
        free((char *)r->tools[i].parameters);
    }
    free(r->tools);
    free(r->tool_choice_name);
    memset(r, 0, sizeof *r);
}

/* ---------------------------------------------------------------- embeddings */

static void prompts_free(api_prompt *p, int n) {
    for (int i = 0; i < n; i++) {
        free(p[i].text);
        free(p[i].tokens);
    }
    free(p);
}

static int parse_embeddings_fields(const json_t *root, api_embeddings *e, api_error *err) {
    const json_t *model = api_field(root, "model");
    if (!model) return API_BAD(err, "model", "'model' is required");
    if (api_str_copy(model, "model", &e->model, err)) return -1;
    const json_t *input = api_field(root, "input");
    if (!input) return API_BAD(err, "input", "'input' is required");
    if (parse_prompts(input, "input", API_MAX_EMBED_INPUTS, &e->inputs, &e->n_inputs, err))
        return -1;
    for (int i = 0; i < e->n_inputs; i++)
        if (e->inputs[i].text && !e->inputs[i].text[0]) {
            char pp[32];
            snprintf(pp, sizeof pp, e->n_inputs > 1 ? "input[%d]" : "input", i);
            return API_BAD(err, pp, "'%s' must not be an empty string", pp);
        }
    char *fmt = NULL;
    if (api_opt_string(root, "encoding_format", &fmt, err) < 0) return -1;
    if (fmt) {
        bool ok = !strcmp(fmt, "float") || !strcmp(fmt, "base64");
        e->base64 = !strcmp(fmt, "base64");
        free(fmt);
        if (!ok)
            return API_BAD(err, "encoding_format", "'encoding_format' must be 'float' or 'base64'");
    }
    int64_t v;
    int got = api_opt_int(root, "dimensions", 1, INT32_MAX, &v, err);
    if (got < 0) return -1;
    if (got) e->dimensions = (int)v;
    return api_opt_string(root, "user", &e->user, err) < 0 ? -1 : 0;
}

int api_parse_embeddings(const char *body, size_t len, api_embeddings *out, api_error *err) {
    memset(out, 0, sizeof *out);
    json_t *root = api_parse_body(body, len, err);
    if (!root) return -1;
    int rc = parse_embeddings_fields(root, out, err);
    json_decref(root);
    if (rc) api_embeddings_free(out);
    return rc;
}

void api_embeddings_free(api_embeddings *e) {
    if (!e) return;
    free(e->model);
    prompts_free(e->inputs, e->n_inputs);
    free(e->user);
    memset(e, 0, sizeof *e);
}

/* ---------------------------------------------------------------- tokenize, detokenize */

static int parse_tokenize_fields(const json_t *root, api_tokenize *t, api_error *err) {
    const json_t *msgs = api_field(root, "messages");
    const json_t *content = api_field(root, "content");
    const char *key = "content";
    if (!content) {
        content = api_field(root, "prompt");
        key = "prompt";
    }
    if (msgs && content)
        return API_BAD(err, "messages", "give either '%s' or 'messages', not both", key);
    if (msgs) {
        t->add_special = false; /* the chat template spells its own special tokens */
        if (parse_messages(msgs, &t->messages, &t->n_messages, err)) return -1;
    } else if (content) {
        t->add_special = true;
        if (api_str_copy(content, key, &t->text, err)) return -1;
    } else {
        return API_BAD(err, "content", "'content' (or 'prompt', or 'messages') is required");
    }
    if (api_opt_bool(root, "add_special", &t->add_special, err) < 0) return -1;
    if (api_opt_bool(root, "add_special_tokens", &t->add_special, err) < 0) return -1;
    if (api_opt_bool(root, "with_pieces", &t->with_pieces, err) < 0) return -1;
    return 0;
}

int api_parse_tokenize(const char *body, size_t len, api_tokenize *out, api_error *err) {
    memset(out, 0, sizeof *out);
    json_t *root = api_parse_body(body, len, err);
    if (!root) return -1;
    int rc = parse_tokenize_fields(root, out, err);
    json_decref(root);
    if (rc) api_tokenize_free(out);
    return rc;
}

void api_tokenize_free(api_tokenize *t) {
    if (!t) return;
    free(t->text);
    messages_free(t->messages, t->n_messages);
    memset(t, 0, sizeof *t);
}

int api_parse_detokenize(const char *body, size_t len, int32_t **tokens, int *n_tokens,
                         api_error *err) {
    *tokens = NULL;
    *n_tokens = 0;
    json_t *root = api_parse_body(body, len, err);
    if (!root) return -1;
    int rc = 0;
    const json_t *v = api_field(root, "tokens");
    if (!v)
        rc = API_BAD(err, "tokens", "'tokens' is required");
    else if (!json_is_array(v))
        rc = api_type_error(err, "tokens", "an array of token ids", v);
    else
        rc = parse_token_array(v, "tokens", tokens, n_tokens, err);
    json_decref(root);
    return rc;
}

/* ---------------------------------------------------------------- shared (api_impl.h)
 *
 * The field checks above (api_field, api_opt_*, ...) are api_impl.h's own; these need one
 * more step. */

int api_schema_field(const json_t *schema, const char *param, api_request *r, api_error *err) {
    return schema_field(schema, param, false, r, err);
}

int api_tool_schema(const json_t *schema, const char *param, char **out, api_error *err) {
    if (!json_is_object(schema)) return api_type_error(err, param, "a JSON Schema object", schema);
    if (!(*out = json_dumps(schema, JSON_COMPACT))) return api_oom(err);
    /* the schema must compile: an unsupported keyword is named now */
    kv_error ke = {{0}};
    char *g = json_schema_to_gbnf(*out, strlen(*out), &ke);
    if (!g) return API_BAD(err, param, "'%s': %s", param, ke.msg);
    free(g);
    return 0;
}
