/* OpenAI request parser tests: every field of a valid request read back, each prompt and content
 * shape, the defaults, and every failure class (malformed JSON, wrong types, ranges, missing and
 * unsupported fields, bad encodings) with its status, parameter and message. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/cache.h"
#include "server/api/api.h"

/* ---------------------------------------------------------------- helpers */

static void parse_ok(api_kind kind, const char *body, api_request *r) {
    api_error err = {0};
    int rc = api_parse_request(kind, body, strlen(body), r, &err);
    cr_assert_eq(rc, 0, "parse failed: %s (param '%s') for %s", err.message, err.param, body);
}

/* Parses body (len bytes, so it may hold NULs), expects a failure with this status, param and a
 * message containing msg; checks the request was left freeable. */
static void fail_n(api_kind kind, const char *body, size_t len, int status, const char *param,
                   const char *msg) {
    api_request r;
    api_error err = {0};
    int rc = api_parse_request(kind, body, len, &r, &err);
    cr_assert_eq(rc, -1, "parse succeeded for %s", body);
    cr_assert_eq(err.status, status, "status %d for %s (%s)", err.status, body, err.message);
    cr_assert_str_eq(err.type, status == 400 ? "invalid_request_error" : "server_error");
    cr_assert_str_eq(err.param, param, "param '%s' for %s (%s)", err.param, body, err.message);
    cr_assert_not_null(strstr(err.message, msg), "message '%s' lacks '%s' for %s", err.message, msg,
                       body);
    api_request_free(&r); /* must be safe (and a no-op) after a failed parse */
}

static void fail(api_kind kind, const char *body, const char *param, const char *msg) {
    fail_n(kind, body, strlen(body), 400, param, msg);
}

/* A chat body with one user message and extra fields spliced in (",\"x\":1" or ""). */
static char *chat_with(const char *extra) {
    static char buf[4096];
    snprintf(buf, sizeof buf,
             "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]%s}", extra);
    return buf;
}

static char *completion_with(const char *extra) {
    static char buf[4096];
    snprintf(buf, sizeof buf, "{\"model\":\"m\",\"prompt\":\"hi\"%s}", extra);
    return buf;
}

/* ---------------------------------------------------------------- valid requests */

Test(api, chat_every_field) {
    const char *body =
        "{\"model\":\"smol\",\"messages\":["
        "{\"role\":\"system\",\"content\":\"be brief\"},"
        "{\"role\":\"user\",\"content\":\"hi\",\"name\":\"bob\"},"
        "{\"role\":\"assistant\",\"content\":\"hello\"},"
        "{\"role\":\"developer\",\"content\":\"dev\"}],"
        "\"max_tokens\":50,\"n\":3,\"stream\":true,\"stream_options\":{\"include_usage\":true},"
        "\"logprobs\":true,\"top_logprobs\":5,\"temperature\":0.7,\"top_p\":0.9,\"top_k\":40,"
        "\"min_p\":0.05,\"presence_penalty\":0.5,\"frequency_penalty\":-0.5,"
        "\"repetition_penalty\":1.1,\"seed\":-1,\"logit_bias\":{\"42\":-100,\"7\":2.5},"
        "\"stop\":[\"\\n\\n\",\"END\"],\"user\":\"u-1\",\"cache\":false,\"cache_salt\":\"salt\","
        "\"ignore_eos\":true,\"unknown_field\":{\"ignored\":[1,2]}}";
    api_request r;
    parse_ok(API_CHAT, body, &r);
    cr_assert_eq(r.kind, API_CHAT);
    cr_assert_str_eq(r.model, "smol");
    cr_assert_eq(r.n_messages, 4);
    const char *roles[] = {"system", "user", "assistant", "system"};
    const char *contents[] = {"be brief", "hi", "hello", "dev"};
    for (int i = 0; i < 4; i++) {
        cr_assert_str_eq(r.messages[i].role, roles[i]);
        cr_assert_str_eq(r.messages[i].content, contents[i]);
    }
    cr_assert_null(r.prompts);
    cr_assert_eq(r.max_tokens, 50);
    cr_assert_eq(r.n, 3);
    cr_assert(r.stream);
    cr_assert(r.include_usage);
    cr_assert(r.logprobs);
    cr_assert_eq(r.top_logprobs, 5);
    cr_assert_float_eq(r.sampling.temperature, 0.7f, 1e-6);
    cr_assert_float_eq(r.sampling.top_p, 0.9f, 1e-6);
    cr_assert_eq(r.sampling.top_k, 40);
    cr_assert_float_eq(r.sampling.min_p, 0.05f, 1e-6);
    cr_assert_float_eq(r.sampling.presence_penalty, 0.5f, 1e-6);
    cr_assert_float_eq(r.sampling.frequency_penalty, -0.5f, 1e-6);
    cr_assert_float_eq(r.sampling.repeat_penalty, 1.1f, 1e-6);
    cr_assert(r.seed_given);
    cr_assert_eq(r.sampling.seed, UINT64_MAX); /* -1 cast */
    cr_assert_eq(r.sampling.n_bias, 2);
    cr_assert_eq(r.sampling.bias, r.bias);
    cr_assert_eq(r.bias[0].token, 42);
    cr_assert_float_eq(r.bias[0].bias, -100.0f, 0);
    cr_assert_eq(r.bias[1].token, 7);
    cr_assert_float_eq(r.bias[1].bias, 2.5f, 0);
    cr_assert_eq(r.n_stops, 2);
    cr_assert_str_eq(r.stops[0], "\n\n");
    cr_assert_str_eq(r.stops[1], "END");
    cr_assert_str_eq(r.user, "u-1");
    cr_assert_not(r.cache);
    cr_assert_str_eq(r.cache_salt, "salt");
    cr_assert(r.ignore_eos);
    api_request_free(&r);
    cr_assert_null(r.model);
}

Test(api, chat_defaults) {
    api_request r;
    parse_ok(API_CHAT, chat_with(""), &r);
    sampler_params d;
    sampler_params_default(&d);
    cr_assert_eq(r.max_tokens, -1);
    cr_assert_eq(r.n, 1);
    cr_assert_not(r.stream);
    cr_assert_not(r.include_usage);
    cr_assert_not(r.logprobs);
    cr_assert_eq(r.top_logprobs, 0);
    cr_assert_float_eq(r.sampling.temperature, 1.0f, 0);
    cr_assert_eq(memcmp(&r.sampling, &d, sizeof d), 0);
    cr_assert_not(r.seed_given);
    cr_assert_eq(r.sampling.seed, 0);
    cr_assert_null(r.bias);
    cr_assert_eq(r.n_stops, 0);
    cr_assert_null(r.stops[0]);
    cr_assert_null(r.user);
    cr_assert(r.cache);
    cr_assert_null(r.cache_salt);
    cr_assert_not(r.ignore_eos);
    cr_assert_not(r.echo);
    api_request_free(&r);
}

