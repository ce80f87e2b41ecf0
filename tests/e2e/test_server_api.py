"""`kvserve serve` through the official `openai` Python client (and curl): chat and text
completions, streamed and not, sampling controls, logprobs, the models, tokenize and metrics
endpoints. SmolLM2-135M is weak: only facts it gets right greedily are asserted."""
import json
import subprocess
import time

import openai
import pytest
import requests

from conftest import DEFAULT_CTX, SLOW

FRANCE = "What is the capital of France? Answer in one sentence."
POEM = "Write a short poem about the sea."


def user(text):
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def model(server):
    return server.model_id


def chat(client, model, text, **kw):
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=model, messages=user(text), **kw)


def stream_chat(client, model, text, **kw):
    """(concatenated content, list of chunks) of a streamed chat completion."""
    kw.setdefault("temperature", 0)
    chunks = list(client.chat.completions.create(model=model, messages=user(text), stream=True,
                                                 **kw))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return content, chunks


def complete(client, model, prompt, **kw):
    kw.setdefault("temperature", 0)
    return client.completions.create(model=model, prompt=prompt, **kw)


def check_usage(usage):
    assert usage.prompt_tokens > 0
    assert usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


# ---------------------------------------------------------------- chat completions

def test_chat_greedy_answer(client, model):
    # a namespace of its own: nothing another test sent earlier can be cached in it, so the
    # request's cached_tokens is 0 in any order of the tests
    r = chat(client, model, FRANCE, extra_body={"cache_salt": f"greedy-{time.time_ns()}"})
    assert r.id.startswith("chatcmpl-")
    assert r.object == "chat.completion"
    assert r.model == model
    assert isinstance(r.created, int) and r.created > 1_600_000_000
    assert len(r.choices) == 1
    c = r.choices[0]
    assert c.index == 0
    assert c.message.role == "assistant"
    assert "paris" in c.message.content.lower(), c.message.content
    assert c.finish_reason == "stop"
    assert c.logprobs is None
    check_usage(r.usage)
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_greedy_is_deterministic(client, model):
    a = chat(client, model, POEM, max_tokens=24).choices[0].message.content
    b = chat(client, model, POEM, max_tokens=24).choices[0].message.content
    assert a == b


