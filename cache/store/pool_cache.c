/* The device-pool tier: block entries in a keyed table with an LRU list (util/keytable.h)
 * under one mutex (held briefly; the engine thread is the only writer of the pool itself).
 * Every entry is also in a second table by its parent and first token (its "child key"), for
 * matching to the token; partial entries are only there. */
#include "cache/store/pool_cache.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "util/keytable.h"

/* Children of one parent scanned by a match, at most: a prompt's next block is compared with
 * this many cached blocks that follow the same prefix and start with the same token. */
#define PC_MATCH_SCAN 64

typedef struct pc_entry {
    kt_node node;  /* keyed by key (full entries only) */
    kt_node cnode; /* keyed by ckey */
    lru_node lru;
    cache_key key;    /* full entries: the block's prefix key */
    cache_key ns;     /* namespace */
    cache_key parent; /* the previous block's prefix key (the first block: ns) */
    cache_key ckey;   /* parent with the first token mixed in (child_key) */
    bool dead;        /* cleared by another thread; block not yet released */
    bool partial;     /* holds n_tok < block_tokens rows, in no prefix key's name */
    uint64_t used;    /* use stamp */
    int32_t block;
    int n_tok;
    int32_t tok[]; /* [n_tok] the tokens whose KV the block holds */
} pc_entry;

struct pool_cache {
    kv_pool *pool;
    int block_tokens;
    pthread_mutex_t mu;
    keytable table;
    keytable children; /* every entry, by ckey */
    lru_list lru;
    int64_t n_dead;
    uint64_t clock;
    pool_cache_stats st;
};

pool_cache *pool_cache_create(kv_pool *pool) {
    pool_cache *pc = calloc(1, sizeof *pc);
    if (!pc) return NULL;
    if (keytable_init(&pc->table, CACHE_KEY_BYTES) != 0) {
        free(pc);
        return NULL;
    }
    if (keytable_init(&pc->children, CACHE_KEY_BYTES) != 0) {
        keytable_free(&pc->table);
        free(pc);
        return NULL;
    }
    pc->pool = pool;
    pc->block_tokens = kv_pool_layout(pool)->block_tokens;
    pthread_mutex_init(&pc->mu, NULL);
    return pc;
}

/* Where the children of parent that start with token are found: the parent's key with the
 * token mixed into its first bytes. Different parents may meet at one child key; a match
 * compares the parent itself. */
static void child_key(const cache_key *parent, int32_t token, cache_key *out) {
    *out = *parent;
    uint32_t t = (uint32_t)token;
    for (int i = 0; i < 4; i++) out->b[i] ^= (uint8_t)(t >> (8 * i));
}

static pc_entry *find(const pool_cache *pc, const cache_key *key) {
    kt_node *n = keytable_find(&pc->table, key->b);
    return n ? KT_ENTRY(n, pc_entry, node) : NULL;
}

static void touch(pool_cache *pc, pc_entry *e) {
    e->used = pc->clock++;
    lru_touch(&pc->lru, &e->lru);
}

/* Removes e from the table and list and releases its block. Engine thread, mu held. */
static void entry_free(pool_cache *pc, pc_entry *e) {
    if (!e->partial) keytable_remove(&pc->table, &e->node);
    keytable_remove(&pc->children, &e->cnode);
    lru_unlink(&pc->lru, &e->lru);
    kv_pool_block_unref(pc->pool, e->block);
    if (e->dead) pc->n_dead--;
    pc->st.entries--;
    pc->st.blocks--;
    pc->st.partial -= e->partial;
    free(e);
}

void pool_cache_destroy(pool_cache *pc) {
    if (!pc) return;
    while (pc->lru.oldest) entry_free(pc, KT_ENTRY(pc->lru.oldest, pc_entry, lru));
    keytable_free(&pc->table);
    keytable_free(&pc->children);
    pthread_mutex_destroy(&pc->mu);
    free(pc);
}

bool pool_cache_has(pool_cache *pc, const cache_key *key) {
    pthread_mutex_lock(&pc->mu);
    pc_entry *e = find(pc, key);
    bool has = e && !e->dead;
    pthread_mutex_unlock(&pc->mu);
    return has;
}

int64_t pool_cache_clear(pool_cache *pc, const cache_key *ns) {
    int64_t n = 0;
    pthread_mutex_lock(&pc->mu);
    for (lru_node *v = pc->lru.oldest; v; v = v->newer) {
        pc_entry *e = KT_ENTRY(v, pc_entry, lru);
        if (!e->dead && (!ns || memcmp(e->ns.b, ns->b, CACHE_KEY_BYTES) == 0)) {
            e->dead = true;
            pc->n_dead++;
            n++;
        }
    }
    pthread_mutex_unlock(&pc->mu);
    return n;
}