Test(api, null_means_not_given) {
    api_request r;
    parse_ok(API_CHAT,
             chat_with(",\"max_tokens\":null,\"temperature\":null,\"stop\":null,\"seed\":null,"
                       "\"logit_bias\":null,\"n\":null,\"stream\":null,\"user\":null,"
                       "\"stream_options\":null,\"top_logprobs\":null,\"logprobs\":null"),
             &r);
    cr_assert_eq(r.max_tokens, -1);
    cr_assert_float_eq(r.sampling.temperature, 1.0f, 0);
    cr_assert_eq(r.n_stops, 0);
    cr_assert_not(r.seed_given);
    cr_assert_eq(r.n, 1);
    cr_assert_null(r.user);
    api_request_free(&r);
}

Test(api, content_parts_joined) {
    api_request r;
    parse_ok(API_CHAT,
             "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":["
             "{\"type\":\"text\",\"text\":\"Hello, \"},{\"type\":\"text\",\"text\":\"\"},"
             "{\"type\":\"text\",\"text\":\"w\\u00f6rld\"}]},"
             "{\"role\":\"assistant\",\"content\":[]},"
             "{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[]},"
             "{\"role\":\"assistant\"}]}",
             &r);
    cr_assert_eq(r.n_messages, 4);
    cr_assert_str_eq(r.messages[0].content, "Hello, w\xc3\xb6rld");
    for (int i = 1; i < 4; i++) {
        cr_assert_str_eq(r.messages[i].role, "assistant");
        cr_assert_str_eq(r.messages[i].content, "");
    }
    api_request_free(&r);
}

Test(api, prediction_and_speculative) {
    api_request r;
    parse_ok(API_CHAT, chat_with(""), &r);
    cr_assert(r.speculative);
    cr_assert_null(r.prediction);
    api_request_free(&r);
    parse_ok(API_CHAT,
             chat_with(",\"speculative\":false,\"prediction\":{\"type\":\"content\","
                       "\"content\":[{\"type\":\"text\",\"text\":\"def f\"},"
                       "{\"type\":\"text\",\"text\":\"(x):\"}]}"),
             &r);
    cr_assert(!r.speculative);
    cr_assert_str_eq(r.prediction, "def f(x):");
    api_request_free(&r);
    parse_ok(API_COMPLETION,
             completion_with(",\"prediction\":{\"type\":\"content\",\"content\":\"x = 1\"}"), &r);
    cr_assert_str_eq(r.prediction, "x = 1");
    api_request_free(&r);
    parse_ok(API_CHAT, chat_with(",\"prediction\":null"), &r);
    cr_assert_null(r.prediction);
    api_request_free(&r);
}

Test(api, completion_prompt_string) {
    api_request r;
    parse_ok(API_COMPLETION, completion_with(",\"echo\":true,\"logprobs\":3"), &r);
    cr_assert_eq(r.kind, API_COMPLETION);
    cr_assert_null(r.messages);
    cr_assert_eq(r.n_prompts, 1);
    cr_assert_str_eq(r.prompts[0].text, "hi");
    cr_assert_null(r.prompts[0].tokens);
    cr_assert(r.echo);
    cr_assert(r.logprobs);
    cr_assert_eq(r.top_logprobs, 3);
    api_request_free(&r);
}

Test(api, completion_prompt_strings) {
    api_request r;
    parse_ok(API_COMPLETION, "{\"model\":\"m\",\"prompt\":[\"a\",\"\",\"c\"],\"logprobs\":0}", &r);
    cr_assert_eq(r.n_prompts, 3);
    cr_assert_str_eq(r.prompts[0].text, "a");
    cr_assert_str_eq(r.prompts[1].text, ""); /* allowed, as OpenAI; the caller sees 0 tokens */
    cr_assert_str_eq(r.prompts[2].text, "c");
    cr_assert(r.logprobs);
    cr_assert_eq(r.top_logprobs, 0);
    cr_assert_not(r.echo);
    api_request_free(&r);
}

Test(api, completion_prompt_tokens) {
    api_request r;
    parse_ok(API_COMPLETION, "{\"model\":\"m\",\"prompt\":[1,0,2147483647,5.0]}", &r);
    cr_assert_eq(r.n_prompts, 1);
    cr_assert_null(r.prompts[0].text);
    cr_assert_eq(r.prompts[0].n_tokens, 4);
    int32_t want[] = {1, 0, INT32_MAX, 5};
    for (int i = 0; i < 4; i++) cr_assert_eq(r.prompts[0].tokens[i], want[i]);
    api_request_free(&r);
}

Test(api, completion_prompt_token_arrays) {
    api_request r;
    parse_ok(API_COMPLETION, "{\"model\":\"m\",\"prompt\":[[1,2,3],[4]],\"n\":2}", &r);
    cr_assert_eq(r.n_prompts, 2);
    cr_assert_eq(r.n, 2);
    cr_assert_eq(r.prompts[0].n_tokens, 3);
    cr_assert_eq(r.prompts[0].tokens[2], 3);
    cr_assert_eq(r.prompts[1].n_tokens, 1);
    cr_assert_eq(r.prompts[1].tokens[0], 4);
    api_request_free(&r);
}

Test(api, max_completion_tokens_wins) {
    api_request r;
    parse_ok(API_CHAT, chat_with(",\"max_completion_tokens\":7,\"max_tokens\":100"), &r);
    cr_assert_eq(r.max_tokens, 7);
    api_request_free(&r);
    parse_ok(API_CHAT, chat_with(",\"max_tokens\":100,\"max_completion_tokens\":null"), &r);
    cr_assert_eq(r.max_tokens, 100);
    api_request_free(&r);
}

Test(api, max_tokens_zero_only_with_echo) {
    api_request r;
    parse_ok(API_COMPLETION, completion_with(",\"echo\":true,\"max_tokens\":0"), &r);
    cr_assert_eq(r.max_tokens, 0);
    cr_assert(r.echo);
    api_request_free(&r);
    fail(API_COMPLETION, completion_with(",\"max_tokens\":0"), "max_tokens", "at least 1");
    fail(API_COMPLETION, completion_with(",\"echo\":true,\"max_tokens\":-1"), "max_tokens",
         "at least 0");
}

Test(api, top_k_minus_one_is_off) {
    api_request r;
    parse_ok(API_CHAT, chat_with(",\"top_k\":-1"), &r);
    cr_assert_eq(r.sampling.top_k, 0);
    api_request_free(&r);
    parse_ok(API_CHAT, chat_with(",\"top_k\":0,\"temperature\":0,\"top_p\":0,\"n\":2.0"), &r);
    cr_assert_eq(r.sampling.top_k, 0);
    cr_assert_float_eq(r.sampling.temperature, 0.0f, 0);
    cr_assert_float_eq(r.sampling.top_p, 0.0f, 0);
    cr_assert_eq(r.n, 2); /* an integral float is an integer, as pydantic's lax mode */
    api_request_free(&r);
}

Test(api, stop_string_and_stream_options_without_stream) {
    api_request r;
    parse_ok(API_CHAT, chat_with(",\"stop\":\"###\",\"stream_options\":{\"include_usage\":true}"),
             &r);
    cr_assert_eq(r.n_stops, 1);
    cr_assert_str_eq(r.stops[0], "###");
    cr_assert_not(r.stream);
    cr_assert_not(r.include_usage); /* meaningless without stream: accepted and ignored */
    api_request_free(&r);
    parse_ok(API_CHAT, chat_with(",\"stop\":[],\"logit_bias\":{}"), &r);
    cr_assert_eq(r.n_stops, 0);
    cr_assert_null(r.bias);
    cr_assert_eq(r.sampling.n_bias, 0);
    api_request_free(&r);
}

Test(api, free_is_safe_on_zeroed_and_twice) {
    api_request r;
    memset(&r, 0, sizeof r);
    api_request_free(&r);
    api_request_free(NULL);
    parse_ok(API_CHAT, chat_with(",\"stop\":[\"a\",\"b\"]"), &r);
    api_request_free(&r);
    api_request_free(&r);
    api_tokenize t;
    memset(&t, 0, sizeof t);
    api_tokenize_free(&t);
}

/* ---------------------------------------------------------------- malformed bodies */

Test(api, malformed_json) {
    fail(API_CHAT, "{\"model\": \"m\",,}", "", "malformed JSON at line 1, column");
    fail(API_CHAT, "{\"model\": nope}", "", "invalid token");
    fail(API_CHAT, "", "", "the request body is empty");
    fail_n(API_COMPLETION, NULL, 0, 400, "", "the request body is empty");
    fail(API_CHAT, " \n", "", "malformed JSON at line 2");
    fail(API_CHAT, "{} trailing", "", "end of file expected");
    fail(API_CHAT, "{\"model\":\"a\",\"model\":\"b\"}", "", "duplicate object key");
    fail(API_CHAT, "{\"seed\":99999999999999999999}", "", "too big integer");
    fail(API_CHAT, "{\"x\":\"\\ud800\"}", "", "invalid Unicode");
}

Test(api, truncated_json) {
    const char *body = chat_with("");
    fail_n(API_CHAT, body, strlen(body) - 1, 400, "", "expected near end of file");
    fail(API_CHAT, "{\"model\":\"m", "", "premature end of input");
    fail_n(API_CHAT, "{", 1, 400, "", "malformed JSON");
}

Test(api, not_an_object) {
    fail(API_CHAT, "[1,2]", "", "must be a JSON object, got an array");
    fail(API_CHAT, "\"hi\"", "", "must be a JSON object, got a string");
    fail(API_COMPLETION, "null", "", "got null");
    fail(API_COMPLETION, "42", "", "got an integer");
}

Test(api, invalid_utf8) {
    fail(API_CHAT, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"a\xff\"}]}", "",
         "invalid UTF-8");
    fail(API_CHAT, "{\"model\":\"\xc3\"}", "", "invalid UTF-8");            /* truncated sequence */
    fail(API_CHAT, "{\"model\":\"\xed\xa0\x80\"}", "", "invalid UTF-8");    /* encoded surrogate */
    fail(API_COMPLETION, "{\"model\":\"\xc0\xaf\"}", "", "byte offset 10"); /* overlong '/' */
}

Test(api, nul_characters) {
    fail(API_CHAT, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"a\\u0000b\"}]}",
         "messages[0].content", "NUL");
    fail(API_CHAT,
         "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\","
         "\"text\":\"\\u0000\"}]}]}",
         "messages[0].content[0].text", "NUL");
    fail(API_CHAT, "{\"model\":\"m\\u0000\"}", "model", "NUL");
    fail(API_CHAT, "{\"a\\u0000\":1}", "", "NUL");
    fail(API_COMPLETION, completion_with(",\"stop\":[\"x\",\"\\u0000\"]"), "stop[1]", "NUL");
    /* a raw NUL byte is not valid JSON at all */
    fail_n(API_CHAT, "{\"model\":\"a\0b\"}", 15, 400, "", "malformed JSON");
}

/* ---------------------------------------------------------------- types */

Test(api, wrong_types_scalars) {
    fail(API_CHAT, chat_with(",\"temperature\":\"hot\""), "temperature",
         "'temperature' must be a number, got a string");
    fail(API_CHAT, chat_with(",\"top_p\":true"), "top_p", "must be a number, got a boolean");
    fail(API_CHAT, chat_with(",\"n\":\"2\""), "n", "'n' must be an integer, got a string");
    fail(API_CHAT, chat_with(",\"n\":1.5"), "n", "must be an integer, got a number");
    fail(API_CHAT, chat_with(",\"max_tokens\":[]"), "max_tokens", "must be an integer");
    fail(API_CHAT, chat_with(",\"seed\":0.5"), "seed", "must be an integer");
    fail(API_CHAT, chat_with(",\"top_k\":{}"), "top_k", "got an object");
    fail(API_CHAT, chat_with(",\"stream\":1"), "stream", "'stream' must be a boolean");
    fail(API_CHAT, chat_with(",\"logprobs\":5"), "logprobs", "must be a boolean");
    fail(API_COMPLETION, completion_with(",\"logprobs\":true"), "logprobs", "must be an integer");
    fail(API_COMPLETION, completion_with(",\"echo\":\"yes\""), "echo", "must be a boolean");
    fail(API_CHAT, chat_with(",\"user\":5"), "user", "'user' must be a string, got an integer");
    fail(API_CHAT, chat_with(",\"cache\":\"no\""), "cache", "must be a boolean");
    fail(API_CHAT, chat_with(",\"cache_salt\":1"), "cache_salt", "must be a string");
    fail(API_CHAT, chat_with(",\"ignore_eos\":\"yes\""), "ignore_eos", "must be a boolean");
    fail(API_CHAT, chat_with(",\"speculative\":1"), "speculative", "must be a boolean");
    fail(API_CHAT, chat_with(",\"prediction\":\"x\""), "prediction", "must be an object");
    fail(API_CHAT, chat_with(",\"prediction\":{\"content\":\"x\"}"), "prediction.type",
         "is required");
    fail(API_CHAT, chat_with(",\"prediction\":{\"type\":\"text\",\"content\":\"x\"}"),
         "prediction.type", "must be 'content'");
    fail(API_CHAT, chat_with(",\"prediction\":{\"type\":\"content\"}"), "prediction.content",
         "is required");
    fail(API_CHAT, chat_with(",\"prediction\":{\"type\":\"content\",\"content\":{}}"),
         "prediction.content", "must be a string or an array of text parts");
    fail(API_CHAT,
         chat_with(",\"prediction\":{\"type\":\"content\",\"content\":[{\"type\":\"image\"}]}"),
         "prediction.content[0]", "must be {\"type\": \"text\"");
    fail(API_CHAT, "{\"model\":3,\"messages\":[]}", "model", "'model' must be a string");
}

Test(api, wrong_types_structures) {
    fail(API_CHAT, chat_with(",\"stop\":5"), "stop", "must be a string or an array of strings");
    fail(API_CHAT, chat_with(",\"stop\":[\"a\",\"b\",3]"), "stop[2]",
         "'stop[2]' must be a string, got an integer");
    fail(API_CHAT, chat_with(",\"logit_bias\":[1]"), "logit_bias", "must be an object");
    fail(API_CHAT, chat_with(",\"logit_bias\":{\"5\":\"x\"}"), "logit_bias",
         "must be numbers, got a string");
    fail(API_CHAT, chat_with(",\"stream\":true,\"stream_options\":true"), "stream_options",
         "must be an object");
    fail(API_CHAT, chat_with(",\"stream\":true,\"stream_options\":{\"include_usage\":1}"),
         "stream_options.include_usage", "must be a boolean");
    fail(API_CHAT, "{\"model\":\"m\",\"messages\":\"hi\"}", "messages",
         "'messages' must be an array, got a string");
    fail(API_CHAT, "{\"model\":\"m\",\"messages\":[\"hi\"]}", "messages[0]", "must be an object");
    fail(API_CHAT,
         "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"a\"},"
         "{\"role\":\"user\",\"content\":5}]}",
         "messages[1].content", "'messages[1].content' must be a string or an array");
    fail(API_CHAT, "{\"model\":\"m\",\"messages\":[{\"role\":1,\"content\":\"a\"}]}",
         "messages[0].role", "must be a string");
    fail(API_CHAT, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":[\"a\"]}]}",
         "messages[0].content[0]", "must be an object");
    fail(API_CHAT,
         "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\","
         "\"text\":7}]}]}",
         "messages[0].content[0].text", "must be a string");
    fail(API_COMPLETION, "{\"model\":\"m\",\"prompt\":{}}", "prompt", "got an object");
    fail(API_COMPLETION, "{\"model\":\"m\",\"prompt\":[true]}", "prompt[0]", "got a boolean");
}

Test(api, mixed_prompt_arrays) {
    fail(API_COMPLETION, "{\"model\":\"m\",\"prompt\":[\"a\",1]}", "prompt[1]",
         "must be a string, got an integer");
    fail(API_COMPLETION, "{\"model\":\"m\",\"prompt\":[1,\"a\"]}", "prompt[1]",
         "must be an integer, got a string");
    fail(API_COMPLETION, "{\"model\":\"m\",\"prompt\":[[1],2]}", "prompt[1]",
         "must be an array of token ids");
    fail(API_COMPLETION, "{\"model\":\"m\",\"prompt\":[[1],[2,\"x\"]]}", "prompt[1][1]",
         "must be an integer");
    fail(API_COMPLETION, "{\"model\":\"m\",\"prompt\":[1,2.5]}", "prompt[1]",
         "must be an integer, got a number");
}

/* ---------------------------------------------------------------- missing and empty */

Test(api, missing_required) {
    fail(API_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}]}", "model",
         "'model' is required");
    fail(API_CHAT, "{\"model\":null,\"messages\":[]}", "model", "'model' is required");
    fail(API_CHAT, "{\"model\":\"m\"}", "messages", "'messages' is required");
    fail(API_COMPLETION, "{\"model\":\"m\",\"messages\":[]}", "prompt", "'prompt' is required");
    fail(API_CHAT, "{\"model\":\"m\",\"messages\":[{\"content\":\"a\"}]}", "messages[0].role",
         "is required");
    fail(API_CHAT, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\"}]}", "messages[0].content",
         "is required for role 'user'");
    fail(API_CHAT, "{\"model\":\"m\",\"messages\":[{\"role\":\"system\",\"content\":null}]}",
         "messages[0].content", "is required");
    fail(API_CHAT,
         "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":[{\"text\":\"a\"}]}]}",
         "messages[0].content[0].type", "is required");
    fail(API_CHAT,
         "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\"}]}]}",
         "messages[0].content[0].text", "is required");
}

Test(api, empty_lists) {
    fail(API_CHAT, "{\"model\":\"m\",\"messages\":[]}", "messages", "must not be empty");
    fail(API_COMPLETION, "{\"model\":\"m\",\"prompt\":[]}", "prompt", "must not be empty");
    fail(API_COMPLETION, "{\"model\":\"m\",\"prompt\":[[1],[]]}", "prompt[1]", "must not be empty");
}

/* ---------------------------------------------------------------- roles and content */

Test(api, unknown_role) {
    fail(API_CHAT, "{\"model\":\"m\",\"messages\":[{\"role\":\"wizard\",\"content\":\"a\"}]}",
         "messages[0].role", "unknown role 'wizard'");
    fail(API_CHAT, "{\"model\":\"m\",\"messages\":[{\"role\":\"function\",\"content\":\"a\"}]}",
         "messages[0].role", "role 'function' is deprecated");
    fail(API_CHAT,
         "{\"model\":\"m\",\"messages\":[{\"role\":\"assistant\",\"content\":null,"
         "\"tool_calls\":[{\"id\":\"1\",\"type\":\"function\"}]}]}",
         "messages[0].tool_calls[0].function", "is required: an object");
    fail(API_CHAT,
         "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"a\","
         "\"tool_calls\":[]}]}",
         "messages[0].tool_calls", "only assistant messages");
}

/* Tool turns stay structured for the chat template, which writes them in the model's tool
 * format: the assistant's calls (arguments as the JSON text sent), the tool's result with the
 * id it answers (and a name when the message gives one). */
Test(api, tool_turns_kept) {
    api_request r;
    parse_ok(API_CHAT,
             "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"w?\"},"
             "{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":\"c1\","
             "\"type\":\"function\",\"function\":{\"name\":\"get\",\"arguments\":"
             "\"{\\\"a\\\": 1}\"}},{\"id\":\"c2\",\"function\":{\"name\":\"put\"}}]},"
             "{\"role\":\"tool\",\"tool_call_id\":\"c1\",\"content\":\"sunny\"},"
             "{\"role\":\"tool\",\"tool_call_id\":\"c2\",\"name\":\"lookup\",\"content\":\"?\"}],"
             "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"get\","
             "\"parameters\":{\"type\":\"object\",\"properties\":{\"a\":{\"type\":"
             "\"integer\"}}}}}],\"tool_choice\":\"required\"}",
             &r);
    const chat_message *a = &r.messages[1], *t = &r.messages[2];
    cr_assert_str_eq(a->content, "");
    cr_assert_eq(a->n_tool_calls, 2);
    cr_assert_str_eq(a->tool_calls[0].id, "c1");
    cr_assert_str_eq(a->tool_calls[0].name, "get");
    cr_assert_str_eq(a->tool_calls[0].arguments, "{\"a\": 1}");
    cr_assert_str_eq(a->tool_calls[1].name, "put");
    cr_assert_null(a->tool_calls[1].arguments);
    cr_assert_str_eq(t->role, "tool");
    cr_assert_str_eq(t->content, "sunny");
    cr_assert_str_eq(t->tool_call_id, "c1");
    cr_assert_null(t->name, "not given: the template looks the call up by its id");
    cr_assert_str_eq(r.messages[3].tool_call_id, "c2");
    cr_assert_str_eq(r.messages[3].name, "lookup");
    cr_assert_eq(r.n_tools, 1);
    cr_assert_eq(r.tool_choice, CHAT_TOOL_REQUIRED);
    cr_assert(r.parallel_tool_calls);
    cr_assert_null(r.gbnf, "the calls' grammar depends on the model: built when it is known");
    api_request_free(&r);
}

Test(api, tool_calls_bad) {
#define ASSISTANT_CALL(call)                                                                       \
    "{\"model\":\"m\",\"messages\":[{\"role\":\"assistant\",\"tool_calls\":[" call "]}]}"
    fail(API_CHAT, ASSISTANT_CALL("{\"function\":{\"name\":\"a b\"}}"),
         "messages[0].tool_calls[0].function.name", "1 to 64 of");
    fail(API_CHAT, ASSISTANT_CALL("{\"function\":{\"name\":\"f\",\"arguments\":\"{nope\"}}"),
         "messages[0].tool_calls[0].function.arguments", "is not JSON");
    fail(API_CHAT, ASSISTANT_CALL("{\"function\":{\"name\":\"f\",\"arguments\":{}}}"),
         "messages[0].tool_calls[0].function.arguments", "must be a string (JSON text)");
    fail(API_CHAT, ASSISTANT_CALL("{\"id\":7,\"function\":{\"name\":\"f\"}}"),
         "messages[0].tool_calls[0].id", "must be a string");
    fail(API_CHAT, ASSISTANT_CALL("{\"id\":\"c\",\"function\":{\"name\":\"f\"}}, 3"),
         "messages[0].tool_calls[1]", "must be an object");
    fail(API_CHAT, ASSISTANT_CALL("{\"function\":{\"name\":\"f\"}}"),
         "messages[0].tool_calls[0].id", "is required: tool messages answer it");
#undef ASSISTANT_CALL
    /* an empty argument string is an empty object, as before */
    api_request r;
    parse_ok(API_CHAT,
             "{\"model\":\"m\",\"messages\":[{\"role\":\"assistant\",\"tool_calls\":[{"
             "\"id\":\"c\",\"function\":{\"name\":\"f\",\"arguments\":\"\"}}]},"
             "{\"role\":\"tool\",\"tool_call_id\":\"c\",\"content\":\"r\"}]}",
             &r);
    cr_assert_str_eq(r.messages[0].tool_calls[0].arguments, "");
    api_request_free(&r);
}

/* A tool message answers a call of the assistant message right before it (or before the other
 * results of its calls), by id, once; every call gets its result before the conversation goes
 * on. OpenAI's words, with the message at fault as the param. */
Test(api, tool_turns_checked) {
#define CONV(msgs) "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"q\"}," msgs "]}"
#define CALLS(ids) "{\"role\":\"assistant\",\"tool_calls\":[" ids "]}"
#define CALL(id) "{\"id\":\"" id "\",\"function\":{\"name\":\"f\"}}"
#define RESULT(id) "{\"role\":\"tool\",\"tool_call_id\":\"" id "\",\"content\":\"r\"}"
#define USER "{\"role\":\"user\",\"content\":\"u\"}"
    fail(API_CHAT, CONV(RESULT("c1")), "messages[1].role",
         "Invalid parameter: messages with role 'tool' must be a response to a preceeding "
         "message with 'tool_calls'.");
    fail(API_CHAT, CONV(CALLS(CALL("c1")) "," RESULT("c1") "," USER "," RESULT("c1")),
         "messages[4].role", "must be a response to a preceeding message");
    fail(API_CHAT, CONV(CALLS(CALL("c1")) "," RESULT("c2")), "messages[2].tool_call_id",
         "Invalid parameter: 'tool_call_id' of 'c2' not found in 'tool_calls' of previous "
         "message.");
    fail(API_CHAT, CONV(CALLS(CALL("c1") "," CALL("c2")) "," RESULT("c1") "," RESULT("c1")),
         "messages[3].tool_call_id", "'c1' was already answered by messages[2]");
    fail(API_CHAT, CONV(CALLS(CALL("c1") "," CALL("c2") "," CALL("c3")) "," RESULT("c2")),
         "messages[1].role",
         "An assistant message with 'tool_calls' must be followed by tool messages responding "
         "to each 'tool_call_id'. The following tool_call_ids did not have response messages: "
         "c1, c3");
    fail(API_CHAT, CONV(CALLS(CALL("c1")) "," USER), "messages[1].role",
         "did not have response messages: c1");
    fail(API_CHAT, CONV("{\"role\":\"tool\",\"content\":\"r\"}"), "messages[1].tool_call_id",
         "is required for role 'tool'");
    /* results in any order, then the conversation goes on, with more calls */
    api_request r;
    parse_ok(API_CHAT,
             CONV(CALLS(CALL("c1") "," CALL("c2")) "," RESULT("c2") "," RESULT(
                 "c1") "," USER "," CALLS(CALL("c3")) "," RESULT("c3")),
             &r);
    api_request_free(&r);
#undef CONV
#undef CALLS
#undef CALL
#undef RESULT
#undef USER
}

/* OpenAI's deprecated functions / function_call are tools / tool_choice: one call per answer,
 * given back in the legacy shape; both forms at once name the legacy field. */
Test(api, legacy_functions_are_tools) {
    api_request r;
    parse_ok(API_CHAT,
             chat_with(",\"functions\":[{\"name\":\"get\",\"description\":\"d\","
                       "\"parameters\":{\"type\":\"object\"}},{\"name\":\"put\"}],"
                       "\"function_call\":{\"name\":\"put\"}"),
             &r);
    cr_assert_eq(r.n_tools, 2);
    cr_assert_str_eq(r.tools[0].name, "get");
    cr_assert_str_eq(r.tools[0].description, "d");
    cr_assert_not_null(r.tools[0].parameters);
    cr_assert_str_eq(r.tools[1].name, "put");
    cr_assert_eq(r.tool_choice, CHAT_TOOL_NAMED);
    cr_assert_str_eq(r.tool_choice_name, "put");
    cr_assert(r.legacy_functions);
    cr_assert_not(r.parallel_tool_calls, "a legacy answer holds one function_call");
    api_request_free(&r);
    const char *choices[] = {"\"none\"", "\"auto\""};
    const chat_tool_choice want[] = {CHAT_TOOL_NONE, CHAT_TOOL_AUTO};
    for (int i = 0; i < 2; i++) {
        char extra[128];
        snprintf(extra, sizeof extra, ",\"functions\":[{\"name\":\"f\"}],\"function_call\":%s",
                 choices[i]);
        parse_ok(API_CHAT, chat_with(extra), &r);
        cr_assert_eq(r.tool_choice, want[i]);
        api_request_free(&r);
    }
    parse_ok(API_CHAT,
             chat_with(",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}]"), &r);
    cr_assert_not(r.legacy_functions);
    api_request_free(&r);
    fail(API_CHAT,
         chat_with(",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}],"
                   "\"functions\":[{\"name\":\"f\"}]"),
         "functions", "deprecated form of 'tools'");
    fail(API_CHAT,
         chat_with(",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}],"
                   "\"tool_choice\":\"auto\",\"function_call\":\"auto\""),
         "function_call", "deprecated form of 'tool_choice'");
    fail(API_CHAT, chat_with(",\"functions\":[{\"name\":\"f\"}],\"function_call\":\"required\""),
         "function_call", "must be 'none', 'auto' or {\"name\": ...}");
    fail(API_CHAT,
         chat_with(",\"functions\":[{\"name\":\"f\"}],\"function_call\":{\"name\":\"g\"}"),
         "function_call", "names 'g', which is not in 'functions'");
    fail(API_CHAT, chat_with(",\"functions\":[{\"name\":\"f\",\"parameters\":3}]"),
         "functions[0].parameters", "must be a JSON Schema object");
}

Test(api, image_part) {
    fail(API_CHAT,
         "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\","
         "\"text\":\"see\"},{\"type\":\"image_url\",\"image_url\":{\"url\":\"http://x\"}}]}]}",
         "messages[0].content[1].type", "content part type 'image_url' is not supported");
}

/* ---------------------------------------------------------------- ranges */

Test(api, out_of_range) {
    fail(API_CHAT, chat_with(",\"temperature\":2.5"), "temperature",
         "'temperature' must be between 0 and 2, got 2.5");
    fail(API_CHAT, chat_with(",\"temperature\":-0.1"), "temperature", "between 0 and 2");
    fail(API_CHAT, chat_with(",\"top_p\":1.01"), "top_p", "between 0 and 1");
    fail(API_CHAT, chat_with(",\"min_p\":-1"), "min_p", "between 0 and 1");
    fail(API_CHAT, chat_with(",\"top_k\":-2"), "top_k", "must be at least -1, got -2");
    fail(API_CHAT, chat_with(",\"top_k\":4294967296"), "top_k", "at most 2147483647");
    fail(API_CHAT, chat_with(",\"presence_penalty\":2.5"), "presence_penalty", "between -2 and 2");
    fail(API_CHAT, chat_with(",\"frequency_penalty\":-3"), "frequency_penalty", "between -2 and 2");
    fail(API_CHAT, chat_with(",\"repetition_penalty\":0"), "repetition_penalty",
         "greater than 0 and 100");
    fail(API_CHAT, chat_with(",\"repetition_penalty\":101"), "repetition_penalty",
         "greater than 0 and 100");
    fail(API_CHAT, chat_with(",\"n\":0"), "n", "between 1 and 16, got 0");
    fail(API_CHAT, chat_with(",\"n\":17"), "n", "between 1 and 16");
    fail(API_CHAT, chat_with(",\"max_tokens\":0"), "max_tokens", "must be at least 1");
    fail(API_CHAT, chat_with(",\"max_completion_tokens\":-5"), "max_completion_tokens",
         "must be at least 1");
    fail(API_CHAT, chat_with(",\"logprobs\":true,\"top_logprobs\":21"), "top_logprobs",
         "between 0 and 20");
    fail(API_COMPLETION, completion_with(",\"logprobs\":6"), "logprobs", "between 0 and 5");
    fail(API_CHAT, chat_with(",\"logit_bias\":{\"1\":100.5}"), "logit_bias",
         "between -100 and 100");
    fail(API_COMPLETION, "{\"model\":\"m\",\"prompt\":[1,-1]}", "prompt[1]", "at least 0");
    fail(API_COMPLETION, "{\"model\":\"m\",\"prompt\":[[2147483648]]}", "prompt[0][0]",
         "at most 2147483647");
    char salt[300 + 64];
    char s[258];
    memset(s, 'a', 257);
    s[257] = '\0';
    snprintf(salt, sizeof salt, ",\"cache_salt\":\"%s\"", s);
    fail(API_CHAT, chat_with(salt), "cache_salt", "longer than 256 bytes");
}

/* A body whose field key is a list of n one-letter strings. */
static char *list_body(const char *key, int n) {
    static char body[32 + 4 * (API_MAX_PROMPTS + API_MAX_EMBED_INPUTS + 2)];
    size_t len = (size_t)snprintf(body, sizeof body, "{\"model\":\"m\",\"%s\":[", key);
    for (int i = 0; i < n; i++)
        len += (size_t)snprintf(body + len, sizeof body - len, "%s\"a\"", i ? "," : "");
    snprintf(body + len, sizeof body - len, "]}");
    return body;
}

Test(api, too_many_prompts) {
    api_request r;
    parse_ok(API_COMPLETION, list_body("prompt", API_MAX_PROMPTS), &r);
    cr_assert_eq(r.n_prompts, API_MAX_PROMPTS);
    api_request_free(&r);
    fail(API_COMPLETION, list_body("prompt", API_MAX_PROMPTS + 1), "prompt",
         "'prompt' has 2049 prompts, more than the limit of 2048");
}

Test(api, stops) {
    fail(API_CHAT, chat_with(",\"stop\":[\"a\",\"b\",\"c\",\"d\",\"e\"]"), "stop",
         "'stop' has 5 strings, more than the limit of 4");
    fail(API_CHAT, chat_with(",\"stop\":\"\""), "stop", "must not be an empty string");
    fail(API_CHAT, chat_with(",\"stop\":[\"a\",\"\"]"), "stop[1]", "must not be an empty string");
}

Test(api, logit_bias_keys) {
    fail(API_CHAT, chat_with(",\"logit_bias\":{\"abc\":1}"), "logit_bias",
         "keys must be token ids (non-negative integers), got 'abc'");
    fail(API_CHAT, chat_with(",\"logit_bias\":{\"-1\":1}"), "logit_bias", "got '-1'");
    fail(API_CHAT, chat_with(",\"logit_bias\":{\"1.5\":1}"), "logit_bias", "got '1.5'");
    fail(API_CHAT, chat_with(",\"logit_bias\":{\"\":1}"), "logit_bias", "got ''");
    fail(API_CHAT, chat_with(",\"logit_bias\":{\"2147483648\":1}"), "logit_bias", "token ids");
    fail(API_CHAT, chat_with(",\"logit_bias\":{\"7\":1,\"007\":2}"), "logit_bias",
         "gives token 7 twice");
    char body[API_MAX_LOGIT_BIAS * 12 + 64];
    size_t off = (size_t)snprintf(body, sizeof body, ",\"logit_bias\":{");
    for (int i = 0; i <= API_MAX_LOGIT_BIAS; i++)
        off += (size_t)snprintf(body + off, sizeof body - off, "%s\"%d\":1", i ? "," : "", i);
    snprintf(body + off, sizeof body - off, "}");
    char *full = malloc(strlen(body) + 128);
    cr_assert_not_null(full);
    sprintf(full, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]%s}",
            body);
    fail(API_CHAT, full, "logit_bias", "more than the limit of 1024");
    free(full);
}

