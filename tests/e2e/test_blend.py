"""CacheBlend through the server with the unmodified openai client: passages seen in one prompt are
reused by content in another that orders them differently behind another question, in one user
string (transparent) and as content parts; usage and /metrics say so; "blend": false and
--no-blend turn it off; ratio 1 answers exactly as a full prefill; blended requests in a
concurrent batch answer as they do alone; the passages' records survive a restart on disk, and
one damaged on disk is found at the layer where it breaks and its tokens computed instead."""
import glob
import os
import shutil
import struct
import threading
import time

import openai
import pytest

from conftest import SANITIZED

MAX_TOKENS = 4 if SANITIZED else 12
# The mechanism as configured, with no quality budget: blend's default setting here is the
# server's --blend-recompute (test_reuse_quality.py tests the budget over a calibration)
CTX = ("-c", "2048", "--reuse-quality", "none")

PASSAGES = [
    "The licenses for most software and other practical works are designed\n"
    "to take away your freedom to share and change the works. By contrast,\n"
    "the GNU General Public License is intended to guarantee your freedom to\n"
    "share and change all versions of a program--to make sure it remains free\n"
    "software for all its users.",
    "When we speak of free software, we are referring to freedom, not\n"
    "price. Our General Public Licenses are designed to make sure that you\n"
    "have the freedom to distribute copies of free software (and charge for\n"
    "them if you wish), that you receive source code or can get it if you\n"
    "want it, that you can change the software or use pieces of it in new\n"
    "free programs, and that you know you can do these things.",
    "To protect your rights, we need to prevent others from denying you\n"
    "these rights or asking you to surrender the rights. Therefore, you have\n"
    "certain responsibilities if you distribute copies of the software, or if\n"
    "you modify it: responsibilities to respect the freedom of others.",
]
SYSTEM = {"role": "system", "content": "Answer the question using the documents."}


def rag(order, question):
    docs = "\n\n".join(f"Document {i + 1}:\n{PASSAGES[p]}" for i, p in enumerate(order))
    return [SYSTEM, {"role": "user", "content": f"{docs}\n\nQuestion: {question}"}]


def rag_parts(order, question):
    parts = [{"type": "text", "text": f"Document {i + 1}:\n{PASSAGES[p]}\n\n"}
             for i, p in enumerate(order)]
    return [SYSTEM, {"role": "user", "content": parts + [
        {"type": "text", "text": f"Question: {question}"}]}]


def ask(client, model, messages, **extra):
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                       temperature=0, extra_body=extra or None)
    return r.choices[0].message.content, r.usage


def details(usage):
    d = usage.prompt_tokens_details
    return d.cached_tokens, (d.model_extra or {}).get("blended_tokens", 0), \
        (d.model_extra or {}).get("recomputed_tokens", 0)


@pytest.fixture
def blend_server(start_server):
    return start_server(*CTX)


def test_passages_in_another_order_are_blended(blend_server):
    c, m = blend_server.client(), blend_server.model_id
    ask(c, m, rag([0, 1, 2], "What is free software?"))
    before = blend_server.metrics().get("kvserve_blend_tokens_total", 0)
    text, usage = ask(c, m, rag([2, 0, 1], "Who has responsibilities?"))
    cached, blended, recomputed = details(usage)
    # most of the passages come from the first prompt's KV, re-rotated; a share recomputed
    assert blended > 0.6 * usage.prompt_tokens, usage
    assert 0 < recomputed < blended, usage
    assert cached >= blended - recomputed
    assert usage.prompt_tokens_details.model_extra["blend_ratio"] == pytest.approx(0.15)
    assert text
    after = blend_server.metrics()["kvserve_blend_tokens_total"]
    assert after - before == blended


def test_a_repaired_prompt_is_reused_exactly_when_asked_again(start_server):
    """--blend-repair: a prompt that blended is computed again in full once the engine is idle
    and its chunks stored; asked again, it reuses its KV exactly (nothing blended) and answers
    as a full prefill does."""
    srv = start_server(*CTX, "--blend-repair")
    c, m = srv.client(), srv.model_id
    ask(c, m, rag([0, 1, 2], "What is free software?"))
    msgs = rag([2, 0, 1], "Who has responsibilities?")
    _, usage = ask(c, m, msgs)
    assert details(usage)[1] > 0, usage  # blended
    deadline = time.monotonic() + 120
    while srv.get_json("/v1/cache/stats")["reuse_quality"]["methods"]["blend"]["repair"][
            "repaired"] < 1:
        assert time.monotonic() < deadline, "no repair"
        time.sleep(0.05)
    full, _ = ask(c, m, msgs, cache=False)
    got, usage = ask(c, m, msgs)
    cached, blended, _ = details(usage)
    assert blended == 0 and cached >= usage.prompt_tokens - 64, usage
    assert got == full
    repair = srv.get_json("/health")["reuse_quality"]["methods"]["blend"]["repair"]
    assert repair == {"on": True, "repaired": 1, "dropped": 0}, repair


