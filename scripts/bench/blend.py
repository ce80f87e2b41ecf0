#!/usr/bin/env python3
"""CacheBlend on a RAG set built from local texts: quality against full prefill, and TTFT.

The set: passages of 200-600 tokens cut from the licence texts in /usr/share/common-licenses
(paragraphs merged up to the length), and questions that each put 4-6 of them, shuffled, in one
user message as a RAG frontend does ("Document k:" headers, the passages, then the question),
behind a system prompt. Passages are shared between questions, so each question finds its
passages' KV computed in other contexts: first every passage is sent once alone (the RAG
database's precompute), then each question is asked by every method, in one server process,
each method in its own cache namespace (so one method's run does not feed the next's):

  full prefill    "cache": false: nothing reused (the reference)
  full reuse      "blend_ratio": 0: reused KV as is, no recompute at all
  POLICY 5..50%   "blend_policy": hkvd (CacheBlend's ranking), legolink (EPIC: the first tokens
                  of every reused run) or hybrid (up to 8 run-start tokens, then HKVD), at
                  "blend_ratio" 0.05 .. 0.50: the same budget of recomputed tokens
  server default  nothing set: what the server does for a client that asks nothing
  POLICY 100%     "blend_ratio": 1: every token computed, the reused KV only overwritten: a
                  check (its answers must be the full prefill's, 100%); only with --methods

Per method: greedy answers identical to full prefill (%), the first 8 tokens identical (%), the
first token identical (top-1 agreement), token F1 of the answer against the
full-prefill answer, mean KL(full || method) of the first token's distribution (over the top-20
logprobs of both, the rest of the mass floored), mean TTFT and its ratio to full prefill, and the
share of prompt tokens reused by content. TTFT is the time from sending the request to the first
streamed content.

The scale for those figures: "full prefill, f32" is the same full prefill on a second server
with --precise (f32 matmuls instead of 8-bit activations), a change of rounding only. Where it
already moves answers, no reuse can be expected to keep them word for word.

Then the issue's speed case: prompts of 6 passages of 480-560 tokens, each asked as a full
prefill, blended at 15% from RAM, and blended at 15% after a restart, the passages' KV read from
the disk tier layer by layer during the pass (median TTFT of --six prompts).

    python3 scripts/bench/blend.py [--bin build/kvserve] [--model MODEL] [--questions 50]
                                   [--max-tokens 24] [--seed 1] [--six 6] [--policies ...]
                                   [--ratios 0.05,0.15,...] [--json OUT] [--plot OUT.png]
"""
import argparse
import json
import math
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import time

import benchlib
from benchlib import ROOT
TEXTS = ["GPL-3", "Apache-2.0", "MPL-2.0", "GPL-2", "LGPL-2.1", "GFDL-1.3", "Artistic",
         "LGPL-3", "MPL-1.1", "CC0-1.0"]
SYSTEM = "You are a helpful assistant. Answer the question using only the documents."
ASK = [
    "Quote the sentence that comes right after \"{frag}\".",
    "Which document says \"{frag}\", and what does it say next?",
    "Summarize Document {k} in one sentence.",
    "What does Document {k} say about {word}?",
    "Compare what Document {k} and Document {k2} say.",
    "List the main obligations in Document {k}.",
]
POLICIES = ["hkvd", "legolink", "hybrid"]
RATIOS = [0.05, 0.15, 0.30, 0.50]


def methods_for(policies, ratios):
    """(name, request fields) of every method: the reference first."""
    out = [("full prefill", {"cache": False}), ("full reuse (0%)", {"blend_ratio": 0.0})]
    out += [(f"{p} {round(100 * r)}%", {"blend_ratio": r, "blend_policy": p})
            for p in policies for r in ratios]
    out += [("server default", {}), ("hkvd 100%", {"blend_ratio": 1.0, "blend_policy": "hkvd"}),
            ("legolink 100%", {"blend_ratio": 1.0, "blend_policy": "legolink"})]
    return out
TOP = 20


class Server(benchlib.Server):
    def __init__(self, args, extra=(), cache_dir="off"):
        # every method's namespace holds every passage
        super().__init__(args.bin, args.model, args.threads,
                         ["-c", "8192", "--cache-dir", cache_dir, "--blend-ram-bytes", "8G",
                          *extra])

    def chat(self, messages, max_tokens, extra):
        """(seconds to the first content, text, first token's top logprobs, usage, tokens)."""
        return self.chat_stream({
            "messages": messages, "max_tokens": max_tokens, "temperature": 0, "logprobs": True,
            "top_logprobs": TOP, "stream_options": {"include_usage": True}, **extra})


