/* The file format of the content records' disk tier (cache/store/content.h; internal to cache/:
 * content_disk.c writes and reads it, redis.c stores records in it, tests/fuzz/content_disk_fuzz.c
 * fuzzes the parser):
 *
 *   offset  size  field (integers little-endian)
 *   0       8     magic "KVSBLEND"
 *   8       4     format version (CONTENT_RECORD_VERSION)
 *   12      4     header bytes: 168 + 32 * n_layer
 *   16      32    model identity
 *   48      32    content key (also the file's name, <hex>.kvb)
 *   80      32    namespace
 *   112     4x4   n_layer, kv_dim, n_tok, pos0 (K was rotated at pos0 + i)
 *   128     8     layer bytes: 2 * n_tok * kv_dim f16 (the layer's K rows, then its V rows)
 *   136     32    SHA-256 of the header without this field (bytes 0..135 and 168..end)
 *   168     32xL  SHA-256 of each layer's bytes
 *   then    the layers, back to back
 *
 * Each layer carries its own checksum so that a reader going layer by layer (the fusor's
 * loader, as the forward pass reaches each layer) finds damage at the layer where it is. */
#ifndef KVSERVE_CACHE_CONTENT_DISK_H
#define KVSERVE_CACHE_CONTENT_DISK_H

#include "cache/store/content.h"

#define CONTENT_RECORD_VERSION 1
/* The most tokens a content record holds (content-defined chunks are far smaller). */
#define CONTENT_RECORD_MAX_TOKENS 4096

typedef struct content_record_info {
    cache_key key;
    cache_key ns;
    int32_t pos0;
    int n_tok;
    int64_t file_bytes;
    const uint8_t *layer_sha; /* [n_layer][32] inside the header buffer (valid while it is) */
} content_record_info;

size_t content_record_header_bytes(int n_layer);
size_t content_record_layer_bytes(int kv_dim, int n_tok);
/* Fills hdr[content_record_header_bytes(r->n_layer)] for r (hashes its layers). -1 when
 * hashing fails. */
int content_record_encode_header(const uint8_t model_id[32], const content_rec *r, uint8_t *hdr);
/* Checks hdr[0..len), the start of a file of file_bytes named for key, against this model and
 * layout: magic, version, header size, header checksum, model identity, the key, dimensions, a
 * token count of 1..CONTENT_RECORD_MAX_TOKENS, pos0 range, layer size, the file's size. Reads a
 * field only after checking that len covers it. -1 with err naming the first failure. */
int content_record_check_header(const uint8_t model_id[32], int n_layer, int kv_dim,
                                const uint8_t *hdr, size_t len, int64_t file_bytes,
                                const cache_key *key, content_record_info *out, kv_error *err);

/* A whole record in memory (buf[0..len): the header, then the layers, as in a file) under key:
 * checked as a file is (content_record_check_header, then every layer's checksum) into a record
 * of its own (the Redis tier's copies of content records). NULL with err. */
content_rec *content_record_parse(const uint8_t model_id[32], int n_layer, int kv_dim,
                                  const uint8_t *buf, size_t len, const cache_key *key,
                                  kv_error *err);

#endif
