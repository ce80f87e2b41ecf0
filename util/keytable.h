/* util/keytable: the keyed hash table and LRU list the cache tiers share (RAM, disk, device
 * pool). Both are intrusive: an entry embeds a kt_node and keeps its own key bytes, so one
 * allocation holds an entry and its links, and an entry can sit in several tables (a chunk
 * record is found by its own key and by each of its blocks' keys).
 *
 * Keys are fixed-length byte strings (SHA-256 digests here). A tenant who knows the model
 * identity could grind prompts whose digests share low bits, so bucket positions go through a
 * per-table random seed (splitmix64's finaliser) and cannot be predicted from outside.
 *
 * Equal keys may be inserted more than once (a multimap): keytable_find returns one of them and
 * keytable_find_next the others. Not thread-safe: the owner holds its lock around every call. */
#ifndef KVSERVE_KEYTABLE_H
#define KVSERVE_KEYTABLE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct kt_node {
    struct kt_node *hnext; /* bucket chain */
    const uint8_t *key;    /* key_bytes bytes, owned by the entry, fixed while inserted */
} kt_node;

typedef struct keytable {
    kt_node **buckets; /* [n_buckets] chains */
    size_t n_buckets;  /* power of two */
    size_t n;          /* nodes inserted */
    size_t key_bytes;
    uint64_t seed;
} keytable;

/* An empty table for keys of key_bytes (8..256) bytes. -1 when out of memory. */
int keytable_init(keytable *t, size_t key_bytes);
/* Frees the bucket array (not the entries, which belong to the caller). */
void keytable_free(keytable *t);
/* Inserts node (its key set). Grows the table at load factor 1; when growing fails the table
 * only gets slower, so inserting never fails. */
void keytable_insert(keytable *t, kt_node *node);
/* Removes node, which must be in t. */
void keytable_remove(keytable *t, kt_node *node);
/* A node with this key, or NULL. */
kt_node *keytable_find(const keytable *t, const void *key);
/* The next node after `node` with the same key, or NULL. */
kt_node *keytable_find_next(const keytable *t, const kt_node *node);
/* Visits every node; `visit` may remove the node it is given (and no other). */
void keytable_each(keytable *t, void (*visit)(void *ud, kt_node *node), void *ud);

/* ---------------------------------------------------------------- LRU list */

typedef struct lru_node {
    struct lru_node *older, *newer;
    bool linked;
} lru_node;

typedef struct lru_list {
    lru_node *oldest, *newest;
} lru_list;

/* Makes node the most recently used (linking it if it was not in the list). */
void lru_touch(lru_list *l, lru_node *node);
/* Takes node out of the list (no-op when it is not linked). */
void lru_unlink(lru_list *l, lru_node *node);

/* The entry that embeds a node: KT_ENTRY(ptr, struct ram_entry, lru). */
#define KT_ENTRY(ptr, type, member) ((type *)(void *)((char *)(ptr)-offsetof(type, member)))

#endif
