/* Client state shared through Redis (cache/store/redis_state.h): items in checked envelopes
 * (cache/store/redis_envelope.h), one sorted-set index per kind and namespace, over one link
 * (cache/store/redis_link.h). */
#include "cache/store/redis_state.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cache/store/redis.h"
#include "cache/store/redis_envelope.h"
#include "cache/store/redis_link.h"
#include "util/util.h"

#define NAME_MAX_BYTES REDIS_ENV_NAME_MAX
/* "kvserve:s1:" + 64 + ":" + kind + ":" + 64 */
#define KEY_LEN 176 /* and ":deleted" */

static const char *const KIND_TAG[REDIS_STATE_KINDS] = {"resp", "schema", "pin", "lease"};

struct redis_state {
    redis_state_bounds bounds[REDIS_STATE_KINDS];
    cache_redis_addr addr;
    redis_health health;
    pthread_mutex_t mu; /* guards link, st */
    redis_link link;
    redis_state_stats st;
};

/* ---------------------------------------------------------------- keys, envelopes */

static void key_index(redis_state_kind kind, const cache_key *ns, char out[KEY_LEN]) {
    char nh[2 * CACHE_KEY_BYTES + 1];
    cache_key_hex(ns, nh);
    snprintf(out, KEY_LEN, "kvserve:s%d:%s:%s:index", REDIS_STATE_KEY_VERSION, nh, KIND_TAG[kind]);
}

static void key_item(redis_state_kind kind, const cache_key *ns, const char *name, size_t n,
                     char out[KEY_LEN]) {
    char nh[2 * CACHE_KEY_BYTES + 1], kh[2 * CACHE_KEY_BYTES + 1];
    cache_key h;
    kv_sha256(name, n, h.b);
    cache_key_hex(ns, nh);
    cache_key_hex(&h, kh);
    snprintf(out, KEY_LEN, "kvserve:s%d:%s:%s:%s", REDIS_STATE_KEY_VERSION, nh, KIND_TAG[kind], kh);
}

/* The tombstone a DELETE leaves: other instances drop their local copies when they see it. */
static void key_tomb(redis_state_kind kind, const cache_key *ns, const char *name,
                     char out[KEY_LEN]) {
    key_item(kind, ns, name, strlen(name), out);
    strcat(out, ":deleted");
}

/* ---------------------------------------------------------------- open, close */

redis_state *redis_state_open(const char *url, int timeout_ms,
                              const redis_state_bounds bounds[REDIS_STATE_KINDS], kv_error *err) {
    cache_redis_addr addr;
    if (cache_redis_parse_url(url, &addr, err) != 0) return NULL;
    for (int k = 0; k < REDIS_STATE_KINDS; k++)
        if (bounds[k].ttl_s < 1 || bounds[k].max_per_ns < 1 || bounds[k].max_value < 1 ||
            bounds[k].max_value > (512u << 20) || timeout_ms < 1) {
            kv_fail(err, "redis state: ttl, bound or timeout out of range");
            return NULL;
        }
    redis_state *st = calloc(1, sizeof *st);
    if (!st) {
        kv_fail(err, "out of memory");
        return NULL;
    }
    memcpy(st->bounds, bounds, sizeof st->bounds);
    st->addr = addr;
    pthread_mutex_init(&st->mu, NULL);
    redis_health_init(&st->health, "state", "shared state is local only", &st->addr);
    redis_link_init(&st->link, "state", &st->addr, &st->health, timeout_ms);
    /* A first exchange, so the log says at once whether Redis answers. */
    const char *ping[1] = {"PING"};
    redisReply *rep = redis_link_command(&st->link, 1, ping, NULL);
    if (rep) freeReplyObject(rep);
    return st;
}

void redis_state_close(redis_state *st) {
    if (!st) return;
    redis_link_close(&st->link);
    redis_health_destroy(&st->health);
    pthread_mutex_destroy(&st->mu);
    free(st);
}

/* ---------------------------------------------------------------- items */

/* Deletes items and their index entries (one round trip; a failure leaves them to expire).
 * Under mu. Returns how many item keys were there, -1 when Redis could not be reached. */
