"""`kvserve serve` under concurrent load: batched streams give the same greedy text as each
request alone, a client that disconnects frees its sequence, and a long prompt is prefilled in
chunks between decode steps so that running streams keep making progress."""
import http.client
import json
import signal
import threading
import time
import urllib.parse

import requests

from conftest import SANITIZED, SLOW

MAX_TOKENS = 8 if SANITIZED else 32

QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Tell me the capital of France.",
    "What is the capital of Japan?",
    "How many days are there in a week?",
    "What color is the sky on a clear day?",
    "Which planet do we live on?",
    "Write a short poem about the sea.",
    "Name a fruit.",
    "Give me three tips for staying healthy.",
    "Explain what a computer is to a child.",
    "What is two plus two?",
    "Describe a cat in a few words.",
    "Why do birds fly south in winter? Please explain in detail, with examples.",
    "Say hello.",
    "List the days of the week.",
    "What is the boiling point of water in Celsius?",
]


def user(text):
    return [{"role": "user", "content": text}]


def sse_events(resp):
    """Yields the parsed `data:` events of a streamed http.client response ('[DONE]' as is)."""
    while True:
        line = resp.readline()
        if not line:
            return
        line = line.decode().strip()
        if line.startswith("data: "):
            data = line[len("data: "):]
            yield data if data == "[DONE]" else json.loads(data)


