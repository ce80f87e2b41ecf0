/* The Redis tier against a real redis-server started by each test on a free port (killed at exit,
 * also after a failed assertion, and by the kernel if the test process dies): URLs; put then
 * fetch, bit for bit; a record found by a middle block key; values corrupted, truncated, too
 * large, of another model or layout: refused, counted and deleted; Redis full (OOM): writes
 * counted as errors; Redis stalled (SIGSTOP) or killed: lookups miss within the timeout and puts
 * never block; Redis resumed or restarted: the tier reconnects after its backoff; clear by
 * namespace; every encoding (lossless, q8, codec levels) fetched as forced, and the fetch
 * policy's choices (text, lossless, budgets); values of another codec table not used (lossless
 * instead) and kept, corrupt coded values refused and deleted; a damaged generation replaced by
 * the next write. Then the store over it: a second store with its own RAM and disk finds the
 * first one's chunks. Then two shards behind nutcracker (twemproxy): records spread over both,
 * a damaged value deleted through the proxy, a clear without SCAN (generations), a shard
 * stalled, killed, restarted empty and flushed: misses for its records, never a wrong chunk.
 * Skips, saying so, where redis-server (or, for the shards, nutcracker) is not installed.
 */
#include <criterion/criterion.h>
#include <hiredis/hiredis.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cache/codec/chunk_codec.h"
#include "cache/store/record.h"
#include "cache/store/redis.h"
#include "tests/unit/chunk_fixture.h"
#include "tests/unit/redis_fixture.h"
#include "tests/unit/tmpdir.h"

/* ---------------------------------------------------------------- redis-server */

static test_redis srv = {.pid = -1};

static void redis_stop(void) { test_redis_stop(&srv); }
static void redis_start(void) { test_redis_start(&srv); }
static redisContext *raw_connect(void) { return test_redis_connect(&srv); }

static void setup(void) {
    signal(SIGPIPE, SIG_IGN); /* as kvserve serve does: hiredis writes with write() */
    atexit(redis_stop);
    redis_start();
}

static void teardown(void) { redis_stop(); }

TestSuite(cache_redis, .init = setup, .fini = teardown, .timeout = 60);

/* ---------------------------------------------------------------- chunks */

/* 2 layers, 1 KV head, head_dim 8, blocks of 16, chunks of 64: 1024 bytes a block, 4 a chunk. */
static cache_layout small_layout(uint8_t id) {
    cache_layout l = {
        .n_layer = 2, .n_kv_head = 1, .head_dim = 8, .block_tokens = 16, .chunk_tokens = 64};
    for (int i = 0; i < 32; i++) l.model_id[i] = (uint8_t)(id + i);
    return l;
}

static cache_key make_ns(const char *salt) {
    cache_key ns;
    cache_namespace((const uint8_t *)"tenant", 6, salt, &ns);
    return ns;
}

/* The block keys of a sequence of n_tokens tokens seed*1000 + t, except that tokens from
 * `diverge` on are shifted (a prompt that differs from there). */
static int seq_keys(const cache_layout *l, const cache_key *ns, int seed, int n_tokens, int diverge,
                    cache_key *bkeys) {
    int32_t tokens[512];
    cr_assert_leq(n_tokens, 512);
    for (int t = 0; t < n_tokens; t++) tokens[t] = seed * 1000 + t + (t >= diverge ? 500 : 0);
    return cache_prefix_keys(l->model_id, ns, tokens, n_tokens, l->block_tokens, bkeys, 32);
}

/* Chunk `index` of sequence seed, its first n_blocks blocks, with a payload from the seed. */
static cache_chunk *make_chunk(const cache_layout *l, const cache_key *ns, int seed, int index,
                               int n_blocks) {
    cache_key bkeys[32];
    int cb = cache_chunk_blocks(l);
    seq_keys(l, ns, seed, (index + 1) * l->chunk_tokens, 1 << 30, bkeys);
    cache_chunk *c =
        cache_chunk_create(l, bkeys + index * cb, n_blocks, ns, index * l->chunk_tokens);
    cr_assert_not_null(c);
    chunk_fill(c, 0x9E3779B97F4A7C15ull * (uint64_t)(seed * 31 + index + 1));
    return c;
}

/* The tier on the Redis at url: no TTL, 16 queued writes, 200 ms timeouts. */
static cache_redis *open_tier_at(const char *url, const cache_layout *l) {
    kv_error err = {{0}};
    cache_redis *r = cache_redis_open(url, l, NULL, 0, 16, 200, &err);
    cr_assert_not_null(r, "%s", err.msg);
    return r;
}

static cache_redis *open_tier(const cache_layout *l) { return open_tier_at(srv.url, l); }

/* cache_redis_fetch with the default policy: lossless, no budget. */
static int fetch_lossless(cache_redis *r, const cache_key *bkeys, int first, int n_blocks,
                          cache_chunk **out, int *upto, int max_out) {
    const cache_fetch_policy p = {.force_enc = CACHE_ENC_ANY};
    uint8_t enc[8];
    int n_text = 0;
    cr_assert_leq(max_out, 8);
    int n = cache_redis_fetch(r, bkeys, first, n_blocks, &p, out, upto, enc, max_out, &n_text);
    for (int i = 0; i < n; i++) cr_assert_eq(enc[i], CACHE_ENC_RAW);
    cr_assert_eq(n_text, 0);
    return n;
}

static cache_tier_stats stats(cache_redis *r, bool *connected) {
    cache_tier_stats st;
    bool up;
    cache_redis_stats(r, &st, connected ? connected : &up);
    return st;
}

/* The key of a record's value in encoding enc in Redis (cache/store/redis.h's layout; a codec
 * level's names its table t). */
static void value_name(const cache_layout *l, const codec_table *t, const cache_key *ns,
                       const cache_key *key, int enc, char *out, size_t n) {
    char mh[65], nh[65], kh[65], tag[24] = "r";
    cache_key mid;
    memcpy(mid.b, l->model_id, 32);
    cache_key_hex(&mid, mh);
    cache_key_hex(ns, nh);
    cache_key_hex(key, kh);
    if (enc >= CACHE_ENC_CODEC)
        snprintf(tag, sizeof tag, "e%d-%02x%02x%02x%02x", enc, t->id[0], t->id[1], t->id[2],
                 t->id[3]);
    else if (enc != CACHE_ENC_RAW)
        snprintf(tag, sizeof tag, "e%d", enc);
    snprintf(out, n, "kvserve:%d:%.16s-%dx%d:%s:%s:%s", CACHE_REDIS_KEY_VERSION, mh,
             l->block_tokens, l->chunk_tokens, nh, tag, kh);
}

static void record_name(const cache_layout *l, const cache_key *ns, const cache_key *key, char *out,
                        size_t n) {
    value_name(l, NULL, ns, key, CACHE_ENC_RAW, out, n);
}

