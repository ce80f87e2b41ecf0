/* The Responses API's request side (responses.h): a body validated field by field with the chat
 * request's helpers (api_impl.h: the same types, ranges and messages), its input items put in
 * canonical form, and canonical items translated into chat messages.
 *
 * Field by field as OpenAI's API reference for POST /v1/responses defines it. What this server
 * cannot do is refused by name rather than dropped: a field asking for it is a 400 unless it
 * holds the API's default (background false, include [], truncation "disabled", reasoning effort
 * "none", ...). Hints that change nothing here (prompt_cache_key, prompt_cache_retention,
 * safety_identifier, max_tool_calls: it bounds built-in tools, which this server has none of)
 * are checked and repeated in the response object. */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/grammar/grammar.h"
#include "server/api/api_impl.h"
#include "server/api/responses.h"

/* ---------------------------------------------------------------- helpers */

/* v is a string without NUL (handed out as a C string, "a\u0000b" would be cut). */
static int text_check(const json_t *v, const char *param, api_error *err) {
    if (!json_is_string(v)) return api_type_error(err, param, "a string", v);
    if (memchr(json_string_value(v), '\0', json_string_length(v)))
        return API_BAD(err, param, "'%s' must not contain NUL characters (\\u0000)", param);
    return 0;
}

/* A string field that may only hold one of the values in ok (NULL-terminated) or be absent. */
static int only_values(const json_t *obj, const char *key, const char *param, const char *const *ok,
                       const char *why, api_error *err) {
    const json_t *v = api_field(obj, key);
    if (!v) return 0;
    if (text_check(v, param, err)) return -1;
    for (int i = 0; ok[i]; i++)
        if (strcmp(json_string_value(v), ok[i]) == 0) return 0;
    return API_BAD(err, param, "'%s' '%.40s' is not supported: %s", param, json_string_value(v),
                   why);
}

static int set_new(json_t *obj, const char *key, json_t *v, api_error *err) {
    if (!v || json_object_set_new(obj, key, v)) return api_oom(err);
    return 0;
}

/* obj[key] (absent or null: null) into echo[key]. */
static int echo_field(json_t *echo, const json_t *obj, const char *key, api_error *err) {
    const json_t *v = api_field(obj, key);
    return set_new(echo, key, v ? json_deep_copy(v) : json_null(), err);
}

/* ---------------------------------------------------------------- what is refused */

/* Chat Completions fields sent here by mistake: each is named with the Responses API's own. */
static int refuse_chat_fields(const json_t *root, api_error *err) {
    static const struct {
        const char *key, *instead;
    } CHAT[] = {
        {"messages", "'input' (a string, or a list of messages and other items)"},
        {"max_tokens", "'max_output_tokens'"},
        {"max_completion_tokens", "'max_output_tokens'"},
        {"response_format", "'text.format'"},
        {"functions", "'tools' ({\"type\": \"function\", \"name\", \"parameters\"})"},
        {"function_call", "'tool_choice'"},
        {"n", "nothing: a response has one answer"},
    };
    for (size_t i = 0; i < sizeof CHAT / sizeof CHAT[0]; i++)
        if (json_object_get(root, CHAT[i].key))
            return API_BAD(err, CHAT[i].key,
                           "'%s' is a Chat Completions parameter; the Responses API takes %s",
                           CHAT[i].key, CHAT[i].instead);
    return 0;
}

