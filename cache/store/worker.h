/* A background thread for the tiers' encoders (internal to cache/: the disk tier's and the
 * encoded RAM tier's): it runs a function on each chunk queued, in order, at a lower CPU priority
 * than the engine's threads, so encoding takes what compute leaves. The queue is bounded: a
 * chunk that does not fit is not queued (the caller counts it). Thread-safe. */
#ifndef KVSERVE_CACHE_WORKER_H
#define KVSERVE_CACHE_WORKER_H

#include "cache/cache.h"

typedef struct chunk_worker chunk_worker;

/* What the worker does with a chunk (and the tag it was queued with). */
typedef void (*chunk_work_fn)(void *ud, cache_chunk *c, uint64_t tag);

/* Starts a worker whose queue holds up to cap chunks; first (may be NULL) runs on its thread
 * before any chunk. NULL with err when out of memory or the thread cannot start. */
chunk_worker *chunk_worker_start(int cap, chunk_work_fn fn, void (*first)(void *ud), void *ud,
                                 kv_error *err);
/* Queues c (taking a reference) with tag; false when the queue is full or the worker stops. */
bool chunk_worker_queue(chunk_worker *w, cache_chunk *c, uint64_t tag);
/* Waits until nothing is queued and fn is not running. */
void chunk_worker_flush(chunk_worker *w);
/* Drops what is still queued, waits for the chunk being worked on, joins and frees (NULL: no-op).
 */
void chunk_worker_stop(chunk_worker *w);

#endif
