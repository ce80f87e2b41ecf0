/* The Redis tier of the chunk store (cache/store/redis.h): hiredis's blocking API with timeouts
 * over two connections (cache/store/redis_link.h: timeouts, backoff, state logged when it
 * changes), one for lookups (the callers' threads, one at a time) and one for the write-behind
 * thread, so a lookup never waits behind a queue of multi-megabyte SETs.
 *
 * Trust. Everything Redis sends is checked: reply types, the alias's length, the record's size
 * (at most a full chunk's), header and payload checksums, model identity and layout, the key the
 * alias named. A value failing a check is counted as corrupt, deleted, and the chunk is a miss. */
#include <hiredis/hiredis.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/time.h>

#include "cache/codec/chunk_codec.h"
#include "cache/codec/meter.h"
#include "cache/store/content_disk.h"
#include "cache/store/record.h"
#include "cache/store/redis.h"
#include "cache/store/redis_link.h"

#define REDIS_KEY_VERSION CACHE_REDIS_KEY_VERSION
#define REDIS_MAX_WRITE_QUEUE (1 << 20)
#define REDIS_KEY_LEN                                                                              \
    224 /* longest: "kvserve:4:" + 16 + "-16x4096:" + 64 + ":e9-12345678:" + 64                    \
         */
/* An alias: the record key, its namespace, the generations it was written under (every
 * namespace's, then its own: u64 each), then u32 sizes of the record's values, one per
 * encoding (0: not stored), as many as the writer offered. */
#define REDIS_GEN_BYTES 8
#define REDIS_ALIAS_HEAD (2 * CACHE_KEY_BYTES + 2 * REDIS_GEN_BYTES)
#define REDIS_ALIAS_MAX (REDIS_ALIAS_HEAD + 4 * CACHE_ENC_MAX)
/* Before a lookup has measured the link, it is taken to move 1 Gb/s (bytes per ns). */
#define REDIS_PRIOR_BW 0.125
#define REDIS_SCAN_COUNT "512"

/* A record queued for writing: a chunk record, or a content record (cache/store/content.h). */
typedef struct redis_item {
    cache_chunk *chunk;
    content_rec *content;
} redis_item;

struct cache_redis {
    cache_layout layout;
    const codec_table *table; /* the codec's levels (NULL: lossless and q8 only); borrowed */
    int n_enc;                /* cache_enc_count(table) */
    size_t header_bytes;      /* cache_record_header_bytes(layout) */
    size_t max_value;         /* a full chunk's record: header + chunk payload */
    size_t max_payload;       /* the largest encoded payload of a chunk */
    int decode_threads;
    cache_redis_addr addr;
    char prefix[48]; /* "kvserve:<version>:<model>-<block_tokens>x<chunk_tokens>:" */
    int64_t ttl_s;
    int write_queue;

    pthread_mutex_t lookup_mu; /* guards lookup, scratch */
    redis_link lookup;
    float *scratch; /* [cache_enc_scratch_floats]: decoding */

    pthread_mutex_t mu; /* guards what follows */
    pthread_cond_t work, done;
    redis_item *wq; /* ring [write_queue] of records to write, each holding a reference */
    int wq_head, wq_len;
    int n_writes; /* queued + in flight */
    bool stop;
    cache_tier_stats st;
    redis_health health; /* both links' state; its url names Redis in messages */
    cache_meter meter;   /* the lookup link and the decoders (cache/codec/meter.h) */

    pthread_t thread; /* the write thread, and its connection */
    bool thread_started;
    redis_link writer;
    uint8_t *value;   /* [header_bytes + max_payload]: the record being written */
    float *w_scratch; /* [cache_enc_scratch_floats]: encoding */
    bool refusing;    /* Redis answered the last write with an error (write thread) */
    bool no_scan;     /* Redis (a proxy) refused SCAN: clears bump generations only (lookup_mu) */
};

/* The generations a value was written under, or that are current: every namespace's, and its
 * namespace's (0: never cleared). */
typedef struct redis_gens {
    uint64_t all, ns;
} redis_gens;

/* ---------------------------------------------------------------- keys */

/* A record's value in encoding enc: ":r:" holds the lossless one, ":e<enc>:" the others. */
static void key_value(const cache_redis *r, const cache_key *ns, const cache_key *key, int enc,
                      char out[REDIS_KEY_LEN]) {
    char nh[2 * CACHE_KEY_BYTES + 1], kh[2 * CACHE_KEY_BYTES + 1], tag[24] = "r";
    cache_key_hex(ns, nh);
    cache_key_hex(key, kh);
    if (enc >= CACHE_ENC_CODEC) /* named with the table: instances with other tables miss */
        snprintf(tag, sizeof tag, "e%d-%02x%02x%02x%02x", enc & 0xff, r->table->id[0],
                 r->table->id[1], r->table->id[2], r->table->id[3]);
    else if (enc != CACHE_ENC_RAW)
        snprintf(tag, sizeof tag, "e%d", enc & 0xff);
    snprintf(out, REDIS_KEY_LEN, "%s%s:%s:%s", r->prefix, nh, tag, kh);
}

/* A generation's key: <prefix>g for every namespace (ns NULL), <prefix><ns>:g for one. */
static void key_gen(const cache_redis *r, const cache_key *ns, char out[REDIS_KEY_LEN]) {
    char nh[2 * CACHE_KEY_BYTES + 1];
    if (!ns) {
        snprintf(out, REDIS_KEY_LEN, "%sg", r->prefix);
        return;
    }
    cache_key_hex(ns, nh);
    snprintf(out, REDIS_KEY_LEN, "%s%s:g", r->prefix, nh);
}

static void key_alias(const cache_redis *r, const cache_key *bkey, char out[REDIS_KEY_LEN]) {
    char kh[2 * CACHE_KEY_BYTES + 1];
    cache_key_hex(bkey, kh);
    snprintf(out, REDIS_KEY_LEN, "%sb:%s", r->prefix, kh);
}

/* ---------------------------------------------------------------- lookups */

/* Checks a value read under the alias (record key, namespace) in encoding enc, and makes a chunk
 * of it (decoded on n_threads); NULL with err when any check fails. *stale is set when the
 * value itself is wrong (torn, corrupt, another key), so it should be deleted, and left false
 * when only the decode refused it (a codec table other than this instance's). */
