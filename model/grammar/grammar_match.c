/* Matching a compiled grammar against the vocabulary.
 *
 * The pushdown automaton's configurations are stacks of grammar positions: the top is the byte
 * element to match next, the frames below are where to continue when the current rule ends.
 * Stacks are hash-consed into nodes (position, parent node), so a stack is one int and stacks
 * sharing a tail share it; a tail call (a reference that ends its alternative) pushes no frame,
 * so x* loops do not grow the stack. Since grammars are ambiguous, the state after some input is
 * the set of stacks it can be in (llama.cpp's "stacks"); sets are interned too and their
 * transitions on each byte memoized, which determinizes the automaton lazily: after warm-up, a
 * byte costs one array read.
 *
 * Masks: the vocabulary's tokens sit in a byte trie laid out in preorder, each node with the
 * index just past its subtree. One pass over the array walks every token against the state's
 * transitions, jumping over a subtree at the first byte the grammar refuses (xgrammar and
 * llguidance prune the same way). The mask of each state is cached, so a state seen before
 * (every character inside a JSON string is the same state) costs only applying the bitset. */
#include "model/grammar/grammar.h"
#include "model/grammar/grammar_impl.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define T_UNKNOWN (-3)
#define MAX_SET_STACKS 4096
#define MAX_CLOSURE_WORK 1000000
#define MATCH_BUDGET ((size_t)256 << 20) /* memo bytes per gmatch */

/* ---------------------------------------------------------------- vocabulary trie */

struct grammar_vocab {
    int32_t n_vocab;
    char *bytes;   /* every token's bytes, concatenated */
    size_t *off;   /* [n_vocab + 1] */
    bool *eog;     /* [n_vocab] */
    int32_t *eogs; /* the end-of-generation ids */
    int32_t n_eog;
    /* the trie in preorder: node k holds byte[k] at depth[k] (1 = first byte), skip[k] is the
     * first node after its subtree, tok[k] the first token whose bytes end there (chained by
     * tok_next), or -1 */
    uint8_t *nbyte;
    uint16_t *ndepth;
    int32_t *nskip;
    int32_t *ntok;
    int32_t *tok_next; /* [n_vocab] */
    int64_t n_nodes;
    int max_depth;
};

typedef struct tok_ref {
    const char *p;
    uint32_t len;
    int32_t id;
} tok_ref;

