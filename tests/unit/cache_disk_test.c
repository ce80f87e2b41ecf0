/* The disk tier (cache/store/disk.h): write and read back, restart, corrupt / torn / vanished /
 * foreign files, stray temporary files, LRU eviction under a cap with pins (also the order
 * rebuilt from mtimes at open), clear by namespace (also of writes in flight), a full write
 * queue, a full disk (a 64 KiB tmpfs, when mounting is allowed), the pread/pwrite fallback
 * (io_uring_setup blocked by seccomp) and concurrent puts, reads and clears. The record format
 * is record_test's, the encodings cache_disk_enc_test's. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <liburing.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <pthread.h>
#include <sched.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "cache/store/disk.h"
#include "cache/store/record.h"
#include "tests/unit/chunk_fixture.h"
#include "tests/unit/disk_fixture.h"

Test(disk, put_flush_read_returns_identical_bytes) {
    char *dir = make_tmpdir();
    cache_layout l = small_layout();
    cache_key ns = make_ns("a");
    cache_disk *d = open_disk(dir, &l, 1 << 20, 16);
    cache_chunk *c[3];
    for (int i = 0; i < 3; i++) {
        c[i] = make_chunk(&l, &ns, i);
        put_ok(d, c[i]);
    }
    cr_assert_not(cache_disk_put(d, c[0]), "a key being written or written is refused");
    cache_disk_flush(d);
    cr_assert_not(cache_disk_put(d, c[1]), "a key on disk is refused");
    for (int i = 0; i < 3; i++) cr_assert_eq(atomic_load(&c[i]->refs), 1, "queue ref dropped");
    cache_tier_stats st = stats(d);
    cr_assert_eq(st.entries, 3);
    cr_assert_eq(st.bytes, 3 * PAYLOAD);
    cr_assert_eq(st.bytes_in, 3 * PAYLOAD);
    cr_assert_eq(st.capacity, 1 << 20);
    cr_assert_eq(st.write_errors + st.dropped + st.corrupt, 0);
    cr_assert_eq(count_files(dir, &l, ".kvc"), 3);
    cr_assert_eq(count_files(dir, &l, ".part"), 0);
    char path[512];
    record_path(dir, &l, &c[1]->key, path, sizeof path);
    struct stat sb;
    cr_assert_eq(stat(path, &sb), 0, "%s missing", path);
    cr_assert_eq(sb.st_size, FILE_BYTES);

    cache_chunk *absent = make_chunk(&l, &ns, 99);
    cache_key keys[4] = {c[2]->key, absent->key, c[0]->key, c[1]->key};
    cache_chunk *out[4];
    for (int i = 0; i < 3; i++) cr_assert(cache_disk_contains(d, &c[i]->key));
    cr_assert_not(cache_disk_contains(d, &absent->key));
    cache_disk_read(d, keys, 4, out);
    chunk_assert_same(out[0], c[2]);
    cr_assert_null(out[1]);
    chunk_assert_same(out[2], c[0]);
    chunk_assert_same(out[3], c[1]);
    st = stats(d);
    cr_assert_eq(st.hits, 3);
    cr_assert_eq(st.misses, 1);
    cr_assert_eq(st.bytes_out, 3 * PAYLOAD);
    for (int i = 0; i < 4; i++) cache_chunk_unref(out[i]);
    /* All misses: answered without I/O, still counted. */
    cr_assert_null(read_one(d, &absent->key));
    cr_assert_eq(stats(d).misses, 2);
    for (int i = 0; i < 3; i++) cache_chunk_unref(c[i]);
    cache_chunk_unref(absent);
    cache_disk_close(d);
    remove_tree(dir);
}