static cache_chunk *value_decode(cache_redis *r, const redisReply *v, const cache_key *key,
                                 const cache_key *ns, int enc, bool *stale, kv_error *err) {
    *stale = true;
    if (v->type != REDIS_REPLY_STRING) {
        kv_fail(err, "not a string (reply type %d)", v->type);
        return NULL;
    }
    size_t max = enc == CACHE_ENC_RAW ? r->max_value : r->header_bytes + r->max_payload;
    if (v->len > max) {
        kv_fail(err, "%zu bytes, more than a full chunk's record (%zu)", v->len, max);
        return NULL;
    }
    const uint8_t *buf = (const uint8_t *)v->str;
    cache_record_info info;
    if (cache_record_decode_header_encoded(buf, v->len, &r->layout, r->max_payload, &info, err))
        return NULL;
    if (memcmp(info.key.b, key->b, CACHE_KEY_BYTES) != 0 ||
        memcmp(info.ns.b, ns->b, CACHE_KEY_BYTES) != 0 || info.level != (uint32_t)enc) {
        kv_fail(err, "the record names another key, namespace or encoding than its alias");
        return NULL;
    }
    if (v->len != r->header_bytes + info.payload_bytes) {
        kv_fail(err, "%zu bytes, the header says %zu", v->len,
                r->header_bytes + (size_t)info.payload_bytes);
        return NULL;
    }
    if (cache_record_check_payload(&info, buf + r->header_bytes, err) != 0) return NULL;
    cache_chunk *c = cache_chunk_create(&r->layout, (const cache_key *)(const void *)info.bkeys,
                                        info.n_blocks, &info.ns, info.pos0);
    if (!c) {
        *stale = false;
        kv_fail(err, "out of memory");
        return NULL;
    }
    if (cache_enc_decode(&r->layout, r->table, enc, buf + r->header_bytes,
                         (size_t)info.payload_bytes, c, r->scratch, r->decode_threads, err)) {
        /* The checksum held: the writer's table or codec differs from this instance's. */
        *stale = false;
        cache_chunk_unref(c);
        return NULL;
    }
    return c;
}

/* Deletes bad values (one round trip; a failure only leaves them for the next reader). */
static void delete_keys(redis_link *c, char (*keys)[REDIS_KEY_LEN], int n) {
    if (n == 0 || !c->ctx) return;
    const char **argv = malloc(sizeof *argv * (size_t)(n + 1));
    if (!argv) return;
    argv[0] = "UNLINK";
    for (int i = 0; i < n; i++) argv[i + 1] = keys[i];
    redisReply *rep = NULL;
    if (redisAppendCommandArgv(c->ctx, n + 1, argv, NULL) == REDIS_OK) rep = redis_link_reply(c);
    if (rep) freeReplyObject(rep);
    free(argv);
}

/* MGET of names[0..n): the array of their n values, or NULL (the caller misses). An error reply
 * for the whole MGET is retried once, on a new connection: twemproxy answers one when a shard
 * that some of the keys are on fails, closes the connection, and ejects the shard, so the retry
 * gets what the other shards hold. */
static redisReply *mget(cache_redis *r, redis_link *c, char (*names)[REDIS_KEY_LEN], int n) {
    const char **argv = malloc(sizeof *argv * (size_t)(n + 1));
    redisReply *rep = NULL;
    if (!argv) return NULL;
    argv[0] = "MGET";
    for (int i = 0; i < n; i++) argv[i + 1] = names[i];
    for (int attempt = 0; attempt < 2; attempt++) {
        if (redisAppendCommandArgv(c->ctx, n + 1, argv, NULL) != REDIS_OK) {
            redis_link_fail(c, "cannot build a command");
            break;
        }
        if (!(rep = redis_link_reply(c)) || rep->type != REDIS_REPLY_ERROR) break;
        log_debug("cache: redis %s: MGET answered %.*s", r->health.url, (int)rep->len, rep->str);
        freeReplyObject(rep);
        rep = NULL;
        redis_link_drop(c);
        if (attempt == 1 || !redis_link_get(c)) break;
    }
    free(argv);
    if (rep && (rep->type != REDIS_REPLY_ARRAY || rep->elements != (size_t)n)) {
        freeReplyObject(rep);
        return NULL;
    }
    return rep;
}

/* The aliases of blocks [first, n_blocks): one MGET. Returns the reply (an array of
 * n_blocks - first elements), or NULL. */
static redisReply *mget_aliases(cache_redis *r, redis_link *c, const cache_key *bkeys, int first,
                                int n_blocks) {
    int n = n_blocks - first;
    char(*keys)[REDIS_KEY_LEN] = malloc(sizeof *keys * (size_t)n);
    if (!keys) return NULL;
    for (int i = 0; i < n; i++) key_alias(r, &bkeys[first + i], keys[i]);
    redisReply *rep = mget(r, c, keys, n);
    free(keys);
    return rep;
}

/* ---------------------------------------------------------------- generations */

/* A clear through a proxy cannot list the keys it would delete (twemproxy refuses SCAN), so
 * it makes them unreachable: <prefix>g and <prefix><ns>:g hold the generation of every
 * namespace and of one (8 random bytes each clear sets; no key: 0, never cleared). Aliases and
 * content values carry the two generations current when they were written, and a lookup takes
 * them only while both still are; the values left behind expire with their TTL. A generation
 * key that a shard loses (restarted empty) reads 0 again: values written before the clear are
 * found again (verified KV, as any), those written after it are not. */

/* A generation's value: nil is 0; false for anything but nil or 8 bytes (damaged). */
static bool gen_parse(const redisReply *v, uint64_t *g) {
    *g = 0;
    if (v->type == REDIS_REPLY_NIL) return true;
    if (v->type != REDIS_REPLY_STRING || v->len != REDIS_GEN_BYTES) return false;
    *g = le_get_u64((const uint8_t *)v->str);
    return true;
}

/* Both generations from the first two values of an MGET reply; false when either is damaged. */
static bool gens_parse(const redisReply *rep, redis_gens *g) {
    bool all = gen_parse(rep->element[0], &g->all);
    return gen_parse(rep->element[1], &g->ns) && all;
}

/* The names of ns's two generation keys, into names[0..2). */
static void gens_names(const cache_redis *r, const cache_key *ns, char (*names)[REDIS_KEY_LEN]) {
    key_gen(r, NULL, names[0]);
    key_gen(r, ns, names[1]);
}

