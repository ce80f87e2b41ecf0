/* libFuzzer target for the shared state's envelope (cache/store/redis_envelope.c). The input is
 * checked as an envelope read under a fixed key, from a heap copy of exactly its bytes (ASan sees
 * any read past the end): an acceptance must point inside the input. Then the input is split into
 * a name (up to its first NUL, at most 64 bytes; one byte at least) and a value, wrapped, and the
 * envelope must be accepted with the same value and times, and refused once any byte of it (one
 * the input picks) is changed, or under another namespace, kind or name. Any violation aborts. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/store/redis_envelope.h"

static const size_t MAX_VALUE = 1 << 20;

static bool check(int kind, const cache_key *ns, const char *name, const uint8_t *v, size_t n,
                  const uint8_t **value, size_t *len, int64_t when[2]) {
    const char *why = NULL;
    bool ok = redis_env_check(kind, ns, name, MAX_VALUE, v, n, value, len, when, &why);
    if (!ok && (!why || !why[0])) abort();
    if (ok && (*value < v || *value + *len > v + n)) abort();
    return ok;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    cache_key ns, other;
    memset(ns.b, 7, sizeof ns.b);
    memset(other.b, 8, sizeof other.b);
    uint8_t *copy = malloc(size ? size : 1);
    if (!copy) return 0;
    memcpy(copy, data, size);
    const uint8_t *value;
    size_t len;
    int64_t when[2];
    check(0, &ns, "n", copy, size, &value, &len, when);
    free(copy);

    char name[65];
    size_t n_name = strnlen((const char *)data, size < 64 ? size : 64);
    memcpy(name, data, n_name);
    name[n_name] = 0;
    if (!n_name) strcpy(name, "n");
    const uint8_t *val = data + (n_name < size ? n_name + 1 : size);
    size_t n_val = (size_t)(data + size - val);
    if (n_val > MAX_VALUE) return 0;
    char longer[67];
    snprintf(longer, sizeof longer, "%s+", name); /* another name */
    int64_t at[2] = {(int64_t)size, (int64_t)size * 3 + 1};
    size_t n;
    uint8_t *env = redis_env_make(1, &ns, at, name, val, n_val, &n);
    if (!env) abort();
    if (!check(1, &ns, name, env, n, &value, &len, when) || len != n_val ||
        (n_val && memcmp(value, val, n_val)) || when[0] != at[0] || when[1] != at[1])
        abort();
    if (check(1, &other, name, env, n, &value, &len, when) ||
        check(2, &ns, name, env, n, &value, &len, when) ||
        check(1, &ns, longer, env, n, &value, &len, when) ||
        check(1, &ns, name, env, n - 1, &value, &len, when))
        abort();
    size_t at_byte = size ? data[0] * 131u % n : 0;
    env[at_byte] ^= 0x40;
    if (check(1, &ns, name, env, n, &value, &len, when)) abort();
    free(env);
    return 0;
}
