/* The Responses API's stored responses (responses.h): a keyed table and an LRU list per tenant
 * (util/keytable.h) under one mutex. An entry is found by SHA-256(namespace, id), then checked
 * against both, so ids are any client string and a key from one namespace never finds another's
 * entry. Sizes count the JSON texts and the entry itself: the bound is on memory held. */
#include <openssl/sha.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "server/api/responses.h"
#include "util/keytable.h"
#include "util/util.h"

typedef struct resp_entry {
    kt_node node;
    lru_node lru;
    uint8_t key[SHA256_DIGEST_LENGTH];
    cache_key ns;
    char *id, *response, *conversation;
    int64_t bytes;
    int tenant; /* whose LRU list it is on */
} resp_entry;

/* A tenant's entries, oldest first, and what they hold. */
typedef struct resp_tenant {
    lru_list lru;
    resp_store_stats st;
} resp_tenant;

struct resp_store {
    pthread_mutex_t mu;
    keytable table;
    resp_tenant *tenants; /* [n_tenants] */
    int n_tenants;
    int max_count;
    int64_t max_bytes;
    int64_t share_count, share_bytes; /* what each tenant keeps for sure */
    int64_t count, bytes, evictions;
};

/* SHA-256(namespace, id); false when out of memory. */
static bool entry_key(const cache_key *ns, const char *id, uint8_t out[SHA256_DIGEST_LENGTH]) {
    size_t n = strlen(id);
    unsigned char *b = malloc(CACHE_KEY_BYTES + n);
    if (!b) return false;
    memcpy(b, ns->b, CACHE_KEY_BYTES);
    memcpy(b + CACHE_KEY_BYTES, id, n);
    SHA256(b, CACHE_KEY_BYTES + n, out);
    free(b);
    return true;
}

static void entry_free(resp_entry *e) {
    if (!e) return;
    free(e->id);
    free(e->response);
    free(e->conversation);
    free(e);
}

/* The entry of (ns, id), under mu. */
static resp_entry *find_locked(resp_store *st, const cache_key *ns, const char *id) {
    uint8_t key[SHA256_DIGEST_LENGTH];
    if (!entry_key(ns, id, key)) return NULL;
    for (kt_node *n = keytable_find(&st->table, key); n; n = keytable_find_next(&st->table, n)) {
        resp_entry *e = KT_ENTRY(n, resp_entry, node);
        if (memcmp(e->ns.b, ns->b, CACHE_KEY_BYTES) == 0 && strcmp(e->id, id) == 0) return e;
    }
    return NULL;
}

static void remove_locked(resp_store *st, resp_entry *e) {
    resp_tenant *t = &st->tenants[e->tenant];
    keytable_remove(&st->table, &e->node);
    lru_unlink(&t->lru, &e->lru);
    st->count--;
    st->bytes -= e->bytes;
    t->st.count--;
    t->st.bytes -= e->bytes;
    entry_free(e);
}

resp_store *resp_store_create(int max_count, int64_t max_bytes, int n_tenants, int share_pct) {
    resp_store *st = calloc(1, sizeof *st);
    if (!st) return NULL;
    st->n_tenants = n_tenants > 1 ? n_tenants : 1;
    if (!(st->tenants = calloc((size_t)st->n_tenants, sizeof *st->tenants)) ||
        keytable_init(&st->table, SHA256_DIGEST_LENGTH)) {
        free(st->tenants);
        free(st);
        return NULL;
    }
    pthread_mutex_init(&st->mu, NULL);
    st->max_count = max_count;
    st->max_bytes = max_bytes;
    st->share_count = kv_tenant_share(max_count, share_pct, st->n_tenants, 1);
    st->share_bytes = kv_tenant_share(max_bytes, share_pct, st->n_tenants, 1);
    return st;
}

void resp_store_destroy(resp_store *st) {
    if (!st) return;
    for (int t = 0; t < st->n_tenants; t++)
        while (st->tenants[t].lru.oldest)
            remove_locked(st, KT_ENTRY(st->tenants[t].lru.oldest, resp_entry, lru));
    free(st->tenants);
    keytable_free(&st->table);
    pthread_mutex_destroy(&st->mu);
    free(st);
}

/* How far tenant t is over its share: the larger of its entries and its bytes over what the
 * share keeps (> 1: over it). */
