/* cache/: tenants' shares of the pinned bytes (cache/store/pins.h) through the chunk store, in
 * RAM and on disk: a tenant's pins and leases stop at its share while another tenant's still go
 * in, a pin call past the share pins nothing (with an expiry too), a renewed lease and an unpin
 * never fail, a lease passes to the longer record that replaces its record with its tenant, and a
 * record held for no tenant becomes the tenant's that holds it too. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "cache/cache.h"
#include "cache/store/pins.h"
#include "tests/unit/tmpdir.h"

/* Two blocks of 16 tokens per chunk. */
static const cache_layout SMALL = {
    .n_layer = 2, .n_kv_head = 1, .head_dim = 8, .block_tokens = 16, .chunk_tokens = 32};

#define T0 1700000000

static int64_t fake_clock(void *arg) { return *(int64_t *)arg; }

/* Block b of tenant t's sequence: chunk c holds blocks 2c and 2c + 1. */
static cache_key seq_key(int t, int b) {
    cache_key k = {{0}};
    k.b[0] = (uint8_t)(b + 1);
    k.b[1] = (uint8_t)(t + 1);
    k.b[7] = 0x9a;
    return k;
}

/* Tenant t's chunks [0, n) stored whole (n_blocks 2), or its chunk c's first block only. */
static void put_chunk(cache_store *s, int t, int c, int n_blocks) {
    cache_key bkeys[2] = {seq_key(t, 2 * c), seq_key(t, 2 * c + 1)}, ns = {{0}};
    ns.b[0] = (uint8_t)(t + 1);
    cache_chunk *ch = cache_chunk_create(&SMALL, bkeys, n_blocks, &ns, c * 32);
    cr_assert_not_null(ch);
    memset(ch->data, c + 1, ch->bytes);
    cache_store_put(s, ch);
    cache_chunk_unref(ch);
}

/* A store of 8 chunks in RAM (pins: at most 4) and, with dir, on disk, for two tenants, each
 * holding at most share_pct percent of the pins (0: half). */
static cache_store *open_store(const char *dir, int share_pct, int64_t *clock) {
    int64_t tier = 8 * (int64_t)cache_chunk_bytes(&SMALL);
    cache_store_opts o = {.n_tenants = 2, .tenant_pin_share = share_pct, .write_queue = 16};
    o.ram_bytes = tier;
    if (dir) { /* its headers beside the payload */
        o.dir = dir;
        o.disk_bytes = tier + 8192;
    }
    o.clock = fake_clock;
    o.clock_arg = clock;
    kv_error err = {{0}};
    cache_store *s = cache_store_open(&SMALL, &o, &err);
    cr_assert_not_null(s, "cache_store_open: %s", err.msg);
    return s;
}

static int64_t ram_pinned(cache_store *s, int t) {
    cache_tenant_pins p;
    cache_store_tenant_pins(s, t, &p);
    return p.ram;
}

