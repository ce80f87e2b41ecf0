/* The disk tiers' core (cache/store/dirstore.h): the directory, the scan at open, the capped LRU
 * index, the victims deleted outside the lock, and the I/O thread with its jobs, write ring and
 * posted work. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cache/store/dirstore.h"

#define DIRSTORE_WARN_NS 10000000000ull /* at most one I/O warning per 10 s */
#define DIRSTORE_TMP_NAME 128

/* Files of a key to delete once the lock is released. */
typedef struct dirstore_victim {
    cache_key key;
    uint16_t files;
} dirstore_victim;

/* A job whose caller waits for it (the struct lives on the caller's stack). */
typedef struct dirstore_job {
    void (*fn)(void *ud, void *arg);
    void *arg;
    bool done;
    struct dirstore_job *next;
} dirstore_job;

/* A queued write: the item and the writing entry it becomes. */
typedef struct dirstore_write {
    void *item;
    dirstore_entry *e;
    int64_t bytes; /* the entry's at queueing (the entry may change before the write ends) */
} dirstore_write;

struct dirstore {
    const dirstore_type *t;
    void *ud;
    char *path;
    int dir_fd;
    int n_files;
    size_t header_bytes;
    int64_t cap;
    int write_queue;

    pthread_mutex_t mu;
    pthread_cond_t work; /* to the I/O thread: a job, a write, a victim, posted work or stop */
    pthread_cond_t done; /* to waiters: a job, a write or posted work finished */

    /* Guarded by mu. */
    keytable table; /* key -> entry */
    lru_list lru;   /* published entries */
    uint64_t next_gen;
    cache_tier_stats st;
    dirstore_write *wq; /* ring [max(write_queue, 1)] */
    int wq_head, wq_len;
    int n_writes;        /* queued + in flight */
    int64_t write_bytes; /* their records' bytes */
    dirstore_job *jobs, *jobs_tail;
    void (*post_fn)(void *ud, void *arg); /* posted work (NULL: none) */
    void *post_arg;
    dirstore_victim *victims;
    size_t n_victims, cap_victims;
    bool stop;

    /* The I/O thread's own (and open's, before the thread starts). */
    pthread_t thread;
    bool thread_started;
    uint64_t tmp_counter;
    uint64_t warn_last_ns;
    int64_t warn_suppressed;
    bool warned_once;
};

static bool ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && memcmp(s + n - m, suffix, m) == 0;
}

const char *dirstore_path(const dirstore *ds) { return ds->path; }
int dirstore_dir_fd(const dirstore *ds) { return ds->dir_fd; }
int64_t dirstore_cap(const dirstore *ds) { return ds->cap; }

int64_t dirstore_write_bytes(dirstore *ds) {
    pthread_mutex_lock(&ds->mu);
    int64_t n = ds->write_bytes;
    pthread_mutex_unlock(&ds->mu);
    return n;
}
void dirstore_lock(dirstore *ds) { pthread_mutex_lock(&ds->mu); }
void dirstore_unlock(dirstore *ds) { pthread_mutex_unlock(&ds->mu); }
cache_tier_stats *dirstore_stats_locked(dirstore *ds) { return &ds->st; }

/* O_DIRECT keeps the page cache for the model and the RAM tier; filesystems without it (tmpfs
 * before Linux 6.6, some FUSE) refuse it with EINVAL, and then buffered I/O is used. An
 * O_CREAT open that fails that way may already have created the file: remove it first. */
int dirstore_open_file(dirstore *ds, const char *name, int flags) {
    if (!ds->t->direct) return openat(ds->dir_fd, name, flags | O_CLOEXEC, 0644);
    int fd = openat(ds->dir_fd, name, flags | O_DIRECT | O_CLOEXEC, 0644);
    if (fd >= 0 || errno != EINVAL) return fd;
    if (flags & O_CREAT) unlinkat(ds->dir_fd, name, 0);
    return openat(ds->dir_fd, name, flags | O_CLOEXEC, 0644);
}

