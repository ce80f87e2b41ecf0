/* Chat templates: the prompt formats kvserve serves, re-implemented in C rather than executing
 * the GGUF's Jinja source. Each renderer reproduces, byte for byte, the Hugging Face template it
 * names; tests/unit/chat_test.c checks that against jinja2's own rendering (the JSON files in
 * tests/golden/chat, written by scripts/ref/make_chat_goldens.py):
 *
 *   ChatML   SmolLM2 / Qwen2 / the HF docs' ChatML, with the template's hard-coded default system
 *            message when it has one
 *   Llama 3  meta-llama/Meta-Llama-3-8B-Instruct (content passed through Jinja's `trim`)
 *   Llama 2  meta-llama/Llama-2-7b-chat-hf (content passed through Python's str.strip())
 *
 * Deliberate difference: Llama 2's template silently drops a system message that is not first
 * (it only checks that user turns fall on even positions); chat_render rejects it. */
#include "model/chat.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- growable string */

typedef struct strbuf {
    char *p;
    size_t len, cap;
    bool oom;
} strbuf;

static void sb_append(strbuf *b, const char *s, size_t n) {
    if (b->oom) return;
    size_t need;
    if (size_add(b->len, n + 1, &need) != 0) {
        b->oom = true;
        return;
    }
    if (need > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < need) cap = cap > SIZE_MAX / 2 ? need : cap * 2;
        char *p = realloc(b->p, cap);
        if (!p) {
            b->oom = true;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}

static void sb_puts(strbuf *b, const char *s) { sb_append(b, s, strlen(s)); }

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
static void sb_append_stripped(strbuf *b, const char *s) {
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
    sb_append(b, s + begin, end - begin);
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
    sb_append(b, o, n);
}

/* Appends s[0..n) with Jinja's newline normalisation (\r\n and \r become \n). */
static void sb_append_raw(strbuf *b, const char *s, size_t n) {
    for (size_t i = 0; i < n; i++) {
        if (s[i] == '\r') {
            sb_append(b, "\n", 1);
            if (i + 1 < n && s[i + 1] == '\n') i++;
        } else {
            sb_append(b, s + i, 1);
        }
    }
}

static void jinja_unescape(strbuf *b, const char *s, size_t n) {
    for (size_t i = 0; i < n; i++) {
        if (s[i] == '\r') { /* newline normalisation comes before unescaping */
            sb_append(b, "\n", 1);
            if (i + 1 < n && s[i + 1] == '\n') i++;
            continue;
        }
        if (s[i] != '\\' || i + 1 == n) {
            sb_append(b, s + i, 1);
            continue;
        }
        char e = s[++i];
        const char *simple = strchr("ntr\\'\"abfv", e);
        if (simple && e != '\0') {
            static const char out[] = "\n\t\r\\'\"\a\b\f\v";
            sb_append(b, &out[simple - "ntr\\'\"abfv"], 1);
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
        sb_append(b, s + i - 1, 2); /* unknown escape: Python keeps it */
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

void chat_template_detect(const char *jinja, size_t len, chat_template *out) {
    out->kind = CHAT_TEMPLATE_UNKNOWN;
    out->default_system = NULL;
    if (!jinja) return;
    /* The markers are the formats' own special tokens; a template spelling one of them is that
     * format (Llama 3.1+ templates also match Llama 3, and render without 3.1's date header). */
    if (find(jinja, len, "<|im_start|>")) {
        out->kind = CHAT_TEMPLATE_CHATML;
        out->default_system = chatml_default_system(jinja, len);
    } else if (find(jinja, len, "<|start_header_id|>")) {
        out->kind = CHAT_TEMPLATE_LLAMA3;
    } else if (find(jinja, len, "[INST]")) {
        out->kind = CHAT_TEMPLATE_LLAMA2;
    }
}

int chat_template_from_name(const char *name, chat_template *out) {
    out->kind = CHAT_TEMPLATE_UNKNOWN;
    out->default_system = NULL;
    if (!name) return -1;
    if (strcmp(name, "chatml") == 0)
        out->kind = CHAT_TEMPLATE_CHATML;
    else if (strcmp(name, "llama3") == 0)
        out->kind = CHAT_TEMPLATE_LLAMA3;
    else if (strcmp(name, "llama2") == 0 || strcmp(name, "mistral") == 0)
        out->kind = CHAT_TEMPLATE_LLAMA2;
    else
        return -1;
    return 0;
}

const char *chat_template_name(chat_template_kind kind) {
    switch (kind) {
    case CHAT_TEMPLATE_CHATML:
        return "chatml";
    case CHAT_TEMPLATE_LLAMA3:
        return "llama3";
    case CHAT_TEMPLATE_LLAMA2:
        return "llama2";
    case CHAT_TEMPLATE_UNKNOWN:
        break;
    }
    return "unknown";
}

void chat_template_free(chat_template *t) {
    if (!t) return;
    free(t->default_system);
    t->default_system = NULL;
    t->kind = CHAT_TEMPLATE_UNKNOWN;
}

/* ---------------------------------------------------------------- rendering */

static bool is_role(const chat_message *m, const char *role) { return strcmp(m->role, role) == 0; }

static const char *content_of(const chat_message *m) { return m->content ? m->content : ""; }

/* SmolLM2 / Qwen2: {% if loop.first and messages[0]['role'] != 'system' %} default system. */
static void render_chatml(strbuf *b, const chat_template *t, const chat_message *msgs, int n,
                          bool gen) {
    if (n > 0 && t->default_system && !is_role(&msgs[0], "system")) {
        sb_puts(b, "<|im_start|>system\n");
        sb_puts(b, t->default_system);
        sb_puts(b, "<|im_end|>\n");
    }
    for (int i = 0; i < n; i++) {
        sb_puts(b, "<|im_start|>");
        sb_puts(b, msgs[i].role);
        sb_puts(b, "\n");
        sb_puts(b, content_of(&msgs[i]));
        sb_puts(b, "<|im_end|>\n");
    }
    if (gen) sb_puts(b, "<|im_start|>assistant\n");
}

static void render_llama3(strbuf *b, const chat_message *msgs, int n, bool gen, const char *bos) {
    for (int i = 0; i < n; i++) {
        if (i == 0) sb_puts(b, bos);
        sb_puts(b, "<|start_header_id|>");
        sb_puts(b, msgs[i].role);
        sb_puts(b, "<|end_header_id|>\n\n");
        sb_append_stripped(b, content_of(&msgs[i]));
        sb_puts(b, "<|eot_id|>");
    }
    if (gen) sb_puts(b, "<|start_header_id|>assistant<|end_header_id|>\n\n");
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
            sb_puts(&content, "<<SYS>>\n");
            sb_puts(&content, sys);
            sb_puts(&content, "\n<</SYS>>\n\n");
        }
        sb_puts(&content, content_of(m));
        if (content.oom) {
            free(content.p);
            b->oom = true;
            return 0;
        }
        if (is_role(m, "user")) {
            sb_puts(b, bos);
            sb_puts(b, "[INST] ");
            sb_append_stripped(b, content.p);
            sb_puts(b, " [/INST]");
        } else {
            sb_puts(b, " ");
            sb_append_stripped(b, content.p);
            sb_puts(b, " </s>");
        }
        free(content.p);
    }
    return 0;
}

char *chat_render(const chat_template *t, const chat_message *msgs, int n_msgs,
                  bool add_generation_prompt, const char *bos, kv_error *err) {
    if (!t) {
        kv_fail(err, "chat: no template");
        return NULL;
    }
    if (n_msgs < 0 || (n_msgs > 0 && !msgs)) {
        kv_fail(err, "chat: invalid message list (%d messages)", n_msgs);
        return NULL;
    }
    for (int i = 0; i < n_msgs; i++) {
        const char *r = msgs[i].role;
        if (!r ||
            (strcmp(r, "system") != 0 && strcmp(r, "user") != 0 && strcmp(r, "assistant") != 0)) {
            kv_fail(err, "chat: message %d has unknown role '%s' (system, user, assistant)", i,
                    r ? r : "(null)");
            return NULL;
        }
    }
    if (!bos) bos = "";
    strbuf b = {0};
    sb_append(&b, "", 0); /* an empty conversation still renders to "" rather than NULL */
    int rc = 0;
    switch (t->kind) {
    case CHAT_TEMPLATE_CHATML:
        render_chatml(&b, t, msgs, n_msgs, add_generation_prompt);
        break;
    case CHAT_TEMPLATE_LLAMA3:
        render_llama3(&b, msgs, n_msgs, add_generation_prompt, bos);
        break;
    case CHAT_TEMPLATE_LLAMA2:
        rc = render_llama2(&b, msgs, n_msgs, bos, err);
        break;
    case CHAT_TEMPLATE_UNKNOWN:
    default:
        rc = kv_fail(err, "chat: unknown chat template; name one (chatml, llama3, llama2)");
    }
    if (rc == 0 && b.oom) rc = kv_fail(err, "chat: out of memory rendering %d messages", n_msgs);
    if (rc != 0) {
        free(b.p);
        return NULL;
    }
    return b.p;
}