/* Sets the generation of ns's scope (NULL: every namespace) to a new random one, into *out. */
static bool gen_bump(cache_redis *r, redis_link *c, const cache_key *ns, uint64_t *out) {
    uint8_t g[REDIS_GEN_BYTES];
    char name[REDIS_KEY_LEN];
    if (kv_random(g, sizeof g) != 0) return false;
    if (le_get_u64(g) == 0) g[0] = 1; /* 0 is "never cleared" */
    key_gen(r, ns, name);
    const char *argv[3] = {"SET", name, (const char *)g};
    size_t len[3] = {3, strlen(name), sizeof g};
    redisReply *rep = NULL;
    if (redis_link_get(c) && redisAppendCommandArgv(c->ctx, 3, argv, len) == REDIS_OK)
        rep = redis_link_reply(c);
    bool ok = rep && rep->type == REDIS_REPLY_STATUS;
    if (rep) freeReplyObject(rep);
    if (ok && out) *out = le_get_u64(g);
    return ok;
}

/* The generations current for ns, for a writer: a damaged one (not 8 bytes) is replaced by a new
 * one, as a clear would, so that it costs hits once rather than every write. */
static bool gens_for_write(cache_redis *r, redis_link *c, const cache_key *ns, redis_gens *g) {
    char names[2][REDIS_KEY_LEN];
    gens_names(r, ns, names);
    redisReply *rep = mget(r, c, names, 2);
    if (!rep) return false;
    bool all = gen_parse(rep->element[0], &g->all), one = gen_parse(rep->element[1], &g->ns);
    freeReplyObject(rep);
    if (!all || !one)
        log_warn("cache: redis %s: a damaged generation replaced (records written before it are "
                 "missed)",
                 r->health.url);
    return (all || gen_bump(r, c, NULL, &g->all)) && (one || gen_bump(r, c, ns, &g->ns));
}

static bool alias_ok(const redisReply *a) {
    return a->type == REDIS_REPLY_STRING && a->len > REDIS_ALIAS_HEAD &&
           a->len <= REDIS_ALIAS_MAX && (a->len - REDIS_ALIAS_HEAD) % 4 == 0;
}

/* One record a lookup continues the prefix with: its names and the sizes of its values. */
typedef struct fetch_rec {
    cache_key key, ns;
    redis_gens gens;              /* the generations its alias was written under */
    uint64_t size[CACHE_ENC_MAX]; /* value bytes per encoding, 0: not stored */
    int tokens;
    int enc;         /* the encoding asked for */
    redisReply *rep; /* its value, once read (the decoder frees it) */
    uint64_t t_sent; /* when its GET was sent */
} fetch_rec;

/* The encoding for chunk i of n (cache_meter_choose): CACHE_ENC_TEXT to compute it and the
 * chunks after it from their text. Called with r->mu held. */
static int choose_enc(const cache_redis *r, const cache_fetch_policy *p, const fetch_rec *recs,
                      int i, int n, uint64_t t0, cache_meter_plan *plan) {
    return cache_meter_choose(&r->meter, p, recs[i].size, recs[i].tokens, i, n, t0, true, plan);
}

/* The decoder: a thread that turns the values the lookup thread reads into chunks, so chunk i
 * decodes while chunk i + 1 travels. */
typedef struct decoder {
    cache_redis *r;
    fetch_rec *recs;
    cache_chunk **out;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int queued;  /* recs[0..queued) have their value */
    bool closed; /* no more will come */
    int done;    /* recs[0..done) decoded into out[] */
    bool failed; /* recs[done] was refused: nothing after it is decoded */
    char bad[REDIS_KEY_LEN];
    bool bad_stale; /* delete bad */
    int64_t bytes_out;
} decoder;

static void *decoder_thread(void *arg) {
    decoder *d = arg;
    cache_redis *r = d->r;
    pthread_mutex_lock(&d->mu);
    for (int i = 0;; i++) {
        while (i >= d->queued && !d->closed) pthread_cond_wait(&d->cv, &d->mu);
        if (i >= d->queued) break;
        pthread_mutex_unlock(&d->mu);
        fetch_rec *f = &d->recs[i];
        kv_error err = {{0}};
        bool stale = false;
        cache_chunk *c = NULL;
        uint64_t t0 = clock_now_ns();
        /* nil (expired, evicted or cleared) or an error reply (e.g. LOADING): a plain miss */
        bool value = f->rep->type == REDIS_REPLY_STRING;
        if (value) c = value_decode(r, f->rep, &f->key, &f->ns, f->enc, &stale, &err);
        uint64_t dt = clock_now_ns() - t0;
        if (!c && value) {
            key_value(r, &f->ns, &f->key, f->enc, d->bad);
            d->bad_stale = stale && strcmp(err.msg, "out of memory") != 0;
            log_warn("cache: redis %s: refusing %s: %s", r->health.url, d->bad, err.msg);
        }
        if (c) { /* never r->mu under d->mu: the reading thread takes them the other way */
            pthread_mutex_lock(&r->mu);
            cache_meter_decode(&r->meter, f->enc, (double)c->bytes / 2, dt);
            pthread_mutex_unlock(&r->mu);
        }
        pthread_mutex_lock(&d->mu);
        if (!c) {
            d->failed = true;
            break;
        }
        d->out[i] = c;
        d->done = i + 1;
        d->bytes_out += (int64_t)f->rep->len;
        freeReplyObject(f->rep); /* the wire copy goes as soon as the chunk is made */
        f->rep = NULL;
    }
    pthread_mutex_unlock(&d->mu);
    return NULL;
}

/* Sends the GET of f's value in f->enc. */
static bool send_get(cache_redis *r, redis_link *c, fetch_rec *f) {
    char name[REDIS_KEY_LEN];
    key_value(r, &f->ns, &f->key, f->enc, name);
    const char *argv[2] = {"GET", name};
    f->t_sent = clock_now_ns();
    if (redisAppendCommandArgv(c->ctx, 2, argv, NULL) != REDIS_OK) {
        redis_link_fail(c, "cannot build a command");
        return false;
    }
    return true;
}

/* Reads the values of recs[0..n) in order, each GET sent once the one before it has arrived
 * (its encoding chosen on what that one measured), while the decoder turns them into out[].
 * Returns how many chunks out[] got; *n_text: chunks left to be computed from text. */
