"""kvserve behind the routers people already run in front of several inference servers:
SGLang's (sglang-router) and vLLM's (vllm-router), both installed by scripts/setup.sh. Two
instances per router, each on one thread: the routers register them (GET /health,
/server_info, /model_info), list their model, poll their load (GET /get_load) under the
power_of_two policy, forward every API the router knows to them, streams included, and take
an instance out while it drains after SIGTERM, without a request failing.

One pair of instances per router for the whole module; the routers check health every second
and mark a worker unhealthy after one failure, so nothing here waits on a sleep."""
import concurrent.futures
import json
import os
import sys
import time
import urllib.error
import urllib.request

import pytest

from conftest import ROOT, SLOW, KvServer, http_get

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import cluster  # noqa: E402  (scripts/cluster.py)

# Small instances: a 1024-token context (so a 4096-token KV pool) on one thread each.
INSTANCE_ARGS = ["--threads", "1", "-c", "1024"]


def post(url, body, timeout=60 * SLOW):
    """(status, parsed JSON or raw text) of a POST; HTTP errors are returned, not raised."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


class Router(cluster.Router):
    """scripts/cluster.py's router (health checked every second) with the `extra` options,
    started at once; `client()` is an OpenAI client through it."""

    def __init__(self, kind, workers, policy, extra=()):
        super().__init__(kind, workers, policy, extra=extra)
        self.start(timeout=30 * SLOW)

    def client(self):
        import openai
        return openai.OpenAI(base_url=self.url + "/v1", api_key="x", timeout=60 * SLOW,
                             max_retries=0)


def start_pair(*extra, b_extra=()):
    """Two instances, a and b; b_extra: b's own options."""
    servers = []
    try:
        for more in ((), b_extra):
            servers.append(KvServer([*INSTANCE_ARGS, *extra, *more]).start())
    except BaseException:
        for s in servers:
            s.terminate()
        raise
    return servers


def serving_pair(*extra, b_extra=()):
    """A fixture's body: start_pair's instances, yielded, then stopped."""
    servers = start_pair(*extra, b_extra=b_extra)
    yield servers
    for s in servers:
        s.terminate()


@pytest.fixture(scope="module")
def pair(model_path):
    """Two instances for sglang-router (GET /get_load in its shape, the default)."""
    yield from serving_pair()


@pytest.fixture(scope="module")
def sglang(pair):
    """sglang-router in front of the pair, with its default policy, cache_aware."""
    r = Router("sglang", pair, "cache_aware")
    yield r
    r.stop()


def model_id(pair):
    return pair[0].model_id


# ---------------------------------------------------------------- what the routers read


def test_instances_answer_what_the_routers_read(pair):
    a = pair[0]
    for path in ("/server_info", "/get_server_info"):
        info = a.get_json(path)
        assert info["served_model_name"] == info["model_id"] == a.model_id
        assert "model" not in info  # serde: model_id's alias beside it fails the whole parse
        assert "model_path" not in info  # the router would load a tokenizer from it
        assert info["tp_size"] == info["dp_size"] == 1
        assert info["max_running_requests"] == 16
        assert info["max_total_tokens"] == 4096 and info["context_length"] == 1024
    for path in ("/model_info", "/get_model_info"):
        info = a.get_json(path)
        assert info["model_type"] == "llama" and info["is_generation"] is True
    load = a.get_json("/get_load")
    assert isinstance(load, list) and len(load) == 1, load
    assert load[0]["num_reqs"] == load[0]["num_waiting_reqs"] == load[0]["num_tokens"] == 0
    assert load[0]["kv_blocks_total"] * load[0]["kv_block_tokens"] == 4096
    status, _ = post(a.url + "/get_load", {})
    assert status == 405


def test_sglang_router_names_the_model(sglang, pair):
    status, body = http_get(sglang.url + "/v1/models")
    assert status == 200, body
    assert [m["id"] for m in json.loads(body)["data"]] == [model_id(pair)]
    status, body = http_get(sglang.url + "/workers")
    for w in json.loads(body)["workers"]:
        assert w["model_id"] == model_id(pair)
        assert w["metadata"]["model_type"] == "llama", w


