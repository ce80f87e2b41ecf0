"""Tool calls through the official `openai` client: tool_choice required, named, auto and
none; parallel_tool_calls; calls parsed into message.tool_calls (ids, names, arguments that
validate against the function's parameter schema, finish_reason "tool_calls"), streamed as
delta.tool_calls; a conversation holding an assistant tool_calls turn and a tool result is
answered; the 400s for bad tools. The default model's template has no tool format (the generic
one is used); the same checks run with --chat-template naming each family's own format (Qwen 2.5
/ Hermes, Llama 3.1, Mistral Nemo, Mistral v3), whose prompts the unit tests compare with the templates'
renderings."""
import json

import jsonschema
import pytest

from conftest import KvServer

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 40},
                          "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 30}},
        "required": ["tz"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Time in a time zone",
                                      "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def check_calls(calls):
    assert calls
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
    assert len({c.id for c in calls}) == len(calls)


@pytest.mark.parametrize("choice,names", [
    ("required", None),
    ({"type": "function", "function": {"name": "get_time"}}, ["get_time"]),
])
def test_required_and_named_calls(client, server, choice, names):
    r = client.chat.completions.create(model=server.model_id, messages=ASK, tools=TOOLS,
                                       tool_choice=choice, max_tokens=150, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    assert c.message.content is None
    check_calls(c.message.tool_calls)
    if names:
        assert [t.function.name for t in c.message.tool_calls] == names


def test_parallel_off_gives_one_call(client, server):
    r = client.chat.completions.create(model=server.model_id, messages=ASK, tools=TOOLS,
                                       tool_choice="required", parallel_tool_calls=False,
                                       max_tokens=150, temperature=0)
    assert r.choices[0].finish_reason == "tool_calls"
    assert len(r.choices[0].message.tool_calls) == 1


def stream_calls(client, **kw):
    """The calls of a streamed answer, put together from its deltas, and its finish_reason."""
    calls, finish = {}, None
    for ch in client.chat.completions.create(stream=True, **kw):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        assert not d.content
        for tc in d.tool_calls or []:
            if tc.id:
                assert tc.function.name and tc.index not in calls
                calls[tc.index] = {"id": tc.id, "name": tc.function.name,
                                   "args": tc.function.arguments}
            else:
                calls[tc.index]["args"] += tc.function.arguments
        finish = ch.choices[0].finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish


def test_calls_cut_by_max_tokens(client, server):
    """max_tokens ending inside a call's arguments: the whole answer holds the calls so far,
    the last one's arguments cut short, with finish "length", as the streamed form sent them
    (not the raw text of the call syntax as content)."""
    kw = dict(model=server.model_id, messages=ASK, tools=TOOLS, tool_choice="required",
              temperature=0)
    full = client.chat.completions.create(max_tokens=150, **kw)
    assert full.choices[0].finish_reason == "tool_calls"
    last = full.choices[0].message.tool_calls[-1].function
    # cut a few tokens before the end: inside the last call's arguments or its closing syntax
    cut = client.chat.completions.create(max_tokens=full.usage.completion_tokens - 3, **kw)
    c = cut.choices[0]
    assert c.finish_reason == "length"
    assert c.message.content is None, c.message
    calls = c.message.tool_calls
    assert [t.function.name for t in calls] == \
        [t.function.name for t in full.choices[0].message.tool_calls]
    assert last.arguments.startswith(calls[-1].function.arguments)
    assert all(t.id.startswith("call_") for t in calls)
    streamed, finish = stream_calls(client, max_tokens=full.usage.completion_tokens - 3, **kw)
    assert finish == "length"
    assert [(x["name"], x["args"]) for x in streamed] == \
        [(t.function.name, t.function.arguments) for t in calls]


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
def test_streamed_calls_equal_whole(client, server, choice):
    kw = dict(model=server.model_id, messages=ASK, tools=TOOLS, tool_choice=choice,
              max_tokens=150, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    calls, finish = stream_calls(client, **kw)
    assert finish == "tool_calls"
    assert [(c["name"], c["args"]) for c in calls] == \
        [(t.function.name, t.function.arguments) for t in whole]


def test_a_forced_call_is_not_repeated(client, server):
    """tool_choice "required" at temperature 0: the model would call get_weather for Paris again
    and again until max_tokens cut the third copy; a call equal to one the answer already made
    ends the turn instead (finish "tool_calls", the calls before it), streamed or whole."""
    kw = dict(model=server.model_id, messages=ASK, tools=TOOLS[:1], tool_choice="required",
              max_tokens=100, temperature=0)
    c = client.chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "tool_calls", c
    check_calls(c.message.tool_calls)
    calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
    assert len(set(calls)) == len(calls), calls
    streamed, finish = stream_calls(client, **kw)
    assert finish == "tool_calls"
    assert [(x["name"], x["args"]) for x in streamed] == calls


def test_auto_and_none_answer(client, server):
    for choice in ("auto", "none"):
        r = client.chat.completions.create(model=server.model_id, messages=ASK, tools=TOOLS,
                                           tool_choice=choice, max_tokens=40, temperature=0)
        c = r.choices[0]
        if c.finish_reason == "tool_calls":
            assert choice == "auto"
            check_calls(c.message.tool_calls)
        elif c.message.tool_calls:  # max_tokens cut a call: the calls so far
            assert choice == "auto" and c.finish_reason == "length", (name, c)
            assert c.message.content is None
        else:
            assert c.message.content and not c.message.tool_calls


def test_conversation_with_a_tool_result(client, server):
    msgs = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather",
                          "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
    ]
    r = client.chat.completions.create(model=server.model_id, messages=msgs, tools=TOOLS,
                                       tool_choice="none", max_tokens=40, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.choices[0].message.content


CALL_1 = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]}


@pytest.mark.parametrize("msgs,param,words", [
    (ASK + [{"role": "tool", "tool_call_id": "call_1", "content": "18"}], "messages[1].role",
     "messages with role 'tool' must be a response to a preceeding message with 'tool_calls'"),
    (ASK + [CALL_1, {"role": "tool", "tool_call_id": "call_2", "content": "18"}],
     "messages[2].tool_call_id", "'tool_call_id' of 'call_2' not found in 'tool_calls'"),
    (ASK + [CALL_1] + ASK, "messages[1].role",
     "The following tool_call_ids did not have response messages: call_1"),
])
def test_tool_turns_must_answer_calls(client, server, msgs, param, words):
    """A tool message answers a call of the assistant message right before it, and every call
    gets its result: otherwise a 400 naming the message, in OpenAI's words."""
    import openai
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.model_id, messages=msgs, max_tokens=2)
    err = e.value.body
    assert err["param"] == param, err
    assert words in err["message"], err
    # answered, the same conversation goes on
    ok = ASK + [CALL_1, {"role": "tool", "tool_call_id": "call_1", "content": "18"}]
    r = client.chat.completions.create(model=server.model_id, messages=ok, max_tokens=2,
                                       temperature=0)  # sampled, it could end at its first token
    assert r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
     "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}]},
     "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": TOOLS, "functions": [t["function"] for t in TOOLS]}, "functions"),
    ({"tools": TOOLS, "tool_choice": "auto", "function_call": "auto"}, "function_call"),
    ({"functions": [{"name": "bad name"}]}, "functions[0].name"),
    ({"functions": [t["function"] for t in TOOLS], "function_call": "required"},
     "function_call"),
])
def test_bad_tools_are_400(server, body, param):
    status, r = server.post_json("/v1/chat/completions",
                                 {"model": server.model_id, "messages": ASK, **body})
    assert status == 400, r
    assert r["error"]["param"] == param, r


