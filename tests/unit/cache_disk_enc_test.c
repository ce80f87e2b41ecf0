/* The disk tier's encodings (cache/store/disk.h, cache_disk_open_enc): each record kept in every
 * encoding, read as forced bit for bit, reindexed at open (another table's deleted, all deleted
 * when encodings are off), a damaged or vanished encoding falling back to the record, and the
 * encodings going with their record (clear, supersede, eviction); then the store's encoded RAM
 * tier, which reads the disk for exact fetches. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cache/codec/chunk_codec.h"
#include "cache/store/disk.h"
#include "cache/store/record.h"
#include "tests/unit/chunk_fixture.h"
#include "tests/unit/disk_fixture.h"

/* A sidecar: a 4096-byte header and an encoded payload padded to 4096. */
#define ENC_PAYLOAD 4096

static cache_disk *open_enc(const char *dir, const cache_layout *l, int64_t cap,
                            const codec_table *t) {
    kv_error err = {{0}};
    cache_disk *d = cache_disk_open_enc(dir, l, cap, 16, t, true, &err);
    cr_assert_not_null(d, "cache_disk_open_enc: %s", err.msg);
    return d;
}

/* The file of c's record in encoding enc (a name as the tier writes it). */
static void enc_path(const char *dir, const cache_layout *l, const codec_table *t,
                     const cache_key *k, int enc, char *out, size_t n) {
    char hex[65], name[100];
    cache_key_hex(k, hex);
    if (enc < CACHE_ENC_CODEC)
        snprintf(name, sizeof name, "%s.e%d.kvc", hex, enc);
    else
        snprintf(name, sizeof name, "%s.e%d-%02x%02x%02x%02x.kvc", hex, enc, t->id[0], t->id[1],
                 t->id[2], t->id[3]);
    model_path(dir, l, name, out, n);
}

/* Reads record k with encoding force (CACHE_ENC_*) forced: the chunk; the encoding it came in
 * into *enc. */
static cache_chunk *read_forced(cache_disk *d, const cache_key *k, int force, uint8_t *enc) {
    cache_fetch_policy p = {.force_enc = force};
    cache_chunk *got = NULL;
    *enc = 0xff;
    cache_disk_read_enc(d, k, 1, &p, &got, enc);
    return got;
}

/* Reads c[0..n) with encoding e forced, for every e of t: each comes in e, bit for bit what e
 * makes of it. */
static void read_each_encoding(cache_disk *d, const cache_layout *l, const codec_table *t,
                               cache_chunk **c, int n) {
    for (int e = 0; e < cache_enc_count(t); e++) {
        for (int i = 0; i < n; i++) {
            uint8_t enc;
            cache_chunk *got = read_forced(d, &c[i]->key, e, &enc);
            cr_assert_eq(enc, e, "chunk %d came as %d, not %d", i, enc, e);
            cache_chunk *want = chunk_coded_copy(l, t, e, c[i]);
            chunk_assert_same(got, want);
            if (e == CACHE_ENC_RAW) chunk_assert_same(got, c[i]);
            cache_chunk_unref(want);
            cache_chunk_unref(got);
        }
    }
}

