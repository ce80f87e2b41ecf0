/* Chat templates: the prompt formats of the model families kvserve serves, recognised from the
 * GGUF's tokenizer.chat_template (a Jinja source we do not execute) or named by flag. */
#ifndef KVSERVE_CHAT_H
#define KVSERVE_CHAT_H

#include <stdbool.h>
#include <stddef.h>

#include "util/util.h"

typedef enum chat_template_kind {
    CHAT_TEMPLATE_UNKNOWN = 0,
    CHAT_TEMPLATE_CHATML, /* <|im_start|>role\n...<|im_end|>\n  (SmolLM2, Qwen, Hermes) */
    CHAT_TEMPLATE_LLAMA3, /* <|start_header_id|>role<|end_header_id|>\n\n...<|eot_id|> */
    CHAT_TEMPLATE_LLAMA2, /* <s>[INST] <<SYS>>...<</SYS>> user [/INST] answer </s> */
    /* Llama 3.1 / 3.2 / 3.3: Llama 3's turns after a system header that carries "Cutting
     * Knowledge Date: December 2023" and "Today Date: 26 Jul 2024" (the templates' fallback
     * date: kvserve passes no date_string, so a prompt's text, and its cached KV, do not change
     * at midnight); tool results in "ipython" turns. */
    CHAT_TEMPLATE_LLAMA31,
    /* Mistral Nemo (v3-tekken): <s>[INST]user[/INST]answer</s>, no spaces, no trimming; the
     * system message goes into the last turn when that turn is the user's. */
    CHAT_TEMPLATE_MISTRAL,
    /* Mistral 7B Instruct v0.1 / v0.2's original template: <s>[INST] user [/INST]answer</s>, no
     * system message (a conversation with one is refused, as the template does). */
    CHAT_TEMPLATE_MISTRAL_LEGACY,
    /* Mistral "v1" (Mistral 7B v0.1 / v0.2's later template): <s> [INST] user [/INST] answer</s>,
     * the system message and "\n\n" before the first user message. */
    CHAT_TEMPLATE_MISTRAL_V1,
    /* Mistral "v3" (Mistral 7B v0.3, Mistral Large 2407): <s>[INST] user[/INST] answer</s>, the
     * answer trimmed; the system message into the last turn when that turn is the user's; tools
     * as Nemo's, each marker followed by a space. */
    CHAT_TEMPLATE_MISTRAL_V3,
    /* Mistral "v7" (Mistral Large 2411): <s>[SYSTEM_PROMPT] sys[/SYSTEM_PROMPT][INST] user[/INST]
     * answer</s>, system messages wherever they are. */
    CHAT_TEMPLATE_MISTRAL_V7,
    /* Mistral "v7-tekken" (Mistral Small 3.x with Small 3.2's tool format; Devstral and Ministral
     * 3 with the generic one): v7 without the spaces, roles alternating after the optional system
     * message. The templates' default system message (Small 3.x's carries today's date) is not
     * inserted. */
    CHAT_TEMPLATE_MISTRAL_V7_TEKKEN,
} chat_template_kind;

/* How a template writes tools, calls and results (see "tools" below). */
typedef enum chat_tool_format {
    CHAT_TOOLS_GENERIC = 0, /* kvserve's own, for templates without a tool format */
    CHAT_TOOLS_HERMES,      /* Qwen 2.5 / Hermes: <tools> in the system turn, <tool_call> */
    CHAT_TOOLS_LLAMA3,  /* Llama 3.1+: JSON tools in the first user turn, {"name", "parameters"} */
    CHAT_TOOLS_MISTRAL, /* Mistral Nemo: [AVAILABLE_TOOLS], [TOOL_CALLS], [TOOL_RESULTS] */
    CHAT_TOOLS_MISTRAL_V3, /* Mistral v3: Nemo's with a space after each marker */
    CHAT_TOOLS_MISTRAL_V7, /* Mistral Small 3.2: [TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{...} */
} chat_tool_format;

typedef struct chat_template {
    chat_template_kind kind;
    /* A system message the template inserts when the conversation has none (SmolLM2's
     * "You are a helpful AI assistant named SmolLM, ..."), malloc'd, or NULL. */
    char *default_system;
    chat_tool_format tools;
} chat_template;