Test(disk, partial_records_are_found_by_block_and_superseded) {
    char *dir = make_tmpdir();
    cache_layout l = small_layout();
    cache_key ns = make_ns("a");
    cache_disk *d = open_disk(dir, &l, 1 << 20, 16);
    /* a sequence's trailing partial chunk: one block of two, pinned */
    cache_chunk *part = make_part(&l, &ns, 5, 1);
    cr_assert_eq(part->bytes, PAYLOAD / 2);
    put_ok(d, part);
    cache_disk_flush(d);
    cr_assert_eq(cache_disk_pin(d, CACHE_TENANT_NONE, &part->key, 1, true, 0), 1);
    char path[512];
    record_path(dir, &l, &part->key, path, sizeof path);
    struct stat sb;
    cr_assert_eq(stat(path, &sb), 0);
    cr_assert_eq(sb.st_size, HEADER + 4096, "the payload padded to a page");
    cache_key rec;
    int block = -1;
    cr_assert(cache_disk_find(d, &part->bkeys[0], &rec, &block));
    cr_assert_eq(memcmp(rec.b, part->key.b, 32), 0);
    cr_assert_eq(block, 0);
    cache_chunk *got = read_one(d, &part->key);
    chunk_assert_same(got, part);
    cache_chunk_unref(got);

    /* the whole chunk replaces it once written, and inherits its pin */
    cache_chunk *whole = make_chunk(&l, &ns, 5);
    cr_assert_eq(memcmp(whole->bkeys[0].b, part->key.b, 32), 0);
    put_ok(d, whole);
    cache_disk_flush(d);
    cr_assert_not(file_exists(path), "the partial record is deleted");
    cr_assert_eq(count_files(dir, &l, ".kvc"), 1);
    cache_tier_stats st = stats(d);
    cr_assert_eq(st.entries, 1);
    cr_assert_eq(st.bytes, PAYLOAD);
    cr_assert_eq(st.pinned, 1);
    /* a prompt diverging after the first block finds the whole record by that block */
    cr_assert(cache_disk_find(d, &whole->bkeys[0], &rec, &block));
    cr_assert_eq(memcmp(rec.b, whole->key.b, 32), 0);
    cr_assert_eq(block, 0);
    cr_assert(cache_disk_find(d, &whole->bkeys[1], &rec, &block));
    cr_assert_eq(block, 1);
    /* a shorter record of a chunk held whole is not written again */
    cr_assert_not(cache_disk_put(d, part));
    cache_disk_close(d);

    /* the index of blocks is rebuilt at open */
    d = open_disk(dir, &l, 1 << 20, 16);
    cr_assert(cache_disk_find(d, &whole->bkeys[0], &rec, &block));
    cr_assert_eq(block, 0);
    got = read_one(d, &whole->key);
    chunk_assert_same(got, whole);
    cache_chunk_unref(got);
    cache_chunk_unref(part);
    cache_chunk_unref(whole);
    cache_disk_close(d);
    remove_tree(dir);
}

Test(disk, reopen_rebuilds_the_index) {
    char *dir = make_tmpdir();
    cache_layout l = small_layout();
    cache_key ns = make_ns("a");
    cache_disk *d = open_disk(dir, &l, 1 << 20, 16);
    cache_chunk *c[5];
    for (int i = 0; i < 5; i++) {
        c[i] = make_chunk(&l, &ns, i);
        put_ok(d, c[i]);
    }
    cache_disk_close(d); /* finishes the queued writes */
    d = open_disk(dir, &l, 1 << 20, 16);
    cache_tier_stats st = stats(d);
    cr_assert_eq(st.entries, 5);
    cr_assert_eq(st.bytes, 5 * PAYLOAD);
    cr_assert_eq(st.corrupt, 0);
    cr_assert_eq(st.evictions, 0);
    for (int i = 0; i < 5; i++) {
        cr_assert(cache_disk_contains(d, &c[i]->key));
        cache_chunk *got = read_one(d, &c[i]->key);
        chunk_assert_same(got, c[i]);
        cache_chunk_unref(got);
        cr_assert_not(cache_disk_put(d, c[i]), "an indexed key is refused after restart");
    }
    cache_disk_close(d);
    for (int i = 0; i < 5; i++) cache_chunk_unref(c[i]);
    remove_tree(dir);
}

