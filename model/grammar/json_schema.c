/* JSON Schema (draft 2020-12, the subset structured outputs use) compiled to GBNF.
 *
 * The output is JSON as Python's json.dumps writes it: ", " between members and elements, ": "
 * after keys, no other whitespace, properties in the schema's order. One fixed layout makes
 * most of an object's text forced (`{"name": "` after `{`), which jump-forward feeds to the
 * model without sampling, and is the layout models see most in training.
 *
 * Supported: type (a name or a list), properties, required, additionalProperties (false when
 * absent: no extra keys are generated, which every schema accepts; true or a schema: extra keys
 * after the declared ones), items, prefixItems, minItems, maxItems, minLength, maxLength, pattern
 * (^ $ literals . [classes] \d \w \s groups | * + ? {m,n}), format (date, time, date-time, uuid,
 * email), enum, const, minimum, maximum, exclusiveMinimum, exclusiveMaximum (integers exactly;
 * numbers keep to the integer bounds inside the range, a subset of the valid values), anyOf,
 * oneOf (as anyOf: exclusivity is not enforced), allOf (of object schemas, merged), $ref to
 * "#", "#/$defs/.." or "#/definitions/.." (recursion included), $defs/definitions, and the
 * annotations (title, description, default, examples, $schema, $id, $comment, deprecated,
 * readOnly, writeOnly, discriminator). Anything else is an error naming the keyword. */
#include "model/grammar/grammar.h"

#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_DEPTH 64
#define MAX_BOUND 1e15 /* integer bounds beyond this are treated as absent */

/* ---------------------------------------------------------------- text builder */

typedef kv_buf sbuf; /* util's growable buffer: an append that fails sets oom */

/* A GBNF string literal of s[0..n) (quotes, backslashes and control bytes escaped). */
static void sb_literal(sbuf *b, const char *s, size_t n) {
    kv_buf_append(b, "\"", 1);
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\')
            kv_buf_printf(b, "\\%c", c);
        else if (c < 0x20 || c == 0x7f)
            kv_buf_printf(b, "\\x%02X", c);
        else
            kv_buf_append(b, (const char *)&c, 1);
    }
    kv_buf_append(b, "\"", 1);
}

/* A JSON value's compact text as a GBNF literal (enum, const). */
static int sb_json_literal(sbuf *b, const json_t *v) {
    char *t = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
    if (!t) return -1;
    sb_literal(b, t, strlen(t));
    free(t);
    return 0;
}

/* ---------------------------------------------------------------- compiler state */

typedef struct jsc {
    const json_t *root;
    sbuf out; /* the rules */
    int n_rules;
    /* $ref targets already given a rule: pointer -> rule number */
    const json_t **ref_node;
    int *ref_rule;
    int n_refs, cap_refs;
    kv_error *err;
} jsc;

static int new_rule(jsc *c) { return c->n_rules++; }

static int fail_kw(jsc *c, const char *path, const char *what, const char *kw) {
    return kv_fail(c->err, "json_schema: %s '%s' at %s", what, kw, path);
}

static int compile(jsc *c, const json_t *s, const char *path, int depth, int *rule);

/* Compiles s into a new rule and writes its name into b. */
static int ref_to(jsc *c, sbuf *b, const json_t *s, const char *path, int depth) {
    int r;
    if (compile(c, s, path, depth + 1, &r)) return -1;
    kv_buf_printf(b, "r%d", r);
    return 0;
}

static void child_path(char *out, size_t cap, const char *path, const char *a, const char *b) {
    snprintf(out, cap, "%s/%s%s%s", path, a, b ? "/" : "", b ? b : "");
}

/* ---------------------------------------------------------------- primitives */

static const char *PRIMITIVES =
    "value ::= object | array | string | number | \"true\" | \"false\" | \"null\"\n"
    "object ::= \"{\" ( member ( \", \" member )* )? \"}\"\n"
    "member ::= string \": \" value\n"
    "array ::= \"[\" ( value ( \", \" value )* )? \"]\"\n"
    "string ::= \"\\\"\" char* \"\\\"\"\n"
    "char ::= [^\"\\\\\\x00-\\x1F] | \"\\\\\" ( [\"\\\\/bfnrt] | \"u\" [0-9a-fA-F]{4} )\n"
    "integer ::= \"-\"? ( \"0\" | [1-9] [0-9]{0,15} )\n"
    "number ::= integer ( \".\" [0-9]{1,15} )? ( [eE] [-+]? [0-9]{1,3} )?\n"
    "boolean ::= \"true\" | \"false\"\n"
    "null ::= \"null\"\n"
    "date ::= [0-9]{4} \"-\" ( \"0\" [1-9] | \"1\" [0-2] ) \"-\" ( \"0\" [1-9] | [12] [0-9] | "
    "\"3\" [01] )\n"
    "time ::= ( [01] [0-9] | \"2\" [0-3] ) \":\" [0-5] [0-9] \":\" [0-5] [0-9] ( \".\" "
    "[0-9]{1,6} )? ( \"Z\" | [+-] ( [01] [0-9] | \"2\" [0-3] ) \":\" [0-5] [0-9] )\n"
    "hex ::= [0-9a-f]\n"
    "uuid ::= hex{8} \"-\" hex{4} \"-\" hex{4} \"-\" hex{4} \"-\" hex{12}\n"
    "email ::= [a-zA-Z0-9._+-]{1,64} \"@\" [a-zA-Z0-9-]{1,63} ( \".\" [a-zA-Z0-9-]{1,63} "
    "){0,3} \".\" [a-zA-Z]{2,12}\n";

const char *json_object_gbnf(void) {
    static const char *G =
        "root ::= object\n"
        "value ::= object | array | string | number | \"true\" | \"false\" | \"null\"\n"
        "object ::= \"{\" ( member ( \", \" member )* )? \"}\"\n"
        "member ::= string \": \" value\n"
        "array ::= \"[\" ( value ( \", \" value )* )? \"]\"\n"
        "string ::= \"\\\"\" char* \"\\\"\"\n"
        "char ::= [^\"\\\\\\x00-\\x1F] | \"\\\\\" ( [\"\\\\/bfnrt] | \"u\" [0-9a-fA-F]{4} )\n"
        "number ::= \"-\"? ( \"0\" | [1-9] [0-9]{0,15} ) ( \".\" [0-9]{1,15} )? ( [eE] [-+]? "
        "[0-9]{1,3} )?\n";
    return G;
}

/* ---------------------------------------------------------------- integer ranges */

