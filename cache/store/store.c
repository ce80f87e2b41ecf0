/* The chunk store: the RAM tier over the disk tier over Redis (DESIGN.md "Store tiers"). A lookup
 * walks RAM, then disk, then Redis for the chunks the first two lack; hits below RAM are promoted
 * into RAM (Redis hits onto disk too). A put goes into RAM at once and onto disk and into Redis in
 * the background (each tier's own thread), so storing never waits for I/O.
 *
 * An encoded RAM tier (cache_store_opts.ram_enc) takes a chunk lossless, and an encoder thread at
 * a lower CPU priority swaps it for its encoding soon after (a full queue leaves it lossless). A
 * lookup decodes what it finds there before returning it, reported as that encoding: lossy KV,
 * never taken by a fetch that insists on exact KV (it reads disk instead). */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cache/cache.h"
#include "cache/codec/chunk_codec.h"
#include "cache/store/content.h"
#include "cache/store/disk.h"
#include "cache/store/ram.h"
#include "cache/store/redis.h"
#include "cache/store/worker.h"

#define STORE_REDIS_TIMEOUT_MS 200
#define STORE_ENCODE_QUEUE 16 /* chunks waiting for the RAM tier's encoder (as on disk) */
#define STORE_DECODE_THREADS 2

struct cache_store {
    cache_layout layout;
    cache_ram *ram;     /* NULL: no RAM tier */
    cache_disk *disk;   /* NULL: no disk tier */
    cache_redis *redis; /* NULL: no Redis tier */
    int64_t (*clock)(void *arg);
    void *clock_arg;

    /* The encoded RAM tier (ram_enc != CACHE_ENC_RAW). */
    int ram_enc;
    const codec_table *table;
    chunk_worker *encoder; /* encodes the lossless chunks put into RAM */
    float *enc_scratch;    /* the encoder's */
    uint8_t *enc_buf;
    size_t enc_cap;
};

/* ---------------------------------------------------------------- the encoded RAM tier */

/* Encodes c and swaps it into RAM in its place (when RAM still holds c). Encoder thread. */
static void ram_encode(void *ud, cache_chunk *c, uint64_t tag) {
    cache_store *s = ud;
    (void)tag;
    if (!cache_ram_has(s->ram, c)) return; /* evicted or superseded since it was queued */
    kv_error err = {{0}};
    int64_t len = cache_enc_encode(&s->layout, s->table, s->ram_enc, c, s->enc_scratch, s->enc_buf,
                                   s->enc_cap, &err);
    if (len <= 0) {
        log_warn("cache: RAM tier: a chunk stays lossless: %s", err.msg);
        return;
    }
    cache_chunk *e = cache_chunk_create_encoded(c, s->ram_enc, s->enc_buf, (size_t)len);
    if (!e) return;
    cache_ram_swap(s->ram, c, e);
    cache_chunk_unref(e);
}

/* Puts c into RAM; a lossless chunk of an encoded tier is queued for the encoder (a full
 * queue leaves it lossless). */
static bool ram_put(cache_store *s, cache_chunk *c) {
    if (!cache_ram_put(s->ram, c)) return false;
    if (s->encoder && c->enc == CACHE_ENC_RAW) chunk_worker_queue(s->encoder, c, 0);
    return true;
}

/* c as pool blocks: itself when lossless, else decoded into a new chunk (c's reference is
 * dropped); NULL when that fails. */
static cache_chunk *ram_decode(cache_store *s, cache_chunk *c) {
    if (c->enc == CACHE_ENC_RAW) return c;
    cache_chunk *d = cache_chunk_create(&s->layout, c->bkeys, c->n_blocks, &c->ns, c->pos0);
    float *scratch = malloc(sizeof(float) * cache_enc_scratch_floats(&s->layout));
    kv_error err = {{0}};
    if (!d || !scratch ||
        cache_enc_decode(&s->layout, s->table, c->enc, c->data, c->bytes, d, scratch,
                         STORE_DECODE_THREADS, &err) != 0) {
        log_warn("cache: RAM tier: cannot decode a chunk: %s",
                 d && scratch ? err.msg : "out of memory");
        if (d) cache_chunk_unref(d);
        d = NULL;
    }
    free(scratch);
    cache_chunk_unref(c);
    return d;
}

/* ---------------------------------------------------------------- open */