static int64_t drop_locked(redis_state *st, redis_state_kind kind, const cache_key *ns,
                           const char *const *names, int n) {
    if (n <= 0) return 0;
    char index[KEY_LEN];
    key_index(kind, ns, index);
    const char **argv = malloc(sizeof *argv * (size_t)(n + 2));
    char(*keys)[KEY_LEN] = malloc(sizeof *keys * (size_t)n);
    int64_t gone = -1;
    if (argv && keys && redis_link_get(&st->link)) {
        argv[0] = "DEL";
        for (int i = 0; i < n; i++) {
            key_item(kind, ns, names[i], strlen(names[i]), keys[i]);
            argv[i + 1] = keys[i];
        }
        bool ok = redisAppendCommandArgv(st->link.ctx, n + 1, argv, NULL) == REDIS_OK;
        argv[0] = "ZREM";
        argv[1] = index;
        for (int i = 0; i < n; i++) argv[i + 2] = names[i];
        ok = ok && redisAppendCommandArgv(st->link.ctx, n + 2, argv, NULL) == REDIS_OK;
        redisReply *del = ok ? redis_link_reply(&st->link) : NULL;
        if (!ok) redis_link_fail(&st->link, "cannot build a command");
        if (del && del->type == REDIS_REPLY_INTEGER) gone = del->integer;
        if (del) freeReplyObject(del);
        if (del && !redis_link_replies(&st->link, 1, NULL, 0)) gone = -1;
    }
    free(argv);
    free(keys);
    if (gone > 0) st->st.deleted += gone;
    return gone;
}

/* Drops the index's names past its bound (the soonest to expire) with their items. Under mu. */
static void trim_locked(redis_state *st, redis_state_kind kind, const cache_key *ns) {
    char index[KEY_LEN], stop[24];
    key_index(kind, ns, index);
    snprintf(stop, sizeof stop, "%d", -(st->bounds[kind].max_per_ns + 1));
    const char *argv[4] = {"ZRANGE", index, "0", stop};
    redisReply *rep = redis_link_command(&st->link, 4, argv, NULL);
    if (rep && rep->type == REDIS_REPLY_ARRAY && rep->elements > 0) {
        const char **names = malloc(sizeof *names * rep->elements);
        int n = 0;
        for (size_t i = 0; names && i < rep->elements; i++)
            if (rep->element[i]->type == REDIS_REPLY_STRING &&
                strlen(rep->element[i]->str) == rep->element[i]->len)
                names[n++] = rep->element[i]->str;
        if (names) drop_locked(st, kind, ns, names, n);
        free(names);
    }
    if (rep) freeReplyObject(rep);
}

int redis_state_put(redis_state *st, redis_state_kind kind, const cache_key *ns, const char *name,
                    const void *value, size_t len, int64_t ttl_s) {
    size_t n_name = strlen(name);
    const redis_state_bounds *b = &st->bounds[kind];
    if (ttl_s <= 0) ttl_s = b->ttl_s;
    if (n_name < 1 || n_name > NAME_MAX_BYTES || len > b->max_value) return 1;
    int64_t now = (int64_t)time(NULL), when[2] = {now, now + ttl_s};
    size_t vlen = 0;
    uint8_t *v = redis_env_make((int)kind, ns, when, name, value, len, &vlen);
    if (!v) return -1;
    char key[KEY_LEN], index[KEY_LEN], ttl[24], score[24], index_ttl[24];
    key_item(kind, ns, name, n_name, key);
    key_index(kind, ns, index);
    snprintf(ttl, sizeof ttl, "%lld", (long long)ttl_s);
    snprintf(score, sizeof score, "%lld", (long long)when[1]);
    /* the index lives as long as the longest-lived item written to it lately */
    snprintf(index_ttl, sizeof index_ttl, "%lld", (long long)(ttl_s > b->ttl_s ? ttl_s : b->ttl_s));
    const char *set[5] = {"SET", key, (const char *)v, "EX", ttl};
    size_t set_len[5] = {3, strlen(key), vlen, 2, strlen(ttl)};
    const char *zadd[4] = {"ZADD", index, score, name};
    const char *expire[3] = {"EXPIRE", index, index_ttl};
    char tomb[KEY_LEN];
    key_tomb(kind, ns, name, tomb);
    const char *untomb[2] = {"DEL", tomb};
    char refused[128] = "";
    pthread_mutex_lock(&st->mu);
    redis_link *c = &st->link;
    bool ok = redis_link_get(c) && redisAppendCommandArgv(c->ctx, 5, set, set_len) == REDIS_OK &&
              redisAppendCommandArgv(c->ctx, 4, zadd, NULL) == REDIS_OK &&
              redisAppendCommandArgv(c->ctx, 3, expire, NULL) == REDIS_OK &&
              redisAppendCommandArgv(c->ctx, 2, untomb, NULL) == REDIS_OK;
    if (!ok && c->ctx) redis_link_fail(c, "cannot build a command");
    ok = ok && redis_link_replies(c, 4, refused, sizeof refused);
    if (ok) trim_locked(st, kind, ns);
    if (ok)
        st->st.writes++;
    else
        st->st.write_errors++;
    pthread_mutex_unlock(&st->mu);
    if (refused[0]) log_warn("state: redis %s refuses a write: %s", st->health.url, refused);
    free(v);
    return ok ? 0 : -1;
}

