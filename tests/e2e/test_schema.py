"""Prompt Cache end to end on the real model: schemas registered over REST and precomputed in
the background, prompts in PML and in JSON through the official openai client (chat and
completions), parameters, unions, nesting, role tags, exactness where the layout is a prefix's,
restart persistence, namespace isolation, concurrent requests equal to solo runs, and module KV
that went missing."""
import concurrent.futures
import json
import time
import urllib.error
import urllib.request

import pytest

from conftest import SLOW

MAX_TOKENS = 12

TRAVEL = """<schema name="travel">
  <system>You are a travel agent. Answer in one sentence.</system>
  <user>
    <module name="plan">Plan a trip of <parameter name="days" length="4"/> days.</module>
    <union>
      <module name="tokyo">Tokyo is the capital of Japan, known for temples and sushi.</module>
      <module name="miami">Miami is a city in Florida, known for beaches.<module name="surf">
        The best surfing in Miami is at South Beach in the winter.</module></module>
    </union>
  </user>
</schema>"""


def call(srv, method, path, body=None, raw=None, api_key=None):
    data = raw.encode() if raw is not None else (
        json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(srv.url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=120 * SLOW) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def register(srv, pml, api_key=None, salt=None, wait=True):
    body = {"pml": pml}
    if salt:
        body["cache_salt"] = salt
    status, r = call(srv, "POST", "/v1/schemas", body, api_key=api_key)
    assert status in (200, 202), r
    if wait:
        r = wait_ready(srv, r["name"], api_key=api_key, salt=salt)
    return r


def wait_ready(srv, name, api_key=None, salt=None, timeout=120):
    q = f"?cache_salt={salt}" if salt else ""
    deadline = time.monotonic() + timeout * SLOW
    while time.monotonic() < deadline:
        status, r = call(srv, "GET", f"/v1/schemas/{name}{q}", api_key=api_key)
        assert status == 200, r
        if r["status"] != "building":
            assert r["status"] == "ready", r
            return r
        time.sleep(0.1)
    raise AssertionError(f"schema {name} not ready: {r}")


def chat(srv, schema_prompt, messages=(), api_key=None, **extra):
    """The prompt with plain Prompt Cache ("fixup": false) unless extra says otherwise: under
    the default quality budget a prompt that names no fix-up gets what the model's calibration
    allows (test_reuse_quality.py), and these tests are about the modules' reuse itself."""
    body = {"model": srv.model_id, "messages": list(messages), "schema_prompt": schema_prompt,
            "max_tokens": MAX_TOKENS, "temperature": 0, "fixup": False, **extra}
    return call(srv, "POST", "/v1/chat/completions", body, api_key=api_key)


def answer(srv, schema_prompt, **kw):
    status, r = chat(srv, schema_prompt, **kw)
    assert status == 200, r
    return r["choices"][0]["message"]["content"], r["usage"]


def test_register_progress_list_and_delete(server):
    status, r = call(server, "POST", "/v1/schemas", raw=TRAVEL)
    assert status in (200, 202), r
    assert r["object"] == "schema" and r["name"] == "travel"
    assert r["progress"]["total_tokens"] == r["tokens"] > 0
    r = wait_ready(server, "travel")
    assert r["progress"]["fraction"] == 1.0
    mods = {m["name"]: m for m in r["modules"]}
    assert mods["tokyo"]["start"] == mods["miami"]["start"] == mods["plan"]["end"]
    assert mods["surf"]["parent"] == "miami" and mods["tokyo"]["union"] == mods["miami"]["union"]
    assert mods["plan"]["parameters"] == [
        {"name": "days", "length": 4, "position": mods["plan"]["parameters"][0]["position"]}]
    # the same source again is a no-op (200), and it is listed
    status, r2 = call(server, "POST", "/v1/schemas", raw=TRAVEL)
    assert status == 200 and r2["status"] == "ready"
    status, lst = call(server, "GET", "/v1/schemas")
    assert status == 200 and "travel" in [s["name"] for s in lst["data"]]
    # deleted: gone, and prompts naming it are 404s
    register(server, TRAVEL.replace('"travel"', '"travel2"'))
    status, r = call(server, "DELETE", "/v1/schemas/travel2")
    assert status == 200 and r["deleted"] is True
    status, r = call(server, "GET", "/v1/schemas/travel2")
    assert status == 404 and r["error"]["code"] == "schema_not_found"
    status, r = chat(server, '<prompt schema="travel2"><plan/></prompt>')
    assert status == 404, r
    status, r = call(server, "PUT", "/v1/schemas/travel")
    assert status == 405


@pytest.mark.parametrize("pml,want", [
    ('<schema name="bad">\n  <module name="a">x</modul>\n</schema>',
     "line 2, column 23: mismatched tag"),
    ('<schema name="bad"><union>\n<module name="a">x</module>text</union></schema>',
     "line 2, column 28: text inside <union>"),
    ('<schema name="bad"><module name="a"><parameter name="p" length="-1"/></module></schema>',
     "line 1, column 37: <parameter name=\"p\"> needs a 'length' of 1 to 4096"),
    ('<schema name="bad"><module name="a">x</module>\n<module name="a">y</module></schema>',
     "line 2, column 1: module 'a' is declared twice"),
    ('<!DOCTYPE x [<!ENTITY e "e">]><schema name="bad"/>', "DOCTYPE declarations are not"),
])
def test_bad_pml_is_a_400_with_its_position(server, pml, want):
    status, r = call(server, "POST", "/v1/schemas", raw=pml)
    assert status == 400, r
    assert want in r["error"]["message"], r
    assert r["error"]["code"] == "invalid_pml"


@pytest.mark.parametrize("fixup", [False, None])
def test_a_prompt_over_text_only_equals_a_full_prefill(server, fixup):
    """A schema without modules is one sequence at positions 0..n-1: its reused KV is what a
    full prefill computes, so greedy output is identical; the default quality budget, which
    allows no approximate reuse on this model, reuses it too (fixup None: the field not given)."""
    register(server, '<schema name="sys"><system>You are a helpful assistant who answers in '
                     'French. Keep every answer short and polite.</system></schema>')
    p = '<prompt schema="sys"><user>What is the capital of Italy?</user></prompt>'
    warm, usage = answer(server, p, fixup=fixup)
    cold, cold_usage = answer(server, p, cache=False)
    assert warm == cold
    assert usage["prompt_tokens"] == cold_usage["prompt_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 20
    assert cold_usage["prompt_tokens_details"]["cached_tokens"] == 0


def test_one_module_after_the_text_equals_a_full_prefill(server):
    """A module that follows all of the schema's text, imported alone, was computed after that
    text at the same positions a full prefill gives it: identical output."""
    register(server, '<schema name="tail2">Facts.\n<module name="doc">The secret colour of the '
                     'ocean today is green.</module></schema>')
    p = '<prompt schema="tail2"><doc/> Question: what colour is the ocean today? Answer:</prompt>'
    body = {"model": server.model_id, "prompt": "", "schema_prompt": p, "max_tokens": MAX_TOKENS,
            "temperature": 0, "fixup": False}
    status, warm = call(server, "POST", "/v1/completions", body)
    assert status == 200, warm
    status, cold = call(server, "POST", "/v1/completions", {**body, "cache": False})
    assert status == 200, cold
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 10


def test_parameters_unions_and_nesting(server):
    register(server, TRAVEL)
    text, usage = answer(server, '<prompt schema="travel"><plan days="3"/><miami><surf/></miami>'
                                 '<user>Where should I surf?</user></prompt>')
    assert text
    # parameters: a value over its length is refused, never truncated
    status, r = chat(server, '<prompt schema="travel"><plan days="one two three four five six"/>'
                             '</prompt>')
    assert status == 400 and "its length is 4" in r["error"]["message"], r
    status, r = chat(server, '<prompt schema="travel"><plan weeks="2"/></prompt>')
    assert status == 400 and "no parameter 'weeks'" in r["error"]["message"], r
    # unions: at most one member
    status, r = chat(server, '<prompt schema="travel"><tokyo/><miami/></prompt>')
    assert status == 400 and "members of one <union>" in r["error"]["message"], r
    # nesting: a nested module only inside its parent
    status, r = chat(server, '<prompt schema="travel"><surf/></prompt>')
    assert status == 400 and "reference it inside <miami>" in r["error"]["message"], r
    assert "line 1, column 25" in r["error"]["message"]
    status, r = chat(server, '<prompt schema="travel"><rome/></prompt>')
    assert status == 400 and "has no module 'rome'" in r["error"]["message"], r
    # the modules' tokens are reused, the parameter and the question computed
    with_surf = usage["prompt_tokens_details"]["cached_tokens"]
    _, usage2 = answer(server, '<prompt schema="travel"><miami/><user>Hi</user></prompt>')
    assert usage2["prompt_tokens_details"]["cached_tokens"] < with_surf


def test_openai_client_pml_and_json_forms_agree(server):
    register(server, TRAVEL)
    c = server.client()
    pml = '<prompt schema="travel"><plan days="5"/><tokyo/></prompt>'
    js = {"schema": "travel", "modules": [{"name": "plan", "params": {"days": "5"}},
                                          {"name": "tokyo"}]}
    msgs = [{"role": "user", "content": "What should I eat there?"}]
    plain = {"fixup": False}  # plain Prompt Cache (chat()'s docstring)
    a = c.chat.completions.create(model=server.model_id, messages=msgs, max_tokens=MAX_TOKENS,
                                  temperature=0, extra_body={"schema_prompt": pml, **plain})
    b = c.chat.completions.create(model=server.model_id, messages=msgs, max_tokens=MAX_TOKENS,
                                  temperature=0, extra_body={"schema_prompt": js, **plain})
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens
    assert a.usage.prompt_tokens_details.cached_tokens > 0
    # the messages are the same as a role tag in the prompt
    pml_q = '<prompt schema="travel"><plan days="5"/><tokyo/><user>What should I eat there?' \
            '</user></prompt>'
    d = c.chat.completions.create(model=server.model_id, messages=[], max_tokens=MAX_TOKENS,
                                  temperature=0, extra_body={"schema_prompt": pml_q, **plain})
    assert d.choices[0].message.content == a.choices[0].message.content
    # completions: free text after, streamed equal to whole
    kw = dict(model=server.model_id, prompt="", max_tokens=MAX_TOKENS, temperature=0,
              extra_body={"schema_prompt": pml_q, **plain})
    whole = c.completions.create(**kw).choices[0].text
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(stream=True, **kw)
                       if ch.choices)
    assert whole == streamed and whole
    # a bad JSON form is a 400
    status, r = chat(server, {"schema": "travel", "modules": [{"name": 3}]})
    assert status == 400, r


def test_missing_records_fall_back_and_rebuild(server):
    register(server, TRAVEL.replace('"travel"', '"travel3"'))
    p = '<prompt schema="travel3"><tokyo/><user>Hello</user></prompt>'
    before, _ = answer(server, p)
    status, r = call(server, "POST", "/v1/cache/clear", {"tiers": ["ram", "disk"]})
    assert status == 200, r
    text, usage = answer(server, p)  # computed in full, not refused
    # (but for the chat template's first tokens, which earlier prompts share: reuse to the token)
    assert usage["prompt_tokens_details"]["cached_tokens"] < 16
    wait_ready(server, "travel3")
    again, usage = answer(server, p)
    assert again == before and usage["prompt_tokens_details"]["cached_tokens"] > 0


def test_concurrent_schema_requests_equal_solo_runs(server):
    register(server, TRAVEL)
    prompts = [f'<prompt schema="travel"><plan days="{d}"/>{m}<user>{q}</user></prompt>'
               for d, m, q in [("2", "<tokyo/>", "What to see?"), ("3", "<miami/>", "Why go?"),
                               ("4", "<miami><surf/></miami>", "When to surf?"),
                               ("1", "", "Any advice?"), ("6", "<tokyo/>", "Food?"),
                               ("5", "<miami/>", "Hotels?")]]
    solo = [answer(server, p)[0] for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(6) as ex:
        together = list(ex.map(lambda p: answer(server, p)[0], prompts))
    assert together == solo


def test_schemas_survive_a_restart(start_server, tmp_dir):
    d = tmp_dir("kvserve-schema-")
    a = start_server("-c", "2048", "--cache-dir", d)
    register(a, TRAVEL)
    p = '<prompt schema="travel"><plan days="2"/><miami><surf/></miami><user>Go?</user></prompt>'
    first, usage = answer(a, p)
    a.terminate()
    b = start_server("-c", "2048", "--cache-dir", d)
    r = wait_ready(b, "travel")
    assert r["progress"]["done_tokens"] == r["tokens"]
    again, usage2 = answer(b, p)
    assert again == first
    assert usage2["prompt_tokens_details"]["cached_tokens"] == \
        usage["prompt_tokens_details"]["cached_tokens"] > 0
    assert "0 tokens precomputed" in b.stderr()


def test_namespaces_keep_schemas_apart(start_server):
    s = start_server("-c", "2048", "--api-key", "alice", "--api-key", "bob")
    register(s, TRAVEL, api_key="alice")
    p = '<prompt schema="travel"><tokyo/></prompt>'
    status, r = chat(s, p, api_key="alice")
    assert status == 200, r
    status, r = chat(s, p, api_key="bob")
    assert status == 404 and r["error"]["code"] == "schema_not_found", r
    status, r = call(s, "GET", "/v1/schemas/travel", api_key="bob")
    assert status == 404
    status, r = call(s, "GET", "/v1/schemas", api_key="bob")
    assert status == 200 and r["data"] == []
    # cache_salt splits a tenant further
    status, r = chat(s, p, api_key="alice", cache_salt="x")
    assert status == 404, r
    register(s, TRAVEL, api_key="alice", salt="x")
    status, r = chat(s, p, api_key="alice", cache_salt="x")
    assert status == 200, r
    # bob may not delete alice's
    status, r = call(s, "DELETE", "/v1/schemas/travel", api_key="bob")
    assert status == 404
    status, r = call(s, "GET", "/v1/schemas/travel", api_key="alice")
    assert status == 200


def test_fixup_at_ratio_one_is_a_full_prefill(server):
    """The fix-up lays the prompt out as a full prefill and blends the modules' KV in; at ratio
    1 every token is recomputed: the full prefill's answer, bit for bit."""
    register(server, TRAVEL)
    p = '<prompt schema="travel"><plan days="3"/><miami><surf/></miami><user>When?</user></prompt>'
    cold, _ = answer(server, p, cache=False)
    full, usage = answer(server, p, fixup=True, fixup_ratio=1.0)
    assert full == cold
    assert usage["prompt_tokens_details"]["blended_tokens"] > 0
    some, usage = answer(server, p, fixup=True, fixup_ratio=0.15)
    det = usage["prompt_tokens_details"]
    assert 0 < det["recomputed_tokens"] < det["blended_tokens"]
    assert det["cached_tokens"] == det["blended_tokens"] - det["recomputed_tokens"]


def test_a_schema_deleted_while_it_builds_leaves_nothing_pinned(start_server):
    """The builder precomputes one module at a time through the engine: a DELETE that lands
    while a module is in the engine must also unpin the records that module stores after it."""
    s = start_server("-c", "2048")
    modules = "\n".join(
        f'<module name="m{i}">Section {i}. ' + " ".join(f"fact {i}.{k} is true." for k in range(12))
        + "</module>" for i in range(16))
    status, r = call(s, "POST", "/v1/schemas", raw=f'<schema name="big">{modules}</schema>')
    assert status in (200, 202), r
    time.sleep(0.3 * SLOW)
    status, r = call(s, "DELETE", "/v1/schemas/big")
    assert status == 200, r
    # the builder works on one schema at a time: once the next is ready, big's build is over
    register(s, TRAVEL)
    status, r = call(s, "DELETE", "/v1/schemas/travel")
    assert status == 200, r
    status, st = call(s, "GET", "/v1/cache/stats")
    assert status == 200
    assert st["tiers"]["ram"]["pinned"] == 0, st["tiers"]


def test_a_prompt_to_a_schema_still_building_is_answered(start_server):
    """Not a 409 to retry: what is not stored yet is computed with the prompt, and once the
    schema is ready the same prompt reuses its modules."""
    s = start_server("-c", "4096")
    modules = "\n".join(
        f'<module name="m{i}">Section {i}. ' + " ".join(f"fact {i}.{k} is true." for k in range(12))
        + "</module>" for i in range(24))
    status, r = call(s, "POST", "/v1/schemas", raw=f'<schema name="big">{modules}</schema>')
    assert status == 202, r
    status, r = call(s, "GET", "/v1/schemas/big")
    building = r["status"] == "building"
    p = '<prompt schema="big"><m0/><m23/><user>Which section is first?</user></prompt>'
    status, r = chat(s, p)
    assert status == 200, r
    if building:
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    wait_ready(s, "big")
    _, usage = answer(s, p)
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0


def test_modules_from_an_encoded_ram_tier(start_server):
    """--cache-ram-encoding q8 and no disk tier: the modules' records are swapped for their q8
    encoding, and a prompt still reuses them (decoded) rather than computing them again."""
    srv = start_server("-c", "2048", "--cache-dir", "off", "--cache-ram-encoding", "q8")
    register(srv, TRAVEL)
    deadline, last, since = time.monotonic() + 60 * SLOW, None, time.monotonic()
    while time.monotonic() - since < 2:  # the encoder has swapped every record
        assert time.monotonic() < deadline
        _, st = call(srv, "GET", "/v1/cache/stats")
        if st["tiers"]["ram"]["bytes"] != last:
            last, since = st["tiers"]["ram"]["bytes"], time.monotonic()
        time.sleep(0.2)
    assert st["tiers"]["ram"]["entries"] > 0
    per_token = 30 * 2 * 3 * 64  # q8: a byte per KV element (SmolLM2-135M), plus scales
    assert last < 1.5 * per_token * st["tiers"]["ram"]["entries"] * 256, st["tiers"]["ram"]
    p = '<prompt schema="travel"><plan days="2"/><miami><surf/></miami><user>Go?</user></prompt>'
    text, usage = answer(srv, p)
    assert text and usage["prompt_tokens_details"]["cached_tokens"] > 0, usage