Test(api, top_logprobs_without_logprobs) {
    fail(API_CHAT, chat_with(",\"top_logprobs\":2"), "top_logprobs",
         "'top_logprobs' requires 'logprobs' to be true");
    fail(API_CHAT, chat_with(",\"logprobs\":false,\"top_logprobs\":0"), "top_logprobs",
         "requires 'logprobs'");
}

/* ---------------------------------------------------------------- error JSON */

Test(api, error_json_round_trip) {
    api_error err;
    api_fail(&err, 400, "invalid_request_error", NULL, "messages[1].content", "bad \"%s\"\n",
             "quote");
    char *s = api_error_json(&err);
    cr_assert_not_null(s);
    json_error_t jerr;
    json_t *root = json_loads(s, 0, &jerr);
    cr_assert_not_null(root, "%s: %s", s, jerr.text);
    json_t *e = json_object_get(root, "error");
    cr_assert(json_is_object(e));
    cr_assert_str_eq(json_string_value(json_object_get(e, "message")), "bad \"quote\"\n");
    cr_assert_str_eq(json_string_value(json_object_get(e, "type")), "invalid_request_error");
    cr_assert_str_eq(json_string_value(json_object_get(e, "param")), "messages[1].content");
    cr_assert(json_is_null(json_object_get(e, "code")));
    json_decref(root);
    free(s);

    api_fail(&err, 404, "invalid_request_error", "model_not_found", "", "no model '%s'", "x");
    s = api_error_json(&err);
    root = json_loads(s, 0, &jerr);
    cr_assert_not_null(root);
    e = json_object_get(root, "error");
    cr_assert(json_is_null(json_object_get(e, "param")));
    cr_assert_str_eq(json_string_value(json_object_get(e, "code")), "model_not_found");
    json_decref(root);
    free(s);
}

