/* The Responses API's request side and store (server/api/responses.h): every field read onto the
 * chat request and repeated in the response object's settings; input items (strings, messages with
 * parts, function calls and their outputs) turned into the chat turns the template writes, after
 * a stored conversation; the tool-turn checks in the API's words; every refused field named; and
 * the store's bounds, eviction order and namespaces. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/api/responses.h"

/* ---------------------------------------------------------------- helpers */

static void parse_ok(const char *body, resp_request *r) {
    api_error err = {0};
    int rc = resp_parse(body, strlen(body), r, &err);
    cr_assert_eq(rc, 0, "parse failed: %s (param '%s') for %s", err.message, err.param, body);
}

/* Parses and translates body (prev: a stored conversation's items as JSON text, or NULL). */
static void conv_ok(const char *body, const char *prev, resp_request *r) {
    parse_ok(body, r);
    json_t *p = prev ? json_loads(prev, 0, NULL) : NULL;
    cr_assert(!prev || p, "bad prev %s", prev);
    api_error err = {0};
    int rc = resp_conversation(r, p, &err);
    json_decref(p);
    cr_assert_eq(rc, 0, "conversation failed: %s (param '%s') for %s", err.message, err.param,
                 body);
}

/* body fails to parse (or, parsed, to translate after prev) with a 400 naming param, its message
 * containing msg; the request is left freeable. */
static void fail_prev(const char *body, const char *prev, const char *param, const char *msg) {
    resp_request r;
    api_error err = {0};
    int rc = resp_parse(body, strlen(body), &r, &err);
    if (rc == 0) {
        json_t *p = prev ? json_loads(prev, 0, NULL) : NULL;
        rc = resp_conversation(&r, p, &err);
        json_decref(p);
    } else {
        cr_assert_null(r.rq.model, "a failed parse left the request filled: %s", body);
        cr_assert_null(r.input);
        cr_assert_null(r.echo);
    }
    cr_assert_eq(rc, -1, "accepted: %s", body);
    cr_assert_eq(err.status, 400, "status %d for %s (%s)", err.status, body, err.message);
    cr_assert_str_eq(err.type, "invalid_request_error");
    cr_assert_str_eq(err.param, param, "param '%s' for %s (%s)", err.param, body, err.message);
    cr_assert_not_null(strstr(err.message, msg), "message '%s' lacks '%s' for %s", err.message, msg,
                       body);
    resp_request_free(&r);
}

static void fail(const char *body, const char *param, const char *msg) {
    fail_prev(body, NULL, param, msg);
}

/* A body with input "hi" and extra fields spliced in (",\"x\":1"). */
static const char *with(const char *extra) {
    static char buf[4096];
    snprintf(buf, sizeof buf, "{\"model\":\"m\",\"input\":\"hi\"%s}", extra);
    return buf;
}

static const json_t *echo(const resp_request *r, const char *key) {
    const json_t *v = json_object_get(r->echo, key);
    cr_assert_not_null(v, "echo lacks '%s'", key);
    return v;
}

/* ---------------------------------------------------------------- requests */

Test(responses, string_input_is_a_user_message_with_the_apis_defaults) {
    resp_request r;
    conv_ok(with(""), NULL, &r);
    cr_assert_str_eq(r.rq.model, "m");
    cr_assert_eq(r.rq.kind, API_CHAT);
    cr_assert_eq(r.rq.n, 1);
    cr_assert_eq(r.rq.max_tokens, -1);
    cr_assert_not(r.rq.stream);
    cr_assert(r.store);
    cr_assert(r.rq.cache);
    cr_assert_eq(r.rq.tool_choice, CHAT_TOOL_NONE);
    cr_assert_null(r.rq.gbnf);
    cr_assert_null(r.instructions);
    cr_assert_null(r.previous_response_id);
    cr_assert_eq(r.rq.n_messages, 1);
    cr_assert_str_eq(r.rq.messages[0].role, "user");
    cr_assert_str_eq(r.rq.messages[0].content, "hi");
    char *in = json_dumps(r.input, JSON_COMPACT);
    cr_assert_str_eq(in, "[{\"type\":\"message\",\"role\":\"user\",\"content\":[\"hi\"]}]");
    free(in);
    cr_assert_str_eq(json_string_value(echo(&r, "tool_choice")), "auto");
    cr_assert_eq(json_array_size(echo(&r, "tools")), 0);
    cr_assert(json_is_true(echo(&r, "parallel_tool_calls")));
    cr_assert(json_is_true(echo(&r, "store")));
    cr_assert_float_eq(json_number_value(echo(&r, "temperature")), 1.0, 0);
    cr_assert_float_eq(json_number_value(echo(&r, "top_p")), 1.0, 0);
    cr_assert(json_is_null(echo(&r, "max_output_tokens")));
    cr_assert(json_is_null(echo(&r, "instructions")));
    cr_assert_str_eq(json_string_value(echo(&r, "truncation")), "disabled");
    cr_assert_eq(json_object_size(echo(&r, "metadata")), 0);
    const json_t *fmt = json_object_get(echo(&r, "text"), "format");
    cr_assert_str_eq(json_string_value(json_object_get(fmt, "type")), "text");
    resp_request_free(&r);
    cr_assert_null(r.rq.model);
    resp_request_free(&r); /* twice is harmless */
}

