/* The state shared through Redis (cache/store/redis_state.h) against a real redis-server started
 * by each test: put, get, delete and tombstones per kind and namespace; lists bounded per
 * namespace (the soonest to expire dropped, their items deleted) and without expired names;
 * expiry on every key; values over the bound not shared; damaged values (a flipped byte, a
 * truncated one, another namespace's copied over, a damaged index) are misses, counted and
 * deleted; Redis stalled: one call waits the timeout, the next ones none (backoff); Redis
 * killed: every call answers "unreachable" at once, and the state works again once Redis is
 * back. Skips, saying so, where redis-server is not installed. */
#include <criterion/criterion.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cache/store/redis_state.h"
#include "tests/unit/redis_fixture.h"
#include "util/util.h"

static test_redis srv = {.pid = -1};

static void setup(void) {
    signal(SIGPIPE, SIG_IGN); /* as kvserve serve does: hiredis writes with write() */
    test_redis_start(&srv);
}

static void teardown(void) { test_redis_stop(&srv); }

TestSuite(redis_state, .init = setup, .fini = teardown, .timeout = 60);

static cache_key make_ns(const char *salt) {
    cache_key ns;
    cache_namespace((const uint8_t *)"tenant", 6, salt, &ns);
    return ns;
}

/* Responses: 3 per namespace, 1 KiB each at most; the other kinds alike. */
static redis_state *open_state(int timeout_ms) {
    redis_state_bounds b[REDIS_STATE_KINDS];
    for (int k = 0; k < REDIS_STATE_KINDS; k++) b[k] = (redis_state_bounds){3600, 3, 1024};
    kv_error err = {{0}};
    redis_state *st = redis_state_open(srv.url, timeout_ms, b, &err);
    cr_assert(st, "%s", err.msg);
    return st;
}

/* The key of a response item, as redis_state.h names it. */
static void item_key(const cache_key *ns, const char *name, char *out, size_t n) {
    cache_key h;
    char nh[2 * CACHE_KEY_BYTES + 1], kh[2 * CACHE_KEY_BYTES + 1];
    kv_sha256(name, strlen(name), h.b);
    cache_key_hex(ns, nh);
    cache_key_hex(&h, kh);
    snprintf(out, n, "kvserve:s1:%s:resp:%s", nh, kh);
}

static redisReply *raw(const char *fmt, const char *a, const char *b, size_t blen) {
    redisContext *c = test_redis_connect(&srv);
    cr_assert(c);
    redisReply *rep = b ? redisCommand(c, fmt, a, b, blen) : redisCommand(c, fmt, a);
    cr_assert(rep);
    redisFree(c);
    return rep;
}

static long long raw_int(const char *fmt, const char *key) {
    redisReply *rep = raw(fmt, key, NULL, 0);
    cr_assert_eq(rep->type, REDIS_REPLY_INTEGER);
    long long v = rep->integer;
    freeReplyObject(rep);
    return v;
}

static int get_text(redis_state *st, const cache_key *ns, const char *name, char **out) {
    size_t len = 0;
    int rc = redis_state_get(st, REDIS_STATE_RESPONSE, ns, name, out, &len);
    if (rc == 1) cr_assert_eq(len, strlen(*out));
    return rc;
}

Test(redis_state, put_get_and_delete_with_a_tombstone_per_namespace) {
    redis_state *st = open_state(1000);
    cache_key a = make_ns(NULL), b = make_ns("other");
    cr_assert_eq(redis_state_put(st, REDIS_STATE_RESPONSE, &a, "resp_1", "{\"x\":1}", 7, 0), 0);
    char *v = NULL;
    cr_assert_eq(get_text(st, &a, "resp_1", &v), 1);
    cr_assert_str_eq(v, "{\"x\":1}");
    free(v);
    /* another namespace, another kind, another name: none */
    cr_assert_eq(get_text(st, &b, "resp_1", &v), 0);
    cr_assert_null(v);
    size_t len;
    cr_assert_eq(redis_state_get(st, REDIS_STATE_SCHEMA, &a, "resp_1", &v, &len), 0);
    cr_assert_eq(get_text(st, &a, "resp_2", &v), 0);
    /* the key expires with the kind's ttl */
    char key[256];
    item_key(&a, "resp_1", key, sizeof key);
    long long ttl = raw_int("TTL %s", key);
    cr_assert(ttl > 3500 && ttl <= 3600, "%lld", ttl);
    cr_assert_eq(redis_state_deleted(st, REDIS_STATE_RESPONSE, &a, "resp_1"), 0);
    cr_assert_eq(redis_state_delete(st, REDIS_STATE_RESPONSE, &a, "resp_1"), 1);
    cr_assert_eq(redis_state_delete(st, REDIS_STATE_RESPONSE, &a, "resp_1"), 0);
    cr_assert_eq(get_text(st, &a, "resp_1", &v), 0);
    cr_assert_eq(redis_state_deleted(st, REDIS_STATE_RESPONSE, &a, "resp_1"), 1);
    cr_assert_eq(redis_state_deleted(st, REDIS_STATE_RESPONSE, &b, "resp_1"), 0);
    /* stored again: no longer deleted */
    cr_assert_eq(redis_state_put(st, REDIS_STATE_RESPONSE, &a, "resp_1", "y", 1, 0), 0);
    cr_assert_eq(redis_state_deleted(st, REDIS_STATE_RESPONSE, &a, "resp_1"), 0);
    /* over the value bound, or a name too long: not shared */
    char big[2048];
    memset(big, 'x', sizeof big);
    cr_assert_eq(redis_state_put(st, REDIS_STATE_RESPONSE, &a, "big", big, sizeof big, 0), 1);
    cr_assert_eq(redis_state_put(st, REDIS_STATE_RESPONSE, &a, "", "y", 1, 0), 1);
    redis_state_stats s;
    redis_state_stats_get(st, &s);
    cr_assert(s.connected);
    cr_assert_eq(s.writes, 2);
    cr_assert_eq(s.hits, 1);
    redis_state_close(st);
}

