/* The disk tier of the chunk store (internal to cache/; cache/store/store.c is its only user).
 *
 * One directory per model identity under the configured cache directory holds one file per
 * chunk: a record (cache/store/record.h: header with magic, version, model identity, layout, key,
 * namespace, positions, payload checksum; then the payload). Writes go to a temporary file that
 * is renamed into place when complete, so a reader (or a restart after kill -9) sees whole
 * records or none. An I/O thread owns an io_uring and performs every read and write, with
 * O_DIRECT where the filesystem allows it. The index (record key and block keys -> file size, LRU
 * order, pins) lives in memory and is rebuilt from the files' headers at open; the byte cap is kept
 * by deleting the least recently used unpinned records. All functions are thread-safe. */
#ifndef KVSERVE_CACHE_DISK_H
#define KVSERVE_CACHE_DISK_H

#include "cache/cache.h"
#include "cache/codec/codec.h"

typedef struct cache_disk cache_disk;

/* Opens (creating) dir/<first 16 hex digits of the model identity>/, deletes leftover
 * temporary files, reads every record's header and indexes the valid ones (torn, corrupt or
 * foreign-layout records are deleted; they and the temporary files are counted as corrupt),
 * evicts down to cap_bytes (least recent modification time first) and starts the I/O thread.
 * NULL with err when the directory cannot be created or used, or an argument is out of range
 * (cap_bytes < 0, write_queue outside 0..2^20). */
cache_disk *cache_disk_open(const char *dir, const cache_layout *l, int64_t cap_bytes,
                            int write_queue, kv_error *err);
/* The same; with encode, the tier also keeps each record's chunk in every other encoding of
 * table (cache/codec/chunk_codec.h: q8, then table's levels; NULL: q8 only), each in a file beside
 * the record, made in the background by an encoder thread at a lower CPU priority (its queue holds
 * 16 records; beyond: not encoded, counted as dropped). The files count towards cap_bytes and go
 * with their record. At open, files of another table or of no record are deleted; without encode,
 * every encoding's file is. */
cache_disk *cache_disk_open_enc(const char *dir, const cache_layout *l, int64_t cap_bytes,
                                int write_queue, const codec_table *table, bool encode,
                                kv_error *err);
/* Finishes queued writes, stops the I/O thread, frees the index. */
void cache_disk_close(cache_disk *d);

/* True when the record whose own key is key is on disk (a record still being written is not). */
bool cache_disk_contains(cache_disk *d, const cache_key *key);
/* True when a record on disk holds a block whose key is bkey: its own key goes to *record and
 * the block's index in it to *block. No I/O. */
bool cache_disk_find(cache_disk *d, const cache_key *bkey, cache_key *record, int *block);
/* Queues c to be written (taking a reference). False, without queuing, when a record on disk or
 * being written already holds c's last block, when c's payload is not whole blocks of the
 * layout, or when write_queue writes are pending (counted as dropped). Once written, records of
 * the same chunk that hold a prefix of c are deleted (c's record inherits a pin they had). A
 * write that fails (ENOSPC, EIO) is counted as a write error and leaves no file behind. */
bool cache_disk_put(cache_disk *d, cache_chunk *c);
/* The bytes of the chunks queued or being written: their payloads are held until written. */
int64_t cache_disk_write_bytes(cache_disk *d);
/* Reads the records whose own keys are keys[0..n) concurrently (one batch of io_uring reads)
 * and verifies them. out[i] gets a new chunk (one reference) or NULL: not indexed, unreadable,
 * or failing its header or payload checksum (then deleted and counted as corrupt). Counts
 * hits/misses. */
void cache_disk_read(cache_disk *d, const cache_key *keys, int n, cache_chunk **out);
/* The same, each record read in the encoding policy chooses (cache_meter_choose, with this disk's
 * measured read rate; never text; NULL: lossless) from the ones it has; enc_out[i] (may be NULL)
 * gets the encoding out[i] came in. An encoding that fails its checks is deleted (counted as
 * corrupt) and the record is read lossless instead. */
void cache_disk_read_enc(cache_disk *d, const cache_key *keys, int n,
                         const cache_fetch_policy *policy, cache_chunk **out, uint8_t *enc_out);
/* Sets or clears the pin of each key held (on disk or being written: the pin then applies once
 * it is on disk) for tenant (CACHE_TENANT_NONE: none), or with until > 0 leases it until then
 * instead (as cache_disk_lease does, by its own key); returns how many were held. Pinned records
 * may fill at most half the capacity: a pin beyond that is refused (the key does not count as
 * held). -1, nothing pinned, when the records not pinned yet would take the tenant past its
 * share (cache/store/pins.h). */
int cache_disk_pin(cache_disk *d, int tenant, const cache_key *keys, int n, bool pin,
                   int64_t until);
/* Caps the bytes of pinned records below half the capacity (0: half the capacity), and each of
 * n_tenants tenants' at share_pct percent of that (0: an equal part). -1 when out of memory. */
int cache_disk_set_pin_limit(cache_disk *d, int64_t bytes, int n_tenants, int share_pct);
/* Tenant t's pinned bytes, and the most its share lets it hold. */
void cache_disk_tenant_pins(cache_disk *d, int t, int64_t *bytes, int64_t *share);
/* Leases the record holding block bkey (on disk or being written) for tenant until `until` (Unix
 * seconds; a later lease is kept), as cache_ram_lease does; the leases are kept in the tier's
 * leases file (cache/store/leases.h), rewritten by the I/O thread (without their tenants: a
 * lease restored at start is held for none until a tenant holds it too). False when no record holds
 * the block, or the pin cap or the tenant's share of it is reached. */
bool cache_disk_lease(cache_disk *d, int tenant, const cache_key *bkey, int64_t until);
/* Ends the leases due at `now`; returns how many ended. Cheap when none is due. */
int cache_disk_expire(cache_disk *d, int64_t now);
/* Lists up to max pinned or leased records into out (disk set); returns how many there are. */
int cache_disk_pins(cache_disk *d, cache_pin_info *out, int max);
/* Gives the records indexed at open the leases the leases file kept for them that end after
 * `now`; returns how many. A missing file is no lease; a bad one is logged and ignored. */
int cache_disk_restore_leases(cache_disk *d, int64_t now);
/* Deletes every record of namespace ns (NULL: all), pinned or not; returns how many were on
 * disk. Records still being written are not counted: they are deleted when their write ends. */
int64_t cache_disk_clear(cache_disk *d, const cache_key *ns);
void cache_disk_stats(cache_disk *d, cache_tier_stats *out);
/* Waits until no write (nor encoding) is queued or in flight. */
void cache_disk_flush(cache_disk *d);

#endif
