#!/usr/bin/env python3
"""CacheBlend on a RAG set built from local texts: quality against full prefill, and TTFT.

The set: passages of 200-600 tokens cut from the licence texts in /usr/share/common-licenses
(paragraphs merged up to the length), and questions that each put 4-6 of them, shuffled, in one
user message as a RAG frontend does ("Document k:" headers, the passages, then the question),
behind a system prompt. Passages are shared between questions, so each question finds its
passages' KV computed in other contexts: first every passage is sent once alone (the RAG
database's precompute), then each question is asked by every method, in one server process,
each method in its own cache namespace (so one method's run does not feed the next's):

  full prefill   "cache": false: nothing reused (the reference)
  full reuse     "blend_ratio": 0: reused KV as is, no recompute at all
  blend 5..30%   "blend_ratio": 0.05 .. 0.30
  controller     no ratio: the server's loading controller picks (floor --blend-recompute)
  blend 100%     "blend_ratio": 1: every token computed, the reused KV only overwritten: a
                 check (its answers must be the full prefill's, 100%); only with --methods

Per method: greedy answers identical to full prefill (%), token F1 of the answer against the
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
                                   [--max-tokens 24] [--seed 1] [--six 6]
"""
import argparse
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
METHODS = [("full prefill", {"cache": False}), ("full reuse (0%)", {"blend_ratio": 0.0}),
           ("blend 5%", {"blend_ratio": 0.05}), ("blend 10%", {"blend_ratio": 0.10}),
           ("blend 15%", {"blend_ratio": 0.15}), ("blend 30%", {"blend_ratio": 0.30}),
           ("controller", {}), ("blend 100%", {"blend_ratio": 1.0})]
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
    out = []
    for name in TEXTS:
        path = os.path.join("/usr/share/common-licenses", name)
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            paras = [p.strip() for p in re.split(r"\n\s*\n", f.read()) if p.strip()]
        cur, n_cur = [], 0
        for p in paras:
            st, body = srv.request("POST", "/tokenize", {"content": p, "add_special": False})
            assert st == 200, body
            n = len(body["tokens"])
            if n > 600:
                continue
            if n_cur + n > 600:
                if n_cur >= 200:
                    out.append("\n\n".join(cur))
                cur, n_cur = [], 0
            cur.append(p)
            n_cur += n
        if n_cur >= 200:
            out.append("\n\n".join(cur))
    return out


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
    """TTFT of prompts of 6 passages of 480-560 tokens: full prefill, blend 15% from RAM, and
    blend 15% from the disk tier after a restart. Returns the rows of a table."""
    big = [i for i, n in enumerate(lengths) if 480 <= n <= 560]
    rng = random.Random(args.seed + 7)
    sets = [rng.sample(big, 6) for _ in range(args.six)]
    cache_dir = tempfile.mkdtemp(prefix="kvserve-bench-blend-")
    times = {"full": [], "ram": [], "disk": []}
    n_tok = []
    try:
        srv = Server(args, cache_dir=cache_dir)
        for d in sorted({d for s in sets for d in s}):
            srv.chat([{"role": "user", "content": f"Document 1:\n{pool[d]}"}], 1, {})
        # one unmeasured request of the same shape first (page faults of a fresh KV pool)
        srv.chat(messages(pool, sets[0], "Warm up."), 1, {"cache": False})
        for s in sets:
            msgs = messages(pool, s, "Summarize Document 3 in one sentence.")
            t, _, _, u, _ = srv.chat(msgs, 1, {"cache": False})
            times["full"].append(t)
            n_tok.append(u["prompt_tokens"])
            t, _, _, u, _ = srv.chat(msgs, 1, {"blend_ratio": 0.15})
            times["ram"].append(t)
        srv.stop()
        # the disk copies stay; RAM starts empty: every passage comes from disk
        srv = Server(args, cache_dir=cache_dir)
        srv.chat(messages(pool, sets[0], "Warm up."), 1, {"cache": False, "cache_salt": "w"})
        for s in sets:
            msgs = messages(pool, s, "What does Document 2 say first?")
            t, _, _, u, _ = srv.chat(msgs, 1, {"blend_ratio": 0.15})
            times["disk"].append(t)
        srv.stop()
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    full = statistics.median(times["full"])
    rows = [("full prefill", full), ("blend 15%, passages in RAM", statistics.median(times["ram"])),
            ("blend 15%, passages on disk (after a restart)", statistics.median(times["disk"]))]
    return statistics.mean(n_tok), [(name, t, full / t) for name, t in rows]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    benchlib.add_server_args(ap)
    ap.add_argument("--questions", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--methods", default="",
                    help="comma-separated method names to run (full prefill always runs)")
    ap.add_argument("--six", type=int, default=6,
                    help="prompts of 6 passages x ~512 tokens for the TTFT case (0: skip)")
    args = ap.parse_args()
    # the 100% check runs when named
    methods = [m for m in METHODS if m[0] == "full prefill" or
               (m[0] in args.methods.split(",") if args.methods else m[0] != "blend 100%")]

    srv = Server(args)
    try:
        pool = passages(srv)
        rng = random.Random(args.seed)
        qs = question_set(pool, args.questions, rng)
        used = sorted({d for docs, _ in qs for d in docs})
        print(f"{len(pool)} passages, {len(used)} used by {len(qs)} questions", file=sys.stderr)
        # Each method runs in its own namespace (cache_salt), so what one method's run of a
        # prompt stores (its question, its headers) is not reused by the next method's run of
        # the same prompt. In each, the RAG database's precompute first: every passage once,
        # alone.
        for mi, (name, extra) in enumerate(methods):
            if "cache" not in extra:
                for d in used:
                    srv.chat([{"role": "user", "content": f"Document 1:\n{pool[d]}"}], 1,
                             {"cache_salt": f"m{mi}"})
        res = {name: [] for name, _ in methods}
        res["full prefill, f32"] = []
        precise = Server(args, ["--precise"])
        for qi, (docs, q) in enumerate(qs):
            msgs = messages(pool, docs, q)
            ref = None
            for mi, (name, extra) in enumerate(methods):
                t, text, lp, usage, toks = srv.chat(msgs, args.max_tokens,
                                                    {**extra, "cache_salt": f"m{mi}"})
                det = usage["prompt_tokens_details"]
                row = {"t": t, "text": text, "lp": lp, "n": usage["prompt_tokens"], "toks": toks,
                       "blended": det.get("blended_tokens", 0),
                       "cached": det.get("cached_tokens", 0)}
                if ref is None:
                    ref = row
                row["same"] = text == ref["text"]
                row["same8"] = toks[:8] == ref["toks"][:8]
                row["f1"] = f1(text, ref["text"])
                row["kl"] = kl(ref["lp"], lp) if ref["lp"] and lp else float("nan")
                res[name].append(row)
            t, text, lp, usage, toks = precise.chat(msgs, args.max_tokens, {"cache": False})
            res["full prefill, f32"].append(
                {"t": t, "text": text, "n": usage["prompt_tokens"], "blended": 0,
                 "same": text == ref["text"], "same8": toks[:8] == ref["toks"][:8],
                 "f1": f1(text, ref["text"]), "kl": kl(ref["lp"], lp)})
            print(f"question {qi + 1}/{len(qs)}: {len(docs)} passages, {ref['n']} tokens",
                  file=sys.stderr)
        full_t = statistics.mean(r["t"] for r in res["full prefill"])
        print(f"\n{len(qs)} questions, 4-6 passages of 200-600 tokens each, mean prompt "
              f"{statistics.mean(r['n'] for r in res['full prefill']):.0f} tokens; "
              f"{args.max_tokens} greedy tokens\n")
        print("| method | identical answer | identical first 8 tokens | token F1 | "
              "KL first token | TTFT s | speed-up | blended tokens |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        precise.stop()
        for name in [methods[0][0], "full prefill, f32"] + [m[0] for m in methods[1:]]:
            rows = res[name]
            t = statistics.mean(r["t"] for r in rows)
            kls = [r["kl"] for r in rows if not math.isnan(r["kl"])]
            print(f"| {name} | {100 * sum(r['same'] for r in rows) / len(rows):.0f}% | "
                  f"{100 * sum(r['same8'] for r in rows) / len(rows):.0f}% | "
                  f"{statistics.mean(r['f1'] for r in rows):.3f} | "
                  f"{statistics.mean(kls) if kls else float('nan'):.4f} | {t:.2f} | "
                  f"{full_t / t:.2f}x | "
                  f"{100 * sum(r['blended'] for r in rows) / sum(r['n'] for r in rows):.0f}% |")
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
