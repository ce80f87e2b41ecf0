/* What the chat template renderers (chat.c), the tool formats (chat_tools.c) and the Python-JSON
 * writer (chat_json.c) share. Not part of model/'s contract. */
#ifndef KVSERVE_CHAT_IMPL_H
#define KVSERVE_CHAT_IMPL_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

#include "model/chat/chat.h"
#include "util/util.h"

/* ---------------------------------------------------------------- growable string */

/* util's growable buffer (kv_buf_append, kv_buf_puts): an append that fails sets oom. */
typedef kv_buf strbuf;

/* Python's str.strip() (and Jinja's `trim`) on UTF-8 text: s without leading and trailing
 * whitespace. */
void sb_append_stripped(strbuf *b, const char *s);

/* ---------------------------------------------------------------- Python's json.dumps
 * (chat_json.c)
 *
 * Hugging Face transformers runs chat templates with its own `tojson` filter:
 * json.dumps(x, ensure_ascii=False, indent=indent), keys in their given order (jinja2's built-in
 * tojson would sort them and escape <>&'). These write JSON the same way. */

#define PYJSON_NO_INDENT (-1) /* ", " and ": " between items, all on one line */

/* Appends v as json.dumps(v, ensure_ascii=False, indent=indent) writes it: strings escaped as
 * Python does (\" \\ \n \r \t \b \f, other controls as \u00XX, the rest as UTF-8), floats as
 * Python's repr (1e-05, 100.0, 1e+16), objects in their insertion order. */
void pyjson_append(strbuf *b, const json_t *v, int indent);
/* The same for JSON text (any value); -1 when it does not parse. */
int pyjson_append_text(strbuf *b, const char *text, int indent);
/* A JSON string literal of s, as json.dumps writes it. */
void pyjson_append_string(strbuf *b, const char *s);

/* A tool as Hugging Face templates receive it: {"type": "function", "function": {"name",
 * "description" (when given), "parameters" (when given, its keys in the client's order)}}. NULL
 * when out of memory (a parameters text that does not parse is left out). */
json_t *chat_tool_json(const chat_tool *t);

/* ---------------------------------------------------------------- tool formats (chat_tools.c) */

/* Appends the calls of an assistant turn as format f writes them in the prompt (arguments in
 * Python's JSON layout); Hermes' calls each start on a new line. -1 with err when arguments are
 * not JSON or (Llama 3.1) there is not exactly one call. */
int chat_tools_append_calls(strbuf *b, chat_tool_format f, const chat_tool_call *calls, int n,
                            int msg_index, kv_error *err);

/* The generic format's messages: the tools listed in the system message (appended to the
 * conversation's own, or as a new first one), calls appended to their assistant turn's content,
 * tool results as user turns. *out is malloc'd with every content string; free it with
 * chat_messages_free. -1 with err. */
int chat_tools_generic_messages(const chat_message *msgs, int n, const chat_tool *tools,
                                int n_tools, chat_message **out, int *n_out, kv_error *err);
void chat_messages_free(chat_message *msgs, int n);

#endif
