#!/usr/bin/env python3
"""kvserve vs llama.cpp on the same model, machine and thread count, in one run.

Runs `kvserve bench` and the same tests through llama-cpp-python (llama.cpp), alternating the
two engines per repetition so machine noise hits both alike, and prints tokens/s and the ratio.

    python3 -m venv /tmp/ref/venv && /tmp/ref/venv/bin/pip install llama-cpp-python
    /tmp/ref/venv/bin/python scripts/bench/vs_llamacpp.py [-m MODEL] [-t 2] [-r 3]
"""
import argparse
import random
import re
import statistics
import subprocess
import time

from llama_cpp import Llama

TESTS = [("pp512", 512, 0, 0), ("pp2048", 2048, 0, 0), ("tg128", 0, 128, 0),
         ("tg64@4096", 0, 64, 4096)]


def llamacpp_run(llm, n_prompt, n_gen, depth, n_vocab):
    rng = random.Random(42)
    toks = [rng.randrange(n_vocab) for _ in range(depth + n_prompt + n_gen)]
    llm.reset()
    if depth:
        llm.eval(toks[:depth])
    t0 = time.perf_counter()
    if n_prompt:
        llm.eval(toks[depth:depth + n_prompt])
    for t in toks[depth + n_prompt:]:
        llm.eval([t])
    return (n_prompt + n_gen) / (time.perf_counter() - t0)


def kvserve_run(binary, model, threads, name):
    out = subprocess.run([binary, "bench", "-m", model, "-t", str(threads), "-r", "1", "-T", name],
                         capture_output=True, text=True, check=True).stdout
    m = re.search(r"\| ([0-9.]+) ± [0-9.]+ \|\s*$", out.strip())
    return float(m.group(1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-r", "--reps", type=int, default=3)
    ap.add_argument("--bin", default="build/kvserve")
    args = ap.parse_args()
    llm = Llama(model_path=args.model, n_ctx=4096 + 64, n_batch=512, n_ubatch=512,
                n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
    n_vocab = llm.n_vocab()
    print(f"| test | kvserve t/s | llama.cpp t/s | kvserve / llama.cpp |  ({args.threads} threads, "
          f"median of {args.reps})")
    print("| --- | ---: | ---: | ---: |")
    for name, n_prompt, n_gen, depth in TESTS:
        llamacpp_run(llm, n_prompt, n_gen, depth, n_vocab)  # warm-up
        ours, theirs, ratios = [], [], []
        for _ in range(args.reps):
            a = kvserve_run(args.bin, args.model, args.threads, name)
            b = llamacpp_run(llm, n_prompt, n_gen, depth, n_vocab)
            ours.append(a)
            theirs.append(b)
            ratios.append(a / b)
        print(f"| {name} | {statistics.median(ours):.1f} | {statistics.median(theirs):.1f} | "
              f"{statistics.median(ratios):.2f} |", flush=True)


if __name__ == "__main__":
    main()
