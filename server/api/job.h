/* One generating request in flight, whatever API it came through (OpenAI's chat and
 * completions, the Responses API, Anthropic's Messages): a gen_request per prompt, n choices
 * each, and the stream's cursors into their output. job.c runs it over the engine; stream.c
 * streams it, one driver for every API, each API's dialect a job_format of hooks that
 * write Server-Sent Events with job_sse_event. Internal to server/api/. */
#ifndef KVSERVE_JOB_H
#define KVSERVE_JOB_H

#include <jansson.h>

#include "server/api/handlers.h"

typedef struct job job;

/* How a job's answer is written in its API's dialect (job.fmt): OpenAI's chat and completions
 * (openai.c), the Responses API (responses.c), Anthropic's Messages (anthropic.c). Streamed, the
 * one driver (stream.c) takes each choice's news under its request's lock and hands it to the
 * stream hooks outside it, tool calls already parsed; they queue events with job_sse_event (or
 * job_sse_json) and return 0, or -1 when out of memory. Whole, reply writes the answer once
 * every choice has finished. */
typedef struct job_format {
    /* The opening events: 1 sent, 0 not ready yet (the stream waits), -1 out of memory. */
    int (*open)(job *j);
    /* Choice index's next text s[0..n) (n may be 0) with the logprobs of the tokens it covers
     * (chat/completions' shape, or NULL; the hook takes the reference) and, when it ends the
     * choice, the finish reason ("stop", "length", "tool_calls", "function_call"; NULL while
     * the choice runs). */
    int (*text)(job *j, int index, const char *s, size_t n, json_t *logprobs, const char *finish);
    /* A call of choice index: one begins (CHAT_TOOL_EVENT_CALL: s is its name) or its arguments
     * continue (CHAT_TOOL_EVENT_ARGS). */
    int (*call)(job *j, int index, const chat_tool_event *ev);
    /* The closing events once every choice has finished; err: the first error (the stream
     * ends with it, in the API's shape), or NULL. */
    int (*close)(job *j, const api_error *err);
    /* The whole answer (no stream) once every choice has finished without an error; an error
     * is written by reply_error, in the API's error JSON. */
    void (*reply)(job *j, http_reply *out);
    void (*reply_error)(http_reply *out, const api_error *err);
    const char *path; /* the endpoint, for the log of a stream that ended with an error */
} job_format;

struct job {
    server *s;
    api_kind kind;
    char id[48];
    long created;
    gen_request **reqs; /* one per prompt; choice index = prompt * n + choice */
    int n_reqs;
    int n;
    int prompt_tokens;
    char **echo; /* completions with echo: each prompt's text */
    bool logprobs;
    int top_logprobs;
    bool include_usage;
    int fd;     /* the client's socket */
    int tenant; /* whose request it is (server_tenant) */
    bool streaming;
    /* The connection waiting on the job (http_call.wake): woken at every change of a stream,
     * and when a whole request has finished otherwise. */
    void (*wake)(void *arg);
    void *wake_arg;
    char request_id[HTTP_REQUEST_ID_MAX]; /* for the log */
    bool tools;                           /* chat with tools: answers are parsed into tool calls */
    bool legacy;                          /* ... given back as function_call (legacy functions) */
    uint32_t call_salt;                   /* tool call ids: call_<salt><choice><call> */
    chat_tool_parser *tp;                 /* streaming, per choice */
    char **acc;                           /* streaming with tools, per choice: the text so far */
    size_t *acc_len;
    /* streaming */
    size_t *text_off; /* per choice: text already sent */
    int *lp_off;      /* per choice: logprobs already sent */
    bool *finish_sent;
    bool started, ended;
    char *buf; /* SSE bytes not yet handed to the connection */
    size_t buf_len, buf_off, buf_cap;
    const job_format *fmt; /* its API's (job_answer sets it) */
    /* Another API's state for the request (its stream hooks' and reply's), freed by ext_free
     * with the job. */
    void *ext;
    void (*ext_free)(void *ext);
};

/* Validates, tokenizes and (submit) submits rq (job.c); without submit, only computes the
 * prompts' cache keys. NULL with err on any problem. */
job *job_start(server *s, const api_request *rq, const http_call *c, bool submit, api_error *err);
/* Waits until every choice has finished, blocking the calling thread (the cache's pin, a
 * prompt-only run); -1 (499) when the client went away meanwhile. */
