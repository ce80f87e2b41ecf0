/* The disk tier of the chunk store (cache/disk.h): one record file per chunk, an in-memory
 * index, and one I/O thread that performs every file operation after open.
 *
 * Ownership of files. Only the I/O thread creates, renames or deletes record files once the tier
 * is open: writes, evictions, deletions of corrupt records and cache_disk_clear's deletions are
 * all its jobs. A key's file therefore cannot be deleted by one party while another recreates
 * it, without any lock held across a system call: the index mutex guards memory only.
 *
 * Jobs. Callers that wait (reads, clears) queue a job on their own stack and sleep on a condition
 * variable; these jobs go before queued writes, so a read never waits behind the write-back
 * queue. Writes are a ring of chunk references bounded by write_queue.
 *
 * Durability. A write goes to tmp-<key>-<pid>-<n>.part and is renamed to <key>.kvc once every
 * byte is written, so after a crash or kill -9 the directory holds whole records or none. There
 * is no fdatasync: the cache promises nothing across a power loss, and a record torn by one
 * fails its checksums when read (or its size check at open) and is dropped like any corrupt
 * record. A sync per write would cost more than the recomputation it saves.
 *
 * Encodings (cache_disk_open_enc with encode). Beside each record <key>.kvc the tier keeps its
 * chunk in every other encoding the Redis tier offers (cache/chunk_codec.h): <key>.e1.kvc for
 * q8, <key>.e<N>-<table id>.kvc for codec level N - 2 (named with the codec table, so files of
 * another table are deleted at open, never decoded). Each is a whole record of that level
 * (cache/record.h), written like a record. An encoder thread, at a lower CPU priority, encodes
 * each record once it is published and hands the files to the I/O thread; the index keeps their
 * sizes with the record, and they count towards the cap, are evicted, cleared, superseded and
 * deleted with it. A read chooses each record's encoding with the fetch policy (cache/meter.h)
 * from this disk's measured read rate and this machine's decode costs; an encoding that fails
 * its checks is dropped, and the lossless record is read instead. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <liburing.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cache/chunk_codec.h"
#include "cache/disk.h"
#include "cache/leases.h"
#include "cache/meter.h"
#include "cache/record.h"
#include "cache/worker.h"
#include "util/keytable.h"

#define DISK_RING_DEPTH 64 /* io_uring entries, and the most operations in flight */
/* A read job keeps up to DISK_READ_AHEAD records in flight (2 operations each: header, payload)
 * while it checks the oldest one's checksum. */
#define DISK_READ_AHEAD 4
#define DISK_MAX_OP (1u << 30)      /* bytes per submitted operation (prep_* take an unsigned) */
#define DISK_WARN_NS 10000000000ull /* at most one I/O warning per 10 s */
#define DISK_MAX_WRITE_QUEUE (1 << 20)
#define DISK_TMP_NAME 128
#define DISK_NAME_MAX (2 * CACHE_KEY_BYTES + 32) /* "<key>.e9-0123abcd.kvc" and room */
/* Before a read has measured the disk, it is taken to read 1 GB/s (bytes per ns). */
#define DISK_PRIOR_BW 1.0
#define DISK_DECODE_THREADS 2
/* Records waiting for the encoder, each a lossless chunk held in memory: a burst beyond it is
 * not encoded (an encoding costs more than a write; a deep queue would only hold memory). */
#define DISK_ENCODE_QUEUE 16
#define DISK_LEASES "leases" /* the leases file (cache/leases.h), beside the records */
#define DISK_LEASES_TMP "leases.tmp"

/* ---------------------------------------------------------------- types */

struct disk_entry;

/* One of a record's blocks in the block index: a prompt that shares the record's first i + 1
 * blocks finds it by the key of block i. */
typedef struct disk_block {
    kt_node node; /* in blocks, keyed by key */
    struct disk_entry *e;
    cache_key key;
} disk_block;

/* A record's files: bit 0 its lossless record, bit e its encoding e. */
typedef uint16_t disk_files;

/* Files to delete once mu is released. */
typedef struct disk_victim {
    cache_key key;
    disk_files files;
} disk_victim;

/* One record in the index. A record is "writing" from cache_disk_put until its file is renamed
 * into place (not readable, not counted in entries/bytes, not in the LRU list), then published.
 * A writing record cleared by cache_disk_clear is doomed: its write deletes it on completion. */
typedef struct disk_entry {
    kt_node by_key; /* in records, keyed by its last block's key (the record key) */
    lru_node lru;   /* published entries only */
    cache_key ns;
    uint64_t gen;                 /* distinguishes this entry from a later one with the same key */
    int64_t bytes;                /* payload bytes, of every file */
    uint64_t size[CACHE_ENC_MAX]; /* file bytes by encoding ([0]: the record; 0: no file) */
    int n_blocks;
    /* pinned: kept from eviction (and counted in pinned_bytes) while it has a reason: a pin
     * until unpinned (manual) or a lease until a time (Unix seconds, 0: none) */
    bool pinned, manual, writing, doomed;
    int64_t lease;
    disk_block by_block[]; /* [n_blocks] */
} disk_entry;

typedef enum disk_job_kind { DISK_JOB_READ, DISK_JOB_UNLINK } disk_job_kind;

/* A job whose caller waits for it (the struct lives on the caller's stack). */
typedef struct disk_job {
    disk_job_kind kind;
    const cache_key *keys;      /* [n]: record keys to read */
    const disk_victim *victims; /* [n]: files to delete */
    int n;
    const cache_fetch_policy *policy; /* reads: how to choose encodings (NULL: lossless) */
    cache_chunk **out;                /* [n], reads */
    uint8_t *enc_out;                 /* [n], reads: the encoding each came in (may be NULL) */
    bool done;
    struct disk_job *next;
} disk_job;

/* One read or write of buf[0..len) at file offset off. */
typedef struct disk_op {
    int fd;
    uint8_t *buf;
    size_t len;
    off_t off;
    size_t done;
    int err; /* errno; ENODATA: end of file before len (a torn record) */
    int retries;
    bool inflight; /* submitted to the ring, its completion not yet reaped */
} disk_op;

/* A record's encodings, made by the encoder for the I/O thread to write: buf[e] holds len[e]
 * bytes (header and padded payload; NULL: not made), payload[e] of them the payload. */
typedef struct disk_sidecars {
    cache_key key;
    uint64_t gen; /* the entry they belong to */
    uint8_t *buf[CACHE_ENC_MAX];
    size_t len[CACHE_ENC_MAX];
    uint64_t payload[CACHE_ENC_MAX];
} disk_sidecars;

struct cache_disk {
    cache_layout layout;
    const codec_table *table; /* the codec's levels (NULL: q8 only); borrowed */
    int n_enc;                /* encodings kept: 1 (lossless only) or cache_enc_count(table) */
    size_t max_payload;       /* the largest encoded payload of a chunk */
    size_t header_bytes;      /* cache_record_header_bytes(layout) */
    int64_t cap;
    int write_queue;
    char *path; /* dir/<model>, for messages */
    int dir_fd;

    pthread_mutex_t mu;
    pthread_cond_t work; /* to the I/O thread: a job, a write or stop */
    pthread_cond_t done; /* to waiters: a job finished or a write completed */

    /* Guarded by mu. */
    keytable records; /* record key -> entry */
    keytable blocks;  /* block key -> the entries holding that block */
    lru_list lru;     /* published entries */
    uint64_t next_gen;
    cache_chunk **wq; /* ring [max(write_queue, 1)] of queued writes, each holding a ref */
    int wq_head, wq_len;
    int n_writes; /* queued + in flight */
    disk_job *jobs, *jobs_tail;
    bool stop;
    cache_tier_stats st;    /* capacity is filled in by cache_disk_stats */
    int64_t pinned_bytes;   /* payload bytes of pinned entries (published or being written) */
    int64_t pin_limit;      /* pinned bytes at most beside half the cap (0: none) */
    int64_t next_expiry;    /* no lease ends before this (0: no lease) */
    bool leases_dirty;      /* the leases file is behind the index: the I/O thread rewrites it */
    cache_meter meter;      /* this disk's read rate and the decoders */
    chunk_worker *encoder;  /* encodes published records (NULL: none, or stopping) */
    disk_sidecars *handoff; /* encoded files for the I/O thread to write (one at a time) */

    float *enc_scratch; /* the encoder's */
    float *scratch;     /* the I/O thread's: decoding */

    /* The I/O thread's own (and open's, before the thread starts). */
    pthread_t thread;
    bool thread_started;
    struct io_uring ring;
    bool have_ring;
    uint8_t *hdr; /* [header_bytes], CACHE_ALIGN-aligned, host: the header being written */
    uint64_t tmp_counter;
    uint64_t warn_last_ns;
    int64_t warn_suppressed;
    bool warned_once;
    disk_victim *victims; /* files to delete once mu is released */
    size_t n_victims, cap_victims;
};

static size_t padded(size_t bytes) { return (bytes + CACHE_ALIGN - 1) / CACHE_ALIGN * CACHE_ALIGN; }

static const cache_key *entry_key(const disk_entry *e) { return &e->by_block[e->n_blocks - 1].key; }

/* ---------------------------------------------------------------- names and warnings */

