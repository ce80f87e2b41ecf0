"""Anthropic's Messages API through the unmodified `anthropic` SDK: messages.create and
messages.stream answer (the named events in order), a stop sequence is named, a tool call goes
round (tool_use, then tool_result sent back), count_tokens counts what a request's usage
counts, a ~3,000-token system block marked with cache_control is stored on the first request
(cache_creation_input_tokens) and read on the next (cache_read_input_tokens), also after a
restart on the same cache directory, its lease listed in /v1/cache/stats with its expiry about
5 minutes ahead; errors come in Anthropic's shape, and the key goes as x-api-key (or Bearer).

One server for the module (an API key, a private cache directory), restarted once; prompts are
short and max_tokens small but for the cached system block, prefilled once."""
import json
import os
import shutil
import tempfile
import time
import urllib.error
import urllib.request

import anthropic
import pytest

from conftest import SLOW, KvServer

KEY = "anthropic-test-key"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
           "required": ["city"]}
TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER}]
# The SDK no longer names the sampling fields; the API still takes them (kvserve does).
GREEDY = {"temperature": 0}
# About 2,900 tokens of SmolLM2's vocabulary.
SYSTEM = " ".join(f"Rule {i}: the assistant answers politely about topic {i} and never "
                  f"mentions topic {i + 1}." for i in range(130))