Test(disk, corrupt_record_is_deleted_and_counted) {
    char *dir = make_tmpdir();
    cache_layout l = small_layout();
    cache_key ns = make_ns("a");
    cache_disk *d = open_disk(dir, &l, 1 << 20, 16);
    cache_chunk *a = make_chunk(&l, &ns, 1), *b = make_chunk(&l, &ns, 2);
    put_ok(d, a);
    put_ok(d, b);
    cache_disk_flush(d);
    char pa[512], pb[512];
    record_path(dir, &l, &a->key, pa, sizeof pa);
    record_path(dir, &l, &b->key, pb, sizeof pb);
    flip_byte(pa, HEADER + 100); /* payload */
    flip_byte(pb, 132);          /* header: pos0 */

    cr_assert_null(read_one(d, &a->key), "a flipped payload byte must not be served");
    cache_tier_stats st = stats(d);
    cr_assert_eq(st.corrupt, 1);
    cr_assert_eq(st.misses, 1);
    cr_assert_eq(st.entries, 1);
    cr_assert_eq(st.bytes, PAYLOAD);
    cr_assert_not(file_exists(pa), "corrupt file left behind");
    cr_assert_not(cache_disk_contains(d, &a->key));
    cr_assert_null(read_one(d, &a->key));
    st = stats(d);
    cr_assert_eq(st.corrupt, 1, "the second read is a plain miss");
    cr_assert_eq(st.misses, 2);

    cr_assert_null(read_one(d, &b->key), "a flipped header byte must not be served");
    cr_assert_eq(stats(d).corrupt, 2);
    cr_assert_not(file_exists(pb));
    cr_assert_eq(stats(d).entries, 0);
    /* The key can be written again. */
    put_ok(d, a);
    cache_disk_flush(d);
    cache_chunk *got = read_one(d, &a->key);
    chunk_assert_same(got, a);
    cache_chunk_unref(got);
    cache_disk_close(d);
    cache_chunk_unref(a);
    cache_chunk_unref(b);
    remove_tree(dir);
}

Test(disk, vanished_file_is_a_miss_not_corrupt) {
    char *dir = make_tmpdir();
    cache_layout l = small_layout();
    cache_key ns = make_ns("a");
    cache_disk *d = open_disk(dir, &l, 1 << 20, 16);
    cache_chunk *a = make_chunk(&l, &ns, 1);
    put_ok(d, a);
    cache_disk_flush(d);
    char pa[512];
    record_path(dir, &l, &a->key, pa, sizeof pa);
    cr_assert_eq(unlink(pa), 0);
    cr_assert_null(read_one(d, &a->key));
    cache_tier_stats st = stats(d);
    cr_assert_eq(st.corrupt, 0);
    cr_assert_eq(st.misses, 1);
    cr_assert_eq(st.entries, 0);
    cr_assert_eq(st.bytes, 0);
    cr_assert_not(cache_disk_contains(d, &a->key));
    cache_disk_close(d);
    cache_chunk_unref(a);
    remove_tree(dir);
}

Test(disk, torn_and_stray_files_are_removed_at_open) {
    char *dir = make_tmpdir();
    cache_layout l = small_layout();
    cache_key ns = make_ns("a");
    cache_disk *d = open_disk(dir, &l, 1 << 20, 16);
    cache_chunk *c[4];
    for (int i = 0; i < 4; i++) c[i] = make_chunk(&l, &ns, i);
    for (int i = 0; i < 3; i++) put_ok(d, c[i]);
    cache_disk_close(d);

    char p[512];
    record_path(dir, &l, &c[0]->key, p, sizeof p);
    cr_assert_eq(truncate(p, 5000), 0); /* torn payload */
    record_path(dir, &l, &c[1]->key, p, sizeof p);
    cr_assert_eq(truncate(p, 100), 0); /* torn header */
    /* c[2]'s record under c[3]'s name: a header naming another key. */
    char p2[512], p3[512];
    record_path(dir, &l, &c[2]->key, p2, sizeof p2);
    record_path(dir, &l, &c[3]->key, p3, sizeof p3);
    cr_assert_eq(link(p2, p3), 0);
    model_path(dir, &l, "tmp-0123-1-1.part", p, sizeof p);
    write_file(p, "partial", 7);
    model_path(dir, &l, "whatever.part", p, sizeof p);
    write_file(p, "partial", 7);
    char keep[512];
    model_path(dir, &l, "notes.txt", keep, sizeof keep);
    write_file(keep, "not ours", 8);

    d = open_disk(dir, &l, 1 << 20, 16);
    cache_tier_stats st = stats(d);
    cr_assert_eq(st.corrupt, 5, "2 torn, 1 misnamed, 2 temporary; got %lld", (long long)st.corrupt);
    cr_assert_eq(st.entries, 1);
    cr_assert_eq(count_files(dir, &l, ".part"), 0);
    cr_assert_eq(count_files(dir, &l, ".kvc"), 1);
    cr_assert(file_exists(keep), "files that are not records are left alone");
    cr_assert_not(cache_disk_contains(d, &c[0]->key));
    cr_assert_not(cache_disk_contains(d, &c[3]->key));
    cache_chunk *got = read_one(d, &c[2]->key);
    chunk_assert_same(got, c[2]);
    cache_chunk_unref(got);
    cache_disk_close(d);

    /* The same directory under another layout of the same model: its records are foreign. */
    cache_layout other = l;
    other.chunk_tokens = 64;
    d = open_disk(dir, &other, 1 << 20, 16);
    cr_assert_eq(stats(d).corrupt, 1);
    cr_assert_eq(stats(d).entries, 0);
    cache_disk_close(d);
    for (int i = 0; i < 4; i++) cache_chunk_unref(c[i]);
    remove_tree(dir);
}

