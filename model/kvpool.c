/* The paged KV pool: fixed-size blocks of block_tokens slots (every layer's K and V), a free
 * list, and reference counts so sequences with a common prefix share its blocks (vLLM's
 * PagedAttention block tables). A block is written only while one sequence holds it: the first
 * write into a shared block copies it. */
#include <stdlib.h>
#include <string.h>

#include "model/model.h"

struct kv_pool {
    backend *b;
    kv_layout layout;
    void *mem;         /* backend memory: [n_blocks] blocks, see kv_layout */
    int32_t *refs;     /* [n_blocks] */
    int32_t *free_ids; /* stack of free block ids */
    int64_t n_free;
};

kv_pool *kv_pool_create(backend *b, const model *m, int64_t n_tokens, int block_tokens,
                        kv_error *err) {
    if (block_tokens < 16 || block_tokens > 4096 || block_tokens % 16 != 0) {
        kv_fail(err, "KV block size must be a multiple of 16 in 16..4096, got %d", block_tokens);
        return NULL;
    }
    if (n_tokens < block_tokens) {
        kv_fail(err, "KV pool of %lld tokens is smaller than one block (%d)", (long long)n_tokens,
                block_tokens);
        return NULL;
    }
    int64_t n_blocks = n_tokens / block_tokens;
    if (n_blocks > INT32_MAX) {
        kv_fail(err, "KV pool of %lld tokens is too large", (long long)n_tokens);
        return NULL;
    }
    kv_pool *p = calloc(1, sizeof *p);
    if (!p) goto oom;
    p->b = b;
    p->layout = (kv_layout){m->hp.n_layer, m->hp.n_kv_head, m->hp.head_dim, block_tokens, n_blocks};
    p->refs = calloc((size_t)n_blocks, sizeof *p->refs);
    p->free_ids = malloc(sizeof *p->free_ids * (size_t)n_blocks);
    if (!p->refs || !p->free_ids) goto oom;
    p->mem = backend_kv_alloc(b, &p->layout);
    if (!p->mem) {
        kv_fail(err, "cannot allocate the KV pool: %lld tokens x %zu bytes",
                (long long)(n_blocks * block_tokens), model_kv_bytes_per_token(m));
        kv_pool_destroy(p);
        return NULL;
    }
    /* Low ids on top of the stack: allocation order is deterministic. */
    for (int64_t i = 0; i < n_blocks; i++) p->free_ids[i] = (int32_t)(n_blocks - 1 - i);
    p->n_free = n_blocks;
    return p;
oom:
    kv_pool_destroy(p);
    kv_fail(err, "out of memory creating the KV pool");
    return NULL;
}

void kv_pool_destroy(kv_pool *p) {
    if (!p) return;
    if (p->mem) backend_kv_free(p->b, p->mem);
    free(p->refs);
    free(p->free_ids);
    free(p);
}

const kv_layout *kv_pool_layout(const kv_pool *p) { return &p->layout; }
void *kv_pool_memory(kv_pool *p) { return p->mem; }
int64_t kv_pool_free_blocks(const kv_pool *p) { return p->n_free; }
int64_t kv_pool_total_blocks(const kv_pool *p) { return p->layout.n_blocks; }
int kv_pool_block_refs(const kv_pool *p, int32_t block) {
    return block >= 0 && block < p->layout.n_blocks ? p->refs[block] : 0;
}

static int32_t pool_take(kv_pool *p) {
    int32_t id = p->free_ids[--p->n_free];
    p->refs[id] = 1;
    return id;
}

static void pool_unref(kv_pool *p, int32_t id) {
    if (--p->refs[id] == 0) p->free_ids[p->n_free++] = id;
}

void kv_seq_init(kv_seq *s) { memset(s, 0, sizeof *s); }

static int seq_grow_table(kv_seq *s, int n_blocks) {
    if (n_blocks <= s->cap_blocks) return 0;
    int cap = s->cap_blocks ? s->cap_blocks : 8;
    while (cap < n_blocks) cap *= 2;
    int32_t *t = realloc(s->blocks, sizeof *t * (size_t)cap);
    if (!t) return -1;
    s->blocks = t;
    s->cap_blocks = cap;
    return 0;
}

