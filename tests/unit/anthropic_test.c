/* Anthropic Messages request parser tests (server/api/anthropic_req.c): a body read back as the
 * chat request it maps onto (system, blocks, tool calls and results, tools, tool_choice, sampling),
 * the cache_control markers with where their blocks are, and every refusal with its path
 * (missing and unknown fields, roles, the tool-turn rules, unsupported blocks and features, the
 * marker limits), and Anthropic's error JSON. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/api/anthropic.h"

static void parse_ok(const char *body, bool count, anthropic_request *r) {
    api_error err = {0};
    int rc = anthropic_parse(body, strlen(body), count, r, &err);
    cr_assert_eq(rc, 0, "parse failed: %s for %s", err.message, body);
}

/* Expects a 400 whose message begins with the field's path and holds msg. */
static void fail_count(const char *body, bool count, const char *path, const char *msg) {
    anthropic_request r;
    api_error err = {0};
    cr_assert_eq(anthropic_parse(body, strlen(body), count, &r, &err), -1, "parsed: %s", body);
    cr_assert_eq(err.status, 400, "status %d (%s)", err.status, err.message);
    cr_assert_eq(strncmp(err.message, path, strlen(path)), 0, "message '%s' does not name '%s'",
                 err.message, path);
    cr_assert_not_null(strstr(err.message, msg), "message '%s' lacks '%s'", err.message, msg);
    cr_assert_null(r.rq.messages, "a failed parse leaves nothing");
    anthropic_request_free(&r);
}

static void fail(const char *body, const char *path, const char *msg) {
    fail_count(body, false, path, msg);
}

/* A body with one user message "hi" and fields spliced in (",\"x\":1" or ""). */
static char *with(const char *extra) {
    static char buf[4096];
    snprintf(buf, sizeof buf,
             "{\"model\":\"m\",\"max_tokens\":8,\"messages\":[{\"role\":\"user\",\"content\":"
             "\"hi\"}]%s}",
             extra);
    return buf;
}

/* ---------------------------------------------------------------- valid requests */

Test(anthropic, fields_map_onto_the_chat_request) {
    const char *body =
        "{\"model\":\"smol\",\"max_tokens\":24,\"temperature\":0.5,\"top_p\":0.9,\"top_k\":40,"
        "\"stop_sequences\":[\"END\",\"##\"],\"stream\":true,\"metadata\":{\"user_id\":\"u1\"},"
        "\"service_tier\":\"auto\",\"thinking\":{\"type\":\"disabled\"},"
        "\"system\":[{\"type\":\"text\",\"text\":\"Be brief.\"},{\"type\":\"text\",\"text\":\"Be "
        "kind.\"}],"
        "\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"a\"},"
        "{\"type\":\"text\",\"text\":\"b\"}]},{\"role\":\"assistant\",\"content\":\"ok\"},"
        "{\"role\":\"user\",\"content\":\"c\"}]}";
    anthropic_request r;
    parse_ok(body, false, &r);
    const api_request *rq = &r.rq;
    cr_assert_eq(rq->kind, API_CHAT);
    cr_assert_str_eq(rq->model, "smol");
    cr_assert_eq(rq->max_tokens, 24);
    cr_assert_float_eq(rq->sampling.temperature, 0.5f, 1e-6);
    cr_assert_float_eq(rq->sampling.top_p, 0.9f, 1e-6);
    cr_assert_eq(rq->sampling.top_k, 40);
    cr_assert_eq(rq->n_stops, 2);
    cr_assert_str_eq(rq->stops[1], "##");
    cr_assert(rq->stream);
    cr_assert_str_eq(rq->user, "u1");
    cr_assert_eq(rq->n, 1);
    cr_assert(rq->cache, "the chat request's defaults");
    cr_assert_eq(rq->n_messages, 4);
    cr_assert_str_eq(rq->messages[0].role, "system");
    cr_assert_str_eq(rq->messages[0].content, "Be brief.\n\nBe kind.");
    cr_assert_eq(rq->messages[0].n_parts, 2);
    cr_assert_eq(rq->messages[0].part_ends[0], 9);
    cr_assert_str_eq(rq->messages[1].role, "user");
    cr_assert_str_eq(rq->messages[1].content, "a\n\nb");
    cr_assert_str_eq(rq->messages[2].role, "assistant");
    cr_assert_str_eq(rq->messages[3].content, "c");
    cr_assert_eq(rq->tool_choice, CHAT_TOOL_NONE, "no tools");
    cr_assert_eq(r.n_markers, 0);
    anthropic_request_free(&r);
}

