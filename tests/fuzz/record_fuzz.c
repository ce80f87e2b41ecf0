/* libFuzzer target for the chunk record parser (cache/record.c) under a fixed layout (2 layers,
 * 1 KV head, head_dim 8, blocks of 16, chunks of 32: a 2048-byte payload). Each input is
 *   1. decoded as it is (a copy of exactly size bytes, so ASan sees any read past len);
 *   2. decoded again after repairs chosen by the input's last byte: bit 0 writes a valid magic,
 *      version and header size, bit 1 the layout's model identity, bit 2 its dimensions and
 *      payload size, bit 3 zeroes the level, reserved field and tail, bit 4 writes the checksum
 *      of the payload that follows (when there is one); then the header checksum is recomputed,
 *      so the checks behind the checksums are reached without guessing SHA-256.
 * Whenever a header is accepted: its fields must be in range, and when the payload that follows
 * it passes its checksum, re-encoding the decoded record must give back the input header byte
 * for byte (a version-1 header has one valid encoding). Any violation aborts. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/evp.h>

#include "cache/record.h"

static cache_layout fuzz_layout(void) {
    cache_layout l = {
        .n_layer = 2, .n_kv_head = 1, .head_dim = 8, .block_tokens = 16, .chunk_tokens = 32};
    for (int i = 0; i < 32; i++) l.model_id[i] = (uint8_t)(0x5A ^ i);
    return l;
}

static void put_u32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static void check(const uint8_t *buf, size_t len, const cache_layout *l) {
    cache_record_info info;
    kv_error err = {{0}};
    if (cache_record_decode_header(buf, len, l, &info, &err) != 0) {
        if (!err.msg[0]) abort(); /* every refusal names its reason */
        return;
    }
    if (len < CACHE_RECORD_HEADER || info.payload_bytes != cache_chunk_bytes(l) || info.pos0 < 0 ||
        info.level != CACHE_RECORD_LEVEL_RAW)
        abort();
    if (len - CACHE_RECORD_HEADER < info.payload_bytes) return;
    const uint8_t *payload = buf + CACHE_RECORD_HEADER;
    if (cache_record_check_payload(&info, payload, &err) != 0) return;
    cache_chunk *c = cache_chunk_create(l, &info.key, &info.ns, info.pos0);
    if (!c) abort();
    memcpy(c->data, payload, c->bytes);
    uint8_t *again = malloc(CACHE_RECORD_HEADER);
    if (!again) abort();
    cache_record_encode_header(l, c, again);
    if (memcmp(again, buf, CACHE_RECORD_HEADER) != 0) abort();
    free(again);
    cache_chunk_unref(c);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    cache_layout l = fuzz_layout();
    uint8_t *buf = malloc(size ? size : 1);
    if (!buf) return 0;
    if (size) memcpy(buf, data, size);
    check(buf, size, &l);

    /* 2. Repaired and resealed (only when the whole header is there to reseal). */
    if (size >= CACHE_RECORD_HEADER) {
        uint8_t flags = data[size - 1];
        if (flags & 1) {
            memcpy(buf, "KVSCHUNK", 8);
            put_u32(buf + 8, CACHE_RECORD_VERSION);
            put_u32(buf + 12, CACHE_RECORD_HEADER);
        }
        if (flags & 2) memcpy(buf + 16, l.model_id, 32);
        if (flags & 4) {
            const int dims[5] = {l.n_layer, l.n_kv_head, l.head_dim, l.block_tokens,
                                 l.chunk_tokens};
            for (int i = 0; i < 5; i++) put_u32(buf + 112 + 4 * i, (uint32_t)dims[i]);
            uint64_t payload = cache_chunk_bytes(&l);
            for (int i = 0; i < 8; i++) buf[144 + i] = (uint8_t)(payload >> (8 * i));
        }
        if (flags & 8) {
            memset(buf + 136, 0, 8);
            memset(buf + 216, 0, CACHE_RECORD_HEADER - 216);
        }
        unsigned int n = 0;
        size_t payload = cache_chunk_bytes(&l);
        if ((flags & 16) && size - CACHE_RECORD_HEADER >= payload &&
            EVP_Digest(buf + CACHE_RECORD_HEADER, payload, buf + 152, &n, EVP_sha256(), NULL) != 1)
            abort();
        if (EVP_Digest(buf, 184, buf + 184, &n, EVP_sha256(), NULL) != 1) abort();
        check(buf, size, &l);
    }
    free(buf);
    return 0;
}
