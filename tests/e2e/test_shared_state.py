"""State a client leaves on one instance, found on another (README "Redis tier": what is
shared): two instances sharing one redis-server behind sglang-router's round_robin policy. A
Responses conversation alternates instances (each turn's previous_response_id stored on the
other one); GET and DELETE on either instance directly (the router answers GET
/v1/responses/{id} itself); a schema registered on one is listed and used on the other, and
deleted from both by one DELETE; a pin taken on one is listed and removed on the other. A pair
without --redis shares none of it. One module-wide pair, redis-server and router; skipped,
visibly, where redis-server is not installed."""
import json
import time
import urllib.error
import urllib.request

import pytest

from conftest import http_get
from test_redis import serving_redis
from test_router import Router, post, serving_pair, start_pair


@pytest.fixture(scope="module")
def redis_srv(tmp_path_factory):
    yield from serving_redis(str(tmp_path_factory.mktemp("redis")))


@pytest.fixture(scope="module")
def pair(model_path, redis_srv):
    yield from serving_pair("--redis", redis_srv.url, "--redis-codec", "off")  # no calibration


@pytest.fixture(scope="module")
def router(pair):
    r = Router("sglang", pair, "round_robin")
    yield r
    r.stop()


def respond(url, model, text, previous=None):
    body = {"model": model, "input": text, "max_output_tokens": 4, "temperature": 0}
    if previous:
        body["previous_response_id"] = previous
    status, r = post(url + "/v1/responses", body)
    assert status == 200, r
    return r


def status_of(url):
    return http_get(url)[0]


def call(url, method, body=None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_responses_conversation_alternates_instances_through_the_router(router, pair):
    model = pair[0].model_id
    first = respond(router.url, model, "My name is Ada. Say hi.")
    ids = [first["id"]]
    for turn in ("What is my name?", "Say it again.", "And once more."):
        ids.append(respond(router.url, model, turn, previous=ids[-1])["id"])
    # round_robin sent the turns to both instances in turn: each found the previous response,
    # stored by the other one, in Redis
    for s in pair:
        state = s.get_json("/v1/cache/stats")["tiers"]["redis"]["state"]
        assert state["connected"] and state["hits"] >= 1 and state["writes"] >= 2, state
    for s in pair:
        for i in ids:
            got = s.get_json("/v1/responses/" + i)
            assert got["id"] == i and got["object"] == "response"
    # one DELETE, on either instance, removes it from both
    status, body = call(pair[1].url + "/v1/responses/" + ids[0], "DELETE")
    assert status == 200 and body["deleted"] is True, body
    for s in pair:
        assert status_of(s.url + "/v1/responses/" + ids[0]) == 404
    status, r = post(router.url + "/v1/responses",
                     {"model": model, "input": "x", "previous_response_id": ids[0]})
    assert status == 400 and r["error"]["code"] == "previous_response_not_found", r


def test_without_redis_nothing_is_shared(model_path):
    a, b = start_pair()
    try:
        r = respond(a.url, a.model_id, "Hi")
        assert status_of(a.url + "/v1/responses/" + r["id"]) == 200
        assert status_of(b.url + "/v1/responses/" + r["id"]) == 404
        status, body = post(b.url + "/v1/responses", {"model": b.model_id, "input": "x",
                                                      "previous_response_id": r["id"]})
        assert status == 400, body
    finally:
        a.terminate()
        b.terminate()


SCHEMA = """<schema name="{name}">
  <system>You are a travel agent. Answer in one sentence.</system>
  <user><module name="city">Lisbon is the capital of Portugal, known for its trams.</module></user>
</schema>"""


def test_a_schema_registered_on_one_instance_is_used_listed_and_deleted_on_the_other(pair):
    a, b = pair
    for name in ("trip", "trip2"):
        status, r = call(a.url + "/v1/schemas", "POST", {"pml": SCHEMA.format(name=name)})
        assert status in (200, 202), r
    # b never saw either: "trip" is found by name (compiled and built there), "trip2" in a list
    status, r = call(b.url + "/v1/schemas/trip", "GET")
    assert status == 200 and r["name"] == "trip", r
    status, r = call(b.url + "/v1/chat/completions", "POST",
                     {"model": b.model_id, "schema_prompt": '<prompt schema="trip"><city/>'
                      '</prompt>', "messages": [], "max_tokens": 4, "temperature": 0,
                      "fixup": False})
    assert status == 200, r
    status, r = call(b.url + "/v1/schemas", "GET")
    assert status == 200 and {"trip", "trip2"} <= {s["name"] for s in r["data"]}, r
    # one DELETE on b removes it from a too
    status, r = call(b.url + "/v1/schemas/trip2", "DELETE")
    assert status == 200, r
    assert call(a.url + "/v1/schemas/trip2", "GET")[0] == 404
    status, r = call(a.url + "/v1/schemas", "GET")
    assert "trip2" not in {s["name"] for s in r["data"]}, r


def pins(srv):
    return srv.get_json("/v1/cache/stats")["pins"]


def settled(srv, timeout=60):
    """Waits until no schema of srv is building (a build pins its modules' chunks)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, r = call(srv.url + "/v1/schemas", "GET")
        assert status == 200, r
        if all(s["status"] != "building" for s in r["data"]):
            return
        time.sleep(0.05)
    raise AssertionError(f"schemas still building on {srv.url}: {r}")


def test_a_pin_taken_on_one_instance_is_listed_and_unpinned_on_the_other(pair):
    a, b = pair
    for srv in pair:
        settled(srv)  # the schema test's builds (on b: in the background) pin nothing later
    before = {srv.url: {p["record"] for p in pins(srv)["list"]} for srv in pair}  # schemas'

    def new(srv):
        return [p for p in pins(srv)["list"] if p["record"] not in before[srv.url]]

    prompt = list(range(1000, 1300))  # a whole chunk of 256 tokens and a partial one
    status, r = a.post_json("/v1/cache/pin", {"model": a.model_id, "prompt": prompt})
    assert status == 200 and r["pinned_chunks"] == 2, r
    lease = list(range(2000, 2300))
    status, r = a.post_json("/v1/cache/pin", {"model": a.model_id, "prompt": lease, "ttl": 600})
    assert status == 200 and r["pinned_chunks"] == 2, r
    here = new(a)
    assert len(here) == 4 and all("redis" not in p["tiers"] for p in here), here
    ours = {p["record"] for p in here}

    def listed_of_ours(srv):  # what srv lists of a's pins and leases, whatever else it lists
        return [p for p in pins(srv)["list"] if p["record"] in ours]

    there = listed_of_ours(b)
    assert len(there) == 4 and all(p["tiers"] == ["redis"] for p in there), there
    assert sorted(p["pinned"] for p in there) == [False, False, True, True], there
    assert all(p["expires_in_s"] > 500 for p in there if not p["pinned"]), there
    # unpinned on b: gone from both lists (a ends its own pin), the leases stay
    status, r = b.post_json("/v1/cache/unpin", {"model": b.model_id, "prompt": prompt})
    assert status == 200 and r["unpinned_chunks"] == 2, r
    for srv in pair:
        listed = listed_of_ours(srv)
        assert len(listed) == 2 and not any(p["pinned"] for p in listed), listed
