/* The chat goldens (tests/golden/chat/<name>.json, from scripts/ref/make_chat_goldens.py) as
 * chat_render's arguments: a case's messages (with their tool calls, arguments as the JSON text
 * an OpenAI client sends) and tools. */
#ifndef KVSERVE_CHAT_GOLDEN_H
#define KVSERVE_CHAT_GOLDEN_H

#include <jansson.h>
#include <stdbool.h>

#include "model/chat/chat.h"

typedef struct golden_conv {
    chat_message *msgs;
    int n_msgs;
    chat_tool *tools; /* NULL when the case passes no tools */
    int n_tools;
    /* storage the fields above point into */
    chat_tool_call *calls;
    char **strs;
    int n_strs;
} golden_conv;

/* Fills c from a case object (strings point into it, or into c's own storage). The test fails on
 * a malformed case. */
void golden_conv_load(json_t *c, golden_conv *out);
void golden_conv_free(golden_conv *c);
/* The golden file tests/golden/chat/<name>.json (the test fails when it does not load). */
json_t *golden_chat_load(const char *name);
/* Its case named `name` (or `name`+system, as make_chat_goldens.py names a case it gave a
 * system message of its own), or NULL. */
json_t *golden_chat_case(json_t *doc, const char *name);

#endif