static redisReply *raw(redisContext *c, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    redisReply *rep = redisvCommand(c, fmt, ap);
    va_end(ap);
    cr_assert_not_null(rep, "redis: %s", c->errstr);
    return rep;
}

static int64_t now_ms(void) { return (int64_t)(clock_now_ns() / 1000000); }

/* The record holding block 0 of a sequence of 4+ blocks whose keys are bkeys, into *out: 1, or
 * 0 (a miss). */
static int fetch_first(cache_redis *r, const cache_key *bkeys, cache_chunk **out) {
    int upto[1];
    return fetch_lossless(r, bkeys, 0, 4, out, upto, 1);
}

/* fetch_first, retried every 50 ms for up to 15 s (the reconnection backoff is at most 5 s);
 * reput, when not NULL, is written again before each try (a restarted Redis is empty). */
static int fetch_within(cache_redis *r, const cache_key *bkeys, cache_chunk *reput,
                        cache_chunk **out) {
    int64_t t0 = now_ms();
    for (;;) {
        if (reput) {
            cache_redis_put(r, reput);
            cache_redis_flush(r);
        }
        if (fetch_first(r, bkeys, out)) return 1;
        if (now_ms() - t0 >= 15000) return 0;
        usleep(50000);
    }
}

/* Chunk 0 (4 blocks) of sequence seed, written through r and found: its block keys into bkeys. */
static cache_chunk *put_found(cache_redis *r, const cache_layout *l, const cache_key *ns, int seed,
                              cache_key *bkeys) {
    cache_chunk *c = make_chunk(l, ns, seed, 0, 4), *out[1] = {0};
    cache_redis_put(r, c);
    cache_redis_flush(r);
    seq_keys(l, ns, seed, 64, 1 << 30, bkeys);
    cr_assert_eq(fetch_first(r, bkeys, out), 1);
    chunk_assert_same(out[0], c);
    cache_chunk_unref(out[0]);
    return c;
}

/* ---------------------------------------------------------------- URLs */

