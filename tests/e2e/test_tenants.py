"""Fair shares between tenants (DESIGN.md "Tenants"): two API keys on one server, each holding a
share of what they share. One key pinning and leasing past its share of the pinned bytes gets
its own pins refused (409) and its own cache_control markers leased nothing, while the other
key's marked prefix is still leased; one key flooding the Responses store evicts its own oldest
responses, and the other's conversation goes on; one key's burst of queued requests gets 429s
past its share of the queue while the other key's single request gets in and is answered after
a few of the burst's requests, not after all of them. /metrics reports each tenant by its key's
index, never by the key. One server start for all of it: a RAM tier of ten 64-token chunks
(pins: at most half of it, a key at most half of that), 8 stored responses, 2 sequences at
once and a queue of 128 (a key: 64)."""
import concurrent.futures
import threading
import time

import anthropic
import pytest

from conftest import SLOW, KvServer

ALICE, BOB = "key-alice", "key-bob"  # tenants "0" and "1" (their order in --api-key)
CHUNK = 64
CHUNK_BYTES = CHUNK * 30 * 2 * 3 * 64 * 2  # SmolLM2-135M: layers x (K, V) x kv heads x dim x f16
STORE = 8
QUEUE = 128


@pytest.fixture(scope="module")
def srv(model_path):
    s = KvServer(["-c", "1024", "--api-key", ALICE, "--api-key", BOB,
                  "--cache-chunk-tokens", str(CHUNK), "--cache-ram-bytes", str(10 * CHUNK_BYTES),
                  "--cache-dir", "off", "--no-blend", "--responses-store", str(STORE),
                  "--max-seqs", "2", "--max-queue", str(QUEUE)]).start()
    yield s
    s.terminate()