Test(anthropic, tool_use_and_tool_result_become_calls_and_tool_messages) {
    const char *body =
        "{\"model\":\"m\",\"max_tokens\":8,"
        "\"tools\":[{\"name\":\"get_weather\",\"description\":\"Weather\",\"input_schema\":"
        "{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"}},\"required\":"
        "[\"city\"]}},{\"type\":\"custom\",\"name\":\"noop\",\"input_schema\":{\"type\":"
        "\"object\"}}],"
        "\"tool_choice\":{\"type\":\"any\",\"disable_parallel_tool_use\":true},"
        "\"messages\":[{\"role\":\"user\",\"content\":\"Weather in Paris?\"},"
        "{\"role\":\"assistant\",\"content\":[{\"type\":\"text\",\"text\":\"Checking.\"},"
        "{\"type\":\"tool_use\",\"id\":\"toolu_1\",\"name\":\"get_weather\",\"input\":{\"city\":"
        "\"Paris\"}},{\"type\":\"tool_use\",\"id\":\"toolu_2\",\"name\":\"noop\",\"input\":{}}]},"
        "{\"role\":\"user\",\"content\":[{\"type\":\"tool_result\",\"tool_use_id\":\"toolu_1\","
        "\"content\":\"18C\"},{\"type\":\"tool_result\",\"tool_use_id\":\"toolu_2\",\"is_error\":"
        "true,\"content\":[{\"type\":\"text\",\"text\":\"failed\"}]},{\"type\":\"text\",\"text\":"
        "\"Thanks\"}]}]}";
    anthropic_request r;
    parse_ok(body, false, &r);
    const api_request *rq = &r.rq;
    cr_assert_eq(rq->n_tools, 2);
    cr_assert_str_eq(rq->tools[0].name, "get_weather");
    cr_assert_str_eq(rq->tools[0].description, "Weather");
    cr_assert_not_null(strstr(rq->tools[0].parameters, "\"city\""));
    cr_assert_eq(rq->tool_choice, CHAT_TOOL_REQUIRED);
    cr_assert_not(rq->parallel_tool_calls);
    cr_assert_eq(rq->n_messages, 5);
    const chat_message *a = &rq->messages[1];
    cr_assert_str_eq(a->role, "assistant");
    cr_assert_str_eq(a->content, "Checking.");
    cr_assert_eq(a->n_tool_calls, 2);
    cr_assert_str_eq(a->tool_calls[0].id, "toolu_1");
    cr_assert_str_eq(a->tool_calls[0].name, "get_weather");
    cr_assert_str_eq(a->tool_calls[0].arguments, "{\"city\":\"Paris\"}");
    cr_assert_str_eq(a->tool_calls[1].arguments, "{}");
    cr_assert_str_eq(rq->messages[2].role, "tool");
    cr_assert_str_eq(rq->messages[2].tool_call_id, "toolu_1");
    cr_assert_str_eq(rq->messages[2].content, "18C");
    cr_assert_str_eq(rq->messages[3].tool_call_id, "toolu_2");
    cr_assert_str_eq(rq->messages[3].content, "Error: failed", "is_error said in words");
    cr_assert_str_eq(rq->messages[4].role, "user");
    cr_assert_str_eq(rq->messages[4].content, "Thanks");
    anthropic_request_free(&r);
}