Test(cache_redis, urls) {
    cache_redis_addr a;
    kv_error err = {{0}};
    cr_assert_eq(cache_redis_parse_url("redis://localhost", &a, &err), 0, "%s", err.msg);
    cr_assert_str_eq(a.host, "localhost");
    cr_assert_eq(a.port, 6379);
    cr_assert_eq(a.db, 0);
    cr_assert_not(a.has_password);
    cr_assert_eq(cache_redis_parse_url("redis://:s3cret@10.0.0.2:7000/3", &a, &err), 0);
    cr_assert_str_eq(a.host, "10.0.0.2");
    cr_assert_eq(a.port, 7000);
    cr_assert_eq(a.db, 3);
    cr_assert(a.has_password);
    cr_assert_str_eq(a.password, "s3cret");
    cr_assert_eq(cache_redis_parse_url("unix:///run/redis.sock", &a, &err), 0);
    cr_assert_str_eq(a.path, "/run/redis.sock");
    const char *bad[] = {"",
                         "localhost:6379",
                         "http://localhost",
                         "redis://",
                         "redis://:6379",
                         "redis://host:0",
                         "redis://host:65536",
                         "redis://host:12x",
                         "redis://host/db",
                         "redis://user:pw@host",
                         "redis://[::1]:6379",
                         "unix://relative.sock"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        cr_assert_neq(cache_redis_parse_url(bad[i], &a, &err), 0, "accepted '%s'", bad[i]);
    cache_layout l = small_layout(1);
    cr_assert_null(cache_redis_open("redis://host:99999", &l, NULL, 0, 16, 200, &err));
    cr_assert(strstr(err.msg, "port"), "%s", err.msg);
}

/* ---------------------------------------------------------------- round trips */

Test(cache_redis, put_then_fetch_bit_for_bit) {
    cache_layout l = small_layout(1);
    cache_key ns = make_ns(NULL), bkeys[32];
    cache_redis *r = open_tier(&l);
    cache_chunk *c0 = make_chunk(&l, &ns, 7, 0, 4), *c1 = make_chunk(&l, &ns, 7, 1, 2);
    cr_assert(cache_redis_put(r, c0));
    cr_assert(cache_redis_put(r, c1));
    cache_redis_flush(r);
    int nb = seq_keys(&l, &ns, 7, 8 * 16, 1 << 30, bkeys); /* 2 chunks */
    cache_chunk *out[4] = {0};
    int upto[4];
    cr_assert_eq(fetch_lossless(r, bkeys, 0, nb, out, upto, 4), 2);
    chunk_assert_same(out[0], c0);
    chunk_assert_same(out[1], c1);
    cr_assert_eq(upto[0], 4);
    cr_assert_eq(upto[1], 6); /* the second record holds 2 of the chunk's 4 blocks */
    bool up = false;
    cache_tier_stats st = stats(r, &up);
    cr_assert(up);
    cr_assert_eq(st.hits, 2);
    cr_assert_eq(st.misses, 1); /* the sequence goes on past what Redis holds */
    /* Written: each record lossless and in q8 (no codec table), each value with its header;
     * read: the lossless values. */
    int64_t hdr = (int64_t)cache_record_header_bytes(&l);
    int64_t q8 = 2 * 2 * (4 + 8) * (64 + 32); /* layers x K/V x (min, step, codes) x tokens */
    cr_assert_eq(st.bytes_in, 4 * hdr + (int64_t)(c0->bytes + c1->bytes) + q8);
    cr_assert_eq(st.bytes_out, 2 * hdr + (int64_t)(c0->bytes + c1->bytes));
    cr_assert_eq(st.corrupt + st.write_errors + st.dropped, 0);
    for (int i = 0; i < 2; i++) cache_chunk_unref(out[i]);

    /* From a block inside the first chunk, and with room for one chunk only. */
    cr_assert_eq(fetch_lossless(r, bkeys, 2, nb, out, upto, 1), 1);
    chunk_assert_same(out[0], c0);
    cache_chunk_unref(out[0]);
    /* Another namespace's sequence: no alias, a miss. */
    cache_key other = make_ns("salt"), okeys[32];
    seq_keys(&l, &other, 7, 64, 1 << 30, okeys);
    cr_assert_eq(fetch_lossless(r, okeys, 0, 4, out, upto, 4), 0);
    cache_chunk_unref(c0);
    cache_chunk_unref(c1);
    cache_redis_close(r);
}

Test(cache_redis, found_by_a_middle_block_key) {
    cache_layout l = small_layout(1);
    cache_key ns = make_ns(NULL), bkeys[32];
    cache_redis *r = open_tier(&l);
    cache_chunk *c = make_chunk(&l, &ns, 3, 0, 4);
    cache_redis_put(r, c);
    cache_redis_flush(r);
    /* A prompt that shares the record's first 2 blocks, then diverges inside the chunk. */
    int nb = seq_keys(&l, &ns, 3, 64, 40, bkeys);
    cr_assert_eq(nb, 4);
    cache_chunk *out[2] = {0};
    int upto[2];
    cr_assert_eq(fetch_lossless(r, bkeys, 0, nb, out, upto, 2), 1);
    chunk_assert_same(out[0], c);
    cr_assert_eq(upto[0], 2);
    cache_chunk_unref(out[0]);

    /* A longer record of the chunk supersedes a shorter one: the aliases name it, the shorter
     * record is deleted. */
    cache_chunk *part = make_chunk(&l, &ns, 4, 0, 2), *full = make_chunk(&l, &ns, 4, 0, 4);
    cache_redis_put(r, part);
    cache_redis_flush(r);
    cache_redis_put(r, full);
    cache_redis_flush(r);
    seq_keys(&l, &ns, 4, 64, 1 << 30, bkeys);
    cr_assert_eq(fetch_lossless(r, bkeys, 0, 4, out, upto, 2), 1);
    chunk_assert_same(out[0], full);
    cache_chunk_unref(out[0]);
    char name[256];
    record_name(&l, &ns, &part->key, name, sizeof name);
    redisContext *rc = raw_connect();
    cr_assert_not_null(rc);
    redisReply *rep = raw(rc, "EXISTS %s", name);
    cr_assert_eq(rep->integer, 0);
    freeReplyObject(rep);
    redisFree(rc);
    cache_chunk_unref(c);
    cache_chunk_unref(part);
    cache_chunk_unref(full);
    cache_redis_close(r);
}

/* ---------------------------------------------------------------- values not to trust */

/* Puts chunk (seed 5, chunk 0) through r, then replaces its value with bad[0..len) (raw SET)
 * and fetches it: refused, counted, deleted. */
static void assert_refused(cache_redis *r, const cache_layout *l, const uint8_t *bad, size_t len,
                           int64_t corrupt_before) {
    cache_key ns = make_ns(NULL), bkeys[32];
    cache_chunk *c = make_chunk(l, &ns, 5, 0, 4);
    cache_redis_put(r, c);
    cache_redis_flush(r);
    char name[256];
    record_name(l, &ns, &c->key, name, sizeof name);
    redisContext *rc = raw_connect();
    cr_assert_not_null(rc);
    freeReplyObject(raw(rc, "SET %s %b", name, bad, len));
    seq_keys(l, &ns, 5, 64, 1 << 30, bkeys);
    cache_chunk *out[1] = {0};
    cr_assert_eq(fetch_first(r, bkeys, out), 0);
    cr_assert_null(out[0]);
    cr_assert_eq(stats(r, NULL).corrupt, corrupt_before + 1);
    redisReply *rep = raw(rc, "EXISTS %s", name);
    cr_assert_eq(rep->integer, 0, "a refused value is deleted");
    freeReplyObject(rep);
    redisFree(rc);
    cache_chunk_unref(c);
}

/* The value cache/store/redis.c writes for c: header, then payload. */
static uint8_t *encode(const cache_layout *l, const cache_chunk *c, size_t *len) {
    size_t hb = cache_record_header_bytes(l);
    uint8_t *v = malloc(hb + c->bytes);
    cr_assert_not_null(v);
    cache_record_encode_header(l, c, v);
    memcpy(v + hb, c->data, c->bytes);
    *len = hb + c->bytes;
    return v;
}

Test(cache_redis, corrupt_truncated_and_oversized_values_refused) {
    cache_layout l = small_layout(1);
    cache_key ns = make_ns(NULL);
    cache_redis *r = open_tier(&l);
    cache_chunk *c = make_chunk(&l, &ns, 5, 0, 4);
    size_t len;
    uint8_t *v = encode(&l, c, &len);
    size_t hb = cache_record_header_bytes(&l);
    int64_t n = 0;
    /* A flipped payload byte, a flipped header byte, truncations, a byte too many, garbage. */
    v[hb + 100] ^= 0x10;
    assert_refused(r, &l, v, len, n++);
    v[hb + 100] ^= 0x10;
    v[60] ^= 0x01;
    assert_refused(r, &l, v, len, n++);
    v[60] ^= 0x01;
    assert_refused(r, &l, v, len - 1, n++);
    assert_refused(r, &l, v, hb, n++);
    assert_refused(r, &l, v, 100, n++);
    uint8_t *big = calloc(1, len + 1);
    memcpy(big, v, len);
    assert_refused(r, &l, big, len + 1, n++);
    assert_refused(r, &l, (const uint8_t *)"hello", 5, n++);
    /* An empty value. */
    assert_refused(r, &l, v, 0, n++);
    free(big);
    free(v);
    cache_chunk_unref(c);
    cache_redis_close(r);
}

Test(cache_redis, other_model_or_layout_refused) {
    cache_layout l = small_layout(1), other_model = small_layout(9), other_layout = small_layout(1);
    other_layout.n_layer = 1; /* a smaller payload: refused for its layout, not its size */
    cache_key ns = make_ns(NULL);
    cache_redis *r = open_tier(&l);
    size_t len;
    /* The same chunk (keys and positions) encoded for another model, then another layout. */
    cache_chunk *c = make_chunk(&l, &ns, 5, 0, 4);
    uint8_t *v = encode(&other_model, c, &len);
    assert_refused(r, &l, v, len, 0);
    free(v);
    cache_chunk *c3 = cache_chunk_create(&other_layout, c->bkeys, 4, &ns, 0);
    cr_assert_not_null(c3);
    memset(c3->data, 7, c3->bytes);
    v = encode(&other_layout, c3, &len);
    assert_refused(r, &l, v, len, 1);
    free(v);
    cache_chunk_unref(c3);
    cache_chunk_unref(c);

    /* Tiers of other models or chunk sizes use other keys: a miss, nothing refused. */
    cache_layout other_chunks = small_layout(1);
    other_chunks.chunk_tokens = 32;
    cache_redis *r2 = open_tier(&other_chunks), *r3 = open_tier(&other_model);
    cache_chunk *c2 = make_chunk(&other_chunks, &ns, 6, 0, 2),
                *c9 = make_chunk(&other_model, &ns, 6, 0, 4);
    cache_redis_put(r2, c2);
    cache_redis_put(r3, c9);
    cache_redis_flush(r2);
    cache_redis_flush(r3);
    cache_key bkeys[32];
    seq_keys(&l, &ns, 6, 64, 1 << 30, bkeys);
    cache_chunk *out[1] = {0};
    cr_assert_eq(fetch_first(r, bkeys, out), 0);
    cr_assert_eq(stats(r, NULL).corrupt, 2);
    cache_chunk_unref(c2);
    cache_chunk_unref(c9);
    cache_redis_close(r2);
    cache_redis_close(r3);
    cache_redis_close(r);
}

/* ---------------------------------------------------------------- failures */

Test(cache_redis, down_then_restarted) {
    cache_layout l = small_layout(1);
    cache_key ns = make_ns(NULL), bkeys[32];
    cache_redis *r = open_tier(&l);
    cache_chunk *c = put_found(r, &l, &ns, 8, bkeys), *out[1] = {0};

    redis_stop();
    int64_t t0 = now_ms();
    for (int i = 0; i < 20; i++) cr_assert_eq(fetch_first(r, bkeys, out), 0);
    cr_assert_lt(now_ms() - t0, 2000, "lookups while Redis is down took %lld ms",
                 (long long)(now_ms() - t0));
    t0 = now_ms();
    int queued = 0;
    for (int i = 0; i < 200; i++) queued += cache_redis_put(r, c);
    cr_assert_lt(now_ms() - t0, 200, "puts blocked");
    cache_redis_flush(r);
    bool up = true;
    cache_tier_stats st = stats(r, &up);
    cr_assert_not(up);
    cr_assert_eq(st.write_errors + st.dropped, 200, "every put failed or was dropped");
    cr_assert_eq(st.dropped, 200 - queued);
    cr_assert_geq(st.misses, 20);

    /* Back on the same port (empty: no persistence): writes and lookups work again once the
     * backoff (at most 5 s) has passed. */
    redis_start();
    cr_assert_eq(fetch_within(r, bkeys, c, out), 1, "no reconnection within 15 s");
    chunk_assert_same(out[0], c);
    cache_chunk_unref(out[0]);
    stats(r, &up);
    cr_assert(up);
    cache_chunk_unref(c);
    cache_redis_close(r);
}

Test(cache_redis, stalled_redis_times_out) {
    cache_layout l = small_layout(1);
    cache_key ns = make_ns(NULL), bkeys[32];
    cache_redis *r = open_tier(&l);
    cache_chunk *c = make_chunk(&l, &ns, 10, 0, 4);
    cache_redis_put(r, c);
    cache_redis_flush(r);
    seq_keys(&l, &ns, 10, 64, 1 << 30, bkeys);
    /* Stopped, Redis still accepts connections (the kernel's backlog) but answers nothing: each
     * wait ends at the 200 ms timeout, and the backoff keeps the next lookups from waiting. */
    kill(srv.pid, SIGSTOP);
    cache_chunk *out[1] = {0};
    int64_t t0 = now_ms();
    for (int i = 0; i < 10; i++) cr_assert_eq(fetch_first(r, bkeys, out), 0);
    cr_assert_lt(now_ms() - t0, 2000, "lookups took %lld ms", (long long)(now_ms() - t0));
    t0 = now_ms();
    for (int i = 0; i < 50; i++) cache_redis_put(r, c);
    cr_assert_lt(now_ms() - t0, 200, "puts blocked");
    bool up = true;
    stats(r, &up);
    cr_assert_not(up);
    kill(srv.pid, SIGCONT);
    cr_assert_eq(fetch_within(r, bkeys, NULL, out), 1, "no recovery within 15 s");
    chunk_assert_same(out[0], c);
    cache_chunk_unref(out[0]);
    cache_redis_flush(r);
    cache_chunk_unref(c);
    cache_redis_close(r);
}

Test(cache_redis, full_redis_refuses_writes) {
    cache_layout l = small_layout(1);
    cache_key ns = make_ns(NULL), bkeys[32];
    cache_redis *r = open_tier(&l);
    redisContext *rc = raw_connect();
    cr_assert_not_null(rc);
    /* maxmemory below what Redis uses already: every write gets an OOM error */
    freeReplyObject(raw(rc, "CONFIG SET maxmemory-policy noeviction"));
    freeReplyObject(raw(rc, "CONFIG SET maxmemory 1"));
    cache_chunk *c = make_chunk(&l, &ns, 9, 0, 4);
    cr_assert(cache_redis_put(r, c));
    cache_redis_flush(r);
    bool up = false;
    cache_tier_stats st = stats(r, &up);
    cr_assert_eq(st.write_errors, 1);
    cr_assert_eq(st.bytes_in, 0);
    cr_assert(up, "a refused write is not a lost connection");
    seq_keys(&l, &ns, 9, 64, 1 << 30, bkeys);
    cache_chunk *out[1] = {0};
    cr_assert_eq(fetch_first(r, bkeys, out), 0);
    /* room again: the same connection writes */
    freeReplyObject(raw(rc, "CONFIG SET maxmemory 0"));
    cache_redis_put(r, c);
    cache_redis_flush(r);
    cr_assert_eq(fetch_first(r, bkeys, out), 1);
    chunk_assert_same(out[0], c);
    cache_chunk_unref(out[0]);
    redisFree(rc);
    cache_chunk_unref(c);
    cache_redis_close(r);
}

Test(cache_redis, clear_by_namespace) {
    cache_layout l = small_layout(1);
    cache_key a = make_ns("a"), b = make_ns("b"), bkeys[32];
    cache_redis *r = open_tier(&l);
    cache_chunk *ca = make_chunk(&l, &a, 1, 0, 4), *cb = make_chunk(&l, &b, 1, 0, 4);
    cache_redis_put(r, ca);
    cache_redis_put(r, cb);
    cache_redis_flush(r);
    cr_assert_eq(cache_redis_clear(r, &a), 1);
    cache_chunk *out[1] = {0};
    seq_keys(&l, &a, 1, 64, 1 << 30, bkeys);
    cr_assert_eq(fetch_first(r, bkeys, out), 0);
    seq_keys(&l, &b, 1, 64, 1 << 30, bkeys);
    cr_assert_eq(fetch_first(r, bkeys, out), 1);
    cache_chunk_unref(out[0]);
    cr_assert_eq(cache_redis_clear(r, NULL), 1);
    cr_assert_eq(fetch_first(r, bkeys, out), 0);
    redisContext *rc = raw_connect();
    redisReply *rep = raw(rc, "DBSIZE");
    /* the aliases too; what is left is the new generation of every namespace */
    cr_assert_eq(rep->integer, 1, "a clear of everything drops the aliases too");
    freeReplyObject(rep);
    redisFree(rc);
    cache_chunk_unref(ca);
    cache_chunk_unref(cb);
    cache_redis_close(r);
}

Test(cache_redis, a_damaged_generation_costs_hits_until_a_write_replaces_it) {
    cache_layout l = small_layout(1);
    cache_key ns = make_ns(NULL), bkeys[32];
    cache_redis *r = open_tier(&l);
    cache_chunk *c = put_found(r, &l, &ns, 12, bkeys), *out[1] = {0};
    /* every namespace's generation: 3 bytes, not 8 */
    char name[256], mh[65];
    cache_key mid;
    memcpy(mid.b, l.model_id, 32);
    cache_key_hex(&mid, mh);
    snprintf(name, sizeof name, "kvserve:%d:%.16s-%dx%d:g", CACHE_REDIS_KEY_VERSION, mh,
             l.block_tokens, l.chunk_tokens);
    redisContext *rc = raw_connect();
    cr_assert_not_null(rc);
    freeReplyObject(raw(rc, "SET %s abc", name));
    cr_assert_eq(fetch_first(r, bkeys, out), 0);
    /* the next write sets a new one: what it writes is found, nothing older */
    cache_chunk *c2 = make_chunk(&l, &ns, 13, 0, 4);
    cache_redis_put(r, c2);
    cache_redis_flush(r);
    redisReply *rep = raw(rc, "STRLEN %s", name);
    cr_assert_eq(rep->integer, 8);
    freeReplyObject(rep);
    cr_assert_eq(fetch_first(r, bkeys, out), 0);
    seq_keys(&l, &ns, 13, 64, 1 << 30, bkeys);
    cr_assert_eq(fetch_first(r, bkeys, out), 1);
    chunk_assert_same(out[0], c2);
    cache_chunk_unref(out[0]);
    cr_assert_eq(stats(r, NULL).write_errors, 0);
    redisFree(rc);
    cache_chunk_unref(c);
    cache_chunk_unref(c2);
    cache_redis_close(r);
}

/* ---------------------------------------------------------------- encodings, fetch policy */

static cache_redis *open_coded(const cache_layout *l, const codec_table *t) {
    kv_error err = {{0}};
    cache_redis *r = cache_redis_open(srv.url, l, t, 0, 16, 2000, &err);
    cr_assert_not_null(r, "%s", err.msg);
    return r;
}

/* Chunk `index` of sequence seed with a KV-like payload (codecs code it as they would KV). */
static cache_chunk *kv_chunk(const cache_layout *l, const cache_key *ns, int seed, int index) {
    cache_chunk *c = make_chunk(l, ns, seed, index, 4);
    chunk_fill_kv(c, l, (uint64_t)seed);
    return c;
}

/* A fetch of a 2-chunk sequence under policy p: chunks into out[], their encodings into enc[]. */
static int fetch_policy(cache_redis *r, const cache_key *bkeys, const cache_fetch_policy *p,
                        cache_chunk **out, uint8_t *enc, int *n_text) {
    int upto[2];
    return cache_redis_fetch(r, bkeys, 0, 8, p, out, upto, enc, 2, n_text);
}

/* Two KV-like chunks of sequence seed (its first 128 tokens) written through r; their block keys
 * into bkeys. */
static void put_two(cache_redis *r, const cache_layout *l, const cache_key *ns, int seed,
                    cache_chunk *c[2], cache_key *bkeys) {
    for (int i = 0; i < 2; i++) {
        c[i] = kv_chunk(l, ns, seed, i);
        cache_redis_put(r, c[i]);
    }
    cache_redis_flush(r);
    seq_keys(l, ns, seed, 128, 1 << 30, bkeys);
}

Test(cache_redis, every_encoding_through_redis_and_the_policy) {
    cache_layout l = small_layout(1);
    cache_key ns = make_ns(NULL), bkeys[32];
    codec_table t;
    chunk_codec_table(&t, &l, 1, 3);
    cache_redis *r = open_coded(&l, &t);
    cache_chunk *c[2];
    put_two(r, &l, &ns, 3, c, bkeys);
    cache_chunk *out[2] = {0};
    uint8_t enc[2];
    int n_text = -1;
    /* Each encoding, forced: what came is what that encoding makes of the chunk, bit for bit. */
    for (int e = 0; e < cache_enc_count(&t); e++) {
        cache_fetch_policy p = {.force_enc = e};
        cr_assert_eq(fetch_policy(r, bkeys, &p, out, enc, &n_text), 2, "encoding %d", e);
        for (int i = 0; i < 2; i++) {
            cr_assert_eq(enc[i], e);
            cache_chunk *want = chunk_coded_copy(&l, &t, e, c[i]);
            chunk_assert_same(out[i], want);
            cache_chunk_unref(want);
            cache_chunk_unref(out[i]);
        }
        cr_assert_eq(n_text, 0);
        cr_assert_eq(stats(r, NULL).enc_hits[e], 2);
    }
    /* Text: nothing read, both chunks left to be computed. */
    cache_fetch_policy text = {.force_enc = CACHE_ENC_TEXT};
    cr_assert_eq(fetch_policy(r, bkeys, &text, out, enc, &n_text), 0);
    cr_assert_eq(n_text, 2);
    /* Computing is measured faster than any fetch could be: text, budget or not, but only from
     * the second chunk on while the link is unmeasured (values this small time the round trip,
     * not the link): the first is fetched (lossless with no budget, the fastest under one
     * nothing can meet). */
    cache_fetch_policy fast = {.force_enc = CACHE_ENC_ANY, .text_ns_per_token = 1e-9};
    for (int k = 0; k < 2; k++) {
        fast.budget_ns = k;
        cr_assert_eq(fetch_policy(r, bkeys, &fast, out, enc, &n_text), 1);
        if (k == 0) cr_assert_eq(enc[0], CACHE_ENC_RAW);
        cr_assert_eq(n_text, 1);
        cache_chunk_unref(out[0]);
    }
    /* Exact KV fits a generous budget, and a request insisting on it gets it under any. */
    cache_fetch_policy roomy = {.force_enc = CACHE_ENC_ANY, .budget_ns = INT64_C(60000000000)};
    cache_fetch_policy strict = {.force_enc = CACHE_ENC_ANY, .lossless = true, .budget_ns = 1};
    for (int k = 0; k < 2; k++) {
        cr_assert_eq(fetch_policy(r, bkeys, k ? &strict : &roomy, out, enc, &n_text), 2);
        for (int i = 0; i < 2; i++) {
            cr_assert_eq(enc[i], CACHE_ENC_RAW);
            chunk_assert_same(out[i], c[i]);
            cache_chunk_unref(out[i]);
        }
    }
    cache_tier_stats st = stats(r, NULL);
    cr_assert_eq(st.text, 4);
    cr_assert_eq(st.corrupt, 0);
    for (int i = 0; i < 2; i++) cache_chunk_unref(c[i]);
    cache_redis_close(r);
    codec_table_free(&t);
}

Test(cache_redis, another_codec_tables_values_are_not_used_and_kept) {
    cache_layout l = small_layout(1);
    cache_key ns = make_ns(NULL), bkeys[32];
    codec_table t1, t2;
    chunk_codec_table(&t1, &l, 1, 3);
    chunk_codec_table(&t2, &l, 1.5f, 3);
    cr_assert_neq(memcmp(t1.id, t2.id, 4), 0);
    cache_redis *a = open_coded(&l, &t1), *b = open_coded(&l, &t2);
    cache_chunk *c[2];
    put_two(a, &l, &ns, 4, c, bkeys);
    cache_chunk *out[2] = {0};
    uint8_t enc[2];
    int n_text;
    /* a's codec values are named with a's table: b finds none of its own, and takes the
     * lossless values instead, never decoding a's with its table */
    cache_fetch_policy coded = {.force_enc = CACHE_ENC_CODEC + 1};
    cr_assert_eq(fetch_policy(b, bkeys, &coded, out, enc, &n_text), 2);
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(enc[i], CACHE_ENC_RAW);
        chunk_assert_same(out[i], c[i]);
        cache_chunk_unref(out[i]);
    }
    cr_assert_eq(stats(b, NULL).corrupt, 0);
    /* and a's are kept: good for the instances with a's table */
    char name[256];
    value_name(&l, &t1, &ns, &c[0]->key, CACHE_ENC_CODEC + 1, name, sizeof name);
    redisContext *rc = raw_connect();
    redisReply *rep = raw(rc, "EXISTS %s", name);
    cr_assert_eq(rep->integer, 1);
    freeReplyObject(rep);
    redisFree(rc);
    cr_assert_eq(fetch_policy(a, bkeys, &coded, out, enc, &n_text), 2);
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(enc[i], CACHE_ENC_CODEC + 1);
        cache_chunk_unref(out[i]);
    }
    /* b's own writes of the same chunks sit beside a's, each under its table */
    for (int i = 0; i < 2; i++) cache_redis_put(b, c[i]);
    cache_redis_flush(b);
    cr_assert_eq(fetch_policy(b, bkeys, &coded, out, enc, &n_text), 2);
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(enc[i], CACHE_ENC_CODEC + 1);
        cache_chunk_unref(out[i]);
    }
    cr_assert_eq(fetch_policy(a, bkeys, &coded, out, enc, &n_text), 2);
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(enc[i], CACHE_ENC_CODEC + 1);
        cache_chunk_unref(out[i]);
    }
    for (int i = 0; i < 2; i++) cache_chunk_unref(c[i]);
    cache_redis_close(a);
    cache_redis_close(b);
    codec_table_free(&t1);
    codec_table_free(&t2);
}

