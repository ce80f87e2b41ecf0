/* A completion request's life over the engine (job.h), shared by every API that
 * generates: its prompts rendered and tokenized (chat template, tokenizer, length checks with
 * the counts in the message), one gen_request per prompt with n choices, submitted, waited on
 * and freed; and the pieces of OpenAI's JSON that the APIs build their answers from. */
#include "server/api/job.h"
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <openssl/evp.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---------------------------------------------------------------- prompts */

static int fail_400(api_error *err, const char *param, const char *code, const char *msg) {
    return api_fail(err, 400, "invalid_request_error", code, param, "%s", msg);
}

static int fail_oom(api_error *err) {
    return api_fail(err, 500, "server_error", NULL, NULL, "out of memory");
}

/* Where a content part (c[a..e)) is in the rendered prompt, searched from byte `from`: its
 * bytes as sent, else without the white space around them (templates trim messages). */
const char *job_find_part(const char *text, size_t len, size_t from, const char *c, size_t a,
                          size_t e, size_t *n) {
    for (int trim = 0; trim < 2; trim++) {
        if (trim) {
            while (a < e && strchr(" \t\r\n", c[a])) a++;
            while (e > a && strchr(" \t\r\n", c[e - 1])) e--;
        }
        const char *hit = a < e ? memmem(text + from, len - from, c + a, e - a) : NULL;
        if (hit) {
            *n = e - a;
            return hit;
        }
    }
    return NULL;
}

/* The segment bounds of a chat prompt (gen_request's bounds): the tokens where its messages'
 * content parts begin and end, so that each part cuts into content-defined chunks as a prompt's
 * start does, and blend finds a passage sent as a part wherever it sits. Parts are found in the
 * rendered text in order; a bound inside a token moves to that token's end. Returns the count
 * (*out malloc'd), 0 when there are none or the tokens do not spell the text byte for byte
 * (SentencePiece's added space): then the prompt is cut by content alone. */
static int part_bounds(const model *m, const chat_message *msgs, int n, const char *text,
                       const int32_t *ids, int n_ids, bool added_bos, int **out) {
    *out = NULL;
    int want = 0;
    for (int i = 0; i < n; i++) want += msgs[i].n_parts;
    if (want == 0) return 0;
    size_t len = strlen(text), from = 0;
    size_t *starts = malloc(sizeof *starts * (size_t)n_ids);
    int *b = malloc(sizeof *b * 2 * (size_t)want), nb = 0, tok = 0;
    if (!starts || !b ||
        !tokenizer_token_starts(m->tok, ids, n_ids, added_bos, text, len, starts)) {
        free(starts);
        free(b);
        return 0;
    }
    for (int i = 0; i < n; i++)
        for (int j = 0; j < msgs[i].n_parts; j++) {
            const char *c = msgs[i].content;
            size_t a = j ? msgs[i].part_ends[j - 1] : 0, e = msgs[i].part_ends[j], n_hit;
            const char *hit = job_find_part(text, len, from, c, a, e, &n_hit);
            if (!hit) continue;
            size_t edge[2] = {(size_t)(hit - text), (size_t)(hit - text) + n_hit};
            from = edge[1];
            for (int k = 0; k < 2; k++) {
                while (tok < n_ids && starts[tok] < edge[k]) tok++;
                if (tok > 0 && tok < n_ids && (nb == 0 || b[nb - 1] < tok)) b[nb++] = tok;
            }
        }
    free(starts);
    if (nb == 0) {
        free(b);
        return 0;
    }
    *out = b;
    return nb;
}

/* Templates that spell BOS out (Llama 3) must not get a second one from the tokenizer. */
char *job_render(const model *m, const chat_message *msgs, int n, const chat_tool *tools,
                 int n_tools, bool gen, bool *add_bos, api_error *err) {
    kv_error ke = {{0}};
    int32_t bos = tokenizer_bos(m->tok);
    const char *bos_text = bos >= 0 ? tokenizer_token_text(m->tok, bos) : NULL;
    char *text = chat_render(&m->chat, msgs, n, tools, n_tools, gen, bos_text, &ke);
    if (!text) {
        fail_400(err, "messages", NULL, ke.msg);
        return NULL;
    }
    *add_bos = tokenizer_add_bos(m->tok);
    if (bos_text && strncmp(text, bos_text, strlen(bos_text)) == 0) *add_bos = false;
    return text;
}

/* Renders messages (with tools, when given) with the model's chat template and tokenizes them;
 * *bounds (malloc'd, or NULL) gets the content parts' segment bounds and *n_bounds their count,
 * unless bounds is NULL. */
