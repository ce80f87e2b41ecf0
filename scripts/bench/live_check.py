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
    offline, seen = [], 0
    try:
        for d in sorted({d for docs, _ in qs for d in docs}):
            srv.chat(blend.precompute_turn(pool[d]), 1, {})
        for qi, (docs, q) in enumerate(qs):
            msgs = blend.messages(pool, docs, q)
            _, _, ref_lp, _, _ = srv.chat(msgs, 1, {"cache": False})
            _, _, lp, usage, _ = srv.chat(msgs, 1, {})
            if not usage["prompt_tokens_details"].get("blended_tokens"):
                continue
            offline.append(blend.kl(ref_lp, lp))
            seen += 1
            deadline = time.monotonic() + 300
            while True:
                live = srv.request("GET", "/v1/cache/stats")[1]["reuse_quality"]["methods"][
                    "blend"]["live_check"]
                if live["checked"] >= seen or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            print(f"question {qi + 1}: offline KL {offline[-1]:.4f}; live mean "
                  f"{live['mean_kl']:.4f} over {live['checked']}", file=sys.stderr)
    finally:
        srv.stop()
        os.unlink(calib)
    off = statistics.mean(offline)
    print(f"\n{args.policy} {round(100 * args.ratio)}%, {len(offline)} blended questions of "
          f"bench-blend's RAG set:\n")
    print("| measure | first-token KL | top-1 |")
    print("| --- | ---: | ---: |")
    print(f"| offline (bench estimator) | {off:.4f} | |")
    print(f"| live check, mean of {live['checked']} | {live['mean_kl']:.4f} | "
          f"{100 * live['mean_top1']:.0f}% |")
    if live["rolling_kl"]:
        print(f"| live check, last window of 20 | {live['rolling_kl']:.4f} | "
              f"{100 * live['rolling_top1']:.0f}% |")
    print(f"\nlive / offline: {live['mean_kl'] / off:.3f}")


if __name__ == "__main__":
    main()
