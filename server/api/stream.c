/* Streaming responses: the driver that follows a job's choices (their text, tool calls parsed as
 * they stream, finish) and hands them to the job's format (job_stream_format), and OpenAI's
 * chat/completions format. There each event is `data: {chunk}\n\n`; a chat stream opens with
 * the assistant role per choice, then content deltas, then a chunk with the finish reason; with
 * stream_options.include_usage every chunk carries "usage": null and a last chunk with no choices
 * carries the usage; `data: [DONE]` ends the stream. An error after the stream began is sent as
 * `data: {"error": {...}}` before [DONE]. */
#include <stdlib.h>
#include <string.h>

#include "server/api/job.h"

int job_put(job *j, const char *s, size_t n) {
    if (j->buf_len + n > j->buf_cap) {
        size_t cap = (j->buf_len + n) * 2;
        char *b = realloc(j->buf, cap);
        if (!b) return -1;
        j->buf = b;
        j->buf_cap = cap;
    }
    memcpy(j->buf + j->buf_len, s, n);
    j->buf_len += n;
    return 0;
}

/* Queues `data: <json>\n\n` (takes the reference). */
static int emit(job *j, json_t *v) {
    char *s = v ? json_dumps(v, JSON_COMPACT) : NULL;
    json_decref(v);
    if (!s) return -1;
    int rc = job_put(j, "data: ", 6) || job_put(j, s, strlen(s)) || job_put(j, "\n\n", 2);
    free(s);
    return rc ? -1 : 0;
}

static json_t *chunk(const job *j, json_t *choices) {
    json_t *v =
        json_pack("{s:s,s:s,s:I,s:s,s:o}", "id", j->id, "object",
                  j->kind == API_CHAT ? "chat.completion.chunk" : "text_completion", "created",
                  (json_int_t)j->created, "model", j->s->model_ids[0], "choices", choices);
    if (v && j->include_usage) json_object_set_new(v, "usage", json_null());
    return v;
}

/* One choice's delta: text (may be empty), logprobs of the tokens it covers, finish reason. */
static json_t *choice_delta(const job *j, int index, const char *text, size_t len, json_t *logprobs,
                            const char *finish) {
    json_t *c = json_object();
    json_object_set_new(c, "index", json_integer(index));
    if (j->kind == API_CHAT) {
        json_t *delta = json_object();
        if (len > 0 || !finish) json_object_set_new(delta, "content", json_stringn(text, len));
        json_object_set_new(c, "delta", delta);
    } else {
        json_object_set_new(c, "text", json_stringn(text, len));
    }
    json_object_set_new(c, "logprobs", logprobs ? logprobs : json_null());
    json_object_set_new(c, "finish_reason", finish ? json_string(finish) : json_null());
    return c;
}

/* True when every prompt's scoring (echo with logprobs) is done, or none is needed. */
static bool prompts_scored(job *j) {
    for (int p = 0; p < j->n_reqs; p++) {
        gen_request *r = j->reqs[p];
        if (!r->prompt_logprobs) continue;
        pthread_mutex_lock(&r->mu);
        bool ready = r->prompt_lps_ready || r->n_finished == r->n_choices;
        pthread_mutex_unlock(&r->mu);
        if (!ready) return false;
    }
    return true;
}

/* The opening chunks: the assistant role (chat) or the echoed prompt (completions, with the
 * prompt's logprobs when asked: those wait for the engine to score it). Returns 1 when sent,
 * 0 when the prompt's scores are not ready yet, -1 when out of memory. */
static int chat_open(job *j) {
    if (j->echo && j->logprobs && !prompts_scored(j)) return 0;
    for (int p = 0; p < j->n_reqs; p++)
        for (int i = 0; i < j->n; i++) {
            int index = p * j->n + i;
            json_t *c = NULL;
            if (j->kind == API_CHAT) {
                c = json_pack("{s:i,s:{s:s,s:s},s:n,s:n}", "index", index, "delta", "role",
                              "assistant", "content", "", "logprobs", "finish_reason");
            } else if (j->echo) {
                /* an error before scoring ended leaves prompt_lps unwritten: no logprobs then */
                gen_request *r = j->reqs[p];
                pthread_mutex_lock(&r->mu);
                bool scored = r->prompt_logprobs && r->prompt_lps_ready;
                pthread_mutex_unlock(&r->mu);
                json_t *lps = scored ? job_prompt_logprobs_json(j, p) : NULL;
                c = choice_delta(j, index, j->echo[p], strlen(j->echo[p]), lps, NULL);
            }
            if (c && emit(j, chunk(j, json_pack("[o]", c)))) return -1;
        }
    return 1;
}

/* One choice's news (choice_news), copied out under the request's lock so the JSON is built
 * without it (the engine takes that lock for every token it publishes). */