Test(disk, cap_evicts_least_recently_used_and_keeps_pins) {
    char *dir = make_tmpdir();
    cache_layout l = small_layout();
    cache_key ns = make_ns("a");
    cache_disk *d = open_disk(dir, &l, 3 * PAYLOAD, 16);
    cache_chunk *c[6];
    for (int i = 0; i < 6; i++) c[i] = make_chunk(&l, &ns, i);
    /* Flushing between puts fixes the write order: A, B, C. */
    for (int i = 0; i < 3; i++) {
        put_ok(d, c[i]);
        cache_disk_flush(d);
    }
    cache_chunk *got = read_one(d, &c[0]->key); /* LRU now B, C, A */
    cache_chunk_unref(got);
    put_ok(d, c[3]);
    cache_disk_flush(d);
    cache_tier_stats st = stats(d);
    cr_assert_eq(st.evictions, 1);
    cr_assert_leq(st.bytes, 3 * PAYLOAD);
    cr_assert_not(cache_disk_contains(d, &c[1]->key), "B was least recently used");
    char p[512];
    record_path(dir, &l, &c[1]->key, p, sizeof p);
    cr_assert_not(file_exists(p), "evicted file left behind");
    for (int i = 0; i < 4; i++)
        if (i != 1) cr_assert(cache_disk_contains(d, &c[i]->key), "chunk %d evicted", i);

    /* LRU C, A, D; pin C: E evicts A, F evicts D. */
    cr_assert_eq(cache_disk_pin(d, CACHE_TENANT_NONE, &c[2]->key, 1, true, 0), 1);
    cr_assert_eq(cache_disk_pin(d, CACHE_TENANT_NONE, &c[1]->key, 1, true, 0), 0,
                 "an evicted key is not held");
    cr_assert_eq(stats(d).pinned, 1);
    put_ok(d, c[4]);
    cache_disk_flush(d);
    cr_assert_not(cache_disk_contains(d, &c[0]->key));
    put_ok(d, c[5]);
    cache_disk_flush(d);
    cr_assert_not(cache_disk_contains(d, &c[3]->key));
    st = stats(d);
    cr_assert_eq(st.evictions, 3);
    cr_assert_eq(st.entries, 3);
    cr_assert_leq(st.bytes, 3 * PAYLOAD);
    cr_assert_eq(count_files(dir, &l, ".kvc"), 3);
    got = read_one(d, &c[2]->key);
    chunk_assert_same(got, c[2]);
    cache_chunk_unref(got);

    /* Pins may fill half the tier: with C pinned, E and F cannot be, and unpinned traffic
     * keeps its room. */
    cache_key pin_keys[2] = {c[4]->key, c[5]->key};
    cr_assert_eq(cache_disk_pin(d, CACHE_TENANT_NONE, pin_keys, 2, true, 0), 0);
    cr_assert_eq(stats(d).pinned, 1);
    put_ok(d, c[0]);
    cache_disk_flush(d);
    cr_assert(cache_disk_contains(d, &c[0]->key));
    cr_assert(cache_disk_contains(d, &c[2]->key), "pinned C evicted");
    cr_assert_not(cache_disk_contains(d, &c[4]->key), "E was least recently used");
    cr_assert_eq(stats(d).evictions, 4);
    cache_disk_close(d);
    for (int i = 0; i < 6; i++) cache_chunk_unref(c[i]);
    remove_tree(dir);
}