int job_tokenize_messages(const server *s, const chat_message *msgs, int n, const chat_tool *tools,
                          int n_tools, int32_t **ids, int **bounds, int *n_bounds, api_error *err) {
    const model *m = s->m;
    kv_error ke = {{0}};
    bool add_bos;
    char *text = job_render(m, msgs, n, tools, n_tools, true, &add_bos, err);
    if (!text) return -1;
    if (server_check_text(s, strlen(text), "messages", err)) {
        free(text);
        return -1;
    }
    int n_ids = tokenizer_encode(m->tok, text, strlen(text), add_bos, true, ids, &ke);
    if (n_ids > 0 && bounds)
        *n_bounds = part_bounds(m, msgs, n, text, *ids, n_ids, add_bos, bounds);
    free(text);
    if (n_ids < 0) return fail_400(err, "messages", NULL, ke.msg);
    return n_ids;
}

int job_tokenize_text(const server *s, const char *text, bool add_special, int32_t **ids,
                      const char *param, api_error *err) {
    const model *m = s->m;
    if (server_check_text(s, strlen(text), param, err)) return -1;
    kv_error ke = {{0}};
    bool add_bos = add_special && tokenizer_add_bos(m->tok);
    int n = tokenizer_encode(m->tok, text, strlen(text), add_bos, true, ids, &ke);
    if (n < 0) return fail_400(err, param, NULL, ke.msg);
    return n;
}

int job_check_ids(const model *m, const int32_t *ids, int n, const char *param, api_error *err) {
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= m->hp.n_vocab)
            return api_fail(err, 400, "invalid_request_error", NULL, param,
                            "token id %d at position %d is outside the vocabulary [0, %d)", ids[i],
                            i, m->hp.n_vocab);
    return 0;
}

/* ---------------------------------------------------------------- model names */

/* True when a request may name the model `name`: one of the served names, or any name with
 * --accept-any-model (frontends that send a fixed name such as gpt-4o-mini). */
bool job_model_accepted(const server *s, const char *name) {
    if (s->cfg->accept_any_model) return true;
    for (int i = 0; i < s->n_model_ids; i++)
        if (strcmp(name, s->model_ids[i]) == 0) return true;
    return false;
}

/* The 404 for a name not served, listing the names that are (as many as the message holds). */
int job_model_check(const server *s, const char *name, api_error *err) {
    return job_model_accepted(s, name) ? 0 : job_model_not_found(s, name, "model", err);
}

int job_model_not_found(const server *s, const char *name, const char *param, api_error *err) {
    char names[256];
    size_t n = 0;
    for (int i = 0; i < s->n_model_ids && n < sizeof names; i++)
        n +=
            (size_t)snprintf(names + n, sizeof names - n, "%s'%s'", i ? ", " : "", s->model_ids[i]);
    return api_fail(err, 404, "invalid_request_error", "model_not_found", param,
                    "The model '%s' does not exist; this server serves %s", name, names);
}

/* ---------------------------------------------------------------- jobs */

void job_free(job *j) {
    if (!j) return;
    for (int i = 0; i < j->n_reqs; i++) {
        gen_request *r = j->reqs[i];
        if (r) gen_request_watch(r, NULL, NULL); /* the connection may be gone after this */
        /* harmless for a finished request: the engine no longer looks at it */
        if (r) atomic_store(&r->cancelled, true);
        gen_request_unref(r);
        if (j->echo) free(j->echo[i]);
    }
    free(j->reqs);
    free(j->echo);
    free(j->text_off);
    free(j->lp_off);
    free(j->finish_sent);
    if (j->acc)
        for (int i = 0; i < j->n_reqs * j->n; i++) free(j->acc[i]);
    free(j->acc);
    free(j->acc_len);
    free(j->tp);
    free(j->buf);
    if (j->ext_free) j->ext_free(j->ext);
    free(j);
}

/* The job's random numbers: its id's, its calls' and a seed. -1 with err (500) when the kernel
 * gives no random bytes (never a clock's stand-in: ids must not be guessable). */
typedef struct job_random {
    uint64_t id;
    uint32_t id_tail, call_salt;
    uint64_t seed;
} job_random;

static int job_random_draw(job_random *r, api_error *err) {
    if (kv_random(r, sizeof *r) == 0) return 0;
    return api_fail(err, 500, "server_error", NULL, NULL,
                    "no random bytes for the request's ids (getrandom: %s)", strerror(errno));
}

/* A job for rq with room for n_prompts requests and none added yet, ids from rnd. NULL when out
 * of memory. */
