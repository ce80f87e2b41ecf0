/* cache/: leases (pins with an expiry) through the chunk store, on an injected clock: a leased
 * record outlives eviction until its time and not after, a lease passes to the longer record
 * that replaces its record, leases and pins share the pin limit and do not undo each other, a
 * prefix is leased chunk by chunk up to the first chunk no tier holds, the disk tier keeps its
 * leases across a restart (and drops expired ones), and the leases file's parser refuses what
 * is not one. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/cache.h"
#include "cache/store/leases.h"
#include "tests/unit/tmpdir.h"

/* Two blocks of 16 tokens per chunk. */
static const cache_layout SMALL = {
    .n_layer = 2, .n_kv_head = 1, .head_dim = 8, .block_tokens = 16, .chunk_tokens = 32};

#define T0 1700000000 /* the injected clock's start, Unix seconds */

static int64_t fake_clock(void *arg) { return *(int64_t *)arg; }

/* Block b of a sequence's key: chunk b / 2 holds blocks 2c and 2c + 1. */
static cache_key seq_key(int b) {
    cache_key k = {{0}};
    k.b[0] = (uint8_t)(b + 1);
    k.b[7] = 0x5e;
    return k;
}

static void seq_keys(cache_key *out, int n) {
    for (int b = 0; b < n; b++) out[b] = seq_key(b);
}

/* The record of chunk c of the sequence holding its first n_blocks blocks (1 or 2). */
static cache_chunk *seq_chunk(int c, int n_blocks) {
    cache_key bkeys[2] = {seq_key(2 * c), seq_key(2 * c + 1)}, ns = {{0}};
    cache_chunk *ch = cache_chunk_create(&SMALL, bkeys, n_blocks, &ns, c * 32);
    cr_assert_not_null(ch);
    memset(ch->data, c + 1, ch->bytes);
    return ch;
}

/* Stores the sequence's chunks [from, to) whole. */
static void put_chunks(cache_store *s, int from, int to) {
    for (int c = from; c < to; c++) {
        cache_chunk *ch = seq_chunk(c, 2);
        cache_store_put(s, ch);
        cache_chunk_unref(ch);
    }
}

static bool ram_holds_chunk(cache_store *s, int c) {
    cache_key k = seq_key(2 * c + 1);
    return cache_store_holds(s, &k);
}

static cache_store *open_store(int64_t ram_chunks, const char *dir, int64_t pin_bytes,
                               int64_t *clock) {
    cache_store_opts o = {.ram_bytes = ram_chunks * (int64_t)cache_chunk_bytes(&SMALL),
                          .dir = dir,
                          .disk_bytes = dir ? 64 << 20 : 0,
                          .write_queue = 16,
                          .pin_bytes = pin_bytes,
                          .clock = fake_clock,
                          .clock_arg = clock};
    kv_error err = {{0}};
    cache_store *s = cache_store_open(&SMALL, &o, &err);
    cr_assert_not_null(s, "cache_store_open: %s", err.msg);
    return s;
}

static int64_t ram_pinned(cache_store *s) {
    cache_stats st;
    cache_store_stats(s, &st);
    return st.ram.pinned;
}

/* A RAM-only store of ram_chunks chunks holding the sequence's first two, and their blocks'
 * keys. */
static cache_store *store_of_two(int64_t ram_chunks, int64_t *now, cache_key keys[4]) {
    cache_store *s = open_store(ram_chunks, NULL, 0, now);
    put_chunks(s, 0, 2);
    seq_keys(keys, 4);
    return s;
}

Test(cache_lease, a_leased_record_outlives_eviction_until_its_time) {
    int64_t now = T0;
    cache_key keys[4];
    cache_store *s = store_of_two(4, &now, keys);
    /* the prefix of the first chunk, for 300 s */
    cr_assert_eq(cache_store_lease(s, CACHE_TENANT_NONE, keys, 2, now + 300), 2);
    cr_assert_eq(ram_pinned(s), 1);
    put_chunks(s, 2, 10); /* traffic: everything unleased goes */
    cr_assert(ram_holds_chunk(s, 0), "leased: kept");
    cr_assert_not(ram_holds_chunk(s, 1), "not leased: evicted");
    now = T0 + 299;
    cr_assert_eq(cache_store_expire(s), 0, "not due yet");
    put_chunks(s, 10, 14);
    cr_assert(ram_holds_chunk(s, 0));
    now = T0 + 300; /* due: released by the next use of the store, no new lease needed */
    cache_pin_info pins[4];
    cr_assert_eq(cache_store_pins(s, pins, 4), 0, "listing ends the lease that is due");
    cr_assert_eq(ram_pinned(s), 0);
    put_chunks(s, 14, 18);
    cr_assert_not(ram_holds_chunk(s, 0), "released: evicted like the rest");
    cache_store_close(s);
}

