/* libFuzzer target for the Responses API's request parser (server/api/responses_parse.c): the bytes
 * go to resp_parse and, parsed, to resp_conversation twice: alone, and after a copy of their own
 * input items as a stored conversation (the shape previous_response_id gives it). On success
 * every string and array handed out is read end to end, so ASan checks each one, and the
 * invariants the server relies on are checked (roles, calls only on assistant turns, arguments
 * that are JSON, one choice, echo fields present); on failure the error must be a well-formed
 * 4xx/5xx whose JSON parses back, and the request must be left empty.
 * Seeds: tests/fuzz/corpus/responses_fuzz/ (string and item inputs, tools, formats, refusals). */
#include <jansson.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/api/responses.h"
#include "tests/fuzz/api_checks.h"

/* The chat turns, as api_fuzz checks a chat request's, and what the translation adds: every call
 * has its id, every tool turn the id it answers, parts end inside their message, and the
 * instructions come first. */
static uint64_t use_conversation(const resp_request *r) {
    const api_request *rq = &r->rq;
    uint64_t sink = use_messages(rq->messages, rq->n_messages);
    for (int i = 0; i < rq->n_messages; i++) {
        const chat_message *m = &rq->messages[i];
        for (int k = 0; k < m->n_tool_calls; k++) CHECK(m->tool_calls[k].id != NULL);
        CHECK(!strcmp(m->role, "tool") == (m->tool_call_id != NULL));
        for (int p = 0; p < m->n_parts; p++) {
            CHECK(m->part_ends[p] <= strlen(m->content));
            CHECK(p == 0 || m->part_ends[p] >= m->part_ends[p - 1]);
        }
    }
    if (r->instructions) CHECK(!strcmp(rq->messages[0].content, r->instructions));
    return sink;
}

static uint64_t use_request(const resp_request *r) {
    const api_request *rq = &r->rq;
    uint64_t sink = use_str(rq->model);
    CHECK(rq->kind == API_CHAT && rq->n == 1 && rq->messages == NULL);
    CHECK(json_is_array(r->input) && json_array_size(r->input) >= 1);
    CHECK(rq->max_tokens == -1 || rq->max_tokens >= 1);
    CHECK(rq->n_tools >= 0 && rq->n_tools <= API_MAX_TOOLS);
    for (int i = 0; i < rq->n_tools; i++) sink += use_str(rq->tools[i].name);
    CHECK((rq->tool_choice == CHAT_TOOL_NAMED) == (rq->tool_choice_name != NULL));
    CHECK(rq->tool_choice == CHAT_TOOL_NONE || rq->n_tools > 0);
    CHECK(!rq->gbnf || rq->tool_choice == CHAT_TOOL_NONE);
    if (rq->gbnf) sink += use_str(rq->gbnf);
    if (r->instructions) sink += use_str(r->instructions);
    if (r->previous_response_id) {
        size_t n = strlen(r->previous_response_id);
        CHECK(n >= 1 && n <= RESP_MAX_ID);
    }
    const char *keys[] = {
        "tools",       "tool_choice", "text",         "metadata",          "store",
        "temperature", "top_p",       "instructions", "max_output_tokens", "parallel_tool_calls"};
    for (size_t k = 0; k < sizeof keys / sizeof keys[0]; k++)
        CHECK(json_object_get(r->echo, keys[k]) != NULL);
    CHECK(json_array_size(json_object_get(r->echo, "tools")) == (size_t)rq->n_tools);
    CHECK(json_object_size(json_object_get(r->echo, "metadata")) <= RESP_MAX_METADATA);
    /* every canonical item has the fields the translation reads */
    size_t i;
    const json_t *it;
    json_array_foreach(r->input, i, it) {
        const char *type = json_string_value(json_object_get(it, "type"));
        CHECK(type != NULL);
        if (!strcmp(type, "message")) {
            CHECK(json_is_string(json_object_get(it, "role")));
            CHECK(json_is_array(json_object_get(it, "content")));
        } else {
            CHECK(json_is_string(json_object_get(it, "call_id")));
        }
    }
    return sink;
}

/* Translates r (prev: a stored conversation, or NULL) and checks the turns or the error. */
static uint64_t translate(resp_request *r, const json_t *prev) {
    api_error err;
    if (resp_conversation(r, prev, &err) == 0) return use_conversation(r);
    check_error(&err);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    resp_request r, again;
    api_error err;
    if (resp_parse((const char *)data, size, &r, &err) != 0) {
        check_error(&err);
        CHECK(r.rq.model == NULL && r.input == NULL && r.echo == NULL);
        resp_request_free(&r);
        return 0;
    }
    volatile uint64_t sink = use_request(&r);
    json_t *prev = json_deep_copy(r.input);
    CHECK(prev != NULL);
    sink += translate(&r, NULL);
    /* again, after its own items as a stored conversation */
    CHECK(resp_parse((const char *)data, size, &again, &err) == 0);
    sink += translate(&again, prev);
    json_decref(prev);
    resp_request_free(&again);
    resp_request_free(&r);
    (void)sink;
    return 0;
}