static job *job_create(server *s, const api_request *rq, const http_call *c, int n_prompts,
                       const job_random *rnd) {
    job *j = calloc(1, sizeof *j);
    if (!j) return NULL;
    j->s = s;
    j->kind = rq->kind;
    j->n = rq->n;
    j->fd = c->fd;
    j->tenant = server_tenant(s, c);
    j->streaming = rq->stream;
    j->wake = c->wake;
    j->wake_arg = c->wake_arg;
    snprintf(j->request_id, sizeof j->request_id, "%s", c->request_id ? c->request_id : "-");
    j->created = (long)time(NULL);
    j->logprobs = rq->logprobs;
    j->top_logprobs = rq->top_logprobs;
    j->include_usage = rq->include_usage;
    j->tools = rq->kind == API_CHAT && rq->tool_choice != CHAT_TOOL_NONE;
    j->legacy = rq->legacy_functions;
    j->call_salt = rnd->call_salt;
    snprintf(j->id, sizeof j->id, "%s-%016llx%08x", rq->kind == API_CHAT ? "chatcmpl" : "cmpl",
             (unsigned long long)rnd->id, (unsigned)rnd->id_tail);
    if (!(j->reqs = calloc((size_t)n_prompts, sizeof *j->reqs)) ||
        (rq->echo && !(j->echo = calloc((size_t)n_prompts, sizeof *j->echo)))) {
        job_free(j);
        return NULL;
    }
    return j;
}

/* Prompt p of rq as token ids (*ids malloc'd): the chat's messages rendered and tokenized, a
 * text prompt tokenized, or a token-id prompt checked against the vocabulary. param receives
 * the name errors cite. Returns the count (0: an empty prompt), or -1 with err and *ids NULL. */
static int prompt_tokens(const server *s, const api_request *rq, int p, int32_t **ids, int **bounds,
                         int *n_bounds, char *param, size_t param_size, api_error *err) {
    *ids = NULL;
    *bounds = NULL;
    *n_bounds = 0;
    if (rq->kind == API_CHAT) {
        snprintf(param, param_size, "messages");
        /* tool_choice none: no tools listed, earlier calls and results still written */
        bool tools = rq->tool_choice != CHAT_TOOL_NONE;
        /* content parts bound blend's segments: not looked for when the request blends nothing */
        return job_tokenize_messages(s, rq->messages, rq->n_messages, tools ? rq->tools : NULL,
                                     tools ? rq->n_tools : 0, ids, rq->blend != 0 ? bounds : NULL,
                                     n_bounds, err);
    }
    snprintf(param, param_size, rq->n_prompts > 1 ? "prompt[%d]" : "prompt", p);
    const api_prompt *pr = &rq->prompts[p];
    if (pr->text) return job_tokenize_text(s, pr->text, true, ids, param, err);
    if (job_check_ids(s->m, pr->tokens, pr->n_tokens, param, err)) return -1;
    if (!(*ids = malloc(sizeof(int32_t) * (size_t)(pr->n_tokens ? pr->n_tokens : 1))))
        return fail_oom(err);
    memcpy(*ids, pr->tokens, sizeof(int32_t) * (size_t)pr->n_tokens);
    return pr->n_tokens;
}

/* The completion's budget for a prompt of n_ids tokens: max_tokens as asked (not given:
 * completions stop at 16 tokens, OpenAI's and vLLM's default for the legacy endpoint; chat runs
 * to the context's end), within the context and --max-tokens-limit. -1 with err when the
 * prompt leaves no room or the request asks for more than fits. */
static int prompt_max_tokens(const server *s, const api_request *rq, int n_ids, const char *param,
                             api_error *err) {
    const char *what = rq->kind == API_CHAT ? "messages" : "prompt";
    int max_tokens = rq->max_tokens;
    if (max_tokens < 0 && rq->kind == API_COMPLETION) max_tokens = 16;
    if (n_ids >= s->ctx || (max_tokens > 0 && max_tokens > s->ctx - n_ids)) {
        if (max_tokens > 0)
            return api_fail(err, 400, "invalid_request_error", "context_length_exceeded", param,
                            "This model's maximum context length is %d tokens. However, you "
                            "requested %lld tokens (%d in the %s, %d in the completion). Please "
                            "reduce the length of the %s or completion.",
                            s->ctx, (long long)n_ids + max_tokens, n_ids, what, max_tokens, what);
        return api_fail(err, 400, "invalid_request_error", "context_length_exceeded", param,
                        "This model's maximum context length is %d tokens. However, your "
                        "%s has %d tokens, leaving no room for a completion.",
                        s->ctx, what, n_ids);
    }
    if (max_tokens > s->max_tokens_limit)
        return api_fail(err, 400, "invalid_request_error", NULL, "max_tokens",
                        "max_tokens is %d; this server allows at most %d", max_tokens,
                        s->max_tokens_limit);
    if (max_tokens < 0) {
        max_tokens = s->ctx - n_ids;
        if (max_tokens > s->max_tokens_limit) max_tokens = s->max_tokens_limit;
    }
    return max_tokens;
}

/* The request's grammar, parsed (again: api.c validated it) and bound to the vocabulary; with
 * tools, the calls' grammar in the model's tool format. */