Test(cache_lease, leases_are_listed_with_their_expiry_and_a_later_one_wins) {
    int64_t now = T0;
    cache_key keys[4];
    cache_store *s = store_of_two(8, &now, keys);
    cr_assert_eq(cache_store_lease(s, CACHE_TENANT_NONE, keys, 4, now + 3600), 4);
    cr_assert_eq(cache_store_lease(s, CACHE_TENANT_NONE, keys, 2, now + 300), 2,
                 "a shorter lease keeps the later");
    cache_pin_info pins[4];
    cr_assert_eq(cache_store_pins(s, pins, 4), 2);
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(pins[i].lease, T0 + 3600);
        cr_assert(pins[i].ram && !pins[i].disk && !pins[i].manual);
        cr_assert_eq(pins[i].n_blocks, 2);
    }
    now = T0 + 600;
    cr_assert_eq(cache_store_lease(s, CACHE_TENANT_NONE, keys, 2, now + 3600), 2,
                 "a refresh moves it on");
    now = T0 + 3600;
    cr_assert_eq(cache_store_expire(s), 1, "the second chunk's lease ends, the first's not");
    cr_assert_eq(cache_store_pins(s, pins, 4), 1);
    cr_assert_eq(pins[0].lease, T0 + 600 + 3600);
    cache_store_close(s);
}

Test(cache_lease, a_prefix_is_leased_up_to_the_first_chunk_no_tier_holds) {
    int64_t now = T0;
    cache_store *s = open_store(8, NULL, 0, &now);
    put_chunks(s, 0, 1);
    put_chunks(s, 2, 3); /* chunk 1 is missing */
    cache_key keys[6];
    seq_keys(keys, 6);
    cr_assert_eq(cache_store_lease(s, CACHE_TENANT_NONE, keys, 6, now + 300), 2);
    cr_assert_eq(ram_pinned(s), 1, "nothing past the gap: it could not be reused");
    /* a prefix ending inside a chunk leases that chunk's record (it holds the prefix's blocks) */
    cr_assert_eq(cache_store_lease(s, CACHE_TENANT_NONE, keys, 1, now + 300), 1);
    cr_assert_eq(cache_store_lease(s, CACHE_TENANT_NONE, keys, 0, now + 300), 0);
    cache_store_close(s);
}

Test(cache_lease, a_lease_passes_to_the_record_that_replaces_its_own) {
    int64_t now = T0;
    cache_store *s = open_store(8, NULL, 0, &now);
    /* a prompt's trailing partial chunk, leased; then the sequence's generated tokens complete
     * the chunk and its longer record replaces the partial one */
    cache_chunk *part = seq_chunk(0, 1);
    cache_store_put(s, part);
    cache_chunk_unref(part);
    cache_key keys[2];
    seq_keys(keys, 2);
    cr_assert_eq(cache_store_lease(s, CACHE_TENANT_NONE, keys, 1, now + 300), 1);
    put_chunks(s, 0, 1);
    cache_pin_info pins[2];
    cr_assert_eq(cache_store_pins(s, pins, 2), 1);
    cr_assert_eq(pins[0].n_blocks, 2, "the whole record has the lease");
    cr_assert_eq(pins[0].lease, T0 + 300);
    put_chunks(s, 1, 12);
    cr_assert(ram_holds_chunk(s, 0));
    now = T0 + 301;
    cr_assert_eq(cache_store_expire(s), 1, "and it ends there too");
    cache_store_close(s);
}

Test(cache_lease, leases_and_pins_share_the_limit_and_keep_each_other) {
    int64_t now = T0;
    size_t cb = cache_chunk_bytes(&SMALL);
    /* 8 chunks of RAM (pins may take 4) and a pin limit of 2 chunks */
    cache_store *s = open_store(8, NULL, (int64_t)(2 * cb), &now);
    put_chunks(s, 0, 3);
    cache_key keys[6];
    seq_keys(keys, 6);
    cache_key rec0 = seq_key(1);
    cr_assert_eq(cache_store_pin(s, CACHE_TENANT_NONE, &rec0, 1, true), 1);
    cr_assert_eq(cache_store_lease(s, CACHE_TENANT_NONE, keys, 6, now + 300), 4,
                 "the third chunk is over the limit");
    cr_assert_eq(ram_pinned(s), 2);
    /* unpinning keeps the lease; the lease ending keeps the pin */
    cr_assert_eq(cache_store_pin(s, CACHE_TENANT_NONE, &rec0, 1, false), 1);
    cr_assert_eq(ram_pinned(s), 2);
    cr_assert_eq(cache_store_pin(s, CACHE_TENANT_NONE, &rec0, 1, true), 1);
    now = T0 + 300;
    cr_assert_eq(cache_store_expire(s), 2);
    cache_pin_info pins[4];
    cr_assert_eq(cache_store_pins(s, pins, 4), 1);
    cr_assert(pins[0].manual);
    cr_assert_eq(pins[0].lease, 0);
    cache_store_close(s);
}

