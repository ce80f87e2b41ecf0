/* GBNF parsing and compilation to a byte-level pushdown automaton.
 *
 * The grammar format is llama.cpp's GBNF (grammars/README.md in llama.cpp): rules
 * `name ::= alternatives`, string literals, character classes (negated with ^), `.` for any
 * character, groups, the repetitions * + ? {m} {m,} {m,n}, and # comments. A rule ends where the
 * next `name ::=` begins, so rules may span lines.
 *
 * Compilation works on bytes, not code points: a character class becomes the alternation of its
 * UTF-8 byte sequences (the range splitting of Russ Cox's utf8-ranges, as RE2 and Rust's regex
 * do), so a token ending inside a multi-byte character is matched like any other, and the
 * automaton needs no UTF-8 decoding state. Repetitions become generated rules (x* is R ::= x R |
 * empty) and groups become rules, so the compiled form has three element kinds only: a byte (or
 * byte set), a rule reference, and the end of an alternative. */
#include "model/grammar/grammar.h"
#include "model/grammar/grammar_impl.h"
#include "util/utf8.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_RULES 100000
#define MAX_ELEMS 4000000
#define MAX_NESTING 64
#define MAX_REPEAT 10000

/* ---------------------------------------------------------------- rules under construction */

typedef struct elist {
    gelem *el;
    int n, cap;
} elist;

typedef struct prule {
    char *name; /* NULL for generated rules */
    elist body; /* alternatives, each ended by G_END */
    bool defined;
    int first_line; /* where it was first referenced (for "undefined rule" errors) */
} prule;

typedef struct gparser {
    const char *s;
    size_t len, pos;
    int line;
    prule *rules;
    int n_rules, cap_rules;
    uint64_t (*sets)[4];
    int n_sets, cap_sets;
    int64_t n_elems; /* across rules, against MAX_ELEMS */
    int depth;
    kv_error *err;
} gparser;

static int elist_push(gparser *p, elist *l, gelem e) {
    if (++p->n_elems > MAX_ELEMS)
        return kv_fail(p->err, "grammar: more than %d elements after expansion", MAX_ELEMS);
    if (l->n == l->cap) {
        int cap = l->cap ? l->cap * 2 : 8;
        gelem *t = realloc(l->el, sizeof *t * (size_t)cap);
        if (!t) return kv_fail(p->err, "out of memory");
        l->el = t;
        l->cap = cap;
    }
    l->el[l->n++] = e;
    return 0;
}

static int elist_append(gparser *p, elist *dst, const elist *src) {
    for (int i = 0; i < src->n; i++)
        if (elist_push(p, dst, src->el[i])) return -1;
    return 0;
}

/* A new rule (name copied, or NULL for a generated one); its id or -1. */
static int rule_new(gparser *p, const char *name, size_t name_len) {
    if (p->n_rules >= MAX_RULES)
        return kv_fail(p->err, "grammar: more than %d rules after expansion", MAX_RULES);
    if (p->n_rules == p->cap_rules) {
        int cap = p->cap_rules ? p->cap_rules * 2 : 16;
        prule *t = realloc(p->rules, sizeof *t * (size_t)cap);
        if (!t) return kv_fail(p->err, "out of memory");
        p->rules = t;
        p->cap_rules = cap;
    }
    prule *r = &p->rules[p->n_rules];
    memset(r, 0, sizeof *r);
    r->first_line = p->line;
    if (name) {
        if (!(r->name = malloc(name_len + 1))) return kv_fail(p->err, "out of memory");
        memcpy(r->name, name, name_len);
        r->name[name_len] = '\0';
    }
    return p->n_rules++;
}

static int rule_find(gparser *p, const char *name, size_t len) {
    for (int i = 0; i < p->n_rules; i++)
        if (p->rules[i].name && strlen(p->rules[i].name) == len &&
            memcmp(p->rules[i].name, name, len) == 0)
            return i;
    return rule_new(p, name, len);
}

/* A generated rule whose alternatives are body (each already ended by G_END). */
static int rule_generated(gparser *p, const elist *body) {
    int id = rule_new(p, NULL, 0);
    if (id < 0) return -1;
    p->rules[id].defined = true;
    return elist_append(p, &p->rules[id].body, body) ? -1 : id;
}