/* The API's fields for what this server does not run: only their defaults pass. */
static int refuse_unsupported(const json_t *root, api_error *err) {
    const json_t *v;
    bool b = false;
    if (api_opt_bool(root, "background", &b, err) < 0) return -1;
    if (b)
        return API_BAD(err, "background",
                       "'background' responses are not supported: this server answers within the "
                       "request (or its stream)");
    if (api_field(root, "conversation"))
        return API_BAD(err, "conversation",
                       "'conversation' is not supported: continue a conversation with "
                       "'previous_response_id', or send its items in 'input'");
    if (api_field(root, "prompt"))
        return API_BAD(err, "prompt", "reusable prompts ('prompt') are not supported");
    if ((v = api_field(root, "include"))) {
        if (!json_is_array(v)) return api_type_error(err, "include", "an array of strings", v);
        if (json_array_size(v) > 0) {
            const json_t *first = json_array_get(v, 0);
            return API_BAD(err, "include[0]",
                           "'include' value '%.60s' is not supported: this server returns no "
                           "reasoning, logprobs, images or built-in tools' results",
                           json_is_string(first) ? json_string_value(first) : "(not a string)");
        }
    }
    if ((v = api_field(root, "reasoning"))) {
        if (!json_is_object(v)) return api_type_error(err, "reasoning", "an object", v);
        static const char *const NONE[] = {"none", NULL};
        if (only_values(v, "effort", "reasoning.effort", NONE,
                        "this server's models do not reason (only 'none')", err))
            return -1;
        if (api_field(v, "summary"))
            return API_BAD(err, "reasoning.summary",
                           "'reasoning.summary' is not supported: there is no reasoning to sum up");
        if (api_field(v, "generate_summary"))
            return API_BAD(err, "reasoning.generate_summary",
                           "'reasoning.generate_summary' is not supported: there is no reasoning "
                           "to sum up");
    }
    static const char *const TIERS[] = {"auto", "default", NULL};
    if (only_values(root, "service_tier", "service_tier", TIERS, "only 'auto' and 'default'", err))
        return -1;
    static const char *const DISABLED[] = {"disabled", NULL};
    if (only_values(root, "truncation", "truncation", DISABLED,
                    "nothing is dropped from a conversation: one over the context is a 400 "
                    "(context_length_exceeded)",
                    err))
        return -1;
    int64_t n = 0;
    if (api_opt_int(root, "top_logprobs", 0, 20, &n, err) < 0) return -1;
    if (n > 0)
        return API_BAD(err, "top_logprobs", "'top_logprobs' is not supported: no logprobs output");
    static const char *const RETENTION[] = {"in_memory", "24h", NULL};
    if (only_values(root, "prompt_cache_retention", "prompt_cache_retention", RETENTION,
                    "only 'in_memory' and '24h'", err))
        return -1;
    if ((v = api_field(root, "stream_options"))) {
        if (!json_is_object(v)) return api_type_error(err, "stream_options", "an object", v);
        /* the obfuscation field pads deltas against length side channels; none is sent here */
        if (api_opt_bool(v, "include_obfuscation", &b, err) < 0) return -1;
    }
    return 0;
}

/* ---------------------------------------------------------------- input items */

/* A message's content as canonical parts (strings): a string, or an array of input_text,
 * output_text (and an assistant's refusal) parts. */
static json_t *content_parts(const json_t *v, const char *param, api_error *err) {
    json_t *parts = json_array();
    if (!parts) return api_oom(err), NULL;
    if (json_is_string(v)) {
        if (text_check(v, param, err)) goto fail;
        if (json_array_append(parts, (json_t *)v)) goto oom;
        return parts;
    }
    if (!json_is_array(v)) {
        api_type_error(err, param, "a string or an array of content parts", v);
        goto fail;
    }
    size_t j;
    const json_t *part;
    json_array_foreach(v, j, part) {
        char pp[96], pt[112];
        snprintf(pp, sizeof pp, "%.60s[%zu]", param, j);
        snprintf(pt, sizeof pt, "%s.type", pp);
        if (!json_is_object(part)) {
            api_type_error(err, pp, "an object", part);
            goto fail;
        }
        const json_t *type = json_object_get(part, "type");
        if (text_check(type, pt, err)) goto fail;
        const char *t = json_string_value(type);
        const char *key = !strcmp(t, "input_text") || !strcmp(t, "output_text") ? "text"
                          : !strcmp(t, "refusal")                               ? "refusal"
                                                                                : NULL;
        if (!key) {
            bool media =
                !strcmp(t, "input_image") || !strcmp(t, "input_file") || !strcmp(t, "input_audio");
            API_BAD(err, pt, "content part type '%.40s' is not supported%s", t,
                    media ? ": this server's models read text only"
                          : " (input_text, output_text or refusal)");
            goto fail;
        }
        snprintf(pt, sizeof pt, "%s.%s", pp, key);
        const json_t *text = json_object_get(part, key);
        if (!text) {
            API_BAD(err, pt, "'%s' is required", pt);
            goto fail;
        }
        if (text_check(text, pt, err)) goto fail;
        if (json_array_append(parts, (json_t *)text)) goto oom;
    }
    return parts;
oom:
    api_oom(err);
fail:
    json_decref(parts);
    return NULL;
}

/* A required string field of item it (param "input[i].key") without NUL. */
static const json_t *item_text(const json_t *it, const char *key, int i, api_error *err) {
    char p[64];
    snprintf(p, sizeof p, "input[%d].%s", i, key);
    const json_t *v = json_object_get(it, key);
    if (!v) return API_BAD(err, p, "'%s' is required", p), NULL;
    return text_check(v, p, err) ? NULL : v;
}

