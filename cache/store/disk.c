/* The disk tier of the chunk store (cache/store/disk.h): one record file per chunk, on the disk
 * tiers' core (cache/store/dirstore.h), which owns the directory, the index and its cap, the I/O
 * thread (every file operation after open is its work), the write ring and the durability rule:
 * records are written to a temporary name and renamed into place, without fdatasync. This file adds
 * what only the chunk tier has: the block index (a prompt finds a record by any of its blocks'
 * keys), pins, io_uring reads and writes with O_DIRECT, and the encodings.
 *
 * Reads. A read is a job on the I/O thread that its caller waits for; jobs go before queued
 * writes, so a read never waits behind the write-back queue. It keeps several records' reads in
 * flight on the io_uring while it checks the oldest.
 *
 * Encodings (cache_disk_open_enc with encode). Beside each record <key>.kvc the tier keeps its
 * chunk in every other encoding the Redis tier offers (cache/codec/chunk_codec.h): <key>.e1.kvc for
 * q8, <key>.e<N>-<table id>.kvc for codec level N - 2 (named with the codec table, so files of
 * another table are deleted at open, never decoded). Each is a whole record of that level
 * (cache/store/record.h), written like a record. An encoder thread, at a lower CPU priority,
 * encodes each record once it is published and hands the files to the I/O thread; the index keeps
 * their sizes with the record, and they count towards the cap, are evicted, cleared, superseded and
 * deleted with it. A read chooses each record's encoding with the fetch policy
 * (cache/codec/meter.h) from this disk's measured read rate and this machine's decode costs; an
 * encoding that fails its checks is dropped, and the lossless record is read instead. */
#include <errno.h>
#include <fcntl.h>
#include <liburing.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cache/codec/chunk_codec.h"
#include "cache/codec/meter.h"
#include "cache/store/dirstore.h"
#include "cache/store/disk.h"
#include "cache/store/leases.h"
#include "cache/store/pins.h"
#include "cache/store/record.h"
#include "cache/store/worker.h"
#include "util/keytable.h"

#define DISK_RING_DEPTH 64 /* io_uring entries, and the most operations in flight */
/* A read job keeps up to DISK_READ_AHEAD records in flight (2 operations each: header, payload)
 * while it checks the oldest one's checksum. */
#define DISK_READ_AHEAD 4
#define DISK_MAX_OP (1u << 30) /* bytes per submitted operation (prep_* take an unsigned) */
#define DISK_MAX_WRITE_QUEUE DIRSTORE_MAX_WRITE_QUEUE
#define DISK_NAME_MAX DIRSTORE_NAME_MAX
/* Before a read has measured the disk, it is taken to read 1 GB/s (bytes per ns). */
#define DISK_PRIOR_BW 1.0
#define DISK_DECODE_THREADS 2
/* Records waiting for the encoder, each a lossless chunk held in memory: a burst beyond it is
 * not encoded (an encoding costs more than a write; a deep queue would only hold memory). */
#define DISK_ENCODE_QUEUE 16
#define DISK_LEASES "leases" /* the leases file (cache/store/leases.h), beside the records */
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

/* One record in the index (its key, namespace, LRU place, pin and state are the core's: see
 * dirstore_entry). bytes counts payload bytes of every file; files has bit 0 for its lossless
 * record and bit e for its encoding e. */
typedef struct disk_entry {
    dirstore_entry base;
    uint64_t size[CACHE_ENC_MAX]; /* file bytes by encoding ([0]: the record; 0: no file) */
    int n_blocks;
    /* Why base.pinned is set (it is while either is): a pin until unpinned (manual), a lease
     * until a time (Unix seconds, 0: none). */
    bool manual;
    int64_t lease;
    int tenant;            /* whose pin reasons they are (counted in its pinned bytes) */
    disk_block by_block[]; /* [n_blocks] */
} disk_entry;

/* A read job (the struct lives on the waiting caller's stack). */
typedef struct disk_job {
    const cache_key *keys; /* [n]: record keys to read */
    int n;
    const cache_fetch_policy *policy; /* how to choose encodings (NULL: lossless) */
    cache_chunk **out;                /* [n] */
    uint8_t *enc_out;                 /* [n]: the encoding each came in (may be NULL) */
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
    dirstore *ds; /* the directory, the index, the I/O thread; its lock guards what follows */
    cache_layout layout;
    const codec_table *table; /* the codec's levels (NULL: q8 only); borrowed */
    int n_enc;                /* encodings kept: 1 (lossless only) or cache_enc_count(table) */
    size_t max_payload;       /* the largest encoded payload of a chunk */
    size_t header_bytes;      /* cache_record_header_bytes(layout) */
    int64_t cap;

    /* Guarded by the core's lock. */
    keytable blocks;       /* block key -> the entries holding that block */
    pin_ledger pins;       /* payload bytes of pinned entries (published or being written) */
    int64_t pin_limit;     /* pinned bytes at most beside half the cap (0: none) */
    int64_t next_expiry;   /* no lease ends before this (0: no lease) */
    bool leases_dirty;     /* the leases file is behind the index */
    bool leases_posted;    /* its rewrite is handed to the I/O thread and has not begun */
    cache_meter meter;     /* this disk's read rate and the decoders */
    chunk_worker *encoder; /* encodes published records (NULL: none, or stopping) */

    float *enc_scratch; /* the encoder's */
    float *scratch;     /* the I/O thread's: decoding */

    /* The I/O thread's own (and open's, before the thread starts). */
    struct io_uring ring;
    bool have_ring;
    uint8_t *hdr; /* [header_bytes], CACHE_ALIGN-aligned, host: the header being written */
};

