/* The blend content store's disk tier (cache/blend.h): content records kept across restarts,
 * read layer by layer by the fusor's loader while the forward pass computes.
 *
 * One file per record, <dir>/<content key hex>.kvb, written by a background thread to a
 * temporary name and renamed into place when whole; the format is cache/content_disk.h's.
 *
 * A layer is checked when it is read, so a record damaged on disk is found at the layer it
 * breaks: the fusor then falls back to computing its tokens (the engine redoes the step), the
 * file is deleted and counted. At open the index is rebuilt from the headers (leftover
 * temporaries and files that fail their header checks are deleted); least recently used
 * records (by file time at open) go first when the cap is reached. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <openssl/evp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cache/content_disk.h"
#include "util/keytable.h"

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

typedef struct cd_entry {
    kt_node node;
    lru_node lru;
    cache_key key;
    cache_key ns;
    int32_t pos0;
    int n_tok;
    int64_t bytes;
} cd_entry;

struct content_disk {
    char *path;
    int dir_fd;
    uint8_t model_id[32];
    int n_layer;
    int kv_dim;
    int64_t cap;
    pthread_mutex_t mu;
    pthread_cond_t work, idle;
    keytable table;
    lru_list lru;
    cache_tier_stats st;
    content_rec **wq; /* [CD_WRITE_QUEUE] ring of records to write, one reference each */
    int wq_head, wq_len;
    bool writing;
    bool quit;
    pthread_t thread;
    bool thread_started;
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

static int sha256(const void *data, size_t len, uint8_t out[32]) {
    unsigned n = 0;
    return EVP_Digest(data, len, out, &n, EVP_sha256(), NULL) == 1 && n == 32 ? 0 : -1;
}

static int header_sha(const uint8_t *hdr, size_t hb, uint8_t out[32]) {
    EVP_MD_CTX *md = EVP_MD_CTX_new();
    unsigned n = 0;
    int ok = md && EVP_DigestInit_ex(md, EVP_sha256(), NULL) == 1 &&
             EVP_DigestUpdate(md, hdr, OFF_HEADER_SHA) == 1 &&
             EVP_DigestUpdate(md, hdr + OFF_LAYER_SHA, hb - OFF_LAYER_SHA) == 1 &&
             EVP_DigestFinal_ex(md, out, &n) == 1 && n == 32;
    EVP_MD_CTX_free(md);
    return ok ? 0 : -1;
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
        if (sha256(content_rec_rows(r, l, 0), lb, hdr + OFF_LAYER_SHA + 32 * (size_t)l)) return -1;
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
        if (sha256(layer, lb, sha) || memcmp(sha, info.layer_sha + 32 * (size_t)l, 32) != 0) {
            content_rec_unref(r);
            kv_fail(err, "layer %d checksum", l);
            return NULL;
        }
        memcpy((uint8_t *)r->data + (size_t)l * lb, layer, lb);
    }
    return r;
}

static void record_name(const cache_key *k, char out[2 * CACHE_KEY_BYTES + 5]) {
    cache_key_hex(k, out);
    strcat(out, ".kvb");
}

static bool record_name_parse(const char *name, cache_key *k) {
    if (strlen(name) != 2 * CACHE_KEY_BYTES + 4 || strcmp(name + 2 * CACHE_KEY_BYTES, ".kvb"))
        return false;
    for (int i = 0; i < CACHE_KEY_BYTES; i++) {
        unsigned v;
        char hex[3] = {name[2 * i], name[2 * i + 1], 0};
        if (!strchr("0123456789abcdef", hex[0]) || !strchr("0123456789abcdef", hex[1]) ||
            sscanf(hex, "%2x", &v) != 1)
            return false;
        k->b[i] = (uint8_t)v;
    }
    return true;
}

/* ---------------------------------------------------------------- index (under mu) */

static cd_entry *find(const content_disk *d, const cache_key *key) {
    kt_node *n = keytable_find(&d->table, key->b);
    return n ? KT_ENTRY(n, cd_entry, node) : NULL;
}

/* Forgets e and deletes its file. */
static void entry_drop(content_disk *d, cd_entry *e) {
    char name[2 * CACHE_KEY_BYTES + 5];
    record_name(&e->key, name);
    unlinkat(d->dir_fd, name, 0);
    keytable_remove(&d->table, &e->node);
    lru_unlink(&d->lru, &e->lru);
    d->st.entries--;
    d->st.bytes -= e->bytes;
    free(e);
}

static void entry_add(content_disk *d, cd_entry *e) {
    e->node.key = e->key.b;
    keytable_insert(&d->table, &e->node);
    lru_touch(&d->lru, &e->lru);
    d->st.entries++;
    d->st.bytes += e->bytes;
}

