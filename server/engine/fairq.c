/* The engine's queue, shared fairly between tenants (server/engine/fairq.h). */
#include "server/engine/fairq.h"

#include <stdlib.h>
#include <string.h>

#include "util/util.h"

int fairq_init(fairq *q, int n_tenants, int cap_total, int cap_tenant) {
    *q = (fairq){0};
    if (n_tenants < 1 || cap_total < 1 || cap_tenant < 1 || cap_tenant > cap_total) return -1;
    if (!(q->lanes = calloc((size_t)n_tenants, sizeof *q->lanes))) return -1;
    q->n_tenants = n_tenants;
    q->cap_total = cap_total;
    q->cap_tenant = cap_tenant;
    return 0;
}

void fairq_free(fairq *q) {
    for (int t = 0; q->lanes && t < q->n_tenants; t++) free(q->lanes[t].items);
    free(q->lanes);
    *q = (fairq){0};
}

fairq_status fairq_room(const fairq *q, int t) {
    if (q->total >= q->cap_total) return FAIRQ_FULL;
    return q->lanes[t].len >= q->cap_tenant ? FAIRQ_TENANT_FULL : FAIRQ_OK;
}

/* Room in l for one more: its ring grown (the wrapped items moved past the old end) when full. */
static int lane_reserve(fairq_lane *l) {
    size_t old = l->cap;
    if (kv_array_reserve((void **)&l->items, &l->cap, (size_t)l->len + 1, sizeof *l->items, 8))
        return -1;
    size_t end = (size_t)l->head + (size_t)l->len;
    if (l->cap > old && end > old) /* new cap >= 2 old: the wrapped part fits after old */
        memcpy(l->items + old, l->items, sizeof *l->items * (end - old));
    return 0;
}

static void lane_push(fairq_lane *l, void *item) {
    l->items[((size_t)l->head + (size_t)l->len++) % l->cap] = item;
}

fairq_status fairq_push(fairq *q, int t, void *item) {
    fairq_status st = fairq_room(q, t);
    if (st != FAIRQ_OK) return st;
    if (lane_reserve(&q->lanes[t])) return FAIRQ_NO_MEMORY;
    lane_push(&q->lanes[t], item);
    q->total++;
    return FAIRQ_OK;
}

void *fairq_peek(const fairq *q, int *t) {
    for (int k = 0; k < q->n_tenants && q->total > 0; k++) {
        int u = (q->turn + k) % q->n_tenants;
        const fairq_lane *l = &q->lanes[u];
        if (l->len > 0) {
            *t = u;
            return l->items[l->head];
        }
    }
    return NULL;
}

void fairq_pop(fairq *q, int t, bool had_turn, void *next) {
    fairq_lane *l = &q->lanes[t];
    if (l->len == 0) return;
    if (next && !had_turn) {
        l->items[l->head] = next;
        return;
    }
    l->head = (int)(((size_t)l->head + 1) % l->cap);
    l->len--;
    q->total--;
    if (next) { /* into the place the head left */
        lane_push(l, next);
        q->total++;
    }
    if (had_turn) q->turn = (t + 1) % q->n_tenants;
}

int fairq_len(const fairq *q, int t) { return q->lanes[t].len; }