static double over_share(const resp_store *st, const resp_tenant *t) {
    double c = (double)t->st.count / (double)st->share_count;
    double b = (double)t->st.bytes / (double)st->share_bytes;
    return c > b ? c : b;
}

/* Makes the store fit its bounds again after e went in: the oldest entries of the tenant
 * furthest over its share go first (e itself never: it fits alone). Returns how many went. */
static int64_t evict_locked(resp_store *st, const resp_entry *e) {
    int64_t evicted = 0;
    while (st->count > st->max_count || st->bytes > st->max_bytes) {
        resp_tenant *victim = NULL;
        for (int k = 0; k < st->n_tenants; k++) {
            resp_tenant *t = &st->tenants[k];
            lru_node *oldest = t->lru.oldest;
            if (!oldest || oldest == &e->lru) continue;
            if (!victim || over_share(st, t) > over_share(st, victim)) victim = t;
        }
        if (!victim) break; /* e alone: within the bounds */
        victim->st.evictions++;
        remove_locked(st, KT_ENTRY(victim->lru.oldest, resp_entry, lru));
        evicted++;
    }
    st->evictions += evicted;
    return evicted;
}

int resp_store_put(resp_store *st, int tenant, const cache_key *ns, const char *id,
                   const char *response, const char *conversation) {
    resp_entry *e = calloc(1, sizeof *e);
    if (!e) return -1;
    e->ns = *ns;
    e->tenant = tenant >= 0 && tenant < st->n_tenants ? tenant : 0;
    e->id = strdup(id);
    e->response = strdup(response);
    e->conversation = strdup(conversation);
    if (!e->id || !e->response || !e->conversation) {
        entry_free(e);
        return -1;
    }
    e->bytes = (int64_t)(sizeof *e + strlen(id) + strlen(response) + strlen(conversation) + 3);
    if (e->bytes > st->max_bytes) {
        entry_free(e);
        return 1;
    }
    if (!entry_key(ns, id, e->key)) {
        entry_free(e);
        return -1;
    }
    e->node.key = e->key;
    pthread_mutex_lock(&st->mu);
    resp_entry *old = find_locked(st, ns, id);
    if (old) remove_locked(st, old);
    resp_tenant *t = &st->tenants[e->tenant];
    keytable_insert(&st->table, &e->node);
    lru_touch(&t->lru, &e->lru);
    st->count++;
    st->bytes += e->bytes;
    t->st.count++;
    t->st.bytes += e->bytes;
    int64_t evicted = evict_locked(st, e);
    pthread_mutex_unlock(&st->mu);
    if (evicted > 0)
        log_debug("responses: %lld stored responses evicted (--responses-store %d, "
                  "--responses-store-bytes %lld)",
                  (long long)evicted, st->max_count, (long long)st->max_bytes);
    return 0;
}

bool resp_store_get(resp_store *st, const cache_key *ns, const char *id, char **response,
                    char **conversation) {
    if (response) *response = NULL;
    if (conversation) *conversation = NULL;
    pthread_mutex_lock(&st->mu);
    resp_entry *e = find_locked(st, ns, id);
    bool ok = e != NULL;
    if (e) {
        lru_touch(&st->tenants[e->tenant].lru, &e->lru);
        if (response && !(*response = strdup(e->response))) ok = false;
        if (conversation && !(*conversation = strdup(e->conversation))) ok = false;
    }
    pthread_mutex_unlock(&st->mu);
    if (!ok) {
        if (response) free(*response), *response = NULL;
        if (conversation) free(*conversation), *conversation = NULL;
    }
    return ok;
}

bool resp_store_delete(resp_store *st, const cache_key *ns, const char *id) {
    pthread_mutex_lock(&st->mu);
    resp_entry *e = find_locked(st, ns, id);
    if (e) remove_locked(st, e);
    pthread_mutex_unlock(&st->mu);
    return e != NULL;
}

void resp_store_stats_get(resp_store *st, resp_store_stats *out) {
    pthread_mutex_lock(&st->mu);
    *out = (resp_store_stats){st->count, st->bytes, st->evictions};
    pthread_mutex_unlock(&st->mu);
}

void resp_store_tenant_stats(resp_store *st, int t, resp_store_stats *out) {
    *out = (resp_store_stats){0};
    pthread_mutex_lock(&st->mu);
    if (t >= 0 && t < st->n_tenants) *out = st->tenants[t].st;
    pthread_mutex_unlock(&st->mu);
}
