/* The device-pool tier: block entries in a keyed table with an LRU list (util/keytable.h)
 * under one mutex (held briefly; the engine thread is the only writer of the pool itself). */
#include "cache/store/pool_cache.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "util/keytable.h"

typedef struct pc_entry {
    kt_node node; /* keyed by key */
    lru_node lru;
    cache_key key;
    cache_key ns;
    bool dead;     /* cleared by another thread; block not yet released */
    uint64_t used; /* use stamp */
    int32_t block;
} pc_entry;

struct pool_cache {
    kv_pool *pool;
    pthread_mutex_t mu;
    keytable table;
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
    pc->pool = pool;
    pthread_mutex_init(&pc->mu, NULL);
    return pc;
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
    keytable_remove(&pc->table, &e->node);
    lru_unlink(&pc->lru, &e->lru);
    kv_pool_block_unref(pc->pool, e->block);
    if (e->dead) pc->n_dead--;
    pc->st.entries--;
    pc->st.blocks--;
    free(e);
}

void pool_cache_destroy(pool_cache *pc) {
    if (!pc) return;
    while (pc->lru.oldest) entry_free(pc, KT_ENTRY(pc->lru.oldest, pc_entry, lru));
    keytable_free(&pc->table);
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

void pool_cache_put(pool_cache *pc, const cache_key *key, const cache_key *ns, int32_t block) {
    pthread_mutex_lock(&pc->mu);
    pc_entry *e = find(pc, key);
    if (e && e->dead) {
        entry_free(pc, e); /* cleared, now stored again */
        e = NULL;
    }
    if (!e && (e = malloc(sizeof *e))) {
        *e = (pc_entry){.key = *key, .ns = *ns, .block = block};
        e->node.key = e->key.b;
        keytable_insert(&pc->table, &e->node);
        kv_pool_block_ref(pc->pool, block);
        touch(pc, e);
        pc->st.entries++;
        pc->st.blocks++;
    }
    pthread_mutex_unlock(&pc->mu);
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