int redis_state_get(redis_state *st, redis_state_kind kind, const cache_key *ns, const char *name,
                    char **value, size_t *len) {
    *value = NULL;
    *len = 0;
    size_t n_name = strlen(name);
    if (n_name < 1 || n_name > NAME_MAX_BYTES) return 0;
    char key[KEY_LEN];
    key_item(kind, ns, name, n_name, key);
    const char *argv[2] = {"GET", key};
    int rc = -1;
    pthread_mutex_lock(&st->mu);
    redisReply *rep = redis_link_command(&st->link, 2, argv, NULL);
    if (rep && rep->type == REDIS_REPLY_STRING) {
        const uint8_t *v;
        int64_t when[2];
        const char *why = "";
        if (redis_env_check((int)kind, ns, name, st->bounds[kind].max_value,
                            (const uint8_t *)rep->str, rep->len, &v, len, when, &why)) {
            rc = (*value = malloc(*len + 1)) ? 1 : -1;
            if (*value) memcpy(*value, v, *len), (*value)[*len] = 0;
        } else {
            log_warn("state: redis %s: refusing %s: %s", st->health.url, key, why);
            st->st.corrupt++;
            drop_locked(st, kind, ns, &name, 1);
            rc = 0;
        }
    } else if (rep) {
        rc = 0; /* nil: expired, evicted, flushed or never there */
    }
    if (rc == 1)
        st->st.hits++;
    else
        st->st.misses++;
    pthread_mutex_unlock(&st->mu);
    if (rep) freeReplyObject(rep);
    if (rc != 1) *len = 0;
    return rc;
}

int redis_state_delete(redis_state *st, redis_state_kind kind, const cache_key *ns,
                       const char *name) {
    size_t n_name = strlen(name);
    if (n_name < 1 || n_name > NAME_MAX_BYTES) return 0;
    char tomb[KEY_LEN], ttl[24];
    key_tomb(kind, ns, name, tomb);
    snprintf(ttl, sizeof ttl, "%lld", (long long)st->bounds[kind].ttl_s);
    const char *set[5] = {"SET", tomb, "1", "EX", ttl};
    pthread_mutex_lock(&st->mu);
    int64_t gone = drop_locked(st, kind, ns, &name, 1);
    redisReply *rep = gone >= 0 ? redis_link_command(&st->link, 5, set, NULL) : NULL;
    pthread_mutex_unlock(&st->mu);
    if (rep) freeReplyObject(rep);
    return gone < 0 ? -1 : gone > 0;
}

int redis_state_deleted(redis_state *st, redis_state_kind kind, const cache_key *ns,
                        const char *name) {
    size_t n_name = strlen(name);
    if (n_name < 1 || n_name > NAME_MAX_BYTES) return 0;
    char tomb[KEY_LEN];
    key_tomb(kind, ns, name, tomb);
    const char *argv[2] = {"EXISTS", tomb};
    pthread_mutex_lock(&st->mu);
    redisReply *rep = redis_link_command(&st->link, 2, argv, NULL);
    pthread_mutex_unlock(&st->mu);
    int rc = !rep ? -1 : rep->type == REDIS_REPLY_INTEGER && rep->integer > 0;
    if (rep) freeReplyObject(rep);
    return rc;
}

void redis_state_items_free(redis_state_item *v, int n) {
    for (int i = 0; v && i < n; i++) {
        free(v[i].name);
        free(v[i].value);
    }
    free(v);
}

/* The items named by the index reply names (an array of strings), read with one MGET; the
 * missing and the refused are dropped from the index. Under mu. */
