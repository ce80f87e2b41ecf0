/* The disk tier's leases file (internal to cache/): the leases of its records (cache.h's
 * cache_store_lease), kept beside them as `leases` in the tier's directory so a lease outlives a
 * restart as the records do. Pins until unpinned are not kept: their owners (the pin endpoint,
 * the schema registry) make them again.
 *
 *   offset  size  field
 *   0       8     magic "KVLEASES"
 *   8       4     format version (CACHE_LEASES_VERSION), little-endian like every integer
 *   12      4     n: the number of leases
 *   16      40xn  per lease: the record's key (32 bytes), then its expiry (int64 Unix seconds)
 *   16+40n  32    SHA-256 of every byte before it
 *
 * The file is rewritten whole (a temporary file renamed into place) whenever the leases change;
 * a file that fails any check is ignored (the leases are lost, the records are not).
 * tests/fuzz/leases_fuzz.c fuzzes the parser. */
#ifndef KVSERVE_CACHE_LEASES_H
#define KVSERVE_CACHE_LEASES_H

#include "cache/cache.h"

#define CACHE_LEASES_VERSION 1
#define CACHE_LEASES_MAX (1 << 20) /* leases one file may hold */

typedef struct cache_lease {
    cache_key key; /* the record's own key */
    int64_t until; /* Unix seconds, > 0 */
} cache_lease;

/* Bytes of a file holding n leases. */
size_t cache_leases_bytes(int n);
/* Writes n leases into out (cache_leases_bytes(n) bytes). -1 when the checksum cannot be made. */
int cache_leases_encode(const cache_lease *leases, int n, uint8_t *out);
/* Parses buf[0..len): the leases (malloc'd, NULL when none) and their count, or -1 with err
 * (size, magic, version, count, a non-positive expiry or the checksum wrong). */
int cache_leases_parse(const uint8_t *buf, size_t len, cache_lease **out, int *n, kv_error *err);

#endif
