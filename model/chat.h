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

#endif