Test(api, error_json_from_parse_and_bad_utf8) {
    /* A message quoting client text cut mid-character must still give valid JSON. */
    api_error err;
    api_fail(&err, 400, "invalid_request_error", NULL, "x", "cut: %.4s", "ab\xc3\xb6\xc3\xb6");
    char *s = api_error_json(&err);
    cr_assert_not_null(s);
    json_t *root = json_loads(s, 0, NULL);
    cr_assert_not_null(root, "%s", s);
    cr_assert_str_eq(json_string_value(json_object_get(json_object_get(root, "error"), "message")),
                     "cut: ab\xc3\xb6");
    json_decref(root);
    free(s);

    api_request r;
    cr_assert_eq(api_parse_request(API_CHAT, "{\"model\":\"\xff\"}", 13, &r, &err), -1);
    s = api_error_json(&err);
    root = json_loads(s, 0, NULL);
    cr_assert_not_null(root, "%s", s);
    cr_assert_not_null(
        strstr(json_string_value(json_object_get(json_object_get(root, "error"), "message")),
               "invalid UTF-8"));
    json_decref(root);
    free(s);
}

/* ---------------------------------------------------------------- tokenize, detokenize */

static void tok_fail(const char *body, const char *param, const char *msg) {
    api_tokenize t;
    api_error err = {0};
    cr_assert_eq(api_parse_tokenize(body, strlen(body), &t, &err), -1, "accepted %s", body);
    cr_assert_eq(err.status, 400);
    cr_assert_str_eq(err.param, param, "param '%s' for %s", err.param, body);
    cr_assert_not_null(strstr(err.message, msg), "'%s' lacks '%s'", err.message, msg);
    api_tokenize_free(&t);
}

