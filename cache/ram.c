/* The RAM tier: a chained hash table over chunk keys (keys are SHA-256, so their leading bytes
 * are already uniform) and a doubly linked LRU list, under one mutex. Eviction drops the
 * table's reference; a chunk still used by a request lives on until that request drops it. */
#include "cache/ram.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

typedef struct ram_entry {
    cache_chunk *c;
    bool pinned;
    struct ram_entry *next_hash;
    struct ram_entry *lru_prev, *lru_next; /* prev: less recently used */
} ram_entry;

struct cache_ram {
    pthread_mutex_t mu;
    ram_entry **buckets;
    size_t n_buckets;               /* power of two */
    ram_entry *lru_head, *lru_tail; /* head: least recently used */
    int64_t pinned_bytes;
    cache_tier_stats st;
};

static size_t key_hash(const cache_key *k) {
    uint64_t h;
    memcpy(&h, k->b, sizeof h);
    return (size_t)h;
}

cache_ram *cache_ram_create(int64_t cap_bytes) {
    cache_ram *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    r->n_buckets = 64;
    if (!(r->buckets = calloc(r->n_buckets, sizeof *r->buckets))) {
        free(r);
        return NULL;
    }
    pthread_mutex_init(&r->mu, NULL);
    r->st.capacity = cap_bytes;
    return r;
}

static void lru_unlink(cache_ram *r, ram_entry *e) {
    if (e->lru_prev)
        e->lru_prev->lru_next = e->lru_next;
    else
        r->lru_head = e->lru_next;
    if (e->lru_next)
        e->lru_next->lru_prev = e->lru_prev;
    else
        r->lru_tail = e->lru_prev;
    e->lru_prev = e->lru_next = NULL;
}

static void lru_push_tail(cache_ram *r, ram_entry *e) {
    e->lru_prev = r->lru_tail;
    e->lru_next = NULL;
    if (r->lru_tail)
        r->lru_tail->lru_next = e;
    else
        r->lru_head = e;
    r->lru_tail = e;
}

static ram_entry **find_slot(cache_ram *r, const cache_key *key) {
    ram_entry **p = &r->buckets[key_hash(key) & (r->n_buckets - 1)];
    while (*p && memcmp((*p)->c->key.b, key->b, CACHE_KEY_BYTES) != 0) p = &(*p)->next_hash;
    return p;
}

/* Unlinks the entry at *slot from the table and the list and frees it. */
static void remove_at(cache_ram *r, ram_entry **slot) {
    ram_entry *e = *slot;
    *slot = e->next_hash;
    lru_unlink(r, e);
    r->st.entries--;
    r->st.bytes -= (int64_t)e->c->bytes;
    if (e->pinned) {
        r->st.pinned--;
        r->pinned_bytes -= (int64_t)e->c->bytes;
    }
    cache_chunk_unref(e->c);
    free(e);
}

static void grow(cache_ram *r) {
    size_t n = r->n_buckets * 2;
    ram_entry **b = calloc(n, sizeof *b);
    if (!b) return; /* keep the smaller table: only slower */
    for (size_t i = 0; i < r->n_buckets; i++)
        for (ram_entry *e = r->buckets[i], *next; e; e = next) {
            next = e->next_hash;
            size_t h = key_hash(&e->c->key) & (n - 1);
            e->next_hash = b[h];
            b[h] = e;
        }
    free(r->buckets);
    r->buckets = b;
    r->n_buckets = n;
}

void cache_ram_destroy(cache_ram *r) {
    if (!r) return;
    for (size_t i = 0; i < r->n_buckets; i++)
        while (r->buckets[i]) remove_at(r, &r->buckets[i]);
    free(r->buckets);
    pthread_mutex_destroy(&r->mu);
    free(r);
}

cache_chunk *cache_ram_get(cache_ram *r, const cache_key *key) {
    pthread_mutex_lock(&r->mu);
    ram_entry *e = *find_slot(r, key);
    cache_chunk *c = NULL;
    if (e) {
        c = e->c;
        cache_chunk_ref(c);
        lru_unlink(r, e);
        lru_push_tail(r, e);
        r->st.hits++;
        r->st.bytes_out += (int64_t)c->bytes;
    } else {
        r->st.misses++;
    }
    pthread_mutex_unlock(&r->mu);
    return c;
}

bool cache_ram_contains(cache_ram *r, const cache_key *key) {
    pthread_mutex_lock(&r->mu);
    bool found = *find_slot(r, key) != NULL;
    pthread_mutex_unlock(&r->mu);
    return found;
}

bool cache_ram_put(cache_ram *r, cache_chunk *c) {
    pthread_mutex_lock(&r->mu);
    bool ok = false;
    /* Nothing is evicted for a chunk that could not fit beside the pinned ones. */
    if (r->pinned_bytes + (int64_t)c->bytes > r->st.capacity || *find_slot(r, &c->key)) goto out;
    /* Make room first: least recently used unpinned chunks go. */
    ram_entry *v = r->lru_head;
    while (v && r->st.bytes + (int64_t)c->bytes > r->st.capacity) {
        ram_entry *next = v->lru_next;
        if (!v->pinned) {
            remove_at(r, find_slot(r, &v->c->key));
            r->st.evictions++;
        }
        v = next;
    }
    if (r->st.bytes + (int64_t)c->bytes > r->st.capacity) goto out; /* held by pins */
    ram_entry *e = calloc(1, sizeof *e);
    if (!e) goto out;
    if ((size_t)r->st.entries >= r->n_buckets) grow(r);
    ram_entry **slot = find_slot(r, &c->key);
    cache_chunk_ref(c);
    e->c = c;
    e->next_hash = *slot;
    *slot = e;
    lru_push_tail(r, e);
    r->st.entries++;
    r->st.bytes += (int64_t)c->bytes;
    r->st.bytes_in += (int64_t)c->bytes;
    ok = true;
out:
    pthread_mutex_unlock(&r->mu);
    return ok;
}

int cache_ram_pin(cache_ram *r, const cache_key *keys, int n, bool pin) {
    int held = 0;
    pthread_mutex_lock(&r->mu);
    for (int i = 0; i < n; i++) {
        ram_entry *e = *find_slot(r, &keys[i]);
        if (!e) continue;
        int64_t b = (int64_t)e->c->bytes;
        if (pin && !e->pinned && r->pinned_bytes + b > r->st.capacity / 2) continue;
        held++;
        if (e->pinned != pin) {
            r->st.pinned += pin ? 1 : -1;
            r->pinned_bytes += pin ? b : -b;
        }
        e->pinned = pin;
    }
    pthread_mutex_unlock(&r->mu);
    return held;
}

int64_t cache_ram_clear(cache_ram *r, const cache_key *ns) {
    int64_t n = 0;
    pthread_mutex_lock(&r->mu);
    for (size_t i = 0; i < r->n_buckets; i++) {
        ram_entry **p = &r->buckets[i];
        while (*p) {
            if (!ns || memcmp((*p)->c->ns.b, ns->b, CACHE_KEY_BYTES) == 0) {
                remove_at(r, p);
                n++;
            } else {
                p = &(*p)->next_hash;
            }
        }
    }
    pthread_mutex_unlock(&r->mu);
    return n;
}

void cache_ram_stats(cache_ram *r, cache_tier_stats *out) {
    pthread_mutex_lock(&r->mu);
    *out = r->st;
    pthread_mutex_unlock(&r->mu);
}