Test(disk, lru_order_at_open_follows_mtime) {
    char *dir = make_tmpdir();
    cache_layout l = small_layout();
    cache_key ns = make_ns("a");
    cache_disk *d = open_disk(dir, &l, 1 << 20, 16);
    cache_chunk *c[3];
    for (int i = 0; i < 3; i++) {
        c[i] = make_chunk(&l, &ns, i);
        put_ok(d, c[i]);
    }
    cache_disk_close(d);
    /* Ages: c[1] oldest, then c[2], then c[0]. */
    const time_t age[3] = {1000, 3000, 2000};
    for (int i = 0; i < 3; i++) {
        char p[512];
        record_path(dir, &l, &c[i]->key, p, sizeof p);
        struct timespec ts[2] = {{.tv_sec = 1700000000 - age[i]}, {.tv_sec = 1700000000 - age[i]}};
        cr_assert_eq(utimensat(AT_FDCWD, p, ts, 0), 0);
    }
    d = open_disk(dir, &l, 2 * PAYLOAD, 16);
    cr_assert_eq(stats(d).evictions, 1);
    cr_assert_not(cache_disk_contains(d, &c[1]->key), "the oldest mtime goes first");
    cache_disk_close(d);
    d = open_disk(dir, &l, PAYLOAD, 16);
    cr_assert_not(cache_disk_contains(d, &c[2]->key));
    cr_assert(cache_disk_contains(d, &c[0]->key));
    cr_assert_eq(count_files(dir, &l, ".kvc"), 1);
    cache_disk_close(d);
    for (int i = 0; i < 3; i++) cache_chunk_unref(c[i]);
    remove_tree(dir);
}

Test(disk, clear_by_namespace) {
    char *dir = make_tmpdir();
    cache_layout l = small_layout();
    cache_key ns1 = make_ns("one"), ns2 = make_ns("two");
    cache_disk *d = open_disk(dir, &l, 1 << 20, 16);
    cache_chunk *c[4] = {make_chunk(&l, &ns1, 0), make_chunk(&l, &ns1, 1), make_chunk(&l, &ns2, 0),
                         make_chunk(&l, &ns2, 1)};
    for (int i = 0; i < 4; i++) put_ok(d, c[i]);
    cache_disk_flush(d);
    cr_assert_eq(cache_disk_pin(d, CACHE_TENANT_NONE, &c[0]->key, 1, true, 0), 1);
    cr_assert_eq(cache_disk_clear(d, &ns1), 2, "pinned or not, ns1's two records");
    cache_tier_stats st = stats(d);
    cr_assert_eq(st.entries, 2);
    cr_assert_eq(st.bytes, 2 * PAYLOAD);
    cr_assert_eq(st.pinned, 0);
    for (int i = 0; i < 2; i++) {
        char p[512];
        record_path(dir, &l, &c[i]->key, p, sizeof p);
        cr_assert_not(file_exists(p), "cleared file left behind");
        cr_assert_not(cache_disk_contains(d, &c[i]->key));
        cr_assert_null(read_one(d, &c[i]->key));
    }
    for (int i = 2; i < 4; i++) {
        cache_chunk *got = read_one(d, &c[i]->key);
        chunk_assert_same(got, c[i]);
        cache_chunk_unref(got);
    }
    cr_assert_eq(cache_disk_clear(d, &ns1), 0);
    cr_assert_eq(cache_disk_clear(d, NULL), 2);
    cr_assert_eq(stats(d).entries, 0);
    cr_assert_eq(count_files(dir, &l, ".kvc"), 0);
    /* A cleared key can be stored again. */
    put_ok(d, c[0]);
    cache_disk_flush(d);
    cr_assert(cache_disk_contains(d, &c[0]->key));
    cache_disk_close(d);
    for (int i = 0; i < 4; i++) cache_chunk_unref(c[i]);
    remove_tree(dir);
}

Test(disk, clear_during_writes_leaves_nothing) {
    char *dir = make_tmpdir();
    cache_layout l = small_layout();
    cache_key ns = make_ns("a");
    cache_disk *d = open_disk(dir, &l, 1 << 20, 64);
    cache_chunk *c[32];
    for (int i = 0; i < 32; i++) {
        c[i] = make_chunk(&l, &ns, i);
        put_ok(d, c[i]);
    }
    /* Some of these are on disk, the rest queued or in flight: all must go. */
    int64_t n = cache_disk_clear(d, &ns);
    cr_assert_leq(n, 32);
    cache_disk_flush(d);
    cache_tier_stats st = stats(d);
    cr_assert_eq(st.entries, 0, "%lld records survived a clear", (long long)st.entries);
    cr_assert_eq(st.bytes, 0);
    cr_assert_eq(count_files(dir, &l, ".kvc"), 0);
    cr_assert_eq(count_files(dir, &l, ".part"), 0);
    for (int i = 0; i < 32; i++) cr_assert_eq(atomic_load(&c[i]->refs), 1);
    cache_disk_close(d);
    for (int i = 0; i < 32; i++) cache_chunk_unref(c[i]);
    remove_tree(dir);
}

