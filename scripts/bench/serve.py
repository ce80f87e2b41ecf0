#!/usr/bin/env python3
"""Serving throughput of `kvserve serve`: aggregate decode tokens/s with 1, 4 and 16 streams at
once (continuous batching), plus time to first token and inter-token latency.

Every stream is a streaming /v1/completions request with a distinct short prompt, greedy, with
ignore_eos so each generates exactly --tokens tokens. For each concurrency level all streams
start together; the aggregate decode rate is the tokens generated after each stream's first
token divided by the span from the first first-token to the last last-token. Levels run in one
process against one server, repeated --reps times (median), and are compared as ratios to the
single stream, since machines here are shared and noisy.

    python3 scripts/bench/serve.py [--bin build/kvserve] [--model MODEL] [--threads 2]
"""
import argparse
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

import benchlib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROMPTS = [
    "The history of the printing press", "A recipe for tomato soup", "How volcanoes form",
    "The rules of chess", "Why the sky is blue", "A short story about a lighthouse keeper",
    "The life cycle of a butterfly", "How to plant a tree", "The planets of the solar system",
    "A letter to a friend about a trip", "How bread rises", "The invention of the telephone",
    "A poem about autumn leaves", "How bees make honey", "The water cycle explained",
    "Tips for learning a new language", "The story of the first flight",
    "How a bicycle works", "A description of a busy market", "Why cats purr",
]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream_once(port, model, prompt, n_tokens, out):
    """One streaming completion; records (t_start, [token arrival times], n_tokens)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": n_tokens,
                       "temperature": 0, "stream": True, "ignore_eos": True,
                       "stream_options": {"include_usage": True}})
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
    arrivals, usage = [], None
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data: "):
            continue
        data = line[6:]
        if data == b"[DONE]":
            break
        ev = json.loads(data)
        if ev.get("usage"):
            usage = ev["usage"]
        if ev.get("choices") and ev["choices"][0].get("text"):
            arrivals.append(time.perf_counter())
    conn.close()
    out.append((t0, arrivals, usage["completion_tokens"] if usage else len(arrivals)))


def run_level(port, model, conc, n_tokens):
    results, threads = [], []
    for i in range(conc):
        p = PROMPTS[i % len(PROMPTS)] + (f" (part {i // len(PROMPTS) + 1})" if i >= len(PROMPTS)
                                         else "")
        threads.append(threading.Thread(target=stream_once,
                                        args=(port, model, p, n_tokens, results)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if len(results) != conc:
        raise RuntimeError(f"{conc - len(results)} of {conc} streams failed")
    first = min(a[0] for _, a, _ in results)
    last = max(a[-1] for _, a, _ in results)
    decode_tokens = sum(n - 1 for _, _, n in results)
    ttft = statistics.median(a[0] - t0 for t0, a, _ in results)
    gaps = [b - a for _, arr, _ in results for a, b in zip(arr, arr[1:])]
    return {"agg": decode_tokens / (last - first), "ttft": ttft,
            "itl": statistics.median(gaps) if gaps else float("nan"),
            "tokens": sum(n for _, _, n in results)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    benchlib.add_server_args(ap)
    ap.add_argument("--tokens", type=int, default=128, help="tokens per stream")
    ap.add_argument("--levels", default="1,4,16")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]

    port = free_port()
    srv = subprocess.Popen([args.bin, "serve", "-m", args.model, "--port", str(port), "-t",
                            str(args.threads), "--max-seqs", str(max(levels)), "--ctx-size",
                            "2048", "--log-level", "warn"], cwd=ROOT)
    try:
        model = None
        for _ in range(600):
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                c.request("GET", "/v1/models")
                r = c.getresponse()
                if r.status == 200:
                    model = json.loads(r.read())["data"][0]["id"]
                    break
            except OSError:
                pass
            time.sleep(0.1)
        if model is None:
            sys.exit("the server did not come up")
        run_level(port, model, 2, 16)  # warm-up
        rows = {c: [] for c in levels}
        for _ in range(args.reps):
            for c in levels:  # levels alternate within a repetition: noise hits all alike
                rows[c].append(run_level(port, model, c, args.tokens))
        base = statistics.median(r["agg"] for r in rows[levels[0]])
        print(f"\nkvserve serve, {args.threads} threads, {args.tokens} tokens per stream, "
              f"median of {args.reps}\n")
        print("| streams | aggregate decode tok/s | vs 1 stream | median TTFT ms "
              "| median ITL ms |")
        print("|---:|---:|---:|---:|---:|")
        for c in levels:
            agg = statistics.median(r["agg"] for r in rows[c])
            ttft = statistics.median(r["ttft"] for r in rows[c]) * 1e3
            itl = statistics.median(r["itl"] for r in rows[c]) * 1e3
            print(f"| {c} | {agg:.0f} | {agg / base:.2f}x | {ttft:.0f} | {itl:.1f} |")
    finally:
        srv.send_signal(signal.SIGTERM)
        try:
            srv.wait(timeout=30)
        except subprocess.TimeoutExpired:
            srv.kill()


if __name__ == "__main__":
    main()
