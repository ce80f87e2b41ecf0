/* The engine's queue, shared fairly between tenants (server/engine/fairq.h). */
#include "server/engine/fairq.h"

#include <stdlib.h>

int fairq_init(fairq *q, int n_tenants, int cap_total, int cap_tenant) {
    *q = (fairq){0};
    if (n_tenants < 1 || cap_total < 1 || cap_tenant < 1 || cap_tenant > cap_total) return -1;
    if (!(q->lanes = calloc((size_t)n_tenants, sizeof *q->lanes))) return -1;
    q->n_tenants = n_tenants;
    for (int t = 0; t < n_tenants; t++)
        if (!(q->lanes[t].items = calloc((size_t)cap_tenant, sizeof(void *)))) {
            fairq_free(q);
            return -1;
        }
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

static void lane_push(const fairq *q, fairq_lane *l, void *item) {
    l->items[(l->head + l->len++) % q->cap_tenant] = item;
}

fairq_status fairq_push(fairq *q, int t, void *item) {
    fairq_status st = fairq_room(q, t);
    if (st != FAIRQ_OK) return st;
    lane_push(q, &q->lanes[t], item);
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
    l->head = (l->head + 1) % q->cap_tenant;
    l->len--;
    q->total--;
    if (next) {
        lane_push(q, l, next);
        q->total++;
    }
    if (had_turn) q->turn = (t + 1) % q->n_tenants;
}

int fairq_len(const fairq *q, int t) { return q->lanes[t].len; }
