/* The tool formats (see chat.h): one table of each format's call syntax, from which come the
 * calls written into a prompt, the grammar that constrains an answer to calls, and the parser
 * that turns an answer back into content or calls as it streams; and the generic format's
 * system prompt and message rewriting. The templates that list tools their own way (Qwen 2.5,
 * Llama 3.1, Mistral Nemo and v3) do so in chat.c. */
#include "model/chat/chat_impl.h"
#include "model/grammar/grammar.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- call syntax */

/* A turn's calls: open, then each call as
 *   call NAME args ARGUMENTS end [ID id_end]
 * or, where id_open is set, as
 *   call NAME id_open ID args ARGUMENTS end id_end
 * separated by sep, then close. */
typedef struct tool_syntax {
    const char *open;    /* before the first call */
    const char *call;    /* a call, up to its name */
    const char *args;    /* between the name and the arguments */
    const char *end;     /* after the arguments */
    int id_len;          /* then the call's own id, [a-zA-Z0-9]{id_len} (0: none) */
    const char *id_end;  /* after the id */
    const char *sep;     /* between calls; NULL: one call per turn */
    const char *close;   /* after the last call */
    const char *id_open; /* between the name and the id, which then comes before args (or NULL) */
} tool_syntax;

static const tool_syntax SYNTAX[] = {
    [CHAT_TOOLS_GENERIC] = {"", "<tool_call>{\"name\": \"", "\", \"arguments\": ", "}</tool_call>",
                            0, "", "\n", ""},
    /* Qwen 2.5's template: '\n<tool_call>\n{"name": "' + name + '", "arguments": ' + tojson +
     * '}\n</tool_call>' per call; the answer begins after "assistant\n", so the newline before
     * each call but the first is the separator. */
    [CHAT_TOOLS_HERMES] = {"", "<tool_call>\n{\"name\": \"",
                           "\", \"arguments\": ", "}\n</tool_call>", 0, "", "\n", ""},
    /* Llama 3.1's template: '{"name": "' + name + '", "parameters": ' + tojson + '}', and it
     * refuses a turn with more than one call. */
    [CHAT_TOOLS_LLAMA3] = {"", "{\"name\": \"", "\", \"parameters\": ", "}", 0, "", NULL, ""},
    /* Mistral Nemo's template: "[TOOL_CALLS][" + (function|tojson)[:-1] + ', "id": "' + id +
     * '"}' joined by ", ", then "]" (and EOS). */
    [CHAT_TOOLS_MISTRAL] = {"[TOOL_CALLS][", "{\"name\": \"", "\", \"arguments\": ", ", \"id\": \"",
                            9, "\"}", ", ", "]"},
    /* Mistral Large 2407's ("v3") template: the same after "[TOOL_CALLS] [". */
    [CHAT_TOOLS_MISTRAL_V3] = {"[TOOL_CALLS] [", "{\"name\": \"",
                               "\", \"arguments\": ", ", \"id\": \"", 9, "\"}", ", ", "]"},
    /* Mistral Small 3.2's ("v7-tekken") template: "[TOOL_CALLS]" + name + "[CALL_ID]" + id +
     * "[ARGS]" + tojson per call, nothing between the calls or after them (then EOS). */
    [CHAT_TOOLS_MISTRAL_V7] = {"", "[TOOL_CALLS]", "[ARGS]", "", 9, "", "", "", "[CALL_ID]"},
};

static const tool_syntax *syntax_of(chat_tool_format f) {
    return (unsigned)f < sizeof SYNTAX / sizeof SYNTAX[0] ? &SYNTAX[f]
                                                          : &SYNTAX[CHAT_TOOLS_GENERIC];
}