Test(disk, encodings_are_kept_read_as_asked_and_reindexed_at_open) {
    char *dir = make_tmpdir();
    cache_layout l = small_layout();
    cache_key ns = make_ns(NULL);
    codec_table t, other;
    chunk_codec_table(&t, &l, 1, 3);
    chunk_codec_table(&other, &l, 1.5f, 3);
    int n_enc = cache_enc_count(&t);
    cr_assert_gt(n_enc, 3);
    cache_disk *d = open_enc(dir, &l, 1 << 20, &t);
    cache_chunk *c[2] = {kv_chunk(&l, &ns, 0), kv_chunk(&l, &ns, 1)};
    for (int i = 0; i < 2; i++) put_ok(d, c[i]);
    cache_disk_flush(d);
    int64_t all = 2 * PAYLOAD + 2 * (n_enc - 1) * ENC_PAYLOAD;
    cr_assert_eq(count_files(dir, &l, ".kvc"), 2 * n_enc, "a file per record and encoding");
    cr_assert_eq(stats(d).bytes, all, "the encodings count towards the cap");
    read_each_encoding(d, &l, &t, c, 2);
    cache_tier_stats st = stats(d);
    for (int e = 0; e < n_enc; e++) cr_assert_eq(st.enc_hits[e], 2);
    /* a policy with no budget, or insisting on exact KV, reads the records */
    cache_fetch_policy plain = {.force_enc = CACHE_ENC_ANY},
                       strict = {.force_enc = CACHE_ENC_ANY, .lossless = true, .budget_ns = 1};
    for (int k = 0; k < 2; k++) {
        cache_chunk *got = NULL;
        uint8_t enc = 0xff;
        cache_disk_read_enc(d, &c[0]->key, 1, k ? &strict : &plain, &got, &enc);
        cr_assert_eq(enc, CACHE_ENC_RAW);
        chunk_assert_same(got, c[0]);
        cache_chunk_unref(got);
    }
    cache_disk_close(d);

    /* Reopened with the same table: every encoding indexed again. */
    d = open_enc(dir, &l, 1 << 20, &t);
    cr_assert_eq(stats(d).entries, 2);
    cr_assert_eq(stats(d).bytes, all);
    read_each_encoding(d, &l, &t, c, 2);
    cache_disk_close(d);

    /* With another table: its levels' files are another table's, deleted; q8 stays. */
    d = open_enc(dir, &l, 1 << 20, &other);
    cr_assert_eq(count_files(dir, &l, ".kvc"), 2 * 2);
    cr_assert_eq(stats(d).bytes, 2 * PAYLOAD + 2 * ENC_PAYLOAD);
    cr_assert_eq(stats(d).corrupt, 0);
    uint8_t enc;
    cache_chunk *got = read_forced(d, &c[0]->key, CACHE_ENC_CODEC, &enc);
    cr_assert_eq(enc, CACHE_ENC_RAW, "no level of this table: the record");
    chunk_assert_same(got, c[0]);
    cache_chunk_unref(got);
    cache_disk_close(d);

    /* Without encodings: only the records stay (and files named otherwise, left alone). */
    char stray[512], hex[65], name[100];
    cache_key_hex(&c[0]->key, hex);
    snprintf(name, sizeof name, "%s.e1.notes.kvc", hex);
    model_path(dir, &l, name, stray, sizeof stray);
    write_file(stray, "x", 1);
    d = open_disk(dir, &l, 1 << 20, 16);
    cr_assert(file_exists(stray), "not a name the tier writes: left alone");
    cr_assert_eq(unlink(stray), 0);
    cr_assert_eq(count_files(dir, &l, ".kvc"), 2);
    cr_assert_eq(stats(d).bytes, 2 * PAYLOAD);
    cache_disk_close(d);
    for (int i = 0; i < 2; i++) cache_chunk_unref(c[i]);
    codec_table_free(&t);
    codec_table_free(&other);
    remove_tree(dir);
}

Test(disk, damaged_or_vanished_encoding_falls_back_to_the_record) {
    char *dir = make_tmpdir();
    cache_layout l = small_layout();
    cache_key ns = make_ns(NULL);
    codec_table t;
    chunk_codec_table(&t, &l, 1, 3);
    cache_disk *d = open_enc(dir, &l, 1 << 20, &t);
    cache_chunk *c = kv_chunk(&l, &ns, 0);
    put_ok(d, c);
    cache_disk_flush(d);
    int64_t bytes = stats(d).bytes;
    char q8[512], lvl[512];
    enc_path(dir, &l, &t, &c->key, CACHE_ENC_Q8, q8, sizeof q8);
    enc_path(dir, &l, &t, &c->key, CACHE_ENC_CODEC, lvl, sizeof lvl);
    cr_assert(file_exists(q8) && file_exists(lvl));
    flip_byte(q8, HEADER + 10);
    cr_assert_eq(unlink(lvl), 0);
    for (int e = CACHE_ENC_Q8; e <= CACHE_ENC_CODEC; e++) {
        uint8_t enc;
        cache_chunk *got = read_forced(d, &c->key, e, &enc);
        cr_assert_eq(enc, CACHE_ENC_RAW, "encoding %d failed: the record instead", e);
        chunk_assert_same(got, c);
        cache_chunk_unref(got);
    }
    cache_tier_stats st = stats(d);
    cr_assert_eq(st.corrupt, 1, "the flipped file, not the vanished one");
    cr_assert_eq(st.entries, 1, "the record and its other encodings stay");
    cr_assert_eq(st.bytes, bytes - 2 * ENC_PAYLOAD);
    cr_assert_not(file_exists(q8), "the damaged encoding is deleted");
    /* the others still serve */
    uint8_t enc;
    cache_chunk *got = read_forced(d, &c->key, CACHE_ENC_CODEC + 1, &enc);
    cr_assert_eq(enc, CACHE_ENC_CODEC + 1);
    cache_chunk *want = chunk_coded_copy(&l, &t, CACHE_ENC_CODEC + 1, c);
    chunk_assert_same(got, want);
    cache_chunk_unref(want);
    cache_chunk_unref(got);
    cache_disk_close(d);
    cache_chunk_unref(c);
    codec_table_free(&t);
    remove_tree(dir);
}