Test(cache_redis, a_corrupt_coded_value_is_refused_and_deleted) {
    cache_layout l = small_layout(1);
    cache_key ns = make_ns(NULL), bkeys[32];
    codec_table t;
    chunk_codec_table(&t, &l, 1, 3);
    cache_redis *r = open_coded(&l, &t);
    cache_chunk *c[2];
    put_two(r, &l, &ns, 5, c, bkeys);
    /* one byte of the second chunk's codec2 payload flipped */
    char name[256];
    value_name(&l, &t, &ns, &c[1]->key, CACHE_ENC_CODEC + 2, name, sizeof name);
    redisContext *rc = raw_connect();
    int at = (int)cache_record_header_bytes(&l) + 100;
    redisReply *rep = raw(rc, "GETRANGE %s %d %d", name, at, at);
    cr_assert_eq(rep->type, REDIS_REPLY_STRING);
    cr_assert_eq(rep->len, 1);
    char flipped[2] = {(char)(rep->str[0] ^ 0x10), 0};
    freeReplyObject(rep);
    rep = redisCommand(rc, "SETRANGE %s %d %b", name, at, flipped, (size_t)1);
    freeReplyObject(rep);
    cache_chunk *out[2] = {0};
    uint8_t enc[2];
    int n_text;
    cache_fetch_policy coded = {.force_enc = CACHE_ENC_CODEC + 2};
    cr_assert_eq(fetch_policy(r, bkeys, &coded, out, enc, &n_text), 1, "the prefix ends there");
    cache_chunk_unref(out[0]);
    cr_assert_eq(stats(r, NULL).corrupt, 1);
    rep = raw(rc, "EXISTS %s", name);
    cr_assert_eq(rep->integer, 0);
    freeReplyObject(rep);
    redisFree(rc);
    for (int i = 0; i < 2; i++) cache_chunk_unref(c[i]);
    cache_redis_close(r);
    codec_table_free(&t);
}