void dirstore_warn(dirstore *ds, const char *fmt, ...) {
    uint64_t now = clock_now_ns();
    if (ds->warned_once && now - ds->warn_last_ns < DIRSTORE_WARN_NS) {
        ds->warn_suppressed++;
        return;
    }
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (ds->warn_suppressed)
        log_warn("%s %s: %s (%lld similar warnings suppressed)", ds->t->tier, ds->path, msg,
                 (long long)ds->warn_suppressed);
    else
        log_warn("%s %s: %s", ds->t->tier, ds->path, msg);
    ds->warned_once = true;
    ds->warn_last_ns = now;
    ds->warn_suppressed = 0;
}

/* ---------------------------------------------------------------- index (caller holds mu) */

dirstore_entry *dirstore_find_locked(const dirstore *ds, const cache_key *k) {
    kt_node *n = keytable_find(&ds->table, k->b);
    return n ? KT_ENTRY(n, dirstore_entry, node) : NULL;
}

typedef struct each_walk {
    void (*visit)(void *ud, dirstore_entry *e);
    void *ud;
} each_walk;

static void each_visit(void *ud, kt_node *n) {
    each_walk *w = ud;
    w->visit(w->ud, KT_ENTRY(n, dirstore_entry, node));
}

void dirstore_each_locked(dirstore *ds, void (*visit)(void *ud, dirstore_entry *e), void *ud) {
    each_walk w = {visit, ud};
    keytable_each(&ds->table, each_visit, &w);
}

void dirstore_touch_locked(dirstore *ds, dirstore_entry *e) { lru_touch(&ds->lru, &e->lru); }

/* e (new, not indexed) joins the index as writing. */
static void entry_add(dirstore *ds, dirstore_entry *e) {
    e->gen = ++ds->next_gen;
    e->writing = true;
    e->files |= 1;
    e->node.key = e->key.b;
    keytable_insert(&ds->table, &e->node);
    if (ds->t->index) ds->t->index(ds->ud, e);
}

/* Writing -> published: readable, counted, most recently used. */
static void entry_publish(dirstore *ds, dirstore_entry *e) {
    e->writing = false;
    lru_touch(&ds->lru, &e->lru);
    ds->st.entries++;
    ds->st.bytes += e->bytes;
    if (e->pinned) ds->st.pinned++;
}

/* Takes e out of the index and frees it (its files are the caller's to delete). */
static void entry_drop(dirstore *ds, dirstore_entry *e) {
    if (ds->t->unindex) ds->t->unindex(ds->ud, e);
    if (!e->writing) {
        lru_unlink(&ds->lru, &e->lru);
        ds->st.entries--;
        ds->st.bytes -= e->bytes;
        if (e->pinned) ds->st.pinned--;
    }
    keytable_remove(&ds->table, &e->node);
    free(e);
}

bool dirstore_unlink_locked(dirstore *ds, const cache_key *k, uint16_t files) {
    if (!files) return true;
    if (kv_array_reserve((void **)&ds->victims, &ds->cap_victims, ds->n_victims + 1,
                         sizeof *ds->victims, 16))
        return false;
    ds->victims[ds->n_victims++] = (dirstore_victim){*k, files};
    pthread_cond_signal(&ds->work);
    return true;
}

bool dirstore_remove_locked(dirstore *ds, dirstore_entry *e, uint16_t files) {
    if (!dirstore_unlink_locked(ds, &e->key, files)) return false;
    entry_drop(ds, e);
    return true;
}

void dirstore_set_file_locked(dirstore *ds, dirstore_entry *e, int file, bool present,
                              int64_t delta) {
    if (present)
        e->files |= (uint16_t)(1u << file);
    else
        e->files &= (uint16_t) ~(1u << file);
    e->bytes += delta;
    if (!e->writing) ds->st.bytes += delta;
}

/* Pins are honoured even when pinned entries alone exceed the cap (the tier keeps them to a
 * share of it); an unpin takes effect at the next write. */