/* The name of record k's file in encoding enc: <key>.kvc, <key>.e1.kvc, <key>.e<N>-<table>.kvc. */
static void file_name(const cache_disk *d, const cache_key *k, int enc, char out[DISK_NAME_MAX]) {
    char hex[2 * CACHE_KEY_BYTES + 1];
    cache_key_hex(k, hex);
    if (enc == CACHE_ENC_RAW)
        snprintf(out, DISK_NAME_MAX, "%s.kvc", hex);
    else if (enc < CACHE_ENC_CODEC || !d->table)
        snprintf(out, DISK_NAME_MAX, "%s.e%d.kvc", hex, enc);
    else
        snprintf(out, DISK_NAME_MAX, "%s.e%d-%02x%02x%02x%02x.kvc", hex, enc, d->table->id[0],
                 d->table->id[1], d->table->id[2], d->table->id[3]);
}

static int hex_digit(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

static bool ends_with(const char *s, const char *suffix);

/* True when name is one of the names this tier writes, for any codec table: <64 lower-case
 * hex>.kvc (*enc 0), <64 hex>.e<N>.kvc or <64 hex>.e<N>-<8 hex>.kvc (*enc N, 1 .. 9; whether
 * it is this instance's, file_name says). The key goes to k. */
static bool file_name_parse(const char *name, cache_key *k, int *enc) {
    size_t n = strlen(name);
    if (n < 2 * CACHE_KEY_BYTES + 4 || !ends_with(name, ".kvc")) return false;
    for (int i = 0; i < CACHE_KEY_BYTES; i++) {
        int hi = hex_digit(name[2 * i]), lo = hex_digit(name[2 * i + 1]);
        if (hi < 0 || lo < 0) return false;
        k->b[i] = (uint8_t)(hi << 4 | lo);
    }
    const char *rest = name + 2 * CACHE_KEY_BYTES;
    *enc = CACHE_ENC_RAW;
    if (strcmp(rest, ".kvc") == 0) return true;
    if (rest[0] != '.' || rest[1] != 'e' || rest[2] < '1' || rest[2] > '9') return false;
    *enc = rest[2] - '0';
    if (strcmp(rest + 3, ".kvc") == 0) return true;
    if (rest[3] != '-') return false;
    for (int i = 4; i < 12; i++) /* stops at the terminating zero */
        if (hex_digit(rest[i]) < 0) return false;
    return strcmp(rest + 12, ".kvc") == 0;
}

static bool ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && memcmp(s + n - m, suffix, m) == 0;
}

/* I/O errors can come by the thousand (a full or failing disk): one warning per DISK_WARN_NS,
 * with the count of those held back. I/O thread only. */
static void __attribute__((format(printf, 2, 3))) disk_warn(cache_disk *d, const char *fmt, ...) {
    uint64_t now = clock_now_ns();
    if (d->warned_once && now - d->warn_last_ns < DISK_WARN_NS) {
        d->warn_suppressed++;
        return;
    }
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (d->warn_suppressed)
        log_warn("cache: disk %s: %s (%lld similar warnings suppressed)", d->path, msg,
                 (long long)d->warn_suppressed);
    else
        log_warn("cache: disk %s: %s", d->path, msg);
    d->warned_once = true;
    d->warn_last_ns = now;
    d->warn_suppressed = 0;
}

/* arr (n of *cap elements of elem bytes used) with room for one more: itself, or moved to twice
 * the room (at least 16); NULL when out of memory (arr is then unchanged). */
static void *grown(void *arr, size_t n, size_t *cap, size_t elem) {
    if (n < *cap) return arr;
    size_t c = *cap ? 2 * *cap : 16;
    void *v = realloc(arr, c * elem);
    if (v) *cap = c;
    return v;
}

/* ---------------------------------------------------------------- index (caller holds mu) */

static disk_entry *table_find(const cache_disk *d, const cache_key *k) {
    kt_node *n = keytable_find(&d->records, k->b);
    return n ? KT_ENTRY(n, disk_entry, by_key) : NULL;
}

/* A published entry holding block key k, and the block's index in it; NULL when none. */
static disk_entry *block_find(const cache_disk *d, const cache_key *k, int *block) {
    for (kt_node *n = keytable_find(&d->blocks, k->b); n; n = keytable_find_next(&d->blocks, n)) {
        disk_block *b = KT_ENTRY(n, disk_block, node);
        if (b->e->writing) continue;
        *block = (int)(b - b->e->by_block);
        return b->e;
    }
    return NULL;
}

/* A new entry for the record of blocks bkeys[0..n_blocks) (its key not yet in the table):
 * writing, or published by entry_publish. NULL when out of memory. */
static disk_entry *table_add(cache_disk *d, const cache_key *bkeys, int n_blocks,
                             const cache_key *ns, int64_t bytes) {
    disk_entry *e = calloc(1, sizeof *e + sizeof(disk_block) * (size_t)n_blocks);
    if (!e) return NULL;
    e->ns = *ns;
    e->bytes = bytes;
    e->size[CACHE_ENC_RAW] = cache_record_file_bytes(&d->layout, (size_t)bytes);
    e->n_blocks = n_blocks;
    e->gen = ++d->next_gen;
    e->writing = true;
    for (int i = 0; i < n_blocks; i++) {
        disk_block *b = &e->by_block[i];
        b->e = e;
        b->key = bkeys[i];
        b->node.key = b->key.b;
        keytable_insert(&d->blocks, &b->node);
    }
    e->by_key.key = entry_key(e)->b;
    keytable_insert(&d->records, &e->by_key);
    return e;
}

/* Writing -> published: readable, counted, most recently used. */
static void entry_publish(cache_disk *d, disk_entry *e) {
    e->writing = false;
    lru_touch(&d->lru, &e->lru);
    d->st.entries++;
    d->st.bytes += e->bytes;
    if (e->pinned) d->st.pinned++;
}

/* The files e has. */
static disk_files entry_files(const disk_entry *e) {
    disk_files f = 1;
    for (int i = 1; i < CACHE_ENC_MAX; i++)
        if (e->size[i]) f |= (disk_files)(1u << i);
    return f;
}

/* Gives published entry e encoding enc's file of file_bytes bytes (0: takes it away); all but
 * its header count as payload. */
static void entry_set_enc(cache_disk *d, disk_entry *e, int enc, uint64_t file_bytes) {
    int64_t hb = (int64_t)d->header_bytes;
    int64_t delta = (file_bytes ? (int64_t)file_bytes - hb : 0) -
                    (e->size[enc] ? (int64_t)e->size[enc] - hb : 0);
    e->size[enc] = file_bytes;
    e->bytes += delta;
    d->st.bytes += delta;
    if (e->pinned) d->pinned_bytes += delta;
}

/* Pinned records may fill at most half the tier, so unpinned traffic always has room, and at
 * most the pin limit. */
static int64_t pin_cap(const cache_disk *d) {
    int64_t half = d->cap / 2;
    return d->pin_limit > 0 && d->pin_limit < half ? d->pin_limit : half;
}

/* Gives e these pin reasons (manual, a lease until `lease`, 0: none), keeping it from eviction
 * while it has one. False, e unchanged, when that would take the pinned bytes over the cap. A
 * change of lease is for the I/O thread to write to the leases file. */
static bool entry_hold(cache_disk *d, disk_entry *e, bool manual, int64_t lease) {
    bool held = manual || lease > 0;
    if (held && !e->pinned && d->pinned_bytes + e->bytes > pin_cap(d)) return false;
    if (held != e->pinned) {
        d->pinned_bytes += held ? e->bytes : -e->bytes;
        if (!e->writing) d->st.pinned += held ? 1 : -1;
    }
    if (lease != e->lease) {
        d->leases_dirty = true;
        pthread_cond_signal(&d->work);
    }
    e->pinned = held;
    e->manual = manual;
    e->lease = lease;
    if (lease > 0 && (d->next_expiry == 0 || lease < d->next_expiry)) d->next_expiry = lease;
    return true;
}

/* Removes e from the index and frees it (its file, if any, is the caller's to delete). */
static void entry_drop(cache_disk *d, disk_entry *e) {
    if (e->lease) d->leases_dirty = true; /* written with the next change, or at close */
    if (e->pinned) d->pinned_bytes -= e->bytes;
    if (!e->writing) {
        lru_unlink(&d->lru, &e->lru);
        d->st.entries--;
        d->st.bytes -= e->bytes;
        if (e->pinned) d->st.pinned--;
    }
    keytable_remove(&d->records, &e->by_key);
    for (int i = 0; i < e->n_blocks; i++) keytable_remove(&d->blocks, &e->by_block[i].node);
    free(e);
}

/* Remembers files of record k to delete after mu is released (I/O thread, or open). False when
 * out of memory: the caller keeps the entry instead, so no file is ever left outside the index. */
static bool victim_push(cache_disk *d, const cache_key *k, disk_files files) {
    disk_victim *v = grown(d->victims, d->n_victims, &d->cap_victims, sizeof *v);
    if (!v) return false;
    d->victims = v;
    d->victims[d->n_victims++] = (disk_victim){*k, files};
    return true;
}

/* Remembers every file of e to delete (victim_push). */
static bool victim_entry(cache_disk *d, const disk_entry *e) {
    return victim_push(d, entry_key(e), entry_files(e));
}

/* Drops least recently used unpinned records until bytes <= cap. Pins are honoured even when
 * pinned records alone exceed the cap; an unpin takes effect at the next write. */
static void evict_locked(cache_disk *d) {
    for (lru_node *v = d->lru.oldest; v && d->st.bytes > d->cap;) {
        lru_node *next = v->newer;
        disk_entry *e = KT_ENTRY(v, disk_entry, lru);
        if (!e->pinned) {
            if (!victim_entry(d, e)) break;
            entry_drop(d, e);
            d->st.evictions++;
        }
        v = next;
    }
}

/* A record that just got published holds a prefix of it: the records of the same chunk that
 * end at one of its earlier blocks. They are deleted, and the pins and latest lease they had
 * pass to e (as far as the pin cap allows). */
