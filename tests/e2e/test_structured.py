"""Structured outputs through the official `openai` client: response_format json_schema (every
answer validated with the `jsonschema` package) and json_object, llama-server's grammar and
json_schema fields, vLLM's guided_* fields (extra_body), streaming, finish_reason "length" on
a structure cut short, and the 400s for unsupported schemas and conflicting fields."""
import json

import jsonschema
import openai
import pytest

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "address"],
    "additionalProperties": False,
}
COLOR = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}},
    "required": ["color"],
    "additionalProperties": False,
}
LIST = {
    "type": "object",
    "properties": {"fruits": {"type": "array", "items": {"type": "string", "maxLength": 20},
                              "minItems": 2, "maxItems": 4}},
    "required": ["fruits"],
    "additionalProperties": False,
}
TREE = {
    "$defs": {"node": {"type": "object",
                       "properties": {"label": {"type": "string", "maxLength": 12},
                                      "children": {"type": "array", "maxItems": 2,
                                                   "items": {"$ref": "#/$defs/node"}}},
                       "required": ["label", "children"], "additionalProperties": False}},
    "$ref": "#/$defs/node",
}


def user(text):
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def schema_format(schema, name="answer"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@pytest.mark.parametrize("schema,prompt", [
    (PERSON, "Invent a person who lives in a city. Answer in JSON."),
    (COLOR, "What color is the sky? Answer in JSON."),
    (LIST, "List some fruits in JSON."),
])
def test_json_schema_answers_validate(client, server, schema, prompt):
    for seed in (1, 2):
        r = client.chat.completions.create(model=server.model_id, messages=user(prompt),
                                           response_format=schema_format(schema),
                                           max_tokens=300, temperature=0.8, seed=seed)
        c = r.choices[0]
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), schema)


def test_recursive_schema(client, server):
    """$ref recursion: SmolLM2 tends to nest forever, so an answer cut by max_tokens is allowed;
    a finished one must validate."""
    r = client.chat.completions.create(model=server.model_id,
                                       messages=user("Describe a small family tree as JSON."),
                                       response_format=schema_format(TREE), max_tokens=200,
                                       temperature=0)
    c = r.choices[0]
    assert c.message.content.startswith('{"label": "')
    if c.finish_reason == "stop":
        jsonschema.validate(json.loads(c.message.content), TREE)


def test_json_schema_streamed_equals_whole(client, server):
    kw = dict(model=server.model_id, messages=user("Invent a person. Answer in JSON."),
              response_format=schema_format(PERSON), max_tokens=200, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kw))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
    jsonschema.validate(json.loads(text), PERSON)


def test_jump_forward_gives_the_same_answer(client, server):
    kw = dict(model=server.model_id, messages=user("Invent a person. Answer in JSON."),
              response_format=schema_format(PERSON), max_tokens=200, temperature=0)
    on = client.chat.completions.create(**kw).choices[0].message.content
    off = client.chat.completions.create(extra_body={"jump_forward": False}, **kw)
    assert json.loads(on) and json.loads(off.choices[0].message.content)
    jsonschema.validate(json.loads(off.choices[0].message.content), PERSON)


def test_json_object_parses(client, server):
    r = client.chat.completions.create(model=server.model_id,
                                       messages=user("Describe a cat as a JSON object."),
                                       response_format={"type": "json_object"}, max_tokens=300,
                                       temperature=0.7, seed=3)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # an open object may run long: what came is still a JSON object's beginning
        assert r.choices[0].message.content.startswith("{")


def test_length_cuts_a_structure_short(client, server):
    r = client.chat.completions.create(model=server.model_id, messages=user("A person in JSON."),
                                       response_format=schema_format(PERSON), max_tokens=5)
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content.startswith("{")
    assert r.usage.completion_tokens == 5


