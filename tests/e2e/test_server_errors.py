"""`kvserve serve` rejects bad requests with OpenAI-shaped errors ({"error": {"message", "type",
"param", "code"}}) and the right HTTP status, keeps serving afterwards, enforces API keys, body,
context and queue limits, and reports configuration errors at start-up with exit code 2."""
import json
import subprocess
import threading
import time

import openai
import pytest
import requests

from conftest import BIN, ROOT, SANITIZER_MARKERS, SLOW, server_env

FRANCE = "What is the capital of France? Answer in one sentence."
TIMEOUT = 60 * SLOW


def user(text):
    return [{"role": "user", "content": text}]


def post(url, path, body=None, raw=None, headers=None, **kw):
    """POSTs `body` as JSON, or `raw` bytes as they are."""
    h = {"Content-Type": "application/json", **(headers or {})}
    data = raw if raw is not None else json.dumps(body).encode()
    return requests.post(url + path, data=data, headers=h, timeout=TIMEOUT, **kw)


def check_error(r, status, param=None, code=None, type_=None):
    """Asserts the OpenAI error shape; returns the error object."""
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers.get("Content-Type", "").startswith("application/json"), r.headers
    body = r.json()
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert "param" in err and "code" in err, err
    if param is not None:  # the field, or an element of it ("prompt[0]")
        assert (err["param"] == param
                or str(err["param"]).startswith((param + "[", param + "."))), err
    if code is not None:
        assert err["code"] == code, err
    if type_ is not None:
        assert err["type"] == type_, err
    return err


def check_serves(url, model, headers=None):
    """The server still answers a good request."""
    r = post(url, "/v1/chat/completions", {"model": model, "messages": user(FRANCE),
                                           "temperature": 0, "max_tokens": 16}, headers=headers)
    assert r.status_code == 200, r.text
    assert "paris" in r.json()["choices"][0]["message"]["content"].lower()


MODEL = "SmolLM2-135M-Instruct.Q4_1"
MSGS = user("hi")


def chat_body(**kw):
    return {"model": MODEL, "messages": MSGS, "max_tokens": 4, **kw}


# (endpoint, body: dict for JSON or bytes as is, param expected in the error or None)
BAD_REQUESTS = {
    "malformed JSON": ("/v1/chat/completions", b"{", None),
    "not JSON": ("/v1/chat/completions", b"hello", None),
    "empty body": ("/v1/chat/completions", b"", None),
    "truncated JSON": ("/v1/chat/completions",
                       b'{"model": "SmolLM2-135M-Instruct.Q4_1", "messages": [{"role": "us', None),
    "trailing garbage": ("/v1/chat/completions", json.dumps(chat_body()).encode() + b"}", None),
    "array body": ("/v1/chat/completions", b"[1, 2]", None),
    "string body": ("/v1/chat/completions", b'"hi"', None),
    "invalid UTF-8": ("/v1/chat/completions",
                      b'{"model": "SmolLM2-135M-Instruct.Q4_1", "messages": [{"role": "user", '
                      b'"content": "caf\xc3 \xff\xfe"}]}', None),
    "NUL escape": ("/v1/chat/completions", chat_body(messages=user("a\u0000b")), None),
    "messages string": ("/v1/chat/completions", chat_body(messages="hi"), "messages"),
    "messages missing": ("/v1/chat/completions", {"model": MODEL}, "messages"),
    "messages empty": ("/v1/chat/completions", chat_body(messages=[]), "messages"),
    "message not object": ("/v1/chat/completions", chat_body(messages=["hi"]), None),
    "role unknown": ("/v1/chat/completions",
                     chat_body(messages=[{"role": "wizard", "content": "hi"}]), None),
    "content number": ("/v1/chat/completions",
                       chat_body(messages=[{"role": "user", "content": 5}]), None),
    "model missing": ("/v1/chat/completions", {"messages": MSGS}, "model"),
    "model number": ("/v1/chat/completions", chat_body(model=7), "model"),
    "temperature string": ("/v1/chat/completions", chat_body(temperature="1"), "temperature"),
    "temperature negative": ("/v1/chat/completions", chat_body(temperature=-1), "temperature"),
    "top_p over 1": ("/v1/chat/completions", chat_body(top_p=2), "top_p"),
    "max_tokens negative": ("/v1/chat/completions", chat_body(max_tokens=-1), "max_tokens"),
    "max_tokens zero": ("/v1/chat/completions", chat_body(max_tokens=0), "max_tokens"),
    "max_tokens float": ("/v1/chat/completions", chat_body(max_tokens=2.5), "max_tokens"),
    "max_tokens string": ("/v1/chat/completions", chat_body(max_tokens="4"), "max_tokens"),
    "max_completion_tokens zero": ("/v1/chat/completions",
                                   chat_body(max_completion_tokens=0), "max_completion_tokens"),
    "n zero": ("/v1/chat/completions", chat_body(n=0), "n"),
    "n huge": ("/v1/chat/completions", chat_body(n=1000), "n"),
    "stop 5 entries": ("/v1/chat/completions", chat_body(stop=["a", "b", "c", "d", "e"]), "stop"),
    "stop number": ("/v1/chat/completions", chat_body(stop=5), "stop"),
    "stream string": ("/v1/chat/completions", chat_body(stream="yes"), "stream"),
    "seed string": ("/v1/chat/completions", chat_body(seed="x"), "seed"),
    "top_logprobs over 20": ("/v1/chat/completions",
                             chat_body(logprobs=True, top_logprobs=30), "top_logprobs"),
    "ignore_eos string": ("/v1/chat/completions", chat_body(ignore_eos="yes"), "ignore_eos"),
    "stream_options not object": ("/v1/chat/completions",
                                  chat_body(stream=True, stream_options=1), "stream_options"),
    "prompt missing": ("/v1/completions", {"model": MODEL}, "prompt"),
    "prompt number": ("/v1/completions", {"model": MODEL, "prompt": 5}, "prompt"),
    "prompt token out of range": ("/v1/completions",
                                  {"model": MODEL, "prompt": [1, 99999999]}, "prompt"),
    "prompt token negative": ("/v1/completions", {"model": MODEL, "prompt": [-1]}, "prompt"),
    "completion logprobs over 5": ("/v1/completions",
                                   {"model": MODEL, "prompt": "hi", "logprobs": 50}, "logprobs"),
    "tokenize no content": ("/tokenize", {}, None),
    "tokenize content number": ("/tokenize", {"content": 5}, None),
    "detokenize tokens string": ("/detokenize", {"tokens": "1 2"}, "tokens"),
    "detokenize token out of range": ("/detokenize", {"tokens": [99999999]}, "tokens"),
}


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_bad_request_is_400(server, name):
    path, body, param = BAD_REQUESTS[name]
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = post(server.url, path, raw=raw)
    check_error(r, 400, param=param, type_="invalid_request_error")
    check_serves(server.url, server.model_id)


