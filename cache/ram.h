/* The RAM tier of the chunk store (internal to cache/): chunk records held by reference in a
 * hash table with an LRU list and a byte cap. Pinned chunks are never evicted. Thread-safe. */
#ifndef KVSERVE_CACHE_RAM_H
#define KVSERVE_CACHE_RAM_H

#include "cache/cache.h"

typedef struct cache_ram cache_ram;

cache_ram *cache_ram_create(int64_t cap_bytes);
void cache_ram_destroy(cache_ram *r);
/* A new reference to key's chunk (made most recently used), or NULL. Counts a hit or miss. */
cache_chunk *cache_ram_get(cache_ram *r, const cache_key *key);
bool cache_ram_contains(cache_ram *r, const cache_key *key);
/* Inserts c (taking a reference) unless key is present or c alone exceeds the cap; evicts
 * least recently used unpinned chunks down to the cap. False when not inserted. */
bool cache_ram_put(cache_ram *r, cache_chunk *c);
/* Pins (pin) or unpins keys; returns how many were held and (pinning) pinned. Pinned chunks
 * may fill at most half the capacity, so unpinned traffic always has room. */
int cache_ram_pin(cache_ram *r, const cache_key *keys, int n, bool pin);
int64_t cache_ram_clear(cache_ram *r, const cache_key *ns);
void cache_ram_stats(cache_ram *r, cache_tier_stats *out);

#endif