cache_store *cache_store_open(const cache_layout *l, const cache_store_opts *o, kv_error *err) {
    if (cache_layout_check(l, err)) return NULL;
    if (o->ram_bytes < 0 || o->disk_bytes < 0) {
        kv_fail(err, "cache capacities must not be negative");
        return NULL;
    }
    cache_store *s = calloc(1, sizeof *s);
    if (!s) {
        kv_fail(err, "out of memory");
        return NULL;
    }
    s->layout = *l;
    s->clock = o->clock;
    s->clock_arg = o->clock_arg;
    if (o->pin_bytes < 0) {
        kv_fail(err, "the pin cap must not be negative");
        goto fail;
    }
    if (o->ram_bytes > 0 && !(s->ram = cache_ram_create(o->ram_bytes))) {
        kv_fail(err, "out of memory");
        goto fail;
    }
    if (s->ram &&
        cache_ram_set_pin_limit(s->ram, o->pin_bytes, o->n_tenants, o->tenant_pin_share)) {
        kv_fail(err, "out of memory");
        goto fail;
    }
    if (o->ram_enc != CACHE_ENC_RAW && s->ram) {
        char name[16];
        cache_enc_name(o->ram_enc, name);
        if (o->ram_enc < 0 || o->ram_enc >= cache_enc_count(o->codec)) {
            kv_fail(err, "RAM tier encoding %s: %s", name,
                    o->ram_enc >= CACHE_ENC_CODEC ? "no such level in the codec table"
                                                  : "not an encoding");
            goto fail;
        }
        if (cache_enc_check_table(l, o->codec, err)) goto fail;
        s->ram_enc = o->ram_enc;
        s->table = o->codec;
        s->enc_cap = cache_enc_bound(l, o->codec, o->ram_enc, cache_chunk_blocks(l));
        s->enc_buf = malloc(s->enc_cap);
        s->enc_scratch = malloc(sizeof(float) * cache_enc_scratch_floats(l));
        if (!s->enc_buf || !s->enc_scratch) {
            kv_fail(err, "out of memory");
            goto fail;
        }
        if (!(s->encoder = chunk_worker_start(STORE_ENCODE_QUEUE, ram_encode, NULL, s, err)))
            goto fail;
    }
    if (o->dir && o->dir[0] && o->disk_bytes > 0 &&
        !(s->disk = cache_disk_open_enc(o->dir, l, o->disk_bytes,
                                        o->write_queue > 0 ? o->write_queue : 64, o->codec,
                                        o->disk_encoded, err)))
        goto fail;
    if (s->disk) {
        if (cache_disk_set_pin_limit(s->disk, o->pin_bytes, o->n_tenants, o->tenant_pin_share)) {
            kv_fail(err, "out of memory");
            goto fail;
        }
        cache_disk_restore_leases(s->disk, cache_store_now(s));
    }
    if (o->redis_url && o->redis_url[0] &&
        !(s->redis = cache_redis_open(
              o->redis_url, l, o->codec, o->redis_ttl_s, o->write_queue > 0 ? o->write_queue : 64,
              o->redis_timeout_ms > 0 ? o->redis_timeout_ms : STORE_REDIS_TIMEOUT_MS, err)))
        goto fail;
    return s;
fail:
    cache_store_close(s);
    return NULL;
}

int cache_store_check_redis_url(const char *url, kv_error *err) {
    cache_redis_addr addr;
    return cache_redis_parse_url(url, &addr, err);
}

void cache_store_close(cache_store *s) {
    if (!s) return;
    chunk_worker_stop(s->encoder);
    cache_redis_close(s->redis);
    cache_disk_close(s->disk);
    cache_ram_destroy(s->ram);
    free(s->enc_buf);
    free(s->enc_scratch);
    free(s);
}

const cache_layout *cache_store_layout(const cache_store *s) { return &s->layout; }

/* The furthest of blocks [j, end) of the sequence (end inside j's chunk) that a record holds,
 * probing RAM and then disk from the last block down: its index, with the RAM record (a
 * reference; exact: only a lossless one) in *ram or the disk record's key in *disk_key. -1 when
 * no record holds block j. */
static int probe_chunk(cache_store *s, const cache_key *bkeys, int j, int end, bool exact,
                       cache_chunk **ram, cache_key *disk_key) {
    int block;
    for (int b = end - 1; b >= j; b--) {
        if (s->ram && (*ram = cache_ram_find_as(s->ram, &bkeys[b], exact, &block))) return b;
        if (s->disk && cache_disk_find(s->disk, &bkeys[b], disk_key, &block)) return b;
    }
    return -1;
}