static int set_intern(gparser *p, const uint64_t bits[4]) {
    for (int i = 0; i < p->n_sets; i++)
        if (!memcmp(p->sets[i], bits, sizeof p->sets[i])) return i;
    if (p->n_sets == p->cap_sets) {
        int cap = p->cap_sets ? p->cap_sets * 2 : 16;
        uint64_t(*t)[4] = realloc(p->sets, sizeof *t * (size_t)cap);
        if (!t) return kv_fail(p->err, "out of memory");
        p->sets = t;
        p->cap_sets = cap;
    }
    memcpy(p->sets[p->n_sets], bits, sizeof p->sets[0]);
    return p->n_sets++;
}

/* One byte range [lo, hi] as an element (a single byte when lo == hi). */
static int byte_range_elem(gparser *p, int lo, int hi, gelem *out) {
    if (lo == hi) {
        *out = (gelem){G_BYTE, lo};
        return 0;
    }
    uint64_t bits[4] = {0};
    for (int b = lo; b <= hi; b++) bits[b >> 6] |= 1ull << (b & 63);
    int id = set_intern(p, bits);
    if (id < 0) return -1;
    *out = (gelem){G_SET, id};
    return 0;
}

/* ---------------------------------------------------------------- lexing */

static int fail_at(gparser *p, const char *what) {
    return kv_fail(p->err, "grammar: %s at line %d", what, p->line);
}

static bool at_end(const gparser *p) { return p->pos >= p->len; }
static int peek(const gparser *p) { return at_end(p) ? -1 : (uint8_t)p->s[p->pos]; }

/* Skips blanks, newlines and comments. */
static void skip_space(gparser *p) {
    while (!at_end(p)) {
        char c = p->s[p->pos];
        if (c == '#') {
            while (!at_end(p) && p->s[p->pos] != '\n') p->pos++;
        } else if (c == '\n') {
            p->line++;
            p->pos++;
        } else if (c == ' ' || c == '\t' || c == '\r') {
            p->pos++;
        } else {
            break;
        }
    }
}

static bool is_name_char(int c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
           c == '_';
}

static size_t name_len_at(const gparser *p, size_t pos) {
    size_t n = 0;
    while (pos + n < p->len && is_name_char((uint8_t)p->s[pos + n])) n++;
    return n;
}

/* True when a `name ::=` starts at the current position (the end of the previous rule). */
static bool at_rule_start(const gparser *p) {
    size_t n = name_len_at(p, p->pos);
    if (n == 0) return false;
    size_t q = p->pos + n;
    while (q < p->len && (p->s[q] == ' ' || p->s[q] == '\t')) q++;
    return q + 3 <= p->len && memcmp(p->s + q, "::=", 3) == 0;
}

static int hex_digits(gparser *p, int n, uint32_t *out) {
    uint32_t v = 0;
    for (int i = 0; i < n; i++) {
        int c = peek(p);
        int d = c >= '0' && c <= '9'   ? c - '0'
                : c >= 'a' && c <= 'f' ? c - 'a' + 10
                : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                       : -1;
        if (d < 0) return fail_at(p, "bad hexadecimal escape");
        v = v * 16 + (uint32_t)d;
        p->pos++;
    }
    *out = v;
    return 0;
}

/* One character of a literal or class (an escape or a UTF-8 character) as a code point. */
static int read_char(gparser *p, uint32_t *cp) {
    if (at_end(p)) return fail_at(p, "unexpected end of grammar");
    if (p->s[p->pos] == '\\') {
        p->pos++;
        int c = peek(p);
        if (c < 0) return fail_at(p, "unexpected end of grammar after '\\'");
        p->pos++;
        switch (c) {
        case 'n':
            *cp = '\n';
            break;
        case 'r':
            *cp = '\r';
            break;
        case 't':
            *cp = '\t';
            break;
        case '0':
            *cp = 0;
            break;
        case 'x':
            return hex_digits(p, 2, cp);
        case 'u':
            return hex_digits(p, 4, cp);
        case 'U':
            return hex_digits(p, 8, cp);
        case '\\':
        case '"':
        case '[':
        case ']':
        case '-':
        case '^':
        case '/':
        case '.':
        case '\'':
        case '{':
        case '}':
        case '(':
        case ')':
        case '|':
        case '*':
        case '+':
        case '?':
        case ' ':
            *cp = (uint32_t)c;
            break;
        default:
            return fail_at(p, "unknown escape");
        }
        return 0;
    }
    size_t n;
    if (utf8_decode((const uint8_t *)p->s + p->pos, p->len - p->pos, cp, &n) != UTF8_OK)
        return fail_at(p, "invalid UTF-8");
    if (*cp == '\n') p->line++;
    p->pos += n;
    return 0;
}