static int read_items_locked(redis_state *st, redis_state_kind kind, const cache_key *ns,
                             const redisReply *names, redis_state_item *out) {
    size_t n = names->elements;
    const char **argv = malloc(sizeof *argv * (n + 1)), **gone = malloc(sizeof *gone * n);
    char(*keys)[KEY_LEN] = malloc(sizeof *keys * n);
    redisReply *rep = NULL;
    int found = 0, n_gone = 0;
    if (argv && gone && keys) {
        argv[0] = "MGET";
        for (size_t i = 0; i < n; i++) {
            key_item(kind, ns, names->element[i]->str, names->element[i]->len, keys[i]);
            argv[i + 1] = keys[i];
        }
        rep = redis_link_command(&st->link, (int)n + 1, argv, NULL);
    }
    if (rep && rep->type == REDIS_REPLY_ARRAY && rep->elements == n) {
        for (size_t i = 0; i < n; i++) {
            const redisReply *r = rep->element[i];
            const char *name = names->element[i]->str, *why = "";
            const uint8_t *v;
            size_t len;
            int64_t when[2];
            redis_state_item *it = &out[found];
            if (r->type != REDIS_REPLY_STRING) { /* expired or flushed: its name goes too */
                gone[n_gone++] = name;
                continue;
            }
            if (!redis_env_check((int)kind, ns, name, st->bounds[kind].max_value,
                                 (const uint8_t *)r->str, r->len, &v, &len, when, &why)) {
                log_warn("state: redis %s: refusing %s: %s", st->health.url, keys[i], why);
                st->st.corrupt++;
                gone[n_gone++] = name;
                continue;
            }
            it->stored = when[0];
            it->expires = when[1];
            it->name = strdup(name);
            it->value = malloc(len + 1);
            if (!it->name || !it->value) {
                free(it->name);
                free(it->value);
                continue;
            }
            memcpy(it->value, v, len);
            it->value[len] = 0;
            it->len = len;
            found++;
        }
        drop_locked(st, kind, ns, gone, n_gone);
    }
    if (rep) freeReplyObject(rep);
    free(argv);
    free(gone);
    free(keys);
    return rep ? found : -1;
}

int redis_state_list(redis_state *st, redis_state_kind kind, const cache_key *ns,
                     redis_state_item **out, int *n) {
    *out = NULL;
    *n = 0;
    char index[KEY_LEN], now[24], stop[24];
    key_index(kind, ns, index);
    snprintf(now, sizeof now, "(%lld", (long long)time(NULL));
    snprintf(stop, sizeof stop, "%d", st->bounds[kind].max_per_ns - 1);
    const char *expired[4] = {"ZREMRANGEBYSCORE", index, "-inf", now};
    const char *range[4] = {"ZRANGE", index, "0", stop};
    int rc = -1;
    pthread_mutex_lock(&st->mu);
    redisReply *rep = redis_link_command(&st->link, 4, expired, NULL);
    if (rep) freeReplyObject(rep);
    rep = rep ? redis_link_command(&st->link, 4, range, NULL) : NULL;
    bool ok = rep && rep->type == REDIS_REPLY_ARRAY;
    for (size_t i = 0; ok && i < rep->elements; i++)
        ok = rep->element[i]->type == REDIS_REPLY_STRING && rep->element[i]->len >= 1 &&
             rep->element[i]->len <= NAME_MAX_BYTES &&
             strlen(rep->element[i]->str) == rep->element[i]->len;
    if (ok && rep->elements == 0) rc = 0;
    if (ok && rep->elements > 0) {
        redis_state_item *v = calloc(rep->elements, sizeof *v);
        int found = v ? read_items_locked(st, kind, ns, rep, v) : -1;
        if (found >= 0) {
            *out = v;
            *n = found;
            rc = 0;
        } else {
            free(v);
        }
    } else if (rep && !ok) {
        /* not a list of names: the index is damaged; it goes (its items expire) */
        const char *del[2] = {"DEL", index};
        redisReply *d = redis_link_command(&st->link, 2, del, NULL);
        if (d) freeReplyObject(d);
        st->st.corrupt++;
        rc = 0;
    }
    pthread_mutex_unlock(&st->mu);
    if (rep) freeReplyObject(rep);
    return rc;
}

void redis_state_stats_get(redis_state *st, redis_state_stats *out) {
    pthread_mutex_lock(&st->mu);
    *out = st->st;
    pthread_mutex_unlock(&st->mu);
    out->connected = redis_health_up(&st->health);
}
