/* Prompt Cache schemas (cache/schema/schema.h): role tags through the chat template, the layout of
 * a schema's positions and keys, precompute jobs, and the assembly of prompts. */
#include "cache/schema/schema.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- role tags */

static const char *const ROLE_NAMES[3] = {"system", "user", "assistant"};
/* Marker texts: plain letters, which no template trims or escapes. */
static const char *const MARK[4] = {"KVSMARKAAA", "KVSMARKBBB", "KVSMARKCCC", "KVSMARKDDD"};

static char *render(const model *m, const char *const *roles, int n, bool gen, kv_error *err) {
    chat_message msgs[4];
    for (int i = 0; i < n; i++) msgs[i] = (chat_message){.role = roles[i], .content = MARK[i]};
    int32_t bos = tokenizer_bos(m->tok);
    const char *bos_text = bos >= 0 ? tokenizer_token_text(m->tok, bos) : NULL;
    return chat_render(&m->chat, msgs, n, NULL, 0, gen, bos_text, err);
}

static char *dupn(const char *s, size_t n) {
    char *d = malloc(n + 1);
    if (d) {
        memcpy(d, s, n);
        d[n] = '\0';
    }
    return d;
}

/* Splits the part of whole after prefix (which whole must start with) at marker: *pre before,
 * *suf after. False when the shape is not that. */
static bool split_turn(const char *whole, const char *prefix, const char *marker, char **pre,
                       char **suf) {
    size_t np = strlen(prefix);
    if (strncmp(whole, prefix, np) != 0) return false;
    const char *rest = whole + np, *at = strstr(rest, marker);
    if (!at || strstr(at + 1, marker)) return false;
    *pre = dupn(rest, (size_t)(at - rest));
    *suf = strdup(at + strlen(marker));
    return *pre && *suf;
}

static void chat_why(schema_chat *c, const char *fmt, const char *what) {
    c->ok = false;
    snprintf(c->why, sizeof c->why, fmt, what);
}

void schema_chat_init(schema_chat *c, const model *m) {
    memset(c, 0, sizeof *c);
    c->bos = tokenizer_bos(m->tok);
    c->add_bos = tokenizer_add_bos(m->tok) && c->bos >= 0;
    const char *tname = chat_template_name(m->chat.kind);
    kv_error err = {{0}};
    const char *S = "system", *U = "user", *A = "assistant";
    const char *r_s[] = {S}, *r_su[] = {S, U}, *r_sua[] = {S, U, A}, *r_u[] = {U},
               *r_suau[] = {S, U, A, U};
    char *w1 = render(m, r_s, 1, false, &err), *w2 = render(m, r_su, 2, false, &err),
         *w3 = render(m, r_sua, 3, false, &err), *w4 = render(m, r_su, 2, true, &err),
         *w5 = render(m, r_u, 1, false, &err), *w6 = render(m, r_suau, 4, true, &err);
    char *full = NULL;
    if (!w1 || !w2 || !w3 || !w4 || !w5 || !w6) {
        chat_why(c, "the chat template (%s) cannot render a conversation", tname);
        goto done;
    }
    /* the BOS a template spells (Llama 3) is not part of the system turn */
    int32_t bos = c->bos;
    const char *bos_text = bos >= 0 ? tokenizer_token_text(m->tok, bos) : NULL;
    /* spelled once before the first turn (Llama 3), not a marker every turn opens with (ChatML,
     * whose BOS is <|im_start|>) */
    size_t nb = bos_text && strncmp(w1, bos_text, strlen(bos_text)) == 0 &&
                        strncmp(w2 + strlen(w1), bos_text, strlen(bos_text)) != 0
                    ? strlen(bos_text)
                    : 0;
    if (!(c->start = dupn(w1, nb))) goto oom;
    char *sys_pre = NULL, *sys_suf = NULL;
    if (!split_turn(w1, c->start, MARK[0], &sys_pre, &sys_suf)) {
        free(sys_pre);
        free(sys_suf);
        chat_why(c, "the chat template (%s) does not write a system turn on its own", tname);
        goto done;
    }
    c->pre[PML_ROLE_SYSTEM] = sys_pre;
    c->suf[PML_ROLE_SYSTEM] = sys_suf;
    if (!split_turn(w2, w1, MARK[1], &c->pre[PML_ROLE_USER], &c->suf[PML_ROLE_USER]) ||
        !split_turn(w3, w2, MARK[2], &c->pre[PML_ROLE_ASSISTANT], &c->suf[PML_ROLE_ASSISTANT]) ||
        strncmp(w4, w2, strlen(w2)) != 0) {
        chat_why(c,
                 "the chat template (%s) writes a turn depending on the others (a system message "
                 "folded into a user turn)",
                 tname);
        goto done;
    }
    if (!(c->gen = strdup(w4 + strlen(w2)))) goto oom;
    /* without a system turn: what the template inserts before the first user turn */
    size_t ns = strlen(c->start), nu = strlen(c->pre[PML_ROLE_USER]);
    const char *u = strstr(w5, c->pre[PML_ROLE_USER]);
    if (strncmp(w5, c->start, ns) != 0 || !u || u < w5 + ns || !strstr(u, MARK[0])) {
        chat_why(c, "the chat template (%s) writes a lone user turn unlike its others", tname);
        goto done;
    }
    if (!(c->implicit = dupn(w5 + ns, (size_t)(u - w5 - ns)))) goto oom;
    (void)nu;
    /* the parts must give back whole renderings */
    size_t cap = strlen(w6) + 1;
    if (!(full = malloc(cap + 4096))) goto oom;
    int pos = snprintf(full, cap + 4096, "%s", c->start);
    const int roles[4] = {PML_ROLE_SYSTEM, PML_ROLE_USER, PML_ROLE_ASSISTANT, PML_ROLE_USER};
    for (int i = 0; i < 4 && pos >= 0 && (size_t)pos < cap + 4096; i++)
        pos += snprintf(full + pos, cap + 4096 - (size_t)pos, "%s%s%s", c->pre[roles[i]], MARK[i],
                        c->suf[roles[i]]);
    if (pos >= 0 && (size_t)pos < cap + 4096)
        snprintf(full + pos, cap + 4096 - (size_t)pos, "%s", c->gen);
    if (strcmp(full, w6) != 0) {
        chat_why(c, "the chat template (%s) does not write its turns one after another", tname);
        goto done;
    }
    c->ok = true;
    goto done;
oom:
    chat_why(c, "%s", "out of memory");
done:
    free(w1);
    free(w2);
    free(w3);
    free(w4);
    free(w5);
    free(w6);
    free(full);
    (void)ROLE_NAMES;
}