Test(disk, a_pinned_records_encodings_keep_pins_within_half_the_tier) {
    char *dir = make_tmpdir();
    cache_layout l = small_layout();
    cache_key ns = make_ns(NULL);
    codec_table t;
    chunk_codec_table(&t, &l, 1, 3);
    /* half the tier holds the pinned record, not its encodings as well */
    cache_disk *d = open_enc(dir, &l, 4 * ENC_PAYLOAD, &t);
    cache_chunk *c = kv_chunk(&l, &ns, 0);
    put_ok(d, c);
    cr_assert_eq(cache_disk_pin(d, CACHE_TENANT_NONE, &c->key, 1, true, 0), 1,
                 "pinned while it is written");
    cache_disk_flush(d);
    cache_tier_stats st = stats(d);
    cr_assert_eq(st.pinned, 1);
    cr_assert_eq(st.bytes, PAYLOAD, "the encodings were not indexed");
    cr_assert_eq(count_files(dir, &l, ".kvc"), 1, "and their files were deleted");
    uint8_t enc;
    cache_chunk *got = read_forced(d, &c->key, CACHE_ENC_Q8, &enc);
    cr_assert_eq(enc, CACHE_ENC_RAW);
    chunk_assert_same(got, c);
    cache_chunk_unref(got);
    cache_disk_close(d);
    cache_chunk_unref(c);
    codec_table_free(&t);
    remove_tree(dir);
}

Test(disk, encodings_go_with_their_record) {
    char *dir = make_tmpdir();
    cache_layout l = small_layout();
    cache_key ns = make_ns(NULL);
    codec_table t;
    chunk_codec_table(&t, &l, 1, 3);
    int n_enc = cache_enc_count(&t);
    int64_t rec = PAYLOAD + (n_enc - 1) * ENC_PAYLOAD; /* a whole record's bytes */
    cache_disk *d = open_enc(dir, &l, 2 * rec + rec / 2, &t);
    /* superseded: a record of the chunk's first block, then the whole chunk */
    cache_chunk *part = make_part(&l, &ns, 0, 1);
    chunk_fill_kv(part, &l, 7);
    put_ok(d, part);
    cache_disk_flush(d);
    cr_assert_eq(count_files(dir, &l, ".kvc"), n_enc);
    cache_chunk *c[3] = {kv_chunk(&l, &ns, 0), kv_chunk(&l, &ns, 1), kv_chunk(&l, &ns, 2)};
    put_ok(d, c[0]);
    cache_disk_flush(d);
    cr_assert_eq(count_files(dir, &l, ".kvc"), n_enc, "the part's encodings went with it");
    char p[512];
    enc_path(dir, &l, &t, &part->key, CACHE_ENC_Q8, p, sizeof p);
    cr_assert_not(file_exists(p));
    /* evicted: a third record over a cap of two and a half */
    for (int i = 1; i < 3; i++) {
        put_ok(d, c[i]);
        cache_disk_flush(d);
    }
    cache_tier_stats st = stats(d);
    cr_assert_eq(st.entries, 2);
    cr_assert_eq(st.bytes, 2 * rec);
    cr_assert_eq(count_files(dir, &l, ".kvc"), 2 * n_enc, "the evicted record's went with it");
    enc_path(dir, &l, &t, &c[0]->key, CACHE_ENC_Q8, p, sizeof p);
    cr_assert_not(file_exists(p));
    /* cleared */
    cr_assert_eq(cache_disk_clear(d, &ns), 2);
    cr_assert_eq(count_files(dir, &l, ".kvc"), 0);
    cr_assert_eq(stats(d).bytes, 0);
    cache_disk_close(d);
    for (int i = 0; i < 3; i++) cache_chunk_unref(c[i]);
    cache_chunk_unref(part);
    codec_table_free(&t);
    remove_tree(dir);
}

