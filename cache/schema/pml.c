/* The PML parser (cache/schema/pml.h): expat builds the tree, the handlers check PML's structure as
 * elements open, and the first problem stops the parse with its line and column. */
#include "cache/schema/pml.h"

#include <expat.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PML_MAX_NAME 64

void pml_limits_default(pml_limits *l) {
    *l = (pml_limits){
        .max_bytes = 4u << 20, .max_depth = 32, .max_nodes = 20000, .max_param_len = 4096};
}

bool pml_name_ok(const char *s) {
    size_t n = strlen(s);
    if (n == 0 || n > PML_MAX_NAME - 1) return false;
    char c = s[0];
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_')) return false;
    for (size_t i = 1; i < n; i++) {
        c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '_' || c == '-' || c == '.'))
            return false;
    }
    return true;
}

static const char *const RESERVED[] = {"schema",    "prompt", "module", "union",
                                       "parameter", "system", "user",   "assistant"};

bool pml_reserved(const char *s) {
    for (size_t i = 0; i < sizeof RESERVED / sizeof RESERVED[0]; i++)
        if (strcmp(s, RESERVED[i]) == 0) return true;
    return false;
}

static int role_of(const char *s) {
    if (strcmp(s, "system") == 0) return PML_ROLE_SYSTEM;
    if (strcmp(s, "user") == 0) return PML_ROLE_USER;
    if (strcmp(s, "assistant") == 0) return PML_ROLE_ASSISTANT;
    return -1;
}

/* ---------------------------------------------------------------- tree */

static void node_free(pml_node *n) {
    for (int i = 0; i < n->n_kids; i++) {
        node_free(n->kids[i]);
        free(n->kids[i]);
    }
    free(n->kids);
    for (int i = 0; i < 2 * n->n_args; i++) free(n->args[i]);
    free(n->args);
    free(n->name);
    free(n->text);
}

void pml_free(pml_doc *d) {
    if (!d) return;
    node_free(&d->root);
    free(d->name);
    free(d);
}

static pml_node *node_add(pml_node *parent, pml_kind kind, int line, int col) {
    if (parent->n_kids == parent->cap_kids) {
        int cap = parent->cap_kids ? 2 * parent->cap_kids : 4;
        pml_node **k = realloc(parent->kids, sizeof *k * (size_t)cap);
        if (!k) return NULL;
        parent->kids = k;
        parent->cap_kids = cap;
    }
    pml_node *n = calloc(1, sizeof *n);
    if (!n) return NULL;
    n->kind = kind;
    n->line = line;
    n->col = col;
    parent->kids[parent->n_kids++] = n;
    return n;
}

/* ---------------------------------------------------------------- the parse */

#define STACK_MAX 64

typedef struct parse {
    XML_Parser xp;
    const pml_limits *lim;
    pml_doc *doc;
    kv_error *err;
    bool failed;
    pml_node *stack[STACK_MAX]; /* open elements; [0] is the root element */
    int depth;
    int n_nodes;
    /* pending character data */
    char *text;
    size_t len, cap;
    int text_line, text_col;
} parse;

static int line_of(parse *p) { return (int)XML_GetCurrentLineNumber(p->xp); }
static int col_of(parse *p) { return (int)XML_GetCurrentColumnNumber(p->xp) + 1; }