int job_wait(job *j, api_error *err);
/* True when every choice of every prompt has finished. */
bool job_finished(job *j);
void job_free(job *j);
const char *job_finish_name(gen_finish f);
json_t *job_usage(const job *j);
/* Logprobs of n tokens in the endpoint's shape; text_base: the text offset of the first. */
json_t *job_logprobs_json(const job *j, const gen_logprob *lps, int n, size_t text_base);
int job_error(const job *j, api_error *err);
/* Bytes of echoed prompt text before a choice's completion (0 without echo). */
size_t job_echo_len(const job *j, int prompt);
/* A whole choice's logprobs: for completions with echo, the prompt's tokens (scored by the
 * engine) come first. */
json_t *job_choice_logprobs_json(const job *j, int prompt, const gen_logprob *lps, int n);
/* The prompt's tokens as completions logprobs arrays (first token null). */
json_t *job_prompt_logprobs_json(const job *j, int prompt);
/* The id of a choice's call. */
void job_call_id(const job *j, int choice, int call, char *out, size_t cap);
/* A chat answer under tools as OpenAI's message (role, content or tool_calls; legacy functions:
 * function_call), with *finish "tool_calls" ("function_call") for complete calls; choice index
 * c of j. */
json_t *job_message_json(const job *j, int index, const gen_choice *c, const char **finish);

/* ---------------------------------------------------------------- the answer (stream.c) */

/* The handler's answer for j, written in fmt, which owns j from then on (freed when the
 * connection ends): with stream, an SSE stream (HTTP_STREAMING); else a reply pending until every
 * choice has finished (HTTP_PENDING). */
http_result job_answer(job *j, const job_format *fmt, bool stream, http_out *out);
/* The one SSE writer: queues `event: EVENT\n` (none when event is NULL), then `data: DATA\n\n`.
 * -1 when out of memory (data NULL counts as that: a failed dump). */
int job_sse_event(job *j, const char *event, const char *data);
/* job_sse_event with the compact JSON text of v as its data (takes the reference). */
int job_sse_json(job *j, const char *event, json_t *v);
/* Receives the tool parser's events (job_tool_events); 0, or -1 to stop (out of memory). */
typedef int (*job_tool_fn)(void *ud, const chat_tool_event *ev);
/* Hands the events of tp on a chat answer so far, text[0..len), to fn: f is the choice's finish
 * (GEN_RUNNING while it runs). An answer that max_tokens cut inside its calls ends with the
 * calls so far: the unfinished syntax after them is held back, not sent as content; cut before
 * any call, what is left is content after all. */
int job_tool_events(chat_tool_parser *tp, const char *text, size_t len, gen_finish f,
                    job_tool_fn fn, void *ud);

/* For the other APIs over the same jobs (openai.c's embeddings and tokenizer, anthropic.c). */

/* True when requests may name the model `name`; the 404 that names the served models when not
 * (param: the field that named it, or NULL). */
bool job_model_accepted(const server *s, const char *name);
int job_model_not_found(const server *s, const char *name, const char *param, api_error *err);
/* A chat's or a text's token ids (malloc'd) as a job tokenizes them: the count, or -1 with err
 * (400; text over server_text_limit is refused before it is tokenized). With bounds, the token
 * offsets where the chat's content parts start and end (*n_bounds of them; see part_bounds in
 * job.c). */
int job_tokenize_messages(const server *s, const chat_message *msgs, int n, const chat_tool *tools,
                          int n_tools, int32_t **ids, int **bounds, int *n_bounds, api_error *err);
int job_tokenize_text(const server *s, const char *text, bool add_special, int32_t **ids,
                      const char *param, api_error *err);
/* -1 with err (400 naming param) when an id is outside the vocabulary. */
int job_check_ids(const model *m, const int32_t *ids, int n, const char *param, api_error *err);
/* The API error for an engine refusal (429 when its queue is full, 503 when it shuts down). */
int job_submit_fail(engine_submit_status st, const kv_error *ke, api_error *err);

/* 0 when requests may name the model `name`, else -1 with the 404 (model_not_found). */
int job_model_check(const server *s, const char *name, api_error *err);
/* msgs (with tools, n_tools > 0) rendered with m's chat template (gen: with the assistant
 * turn's opening), and whether the tokenizer adds BOS before it: what a chat job tokenizes.
 * malloc'd, or NULL with err (400). */
char *job_render(const model *m, const chat_message *msgs, int n, const chat_tool *tools,
                 int n_tools, bool gen, bool *add_bos, api_error *err);
/* Where content part c[a..e) is in a rendered prompt text[0..len), searched from byte `from`:
 * its bytes as sent, else trimmed of white space (*n: the bytes found); NULL when absent. */
const char *job_find_part(const char *text, size_t len, size_t from, const char *c, size_t a,
                          size_t e, size_t *n);

#endif
