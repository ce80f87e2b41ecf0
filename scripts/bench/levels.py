#!/usr/bin/env python3
"""The local tiers that hold encodings (issue 16): what each encoding saves in room, costs in time
to first token and changes in the answers, against exact reuse and a full prefill.

  RAM   --cache-ram-encoding ENC (no disk tier): the RAM tier holds each chunk in ENC. Per
        encoding, a fresh server computes a system prompt of about --context tokens of licence
        text with a first question, waits until its RAM tier's encoder has swapped the chunks
        for their encoding, then, for each of --questions new questions, clears the pool (so the
        chunks come from RAM) and sends the question twice: with "cache": false (a full prefill:
        the reference) and with the cache. Reported: RAM bytes per chunk and the room it makes
        (chunks held in the same --cache-ram-bytes, against lossless), warm TTFT (median) and
        warm/cold, and quality against the full prefill: greedy answers of --max-tokens tokens
        identical, and the first token the same.
  disk  --cache-disk-encoded, --cache-ram-bytes 0 (every reuse reads the disk, O_DIRECT): one
        server computes the system prompt, waits until every encoding's file is written, then
        the same questions with "kv_level" forcing each encoding, and adaptive under
        "ttft_budget_ms" (a tight budget no level meets, and a loose one). Reported: bytes per
        chunk on disk, warm TTFT and warm/cold, the levels the reads took, and quality.

Requests say "blend": false (this measures prefix reuse). All runs are in one process against
one binary; medians and ratios, since machines here are shared and noisy. The model's codec
table is made first when missing or older than the binary (`kvserve calibrate`).

    python3 scripts/bench/levels.py [--bin build/kvserve] [--model MODEL] [--threads 2]
                                    [--context 2000] [--questions 6] [--max-tokens 16]
"""
import argparse
import glob
import os
import shutil
import statistics
import sys
import tempfile
import time

import benchlib
import codec
from ttft import QUESTIONS, licence_text, system_prompt

RAM_LEVELS = ["lossless", "q8", "codec0", "codec1", "codec2", "codec3"]
EXTRA_QUESTIONS = ["Who may change the terms of this licence?",
                   "Can I combine this program with code under another licence?",
                   "What counts as the source code of a work?",
                   "Must I give recipients the same rights I received?"]


def ask(srv, sysmsg, question, max_tokens, **fields):
    """(seconds to the first content, text, usage) of a greedy streamed chat request."""
    t, text, _, usage, _ = srv.chat_stream({
        "messages": [sysmsg, {"role": "user", "content": question}], "max_tokens": max_tokens,
        "temperature": 0, "blend": False, "stream_options": {"include_usage": True}, **fields})
    return t, text, usage


def tier(srv, name):
    st, body = srv.request("GET", "/v1/cache/stats")
    assert st == 200, body
    return body["tiers"][name]


def wait_steady(read, seconds=120):
    """Polls read() until it has not changed for 2 s; returns its value."""
    deadline, last, since = time.monotonic() + seconds, None, time.monotonic()
    while time.monotonic() < deadline:
        now = read()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since > 2:
            return now
        time.sleep(0.2)
    sys.exit("the encoder did not settle")


def run_questions(srv, sysmsg, questions, max_tokens, **fields):
    """Per question: cold (cache off) then warm (pool cleared first). Returns a dict of lists."""
    out = {"cold": [], "warm": [], "same": 0, "first": 0, "levels": []}
    for q in questions:
        srv.request("POST", "/v1/cache/clear", {"tiers": ["pool"]})
        t_cold, ref, _ = ask(srv, sysmsg, q, max_tokens, cache=False)
        srv.request("POST", "/v1/cache/clear", {"tiers": ["pool"]})
        t_warm, text, usage = ask(srv, sysmsg, q, max_tokens, **fields)
        if not usage["prompt_tokens_details"]["cached_tokens"]:
            sys.exit(f"nothing reused for {q!r}: {usage}")
        out["cold"].append(t_cold)
        out["warm"].append(t_warm)
        out["same"] += text == ref
        out["first"] += text.split(" ")[:1] == ref.split(" ")[:1]
        out["levels"] += [c["level"] for c in usage.get("kv_chunks", [])]
    return out