void schema_chat_free(schema_chat *c) {
    free(c->start);
    for (int i = 0; i < 3; i++) {
        free(c->pre[i]);
        free(c->suf[i]);
    }
    free(c->gen);
    free(c->implicit);
    memset(c, 0, sizeof *c);
}

/* ---------------------------------------------------------------- layout */

typedef struct builder {
    schema *sc;
    const schema_opts *o;
    kv_error *err;
    int cap_nodes;
} builder;

static int node_push(builder *b, int node, const int32_t *ids, int n, int32_t *p) {
    schema_node *nd = &b->sc->nodes[node];
    if (*p + (int64_t)n > b->o->max_positions)
        return kv_fail(b->err, "the schema needs more than %d positions (the context)",
                       b->o->max_positions);
    if (nd->n_tok + n > nd->cap_tok) {
        int cap = (nd->n_tok + n) * 2;
        int32_t *t = realloc(nd->tok, sizeof *t * (size_t)cap);
        if (t) nd->tok = t;
        int32_t *q = t ? realloc(nd->pos, sizeof *q * (size_t)cap) : NULL;
        if (!t || !q) return kv_fail(b->err, "out of memory");
        nd->pos = q;
        nd->cap_tok = cap;
    }
    for (int i = 0; i < n; i++) {
        nd->tok[nd->n_tok] = ids[i];
        nd->pos[nd->n_tok++] = (*p)++;
    }
    return 0;
}

/* Tokenizes text (special: the template's own markup, whose special tokens are parsed) into
 * node's own tokens at *p on. */
static int emit(builder *b, int node, const char *text, bool special, int32_t *p) {
    if (!text || !*text) return 0;
    int32_t *ids = NULL;
    int n = tokenizer_encode(b->o->m->tok, text, strlen(text), false, special, &ids, b->err);
    if (n < 0) return -1;
    int rc = node_push(b, node, ids, n, p);
    free(ids);
    return rc;
}

static int node_new(builder *b, int parent, const pml_node *x, int union_id, int32_t start) {
    schema *sc = b->sc;
    for (int i = 1; i < sc->n_nodes; i++)
        if (strcmp(sc->nodes[i].name, x->name) == 0)
            return kv_fail(b->err,
                           "line %d, column %d: module '%s' is declared twice (first at "
                           "line %d, column %d)",
                           x->line, x->col, x->name, sc->nodes[i].line, sc->nodes[i].col);
    if (sc->n_nodes > b->o->max_modules)
        return kv_fail(b->err, "line %d, column %d: more than %d modules", x->line, x->col,
                       b->o->max_modules);
    if (sc->n_nodes == b->cap_nodes) {
        int cap = b->cap_nodes * 2;
        schema_node *t = realloc(sc->nodes, sizeof *t * (size_t)cap);
        if (!t) return kv_fail(b->err, "out of memory");
        sc->nodes = t;
        b->cap_nodes = cap;
    }
    schema_node *nd = &sc->nodes[sc->n_nodes];
    memset(nd, 0, sizeof *nd);
    nd->parent = parent;
    nd->union_id = union_id;
    nd->line = x->line;
    nd->col = x->col;
    nd->start = start;
    if (!(nd->name = strdup(x->name))) return kv_fail(b->err, "out of memory");
    return sc->n_nodes++;
}

static int walk(builder *b, int node, const pml_node *x, int32_t *p);

static int add_param(builder *b, int node, const pml_node *k, int32_t *p) {
    schema_node *nd = &b->sc->nodes[node];
    for (int i = 0; i < nd->n_params; i++)
        if (strcmp(nd->params[i].name, k->name) == 0)
            return kv_fail(b->err, "line %d, column %d: module '%s' has two parameters named '%s'",
                           k->line, k->col, nd->name, k->name);
    if (*p + (int64_t)k->length > b->o->max_positions)
        return kv_fail(b->err, "the schema needs more than %d positions (the context)",
                       b->o->max_positions);
    schema_param *t = realloc(nd->params, sizeof *t * (size_t)(nd->n_params + 1));
    if (!t) return kv_fail(b->err, "out of memory");
    nd->params = t;
    t[nd->n_params] = (schema_param){.name = strdup(k->name), .length = k->length, .pos = *p};
    if (!t[nd->n_params++].name) return kv_fail(b->err, "out of memory");
    *p += k->length;
    return 0;
}