void dirstore_evict_locked(dirstore *ds) {
    for (lru_node *v = ds->lru.oldest; v && ds->st.bytes > ds->cap;) {
        lru_node *next = v->newer;
        dirstore_entry *e = KT_ENTRY(v, dirstore_entry, lru);
        if (!e->pinned) {
            if (!dirstore_remove_locked(ds, e, e->files)) break;
            ds->st.evictions++;
        }
        v = next;
    }
}

bool dirstore_queue_locked(dirstore *ds, dirstore_entry *e, void *item) {
    if (ds->n_writes >= ds->write_queue) {
        ds->st.dropped++;
        return false;
    }
    entry_add(ds, e);
    ds->wq[(ds->wq_head + ds->wq_len) % ds->write_queue] = (dirstore_write){item, e, e->bytes};
    ds->wq_len++;
    ds->n_writes++;
    ds->write_bytes += e->bytes;
    pthread_cond_signal(&ds->work);
    return true;
}

/* ---------------------------------------------------------------- victims */

/* Deletes victims[0..n)'s files (without mu). */
static void unlink_files(dirstore *ds, const dirstore_victim *victims, size_t n) {
    char name[DIRSTORE_NAME_MAX];
    for (size_t i = 0; i < n; i++)
        for (int f = 0; f < DIRSTORE_MAX_FILES; f++) {
            if (!(victims[i].files & (1u << f))) continue;
            ds->t->file_name(ds->ud, &victims[i].key, f, name);
            if (unlinkat(ds->dir_fd, name, 0) != 0 && errno != ENOENT)
                dirstore_warn(ds, "cannot delete %s: %s", name, strerror(errno));
        }
}

/* Deletes every victim's files with mu released (I/O thread). */
static void drain_victims_locked(dirstore *ds) {
    if (!ds->n_victims) return;
    while (ds->n_victims) {
        dirstore_victim *v = ds->victims;
        size_t n = ds->n_victims;
        ds->victims = NULL;
        ds->n_victims = ds->cap_victims = 0;
        pthread_mutex_unlock(&ds->mu);
        unlink_files(ds, v, n);
        free(v);
        pthread_mutex_lock(&ds->mu);
    }
    pthread_cond_broadcast(&ds->done); /* a flush waits for victims too */
}

/* ---------------------------------------------------------------- writing */

int dirstore_write_file(dirstore *ds, const cache_key *k, int file, dirstore_payload_fn fn,
                        void *arg, const char **what) {
    char hex[2 * CACHE_KEY_BYTES + 1], tmp[DIRSTORE_TMP_NAME], name[DIRSTORE_NAME_MAX];
    cache_key_hex(k, hex);
    ds->t->file_name(ds->ud, k, file, name);
    snprintf(tmp, sizeof tmp, "tmp-%s-%ld-%llu.part", hex, (long)getpid(),
             (unsigned long long)++ds->tmp_counter);
    *what = "create";
    int fd = dirstore_open_file(ds, tmp, O_WRONLY | O_CREAT | O_EXCL);
    if (fd < 0) return errno;
    *what = "write";
    int err = fn(ds->ud, fd, arg);
    if (close(fd) != 0 && !err) err = errno;
    if (!err && renameat(ds->dir_fd, tmp, ds->dir_fd, name) != 0) {
        err = errno;
        *what = "rename";
    }
    if (err) unlinkat(ds->dir_fd, tmp, 0);
    return err;
}

/* Writes a queued item's record, publishes it (or drops it: a failed write, a doomed entry) and
 * enforces the cap; any failure leaves no file and counts a write error. Drops the queue's
 * reference. */
