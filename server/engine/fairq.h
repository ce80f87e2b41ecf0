/* The engine's queue, shared fairly between tenants (internal to server/engine/; DESIGN.md
 * "Tenants"). Each tenant (an API key, or the whole server without keys) has its own FIFO of
 * waiting requests, at most cap_tenant of them, and all tenants together at most cap_total.
 * Admission takes the tenants in turn: fairq_peek names the head of the first tenant with work
 * waiting at or after the one whose turn it is, and fairq_pop, once that head was admitted,
 * passes the turn to the tenant after it. A tenant's burst then waits behind its own requests
 * only: another tenant's single request is the next one admitted once the running tenant's
 * turn ends, whatever the burst's length (as vLLM's and SGLang's fair schedulers put the
 * tenants' queues, not their requests, in round-robin). Within a tenant the order is first come,
 * first served, as one queue was. Not thread-safe: the engine holds its lock around every call. */
#ifndef KVSERVE_ENGINE_FAIRQ_H
#define KVSERVE_ENGINE_FAIRQ_H

#include <stdbool.h>
#include <stddef.h>

typedef struct fairq_lane {
    void **items; /* [cap] ring, grown as the lane fills (all lanes hold cap_total at most) */
    size_t cap;
    int head, len;
} fairq_lane;

typedef struct fairq {
    fairq_lane *lanes; /* [n_tenants] */
    int n_tenants;
    int cap_total, cap_tenant;
    int total; /* items waiting, all lanes */
    int turn;  /* the tenant whose turn it is */
} fairq;

typedef enum fairq_status {
    FAIRQ_OK = 0,
    FAIRQ_FULL,        /* cap_total items wait */
    FAIRQ_TENANT_FULL, /* the tenant's cap_tenant items wait */
    FAIRQ_NO_MEMORY,   /* the lane could not grow */
} fairq_status;

/* n_tenants >= 1 lanes of cap_tenant (1 .. cap_total); -1 when out of memory or out of range. */
int fairq_init(fairq *q, int n_tenants, int cap_total, int cap_tenant);
void fairq_free(fairq *q);
/* Whether tenant t (in range) could queue one more item now. */
fairq_status fairq_room(const fairq *q, int t);
/* Queues item at the back of tenant t's lane, if fairq_room says so (and memory allows). */
fairq_status fairq_push(fairq *q, int t, void *item);
/* The head of the tenant whose turn it is (or, that one having none waiting, of the next one
 * that has), its tenant in *t; NULL when nothing waits. */
void *fairq_peek(const fairq *q, int *t);
/* Takes tenant t's head out. had_turn: it was admitted, and the turn passes to the tenant after
 * t; next (or NULL) joins the back of t's lane (a group's next request, engine.h). Else (the head
 * was cancelled, or the queue is emptied) next, if any, takes the head's place and t keeps its
 * turn. Never refused: next replaces the head it follows. */
void fairq_pop(fairq *q, int t, bool had_turn, void *next);
/* Items waiting: tenant t's, and all. */
int fairq_len(const fairq *q, int t);
static inline int fairq_total(const fairq *q) { return q->total; }

#endif