/* ---------------------------------------------------------------- character classes */

typedef struct cprange {
    uint32_t lo, hi;
} cprange;

typedef struct crset {
    cprange *r;
    int n, cap;
} crset;

static int crset_add(gparser *p, crset *s, uint32_t lo, uint32_t hi) {
    if (s->n == s->cap) {
        int cap = s->cap ? s->cap * 2 : 8;
        cprange *t = realloc(s->r, sizeof *t * (size_t)cap);
        if (!t) return kv_fail(p->err, "out of memory");
        s->r = t;
        s->cap = cap;
    }
    s->r[s->n++] = (cprange){lo, hi};
    return 0;
}

static int cprange_cmp(const void *a, const void *b) {
    const cprange *x = a, *y = b;
    return x->lo < y->lo ? -1 : x->lo > y->lo;
}

/* Sorts and merges; with negate, the complement in [0, 0x10FFFF]. Surrogates, which UTF-8
 * cannot encode, are removed either way. */
static int crset_normalize(gparser *p, crset *s, bool negate) {
    if (s->n > 1) qsort(s->r, (size_t)s->n, sizeof *s->r, cprange_cmp);
    int k = 0;
    for (int i = 0; i < s->n; i++) {
        if (k > 0 && s->r[i].lo <= s->r[k - 1].hi + 1) {
            if (s->r[i].hi > s->r[k - 1].hi) s->r[k - 1].hi = s->r[i].hi;
        } else {
            s->r[k++] = s->r[i];
        }
    }
    s->n = k;
    crset out = {0};
    if (negate) {
        uint32_t next = 0;
        for (int i = 0; i < s->n; i++) {
            if (s->r[i].lo > next && crset_add(p, &out, next, s->r[i].lo - 1)) goto fail;
            next = s->r[i].hi + 1;
        }
        if (next <= 0x10FFFF && crset_add(p, &out, next, 0x10FFFF)) goto fail;
    } else {
        for (int i = 0; i < s->n; i++)
            if (crset_add(p, &out, s->r[i].lo, s->r[i].hi)) goto fail;
    }
    free(s->r);
    *s = (crset){0};
    for (int i = 0; i < out.n; i++) {
        uint32_t lo = out.r[i].lo, hi = out.r[i].hi;
        if (lo <= 0xDFFF && hi >= 0xD800) {
            if (lo < 0xD800 && crset_add(p, s, lo, 0xD7FF)) goto fail;
            if (hi > 0xDFFF && crset_add(p, s, 0xE000, hi)) goto fail;
        } else if (crset_add(p, s, lo, hi)) {
            goto fail;
        }
    }
    free(out.r);
    return 0;
fail:
    free(out.r);
    return -1;
}

typedef struct utf8_seq {
    uint8_t lo[4], hi[4];
    int n;
} utf8_seq;

/* Splits [lo, hi] (no surrogates, at most 0x10FFFF) into byte-range sequences: each sequence
 * matches exactly the UTF-8 encodings of a sub-range, byte position by byte position. */
static int utf8_split(gparser *p, uint32_t lo, uint32_t hi, elist *alts, uint64_t single[4],
                      int depth) {
    if (lo > hi) return 0;
    if (depth > 32) return fail_at(p, "character class too complex");
    static const uint32_t len_max[3] = {0x7F, 0x7FF, 0xFFFF};
    for (int i = 0; i < 3; i++)
        if (lo <= len_max[i] && hi > len_max[i])
            return utf8_split(p, lo, len_max[i], alts, single, depth + 1) ||
                           utf8_split(p, len_max[i] + 1, hi, alts, single, depth + 1)
                       ? -1
                       : 0;
    if (hi <= 0x7F) {
        for (uint32_t b = lo; b <= hi; b++) single[b >> 6] |= 1ull << (b & 63);
        return 0;
    }
    uint8_t a[4], b[4];
    int n = utf8_encode(lo, a);
    for (int i = 1; i < n; i++) {
        uint32_t m = (1u << (6 * i)) - 1;
        if ((lo & ~m) != (hi & ~m)) {
            if ((lo & m) != 0)
                return utf8_split(p, lo, lo | m, alts, single, depth + 1) ||
                               utf8_split(p, (lo | m) + 1, hi, alts, single, depth + 1)
                           ? -1
                           : 0;
            if ((hi & m) != m)
                return utf8_split(p, lo, (hi & ~m) - 1, alts, single, depth + 1) ||
                               utf8_split(p, hi & ~m, hi, alts, single, depth + 1)
                           ? -1
                           : 0;
        }
    }
    utf8_encode(hi, b);
    for (int k = 0; k < n; k++) {
        gelem e;
        if (byte_range_elem(p, a[k], b[k], &e) || elist_push(p, alts, e)) return -1;
    }
    return elist_push(p, alts, (gelem){G_END, 0});
}