Test(disk, full_write_queue_drops) {
    char *dir = make_tmpdir();
    cache_layout l = small_layout();
    cache_key ns = make_ns("a");
    cache_disk *d = open_disk(dir, &l, 1 << 20, 0);
    cache_chunk *c = make_chunk(&l, &ns, 0);
    cr_assert_not(cache_disk_put(d, c), "a queue of 0 takes nothing");
    cr_assert_eq(stats(d).dropped, 1);
    cr_assert_eq(atomic_load(&c->refs), 1, "a dropped put keeps no reference");
    cache_disk_close(d);
    cache_chunk_unref(c);

    d = open_disk(dir, &l, 1 << 20, 1);
    int queued = 0;
    cache_chunk *cs[50];
    for (int i = 0; i < 50; i++) {
        cs[i] = make_chunk(&l, &ns, i);
        queued += cache_disk_put(d, cs[i]);
    }
    cache_disk_flush(d);
    cache_tier_stats st = stats(d);
    cr_assert_gt(st.dropped, 0, "50 puts into a queue of 1 without any drop");
    cr_assert_eq(st.dropped + queued, 50);
    cr_assert_eq(st.entries, queued);
    cr_assert_eq(st.write_errors, 0);
    cache_disk_close(d);
    for (int i = 0; i < 50; i++) cache_chunk_unref(cs[i]);
    remove_tree(dir);
}

Test(disk, bad_arguments_are_refused) {
    char *dir = make_tmpdir();
    cache_layout l = small_layout();
    kv_error err = {{0}};
    cr_assert_null(cache_disk_open(dir, &l, -1, 4, &err));
    cr_assert_null(cache_disk_open(dir, &l, 1 << 20, -1, &err));
    cache_layout bad = l;
    bad.block_tokens = 17;
    cr_assert_null(cache_disk_open(dir, &bad, 1 << 20, 4, &err));
    cr_assert_not_null(strstr(err.msg, "block"), "%s", err.msg);
    /* A path through a regular file cannot be a directory. */
    char file[512];
    snprintf(file, sizeof file, "%s/plain", dir);
    write_file(file, "x", 1);
    cr_assert_null(cache_disk_open(file, &l, 1 << 20, 4, &err));
    cr_assert_neq(err.msg[0], '\0');
    /* mkdir -p of a nested path. */
    char nested[512];
    snprintf(nested, sizeof nested, "%s/a/b//c/", dir);
    cache_disk *d = open_disk(nested, &l, 1 << 20, 4);
    cache_disk_close(d);
    remove_tree(dir);
}

/* A 64 KiB tmpfs holds one 45056-byte record: the second and third writes fail with ENOSPC. */
Test(disk, full_disk_counts_write_errors) {
    if (geteuid() != 0) cr_skip_test("needs root to mount a small tmpfs");
    /* A private mount namespace for this test's process (Criterion runs each test in its own):
     * the tmpfs disappears with the process even when an assertion ends the test early. */
    if (unshare(CLONE_NEWNS) == 0) mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL);
    char *dir = make_tmpdir();
    if (mount("tmpfs", dir, "tmpfs", 0, "size=64k") != 0) {
        int e = errno;
        remove_tree(dir);
        cr_skip_test("cannot mount a tmpfs (%s)", strerror(e));
    }
    cache_layout l = small_layout();
    l.head_dim = 64;
    l.chunk_tokens = 80; /* 5 blocks of 8192 bytes: 40960-byte payload */
    cache_key ns = make_ns("a");
    cache_disk *d = open_disk(dir, &l, 1 << 20, 16);
    cache_chunk *c[3];
    for (int i = 0; i < 3; i++) {
        c[i] = make_chunk(&l, &ns, i);
        put_ok(d, c[i]);
        cache_disk_flush(d);
    }
    cache_tier_stats st = stats(d);
    cr_assert_eq(st.write_errors, 2, "write errors %lld", (long long)st.write_errors);
    cr_assert_eq(st.entries, 1);
    cr_assert_eq(count_files(dir, &l, ".part"), 0, "a failed write left its temporary file");
    cr_assert_eq(count_files(dir, &l, ".kvc"), 1);
    cache_chunk *got = read_one(d, &c[0]->key);
    chunk_assert_same(got, c[0]);
    cache_chunk_unref(got);
    cr_assert_null(read_one(d, &c[1]->key));
    cache_disk_close(d);
    cr_assert_eq(umount(dir), 0, "umount: %s", strerror(errno));
    for (int i = 0; i < 3; i++) cache_chunk_unref(c[i]);
    remove_tree(dir);
}