int kv_seq_reserve(kv_pool *p, kv_seq *s, int n_tokens, kv_error *err) {
    int bt = p->layout.block_tokens;
    if (n_tokens < 0) return kv_fail(err, "negative KV reservation");
    int need = (n_tokens + bt - 1) / bt;
    /* The block holding the next slot to write may be shared (after a fork): it is copied. */
    int first_write = s->n_tokens / bt;
    bool cow =
        first_write < s->n_blocks && s->n_tokens < n_tokens && p->refs[s->blocks[first_write]] > 1;
    int64_t extra = (need > s->n_blocks ? need - s->n_blocks : 0) + (cow ? 1 : 0);
    if (extra > p->n_free)
        return kv_fail(err, "KV pool full: need %lld more blocks of %d tokens, %lld free",
                       (long long)extra, bt, (long long)p->n_free);
    if (seq_grow_table(s, need) != 0) return kv_fail(err, "out of memory for a block table");
    if (cow) {
        int32_t old = s->blocks[first_write];
        int32_t fresh = pool_take(p);
        backend_kv_copy_block(p->b, p->mem, &p->layout, fresh, old);
        pool_unref(p, old);
        s->blocks[first_write] = fresh;
    }
    while (s->n_blocks < need) s->blocks[s->n_blocks++] = pool_take(p);
    return 0;
}

int kv_seq_fork(kv_pool *p, kv_seq *dst, const kv_seq *src, int n_tokens, kv_error *err) {
    int bt = p->layout.block_tokens;
    if (dst->n_blocks != 0) return kv_fail(err, "kv_seq_fork: destination is not empty");
    if (n_tokens < 0 || n_tokens > src->n_tokens)
        return kv_fail(err, "kv_seq_fork: %d tokens requested, source holds %d", n_tokens,
                       src->n_tokens);
    int nb = (n_tokens + bt - 1) / bt;
    if (seq_grow_table(dst, nb) != 0) return kv_fail(err, "out of memory for a block table");
    for (int i = 0; i < nb; i++) {
        dst->blocks[i] = src->blocks[i];
        p->refs[src->blocks[i]]++;
    }
    dst->n_blocks = nb;
    dst->n_tokens = n_tokens;
    return 0;
}

void kv_seq_truncate(kv_pool *p, kv_seq *s, int n_tokens) {
    if (n_tokens < 0) n_tokens = 0;
    if (n_tokens >= s->n_tokens) return;
    int bt = p->layout.block_tokens;
    int keep = (n_tokens + bt - 1) / bt;
    while (s->n_blocks > keep) pool_unref(p, s->blocks[--s->n_blocks]);
    s->n_tokens = n_tokens;
}

void kv_seq_release(kv_pool *p, kv_seq *s) {
    while (s->n_blocks > 0) pool_unref(p, s->blocks[--s->n_blocks]);
    free(s->blocks);
    kv_seq_init(s);
}

void kv_pool_block_ref(kv_pool *p, int32_t block) { p->refs[block]++; }
void kv_pool_block_unref(kv_pool *p, int32_t block) { pool_unref(p, block); }

static int seq_check_whole(const kv_pool *p, const kv_seq *s, kv_error *err) {
    int bt = p->layout.block_tokens;
    if (s->n_tokens % bt != 0 || s->n_blocks != s->n_tokens / bt)
        return kv_fail(err, "appending blocks to a sequence that holds %d tokens in %d blocks",
                       s->n_tokens, s->n_blocks);
    return 0;
}

int kv_seq_append_blocks(kv_pool *p, kv_seq *s, const int32_t *blocks, int n, kv_error *err) {
    if (seq_check_whole(p, s, err)) return -1;
    if (seq_grow_table(s, s->n_blocks + n) != 0)
        return kv_fail(err, "out of memory for a block table");
    for (int i = 0; i < n; i++) {
        p->refs[blocks[i]]++;
        s->blocks[s->n_blocks++] = blocks[i];
    }
    s->n_tokens += n * p->layout.block_tokens;
    return 0;
}