static json_t *message_item(const json_t *it, int i, api_error *err) {
    char p[64];
    const json_t *role = item_text(it, "role", i, err);
    if (!role) return NULL;
    const char *r = json_string_value(role);
    const char *canon = !strcmp(r, "developer") ? "system" : r;
    snprintf(p, sizeof p, "input[%d].role", i);
    if (strcmp(canon, "system") && strcmp(canon, "user") && strcmp(canon, "assistant"))
        return API_BAD(err, p,
                       "unknown role '%.40s' (expected user, assistant, system or developer; a "
                       "function's result is a function_call_output item)",
                       r),
               NULL;
    snprintf(p, sizeof p, "input[%d].content", i);
    const json_t *content = json_object_get(it, "content");
    if (!content) return API_BAD(err, p, "'%s' is required", p), NULL;
    json_t *parts = content_parts(content, p, err);
    if (!parts) return NULL;
    json_t *m = json_pack("{s:s,s:s,s:o}", "type", "message", "role", canon, "content", parts);
    if (!m) api_oom(err);
    return m;
}

static json_t *call_item(const json_t *it, int i, api_error *err) {
    char p[64];
    const json_t *id = item_text(it, "call_id", i, err), *name, *args;
    if (!id || !(name = item_text(it, "name", i, err)) ||
        !(args = item_text(it, "arguments", i, err)))
        return NULL;
    if (!api_tool_name_ok(json_string_value(name), json_string_length(name))) {
        snprintf(p, sizeof p, "input[%d].name", i);
        return API_BAD(err, p, "'%s' must be 1 to 64 of a-z, A-Z, 0-9, _ and -", p), NULL;
    }
    if (json_string_length(id) == 0) {
        snprintf(p, sizeof p, "input[%d].call_id", i);
        return API_BAD(err, p, "'%s' must not be empty", p), NULL;
    }
    /* the chat template writes the parsed arguments, so they must parse ("" stands for {}) */
    if (json_string_length(args) > 0) {
        json_error_t je;
        json_t *parsed = json_loads(json_string_value(args), JSON_DECODE_ANY, &je);
        if (!parsed) {
            snprintf(p, sizeof p, "input[%d].arguments", i);
            return API_BAD(err, p, "'%s' is not JSON: %s", p, je.text), NULL;
        }
        json_decref(parsed);
    }
    json_t *c = json_pack("{s:s,s:O,s:O,s:O}", "type", "function_call", "call_id", id, "name", name,
                          "arguments", args);
    if (!c) api_oom(err);
    return c;
}

static json_t *output_item(const json_t *it, int i, api_error *err) {
    char p[64];
    const json_t *id = item_text(it, "call_id", i, err);
    if (!id) return NULL;
    snprintf(p, sizeof p, "input[%d].output", i);
    const json_t *out = json_object_get(it, "output");
    if (!out) return API_BAD(err, p, "'%s' is required", p), NULL;
    /* the output as a string, or as text parts (joined) */
    json_t *parts = content_parts(out, p, err);
    if (!parts) return NULL;
    size_t k, total = 0;
    json_t *s;
    json_array_foreach(parts, k, s) total += json_string_length(s);
    char *text = malloc(total + 1);
    if (!text) {
        json_decref(parts);
        return api_oom(err), NULL;
    }
    total = 0;
    json_array_foreach(parts, k, s) {
        memcpy(text + total, json_string_value(s), json_string_length(s));
        total += json_string_length(s);
    }
    json_decref(parts);
    json_t *o = json_pack("{s:s,s:O,s:s%}", "type", "function_call_output", "call_id", id, "output",
                          text, total);
    free(text);
    if (!o) api_oom(err);
    return o;
}

/* Input item i in canonical form (responses.h), or NULL with err. */
static json_t *item_canonical(const json_t *it, int i, api_error *err) {
    char p[64];
    snprintf(p, sizeof p, "input[%d]", i);
    if (!json_is_object(it)) return api_type_error(err, p, "an object", it), NULL;
    const json_t *type = json_object_get(it, "type");
    snprintf(p, sizeof p, "input[%d].type", i);
    if (!type) {
        if (json_object_get(it, "role")) return message_item(it, i, err);
        return API_BAD(err, p, "'%s' is required (or 'role', for a message)", p), NULL;
    }
    if (text_check(type, p, err)) return NULL;
    const char *t = json_string_value(type);
    if (!strcmp(t, "message")) return message_item(it, i, err);
    if (!strcmp(t, "function_call")) return call_item(it, i, err);
    if (!strcmp(t, "function_call_output")) return output_item(it, i, err);
    if (!strcmp(t, "item_reference"))
        return API_BAD(err, p,
                       "item references are not supported: send the item itself, or continue "
                       "with 'previous_response_id'"),
               NULL;
    if (!strcmp(t, "reasoning"))
        return API_BAD(err, p,
                       "reasoning items are not supported: this server's models do not "
                       "reason"),
               NULL;
    return API_BAD(err, p,
                   "input item type '%.40s' is not supported (message, function_call or "
                   "function_call_output)",
                   t),
           NULL;
}

