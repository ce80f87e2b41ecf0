/* Chunk keys (DESIGN.md "Chunk keys") and chunk records in memory. Keys are SHA-256 through
 * OpenSSL's EVP interface, deterministic across processes and machines: every integer is
 * hashed little-endian and every field is fixed-length or tagged. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/evp.h>

#include "cache/cache.h"

/* Domain tags keep the three kinds of hash apart even over the same bytes. */
static const char TAG_NAMESPACE[] = "kvserve.namespace.v1";
static const char TAG_PREFIX[] = "kvserve.prefix.v1";
static const char TAG_CONTENT[] = "kvserve.content.v1";
static const char TAG_SCHEMA[] = "kvserve.schema.v1";

/* Hashes tokens as little-endian int32 (the wire order on every supported host). */
static void digest_tokens(EVP_MD_CTX *md, const int32_t *tokens, int n_tokens) {
    uint8_t buf[1024];
    size_t fill = 0;
    for (int i = 0; i < n_tokens; i++) {
        uint32_t v = (uint32_t)tokens[i];
        buf[fill++] = (uint8_t)v;
        buf[fill++] = (uint8_t)(v >> 8);
        buf[fill++] = (uint8_t)(v >> 16);
        buf[fill++] = (uint8_t)(v >> 24);
        if (fill == sizeof buf) {
            EVP_DigestUpdate(md, buf, fill);
            fill = 0;
        }
    }
    if (fill) EVP_DigestUpdate(md, buf, fill);
}

