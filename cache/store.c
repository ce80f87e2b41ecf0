/* The chunk store: the RAM tier over the disk tier over Redis (DESIGN.md "Store tiers"). A lookup
 * walks RAM, then disk, then Redis for the chunks the first two lack; hits below RAM are promoted
 * into RAM (Redis hits onto disk too). A put goes into RAM at once and onto disk and into Redis in
 * the background (each tier's own thread), so storing never waits for I/O. */
#include <stdlib.h>
#include <string.h>

#include "cache/blend.h"
#include "cache/cache.h"
#include "cache/disk.h"
#include "cache/ram.h"
#include "cache/redis.h"

#define STORE_REDIS_TIMEOUT_MS 200

struct cache_store {
    cache_layout layout;
    cache_ram *ram;     /* NULL: no RAM tier */
    cache_disk *disk;   /* NULL: no disk tier */
    cache_redis *redis; /* NULL: no Redis tier */
};

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
    if (o->ram_bytes > 0 && !(s->ram = cache_ram_create(o->ram_bytes))) {
        kv_fail(err, "out of memory");
        goto fail;
    }
    if (o->dir && o->dir[0] && o->disk_bytes > 0 &&
        !(s->disk = cache_disk_open_enc(o->dir, l, o->disk_bytes,
                                        o->write_queue > 0 ? o->write_queue : 64, o->codec,
                                        o->disk_encoded, err)))
        goto fail;
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
    cache_redis_close(s->redis);
    cache_disk_close(s->disk);
    cache_ram_destroy(s->ram);
    free(s);
}

const cache_layout *cache_store_layout(const cache_store *s) { return &s->layout; }

/* The furthest of blocks [j, end) of the sequence (end inside j's chunk) that a record holds,
 * probing RAM and then disk from the last block down: its index, with the RAM record (a
 * reference) in *ram or the disk record's key in *disk_key. -1 when no record holds block j. */
static int probe_chunk(cache_store *s, const cache_key *bkeys, int j, int end, cache_chunk **ram,
                       cache_key *disk_key) {
    int block;
    for (int b = end - 1; b >= j; b--) {
        if (s->ram && (*ram = cache_ram_find(s->ram, &bkeys[b], &block))) return b;
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
    if (c && s->ram && !cache_ram_put(s->ram, c)) {
        int block;
        cache_chunk *shared = cache_ram_find(s->ram, &c->key, &block);
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
    *n_out = 0;
    *n_text = 0;
    if (!upto || !disk_at || !disk_keys || !enc || !denc) goto done;

    /* Chunk by chunk: a chunk's record continues the prefix only when it reaches the chunk's
     * end (or the sequence's last block). */
    while (j < n_blocks && n < max_out) {
        int end = (j / cb + 1) * cb < n_blocks ? (j / cb + 1) * cb : n_blocks;
        cache_chunk *c = NULL;
        int b = probe_chunk(s, bkeys, j, end, &c, &disk_keys[n_disk]);
        if (!c && s->ram) cache_ram_count_miss(s->ram);
        if (b < 0) {
            unheld = true;
            break;
        }
        if (!c) disk_at[n_disk++] = n;
        if (src) src[n] = (cache_fetch_src){.tier = c ? CACHE_TIER_RAM : CACHE_TIER_DISK};
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
            bool exact = !dc || denc[i] == CACHE_ENC_RAW; /* lossy ones are not promoted */
            out[disk_at[i]] = exact ? promote(s, dc ? dc[i] : NULL) : dc[i];
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
    if (s->ram) cache_ram_put(s->ram, c);
    if (s->disk) cache_disk_put(s->disk, c);
}

void cache_store_put(cache_store *s, cache_chunk *c) {
    cache_store_put_local(s, c);
    if (s->redis) cache_redis_put(s->redis, c);
}

int cache_store_pin(cache_store *s, const cache_key *keys, int n_keys, bool pin) {
    int ram = s->ram ? cache_ram_pin(s->ram, keys, n_keys, pin) : 0;
    int disk = s->disk ? cache_disk_pin(s->disk, keys, n_keys, pin) : 0;
    return s->ram ? ram : disk; /* resident means in RAM, when there is a RAM tier */
}

void cache_store_clear(cache_store *s, const cache_key *ns, bool ram, bool disk, bool redis,
                       int64_t *n_ram, int64_t *n_disk, int64_t *n_redis) {
    *n_ram = ram && s->ram ? cache_ram_clear(s->ram, ns) : 0;
    *n_disk = disk && s->disk ? cache_disk_clear(s->disk, ns) : 0;
    *n_redis = redis && s->redis ? cache_redis_clear(s->redis, ns) : 0;
}

void cache_store_stats(cache_store *s, cache_stats *out) {
    memset(out, 0, sizeof *out);
    if (s->ram) cache_ram_stats(s->ram, &out->ram);
    if (s->disk) cache_disk_stats(s->disk, &out->disk);
    if (s->redis) cache_redis_stats(s->redis, &out->redis, &out->redis_connected);
    out->disk_enabled = s->disk != NULL;
    out->redis_enabled = s->redis != NULL;
}

void cache_store_flush(cache_store *s) {
    if (s->disk) cache_disk_flush(s->disk);
    if (s->redis) cache_redis_flush(s->redis);
}

bool cache_store_has_redis(const cache_store *s) { return s && s->redis; }

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
