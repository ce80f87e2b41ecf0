/* The generic tool-call format (see chat.h): the system prompt that lists the tools, the
 * grammar that constrains an answer to calls of them, and the parser that turns an answer back
 * into content or calls as it streams. */
#include "model/chat.h"
#include "model/grammar.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CALL_OPEN "<tool_call>{\"name\": \""
#define CALL_ARGS "\", \"arguments\": "
#define CALL_CLOSE "}</tool_call>"

typedef struct tbuf {
    char *s;
    size_t n, cap;
    bool oom;
} tbuf;

static void tb_put(tbuf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->n + n + 1 > b->cap) {
        size_t cap = (b->n + n + 1) * 2;
        char *t = realloc(b->s, cap);
        if (!t) {
            b->oom = true;
            return;
        }
        b->s = t;
        b->cap = cap;
    }
    memcpy(b->s + b->n, s, n);
    b->n += n;
    b->s[b->n] = '\0';
}

static void tb_str(tbuf *b, const char *s) { tb_put(b, s, strlen(s)); }

static char *tb_done(tbuf *b, kv_error *err) {
    if (b->oom || !b->s) {
        free(b->s);
        kv_fail(err, "out of memory");
        return NULL;
    }
    return b->s;
}

char *chat_tools_system(const chat_tool *tools, int n, kv_error *err) {
    tbuf b = {0};
    tb_str(&b, "You can call these functions. Each is given as JSON with the JSON Schema of its "
               "arguments:\n");
    for (int i = 0; i < n; i++) {
        json_t *o = json_object();
        json_object_set_new(o, "name", json_string(tools[i].name));
        if (tools[i].description)
            json_object_set_new(o, "description", json_string(tools[i].description));
        json_t *params = tools[i].parameters ? json_loads(tools[i].parameters, 0, NULL) : NULL;
        if (params) json_object_set_new(o, "parameters", params);
        char *t = json_dumps(o, JSON_COMPACT);
        json_decref(o);
        if (!t) {
            b.oom = true;
            break;
        }
        tb_str(&b, t);
        tb_str(&b, "\n");
        free(t);
    }
    tb_str(&b, "To call a function, answer with " CALL_OPEN "<function name>" CALL_ARGS
               "<arguments as a JSON object>" CALL_CLOSE
               ", one per line for several calls, and nothing else.");
    return tb_done(&b, err);
}

char *chat_tools_gbnf(const chat_tool *tools, int n, chat_tool_choice choice, const char *named,
                      bool parallel, kv_error *err) {
    tbuf b = {0};
    if (choice == CHAT_TOOL_AUTO)
        tb_str(&b, "root ::= calls | [^<] .*\n");
    else
        tb_str(&b, "root ::= calls\n");
    tb_str(&b, parallel && choice != CHAT_TOOL_NAMED ? "calls ::= call (\"\\n\" call)*\n"
                                                     : "calls ::= call\n");
    tb_str(&b, "call ::= \"<tool_call>{\\\"name\\\": \\\"\" (");
    bool first = true;
    for (int i = 0; i < n; i++) {
        if (choice == CHAT_TOOL_NAMED && strcmp(tools[i].name, named) != 0) continue;
        char alt[160];
        snprintf(alt, sizeof alt, "%s\"%s\\\", \\\"arguments\\\": \" tool%d-args",
                 first ? "" : " | ", tools[i].name, i);
        tb_str(&b, alt);
        first = false;
    }
    if (first) {
        free(b.s);
        kv_fail(err, "tool_choice names '%s', which is not among the tools", named);
        return NULL;
    }
    tb_str(&b, ") \"}</tool_call>\"\n");
    for (int i = 0; i < n; i++) {
        char prefix[32];
        snprintf(prefix, sizeof prefix, "tool%d-args", i);
        if (!tools[i].parameters) {
            tb_str(&b, prefix);
            tb_str(&b, " ::= object\n");
            continue;
        }
        char *rules = json_schema_to_gbnf_rules(tools[i].parameters, strlen(tools[i].parameters),
                                                prefix, err);
        if (!rules) {
            free(b.s);
            kv_fail_wrap(err, "tool '%s' parameters", tools[i].name);
            return NULL;
        }
        tb_str(&b, rules);
        free(rules);
    }
    tb_str(&b, json_schema_primitives());
    return tb_done(&b, err);
}