static void write_one(dirstore *ds, dirstore_write w) {
    const dirstore_type *t = ds->t;
    dirstore_entry *e = w.e; /* only this write frees a writing entry */
    const char *what;
    int err = dirstore_write_file(ds, &e->key, 0, t->write_payload, w.item, &what);
    char name[DIRSTORE_NAME_MAX];
    t->file_name(ds->ud, &e->key, 0, name);

    pthread_mutex_lock(&ds->mu);
    if (dirstore_find_locked(ds, &e->key) != e || !e->writing) {
        log_error("%s: the index lost a record being written", t->tier);
        abort();
    }
    if (err) {
        ds->st.write_errors++;
        entry_drop(ds, e);
    } else if (e->doomed) {
        if (!dirstore_remove_locked(ds, e, e->files))
            entry_publish(ds, e); /* out of memory: keep it indexed rather than orphaned */
    } else {
        cache_key key = e->key;
        entry_publish(ds, e);
        ds->st.bytes_in += e->bytes;
        if (t->published) t->published(ds->ud, e, w.item);
        dirstore_evict_locked(ds);
        if (t->written && dirstore_find_locked(ds, &key) == e) t->written(ds->ud, e, w.item);
    }
    pthread_mutex_unlock(&ds->mu);
    if (err) dirstore_warn(ds, "cannot %s record %s: %s", what, name, strerror(err));
    t->unref(w.item);
}

/* Waiting callers' jobs first, then queued writes, then posted work; victims before each.
 * Exits once stopped and drained. */
static void *io_thread(void *arg) {
    dirstore *ds = arg;
    pthread_mutex_lock(&ds->mu);
    for (;;) {
        drain_victims_locked(ds);
        if (ds->jobs) {
            dirstore_job *j = ds->jobs;
            ds->jobs = j->next;
            if (!ds->jobs) ds->jobs_tail = NULL;
            if (j->fn) {
                pthread_mutex_unlock(&ds->mu);
                j->fn(ds->ud, j->arg);
                pthread_mutex_lock(&ds->mu);
                drain_victims_locked(ds);
            }
            j->done = true;
            pthread_cond_broadcast(&ds->done);
        } else if (ds->wq_len) {
            dirstore_write w = ds->wq[ds->wq_head];
            ds->wq_head = (ds->wq_head + 1) % ds->write_queue;
            ds->wq_len--;
            pthread_mutex_unlock(&ds->mu);
            write_one(ds, w);
            pthread_mutex_lock(&ds->mu);
            /* After the write's deletions too, so a flush sees the directory settled. */
            drain_victims_locked(ds);
            ds->n_writes--;
            ds->write_bytes -= w.bytes;
            pthread_cond_broadcast(&ds->done);
        } else if (ds->post_fn) {
            void (*fn)(void *, void *) = ds->post_fn;
            pthread_mutex_unlock(&ds->mu);
            fn(ds->ud, ds->post_arg);
            pthread_mutex_lock(&ds->mu);
            drain_victims_locked(ds);
            ds->post_fn = NULL;
            pthread_cond_broadcast(&ds->done);
        } else if (ds->stop) {
            break;
        } else {
            pthread_cond_wait(&ds->work, &ds->mu);
        }
    }
    pthread_mutex_unlock(&ds->mu);
    return NULL;
}

void dirstore_run_locked(dirstore *ds, void (*fn)(void *ud, void *arg), void *arg) {
    dirstore_job j = {.fn = fn, .arg = arg};
    if (ds->jobs_tail)
        ds->jobs_tail->next = &j;
    else
        ds->jobs = &j;
    ds->jobs_tail = &j;
    pthread_cond_signal(&ds->work);
    while (!j.done) pthread_cond_wait(&ds->done, &ds->mu);
}

void dirstore_post(dirstore *ds, void (*fn)(void *ud, void *arg), void *arg) {
    pthread_mutex_lock(&ds->mu);
    while (ds->post_fn) pthread_cond_wait(&ds->done, &ds->mu);
    ds->post_fn = fn;
    ds->post_arg = arg;
    pthread_cond_signal(&ds->work);
    pthread_mutex_unlock(&ds->mu);
}

/* ---------------------------------------------------------------- the scan at open */

typedef struct scan_item {
    dirstore_entry *e;
    struct timespec mtime;
} scan_item;