Test(cache_lease, the_disk_tier_keeps_its_leases_across_a_restart) {
    char *dir = tmpdir_create("kvserve-lease-test-");
    int64_t now = T0;
    cache_store *s = open_store(8, dir, 0, &now);
    put_chunks(s, 0, 3);
    cache_key keys[6];
    seq_keys(keys, 6);
    cr_assert_eq(cache_store_lease(s, CACHE_TENANT_NONE, keys, 4, now + 300), 4);
    cr_assert_eq(cache_store_lease(s, CACHE_TENANT_NONE, keys, 6, now + 100), 6);
    cache_store_flush(s);
    cache_store_close(s);

    now = T0 + 200; /* the third chunk's lease is over by now, the others' not */
    s = open_store(8, dir, 0, &now);
    cache_pin_info pins[4];
    cr_assert_eq(cache_store_pins(s, pins, 4), 2);
    for (int i = 0; i < 2; i++) {
        cr_assert(pins[i].disk && !pins[i].ram, "restored on disk");
        cr_assert_eq(pins[i].lease, T0 + 300);
    }
    cache_stats st;
    cache_store_stats(s, &st);
    cr_assert_eq(st.disk.pinned, 2);
    cache_store_close(s);

    now = T0 + 300;
    s = open_store(8, dir, 0, &now);
    cr_assert_eq(cache_store_pins(s, pins, 4), 0, "expired while the server was down");
    cache_store_close(s);

    /* a torn leases file costs the leases, not the records */
    char path[512];
    snprintf(path, sizeof path, "%s/%s/leases", dir, "0000000000000000");
    FILE *f = fopen(path, "r+b");
    cr_assert_not_null(f, "%s", path);
    fputc('X', f);
    fclose(f);
    now = T0;
    s = open_store(8, dir, 0, &now);
    cr_assert_eq(cache_store_pins(s, pins, 4), 0);
    cache_store_stats(s, &st);
    cr_assert_eq(st.disk.entries, 3);
    cache_store_close(s);
    free(dir);
}

/* ---------------------------------------------------------------- the leases file */

Test(cache_leases_file, round_trips_and_refuses_what_is_not_one) {
    cache_lease in[3];
    for (int i = 0; i < 3; i++) in[i] = (cache_lease){seq_key(i), T0 + i};
    size_t n = cache_leases_bytes(3);
    uint8_t *buf = malloc(n);
    cr_assert_eq(cache_leases_encode(in, 3, buf), 0);
    cache_lease *out;
    int count;
    kv_error err = {{0}};
    cr_assert_eq(cache_leases_parse(buf, n, &out, &count, &err), 0, "%s", err.msg);
    cr_assert_eq(count, 3);
    cr_assert_eq(memcmp(out, in, sizeof in), 0);
    free(out);
    cr_assert_eq(cache_leases_parse(buf, n - 1, &out, &count, &err), -1, "short");
    cr_assert(strstr(err.msg, "bytes"), "%s", err.msg);
    buf[20] ^= 1;
    cr_assert_eq(cache_leases_parse(buf, n, &out, &count, &err), -1, "a flipped bit");
    cr_assert(strstr(err.msg, "checksum"), "%s", err.msg);
    buf[20] ^= 1;
    buf[8] = 9;
    cr_assert_eq(cache_leases_parse(buf, n, &out, &count, &err), -1, "another version");
    cr_assert(strstr(err.msg, "version"), "%s", err.msg);
    cr_assert_null(out);
    /* a lease that never ends is not one: the checksum is right, the expiry is not */
    in[1].until = 0;
    cr_assert_eq(cache_leases_encode(in, 3, buf), 0);
    cr_assert_eq(cache_leases_parse(buf, n, &out, &count, &err), -1);
    cr_assert(strstr(err.msg, "expiry"), "%s", err.msg);
    cr_assert_eq(cache_leases_encode(in, 0, buf), 0);
    cr_assert_eq(cache_leases_parse(buf, cache_leases_bytes(0), &out, &count, &err), 0);
    cr_assert_eq(count, 0);
    free(buf);
}