static int walk_module(builder *b, int parent, const pml_node *k, int union_id, int32_t *p) {
    int m = node_new(b, parent, k, union_id, *p);
    if (m < 0) return -1;
    if (walk(b, m, k, p)) return -1;
    b->sc->nodes[m].end = *p;
    return 0;
}

static int walk(builder *b, int node, const pml_node *x, int32_t *p) {
    const schema_chat *chat = b->o->chat;
    for (int i = 0; i < x->n_kids; i++) {
        const pml_node *k = x->kids[i];
        switch (k->kind) {
        case PML_TEXT:
            if (emit(b, node, k->text, false, p)) return -1;
            break;
        case PML_ROLE:
            if (emit(b, node, chat->pre[k->role], true, p) || walk(b, node, k, p) ||
                emit(b, node, chat->suf[k->role], true, p))
                return -1;
            break;
        case PML_PARAM:
            if (add_param(b, node, k, p)) return -1;
            break;
        case PML_MODULE:
            if (walk_module(b, node, k, -1, p)) return -1;
            break;
        case PML_UNION: {
            int u = b->sc->n_unions++;
            int32_t start = *p, end = *p;
            for (int j = 0; j < k->n_kids; j++) {
                int32_t q = start;
                if (walk_module(b, node, k->kids[j], u, &q)) return -1;
                if (q > end) end = q;
            }
            *p = end;
            break;
        }
        }
    }
    return 0;
}

/* The first role tag in document order, or NULL. */
static const pml_node *first_role(const pml_node *x) {
    for (int i = 0; i < x->n_kids; i++) {
        if (x->kids[i]->kind == PML_ROLE) return x->kids[i];
        const pml_node *r = first_role(x->kids[i]);
        if (r) return r;
    }
    return NULL;
}

/* Tokens of node a (an ancestor of the node that starts at start) before start. */
static int tokens_before(const schema_node *a, int32_t start) {
    int k = 0;
    while (k < a->n_tok && a->pos[k] < start) k++;
    return k;
}

/* The ancestors of node, root first, into path; returns how many. */
static int ancestors(const schema *sc, int node, int *path) {
    int n = 0;
    for (int a = sc->nodes[node].parent; a >= 0; a = sc->nodes[a].parent) n++;
    int i = n;
    for (int a = sc->nodes[node].parent; a >= 0; a = sc->nodes[a].parent) path[--i] = a;
    return n;
}

static int compute_keys(schema *sc, const uint8_t model_id[32], int bt, kv_error *err) {
    int *path = malloc(sizeof *path * (size_t)(sc->n_nodes + 1));
    if (!path) return kv_fail(err, "out of memory");
    for (int i = 0; i < sc->n_nodes; i++) {
        schema_node *nd = &sc->nodes[i];
        memset(&nd->ctx_key, 0, sizeof nd->ctx_key);
        int n_path = ancestors(sc, i, path);
        for (int j = 0; j < n_path; j++) {
            const schema_node *a = &sc->nodes[path[j]];
            int k = tokens_before(a, nd->start);
            if (k > 0)
                cache_schema_key(model_id, &sc->ns, &nd->ctx_key, a->tok, a->pos, k, &nd->ctx_key);
        }
        nd->n_blocks = (nd->n_tok + bt - 1) / bt;
        if (nd->n_blocks == 0) continue;
        if (!(nd->bkeys = malloc(sizeof *nd->bkeys * (size_t)nd->n_blocks))) {
            free(path);
            return kv_fail(err, "out of memory");
        }
        for (int j = 0; j < nd->n_blocks; j++) {
            int a = j * bt, n = nd->n_tok - a < bt ? nd->n_tok - a : bt;
            cache_schema_key(model_id, &sc->ns, j ? &nd->bkeys[j - 1] : &nd->ctx_key, nd->tok + a,
                             nd->pos + a, n, &nd->bkeys[j]);
        }
        sc->own_tokens += nd->n_tok;
    }
    free(path);
    return 0;
}

schema *schema_compile(const pml_doc *doc, const char *src, size_t len, const cache_key *ns,
                       const schema_opts *o, kv_error *err) {
    if (doc->prompt) {
        kv_fail(err, "line %d, column %d: a <prompt> where a <schema> was expected", doc->root.line,
                doc->root.col);
        return NULL;
    }
    const pml_node *role = first_role(&doc->root);
    if (role && !o->chat->ok) {
        kv_fail(err, "line %d, column %d: role tags are not available: %s", role->line, role->col,
                o->chat->why);
        return NULL;
    }
    schema *sc = calloc(1, sizeof *sc);
    builder b = {.sc = sc, .o = o, .err = err, .cap_nodes = 16};
    if (!sc || !(sc->nodes = calloc((size_t)b.cap_nodes, sizeof *sc->nodes)) ||
        !(sc->name = strdup(doc->name)) || !(sc->source = dupn(src, len))) {
        kv_fail(err, "out of memory");
        goto fail;
    }
    atomic_init(&sc->refs, 1);
    sc->source_len = len;
    sc->ns = *ns;
    sc->n_nodes = 1;
    sc->nodes[0].parent = -1;
    sc->nodes[0].union_id = -1;
    sc->nodes[0].line = doc->root.line;
    sc->nodes[0].col = doc->root.col;
    sc->block_tokens = o->block_tokens;
    sc->chunk_tokens = o->chunk_tokens;
    sc->roles = role != NULL;
    int32_t p = 0;
    const schema_chat *chat = o->chat;
    if (chat->add_bos && node_push(&b, 0, &chat->bos, 1, &p)) goto fail;
    if (role && !chat->add_bos && emit(&b, 0, chat->start, true, &p)) goto fail;
    /* a conversation without a system turn gets the template's default one, as chat does */
    if (role && role->role != PML_ROLE_SYSTEM && emit(&b, 0, chat->implicit, true, &p)) goto fail;
    if (walk(&b, 0, &doc->root, &p)) goto fail;
    sc->nodes[0].end = sc->extent = p;
    if (sc->extent == 0) {
        kv_fail(err, "line %d, column %d: the schema has no text", doc->root.line, doc->root.col);
        goto fail;
    }
    if (compute_keys(sc, o->m->identity, o->block_tokens, err)) goto fail;
    return sc;
fail:
    if (sc) {
        atomic_init(&sc->refs, 1);
        schema_unref(sc);
    }
    return NULL;
}