static void failf(parse *p, int line, int col, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void failf(parse *p, int line, int col, const char *fmt, ...) {
    if (p->failed) return;
    p->failed = true;
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    kv_fail(p->err, "line %d, column %d: %s", line, col, msg);
    XML_StopParser(p->xp, XML_FALSE);
}

static bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

/* Drops whitespace holding a line break at either end of the pending text: indentation. */
static void trim_breaks(const char *s, size_t n, size_t *a, size_t *b) {
    size_t i = 0, j = n;
    bool brk = false;
    while (i < n && is_space(s[i])) brk |= s[i++] == '\n';
    if (!brk) i = 0;
    brk = false;
    size_t k = j;
    while (k > i && is_space(s[k - 1])) brk |= s[--k] == '\n';
    if (brk) j = k;
    *a = i;
    *b = j;
}

/* The pending text becomes a text node of the innermost open element (or an error where PML
 * has no place for text). */
static void flush_text(parse *p) {
    if (p->len == 0 || p->failed) {
        p->len = 0;
        return;
    }
    size_t a, b;
    trim_breaks(p->text, p->len, &a, &b);
    size_t n = b > a ? b - a : 0;
    p->len = 0;
    if (n == 0) return;
    pml_node *parent = p->stack[p->depth - 1];
    bool blank = true;
    for (size_t i = a; i < b && blank; i++) blank = is_space(p->text[i]);
    if (parent->kind == PML_UNION || parent->kind == PML_PARAM ||
        (p->doc->prompt && parent->kind == PML_MODULE)) {
        if (blank) return;
        failf(p, p->text_line, p->text_col, "text inside <%s>: %s",
              parent->kind == PML_UNION   ? "union"
              : parent->kind == PML_PARAM ? "parameter"
                                          : parent->name,
              parent->kind == PML_UNION ? "a union holds modules only"
              : parent->kind == PML_PARAM
                  ? "a parameter is a placeholder; its value comes from the prompt"
                  : "a module reference holds nested module references only (write text "
                    "outside it)");
        return;
    }
    if (++p->n_nodes > p->lim->max_nodes) {
        failf(p, p->text_line, p->text_col, "more than %d elements and text runs",
              p->lim->max_nodes);
        return;
    }
    pml_node *t = node_add(parent, PML_TEXT, p->text_line, p->text_col);
    if (!t || !(t->text = malloc(n + 1))) {
        failf(p, p->text_line, p->text_col, "out of memory");
        return;
    }
    memcpy(t->text, p->text + a, n);
    t->text[n] = '\0';
    t->len = n;
}

static void on_text(void *ud, const XML_Char *s, int n) {
    parse *p = ud;
    if (p->failed || n <= 0) return;
    if (p->depth == 0) return; /* outside the root element expat allows only whitespace */
    if (p->len == 0) {
        p->text_line = line_of(p);
        p->text_col = col_of(p);
    }
    if (p->len + (size_t)n + 1 > p->cap) {
        size_t cap = (p->len + (size_t)n + 1) * 2;
        char *t = realloc(p->text, cap);
        if (!t) {
            failf(p, line_of(p), col_of(p), "out of memory");
            return;
        }
        p->text = t;
        p->cap = cap;
    }
    memcpy(p->text + p->len, s, (size_t)n);
    p->len += (size_t)n;
}

/* The value of attribute `name` among attrs (NULL-terminated name/value pairs), or NULL. Every
 * attribute must be one of `allowed` (NULL-terminated). */
static const char *attr(parse *p, const XML_Char **attrs, const char *elem,
                        const char *const *allowed, const char *name, int line, int col) {
    const char *v = NULL;
    for (int i = 0; attrs[i]; i += 2) {
        bool ok = false;
        for (int k = 0; allowed[k] && !ok; k++) ok = strcmp(attrs[i], allowed[k]) == 0;
        if (!ok) {
            failf(p, line, col, "<%s> has no attribute '%s'", elem, attrs[i]);
            return NULL;
        }
        if (name && strcmp(attrs[i], name) == 0) v = attrs[i + 1];
    }
    return v;
}

static char *name_attr(parse *p, const XML_Char **attrs, const char *elem,
                       const char *const *allowed, const char *key, int line, int col) {
    const char *v = attr(p, attrs, elem, allowed, key, line, col);
    if (p->failed) return NULL;
    if (!v) {
        failf(p, line, col, "<%s> needs a '%s' attribute", elem, key);
        return NULL;
    }
    if (!pml_name_ok(v)) {
        failf(p, line, col,
              "%s '%s' of <%s> is not a name (a letter or '_', then letters, digits, '_', '-', "
              "'.'; at most %d characters)",
              key, v, elem, PML_MAX_NAME - 1);
        return NULL;
    }
    char *s = strdup(v);
    if (!s) failf(p, line, col, "out of memory");
    return s;
}

/* True when an element of the open stack (from the innermost) is a role tag. */
static bool inside_role(const parse *p) {
    for (int i = p->depth - 1; i > 0; i--)
        if (p->stack[i]->kind == PML_ROLE) return true;
    return false;
}

/* The innermost open element that is not a role tag. */
static pml_node *container(const parse *p) {
    for (int i = p->depth - 1; i > 0; i--)
        if (p->stack[i]->kind != PML_ROLE) return p->stack[i];
    return p->stack[0];
}

static void schema_element(parse *p, const char *el, const XML_Char **attrs, int line, int col) {
    static const char *const NO_ATTRS[] = {NULL};
    static const char *const MODULE_ATTRS[] = {"name", NULL};
    static const char *const PARAM_ATTRS[] = {"name", "length", NULL};
    pml_node *parent = p->stack[p->depth - 1];
    int role = role_of(el);
    pml_node *n = NULL;
    if (parent->kind == PML_PARAM) {
        failf(p, line, col, "<%s> inside <parameter>: a parameter is empty", el);
        return;
    }
    if (parent->kind == PML_UNION && strcmp(el, "module") != 0) {
        failf(p, line, col, "<%s> inside <union>: a union holds modules only", el);
        return;
    }
    if (strcmp(el, "module") == 0) {
        char *name = name_attr(p, attrs, el, MODULE_ATTRS, "name", line, col);
        if (!name) return;
        if (pml_reserved(name)) {
            failf(p, line, col, "'%s' is reserved in PML and cannot name a module", name);
            free(name);
            return;
        }
        if (!(n = node_add(parent, PML_MODULE, line, col))) {
            free(name);
            goto oom;
        }
        n->name = name;
    } else if (strcmp(el, "union") == 0) {
        attr(p, attrs, el, NO_ATTRS, NULL, line, col);
        if (p->failed) return;
        if (!(n = node_add(parent, PML_UNION, line, col))) goto oom;
    } else if (strcmp(el, "parameter") == 0) {
        if (container(p)->kind != PML_MODULE) {
            failf(p, line, col, "<parameter> outside a module: only a module's text can have one");
            return;
        }
        char *name = name_attr(p, attrs, el, PARAM_ATTRS, "name", line, col);
        if (!name) return;
        const char *ls = attr(p, attrs, el, PARAM_ATTRS, "length", line, col);
        char *end = NULL;
        long len = ls ? strtol(ls, &end, 10) : 0;
        if (!ls || !*ls || *end || ls[0] == '-' || ls[0] == '+' || len < 1 ||
            len > p->lim->max_param_len) {
            failf(p, line, col, "<parameter name=\"%s\"> needs a 'length' of 1 to %d tokens%s%s%s",
                  name, p->lim->max_param_len, ls ? ", not '" : "", ls ? ls : "", ls ? "'" : "");
            free(name);
            return;
        }
        if (!(n = node_add(parent, PML_PARAM, line, col))) {
            free(name);
            goto oom;
        }
        n->name = name;
        n->length = (int)len;
    } else if (role >= 0) {
        if (inside_role(p)) {
            failf(p, line, col, "<%s> inside another role tag", el);
            return;
        }
        attr(p, attrs, el, NO_ATTRS, NULL, line, col);
        if (p->failed) return;
        if (!(n = node_add(parent, PML_ROLE, line, col))) goto oom;
        n->role = (pml_role)role;
    } else if (strcmp(el, "schema") == 0 || strcmp(el, "prompt") == 0) {
        failf(p, line, col, "<%s> inside a schema", el);
        return;
    } else {
        failf(p, line, col,
              "unknown element <%s> in a schema (PML has <module>, <union>, <parameter>, "
              "<system>, <user>, <assistant>)",
              el);
        return;
    }
    p->stack[p->depth++] = n;
    return;
oom:
    failf(p, line, col, "out of memory");
}

static void prompt_element(parse *p, const char *el, const XML_Char **attrs, int line, int col) {
    static const char *const NO_ATTRS[] = {NULL};
    pml_node *parent = p->stack[p->depth - 1];
    int role = role_of(el);
    pml_node *n = NULL;
    if (parent->kind == PML_ROLE) {
        failf(p, line, col, "<%s> inside <%s>: a prompt's role tag holds text only", el,
              RESERVED[5 + parent->role]);
        return;
    }
    if (role >= 0) {
        if (parent->kind == PML_MODULE) {
            failf(p, line, col, "<%s> inside the module reference <%s>", el, parent->name);
            return;
        }
        attr(p, attrs, el, NO_ATTRS, NULL, line, col);
        if (p->failed) return;
        if (!(n = node_add(parent, PML_ROLE, line, col))) goto oom;
        n->role = (pml_role)role;
    } else if (pml_reserved(el)) {
        failf(p, line, col,
              "<%s> belongs in a schema; a prompt names a module by its tag (<name/>) and gives "
              "its parameters as attributes",
              el);
        return;
    } else if (!pml_name_ok(el)) {
        failf(p, line, col, "<%s> is not a module name", el);
        return;
    } else {
        int n_args = 0;
        for (int i = 0; attrs[i]; i += 2) n_args++;
        if (!(n = node_add(parent, PML_MODULE, line, col))) goto oom;
        if (!(n->name = strdup(el))) goto oom;
        if (n_args && !(n->args = calloc((size_t)(2 * n_args), sizeof *n->args))) goto oom;
        for (int i = 0; i < n_args; i++) {
            if (!pml_name_ok(attrs[2 * i])) {
                failf(p, line, col, "'%s' is not a parameter name", attrs[2 * i]);
                return;
            }
            if (!(n->args[2 * i] = strdup(attrs[2 * i])) ||
                !(n->args[2 * i + 1] = strdup(attrs[2 * i + 1])))
                goto oom;
            n->n_args++;
        }
    }
    p->stack[p->depth++] = n;
    return;
oom:
    failf(p, line, col, "out of memory");
}

static void on_start(void *ud, const XML_Char *el, const XML_Char **attrs) {
    parse *p = ud;
    if (p->failed) return;
    int line = line_of(p), col = col_of(p);
    if (p->depth > 0) flush_text(p);
    if (p->failed) return;
    if (p->depth >= p->lim->max_depth || p->depth >= STACK_MAX - 1) {
        failf(p, line, col, "elements nest deeper than %d",
              p->lim->max_depth < STACK_MAX - 1 ? p->lim->max_depth : STACK_MAX - 1);
        return;
    }
    if (++p->n_nodes > p->lim->max_nodes) {
        failf(p, line, col, "more than %d elements and text runs", p->lim->max_nodes);
        return;
    }
    if (p->depth == 0) {
        static const char *const SCHEMA_ATTRS[] = {"name", NULL};
        static const char *const PROMPT_ATTRS[] = {"schema", NULL};
        bool prompt = strcmp(el, "prompt") == 0;
        if (!prompt && strcmp(el, "schema") != 0) {
            failf(p, line, col, "the document must be a <schema> or a <prompt>, not <%s>", el);
            return;
        }
        p->doc->prompt = prompt;
        p->doc->name = name_attr(p, attrs, el, prompt ? PROMPT_ATTRS : SCHEMA_ATTRS,
                                 prompt ? "schema" : "name", line, col);
        if (!p->doc->name) return;
        p->doc->root.line = line;
        p->doc->root.col = col;
        p->stack[p->depth++] = &p->doc->root;
        return;
    }
    if (p->doc->prompt)
        prompt_element(p, el, attrs, line, col);
    else
        schema_element(p, el, attrs, line, col);
}

static void on_end(void *ud, const XML_Char *el) {
    (void)el;
    parse *p = ud;
    if (p->failed) return;
    flush_text(p);
    if (p->failed || p->depth == 0) return;
    pml_node *n = p->stack[--p->depth];
    if (n->kind == PML_UNION && n->n_kids == 0)
        failf(p, n->line, n->col, "an empty <union>: it needs at least one module");
}

static void on_doctype(void *ud, const XML_Char *name, const XML_Char *sysid, const XML_Char *pubid,
                       int internal) {
    (void)name, (void)sysid, (void)pubid, (void)internal;
    parse *p = ud;
    failf(p, line_of(p), col_of(p), "DOCTYPE declarations are not allowed in PML");
}

pml_doc *pml_parse(const char *src, size_t len, const pml_limits *lim, kv_error *err) {
    pml_limits dl;
    if (!lim) {
        pml_limits_default(&dl);
        lim = &dl;
    }
    if (len > lim->max_bytes || len > (size_t)INT32_MAX) {
        kv_fail(err, "the PML is %zu bytes; at most %zu are accepted", len, lim->max_bytes);
        return NULL;
    }
    parse p = {.lim = lim, .err = err};
    if (!(p.doc = calloc(1, sizeof *p.doc)) || !(p.xp = XML_ParserCreate("UTF-8"))) {
        free(p.doc);
        kv_fail(err, "out of memory");
        return NULL;
    }
    XML_SetUserData(p.xp, &p);
    XML_SetElementHandler(p.xp, on_start, on_end);
    XML_SetCharacterDataHandler(p.xp, on_text);
    XML_SetStartDoctypeDeclHandler(p.xp, on_doctype);
    if (XML_Parse(p.xp, src, (int)len, XML_TRUE) == XML_STATUS_ERROR && !p.failed) {
        p.failed = true;
        kv_fail(err, "line %d, column %d: %s", line_of(&p), col_of(&p),
                XML_ErrorString(XML_GetErrorCode(p.xp)));
    }
    if (!p.failed && !p.doc->name) {
        p.failed = true;
        kv_fail(err, "line 1, column 1: the document is empty");
    }
    XML_ParserFree(p.xp);
    free(p.text);
    if (p.failed) {
        pml_free(p.doc);
        return NULL;
    }
    return p.doc;
}