Test(cache_pins, a_tenant_stops_at_its_share_and_the_other_still_pins) {
    int64_t now = T0, cb = (int64_t)cache_chunk_bytes(&SMALL);
    cache_store *s = open_store(NULL, 0, &now);
    for (int t = 0; t < 2; t++)
        for (int c = 0; c < 3; c++) put_chunk(s, t, c, 2);
    cache_key a[3] = {seq_key(0, 1), seq_key(0, 3), seq_key(0, 5)};
    /* tenant 0's share: half of four chunks */
    cr_assert_eq(cache_store_pin(s, 0, a, 2, true), 2);
    cr_assert_eq(cache_store_pin(s, 0, a + 2, 1, true), -1, "past its share: refused");
    cr_assert_eq(ram_pinned(s, 0), 2 * cb);
    cr_assert_eq(cache_store_pin(s, 0, a, 2, true), 2, "pinned again: no more bytes");
    cache_key b[6];
    for (int k = 0; k < 6; k++) b[k] = seq_key(1, k);
    /* tenant 1 leases its two chunks while tenant 0 is full; not a third */
    cr_assert_eq(cache_store_lease(s, 1, b, 4, now + 300), 4);
    cr_assert_eq(cache_store_lease(s, 1, b, 6, now + 300), 4, "its share ends at chunk 2");
    cr_assert_eq(cache_store_lease(s, 1, b, 4, now + 600), 4, "renewed: never refused");
    cr_assert_eq(ram_pinned(s, 1), 2 * cb);
    cache_tenant_pins p;
    cache_store_tenant_pins(s, 1, &p);
    cr_assert_eq(p.ram_share, 2 * cb);
    /* a record pinned for no tenant counts against the cap only: none is left */
    cr_assert_eq(cache_store_pin(s, CACHE_TENANT_NONE, a + 2, 1, true), 0);
    /* unpinned, tenant 0 has room again; tenant 1's leases end at their time */
    cr_assert_eq(cache_store_pin(s, 0, a, 1, false), 1);
    cr_assert_eq(cache_store_pin(s, 0, a + 2, 1, true), 1);
    now = T0 + 601;
    cr_assert_eq(cache_store_expire(s), 2);
    cr_assert_eq(ram_pinned(s, 1), 0);
    cache_store_close(s);
}

/* A RAM-only store (shares of two chunks) holding tenant 0's chunks 0 to 2, and their keys. */
static cache_store *store_of_three(int64_t *now, cache_key a[3]) {
    cache_store *s = open_store(NULL, 0, now);
    for (int c = 0; c < 3; c++) {
        put_chunk(s, 0, c, 2);
        a[c] = seq_key(0, 2 * c + 1);
    }
    return s;
}

Test(cache_pins, a_pin_call_past_the_share_pins_none_of_its_records) {
    int64_t now = T0;
    cache_key a[3];
    cache_store *s = store_of_three(&now, a);
    cr_assert_eq(cache_store_pin(s, 0, a, 3, true), -1);
    cr_assert_eq(ram_pinned(s, 0), 0, "none of the three");
    cache_stats st;
    cache_store_stats(s, &st);
    cr_assert_eq(st.ram.pinned, 0);
    cache_store_close(s);
}

Test(cache_pins, a_larger_share_lets_one_tenant_fill_the_cap) {
    int64_t now = T0;
    cache_store *s = open_store(NULL, 100, &now);
    for (int c = 0; c < 5; c++) put_chunk(s, 0, c, 2);
    cache_key a[5];
    for (int c = 0; c < 5; c++) a[c] = seq_key(0, 2 * c + 1);
    /* 100%: the whole cap (half the tier), as with one tenant; the cap still holds */
    cr_assert_eq(cache_store_pin(s, 0, a, 5, true), 4);
    cache_store_close(s);
}

Test(cache_pins, a_lease_passes_to_the_longer_record_with_its_tenant) {
    int64_t now = T0, bb = (int64_t)cache_block_bytes(&SMALL);
    cache_store *s = open_store(NULL, 0, &now);
    put_chunk(s, 1, 0, 1); /* the first block of tenant 1's chunk 0 */
    cache_key b0 = seq_key(1, 0);
    cr_assert_eq(cache_store_lease(s, 1, &b0, 1, now + 300), 1);
    cr_assert_eq(ram_pinned(s, 1), bb);
    put_chunk(s, 1, 0, 2); /* the whole chunk replaces it, leased for tenant 1 */
    cr_assert_eq(ram_pinned(s, 1), 2 * bb);
    cr_assert_eq(ram_pinned(s, 0), 0);
    cache_store_close(s);
}

