/* The disk tiers' core (cache/store/dirstore.h), through both tiers that stand on it: the chunk
 * tier (cache/store/disk.h) and blend's content tier (cache/store/content_disk.h). Each test runs
 * once per tier, through a small driver table, and checks what the core promises whatever the type:
 * records survive a reopen (the index rebuilt from the headers of files written by an earlier open:
 * the names and formats are the tiers' own and unchanged), leftover temporaries and damaged records
 * are deleted at open and counted while foreign names are left alone, the cap evicts the least
 * recently used, a clear's files are gone when it returns, and a flushed directory holds no
 * temporary file. */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cache/store/content_disk.h"
#include "tests/unit/disk_fixture.h"

/* ---------------------------------------------------------------- the two tiers */

enum { CD_LAYERS = 2, CD_DIM = 16, CD_TOKENS = 20, N_REC = 4 };

static uint8_t CD_MODEL[32] = {7};

/* One tier as the tests see it: records 0..N_REC-1, each in namespace i % 2. */
typedef struct tier_driver {
    const char *name;
    int64_t one; /* what one record counts towards the cap */
    void *(*open)(const char *dir, int64_t cap);
    void (*close)(void *t);
    void (*put)(void *t, int i);
    bool (*read)(void *t, int i); /* read back whole and equal */
    int64_t (*clear)(void *t, int ns);
    void (*flush)(void *t);
    cache_tier_stats (*stats)(void *t);
    /* The directory the tier's files are in, and record i's file. */
    void (*dir_of)(const char *dir, char *out, size_t n);
    void (*path_of)(const char *dir, int i, char *out, size_t n);
} tier_driver;

static cache_key ns_of(int i) { return make_ns(i % 2 ? "odd" : "even"); }

/* The chunk tier. */

static void *chunk_open(const char *dir, int64_t cap) {
    cache_layout l = small_layout();
    return open_disk(dir, &l, cap, 16);
}
static void chunk_close(void *t) { cache_disk_close(t); }
static cache_chunk *chunk_rec(int i) {
    cache_layout l = small_layout();
    cache_key ns = ns_of(i);
    return make_chunk(&l, &ns, i);
}
static void chunk_put(void *t, int i) {
    cache_chunk *c = chunk_rec(i);
    put_ok(t, c);
    cache_chunk_unref(c);
}
static bool chunk_read(void *t, int i) {
    cache_chunk *want = chunk_rec(i), *got = read_one(t, &want->key);
    bool same = got && got->bytes == want->bytes && memcmp(got->data, want->data, got->bytes) == 0;
    cache_chunk_unref(want);
    if (got) cache_chunk_unref(got);
    return same;
}
static int64_t chunk_clear(void *t, int ns) {
    cache_key k = ns_of(ns);
    return cache_disk_clear(t, ns < 0 ? NULL : &k);
}
static void chunk_flush(void *t) { cache_disk_flush(t); }
static cache_tier_stats chunk_stats(void *t) { return stats(t); }
static void chunk_dir(const char *dir, char *out, size_t n) {
    cache_layout l = small_layout();
    model_path(dir, &l, NULL, out, n);
}
static void chunk_path(const char *dir, int i, char *out, size_t n) {
    cache_layout l = small_layout();
    cache_chunk *c = chunk_rec(i);
    record_path(dir, &l, &c->key, out, n);
    cache_chunk_unref(c);
}

/* The content tier. */