/* One call of an assistant turn, as OpenAI sends it back. */
typedef struct chat_tool_call {
    const char *id;        /* the call's id (tool messages answer it), or NULL */
    const char *name;      /* the function */
    const char *arguments; /* JSON text; NULL or "": {} */
} chat_tool_call;

typedef struct chat_message {
    const char *role;    /* "system", "user", "assistant", "tool" */
    const char *content; /* UTF-8, or NULL for "" */
    /* assistant: the calls it made (n_tool_calls > 0), written after (or instead of) content */
    const chat_tool_call *tool_calls;
    int n_tool_calls;
    /* tool: the call answered, and its function's name (the generic format shows it) */
    const char *tool_call_id;
    const char *name;
    /* content that came as n_parts > 1 text parts: where each ends (bytes into content), for
     * the server's blend segments (a template writes content whole and ignores these) */
    const size_t *part_ends;
    int n_parts;
} chat_message;

/* A function the model may call (OpenAI's tools[].function). */
typedef struct chat_tool {
    const char *name;        /* [a-zA-Z0-9_-]{1,64}, as OpenAI requires */
    const char *description; /* or NULL */
    const char *parameters;  /* JSON Schema text, or NULL (any object) */
} chat_tool;

/* Recognises the template from its Jinja source by the formats' own markers (special tokens,
 * Llama 3.1's date header, Qwen's <tool_call>, Mistral's [TOOL_CALLS] and [SYSTEM_PROMPT], the
 * spaces around Mistral's [INST]). Unknown sources give CHAT_TEMPLATE_UNKNOWN. */
void chat_template_detect(const char *jinja, size_t len, chat_template *out);
/* By name: "chatml"; "qwen2.5" (ChatML, Hermes tools, Qwen's default system message) and
 * "hermes" (the same without it); "llama3"; "llama3.1" (also "llama3.2", "llama3.3");
 * "llama2"; "mistral-legacy"; "mistral-v1" (also "mistral", which named Llama 2's format before
 * kvserve had Mistral's own); "mistral-v3"; "mistral-nemo" (also "mistral-v3-tekken");
 * "mistral-v7"; "mistral-v7-tekken" (Small 3.2's tool format) and "devstral" (the same with the
 * generic one). -1 for any other name. */
int chat_template_from_name(const char *name, chat_template *out);
#define CHAT_TEMPLATE_NAMES                                                                        \
    "chatml, qwen2.5, hermes, llama3, llama3.1 (.2, .3), llama2, mistral-legacy, mistral-v1 "      \
    "(mistral), mistral-v3, mistral-nemo (mistral-v3-tekken), mistral-v7, mistral-v7-tekken, "     \
    "devstral"
const char *chat_template_name(chat_template_kind kind);
const char *chat_tools_format_name(chat_tool_format f);
void chat_template_free(chat_template *t);

/* Renders messages (and, with add_generation_prompt, the assistant turn's opening) as text whose
 * special tokens are spelled out, for tokenizer_encode(parse_special = true). tools (n_tools > 0)
 * are listed the way the template's tool format does; assistant turns' calls and tool messages
 * are written in that format whether or not tools are given. bos is the BOS token's text (or
 * NULL) for templates that spell it. Returns a malloc'd string or NULL with err (unknown role,
 * UNKNOWN kind, roles out of order where the format requires alternation, call arguments that
 * are not JSON, anything else the template itself refuses). */
char *chat_render(const chat_template *t, const chat_message *msgs, int n_msgs,
                  const chat_tool *tools, int n_tools, bool add_generation_prompt, const char *bos,
                  kv_error *err);

/* ---------------------------------------------------------------- tool turns (chat_tools.c)
 *
 * The rules a conversation's tool turns keep, whatever API brought them (OpenAI's chat messages;
 * Anthropic's tool_use and tool_result blocks, the Responses API's function_call items, once
 * mapped onto these messages): the results of an assistant message's calls come in the tool
 * messages right after it, one for each of its calls, by id. Each API words the verdict its own
 * way (for OpenAI, api.c). */

