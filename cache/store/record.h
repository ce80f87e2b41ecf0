/* The chunk record format (internal to cache/store/: the disk and Redis tiers write and read it;
 * the codec encodes its payload without seeing the header, chunk_codec.h's encoding ids being
 * its level field). A record is a header of cache_record_header_bytes(layout) bytes (a multiple
 * of CACHE_ALIGN: 4096 up to 120 blocks per chunk) followed by the payload padded to CACHE_ALIGN:
 *
 *   offset  size  field
 *   0       8     magic "KVSCHUNK"
 *   8       4     format version (CACHE_RECORD_VERSION), little-endian like every integer
 *   12      4     header bytes (cache_record_header_bytes of the layout)
 *   16      32    model identity
 *   48      32    record key (the prefix key of its last block)
 *   80      32    namespace
 *   112     4x5   n_layer, n_kv_head, head_dim, block_tokens, chunk_tokens
 *   132     4     pos0: position of the first token (K is rotated at pos0 + i), a multiple of
 *                 chunk_tokens
 *   136     4     level: 0 = raw f16 in pool-block layout; 1 .. CACHE_RECORD_MAX_LEVEL =
 *                 the payload is that encoding of it (cache/codec/chunk_codec.h), only in
 *                 the Redis tier and the disk tier's encodings beside a record
 *   140     4     n_tokens: tokens held, whole blocks, 1 block .. chunk_tokens
 *   144     8     payload bytes (n_tokens / block_tokens pool blocks; encoded: its length)
 *   152     32    SHA-256 of the payload
 *   184     32    SHA-256 of the rest of the header: bytes 0..183 and 216..header bytes
 *   216     32xN  the prefix keys of its N = n_tokens / block_tokens blocks (the last is the
 *                 record key): a prompt that diverges inside the chunk finds the record by
 *                 the key of its last shared block
 *   ...           zero to the header's end
 *
 * Version 1 (chunk-chained keys, whole chunks only) records are refused: their keys can never
 * match a version-2 lookup, so the disk tier deletes them at open.
 *
 * Parsers check every field before trusting it; tests/fuzz/record_fuzz.c fuzzes the parser. */
#ifndef KVSERVE_CACHE_RECORD_H
#define KVSERVE_CACHE_RECORD_H

#include "cache/cache.h"

#define CACHE_RECORD_VERSION 2
#define CACHE_RECORD_LEVEL_RAW 0
#define CACHE_RECORD_MAX_LEVEL 9 /* CACHE_ENC_MAX - 1 (cache/codec/chunk_codec.h) */
/* The largest header any layout has (CACHE_MAX_CHUNK_BLOCKS keys). */
#define CACHE_RECORD_MAX_HEADER 12288

typedef struct cache_record_info {
    cache_key key;
    cache_key ns;
    int32_t pos0;
    uint32_t level;
    int n_blocks;
    const uint8_t *bkeys; /* [n_blocks][32] inside the decoded buffer (valid while it is) */
    uint64_t payload_bytes;
    uint8_t payload_sha[32];
} cache_record_info;

/* Bytes of the header under layout l: room for a whole chunk's block keys, rounded up to
 * CACHE_ALIGN. */
size_t cache_record_header_bytes(const cache_layout *l);
/* Bytes of the whole record file for a payload of payload_bytes (header + padded payload). */
size_t cache_record_file_bytes(const cache_layout *l, size_t payload_bytes);
/* Fills hdr[cache_record_header_bytes(l)] for chunk c under layout l (hashes c's payload). */
void cache_record_encode_header(const cache_layout *l, const cache_chunk *c, uint8_t *hdr);
/* The same with level as the record's level and payload[0..payload_bytes) as its payload (an
 * encoding of c's). */
void cache_record_encode_header_as(const cache_layout *l, const cache_chunk *c, uint32_t level,
                                   const uint8_t *payload, size_t payload_bytes, uint8_t *hdr);
/* Parses and checks a header: magic, version, header size, that len covers the whole header,
 * header checksum, model identity and layout equal to l's, level, token count (whole blocks, at
 * most a chunk), payload size equal to its blocks' bytes, pos0 >= 0 and a multiple of
 * chunk_tokens, the last block key equal to the record key, the bytes after the keys zero. -1
 * with err naming the first problem. len is how many bytes buf holds. */
int cache_record_decode_header(const uint8_t *buf, size_t len, const cache_layout *l,
                               cache_record_info *out, kv_error *err);
/* The same, also accepting encoded records (levels 1 .. CACHE_RECORD_MAX_LEVEL) whose payload
 * is 1 .. max_payload bytes (max_payload > 0); the payload's decoder checks the rest. */
int cache_record_decode_header_encoded(const uint8_t *buf, size_t len, const cache_layout *l,
                                       size_t max_payload, cache_record_info *out, kv_error *err);
/* Checks a payload against the header's checksum; -1 with err on mismatch. payload holds
 * info->payload_bytes bytes (info from cache_record_decode_header, which bounds that size). */
int cache_record_check_payload(const cache_record_info *info, const uint8_t *payload,
                               kv_error *err);

#endif