static size_t padded(size_t bytes) { return (bytes + CACHE_ALIGN - 1) / CACHE_ALIGN * CACHE_ALIGN; }

static cache_tier_stats *stats(cache_disk *d) { return dirstore_stats_locked(d->ds); }

/* ---------------------------------------------------------------- names */

/* The name of record k's file in encoding enc: <key>.kvc, <key>.e1.kvc, <key>.e<N>-<table>.kvc. */
static void file_name(void *ud, const cache_key *k, int enc, char out[DISK_NAME_MAX]) {
    const cache_disk *d = ud;
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

/* True when name is one of the names this tier writes, for any codec table: <64 lower-case
 * hex>.kvc (*enc 0), <64 hex>.e<N>.kvc or <64 hex>.e<N>-<8 hex>.kvc (*enc N, 1 .. 9; whether
 * it is this instance's, file_name says). The key goes to k. */
static bool file_name_parse(const char *name, cache_key *k, int *enc) {
    size_t n = strlen(name);
    uint8_t table_id[4];
    if (n < 2 * CACHE_KEY_BYTES + 4 || strcmp(name + n - 4, ".kvc") != 0 ||
        !kv_hex_decode(name, CACHE_KEY_BYTES, k->b))
        return false;
    const char *rest = name + 2 * CACHE_KEY_BYTES;
    *enc = CACHE_ENC_RAW;
    if (strcmp(rest, ".kvc") == 0) return true;
    if (rest[0] != '.' || rest[1] != 'e' || rest[2] < '1' || rest[2] > '9') return false;
    *enc = rest[2] - '0';
    if (strcmp(rest + 3, ".kvc") == 0) return true;
    /* kv_hex_decode stops at the terminating zero */
    return rest[3] == '-' && kv_hex_decode(rest + 4, 4, table_id) && strcmp(rest + 12, ".kvc") == 0;
}

/* ---------------------------------------------------------------- index (caller holds the lock) */

static disk_entry *table_find(const cache_disk *d, const cache_key *k) {
    return (disk_entry *)dirstore_find_locked(d->ds, k);
}

/* A published entry holding block key k, and the block's index in it; NULL when none. */
static disk_entry *block_find(const cache_disk *d, const cache_key *k, int *block) {
    for (kt_node *n = keytable_find(&d->blocks, k->b); n; n = keytable_find_next(&d->blocks, n)) {
        disk_block *b = KT_ENTRY(n, disk_block, node);
        if (b->e->base.writing) continue;
        *block = (int)(b - b->e->by_block);
        return b->e;
    }
    return NULL;
}

/* A new entry (not indexed) for the record of blocks bkeys[0..n_blocks) with bytes of payload.
 * NULL when out of memory. */
static disk_entry *entry_new(const cache_disk *d, const cache_key *bkeys, int n_blocks,
                             const cache_key *ns, int64_t bytes) {
    disk_entry *e = calloc(1, sizeof *e + sizeof(disk_block) * (size_t)n_blocks);
    if (!e) return NULL;
    e->base.key = bkeys[n_blocks - 1];
    e->base.ns = *ns;
    e->base.bytes = bytes;
    e->size[CACHE_ENC_RAW] = cache_record_file_bytes(&d->layout, (size_t)bytes);
    e->n_blocks = n_blocks;
    for (int i = 0; i < n_blocks; i++) {
        disk_block *b = &e->by_block[i];
        b->e = e;
        b->key = bkeys[i];
        b->node.key = b->key.b;
    }
    return e;
}

/* The core's hooks: an entry joins or leaves the index. */
static void entry_index(void *ud, dirstore_entry *base) {
    cache_disk *d = ud;
    disk_entry *e = (disk_entry *)base;
    for (int i = 0; i < e->n_blocks; i++) keytable_insert(&d->blocks, &e->by_block[i].node);
}

static void entry_unindex(void *ud, dirstore_entry *base) {
    cache_disk *d = ud;
    disk_entry *e = (disk_entry *)base;
    if (e->lease) d->leases_dirty = true; /* written with the next change, or at close */
    if (e->base.pinned) pin_ledger_add(&d->pins, e->tenant, -e->base.bytes);
    for (int i = 0; i < e->n_blocks; i++) keytable_remove(&d->blocks, &e->by_block[i].node);
}

/* Gives published entry e (of ds, d's store) encoding enc's file of file_bytes bytes (0: takes it
 * away); all but its header count as payload. */
static void entry_set_enc(cache_disk *d, dirstore *ds, disk_entry *e, int enc,
                          uint64_t file_bytes) {
    int64_t hb = (int64_t)d->header_bytes;
    int64_t delta = (file_bytes ? (int64_t)file_bytes - hb : 0) -
                    (e->size[enc] ? (int64_t)e->size[enc] - hb : 0);
    e->size[enc] = file_bytes;
    dirstore_set_file_locked(ds, &e->base, enc, file_bytes != 0, delta);
    if (e->base.pinned) pin_ledger_add(&d->pins, e->tenant, delta);
}

/* Pinned records may fill at most half the tier, so unpinned traffic always has room, and at
 * most the pin limit. */
static int64_t pin_cap(const cache_disk *d) {
    int64_t half = d->cap / 2;
    return d->pin_limit > 0 && d->pin_limit < half ? d->pin_limit : half;
}

/* Gives e these pin reasons (manual, a lease until `lease`, 0: none), for tenant t when it had
 * none, keeping it from eviction while it has one. PIN_OK, or why not (e unchanged) when that
 * would take the pinned bytes over the cap or the tenant's share of it. A change of lease is for
 * the leases file (leases_save, once the lock is released). */
static pin_verdict entry_hold(cache_disk *d, disk_entry *e, int t, bool manual, int64_t lease) {
    bool held = manual || lease > 0;
    int64_t b = e->base.bytes;
    if (held) {
        pin_verdict v = pin_ledger_hold(&d->pins, &e->tenant, e->base.pinned, t, b, pin_cap(d));
        if (v != PIN_OK) return v;
    } else if (e->base.pinned) {
        pin_ledger_add(&d->pins, e->tenant, -b);
    }
    if (held != e->base.pinned && !e->base.writing) stats(d)->pinned += held ? 1 : -1;
    if (lease != e->lease) d->leases_dirty = true;
    e->base.pinned = held;
    e->manual = manual;
    e->lease = lease;
    if (lease > 0 && (d->next_expiry == 0 || lease < d->next_expiry)) d->next_expiry = lease;
    return PIN_OK;
}

/* The core's hook when a record is published: it holds a prefix of it, the records of the same
 * chunk that end at one of its earlier blocks. They are deleted, and the pins and latest lease
 * they had pass to e (as far as the pin cap allows). */
static void supersede_locked(void *ud, dirstore_entry *base, void *item) {
    cache_disk *d = ud;
    disk_entry *e = (disk_entry *)base;
    (void)item;
    bool manual = e->manual;
    int64_t lease = e->lease;
    /* a chunk's records share its namespace's tenant */
    int tenant = e->base.pinned ? e->tenant : CACHE_TENANT_NONE;
    for (int i = 0; i < e->n_blocks - 1; i++) {
        disk_entry *old = table_find(d, &e->by_block[i].key);
        if (!old || old->base.writing) continue;
        bool was_manual = old->manual, was_pinned = old->base.pinned;
        int64_t was_lease = old->lease;
        int was_tenant = old->tenant;
        if (!dirstore_remove_locked(d->ds, &old->base, old->base.files)) continue;
        manual |= was_manual;
        if (was_lease > lease) lease = was_lease;
        if (was_pinned && tenant == CACHE_TENANT_NONE) tenant = was_tenant;
    }
    entry_hold(d, e, tenant, manual, lease);
}

/* ---------------------------------------------------------------- I/O */

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
                             dirstore_path(d->ds), strerror(r < 0 ? -r : EIO));
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
                    log_error("cache: disk %s: io_uring wait failed (%s)", dirstore_path(d->ds),
                              strerror(-r));
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
        log_warn("cache: disk %s: io_uring submit failed (%s); using pread", dirstore_path(d->ds),
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
            log_error("cache: disk %s: io_uring wait failed (%s)", dirstore_path(d->ds),
                      strerror(-r));
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

/* Writes buf[0..header_bytes) then buf[header_bytes..len) (whole CACHE_ALIGN blocks) to fd with
 * io_uring: 0, or an errno. */
typedef struct disk_payload {
    uint8_t *hdr, *body;
    size_t body_len;
} disk_payload;

static int payload_write(cache_disk *d, int fd, const disk_payload *p) {
    disk_op ops[2] = {
        {.fd = fd, .buf = p->hdr, .len = d->header_bytes, .off = 0},
        {.fd = fd, .buf = p->body, .len = p->body_len, .off = (off_t)d->header_bytes},
    };
    disk_io(d, ops, 2, true);
    return ops[0].err ? ops[0].err : ops[1].err;
}

/* The core's payload writer for a queued chunk: its record. */
static int record_write(void *ud, int fd, void *item) {
    cache_disk *d = ud;
    cache_chunk *c = item;
    cache_record_encode_header(&d->layout, c, d->hdr);
    /* The payload's padding is zeroed by cache_chunk_create: whole CACHE_ALIGN blocks. */
    disk_payload p = {d->hdr, c->data, padded(c->bytes)};
    return payload_write(d, fd, &p);
}

static int sidecar_write(void *ud, int fd, void *arg) { return payload_write(ud, fd, arg); }

static void chunk_unref(void *item) { cache_chunk_unref(item); }

/* The core's hook once a record is published and the cap kept: its chunk goes to the encoder; a
 * full queue leaves the record lossless only (counted as dropped). */
static void encode_queue_locked(void *ud, dirstore_entry *e, void *item) {
    cache_disk *d = ud;
    if (d->encoder && !chunk_worker_queue(d->encoder, item, e->gen)) stats(d)->dropped++;
}

/* Posted to the I/O thread by the encoder: writes one record's encoded files, and indexes them
 * with it; files whose record has gone since (evicted, cleared, superseded), or would take a
 * pinned record's pins over half the tier, are deleted again. Frees the disk_sidecars. */
static void disk_write_sidecars(void *ud, void *arg) {
    cache_disk *d = ud;
    disk_sidecars *s = arg;
    uint16_t written = 0;
    uint64_t size[CACHE_ENC_MAX] = {0};
    char name[DISK_NAME_MAX];
    for (int e = 1; e < CACHE_ENC_MAX; e++) {
        if (!s->buf[e]) continue;
        const char *what;
        disk_payload p = {s->buf[e], s->buf[e] + d->header_bytes, s->len[e] - d->header_bytes};
        int err = dirstore_write_file(d->ds, &s->key, e, sidecar_write, &p, &what);
        if (err) {
            file_name(d, &s->key, e, name);
            dirstore_warn(d->ds, "cannot %s %s: %s", what, name, strerror(err));
            dirstore_lock(d->ds);
            stats(d)->write_errors++;
            dirstore_unlock(d->ds);
            continue;
        }
        written |= (uint16_t)(1u << e);
        size[e] = s->len[e];
    }
    dirstore_lock(d->ds);
    disk_entry *e = table_find(d, &s->key);
    int64_t added = 0;
    for (int i = 1; i < CACHE_ENC_MAX; i++)
        added += size[i] ? (int64_t)size[i] - (int64_t)d->header_bytes : 0;
    /* a pinned record's encodings are pinned too: only as far as the pin cap allows */
    bool room = e && (!e->base.pinned ||
                      pin_ledger_check(&d->pins, e->tenant, added, pin_cap(d)) == PIN_OK);
    if (e && e->base.gen == s->gen && !e->base.writing && room) {
        for (int i = 1; i < CACHE_ENC_MAX; i++)
            if (size[i]) {
                entry_set_enc(d, d->ds, e, i, size[i]);
                stats(d)->bytes_in += (int64_t)size[i] - (int64_t)d->header_bytes;
            }
        dirstore_evict_locked(d->ds);
    } else if (written && !dirstore_unlink_locked(d->ds, &s->key, written)) {
        log_error("cache: disk %s: out of memory: encoded files of a dropped record left behind",
                  dirstore_path(d->ds));
    }
    dirstore_unlock(d->ds);
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
        dirstore_lock(d->ds);
        disk_entry *en = table_find(d, &c->key);
        bool live = en && en->base.gen == gen && d->encoder;
        dirstore_unlock(d->ds);
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
    dirstore_post(d->ds, disk_write_sidecars, s);
}

/* The encoder's first work: what decoding costs here, for the fetch policy. */
static void encoder_first(void *ud) {
    cache_disk *d = ud;
    double dec_ns[CACHE_ENC_MAX] = {0};
    cache_meter_measure(&d->layout, d->table, DISK_DECODE_THREADS, d->enc_scratch, dec_ns);
    dirstore_lock(d->ds);
    cache_meter_set_decode(&d->meter, dec_ns);
    dirstore_unlock(d->ds);
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
    dirstore_lock(d->ds);
    cache_meter_decode(&d->meter, enc, (double)c->bytes / 2, clock_now_ns() - t0);
    dirstore_unlock(d->ds);
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
    sl->fd = dirstore_open_file(d->ds, name, O_RDONLY);
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
            dirstore_warn(d->ds, "cannot read %s: %s", name,
                          e == ENODATA ? "file shorter than its record" : strerror(e));
        } else if ((v = read_verify(d, sl->enc, r->hdr, r->payload ? r->payload : sl->c->data,
                                    r->ops[1].len, &j->keys[sl->idx], sl->c, &err)) != 0) {
            sl->result = v > 0 ? READ_SKIPPED : READ_CORRUPT;
            dirstore_warn(d->ds, "%s %s: %s", v > 0 ? "cannot decode" : "dropping", name, err.msg);
        } else {
            sl->result = READ_OK;
            if (first && j->policy) {
                dirstore_lock(d->ds);
                cache_meter_link(&d->meter, sl->size[sl->enc], took);
                dirstore_unlock(d->ds);
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
        dirstore_lock(d->ds);
        stats(d)->misses += j->n;
        dirstore_unlock(d->ds);
        return;
    }
    int m = 0;
    dirstore_lock(d->ds);
    for (int i = 0; i < j->n; i++) {
        disk_entry *e = table_find(d, &j->keys[i]);
        if (!e || e->base.writing) continue;
        slots[m] = (read_slot){.idx = i, .gen = e->base.gen, .n_blocks = e->n_blocks};
        memcpy(slots[m++].size, e->size, sizeof e->size);
    }
    dirstore_unlock(d->ds);

    /* records k + 1 .. k + DISK_READ_AHEAD - 1 read while record k is checked (and decoded) */
    uint64_t t0 = j->policy && j->policy->start_ns ? j->policy->start_ns : clock_now_ns();
    cache_meter_plan plan = {0, 0};
    read_inflight fl[DISK_READ_AHEAD];
    for (int k = 0; k < DISK_READ_AHEAD; k++) fl[k].hdr = (uint8_t *)hdrs + k * d->header_bytes;
    for (int k = 0; k < m + DISK_READ_AHEAD - 1; k++) {
        if (k < m) {
            read_slot *sl = &slots[k];
            if (j->policy && d->n_enc > 1) {
                dirstore_lock(d->ds);
                sl->enc = cache_meter_choose(&d->meter, j->policy, sl->size,
                                             sl->n_blocks * d->layout.block_tokens, k, m, t0, false,
                                             &plan);
                dirstore_unlock(d->ds);
            }
            fl[k % DISK_READ_AHEAD].sl = sl;
            read_record_start(d, j, &fl[k % DISK_READ_AHEAD]);
        }
        int done = k - (DISK_READ_AHEAD - 1);
        if (done >= 0) read_record_finish(d, j, &fl[done % DISK_READ_AHEAD], done == 0);
    }

    dirstore_lock(d->ds);
    stats(d)->misses += j->n - m; /* not indexed */
    for (int s = 0; s < m; s++) {
        read_slot *sl = &slots[s];
        disk_entry *e = table_find(d, &j->keys[sl->idx]);
        bool same = e && e->base.gen == sl->gen && !e->base.writing;
        if (same && sl->bad_enc && sl->bad_result != READ_SKIPPED && e->size[sl->bad_enc]) {
            /* an encoding gone or refused: the record keeps its others (a file that cannot be
             * queued for deletion, for want of memory, stays indexed) */
            bool corrupt = sl->bad_result == READ_CORRUPT;
            if (corrupt) stats(d)->corrupt++;
            if (!corrupt ||
                dirstore_unlink_locked(d->ds, &e->base.key, (uint16_t)(1u << sl->bad_enc)))
                entry_set_enc(d, d->ds, e, sl->bad_enc, 0);
        }
        if (sl->result == READ_OK) {
            j->out[sl->idx] = sl->c;
            if (j->enc_out) j->enc_out[sl->idx] = (uint8_t)sl->enc;
            stats(d)->hits++;
            stats(d)->enc_hits[sl->enc]++;
            stats(d)->bytes_out += sl->enc == CACHE_ENC_RAW
                                       ? (int64_t)sl->c->bytes
                                       : (int64_t)sl->size[sl->enc] - (int64_t)d->header_bytes;
            if (same) dirstore_touch_locked(d->ds, &e->base);
            continue;
        }
        stats(d)->misses++;
        /* Only the entry that was read is dropped: a clear and a new write of the same key
         * since then made a new entry (another gen) whose file is sound. */
        if (!same) continue;
        if (sl->result == READ_VANISHED) {
            dirstore_remove_locked(d->ds, &e->base, e->base.files & (uint16_t)~1u);
        } else if (sl->result == READ_CORRUPT) {
            stats(d)->corrupt++;
            dirstore_remove_locked(d->ds, &e->base, e->base.files);
        }
    }
    dirstore_unlock(d->ds);
    free(hdrs);
    free(slots);
}

/* The core's job: a read. */
static void read_job(void *ud, void *arg) { disk_read_job(ud, arg); }

/* ---------------------------------------------------------------- open */

/* The core's check at open of record k's file in encoding enc (of file_bytes, its header in
 * hdr[0..len)): header, key and level against the name, size; an encoding's block count against
 * its record's. A record gets a new entry; an encoding is given to its record's. */
static dirstore_check scan_check(void *ud, dirstore *ds, const cache_key *k, int enc,
                                 const uint8_t *hdr, size_t len, int64_t file_bytes,
                                 dirstore_entry **out, kv_error *err) {
    cache_disk *d = ud;
    cache_record_info info;
    if (enc == CACHE_ENC_RAW ? cache_record_decode_header(hdr, len, &d->layout, &info, err) != 0
                             : cache_record_decode_header_encoded(hdr, len, &d->layout,
                                                                  d->max_payload, &info, err) != 0)
        return DIRSTORE_CORRUPT;
    if (memcmp(info.key.b, k->b, CACHE_KEY_BYTES) != 0)
        return dirstore_corrupt(err, "header names another key");
    if (info.level != (uint32_t)enc)
        return dirstore_corrupt(err, "header has level %u, its name %d", info.level, enc);
    size_t want = cache_record_file_bytes(&d->layout, (size_t)info.payload_bytes);
    if ((uint64_t)file_bytes != (uint64_t)want)
        return dirstore_corrupt(err, "file has %lld bytes, its record %zu", (long long)file_bytes,
                                want);
    if (enc == CACHE_ENC_RAW) {
        disk_entry *e = entry_new(d, (const cache_key *)(const void *)info.bkeys, info.n_blocks,
                                  &info.ns, (int64_t)info.payload_bytes);
        *out = e ? &e->base : NULL;
        return DIRSTORE_VALID;
    }
    disk_entry *e = (disk_entry *)*out;
    if (info.n_blocks != e->n_blocks)
        return dirstore_corrupt(err, "%d blocks, its record %d", info.n_blocks, e->n_blocks);
    entry_set_enc(d, ds, e, enc, (uint64_t)file_bytes); /* ds: d->ds is not set yet */
    return DIRSTORE_VALID;
}

static const dirstore_type disk_type = {
    .tier = "cache: disk",
    .direct = true,
    .file_name = file_name,
    .parse_name = file_name_parse,
    .check = scan_check,
    .write_payload = record_write,
    .unref = chunk_unref,
    .index = entry_index,
    .unindex = entry_unindex,
    .published = supersede_locked,
    .written = encode_queue_locked,
};

static void disk_free(cache_disk *d) {
    dirstore_close(d->ds); /* frees the entries; the block index only links them */
    if (d->have_ring) io_uring_queue_exit(&d->ring);
    keytable_free(&d->blocks);
    pin_ledger_free(&d->pins);
    free(d->scratch);
    free(d->enc_scratch);
    free(d->hdr);
    free(d);
}

/* Stops the encoder (what it has not begun is not encoded); the I/O thread, after it has drained
 * the jobs, writes and encoded files still queued, stops in disk_free. */
static void encoder_stop(cache_disk *d) {
    if (!d->ds) return;
    /* No record is queued for the encoder once it is out of the tier. */
    dirstore_lock(d->ds);
    chunk_worker *w = d->encoder;
    d->encoder = NULL;
    dirstore_unlock(d->ds);
    chunk_worker_stop(w);
}

cache_disk *cache_disk_open(const char *dir, const cache_layout *l, int64_t cap_bytes,
                            int write_queue, kv_error *err) {
    return cache_disk_open_enc(dir, l, cap_bytes, write_queue, NULL, false, err);
}

/* The tier without its directory: layout, encodings, buffers. NULL with err. */
static cache_disk *disk_new(const cache_layout *l, int64_t cap_bytes, const codec_table *table,
                            bool encode, kv_error *err) {
    cache_disk *d = calloc(1, sizeof *d);
    if (!d) {
        kv_fail(err, "cache disk: out of memory");
        return NULL;
    }
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
    bool tables = keytable_init(&d->blocks, CACHE_KEY_BYTES) == 0;
    void *hdr = NULL;
    if (posix_memalign(&hdr, CACHE_ALIGN, d->header_bytes) != 0) hdr = NULL;
    d->hdr = hdr;
    bool enc_ok = true;
    if (d->n_enc > 1) {
        d->scratch = malloc(sizeof(float) * cache_enc_scratch_floats(l));
        d->enc_scratch = malloc(sizeof(float) * cache_enc_scratch_floats(l));
        enc_ok = d->scratch && d->enc_scratch;
    }
    if (!tables || !d->hdr || !enc_ok) {
        kv_fail(err, "cache disk: out of memory");
        disk_free(d);
        return NULL;
    }
    return d;
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
    cache_disk *d = disk_new(l, cap_bytes, table, encode, err);
    if (!d) return NULL;
    /* one directory per model: dir/<first 16 hex digits of its identity> */
    char model_hex[2 * CACHE_KEY_BYTES + 1], *path = NULL;
    kv_hex_encode(l->model_id, CACHE_KEY_BYTES, model_hex);
    if (asprintf(&path, "%s/%.16s", dir, model_hex) < 0) {
        kv_fail(err, "cache disk: out of memory");
        disk_free(d);
        return NULL;
    }
    /* the ring before the I/O thread, which the core starts once the directory is scanned */
    int r = io_uring_queue_init(DISK_RING_DEPTH, &d->ring, 0);
    d->have_ring = r == 0;
    if (r != 0)
        log_warn("cache: disk %s: io_uring unavailable (%s); using pread/pwrite", path,
                 strerror(-r));
    dirstore_params p = {.path = path,
                         .cap = cap_bytes,
                         .write_queue = write_queue,
                         .n_files = d->n_enc,
                         .header_bytes = d->header_bytes,
                         .ud = d};
    d->ds = dirstore_open(&disk_type, &p, err);
    free(path);
    if (!d->ds) goto fail;
    if (d->n_enc > 1) {
        chunk_worker *w =
            chunk_worker_start(DISK_ENCODE_QUEUE, encode_record, encoder_first, d, err);
        if (!w) {
            kv_fail_wrap(err, "cache disk");
            goto fail;
        }
        dirstore_lock(d->ds);
        d->encoder = w;
        dirstore_unlock(d->ds);
    }
    return d;
fail:
    encoder_stop(d);
    disk_free(d);
    return NULL;
}

/* ---------------------------------------------------------------- the public calls */

static void leases_save(cache_disk *d);

void cache_disk_close(cache_disk *d) {
    if (!d) return;
    leases_save(d); /* the core runs what is posted before it stops */
    encoder_stop(d);
    disk_free(d);
}

bool cache_disk_contains(cache_disk *d, const cache_key *key) {
    dirstore_lock(d->ds);
    disk_entry *e = table_find(d, key);
    bool found = e && !e->base.writing;
    dirstore_unlock(d->ds);
    return found;
}

bool cache_disk_find(cache_disk *d, const cache_key *bkey, cache_key *record, int *block) {
    dirstore_lock(d->ds);
    disk_entry *e = block_find(d, bkey, block);
    if (e) *record = e->base.key;
    dirstore_unlock(d->ds);
    return e != NULL;
}

bool cache_disk_put(cache_disk *d, cache_chunk *c) {
    if (c->n_blocks < 1 || c->n_blocks > cache_chunk_blocks(&d->layout) ||
        c->bytes != cache_block_bytes(&d->layout) * (size_t)c->n_blocks)
        return false; /* another layout's chunk */
    dirstore_lock(d->ds);
    bool queued = false;
    if (keytable_find(&d->blocks, c->key.b)) {
        /* on disk or being written, alone or inside a longer record of its chunk */
    } else {
        disk_entry *e = entry_new(d, c->bkeys, c->n_blocks, &c->ns, (int64_t)c->bytes);
        if (!e)
            stats(d)->dropped++; /* out of memory for the index entry */
        else if ((queued = dirstore_queue_locked(d->ds, &e->base, c)))
            cache_chunk_ref(c);
        else
            free(e); /* the queue is full (counted) */
    }
    dirstore_unlock(d->ds);
    return queued;
}

int64_t cache_disk_write_bytes(cache_disk *d) { return dirstore_write_bytes(d->ds); }

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
    dirstore_lock(d->ds);
    bool any = false;
    for (int i = 0; i < n && !any; i++) {
        disk_entry *e = table_find(d, &keys[i]);
        any = e && !e->base.writing;
    }
    if (!any) {
        stats(d)->misses += n; /* nothing to read: no trip through the I/O thread */
    } else {
        disk_job j = {.keys = keys, .n = n, .policy = policy, .out = out, .enc_out = enc_out};
        dirstore_run_locked(d->ds, read_job, &j);
    }
    dirstore_unlock(d->ds);
}

