"""The context cache end to end on the real model: greedy outputs with the cache on (pool hit,
RAM hit, disk hit after a restart, partial prefix hit) equal outputs with the cache off; the
per-request opt-out; namespaces per API key and cache_salt; the cache endpoints; corrupt, torn
and unwritable records; concurrent requests sharing a prefix; the RAM tier's byte cap."""
import concurrent.futures
import glob
import os
import subprocess
import time

import pytest

from conftest import MODEL, SANITIZED, SLOW

# Under AddressSanitizer (5x slower) the same tests run on 64-token chunks.
CHUNK = 64 if SANITIZED else 256
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 2  # SmolLM2-135M: layers x (K, V) x kv heads x dim x f16
CHUNK_BYTES = CHUNK * KV_BYTES_PER_TOKEN
MAX_TOKENS = 8 if SANITIZED else 16
CTX = ["-c", "2048", "--cache-chunk-tokens", str(CHUNK)]
# For tests of the chunk tiers alone across a restart: blend's content records are kept on disk
# too, and would serve a prompt by content where its chunk records are gone (test_blend.py)
EXACT = ["--no-blend"]
BLOCK = 16  # KV block: records (RAM, disk, Redis) hold whole blocks


def reusable(n):
    """Prompt tokens a repeat of an n-token prompt reuses from records (RAM, disk, Redis): its
    whole blocks, but never the last token (its logits must be computed)."""
    whole = n // BLOCK * BLOCK
    return whole if whole < n else n - 1


def pooled(n):
    """Prompt tokens a repeat of an n-token prompt reuses from the pool tier, which matches to
    the token (the last sequence's partly filled block lends its rows too): all but the last."""
    return n - 1


