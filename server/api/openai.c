/* The OpenAI endpoints over the engine: requests become token prompts (chat template, tokenizer,
 * length checks with the counts in the message), one gen_request per prompt with n choices, and
 * the engine's output becomes OpenAI's JSON, whole or streamed (stream.c's driver, in this file's
 * chunk format).
 *
 * Streamed, each event is `data: {chunk}\n\n`; a chat stream opens with the assistant role per
 * choice, then content deltas (or tool call deltas), then a chunk with the finish reason; with
 * stream_options.include_usage every chunk carries "usage": null and a last chunk with no choices
 * carries the usage; `data: [DONE]` ends the stream. An error after the stream began is sent as
 * `data: {"error": {...}}` before [DONE]. */
#include <jansson.h>
#include <math.h>
#include <openssl/evp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "server/api/job.h"

/* ---------------------------------------------------------------- completions */

/* The whole response once every choice has finished. */
static void chat_reply(job *j, http_reply *out) {
    json_t *choices = json_array();
    for (int p = 0; p < j->n_reqs; p++) {
        gen_request *r = j->reqs[p];
        for (int i = 0; i < r->n_choices; i++) {
            const gen_choice *c = &r->choices[i];
            json_t *ch = json_object();
            json_object_set_new(ch, "index", json_integer(p * j->n + i));
            const char *text = c->text ? c->text : "";
            const char *finish = job_finish_name(c->finish);
            if (j->kind == API_CHAT && j->tools) {
                json_object_set_new(ch, "message", job_message_json(j, p * j->n + i, c, &finish));
            } else if (j->kind == API_CHAT) {
                json_object_set_new(
                    ch, "message",
                    json_pack("{s:s,s:s%}", "role", "assistant", "content", text, c->len));
            } else if (j->echo) {
                size_t el = strlen(j->echo[p]);
                char *both = malloc(el + c->len + 1);
                if (both) {
                    memcpy(both, j->echo[p], el);
                    memcpy(both + el, text, c->len + 1);
                    json_object_set_new(ch, "text", json_stringn(both, el + c->len));
                }
                free(both);
            } else {
                json_object_set_new(ch, "text", json_stringn(text, c->len));
            }
            json_object_set_new(ch, "logprobs",
                                j->logprobs ? job_choice_logprobs_json(j, p, c->lps, c->n_lps)
                                            : json_null());
            json_object_set_new(ch, "finish_reason", json_string(finish));
            json_array_append_new(choices, ch);
        }
    }
    json_t *v = json_pack("{s:s,s:s,s:I,s:s,s:o,s:o}", "id", j->id, "object",
                          j->kind == API_CHAT ? "chat.completion" : "text_completion", "created",
                          (json_int_t)j->created, "model", j->s->model_ids[0], "choices", choices,
                          "usage", job_usage(j));
    http_reply_json(out, 200, v);
}

/* ---------------------------------------------------------------- streamed completions */

/* A chunk of the stream around choices (taken). */
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
            if (c && job_sse_json(j, NULL, chunk(j, json_pack("[o]", c)))) return -1;
        }
    return 1;
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
    return job_sse_json(j, NULL, chunk(j, json_pack("[o]", c)));
}

/* Text as one chunk of choice index: a content delta (or completions' text) with its logprobs
 * and finish reason. */
static int chat_text(job *j, int index, const char *s, size_t n, json_t *logprobs,
                     const char *finish) {
    return job_sse_json(j, NULL,
                        chunk(j, json_pack("[o]", choice_delta(j, index, s, n, logprobs, finish))));
}

/* The error event, or the usage chunk when asked for, then [DONE]. */
static int chat_close(job *j, const api_error *err) {
    if (err) {
        char *e = api_error_json(err);
        int rc = job_sse_event(j, NULL, e);
        free(e);
        if (rc) return -1;
    } else if (j->include_usage) {
        json_t *v = chunk(j, json_array());
        json_object_set_new(v, "usage", job_usage(j));
        if (job_sse_json(j, NULL, v)) return -1;
    }
    return job_sse_event(j, NULL, "[DONE]");
}