static int take_news(job *j, int p, int i, choice_news *out, bool *done) {
    gen_request *r = j->reqs[p];
    int index = p * j->n + i;
    const gen_choice *c = &r->choices[i];
    memset(out, 0, sizeof *out);
    out->finish = GEN_RUNNING;
    if (j->finish_sent[index]) return 0;
    size_t from = j->text_off[index];
    int lp_from = j->lp_off[index];
    if (c->len == from && c->n_lps == lp_from && c->finish == GEN_RUNNING) {
        *done = false;
        return 0;
    }
    out->text_base = from;
    out->len = c->len - from;
    out->n_lps = j->logprobs ? c->n_lps - lp_from : 0;
    out->text = malloc(out->len + 1);
    out->lps = out->n_lps > 0 ? malloc(sizeof *out->lps * (size_t)out->n_lps) : NULL;
    if (!out->text || (out->n_lps > 0 && !out->lps)) {
        free(out->text);
        free(out->lps);
        return -1;
    }
    if (out->len) memcpy(out->text, c->text + from, out->len);
    if (out->n_lps > 0) memcpy(out->lps, c->lps + lp_from, sizeof *out->lps * (size_t)out->n_lps);
    out->finish = c->finish;
    j->text_off[index] = c->len;
    j->lp_off[index] = c->n_lps;
    if (c->finish != GEN_RUNNING)
        j->finish_sent[index] = true;
    else
        *done = false;
    return 1;
}

/* Hands the parser's events on acc[0..len) to the format. */
static int stream_tool_events(job *j, int index, chat_tool_parser *tp, const char *acc, size_t len,
                              bool final) {
    chat_tool_event ev[16];
    int n;
    do {
        n = chat_tools_parse(tp, acc, len, final, ev, 16);
        for (int k = 0; k < n; k++) {
            int rc = ev[k].kind == CHAT_TOOL_EVENT_CONTENT
                         ? j->fmt->text(j, index, ev[k].s, ev[k].n, NULL, NULL)
                         : j->fmt->call(j, index, &ev[k]);
            if (rc) return -1;
        }
    } while (n == 16);
    return 0;
}

/* A call event as chat chunks: the call's index, id, type and name first, then argument pieces;
 * legacy functions as delta.function_call (the name, then argument pieces). */
static int chat_call(job *j, int index, const chat_tool_event *ev) {
    json_t *c;
    if (j->legacy) {
        json_t *fn = ev->kind == CHAT_TOOL_EVENT_CALL
                         ? json_pack("{s:s%,s:s}", "name", ev->s, ev->n, "arguments", "")
                         : json_pack("{s:s%}", "arguments", ev->s, ev->n);
        c = json_pack("{s:i,s:{s:o},s:n,s:n}", "index", index, "delta", "function_call", fn,
                      "logprobs", "finish_reason");
    } else {
        json_t *call;
        if (ev->kind == CHAT_TOOL_EVENT_CALL) {
            char id[48];
            job_call_id(j, index, ev->index, id, sizeof id);
            call = json_pack("{s:i,s:s,s:s,s:{s:s%,s:s}}", "index", ev->index, "id", id, "type",
                             "function", "function", "name", ev->s, ev->n, "arguments", "");
        } else {
            call = json_pack("{s:i,s:{s:s%}}", "index", ev->index, "function", "arguments", ev->s,
                             ev->n);
        }
        c = json_pack("{s:i,s:{s:[o]},s:n,s:n}", "index", index, "delta", "tool_calls", call,
                      "logprobs", "finish_reason");
    }
    return emit(j, chunk(j, json_pack("[o]", c)));
}

/* Text as one chunk of choice index: a content delta (or completions' text) with its logprobs
 * and finish reason. */
static int chat_text(job *j, int index, const char *s, size_t n, json_t *logprobs,
                     const char *finish) {
    return emit(j, chunk(j, json_pack("[o]", choice_delta(j, index, s, n, logprobs, finish))));
}

/* A chat choice under tools: its new text goes through the tool parser, so calls stream as
 * OpenAI streams them (delta.tool_calls: index, id, type and name first, then argument pieces)
 * and anything else as content; the finish is "tool_calls" after complete calls. An answer that
 * max_tokens cut inside its calls ends with the calls so far: the unfinished syntax after them is
 * held back, not sent as content (the whole answer's form, tools_message, does the same). Legacy
 * functions stream as delta.function_call (the name, then argument pieces), finish
 * "function_call". */