static void supersede_locked(cache_disk *d, disk_entry *e) {
    bool manual = e->manual;
    int64_t lease = e->lease;
    for (int i = 0; i < e->n_blocks - 1; i++) {
        disk_entry *old = table_find(d, &e->by_block[i].key);
        if (!old || old->writing || !victim_entry(d, old)) continue;
        manual |= old->manual;
        if (old->lease > lease) lease = old->lease;
        entry_drop(d, old);
    }
    entry_hold(d, e, manual, lease);
}

/* Deletes victims[0..n)'s files (without mu). */
static void unlink_files(cache_disk *d, const disk_victim *victims, size_t n) {
    char name[DISK_NAME_MAX];
    for (size_t i = 0; i < n; i++)
        for (int e = 0; e < CACHE_ENC_MAX; e++) {
            if (!(victims[i].files & (1u << e))) continue;
            file_name(d, &victims[i].key, e, name);
            if (unlinkat(d->dir_fd, name, 0) != 0 && errno != ENOENT)
                disk_warn(d, "cannot delete %s: %s", name, strerror(errno));
        }
}

/* Deletes the files of d->victims (without mu). */
static void unlink_victims(cache_disk *d) {
    unlink_files(d, d->victims, d->n_victims);
    d->n_victims = 0;
}

/* ---------------------------------------------------------------- I/O */

/* O_DIRECT keeps the page cache for the model and the RAM tier; filesystems without it (tmpfs
 * before Linux 6.6, some FUSE) refuse it with EINVAL, and then buffered I/O is used. An
 * O_CREAT open that fails that way may already have created the file: remove it first. */
static int open_direct(int dir_fd, const char *name, int flags) {
    int fd = openat(dir_fd, name, flags | O_DIRECT | O_CLOEXEC, 0644);
    if (fd >= 0 || errno != EINVAL) return fd;
    if (flags & O_CREAT) unlinkat(dir_fd, name, 0);
    return openat(dir_fd, name, flags | O_CLOEXEC, 0644);
}

static bool op_pending(const disk_op *o) { return !o->err && o->done < o->len; }

/* Accounts one completed transfer of res bytes (or -errno). */
static void op_complete(disk_op *o, int64_t res, bool write) {
    if (res > 0) {
        o->done += (size_t)res; /* short: the rest is resubmitted */
    } else if (res == 0) {
        o->err = write ? EIO : ENODATA;
    } else if ((res == -EINTR || res == -EAGAIN) && ++o->retries < 8) {
        /* transient: resubmitted */
    } else {
        o->err = (int)-res;
    }
}

/* The fallback when io_uring is unavailable (seccomp, old kernel): one operation at a time on
 * the I/O thread. Also finishes whatever a broken ring left pending. */
static void io_sync(disk_op *ops, int n, bool write) {
    for (int i = 0; i < n; i++) {
        disk_op *o = &ops[i];
        while (op_pending(o)) {
            size_t len = o->len - o->done;
            off_t off = o->off + (off_t)o->done;
            ssize_t r = write ? pwrite(o->fd, o->buf + o->done, len, off)
                              : pread(o->fd, o->buf + o->done, len, off);
            op_complete(o, r < 0 ? -(int64_t)errno : (int64_t)r, write);
        }
    }
}

/* Submits ops in batches of up to DISK_RING_DEPTH and reaps every completion of a batch before
 * the next, resubmitting short transfers, until each op is done or failed. On a submission
 * failure the ring is given up and io_sync finishes the rest. */
static void io_ring(cache_disk *d, disk_op *ops, int n, bool write) {
    struct io_uring *ring = &d->ring;
    bool any = true;
    while (any && d->have_ring) {
        any = false;
        for (int i = 0; i < n && d->have_ring;) {
            int batch = 0;
            for (; i < n && batch < DISK_RING_DEPTH; i++) {
                disk_op *o = &ops[i];
                if (!op_pending(o)) continue;
                struct io_uring_sqe *sqe = io_uring_get_sqe(ring);
                if (!sqe) break; /* cannot happen: every batch is reaped before the next */
                size_t len = o->len - o->done;
                unsigned nb = len > DISK_MAX_OP ? DISK_MAX_OP : (unsigned)len;
                uint64_t off = (uint64_t)o->off + o->done;
                if (write)
                    io_uring_prep_write(sqe, o->fd, o->buf + o->done, nb, off);
                else
                    io_uring_prep_read(sqe, o->fd, o->buf + o->done, nb, off);
                io_uring_sqe_set_data(sqe, o);
                batch++;
            }
            int submitted = 0;
            while (submitted < batch) {
                int r = io_uring_submit(ring);
                if (r > 0) {
                    submitted += r;
                } else if (r == 0 || (r != -EINTR && r != -EAGAIN && r != -EBUSY)) {
                    /* SQEs not taken by the kernel stay in the ring, which is not entered
                     * again: io_sync does those operations. */
                    log_warn("cache: disk %s: io_uring submit failed (%s); using pread/pwrite",
                             d->path, strerror(r < 0 ? -r : EIO));
                    d->have_ring = false;
                    break;
                }
            }
            for (int k = 0; k < submitted; k++) {
                struct io_uring_cqe *cqe = NULL;
                int r;
                while ((r = io_uring_wait_cqe(ring, &cqe)) == -EINTR || r == -EAGAIN) continue;
                if (r != 0) {
                    /* Buffers may still be in the kernel's hands: continuing could corrupt the
                     * heap. The ring is private to this thread, so this is a broken invariant. */
                    log_error("cache: disk %s: io_uring wait failed (%s)", d->path, strerror(-r));
                    abort();
                }
                op_complete(io_uring_cqe_get_data(cqe), cqe->res, write);
                io_uring_cqe_seen(ring, cqe);
            }
            if (submitted < batch) {
                /* The ops never taken are still pending; the io_sync below does them. */
                break;
            }
        }
        for (int i = 0; i < n; i++) any |= op_pending(&ops[i]);
    }
}

/* Performs ops (each op's own fd, buffer and offset), concurrently where the ring allows. */
static void disk_io(cache_disk *d, disk_op *ops, int n, bool write) {
    if (d->have_ring) io_ring(d, ops, n, write);
    io_sync(ops, n, write);
}

/* Reads ops[0..n) (with the other calls' in flight, at most DISK_RING_DEPTH) without waiting:
 * read_wait finishes them, so the thread can work while the device does. */
static void read_start(cache_disk *d, disk_op *ops, int n) {
    int batch = 0;
    for (int i = 0; i < n && d->have_ring; i++) {
        if (ops[i].len > DISK_MAX_OP) continue; /* read_wait reads it */
        struct io_uring_sqe *sqe = io_uring_get_sqe(&d->ring);
        if (!sqe) break; /* the ring is full: read_wait does the rest */
        io_uring_prep_read(sqe, ops[i].fd, ops[i].buf, (unsigned)ops[i].len, (uint64_t)ops[i].off);
        io_uring_sqe_set_data(sqe, &ops[i]);
        ops[i].inflight = true;
        batch++;
    }
    for (int submitted = 0; submitted < batch;) {
        int r = io_uring_submit(&d->ring);
        if (r > 0) {
            submitted += r;
            continue;
        }
        if (r == -EINTR || r == -EAGAIN || r == -EBUSY) continue;
        /* SQEs the kernel did not take stay in the ring, which is not entered again: their
         * ops are not in flight, and read_wait reads them itself. */
        log_warn("cache: disk %s: io_uring submit failed (%s); using pread", d->path,
                 strerror(r < 0 ? -r : EIO));
        d->have_ring = false;
        for (int i = 0, k = 0; i < n; i++)
            if (ops[i].inflight && k++ >= submitted) ops[i].inflight = false;
        break;
    }
}

/* Waits until ops[0..n) (started by read_start) are done or failed: completions of other ops in
 * flight are accounted as they come; what the ring did not finish is read here. */
static void read_wait(cache_disk *d, disk_op *ops, int n) {
    for (;;) {
        bool waiting = false;
        for (int i = 0; i < n && !waiting; i++) waiting = ops[i].inflight;
        if (!waiting) break;
        struct io_uring_cqe *cqe = NULL;
        int r;
        while ((r = io_uring_wait_cqe(&d->ring, &cqe)) == -EINTR || r == -EAGAIN) continue;
        if (r != 0) {
            /* Buffers may still be in the kernel's hands (see io_ring). */
            log_error("cache: disk %s: io_uring wait failed (%s)", d->path, strerror(-r));
            abort();
        }
        disk_op *o = io_uring_cqe_get_data(cqe);
        o->inflight = false;
        op_complete(o, cqe->res, false);
        io_uring_cqe_seen(&d->ring, cqe);
    }
    /* Short reads, retries, no ring: here, one at a time. Not through the ring, where this
     * thread would reap the completions of the other group's reads. */
    io_sync(ops, n, false);
}

/* ---------------------------------------------------------------- the I/O thread's jobs */

/* Writes c to a temporary file, renames it into place, publishes it and evicts down to the cap;
 * any failure leaves no file and counts a write error. Drops the queue's reference to c. */
/* Writes hdr[header_bytes] then body[body_len] (whole CACHE_ALIGN blocks) to a temporary file
 * and renames it to name: 0, or an errno with *what the step that failed (no file left). */