def test_legacy_functions_answer_as_function_call(client, server):
    """functions and function_call, OpenAI's deprecated form of tools and tool_choice, still
    work as OpenAI answers them: one call, as message.function_call with finish "function_call",
    streamed as delta.function_call."""
    kw = dict(model=server.model_id, messages=ASK, functions=[t["function"] for t in TOOLS],
              function_call={"name": "get_weather"}, max_tokens=60, temperature=0)
    c = client.chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "function_call", c
    assert c.message.tool_calls is None and c.message.content is None, c.message
    fc = c.message.function_call
    assert fc.name == "get_weather"
    jsonschema.validate(json.loads(fc.arguments), WEATHER)
    name, args, finish = None, "", None
    for ch in client.chat.completions.create(stream=True, **kw):
        d = ch.choices[0].delta
        assert not d.tool_calls and not d.content, d
        if d.function_call:
            name = name or d.function_call.name
            args += d.function_call.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    assert (name, args, finish) == (fc.name, fc.arguments, "function_call")


# ---------------------------------------------------------------- per-family tool formats

FAMILIES = ["qwen2.5", "llama3.1", "mistral-nemo", "mistral-v3"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    """A server rendering and parsing with one family's template: (name, server, client)."""
    s = KvServer(["-c", "2048", "--chat-template", request.param]).start()
    yield request.param, s, s.client()
    s.terminate()


@pytest.mark.parametrize("choice,names", [
    ("required", None),
    ({"type": "function", "function": {"name": "get_time"}}, ["get_time"]),
])
def test_family_required_and_named(family, choice, names):
    name, server, client = family
    kw = dict(model=server.model_id, messages=ASK, tools=TOOLS, tool_choice=choice,
              max_tokens=150, temperature=0)
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", (name, c)
    assert c.message.content is None
    check_calls(c.message.tool_calls)
    if names:
        assert [t.function.name for t in c.message.tool_calls] == names
    if name == "llama3.1":  # its template writes one call per turn
        assert len(c.message.tool_calls) == 1
    streamed, finish = stream_calls(client, **kw)
    assert finish == "tool_calls"
    assert [(x["name"], x["args"]) for x in streamed] == \
        [(t.function.name, t.function.arguments) for t in c.message.tool_calls]


def test_family_answers_a_tool_result(family):
    """The model's own call and the result go back (ids mapped for Mistral's 9-character ones);
    the prompt grows by them, and the answer comes back as text."""
    name, server, client = family
    first = client.chat.completions.create(model=server.model_id, messages=ASK, tools=TOOLS,
                                           tool_choice="required", max_tokens=150,
                                           temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"},
    ]
    for choice in ("none", "auto"):
        kw = dict(model=server.model_id, tools=TOOLS, tool_choice=choice, temperature=0)
        base = client.chat.completions.create(messages=ASK, max_tokens=1, **kw)
        r = client.chat.completions.create(messages=history, max_tokens=30, **kw)
        c = r.choices[0]
        assert c.finish_reason in ("stop", "length", "tool_calls"), (name, c)
        if c.finish_reason == "tool_calls":
            assert choice == "auto"
            check_calls(c.message.tool_calls)
        elif c.message.tool_calls:  # max_tokens cut a call: the calls so far
            assert choice == "auto" and c.finish_reason == "length", (name, c)
            assert c.message.content is None
        else:
            assert isinstance(c.message.content, str)
        assert r.usage.prompt_tokens > base.usage.prompt_tokens + 10


def test_family_template_refusals_are_400(family):
    name, server, _ = family
    two_calls = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{i}", "type": "function",
         "function": {"name": "get_time", "arguments": json.dumps({"tz": "UTC"})}}
        for i in range(2)]}] + [
        {"role": "tool", "tool_call_id": f"call_{i}", "content": "12:00"} for i in range(2)]
    status, r = server.post_json("/v1/chat/completions", {
        "model": server.model_id, "messages": two_calls, "tools": TOOLS, "max_tokens": 5})
    if name == "llama3.1":
        assert status == 400 and r["error"]["param"] == "messages", r
        assert "one call per turn" in r["error"]["message"], r
    else:
        assert status == 200, r
    bad_args = ASK + [{"role": "assistant", "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": "get_time", "arguments": "{"}}]}]
    status, r = server.post_json("/v1/chat/completions", {
        "model": server.model_id, "messages": bad_args, "max_tokens": 5})
    assert status == 400, r
    assert r["error"]["param"] == "messages[1].tool_calls[0].function.arguments", r
