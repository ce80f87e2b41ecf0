#!/usr/bin/env python3
"""Prompt Cache: time to first token with a schema's precomputed modules against a full prefill
of the same text, and the answers' quality, in one server process.

TTFT: a schema of a system prompt and document modules (passages of the licence texts in
/usr/share/common-licenses) totalling about 1K, 4K and 8K tokens; a prompt imports every module
and asks a question in a user turn. Each size is registered (precomputed once), then the prompt
is timed with its modules reused and with "cache": false (the same tokens, computed in full),
alternately, median of --reps. TTFT is from sending the request to the first streamed content.

Quality: a RAG schema of up to --docs passages (about 7K tokens in all), each a module, and an
"ask" module whose parameter may hold the question; --prompts prompts each import 3-4 passages
and ask about one of them, in a user turn after the schema (--ask turn) or as the parameter
(--ask parameter). Every prompt is answered (greedy, --max-tokens) by full prefill ("cache":
false), by plain Prompt Cache, and with the fix-up at 15%, 30% and 100% (the last recomputes
every token: it must equal full prefill, a check): identical answers (%), identical first 8 tokens, token F1
against the full prefill's answer, mean KL(full || method) of the first token's distribution
(top-20 logprobs), and mean TTFT with its ratio to full prefill.

    python3 scripts/bench/schema.py [--bin build/kvserve] [--model MODEL] [--threads 2]
                                    [--sizes 1000,4000,8000] [--prompts 40] [--docs 20]
"""
import argparse
import os
import random
import re
import statistics
import sys
import time
from xml.sax.saxutils import escape, quoteattr

import benchlib
from benchlib import ROOT
from blend import TOP, f1, kl, passages

SYSTEM = "You are a helpful assistant. Answer the question using only the documents."
QUESTIONS = [
    "Quote the sentence that comes right after \"{frag}\".",
    "What does the document say about {word}?",
    "Summarize the document that mentions \"{frag}\" in one sentence.",
    "Which document talks about {word}, and what does it say?",
]
METHODS = [("full prefill", {"cache": False}), ("Prompt Cache", {"fixup": False}),
           ("fix-up 15%", {"fixup": True, "fixup_ratio": 0.15}),
           ("fix-up 30%", {"fixup": True, "fixup_ratio": 0.30}),
           ("fix-up 100%", {"fixup": True, "fixup_ratio": 1.0})]


class Server(benchlib.Server):
    def __init__(self, args):
        super().__init__(args.bin, args.model, args.threads,
                         ["-c", "8192", "--cache-dir", "off", "--cache-ram-bytes", "4G"])

    def ask(self, schema_prompt, max_tokens, extra):
        """(seconds to the first content, text, first token's top logprobs, usage, tokens)."""
        return self.chat_stream({
            "messages": [], "schema_prompt": schema_prompt, "max_tokens": max_tokens,
            "temperature": 0, "logprobs": True, "top_logprobs": TOP,
            "stream_options": {"include_usage": True}, **extra})

    def register(self, pml):
        st, r = self.request("POST", "/v1/schemas", {"pml": pml})
        if st not in (200, 202):
            sys.exit(f"registering: HTTP {st}: {r}")
        t0 = time.perf_counter()
        while r["status"] == "building":
            time.sleep(0.2)
            st, r = self.request("GET", f"/v1/schemas/{r['name']}")
        if r["status"] != "ready":
            sys.exit(f"schema {r['name']}: {r}")
        return r, time.perf_counter() - t0


def n_tokens(srv, text):
    st, body = srv.request("POST", "/tokenize", {"content": text, "add_special": False})
    assert st == 200, body
    return len(body["tokens"])


def doc_module(i, text):
    return f'<module name="d{i}">Document:\n{escape(text)}\n\n</module>'