void schema_ref(schema *sc) { atomic_fetch_add(&sc->refs, 1); }

void schema_unref(schema *sc) {
    if (!sc || atomic_fetch_sub(&sc->refs, 1) != 1) return;
    for (int i = 0; sc->nodes && i < sc->n_nodes; i++) {
        schema_node *nd = &sc->nodes[i];
        free(nd->name);
        free(nd->tok);
        free(nd->pos);
        for (int k = 0; k < nd->n_params; k++) free(nd->params[k].name);
        free(nd->params);
        free(nd->bkeys);
    }
    free(sc->nodes);
    free(sc->name);
    free(sc->source);
    free(sc);
}

int schema_find(const schema *sc, const char *module) {
    for (int i = 1; i < sc->n_nodes; i++)
        if (strcmp(sc->nodes[i].name, module) == 0) return i;
    return -1;
}

int schema_node_records(const schema *sc, int node, cache_key *out, int max) {
    const schema_node *nd = &sc->nodes[node];
    int cb = sc->chunk_tokens / sc->block_tokens, n = 0;
    for (int b = 0; b < nd->n_blocks && n < max; b += cb) {
        int last = b + cb - 1 < nd->n_blocks - 1 ? b + cb - 1 : nd->n_blocks - 1;
        out[n++] = nd->bkeys[last];
    }
    return n;
}

bool schema_stored(const schema *sc, cache_store *st) {
    for (int i = 0; i < sc->n_nodes; i++) {
        const schema_node *nd = &sc->nodes[i];
        for (int b = 0; b < nd->n_blocks; b++)
            if (!cache_store_holds(st, &nd->bkeys[b])) return false;
    }
    return true;
}

/* ---------------------------------------------------------------- rows from records */

static int kv_add_rec(schema_kv *k, cache_chunk *c) {
    if (k->n_recs == k->cap_recs) {
        int cap = k->cap_recs ? 2 * k->cap_recs : 8;
        cache_chunk **t = realloc(k->recs, sizeof *t * (size_t)cap);
        if (!t) return -1;
        k->recs = t;
        k->cap_recs = cap;
    }
    k->recs[k->n_recs++] = c;
    return 0;
}

static int kv_add_rows(schema_kv *k, const cache_chunk *rec, int src, int dst, int n,
                       int32_t src_pos) {
    if (k->n_rows == k->cap_rows) {
        int cap = k->cap_rows ? 2 * k->cap_rows : 16;
        schema_rows *t = realloc(k->rows, sizeof *t * (size_t)cap);
        if (!t) return -1;
        k->rows = t;
        k->cap_rows = cap;
    }
    k->rows[k->n_rows++] =
        (schema_rows){.rec = rec, .src = src, .dst = dst, .n = n, .src_pos = src_pos};
    return 0;
}

/* The records of node's first upto tokens, appended to k->recs (first index in *first): 0, or
 * 1 when the store does not hold them all, -1 when out of memory. */
static int fetch_node(const schema *sc, int node, int upto, cache_store *st, schema_kv *k,
                      int *first) {
    const schema_node *nd = &sc->nodes[node];
    int bt = sc->block_tokens, cb = sc->chunk_tokens / bt;
    int nb = (upto + bt - 1) / bt, want = (nb + cb - 1) / cb;
    cache_chunk **got = calloc((size_t)(want > 0 ? want : 1), sizeof *got);
    if (!got) return -1;
    int n_got = 0, n_text;
    /* no budget: lossless from disk and Redis; an encoded RAM tier's records are taken (its
     * operator chose them over exact KV, and without a disk tier they are all there is) */
    static const cache_fetch_policy any = {.force_enc = CACHE_ENC_ANY};
    int covered =
        nb > 0 ? cache_store_fetch(st, nd->bkeys, 0, nb, &any, got, NULL, want, &n_got, &n_text)
               : 0;
    *first = k->n_recs;
    int rc = covered < nb || n_got != want ? 1 : 0;
    for (int i = 0; i < n_got; i++) {
        if (rc == 0 && kv_add_rec(k, got[i]) == 0) continue;
        if (rc == 0) rc = -1;
        cache_chunk_unref(got[i]);
    }
    free(got);
    return rc;
}

/* Rows of node's own tokens [a, b) to slots dst.., split at chunk and position boundaries (a
 * span's positions are consecutive, as the fix-up wants). recs0: the node's first record in
 * k->recs. */
