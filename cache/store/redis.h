/* The Redis tier of the chunk store (internal to cache/; cache/store/store.c is its only user).
 *
 * Below disk, shared by every instance that names the same Redis: one instance's chunks save the
 * others their prefill. A value is a whole chunk record in the disk tier's format
 * (cache/store/record.h: the header with its checksums, then the payload, unpadded), verified like
 * a record read from disk before it is used. Keys (model: the first 16 hex digits of the model
 * identity; bt, ct: the layout's block and chunk tokens; ns, key: 64 hex digits):
 *
 *   kvserve:<version>:<model>-<bt>x<ct>:<ns>:r:<record key>   the record
 *   kvserve:<version>:<model>-<bt>x<ct>:b:<block key>         an alias: the record key and
 *                                                             namespace of a record holding
 *                                                             that block, the generations it
 *                                                             was written under, value sizes
 *   kvserve:<version>:<model>-<bt>x<ct>:g, ...:<ns>:g         the generation of every namespace,
 *                                                             of one: 8 bytes a clear sets
 *
 * so a record is found by any of its block keys (one MGET for every block of a sequence, one for
 * the generations, then a GET per chunk), and a namespace's records match one SCAN pattern. A
 * block key is a SHA-256 over the namespace already, so an alias carries no namespace in its
 * name. Only commands that twemproxy forwards are needed (GET, SET, MGET, UNLINK; SCAN for a
 * clear, which works without it), so the URL may name a twemproxy in front of several Redis.
 *
 * Network waits are bounded: every connect, send and receive times out after timeout_ms. A
 * failure drops the connection and retries after a backoff (100 ms doubling to 5 s); until then
 * lookups miss at once and queued writes are dropped, so a down or slow Redis costs a
 * recomputation, never a failed or stuck request. Lookups run on the calling thread over the
 * lookup connection (one caller at a time); writes run on the tier's own thread over another.
 * hiredis writes to sockets with write(): the process must ignore SIGPIPE (kvserve serve does). */
#ifndef KVSERVE_CACHE_REDIS_H
#define KVSERVE_CACHE_REDIS_H

#include "cache/cache.h"
#include "cache/codec/codec.h"
#include "cache/store/content.h"

/* The version in every key: a new record or alias format gets new keys. 3: version-2 records in
 * several encodings, aliases that list their sizes; 4: aliases and content values that carry
 * their generations. */
#define CACHE_REDIS_KEY_VERSION 4

typedef struct cache_redis cache_redis;

/* Where a Redis listens, parsed from a URL. */
typedef struct cache_redis_addr {
    char host[256]; /* TCP host name or address; "" for a Unix socket */
    int port;
    char path[108]; /* Unix socket path; "" for TCP */
    char password[256];
    bool has_password;
    int db;
} cache_redis_addr;

/* Accepts redis://host[:port][/db], redis://:password@host[:port][/db] and
 * unix:///absolute/path (port 6379 and db 0 by default; host a name or an IPv4 address; no
 * percent-decoding: the last '@' ends the password). -1 with err naming what is wrong.
 * tests/fuzz/redis_url_fuzz.c fuzzes it. */
int cache_redis_parse_url(const char *url, cache_redis_addr *out, kv_error *err);

/* Parses url and starts the write thread; the first connection is tried at once (a Redis that is
 * down is only logged: the tier connects when it comes up). ttl_s: expiry of every key written
 * (0: none); write_queue: pending writes at most (beyond: dropped, counted); timeout_ms: each
 * network wait. NULL with err on a bad URL or argument. */
cache_redis *cache_redis_open(const char *url, const cache_layout *l, const codec_table *table,
                              int64_t ttl_s, int write_queue, int timeout_ms, kv_error *err);
/* Finishes the queued writes Redis takes (while it answers), stops the thread, disconnects. */
void cache_redis_close(cache_redis *r);

/* Continues a sequence's prefix from block first on, chunk by chunk, as cache_store_fetch does
 * (bkeys[0..n_blocks)): up to max_out verified chunks go to out[] (one reference each) and, for
 * each, upto[i] the block after the last one of the sequence it holds. Returns how many; 0 at
 * once while the tier is backing off. Counts a hit per chunk, a miss per lookup that ends before
 * the sequence does, a corrupt value per record refused (then deleted). */
int cache_redis_fetch(cache_redis *r, const cache_key *bkeys, int first, int n_blocks,
                      const cache_fetch_policy *policy, cache_chunk **out, int *upto,
                      uint8_t *enc_out, int max_out, int *n_text);
/* Queues c to be written (taking a reference); never blocks on the network. False, counted as
 * dropped, when the queue is full or c is not whole blocks of the layout. */
bool cache_redis_put(cache_redis *r, cache_chunk *c);
/* Queues a complete content record (cache/store/content.h) to be written, lossless, in its disk
 * file's format under ...:<ns>:c:<content key> (taking a reference); false, counted as dropped,
 * when the queue is full or the record is not this layout's. */
bool cache_redis_put_content(cache_redis *r, content_rec *c);
/* Looks up content records of namespace ns by key (keys[i] of n_tok[i] tokens) in one MGET:
 * out[i] a checked record with one reference, or NULL. Values that fail a check are refused,
 * counted as corrupt and deleted. Returns how many were found. */
int cache_redis_fetch_content(cache_redis *r, const cache_key *ns, const cache_key *keys,
                              const int *n_tok, int n, content_rec **out);
/* Clears namespace ns's records (NULL: every record of this model identity): deletes them (and,
 * for NULL, the aliases) with SCAN and UNLINK where Redis takes SCAN, then sets the scope's new
 * generation, so that what was written before is never matched again, also where the keys could
 * not be listed (a proxy: they expire with their TTL). Returns how many records were deleted (0
 * through a proxy), -1 when Redis could not be reached. */
int64_t cache_redis_clear(cache_redis *r, const cache_key *ns);
/* Keeps the chunks of a sequence's blocks bkeys[0..n_blocks) in namespace ns (their records'
 * values in every encoding this instance writes, and the blocks' aliases) for at least ttl_s
 * seconds from now, or the tier's TTL when that is longer (EXPIRE: a key extended further by an
 * earlier call may be shortened to that); nothing with no TTL. A pin or lease another instance
 * sees in Redis then finds the chunks it names. -1 when Redis could not be reached. */
int cache_redis_keep(cache_redis *r, const cache_key *ns, const cache_key *bkeys, int n_blocks,
                     int64_t ttl_s);
/* entries, bytes and capacity are unknown (0): Redis holds other instances' keys too. */
void cache_redis_stats(cache_redis *r, cache_tier_stats *out, bool *connected);
/* Waits until no write is queued or in flight. */
void cache_redis_flush(cache_redis *r);

#endif