Test(anthropic, tool_choice_kinds) {
    const char *tools = ",\"tools\":[{\"name\":\"f\",\"input_schema\":{\"type\":\"object\"}}]";
    const struct {
        const char *choice;
        chat_tool_choice want;
    } cases[] = {{"", CHAT_TOOL_AUTO},
                 {",\"tool_choice\":{\"type\":\"auto\"}", CHAT_TOOL_AUTO},
                 {",\"tool_choice\":{\"type\":\"none\"}", CHAT_TOOL_NONE},
                 {",\"tool_choice\":{\"type\":\"tool\",\"name\":\"f\"}", CHAT_TOOL_NAMED}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char extra[256];
        snprintf(extra, sizeof extra, "%s%s", tools, cases[i].choice);
        anthropic_request r;
        parse_ok(with(extra), false, &r);
        cr_assert_eq(r.rq.tool_choice, cases[i].want, "%s", cases[i].choice);
        if (cases[i].want == CHAT_TOOL_NAMED) cr_assert_str_eq(r.rq.tool_choice_name, "f");
        cr_assert(r.rq.parallel_tool_calls);
        anthropic_request_free(&r);
    }
    fail(with(",\"tool_choice\":{\"type\":\"any\"}"), "tool_choice.type", "needs tools");
    char extra[256];
    snprintf(extra, sizeof extra, "%s,\"tool_choice\":{\"type\":\"tool\",\"name\":\"g\"}", tools);
    fail(with(extra), "tool_choice.name", "no tool is named 'g'");
    snprintf(extra, sizeof extra, "%s,\"tool_choice\":{\"type\":\"some\"}", tools);
    fail(with(extra), "tool_choice.type", "Input should be");
}

Test(anthropic, cache_control_markers_say_where_their_blocks_are) {
    const char *body =
        "{\"model\":\"m\",\"max_tokens\":8,"
        "\"tools\":[{\"name\":\"f\",\"input_schema\":{\"type\":\"object\"},\"cache_control\":"
        "{\"type\":\"ephemeral\",\"ttl\":\"1h\"}}],"
        "\"system\":[{\"type\":\"text\",\"text\":\"One.\"},{\"type\":\"text\",\"text\":\"Two.\","
        "\"cache_control\":{\"type\":\"ephemeral\"}}],"
        "\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"Doc\"},"
        "{\"type\":\"text\",\"text\":\"Question\",\"cache_control\":{\"type\":\"ephemeral\","
        "\"ttl\":\"5m\"}}]},{\"role\":\"assistant\",\"content\":[{\"type\":\"tool_use\",\"id\":"
        "\"t1\",\"name\":\"f\",\"input\":{}}]},{\"role\":\"user\",\"content\":[{\"type\":"
        "\"tool_result\",\"tool_use_id\":\"t1\",\"content\":\"r\",\"cache_control\":{\"type\":"
        "\"ephemeral\"}}]}]}";
    anthropic_request r;
    parse_ok(body, false, &r);
    cr_assert_eq(r.n_markers, 4);
    const anthropic_marker *m = r.markers;
    cr_assert_eq(m[0].msg, -1, "the tools");
    cr_assert_eq(m[0].ttl, ANTHROPIC_TTL_1H);
    cr_assert_str_eq(m[0].param, "tools.0.cache_control");
    cr_assert_eq(m[1].msg, 0, "the system message");
    cr_assert(m[1].text);
    cr_assert_eq(m[1].a, 6);
    cr_assert_eq(m[1].e, 10, "\"Two.\" in \"One.\\n\\nTwo.\"");
    cr_assert_eq(m[1].ttl, ANTHROPIC_TTL_5M);
    cr_assert_str_eq(m[1].param, "system.1.cache_control");
    cr_assert_eq(m[2].msg, 1);
    cr_assert_eq(memcmp(r.rq.messages[1].content + m[2].a, "Question", m[2].e - m[2].a), 0);
    cr_assert_str_eq(m[2].param, "messages.0.content.1.cache_control");
    cr_assert_eq(m[3].msg, 3, "the tool message of the result");
    cr_assert_not(m[3].text);
    cr_assert_str_eq(r.rq.messages[3].role, "tool");
    anthropic_request_free(&r);
}

Test(anthropic, top_level_cache_control_marks_the_last_block) {
    anthropic_request r;
    parse_ok("{\"model\":\"m\",\"max_tokens\":0,\"cache_control\":{\"type\":\"ephemeral\","
             "\"ttl\":\"1h\"},\"system\":\"s\",\"messages\":[{\"role\":\"user\",\"content\":\"a\"},"
             "{\"role\":\"assistant\",\"content\":\"b\"},{\"role\":\"user\",\"content\":\"c\"}]}",
             false, &r);
    cr_assert_eq(r.rq.max_tokens, 0, "pre-warming the cache");
    cr_assert_eq(r.n_markers, 1);
    cr_assert_eq(r.markers[0].msg, 3);
    cr_assert_not(r.markers[0].text, "the whole last message");
    cr_assert_eq(r.markers[0].ttl, ANTHROPIC_TTL_1H);
    cr_assert_str_eq(r.markers[0].param, "cache_control");
    anthropic_request_free(&r);
}

