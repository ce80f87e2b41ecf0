/* Pinned bytes per tenant (cache/store/pins.h). */
#include "cache/store/pins.h"

#include <stdlib.h>

static bool tenant_ok(const pin_ledger *l, int t) { return t >= 0 && t < l->n_tenants; }

int pin_ledger_tenants(pin_ledger *l, int n_tenants, int share_pct) {
    int64_t *b = NULL;
    if (n_tenants > 0 && !(b = calloc((size_t)n_tenants, sizeof *b))) return -1;
    free(l->bytes);
    l->bytes = b;
    l->n_tenants = n_tenants;
    l->share_pct = share_pct;
    return 0;
}

void pin_ledger_free(pin_ledger *l) {
    free(l->bytes);
    l->bytes = NULL;
    l->n_tenants = 0;
}

int64_t pin_ledger_share(const pin_ledger *l, int64_t cap) {
    return kv_tenant_share(cap, l->share_pct, l->n_tenants, 0);
}

bool pin_ledger_over_share(const pin_ledger *l, int t, int64_t bytes, int64_t cap) {
    int64_t share = pin_ledger_share(l, cap);
    /* a share of the whole cap (one tenant, or 100%) is the cap's to refuse */
    return bytes > 0 && tenant_ok(l, t) && share < cap && l->bytes[t] + bytes > share;
}

pin_verdict pin_ledger_check(const pin_ledger *l, int t, int64_t bytes, int64_t cap) {
    if (l->total + bytes > cap) return PIN_TIER_FULL;
    return pin_ledger_over_share(l, t, bytes, cap) ? PIN_SHARE_FULL : PIN_OK;
}

int64_t pin_ledger_need(const pin_ledger *l, int owner, bool was_held, int t, int64_t bytes) {
    bool adopt = was_held && owner == CACHE_TENANT_NONE && tenant_ok(l, t);
    return !was_held || adopt ? bytes : 0;
}

pin_verdict pin_ledger_hold(pin_ledger *l, int *owner, bool was_held, int t, int64_t bytes,
                            int64_t cap) {
    if (!was_held) {
        pin_verdict v = pin_ledger_check(l, t, bytes, cap);
        if (v != PIN_OK) return v;
        *owner = t;
        pin_ledger_add(l, t, bytes);
        return PIN_OK;
    }
    if (pin_ledger_need(l, *owner, true, t, bytes) == 0) return PIN_OK;
    if (pin_ledger_over_share(l, t, bytes, cap)) return PIN_SHARE_FULL;
    pin_ledger_add(l, *owner, -bytes); /* the total stays */
    pin_ledger_add(l, t, bytes);
    *owner = t;
    return PIN_OK;
}

void pin_ledger_add(pin_ledger *l, int t, int64_t delta) {
    l->total += delta;
    if (tenant_ok(l, t)) l->bytes[t] += delta;
}

int64_t pin_ledger_of(const pin_ledger *l, int t) { return tenant_ok(l, t) ? l->bytes[t] : 0; }
