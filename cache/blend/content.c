/* Content-defined chunks over token ids and the content store (cache/blend/blend.h). */
#include "cache/blend/blend.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "util/keytable.h"

/* ---------------------------------------------------------------- chunking */

uint8_t *cache_token_kinds(const tokenizer *t) {
    int n = tokenizer_n_vocab(t);
    uint8_t *kinds = calloc((size_t)n, 1);
    if (!kinds) return NULL;
    char buf[256];
    for (int32_t id = 0; id < n; id++) {
        /* control tokens decode to nothing unless rendered */
        int len = tokenizer_token_bytes(t, id, false, buf, sizeof buf);
        if (len == 0 && tokenizer_token_bytes(t, id, true, buf, sizeof buf) > 0)
            kinds[id] = CACHE_TOKEN_HARD;
        else if (len > 0 && memchr(buf, '\n', len < (int)sizeof buf ? (size_t)len : sizeof buf))
            kinds[id] = CACHE_TOKEN_SOFT;
    }
    return kinds;
}

/* splitmix64's finaliser: the gear value of a token id. */
static uint64_t gear(uint32_t id) {
    uint64_t z = (uint64_t)id + 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

int cache_cdc_cut(const int32_t *tokens, int n, const uint8_t *kinds, int n_vocab,
                  const cache_cdc_params *p, const int *bounds, int n_bounds, int *ends,
                  int max_ends) {
    int gap = p->avg_tokens - p->min_tokens;
    int bits = 0;
    while (bits < 32 && (1 << (bits + 1)) <= gap) bits++;
    int n_ends = 0, start = 0, nb = 0;
    uint64_t h = 0;
    for (int i = 0; i < n && n_ends < max_ends; i++) {
        while (nb < n_bounds && bounds[nb] < i) nb++;
        if (nb < n_bounds && bounds[nb] == i) { /* a segment starts here */
            if (i > start) {
                ends[n_ends++] = i;
                if (n_ends == max_ends) return n_ends;
                start = i;
            }
            h = 0;
        }
        int32_t id = tokens[i];
        uint8_t kind = kinds && id >= 0 && id < n_vocab ? kinds[id] : CACHE_TOKEN_PLAIN;
        if (kind == CACHE_TOKEN_HARD) {
            if (i > start) {
                ends[n_ends++] = i;
                if (n_ends == max_ends) return n_ends;
            }
            ends[n_ends++] = i + 1;
            start = i + 1;
            h = 0;
            continue;
        }
        h = (h << 4) + gear((uint32_t)id); /* the top bits see the last 16 tokens */
        int len = i + 1 - start;
        bool cut = len >= p->max_tokens;
        if (len >= p->min_tokens) {
            cut = cut || kind == CACHE_TOKEN_SOFT;
            cut = cut || (bits > 0 && (h >> (64 - bits)) == 0);
        }
        if (cut) {
            ends[n_ends++] = i + 1;
            start = i + 1;
        }
    }
    if (start < n && n_ends < max_ends) ends[n_ends++] = n;
    return n_ends;
}

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
