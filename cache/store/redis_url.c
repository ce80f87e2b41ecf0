/* Redis tier URLs (cache/store/redis.h's cache_redis_parse_url), apart from the tier so the fuzz
 * target tests/fuzz/redis_url_fuzz.c links this parser alone. */
#include <string.h>

#include "cache/store/redis.h"

static int parse_int(const char *s, size_t len, int lo, int hi, int *out) {
    if (len == 0 || len > 9) return -1;
    int v = 0;
    for (size_t i = 0; i < len; i++) {
        if (s[i] < '0' || s[i] > '9') return -1;
        v = v * 10 + (s[i] - '0');
    }
    if (v < lo || v > hi) return -1;
    *out = v;
    return 0;
}

int cache_redis_parse_url(const char *url, cache_redis_addr *out, kv_error *err) {
    memset(out, 0, sizeof *out);
    out->port = 6379;
    if (strncmp(url, "unix://", 7) == 0) {
        const char *path = url + 7;
        if (path[0] != '/')
            return kv_fail(err, "redis URL '%s': unix:// needs an absolute path (unix:///...)",
                           url);
        if (strlen(path) >= sizeof out->path)
            return kv_fail(err, "redis URL: socket path longer than %zu bytes",
                           sizeof out->path - 1);
        strcpy(out->path, path);
        return 0;
    }
    if (strncmp(url, "redis://", 8) != 0)
        return kv_fail(err, "redis URL must start with redis:// or unix://");
    const char *p = url + 8, *end = p + strlen(p);
    const char *at = strrchr(p, '@');
    if (at) {
        /* Only a password (redis://:secret@host): Redis 6 ACL users are not supported. */
        if (p[0] != ':' || at == p + 1)
            return kv_fail(err, "redis URL: credentials must be ':password@' (no user name)");
        size_t n = (size_t)(at - p - 1);
        if (n >= sizeof out->password) return kv_fail(err, "redis URL: password too long");
        memcpy(out->password, p + 1, n);
        out->has_password = true;
        p = at + 1;
    }
    const char *slash = strchr(p, '/');
    const char *host_end = slash ? slash : end;
    const char *colon = memchr(p, ':', (size_t)(host_end - p));
    const char *name_end = colon ? colon : host_end;
    if (name_end == p) return kv_fail(err, "redis URL: no host");
    if ((size_t)(name_end - p) >= sizeof out->host) return kv_fail(err, "redis URL: host too long");
    for (const char *q = p; q < name_end; q++)
        if (*q == '[' || *q == ']' || *q == '?' || *q == '#' || (unsigned char)*q <= ' ')
            return kv_fail(err, "redis URL: bad host (a name or an IPv4 address)");
    memcpy(out->host, p, (size_t)(name_end - p));
    if (colon && parse_int(colon + 1, (size_t)(host_end - colon - 1), 1, 65535, &out->port))
        return kv_fail(err, "redis URL: the port must be 1 to 65535");
    if (slash && slash + 1 < end &&
        parse_int(slash + 1, (size_t)(end - slash - 1), 0, 65535, &out->db))
        return kv_fail(err, "redis URL: the database must be a number");
    return 0;
}
