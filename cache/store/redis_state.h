/* What a client leaves on one instance and may ask another for, shared through Redis: stored
 * responses, schema definitions, pins and leases (the server's and the schema registry's; the
 * chunks themselves are the Redis tier's, cache/store/redis.h).
 *
 * Each item is a name (a response id, a schema name, a pin's chunk key) and a value (bytes the
 * user gives meaning to), in a kind and a namespace (the tenant's: 64 hex digits as in the chunk
 * tier), with an expiry. Keys (kind: "resp", "schema", "pin", "lease"):
 *
 *   kvserve:s1:<ns>:<kind>:<sha256(name), 64 hex>   the item: a checked envelope (below)
 *   kvserve:s1:<ns>:<kind>:<sha256(name)>:deleted   a tombstone: "1", for the kind's ttl
 *   kvserve:s1:<ns>:<kind>:index                    a sorted set: names scored by expiry
 *
 * Only single-key commands (GET, SET EX, DEL, EXISTS, EXPIRE, ZADD, ZRANGE, ZREM, ZREMRANGEBYRANK,
 * ZREMRANGEBYSCORE) and MGET, so that a proxy sharding by key (twemproxy) forwards every one.
 *
 * Bounds per kind: an item's value is at most max_value bytes (larger ones are not shared); a
 * namespace's index keeps max_per_ns names, the soonest to expire dropped first (their items
 * deleted with them); every key expires (the kind's ttl, or the item's own: a pin's, a lease's).
 *
 * Trust. An item's value is an envelope: "KVST", a version, when it was stored and expires, the
 * name's and the value's lengths, and SHA-256 over (namespace, kind, times, name, value). A value
 * that fails a check (size, envelope, checksum, another name or namespace than its key's) is a
 * miss, counted as corrupt and deleted. Faults: one link (cache/store/redis_link.h: every wait
 * bounded by the timeout, backoff after a failure): a down, slow or flushed Redis makes every call
 * answer "unreachable" or "none" at once or within one timeout; callers then behave as a server
 * without Redis. Thread-safe (one caller at a time on the link). */
#ifndef KVSERVE_CACHE_REDIS_STATE_H
#define KVSERVE_CACHE_REDIS_STATE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cache/cache.h"

#define REDIS_STATE_KEY_VERSION 1

typedef enum redis_state_kind {
    REDIS_STATE_RESPONSE,
    REDIS_STATE_SCHEMA,
    REDIS_STATE_PIN,
    REDIS_STATE_LEASE,
    REDIS_STATE_KINDS
} redis_state_kind;

typedef struct redis_state_bounds {
    int64_t ttl_s;    /* an item's life when its put names none (>= 1) */
    int max_per_ns;   /* names a namespace's index keeps */
    size_t max_value; /* bytes of a value */
} redis_state_bounds;

typedef struct redis_state redis_state;

/* One item as a list returns it: malloc'd name and value (NUL-terminated too), its expiry. */
typedef struct redis_state_item {
    char *name;
    char *value;
    size_t len;
    int64_t stored, expires; /* Unix seconds: when it was put, when it ends */
} redis_state_item;

typedef struct redis_state_stats {
    int64_t hits, misses, writes, write_errors, corrupt, deleted;
    bool connected;
} redis_state_stats;

/* Parses url (cache_redis_parse_url) and connects once (a Redis that is down is only logged).
 * bounds: one per kind. NULL with err on a bad URL or bound. */
redis_state *redis_state_open(const char *url, int timeout_ms,
                              const redis_state_bounds bounds[REDIS_STATE_KINDS], kv_error *err);
void redis_state_close(redis_state *st);

/* Stores value (len bytes) as (kind, ns, name), replacing what was there, expiring after ttl_s
 * seconds (0: the kind's ttl); a name is 1..1024 bytes. 0 when Redis took it, 1 when it is over
 * the kind's bounds (not shared), -1 when Redis could not be reached or refused it. */
int redis_state_put(redis_state *st, redis_state_kind kind, const cache_key *ns, const char *name,
                    const void *value, size_t len, int64_t ttl_s);
/* The value of (kind, ns, name) as a malloc'd, NUL-terminated copy (*len its bytes). 1: found,
 * 0: none (or a value that failed a check: deleted), -1: Redis could not be reached. */
int redis_state_get(redis_state *st, redis_state_kind kind, const cache_key *ns, const char *name,
                    char **value, size_t *len);
/* Deletes (kind, ns, name) and leaves a tombstone (for the kind's ttl; a later put of the name
 * removes it): 1 when it was there, 0 when not, -1 when Redis could not be reached. */
int redis_state_delete(redis_state *st, redis_state_kind kind, const cache_key *ns,
                       const char *name);
/* Whether (kind, ns, name) was deleted (its tombstone is there), so that a copy another
 * instance keeps goes too: 1 yes, 0 no, -1 Redis could not be reached. A flushed Redis has no
 * tombstones: local copies stay, as without Redis. */
int redis_state_deleted(redis_state *st, redis_state_kind kind, const cache_key *ns,
                        const char *name);
/* Every live item of (kind, ns), soonest to expire first, at most the kind's max_per_ns: *out
 * (free with redis_state_items_free), *n. 0, or -1 when Redis could not be reached (*n 0). */
int redis_state_list(redis_state *st, redis_state_kind kind, const cache_key *ns,
                     redis_state_item **out, int *n);
void redis_state_items_free(redis_state_item *v, int n);
void redis_state_stats_get(redis_state *st, redis_state_stats *out);

#endif