def test_bad_request_through_openai_client(server):
    key = 'kvserve_requests_total{endpoint="/v1/chat/completions",status="400"}'
    before = server.metrics().get(key, 0)
    c = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=server.model_id, messages=user("hi"), temperature=5)
    assert e.value.status_code == 400
    assert e.value.param == "temperature"
    check_serves(server.url, server.model_id)
    assert server.metrics()[key] == before + 1


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_unknown_model_is_404(server, path):
    body = {"model": "gpt-4o", "messages": MSGS} if "chat" in path else \
        {"model": "gpt-4o", "prompt": "hi"}
    err = check_error(post(server.url, path, body), 404, code="model_not_found")
    assert "gpt-4o" in err["message"]
    check_error(requests.get(server.url + "/v1/models/gpt-4o"), 404, code="model_not_found")
    check_serves(server.url, server.model_id)


def test_max_tokens_over_context_is_400(server):
    ctx = requests.get(server.url + "/v1/models").json()["data"][0]["max_model_len"]
    err = check_error(post(server.url, "/v1/chat/completions",
                           chat_body(model=server.model_id, max_tokens=ctx + 10)), 400)
    assert err["code"] == "context_length_exceeded"
    assert str(ctx) in err["message"]
    check_serves(server.url, server.model_id)


@pytest.mark.parametrize("method,path,status", [
    ("GET", "/v1/chat/completions", 405),
    ("PUT", "/v1/completions", 405),
    ("POST", "/v1/models", 405),
    ("DELETE", "/health", 405),
    ("POST", "/metrics", 405),
    ("GET", "/tokenize", 405),
    ("GET", "/nope", 404),
    ("POST", "/v1/nope", 404),
    ("GET", "/v1/chat/completions/extra", 404),
    ("POST", "/", 405),  # the web page (tests/e2e/test_webui.py; --no-webui: 404)
    ("GET", "/webui/nope.js", 404),
])
def test_wrong_method_or_path(server, method, path, status):
    r = requests.request(method, server.url + path, timeout=TIMEOUT)
    check_error(r, status)
    if status == 405:
        assert r.headers.get("Allow") in ("GET", "POST"), r.headers
    check_serves(server.url, server.model_id)


