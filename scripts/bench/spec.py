#!/usr/bin/env python3
"""Speculative decoding from the context: decode speed with speculation off and on, in one run.

Three sets, every request greedy and streamed, asked twice on one server (`--spec context`):
once with "speculative": false and once with speculation on, in alternating order:

  RAG             a passage of 200-400 tokens cut from the licence texts in
                  /usr/share/common-licenses (the texts the blend benchmark uses) and a question
                  whose answer quotes or paraphrases it (repeat a part, quote what it says about
                  a word, list its points)
  free chat       questions with nothing to copy from (stories, explanations, advice)
  edit+prediction an edit of a passage ("replace X with Y, output the text") with the passage as
                  OpenAI's Predicted Outputs "prediction"

Decode speed is (completion tokens - 1) / (time from the first streamed token to the last): the
prompt's prefill is not in it. Per set: decode tokens/s off and on (the median over its
requests, so that a stall of a shared machine moves it little) and the median of each request's
on/off ratio (the two runs of a request are back to back, so a change of load between requests
cancels out), draft tokens verified and kept (usage.completion_tokens_details, kvserve's extension), the
acceptance rate, and greedy mismatches (answers that differ with speculation on: must be 0).
Then --streams concurrent RAG streams, aggregate tokens/s off and on (--load-reps pairs, which
of the two goes first alternating; medians, and each pair's ratio): from SPEC_MAX_BATCH (8)
decoding sequences on no sequence drafts, which the ratio shows.

With --draft-model FILE, the RAG and free-chat sets again on a server with that draft model
(`--draft-model`, beside the context): the same figures, and of the draft tokens those the draft
model made, how many it made and kept, and the seconds its forward calls took. SmolLM2 drafting
for itself at another quantization (`make_draft_model.py`) checks the path and its acceptance;
it cannot speed anything up, the draft costing as much as the model.

With --llama-server PATH (scripts/bench/build_llamacpp.sh builds it), the same three sets on
llama-server (one slot, --poll 0 so an idle server does not spin): two servers at once, without
speculation and with --llama-spec (its context speculation, default ngram-simple over 4-token
keys with 8-token drafts), each request sent to one then the other: its decode tokens/s off and
on, the median ratio, and its own mismatches, beside kvserve's.

    python3 scripts/bench/spec.py [--bin build/kvserve] [--model MODEL] [--threads 2]
                                  [--rag 8] [--chat 6] [--edit 3] [--max-tokens 200]
                                  [--streams 4,16] [--load-reps 3] [--json OUT] [--draft-model FILE]
                                  [--llama-server build/llamacpp/avx512/bin/llama-server]
"""
import argparse
import json
import os
import re
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

TEXTS = ["Apache-2.0", "GPL-3", "MPL-2.0", "LGPL-3", "GFDL-1.3", "Artistic", "CC0-1.0"]
RAG_QUESTIONS = [
    "Repeat the first paragraph of the document word for word.",
    "What does the document say about {word}? Quote the sentence.",
    "Copy the document exactly as it is written.",
    "List the points the document makes, using its own words.",
]
CHAT = [
    "Write a short story about a dragon who is afraid of the dark.",
    "Explain how a rainbow forms, for a ten-year-old.",
    "Give me five tips for learning to play the guitar.",
    "What are the pros and cons of working from home?",
    "Describe a perfect day at the beach.",
    "How do I make a good cup of tea?",
    "Write a poem about autumn leaves.",
    "Why is the sky blue?",
]
SYSTEM = "You are a helpful assistant. Answer from the document when one is given."