static int parse_input(const json_t *root, resp_request *out, api_error *err) {
    const json_t *v = api_field(root, "input");
    if (!v) return API_BAD(err, "input", "'input' is required");
    if (!(out->input = json_array())) return api_oom(err);
    if (json_is_string(v)) {
        if (text_check(v, "input", err)) return -1;
        json_t *m = json_pack("{s:s,s:s,s:[O]}", "type", "message", "role", "user", "content", v);
        return m ? (json_array_append_new(out->input, m) ? api_oom(err) : 0) : api_oom(err);
    }
    if (!json_is_array(v))
        return api_type_error(err, "input", "a string or an array of input items", v);
    size_t n = json_array_size(v);
    if (n == 0) return API_BAD(err, "input", "'input' must not be empty");
    if (n > INT_MAX / 4) return API_BAD(err, "input", "'input' has too many items (%zu)", n);
    for (size_t i = 0; i < n; i++) {
        json_t *c = item_canonical(json_array_get(v, i), (int)i, err);
        if (!c) return -1;
        if (json_array_append_new(out->input, c)) return api_oom(err);
    }
    return 0;
}

/* ---------------------------------------------------------------- tools and text */

/* tools (function tools, flat: {"type": "function", "name", "description", "parameters",
 * "strict"}), tool_choice and parallel_tool_calls. */
static int parse_tools(const json_t *root, resp_request *out, api_error *err) {
    api_request *rq = &out->rq;
    json_t *echo_tools = json_array();
    if (set_new(out->echo, "tools", echo_tools, err)) return -1;
    const json_t *tools = api_field(root, "tools");
    if (tools) {
        if (!json_is_array(tools)) return api_type_error(err, "tools", "an array", tools);
        size_t n = json_array_size(tools);
        if (n > API_MAX_TOOLS)
            return API_BAD(err, "tools", "'tools' has %zu tools, more than the limit of %d", n,
                           API_MAX_TOOLS);
        if (n > 0 && !(rq->tools = calloc(n, sizeof *rq->tools))) return api_oom(err);
        for (size_t i = 0; i < n; i++) {
            const json_t *t = json_array_get(tools, i);
            char pp[32], pt[48];
            snprintf(pp, sizeof pp, "tools[%zu]", i);
            snprintf(pt, sizeof pt, "tools[%zu].type", i);
            if (!json_is_object(t)) return api_type_error(err, pp, "an object", t);
            const json_t *type = json_object_get(t, "type");
            if (text_check(type, pt, err)) return -1;
            if (strcmp(json_string_value(type), "function") != 0)
                return API_BAD(err, pt,
                               "tool type '%.40s' is not supported: this server runs function "
                               "tools only (built-in tools such as web_search and file_search "
                               "are OpenAI's)",
                               json_string_value(type));
            if (api_parse_function(t, pp, i, rq, err)) return -1;
            /* a function's calls always follow its parameters here (a grammar), strict or not;
             * the Responses API's default is strict */
            bool strict = true;
            snprintf(pt, sizeof pt, "tools[%zu].strict", i);
            const json_t *sv = api_field(t, "strict");
            if (sv && !json_is_boolean(sv)) return api_type_error(err, pt, "a boolean", sv);
            if (sv) strict = json_is_true(sv);
            const json_t *params = api_field(t, "parameters");
            json_t *e = json_pack("{s:s,s:s,s:s?,s:O?,s:b}", "type", "function", "name",
                                  rq->tools[i].name, "description", rq->tools[i].description,
                                  "parameters", params, "strict", strict);
            if (!e || json_array_append_new(echo_tools, e)) return api_oom(err);
        }
    }
    rq->parallel_tool_calls = true;
    if (api_opt_bool(root, "parallel_tool_calls", &rq->parallel_tool_calls, err) < 0) return -1;
    if (set_new(out->echo, "parallel_tool_calls", json_boolean(rq->parallel_tool_calls), err))
        return -1;
    rq->tool_choice = rq->n_tools > 0 ? CHAT_TOOL_AUTO : CHAT_TOOL_NONE;
    const json_t *tc = api_field(root, "tool_choice");
    if (!tc) return set_new(out->echo, "tool_choice", json_string("auto"), err);
    if (json_is_string(tc)) {
        if (text_check(tc, "tool_choice", err)) return -1;
        const char *c = json_string_value(tc);
        if (!strcmp(c, "none"))
            rq->tool_choice = CHAT_TOOL_NONE;
        else if (!strcmp(c, "required"))
            rq->tool_choice = CHAT_TOOL_REQUIRED;
        else if (strcmp(c, "auto") != 0)
            return API_BAD(err, "tool_choice",
                           "'tool_choice' must be 'none', 'auto', 'required' or {\"type\": "
                           "\"function\", \"name\": ...}, got '%.40s'",
                           c);
        if (rq->tool_choice == CHAT_TOOL_REQUIRED && rq->n_tools == 0)
            return API_BAD(err, "tool_choice",
                           "'tool_choice' is 'required' but there are no 'tools'");
        return set_new(out->echo, "tool_choice", json_deep_copy(tc), err);
    }
    if (!json_is_object(tc)) return api_type_error(err, "tool_choice", "a string or an object", tc);
    const json_t *type = json_object_get(tc, "type");
    if (text_check(type, "tool_choice.type", err)) return -1;
    if (strcmp(json_string_value(type), "function") != 0)
        return API_BAD(err, "tool_choice.type",
                       "'tool_choice.type' '%.40s' is not supported: this server runs function "
                       "tools only ({\"type\": \"function\", \"name\": ...})",
                       json_string_value(type));
    const json_t *name = json_object_get(tc, "name");
    if (text_check(name, "tool_choice.name", err)) return -1;
    if (api_str_copy(name, "tool_choice.name", &rq->tool_choice_name, err)) return -1;
    bool found = false;
    for (int i = 0; i < rq->n_tools; i++) found |= !strcmp(rq->tools[i].name, rq->tool_choice_name);
    if (!found)
        return API_BAD(err, "tool_choice.name", "'tool_choice.name' '%.64s' is not in 'tools'",
                       rq->tool_choice_name);
    rq->tool_choice = CHAT_TOOL_NAMED;
    return set_new(out->echo, "tool_choice",
                   json_pack("{s:s,s:s}", "type", "function", "name", rq->tool_choice_name), err);
}