/* ---------------------------------------------------------------- two stores, one Redis */

Test(cache_redis, second_store_reuses_the_first_ones_chunks) {
    cache_layout l = small_layout(1);
    cache_key ns = make_ns(NULL), bkeys[32];
    char *dir1 = tmpdir_create("kvserve-redis-store-"),
         *dir2 = tmpdir_create("kvserve-redis-store-");
    cache_store_opts o = {.ram_bytes = 1 << 20,
                          .dir = dir1,
                          .disk_bytes = 1 << 20,
                          .redis_url = srv.url,
                          .redis_ttl_s = 60};
    kv_error err = {{0}};
    cache_store *s1 = cache_store_open(&l, &o, &err);
    cr_assert_not_null(s1, "%s", err.msg);
    o.dir = dir2;
    cache_store *s2 = cache_store_open(&l, &o, &err);
    cr_assert_not_null(s2, "%s", err.msg);
    cache_chunk *c0 = make_chunk(&l, &ns, 2, 0, 4), *c1 = make_chunk(&l, &ns, 2, 1, 4);
    cache_store_put(s1, c0);
    cache_store_put(s1, c1);
    cache_store_flush(s1);
    int nb = seq_keys(&l, &ns, 2, 128, 1 << 30, bkeys);
    cr_assert_not(cache_store_holds(s2, &bkeys[3]), "holds answers from RAM and disk only");
    cache_chunk *out[2] = {0};
    int n = 0, n_text = 0;
    cr_assert_eq(cache_store_fetch(s2, bkeys, 0, nb, NULL, out, NULL, 2, &n, &n_text), 8);
    cr_assert_eq(n, 2);
    chunk_assert_same(out[0], c0);
    chunk_assert_same(out[1], c1);
    for (int i = 0; i < n; i++) cache_chunk_unref(out[i]);
    cache_stats st;
    cache_store_stats(s2, &st);
    cr_assert(st.redis_enabled && st.redis_connected);
    cr_assert_eq(st.redis.hits, 2);
    /* Promoted: into s2's RAM, and onto its disk. */
    cache_store_flush(s2);
    cr_assert(cache_store_holds(s2, &bkeys[3]));
    cr_assert_eq(cache_store_fetch(s2, bkeys, 0, nb, NULL, out, NULL, 2, &n, &n_text), 8);
    for (int i = 0; i < n; i++) cache_chunk_unref(out[i]);
    cache_store_stats(s2, &st);
    cr_assert_eq(st.redis.hits, 2);
    cr_assert_eq(st.disk.bytes_in, (int64_t)(c0->bytes + c1->bytes));
    /* The key TTL is set. */
    char name[256];
    record_name(&l, &ns, &c0->key, name, sizeof name);
    redisContext *rc = raw_connect();
    redisReply *rep = raw(rc, "TTL %s", name);
    cr_assert(rep->integer > 0 && rep->integer <= 60, "TTL %lld", rep->integer);
    freeReplyObject(rep);
    redisFree(rc);
    cache_chunk_unref(c0);
    cache_chunk_unref(c1);
    cache_store_close(s1);
    cache_store_close(s2);
    free(dir1);
    free(dir2);
}

