/* Chunk records for the store tiers' unit tests (cache_disk_test, cache_redis_test). */
#ifndef KVSERVE_CHUNK_FIXTURE_H
#define KVSERVE_CHUNK_FIXTURE_H

#include <stdint.h>

#include "cache/cache.h"
#include "cache/codec/codec.h"

/* Fills c's payload with xorshift64 bytes from seed: equal seeds, equal payloads. */
void chunk_fill(cache_chunk *c, uint64_t seed);

/* KV-like values: element (layer, kv, token, chan) of sequence seed, a channel's own centre and
 * spread plus noise (what a codec table calibrates on and codes well). */
float chunk_kv_value(int layer, int kv, int pos, int chan, uint64_t seed);
/* Fills c's payload (layout l's pool blocks) with chunk_kv_value, tokens at c->pos0 + t, through
 * the CPU backend's KV writer (kernels/backend.h owns the layout). */
void chunk_fill_kv(cache_chunk *c, const cache_layout *l, uint64_t seed);
/* The K (kv 0) or V rows of one layer of c's payload through the backend's KV reader: out
 * [tokens][n_kv_head * head_dim] f32. */
void chunk_kv_rows(const cache_chunk *c, const cache_layout *l, int layer, int kv, float *out);
/* A codec table for layout l (its model identity and shape; no RoPE, no protected tokens), levels
 * with bins scaled by coarse (1: the finest here), calibrated on four chunks of chunk_kv_value
 * of seed. */
void chunk_codec_table(codec_table *t, const cache_layout *l, float coarse, uint64_t seed);

/* What c becomes through encoding enc (cache/codec/chunk_codec.h) and back, computed here. */
cache_chunk *chunk_coded_copy(const cache_layout *l, const codec_table *t, int enc,
                              const cache_chunk *c);

/* Fails the test unless got (not NULL) equals want: keys, blocks, namespace, position, payload. */
void chunk_assert_same(const cache_chunk *got, const cache_chunk *want);

#endif