const char *const *chat_tools_markers(chat_tool_format f) {
    /* Hermes-style tokenizers (Qwen 2.5, Hermes 2 Pro) hold <tool_call> and </tool_call> as
     * added tokens, some as control tokens; Mistral's [TOOL_CALLS] is one. */
    static const char *const tool_call[] = {"<tool_call>", "</tool_call>", NULL};
    static const char *const mistral[] = {"[TOOL_CALLS]", NULL};
    static const char *const mistral_v7[] = {"[TOOL_CALLS]", "[CALL_ID]", "[ARGS]", NULL};
    static const char *const none[] = {NULL};
    switch (f) {
    case CHAT_TOOLS_GENERIC:
    case CHAT_TOOLS_HERMES:
        return tool_call;
    case CHAT_TOOLS_MISTRAL:
    case CHAT_TOOLS_MISTRAL_V3:
        return mistral;
    case CHAT_TOOLS_MISTRAL_V7:
        return mistral_v7;
    default:
        return none;
    }
}

const char *chat_tools_format_name(chat_tool_format f) {
    static const char *const names[] = {"generic", "hermes",     "llama3",
                                        "mistral", "mistral-v3", "mistral-v7"};
    return (unsigned)f < sizeof names / sizeof names[0] ? names[f] : "generic";
}

static bool is_alnum(char c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
}

void chat_tools_mistral_id(const char *id, char out[10]) {
    static const char B62[] = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
    size_t n = id ? strlen(id) : 0;
    bool ok = n == 9;
    for (size_t i = 0; ok && i < n; i++) ok = is_alnum(id[i]);
    if (ok) {
        memcpy(out, id, 10);
        return;
    }
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a 64 */
    for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)id[i]) * 0x100000001b3ull;
    for (int i = 0; i < 9; i++, h /= 62) out[i] = B62[h % 62];
    out[9] = '\0';
}

int chat_tools_append_calls(strbuf *b, chat_tool_format f, const chat_tool_call *calls, int n,
                            int msg_index, kv_error *err) {
    const tool_syntax *x = syntax_of(f);
    if (!x->sep && n != 1)
        return kv_fail(err,
                       "chat: message %d has %d tool calls; this model's template takes one "
                       "call per turn",
                       msg_index, n);
    kv_buf_puts(b, x->open);
    for (int i = 0; i < n; i++) {
        if (i > 0) kv_buf_puts(b, x->sep);
        char id[10];
        chat_tools_mistral_id(calls[i].id, id);
        kv_buf_puts(b, x->call);
        kv_buf_puts(b, calls[i].name ? calls[i].name : "");
        if (x->id_open) {
            kv_buf_puts(b, x->id_open);
            kv_buf_puts(b, id);
        }
        kv_buf_puts(b, x->args);
        const char *a = calls[i].arguments && *calls[i].arguments ? calls[i].arguments : "{}";
        if (pyjson_append_text(b, a, PYJSON_NO_INDENT))
            return kv_fail(err, "chat: message %d: tool call %d: the arguments are not JSON",
                           msg_index, i);
        kv_buf_puts(b, x->end);
        if (x->id_len > 0 && !x->id_open) kv_buf_puts(b, id);
        kv_buf_puts(b, x->id_end);
    }
    kv_buf_puts(b, x->close);
    return 0;
}

/* ---------------------------------------------------------------- the generic format */

static char *generic_system(const chat_tool *tools, int n) {
    strbuf b = {0};
    kv_buf_puts(&b,
                "You can call these functions. Each is given as JSON with the JSON Schema of its "
                "arguments:\n");
    for (int i = 0; i < n; i++) {
        json_t *t = chat_tool_json(&tools[i]);
        char *s = t ? json_dumps(json_object_get(t, "function"), JSON_COMPACT) : NULL;
        json_decref(t);
        if (!s) {
            b.oom = true;
            break;
        }
        kv_buf_puts(&b, s);
        kv_buf_puts(&b, "\n");
        free(s);
    }
    const tool_syntax *x = &SYNTAX[CHAT_TOOLS_GENERIC];
    kv_buf_puts(&b, "To call a function, answer with ");
    kv_buf_puts(&b, x->call);
    kv_buf_puts(&b, "<function name>");
    kv_buf_puts(&b, x->args);
    kv_buf_puts(&b, "<arguments as a JSON object>");
    kv_buf_puts(&b, x->end);
    kv_buf_puts(&b, ", one per line for several calls, and nothing else.");
    if (b.oom) {
        free(b.p);
        return NULL;
    }
    return b.p;
}