/* text: {"format": {"type": "text" | "json_object" | "json_schema", ...}, "verbosity"}. */
static int parse_text(const json_t *root, resp_request *out, api_error *err) {
    const char *P = "text.format";
    const json_t *text = api_field(root, "text");
    const json_t *fmt = NULL;
    if (text) {
        if (!json_is_object(text)) return api_type_error(err, "text", "an object", text);
        static const char *const MEDIUM[] = {"medium", NULL};
        if (only_values(text, "verbosity", "text.verbosity", MEDIUM, "only 'medium'", err))
            return -1;
        fmt = api_field(text, "format");
    }
    json_t *echo_fmt = NULL;
    if (!fmt) {
        echo_fmt = json_pack("{s:s}", "type", "text");
    } else {
        if (!json_is_object(fmt)) return api_type_error(err, P, "an object", fmt);
        const json_t *type = json_object_get(fmt, "type");
        if (text_check(type, "text.format.type", err)) return -1;
        const char *t = json_string_value(type);
        if (!strcmp(t, "text")) {
            echo_fmt = json_pack("{s:s}", "type", "text");
        } else if (!strcmp(t, "json_object")) {
            char *g = strdup(json_object_gbnf());
            if (!g) return api_oom(err);
            if (api_set_gbnf(&out->rq, P, g, err)) return -1;
            echo_fmt = json_pack("{s:s}", "type", "json_object");
        } else if (!strcmp(t, "json_schema")) {
            const json_t *name = json_object_get(fmt, "name");
            if (!name) return API_BAD(err, "text.format.name", "'text.format.name' is required");
            if (text_check(name, "text.format.name", err)) return -1;
            if (!api_tool_name_ok(json_string_value(name), json_string_length(name)))
                return API_BAD(err, "text.format.name",
                               "'text.format.name' must be 1 to 64 of a-z, A-Z, 0-9, _ and -");
            const json_t *schema = json_object_get(fmt, "schema");
            if (!schema)
                return API_BAD(err, "text.format.schema", "'text.format.schema' is required");
            const json_t *strict = api_field(fmt, "strict"), *desc = api_field(fmt, "description");
            if (strict && !json_is_boolean(strict))
                return api_type_error(err, "text.format.strict", "a boolean", strict);
            if (desc && text_check(desc, "text.format.description", err)) return -1;
            if (api_schema_field(schema, "text.format.schema", &out->rq, err)) return -1;
            echo_fmt =
                json_pack("{s:s,s:O,s:O,s:O?,s:b}", "type", "json_schema", "name", name, "schema",
                          schema, "description", desc, "strict", strict && json_is_true(strict));
        } else {
            return API_BAD(err, "text.format.type",
                           "'text.format.type' must be 'text', 'json_object' or 'json_schema', "
                           "got '%.40s'",
                           t);
        }
    }
    return set_new(
        out->echo, "text",
        echo_fmt ? json_pack("{s:o,s:s}", "format", echo_fmt, "verbosity", "medium") : NULL, err);
}