Test(anthropic, count_tokens_bodies_have_no_generation_fields) {
    anthropic_request r;
    parse_ok("{\"model\":\"m\",\"system\":\"s\",\"messages\":[{\"role\":\"user\",\"content\":"
             "\"hi\"}]}",
             true, &r);
    cr_assert_eq(r.rq.n_messages, 2);
    cr_assert_eq(r.rq.max_tokens, -1);
    anthropic_request_free(&r);
    fail_count(with(""), true, "max_tokens", "Extra inputs are not permitted");
}

/* ---------------------------------------------------------------- refusals */

Test(anthropic, required_fields_and_types) {
    fail("{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}", "max_tokens",
         "Field required");
    fail("{\"model\":\"m\",\"max_tokens\":-1,\"messages\":[{\"role\":\"user\",\"content\":"
         "\"hi\"}]}",
         "'max_tokens'", "at least 0");
    fail("{\"max_tokens\":8,\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}", "model",
         "Field required");
    fail("{\"model\":\"m\",\"max_tokens\":8,\"messages\":[]}", "messages", "at least one");
    fail("{\"model\":\"m\",\"max_tokens\":8}", "messages", "Field required");
    fail(with(",\"temperature\":1.5"), "'temperature'", "between 0 and 1");
    fail(with(",\"top_k\":-1"), "'top_k'", "at least 0");
    fail(with(",\"stop_sequences\":[\"a\",\"b\",\"c\",\"d\",\"e\"]"), "stop_sequences",
         "more than this server's 4");
    fail(with(",\"stop_sequences\":[\"\"]"), "stop_sequences.0", "non-empty");
    fail(with(",\"metadata\":{\"user_id\":\"u\",\"x\":1}"), "metadata.x", "Extra inputs");
    fail(with(",\"frequency_penalty\":1"), "frequency_penalty", "Extra inputs are not permitted");
    fail(with(",\"service_tier\":\"priority\""), "service_tier", "Input should be");
    fail("{\"model\":\"m\",\"max_tokens\":8,\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}"
         "]",
         "", "malformed JSON");
}

Test(anthropic, roles_and_contents) {
    fail("{\"model\":\"m\",\"max_tokens\":8,\"messages\":[{\"role\":\"system\",\"content\":\"x\"}"
         "]}",
         "messages.0.role", "Input should be 'user', 'assistant'");
    fail("{\"model\":\"m\",\"max_tokens\":8,\"messages\":[{\"role\":\"user\",\"content\":\"hi\"},"
         "{\"role\":\"assistant\",\"content\":\"The answer is\"}]}",
         "messages.1.role", "prefill");
    fail("{\"model\":\"m\",\"max_tokens\":8,\"messages\":[{\"role\":\"user\",\"content\":\"\"}]}",
         "messages.0.content", "non-empty");
    fail("{\"model\":\"m\",\"max_tokens\":8,\"messages\":[{\"role\":\"user\",\"content\":[]}]}",
         "messages.0.content", "must not be empty");
    fail("{\"model\":\"m\",\"max_tokens\":8,\"messages\":[{\"role\":\"user\",\"content\":[{"
         "\"type\":\"text\",\"text\":\"\"}]}]}",
         "messages.0.content.0", "non-empty");
    fail("{\"model\":\"m\",\"max_tokens\":8,\"messages\":[{\"role\":\"user\",\"content\":\"hi\","
         "\"name\":\"bob\"}]}",
         "messages.0.name", "Extra inputs");
}