static int stream_values(cache_redis *r, redis_link *c, fetch_rec *recs, int n,
                         const cache_fetch_policy *p, uint64_t t0, cache_chunk **out, int *n_text,
                         int *corrupt) {
    decoder d = {.r = r, .recs = recs, .out = out};
    pthread_mutex_init(&d.mu, NULL);
    pthread_cond_init(&d.cv, NULL);
    pthread_t th;
    bool threaded = pthread_create(&th, NULL, decoder_thread, &d) == 0;
    int sent = 0, text_from = n; /* chunks from text_from on are left to text */
    cache_meter_plan plan = {0, 0};
    pthread_mutex_lock(&r->mu);
    recs[0].enc = choose_enc(r, p, recs, 0, n, t0, &plan);
    pthread_mutex_unlock(&r->mu);
    if (!threaded)
        log_warn("cache: redis %s: cannot start a decoder thread (a miss)", r->health.url);
    else if (recs[0].enc == CACHE_ENC_TEXT)
        text_from = 0;
    else if (send_get(r, c, &recs[0]))
        sent = 1;
    for (int i = 0; i < sent;) {
        redisReply *rep = redis_link_reply(c);
        if (!rep) break;
        uint64_t now = clock_now_ns();
        fetch_rec *f = &recs[i];
        if (rep->type != REDIS_REPLY_STRING && f->enc != CACHE_ENC_RAW && f->size[CACHE_ENC_RAW]) {
            /* that encoding is gone (evicted, or written under another codec table): the
             * lossless value instead */
            freeReplyObject(rep);
            f->enc = CACHE_ENC_RAW;
            if (!send_get(r, c, f)) break;
            continue;
        }
        f->rep = rep;
        pthread_mutex_lock(&d.mu);
        bool more = rep->type == REDIS_REPLY_STRING && i + 1 < n && !d.failed;
        pthread_mutex_unlock(&d.mu);
        pthread_mutex_lock(&r->mu);
        if (rep->type == REDIS_REPLY_STRING) cache_meter_link(&r->meter, rep->len, now - f->t_sent);
        if (more) recs[i + 1].enc = choose_enc(r, p, recs, i + 1, n, t0, &plan);
        pthread_mutex_unlock(&r->mu);
        if (more && recs[i + 1].enc == CACHE_ENC_TEXT)
            text_from = i + 1;
        else if (more && send_get(r, c, &recs[i + 1]))
            sent++;
        pthread_mutex_lock(&d.mu);
        d.queued = ++i;
        pthread_cond_signal(&d.cv);
        pthread_mutex_unlock(&d.mu);
    }
    pthread_mutex_lock(&d.mu);
    d.closed = true;
    pthread_cond_signal(&d.cv);
    pthread_mutex_unlock(&d.mu);
    if (threaded) pthread_join(th, NULL);
    if (d.failed && d.bad[0]) {
        (*corrupt)++;
        if (d.bad_stale) delete_keys(c, &d.bad, 1);
    }
    /* text continues the prefix only from where the fetched chunks end */
    *n_text = d.done == text_from ? n - text_from : 0;
    for (int i = 0; i < n; i++)
        if (recs[i].rep) freeReplyObject(recs[i].rep);
    pthread_mutex_destroy(&d.mu);
    pthread_cond_destroy(&d.cv);
    pthread_mutex_lock(&r->mu);
    r->st.bytes_out += d.bytes_out;
    pthread_mutex_unlock(&r->mu);
    return d.done;
}

/* How many of recs[0..n) were written under the generations current now (one MGET of the first
 * one's namespace's): the prefix ends at the first that was not. 0 when Redis did not say. */
static int gens_current(cache_redis *r, redis_link *c, const fetch_rec *recs, int n) {
    char names[2][REDIS_KEY_LEN];
    redis_gens now;
    gens_names(r, &recs[0].ns, names);
    redisReply *rep = mget(r, c, names, 2);
    bool ok = rep && gens_parse(rep, &now);
    if (rep) freeReplyObject(rep);
    int i = 0;
    while (ok && i < n && recs[i].gens.all == now.all && recs[i].gens.ns == now.ns &&
           memcmp(recs[i].ns.b, recs[0].ns.b, CACHE_KEY_BYTES) == 0)
        i++;
    return i;
}

int cache_redis_fetch(cache_redis *r, const cache_key *bkeys, int first, int n_blocks,
                      const cache_fetch_policy *policy, cache_chunk **out, int *upto,
                      uint8_t *enc_out, int max_out, int *n_text) {
    *n_text = 0;
    if (first >= n_blocks || max_out <= 0) return 0;
    uint64_t t0 = policy->start_ns ? policy->start_ns : clock_now_ns();
    int cb = cache_chunk_blocks(&r->layout), bt = r->layout.block_tokens;
    int n = 0, m = 0, misses = 0, corrupt = 0;
    fetch_rec *recs = calloc((size_t)max_out, sizeof *recs);
    redisReply *aliases = NULL;
    pthread_mutex_lock(&r->lookup_mu);
    redis_link *c = &r->lookup;
    if (!recs || !redis_link_get(c) || !(aliases = mget_aliases(r, c, bkeys, first, n_blocks))) {
        misses = 1;
        goto done;
    }

    /* The walk of cache_store_fetch over the aliases: per chunk, the furthest block aliased. */
    for (int j = first; j < n_blocks && n < max_out;) {
        int end = (j / cb + 1) * cb < n_blocks ? (j / cb + 1) * cb : n_blocks, b = end - 1;
        while (b >= j && !alias_ok(aliases->element[b - first])) b--;
        if (b < j) break;
        const redisReply *a = aliases->element[b - first];
        fetch_rec *f = &recs[n];
        memcpy(f->key.b, a->str, CACHE_KEY_BYTES);
        memcpy(f->ns.b, a->str + CACHE_KEY_BYTES, CACHE_KEY_BYTES);
        f->gens.all = le_get_u64((const uint8_t *)a->str + 2 * CACHE_KEY_BYTES);
        f->gens.ns = le_get_u64((const uint8_t *)a->str + 2 * CACHE_KEY_BYTES + REDIS_GEN_BYTES);
        for (size_t e = 0; e < (a->len - REDIS_ALIAS_HEAD) / 4; e++)
            f->size[e] = le_get_u32((const uint8_t *)a->str + REDIS_ALIAS_HEAD + 4 * e);
        f->tokens = (b + 1 - (j / cb) * cb) * bt;
        upto[n++] = b + 1;
        j = b + 1;
        if (j < end) break;
    }
    if (n == 0 || (upto[n - 1] < n_blocks && n < max_out)) misses = 1;
    int current = n ? gens_current(r, c, recs, n) : 0;
    if (current < n) misses = 1;
    n = current;
    if (n == 0) goto done;
    m = stream_values(r, c, recs, n, policy, t0, out, n_text, &corrupt);
    for (int i = 0; i < m; i++) enc_out[i] = (uint8_t)recs[i].enc;
    if (m + *n_text < n) misses = 1;
done:
    pthread_mutex_unlock(&r->lookup_mu);
    if (aliases) freeReplyObject(aliases);
    free(recs);
    pthread_mutex_lock(&r->mu);
    r->st.hits += m;
    for (int i = 0; i < m; i++) r->st.enc_hits[enc_out[i]]++;
    r->st.text += *n_text;
    r->st.misses += misses;
    r->st.corrupt += corrupt;
    pthread_mutex_unlock(&r->mu);
    return m;
}