char *chat_tools_render_call(const char *name, const char *arguments) {
    tbuf b = {0};
    tb_str(&b, CALL_OPEN);
    tb_str(&b, name);
    tb_str(&b, CALL_ARGS);
    tb_str(&b, arguments && *arguments ? arguments : "{}");
    tb_str(&b, CALL_CLOSE);
    kv_error err;
    return tb_done(&b, &err);
}

char *chat_tools_render_result(const char *name, const char *content) {
    json_t *o = json_pack("{s:s,s:s}", "name", name ? name : "", "content", content);
    char *t = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (!t) return NULL;
    tbuf b = {0};
    tb_str(&b, "<tool_response>");
    tb_str(&b, t);
    tb_str(&b, "</tool_response>");
    free(t);
    kv_error err;
    return tb_done(&b, &err);
}

/* ---------------------------------------------------------------- parsing */

/* How many bytes of text[0..len) can be released without cutting a UTF-8 character. */
static size_t utf8_cut(const char *text, size_t len) {
    size_t i = len;
    while (i > 0 && ((unsigned char)text[i - 1] & 0xC0) == 0x80) i--;
    if (i == 0) return 0;
    unsigned char lead = (unsigned char)text[i - 1];
    size_t need = lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : lead >= 0xC0 ? 2 : 1;
    return len - (i - 1) >= need ? len : i - 1;
}

int chat_tools_parse(chat_tool_parser *p, const char *text, size_t len, bool final,
                     chat_tool_event *ev, int max) {
    int k = 0;
    while (k < max && p->cur < len) {
        const char *s = text + p->cur;
        size_t left = len - p->cur;
        if (p->mode == 0) p->mode = s[0] == '<' ? 2 : 1;
        if (p->mode == 1) {
            ev[k++] = (chat_tool_event){CHAT_TOOL_EVENT_CONTENT, 0, s, left};
            p->cur = len;
            break;
        }
        if (p->in_args) {
            const char *end = NULL;
            for (size_t i = 0; i + strlen(CALL_CLOSE) <= left && !end; i++)
                if (!memcmp(s + i, CALL_CLOSE, strlen(CALL_CLOSE))) end = s + i;
            size_t n;
            if (end) {
                n = (size_t)(end - s);
            } else {
                /* hold back what could be the start of the closing marker */
                n = left > strlen(CALL_CLOSE) ? left - strlen(CALL_CLOSE) : 0;
                if (final) n = left;
                n = utf8_cut(s, n);
            }
            if (n > 0) ev[k++] = (chat_tool_event){CHAT_TOOL_EVENT_ARGS, p->n_calls - 1, s, n};
            p->cur += n;
            if (!end) break;
            p->cur += strlen(CALL_CLOSE);
            p->in_args = false;
            p->complete = true;
            continue;
        }
        if (s[0] == '\n') { /* between calls */
            p->cur++;
            continue;
        }
        size_t open = strlen(CALL_OPEN);
        if (left < open || memcmp(s, CALL_OPEN, open) != 0) {
            /* not (or not yet) a call: wait unless it cannot become one */
            if (!final && left < open && !memcmp(s, CALL_OPEN, left)) break;
            ev[k++] = (chat_tool_event){CHAT_TOOL_EVENT_CONTENT, 0, s, left};
            p->cur = len;
            p->complete = false;
            break;
        }
        const char *name = s + open;
        const char *q = memchr(name, '"', left - open);
        size_t args = strlen(CALL_ARGS);
        if (!q || (size_t)(q - s) + args > left) {
            if (final) p->complete = false, p->cur = len;
            break;
        }
        if (memcmp(q, CALL_ARGS, args) != 0) {
            p->complete = false;
            p->cur = len;
            break;
        }
        ev[k++] = (chat_tool_event){CHAT_TOOL_EVENT_CALL, p->n_calls++, name, (size_t)(q - name)};
        p->in_args = true;
        p->complete = false;
        p->cur = (size_t)(q - text) + args;
    }
    return k;
}