def test_llama_server_and_vllm_fields(client, server):
    m = server.model_id
    r = client.chat.completions.create(model=m, messages=user("Is water wet?"), max_tokens=20,
                                       extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].message.content in ("yes", "no")
    assert r.choices[0].finish_reason == "stop"
    # greedy, and words of at most 8 letters, so the grammar ends within max_tokens whatever
    # the model writes (sampled, an unbounded word could run past it)
    r = client.chat.completions.create(
        model=m, messages=user("Count to three."), max_tokens=30, temperature=0,
        extra_body={"grammar": 'root ::= "one" (", " word){2}\nword ::= [a-z]{1,8}'})
    text = r.choices[0].message.content
    assert text.startswith("one, ") and text.count(", ") == 2, text
    for field in ("guided_json", "json_schema"):
        r = client.chat.completions.create(model=m, messages=user("Pick a color in JSON."),
                                           max_tokens=50, extra_body={field: COLOR})
        jsonschema.validate(json.loads(r.choices[0].message.content), COLOR)
    r = client.chat.completions.create(model=m, messages=user("Pick a color in JSON."),
                                       max_tokens=50,
                                       extra_body={"guided_json": json.dumps(COLOR)})
    jsonschema.validate(json.loads(r.choices[0].message.content), COLOR)
    r = client.completions.create(model=m, prompt="The color is", max_tokens=20,
                                  extra_body={"guided_grammar": 'root ::= " " ("red" | "blue")'})
    assert r.choices[0].text in (" red", " blue")


def test_n_choices_each_follow_the_grammar(client, server):
    r = client.chat.completions.create(model=server.model_id, messages=user("Fruits in JSON."),
                                       response_format=schema_format(LIST), max_tokens=120, n=3,
                                       temperature=1.0, seed=5)
    assert len(r.choices) == 3
    for c in r.choices:
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.message.content), LIST)


@pytest.mark.parametrize("body,param,needle", [
    ({"response_format": schema_format({"type": "object", "not": {}})},
     "response_format.json_schema.schema", "'not'"),
    ({"response_format": schema_format({"type": "string", "format": "hostname"})},
     "response_format.json_schema.schema", "'hostname'"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "required"),
    ({"grammar": "root ::= missing"}, "grammar", "'missing'"),
    ({"grammar": "root ::= \"a\"", "guided_choice": ["a"]}, "guided_choice", "give one"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
])
def test_bad_constraints_are_400(server, body, param, needle):
    status, r = server.post_json("/v1/chat/completions",
                                 {"model": server.model_id, "messages": user("x"), **body})
    assert status == 400, r
    assert r["error"]["param"] == param
    assert needle in r["error"]["message"], r["error"]["message"]


def test_sdk_raises_bad_request(client, server):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=server.model_id, messages=user("x"),
            response_format=schema_format({"type": "object", "patternProperties": {}}))


def test_logprobs_are_the_models(client, server):
    """Under a grammar the reported logprobs are still the model's (unmasked) distribution: a
    chosen token that is among its top alternatives has the same logprob there."""
    r = client.chat.completions.create(model=server.model_id, messages=user("A color in JSON."),
                                       response_format=schema_format(COLOR), max_tokens=30,
                                       temperature=0, logprobs=True, top_logprobs=5)
    c = r.choices[0]
    jsonschema.validate(json.loads(c.message.content), COLOR)
    entries = c.logprobs.content
    assert "".join(e.token for e in entries) == c.message.content  # no jump-forward
    checked = 0
    for e in entries:
        assert e.logprob <= 0
        for alt in e.top_logprobs:
            if alt.token == e.token:
                assert alt.logprob == pytest.approx(e.logprob, abs=1e-3)
                checked += 1
    assert checked > 0


def test_grammar_survives_preemption(start_server):
    """A small KV pool preempts sequences (their KV is recomputed later): each answer still
    follows its schema, since the grammar's state follows the tokens, which preemption keeps."""
    import concurrent.futures
    srv = start_server("-c", "256", "--kv-pool-tokens", "256", "--max-seqs", "6",
                       "--prefill-chunk", "64", "--no-cache")
    cl = srv.client()

    def one(i):
        return cl.chat.completions.create(
            model=srv.model_id, messages=user(f"Invent person number {i} as JSON."),
            response_format=schema_format(PERSON), max_tokens=90, temperature=0.7, seed=i)

    with concurrent.futures.ThreadPoolExecutor(6) as ex:
        results = list(ex.map(one, range(6)))
    for r in results:
        c = r.choices[0]
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.message.content), PERSON)
        else:
            assert c.finish_reason == "length" and c.message.content.startswith('{"name": "')
    assert srv.metrics().get("kvserve_preemptions_total", 0) > 0