/* ---------------------------------------------------------------- shards behind twemproxy */

/* Two redis-server shards behind nutcracker, configured as scripts/cluster.py configures it
 * (ketama over fnv1a_64; a shard that fails one command is ejected, its keys answered by the
 * other, and tried again after server_retry_timeout: 300 ms here, 2 s there). */
#define SHARD_RETRY_MS 300

typedef struct test_shards {
    pid_t pid[2], proxy;
    int port[2], proxy_port;
    char *dir;
    char url[64]; /* the proxy's */
} test_shards;

static test_shards sh = {.pid = {-1, -1}, .proxy = -1};

static void shards_stop(void) {
    fixture_kill(sh.proxy);
    for (int i = 0; i < 2; i++) fixture_kill(sh.pid[i]);
    sh.proxy = sh.pid[0] = sh.pid[1] = -1;
}

static void shards_setup(void) {
    signal(SIGPIPE, SIG_IGN);
    if (access(NUTCRACKER, X_OK) != 0)
        cr_skip_test("nutcracker (twemproxy) is not installed: scripts/setup.sh installs it");
    atexit(shards_stop);
    sh.dir = tmpdir_create("kvserve-redis-shards-");
    for (int i = 0; i < 2; i++) {
        sh.port[i] = fixture_free_port();
        sh.pid[i] = fixture_redis_start(sh.port[i], sh.dir);
    }
    sh.proxy_port = fixture_free_port();
    char conf[512], path[256], stats_port[16];
    snprintf(conf, sizeof conf,
             "kvserve:\n  listen: 127.0.0.1:%d\n  redis: true\n  hash: fnv1a_64\n"
             "  distribution: ketama\n  timeout: 100\n  auto_eject_hosts: true\n"
             "  server_retry_timeout: %d\n  server_failure_limit: 1\n  servers:\n"
             "   - 127.0.0.1:%d:1 shard0\n   - 127.0.0.1:%d:1 shard1\n",
             sh.proxy_port, SHARD_RETRY_MS, sh.port[0], sh.port[1]);
    snprintf(path, sizeof path, "%s/nutcracker.yml", sh.dir);
    FILE *f = fopen(path, "w");
    cr_assert(f && fputs(conf, f) >= 0 && fclose(f) == 0);
    snprintf(stats_port, sizeof stats_port, "%d", fixture_free_port());
    const char *argv[] = {NUTCRACKER, "-c", path, "-s", stats_port, "-o", "/dev/null", NULL};
    sh.proxy = fixture_spawn(argv);
    cr_assert(fixture_ping_within(sh.proxy_port), "nutcracker did not start");
    snprintf(sh.url, sizeof sh.url, "redis://127.0.0.1:%d", sh.proxy_port);
}