Test(redis_state, a_list_keeps_the_bound_and_drops_the_soonest_to_expire) {
    redis_state *st = open_state(1000);
    cache_key a = make_ns(NULL), b = make_ns("other");
    char name[16];
    for (int i = 0; i < 5; i++) { /* later ones live longer */
        snprintf(name, sizeof name, "s%d", i);
        cr_assert_eq(redis_state_put(st, REDIS_STATE_SCHEMA, &a, name, name, 2, 100 + i), 0);
    }
    cr_assert_eq(redis_state_put(st, REDIS_STATE_SCHEMA, &b, "s9", "b", 1, 0), 0);
    redis_state_item *items;
    int n;
    cr_assert_eq(redis_state_list(st, REDIS_STATE_SCHEMA, &a, &items, &n), 0);
    cr_assert_eq(n, 3);
    for (int i = 0; i < 3; i++) {
        snprintf(name, sizeof name, "s%d", i + 2);
        cr_assert_str_eq(items[i].name, name);
        cr_assert_str_eq(items[i].value, name);
        cr_assert_eq(items[i].len, 2);
        cr_assert_eq(items[i].expires - items[i].stored, 102 + i);
    }
    cr_assert(items[0].expires < items[2].expires);
    redis_state_items_free(items, n);
    /* the trimmed ones are gone, not only unlisted */
    char *v;
    size_t len;
    cr_assert_eq(redis_state_get(st, REDIS_STATE_SCHEMA, &a, "s0", &v, &len), 0);
    cr_assert_eq(redis_state_get(st, REDIS_STATE_SCHEMA, &a, "s4", &v, &len), 1);
    free(v);
    /* an item deleted (or expired, or flushed) behind the index's back is dropped from it */
    cr_assert_eq(redis_state_delete(st, REDIS_STATE_SCHEMA, &a, "s3"), 1);
    cr_assert_eq(redis_state_list(st, REDIS_STATE_SCHEMA, &a, &items, &n), 0);
    cr_assert_eq(n, 2);
    redis_state_items_free(items, n);
    cr_assert_eq(redis_state_list(st, REDIS_STATE_PIN, &a, &items, &n), 0);
    cr_assert_eq(n, 0);
    redis_state_close(st);
}

Test(redis_state, damaged_values_are_misses_counted_and_deleted) {
    redis_state *st = open_state(1000);
    cache_key a = make_ns(NULL), b = make_ns("other");
    char key[256], key_b[256];
    item_key(&a, "r", key, sizeof key);
    item_key(&b, "r", key_b, sizeof key_b);
    const char *text = "{\"id\":\"r\"}";
    /* a flipped byte, a truncated value, a value that is no envelope */
    for (int damage = 0; damage < 3; damage++) {
        cr_assert_eq(redis_state_put(st, REDIS_STATE_RESPONSE, &a, "r", text, strlen(text), 0), 0);
        redisReply *rep = raw("GET %s", key, NULL, 0);
        cr_assert_eq(rep->type, REDIS_REPLY_STRING);
        char buf[512];
        size_t n = rep->len;
        memcpy(buf, rep->str, n);
        freeReplyObject(rep);
        if (damage == 0) buf[n - 3] ^= 1;
        if (damage == 1) n -= 4;
        if (damage == 2) memcpy(buf, "JUNK", 4);
        freeReplyObject(raw("SET %s %b", key, buf, n));
        char *v = NULL;
        cr_assert_eq(get_text(st, &a, "r", &v), 0, "damage %d", damage);
        cr_assert_null(v);
        cr_assert_eq(raw_int("EXISTS %s", key), 0, "damage %d: not deleted", damage);
    }
    /* another namespace's item copied over this one's key */
    cr_assert_eq(redis_state_put(st, REDIS_STATE_RESPONSE, &b, "r", text, strlen(text), 0), 0);
    redisReply *rep = raw("GET %s", key_b, NULL, 0);
    freeReplyObject(raw("SET %s %b", key, rep->str, rep->len));
    freeReplyObject(rep);
    char *v = NULL;
    cr_assert_eq(get_text(st, &a, "r", &v), 0);
    cr_assert_eq(get_text(st, &b, "r", &v), 1);
    free(v);
    redis_state_stats s;
    redis_state_stats_get(st, &s);
    cr_assert_eq(s.corrupt, 4);
    /* a damaged index (not a sorted set): an empty list, the index dropped */
    char nh[2 * CACHE_KEY_BYTES + 1], index[256];
    cache_key_hex(&a, nh);
    snprintf(index, sizeof index, "kvserve:s1:%s:resp:index", nh);
    freeReplyObject(raw("SET %s %b", index, "x", 1));
    redis_state_item *items;
    int n;
    cr_assert_eq(redis_state_list(st, REDIS_STATE_RESPONSE, &a, &items, &n), 0);
    cr_assert_eq(n, 0);
    cr_assert_eq(redis_state_put(st, REDIS_STATE_RESPONSE, &a, "r2", "x", 1, 0), 0);
    cr_assert_eq(redis_state_list(st, REDIS_STATE_RESPONSE, &a, &items, &n), 0);
    cr_assert_eq(n, 1);
    redis_state_items_free(items, n);
    redis_state_close(st);
}

