"""Approximate reuse under the quality budget (--reuse-quality over the model's calibration,
cache/quality.h), through the server with the unmodified openai client: a client that asks
nothing gets blend only where the calibration shows a setting within budget, at that setting;
one that names a ratio or a policy still gets it; /health and /v1/cache/stats say what is on
and why; a calibration of another model, or a budget that is not one, is refused at start."""
import itertools
import json
import os
import threading
import time

import pytest

from conftest import MODEL, free_port, run_kvserve
from test_blend import PASSAGES, SYSTEM, ask, details, rag

CTX = ("-c", "2048")
QUALITY_WINDOW = 20  # cache/quality.h


def identity(server):
    return server.get_json("/v1/cache/stats")["model_identity"]


def calibration(path, model_identity, points, floor=(0.004, 0.98)):
    with open(path, "w") as f:
        json.dump({"format": "kvserve-kvquality", "version": 1,
                   "model_identity": model_identity, "prompts": 10,
                   "floor": {"kl": floor[0], "top1": floor[1]}, "points": points}, f)
    return path


def blend_point(policy, ratio, kl, top1, speedup):
    return {"method": "blend", "policy": policy, "ratio": ratio, "kl": kl, "top1": top1,
            "speedup": speedup}


@pytest.fixture
def model_identity(server):
    return identity(server)


def test_a_client_that_asks_nothing_gets_the_calibrated_setting(start_server, tmp_dir,
                                                                 model_identity):
    # within floor (KL <= 0.008, top-1 >= 96%): legolink 30% is the fastest that is
    path = calibration(os.path.join(tmp_dir("kvserve-quality-"), "q.json"), model_identity, [
        blend_point("hkvd", 0.15, 0.1, 0.7, 4.2),
        blend_point("legolink", 0.3, 0.007, 0.97, 3.0),
        blend_point("legolink", 0.8, 0.004, 0.98, 1.2),
        {"method": "level", "level": "q8", "kl": 0.003, "top1": 0.99},
        {"method": "level", "level": "codec0", "kl": 0.05, "top1": 0.9}])
    srv = start_server(*CTX, "--reuse-calibration", path)
    q = srv.get_json("/health")["reuse_quality"]
    assert q["calibration"] == path
    assert q["methods"]["blend"]["on"] and q["methods"]["blend"]["policy"] == "legolink"
    assert q["methods"]["blend"]["ratio"] == pytest.approx(0.3)
    assert "legolink 30%" in q["methods"]["blend"]["why"]
    assert q["methods"]["levels"]["allowed"] == ["q8"]
    assert srv.get_json("/v1/cache/stats")["reuse_quality"] == q
    c, m = srv.client(), srv.model_id
    ask(c, m, rag([0, 1, 2], "What is free software?"))
    _, usage = ask(c, m, rag([2, 0, 1], "Who has responsibilities?"))
    _, blended, recomputed = details(usage)
    extra = usage.prompt_tokens_details.model_extra
    assert blended > 0.6 * usage.prompt_tokens, usage
    assert extra["blend_policy"] == "legolink" and extra["blend_ratio"] == pytest.approx(0.3)
    assert recomputed < blended


def test_a_method_out_of_budget_is_off_unless_a_request_asks(start_server, tmp_dir,
                                                             model_identity):
    path = calibration(os.path.join(tmp_dir("kvserve-quality-"), "q.json"), model_identity, [
        blend_point("hkvd", 0.15, 0.1, 0.7, 4.2), blend_point("hybrid", 0.5, 0.03, 0.9, 1.8)])
    srv = start_server(*CTX, "--reuse-calibration", path)
    blend = srv.get_json("/health")["reuse_quality"]["methods"]["blend"]
    assert not blend["on"]
    assert "no setting within KL <= 0.0080" in blend["why"] and "hybrid 50%" in blend["why"]
    c, m = srv.client(), srv.model_id
    ask(c, m, rag([0, 1, 2], "What is free software?"))
    msgs = rag([2, 0, 1], "Who has responsibilities?")
    full, _ = ask(c, m, msgs, cache=False)
    # the passages were kept all the same: asked for, they are reused
    got, usage = ask(c, m, msgs)
    assert details(usage)[1] == 0, usage
    assert got == full
    _, usage = ask(c, m, rag([1, 2, 0], "What may you charge for?"), blend_ratio=0.5,
                   blend_policy="hybrid")
    assert details(usage)[1] > 0.6 * usage.prompt_tokens, usage
    # a looser budget of the same calibration takes it
    srv2 = start_server(*CTX, "--reuse-calibration", path, "--reuse-quality", "0.05")
    blend = srv2.get_json("/health")["reuse_quality"]["methods"]["blend"]
    assert blend["on"] and blend["policy"] == "hybrid"