void chat_messages_free(chat_message *msgs, int n) {
    for (int i = 0; msgs && i < n; i++) free((char *)msgs[i].content);
    free(msgs);
}

/* A tool message's function: its own name, or that of the earlier call its id answers. */
static const char *result_name(const chat_message *msgs, int i) {
    const char *id = msgs[i].tool_call_id;
    for (int j = i - 1; j >= 0 && !msgs[i].name && id; j--)
        for (int k = 0; k < msgs[j].n_tool_calls; k++)
            if (msgs[j].tool_calls[k].id && !strcmp(msgs[j].tool_calls[k].id, id))
                return msgs[j].tool_calls[k].name;
    return msgs[i].name ? msgs[i].name : "";
}

/* Message i of the generic format's conversation into *out (content malloc'd). */
static int generic_message(const chat_message *msgs, int i, chat_message *out, kv_error *err) {
    const chat_message *m = &msgs[i];
    strbuf b = {0};
    kv_buf_append(&b, "", 0);
    out->role = m->role;
    if (!strcmp(m->role, "tool")) {
        out->role = "user";
        kv_buf_puts(&b, "<tool_response>{\"name\": ");
        pyjson_append_string(&b, result_name(msgs, i));
        kv_buf_puts(&b, ", \"content\": ");
        pyjson_append_string(&b, m->content ? m->content : "");
        kv_buf_puts(&b, "}</tool_response>");
    } else {
        kv_buf_puts(&b, m->content ? m->content : "");
    }
    if (m->n_tool_calls > 0) {
        if (b.len > 0) kv_buf_puts(&b, "\n");
        if (chat_tools_append_calls(&b, CHAT_TOOLS_GENERIC, m->tool_calls, m->n_tool_calls, i,
                                    err)) {
            free(b.p);
            return -1;
        }
    }
    out->content = b.p;
    if (b.oom) return kv_fail(err, "chat: out of memory");
    return 0;
}

int chat_tools_generic_messages(const chat_message *msgs, int n, const chat_tool *tools,
                                int n_tools, chat_message **out, int *n_out, kv_error *err) {
    *out = NULL;
    *n_out = 0;
    chat_message *m = calloc((size_t)n + 1, sizeof *m);
    char *sys = n_tools > 0 ? generic_system(tools, n_tools) : NULL;
    if (!m || (n_tools > 0 && !sys)) {
        free(m);
        free(sys);
        return kv_fail(err, "chat: out of memory");
    }
    int k = 0, first = 0;
    if (sys) {
        if (n > 0 && !strcmp(msgs[0].role, "system") && msgs[0].n_tool_calls == 0) {
            /* the conversation's own system message, then the tools */
            strbuf b = {0};
            kv_buf_puts(&b, msgs[0].content ? msgs[0].content : "");
            kv_buf_puts(&b, "\n\n");
            kv_buf_puts(&b, sys);
            free(sys);
            sys = b.p;
            first = 1;
        }
        m[k++] = (chat_message){.role = "system", .content = sys};
        if (!sys) {
            chat_messages_free(m, k);
            return kv_fail(err, "chat: out of memory");
        }
    }
    for (int i = first; i < n; i++) {
        if (generic_message(msgs, i, &m[k], err)) {
            chat_messages_free(m, k + 1);
            return -1;
        }
        k++;
    }
    *out = m;
    *n_out = k;
    return 0;
}

/* ---------------------------------------------------------------- tool turns */