static int write_file(cache_disk *d, const cache_key *k, const char *name, uint8_t *hdr,
                      uint8_t *body, size_t body_len, const char **what) {
    char hex[2 * CACHE_KEY_BYTES + 1], tmp[DISK_TMP_NAME];
    cache_key_hex(k, hex);
    snprintf(tmp, sizeof tmp, "tmp-%s-%ld-%llu.part", hex, (long)getpid(),
             (unsigned long long)++d->tmp_counter);
    *what = "create";
    int fd = open_direct(d->dir_fd, tmp, O_WRONLY | O_CREAT | O_EXCL);
    if (fd < 0) return errno;
    disk_op ops[2] = {
        {.fd = fd, .buf = hdr, .len = d->header_bytes, .off = 0},
        {.fd = fd, .buf = body, .len = body_len, .off = (off_t)d->header_bytes},
    };
    disk_io(d, ops, 2, true);
    int err = ops[0].err ? ops[0].err : ops[1].err;
    *what = "write";
    if (close(fd) != 0 && !err) err = errno;
    if (!err && renameat(d->dir_fd, tmp, d->dir_fd, name) != 0) {
        err = errno;
        *what = "rename";
    }
    if (err) unlinkat(d->dir_fd, tmp, 0);
    return err;
}

/* Queues published entry e's chunk c for the encoder (caller holds mu); a full queue leaves
 * the record lossless only (counted as dropped). */
static void encode_queue_locked(cache_disk *d, disk_entry *e, cache_chunk *c) {
    if (d->encoder && !chunk_worker_queue(d->encoder, c, e->gen)) d->st.dropped++;
}

static void disk_write(cache_disk *d, cache_chunk *c) {
    char name[DISK_NAME_MAX];
    file_name(d, &c->key, CACHE_ENC_RAW, name);
    cache_record_encode_header(&d->layout, c, d->hdr);
    const char *what;
    /* The payload's padding is zeroed by cache_chunk_create: whole CACHE_ALIGN blocks. */
    int err = write_file(d, &c->key, name, d->hdr, c->data, padded(c->bytes), &what);

    pthread_mutex_lock(&d->mu);
    disk_entry *e = table_find(d, &c->key); /* the writing entry cache_disk_put made */
    if (!e || !e->writing) {
        log_error("cache: disk index lost a record being written");
        abort();
    }
    if (err) {
        d->st.write_errors++;
        entry_drop(d, e);
    } else if (e->doomed) {
        if (victim_entry(d, e))
            entry_drop(d, e);
        else
            entry_publish(d, e); /* out of memory: keep it indexed rather than orphaned */
    } else {
        entry_publish(d, e);
        d->st.bytes_in += e->bytes;
        supersede_locked(d, e);
        evict_locked(d);
        if (table_find(d, &c->key) == e) encode_queue_locked(d, e, c);
    }
    pthread_mutex_unlock(&d->mu);
    unlink_victims(d);
    if (err) disk_warn(d, "cannot %s record %s: %s", what, name, strerror(err));
    cache_chunk_unref(c);
}

/* Writes the encoder's files of one record, and indexes them with it; files whose record has
 * gone since (evicted, cleared, superseded), or would take a pinned record's pins over half the
 * tier, are deleted again. Frees s. */
static void disk_write_sidecars(cache_disk *d, disk_sidecars *s) {
    disk_files written = 0;
    uint64_t size[CACHE_ENC_MAX] = {0};
    char name[DISK_NAME_MAX];
    for (int e = 1; e < CACHE_ENC_MAX; e++) {
        if (!s->buf[e]) continue;
        const char *what;
        file_name(d, &s->key, e, name);
        int err = write_file(d, &s->key, name, s->buf[e], s->buf[e] + d->header_bytes,
                             s->len[e] - d->header_bytes, &what);
        if (err) {
            disk_warn(d, "cannot %s %s: %s", what, name, strerror(err));
            pthread_mutex_lock(&d->mu);
            d->st.write_errors++;
            pthread_mutex_unlock(&d->mu);
            continue;
        }
        written |= (disk_files)(1u << e);
        size[e] = s->len[e];
    }
    pthread_mutex_lock(&d->mu);
    disk_entry *e = table_find(d, &s->key);
    int64_t added = 0;
    for (int i = 1; i < CACHE_ENC_MAX; i++)
        added += size[i] ? (int64_t)size[i] - (int64_t)d->header_bytes : 0;
    /* a pinned record's encodings are pinned too: only as far as the pin cap allows */
    bool room = e && (!e->pinned || d->pinned_bytes + added <= pin_cap(d));
    if (e && e->gen == s->gen && !e->writing && room) {
        for (int i = 1; i < CACHE_ENC_MAX; i++)
            if (size[i]) {
                entry_set_enc(d, e, i, size[i]);
                d->st.bytes_in += (int64_t)size[i] - (int64_t)d->header_bytes;
            }
        evict_locked(d);
    } else if (written && !victim_push(d, &s->key, written)) {
        log_error("cache: disk %s: out of memory: encoded files of a dropped record left behind",
                  d->path);
    }
    pthread_mutex_unlock(&d->mu);
    unlink_victims(d);
    for (int i = 0; i < CACHE_ENC_MAX; i++) free(s->buf[i]);
    free(s);
}

/* The encoder's work on record c (of entry generation gen): its encodings, made while its entry
 * lives and the tier is not stopping, handed to the I/O thread (waiting while it writes the
 * previous record's). */
static void encode_record(void *ud, cache_chunk *c, uint64_t gen) {
    cache_disk *d = ud;
    disk_sidecars *s = calloc(1, sizeof *s);
    bool made = false;
    if (s) {
        s->key = c->key;
        s->gen = gen;
    }
    for (int e = 1; s && e < d->n_enc; e++) {
        pthread_mutex_lock(&d->mu);
        disk_entry *en = table_find(d, &c->key);
        bool live = en && en->gen == gen && d->encoder;
        pthread_mutex_unlock(&d->mu);
        if (!live) break;
        size_t cap = padded(cache_enc_bound(&d->layout, d->table, e, c->n_blocks));
        void *buf = NULL;
        if (cap == 0 || posix_memalign(&buf, CACHE_ALIGN, d->header_bytes + cap) != 0) continue;
        kv_error err = {{0}};
        uint8_t *payload = (uint8_t *)buf + d->header_bytes;
        int64_t len =
            cache_enc_encode(&d->layout, d->table, e, c, d->enc_scratch, payload, cap, &err);
        if (len <= 0) {
            log_debug("cache: disk: chunk not encoded as %d: %s", e, err.msg);
            free(buf);
            continue;
        }
        memset(payload + len, 0, padded((size_t)len) - (size_t)len);
        cache_record_encode_header_as(&d->layout, c, (uint32_t)e, payload, (size_t)len, buf);
        s->buf[e] = buf;
        s->len[e] = d->header_bytes + padded((size_t)len);
        made = true;
    }
    if (!made) {
        free(s);
        return;
    }
    pthread_mutex_lock(&d->mu);
    while (d->handoff) pthread_cond_wait(&d->done, &d->mu);
    d->handoff = s;
    pthread_cond_signal(&d->work);
    pthread_mutex_unlock(&d->mu);
}

/* The encoder's first work: what decoding costs here, for the fetch policy. */
static void encoder_first(void *ud) {
    cache_disk *d = ud;
    double dec_ns[CACHE_ENC_MAX] = {0};
    cache_meter_measure(&d->layout, d->table, DISK_DECODE_THREADS, d->enc_scratch, dec_ns);
    pthread_mutex_lock(&d->mu);
    cache_meter_set_decode(&d->meter, dec_ns);
    pthread_mutex_unlock(&d->mu);
}

typedef enum read_result {
    READ_OK,
    READ_SKIPPED,  /* transient (out of memory, out of descriptors): a miss, record kept */
    READ_VANISHED, /* the file is gone: a miss, dropped from the index */
    READ_CORRUPT,  /* torn, unreadable or failing a check: deleted and counted */
} read_result;

typedef struct read_slot {
    int idx; /* into the job's keys and out */
    uint64_t gen;
    int n_blocks;
    uint64_t size[CACHE_ENC_MAX]; /* the entry's files */
    int enc;                      /* the file read */
    int fd;
    cache_chunk *c;
    read_result result;
    int bad_enc; /* an encoding that failed (then the record was read instead; 0: none) */
    read_result bad_result;
} read_slot;

/* Checks a record read into hdr and payload[0..body): the header (of level enc), the key it
 * names against the one asked for, its block count against the index's, its payload's size
 * against what was read, the payload checksum. Then fills c's keys, namespace and position from
 * the header and, for an encoding, decodes the payload into c. 0; -1 with err when the record
 * fails a check; 1 with err when decoding ran out of memory (the file may be sound). */
static int read_verify(cache_disk *d, int enc, const uint8_t *hdr, const uint8_t *payload,
                       size_t body, const cache_key *key, cache_chunk *c, kv_error *err) {
    cache_record_info info;
    if (enc == CACHE_ENC_RAW
            ? cache_record_decode_header(hdr, d->header_bytes, &d->layout, &info, err) != 0
            : cache_record_decode_header_encoded(hdr, d->header_bytes, &d->layout, d->max_payload,
                                                 &info, err) != 0)
        return -1;
    if (memcmp(info.key.b, key->b, CACHE_KEY_BYTES) != 0)
        return kv_fail(err, "header names another key");
    if (info.level != (uint32_t)enc)
        return kv_fail(err, "header has level %u, its name %d", info.level, enc);
    if (info.n_blocks != c->n_blocks)
        return kv_fail(err, "header has %d blocks, the index %d", info.n_blocks, c->n_blocks);
    if (info.payload_bytes > body)
        return kv_fail(err, "header has a %llu-byte payload, the file %zu bytes after it",
                       (unsigned long long)info.payload_bytes, body);
    if (cache_record_check_payload(&info, payload, err) != 0) return -1;
    memcpy(c->bkeys, info.bkeys, (size_t)info.n_blocks * CACHE_KEY_BYTES);
    c->key = info.key;
    c->ns = info.ns;
    c->pos0 = info.pos0;
    if (enc == CACHE_ENC_RAW) return 0;
    uint64_t t0 = clock_now_ns();
    if (cache_enc_decode(&d->layout, d->table, enc, payload, (size_t)info.payload_bytes, c,
                         d->scratch, DISK_DECODE_THREADS, err) != 0)
        return strstr(err->msg, "out of memory") ? 1 : -1;
    pthread_mutex_lock(&d->mu);
    cache_meter_decode(&d->meter, enc, (double)c->bytes / 2, clock_now_ns() - t0);
    pthread_mutex_unlock(&d->mu);
    return 0;
}

