/* The RAM tier: chunk records in two keyed tables (util/keytable.h), by their own key and by
 * each of their blocks' keys, and an LRU list, under one mutex. Eviction drops the table's
 * reference; a chunk still used by a request lives on until that request drops it. */
#include "cache/store/ram.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "cache/store/pins.h"
#include "util/keytable.h"

struct ram_entry;

typedef struct ram_block {
    kt_node node; /* in blocks, keyed by the block's key */
    struct ram_entry *e;
} ram_block;

typedef struct ram_entry {
    kt_node by_key; /* in records, keyed by c->key */
    lru_node lru;
    cache_chunk *c;
    /* Kept from eviction (and counted in pins) while it has a reason: a pin until
     * unpinned (manual) or a lease until a time (Unix seconds, 0: none). */
    bool pinned, manual;
    int64_t lease;
    int tenant;           /* whose pin reasons they are (counted in its pinned bytes) */
    ram_block by_block[]; /* [c->n_blocks]: block i keyed by c->bkeys[i] */
} ram_entry;

struct cache_ram {
    pthread_mutex_t mu;
    keytable records; /* record key -> entry */
    keytable blocks;  /* block key -> entry (several entries may hold one block) */
    lru_list lru;
    pin_ledger pins;     /* pinned bytes, in all and per tenant */
    int64_t pin_limit;   /* pinned bytes at most beside half the capacity (0: none) */
    int64_t next_expiry; /* no lease ends before this (0: no lease) */
    cache_tier_stats st;
};

cache_ram *cache_ram_create(int64_t cap_bytes) {
    cache_ram *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    if (keytable_init(&r->records, CACHE_KEY_BYTES) || keytable_init(&r->blocks, CACHE_KEY_BYTES)) {
        keytable_free(&r->records);
        keytable_free(&r->blocks);
        free(r);
        return NULL;
    }
    pthread_mutex_init(&r->mu, NULL);
    r->st.capacity = cap_bytes;
    return r;
}

static ram_entry *find_record(const cache_ram *r, const cache_key *key) {
    kt_node *n = keytable_find(&r->records, key->b);
    return n ? KT_ENTRY(n, ram_entry, by_key) : NULL;
}

/* Pinned chunks may fill at most half the capacity, so unpinned traffic always has room, and at
 * most the pin limit. */
static int64_t pin_cap(const cache_ram *r) {
    int64_t half = r->st.capacity / 2;
    return r->pin_limit > 0 && r->pin_limit < half ? r->pin_limit : half;
}

/* Gives e these pin reasons (manual, a lease until `lease`, 0: none), for tenant t when it had
 * none, keeping it from eviction while it has one. PIN_OK, or why not (e unchanged) when that
 * would take the pinned bytes over the cap or the tenant's share of it. */
static pin_verdict entry_hold(cache_ram *r, ram_entry *e, int t, bool manual, int64_t lease) {
    bool held = manual || lease > 0;
    int64_t b = (int64_t)e->c->bytes;
    if (held) {
        pin_verdict v = pin_ledger_hold(&r->pins, &e->tenant, e->pinned, t, b, pin_cap(r));
        if (v != PIN_OK) return v;
    } else if (e->pinned) {
        pin_ledger_add(&r->pins, e->tenant, -b);
    }
    if (held != e->pinned) r->st.pinned += held ? 1 : -1;
    e->pinned = held;
    e->manual = manual;
    e->lease = lease;
    if (lease > 0 && (r->next_expiry == 0 || lease < r->next_expiry)) r->next_expiry = lease;
    return PIN_OK;
}

/* Unlinks e from the tables and the list and frees it. */
static void entry_remove(cache_ram *r, ram_entry *e) {
    keytable_remove(&r->records, &e->by_key);
    for (int i = 0; i < e->c->n_blocks; i++) keytable_remove(&r->blocks, &e->by_block[i].node);
    lru_unlink(&r->lru, &e->lru);
    r->st.entries--;
    r->st.bytes -= (int64_t)e->c->bytes;
    if (e->pinned) {
        r->st.pinned--;
        pin_ledger_add(&r->pins, e->tenant, -(int64_t)e->c->bytes);
    }
    cache_chunk_unref(e->c);
    free(e);
}

void cache_ram_destroy(cache_ram *r) {
    if (!r) return;
    while (r->lru.oldest) entry_remove(r, KT_ENTRY(r->lru.oldest, ram_entry, lru));
    keytable_free(&r->records);
    keytable_free(&r->blocks);
    pin_ledger_free(&r->pins);
    pthread_mutex_destroy(&r->mu);
    free(r);
}

cache_chunk *cache_ram_find(cache_ram *r, const cache_key *bkey, int *block) {
    return cache_ram_find_as(r, bkey, false, block);
}