static bool is_tool(const chat_message *m) { return m->role && !strcmp(m->role, "tool"); }

static bool same_id(const char *a, const char *b) { return a && b && !strcmp(a, b); }

void chat_unanswered_ids(const chat_message *msgs, int n, int i, int from, char *out, size_t cap) {
    size_t used = 0;
    if (cap) out[0] = '\0';
    for (int k = from; k < msgs[i].n_tool_calls && used < cap; k++)
        if (!chat_call_answered(msgs, n, i, k))
            used += (size_t)snprintf(out + used, cap - used, "%s%.64s", used ? ", " : "",
                                     msgs[i].tool_calls[k].id ? msgs[i].tool_calls[k].id : "");
}

bool chat_call_answered(const chat_message *msgs, int n, int i, int k) {
    for (int j = i + 1; j < n && is_tool(&msgs[j]); j++)
        if (same_id(msgs[j].tool_call_id, msgs[i].tool_calls[k].id)) return true;
    return false;
}

static chat_turn_problem turn_problem(chat_turn_check *out, chat_turn_problem p, int msg, int call,
                                      int other) {
    *out = (chat_turn_check){p, msg, call, other};
    return p;
}

chat_turn_problem chat_check_tool_turns(const chat_message *msgs, int n, chat_turn_check *out) {
    int calls = -1; /* the assistant message whose results may come now, or -1 */
    for (int i = 0; i <= n; i++) {
        if (i < n && is_tool(&msgs[i])) {
            if (calls < 0) return turn_problem(out, CHAT_TURNS_RESULT_WITHOUT_CALLS, i, -1, -1);
            const chat_message *a = &msgs[calls];
            int k = 0;
            while (k < a->n_tool_calls && !same_id(a->tool_calls[k].id, msgs[i].tool_call_id)) k++;
            if (k == a->n_tool_calls) return turn_problem(out, CHAT_TURNS_UNKNOWN_ID, i, -1, -1);
            for (int j = calls + 1; j < i; j++)
                if (same_id(msgs[j].tool_call_id, msgs[i].tool_call_id))
                    return turn_problem(out, CHAT_TURNS_ANSWERED_TWICE, i, k, j);
            continue;
        }
        /* the results of the calls before (if any) have ended */
        for (int k = 0; calls >= 0 && k < msgs[calls].n_tool_calls; k++)
            if (!chat_call_answered(msgs, n, calls, k))
                return turn_problem(out, CHAT_TURNS_UNANSWERED, calls, k, -1);
        calls = i < n && msgs[i].n_tool_calls > 0 ? i : -1;
    }
    return turn_problem(out, CHAT_TURNS_OK, -1, -1, -1);
}

/* ---------------------------------------------------------------- grammar */

/* A GBNF string literal of s. */
static void gbnf_literal(strbuf *b, const char *s) {
    if (!*s) return; /* nothing to match */
    kv_buf_puts(b, " \"");
    for (; *s; s++) {
        const char *e = *s == '"' ? "\\\"" : *s == '\\' ? "\\\\" : *s == '\n' ? "\\n" : NULL;
        if (e)
            kv_buf_puts(b, e);
        else
            kv_buf_append(b, s, 1);
    }
    kv_buf_puts(b, "\"");
}