Test(anthropic, unsupported_blocks_and_features_are_named) {
    fail("{\"model\":\"m\",\"max_tokens\":8,\"messages\":[{\"role\":\"user\",\"content\":[{"
         "\"type\":\"image\",\"source\":{\"type\":\"base64\",\"media_type\":\"image/png\","
         "\"data\":\"AA==\"}}]}]}",
         "messages.0.content.0.type", "image blocks are not supported");
    fail("{\"model\":\"m\",\"max_tokens\":8,\"messages\":[{\"role\":\"user\",\"content\":[{"
         "\"type\":\"document\",\"source\":{}}]}]}",
         "messages.0.content.0.type", "document blocks are not supported");
    fail("{\"model\":\"m\",\"max_tokens\":8,\"system\":[{\"type\":\"image\"}],\"messages\":[{"
         "\"role\":\"user\",\"content\":\"hi\"}]}",
         "system.0.type", "image blocks");
    fail(with(",\"thinking\":{\"type\":\"enabled\",\"budget_tokens\":1024}"), "thinking",
         "extended thinking is not supported");
    fail(with(",\"tools\":[{\"type\":\"web_search_20250305\",\"name\":\"web_search\"}]"),
         "tools.0.type", "server tool 'web_search_20250305' is not supported");
    fail(with(",\"mcp_servers\":[]"), "mcp_servers", "not supported");
    fail(with(",\"output_config\":{\"effort\":\"low\"}"), "output_config", "not supported");
    fail(with(",\"speed\":\"fast\""), "speed", "fast mode is not supported");
    fail("{\"model\":\"m\",\"max_tokens\":8,\"messages\":[{\"role\":\"user\",\"content\":[{"
         "\"type\":\"text\",\"text\":\"hi\",\"citations\":[{\"type\":\"char_location\"}]}]}]}",
         "messages.0.content.0.citations", "citations are not supported");
}

Test(anthropic, tool_turns_follow_anthropics_rules) {
    /* a tool_result with no tool_use before it */
    fail("{\"model\":\"m\",\"max_tokens\":8,\"messages\":[{\"role\":\"user\",\"content\":[{"
         "\"type\":\"tool_result\",\"tool_use_id\":\"toolu_9\",\"content\":\"x\"}]}]}",
         "messages.0.content.0", "unexpected `tool_use_id` found in `tool_result` blocks: toolu_9");
    const char *head = "{\"model\":\"m\",\"max_tokens\":8,\"messages\":[{\"role\":\"user\","
                       "\"content\":\"q\"},{\"role\":\"assistant\",\"content\":[{\"type\":"
                       "\"tool_use\",\"id\":\"toolu_1\",\"name\":\"f\",\"input\":{}}]},";
    char body[1024];
    /* an id that the call before lacks */
    snprintf(body, sizeof body,
             "%s{\"role\":\"user\",\"content\":[{\"type\":\"tool_result\",\"tool_use_id\":"
             "\"toolu_2\"}]}]}",
             head);
    fail(body, "messages.2.content.0", "unexpected `tool_use_id`");
    /* a call without its result */
    snprintf(body, sizeof body, "%s{\"role\":\"user\",\"content\":\"and?\"}]}", head);
    fail(body, "messages.1", "without `tool_result` blocks immediately after: toolu_1");
    /* text before the results */
    snprintf(body, sizeof body,
             "%s{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"x\"},{\"type\":"
             "\"tool_result\",\"tool_use_id\":\"toolu_1\"}]}]}",
             head);
    fail(body, "messages.2.content.1", "must come first");
    /* a tool_use in a user message, a bad name, input not an object */
    fail("{\"model\":\"m\",\"max_tokens\":8,\"messages\":[{\"role\":\"user\",\"content\":[{"
         "\"type\":\"tool_use\",\"id\":\"a\",\"name\":\"f\",\"input\":{}}]}]}",
         "messages.0.content.0.type", "not allowed in a user message");
    snprintf(body, sizeof body,
             "{\"model\":\"m\",\"max_tokens\":8,\"messages\":[{\"role\":\"user\",\"content\":"
             "\"q\"},{\"role\":\"assistant\",\"content\":[{\"type\":\"tool_use\",\"id\":\"a\","
             "\"name\":\"f g\",\"input\":{}}]},{\"role\":\"user\",\"content\":\"x\"}]}");
    fail(body, "messages.1.content.0.name", "should match pattern");
    snprintf(body, sizeof body,
             "{\"model\":\"m\",\"max_tokens\":8,\"messages\":[{\"role\":\"user\",\"content\":"
             "\"q\"},{\"role\":\"assistant\",\"content\":[{\"type\":\"tool_use\",\"id\":\"a\","
             "\"name\":\"f\",\"input\":[1]}]},{\"role\":\"user\",\"content\":\"x\"}]}");
    fail(body, "'messages.1.content.0.input'", "must be an object");
    /* tools: names unique, a schema that compiles */
    fail(with(",\"tools\":[{\"name\":\"f\",\"input_schema\":{}},{\"name\":\"f\",\"input_schema\":"
              "{}}]"),
         "tools.1.name", "unique");
    fail(with(",\"tools\":[{\"name\":\"f\"}]"), "tools.0.input_schema", "Field required");
    fail(with(",\"tools\":[{\"name\":\"f\",\"input_schema\":{\"type\":\"object\",\"not\":{}}}]"),
         "'tools.0.input_schema'", "not");
}