/* Digits of lo..hi, both with n digits (as strings), as GBNF alternatives into b. */
static void digits_range(sbuf *b, const char *lo, const char *hi, int n) {
    if (n == 0) {
        kv_buf_append(b, "\"\"", 2);
        return;
    }
    if (lo[0] == hi[0]) {
        kv_buf_printf(b, "\"%c\" ", lo[0]);
        kv_buf_append(b, "(", 1);
        digits_range(b, lo + 1, hi + 1, n - 1);
        kv_buf_append(b, ")", 1);
        return;
    }
    bool lo_zeros = true, hi_nines = true;
    for (int i = 1; i < n; i++) {
        lo_zeros &= lo[i] == '0';
        hi_nines &= hi[i] == '9';
    }
    if (lo_zeros && hi_nines) {
        kv_buf_printf(b, "[%c-%c]", lo[0], hi[0]);
        if (n > 1) kv_buf_printf(b, " [0-9]{%d}", n - 1);
        return;
    }
    char nines[24], zeros[24];
    memset(nines, '9', sizeof nines);
    memset(zeros, '0', sizeof zeros);
    int from = lo[0], to = hi[0];
    bool sep = false;
    kv_buf_append(b, "(", 1);
    if (!lo_zeros) {
        kv_buf_printf(b, "\"%c\" (", lo[0]);
        digits_range(b, lo + 1, nines, n - 1);
        kv_buf_append(b, ")", 1);
        from++;
        sep = true;
    }
    if (!hi_nines) to--;
    if (from <= to) {
        if (sep) kv_buf_append(b, " | ", 3);
        kv_buf_printf(b, "[%c-%c]", from, to);
        if (n > 1) kv_buf_printf(b, " [0-9]{%d}", n - 1);
        sep = true;
    }
    if (!hi_nines) {
        if (sep) kv_buf_append(b, " | ", 3);
        kv_buf_printf(b, "\"%c\" (", hi[0]);
        digits_range(b, zeros, hi + 1, n - 1);
        kv_buf_append(b, ")", 1);
    }
    kv_buf_append(b, ")", 1);
}

/* Non-negative integers in [lo, hi] (hi < 0: unbounded above) without leading zeros. */
static void uint_range(sbuf *b, int64_t lo, int64_t hi) {
    kv_buf_append(b, "(", 1);
    char ls[24], hs[24];
    int nl = snprintf(ls, sizeof ls, "%lld", (long long)lo);
    int nh = hi >= 0 ? snprintf(hs, sizeof hs, "%lld", (long long)hi) : 16;
    bool first = true;
    for (int n = nl; n <= nh; n++) {
        int64_t pow = 1;
        for (int i = 1; i < n; i++) pow *= 10;
        int64_t a = n == 1 ? 0 : pow, z = pow * 10 - 1;
        if (a < lo) a = lo;
        if (hi >= 0 && z > hi) z = hi;
        if (a > z) continue;
        char as[24], zs[24];
        snprintf(as, sizeof as, "%lld", (long long)a);
        snprintf(zs, sizeof zs, "%lld", (long long)z);
        if (!first) kv_buf_append(b, " | ", 3);
        first = false;
        digits_range(b, as, zs, n);
    }
    if (first) kv_buf_append(b, "\"0\"", 3); /* not reached: callers keep lo <= hi */
    kv_buf_append(b, ")", 1);
}

/* Integers in [lo, hi]; has_lo/has_hi false for an open side. */
static void int_range(sbuf *b, bool has_lo, int64_t lo, bool has_hi, int64_t hi) {
    kv_buf_append(b, "(", 1);
    bool any = false;
    /* negative part: -x for x in [max(1, -hi), -lo] */
    if (!has_lo || lo < 0) {
        int64_t xlo = has_hi && hi < 0 ? -hi : 1, xhi = has_lo ? -lo : -1;
        kv_buf_append(b, "\"-\" ", 4);
        uint_range(b, xlo, xhi);
        any = true;
    }
    if (!has_hi || hi >= 0) {
        if (any) kv_buf_append(b, " | ", 3);
        uint_range(b, has_lo && lo > 0 ? lo : 0, has_hi ? hi : -1);
    }
    kv_buf_append(b, ")", 1);
}

/* ---------------------------------------------------------------- keywords */

static bool is_annotation(const char *k) {
    static const char *ann[] = {"title",      "description", "default",       "examples",
                                "$schema",    "$id",         "$comment",      "deprecated",
                                "readOnly",   "writeOnly",   "discriminator", "$defs",
                                "definitions"};
    for (size_t i = 0; i < sizeof ann / sizeof *ann; i++)
        if (!strcmp(k, ann[i])) return true;
    return false;
}

/* Every keyword of s must be known for its type (or an annotation). */
static int check_keywords(jsc *c, const json_t *s, const char *path) {
    static const char *known[] = {"type",
                                  "properties",
                                  "required",
                                  "additionalProperties",
                                  "items",
                                  "prefixItems",
                                  "minItems",
                                  "maxItems",
                                  "minLength",
                                  "maxLength",
                                  "pattern",
                                  "format",
                                  "enum",
                                  "const",
                                  "minimum",
                                  "maximum",
                                  "exclusiveMinimum",
                                  "exclusiveMaximum",
                                  "anyOf",
                                  "oneOf",
                                  "allOf",
                                  "$ref",
                                  "strict",
                                  "nullable"};
    const char *k;
    const json_t *v;
    json_object_foreach((json_t *)s, k, v) {
        bool ok = is_annotation(k);
        for (size_t i = 0; !ok && i < sizeof known / sizeof *known; i++) ok = !strcmp(k, known[i]);
        if (!ok) return fail_kw(c, path, "unsupported keyword", k);
    }
    return 0;
}

static int get_count(jsc *c, const json_t *s, const char *key, const char *path, int64_t *out) {
    const json_t *v = json_object_get(s, key);
    if (!v) return 0;
    if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > 100000)
        return fail_kw(c, path, "expected a count from 0 to 100000 for", key);
    *out = (int64_t)json_integer_value(v);
    return 1;
}

/* x repeated lo..hi times (hi < 0: unbounded), separated by sep ("" for none). */
static void repeat(sbuf *b, const char *x, const char *sep, int64_t lo, int64_t hi) {
    if (hi == 0) {
        kv_buf_append(b, "\"\"", 2);
        return;
    }
    if (lo == 0) kv_buf_append(b, "(", 1);
    kv_buf_printf(b, "%s", x);
    int64_t rlo = lo > 0 ? lo - 1 : 0, rhi = hi > 0 ? hi - 1 : -1;
    if (rhi != 0) {
        kv_buf_printf(b, " ( %s%s%s )", sep, *sep ? " " : "", x);
        if (rhi < 0)
            kv_buf_printf(b, "{%lld,}", (long long)rlo);
        else
            kv_buf_printf(b, "{%lld,%lld}", (long long)rlo, (long long)rhi);
    }
    if (lo == 0) kv_buf_append(b, ")?", 2);
}