static void *content_open(const char *dir, int64_t cap) {
    kv_error err = {{0}};
    content_disk *d = content_disk_open(dir, CD_MODEL, CD_LAYERS, CD_DIM, cap, &err);
    cr_assert_not_null(d, "%s", err.msg);
    return d;
}
static void content_close(void *t) { content_disk_close(t); }
static content_rec *content_make(int i) {
    cache_key key = {{0}}, ns = ns_of(i);
    key.b[0] = (uint8_t)(i + 1);
    content_rec *r = content_rec_create(CD_LAYERS, CD_DIM, CD_TOKENS, &key, &ns, 3 * i);
    cr_assert_not_null(r);
    for (size_t k = 0; k < r->bytes / sizeof(uint16_t); k++) r->data[k] = (uint16_t)(i * 31 + k);
    return r;
}
static void content_put(void *t, int i) {
    content_rec *r = content_make(i);
    content_disk_put(t, r);
    content_rec_unref(r);
}
static bool content_read(void *t, int i) {
    content_rec *want = content_make(i), *got = content_disk_get(t, &want->key, CD_TOKENS);
    bool same = got != NULL;
    for (int l = 0; same && l < CD_LAYERS; l++) same = content_rec_read_layer(got, l) == 0;
    same = same && memcmp(got->data, want->data, want->bytes) == 0 && got->pos0 == want->pos0;
    content_rec_unref(want);
    content_rec_unref(got);
    return same;
}
static int64_t content_clear(void *t, int ns) {
    cache_key k = ns_of(ns);
    return content_disk_clear(t, ns < 0 ? NULL : &k);
}
static void content_flush(void *t) { content_disk_flush(t); }
static cache_tier_stats content_stats(void *t) {
    cache_tier_stats st;
    content_disk_stats(t, &st);
    return st;
}
static void content_dir(const char *dir, char *out, size_t n) { snprintf(out, n, "%s", dir); }
static void content_path(const char *dir, int i, char *out, size_t n) {
    content_rec *r = content_make(i);
    char hex[2 * CACHE_KEY_BYTES + 1];
    cache_key_hex(&r->key, hex);
    snprintf(out, n, "%s/%s.kvb", dir, hex);
    content_rec_unref(r);
}

static tier_driver TIERS[] = {
    {"chunk", PAYLOAD, chunk_open, chunk_close, chunk_put, chunk_read, chunk_clear, chunk_flush,
     chunk_stats, chunk_dir, chunk_path},
    {"content", 168 + 32 * CD_LAYERS + CD_LAYERS * 2 * 2 * CD_TOKENS *CD_DIM, content_open,
     content_close, content_put, content_read, content_clear, content_flush, content_stats,
     content_dir, content_path},
};

/* ---------------------------------------------------------------- helpers */

/* Files in the tier's directory whose names end with suffix. */
static int files_ending(const tier_driver *t, const char *dir, const char *suffix) {
    char path[512];
    t->dir_of(dir, path, sizeof path);
    return count_files_in(path, suffix);
}

static void *fill(const tier_driver *t, const char *dir, int64_t cap, int n) {
    void *s = t->open(dir, cap);
    for (int i = 0; i < n; i++) t->put(s, i);
    t->flush(s);
    return s;
}

/* Criterion runs each test in a new process (the binary again, possibly at another address):
 * a parameter is the index of a tier, not a pointer into this one. */
static int TIER_INDEX[] = {0, 1};

#define TIER_PARAMS(test)                                                                          \
    ParameterizedTestParameters(dirstore, test) {                                                  \
        return cr_make_param_array(int, TIER_INDEX, sizeof TIER_INDEX / sizeof TIER_INDEX[0]);     \
    }

/* ---------------------------------------------------------------- the tests */

TIER_PARAMS(records_survive_a_reopen)
ParameterizedTest(int *tier, dirstore, records_survive_a_reopen) {
    const tier_driver *t = &TIERS[*tier];
    char *dir = make_tmpdir();
    void *s = fill(t, dir, 1 << 20, N_REC);
    cr_assert_eq(files_ending(t, dir, ".part"), 0, "%s: a flushed directory has no temporary",
                 t->name);
    t->close(s);
    s = t->open(dir, 1 << 20);
    cache_tier_stats st = t->stats(s);
    cr_assert_eq(st.entries, N_REC, "%s", t->name);
    cr_assert_eq(st.corrupt, 0, "%s", t->name);
    for (int i = 0; i < N_REC; i++) cr_assert(t->read(s, i), "%s: record %d", t->name, i);
    t->close(s);
    remove_tree(dir);
}