Test(api, tokenize_shapes) {
    api_tokenize t;
    api_error err;
    const char *b1 = "{\"model\":\"m\",\"content\":\"hello\"}";
    cr_assert_eq(api_parse_tokenize(b1, strlen(b1), &t, &err), 0, "%s", err.message);
    cr_assert_str_eq(t.text, "hello");
    cr_assert_null(t.messages);
    cr_assert(t.add_special);
    cr_assert_not(t.with_pieces);
    api_tokenize_free(&t);

    const char *b2 = "{\"prompt\":\"\",\"add_special_tokens\":false,\"with_pieces\":true}";
    cr_assert_eq(api_parse_tokenize(b2, strlen(b2), &t, &err), 0, "%s", err.message);
    cr_assert_str_eq(t.text, "");
    cr_assert_not(t.add_special);
    cr_assert(t.with_pieces);
    api_tokenize_free(&t);

    const char *b3 = "{\"messages\":[{\"role\":\"developer\",\"content\":\"s\"},"
                     "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"u\"}]}]}";
    cr_assert_eq(api_parse_tokenize(b3, strlen(b3), &t, &err), 0, "%s", err.message);
    cr_assert_null(t.text);
    cr_assert_eq(t.n_messages, 2);
    cr_assert_str_eq(t.messages[0].role, "system");
    cr_assert_str_eq(t.messages[1].content, "u");
    cr_assert_not(t.add_special);
    api_tokenize_free(&t);

    const char *b4 = "{\"messages\":[{\"role\":\"user\",\"content\":\"u\"}],\"add_special\":true}";
    cr_assert_eq(api_parse_tokenize(b4, strlen(b4), &t, &err), 0, "%s", err.message);
    cr_assert(t.add_special);
    api_tokenize_free(&t);
}

