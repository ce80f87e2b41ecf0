/* The device-pool tier of the context cache (the planner's, cache/plan.h): KV blocks that stay in
 * the pool after their sequence ends, found by prefix key, as vLLM's automatic prefix caching does.
 * An entry is one full block under its block key (cache/cache.h) and holds one reference on it, so
 * a later request with the same prefix appends the blocks to its block table by reference (no
 * copy) and concurrent requests share them. When the pool needs room, least recently used
 * entries whose block no sequence shares are evicted first, before any sequence is preempted.
 * A sequence's blocks are touched from its last block to its first, so the tail of a prefix is
 * always older than its head and goes first: what is left is still a usable prefix.
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
    int64_t entries; /* blocks held, one entry each */
    int64_t blocks;  /* the same count (kept for the metrics' names) */
    int64_t hits;    /* blocks found by prefix lookups */
    int64_t misses;  /* lookups that stopped at a block not held */
    int64_t evictions;
} pool_cache_stats;

pool_cache *pool_cache_create(kv_pool *pool);
/* Releases every entry's block (engine thread, or after it stopped). */
void pool_cache_destroy(pool_cache *pc);

/* Any thread. */
bool pool_cache_has(pool_cache *pc, const cache_key *key);
/* Drops the entries of namespace ns (NULL: all); returns how many. Any thread. */
int64_t pool_cache_clear(pool_cache *pc, const cache_key *ns);
void pool_cache_stats_get(pool_cache *pc, pool_cache_stats *out);

/* Engine thread only. */
/* How many leading keys of keys[0..n) are held: their block ids go to blocks (when not NULL;
 * valid until the next call that evicts), and they are touched, last first. Counts the blocks
 * found as hits and, when it stops short of n, one miss (when count). */
int pool_cache_lookup(pool_cache *pc, const cache_key *keys, int n, int32_t *blocks, bool count);
/* Registers block as key's (taking a reference), most recently used. No-op when present. */
void pool_cache_put(pool_cache *pc, const cache_key *key, const cache_key *ns, int32_t block);
/* A use stamp: entries touched (lookup, put) from now on have stamps >= it. */
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