static void evict(content_disk *d) {
    while (d->st.bytes > d->cap && d->lru.oldest) {
        entry_drop(d, KT_ENTRY(d->lru.oldest, cd_entry, lru));
        d->st.evictions++;
    }
}

/* ---------------------------------------------------------------- writing */

static int write_full(int fd, const void *p, size_t n) {
    const uint8_t *b = p;
    while (n > 0) {
        ssize_t w = write(fd, b, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        b += w;
        n -= (size_t)w;
    }
    return 0;
}

static void disk_write(content_disk *d, content_rec *r) {
    char name[2 * CACHE_KEY_BYTES + 5], part[2 * CACHE_KEY_BYTES + 10];
    record_name(&r->key, name);
    snprintf(part, sizeof part, "%s.part", name);
    size_t hb = content_record_header_bytes(d->n_layer),
           lb = content_record_layer_bytes(d->kv_dim, r->n_tok);
    uint8_t *hdr = malloc(hb);
    cd_entry *e = calloc(1, sizeof *e);
    int fd = -1;
    const char *why = "out of memory";
    if (!hdr || !e || content_record_encode_header(d->model_id, r, hdr)) goto fail;
    why = "cannot create";
    if ((fd = openat(d->dir_fd, part, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)) < 0)
        goto fail;
    why = "cannot write";
    if (write_full(fd, hdr, hb) || write_full(fd, r->data, (size_t)d->n_layer * lb) ||
        fdatasync(fd) != 0)
        goto fail;
    close(fd);
    fd = -1;
    why = "cannot rename";
    if (renameat(d->dir_fd, part, d->dir_fd, name) != 0) goto fail;
    *e = (cd_entry){.key = r->key,
                    .ns = r->ns,
                    .pos0 = r->pos0,
                    .n_tok = r->n_tok,
                    .bytes = (int64_t)(hb + (size_t)d->n_layer * lb)};
    pthread_mutex_lock(&d->mu);
    cd_entry *old = find(d, &r->key);
    if (old) { /* written meanwhile by another request: the file is the same */
        keytable_remove(&d->table, &old->node);
        lru_unlink(&d->lru, &old->lru);
        d->st.entries--;
        d->st.bytes -= old->bytes;
        free(old);
    }
    entry_add(d, e);
    d->st.bytes_in += e->bytes;
    evict(d);
    pthread_mutex_unlock(&d->mu);
    free(hdr);
    return;
fail:
    /* a full disk or a failing write costs only the disk copy */
    log_warn("blend: disk %s: %s %s: %s", d->path, why, part, strerror(errno));
    if (fd >= 0) close(fd);
    unlinkat(d->dir_fd, part, 0);
    pthread_mutex_lock(&d->mu);
    d->st.write_errors++;
    pthread_mutex_unlock(&d->mu);
    free(hdr);
    free(e);
}

static void *disk_thread(void *arg) {
    content_disk *d = arg;
    pthread_mutex_lock(&d->mu);
    for (;;) {
        while (d->wq_len == 0 && !d->quit) pthread_cond_wait(&d->work, &d->mu);
        if (d->wq_len == 0) break; /* quit once the queue is empty */
        content_rec *r = d->wq[d->wq_head];
        d->wq_head = (d->wq_head + 1) % CD_WRITE_QUEUE;
        d->wq_len--;
        d->writing = true;
        pthread_mutex_unlock(&d->mu);
        disk_write(d, r);
        content_rec_unref(r);
        pthread_mutex_lock(&d->mu);
        d->writing = false;
        pthread_cond_broadcast(&d->idle);
    }
    pthread_mutex_unlock(&d->mu);
    return NULL;
}

/* ---------------------------------------------------------------- open and scan */

typedef struct scan_item {
    cd_entry *e;
    struct timespec mtime;
} scan_item;

static int scan_item_cmp(const void *a, const void *b) {
    const struct timespec *x = &((const scan_item *)a)->mtime, *y = &((const scan_item *)b)->mtime;
    if (x->tv_sec != y->tv_sec) return x->tv_sec < y->tv_sec ? -1 : 1;
    return (x->tv_nsec > y->tv_nsec) - (x->tv_nsec < y->tv_nsec);
}

static int disk_scan(content_disk *d, kv_error *err) {
    int fd = dup(d->dir_fd);
    DIR *dir = fd >= 0 ? fdopendir(fd) : NULL;
    if (!dir) {
        if (fd >= 0) close(fd);
        return kv_fail(err, "cannot list %s: %s", d->path, strerror(errno));
    }
    size_t hb = content_record_header_bytes(d->n_layer);
    uint8_t *hdr = malloc(hb);
    scan_item *items = NULL;
    size_t n_items = 0, cap_items = 0;
    int rc = 0;
    if (!hdr) rc = kv_fail(err, "out of memory");
    struct dirent *de;
    while (rc == 0 && (de = readdir(dir))) {
        const char *name = de->d_name;
        size_t nl = strlen(name);
        cache_key key;
        if (nl > 5 && strcmp(name + nl - 5, ".part") == 0) { /* a write that never finished */
            if (unlinkat(d->dir_fd, name, 0) == 0) d->st.corrupt++;
            continue;
        }
        if (!record_name_parse(name, &key)) continue; /* not ours: left alone */
        struct stat sb;
        int rfd = openat(d->dir_fd, name, O_RDONLY | O_CLOEXEC);
        if (rfd < 0) continue;
        ssize_t got = fstat(rfd, &sb) == 0 && S_ISREG(sb.st_mode) ? pread(rfd, hdr, hb, 0) : -1;
        close(rfd);
        cd_entry *e = calloc(1, sizeof *e);
        kv_error why = {{0}};
        if (!e) {
            rc = kv_fail(err, "out of memory");
            break;
        }
        content_record_info info;
        if (got < 0 ||
            content_record_check_header(d->model_id, d->n_layer, d->kv_dim, hdr, (size_t)got,
                                        (int64_t)sb.st_size, &key, &info, &why) != 0) {
            log_warn("blend: disk %s: deleting %s: %s", d->path, name,
                     got < 0 ? strerror(errno) : why.msg);
            if (unlinkat(d->dir_fd, name, 0) == 0) d->st.corrupt++;
            free(e);
            continue;
        }
        *e = (cd_entry){.key = key,
                        .ns = info.ns,
                        .pos0 = info.pos0,
                        .n_tok = info.n_tok,
                        .bytes = info.file_bytes};
        if (n_items == cap_items) {
            size_t cap = cap_items ? 2 * cap_items : 64;
            scan_item *v = realloc(items, cap * sizeof *v);
            if (!v) {
                free(e);
                rc = kv_fail(err, "out of memory");
                break;
            }
            items = v;
            cap_items = cap;
        }
        items[n_items++] = (scan_item){e, sb.st_mtim};
    }
    if (n_items) qsort(items, n_items, sizeof *items, scan_item_cmp);
    for (size_t i = 0; i < n_items; i++) {
        if (rc == 0)
            entry_add(d, items[i].e);
        else
            free(items[i].e);
    }
    if (rc == 0) evict(d);
    closedir(dir);
    free(items);
    free(hdr);
    return rc;
}

static void free_entry(void *ud, kt_node *n) {
    (void)ud;
    free(KT_ENTRY(n, cd_entry, node));
}

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
    d->dir_fd = -1;
    pthread_mutex_init(&d->mu, NULL);
    pthread_cond_init(&d->work, NULL);
    pthread_cond_init(&d->idle, NULL);
    memcpy(d->model_id, model_id, 32);
    d->n_layer = n_layer;
    d->kv_dim = kv_dim;
    d->cap = cap_bytes;
    d->st.capacity = cap_bytes;
    d->path = strdup(dir);
    d->wq = calloc(CD_WRITE_QUEUE, sizeof *d->wq);
    if (!d->path || !d->wq || keytable_init(&d->table, CACHE_KEY_BYTES) != 0) {
        kv_fail(err, "blend disk: out of memory");
        goto fail;
    }
    if (kv_mkdir_p(d->path, err) != 0) goto fail;
    d->dir_fd = open(d->path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (d->dir_fd < 0 || faccessat(d->dir_fd, ".", W_OK | X_OK, AT_EACCESS) != 0) {
        kv_fail(err, "cannot use %s: %s", d->path, strerror(errno));
        goto fail;
    }
    if (disk_scan(d, err) != 0) goto fail;
    if (pthread_create(&d->thread, NULL, disk_thread, d) != 0) {
        kv_fail(err, "blend disk: cannot start its writer thread");
        goto fail;
    }
    d->thread_started = true;
    log_info("blend: disk %s: %lld records, %lld bytes (cap %lld); %lld invalid files deleted",
             d->path, (long long)d->st.entries, (long long)d->st.bytes, (long long)d->cap,
             (long long)d->st.corrupt);
    return d;
fail:
    content_disk_close(d);
    return NULL;
}

void content_disk_close(content_disk *d) {
    if (!d) return;
    if (d->thread_started) {
        pthread_mutex_lock(&d->mu);
        d->quit = true;
        pthread_cond_broadcast(&d->work);
        pthread_mutex_unlock(&d->mu);
        pthread_join(d->thread, NULL);
    }
    for (int i = 0; i < d->wq_len; i++) content_rec_unref(d->wq[(d->wq_head + i) % CD_WRITE_QUEUE]);
    if (d->table.buckets) keytable_each(&d->table, free_entry, NULL);
    keytable_free(&d->table);
    if (d->dir_fd >= 0) close(d->dir_fd);
    pthread_cond_destroy(&d->work);
    pthread_cond_destroy(&d->idle);
    pthread_mutex_destroy(&d->mu);
    free(d->wq);
    free(d->path);
    free(d);
}

/* ---------------------------------------------------------------- the public calls */

void content_disk_put(content_disk *d, content_rec *r) {
    if (!d || !r || r->src || r->n_layer != d->n_layer || r->kv_dim != d->kv_dim) return;
    pthread_mutex_lock(&d->mu);
    if (find(d, &r->key)) {
        lru_touch(&d->lru, &find(d, &r->key)->lru);
    } else if (d->wq_len == CD_WRITE_QUEUE) {
        d->st.dropped++;
    } else {
        content_rec_ref(r);
        d->wq[(d->wq_head + d->wq_len++) % CD_WRITE_QUEUE] = r;
        pthread_cond_signal(&d->work);
    }
    pthread_mutex_unlock(&d->mu);
}

content_rec *content_disk_get(content_disk *d, const cache_key *key, int n_tok) {
    if (!d) return NULL;
    pthread_mutex_lock(&d->mu);
    cd_entry *e = find(d, key);
    cd_entry info = e && e->n_tok == n_tok ? *e : (cd_entry){0};
    if (e && e->n_tok == n_tok) {
        lru_touch(&d->lru, &e->lru);
        d->st.hits++;
    } else {
        d->st.misses++;
    }
    pthread_mutex_unlock(&d->mu);
    if (info.n_tok == 0) return NULL;
    content_rec *r = content_rec_create(d->n_layer, d->kv_dim, n_tok, key, &info.ns, info.pos0);
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

/* The record failed (a read error, a bad checksum, a vanished file): forget it and delete it. */
static int src_fail(content_rec *r, const char *why) {
    content_src *src = r->src;
    content_disk *d = src->d;
    char hex[2 * CACHE_KEY_BYTES + 1];
    cache_key_hex(&r->key, hex);
    log_warn("blend: disk %s: record %.16s dropped: %s; its tokens are computed instead", d->path,
             hex, why);
    src->failed = true;
    if (src->fd >= 0) close(src->fd);
    src->fd = -1;
    pthread_mutex_lock(&d->mu);
    cd_entry *e = find(d, &r->key);
    if (e) entry_drop(d, e);
    d->st.corrupt++;
    pthread_mutex_unlock(&d->mu);
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
        char name[2 * CACHE_KEY_BYTES + 5];
        record_name(&r->key, name);
        src->fd = openat(d->dir_fd, name, O_RDONLY | O_CLOEXEC);
        if (src->fd < 0) return src_fail(r, strerror(errno));
        uint8_t *hdr = malloc(hb);
        struct stat sb;
        content_record_info got;
        kv_error why = {{0}};
        ssize_t n = hdr && fstat(src->fd, &sb) == 0 ? pread(src->fd, hdr, hb, 0) : -1;
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
    size_t done = 0;
    while (done < lb) {
        ssize_t n = pread(src->fd, dst + done, lb - done, (off_t)(hb + (size_t)layer * lb + done));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return src_fail(r, n < 0 ? strerror(errno) : "short read");
        done += (size_t)n;
    }
    if (sha256(dst, lb, sha) || memcmp(sha, src->layer_sha + 32 * (size_t)layer, 32) != 0)
        return src_fail(r, "layer checksum");
    pthread_mutex_lock(&d->mu);
    d->st.bytes_out += (int64_t)lb;
    pthread_mutex_unlock(&d->mu);
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
    if (!d) return 0;
    pthread_mutex_lock(&d->mu);
    int64_t n = 0;
    for (lru_node *l = d->lru.oldest; l;) {
        cd_entry *e = KT_ENTRY(l, cd_entry, lru);
        l = l->newer;
        if (ns && memcmp(e->ns.b, ns->b, CACHE_KEY_BYTES) != 0) continue;
        entry_drop(d, e);
        n++;
    }
    pthread_mutex_unlock(&d->mu);
    return n;
}

void content_disk_stats(content_disk *d, cache_tier_stats *out) {
    memset(out, 0, sizeof *out);
    if (!d) return;
    pthread_mutex_lock(&d->mu);
    *out = d->st;
    pthread_mutex_unlock(&d->mu);
}

void content_disk_flush(content_disk *d) {
    if (!d) return;
    pthread_mutex_lock(&d->mu);
    while (d->wq_len > 0 || d->writing) pthread_cond_wait(&d->idle, &d->mu);
    pthread_mutex_unlock(&d->mu);
}