def test_content_parts_are_blended(blend_server):
    c, m = blend_server.client(), blend_server.model_id
    ask(c, m, rag_parts([1, 2, 0], "What do the licenses guarantee?"))
    _, usage = ask(c, m, rag_parts([0, 2, 1], "What must you respect?"))
    _, blended, _ = details(usage)
    assert blended > 0.6 * usage.prompt_tokens, usage


def test_content_parts_without_line_breaks_are_segments(blend_server):
    # passages as single lines, parts joined with nothing between them: only the part bounds
    # cut a passage off its neighbours, so each is found whole wherever it sits
    flat = [p.replace("\n", " ") for p in PASSAGES]

    def msgs(order, question):
        return [SYSTEM, {"role": "user", "content": [{"type": "text", "text": flat[p]}
                                                     for p in order] + [
            {"type": "text", "text": f"Question: {question}"}]}]

    c, m = blend_server.client(), blend_server.model_id
    n_passages = sum(len(blend_server.post_json("/tokenize", {"content": p, "add_special": False})
                         [1]["tokens"]) for p in flat)
    ask(c, m, msgs([1, 2, 0], "What do the licenses guarantee?"))
    _, usage = ask(c, m, msgs([2, 0, 1], "What must you respect?"))
    _, blended, _ = details(usage)
    assert blended >= n_passages - 2, (usage, n_passages)


def test_ratio_one_answers_as_full_prefill_and_blend_false_reuses_nothing(blend_server):
    c, m = blend_server.client(), blend_server.model_id
    ask(c, m, rag([0, 1, 2], "Summarize the documents."))
    msgs = rag([1, 0, 2], "What can you charge for?")
    full, usage = ask(c, m, msgs, cache=False)
    assert details(usage) == (0, 0, 0)
    off, usage = ask(c, m, msgs, blend=False)
    assert details(usage)[1] == 0
    assert off == full
    # an order not seen before keeps the exact prefix from matching: blended at 100%
    msgs = rag([2, 1, 0], "Is the software free of charge?")
    full, _ = ask(c, m, msgs, cache=False)
    got, usage = ask(c, m, msgs, blend_ratio=1.0)
    _, blended, recomputed = details(usage)
    assert blended > 0 and recomputed == blended, usage
    assert got == full


def test_blend_ratio_out_of_range_is_400(blend_server):
    c, m = blend_server.client(), blend_server.model_id
    with pytest.raises(openai.BadRequestError) as e:
        ask(c, m, rag([0], "hi"), blend_ratio=1.5)
    assert e.value.param == "blend_ratio"
    with pytest.raises(openai.BadRequestError):
        ask(c, m, rag([0], "hi"), blend="yes")


def test_no_blend_server_blends_nothing(start_server):
    s = start_server(*CTX, "--no-blend")
    c, m = s.client(), s.model_id
    ask(c, m, rag([0, 1, 2], "What is free software?"))
    _, usage = ask(c, m, rag([2, 0, 1], "Who has responsibilities?"))
    assert details(usage)[1] == 0


