/* The OpenAI API's request side: JSON bodies of /v1/chat/completions, /v1/completions,
 * /tokenize and /detokenize validated into plain structs (failures: server/http/error.h). Parsing
 * needs no model: what depends on the model (the chat template, token counts, the vocabulary size)
 * is checked by the caller. Every failure is an api_error with the HTTP status, the OpenAI error
 * type, the offending parameter and a message that says what was wrong. */
#ifndef KVSERVE_API_H
#define KVSERVE_API_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "model/chat/chat.h"
#include "model/sampler.h"
#include "server/http/error.h"

#define API_MAX_STOPS 4 /* as OpenAI */
#define API_MAX_N 16    /* choices per request */
#define API_MAX_TOP_LOGPROBS 20
#define API_MAX_LOGIT_BIAS 1024
#define API_MAX_PROMPTS 2048      /* prompts in one /v1/completions request, as embeddings */
#define API_MAX_TOKENS (1 << 20)  /* ids in one token-id prompt or /detokenize body */
#define API_MAX_CACHE_SALT 256    /* bytes */
#define API_MAX_TOOLS 128         /* as OpenAI */
#define API_MAX_EMBED_INPUTS 2048 /* inputs in one /v1/embeddings request, as OpenAI */

typedef enum api_kind {
    API_CHAT = 0,   /* /v1/chat/completions */
    API_COMPLETION, /* /v1/completions */
} api_kind;

/* One prompt of /v1/completions: text, or token ids. */
typedef struct api_prompt {
    char *text;      /* UTF-8, NUL-terminated; NULL when tokens are given */
    int32_t *tokens; /* ids (range-checked against the vocabulary by the caller) */
    int n_tokens;
} api_prompt;

typedef struct api_request {
    api_kind kind;
    char *model; /* required */
    /* chat: messages with roles system/user/assistant/tool (also "developer" mapped to
     * system); content as a string or an array of {"type":"text","text":..} parts joined in
     * order; an assistant's tool_calls (names checked, arguments JSON text that parses); a tool
     * message's tool_call_id and name. */
    chat_message *messages; /* role and content strings owned by the request */
    int n_messages;
    /* completions: a string, an array of strings, an array of ids, or an array of id arrays.
     * Several prompts give n choices each, in prompt order, as OpenAI does. */
    api_prompt *prompts;
    int n_prompts;
    bool echo; /* completions: prepend the prompt text to the choice's text */

    int max_tokens; /* max_tokens or max_completion_tokens (the latter wins); -1: not given */
    int n;          /* choices per prompt, 1..API_MAX_N */
    bool stream;
    bool include_usage; /* stream_options.include_usage (false unless stream) */
    /* chat: logprobs (bool) + top_logprobs (0..20); completions: logprobs (int 0..5 -> top). */
    bool logprobs;
    int top_logprobs;
    sampler_params sampling;    /* temperature, top_p, top_k, min_p, penalties, seed */
    bool seed_given;            /* seed present in the request */
    logit_bias *bias;           /* sampling.bias points here; ids not yet range-checked */
    char *stops[API_MAX_STOPS]; /* stop: a string or an array of up to 4 strings */
    int n_stops;
    char *user;
    /* kvserve extensions (optional; for the context cache) */
    bool cache;       /* "cache": false opts out; default true */
    char *cache_salt; /* "cache_salt": namespace salt, or NULL */
    bool ignore_eos;  /* vLLM's "ignore_eos": generate past end-of-generation tokens */
    bool speculative; /* "speculative": false keeps the request from drafting; default true */
    /* OpenAI's Predicted Outputs: "prediction": {"type": "content", "content": a string or an
     * array of {"type": "text", "text"} parts}, the parts joined; NULL when not given */
    char *prediction;
    int blend;         /* "blend": 0 off, 1 on (CacheBlend); -1 unset: the quality budget's */
    float blend_ratio; /* "blend_ratio": share of blended tokens recomputed, 0..1; -1: server */
    int blend_policy;  /* "blend_policy": which are recomputed (blend_policy); -1: the server's */
    /* The Redis tier's fetch (cache_fetch_policy): "kv_level" forces an encoding
     * (CACHE_ENC_ANY: none), "kv_lossless" insists on exact KV, "ttft_budget_ms" (-1: the
     * server's) lets levels adapt to a time budget. */
    int kv_level;
    bool kv_lossless;
    int64_t ttft_budget_ms;
    /* Prompt Cache: "schema_prompt", a <prompt schema> in PML (a string) or its JSON form (an
     * object, kept here as its JSON text), or NULL; "fixup" (-1: the server's default) and
     * "fixup_ratio" (-1: the server's) for the cross-module fix-up */
    char *schema_prompt;
    bool schema_prompt_json;
    int fixup;
    float fixup_ratio;
    /* Constrained decoding: the GBNF every answer must match (validated), from one of
     * response_format (json_schema, json_object), grammar / json_schema (llama-server),
     * guided_grammar / guided_json / guided_choice (vLLM); NULL when the output is free. */
    char *gbnf;
    char gbnf_param[64]; /* the field it came from */
    bool jump_forward;   /* kvserve's "jump_forward" (default true): forced text as prefill */
    /* chat: tools ({"type": "function", "function": {name, description, parameters}}), their
     * strings owned; tool_choice (default auto with tools); parallel_tool_calls (default true).
     * Assistant turns' tool_calls and tool messages stay in the messages (role "tool"), for the
     * chat template to write in the model's tool format; so does the grammar of the calls
     * (gbnf stays NULL for tools: openai.c builds it once the model is known). */
    chat_tool *tools;
    int n_tools;
    chat_tool_choice tool_choice;
    char *tool_choice_name; /* CHAT_TOOL_NAMED */
    bool parallel_tool_calls;
    /* The tools came as the legacy "functions" and "function_call" (OpenAI's deprecated form,
     * still taken): one call per answer, given back as message.function_call with finish
     * "function_call". Both forms at once are a 400. */
    bool legacy_functions;
} api_request;