static int request_grammar(const server *s, gen_request *r, const api_request *rq, api_error *err) {
    kv_error ke = {{0}};
    const char *src = rq->gbnf, *param = rq->gbnf_param;
    char *calls = NULL;
    if (!src) {
        calls = chat_tools_gbnf(s->m->chat.tools, rq->tools, rq->n_tools, rq->tool_choice,
                                rq->tool_choice_name, rq->parallel_tool_calls, &ke);
        if (!calls) return fail_400(err, "tools", NULL, ke.msg);
        src = calls;
        param = "tools";
    }
    r->grammar = grammar_parse(src, strlen(src), &ke);
    free(calls);
    if (!r->grammar) return fail_400(err, param, NULL, ke.msg);
    if (!(r->gm = gmatch_create(r->grammar, s->gvocab, &ke))) return fail_oom(err);
    if (gmatch_start(r->gm) < 0)
        return fail_400(err, param, NULL, "the grammar is too complex to match");
    /* Forced tokens have no sampled logprobs: jump-forward only without them. */
    r->jump_forward = rq->jump_forward && !rq->logprobs;
    return 0;
}

/* Sets up r, which holds prompt p, from rq's sampling and output options. -1 with err. */
static int request_setup(const server *s, gen_request *r, const api_request *rq, int max_tokens,
                         uint64_t seed, api_error *err) {
    r->max_tokens = max_tokens;
    r->sp = rq->sampling;
    r->sp.seed = seed;
    r->sp.bias = NULL;
    r->logprobs = rq->logprobs;
    r->top_logprobs = rq->top_logprobs;
    r->ignore_eos = rq->ignore_eos;
    r->speculative = rq->speculative;
    if (rq->prediction && rq->speculative) {
        /* drafted where the output matches it: the tokens the answer would have as plain text */
        kv_error ke = {{0}};
        size_t len = strlen(rq->prediction);
        if (server_check_text(s, len, "prediction.content", err)) return -1;
        int n = tokenizer_encode(s->m->tok, rq->prediction, len, false, false, &r->prediction, &ke);
        if (n < 0) return fail_400(err, "prediction.content", NULL, ke.msg);
        r->n_prediction = n;
    }
    /* Blend: a request naming "blend": true, a ratio or a policy blends; one that says nothing
     * blends where the quality budget lets it (cache/quality.h); both keep their chunks for
     * later prompts unless they say "blend": false. */
    bool asks = rq->blend == 1 || rq->blend_ratio >= 0 || rq->blend_policy >= 0;
    r->plan.blend = rq->blend == 0                                            ? PLAN_BLEND_OFF
                    : asks || s->reuse.choice.blend || !s->reuse.choice.gated ? PLAN_BLEND_ON
                                                                              : PLAN_BLEND_STORE;
    r->plan.blend_ratio = rq->blend_ratio;
    r->plan.blend_policy = rq->blend_policy;
    r->plan.kv_level = rq->kv_level;
    r->plan.kv_lossless = rq->kv_lossless;
    r->plan.ttft_budget_ms = rq->ttft_budget_ms;
    r->prompt_logprobs = rq->kind == API_COMPLETION && rq->echo && rq->logprobs;
    r->t_arrival = clock_now_ns();
    if (rq->sampling.n_bias > 0) {
        if (!(r->bias = malloc(sizeof *r->bias * (size_t)rq->sampling.n_bias)))
            return fail_oom(err);
        memcpy(r->bias, rq->sampling.bias, sizeof *r->bias * (size_t)rq->sampling.n_bias);
        r->sp.bias = r->bias;
    }
    kv_error ke = {{0}};
    if (stop_set_init(&r->stops, (const char *const *)rq->stops, rq->n_stops, &ke))
        return fail_400(err, "stop", NULL, ke.msg);
    bool tools = rq->kind == API_CHAT && rq->tool_choice != CHAT_TOOL_NONE;
    /* a call repeating one the answer already made ends the turn instead (chat_tool_guard) */
    r->guard_calls = tools;
    r->call_format = s->m->chat.tools;
    return rq->gbnf || tools ? request_grammar(s, r, rq, err) : 0;
}

/* A schema_prompt (Prompt Cache) as the prompt: its tokens in slot order with their positions
 * and the module KV to import, or (cache false) the same text as a plain prompt in position
 * order, computed in full. *span is the positions it takes (the context check's length). */
static int schema_prompt_tokens(server *s, const api_request *rq, const http_call *c, int32_t **ids,
                                int32_t **pos, schema_kv **skv, int *span, api_error *err) {
    schema_prompt sp;
    if (schemas_prompt(s, rq, c, &sp, err)) return -1;
    int n = sp.n;
    if (rq->cache && sp.kv) {
        *ids = sp.tokens;
        *pos = sp.pos;
        *skv = sp.kv;
        *span = sp.last_pos + 1;
        sp.tokens = sp.pos = NULL;
        sp.kv = NULL;
    } else {
        *ids = sp.flat;
        *span = n;
        sp.flat = NULL;
    }
    schema_prompt_free(&sp);
    return n;
}

/* Tokenizes and checks prompt p and adds its gen_request to j. -1 with err; from the moment
 * the request is in j, job_free frees it, its prompt and its echo text. */
