/* The chunk record format (cache/store/record.h): a 4096-byte header block, then the payload padded
 * to CACHE_ALIGN. Integers are little-endian whatever the host; checksums are SHA-256 (util's
 * kv_sha256, OpenSSL underneath). The parser reads a field only after
 * checking that len covers it, and names the first field that is wrong. */
#include <string.h>

#include "cache/store/record.h"

_Static_assert(CACHE_RECORD_MAX_LEVEL == CACHE_ENC_MAX - 1, "a record level per encoding");

static const uint8_t RECORD_MAGIC[8] = {'K', 'V', 'S', 'C', 'H', 'U', 'N', 'K'};

/* Field offsets (record.h's table). */
enum {
    OFF_MAGIC = 0,
    OFF_VERSION = 8,
    OFF_HEADER_BYTES = 12,
    OFF_MODEL = 16,
    OFF_KEY = 48,
    OFF_NS = 80,
    OFF_LAYOUT = 112, /* 5 x u32: n_layer, n_kv_head, head_dim, block_tokens, chunk_tokens */
    OFF_POS0 = 132,
    OFF_LEVEL = 136,
    OFF_TOKENS = 140,
    OFF_PAYLOAD_BYTES = 144,
    OFF_PAYLOAD_SHA = 152,
    OFF_HEADER_SHA = 184,
    OFF_BKEYS = 216, /* the block keys, then zero to the header's end */
};

/* The header's own checksum: every header byte but the checksum field. */
static int header_sha(const uint8_t *hdr, size_t header_bytes, uint8_t out[32]) {
    return kv_sha256_2(hdr, OFF_HEADER_SHA, hdr + OFF_BKEYS, header_bytes - OFF_BKEYS, out);
}

size_t cache_record_header_bytes(const cache_layout *l) {
    size_t keys = (size_t)OFF_BKEYS + (size_t)cache_chunk_blocks(l) * CACHE_KEY_BYTES;
    return (keys + CACHE_ALIGN - 1) / CACHE_ALIGN * CACHE_ALIGN;
}

size_t cache_record_file_bytes(const cache_layout *l, size_t payload_bytes) {
    size_t header = cache_record_header_bytes(l);
    /* Saturates instead of wrapping: a size no file can have never equals a real file's size. */
    if (payload_bytes > SIZE_MAX - header - CACHE_ALIGN) return SIZE_MAX;
    return header + (payload_bytes + CACHE_ALIGN - 1) / CACHE_ALIGN * CACHE_ALIGN;
}

void cache_record_encode_header(const cache_layout *l, const cache_chunk *c, uint8_t *hdr) {
    cache_record_encode_header_as(l, c, CACHE_RECORD_LEVEL_RAW, c->data, c->bytes, hdr);
}

void cache_record_encode_header_as(const cache_layout *l, const cache_chunk *c, uint32_t level,
                                   const uint8_t *payload, size_t payload_bytes, uint8_t *hdr) {
    size_t header_bytes = cache_record_header_bytes(l);
    memset(hdr, 0, header_bytes);
    memcpy(hdr + OFF_MAGIC, RECORD_MAGIC, sizeof RECORD_MAGIC);
    le_put_u32(hdr + OFF_VERSION, CACHE_RECORD_VERSION);
    le_put_u32(hdr + OFF_HEADER_BYTES, (uint32_t)header_bytes);
    memcpy(hdr + OFF_MODEL, l->model_id, 32);
    memcpy(hdr + OFF_KEY, c->key.b, CACHE_KEY_BYTES);
    memcpy(hdr + OFF_NS, c->ns.b, CACHE_KEY_BYTES);
    const int dims[5] = {l->n_layer, l->n_kv_head, l->head_dim, l->block_tokens, l->chunk_tokens};
    for (int i = 0; i < 5; i++) le_put_u32(hdr + OFF_LAYOUT + 4 * i, (uint32_t)dims[i]);
    le_put_u32(hdr + OFF_POS0, (uint32_t)c->pos0);
    le_put_u32(hdr + OFF_LEVEL, level);
    le_put_u32(hdr + OFF_TOKENS, (uint32_t)(c->n_blocks * l->block_tokens));
    le_put_u64(hdr + OFF_PAYLOAD_BYTES, payload_bytes);
    memcpy(hdr + OFF_BKEYS, c->bkeys, (size_t)c->n_blocks * CACHE_KEY_BYTES);
    /* A checksum that cannot be computed (OpenSSL out of memory) leaves zeros: the record then
     * fails its check when read and is dropped, which costs a miss and nothing else. */
    if (kv_sha256(payload, payload_bytes, hdr + OFF_PAYLOAD_SHA) != 0 ||
        header_sha(hdr, header_bytes, hdr + OFF_HEADER_SHA) != 0) {
        log_error("cache: SHA-256 failed while encoding a record header (out of memory)");
        memset(hdr + OFF_PAYLOAD_SHA, 0, 64);
    }
}

/* Fails unless buf holds end bytes: every field is read only after this check. */
static int need(size_t len, size_t end, const char *field, kv_error *err) {
    if (len >= end) return 0;
    return kv_fail(err, "cache record truncated: %zu bytes, %s needs %zu", len, field, end);
}

