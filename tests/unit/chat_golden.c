/* See chat_golden.h. */
#include "tests/unit/chat_golden.h"

#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *str_or_null(json_t *obj, const char *key) {
    json_t *v = json_object_get(obj, key);
    cr_assert(!v || json_is_string(v) || json_is_null(v), "'%s' is not a string", key);
    return json_string_value(v);
}

/* JSON text of v, kept in c's storage. */
static const char *keep_dump(golden_conv *c, json_t *v) {
    char *s = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
    cr_assert_not_null(s);
    c->strs = realloc(c->strs, sizeof *c->strs * (size_t)(c->n_strs + 1));
    cr_assert_not_null(c->strs);
    return c->strs[c->n_strs++] = s;
}

void golden_conv_load(json_t *cs, golden_conv *c) {
    memset(c, 0, sizeof *c);
    json_t *jm = json_object_get(cs, "messages");
    cr_assert(json_is_array(jm));
    c->n_msgs = (int)json_array_size(jm);
    c->msgs = calloc((size_t)c->n_msgs + 1, sizeof *c->msgs);
    size_t n_calls = 0, k;
    json_t *m;
    json_array_foreach(jm, k, m) n_calls += json_array_size(json_object_get(m, "tool_calls"));
    c->calls = calloc(n_calls + 1, sizeof *c->calls);
    cr_assert(c->msgs && c->calls);
    chat_tool_call *call = c->calls;
    json_array_foreach(jm, k, m) {
        chat_message *out = &c->msgs[k];
        out->role = str_or_null(m, "role");
        out->content = str_or_null(m, "content");
        out->tool_call_id = str_or_null(m, "tool_call_id");
        json_t *calls = json_object_get(m, "tool_calls");
        out->tool_calls = call;
        out->n_tool_calls = (int)json_array_size(calls);
        size_t i;
        json_t *tc;
        json_array_foreach(calls, i, tc) {
            json_t *fn = json_object_get(tc, "function");
            call->id = str_or_null(tc, "id");
            call->name = str_or_null(fn, "name");
            call->arguments = keep_dump(c, json_object_get(fn, "arguments"));
            call++;
        }
    }
    json_t *jt = json_object_get(cs, "tools");
    if (!json_is_array(jt)) return;
    c->n_tools = (int)json_array_size(jt);
    c->tools = calloc((size_t)c->n_tools + 1, sizeof *c->tools);
    cr_assert_not_null(c->tools);
    json_t *t;
    json_array_foreach(jt, k, t) {
        json_t *fn = json_object_get(t, "function");
        c->tools[k].name = str_or_null(fn, "name");
        c->tools[k].description = str_or_null(fn, "description");
        json_t *params = json_object_get(fn, "parameters");
        c->tools[k].parameters = params ? keep_dump(c, params) : NULL;
    }
}

void golden_conv_free(golden_conv *c) {
    for (int i = 0; i < c->n_strs; i++) free(c->strs[i]);
    free(c->strs);
    free(c->msgs);
    free(c->calls);
    free(c->tools);
    memset(c, 0, sizeof *c);
}

json_t *golden_chat_load(const char *name) {
    char path[256];
    snprintf(path, sizeof path, "tests/golden/chat/%s.json", name);
    json_error_t jerr;
    json_t *doc = json_load_file(path, 0, &jerr);
    cr_assert_not_null(doc, "%s:%d: %s (run from the repo root)", path, jerr.line, jerr.text);
    return doc;
}

json_t *golden_chat_case(json_t *doc, const char *name) {
    size_t i;
    json_t *c;
    char own[128]; /* the case given a system message of its own (Mistral Small 3.2's goldens) */
    snprintf(own, sizeof own, "%s+system", name);
    json_array_foreach(json_object_get(doc, "cases"), i, c) {
        const char *n = json_string_value(json_object_get(c, "name"));
        if (!strcmp(n, name) || !strcmp(n, own)) return c;
    }
    return NULL;
}