Test(responses, every_field_is_read_and_repeated) {
    resp_request r;
    conv_ok("{\"model\":\"m\",\"input\":\"hi\",\"instructions\":\"Be brief.\","
            "\"max_output_tokens\":24,\"temperature\":0.25,\"top_p\":0.5,\"stream\":true,"
            "\"store\":false,\"previous_response_id\":\"resp_1\",\"user\":\"u\","
            "\"metadata\":{\"k\":\"v\"},\"parallel_tool_calls\":false,"
            "\"tools\":[{\"type\":\"function\",\"name\":\"f\",\"description\":\"d\","
            "\"parameters\":{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}}},"
            "\"strict\":false},{\"type\":\"function\",\"name\":\"g\"}],"
            "\"tool_choice\":{\"type\":\"function\",\"name\":\"g\"},\"cache_salt\":\"s\","
            "\"seed\":7,\"max_tool_calls\":3,\"prompt_cache_key\":\"k\","
            "\"safety_identifier\":\"x\",\"background\":false,\"include\":[],"
            "\"reasoning\":{\"effort\":\"none\"},\"service_tier\":\"auto\","
            "\"truncation\":\"disabled\",\"top_logprobs\":0,"
            "\"stream_options\":{\"include_obfuscation\":false}}",
            NULL, &r);
    cr_assert_str_eq(r.instructions, "Be brief.");
    cr_assert_eq(r.rq.max_tokens, 24);
    cr_assert_float_eq(r.rq.sampling.temperature, 0.25f, 0);
    cr_assert_float_eq(r.rq.sampling.top_p, 0.5f, 0);
    cr_assert(r.rq.stream);
    cr_assert_not(r.store);
    cr_assert_str_eq(r.previous_response_id, "resp_1");
    cr_assert_str_eq(r.rq.user, "u");
    cr_assert_str_eq(r.rq.cache_salt, "s");
    cr_assert(r.rq.seed_given);
    cr_assert_not(r.rq.parallel_tool_calls);
    cr_assert_eq(r.rq.n_tools, 2);
    cr_assert_str_eq(r.rq.tools[0].name, "f");
    cr_assert_str_eq(r.rq.tools[0].description, "d");
    cr_assert_not_null(strstr(r.rq.tools[0].parameters, "\"integer\""));
    cr_assert_null(r.rq.tools[1].parameters);
    cr_assert_eq(r.rq.tool_choice, CHAT_TOOL_NAMED);
    cr_assert_str_eq(r.rq.tool_choice_name, "g");
    /* the instructions are the first (system) turn */
    cr_assert_eq(r.rq.n_messages, 2);
    cr_assert_str_eq(r.rq.messages[0].role, "system");
    cr_assert_str_eq(r.rq.messages[0].content, "Be brief.");
    cr_assert_float_eq(json_number_value(echo(&r, "temperature")), 0.25, 0);
    cr_assert_eq(json_integer_value(echo(&r, "max_output_tokens")), 24);
    cr_assert_eq(json_integer_value(echo(&r, "max_tool_calls")), 3);
    cr_assert_str_eq(json_string_value(echo(&r, "previous_response_id")), "resp_1");
    cr_assert_str_eq(json_string_value(echo(&r, "prompt_cache_key")), "k");
    cr_assert_str_eq(json_string_value(json_object_get(echo(&r, "metadata"), "k")), "v");
    cr_assert(json_is_false(echo(&r, "store")));
    const json_t *t0 = json_array_get(echo(&r, "tools"), 0),
                 *t1 = json_array_get(echo(&r, "tools"), 1);
    cr_assert_str_eq(json_string_value(json_object_get(t0, "name")), "f");
    cr_assert(json_is_false(json_object_get(t0, "strict")));
    cr_assert(json_is_true(json_object_get(t1, "strict"))); /* the Responses API's default */
    cr_assert(json_is_null(json_object_get(t1, "parameters")));
    const json_t *tc = echo(&r, "tool_choice");
    cr_assert_str_eq(json_string_value(json_object_get(tc, "name")), "g");
    resp_request_free(&r);
}

