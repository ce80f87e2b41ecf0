/* The field checks api.c validates OpenAI bodies with, for the other APIs' request parsers
 * (anthropic_req.c), so every API refuses the same things in the same words: a body that is not
 * UTF-8 JSON holding an object, a wrong type, a value out of range, a string holding NUL.
 * Internal to server/. */
#ifndef KVSERVE_API_JSON_H
#define KVSERVE_API_JSON_H

#include <jansson.h>
#include <stdbool.h>

#include "server/api.h"

/* The body parsed (its encoding checked first): a JSON object, or NULL with err. */
json_t *api_json_body(const char *body, size_t len, api_error *err);
/* obj's field key, or NULL when absent or null (an optional field's "not given"). */
json_t *api_json_field(const json_t *obj, const char *key);
/* "'param' must be <want>, got <type>" (or "'param' is required: <want>" for got NULL); -1. */
int api_json_type_error(api_error *err, const char *param, const char *want, const json_t *got);
/* Optional fields of obj, named key in errors: 1 when given (stored), 0 when absent or null, -1
 * with err on a wrong type or range ([lo, hi]). */
int api_json_number(const json_t *obj, const char *key, double lo, double hi, float *out,
                    api_error *err);
int api_json_int(const json_t *obj, const char *key, int64_t lo, int64_t hi, int64_t *out,
                 api_error *err);
int api_json_bool(const json_t *obj, const char *key, bool *out, api_error *err);
/* A string value v (non-NULL) copied into *out (malloc'd); param names it. 0, or -1 with err
 * (not a string, NUL inside, out of memory). */
int api_json_string(const json_t *v, const char *param, char **out, api_error *err);
/* A tool's name as OpenAI and Anthropic take it: 1 to 64 of a-z, A-Z, 0-9, _ and -. */
bool api_tool_name_ok(const char *s, size_t len);
/* A tool's parameters (a JSON Schema object) as JSON text in *out (malloc'd), after checking
 * that it compiles to a grammar (an unsupported keyword is named); param names it. */
int api_tool_schema(const json_t *schema, const char *param, char **out, api_error *err);

#endif
