"""The Redis tier end to end: two instances, each with its own disk tier, share one redis-server
(started here on a free port, without persistence): what one computed, the other reuses from
Redis with the same greedy answer. Redis killed: requests still succeed with the same answers,
and the stats and metrics say it is down; Redis restarted: the instances reconnect on their own
and reuse through it again; Redis gone in the middle of a value: the rest is computed, the answer
the same. Levels: every chunk forced to a codec level, to 8-bit or to text,
and under a TTFT budget, with usage saying what each chunk came as; lossy KV never reaches the
instance's exact tiers; the codec table found in the cache directory, or none. Blend's content
records through Redis: one instance's passages blended by another. The disk tier with every
level (--cache-disk-encoded, no Redis): levels read from disk after a restart; an encoded RAM
tier (--cache-ram-encoding). The Redis tests
are skipped, visibly, where redis-server is not installed."""
import glob
import os
import shutil
import subprocess
import time

import pytest

from conftest import MODEL, SLOW, free_port, run_kvserve
from test_cache import (BLOCK, CHUNK, CTX, EXACT, KV_BYTES_PER_TOKEN, MAX_TOKENS, clear, complete,
                        document_tokens, question_tokens, records_for, reusable, pooled,
                        stats)

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


def serving_redis(directory):
    """A fixture's body: a RedisServer in directory, yielded, then killed (the test skipped where
    redis-server is not installed)."""
    if not os.access(REDIS_SERVER, os.X_OK):
        pytest.skip("redis-server is not installed (scripts/setup.sh installs it)")
    r = RedisServer(directory).start()
    yield r
    r.kill()


@pytest.fixture
def redis(tmp_dir):
    yield from serving_redis(tmp_dir("kvserve-redis-"))


@pytest.fixture(scope="module")
def codec_table(tmp_path_factory):
    """A codec table for the test model, calibrated once from a licence text (prefill only, a
    few seconds; the server's own calibration writes 2048 tokens first)."""
    path = str(tmp_path_factory.mktemp("codec") / "table.kvcodec")
    text = "/usr/share/common-licenses/GPL-3"
    r = run_kvserve("calibrate", "-m", MODEL, "--text", text, "-n", "256", "--chunk", "64",
                    "-o", path, timeout=300 * SLOW)
    assert r.returncode == 0, r.stderr
    return path


def with_redis(redis, codec_table):
    return ["--redis", redis.url, "--redis-codec", codec_table]


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


def test_two_instances_share_one_redis(start_server, redis, codec_table):
    a = start_server(*CTX, *EXACT, *with_redis(redis, codec_table))
    assert redis_tier(a)["enabled"] and redis_tier(a)["connected"]
    prompt = document_tokens(a, 2 * CHUNK + 40, seed=21) + question_tokens(a)
    ref, cached, _ = complete(a, prompt)
    assert cached == 0
    a.terminate()  # a clean stop finishes the queued writes to Redis

    # b has its own (empty) disk tier: its hits come from Redis
    b = start_server(*CTX, *EXACT, *with_redis(redis, codec_table))
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
    assert (text, cached) == (ref, pooled(len(prompt)))
    assert redis_tier(b)["hits"] == st["hits"]
    # the official client sees the reuse too
    r = b.client().completions.create(model=b.model_id, prompt=prompt, max_tokens=MAX_TOKENS,
                                      temperature=0)
    assert r.choices[0].text == ref
    assert r.usage.prompt_tokens_details.cached_tokens == pooled(len(prompt))

    # clearing Redis for this namespace: a third instance recomputes
    assert clear(b, tiers=["redis"])["redis"] >= records_for(len(prompt))
    c = start_server(*CTX, *EXACT, *with_redis(redis, codec_table))
    text, cached, _ = complete(c, prompt)
    assert (text, cached) == (ref, 0)


def test_redis_down_then_back(start_server, redis, codec_table):
    b = start_server(*CTX, *EXACT, *with_redis(redis, codec_table))
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
    assert (text, cached) == (ref, pooled(len(prompt)))  # RAM and pool still work
    st = redis_tier(b)
    assert not st["connected"] and st["misses"] >= 1, st
    assert b.metrics()["kvserve_cache_redis_connected"] == 0

    # Redis back on the same port, empty: a new instance fills it, b reconnects and reuses it
    redis.start()
    a = start_server(*CTX, *EXACT, *with_redis(redis, codec_table))
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