# ---------------------------------------------------------------- servers with their own limits

def test_body_over_limit_is_413(start_server):
    s = start_server("-c", "256", "--max-body-bytes", "64K")
    big = json.dumps(chat_body(model=s.model_id, messages=user("x" * (1 << 20)))).encode()
    check_error(post(s.url, "/v1/chat/completions", raw=big), 413)

    def chunks():  # the same body without a Content-Length (chunked transfer encoding)
        for i in range(0, len(big), 1 << 16):
            yield big[i:i + (1 << 16)]
    check_error(post(s.url, "/v1/chat/completions", raw=chunks()), 413)
    # just under the limit is fine (and is a well-formed request)
    ok = chat_body(model=s.model_id, messages=user("hi " + " " * (60 << 10)), max_tokens=2)
    r = post(s.url, "/v1/chat/completions", ok)
    assert r.status_code in (200, 400), r.text  # 400 only for the context, not the size
    if r.status_code == 400:
        assert r.json()["error"]["code"] == "context_length_exceeded"
    check_serves(s.url, s.model_id)


def test_prompt_over_context_is_400(start_server):
    s = start_server("-c", "256")
    para = "The history of the river valley is long and varied, and farmers grew wheat there. "
    text = para * 35
    n = requests.post(s.url + "/tokenize", json={"messages": user(text)}).json()["count"]
    assert 500 < n < 800, n
    err = check_error(post(s.url, "/v1/chat/completions",
                           {"model": s.model_id, "messages": user(text)}), 400,
                      code="context_length_exceeded", type_="invalid_request_error")
    assert "256" in err["message"] and str(n) in err["message"], err
    assert err["param"] == "messages"

    n_prompt = requests.post(s.url + "/tokenize", json={"content": text}).json()["count"]
    err = check_error(post(s.url, "/v1/completions", {"model": s.model_id, "prompt": text}), 400,
                      code="context_length_exceeded")
    assert "256" in err["message"] and str(n_prompt) in err["message"], err

    # the openai client raises BadRequestError with the code
    with pytest.raises(openai.BadRequestError) as e:
        s.client().chat.completions.create(model=s.model_id, messages=user(text))
    assert e.value.code == "context_length_exceeded"

    # max_tokens over the context with a short prompt
    err = check_error(post(s.url, "/v1/completions",
                           {"model": s.model_id, "prompt": "hi", "max_tokens": 300}), 400,
                      code="context_length_exceeded")
    assert "256" in err["message"] and "300" in err["message"], err
    check_serves(s.url, s.model_id)


def test_api_keys(start_server):
    s = start_server("-c", "256", "--api-key", "k1", "--api-key", "k2")
    body = chat_body(model=s.model_id, max_tokens=2)
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "k1"},
                    {"Authorization": "Bearer k1x"}, {"Authorization": "Bearer "}):
        check_error(post(s.url, "/v1/chat/completions", body, headers=headers), 401,
                    code="invalid_api_key")
        check_error(requests.get(s.url + "/v1/models", headers=headers), 401,
                    code="invalid_api_key")
    check_error(post(s.url, "/tokenize", {"content": "hi"}), 401, code="invalid_api_key")
    for key in ("k1", "k2"):
        auth = {"Authorization": f"Bearer {key}"}
        r = post(s.url, "/v1/chat/completions", body, headers=auth)
        assert r.status_code == 200, r.text
        assert requests.get(s.url + "/v1/models", headers=auth).status_code == 200
        check_serves(s.url, s.model_id, headers=auth)
    # /health, /metrics and what routers read of a worker stay public (a router in front of
    # several keys has none of its own)
    for path in ("/health", "/metrics", "/get_load", "/server_info", "/model_info"):
        assert requests.get(s.url + path).status_code == 200, path
    assert requests.get(s.url + "/server_info").json()["model_id"] == s.model_id

    with pytest.raises(openai.AuthenticationError) as e:
        s.client(api_key="wrong").models.list()
    assert e.value.code == "invalid_api_key"
    assert [m.id for m in s.client(api_key="k2").models.list().data] == [s.model_id]


def test_api_keys_from_environment(start_server):
    s = start_server("-c", "256", env={"KVSERVE_API_KEYS": "e1,e2"})
    check_error(requests.get(s.url + "/v1/models"), 401, code="invalid_api_key")
    for key in ("e1", "e2"):
        assert requests.get(s.url + "/v1/models",
                            headers={"Authorization": f"Bearer {key}"}).status_code == 200


