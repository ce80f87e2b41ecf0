/* server/engine/fairq.h: the engine's queue shared between tenants. Tenants with work waiting
 * take turns; within a tenant, first come first served; a tenant's lane is bounded by its share
 * and the queue by its total; a group's next request waits behind its own tenant's entries; a
 * head that is not admitted keeps its tenant's turn. */
#include <criterion/criterion.h>

#include "server/engine/fairq.h"

static int ITEMS[256];

/* Admits n heads in turn, writing their item indices to out. */
static void admit(fairq *q, int n, int *out) {
    for (int k = 0; k < n; k++) {
        int t = -1;
        int *item = fairq_peek(q, &t);
        cr_assert_not_null(item);
        out[k] = (int)(item - ITEMS);
        fairq_pop(q, t, true, NULL);
    }
}

Test(fairq, a_burst_does_not_delay_another_tenants_single_request) {
    fairq q;
    cr_assert_eq(fairq_init(&q, 2, 128, 64), 0);
    for (int i = 0; i < 60; i++) cr_assert_eq(fairq_push(&q, 0, &ITEMS[i]), FAIRQ_OK);
    admit(&q, 1, (int[1]){0}); /* tenant 0's first, then the other arrives */
    cr_assert_eq(fairq_push(&q, 1, &ITEMS[100]), FAIRQ_OK);
    int got[4];
    admit(&q, 4, got);
    cr_assert_eq(got[0], 100, "the other tenant's turn comes next");
    cr_assert_eq(got[1], 1, "then tenant 0's, in order");
    cr_assert_eq(got[2], 2);
    cr_assert_eq(got[3], 3);
    cr_assert_eq(fairq_total(&q), 56);
    fairq_free(&q);
}

Test(fairq, tenants_with_work_take_turns_in_order) {
    fairq q;
    cr_assert_eq(fairq_init(&q, 3, 16, 8), 0);
    for (int i = 0; i < 3; i++) fairq_push(&q, 0, &ITEMS[i]);
    for (int i = 10; i < 12; i++) fairq_push(&q, 2, &ITEMS[i]);
    int got[5];
    admit(&q, 5, got);
    int want[5] = {0, 10, 1, 11, 2};
    for (int k = 0; k < 5; k++) cr_assert_eq(got[k], want[k], "at %d", k);
    int t;
    cr_assert_null(fairq_peek(&q, &t));
    fairq_free(&q);
}

Test(fairq, a_tenants_share_and_the_total_bound_the_queue) {
    fairq q;
    cr_assert_eq(fairq_init(&q, 3, 5, 3), 0);
    for (int i = 0; i < 3; i++) cr_assert_eq(fairq_push(&q, 0, &ITEMS[i]), FAIRQ_OK);
    cr_assert_eq(fairq_push(&q, 0, &ITEMS[3]), FAIRQ_TENANT_FULL);
    cr_assert_eq(fairq_room(&q, 1), FAIRQ_OK, "another tenant still gets in");
    cr_assert_eq(fairq_push(&q, 1, &ITEMS[4]), FAIRQ_OK);
    cr_assert_eq(fairq_push(&q, 2, &ITEMS[5]), FAIRQ_OK);
    cr_assert_eq(fairq_push(&q, 2, &ITEMS[6]), FAIRQ_FULL);
    cr_assert_eq(fairq_len(&q, 0), 3);
    cr_assert_eq(fairq_total(&q), 5);
    fairq_free(&q);
    cr_assert_eq(fairq_init(&q, 2, 4, 5), -1, "a share beyond the total");
    cr_assert_eq(fairq_init(&q, 0, 4, 4), -1);
}

Test(fairq, a_group_waits_behind_its_own_tenant_and_a_refused_head_keeps_the_turn) {
    fairq q;
    cr_assert_eq(fairq_init(&q, 2, 8, 4), 0);
    fairq_push(&q, 0, &ITEMS[0]); /* a group: 0, then 1 */
    fairq_push(&q, 0, &ITEMS[2]);
    fairq_push(&q, 1, &ITEMS[9]);
    int t;
    cr_assert_eq(fairq_peek(&q, &t), &ITEMS[0]);
    fairq_pop(&q, t, true, &ITEMS[1]); /* admitted: its next goes behind item 2 */
    /* tenant 1's turn; its head is cancelled: taken out without a turn */
    cr_assert_eq(fairq_peek(&q, &t), &ITEMS[9]);
    cr_assert_eq(t, 1);
    fairq_pop(&q, t, false, NULL);
    int got[2];
    admit(&q, 2, got);
    cr_assert_eq(got[0], 2);
    cr_assert_eq(got[1], 1);
    /* a cancelled head's next takes its place */
    fairq_push(&q, 1, &ITEMS[20]);
    cr_assert_eq(fairq_peek(&q, &t), &ITEMS[20]);
    fairq_pop(&q, t, false, &ITEMS[21]);
    cr_assert_eq(fairq_peek(&q, &t), &ITEMS[21]);
    cr_assert_eq(fairq_total(&q), 1);
    fairq_free(&q);
}

Test(fairq, a_lane_grows_as_it_fills_keeping_its_order) {
    fairq q;
    cr_assert_eq(fairq_init(&q, 1, 100, 100), 0);
    int got[40];
    for (int i = 0; i < 6; i++) fairq_push(&q, 0, &ITEMS[i]);
    admit(&q, 4, got); /* the ring's head moves on, its items wrap ... */
    for (int i = 6; i < 40; i++) cr_assert_eq(fairq_push(&q, 0, &ITEMS[i]), FAIRQ_OK);
    admit(&q, 36, got); /* ... and grow past its first size */
    for (int k = 0; k < 36; k++) cr_assert_eq(got[k], 4 + k, "at %d", k);
    cr_assert_eq(fairq_total(&q), 0);
    fairq_free(&q);
}