TestSuite(cache_redis_shards, .init = shards_setup, .fini = shards_stop, .timeout = 60);

#define SHARD_SEQS 8

static redisContext *shard_connect(int i) {
    struct timeval tv = {.tv_sec = 1};
    redisContext *c = redisConnectWithTimeout("127.0.0.1", sh.port[i], tv);
    cr_assert(c && !c->err, "shard %d: %s", i, c ? c->errstr : "out of memory");
    return c;
}

static int64_t shard_dbsize(int i) {
    redisContext *c = shard_connect(i);
    redisReply *rep = raw(c, "DBSIZE");
    int64_t n = rep->integer;
    freeReplyObject(rep);
    redisFree(c);
    return n;
}

/* SHARD_SEQS one-chunk sequences (seeds 40 ..) of namespace ns written through r. */
static void shards_put(cache_redis *r, const cache_layout *l, const cache_key *ns,
                       cache_chunk **c) {
    for (int i = 0; i < SHARD_SEQS; i++) {
        c[i] = make_chunk(l, ns, 40 + i, 0, 4);
        cr_assert(cache_redis_put(r, c[i]));
    }
    cache_redis_flush(r);
}

/* Looks each sequence up: how many were found; every chunk found must be the one written. */
static int shards_fetch(cache_redis *r, const cache_layout *l, const cache_key *ns,
                        cache_chunk **c) {
    int found = 0;
    for (int i = 0; i < SHARD_SEQS; i++) {
        cache_key bkeys[32];
        cache_chunk *out[1] = {0};
        seq_keys(l, ns, 40 + i, 64, 1 << 30, bkeys);
        if (fetch_first(r, bkeys, out) == 0) continue;
        chunk_assert_same(out[0], c[i]);
        cache_chunk_unref(out[0]);
        found++;
    }
    return found;
}

static cache_redis *open_proxied(const cache_layout *l) { return open_tier_at(sh.url, l); }

/* The tier through the proxy, with the SHARD_SEQS sequences of the default namespace written. */
static cache_redis *shards_begin(cache_layout *l, cache_key *ns, cache_chunk **c) {
    *l = small_layout(1);
    *ns = make_ns(NULL);
    cache_redis *r = open_proxied(l);
    shards_put(r, l, ns, c);
    return r;
}

static void shards_unref(cache_chunk **c) {
    for (int i = 0; i < SHARD_SEQS; i++) cache_chunk_unref(c[i]);
}

Test(cache_redis_shards, records_spread_over_the_shards_and_bad_values_are_deleted) {
    cache_layout l;
    cache_key ns;
    cache_chunk *c[SHARD_SEQS];
    cache_redis *r = shards_begin(&l, &ns, c);
    cr_assert_eq(shards_fetch(r, &l, &ns, c), SHARD_SEQS);
    cr_assert(shard_dbsize(0) > 0 && shard_dbsize(1) > 0, "one shard holds every key");
    /* a damaged value on its shard: refused, counted, deleted through the proxy (UNLINK) */
    char name[256];
    record_name(&l, &ns, &c[0]->key, name, sizeof name);
    for (int i = 0; i < 2; i++) {
        redisContext *rc = shard_connect(i);
        redisReply *rep = raw(rc, "EXISTS %s", name);
        if (rep->integer) freeReplyObject(raw(rc, "SETRANGE %s 100 x", name));
        freeReplyObject(rep);
        redisFree(rc);
    }
    cr_assert_eq(shards_fetch(r, &l, &ns, c), SHARD_SEQS - 1);
    cr_assert_eq(stats(r, NULL).corrupt, 1);
    cr_assert_eq(shard_dbsize(0) + shard_dbsize(1), 8 * (2 + 4) - 1); /* lossless, q8, aliases */
    shards_unref(c);
    cache_redis_close(r);
}

