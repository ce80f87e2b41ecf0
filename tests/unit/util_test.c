/* util's randomness (kv_random): what ids and secrets are drawn from, never a clock; and a
 * tenant's share of a budget (kv_tenant_share). */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "util/util.h"

Test(util, random_bytes_fill_the_buffer_and_differ_between_draws) {
    uint8_t a[64], b[64], zero[64] = {0};
    cr_assert_eq(kv_random(a, sizeof a), 0);
    cr_assert_eq(kv_random(b, sizeof b), 0);
    cr_assert_neq(memcmp(a, b, sizeof a), 0, "two draws of 512 bits never agree");
    cr_assert_neq(memcmp(a, zero, sizeof a), 0);
    cr_assert_eq(kv_random(NULL, 0), 0, "nothing asked, nothing drawn");
    /* past what one getrandom call gives from the pool at once: the short reads are continued */
    size_t n = (size_t)40 << 20;
    uint8_t *big = calloc(n, 1);
    cr_assert_not_null(big);
    cr_assert_eq(kv_random(big, n), 0);
    size_t tail_zero = 0;
    for (size_t i = n - 4096; i < n; i++) tail_zero += big[i] == 0;
    cr_assert_lt(tail_zero, 64, "the last page is filled too (%zu zero bytes)", tail_zero);
    free(big);
}

Test(util, a_tenants_share_is_a_part_of_the_total) {
    cr_assert_eq(kv_tenant_share(100, 0, 1, 0), 100, "one tenant: all of it");
    cr_assert_eq(kv_tenant_share(100, 25, 1, 0), 100);
    cr_assert_eq(kv_tenant_share(100, 0, 3, 0), 33, "an equal part");
    cr_assert_eq(kv_tenant_share(100, 50, 3, 0), 50);
    cr_assert_eq(kv_tenant_share(5, 10, 4, 1), 1, "at least min");
    cr_assert_eq(kv_tenant_share(0, 10, 4, 1), 0, "never more than the total");
    cr_assert_eq(kv_tenant_share(INT64_C(1) << 62, 100, 2, 0), INT64_C(1) << 62, "no overflow");
}
