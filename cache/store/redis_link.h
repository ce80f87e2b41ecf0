/* One connection to Redis under the Redis tier's discipline (internal to cache/: the chunk tier,
 * cache/store/redis.c, and the shared client state, cache/store/redis_state.c, are its users).
 *
 * Every connect, send and receive times out after the link's timeout. A failure (refused,
 * reset, timed out, a protocol error) frees the context, and the next attempt is allowed after
 * 100 ms, doubling to 5 s; an answered command resets it. Until then redis_link_get answers NULL
 * at once, so a down or slow Redis costs its callers a miss, never a wait beyond one timeout per
 * backoff. After a timeout the connection may still carry the rest of a reply, so it is never
 * reused. Links of one user share a redis_health: the state (connected or not) is logged when
 * it changes, once per outage, not per request. A link is used by one thread at a time. */
#ifndef KVSERVE_CACHE_REDIS_LINK_H
#define KVSERVE_CACHE_REDIS_LINK_H

#include <hiredis/hiredis.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/time.h>

#include "cache/store/redis.h"

/* Whether a user's links reach Redis, for its stats and its log lines. */
typedef struct redis_health {
    pthread_mutex_t mu;
    int state;     /* -1: never connected yet, 0: down, 1: connected */
    char who[16];  /* the log lines' prefix: "cache", "state" */
    char url[64];  /* the address without the password */
    char miss[48]; /* what a lost Redis costs, for the log: "lookups miss" */
} redis_health;

typedef struct redis_link {
    const char *name; /* "lookup", "write", for messages */
    const cache_redis_addr *addr;
    struct timeval timeout;
    redis_health *health;
    redisContext *ctx;
    uint64_t retry_ns; /* no attempt before this (monotonic) */
    uint64_t backoff_ns;
} redis_link;

void redis_health_init(redis_health *h, const char *who, const char *miss,
                       const cache_redis_addr *a);
void redis_health_destroy(redis_health *h);
bool redis_health_up(redis_health *h);

/* A link named name to a (borrowed) sharing h, each network wait bounded by timeout_ms. */
void redis_link_init(redis_link *c, const char *name, const cache_redis_addr *a, redis_health *h,
                     int timeout_ms);
/* The link's context, connecting when there is none and the backoff allows; NULL when Redis
 * cannot be used now. */
redisContext *redis_link_get(redis_link *c);
/* Drops the connection and backs off. */
void redis_link_fail(redis_link *c, const char *why);
/* Drops the connection without the backoff of a failure: the next redis_link_get connects again
 * (a proxy that closes a connection after an error reply for some keys: cache/store/redis.c). */
void redis_link_drop(redis_link *c);
/* Reads one reply of a pipeline; NULL (the connection failed, dropped) on an I/O or protocol
 * error. */
redisReply *redis_link_reply(redis_link *c);
/* Appends argv (argvlen NULL: C strings) and reads its reply: NULL when the link is down, backs
 * off or failed. */
redisReply *redis_link_command(redis_link *c, int argc, const char **argv, const size_t *argvlen);
/* Reads the replies of n appended commands, every one, so the connection stays in step. False
 * when the connection failed or a reply was an error (the first goes to refused, when given). */
bool redis_link_replies(redis_link *c, int n, char *refused, size_t refused_len);
void redis_link_close(redis_link *c);

#endif