/* ---------------------------------------------------------------- writes */

/* Appends SET name value (EX ttl when the tier has one) to the connection's pipeline. */
static bool append_set(const cache_redis *r, redis_link *c, const char *name, const void *value,
                       size_t len) {
    char ttl[24];
    snprintf(ttl, sizeof ttl, "%lld", (long long)r->ttl_s);
    const char *argv[5] = {"SET", name, value, "EX", ttl};
    size_t argvlen[5] = {3, strlen(name), len, 2, strlen(ttl)};
    return redisAppendCommandArgv(c->ctx, r->ttl_s > 0 ? 5 : 3, argv, argvlen) == REDIS_OK;
}

/* One pipeline: the record's value in every encoding the tier offers (coarsest first, lossless
 * last), then each block's alias listing their sizes (so an alias never names a value not yet
 * stored), then UNLINK of the values of the same chunk's records that hold a prefix of c's
 * blocks (their keys are c's earlier block keys; c supersedes them, as on disk). True when every
 * reply was OK; else the first error Redis answered (e.g. OOM under maxmemory) goes to refused. */
static bool write_chunk(cache_redis *r, redis_link *c, cache_chunk *ch, char *refused,
                        size_t refused_len, int64_t *bytes) {
    char name[REDIS_KEY_LEN];
    int n_cmd = 0;
    bool ok = true;
    uint8_t alias[REDIS_ALIAS_MAX] = {0};
    redis_gens g;
    *bytes = 0;
    if (!gens_for_write(r, c, &ch->ns, &g)) return false;
    memcpy(alias, ch->key.b, CACHE_KEY_BYTES);
    memcpy(alias + CACHE_KEY_BYTES, ch->ns.b, CACHE_KEY_BYTES);
    le_put_u64(alias + 2 * CACHE_KEY_BYTES, g.all);
    le_put_u64(alias + 2 * CACHE_KEY_BYTES + REDIS_GEN_BYTES, g.ns);
    for (int e = r->n_enc - 1; e >= 0 && ok; e--) {
        kv_error err = {{0}};
        uint8_t *payload = r->value + r->header_bytes;
        int64_t len = cache_enc_encode(&r->layout, r->table, e, ch, r->w_scratch, payload,
                                       r->max_payload, &err);
        if (len <= 0) { /* stored without that encoding: lookups take another */
            log_debug("cache: redis: chunk not encoded as %d: %s", e, err.msg);
            continue;
        }
        cache_record_encode_header_as(&r->layout, ch, (uint32_t)e, payload, (size_t)len, r->value);
        size_t vlen = r->header_bytes + (size_t)len;
        le_put_u32(alias + REDIS_ALIAS_HEAD + 4 * e, (uint32_t)vlen);
        key_value(r, &ch->ns, &ch->key, e, name);
        ok = append_set(r, c, name, r->value, vlen);
        n_cmd += ok;
        *bytes += (int64_t)vlen;
    }
    size_t alias_len = REDIS_ALIAS_HEAD + 4 * (size_t)r->n_enc;
    for (int b = 0; b < ch->n_blocks && ok; b++) {
        key_alias(r, &ch->bkeys[b], name);
        ok = append_set(r, c, name, alias, alias_len);
        n_cmd += ok;
    }
    /* one UNLINK for every value of the records c supersedes (this instance's encodings;
     * another table's expire with their TTL) */
    int n_old = (ch->n_blocks - 1) * r->n_enc;
    if (n_old > 0 && ok) {
        char(*names)[REDIS_KEY_LEN] = malloc(sizeof *names * (size_t)n_old);
        const char **uv = malloc(sizeof *uv * (size_t)(n_old + 1));
        ok = names && uv;
        for (int b = 0, k = 0; ok && b + 1 < ch->n_blocks; b++)
            for (int e = 0; e < r->n_enc; e++, k++) {
                key_value(r, &ch->ns, &ch->bkeys[b], e, names[k]);
                uv[k + 1] = names[k];
            }
        if (ok) {
            uv[0] = "UNLINK";
            ok = redisAppendCommandArgv(c->ctx, n_old + 1, uv, NULL) == REDIS_OK;
            n_cmd += ok;
        }
        free(names);
        free(uv);
    }
    bool all = redis_link_replies(c, n_cmd, refused, refused_len) && ok;
    if (!ok && c->ctx) redis_link_fail(c, "cannot build a command");
    return all;
}

/* A content record's key: ":c:" beside the chunk records of its namespace. */
static void key_content(const cache_redis *r, const cache_key *ns, const cache_key *key,
                        char out[REDIS_KEY_LEN]) {
    char nh[2 * CACHE_KEY_BYTES + 1], kh[2 * CACHE_KEY_BYTES + 1];
    cache_key_hex(ns, nh);
    cache_key_hex(key, kh);
    snprintf(out, REDIS_KEY_LEN, "%s%s:c:%s", r->prefix, nh, kh);
}

/* One SET of a content record, lossless: the generations it is written under (u64 each), then
 * the record in its disk file's format (cache/store/content_disk.h). */
