/* The device-pool tier of the context cache (engine-internal): chunks whose KV blocks stay in
 * the KV pool after their sequence ends, found by prefix key, as vLLM's automatic prefix
 * caching does. An entry holds one reference on each of its chunk's blocks, so a later request
 * with the same prefix appends them to its block table by reference (no copy) and concurrent
 * requests share them. When the pool needs room, least recently used entries whose blocks no
 * sequence shares are evicted first, before any sequence is preempted.
 *
 * The engine thread owns the entries and the pool. Other threads may ask whether a key is held
 * (pool_cache_has) and drop entries (pool_cache_clear: marked dead, their blocks released by the
 * engine thread at its next pool_cache_reclaim). */
#ifndef KVSERVE_POOL_CACHE_H
#define KVSERVE_POOL_CACHE_H

#include "cache/cache.h"
#include "model/model.h"

typedef struct pool_cache pool_cache;

typedef struct pool_cache_stats {
    int64_t entries;
    int64_t blocks; /* blocks held by entries */
    int64_t hits, misses, evictions;
} pool_cache_stats;

/* chunk_blocks: blocks per chunk. */
pool_cache *pool_cache_create(kv_pool *pool, int chunk_blocks);
/* Releases every entry's blocks (engine thread, or after it stopped). */
void pool_cache_destroy(pool_cache *pc);

/* Any thread. */
bool pool_cache_has(pool_cache *pc, const cache_key *key);
/* Drops the entries of namespace ns (NULL: all); returns how many. Any thread. */
int64_t pool_cache_clear(pool_cache *pc, const cache_key *ns);
void pool_cache_stats_get(pool_cache *pc, pool_cache_stats *out);

/* Engine thread only. */
/* key's chunk_blocks block ids (valid until the next call that evicts), made most recently
 * used, or NULL. Counts a hit or a miss. */
const int32_t *pool_cache_get(pool_cache *pc, const cache_key *key);
/* Makes key's entry most recently used (no statistics); false when not held. */
bool pool_cache_touch(pool_cache *pc, const cache_key *key);
/* Registers blocks as key's chunk (taking a reference on each). No-op when present. */
void pool_cache_put(pool_cache *pc, const cache_key *key, const cache_key *ns,
                    const int32_t *blocks);
/* A use stamp: entries touched (get, touch, put) from now on have stamps >= it. */
uint64_t pool_cache_clock(pool_cache *pc);
/* Evicts least recently used entries that no sequence shares, and that were last used before
 * stamp `keep_from` (UINT64_MAX: any), until the pool has need_free free blocks. Evicts nothing
 * when even all of them would not be enough. Returns the pool's free blocks afterwards. */
int64_t pool_cache_make_room(pool_cache *pc, int64_t need_free, uint64_t keep_from);
/* Blocks held only by entries (freed if they were evicted). */
int64_t pool_cache_idle_blocks(pool_cache *pc);
/* Releases the blocks of entries dropped by pool_cache_clear. */
void pool_cache_reclaim(pool_cache *pc);

#endif
