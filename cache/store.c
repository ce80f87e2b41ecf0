/* The chunk store: the RAM tier over the disk tier (DESIGN.md "Store tiers"). A lookup walks
 * RAM, then disk; disk hits are promoted into RAM. A put goes into RAM at once and onto disk in
 * the background (the disk tier's I/O thread), so storing never waits for I/O. */
#include <stdlib.h>
#include <string.h>

#include "cache/cache.h"
#include "cache/disk.h"
#include "cache/ram.h"

struct cache_store {
    cache_layout layout;
    cache_ram *ram;   /* NULL: no RAM tier */
    cache_disk *disk; /* NULL: no disk tier */
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
        !(s->disk = cache_disk_open(o->dir, l, o->disk_bytes,
                                    o->write_queue > 0 ? o->write_queue : 64, err)))
        goto fail;
    return s;
fail:
    cache_store_close(s);
    return NULL;
}

void cache_store_close(cache_store *s) {
    if (!s) return;
    cache_disk_close(s->disk);
    cache_ram_destroy(s->ram);
    free(s);
}

const cache_layout *cache_store_layout(const cache_store *s) { return &s->layout; }

int cache_store_fetch(cache_store *s, const cache_key *keys, const bool *want, int n_keys,
                      cache_chunk **out) {
    /* RAM first, in order; note which wanted keys must come from disk. */
    int *from_disk = malloc(sizeof(int) * (size_t)(n_keys > 0 ? n_keys : 1));
    int n_disk = 0, n = 0;
    for (; n < n_keys; n++) {
        out[n] = NULL;
        if (!want[n]) continue;
        if (s->ram && (out[n] = cache_ram_get(s->ram, &keys[n]))) continue;
        if (!s->disk || !from_disk || !cache_disk_contains(s->disk, &keys[n])) break;
        from_disk[n_disk++] = n;
    }
    for (int i = n + 1; i < n_keys; i++) out[i] = NULL;
    if (n_disk > 0) {
        /* One batch of parallel reads for every chunk the prefix still needs. */
        cache_key *dk = malloc(sizeof *dk * (size_t)n_disk);
        cache_chunk **dc = calloc((size_t)n_disk, sizeof *dc);
        if (dk && dc) {
            for (int i = 0; i < n_disk; i++) dk[i] = keys[from_disk[i]];
            cache_disk_read(s->disk, dk, n_disk, dc);
        }
        for (int i = 0; i < n_disk; i++) {
            cache_chunk *c = dc ? dc[i] : NULL;
            /* Promoted to RAM; when a concurrent fetch promoted it first, that copy is shared
             * instead, so concurrent requests for one prefix hold one copy. */
            if (c && s->ram && !cache_ram_put(s->ram, c)) {
                cache_chunk *shared = cache_ram_get(s->ram, &c->key);
                if (shared) {
                    cache_chunk_unref(c);
                    c = shared;
                }
            }
            out[from_disk[i]] = c;
        }
        /* The prefix ends at the first chunk that could not be read. */
        for (int i = 0; i < n_disk; i++)
            if (!out[from_disk[i]]) {
                n = from_disk[i];
                break;
            }
        free(dk);
        free(dc);
    }
    for (int i = n; i < n_keys; i++) {
        cache_chunk_unref(out[i]);
        out[i] = NULL;
    }
    free(from_disk);
    return n;
}

bool cache_store_contains(cache_store *s, const cache_key *key) {
    return (s->ram && cache_ram_contains(s->ram, key)) ||
           (s->disk && cache_disk_contains(s->disk, key));
}

void cache_store_put(cache_store *s, cache_chunk *c) {
    if (s->ram) cache_ram_put(s->ram, c);
    if (s->disk) cache_disk_put(s->disk, c);
}

int cache_store_pin(cache_store *s, const cache_key *keys, int n_keys, bool pin) {
    int ram = s->ram ? cache_ram_pin(s->ram, keys, n_keys, pin) : 0;
    int disk = s->disk ? cache_disk_pin(s->disk, keys, n_keys, pin) : 0;
    return s->ram ? ram : disk; /* resident means in RAM, when there is a RAM tier */
}

void cache_store_clear(cache_store *s, const cache_key *ns, bool ram, bool disk, int64_t *n_ram,
                       int64_t *n_disk) {
    *n_ram = ram && s->ram ? cache_ram_clear(s->ram, ns) : 0;
    *n_disk = disk && s->disk ? cache_disk_clear(s->disk, ns) : 0;
}

void cache_store_stats(cache_store *s, cache_stats *out) {
    memset(out, 0, sizeof *out);
    if (s->ram) cache_ram_stats(s->ram, &out->ram);
    if (s->disk) cache_disk_stats(s->disk, &out->disk);
    out->disk_enabled = s->disk != NULL;
}

void cache_store_flush(cache_store *s) {
    if (s->disk) cache_disk_flush(s->disk);
}