/* True when c holds block b of the sequence as the index said: at the right position, under
 * the sequence's key (a record read from disk is checked against its own header, not yet
 * against the block asked for). */
static bool holds_block(const cache_store *s, const cache_chunk *c, const cache_key *bkeys, int b) {
    int bt = s->layout.block_tokens, i = b - c->pos0 / bt;
    return c->pos0 % s->layout.chunk_tokens == 0 &&
           b / cache_chunk_blocks(&s->layout) == c->pos0 / s->layout.chunk_tokens && i >= 0 &&
           i < c->n_blocks && memcmp(c->bkeys[i].b, bkeys[b].b, CACHE_KEY_BYTES) == 0;
}

/* A chunk read from a lower tier, promoted to RAM; when a concurrent fetch promoted it first,
 * that copy is returned instead (c's reference dropped), so concurrent requests for one prefix
 * hold one copy. */
static cache_chunk *promote(cache_store *s, cache_chunk *c) {
    if (c && s->ram && !ram_put(s, c)) {
        int block;
        /* (not one RAM holds in an encoding: c is better) */
        cache_chunk *shared = cache_ram_find_as(s->ram, &c->key, true, &block);
        if (shared) {
            cache_chunk_unref(c);
            c = shared;
        }
    }
    return c;
}

int cache_store_fetch(cache_store *s, const cache_key *bkeys, int first, int n_blocks,
                      const cache_fetch_policy *policy, cache_chunk **out, cache_fetch_src *src,
                      int max_out, int *n_out, int *n_text) {
    static const cache_fetch_policy lossless = {.force_enc = CACHE_ENC_ANY};
    int cb = cache_chunk_blocks(&s->layout);
    int cap = max_out > 0 ? max_out : 1;
    int *upto = malloc(sizeof(int) * (size_t)cap);    /* out[i] covers blocks up to upto[i] */
    int *disk_at = malloc(sizeof(int) * (size_t)cap); /* out[] slots to read from disk */
    cache_key *disk_keys = malloc(sizeof(cache_key) * (size_t)cap);
    int n = 0, n_disk = 0, covered = 0, j = first;
    uint8_t *enc = malloc((size_t)cap);  /* out[i]'s encoding, from Redis */
    uint8_t *denc = malloc((size_t)cap); /* the encodings disk reads came in */
    bool unheld = false; /* the walk stopped at a chunk RAM and disk have no record of */
    /* a fetch insisting on exact KV takes no encoding from an encoded RAM tier */
    bool exact = !policy || policy->lossless || policy->force_enc == CACHE_ENC_RAW;
    *n_out = 0;
    *n_text = 0;
    if (!upto || !disk_at || !disk_keys || !enc || !denc) goto done;

    /* Chunk by chunk: a chunk's record continues the prefix only when it reaches the chunk's
     * end (or the sequence's last block). */
    while (j < n_blocks && n < max_out) {
        int end = (j / cb + 1) * cb < n_blocks ? (j / cb + 1) * cb : n_blocks;
        cache_chunk *c = NULL;
        int b = probe_chunk(s, bkeys, j, end, exact, &c, &disk_keys[n_disk]);
        if (!c && s->ram) cache_ram_count_miss(s->ram);
        if (b < 0) {
            unheld = true;
            break;
        }
        int enc_c = c ? c->enc : CACHE_ENC_RAW;
        if (c && !(c = ram_decode(s, c))) break; /* the prefix ends here */
        if (!c) disk_at[n_disk++] = n;
        if (src)
            src[n] = (cache_fetch_src){.tier = c ? CACHE_TIER_RAM : CACHE_TIER_DISK,
                                       .enc = (uint8_t)enc_c};
        out[n] = c;
        upto[n++] = b + 1;
        j = b + 1;
        if (j < end) break;
    }
    /* Redis continues from there (network round trips on this thread, each bounded). */
    int n_redis = 0, redis_from = n;
    if (unheld && s->redis) {
        n_redis = cache_redis_fetch(s->redis, bkeys, j, n_blocks, policy ? policy : &lossless,
                                    out + n, upto + n, enc + n, max_out - n, n_text);
        for (int i = n; i < n + n_redis && src; i++)
            src[i] = (cache_fetch_src){.tier = CACHE_TIER_REDIS, .enc = enc[i]};
        n += n_redis;
    }
    if (n_disk > 0) {
        /* One batch of parallel reads for every chunk the prefix still needs. */
        cache_chunk **dc = calloc((size_t)n_disk, sizeof *dc);
        if (dc) cache_disk_read_enc(s->disk, disk_keys, n_disk, policy, dc, denc);
        for (int i = 0; i < n_disk; i++) {
            bool raw = !dc || denc[i] == CACHE_ENC_RAW; /* lossy ones are not promoted */
            out[disk_at[i]] = raw ? promote(s, dc ? dc[i] : NULL) : dc[i];
            if (src) src[disk_at[i]].enc = dc ? denc[i] : CACHE_ENC_RAW;
        }
        free(dc);
    }
    /* Lossless chunks from Redis are kept here too; lossy ones reach the pool only, for this
     * request: RAM and disk hold only what a full prefill computes. */
    for (int i = redis_from; i < redis_from + n_redis && enc[i] == CACHE_ENC_RAW; i++) {
        if (s->disk) cache_disk_put(s->disk, out[i]);
        out[i] = promote(s, out[i]);
    }
    /* The prefix ends at the first record that could not be read or does not hold its block. */
    int m = 0;
    while (m < n && out[m] && holds_block(s, out[m], bkeys, upto[m] - 1)) m++;
    for (int i = m; i < n; i++) {
        cache_chunk_unref(out[i]);
        out[i] = NULL;
    }
    *n_out = m;
    covered = m ? upto[m - 1] - first : 0;
    if (m < n) *n_text = 0; /* the prefix ended before the chunks left to text */
done:
    free(upto);
    free(disk_at);
    free(disk_keys);
    free(enc);
    free(denc);
    return covered;
}