Test(cache_pins, a_pin_with_an_expiry_is_a_lease_within_the_share) {
    int64_t now = T0;
    cache_key a[3];
    cache_store *s = store_of_three(&now, a);
    cr_assert_eq(cache_store_pin_until(s, 0, a, 3, now + 60), -1, "all or none, as a pin");
    cr_assert_eq(cache_store_pin_until(s, 0, a, 2, now + 60), 2);
    cr_assert_eq(cache_store_pin(s, 0, a, 2, false), 2, "unpinning leaves the lease");
    cache_pin_info pins[4];
    cr_assert_eq(cache_store_pins(s, pins, 4), 2);
    cr_assert_not(pins[0].manual);
    cr_assert_eq(pins[0].lease, T0 + 60);
    now = T0 + 61;
    cr_assert_eq(cache_store_pins(s, pins, 4), 0, "ended by itself");
    cr_assert_eq(ram_pinned(s, 0), 0);
    cache_store_close(s);
}

Test(cache_pins, the_disk_tier_keeps_shares_too) {
    int64_t now = T0, cb = (int64_t)cache_chunk_bytes(&SMALL);
    char *dir = tmpdir_create("kvserve-pins-test-");
    cache_store *s = open_store(dir, 0, &now);
    for (int c = 0; c < 3; c++) put_chunk(s, 0, c, 2);
    cache_store_flush(s);
    cache_key a[3] = {seq_key(0, 1), seq_key(0, 3), seq_key(0, 5)};
    cr_assert_eq(cache_store_pin(s, 0, a, 1, true), 1);
    cache_tenant_pins p;
    cache_store_tenant_pins(s, 0, &p);
    cr_assert_eq(p.disk, cb, "pinned on disk too");
    cr_assert_gt(p.disk_share, 0);
    cr_assert_leq(p.disk + cb, p.disk_share, "room for one more on disk");
    cache_store_close(s);
    free(dir);
}

Test(cache_pins, the_ledger_counts_tenants_apart) {
    pin_ledger l = {0};
    cr_assert_eq(pin_ledger_tenants(&l, 3, 0), 0);
    cr_assert_eq(pin_ledger_share(&l, 90), 30);
    cr_assert_eq(pin_ledger_check(&l, 0, 30, 90), PIN_OK);
    pin_ledger_add(&l, 0, 30);
    cr_assert_eq(pin_ledger_check(&l, 0, 1, 90), PIN_SHARE_FULL);
    cr_assert_eq(pin_ledger_check(&l, 1, 30, 90), PIN_OK);
    pin_ledger_add(&l, CACHE_TENANT_NONE, 50);
    cr_assert_eq(pin_ledger_check(&l, 1, 30, 90), PIN_TIER_FULL, "the cap before the share");
    cr_assert_eq(pin_ledger_of(&l, 0), 30);
    cr_assert_eq(pin_ledger_of(&l, 7), 0);
    cr_assert_eq(l.total, 80);
    pin_ledger_free(&l);
}

Test(cache_pins, a_record_held_for_no_tenant_becomes_the_tenants_that_holds_it_too) {
    pin_ledger l = {0};
    cr_assert_eq(pin_ledger_tenants(&l, 2, 0), 0); /* shares of 50 under a cap of 100 */
    int a = 0, b = 0;
    cr_assert_eq(pin_ledger_hold(&l, &a, false, CACHE_TENANT_NONE, 40, 100), PIN_OK);
    cr_assert_eq(a, CACHE_TENANT_NONE, "restored at start, say");
    cr_assert_eq(pin_ledger_need(&l, a, true, 1, 40), 40);
    cr_assert_eq(pin_ledger_hold(&l, &a, true, 1, 40, 100), PIN_OK);
    cr_assert_eq(a, 1, "its lease renewed: now tenant 1's");
    cr_assert_eq(pin_ledger_of(&l, 1), 40);
    cr_assert_eq(l.total, 40, "the total stays");
    cr_assert_eq(pin_ledger_need(&l, a, true, 1, 40), 0, "held already: no more bytes");
    cr_assert_eq(pin_ledger_hold(&l, &b, false, CACHE_TENANT_NONE, 30, 100), PIN_OK);
    cr_assert_eq(pin_ledger_hold(&l, &b, true, 1, 30, 100), PIN_SHARE_FULL, "past 50");
    cr_assert_eq(b, CACHE_TENANT_NONE);
    cr_assert_eq(l.total, 70);
    pin_ledger_free(&l);
}
