/* The web page at / and its files under /webui/ (GET, no API key: the page asks for the key and
 * sends it with its own API calls). Every answer carries a Content-Security-Policy that lets
 * the page load and call nothing but this server (no inline script or style, no other origin,
 * no framing), and an ETag with Cache-Control: no-cache, so a browser revalidates each load and
 * gets 304 until the binary serves other bytes. --no-webui takes the routes away (http.c). */
#include <stdlib.h>
#include <string.h>

#include "server/api/handlers.h"
#include "server/api/webui.h"

#define WEBUI_PREFIX "/webui/"

static const char CSP[] = "default-src 'none'; script-src 'self'; style-src 'self'; "
                          "img-src 'self'; connect-src 'self'; base-uri 'none'; "
                          "form-action 'none'; frame-ancestors 'none'";

const webui_asset *webui_find(const char *url) {
    const char *name = NULL;
    if (strcmp(url, "/") == 0)
        name = "index.html";
    else if (strncmp(url, WEBUI_PREFIX, strlen(WEBUI_PREFIX)) == 0)
        name = url + strlen(WEBUI_PREFIX);
    if (!name || !name[0]) return NULL;
    for (size_t i = 0; i < WEBUI_N_ASSETS; i++)
        if (strcmp(WEBUI_ASSETS[i].name, name) == 0) return &WEBUI_ASSETS[i];
    return NULL;
}

bool webui_etag_matches(const char *h, const char *etag) {
    if (!h) return false;
    size_t n_etag = strlen(etag);
    for (;;) {
        while (*h == ' ' || *h == '\t' || *h == ',') h++;
        if (!*h) return false;
        if (*h == '*') return true;
        if (strncmp(h, "W/", 2) == 0) h += 2;
        /* one entity tag: a quoted string without inner quotes (RFC 9110 8.8.3) */
        const char *end = *h == '"' ? strchr(h + 1, '"') : NULL;
        size_t len = end ? (size_t)(end - h) + 1 : strcspn(h, ",");
        if (len == n_etag && memcmp(h, etag, n_etag) == 0) return true;
        h += len;
    }
}

http_result webui_get(server *s, const http_call *c, http_out *o) {
    (void)s;
    http_reply *out = &o->reply;
    const char *url = c->url;
    const webui_asset *a = webui_find(url);
    *out = (http_reply){0};
    if (!a) {
        api_error err;
        api_fail(&err, 404, "invalid_request_error", "not_found", NULL,
                 "no file %.200s in the web page", url);
        http_reply_error(out, &err);
        return HTTP_REPLIED;
    }
    const http_header headers[] = {
        {"Content-Security-Policy", CSP},
        {"X-Content-Type-Options", "nosniff"},
        {"Referrer-Policy", "no-referrer"},
        {"Cache-Control", "no-cache"},
        {"ETag", a->etag},
    };
    _Static_assert(sizeof headers / sizeof headers[0] <= HTTP_REPLY_HEADERS, "room for headers");
    out->content_type = a->content_type;
    memcpy(out->headers, headers, sizeof headers);
    if (webui_etag_matches(c->if_none_match, a->etag)) {
        out->status = 304; /* no body: the client's copy is these bytes */
        return HTTP_REPLIED;
    }
    if (!(out->body = malloc(a->len ? a->len : 1))) {
        *out = (http_reply){0}; /* no validator on an error */
        api_error err;
        api_fail(&err, 500, "server_error", NULL, NULL, "out of memory");
        http_reply_error(out, &err);
        return HTTP_REPLIED;
    }
    memcpy(out->body, a->data, a->len);
    out->len = a->len;
    out->status = 200;
    return HTTP_REPLIED;
}