def settled_bytes_in(srv):
    """The Redis tier's bytes written, once its writes have stopped."""
    last = -1
    deadline = time.monotonic() + 60 * SLOW
    while time.monotonic() < deadline:
        now = redis_tier(srv)["bytes_in"]
        if now == last:
            return now
        last = now
        time.sleep(1.0)
    raise AssertionError("the Redis tier's writes did not settle")


def kv_levels(r):
    """The levels usage says the fetched chunks came in, and the tiers they came from."""
    chunks = r["usage"].get("kv_chunks", [])
    return [c["level"] for c in chunks], {c["tier"] for c in chunks}


def encoded_files(cache_dir):
    return glob.glob(os.path.join(cache_dir, "*", "*.e*.kvc"))


def test_levels_from_an_encoded_disk_tier(start_server, tmp_dir, codec_table):
    """--cache-disk-encoded: the disk tier keeps every level beside each record, with no Redis;
    a restarted instance reads them as asked, and lossy KV stays with its request."""
    cache_dir = tmp_dir("kvserve-encdisk-")
    args = [*CTX, *EXACT, "--cache-dir", cache_dir, "--cache-disk-encoded",
            "--redis-codec", codec_table]
    a = start_server(*args)
    prompt = document_tokens(a, 2 * CHUNK + 40, seed=43) + question_tokens(a)
    ref, _, _ = complete(a, prompt)
    n = records_for(len(prompt))
    # the encodings are made in the background after each record is written: wait for them
    deadline, last, since = time.monotonic() + 120 * SLOW, -1, time.monotonic()
    while time.monotonic() < deadline:
        now = len(encoded_files(cache_dir))
        if now != last:
            last, since = now, time.monotonic()
        elif now > 0 and time.monotonic() - since > 2:
            break
        time.sleep(0.25)
    levels = len(encoded_files(cache_dir)) // n
    assert levels >= 2 and len(encoded_files(cache_dir)) == n * levels, encoded_files(cache_dir)
    a.terminate()

    b = start_server(*args)  # an empty RAM tier: the chunks come from disk
    text, cached, r = complete(b, prompt, kv_level="codec1")
    assert kv_levels(r) == (["codec1"] * n, {"disk"}), r["usage"]
    assert cached == reusable(len(prompt)) and text
    text, cached, r = complete(b, prompt, kv_level="q8")
    assert kv_levels(r) == (["q8"] * n, {"disk"}), r["usage"]
    # neither was kept above disk: a request insisting on exact KV reads the records, and
    # answers as the full prefill did
    text, cached, r = complete(b, prompt, kv_lossless=True, ttft_budget_ms=1)
    assert kv_levels(r) == (["lossless"] * n, {"disk"}), r["usage"]
    assert (text, cached) == (ref, reusable(len(prompt)))
    st = stats(b)["tiers"]["disk"]
    assert st["levels"]["codec1"] == n and st["levels"]["q8"] == n, st
    assert st["levels"]["lossless"] == n and st["corrupt"] == 0, st
    assert b.metrics()['kvserve_cache_disk_chunks_total{level="codec1"}'] == n
    # a cleared cache takes the encodings with the records
    clear(b)
    assert encoded_files(cache_dir) == []


def test_an_encoded_ram_tier(start_server, codec_table):
    """--cache-ram-encoding codec1: the RAM tier holds chunks at that level (swapped in by its
    encoder soon after they are stored, so more fit in --cache-ram-bytes); a reuse from it is
    lossy, said in usage, and a request insisting on exact KV does not take it."""
    srv = start_server(*CTX, *EXACT, "--cache-dir", "off", "--cache-ram-encoding", "codec1",
                       "--redis-codec", codec_table)
    prompt = document_tokens(srv, 2 * CHUNK + 40, seed=45) + question_tokens(srv)
    ref, _, _ = complete(srv, prompt)
    n = records_for(len(prompt))
    raw = (len(prompt) - 1) // BLOCK * BLOCK * KV_BYTES_PER_TOKEN  # what it computed, as f16
    deadline = time.monotonic() + 60 * SLOW
    while stats(srv)["tiers"]["ram"]["bytes"] > raw // 3:
        assert time.monotonic() < deadline, stats(srv)["tiers"]["ram"]
        time.sleep(0.2)
    # the two whole chunks encoded can bring the total under a third while the short last one
    # still waits for the encoder: done once the bytes stay put
    last = None
    while (now := stats(srv)["tiers"]["ram"]["bytes"]) != last:
        assert time.monotonic() < deadline, stats(srv)["tiers"]["ram"]
        last = now
        time.sleep(1.0)
    assert stats(srv)["tiers"]["ram"]["entries"] == n
    clear(srv, tiers=["pool"])  # the pool holds the exact blocks: RAM's are asked for
    text, cached, r = complete(srv, prompt)
    assert kv_levels(r) == (["codec1"] * n, {"ram"}), r["usage"]
    assert cached == reusable(len(prompt)) and text
    # exact KV insisted on: RAM has only the level, there is no disk, so the prompt is computed,
    # and answered as the first time
    text, cached, r = complete(srv, prompt, kv_lossless=True)
    assert (text, cached) == (ref, 0), r["usage"]
    assert "kv_chunks" not in r["usage"]