bool cache_store_holds(cache_store *s, const cache_key *bkey) {
    cache_key record;
    int block;
    return (s->ram && cache_ram_holds(s->ram, bkey)) ||
           (s->disk && cache_disk_find(s->disk, bkey, &record, &block));
}

void cache_store_put_local(cache_store *s, cache_chunk *c) {
    cache_store_expire(s); /* an expired lease must not keep a record from eviction */
    if (s->ram) ram_put(s, c);
    if (s->disk) cache_disk_put(s->disk, c);
}

bool cache_store_put_below(cache_store *s, cache_chunk *c, bool redis) {
    if (!s->disk) return false;
    cache_store_expire(s);
    cache_disk_put(s->disk, c);
    if (redis && s->redis) cache_redis_put(s->redis, c);
    return true;
}

int64_t cache_store_disk_backlog(cache_store *s) {
    return s->disk ? cache_disk_write_bytes(s->disk) : -1;
}

void cache_store_put(cache_store *s, cache_chunk *c) {
    cache_store_put_local(s, c);
    if (s->redis) cache_redis_put(s->redis, c);
}

/* Pins, unpins or (until > 0) leases records by their own keys in every tier. */
static int pin_tiers(cache_store *s, int tenant, const cache_key *keys, int n, bool pin,
                     int64_t until) {
    int ram = s->ram ? cache_ram_pin(s->ram, tenant, keys, n, pin, until) : 0;
    int disk = s->disk ? cache_disk_pin(s->disk, tenant, keys, n, pin, until) : 0;
    return s->ram ? ram : disk; /* resident means in RAM, when there is a RAM tier */
}

int cache_store_pin(cache_store *s, int tenant, const cache_key *keys, int n_keys, bool pin) {
    return pin_tiers(s, tenant, keys, n_keys, pin, 0);
}

int cache_store_pin_until(cache_store *s, int tenant, const cache_key *keys, int n_keys,
                          int64_t until) {
    cache_store_expire(s);
    return pin_tiers(s, tenant, keys, n_keys, true, until);
}

void cache_store_tenant_pins(cache_store *s, int tenant, cache_tenant_pins *out) {
    memset(out, 0, sizeof *out);
    if (s->ram) cache_ram_tenant_pins(s->ram, tenant, &out->ram, &out->ram_share);
    if (s->disk) cache_disk_tenant_pins(s->disk, tenant, &out->disk, &out->disk_share);
}

/* ---------------------------------------------------------------- leases */

int64_t cache_store_now(cache_store *s) {
    return s->clock ? s->clock(s->clock_arg) : (int64_t)time(NULL);
}