typedef enum chat_turn_problem {
    CHAT_TURNS_OK = 0,
    CHAT_TURNS_RESULT_WITHOUT_CALLS, /* tool message msg does not follow a message with calls */
    CHAT_TURNS_UNKNOWN_ID,           /* tool message msg answers an id the calls before it lack */
    CHAT_TURNS_ANSWERED_TWICE,       /* tool message msg answers a call answered by message other */
    CHAT_TURNS_UNANSWERED, /* assistant message msg's call `call` has no result after it */
} chat_turn_problem;

typedef struct chat_turn_check {
    chat_turn_problem problem;
    int msg;   /* the message at fault */
    int call;  /* UNANSWERED: its first call without a result */
    int other; /* ANSWERED_TWICE: the tool message that answered it first */
} chat_turn_check;

/* Checks msgs[0..n)'s tool turns; the first problem found (in message order) goes into *out,
 * which is also returned. A call or result without an id is never answered. */
chat_turn_problem chat_check_tool_turns(const chat_message *msgs, int n, chat_turn_check *out);
/* Whether call k of assistant message i has a result among the tool messages right after it. */
bool chat_call_answered(const chat_message *msgs, int n, int i, int k);
/* The ids of assistant message i's calls from `from` on that have no result after it, joined
 * with ", " into out (cap bytes; each id cut to 64 bytes, the list cut to fit): what the APIs'
 * refusals of an unanswered call list. */
void chat_unanswered_ids(const chat_message *msgs, int n, int i, int from, char *out, size_t cap);

/* ---------------------------------------------------------------- tools (chat_tools.c)
 *
 * Each tool format, as its template writes it (tools, the answer's calls, results); the
 * answer's syntax is also what the grammar allows and the parser reads:
 *
 *   generic  kvserve's, for templates without a format of their own (SmolLM2's): the tools as
 *            JSON lines in the system message (appended to the conversation's own); calls
 *              <tool_call>{"name": "NAME", "arguments": {...}}</tool_call>
 *            one a line; a result as a user turn holding
 *              <tool_response>{"name": "NAME", "content": RESULT}</tool_response>
 *   hermes   Qwen 2.5's template: <tools> in the system turn; calls
 *              <tool_call>\n{"name": "NAME", "arguments": {...}}\n</tool_call>
 *            one a line; results as <tool_response>\nRESULT\n</tool_response> in a user turn
 *   llama3   Llama 3.1+'s template: the tools (JSON, indented) in the first user turn; one call
 *            per turn, {"name": "NAME", "parameters": {...}}; results in "ipython" turns
 *   mistral  Mistral Nemo's template: [AVAILABLE_TOOLS][...][/AVAILABLE_TOOLS] before the last
 *            user turn; calls
 *              [TOOL_CALLS][{"name": "NAME", "arguments": {...}, "id": "ID"}, ...]
 *            with 9-character alphanumeric ids; results [TOOL_RESULTS]{"content": RESULT,
 *            "call_id": "ID"}[/TOOL_RESULTS]
 *   mistral-v3  Mistral v3's (Mistral 7B v0.3, Large 2407): the same with a space after
 *            [AVAILABLE_TOOLS], [TOOL_CALLS] and [TOOL_RESULTS]
 *   mistral-v7  Mistral Small 3.2's template: [AVAILABLE_TOOLS][...][/AVAILABLE_TOOLS] (the
 *            tools as one JSON list) before the last user turn; each call
 *              [TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{...}
 *            (ids as Nemo's); results [TOOL_RESULTS]ID[TOOL_CONTENT]RESULT[/TOOL_RESULTS]
 *
 * Arguments are written in Python's JSON layout (", " and ": "), as the templates' tojson does
 * and as the grammar's JSON Schema rules generate them. */

typedef enum chat_tool_choice {
    CHAT_TOOL_NONE = 0, /* no tools rendered, no call */
    CHAT_TOOL_AUTO,     /* text or calls */
    CHAT_TOOL_REQUIRED, /* at least one call */
    CHAT_TOOL_NAMED,    /* one call of the named function */
} chat_tool_choice;