char *chat_tools_gbnf(chat_tool_format f, const chat_tool *tools, int n, chat_tool_choice choice,
                      const char *named, bool parallel, kv_error *err) {
    const tool_syntax *x = syntax_of(f);
    strbuf b = {0};
    char line[96];
    if (choice == CHAT_TOOL_AUTO) {
        /* content: anything that does not begin the way calls do */
        unsigned char first = (unsigned char)(*x->open ? x->open[0] : x->call[0]);
        snprintf(line, sizeof line, "root ::= calls | [^\\x%02X] .*\n", first);
        kv_buf_puts(&b, line);
    } else {
        kv_buf_puts(&b, "root ::= calls\n");
    }
    kv_buf_puts(&b, "calls ::=");
    if (*x->open) gbnf_literal(&b, x->open);
    kv_buf_puts(&b, " call");
    if (parallel && choice != CHAT_TOOL_NAMED && x->sep) {
        kv_buf_puts(&b, " (");
        gbnf_literal(&b, x->sep);
        kv_buf_puts(&b, " call )*");
    }
    if (*x->close) gbnf_literal(&b, x->close);
    kv_buf_puts(&b, "\ncall ::=");
    gbnf_literal(&b, x->call);
    kv_buf_puts(&b, " (");
    bool any = false;
    for (int i = 0; i < n; i++) {
        if (choice == CHAT_TOOL_NAMED && strcmp(tools[i].name, named) != 0) continue;
        if (any) kv_buf_puts(&b, " |");
        gbnf_literal(&b, tools[i].name);
        if (x->id_open) {
            gbnf_literal(&b, x->id_open);
            snprintf(line, sizeof line, " [a-zA-Z0-9]{%d}", x->id_len);
            kv_buf_puts(&b, line);
        }
        gbnf_literal(&b, x->args);
        snprintf(line, sizeof line, " tool%d-args", i);
        kv_buf_puts(&b, line);
        any = true;
    }
    if (!any) {
        free(b.p);
        kv_fail(err, "tool_choice names '%s', which is not among the tools", named ? named : "");
        return NULL;
    }
    kv_buf_puts(&b, " )");
    gbnf_literal(&b, x->end);
    if (x->id_len > 0 && !x->id_open) {
        snprintf(line, sizeof line, " [a-zA-Z0-9]{%d}", x->id_len);
        kv_buf_puts(&b, line);
        gbnf_literal(&b, x->id_end);
    }
    kv_buf_puts(&b, "\n");
    for (int i = 0; i < n; i++) {
        char prefix[32];
        snprintf(prefix, sizeof prefix, "tool%d-args", i);
        if (!tools[i].parameters) {
            kv_buf_puts(&b, prefix);
            kv_buf_puts(&b, " ::= object\n");
            continue;
        }
        char *rules = json_schema_to_gbnf_rules(tools[i].parameters, strlen(tools[i].parameters),
                                                prefix, err);
        if (!rules) {
            free(b.p);
            kv_fail_wrap(err, "tool '%s' parameters", tools[i].name);
            return NULL;
        }
        kv_buf_puts(&b, rules);
        free(rules);
    }
    kv_buf_puts(&b, json_schema_primitives());
    if (b.oom) {
        free(b.p);
        kv_fail(err, "out of memory");
        return NULL;
    }
    return b.p;
}

/* ---------------------------------------------------------------- parsing */

enum {
    PH_OPEN = 0, /* before the calls' opening */
    PH_CALL,     /* before a call */
    PH_ARGS,     /* inside a call's arguments */
    PH_END,      /* after the arguments */
    PH_ID,       /* the call's own id */
    PH_ID_END,   /* after it */
    PH_NEXT,     /* after a call: a separator, the closing, or the end */
    PH_DONE,     /* after the closing: nothing may follow */
    PH_BROKEN,   /* left the syntax: the rest is content */
};

void chat_tool_parser_init(chat_tool_parser *p, chat_tool_format f) {
    memset(p, 0, sizeof *p);
    p->format = f;
}

/* How many bytes of text[0..len) can be released without cutting a UTF-8 character. */
static size_t utf8_cut(const char *text, size_t len) {
    size_t i = len;
    while (i > 0 && ((unsigned char)text[i - 1] & 0xC0) == 0x80) i--;
    if (i == 0) return 0;
    unsigned char lead = (unsigned char)text[i - 1];
    size_t need = lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : lead >= 0xC0 ? 2 : 1;
    return len - (i - 1) >= need ? len : i - 1;
}