def test_no_calibration_means_exact_reuse_only(start_server, tmp_dir):
    # the model under another path, with no calibration beside it
    d = tmp_dir("kvserve-quality-")
    alone = os.path.join(d, os.path.basename(MODEL))
    os.symlink(os.path.abspath(MODEL), alone)
    srv = start_server(*CTX, "-m", alone)
    q = srv.get_json("/health")["reuse_quality"]
    assert q["budget"] == "floor" and q["calibration"] is None
    assert not q["methods"]["blend"]["on"] and q["methods"]["levels"]["allowed"] == []
    assert "no calibration" in q["methods"]["blend"]["why"]
    assert "calibrate-reuse" in srv.stderr()
    c, m = srv.client(), srv.model_id
    ask(c, m, rag([0, 1, 2], "What is free software?"))
    _, usage = ask(c, m, rag([2, 0, 1], "Who has responsibilities?"))
    assert details(usage)[1] == 0, usage


def test_schema_prompts_get_the_fixup_the_budget_allows(start_server, tmp_dir, model_identity):
    """Prompt Cache's modules out of their context are approximate reuse too: a schema prompt
    that names no fix-up gets the least calibrated fix-up within the budget, and where none is
    within it, the full prefill's answer from the exact part of the modules' KV; "fixup" still
    wins."""
    from test_schema import TRAVEL, answer, register
    path = calibration(os.path.join(tmp_dir("kvserve-quality-"), "q.json"), model_identity, [
        {"method": "fixup", "ratio": 0.0, "kl": 0.18, "top1": 1.0, "speedup": 40},
        {"method": "fixup", "ratio": 0.3, "kl": 0.007, "top1": 0.97, "speedup": 2.3},
        {"method": "fixup", "ratio": 0.8, "kl": 0.003, "top1": 0.99, "speedup": 1.1}])
    p = '<prompt schema="travel"><plan days="3"/><miami><surf/></miami><user>When?</user></prompt>'
    srv = start_server(*CTX, "--reuse-calibration", path)
    fixup = srv.get_json("/health")["reuse_quality"]["methods"]["fixup"]
    assert fixup["ratio"] == pytest.approx(0.3) and "fix-up 30%" in fixup["why"]
    register(srv, TRAVEL)
    _, usage = answer(srv, p, fixup=None)  # null: the field is not given
    det = usage["prompt_tokens_details"]
    assert det["blended_tokens"] > 0 and det["recomputed_tokens"] < det["blended_tokens"]
    assert det["recomputed_tokens"] >= 0.25 * det["blended_tokens"], det
    # a budget no fix-up meets: laid out as a full prefill, reusing only the KV that is exact
    # (the system turn and the module's text up to its parameter), unless the request asks
    tight = start_server(*CTX, "--reuse-calibration", path, "--reuse-quality", "0.001")
    assert "off" in tight.get_json("/health")["reuse_quality"]["methods"]["fixup"]["why"]
    register(tight, TRAVEL)
    cold, _ = answer(tight, p, cache=False, fixup=True)  # the full prefill's layout, no reuse
    got, usage = answer(tight, p, fixup=None)
    exact = usage["prompt_tokens_details"]["cached_tokens"]
    uncached, _ = answer(tight, p, cache=False, fixup=None)  # "cache" changes only the reuse
    _, usage = answer(tight, p, fixup=False)
    assert got == cold == uncached, (got, cold, uncached)
    assert 20 < exact < usage["prompt_tokens_details"]["cached_tokens"], usage


def test_another_models_calibration_and_a_bad_budget_are_refused(tmp_dir, model_identity):
    other = ("0" if model_identity[0] != "0" else "1") + model_identity[1:]
    path = calibration(os.path.join(tmp_dir("kvserve-quality-"), "q.json"), other,
                       [blend_point("hkvd", 0.15, 0.001, 1.0, 4.0)])
    r = run_kvserve("serve", "-m", MODEL, "--port", str(free_port()), "-c", "256", "--reuse-calibration", path,
                    timeout=120)
    assert r.returncode != 0 and "another model" in r.stderr, r.stderr
    r = run_kvserve("serve", "-m", MODEL, "--port", str(free_port()), "-c", "256", "--reuse-quality",
                    "excellent", timeout=120)
    assert r.returncode != 0 and "--reuse-quality must be" in r.stderr, r.stderr


FOURTH = ("Developers that use the GNU GPL protect your rights with two steps:\n"
          "(1) assert copyright on the software, and (2) offer you this License\n"
          "giving you legal permission to copy, distribute and/or modify it.")


def rag4(order, question):
    docs = [*PASSAGES, FOURTH]
    body = "\n\n".join(f"Document {i + 1}:\n{docs[p]}" for i, p in enumerate(order))
    return [SYSTEM, {"role": "user", "content": f"{body}\n\nQuestion: {question}"}]