def ttft_table(srv, pool, sizes, reps):
    rows = []
    lens = [n_tokens(srv, f"Document:\n{p}\n\n") for p in pool]
    for size in sizes:
        mods, total = [], 0
        for i, p in enumerate(pool):
            if total + lens[i] > size:
                continue
            mods.append(i)
            total += lens[i]
        name = f"ttft{size}"
        pml = (f'<schema name="{name}"><system>{escape(SYSTEM)}</system><user>' +
               "".join(doc_module(i, pool[i]) for i in mods) + "</user></schema>")
        info, build_s = srv.register(pml)
        prompt = (f'<prompt schema="{name}">' + "".join(f"<d{i}/>" for i in mods) +
                  "<user>Which document mentions a warranty?</user></prompt>")
        warm, cold, fix = [], [], []
        for _ in range(reps):
            cold.append(srv.ask(prompt, 1, {"cache": False}))
            warm.append(srv.ask(prompt, 1, {"fixup": False}))
            fix.append(srv.ask(prompt, 1, {"fixup": True, "fixup_ratio": 0.15}))
        tc = statistics.median(r[0] for r in cold)
        tw = statistics.median(r[0] for r in warm)
        tf = statistics.median(r[0] for r in fix)
        rows.append((size, total, warm[0][3]["prompt_tokens"],
                     warm[0][3]["prompt_tokens_details"]["cached_tokens"], build_s, tc, tw, tf))
        print(f"size {size}: {total} module tokens, full {tc:.3f} s, schema {tw:.4f} s, "
              f"fix-up {tf:.3f} s", file=sys.stderr)
        srv.request("DELETE", f"/v1/schemas/{name}")
    print("\n| modules | module tokens | prompt tokens | reused | precompute | full prefill | "
          "Prompt Cache | speed-up | fix-up 15% | speed-up |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for size, total, n, cached, b, tc, tw, tf in rows:
        print(f"| {size // 1000}K | {total} | {n} | {cached} | {b:.1f} s | {tc * 1000:.0f} ms | "
              f"{tw * 1000:.1f} ms | {tc / tw:.1f}x | {tf * 1000:.0f} ms | {tc / tf:.1f}x |")


def quality_measure(srv, pool, n_docs, n_prompts, max_tokens, rng, param, methods=METHODS):
    """{method name: rows} of the RAG schema's prompts answered by each method (the first is
    the reference every other row is compared with), and the schema's document count."""
    # documents drawn at random while the schema stays within the context (about 7K tokens)
    docs, total = [], 0
    for d in rng.sample(range(len(pool)), len(pool)):
        n = n_tokens(srv, f"Document:\n{pool[d]}\n\n")
        if len(docs) < n_docs and total + n <= 7000:
            docs.append(d)
            total += n
    n_docs = len(docs)
    pml = (f'<schema name="rag"><system>{escape(SYSTEM)}</system><user>' +
           "".join(doc_module(k, pool[d]) for k, d in enumerate(docs)) +
           '<module name="ask">Question: <parameter name="q" length="64"/></module>'
           "</user></schema>")
    info, build_s = srv.register(pml)
    print(f"rag schema: {info['tokens']} tokens over {info['positions']} positions, "
          f"precomputed in {build_s:.1f} s", file=sys.stderr)
    res = {name: [] for name, _ in methods}
    for pi in range(n_prompts):
        pick = sorted(rng.sample(range(n_docs), rng.randint(3, 4)))
        about = pool[docs[rng.choice(pick)]]
        sents = [s for s in re.split(r"(?<=[.;:])\s+", about) if len(s.split()) >= 8]
        sent = rng.choice(sents) if sents else about[:80]
        words = sent.split()
        frag = " ".join(words[:min(len(words) - 1, 6)])
        word = rng.choice([w.strip(".,;:()\"") for w in words if len(w) > 5] or ["the licence"])
        q = rng.choice(QUESTIONS).format(frag=frag, word=word)
        ask = (f"<ask q={quoteattr(q)}/>" if param else
               f"<user>Question: {escape(q)}</user>")
        prompt = '<prompt schema="rag">' + "".join(f"<d{k}/>" for k in pick) + ask + "</prompt>"
        ref = None
        for name, extra in methods:
            t, text, lp, usage, toks = srv.ask(prompt, max_tokens, extra)
            row = {"t": t, "text": text, "n": usage["prompt_tokens"], "toks": toks,
                   "cached": usage["prompt_tokens_details"]["cached_tokens"]}
            if ref is None:
                ref = dict(row, lp=lp)
            row["same"] = text == ref["text"]
            row["same8"] = toks[:8] == ref["toks"][:8]
            row["top1"] = toks[:1] == ref["toks"][:1]
            row["f1"] = f1(text, ref["text"])
            row["kl"] = kl(ref["lp"], lp) if ref["lp"] and lp else float("nan")
            res[name].append(row)
        print(f"prompt {pi + 1}/{n_prompts}: {len(pick)} documents, {ref['n']} tokens",
              file=sys.stderr)
    return res, n_docs


def quality_table(srv, pool, n_docs, n_prompts, max_tokens, rng, param):
    res, n_docs = quality_measure(srv, pool, n_docs, n_prompts, max_tokens, rng, param)
    full_t = statistics.mean(r["t"] for r in res["full prefill"])
    print(f"\n{n_prompts} prompts over a schema of {n_docs} documents (3-4 imported each, mean "
          f"prompt {statistics.mean(r['n'] for r in res['full prefill']):.0f} tokens); "
          f"{max_tokens} greedy tokens\n")
    print("| method | identical answer | identical first 8 tokens | token F1 | KL first token | "
          "TTFT ms | speed-up |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, _ in METHODS:
        rows = res[name]
        t = statistics.mean(r["t"] for r in rows)
        kls = [r["kl"] for r in rows if r["kl"] == r["kl"]]
        print(f"| {name} | {100 * sum(r['same'] for r in rows) / len(rows):.0f}% | "
              f"{100 * sum(r['same8'] for r in rows) / len(rows):.0f}% | "
              f"{statistics.mean(r['f1'] for r in rows):.3f} | "
              f"{statistics.mean(kls) if kls else float('nan'):.4f} | {t * 1000:.0f} | "
              f"{full_t / t:.1f}x |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    benchlib.add_server_args(ap)
    ap.add_argument("--sizes", default="1000,4000,8000")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--docs", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--ask", choices=["parameter", "turn"], default="turn",
                    help="the question: the ask module's parameter, or a user turn after")
    args = ap.parse_args()
    srv = Server(args)
    try:
        pool = passages(srv)
        print(f"{len(pool)} passages", file=sys.stderr)
        if args.sizes:
            ttft_table(srv, pool, [int(s) for s in args.sizes.split(",")], args.reps)
        if args.prompts > 0:
            quality_table(srv, pool, args.docs, args.prompts, args.max_tokens,
                          random.Random(args.seed), args.ask == "parameter")
    finally:
        srv.stop()


if __name__ == "__main__":
    main()
