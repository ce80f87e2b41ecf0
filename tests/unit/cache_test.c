/* cache/: chunk keys against goldens from an independent implementation
 * (scripts/ref/make_cache_key_golden.py, Python hashlib), the chaining and namespace
 * properties, and the RAM tier (LRU, byte cap, pins, namespaces, references, swapping a chunk for
 * its encoding). */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "cache/cache.h"
#include "cache/store/ram.h"

static void golden(const char *name, char out[65]) {
    FILE *f = fopen("tests/golden/cache/keys.txt", "r");
    cr_assert_not_null(f, "tests/golden/cache/keys.txt missing");
    char n[64], hex[80];
    while (fscanf(f, "%63s %79s", n, hex) == 2)
        if (strcmp(n, name) == 0) {
            fclose(f);
            cr_assert_eq(strlen(hex), 64);
            memcpy(out, hex, 65);
            return;
        }
    fclose(f);
    cr_assert_fail("golden key %s missing", name);
}

static void check_key(const cache_key *k, const char *name) {
    char want[65], got[65];
    golden(name, want);
    cache_key_hex(k, got);
    cr_assert_str_eq(got, want, "%s", name);
}

static uint8_t MODEL_ID[32];
static int32_t TOKENS[48];

static void setup_inputs(void) {
    for (int i = 0; i < 32; i++) MODEL_ID[i] = (uint8_t)i;
    for (int i = 0; i < 48; i++) TOKENS[i] = (i * 7919 + 13) % 49152 - 5;
}

TestSuite(cache_keys, .init = setup_inputs);

Test(cache_keys, match_the_independent_reference) {
    cache_key ns_none, ns_alice, ns_salt, keys[3], content;
    cache_namespace(NULL, 0, NULL, &ns_none);
    cache_namespace((const uint8_t *)"alice", 5, NULL, &ns_alice);
    cache_namespace((const uint8_t *)"alice", 5, "s1", &ns_salt);
    check_key(&ns_none, "ns_none");
    check_key(&ns_alice, "ns_alice");
    check_key(&ns_salt, "ns_alice_s1");
    cr_assert_eq(cache_prefix_keys(MODEL_ID, &ns_alice, TOKENS, 48, 16, keys, 3), 3);
    check_key(&keys[0], "prefix0");
    check_key(&keys[1], "prefix1");
    check_key(&keys[2], "prefix2");
    cache_content_key(MODEL_ID, &ns_alice, TOKENS + 16, 16, &content);
    check_key(&content, "content");
}

Test(cache_keys, chain_over_the_whole_prefix) {
    cache_key ns, a[3], b[3];
    cache_namespace(NULL, 0, NULL, &ns);
    cache_prefix_keys(MODEL_ID, &ns, TOKENS, 48, 16, a, 3);
    int32_t t[48];
    memcpy(t, TOKENS, sizeof t);
    t[3]++; /* one token of the first chunk differs: every later key differs */
    cache_prefix_keys(MODEL_ID, &ns, t, 48, 16, b, 3);
    for (int i = 0; i < 3; i++) cr_assert_neq(memcmp(a[i].b, b[i].b, 32), 0, "key %d", i);
    /* only full chunks get keys; max_keys bounds the count */
    cr_assert_eq(cache_prefix_keys(MODEL_ID, &ns, TOKENS, 47, 16, b, 3), 2);
    cr_assert_eq(cache_prefix_keys(MODEL_ID, &ns, TOKENS, 48, 16, b, 1), 1);
    cr_assert_eq(memcmp(a[0].b, b[0].b, 32), 0);
    cr_assert_eq(cache_prefix_keys(MODEL_ID, &ns, TOKENS, 10, 16, b, 3), 0);
}

