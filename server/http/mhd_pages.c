/* libmicrohttpd's own error pages, answered in OpenAI's error JSON instead.
 *
 * libmicrohttpd refuses some malformed requests itself, before any of the server's code sees
 * them: a header line without a colon, a Content-Length that is not a number, a malformed chunk
 * size, an HTTP version it does not speak, a header block over the connection's pool. It answers
 * them with small HTML pages compiled into the library, and 0.9 has no option or callback to
 * replace them. It builds each page with MHD_create_response_from_buffer over its own static
 * text, and it makes that call through its PLT, as any caller does. So the definition below is
 * what the library's own calls reach (the dynamic linker looks in the executable first, as it
 * does for malloc); it hands every call to the library's function, and only a buffer that lies
 * in the library's own image and reads as one of its pages is answered with the error JSON
 * instead: the page's text as the message, a code by its title, Content-Type
 * application/json. Where the library binds the call itself (a static build, another
 * version), its pages come back as they were: still errors, in HTML. */
#include <dlfcn.h>
#include <microhttpd.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "server/http/error.h"

typedef struct MHD_Response *(*create_fn)(size_t size, void *buffer,
                                          enum MHD_ResponseMemoryMode mode);

static create_fn g_create; /* the library's function */
static void *g_lib_base;   /* where the library is loaded */
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static void resolve(void) {
    *(void **)&g_create = dlsym(RTLD_NEXT, "MHD_create_response_from_buffer");
    Dl_info info;
    if (g_create && dladdr(*(void **)&g_create, &info)) g_lib_base = info.dli_fbase;
}

/* The codes by the pages' titles (libmicrohttpd 0.9.75 has these; another title gets
 * "malformed_request"). */
static const struct {
    const char *title;
    const char *code;
} CODES[] = {
    {"Request malformed", "malformed_request"},
    {"Request too big", "headers_too_large"},
    {"Request content too large", "request_too_large"},
    {"Requested HTTP version is not supported", "http_version_not_supported"},
    {"&quot;Host:&quot; header required", "host_header_required"},
};

#define PAGE_OPEN "<html><head><title>"

/* The text of the element that follows `open` in page[0, n), its tags dropped and &quot;
 * read as a quote, into out (cap bytes, NUL-terminated). */
static void element_text(const char *page, size_t n, const char *open, const char *close, char *out,
                         size_t cap) {
    size_t o = 0;
    const char *p = memmem(page, n, open, strlen(open));
    if (p) {
        p += strlen(open);
        const char *end = memmem(p, n - (size_t)(p - page), close, strlen(close));
        if (!end) end = page + n;
        bool tag = false;
        while (p < end && o + 1 < cap) {
            if (*p == '<' || *p == '>') {
                tag = *p++ == '<';
            } else if (tag) {
                p++;
            } else if ((size_t)(end - p) >= 6 && memcmp(p, "&quot;", 6) == 0) {
                out[o++] = '"';
                p += 6;
            } else {
                out[o++] = *p++;
            }
        }
    }
    out[o] = '\0';
}

/* The error JSON for one of the library's pages, malloc'd, or NULL when buf is not one. */
static char *page_json(const char *buf, size_t n) {
    if (!g_lib_base || n < sizeof PAGE_OPEN || memcmp(buf, PAGE_OPEN, sizeof PAGE_OPEN - 1) != 0)
        return NULL;
    Dl_info info;
    if (!dladdr(buf, &info) || info.dli_fbase != g_lib_base) return NULL;
    char title[128], body[256];
    element_text(buf, n, "<title>", "</title>", title, sizeof title);
    element_text(buf, n, "<body>", "</body>", body, sizeof body);
    const char *code = "malformed_request", *type = "invalid_request_error";
    const char *raw_title = buf + sizeof PAGE_OPEN - 1;
    for (size_t i = 0; i < sizeof CODES / sizeof *CODES; i++)
        if (strncmp(raw_title, CODES[i].title, strlen(CODES[i].title)) == 0) code = CODES[i].code;
    if (strncmp(raw_title, "Internal server error", 21) == 0) {
        code = NULL;
        type = "server_error";
    }
    api_error e;
    api_fail(&e, 400, type, code, NULL, "%s: %s", title, body[0] ? body : title);
    return api_error_json(&e);
}

struct MHD_Response *MHD_create_response_from_buffer(size_t size, void *buffer,
                                                     enum MHD_ResponseMemoryMode mode) {
    pthread_once(&g_once, resolve);
    if (!g_create) return NULL; /* no libmicrohttpd: cannot happen in a linked program */
    char *json = mode == MHD_RESPMEM_PERSISTENT && buffer ? page_json(buffer, size) : NULL;
    if (!json) return g_create(size, buffer, mode);
    struct MHD_Response *r = g_create(strlen(json), json, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(json);
        return g_create(size, buffer, mode);
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "application/json");
    return r;
}
