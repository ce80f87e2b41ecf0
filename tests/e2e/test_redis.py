"""The Redis tier end to end: two instances, each with its own disk tier, share one redis-server
(started here on a free port, without persistence): what one computed, the other reuses from
Redis with the same greedy answer. Redis killed: requests still succeed with the same answers,
and the stats and metrics say it is down; Redis restarted: the instances reconnect on their own
and reuse through it again. Skipped, visibly, where redis-server is not installed."""
import os
import shutil
import subprocess
import time

import pytest

from conftest import SLOW, free_port
from test_cache import (CHUNK, CTX, EXACT, MAX_TOKENS, clear, complete, document_tokens,
                        question_tokens, records_for, reusable, stats)

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


class RedisServer:
    """One redis-server child on 127.0.0.1:port, no RDB or AOF files (its --dir is a private
    temporary directory, removed with the test)."""

    def __init__(self, directory):
        self.dir = directory
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}"
        self.proc = None

    def start(self):
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--daemonize", "no", "--dir", self.dir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 10 * SLOW
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "redis-server exited at start"
            if self.ping():
                return self
            time.sleep(0.05)
        raise AssertionError(f"redis-server did not answer on port {self.port}")

    def ping(self):
        import socket
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def redis(tmp_dir):
    if not os.access(REDIS_SERVER, os.X_OK):
        pytest.skip("redis-server is not installed (scripts/setup.sh installs it)")
    r = RedisServer(tmp_dir("kvserve-redis-")).start()
    yield r
    r.kill()


def redis_tier(srv):
    return stats(srv)["tiers"]["redis"]


def wait_connected(srv, want, seed):
    """Sends short new prompts (each a lookup and a write-back) until the Redis tier's connected
    flag is `want`; returns the answers' count."""
    deadline = time.monotonic() + 30 * SLOW
    n = 0
    while redis_tier(srv)["connected"] != want:
        assert time.monotonic() < deadline, redis_tier(srv)
        complete(srv, document_tokens(srv, 40, seed=seed + n))
        n += 1
        time.sleep(0.2)
    return n


def test_two_instances_share_one_redis(start_server, redis):
    a = start_server(*CTX, *EXACT, "--redis", redis.url)
    assert redis_tier(a)["enabled"] and redis_tier(a)["connected"]
    prompt = document_tokens(a, 2 * CHUNK + 40, seed=21) + question_tokens(a)
    ref, cached, _ = complete(a, prompt)
    assert cached == 0
    a.terminate()  # a clean stop finishes the queued writes to Redis

    # b has its own (empty) disk tier: its hits come from Redis
    b = start_server(*CTX, *EXACT, "--redis", redis.url)
    text, cached, _ = complete(b, prompt)
    assert (text, cached) == (ref, reusable(len(prompt)))
    st = redis_tier(b)
    assert st["hits"] == records_for(len(prompt)) and st["corrupt"] == 0, st
    assert st["bytes_out"] > 0
    m = b.metrics()
    assert m['kvserve_cache_hits_total{tier="redis"}'] == st["hits"]
    assert m["kvserve_cache_redis_connected"] == 1
    # promoted: a repeat is served above Redis (pool, RAM), the hits stay
    text, cached, _ = complete(b, prompt)
    assert (text, cached) == (ref, reusable(len(prompt)))
    assert redis_tier(b)["hits"] == st["hits"]
    # the official client sees the reuse too
    r = b.client().completions.create(model=b.model_id, prompt=prompt, max_tokens=MAX_TOKENS,
                                      temperature=0)
    assert r.choices[0].text == ref
    assert r.usage.prompt_tokens_details.cached_tokens == reusable(len(prompt))

    # clearing Redis for this namespace: a third instance recomputes
    assert clear(b, tiers=["redis"])["redis"] >= records_for(len(prompt))
    c = start_server(*CTX, *EXACT, "--redis", redis.url)
    text, cached, _ = complete(c, prompt)
    assert (text, cached) == (ref, 0)


def test_redis_down_then_back(start_server, redis):
    b = start_server(*CTX, *EXACT, "--redis", redis.url)
    assert redis_tier(b)["connected"]

    # Redis killed: requests succeed, with the answers of an uncached run, without waiting long
    redis.kill()
    prompt = document_tokens(b, 2 * CHUNK + 40, seed=31) + question_tokens(b)
    ref, _, _ = complete(b, prompt, cache=False)
    t0 = time.monotonic()
    text, cached, _ = complete(b, prompt)
    assert (text, cached) == (ref, 0)
    assert time.monotonic() - t0 < 30 * SLOW
    text, cached, _ = complete(b, prompt)
    assert (text, cached) == (ref, reusable(len(prompt)))  # RAM and pool still work
    st = redis_tier(b)
    assert not st["connected"] and st["misses"] >= 1, st
    assert b.metrics()["kvserve_cache_redis_connected"] == 0

    # Redis back on the same port, empty: a new instance fills it, b reconnects and reuses it
    redis.start()
    a = start_server(*CTX, *EXACT, "--redis", redis.url)
    prompt2 = document_tokens(a, 2 * CHUNK + 40, seed=32) + question_tokens(a)
    ref2, cached, _ = complete(a, prompt2)
    assert cached == 0
    a.terminate()
    wait_connected(b, True, seed=400)
    hits = redis_tier(b)["hits"]
    text, cached, _ = complete(b, prompt2)
    assert (text, cached) == (ref2, reusable(len(prompt2)))
    assert redis_tier(b)["hits"] == hits + records_for(len(prompt2))
    assert "lost" in b.stderr() and "reconnected" in b.stderr()