static int job_add_prompt(job *j, const api_request *rq, const http_call *c, int p, uint64_t seed,
                          api_error *err) {
    const model *m = j->s->m;
    int32_t *ids = NULL, *pos = NULL;
    schema_kv *skv = NULL;
    char param[32];
    int span = 0, *bounds = NULL, n_bounds = 0;
    int n_ids;
    if (rq->schema_prompt) {
        snprintf(param, sizeof param, "schema_prompt");
        if (rq->echo && rq->logprobs) {
            fail_400(err, "echo", NULL,
                     "a schema_prompt's modules are not computed, so they cannot be scored: "
                     "'echo' with 'logprobs' is not available");
            return -1;
        }
        n_ids = schema_prompt_tokens(j->s, rq, c, &ids, &pos, &skv, &span, err);
    } else {
        n_ids = prompt_tokens(j->s, rq, p, &ids, &bounds, &n_bounds, param, sizeof param, err);
        span = n_ids;
    }
    if (n_ids < 0) goto fail;
    if (n_ids == 0) {
        fail_400(err, param, NULL, "the prompt is empty (it has no tokens)");
        goto fail;
    }
    int max_tokens = prompt_max_tokens(j->s, rq, span, param, err);
    if (max_tokens < 0) goto fail;
    gen_request *r = gen_request_create(rq->n);
    if (!r) {
        fail_oom(err);
        goto fail;
    }
    j->reqs[j->n_reqs++] = r;
    r->tenant = j->tenant;
    r->prompt = ids;
    r->n_prompt = n_ids;
    r->plan.bounds = bounds;
    r->plan.n_bounds = n_bounds;
    r->pos = pos;
    r->skv = skv;
    if (j->echo) {
        kv_error ke = {{0}};
        size_t len;
        j->echo[p] = !rq->schema_prompt && rq->prompts[p].text
                         ? strdup(rq->prompts[p].text)
                         : tokenizer_decode(m->tok, ids, (size_t)n_ids, false, &len, &ke);
        if (!j->echo[p]) return fail_oom(err);
    }
    if (request_setup(j->s, r, rq, max_tokens, seed, err)) return -1;
    j->prompt_tokens += n_ids;
    return 0;
fail:
    free(ids);
    free(bounds);
    free(pos);
    schema_kv_free(skv);
    return -1;
}

/* The context cache: keys and chunk fetches (disk reads block this thread, not the engine).
 * Every prompt of the request shares its namespace. -1 when out of memory. */
static int job_prepare_cache(job *j, const api_request *rq, const http_call *c, bool fetch) {
    cache_key ns;
    server_cache_namespace(j->s, c, rq->cache_salt, &ns);
    for (int p = 0; p < j->n_reqs; p++)
        if (engine_prepare_cache(j->s->eng, j->reqs[p], &ns, fetch)) return -1;
    return 0;
}

/* The engine changed r (under r->mu): a stream may have output to send; a whole reply waits for
 * the request's last choice. */
static void job_notify(void *arg, const gen_request *r) {
    job *j = arg;
    if (j->streaming || r->n_finished == r->n_choices) j->wake(j->wake_arg);
}

/* The answer to a refused submission. */
int job_submit_fail(engine_submit_status st, const kv_error *ke, api_error *err) {
    if (st == ENGINE_SUBMIT_QUEUE_FULL)
        return api_fail(err, 429, "rate_limit_error", "server_busy", NULL, "%s", ke->msg);
    if (st == ENGINE_SUBMIT_SHUTTING_DOWN || st == ENGINE_SUBMIT_NO_MEMORY)
        return api_fail(err, 503, "server_error", NULL, NULL, "%s", ke->msg);
    return api_fail(err, 400, "invalid_request_error", NULL, NULL, "%s", ke->msg);
}

/* Allocates the stream's cursors and queues the prompts' requests as one group (one place in
 * the queue, fed to the batch as room allows). -1 with err, and nothing queued. */
static int job_submit(job *j, api_error *err) {
    int n_choices = j->n_reqs * j->n;
    j->text_off = calloc((size_t)n_choices, sizeof *j->text_off);
    j->lp_off = calloc((size_t)n_choices, sizeof *j->lp_off);
    j->finish_sent = calloc((size_t)n_choices, sizeof *j->finish_sent);
    if (!j->text_off || !j->lp_off || !j->finish_sent) return fail_oom(err);
    if (j->tools && (!(j->tp = calloc((size_t)n_choices, sizeof *j->tp)) ||
                     !(j->acc = calloc((size_t)n_choices, sizeof *j->acc)) ||
                     !(j->acc_len = calloc((size_t)n_choices, sizeof *j->acc_len))))
        return fail_oom(err);
    for (int i = 0; j->tp && i < n_choices; i++)
        chat_tool_parser_init(&j->tp[i], j->s->m->chat.tools);
    for (int p = 0; p < j->n_reqs && j->wake; p++) gen_request_watch(j->reqs[p], job_notify, j);
    kv_error ke = {{0}};
    engine_submit_status st = engine_submit_group(j->s->eng, j->reqs, j->n_reqs, &ke);
    return st == ENGINE_SUBMIT_OK ? 0 : job_submit_fail(st, &ke, err);
}