/* s[0..left) against the literal lit: 1 it begins with lit, 0 it is a shorter piece of lit
 * (more text may decide), -1 it is not lit. */
static int literal(const char *s, size_t left, const char *lit) {
    size_t k = strlen(lit), m = left < k ? left : k;
    if (memcmp(s, lit, m) != 0) return -1;
    return left >= k ? 1 : 0;
}

/* Scans n bytes of a JSON value's text from where p's state left off; returns the bytes that
 * belong to the value (all n unless it ended), *done when it ended, or -1 when the text cannot
 * be a value the arguments may be (an object, an array or a string). */
static long scan_json(chat_tool_parser *p, const char *s, size_t n, bool at_start, bool *done) {
    *done = false;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (at_start && i == 0 && c != '{' && c != '[' && c != '"') return -1;
        if (p->in_string) {
            if (p->escaped)
                p->escaped = false;
            else if (c == '\\')
                p->escaped = true;
            else if (c == '"')
                p->in_string = false;
        } else if (c == '"') {
            p->in_string = true;
        } else if (c == '{' || c == '[') {
            p->depth++;
        } else if (c == '}' || c == ']') {
            p->depth--;
        }
        if (p->depth == 0 && !p->in_string) {
            *done = true;
            return (long)i + 1;
        }
    }
    return (long)n;
}

/* PH_ID: the call's id of x->id_len letters and digits. Returns the phase's verdict (1 moved on,
 * 0 wait for more text, -1 broken). */
static int parse_id(chat_tool_parser *p, const tool_syntax *x, const char *s, size_t left) {
    size_t have = left < (size_t)x->id_len ? left : (size_t)x->id_len;
    int r = left >= (size_t)x->id_len ? 1 : 0;
    for (size_t i = 0; i < have; i++)
        if (!is_alnum(s[i])) r = -1;
    if (r == 1) p->cur += (size_t)x->id_len, p->phase = PH_ID_END;
    return r;
}

/* PH_CALL: a call's opening, its name, its id where the format puts one there and the opening of
 * its arguments. On 1 (moved on to PH_ARGS), *ev is the call's event; else 0 or -1 as parse_id. */
static int parse_call(chat_tool_parser *p, const tool_syntax *x, const char *text, size_t len,
                      chat_tool_event *ev) {
    const char *s = text + p->cur;
    size_t left = len - p->cur;
    int r = literal(s, left, x->call);
    if (r != 1) return r;
    /* the name runs up to what follows it (its first character is never a name's) */
    const char *name = s + strlen(x->call);
    const char *after = x->id_open ? x->id_open : x->args;
    const char *q = memchr(name, after[0], left - strlen(x->call));
    r = q ? literal(q, left - (size_t)(q - s), after) : 0;
    const char *a = q; /* where args begins */
    if (r == 1 && x->id_open) {
        const char *id = q + strlen(x->id_open);
        size_t rest = left - (size_t)(id - s), len_id = (size_t)x->id_len;
        for (size_t i = 0; i < rest && i < len_id; i++)
            if (!is_alnum(id[i])) r = -1;
        if (r == 1 && rest < len_id) r = 0;
        a = id + len_id;
        if (r == 1) r = literal(a, left - (size_t)(a - s), x->args);
    }
    if (r != 1) return r;
    *ev = (chat_tool_event){CHAT_TOOL_EVENT_CALL, p->n_calls++, name, (size_t)(q - name)};
    p->cur = (size_t)(a - text) + strlen(x->args);
    p->phase = PH_ARGS;
    p->depth = 0;
    p->in_string = p->escaped = false;
    p->complete = false;
    return 1;
}

/* PH_ARGS: as much of the arguments' JSON as has come (held back: a split UTF-8 character unless
 * final), as an event into ev[*k] when there is any. Returns 1 to go on, 0 to wait for more text,
 * -1 when the text is not arguments. */