Test(anthropic, cache_control_limits) {
    char body[2048];
    size_t n =
        (size_t)snprintf(body, sizeof body, "{\"model\":\"m\",\"max_tokens\":8,\"system\":[");
    for (int i = 0; i < 5; i++)
        n += (size_t)snprintf(body + n, sizeof body - n,
                              "%s{\"type\":\"text\",\"text\":\"s%d\",\"cache_control\":{\"type\":"
                              "\"ephemeral\"}}",
                              i ? "," : "", i);
    snprintf(body + n, sizeof body - n, "],\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}");
    fail(body, "system.4.cache_control",
         "A maximum of 4 blocks with cache_control may be provided. Found 5.");
    fail("{\"model\":\"m\",\"max_tokens\":8,\"system\":[{\"type\":\"text\",\"text\":\"a\","
         "\"cache_control\":{\"type\":\"ephemeral\"}},{\"type\":\"text\",\"text\":\"b\","
         "\"cache_control\":{\"type\":\"ephemeral\",\"ttl\":\"1h\"}}],\"messages\":[{\"role\":"
         "\"user\",\"content\":\"hi\"}]}",
         "system.1.cache_control", "must not come after a ttl='5m' one");
    fail("{\"model\":\"m\",\"max_tokens\":8,\"system\":[{\"type\":\"text\",\"text\":\"a\","
         "\"cache_control\":{\"type\":\"persistent\"}}],\"messages\":[{\"role\":\"user\","
         "\"content\":\"hi\"}]}",
         "system.0.cache_control.type", "Input should be 'ephemeral'");
    fail("{\"model\":\"m\",\"max_tokens\":8,\"system\":[{\"type\":\"text\",\"text\":\"a\","
         "\"cache_control\":{\"type\":\"ephemeral\",\"ttl\":\"10m\"}}],\"messages\":[{\"role\":"
         "\"user\",\"content\":\"hi\"}]}",
         "system.0.cache_control.ttl", "'5m', '1h'");
}

Test(anthropic, errors_in_anthropics_shape) {
    cr_assert_str_eq(anthropic_error_type(400), "invalid_request_error");
    cr_assert_str_eq(anthropic_error_type(401), "authentication_error");
    cr_assert_str_eq(anthropic_error_type(403), "permission_error");
    cr_assert_str_eq(anthropic_error_type(404), "not_found_error");
    cr_assert_str_eq(anthropic_error_type(413), "request_too_large");
    cr_assert_str_eq(anthropic_error_type(429), "rate_limit_error");
    cr_assert_str_eq(anthropic_error_type(503), "overloaded_error");
    cr_assert_str_eq(anthropic_error_type(500), "api_error");
    api_error e = {.status = 404};
    snprintf(e.message, sizeof e.message, "no such model \xff");
    char *s = anthropic_error_json(&e);
    json_t *v = json_loads(s, 0, NULL);
    cr_assert_not_null(v, "%s", s);
    cr_assert_str_eq(json_string_value(json_object_get(v, "type")), "error");
    json_t *err = json_object_get(v, "error");
    cr_assert_str_eq(json_string_value(json_object_get(err, "type")), "not_found_error");
    cr_assert_str_eq(json_string_value(json_object_get(err, "message")), "no such model ?");
    json_decref(v);
    free(s);
}