static const job_format CHAT_FORMAT = {chat_open,
                                       chat_text,
                                       chat_call,
                                       chat_close,
                                       chat_reply,
                                       http_reply_error,
                                       "/v1/chat/completions"};
static const job_format COMPLETION_FORMAT = {
    chat_open, chat_text, chat_call, chat_close, chat_reply, http_reply_error, "/v1/completions"};

static http_result completion_endpoint(server *s, api_kind kind, const http_call *c,
                                       http_out *out) {
    api_request rq;
    api_error err = {0};
    if (api_parse_request(kind, c->body, c->len, &rq, &err)) {
        api_request_free(&rq);
        http_reply_error(&out->reply, &err);
        return HTTP_REPLIED;
    }
    job *j = job_start(s, &rq, c, true, &err);
    bool streaming = rq.stream;
    api_request_free(&rq);
    if (!j) {
        http_reply_error(&out->reply, &err);
        if (err.status == 429) out->reply.retry_after = 1;
        return HTTP_REPLIED;
    }
    return job_answer(j, kind == API_CHAT ? &CHAT_FORMAT : &COMPLETION_FORMAT, streaming, out);
}

http_result openai_chat(server *s, const http_call *c, http_out *out) {
    return completion_endpoint(s, API_CHAT, c, out);
}

http_result openai_completions(server *s, const http_call *c, http_out *out) {
    return completion_endpoint(s, API_COMPLETION, c, out);
}

/* ---------------------------------------------------------------- embeddings */

/* One input's gen_request: its tokens prefilled once, pooled and normalized by the engine. */
static gen_request *embed_request(const server *s, const api_prompt *in, int i, int n_inputs,
                                  int *n_tokens, api_error *err) {
    const model *m = s->m;
    char param[32];
    snprintf(param, sizeof param, n_inputs > 1 ? "input[%d]" : "input", i);
    int32_t *ids = NULL;
    int n;
    if (in->text) {
        n = job_tokenize_text(s, in->text, true, &ids, param, err);
    } else {
        n = job_check_ids(m, in->tokens, in->n_tokens, param, err) ? -1 : in->n_tokens;
        if (n > 0 && !(ids = malloc(sizeof *ids * (size_t)n)))
            return api_fail(err, 500, "server_error", NULL, NULL, "out of memory"), NULL;
        if (n > 0) memcpy(ids, in->tokens, sizeof *ids * (size_t)n);
    }
    if (n < 0) return NULL;
    if (n == 0 || n >= s->ctx) {
        free(ids);
        if (n == 0)
            api_fail(err, 400, "invalid_request_error", NULL, param,
                     "the input is empty (it has no tokens)");
        else
            api_fail(err, 400, "invalid_request_error", "context_length_exceeded", param,
                     "This model's maximum context length is %d tokens; '%s' has %d tokens "
                     "(at most %d fit)",
                     s->ctx, param, n, s->ctx - 1);
        return NULL;
    }
    gen_request *r = gen_request_create(1);
    float *vec = malloc(sizeof *vec * (size_t)m->hp.dim);
    if (!r || !vec) {
        free(ids);
        free(vec);
        gen_request_unref(r);
        api_fail(err, 500, "server_error", NULL, NULL, "out of memory");
        return NULL;
    }
    r->prompt = ids;
    r->n_prompt = n;
    r->max_tokens = 0;
    r->pooling = s->pooling;
    r->embedding = vec;
    r->t_arrival = clock_now_ns();
    *n_tokens = n;
    return r;
}

/* A vector as JSON: floats, or (base64) its little-endian float32 bytes as OpenAI sends them. */
static json_t *vector_json(const float *v, int n, bool base64) {
    if (!base64) {
        json_t *a = json_array();
        for (int k = 0; k < n; k++) json_array_append_new(a, json_real(v[k]));
        return a;
    }
    size_t bytes = sizeof(float) * (size_t)n;
    unsigned char *raw = malloc(bytes), *b64 = malloc(4 * ((bytes + 2) / 3) + 1);
    json_t *out = NULL;
    if (raw && b64) {
        for (int k = 0; k < n; k++) {
            uint32_t u;
            memcpy(&u, &v[k], 4);
            for (int j = 0; j < 4; j++) raw[4 * k + j] = (unsigned char)(u >> (8 * j));
        }
        int len = EVP_EncodeBlock(b64, raw, (int)bytes);
        out = json_stringn((const char *)b64, (size_t)len);
    }
    free(raw);
    free(b64);
    return out;
}

