/* The device-pool tier of the context cache (the planner's, cache/plan.h): KV blocks that stay in
 * the pool after their sequence ends, found by prefix key, as vLLM's automatic prefix caching does.
 * An entry is one full block under its block key (cache/cache.h) and holds one reference on it, so
 * a later request with the same prefix appends the blocks to its block table by reference (no
 * copy) and concurrent requests share them. When the pool needs room, least recently used
 * entries whose block no sequence shares are evicted first, before any sequence is preempted.
 * A sequence's blocks are touched from its last block to its first, so the tail of a prefix is
 * always older than its head and goes first: what is left is still a usable prefix.
 *
 * Reuse goes to the token (as llama-server's slots and SGLang's radix cache do): every entry
 * also knows the block before it (its parent's key) and its tokens, so a prompt whose next
 * block is not held whole finds the held block after the same prefix that shares most of its
 * leading tokens (pool_cache_match), a full block or a partial one: the last block of a
 * sequence that ended (or was preempted) mid-block, kept with the rows it holds. The sequence
 * that takes such a block shares it and copies it on its first write (kv_seq_reserve): a cached
 * block is never written in place. A partial entry is dropped when a held block covers its
 * tokens. The index costs one entry per block, 208 bytes and 4 per token, and a bucket in
 * each of its two tables: about 19 bytes per cached token with 16-token blocks (9 before it
 * matched to the token), against 23 KiB of f16 KV per token for SmolLM2-135M.
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
    int64_t partial;      /* entries holding part of a block */
    int64_t partial_hits; /* matches to the token (pool_cache_match) that found a block */
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
/* Registers block as key's (taking a reference), most recently used. No-op when present.
 * parent: the previous block's key (NULL: the prompt's first block); tokens: the block's
 * block_tokens tokens. */
void pool_cache_put(pool_cache *pc, const cache_key *key, const cache_key *ns,
                    const cache_key *parent, const int32_t *tokens, int32_t block);
/* Registers the first n (0 < n < block_tokens) rows of block, after parent as above, holding
 * tokens[0..n) (taking a reference): a sequence's last, partly filled block, which it no longer
 * writes. No-op when a held block after the same parent starts with those tokens already. */
void pool_cache_put_partial(pool_cache *pc, const cache_key *ns, const cache_key *parent,
                            const int32_t *tokens, int n, int32_t block);
/* The held block after parent (NULL: first blocks) in namespace ns whose leading tokens match
 * tokens[0..n) the furthest: returns how many match (0: none) and puts its id in *block (valid
 * until the next call that evicts), touching it. Scans a bounded number of candidates. */
int pool_cache_match(pool_cache *pc, const cache_key *ns, const cache_key *parent,
                     const int32_t *tokens, int n, int32_t *block);
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