cache_chunk *cache_ram_find_as(cache_ram *r, const cache_key *bkey, bool lossless, int *block) {
    pthread_mutex_lock(&r->mu);
    kt_node *n = keytable_find(&r->blocks, bkey->b);
    cache_chunk *c = NULL;
    if (n && (!lossless || KT_ENTRY(n, ram_block, node)->e->c->enc == CACHE_ENC_RAW)) {
        ram_block *b = KT_ENTRY(n, ram_block, node);
        ram_entry *e = b->e;
        *block = (int)(b - e->by_block);
        c = e->c;
        cache_chunk_ref(c);
        lru_touch(&r->lru, &e->lru);
        r->st.hits++;
        r->st.bytes_out += (int64_t)c->bytes;
    }
    pthread_mutex_unlock(&r->mu);
    return c;
}

bool cache_ram_holds(cache_ram *r, const cache_key *bkey) {
    pthread_mutex_lock(&r->mu);
    bool found = keytable_find(&r->blocks, bkey->b) != NULL;
    pthread_mutex_unlock(&r->mu);
    return found;
}

void cache_ram_count_miss(cache_ram *r) {
    pthread_mutex_lock(&r->mu);
    r->st.misses++;
    pthread_mutex_unlock(&r->mu);
}

bool cache_ram_contains(cache_ram *r, const cache_key *key) {
    pthread_mutex_lock(&r->mu);
    bool found = find_record(r, key) != NULL;
    pthread_mutex_unlock(&r->mu);
    return found;
}

bool cache_ram_put(cache_ram *r, cache_chunk *c) {
    pthread_mutex_lock(&r->mu);
    bool ok = false;
    /* Nothing is evicted for a chunk that could not fit beside the pinned ones, nor for one
     * whose blocks a record holds already (the same record, or a longer one of its chunk). */
    if (r->pins.total + (int64_t)c->bytes > r->st.capacity || keytable_find(&r->blocks, c->key.b))
        goto out;
    /* Records of this chunk that end at one of c's blocks hold a prefix of c: c replaces them
     * (and keeps the pins and the latest lease they had). */
    bool manual = false;
    int64_t lease = 0;
    int tenant = CACHE_TENANT_NONE; /* theirs: a chunk's records share its namespace's tenant */
    for (int i = 0; i < c->n_blocks - 1; i++) {
        ram_entry *old = find_record(r, &c->bkeys[i]);
        if (!old) continue;
        if (old->pinned) tenant = old->tenant;
        manual |= old->manual;
        if (old->lease > lease) lease = old->lease;
        entry_remove(r, old);
    }
    /* Make room first: least recently used unpinned chunks go. */
    for (lru_node *v = r->lru.oldest; v && r->st.bytes + (int64_t)c->bytes > r->st.capacity;) {
        lru_node *next = v->newer;
        ram_entry *e = KT_ENTRY(v, ram_entry, lru);
        if (!e->pinned) {
            entry_remove(r, e);
            r->st.evictions++;
        }
        v = next;
    }
    if (r->st.bytes + (int64_t)c->bytes > r->st.capacity) goto out; /* held by pins */
    ram_entry *e = calloc(1, sizeof *e + sizeof(ram_block) * (size_t)c->n_blocks);
    if (!e) goto out;
    cache_chunk_ref(c);
    e->c = c;
    e->by_key.key = c->key.b;
    keytable_insert(&r->records, &e->by_key);
    for (int i = 0; i < c->n_blocks; i++) {
        e->by_block[i] = (ram_block){.node.key = c->bkeys[i].b, .e = e};
        keytable_insert(&r->blocks, &e->by_block[i].node);
    }
    lru_touch(&r->lru, &e->lru);
    r->st.entries++;
    r->st.bytes += (int64_t)c->bytes;
    r->st.bytes_in += (int64_t)c->bytes;
    entry_hold(r, e, tenant, manual, lease); /* as far as the cap and the share allow */
    ok = true;
out:
    pthread_mutex_unlock(&r->mu);
    return ok;
}

bool cache_ram_has(cache_ram *r, const cache_chunk *c) {
    pthread_mutex_lock(&r->mu);
    ram_entry *e = find_record(r, &c->key);
    bool held = e && e->c == c;
    pthread_mutex_unlock(&r->mu);
    return held;
}

bool cache_ram_swap(cache_ram *r, const cache_chunk *old, cache_chunk *c) {
    pthread_mutex_lock(&r->mu);
    ram_entry *e = find_record(r, &old->key);
    bool ok = e && e->c == old && c->n_blocks == old->n_blocks &&
              memcmp(c->bkeys, old->bkeys, sizeof(cache_key) * (size_t)c->n_blocks) == 0;
    if (ok) {
        int64_t delta = (int64_t)c->bytes - (int64_t)old->bytes;
        r->st.bytes += delta;
        if (e->pinned) pin_ledger_add(&r->pins, e->tenant, delta);
        cache_chunk_ref(c);
        cache_chunk_unref(e->c);
        e->c = c;
        /* the tables key the entry by its chunk's keys: the same, now in c */
        e->by_key.key = c->key.b;
        for (int i = 0; i < c->n_blocks; i++) e->by_block[i].node.key = c->bkeys[i].b;
    }
    pthread_mutex_unlock(&r->mu);
    return ok;
}