Test(cache_keys, namespaces_and_models_separate_keys) {
    cache_key n1, n2, n3, n4, k1, k2;
    cache_namespace((const uint8_t *)"ab", 2, "c", &n1);
    cache_namespace((const uint8_t *)"a", 1, "bc", &n2); /* same bytes, split differently */
    cache_namespace((const uint8_t *)"ab", 2, "", &n3);  /* empty salt is not no salt */
    cache_namespace((const uint8_t *)"ab", 2, NULL, &n4);
    cr_assert_neq(memcmp(n1.b, n2.b, 32), 0);
    cr_assert_neq(memcmp(n3.b, n4.b, 32), 0);
    cache_prefix_key(MODEL_ID, &n1, NULL, TOKENS, 16, &k1);
    cache_prefix_key(MODEL_ID, &n2, NULL, TOKENS, 16, &k2);
    cr_assert_neq(memcmp(k1.b, k2.b, 32), 0);
    uint8_t other[32];
    memcpy(other, MODEL_ID, 32);
    other[31] ^= 1;
    cache_prefix_key(other, &n1, NULL, TOKENS, 16, &k2);
    cr_assert_neq(memcmp(k1.b, k2.b, 32), 0);
    /* the prefix key differs from the content key of the same tokens */
    cache_content_key(MODEL_ID, &n1, TOKENS, 16, &k2);
    cr_assert_neq(memcmp(k1.b, k2.b, 32), 0);
}

/* ---------------------------------------------------------------- layout */

static const cache_layout SMALL = {
    .n_layer = 2, .n_kv_head = 1, .head_dim = 8, .block_tokens = 16, .chunk_tokens = 32};

Test(cache_layout, sizes_and_checks) {
    cr_assert_eq(cache_block_bytes(&SMALL), 2u * 2 * 1 * 16 * 8 * 2);
    cr_assert_eq(cache_chunk_bytes(&SMALL), 2 * cache_block_bytes(&SMALL));
    cr_assert_eq(cache_layout_check(&SMALL, NULL), 0);
    cache_layout l = SMALL;
    l.chunk_tokens = 40;
    kv_error err = {{0}};
    cr_assert_eq(cache_layout_check(&l, &err), -1);
    cr_assert(strstr(err.msg, "multiple"), "%s", err.msg);
    l = SMALL;
    l.n_layer = 0;
    cr_assert_eq(cache_layout_check(&l, NULL), -1);
}

/* ---------------------------------------------------------------- RAM tier */

static cache_key key_n(int n) {
    cache_key k = {{0}};
    k.b[0] = (uint8_t)n;
    k.b[9] = (uint8_t)(n >> 8);
    return k;
}

/* The key of block `block` (0 or 1) of chunk n: block 1's is key_n(n), the record's own key. */
static cache_key block_key(int n, int block) {
    cache_key k = key_n(n);
    if (block == 0) k.b[20] = 0xAA;
    return k;
}

/* A record of chunk n holding its first n_blocks blocks (SMALL has 2 per chunk). */
static cache_chunk *chunk_blocks(int n, int n_blocks, const cache_key *ns) {
    cache_key bkeys[2] = {block_key(n, 0), block_key(n, 1)};
    cache_chunk *c = cache_chunk_create(&SMALL, bkeys, n_blocks, ns, n * 32);
    cr_assert_not_null(c);
    memset(c->data, n, c->bytes);
    return c;
}

static cache_chunk *chunk_n(int n, const cache_key *ns) { return chunk_blocks(n, 2, ns); }

/* A lookup as the store makes it: a hit, or a counted miss. */
static cache_chunk *ram_get(cache_ram *r, const cache_key *bkey) {
    int block;
    cache_chunk *c = cache_ram_find(r, bkey, &block);
    if (!c) cache_ram_count_miss(r);
    return c;
}

Test(cache_ram, lru_eviction_keeps_the_byte_cap) {
    size_t cb = cache_chunk_bytes(&SMALL);
    cache_ram *r = cache_ram_create((int64_t)(3 * cb));
    cache_key ns = {{0}};
    for (int i = 0; i < 3; i++) {
        cache_chunk *c = chunk_n(i, &ns);
        cr_assert(cache_ram_put(r, c));
        cr_assert_not(cache_ram_put(r, c), "a key is stored once");
        cache_chunk_unref(c);
    }
    cache_key k0 = key_n(0);
    cache_chunk_unref(ram_get(r, &k0)); /* 0 is now the most recently used */
    cache_chunk *c3 = chunk_n(3, &ns);
    cr_assert(cache_ram_put(r, c3));
    cache_chunk_unref(c3);
    cache_tier_stats st;
    cache_ram_stats(r, &st);
    cr_assert_eq(st.entries, 3);
    cr_assert_leq(st.bytes, st.capacity);
    cr_assert_eq(st.evictions, 1);
    cache_key k1 = key_n(1), k2 = key_n(2);
    cr_assert_not(cache_ram_contains(r, &k1), "the least recently used chunk went");
    cr_assert(cache_ram_contains(r, &k0));
    cr_assert(cache_ram_contains(r, &k2));
    cache_chunk *g = ram_get(r, &k2);
    cr_assert_not_null(g);
    cr_assert_eq(g->data[5], 2);
    cache_chunk_unref(g);
    cr_assert_null(ram_get(r, &k1));
    cache_ram_stats(r, &st);
    cr_assert_eq(st.hits, 2);
    cr_assert_eq(st.misses, 1);
    cache_ram_destroy(r);
}