TIER_PARAMS(temporaries_and_damaged_records_go_at_open_foreign_names_stay)
ParameterizedTest(int *tier, dirstore,
                  temporaries_and_damaged_records_go_at_open_foreign_names_stay) {
    const tier_driver *t = &TIERS[*tier];
    char *dir = make_tmpdir();
    t->close(fill(t, dir, 1 << 20, N_REC));
    char d[512], path[600], part_new[600], part_old[600], other[600];
    t->dir_of(dir, d, sizeof d);
    /* record 1 torn; temporaries named as now and as the content tier named them before */
    t->path_of(dir, 1, path, sizeof path);
    cr_assert_eq(truncate(path, 100), 0);
    snprintf(part_new, sizeof part_new, "%s/tmp-0a0b-123-4.part", d);
    snprintf(part_old, sizeof part_old, "%s/%064d.kvb.part", d, 0);
    snprintf(other, sizeof other, "%s/README", d);
    write_file(part_new, "x", 1);
    write_file(part_old, "x", 1);
    write_file(other, "x", 1);
    void *s = t->open(dir, 1 << 20);
    cache_tier_stats st = t->stats(s);
    cr_assert_eq(st.entries, N_REC - 1, "%s", t->name);
    cr_assert_eq(st.corrupt, 3, "%s", t->name);
    cr_assert_not(file_exists(path), "%s", t->name);
    cr_assert_not(file_exists(part_new), "%s", t->name);
    cr_assert_not(file_exists(part_old), "%s", t->name);
    cr_assert(file_exists(other), "%s: not ours: left alone", t->name);
    cr_assert_not(t->read(s, 1), "%s", t->name);
    cr_assert(t->read(s, 2), "%s", t->name);
    t->close(s);
    remove_tree(dir);
}

TIER_PARAMS(the_cap_evicts_the_least_recently_used)
ParameterizedTest(int *tier, dirstore, the_cap_evicts_the_least_recently_used) {
    const tier_driver *t = &TIERS[*tier];
    char *dir = make_tmpdir();
    void *s = fill(t, dir, 3 * t->one, 3);
    cr_assert(t->read(s, 0), "%s", t->name); /* record 1 is now the least recently used */
    t->put(s, 3);
    t->flush(s);
    cache_tier_stats st = t->stats(s);
    cr_assert_eq(st.entries, 3, "%s", t->name);
    cr_assert_eq(st.evictions, 1, "%s", t->name);
    cr_assert_eq(st.bytes, 3 * t->one, "%s", t->name);
    char path[600];
    t->path_of(dir, 1, path, sizeof path);
    cr_assert_not(file_exists(path), "%s: the evicted record's file is deleted", t->name);
    cr_assert_not(t->read(s, 1), "%s", t->name);
    for (int i = 0; i < 4; i += 2) cr_assert(t->read(s, i), "%s: record %d", t->name, i);
    cr_assert(t->read(s, 3), "%s", t->name);
    t->close(s);
    remove_tree(dir);
}

TIER_PARAMS(a_clears_files_are_gone_when_it_returns)
ParameterizedTest(int *tier, dirstore, a_clears_files_are_gone_when_it_returns) {
    const tier_driver *t = &TIERS[*tier];
    char *dir = make_tmpdir();
    void *s = fill(t, dir, 1 << 20, N_REC);
    cr_assert_eq(t->clear(s, 1), N_REC / 2, "%s", t->name);
    char path[600];
    for (int i = 0; i < N_REC; i++) {
        t->path_of(dir, i, path, sizeof path);
        cr_assert_eq(file_exists(path), i % 2 == 0, "%s: record %d", t->name, i);
    }
    cr_assert_eq(t->clear(s, -1), N_REC / 2, "%s", t->name);
    cache_tier_stats st = t->stats(s);
    cr_assert_eq(st.entries, 0, "%s", t->name);
    cr_assert_eq(st.bytes, 0, "%s", t->name);
    for (int i = 0; i < N_REC; i++) {
        t->path_of(dir, i, path, sizeof path);
        cr_assert_not(file_exists(path), "%s: record %d", t->name, i);
    }
    t->close(s);
    remove_tree(dir);
}
