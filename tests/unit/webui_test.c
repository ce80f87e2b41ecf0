/* The web page's files: the binary holds exactly the files of server/web/ (a build older than
 * the sources fails here), each with the ETag of its bytes and the Content-Type of its
 * extension; URLs find them and nothing else; answers carry the security and caching headers,
 * 304 for a current copy and OpenAI's 404 for a file the page does not have. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <jansson.h>
#include <openssl/sha.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/api/handlers.h"
#include "server/api/webui.h"

#define WEB_DIR "server/web"

static unsigned char *read_all(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "cannot open %s (run the tests from the repository root)", path);
    size_t cap = 1 << 16, n = 0;
    unsigned char *buf = malloc(cap);
    cr_assert_not_null(buf);
    size_t got;
    while ((got = fread(buf + n, 1, cap - n, f)) > 0) {
        n += got;
        if (n == cap) {
            cap *= 2;
            buf = realloc(buf, cap);
            cr_assert_not_null(buf);
        }
    }
    fclose(f);
    *len = n;
    return buf;
}

static const char *header(const http_reply *r, const char *name) {
    for (int i = 0; i < HTTP_REPLY_HEADERS && r->headers[i].name; i++)
        if (strcmp(r->headers[i].name, name) == 0) return r->headers[i].value;
    return NULL;
}

static const webui_asset *asset_named(const char *name) {
    for (size_t i = 0; i < WEBUI_N_ASSETS; i++)
        if (strcmp(WEBUI_ASSETS[i].name, name) == 0) return &WEBUI_ASSETS[i];
    return NULL;
}

Test(webui, embedded_files_are_the_sources_byte_for_byte) {
    DIR *d = opendir(WEB_DIR);
    cr_assert_not_null(d, "cannot list %s", WEB_DIR);
    size_t n_files = 0;
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        if (de->d_name[0] == '.') continue;
        n_files++;
        char path[512];
        snprintf(path, sizeof path, "%s/%s", WEB_DIR, de->d_name);
        const webui_asset *a = asset_named(de->d_name);
        cr_assert_not_null(a, "%s is not in the binary: rebuild (make)", path);
        size_t len;
        unsigned char *src = read_all(path, &len);
        cr_assert_eq(a->len, len, "%s: %zu bytes embedded, %zu in the source: a stale build", path,
                     a->len, len);
        cr_assert(memcmp(a->data, src, len) == 0, "%s differs from its embedded copy", path);
        uint8_t dig[32];
        SHA256(src, len, dig);
        char etag[40] = "\"";
        for (int i = 0; i < 16; i++) snprintf(etag + 1 + 2 * i, 3, "%02x", dig[i]);
        strcat(etag, "\"");
        cr_assert_str_eq(a->etag, etag, "%s", path);
        free(src);
    }
    closedir(d);
    cr_assert_eq(WEBUI_N_ASSETS, n_files, "the binary holds %zu files, %s has %zu", WEBUI_N_ASSETS,
                 WEB_DIR, n_files);
}

Test(webui, content_types_follow_the_extension) {
    static const char *const want[][2] = {
        {"index.html", "text/html; charset=utf-8"},
        {"app.js", "text/javascript; charset=utf-8"},
        {"style.css", "text/css; charset=utf-8"},
        {"icon.svg", "image/svg+xml"},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        const webui_asset *a = asset_named(want[i][0]);
        cr_assert_not_null(a, "%s is not embedded", want[i][0]);
        cr_assert_str_eq(a->content_type, want[i][1], "%s", want[i][0]);
    }
}

Test(webui, urls_find_the_page_and_its_files_only) {
    cr_assert_str_eq(webui_find("/")->name, "index.html");
    cr_assert_str_eq(webui_find("/webui/app.js")->name, "app.js");
    cr_assert_str_eq(webui_find("/webui/style.css")->name, "style.css");
    static const char *const none[] = {"",
                                       "/index.html",
                                       "/app.js",
                                       "/webui",
                                       "/webui/",
                                       "/webui/nope.js",
                                       "/webui/../webui/app.js",
                                       "/webui//app.js",
                                       "/webui/app.js/",
                                       "/webui/APP.JS",
                                       "/v1/models"};
    for (size_t i = 0; i < sizeof none / sizeof none[0]; i++)
        cr_assert_null(webui_find(none[i]), "'%s' found a file", none[i]);
}

Test(webui, if_none_match_lists) {
    const char *e = "\"0123456789abcdef0123456789abcdef\"";
    cr_assert(webui_etag_matches(e, e));
    cr_assert(webui_etag_matches("W/\"0123456789abcdef0123456789abcdef\"", e), "weak compare");
    cr_assert(webui_etag_matches("\"x\", \"0123456789abcdef0123456789abcdef\"", e));
    cr_assert(webui_etag_matches("\"x\",W/\"0123456789abcdef0123456789abcdef\" ,", e));
    cr_assert(webui_etag_matches("*", e));
    cr_assert_not(webui_etag_matches(NULL, e));
    cr_assert_not(webui_etag_matches("", e));
    cr_assert_not(webui_etag_matches(" , ,", e));
    cr_assert_not(webui_etag_matches("\"0123456789abcdef0123456789abcde\"", e), "a prefix");
    cr_assert_not(webui_etag_matches("\"0123456789abcdef0123456789abcdef0\"", e), "longer");
    cr_assert_not(webui_etag_matches("0123456789abcdef0123456789abcdef", e), "unquoted");
    cr_assert_not(webui_etag_matches("\"0123456789abcdef0123456789abcdef", e), "unterminated");
    cr_assert_not(webui_etag_matches("W/", e));
    cr_assert_not(webui_etag_matches("\"a,b\", \"c\"", e), "a comma inside a tag");
}

/* GET url through the handler, as the transport calls it. */
static http_reply get(http_call *c, const char *url) {
    http_out o = {0};
    c->method = "GET";
    c->url = url;
    cr_assert_eq(webui_get(NULL, c, &o), HTTP_REPLIED);
    return o.reply;
}

