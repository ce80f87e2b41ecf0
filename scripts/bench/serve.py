#!/usr/bin/env python3
"""Serving throughput of `kvserve serve`: aggregate decode tokens/s with 1, 4 and 16 streams at
once (continuous batching), plus time to first token and inter-token latency.

Every stream is a streaming /v1/completions request with a distinct short prompt, greedy, with
ignore_eos so each generates exactly --tokens tokens. For each concurrency level all streams
start together; the aggregate decode rate is the tokens generated after each stream's first
token divided by the span from the first first-token to the last last-token. Levels run in one
process against one server, repeated --reps times (median), and are compared as ratios to the
single stream, since machines here are shared and noisy.

Then memory: per level, a fresh server (cache directory empty) runs the warm-up and that level
once, and its peak RSS (VmHWM: the mmapped weights it touched, the KV pool's committed pages,
what the RAM tier took, scratch) is read from /proc. With --llama-server PATH
(scripts/bench/build_llamacpp.sh builds it) a fresh llama-server with as many slots and the same
KV capacity (-np LEVEL_MAX -c 4 x 2048, kvserve's pool) runs the same load beside it, and the
table gives the ratio; the throughput levels then also run against a llama-server started beside
kvserve (alternating server by server within each repetition), in a table of tokens/s and TTFT
side by side. Prompts repeat from one repetition to the next, as a client's do: both servers
reuse what they share with earlier ones.

    python3 scripts/bench/serve.py [--bin build/kvserve] [--model MODEL] [--threads 2]
                                   [--llama-server build/llamacpp/avx512/bin/llama-server]

--device cuda: both servers on the GPU (kvserve --device cuda; llama-server -ngl 99 -fa on, as
build_llamacpp.sh's cuda level builds it); scripts/device/check.sh's `peer` step runs
--levels 1,32 so.
"""
import argparse
import http.client
import json
import os
import statistics
import tempfile
import threading
import time

import benchlib


PROMPTS = [
    "The history of the printing press", "A recipe for tomato soup", "How volcanoes form",
    "The rules of chess", "Why the sky is blue", "A short story about a lighthouse keeper",
    "The life cycle of a butterfly", "How to plant a tree", "The planets of the solar system",
    "A letter to a friend about a trip", "How bread rises", "The invention of the telephone",
    "A poem about autumn leaves", "How bees make honey", "The water cycle explained",
    "Tips for learning a new language", "The story of the first flight",
    "How a bicycle works", "A description of a busy market", "Why cats purr",
]


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


CTX = 2048  # tokens per sequence; kvserve's pool holds 4 contexts (its default)


def kvserve(args, max_seqs, extra=()):
    return benchlib.Server(args.bin, args.model, args.threads,
                           ["--max-seqs", str(max_seqs), "--ctx-size", str(CTX),
                            "--device", args.device, *extra])


def llama_server(args, max_seqs):
    """As many slots, and as much KV, as kvserve's pool (4 contexts)."""
    gpu = ["-ngl", "99", "-fa", "on"] if args.device == "cuda" else []
    return benchlib.LlamaServer(args.llama_server, args.model, args.threads,
                                ["-np", str(max_seqs), "-c", str(4 * CTX), "--poll", "0", *gpu])


def peak_rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


def peak_rss(args, start, conc):
    """Peak RSS (MiB) of a fresh server (start()) through the warm-up and one run of conc
    streams."""
    srv = start()
    try:
        run_level(srv.port, srv.model, 2, 16)
        run_level(srv.port, srv.model, conc, args.tokens)
        return peak_rss_mib(srv.proc.pid)
    finally:
        srv.stop()


def memory_table(args, levels):
    top = max(levels)
    with tempfile.TemporaryDirectory() as tmp:
        kv, ll = {}, {}
        for c in levels:
            d = os.path.join(tmp, str(c))
            kv[c] = peak_rss(args, lambda d=d: kvserve(args, top, ["--cache-dir", d]), c)
            if args.llama_server:
                ll[c] = peak_rss(args, lambda: llama_server(args, top), c)
    print(f"\nPeak RSS (VmHWM), a fresh server per level ({top} sequences, {4 * CTX} tokens of "
          "KV, empty cache directory), warm-up plus one run\n")
    if ll:
        print("| streams | kvserve MiB | llama-server MiB | kvserve / llama-server |")
        print("|---:|---:|---:|---:|")
        for c in levels:
            print(f"| {c} | {kv[c]:.0f} | {ll[c]:.0f} | {kv[c] / ll[c]:.2f}x |")
    else:
        print("| streams | kvserve MiB |")
        print("|---:|---:|")
        for c in levels:
            print(f"| {c} | {kv[c]:.0f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    benchlib.add_server_args(ap)
    ap.add_argument("--tokens", type=int, default=128, help="tokens per stream")
    ap.add_argument("--levels", default="1,4,16")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--llama-server", help="llama-server binary: the same load on it, and its "
                    "peak RSS, beside kvserve's")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak RSS table")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                    help="kvserve's --device; cuda also puts llama-server on the GPU")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]

    peers = [kvserve(args, max(levels))]
    try:
        if args.llama_server:
            peers.append(llama_server(args, max(levels)))
        for srv in peers:
            run_level(srv.port, srv.model, 2, 16)  # warm-up
        rows = {(srv.NAME, c): [] for srv in peers for c in levels}
        for rep in range(args.reps):
            for c in levels:  # levels alternate within a repetition: noise hits all alike
                for srv in peers if rep % 2 == 0 else peers[::-1]:  # and the servers too
                    rows[srv.NAME, c].append(run_level(srv.port, srv.model, c, args.tokens))
    finally:
        for srv in peers:
            srv.stop()
    med = {k: {f: statistics.median(r[f] for r in v) for f in ("agg", "ttft", "itl")}
           for k, v in rows.items()}
    base = med["kvserve", levels[0]]["agg"]
    print(f"\nkvserve serve --device {args.device}, {args.threads} threads, {args.tokens} tokens "
          f"per stream, median of {args.reps}\n")
    print("| streams | aggregate decode tok/s | vs 1 stream | median TTFT ms | median ITL ms |")
    print("|---:|---:|---:|---:|---:|")
    for c in levels:
        m = med["kvserve", c]
        print(f"| {c} | {m['agg']:.0f} | {m['agg'] / base:.2f}x | {m['ttft'] * 1e3:.0f} "
              f"| {m['itl'] * 1e3:.1f} |")
    if args.llama_server:
        print(f"\nThe same load on llama-server (-np {max(levels)}), alternating with kvserve\n")
        print("| streams | kvserve tok/s | llama-server tok/s | ratio | kvserve TTFT ms "
              "| llama-server TTFT ms | ratio |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for c in levels:
            a, b = med["kvserve", c], med["llama-server", c]
            print(f"| {c} | {a['agg']:.0f} | {b['agg']:.0f} | {a['agg'] / b['agg']:.2f}x "
                  f"| {a['ttft'] * 1e3:.1f} | {b['ttft'] * 1e3:.1f} "
                  f"| {a['ttft'] / b['ttft']:.2f}x |")
    if not args.no_memory:
        memory_table(args, levels)


if __name__ == "__main__":
    main()
