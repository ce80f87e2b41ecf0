/* Pins and leases shared through Redis (handlers.h; cache/store/redis_state.h, kinds "pin" and
 * "lease"). An item per record, named by the record's key (64 hex digits) in the request's
 * namespace, its value {"record": hex, "tokens": n, "expires_at": Unix seconds or null}; a
 * lease's item lives until the lease ends, a pin's for the Redis tier's TTL (--redis-ttl; a pin
 * taken again renews it).
 *
 * What a pin or lease means on an instance that did not take it: the chunks it names are kept
 * in the shared tier for its life (their Redis keys' expiry extended, cache_store_keep_shared),
 * so that instance reads them from Redis instead of computing them again; it is listed by that
 * instance's GET /v1/cache/stats (with "tiers": ["redis"]) and can be unpinned there. It does
 * not pin anything in that instance's own RAM or disk, which hold what its own traffic needs.
 * An unpin on any instance removes the pin from Redis and leaves a tombstone; the instance that
 * took it ends its local pin when it next lists its pins. */
#include <stdlib.h>
#include <time.h>

#include "cache/store/redis_state.h"
#include "server/api/handlers.h"

/* The record keys of bkeys[0..n_blocks) into out (malloc'd), with each record's tokens. */
static int records_of(const server *s, const cache_key *bkeys, int n_blocks, cache_key **out) {
    int cb = cache_chunk_blocks(cache_store_layout(s->store));
    int n = (n_blocks + cb - 1) / cb;
    *out = n > 0 ? malloc(sizeof **out * (size_t)n) : NULL;
    if (!*out) return 0;
    cache_record_keys(bkeys, n_blocks, cb, *out);
    return n;
}

void shared_pins_record(server *s, const cache_key *ns, const cache_key *bkeys, int n_blocks,
                        int64_t until) {
    if (!s->shared || !s->store || n_blocks <= 0) return;
    const cache_layout *l = cache_store_layout(s->store);
    int cb = cache_chunk_blocks(l);
    int64_t ttl = until ? until - (int64_t)time(NULL) : 0;
    if (until && ttl < 1) return;
    cache_key *records;
    int n = records_of(s, bkeys, n_blocks, &records);
    for (int i = 0; i < n; i++) {
        char hex[2 * CACHE_KEY_BYTES + 1];
        cache_key_hex(&records[i], hex);
        int blocks = (i + 1) * cb < n_blocks ? (i + 1) * cb : n_blocks;
        json_t *v = json_pack("{s:s,s:i,s:o}", "record", hex, "tokens", blocks * l->block_tokens,
                              "expires_at", until ? json_integer(until) : json_null());
        char *text = v ? json_dumps(v, JSON_COMPACT) : NULL;
        if (text)
            redis_state_put(s->shared, until ? REDIS_STATE_LEASE : REDIS_STATE_PIN, ns, hex, text,
                            strlen(text), ttl);
        free(text);
        json_decref(v);
    }
    free(records);
    /* a pin's chunks are kept as long as its item: the pin kind's life, the tier's TTL */
    if (cache_store_keep_shared(s->store, ns, bkeys, n_blocks, ttl) != 0)
        log_debug("cache: a shared pin's chunks keep their own expiry (Redis unreachable)");
}

int shared_pins_forget(server *s, const cache_key *ns, const cache_key *bkeys, int n_blocks) {
    if (!s->shared || !s->store) return 0;
    cache_key *records;
    int n = records_of(s, bkeys, n_blocks, &records), gone = 0;
    for (int i = 0; i < n; i++) {
        char hex[2 * CACHE_KEY_BYTES + 1];
        cache_key_hex(&records[i], hex);
        gone += redis_state_delete(s->shared, REDIS_STATE_PIN, ns, hex) == 1;
    }
    free(records);
    return gone;
}

/* Whether record (hex) of ns is among the local records. */
static bool held_here(const cache_key *ns, const char *hex, const cache_pin_info *local, int n) {
    for (int i = 0; i < n; i++) {
        char h[2 * CACHE_KEY_BYTES + 1];
        cache_key_hex(&local[i].key, h);
        if (!strcmp(h, hex) && !memcmp(local[i].ns.b, ns->b, CACHE_KEY_BYTES)) return true;
    }
    return false;
}

int shared_pins_sync(server *s, const cache_key *ns, const cache_pin_info *local, int n) {
    int ended = 0;
    for (int i = 0; s->shared && s->store && i < n; i++) {
        const cache_pin_info *p = &local[i];
        if (!p->manual || memcmp(p->ns.b, ns->b, CACHE_KEY_BYTES) != 0) continue;
        char hex[2 * CACHE_KEY_BYTES + 1];
        cache_key_hex(&p->key, hex);
        if (redis_state_deleted(s->shared, REDIS_STATE_PIN, ns, hex) == 1) {
            cache_store_pin(s->store, CACHE_TENANT_NONE, &p->key, 1, false);
            log_info("cache: record %.16s unpinned on another instance", hex);
            ended++;
        }
    }
    return ended;
}

json_t *shared_pins_json(server *s, const cache_key *ns, const cache_pin_info *local, int n_local) {
    json_t *list = json_array();
    if (!s->shared || !s->store || !list) return list;
    char nh[2 * CACHE_KEY_BYTES + 1];
    cache_key_hex(ns, nh);
    int64_t now = (int64_t)time(NULL);
    for (int k = REDIS_STATE_PIN; k <= REDIS_STATE_LEASE; k++) {
        redis_state_item *items = NULL;
        int n = 0;
        if (redis_state_list(s->shared, (redis_state_kind)k, ns, &items, &n)) continue;
        for (int i = 0; i < n; i++) {
            json_t *v = json_loadb(items[i].value, items[i].len, 0, NULL);
            const char *rec = json_string_value(json_object_get(v, "record"));
            json_t *tokens = json_object_get(v, "tokens");
            if (!rec || strcmp(rec, items[i].name) || !json_is_integer(tokens) ||
                held_here(ns, rec, local, n_local)) {
                json_decref(v);
                continue;
            }
            bool lease = k == REDIS_STATE_LEASE;
            json_t *e = json_pack("{s:s%,s:s%,s:I,s:b,s:[s]}", "record", rec, (size_t)16,
                                  "namespace", nh, (size_t)16, "tokens", json_integer_value(tokens),
                                  "pinned", !lease, "tiers", "redis");
            json_object_set_new(e, "expires_at",
                                lease ? json_integer(items[i].expires) : json_null());
            if (lease)
                json_object_set_new(
                    e, "expires_in_s",
                    json_integer(items[i].expires > now ? items[i].expires - now : 0));
            json_array_append_new(list, e);
            json_decref(v);
        }
        redis_state_items_free(items, n);
    }
    return list;
}
