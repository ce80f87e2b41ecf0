/* The chunk record format (cache/store/record.h): record round trips, every header field corrupted
 * (with and without a valid header checksum), another layout or model, truncation at every
 * length, encoded levels only where asked for, and payload bit flips. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "cache/store/record.h"
#include "tests/unit/chunk_fixture.h"
#include "tests/unit/disk_fixture.h"

/* Recomputes the header checksum (bytes 0..183 and 216..HEADER into 184..215), so a corrupted
 * field reaches the check that names it. */
static void reseal(uint8_t *hdr) {
    cr_assert_eq(kv_sha256_2(hdr, 184, hdr + 216, HEADER - 216, hdr + 184), 0);
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