/* A class of code points as elements matching one character: a byte or byte set when every
 * member is ASCII, else a reference to a generated rule of UTF-8 alternatives. */
static int class_elems(gparser *p, const crset *cs, elist *out) {
    elist alts = {0};
    uint64_t single[4] = {0};
    int rc = -1;
    for (int i = 0; i < cs->n; i++)
        if (utf8_split(p, cs->r[i].lo, cs->r[i].hi, &alts, single, 0)) goto done;
    bool any_single = single[0] | single[1];
    if (alts.n == 0 && !any_single) {
        rc = fail_at(p, "empty character class");
        goto done;
    }
    gelem e = {G_SET, 0};
    if (any_single) {
        int lo = -1, cnt = 0;
        for (int b = 0; b < 128; b++)
            if (single[b >> 6] >> (b & 63) & 1) {
                if (lo < 0) lo = b;
                cnt++;
            }
        if (cnt == 1) {
            e = (gelem){G_BYTE, lo};
        } else {
            int id = set_intern(p, single);
            if (id < 0) goto done;
            e = (gelem){G_SET, id};
        }
    }
    if (alts.n == 0) {
        rc = elist_push(p, out, e);
        goto done;
    }
    elist body = {0};
    if (any_single && (elist_push(p, &body, e) || elist_push(p, &body, (gelem){G_END, 0}))) {
        free(body.el);
        goto done;
    }
    if (elist_append(p, &body, &alts)) {
        free(body.el);
        goto done;
    }
    int id = rule_generated(p, &body);
    free(body.el);
    if (id >= 0) rc = elist_push(p, out, (gelem){G_REF, id});
done:
    free(alts.el);
    return rc;
}

static int parse_class(gparser *p, elist *out) {
    p->pos++; /* [ */
    bool negate = peek(p) == '^';
    if (negate) p->pos++;
    crset cs = {0};
    int rc = -1;
    while (peek(p) != ']') {
        if (at_end(p)) {
            fail_at(p, "unterminated character class");
            goto done;
        }
        uint32_t lo, hi;
        if (read_char(p, &lo)) goto done;
        hi = lo;
        if (peek(p) == '-' && p->pos + 1 < p->len && p->s[p->pos + 1] != ']') {
            p->pos++;
            if (read_char(p, &hi)) goto done;
            if (hi < lo) {
                fail_at(p, "character range out of order");
                goto done;
            }
        }
        if (hi > 0x10FFFF) {
            fail_at(p, "code point above U+10FFFF");
            goto done;
        }
        if (crset_add(p, &cs, lo, hi)) goto done;
    }
    p->pos++; /* ] */
    if (crset_normalize(p, &cs, negate)) goto done;
    rc = class_elems(p, &cs, out);
done:
    free(cs.r);
    return rc;
}

static int parse_literal(gparser *p, elist *out) {
    p->pos++; /* " */
    while (peek(p) != '"') {
        if (at_end(p) || peek(p) == '\n') return fail_at(p, "unterminated string literal");
        uint32_t cp;
        if (read_char(p, &cp)) return -1;
        if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
            return fail_at(p, "escape is not a Unicode scalar value");
        uint8_t b[4];
        int n = utf8_encode(cp, b);
        for (int i = 0; i < n; i++)
            if (elist_push(p, out, (gelem){G_BYTE, b[i]})) return -1;
    }
    p->pos++;
    return 0;
}

/* ---------------------------------------------------------------- rules */

static int parse_alternatives(gparser *p, elist *out, bool nested);