/* io_uring_setup refused by seccomp (as container runtimes do): the tier must work on its
 * pread/pwrite fallback. Criterion runs each test in its own process, so the filter stays here. */
Test(disk, pread_fallback_without_io_uring) {
    struct sock_filter filter[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_setup, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOSYS),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    struct sock_fprog prog = {.len = sizeof filter / sizeof filter[0], .filter = filter};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 ||
        prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) != 0)
        cr_skip_test("cannot install a seccomp filter (%s)", strerror(errno));
    struct io_uring ring;
    cr_assert_eq(io_uring_queue_init(8, &ring, 0), -ENOSYS, "the filter did not take");

    char *dir = make_tmpdir();
    cache_layout l = small_layout();
    cache_key ns = make_ns("a");
    cache_disk *d = open_disk(dir, &l, 1 << 20, 64);
    cache_chunk *c[40];
    for (int i = 0; i < 40; i++) {
        c[i] = make_chunk(&l, &ns, i);
        put_ok(d, c[i]);
    }
    cache_disk_close(d);
    d = open_disk(dir, &l, 1 << 20, 16);
    cr_assert_eq(stats(d).entries, 40);
    char p[512];
    record_path(dir, &l, &c[5]->key, p, sizeof p);
    flip_byte(p, HEADER + PAYLOAD - 1);
    cache_key keys[40];
    cache_chunk *out[40];
    for (int i = 0; i < 40; i++) keys[i] = c[i]->key;
    cache_disk_read(d, keys, 40, out); /* more than one read group */
    for (int i = 0; i < 40; i++) {
        if (i == 5) {
            cr_assert_null(out[i]);
            continue;
        }
        chunk_assert_same(out[i], c[i]);
        cache_chunk_unref(out[i]);
    }
    cr_assert_eq(stats(d).corrupt, 1);
    cr_assert_eq(stats(d).hits, 39);
    cache_disk_close(d);
    for (int i = 0; i < 40; i++) cache_chunk_unref(c[i]);
    remove_tree(dir);
}

Test(disk, large_batch_reads_through_io_uring) {
    char *dir = make_tmpdir();
    cache_layout l = small_layout();
    cache_key ns = make_ns("a");
    cache_disk *d = open_disk(dir, &l, 1 << 20, 128);
    enum { N = 100 };
    cache_chunk *c[N];
    cache_key keys[N];
    cache_chunk *out[N];
    for (int i = 0; i < N; i++) {
        c[i] = make_chunk(&l, &ns, i);
        keys[i] = c[i]->key;
        put_ok(d, c[i]);
    }
    cache_disk_flush(d);
    cache_disk_read(d, keys, N, out);
    for (int i = 0; i < N; i++) {
        chunk_assert_same(out[i], c[i]);
        cache_chunk_unref(out[i]);
        cache_chunk_unref(c[i]);
    }
    cr_assert_eq(stats(d).hits, N);
    cache_disk_close(d);
    remove_tree(dir);
}

/* One batch crosses many read groups (the next group reads while the last is checked): damaged,
 * torn and vanished records anywhere in it are refused each on its own, the rest served. */
Test(disk, damaged_records_in_a_batch_leave_the_rest) {
    char *dir = make_tmpdir();
    cache_layout l = small_layout();
    cache_key ns = make_ns("a");
    cache_disk *d = open_disk(dir, &l, 1 << 20, 64);
    enum { N = 23 };
    cache_chunk *c[N], *out[N];
    cache_key keys[N];
    for (int i = 0; i < N; i++) {
        c[i] = make_chunk(&l, &ns, i);
        keys[i] = c[i]->key;
        put_ok(d, c[i]);
    }
    cache_disk_flush(d);
    char path[512];
    for (int i = 0; i < N; i++) {
        record_path(dir, &l, &keys[i], path, sizeof path);
        if (i % 5 == 1) flip_byte(path, HEADER + 7 + i); /* payload */
        if (i % 5 == 3) cr_assert_eq(truncate(path, HEADER + PAYLOAD / 2), 0);
        if (i == 22) cr_assert_eq(unlink(path), 0);
    }
    cache_disk_read(d, keys, N, out);
    int bad = 0;
    for (int i = 0; i < N; i++) {
        bool damaged = i % 5 == 1 || i % 5 == 3 || i == 22;
        if (damaged) {
            cr_expect_null(out[i], "record %d is damaged", i);
            bad += i != 22;
        } else {
            chunk_assert_same(out[i], c[i]);
        }
        cache_chunk_unref(out[i]);
        cache_chunk_unref(c[i]);
    }
    cache_tier_stats st = stats(d);
    cr_expect_eq(st.corrupt, bad);
    cr_expect_eq(st.hits, N - bad - 1);
    cr_expect_eq(st.entries, N - bad - 1);
    cache_disk_close(d);
    remove_tree(dir);
}

