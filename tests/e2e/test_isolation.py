"""Tenants' private state and requests from web pages (issue #44), on one server with two API
keys on the loopback address: /v1/cache/stats lists only the caller's pins; Responses output item
ids say nothing of the response's id, and cache_salt separates stored responses as it does the
KV cache; a POST body must be declared JSON (415); a page of a foreign Origin is refused while
the web page's own origin and --allowed-origins get CORS (preflights too); a foreign Host is
refused on the loopback listener (DNS rebinding) unless --allowed-hosts names it; and text that
cannot fit the context is refused before count_tokens, /tokenize or /detokenize work on it."""
import json
import re

import openai
import pytest
import requests

from conftest import SLOW, KvServer

ALICE, BOB = "alice-key", "bob-key"
APP = "http://app.example:3000"  # a frontend on another origin, allowed by --allowed-origins
TIMEOUT = 60 * SLOW


@pytest.fixture(scope="module")
def srv(model_path):
    s = KvServer(["-c", "1024", "--cache-chunk-tokens", "16", "--api-key", ALICE, "--api-key",
                  BOB, "--allowed-origins", APP + "/", "--allowed-hosts", "kvserve.internal"])
    s.start()
    yield s
    s.terminate()


def post(srv, path, body, key=ALICE, headers=None, data=None):
    h = {"Authorization": f"Bearer {key}", "Content-Type": "application/json", **(headers or {})}
    return requests.post(srv.url + path, data=data if data is not None else json.dumps(body),
                         headers=h, timeout=TIMEOUT)


def error(r, status, code=None):
    assert r.status_code == status, (r.status_code, r.text)
    e = r.json()["error"]
    assert e["message"] and e["type"], e
    if code:
        assert e["code"] == code, e
    return e


def pins(srv, key, salt=None):
    q = f"?cache_salt={salt}" if salt else ""
    r = requests.get(srv.url + "/v1/cache/stats" + q, headers={"Authorization": f"Bearer {key}"},
                     timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()["pins"]


# ---------------------------------------------------------------- private state

def test_cache_stats_list_only_the_callers_pins(srv):
    for key, words in ((ALICE, "apples and pears"), (BOB, "bicycles and trains")):
        prompt = f"A short note about {words}, written to be pinned in the cache. " * 3
        r = post(srv, "/v1/cache/pin", {"model": srv.model_id, "prompt": prompt}, key=key)
        assert r.status_code == 200 and r.json()["pinned_chunks"] > 0, r.text
    r = post(srv, "/v1/cache/pin", {"model": srv.model_id, "cache_salt": "s1",
                                    "prompt": "Salted and pinned: a note about lakes. " * 4})
    assert r.status_code == 200 and r.json()["pinned_chunks"] > 0, r.text
    mine = {}
    for key in (ALICE, BOB):
        p = pins(srv, key)
        assert p["records"] == len(p["list"]) > 0, p
        mine[key] = {x["namespace"] for x in p["list"]}
        assert len(mine[key]) == 1, p  # its own namespace only
    assert mine[ALICE] != mine[BOB]
    salted = pins(srv, ALICE, salt="s1")
    assert salted["records"] > 0 and {x["namespace"] for x in salted["list"]} not in mine.values()


def test_response_item_ids_are_unrelated_to_the_response_id(srv):
    client = srv.client(api_key=ALICE)
    r = client.responses.create(model=srv.model_id, input="Say hello.", max_output_tokens=4,
                                temperature=0)
    digits = r.id.removeprefix("resp_")
    item = r.output[0].id
    # not one run of 8 of the response id's digits appears in the item's id
    assert not any(digits[i:i + 8] in item for i in range(len(digits) - 7)), (r.id, item)
    assert re.fullmatch(r"msg_[0-9a-f]{48}", item), item
    # the stream names its items as the whole response does, and another response's differ
    events = list(client.responses.create(model=srv.model_id, input="Say hello.", stream=True,
                                          max_output_tokens=4, temperature=0))
    added = [e.item.id for e in events if e.type == "response.output_item.added"]
    assert added == [o.id for o in events[-1].response.output] and added[0] != item


def test_cache_salt_separates_stored_responses(srv):
    client = srv.client(api_key=ALICE)
    first = client.responses.create(model=srv.model_id, input="Name a colour.",
                                    max_output_tokens=4, temperature=0,
                                    extra_body={"cache_salt": "salt-1"})
    for salt in ("salt-2", None):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=srv.model_id, input="Another.", max_output_tokens=4,
                                    previous_response_id=first.id,
                                    extra_body={"cache_salt": salt} if salt else None)
        assert e.value.code == "previous_response_not_found"
    again = client.responses.create(model=srv.model_id, input="Another.", max_output_tokens=4,
                                    previous_response_id=first.id,
                                    extra_body={"cache_salt": "salt-1"})
    assert again.status in ("completed", "incomplete")
    auth = {"Authorization": f"Bearer {ALICE}"}
    url = srv.url + "/v1/responses/" + first.id
    assert requests.get(url, headers=auth, timeout=TIMEOUT).status_code == 404
    got = requests.get(url + "?cache_salt=salt-1", headers=auth, timeout=TIMEOUT)
    assert got.status_code == 200 and got.json()["id"] == first.id


