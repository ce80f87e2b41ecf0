/* Encodings of a chunk record's payload for the tier that moves records over a network (Redis;
 * internal to cache/). A chunk travels in one of:
 *
 *   id  name       what
 *   0   lossless   the raw f16 pool blocks (cache/cache.h), as RAM and disk hold them
 *   1   q8         8-bit per-token uniform quantization (CacheGen's baseline; codec_quant.h)
 *   2+L codecL     the CacheGen codec at the table's level L (cache/codec/codec.h)
 *
 * The id is the record header's level field (cache/store/record.h), so an encoded record carries
 * the same checked header as a raw one, and its payload is the encoded bytes. A codec payload names
 * its table (the bitstream's header), and decoding refuses a table other than the reader's, so
 * a record written under another table is refused, never decoded wrongly.
 *
 * Encoders and decoders convert between the pool's block layout and the codec's
 * [layer][kv][token][channel] order through a caller's f32 scratch of cache_enc_scratch_floats
 * elements; a chunk's K is given rotated at pos0 + t, as the codec expects. */
#ifndef KVSERVE_CACHE_CHUNK_CODEC_H
#define KVSERVE_CACHE_CHUNK_CODEC_H

#include "cache/cache.h"
#include "cache/codec/codec.h"

/* The ids are cache.h's CACHE_ENC_*. */

/* How many encodings a tier offers: lossless and q8, then every level of t (NULL: none). */
int cache_enc_count(const codec_table *t);
/* -1 with err unless t (when not NULL) codes l's shape: n_layer layers of n_kv_head * head_dim
 * channels, and chunks of l's size. */
int cache_enc_check_table(const cache_layout *l, const codec_table *t, kv_error *err);

/* f32 elements of the scratch an encode or decode of a full chunk needs. */
size_t cache_enc_scratch_floats(const cache_layout *l);
/* Bytes enough for any payload of an n_blocks-block chunk in encoding enc (0: enc unknown or
 * needs the table t lacks). */
size_t cache_enc_bound(const cache_layout *l, const codec_table *t, int enc, int n_blocks);

/* Writes x (f32 [layer][kv][token][channel], c's tokens) into c's payload as pool blocks. */
void cache_enc_from_f32(const cache_layout *l, const float *x, cache_chunk *c);
/* Encodes c's payload as enc into out[0..cap): returns the length, or -1 with err. */
int64_t cache_enc_encode(const cache_layout *l, const codec_table *t, int enc, const cache_chunk *c,
                         float *scratch, uint8_t *out, size_t cap, kv_error *err);
/* Decodes in[0..len), a payload of encoding enc for chunk c (its n_blocks and pos0 set), into
 * c's payload; n_threads decode a codec bitstream's layers. -1 with err when the payload is not
 * a valid encoding of c's shape and position (wrong length, table, token count or position). */
int cache_enc_decode(const cache_layout *l, const codec_table *t, int enc, const uint8_t *in,
                     size_t len, cache_chunk *c, float *scratch, int n_threads, kv_error *err);

#endif