static int stream_tools(job *j, int index, const choice_news *nw) {
    size_t len = j->acc_len[index];
    char *acc = realloc(j->acc[index], len + nw->len + 1);
    if (!acc) return -1;
    memcpy(acc + len, nw->text, nw->len);
    j->acc[index] = acc;
    j->acc_len[index] = len += nw->len;
    chat_tool_parser *tp = &j->tp[index];
    bool final = nw->finish != GEN_RUNNING, cut = nw->finish == GEN_FINISH_LENGTH;
    if (stream_tool_events(j, index, tp, acc, len, final && !cut)) return -1;
    /* cut before any call: what is left is content after all */
    if (final && cut && tp->n_calls == 0 && stream_tool_events(j, index, tp, acc, len, true))
        return -1;
    if (!final) return 0;
    const char *finish = job_finish_name(nw->finish);
    if (tp->mode == 2 && tp->complete && tp->n_calls > 0 && nw->finish == GEN_FINISH_STOP)
        finish = j->legacy ? "function_call" : "tool_calls";
    return j->fmt->text(j, index, "", 0, NULL, finish);
}

/* Queues a chunk for every choice with new output. Sets *progress when something was queued
 * and *done when every choice has finished. */
static int stream_collect(job *j, bool *progress, bool *done) {
    *progress = false;
    *done = true;
    for (int p = 0; p < j->n_reqs; p++) {
        gen_request *r = j->reqs[p];
        for (int i = 0; i < r->n_choices; i++) {
            choice_news nw;
            pthread_mutex_lock(&r->mu);
            int got = take_news(j, p, i, &nw, done);
            pthread_mutex_unlock(&r->mu);
            if (got < 0) return -1;
            if (got == 0) continue;
            int rc = 0;
            if (nw.finish != GEN_FINISH_ERROR && j->tools) {
                rc = stream_tools(j, p * j->n + i, &nw);
                *progress = true;
            } else if (nw.finish != GEN_FINISH_ERROR) { /* errors are reported at the end */
                json_t *lps = nw.n_lps > 0 ? job_logprobs_json(j, nw.lps, nw.n_lps,
                                                               job_echo_len(j, p) + nw.text_base)
                                           : NULL;
                rc =
                    j->fmt->text(j, p * j->n + i, nw.text, nw.len, lps, job_finish_name(nw.finish));
                *progress = true;
            }
            free(nw.text);
            free(nw.lps);
            if (rc) return -1;
        }
    }
    return 0;
}

/* The error event, or the usage chunk when asked for, then [DONE]. */
static int chat_close(job *j, const api_error *err) {
    if (err) {
        char *e = api_error_json(err);
        int rc = !e || job_put(j, "data: ", 6) || job_put(j, e, strlen(e)) || job_put(j, "\n\n", 2);
        free(e);
        if (rc) return -1;
    } else if (j->include_usage) {
        json_t *v = chunk(j, json_array());
        json_object_set_new(v, "usage", job_usage(j));
        if (emit(j, v)) return -1;
    }
    return job_put(j, "data: [DONE]\n\n", 14);
}

static const job_stream_format CHAT_FORMAT = {chat_open, chat_text, chat_call, chat_close, NULL};

static int stream_close_events(job *j) {
    api_error err = {0};
    bool failed = job_error(j, &err) != 0;
    if (failed) /* the access line says 200 (what the status line said): this says why it ended */
        log_warn("POST %s %d id=%s: the stream ended with an error event: %s",
                 j->fmt->path          ? j->fmt->path
                 : j->kind == API_CHAT ? "/v1/chat/completions"
                                       : "/v1/completions",
                 err.status, j->request_id, err.message);
    j->ended = true;
    return j->fmt->close(j, failed ? &err : NULL);
}

long job_buf_take(job *j, char *buf, size_t max) {
    if (j->buf_off < j->buf_len) {
        size_t n = j->buf_len - j->buf_off < max ? j->buf_len - j->buf_off : max;
        memcpy(buf, j->buf + j->buf_off, n);
        j->buf_off += n;
        return (long)n;
    }
    j->buf_len = j->buf_off = 0;
    return 0;
}

static long stream_read(void *ud, char *buf, size_t max) {
    job *j = ud;
    for (;;) {
        long n = job_buf_take(j, buf, max);
        if (n > 0) return n;
        if (j->ended) return 0;
        if (!j->started) {
            int rc = j->fmt->open(j);
            if (rc < 0) return -1;
            if (rc == 0) return http_client_gone(j->fd) ? -1 : HTTP_WAIT;
            j->started = true;
            continue;
        }
        bool progress, done;
        if (stream_collect(j, &progress, &done)) return -1;
        if (done) {
            if (stream_close_events(j)) return -1;
            continue;
        }
        if (progress) continue;
        /* job_free (at close) cancels the work of a client that left */
        return http_client_gone(j->fd) ? -1 : HTTP_WAIT;
    }
}

static void stream_close(void *ud) { job_free(ud); }

int job_take_news(job *j, int p, int i, choice_news *out, bool *done) {
    return take_news(j, p, i, out, done);
}

void job_stream(job *j, http_stream *out) {
    if (!j->fmt) j->fmt = &CHAT_FORMAT;
    *out = (http_stream){.ud = j, .read = stream_read, .close = stream_close};
}
