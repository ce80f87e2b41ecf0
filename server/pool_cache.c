/* The device-pool tier: a chained hash table of chunk entries and an LRU list under one mutex
 * (held briefly; the engine thread is the only writer of the pool itself). */
#include "server/pool_cache.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

typedef struct pc_entry {
    cache_key key;
    cache_key ns;
    bool dead;     /* cleared by another thread; blocks not yet released */
    uint64_t used; /* use stamp */
    struct pc_entry *next_hash;
    struct pc_entry *lru_prev, *lru_next; /* prev: less recently used */
    int32_t blocks[];                     /* [chunk_blocks] */
} pc_entry;

struct pool_cache {
    kv_pool *pool;
    int chunk_blocks;
    pthread_mutex_t mu;
    pc_entry **buckets;
    size_t n_buckets; /* power of two */
    pc_entry *lru_head, *lru_tail;
    int64_t n_dead;
    uint64_t clock;
    pool_cache_stats st;
};

static size_t key_hash(const cache_key *k) {
    uint64_t h;
    memcpy(&h, k->b, sizeof h);
    return (size_t)h;
}

pool_cache *pool_cache_create(kv_pool *pool, int chunk_blocks) {
    pool_cache *pc = calloc(1, sizeof *pc);
    if (!pc) return NULL;
    pc->pool = pool;
    pc->chunk_blocks = chunk_blocks;
    /* Entries are bounded by the pool: one bucket per chunk the pool can hold. */
    int64_t max_entries = kv_pool_total_blocks(pool) / chunk_blocks + 1;
    pc->n_buckets = 16;
    while ((int64_t)pc->n_buckets < max_entries) pc->n_buckets *= 2;
    if (!(pc->buckets = calloc(pc->n_buckets, sizeof *pc->buckets))) {
        free(pc);
        return NULL;
    }
    pthread_mutex_init(&pc->mu, NULL);
    return pc;
}

static void lru_unlink(pool_cache *pc, pc_entry *e) {
    if (e->lru_prev)
        e->lru_prev->lru_next = e->lru_next;
    else
        pc->lru_head = e->lru_next;
    if (e->lru_next)
        e->lru_next->lru_prev = e->lru_prev;
    else
        pc->lru_tail = e->lru_prev;
    e->lru_prev = e->lru_next = NULL;
}

static void lru_push_tail(pool_cache *pc, pc_entry *e) {
    e->used = pc->clock++;
    e->lru_prev = pc->lru_tail;
    e->lru_next = NULL;
    if (pc->lru_tail)
        pc->lru_tail->lru_next = e;
    else
        pc->lru_head = e;
    pc->lru_tail = e;
}

static pc_entry **find_slot(pool_cache *pc, const cache_key *key) {
    pc_entry **p = &pc->buckets[key_hash(key) & (pc->n_buckets - 1)];
    while (*p && memcmp((*p)->key.b, key->b, CACHE_KEY_BYTES) != 0) p = &(*p)->next_hash;
    return p;
}

/* Removes e from the table and list and releases its blocks. Engine thread, mu held. */
static void entry_free(pool_cache *pc, pc_entry *e) {
    pc_entry **slot = find_slot(pc, &e->key);
    *slot = e->next_hash;
    lru_unlink(pc, e);
    for (int i = 0; i < pc->chunk_blocks; i++) kv_pool_block_unref(pc->pool, e->blocks[i]);
    if (e->dead) pc->n_dead--;
    pc->st.entries--;
    pc->st.blocks -= pc->chunk_blocks;
    free(e);
}

void pool_cache_destroy(pool_cache *pc) {
    if (!pc) return;
    while (pc->lru_head) entry_free(pc, pc->lru_head);
    free(pc->buckets);
    pthread_mutex_destroy(&pc->mu);
    free(pc);
}

bool pool_cache_has(pool_cache *pc, const cache_key *key) {
    pthread_mutex_lock(&pc->mu);
    pc_entry *e = *find_slot(pc, key);
    bool has = e && !e->dead;
    pthread_mutex_unlock(&pc->mu);
    return has;
}

int64_t pool_cache_clear(pool_cache *pc, const cache_key *ns) {
    int64_t n = 0;
    pthread_mutex_lock(&pc->mu);
    for (pc_entry *e = pc->lru_head; e; e = e->lru_next)
        if (!e->dead && (!ns || memcmp(e->ns.b, ns->b, CACHE_KEY_BYTES) == 0)) {
            e->dead = true;
            pc->n_dead++;
            n++;
        }
    pthread_mutex_unlock(&pc->mu);
    return n;
}