static void digest_u32(EVP_MD_CTX *md, uint32_t v) {
    uint8_t b[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
    EVP_DigestUpdate(md, b, 4);
}

/* The EVP context is created per call: a few hundred nanoseconds against a chunk's microseconds
 * of hashing, and no state shared between threads. Allocation failure (the only way these
 * calls fail) aborts: a key that silently differed would be worse than no server. */
static EVP_MD_CTX *digest_begin(const char *tag) {
    EVP_MD_CTX *md = EVP_MD_CTX_new();
    if (!md || EVP_DigestInit_ex(md, EVP_sha256(), NULL) != 1) {
        log_error("cache: SHA-256 is unavailable (out of memory)");
        abort();
    }
    EVP_DigestUpdate(md, tag, strlen(tag) + 1);
    return md;
}

static void digest_end(EVP_MD_CTX *md, cache_key *out) {
    unsigned int len = 0;
    EVP_DigestFinal_ex(md, out->b, &len);
    EVP_MD_CTX_free(md);
}

void cache_namespace(const uint8_t *tenant, size_t tenant_len, const char *salt, cache_key *ns) {
    EVP_MD_CTX *md = digest_begin(TAG_NAMESPACE);
    /* Lengths first, so (tenant, salt) pairs cannot collide by shifting bytes between them. */
    size_t salt_len = salt ? strlen(salt) : 0;
    digest_u32(md, (uint32_t)tenant_len);
    digest_u32(md, salt ? (uint32_t)salt_len : UINT32_MAX);
    if (tenant_len) EVP_DigestUpdate(md, tenant, tenant_len);
    if (salt_len) EVP_DigestUpdate(md, salt, salt_len);
    digest_end(md, ns);
}

/* A chained key's digest so far: tag, model identity, namespace, previous key (none: zeros). */
static EVP_MD_CTX *chain_begin(const char *tag, const uint8_t model_id[32], const cache_key *ns,
                               const cache_key *prev) {
    static const cache_key zero;
    EVP_MD_CTX *md = digest_begin(tag);
    EVP_DigestUpdate(md, model_id, 32);
    EVP_DigestUpdate(md, ns->b, CACHE_KEY_BYTES);
    EVP_DigestUpdate(md, (prev ? prev : &zero)->b, CACHE_KEY_BYTES);
    return md;
}

void cache_schema_key(const uint8_t model_id[32], const cache_key *ns, const cache_key *prev,
                      const int32_t *tokens, const int32_t *pos, int n_tokens, cache_key *out) {
    EVP_MD_CTX *md = chain_begin(TAG_SCHEMA, model_id, ns, prev);
    digest_u32(md, (uint32_t)n_tokens);
    digest_tokens(md, tokens, n_tokens);
    digest_tokens(md, pos, n_tokens);
    digest_end(md, out);
}

void cache_prefix_key(const uint8_t model_id[32], const cache_key *ns, const cache_key *prev,
                      const int32_t *tokens, int n_tokens, cache_key *out) {
    EVP_MD_CTX *md = chain_begin(TAG_PREFIX, model_id, ns, prev);
    digest_u32(md, (uint32_t)n_tokens);
    digest_tokens(md, tokens, n_tokens);
    digest_end(md, out);
}

int cache_prefix_keys(const uint8_t model_id[32], const cache_key *ns, const int32_t *tokens,
                      int n_tokens, int block_tokens, cache_key *out, int max_keys) {
    if (block_tokens <= 0 || n_tokens <= 0) return 0;
    int n = n_tokens / block_tokens;
    if (n > max_keys) n = max_keys;
    for (int i = 0; i < n; i++)
        cache_prefix_key(model_id, ns, i ? &out[i - 1] : NULL, tokens + (size_t)i * block_tokens,
                         block_tokens, &out[i]);
    return n;
}

int cache_record_keys(const cache_key *bkeys, int n_blocks, int chunk_blocks, cache_key *out) {
    int n = 0;
    for (int end = chunk_blocks; end - chunk_blocks < n_blocks; end += chunk_blocks)
        out[n++] = bkeys[(end < n_blocks ? end : n_blocks) - 1];
    return n;
}

void cache_content_key(const uint8_t model_id[32], const cache_key *ns, const int32_t *tokens,
                       int n_tokens, cache_key *out) {
    EVP_MD_CTX *md = digest_begin(TAG_CONTENT);
    EVP_DigestUpdate(md, model_id, 32);
    EVP_DigestUpdate(md, ns->b, CACHE_KEY_BYTES);
    digest_u32(md, (uint32_t)n_tokens);
    digest_tokens(md, tokens, n_tokens);
    digest_end(md, out);
}

void cache_key_hex(const cache_key *k, char out[2 * CACHE_KEY_BYTES + 1]) {
    kv_hex_encode(k->b, CACHE_KEY_BYTES, out);
}

/* ---------------------------------------------------------------- layout and records */

int cache_layout_check(const cache_layout *l, kv_error *err) {
    if (l->n_layer < 1 || l->n_layer > 1024 || l->n_kv_head < 1 || l->n_kv_head > 1024 ||
        l->head_dim < 1 || l->head_dim > 1024)
        return kv_fail(err, "cache layout out of range: %d layers, %d KV heads, head dim %d",
                       l->n_layer, l->n_kv_head, l->head_dim);
    if (l->block_tokens < 16 || l->block_tokens > 4096 || l->block_tokens % 16)
        return kv_fail(err, "cache block size must be a multiple of 16 in 16..4096, got %d",
                       l->block_tokens);
    if (l->chunk_tokens < l->block_tokens || l->chunk_tokens % l->block_tokens ||
        l->chunk_tokens / l->block_tokens > CACHE_MAX_CHUNK_BLOCKS)
        return kv_fail(err,
                       "chunk size %d must be a multiple of the KV block size %d (at most %d "
                       "blocks)",
                       l->chunk_tokens, l->block_tokens, CACHE_MAX_CHUNK_BLOCKS);
    return 0;
}

size_t cache_block_bytes(const cache_layout *l) {
    return (size_t)l->n_layer * 2 * (size_t)l->n_kv_head * (size_t)l->block_tokens *
           (size_t)l->head_dim * 2;
}

int cache_chunk_blocks(const cache_layout *l) { return l->chunk_tokens / l->block_tokens; }

size_t cache_chunk_bytes(const cache_layout *l) {
    return cache_block_bytes(l) * (size_t)cache_chunk_blocks(l);
}

/* A chunk of a payload of `bytes` bytes (uninitialised; its padding zero). */
static cache_chunk *chunk_alloc(const cache_key *bkeys, int n_blocks, const cache_key *ns,
                                int32_t pos0, size_t bytes) {
    /* The block keys live in the same allocation. */
    cache_chunk *c = calloc(1, sizeof *c + sizeof(cache_key) * (size_t)n_blocks);
    if (!c) return NULL;
    c->bkeys = (cache_key *)(void *)(c + 1);
    if (bkeys) {
        memcpy(c->bkeys, bkeys, sizeof(cache_key) * (size_t)n_blocks);
        c->key = bkeys[n_blocks - 1];
    }
    c->ns = *ns;
    c->pos0 = pos0;
    c->n_blocks = n_blocks;
    c->bytes = bytes;
    size_t cap = (c->bytes + CACHE_ALIGN - 1) / CACHE_ALIGN * CACHE_ALIGN;
    void *p = NULL;
    if (posix_memalign(&p, CACHE_ALIGN, cap) != 0) {
        free(c);
        return NULL;
    }
    c->data = p;
    /* The padding after the payload is written to disk with it (O_DIRECT writes whole
     * blocks): zero it so no stale heap bytes leave the process. */
    memset(c->data + c->bytes, 0, cap - c->bytes);
    atomic_init(&c->refs, 1);
    return c;
}

cache_chunk *cache_chunk_create(const cache_layout *l, const cache_key *bkeys, int n_blocks,
                                const cache_key *ns, int32_t pos0) {
    if (n_blocks < 1 || n_blocks > cache_chunk_blocks(l)) return NULL;
    return chunk_alloc(bkeys, n_blocks, ns, pos0, cache_block_bytes(l) * (size_t)n_blocks);
}

cache_chunk *cache_chunk_create_encoded(const cache_chunk *like, int enc, const uint8_t *payload,
                                        size_t len) {
    cache_chunk *c = chunk_alloc(like->bkeys, like->n_blocks, &like->ns, like->pos0, len);
    if (!c) return NULL;
    memcpy(c->data, payload, len);
    c->enc = (uint8_t)enc;
    return c;
}

void cache_chunk_ref(cache_chunk *c) { atomic_fetch_add(&c->refs, 1); }

void cache_chunk_unref(cache_chunk *c) {
    if (!c || atomic_fetch_sub(&c->refs, 1) != 1) return;
    free(c->data);
    free(c);
}

/* ---------------------------------------------------------------- encoding names */

void cache_enc_name(int enc, char out[16]) {
    if (enc == CACHE_ENC_TEXT)
        snprintf(out, 16, "text");
    else if (enc == CACHE_ENC_RAW)
        snprintf(out, 16, "lossless");
    else if (enc == CACHE_ENC_Q8)
        snprintf(out, 16, "q8");
    else
        snprintf(out, 16, "codec%d", (enc - CACHE_ENC_CODEC) & 0xff);
}

int cache_enc_parse(const char *name) {
    for (int e = CACHE_ENC_TEXT; e < CACHE_ENC_MAX; e++) {
        char n[16];
        cache_enc_name(e, n);
        if (e != CACHE_ENC_ANY && strcmp(n, name) == 0) return e;
    }
    return CACHE_ENC_ANY;
}