static int node_rows(const schema *sc, int node, int a, int b, int dst, schema_kv *k, int recs0) {
    const schema_node *nd = &sc->nodes[node];
    int ct = sc->chunk_tokens;
    while (a < b) {
        int e = a + 1;
        while (e < b && e % ct != 0 && nd->pos[e] == nd->pos[e - 1] + 1) e++;
        if (kv_add_rows(k, k->recs[recs0 + a / ct], a % ct, dst, e - a, nd->pos[a])) return -1;
        dst += e - a;
        a = e;
    }
    return 0;
}

void schema_kv_free(schema_kv *k) {
    if (!k) return;
    for (int i = 0; i < k->n_recs; i++) cache_chunk_unref(k->recs[i]);
    free(k->recs);
    free(k->rows);
    free(k->export_bkeys);
    free(k);
}

/* ---------------------------------------------------------------- precompute jobs */

void schema_job_free(schema_job *j) {
    free(j->tokens);
    free(j->pos);
    schema_kv_free(j->kv);
    memset(j, 0, sizeof *j);
}

int schema_node_job(const schema *sc, int node, cache_store *st, schema_job *out, kv_error *err) {
    memset(out, 0, sizeof *out);
    const schema_node *nd = &sc->nodes[node];
    int *path = malloc(sizeof *path * (size_t)(sc->n_nodes + 1));
    int *ks = malloc(sizeof *ks * (size_t)(sc->n_nodes + 1));
    schema_kv *k = calloc(1, sizeof *k);
    if (!path || !ks || !k) goto oom;
    k->fixup = -1;
    int n_path = ancestors(sc, node, path), n_ctx = 0;
    for (int j = 0; j < n_path; j++) n_ctx += ks[j] = tokens_before(&sc->nodes[path[j]], nd->start);
    out->n = n_ctx + nd->n_tok;
    out->kv = k;
    if (!(out->tokens = malloc(sizeof(int32_t) * (size_t)(out->n + 1))) ||
        !(out->pos = malloc(sizeof(int32_t) * (size_t)(out->n + 1))))
        goto oom;
    int dst = 0;
    for (int j = 0; j < n_path; j++) {
        const schema_node *a = &sc->nodes[path[j]];
        if (ks[j] == 0) continue;
        int first, rc = fetch_node(sc, path[j], ks[j], st, k, &first);
        if (rc < 0) goto oom;
        if (rc > 0) {
            kv_fail(err, "the KV of %s%s%s is not in the cache",
                    a->name ? "module '" : "the schema's text", a->name ? a->name : "",
                    a->name ? "'" : "");
            goto fail;
        }
        if (node_rows(sc, path[j], 0, ks[j], dst, k, first)) goto oom;
        memcpy(out->tokens + dst, a->tok, sizeof(int32_t) * (size_t)ks[j]);
        memcpy(out->pos + dst, a->pos, sizeof(int32_t) * (size_t)ks[j]);
        dst += ks[j];
    }
    k->n_slots = n_ctx;
    memcpy(out->tokens + dst, nd->tok, sizeof(int32_t) * (size_t)nd->n_tok);
    memcpy(out->pos + dst, nd->pos, sizeof(int32_t) * (size_t)nd->n_tok);
    if (!(k->export_bkeys = malloc(sizeof *k->export_bkeys * (size_t)(nd->n_blocks + 1)))) goto oom;
    memcpy(k->export_bkeys, nd->bkeys, sizeof *nd->bkeys * (size_t)nd->n_blocks);
    k->export_blocks = nd->n_blocks;
    k->export_from = n_ctx;
    k->export_n = nd->n_tok;
    k->export_ns = sc->ns;
    free(path);
    free(ks);
    return 0;
oom:
    kv_fail(err, "out of memory");
fail:
    free(path);
    free(ks);
    if (!out->kv) schema_kv_free(k);
    schema_job_free(out);
    return -1;
}

/* ---------------------------------------------------------------- prompts */

typedef struct use {
    int node;
    const pml_node *ref;
} use;

typedef struct asm_state {
    const schema *sc;
    const tokenizer *tok;
    kv_error *err;
    use *uses;
    int n_uses;
    int *used_union; /* [n_unions] the node using it, or -1 */
    int *used_node;  /* [n_nodes] 1 when imported */
} asm_state;

