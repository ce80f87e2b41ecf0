#!/usr/bin/env python3
"""The live check of approximate reuse (cache/quality.h) against the offline measure, on the same
prompts: does the server's own rolling first-token KL say what bench-blend says?

A server runs one blend setting for every request that asks nothing (a calibration naming only
that setting, under a KL budget loose enough that the monitor never steps), with
--quality-sample 100: every blended request is computed again as a full prefill once the engine
is idle, and the two first-token distributions compared. The script sends bench-blend's RAG
questions (passages precomputed alone first), each also as a full prefill ("cache": false, the
offline reference), waits for each check, and prints per question the offline KL (full prefill's
top-20 against the blended answer's, blend.py's estimator) beside the server's mean, and the
server's rolling figure over its last window of 20.

    python3 scripts/bench/live_check.py [--questions 24] [--policy hkvd] [--ratio 0.15]
"""
import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

import benchlib
import blend


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    benchlib.add_server_args(ap)
    ap.add_argument("--questions", type=int, default=24)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--policy", default="hkvd")
    ap.add_argument("--ratio", type=float, default=0.15)
    args = ap.parse_args()

    probe = blend.Server(args, ["--reuse-quality", "none"])
    try:
        identity = probe.request("GET", "/v1/cache/stats")[1]["model_identity"]
        pool = blend.passages(probe)
    finally:
        probe.stop()
    qs = blend.question_set(pool, args.questions, random.Random(args.seed))
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"format": "kvserve-kvquality", "version": 1, "model_identity": identity,
                   "prompts": 1, "floor": {"kl": 0.001, "top1": 1.0},
                   "points": [{"method": "blend", "policy": args.policy, "ratio": args.ratio,
                               "kl": 0.0, "top1": 1.0}]}, f)
        calib = f.name
    srv = blend.Server(args, ["--reuse-calibration", calib, "--reuse-quality", "1000",
                              "--quality-sample", "100"])
    offline, live_kl = [], []

    def checks():
        """(checked, sampled, sum of the checks' KL) once every sampled request is checked."""
        deadline = time.monotonic() + 300
        while True:
            q = srv.request("GET", "/v1/cache/stats")[1]["reuse_quality"]["methods"]["blend"][
                "live_check"]
            if q["checked"] + q["dropped"] >= q["sampled"] or time.monotonic() > deadline:
                return q, q["mean_kl"] * q["checked"]
            time.sleep(0.05)

    try:
        for d in sorted({d for docs, _ in qs for d in docs}):
            # a precompute may blend too (licences share lines): checked, not counted
            srv.chat(blend.precompute_turn(pool[d]), 1, {})
        live, before = checks()
        for qi, (docs, q) in enumerate(qs):
            msgs = blend.messages(pool, docs, q)
            _, _, ref_lp, _, _ = srv.chat(msgs, 1, {"cache": False})
            _, _, lp, usage, _ = srv.chat(msgs, 1, {})
            if not usage["prompt_tokens_details"].get("blended_tokens"):
                continue
            n0 = live["checked"]
            live, total = checks()
            if live["checked"] != n0 + 1:
                sys.exit(f"question {qi + 1}: {live['checked'] - n0} checks, not 1: {live}")
            offline.append(blend.kl(ref_lp, lp))
            live_kl.append(total - before)
            before = total
            print(f"question {qi + 1}: offline KL {offline[-1]:.4f}, live {live_kl[-1]:.4f}",
                  file=sys.stderr)
    finally:
        srv.stop()
        os.unlink(calib)
    off, on = statistics.mean(offline), statistics.mean(live_kl)
    worst = max(abs(a - b) for a, b in zip(offline, live_kl))
    print(f"\n{args.policy} {round(100 * args.ratio)}%, {len(offline)} blended questions of "
          f"bench-blend's RAG set, each checked once:\n")
    print("| measure | mean first-token KL |")
    print("| --- | ---: |")
    print(f"| offline (bench estimator, a cache-off request's top 20) | {off:.4f} |")
    print(f"| live check (the server's own, the same requests) | {on:.4f} |")
    print(f"\nlive / offline: {on / off:.3f}; largest per-question difference {worst:.4f}")


if __name__ == "__main__":
    main()
