/* The core under the two disk tiers (internal to cache/; cache/store/disk.c, the chunk tier, and
 * cache/store/content_disk.c, blend's content tier, are its users): a directory of record files, an
 * in-memory index of them kept under a byte cap, and one I/O thread that performs every file
 * operation once the store is open.
 *
 * A tier describes its files with a dirstore_type, as Redis's dictType describes a dict's keys:
 * how a file is named and a name parsed, how a header is checked at open, how a queued item's
 * payload is written, and what else the tier indexes with an entry. The core owns what both tiers
 * did alike: the scan at open (leftover temporaries deleted, names parsed, headers checked,
 * invalid files deleted and counted as corrupt, the valid ones indexed oldest modification first,
 * then the cap enforced), the keyed LRU index and its cap, the write ring and its thread, jobs that
 * callers wait for, flush, clear by namespace and the statistics. The tiers keep what only one
 * has: the chunk tier its io_uring reads, encodings, block index and pins; the content tier its
 * layer-by-layer reads.
 *
 * Files. A key has up to DIRSTORE_MAX_FILES files: file 0, its record, and (a tier that keeps
 * them) companion files 1.. beside it (the chunk tier's encodings), which count towards the cap
 * and go with their record. At open a companion file is indexed after its record's; one of no
 * record, or that the tier does not keep this time, is deleted.
 *
 * Ownership of files. After open only the I/O thread creates, renames or deletes files: writes,
 * evictions, deletions of corrupt records and clears are all its work. A key's file therefore
 * cannot be deleted by one party while another recreates it, and no lock is held across a system
 * call: the mutex guards memory only. An entry dropped from the index under the lock leaves its
 * files as "victims" that the I/O thread deletes once the lock is released, before it takes its
 * next piece of work; dirstore_clear and dirstore_settle wait until they are gone.
 *
 * Durability. A write goes to tmp-<key hex>-<pid>-<n>.part (unique within and across processes)
 * and is renamed to its name once every byte is written, so after a crash or kill -9 the directory
 * holds whole records or none; temporaries are deleted at open. There is no fdatasync: the cache
 * promises nothing across a power loss, and a record torn by one fails its checks (its size at
 * open, its checksums when read) and is dropped like any corrupt record. A sync per write would
 * cost more than the recomputation it saves.
 *
 * Locking. dirstore_lock/dirstore_unlock around the *_locked calls; a tier keeps its own index
 * (the chunk tier's block keys) under the same mutex. Calls marked "I/O thread" run only inside
 * the type's callbacks or jobs. */
#ifndef KVSERVE_CACHE_DIRSTORE_H
#define KVSERVE_CACHE_DIRSTORE_H

#include "cache/cache.h"
#include "util/keytable.h"

#define DIRSTORE_MAX_FILES 16
#define DIRSTORE_NAME_MAX (2 * CACHE_KEY_BYTES + 32) /* "<key>.e9-0123abcd.kvc" and room */
#define DIRSTORE_MAX_WRITE_QUEUE (1 << 20)

typedef struct dirstore dirstore;

/* One key in the index; a tier's entry embeds it as its first member (a tier that needs more
 * allocates more and casts). A new entry is "writing" from dirstore_queue_locked until its record
 * is renamed into place (not counted in entries/bytes, not in the LRU list), then published.
 * A writing entry cleared is doomed: its write deletes it on completion. */
typedef struct dirstore_entry {
    kt_node node; /* in the core's table, keyed by key */
    lru_node lru; /* published entries only */
    cache_key key;
    cache_key ns;
    uint64_t gen;   /* distinguishes this entry from a later one with the same key */
    int64_t bytes;  /* counted towards the cap */
    uint16_t files; /* the files it has: bit 0 its record, bit f companion file f */
    bool writing, doomed;
    bool pinned; /* never evicted (the tier decides what may be pinned) */
} dirstore_entry;

/* Writes a payload to fd (at its start): 0, or an errno. */
typedef int (*dirstore_payload_fn)(void *ud, int fd, void *arg);

/* What a type's check found in a file at open. */
typedef enum dirstore_check {
    DIRSTORE_VALID = 0, /* indexed */
    DIRSTORE_CORRUPT,   /* deleted and counted as corrupt (err says why) */
    DIRSTORE_SKIP,      /* left alone: not readable now */
} dirstore_check;

