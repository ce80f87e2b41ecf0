/* The web page at / (webui.c): the files of server/web/, compiled into the binary at build time
 * by scripts/embed_assets.py (the Makefile writes $(BUILD)/gen/webui_assets.c), so the server
 * reads no file and fetches nothing to serve it. Internal to server/ (and its unit test). */
#ifndef KVSERVE_WEBUI_H
#define KVSERVE_WEBUI_H

#include <stdbool.h>
#include <stddef.h>

typedef struct webui_asset {
    const char *name;         /* its file name in server/web/, e.g. "app.js" */
    const char *content_type; /* from the extension, e.g. "text/javascript; charset=utf-8" */
    const char *etag;         /* strong validator: the first 32 hex of its SHA-256, quoted */
    const unsigned char *data;
    size_t len;
} webui_asset;

/* The generated table. */
extern const webui_asset WEBUI_ASSETS[];
extern const size_t WEBUI_N_ASSETS;

/* The file a URL path names: "/" is index.html, "/webui/NAME" the file NAME; NULL otherwise. */
const webui_asset *webui_find(const char *url);

/* True when an If-None-Match header value (a list of entity tags, weak or strong, or "*")
 * names etag: the client's copy is current (RFC 9110 13.1.2 compares weakly). */
bool webui_etag_matches(const char *if_none_match, const char *etag);

#endif
