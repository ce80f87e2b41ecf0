/* The shared state's envelope (cache/store/redis_envelope.h). */
#include "cache/store/redis_envelope.h"

#include <stdlib.h>
#include <string.h>

#include "util/util.h"

#define ENV_MAGIC "KVST"

/* SHA-256 over what the envelope vouches for. */
static void env_sum(int kind, const cache_key *ns, const int64_t when[2], const char *name,
                    size_t n_name, const void *value, size_t len, uint8_t out[32]) {
    uint8_t head[CACHE_KEY_BYTES + 1 + 16 + 4 + REDIS_ENV_NAME_MAX];
    memcpy(head, ns->b, CACHE_KEY_BYTES);
    head[CACHE_KEY_BYTES] = (uint8_t)kind;
    le_put_u64(head + CACHE_KEY_BYTES + 1, (uint64_t)when[0]);
    le_put_u64(head + CACHE_KEY_BYTES + 9, (uint64_t)when[1]);
    le_put_u32(head + CACHE_KEY_BYTES + 17, (uint32_t)n_name);
    memcpy(head + CACHE_KEY_BYTES + 21, name, n_name);
    kv_sha256_2(head, CACHE_KEY_BYTES + 21 + n_name, value, len, out);
}

uint8_t *redis_env_make(int kind, const cache_key *ns, const int64_t when[2], const char *name,
                        const void *value, size_t len, size_t *out_len) {
    size_t n_name = strlen(name);
    if (n_name < 1 || n_name > REDIS_ENV_NAME_MAX || len > UINT32_MAX) return NULL;
    uint8_t *v = malloc(REDIS_ENV_HEAD + n_name + len);
    if (!v) return NULL;
    memcpy(v, ENV_MAGIC, 4);
    le_put_u32(v + 4, REDIS_ENV_VERSION);
    le_put_u64(v + 8, (uint64_t)when[0]);
    le_put_u64(v + 16, (uint64_t)when[1]);
    le_put_u32(v + 24, (uint32_t)n_name);
    le_put_u32(v + 28, (uint32_t)len);
    env_sum(kind, ns, when, name, n_name, value, len, v + 32);
    memcpy(v + REDIS_ENV_HEAD, name, n_name);
    if (len) memcpy(v + REDIS_ENV_HEAD + n_name, value, len);
    *out_len = REDIS_ENV_HEAD + n_name + len;
    return v;
}

bool redis_env_check(int kind, const cache_key *ns, const char *name, size_t max_value,
                     const uint8_t *v, size_t n, const uint8_t **value, size_t *len,
                     int64_t when[2], const char **why) {
    if (n < REDIS_ENV_HEAD || memcmp(v, ENV_MAGIC, 4) != 0 ||
        le_get_u32(v + 4) != REDIS_ENV_VERSION) {
        *why = "not an envelope of this version";
        return false;
    }
    size_t n_name = le_get_u32(v + 24), n_value = le_get_u32(v + 28);
    if (n_name > REDIS_ENV_NAME_MAX || n_value > max_value ||
        n != REDIS_ENV_HEAD + n_name + n_value) {
        *why = "its lengths are out of bounds or disagree with its size";
        return false;
    }
    if (n_name != strlen(name) || memcmp(v + REDIS_ENV_HEAD, name, n_name) != 0) {
        *why = "it names another item";
        return false;
    }
    uint8_t sum[32];
    when[0] = (int64_t)le_get_u64(v + 8);
    when[1] = (int64_t)le_get_u64(v + 16);
    env_sum(kind, ns, when, name, n_name, v + REDIS_ENV_HEAD + n_name, n_value, sum);
    if (memcmp(sum, v + 32, 32) != 0) {
        *why = "checksum mismatch (damaged, or another namespace's)";
        return false;
    }
    *value = v + REDIS_ENV_HEAD + n_name;
    *len = n_value;
    return true;
}