def open_stream(url, body, timeout=60):
    """POSTs a streamed request with http.client; returns (connection, response)."""
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout * SLOW)
    conn.request("POST", "/v1/chat/completions", body=json.dumps({**body, "stream": True}),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    assert resp.getheader("Content-Type", "").startswith("text/event-stream")
    return conn, resp


def wait_for(pred, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


def test_concurrent_streams_equal_sequential(server):
    client = server.client()
    model = server.model_id
    n = len(QUESTIONS)
    results = [None] * n
    errors = []
    barrier = threading.Barrier(n)

    def run(i):
        try:
            barrier.wait(timeout=30)
            chunks = client.chat.completions.create(model=model, messages=user(QUESTIONS[i]),
                                                    temperature=0, max_tokens=MAX_TOKENS,
                                                    stream=True)
            text, finish = "", []
            for c in chunks:
                for ch in c.choices:
                    text += ch.delta.content or ""
                    if ch.finish_reason:
                        finish.append(ch.finish_reason)
            results[i] = (text, finish)
        except Exception as e:  # reported below
            errors.append((i, repr(e)))

    peak = [0.0]
    done = threading.Event()

    def watch():  # the largest running batch seen while the clients stream
        while not done.is_set():
            peak[0] = max(peak[0], server.metrics()["kvserve_running_sequences"])
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300 * SLOW)
    done.set()
    watcher.join()
    assert not errors, errors
    assert all(r is not None for r in results)
    assert peak[0] > 1, "the streams never ran batched"

    for i, (text, finish) in enumerate(results):
        assert len(finish) == 1 and finish[0] in ("stop", "length"), (QUESTIONS[i], finish)
        alone = client.chat.completions.create(model=model, messages=user(QUESTIONS[i]),
                                               temperature=0, max_tokens=MAX_TOKENS)
        assert text == alone.choices[0].message.content, (
            f"batched output differs from the same request alone for {QUESTIONS[i]!r}")
        assert finish[0] == alone.choices[0].finish_reason
    assert "paris" in results[0][0].lower()


def test_disconnect_mid_stream_frees_the_sequence(server):
    # A client sees [DONE] before the engine reaps its sequence: wait until the earlier tests'
    # sequences are gone, so the baseline does not count their blocks.
    assert wait_for(lambda: server.metrics()["kvserve_running_sequences"] == 0, 2 * SLOW)
    before = server.metrics()
    conn, resp = open_stream(server.url, {
        "model": server.model_id, "messages": user("Write a long story about a dragon."),
        "temperature": 0, "max_tokens": 1000, "ignore_eos": True})
    got = 0
    for ev in sse_events(resp):
        assert ev != "[DONE]"
        if ev["choices"] and ev["choices"][0]["delta"].get("content"):
            got += 1
            if got == 3:
                break
    assert server.metrics()["kvserve_running_sequences"] == 1
    conn.sock.close()
    conn.close()

    assert wait_for(lambda: server.metrics()["kvserve_running_sequences"] == 0, 2 * SLOW), \
        "the sequence of a disconnected client is still running"
    after = server.metrics()
    assert after["kvserve_queue_depth"] == 0
    # its KV blocks are given back
    assert after["kvserve_kv_pool_blocks_used"] == before["kvserve_kv_pool_blocks_used"]
    # and it stopped generating: far fewer than the 1000 tokens asked for
    gen = after["kvserve_generation_tokens_total"] - before["kvserve_generation_tokens_total"]
    assert gen < 500

    r = server.client().chat.completions.create(
        model=server.model_id, messages=user("What is the capital of France? Answer in one "
                                             "sentence."), temperature=0)
    assert "paris" in r.choices[0].message.content.lower()


def long_prompt(server, target):
    para = ("The history of the river valley is long and varied. Farmers grew wheat and barley "
            "on its banks, traders carried salt and cloth along its roads, and every spring "
            "the water rose over the fields and left behind a layer of rich dark soil. ")
    n = requests.post(server.url + "/tokenize", json={"content": para}).json()["count"]
    text = para * (target // n + 1)
    text += "\nIn one sentence, what did the farmers grow?"
    count = requests.post(server.url + "/tokenize",
                          json={"messages": user(text)}).json()["count"]
    assert target <= count < target + 300, count
    return text


def test_long_prompt_does_not_stall_running_stream(server):
    """A ~1500-token prompt is prefilled in chunks (--prefill-chunk, 256 by default) between
    decode steps: a stream that is already running keeps receiving tokens meanwhile."""
    client = server.client()
    model = server.model_id
    # ~1500 tokens: 6 prefill chunks of 256 (4 under AddressSanitizer, where prefill is ~8x slower)
    text = long_prompt(server, 800 if SANITIZED else 1500)
    short_body = {"model": model, "messages": user("Write a long story about a dragon."),
                  "temperature": 0, "max_tokens": 1500, "ignore_eos": True}

    stamps = []  # arrival times of the short stream's tokens
    short_text = []
    stop_reading = threading.Event()
    conn, resp = open_stream(server.url, short_body)

    def read_short():
        try:
            for ev in sse_events(resp):
                if ev == "[DONE]" or stop_reading.is_set():
                    return
                delta = ev["choices"][0]["delta"] if ev["choices"] else {}
                if "role" not in delta and delta.get("content") is not None:  # one per token
                    stamps.append(time.monotonic())
                    short_text.append(delta["content"])
        finally:
            conn.close()  # a disconnect, when the stream has not ended

    reader = threading.Thread(target=read_short)
    reader.start()
    assert wait_for(lambda: len(stamps) >= 4, 30 * SLOW), "the short stream did not start"

    sent = time.monotonic()
    long_stream = client.chat.completions.create(model=model, messages=user(text),
                                                 temperature=0, max_tokens=8, stream=True)
    long_text, first = "", None
    for c in long_stream:
        if c.choices and c.choices[0].delta.content:
            if first is None:
                first = time.monotonic()
            long_text += c.choices[0].delta.content
    assert first is not None, "the long prompt produced no text"
    # the short stream's tokens that came while the long prompt was being prefilled
    during = [t for t in stamps if sent < t < first]
    stop_reading.set()
    reader.join(timeout=30 * SLOW)
    # about one token per prefill chunk; without interleaving, none
    print(f"short stream: {len(during)} tokens during the long prompt's "
          f"{first - sent:.2f} s to first token")
    assert len(during) >= 2, (
        f"the running stream got {len(during)} tokens during the {first - sent:.2f} s that "
        f"the long prompt took to its first token")

    # correctness: both equal the same requests alone (the short one over its first deltas). A
    # delta may carry more than one token (a speculative step keeps several; a writer that
    # falls behind sends what has come), so the answer alone is asked for as many tokens as the
    # streamed text has characters, which covers it, and must begin with it
    streamed = "".join(short_text[:min(len(short_text), MAX_TOKENS)])
    short_alone = client.chat.completions.create(
        model=model, messages=short_body["messages"], temperature=0, max_tokens=len(streamed) + 1,
        extra_body={"ignore_eos": True})
    assert streamed and short_alone.choices[0].message.content.startswith(streamed)
    if not SANITIZED:  # another ~1500-token prefill: slow under AddressSanitizer
        alone = client.chat.completions.create(model=model, messages=user(text),
                                               temperature=0, max_tokens=8)
        assert long_text == alone.choices[0].message.content
    assert wait_for(lambda: server.metrics()["kvserve_running_sequences"] == 0, 2 * SLOW)