Test(webui, get_answers_with_security_and_cache_headers) {
    http_call c = {.fd = -1, .request_id = "t"};
    http_reply r;
    r = get(&c, "/");
    cr_assert_eq(r.status, 200);
    const webui_asset *a = asset_named("index.html");
    cr_assert_eq(r.len, a->len);
    cr_assert(memcmp(r.body, a->data, a->len) == 0);
    cr_assert_str_eq(r.content_type, "text/html; charset=utf-8");
    const char *csp = header(&r, "Content-Security-Policy");
    cr_assert_not_null(csp);
    cr_assert_not_null(strstr(csp, "default-src 'none'"), "%s", csp);
    cr_assert_not_null(strstr(csp, "script-src 'self';"), "%s", csp);
    cr_assert_not_null(strstr(csp, "connect-src 'self';"), "%s", csp);
    cr_assert_null(strstr(csp, "unsafe"), "%s", csp);
    cr_assert_str_eq(header(&r, "ETag"), a->etag);
    cr_assert_str_eq(header(&r, "Cache-Control"), "no-cache");
    cr_assert_str_eq(header(&r, "X-Content-Type-Options"), "nosniff");
    free(r.body);

    /* the browser's copy is current: 304, no body, the same validator */
    c.if_none_match = asset_named("app.js")->etag;
    r = get(&c, "/webui/app.js");
    cr_assert_eq(r.status, 304);
    cr_assert_null(r.body);
    cr_assert_eq(r.len, 0);
    cr_assert_str_eq(header(&r, "ETag"), asset_named("app.js")->etag);
    /* another file's tag does not make this one current */
    r = get(&c, "/webui/style.css");
    cr_assert_eq(r.status, 200);
    free(r.body);
}

Test(webui, a_missing_file_is_an_openai_404) {
    http_call c = {.fd = -1, .request_id = "t"};
    http_reply r;
    r = get(&c, "/webui/secret.txt");
    cr_assert_eq(r.status, 404);
    cr_assert_str_eq(r.content_type, "application/json");
    cr_assert_null(header(&r, "ETag"));
    json_error_t je;
    json_t *v = json_loadb(r.body, r.len, 0, &je);
    cr_assert_not_null(v, "%s", je.text);
    json_t *e = json_object_get(v, "error");
    cr_assert_str_eq(json_string_value(json_object_get(e, "code")), "not_found");
    cr_assert_not_null(strstr(json_string_value(json_object_get(e, "message")), "/webui/secret"));
    json_decref(v);
    free(r.body);
}