def passages(srv, n):
    """n passages of 200-400 tokens: consecutive paragraphs of the texts merged."""
    out = benchlib.license_passages(srv, TEXTS, 200, 400)
    if not out:
        sys.exit("spec bench: no texts in /usr/share/common-licenses")
    # spread over the texts: every k-th passage
    step = max(1, len(out) // n)
    return out[::step][:n]


def keyword(passage):
    words = [w for w in re.findall(r"[A-Za-z]{7,}", passage)]
    return words[len(words) // 2].lower() if words else "licence"


def rag_set(pool, n):
    items = []
    for i in range(n):
        p = pool[i % len(pool)]
        q = RAG_QUESTIONS[i % len(RAG_QUESTIONS)].format(word=keyword(p))
        items.append(({"messages": [{"role": "system", "content": SYSTEM},
                                    {"role": "user", "content": f"Document:\n{p}\n\n{q}"}]}))
    return items


def chat_set(n):
    return [{"messages": [{"role": "user", "content": CHAT[i % len(CHAT)]}]} for i in range(n)]


def edit_set(pool, n):
    items = []
    for i in range(n):
        p = pool[(i * 3 + 1) % len(pool)].split("\n\n")[0]
        w = keyword(p)
        items.append({"messages": [{"role": "user", "content":
                                    f"Text:\n{p}\n\nReplace the word \"{w}\" with \"item\" in the "
                                    "text and output the whole text, nothing else."}],
                      "prediction": {"type": "content", "content": p}})
    return items


def run_one(srv, body, spec, max_tokens):
    """(decode tokens, decode seconds, text, usage) of one streamed greedy request (spec None:
    the field is not sent, for llama-server)."""
    fields = {"speculative": spec} if spec is not None else {}
    t0, resp = srv.stream("/v1/chat/completions", {
        "model": srv.model, "stream": True, "stream_options": {"include_usage": True},
        "temperature": 0, "max_tokens": max_tokens, **fields, **body})
    t_first = t_last = None
    text, usage = "", None
    for ev in benchlib.sse_events(resp):
        if "error" in ev:
            sys.exit(f"error: {ev['error']}")
        for ch in ev.get("choices") or []:
            piece = ch.get("delta", {}).get("content")
            if piece:
                now = time.perf_counter()
                t_first = t_first or now
                t_last = now
                text += piece
        if ev.get("usage"):
            usage = ev["usage"]
    n = usage["completion_tokens"] - 1
    return n, (t_last - t_first) if t_first and t_last > t_first else 0.0, text, usage


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return 0.0 if n == 0 else xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def run_set(srv, items, max_tokens):
    """The set's figures: each item off and on, alternating which goes first."""
    tok = {False: 0, True: 0}
    rate = {False: [], True: []}
    ratios = []
    drafted = kept = pred_kept = pred_rej = mismatches = 0
    for i, body in enumerate(items):
        out = {}
        for spec in ((False, True) if i % 2 == 0 else (True, False)):
            n, s, text, usage = run_one(srv, body, spec, max_tokens)
            tok[spec] += n
            if s > 0:
                rate[spec].append(n / s)
            out[spec] = text
            rs = rate[spec][-1] if s > 0 else 0
            out[(spec, "rate")] = rs
            if spec:
                d = usage.get("completion_tokens_details") or {}
                drafted += d.get("draft_tokens", 0)
                kept += d.get("accepted_draft_tokens", 0)
                pred_kept += d.get("accepted_prediction_tokens", 0)
                pred_rej += d.get("rejected_prediction_tokens", 0)
        mismatches += out[False] != out[True]
        if out[(False, "rate")] > 0:
            ratios.append(out[(True, "rate")] / out[(False, "rate")])
    off, on = median(rate[False]), median(rate[True])
    return {"prompts": len(items), "tokens": tok[True], "off_tps": off, "on_tps": on,
            "ratio": median(ratios), "drafted": drafted, "accepted": kept,
            "acceptance": kept / drafted if drafted else 0, "pred_accepted": pred_kept,
            "pred_rejected": pred_rej, "mismatches": mismatches}


def run_llama(a, sets):
    """llama-server's decode tokens/s on each set without and with its speculation: two servers,
    each request to one and then the other."""
    servers = {}
    try:
        for spec, extra in ((False, []), (True, a.llama_spec.split())):
            servers[spec] = benchlib.LlamaServer(a.llama_server, a.model, a.threads,
                                                 ["-c", "4096", "-np", "1", "--poll", "0", *extra])
        out = {}
        for name, items in sets:
            rate = {False: [], True: []}
            ratios, mismatches = [], 0
            for i, body in enumerate(items):
                body = {k: v for k, v in body.items() if k != "prediction"}
                got = {}
                for spec in ((False, True) if i % 2 == 0 else (True, False)):
                    n, s, text, _ = run_one(servers[spec], body, None, a.max_tokens)
                    got[spec] = (n / s if s > 0 else 0, text)
                    rate[spec].append(got[spec][0])
                mismatches += got[False][1] != got[True][1]
                if got[False][0] > 0:
                    ratios.append(got[True][0] / got[False][0])
            out[name] = {"off_tps": median(rate[False]), "on_tps": median(rate[True]),
                         "ratio": median(ratios), "mismatches": mismatches}
        return out
    finally:
        for srv in servers.values():
            srv.stop()


def run_draft(a, sets):
    """The sets on a server with --draft-model: run_set's figures, and the draft model's share
    (its /health counters over the set)."""
    srv = benchlib.Server(a.bin, a.model, a.threads,
                          ["-c", "4096", "--spec", "context", "--draft-model", a.draft_model])
    rows = []
    try:
        for name, items in sets:
            h0 = srv.request("GET", "/health")[1]["speculation"]
            r = run_set(srv, items, a.max_tokens)
            h1 = srv.request("GET", "/health")[1]["speculation"]
            r["set"] = name
            for k in ("draft_model_drafted", "draft_model_accepted", "draft_model_seconds"):
                r[k] = h1[k] - h0[k]
            rows.append(r)
            print(f"{name} with the draft model: {r['off_tps']:.1f} -> {r['on_tps']:.1f} tok/s, "
                  f"acceptance {r['acceptance']:.0%}, mismatches {r['mismatches']}",
                  file=sys.stderr)
    finally:
        srv.stop()
    return rows


def run_load(srv, items, streams, spec, max_tokens):
    """Aggregate decode tokens/s of `streams` concurrent streams over items."""
    results = []

    def worker(k):
        n, _, _, _ = run_one(srv, items[k % len(items)], spec, max_tokens)
        results.append(n + 1)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(results) / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    benchlib.add_server_args(ap)
    ap.add_argument("--rag", type=int, default=8)
    ap.add_argument("--chat", type=int, default=6)
    ap.add_argument("--edit", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--streams", default="4,16")
    ap.add_argument("--load-reps", type=int, default=3,
                    help="off/on pairs per stream count (the median ratio is reported)")
    ap.add_argument("--json")
    ap.add_argument("--llama-server")
    ap.add_argument("--draft-model", help="the RAG and chat sets again with this draft model")
    ap.add_argument("--llama-spec", default="--spec-type ngram-simple --spec-ngram-simple-size-n 4 "
                    "--spec-ngram-simple-size-m 8 --spec-draft-n-max 8")
    a = ap.parse_args()
    srv = benchlib.Server(a.bin, a.model, a.threads, ["-c", "4096", "--spec", "context"])
    try:
        pool = passages(srv, max(a.rag, a.edit * 3 + 2))
        sets = [("RAG (quote/paraphrase a passage)", rag_set(pool, a.rag)),
                ("free chat", chat_set(a.chat)),
                ("edit with prediction", edit_set(pool, a.edit))]
        rows = []
        for name, items in sets:
            if not items:
                continue
            r = run_set(srv, items, a.max_tokens)
            r["set"] = name
            rows.append(r)
            print(f"{name}: {r['off_tps']:.1f} -> {r['on_tps']:.1f} tok/s "
                  f"({r['ratio']:.2f}x), acceptance {r['acceptance']:.0%}, "
                  f"mismatches {r['mismatches']}", file=sys.stderr)
        load = []
        for streams in [int(x) for x in a.streams.split(",") if x]:
            items = rag_set(pool, streams)
            pairs = []
            for rep in range(a.load_reps):
                # off and on alternate which goes first (the second finds the prompts cached)
                order = [False, True] if rep % 2 == 0 else [True, False]
                tps = {spec: run_load(srv, items, streams, spec, a.max_tokens) for spec in order}
                pairs.append((tps[False], tps[True]))
            load.append({"streams": streams,
                         "off_tps": statistics.median(p[0] for p in pairs),
                         "on_tps": statistics.median(p[1] for p in pairs),
                         "ratio": statistics.median(p[1] / p[0] for p in pairs),
                         "ratios": [round(p[1] / p[0], 3) for p in pairs]})
    finally:
        srv.stop()
    drafts = run_draft(a, sets[:2]) if a.draft_model else []
    llama = run_llama(a, sets) if a.llama_server else {}
    print(f"\nkvserve speculation from the context, {os.path.basename(a.model)}, "
          f"{a.threads} threads, greedy, max_tokens {a.max_tokens}\n")
    print("| set | prompts | tokens | decode tok/s off | on | on/off | drafted | kept "
          "| acceptance | greedy mismatches |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        extra = (f" (prediction: {r['pred_accepted']} kept, {r['pred_rejected']} rejected)"
                 if r["pred_accepted"] or r["pred_rejected"] else "")
        print(f"| {r['set']} | {r['prompts']} | {r['tokens']} | {r['off_tps']:.1f} | "
              f"{r['on_tps']:.1f} | {r['ratio']:.2f}x | {r['drafted']} | {r['accepted']}{extra} | "
              f"{r['acceptance']:.0%} | {r['mismatches']} |")
    if load:
        print("\n| RAG streams at once | aggregate tok/s off | on | on/off (median) | each pair |")
        print("| ---: | ---: | ---: | ---: | --- |")
        for r in load:
            print(f"| {r['streams']} | {r['off_tps']:.1f} | {r['on_tps']:.1f} | "
                  f"{r['ratio']:.2f}x | {', '.join(f'{x:.2f}' for x in r['ratios'])} |")
    if drafts:
        print(f"\nwith --draft-model {os.path.basename(a.draft_model)} (beside the context)\n")
        print("| set | prompts | decode tok/s off | on | on/off | drafted | kept | acceptance "
              "| by the draft model: drafted | kept | its seconds | greedy mismatches |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in drafts:
            print(f"| {r['set']} | {r['prompts']} | {r['off_tps']:.1f} | {r['on_tps']:.1f} | "
                  f"{r['ratio']:.2f}x | {r['drafted']} | {r['accepted']} | "
                  f"{r['acceptance']:.0%} | {r['draft_model_drafted']} | "
                  f"{r['draft_model_accepted']} | {r['draft_model_seconds']:.1f} | "
                  f"{r['mismatches']} |")
    if llama:
        print(f"\nllama-server, the same requests, one slot; on: {a.llama_spec}\n")
        print("| set | llama-server tok/s off | on | on/off | its mismatches | kvserve on "
              "vs llama-server on |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for r in rows:
            lr = llama.get(r["set"])
            if lr:
                print(f"| {r['set']} | {lr['off_tps']:.1f} | {lr['on_tps']:.1f} | "
                      f"{lr['ratio']:.2f}x | {lr['mismatches']} | "
                      f"{r['on_tps'] / lr['on_tps'] if lr['on_tps'] else 0:.2f}x |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"sets": rows, "load": load, "llama_server": llama, "draft_model": drafts},
                      f, indent=1)
    if any(r["mismatches"] for r in rows + drafts):
        sys.exit("greedy outputs differ with speculation")


if __name__ == "__main__":
    main()