/* ---------------------------------------------------------------- the store's encoded RAM tier */

/* Fetches c's record (its blocks' keys) from s under policy p: the chunk, its source in *src. */
static cache_chunk *store_get(cache_store *s, const cache_chunk *c, const cache_fetch_policy *p,
                              cache_fetch_src *src) {
    cache_chunk *out = NULL;
    int n = 0, n_text = 0;
    int covered = cache_store_fetch(s, c->bkeys, 0, c->n_blocks, p, &out, src, 1, &n, &n_text);
    cr_assert_eq(n, 1);
    cr_assert_eq(covered, c->n_blocks);
    return out;
}

Test(store, encoded_ram_serves_its_level_and_exact_fetches_read_disk) {
    char *dir = make_tmpdir();
    cache_layout l = small_layout();
    cache_key ns = make_ns(NULL);
    codec_table t;
    chunk_codec_table(&t, &l, 1, 3);
    cache_store_opts o = {.ram_bytes = 1 << 20,
                          .dir = dir,
                          .disk_bytes = 1 << 20,
                          .codec = &t,
                          .ram_enc = CACHE_ENC_CODEC + 1};
    kv_error err = {{0}};
    cache_store *s = cache_store_open(&l, &o, &err);
    cr_assert_not_null(s, "%s", err.msg);
    cache_chunk *c = kv_chunk(&l, &ns, 0);
    cache_store_put(s, c);
    cache_store_flush(s); /* the disk write, and the RAM tier's encoding */
    cache_stats st;
    cache_store_stats(s, &st);
    cr_assert_eq(st.ram.entries, 1);
    cr_assert_lt(st.ram.bytes, PAYLOAD / 2, "RAM holds the level: %lld bytes",
                 (long long)st.ram.bytes);
    /* any fetch takes the level from RAM, decoded */
    cache_fetch_src src = {0};
    cache_fetch_policy any = {.force_enc = CACHE_ENC_ANY};
    cache_chunk *got = store_get(s, c, &any, &src);
    cr_assert_eq(src.tier, CACHE_TIER_RAM);
    cr_assert_eq(src.enc, CACHE_ENC_CODEC + 1);
    cache_chunk *want = chunk_coded_copy(&l, &t, CACHE_ENC_CODEC + 1, c);
    chunk_assert_same(got, want);
    cache_chunk_unref(want);
    cache_chunk_unref(got);
    /* one insisting on exact KV (or with no policy) reads the record on disk, and does not
     * bring it into RAM over the level */
    cache_fetch_policy exact[2] = {{.force_enc = CACHE_ENC_ANY, .lossless = true},
                                   {.force_enc = CACHE_ENC_RAW}};
    cache_store_stats(s, &st);
    int64_t ram_hits = st.ram.hits;
    for (int k = 0; k < 3; k++) {
        got = store_get(s, c, k < 2 ? &exact[k] : NULL, &src);
        cr_assert_eq(src.tier, CACHE_TIER_DISK);
        cr_assert_eq(src.enc, CACHE_ENC_RAW);
        chunk_assert_same(got, c);
        cache_chunk_unref(got);
    }
    cache_store_stats(s, &st);
    cr_assert_eq(st.ram.entries, 1);
    cr_assert_lt(st.ram.bytes, PAYLOAD / 2);
    cr_assert_eq(st.ram.hits, ram_hits, "an encoding passed over is no RAM hit");
    cache_store_close(s);
    /* a level the table lacks is refused at open */
    o.ram_enc = CACHE_ENC_CODEC + t.n_levels;
    cr_assert_null(cache_store_open(&l, &o, &err));
    cr_assert(strstr(err.msg, "codec table"), "%s", err.msg);
    cache_chunk_unref(c);
    codec_table_free(&t);
    remove_tree(dir);
}