/* Builds one gen_request per prompt and submits them as one group. On failure nothing stays
 * queued. */
job *job_start(server *s, const api_request *rq, const http_call *c, bool submit, api_error *err) {
    if (!job_model_accepted(s, rq->model)) {
        job_model_not_found(s, rq->model, "model", err);
        return NULL;
    }
    int n_prompts = rq->kind == API_CHAT || rq->schema_prompt ? 1 : rq->n_prompts;
    job_random rnd;
    if (job_random_draw(&rnd, err)) return NULL;
    job *j = job_create(s, rq, c, n_prompts, &rnd);
    if (!j) {
        fail_oom(err);
        return NULL;
    }
    uint64_t seed = rq->seed_given ? rq->sampling.seed : rnd.seed;
    for (int p = 0; p < n_prompts; p++)
        if (job_add_prompt(j, rq, c, p, seed, err)) goto fail;
    if (rq->cache && s->cfg->cache && job_prepare_cache(j, rq, c, submit)) {
        fail_oom(err);
        goto fail;
    }
    if (submit && job_submit(j, err)) goto fail;
    return j;
fail:
    job_free(j);
    return NULL;
}

/* ---------------------------------------------------------------- JSON of the output */

size_t job_echo_len(const job *j, int prompt) { return j->echo ? strlen(j->echo[prompt]) : 0; }

const char *job_finish_name(gen_finish f) {
    return f == GEN_FINISH_LENGTH ? "length" : f == GEN_FINISH_STOP ? "stop" : NULL;
}

/* kvserve's extension: the chunks of the prompts found in the store's tiers, in order, each with
 * its tokens, tier and the encoding it came in ("text": Redis held it, and the fetch computed it
 * instead); NULL when there were none. */
static json_t *fetched_json(const job *j) {
    static const char *const tiers[] = {"ram", "disk", "redis"};
    json_t *a = NULL;
    for (int p = 0; p < j->n_reqs; p++)
        for (int i = 0; i < j->reqs[p]->plan.n_fetched; i++) {
            const plan_fetched *f = &j->reqs[p]->plan.fetched[i];
            char enc[16];
            cache_enc_name(f->enc, enc);
            if (!a && !(a = json_array())) return NULL;
            json_array_append_new(a, json_pack("{s:i,s:s,s:s}", "tokens", f->tokens, "tier",
                                               tiers[f->tier], "level", enc));
        }
    return a;
}

json_t *job_usage(const job *j) {
    int completion = 0;
    for (int p = 0; p < j->n_reqs; p++)
        for (int i = 0; i < j->reqs[p]->n_choices; i++)
            completion += j->reqs[p]->choices[i].n_tokens;
    int cached = 0, blended = 0, recomputed = 0, drafted = 0, accepted = 0, pred_acc = 0,
        pred_rej = 0;
    float ratio = -1;
    int policy = BLEND_POLICY_HKVD;
    for (int p = 0; p < j->n_reqs; p++) {
        gen_request *r = j->reqs[p];
        pthread_mutex_lock(&r->mu);
        cached += r->cached_tokens;
        blended += r->blended_tokens;
        recomputed += r->recomputed_tokens;
        if (r->blended_tokens > 0 && r->blend_ratio_used > ratio) ratio = r->blend_ratio_used;
        if (r->blended_tokens > 0) policy = r->blend_policy_used;
        drafted += r->spec_drafted;
        accepted += r->spec_accepted;
        pred_acc += r->pred_accepted;
        pred_rej += r->pred_rejected;
        pthread_mutex_unlock(&r->mu);
    }
    json_t *details = json_pack("{s:i}", "cached_tokens", cached);
    /* kvserve's extension: what blend reused by content, recomputed, and the ratio it ran at */
    if (blended > 0) {
        json_object_set_new(details, "blended_tokens", json_integer(blended));
        json_object_set_new(details, "recomputed_tokens", json_integer(recomputed));
        json_object_set_new(details, "blend_ratio", json_real(ratio));
        json_object_set_new(details, "blend_policy",
                            json_string(blend_policy_name((blend_policy)policy)));
    }
    json_t *u = json_pack("{s:i,s:i,s:i,s:o}", "prompt_tokens", j->prompt_tokens,
                          "completion_tokens", completion, "total_tokens",
                          j->prompt_tokens + completion, "prompt_tokens_details", details);
    /* Predicted Outputs: the prediction's draft tokens the model kept and those it did not
     * (verified, so computed, but not in the answer); kvserve's extension: every draft token
     * speculation verified (the prediction's and the context's) and kept */
    json_t *cd = json_pack("{s:i,s:i,s:i}", "reasoning_tokens", 0, "accepted_prediction_tokens",
                           pred_acc, "rejected_prediction_tokens", pred_rej);
    if (cd && drafted > 0) {
        json_object_set_new(cd, "draft_tokens", json_integer(drafted));
        json_object_set_new(cd, "accepted_draft_tokens", json_integer(accepted));
    }
    if (u && cd) json_object_set_new(u, "completion_tokens_details", cd);
    json_t *chunks = fetched_json(j);
    if (u && chunks) json_object_set_new(u, "kv_chunks", chunks);
    return u;
}

