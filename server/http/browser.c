/* Requests from web browsers (http.h's "browser requests"): which pages may call the API, which
 * Host names a loopback listener answers, and what a POST body must be declared as.
 *
 * Curl and the SDKs send no Origin. A page the user opens does, on every cross-origin request
 * and on its own POSTs, and a "simple" request (a form's or fetch's text/plain POST) reaches the
 * server without a preflight: refusing a foreign Origin and a body not declared as JSON keeps
 * such a page from driving a server on the user's machine (clearing or pinning its cache,
 * spending its compute). A page whose name the attacker rebinds to 127.0.0.1 is same-origin to
 * the browser, so Origin does not catch it; its Host does, which names the attacker's domain:
 * on a loopback listener only the loopback names (and --allowed-hosts) are answered. Ollama
 * does the same (OLLAMA_ORIGINS, its Host check on loopback). */
#include <arpa/inet.h>
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "server/http/http.h"

/* The loopback names a loopback (or any-address) listener always answers and serves its web
 * page under. */
static const char *const LOOPBACK_NAMES[] = {"localhost", "127.0.0.1", "[::1]"};
#define N_LOOPBACK (sizeof LOOPBACK_NAMES / sizeof LOOPBACK_NAMES[0])

/* Appends a copy of text[0..n) to (*list, *count); -1 when out of memory. */
static int list_add(char ***list, int *count, const char *text, size_t n) {
    char **grown = realloc(*list, sizeof *grown * (size_t)(*count + 1));
    if (!grown) return -1;
    *list = grown;
    if (!(grown[*count] = strndup(text, n))) return -1;
    (*count)++;
    return 0;
}

/* The origin http://name[:port] (port 80 is left out, as browsers write it). */
static int add_own_origin(http_browser *b, const char *name, int port) {
    char o[96];
    int n = port == 80 ? snprintf(o, sizeof o, "http://%s", name)
                       : snprintf(o, sizeof o, "http://%s:%d", name, port);
    return list_add(&b->origins, &b->n_origins, o, (size_t)n);
}

/* The server's own origins and Host names: its address's, and on a loopback or any-address
 * listener the loopback names' (the web page is opened under any of them). */
static int add_own(http_browser *b, const kv_config *cfg, bool local) {
    bool listed = false;
    for (size_t i = 0; local && i < N_LOOPBACK; i++) {
        listed |= strcasecmp(LOOPBACK_NAMES[i], cfg->host) == 0;
        if (add_own_origin(b, LOOPBACK_NAMES[i], cfg->port) ||
            list_add(&b->hosts, &b->n_hosts, LOOPBACK_NAMES[i], strlen(LOOPBACK_NAMES[i])))
            return -1;
    }
    if (listed) return 0;
    return add_own_origin(b, cfg->host, cfg->port) ||
           list_add(&b->hosts, &b->n_hosts, cfg->host, strlen(cfg->host));
}

int http_browser_init(http_browser *b, const kv_config *cfg, kv_error *err) {
    *b = (http_browser){0};
    struct in_addr a;
    if (inet_pton(AF_INET, cfg->host, &a) != 1)
        return kv_fail(err, "host: '%s' is not an IPv4 address", cfg->host);
    uint32_t ip = ntohl(a.s_addr);
    bool loopback = (ip >> 24) == 127;
    b->check_host = loopback;
    if (add_own(b, cfg, loopback || ip == 0)) goto oom;
    for (int i = 0; i < cfg->n_allowed_origins; i++) {
        const char *o = cfg->allowed_origins[i];
        size_t n = strlen(o);
        while (n > 1 && o[n - 1] == '/') n--; /* "http://app:3000/" names the same origin */
        if (strcmp(o, "*") == 0)
            b->any_origin = true;
        else if (list_add(&b->origins, &b->n_origins, o, n))
            goto oom;
    }
    for (int i = 0; i < cfg->n_allowed_hosts; i++) {
        const char *h = cfg->allowed_hosts[i];
        if (strcmp(h, "*") == 0)
            b->check_host = false;
        else if (list_add(&b->hosts, &b->n_hosts, h, strlen(h)))
            goto oom;
    }
    return 0;
oom:
    http_browser_free(b);
    return kv_fail(err, "out of memory");
}

void http_browser_free(http_browser *b) {
    for (int i = 0; i < b->n_origins; i++) free(b->origins[i]);
    for (int i = 0; i < b->n_hosts; i++) free(b->hosts[i]);
    free(b->origins);
    free(b->hosts);
    *b = (http_browser){0};
}

bool http_browser_origin_ok(const http_browser *b, const char *origin) {
    if (!origin || b->any_origin) return true;
    for (int i = 0; i < b->n_origins; i++)
        if (strcasecmp(origin, b->origins[i]) == 0) return true;
    return false;
}

/* The length of host's name: without ":port" (digits only; a bracketed IPv6 address keeps its
 * colons). 0 when what follows the name is not a port. */
static size_t host_name_len(const char *host) {
    const char *end = host[0] == '[' ? strchr(host, ']') : NULL;
    end = end ? end + 1 : host + strcspn(host, ":");
    if (*end == ':') {
        const char *p = end + 1;
        if (!*p) return 0;
        while (isdigit((unsigned char)*p)) p++;
        if (*p) return 0;
    } else if (*end) {
        return 0;
    }
    return (size_t)(end - host);
}

bool http_browser_host_ok(const http_browser *b, const char *host) {
    if (!b->check_host || !host) return true; /* HTTP/1.0 tools may send none; browsers do */
    size_t n = host_name_len(host);
    for (int i = 0; n && i < b->n_hosts; i++)
        if (strlen(b->hosts[i]) == n && strncasecmp(host, b->hosts[i], n) == 0) return true;
    return false;
}

bool http_content_type_is(const char *type, const char *media) {
    if (!type) return false;
    while (*type == ' ' || *type == '\t') type++;
    size_t n = strlen(media);
    if (strncasecmp(type, media, n) != 0) return false;
    return type[n] == '\0' || type[n] == ';' || type[n] == ' ' || type[n] == '\t'; /* charset */
}

const char *http_preflight_headers(const char *requested) {
    static const char DEFAULT[] = "Authorization, Content-Type, X-Api-Key, X-Request-Id";
    size_t n = requested ? strlen(requested) : 0;
    if (n == 0 || n > 1024) return DEFAULT;
    /* header names (RFC 9110 tokens), comma-separated */
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)requested[i];
        if (!isalnum(ch) && !strchr("!#$%&'*+-.^_`|~, ", ch)) return DEFAULT;
    }
    return requested;
}