static int tok_ref_cmp(const void *a, const void *b) {
    const tok_ref *x = a, *y = b;
    uint32_t n = x->len < y->len ? x->len : y->len;
    int c = memcmp(x->p, y->p, n);
    if (c) return c;
    if (x->len != y->len) return x->len < y->len ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

void grammar_vocab_destroy(grammar_vocab *v) {
    if (!v) return;
    free(v->bytes);
    free(v->off);
    free(v->eog);
    free(v->eogs);
    free(v->nbyte);
    free(v->ndepth);
    free(v->nskip);
    free(v->ntok);
    free(v->tok_next);
    free(v);
}

/* Builds the trie from v->bytes/off/eog. */
static int vocab_build(grammar_vocab *v, kv_error *err) {
    int32_t n = v->n_vocab;
    tok_ref *refs = malloc(sizeof *refs * (size_t)(n ? n : 1));
    int64_t total = 0;
    int n_refs = 0, n_eog = 0, max_len = 0;
    if (!refs) return kv_fail(err, "out of memory");
    for (int32_t i = 0; i < n; i++) {
        size_t len = v->off[i + 1] - v->off[i];
        if (v->eog[i]) n_eog++;
        if (len == 0 || len > 65535) continue; /* never allowed as text */
        refs[n_refs++] = (tok_ref){v->bytes + v->off[i], (uint32_t)len, i};
        total += (int64_t)len;
        if ((int)len > max_len) max_len = (int)len;
    }
    qsort(refs, (size_t)n_refs, sizeof *refs, tok_ref_cmp);
    size_t cap = (size_t)total + 1;
    v->nbyte = malloc(cap);
    v->ndepth = malloc(sizeof *v->ndepth * cap);
    v->nskip = malloc(sizeof *v->nskip * cap);
    v->ntok = malloc(sizeof *v->ntok * cap);
    v->tok_next = malloc(sizeof *v->tok_next * (size_t)(n ? n : 1));
    v->eogs = malloc(sizeof *v->eogs * (size_t)(n_eog ? n_eog : 1));
    int32_t *open = malloc(sizeof *open * (size_t)(max_len + 2));
    if (!v->nbyte || !v->ndepth || !v->nskip || !v->ntok || !v->tok_next || !v->eogs || !open) {
        free(refs);
        free(open);
        return kv_fail(err, "out of memory");
    }
    for (int32_t i = 0; i < n; i++) {
        v->tok_next[i] = -1;
        if (v->eog[i]) v->eogs[v->n_eog++] = i;
    }
    int64_t nn = 0;
    int depth = 0; /* length of the open path; open[d] is its node at depth d */
    for (int k = 0; k < n_refs; k++) {
        const tok_ref *t = &refs[k];
        int lcp = 0;
        if (k > 0) {
            const tok_ref *u = &refs[k - 1];
            while (lcp < (int)t->len && lcp < (int)u->len && t->p[lcp] == u->p[lcp]) lcp++;
        }
        if (lcp > depth) lcp = depth;
        for (int d = depth; d > lcp; d--) v->nskip[open[d]] = (int32_t)nn;
        depth = lcp;
        for (int d = lcp; d < (int)t->len; d++) {
            v->nbyte[nn] = (uint8_t)t->p[d];
            v->ndepth[nn] = (uint16_t)(d + 1);
            v->ntok[nn] = -1;
            open[++depth] = (int32_t)nn;
            nn++;
        }
        int32_t node = open[depth];
        v->tok_next[t->id] = v->ntok[node];
        v->ntok[node] = t->id;
    }
    for (int d = depth; d > 0; d--) v->nskip[open[d]] = (int32_t)nn;
    v->n_nodes = nn;
    v->max_depth = max_len;
    free(open);
    free(refs);
    return 0;
}

grammar_vocab *grammar_vocab_create_raw(const char *const *tokens, const size_t *lens,
                                        const bool *eog, int32_t n_vocab, kv_error *err) {
    grammar_vocab *v = calloc(1, sizeof *v);
    size_t total = 0;
    if (!v) goto oom;
    v->n_vocab = n_vocab;
    for (int32_t i = 0; i < n_vocab; i++) total += lens[i];
    v->bytes = malloc(total + 1);
    v->off = malloc(sizeof *v->off * ((size_t)n_vocab + 1));
    v->eog = calloc((size_t)n_vocab + 1, sizeof *v->eog);
    if (!v->bytes || !v->off || !v->eog) goto oom;
    size_t o = 0;
    for (int32_t i = 0; i < n_vocab; i++) {
        v->off[i] = o;
        if (lens[i]) memcpy(v->bytes + o, tokens[i], lens[i]);
        o += lens[i];
        v->eog[i] = eog && eog[i];
    }
    v->off[n_vocab] = o;
    if (vocab_build(v, err)) {
        grammar_vocab_destroy(v);
        return NULL;
    }
    return v;
oom:
    kv_fail(err, "out of memory");
    grammar_vocab_destroy(v);
    return NULL;
}

int32_t grammar_vocab_n_tokens(const grammar_vocab *v) { return v->n_vocab; }
int64_t grammar_vocab_n_nodes(const grammar_vocab *v) { return v->n_nodes; }

/* ---------------------------------------------------------------- matcher state */

typedef struct gset {
    uint32_t off, n; /* stacks pool[off .. off + n), sorted; -1 is the empty stack (matched) */
    uint32_t hash;
    bool can_end;
    uint64_t first[4]; /* bytes some stack can take next */
    int32_t *trans;    /* [256] set reached on each byte, T_UNKNOWN until computed; or NULL */
    uint64_t *mask;    /* allowed tokens, or NULL until computed */
} gset;

struct gmatch {
    const grammar *g;
    const grammar_vocab *v;
    /* stack nodes: (position, parent node or -1), hash-consed */
    int32_t *npos, *npar;
    uint32_t *nseen; /* epoch of the last closure that reached the node */
    int32_t n_nodes, cap_nodes;
    int32_t *nhash;
    uint32_t nhash_cap;
    /* stack sets, interned */
    int32_t *pool;
    size_t n_pool, cap_pool;
    gset *sets;
    int32_t n_sets, cap_sets;
    int32_t *shash;
    uint32_t shash_cap;
    uint32_t epoch;
    /* scratch */
    int32_t *work; /* closure worklist of (position, parent) pairs */
    size_t cap_work;
    int32_t *out;
    size_t n_out, cap_out;
    int32_t *dstate; /* [max_depth + 1] states along the trie path */
    size_t bytes;    /* memo bytes, against MATCH_BUDGET */
    int32_t start, final;
};

static uint32_t hash_u32(uint32_t h, uint32_t x) {
    h ^= x + 0x9e3779b9u + (h << 6) + (h >> 2);
    return h * 0x85ebca6bu;
}

/* kv_array_reserve, counting what it adds in *bytes (the matcher's memory bound). */
static int grow(void **p, size_t *cap, size_t need, size_t elem, size_t *bytes) {
    size_t old = *cap;
    if (kv_array_reserve(p, cap, need, elem, 64)) return -1;
    *bytes += (*cap - old) * elem;
    return 0;
}

static int rehash_nodes(gmatch *m) {
    uint32_t cap = m->nhash_cap ? m->nhash_cap * 2 : 1024;
    int32_t *h = malloc(sizeof *h * cap);
    if (!h) return -1;
    memset(h, 0xff, sizeof *h * cap);
    for (int32_t i = 0; i < m->n_nodes; i++) {
        uint32_t k = hash_u32(hash_u32(0, (uint32_t)m->npos[i]), (uint32_t)m->npar[i]) & (cap - 1);
        while (h[k] >= 0) k = (k + 1) & (cap - 1);
        h[k] = i;
    }
    m->bytes += sizeof *h * (cap - m->nhash_cap);
    free(m->nhash);
    m->nhash = h;
    m->nhash_cap = cap;
    return 0;
}

/* The node (pos, par), created if new; -1 when a limit is hit. */
static int32_t node_get(gmatch *m, int32_t pos, int32_t par) {
    if ((uint32_t)m->n_nodes * 2 >= m->nhash_cap && rehash_nodes(m)) return -1;
    uint32_t k = hash_u32(hash_u32(0, (uint32_t)pos), (uint32_t)par) & (m->nhash_cap - 1);
    for (; m->nhash[k] >= 0; k = (k + 1) & (m->nhash_cap - 1)) {
        int32_t i = m->nhash[k];
        if (m->npos[i] == pos && m->npar[i] == par) return i;
    }
    if (m->n_nodes == m->cap_nodes) {
        size_t cap = (size_t)m->cap_nodes, c1 = cap, c2 = cap, c3 = cap;
        if (m->bytes > MATCH_BUDGET || m->n_nodes >= INT32_MAX / 4 ||
            grow((void **)&m->npos, &c1, cap + 1, sizeof *m->npos, &m->bytes) ||
            grow((void **)&m->npar, &c2, cap + 1, sizeof *m->npar, &m->bytes) ||
            grow((void **)&m->nseen, &c3, cap + 1, sizeof *m->nseen, &m->bytes))
            return -1;
        m->cap_nodes = (int32_t)c1;
    }
    int32_t i = m->n_nodes++;
    m->npos[i] = pos;
    m->npar[i] = par;
    m->nseen[i] = 0;
    m->nhash[k] = i;
    return i;
}

static int out_push(gmatch *m, int32_t s) {
    if (m->n_out >= MAX_SET_STACKS) return -1;
    if (grow((void **)&m->out, &m->cap_out, m->n_out + 1, sizeof *m->out, &m->bytes)) return -1;
    m->out[m->n_out++] = s;
    return 0;
}

/* Adds to m->out every stack reachable from continuing at pos with parent par without
 * consuming a byte: references are entered, ends of alternatives return to the parent, byte
 * elements are where stacks stop. -1 when a limit is hit. */
static int closure(gmatch *m, int32_t pos, int32_t par) {
    const grammar *g = m->g;
    size_t n_work = 0, steps = 0;
    if (grow((void **)&m->work, &m->cap_work, 2, sizeof *m->work, &m->bytes)) return -1;
    m->work[n_work++] = pos;
    m->work[n_work++] = par;
    while (n_work > 0) {
        if (++steps > MAX_CLOSURE_WORK) return -1;
        int32_t pr = m->work[--n_work], p = m->work[--n_work];
        const gelem *e = &g->elems[p];
        if (e->type == G_END) {
            if (pr < 0) {
                if (out_push(m, -1)) return -1;
                continue;
            }
            int32_t pp = m->npos[pr], ppar = m->npar[pr];
            if (grow((void **)&m->work, &m->cap_work, n_work + 2, sizeof *m->work, &m->bytes))
                return -1;
            m->work[n_work++] = pp;
            m->work[n_work++] = ppar;
            continue;
        }
        int32_t id = node_get(m, p, pr);
        if (id < 0) return -1;
        if (m->nseen[id] == m->epoch) continue;
        m->nseen[id] = m->epoch;
        if (e->type != G_REF) {
            if (out_push(m, id)) return -1;
            continue;
        }
        /* A reference that ends its alternative returns straight to the parent (tail call). */
        int32_t ret = pr;
        if (g->elems[p + 1].type != G_END && (ret = node_get(m, p + 1, pr)) < 0) return -1;
        const grule *r = &g->rules[e->val];
        if (grow((void **)&m->work, &m->cap_work, n_work + 2 * (size_t)r->n_alts, sizeof *m->work,
                 &m->bytes))
            return -1;
        for (int32_t a = r->n_alts - 1; a >= 0; a--) {
            m->work[n_work++] = g->alts[r->first_alt + a];
            m->work[n_work++] = ret;
        }
    }
    return 0;
}

static int i32_cmp(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return x < y ? -1 : x > y;
}

static int rehash_sets(gmatch *m) {
    uint32_t cap = m->shash_cap ? m->shash_cap * 2 : 256;
    int32_t *h = malloc(sizeof *h * cap);
    if (!h) return -1;
    memset(h, 0xff, sizeof *h * cap);
    for (int32_t i = 0; i < m->n_sets; i++) {
        uint32_t k = m->sets[i].hash & (cap - 1);
        while (h[k] >= 0) k = (k + 1) & (cap - 1);
        h[k] = i;
    }
    m->bytes += sizeof *h * (cap - m->shash_cap);
    free(m->shash);
    m->shash = h;
    m->shash_cap = cap;
    return 0;
}

/* The set of m->out's stacks (sorted and deduplicated here) as an id: GMATCH_DEAD when empty,
 * GMATCH_ERROR when a limit is hit. */
static int32_t set_intern(gmatch *m) {
    if (m->n_out == 0) return GMATCH_DEAD;
    qsort(m->out, m->n_out, sizeof *m->out, i32_cmp);
    size_t n = 1;
    for (size_t i = 1; i < m->n_out; i++)
        if (m->out[i] != m->out[n - 1]) m->out[n++] = m->out[i];
    m->n_out = n;
    uint32_t h = 0x12345u;
    for (size_t i = 0; i < n; i++) h = hash_u32(h, (uint32_t)m->out[i]);
    if ((uint32_t)m->n_sets * 2 >= m->shash_cap && rehash_sets(m)) return GMATCH_ERROR;
    uint32_t k = h & (m->shash_cap - 1);
    for (; m->shash[k] >= 0; k = (k + 1) & (m->shash_cap - 1)) {
        const gset *s = &m->sets[m->shash[k]];
        if (s->hash == h && s->n == n && !memcmp(m->pool + s->off, m->out, n * sizeof *m->out))
            return m->shash[k];
    }
    size_t cs = (size_t)m->cap_sets;
    if (m->bytes > MATCH_BUDGET || m->n_pool + n > UINT32_MAX ||
        grow((void **)&m->pool, &m->cap_pool, m->n_pool + n, sizeof *m->pool, &m->bytes) ||
        grow((void **)&m->sets, &cs, (size_t)m->n_sets + 1, sizeof *m->sets, &m->bytes))
        return GMATCH_ERROR;
    m->cap_sets = (int32_t)cs;
    int32_t id = m->n_sets++;
    gset *s = &m->sets[id];
    memset(s, 0, sizeof *s);
    s->off = (uint32_t)m->n_pool;
    s->n = (uint32_t)n;
    s->hash = h;
    memcpy(m->pool + m->n_pool, m->out, n * sizeof *m->out);
    m->n_pool += n;
    for (size_t i = 0; i < n; i++) {
        if (m->out[i] < 0) {
            s->can_end = true;
            continue;
        }
        const gelem *e = &m->g->elems[m->npos[m->out[i]]];
        if (e->type == G_BYTE)
            s->first[e->val >> 6] |= 1ull << (e->val & 63);
        else
            for (int w = 0; w < 4; w++) s->first[w] |= m->g->sets[e->val][w];
    }
    m->shash[k] = id;
    return id;
}

/* The set reached from state on byte c (memoized). */
static int32_t transition(gmatch *m, int32_t state, uint8_t c) {
    gset *s = &m->sets[state];
    if (!(s->first[c >> 6] >> (c & 63) & 1)) return GMATCH_DEAD;
    if (s->trans && s->trans[c] != T_UNKNOWN) return s->trans[c];
    if (!s->trans) {
        if (m->bytes > MATCH_BUDGET || !(s->trans = malloc(sizeof *s->trans * 256)))
            return GMATCH_ERROR;
        m->bytes += sizeof *s->trans * 256;
        for (int i = 0; i < 256; i++) s->trans[i] = T_UNKNOWN;
    }
    m->n_out = 0;
    if (++m->epoch == 0) { /* wrapped: forget every mark */
        memset(m->nseen, 0, sizeof *m->nseen * (size_t)m->n_nodes);
        m->epoch = 1;
    }
    uint32_t off = s->off, n = s->n;
    for (uint32_t i = 0; i < n; i++) {
        int32_t st = m->pool[off + i];
        if (st < 0) continue;
        int32_t p = m->npos[st];
        if (gelem_matches(m->g, &m->g->elems[p], c) && closure(m, p + 1, m->npar[st]))
            return GMATCH_ERROR;
    }
    int32_t t = set_intern(m);
    m->sets[state].trans[c] = t; /* sets may have moved */
    return t;
}

/* ---------------------------------------------------------------- public */

gmatch *gmatch_create(const grammar *g, const grammar_vocab *v, kv_error *err) {
    gmatch *m = calloc(1, sizeof *m);
    if (!m) goto oom;
    m->g = g;
    m->v = v;
    m->epoch = 1;
    if (!(m->dstate = malloc(sizeof *m->dstate * ((size_t)v->max_depth + 2)))) goto oom;
    if (rehash_nodes(m) || rehash_sets(m)) goto oom;
    /* the start: every alternative of root; the final state: the empty stack alone */
    const grule *r = &g->rules[g->root];
    m->n_out = 0;
    for (int32_t a = 0; a < r->n_alts; a++)
        if (closure(m, g->alts[r->first_alt + a], -1)) {
            m->start = GMATCH_ERROR;
            break;
        }
    if (m->start != GMATCH_ERROR) m->start = set_intern(m);
    m->n_out = 0;
    if (out_push(m, -1)) goto oom;
    m->final = set_intern(m);
    if (m->final < 0) goto oom;
    return m;
oom:
    kv_fail(err, "out of memory");
    gmatch_destroy(m);
    return NULL;
}

void gmatch_destroy(gmatch *m) {
    if (!m) return;
    for (int32_t i = 0; i < m->n_sets; i++) {
        free(m->sets[i].trans);
        free(m->sets[i].mask);
    }
    free(m->sets);
    free(m->shash);
    free(m->pool);
    free(m->npos);
    free(m->npar);
    free(m->nseen);
    free(m->nhash);
    free(m->work);
    free(m->out);
    free(m->dstate);
    free(m);
}

int32_t gmatch_start(gmatch *m) { return m->start; }

bool gmatch_can_end(const gmatch *m, int32_t state) {
    return state >= 0 && state < m->n_sets && m->sets[state].can_end;
}

bool gmatch_is_final(const gmatch *m, int32_t state) {
    return state >= 0 && state < m->n_sets && m->sets[state].n == 1 && m->sets[state].can_end;
}

int32_t gmatch_accept_bytes(gmatch *m, int32_t state, const char *bytes, size_t n) {
    for (size_t i = 0; i < n && state >= 0; i++) state = transition(m, state, (uint8_t)bytes[i]);
    return state;
}

int32_t gmatch_accept_token(gmatch *m, int32_t state, int32_t token) {
    const grammar_vocab *v = m->v;
    if (state < 0 || state >= m->n_sets) return GMATCH_DEAD;
    if (token < 0 || token >= v->n_vocab) return GMATCH_DEAD;
    if (v->eog[token]) return m->sets[state].can_end ? m->final : GMATCH_DEAD;
    size_t len = v->off[token + 1] - v->off[token];
    if (len == 0) return GMATCH_DEAD;
    return gmatch_accept_bytes(m, state, v->bytes + v->off[token], len);
}

const uint64_t *gmatch_mask(gmatch *m, int32_t state, kv_error *err) {
    const grammar_vocab *v = m->v;
    if (state < 0 || state >= m->n_sets) {
        kv_fail(err, "grammar: no state to continue from");
        return NULL;
    }
    if (m->sets[state].mask) return m->sets[state].mask;
    size_t words = ((size_t)v->n_vocab + 63) / 64;
    uint64_t *mask = calloc(words ? words : 1, sizeof *mask);
    if (!mask || m->bytes > MATCH_BUDGET) {
        free(mask);
        kv_fail(err, "grammar: the matcher's memory budget is spent");
        return NULL;
    }
    int32_t *ds = m->dstate;
    ds[0] = state;
    const uint8_t *nbyte = v->nbyte;
    const uint16_t *ndepth = v->ndepth;
    for (int64_t k = 0; k < v->n_nodes;) {
        int32_t prev = ds[ndepth[k] - 1];
        uint8_t c = nbyte[k];
        const gset *ps = &m->sets[prev];
        int32_t t;
        if (!(ps->first[c >> 6] >> (c & 63) & 1))
            t = GMATCH_DEAD;
        else if (ps->trans && ps->trans[c] != T_UNKNOWN)
            t = ps->trans[c];
        else
            t = transition(m, prev, c);
        if (t < 0) {
            if (t == GMATCH_ERROR) {
                free(mask);
                kv_fail(err,
                        "grammar: too complex to match (a state holds more than %d stacks, "
                        "or the matcher's memory budget is spent)",
                        MAX_SET_STACKS);
                return NULL;
            }
            k = v->nskip[k];
            continue;
        }
        ds[ndepth[k]] = t;
        for (int32_t tok = v->ntok[k]; tok >= 0; tok = v->tok_next[tok])
            mask[tok >> 6] |= 1ull << (tok & 63);
        k++;
    }
    if (m->sets[state].can_end)
        for (int32_t i = 0; i < v->n_eog; i++) mask[v->eogs[i] >> 6] |= 1ull << (v->eogs[i] & 63);
    m->bytes += words * sizeof *mask;
    m->sets[state].mask = mask;
    return mask;
}

int gmatch_apply(gmatch *m, int32_t state, float *logits, kv_error *err) {
    const uint64_t *mask = gmatch_mask(m, state, err);
    if (!mask) return -1;
    int32_t n = m->v->n_vocab, allowed = 0;
    for (int32_t w = 0; w * 64 < n; w++) {
        uint64_t bits = mask[w];
        int32_t lo = w * 64, hi = lo + 64 < n ? lo + 64 : n;
        if (bits == ~0ull && hi - lo == 64) {
            allowed += 64;
            continue;
        }
        for (int32_t i = lo; i < hi; i++) {
            if (bits >> (i - lo) & 1)
                allowed++;
            else
                logits[i] = -INFINITY;
        }
    }
    return allowed;
}

size_t gmatch_forced(gmatch *m, int32_t state, char *buf, size_t cap, int32_t *next) {
    size_t n = 0, whole = 0;
    int32_t whole_state = state;
    int pending = 0; /* continuation bytes the current character still needs */
    while (n < cap && state >= 0 && !m->sets[state].can_end) {
        const uint64_t *f = m->sets[state].first;
        int count = 0, c = -1;
        for (int w = 0; w < 4 && count < 2; w++) {
            count += __builtin_popcountll(f[w]);
            if (f[w] && c < 0) c = w * 64 + __builtin_ctzll(f[w]);
        }
        if (count != 1) break;
        int32_t t = transition(m, state, (uint8_t)c);
        if (t < 0) break;
        buf[n++] = (char)c;
        state = t;
        if (pending > 0)
            pending--;
        else
            pending = c >= 0xF0 ? 3 : c >= 0xE0 ? 2 : c >= 0xC0 ? 1 : 0;
        if (pending == 0) {
            whole = n;
            whole_state = state;
        }
    }
    *next = whole_state;
    return whole;
}

void gmatch_stats(const gmatch *m, int64_t *n_states, int64_t *n_masks, int64_t *bytes) {
    int64_t masks = 0;
    for (int32_t i = 0; i < m->n_sets; i++) masks += m->sets[i].mask != NULL;
    if (n_states) *n_states = m->n_sets;
    if (n_masks) *n_masks = masks;
    if (bytes) *bytes = (int64_t)m->bytes;
}