def test_sglang_router_forwards_every_api_it_knows(sglang, pair):
    client = sglang.client()
    ask = [{"role": "user", "content": "Say hello."}]
    # greedy, and long enough answers that none ends before its limit
    chat = client.chat.completions.create(model=model_id(pair), messages=ask, max_tokens=4,
                                          temperature=0)
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 4
    text = client.completions.create(model=model_id(pair), prompt="Once upon", max_tokens=4,
                                     temperature=0)
    assert text.choices[0].text and text.usage.completion_tokens == 4
    resp = client.responses.create(model=model_id(pair), input="Say hello.",
                                   max_output_tokens=4, temperature=0)
    assert resp.output_text and resp.usage.output_tokens == 4
    emb = client.embeddings.create(model=model_id(pair), input=["a cat", "a dog"])
    assert len(emb.data) == 2 and len(emb.data[0].embedding) > 0
    # sglang-router 0.3.2 has no /v1/messages route (README says so): it answers 404 itself
    status, _ = post(sglang.url + "/v1/messages",
                     {"model": model_id(pair), "max_tokens": 4, "messages": ask})
    assert status == 404


def test_sglang_router_passes_streams(sglang, pair):
    client = sglang.client()
    stream = client.chat.completions.create(
        model=model_id(pair), messages=[{"role": "user", "content": "Count to five."}],
        max_tokens=6, temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and len(chunks) >= 3
    assert chunks[-1].usage.completion_tokens == 6
    with client.responses.stream(model=model_id(pair), input="Count to five.",
                                 max_output_tokens=6, temperature=0) as s:
        events = [e.type for e in s]
    # max_output_tokens cuts the answer: the stream ends incomplete, as OpenAI's does
    assert events[0] == "response.created"
    assert events[-1] in ("response.completed", "response.incomplete"), events
    assert "response.output_text.delta" in events


def served(pair):
    """Chat completions each instance has answered."""
    key = 'kvserve_requests_total{endpoint="/v1/chat/completions",status="200"}'
    return [s.metrics().get(key, 0) for s in pair]


def chat_through(router, pair, n, question="Say hello."):
    for i in range(n):
        status, body = post(router.url + "/v1/chat/completions",
                            {"model": model_id(pair), "max_tokens": 2,
                             "messages": [{"role": "user", "content": f"{question} {i}"}]})
        assert status == 200, body


@pytest.mark.parametrize("policy", ["round_robin", "power_of_two"])
def test_sglang_router_policies_spread_requests(pair, policy):
    r = Router("sglang", pair, policy)
    try:
        if policy == "power_of_two":
            # the router parsed both instances' /get_load (-1: it could not)
            status, body = http_get(r.url + "/get_loads")
            loads = {w["worker"]: w["load"] for w in json.loads(body)["workers"]}
            assert loads == {s.url: 0 for s in pair}, body
        before = served(pair)
        chat_through(r, pair, 6)
        after = served(pair)
        gained = [b - a for a, b in zip(before, after)]
        assert sum(gained) == 6
        if policy == "round_robin":
            assert gained == [3, 3], gained
    finally:
        r.stop()


def test_sglang_router_cache_aware_keeps_a_prefix_on_one_instance(sglang, pair):
    before = served(pair)
    chat_through(sglang, pair, 4, question="Tell me about the weather in Paris today, please.")
    gained = [b - a for a, b in zip(before, served(pair))]
    assert sorted(gained) == [0, 4], gained


# ---------------------------------------------------------------- vLLM's router


def test_vllm_router_lists_forwards_reads_the_load_and_drains(model_path):
    # b keeps taking requests for 3 s after SIGTERM, while /health answers 503
    servers = start_pair("--get-load-format", "vllm", b_extra=("--drain-grace", "3"))
    r = None
    try:
        load = servers[0].get_json("/get_load")
        assert load["load"] == 0 and load["num_reqs"] == 0, load
        r = Router("vllm", servers, "power_of_two")
        status, body = http_get(r.url + "/get_loads")
        assert {w["load"] for w in json.loads(body)["workers"]} == {0}, body
        status, body = http_get(r.url + "/v1/models")
        assert status == 200 and json.loads(body)["data"][0]["id"] == servers[0].model_id
        client = r.client()
        ask = [{"role": "user", "content": "Say hello."}]
        chat = client.chat.completions.create(model=servers[0].model_id, messages=ask,
                                              max_tokens=4, temperature=0)
        assert chat.usage.completion_tokens == 4
        stream = client.chat.completions.create(model=servers[0].model_id, messages=ask,
                                                max_tokens=4, temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert client.completions.create(model=servers[0].model_id, prompt="Once", max_tokens=2,
                                         temperature=0).usage.completion_tokens == 2
        assert client.responses.create(model=servers[0].model_id, input="Hi",
                                       max_output_tokens=2,
                                       temperature=0).usage.output_tokens == 2
        assert len(client.embeddings.create(model=servers[0].model_id, input="a").data) == 1
        # vllm-router forwards Anthropic's Messages API as it came
        status, body = post(r.url + "/v1/messages",
                            {"model": servers[0].model_id, "max_tokens": 2, "temperature": 0,
                             "messages": ask})
        assert status == 200 and body["usage"]["output_tokens"] == 2, body
        drain_through(r, servers, grace=True)
        # with the grace, the router took b out before b refused anything: no request was
        # retried (power_of_two may draw a refusing instance again for every retry)
        assert "completions 503" not in servers[1].stderr(), servers[1].stderr()
    finally:
        if r:
            r.stop()
        for s in servers:
            s.terminate()


# ---------------------------------------------------------------- draining


def num_reqs(server):
    load = server.get_json("/get_load")
    return (load[0] if isinstance(load, list) else load)["num_reqs"]


def drain_through(r, pair, grace=False):
    """SIGTERMs pair[1] while it runs a long request, and checks that the router takes it out
    before it exits and that no request sent through the router meanwhile fails: without
    --drain-grace, those the router still sends it are refused (503) and retried on pair[0]."""
    a, b = pair
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        # a long request (about 4 s here) keeps b draining past the router's next health check
        long = pool.submit(post, b.url + "/v1/chat/completions",
                           {"model": b.model_id, "max_tokens": 900, "ignore_eos": True,
                            "messages": [{"role": "user", "content": "Write a story."}]})
        deadline = time.monotonic() + 10 * SLOW
        while num_reqs(b) == 0:
            assert time.monotonic() < deadline and not long.done(), long
            time.sleep(0.02)
        b.proc.send_signal(15)
        while http_get(b.url + "/health")[0] == 200:  # until the signal is taken
            assert time.monotonic() < deadline
            time.sleep(0.01)
        status, body = http_get(b.url + "/health")
        assert status == 503 and json.loads(body)["status"] == "draining"
        assert num_reqs(b) == 1  # the load is still answered, the long request in it
        # b itself: during --drain-grace it still answers, else it refuses at once
        status, body = post(b.url + "/v1/chat/completions",
                            {"model": b.model_id, "max_tokens": 2,
                             "messages": [{"role": "user", "content": "Hi."}]})
        assert status == (200 if grace else 503), body
        # requests through the router all succeed while b drains (those it sends b are
        # answered 503 and retried on a) and the router takes b out before b exits
        t0, out_while_draining = time.monotonic(), False
        while not long.done():
            chat_through(r, pair, 1)
            if not r.workers_state()[b.url]:
                out_while_draining = b.proc.poll() is None
                break
        assert out_while_draining, "b left the router's pool only after it exited"
        assert time.monotonic() - t0 < 3 * SLOW
        status, body = long.result()
        assert status == 200 and body["usage"]["completion_tokens"] == 900, body
    assert b.proc.wait(timeout=10 * SLOW) == 0
    chat_through(r, pair, 4)  # b gone: every request goes to a
    assert r.workers_state() == {a.url: True, b.url: False}


def test_drain_grace_takes_requests_and_a_second_signal_still_exits_at_once(start_server):
    s = start_server("-c", "256", "--drain-grace", "60")
    s.proc.send_signal(15)
    deadline = time.monotonic() + 5 * SLOW
    while "--drain-grace" not in s.stderr():
        assert time.monotonic() < deadline, s.stderr()
        time.sleep(0.01)
    status, body = http_get(s.url + "/health")
    assert status == 503 and json.loads(body)["status"] == "draining"
    status, body = post(s.url + "/v1/completions",
                        {"model": s.model_id, "prompt": "Hi", "max_tokens": 2})
    assert status == 200, body
    t0 = time.monotonic()
    s.proc.send_signal(2)
    rc = s.proc.wait(timeout=10 * SLOW)
    s.killed = True  # exited on purpose, without the clean shutdown terminate() checks
    s._close_stderr()
    assert rc == 128 + 2 and time.monotonic() - t0 < 2 * SLOW, (rc, s.stderr())
    assert "SIGINT again: exiting now, without draining" in s.stderr()


def test_sglang_router_takes_a_draining_instance_out_and_no_request_fails(pair):
    """Runs last: it stops one of the module's instances."""
    r = Router("sglang", pair, "round_robin")
    try:
        drain_through(r, pair)
    finally:
        r.stop()