int cache_store_expire(cache_store *s) {
    int64_t now = cache_store_now(s);
    int n = s->ram ? cache_ram_expire(s->ram, now) : 0;
    return n + (s->disk ? cache_disk_expire(s->disk, now) : 0);
}

int cache_store_lease(cache_store *s, int tenant, const cache_key *bkeys, int n_blocks,
                      int64_t until) {
    cache_store_expire(s);
    int cb = cache_chunk_blocks(&s->layout), covered = 0;
    for (int j = 0; j < n_blocks; j += cb) {
        /* the chunk's last block of the sequence: a record holding it holds the chunk's blocks
         * before it too */
        int last = j + cb < n_blocks ? j + cb - 1 : n_blocks - 1;
        bool ram = s->ram && cache_ram_lease(s->ram, tenant, &bkeys[last], until);
        bool disk = s->disk && cache_disk_lease(s->disk, tenant, &bkeys[last], until);
        if (!ram && !disk) break;
        covered = last + 1;
    }
    return covered;
}

int cache_store_pins(cache_store *s, cache_pin_info *out, int max) {
    cache_store_expire(s);
    int n = s->ram ? cache_ram_pins(s->ram, out, max) : 0;
    int listed = n < max ? n : max, total = n;
    if (!s->disk) return total;
    int n_disk = cache_disk_pins(s->disk, NULL, 0);
    cache_pin_info *disk = malloc(sizeof *disk * (size_t)(n_disk > 0 ? n_disk : 1));
    if (!disk) return total + n_disk; /* RAM's listed; disk's only counted */
    int got = cache_disk_pins(s->disk, disk, n_disk);
    if (got < n_disk) n_disk = got; /* some ended meanwhile; more listed than room: those */
    for (int i = 0; i < n_disk; i++) {
        int k = 0;
        while (k < listed && memcmp(out[k].key.b, disk[i].key.b, CACHE_KEY_BYTES) != 0) k++;
        if (k < listed) { /* in both tiers: one record */
            out[k].disk = true;
            out[k].manual |= disk[i].manual;
            if (disk[i].lease > out[k].lease) out[k].lease = disk[i].lease;
            continue;
        }
        total++;
        if (listed < max) out[listed++] = disk[i];
    }
    free(disk);
    return total;
}

void cache_store_clear(cache_store *s, const cache_key *ns, bool ram, bool disk, bool redis,
                       int64_t *n_ram, int64_t *n_disk, int64_t *n_redis) {
    *n_ram = ram && s->ram ? cache_ram_clear(s->ram, ns) : 0;
    *n_disk = disk && s->disk ? cache_disk_clear(s->disk, ns) : 0;
    *n_redis = redis && s->redis ? cache_redis_clear(s->redis, ns) : 0;
}

void cache_store_stats(cache_store *s, cache_stats *out) {
    cache_store_expire(s); /* pinned counts without the leases that are due */
    memset(out, 0, sizeof *out);
    if (s->ram) cache_ram_stats(s->ram, &out->ram);
    if (s->disk) cache_disk_stats(s->disk, &out->disk);
    if (s->redis) cache_redis_stats(s->redis, &out->redis, &out->redis_connected);
    out->disk_enabled = s->disk != NULL;
    out->redis_enabled = s->redis != NULL;
}

void cache_store_flush(cache_store *s) {
    if (s->encoder) chunk_worker_flush(s->encoder);
    if (s->disk) cache_disk_flush(s->disk);
    if (s->redis) cache_redis_flush(s->redis);
}

bool cache_store_has_redis(const cache_store *s) { return s && s->redis; }

int cache_store_keep_shared(cache_store *s, const cache_key *ns, const cache_key *bkeys,
                            int n_blocks, int64_t ttl_s) {
    return s && s->redis ? cache_redis_keep(s->redis, ns, bkeys, n_blocks, ttl_s) : 0;
}

void cache_store_put_content(cache_store *s, content_rec *r) {
    if (s && s->redis) cache_redis_put_content(s->redis, r);
}

int cache_store_fetch_content(cache_store *s, const cache_key *ns, const cache_key *keys,
                              const int *n_tok, int n, content_rec **out) {
    if (!s || !s->redis) {
        for (int i = 0; i < n; i++) out[i] = NULL;
        return 0;
    }
    return cache_redis_fetch_content(s->redis, ns, keys, n_tok, n, out);
}
