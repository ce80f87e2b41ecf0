/* The content records' disk tier (cache/store/content.h): records kept across restarts, read
 * layer by layer by blend's fusor (its loader thread) while the forward pass computes.
 *
 * One file per record, <dir>/<content key hex>.kvb, in the format cache/store/content_disk.h gives;
 * the directory, its index, the writer thread and the durability rule are the disk tiers' core's
 * (cache/store/dirstore.h), with the type table below.
 *
 * A layer is checked when it is read, so a record damaged on disk is found at the layer it
 * breaks: the fusor then falls back to computing its tokens (the engine redoes the step), the
 * file is deleted and counted. At open the index is rebuilt from the headers (leftover
 * temporaries and files that fail their header checks are deleted); least recently used
 * records (by file time at open) go first when the cap is reached. */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cache/store/content_disk.h"
#include "cache/store/dirstore.h"

#define CD_MAGIC "KVSBLEND"
#define OFF_VERSION 8
#define OFF_HEADER_BYTES 12
#define OFF_MODEL 16
#define OFF_KEY 48
#define OFF_NS 80
#define OFF_DIMS 112
#define OFF_LAYER_BYTES 128
#define OFF_HEADER_SHA 136
#define OFF_LAYER_SHA 168
#define CD_WRITE_QUEUE 256 /* pending writes at most; beyond, a write is dropped and counted */

struct content_disk {
    dirstore *ds;
    uint8_t model_id[32];
    int n_layer;
    int kv_dim;
};

/* A disk record being read into a content_rec, layer by layer (content_rec.src). */
struct content_src {
    content_disk *d;
    int fd;
    int n_read; /* layers read and checked */
    bool failed;
    uint8_t *layer_sha; /* [n_layer][32], from the header */
};

/* ---------------------------------------------------------------- format */

size_t content_record_header_bytes(int n_layer) { return OFF_LAYER_SHA + 32 * (size_t)n_layer; }

/* The header's own checksum: every header byte but the checksum field. */
static int header_sha(const uint8_t *hdr, size_t hb, uint8_t out[32]) {
    return kv_sha256_2(hdr, OFF_HEADER_SHA, hdr + OFF_LAYER_SHA, hb - OFF_LAYER_SHA, out);
}

size_t content_record_layer_bytes(int kv_dim, int n_tok) {
    return 2 * sizeof(uint16_t) * (size_t)n_tok * (size_t)kv_dim;
}

int content_record_encode_header(const uint8_t model_id[32], const content_rec *r, uint8_t *hdr) {
    size_t hb = content_record_header_bytes(r->n_layer),
           lb = content_record_layer_bytes(r->kv_dim, r->n_tok);
    memset(hdr, 0, hb);
    memcpy(hdr, CD_MAGIC, 8);
    le_put_u32(hdr + OFF_VERSION, CONTENT_RECORD_VERSION);
    le_put_u32(hdr + OFF_HEADER_BYTES, (uint32_t)hb);
    memcpy(hdr + OFF_MODEL, model_id, 32);
    memcpy(hdr + OFF_KEY, r->key.b, 32);
    memcpy(hdr + OFF_NS, r->ns.b, 32);
    le_put_u32(hdr + OFF_DIMS, (uint32_t)r->n_layer);
    le_put_u32(hdr + OFF_DIMS + 4, (uint32_t)r->kv_dim);
    le_put_u32(hdr + OFF_DIMS + 8, (uint32_t)r->n_tok);
    le_put_u32(hdr + OFF_DIMS + 12, (uint32_t)r->pos0);
    le_put_u64(hdr + OFF_LAYER_BYTES, lb);
    for (int l = 0; l < r->n_layer; l++)
        if (kv_sha256(content_rec_rows(r, l, 0), lb, hdr + OFF_LAYER_SHA + 32 * (size_t)l))
            return -1;
    return header_sha(hdr, hb, hdr + OFF_HEADER_SHA);
}

