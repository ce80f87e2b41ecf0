/* The error every failed request is answered with: OpenAI's error object, with the HTTP status
 * it goes with. The transport's own refusals and every API's validation use it; an API with
 * another format (Anthropic's) rewrites the JSON at the end (http_route.error_format). */
#ifndef KVSERVE_HTTP_ERROR_H
#define KVSERVE_HTTP_ERROR_H

typedef struct api_error {
    int status;       /* HTTP status: 400, 401, 404, 413, 429, 500, 503 */
    const char *type; /* "invalid_request_error", "authentication_error", ... (static) */
    const char *code; /* "model_not_found", "context_length_exceeded", ... or NULL (static) */
    char param[64];   /* the offending parameter ("messages[2].content"), "" for none */
    char message[512];
} api_error;

/* Fills err and returns -1. type/code are static strings (or NULL code). */
int api_fail(api_error *err, int status, const char *type, const char *code, const char *param,
             const char *fmt, ...) __attribute__((format(printf, 6, 7)));

/* {"error":{"message":..,"type":..,"param":..|null,"code":..|null}} as a malloc'd string. */
char *api_error_json(const api_error *err);

#endif