Test(cache_ram, pinned_chunks_stay_and_held_chunks_outlive_eviction) {
    size_t cb = cache_chunk_bytes(&SMALL);
    cache_ram *r = cache_ram_create((int64_t)(4 * cb));
    cache_key ns = {{0}};
    cache_chunk *c[3];
    for (int i = 0; i < 3; i++) {
        c[i] = chunk_n(i, &ns);
        cr_assert(cache_ram_put(r, c[i]));
    }
    cache_key k[3] = {key_n(0), key_n(1), key_n(2)};
    /* pins may take half the tier: two chunks of four, not three */
    cr_assert_eq(cache_ram_pin(r, CACHE_TENANT_NONE, k, 3, true, 0), 2);
    cache_tier_stats st;
    cache_ram_stats(r, &st);
    cr_assert_eq(st.pinned, 2);
    for (int i = 3; i < 9; i++) {
        cache_chunk *x = chunk_n(i, &ns);
        cr_assert(cache_ram_put(r, x), "unpinned traffic always has room");
        cache_chunk_unref(x);
    }
    cr_assert(cache_ram_contains(r, &k[0]), "pinned");
    cr_assert(cache_ram_contains(r, &k[1]), "pinned");
    cr_assert_not(cache_ram_contains(r, &k[2]), "not pinned: evicted");
    /* c[2] was evicted, but the reference held here keeps its payload valid */
    cr_assert_eq(c[2]->data[0], 2);
    cache_ram_stats(r, &st);
    cr_assert_leq(st.bytes, st.capacity);
    /* unpinned, they go like the rest */
    cr_assert_eq(cache_ram_pin(r, CACHE_TENANT_NONE, k, 2, false, 0), 2);
    for (int i = 10; i < 14; i++) {
        cache_chunk *x = chunk_n(i, &ns);
        cr_assert(cache_ram_put(r, x));
        cache_chunk_unref(x);
    }
    cr_assert_not(cache_ram_contains(r, &k[0]));
    for (int i = 0; i < 3; i++) cache_chunk_unref(c[i]);
    cache_ram_destroy(r);
}

Test(cache_ram, records_are_found_by_any_block_and_superseded_by_longer_ones) {
    size_t bb = cache_block_bytes(&SMALL);
    cache_ram *r = cache_ram_create(1 << 20);
    cache_key ns = {{0}};
    /* a sequence's trailing partial chunk: its first block only */
    cache_chunk *part = chunk_blocks(7, 1, &ns);
    cr_assert_eq(part->bytes, bb);
    cr_assert(cache_ram_put(r, part));
    cache_key k0 = block_key(7, 0), k1 = block_key(7, 1);
    cr_assert(cache_ram_holds(r, &k0));
    cr_assert_not(cache_ram_holds(r, &k1));
    cr_assert_eq(cache_ram_pin(r, CACHE_TENANT_NONE, &k0, 1, true, 0), 1);
    /* the whole chunk replaces it and inherits its pin */
    cache_chunk *whole = chunk_n(7, &ns);
    cr_assert(cache_ram_put(r, whole));
    cache_tier_stats st;
    cache_ram_stats(r, &st);
    cr_assert_eq(st.entries, 1);
    cr_assert_eq(st.bytes, (int64_t)(2 * bb));
    cr_assert_eq(st.pinned, 1);
    cr_assert_not(cache_ram_contains(r, &k0), "the partial record is gone");
    cr_assert(cache_ram_contains(r, &k1));
    /* a prompt that diverges after the first block finds the whole record by that block */
    int block = -1;
    cache_chunk *c = cache_ram_find(r, &k0, &block);
    cr_assert_eq(c, whole);
    cr_assert_eq(block, 0);
    cache_chunk_unref(c);
    c = cache_ram_find(r, &k1, &block);
    cr_assert_eq(block, 1);
    cache_chunk_unref(c);
    /* a shorter record of a chunk held whole is not stored again */
    cr_assert_not(cache_ram_put(r, part));
    cache_ram_stats(r, &st);
    cr_assert_eq(st.entries, 1);
    cache_chunk_unref(part);
    cache_chunk_unref(whole);
    cache_ram_destroy(r);
}