/* Wraps a sequence as one element (a reference to a rule with that single alternative). */
static int as_single(gparser *p, elist *item, gelem *out) {
    if (item->n == 1) {
        *out = item->el[0];
        return 0;
    }
    if (elist_push(p, item, (gelem){G_END, 0})) return -1;
    int id = rule_generated(p, item);
    if (id < 0) return -1;
    *out = (gelem){G_REF, id};
    return 0;
}

/* x* as R ::= x R | (empty); returns R. */
static int rule_star(gparser *p, gelem x) {
    int id = rule_new(p, NULL, 0);
    if (id < 0) return -1;
    prule *r = &p->rules[id];
    r->defined = true;
    gelem seq[] = {x, {G_REF, id}, {G_END, 0}, {G_END, 0}};
    for (int i = 0; i < 4; i++)
        if (elist_push(p, &p->rules[id].body, seq[i])) return -1;
    return id;
}

/* x{0,k} as O_k ::= x O_{k-1} | (empty), O_1 ::= x | (empty); returns O_k. */
static int rule_upto(gparser *p, gelem x, int k) {
    int prev = -1;
    for (int i = 1; i <= k; i++) {
        int id = rule_new(p, NULL, 0);
        if (id < 0) return -1;
        p->rules[id].defined = true;
        elist *b = &p->rules[id].body;
        if (elist_push(p, b, x)) return -1;
        if (prev >= 0 && elist_push(p, b, (gelem){G_REF, prev})) return -1;
        if (elist_push(p, b, (gelem){G_END, 0}) || elist_push(p, b, (gelem){G_END, 0})) return -1;
        prev = id;
    }
    return prev;
}

static int parse_count(gparser *p, int *out) {
    int v = 0, digits = 0;
    while (peek(p) >= '0' && peek(p) <= '9') {
        v = v * 10 + (peek(p) - '0');
        if (v > MAX_REPEAT) return fail_at(p, "repetition count too large");
        p->pos++;
        digits++;
    }
    if (!digits) return fail_at(p, "expected a number in {m,n}");
    *out = v;
    return 0;
}

/* Applies a repetition operator (if one follows) to item, appending the result to out. */
static int parse_repetition(gparser *p, elist *item, elist *out) {
    int c = peek(p);
    if (c != '*' && c != '+' && c != '?' && c != '{') return elist_append(p, out, item);
    int lo = 0, hi = -1; /* hi -1: unbounded */
    p->pos++;
    if (c == '+') lo = 1;
    if (c == '?') hi = 1;
    if (c == '{') {
        skip_space(p);
        if (parse_count(p, &lo)) return -1;
        skip_space(p);
        hi = lo;
        if (peek(p) == ',') {
            p->pos++;
            skip_space(p);
            hi = -1;
            if (peek(p) != '}' && parse_count(p, &hi)) return -1;
            skip_space(p);
        }
        if (peek(p) != '}') return fail_at(p, "expected '}'");
        p->pos++;
        if (hi >= 0 && hi < lo) return fail_at(p, "repetition {m,n} with n < m");
    }
    if (item->n == 0) return 0; /* repeating nothing is nothing */
    gelem x;
    if (as_single(p, item, &x)) return -1;
    for (int i = 0; i < lo; i++)
        if (elist_push(p, out, x)) return -1;
    int tail = hi < 0 ? rule_star(p, x) : hi > lo ? rule_upto(p, x, hi - lo) : -2;
    if (tail == -1) return -1;
    return tail >= 0 ? elist_push(p, out, (gelem){G_REF, tail}) : 0;
}

/* A sequence of items up to '|', ')', the next rule or the end. */
static int parse_sequence(gparser *p, elist *out, bool nested) {
    for (;;) {
        skip_space(p);
        int c = peek(p);
        if (c < 0 || c == '|' || c == ')') return 0;
        if (!nested && at_rule_start(p)) return 0;
        elist item = {0};
        int rc;
        if (c == '"') {
            rc = parse_literal(p, &item);
        } else if (c == '[') {
            rc = parse_class(p, &item);
        } else if (c == '.') {
            p->pos++;
            crset cs = {0};
            rc = crset_add(p, &cs, 0, 0x10FFFF) || crset_normalize(p, &cs, false) ||
                         class_elems(p, &cs, &item)
                     ? -1
                     : 0;
            free(cs.r);
        } else if (c == '(') {
            if (++p->depth > MAX_NESTING) return fail_at(p, "groups nested too deeply");
            p->pos++;
            elist body = {0};
            rc = parse_alternatives(p, &body, true);
            if (!rc) {
                skip_space(p);
                if (peek(p) != ')') rc = fail_at(p, "expected ')'");
                p->pos++;
            }
            p->depth--;
            if (!rc) {
                int id = rule_generated(p, &body);
                rc = id < 0 ? -1 : elist_push(p, &item, (gelem){G_REF, id});
            }
            free(body.el);
        } else if (is_name_char(c)) {
            size_t n = name_len_at(p, p->pos);
            int id = rule_find(p, p->s + p->pos, n);
            p->pos += n;
            rc = id < 0 ? -1 : elist_push(p, &item, (gelem){G_REF, id});
        } else {
            free(item.el);
            return fail_at(p, "unexpected character");
        }
        if (!rc) rc = parse_repetition(p, &item, out);
        free(item.el);
        if (rc) return -1;
    }
}