/* ---------------------------------------------------------------- the request */

static int parse_metadata(const json_t *root, resp_request *out, api_error *err) {
    const json_t *v = api_field(root, "metadata");
    if (!v) return set_new(out->echo, "metadata", json_object(), err);
    if (!json_is_object(v)) return api_type_error(err, "metadata", "an object of strings", v);
    if (json_object_size(v) > RESP_MAX_METADATA)
        return API_BAD(err, "metadata", "'metadata' has %zu pairs, more than the limit of %d",
                       json_object_size(v), RESP_MAX_METADATA);
    const char *key;
    const json_t *val;
    json_object_foreach((json_t *)v, key, val) {
        char p[96];
        snprintf(p, sizeof p, "metadata.%.64s", key);
        if (strlen(key) > RESP_MAX_METADATA_KEY)
            return API_BAD(err, "metadata", "a 'metadata' key is longer than %d bytes",
                           RESP_MAX_METADATA_KEY);
        if (text_check(val, p, err)) return -1;
        if (json_string_length(val) > RESP_MAX_METADATA_VALUE)
            return API_BAD(err, p, "'%s' is longer than %d bytes", p, RESP_MAX_METADATA_VALUE);
    }
    return set_new(out->echo, "metadata", json_deep_copy(v), err);
}

static int parse_fields(const json_t *root, resp_request *out, api_error *err) {
    api_request *rq = &out->rq;
    if (refuse_chat_fields(root, err) || refuse_unsupported(root, err)) return -1;
    const json_t *model = api_field(root, "model");
    if (!model) return API_BAD(err, "model", "'model' is required");
    if (api_str_copy(model, "model", &rq->model, err)) return -1;
    if (parse_input(root, out, err)) return -1;
    if (api_opt_string(root, "instructions", &out->instructions, err) < 0) return -1;
    const json_t *prev = api_field(root, "previous_response_id");
    if (prev) {
        if (text_check(prev, "previous_response_id", err)) return -1;
        if (json_string_length(prev) == 0 || json_string_length(prev) > RESP_MAX_ID)
            return API_BAD(err, "previous_response_id",
                           "'previous_response_id' must be 1 to %d bytes", RESP_MAX_ID);
        if (api_str_copy(prev, "previous_response_id", &out->previous_response_id, err)) return -1;
    }
    int64_t v;
    int got = api_opt_int(root, "max_output_tokens", 1, INT32_MAX, &v, err);
    if (got < 0) return -1;
    if (got) rq->max_tokens = (int)v;
    if (api_opt_int(root, "max_tool_calls", 1, INT32_MAX, &v, err) < 0) return -1;
    if (api_opt_bool(root, "stream", &rq->stream, err) < 0) return -1;
    if (api_opt_bool(root, "store", &out->store, err) < 0) return -1;
    if (api_parse_sampling(root, rq, err)) return -1;
    if (api_opt_string(root, "user", &rq->user, err) < 0) return -1;
    const char *const HINTS[] = {"prompt_cache_key", "safety_identifier"};
    for (int i = 0; i < 2; i++) {
        const json_t *h = api_field(root, HINTS[i]);
        if (h && text_check(h, HINTS[i], err)) return -1;
    }
    if (api_parse_extensions(root, rq, err)) return -1;
    if (parse_metadata(root, out, err) || parse_text(root, out, err) || parse_tools(root, out, err))
        return -1;
    if (rq->gbnf && rq->tool_choice != CHAT_TOOL_NONE)
        return API_BAD(err, "text.format",
                       "'text.format' constrains the answer, so no tool can be called with it: "
                       "leave it out, or give tool_choice 'none'");

    /* the rest of the response object's repeated settings */
    json_t *e = out->echo;
    const json_t *temp = api_field(root, "temperature"), *top_p = api_field(root, "top_p");
    if (set_new(e, "instructions", out->instructions ? json_string(out->instructions) : json_null(),
                err) ||
        set_new(e, "max_output_tokens",
                rq->max_tokens > 0 ? json_integer(rq->max_tokens) : json_null(), err) ||
        echo_field(e, root, "max_tool_calls", err) ||
        set_new(e, "previous_response_id",
                prev ? json_string(out->previous_response_id) : json_null(), err) ||
        set_new(e, "reasoning", json_pack("{s:n,s:n}", "effort", "summary"), err) ||
        set_new(e, "service_tier", json_string("default"), err) ||
        set_new(e, "store", json_boolean(out->store), err) ||
        set_new(e, "temperature", temp ? json_deep_copy(temp) : json_real(1.0), err) ||
        set_new(e, "top_p", top_p ? json_deep_copy(top_p) : json_real(1.0), err) ||
        set_new(e, "top_logprobs", json_integer(0), err) ||
        set_new(e, "truncation", json_string("disabled"), err) ||
        set_new(e, "user", rq->user ? json_string(rq->user) : json_null(), err) ||
        echo_field(e, root, "prompt_cache_key", err) ||
        echo_field(e, root, "prompt_cache_retention", err) ||
        echo_field(e, root, "safety_identifier", err) ||
        set_new(e, "background", json_false(), err))
        return -1;
    return 0;
}