int content_record_check_header(const uint8_t model_id[32], int n_layer, int kv_dim,
                                const uint8_t *hdr, size_t len, int64_t file_bytes,
                                const cache_key *key, content_record_info *out, kv_error *err) {
    size_t hb = content_record_header_bytes(n_layer);
    if (len < hb || memcmp(hdr, CD_MAGIC, 8) != 0) return kv_fail(err, "not a content record");
    if (le_get_u32(hdr + OFF_VERSION) != CONTENT_RECORD_VERSION)
        return kv_fail(err, "content record version %u", le_get_u32(hdr + OFF_VERSION));
    if (le_get_u32(hdr + OFF_HEADER_BYTES) != hb) return kv_fail(err, "header size");
    uint8_t sha[32];
    if (header_sha(hdr, hb, sha) || memcmp(sha, hdr + OFF_HEADER_SHA, 32) != 0)
        return kv_fail(err, "header checksum");
    if (memcmp(hdr + OFF_MODEL, model_id, 32) != 0) return kv_fail(err, "another model");
    if (memcmp(hdr + OFF_KEY, key->b, 32) != 0) return kv_fail(err, "key differs from name");
    uint32_t nl = le_get_u32(hdr + OFF_DIMS), kd = le_get_u32(hdr + OFF_DIMS + 4),
             n_tok = le_get_u32(hdr + OFF_DIMS + 8), pos0 = le_get_u32(hdr + OFF_DIMS + 12);
    if (nl != (uint32_t)n_layer || kd != (uint32_t)kv_dim)
        return kv_fail(err, "layout %u layers x %u differs", nl, kd);
    if (n_tok < 1 || n_tok > CONTENT_RECORD_MAX_TOKENS || pos0 > (uint32_t)INT32_MAX - n_tok)
        return kv_fail(err, "%u tokens at %u", n_tok, pos0);
    size_t lb = content_record_layer_bytes(kv_dim, (int)n_tok);
    if (le_get_u64(hdr + OFF_LAYER_BYTES) != lb) return kv_fail(err, "layer size");
    if (file_bytes != (int64_t)(hb + (size_t)n_layer * lb))
        return kv_fail(err, "file of %lld bytes, not %zu", (long long)file_bytes,
                       hb + (size_t)n_layer * lb);
    out->key = *key;
    memcpy(out->ns.b, hdr + OFF_NS, 32);
    out->pos0 = (int32_t)pos0;
    out->n_tok = (int)n_tok;
    out->file_bytes = file_bytes;
    out->layer_sha = hdr + OFF_LAYER_SHA;
    return 0;
}

content_rec *content_record_parse(const uint8_t model_id[32], int n_layer, int kv_dim,
                                  const uint8_t *buf, size_t len, const cache_key *key,
                                  kv_error *err) {
    content_record_info info;
    if (content_record_check_header(model_id, n_layer, kv_dim, buf, len, (int64_t)len, key, &info,
                                    err))
        return NULL;
    content_rec *r = content_rec_create(n_layer, kv_dim, info.n_tok, key, &info.ns, info.pos0);
    if (!r) {
        kv_fail(err, "out of memory");
        return NULL;
    }
    size_t hb = content_record_header_bytes(n_layer),
           lb = content_record_layer_bytes(kv_dim, info.n_tok);
    for (int l = 0; l < n_layer; l++) {
        uint8_t sha[32];
        const uint8_t *layer = buf + hb + (size_t)l * lb;
        if (kv_sha256(layer, lb, sha) || memcmp(sha, info.layer_sha + 32 * (size_t)l, 32) != 0) {
            content_rec_unref(r);
            kv_fail(err, "layer %d checksum", l);
            return NULL;
        }
        memcpy((uint8_t *)r->data + (size_t)l * lb, layer, lb);
    }
    return r;
}

/* ---------------------------------------------------------------- the core's type */

typedef struct cd_entry {
    dirstore_entry base;
    int32_t pos0;
    int n_tok;
} cd_entry;

static void record_name(void *ud, const cache_key *k, int file, char out[DIRSTORE_NAME_MAX]) {
    (void)ud;
    (void)file;
    cache_key_hex(k, out);
    strcat(out, ".kvb");
}

static bool record_name_parse(const char *name, cache_key *k, int *file) {
    *file = 0;
    return strlen(name) == 2 * CACHE_KEY_BYTES + 4 &&
           strcmp(name + 2 * CACHE_KEY_BYTES, ".kvb") == 0 &&
           kv_hex_decode(name, CACHE_KEY_BYTES, k->b);
}

static dirstore_check record_check(void *ud, dirstore *ds, const cache_key *k, int file,
                                   const uint8_t *hdr, size_t len, int64_t file_bytes,
                                   dirstore_entry **e, kv_error *err) {
    content_disk *d = ud;
    (void)ds;
    (void)file;
    content_record_info info;
    if (content_record_check_header(d->model_id, d->n_layer, d->kv_dim, hdr, len, file_bytes, k,
                                    &info, err) != 0)
        return DIRSTORE_CORRUPT;
    cd_entry *ce = calloc(1, sizeof *ce);
    if (ce)
        *ce = (cd_entry){.base = {.key = *k, .ns = info.ns, .bytes = info.file_bytes},
                         .pos0 = info.pos0,
                         .n_tok = info.n_tok};
    *e = ce ? &ce->base : NULL;
    return DIRSTORE_VALID;
}

