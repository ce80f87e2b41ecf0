/* cache/store/content.c: content records in RAM. The content store keeps the most recently used
 * records under its byte cap and clears one namespace's records, leaving the others'. (Records
 * on disk: content_disk_test.c; the fusor that reads them: blend_test.c.) */
#include <criterion/criterion.h>

#include "cache/store/content.h"

Test(content, the_store_evicts_least_recently_used_and_clears_by_namespace) {
    cache_key k[3] = {{{1}}, {{2}}, {{3}}}, ns1 = {{9}}, ns2 = {{8}};
    content_rec *r[3];
    for (int i = 0; i < 3; i++) r[i] = content_rec_create(2, 8, 10, &k[i], i == 2 ? &ns2 : &ns1, 0);
    /* room for two */
    content_store *s = content_store_create((int64_t)r[0]->bytes * 2);
    content_store_put(s, r[0]);
    content_store_put(s, r[1]);
    content_rec *got = content_store_get(s, &k[0]); /* r[0] becomes the most recent */
    cr_assert_eq(got, r[0]);
    content_rec_unref(got);
    content_store_put(s, r[2]); /* evicts r[1] */
    cr_expect(content_store_has(s, &k[0]));
    cr_expect_not(content_store_has(s, &k[1]));
    cr_expect(content_store_has(s, &k[2]));
    cr_expect_eq(content_store_clear(s, &ns1), 1);
    cr_expect_not(content_store_has(s, &k[0]));
    cr_expect(content_store_has(s, &k[2]));
    cache_tier_stats st;
    content_store_stats(s, &st);
    cr_expect_eq(st.entries, 1);
    cr_expect_eq(st.evictions, 1);
    content_store_destroy(s);
    for (int i = 0; i < 3; i++) content_rec_unref(r[i]);
}