/* Fills err (a printf format) and returns DIRSTORE_CORRUPT: a check's refusal. */
dirstore_check dirstore_corrupt(kv_error *err, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

typedef struct dirstore_type {
    const char *tier; /* messages' prefix: "cache: disk" */
    bool direct;      /* O_DIRECT where the filesystem allows it (reads and writes) */
    /* The name of key k's file f. */
    void (*file_name)(void *ud, const cache_key *k, int file, char out[DIRSTORE_NAME_MAX]);
    /* True when name is one this tier writes (for any instance: whether it is this one's,
     * file_name says); the key to k and the file to *file. Other names are left alone. */
    bool (*parse_name)(const char *name, cache_key *k, int *file);
    /* At open: checks hdr[0..len) (up to the header_bytes given to dirstore_open), the start of
     * key k's file f of file_bytes. File 0: a new entry (calloc'ed; key, ns, bytes set) to *e.
     * File f > 0: *e is its record's entry, to give the file (dirstore_set_file_locked on ds,
     * which dirstore_open has not returned yet). A new entry that cannot be allocated: VALID
     * with *e NULL (the open fails, out of memory). */
    dirstore_check (*check)(void *ud, dirstore *ds, const cache_key *k, int file,
                            const uint8_t *hdr, size_t len, int64_t file_bytes, dirstore_entry **e,
                            kv_error *err);
    /* Writes a queued item's record payload (everything, header included). */
    dirstore_payload_fn write_payload;
    /* Drops the queue's reference to an item. */
    void (*unref)(void *item);
    /* Optional: an entry joins or leaves the index (the tier's own index, its pin accounting). */
    void (*index)(void *ud, dirstore_entry *e);
    void (*unindex)(void *ud, dirstore_entry *e);
    /* Optional, under the lock: item's record was just published as e, before the cap is
     * enforced (the chunk tier supersedes shorter records of the chunk). */
    void (*published)(void *ud, dirstore_entry *e, void *item);
    /* Optional, under the lock: after the cap is enforced, when e is still indexed. */
    void (*written)(void *ud, dirstore_entry *e, void *item);
} dirstore_type;

typedef struct dirstore_params {
    const char *path;    /* the directory (made with its parents) */
    int64_t cap;         /* bytes, >= 0 */
    int write_queue;     /* writes queued or in flight at most, 0..DIRSTORE_MAX_WRITE_QUEUE */
    int n_files;         /* files kept per key, 1..DIRSTORE_MAX_FILES */
    size_t header_bytes; /* how much of a file check is given at open */
    void *ud;            /* the tier, passed to every callback */
} dirstore_params;

/* Opens (creating) the directory, scans it (see above) and starts the I/O thread. NULL with err
 * when the directory cannot be made or used, or a parameter is out of range. */
dirstore *dirstore_open(const dirstore_type *t, const dirstore_params *p, kv_error *err);
/* Writes what is queued, runs what is posted, stops the I/O thread, frees every entry. */
void dirstore_close(dirstore *ds);
const char *dirstore_path(const dirstore *ds);
int dirstore_dir_fd(const dirstore *ds);
/* Opens name in the directory, O_DIRECT where the type asks and the filesystem allows. */
int dirstore_open_file(dirstore *ds, const char *name, int flags);

void dirstore_lock(dirstore *ds);
void dirstore_unlock(dirstore *ds);

/* ---------------------------------------------------------------- index (caller holds the lock) */

/* Key k's entry (writing or published), or NULL. */
dirstore_entry *dirstore_find_locked(const dirstore *ds, const cache_key *k);
/* Visits every entry, writing or published (visit must not add or remove any). */
void dirstore_each_locked(dirstore *ds, void (*visit)(void *ud, dirstore_entry *e), void *ud);
/* Makes published e the most recently used. */
void dirstore_touch_locked(dirstore *ds, dirstore_entry *e);
/* Queues item (the caller's reference passes to the queue) to be written as new entry e (not
 * indexed; its key not in the index), which joins the index as writing. False, with nothing
 * done, when write_queue writes are queued or in flight (counted as dropped). */
bool dirstore_queue_locked(dirstore *ds, dirstore_entry *e, void *item);
/* Takes e out of the index and frees it, leaving files (a subset of e->files) to delete. False
 * when out of memory for that: e is then kept, so no file is ever left outside the index. */
bool dirstore_remove_locked(dirstore *ds, dirstore_entry *e, uint16_t files);
/* Key k's files, no longer indexed, to delete. False when out of memory. */
bool dirstore_unlink_locked(dirstore *ds, const cache_key *k, uint16_t files);
/* Gives e companion file f, adding delta to its bytes (with f absent: takes it away). */
void dirstore_set_file_locked(dirstore *ds, dirstore_entry *e, int file, bool present,
                              int64_t delta);
/* Removes least recently used unpinned entries until bytes <= cap. */
void dirstore_evict_locked(dirstore *ds);
/* The statistics, for the tier to count its reads (capacity is filled in by dirstore_stats). */
cache_tier_stats *dirstore_stats_locked(dirstore *ds);
int64_t dirstore_cap(const dirstore *ds);
/* The bytes of the records queued or being written (locks). */
int64_t dirstore_write_bytes(dirstore *ds);

/* ---------------------------------------------------------------- the I/O thread's work */

/* Runs fn(ud, arg) on the I/O thread, ahead of queued writes, and waits for it (fn NULL: only
 * waits until the victims left so far are deleted). Caller holds the lock (released while
 * waiting). */
void dirstore_run_locked(dirstore *ds, void (*fn)(void *ud, void *arg), void *arg);
/* Hands fn(ud, arg) to the I/O thread to run after queued writes, without waiting for it (only,
 * while one posted before is pending, for that one). Counts in dirstore_flush. */
void dirstore_post(dirstore *ds, void (*fn)(void *ud, void *arg), void *arg);
/* I/O thread: writes key k's file f through a temporary file (see Durability): 0, or an errno
 * with *what the step that failed (no file left behind). */
int dirstore_write_file(dirstore *ds, const cache_key *k, int file, dirstore_payload_fn fn,
                        void *arg, const char **what);
/* I/O thread: a warning, at most one per 10 s (I/O errors come by the thousand from a full or
 * failing disk), with the count of those held back. */
void dirstore_warn(dirstore *ds, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* ---------------------------------------------------------------- the public calls' cores */

/* Deletes every entry of namespace ns (NULL: all), pinned or not, and waits until their files
 * are gone; returns how many were published (writing ones are doomed, not counted). */
int64_t dirstore_clear(dirstore *ds, const cache_key *ns);
void dirstore_stats(dirstore *ds, cache_tier_stats *out);
/* Waits until no write or posted work is queued or in flight and no victim is left. */
void dirstore_flush(dirstore *ds);

#endif
