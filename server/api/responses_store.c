/* The Responses API's stored responses (responses.h): a keyed table and an LRU list
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
} resp_entry;

struct resp_store {
    pthread_mutex_t mu;
    keytable table;
    lru_list lru;
    int max_count;
    int64_t max_bytes;
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
    keytable_remove(&st->table, &e->node);
    lru_unlink(&st->lru, &e->lru);
    st->count--;
    st->bytes -= e->bytes;
    entry_free(e);
}

resp_store *resp_store_create(int max_count, int64_t max_bytes) {
    resp_store *st = calloc(1, sizeof *st);
    if (!st) return NULL;
    if (keytable_init(&st->table, SHA256_DIGEST_LENGTH)) {
        free(st);
        return NULL;
    }
    pthread_mutex_init(&st->mu, NULL);
    st->max_count = max_count;
    st->max_bytes = max_bytes;
    return st;
}

void resp_store_destroy(resp_store *st) {
    if (!st) return;
    while (st->lru.oldest) remove_locked(st, KT_ENTRY(st->lru.oldest, resp_entry, lru));
    keytable_free(&st->table);
    pthread_mutex_destroy(&st->mu);
    free(st);
}

int resp_store_put(resp_store *st, const cache_key *ns, const char *id, const char *response,
                   const char *conversation) {
    resp_entry *e = calloc(1, sizeof *e);
    if (!e) return -1;
    e->ns = *ns;
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
    keytable_insert(&st->table, &e->node);
    lru_touch(&st->lru, &e->lru);
    st->count++;
    st->bytes += e->bytes;
    /* the new entry is the newest: it fits alone, so it is never the one evicted */
    int64_t evicted = 0;
    while (st->count > st->max_count || st->bytes > st->max_bytes) {
        remove_locked(st, KT_ENTRY(st->lru.oldest, resp_entry, lru));
        evicted++;
    }
    st->evictions += evicted;
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
        lru_touch(&st->lru, &e->lru);
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
