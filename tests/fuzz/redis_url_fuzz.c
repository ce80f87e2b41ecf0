/* libFuzzer target for the Redis tier's URL parser (cache_redis_parse_url, cache/store/redis.c).
 * Each input, cut at its first NUL, is parsed from a heap copy of exactly its bytes (ASan sees any
 * read past the end). A refusal must name its reason; an accepted URL must give a TCP host or an
 * absolute socket path (not both), a port in 1..65535, a database in 0..65535, a host without the
 * URL's separators, and, written back as a URL, must parse again to the same fields. Any
 * violation aborts. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/store/redis.h"

static void check(const cache_redis_addr *a) {
    if (!a->host[0] == !a->path[0]) abort();
    if (a->path[0] && a->path[0] != '/') abort();
    if (a->port < 1 || a->port > 65535 || a->db < 0 || a->db > 65535) abort();
    if (strpbrk(a->host, ":/@[]?# ")) abort();
    if (!a->has_password && a->password[0]) abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    size_t n = strnlen((const char *)data, size);
    char *url = malloc(n + 1);
    if (!url) return 0;
    memcpy(url, data, n);
    url[n] = '\0';
    cache_redis_addr a, b;
    kv_error err = {{0}};
    if (cache_redis_parse_url(url, &a, &err) != 0) {
        if (!err.msg[0]) abort();
        free(url);
        return 0;
    }
    check(&a);
    char again[1024];
    if (a.path[0])
        snprintf(again, sizeof again, "unix://%s", a.path);
    else
        snprintf(again, sizeof again, "redis://%s%s%s%s:%d/%d", a.has_password ? ":" : "",
                 a.password, a.has_password ? "@" : "", a.host, a.port, a.db);
    if (cache_redis_parse_url(again, &b, &err) != 0) abort();
    if (strcmp(a.host, b.host) || strcmp(a.path, b.path) || a.port != b.port || a.db != b.db ||
        a.has_password != b.has_password || strcmp(a.password, b.password))
        abort();
    free(url);
    return 0;
}
