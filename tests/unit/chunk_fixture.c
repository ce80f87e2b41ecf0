/* Chunk records for the store tiers' unit tests (chunk_fixture.h). */
#include "tests/unit/chunk_fixture.h"

#include <criterion/criterion.h>
#include <string.h>

void chunk_fill(cache_chunk *c, uint64_t seed) {
    uint64_t s = seed;
    for (size_t b = 0; b < c->bytes; b++) {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        c->data[b] = (uint8_t)(s >> 32);
    }
}

void chunk_assert_same(const cache_chunk *got, const cache_chunk *want) {
    cr_assert_not_null(got);
    cr_assert_eq(memcmp(got->key.b, want->key.b, CACHE_KEY_BYTES), 0);
    cr_assert_eq(got->n_blocks, want->n_blocks);
    cr_assert_eq(memcmp(got->bkeys, want->bkeys, sizeof(cache_key) * (size_t)want->n_blocks), 0);
    cr_assert_eq(memcmp(got->ns.b, want->ns.b, CACHE_KEY_BYTES), 0);
    cr_assert_eq(got->pos0, want->pos0);
    cr_assert_eq(got->bytes, want->bytes);
    cr_assert_eq(memcmp(got->data, want->data, want->bytes), 0, "payload differs");
}