/* The bytes pinning keys for tenant t would add to t's (records held and not t's yet). Under
 * the lock. */
static int64_t pin_need(const cache_disk *d, int t, const cache_key *keys, int n) {
    int64_t need = 0;
    for (int i = 0; i < n; i++) {
        const disk_entry *e = table_find(d, &keys[i]);
        if (e && !e->base.doomed)
            need += pin_ledger_need(&d->pins, e->tenant, e->base.pinned, t, e->base.bytes);
    }
    return need;
}

int cache_disk_pin(cache_disk *d, int tenant, const cache_key *keys, int n, bool pin,
                   int64_t until) {
    int held = 0;
    dirstore_lock(d->ds);
    /* a tenant's share takes the whole call or none of it; the cap, as far as it goes */
    if (pin && pin_ledger_over_share(&d->pins, tenant, pin_need(d, tenant, keys, n), pin_cap(d)))
        held = -1;
    for (int i = 0; i < n && held >= 0; i++) {
        disk_entry *e = table_find(d, &keys[i]);
        /* A record being written counts as held: the pin applies once it is published. */
        if (!e || e->base.doomed) continue;
        /* with until, a lease instead of a pin (the pin, if any, stays as it was) */
        bool manual = until > 0 ? e->manual : pin;
        int64_t lease = pin && until > e->lease ? until : e->lease;
        if (entry_hold(d, e, tenant, manual, lease) == PIN_OK) held++;
    }
    dirstore_unlock(d->ds);
    if (until > 0) leases_save(d);
    return held;
}