class Server:
    """The module's server, which the restart test stops and starts again on its directory."""

    def __init__(self):
        self.cache_dir = tempfile.mkdtemp(prefix="kvserve-anthropic-")
        self.srv = None
        self.start()

    def start(self):
        self.srv = KvServer(["-c", "4096", "--api-key", KEY, "--cache-dir", self.cache_dir,
                             "--no-blend"]).start()

    def restart(self):
        self.srv.terminate()
        self.start()

    def client(self, api_key=KEY):
        return anthropic.Anthropic(base_url=self.srv.url, api_key=api_key, max_retries=0,
                                   timeout=120 * SLOW)

    @property
    def model(self):
        return self.srv.model_id

    def post(self, path, body, headers=None):
        """(status, parsed JSON) of a raw POST with the key as x-api-key unless headers say."""
        h = {"content-type": "application/json", "anthropic-version": "2023-06-01"}
        h.update({"x-api-key": KEY} if headers is None else headers)
        req = urllib.request.Request(self.srv.url + path, data=json.dumps(body).encode(),
                                     headers=h)
        try:
            with urllib.request.urlopen(req, timeout=120 * SLOW) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def stats(self):
        return self.srv.get_json("/v1/cache/stats", api_key=KEY)

    def close(self):
        try:
            self.srv.terminate()
        finally:
            shutil.rmtree(self.cache_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def srv(model_path):
    s = Server()
    yield s
    s.close()


def ask(text):
    return [{"role": "user", "content": text}]


def test_create_and_stream(srv):
    c = srv.client()
    m = c.messages.create(model=srv.model, max_tokens=12, extra_body=GREEDY,
                          messages=ask("What is the capital of France?"))
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant"
    assert m.model == srv.model
    assert m.content and m.content[0].type == "text" and m.content[0].text.strip()
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    assert 1 <= m.usage.output_tokens <= 12
    u = m.usage
    prompt = u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens
    assert prompt > 10 and u.cache_creation_input_tokens == 0

    events = []
    with c.messages.stream(model=srv.model, max_tokens=12, extra_body=GREEDY,
                           messages=ask("What is the capital of France?")) as st:
        text = "".join(st.text_stream)
        final = st.get_final_message()
    assert text == final.content[0].text == m.content[0].text, "greedy: the same answer"
    assert final.stop_reason == m.stop_reason
    assert final.usage.output_tokens == m.usage.output_tokens
    # the same prompt again: its prefix is read from the cache
    assert final.usage.cache_read_input_tokens > 0

    with c.messages.stream(model=srv.model, max_tokens=4, messages=ask("Hi")) as st:
        events = [e.type for e in st]
    assert events[0] == "message_start" and events[-1] == "message_stop"
    for kind in ("content_block_start", "content_block_delta", "content_block_stop",
                 "message_delta"):
        assert kind in events, events


def test_stop_sequence_is_named(srv):
    m = srv.client().messages.create(
        model=srv.model, max_tokens=16, extra_body=GREEDY, stop_sequences=[","],
        messages=ask("Count from 1 to 10, separated by commas."))
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", ",")
    assert "," not in m.content[0].text


def test_tool_call_round_trip(srv):
    c = srv.client()
    m = c.messages.create(model=srv.model, max_tokens=40, extra_body=GREEDY, tools=TOOLS,
                          tool_choice={"type": "tool", "name": "get_weather"},
                          messages=ask("What is the weather in Paris?"))
    assert m.stop_reason == "tool_use"
    calls = [b for b in m.content if b.type == "tool_use"]
    assert len(calls) == 1, "a forced call ends (no repeated identical call)"
    call = calls[0]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    assert isinstance(call.input, dict) and isinstance(call.input["city"], str)

    # streamed: the call's input arrives as input_json_delta pieces
    with c.messages.stream(model=srv.model, max_tokens=40, extra_body=GREEDY, tools=TOOLS,
                           tool_choice={"type": "tool", "name": "get_weather"},
                           messages=ask("What is the weather in Paris?")) as st:
        deltas = [e.delta.partial_json for e in st
                  if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
        final = st.get_final_message()
    assert deltas and json.loads("".join(deltas)) == call.input
    assert final.content[-1].type == "tool_use" and final.content[-1].input == call.input

    # the result goes back; the answer is text
    history = ask("What is the weather in Paris?") + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": "18 degrees and sunny"}]}]
    r = c.messages.create(model=srv.model, max_tokens=16, extra_body=GREEDY, tools=TOOLS,
                          tool_choice={"type": "none"}, messages=history)
    assert r.content[0].type == "text" and r.content[0].text.strip()
    assert r.stop_reason in ("end_turn", "max_tokens")


def test_count_tokens_counts_what_create_counts(srv):
    c = srv.client()
    system = "You answer in one word."
    n = c.messages.count_tokens(model=srv.model, system=system, tools=TOOLS,
                                messages=ask("Name a colour."))
    m = c.messages.create(model=srv.model, max_tokens=4, system=system, tools=TOOLS,
                          messages=ask("Name a colour."))
    u = m.usage
    assert n.input_tokens == (u.input_tokens + u.cache_read_input_tokens +
                              u.cache_creation_input_tokens)
    bare = c.messages.count_tokens(model=srv.model, system=system, messages=ask("Name a colour."))
    assert bare.input_tokens < n.input_tokens, "the tools are part of the prompt"


def test_errors_in_anthropics_shape(srv):
    def bad(body, status=400, kind="invalid_request_error", headers=None, path="/v1/messages"):
        st, v = srv.post(path, body, headers)
        assert st == status, (st, v)
        assert v["type"] == "error" and v["error"]["type"] == kind, v
        return v["error"]["message"]

    base = {"model": srv.model, "max_tokens": 8, "messages": ask("hi")}
    assert "max_tokens: Field required" in bad({k: v for k, v in base.items()
                                                if k != "max_tokens"})
    assert "messages.0.role" in bad({**base, "messages": [{"role": "robot", "content": "x"}]})
    lone = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x",
                                          "content": "1"}]}]
    assert "unexpected `tool_use_id`" in bad({**base, "messages": lone})
    marked = [{"type": "text", "text": f"s{i}", "cache_control": {"type": "ephemeral"}}
              for i in range(5)]
    assert "A maximum of 4 blocks with cache_control" in bad({**base, "system": marked})
    image = [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]
    assert "messages.0.content.0.type: image blocks are not supported" in bad(
        {**base, "messages": image})
    assert "thinking" in bad({**base, "thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert "does not exist" in bad({**base, "model": "claude-nope"}, 404, "not_found_error")
    # count_tokens: the same shape
    assert "Extra inputs" in bad(base, path="/v1/messages/count_tokens")

    # the key: x-api-key (the SDK's) or Bearer; none or a wrong one is a 401 in this shape
    bad(base, 401, "authentication_error", headers={})
    bad(base, 401, "authentication_error", headers={"x-api-key": "wrong"})
    st, v = srv.post("/v1/messages", base, headers={"authorization": f"Bearer {KEY}"})
    assert st == 200 and v["type"] == "message", v
    with pytest.raises(anthropic.AuthenticationError):
        srv.client(api_key="wrong").messages.create(model=srv.model, max_tokens=4,
                                                    messages=ask("hi"))
    with pytest.raises(anthropic.NotFoundError):
        srv.client().messages.create(model="claude-nope", max_tokens=4, messages=ask("hi"))
    with pytest.raises(anthropic.BadRequestError) as e:
        srv.client().messages.create(model=srv.model, max_tokens=4, messages=image)
    assert "image blocks are not supported" in str(e.value)


def cached_request(srv, question):
    return srv.client().messages.create(
        model=srv.model, max_tokens=8, extra_body=GREEDY,
        system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        messages=ask(question)).usage


def leases(srv):
    return [p for p in srv.stats()["pins"]["list"] if p["expires_at"] is not None]


def test_prompt_cache_writes_then_reads_also_after_a_restart(srv):
    first = cached_request(srv, "Which topic comes after topic 3?")
    # nothing of the system prompt, only the chat template's first tokens (earlier requests
    # share them: reuse to the token)
    assert first.cache_read_input_tokens < 16
    assert first.cache_creation_input_tokens >= 2700, first
    assert first.cache_creation.ephemeral_5m_input_tokens == first.cache_creation_input_tokens
    stored = first.cache_creation_input_tokens

    second = cached_request(srv, "Say something else.")
    assert second.cache_read_input_tokens >= 0.95 * stored, second
    assert second.cache_creation_input_tokens == 0, "read, not stored again"

    # the lease: records holding the prefix, in RAM and on disk, for 5 minutes (where two
    # records of the last chunk hold it, the questions' own, each tier may lease another)
    now = time.time()
    held = leases(srv)
    for tier in ("ram", "disk"):
        assert sum(p["tokens"] for p in held if tier in p["tiers"]) >= stored, held
    for p in held:
        assert 240 <= p["expires_at"] - now <= 301, p
        assert 240 <= p["expires_in_s"] <= 300, p
    expires = {p["record"]: p["expires_at"] for p in held if "disk" in p["tiers"]}

    srv.restart()  # the same cache directory: records and leases come back from disk
    kept = leases(srv)
    assert {p["record"]: p["expires_at"] for p in kept} == expires
    assert all(p["tiers"] == ["disk"] for p in kept), kept
    third = cached_request(srv, "Which topic comes after topic 3?")
    assert third.cache_read_input_tokens >= 0.95 * stored, third
    assert third.input_tokens + third.cache_read_input_tokens + \
        third.cache_creation_input_tokens == \
        first.input_tokens + first.cache_read_input_tokens + stored
