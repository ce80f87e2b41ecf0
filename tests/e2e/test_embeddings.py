"""POST /v1/embeddings (and llama-server's /embeddings) through the official `openai` client:
vectors of the model's width, L2-normalized, a paraphrase closer than an unrelated sentence,
float and base64 (the SDK's default) agreeing, token-id inputs, dimensions, usage, and the
400s (an input over the context names the limit, 2049 inputs the field). One request is one
admission: 2,048 inputs in one request, and more inputs (or completion prompts) than --max-queue,
are served, each as alone."""
import base64
import math
import struct

import pytest

from conftest import SANITIZED

SENTENCES = ["The cat sat on the mat.", "A cat was sitting on the rug.",
             "Stock markets fell sharply on Monday."]


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def dot(a, b):
    return sum(x * y for x, y in zip(a, b))


def test_paraphrase_ranks_above_unrelated(client, server):
    r = client.embeddings.create(model=server.model_id, input=SENTENCES)
    vecs = [d.embedding for d in r.data]
    assert [d.index for d in r.data] == [0, 1, 2]
    assert all(len(v) == 576 for v in vecs)  # SmolLM2-135M's hidden size
    for v in vecs:
        assert abs(math.sqrt(dot(v, v)) - 1) < 1e-4
    assert dot(vecs[0], vecs[1]) > dot(vecs[0], vecs[2])
    assert dot(vecs[0], vecs[1]) > dot(vecs[1], vecs[2])
    assert r.usage.prompt_tokens == r.usage.total_tokens > 10


def test_float_and_base64_agree(client, server):
    as_float = client.embeddings.create(model=server.model_id, input=SENTENCES[0],
                                        encoding_format="float").data[0].embedding
    status, raw = server.post_json("/v1/embeddings", {"model": server.model_id,
                                                      "input": SENTENCES[0],
                                                      "encoding_format": "base64"})
    assert status == 200
    b = base64.b64decode(raw["data"][0]["embedding"])
    decoded = struct.unpack(f"<{len(b) // 4}f", b)
    assert list(decoded) == pytest.approx(as_float, abs=1e-7)
    # the SDK asks for base64 by default and decodes it
    default = client.embeddings.create(model=server.model_id, input=SENTENCES[0]).data[0]
    assert default.embedding == pytest.approx(as_float, abs=1e-7)


def test_token_inputs_and_dimensions(client, server):
    status, tok = server.post_json("/tokenize", {"content": SENTENCES[0]})
    ids = tok["tokens"]
    by_text = client.embeddings.create(model=server.model_id, input=SENTENCES[0],
                                       encoding_format="float").data[0].embedding
    by_ids = client.embeddings.create(model=server.model_id, input=[ids, ids],
                                      encoding_format="float")
    assert len(by_ids.data) == 2
    assert by_ids.data[0].embedding == pytest.approx(by_text, abs=1e-6)
    one = client.embeddings.create(model=server.model_id, input=ids, encoding_format="float")
    assert one.data[0].embedding == pytest.approx(by_text, abs=1e-6)
    short = client.embeddings.create(model=server.model_id, input=SENTENCES[0], dimensions=64,
                                     encoding_format="float").data[0].embedding
    assert len(short) == 64 and abs(math.sqrt(dot(short, short)) - 1) < 1e-4
    status, r = server.post_json("/embeddings", {"model": server.model_id, "input": "x"})
    assert status == 200 and len(r["data"][0]["embedding"]) == 576


@pytest.mark.parametrize("body,param,needle", [
    ({"input": ""}, "input", "empty"),
    ({"input": []}, "input", "empty"),
    ({"input": ["a", 5]}, "input[1]", "string"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format", "base64"),
    ({"input": "a", "dimensions": 100000}, "dimensions", "576"),
    ({"input": [[1, 2], [10 ** 7]]}, "input[1]", "vocabulary"),
    ({"input": "word " * 3000}, "input", "context length"),
    ({}, "input", "required"),
    ({"input": ["a"] * 2049}, "input", "limit of 2048"),
])
def test_bad_inputs_are_400(server, body, param, needle):
    status, r = server.post_json("/v1/embeddings", {"model": server.model_id, **body})
    assert status == 400, r
    assert r["error"]["param"] == param, r
    assert needle in r["error"]["message"], r["error"]["message"]


def test_one_request_of_2048_inputs(client, server):
    """OpenAI's limit, in one request on the default server: every input answered, in order,
    each with its own vector (neighbours differ). Under the sanitizers (5x slower) 300 inputs
    take the same paths."""
    n = 300 if SANITIZED else 2048
    texts = [f"line {i} of the ledger" for i in range(n)]
    r = client.embeddings.create(model=server.model_id, input=texts, encoding_format="float")
    assert [d.index for d in r.data] == list(range(n))
    assert all(len(d.embedding) == 576 for d in r.data)
    assert r.data[7].embedding != r.data[8].embedding
    assert r.usage.prompt_tokens >= n


def test_more_inputs_than_the_queue_holds(start_server):
    """A request's inputs take one place in the queue and go to the batch (2 sequences here)
    as room allows: 10 inputs, or 10 prompts, on a server that queues 4 requests."""
    s = start_server("-c", "256", "--max-seqs", "2", "--max-queue", "4")
    texts = [f"Note {i}: the {w} is on the table." for i, w in
             enumerate(["cup", "book", "key", "lamp", "pen", "bowl", "map", "coin", "box", "hat"])]
    status, r = s.post_json("/v1/embeddings", {"model": s.model_id, "input": texts})
    assert status == 200, r
    assert [d["index"] for d in r["data"]] == list(range(10))
    for t, d in zip(texts, r["data"]):
        status, alone = s.post_json("/v1/embeddings", {"model": s.model_id, "input": t})
        assert d["embedding"] == pytest.approx(alone["data"][0]["embedding"], abs=1e-5)
    body = {"model": s.model_id, "max_tokens": 6, "temperature": 0}
    status, r = s.post_json("/v1/completions", {**body, "prompt": texts})
    assert status == 200, r
    assert sorted(c["index"] for c in r["choices"]) == list(range(10))
    for c in r["choices"]:
        status, alone = s.post_json("/v1/completions", {**body, "prompt": texts[c["index"]]})
        assert c["text"] == alone["choices"][0]["text"]
    status, r = s.post_json("/v1/completions", {**body, "prompt": ["a"] * 2049})
    assert status == 400 and r["error"]["param"] == "prompt", r
    assert "limit of 2048" in r["error"]["message"]
