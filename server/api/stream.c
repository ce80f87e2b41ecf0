/* A job's answer (job.h), streamed or whole, in its API's format (job_format: OpenAI's in
 * openai.c, the Responses API's in responses.c, Anthropic's Messages in anthropic.c).
 *
 * Streamed, one driver for every API follows the job's choices (their text, tool calls parsed as
 * they stream, the finish) and hands them to the format's stream hooks, which write Server-Sent
 * Events (https://html.spec.whatwg.org/multipage/server-sent-events.html) with the one writer,
 * job_sse_event. Once every choice has finished the close hook ends the stream, with the first
 * error in its API's shape when there was one: the status line said 200 by then, so the log says
 * why the stream ended. Whole, the reply waits for the last choice and is the format's. */
#include <stdlib.h>
#include <string.h>

#include "server/api/job.h"

/* ---------------------------------------------------------------- SSE bytes */

/* Queues n bytes of the stream; -1 when out of memory. */
static int job_put(job *j, const char *s, size_t n) {
    if (kv_array_reserve((void **)&j->buf, &j->buf_cap, j->buf_len + n, 1, 256)) return -1;
    memcpy(j->buf + j->buf_len, s, n);
    j->buf_len += n;
    return 0;
}

int job_sse_event(job *j, const char *event, const char *data) {
    if (!data) return -1;
    if (event &&
        (job_put(j, "event: ", 7) || job_put(j, event, strlen(event)) || job_put(j, "\n", 1)))
        return -1;
    if (job_put(j, "data: ", 6) || job_put(j, data, strlen(data)) || job_put(j, "\n\n", 2))
        return -1;
    return 0;
}

int job_sse_json(job *j, const char *event, json_t *v) {
    char *s = v ? json_dumps(v, JSON_COMPACT) : NULL;
    json_decref(v);
    int rc = job_sse_event(j, event, s);
    free(s);
    return rc;
}

/* Moves up to max pending bytes into buf: their count, 0 when none are left. */
static long job_buf_take(job *j, char *buf, size_t max) {
    if (j->buf_off < j->buf_len) {
        size_t n = j->buf_len - j->buf_off < max ? j->buf_len - j->buf_off : max;
        memcpy(buf, j->buf + j->buf_off, n);
        j->buf_off += n;
        return (long)n;
    }
    j->buf_len = j->buf_off = 0;
    return 0;
}

/* ---------------------------------------------------------------- a choice's news */

/* A choice's news since the stream's cursor (its text, logprobs and finish), copied under the
 * request's lock so the JSON is built without it (the engine takes that lock for every token it
 * publishes). */
typedef struct choice_news {
    char *text;
    size_t len, text_base;
    gen_logprob *lps;
    int n_lps;
    gen_finish finish;
} choice_news;

/* Takes choice i of prompt p's news into *out (free text and lps) and moves the cursor: 1 when
 * there was some, 0 when none (*done cleared while the choice runs), -1 when out of memory.
 * Call with the request's mutex held. */
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

int job_tool_events(chat_tool_parser *tp, const char *text, size_t len, gen_finish f,
                    job_tool_fn fn, void *ud) {
    bool final = f != GEN_RUNNING, cut = f == GEN_FINISH_LENGTH;
    for (int pass = 0; pass < 2; pass++) {
        /* the second pass: cut before any call, the text is content after all */
        if (pass == 1 && !(final && cut && tp->n_calls == 0)) break;
        chat_tool_event ev[16];
        int n;
        do {
            n = chat_tools_parse(tp, text, len, final && (!cut || pass == 1), ev, 16);
            for (int k = 0; k < n; k++)
                if (fn(ud, &ev[k])) return -1;
        } while (n == 16);
    }
    return 0;
}

/* The choice a tool event belongs to, for the format's hooks. */
typedef struct tool_target {
    job *j;
    int index;
} tool_target;

static int tool_event_to_format(void *ud, const chat_tool_event *ev) {
    tool_target *t = ud;
    return ev->kind == CHAT_TOOL_EVENT_CONTENT
               ? t->j->fmt->text(t->j, t->index, ev->s, ev->n, NULL, NULL)
               : t->j->fmt->call(t->j, t->index, ev);
}

/* A chat choice under tools: its new text goes through the tool parser, so calls stream as
 * calls and anything else as text; the finish is "tool_calls" after complete calls ("function_call"
 * for legacy functions). An answer that max_tokens cut inside its calls ends with the calls so
 * far (the whole answer's form, job_message_json, does the same). */
static int stream_tools(job *j, int index, const choice_news *nw) {
    size_t len = j->acc_len[index];
    char *acc = realloc(j->acc[index], len + nw->len + 1);
    if (!acc) return -1;
    memcpy(acc + len, nw->text, nw->len);
    acc[len + nw->len] = '\0';
    j->acc[index] = acc;
    j->acc_len[index] = len += nw->len;
    chat_tool_parser *tp = &j->tp[index];
    if (job_tool_events(tp, acc, len, nw->finish, tool_event_to_format,
                        &(tool_target){.j = j, .index = index}))
        return -1;
    if (nw->finish == GEN_RUNNING) return 0;
    const char *finish = job_finish_name(nw->finish);
    if (tp->mode == 2 && tp->complete && tp->n_calls > 0 && nw->finish == GEN_FINISH_STOP)
        finish = j->legacy ? "function_call" : "tool_calls";
    return j->fmt->text(j, index, "", 0, NULL, finish);
}

/* Hands every choice's new output to the format. Sets *progress when something was handed on
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

/* ---------------------------------------------------------------- the stream */

static int stream_close_events(job *j) {
    api_error err = {0};
    bool failed = job_error(j, &err) != 0;
    if (failed) /* the access line says 200 (what the status line said): this says why it ended */
        log_warn("POST %s %d id=%s: the stream ended with an error event: %s", j->fmt->path,
                 err.status, j->request_id, err.message);
    j->ended = true;
    return j->fmt->close(j, failed ? &err : NULL);
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

/* ---------------------------------------------------------------- the whole answer */

/* A whole reply, once every choice has finished: 1 with *out filled, else 0. */
static int job_poll(void *ud, http_reply *out) {
    job *j = ud;
    if (!job_finished(j)) return 0;
    api_error err = {0};
    if (job_error(j, &err))
        j->fmt->reply_error(out, &err);
    else
        j->fmt->reply(j, out);
    return 1;
}

static void job_close(void *ud) { job_free(ud); }

http_result job_answer(job *j, const job_format *fmt, bool stream, http_out *out) {
    j->fmt = fmt;
    if (stream) {
        out->stream = (http_stream){.ud = j, .read = stream_read, .close = job_close};
        return HTTP_STREAMING;
    }
    out->pending = (http_pending){.ud = j, .poll = job_poll, .close = job_close};
    return HTTP_PENDING;
}