Test(responses, text_formats_become_the_grammar) {
    resp_request r;
    parse_ok(with(",\"text\":{\"format\":{\"type\":\"json_schema\",\"name\":\"city\",\"strict\":"
                  "true,\"schema\":{\"type\":\"object\",\"properties\":{\"n\":{\"type\":"
                  "\"integer\"}},\"required\":[\"n\"]}}}"),
             &r);
    cr_assert_not_null(r.rq.gbnf);
    cr_assert_str_eq(r.rq.gbnf_param, "text.format.schema");
    const json_t *fmt = json_object_get(echo(&r, "text"), "format");
    cr_assert_str_eq(json_string_value(json_object_get(fmt, "type")), "json_schema");
    cr_assert_str_eq(json_string_value(json_object_get(fmt, "name")), "city");
    cr_assert(json_is_true(json_object_get(fmt, "strict")));
    cr_assert_not_null(json_object_get(json_object_get(fmt, "schema"), "properties"));
    resp_request_free(&r);

    parse_ok(with(",\"text\":{\"format\":{\"type\":\"json_object\"}}"), &r);
    cr_assert_not_null(r.rq.gbnf);
    cr_assert_str_eq(r.rq.gbnf_param, "text.format");
    resp_request_free(&r);

    parse_ok(with(",\"text\":{\"format\":{\"type\":\"text\"},\"verbosity\":\"medium\"}"), &r);
    cr_assert_null(r.rq.gbnf);
    resp_request_free(&r);
}

Test(responses, items_become_chat_turns) {
    resp_request r;
    conv_ok("{\"model\":\"m\",\"instructions\":\"I\",\"input\":["
            "{\"role\":\"developer\",\"content\":\"dev\"},"
            "{\"type\":\"message\",\"role\":\"user\",\"content\":[{\"type\":\"input_text\","
            "\"text\":\"a\"},{\"type\":\"input_text\",\"text\":\"bc\"}]},"
            "{\"type\":\"message\",\"id\":\"msg_1\",\"status\":\"completed\",\"role\":"
            "\"assistant\",\"content\":[{\"type\":\"output_text\",\"text\":\"let me look\","
            "\"annotations\":[]}]},"
            "{\"type\":\"function_call\",\"id\":\"fc_1\",\"call_id\":\"A\",\"name\":\"f\","
            "\"arguments\":\"{\\\"x\\\": 1}\",\"status\":\"completed\"},"
            "{\"type\":\"function_call\",\"call_id\":\"B\",\"name\":\"g\",\"arguments\":\"\"},"
            "{\"type\":\"function_call_output\",\"call_id\":\"B\",\"output\":\"two\"},"
            "{\"type\":\"function_call_output\",\"call_id\":\"A\",\"output\":[{\"type\":"
            "\"input_text\",\"text\":\"o\"},{\"type\":\"input_text\",\"text\":\"ne\"}]},"
            "{\"role\":\"user\",\"content\":\"thanks\"}]}",
            NULL, &r);
    const chat_message *m = r.rq.messages;
    cr_assert_eq(r.rq.n_messages, 7);
    const char *roles[] = {"system", "system", "user", "assistant", "tool", "tool", "user"};
    const char *contents[] = {"I", "dev", "abc", "let me look", "two", "one", "thanks"};
    for (int i = 0; i < 7; i++) {
        cr_assert_str_eq(m[i].role, roles[i], "message %d", i);
        cr_assert_str_eq(m[i].content, contents[i], "message %d", i);
    }
    /* two text parts: where each ends, for blend's segments */
    cr_assert_eq(m[2].n_parts, 2);
    cr_assert_eq(m[2].part_ends[0], 1);
    cr_assert_eq(m[2].part_ends[1], 3);
    /* the calls join the assistant's turn, in order */
    cr_assert_eq(m[3].n_tool_calls, 2);
    cr_assert_str_eq(m[3].tool_calls[0].id, "A");
    cr_assert_str_eq(m[3].tool_calls[0].name, "f");
    cr_assert_str_eq(m[3].tool_calls[0].arguments, "{\"x\": 1}");
    cr_assert_str_eq(m[3].tool_calls[1].id, "B");
    cr_assert_str_eq(m[3].tool_calls[1].arguments, "");
    cr_assert_str_eq(m[4].tool_call_id, "B");
    cr_assert_str_eq(m[5].tool_call_id, "A");
    resp_request_free(&r);
}