void pool_cache_stats_get(pool_cache *pc, pool_cache_stats *out) {
    pthread_mutex_lock(&pc->mu);
    *out = pc->st;
    out->entries -= pc->n_dead;
    pthread_mutex_unlock(&pc->mu);
}

const int32_t *pool_cache_get(pool_cache *pc, const cache_key *key) {
    pthread_mutex_lock(&pc->mu);
    pc_entry *e = *find_slot(pc, key);
    const int32_t *blocks = NULL;
    if (e && !e->dead) {
        lru_unlink(pc, e);
        lru_push_tail(pc, e);
        blocks = e->blocks;
        pc->st.hits++;
    } else {
        pc->st.misses++;
    }
    pthread_mutex_unlock(&pc->mu);
    return blocks;
}

bool pool_cache_touch(pool_cache *pc, const cache_key *key) {
    pthread_mutex_lock(&pc->mu);
    pc_entry *e = *find_slot(pc, key);
    bool held = e && !e->dead;
    if (held) {
        lru_unlink(pc, e);
        lru_push_tail(pc, e);
    }
    pthread_mutex_unlock(&pc->mu);
    return held;
}

void pool_cache_put(pool_cache *pc, const cache_key *key, const cache_key *ns,
                    const int32_t *blocks) {
    pthread_mutex_lock(&pc->mu);
    pc_entry **slot = find_slot(pc, key);
    if (*slot && (*slot)->dead) entry_free(pc, *slot); /* cleared, now stored again */
    slot = find_slot(pc, key);
    pc_entry *e = *slot ? NULL : malloc(sizeof *e + sizeof(int32_t) * (size_t)pc->chunk_blocks);
    if (e) {
        e->key = *key;
        e->ns = *ns;
        e->dead = false;
        memcpy(e->blocks, blocks, sizeof(int32_t) * (size_t)pc->chunk_blocks);
        for (int i = 0; i < pc->chunk_blocks; i++) kv_pool_block_ref(pc->pool, blocks[i]);
        e->next_hash = *slot;
        *slot = e;
        lru_push_tail(pc, e);
        pc->st.entries++;
        pc->st.blocks += pc->chunk_blocks;
    }
    pthread_mutex_unlock(&pc->mu);
}

/* An entry frees its blocks only when nothing else references them. */
static bool entry_idle(const pool_cache *pc, const pc_entry *e) {
    for (int i = 0; i < pc->chunk_blocks; i++)
        if (kv_pool_block_refs(pc->pool, e->blocks[i]) > 1) return false;
    return true;
}

uint64_t pool_cache_clock(pool_cache *pc) {
    pthread_mutex_lock(&pc->mu);
    uint64_t c = pc->clock;
    pthread_mutex_unlock(&pc->mu);
    return c;
}

static bool evictable(const pool_cache *pc, const pc_entry *e, uint64_t keep_from) {
    return e->dead || (e->used < keep_from && entry_idle(pc, e));
}

int64_t pool_cache_make_room(pool_cache *pc, int64_t need_free, uint64_t keep_from) {
    pthread_mutex_lock(&pc->mu);
    /* Evicting is only worth it when it reaches need_free: otherwise the entries would go and
     * the caller would wait all the same. */
    int64_t could = kv_pool_free_blocks(pc->pool);
    for (pc_entry *e = pc->lru_head; e && could < need_free; e = e->lru_next)
        if (evictable(pc, e, keep_from)) could += pc->chunk_blocks;
    pc_entry *e = could >= need_free ? pc->lru_head : NULL;
    while (e && kv_pool_free_blocks(pc->pool) < need_free) {
        pc_entry *next = e->lru_next;
        if (evictable(pc, e, keep_from)) {
            if (!e->dead) pc->st.evictions++;
            entry_free(pc, e);
        }
        e = next;
    }
    pthread_mutex_unlock(&pc->mu);
    return kv_pool_free_blocks(pc->pool);
}

int64_t pool_cache_idle_blocks(pool_cache *pc) {
    int64_t n = 0;
    pthread_mutex_lock(&pc->mu);
    for (pc_entry *e = pc->lru_head; e; e = e->lru_next)
        for (int i = 0; i < pc->chunk_blocks; i++)
            n += kv_pool_block_refs(pc->pool, e->blocks[i]) == 1;
    pthread_mutex_unlock(&pc->mu);
    return n;
}

void pool_cache_reclaim(pool_cache *pc) {
    pthread_mutex_lock(&pc->mu);
    for (pc_entry *e = pc->lru_head, *next; e && pc->n_dead > 0; e = next) {
        next = e->lru_next;
        if (e->dead) entry_free(pc, e);
    }
    pthread_mutex_unlock(&pc->mu);
}