static int parse_args(chat_tool_parser *p, const tool_syntax *x, const char *text, size_t len,
                      bool final, chat_tool_event *ev, int *k) {
    const char *s = text + p->cur;
    size_t left = len - p->cur;
    bool at_start = p->depth == 0 && !p->in_string, done;
    chat_tool_parser probe = *p;
    long n = scan_json(&probe, s, left, at_start, &done);
    if (n < 0) return -1;
    if (!done && !final) n = (long)utf8_cut(s, (size_t)n); /* hold back a split char */
    scan_json(p, s, (size_t)n, at_start, &done);
    if (n > 0) ev[(*k)++] = (chat_tool_event){CHAT_TOOL_EVENT_ARGS, p->n_calls - 1, s, (size_t)n};
    p->cur += (size_t)n;
    if (done) p->phase = PH_END;
    if (done && !*x->end && (x->id_len == 0 || x->id_open) && !*x->id_end) {
        /* nothing is owed after the arguments: the call has ended */
        p->phase = PH_NEXT;
        p->complete = !*x->close;
    }
    if (!done && p->cur < len) return 0; /* a held-back character: wait */
    return 1;
}

int chat_tools_parse(chat_tool_parser *p, const char *text, size_t len, bool final,
                     chat_tool_event *ev, int max) {
    const tool_syntax *x = syntax_of(p->format);
    int k = 0;
    while (k < max && p->cur < len) {
        const char *s = text + p->cur;
        size_t left = len - p->cur;
        if (p->mode == 0) p->mode = s[0] == (*x->open ? x->open[0] : x->call[0]) ? 2 : 1;
        if (p->mode == 1 || p->phase == PH_BROKEN) {
            ev[k++] = (chat_tool_event){CHAT_TOOL_EVENT_CONTENT, 0, s, left};
            p->cur = len;
            p->complete = false;
            break;
        }
        int r = -1; /* the phase's verdict: 1 moved on, 0 wait for more text, -1 broken */
        const char *lit = NULL, *lit2 = NULL;
        int next = 0, next2 = 0;
        switch (p->phase) {
        case PH_OPEN:
            lit = x->open, next = PH_CALL;
            break;
        case PH_END:
            lit = x->end, next = x->id_len > 0 && !x->id_open ? PH_ID : PH_ID_END;
            break;
        case PH_ID_END:
            lit = x->id_end, next = PH_NEXT;
            break;
        case PH_NEXT:
            lit = x->sep, next = PH_CALL;
            lit2 = *x->close ? x->close : NULL, next2 = PH_DONE;
            break;
        case PH_ID:
            r = parse_id(p, x, s, left);
            break;
        case PH_CALL:
            r = parse_call(p, x, text, len, &ev[k]);
            if (r != 1) break;
            k++;
            continue;
        case PH_ARGS:
            r = parse_args(p, x, text, len, final, ev, &k);
            if (r < 0) break;
            if (r == 0) return k;
            continue;
        default: /* PH_DONE: nothing may follow the closing */
            break;
        }
        if (lit || lit2) {
            int r1 = lit ? literal(s, left, lit) : -1, r2 = lit2 ? literal(s, left, lit2) : -1;
            if (r1 == 1 || r2 == 1) {
                p->cur += strlen(r1 == 1 ? lit : lit2);
                p->phase = r1 == 1 ? next : next2;
                r = 1;
            } else {
                r = r1 == 0 || r2 == 0 ? 0 : -1;
            }
        }
        if (r == 1) {
            if (p->phase == PH_ID_END && !*x->id_end) p->phase = PH_NEXT;
            /* after a call the calls are complete unless the format still owes its closing */
            p->complete = p->phase == PH_DONE || (p->phase == PH_NEXT && !*x->close);
            continue;
        }
        if (r == 0 && !final) break;
        p->phase = PH_BROKEN;
    }
    return k;
}

/* ---------------------------------------------------------------- repeated calls */