def test_blended_requests_in_a_batch_answer_as_alone(blend_server):
    c, m = blend_server.client(), blend_server.model_id
    prompts = [rag([0, 1, 2], "Who wrote this?"), rag([2, 1, 0], "What is free?"),
               rag([1, 2, 0], "Can I change the software?"), rag([0, 2, 1], "What is price?")]
    ask(c, m, prompts[0])  # the passages' KV, computed once
    # each alone first (this also stores every chunk these prompts can store), then alone
    # again for the reference, then all at once
    for p in prompts[1:]:
        ask(c, m, p)
    alone = [ask(c, m, p) for p in prompts[1:]]
    assert all(details(u)[1] > 0 for _, u in alone)
    together = [None] * len(alone)

    def run(i):
        together[i] = ask(c, m, prompts[1 + i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(alone))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (a_text, a_usage), (t_text, t_usage) in zip(alone, together):
        assert t_text == a_text
        assert details(t_usage) == details(a_usage)


def blend_files(cache_dir):
    return sorted(glob.glob(os.path.join(cache_dir, "*", "blend", "*.kvb")))


def blend_tier(srv, name="blend_disk"):
    return srv.get_json("/v1/cache/stats")["tiers"][name]


def flip_layer_byte(path, layer):
    """Flips one byte in the middle of `layer`'s K rows of a record file (its header says where:
    168 + 32 * n_layer header bytes, then n_layer layers of layer_bytes)."""
    with open(path, "r+b") as fh:
        head = fh.read(136)
        n_layer, = struct.unpack_from("<I", head, 112)
        layer_bytes, = struct.unpack_from("<Q", head, 128)
        off = 168 + 32 * n_layer + layer * layer_bytes + layer_bytes // 4
        fh.seek(off)
        b = fh.read(1)
        fh.seek(off)
        fh.write(bytes([b[0] ^ 0x20]))


def test_records_survive_a_restart_and_a_damaged_one_is_computed_instead(start_server, tmp_dir):
    base = tmp_dir("kvserve-blend-")
    srv = start_server(*CTX, "--cache-dir", base)
    c, m = srv.client(), srv.model_id
    ask(c, m, rag([0, 1, 2], "What is free software?"))
    srv.terminate()  # a clean stop finishes the queued writes
    files = blend_files(base)
    assert len(files) >= 3, files
    # copies of the directory as it stands, for the damaged-record cases below
    copies = {}
    for name in ("damaged", "missing", "damaged1"):
        copies[name] = tmp_dir(f"kvserve-blend-{name}-")
        shutil.rmtree(copies[name])
        shutil.copytree(base, copies[name])

    # after a restart the passages come from disk, read layer by layer as the pass goes, and
    # the records read whole are promoted to RAM; at ratio 1 the answer is a full prefill's
    msgs = rag([2, 0, 1], "Who has responsibilities?")
    srv = start_server(*CTX, "--cache-dir", base)
    st = blend_tier(srv)
    assert st["entries"] == len(files) and st["corrupt"] == 0, st
    full, _ = ask(srv.client(), m, msgs, cache=False)
    got, usage = ask(srv.client(), m, msgs, blend_ratio=1.0)
    _, blended, _ = details(usage)
    assert blended > 0.6 * usage.prompt_tokens, usage
    assert got == full
    st = blend_tier(srv)
    assert st["hits"] > 0 and st["bytes_out"] > 0, st
    assert blend_tier(srv, "blend_ram")["entries"] > 0
    srv.terminate()

    # the largest record damaged in its middle layer, in one copy of the directory; the same
    # record simply missing in another: the damaged copy answers as the one without it (the
    # step whose pass found the damage runs again, those tokens computed), and drops the file
    rel = os.path.relpath(max(files, key=os.path.getsize), base)
    damaged, missing = copies["damaged"], copies["missing"]
    with open(os.path.join(damaged, rel), "rb") as fh:
        n_layer, = struct.unpack_from("<I", fh.read(116), 112)
    flip_layer_byte(os.path.join(damaged, rel), n_layer // 2)  # found mid-pass
    os.remove(os.path.join(missing, rel))
    srv = start_server(*CTX, "--cache-dir", missing)
    want, usage_want = ask(srv.client(), m, msgs)
    srv.terminate()
    with open(os.path.join(damaged, rel), "rb") as fh:
        bad_bytes = fh.read()
    srv = start_server(*CTX, "--cache-dir", damaged)
    got, usage_got = ask(srv.client(), m, msgs)
    st = blend_tier(srv)
    assert st["corrupt"] == 1, st
    assert srv.metrics()['kvserve_cache_corrupt_total{tier="blend_disk"}'] == 1
    assert (got, details(usage_got)) == (want, details(usage_want))
    srv.terminate()
    # the damaged file was deleted; the chunk, computed this time, may have been stored anew
    path = os.path.join(damaged, rel)
    assert not os.path.exists(path) or open(path, "rb").read() != bad_bytes

    # and at ratio 1 the damaged record still leaves the answer a full prefill's
    damaged = copies["damaged1"]
    flip_layer_byte(os.path.join(damaged, rel), n_layer - 1)
    srv = start_server(*CTX, "--cache-dir", damaged)
    full, _ = ask(srv.client(), m, msgs, cache=False)
    got, usage = ask(srv.client(), m, msgs, blend_ratio=1.0)
    assert details(usage)[1] > 0 and blend_tier(srv)["corrupt"] == 1
    assert got == full
