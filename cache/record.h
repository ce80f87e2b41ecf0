/* The chunk record format on disk (internal to cache/). A record is a header block of
 * CACHE_RECORD_HEADER bytes followed by the payload padded to CACHE_ALIGN:
 *
 *   offset  size  field
 *   0       8     magic "KVSCHUNK"
 *   8       4     format version (CACHE_RECORD_VERSION), little-endian like every integer
 *   12      4     header bytes (CACHE_RECORD_HEADER)
 *   16      32    model identity
 *   48      32    chunk key (prefix key)
 *   80      32    namespace
 *   112     4x5   n_layer, n_kv_head, head_dim, block_tokens, chunk_tokens
 *   132     4     pos0: position of the first token (K is rotated at pos0 + i)
 *   136     4     level: 0 = raw f16 in pool-block layout (codec levels come with CacheGen)
 *   140     4     reserved, 0
 *   144     8     payload bytes
 *   152     32    SHA-256 of the payload
 *   184     32    SHA-256 of bytes 0..183 (the header's own checksum)
 *   216..         zero
 *
 * Parsers check every field before trusting it; tests/fuzz/record_fuzz.c fuzzes the parser. */
#ifndef KVSERVE_CACHE_RECORD_H
#define KVSERVE_CACHE_RECORD_H

#include "cache/cache.h"

#define CACHE_RECORD_HEADER 4096
#define CACHE_RECORD_VERSION 1
#define CACHE_RECORD_LEVEL_RAW 0

typedef struct cache_record_info {
    cache_key key;
    cache_key ns;
    int32_t pos0;
    uint32_t level;
    uint64_t payload_bytes;
    uint8_t payload_sha[32];
} cache_record_info;

/* Bytes of the whole record file for a payload of payload_bytes (header + padded payload). */
size_t cache_record_file_bytes(size_t payload_bytes);
/* Fills hdr[CACHE_RECORD_HEADER] for chunk c under layout l (hashes c's payload). */
void cache_record_encode_header(const cache_layout *l, const cache_chunk *c,
                                uint8_t hdr[CACHE_RECORD_HEADER]);
/* Parses and checks a header: magic, version, header size, that len covers the whole header
 * block, header checksum, model identity and layout equal to l's, level, reserved field 0,
 * payload size equal to cache_chunk_bytes(l), pos0 >= 0, bytes 216.. zero. -1 with err naming
 * the first problem. len is how many bytes buf holds. */
int cache_record_decode_header(const uint8_t *buf, size_t len, const cache_layout *l,
                               cache_record_info *out, kv_error *err);
/* Checks a payload against the header's checksum; -1 with err on mismatch. payload holds
 * info->payload_bytes bytes (info from cache_record_decode_header, which bounds that size). */
int cache_record_check_payload(const cache_record_info *info, const uint8_t *payload,
                               kv_error *err);

#endif