int resp_parse(const char *body, size_t len, resp_request *out, api_error *err) {
    memset(out, 0, sizeof *out);
    api_request_init(API_CHAT, &out->rq);
    out->store = true;
    json_t *root = api_parse_body(body, len, err);
    if (!root) return -1;
    int rc = (out->echo = json_object()) ? parse_fields(root, out, err) : api_oom(err);
    json_decref(root);
    if (rc) resp_request_free(out);
    return rc;
}

void resp_request_free(resp_request *r) {
    if (!r) return;
    api_request_free(&r->rq);
    free(r->instructions);
    free(r->previous_response_id);
    json_decref(r->input);
    json_decref(r->echo);
    memset(r, 0, sizeof *r);
}

/* ---------------------------------------------------------------- conversations */

/* The chat messages being built (rq->messages has room for every item) and, per message, the
 * input item it came from (-1: the instructions or a stored turn), for errors. */
typedef struct conv {
    api_request *rq;
    int *origin;
} conv;

static chat_message *conv_add(conv *cv, const char *role, int origin, api_error *err) {
    chat_message *m = &cv->rq->messages[cv->rq->n_messages];
    if (!role) /* a stored conversation is this file's own canonical form */
        return api_fail(err, 500, "server_error", NULL, NULL, "a malformed stored message"), NULL;
    if (!(m->role = strdup(role))) return api_oom(err), NULL;
    cv->origin[cv->rq->n_messages++] = origin;
    return m;
}

/* A message item's parts joined, with where each ends when there are several (blend's
 * segments: as a chat message's text parts). */
static int conv_message(conv *cv, const json_t *it, int origin, api_error *err) {
    chat_message *m = conv_add(cv, json_string_value(json_object_get(it, "role")), origin, err);
    if (!m) return -1;
    const json_t *parts = json_object_get(it, "content");
    size_t n = json_array_size(parts), total = 0, k;
    const json_t *s;
    json_array_foreach(parts, k, s) total += json_string_length(s);
    char *text = malloc(total + 1);
    size_t *ends = n > 1 ? malloc(sizeof *ends * n) : NULL;
    m->content = text;
    m->part_ends = ends;
    if (!text || (n > 1 && !ends)) return api_oom(err);
    m->n_parts = ends ? (int)n : 0;
    total = 0;
    json_array_foreach(parts, k, s) {
        memcpy(text + total, json_string_value(s), json_string_length(s));
        total += json_string_length(s);
        if (ends) ends[k] = total;
    }
    text[total] = '\0';
    return 0;
}

static const char *item_str(const json_t *it, const char *key) {
    return json_string_value(json_object_get(it, key));
}

/* A function_call joins the assistant turn right before it (its text, or the calls before it);
 * anything else before it starts a turn of its own. */
