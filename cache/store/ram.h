/* The RAM tier of the chunk store (internal to cache/): chunk records held by reference in a
 * hash table with an LRU list and a byte cap. Pinned chunks are never evicted. Thread-safe. */
#ifndef KVSERVE_CACHE_RAM_H
#define KVSERVE_CACHE_RAM_H

#include "cache/cache.h"

typedef struct cache_ram cache_ram;

cache_ram *cache_ram_create(int64_t cap_bytes);
void cache_ram_destroy(cache_ram *r);
/* A new reference to a chunk holding a block whose key is bkey (made most recently used; a
 * hit), and the block's index in it; NULL when none does (no statistics: the caller probes). */
cache_chunk *cache_ram_find(cache_ram *r, const cache_key *bkey, int *block);
/* The same; with lossless, a chunk held in an encoding (cache_chunk.enc) is not found (no hit
 * counted, no LRU change). */
cache_chunk *cache_ram_find_as(cache_ram *r, const cache_key *bkey, bool lossless, int *block);
/* True when a chunk holds a block whose key is bkey (no statistics, no LRU change). */
bool cache_ram_holds(cache_ram *r, const cache_key *bkey);
/* Counts a miss (a lookup the caller gave up on). */
void cache_ram_count_miss(cache_ram *r);
/* True when a chunk's own key is key. */
bool cache_ram_contains(cache_ram *r, const cache_key *key);
/* Inserts c (taking a reference) unless a record holds its last block already or c alone
 * exceeds the cap (beside the pinned chunks); records of the same chunk holding a prefix of c
 * are replaced by it; evicts least recently used unpinned chunks down to the cap. False when
 * not inserted. */
bool cache_ram_put(cache_ram *r, cache_chunk *c);
/* True when c itself is the record held under its key. */
bool cache_ram_has(cache_ram *r, const cache_chunk *c);
/* Replaces the chunk old, where it is still the record held under its key, by c (taking a
 * reference; c holds the same blocks, e.g. old encoded), keeping its place in the LRU order and
 * its pin. False when old is no longer held. */
bool cache_ram_swap(cache_ram *r, const cache_chunk *old, cache_chunk *c);
/* Pins (pin) or unpins keys for tenant (cache.h's CACHE_TENANT_NONE: none), or with until > 0
 * leases them until then instead of pinning them (as cache_ram_lease does, by their own keys);
 * returns how many were held and (pinning) pinned, or -1, nothing pinned, when the records not
 * pinned yet would take the tenant past its share (cache/store/pins.h). Pinned chunks may fill at
 * most half the capacity, so unpinned traffic always has room, and at most the pin limit.
 * Unpinning leaves a lease in force. */
int cache_ram_pin(cache_ram *r, int tenant, const cache_key *keys, int n, bool pin, int64_t until);
/* Caps the bytes of pinned chunks below half the capacity (0: half the capacity), and each of
 * n_tenants tenants' at share_pct percent of that (0: an equal part). -1 when out of memory. */
int cache_ram_set_pin_limit(cache_ram *r, int64_t bytes, int n_tenants, int share_pct);
/* Tenant t's pinned bytes, and the most its share lets it hold. */
void cache_ram_tenant_pins(cache_ram *r, int t, int64_t *bytes, int64_t *share);
/* Leases the record holding the block bkey (one of them, when several do: each holds every
 * block of the chunk up to bkey's) for tenant until `until` (Unix seconds; an existing later
 * lease is kept). A lease keeps the record like a pin and passes, as a pin does, to a longer
 * record of the chunk that replaces it. False when no record holds the block, or the pin cap or
 * the tenant's share of it is reached. */
bool cache_ram_lease(cache_ram *r, int tenant, const cache_key *bkey, int64_t until);
/* Ends the leases due at `now` (Unix seconds): their records are evicted like any other from
 * then on (unless pinned). Returns how many ended; cheap when none is due. */
int cache_ram_expire(cache_ram *r, int64_t now);
/* Lists up to max pinned or leased records into out (ram set); returns how many there are. */
int cache_ram_pins(cache_ram *r, cache_pin_info *out, int max);
int64_t cache_ram_clear(cache_ram *r, const cache_key *ns);
void cache_ram_stats(cache_ram *r, cache_tier_stats *out);

#endif