static int compile_string(jsc *c, const json_t *s, const char *path, sbuf *b);
static int compile_object(jsc *c, const json_t *s, const char *path, int depth, sbuf *b);

/* A number's bounds as an integer range: inclusive bounds rounded inward (a subset of the valid
 * values for fractional bounds). Returns false for an empty range. */
static int bounds(jsc *c, const json_t *s, const char *path, bool integer, bool *has_lo,
                  int64_t *lo, bool *has_hi, int64_t *hi, bool *hi_excl) {
    *has_lo = *has_hi = *hi_excl = false;
    const char *keys[] = {"minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"};
    for (int i = 0; i < 4; i++) {
        const json_t *v = json_object_get(s, keys[i]);
        if (!v) continue;
        if (!json_is_number(v)) return fail_kw(c, path, "expected a number for", keys[i]);
        double d = json_number_value(v);
        if (fabs(d) > MAX_BOUND) continue;
        bool excl = i == 1 || i == 3;
        if (i < 2) {
            double f = ceil(d);
            if (excl && f == d) f += 1; /* > d: the next integer (numbers: a subset) */
            if (!*has_lo || (int64_t)f > *lo) *lo = (int64_t)f;
            *has_lo = true;
        } else {
            double f = floor(d);
            bool e = false;
            if (excl && f == d) {
                if (integer)
                    f -= 1;
                else
                    e = true; /* numbers below d: integer part up to d - 1, any fraction */
            }
            if (!*has_hi || (int64_t)f < *hi || ((int64_t)f == *hi && e)) {
                *hi = (int64_t)f;
                *hi_excl = e;
            }
            *has_hi = true;
        }
    }
    if (*has_lo && *has_hi && (*lo > *hi || (*lo == *hi && *hi_excl)))
        return kv_fail(c->err, "json_schema: the bounds at %s leave no value", path);
    return 0;
}

static int compile_number(jsc *c, const json_t *s, const char *path, bool integer, sbuf *b) {
    bool has_lo, has_hi, hi_excl;
    int64_t lo = 0, hi = 0;
    if (bounds(c, s, path, integer, &has_lo, &lo, &has_hi, &hi, &hi_excl)) return -1;
    if (!has_lo && !has_hi) {
        kv_buf_printf(b, "%s", integer ? "integer" : "number");
        return 0;
    }
    if (integer) {
        int_range(b, has_lo, lo, has_hi, hi);
        return 0;
    }
    /* numbers: an integer part in range with any fraction where every fraction keeps the
     * value in range, and the bounds themselves exactly */
    const char *frac = "( \".\" [0-9]{1,15} )?";
    bool any = false;
    kv_buf_append(b, "(", 1);
    if (!has_hi || hi >= 0) {
        int64_t a = has_lo && lo > 0 ? lo : 0;
        if (!has_hi || hi - 1 >= a) {
            kv_buf_append(b, "(", 1);
            uint_range(b, a, has_hi ? hi - 1 : -1);
            kv_buf_printf(b, " %s)", frac);
            any = true;
        }
        if (has_hi && !hi_excl && hi >= a) {
            kv_buf_printf(b, "%s\"%lld\"", any ? " | " : "", (long long)hi);
            any = true;
        }
    }
    if (!has_lo || lo < 0) {
        /* -x: x above -hi (or from 1), at most -lo */
        int64_t xlo = has_hi && hi < 0 ? (hi_excl ? -hi + 1 : -hi) : 1;
        if (!has_lo || -lo - 1 >= xlo) {
            kv_buf_printf(b, "%s\"-\" (", any ? " | " : "");
            uint_range(b, xlo, has_lo ? -lo - 1 : -1);
            kv_buf_printf(b, " %s)", frac);
            any = true;
        }
        if (has_lo && -lo >= xlo) {
            kv_buf_printf(b, "%s\"-%lld\"", any ? " | " : "", (long long)-lo);
            any = true;
        }
    }
    kv_buf_append(b, ")", 1);
    if (!any) return kv_fail(c->err, "json_schema: the bounds at %s leave no value", path);
    return 0;
}

/* ---------------------------------------------------------------- patterns */

typedef struct rx {
    const char *s;
    size_t n, i;
    jsc *c;
    const char *path;
    int depth;
} rx;

