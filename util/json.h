/* Small jansson helpers shared by the layers that parse JSON (config/, server/). */
#ifndef KVSERVE_UTIL_JSON_H
#define KVSERVE_UTIL_JSON_H

#include <jansson.h>

/* "an object", "an array", "a string", "an integer", "a number", "a boolean", "null": for
 * messages like "'port' must be an integer, got a string". */
const char *json_type_name(const json_t *v);

#endif
