/* The pinned bytes of a tier, in all and per tenant (internal to cache/: the RAM and disk tiers
 * keep one each). Pins and leases (cache.h) keep records from eviction; a tier lets them fill at
 * most its pin cap, and each tenant at most its share of that cap (cache_store_opts'
 * tenant_pin_share), so one tenant cannot hold the whole cap and leave the others' pins and
 * cache_control leases refused. Pins cannot be taken back (a pin holds until unpinned, a lease
 * until its time), so a share is a hard bound, never borrowed: with the default share (an equal
 * part) a tenant within its share is never refused because of another. A record held for no
 * tenant (CACHE_TENANT_NONE: the schema registry's pins, leases restored at start) counts
 * against the cap only, until a tenant holds it too (renews the lease): it is that tenant's then.
 * The owner holds the tier's lock around every call. */
#ifndef KVSERVE_CACHE_PINS_H
#define KVSERVE_CACHE_PINS_H

#include "cache/cache.h"

typedef struct pin_ledger {
    int64_t total;  /* pinned bytes */
    int64_t *bytes; /* [n_tenants] of those, each tenant's */
    int n_tenants;  /* 0: no tenants (every hold counts against the cap only) */
    int share_pct;  /* a tenant's share of the cap, percent (0: an equal part) */
} pin_ledger;

/* Why a hold was refused, or not. */
typedef enum pin_verdict {
    PIN_OK = 0,
    PIN_TIER_FULL,  /* the tier's cap */
    PIN_SHARE_FULL, /* the tenant's share of it */
} pin_verdict;

/* Sets the tenants (n 0 or 1: one, holding the whole cap); -1 when out of memory (the ledger is
 * then unchanged). Bytes held by a tenant not kept from before count for no tenant. */
int pin_ledger_tenants(pin_ledger *l, int n_tenants, int share_pct);
void pin_ledger_free(pin_ledger *l);
/* Whether `bytes` more for tenant t fit under cap and t's share of it. */
pin_verdict pin_ledger_check(const pin_ledger *l, int t, int64_t bytes, int64_t cap);
/* True when `bytes` more (> 0) would take tenant t past its share of cap, where that share is
 * less than the cap (else the cap refuses, as it refuses any tenant). */
bool pin_ledger_over_share(const pin_ledger *l, int t, int64_t bytes, int64_t cap);
/* A record of `bytes` held for *owner (was_held) or for none yet is to be held for tenant t too:
 * PIN_OK once counted (a new hold: to t, as *owner; a record held for no tenant, restored at start
 * or the schema registry's, becomes t's, as far as t's share allows), else why not, nothing
 * changed. A record a tenant holds already takes no more bytes, so it is never refused. */
pin_verdict pin_ledger_hold(pin_ledger *l, int *owner, bool was_held, int t, int64_t bytes,
                            int64_t cap);
/* The bytes of a record held for *owner, or for none yet, that holding it for t would add to
 * t's (pin_ledger_hold's share check). */
int64_t pin_ledger_need(const pin_ledger *l, int owner, bool was_held, int t, int64_t bytes);
/* Counts delta bytes (negative: released) to tenant t (CACHE_TENANT_NONE or out of range: to
 * none) and the total. */
void pin_ledger_add(pin_ledger *l, int t, int64_t delta);
/* Tenant t's pinned bytes (0 for one out of range) and the most it may hold under cap. */
int64_t pin_ledger_of(const pin_ledger *l, int t);
int64_t pin_ledger_share(const pin_ledger *l, int64_t cap);

#endif
