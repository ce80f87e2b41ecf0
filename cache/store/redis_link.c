/* One connection to Redis with timeouts and backoff (cache/store/redis_link.h). */
#include "cache/store/redis_link.h"

#include <stdio.h>
#include <string.h>

#include "util/util.h"

#define REDIS_BACKOFF_MIN_NS 100000000ull  /* 100 ms */
#define REDIS_BACKOFF_MAX_NS 5000000000ull /* 5 s */

void redis_health_init(redis_health *h, const char *who, const char *miss,
                       const cache_redis_addr *a) {
    pthread_mutex_init(&h->mu, NULL);
    h->state = -1;
    snprintf(h->who, sizeof h->who, "%s", who);
    snprintf(h->miss, sizeof h->miss, "%s", miss);
    if (a->path[0])
        snprintf(h->url, sizeof h->url, "unix://%.50s", a->path);
    else
        snprintf(h->url, sizeof h->url, "%.40s:%d/%d", a->host, a->port, a->db);
}

void redis_health_destroy(redis_health *h) { pthread_mutex_destroy(&h->mu); }

bool redis_health_up(redis_health *h) {
    pthread_mutex_lock(&h->mu);
    bool up = h->state == 1;
    pthread_mutex_unlock(&h->mu);
    return up;
}

/* Logs the state when it changes: one line per outage, not one per request. */
static void set_state(redis_health *h, bool up, const char *why) {
    pthread_mutex_lock(&h->mu);
    int was = h->state;
    h->state = up;
    pthread_mutex_unlock(&h->mu);
    if (up && was != 1)
        log_info("%s: redis %s %s", h->who, h->url, was == -1 ? "connected" : "reconnected");
    else if (!up && was == 1)
        log_warn("%s: redis %s lost: %s (%s until it is back)", h->who, h->url, why, h->miss);
    else if (!up && was == -1)
        log_warn("%s: redis %s unavailable: %s (retrying in the background)", h->who, h->url, why);
}

void redis_link_init(redis_link *c, const char *name, const cache_redis_addr *a, redis_health *h,
                     int timeout_ms) {
    *c = (redis_link){.name = name, .addr = a, .health = h};
    c->timeout = (struct timeval){.tv_sec = timeout_ms / 1000, .tv_usec = timeout_ms % 1000 * 1000};
}

void redis_link_fail(redis_link *c, const char *why) {
    char msg[160];
    snprintf(msg, sizeof msg, "%s", why);
    if (c->ctx) redisFree(c->ctx);
    c->ctx = NULL;
    c->backoff_ns = c->backoff_ns ? c->backoff_ns * 2 : REDIS_BACKOFF_MIN_NS;
    if (c->backoff_ns > REDIS_BACKOFF_MAX_NS) c->backoff_ns = REDIS_BACKOFF_MAX_NS;
    c->retry_ns = clock_now_ns() + c->backoff_ns;
    set_state(c->health, false, msg);
}

void redis_link_drop(redis_link *c) {
    if (c->ctx) redisFree(c->ctx);
    c->ctx = NULL;
}

/* A command on a fresh connection (AUTH, SELECT): false when it failed. */
static bool link_setup(redis_link *c, int argc, const char **argv, char *why, size_t n) {
    redisReply *rep = redisCommandArgv(c->ctx, argc, argv, NULL);
    bool ok = rep && rep->type == REDIS_REPLY_STATUS;
    if (!rep)
        snprintf(why, n, "%s: %s", argv[0], c->ctx->errstr);
    else if (!ok)
        snprintf(why, n, "%s: %.*s", argv[0], rep->type == REDIS_REPLY_ERROR ? (int)rep->len : 0,
                 rep->type == REDIS_REPLY_ERROR ? rep->str : "");
    if (rep) freeReplyObject(rep);
    return ok;
}

redisContext *redis_link_get(redis_link *c) {
    if (c->ctx) return c->ctx;
    if (clock_now_ns() < c->retry_ns) return NULL;
    const cache_redis_addr *a = c->addr;
    c->ctx = a->path[0] ? redisConnectUnixWithTimeout(a->path, c->timeout)
                        : redisConnectWithTimeout(a->host, a->port, c->timeout);
    char why[192];
    if (!c->ctx) {
        redis_link_fail(c, "out of memory");
        return NULL;
    }
    if (c->ctx->err) {
        snprintf(why, sizeof why, "%s", c->ctx->errstr);
        redis_link_fail(c, why);
        return NULL;
    }
    if (redisSetTimeout(c->ctx, c->timeout) != REDIS_OK) {
        redis_link_fail(c, "cannot set the socket timeout");
        return NULL;
    }
    if (a->has_password) {
        const char *argv[2] = {"AUTH", a->password};
        if (!link_setup(c, 2, argv, why, sizeof why)) {
            redis_link_fail(c, why);
            return NULL;
        }
    }
    if (a->db) {
        char db[16];
        snprintf(db, sizeof db, "%d", a->db);
        const char *argv[2] = {"SELECT", db};
        if (!link_setup(c, 2, argv, why, sizeof why)) {
            redis_link_fail(c, why);
            return NULL;
        }
    }
    /* Up (and the backoff reset) only once a command is answered: a Redis that accepts
     * connections but answers nothing in time keeps backing off. */
    return c->ctx;
}

redisReply *redis_link_reply(redis_link *c) {
    void *rep = NULL;
    if (redisGetReply(c->ctx, &rep) != REDIS_OK || !rep) {
        char why[192];
        snprintf(why, sizeof why, "%s connection: %s", c->name,
                 c->ctx->errstr[0] ? c->ctx->errstr : "no reply");
        if (rep) freeReplyObject(rep);
        redis_link_fail(c, why);
        return NULL;
    }
    c->backoff_ns = 0;
    set_state(c->health, true, NULL); /* also when another link marked Redis down */
    return rep;
}

redisReply *redis_link_command(redis_link *c, int argc, const char **argv, const size_t *argvlen) {
    if (!redis_link_get(c)) return NULL;
    if (redisAppendCommandArgv(c->ctx, argc, argv, argvlen) != REDIS_OK) {
        redis_link_fail(c, "cannot build a command");
        return NULL;
    }
    return redis_link_reply(c);
}

bool redis_link_replies(redis_link *c, int n, char *refused, size_t refused_len) {
    bool all = true;
    for (int i = 0; i < n; i++) {
        redisReply *rep = redis_link_reply(c);
        if (!rep) return false;
        if (rep->type == REDIS_REPLY_ERROR && all) {
            all = false;
            if (refused) snprintf(refused, refused_len, "%.*s", (int)rep->len, rep->str);
        }
        freeReplyObject(rep);
    }
    return all;
}

void redis_link_close(redis_link *c) {
    if (c->ctx) redisFree(c->ctx);
    c->ctx = NULL;
}