def passages(srv):
    """Passages of 200-600 tokens: consecutive paragraphs of each text merged."""
    return benchlib.license_passages(srv, TEXTS, 200, 600)


def question_set(pool, n, rng):
    qs = []
    for _ in range(n):
        docs = rng.sample(range(len(pool)), rng.randint(4, 6))
        k = rng.randrange(len(docs))
        k2 = (k + 1 + rng.randrange(len(docs) - 1)) % len(docs)
        sents = [s for s in re.split(r"(?<=[.;:])\s+", pool[docs[k]]) if len(s.split()) >= 8]
        sent = rng.choice(sents) if sents else pool[docs[k]][:80]
        words = sent.split()
        frag = " ".join(words[:min(len(words) - 1, 8)])
        word = rng.choice([w.strip(".,;:()\"") for w in words if len(w) > 5] or ["the licence"])
        q = rng.choice(ASK).format(frag=frag, k=k + 1, k2=k2 + 1, word=word)
        qs.append((docs, q))
    return qs


def messages(pool, docs, question):
    body = "\n\n".join(f"Document {i + 1}:\n{pool[d]}" for i, d in enumerate(docs))
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{body}\n\nQuestion: {question}"}]


def f1(a, b):
    ta, tb = a.split(), b.split()
    if not ta and not tb:
        return 1.0
    common = 0
    rest = list(tb)
    for t in ta:
        if t in rest:
            rest.remove(t)
            common += 1
    if common == 0:
        return 0.0
    p, r = common / len(ta), common / len(tb)
    return 2 * p * r / (p + r)


def kl(p_lp, q_lp):
    """KL(p || q) over the union of both top-k lists; a token missing from a list gets the
    smaller of its list's least logprob and the mass that list leaves out."""
    def floor(lp):
        rest = 1 - sum(math.exp(v) for v in lp.values())
        return min(min(lp.values()), math.log(max(rest, 1e-12)))
    fp, fq = floor(p_lp), floor(q_lp)
    keys = set(p_lp) | set(q_lp)
    p = {k: math.exp(p_lp.get(k, fp)) for k in keys}
    q = {k: math.exp(q_lp.get(k, fq)) for k in keys}
    zp, zq = sum(p.values()), sum(q.values())
    return sum(p[k] / zp * math.log((p[k] / zp) / (q[k] / zq)) for k in keys)


def passage_lengths(srv, pool):
    out = []
    for p in pool:
        st, body = srv.request("POST", "/tokenize", {"content": p, "add_special": False})
        assert st == 200, body
        out.append(len(body["tokens"]))
    return out


def six_passages(args, pool, lengths):
    """TTFT of prompts of 6 passages of 480-560 tokens: full prefill, then blended from RAM with
    the server's default setting (what a client that asks nothing gets) and with --six-fields
    (default hkvd at 15%), and both from the disk tier after a restart. Returns the rows of a
    table."""
    big = [i for i, n in enumerate(lengths) if 480 <= n <= 560]
    rng = random.Random(args.seed + 7)
    sets = [rng.sample(big, 6) for _ in range(args.six)]
    cache_dir = tempfile.mkdtemp(prefix="kvserve-bench-blend-")
    chosen = json.loads(args.six_fields)
    label = ", ".join(f"{k} {v}" for k, v in chosen.items())
    setups = [("server default", {}), (label, chosen)]
    times = {"full": []}
    n_tok = []
    extra = args.server_args.split()
    try:
        srv = Server(args, extra, cache_dir=cache_dir)
        for d in sorted({d for s in sets for d in s}):
            srv.chat(precompute_turn(pool[d]), 1, {})
        # one unmeasured request of the same shape first (page faults of a fresh KV pool)
        srv.chat(messages(pool, sets[0], "Warm up."), 1, {"cache": False})
        for s in sets:
            msgs = messages(pool, s, "Summarize Document 3 in one sentence.")
            t, _, _, u, _ = srv.chat(msgs, 1, {"cache": False})
            times["full"].append(t)
            n_tok.append(u["prompt_tokens"])
            for si, (name, fields) in enumerate(setups):
                t, _, _, u, _ = srv.chat(msgs, 1, {**fields, "cache_salt": f"s{si}"})
                times.setdefault(f"{name}, passages in RAM", []).append(t)
        srv.stop()
        # the disk copies stay; RAM starts empty: every passage comes from disk
        srv = Server(args, extra, cache_dir=cache_dir)
        srv.chat(messages(pool, sets[0], "Warm up."), 1, {"cache": False, "cache_salt": "w"})
        for s in sets:
            msgs = messages(pool, s, "What does Document 2 say first?")
            for si, (name, fields) in enumerate(setups):
                t, _, _, u, _ = srv.chat(msgs, 1, {**fields, "cache_salt": f"s{si}"})
                times.setdefault(f"{name}, passages on disk (after a restart)", []).append(t)
        srv.stop()
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    full = statistics.median(times.pop("full"))
    rows = [("full prefill", full)] + [(k, statistics.median(v)) for k, v in times.items()]
    return statistics.mean(n_tok), [(name, t, full / t) for name, t in rows]


