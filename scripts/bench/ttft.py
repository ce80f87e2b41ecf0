#!/usr/bin/env python3
"""Time to first token with the context cache on real prompts: a long system prompt of real
text (licence texts from /usr/share/common-licenses) through the model's chat template, at
lengths that are not multiples of the chunk or the KV block, then

  new question, pool   the same system prompt with a question never asked: its blocks are in
                       the KV pool, appended by reference
  new question, RAM    another new question after POST /v1/cache/clear {"tiers": ["pool"]}:
                       the blocks are copied in from the RAM tier (the trailing partial chunk
                       too)
  next turn            the first question, the model's answer and a follow-up: the prefix
                       cached now includes the previous turn (answer tokens computed as
                       generated)
  new question, disk   after restarting the server on the same cache directory: read from disk
                       (O_DIRECT where the filesystem allows, so not from the page cache)
  another instance,    a second server with an empty cache directory and the same Redis (a
  Redis                redis-server the script starts on a free port, when one is installed;
                       --no-redis leaves it out): read from Redis over loopback TCP

Each warm request is compared with the same request sent with "cache": false right before it
(its cold run): TTFT ratio warm/cold, and the greedy output (8 tokens) must be identical. TTFT
is the time from sending the request to the first streamed content. Every length uses its own
system prompt (a session tag in front), never seen by the cache before. Requests say "blend":
false: the prompts of different lengths are cut from the same text, which blend would find by
content (make bench-blend measures that); this measures exact reuse. All runs are in one
process against one server binary; the table gives medians of --reps and ratios, since
machines here are shared and noisy.

    python3 scripts/bench/ttft.py [--bin build/kvserve] [--model MODEL] [--threads 2]
                                  [--contexts 1000,2000,4000,8000] [--reps 2] [--no-redis]
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import benchlib
from benchlib import ROOT
LICENCES = ["GPL-3", "Apache-2.0", "MPL-2.0", "GPL-2", "LGPL-2.1"]
QUESTIONS = ["Can I sell copies of software under this licence?",
             "What must I include when I distribute the program in object code form?",
             "Does the licence give me any patent rights?",
             "What happens if I violate the terms?",
             "Is there any warranty for the program?"]
FOLLOW_UP = "And does that also apply to modified versions?"
MAX_TOKENS = 8


class Server(benchlib.Server):
    def __init__(self, args, cache_dir, redis=None):
        super().__init__(args.bin, args.model, args.threads,
                         ["-c", str(args.ctx), "--cache-dir", cache_dir,
                          *(["--redis", redis.url] if redis else [])])

    def chat(self, messages, cache=True):
        """(seconds to the first content, whole text, prompt_tokens, cached_tokens)."""
        t_first, text, _, usage, _ = self.chat_stream({
            "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "cache": cache,
            "blend": False, "stream_options": {"include_usage": True}})
        return (t_first, text, usage["prompt_tokens"],
                usage["prompt_tokens_details"]["cached_tokens"])


class Redis:
    """A redis-server child on a free loopback port, without persistence."""

    def __init__(self, directory):
        self.port = benchlib.free_port()
        self.url = f"redis://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", directory],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.5)
        if self.proc.poll() is not None:
            sys.exit("redis-server exited at start")

    def stop(self):
        self.proc.kill()
        self.proc.wait()


def licence_text():
    parts = []
    for name in LICENCES:
        with open(os.path.join("/usr/share/common-licenses", name), encoding="utf-8") as f:
            parts.append(f.read())
    return "\n\n".join(parts)


def system_prompt(srv, text, n_tokens, tag):
    """A system prompt of about n_tokens tokens: the tag, then whole words of text."""
    words = text.split(" ")
    lo, hi = 1, len(words)
    while lo < hi:  # the most words whose tokens fit n_tokens
        mid = (lo + hi + 1) // 2
        s = f"[{tag}] You answer questions about these licences.\n\n" + " ".join(words[:mid])
        st, body = srv.request("POST", "/tokenize", {"content": s, "add_special": False})
        assert st == 200, body
        if len(body["tokens"]) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    return f"[{tag}] You answer questions about these licences.\n\n" + " ".join(words[:lo])


def measure(srv, messages, times, key):
    """Cold (cache off) then warm: records both times, checks the outputs are identical and
    returns (prompt tokens, cached tokens, answer)."""
    t_cold, ref, n_prompt, cached = srv.chat(messages, cache=False)
    assert cached == 0, cached
    t_warm, text, n_prompt2, cached = srv.chat(messages)
    assert n_prompt2 == n_prompt
    if text != ref:
        sys.exit(f"{key}: cached output {text!r} differs from uncached {ref!r}")
    times.setdefault(key, []).append((t_cold, t_warm, n_prompt, cached))
    return n_prompt, cached, text


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    benchlib.add_server_args(ap)
    ap.add_argument("--contexts", default="1000,2000,4000,8000",
                    help="system prompt lengths in tokens (about)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--no-redis", action="store_true",
                    help="leave out the second instance reading from Redis")
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    args.ctx = max(contexts) + 512
    text = licence_text()
    cache_dir = tempfile.mkdtemp(prefix="kvserve-ttft-")
    redis = None
    if not args.no_redis and shutil.which("redis-server"):
        redis = Redis(cache_dir)
    elif not args.no_redis:
        print("redis-server not found: the Redis case is left out", file=sys.stderr)
    kinds = ["pool", "ram", "turn", "disk"] + (["redis"] if redis else [])
    srv = Server(args, os.path.join(cache_dir, "a"), redis)
    times = {}
    try:
        for rep in range(args.reps):
            systems = {c: system_prompt(srv, text, c, f"session {rep}.{c}") for c in contexts}
            convo = {}
            for c in contexts:
                sysmsg = {"role": "system", "content": systems[c]}
                q = [{"role": "user", "content": s} for s in QUESTIONS]
                # the first question primes the cache (its prompt is cold)
                _, answer, _, cached = srv.chat([sysmsg, q[0]])
                assert cached == 0, cached
                convo[c] = [sysmsg, q[0], {"role": "assistant", "content": answer},
                            {"role": "user", "content": FOLLOW_UP}]
                measure(srv, [sysmsg, q[1]], times, (c, "pool"))
                srv.request("POST", "/v1/cache/clear", {"tiers": ["pool"]})
                measure(srv, [sysmsg, q[2]], times, (c, "ram"))
                measure(srv, convo[c], times, (c, "turn"))
            srv.stop()  # finishes the queued disk (and Redis) writes
            srv = Server(args, os.path.join(cache_dir, "a"), redis)
            for c in contexts:
                sysmsg = {"role": "system", "content": systems[c]}
                measure(srv, [sysmsg, {"role": "user", "content": QUESTIONS[3]}], times,
                        (c, "disk"))
            if redis:
                # another instance, its own (empty) cache directory, the same Redis
                srv.stop()
                srv = Server(args, os.path.join(cache_dir, f"b{rep}"), redis)
                for c in contexts:
                    sysmsg = {"role": "system", "content": systems[c]}
                    measure(srv, [sysmsg, {"role": "user", "content": QUESTIONS[4]}], times,
                            (c, "redis"))
                srv.stop()
                srv = Server(args, os.path.join(cache_dir, "a"), redis)
            print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr)
    finally:
        srv.stop()
        if redis:
            redis.stop()
        shutil.rmtree(cache_dir, ignore_errors=True)

    model = os.path.basename(args.model)[:-len(".gguf")]
    print(f"TTFT warm vs cold (the same request with \"cache\": false), median of {args.reps} "
          f"(model {model}, {args.threads} threads, chat template, {MAX_TOKENS} tokens "
          f"generated, identical with and without the cache)")
    print("| system prompt | case | prompt tokens | reused | cold | warm | warm/cold |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    names = {"pool": "new question, pool", "ram": "new question, RAM",
             "turn": "next turn, pool", "disk": "new question, disk (restart)",
             "redis": "another instance, Redis"}
    for c in contexts:
        for kind in kinds:
            runs = times[(c, kind)]
            cold = statistics.median(r[0] for r in runs)
            warm = statistics.median(r[1] for r in runs)
            n_prompt, cached = runs[-1][2], runs[-1][3]
            print(f"| {c} | {names[kind]} | {n_prompt} | {cached} | {cold * 1000:.0f} ms | "
                  f"{warm * 1000:.1f} ms | {warm / cold:.1%} |")


if __name__ == "__main__":
    main()