int kv_seq_import_blocks(kv_pool *p, kv_seq *s, int n, const void *host, kv_error *err) {
    if (seq_check_whole(p, s, err)) return -1;
    if (n > p->n_free)
        return kv_fail(err, "KV pool full: need %d blocks, %lld free", n, (long long)p->n_free);
    if (seq_grow_table(s, s->n_blocks + n) != 0)
        return kv_fail(err, "out of memory for a block table");
    int first = s->n_blocks;
    for (int i = 0; i < n; i++) s->blocks[s->n_blocks++] = pool_take(p);
    backend_kv_write_blocks(p->b, p->mem, &p->layout, s->blocks + first, n, host);
    s->n_tokens += n * p->layout.block_tokens;
    return 0;
}

void kv_seq_export_blocks(kv_pool *p, const kv_seq *s, int first, int n, void *host) {
    kv_pool_export_blocks(p, s->blocks + first, n, host);
}

void kv_pool_export_blocks(kv_pool *p, const int32_t *blocks, int n, void *host) {
    backend_kv_read_blocks(p->b, p->mem, &p->layout, blocks, n, host);
}

/* ---------------------------------------------------------------- token rows */

/* Host blocks are a record payload: blocks in the pool's layout back to back, host slot h in
 * block h / block_tokens at slot h % block_tokens. dir 0: pool to host, 1: host to pool. */
static int seq_rows(kv_pool *p, kv_seq *s, int slot, int n, uint8_t *host, int host_slot, int dir) {
    if (dir == 0)
        backend_kv_read_rows(p->b, p->mem, &p->layout, s->blocks, slot, n, host, host_slot);
    else
        backend_kv_write_rows(p->b, p->mem, &p->layout, s->blocks, slot, n, host, host_slot);
    return 0;
}

/* Rows one at a time at the edges, whole blocks (every layer at once, bit for bit) where the
 * two sides line up on block boundaries. */
static int seq_copy(kv_pool *p, kv_seq *s, int slot, int n, uint8_t *host, int host_slot, int dir) {
    int bt = p->layout.block_tokens;
    size_t bb = kv_layout_block_bytes(&p->layout);
    if (slot % bt == host_slot % bt) {
        int lead = (bt - slot % bt) % bt;
        if (lead > n) lead = n;
        if (lead > 0 && seq_rows(p, s, slot, lead, host, host_slot, dir)) return -1;
        slot += lead, host_slot += lead, n -= lead;
        int whole = n / bt;
        if (whole > 0) {
            uint8_t *hb = host + (size_t)(host_slot / bt) * bb;
            if (dir == 0)
                backend_kv_read_blocks(p->b, p->mem, &p->layout, s->blocks + slot / bt, whole, hb);
            else
                backend_kv_write_blocks(p->b, p->mem, &p->layout, s->blocks + slot / bt, whole, hb);
        }
        slot += whole * bt, host_slot += whole * bt, n -= whole * bt;
    }
    return n > 0 ? seq_rows(p, s, slot, n, host, host_slot, dir) : 0;
}

int kv_seq_export_rows(kv_pool *p, const kv_seq *s, int slot, int n, void *host, int host_slot,
                       kv_error *err) {
    if (slot < 0 || n < 0 || host_slot < 0 || slot + n > s->n_tokens)
        return kv_fail(err, "exporting slots %d..%d of a sequence of %d", slot, slot + n,
                       s->n_tokens);
    if (seq_copy(p, (kv_seq *)s, slot, n, host, host_slot, 0))
        return kv_fail(err, "out of memory exporting KV rows");
    return 0;
}

int kv_seq_import_rows(kv_pool *p, kv_seq *s, int slot, int n, const void *host, int host_slot,
                       kv_error *err) {
    int bt = p->layout.block_tokens;
    if (slot < 0 || n < 0 || host_slot < 0 || slot + n > s->n_blocks * bt)
        return kv_fail(err, "importing slots %d..%d into %d reserved", slot, slot + n,
                       s->n_blocks * bt);
    for (int b = slot / bt; n > 0 && b <= (slot + n - 1) / bt; b++)
        if (p->refs[s->blocks[b]] != 1)
            return kv_fail(err, "importing KV rows into a shared block");
    if (seq_copy(p, s, slot, n, (uint8_t *)(uintptr_t)host, host_slot, 1))
        return kv_fail(err, "out of memory importing KV rows");
    return 0;
}
