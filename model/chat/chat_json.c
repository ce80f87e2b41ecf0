/* JSON written as Python's json.dumps(ensure_ascii=False) writes it, which is what Hugging Face
 * templates' `tojson` gives (transformers' filter; see chat_impl.h): the text a model saw in
 * training for its tool lists, call arguments and results. Python's own behaviour is the
 * reference (Lib/json/encoder.py: py_encode_basestring, _make_iterencode; float.__repr__). */
#include "model/chat/chat_impl.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void pyjson_append_string(strbuf *b, const char *s) {
    kv_buf_append(b, "\"", 1);
    size_t run = 0; /* bytes of s copied as they are, pending */
    for (size_t i = 0;; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c != '\0' && c >= 0x20 && c != '"' && c != '\\') {
            run++;
            continue;
        }
        kv_buf_append(b, s + i - run, run);
        run = 0;
        if (c == '\0') break;
        static const char plain[] = "\"\\\n\r\t\b\f", escaped[] = "\"\\nrtbf";
        const char *k = strchr(plain, c);
        char e[8];
        if (k)
            snprintf(e, sizeof e, "\\%c", escaped[k - plain]);
        else
            snprintf(e, sizeof e, "\\u%04x", c);
        kv_buf_puts(b, e);
    }
    kv_buf_append(b, "\"", 1);
}

/* float.__repr__: the shortest digits that read back as x, in fixed notation when the decimal
 * exponent is in [-4, 16) (with ".0" when integral), else d.ddde+XX. */
static void append_float(strbuf *b, double x) {
    if (isnan(x) || isinf(x)) { /* json.dumps' spellings (not JSON, but what Python writes) */
        kv_buf_puts(b, isnan(x) ? "NaN" : x < 0 ? "-Infinity" : "Infinity");
        return;
    }
    char e[40];
    for (int prec = 0; prec < 17; prec++) {
        snprintf(e, sizeof e, "%.*e", prec, x);
        if (strtod(e, NULL) == x) break;
    }
    /* e is [-]d[.ddd]e[+-]XX */
    const char *p = e;
    char digits[24];
    int nd = 0;
    if (*p == '-') kv_buf_append(b, p++, 1);
    for (; *p != 'e'; p++)
        if (*p != '.') digits[nd++] = *p;
    int exp10 = atoi(p + 1);
    while (nd > 1 && digits[nd - 1] == '0') nd--;
    char out[48];
    int n = 0;
    if (exp10 >= -4 && exp10 < 16) {
        if (exp10 < 0) {
            n += snprintf(out + n, sizeof out - (size_t)n, "0.");
            for (int i = 0; i < -exp10 - 1; i++) out[n++] = '0';
            for (int i = 0; i < nd; i++) out[n++] = digits[i];
        } else {
            for (int i = 0; i <= exp10; i++) out[n++] = i < nd ? digits[i] : '0';
            out[n++] = '.';
            if (nd > exp10 + 1)
                for (int i = exp10 + 1; i < nd; i++) out[n++] = digits[i];
            else
                out[n++] = '0';
        }
    } else {
        out[n++] = digits[0];
        if (nd > 1) {
            out[n++] = '.';
            for (int i = 1; i < nd; i++) out[n++] = digits[i];
        }
        n += snprintf(out + n, sizeof out - (size_t)n, "e%c%02d", exp10 < 0 ? '-' : '+',
                      exp10 < 0 ? -exp10 : exp10);
    }
    kv_buf_append(b, out, (size_t)n);
}

static void newline_indent(strbuf *b, int indent, int level) {
    kv_buf_append(b, "\n", 1);
    for (int i = 0; i < indent * level; i++) kv_buf_append(b, " ", 1);
}

static void append_value(strbuf *b, const json_t *v, int indent, int level) {
    char num[32];
    switch (json_typeof(v)) {
    case JSON_OBJECT:
    case JSON_ARRAY: {
        bool obj = json_is_object(v);
        size_t n = obj ? json_object_size(v) : json_array_size(v);
        if (n == 0) {
            kv_buf_puts(b, obj ? "{}" : "[]");
            return;
        }
        kv_buf_puts(b, obj ? "{" : "[");
        /* json_object_iter walks the keys in insertion order (jansson >= 2.8) */
        void *it = obj ? json_object_iter((json_t *)v) : NULL;
        for (size_t i = 0; i < n; i++) {
            if (i > 0) kv_buf_puts(b, indent >= 0 ? "," : ", ");
            if (indent >= 0) newline_indent(b, indent, level + 1);
            if (obj) {
                pyjson_append_string(b, json_object_iter_key(it));
                kv_buf_puts(b, ": ");
                append_value(b, json_object_iter_value(it), indent, level + 1);
                it = json_object_iter_next((json_t *)v, it);
            } else {
                append_value(b, json_array_get(v, i), indent, level + 1);
            }
        }
        if (indent >= 0) newline_indent(b, indent, level);
        kv_buf_puts(b, obj ? "}" : "]");
        return;
    }
    case JSON_STRING:
        pyjson_append_string(b, json_string_value(v));
        return;
    case JSON_INTEGER:
        snprintf(num, sizeof num, "%lld", (long long)json_integer_value(v));
        kv_buf_puts(b, num);
        return;
    case JSON_REAL:
        append_float(b, json_real_value(v));
        return;
    case JSON_TRUE:
        kv_buf_puts(b, "true");
        return;
    case JSON_FALSE:
        kv_buf_puts(b, "false");
        return;
    case JSON_NULL:
        kv_buf_puts(b, "null");
        return;
    }
}

void pyjson_append(strbuf *b, const json_t *v, int indent) { append_value(b, v, indent, 0); }

int pyjson_append_text(strbuf *b, const char *text, int indent) {
    json_t *v = json_loads(text, JSON_DECODE_ANY, NULL);
    if (!v) return -1;
    pyjson_append(b, v, indent);
    json_decref(v);
    return 0;
}

json_t *chat_tool_json(const chat_tool *t) {
    json_t *fn = json_object();
    json_t *tool = json_pack("{s:s,s:o}", "type", "function", "function", fn);
    if (!tool) return NULL;
    json_object_set_new(fn, "name", json_string(t->name));
    if (t->description) json_object_set_new(fn, "description", json_string(t->description));
    json_t *params = t->parameters ? json_loads(t->parameters, 0, NULL) : NULL;
    if (params) json_object_set_new(fn, "parameters", params);
    return tool;
}