static int conv_call(conv *cv, const json_t *it, int origin, api_error *err) {
    api_request *rq = cv->rq;
    chat_message *m = rq->n_messages > 0 ? &rq->messages[rq->n_messages - 1] : NULL;
    if (!m || strcmp(m->role, "assistant") != 0) {
        if (!(m = conv_add(cv, "assistant", origin, err))) return -1;
        if (!(m->content = strdup(""))) return api_oom(err);
    }
    chat_tool_call *calls =
        realloc((void *)m->tool_calls, sizeof *calls * (size_t)(m->n_tool_calls + 1));
    if (!calls) return api_oom(err);
    m->tool_calls = calls;
    chat_tool_call *c = &calls[m->n_tool_calls];
    *c = (chat_tool_call){0};
    m->n_tool_calls++;
    if (!(c->id = strdup(item_str(it, "call_id"))) || !(c->name = strdup(item_str(it, "name"))) ||
        !(c->arguments = strdup(item_str(it, "arguments"))))
        return api_oom(err);
    return 0;
}

static int conv_output(conv *cv, const json_t *it, int origin, api_error *err) {
    chat_message *m = conv_add(cv, "tool", origin, err);
    if (!m) return -1;
    const json_t *out = json_object_get(it, "output");
    if (!(m->tool_call_id = strdup(item_str(it, "call_id"))) ||
        !(m->content = strndup(json_string_value(out), json_string_length(out))))
        return api_oom(err);
    return 0;
}

static int conv_items(conv *cv, const json_t *items, bool input, api_error *err) {
    size_t i;
    const json_t *it;
    json_array_foreach(items, i, it) {
        const char *type = item_str(it, "type");
        int origin = input ? (int)i : -1, rc;
        if (!type)
            rc = API_BAD(err, "previous_response_id", "the stored conversation is malformed");
        else if (!strcmp(type, "function_call"))
            rc = conv_call(cv, it, origin, err);
        else if (!strcmp(type, "function_call_output"))
            rc = conv_output(cv, it, origin, err);
        else
            rc = conv_message(cv, it, origin, err);
        if (rc) return -1;
    }
    return 0;
}

/* chat_check_tool_turns' verdict in the Responses API's words (OpenAI's own, where it has
 * them), naming the input item at fault. */
static int check_turns(const conv *cv, api_error *err) {
    const api_request *rq = cv->rq;
    chat_turn_check c;
    if (chat_check_tool_turns(rq->messages, rq->n_messages, &c) == CHAT_TURNS_OK) return 0;
    const chat_message *m = &rq->messages[c.msg];
    char param[64] = "input";
    if (cv->origin[c.msg] >= 0)
        snprintf(param, sizeof param, "input[%d].call_id", cv->origin[c.msg]);
    switch (c.problem) {
    case CHAT_TURNS_RESULT_WITHOUT_CALLS:
    case CHAT_TURNS_UNKNOWN_ID:
        return API_BAD(err, param,
                       "No tool call found for function call output with call_id %.64s (its "
                       "function_call must come right before it, or before the other outputs of "
                       "its turn's calls).",
                       m->tool_call_id);
    case CHAT_TURNS_ANSWERED_TWICE:
        return API_BAD(err, param, "Duplicate function call output for call_id %.64s.",
                       m->tool_call_id);
    default:
        if (cv->origin[c.msg] >= 0) snprintf(param, sizeof param, "input[%d]", cv->origin[c.msg]);
        return API_BAD(err, param,
                       "No tool output found for function call %.64s: every function_call needs "
                       "its function_call_output before the conversation goes on.",
                       m->tool_calls[c.call].id);
    }
}

int resp_conversation(resp_request *r, const json_t *prev, api_error *err) {
    api_request *rq = &r->rq;
    size_t bound = 1 + json_array_size(prev) + json_array_size(r->input);
    if (bound > INT_MAX / 4) return API_BAD(err, "input", "the conversation is too long");
    if (rq->messages) return api_fail(err, 500, "server_error", NULL, NULL, "built twice");
    rq->messages = calloc(bound, sizeof *rq->messages);
    conv cv = {rq, malloc(sizeof(int) * bound)};
    int rc = -1;
    if (!rq->messages || !cv.origin) {
        api_oom(err);
        goto done;
    }
    if (r->instructions) {
        chat_message *m = conv_add(&cv, "system", -1, err);
        if (!m || !(m->content = strdup(r->instructions))) {
            if (m) api_oom(err);
            goto done;
        }
    }
    if ((prev && conv_items(&cv, prev, false, err)) || conv_items(&cv, r->input, true, err))
        goto done;
    rc = check_turns(&cv, err);
done:
    free(cv.origin);
    return rc;
}