static int where(kv_error *err, const pml_node *x, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int where(kv_error *err, const pml_node *x, const char *fmt, ...) {
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (x->line > 0) return kv_fail(err, "line %d, column %d: %s", x->line, x->col, msg);
    return kv_fail(err, "%s", msg);
}

/* The module references under x (whose module is node parent: 0 at the prompt's top). */
static int collect(asm_state *a, const pml_node *x, int parent) {
    const schema *sc = a->sc;
    for (int i = 0; i < x->n_kids; i++) {
        const pml_node *r = x->kids[i];
        if (r->kind != PML_MODULE) continue;
        int m = schema_find(sc, r->name);
        if (m < 0) return where(a->err, r, "schema '%s' has no module '%s'", sc->name, r->name);
        const schema_node *nd = &sc->nodes[m];
        if (nd->parent != parent) {
            if (nd->parent == 0)
                return where(a->err, r, "module '%s' is not inside '%s' in schema '%s'", r->name,
                             sc->nodes[parent].name, sc->name);
            return where(a->err, r,
                         "module '%s' is inside '%s' in schema '%s': reference it inside <%s>",
                         r->name, sc->nodes[nd->parent].name, sc->name, sc->nodes[nd->parent].name);
        }
        if (a->used_node[m]) return where(a->err, r, "module '%s' is referenced twice", r->name);
        if (nd->union_id >= 0) {
            int other = a->used_union[nd->union_id];
            if (other >= 0)
                return where(a->err, r,
                             "modules '%s' and '%s' are members of one <union>: a prompt takes "
                             "at most one",
                             sc->nodes[other].name, r->name);
            a->used_union[nd->union_id] = m;
        }
        for (int k = 0; k < r->n_args; k++) {
            bool found = false;
            for (int q = 0; q < nd->n_params && !found; q++)
                found = strcmp(nd->params[q].name, r->args[2 * k]) == 0;
            if (!found)
                return where(a->err, r, "module '%s' has no parameter '%s'", r->name,
                             r->args[2 * k]);
        }
        a->used_node[m] = 1;
        a->uses[a->n_uses++] = (use){.node = m, .ref = r};
        if (collect(a, r, m)) return -1;
    }
    return 0;
}

typedef struct placed {
    int32_t pos;
    int32_t token;
    int node; /* -1: a parameter's value */
    int idx;  /* the node's own token index */
} placed;

static int cmp_placed(const void *x, const void *y) {
    const placed *a = x, *b = y;
    if (a->pos != b->pos) return a->pos < b->pos ? -1 : 1;
    return (a->node > b->node) - (a->node < b->node);
}

/* A growable token list. */
typedef struct tokv {
    int32_t *ids;
    int n, cap;
} tokv;

static int tokv_push(tokv *v, const int32_t *ids, int n) {
    if (v->n + n > v->cap) {
        int cap = (v->n + n) * 2 + 16;
        int32_t *t = realloc(v->ids, sizeof *t * (size_t)cap);
        if (!t) return -1;
        v->ids = t;
        v->cap = cap;
    }
    memcpy(v->ids + v->n, ids, sizeof *ids * (size_t)n);
    v->n += n;
    return 0;
}

static int tokv_text(tokv *v, const tokenizer *tok, const char *text, bool special, kv_error *err) {
    if (!text || !*text) return 0;
    int32_t *ids = NULL;
    int n = tokenizer_encode(tok, text, strlen(text), false, special, &ids, err);
    if (n < 0) return -1;
    int rc = tokv_push(v, ids, n);
    free(ids);
    return rc ? kv_fail(err, "out of memory") : 0;
}

static int tokv_turn(tokv *v, const tokenizer *tok, const schema_chat *chat, int role,
                     const char *text, kv_error *err) {
    if (role < 0) return tokv_text(v, tok, text, false, err);
    return tokv_text(v, tok, chat->pre[role], true, err) || tokv_text(v, tok, text, false, err) ||
                   tokv_text(v, tok, chat->suf[role], true, err)
               ? -1
               : 0;
}

/* True when node a is node b or one of b's ancestors. */
static bool ancestor_or_self(const schema *sc, int a, int b) {
    for (; b >= 0; b = sc->nodes[b].parent)
        if (b == a) return true;
    return false;
}

/* How many of the imported tokens pl[0, n) (in position order) lead the prompt with the KV a
 * full prefill computes: they sit at positions 0, 1, ... and each was computed after exactly
 * the tokens before it, its node's and its ancestors' (a node's KV never saw a sibling module,
 * a parameter's value or a module the prompt leaves out: the first of those, or the gap they
 * leave, ends the prefix). Ancestry is transitive, so each token is checked against the one
 * before it. */
static int exact_prefix(const schema *sc, const placed *pl, int n) {
    int e = 0;
    while (e < n && pl[e].pos == e && (e == 0 || ancestor_or_self(sc, pl[e - 1].node, pl[e].node)))
        e++;
    return e;
}

void schema_prompt_free(schema_prompt *p) {
    free(p->tokens);
    free(p->pos);
    free(p->flat);
    schema_kv_free(p->kv);
    memset(p, 0, sizeof *p);
}

/* Collects doc's module references into a (a->uses, used_union and used_node, allocated here:
 * the caller frees them, on failure too). 0, or -1 with err: a reference that does not fit the
 * schema (collect), out of memory. */
static int collect_uses(asm_state *a, const pml_doc *doc) {
    const schema *sc = a->sc;
    a->uses = malloc(sizeof *a->uses * (size_t)sc->n_nodes);
    a->used_union = malloc(sizeof *a->used_union * (size_t)(sc->n_unions + 1));
    a->used_node = calloc((size_t)sc->n_nodes, sizeof *a->used_node);
    if (!a->uses || !a->used_union || !a->used_node) return kv_fail(a->err, "out of memory");
    for (int i = 0; i < sc->n_unions; i++) a->used_union[i] = -1;
    a->used_node[0] = 1;
    return collect(a, &doc->root, 0);
}

/* Appends to pl (at *n) the values of every use's parameters, tokenized, at their parameters'
 * positions. 0, or -1 with err: a value longer than its parameter's length. */
static int place_values(const asm_state *a, placed *pl, int *n) {
    const schema *sc = a->sc;
    tokv val = {0};
    int rc = -1;
    for (int u = 0; u < a->n_uses; u++) {
        const schema_node *nd = &sc->nodes[a->uses[u].node];
        const pml_node *r = a->uses[u].ref;
        for (int q = 0; q < r->n_args; q++) {
            const schema_param *pm = NULL;
            for (int j = 0; j < nd->n_params && !pm; j++)
                if (strcmp(nd->params[j].name, r->args[2 * q]) == 0) pm = &nd->params[j];
            val.n = 0;
            if (tokv_text(&val, a->tok, r->args[2 * q + 1], false, a->err)) goto done;
            if (val.n > pm->length) {
                where(a->err, r,
                      "parameter '%s' of module '%s' is %d tokens; its length is %d (a value is "
                      "never truncated)",
                      pm->name, nd->name, val.n, pm->length);
                goto done;
            }
            for (int t = 0; t < val.n; t++)
                pl[(*n)++] = (placed){.pos = pm->pos + t, .token = val.ids[t], .node = -1};
        }
    }
    rc = 0;
done:
    free(val.ids);
    return rc;
}

/* Every token the prompt places, into *out (malloc'd; the caller frees it, on failure too): the
 * imported nodes' own tokens pl[0, *n_cached), then the parameters' values up to *n, each part
 * in position order. 0, or -1 with err. */
static int place_tokens(const asm_state *a, placed **out, int *n, int *n_cached) {
    const schema *sc = a->sc;
    int64_t n_pl = 0;
    for (int i = 0; i < sc->n_nodes; i++)
        if (a->used_node[i]) n_pl += sc->nodes[i].n_tok;
    for (int u = 0; u < a->n_uses; u++) {
        const schema_node *nd = &sc->nodes[a->uses[u].node];
        for (int q = 0; q < nd->n_params; q++) n_pl += nd->params[q].length;
    }
    placed *pl = *out = malloc(sizeof *pl * (size_t)(n_pl + 1));
    if (!pl) return kv_fail(a->err, "out of memory");
    *n = 0;
    for (int i = 0; i < sc->n_nodes; i++) {
        if (!a->used_node[i]) continue;
        const schema_node *nd = &sc->nodes[i];
        for (int t = 0; t < nd->n_tok; t++)
            pl[(*n)++] = (placed){.pos = nd->pos[t], .token = nd->tok[t], .node = i, .idx = t};
    }
    *n_cached = *n;
    if (place_values(a, pl, n)) return -1;
    qsort(pl, (size_t)*n_cached, sizeof *pl, cmp_placed);
    qsort(pl + *n_cached, (size_t)(*n - *n_cached), sizeof *pl, cmp_placed);
    return 0;
}

/* The free text into v: the prompt's text and role tags, the turns after it and (gen) the
 * answer's opening. 0, or -1 with err: role tags or turns the template cannot render. */
static int free_text_tokens(const asm_state *a, const pml_doc *doc, const schema_chat *chat,
                            const schema_turn *turns, int n_turns, bool gen, tokv *v) {
    for (int i = 0; i < doc->root.n_kids; i++) {
        const pml_node *x = doc->root.kids[i];
        if (x->kind == PML_TEXT && tokv_turn(v, a->tok, chat, -1, x->text, a->err)) return -1;
        if (x->kind != PML_ROLE) continue;
        if (!chat->ok) return where(a->err, x, "role tags are not available: %s", chat->why);
        const char *text = x->n_kids > 0 ? x->kids[0]->text : "";
        if (tokv_turn(v, a->tok, chat, (int)x->role, text, a->err)) return -1;
    }
    for (int i = 0; i < n_turns; i++) {
        if (turns[i].role >= 0 && !chat->ok)
            return kv_fail(a->err, "role turns are not available: %s", chat->why);
        if (tokv_turn(v, a->tok, chat, turns[i].role, turns[i].text, a->err)) return -1;
    }
    if (gen && chat->ok && tokv_text(v, a->tok, chat->gen, true, a->err)) return -1;
    return 0;
}

/* Lays out out's n + ft->n tokens: tokens and pos, the placed tokens pl[0, n) at their positions
 * and the free text ft after the last of them; flat, a full prefill's order: the placed tokens
 * merged by position, then the free text, with *flat_slot[i] (malloc'd; the caller frees it)
 * where cached entry i of pl[0, n_cached) lands there. compact: tokens and pos are flat's, at
 * 0..n-1. 0, or -1 when out of memory. */
static int lay_out(schema_prompt *out, const placed *pl, int n, int n_cached, const tokv *ft,
                   bool compact, int **flat_slot) {
    int total = n + ft->n;
    int32_t last = -1;
    for (int i = 0; i < n; i++)
        if (pl[i].pos > last) last = pl[i].pos;
    out->n = total;
    if (!(out->tokens = malloc(sizeof(int32_t) * (size_t)total)) ||
        !(out->pos = malloc(sizeof(int32_t) * (size_t)total)) ||
        !(out->flat = malloc(sizeof(int32_t) * (size_t)total)))
        return -1;
    for (int i = 0; i < n; i++) {
        out->tokens[i] = pl[i].token;
        out->pos[i] = pl[i].pos;
    }
    for (int i = 0; i < ft->n; i++) {
        out->tokens[n + i] = ft->ids[i];
        out->pos[n + i] = last + 1 + i;
    }
    out->last_pos = out->pos[total - 1];
    int *slot = *flat_slot = malloc(sizeof *slot * (size_t)(n_cached + 1));
    if (!slot) return -1;
    int i = 0, j = n_cached, o = 0;
    while (i < n_cached || j < n) {
        if (j >= n || (i < n_cached && pl[i].pos < pl[j].pos)) {
            slot[i] = o;
            out->flat[o++] = pl[i++].token;
        } else {
            out->flat[o++] = pl[j++].token;
        }
    }
    if (ft->n > 0) memcpy(out->flat + o, ft->ids, sizeof(int32_t) * (size_t)ft->n);
    if (compact) {
        memcpy(out->tokens, out->flat, sizeof(int32_t) * (size_t)total);
        for (int t = 0; t < total; t++) out->pos[t] = t;
        out->last_pos = total - 1;
    }
    return 0;
}

/* Fetches into k the records of the nodes of the imported tokens pl[0, n_import): each node's
 * up to its last imported token (all of them, unless only an exact prefix is taken);
 * recs0[node] is its first in k->recs. 0, 1 when the store does not hold one, -1 when out of
 * memory. */
static int fetch_records(const schema *sc, const placed *pl, int n_import, cache_store *st,
                         schema_kv *k, int *recs0) {
    int *upto = calloc((size_t)sc->n_nodes, sizeof *upto);
    if (!upto) return -1;
    for (int i = 0; i < n_import; i++)
        if (pl[i].idx + 1 > upto[pl[i].node]) upto[pl[i].node] = pl[i].idx + 1;
    int rc = 0;
    for (int i = 0; i < sc->n_nodes && rc == 0; i++)
        if (upto[i] > 0) rc = fetch_node(sc, i, upto[i], st, k, &recs0[i]);
    free(upto);
    return rc;
}

/* Rows into k for the imported tokens pl[0, n_import), in runs of one node's consecutive tokens
 * that land on consecutive slots: slot i, or (compact) flat_slot[i], where a parameter's value
 * may sit between. recs0: each node's first record in k->recs. 0, or -1 when out of memory. */
static int import_runs(const schema *sc, const placed *pl, int n_import, const int *flat_slot,
                       bool compact, schema_kv *k, const int *recs0) {
    for (int s = 0; s < n_import;) {
        int e = s + 1, d0 = compact ? flat_slot[s] : s;
        while (e < n_import && pl[e].node == pl[s].node && pl[e].idx == pl[e - 1].idx + 1 &&
               (!compact || flat_slot[e] == flat_slot[e - 1] + 1))
            e++;
        if (node_rows(sc, pl[s].node, pl[s].idx, pl[s].idx + (e - s), d0, k, recs0[pl[s].node]))
            return -1;
        s = e;
    }
    return 0;
}

/* The KV rows of the imported tokens pl[0, n_import) into out->kv, from their nodes' records in
 * st (import_runs says where they land). A record that is gone (cleared, evicted, corrupt)
 * leaves out->kv NULL, out->n_cached 0 and out->missing set: the prompt is computed in full.
 * 0, or -1 when out of memory. */
static int import_rows(const schema *sc, const placed *pl, int n_import, const int *flat_slot,
                       bool compact, cache_store *st, schema_prompt *out) {
    schema_kv *k = calloc(1, sizeof *k);
    if (!k) return -1;
    k->fixup = -1;
    int *recs0 = malloc(sizeof *recs0 * (size_t)sc->n_nodes);
    int rc = recs0 ? fetch_records(sc, pl, n_import, st, k, recs0) : -1;
    if (rc > 0) {
        out->n_cached = 0;
        out->missing = true;
        rc = 0;
    } else if (rc == 0) {
        rc = import_runs(sc, pl, n_import, flat_slot, compact, k, recs0);
        if (rc == 0) {
            k->n_slots = out->n_cached;
            out->kv = k;
            k = NULL;
        }
    }
    free(recs0);
    schema_kv_free(k);
    return rc;
}

int schema_assemble(const schema *sc, const pml_doc *doc, const schema_chat *chat,
                    const tokenizer *tok, const schema_turn *turns, int n_turns, bool gen,
                    cache_store *st, schema_fetch fetch, bool compact, schema_prompt *out,
                    kv_error *err) {
    memset(out, 0, sizeof *out);
    bool exact = fetch == SCHEMA_FETCH_EXACT;
    compact = compact || exact;
    asm_state a = {.sc = sc, .tok = tok, .err = err};
    placed *pl = NULL;
    tokv free_text = {0};
    int *flat_slot = NULL;
    int n = 0, n_cached = 0, rc = -1;
    if (!doc->prompt)
        return kv_fail(err, "line %d, column %d: a <schema> where a <prompt> was expected",
                       doc->root.line, doc->root.col);
    if (strcmp(doc->name, sc->name) != 0)
        return kv_fail(err, "the prompt names schema '%s', not '%s'", doc->name, sc->name);
    if (collect_uses(&a, doc) || place_tokens(&a, &pl, &n, &n_cached) ||
        free_text_tokens(&a, doc, chat, turns, n_turns, gen, &free_text))
        goto done;
    int total = n + free_text.n;
    if (total == 0) {
        kv_fail(err, "the prompt is empty");
        goto done;
    }
    out->n_modules = a.n_uses;
    if (lay_out(out, pl, n, n_cached, &free_text, compact, &flat_slot)) goto oom;
    /* at least the last token is computed, for its logits */
    if (n_cached >= total) n_cached = total - 1;
    int n_import = exact ? exact_prefix(sc, pl, n_cached) : n_cached;
    out->n_cached = compact && !exact ? 0 : n_import;
    if (fetch != SCHEMA_FETCH_NONE && n_import > 0 &&
        import_rows(sc, pl, n_import, flat_slot, compact, st, out))
        goto oom;
    rc = 0;
    goto done;
oom:
    kv_fail(err, "out of memory");
done:
    if (rc) schema_prompt_free(out);
    free(pl);
    free(flat_slot);
    free(free_text.ids);
    free(a.uses);
    free(a.used_union);
    free(a.used_node);
    return rc;
}