static bool write_content(cache_redis *r, redis_link *c, const content_rec *cr, char *refused,
                          size_t refused_len, int64_t *bytes) {
    size_t gb = 2 * REDIS_GEN_BYTES, hb = content_record_header_bytes(cr->n_layer);
    size_t len = gb + hb + cr->bytes;
    redis_gens g;
    if (!gens_for_write(r, c, &cr->ns, &g)) return false;
    uint8_t *v = malloc(len);
    char name[REDIS_KEY_LEN];
    if (!v || content_record_encode_header(r->layout.model_id, cr, v + gb)) {
        free(v);
        return false;
    }
    le_put_u64(v, g.all);
    le_put_u64(v + REDIS_GEN_BYTES, g.ns);
    memcpy(v + gb + hb, cr->data, cr->bytes);
    key_content(r, &cr->ns, &cr->key, name);
    bool ok = append_set(r, c, name, v, len);
    free(v);
    if (!ok) {
        redis_link_fail(c, "cannot build a command");
        return false;
    }
    *bytes = (int64_t)len;
    return redis_link_replies(c, 1, refused, refused_len);
}

/* The decode costs of this machine, measured on the write thread at start (cache_meter_measure);
 * each is refined by the decodes requests do. */
static void measure_decode(cache_redis *r) {
    double dec_ns[CACHE_ENC_MAX] = {0};
    cache_meter_measure(&r->layout, r->table, r->decode_threads, r->w_scratch, dec_ns);
    pthread_mutex_lock(&r->mu);
    cache_meter_set_decode(&r->meter, dec_ns);
    pthread_mutex_unlock(&r->mu);
}

static void *redis_thread(void *arg) {
    cache_redis *r = arg;
    measure_decode(r);
    pthread_mutex_lock(&r->mu);
    for (;;) {
        if (r->wq_len) {
            redis_item it = r->wq[r->wq_head];
            r->wq_head = (r->wq_head + 1) % r->write_queue;
            r->wq_len--;
            pthread_mutex_unlock(&r->mu);
            char refused[128] = "";
            int64_t bytes = 0;
            bool ok =
                redis_link_get(&r->writer) &&
                (it.chunk
                     ? write_chunk(r, &r->writer, it.chunk, refused, sizeof refused, &bytes)
                     : write_content(r, &r->writer, it.content, refused, sizeof refused, &bytes));
            /* Refusals (OOM under maxmemory, a read-only replica) come with every write while
             * they last: logged when they start and when they end. */
            if (refused[0] && !r->refusing)
                log_warn("cache: redis %s refuses writes: %s", r->health.url, refused);
            else if (ok && r->refusing)
                log_info("cache: redis %s accepts writes again", r->health.url);
            if (refused[0] || ok) r->refusing = refused[0] != 0;
            pthread_mutex_lock(&r->mu);
            if (ok)
                r->st.bytes_in += bytes;
            else
                r->st.write_errors++;
            r->n_writes--;
            pthread_cond_broadcast(&r->done);
            pthread_mutex_unlock(&r->mu);
            if (it.chunk) cache_chunk_unref(it.chunk);
            if (it.content) content_rec_unref(it.content);
            pthread_mutex_lock(&r->mu);
        } else if (r->stop) {
            break;
        } else {
            pthread_cond_wait(&r->work, &r->mu);
        }
    }
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

/* Queues it (the caller took its reference); false, counted as dropped, when the queue is full. */
static bool enqueue(cache_redis *r, redis_item it) {
    pthread_mutex_lock(&r->mu);
    bool queued = r->n_writes < r->write_queue;
    if (queued) {
        r->wq[(r->wq_head + r->wq_len) % r->write_queue] = it;
        r->wq_len++;
        r->n_writes++;
        pthread_cond_signal(&r->work);
    } else {
        r->st.dropped++;
    }
    pthread_mutex_unlock(&r->mu);
    return queued;
}

bool cache_redis_put(cache_redis *r, cache_chunk *c) {
    if (c->n_blocks < 1 || c->n_blocks > cache_chunk_blocks(&r->layout) ||
        c->bytes != cache_block_bytes(&r->layout) * (size_t)c->n_blocks)
        return false;
    cache_chunk_ref(c);
    if (enqueue(r, (redis_item){.chunk = c})) return true;
    cache_chunk_unref(c);
    return false;
}

bool cache_redis_put_content(cache_redis *r, content_rec *c) {
    if (c->src || c->n_layer != r->layout.n_layer ||
        c->kv_dim != r->layout.n_kv_head * r->layout.head_dim)
        return false;
    content_rec_ref(c);
    if (enqueue(r, (redis_item){.content = c})) return true;
    content_rec_unref(c);
    return false;
}

/* A content value read for keys[i] under the generations now: its record, checked, or NULL with
 * err (*stale when it was written before a clear: not damaged, only out of date). */
static content_rec *content_decode(cache_redis *r, const redisReply *v, const redis_gens *now,
                                   const cache_key *ns, const cache_key *key, int n_tok,
                                   bool *stale, kv_error *err) {
    size_t gb = 2 * REDIS_GEN_BYTES;
    const uint8_t *p = (const uint8_t *)v->str;
    *stale = false;
    if (v->len < gb) {
        kv_fail(err, "%zu bytes, shorter than its generations", v->len);
        return NULL;
    }
    if (le_get_u64(p) != now->all || le_get_u64(p + REDIS_GEN_BYTES) != now->ns) {
        *stale = true;
        return NULL;
    }
    int kv_dim = r->layout.n_kv_head * r->layout.head_dim;
    content_rec *cr = content_record_parse(r->layout.model_id, r->layout.n_layer, kv_dim, p + gb,
                                           v->len - gb, key, err);
    if (cr && (cr->n_tok != n_tok || memcmp(cr->ns.b, ns->b, CACHE_KEY_BYTES) != 0)) {
        kv_fail(err, "%d tokens in another namespace, %d asked for", cr->n_tok, n_tok);
        content_rec_unref(cr);
        cr = NULL;
    }
    return cr;
}

int cache_redis_fetch_content(cache_redis *r, const cache_key *ns, const cache_key *keys,
                              const int *n_tok, int n, content_rec **out) {
    int found = 0, corrupt = 0;
    int64_t bytes_out = 0;
    for (int i = 0; i < n; i++) out[i] = NULL;
    if (n <= 0) return 0;
    /* one MGET: the two generations, then the records */
    char(*names)[REDIS_KEY_LEN] = malloc(sizeof *names * (size_t)(n + 2));
    redisReply *rep = NULL;
    redis_gens now;
    pthread_mutex_lock(&r->lookup_mu);
    redis_link *c = &r->lookup;
    if (names && redis_link_get(c)) {
        gens_names(r, ns, names);
        for (int i = 0; i < n; i++) key_content(r, ns, &keys[i], names[i + 2]);
        rep = mget(r, c, names, n + 2);
    }
    bool current = rep && gens_parse(rep, &now);
    for (int i = 0; current && i < n; i++) {
        const redisReply *v = rep->element[i + 2];
        if (v->type != REDIS_REPLY_STRING) continue;
        kv_error err = {{0}};
        bool stale;
        content_rec *cr = content_decode(r, v, &now, ns, &keys[i], n_tok[i], &stale, &err);
        if (!cr && !stale) {
            corrupt++;
            log_warn("cache: redis %s: refusing %s: %s", r->health.url, names[i + 2], err.msg);
            delete_keys(c, &names[i + 2], 1);
        }
        if (!cr) continue;
        out[i] = cr;
        found++;
        bytes_out += (int64_t)v->len;
    }
    pthread_mutex_unlock(&r->lookup_mu);
    if (rep) freeReplyObject(rep);
    free(names);
    pthread_mutex_lock(&r->mu);
    r->st.content_hits += found;
    r->st.corrupt += corrupt;
    r->st.bytes_out += bytes_out;
    pthread_mutex_unlock(&r->mu);
    return found;
}

/* ---------------------------------------------------------------- open, clear, stats */

cache_redis *cache_redis_open(const char *url, const cache_layout *l, const codec_table *table,
                              int64_t ttl_s, int write_queue, int timeout_ms, kv_error *err) {
    cache_redis_addr addr;
    if (cache_redis_parse_url(url, &addr, err) != 0) return NULL;
    if (cache_enc_check_table(l, table, err)) return NULL;
    if (ttl_s < 0 || write_queue < 1 || write_queue > REDIS_MAX_WRITE_QUEUE || timeout_ms < 1) {
        kv_fail(err, "redis tier: ttl, write queue or timeout out of range");
        return NULL;
    }
    cache_redis *r = calloc(1, sizeof *r);
    if (!r) {
        kv_fail(err, "out of memory");
        return NULL;
    }
    r->layout = *l;
    r->table = table;
    r->n_enc = cache_enc_count(table);
    r->decode_threads = 2;
    r->addr = addr;
    r->header_bytes = cache_record_header_bytes(l);
    r->max_value = r->header_bytes + cache_chunk_bytes(l);
    for (int e = 0; e < r->n_enc; e++) {
        size_t b = cache_enc_bound(l, table, e, cache_chunk_blocks(l));
        if (b > r->max_payload) r->max_payload = b;
    }
    cache_meter_init(&r->meter, l, r->n_enc, REDIS_PRIOR_BW);
    cache_key mid;
    memcpy(mid.b, l->model_id, CACHE_KEY_BYTES);
    char mh[2 * CACHE_KEY_BYTES + 1];
    cache_key_hex(&mid, mh);
    /* The chunking is in the name too: instances of one model with other chunk sizes would
     * otherwise find each other's records, refuse them as foreign and delete them. */
    snprintf(r->prefix, sizeof r->prefix, "kvserve:%d:%.16s-%dx%d:", REDIS_KEY_VERSION, mh,
             l->block_tokens, l->chunk_tokens);
    r->ttl_s = ttl_s;
    r->write_queue = write_queue;
    redis_health_init(&r->health, "cache", "lookups miss", &r->addr);
    redis_link_init(&r->lookup, "lookup", &r->addr, &r->health, timeout_ms);
    redis_link_init(&r->writer, "write", &r->addr, &r->health, timeout_ms);
    pthread_mutex_init(&r->lookup_mu, NULL);
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->work, NULL);
    pthread_cond_init(&r->done, NULL);
    r->wq = calloc((size_t)write_queue, sizeof *r->wq);
    r->value = malloc(r->header_bytes + r->max_payload);
    r->scratch = malloc(sizeof(float) * cache_enc_scratch_floats(l));
    r->w_scratch = malloc(sizeof(float) * cache_enc_scratch_floats(l));
    if (!r->wq || !r->value || !r->scratch || !r->w_scratch) {
        kv_fail(err, "out of memory");
        goto fail;
    }
    /* A first exchange, so the log and the stats say at once whether Redis answers. */
    pthread_mutex_lock(&r->lookup_mu);
    const char *ping[1] = {"PING"};
    redisReply *rep = NULL;
    if (redis_link_get(&r->lookup) &&
        redisAppendCommandArgv(r->lookup.ctx, 1, ping, NULL) == REDIS_OK)
        rep = redis_link_reply(&r->lookup);
    if (rep) freeReplyObject(rep);
    pthread_mutex_unlock(&r->lookup_mu);
    if (pthread_create(&r->thread, NULL, redis_thread, r) != 0) {
        kv_fail(err, "redis tier: cannot start its thread");
        goto fail;
    }
    r->thread_started = true;
    return r;
fail:
    cache_redis_close(r);
    return NULL;
}

