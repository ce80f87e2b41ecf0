/* Chat templates: the prompt formats of the model families kvserve serves, recognised from the
 * GGUF's tokenizer.chat_template (a Jinja source we do not execute) or named by flag. */
#ifndef KVSERVE_CHAT_H
#define KVSERVE_CHAT_H

#include <stdbool.h>
#include <stddef.h>

#include "util/util.h"

typedef enum chat_template_kind {
    CHAT_TEMPLATE_UNKNOWN = 0,
    CHAT_TEMPLATE_CHATML, /* <|im_start|>role\n...<|im_end|>\n  (SmolLM2, Qwen) */
    CHAT_TEMPLATE_LLAMA3, /* <|start_header_id|>role<|end_header_id|>\n\n...<|eot_id|> */
    CHAT_TEMPLATE_LLAMA2, /* <s>[INST] <<SYS>>...<</SYS>> user [/INST] answer </s> (and Mistral) */
} chat_template_kind;

typedef struct chat_template {
    chat_template_kind kind;
    /* A system message the template inserts when the conversation has none (SmolLM2's
     * "You are a helpful AI assistant named SmolLM, ..."), malloc'd, or NULL. */
    char *default_system;
} chat_template;

typedef struct chat_message {
    const char *role;    /* "system", "user", "assistant" */
    const char *content; /* UTF-8 */
} chat_message;

/* Recognises the template from its Jinja source. Unknown sources give CHAT_TEMPLATE_UNKNOWN. */
void chat_template_detect(const char *jinja, size_t len, chat_template *out);
/* "chatml", "llama3", "llama2" (also "mistral"); -1 for any other name. */
int chat_template_from_name(const char *name, chat_template *out);
const char *chat_template_name(chat_template_kind kind);
void chat_template_free(chat_template *t);

/* Renders messages (and, with add_generation_prompt, the assistant turn's opening) as text whose
 * special tokens are spelled out, for tokenizer_encode(parse_special = true). bos is the BOS
 * token's text (or NULL) for templates that spell it. Returns a malloc'd string or NULL with err
 * (unknown role, UNKNOWN kind, roles out of order where the format requires alternation). */
char *chat_render(const chat_template *t, const chat_message *msgs, int n_msgs,
                  bool add_generation_prompt, const char *bos, kv_error *err);

/* ---------------------------------------------------------------- tools (chat_tools.c)
 *
 * The generic tool format, for templates without one of their own (SmolLM2's has none): the
 * functions are listed in the system prompt as JSON, and a call is written the way Hermes and
 * Qwen 2.5 write theirs,
 *   <tool_call>{"name": "NAME", "arguments": {...}}</tool_call>
 * several calls separated by a newline; a tool's result goes back in a user turn as
 *   <tool_response>{"name": "NAME", "content": RESULT}</tool_response>
 * The answer is constrained by a grammar built from the functions' parameter schemas. */

typedef struct chat_tool {
    const char *name;        /* [a-zA-Z0-9_-]{1,64}, as OpenAI requires */
    const char *description; /* or NULL */
    const char *parameters;  /* JSON Schema text, or NULL (any object) */
} chat_tool;

typedef enum chat_tool_choice {
    CHAT_TOOL_NONE = 0, /* no tools rendered, no call */
    CHAT_TOOL_AUTO,     /* text or calls */
    CHAT_TOOL_REQUIRED, /* at least one call */
    CHAT_TOOL_NAMED,    /* one call of the named function */
} chat_tool_choice;

/* The system prompt text listing the tools and the call format (malloc'd). */
char *chat_tools_system(const chat_tool *tools, int n, kv_error *err);
/* GBNF for the answer: calls of the tools (named: only that one; parallel: one or more), or for
 * auto also plain text that does not start with '<'. NULL with err (a schema that does not
 * compile names the tool). */
char *chat_tools_gbnf(const chat_tool *tools, int n, chat_tool_choice choice, const char *named,
                      bool parallel, kv_error *err);
/* An assistant's earlier call as the format writes it (arguments: the JSON text as sent). */
char *chat_tools_render_call(const char *name, const char *arguments);
/* A tool's result as the user turn's content. */
char *chat_tools_render_result(const char *name, const char *content);

/* Incremental parsing of an answer into content or calls, for streaming and whole replies
 * alike: feed the whole text so far each time; events point into that text. */
typedef struct chat_tool_parser {
    int mode;      /* 0 undecided, 1 content, 2 calls */
    size_t cur;    /* bytes of the text consumed */
    int n_calls;   /* calls begun */
    bool in_args;  /* inside the current call's arguments */
    bool complete; /* every call begun has ended */
} chat_tool_parser;

typedef enum chat_tool_event_kind {
    CHAT_TOOL_EVENT_CONTENT = 0, /* s[0..n) is content */
    CHAT_TOOL_EVENT_CALL,        /* call `index` begins; s[0..n) is its name */
    CHAT_TOOL_EVENT_ARGS,        /* s[0..n) continues call `index`'s arguments */
} chat_tool_event_kind;

typedef struct chat_tool_event {
    chat_tool_event_kind kind;
    int index;
    const char *s;
    size_t n;
} chat_tool_event;

/* Consumes what can be decided of text[0..len) (final: nothing more will come), writing up to
 * max events; returns their count (call again while it returns max). */
int chat_tools_parse(chat_tool_parser *p, const char *text, size_t len, bool final,
                     chat_tool_event *ev, int max);

#endif
