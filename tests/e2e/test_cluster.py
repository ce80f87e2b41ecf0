"""Two instances sharing one Redis tier behind sglang-router (round_robin), under faults: a prompt
one instance computed is served to the other from Redis; an instance SIGTERMed while clients
stream and wait on answers is taken out by the router as it drains, and no request fails; an
instance kill -9ed under the same load costs only the requests it held, every request after the
router marks it unhealthy is answered by the other, and it rejoins when restarted on its port.

The router, its health flags and the instances' options are test_router.py's; the router's own
/v1/models is checked there. One pair, one Redis and one router for the module: each fault test
restarts the instance it stopped."""
import concurrent.futures
import subprocess
import threading
import time

import pytest

from conftest import SLOW
from test_redis import serving_redis
from test_router import Router, num_reqs, served, serving_pair

# b drains with a grace past the router's health interval (1 s, out after one failure)
GRACE = ["--drain-grace", "2"]
LICENSE = "/usr/share/common-licenses/GPL-3"
CHUNK = 256  # --cache-chunk-tokens' default


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    yield from serving_redis(str(tmp_path_factory.mktemp("redis")))


@pytest.fixture(scope="module")
def pair(model_path, redis):
    # --redis-codec off: lossless and q8 values, no codec table to calibrate at start
    yield from serving_pair("--redis", redis.url, "--redis-codec", "off", b_extra=GRACE)


@pytest.fixture(scope="module")
def router(pair):
    # the requests a killed instance failed open the router's circuit breaker for it, which
    # keeps it out this long once it is healthy again (60 s by default)
    r = Router("sglang", pair, "round_robin", extra=["--cb-timeout-duration-secs", "1"])
    yield r
    r.stop()


def wait_until(cond, what, timeout=15 * SLOW):
    """Polls cond until it holds; returns the time it did."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)
    return time.monotonic()


def redis_records(redis):
    """Lossless chunk records in Redis (one value each)."""
    out = subprocess.run(["redis-cli", "-p", str(redis.port), "--scan", "--pattern", "*:r:*"],
                         capture_output=True, text=True, check=True).stdout
    return len(out.split())


def ask_through(router, model, content):
    client = router.client()
    return client.chat.completions.create(model=model, max_tokens=2, temperature=0,
                                          messages=[{"role": "user", "content": content}])


def test_a_prompt_computed_on_one_instance_is_served_from_redis_on_the_other(router, pair,
                                                                             redis):
    with open(LICENSE) as f:
        text = f.read(3200)  # about 700 tokens: two whole chunks and a partial one
    question = text + "\n\nWho may copy this license?"
    records, before = redis_records(redis), served(pair)
    first = ask_through(router, pair[0].model_id, question)
    computed_on = [b - a for a, b in zip(before, served(pair))].index(1)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert first.usage.prompt_tokens > 2 * CHUNK
    # the writer is asynchronous, in order: wait for the two whole chunks to reach Redis
    wait_until(lambda: redis_records(redis) >= records + 2, "the chunks never reached Redis")
    before = served(pair)
    again = ask_through(router, pair[0].model_id, question)
    # round_robin: the next request goes to the other instance, whose own tiers never saw it
    assert [b - a for a, b in zip(before, served(pair))].index(1) == 1 - computed_on
    assert again.usage.prompt_tokens_details.cached_tokens >= 2 * CHUNK, again.usage
    chunks = again.usage.model_extra["kv_chunks"]
    assert chunks and {c["tier"] for c in chunks} == {"redis"}, chunks
    assert sum(c["tokens"] for c in chunks) == again.usage.prompt_tokens_details.cached_tokens
    assert again.choices[0].message.content == first.choices[0].message.content


class Load:
    """`n` clients sending short greedy chats through the router, one after another, until
    stopped; odd clients stream. Each request is recorded as (sent, error or None): a stream
    that ends without its finish_reason is an error too."""

    def __init__(self, router, model, n=4):
        self.router, self.model = router, model
        self.records, self._lock = [], threading.Lock()
        self._stop = threading.Event()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=n)
        self._clients = [self._pool.submit(self._client, i) for i in range(n)]

    def _ask(self, client, i, k, stream):
        ask = dict(model=self.model, max_tokens=4, temperature=0,
                   messages=[{"role": "user", "content": f"Client {i}, question {k}: say hi."}])
        if not stream:
            r = client.chat.completions.create(**ask)
            return r.choices[0].finish_reason
        chunks = list(client.chat.completions.create(**ask, stream=True))
        return next((c.choices[0].finish_reason for c in reversed(chunks)
                     if c.choices and c.choices[0].finish_reason), None)

    def _client(self, i):
        client = self.router.client()
        k = 0
        while not self._stop.is_set():
            sent = time.monotonic()
            try:
                finish = self._ask(client, i, k, stream=i % 2 == 1)
                error = None if finish in ("length", "stop") else f"finish_reason {finish}"
            except Exception as e:  # the client's errors: a 5xx, a reset connection
                error = repr(e)
            with self._lock:
                self.records.append((sent, error))
            k += 1

    def answered_since(self, t):
        with self._lock:
            return sum(1 for sent, error in self.records if sent > t and error is None)

    def stop(self):
        """Stops the clients once their requests are answered; returns the records."""
        self._stop.set()
        for c in self._clients:
            c.result(timeout=60 * SLOW)  # a request that hangs fails the test here
        self._pool.shutdown()
        return self.records


def rejoin(router, pair, i):
    """Restarts pair[i] on its port and checks the router sends it requests again."""
    pair[i].restart()
    wait_until(lambda: router.workers_state()[pair[i].url], "the router never took it back")
    k = 0
    while served(pair)[i] < 2:  # counted from its restart
        assert k < 40, "the router sends the restarted instance nothing"
        ask_through(router, pair[i].model_id, f"Back again, {k}?")
        k += 1


def test_an_instance_drained_under_load_fails_no_request(router, pair):
    a, b = pair
    load = Load(router, b.model_id)
    try:
        wait_until(lambda: num_reqs(b) > 0, "no request reached b")
        b.proc.send_signal(15)
        # the router takes b out while it drains (--drain-grace: it still takes requests)
        out = wait_until(lambda: not router.workers_state()[b.url], "b never left the router")
        assert b.proc.poll() is None, "b left the router's pool only after it exited"
        wait_until(lambda: load.answered_since(out) >= 8, "a did not answer")
    finally:
        records = load.stop()
    assert [e for _, e in records if e] == []
    assert b.proc.wait(timeout=20 * SLOW) == 0
    assert "completions 503" not in b.stderr()  # none refused: none even retried
    rejoin(router, pair, 1)


def test_an_instance_killed_under_load_costs_only_its_requests_and_rejoins(router, pair):
    a, b = pair
    load = Load(router, a.model_id)
    try:
        wait_until(lambda: num_reqs(a) > 0, "no request reached a")
        a.kill9()
        out = wait_until(lambda: not router.workers_state()[a.url], "a never left the router")
        wait_until(lambda: load.answered_since(out) >= 8, "b did not answer")
    finally:
        records = load.stop()
    # the requests a held (or was sent before the router saw it gone) may fail; none later
    assert [e for sent, e in records if e and sent > out] == []
    assert len(records) > 8
    rejoin(router, pair, 0)