/* Alternatives, each appended to out followed by G_END. */
static int parse_alternatives(gparser *p, elist *out, bool nested) {
    for (;;) {
        if (parse_sequence(p, out, nested) || elist_push(p, out, (gelem){G_END, 0})) return -1;
        skip_space(p);
        if (peek(p) != '|') return 0;
        p->pos++;
    }
}

static int parse_rule(gparser *p) {
    size_t n = name_len_at(p, p->pos);
    if (n == 0) return fail_at(p, "expected a rule name");
    int id = rule_find(p, p->s + p->pos, n);
    if (id < 0) return -1;
    if (p->rules[id].defined) {
        kv_fail(p->err, "grammar: rule '%.*s' defined twice (line %d)", (int)(n < 64 ? n : 64),
                p->s + p->pos, p->line);
        return -1;
    }
    p->pos += n;
    skip_space(p);
    if (p->pos + 3 > p->len || memcmp(p->s + p->pos, "::=", 3) != 0)
        return fail_at(p, "expected '::='");
    p->pos += 3;
    p->rules[id].defined = true;
    elist body = {0};
    int rc = parse_alternatives(p, &body, false);
    if (!rc) {
        skip_space(p);
        if (!at_end(p) && !at_rule_start(p)) rc = fail_at(p, "unexpected ')'");
    }
    if (!rc) rc = elist_append(p, &p->rules[id].body, &body);
    free(body.el);
    return rc;
}

/* ---------------------------------------------------------------- checks and flattening */

/* Left recursion (a rule reaching itself before any byte) would make matching loop: refused,
 * as llama.cpp refuses it. Rules that can match nothing are found first, since a reference
 * after them is still in leading position. */
static int check_left_recursion(grammar *g, kv_error *err) {
    int n = g->n_rules, rc = 0;
    bool *nullable = calloc((size_t)n, 1);
    int *state = calloc((size_t)n, sizeof *state); /* 0 new, 1 on the path, 2 done */
    int *stack = malloc(sizeof *stack * (size_t)n * 2 + 2);
    if (!nullable || !state || !stack) {
        rc = kv_fail(err, "out of memory");
        goto done;
    }
    for (bool changed = true; changed;) {
        changed = false;
        for (int r = 0; r < n; r++) {
            if (nullable[r]) continue;
            for (int a = 0; a < g->rules[r].n_alts && !nullable[r]; a++) {
                const gelem *e = g->elems + g->alts[g->rules[r].first_alt + a];
                while (e->type == G_REF && nullable[e->val]) e++;
                if (e->type == G_END) nullable[r] = changed = true;
            }
        }
    }
    /* Depth-first over "r may begin with s" edges, iteratively (grammars can be deep). stack
     * holds (rule, next alternative-element cursor) pairs. */
    for (int root = 0; root < n && !rc; root++) {
        if (state[root]) continue;
        int sp = 0;
        stack[sp++] = root;
        stack[sp++] = 0;
        state[root] = 1;
        while (sp > 0 && !rc) {
            int r = stack[sp - 2], cur = stack[sp - 1];
            /* cur enumerates (alternative, position) as a flat index over the rule's leading
             * references: alternative cur >> 16, element cur & 0xffff. */
            int a = cur >> 16, k = cur & 0xffff;
            int next = -1;
            while (a < g->rules[r].n_alts) {
                const gelem *e = g->elems + g->alts[g->rules[r].first_alt + a] + k;
                if (e->type == G_REF && k < 0xffff) {
                    next = e->val;
                    stack[sp - 1] = nullable[e->val] ? (a << 16) | (k + 1) : (a + 1) << 16;
                    break;
                }
                a++;
                k = 0;
            }
            if (next < 0) {
                state[r] = 2;
                sp -= 2;
                continue;
            }
            if (state[next] == 1) {
                const char *name = g->rules[next].name;
                rc = kv_fail(err, "grammar: left recursion in rule '%s'",
                             name ? name : "(a group or repetition)");
            } else if (state[next] == 0) {
                state[next] = 1;
                stack[sp++] = next;
                stack[sp++] = 0;
            }
        }
    }
done:
    free(nullable);
    free(state);
    free(stack);
    return rc;
}

