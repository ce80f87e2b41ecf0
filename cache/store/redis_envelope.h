/* The envelope of an item of the state shared through Redis (internal to cache/store/: its user
 * is redis_state.c; tests/fuzz/redis_envelope_fuzz.c fuzzes the check). Little-endian:
 *
 *   "KVST" | u32 version | i64 stored | i64 expires (Unix s) | u32 name bytes |
 *   u32 value bytes | SHA-256(namespace, kind, stored, expires, name bytes, name, value) |
 *   name | value
 *
 * The namespace and kind are not stored: the checksum holds them, so a value copied under
 * another namespace's or kind's key fails it. */
#ifndef KVSERVE_CACHE_REDIS_ENVELOPE_H
#define KVSERVE_CACHE_REDIS_ENVELOPE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cache/cache.h"

#define REDIS_ENV_VERSION 1u
#define REDIS_ENV_HEAD (4 + 4 + 8 + 8 + 4 + 4 + 32)
#define REDIS_ENV_NAME_MAX 1024 /* bytes of a name */

/* The envelope of (kind, ns, name: 1..REDIS_ENV_NAME_MAX bytes) holding value, stored at when[0]
 * and expiring at when[1]; malloc'd, *out_len its bytes. NULL when out of memory or the name is
 * out of bounds. */
uint8_t *redis_env_make(int kind, const cache_key *ns, const int64_t when[2], const char *name,
                        const void *value, size_t len, size_t *out_len);
/* Checks the n bytes v read under the key of (kind, ns, name): the magic and version, lengths
 * that agree with n (a value at most max_value bytes), the name, the checksum. true with *value
 * pointing into v (*len bytes) and when filled; false with why. */
bool redis_env_check(int kind, const cache_key *ns, const char *name, size_t max_value,
                     const uint8_t *v, size_t n, const uint8_t **value, size_t *len,
                     int64_t when[2], const char **why);

#endif