def row(cells, r, n):
    cold, warm = statistics.median(r["cold"]), statistics.median(r["warm"])
    levels = sorted(set(r["levels"]))
    print(f"| {' | '.join(cells)} | {', '.join(levels)} | {warm * 1000:.0f} ms | "
          f"{warm / cold:.1%} | {r['same']}/{n} | {r['first']}/{n} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    benchlib.add_server_args(ap)
    ap.add_argument("--context", type=int, default=2000, help="system prompt tokens (about)")
    ap.add_argument("--questions", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    questions = (QUESTIONS + EXTRA_QUESTIONS)[:args.questions]
    n = len(questions)
    codec.calibrate_if_stale(args.bin, args.model, args.threads)
    text = licence_text()
    ctx = ["-c", str(args.context + 512)]
    work = tempfile.mkdtemp(prefix="kvserve-levels-")
    srv = None
    ram_rows, disk_rows = [], []
    try:
        # RAM: one server per encoding, no disk tier
        for level in RAM_LEVELS:
            srv = benchlib.Server(args.bin, args.model, args.threads,
                                  [*ctx, "--cache-dir", "off", "--cache-ram-encoding", level])
            sysmsg = {"role": "system",
                      "content": system_prompt(srv, text, args.context, f"ram {level}")}
            ask(srv, sysmsg, "Summarize the first licence in one sentence.", 4)
            ram = wait_steady(lambda: (tier(srv, "ram")["bytes"], tier(srv, "ram")["entries"]))
            r = run_questions(srv, sysmsg, questions, args.max_tokens)
            ram_rows.append((level, ram[0] / ram[1], r))
            srv.stop()
            srv = None
            print(f"RAM {level} done", file=sys.stderr)
        # disk: one server, every encoding on disk, no RAM tier
        cache_dir = os.path.join(work, "disk")
        srv = benchlib.Server(args.bin, args.model, args.threads,
                              [*ctx, "--cache-dir", cache_dir, "--cache-ram-bytes", "0",
                               "--cache-disk-encoded"])
        sysmsg = {"role": "system", "content": system_prompt(srv, text, args.context, "disk")}
        ask(srv, sysmsg, "Summarize the first licence in one sentence.", 4)
        wait_steady(lambda: len(glob.glob(os.path.join(cache_dir, "*", "*.kvc"))))
        sizes = {}
        for path in glob.glob(os.path.join(cache_dir, "*", "*.kvc")):
            name = os.path.basename(path)[64:]
            enc = "lossless" if name == ".kvc" else name[1:].split(".")[0].split("-")[0]
            sizes.setdefault(enc, []).append(os.path.getsize(path))
        names = {"e1": "q8", **{f"e{2 + i}": f"codec{i}" for i in range(8)}}
        sizes = {names.get(k, k): statistics.mean(v) for k, v in sizes.items()}
        modes = [(lv, {"kv_level": lv}) for lv in RAM_LEVELS if lv in sizes]
        modes += [("adaptive, budget 1 ms", {"ttft_budget_ms": 1}),
                  ("adaptive, budget 5 s", {"ttft_budget_ms": 5000})]
        for name, fields in modes:
            r = run_questions(srv, sysmsg, questions, args.max_tokens, **fields)
            disk_rows.append((name, sizes.get(name), r))
            print(f"disk {name} done", file=sys.stderr)
    finally:
        if srv:
            srv.stop()
        shutil.rmtree(work, ignore_errors=True)

    model = os.path.basename(args.model)[:-len(".gguf")]
    print(f"Encoded local tiers: a system prompt of about {args.context} tokens, {n} new "
          f"questions each (model {model}, {args.threads} threads; warm: TTFT median, chunks "
          f"from the tier; quality: {args.max_tokens}-token greedy answers against a full "
          f"prefill)")
    print()
    print("RAM tier (--cache-ram-encoding)")
    print("| encoding | bytes per chunk | chunks per GiB | levels read | warm TTFT | warm/cold "
          "| identical answers | same first word |")
    print("|---|---:|---:|---|---:|---:|---:|---:|")
    for level, size, r in ram_rows:
        row([level, f"{size / 1024:.0f} KiB", f"{(1 << 30) / size:.0f}"], r, n)
    print()
    print("disk tier (--cache-disk-encoded, no RAM tier)")
    print("| read as | file bytes per chunk | levels read | warm TTFT | warm/cold "
          "| identical answers | same first word |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for name, size, r in disk_rows:
        row([name, f"{size / 1024:.0f} KiB" if size else ""], r, n)


if __name__ == "__main__":
    main()
