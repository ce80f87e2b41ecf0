/* Content records: one chunk's KV as some earlier context computed it, kept under its content
 * key for reuse by content (DESIGN.md "Segments, content keys and blend"; cache/blend/blend.h
 * cuts the chunks and fuses the records into a new context), and the tiers that keep them: RAM
 * (content.c), disk (content_disk.c, on the dirstore core; its file format is
 * cache/store/content_disk.h) and a copy in the store's Redis tier (redis.c through store.c).
 *
 * Users: the planner (cache/plan.c) finds, fills and keeps records; blend's fusor reads their rows
 * and a disk record's layers; schema's module KV (cache/schema/schema_kv.c) builds records;
 * cache/setup.c opens the disk tier; the engine clears the tiers and reads their counts (through
 * cache/blend/blend.h). */
#ifndef KVSERVE_CACHE_CONTENT_H
#define KVSERVE_CACHE_CONTENT_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "cache/cache.h"

/* ---------------------------------------------------------------- records */

/* A record still being read from the disk tier, layer by layer (content_disk.c). */
typedef struct content_src content_src;

/* One chunk's KV as some earlier context computed it: every layer's K (rotated at positions
 * pos0 .. pos0 + n_tok - 1) and V as f16, [n_layer][2 (K, V)][n_tok][kv_dim]. Immutable once
 * shared; reference counted. A record found on disk (src set) fills its layers as the fusor's
 * loader reads them, for the one request that holds it, and is shared once complete. */
typedef struct content_rec {
    cache_key key; /* content key of its tokens */
    cache_key ns;
    int32_t pos0;
    int n_tok;
    int n_layer;
    int kv_dim; /* n_kv_head * head_dim */
    size_t bytes;
    uint16_t *data;
    atomic_int refs;
    content_src *src; /* NULL: every layer is in data */
} content_rec;

/* A record with one reference and an uninitialised payload (NULL when out of memory). */
content_rec *content_rec_create(int n_layer, int kv_dim, int n_tok, const cache_key *key,
                                const cache_key *ns, int32_t pos0);
void content_rec_ref(content_rec *r);
void content_rec_unref(content_rec *r);
/* The K (kv 0) or V (kv 1) rows of one layer: [n_tok][kv_dim] f16. */
const uint16_t *content_rec_rows(const content_rec *r, int layer, int kv);

/* ---------------------------------------------------------------- the RAM tier */

/* The content store: records by content key in RAM, least recently used evicted first, under
 * a byte cap. Thread-safe. */
typedef struct content_store content_store;

content_store *content_store_create(int64_t cap_bytes);
void content_store_destroy(content_store *s);
/* The record under key, with a reference for the caller; NULL on a miss. */
content_rec *content_store_get(content_store *s, const cache_key *key);
bool content_store_has(content_store *s, const cache_key *key);
/* Keeps r (the store takes its own reference) unless its key is held or it exceeds the cap. */
void content_store_put(content_store *s, content_rec *r);
/* Drops the records of namespace ns (NULL: all); returns how many. */
int64_t content_store_clear(content_store *s, const cache_key *ns);
void content_store_stats(content_store *s, cache_tier_stats *out);

/* ---------------------------------------------------------------- the disk tier
 *
 * Content records kept across restarts (content_disk.c): one checksummed file per record, each
 * layer hashed on its own, written in the background, read layer by layer by the fusor's loader
 * while earlier layers compute. */
typedef struct content_disk content_disk;

/* Opens (creating) the directory and indexes the records in it of this model and layout
 * (others are left alone; torn or corrupt ones are deleted and counted). NULL with err. */
content_disk *content_disk_open(const char *dir, const uint8_t model_id[32], int n_layer,
                                int kv_dim, int64_t cap_bytes, kv_error *err);
/* Finishes queued writes and frees everything. */
void content_disk_close(content_disk *d);
/* Queues a complete record for writing (the tier takes a reference). Never blocks on I/O; a
 * write that cannot be queued is dropped and counted, one that fails costs only the copy. */
void content_disk_put(content_disk *d, content_rec *r);
/* A record of n_tok tokens under key, to be filled by content_rec_read_layer (src set), or NULL
 * on a miss. No I/O: the index is in memory. */
content_rec *content_disk_get(content_disk *d, const cache_key *key, int n_tok);
/* Reads layer `layer` of a record found on disk into its data (layers in order; a no-op for a
 * layer already read or a record in memory) and checks that layer's checksum. -1 when it fails:
 * the record is then marked failed, deleted from the tier and counted as corrupt. */
int content_rec_read_layer(content_rec *r, int layer);
/* True when every layer is in data (always for a record in memory). */
bool content_rec_complete(const content_rec *r);
/* True when reading it from disk failed. */
bool content_rec_failed(const content_rec *r);
/* Drops a complete record's disk reader, so it can be shared (content_store_put). */
void content_rec_settle(content_rec *r);
/* Frees a record's disk reader (content_rec_unref's; internal to cache/store/). */
void content_src_free(content_src *src);
/* Deletes the records of namespace ns (NULL: all); returns how many. */
int64_t content_disk_clear(content_disk *d, const cache_key *ns);
void content_disk_stats(content_disk *d, cache_tier_stats *out);
/* Waits until every queued write has finished (tests, shutdown). */
void content_disk_flush(content_disk *d);

/* ---------------------------------------------------------------- the Redis copy
 *
 * With a Redis tier (cache.h's store), content records are also written there, lossless, and a
 * prompt's chunks that RAM and disk lack are looked up there before its blend is planned, so
 * instances sharing a Redis reuse each other's passages by content too (cache/store/redis.h). */

/* True when the store has a Redis tier. */
bool cache_store_has_redis(const cache_store *s);
/* Queues r (complete) for the Redis tier, in the background; a no-op without one. */
void cache_store_put_content(cache_store *s, content_rec *r);
/* Looks up keys[0..n) (of n_tok[i] tokens) of namespace ns in the Redis tier: out[i] a record
 * with one reference, or NULL. Returns how many were found (0 without a Redis tier). */
int cache_store_fetch_content(cache_store *s, const cache_key *ns, const cache_key *keys,
                              const int *n_tok, int n, content_rec **out);

#endif