/* A record's file: its header, then its layers (buffered writes: the file is small). */
static int record_write(void *ud, int fd, void *item) {
    content_disk *d = ud;
    content_rec *r = item;
    size_t hb = content_record_header_bytes(d->n_layer),
           lb = content_record_layer_bytes(d->kv_dim, r->n_tok);
    uint8_t *hdr = malloc(hb);
    int err = !hdr || content_record_encode_header(d->model_id, r, hdr) ? ENOMEM : 0;
    if (!err && (kv_write_full(fd, hdr, hb) || kv_write_full(fd, r->data, (size_t)d->n_layer * lb)))
        err = errno;
    free(hdr);
    return err;
}

static void record_unref(void *item) { content_rec_unref(item); }

static const dirstore_type content_disk_type = {
    .tier = "blend: disk",
    .file_name = record_name,
    .parse_name = record_name_parse,
    .check = record_check,
    .write_payload = record_write,
    .unref = record_unref,
};

content_disk *content_disk_open(const char *dir, const uint8_t model_id[32], int n_layer,
                                int kv_dim, int64_t cap_bytes, kv_error *err) {
    if (!dir || !*dir || n_layer < 1 || kv_dim < 1 || cap_bytes < 0) {
        kv_fail(err, "blend disk: bad arguments");
        return NULL;
    }
    content_disk *d = calloc(1, sizeof *d);
    if (!d) {
        kv_fail(err, "blend disk: out of memory");
        return NULL;
    }
    memcpy(d->model_id, model_id, 32);
    d->n_layer = n_layer;
    d->kv_dim = kv_dim;
    dirstore_params p = {.path = dir,
                         .cap = cap_bytes,
                         .write_queue = CD_WRITE_QUEUE,
                         .n_files = 1,
                         .header_bytes = content_record_header_bytes(n_layer),
                         .ud = d};
    if (!(d->ds = dirstore_open(&content_disk_type, &p, err))) {
        free(d);
        return NULL;
    }
    return d;
}

void content_disk_close(content_disk *d) {
    if (!d) return;
    dirstore_close(d->ds);
    free(d);
}

/* ---------------------------------------------------------------- the public calls */

void content_disk_put(content_disk *d, content_rec *r) {
    if (!d || !r || r->src || r->n_layer != d->n_layer || r->kv_dim != d->kv_dim) return;
    dirstore_lock(d->ds);
    dirstore_entry *e = dirstore_find_locked(d->ds, &r->key);
    if (e) {
        if (!e->writing) dirstore_touch_locked(d->ds, e);
    } else {
        cd_entry *ce = calloc(1, sizeof *ce);
        int64_t bytes =
            (int64_t)(content_record_header_bytes(d->n_layer) +
                      (size_t)d->n_layer * content_record_layer_bytes(d->kv_dim, r->n_tok));
        if (ce)
            *ce = (cd_entry){.base = {.key = r->key, .ns = r->ns, .bytes = bytes},
                             .pos0 = r->pos0,
                             .n_tok = r->n_tok};
        if (!ce)
            dirstore_stats_locked(d->ds)->dropped++;
        else if (dirstore_queue_locked(d->ds, &ce->base, r))
            content_rec_ref(r);
        else
            free(ce);
    }
    dirstore_unlock(d->ds);
}

content_rec *content_disk_get(content_disk *d, const cache_key *key, int n_tok) {
    if (!d) return NULL;
    dirstore_lock(d->ds);
    cd_entry *e = (cd_entry *)dirstore_find_locked(d->ds, key);
    bool hit = e && !e->base.writing && e->n_tok == n_tok;
    cd_entry info = hit ? *e : (cd_entry){0};
    if (hit) {
        dirstore_touch_locked(d->ds, &e->base);
        dirstore_stats_locked(d->ds)->hits++;
    } else {
        dirstore_stats_locked(d->ds)->misses++;
    }
    dirstore_unlock(d->ds);
    if (!hit) return NULL;
    content_rec *r =
        content_rec_create(d->n_layer, d->kv_dim, n_tok, key, &info.base.ns, info.pos0);
    content_src *src = calloc(1, sizeof *src);
    if (!r || !src) {
        content_rec_unref(r);
        free(src);
        return NULL;
    }
    *src = (content_src){.d = d, .fd = -1};
    r->src = src;
    return r;
}