Test(api, tokenize_errors) {
    tok_fail("{}", "content", "is required");
    tok_fail("{\"content\":5}", "content", "'content' must be a string, got an integer");
    tok_fail("{\"prompt\":[1]}", "prompt", "must be a string");
    tok_fail("{\"content\":\"a\",\"messages\":[]}", "messages", "not both");
    tok_fail("{\"messages\":[]}", "messages", "must not be empty");
    tok_fail("{\"messages\":[{\"role\":\"tool\"}]}", "messages[0].content", "is required");
    tok_fail("{\"content\":\"a\",\"with_pieces\":\"yes\"}", "with_pieces", "must be a boolean");
    tok_fail("[", "", "malformed JSON");
    tok_fail("[]", "", "must be a JSON object");
    tok_fail("{\"content\":\"\xfe\"}", "", "invalid UTF-8");
}

static void detok_fail(const char *body, const char *param, const char *msg) {
    int32_t *toks = (int32_t *)1;
    int n = 99;
    api_error err = {0};
    cr_assert_eq(api_parse_detokenize(body, strlen(body), &toks, &n, &err), -1, "accepted %s",
                 body);
    cr_assert_null(toks);
    cr_assert_eq(n, 0);
    cr_assert_eq(err.status, 400);
    cr_assert_str_eq(err.param, param, "param '%s' for %s", err.param, body);
    cr_assert_not_null(strstr(err.message, msg), "'%s' lacks '%s'", err.message, msg);
}