def test_levels_through_redis(start_server, redis, codec_table):
    a = start_server(*CTX, *EXACT, *with_redis(redis, codec_table))
    prompt = document_tokens(a, 2 * CHUNK + 40, seed=41) + question_tokens(a)
    ref, _, _ = complete(a, prompt)
    a.terminate()
    n = records_for(len(prompt))

    # a codec level, forced: every chunk comes at it, from Redis (two choices share the KV)
    b = start_server(*CTX, *EXACT, *with_redis(redis, codec_table))
    text, cached, r = complete(b, prompt, kv_level="codec1", n=2)
    assert kv_levels(r) == (["codec1"] * n, {"redis"}), r["usage"]
    assert cached == reusable(len(prompt)) and text
    # lossy KV stays with its request: b's RAM, disk and pool hold nothing of it (neither choice
    # stored it, nor what it computed after it), so a request
    # insisting on exact KV fetches the lossless values, and answers as a full prefill
    text, cached, r = complete(b, prompt, kv_lossless=True, ttft_budget_ms=1)
    assert kv_levels(r) == (["lossless"] * n, {"redis"}), r["usage"]
    assert (text, cached) == (ref, reusable(len(prompt)))
    # now held above Redis: the pool serves it, nothing is fetched
    text, cached, r = complete(b, prompt, kv_level="q8")
    assert (text, cached) == (ref, pooled(len(prompt)))
    assert "kv_chunks" not in r["usage"]
    st = redis_tier(b)
    assert st["levels"]["codec1"] == n and st["levels"]["lossless"] == n, st
    assert b.metrics()['kvserve_cache_redis_chunks_total{level="codec1"}'] == n

    # text: Redis holds it, the request computes it, exactly
    c = start_server(*CTX, *EXACT, *with_redis(redis, codec_table))
    text, cached, r = complete(c, prompt, kv_level="text")
    assert (text, cached) == (ref, 0)
    assert kv_levels(r)[0] == ["text"] * n, r["usage"]
    st = redis_tier(c)
    assert st["levels"]["text"] == n
    # what it computed of them is not written to Redis again (at most the last, partial one,
    # which the answer's tokens extend)
    assert settled_bytes_in(c) < n * CHUNK * KV_BYTES_PER_TOKEN, redis_tier(c)
    # 8-bit, and a budget no fetch can meet: whatever is fastest, every chunk accounted for
    d = start_server(*CTX, *EXACT, *with_redis(redis, codec_table))
    text, cached, r = complete(d, prompt, kv_level="q8")
    assert kv_levels(r) == (["q8"] * n, {"redis"}) and text
    e = start_server(*CTX, *EXACT, *with_redis(redis, codec_table), "--ttft-budget-ms", "1")
    text, cached, r = complete(e, prompt)
    levels, _ = kv_levels(r)
    assert len(levels) == n and text, r["usage"]
    allowed = {"lossless", "q8", "codec0", "codec1", "codec2", "codec3", "text"}
    assert set(levels) <= allowed, levels
    assert (levels[0] == "text") == (cached == 0), (levels, cached)

    # a level that is not one
    status, body = e.post_json("/v1/completions", {"model": e.model_id, "prompt": prompt,
                                                   "max_tokens": 1, "kv_level": "codec7x"})
    assert status == 400 and body["error"]["param"] == "kv_level", body