static int scan_item_cmp(const void *a, const void *b) {
    const struct timespec *x = &((const scan_item *)a)->mtime, *y = &((const scan_item *)b)->mtime;
    if (x->tv_sec != y->tv_sec) return x->tv_sec < y->tv_sec ? -1 : 1;
    return (x->tv_nsec > y->tv_nsec) - (x->tv_nsec < y->tv_nsec);
}

/* What the scan collects: records (to publish oldest first) and companion files (checked once
 * every record is indexed). */
typedef struct scan_state {
    uint8_t *hdr; /* [header_bytes] */
    scan_item *items;
    size_t n_items, cap_items;
    dirstore_victim *side; /* one file each */
    size_t n_side, cap_side;
    int64_t stale;
} scan_state;

dirstore_check dirstore_corrupt(kv_error *err, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    if (err) vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    va_end(ap);
    return DIRSTORE_CORRUPT;
}

/* Checks key k's file f (name, of size bytes) with the type's check: see dirstore_type.check. */
static dirstore_check scan_check(dirstore *ds, scan_state *s, const char *name, const cache_key *k,
                                 int file, int64_t size, dirstore_entry **e, kv_error *err) {
    int fd = openat(ds->dir_fd, name, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return DIRSTORE_SKIP;
    int64_t got = kv_pread_full(fd, s->hdr, ds->header_bytes, 0);
    int saved = errno;
    close(fd);
    if (got < 0) return dirstore_corrupt(err, "%s", strerror(saved));
    return ds->t->check(ds->ud, ds, k, file, s->hdr, (size_t)got, size, e, err);
}

/* A file that failed its checks: deleted and counted. */
static void scan_reject(dirstore *ds, const char *name, const char *why) {
    log_warn("%s %s: deleting %s: %s", ds->t->tier, ds->path, name, why);
    if (unlinkat(ds->dir_fd, name, 0) == 0) ds->st.corrupt++;
}

/* One directory entry: 0, or -1 with err when out of memory. */
static int scan_name(dirstore *ds, scan_state *s, const char *name, kv_error *err) {
    /* A temporary file is a write that never finished (a crash or kill -9; the directory has
     * one writer, this process once open): a torn record. */
    if (ends_with(name, ".part")) {
        if (unlinkat(ds->dir_fd, name, 0) == 0) ds->st.corrupt++;
        return 0;
    }
    cache_key key;
    int file;
    if (!ds->t->parse_name(name, &key, &file)) return 0; /* not ours: left alone */
    struct stat sb;
    if (fstatat(ds->dir_fd, name, &sb, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(sb.st_mode)) return 0;
    if (file != 0) {
        /* checked once their records are indexed; a file not kept: deleted */
        char want[DIRSTORE_NAME_MAX];
        if (file < ds->n_files) ds->t->file_name(ds->ud, &key, file, want);
        if (file >= ds->n_files || strcmp(want, name) != 0) {
            s->stale += unlinkat(ds->dir_fd, name, 0) == 0;
            return 0;
        }
        if (kv_array_reserve((void **)&s->side, &s->cap_side, s->n_side + 1, sizeof *s->side, 16))
            return kv_fail(err, "out of memory");
        s->side[s->n_side++] = (dirstore_victim){key, (uint16_t)(1u << file)};
        return 0;
    }
    dirstore_entry *e = NULL;
    kv_error why = {{0}};
    dirstore_check r = scan_check(ds, s, name, &key, 0, (int64_t)sb.st_size, &e, &why);
    if (r == DIRSTORE_SKIP) return 0;
    if (r == DIRSTORE_CORRUPT) {
        scan_reject(ds, name, why.msg);
        return 0;
    }
    if (!e) return kv_fail(err, "out of memory");
    if (kv_array_reserve((void **)&s->items, &s->cap_items, s->n_items + 1, sizeof *s->items, 16)) {
        free(e);
        return kv_fail(err, "out of memory");
    }
    entry_add(ds, e);
    s->items[s->n_items++] = (scan_item){e, sb.st_mtim};
    return 0;
}

/* Companion file side's check against its record's entry, now indexed. */
static void scan_side(dirstore *ds, scan_state *s, const dirstore_victim *side) {
    char name[DIRSTORE_NAME_MAX];
    int file = __builtin_ctz(side->files);
    ds->t->file_name(ds->ud, &side->key, file, name);
    dirstore_entry *e = dirstore_find_locked(ds, &side->key);
    if (!e) { /* its record was deleted before it (a crash in between) */
        s->stale += unlinkat(ds->dir_fd, name, 0) == 0;
        return;
    }
    struct stat sb;
    kv_error why = {{0}};
    if (fstatat(ds->dir_fd, name, &sb, AT_SYMLINK_NOFOLLOW) != 0) return;
    if (scan_check(ds, s, name, &side->key, file, (int64_t)sb.st_size, &e, &why) ==
        DIRSTORE_CORRUPT)
        scan_reject(ds, name, why.msg);
}

/* Indexes the directory's valid records, oldest modification first in the LRU list; deletes
 * temporary files and invalid records (counted as corrupt), then evicts down to the cap. */
static int scan(dirstore *ds, kv_error *err) {
    int fd = dup(ds->dir_fd);
    DIR *dir = fd >= 0 ? fdopendir(fd) : NULL;
    if (!dir) {
        if (fd >= 0) close(fd);
        return kv_fail(err, "cannot list %s: %s", ds->path, strerror(errno));
    }
    scan_state s = {.hdr = malloc(ds->header_bytes ? ds->header_bytes : 1)};
    int rc = s.hdr ? 0 : kv_fail(err, "out of memory");
    struct dirent *de;
    while (rc == 0 && (de = readdir(dir))) rc = scan_name(ds, &s, de->d_name, err);
    /* On failure the entries already indexed are freed with the table by dirstore_close. */
    if (rc == 0) {
        if (s.n_items) qsort(s.items, s.n_items, sizeof *s.items, scan_item_cmp);
        for (size_t i = 0; i < s.n_items; i++) entry_publish(ds, s.items[i].e);
        for (size_t i = 0; i < s.n_side; i++) scan_side(ds, &s, &s.side[i]);
        if (s.stale)
            log_info("%s %s: %lld encoded files of no record or encoding kept deleted", ds->t->tier,
                     ds->path, (long long)s.stale);
        dirstore_evict_locked(ds);
        unlink_files(ds, ds->victims, ds->n_victims);
        ds->n_victims = 0;
    }
    closedir(dir);
    free(s.items);
    free(s.side);
    free(s.hdr);
    return rc;
}

/* ---------------------------------------------------------------- open and close */

dirstore *dirstore_open(const dirstore_type *t, const dirstore_params *p, kv_error *err) {
    if (!p->path || !*p->path || p->cap < 0 || p->write_queue < 0 ||
        p->write_queue > DIRSTORE_MAX_WRITE_QUEUE || p->n_files < 1 ||
        p->n_files > DIRSTORE_MAX_FILES) {
        kv_fail(err, "%s: bad arguments", t->tier);
        return NULL;
    }
    dirstore *ds = calloc(1, sizeof *ds);
    if (!ds) {
        kv_fail(err, "%s: out of memory", t->tier);
        return NULL;
    }
    ds->t = t;
    ds->ud = p->ud;
    ds->dir_fd = -1;
    ds->n_files = p->n_files;
    ds->header_bytes = p->header_bytes;
    ds->cap = p->cap;
    ds->write_queue = p->write_queue;
    pthread_mutex_init(&ds->mu, NULL);
    pthread_cond_init(&ds->work, NULL);
    pthread_cond_init(&ds->done, NULL);
    ds->path = strdup(p->path);
    ds->wq = calloc(p->write_queue > 0 ? (size_t)p->write_queue : 1, sizeof *ds->wq);
    if (!ds->path || !ds->wq || keytable_init(&ds->table, CACHE_KEY_BYTES) != 0) {
        kv_fail(err, "%s: out of memory", t->tier);
        goto fail;
    }
    if (kv_mkdir_p(ds->path, err) != 0) goto fail;
    ds->dir_fd = open(ds->path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (ds->dir_fd < 0 || faccessat(ds->dir_fd, ".", W_OK | X_OK, AT_EACCESS) != 0) {
        kv_fail(err, "cannot use %s: %s", ds->path, strerror(errno));
        goto fail;
    }
    if (scan(ds, err) != 0) {
        kv_fail_wrap(err, "%s %s", t->tier, ds->path);
        goto fail;
    }
    if (pthread_create(&ds->thread, NULL, io_thread, ds) != 0) {
        kv_fail(err, "%s: cannot start the I/O thread", t->tier);
        goto fail;
    }
    ds->thread_started = true;
    log_info("%s %s: %lld records, %lld bytes (cap %lld); %lld invalid files deleted", t->tier,
             ds->path, (long long)ds->st.entries, (long long)ds->st.bytes, (long long)ds->cap,
             (long long)ds->st.corrupt);
    return ds;
fail:
    dirstore_close(ds);
    return NULL;
}

static void free_entry(void *ud, kt_node *n) {
    (void)ud;
    free(KT_ENTRY(n, dirstore_entry, node));
}

void dirstore_close(dirstore *ds) {
    if (!ds) return;
    if (ds->thread_started) {
        /* The I/O thread drains the jobs, writes and posted work still queued before it stops. */
        pthread_mutex_lock(&ds->mu);
        ds->stop = true;
        pthread_cond_signal(&ds->work);
        pthread_mutex_unlock(&ds->mu);
        pthread_join(ds->thread, NULL);
    }
    for (int i = 0; i < ds->wq_len; i++)
        ds->t->unref(ds->wq[(ds->wq_head + i) % ds->write_queue].item);
    if (ds->table.buckets) keytable_each(&ds->table, free_entry, NULL);
    keytable_free(&ds->table);
    if (ds->dir_fd >= 0) close(ds->dir_fd);
    pthread_cond_destroy(&ds->done);
    pthread_cond_destroy(&ds->work);
    pthread_mutex_destroy(&ds->mu);
    free(ds->wq);
    free(ds->victims);
    free(ds->path);
    free(ds);
}

/* ---------------------------------------------------------------- the public calls' cores */

typedef struct clear_walk {
    dirstore *ds;
    const cache_key *ns;
    int64_t n;
} clear_walk;

static void clear_visit(void *ud, kt_node *node) {
    clear_walk *w = ud;
    dirstore_entry *e = KT_ENTRY(node, dirstore_entry, node);
    if (w->ns && memcmp(e->ns.b, w->ns->b, CACHE_KEY_BYTES) != 0) return;
    if (e->writing)
        e->doomed = true; /* not counted: its write deletes it when it completes */
    else if (dirstore_remove_locked(w->ds, e, e->files))
        w->n++;
    else
        log_error("%s %s: out of memory clearing the cache", w->ds->t->tier, w->ds->path);
}

int64_t dirstore_clear(dirstore *ds, const cache_key *ns) {
    pthread_mutex_lock(&ds->mu);
    clear_walk w = {.ds = ds, .ns = ns};
    keytable_each(&ds->table, clear_visit, &w);
    /* The I/O thread deletes the files (it owns every file operation); until then the keys are
     * out of the index, so nothing reads them, and a new write of one queues behind this. */
    if (ds->n_victims) dirstore_run_locked(ds, NULL, NULL);
    pthread_mutex_unlock(&ds->mu);
    return w.n;
}

void dirstore_stats(dirstore *ds, cache_tier_stats *out) {
    pthread_mutex_lock(&ds->mu);
    *out = ds->st;
    out->capacity = ds->cap;
    pthread_mutex_unlock(&ds->mu);
}

void dirstore_flush(dirstore *ds) {
    pthread_mutex_lock(&ds->mu);
    while (ds->n_writes > 0 || ds->post_fn || ds->n_victims) pthread_cond_wait(&ds->done, &ds->mu);
    pthread_mutex_unlock(&ds->mu);
}