/* Parses and validates a body of len bytes (not NUL-terminated). Returns 0, or -1 with err
 * (status 400 unless stated): malformed JSON (param ""), a body that is not an object, a wrong
 * type or out-of-range value (param names it), a missing model/messages/prompt, an empty message
 * list or prompt list, invalid UTF-8 anywhere in a string, an unknown role. Unknown fields are
 * ignored, as OpenAI-compatible servers do. On failure *out is left empty (zeroed), so
 * api_request_free on it is a harmless no-op. */
int api_parse_request(api_kind kind, const char *body, size_t len, api_request *out,
                      api_error *err);
void api_request_free(api_request *r);

/* /v1/embeddings: {"model", "input": a string, strings, token ids or lists of token ids,
 * "encoding_format": "float" | "base64", "dimensions", "user"}. */
typedef struct api_embeddings {
    char *model;
    api_prompt *inputs; /* token ids range-checked by the caller */
    int n_inputs;
    bool base64;
    int dimensions; /* 0: the model's width */
    char *user;
} api_embeddings;

int api_parse_embeddings(const char *body, size_t len, api_embeddings *out, api_error *err);
void api_embeddings_free(api_embeddings *e);

/* /tokenize: {"content"|"prompt": string} or {"messages": [...]} (rendered with the chat
 * template by the caller), "add_special" / "add_special_tokens" (bool), "with_pieces" (bool). */
typedef struct api_tokenize {
    char *text;             /* or NULL when messages are given */
    chat_message *messages; /* role/content owned */
    int n_messages;
    bool add_special; /* default true for text, false for messages (the template adds them) */
    bool with_pieces;
} api_tokenize;

int api_parse_tokenize(const char *body, size_t len, api_tokenize *out, api_error *err);
void api_tokenize_free(api_tokenize *t);

/* /detokenize: {"tokens": [ids]} (ids not yet range-checked). *tokens is malloc'd (NULL for an
 * empty list, and on failure); the caller frees it. */
int api_parse_detokenize(const char *body, size_t len, int32_t **tokens, int *n_tokens,
                         api_error *err);

#endif