/* A content record of namespace ns (16 tokens, seed's payload), written through r. */
static content_rec *put_content(cache_redis *r, const cache_layout *l, const cache_key *ns,
                                uint8_t seed) {
    cache_key key;
    memset(key.b, seed, sizeof key.b);
    content_rec *cr = content_rec_create(l->n_layer, l->n_kv_head * l->head_dim, 16, &key, ns, 0);
    cr_assert_not_null(cr);
    memset(cr->data, seed, cr->bytes);
    cr_assert(cache_redis_put_content(r, cr));
    cache_redis_flush(r);
    return cr;
}

static bool content_found(cache_redis *r, const content_rec *cr) {
    content_rec *out = NULL;
    int n_tok = cr->n_tok;
    int n = cache_redis_fetch_content(r, &cr->ns, &cr->key, &n_tok, 1, &out);
    bool same = n == 1 && out->bytes == cr->bytes && memcmp(out->data, cr->data, cr->bytes) == 0;
    cr_assert(n == 0 || same, "a content record came back changed");
    if (out) content_rec_unref(out);
    return n == 1;
}

Test(cache_redis_shards, a_clear_through_the_proxy_makes_records_unreachable) {
    cache_layout l = small_layout(1);
    cache_key a = make_ns("a"), b = make_ns("b");
    cache_redis *r = open_proxied(&l);
    cache_chunk *ca[SHARD_SEQS], *cb[SHARD_SEQS];
    shards_put(r, &l, &a, ca);
    shards_put(r, &l, &b, cb);
    content_rec *xa = put_content(r, &l, &a, 3), *xb = put_content(r, &l, &b, 4);
    cr_assert(content_found(r, xa) && content_found(r, xb));
    int64_t keys = shard_dbsize(0) + shard_dbsize(1);
    /* twemproxy refuses SCAN: nothing is deleted (0 counted), a's generation changes */
    cr_assert_eq(cache_redis_clear(r, &a), 0);
    cr_assert_eq(shards_fetch(r, &l, &a, ca), 0);
    cr_assert_not(content_found(r, xa));
    cr_assert_eq(shards_fetch(r, &l, &b, cb), SHARD_SEQS);
    cr_assert(content_found(r, xb));
    cr_assert_eq(shard_dbsize(0) + shard_dbsize(1), keys + 1, "the values are left to expire");
    bool up = false;
    stats(r, &up);
    cr_assert(up, "a refused SCAN is not a lost connection");
    /* a's records written again are found; a clear of everything reaches every namespace */
    shards_put(r, &l, &a, ca);
    cr_assert_eq(shards_fetch(r, &l, &a, ca), SHARD_SEQS);
    cr_assert_eq(cache_redis_clear(r, NULL), 0);
    cr_assert_eq(shards_fetch(r, &l, &a, ca) + shards_fetch(r, &l, &b, cb), 0);
    cr_assert_not(content_found(r, xb));
    cr_assert_eq(stats(r, NULL).corrupt, 0);
    content_rec_unref(xa);
    content_rec_unref(xb);
    shards_unref(ca);
    shards_unref(cb);
    cache_redis_close(r);
}

/* Writes the sequences again and looks them up every 50 ms until all are found (a restarted
 * shard is empty, and back in the proxy's ring after SHARD_RETRY_MS); false after 10 s. */
static bool shards_recover(cache_redis *r, const cache_layout *l, const cache_key *ns,
                           cache_chunk **c) {
    for (int64_t t0 = now_ms(); now_ms() - t0 < 10000; usleep(50000)) {
        for (int i = 0; i < SHARD_SEQS; i++) cache_redis_put(r, c[i]);
        cache_redis_flush(r);
        if (shards_fetch(r, l, ns, c) == SHARD_SEQS) return true;
    }
    return false;
}

Test(cache_redis_shards, a_shard_slow_down_or_flushed_costs_hits_never_a_wrong_chunk) {
    cache_layout l;
    cache_key ns;
    cache_chunk *c[SHARD_SEQS];
    cache_redis *r = shards_begin(&l, &ns, c);
    /* Slow (stopped): the proxy answers an error after its 100 ms timeout, below the tier's
     * 200 ms, and ejects the shard; the MGET retried gets the other shard's keys. */
    kill(sh.pid[1], SIGSTOP);
    int64_t t0 = now_ms();
    int slow = shards_fetch(r, &l, &ns, c);
    int64_t took = now_ms() - t0;
    bool up = false;
    stats(r, &up);
    kill(sh.pid[1], SIGCONT);
    cr_assert(slow > 0 && slow < SHARD_SEQS, "%d of %d found with a shard stalled", slow,
              SHARD_SEQS);
    cr_assert_lt(took, 1500, "lookups took %lld ms", (long long)took);
    cr_assert(up, "the proxy's error replies are not a lost connection");
    /* back in the ring after the retry timeout, with every value it held */
    usleep((SHARD_RETRY_MS + 100) * 1000);
    cr_assert_eq(shards_fetch(r, &l, &ns, c), SHARD_SEQS, "not every record found after the stall");
    /* Down: the same, at once; its keys go to the other shard meanwhile. */
    fixture_kill(sh.pid[1]);
    t0 = now_ms();
    int down = shards_fetch(r, &l, &ns, c);
    cr_assert(down > 0 && down < SHARD_SEQS, "%d of %d found with a shard down", down, SHARD_SEQS);
    cr_assert_lt(now_ms() - t0, 1000);
    shards_put(r, &l, &ns, c);
    cr_assert_eq(shards_fetch(r, &l, &ns, c), SHARD_SEQS, "written again: on the other shard");
    shards_unref(c);
    /* Restarted, empty: back in the ring after the retry timeout; found once written again. */
    sh.pid[1] = fixture_redis_start(sh.port[1], sh.dir);
    usleep((SHARD_RETRY_MS + 100) * 1000);
    shards_put(r, &l, &ns, c);
    cr_assert(shards_recover(r, &l, &ns, c), "not every record found after the restart");
    cr_assert_gt(shard_dbsize(1), 0, "the restarted shard is not back in the ring");
    /* Flushed: its records are misses, the other shard's still found. */
    redisContext *rc = shard_connect(0);
    freeReplyObject(raw(rc, "FLUSHALL"));
    redisFree(rc);
    int flushed = shards_fetch(r, &l, &ns, c);
    cr_assert(flushed > 0 && flushed < SHARD_SEQS, "%d of %d found", flushed, SHARD_SEQS);
    cr_assert_eq(stats(r, NULL).corrupt, 0);
    shards_unref(c);
    cache_redis_close(r);
}