/* The bytes pinning keys for tenant t would add to t's (records held and not t's yet). */
static int64_t pin_need(const cache_ram *r, int t, const cache_key *keys, int n) {
    int64_t need = 0;
    for (int i = 0; i < n; i++) {
        const ram_entry *e = find_record(r, &keys[i]);
        if (e) need += pin_ledger_need(&r->pins, e->tenant, e->pinned, t, (int64_t)e->c->bytes);
    }
    return need;
}

int cache_ram_pin(cache_ram *r, int tenant, const cache_key *keys, int n, bool pin, int64_t until) {
    int held = 0;
    pthread_mutex_lock(&r->mu);
    /* a tenant's share takes the whole call or none of it; the cap, as far as it goes */
    if (pin && pin_ledger_over_share(&r->pins, tenant, pin_need(r, tenant, keys, n), pin_cap(r)))
        held = -1;
    for (int i = 0; i < n && held >= 0; i++) {
        ram_entry *e = find_record(r, &keys[i]);
        if (!e) continue;
        /* with until, a lease instead of a pin (the pin, if any, stays as it was) */
        bool manual = until > 0 ? e->manual : pin;
        int64_t lease = pin && until > e->lease ? until : e->lease;
        if (entry_hold(r, e, tenant, manual, lease) == PIN_OK) held++;
    }
    pthread_mutex_unlock(&r->mu);
    return held;
}

int64_t cache_ram_clear(cache_ram *r, const cache_key *ns) {
    int64_t n = 0;
    pthread_mutex_lock(&r->mu);
    for (lru_node *v = r->lru.oldest, *next; v; v = next) {
        next = v->newer;
        ram_entry *e = KT_ENTRY(v, ram_entry, lru);
        if (!ns || memcmp(e->c->ns.b, ns->b, CACHE_KEY_BYTES) == 0) {
            entry_remove(r, e);
            n++;
        }
    }
    pthread_mutex_unlock(&r->mu);
    return n;
}

int cache_ram_set_pin_limit(cache_ram *r, int64_t bytes, int n_tenants, int share_pct) {
    pthread_mutex_lock(&r->mu);
    r->pin_limit = bytes;
    int rc = pin_ledger_tenants(&r->pins, n_tenants, share_pct);
    pthread_mutex_unlock(&r->mu);
    return rc;
}

void cache_ram_tenant_pins(cache_ram *r, int t, int64_t *bytes, int64_t *share) {
    pthread_mutex_lock(&r->mu);
    *bytes = pin_ledger_of(&r->pins, t);
    *share = pin_ledger_share(&r->pins, pin_cap(r));
    pthread_mutex_unlock(&r->mu);
}

bool cache_ram_lease(cache_ram *r, int tenant, const cache_key *bkey, int64_t until) {
    pthread_mutex_lock(&r->mu);
    kt_node *n = keytable_find(&r->blocks, bkey->b);
    ram_entry *e = n ? KT_ENTRY(n, ram_block, node)->e : NULL;
    bool ok =
        e && entry_hold(r, e, tenant, e->manual, until > e->lease ? until : e->lease) == PIN_OK;
    pthread_mutex_unlock(&r->mu);
    return ok;
}

int cache_ram_expire(cache_ram *r, int64_t now) {
    int n = 0;
    pthread_mutex_lock(&r->mu);
    if (r->next_expiry > 0 && r->next_expiry <= now) {
        int64_t next = 0;
        for (lru_node *v = r->lru.oldest; v; v = v->newer) {
            ram_entry *e = KT_ENTRY(v, ram_entry, lru);
            if (e->lease > 0 && e->lease <= now) {
                entry_hold(r, e, e->tenant, e->manual, 0); /* taking a reason away never fails */
                n++;
            } else if (e->lease > 0 && (next == 0 || e->lease < next)) {
                next = e->lease;
            }
        }
        r->next_expiry = next;
    }
    pthread_mutex_unlock(&r->mu);
    return n;
}

int cache_ram_pins(cache_ram *r, cache_pin_info *out, int max) {
    int n = 0;
    pthread_mutex_lock(&r->mu);
    for (lru_node *v = r->lru.oldest; v; v = v->newer) {
        const ram_entry *e = KT_ENTRY(v, ram_entry, lru);
        if (!e->pinned) continue;
        if (n < max)
            out[n] = (cache_pin_info){.key = e->c->key,
                                      .ns = e->c->ns,
                                      .n_blocks = e->c->n_blocks,
                                      .manual = e->manual,
                                      .lease = e->lease,
                                      .ram = true};
        n++;
    }
    pthread_mutex_unlock(&r->mu);
    return n;
}

void cache_ram_stats(cache_ram *r, cache_tier_stats *out) {
    pthread_mutex_lock(&r->mu);
    *out = r->st;
    pthread_mutex_unlock(&r->mu);
}
