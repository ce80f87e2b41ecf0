"""The Redis tier over two redis-server shards behind twemproxy (nutcracker), as `make cluster`
runs it (scripts/cluster.py starts the shards and the proxy): an instance's records reach
another through the shards; a shard stopped while requests run, then restarted empty, costs
hits, never an answer other than the cache-off one, and the hits come back after the restart;
a clear through the proxy (which refuses SCAN) makes a namespace's records unreachable. Skipped,
visibly, where nutcracker or redis-server is not installed (scripts/setup.sh installs both)."""
import os
import sys
import threading
import time

import pytest

from conftest import ROOT, SLOW
from test_cache import clear, complete, document_tokens, question_tokens

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import cluster  # noqa: E402  (scripts/cluster.py)

# Chunks of 64 tokens, so that a short prompt's records spread over both shards.
ARGS = ["-c", "1024", "--threads", "1", "--cache-chunk-tokens", "64", "--no-blend",
        "--redis-codec", "off"]
# The proxy takes a failed shard out for this long before trying it again (2 s in make cluster).
RETRY_MS = 500
LOCAL = ["pool", "ram", "disk"]  # an instance's own tiers: cleared, its lookups go to Redis


@pytest.fixture(scope="module")
def tier(tmp_path_factory):
    """Two shards and the proxy in front of them, for the whole module."""
    for path in (cluster.NUTCRACKER, cluster.REDIS_SERVER):
        if not os.access(path, os.X_OK):
            pytest.skip(f"{path} is not installed (scripts/setup.sh installs it)")
    d = str(tmp_path_factory.mktemp("shards"))
    shards, proxy = [], None
    try:
        for i in range(2):
            shards.append(cluster.Shard(i, d))
            shards[-1].start()
        proxy = cluster.Proxy(shards, d, retry_ms=RETRY_MS)
        proxy.start()
        yield shards, proxy
    finally:
        for p in [proxy, *shards]:
            if p:
                p.stop()


def redis_chunks(r):
    """Prompt tokens a response took from Redis."""
    return sum(c["tokens"] for c in r["usage"].get("kv_chunks", []) if c["tier"] == "redis")


def test_a_shard_stopped_and_restarted_costs_hits_never_a_wrong_answer(start_server, tier):
    shards, proxy = tier
    w = start_server(*ARGS, "--redis", proxy.url)
    prompts = [document_tokens(w, 150, seed=70 + i) + question_tokens(w) for i in range(3)]
    refs = [complete(w, p, cache=False)[0] for p in prompts]
    for p in prompts:
        complete(w, p)
    w.terminate()  # a clean stop finishes the queued writes
    assert all(s.running() for s in shards)
    b = start_server(*ARGS, "--redis", proxy.url)
    full = []
    for p, ref in zip(prompts, refs):
        text, _, r = complete(b, p)
        assert text == ref
        full.append(redis_chunks(r))
    assert all(n >= 128 for n in full), full  # two whole chunks at least, from both shards
    assert all(s.running() for s in shards)

    # requests run on b, each after its own tiers are cleared, while shard 1 stops and restarts
    done, errors, stop = [], [], threading.Event()

    def ask():
        while not stop.is_set():
            i = len(done) % len(prompts)
            try:
                clear(b, tiers=LOCAL)
                text, _, r = complete(b, prompts[i])
                if text != refs[i]:
                    errors.append(f"prompt {i}: {text!r}, cache-off: {refs[i]!r}")
                done.append((i, redis_chunks(r), time.monotonic()))
            except Exception as e:  # noqa: BLE001 (reported below)
                errors.append(repr(e))
                return

    def wait_done(n):
        deadline = time.monotonic() + 60 * SLOW
        while len(done) < n and not errors:
            assert time.monotonic() < deadline, done
            time.sleep(0.01)

    t = threading.Thread(target=ask)
    t.start()
    try:
        wait_done(2)
        shards[1].kill()  # SIGKILL: the proxy's connection to it breaks
        stopped, n_stopped = time.monotonic(), len(done)
        wait_done(n_stopped + len(prompts))
        shards[1].start()  # empty, on the same port
        restarted, n_restarted = time.monotonic(), len(done)
        # hits come back: once the proxy tries the shard again, each prompt's missing chunks are
        # computed and written again, and every prompt is then served from Redis in full
        deadline = time.monotonic() + 30 * SLOW
        while not errors:
            last = {i: n for i, n, _ in done[n_restarted:]}
            if len(done) - n_restarted >= 2 * len(prompts) and \
                    all(last.get(i) == full[i] for i in range(len(prompts))):
                break
            assert time.monotonic() < deadline, (full, done[n_restarted:])
            time.sleep(0.05)
    finally:
        stop.set()
        t.join()
    assert not errors, errors
    down = [(i, n) for i, n, at in done[n_stopped:n_restarted] if at > stopped]
    assert sum(n for _, n in down) < sum(full[i] for i, _ in down), (full, down)  # hits lost
    st = b.get_json("/v1/cache/stats")["tiers"]["redis"]
    assert st["connected"] and st["corrupt"] == 0, st


def test_a_clear_through_the_proxy_makes_records_unreachable(start_server, tier):
    _, proxy = tier
    a = start_server(*ARGS, "--redis", proxy.url)
    prompt = document_tokens(a, 150, seed=90) + question_tokens(a)
    ref = complete(a, prompt, cache=False)[0]
    complete(a, prompt)
    a.terminate()
    b = start_server(*ARGS, "--redis", proxy.url)
    text, _, r = complete(b, prompt)
    assert text == ref and redis_chunks(r) >= 128, r["usage"]
    # the proxy refuses SCAN: nothing is counted as deleted, and nothing is found again
    assert clear(b)["redis"] == 0
    text, cached, r = complete(b, prompt)
    assert (text, cached, redis_chunks(r)) == (ref, 0, 0), r["usage"]
    assert "does not take SCAN" in b.stderr()
