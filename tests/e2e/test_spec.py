"""Speculative decoding from the context through the official `openai` client: a RAG-style
answer that quotes its passage is the same with speculation on and with "speculative": false
(greedy, streamed or not, with a stop string and logprobs), and drafts were kept (/metrics);
OpenAI's Predicted Outputs report accepted and rejected prediction tokens and leave the answer
unchanged; malformed predictions are 400s; `--spec off` drafts nothing. With `--draft-model`
(SmolLM2 requantized, drafting for itself) greedy answers are the same and its drafts are kept;
a draft model of another vocabulary, or a missing one, stops the server at start."""
import os
import subprocess
import time

import openai
import pytest

from conftest import BIN, MODEL, ROOT, SLOW, free_port, server_env

DRAFT_MODEL = os.environ.get("KVSERVE_TEST_DRAFT_MODEL",
                             os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q8_0.gguf"))

PASSAGE = (
    "The river Tamsel rises in the hills above Oberwald and flows north for two hundred and "
    "twelve kilometres before it joins the Lenne at Haldern. Its valley was settled in the "
    "ninth century by farmers who cleared the oak forest for rye and flax. The first bridge "
    "across the river was built of timber in 1231 and replaced by a stone bridge of seven "
    "arches in 1468, which still carries the old road to the market square. In 1874 a railway "
    "line was opened along the eastern bank, and the town grew from a few hundred people to "
    "more than nine thousand within forty years."
)
QUESTION = "Repeat the document above word for word, from its first sentence to its last."


def rag(passage=PASSAGE, question=QUESTION):
    return [{"role": "user", "content": f"Document:\n{passage}\n\n{question}"}]


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def ask(client, server, spec, **kw):
    kw.setdefault("max_tokens", 160)
    return client.chat.completions.create(model=server.model_id, messages=rag(), temperature=0,
                                          extra_body={"speculative": spec}, **kw)


def test_greedy_answers_are_the_same_with_and_without_speculation(server, client):
    before = server.metrics()
    off = ask(client, server, False)
    on = ask(client, server, True)
    after = server.metrics()
    assert on.choices[0].message.content == off.choices[0].message.content
    assert on.choices[0].finish_reason == off.choices[0].finish_reason
    assert on.usage.completion_tokens == off.usage.completion_tokens
    kept = (after["kvserve_spec_accepted_tokens_total"]
            - before["kvserve_spec_accepted_tokens_total"])
    assert kept > 0, "no draft was kept on an answer that quotes its passage"
    details = on.usage.completion_tokens_details.model_dump()
    assert details["accepted_draft_tokens"] == kept
    assert "draft_tokens" not in off.usage.completion_tokens_details.model_dump()
    assert 0 < after["kvserve_spec_acceptance_ratio"] <= 1
    health = server.get_json("/health")["speculation"]
    assert health["mode"] == "context" and health["accepted"] >= kept > 0
    # streamed, the same text
    stream = ask(client, server, True, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == \
        off.choices[0].message.content


def test_stop_strings_and_logprobs_are_the_same_with_speculation(server, client):
    kw = dict(stop=["stone bridge"], logprobs=True, top_logprobs=2, max_tokens=120)
    off = ask(client, server, False, **kw)
    on = ask(client, server, True, **kw)
    assert on.choices[0].message.content == off.choices[0].message.content
    assert on.choices[0].finish_reason == off.choices[0].finish_reason
    lo, ln = off.choices[0].logprobs.content, on.choices[0].logprobs.content
    assert [t.token for t in ln] == [t.token for t in lo]
    assert [t.logprob for t in ln] == [t.logprob for t in lo]
    assert [[a.token for a in t.top_logprobs] for t in ln] == \
        [[a.token for a in t.top_logprobs] for t in lo]
    # max_tokens cuts a run of kept drafts where it cuts plain decoding
    off = ask(client, server, False, max_tokens=37)
    on = ask(client, server, True, max_tokens=37)
    assert on.usage.completion_tokens == off.usage.completion_tokens == 37
    assert on.choices[0].message.content == off.choices[0].message.content


def test_predicted_outputs_report_accepted_and_rejected_tokens(server, client):
    plain = ask(client, server, False)
    answer = plain.choices[0].message.content
    # the prediction: the answer with a few words changed, as an edit's old text would be
    predicted = answer.replace("timber", "iron").replace("rye", "wheat")
    for content in (predicted, [{"type": "text", "text": predicted[:90]},
                                {"type": "text", "text": predicted[90:]}]):
        r = client.chat.completions.create(
            model=server.model_id, messages=rag(), temperature=0, max_tokens=160,
            prediction={"type": "content", "content": content})
        assert r.choices[0].message.content == answer
        d = r.usage.completion_tokens_details
        assert d.accepted_prediction_tokens > 0
        assert d.rejected_prediction_tokens >= 0
        assert d.accepted_prediction_tokens <= r.usage.completion_tokens


@pytest.mark.parametrize("prediction, param", [
    (5, "prediction"),
    ({"content": "x"}, "prediction.type"),
    ({"type": "text", "content": "x"}, "prediction.type"),
    ({"type": "content"}, "prediction.content"),
    ({"type": "content", "content": 7}, "prediction.content"),
    ({"type": "content", "content": [{"type": "image_url", "image_url": "x"}]},
     "prediction.content[0]"),
    ({"type": "content", "content": [{"type": "text", "text": 3}]}, "prediction.content[0]"),
])
def test_malformed_predictions_are_400s(server, client, prediction, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.model_id, messages=rag(), max_tokens=4,
                                       extra_body={"prediction": prediction})
    assert e.value.body["param"] == param
    assert e.value.body["type"] == "invalid_request_error"


def test_speculative_must_be_a_boolean(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.model_id, messages=rag(), max_tokens=4,
                                       extra_body={"speculative": "yes"})
    assert e.value.body["param"] == "speculative"


def test_spec_off_drafts_nothing(start_server, server, client):
    off = start_server("-c", "2048", "--spec", "off")
    c = off.client()
    r = c.chat.completions.create(model=off.model_id, messages=rag(), temperature=0,
                                  max_tokens=80)
    m = off.metrics()
    assert m["kvserve_spec_draft_tokens_total"] == 0
    assert off.get_json("/health")["speculation"] == \
        {"mode": "off", "drafted": 0, "accepted": 0, "acceptance": 0, "draft_model": None,
         "draft_model_seconds": 0, "draft_model_drafted": 0, "draft_model_accepted": 0}
    assert "draft_tokens" not in r.usage.completion_tokens_details.model_dump()
    ref = ask(client, server, True, max_tokens=80)
    assert r.choices[0].message.content == ref.choices[0].message.content


def test_a_grammar_constrained_answer_drafts_and_stays_the_same(server, client):
    fmt = {"type": "json_schema", "json_schema": {"name": "quote", "strict": True, "schema": {
        "type": "object", "properties": {"quote": {"type": "string", "maxLength": 400}},
        "required": ["quote"], "additionalProperties": False}}}
    kw = dict(response_format=fmt, max_tokens=120, logprobs=True)
    before = server.metrics()["kvserve_spec_draft_tokens_total"]
    off = ask(client, server, False, **kw)
    on = ask(client, server, True, **kw)
    assert on.choices[0].message.content == off.choices[0].message.content
    assert [t.logprob for t in on.choices[0].logprobs.content] == \
        [t.logprob for t in off.choices[0].logprobs.content]
    assert server.metrics()["kvserve_spec_draft_tokens_total"] > before
    assert on.usage.completion_tokens_details.model_dump().get("draft_tokens", 0) > 0


def test_choices_speculate_each_and_a_seed_repeats(server, client):
    one = ask(client, server, False, max_tokens=60)
    two = ask(client, server, True, max_tokens=60, n=2)
    assert [c.message.content for c in two.choices] == [one.choices[0].message.content] * 2
    sampled = [client.chat.completions.create(
        model=server.model_id, messages=rag(), temperature=0.8, seed=5, n=2, max_tokens=60)
        for _ in range(2)]
    assert [c.message.content for c in sampled[0].choices] == \
        [c.message.content for c in sampled[1].choices]


# ---------------------------------------------------------------- the draft model

CHAT = [{"role": "user", "content": "Write a short story about a dragon who is afraid of the dark."}]


def test_a_draft_model_keeps_greedy_answers_and_its_drafts_are_kept(start_server, server, client):
    assert os.path.exists(DRAFT_MODEL), f"{DRAFT_MODEL} missing: run `make model`"
    srv = start_server("-c", "2048", "--draft-model", DRAFT_MODEL)
    c = srv.client()
    for messages in (rag(), CHAT):
        kw = dict(messages=messages, temperature=0, max_tokens=120)
        ref = client.chat.completions.create(model=server.model_id,
                                             extra_body={"speculative": False}, **kw)
        got = c.chat.completions.create(model=srv.model_id, **kw)
        assert got.choices[0].message.content == ref.choices[0].message.content
        assert got.usage.completion_tokens == ref.usage.completion_tokens
        details = got.usage.completion_tokens_details.model_dump()
        assert details["accepted_draft_tokens"] > 0, details
    health = srv.get_json("/health")["speculation"]
    assert health["draft_model"] == DRAFT_MODEL
    drafted, kept = health["draft_model_drafted"], health["draft_model_accepted"]
    assert drafted > 0 and kept >= 0.8 * drafted, health
    assert srv.metrics()["kvserve_spec_draft_model_seconds_total"] > 0
    # the gauges are published after each step: the last one's in a moment
    for _ in range(100):
        if srv.metrics()["kvserve_draft_kv_pool_blocks_used"] == 0:
            break
        time.sleep(0.02)
    assert srv.metrics()["kvserve_draft_kv_pool_blocks_used"] == 0


def refused(*args):
    """kvserve serve with args: it must exit (not serve); returns its stderr."""
    p = subprocess.run([BIN, "serve", "-m", MODEL, "--port", str(free_port()), "--cache-dir", "off",
                        *args], cwd=ROOT, env=server_env(), capture_output=True, text=True,
                       timeout=120 * SLOW)
    assert p.returncode == 1, (p.returncode, p.stderr[-2000:])
    return p.stderr


@pytest.mark.parametrize("kind", ["another vocabulary", "two tokens swapped", "truncated",
                                  "missing"])
def test_a_draft_model_that_cannot_draft_stops_the_server(tmp_dir, kind):
    if kind == "another vocabulary":
        draft = os.path.join(ROOT, "tests", "golden", "arch", "linear_kq.gguf")
    elif kind == "two tokens swapped":
        # the same 49152 texts, two of them swapped: the check reads every token, not a count
        draft = os.path.join(tmp_dir("kvdraft"), "swapped.gguf")
        subprocess.run(["python3", os.path.join(ROOT, "scripts", "make_draft_model.py"), MODEL,
                        draft, "--swap-tokens", "1000,1001"], check=True)
    elif kind == "truncated":  # its header and metadata, the tensors cut off
        draft = os.path.join(tmp_dir("kvdraft"), "cut.gguf")
        with open(MODEL, "rb") as src, open(draft, "wb") as dst:
            dst.write(src.read(4 << 20))
    else:
        draft = os.path.join(tmp_dir("kvdraft"), "none.gguf")
    err = refused("--draft-model", draft)
    assert draft in err, err[-2000:]
    if kind in ("missing", "truncated"):
        assert "--draft-model" in err
    else:
        assert MODEL in err and "vocabulary" in err, err[-2000:]
        if kind == "two tokens swapped":
            assert "token 1000" in err