def precompute_turn(passage):
    """The RAG database's precompute of one passage: sent once, alone."""
    return [{"role": "user", "content": f"Document 1:\n{passage}"}]


def measure(srv, precise, items, methods, max_tokens, log=sys.stderr, default_srv=None):
    """Every method's rows over items [(messages, passages)]: each method in its own cache
    namespace (cache_salt), so what one method's run of a prompt stores (its question, its
    headers) is not reused by the next method's run of the same prompt; in each, the RAG
    database's precompute first (every passage once, alone). methods[0] is the reference (a full
    prefill); "full prefill, f32" is the same prompts on `precise` (--precise): the floor. The
    method named "server default" runs on default_srv (a server with its defaults) when given."""
    def target(name):
        return default_srv if default_srv and name == "server default" else srv

    passages_used = list(dict.fromkeys(p for _, ps in items for p in ps))
    for mi, (name, extra) in enumerate(methods):
        if "cache" not in extra:
            for p in passages_used:
                target(name).chat(precompute_turn(p), 1, {"cache_salt": f"m{mi}"})
    res = {name: [] for name, _ in methods}
    res["full prefill, f32"] = []
    for qi, (msgs, _) in enumerate(items):
        ref = None
        for mi, (name, extra) in enumerate(methods):
            t, text, lp, usage, toks = target(name).chat(msgs, max_tokens,
                                                         {**extra, "cache_salt": f"m{mi}"})
            det = usage["prompt_tokens_details"]
            row = {"t": t, "text": text, "lp": lp, "n": usage["prompt_tokens"], "toks": toks,
                   "blended": det.get("blended_tokens", 0), "cached": det.get("cached_tokens", 0)}
            if ref is None:
                ref = row
            row["same"] = text == ref["text"]
            row["same8"] = toks[:8] == ref["toks"][:8]
            row["top1"] = toks[:1] == ref["toks"][:1]
            row["f1"] = f1(text, ref["text"])
            row["kl"] = kl(ref["lp"], lp) if ref["lp"] and lp else float("nan")
            res[name].append(row)
        t, text, lp, usage, toks = precise.chat(msgs, max_tokens, {"cache": False})
        res["full prefill, f32"].append(
            {"t": t, "text": text, "n": usage["prompt_tokens"], "blended": 0,
             "same": text == ref["text"], "same8": toks[:8] == ref["toks"][:8],
             "top1": toks[:1] == ref["toks"][:1],
             "f1": f1(text, ref["text"]), "kl": kl(ref["lp"], lp)})
        if log:
            print(f"prompt {qi + 1}/{len(items)}: {ref['n']} tokens", file=log)
    return res


def summary(rows, full_t):
    """The table's figures of one method's rows."""
    kls = [r["kl"] for r in rows if not math.isnan(r["kl"])]
    t = statistics.mean(r["t"] for r in rows)
    return {"same": sum(r["same"] for r in rows) / len(rows),
            "same8": sum(r["same8"] for r in rows) / len(rows),
            "top1": sum(r["top1"] for r in rows) / len(rows),
            "f1": statistics.mean(r["f1"] for r in rows),
            "kl": statistics.mean(kls) if kls else float("nan"),
            "t": t, "speedup": full_t / t,
            "blended": sum(r["blended"] for r in rows) / sum(r["n"] for r in rows)}


def plot(table, path):
    """The frontier of a bench run's table (plot_points)."""
    points = [{"policy": k.split(" ")[0], "kl": v["kl"], "speedup": v["speedup"]}
              for k, v in table.items() if k.split(" ")[0] in POLICIES and not k.endswith(" 100%")]
    full = table.get("full reuse (0%)")
    plot_points(points, table["full prefill, f32"]["kl"], path,
                (full["speedup"], full["kl"]) if full else None)


