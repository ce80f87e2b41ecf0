/* The chunk record format and the disk tier: record round trips, every header field corrupted
 * (with and without a valid header checksum), truncation at every length and payload bit flips;
 * then the tier: write and read back, restart, corrupt / torn / vanished / foreign files, stray
 * temporary files, LRU eviction under a cap with pins (also the order rebuilt from mtimes at
 * open), clear by namespace (also of writes in flight), a full write queue, a full disk (a 64 KiB
 * tmpfs, when mounting is allowed), the pread/pwrite fallback (io_uring_setup blocked by seccomp)
 * and concurrent puts, reads and clears. Then the tier's encodings: each record kept in every
 * encoding, read as forced bit for bit, reindexed at open (another table's deleted, all deleted
 * when encodings are off), a damaged or vanished encoding falling back to the record, and the
 * encodings going with their record (clear, supersede, eviction); the store's encoded RAM tier. */
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

#include <openssl/evp.h>

#include "cache/chunk_codec.h"
#include "cache/disk.h"
#include "cache/record.h"
#include "tests/unit/chunk_fixture.h"
#include "tests/unit/tmpdir.h"

/* ---------------------------------------------------------------- helpers */

/* 2 layers, 1 KV head, head_dim 8, blocks of 16, chunks of 32: 2048 payload bytes, 8192-byte
 * files. */
static cache_layout small_layout(void) {
    cache_layout l = {
        .n_layer = 2, .n_kv_head = 1, .head_dim = 8, .block_tokens = 16, .chunk_tokens = 32};
    for (int i = 0; i < 32; i++) l.model_id[i] = (uint8_t)(0xA0 + i);
    return l;
}

#define PAYLOAD 2048
#define FILE_BYTES 8192
#define HEADER 4096 /* room for 2 block keys, rounded up to CACHE_ALIGN */

static cache_key make_ns(const char *salt) {
    cache_key ns;
    cache_namespace((const uint8_t *)"tenant", 6, salt, &ns);
    return ns;
}

/* The first n_blocks blocks of chunk i of namespace ns: block keys from tokens i*1000.., a
 * payload from a seed of (i, ns). */
static cache_chunk *make_part(const cache_layout *l, const cache_key *ns, int i, int n_blocks) {
    int32_t tokens[128];
    cache_key bkeys[8];
    cr_assert_leq(l->chunk_tokens, 128);
    for (int t = 0; t < l->chunk_tokens; t++) tokens[t] = i * 1000 + t;
    int nb = cache_prefix_keys(l->model_id, ns, tokens, l->chunk_tokens, l->block_tokens, bkeys, 8);
    cr_assert_leq(n_blocks, nb);
    cache_chunk *c = cache_chunk_create(l, bkeys, n_blocks, ns, i * l->chunk_tokens);
    cr_assert_not_null(c);
    chunk_fill(c, 0x9E3779B97F4A7C15ull * (uint64_t)(i + 1) ^ ns->b[0]);
    return c;
}

static cache_chunk *make_chunk(const cache_layout *l, const cache_key *ns, int i) {
    return make_part(l, ns, i, cache_chunk_blocks(l));
}

static char *make_tmpdir(void) { return tmpdir_create("kvserve-disk-test-"); }

static int rm_one(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)flag, (void)ftw;
    return remove(path);
}

static void remove_tree(char *dir) {
    nftw(dir, rm_one, 16, FTW_DEPTH | FTW_PHYS);
    free(dir);
}

/* dir/<16 hex of the model>[/name] */
static void model_path(const char *dir, const cache_layout *l, const char *name, char *out,
                       size_t n) {
    cache_key m;
    memcpy(m.b, l->model_id, 32);
    char hex[65];
    cache_key_hex(&m, hex);
    snprintf(out, n, "%s/%.16s%s%s", dir, hex, name ? "/" : "", name ? name : "");
}

static void record_path(const char *dir, const cache_layout *l, const cache_key *k, char *out,
                        size_t n) {
    char hex[65], name[80];
    cache_key_hex(k, hex);
    snprintf(name, sizeof name, "%s.kvc", hex);
    model_path(dir, l, name, out, n);
}