/* The record failed (a read error, a bad checksum, a vanished file): forget it and delete it
 * (the I/O thread does, before this returns). */
static int src_fail(content_rec *r, const char *why) {
    content_src *src = r->src;
    content_disk *d = src->d;
    char hex[2 * CACHE_KEY_BYTES + 1];
    cache_key_hex(&r->key, hex);
    log_warn("blend: disk %s: record %.16s dropped: %s; its tokens are computed instead",
             dirstore_path(d->ds), hex, why);
    src->failed = true;
    if (src->fd >= 0) close(src->fd);
    src->fd = -1;
    dirstore_lock(d->ds);
    dirstore_entry *e = dirstore_find_locked(d->ds, &r->key);
    if (e && !e->writing && dirstore_remove_locked(d->ds, e, e->files))
        dirstore_run_locked(d->ds, NULL, NULL);
    dirstore_stats_locked(d->ds)->corrupt++;
    dirstore_unlock(d->ds);
    return -1;
}

int content_rec_read_layer(content_rec *r, int layer) {
    content_src *src = r->src;
    if (!src || layer < src->n_read) return 0;
    if (src->failed) return -1;
    content_disk *d = src->d;
    if (layer != src->n_read) return src_fail(r, "layers read out of order");
    size_t hb = content_record_header_bytes(d->n_layer),
           lb = content_record_layer_bytes(d->kv_dim, r->n_tok);
    if (src->fd < 0) {
        char name[DIRSTORE_NAME_MAX];
        record_name(d, &r->key, 0, name);
        src->fd = openat(dirstore_dir_fd(d->ds), name, O_RDONLY | O_CLOEXEC);
        if (src->fd < 0) return src_fail(r, strerror(errno));
        uint8_t *hdr = malloc(hb);
        struct stat sb;
        content_record_info got;
        kv_error why = {{0}};
        int64_t n = hdr && fstat(src->fd, &sb) == 0 ? kv_pread_full(src->fd, hdr, hb, 0) : -1;
        int bad = n < 0 ||
                  content_record_check_header(d->model_id, d->n_layer, d->kv_dim, hdr, (size_t)n,
                                              (int64_t)sb.st_size, &r->key, &got, &why) != 0 ||
                  got.n_tok != r->n_tok || got.pos0 != r->pos0;
        if (!bad && !(src->layer_sha = malloc(32 * (size_t)d->n_layer))) bad = 1;
        if (!bad) memcpy(src->layer_sha, got.layer_sha, 32 * (size_t)d->n_layer);
        free(hdr);
        if (bad) return src_fail(r, n < 0 ? "unreadable" : why.msg[0] ? why.msg : "header");
    }
    uint8_t *dst = (uint8_t *)(uintptr_t)content_rec_rows(r, layer, 0), sha[32];
    int64_t n = kv_pread_full(src->fd, dst, lb, (int64_t)(hb + (size_t)layer * lb));
    if (n != (int64_t)lb) return src_fail(r, n < 0 ? strerror(errno) : "short read");
    if (kv_sha256(dst, lb, sha) || memcmp(sha, src->layer_sha + 32 * (size_t)layer, 32) != 0)
        return src_fail(r, "layer checksum");
    dirstore_lock(d->ds);
    dirstore_stats_locked(d->ds)->bytes_out += (int64_t)lb;
    dirstore_unlock(d->ds);
    if (++src->n_read == d->n_layer) {
        close(src->fd);
        src->fd = -1;
    }
    return 0;
}

bool content_rec_complete(const content_rec *r) {
    return !r->src || (!r->src->failed && r->src->n_read == r->n_layer);
}

bool content_rec_failed(const content_rec *r) { return r->src && r->src->failed; }

void content_rec_settle(content_rec *r) {
    if (!r || !content_rec_complete(r) || !r->src) return;
    content_src_free(r->src);
    r->src = NULL;
}

void content_src_free(content_src *src) {
    if (!src) return;
    if (src->fd >= 0) close(src->fd);
    free(src->layer_sha);
    free(src);
}

int64_t content_disk_clear(content_disk *d, const cache_key *ns) {
    return d ? dirstore_clear(d->ds, ns) : 0;
}

void content_disk_stats(content_disk *d, cache_tier_stats *out) {
    memset(out, 0, sizeof *out);
    if (d) dirstore_stats(d->ds, out);
}

void content_disk_flush(content_disk *d) {
    if (d) dirstore_flush(d->ds);
}