/* ---------------------------------------------------------------- concurrency */

#define CONC_KEYS 40
#define CONC_THREADS 4

typedef struct conc_arg {
    cache_disk *d;
    const cache_layout *l;
    cache_chunk **c; /* [CONC_KEYS] */
    uint64_t seed;
    int bad; /* chunks read back wrong */
} conc_arg;

static void *conc_worker(void *p) {
    conc_arg *a = p;
    uint64_t s = a->seed;
    for (int it = 0; it < 300; it++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        /* 3/8 puts, 1/2 reads, 1/8 flushes (they let the I/O thread catch up), 1/128 clears. */
        int op = (int)(s % 128);
        if (op < 48) {
            cache_disk_put(a->d, a->c[(s >> 8) % CONC_KEYS]);
        } else if (op < 112) {
            cache_key keys[4];
            int idx[4];
            cache_chunk *out[4];
            for (int k = 0; k < 4; k++) {
                idx[k] = (int)((s >> (8 + 6 * k)) % CONC_KEYS);
                keys[k] = a->c[idx[k]]->key;
            }
            cache_disk_read(a->d, keys, 4, out);
            for (int k = 0; k < 4; k++) {
                if (!out[k]) continue;
                const cache_chunk *want = a->c[idx[k]];
                a->bad += out[k]->pos0 != want->pos0 ||
                          memcmp(out[k]->data, want->data, want->bytes) != 0;
                cache_chunk_unref(out[k]);
            }
        } else if (op < 127) {
            cache_disk_flush(a->d);
        } else {
            cache_disk_clear(a->d, (s >> 8) & 1 ? NULL : &a->c[0]->ns);
        }
    }
    return NULL;
}

Test(disk, concurrent_puts_reads_and_clears) {
    char *dir = make_tmpdir();
    cache_layout l = small_layout();
    cache_key ns = make_ns("a");
    cache_disk *d = open_disk(dir, &l, 4 * PAYLOAD, 8);
    cache_chunk *c[CONC_KEYS];
    for (int i = 0; i < CONC_KEYS; i++) c[i] = make_chunk(&l, &ns, i);
    pthread_t th[CONC_THREADS];
    conc_arg args[CONC_THREADS];
    for (int t = 0; t < CONC_THREADS; t++) {
        args[t] = (conc_arg){.d = d, .l = &l, .c = c, .seed = 0x1234567ull * (uint64_t)(t + 1)};
        cr_assert_eq(pthread_create(&th[t], NULL, conc_worker, &args[t]), 0);
    }
    for (int t = 0; t < CONC_THREADS; t++) pthread_join(th[t], NULL);
    cache_disk_flush(d);
    for (int t = 0; t < CONC_THREADS; t++) cr_assert_eq(args[t].bad, 0, "wrong bytes served");
    cache_tier_stats st = stats(d);
    cr_assert_eq(st.bytes, st.entries * PAYLOAD);
    cr_assert_leq(st.bytes, 4 * PAYLOAD);
    cr_assert_eq(st.corrupt + st.write_errors, 0);
    cr_assert_gt(st.hits, 0);
    cr_assert_gt(st.evictions, 0);
    cr_assert_eq(count_files(dir, &l, ".kvc"), st.entries, "files and index disagree");
    cr_assert_eq(count_files(dir, &l, ".part"), 0);
    for (int i = 0; i < CONC_KEYS; i++) cr_assert_eq(atomic_load(&c[i]->refs), 1);
    cache_disk_close(d);
    /* What survived is exactly what a restart finds. */
    d = open_disk(dir, &l, 4 * PAYLOAD, 8);
    cr_assert_eq(stats(d).entries, st.entries);
    cr_assert_eq(stats(d).corrupt, 0);
    cache_disk_close(d);
    for (int i = 0; i < CONC_KEYS; i++) cache_chunk_unref(c[i]);
    remove_tree(dir);
}