/* POST /v1/embeddings (and /embeddings): every input is a prefill-only sequence in the engine's
 * batch, the request's inputs one group in its queue; the vectors come back in input order. */
http_result openai_embeddings(server *s, const http_call *c, http_out *o) {
    http_reply *out = &o->reply;
    api_embeddings rq;
    api_error err = {0};
    gen_request **reqs = NULL;
    int n_reqs = 0, tokens = 0, dim = s->m->hp.dim;
    if (api_parse_embeddings(c->body, c->len, &rq, &err)) goto fail;
    if (!job_model_accepted(s, rq.model)) {
        job_model_not_found(s, rq.model, "model", &err);
        goto fail;
    }
    if (rq.dimensions > dim) {
        api_fail(&err, 400, "invalid_request_error", NULL, "dimensions",
                 "'dimensions' is %d; this model's embeddings have %d", rq.dimensions, dim);
        goto fail;
    }
    if (!(reqs = calloc((size_t)rq.n_inputs, sizeof *reqs))) {
        api_fail(&err, 500, "server_error", NULL, NULL, "out of memory");
        goto fail;
    }
    int tenant = server_tenant(s, c);
    for (int i = 0; i < rq.n_inputs; i++) {
        int n = 0;
        if (!(reqs[n_reqs] = embed_request(s, &rq.inputs[i], i, rq.n_inputs, &n, &err))) goto fail;
        reqs[n_reqs++]->tenant = tenant;
        tokens += n;
    }
    /* One request, one place in the queue: the inputs go to the batch as room allows. */
    kv_error ke = {{0}};
    engine_submit_status st = engine_submit_group(s->eng, reqs, n_reqs, &ke);
    if (st != ENGINE_SUBMIT_OK) {
        job_submit_fail(st, &ke, &err);
        if (st == ENGINE_SUBMIT_QUEUE_FULL) out->retry_after = 1;
        goto fail;
    }
    for (int i = 0; i < n_reqs; i++) {
        gen_request *r = reqs[i];
        pthread_mutex_lock(&r->mu);
        while (r->n_finished < 1) {
            gen_request_wait(r, 100);
            if (r->n_finished < 1 && http_client_gone(c->fd)) {
                pthread_mutex_unlock(&r->mu);
                api_fail(&err, 499, "invalid_request_error", NULL, NULL,
                         "the client closed the connection");
                goto fail;
            }
        }
        pthread_mutex_unlock(&r->mu);
        if (r->error_status) {
            api_fail(&err, r->error_status, "server_error", NULL, NULL, "%s", r->error);
            goto fail;
        }
    }
    int d = rq.dimensions ? rq.dimensions : dim;
    json_t *data = json_array();
    for (int i = 0; i < n_reqs; i++) {
        float *v = reqs[i]->embedding;
        if (d < dim) { /* shortened, then normalized again (OpenAI's dimensions) */
            double ss = 0;
            for (int k = 0; k < d; k++) ss += (double)v[k] * v[k];
            double inv = ss > 0 ? 1.0 / sqrt(ss) : 0;
            for (int k = 0; k < d; k++) v[k] = (float)(v[k] * inv);
        }
        json_array_append_new(data, json_pack("{s:s,s:i,s:o}", "object", "embedding", "index", i,
                                              "embedding", vector_json(v, d, rq.base64)));
    }
    http_reply_json(out, 200,
                    json_pack("{s:s,s:o,s:s,s:{s:i,s:i}}", "object", "list", "data", data, "model",
                              s->model_ids[0], "usage", "prompt_tokens", tokens, "total_tokens",
                              tokens));
    goto done;
fail:
    http_reply_error(out, &err);
done:
    for (int i = 0; i < n_reqs; i++) {
        atomic_store(&reqs[i]->cancelled, true);
        gen_request_unref(reqs[i]);
    }
    free(reqs);
    api_embeddings_free(&rq);
    return HTTP_REPLIED;
}