/* GBNF for the answer in format f: calls of the tools (named: one call of that one; parallel:
 * one or more where the format allows several, Llama 3.1's does not), or for auto also plain
 * text that does not start as calls do. NULL with err (a schema that does not compile names the
 * tool). */
char *chat_tools_gbnf(chat_tool_format f, const chat_tool *tools, int n, chat_tool_choice choice,
                      const char *named, bool parallel, kv_error *err);

/* The literal markers format f's calls are written with that a vocabulary may hold as control
 * tokens (Mistral's [TOOL_CALLS]); NULL-terminated. The model makes such tokens decode to their
 * text, so the grammar can ask for them and the parser sees them. */
const char *const *chat_tools_markers(chat_tool_format f);

/* Mistral's call ids are 9 characters of [a-zA-Z0-9]; a client's id that is not is replaced by
 * one derived from it (FNV-1a, base 62), the same wherever the id appears, so a call and the
 * result that answers it keep matching. NULL gives the id of "". */
void chat_tools_mistral_id(const char *id, char out[10]);

/* Incremental parsing of an answer into content or calls, for streaming and whole replies
 * alike: feed the whole text so far each time; events point into that text. A split anywhere
 * (inside a marker, a name, a UTF-8 character) gives the same events as the whole text. */
typedef struct chat_tool_parser {
    chat_tool_format format;
    int mode;      /* 0 undecided, 1 content, 2 calls */
    size_t cur;    /* bytes of the text consumed */
    int n_calls;   /* calls begun */
    bool complete; /* every call begun has ended (and the format's closing, if any, came) */
    /* internal: where in the calls' syntax, and the arguments' JSON nesting */
    int phase, depth;
    bool in_string, escaped;
} chat_tool_parser;

void chat_tool_parser_init(chat_tool_parser *p, chat_tool_format f);

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
 * max events; returns their count (call again while it returns max). Text that leaves the
 * format's syntax is content from there on (complete is then false). */
int chat_tools_parse(chat_tool_parser *p, const char *text, size_t len, bool final,
                     chat_tool_event *ev, int max);

/* What closes a turn's calls in format f after the last one ("]" for Mistral's list, else ""). */
const char *chat_tools_closing(chat_tool_format f);

/* Repeated calls. A model made to call (tool_choice "required") can repeat its call until
 * max_tokens cuts it: SmolLM2 at temperature 0 calls get_weather for Paris again and again. No
 * context-free grammar can refuse "a call equal to an earlier one", so the sequence's guard does,
 * beside its grammar: it follows the answer as it is generated, and when a call's name and
 * arguments equal an earlier call's of the turn (as text: the grammar writes JSON in one layout)
 * the answer is cut after the calls before it and the turn ends there, with the format's closing.
 * A call that may still turn out to repeat one is held back from where it begins (its separator
 * included), so a stream never sends it. */
typedef struct chat_tool_guard {
    chat_tool_parser p;
    size_t fed;      /* bytes of the answer given to p */
    size_t last_end; /* where the syntax of the last call ended (0: no call yet) */
    int n_done;      /* calls whose arguments are complete */
    bool fresh;      /* the call in progress already differs from every earlier call */
    bool free_text;  /* the answer is content, not calls: nothing to guard */
    /* each call's name and arguments, as offsets into the answer (which may move) */
    struct chat_tool_span {
        size_t name, name_len, args, args_len;
        bool has_args;
    } * calls;
    int n_calls, cap_calls;
} chat_tool_guard;

void chat_tool_guard_init(chat_tool_guard *g, chat_tool_format f);
void chat_tool_guard_free(chat_tool_guard *g);
/* Follows text[0..len), the answer so far (it only grows between calls). *release receives how
 * much of it may be released. Returns 1 when the call just completed repeats an earlier one:
 * *cut then receives where the answer ends instead (after the calls before it; the caller
 * appends chat_tools_closing). 0 otherwise, -1 when out of memory. */
int chat_tool_guard_scan(chat_tool_guard *g, const char *text, size_t len, size_t *release,
                         size_t *cut);

#endif