def test_queue_full_is_429(start_server):
    s = start_server("-c", "256", "--max-seqs", "1", "--max-queue", "1")
    long_body = chat_body(model=s.model_id, messages=user("Tell me a long story."),
                          max_tokens=200, ignore_eos=True, stream=True)
    # one stream runs...
    running = post(s.url, "/v1/chat/completions", long_body, stream=True)
    assert running.status_code == 200
    lines = running.iter_lines()
    assert next(lines).startswith(b"data: ")
    # ...one request waits...
    queued = {}

    def wait_in_queue():
        queued["r"] = post(s.url, "/v1/chat/completions",
                           chat_body(model=s.model_id, messages=user(FRANCE), max_tokens=16,
                                     temperature=0))
    t = threading.Thread(target=wait_in_queue)
    t.start()
    deadline = time.monotonic() + 10 * SLOW
    while s.metrics()["kvserve_queue_depth"] < 1:
        assert time.monotonic() < deadline, "the second request was not queued"
        time.sleep(0.02)
    # ...and the third is turned away, streamed or not
    for stream in (False, True):
        r = post(s.url, "/v1/chat/completions",
                 chat_body(model=s.model_id, stream=stream), stream=stream)
        check_error(r, 429)
        assert int(r.headers["Retry-After"]) >= 1, r.headers
    with pytest.raises(openai.RateLimitError):
        s.client().completions.create(model=s.model_id, prompt="hi", max_tokens=2)

    running.close()  # the queued request gets the slot
    t.join(timeout=60 * SLOW)
    assert queued["r"].status_code == 200, queued["r"].text
    assert "paris" in queued["r"].json()["choices"][0]["message"]["content"].lower()
    check_serves(s.url, s.model_id)
    m = s.metrics()
    assert m['kvserve_requests_total{endpoint="/v1/chat/completions",status="429"}'] == 2
    assert m["kvserve_queue_depth"] == 0


# ---------------------------------------------------------------- configuration errors

def serve_fails(*args, env=None, timeout=30):
    """Runs `kvserve serve ARGS` that must fail at once (before loading the model or
    listening); returns its stderr."""
    r = subprocess.run([BIN, "serve", *args], cwd=ROOT, env=server_env(env), text=True,
                       capture_output=True, timeout=timeout * SLOW)
    assert r.returncode == 2, (r.returncode, r.stderr)
    for marker in SANITIZER_MARKERS:
        assert marker not in r.stderr, r.stderr
    return r.stderr


@pytest.mark.parametrize("args,env,names", [
    (["--port", "70000"], None, "--port"),
    (["--port=0"], None, "--port"),
    (["--threads", "abc"], None, "--threads"),
    (["--max-body-bytes", "12Q"], None, "--max-body-bytes"),
    (["--log-level", "loud"], None, "--log-level"),
    (["--bogus"], None, "--bogus"),
    (["--port"], None, "--port"),
    ([], {"KVSERVE_THREADS": "abc"}, "KVSERVE_THREADS"),
    ([], {"KVSERVE_PORT": "-5"}, "KVSERVE_PORT"),
])
def test_bad_option_exits_2(args, env, names):
    err = serve_fails(*args, env=env)
    assert names in err, err


@pytest.mark.parametrize("config,names", [
    ({"bogus_key": 1}, "bogus_key"),
    ({"port": "x"}, "port"),
    ({"ctx_size": -3}, "ctx_size"),
    ("{\"port\": ", "invalid JSON"),
    ([1, 2], None),
])
def test_bad_config_file_exits_2(tmp_path, config, names):
    p = tmp_path / "kvserve.json"
    p.write_text(config if isinstance(config, str) else json.dumps(config))
    err = serve_fails("--config", str(p))
    assert str(p) in err, err
    if names:
        assert names in err, err


def test_missing_config_file_exits_2(tmp_path):
    err = serve_fails("--config", str(tmp_path / "none.json"))
    assert "none.json" in err


def test_config_file_env_and_flag_precedence(tmp_path, start_server):
    p = tmp_path / "kvserve.json"
    p.write_text(json.dumps({"alias": "cfg-model", "ctx_size": 300, "max_seqs": 2,
                             "port": 1, "log_level": "debug"}))
    # config < environment < flag: the port is the flag's, ctx_size the environment's
    s = start_server("--config", str(p), "--log-level", "warn",
                     env={"KVSERVE_CTX_SIZE": "320"}, model_id="cfg-model")
    models = requests.get(s.url + "/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["cfg-model"]
    assert models[0]["max_model_len"] == 320
    check_serves(s.url, "cfg-model")
