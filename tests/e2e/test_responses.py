"""The Responses API through the unmodified `openai` client: client.responses.create whole and
streamed (the semantic events in OpenAI's order, sequence numbers, deltas that add up to the
whole answer), client.responses.stream's final response; a function call round trip
(function_call, then function_call_output, then an answer) with previous_response_id and with
the items sent back, streamed calls, a forced call that is not repeated; json_schema output validated with `jsonschema`; previous_response_id over
three turns reporting the earlier turns as cached tokens; GET and DELETE /v1/responses/{id},
per API key; and the 400s and 404s, naming the field. One server, two API keys (two
namespaces), 16-token cache chunks so a short conversation's earlier turns fill whole chunks."""
import json
import urllib.error
import urllib.request

import jsonschema
import openai
import pytest

from conftest import SLOW, KvServer

KEY, OTHER = "key-a", "key-b"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city",
          "parameters": WEATHER}]
CITY = {"type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12},
                       "population": {"type": "integer", "minimum": 0}},
        "required": ["city", "population"], "additionalProperties": False}
CITY_FORMAT = {"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}}


@pytest.fixture(scope="module")
def server(model_path):
    s = KvServer(["-c", "2048", "--cache-chunk-tokens", "16", "--api-key", KEY,
                  "--api-key", OTHER]).start()
    yield s
    s.terminate()


@pytest.fixture(scope="module")
def client(server):
    return server.client(api_key=KEY)


def call(server, method, path, key=KEY, body=None):
    """(status, parsed JSON) of a request; HTTP errors are returned, not raised."""
    req = urllib.request.Request(server.url + path, method=method,
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Authorization": f"Bearer {key}",
                                          "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60 * SLOW) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def check_usage(u, max_output):
    assert u.input_tokens > 0 and 0 < u.output_tokens <= max_output
    assert u.total_tokens == u.input_tokens + u.output_tokens
    assert 0 <= u.input_tokens_details.cached_tokens <= u.input_tokens
    assert u.output_tokens_details.reasoning_tokens == 0


def test_create_whole(client, server):
    r = client.responses.create(model=server.model_id, input="What is the capital of France?",
                                instructions="Answer in one sentence.", max_output_tokens=16,
                                temperature=0, metadata={"case": "whole"})
    assert r.id.startswith("resp_") and r.object == "response"
    assert r.model == server.model_id and r.created_at > 1_600_000_000
    assert r.status in ("completed", "incomplete") and r.error is None
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
        assert r.usage.output_tokens == 16
    [m] = r.output
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.status == r.status
    assert [c.type for c in m.content] == ["output_text"] and m.content[0].annotations == []
    assert r.output_text and r.output_text == m.content[0].text
    check_usage(r.usage, 16)
    # the request's settings, as the API repeats them
    assert r.instructions == "Answer in one sentence."
    assert r.max_output_tokens == 16 and r.temperature == 0 and r.top_p == 1
    assert r.metadata == {"case": "whole"} and r.store is True
    assert r.tools == [] and r.tool_choice == "auto" and r.parallel_tool_calls is True
    assert r.text.format.type == "text" and r.previous_response_id is None


def test_stream_events_add_up_to_the_whole_answer(client, server):
    kw = dict(model=server.model_id, input="Name three colours.", max_output_tokens=12,
              temperature=0, store=False)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas and types[4:4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    terminal = "response.completed" if whole.status == "completed" else "response.incomplete"
    assert types[4 + len(deltas):] == ["response.output_text.done", "response.content_part.done",
                                       "response.output_item.done", terminal]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    created, last = events[0].response, events[-1].response
    assert created.status == "in_progress" and created.output == [] and created.id == last.id
    item_id = events[2].item.id
    assert all(e.item_id == item_id and e.output_index == 0 for e in deltas)
    text = "".join(e.delta for e in deltas)
    assert text == events[-4].text == events[-3].part.text
    assert events[-2].item.content[0].text == text and events[-2].item.id == item_id
    # the stream's answer is the whole one (greedy), and its final object says the same
    assert text == whole.output_text == last.output_text
    assert last.status == whole.status and last.usage.output_tokens == whole.usage.output_tokens


def test_json_schema_output_whole_and_streamed(client, server):
    kw = dict(model=server.model_id, input="Name a big city and its population, as JSON.",
              text=CITY_FORMAT, max_output_tokens=24, temperature=0)
    r = client.responses.create(**kw)
    assert r.status == "completed", r.output_text
    jsonschema.validate(json.loads(r.output_text), CITY)
    assert r.text.format.type == "json_schema" and r.text.format.name == "city"
    with client.responses.stream(**kw) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == r.output_text
    jsonschema.validate(json.loads(final.output_text), CITY)
    assert client.responses.create(**{**kw, "text": {"format": {"type": "json_object"}},
                                      "max_output_tokens": 12}).output_text.startswith("{")


def test_function_call_round_trip(client, server):
    kw = dict(model=server.model_id, tools=TOOLS, temperature=0)
    first = client.responses.create(input="What is the weather in Paris?", tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=40, **kw)
    assert first.status == "completed"
    [fc] = first.output
    assert fc.type == "function_call" and fc.name == "get_weather" and fc.status == "completed"
    assert fc.call_id.startswith("call_") and fc.id.startswith("fc_")
    jsonschema.validate(json.loads(fc.arguments), WEATHER)
    assert first.tools[0].name == "get_weather" and first.tool_choice == "required"
    result = {"type": "function_call_output", "call_id": fc.call_id, "output": "Sunny, 22 C"}
    # the stored conversation continued by its id: the output answers the call
    answer = client.responses.create(previous_response_id=first.id, input=[result],
                                     tool_choice="none", max_output_tokens=16, **kw)
    assert answer.previous_response_id == first.id
    assert [o.type for o in answer.output] == ["message"] and answer.output_text
    # the same conversation sent whole, the call item as the API gave it
    items = [{"role": "user", "content": "What is the weather in Paris?"},
             fc.model_dump(exclude_none=True), result]
    again = client.responses.create(input=items, tool_choice="none", max_output_tokens=16,
                                    store=False, **kw)
    assert again.output_text == answer.output_text and again.store is False
    assert call(server, "GET", f"/v1/responses/{again.id}")[0] == 404
    # an output whose call is not the one made is refused, naming the item
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(previous_response_id=first.id,
                                input=[{**result, "call_id": "call_other"}], **kw)
    assert e.value.body["param"] == "input[0].call_id"
    assert "No tool call found" in e.value.body["message"]
    # a stored call left unanswered, too
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(previous_response_id=first.id, input="And in Rome?", **kw)
    assert f"No tool output found for function call {fc.call_id}" in e.value.body["message"]


def test_function_call_streamed(client, server):
    kw = dict(model=server.model_id, input="What is the weather in Paris?", tools=TOOLS,
              tool_choice="required", parallel_tool_calls=False, max_output_tokens=40,
              temperature=0, store=False)
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    args = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     *["response.function_call_arguments.delta"] * len(args),
                     "response.function_call_arguments.done", "response.output_item.done",
                     "response.completed"]
    added, done = events[2].item, events[-3]
    assert added.type == "function_call" and added.name == "get_weather" and added.arguments == ""
    assert "".join(e.delta for e in args) == done.arguments == whole.output[0].arguments
    [fc] = final.output
    assert fc.call_id == added.call_id and fc.arguments == done.arguments


def test_a_forced_call_is_not_repeated(client, server):
    """tool_choice "required" with parallel calls: SmolLM2 would call get_weather for Paris again
    and again until max_output_tokens; the call guard ends the turn after the first instead."""
    r = client.responses.create(model=server.model_id, input="What is the weather in Paris?",
                                tools=TOOLS, tool_choice="required", max_output_tokens=80,
                                temperature=0, store=False)
    assert r.status == "completed"
    calls = [(o.name, o.arguments) for o in r.output]
    assert calls and all(o.type == "function_call" for o in r.output)
    assert len(set(calls)) == len(calls), calls


def test_previous_response_id_reuses_the_earlier_turns(client, server):
    kw = dict(model=server.model_id, instructions="You are a geography tutor. Answer briefly.",
              max_output_tokens=8, temperature=0)
    turns, prev = [], None
    for q in ["What is the capital of France?", "And of Germany?", "And of Italy?"]:
        r = client.responses.create(input=q, previous_response_id=prev, **kw)
        assert r.previous_response_id == prev
        turns.append(r)
        prev = r.id
    inputs = [t.usage.input_tokens for t in turns]
    cached = [t.usage.input_tokens_details.cached_tokens for t in turns]
    assert inputs[0] < inputs[1] < inputs[2]
    # each turn's prompt starts with the whole earlier one: its full chunks come from the cache
    assert cached[0] < cached[1] < cached[2], cached
    for i in (1, 2):
        assert cached[i] >= inputs[i - 1] // 16 * 16, (inputs, cached)
    status, got = call(server, "GET", f"/v1/responses/{turns[2].id}")
    assert status == 200 and got["id"] == turns[2].id
    assert got["output"][0]["content"][0]["text"] == turns[2].output_text
    assert got["previous_response_id"] == turns[1].id


def test_get_and_delete(client, server):
    r = client.responses.create(model=server.model_id, input="Say hi.", max_output_tokens=8,
                                temperature=0)
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    assert got.usage.total_tokens == r.usage.total_tokens
    # another API key is another namespace: it neither sees nor deletes it
    assert call(server, "GET", f"/v1/responses/{r.id}", key=OTHER)[0] == 404
    assert call(server, "DELETE", f"/v1/responses/{r.id}", key=OTHER)[0] == 404
    status, body = call(server, "POST", "/v1/responses", key=OTHER,
                        body={"model": server.model_id, "input": "x",
                              "previous_response_id": r.id})
    assert status == 400 and body["error"]["code"] == "previous_response_not_found"
    assert call(server, "DELETE", f"/v1/responses/{r.id}") == \
        (200, {"id": r.id, "object": "response", "deleted": True})
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    assert call(server, "DELETE", f"/v1/responses/{r.id}")[0] == 404
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=server.model_id, input="x", previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id"
    assert e.value.body["code"] == "previous_response_not_found"
    unstored = client.responses.create(model=server.model_id, input="Hi.", max_output_tokens=4,
                                       store=False)
    assert unstored.store is False
    status, body = call(server, "GET", f"/v1/responses/{unstored.id}")
    assert status == 404 and body["error"]["type"] == "invalid_request_error"
    assert call(server, "PUT", f"/v1/responses/{unstored.id}")[0] == 405


@pytest.mark.parametrize("extra,param,needle", [
    ({"background": True}, "background", "not supported"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "function tools only"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort", "do not reason"),
    ({"include": ["reasoning.encrypted_content"]}, "include[0]", "not supported"),
    ({"conversation": "conv_1"}, "conversation", "previous_response_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image",
                                              "image_url": "http://example.com/a.png"}]}]},
     "input[0].content[0].type", "text only"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "o"}]},
     "input[0].call_id", "No tool call found"),
    ({"text": {"format": {"type": "json_schema", "schema": CITY}}}, "text.format.name",
     "is required"),
    ({"response_format": {"type": "json_object"}}, "response_format", "text.format"),
    ({"max_output_tokens": 0}, "max_output_tokens", "at least 1"),
])
def test_errors_name_the_field(server, extra, param, needle):
    status, body = call(server, "POST", "/v1/responses",
                        body={"model": server.model_id, "input": "hi", **extra})
    assert status == 400, body
    err = body["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert needle in err["message"], err


def test_not_found(client, server):
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve("resp_0123")
    assert "resp_0123" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="no-such-model", input="hi")
    assert e.value.body["code"] == "model_not_found"
    assert call(server, "GET", "/v1/responses/x", key="wrong")[0] == 401