void pool_cache_stats_get(pool_cache *pc, pool_cache_stats *out) {
    pthread_mutex_lock(&pc->mu);
    *out = pc->st;
    out->entries -= pc->n_dead;
    out->blocks -= pc->n_dead;
    /* dead partial entries are few and short-lived: not told apart here */
    if (out->partial > out->entries) out->partial = out->entries;
    pthread_mutex_unlock(&pc->mu);
}

int pool_cache_lookup(pool_cache *pc, const cache_key *keys, int n, int32_t *blocks, bool count) {
    pthread_mutex_lock(&pc->mu);
    int held = 0;
    for (; held < n; held++) {
        pc_entry *e = find(pc, &keys[held]);
        if (!e || e->dead) break;
        if (blocks) blocks[held] = e->block;
    }
    /* Last first: the head of the prefix ends up the most recently used. */
    for (int i = held - 1; i >= 0; i--) touch(pc, find(pc, &keys[i]));
    if (count) {
        pc->st.hits += held;
        pc->st.misses += held < n;
    }
    pthread_mutex_unlock(&pc->mu);
    return held;
}

/* How many leading tokens of tok[0..n) e holds (at most its n_tok). */
static int common_prefix(const pc_entry *e, const int32_t *tok, int n) {
    int m = n < e->n_tok ? n : e->n_tok, i = 0;
    while (i < m && e->tok[i] == tok[i]) i++;
    return i;
}

/* A new entry for block after parent (or ns: the first block) holding tok[0..n). mu held. */
static pc_entry *entry_new(pool_cache *pc, const cache_key *ns, const cache_key *parent,
                           const int32_t *tok, int n, int32_t block) {
    pc_entry *e = malloc(sizeof *e + sizeof(int32_t) * (size_t)n);
    if (!e) return NULL;
    *e = (pc_entry){.ns = *ns, .parent = parent ? *parent : *ns, .block = block, .n_tok = n};
    memcpy(e->tok, tok, sizeof(int32_t) * (size_t)n);
    child_key(&e->parent, tok[0], &e->ckey);
    e->cnode.key = e->ckey.b;
    keytable_insert(&pc->children, &e->cnode);
    kv_pool_block_ref(pc->pool, block);
    touch(pc, e);
    pc->st.entries++;
    pc->st.blocks++;
    return e;
}

/* The live children of parent (or ns) starting with tok[0], at most PC_MATCH_SCAN: visit
 * returns false to stop. mu held. */
static void each_child(pool_cache *pc, const cache_key *ns, const cache_key *parent,
                       const int32_t *tok, bool (*visit)(void *ud, pc_entry *e), void *ud) {
    const cache_key *par = parent ? parent : ns;
    cache_key ck;
    child_key(par, tok[0], &ck);
    int seen = 0;
    for (kt_node *n = keytable_find(&pc->children, ck.b), *next; n && seen < PC_MATCH_SCAN;
         n = next) {
        next = keytable_find_next(&pc->children, n);
        pc_entry *e = KT_ENTRY(n, pc_entry, cnode);
        if (e->dead || memcmp(e->parent.b, par->b, CACHE_KEY_BYTES) != 0) continue;
        seen++;
        if (!visit(ud, e)) return;
    }
}

/* Partial children a new entry's tokens cover: their blocks go, when no sequence shares them. */
typedef struct cover {
    pool_cache *pc;
    const int32_t *tok;
    int n;
    pc_entry *drop[PC_MATCH_SCAN];
    int n_drop;
    bool covered; /* a child holds tok[0..n) already */
} cover;

static bool visit_cover(void *ud, pc_entry *e) {
    cover *c = ud;
    int l = common_prefix(e, c->tok, c->n);
    if (l == c->n) c->covered = true;
    if (e->partial && l == e->n_tok && e->n_tok < c->n &&
        kv_pool_block_refs(c->pc->pool, e->block) == 1)
        c->drop[c->n_drop++] = e;
    return true;
}

/* Frees the partial children that tok[0..n) makes redundant; true when a child holds all of
 * tok[0..n) already. mu held. */
static bool prune_covered(pool_cache *pc, const cache_key *ns, const cache_key *parent,
                          const int32_t *tok, int n) {
    cover c = {.pc = pc, .tok = tok, .n = n};
    each_child(pc, ns, parent, tok, visit_cover, &c);
    for (int i = 0; i < c.n_drop; i++) entry_free(pc, c.drop[i]);
    return c.covered;
}