/* ---------------------------------------------------------------- leases */

/* A walk over the index's entries (dirstore_each_locked) for the leases and pins. */
typedef struct lease_walk {
    cache_disk *d;
    cache_lease *out; /* collect: NULL to count only */
    cache_pin_info *pins;
    int n, max;
    int64_t now, next; /* expire: the leases due at now end; the next to end after */
} lease_walk;

static void lease_visit(void *ud, dirstore_entry *base) {
    lease_walk *w = ud;
    const disk_entry *e = (const disk_entry *)base;
    if (e->lease <= 0 || e->base.doomed) return;
    if (w->out) w->out[w->n] = (cache_lease){e->base.key, e->lease};
    w->n++;
}

/* The leases the index holds (caller holds the lock): their count, and with out, them. */
static void lease_collect(cache_disk *d, lease_walk *w) {
    dirstore_each_locked(d->ds, lease_visit, w);
}

/* I/O thread: rewrites the leases file from the index (a temporary file renamed into place).
 * A failure is logged: the leases then hold until a restart. */
static void leases_write(void *ud, void *arg) {
    cache_disk *d = ud;
    (void)arg;
    dirstore_lock(d->ds);
    d->leases_posted = false;
    d->leases_dirty = false;
    lease_walk w = {0};
    lease_collect(d, &w);
    size_t bytes = cache_leases_bytes(w.n);
    uint8_t *buf = malloc(bytes);
    w.out = malloc(sizeof *w.out * (size_t)(w.n ? w.n : 1));
    if (buf && w.out) {
        w.n = 0;
        lease_collect(d, &w);
    }
    dirstore_unlock(d->ds);
    const char *what = "encode";
    int err = !buf || !w.out ? ENOMEM : cache_leases_encode(w.out, w.n, buf) ? EIO : 0;
    int dir = dirstore_dir_fd(d->ds);
    if (!err) {
        what = "write";
        int fd = openat(dir, DISK_LEASES_TMP, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        size_t done = 0;
        while (fd >= 0 && done < bytes) {
            ssize_t k = write(fd, buf + done, bytes - done);
            if (k < 0 && errno == EINTR) continue;
            if (k <= 0) break;
            done += (size_t)k;
        }
        err = fd < 0 ? errno : done < bytes ? (errno ? errno : EIO) : 0;
        if (fd >= 0 && close(fd) != 0 && !err) err = errno;
        if (!err && renameat(dir, DISK_LEASES_TMP, dir, DISK_LEASES) != 0) {
            err = errno;
            what = "rename";
        }
    }
    if (err) dirstore_warn(d->ds, "cannot %s the leases file: %s", what, strerror(err));
    free(buf);
    free(w.out);
}

/* Hands the leases file's rewrite to the I/O thread when the leases changed (without the
 * lock: dirstore_post takes it). */
static void leases_save(cache_disk *d) {
    dirstore_lock(d->ds);
    bool due = d->leases_dirty && !d->leases_posted;
    if (due) d->leases_posted = true;
    dirstore_unlock(d->ds);
    if (due) dirstore_post(d->ds, leases_write, NULL);
}

int cache_disk_set_pin_limit(cache_disk *d, int64_t bytes, int n_tenants, int share_pct) {
    dirstore_lock(d->ds);
    d->pin_limit = bytes;
    int rc = pin_ledger_tenants(&d->pins, n_tenants, share_pct);
    dirstore_unlock(d->ds);
    return rc;
}

void cache_disk_tenant_pins(cache_disk *d, int t, int64_t *bytes, int64_t *share) {
    dirstore_lock(d->ds);
    *bytes = pin_ledger_of(&d->pins, t);
    *share = pin_ledger_share(&d->pins, pin_cap(d));
    dirstore_unlock(d->ds);
}

/* The entry holding block key k, published or being written (not doomed), or NULL. */
static disk_entry *block_find_any(const cache_disk *d, const cache_key *k) {
    disk_entry *writing = NULL;
    for (kt_node *n = keytable_find(&d->blocks, k->b); n; n = keytable_find_next(&d->blocks, n)) {
        disk_entry *e = KT_ENTRY(n, disk_block, node)->e;
        if (e->base.doomed) continue;
        if (!e->base.writing) return e;
        writing = e;
    }
    return writing;
}

bool cache_disk_lease(cache_disk *d, int tenant, const cache_key *bkey, int64_t until) {
    dirstore_lock(d->ds);
    disk_entry *e = block_find_any(d, bkey);
    bool ok =
        e && entry_hold(d, e, tenant, e->manual, until > e->lease ? until : e->lease) == PIN_OK;
    dirstore_unlock(d->ds);
    leases_save(d);
    return ok;
}

static void expire_visit(void *ud, dirstore_entry *base) {
    lease_walk *w = ud;
    disk_entry *e = (disk_entry *)base;
    if (e->lease <= 0) return;
    if (e->lease <= w->now) {
        entry_hold(w->d, e, e->tenant, e->manual, 0); /* taking a reason away never fails */
        w->n++;
    } else if (w->next == 0 || e->lease < w->next) {
        w->next = e->lease;
    }
}

int cache_disk_expire(cache_disk *d, int64_t now) {
    int ended = 0;
    dirstore_lock(d->ds);
    if (d->next_expiry > 0 && d->next_expiry <= now) {
        lease_walk w = {.d = d, .now = now};
        dirstore_each_locked(d->ds, expire_visit, &w);
        d->next_expiry = w.next;
        ended = w.n;
    }
    /* The file keeps the ended leases until the next change or close (a restart skips them):
     * expiry runs on the engine's put path, which must not wait for the I/O thread. */
    dirstore_unlock(d->ds);
    return ended;
}

static void pin_visit(void *ud, dirstore_entry *base) {
    lease_walk *w = ud;
    const disk_entry *e = (const disk_entry *)base;
    if (!e->base.pinned || e->base.doomed) return;
    if (w->n < w->max)
        w->pins[w->n] = (cache_pin_info){.key = e->base.key,
                                         .ns = e->base.ns,
                                         .n_blocks = e->n_blocks,
                                         .manual = e->manual,
                                         .lease = e->lease,
                                         .disk = true};
    w->n++;
}

int cache_disk_pins(cache_disk *d, cache_pin_info *out, int max) {
    lease_walk w = {.pins = out, .max = max};
    dirstore_lock(d->ds);
    dirstore_each_locked(d->ds, pin_visit, &w);
    dirstore_unlock(d->ds);
    return w.n;
}

int cache_disk_restore_leases(cache_disk *d, int64_t now) {
    int fd = openat(dirstore_dir_fd(d->ds), DISK_LEASES, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0; /* none kept */
    struct stat sb;
    uint8_t *buf = NULL;
    kv_error err = {{0}};
    cache_lease *leases = NULL;
    int n = 0, restored = 0;
    size_t len = 0;
    bool read_ok = fstat(fd, &sb) == 0 && sb.st_size >= 0 &&
                   (uint64_t)sb.st_size <= cache_leases_bytes(CACHE_LEASES_MAX) &&
                   (buf = malloc((size_t)sb.st_size + 1));
    while (read_ok && len < (size_t)sb.st_size) {
        ssize_t k = read(fd, buf + len, (size_t)sb.st_size - len);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0)
            read_ok = false;
        else
            len += (size_t)k;
    }
    close(fd);
    const char *path = dirstore_path(d->ds);
    if (!read_ok)
        log_warn("cache: disk %s: leases file unreadable: leases from before the start are lost",
                 path);
    else if (cache_leases_parse(buf, len, &leases, &n, &err) != 0)
        log_warn("cache: disk %s: %s: leases from before the start are lost", path, err.msg);
    dirstore_lock(d->ds);
    for (int i = 0; i < n; i++) {
        disk_entry *e = table_find(d, &leases[i].key);
        if (e && !e->base.doomed && leases[i].until > now &&
            entry_hold(d, e, CACHE_TENANT_NONE, e->manual, leases[i].until) == PIN_OK)
            restored++;
    }
    d->leases_dirty = true; /* the file again, without what expired or is gone */
    dirstore_unlock(d->ds);
    leases_save(d);
    free(leases);
    free(buf);
    if (restored) log_info("cache: disk %s: %d leases kept from before the start", path, restored);
    return restored;
}

int64_t cache_disk_clear(cache_disk *d, const cache_key *ns) { return dirstore_clear(d->ds, ns); }

void cache_disk_stats(cache_disk *d, cache_tier_stats *out) { dirstore_stats(d->ds, out); }

void cache_disk_flush(cache_disk *d) {
    dirstore_flush(d->ds);
    dirstore_lock(d->ds);
    chunk_worker *w = d->encoder; /* stopped only by close: not while a caller flushes */
    dirstore_unlock(d->ds);
    if (w) chunk_worker_flush(w); /* the encodings of what was written */
    dirstore_flush(d->ds);        /* and their files */
}