static bool file_exists(const char *path) {
    struct stat sb;
    return stat(path, &sb) == 0;
}

/* Files in the model directory whose names end with suffix. */
static int count_files(const char *dir, const cache_layout *l, const char *suffix) {
    char path[512];
    model_path(dir, l, NULL, path, sizeof path);
    DIR *dp = opendir(path);
    cr_assert_not_null(dp, "cannot list %s", path);
    int n = 0;
    struct dirent *de;
    while ((de = readdir(dp))) {
        size_t a = strlen(de->d_name), b = strlen(suffix);
        n += a >= b && strcmp(de->d_name + a - b, suffix) == 0;
    }
    closedir(dp);
    return n;
}

static cache_disk *open_disk(const char *dir, const cache_layout *l, int64_t cap, int wq) {
    kv_error err = {{0}};
    cache_disk *d = cache_disk_open(dir, l, cap, wq, &err);
    cr_assert_not_null(d, "cache_disk_open: %s", err.msg);
    return d;
}

static cache_tier_stats stats(cache_disk *d) {
    cache_tier_stats st;
    cache_disk_stats(d, &st);
    return st;
}

static void put_ok(cache_disk *d, cache_chunk *c) {
    cr_assert(cache_disk_put(d, c), "put refused");
}

/* Reads one key; the chunk (or NULL). */
static cache_chunk *read_one(cache_disk *d, const cache_key *k) {
    cache_chunk *out = NULL;
    cache_disk_read(d, k, 1, &out);
    return out;
}

static void write_file(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f, "cannot create %s", path);
    cr_assert_eq(fwrite(data, 1, n, f), n);
    fclose(f);
}

static void flip_byte(const char *path, off_t off) {
    int fd = open(path, O_RDWR);
    cr_assert_geq(fd, 0, "cannot open %s", path);
    uint8_t b;
    cr_assert_eq(pread(fd, &b, 1, off), 1);
    b ^= 0x10;
    cr_assert_eq(pwrite(fd, &b, 1, off), 1);
    close(fd);
}

/* ---------------------------------------------------------------- record format */

/* Recomputes the header checksum (bytes 0..183 and 216..HEADER into 184..215), so a corrupted
 * field reaches the check that names it. */
static void reseal(uint8_t *hdr) {
    unsigned int n = 0;
    EVP_MD_CTX *md = EVP_MD_CTX_new();
    cr_assert(md && EVP_DigestInit_ex(md, EVP_sha256(), NULL) == 1 &&
              EVP_DigestUpdate(md, hdr, 184) == 1 &&
              EVP_DigestUpdate(md, hdr + 216, HEADER - 216) == 1 &&
              EVP_DigestFinal_ex(md, hdr + 184, &n) == 1 && n == 32);
    EVP_MD_CTX_free(md);
}

static void encode(const cache_layout *l, const cache_chunk *c, uint8_t *hdr) {
    cache_record_encode_header(l, c, hdr);
}