static json_t *token_json(const tokenizer *t, int32_t id, float lp, bool with_bytes) {
    size_t len = 0;
    char *text = tokenizer_piece_utf8(t, id, true, &len);
    json_t *o = json_object();
    json_object_set_new(o, "token", text ? json_stringn(text, len) : json_string(""));
    json_object_set_new(o, "logprob", json_real(lp));
    if (with_bytes) {
        char raw[256];
        int n = tokenizer_token_bytes(t, id, true, raw, sizeof raw);
        json_t *bytes = json_array();
        for (int i = 0; i < n && i < (int)sizeof raw; i++)
            json_array_append_new(bytes, json_integer((uint8_t)raw[i]));
        json_object_set_new(o, "bytes", bytes);
    }
    free(text);
    return o;
}

json_t *job_logprobs_json(const job *j, const gen_logprob *lps, int n, size_t text_base) {
    const tokenizer *t = j->s->m->tok;
    if (j->kind == API_CHAT) {
        json_t *content = json_array();
        for (int i = 0; i < n; i++) {
            json_t *o = token_json(t, lps[i].token, lps[i].logprob, true);
            json_t *top = json_array();
            for (int k = 0; k < lps[i].n_top; k++)
                json_array_append_new(top,
                                      token_json(t, lps[i].top_ids[k], lps[i].top_lps[k], true));
            json_object_set_new(o, "top_logprobs", top);
            json_array_append_new(content, o);
        }
        return json_pack("{s:o}", "content", content);
    }
    /* completions: parallel arrays, top alternatives as {token: logprob} objects */
    json_t *tokens = json_array(), *lp = json_array(), *top = json_array(), *off = json_array();
    size_t pos = text_base;
    for (int i = 0; i < n; i++) {
        json_t *o = token_json(t, lps[i].token, lps[i].logprob, false);
        const char *piece = json_string_value(json_object_get(o, "token"));
        json_array_append(tokens, json_object_get(o, "token"));
        json_array_append_new(lp, json_real(lps[i].logprob));
        json_array_append_new(off, json_integer((json_int_t)pos));
        pos += piece ? strlen(piece) : 0;
        json_decref(o);
        json_t *alts = json_object();
        for (int k = 0; k < lps[i].n_top; k++) {
            size_t len;
            char *txt = tokenizer_piece_utf8(t, lps[i].top_ids[k], true, &len);
            if (txt) json_object_set_new(alts, txt, json_real(lps[i].top_lps[k]));
            free(txt);
        }
        json_array_append_new(top, alts);
    }
    return json_pack("{s:o,s:o,s:o,s:o}", "tokens", tokens, "token_logprobs", lp, "top_logprobs",
                     top, "text_offset", off);
}

json_t *job_prompt_logprobs_json(const job *j, int prompt) {
    const gen_request *r = j->reqs[prompt];
    const tokenizer *t = j->s->m->tok;
    json_t *tokens = json_array(), *lp = json_array(), *top = json_array(), *off = json_array();
    size_t pos = 0;
    for (int i = 0; i < r->n_prompt; i++) {
        size_t len = 0;
        char *txt = tokenizer_piece_utf8(t, r->prompt[i], true, &len);
        json_array_append_new(tokens, txt ? json_stringn(txt, len) : json_string(""));
        json_array_append_new(off, json_integer((json_int_t)pos));
        pos += len;
        free(txt);
        /* the first token has no context to be scored in: null, as OpenAI gives it */
        const gen_logprob *g = i > 0 ? &r->prompt_lps[i] : NULL;
        json_array_append_new(lp, g ? json_real(g->logprob) : json_null());
        if (!g) {
            json_array_append_new(top, json_null());
            continue;
        }
        json_t *alts = json_object();
        for (int k = 0; k < g->n_top; k++) {
            char *a = tokenizer_piece_utf8(t, g->top_ids[k], true, &len);
            if (a) json_object_set_new(alts, a, json_real(g->top_lps[k]));
            free(a);
        }
        json_array_append_new(top, alts);
    }
    return json_pack("{s:o,s:o,s:o,s:o}", "tokens", tokens, "token_logprobs", lp, "top_logprobs",
                     top, "text_offset", off);
}

