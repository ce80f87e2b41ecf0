/* Content records and their RAM tier (cache/store/content.h): a record's allocation and
 * reference count, and the content store, records by content key under a byte cap, least
 * recently used evicted first. A record's disk reader (content_rec.src) is content_disk.c's:
 * the last reference hands it back there (content_src_free). */
#include "cache/store/content.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "util/keytable.h"

/* ---------------------------------------------------------------- records */

content_rec *content_rec_create(int n_layer, int kv_dim, int n_tok, const cache_key *key,
                                const cache_key *ns, int32_t pos0) {
    if (n_layer < 1 || kv_dim < 1 || n_tok < 1) return NULL;
    content_rec *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    r->bytes = sizeof(uint16_t) * 2 * (size_t)n_layer * (size_t)n_tok * (size_t)kv_dim;
    if (!(r->data = malloc(r->bytes))) {
        free(r);
        return NULL;
    }
    r->key = *key;
    r->ns = *ns;
    r->pos0 = pos0;
    r->n_tok = n_tok;
    r->n_layer = n_layer;
    r->kv_dim = kv_dim;
    atomic_init(&r->refs, 1);
    return r;
}

void content_rec_ref(content_rec *r) { atomic_fetch_add(&r->refs, 1); }

void content_rec_unref(content_rec *r) {
    if (!r || atomic_fetch_sub(&r->refs, 1) != 1) return;
    content_src_free(r->src);
    free(r->data);
    free(r);
}

const uint16_t *content_rec_rows(const content_rec *r, int layer, int kv) {
    return r->data + ((size_t)layer * 2 + (size_t)kv) * (size_t)r->n_tok * (size_t)r->kv_dim;
}

/* ---------------------------------------------------------------- the store */

typedef struct content_entry {
    kt_node node;
    lru_node lru;
    content_rec *r;
} content_entry;

struct content_store {
    pthread_mutex_t mu;
    keytable table;
    lru_list lru;
    cache_tier_stats st;
};

content_store *content_store_create(int64_t cap_bytes) {
    content_store *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    if (keytable_init(&s->table, CACHE_KEY_BYTES)) {
        free(s);
        return NULL;
    }
    pthread_mutex_init(&s->mu, NULL);
    s->st.capacity = cap_bytes;
    return s;
}

static void entry_remove(content_store *s, content_entry *e) {
    keytable_remove(&s->table, &e->node);
    lru_unlink(&s->lru, &e->lru);
    s->st.entries--;
    s->st.bytes -= (int64_t)e->r->bytes;
    content_rec_unref(e->r);
    free(e);
}

void content_store_destroy(content_store *s) {
    if (!s) return;
    while (s->lru.oldest) entry_remove(s, KT_ENTRY(s->lru.oldest, content_entry, lru));
    keytable_free(&s->table);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

static content_entry *find(content_store *s, const cache_key *key) {
    kt_node *n = keytable_find(&s->table, key->b);
    return n ? KT_ENTRY(n, content_entry, node) : NULL;
}

content_rec *content_store_get(content_store *s, const cache_key *key) {
    pthread_mutex_lock(&s->mu);
    content_entry *e = find(s, key);
    content_rec *r = NULL;
    if (e) {
        r = e->r;
        content_rec_ref(r);
        lru_touch(&s->lru, &e->lru);
        s->st.hits++;
        s->st.bytes_out += (int64_t)r->bytes;
    } else {
        s->st.misses++;
    }
    pthread_mutex_unlock(&s->mu);
    return r;
}

bool content_store_has(content_store *s, const cache_key *key) {
    pthread_mutex_lock(&s->mu);
    bool held = find(s, key) != NULL;
    pthread_mutex_unlock(&s->mu);
    return held;
}

void content_store_put(content_store *s, content_rec *r) {
    pthread_mutex_lock(&s->mu);
    /* a record still being read from disk is not shared until it is whole (settled) */
    if (r->src || (int64_t)r->bytes > s->st.capacity || find(s, &r->key)) goto out;
    while (s->lru.oldest && s->st.bytes + (int64_t)r->bytes > s->st.capacity) {
        entry_remove(s, KT_ENTRY(s->lru.oldest, content_entry, lru));
        s->st.evictions++;
    }
    content_entry *e = calloc(1, sizeof *e);
    if (!e) goto out;
    content_rec_ref(r);
    e->r = r;
    e->node.key = r->key.b;
    keytable_insert(&s->table, &e->node);
    lru_touch(&s->lru, &e->lru);
    s->st.entries++;
    s->st.bytes += (int64_t)r->bytes;
    s->st.bytes_in += (int64_t)r->bytes;
out:
    pthread_mutex_unlock(&s->mu);
}

int64_t content_store_clear(content_store *s, const cache_key *ns) {
    int64_t n = 0;
    pthread_mutex_lock(&s->mu);
    for (lru_node *v = s->lru.oldest, *next; v; v = next) {
        next = v->newer;
        content_entry *e = KT_ENTRY(v, content_entry, lru);
        if (!ns || memcmp(e->r->ns.b, ns->b, CACHE_KEY_BYTES) == 0) {
            entry_remove(s, e);
            n++;
        }
    }
    pthread_mutex_unlock(&s->mu);
    return n;
}

void content_store_stats(content_store *s, cache_tier_stats *out) {
    pthread_mutex_lock(&s->mu);
    *out = s->st;
    pthread_mutex_unlock(&s->mu);
}