/* One record of a read job in flight: its slot, header buffer and reads (header, payload). */
typedef struct read_inflight {
    read_slot *sl;
    uint8_t *hdr;     /* header_bytes, aligned */
    uint8_t *payload; /* an encoding's payload (aligned, allocated); NULL: into the chunk */
    uint64_t t_start; /* when its reads were started */
    disk_op ops[2];
} read_inflight;

/* Opens r's record in encoding sl->enc and starts reading it (no reads when sl->c stays NULL:
 * result says why). */
static void read_record_start(cache_disk *d, disk_job *j, read_inflight *r) {
    static const cache_key zero_ns;
    char name[DISK_NAME_MAX];
    read_slot *sl = r->sl;
    sl->c = NULL;
    r->payload = NULL;
    file_name(d, &j->keys[sl->idx], sl->enc, name);
    sl->fd = open_direct(d->dir_fd, name, O_RDONLY);
    if (sl->fd < 0) {
        sl->result = errno == ENOENT ? READ_VANISHED : READ_SKIPPED;
        return;
    }
    /* Keys, ns and pos0 come from the header, once it has been checked. */
    sl->c = cache_chunk_create(&d->layout, NULL, sl->n_blocks, &zero_ns, 0);
    size_t body = padded(sl->c ? sl->c->bytes : 0);
    if (sl->c && sl->enc != CACHE_ENC_RAW) {
        void *p = NULL;
        body = sl->size[sl->enc] - d->header_bytes;
        if (posix_memalign(&p, CACHE_ALIGN, body) != 0) p = NULL;
        r->payload = p;
    }
    if (!sl->c || (sl->enc != CACHE_ENC_RAW && !r->payload)) {
        if (sl->c) cache_chunk_unref(sl->c);
        sl->c = NULL;
        sl->result = READ_SKIPPED;
        return;
    }
    r->ops[0] = (disk_op){.fd = sl->fd, .buf = r->hdr, .len = d->header_bytes, .off = 0};
    r->ops[1] = (disk_op){.fd = sl->fd,
                          .buf = r->payload ? r->payload : sl->c->data,
                          .len = body,
                          .off = (off_t)d->header_bytes};
    r->t_start = clock_now_ns();
    read_start(d, r->ops, 2);
}

/* Finishes r's reads and verifies its record. first: the job's first record, whose read time
 * samples the disk's rate. An encoding that fails is noted in the slot, and the record is read
 * instead. */
static void read_record_finish(cache_disk *d, disk_job *j, read_inflight *r, bool first) {
    read_slot *sl = r->sl;
    if (sl->c) read_wait(d, r->ops, 2);
    uint64_t took = clock_now_ns() - r->t_start;
    if (sl->fd >= 0) close(sl->fd);
    if (sl->c) {
        char name[DISK_NAME_MAX];
        file_name(d, &j->keys[sl->idx], sl->enc, name);
        int e = r->ops[0].err ? r->ops[0].err : r->ops[1].err;
        kv_error err = {{0}};
        int v;
        if (e) {
            /* Short (torn) or unreadable records are dropped; other errors may pass. */
            sl->result = e == ENODATA || e == EIO ? READ_CORRUPT : READ_SKIPPED;
            disk_warn(d, "cannot read %s: %s", name,
                      e == ENODATA ? "file shorter than its record" : strerror(e));
        } else if ((v = read_verify(d, sl->enc, r->hdr, r->payload ? r->payload : sl->c->data,
                                    r->ops[1].len, &j->keys[sl->idx], sl->c, &err)) != 0) {
            sl->result = v > 0 ? READ_SKIPPED : READ_CORRUPT;
            disk_warn(d, "%s %s: %s", v > 0 ? "cannot decode" : "dropping", name, err.msg);
        } else {
            sl->result = READ_OK;
            if (first && j->policy) {
                pthread_mutex_lock(&d->mu);
                cache_meter_link(&d->meter, sl->size[sl->enc], took);
                pthread_mutex_unlock(&d->mu);
            }
        }
        if (sl->result != READ_OK) {
            cache_chunk_unref(sl->c);
            sl->c = NULL;
        }
    }
    free(r->payload);
    r->payload = NULL;
    if (sl->result != READ_OK && sl->enc != CACHE_ENC_RAW) {
        sl->bad_enc = sl->enc;
        sl->bad_result = sl->result;
        sl->enc = CACHE_ENC_RAW;
        read_record_start(d, j, r);
        read_record_finish(d, j, r, false);
    }
}

/* A read job: every published key's record, DISK_READ_AHEAD in flight at a time, each in the
 * encoding the job's policy chooses. */
static void disk_read_job(cache_disk *d, disk_job *j) {
    read_slot *slots = calloc((size_t)j->n, sizeof *slots);
    void *hdrs = NULL;
    if (!slots || posix_memalign(&hdrs, CACHE_ALIGN, DISK_READ_AHEAD * d->header_bytes) != 0) {
        free(slots);
        pthread_mutex_lock(&d->mu);
        d->st.misses += j->n;
        pthread_mutex_unlock(&d->mu);
        return;
    }
    int m = 0;
    pthread_mutex_lock(&d->mu);
    for (int i = 0; i < j->n; i++) {
        disk_entry *e = table_find(d, &j->keys[i]);
        if (!e || e->writing) continue;
        slots[m] = (read_slot){.idx = i, .gen = e->gen, .n_blocks = e->n_blocks};
        memcpy(slots[m++].size, e->size, sizeof e->size);
    }
    pthread_mutex_unlock(&d->mu);

    /* records k + 1 .. k + DISK_READ_AHEAD - 1 read while record k is checked (and decoded) */
    uint64_t t0 = j->policy && j->policy->start_ns ? j->policy->start_ns : clock_now_ns();
    cache_meter_plan plan = {0, 0};
    read_inflight fl[DISK_READ_AHEAD];
    for (int k = 0; k < DISK_READ_AHEAD; k++) fl[k].hdr = (uint8_t *)hdrs + k * d->header_bytes;
    for (int k = 0; k < m + DISK_READ_AHEAD - 1; k++) {
        if (k < m) {
            read_slot *sl = &slots[k];
            if (j->policy && d->n_enc > 1) {
                pthread_mutex_lock(&d->mu);
                sl->enc = cache_meter_choose(&d->meter, j->policy, sl->size,
                                             sl->n_blocks * d->layout.block_tokens, k, m, t0, false,
                                             &plan);
                pthread_mutex_unlock(&d->mu);
            }
            fl[k % DISK_READ_AHEAD].sl = sl;
            read_record_start(d, j, &fl[k % DISK_READ_AHEAD]);
        }
        int done = k - (DISK_READ_AHEAD - 1);
        if (done >= 0) read_record_finish(d, j, &fl[done % DISK_READ_AHEAD], done == 0);
    }

    pthread_mutex_lock(&d->mu);
    d->st.misses += j->n - m; /* not indexed */
    for (int s = 0; s < m; s++) {
        read_slot *sl = &slots[s];
        disk_entry *e = table_find(d, &j->keys[sl->idx]);
        bool same = e && e->gen == sl->gen && !e->writing;
        if (same && sl->bad_enc && sl->bad_result != READ_SKIPPED && e->size[sl->bad_enc]) {
            /* an encoding gone or refused: the record keeps its others (a file that cannot be
             * queued for deletion, for want of memory, stays indexed) */
            bool corrupt = sl->bad_result == READ_CORRUPT;
            if (corrupt) d->st.corrupt++;
            if (!corrupt || victim_push(d, entry_key(e), (disk_files)(1u << sl->bad_enc)))
                entry_set_enc(d, e, sl->bad_enc, 0);
        }
        if (sl->result == READ_OK) {
            j->out[sl->idx] = sl->c;
            if (j->enc_out) j->enc_out[sl->idx] = (uint8_t)sl->enc;
            d->st.hits++;
            d->st.enc_hits[sl->enc]++;
            d->st.bytes_out += sl->enc == CACHE_ENC_RAW
                                   ? (int64_t)sl->c->bytes
                                   : (int64_t)sl->size[sl->enc] - (int64_t)d->header_bytes;
            if (same) lru_touch(&d->lru, &e->lru);
            continue;
        }
        d->st.misses++;
        /* Only the entry that was read is dropped: a clear and a new write of the same key
         * since then made a new entry (another gen) whose file is sound. */
        if (!same) continue;
        if (sl->result == READ_VANISHED) {
            if (victim_push(d, entry_key(e), entry_files(e) & ~(disk_files)1)) entry_drop(d, e);
        } else if (sl->result == READ_CORRUPT) {
            d->st.corrupt++;
            if (victim_entry(d, e)) entry_drop(d, e);
        }
    }
    pthread_mutex_unlock(&d->mu);
    unlink_victims(d);
    free(hdrs);
    free(slots);
}