Test(redis_state, a_stalled_redis_costs_one_timeout_then_nothing) {
    redis_state *st = open_state(200);
    cache_key a = make_ns(NULL);
    cr_assert_eq(redis_state_put(st, REDIS_STATE_RESPONSE, &a, "r", "x", 1, 0), 0);
    kill(srv.pid, SIGSTOP);
    uint64_t t0 = clock_now_ns();
    char *v = NULL;
    size_t len;
    cr_assert_eq(redis_state_get(st, REDIS_STATE_RESPONSE, &a, "r", &v, &len), -1);
    uint64_t first = clock_now_ns() - t0;
    cr_assert(first >= 150000000ull && first < 1000000000ull, "%llu ns", (unsigned long long)first);
    t0 = clock_now_ns();
    cr_assert_eq(redis_state_put(st, REDIS_STATE_RESPONSE, &a, "r", "y", 1, 0), -1);
    cr_assert_lt(clock_now_ns() - t0, 50000000ull, "the backoff did not skip Redis");
    kill(srv.pid, SIGCONT);
    int rc = -1;
    for (int i = 0; i < 100 && rc != 1; i++) {
        rc = redis_state_get(st, REDIS_STATE_RESPONSE, &a, "r", &v, &len);
        if (rc != 1) usleep(50000);
    }
    cr_assert_eq(rc, 1);
    cr_assert_str_eq(v, "x");
    free(v);
    redis_state_close(st);
}

Test(redis_state, redis_away_answers_unreachable_at_once_and_comes_back) {
    redis_state *st = open_state(200);
    cache_key a = make_ns(NULL);
    cr_assert_eq(redis_state_put(st, REDIS_STATE_RESPONSE, &a, "r", "x", 1, 0), 0);
    test_redis_stop(&srv);
    uint64_t t0 = clock_now_ns();
    char *v = NULL;
    size_t len;
    redis_state_item *items;
    int n;
    cr_assert_eq(redis_state_get(st, REDIS_STATE_RESPONSE, &a, "r", &v, &len), -1);
    cr_assert_eq(redis_state_put(st, REDIS_STATE_RESPONSE, &a, "r", "x", 1, 0), -1);
    cr_assert_eq(redis_state_delete(st, REDIS_STATE_RESPONSE, &a, "r"), -1);
    cr_assert_eq(redis_state_deleted(st, REDIS_STATE_RESPONSE, &a, "r"), -1);
    cr_assert_eq(redis_state_list(st, REDIS_STATE_RESPONSE, &a, &items, &n), -1);
    cr_assert_eq(n, 0);
    cr_assert_lt(clock_now_ns() - t0, 1000000000ull, "calls waited on a Redis that is gone");
    redis_state_stats s;
    redis_state_stats_get(st, &s);
    cr_assert(!s.connected);
    cr_assert_geq(s.write_errors, 1);
    /* back (empty, as after a flush): the state reconnects after its backoff */
    test_redis_start(&srv);
    int rc = -1;
    for (int i = 0; i < 100 && rc != 0; i++) {
        rc = redis_state_put(st, REDIS_STATE_RESPONSE, &a, "r", "y", 1, 0);
        if (rc) usleep(50000);
    }
    cr_assert_eq(rc, 0);
    cr_assert_eq(redis_state_get(st, REDIS_STATE_RESPONSE, &a, "r", &v, &len), 1);
    cr_assert_str_eq(v, "y");
    free(v);
    redis_state_close(st);
}

Test(redis_state, bad_urls_and_bounds_are_refused) {
    redis_state_bounds b[REDIS_STATE_KINDS];
    for (int k = 0; k < REDIS_STATE_KINDS; k++) b[k] = (redis_state_bounds){3600, 3, 1024};
    kv_error err = {{0}};
    cr_assert_null(redis_state_open("http://x", 100, b, &err));
    b[REDIS_STATE_PIN].max_per_ns = 0;
    cr_assert_null(redis_state_open(srv.url, 100, b, &err));
    cr_assert(strstr(err.msg, "out of range"), "%s", err.msg);
}