/* max_encoded: 0 accepts raw records only; else the largest payload an encoded one may have. */
static int decode_header(const uint8_t *buf, size_t len, const cache_layout *l, size_t max_encoded,
                         cache_record_info *out, kv_error *err) {
    if (need(len, OFF_MAGIC + 8, "magic", err)) return -1;
    if (memcmp(buf + OFF_MAGIC, RECORD_MAGIC, sizeof RECORD_MAGIC) != 0)
        return kv_fail(err, "not a cache record (bad magic)");
    if (need(len, OFF_VERSION + 4, "version", err)) return -1;
    uint32_t version = le_get_u32(buf + OFF_VERSION);
    if (version != CACHE_RECORD_VERSION)
        return kv_fail(err, "cache record version %u, expected %d", version, CACHE_RECORD_VERSION);
    if (need(len, OFF_HEADER_BYTES + 4, "header size", err)) return -1;
    size_t header_bytes = cache_record_header_bytes(l);
    uint32_t got_header = le_get_u32(buf + OFF_HEADER_BYTES);
    if (got_header != header_bytes)
        return kv_fail(err, "cache record header size %u, expected %zu", got_header, header_bytes);
    /* The whole header, so the zero tail can be checked too: a reader must not accept bytes it
     * does not understand. */
    if (need(len, header_bytes, "the header", err)) return -1;
    uint8_t sha[32];
    if (header_sha(buf, header_bytes, sha) != 0)
        return kv_fail(err, "cache record: SHA-256 failed (out of memory)");
    if (memcmp(sha, buf + OFF_HEADER_SHA, 32) != 0)
        return kv_fail(err, "cache record header checksum mismatch");
    if (memcmp(buf + OFF_MODEL, l->model_id, 32) != 0)
        return kv_fail(err, "cache record belongs to another model identity");
    static const char *const dim_names[5] = {"n_layer", "n_kv_head", "head_dim", "block_tokens",
                                             "chunk_tokens"};
    const int dims[5] = {l->n_layer, l->n_kv_head, l->head_dim, l->block_tokens, l->chunk_tokens};
    for (int i = 0; i < 5; i++) {
        uint32_t v = le_get_u32(buf + OFF_LAYOUT + 4 * i);
        if (v != (uint32_t)dims[i])
            return kv_fail(err, "cache record layout differs: %s %u, expected %d", dim_names[i], v,
                           dims[i]);
    }
    uint32_t level = le_get_u32(buf + OFF_LEVEL);
    if (level != CACHE_RECORD_LEVEL_RAW && (!max_encoded || level > CACHE_RECORD_MAX_LEVEL))
        return kv_fail(err, "cache record level %u is not supported", level);
    uint32_t n_tokens = le_get_u32(buf + OFF_TOKENS);
    if (n_tokens == 0 || n_tokens % (uint32_t)l->block_tokens ||
        n_tokens > (uint32_t)l->chunk_tokens)
        return kv_fail(err, "cache record of %u tokens: not 1 to %d whole blocks of %d", n_tokens,
                       cache_chunk_blocks(l), l->block_tokens);
    int n_blocks = (int)(n_tokens / (uint32_t)l->block_tokens);
    uint64_t payload = le_get_u64(buf + OFF_PAYLOAD_BYTES);
    uint64_t want = (uint64_t)cache_block_bytes(l) * (uint64_t)n_blocks;
    if (level != CACHE_RECORD_LEVEL_RAW) {
        if (payload == 0 || payload > max_encoded)
            return kv_fail(err, "encoded cache record payload of %llu bytes, at most %zu",
                           (unsigned long long)payload, max_encoded);
    } else if (payload != want)
        return kv_fail(err, "cache record payload size %llu, expected %llu",
                       (unsigned long long)payload, (unsigned long long)want);
    int32_t pos0 = (int32_t)le_get_u32(buf + OFF_POS0);
    if (pos0 < 0 || pos0 % l->chunk_tokens)
        return kv_fail(err, "cache record position %d is not a chunk start", (int)pos0);
    const uint8_t *bkeys = buf + OFF_BKEYS;
    if (memcmp(bkeys + (size_t)(n_blocks - 1) * CACHE_KEY_BYTES, buf + OFF_KEY, CACHE_KEY_BYTES))
        return kv_fail(err, "cache record key differs from its last block's key");
    for (size_t i = OFF_BKEYS + (size_t)n_blocks * CACHE_KEY_BYTES; i < header_bytes; i++)
        if (buf[i]) return kv_fail(err, "cache record header byte %zu not 0", i);

    memcpy(out->key.b, buf + OFF_KEY, CACHE_KEY_BYTES);
    memcpy(out->ns.b, buf + OFF_NS, CACHE_KEY_BYTES);
    out->pos0 = pos0;
    out->level = level;
    out->n_blocks = n_blocks;
    out->bkeys = bkeys;
    out->payload_bytes = payload;
    memcpy(out->payload_sha, buf + OFF_PAYLOAD_SHA, 32);
    return 0;
}

int cache_record_decode_header(const uint8_t *buf, size_t len, const cache_layout *l,
                               cache_record_info *out, kv_error *err) {
    return decode_header(buf, len, l, 0, out, err);
}

int cache_record_decode_header_encoded(const uint8_t *buf, size_t len, const cache_layout *l,
                                       size_t max_payload, cache_record_info *out, kv_error *err) {
    if (max_payload == 0) return kv_fail(err, "no room for an encoded payload");
    return decode_header(buf, len, l, max_payload, out, err);
}

int cache_record_check_payload(const cache_record_info *info, const uint8_t *payload,
                               kv_error *err) {
    uint8_t sha[32];
    if (kv_sha256(payload, (size_t)info->payload_bytes, sha) != 0)
        return kv_fail(err, "cache record: SHA-256 failed (out of memory)");
    if (memcmp(sha, info->payload_sha, 32) != 0)
        return kv_fail(err, "cache record payload checksum mismatch");
    return 0;
}