json_t *job_choice_logprobs_json(const job *j, int prompt, const gen_logprob *lps, int n) {
    json_t *v = job_logprobs_json(j, lps, n, job_echo_len(j, prompt));
    if (!j->reqs[prompt]->prompt_logprobs) return v;
    /* echo: the prompt's tokens come first */
    json_t *all = job_prompt_logprobs_json(j, prompt);
    const char *keys[] = {"tokens", "token_logprobs", "top_logprobs", "text_offset"};
    for (int k = 0; k < 4; k++)
        json_array_extend(json_object_get(all, keys[k]), json_object_get(v, keys[k]));
    json_decref(v);
    return all;
}

void job_call_id(const job *j, int choice, int call, char *out, size_t cap) {
    snprintf(out, cap, "call_%08x%02x%02x", (unsigned)j->call_salt, (unsigned)choice & 0xff,
             (unsigned)call & 0xff);
}

/* A chat answer under tools: its calls (finish "tool_calls") when it is complete calls; the
 * calls so far when max_tokens cut it inside them (finish "length", the last call's arguments
 * cut short), as the streamed form has sent them; else its text as content. Legacy functions
 * get the call as function_call (finish "function_call"), as OpenAI answers them. */
json_t *job_message_json(const job *j, int index, const gen_choice *c, const char **finish) {
    const char *text = c->text ? c->text : "";
    chat_tool_parser tp;
    chat_tool_parser_init(&tp, j->s->m->chat.tools);
    chat_tool_event ev[16];
    json_t *calls = json_array();
    json_t *cur = NULL;
    int n;
    bool content = false;
    do {
        /* a cut answer's unfinished syntax is held back (see stream_tools) */
        n = chat_tools_parse(&tp, text, c->len, c->finish != GEN_FINISH_LENGTH, ev, 16);
        for (int k = 0; k < n; k++) {
            if (ev[k].kind == CHAT_TOOL_EVENT_CONTENT) {
                content = true;
            } else if (ev[k].kind == CHAT_TOOL_EVENT_CALL) {
                char id[48];
                job_call_id(j, index, ev[k].index, id, sizeof id);
                cur = json_pack("{s:s,s:s,s:{s:s%,s:s}}", "id", id, "type", "function", "function",
                                "name", ev[k].s, ev[k].n, "arguments", "");
                json_array_append_new(calls, cur);
            } else if (cur) {
                json_t *fn = json_object_get(cur, "function");
                const char *a = json_string_value(json_object_get(fn, "arguments"));
                size_t la = strlen(a);
                char *both = malloc(la + ev[k].n + 1);
                if (both) {
                    memcpy(both, a, la);
                    memcpy(both + la, ev[k].s, ev[k].n);
                    json_object_set_new(fn, "arguments", json_stringn(both, la + ev[k].n));
                    free(both);
                }
            }
        }
    } while (n == 16);
    bool done = tp.complete && c->finish == GEN_FINISH_STOP;
    if (!content && tp.mode == 2 && json_array_size(calls) > 0 &&
        (done || c->finish == GEN_FINISH_LENGTH)) {
        if (done) *finish = j->legacy ? "function_call" : "tool_calls";
        if (!j->legacy)
            return json_pack("{s:s,s:n,s:o}", "role", "assistant", "content", "tool_calls", calls);
        /* legacy functions: the one call, without its id and type */
        json_t *fn = json_incref(json_object_get(json_array_get(calls, 0), "function"));
        json_decref(calls);
        return json_pack("{s:s,s:n,s:o}", "role", "assistant", "content", "function_call", fn);
    }
    json_decref(calls);
    return json_pack("{s:s,s:s%}", "role", "assistant", "content", text, c->len);
}

/* The first error among the choices, or 0. */
int job_error(const job *j, api_error *err) {
    for (int p = 0; p < j->n_reqs; p++) {
        gen_request *r = j->reqs[p];
        if (r->error_status)
            return api_fail(err, r->error_status, "server_error", NULL, NULL, "%s", r->error);
    }
    return 0;
}

bool job_finished(job *j) {
    bool done = true;
    for (int p = 0; p < j->n_reqs && done; p++) {
        gen_request *r = j->reqs[p];
        pthread_mutex_lock(&r->mu);
        done = r->n_finished == r->n_choices;
        pthread_mutex_unlock(&r->mu);
    }
    return done;
}

int job_wait(job *j, api_error *err) {
    /* A client that hangs up cancels the work at once (job_free). */
    for (int p = 0; p < j->n_reqs; p++) {
        gen_request *r = j->reqs[p];
        pthread_mutex_lock(&r->mu);
        while (r->n_finished < r->n_choices) {
            gen_request_wait(r, 100);
            if (r->n_finished < r->n_choices && http_client_gone(j->fd)) {
                pthread_mutex_unlock(&r->mu);
                return api_fail(err, 499, "invalid_request_error", NULL, NULL,
                                "the client closed the connection");
            }
        }
        pthread_mutex_unlock(&r->mu);
    }
    return 0;
}