Test(record, round_trip) {
    cache_layout l = small_layout();
    cache_key ns = make_ns("salt");
    cache_chunk *c = make_chunk(&l, &ns, 7);
    static uint8_t hdr[HEADER];
    encode(&l, c, hdr);
    cr_assert_eq(memcmp(hdr, "KVSCHUNK", 8), 0);
    cr_assert_eq(hdr[8], CACHE_RECORD_VERSION);
    cr_assert_eq(hdr[12] | hdr[13] << 8, HEADER, "header size little-endian");
    cache_record_info info;
    kv_error err = {{0}};
    cr_assert_eq(cache_record_decode_header(hdr, sizeof hdr, &l, &info, &err), 0, "%s", err.msg);
    cr_assert_eq(memcmp(info.key.b, c->key.b, 32), 0);
    cr_assert_eq(memcmp(info.ns.b, ns.b, 32), 0);
    cr_assert_eq(info.pos0, 7 * 32);
    cr_assert_eq(info.level, CACHE_RECORD_LEVEL_RAW);
    cr_assert_eq(info.payload_bytes, PAYLOAD);
    cr_assert_eq(cache_record_check_payload(&info, c->data, &err), 0, "%s", err.msg);
    /* Encoding is deterministic. */
    static uint8_t again[HEADER];
    encode(&l, c, again);
    cr_assert_eq(memcmp(hdr, again, sizeof hdr), 0);

    cr_assert_eq(info.n_blocks, 2);
    cr_assert_eq(memcmp(info.bkeys, c->bkeys, 2 * 32), 0);
    cr_assert_eq(cache_record_header_bytes(&l), HEADER);
    cr_assert_eq(cache_record_file_bytes(&l, 0), 4096);
    cr_assert_eq(cache_record_file_bytes(&l, 1), 8192);
    cr_assert_eq(cache_record_file_bytes(&l, PAYLOAD), FILE_BYTES);
    cr_assert_eq(cache_record_file_bytes(&l, 4096), 8192);
    cr_assert_eq(cache_record_file_bytes(&l, 4097), 12288);
    cr_assert_eq(cache_record_file_bytes(&l, SIZE_MAX), SIZE_MAX, "saturates, never wraps");
    /* A layout of 256 blocks per chunk lists 256 keys: a header of three pages. */
    cache_layout big = l;
    big.chunk_tokens = 256 * 16;
    cr_assert_eq(cache_record_header_bytes(&big), 12288);
    cr_assert_leq(cache_record_header_bytes(&big), CACHE_RECORD_MAX_HEADER);
    cache_chunk_unref(c);
}

typedef struct field_case {
    const char *name;
    size_t off;
    uint8_t xor_byte;
    const char *msg_unsealed; /* expected in the message without a new header checksum */
    const char *msg_sealed;   /* with one; NULL: the header is then accepted */
} field_case;

Test(record, every_header_field_is_checked) {
    cache_layout l = small_layout();
    cache_key ns = make_ns(NULL);
    cache_chunk *c = make_chunk(&l, &ns, 1);
    static const field_case cases[] = {
        {"magic", 0, 0x01, "magic", "magic"},
        {"magic end", 7, 0x20, "magic", "magic"},
        {"version", 8, 0x03, "version", "version"},
        {"version high byte", 11, 0x80, "version", "version"},
        {"header size", 12, 0x01, "header size", "header size"},
        {"model identity", 16, 0x01, "checksum", "model"},
        {"model identity end", 47, 0x01, "checksum", "model"},
        {"key", 48, 0x01, "checksum", "last block"},
        {"namespace", 80, 0x01, "checksum", NULL},
        {"n_layer", 112, 0x01, "checksum", "n_layer"},
        {"n_kv_head", 116, 0x04, "checksum", "n_kv_head"},
        {"head_dim", 120, 0x01, "checksum", "head_dim"},
        {"block_tokens", 124, 0x10, "checksum", "block_tokens"},
        {"chunk_tokens", 128, 0x40, "checksum", "chunk_tokens"},
        {"chunk_tokens high", 131, 0x01, "checksum", "chunk_tokens"},
        {"pos0 sign", 135, 0x80, "checksum", "chunk start"},
        {"pos0 inside a chunk", 132, 0x01, "checksum", "chunk start"},
        {"level", 136, 0x01, "checksum", "level"},
        {"tokens: not whole blocks", 140, 0x01, "checksum", "whole blocks"},
        {"tokens: more than a chunk", 140, 0x40, "checksum", "whole blocks"},
        {"payload bytes", 144, 0x01, "checksum", "payload size"},
        {"payload bytes high", 151, 0x01, "checksum", "payload size"},
        {"payload checksum", 152, 0x01, "checksum", NULL},
        {"header checksum", 184, 0x01, "checksum", "checksum"},
        {"header checksum end", 215, 0x01, "checksum", "checksum"},
        {"first block key", 216, 0x01, "checksum", NULL},
        {"last block key", 279, 0x01, "checksum", "last block"},
        {"zero tail", 280, 0x01, "checksum", "not 0"},
        {"zero tail end", 4095, 0x01, "checksum", "not 0"},
    };
    static uint8_t good[HEADER], bad[HEADER];
    encode(&l, c, good);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const field_case *fc = &cases[i];
        cache_record_info info;
        kv_error err = {{0}};
        memcpy(bad, good, sizeof bad);
        bad[fc->off] ^= fc->xor_byte;
        cr_assert_eq(cache_record_decode_header(bad, sizeof bad, &l, &info, &err), -1,
                     "%s corrupted, checksum stale: accepted", fc->name);
        cr_assert_not_null(strstr(err.msg, fc->msg_unsealed), "%s: got \"%s\"", fc->name, err.msg);
        if (fc->off >= 184 && fc->off < 216) continue; /* resealing would undo it */
        reseal(bad);
        memset(&err, 0, sizeof err);
        int r = cache_record_decode_header(bad, sizeof bad, &l, &info, &err);
        if (fc->msg_sealed) {
            cr_assert_eq(r, -1, "%s corrupted, checksum resealed: accepted", fc->name);
            cr_assert_not_null(strstr(err.msg, fc->msg_sealed), "%s: got \"%s\"", fc->name,
                               err.msg);
        } else {
            /* Data fields: the header parses, and what it says is what was corrupted. */
            cr_assert_eq(r, 0, "%s: %s", fc->name, err.msg);
            if (fc->off == 152)
                cr_assert_eq(cache_record_check_payload(&info, c->data, &err), -1,
                             "a wrong payload checksum must fail the payload check");
            else
                cr_assert(memcmp(info.key.b, c->key.b, 32) || memcmp(info.ns.b, ns.b, 32) ||
                          memcmp(info.bkeys, c->bkeys, 2 * 32));
        }
    }
    cache_chunk_unref(c);
}

