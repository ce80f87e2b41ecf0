/* The reply helpers handlers answer with (server/http/http.h): JSON bodies, OpenAI's error
 * JSON, text, and whether the client is still there. */
#include <poll.h>
#include <stdlib.h>
#include <string.h>

#include "server/http/http.h"

void http_reply_json(http_reply *out, int status, json_t *v) {
    char *s = v ? json_dumps(v, JSON_COMPACT) : NULL;
    json_decref(v);
    if (!s) {
        static const char oom[] =
            "{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\",\"param\":null,"
            "\"code\":null}}";
        s = strdup(oom);
        status = 500;
    }
    out->status = status;
    out->body = s;
    out->len = s ? strlen(s) : 0;
    out->content_type = "application/json";
}

void http_reply_error(http_reply *out, const api_error *err) {
    char *s = api_error_json(err);
    out->status = err->status;
    out->body = s ? s : strdup("{\"error\":{\"message\":\"out of memory\"}}");
    out->len = out->body ? strlen(out->body) : 0;
    out->content_type = "application/json";
}

bool http_client_gone(int fd) {
    if (fd < 0) return false;
    struct pollfd p = {.fd = fd, .events = 0};
    if (poll(&p, 1, 0) <= 0) return false;
    return (p.revents & (POLLHUP | POLLERR | POLLNVAL)) != 0;
}

void http_reply_text(http_reply *out, int status, const char *content_type, char *text,
                     size_t len) {
    out->status = status;
    out->body = text;
    out->len = len;
    out->content_type = content_type;
}