def tokens(srv, n, seed):
    """n token ids of a made-up document (other seeds: other tokens from the first on)."""
    text = " ".join(f"Entry {seed}-{i}: site {(seed * 31 + i * 7) % 97} holds {i % 13} boxes."
                    for i in range(n // 4))
    status, body = srv.post_json("/tokenize", {"content": text, "add_special": False},
                                 api_key=ALICE)
    assert status == 200 and len(body["tokens"]) >= n, body
    return body["tokens"][:n]


def pin(srv, key, prompt):
    return srv.post_json("/v1/cache/pin", {"model": srv.model_id, "prompt": prompt}, api_key=key)


SYSTEM = " ".join(f"Rule {i}: answer topic {i} with the word {i * 3}." for i in range(14))


def marked(srv, key):
    """usage of a Messages request whose ~180-token system block is marked for caching."""
    c = anthropic.Anthropic(base_url=srv.url, api_key=key, max_retries=0, timeout=60 * SLOW)
    return c.messages.create(
        model=srv.model_id, max_tokens=1,
        system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": "Which word for topic 2?"}]).usage


def test_a_key_past_its_pin_share_is_refused_and_the_other_still_leases(srv):
    # alice's share: half of the pin cap (half the tier, five chunks): two and a half chunks
    status, r = pin(srv, ALICE, tokens(srv, 2 * CHUNK + 5, seed=1))
    assert status == 200 and (r["chunks"], r["pinned_chunks"]) == (2, 2), r
    status, r = pin(srv, ALICE, tokens(srv, 2 * CHUNK + 5, seed=2))
    assert status == 409 and r["error"]["code"] == "pin_share_exceeded", r
    assert "--tenant-pin-share" in r["error"]["message"]
    # her marker leases nothing now; bob's, the same size, still gets two chunks' worth
    assert marked(srv, ALICE).cache_creation_input_tokens == 0
    assert marked(srv, BOB).cache_creation_input_tokens >= 2 * CHUNK
    m = srv.metrics()
    assert m['kvserve_tenant_pinned_bytes{tenant="0",tier="ram"}'] == 2 * CHUNK_BYTES
    assert m['kvserve_tenant_pinned_bytes{tenant="1",tier="ram"}'] >= 2 * CHUNK_BYTES
    assert m['kvserve_tenant_pin_share_bytes{tier="ram"}'] == 5 * CHUNK_BYTES // 2
    assert not any(ALICE in k or BOB in k for k in m)
    # a refused pin pinned nothing; unpinning makes room again
    status, r = srv.post_json("/v1/cache/unpin", {"model": srv.model_id,
                                                  "prompt": tokens(srv, 2 * CHUNK + 5, seed=1)},
                              api_key=ALICE)
    assert status == 200 and r["unpinned_chunks"] == 2, r
    assert srv.metrics()['kvserve_tenant_pinned_bytes{tenant="0",tier="ram"}'] == 0
    # a pin with a ttl is a lease: it ends by itself
    body = {"model": srv.model_id, "prompt": tokens(srv, 2 * CHUNK + 5, seed=2), "ttl": 60}
    status, r = srv.post_json("/v1/cache/pin", body, api_key=ALICE)
    assert status == 200 and r["pinned_chunks"] == 2 and 55 <= r["expires_at"] - time.time() <= 61
    status, r = srv.post_json("/v1/cache/pin", {**body, "ttl": 0}, api_key=ALICE)
    assert status == 400 and r["error"]["param"] == "ttl", r


def test_a_flood_of_stored_responses_evicts_its_own_key_only(srv):
    bob = srv.client(api_key=BOB)
    kept = bob.responses.create(model=srv.model_id, input="Name a colour.", max_output_tokens=2)
    alice = srv.client(api_key=ALICE)
    flood = [alice.responses.create(model=srv.model_id, input=f"Say {i}.", max_output_tokens=1)
             for i in range(STORE + 1)]
    # the store is full: alice, over her half, lost her oldest; bob's conversation goes on
    later = bob.responses.create(model=srv.model_id, input="Another one.", max_output_tokens=1,
                                 previous_response_id=kept.id)
    assert later.status in ("completed", "incomplete")
    assert bob.responses.retrieve(kept.id).id == kept.id
    assert alice.responses.retrieve(flood[-1].id).id == flood[-1].id
    with pytest.raises(Exception) as e:
        alice.responses.retrieve(flood[0].id)
    assert getattr(e.value, "status_code", None) == 404
    m = srv.metrics()
    assert m['kvserve_tenant_responses_stored{tenant="1"}'] == 2
    assert m['kvserve_tenant_responses_stored{tenant="0"}'] == STORE - 2


def completion(srv, key, done, lock, max_tokens=4):
    status, r = srv.post_json("/v1/completions", {
        "model": srv.model_id, "prompt": "Count: 1 2 3", "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": True}, api_key=key)
    with lock:
        done.append((key, status, time.monotonic()))
    return status, r


def wait_for(srv, series, least):
    deadline = time.monotonic() + 30 * SLOW
    while srv.metrics()[series] < least and time.monotonic() < deadline:
        time.sleep(0.02)
    return srv.metrics()


def test_a_burst_of_one_key_does_not_starve_the_other(srv):
    done, lock = [], threading.Lock()
    burst = QUEUE // 2 + 16  # past alice's share of the queue
    with concurrent.futures.ThreadPoolExecutor(burst + 2) as ex:
        # two longer answers of alice's fill both sequence slots while her burst queues
        futs = [ex.submit(completion, srv, ALICE, done, lock, 48) for _ in range(2)]
        wait_for(srv, "kvserve_running_sequences", 2)
        futs += [ex.submit(completion, srv, ALICE, done, lock) for _ in range(burst)]
        m = wait_for(srv, 'kvserve_tenant_requests_waiting{tenant="0"}', QUEUE // 2)
        assert m['kvserve_tenant_requests_waiting{tenant="0"}'] == QUEUE // 2, m
        assert m['kvserve_tenant_requests_waiting{tenant="1"}'] == 0
        assert m["kvserve_tenant_queue_share"] == QUEUE // 2
        status, r = completion(srv, BOB, done, lock)  # one request of the other key
        assert status == 200, r
        results = [f.result() for f in futs]
    refused = [r for st, r in results if st == 429]
    assert refused and all(r["error"]["code"] == "server_busy" for r in refused), results
    assert "your share of the queue" in refused[0]["error"]["message"]
    assert all(st in (200, 429) for st, _ in results)
    # bob's answer came after the two answers running when it arrived and the one admitted
    # beside it (answers of one step may reach their clients in either order), not after
    # alice's sixty-four queued
    bob_at = next(t for k, st, t in done if k == BOB)
    before = sum(1 for k, st, t in done if k == ALICE and st == 200 and t < bob_at)
    assert before <= 8, (before, len(results) - len(refused))
