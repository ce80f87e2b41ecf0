#!/usr/bin/env python3
"""Time to first token with the context cache: cold vs pool hit vs RAM hit vs disk hit after a
restart, for contexts of 1K, 4K and 8K tokens followed by a short question.

For each context length and repetition a fresh made-up document (never seen by the cache) is
sent as token ids plus a question, streaming, greedy, 1 token:
  cold   the first request (empty cache; its chunks are written back in the background)
  pool   the same request again: chunks found in the KV pool, appended by reference
  RAM    after POST /v1/cache/clear {"tiers": ["pool"]}: chunks copied in from the RAM tier
  disk   after restarting the server on the same cache directory: chunks read from disk
         (O_DIRECT where the filesystem allows, so not from the page cache), checked, copied in
TTFT is the time from sending the request to the first streamed token. Every hit is checked
to report the expected cached_tokens and the same first token as the cold run. All runs are in
one process against one server binary; the table compares them as ratios to cold (median of
--reps), since machines here are shared and noisy.

    python3 scripts/bench/ttft.py [--bin build/kvserve] [--model MODEL] [--threads 2]
"""
import argparse
import http.client
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, args, cache_dir):
        self.port = free_port()
        self.proc = subprocess.Popen(
            [args.bin, "serve", "-m", args.model, "-t", str(args.threads), "--port",
             str(self.port), "-c", str(args.ctx), "--cache-dir", cache_dir, "--log-level",
             "warn"], cwd=ROOT, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if self.request("GET", "/health")[0] == 200:
                    return
            except OSError:
                pass
            if self.proc.poll() is not None:
                sys.exit(f"kvserve exited with {self.proc.returncode}")
            time.sleep(0.05)
        sys.exit("kvserve did not become healthy")

    def request(self, method, path, body=None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=900)
        conn.request(method, path, json.dumps(body) if body is not None else None,
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        data = r.read()
        return r.status, json.loads(data) if data else None

    def ttft(self, model, prompt):
        """(seconds to the first token, first token text, cached_tokens)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=900)
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                           "stream": True, "stream_options": {"include_usage": True}})
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            sys.exit(f"HTTP {resp.status}: {resp.read()[:300]!r}")
        t_first, text, cached = None, None, None
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("choices") and t_first is None:
                t_first = time.perf_counter() - t0
                text = ev["choices"][0]["text"]
            if ev.get("usage"):
                cached = ev["usage"]["prompt_tokens_details"]["cached_tokens"]
        return t_first, text, cached

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=120)


def document(srv, n, seed):
    words = []
    k = seed * 2654435761 % (1 << 32)
    while len(words) < n:
        k = (k * 1103515245 + 12345) % (1 << 31)
        words.append(f"Entry {seed}.{len(words)}: station {k % 9973} measured {k % 997} units"
                     f" at {k % 24}:{k % 60:02d}.")
    status, body = srv.request("POST", "/tokenize", {"content": " ".join(words),
                                                     "add_special": False})
    assert status == 200, body
    assert len(body["tokens"]) >= n
    return body["tokens"][:n]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "kvserve"))
    ap.add_argument("--model", default=os.path.join(ROOT, "models",
                                                    "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--contexts", default="1024,4096,8192")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    args.ctx = max(contexts) + 256
    model = os.path.basename(args.model)[:-len(".gguf")]
    cache_dir = tempfile.mkdtemp(prefix="kvserve-ttft-")
    srv = Server(args, cache_dir)
    question = srv.request("POST", "/tokenize", {
        "content": "\nQuestion: which station measured the most units? Answer:",
        "add_special": False})[1]["tokens"]
    times = {(c, kind): [] for c in contexts for kind in ("cold", "pool", "ram", "disk")}
    try:
        for rep in range(args.reps):
            prompts = {c: document(srv, c, seed=1000 * rep + c) + question for c in contexts}
            first = {}
            for c in contexts:
                t, tok, cached = srv.ttft(model, prompts[c])
                assert cached == 0, cached
                times[(c, "cold")].append(t)
                first[c] = tok
                t, tok, cached = srv.ttft(model, prompts[c])
                assert cached == c // 256 * 256 and tok == first[c], (cached, tok, first[c])
                times[(c, "pool")].append(t)
                srv.request("POST", "/v1/cache/clear", {"tiers": ["pool"]})
                t, tok, cached = srv.ttft(model, prompts[c])
                assert cached == c // 256 * 256 and tok == first[c], (cached, tok, first[c])
                times[(c, "ram")].append(t)
            srv.stop()  # finishes the queued disk writes
            srv = Server(args, cache_dir)
            for c in contexts:
                t, tok, cached = srv.ttft(model, prompts[c])
                assert cached == c // 256 * 256 and tok == first[c], (cached, tok, first[c])
                times[(c, "disk")].append(t)
            print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr)
    finally:
        srv.stop()
        shutil.rmtree(cache_dir, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"TTFT, median of {args.reps} (model {model}, {args.threads} threads, "
          f"prompt = context + {len(question)}-token question, 1 token generated)")
    print("| context | cold | pool hit | RAM hit | disk hit (restart) | pool/cold | RAM/cold "
          "| disk/cold |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for c in contexts:
        cold = med[(c, "cold")]
        print(f"| {c} | {cold * 1000:.0f} ms | {med[(c, 'pool')] * 1000:.1f} ms | "
              f"{med[(c, 'ram')] * 1000:.1f} ms | {med[(c, 'disk')] * 1000:.1f} ms | "
              f"{med[(c, 'pool')] / cold:.1%} | {med[(c, 'ram')] / cold:.1%} | "
              f"{med[(c, 'disk')] / cold:.1%} |")


if __name__ == "__main__":
    main()
