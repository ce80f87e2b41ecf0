/* The cache tiers' keyed hash table and LRU list (util/keytable.h). */
#include "util/keytable.h"

#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "util/util.h"

/* splitmix64's finaliser over the key's first 8 bytes and the table's seed. */
static size_t bucket_of(const keytable *t, const uint8_t *key) {
    uint64_t x;
    memcpy(&x, key, sizeof x);
    x ^= t->seed;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    x ^= x >> 31;
    return (size_t)x & (t->n_buckets - 1);
}

int keytable_init(keytable *t, size_t key_bytes) {
    memset(t, 0, sizeof *t);
    if (key_bytes < 8 || key_bytes > 256) return -1;
    t->key_bytes = key_bytes;
    t->n_buckets = 64;
    if (!(t->buckets = calloc(t->n_buckets, sizeof *t->buckets))) return -1;
    if (getrandom(&t->seed, sizeof t->seed, GRND_NONBLOCK) != (ssize_t)sizeof t->seed)
        t->seed = clock_now_ns() ^ (uint64_t)(uintptr_t)t;
    return 0;
}

void keytable_free(keytable *t) {
    free(t->buckets);
    t->buckets = NULL;
    t->n_buckets = t->n = 0;
}

static void grow(keytable *t) {
    size_t old_n = t->n_buckets;
    kt_node **old = t->buckets;
    kt_node **nb = calloc(old_n * 2, sizeof *nb);
    if (!nb) return;
    t->buckets = nb;
    t->n_buckets = old_n * 2;
    for (size_t i = 0; i < old_n; i++)
        for (kt_node *e = old[i], *next; e; e = next) {
            next = e->hnext;
            size_t h = bucket_of(t, e->key);
            e->hnext = nb[h];
            nb[h] = e;
        }
    free(old);
}

void keytable_insert(keytable *t, kt_node *node) {
    if (t->n >= t->n_buckets) grow(t);
    size_t h = bucket_of(t, node->key);
    node->hnext = t->buckets[h];
    t->buckets[h] = node;
    t->n++;
}

void keytable_remove(keytable *t, kt_node *node) {
    kt_node **pp = &t->buckets[bucket_of(t, node->key)];
    while (*pp && *pp != node) pp = &(*pp)->hnext;
    if (!*pp) {
        log_error("keytable: removing a node that is not in the table");
        abort();
    }
    *pp = node->hnext;
    node->hnext = NULL;
    t->n--;
}

static kt_node *scan(const keytable *t, kt_node *from, const void *key) {
    for (kt_node *e = from; e; e = e->hnext)
        if (memcmp(e->key, key, t->key_bytes) == 0) return e;
    return NULL;
}

kt_node *keytable_find(const keytable *t, const void *key) {
    return scan(t, t->buckets[bucket_of(t, key)], key);
}

kt_node *keytable_find_next(const keytable *t, const kt_node *node) {
    return scan(t, node->hnext, node->key);
}

void keytable_each(keytable *t, void (*visit)(void *ud, kt_node *node), void *ud) {
    for (size_t i = 0; i < t->n_buckets; i++)
        for (kt_node *e = t->buckets[i], *next; e; e = next) {
            next = e->hnext;
            visit(ud, e);
        }
}

void lru_unlink(lru_list *l, lru_node *node) {
    if (!node->linked) return;
    if (node->older)
        node->older->newer = node->newer;
    else
        l->oldest = node->newer;
    if (node->newer)
        node->newer->older = node->older;
    else
        l->newest = node->older;
    node->older = node->newer = NULL;
    node->linked = false;
}

void lru_touch(lru_list *l, lru_node *node) {
    lru_unlink(l, node);
    node->older = l->newest;
    node->newer = NULL;
    if (l->newest)
        l->newest->newer = node;
    else
        l->oldest = node;
    l->newest = node;
    node->linked = true;
}