static void parser_free(gparser *p) {
    for (int i = 0; i < p->n_rules; i++) {
        free(p->rules[i].name);
        free(p->rules[i].body.el);
    }
    free(p->rules);
    free(p->sets);
}

/* Moves the parsed rules into g: one element array, alternatives' starts per rule. */
static int flatten(gparser *p, grammar *g) {
    size_t n_el = 0, n_alts = 0;
    for (int i = 0; i < p->n_rules; i++) {
        n_el += (size_t)p->rules[i].body.n + 1;
        for (int k = 0; k < p->rules[i].body.n; k++) n_alts += p->rules[i].body.el[k].type == G_END;
    }
    g->elems = malloc(sizeof *g->elems * (n_el + 1));
    g->alts = malloc(sizeof *g->alts * (n_alts + 1));
    g->rules = calloc((size_t)p->n_rules, sizeof *g->rules);
    if (!g->elems || !g->alts || !g->rules) return kv_fail(p->err, "out of memory");
    int32_t e = 0, a = 0;
    for (int i = 0; i < p->n_rules; i++) {
        const elist *b = &p->rules[i].body;
        g->rules[i].first_alt = a;
        bool start = true;
        for (int k = 0; k < b->n; k++) {
            if (start) g->alts[a++] = e;
            g->elems[e++] = b->el[k];
            start = b->el[k].type == G_END;
        }
        g->rules[i].n_alts = a - g->rules[i].first_alt;
        g->elems[e++] = (gelem){G_END, 0}; /* padding: REF + 1 is always readable */
        g->rules[i].name = p->rules[i].name;
        p->rules[i].name = NULL;
    }
    g->n_rules = p->n_rules;
    g->n_elems = e;
    g->sets = p->sets;
    g->n_sets = p->n_sets;
    p->sets = NULL;
    return 0;
}

grammar *grammar_parse(const char *src, size_t len, kv_error *err) {
    if (len > GRAMMAR_MAX_TEXT) {
        kv_fail(err, "grammar: %zu bytes, more than the limit of %d", len, GRAMMAR_MAX_TEXT);
        return NULL;
    }
    gparser p = {.s = src, .len = len, .line = 1, .err = err};
    grammar *g = calloc(1, sizeof *g);
    if (!g) {
        kv_fail(err, "out of memory");
        return NULL;
    }
    skip_space(&p);
    if (at_end(&p)) {
        kv_fail(err, "grammar: empty (no rules)");
        goto fail;
    }
    while (!at_end(&p)) {
        if (parse_rule(&p)) goto fail;
        skip_space(&p);
    }
    g->root = -1;
    for (int i = 0; i < p.n_rules; i++) {
        if (!p.rules[i].defined) {
            kv_fail(err, "grammar: rule '%s' is used (line %d) but not defined", p.rules[i].name,
                    p.rules[i].first_line);
            goto fail;
        }
        if (p.rules[i].name && !strcmp(p.rules[i].name, "root")) g->root = i;
    }
    if (g->root < 0) {
        kv_fail(err, "grammar: no 'root' rule");
        goto fail;
    }
    if (flatten(&p, g) || check_left_recursion(g, err)) goto fail;
    parser_free(&p);
    return g;
fail:
    parser_free(&p);
    grammar_destroy(g);
    return NULL;
}

void grammar_destroy(grammar *g) {
    if (!g) return;
    if (g->rules)
        for (int i = 0; i < g->n_rules; i++) free(g->rules[i].name);
    free(g->rules);
    free(g->elems);
    free(g->alts);
    free(g->sets);
    free(g);
}

int grammar_n_rules(const grammar *g) { return g->n_rules; }