const char *chat_tools_closing(chat_tool_format f) { return syntax_of(f)->close; }

void chat_tool_guard_init(chat_tool_guard *g, chat_tool_format f) {
    memset(g, 0, sizeof *g);
    chat_tool_parser_init(&g->p, f);
}

void chat_tool_guard_free(chat_tool_guard *g) {
    free(g->calls);
    g->calls = NULL;
    g->n_calls = g->cap_calls = 0;
}

/* Whether call k has the name of an earlier call and arguments that (whole) equal that call's,
 * or (not whole) are the beginning of them so far. */
static bool guard_repeats(const chat_tool_guard *g, const char *text, int k, bool whole) {
    const struct chat_tool_span *c = &g->calls[k];
    for (int i = 0; i < k; i++) {
        const struct chat_tool_span *e = &g->calls[i];
        if (e->name_len != c->name_len || memcmp(text + e->name, text + c->name, c->name_len))
            continue;
        if (whole ? e->args_len != c->args_len : e->args_len < c->args_len) continue;
        if (!memcmp(text + e->args, text + c->args, c->args_len)) return true;
    }
    return false;
}

/* Takes the parser's events on the answer's next bytes into g's spans. -1 when out of memory. */
static int guard_events(chat_tool_guard *g, const char *text, const chat_tool_event *ev, int n) {
    for (int i = 0; i < n; i++) {
        if (ev[i].kind == CHAT_TOOL_EVENT_CONTENT) {
            g->free_text = true;
            return 0;
        }
        if (ev[i].kind == CHAT_TOOL_EVENT_CALL) {
            if (g->n_calls == g->cap_calls) {
                int cap = g->cap_calls ? 2 * g->cap_calls : 8;
                void *p = realloc(g->calls, sizeof *g->calls * (size_t)cap);
                if (!p) return -1;
                g->calls = p;
                g->cap_calls = cap;
            }
            g->calls[g->n_calls++] =
                (struct chat_tool_span){.name = (size_t)(ev[i].s - text), .name_len = ev[i].n};
            g->fresh = !guard_repeats(g, text, g->n_calls - 1, false);
            continue;
        }
        struct chat_tool_span *c = &g->calls[g->n_calls - 1];
        if (!c->has_args) c->args = (size_t)(ev[i].s - text), c->has_args = true;
        c->args_len = (size_t)(ev[i].s + ev[i].n - text) - c->args;
        if (!g->fresh) g->fresh = !guard_repeats(g, text, g->n_calls - 1, false);
    }
    return 0;
}

int chat_tool_guard_scan(chat_tool_guard *g, const char *text, size_t len, size_t *release,
                         size_t *cut) {
    *cut = len;
    /* One byte at a time, so that every end of a call is seen where it is. */
    while (!g->free_text && g->fed < len) {
        int before = g->p.phase, n;
        chat_tool_event ev[4];
        g->fed++;
        do {
            n = chat_tools_parse(&g->p, text, g->fed, false, ev, 4);
            if (guard_events(g, text, ev, n)) return -1;
        } while (n == 4 && !g->free_text);
        if (g->free_text || g->p.phase == PH_BROKEN) {
            g->free_text = true;
            break;
        }
        if (before == PH_ARGS && g->p.phase != PH_ARGS) { /* the arguments are complete */
            g->n_done++;
            if (!g->fresh && guard_repeats(g, text, g->n_calls - 1, true)) {
                *cut = *release = g->last_end;
                return 1;
            }
            g->fresh = true;
        }
        if (before != PH_NEXT && g->p.phase == PH_NEXT) { /* the call's syntax has ended */
            g->last_end = g->p.cur;
            g->fresh = false; /* what follows may begin a repeat */
        }
    }
    bool hold = !g->free_text && g->n_done > 0 && !g->fresh && g->p.phase != PH_DONE;
    *release = hold ? g->last_end : len;
    return 0;
}
