"""Mistral's prompt formats named with --chat-template on the default model: a conversation the
format takes is answered, and one its template refuses (a system message where Mistral 7B
v0.2's original template has none, roles out of order) is a 400 naming `messages`, with the
server still answering afterwards; Mistral Small 3.2's calls ([TOOL_CALLS]NAME[CALL_ID]ID[ARGS])
come back as tool_calls, whole and streamed, and a result sent back is answered. The prompts
themselves are compared with the templates' renderings by the unit tests (tests/golden/chat).
The default model is not Mistral's: after a call nothing closes the calls in Small 3.2's format,
and the small model would go on calling where parallel calls are allowed, so these ask for one."""
import json

import openai
import pytest

from conftest import KvServer

SYS = {"role": "system", "content": "You are terse."}
U1 = {"role": "user", "content": "What is the capital of France?"}
A1 = {"role": "assistant", "content": "Paris."}
U2 = {"role": "user", "content": "And of Italy?"}

# template name -> conversations it refuses
REFUSED = {
    "mistral-legacy": [[U1, A1, SYS, U2], [U1, U2]],
    "mistral-v1": [[U1, U2], [A1, U1]],
    "mistral-v3": [[U1, U2]],
    "mistral-v7": [],
    "mistral-v7-tekken": [[U1, U2], [SYS, U1, A1, SYS, U2]],
}


@pytest.fixture(scope="module", params=sorted(REFUSED))
def named(request):
    s = KvServer(["-c", "1024", "--chat-template", request.param]).start()
    yield request.param, s, s.client()
    s.terminate()


def test_mistral_formats_answer_and_refuse(named):
    name, server, client = named
    ok = [SYS, U1, A1, U2]
    r = client.chat.completions.create(model=server.model_id, messages=ok, max_tokens=4,
                                       temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length"), (name, r)
    assert r.usage.prompt_tokens > 10
    for messages in REFUSED[name]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=server.model_id, messages=messages,
                                           max_tokens=4)
        assert e.value.status_code == 400
        assert e.value.param == "messages", (name, e.value)
        assert name in str(e.value), (name, e.value)
    r = client.chat.completions.create(model=server.model_id, messages=[U1], max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")


TOOLS = [{"type": "function", "function": {
    "name": "get_time", "description": "Time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What time is it in Paris?"}]


def test_mistral_small_calls_round_trip():
    s = KvServer(["-c", "1024", "--chat-template", "mistral-v7-tekken"]).start()
    try:
        client = s.client()
        kw = dict(model=s.model_id, messages=ASK, tools=TOOLS, tool_choice="required",
                  parallel_tool_calls=False, max_tokens=60, temperature=0)
        r = client.chat.completions.create(**kw)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c
        assert c.message.content is None
        (call,) = c.message.tool_calls
        assert call.function.name == "get_time"
        assert isinstance(json.loads(call.function.arguments).get("city"), str)
        streamed = {"name": "", "args": ""}
        finish = None
        for chunk in client.chat.completions.create(stream=True, **kw):
            ch = chunk.choices[0]
            finish = ch.finish_reason or finish
            for tc in ch.delta.tool_calls or []:
                assert tc.index == 0
                streamed["name"] += tc.function.name or ""
                streamed["args"] += tc.function.arguments or ""
        assert finish == "tool_calls"
        assert streamed == {"name": "get_time", "args": call.function.arguments}
        history = ASK + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.id, "type": "function",
                 "function": {"name": "get_time", "arguments": call.function.arguments}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "14:05"},
        ]
        r = client.chat.completions.create(model=s.model_id, messages=history, tools=TOOLS,
                                           tool_choice="none", max_tokens=8, temperature=0)
        assert r.choices[0].finish_reason in ("stop", "length")
        assert r.choices[0].message.content
        assert r.usage.prompt_tokens > 30
    finally:
        s.terminate()