static void disk_unlink_job(cache_disk *d, disk_job *j) {
    unlink_files(d, j->victims, (size_t)j->n);
}

/* ---------------------------------------------------------------- leases file */

typedef struct lease_walk {
    cache_lease *out; /* NULL: count only */
    int n;
    int64_t now; /* expire: leases due at or before it end */
    int64_t next;
    int ended;
    cache_disk *d;
} lease_walk;

static void lease_collect(void *ud, kt_node *node) {
    lease_walk *w = ud;
    const disk_entry *e = KT_ENTRY(node, disk_entry, by_key);
    if (e->lease <= 0 || e->doomed) return;
    if (w->out) w->out[w->n] = (cache_lease){*entry_key(e), e->lease};
    w->n++;
}

/* Rewrites the leases file from the index (I/O thread, called and returning with mu held; the
 * file is written without it). A failure is logged: the leases then hold until a restart. */
static void leases_write_locked(cache_disk *d) {
    d->leases_dirty = false;
    lease_walk w = {0};
    keytable_each(&d->records, lease_collect, &w);
    size_t bytes = cache_leases_bytes(w.n);
    uint8_t *buf = malloc(bytes);
    w.out = malloc(sizeof *w.out * (size_t)(w.n ? w.n : 1));
    if (buf && w.out) {
        w.n = 0;
        keytable_each(&d->records, lease_collect, &w);
    }
    pthread_mutex_unlock(&d->mu);
    const char *what = "encode";
    int err = !buf || !w.out ? ENOMEM : cache_leases_encode(w.out, w.n, buf) ? EIO : 0;
    if (!err) {
        what = "write";
        int fd = openat(d->dir_fd, DISK_LEASES_TMP, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        size_t done = 0;
        while (fd >= 0 && done < bytes) {
            ssize_t k = write(fd, buf + done, bytes - done);
            if (k < 0 && errno == EINTR) continue;
            if (k <= 0) break;
            done += (size_t)k;
        }
        err = fd < 0 ? errno : done < bytes ? (errno ? errno : EIO) : 0;
        if (fd >= 0 && close(fd) != 0 && !err) err = errno;
        if (!err && renameat(d->dir_fd, DISK_LEASES_TMP, d->dir_fd, DISK_LEASES) != 0) {
            err = errno;
            what = "rename";
        }
    }
    if (err) disk_warn(d, "cannot %s the leases file: %s", what, strerror(err));
    free(buf);
    free(w.out);
    pthread_mutex_lock(&d->mu);
}

/* Waiting callers' jobs first, then queued writes; exits once stopped and drained. */
static void *disk_thread(void *arg) {
    cache_disk *d = arg;
    pthread_mutex_lock(&d->mu);
    for (;;) {
        if (d->jobs) {
            disk_job *j = d->jobs;
            d->jobs = j->next;
            if (!d->jobs) d->jobs_tail = NULL;
            pthread_mutex_unlock(&d->mu);
            if (j->kind == DISK_JOB_READ)
                disk_read_job(d, j);
            else
                disk_unlink_job(d, j);
            pthread_mutex_lock(&d->mu);
            j->done = true;
            pthread_cond_broadcast(&d->done);
        } else if (d->wq_len) {
            cache_chunk *c = d->wq[d->wq_head];
            d->wq_head = (d->wq_head + 1) % (d->write_queue > 0 ? d->write_queue : 1);
            d->wq_len--;
            pthread_mutex_unlock(&d->mu);
            disk_write(d, c);
            pthread_mutex_lock(&d->mu);
            /* After the write's deletions too, so a flush sees the directory settled. */
            d->n_writes--;
            pthread_cond_broadcast(&d->done);
        } else if (d->handoff) {
            disk_sidecars *sc = d->handoff;
            pthread_mutex_unlock(&d->mu);
            disk_write_sidecars(d, sc);
            pthread_mutex_lock(&d->mu);
            d->handoff = NULL;
            pthread_cond_broadcast(&d->done);
        } else if (d->leases_dirty) {
            leases_write_locked(d);
        } else if (d->stop) {
            break;
        } else {
            pthread_cond_wait(&d->work, &d->mu);
        }
    }
    pthread_mutex_unlock(&d->mu);
    return NULL;
}

/* Queues j and waits until the I/O thread has run it (caller holds mu). */
static void job_run_locked(cache_disk *d, disk_job *j) {
    j->done = false;
    j->next = NULL;
    if (d->jobs_tail)
        d->jobs_tail->next = j;
    else
        d->jobs = j;
    d->jobs_tail = j;
    pthread_cond_signal(&d->work);
    while (!j->done) pthread_cond_wait(&d->done, &d->mu);
}

/* ---------------------------------------------------------------- open */

/* mkdir -p: every missing component of path, 0755. */
static ssize_t read_full(int fd, uint8_t *buf, size_t len) {
    size_t got = 0;
    while (got < len) {
        ssize_t r = pread(fd, buf + got, len - got, (off_t)got);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return -1;
        if (r == 0) break;
        got += (size_t)r;
    }
    return (ssize_t)got;
}

typedef struct scan_item {
    disk_entry *e;
    struct timespec mtime;
} scan_item;

static int scan_item_cmp(const void *a, const void *b) {
    const struct timespec *x = &((const scan_item *)a)->mtime, *y = &((const scan_item *)b)->mtime;
    if (x->tv_sec != y->tv_sec) return x->tv_sec < y->tv_sec ? -1 : 1;
    return (x->tv_nsec > y->tv_nsec) - (x->tv_nsec < y->tv_nsec);
}

/* Checks one file at open, of a record (enc 0) or an encoding: header, key and level against the
 * name, size. 0 and info when valid; -1 with err (the caller deletes it); 1 when it cannot be
 * opened (left alone). */
static int scan_check(cache_disk *d, const char *name, const cache_key *key, int enc, off_t size,
                      uint8_t *hdr, cache_record_info *info, kv_error *err) {
    int fd = openat(d->dir_fd, name, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 1;
    ssize_t got = read_full(fd, hdr, d->header_bytes);
    int saved = errno;
    close(fd);
    if (got < 0) return kv_fail(err, "%s", strerror(saved));
    if (enc == CACHE_ENC_RAW
            ? cache_record_decode_header(hdr, (size_t)got, &d->layout, info, err) != 0
            : cache_record_decode_header_encoded(hdr, (size_t)got, &d->layout, d->max_payload, info,
                                                 err) != 0)
        return -1;
    if (memcmp(info->key.b, key->b, CACHE_KEY_BYTES) != 0)
        return kv_fail(err, "header names another key");
    if (info->level != (uint32_t)enc)
        return kv_fail(err, "header has level %u, its name %d", info->level, enc);
    size_t want = cache_record_file_bytes(&d->layout, (size_t)info->payload_bytes);
    if ((uint64_t)size != (uint64_t)want)
        return kv_fail(err, "file has %lld bytes, its record %zu", (long long)size, want);
    return 0;
}

/* Indexes the directory's valid records, oldest modification first in the LRU list; deletes
 * temporary files and invalid records (counted as corrupt). */
static int disk_scan(cache_disk *d, kv_error *err) {
    int fd = dup(d->dir_fd);
    DIR *dir = fd >= 0 ? fdopendir(fd) : NULL;
    if (!dir) {
        if (fd >= 0) close(fd);
        return kv_fail(err, "cannot list %s: %s", d->path, strerror(errno));
    }
    uint8_t *hdr = malloc(d->header_bytes);
    scan_item *items = NULL;
    size_t n_items = 0, cap_items = 0, n_side = 0, cap_side = 0;
    disk_victim *side = NULL; /* encodings' files: their records' keys, one file each */
    int64_t stale = 0;
    int rc = 0;
    if (!hdr) {
        rc = kv_fail(err, "out of memory");
        goto done;
    }
    struct dirent *de;
    while ((de = readdir(dir))) {
        const char *name = de->d_name;
        cache_key key;
        /* A temporary file is a write that never finished (a crash or kill -9; the directory
         * has one writer, this process once open): a torn record. */
        if (ends_with(name, ".part")) {
            if (unlinkat(d->dir_fd, name, 0) == 0) d->st.corrupt++;
            continue;
        }
        int enc;
        if (!file_name_parse(name, &key, &enc)) continue; /* not ours: left alone */
        struct stat sb;
        if (fstatat(d->dir_fd, name, &sb, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(sb.st_mode))
            continue;
        if (enc != CACHE_ENC_RAW) {
            /* checked once their records are indexed; of an encoding not kept (another codec
             * table, or none): deleted */
            char want[DISK_NAME_MAX];
            file_name(d, &key, enc, want);
            if (enc >= d->n_enc || strcmp(want, name) != 0) {
                stale += unlinkat(d->dir_fd, name, 0) == 0;
                continue;
            }
            disk_victim *v = grown(side, n_side, &cap_side, sizeof *side);
            if (!v) {
                rc = kv_fail(err, "out of memory");
                goto done;
            }
            side = v;
            side[n_side++] = (disk_victim){key, (disk_files)(1u << enc)};
            continue;
        }
        cache_record_info info;
        kv_error why = {{0}};
        int r = scan_check(d, name, &key, CACHE_ENC_RAW, sb.st_size, hdr, &info, &why);
        if (r > 0) continue;
        if (r < 0) {
            log_warn("cache: disk %s: deleting %s: %s", d->path, name, why.msg);
            if (unlinkat(d->dir_fd, name, 0) == 0) d->st.corrupt++;
            continue;
        }
        scan_item *v = grown(items, n_items, &cap_items, sizeof *items);
        if (!v) {
            rc = kv_fail(err, "out of memory");
            goto done;
        }
        items = v;
        disk_entry *e = table_add(d, (const cache_key *)(const void *)info.bkeys, info.n_blocks,
                                  &info.ns, (int64_t)info.payload_bytes);
        if (!e) {
            rc = kv_fail(err, "out of memory");
            goto done;
        }
        items[n_items++] = (scan_item){e, sb.st_mtim};
    }
    if (n_items) qsort(items, n_items, sizeof *items, scan_item_cmp);
    for (size_t i = 0; i < n_items; i++) entry_publish(d, items[i].e);
    for (size_t i = 0; i < n_side; i++) {
        char name[DISK_NAME_MAX];
        int enc = __builtin_ctz(side[i].files);
        file_name(d, &side[i].key, enc, name);
        disk_entry *e = table_find(d, &side[i].key);
        struct stat sb;
        cache_record_info info;
        kv_error why = {{0}};
        int r = !e ? -1
                : fstatat(d->dir_fd, name, &sb, AT_SYMLINK_NOFOLLOW) != 0
                    ? 1
                    : scan_check(d, name, &side[i].key, enc, sb.st_size, hdr, &info, &why);
        if (r == 0 && info.n_blocks != e->n_blocks)
            r = kv_fail(&why, "%d blocks, its record %d", info.n_blocks, e->n_blocks);
        if (r == 0) {
            entry_set_enc(d, e, enc, (uint64_t)sb.st_size);
        } else if (!e) { /* its record was deleted before it (a crash in between) */
            stale += unlinkat(d->dir_fd, name, 0) == 0;
        } else if (r < 0) {
            log_warn("cache: disk %s: deleting %s: %s", d->path, name, why.msg);
            if (unlinkat(d->dir_fd, name, 0) == 0) d->st.corrupt++;
        }
    }
    if (stale)
        log_info("cache: disk %s: %lld encoded files of no record or encoding kept deleted",
                 d->path, (long long)stale);
    evict_locked(d);
    unlink_victims(d);
done:
    /* On failure the entries already added are freed with the table by disk_free. */
    closedir(dir);
    free(items);
    free(side);
    free(hdr);
    return rc;
}

static void free_entry(void *ud, kt_node *n) {
    (void)ud;
    free(KT_ENTRY(n, disk_entry, by_key));
}

static void disk_free(cache_disk *d) {
    keytable_each(&d->records, free_entry, NULL);
    if (d->have_ring) io_uring_queue_exit(&d->ring);
    if (d->dir_fd >= 0) close(d->dir_fd);
    pthread_cond_destroy(&d->done);
    pthread_cond_destroy(&d->work);
    pthread_mutex_destroy(&d->mu);
    keytable_free(&d->records);
    keytable_free(&d->blocks);
    free(d->wq);
    free(d->scratch);
    free(d->enc_scratch);
    free(d->hdr);
    free(d->victims);
    free(d->path);
    free(d);
}

/* Stops the encoder (what it has not begun is not encoded), then the I/O thread. */
static void threads_stop(cache_disk *d) {
    /* No record is queued for the encoder once it is out of the tier. */
    pthread_mutex_lock(&d->mu);
    chunk_worker *w = d->encoder;
    d->encoder = NULL;
    pthread_mutex_unlock(&d->mu);
    chunk_worker_stop(w);
    /* The I/O thread drains the jobs and writes still queued before it sees stop. */
    pthread_mutex_lock(&d->mu);
    d->stop = true;
    pthread_cond_signal(&d->work);
    pthread_mutex_unlock(&d->mu);
    if (d->thread_started) pthread_join(d->thread, NULL);
    d->thread_started = false;
}

cache_disk *cache_disk_open(const char *dir, const cache_layout *l, int64_t cap_bytes,
                            int write_queue, kv_error *err) {
    return cache_disk_open_enc(dir, l, cap_bytes, write_queue, NULL, false, err);
}

cache_disk *cache_disk_open_enc(const char *dir, const cache_layout *l, int64_t cap_bytes,
                                int write_queue, const codec_table *table, bool encode,
                                kv_error *err) {
    if (cache_layout_check(l, err) != 0) {
        kv_fail_wrap(err, "cache disk");
        return NULL;
    }
    if (encode && cache_enc_check_table(l, table, err)) {
        kv_fail_wrap(err, "cache disk");
        return NULL;
    }
    if (!dir || !*dir) {
        kv_fail(err, "cache disk: no directory given");
        return NULL;
    }
    if (cap_bytes < 0 || write_queue < 0 || write_queue > DISK_MAX_WRITE_QUEUE) {
        kv_fail(err, "cache disk: cap %lld bytes or write queue %d out of range",
                (long long)cap_bytes, write_queue);
        return NULL;
    }
    cache_disk *d = calloc(1, sizeof *d);
    if (!d) {
        kv_fail(err, "cache disk: out of memory");
        return NULL;
    }
    d->dir_fd = -1;
    pthread_mutex_init(&d->mu, NULL);
    pthread_cond_init(&d->work, NULL);
    pthread_cond_init(&d->done, NULL);
    d->layout = *l;
    d->table = encode ? table : NULL;
    d->n_enc = encode ? cache_enc_count(table) : 1;
    for (int e = 1; e < d->n_enc; e++) {
        size_t b = cache_enc_bound(l, d->table, e, cache_chunk_blocks(l));
        if (b > d->max_payload) d->max_payload = b;
    }
    cache_meter_init(&d->meter, l, d->n_enc, DISK_PRIOR_BW);
    d->header_bytes = cache_record_header_bytes(l);
    d->cap = cap_bytes;
    d->write_queue = write_queue;

    char model_hex[2 * CACHE_KEY_BYTES + 1];
    cache_key model;
    memcpy(model.b, l->model_id, CACHE_KEY_BYTES);
    cache_key_hex(&model, model_hex);
    size_t n = strlen(dir) + 18;
    d->path = malloc(n);
    bool tables = keytable_init(&d->records, CACHE_KEY_BYTES) == 0 &&
                  keytable_init(&d->blocks, CACHE_KEY_BYTES) == 0;
    d->wq = calloc(write_queue > 0 ? (size_t)write_queue : 1, sizeof *d->wq);
    void *hdr = NULL;
    if (posix_memalign(&hdr, CACHE_ALIGN, d->header_bytes) != 0) hdr = NULL;
    d->hdr = hdr;
    bool enc_ok = true;
    if (d->n_enc > 1) {
        d->scratch = malloc(sizeof(float) * cache_enc_scratch_floats(l));
        d->enc_scratch = malloc(sizeof(float) * cache_enc_scratch_floats(l));
        enc_ok = d->scratch && d->enc_scratch;
    }
    if (!d->path || !tables || !d->wq || !d->hdr || !enc_ok) {
        kv_fail(err, "cache disk: out of memory");
        goto fail;
    }
    snprintf(d->path, n, "%s/%.16s", dir, model_hex);
    if (kv_mkdir_p(d->path, err) != 0) goto fail;
    d->dir_fd = open(d->path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (d->dir_fd < 0 || faccessat(d->dir_fd, ".", W_OK | X_OK, AT_EACCESS) != 0) {
        kv_fail(err, "cannot use cache directory %s: %s", d->path, strerror(errno));
        goto fail;
    }
    if (disk_scan(d, err) != 0) {
        kv_fail_wrap(err, "cache disk %s", d->path);
        goto fail;
    }

    int r = io_uring_queue_init(DISK_RING_DEPTH, &d->ring, 0);
    d->have_ring = r == 0;
    if (r != 0)
        log_warn("cache: disk %s: io_uring unavailable (%s); using pread/pwrite", d->path,
                 strerror(-r));
    if (pthread_create(&d->thread, NULL, disk_thread, d) != 0) {
        kv_fail(err, "cache disk: cannot start the I/O thread");
        goto fail;
    }
    d->thread_started = true;
    if (d->n_enc > 1) {
        chunk_worker *w =
            chunk_worker_start(DISK_ENCODE_QUEUE, encode_record, encoder_first, d, err);
        if (!w) {
            kv_fail_wrap(err, "cache disk");
            goto fail;
        }
        pthread_mutex_lock(&d->mu);
        d->encoder = w;
        pthread_mutex_unlock(&d->mu);
    }
    log_info("cache: disk %s: %lld records, %lld bytes (cap %lld); %lld invalid files deleted",
             d->path, (long long)d->st.entries, (long long)d->st.bytes, (long long)d->cap,
             (long long)d->st.corrupt);
    return d;
fail:
    threads_stop(d);
    disk_free(d);
    return NULL;
}

/* ---------------------------------------------------------------- the public calls */

void cache_disk_close(cache_disk *d) {
    if (!d) return;
    threads_stop(d);
    disk_free(d);
}

bool cache_disk_contains(cache_disk *d, const cache_key *key) {
    pthread_mutex_lock(&d->mu);
    disk_entry *e = table_find(d, key);
    bool found = e && !e->writing;
    pthread_mutex_unlock(&d->mu);
    return found;
}

bool cache_disk_find(cache_disk *d, const cache_key *bkey, cache_key *record, int *block) {
    pthread_mutex_lock(&d->mu);
    disk_entry *e = block_find(d, bkey, block);
    if (e) *record = *entry_key(e);
    pthread_mutex_unlock(&d->mu);
    return e != NULL;
}

bool cache_disk_put(cache_disk *d, cache_chunk *c) {
    if (c->n_blocks < 1 || c->n_blocks > cache_chunk_blocks(&d->layout) ||
        c->bytes != cache_block_bytes(&d->layout) * (size_t)c->n_blocks)
        return false; /* another layout's chunk */
    pthread_mutex_lock(&d->mu);
    bool queued = false;
    if (keytable_find(&d->blocks, c->key.b)) {
        /* on disk or being written, alone or inside a longer record of its chunk */
    } else if (d->n_writes >= d->write_queue) {
        d->st.dropped++;
    } else if (table_add(d, c->bkeys, c->n_blocks, &c->ns, (int64_t)c->bytes)) {
        cache_chunk_ref(c);
        d->wq[(d->wq_head + d->wq_len) % d->write_queue] = c;
        d->wq_len++;
        d->n_writes++;
        pthread_cond_signal(&d->work);
        queued = true;
    } else {
        d->st.dropped++; /* out of memory for the index entry */
    }
    pthread_mutex_unlock(&d->mu);
    return queued;
}

void cache_disk_read(cache_disk *d, const cache_key *keys, int n, cache_chunk **out) {
    cache_disk_read_enc(d, keys, n, NULL, out, NULL);
}

void cache_disk_read_enc(cache_disk *d, const cache_key *keys, int n,
                         const cache_fetch_policy *policy, cache_chunk **out, uint8_t *enc_out) {
    for (int i = 0; i < n; i++) {
        out[i] = NULL;
        if (enc_out) enc_out[i] = CACHE_ENC_RAW;
    }
    if (n <= 0) return;
    pthread_mutex_lock(&d->mu);
    bool any = false;
    for (int i = 0; i < n && !any; i++) {
        disk_entry *e = table_find(d, &keys[i]);
        any = e && !e->writing;
    }
    if (!any) {
        d->st.misses += n; /* nothing to read: no trip through the I/O thread */
    } else {
        disk_job j = {.kind = DISK_JOB_READ,
                      .keys = keys,
                      .n = n,
                      .policy = policy,
                      .out = out,
                      .enc_out = enc_out};
        job_run_locked(d, &j);
    }
    pthread_mutex_unlock(&d->mu);
}

int cache_disk_pin(cache_disk *d, const cache_key *keys, int n, bool pin) {
    int held = 0;
    pthread_mutex_lock(&d->mu);
    for (int i = 0; i < n; i++) {
        disk_entry *e = table_find(d, &keys[i]);
        /* A record being written counts as held: the pin applies once it is published. */
        if (e && !e->doomed && entry_hold(d, e, pin, e->lease)) held++;
    }
    pthread_mutex_unlock(&d->mu);
    return held;
}

void cache_disk_set_pin_limit(cache_disk *d, int64_t bytes) {
    pthread_mutex_lock(&d->mu);
    d->pin_limit = bytes;
    pthread_mutex_unlock(&d->mu);
}

/* The entry holding block key k, published or being written (not doomed), or NULL. */
static disk_entry *block_find_any(const cache_disk *d, const cache_key *k) {
    disk_entry *writing = NULL;
    for (kt_node *n = keytable_find(&d->blocks, k->b); n; n = keytable_find_next(&d->blocks, n)) {
        disk_entry *e = KT_ENTRY(n, disk_block, node)->e;
        if (e->doomed) continue;
        if (!e->writing) return e;
        writing = e;
    }
    return writing;
}

bool cache_disk_lease(cache_disk *d, const cache_key *bkey, int64_t until) {
    pthread_mutex_lock(&d->mu);
    disk_entry *e = block_find_any(d, bkey);
    bool ok = e && entry_hold(d, e, e->manual, until > e->lease ? until : e->lease);
    pthread_mutex_unlock(&d->mu);
    return ok;
}

static void lease_expire(void *ud, kt_node *node) {
    lease_walk *w = ud;
    disk_entry *e = KT_ENTRY(node, disk_entry, by_key);
    if (e->lease <= 0) return;
    if (e->lease <= w->now) {
        entry_hold(w->d, e, e->manual, 0); /* taking a reason away never fails */
        w->ended++;
    } else if (w->next == 0 || e->lease < w->next) {
        w->next = e->lease;
    }
}

int cache_disk_expire(cache_disk *d, int64_t now) {
    pthread_mutex_lock(&d->mu);
    lease_walk w = {.now = now, .d = d};
    if (d->next_expiry > 0 && d->next_expiry <= now) {
        keytable_each(&d->records, lease_expire, &w);
        d->next_expiry = w.next;
    }
    pthread_mutex_unlock(&d->mu);
    return w.ended;
}

typedef struct pin_walk {
    cache_pin_info *out;
    int n, max;
} pin_walk;

static void pin_collect(void *ud, kt_node *node) {
    pin_walk *w = ud;
    const disk_entry *e = KT_ENTRY(node, disk_entry, by_key);
    if (!e->pinned || e->doomed) return;
    if (w->n < w->max)
        w->out[w->n] = (cache_pin_info){.key = *entry_key(e),
                                        .ns = e->ns,
                                        .n_blocks = e->n_blocks,
                                        .manual = e->manual,
                                        .lease = e->lease,
                                        .disk = true};
    w->n++;
}

int cache_disk_pins(cache_disk *d, cache_pin_info *out, int max) {
    pthread_mutex_lock(&d->mu);
    pin_walk w = {.out = out, .max = max};
    keytable_each(&d->records, pin_collect, &w);
    pthread_mutex_unlock(&d->mu);
    return w.n;
}

int cache_disk_restore_leases(cache_disk *d, int64_t now) {
    int fd = openat(d->dir_fd, DISK_LEASES, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0; /* none kept */
    struct stat sb;
    uint8_t *buf = NULL;
    kv_error err = {{0}};
    cache_lease *leases = NULL;
    int n = 0, restored = 0;
    bool read_ok = fstat(fd, &sb) == 0 && sb.st_size >= 0 &&
                   (uint64_t)sb.st_size <= cache_leases_bytes(CACHE_LEASES_MAX) &&
                   (buf = malloc((size_t)sb.st_size + 1)) &&
                   read_full(fd, buf, (size_t)sb.st_size) == (ssize_t)sb.st_size;
    close(fd);
    if (!read_ok) {
        log_warn("cache: disk %s: leases file unreadable: leases from before the start are lost",
                 d->path);
    } else if (cache_leases_parse(buf, (size_t)sb.st_size, &leases, &n, &err) != 0) {
        log_warn("cache: disk %s: %s: leases from before the start are lost", d->path, err.msg);
    }
    pthread_mutex_lock(&d->mu);
    for (int i = 0; i < n; i++) {
        disk_entry *e = table_find(d, &leases[i].key);
        if (e && !e->doomed && leases[i].until > now &&
            entry_hold(d, e, e->manual, leases[i].until))
            restored++;
    }
    d->leases_dirty = true; /* the file again, without what expired or is gone */
    pthread_cond_signal(&d->work);
    pthread_mutex_unlock(&d->mu);
    free(leases);
    free(buf);
    if (restored)
        log_info("cache: disk %s: %d leases kept from before the start", d->path, restored);
    return restored;
}

typedef struct clear_walk {
    cache_disk *d;
    const cache_key *ns;
    bool drop;          /* false: only count */
    disk_victim *files; /* [count], when drop */
    int64_t n;
} clear_walk;

static void clear_visit(void *ud, kt_node *node) {
    clear_walk *w = ud;
    disk_entry *e = KT_ENTRY(node, disk_entry, by_key);
    if (w->ns && memcmp(e->ns.b, w->ns->b, CACHE_KEY_BYTES) != 0) return;
    if (!w->drop) {
        w->n += !e->writing;
    } else if (e->writing) {
        /* Writes in flight are not counted: they delete themselves when they complete. */
        e->doomed = true;
    } else {
        w->files[w->n++] = (disk_victim){*entry_key(e), entry_files(e)};
        entry_drop(w->d, e);
    }
}

int64_t cache_disk_clear(cache_disk *d, const cache_key *ns) {
    pthread_mutex_lock(&d->mu);
    clear_walk w = {.d = d, .ns = ns};
    keytable_each(&d->records, clear_visit, &w);
    disk_victim *files = w.n ? malloc((size_t)w.n * sizeof *files) : NULL;
    if (w.n && !files) {
        pthread_mutex_unlock(&d->mu);
        log_error("cache: disk %s: out of memory clearing the cache", d->path);
        return 0;
    }
    w = (clear_walk){.d = d, .ns = ns, .drop = true, .files = files};
    keytable_each(&d->records, clear_visit, &w);
    /* The I/O thread deletes the files (it owns every file operation); until then the keys are
     * out of the index, so nothing reads them, and a new write of one queues behind this. */
    if (w.n) {
        disk_job j = {.kind = DISK_JOB_UNLINK, .victims = files, .n = (int)w.n};
        job_run_locked(d, &j);
    }
    pthread_mutex_unlock(&d->mu);
    free(files);
    return w.n;
}

void cache_disk_stats(cache_disk *d, cache_tier_stats *out) {
    pthread_mutex_lock(&d->mu);
    *out = d->st;
    out->capacity = d->cap;
    pthread_mutex_unlock(&d->mu);
}

void cache_disk_flush(cache_disk *d) {
    pthread_mutex_lock(&d->mu);
    while (d->n_writes > 0) pthread_cond_wait(&d->done, &d->mu);
    chunk_worker *w = d->encoder; /* stopped only by close: not while a caller flushes */
    pthread_mutex_unlock(&d->mu);
    if (w) chunk_worker_flush(w); /* the encodings of what was written */
    pthread_mutex_lock(&d->mu);
    while (d->n_writes > 0 || d->handoff) pthread_cond_wait(&d->done, &d->mu);
    pthread_mutex_unlock(&d->mu);
}