Test(record, other_layout_or_model_is_refused) {
    cache_layout l = small_layout();
    cache_key ns = make_ns(NULL);
    cache_chunk *c = make_chunk(&l, &ns, 2);
    static uint8_t hdr[HEADER];
    encode(&l, c, hdr);
    cache_record_info info;
    kv_error err = {{0}};
    cache_layout other = l;
    other.head_dim = 16;
    cr_assert_eq(cache_record_decode_header(hdr, sizeof hdr, &other, &info, &err), -1);
    cr_assert_not_null(strstr(err.msg, "head_dim"), "%s", err.msg);
    other = l;
    other.model_id[31] ^= 1;
    cr_assert_eq(cache_record_decode_header(hdr, sizeof hdr, &other, &info, &err), -1);
    cr_assert_not_null(strstr(err.msg, "model"), "%s", err.msg);
    cache_chunk_unref(c);
}

Test(record, truncated_header_is_refused_at_every_length) {
    cache_layout l = small_layout();
    cache_key ns = make_ns(NULL);
    cache_chunk *c = make_chunk(&l, &ns, 3);
    static uint8_t hdr[HEADER];
    encode(&l, c, hdr);
    for (size_t len = 0; len < HEADER; len++) {
        /* A copy of exactly len bytes, so ASan sees any read past it. */
        uint8_t *cut = malloc(len ? len : 1);
        memcpy(cut, hdr, len);
        cache_record_info info;
        kv_error err = {{0}};
        cr_assert_eq(cache_record_decode_header(cut, len, &l, &info, &err), -1,
                     "%zu bytes accepted", len);
        cr_assert_not_null(strstr(err.msg, "truncated"), "%zu bytes: %s", len, err.msg);
        free(cut);
    }
    cache_chunk_unref(c);
}

