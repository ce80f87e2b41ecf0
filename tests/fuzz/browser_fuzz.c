/* libFuzzer target for the transport's checks of requests from web pages (server/http/browser.c):
 * the input, cut at NULs into a Host header, an Origin, a Content-Type and a preflight's
 * Access-Control-Request-Headers, is checked against a loopback listener's policy with one
 * allowed origin and host. An answered Host must be one of the policy's names, bare or with a
 * port of digits; an allowed Origin one of its origins (ignoring case); a JSON Content-Type must
 * begin with application/json after white space; the headers a preflight allows are the ones
 * asked for or the default, never with a line break. Any violation aborts. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "server/http/http.h"

/* The next NUL-terminated field of data[*at..size) (a heap copy, so ASan sees overreads). */
static char *field(const uint8_t *data, size_t size, size_t *at) {
    size_t n = *at < size ? strnlen((const char *)data + *at, size - *at) : 0;
    char *s = malloc(n + 1);
    if (!s) abort();
    if (n) memcpy(s, data + *at, n);
    s[n] = '\0';
    *at += n + 1;
    return s;
}

static void check_host(const http_browser *b, const char *host) {
    if (!http_browser_host_ok(b, host)) return;
    for (int i = 0; i < b->n_hosts; i++) {
        size_t n = strlen(b->hosts[i]);
        if (strncasecmp(host, b->hosts[i], n) != 0) continue;
        const char *p = host + n;
        if (*p == ':') p += 1 + strspn(p + 1, "0123456789");
        if (!*p) return;
    }
    abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static char *origins[] = {"http://app.example:3000"}, *hosts[] = {"box.lan"};
    kv_config c = {.host = "127.0.0.1",
                   .port = 8080,
                   .allowed_origins = origins,
                   .n_allowed_origins = 1,
                   .allowed_hosts = hosts,
                   .n_allowed_hosts = 1};
    http_browser b;
    kv_error err;
    if (http_browser_init(&b, &c, &err)) abort();
    size_t at = 0;
    char *host = field(data, size, &at), *origin = field(data, size, &at);
    char *type = field(data, size, &at), *asked = field(data, size, &at);
    check_host(&b, host);
    if (http_browser_origin_ok(&b, origin)) {
        int i = 0;
        while (i < b.n_origins && strcasecmp(origin, b.origins[i]) != 0) i++;
        if (i == b.n_origins) abort();
    }
    if (http_content_type_is(type, "application/json")) {
        const char *t = type + strspn(type, " \t");
        if (strncasecmp(t, "application/json", 16) != 0) abort();
    }
    const char *allowed = http_preflight_headers(asked);
    if (strpbrk(allowed, "\r\n") || (allowed != asked && strstr(allowed, "Authorization") == NULL))
        abort();
    free(host);
    free(origin);
    free(type);
    free(asked);
    http_browser_free(&b);
    return 0;
}