void cache_redis_close(cache_redis *r) {
    if (!r) return;
    pthread_mutex_lock(&r->mu);
    r->stop = true;
    pthread_cond_signal(&r->work);
    pthread_mutex_unlock(&r->mu);
    if (r->thread_started) pthread_join(r->thread, NULL);
    for (int i = 0; i < r->wq_len; i++) {
        redis_item it = r->wq[(r->wq_head + i) % r->write_queue];
        if (it.chunk) cache_chunk_unref(it.chunk);
        if (it.content) content_rec_unref(it.content);
    }
    redis_link_close(&r->lookup);
    redis_link_close(&r->writer);
    redis_health_destroy(&r->health);
    pthread_mutex_destroy(&r->lookup_mu);
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->work);
    pthread_cond_destroy(&r->done);
    free(r->wq);
    free(r->value);
    free(r->scratch);
    free(r->w_scratch);
    free(r);
}

/* UNLINKs one page of SCAN's keys; adds the records among them to *n. */
static bool unlink_page(redis_link *c, const redisReply *keys, int64_t *n) {
    const char **argv = malloc(sizeof *argv * (keys->elements + 1));
    size_t *len = malloc(sizeof *len * (keys->elements + 1));
    redisReply *del = NULL;
    if (argv && len) {
        argv[0] = "UNLINK";
        len[0] = 6;
        for (size_t i = 0; i < keys->elements; i++) {
            argv[i + 1] = keys->element[i]->str;
            len[i + 1] = keys->element[i]->len;
            /* Records are counted, not the aliases a clear of everything drops too. */
            *n += memmem(keys->element[i]->str, keys->element[i]->len, ":r:", 3) != NULL ||
                  memmem(keys->element[i]->str, keys->element[i]->len, ":c:", 3) != NULL;
        }
        if (redisAppendCommandArgv(c->ctx, (int)keys->elements + 1, argv, len) == REDIS_OK)
            del = redis_link_reply(c);
    }
    free(argv);
    free(len);
    if (del) freeReplyObject(del);
    return del != NULL;
}

