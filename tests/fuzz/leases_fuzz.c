/* libFuzzer target for the disk tier's leases file parser (cache/store/leases.h): any bytes either
 * parse into leases with positive expiries whose file, encoded again, is the same bytes, or fail
 * with a message and nothing handed out. Seeds: tests/fuzz/corpus/leases_fuzz/. */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/store/leases.h"
#include "tests/fuzz/fuzz_check.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    cache_lease *l;
    int n;
    kv_error err = {{0}};
    if (cache_leases_parse(data, size, &l, &n, &err) != 0) {
        CHECK(l == NULL && n == 0 && err.msg[0]);
        return 0;
    }
    CHECK(n >= 0 && n <= CACHE_LEASES_MAX && (n == 0) == (l == NULL));
    for (int i = 0; i < n; i++) CHECK(l[i].until > 0);
    size_t bytes = cache_leases_bytes(n);
    CHECK(bytes == size);
    uint8_t *again = malloc(bytes);
    CHECK(again && cache_leases_encode(l, n, again) == 0);
    CHECK(memcmp(again, data, size) == 0);
    free(again);
    free(l);
    return 0;
}
