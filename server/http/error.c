/* OpenAI's error object (error.h). */
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "server/http/error.h"
#include "util/utf8.h"

/* Replaces every byte that is not part of a valid UTF-8 sequence with '?', so a message that
 * quotes client text cut by %.Ns (or by the buffer's size) can still go into a JSON string. */
static void utf8_sanitize(char *s) {
    size_t len = strlen(s), i = 0;
    while (i < len) {
        uint32_t cp;
        size_t n;
        if (utf8_decode((const uint8_t *)s + i, len - i, &cp, &n) == UTF8_OK) {
            i += n;
        } else {
            for (size_t j = 0; j < n; j++) s[i + j] = '?';
            i += n;
        }
    }
}

int api_fail(api_error *err, int status, const char *type, const char *code, const char *param,
             const char *fmt, ...) {
    if (!err) return -1;
    err->status = status;
    err->type = type;
    err->code = code;
    snprintf(err->param, sizeof err->param, "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->message, sizeof err->message, fmt, ap);
    va_end(ap);
    utf8_sanitize(err->param);
    utf8_sanitize(err->message);
    return -1;
}

char *api_error_json(const api_error *err) {
    /* Copies, sanitized: err may have been filled by hand rather than through api_fail. */
    char param[sizeof err->param], message[sizeof err->message];
    snprintf(param, sizeof param, "%s", err->param);
    snprintf(message, sizeof message, "%s", err->message);
    utf8_sanitize(param);
    utf8_sanitize(message);
    json_t *root = json_pack("{s:{s:s,s:s,s:s?,s:s?}}", "error", "message", message, "type",
                             err->type ? err->type : "server_error", "param",
                             param[0] ? param : NULL, "code", err->code);
    if (!root) return NULL;
    char *s = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    return s;
}
