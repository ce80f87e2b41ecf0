/* Internal to server/'s request parsers (api.c, responses_parse.c): the JSON field helpers and
 * the pieces of the chat request's validation that other APIs' parsers share, so a Responses
 * request is held to the same ranges, types and messages as a chat request. api.c defines them;
 * nothing outside the parsers includes this header. */
#ifndef KVSERVE_API_IMPL_H
#define KVSERVE_API_IMPL_H

#include <jansson.h>

#include "server/api/api.h"

#define API_INVALID "invalid_request_error"
#define API_BAD(err, param, ...) api_fail((err), 400, API_INVALID, NULL, (param), __VA_ARGS__)

/* The body's root object after the UTF-8 check and jansson's parse (duplicate keys refused), or
 * NULL with err naming what is wrong and where. */
json_t *api_parse_body(const char *body, size_t len, api_error *err);
/* A field of obj, or NULL when absent or null (an optional field's "not given"). */
json_t *api_field(const json_t *obj, const char *key);
/* "'param' is required: want" (got NULL) or "'param' must be want, got TYPE"; returns -1. */
int api_type_error(api_error *err, const char *param, const char *want, const json_t *got);
/* Optional fields: 1 given (stored), 0 absent or null (out untouched), -1 with err on a wrong
 * type or range. Numbers in [lo, hi] ((lo, hi] when lo_open); integers also as 2.0. */
int api_opt_bool(const json_t *obj, const char *key, bool *out, api_error *err);
int api_opt_number(const json_t *obj, const char *key, double lo, double hi, bool lo_open,
                   float *out, api_error *err);
int api_opt_int(const json_t *obj, const char *key, int64_t lo, int64_t hi, int64_t *out,
                api_error *err);
int api_opt_string(const json_t *obj, const char *key, char **out, api_error *err);
/* Copies the string v (NUL refused) into *out (malloc'd); param names it in errors. */
int api_str_copy(const json_t *v, const char *param, char **out, api_error *err);
/* The 500 for an allocation that failed; returns -1. */
int api_oom(api_error *err);
/* OpenAI's function names: 1 to 64 of a-z, A-Z, 0-9, _ and -. */
bool api_tool_name_ok(const char *s, size_t len);
/* A tool's parameters (a JSON Schema object) as JSON text in *out (malloc'd), after checking
 * that it compiles to a grammar (an unsupported keyword is named); param names it. */
int api_tool_schema(const json_t *schema, const char *param, char **out, api_error *err);
/* One function {name, description, parameters} at param pp into r->tools[i] (r->tools has room;
 * n_tools becomes i + 1): the name checked and unique, the parameters a schema that compiles. */
int api_parse_function(const json_t *fn, const char *pp, size_t i, api_request *r, api_error *err);
/* temperature, top_p, min_p, the penalties, top_k, seed, logit_bias and stop. */
int api_parse_sampling(const json_t *obj, api_request *r, api_error *err);
/* kvserve's own fields for the context cache (cache, cache_salt, blend*, kv_*, ttft_budget_ms,
 * fixup*) and ignore_eos. */
int api_parse_extensions(const json_t *root, api_request *r, api_error *err);
/* The output's grammar: a JSON Schema (an object or true) compiled to GBNF, or gbnf itself
 * (owned from here); a second constraint is refused, naming both fields. */
int api_schema_field(const json_t *schema, const char *param, api_request *r, api_error *err);
int api_set_gbnf(api_request *r, const char *param, char *gbnf, api_error *err);
/* An empty request of this kind with every default set (as api_parse_request starts). */
void api_request_init(api_kind kind, api_request *out);

#endif