Test(api, detokenize) {
    int32_t *toks;
    int n;
    api_error err;
    const char *b = "{\"model\":\"m\",\"tokens\":[3,0,2147483647]}";
    cr_assert_eq(api_parse_detokenize(b, strlen(b), &toks, &n, &err), 0, "%s", err.message);
    cr_assert_eq(n, 3);
    cr_assert_eq(toks[0], 3);
    cr_assert_eq(toks[1], 0);
    cr_assert_eq(toks[2], INT32_MAX);
    free(toks);
    b = "{\"tokens\":[]}";
    cr_assert_eq(api_parse_detokenize(b, strlen(b), &toks, &n, &err), 0, "%s", err.message);
    cr_assert_eq(n, 0);
    free(toks);

    detok_fail("{}", "tokens", "'tokens' is required");
    detok_fail("{\"tokens\":\"1 2\"}", "tokens", "must be an array of token ids, got a string");
    detok_fail("{\"tokens\":[1,-2]}", "tokens[1]", "must be at least 0, got -2");
    detok_fail("{\"tokens\":[1,2147483648]}", "tokens[1]", "at most 2147483647");
    detok_fail("{\"tokens\":[1,\"2\"]}", "tokens[1]", "must be an integer, got a string");
    detok_fail("{\"tokens\":[1.5]}", "tokens[0]", "must be an integer, got a number");
    detok_fail("{\"tokens\":[1]", "", "malformed JSON");
}