Test(responses, calls_without_text_open_their_own_turn) {
    resp_request r;
    conv_ok("{\"model\":\"m\",\"input\":[{\"role\":\"user\",\"content\":\"q\"},"
            "{\"type\":\"function_call\",\"call_id\":\"A\",\"name\":\"f\",\"arguments\":\"{}\"},"
            "{\"type\":\"function_call_output\",\"call_id\":\"A\",\"output\":\"r\"},"
            "{\"type\":\"function_call\",\"call_id\":\"B\",\"name\":\"f\",\"arguments\":\"{}\"},"
            "{\"type\":\"function_call_output\",\"call_id\":\"B\",\"output\":\"s\"}]}",
            NULL, &r);
    cr_assert_eq(r.rq.n_messages, 5);
    cr_assert_str_eq(r.rq.messages[1].role, "assistant");
    cr_assert_str_eq(r.rq.messages[1].content, "");
    cr_assert_eq(r.rq.messages[1].n_tool_calls, 1);
    cr_assert_str_eq(r.rq.messages[3].role, "assistant");
    cr_assert_str_eq(r.rq.messages[3].tool_calls[0].id, "B");
    resp_request_free(&r);
}

Test(responses, a_stored_conversation_comes_after_the_instructions) {
    resp_request r;
    const char *prev = "[{\"type\":\"message\",\"role\":\"user\",\"content\":[\"q1\"]},"
                       "{\"type\":\"function_call\",\"call_id\":\"C\",\"name\":\"f\","
                       "\"arguments\":\"{}\"}]";
    conv_ok("{\"model\":\"m\",\"instructions\":\"I\",\"input\":[{\"type\":"
            "\"function_call_output\",\"call_id\":\"C\",\"output\":\"r\"},{\"role\":\"user\","
            "\"content\":\"q2\"}]}",
            prev, &r);
    cr_assert_eq(r.rq.n_messages, 5);
    const char *roles[] = {"system", "user", "assistant", "tool", "user"};
    for (int i = 0; i < 5; i++) cr_assert_str_eq(r.rq.messages[i].role, roles[i]);
    cr_assert_str_eq(r.rq.messages[1].content, "q1");
    cr_assert_str_eq(r.rq.messages[2].tool_calls[0].id, "C");
    cr_assert_str_eq(r.rq.messages[3].tool_call_id, "C");
    /* only the new input is the request's own: the store keeps the rest */
    cr_assert_eq(json_array_size(r.input), 2);
    resp_request_free(&r);
}

Test(responses, tool_turns_are_checked_in_the_apis_words) {
    fail("{\"model\":\"m\",\"input\":[{\"type\":\"function_call_output\",\"call_id\":\"x\","
         "\"output\":\"o\"}]}",
         "input[0].call_id", "No tool call found for function call output with call_id x");
    fail("{\"model\":\"m\",\"input\":[{\"type\":\"function_call\",\"call_id\":\"A\",\"name\":"
         "\"f\",\"arguments\":\"{}\"},{\"type\":\"function_call_output\",\"call_id\":\"Z\","
         "\"output\":\"o\"}]}",
         "input[1].call_id", "No tool call found for function call output with call_id Z");
    fail("{\"model\":\"m\",\"input\":[{\"type\":\"function_call\",\"call_id\":\"A\",\"name\":"
         "\"f\",\"arguments\":\"{}\"},{\"type\":\"function_call_output\",\"call_id\":\"A\","
         "\"output\":\"o\"},{\"type\":\"function_call_output\",\"call_id\":\"A\",\"output\":"
         "\"p\"}]}",
         "input[2].call_id", "Duplicate function call output for call_id A");
    fail("{\"model\":\"m\",\"input\":[{\"type\":\"function_call\",\"call_id\":\"A\",\"name\":"
         "\"f\",\"arguments\":\"{}\"},{\"role\":\"user\",\"content\":\"next\"}]}",
         "input[0]", "No tool output found for function call A");
    /* the stored turn's call, left unanswered by the new input */
    fail_prev(with(""),
              "[{\"type\":\"function_call\",\"call_id\":\"S\",\"name\":\"f\",\"arguments\":"
              "\"{}\"}]",
              "input", "No tool output found for function call S");
}