/* A character class item in GBNF class syntax (escaped unless alphanumeric). */
static void class_char(sbuf *b, uint32_t cp) {
    if ((cp >= '0' && cp <= '9') || (cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z'))
        kv_buf_printf(b, "%c", (char)cp);
    else if (cp <= 0xFFFF)
        kv_buf_printf(b, "\\u%04X", (unsigned)cp);
    else
        kv_buf_printf(b, "\\U%08X", (unsigned)cp);
}

static int rx_fail(rx *r, const char *what) {
    return kv_fail(r->c->err, "json_schema: pattern at %s: %s (at offset %zu)", r->path, what,
                   r->i);
}

/* Characters a JSON string can hold without an escape: the class of a pattern's "any". */
#define RX_ANY "[^\"\\\\\\x00-\\x1F]"

static int rx_escape_class(rx *r, char e, sbuf *b, bool in_class) {
    const char *pos = NULL, *neg = NULL;
    switch (e) {
    case 'd':
        pos = "0-9";
        break;
    case 'w':
        pos = "a-zA-Z0-9_";
        break;
    case 's':
        pos = " ";
        break;
    case 'D':
        neg = "0-9";
        break;
    case 'W':
        neg = "a-zA-Z0-9_";
        break;
    case 'S':
        neg = " ";
        break;
    default:
        return 1;
    }
    if (in_class) {
        if (neg) return rx_fail(r, "negated escapes inside a class are not supported");
        kv_buf_printf(b, "%s", pos);
        return 0;
    }
    if (pos)
        kv_buf_printf(b, "[%s]", pos);
    else
        kv_buf_printf(b, "[^%s\"\\\\\\x00-\\x1F]", neg);
    return 0;
}

static int rx_char(rx *r, uint32_t *cp) {
    size_t len;
    uint32_t v;
    if (r->i >= r->n) return rx_fail(r, "unexpected end");
    unsigned char ch = (unsigned char)r->s[r->i];
    if (ch < 0x80) {
        *cp = ch;
        r->i++;
        return 0;
    }
    /* a UTF-8 sequence: decode its code point (the schema text is valid UTF-8) */
    int n = ch >= 0xF0 ? 4 : ch >= 0xE0 ? 3 : 2;
    v = ch & (n == 4 ? 0x07 : n == 3 ? 0x0F : 0x1F);
    for (len = 1; len < (size_t)n && r->i + len < r->n; len++)
        v = (v << 6) | ((unsigned char)r->s[r->i + len] & 0x3F);
    r->i += len;
    *cp = v;
    return 0;
}

static int rx_alt(rx *r, sbuf *b);

static int rx_class(rx *r, sbuf *b) {
    r->i++; /* [ */
    bool neg = r->i < r->n && r->s[r->i] == '^';
    if (neg) r->i++;
    kv_buf_append(b, neg ? "[^" : "[", neg ? 2 : 1);
    bool first = true;
    while (r->i < r->n && (r->s[r->i] != ']' || first)) {
        first = false;
        uint32_t lo, hi;
        if (r->s[r->i] == '\\') {
            r->i++;
            if (r->i >= r->n) return rx_fail(r, "unexpected end");
            char e = r->s[r->i++];
            int rc = rx_escape_class(r, e, b, true);
            if (rc <= 0) {
                if (rc < 0) return -1;
                continue;
            }
            lo = e == 'n' ? '\n' : e == 't' ? '\t' : (unsigned char)e;
        } else if (rx_char(r, &lo)) {
            return -1;
        }
        hi = lo;
        if (r->i + 1 < r->n && r->s[r->i] == '-' && r->s[r->i + 1] != ']') {
            r->i++;
            if (r->s[r->i] == '\\') {
                r->i++;
                if (r->i >= r->n) return rx_fail(r, "unexpected end");
                hi = (unsigned char)r->s[r->i++];
            } else if (rx_char(r, &hi)) {
                return -1;
            }
            if (hi < lo) return rx_fail(r, "range out of order");
        }
        /* characters JSON would escape are left out of a positive class */
        if (!neg) {
            if (hi < 0x20) continue;
            if (lo < 0x20) lo = 0x20;
            if (lo <= '"' && hi >= '"') {
                if (lo < '"') {
                    class_char(b, lo);
                    if ('"' - 1 > lo) {
                        kv_buf_append(b, "-", 1);
                        class_char(b, '"' - 1);
                    }
                }
                if (hi == '"') continue;
                lo = '"' + 1;
            }
            if (lo <= '\\' && hi >= '\\') {
                if (lo < '\\') {
                    class_char(b, lo);
                    if ('\\' - 1 > lo) {
                        kv_buf_append(b, "-", 1);
                        class_char(b, '\\' - 1);
                    }
                }
                if (hi == '\\') continue;
                lo = '\\' + 1;
            }
        }
        class_char(b, lo);
        if (hi > lo) {
            kv_buf_append(b, "-", 1);
            class_char(b, hi);
        }
    }
    if (r->i >= r->n) return rx_fail(r, "unterminated class");
    r->i++; /* ] */
    if (neg) kv_buf_printf(b, "%s", "\"\\\\\\x00-\\x1F");
    kv_buf_append(b, "]", 1);
    return 0;
}

static int rx_atom(rx *r, sbuf *b) {
    char ch = r->s[r->i];
    if (ch == '(') {
        if (++r->depth > MAX_DEPTH) return rx_fail(r, "groups nested too deeply");
        r->i++;
        if (r->i + 1 < r->n && r->s[r->i] == '?' && r->s[r->i + 1] == ':')
            r->i += 2;
        else if (r->i < r->n && r->s[r->i] == '?')
            return rx_fail(r, "lookaround and named groups are not supported");
        kv_buf_append(b, "(", 1);
        if (rx_alt(r, b)) return -1;
        if (r->i >= r->n || r->s[r->i] != ')') return rx_fail(r, "expected ')'");
        r->i++;
        r->depth--;
        kv_buf_append(b, ")", 1);
        return 0;
    }
    if (ch == '[') return rx_class(r, b);
    if (ch == '.') {
        r->i++;
        kv_buf_append(b, RX_ANY, strlen(RX_ANY));
        return 0;
    }
    uint32_t cp;
    if (ch == '\\') {
        r->i++;
        if (r->i >= r->n) return rx_fail(r, "unexpected end");
        char e = r->s[r->i++];
        int rc = rx_escape_class(r, e, b, false);
        if (rc <= 0) return rc;
        if (e >= '0' && e <= '9') return rx_fail(r, "backreferences are not supported");
        if (e == 'b' || e == 'B') return rx_fail(r, "word boundaries are not supported");
        cp = e == 'n' ? '\n' : e == 't' ? '\t' : (unsigned char)e;
    } else if (rx_char(r, &cp)) {
        return -1;
    }
    /* the character as it appears in the JSON text */
    char enc[8];
    size_t n;
    if (cp == '"' || cp == '\\') {
        enc[0] = '\\';
        enc[1] = (char)cp;
        n = 2;
    } else if (cp == '\n' || cp == '\t') {
        enc[0] = '\\';
        enc[1] = cp == '\n' ? 'n' : 't';
        n = 2;
    } else if (cp < 0x20) {
        n = (size_t)snprintf(enc, sizeof enc, "\\u%04x", (unsigned)cp);
    } else if (cp < 0x80) {
        enc[0] = (char)cp;
        n = 1;
    } else {
        /* copy the original UTF-8 bytes */
        size_t len = cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4;
        memcpy(enc, r->s + r->i - len, len);
        n = len;
    }
    sb_literal(b, enc, n);
    return 0;
}

static int rx_seq(rx *r, sbuf *b) {
    while (r->i < r->n && r->s[r->i] != '|' && r->s[r->i] != ')') {
        char ch = r->s[r->i];
        if (ch == '^' || ch == '$') { /* anchors: the value is the whole string anyway */
            r->i++;
            continue;
        }
        if (ch == '*' || ch == '+' || ch == '?' || ch == '{')
            return rx_fail(r, "a quantifier with nothing to repeat");
        kv_buf_append(b, "(", 1);
        if (rx_atom(r, b)) return -1;
        kv_buf_append(b, ")", 1);
        if (r->i < r->n) {
            ch = r->s[r->i];
            if (ch == '*' || ch == '+' || ch == '?') {
                kv_buf_append(b, &ch, 1);
                r->i++;
            } else if (ch == '{') {
                size_t j = r->i + 1;
                while (j < r->n && r->s[j] != '}') j++;
                if (j >= r->n) return rx_fail(r, "unterminated {m,n}");
                /* {m}, {m,} or {m,n}: digits required where GBNF requires them */
                long m = -1, n = -2;
                size_t k = r->i + 1;
                for (; k < j && r->s[k] >= '0' && r->s[k] <= '9'; k++)
                    m = (m < 0 ? 0 : m) * 10 + (r->s[k] - '0'), m = m > 100000 ? 100000 : m;
                if (k < j && r->s[k] == ',') {
                    n = -1;
                    for (k++; k < j && r->s[k] >= '0' && r->s[k] <= '9'; k++)
                        n = (n < 0 ? 0 : n) * 10 + (r->s[k] - '0'), n = n > 100000 ? 100000 : n;
                }
                if (k != j || m < 0 || m > 10000 || n > 10000 || (n >= 0 && n < m))
                    return rx_fail(r, "bad {m,n}");
                kv_buf_append(b, r->s + r->i, j + 1 - r->i);
                r->i = j + 1;
            }
            if (r->i < r->n && (r->s[r->i] == '?' || r->s[r->i] == '+')) r->i++; /* lazy */
        }
        kv_buf_append(b, " ", 1);
    }
    return 0;
}

static int rx_alt(rx *r, sbuf *b) {
    kv_buf_append(b, "\"\" ", 3);
    if (rx_seq(r, b)) return -1;
    while (r->i < r->n && r->s[r->i] == '|') {
        r->i++;
        kv_buf_append(b, " | \"\" ", 6);
        if (rx_seq(r, b)) return -1;
    }
    return 0;
}

/* ---------------------------------------------------------------- strings */

static int compile_string(jsc *c, const json_t *s, const char *path, sbuf *b) {
    const json_t *fmt = json_object_get(s, "format");
    const json_t *pat = json_object_get(s, "pattern");
    int64_t lo = 0, hi = -1;
    if (get_count(c, s, "minLength", path, &lo) < 0) return -1;
    if (get_count(c, s, "maxLength", path, &hi) < 0) return -1;
    if (hi >= 0 && hi < lo)
        return kv_fail(c->err, "json_schema: maxLength < minLength at %s", path);
    if (pat) {
        if (!json_is_string(pat)) return fail_kw(c, path, "expected a string for", "pattern");
        if (fmt || lo > 0 || hi >= 0)
            return fail_kw(c, path,
                           "pattern with length or format bounds is not supported:", "pattern");
        sbuf tmp = {0};
        rx r = {json_string_value(pat), json_string_length(pat), 0, c, path, 0};
        int rc = rx_alt(&r, &tmp);
        if (!rc && r.i < r.n) rc = rx_fail(&r, "unbalanced ')'");
        if (!rc) kv_buf_printf(b, "\"\\\"\" (%s) \"\\\"\"", tmp.p ? tmp.p : "\"\"");
        free(tmp.p);
        return rc;
    }
    if (fmt) {
        if (!json_is_string(fmt)) return fail_kw(c, path, "expected a string for", "format");
        const char *f = json_string_value(fmt);
        const char *rule = !strcmp(f, "date")        ? "date"
                           : !strcmp(f, "time")      ? "time"
                           : !strcmp(f, "date-time") ? "date \"T\" time"
                           : !strcmp(f, "uuid")      ? "uuid"
                           : !strcmp(f, "email")     ? "email"
                                                     : NULL;
        if (!rule) return fail_kw(c, path, "unsupported format", f);
        kv_buf_printf(b, "\"\\\"\" %s \"\\\"\"", rule);
        return 0;
    }
    if (lo == 0 && hi < 0) {
        kv_buf_append(b, "string", 6);
        return 0;
    }
    kv_buf_append(b, "\"\\\"\" ", 5);
    if (hi < 0)
        kv_buf_printf(b, "char{%lld,}", (long long)lo);
    else
        kv_buf_printf(b, "char{%lld,%lld}", (long long)lo, (long long)hi);
    kv_buf_append(b, " \"\\\"\"", 5);
    return 0;
}

/* ---------------------------------------------------------------- arrays and objects */

static int compile_array(jsc *c, const json_t *s, const char *path, int depth, sbuf *b) {
    const json_t *items = json_object_get(s, "items");
    const json_t *prefix = json_object_get(s, "prefixItems");
    int64_t lo = 0, hi = -1;
    char cp[512];
    if (get_count(c, s, "minItems", path, &lo) < 0) return -1;
    if (get_count(c, s, "maxItems", path, &hi) < 0) return -1;
    if (hi >= 0 && hi < lo) return kv_fail(c->err, "json_schema: maxItems < minItems at %s", path);
    if (prefix && !json_is_array(prefix))
        return fail_kw(c, path, "expected an array for", "prefixItems");
    size_t k = prefix ? json_array_size(prefix) : 0;
    sbuf item = {0};
    if (items && json_is_false(items)) {
        hi = (int64_t)k;
    } else if (items && !json_is_true(items)) {
        child_path(cp, sizeof cp, path, "items", NULL);
        if (ref_to(c, &item, items, cp, depth)) {
            free(item.p);
            return -1;
        }
    } else if (k > 0 && !items) {
        hi = (int64_t)k; /* a tuple: no further items generated */
    }
    if (!item.p) kv_buf_append(&item, "value", 5);
    if (item.oom) return kv_fail(c->err, "out of memory");
    kv_buf_append(b, "\"[\" ", 4);
    for (size_t i = 0; i < k; i++) {
        char idx[24];
        snprintf(idx, sizeof idx, "%zu", i);
        child_path(cp, sizeof cp, path, "prefixItems", idx);
        if (i) kv_buf_append(b, "\", \" ", 5);
        if (ref_to(c, b, json_array_get(prefix, i), cp, depth)) {
            free(item.p);
            return -1;
        }
        kv_buf_append(b, " ", 1);
    }
    int64_t rlo = lo > (int64_t)k ? lo - (int64_t)k : 0;
    int64_t rhi = hi < 0 ? -1 : hi - (int64_t)k;
    if (rhi != 0) {
        if (k > 0) {
            sbuf x = {0};
            kv_buf_printf(&x, "\", \" %s", item.p);
            kv_buf_append(b, "(", 1);
            repeat(b, x.p ? x.p : "", "", rlo, rhi);
            kv_buf_append(b, ")", 1);
            free(x.p);
        } else {
            repeat(b, item.p, "\", \"", rlo, rhi);
        }
    }
    kv_buf_append(b, " \"]\"", 4);
    free(item.p);
    return 0;
}

/* Collects allOf's object schemas into one (properties and required merged). */
static json_t *merge_all_of(jsc *c, const json_t *s, const char *path) {
    const json_t *all = json_object_get(s, "allOf");
    if (!json_is_array(all) || json_array_size(all) == 0) {
        fail_kw(c, path, "expected a non-empty array for", "allOf");
        return NULL;
    }
    json_t *m = json_deep_copy(s);
    json_object_del(m, "allOf");
    json_t *props = json_object(), *req = json_array();
    const json_t *own = json_object_get(s, "properties");
    if (own) json_object_update(props, (json_t *)own);
    const json_t *oreq = json_object_get(s, "required");
    if (json_is_array(oreq)) json_array_extend(req, (json_t *)oreq);
    size_t i;
    const json_t *sub;
    json_array_foreach(all, i, sub) {
        /* a $ref inside allOf: follow it */
        const json_t *t = sub;
        const json_t *ref = json_object_get(sub, "$ref");
        if (ref && json_is_string(ref)) {
            const char *r = json_string_value(ref);
            const char *name = !strncmp(r, "#/$defs/", 8)          ? r + 8
                               : !strncmp(r, "#/definitions/", 14) ? r + 14
                                                                   : NULL;
            const json_t *defs =
                json_object_get(c->root, !strncmp(r, "#/$defs/", 8) ? "$defs" : "definitions");
            t = name && defs ? json_object_get(defs, name) : NULL;
        }
        const json_t *p = t ? json_object_get(t, "properties") : NULL;
        const json_t *type = t ? json_object_get(t, "type") : NULL;
        if (!t ||
            (!p && !(type && json_is_string(type) && !strcmp(json_string_value(type), "object")))) {
            json_decref(m);
            json_decref(props);
            json_decref(req);
            fail_kw(c, path, "allOf is supported over object schemas only:", "allOf");
            return NULL;
        }
        if (p) json_object_update(props, (json_t *)p);
        const json_t *r = json_object_get(t, "required");
        if (json_is_array(r)) json_array_extend(req, (json_t *)r);
    }
    json_object_set_new(m, "properties", props);
    json_object_set_new(m, "required", req);
    json_object_set_new(m, "type", json_string("object"));
    return m;
}

static bool is_required(const json_t *req, const char *name) {
    size_t i;
    const json_t *v;
    json_array_foreach(req, i, v) {
        if (json_is_string(v) && !strcmp(json_string_value(v), name)) return true;
    }
    return false;
}

/* Every name in "required" must be a string with a schema in "properties". */
static int check_required(jsc *c, const json_t *props, const json_t *req, const char *path) {
    if (req && !json_is_array(req)) return fail_kw(c, path, "expected an array for", "required");
    if (!req) return 0;
    size_t i;
    const json_t *v;
    json_array_foreach(req, i, v) {
        if (!json_is_string(v)) return fail_kw(c, path, "expected strings in", "required");
        if (!props || !json_object_get(props, json_string_value(v)))
            return kv_fail(c->err,
                           "json_schema: required property '%s' at %s has no schema "
                           "in 'properties'",
                           json_string_value(v), path);
    }
    return 0;
}

/* The extra members' rule body into extra (`string ": " value`, or the additionalProperties
 * schema's rule) when extra keys are allowed; *open says whether they are. */
static int extra_members(jsc *c, const json_t *props, const json_t *addl, const char *path,
                         int depth, bool *open, sbuf *extra) {
    char cp[512];
    if (addl && !json_is_boolean(addl) && !json_is_object(addl))
        return fail_kw(c, path, "expected a boolean or a schema for", "additionalProperties");
    *open = addl && !json_is_false(addl);
    if (!props && !addl) *open = true; /* {"type": "object"}: any object */
    if (!*open) return 0;
    kv_buf_append(extra, "string \": \" ", 12);
    if (addl && json_is_object(addl)) {
        child_path(cp, sizeof cp, path, "additionalProperties", NULL);
        return ref_to(c, extra, addl, cp, depth);
    }
    kv_buf_append(extra, "value", 5);
    return 0;
}

/* A rule per declared property, `"key": value`, numbered into kv[i] in the schema's order, and
 * whether it is required into reqd[i]. */
static int member_rules(jsc *c, const json_t *props, const json_t *req, const char *path, int depth,
                        int *kv, bool *reqd) {
    char cp[512];
    const char *key;
    const json_t *sub;
    size_t i = 0;
    json_object_foreach((json_t *)props, key, sub) {
        child_path(cp, sizeof cp, path, "properties", key);
        int r = new_rule(c), vr;
        if (compile(c, sub, cp, depth + 1, &vr)) return -1;
        sbuf kt = {0};
        json_t *ks = json_string(key);
        if (!ks || sb_json_literal(&kt, ks)) kt.oom = true;
        json_decref(ks);
        kv_buf_printf(&c->out, "r%d ::= %s \": \" r%d\n", r, kt.p ? kt.p : "\"\"", vr);
        free(kt.p);
        kv[i] = r;
        reqd[i] = req && is_required(req, key);
        i++;
    }
    return 0;
}

/* The rules that chain n members (kv, reqd) and the extra ones (extra, when open) in order, each
 * optional one skippable; returns the rule of the whole list. after_i: members from i on when
 * one came before; first_i: members from i on when none did; both built from the end. */
static int member_chain(jsc *c, const int *kv, const bool *reqd, size_t n, bool open,
                        const char *extra) {
    int after = new_rule(c);
    if (open)
        kv_buf_printf(&c->out, "r%d ::= ( \", \" %s )*\n", after, extra);
    else
        kv_buf_printf(&c->out, "r%d ::= \"\"\n", after);
    int first = new_rule(c);
    if (open)
        kv_buf_printf(&c->out, "r%d ::= ( %s r%d )?\n", first, extra, after);
    else
        kv_buf_printf(&c->out, "r%d ::= \"\"\n", first);
    for (size_t k = n; k-- > 0;) {
        int a = new_rule(c), f = new_rule(c);
        if (reqd[k]) {
            kv_buf_printf(&c->out, "r%d ::= \", \" r%d r%d\n", a, kv[k], after);
            kv_buf_printf(&c->out, "r%d ::= r%d r%d\n", f, kv[k], after);
        } else {
            kv_buf_printf(&c->out, "r%d ::= \", \" r%d r%d | r%d\n", a, kv[k], after, after);
            kv_buf_printf(&c->out, "r%d ::= r%d r%d | r%d\n", f, kv[k], after, first);
        }
        after = a;
        first = f;
    }
    return first;
}

/* An object: the declared members in the schema's order (the optional ones skippable), then the
 * extra ones where additionalProperties allows them. */
static int compile_object(jsc *c, const json_t *s, const char *path, int depth, sbuf *b) {
    const json_t *props = json_object_get(s, "properties");
    const json_t *req = json_object_get(s, "required");
    const json_t *addl = json_object_get(s, "additionalProperties");
    if (props && !json_is_object(props))
        return fail_kw(c, path, "expected an object for", "properties");
    if (check_required(c, props, req, path)) return -1;
    sbuf extra = {0};
    bool open;
    if (extra_members(c, props, addl, path, depth, &open, &extra)) {
        free(extra.p);
        return -1;
    }
    size_t n = props ? json_object_size(props) : 0;
    int *kv = calloc(n + 1, sizeof *kv);
    bool *reqd = calloc(n + 1, sizeof *reqd);
    if (!kv || !reqd || extra.oom) {
        free(kv);
        free(reqd);
        free(extra.p);
        return kv_fail(c->err, "out of memory");
    }
    int rc = member_rules(c, props, req, path, depth, kv, reqd);
    if (!rc) kv_buf_printf(b, "\"{\" r%d \"}\"", member_chain(c, kv, reqd, n, open, extra.p));
    free(kv);
    free(reqd);
    free(extra.p);
    return rc;
}

/* ---------------------------------------------------------------- schemas */

static const json_t *resolve_ref(jsc *c, const json_t *ref, const char *path) {
    if (!json_is_string(ref)) {
        fail_kw(c, path, "expected a string for", "$ref");
        return NULL;
    }
    const char *r = json_string_value(ref);
    if (!strcmp(r, "#")) return c->root;
    const char *defs_key = NULL, *name = NULL;
    if (!strncmp(r, "#/$defs/", 8)) {
        defs_key = "$defs";
        name = r + 8;
    } else if (!strncmp(r, "#/definitions/", 14)) {
        defs_key = "definitions";
        name = r + 14;
    }
    const json_t *defs = defs_key ? json_object_get(c->root, defs_key) : NULL;
    const json_t *t = defs && name ? json_object_get(defs, name) : NULL;
    if (!t) kv_fail(c->err, "json_schema: $ref '%.200s' at %s does not resolve", r, path);
    return t;
}

static int compile_typed(jsc *c, const json_t *s, const char *type, const char *path, int depth,
                         sbuf *b) {
    if (!strcmp(type, "string")) return compile_string(c, s, path, b);
    if (!strcmp(type, "integer")) return compile_number(c, s, path, true, b);
    if (!strcmp(type, "number")) return compile_number(c, s, path, false, b);
    if (!strcmp(type, "boolean")) {
        kv_buf_append(b, "boolean", 7);
        return 0;
    }
    if (!strcmp(type, "null")) {
        kv_buf_append(b, "null", 4);
        return 0;
    }
    if (!strcmp(type, "object")) return compile_object(c, s, path, depth, b);
    if (!strcmp(type, "array")) return compile_array(c, s, path, depth, b);
    return fail_kw(c, path, "unknown type", type);
}

static int compile_body(jsc *c, const json_t *s, const char *path, int depth, sbuf *b);

/* $ref: the target's rule, compiled once (the first reference names it, later ones and
 * recursion reuse the name). */
static int compile_ref(jsc *c, const json_t *v, const char *path, int depth, sbuf *b) {
    char cp[512];
    const json_t *t = resolve_ref(c, v, path);
    if (!t) return -1;
    for (int i = 0; i < c->n_refs; i++)
        if (c->ref_node[i] == t) {
            kv_buf_printf(b, "r%d", c->ref_rule[i]);
            return 0;
        }
    if (c->n_refs == c->cap_refs) {
        int cap = c->cap_refs ? c->cap_refs * 2 : 8;
        const json_t **n = realloc(c->ref_node, sizeof *n * (size_t)cap);
        if (n) c->ref_node = n;
        int *r = realloc(c->ref_rule, sizeof *r * (size_t)cap);
        if (r) c->ref_rule = r;
        if (!n || !r) return kv_fail(c->err, "out of memory");
        c->cap_refs = cap;
    }
    /* The rule is named before it is compiled, so recursion refers to it. */
    int rule = new_rule(c);
    c->ref_node[c->n_refs] = t;
    c->ref_rule[c->n_refs++] = rule;
    sbuf body = {0};
    snprintf(cp, sizeof cp, "%.400s", json_string_value(v));
    int rc = compile_body(c, t, cp, depth + 1, &body);
    if (!rc) kv_buf_printf(&c->out, "r%d ::= %s\n", rule, body.p ? body.p : "\"\"");
    free(body.p);
    if (rc) return -1;
    kv_buf_printf(b, "r%d", rule);
    return 0;
}

/* enum: one of the listed values' literals. */
static int compile_enum(jsc *c, const json_t *v, const char *path, sbuf *b) {
    if (!json_is_array(v) || json_array_size(v) == 0)
        return fail_kw(c, path, "expected a non-empty array for", "enum");
    size_t i;
    const json_t *e;
    kv_buf_append(b, "(", 1);
    json_array_foreach(v, i, e) {
        if (i) kv_buf_append(b, " | ", 3);
        if (sb_json_literal(b, e)) return kv_fail(c->err, "out of memory");
    }
    kv_buf_append(b, ")", 1);
    return 0;
}

/* anyOf or oneOf (alt_key; both as anyOf): a rule per alternative. */
static int compile_alternatives(jsc *c, const json_t *v, const char *alt_key, const char *path,
                                int depth, sbuf *b) {
    char cp[512];
    if (!json_is_array(v) || json_array_size(v) == 0)
        return fail_kw(c, path, "expected a non-empty array for", alt_key);
    size_t i;
    const json_t *e;
    kv_buf_append(b, "(", 1);
    json_array_foreach(v, i, e) {
        char idx[24];
        snprintf(idx, sizeof idx, "%zu", i);
        child_path(cp, sizeof cp, path, alt_key, idx);
        if (i) kv_buf_append(b, " | ", 3);
        if (ref_to(c, b, e, cp, depth)) return -1;
    }
    kv_buf_append(b, ")", 1);
    return 0;
}

/* A schema without "type": the type its keywords imply, else any value. */
static int compile_untyped(jsc *c, const json_t *s, bool nullable, const char *path, int depth,
                           sbuf *b) {
    const char *t = json_object_get(s, "properties") || json_object_get(s, "required") ||
                            json_object_get(s, "additionalProperties")
                        ? "object"
                    : json_object_get(s, "items") || json_object_get(s, "prefixItems") ? "array"
                    : json_object_get(s, "pattern") || json_object_get(s, "format") ||
                            json_object_get(s, "minLength") || json_object_get(s, "maxLength")
                        ? "string"
                    : json_object_get(s, "minimum") || json_object_get(s, "maximum") ? "number"
                                                                                     : NULL;
    if (!t) {
        kv_buf_append(b, "value", 5); /* null included */
        return 0;
    }
    if (nullable) kv_buf_append(b, "( null | ", 9);
    int rc = compile_typed(c, s, t, path, depth, b);
    if (nullable) kv_buf_append(b, " )", 2);
    return rc;
}

/* "type" (a name or a list of names; "nullable": true adds null). */
static int compile_type(jsc *c, const json_t *s, const json_t *type, const char *path, int depth,
                        sbuf *b) {
    bool nullable = json_is_true(json_object_get(s, "nullable"));
    if (!type) return compile_untyped(c, s, nullable, path, depth, b);
    if (json_is_string(type)) {
        if (nullable) kv_buf_append(b, "( null | ", 9);
        int rc = compile_typed(c, s, json_string_value(type), path, depth, b);
        if (nullable) kv_buf_append(b, " )", 2);
        return rc;
    }
    if (!json_is_array(type) || json_array_size(type) == 0)
        return fail_kw(c, path, "expected a name or a list of names for", "type");
    size_t i;
    const json_t *t;
    kv_buf_append(b, "(", 1);
    if (nullable) kv_buf_append(b, "null | ", 7);
    json_array_foreach(type, i, t) {
        if (!json_is_string(t)) return fail_kw(c, path, "expected names in", "type");
        if (i) kv_buf_append(b, " | ", 3);
        if (compile_typed(c, s, json_string_value(t), path, depth, b)) return -1;
    }
    kv_buf_append(b, ")", 1);
    return 0;
}

/* The body of s's rule into b: the first of $ref, const, enum, allOf, anyOf/oneOf and type that
 * s has decides. */
static int compile_body(jsc *c, const json_t *s, const char *path, int depth, sbuf *b) {
    if (json_is_true(s)) {
        kv_buf_append(b, "value", 5);
        return 0;
    }
    if (!json_is_object(s))
        return kv_fail(c->err, "json_schema: the schema at %s must be an object or true", path);
    if (check_keywords(c, s, path)) return -1;
    const json_t *v;
    if ((v = json_object_get(s, "$ref"))) return compile_ref(c, v, path, depth, b);
    if ((v = json_object_get(s, "const"))) return sb_json_literal(b, v) ? -1 : 0;
    if ((v = json_object_get(s, "enum"))) return compile_enum(c, v, path, b);
    if (json_object_get(s, "allOf")) {
        json_t *m = merge_all_of(c, s, path);
        if (!m) return -1;
        int rc = compile_object(c, m, path, depth, b);
        json_decref(m);
        return rc;
    }
    const char *alt_key = json_object_get(s, "anyOf") ? "anyOf" : "oneOf";
    if ((v = json_object_get(s, alt_key)))
        return compile_alternatives(c, v, alt_key, path, depth, b);
    return compile_type(c, s, json_object_get(s, "type"), path, depth, b);
}

/* Compiles s into a new rule, numbered into *rule. */
static int compile(jsc *c, const json_t *s, const char *path, int depth, int *rule) {
    if (depth > MAX_DEPTH)
        return kv_fail(c->err, "json_schema: nested more than %d levels at %s", MAX_DEPTH, path);
    int r = new_rule(c);
    sbuf body = {0};
    int rc = compile_body(c, s, path, depth, &body);
    if (!rc && body.oom) rc = kv_fail(c->err, "out of memory");
    if (!rc) kv_buf_printf(&c->out, "r%d ::= %s\n", r, body.p ? body.p : "\"\"");
    free(body.p);
    *rule = r;
    return rc;
}

/* "root ::= rN" and the schema's rules, without the primitives; NULL with err. */
static char *compile_rules(const char *schema, size_t len, kv_error *err) {
    json_error_t je;
    json_t *root = json_loadb(schema, len, JSON_DECODE_ANY | JSON_REJECT_DUPLICATES, &je);
    if (!root) {
        kv_fail(err, "json_schema: not valid JSON: %s (line %d)", je.text, je.line);
        return NULL;
    }
    jsc c = {.root = root, .err = err};
    int r;
    char *out = NULL;
    if (!compile(&c, root, "#", 0, &r)) {
        sbuf head = {0};
        kv_buf_printf(&head, "root ::= r%d\n", r);
        if (c.out.p) kv_buf_append(&head, c.out.p, c.out.len);
        if (head.oom || c.out.oom) {
            kv_fail(err, "out of memory");
            free(head.p);
        } else {
            out = head.p;
        }
    }
    free(c.out.p);
    free(c.ref_node);
    free(c.ref_rule);
    json_decref(root);
    return out;
}

const char *json_schema_primitives(void) { return PRIMITIVES; }

char *json_schema_to_gbnf(const char *schema, size_t len, kv_error *err) {
    char *rules = compile_rules(schema, len, err);
    if (!rules) return NULL;
    sbuf b = {0};
    kv_buf_printf(&b, "%s%s", rules, PRIMITIVES);
    free(rules);
    if (b.oom) {
        kv_fail(err, "out of memory");
        return NULL;
    }
    /* A schema can still describe a grammar that cannot be matched: one that refers to itself
     * before any value ({"$ref": "#"}) is left-recursive. */
    grammar *g = grammar_parse(b.p, b.len, err);
    if (!g) {
        kv_fail_wrap(err, "json_schema: the schema cannot be compiled");
        free(b.p);
        return NULL;
    }
    grammar_destroy(g);
    return b.p;
}

char *json_schema_to_gbnf_rules(const char *schema, size_t len, const char *prefix, kv_error *err) {
    char *rules = compile_rules(schema, len, err);
    if (!rules) return NULL;
    /* Renames root and rN outside literals and classes; the primitives keep their names. */
    sbuf b = {0};
    size_t n = strlen(rules);
    for (size_t i = 0; i < n;) {
        char ch = rules[i];
        if (ch == '"' || ch == '[') {
            char end = ch == '"' ? '"' : ']';
            size_t j = i + 1;
            while (j < n && rules[j] != end) j += rules[j] == '\\' ? 2 : 1;
            j = j < n ? j + 1 : n;
            kv_buf_append(&b, rules + i, j - i);
            i = j;
            continue;
        }
        size_t j = i;
        while (j < n &&
               ((rules[j] >= 'a' && rules[j] <= 'z') || (rules[j] >= '0' && rules[j] <= '9') ||
                (rules[j] >= 'A' && rules[j] <= 'Z') || rules[j] == '-' || rules[j] == '_'))
            j++;
        if (j == i) {
            kv_buf_append(&b, rules + i, 1);
            i++;
            continue;
        }
        bool num = j - i > 1 && rules[i] == 'r';
        for (size_t k = i + 1; num && k < j; k++) num = rules[k] >= '0' && rules[k] <= '9';
        if (j - i == 4 && !memcmp(rules + i, "root", 4))
            kv_buf_printf(&b, "%s", prefix);
        else if (num)
            kv_buf_printf(&b, "%s-%.*s", prefix, (int)(j - i), rules + i);
        else
            kv_buf_append(&b, rules + i, j - i);
        i = j;
    }
    free(rules);
    if (b.oom) {
        kv_fail(err, "out of memory");
        free(b.p);
        return NULL;
    }
    return b.p;
}