Test(record, encoded_levels_only_where_asked_for) {
    cache_layout l = small_layout();
    cache_key ns = make_ns(NULL);
    cache_chunk *c = make_chunk(&l, &ns, 4);
    static uint8_t hdr[HEADER];
    const uint8_t payload[100] = {1, 2, 3};
    cache_record_encode_header_as(&l, c, 3, payload, sizeof payload, hdr);
    cache_record_info info;
    kv_error err = {{0}};
    /* the disk tier's parser takes raw records only */
    cr_assert_eq(cache_record_decode_header(hdr, sizeof hdr, &l, &info, &err), -1);
    cr_assert_not_null(strstr(err.msg, "level 3"), "%s", err.msg);
    cr_assert_eq(cache_record_decode_header_encoded(hdr, sizeof hdr, &l, 100, &info, &err), 0, "%s",
                 err.msg);
    cr_assert_eq(info.level, 3);
    cr_assert_eq(info.payload_bytes, 100);
    cr_assert_eq(cache_record_check_payload(&info, payload, &err), 0, "%s", err.msg);
    cr_assert_eq(cache_record_decode_header_encoded(hdr, sizeof hdr, &l, 99, &info, &err), -1);
    cache_record_encode_header_as(&l, c, CACHE_RECORD_MAX_LEVEL + 1, payload, sizeof payload, hdr);
    cr_assert_eq(cache_record_decode_header_encoded(hdr, sizeof hdr, &l, 100, &info, &err), -1);
    /* a raw record's payload size is still exact */
    cache_record_encode_header_as(&l, c, CACHE_RECORD_LEVEL_RAW, payload, sizeof payload, hdr);
    cr_assert_eq(cache_record_decode_header_encoded(hdr, sizeof hdr, &l, 1 << 20, &info, &err), -1);
    cache_chunk_unref(c);
}

Test(record, payload_bit_flips_fail_the_check) {
    cache_layout l = small_layout();
    cache_key ns = make_ns(NULL);
    cache_chunk *c = make_chunk(&l, &ns, 4);
    static uint8_t hdr[HEADER];
    encode(&l, c, hdr);
    cache_record_info info;
    kv_error err = {{0}};
    cr_assert_eq(cache_record_decode_header(hdr, sizeof hdr, &l, &info, &err), 0);
    for (size_t bit = 0; bit < 8 * (size_t)PAYLOAD; bit += 61) {
        c->data[bit / 8] ^= (uint8_t)(1u << (bit % 8));
        cr_assert_eq(cache_record_check_payload(&info, c->data, &err), -1, "bit %zu", bit);
        cr_assert_not_null(strstr(err.msg, "payload checksum"), "%s", err.msg);
        c->data[bit / 8] ^= (uint8_t)(1u << (bit % 8));
    }
    cr_assert_eq(cache_record_check_payload(&info, c->data, &err), 0);
    cache_chunk_unref(c);
}

/* ---------------------------------------------------------------- disk tier */

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
    cr_assert_eq(cache_disk_pin(d, &part->key, 1, true), 1);
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
    cr_assert_eq(cache_disk_pin(d, &c[2]->key, 1, true), 1);
    cr_assert_eq(cache_disk_pin(d, &c[1]->key, 1, true), 0, "an evicted key is not held");
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
    cr_assert_eq(cache_disk_pin(d, pin_keys, 2, true), 0);
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
    cr_assert_eq(cache_disk_pin(d, &c[0]->key, 1, true), 1);
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

/* ---------------------------------------------------------------- encodings */

/* A sidecar: a 4096-byte header and an encoded payload padded to 4096. */
#define ENC_PAYLOAD 4096

static cache_disk *open_enc(const char *dir, const cache_layout *l, int64_t cap,
                            const codec_table *t) {
    kv_error err = {{0}};
    cache_disk *d = cache_disk_open_enc(dir, l, cap, 16, t, true, &err);
    cr_assert_not_null(d, "cache_disk_open_enc: %s", err.msg);
    return d;
}

/* Chunk i of ns with a KV-like payload (codecs code it as they would KV). */
static cache_chunk *kv_chunk(const cache_layout *l, const cache_key *ns, int i) {
    cache_chunk *c = make_chunk(l, ns, i);
    chunk_fill_kv(c, l, (uint64_t)(7 + i));
    return c;
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
    cr_assert_eq(cache_disk_pin(d, &c->key, 1, true), 1, "pinned while it is written");
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