/* One entry of /v1/models. */
static json_t *model_json(const server *s, const char *id) {
    return json_pack("{s:s,s:s,s:I,s:s,s:i}", "id", id, "object", "model", "created",
                     (json_int_t)s->started, "owned_by", "kvserve", "max_model_len", s->ctx);
}

/* Every served name is listed; one is found by any name a request may use, so with
 * --accept-any-model a frontend that checks its fixed name before using it finds it. */
http_result openai_models(server *s, const http_call *c, http_out *o) {
    http_reply *out = &o->reply;
    const char *id = c->tail[0] ? c->tail : NULL;
    if (id) {
        if (job_model_accepted(s, id)) {
            http_reply_json(out, 200, model_json(s, id));
            return HTTP_REPLIED;
        }
        api_error err;
        job_model_not_found(s, id, NULL, &err);
        http_reply_error(out, &err);
        return HTTP_REPLIED;
    }
    json_t *data = json_array();
    for (int i = 0; i < s->n_model_ids; i++)
        json_array_append_new(data, model_json(s, s->model_ids[i]));
    http_reply_json(out, 200, json_pack("{s:s,s:o}", "object", "list", "data", data));
    return HTTP_REPLIED;
}

http_result openai_tokenize(server *s, const http_call *c, http_out *o) {
    http_reply *out = &o->reply;
    api_tokenize t;
    api_error err = {0};
    int32_t *ids = NULL;
    int n = -1;
    if (api_parse_tokenize(c->body, c->len, &t, &err) == 0) {
        if (t.messages)
            n = job_tokenize_messages(s, t.messages, t.n_messages, NULL, 0, &ids, NULL, NULL, &err);
        else
            n = job_tokenize_text(s, t.text, t.add_special, &ids, "content", &err);
    }
    if (n < 0) {
        api_tokenize_free(&t);
        http_reply_error(out, &err);
        return HTTP_REPLIED;
    }
    json_t *tokens = json_array();
    for (int i = 0; i < n; i++) {
        if (!t.with_pieces) {
            json_array_append_new(tokens, json_integer(ids[i]));
            continue;
        }
        size_t len;
        char *piece = tokenizer_piece_utf8(s->m->tok, ids[i], true, &len);
        json_array_append_new(tokens, json_pack("{s:i,s:s%}", "id", ids[i], "piece",
                                                piece ? piece : "", piece ? len : 0));
        free(piece);
    }
    free(ids);
    api_tokenize_free(&t);
    http_reply_json(
        out, 200,
        json_pack("{s:o,s:i,s:i}", "tokens", tokens, "count", n, "max_model_len", s->ctx));
    return HTTP_REPLIED;
}

http_result openai_detokenize(server *s, const http_call *c, http_out *o) {
    http_reply *out = &o->reply;
    int32_t *ids = NULL;
    int n = 0;
    api_error err = {0};
    /* a sequence no longer than the context: the text it makes is bounded as a prompt's */
    if (api_parse_detokenize(c->body, c->len, &ids, &n, &err) ||
        (n > s->ctx &&
         api_fail(&err, 400, "invalid_request_error", "context_length_exceeded", "tokens",
                  "'tokens' has %d ids; at most the context's %d are "
                  "detokenized at once",
                  n, s->ctx)) ||
        job_check_ids(s->m, ids, n, "tokens", &err)) {
        free(ids);
        http_reply_error(out, &err);
        return HTTP_REPLIED;
    }
    kv_error ke = {{0}};
    size_t len = 0;
    char *text = tokenizer_decode(s->m->tok, ids, (size_t)n, false, &len, &ke);
    free(ids);
    if (!text) {
        api_fail(&err, 400, "invalid_request_error", NULL, "tokens", "%s", ke.msg);
        http_reply_error(out, &err);
        return HTTP_REPLIED;
    }
    http_reply_json(out, 200, json_pack("{s:s%,s:s%}", "content", text, len, "prompt", text, len));
    free(text);
    return HTTP_REPLIED;
}
