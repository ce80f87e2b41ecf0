/* Chat templates: the prompt formats kvserve serves, re-implemented in C rather than executing
 * the GGUF's Jinja source. Each renderer reproduces, byte for byte, the Hugging Face template it
 * names, with tools where the template has a tool format; tests/unit/chat_test.c checks that
 * against jinja2's own rendering (the JSON files in tests/golden/chat, written by
 * scripts/ref/make_chat_goldens.py):
 *
 *   ChatML      SmolLM2 / Qwen2 / the HF docs' ChatML, with the template's hard-coded default
 *               system message when it has one; with the Hermes tool format,
 *               Qwen/Qwen2.5-7B-Instruct
 *   Llama 3     meta-llama/Meta-Llama-3-8B-Instruct (content passed through Jinja's `trim`)
 *   Llama 3.1   meta-llama/Llama-3.1-8B-Instruct (3.2 and 3.3 render the same here)
 *   Llama 2     meta-llama/Llama-2-7b-chat-hf (content passed through Python's str.strip())
 *   Mistral     mistralai/Mistral-Nemo-Instruct-2407 ("v3-tekken")
 *   Mistral v3  mistralai/Mistral-Large-Instruct-2407 (Mistral 7B v0.3 writes this format too)
 *   legacy, v1  mistralai/Mistral-7B-Instruct-v0.2, its original template and its later one
 *   v7          mistralai/Mistral-Large-Instruct-2411
 *   v7-tekken   mistralai/Mistral-Small-3.2-24B-Instruct-2506 with its tool format (Small 3.x);
 *               unsloth/Devstral-Small-2507-GGUF's template without tools
 *
 * Deliberate differences: Llama 2's template silently drops a system message that is not first
 * (it only checks that user turns fall on even positions); chat_render rejects it. Mistral's
 * refuse call ids that are not 9 characters; chat_render maps them (chat_tools_mistral_id).
 * Mistral Small 3.x's template inserts a default system message carrying today's date when the
 * conversation has none; chat_render inserts none (a prompt's text, and its cached KV, would
 * change at midnight). Devstral's template checks no role order; chat_render checks it as
 * Small 3.2's does. */
#include "model/chat/chat_impl.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- Python whitespace */

/* Decodes one UTF-8 code point at s[0..n); returns its length, or 0 if malformed. */
static size_t utf8_decode(const unsigned char *s, size_t n, uint32_t *cp) {
    if (n == 0) return 0;
    unsigned c = s[0];
    size_t len;
    uint32_t v;
    if (c < 0x80) {
        *cp = c;
        return 1;
    } else if ((c & 0xe0) == 0xc0) {
        len = 2;
        v = c & 0x1f;
    } else if ((c & 0xf0) == 0xe0) {
        len = 3;
        v = c & 0x0f;
    } else if ((c & 0xf8) == 0xf0) {
        len = 4;
        v = c & 0x07;
    } else {
        return 0;
    }
    if (n < len) return 0;
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xc0) != 0x80) return 0;
        v = (v << 6) | (s[i] & 0x3f);
    }
    *cp = v;
    return len;
}

/* The code points for which Python's str.isspace() is true: what str.strip() and Jinja's `trim`
 * filter remove (Unicode White_Space plus the ASCII separators 0x1c-0x1f). */
static bool py_isspace(uint32_t c) {
    return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 ||
           c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 ||
           c == 0x202f || c == 0x205f || c == 0x3000;
}

/* Python's str.strip() on UTF-8 text: appends s without leading and trailing whitespace.
 * Malformed bytes count as non-space, so they stay. */
void sb_append_stripped(strbuf *b, const char *s) {
    const unsigned char *u = (const unsigned char *)s;
    size_t begin = 0, end = strlen(s);
    uint32_t cp;
    size_t k;
    while (begin < end && (k = utf8_decode(u + begin, end - begin, &cp)) > 0 && py_isspace(cp))
        begin += k;
    while (end > begin) {
        size_t start = end - 1; /* back up to the last code point's lead byte */
        while (start > begin && end - start < 4 && (u[start] & 0xc0) == 0x80) start--;
        k = utf8_decode(u + start, end - start, &cp);
        if (k != end - start || !py_isspace(cp)) break;
        end = start;
    }
    kv_buf_append(b, s + begin, end - begin);
}

/* ---------------------------------------------------------------- detection */

static const char *find(const char *hay, size_t n, const char *needle) {
    return memmem(hay, n, needle, strlen(needle));
}

static bool starts_with(const char *s, size_t n, const char *prefix) {
    size_t k = strlen(prefix);
    return n >= k && memcmp(s, prefix, k) == 0;
}

/* Decodes a Jinja string literal's body the way jinja2's lexer does (Python's unicode-escape
 * after newline normalisation): \n \t \r \\ \' \" \a \b \f \v, octal, \xhh, \uhhhh, \Uhhhhhhhh;
 * any other backslash stays as written. */