def live(srv):
    return srv.get_json("/v1/cache/stats")["reuse_quality"]["methods"]["blend"]


def wait_checked(srv, n, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if live(srv)["live_check"]["checked"] >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"fewer than {n} checks: {live(srv)}")


def test_the_live_check_steps_up_from_a_calibration_that_claims_too_much(start_server, tmp_dir,
                                                                        model_identity):
    # it claims legolink at 5% is as close to a full prefill as rounding is: it is not
    path = calibration(os.path.join(tmp_dir("kvserve-quality-"), "q.json"), model_identity, [
        blend_point("legolink", 0.05, 1e-6, 1.0, 8.0),
        blend_point("legolink", 0.5, 1e-6, 1.0, 2.0)], floor=(1e-6, 1.0))
    srv = start_server(*CTX, "--reuse-calibration", path, "--quality-sample", "100")
    b = live(srv)
    assert b["on"] and b["ratio"] == pytest.approx(0.05) and b["live_check"]["on"]
    c, m = srv.client(), srv.model_id
    ask(c, m, rag4([0, 1, 2, 3], "What is free software?"))
    orders = list(itertools.permutations(range(4)))[1:]
    checked, ratios = 0, []
    for order in orders[:-1]:
        _, usage = ask(c, m, rag4(order, "Who has responsibilities?"))
        if details(usage)[1] == 0:
            continue  # nothing blended: nothing to check
        ratios.append(usage.prompt_tokens_details.model_extra["blend_ratio"])
        checked += 1
        wait_checked(srv, checked)  # the engine is idle now: the check runs
        if live(srv)["live_check"]["steps_up"]:
            break
    q = live(srv)
    # a window of samples found it out, and the ratio stepped up the calibrated ladder
    assert q["live_check"]["steps_up"] == 1, (checked, q["live_check"])
    assert checked == QUALITY_WINDOW, q
    assert q["ratio"] == pytest.approx(0.5) and q["calibrated_ratio"] == pytest.approx(0.05)
    assert q["live_check"]["rolling_kl"] > 2e-6 and "legolink 5% -> 50%" in q["live_check"][
        "last_step"]
    assert ratios == [pytest.approx(0.05)] * len(ratios)
    _, usage = ask(c, m, rag4(orders[-1], "What may you charge for?"))
    assert usage.prompt_tokens_details.model_extra["blend_ratio"] == pytest.approx(0.5)
    metrics = srv.metrics()
    assert metrics['kvserve_reuse_quality_steps_total{method="blend",direction="up"}'] == 1
    assert metrics["kvserve_blend_ratio"] == pytest.approx(0.5)
    assert "live check" in srv.stderr()


def test_a_check_gives_way_to_client_requests(start_server, tmp_dir, model_identity):
    path = calibration(os.path.join(tmp_dir("kvserve-quality-"), "q.json"), model_identity, [
        blend_point("legolink", 0.3, 0.0, 1.0, 3.0)], floor=(0.01, 1.0))
    srv = start_server(*CTX, "--reuse-calibration", path, "--quality-sample", "100")
    c, m = srv.client(), srv.model_id
    ask(c, m, rag4([0, 1, 2, 3], "What is free software?"))
    stop = threading.Event()
    errors = []

    def load():
        cl = srv.client()
        try:
            while not stop.is_set():
                cl.completions.create(model=m, prompt="Count: one, two,", max_tokens=24,
                                      temperature=0, extra_body={"cache": False})
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=load) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.3)
        for order in [(1, 0, 2, 3), (2, 3, 0, 1)]:  # two blended requests, checks queued
            _, usage = ask(c, m, rag4(order, "Who has responsibilities?"))
            assert details(usage)[1] > 0, usage
        time.sleep(2)
        during = live(srv)["live_check"]
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors
    # while clients kept the engine busy no check ran to its end
    assert during["sampled"] == 2 and during["checked"] == 0, during
    wait_checked(srv, 2)  # idle: both ran


def test_the_default_server_reuses_reordered_passages_as_its_budget_says(server):
    # the server as `make run` starts it, the default model's calibration beside it
    q = server.get_json("/health")["reuse_quality"]
    blend = q["methods"]["blend"]
    c, m = server.client(), server.model_id
    ask(c, m, rag([0, 1, 2], "What is free software?"))
    msgs = rag([2, 0, 1], "Who has responsibilities?")
    full, _ = ask(c, m, msgs, cache=False)
    got, usage = ask(c, m, msgs)
    _, blended, _ = details(usage)
    if not blend["on"]:
        # exact reuse only: the answer is the full prefill's
        assert blended == 0 and got == full, (usage, blend["why"])
    else:
        extra = usage.prompt_tokens_details.model_extra
        assert blended > 0 and extra["blend_policy"] == blend["policy"], usage
        assert extra["blend_ratio"] >= blend["ratio"] - 1e-6