Test(responses, unsupported_fields_are_named) {
    static const char *const cases[][3] = {
        {",\"background\":true", "background", "not supported"},
        {",\"conversation\":\"conv_1\"", "conversation", "previous_response_id"},
        {",\"prompt\":{\"id\":\"p\"}", "prompt", "not supported"},
        {",\"include\":[\"message.output_text.logprobs\"]", "include[0]",
         "'message.output_text.logprobs' is not supported"},
        {",\"include\":\"x\"", "include", "must be an array"},
        {",\"reasoning\":{\"effort\":\"high\"}", "reasoning.effort", "'high' is not supported"},
        {",\"reasoning\":{\"summary\":\"auto\"}", "reasoning.summary", "not supported"},
        {",\"service_tier\":\"flex\"", "service_tier", "'flex' is not supported"},
        {",\"truncation\":\"auto\"", "truncation", "context_length_exceeded"},
        {",\"top_logprobs\":2", "top_logprobs", "not supported"},
        {",\"text\":{\"verbosity\":\"low\"}", "text.verbosity", "only 'medium'"},
        {",\"tools\":[{\"type\":\"web_search\"}]", "tools[0].type",
         "'web_search' is not supported"},
        {",\"tools\":[{\"type\":\"file_search\",\"vector_store_ids\":[]}]", "tools[0].type",
         "function tools only"},
        {",\"tools\":[{\"type\":\"function\",\"name\":\"f\"}],\"tool_choice\":{\"type\":"
         "\"web_search_preview\"}",
         "tool_choice.type", "not supported"},
        {",\"messages\":[]", "messages", "the Responses API takes 'input'"},
        {",\"response_format\":{\"type\":\"json_object\"}", "response_format", "'text.format'"},
        {",\"max_tokens\":5", "max_tokens", "'max_output_tokens'"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        fail(with(cases[i][0]), cases[i][1], cases[i][2]);
    fail("{\"model\":\"m\",\"input\":[{\"role\":\"user\",\"content\":[{\"type\":\"input_image\","
         "\"image_url\":\"http://x/i.png\"}]}]}",
         "input[0].content[0].type", "read text only");
    fail("{\"model\":\"m\",\"input\":[{\"role\":\"user\",\"content\":[{\"type\":\"input_file\","
         "\"file_id\":\"f\"}]}]}",
         "input[0].content[0].type", "'input_file' is not supported");
    fail("{\"model\":\"m\",\"input\":[{\"type\":\"item_reference\",\"id\":\"msg_1\"}]}",
         "input[0].type", "item references are not supported");
    fail("{\"model\":\"m\",\"input\":[{\"type\":\"reasoning\",\"id\":\"rs\",\"summary\":[]}]}",
         "input[0].type", "reasoning items are not supported");
    fail("{\"model\":\"m\",\"input\":[{\"type\":\"web_search_call\",\"id\":\"ws\"}]}",
         "input[0].type", "'web_search_call' is not supported");
}

Test(responses, bad_values_are_400s_naming_the_field) {
    fail("{\"input\":\"hi\"}", "model", "'model' is required");
    fail("{\"model\":\"m\"}", "input", "'input' is required");
    fail("{\"model\":\"m\",\"input\":[]}", "input", "must not be empty");
    fail("{\"model\":\"m\",\"input\":3}", "input", "a string or an array of input items");
    fail("{\"model\":\"m\",\"input\":\"a\\u0000b\"}", "input", "NUL");
    fail("{\"model\":\"m\",\"input\":[\"hi\"]}", "input[0]", "must be an object");
    fail("{\"model\":\"m\",\"input\":[{\"content\":\"hi\"}]}", "input[0].type", "is required");
    fail("{\"model\":\"m\",\"input\":[{\"role\":\"tool\",\"content\":\"x\"}]}", "input[0].role",
         "function_call_output");
    fail("{\"model\":\"m\",\"input\":[{\"role\":\"user\"}]}", "input[0].content", "is required");
    fail("{\"model\":\"m\",\"input\":[{\"role\":\"user\",\"content\":[{\"type\":\"input_text\"}]"
         "}]}",
         "input[0].content[0].text", "is required");
    fail("{\"model\":\"m\",\"input\":[{\"type\":\"function_call\",\"call_id\":\"A\",\"name\":"
         "\"f g\",\"arguments\":\"{}\"}]}",
         "input[0].name", "1 to 64");
    fail("{\"model\":\"m\",\"input\":[{\"type\":\"function_call\",\"call_id\":\"A\",\"name\":"
         "\"f\",\"arguments\":\"{oops\"}]}",
         "input[0].arguments", "is not JSON");
    fail("{\"model\":\"m\",\"input\":[{\"type\":\"function_call\",\"name\":\"f\",\"arguments\":"
         "\"{}\"}]}",
         "input[0].call_id", "is required");
    fail("{\"model\":\"m\",\"input\":[{\"type\":\"function_call_output\",\"call_id\":\"A\"}]}",
         "input[0].output", "is required");
    fail(with(",\"max_output_tokens\":0"), "max_output_tokens", "at least 1");
    fail(with(",\"temperature\":3"), "temperature", "between 0 and 2");
    fail(with(",\"store\":\"yes\""), "store", "a boolean");
    fail(with(",\"instructions\":7"), "instructions", "a string");
    fail(with(",\"previous_response_id\":\"\""), "previous_response_id", "1 to 128 bytes");
    fail(with(",\"metadata\":{\"a\":1}"), "metadata.a", "a string");
    fail(with(",\"metadata\":{\"1\":\"\",\"2\":\"\",\"3\":\"\",\"4\":\"\",\"5\":\"\",\"6\":\"\","
              "\"7\":\"\",\"8\":\"\",\"9\":\"\",\"10\":\"\",\"11\":\"\",\"12\":\"\",\"13\":\"\","
              "\"14\":\"\",\"15\":\"\",\"16\":\"\",\"17\":\"\"}"),
         "metadata", "more than the limit of 16");
    fail(with(",\"tool_choice\":\"required\""), "tool_choice", "no 'tools'");
    fail(with(",\"tool_choice\":\"sometimes\""), "tool_choice", "must be 'none', 'auto'");
    fail(with(",\"tools\":[{\"type\":\"function\",\"name\":\"f\"}],\"tool_choice\":{\"type\":"
              "\"function\",\"name\":\"g\"}"),
         "tool_choice.name", "'g' is not in 'tools'");
    fail(with(",\"tools\":[{\"type\":\"function\",\"name\":\"f\"},{\"type\":\"function\","
              "\"name\":\"f\"}]"),
         "tools[1].name", "two tools are named 'f'");
    fail(with(",\"tools\":[{\"type\":\"function\",\"name\":\"f\",\"parameters\":{\"not\":{}}}]"),
         "tools[0].parameters", "unsupported keyword 'not'");
    fail(with(",\"tools\":[{\"type\":\"function\",\"name\":\"f\",\"strict\":1}]"),
         "tools[0].strict", "a boolean");
    fail(with(",\"text\":{\"format\":{\"type\":\"json_schema\",\"schema\":{}}}"),
         "text.format.name", "is required");
    fail(with(",\"text\":{\"format\":{\"type\":\"json_schema\",\"name\":\"n\"}}"),
         "text.format.schema", "is required");
    fail(with(",\"text\":{\"format\":{\"type\":\"yaml\"}}"), "text.format.type", "'yaml'");
    fail(with(",\"text\":{\"format\":{\"type\":\"json_schema\",\"name\":\"n\",\"schema\":{"
              "\"type\":\"object\",\"patternProperties\":{}}}}"),
         "text.format.schema", "patternProperties");
    fail(with(",\"text\":{\"format\":{\"type\":\"json_object\"}},\"tools\":[{\"type\":"
              "\"function\",\"name\":\"f\"}]"),
         "text.format", "no tool can be called");
    fail("{\"model\":\"m\",\"input\":", "", "malformed JSON");
    fail("[1]", "", "must be a JSON object");
}

Test(responses, a_format_with_tools_is_fine_when_none_may_be_called) {
    resp_request r;
    parse_ok(with(",\"text\":{\"format\":{\"type\":\"json_object\"}},\"tools\":[{\"type\":"
                  "\"function\",\"name\":\"f\"}],\"tool_choice\":\"none\""),
             &r);
    cr_assert_eq(r.rq.tool_choice, CHAT_TOOL_NONE);
    cr_assert_not_null(r.rq.gbnf);
    cr_assert_str_eq(json_string_value(echo(&r, "tool_choice")), "none");
    resp_request_free(&r);
}

/* ---------------------------------------------------------------- the store */

static cache_key ns_of(const char *tenant) {
    cache_key k;
    cache_namespace((const uint8_t *)tenant, strlen(tenant), NULL, &k);
    return k;
}

static bool has(resp_store *st, const cache_key *ns, const char *id) {
    return resp_store_get(st, ns, id, NULL, NULL);
}

Test(responses_store, put_get_delete) {
    resp_store *st = resp_store_create(8, 1 << 20, 1, 0);
    cr_assert_not_null(st);
    cache_key a = ns_of("a");
    cr_assert_eq(resp_store_put(st, 0, &a, "resp_1", "{\"id\":\"resp_1\"}", "[1]"), 0);
    char *resp = NULL, *conv = NULL;
    cr_assert(resp_store_get(st, &a, "resp_1", &resp, &conv));
    cr_assert_str_eq(resp, "{\"id\":\"resp_1\"}");
    cr_assert_str_eq(conv, "[1]");
    free(resp);
    free(conv);
    cr_assert_not(resp_store_get(st, &a, "resp_2", &resp, &conv));
    cr_assert_null(resp);
    cr_assert_null(conv);
    /* the same id again replaces it */
    cr_assert_eq(resp_store_put(st, 0, &a, "resp_1", "{}", "[2]"), 0);
    cr_assert(resp_store_get(st, &a, "resp_1", NULL, &conv));
    cr_assert_str_eq(conv, "[2]");
    free(conv);
    resp_store_stats s;
    resp_store_stats_get(st, &s);
    cr_assert_eq(s.count, 1);
    cr_assert(resp_store_delete(st, &a, "resp_1"));
    cr_assert_not(resp_store_delete(st, &a, "resp_1"));
    cr_assert_not(has(st, &a, "resp_1"));
    resp_store_stats_get(st, &s);
    cr_assert_eq(s.count, 0);
    cr_assert_eq(s.bytes, 0);
    resp_store_destroy(st);
}

Test(responses_store, namespaces_do_not_see_each_other) {
    resp_store *st = resp_store_create(8, 1 << 20, 1, 0);
    cache_key a = ns_of("key-a"), b = ns_of("key-b");
    cr_assert_eq(resp_store_put(st, 0, &a, "resp_x", "{\"a\":1}", "[]"), 0);
    cr_assert(has(st, &a, "resp_x"));
    cr_assert_not(has(st, &b, "resp_x"));
    cr_assert_not(resp_store_delete(st, &b, "resp_x"));
    cr_assert(has(st, &a, "resp_x"));
    /* the same id in another namespace is another entry */
    cr_assert_eq(resp_store_put(st, 0, &b, "resp_x", "{\"b\":1}", "[]"), 0);
    char *resp;
    cr_assert(resp_store_get(st, &a, "resp_x", &resp, NULL));
    cr_assert_str_eq(resp, "{\"a\":1}");
    free(resp);
    cr_assert(resp_store_get(st, &b, "resp_x", &resp, NULL));
    cr_assert_str_eq(resp, "{\"b\":1}");
    free(resp);
    resp_store_destroy(st);
}

Test(responses_store, the_count_bound_evicts_the_least_recently_used) {
    resp_store *st = resp_store_create(3, 1 << 20, 1, 0);
    cache_key a = ns_of("a");
    cr_assert_eq(resp_store_put(st, 0, &a, "r1", "{}", "[]"), 0);
    cr_assert_eq(resp_store_put(st, 0, &a, "r2", "{}", "[]"), 0);
    cr_assert_eq(resp_store_put(st, 0, &a, "r3", "{}", "[]"), 0);
    cr_assert(has(st, &a, "r1")); /* used: r2 is now the oldest */
    cr_assert_eq(resp_store_put(st, 0, &a, "r4", "{}", "[]"), 0);
    cr_assert_not(has(st, &a, "r2"));
    cr_assert(has(st, &a, "r1") && has(st, &a, "r3") && has(st, &a, "r4"));
    resp_store_stats s;
    resp_store_stats_get(st, &s);
    cr_assert_eq(s.count, 3);
    cr_assert_eq(s.evictions, 1);
    resp_store_destroy(st);
}

/* A string of n - 1 bytes c (malloc'd). */
static char *filled(size_t n, char c) {
    char *s = malloc(n);
    cr_assert_not_null(s);
    memset(s, c, n - 1);
    s[n - 1] = '\0';
    return s;
}

Test(responses_store, the_byte_bound_evicts_and_refuses_what_cannot_fit) {
    char *big = filled(2000, 'x');
    /* room for two entries of ~2 KB, not three */
    resp_store *st = resp_store_create(100, 5000, 1, 0);
    cache_key a = ns_of("a");
    cr_assert_eq(resp_store_put(st, 0, &a, "r1", big, "[]"), 0);
    cr_assert_eq(resp_store_put(st, 0, &a, "r2", big, "[]"), 0);
    cr_assert_eq(resp_store_put(st, 0, &a, "r3", big, "[]"), 0);
    cr_assert_not(has(st, &a, "r1"));
    cr_assert(has(st, &a, "r2") && has(st, &a, "r3"));
    resp_store_stats s;
    resp_store_stats_get(st, &s);
    cr_assert_leq(s.bytes, 5000);
    cr_assert_eq(s.count, 2);
    /* one entry over the bound alone is refused, and evicts nothing */
    char *huge = filled(6000, 'y');
    cr_assert_eq(resp_store_put(st, 0, &a, "r4", huge, "[]"), 1);
    free(huge);
    free(big);
    cr_assert_not(has(st, &a, "r4"));
    cr_assert(has(st, &a, "r2") && has(st, &a, "r3"));
    resp_store_destroy(st);
}

Test(responses_store, a_tenants_flood_evicts_its_own_oldest_only) {
    /* eight entries, two tenants: each keeps four for sure */
    resp_store *st = resp_store_create(8, 1 << 20, 2, 0);
    cache_key a = ns_of("a"), b = ns_of("b");
    cr_assert_eq(resp_store_put(st, 1, &b, "b1", "{}", "[]"), 0);
    cr_assert_eq(resp_store_put(st, 1, &b, "b2", "{}", "[]"), 0);
    char id[16];
    for (int i = 0; i < 10; i++) {
        snprintf(id, sizeof id, "a%d", i);
        cr_assert_eq(resp_store_put(st, 0, &a, id, "{}", "[]"), 0);
    }
    cr_assert(has(st, &b, "b1") && has(st, &b, "b2"), "the other tenant's are kept");
    cr_assert_not(has(st, &a, "a0") || has(st, &a, "a3"), "the flood's oldest went");
    cr_assert(has(st, &a, "a4") && has(st, &a, "a9"));
    resp_store_stats s;
    resp_store_tenant_stats(st, 0, &s);
    cr_assert_eq(s.count, 6, "more than its share, while the store has room");
    cr_assert_eq(s.evictions, 4);
    resp_store_tenant_stats(st, 1, &s);
    cr_assert_eq(s.count, 2);
    cr_assert_eq(s.evictions, 0);
    /* the other tenant takes its share back from the one over it */
    for (int i = 3; i <= 4; i++) {
        snprintf(id, sizeof id, "b%d", i);
        cr_assert_eq(resp_store_put(st, 1, &b, id, "{}", "[]"), 0);
    }
    resp_store_tenant_stats(st, 0, &s);
    cr_assert_eq(s.count, 4);
    cr_assert(has(st, &b, "b1"), "within its share: kept");
    resp_store_stats_get(st, &s);
    cr_assert_eq(s.count, 8);
    resp_store_destroy(st);
}

Test(responses_store, a_tenant_over_its_byte_share_goes_first) {
    char *big = filled(1500, 'x');
    /* 8000 bytes, two tenants: 4000 each for sure */
    resp_store *st = resp_store_create(100, 8000, 2, 0);
    cache_key a = ns_of("a"), b = ns_of("b");
    cr_assert_eq(resp_store_put(st, 1, &b, "b1", "{}", "[]"), 0);
    char id[16];
    for (int i = 0; i < 6; i++) {
        snprintf(id, sizeof id, "a%d", i);
        cr_assert_eq(resp_store_put(st, 0, &a, id, big, "[]"), 0);
    }
    cr_assert(has(st, &b, "b1"));
    cr_assert(has(st, &a, "a5") && !has(st, &a, "a0"));
    resp_store_stats s;
    resp_store_stats_get(st, &s);
    cr_assert_leq(s.bytes, 8000);
    /* a tenant index out of range counts as the first tenant's */
    cr_assert_eq(resp_store_put(st, 7, &a, "odd", "{}", "[]"), 0);
    cr_assert(has(st, &a, "odd"));
    resp_store_destroy(st);
    free(big);
}
