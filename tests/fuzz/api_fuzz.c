/* libFuzzer target for the OpenAI request parser: the same bytes go to api_parse_request (chat
 * and completions), api_parse_tokenize and api_parse_detokenize. On success every string and
 * array the parse handed out is read end to end, so ASan checks each one; on failure the error
 * must carry a 4xx/5xx status and a message, and api_error_json must give valid JSON.
 * Seeds: tests/fuzz/corpus/api_fuzz/ (a chat request, a completions request, tokenize bodies). */
#include <jansson.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/api/api.h"
#include "tests/fuzz/api_checks.h"

static uint64_t use_request(const api_request *r) {
    uint64_t sink = use_str(r->model);
    if (r->kind == API_CHAT) {
        sink += use_messages(r->messages, r->n_messages);
        CHECK(r->prompts == NULL);
    } else {
        CHECK(r->n_prompts >= 1 && r->n_prompts <= API_MAX_PROMPTS && r->messages == NULL);
        for (int i = 0; i < r->n_prompts; i++) {
            const api_prompt *p = &r->prompts[i];
            CHECK((p->text == NULL) != (p->tokens == NULL));
            if (p->text) sink += use_str(p->text);
            CHECK(p->tokens == NULL || p->n_tokens >= 1);
            for (int j = 0; j < p->n_tokens; j++) {
                CHECK(p->tokens[j] >= 0);
                sink += (uint64_t)p->tokens[j];
            }
        }
    }
    CHECK(r->n >= 1 && r->n <= API_MAX_N);
    CHECK(r->max_tokens == -1 || r->max_tokens >= 1);
    CHECK(r->top_logprobs >= 0 && r->top_logprobs <= API_MAX_TOP_LOGPROBS);
    CHECK(!r->include_usage || r->stream);
    const sampler_params *s = &r->sampling;
    CHECK(s->temperature >= 0 && s->temperature <= 2 && s->top_p >= 0 && s->top_p <= 1);
    CHECK(s->top_k >= 0 && s->min_p >= 0 && s->min_p <= 1 && s->repeat_penalty > 0);
    CHECK(s->n_bias >= 0 && s->n_bias <= API_MAX_LOGIT_BIAS && s->bias == r->bias);
    for (int i = 0; i < s->n_bias; i++) {
        CHECK(r->bias[i].token >= 0 && r->bias[i].bias >= -100 && r->bias[i].bias <= 100);
        sink += (uint64_t)r->bias[i].token;
    }
    CHECK(r->n_stops >= 0 && r->n_stops <= API_MAX_STOPS);
    for (int i = 0; i < r->n_stops; i++) CHECK(use_str(r->stops[i]) > 0);
    if (r->user) sink += use_str(r->user);
    if (r->cache_salt) sink += use_str(r->cache_salt);
    if (r->prediction) sink += use_str(r->prediction);
    return sink;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *body = (const char *)data;
    volatile uint64_t sink = 0;
    api_error err;

    const api_kind kinds[] = {API_CHAT, API_COMPLETION};
    for (int k = 0; k < 2; k++) {
        api_request r;
        if (api_parse_request(kinds[k], body, size, &r, &err) == 0) {
            CHECK(r.kind == kinds[k]);
            sink += use_request(&r);
        } else {
            check_error(&err);
            CHECK(r.model == NULL && r.messages == NULL && r.prompts == NULL);
        }
        api_request_free(&r);
    }

    api_tokenize t;
    if (api_parse_tokenize(body, size, &t, &err) == 0) {
        CHECK((t.text == NULL) != (t.messages == NULL));
        if (t.text)
            sink += use_str(t.text);
        else
            sink += use_messages(t.messages, t.n_messages);
    } else {
        check_error(&err);
    }
    api_tokenize_free(&t);

    int32_t *tokens;
    int n_tokens;
    if (api_parse_detokenize(body, size, &tokens, &n_tokens, &err) == 0) {
        CHECK(n_tokens >= 0 && n_tokens <= API_MAX_TOKENS);
        for (int i = 0; i < n_tokens; i++) {
            CHECK(tokens[i] >= 0);
            sink += (uint64_t)tokens[i];
        }
        free(tokens);
    } else {
        check_error(&err);
        CHECK(tokens == NULL && n_tokens == 0);
    }
    (void)sink;
    return 0;
}