def plot_points(points, floor_kl, path, full_reuse=None, title=""):
    """The frontier: first-token KL against TTFT speed-up per policy (points: dicts with policy,
    kl, speedup), the floor and the floor budget's bound (2x) as lines."""
    try:
        import matplotlib
    except ImportError:
        sys.exit("the plot needs matplotlib: python3 -m pip install matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for pol in POLICIES:
        pts = sorted((p["speedup"], p["kl"]) for p in points if p["policy"] == pol)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=pol)
    if full_reuse:
        ax.plot([full_reuse[0]], [full_reuse[1]], "kx", label="full reuse")
    ax.axhline(floor_kl, color="grey", ls="--", label="floor (rounding only)")
    ax.axhline(2 * floor_kl, color="grey", ls=":", label="2x floor (--reuse-quality floor)")
    ax.set_xlabel("TTFT speed-up over full prefill")
    ax.set_ylabel("first-token KL against full prefill")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title(title or "blend: quality against speed per selection policy")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    benchlib.add_server_args(ap)
    ap.add_argument("--questions", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--ratios", default=",".join(str(r) for r in RATIOS))
    ap.add_argument("--methods", default="",
                    help="comma-separated method names to run (full prefill always runs)")
    ap.add_argument("--server-args", default="",
                    help="extra options for the server (its defaults are measured as they are)")
    ap.add_argument("--json", default="", help="write every method's figures here")
    ap.add_argument("--plot", default="", help="draw the frontier here (PNG, needs matplotlib)")
    ap.add_argument("--six", type=int, default=6,
                    help="prompts of 6 passages x ~512 tokens for the TTFT case (0: skip)")
    ap.add_argument("--six-fields", default='{"blend_policy": "hkvd", "blend_ratio": 0.15}',
                    help="request fields of the TTFT case's second blended row (JSON)")
    args = ap.parse_args()
    every = methods_for([p for p in args.policies.split(",") if p],
                        [float(r) for r in args.ratios.split(",") if r])
    # the 100% checks run when named
    methods = [m for m in every if m[0] == "full prefill" or
               (m[0] in args.methods.split(",") if args.methods else not m[0].endswith(" 100%"))]

    srv = Server(args, ["--reuse-quality", "none", *args.server_args.split()])
    try:
        pool = passages(srv)
        rng = random.Random(args.seed)
        qs = question_set(pool, args.questions, rng)
        used = sorted({d for docs, _ in qs for d in docs})
        print(f"{len(pool)} passages, {len(used)} used by {len(qs)} questions", file=sys.stderr)
        items = [(messages(pool, docs, q), [pool[d] for d in docs]) for docs, q in qs]
        precise = Server(args, ["--precise"])
        # the server as a user starts it: its quality budget and the model's calibration
        dflt = Server(args, args.server_args.split())
        res = measure(srv, precise, items, methods, args.max_tokens, default_srv=dflt)
        dflt.stop()
        precise.stop()
        full_t = statistics.mean(r["t"] for r in res["full prefill"])
        print(f"\n{len(qs)} questions, 4-6 passages of 200-600 tokens each, mean prompt "
              f"{statistics.mean(r['n'] for r in res['full prefill']):.0f} tokens; "
              f"{args.max_tokens} greedy tokens\n")
        print("| method | identical answer | identical first 8 tokens | top-1 | token F1 | "
              "KL first token | TTFT s | speed-up | blended tokens |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        table = {}
        for name in [methods[0][0], "full prefill, f32"] + [m[0] for m in methods[1:]]:
            v = table[name] = summary(res[name], full_t)
            print(f"| {name} | {100 * v['same']:.0f}% | {100 * v['same8']:.0f}% | "
                  f"{100 * v['top1']:.0f}% | {v['f1']:.3f} | {v['kl']:.4f} | {v['t']:.2f} | "
                  f"{v['speedup']:.2f}x | {100 * v['blended']:.0f}% |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"questions": len(qs), "max_tokens": args.max_tokens,
                           "methods": table}, f, indent=1)
        if args.plot:
            plot(table, args.plot)
            print(f"\nfrontier drawn in {args.plot}")
        if args.six:
            lengths = passage_lengths(srv, pool)
            srv.stop()
            mean_tok, rows = six_passages(args, pool, lengths)
            print(f"\nTTFT, {args.six} prompts of 6 passages of 480-560 tokens (mean "
                  f"{mean_tok:.0f} tokens), median:\n")
            print("| prompt | TTFT s | speed-up |")
            print("| --- | ---: | ---: |")
            for name, t, x in rows:
                print(f"| {name} | {t:.2f} | {x:.2f}x |")
    finally:
        srv.stop()


if __name__ == "__main__":
    main()