@pytest.mark.parametrize("question,max_tokens", [(FRANCE, None), (POEM, 40)])
def test_chat_stream_matches_non_stream(client, model, question, max_tokens):
    kw = {"max_tokens": max_tokens} if max_tokens else {}
    chat(client, model, question, **kw)  # the prompt cached: both below reuse it alike
    full = chat(client, model, question, **kw)
    content, chunks = stream_chat(client, model, question,
                                  stream_options={"include_usage": True}, **kw)
    assert content == full.choices[0].message.content

    assert chunks[0].choices[0].delta.role == "assistant"
    ids = {c.id for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
    assert all(c.object == "chat.completion.chunk" and c.model == model for c in chunks)
    finishes = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
    assert finishes == [full.choices[0].finish_reason]

    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.model_dump() == full.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_stream_without_usage(client, model):
    content, chunks = stream_chat(client, model, FRANCE)
    assert "paris" in content.lower()
    assert all(c.usage is None for c in chunks)
    assert all(len(c.choices) == 1 for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_multi_turn_and_system_message(client, model):
    r = client.chat.completions.create(model=model, temperature=0, max_tokens=32, messages=[
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user", "content": FRANCE},
    ])
    assert "paris" in r.choices[0].message.content.lower(), r.choices[0].message.content
    assert r.usage.prompt_tokens > chat(client, model, FRANCE).usage.prompt_tokens


# ---------------------------------------------------------------- text completions

def test_completion_string_prompt(client, model):
    r = complete(client, model, "The capital of France is", max_tokens=8)
    assert r.id.startswith("cmpl-")
    assert r.object == "text_completion"
    assert r.model == model
    assert len(r.choices) == 1 and r.choices[0].index == 0
    assert r.choices[0].text
    assert r.choices[0].finish_reason in ("stop", "length")
    check_usage(r.usage)

    chunks = list(complete(client, model, "The capital of France is", max_tokens=8, stream=True,
                           stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == r.choices[0].text
    assert all(c.object == "text_completion" and c.id.startswith("cmpl-") for c in chunks)
    finishes = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
    assert finishes == [r.choices[0].finish_reason]
    assert chunks[-1].choices == []
    # the same usage, but for the repeat's reuse: every prompt token but the last (to the token)
    streamed, whole = chunks[-1].usage.model_dump(), r.usage.model_dump()
    assert streamed["prompt_tokens_details"].pop("cached_tokens") == r.usage.prompt_tokens - 1
    whole["prompt_tokens_details"].pop("cached_tokens")
    assert streamed == whole


def test_completion_prompt_array_with_n(client, model):
    prompts = ["Once upon a time", "The sky is"]
    r = complete(client, model, prompts, n=2, max_tokens=6)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    texts = [c.text for c in r.choices]
    # choices are grouped by prompt, n per prompt; greedy makes each group's choices equal
    alone = [complete(client, model, p, max_tokens=6).choices[0].text for p in prompts]
    assert texts == [alone[0], alone[0], alone[1], alone[1]]
    assert r.usage.completion_tokens == 4 * 6


def test_completion_token_id_prompt_equals_string_prompt(server, client, model):
    prompt = "The capital of France is"
    t = requests.post(server.url + "/tokenize", json={"content": prompt, "add_special": True})
    assert t.status_code == 200, t.text
    ids = t.json()["tokens"]
    assert ids and all(isinstance(i, int) for i in ids)
    by_text = complete(client, model, prompt, max_tokens=10)
    by_ids = complete(client, model, ids, max_tokens=10)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == by_text.usage.prompt_tokens == len(ids)
    # a batch of token-id prompts
    both = complete(client, model, [ids, ids], max_tokens=10)
    assert [c.text for c in both.choices] == [by_text.choices[0].text] * 2


def test_completion_echo(client, model):
    prompt = "Once upon a time"
    plain = complete(client, model, prompt, max_tokens=6).choices[0].text
    echoed = complete(client, model, prompt, max_tokens=6, echo=True).choices[0].text
    assert echoed == prompt + plain


# ---------------------------------------------------------------- max_tokens and stop

def test_max_tokens_gives_length(client, model):
    r = complete(client, model, "Once upon a time", max_tokens=5)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5

    r = chat(client, model, POEM, max_tokens=7)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 7

    r = chat(client, model, POEM, max_completion_tokens=4)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 4


# "The capital of France is Paris." is cut before the first occurrence of the stop string,
# also where the stop string starts inside a token ("aris") or spans tokens ("France is").
@pytest.mark.parametrize("stop", ["Paris", "aris", "France is", ["zzz", "Paris"], "."])
def test_stop_sequences(client, model, stop):
    full = chat(client, model, FRANCE).choices[0].message.content
    stops = [stop] if isinstance(stop, str) else stop
    at = min(full.index(s) for s in stops if s in full)
    expected = full[:at]

    r = chat(client, model, FRANCE, stop=stop)
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "stop"

    content, chunks = stream_chat(client, model, FRANCE, stop=stop)
    assert content == expected
    assert [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason] == ["stop"]


def test_stop_sequences_in_completions(client, model):
    full = complete(client, model, "Once upon a time", max_tokens=12).choices[0].text
    words = full.split()
    assert len(words) >= 3, full
    stop = words[2]
    expected = full[:full.index(stop)]
    r = complete(client, model, "Once upon a time", max_tokens=12, stop=[stop])
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "stop"
    chunks = list(complete(client, model, "Once upon a time", max_tokens=12, stop=[stop],
                           stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected


# ---------------------------------------------------------------- sampling

def sample(client, model, seed, **kw):
    r = chat(client, model, POEM, temperature=1.0, top_p=1.0, max_tokens=16, seed=seed, **kw)
    return r.choices[0].message.content


def test_seed_reproducible(client, model):
    assert sample(client, model, 7) == sample(client, model, 7)
    texts = [sample(client, model, s) for s in (11, 12, 13)]
    assert len(set(texts)) > 1, texts


def test_n_choices(client, model):
    r = chat(client, model, POEM, temperature=1.0, max_tokens=16, n=3, seed=5)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) > 1, texts
    assert 3 <= r.usage.completion_tokens <= 3 * 16  # usage counts all choices

    r = chat(client, model, FRANCE, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content == r.choices[1].message.content
    assert r.usage.completion_tokens == 2 * chat(client, model, FRANCE).usage.completion_tokens


def test_n_choices_stream(client, model):
    chunks = list(client.chat.completions.create(
        model=model, messages=user(POEM), temperature=0, max_tokens=12, n=2, stream=True))
    texts = {0: "", 1: ""}
    finishes = {0: [], 1: []}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finishes[ch.index].append(ch.finish_reason)
    alone = chat(client, model, POEM, max_tokens=12).choices[0]
    assert texts == {0: alone.message.content, 1: alone.message.content}
    assert finishes == {0: [alone.finish_reason], 1: [alone.finish_reason]}


def test_cache_extensions_are_accepted(client, model):
    r = chat(client, model, FRANCE, extra_body={"cache": True, "cache_salt": "tenant-1"})
    assert r.choices[0].message.content == chat(client, model, FRANCE).choices[0].message.content


def test_ignore_eos(client, model):
    short = chat(client, model, FRANCE, max_tokens=20)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 20
    r = chat(client, model, FRANCE, max_tokens=20, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 20


# ---------------------------------------------------------------- logprobs

def test_chat_logprobs(client, model):
    r = chat(client, model, FRANCE, logprobs=True, top_logprobs=3)
    content = r.choices[0].message.content
    lp = r.choices[0].logprobs.content
    assert len(lp) == r.usage.completion_tokens or len(lp) == r.usage.completion_tokens - 1
    assert "".join(t.token for t in lp) == content
    for t in lp:
        assert t.logprob <= 0
        assert len(t.top_logprobs) == 3
        tops = [x.logprob for x in t.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert all(x <= 0 for x in tops)
        assert abs(t.logprob - tops[0]) < 1e-4, (t.token, t.logprob, t.top_logprobs)
        assert t.top_logprobs[0].token == t.token
        if t.bytes is not None:
            assert bytes(t.bytes) == t.token.encode()


def test_chat_logprobs_stream(client, model):
    full = chat(client, model, FRANCE, logprobs=True, top_logprobs=2)
    _, chunks = stream_chat(client, model, FRANCE, logprobs=True, top_logprobs=2)
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content or []]
    want = full.choices[0].logprobs.content
    assert [t.token for t in streamed] == [t.token for t in want]
    for a, b in zip(streamed, want):
        assert abs(a.logprob - b.logprob) < 1e-4


def test_completion_logprobs(client, model):
    r = complete(client, model, "Once upon a time", max_tokens=6, logprobs=2)
    c = r.choices[0]
    lp = c.logprobs
    n = len(lp.tokens)
    assert n == r.usage.completion_tokens == 6
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens) == c.text
    for i in range(n):
        assert lp.token_logprobs[i] <= 0
        top = lp.top_logprobs[i]
        assert 2 <= len(top) <= 3
        assert lp.tokens[i] in top
        assert abs(top[lp.tokens[i]] - max(top.values())) < 1e-4  # greedy
        if i:
            assert lp.text_offset[i] - lp.text_offset[i - 1] == len(lp.tokens[i - 1])


def test_completion_logprobs_at_end_of_turn(client, model):
    # a chat-formatted prompt ends at <|im_end|>: the end-of-turn token is not text, so it has
    # no place in the text's logprobs (OpenAI gives one entry per token of the text)
    prompt = ("<|im_start|>user\nWhat is the capital of France? Answer in one sentence."
              "<|im_end|>\n<|im_start|>assistant\n")
    r = complete(client, model, prompt, max_tokens=32, logprobs=1)
    c = r.choices[0]
    assert c.finish_reason == "stop"
    assert "paris" in c.text.lower()
    assert "".join(c.logprobs.tokens) == c.text
    assert all(0 <= o <= len(c.text) for o in c.logprobs.text_offset)


def test_completion_echo_logprobs_offsets(client, model):
    # text_offset indexes the returned text, which starts with the prompt under echo
    prompt = "Once upon a time"
    r = complete(client, model, prompt, max_tokens=4, logprobs=1, echo=True)
    c = r.choices[0]
    lp = c.logprobs
    assert c.text.startswith(prompt)
    for tok, off in zip(lp.tokens, lp.text_offset):
        assert c.text[off:off + len(tok)] == tok, (c.text, lp.tokens, lp.text_offset)
    assert "".join(lp.tokens).endswith(c.text[len(prompt):])


def test_echo_scores_the_prompt_like_generation(client, model):
    # echo + logprobs + max_tokens 0 scores a text (what evaluation harnesses send): each
    # prompt token's logprob given the tokens before it, the first null. Appending greedy output
    # to its prompt and scoring it gives the generated tokens' own logprobs back.
    prompt = "The capital of France is"
    g = complete(client, model, prompt, max_tokens=2, logprobs=1)
    gen = g.choices[0].logprobs
    s = complete(client, model, prompt + g.choices[0].text, max_tokens=0, echo=True, logprobs=2)
    c = s.choices[0]
    assert c.text == prompt + g.choices[0].text
    assert c.finish_reason == "length"
    assert s.usage.completion_tokens == 0
    lp = c.logprobs
    n = s.usage.prompt_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert all(len(t) == 2 for t in lp.top_logprobs[1:])
    assert "".join(lp.tokens) == c.text
    assert lp.tokens[-2:] == gen.tokens
    for a, b in zip(lp.token_logprobs[-2:], gen.token_logprobs):
        assert abs(a - b) < 1e-4, (lp.token_logprobs, gen.token_logprobs)
    # streamed: the echo chunk carries the same prompt logprobs
    chunks = list(client.completions.create(model=model, prompt=prompt + g.choices[0].text,
                                            max_tokens=0, echo=True, logprobs=2,
                                            stream=True))
    first = chunks[0].choices[0]
    assert first.text == c.text
    assert first.logprobs.token_logprobs == lp.token_logprobs


def test_max_tokens_zero_needs_echo(server, model):
    r = requests.post(server.url + "/v1/completions",
                      json={"model": model, "prompt": "Hello", "max_tokens": 0})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "max_tokens"


# ---------------------------------------------------------------- models

def test_models(client, model):
    ids = [m.id for m in client.models.list().data]
    assert ids == [model]
    m = client.models.retrieve(model)
    assert m.id == model and m.object == "model"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.code == "model_not_found"


def test_unknown_model_in_chat(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=user("hi"), max_tokens=2)
    assert e.value.code == "model_not_found"
    assert "gpt-4" in e.value.message


def test_alias(start_server):
    s = start_server("-c", "256", "--alias", "smol", model_id="smol")
    c = s.client()
    assert [m.id for m in c.models.list().data] == ["smol"]
    r = c.chat.completions.create(model="smol", messages=user(FRANCE), temperature=0)
    assert r.model == "smol"
    assert "paris" in r.choices[0].message.content.lower()
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=user("hi"),
                                  max_tokens=2)


def test_several_aliases(start_server):
    s = start_server("-c", "256", "--alias", "smol", "--alias", "gpt-4o-mini", model_id="smol")
    c = s.client()
    assert [m.id for m in c.models.list().data] == ["smol", "gpt-4o-mini"]
    assert c.models.retrieve("gpt-4o-mini").id == "gpt-4o-mini"
    # any alias is accepted; responses report the first
    r = chat(c, "gpt-4o-mini", FRANCE)
    assert r.model == "smol"
    assert "paris" in r.choices[0].message.content.lower()
    _, chunks = stream_chat(c, "gpt-4o-mini", FRANCE, max_tokens=4)
    assert chunks and all(ch.model == "smol" for ch in chunks)
    assert complete(c, "gpt-4o-mini", "The capital of France is", max_tokens=4).model == "smol"
    # the file name is no longer one of them, and the error names those that are
    for name in ("SmolLM2-135M-Instruct.Q4_1", "gpt-4o"):
        with pytest.raises(openai.NotFoundError) as e:
            chat(c, name, "hi", max_tokens=2)
        assert e.value.code == "model_not_found"
        assert "'smol', 'gpt-4o-mini'" in e.value.message, e.value.message


def test_accept_any_model(start_server):
    s = start_server("-c", "256", "--accept-any-model")
    c = s.client()
    assert [m.id for m in c.models.list().data] == [s.model_id]
    assert c.models.retrieve("gpt-4o-mini").id == "gpt-4o-mini"
    # any name is answered by the served model, which responses report
    for name in ("gpt-4o-mini", s.model_id, "no/such:model"):
        r = chat(c, name, FRANCE)
        assert r.model == s.model_id
        assert "paris" in r.choices[0].message.content.lower()
    _, chunks = stream_chat(c, "gpt-4o-mini", FRANCE, max_tokens=4)
    assert chunks and all(ch.model == s.model_id for ch in chunks)
    r = complete(c, "text-davinci-003", "The capital of France is", max_tokens=4)
    assert r.model == s.model_id and r.choices[0].text


# ---------------------------------------------------------------- health, tokenize, metrics

def test_health(server):
    r = requests.get(server.url + "/health")
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "ok"
    # what the quality budget lets approximate reuse do on this model, and why
    q = body["reuse_quality"]
    assert q["budget"] == "floor"
    assert set(q["methods"]) == {"blend", "fixup", "levels"}
    assert all(m["why"] for m in q["methods"].values())


@pytest.mark.parametrize("text", ["Hello world", "Héllo wörld, 你好 🙂!\n\tTabs  and  spaces"])
def test_tokenize_detokenize_round_trip(server, text):
    r = requests.post(server.url + "/tokenize", json={"content": text})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) > 0
    assert body["max_model_len"] == DEFAULT_CTX
    assert all(isinstance(t, int) for t in body["tokens"])
    d = requests.post(server.url + "/detokenize", json={"tokens": body["tokens"]})
    assert d.status_code == 200, d.text
    assert d.json()["content"] == text

    p = requests.post(server.url + "/tokenize", json={"content": text, "with_pieces": True})
    assert p.status_code == 200, p.text
    pieces = p.json()["tokens"]
    assert [x["id"] for x in pieces] == body["tokens"]
    if text.isascii():
        assert "".join(x["piece"] for x in pieces) == text


def test_tokenize_messages_matches_chat_usage(server, client, model):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": FRANCE}]
    r = requests.post(server.url + "/tokenize", json={"messages": msgs})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) > 0
    usage = client.chat.completions.create(model=model, messages=msgs, temperature=0,
                                           max_tokens=2).usage
    assert body["count"] == usage.prompt_tokens
    d = requests.post(server.url + "/detokenize", json={"tokens": body["tokens"]}).json()
    assert FRANCE in d["content"] or FRANCE in d["prompt"]


def counter(m, name):
    return m.get(name, 0.0)


def test_metrics(server, client, model):
    before = server.metrics()
    r = chat(client, model, FRANCE)
    n = 2
    for _ in range(n - 1):
        chat(client, model, FRANCE)
    key = 'kvserve_requests_total{endpoint="/v1/chat/completions",status="200"}'
    deadline = time.monotonic() + 5 * SLOW
    while True:  # the counters may be bumped just after the response is sent
        after = server.metrics()
        # (and the gauges are published after the engine frees the finished sequences)
        if (after.get(key, 0) - before.get(key, 0) >= n and
                counter(after, "kvserve_generation_tokens_total")
                - counter(before, "kvserve_generation_tokens_total")
                >= n * r.usage.completion_tokens and
                after.get("kvserve_running_sequences", 1) == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert after[key] - before.get(key, 0) == n
    assert (after["kvserve_prompt_tokens_total"] - before["kvserve_prompt_tokens_total"]
            == n * r.usage.prompt_tokens)
    assert (after["kvserve_generation_tokens_total"] - before["kvserve_generation_tokens_total"]
            == n * r.usage.completion_tokens)
    ttft = "kvserve_time_to_first_token_seconds_count"
    assert after[ttft] - before.get(ttft, 0) == n and after[ttft] > 0
    assert after['kvserve_time_to_first_token_seconds_bucket{le="+Inf"}'] == after[ttft]
    assert after["kvserve_time_to_first_token_seconds_sum"] > 0
    itl = "kvserve_inter_token_latency_seconds_count"
    assert after[itl] - before.get(itl, 0) == n * (r.usage.completion_tokens - 1)
    for gauge in ("kvserve_queue_depth", "kvserve_running_sequences",
                  "kvserve_kv_pool_blocks_used"):
        assert after[gauge] == 0, gauge
    assert after["kvserve_kv_pool_blocks_total"] > 0
    assert 0 <= after["kvserve_kv_pool_usage_ratio"] <= 1
    # histogram buckets are cumulative
    buckets = [v for k, v in after.items()
               if k.startswith("kvserve_time_to_first_token_seconds_bucket")]
    assert buckets == sorted(buckets)

    text = requests.get(server.url + "/metrics").text
    assert "# TYPE kvserve_requests_total counter" in text
    assert "# TYPE kvserve_time_to_first_token_seconds histogram" in text
    assert "# TYPE kvserve_running_sequences gauge" in text


# ---------------------------------------------------------------- curl, as in the README

def test_curl_chat(server, model):
    body = json.dumps({"model": model, "messages": user(FRANCE), "temperature": 0})
    r = subprocess.run(["curl", "-sS", "--fail-with-body", server.url + "/v1/chat/completions",
                        "-H", "Content-Type: application/json", "-d", body],
                       capture_output=True, text=True, timeout=60 * SLOW)
    assert r.returncode == 0, r.stderr + r.stdout
    out = json.loads(r.stdout)
    assert out["object"] == "chat.completion"
    assert "paris" in out["choices"][0]["message"]["content"].lower()

    r = subprocess.run(["curl", "-sS", "-N", server.url + "/v1/chat/completions",
                        "-H", "Content-Type: application/json",
                        "-d", json.dumps({"model": model, "messages": user(FRANCE),
                                          "temperature": 0, "stream": True})],
                       capture_output=True, text=True, timeout=60 * SLOW)
    assert r.returncode == 0, r.stderr
    events = [line[len("data: "):] for line in r.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or ""
                   for e in events[:-1])
    assert text == out["choices"][0]["message"]["content"]