Test(cache_ram, swap_keeps_the_place_and_pin_and_counts_the_new_bytes) {
    size_t cb = cache_chunk_bytes(&SMALL);
    cache_ram *r = cache_ram_create((int64_t)(3 * cb));
    cache_key ns = {{0}};
    cache_chunk *c[3];
    for (int i = 0; i < 3; i++) {
        c[i] = chunk_n(i, &ns);
        cr_assert(cache_ram_put(r, c[i]));
    }
    cache_key k0 = key_n(0), k1 = key_n(1);
    cr_assert_eq(cache_ram_pin(r, CACHE_TENANT_NONE, &k1, 1, true, 0), 1);
    uint8_t payload[100];
    memset(payload, 0x5A, sizeof payload);
    cache_chunk *e0 = cache_chunk_create_encoded(c[0], CACHE_ENC_Q8, payload, sizeof payload);
    cache_chunk *e1 = cache_chunk_create_encoded(c[1], CACHE_ENC_Q8, payload, sizeof payload);
    cr_assert(e0 && e1);
    cr_assert_eq(e1->pos0, c[1]->pos0);
    cr_assert(cache_ram_swap(r, c[0], e0));
    cr_assert(cache_ram_swap(r, c[1], e1));
    cr_assert_not(cache_ram_swap(r, c[1], e1), "c[1] is no longer what RAM holds");
    cache_tier_stats st;
    cache_ram_stats(r, &st);
    cr_assert_eq(st.entries, 3);
    cr_assert_eq(st.bytes, (int64_t)(cb + 2 * sizeof payload));
    cr_assert_eq(st.pinned, 1);
    /* found by any block, as the encoding */
    cache_key b0 = block_key(1, 0);
    cache_chunk *g = ram_get(r, &b0);
    cr_assert_eq(g, e1);
    cr_assert_eq(g->enc, CACHE_ENC_Q8);
    cache_chunk_unref(g);
    /* its place in the LRU order is kept: 0 is still the oldest, and goes first (1 is pinned) */
    cache_chunk *c3 = chunk_n(3, &ns), *c4 = chunk_n(4, &ns);
    cr_assert(cache_ram_put(r, c3));
    cr_assert(cache_ram_put(r, c4));
    cr_assert_not(cache_ram_contains(r, &k0));
    cr_assert(cache_ram_contains(r, &k1));
    /* a chunk of other blocks is not swapped in */
    cr_assert_not(cache_ram_swap(r, c3, e1));
    cache_chunk_unref(c3);
    cache_chunk_unref(c4);
    cache_chunk_unref(e0);
    cache_chunk_unref(e1);
    for (int i = 0; i < 3; i++) cache_chunk_unref(c[i]);
    cache_ram_destroy(r);
}

Test(cache_ram, clear_by_namespace) {
    cache_ram *r = cache_ram_create(1 << 20);
    cache_key a = {{1}}, b = {{2}};
    for (int i = 0; i < 6; i++) {
        cache_chunk *c = chunk_n(i, i % 2 ? &a : &b);
        cache_ram_put(r, c);
        cache_chunk_unref(c);
    }
    cr_assert_eq(cache_ram_clear(r, &a), 3);
    cache_key k1 = key_n(1), k2 = key_n(2);
    cr_assert_not(cache_ram_contains(r, &k1));
    cr_assert(cache_ram_contains(r, &k2));
    cr_assert_eq(cache_ram_clear(r, NULL), 3);
    cache_tier_stats st;
    cache_ram_stats(r, &st);
    cr_assert_eq(st.entries, 0);
    cr_assert_eq(st.bytes, 0);
    cache_ram_destroy(r);
}