void pool_cache_put(pool_cache *pc, const cache_key *key, const cache_key *ns,
                    const cache_key *parent, const int32_t *tokens, int32_t block) {
    pthread_mutex_lock(&pc->mu);
    pc_entry *e = find(pc, key);
    if (e && e->dead) {
        entry_free(pc, e); /* cleared, now stored again */
        e = NULL;
    }
    if (!e) {
        prune_covered(pc, ns, parent, tokens, pc->block_tokens);
        if ((e = entry_new(pc, ns, parent, tokens, pc->block_tokens, block))) {
            e->key = *key;
            e->node.key = e->key.b;
            keytable_insert(&pc->table, &e->node);
        }
    }
    pthread_mutex_unlock(&pc->mu);
}

void pool_cache_put_partial(pool_cache *pc, const cache_key *ns, const cache_key *parent,
                            const int32_t *tokens, int n, int32_t block) {
    if (n <= 0 || n >= pc->block_tokens) return;
    pthread_mutex_lock(&pc->mu);
    if (!prune_covered(pc, ns, parent, tokens, n)) {
        pc_entry *e = entry_new(pc, ns, parent, tokens, n, block);
        if (e) {
            e->partial = true;
            pc->st.partial++;
        }
    }
    pthread_mutex_unlock(&pc->mu);
}

/* The longest match among a parent's children so far. */
typedef struct best {
    const int32_t *tok;
    int n;
    pc_entry *e;
    int len;
} best;

static bool visit_best(void *ud, pc_entry *e) {
    best *b = ud;
    int l = common_prefix(e, b->tok, b->n);
    if (l > b->len) {
        b->len = l;
        b->e = e;
    }
    return b->len < b->n;
}

int pool_cache_match(pool_cache *pc, const cache_key *ns, const cache_key *parent,
                     const int32_t *tokens, int n, int32_t *block) {
    if (n <= 0) return 0;
    if (n > pc->block_tokens) n = pc->block_tokens;
    pthread_mutex_lock(&pc->mu);
    best b = {.tok = tokens, .n = n};
    each_child(pc, ns, parent, tokens, visit_best, &b);
    if (b.e) {
        touch(pc, b.e);
        *block = b.e->block;
        pc->st.partial_hits++;
    }
    pthread_mutex_unlock(&pc->mu);
    return b.len;
}

uint64_t pool_cache_clock(pool_cache *pc) {
    pthread_mutex_lock(&pc->mu);
    uint64_t c = pc->clock;
    pthread_mutex_unlock(&pc->mu);
    return c;
}

/* An entry frees its block only when nothing else references it. */
static bool evictable(const pool_cache *pc, const pc_entry *e, uint64_t keep_from) {
    return e->dead || (e->used < keep_from && kv_pool_block_refs(pc->pool, e->block) == 1);
}

int64_t pool_cache_make_room(pool_cache *pc, int64_t need_free, uint64_t keep_from) {
    pthread_mutex_lock(&pc->mu);
    /* Evicting is only worth it when it reaches need_free: otherwise the entries would go and
     * the caller would wait all the same. */
    int64_t could = kv_pool_free_blocks(pc->pool);
    for (lru_node *v = pc->lru.oldest; v && could < need_free; v = v->newer)
        could += evictable(pc, KT_ENTRY(v, pc_entry, lru), keep_from);
    lru_node *v = could >= need_free ? pc->lru.oldest : NULL;
    while (v && kv_pool_free_blocks(pc->pool) < need_free) {
        lru_node *next = v->newer;
        pc_entry *e = KT_ENTRY(v, pc_entry, lru);
        if (evictable(pc, e, keep_from)) {
            if (!e->dead) pc->st.evictions++;
            entry_free(pc, e);
        }
        v = next;
    }
    pthread_mutex_unlock(&pc->mu);
    return kv_pool_free_blocks(pc->pool);
}

int64_t pool_cache_idle_blocks(pool_cache *pc) {
    int64_t n = 0;
    pthread_mutex_lock(&pc->mu);
    for (lru_node *v = pc->lru.oldest; v; v = v->newer)
        n += kv_pool_block_refs(pc->pool, KT_ENTRY(v, pc_entry, lru)->block) == 1;
    pthread_mutex_unlock(&pc->mu);
    return n;
}

void pool_cache_reclaim(pool_cache *pc) {
    pthread_mutex_lock(&pc->mu);
    for (lru_node *v = pc->lru.oldest, *next; v && pc->n_dead > 0; v = next) {
        next = v->newer;
        pc_entry *e = KT_ENTRY(v, pc_entry, lru);
        if (e->dead) entry_free(pc, e);
    }
    pthread_mutex_unlock(&pc->mu);
}