/* ---------------------------------------------------------------- embeddings */

Test(api, embeddings_parse) {
    api_embeddings e;
    api_error err = {0};
    const char *b = "{\"model\":\"m\",\"input\":[\"a\",\"bc\"],\"encoding_format\":\"base64\","
                    "\"dimensions\":8}";
    cr_assert_eq(api_parse_embeddings(b, strlen(b), &e, &err), 0, "%s", err.message);
    cr_assert_eq(e.n_inputs, 2);
    cr_assert_str_eq(e.inputs[1].text, "bc");
    cr_assert(e.base64);
    cr_assert_eq(e.dimensions, 8);
    api_embeddings_free(&e);
    b = "{\"model\":\"m\",\"input\":[[1,2],[3]]}";
    cr_assert_eq(api_parse_embeddings(b, strlen(b), &e, &err), 0, "%s", err.message);
    cr_assert_eq(e.n_inputs, 2);
    cr_assert_eq(e.inputs[0].n_tokens, 2);
    cr_assert_eq(e.inputs[1].tokens[0], 3);
    cr_assert_not(e.base64);
    api_embeddings_free(&e);
    const char *bad[][2] = {
        {"{\"input\":\"a\"}", "model"},
        {"{\"model\":\"m\"}", "input"},
        {"{\"model\":\"m\",\"input\":\"\"}", "input"},
        {"{\"model\":\"m\",\"input\":[\"a\",\"\"]}", "input[1]"},
        {"{\"model\":\"m\",\"input\":\"a\",\"dimensions\":0}", "dimensions"},
        {"{\"model\":\"m\",\"input\":\"a\",\"encoding_format\":\"hex\"}", "encoding_format"},
        {"{\"model\":\"m\",\"input\":[[1],\"a\"]}", "input[1]"},
        {list_body("input", API_MAX_EMBED_INPUTS + 1), "input"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        memset(&err, 0, sizeof err);
        cr_assert_eq(api_parse_embeddings(bad[i][0], strlen(bad[i][0]), &e, &err), -1, "%s",
                     bad[i][0]);
        cr_assert_eq(err.status, 400);
        cr_assert_str_eq(err.param, bad[i][1], "%s: %s", bad[i][0], err.message);
        api_embeddings_free(&e);
    }
}

/* ---------------------------------------------------------------- Prompt Cache */

Test(api, schema_prompt_as_pml_or_json_with_or_without_messages) {
    api_request r;
    parse_ok(API_CHAT,
             "{\"model\":\"m\",\"messages\":[],\"schema_prompt\":\"<prompt schema='s'/>\","
             "\"fixup\":true,\"fixup_ratio\":0.2}",
             &r);
    cr_assert_str_eq(r.schema_prompt, "<prompt schema='s'/>");
    cr_assert_not(r.schema_prompt_json);
    cr_assert_eq(r.n_messages, 0);
    cr_assert_eq(r.fixup, 1);
    cr_assert_float_eq(r.fixup_ratio, 0.2f, 1e-6);
    api_request_free(&r);
    parse_ok(API_COMPLETION,
             "{\"model\":\"m\",\"schema_prompt\":{\"schema\":\"s\",\"modules\":[]}}", &r);
    cr_assert(r.schema_prompt_json);
    cr_assert(strstr(r.schema_prompt, "\"schema\":\"s\""), "%s", r.schema_prompt);
    cr_assert_eq(r.n_prompts, 0);
    cr_assert_eq(r.fixup, -1);
    cr_assert_float_eq(r.fixup_ratio, -1.0f, 1e-6);
    api_request_free(&r);
    parse_ok(API_CHAT, chat_with(",\"schema_prompt\":\"<prompt schema='s'/>\""), &r);
    cr_assert_eq(r.n_messages, 1);
    api_request_free(&r);
}

Test(api, schema_prompt_refusals) {
    fail(API_CHAT, chat_with(",\"schema_prompt\":3"), "schema_prompt", "a PML string or an object");
    fail(API_CHAT, chat_with(",\"fixup\":\"yes\""), "fixup", "a boolean");
    fail(API_CHAT, chat_with(",\"fixup_ratio\":2"), "fixup_ratio", "");
    fail(API_CHAT, "{\"model\":\"m\",\"messages\":[]}", "messages", "must not be empty");
    fail(API_COMPLETION, "{\"model\":\"m\"}", "prompt", "'prompt' is required");
}

/* ---------------------------------------------------------------- KV over the network */

Test(api, redis_fetch_fields) {
    api_request r;
    parse_ok(API_CHAT,
             chat_with(",\"kv_level\":\"codec2\",\"kv_lossless\":true,"
                       "\"ttft_budget_ms\":250"),
             &r);
    cr_assert_eq(r.kv_level, CACHE_ENC_CODEC + 2);
    cr_assert(r.kv_lossless);
    cr_assert_eq(r.ttft_budget_ms, 250);
    api_request_free(&r);
    parse_ok(API_COMPLETION, "{\"model\":\"m\",\"prompt\":\"x\",\"kv_level\":\"text\"}", &r);
    cr_assert_eq(r.kv_level, CACHE_ENC_TEXT);
    cr_assert_not(r.kv_lossless);
    cr_assert_eq(r.ttft_budget_ms, -1, "unset: the server's budget");
    api_request_free(&r);
    parse_ok(API_CHAT, chat_with(""), &r);
    cr_assert_eq(r.kv_level, CACHE_ENC_ANY);
    api_request_free(&r);
    fail(API_CHAT, chat_with(",\"kv_level\":\"codec9\""), "kv_level", "must be lossless, q8");
    fail(API_CHAT, chat_with(",\"kv_level\":2"), "kv_level", "a string");
    fail(API_CHAT, chat_with(",\"kv_lossless\":1"), "kv_lossless", "a boolean");
    fail(API_CHAT, chat_with(",\"ttft_budget_ms\":-5"), "ttft_budget_ms", "");
    fail(API_CHAT, chat_with(",\"ttft_budget_ms\":1.5"), "ttft_budget_ms", "");
}