def test_codec_table_found_in_the_cache_dir_or_none(start_server, redis, codec_table, tmp_dir):
    cache_dir = tmp_dir("kvserve-redis-codec-")
    a = start_server(*CTX, *EXACT, "--redis", redis.url, "--redis-codec", "off",
                     "--cache-dir", cache_dir)
    prompt = document_tokens(a, CHUNK + 40, seed=51) + question_tokens(a)
    ref, _, _ = complete(a, prompt)
    a.terminate()
    # without a table: lossless and 8-bit only; a codec level asked for comes lossless
    b = start_server(*CTX, *EXACT, "--redis", redis.url, "--redis-codec", "off")
    text, _, r = complete(b, prompt, kv_level="codec0")
    assert kv_levels(r)[0] == ["lossless"] * records_for(len(prompt)), r["usage"]
    assert text == ref
    # auto: the table beside the disk tier's records of the model is found and used: what c
    # writes, an instance with that table decodes
    # (MODEL.kvcodec, beside the model, comes first: `kvserve calibrate` and the benchmarks
    # write it there)
    (model_dir,) = [d for d in os.listdir(cache_dir) if len(d) == 16]
    found = os.path.join(cache_dir, model_dir, "codec.kvcodec")
    shutil.copy(codec_table, found)
    if os.path.exists(MODEL + ".kvcodec"):
        found = MODEL + ".kvcodec"
    c = start_server(*CTX, *EXACT, "--redis", redis.url, "--cache-dir", cache_dir)
    assert f"codec table {found}" in c.stderr()
    prompt2 = document_tokens(c, CHUNK + 40, seed=52) + question_tokens(c)
    complete(c, prompt2)
    c.terminate()
    d = start_server(*CTX, *EXACT, *with_redis(redis, found))
    _, _, r = complete(d, prompt2, kv_level="codec0")
    assert kv_levels(r)[0] == ["codec0"] * records_for(len(prompt2)), r["usage"]


class CuttingProxy:
    """A TCP proxy in front of a redis-server that passes each connection's first `budget` bytes
    from Redis and then closes it: Redis going away in the middle of a value."""

    def __init__(self, target_port, budget):
        import socket
        import threading
        self.budget = budget
        self.target = target_port
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}"
        self.cut = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        import socket
        import threading
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            threading.Thread(target=self._pipe, args=(client, upstream, None),
                             daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, self.budget),
                             daemon=True).start()

    def _pipe(self, src, dst, budget):
        sent = 0
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if budget is not None and sent + len(data) >= budget:
                    dst.sendall(data[:budget - sent])
                    self.cut += 1
                    break
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.close()
            except OSError:
                pass

    def close(self):
        self.sock.close()


def test_redis_gone_in_the_middle_of_a_value(start_server, redis, codec_table):
    a = start_server(*CTX, *EXACT, *with_redis(redis, codec_table))
    prompt = document_tokens(a, 3 * CHUNK + 40, seed=61) + question_tokens(a)
    ref, _, _ = complete(a, prompt)
    a.terminate()
    # the lookup connection gets the aliases and one and a half lossless values, then is cut
    value = 4096 + CHUNK * KV_BYTES_PER_TOKEN
    proxy = CuttingProxy(redis.port, int(1.5 * value))
    try:
        b = start_server(*CTX, *EXACT, "--redis", proxy.url, "--redis-codec", codec_table)
        text, cached, r = complete(b, prompt, kv_level="lossless")
        assert proxy.cut >= 1
        assert text == ref  # the chunks that did not come are computed
        assert cached == CHUNK, (cached, r["usage"])
        assert kv_levels(r)[0] == ["lossless"], r["usage"]
        assert "lost" in b.stderr()
    finally:
        proxy.close()


def test_passages_blended_from_another_instance(start_server, redis, codec_table):
    """Blend's content records go to Redis too: passages one instance saw are blended by another,
    in another order behind another question, with no shared disk."""
    from test_blend import ask, details, rag
    a = start_server("-c", "2048", *with_redis(redis, codec_table))
    ask(a.client(), a.model_id, rag([0, 1, 2], "What is free software?"))
    a.terminate()  # a clean stop finishes the queued writes
    b = start_server("-c", "2048", *with_redis(redis, codec_table))
    msgs = rag([2, 0, 1], "Who has responsibilities?")
    full, _ = ask(b.client(), b.model_id, msgs, cache=False)
    assert redis_tier(b)["content_hits"] == 0
    got, usage = ask(b.client(), b.model_id, msgs, blend_ratio=1.0)
    _, blended, _ = details(usage)
    assert blended > 0.6 * usage.prompt_tokens, usage
    assert got == full  # ratio 1: every token recomputed over the fetched records
    st = redis_tier(b)
    assert st["content_hits"] >= 3 and st["corrupt"] == 0, st
