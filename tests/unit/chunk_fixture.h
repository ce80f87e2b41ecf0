/* Chunk records for the store tiers' unit tests (cache_disk_test, cache_redis_test). */
#ifndef KVSERVE_CHUNK_FIXTURE_H
#define KVSERVE_CHUNK_FIXTURE_H

#include <stdint.h>

#include "cache/cache.h"

/* Fills c's payload with xorshift64 bytes from seed: equal seeds, equal payloads. */
void chunk_fill(cache_chunk *c, uint64_t seed);

/* Fails the test unless got (not NULL) equals want: keys, blocks, namespace, position, payload. */
void chunk_assert_same(const cache_chunk *got, const cache_chunk *want);

#endif
