/* The disk tier's leases file (cache/store/leases.h): encoded and parsed with every length and
 * field checked before it is trusted. */
#include "cache/store/leases.h"

#include <openssl/evp.h>
#include <stdlib.h>
#include <string.h>

static const uint8_t MAGIC[8] = {'K', 'V', 'L', 'E', 'A', 'S', 'E', 'S'};
#define HEADER 16
#define ENTRY 40
#define SUM 32

static void put_u32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t get_u32(const uint8_t *p) {
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) v |= (uint32_t)p[i] << (8 * i);
    return v;
}

static void put_i64(uint8_t *p, int64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)((uint64_t)v >> (8 * i));
}

static int64_t get_i64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
    return (int64_t)v;
}

static int checksum(const uint8_t *buf, size_t len, uint8_t out[SUM]) {
    unsigned n = 0;
    return EVP_Digest(buf, len, out, &n, EVP_sha256(), NULL) == 1 && n == SUM ? 0 : -1;
}

size_t cache_leases_bytes(int n) { return HEADER + (size_t)n * ENTRY + SUM; }

int cache_leases_encode(const cache_lease *leases, int n, uint8_t *out) {
    memcpy(out, MAGIC, sizeof MAGIC);
    put_u32(out + 8, CACHE_LEASES_VERSION);
    put_u32(out + 12, (uint32_t)n);
    for (int i = 0; i < n; i++) {
        uint8_t *p = out + HEADER + (size_t)i * ENTRY;
        memcpy(p, leases[i].key.b, CACHE_KEY_BYTES);
        put_i64(p + CACHE_KEY_BYTES, leases[i].until);
    }
    size_t body = HEADER + (size_t)n * ENTRY;
    return checksum(out, body, out + body);
}

int cache_leases_parse(const uint8_t *buf, size_t len, cache_lease **out, int *n, kv_error *err) {
    *out = NULL;
    *n = 0;
    if (len < HEADER + SUM) return kv_fail(err, "leases: %zu bytes, shorter than a header", len);
    if (memcmp(buf, MAGIC, sizeof MAGIC) != 0) return kv_fail(err, "leases: not a leases file");
    uint32_t version = get_u32(buf + 8), count = get_u32(buf + 12);
    if (version != CACHE_LEASES_VERSION)
        return kv_fail(err, "leases: format version %u, expected %d", version,
                       CACHE_LEASES_VERSION);
    if (count > CACHE_LEASES_MAX)
        return kv_fail(err, "leases: %u leases, more than %d", count, CACHE_LEASES_MAX);
    size_t body = HEADER + (size_t)count * ENTRY;
    if (len != body + SUM)
        return kv_fail(err, "leases: %zu bytes for %u leases, expected %zu", len, count,
                       body + SUM);
    uint8_t sum[SUM];
    if (checksum(buf, body, sum) != 0) return kv_fail(err, "leases: cannot compute SHA-256");
    if (memcmp(sum, buf + body, SUM) != 0) return kv_fail(err, "leases: checksum mismatch");
    if (count == 0) return 0;
    cache_lease *l = malloc(sizeof *l * count);
    if (!l) return kv_fail(err, "leases: out of memory");
    for (uint32_t i = 0; i < count; i++) {
        const uint8_t *p = buf + HEADER + (size_t)i * ENTRY;
        memcpy(l[i].key.b, p, CACHE_KEY_BYTES);
        l[i].until = get_i64(p + CACHE_KEY_BYTES);
        if (l[i].until <= 0) {
            long long bad = (long long)l[i].until;
            free(l);
            return kv_fail(err, "leases: lease %u has expiry %lld", i, bad);
        }
    }
    *out = l;
    *n = (int)count;
    return 0;
}
