/* libFuzzer target for the chunk record parser (cache/store/record.c) under a fixed layout (2
 * layers, 1 KV head, head_dim 8, blocks of 16, chunks of 32: up to 2 blocks of 1024 payload bytes,
 * a 4096-byte header). Each input is
 *   1. decoded as it is (a copy of exactly size bytes, so ASan sees any read past len);
 *   2. decoded again after repairs chosen by the input's last byte: bit 0 writes a valid magic,
 *      version and header size, bit 1 the layout's model identity, bit 2 its dimensions and a
 *      token count with its payload size (1 block, or 2 with bit 5), bit 3 zeroes the level and
 *      the tail after the block keys, makes pos0 a chunk start and the record key the last block
 *      key, bit 4 writes the checksum of the payload that follows (when there is one); then the
 *      header checksum is recomputed, so the checks behind the checksums are reached without
 *      guessing SHA-256.
 * Each is also given to the encoded-record parser, whose accepted headers must be in range.
 * Whenever a header is accepted: its fields must be in range, and when the payload that follows
 * it passes its checksum, re-encoding the decoded record must give back the input header byte
 * for byte (a header has one valid encoding). Any violation aborts. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cache/store/record.h"

static cache_layout fuzz_layout(void) {
    cache_layout l = {
        .n_layer = 2, .n_kv_head = 1, .head_dim = 8, .block_tokens = 16, .chunk_tokens = 32};
    for (int i = 0; i < 32; i++) l.model_id[i] = (uint8_t)(0x5A ^ i);
    return l;
}

static void put_u32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

/* The parser for the Redis tier's encoded records: whatever it accepts is in range. */
static void check_encoded(const uint8_t *buf, size_t len, const cache_layout *l) {
    cache_record_info info;
    kv_error err = {{0}};
    if (cache_record_decode_header_encoded(buf, len, l, 4096, &info, &err) != 0) {
        if (!err.msg[0]) abort();
        return;
    }
    if (info.n_blocks < 1 || info.n_blocks > cache_chunk_blocks(l) ||
        info.level > CACHE_RECORD_MAX_LEVEL ||
        (info.level == CACHE_RECORD_LEVEL_RAW
             ? info.payload_bytes != cache_block_bytes(l) * (size_t)info.n_blocks
             : info.payload_bytes < 1 || info.payload_bytes > 4096))
        abort();
}

static void check(const uint8_t *buf, size_t len, const cache_layout *l) {
    size_t header = cache_record_header_bytes(l);
    cache_record_info info;
    kv_error err = {{0}};
    check_encoded(buf, len, l);
    if (cache_record_decode_header(buf, len, l, &info, &err) != 0) {
        if (!err.msg[0]) abort(); /* every refusal names its reason */
        return;
    }
    if (len < header || info.n_blocks < 1 || info.n_blocks > cache_chunk_blocks(l) ||
        info.payload_bytes != cache_block_bytes(l) * (size_t)info.n_blocks || info.pos0 < 0 ||
        info.pos0 % l->chunk_tokens || info.level != CACHE_RECORD_LEVEL_RAW ||
        memcmp(info.bkeys + 32 * (size_t)(info.n_blocks - 1), info.key.b, 32) != 0)
        abort();
    if (len - header < info.payload_bytes) return;
    const uint8_t *payload = buf + header;
    if (cache_record_check_payload(&info, payload, &err) != 0) return;
    cache_chunk *c = cache_chunk_create(l, (const cache_key *)(const void *)info.bkeys,
                                        info.n_blocks, &info.ns, info.pos0);
    if (!c) abort();
    memcpy(c->data, payload, c->bytes);
    uint8_t *again = malloc(header);
    if (!again) abort();
    cache_record_encode_header(l, c, again);
    if (memcmp(again, buf, header) != 0) abort();
    free(again);
    cache_chunk_unref(c);
}

/* The header checksum: bytes 0..183 and 216..header. */
static void reseal(uint8_t *buf, size_t header) {
    if (kv_sha256_2(buf, 184, buf + 216, header - 216, buf + 184) != 0) abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    cache_layout l = fuzz_layout();
    size_t header = cache_record_header_bytes(&l);
    uint8_t *buf = malloc(size ? size : 1);
    if (!buf) return 0;
    if (size) memcpy(buf, data, size);
    check(buf, size, &l);

    /* 2. Repaired and resealed (only when the whole header is there to reseal). */
    if (size >= header) {
        uint8_t flags = data[size - 1];
        int n_blocks = flags & 32 ? 2 : 1;
        size_t payload = cache_block_bytes(&l) * (size_t)n_blocks;
        if (flags & 1) {
            memcpy(buf, "KVSCHUNK", 8);
            put_u32(buf + 8, CACHE_RECORD_VERSION);
            put_u32(buf + 12, (uint32_t)header);
        }
        if (flags & 2) memcpy(buf + 16, l.model_id, 32);
        if (flags & 4) {
            const int dims[5] = {l.n_layer, l.n_kv_head, l.head_dim, l.block_tokens,
                                 l.chunk_tokens};
            for (int i = 0; i < 5; i++) put_u32(buf + 112 + 4 * i, (uint32_t)dims[i]);
            put_u32(buf + 140, (uint32_t)(n_blocks * l.block_tokens));
            for (int i = 0; i < 8; i++) buf[144 + i] = (uint8_t)((uint64_t)payload >> (8 * i));
        }
        if (flags & 8) {
            memset(buf + 136, 0, 4);
            put_u32(buf + 132, (uint32_t)(buf[132] % 4) * (uint32_t)l.chunk_tokens);
            memcpy(buf + 48, buf + 216 + 32 * (n_blocks - 1), 32);
            size_t keys_end = 216 + 32 * (size_t)n_blocks;
            memset(buf + keys_end, 0, header - keys_end);
        }
        if ((flags & 16) && size - header >= payload && kv_sha256(buf + header, payload, buf + 152))
            abort();
        reseal(buf, header);
        check(buf, size, &l);
    }
    free(buf);
    return 0;
}