# ---------------------------------------------------------------- requests from web pages

def test_post_bodies_must_be_declared_json(srv):
    body = json.dumps({"content": "hi"})
    e = error(post(srv, "/tokenize", None, data=body, headers={"Content-Type": "text/plain"}),
              415, "unsupported_media_type")
    assert "application/json" in e["message"] and "text/plain" in e["message"], e
    r = requests.post(srv.url + "/tokenize", data=body.encode(), timeout=TIMEOUT,
                      headers={"Authorization": f"Bearer {ALICE}", "Content-Type": None})
    error(r, 415, "unsupported_media_type")
    r = post(srv, "/tokenize", None, data=body,
             headers={"Content-Type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200 and r.json()["count"] == 1, r.text
    # Anthropic's routes answer in Anthropic's shape
    r = post(srv, "/v1/messages/count_tokens", None, data=body,
             headers={"Content-Type": "text/plain"})
    assert r.status_code == 415 and r.json()["type"] == "error", r.text
    # /v1/schemas also takes PML as it is (answered by the schema parser, not refused)
    r = post(srv, "/v1/schemas", None, data="<schema", headers={"Content-Type": "application/xml"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_pml", r.text
    # a POST without a body needs no Content-Type (curl -X POST)
    r = requests.post(srv.url + "/v1/cache/clear", headers={"Authorization": f"Bearer {BOB}"},
                      timeout=TIMEOUT)
    assert r.status_code == 200, r.text


def test_foreign_origins_are_refused_and_allowed_ones_get_cors(srv):
    body = {"content": "hi"}
    e = error(post(srv, "/tokenize", body, headers={"Origin": "http://evil.example"}), 403,
              "origin_not_allowed")
    assert "--allowed-origins" in e["message"], e
    port = srv.url.rsplit(":", 1)[1]
    for origin in (srv.url, f"http://localhost:{port}", APP):  # the page's own, and the allowed
        r = post(srv, "/tokenize", body, headers={"Origin": origin})
        assert r.status_code == 200, (origin, r.text)
        assert r.headers["Access-Control-Allow-Origin"] == origin, r.headers
    asks = {"Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"}
    r = requests.options(srv.url + "/v1/chat/completions", headers={"Origin": APP, **asks},
                         timeout=TIMEOUT)
    assert r.status_code == 204, r.text
    assert r.headers["Access-Control-Allow-Origin"] == APP
    assert "POST" in r.headers["Access-Control-Allow-Methods"]
    assert "authorization" in r.headers["Access-Control-Allow-Headers"].lower()
    r = requests.options(srv.url + "/v1/chat/completions",
                         headers={"Origin": "http://evil.example", **asks}, timeout=TIMEOUT)
    assert r.status_code == 403 and "Access-Control-Allow-Origin" not in r.headers, r.headers
    # no Origin (curl, the SDKs): no CORS headers, nothing refused
    r = post(srv, "/tokenize", body)
    assert r.status_code == 200 and "Access-Control-Allow-Origin" not in r.headers


def test_foreign_host_is_refused_on_a_loopback_listener(srv):
    port = srv.url.rsplit(":", 1)[1]
    for host in (f"rebound.example:{port}", "rebound.example", "127.0.0.1.nip.io"):
        r = requests.get(srv.url + "/health", headers={"Host": host}, timeout=TIMEOUT)
        error(r, 403, "host_not_allowed")
    for host in (f"localhost:{port}", "127.0.0.1", f"[::1]:{port}", "kvserve.internal"):
        r = requests.get(srv.url + "/health", headers={"Host": host}, timeout=TIMEOUT)
        assert r.status_code == 200, (host, r.text)


# ---------------------------------------------------------------- bounded work on HTTP threads

def test_text_over_the_context_is_refused_before_it_is_tokenized(srv):
    long_text = "hello world " * 20000  # 240 KB: over 1024 tokens of any vocabulary's longest
    r = post(srv, "/v1/messages/count_tokens", {
        "model": srv.model_id, "messages": [{"role": "user", "content": long_text}]})
    assert r.status_code == 400, r.text
    e = r.json()["error"]
    assert e["type"] == "invalid_request_error" and "cannot fit" in e["message"], e
    r = post(srv, "/v1/messages/count_tokens", {
        "model": srv.model_id, "messages": [{"role": "user", "content": "hello " * 1500}]})
    assert r.status_code == 200 and r.json()["input_tokens"] > 1024, r.text  # a count may pass it
    error(post(srv, "/tokenize", {"content": long_text}), 400, "context_length_exceeded")
    error(post(srv, "/detokenize", {"tokens": [1] * 1025}), 400, "context_length_exceeded")
    error(post(srv, "/v1/completions", {"model": srv.model_id, "prompt": long_text}), 400,
          "context_length_exceeded")
    # the work budget on HTTP threads: nothing held now, room for more than one such text
    m = srv.metrics()
    assert m["kvserve_http_tokenizing_bytes"] == 0
    assert m["kvserve_http_tokenizing_budget_bytes"] >= 1024 * 16, m
