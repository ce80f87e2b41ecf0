"""CacheBlend through the server with the unmodified openai client: passages seen in one prompt are
reused by content in another that orders them differently behind another question, in one user
string (transparent) and as content parts; usage and /metrics say so; "blend": false and
--no-blend turn it off; ratio 1 answers exactly as a full prefill; blended requests in a
concurrent batch answer as they do alone."""
import threading

import openai
import pytest

from conftest import SANITIZED

MAX_TOKENS = 4 if SANITIZED else 12

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
    return start_server("-c", "2048")


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


def test_content_parts_are_blended(blend_server):
    c, m = blend_server.client(), blend_server.model_id
    ask(c, m, rag_parts([1, 2, 0], "What do the licenses guarantee?"))
    _, usage = ask(c, m, rag_parts([0, 2, 1], "What must you respect?"))
    _, blended, _ = details(usage)
    assert blended > 0.6 * usage.prompt_tokens, usage


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
    s = start_server("-c", "2048", "--no-blend")
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
