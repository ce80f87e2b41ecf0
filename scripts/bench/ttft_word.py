#!/usr/bin/env python3
"""Time to first token at low load when prompts share all but their last word: one client,
streaming /v1/completions over raw text of about 6, 200 and 3,000 tokens ("Once upon a time N",
a licence text cut to length) whose variants differ only in the last word, kvserve against
llama.cpp's llama-server on the same model, machine and threads.

Each server first answers the prompt with its first word (so it holds that prompt's KV), then
the same variants in the same order. Requests alternate between the two servers, one at a time,
so noise on this shared machine hits both alike. llama-server runs one slot (-np 1), which
reuses the common token prefix of its last prompt; kvserve reuses to the token from its pool
tier (and says how many tokens in usage.prompt_tokens_details.cached_tokens). TTFT is the time
from sending the request to the first streamed text. The table gives medians over --reps
variants, their ratio, and the tokens kvserve reused.

    scripts/bench/build_llamacpp.sh build/llamacpp avx512      # once
    python3 scripts/bench/ttft_word.py [--bin build/kvserve] [--model MODEL] [--threads 2]
        [--llama-server build/llamacpp/avx512/bin/llama-server] [--lengths 6,200,3000] [--reps 8]
"""
import argparse
import os
import statistics
import sys
import time

import benchlib
from benchlib import ROOT

WORDS = ["dog", "cat", "king", "ship", "tree", "river", "lamp", "horse", "storm", "bird",
         "door", "stone", "child", "wolf", "queen", "bridge", "garden", "road", "moon", "candle",
         "window", "forest", "apple", "clock"]
LICENCE = "/usr/share/common-licenses/GPL-3"
MAX_TOKENS = 4


def base_text(srv, n_tokens):
    """Text of about n_tokens tokens (by kvserve's tokenizer) before the last word."""
    if n_tokens <= 6:
        return "Once upon a time"
    with open(LICENCE, encoding="utf-8") as f:
        words = f.read().split()
    lo, hi = 1, len(words)
    while lo < hi:  # the most words whose text stays under n_tokens - 1 tokens
        mid = (lo + hi + 1) // 2
        st, body = srv.request("POST", "/tokenize", {"content": " ".join(words[:mid]),
                                                      "add_special": False})
        assert st == 200, body
        if len(body["tokens"]) <= n_tokens - 1:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


def ttft(srv, prompt):
    """(seconds to the first streamed text, prompt tokens, cached tokens or None)."""
    t0, resp = srv.stream("/v1/completions", {
        "model": srv.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}})
    t_first, usage = None, None
    for ev in benchlib.sse_events(resp):
        if "error" in ev:
            sys.exit(f"{srv.NAME}: error: {ev['error']}")
        for ch in ev.get("choices") or []:
            if ch.get("text") and t_first is None:
                t_first = time.perf_counter() - t0
        if ev.get("usage"):
            usage = ev["usage"]
    if t_first is None:
        t_first = time.perf_counter() - t0
    usage = usage or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return t_first, usage.get("prompt_tokens"), cached


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    benchlib.add_server_args(ap)
    ap.add_argument("--llama-server",
                    default=os.path.join(ROOT, "build/llamacpp/avx512/bin/llama-server"))
    ap.add_argument("--lengths", default="6,200,3000")
    ap.add_argument("--reps", type=int, default=8)
    args = ap.parse_args()
    if not os.access(args.llama_server, os.X_OK):
        sys.exit(f"no llama-server at {args.llama_server} (scripts/bench/build_llamacpp.sh)")
    lengths = [int(x) for x in args.lengths.split(",")]
    ctx = str(max(4096, 2 * max(lengths)))
    kv = benchlib.Server(args.bin, args.model, args.threads, ["-c", ctx])
    ll = benchlib.LlamaServer(args.llama_server, args.model, args.threads,
                              ["-c", ctx, "-np", "1"])
    rows = []
    try:
        for n in lengths:
            base = base_text(kv, n)
            for srv in (kv, ll):
                ttft(srv, f"{base} {WORDS[0]}")
            times = {kv.NAME: [], ll.NAME: []}
            cached, n_prompt = [], None
            for r in range(args.reps):
                prompt = f"{base} {WORDS[1 + r % (len(WORDS) - 1)]}"
                for srv in ((kv, ll) if r % 2 == 0 else (ll, kv)):
                    t, n_p, c = ttft(srv, prompt)
                    times[srv.NAME].append(t * 1000)
                    if srv is kv:
                        n_prompt = n_p
                        cached.append(c)
            a, b = statistics.median(times[kv.NAME]), statistics.median(times[ll.NAME])
            rows.append((n_prompt, a, b, min(cached), max(cached)))
    finally:
        kv.kill()
        ll.kill()
    print(f"\n1 client, prompts sharing all but their last word, {args.threads} threads, "
          f"{args.reps} variants each (medians)\n")
    print("| prompt tokens | kvserve TTFT ms | llama-server TTFT ms | kvserve / llama-server "
          "| kvserve cached tokens |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for n_prompt, a, b, c_lo, c_hi in rows:
        c = f"{c_lo}" if c_lo == c_hi else f"{c_lo}-{c_hi}"
        print(f"| {n_prompt} | {a:.1f} | {b:.1f} | {a / b:.2f}x | {c} |")


if __name__ == "__main__":
    main()