/* Whether the first SCAN's failure is a refusal: twemproxy closes the connection on a command it
 * does not forward, another proxy may answer an error. The connection is dropped without the
 * backoff of a failure (the next command connects again); SCAN is not tried again. */
static bool scan_refused(cache_redis *r, redis_link *c, int status, const redisReply *rep) {
    bool refused =
        status == REDIS_OK ? rep && rep->type == REDIS_REPLY_ERROR : c->ctx->err == REDIS_ERR_EOF;
    if (!refused) return false;
    log_info("cache: redis %s does not take SCAN (a proxy?): a clear makes records unreachable "
             "and leaves them to expire",
             r->health.url);
    r->no_scan = true;
    if (status != REDIS_OK) redis_link_drop(c);
    return true;
}

/* Deletes the keys matching pattern with SCAN and UNLINK: how many records, 0 when Redis refuses
 * SCAN, -1 when it could not be reached. Called with lookup_mu held. */
static int64_t scan_delete(cache_redis *r, redis_link *c, const char *pattern) {
    int64_t n = 0;
    char cursor[32] = "0";
    bool first = true;
    do {
        const char *argv[6] = {"SCAN", cursor, "MATCH", pattern, "COUNT", REDIS_SCAN_COUNT};
        void *reply = NULL;
        if (!redis_link_get(c) || redisAppendCommandArgv(c->ctx, 6, argv, NULL) != REDIS_OK)
            return -1;
        int status = redisGetReply(c->ctx, &reply);
        redisReply *rep = reply;
        if (first && scan_refused(r, c, status, rep)) {
            if (rep) freeReplyObject(rep);
            return 0;
        }
        first = false;
        if (status != REDIS_OK) {
            redis_link_fail(c, c->ctx->errstr);
            return -1;
        }
        /* [cursor, [keys...]] */
        bool ok = rep->type == REDIS_REPLY_ARRAY && rep->elements == 2 &&
                  rep->element[0]->type == REDIS_REPLY_STRING &&
                  rep->element[0]->len < sizeof cursor &&
                  rep->element[1]->type == REDIS_REPLY_ARRAY;
        for (size_t i = 0; ok && i < rep->element[1]->elements; i++)
            ok = rep->element[1]->element[i]->type == REDIS_REPLY_STRING;
        if (ok) {
            memcpy(cursor, rep->element[0]->str, rep->element[0]->len);
            cursor[rep->element[0]->len] = 0;
            ok = rep->element[1]->elements == 0 || unlink_page(c, rep->element[1], &n);
        }
        freeReplyObject(rep);
        if (!ok) return -1;
    } while (strcmp(cursor, "0") != 0);
    return n;
}

int64_t cache_redis_clear(cache_redis *r, const cache_key *ns) {
    char pattern[REDIS_KEY_LEN + 2], nh[2 * CACHE_KEY_BYTES + 1];
    if (ns) {
        cache_key_hex(ns, nh);
        snprintf(pattern, sizeof pattern, "%s%s:*", r->prefix, nh);
    } else {
        snprintf(pattern, sizeof pattern, "%s*", r->prefix);
    }
    pthread_mutex_lock(&r->lookup_mu);
    int64_t n = r->no_scan ? 0 : scan_delete(r, &r->lookup, pattern);
    /* the new generation after the SCAN, whose pattern matches the old one's key */
    if (n >= 0 && !gen_bump(r, &r->lookup, ns, NULL)) n = -1;
    pthread_mutex_unlock(&r->lookup_mu);
    return n;
}

int cache_redis_keep(cache_redis *r, const cache_key *ns, const cache_key *bkeys, int n_blocks,
                     int64_t ttl_s) {
    if (r->ttl_s == 0 || n_blocks <= 0) return 0; /* the keys never expire */
    if (ttl_s < r->ttl_s) ttl_s = r->ttl_s;
    int cb = cache_chunk_blocks(&r->layout), n_rec = (n_blocks + cb - 1) / cb;
    int n = n_blocks + n_rec * r->n_enc;
    char(*names)[REDIS_KEY_LEN] = malloc(sizeof *names * (size_t)n), ttl[24];
    if (!names) return -1;
    snprintf(ttl, sizeof ttl, "%lld", (long long)ttl_s);
    int k = 0;
    for (int b = 0; b < n_blocks; b++) key_alias(r, &bkeys[b], names[k++]);
    for (int j = 0; j < n_blocks; j += cb) {
        int last = j + cb < n_blocks ? j + cb - 1 : n_blocks - 1; /* the record's own key */
        for (int e = 0; e < r->n_enc; e++) key_value(r, ns, &bkeys[last], e, names[k++]);
    }
    pthread_mutex_lock(&r->lookup_mu);
    redis_link *c = &r->lookup;
    bool ok = redis_link_get(c) != NULL;
    for (int i = 0; ok && i < n; i++) {
        const char *argv[3] = {"EXPIRE", names[i], ttl};
        ok = redisAppendCommandArgv(c->ctx, 3, argv, NULL) == REDIS_OK;
        if (!ok) redis_link_fail(c, "cannot build a command");
    }
    ok = ok && redis_link_replies(c, n, NULL, 0);
    pthread_mutex_unlock(&r->lookup_mu);
    free(names);
    return ok ? 0 : -1;
}

void cache_redis_stats(cache_redis *r, cache_tier_stats *out, bool *connected) {
    pthread_mutex_lock(&r->mu);
    *out = r->st;
    pthread_mutex_unlock(&r->mu);
    *connected = redis_health_up(&r->health);
}

void cache_redis_flush(cache_redis *r) {
    pthread_mutex_lock(&r->mu);
    while (r->n_writes > 0) pthread_cond_wait(&r->done, &r->mu);
    pthread_mutex_unlock(&r->mu);
}