def records_for(n):
    """Records (RAM or disk hits) that hold the whole blocks of an n-token prompt: one per chunk,
    the last one partial."""
    blocks_per_chunk = CHUNK // BLOCK
    return (n // BLOCK + blocks_per_chunk - 1) // blocks_per_chunk


def document_tokens(srv, n, seed, api_key=None):
    """n token ids of a deterministic made-up document (different seeds: different tokens from
    the first one on)."""
    sentences = []
    k = seed * 7919
    while len(sentences) < n // 6 + 50:
        k = (k * 1103515245 + 12345) % (1 << 31)
        sentences.append(f"Record {seed}-{len(sentences)}: the river at site {k % 997} is "
                         f"{k % 89} km long and {k % 13} m deep.")
    status, body = srv.post_json("/tokenize", {"content": " ".join(sentences),
                                               "add_special": False}, api_key=api_key)
    assert status == 200, body
    assert len(body["tokens"]) >= n
    return body["tokens"][:n]


QUESTION_TEXT = "\nQuestion: which site has the longest river? Answer:"


def question_tokens(srv, text=QUESTION_TEXT):
    status, body = srv.post_json("/tokenize", {"content": text, "add_special": False})
    assert status == 200, body
    return body["tokens"]


def complete(srv, prompt, api_key=None, **extra):
    """(text, cached_tokens, response) of a greedy completion over token ids."""
    body = {"model": srv.model_id, "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0, **extra}
    status, r = srv.post_json("/v1/completions", body, api_key=api_key)
    assert status == 200, r
    return (r["choices"][0]["text"], r["usage"]["prompt_tokens_details"]["cached_tokens"], r)


def stats(srv, api_key=None):
    return srv.get_json("/v1/cache/stats", api_key=api_key)


def clear(srv, api_key=None, **body):
    status, r = srv.post_json("/v1/cache/clear", body, api_key=api_key)
    assert status == 200, r
    return r["cleared"]


def test_reuse_is_exact_pool_ram_partial_and_whole_prompt(start_server):
    srv = start_server(*CTX)
    doc = document_tokens(srv, 2 * CHUNK + 40, seed=1)
    prompt = doc + question_tokens(srv)
    assert len(prompt) % BLOCK and len(prompt) % CHUNK
    ref, cached, _ = complete(srv, prompt, cache=False)
    assert cached == 0
    # the opt-out stored nothing: the first cached request is cold
    text, cached, _ = complete(srv, prompt)
    assert (text, cached) == (ref, 0)
    # two whole chunks and the trailing partial one (its whole blocks)
    assert stats(srv)["tiers"]["ram"]["entries"] == 3
    # a repeat reuses every whole block from the pool, by reference, and the last block's rows
    text, cached, _ = complete(srv, prompt)
    assert (text, cached) == (ref, pooled(len(prompt)))
    assert stats(srv)["tiers"]["pool"]["hits"] >= len(prompt) // BLOCK
    # the official client sees it too
    r = srv.client().completions.create(model=srv.model_id, prompt=prompt,
                                        max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == ref
    assert r.usage.prompt_tokens_details.cached_tokens == pooled(len(prompt))
    # with the pool tier cleared, the blocks come from RAM (copied into fresh blocks), the
    # partial chunk's too
    assert clear(srv, tiers=["pool"])["pool"] >= len(prompt) // BLOCK
    ram_hits = stats(srv)["tiers"]["ram"]["hits"]
    text, cached, _ = complete(srv, prompt)
    assert (text, cached) == (ref, reusable(len(prompt)))
    assert records_for(len(prompt)) == 3  # two whole chunks and the partial one
    assert stats(srv)["tiers"]["ram"]["hits"] == ram_hits + 3
    # a prompt that diverges inside a block of the second chunk reuses the whole blocks before
    # the divergence: from the pool, and from RAM through the longer record holding them
    other = doc[:CHUNK + 40] + document_tokens(srv, CHUNK + 30, seed=2) + question_tokens(srv)
    ref2, _, _ = complete(srv, other, cache=False)
    clear(srv, tiers=["pool"])
    text, cached, _ = complete(srv, other)
    assert (text, cached) == (ref2, CHUNK + 32)
    text, cached, _ = complete(srv, other)
    assert (text, cached) == (ref2, pooled(len(other)))


def test_whole_prompt_hit_recomputes_the_last_token(start_server):
    """A prompt that is exactly two chunks: the repeat reuses all but its last token, whose
    logits (and so the first token and its logprob) equal the cold run's."""
    srv = start_server(*CTX)
    prompt = document_tokens(srv, 2 * CHUNK, seed=3)
    cold = complete(srv, prompt, logprobs=5)[2]
    _, cached, warm = complete(srv, prompt, logprobs=5)
    assert cached == 2 * CHUNK - 1
    a, b = cold["choices"][0], warm["choices"][0]
    assert a["text"] == b["text"]
    assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
    # The warm run computes the last prompt token alone (the decode path's attention) where the
    # cold run computed it inside a prefill slice: the same values up to float summation order.
    for x, y in zip(a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"]):
        assert abs(x - y) < 2e-2, (x, y)


def test_disk_hit_after_restart_and_corrupt_records(start_server, tmp_dir):
    cache_dir = tmp_dir("kvserve-disk-")
    srv = start_server(*CTX, *EXACT, "--cache-dir", cache_dir)
    prompt = document_tokens(srv, 3 * CHUNK + 20, seed=4) + question_tokens(srv)
    ref, cached, _ = complete(srv, prompt)
    assert cached == 0
    srv.terminate()  # a clean stop finishes the queued writes
    # three whole chunks and the trailing one (the record stored when the prompt was computed
    # was superseded by the longer one stored when the sequence ended)
    files = sorted(glob.glob(os.path.join(cache_dir, "*", "*.kvc")))
    assert len(files) == 4, files

    srv = start_server(*CTX, *EXACT, "--cache-dir", cache_dir)
    st = stats(srv)["tiers"]["disk"]
    assert st["entries"] == 4 and st["corrupt"] == 0, st
    text, cached, _ = complete(srv, prompt)
    assert (text, cached) == (ref, reusable(len(prompt)))
    assert stats(srv)["tiers"]["disk"]["hits"] == records_for(len(prompt)) == 4
    srv.terminate()

    # flip one payload byte in every record: each is detected when read, dropped and recomputed
    for f in files:
        with open(f, "r+b") as fh:
            fh.seek(4096 + 1000)
            b = fh.read(1)
            fh.seek(4096 + 1000)
            fh.write(bytes([b[0] ^ 0x40]))
    srv = start_server(*CTX, *EXACT, "--cache-dir", cache_dir)
    text, cached, _ = complete(srv, prompt)
    assert (text, cached) == (ref, 0)
    st = stats(srv)["tiers"]["disk"]
    assert st["corrupt"] >= 1, st
    assert srv.metrics()['kvserve_cache_corrupt_total{tier="disk"}'] == st["corrupt"]
    srv.terminate()

    # a torn record (truncated) and a stray temporary file are dropped at start
    files = sorted(glob.glob(os.path.join(cache_dir, "*", "*.kvc")))
    assert len(files) == 4  # rewritten after the corrupt ones were dropped
    with open(files[0], "r+b") as fh:
        fh.truncate(4096 + 512)
    part = os.path.join(os.path.dirname(files[0]), "tmp-x-1-1.part")
    with open(part, "wb") as fh:
        fh.write(b"\0" * 100)
    srv = start_server(*CTX, *EXACT, "--cache-dir", cache_dir)
    st = stats(srv)["tiers"]["disk"]
    # both count: the torn record, and the temporary file of a write that never finished
    assert st["entries"] == 3 and st["corrupt"] == 2, st
    assert not os.path.exists(part)
    text, _, _ = complete(srv, prompt)
    assert text == ref


def test_records_are_the_same_bytes_in_two_processes(start_server, tmp_dir):
    """Keys and KV are deterministic across processes: two servers (each with its own random
    hash-table seeds) that compute the same prompt write the same records, byte for byte, under
    the same names, and either one's records serve the other's requests."""
    dirs = [tmp_dir("kvserve-keys-a-"), tmp_dir("kvserve-keys-b-")]
    srvs = [start_server(*CTX, "--cache-dir", d) for d in dirs]
    prompt = document_tokens(srvs[0], 2 * CHUNK + 70, seed=7) + question_tokens(srvs[0])
    refs = [complete(s, prompt)[0] for s in srvs]
    assert refs[0] == refs[1]
    for s in srvs:
        s.terminate()
    names = [sorted(os.path.relpath(f, d) for f in glob.glob(os.path.join(d, "*", "*.kvc")))
             for d in dirs]
    assert len(names[0]) >= 3 and names[0] == names[1], names
    for n in names[0]:
        with open(os.path.join(dirs[0], n), "rb") as a, open(os.path.join(dirs[1], n), "rb") as b:
            assert a.read() == b.read(), n
    # the second directory's records serve the first server's prompt after a restart
    srv = start_server(*CTX, "--cache-dir", dirs[1])
    text, cached, _ = complete(srv, prompt)
    assert (text, cached) == (refs[0], reusable(len(prompt)))


def test_eviction_then_reuse_from_ram_and_disk(start_server, tmp_dir):
    """Other prompts push a prompt's blocks out of a small KV pool, then out of a small RAM tier:
    its whole blocks (the trailing partial chunk's too) come back from RAM, then from disk."""
    cache_dir = tmp_dir("kvserve-evict-")
    ram_cap = 3000 * KV_BYTES_PER_TOKEN  # the prompt and the pool's worth of others fit
    srv = start_server("-c", "1024", "--kv-pool-tokens", "1152", "--cache-chunk-tokens",
                       str(CHUNK), "--cache-ram-bytes", str(ram_cap), "--cache-dir", cache_dir)
    prompt = document_tokens(srv, CHUNK + 100, seed=70) + question_tokens(srv)
    ref, _, _ = complete(srv, prompt, cache=False)
    assert complete(srv, prompt)[1] == 0
    seed = 71
    # other prompts until the pool had to evict as many cached blocks as the prompt has (its
    # blocks are the oldest, so they all went)
    while stats(srv)["tiers"]["pool"]["evictions"] <= len(prompt) // BLOCK:
        assert seed < 90
        complete(srv, document_tokens(srv, 500, seed=seed))
        seed += 1
    ram_hits = stats(srv)["tiers"]["ram"]["hits"]
    text, cached, _ = complete(srv, prompt)
    assert (text, cached) == (ref, reusable(len(prompt)))
    assert stats(srv)["tiers"]["ram"]["hits"] == ram_hits + records_for(len(prompt))
    # more than the RAM tier's capacity of other prompts after it: out of RAM, from disk
    stored = 0
    while stored <= 2 * ram_cap:  # bytes_in also counts partial records later replaced
        before = stats(srv)["tiers"]["ram"]["bytes_in"]
        complete(srv, document_tokens(srv, 500, seed=seed))
        stored += stats(srv)["tiers"]["ram"]["bytes_in"] - before
        seed += 1
    clear(srv, tiers=["pool"])
    disk_hits = stats(srv)["tiers"]["disk"]["hits"]
    text, cached, _ = complete(srv, prompt)
    assert (text, cached) == (ref, reusable(len(prompt)))
    assert stats(srv)["tiers"]["disk"]["hits"] == disk_hits + records_for(len(prompt))


def test_chunks_fetched_for_waiting_requests_are_bounded(start_server, tmp_dir):
    """Chunks read from disk for a request wait with it until admission, outside the tiers'
    caps: at most --cache-ram-bytes of them. Beyond that the prompt is recomputed, exactly."""
    cache_dir = tmp_dir("kvserve-budget-")
    args = [*CTX, *EXACT, "--cache-dir", cache_dir, "--cache-ram-bytes", str(CHUNK_BYTES * 5 // 2)]
    srv = start_server(*args)
    prompt = document_tokens(srv, 4 * CHUNK + 10, seed=5)
    ref, _, _ = complete(srv, prompt)
    srv.terminate()
    srv = start_server(*args)
    text, cached, _ = complete(srv, prompt)
    assert (text, cached) == (ref, 2 * CHUNK)


def test_kill9_during_write_back_never_serves_a_corrupt_chunk(start_server, tmp_dir):
    cache_dir = tmp_dir("kvserve-kill-")
    srv = start_server(*CTX, "--cache-dir", cache_dir)
    prompts = [document_tokens(srv, 4 * CHUNK + 10, seed=10 + i) + question_tokens(srv)
               for i in range(4)]
    refs = [complete(srv, p, cache=False)[0] for p in prompts]
    pool = concurrent.futures.ThreadPoolExecutor(4)
    futs = [pool.submit(complete, srv, p) for p in prompts]
    # kill while chunks are being computed and written
    deadline = time.monotonic() + 60 * SLOW
    while stats(srv)["tiers"]["disk"]["bytes_in"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    srv.kill9()
    for f in futs:
        try:
            f.result(timeout=30)
        except Exception:
            pass
    pool.shutdown()
    srv = start_server(*CTX, "--cache-dir", cache_dir)
    assert not glob.glob(os.path.join(cache_dir, "*", "*.part"))
    for p, ref in zip(prompts, refs):
        assert complete(srv, p)[0] == ref


def test_full_disk_leaves_requests_succeeding(start_server, tmp_dir):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mnt = tmp_dir("kvserve-full-")  # unmounted and removed when the test ends
    # room for one record of a chunk (header + payload) and a half
    size = CHUNK_BYTES * 3 // 2
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", mnt]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    srv = start_server(*CTX, "--cache-dir", mnt)
    # four chunks go to a disk with room for one
    prompts = [document_tokens(srv, 2 * CHUNK + 10, seed=20 + i) for i in range(2)]
    refs = [complete(srv, p, cache=False)[0] for p in prompts]
    for p, ref in zip(prompts, refs):
        assert complete(srv, p)[0] == ref
    deadline = time.monotonic() + 30 * SLOW
    while stats(srv)["tiers"]["disk"]["write_errors"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    st = stats(srv)["tiers"]["disk"]
    assert st["write_errors"] >= 1, st
    # a write still in flight has its temporary file; none may be left once the writes end
    parts = os.path.join(mnt, "*", "*.part")
    while glob.glob(parts) and time.monotonic() < deadline + 10 * SLOW:
        time.sleep(0.05)
    assert not glob.glob(parts)
    # RAM still serves them
    clear(srv, tiers=["pool"])
    for p, ref in zip(prompts, refs):
        text, cached, _ = complete(srv, p)
        assert (text, cached) == (ref, 2 * CHUNK)
    srv.terminate()


def test_concurrent_requests_sharing_a_prefix(start_server):
    srv = start_server(*CTX)
    doc = document_tokens(srv, 3 * CHUNK, seed=30)
    questions = [f"\nQuestion {i}: what is the depth at site {i * 37}? Answer:" for i in range(6)]
    prompts = [doc + question_tokens(srv, q) for q in questions]
    refs = [complete(srv, p, cache=False)[0] for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        out = list(pool.map(lambda p: complete(srv, p), prompts))
    assert [o[0] for o in out] == refs
    # and again, now that the prefix is cached
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        out = list(pool.map(lambda p: complete(srv, p), prompts))
    assert [o[0] for o in out] == refs
    assert [o[1] for o in out] == [pooled(len(p)) for p in prompts]


def test_reuse_to_the_token(start_server):
    """Prompts that share 1..40 leading tokens with a cached one reuse exactly those, under a
    block, across block edges and inside the last block (a sequence's partly filled last block
    lends its rows), and answer as the same prompts with the cache off. The Anthropic usage
    counts the same tokens."""
    srv = start_server(*CTX)
    base = document_tokens(srv, 40, seed=5)
    other = question_tokens(srv)
    assert other[0] not in base  # a prompt base[:k] + other shares k tokens, no more
    complete(srv, base)
    for k in (1, 5, 15, 16, 17, 31, 33, 39):
        prompt = base[:k] + other
        ref, cached, _ = complete(srv, prompt, cache=False)
        assert cached == 0
        text, cached, _ = complete(srv, prompt)
        assert (text, cached) == (ref, k), k
    stats_pool = stats(srv)["tiers"]["pool"]
    # every k but 16 (whole blocks, found by key) took part of a block
    assert stats_pool["partial_hits"] >= 7 and stats_pool["partial_blocks"] >= 1, stats_pool
    # the same conversation twice through the Messages API: all but the last prompt token
    body = {"model": srv.model_id, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": "Name a colour."}]}
    reads = []
    for _ in range(2):
        status, r = srv.post_json("/v1/messages", body)
        assert status == 200, r
        u = r["usage"]
        reads.append((u["cache_read_input_tokens"], u["input_tokens"]))
    assert reads[1][0] > 0 and reads[1][1] == 1, reads


def test_namespaces_isolate_api_keys_and_salts(start_server):
    srv = start_server(*CTX, "--api-key", "alice", "--api-key", "bob")
    prompt = document_tokens(srv, CHUNK + 50, seed=40, api_key="alice")
    warm = pooled(len(prompt))
    assert complete(srv, prompt, api_key="alice")[1] == 0
    assert complete(srv, prompt, api_key="alice")[1] == warm
    # the same prompt under another key is cold, whatever alice has cached
    assert complete(srv, prompt, api_key="bob")[1] == 0
    # a salt splits a tenant's namespace
    assert complete(srv, prompt, api_key="alice", cache_salt="s1")[1] == 0
    assert complete(srv, prompt, api_key="alice", cache_salt="s1")[1] == warm
    # clear works within the caller's namespace; no tenant may clear them all
    status, r = srv.post_json("/v1/cache/clear", {"all": True}, api_key="bob")
    assert status == 403 and r["error"]["param"] == "all", r
    assert clear(srv, api_key="bob")["ram"] == 2  # the whole chunk and the partial one
    assert complete(srv, prompt, api_key="alice")[1] == warm
    assert complete(srv, prompt, api_key="bob")[1] == 0


def test_pin_keeps_chunks_in_a_small_ram_tier(start_server):
    # room for about five chunks in RAM, no disk tier
    srv = start_server(*CTX, "--cache-ram-bytes", str(CHUNK_BYTES * 51 // 10), "--cache-dir", "off")
    pinned = document_tokens(srv, 2 * CHUNK + 5, seed=50)
    status, r = srv.post_json("/v1/cache/pin", {"model": srv.model_id, "prompt": pinned})
    assert status == 200, r
    assert (r["chunks"], r["pinned_chunks"]) == (2, 2)
    assert stats(srv)["tiers"]["ram"]["pinned"] == 2
    for seed in range(51, 55):  # 8 more chunks through a 5-chunk tier
        complete(srv, document_tokens(srv, 2 * CHUNK + 5, seed=seed))
    st = stats(srv)["tiers"]["ram"]
    assert st["evictions"] >= 3 and st["bytes"] <= st["capacity_bytes"], st
    clear(srv, tiers=["pool"])
    assert complete(srv, pinned)[1] == 2 * CHUNK
    status, r = srv.post_json("/v1/cache/unpin", {"model": srv.model_id, "prompt": pinned})
    assert status == 200 and r["unpinned_chunks"] == 2, r
    assert stats(srv)["tiers"]["ram"]["pinned"] == 0


def test_cache_endpoint_errors(server):
    for body in ([1], {"all": "yes"}, {"tiers": ["gpu"]}, {"cache_salt": 5}):
        status, r = server.post_json("/v1/cache/clear", body)
        assert status == 400, (body, r)
        assert r["error"]["type"] == "invalid_request_error"
    status, r = server.post_json("/v1/cache/pin", {"model": server.model_id})
    assert status == 400, r
    status, r = server.post_json("/v1/cache/pin", {"model": "nope", "prompt": "x"})
    assert status == 404, r


def test_stats_and_metrics(server):
    st = stats(server)
    assert st["object"] == "cache.stats" and st["enabled"] and st["chunk_tokens"] == 256
    for tier in ("pool", "ram", "disk"):
        assert st["tiers"][tier]["enabled"], st
    m = server.metrics()
    for tier in ("pool", "ram", "disk"):
        assert f'kvserve_cache_hits_total{{tier="{tier}"}}' in m
    assert 'kvserve_cache_bytes{tier="ram"}' in m
    # last records the pool evicted before the disk took them: none on this light load
    assert m['kvserve_cache_write_errors_total{tier="disk",reason="evicted"}'] == 0
    assert st["tiers"]["disk"]["evicted_writes"] == 0, st


def test_cache_off_server(start_server):
    srv = start_server(*CTX, "--no-cache")
    prompt = document_tokens(srv, CHUNK + 10, seed=60)
    assert complete(srv, prompt)[1] == 0
    assert complete(srv, prompt)[1] == 0
    assert stats(srv)["enabled"] is False


@pytest.mark.skipif(SANITIZED, reason="RSS under AddressSanitizer includes its shadow memory")
def test_ram_tier_holds_its_byte_cap(start_server):
    """A long mixed workload of distinct prompts through a 64 MiB RAM tier: the tier never
    holds more than its cap and the process's RSS stays bounded (without the cap the chunks
    alone would be ~290 MiB)."""
    srv = start_server("-c", "1024", "--cache-ram-bytes", "64M", "--cache-dir", "off")
    for seed in range(100, 125):
        p = document_tokens(srv, 2 * CHUNK + 20, seed=seed)
        complete(srv, p)
        if seed % 5 == 0:
            complete(srv, p)  # some repeats
        st = stats(srv)["tiers"]["ram"]
        assert st["bytes"] <= 64 << 20, st
    with open(f"/proc/{srv.proc.pid}/status") as fh:
        rss = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS"))
    model = os.path.getsize(MODEL)
    pool = 4 * 1024 * KV_BYTES_PER_TOKEN
    # the blend content store takes a quarter of the RAM budget besides the tier
    assert rss < model + pool + (64 << 20) + (16 << 20) + (96 << 20), rss / 2**20