static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static void sb_append_utf8(strbuf *b, uint32_t cp) {
    char o[4];
    size_t n;
    if (cp < 0x80) {
        o[0] = (char)cp;
        n = 1;
    } else if (cp < 0x800) {
        o[0] = (char)(0xc0 | (cp >> 6));
        o[1] = (char)(0x80 | (cp & 0x3f));
        n = 2;
    } else if (cp < 0x10000) {
        o[0] = (char)(0xe0 | (cp >> 12));
        o[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
        o[2] = (char)(0x80 | (cp & 0x3f));
        n = 3;
    } else {
        o[0] = (char)(0xf0 | (cp >> 18));
        o[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
        o[2] = (char)(0x80 | ((cp >> 6) & 0x3f));
        o[3] = (char)(0x80 | (cp & 0x3f));
        n = 4;
    }
    kv_buf_append(b, o, n);
}

/* Appends s[0..n) with Jinja's newline normalisation (\r\n and \r become \n). */
static void sb_append_raw(strbuf *b, const char *s, size_t n) {
    for (size_t i = 0; i < n; i++) {
        if (s[i] == '\r') {
            kv_buf_append(b, "\n", 1);
            if (i + 1 < n && s[i + 1] == '\n') i++;
        } else {
            kv_buf_append(b, s + i, 1);
        }
    }
}

static void jinja_unescape(strbuf *b, const char *s, size_t n) {
    for (size_t i = 0; i < n; i++) {
        if (s[i] == '\r') { /* newline normalisation comes before unescaping */
            kv_buf_append(b, "\n", 1);
            if (i + 1 < n && s[i + 1] == '\n') i++;
            continue;
        }
        if (s[i] != '\\' || i + 1 == n) {
            kv_buf_append(b, s + i, 1);
            continue;
        }
        char e = s[++i];
        const char *simple = strchr("ntr\\'\"abfv", e);
        if (simple && e != '\0') {
            static const char out[] = "\n\t\r\\'\"\a\b\f\v";
            kv_buf_append(b, &out[simple - "ntr\\'\"abfv"], 1);
            continue;
        }
        int digits = e == 'x' ? 2 : e == 'u' ? 4 : e == 'U' ? 8 : 0;
        if (digits > 0) {
            uint32_t cp = 0;
            int k = 0;
            while (k < digits && i + 1 + k < n && hexval(s[i + 1 + k]) >= 0)
                cp = cp * 16 + (uint32_t)hexval(s[i + 1 + k++]);
            if (k == digits && cp <= 0x10ffff) {
                sb_append_utf8(b, cp);
                i += (size_t)k;
                continue;
            }
        } else if (e >= '0' && e <= '7') {
            uint32_t cp = 0;
            int k = 0;
            while (k < 3 && i + k < n && s[i + k] >= '0' && s[i + k] <= '7')
                cp = cp * 8 + (uint32_t)(s[i + k++] - '0');
            sb_append_utf8(b, cp);
            i += (size_t)k - 1;
            continue;
        }
        kv_buf_append(b, s + i - 1, 2); /* unknown escape: Python keeps it */
    }
}

/* If text holds "<|im_start|>system\n...<|im_end|>", returns a malloc'd copy of the "...". */
static char *system_from_text(const char *text, size_t n) {
    static const char open[] = "<|im_start|>system\n";
    const char *a = find(text, n, open);
    if (!a) return NULL;
    a += sizeof open - 1;
    const char *z = find(a, n - (size_t)(a - text), "<|im_end|>");
    if (!z) return NULL;
    return strndup(a, (size_t)(z - a));
}

/* A ChatML template that inserts a fixed system message spells it out as one piece of constant
 * text: a string literal inside {{ }} or {% %} (SmolLM2, Qwen2), or raw template text. Scans
 * both, decoding literals, and returns the first such message; a literal like
 * '<|im_start|>system\n' + messages[0]['content'] has no <|im_end|> in it and does not count. */
static char *chatml_default_system(const char *src, size_t len) {
    strbuf lit = {0};
    char *found = NULL;
    size_t i = 0;
    while (i < len && !found) {
        if (starts_with(src + i, len - i, "{#")) { /* comment */
            const char *z = find(src + i, len - i, "#}");
            i = z ? (size_t)(z - src) + 2 : len;
        } else if (starts_with(src + i, len - i, "{{") || starts_with(src + i, len - i, "{%")) {
            const char *close = src[i + 1] == '{' ? "}}" : "%}";
            i += 2;
            while (i < len && !found && !starts_with(src + i, len - i, close)) {
                char q = src[i];
                if (q != '\'' && q != '"') {
                    i++;
                    continue;
                }
                size_t j = i + 1;
                while (j < len && src[j] != q) j += src[j] == '\\' ? 2 : 1;
                if (j > len) j = len;
                lit.len = 0;
                jinja_unescape(&lit, src + i + 1, j - i - 1);
                if (!lit.oom && lit.p) found = system_from_text(lit.p, lit.len);
                i = j + 1;
            }
            i += 2;
        } else { /* raw text up to the next tag */
            size_t j = i + 1;
            while (j < len && !(src[j] == '{' && j + 1 < len &&
                                (src[j + 1] == '{' || src[j + 1] == '%' || src[j + 1] == '#')))
                j++;
            lit.len = 0;
            sb_append_raw(&lit, src + i, j - i);
            if (!lit.oom && lit.p) found = system_from_text(lit.p, lit.len);
            i = j;
        }
    }
    free(lit.p);
    return found;
}

/* The [INST] family, told apart by the spaces around [INST] and [/INST] and by Mistral's own
 * control tokens (https://github.com/mistralai/cookbook, concept-deep-dive/tokenization):
 *   [SYSTEM_PROMPT]               v7: "[INST] " (Large 2411), or "[INST]" (v7-tekken: Small 3.x,
 *                                 Devstral); their calls as [TOOL_CALLS]NAME[ARGS] are not a
 *                                 tool format of ours
 *   <<SYS>>                       Llama 2
 *   " [INST] "                    v1 (Mistral 7B v0.1 / v0.2), the system message first
 *   "[INST]" + content            Nemo (v3-tekken) when it has [TOOL_CALLS] and
 *                                 [AVAILABLE_TOOLS]
 *   "[INST] " ... "[/INST]"       v3 (Mistral 7B v0.3, Large 2407): the answer's side has no space
 *   "[INST] " ... " [/INST]"      Mistral 7B v0.1 / v0.2's original template (no system message)
 * Anything else with [INST] keeps Llama 2's format, as before these were told apart. */
static void mistral_detect(const char *jinja, size_t len, chat_template *out) {
    bool calls = find(jinja, len, "[TOOL_CALLS]") && find(jinja, len, "[AVAILABLE_TOOLS]");
    bool args = find(jinja, len, "[ARGS]") != NULL;
    out->kind = CHAT_TEMPLATE_LLAMA2;
    if (find(jinja, len, "[SYSTEM_PROMPT]")) {
        out->kind = find(jinja, len, "[INST] ") || find(jinja, len, "[SYSTEM_PROMPT] ")
                        ? CHAT_TEMPLATE_MISTRAL_V7
                        : CHAT_TEMPLATE_MISTRAL_V7_TEKKEN;
        /* Small 3.2's calls, [TOOL_CALLS]NAME[CALL_ID]ID[ARGS]; Devstral's and Ministral 3's,
         * without the id, are not (yet) a format of ours */
        if (out->kind == CHAT_TEMPLATE_MISTRAL_V7_TEKKEN && calls && args &&
            find(jinja, len, "[CALL_ID]") && find(jinja, len, "[TOOL_CONTENT]"))
            out->tools = CHAT_TOOLS_MISTRAL_V7;
    } else if (find(jinja, len, "<<SYS>>")) {
        out->kind = CHAT_TEMPLATE_LLAMA2;
    } else if (find(jinja, len, " [INST] ")) {
        out->kind = CHAT_TEMPLATE_MISTRAL_V1;
    } else if (!find(jinja, len, "[INST] ")) {
        if (calls && !args) {
            out->kind = CHAT_TEMPLATE_MISTRAL;
            out->tools = CHAT_TOOLS_MISTRAL;
        }
    } else if (!find(jinja, len, " [/INST]")) {
        out->kind = CHAT_TEMPLATE_MISTRAL_V3;
        if (calls && !args && find(jinja, len, "[TOOL_CALLS] ["))
            out->tools = CHAT_TOOLS_MISTRAL_V3;
    } else {
        out->kind = CHAT_TEMPLATE_MISTRAL_LEGACY;
    }
}

void chat_template_detect(const char *jinja, size_t len, chat_template *out) {
    *out = (chat_template){0};
    if (!jinja) return;
    /* The markers are the formats' own special tokens and fixed text. Templates that write
     * calls as <function=NAME> (Qwen3-Coder, functionary) or [TOOL_CALLS]NAME[ARGS] (later
     * Mistrals, which also have [SYSTEM_PROMPT]) are not these tool formats. */
    bool xml_calls = find(jinja, len, "<function=") != NULL;
    if (find(jinja, len, "<|im_start|>")) {
        out->kind = CHAT_TEMPLATE_CHATML;
        out->default_system = chatml_default_system(jinja, len);
        if (find(jinja, len, "<tool_call>") && find(jinja, len, "\"arguments\"") && !xml_calls)
            out->tools = CHAT_TOOLS_HERMES;
    } else if (find(jinja, len, "<|start_header_id|>")) {
        out->kind = CHAT_TEMPLATE_LLAMA3;
        if (find(jinja, len, "Cutting Knowledge Date:") && find(jinja, len, "\"parameters\": ") &&
            !xml_calls) {
            out->kind = CHAT_TEMPLATE_LLAMA31;
            out->tools = CHAT_TOOLS_LLAMA3;
        }
    } else if (find(jinja, len, "[INST]")) {
        mistral_detect(jinja, len, out);
    }
}

#define QWEN25_SYSTEM "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

static const struct {
    const char *name;
    chat_template_kind kind;
    chat_tool_format tools;
    const char *default_system;
} TEMPLATE_NAMES[] = {
    /* chat_template_name gives the first name of each kind */
    {"chatml", CHAT_TEMPLATE_CHATML, CHAT_TOOLS_GENERIC, NULL},
    {"llama3", CHAT_TEMPLATE_LLAMA3, CHAT_TOOLS_GENERIC, NULL},
    {"llama2", CHAT_TEMPLATE_LLAMA2, CHAT_TOOLS_GENERIC, NULL},
    {"llama3.1", CHAT_TEMPLATE_LLAMA31, CHAT_TOOLS_LLAMA3, NULL},
    {"mistral-nemo", CHAT_TEMPLATE_MISTRAL, CHAT_TOOLS_MISTRAL, NULL},
    {"mistral-legacy", CHAT_TEMPLATE_MISTRAL_LEGACY, CHAT_TOOLS_GENERIC, NULL},
    {"mistral-v1", CHAT_TEMPLATE_MISTRAL_V1, CHAT_TOOLS_GENERIC, NULL},
    {"mistral-v3", CHAT_TEMPLATE_MISTRAL_V3, CHAT_TOOLS_MISTRAL_V3, NULL},
    {"mistral-v7", CHAT_TEMPLATE_MISTRAL_V7, CHAT_TOOLS_GENERIC, NULL},
    {"mistral-v7-tekken", CHAT_TEMPLATE_MISTRAL_V7_TEKKEN, CHAT_TOOLS_MISTRAL_V7, NULL},
    /* Devstral's and Ministral 3's templates: v7-tekken, their calls without Small 3.2's ids */
    {"devstral", CHAT_TEMPLATE_MISTRAL_V7_TEKKEN, CHAT_TOOLS_GENERIC, NULL},
    {"qwen2.5", CHAT_TEMPLATE_CHATML, CHAT_TOOLS_HERMES, QWEN25_SYSTEM},
    {"hermes", CHAT_TEMPLATE_CHATML, CHAT_TOOLS_HERMES, NULL},
    {"llama3.2", CHAT_TEMPLATE_LLAMA31, CHAT_TOOLS_LLAMA3, NULL},
    {"llama3.3", CHAT_TEMPLATE_LLAMA31, CHAT_TOOLS_LLAMA3, NULL},
    /* "mistral" named Llama 2's format until kvserve had Mistral's own; v1 is Mistral's
     * template for the same models (Mistral 7B v0.1 / v0.2), and takes a system message too */
    {"mistral", CHAT_TEMPLATE_MISTRAL_V1, CHAT_TOOLS_GENERIC, NULL},
    {"mistral-v3-tekken", CHAT_TEMPLATE_MISTRAL, CHAT_TOOLS_MISTRAL, NULL},
};

#define N_TEMPLATE_NAMES (int)(sizeof TEMPLATE_NAMES / sizeof TEMPLATE_NAMES[0])

int chat_template_from_name(const char *name, chat_template *out) {
    *out = (chat_template){0};
    for (int i = 0; name && i < N_TEMPLATE_NAMES; i++) {
        if (strcmp(name, TEMPLATE_NAMES[i].name) != 0) continue;
        const char *sys = TEMPLATE_NAMES[i].default_system;
        if (sys && !(out->default_system = strdup(sys))) return -1;
        out->kind = TEMPLATE_NAMES[i].kind;
        out->tools = TEMPLATE_NAMES[i].tools;
        return 0;
    }
    return -1;
}

const char *chat_template_name(chat_template_kind kind) {
    for (int i = 0; i < N_TEMPLATE_NAMES; i++)
        if (TEMPLATE_NAMES[i].kind == kind) return TEMPLATE_NAMES[i].name;
    return "unknown";
}

void chat_template_free(chat_template *t) {
    if (!t) return;
    free(t->default_system);
    *t = (chat_template){0};
}

/* ---------------------------------------------------------------- rendering */

static bool is_role(const chat_message *m, const char *role) { return strcmp(m->role, role) == 0; }

static const char *content_of(const chat_message *m) { return m->content ? m->content : ""; }

static void append_tools_json(strbuf *b, const chat_tool *tools, int n, const char *before,
                              const char *after, int indent) {
    for (int i = 0; i < n; i++) {
        json_t *t = chat_tool_json(&tools[i]);
        if (!t) {
            b->oom = true;
            return;
        }
        kv_buf_puts(b, before);
        pyjson_append(b, t, indent);
        kv_buf_puts(b, after);
        json_decref(t);
    }
}

/* Qwen 2.5's system turn with tools: the system message (or the default) and the tool list. */
#define HERMES_TOOLS_HEAD                                                                          \
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are " \
    "provided with function signatures within <tools></tools> XML tags:\n<tools>"
#define HERMES_TOOLS_TAIL                                                                          \
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments " \
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "          \
    "\"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"

/* SmolLM2 / Qwen2: {% if loop.first and messages[0]['role'] != 'system' %} default system.
 * With the Hermes tool format, as Qwen 2.5's template: tools in the system turn, calls after the
 * assistant's content, consecutive tool results in one user turn. */
static int render_chatml(strbuf *b, const chat_template *t, const chat_message *msgs, int n,
                         const chat_tool *tools, int n_tools, bool gen, kv_error *err) {
    bool own_system = n > 0 && is_role(&msgs[0], "system");
    if (t->tools == CHAT_TOOLS_HERMES && n == 0)
        return kv_fail(err, "chat (qwen2.5): no messages (its template reads the first)");
    int first = 0;
    if (n_tools > 0) {
        kv_buf_puts(b, "<|im_start|>system\n");
        kv_buf_puts(b, own_system          ? content_of(&msgs[first++])
                       : t->default_system ? t->default_system
                                           : "");
        kv_buf_puts(b, HERMES_TOOLS_HEAD);
        append_tools_json(b, tools, n_tools, "\n", "", PYJSON_NO_INDENT);
        kv_buf_puts(b, HERMES_TOOLS_TAIL);
    } else if (n > 0 && t->default_system && !own_system) {
        kv_buf_puts(b, "<|im_start|>system\n");
        kv_buf_puts(b, t->default_system);
        kv_buf_puts(b, "<|im_end|>\n");
    }
    for (int i = first; i < n; i++) {
        const chat_message *m = &msgs[i];
        if (is_role(m, "tool")) {
            if (i == 0 || !is_role(&msgs[i - 1], "tool")) kv_buf_puts(b, "<|im_start|>user");
            kv_buf_puts(b, "\n<tool_response>\n");
            kv_buf_puts(b, content_of(m));
            kv_buf_puts(b, "\n</tool_response>");
            if (i == n - 1 || !is_role(&msgs[i + 1], "tool")) kv_buf_puts(b, "<|im_end|>\n");
            continue;
        }
        kv_buf_puts(b, "<|im_start|>");
        kv_buf_puts(b, m->role);
        if (m->n_tool_calls > 0) {
            if (*content_of(m)) kv_buf_puts(b, "\n");
            kv_buf_puts(b, content_of(m));
            kv_buf_puts(b, "\n");
            if (chat_tools_append_calls(b, CHAT_TOOLS_HERMES, m->tool_calls, m->n_tool_calls, i,
                                        err))
                return -1;
        } else {
            kv_buf_puts(b, "\n");
            kv_buf_puts(b, content_of(m));
        }
        kv_buf_puts(b, "<|im_end|>\n");
    }
    if (gen) kv_buf_puts(b, "<|im_start|>assistant\n");
    return 0;
}

static void llama3_turn(strbuf *b, const char *role, const char *content) {
    kv_buf_puts(b, "<|start_header_id|>");
    kv_buf_puts(b, role);
    kv_buf_puts(b, "<|end_header_id|>\n\n");
    sb_append_stripped(b, content);
    kv_buf_puts(b, "<|eot_id|>");
}

#define LLAMA3_GEN "<|start_header_id|>assistant<|end_header_id|>\n\n"

static void render_llama3(strbuf *b, const chat_message *msgs, int n, bool gen, const char *bos) {
    for (int i = 0; i < n; i++) {
        if (i == 0) kv_buf_puts(b, bos);
        llama3_turn(b, msgs[i].role, content_of(&msgs[i]));
    }
    if (gen) kv_buf_puts(b, LLAMA3_GEN);
}

/* Llama 3.1's template (3.2's and 3.3's write the same, given no builtin_tools and no
 * strftime_now): a system header always, the tools in the first user turn after the system
 * message, one call per assistant turn, results (JSON-quoted, as its `is iterable` test sends
 * strings through tojson) in "ipython" turns. */
#define LLAMA31_TOOLS_INTRO                                                                        \
    "Given the following functions, please respond with a JSON for a function call with its "      \
    "proper arguments that best answers the given prompt.\n\nRespond in the format {\"name\": "    \
    "function name, \"parameters\": dictionary of argument name and its value}.Do not use "        \
    "variables.\n\n"

static int render_llama31(strbuf *b, const chat_message *msgs, int n, const chat_tool *tools,
                          int n_tools, bool gen, const char *bos, kv_error *err) {
    if (n == 0) return kv_fail(err, "chat (llama3.1): no messages (its template reads the first)");
    int i = 0;
    const char *sys = is_role(&msgs[0], "system") ? content_of(&msgs[i++]) : "";
    kv_buf_puts(b, bos);
    kv_buf_puts(b, "<|start_header_id|>system<|end_header_id|>\n\n");
    if (n_tools > 0) kv_buf_puts(b, "Environment: ipython\n");
    kv_buf_puts(b, "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n");
    sb_append_stripped(b, sys);
    kv_buf_puts(b, "<|eot_id|>");
    if (n_tools > 0) {
        if (i == n)
            return kv_fail(err, "chat (llama3.1): the tools go into the first user message, and "
                                "there is none");
        kv_buf_puts(b, "<|start_header_id|>user<|end_header_id|>\n\n" LLAMA31_TOOLS_INTRO);
        append_tools_json(b, tools, n_tools, "", "\n\n", 4);
        sb_append_stripped(b, content_of(&msgs[i++]));
        kv_buf_puts(b, "<|eot_id|>");
    }
    for (; i < n; i++) {
        const chat_message *m = &msgs[i];
        if (is_role(m, "tool")) {
            kv_buf_puts(b, "<|start_header_id|>ipython<|end_header_id|>\n\n");
            pyjson_append_string(b, content_of(m));
            kv_buf_puts(b, "<|eot_id|>");
        } else if (m->n_tool_calls > 0) {
            kv_buf_puts(b, LLAMA3_GEN);
            if (chat_tools_append_calls(b, CHAT_TOOLS_LLAMA3, m->tool_calls, m->n_tool_calls, i,
                                        err))
                return -1;
            kv_buf_puts(b, "<|eot_id|>");
        } else {
            llama3_turn(b, m->role, content_of(m));
        }
    }
    if (gen) kv_buf_puts(b, LLAMA3_GEN);
    return 0;
}

/* The template ignores add_generation_prompt: " [/INST]" already opens the answer. Its eos_token
 * is "</s>" for every Llama 2 / Mistral tokenizer, so it is spelled here. */
static int render_llama2(strbuf *b, const chat_message *msgs, int n, const char *bos,
                         kv_error *err) {
    if (n == 0) return kv_fail(err, "chat (llama2): no messages");
    const char *sys = NULL;
    int first = 0;
    if (is_role(&msgs[0], "system")) {
        sys = content_of(&msgs[0]);
        first = 1;
    }
    for (int i = first; i < n; i++) {
        const chat_message *m = &msgs[i];
        int j = i - first;
        if (is_role(m, "system"))
            return kv_fail(err, "chat (llama2): message %d: a system message must come first", i);
        if (is_role(m, "user") != (j % 2 == 0))
            return kv_fail(err,
                           "chat (llama2): message %d: roles must alternate user/assistant "
                           "starting with user (got %s)",
                           i, m->role);
        strbuf content = {0};
        if (j == 0 && sys) {
            kv_buf_puts(&content, "<<SYS>>\n");
            kv_buf_puts(&content, sys);
            kv_buf_puts(&content, "\n<</SYS>>\n\n");
        }
        kv_buf_puts(&content, content_of(m));
        if (content.oom) {
            free(content.p);
            b->oom = true;
            return 0;
        }
        if (is_role(m, "user")) {
            kv_buf_puts(b, bos);
            kv_buf_puts(b, "[INST] ");
            sb_append_stripped(b, content.p);
            kv_buf_puts(b, " [/INST]");
        } else {
            kv_buf_puts(b, " ");
            sb_append_stripped(b, content.p);
            kv_buf_puts(b, " </s>");
        }
        free(content.p);
    }
    return 0;
}

/* Mistral Nemo's template and Mistral Large 2407's ("v3"), which differ only in spaces: tools
 * before the last user turn, each function's string fields written raw and the others through
 * tojson; the system message only in the last message, and only when that is the user's;
 * add_generation_prompt ignored ("[/INST]" opens the answer). */
typedef struct mistral_style {
    const char *name;       /* for errors */
    const char *tools_open; /* "[AVAILABLE_TOOLS][" */
    const char *inst;       /* "[INST]" */
    const char *results;    /* "[TOOL_RESULTS]{" */
    bool trim_answer;       /* v3: " " + content|trim */
    chat_tool_format calls;
} mistral_style;

static const mistral_style MISTRAL_NEMO = {
    "mistral-nemo", "[AVAILABLE_TOOLS][", "[INST]", "[TOOL_RESULTS]{", false, CHAT_TOOLS_MISTRAL};
static const mistral_style MISTRAL_V3 = {"mistral-v3", "[AVAILABLE_TOOLS] [",
                                         "[INST] ",    "[TOOL_RESULTS] {",
                                         true,         CHAT_TOOLS_MISTRAL_V3};

static void append_mistral_tools(strbuf *b, const mistral_style *st, const chat_tool *tools,
                                 int n) {
    kv_buf_puts(b, st->tools_open);
    for (int i = 0; i < n; i++) {
        json_t *t = chat_tool_json(&tools[i]);
        if (!t) {
            b->oom = true;
            return;
        }
        kv_buf_puts(b, i > 0 ? ", " : "");
        kv_buf_puts(b, "{\"type\": \"function\", \"function\": {");
        const char *key;
        json_t *v;
        const char *sep = "";
        json_object_foreach(json_object_get(t, "function"), key, v) {
            kv_buf_puts(b, sep);
            kv_buf_puts(b, "\"");
            kv_buf_puts(b, key);
            kv_buf_puts(b, "\": ");
            if (json_is_string(v)) {
                kv_buf_puts(b, "\"");
                kv_buf_puts(b, json_string_value(v));
                kv_buf_puts(b, "\"");
            } else {
                pyjson_append(b, v, PYJSON_NO_INDENT);
            }
            sep = ", ";
        }
        kv_buf_puts(b, "}}");
        json_decref(t);
    }
    kv_buf_puts(b, "][/AVAILABLE_TOOLS]");
}

static int render_mistral(strbuf *b, const mistral_style *st, const chat_message *msgs, int n,
                          const chat_tool *tools, int n_tools, const char *bos, kv_error *err) {
    if (n == 0)
        return kv_fail(err, "chat (%s): no messages (its template reads the first)", st->name);
    int first = 0;
    const char *sys = is_role(&msgs[0], "system") ? content_of(&msgs[first++]) : NULL;
    const char *last_user = NULL;
    for (int i = first, turn = 0; i < n; i++) {
        const chat_message *m = &msgs[i];
        if (is_role(m, "user")) last_user = content_of(m);
        if (is_role(m, "tool") || m->n_tool_calls > 0) continue;
        if (is_role(m, "user") != (turn++ % 2 == 0))
            return kv_fail(err,
                           "chat (%s): message %d: after the optional system message, roles must "
                           "alternate user/assistant (calls and results aside)",
                           st->name, i);
    }
    kv_buf_puts(b, bos);
    for (int i = first; i < n; i++) {
        const chat_message *m = &msgs[i];
        char id[10];
        if (is_role(m, "user")) {
            /* the template compares the messages (dicts): the last user turn's equals */
            if (n_tools > 0 && !strcmp(content_of(m), last_user))
                append_mistral_tools(b, st, tools, n_tools);
            kv_buf_puts(b, st->inst);
            if (i == n - 1 && sys) {
                kv_buf_puts(b, sys);
                kv_buf_puts(b, "\n\n");
            }
            kv_buf_puts(b, content_of(m));
            kv_buf_puts(b, "[/INST]");
        } else if (m->n_tool_calls > 0) {
            if (chat_tools_append_calls(b, st->calls, m->tool_calls, m->n_tool_calls, i, err))
                return -1;
            kv_buf_puts(b, "</s>");
        } else if (is_role(m, "assistant")) {
            if (st->trim_answer) {
                kv_buf_puts(b, " ");
                sb_append_stripped(b, content_of(m));
            } else {
                kv_buf_puts(b, content_of(m));
            }
            kv_buf_puts(b, "</s>");
        } else if (is_role(m, "tool")) {
            chat_tools_mistral_id(m->tool_call_id, id);
            kv_buf_puts(b, st->results);
            kv_buf_puts(b, "\"content\": ");
            kv_buf_puts(b, content_of(m));
            kv_buf_puts(b, ", \"call_id\": \"");
            kv_buf_puts(b, id);
            kv_buf_puts(b, "\"}[/TOOL_RESULTS]");
        } else {
            return kv_fail(err, "chat (%s): message %d: a system message must come first", st->name,
                           i);
        }
    }
    return 0;
}

/* Mistral 7B v0.1 / v0.2's original template. It has no system message: kvserve opens the
 * first user message with a leading one and "\n\n", as the same models' later template (v1)
 * does, rather than refuse what every OpenAI client sends (and the generic tool format's tool
 * list); the template's Jinja raises there instead. Roles alternate after it (user first);
 * nothing is trimmed; add_generation_prompt ignored. */
static int render_mistral_legacy(strbuf *b, const chat_message *msgs, int n, const char *bos,
                                 kv_error *err) {
    int first = n > 0 && is_role(&msgs[0], "system") ? 1 : 0;
    kv_buf_puts(b, bos);
    for (int i = first; i < n; i++) {
        const chat_message *m = &msgs[i];
        if (is_role(m, "user") != ((i - first) % 2 == 0))
            return kv_fail(err,
                           "chat (mistral-legacy): message %d: after the optional system message, "
                           "roles must alternate user/assistant starting with user (got %s)",
                           i, m->role);
        if (is_role(m, "user")) {
            kv_buf_puts(b, "[INST] ");
            if (i == first && first) {
                kv_buf_puts(b, content_of(&msgs[0]));
                kv_buf_puts(b, "\n\n");
            }
            kv_buf_puts(b, content_of(m));
            kv_buf_puts(b, " [/INST]");
        } else {
            kv_buf_puts(b, content_of(m));
            kv_buf_puts(b, "</s>");
        }
    }
    return 0;
}

/* Mistral "v1": the system message (and "\n\n") opens the first user message; roles alternate
 * after it; nothing trimmed; add_generation_prompt ignored. */
static int render_mistral_v1(strbuf *b, const chat_message *msgs, int n, const char *bos,
                             kv_error *err) {
    if (n == 0)
        return kv_fail(err, "chat (mistral-v1): no messages (its template reads the first)");
    int first = 0;
    const char *sys = is_role(&msgs[0], "system") ? content_of(&msgs[first++]) : NULL;
    kv_buf_puts(b, bos);
    for (int i = first; i < n; i++) {
        const chat_message *m = &msgs[i];
        if (is_role(m, "user") != ((i - first) % 2 == 0))
            return kv_fail(err,
                           "chat (mistral-v1): message %d: after the optional system message, "
                           "roles must alternate user/assistant (got %s)",
                           i, m->role);
        if (is_role(m, "user")) {
            kv_buf_puts(b, " [INST] ");
            if (i == first && sys) {
                kv_buf_puts(b, sys);
                kv_buf_puts(b, "\n\n");
            }
            kv_buf_puts(b, content_of(m));
            kv_buf_puts(b, " [/INST]");
        } else if (is_role(m, "assistant")) {
            kv_buf_puts(b, " ");
            kv_buf_puts(b, content_of(m));
            kv_buf_puts(b, "</s>");
        } else {
            return kv_fail(err, "chat (mistral-v1): message %d: a system message must come first",
                           i);
        }
    }
    return 0;
}

/* Mistral "v7" (Large 2411): every message in order, system ones as [SYSTEM_PROMPT], each marker
 * followed by a space; no role order checked. "v7-tekken" (Small 3.x): no spaces, and after the
 * optional first system message the others (system ones included; calls and results aside)
 * must alternate user / not user, as Small 3.2's template checks. Its default system message,
 * which carries today's date, is not inserted. With Small 3.2's tool format (tools != GENERIC):
 * the tools as one JSON list before the last user turn, an assistant turn's calls instead of
 * its content, results with their call's id. add_generation_prompt ignored. */
static int render_mistral_v7(strbuf *b, const chat_message *msgs, int n, bool tekken,
                             chat_tool_format tf, const chat_tool *tools, int n_tools,
                             const char *bos, kv_error *err) {
    const char *sp = tekken ? "" : " ";
    const char *name = tekken ? "mistral-v7-tekken" : "mistral-v7";
    int first = 0;
    kv_buf_puts(b, bos);
    if (tekken && n > 0 && is_role(&msgs[0], "system")) {
        kv_buf_puts(b, "[SYSTEM_PROMPT]");
        kv_buf_puts(b, content_of(&msgs[first++]));
        kv_buf_puts(b, "[/SYSTEM_PROMPT]");
    }
    const char *last_user = NULL;
    for (int i = first, turn = 0; i < n; i++) {
        if (is_role(&msgs[i], "user")) last_user = content_of(&msgs[i]);
        if (!tekken || is_role(&msgs[i], "tool") || msgs[i].n_tool_calls > 0) continue;
        if (is_role(&msgs[i], "user") != (turn++ % 2 == 0))
            return kv_fail(err,
                           "chat (%s): message %d: after the optional system message, roles must "
                           "alternate user/assistant (calls and results aside; got %s)",
                           name, i, msgs[i].role);
    }
    for (int i = first; i < n; i++) {
        const chat_message *m = &msgs[i];
        char id[10];
        if (is_role(m, "user")) {
            /* the template compares the messages (dicts): the last user turn's equals */
            if (n_tools > 0 && !strcmp(content_of(m), last_user)) {
                kv_buf_puts(b, "[AVAILABLE_TOOLS][");
                for (int k = 0; k < n_tools; k++) /* tools|tojson: one JSON list */
                    append_tools_json(b, &tools[k], 1, k > 0 ? ", " : "", "", PYJSON_NO_INDENT);
                kv_buf_puts(b, "][/AVAILABLE_TOOLS]");
            }
            kv_buf_puts(b, "[INST]");
            kv_buf_puts(b, sp);
            kv_buf_puts(b, content_of(m));
            kv_buf_puts(b, "[/INST]");
        } else if (is_role(m, "system")) {
            kv_buf_puts(b, "[SYSTEM_PROMPT]");
            kv_buf_puts(b, sp);
            kv_buf_puts(b, content_of(m));
            kv_buf_puts(b, "[/SYSTEM_PROMPT]");
        } else if (is_role(m, "assistant") && m->n_tool_calls > 0) {
            if (chat_tools_append_calls(b, tf, m->tool_calls, m->n_tool_calls, i, err)) return -1;
            kv_buf_puts(b, "</s>");
        } else if (is_role(m, "assistant")) {
            kv_buf_puts(b, sp);
            kv_buf_puts(b, content_of(m));
            kv_buf_puts(b, "</s>");
        } else if (is_role(m, "tool") && tf == CHAT_TOOLS_MISTRAL_V7) {
            chat_tools_mistral_id(m->tool_call_id, id);
            kv_buf_puts(b, "[TOOL_RESULTS]");
            kv_buf_puts(b, id);
            kv_buf_puts(b, "[TOOL_CONTENT]");
            kv_buf_puts(b, content_of(m));
            kv_buf_puts(b, "[/TOOL_RESULTS]");
        } else {
            return kv_fail(err, "chat (%s): message %d: role %s is not one of this template's",
                           name, i, m->role);
        }
    }
    return 0;
}

/* Whether the generic tool format must rewrite the conversation (tools, calls or results). */
static bool has_tool_parts(const chat_message *msgs, int n, int n_tools) {
    for (int i = 0; i < n; i++)
        if (msgs[i].n_tool_calls > 0 || is_role(&msgs[i], "tool")) return true;
    return n_tools > 0;
}

char *chat_render(const chat_template *t, const chat_message *msgs, int n_msgs,
                  const chat_tool *tools, int n_tools, bool add_generation_prompt, const char *bos,
                  kv_error *err) {
    if (!t) {
        kv_fail(err, "chat: no template");
        return NULL;
    }
    if (n_msgs < 0 || (n_msgs > 0 && !msgs) || n_tools < 0 || (n_tools > 0 && !tools)) {
        kv_fail(err, "chat: invalid message list (%d messages, %d tools)", n_msgs, n_tools);
        return NULL;
    }
    for (int i = 0; i < n_msgs; i++) {
        const char *r = msgs[i].role;
        if (!r || (strcmp(r, "system") != 0 && strcmp(r, "user") != 0 &&
                   strcmp(r, "assistant") != 0 && strcmp(r, "tool") != 0)) {
            kv_fail(err, "chat: message %d has unknown role '%s' (system, user, assistant, tool)",
                    i, r ? r : "(null)");
            return NULL;
        }
        if (msgs[i].n_tool_calls < 0 || (msgs[i].n_tool_calls > 0 && !msgs[i].tool_calls)) {
            kv_fail(err, "chat: message %d: invalid tool call list", i);
            return NULL;
        }
    }
    if (!bos) bos = "";
    chat_message *own = NULL;
    int n_own = 0;
    if (t->tools == CHAT_TOOLS_GENERIC && has_tool_parts(msgs, n_msgs, n_tools)) {
        if (chat_tools_generic_messages(msgs, n_msgs, tools, n_tools, &own, &n_own, err))
            return NULL;
        msgs = own;
        n_msgs = n_own;
        n_tools = 0;
    }
    strbuf b = {0};
    kv_buf_append(&b, "", 0); /* an empty conversation still renders to "" rather than NULL */
    int rc = 0;
    switch (t->kind) {
    case CHAT_TEMPLATE_CHATML:
        rc = render_chatml(&b, t, msgs, n_msgs, tools, n_tools, add_generation_prompt, err);
        break;
    case CHAT_TEMPLATE_LLAMA3:
        render_llama3(&b, msgs, n_msgs, add_generation_prompt, bos);
        break;
    case CHAT_TEMPLATE_LLAMA31:
        rc = render_llama31(&b, msgs, n_msgs, tools, n_tools, add_generation_prompt, bos, err);
        break;
    case CHAT_TEMPLATE_LLAMA2:
        rc = render_llama2(&b, msgs, n_msgs, bos, err);
        break;
    case CHAT_TEMPLATE_MISTRAL:
        rc = render_mistral(&b, &MISTRAL_NEMO, msgs, n_msgs, tools, n_tools, bos, err);
        break;
    case CHAT_TEMPLATE_MISTRAL_V3:
        rc = render_mistral(&b, &MISTRAL_V3, msgs, n_msgs, tools, n_tools, bos, err);
        break;
    case CHAT_TEMPLATE_MISTRAL_LEGACY:
        rc = render_mistral_legacy(&b, msgs, n_msgs, bos, err);
        break;
    case CHAT_TEMPLATE_MISTRAL_V1:
        rc = render_mistral_v1(&b, msgs, n_msgs, bos, err);
        break;
    case CHAT_TEMPLATE_MISTRAL_V7:
    case CHAT_TEMPLATE_MISTRAL_V7_TEKKEN:
        rc = render_mistral_v7(&b, msgs, n_msgs, t->kind == CHAT_TEMPLATE_MISTRAL_V7_TEKKEN,
                               t->tools, tools, n_tools, bos, err);
        break;
    case CHAT_TEMPLATE_UNKNOWN:
    default:
        rc = kv_fail(err, "chat: unknown chat template; name one (" CHAT_TEMPLATE_NAMES ")");
    }
    chat_messages_free(own, n_own);
    if (rc == 0 && b.oom) rc = kv_fail(err, "chat: out of memory rendering %d messages", n_msgs);
    if (rc != 0) {
        free(b.p);
        return NULL;
    }
    return b.p;
}
