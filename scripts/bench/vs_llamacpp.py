#!/usr/bin/env python3
"""kvserve vs llama.cpp at the same SIMD level, same model, machine and threads, in one run.

For each level (avx2, avx512: those the CPU runs), `kvserve bench --simd LEVEL` and llama.cpp's
own `llama-bench` built for exactly that level (scripts/bench/build_llamacpp.sh: GGML_NATIVE=OFF,
AVX2 only, or AVX2 + AVX-512 with VNNI) run llama-bench's tests, alternating per repetition so
machine noise hits both alike. Prints one table per level with the medians and their ratio, and
the memory's read bandwidth with the share of it that kvserve's tg128 reaches (every weight is
read once per decoded token, so weights x tokens/s is the bytes/s that decode streams).

    scripts/bench/build_llamacpp.sh            # once: build/llamacpp/{avx2,avx512}
    python3 scripts/bench/vs_llamacpp.py [-m MODEL ...] [-t 2] [-r 3] [--levels avx2,avx512]
"""
import argparse
import json
import os
import re
import statistics
import subprocess

TESTS = [("pp512", 512, 0, 0), ("pp2048", 2048, 0, 0), ("tg128", 0, 128, 0),
         ("tg64@4096", 0, 64, 4096)]


def cpu_model():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown CPU"


def cpu_levels():
    flags = open("/proc/cpuinfo").read()
    levels = []
    if re.search(r"\bavx2\b", flags) and re.search(r"\bfma\b", flags):
        levels.append("avx2")
    if all(re.search(r"\b%s\b" % f, flags) for f in
           ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni")):
        levels.append("avx512")
    return levels


def kvserve_run(binary, model, threads, level, name):
    out = subprocess.run([binary, "bench", "-m", model, "-t", str(threads), "-r", "1", "-T", name,
                          "--simd", level], capture_output=True, text=True, check=True).stdout
    row = [ln for ln in out.splitlines() if f"| {name} |" in ln][0]
    if f"| {level} |" not in row:
        raise SystemExit(f"kvserve ran at another level than {level}: {row}")
    return float(re.search(r"\| ([0-9.]+) ± [0-9.]+ \|\s*$", row).group(1))


def llamacpp_run(binary, model, threads, n_prompt, n_gen, depth):
    cmd = [binary, "-m", model, "-t", str(threads), "-r", "1", "-o", "json",
           "-p", str(n_prompt), "-n", str(n_gen), "-d", str(depth)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


def read_bandwidth(binary, model, threads):
    out = subprocess.run([binary, "bench", "-m", model, "-t", str(threads), "-r", "1", "-T",
                          "tg128", "--read-bandwidth"], capture_output=True, text=True,
                         check=True).stdout
    return float(re.search(r"read bandwidth: ([0-9.]+) GB/s", out).group(1))


def model_bytes(binary, model):
    """Weight bytes as kvserve reports them (MiB in its bench table)."""
    out = subprocess.run([binary, "bench", "-m", model, "-t", "1", "-r", "1", "-T", "tg128"],
                         capture_output=True, text=True, check=True).stdout
    return float(re.search(r"\| ([0-9.]+) MiB \|", out).group(1)) * 1048576


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", action="append")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-r", "--reps", type=int, default=3)
    ap.add_argument("--bin", default="build/kvserve")
    ap.add_argument("--llamacpp", default="build/llamacpp",
                    help="build_llamacpp.sh's folder (LEVEL/bin/llama-bench)")
    ap.add_argument("--levels", default=",".join(cpu_levels()))
    ap.add_argument("--tests", default=",".join(t[0] for t in TESTS))
    args = ap.parse_args()
    models = args.model or ["models/SmolLM2-135M-Instruct.Q4_1.gguf"]
    tests = [t for t in TESTS if t[0] in args.tests.split(",")]
    bw = read_bandwidth(args.bin, models[0], args.threads)
    print(f"CPU: {cpu_model()}; {args.threads} threads; read bandwidth {bw:.1f} GB/s "
          f"({args.threads} threads); medians of {args.reps}, engines alternating\n")
    for model in models:
        wbytes = model_bytes(args.bin, model)
        for level in args.levels.split(","):
            peer = os.path.join(args.llamacpp, level, "bin", "llama-bench")
            if not os.access(peer, os.X_OK):
                raise SystemExit(f"{peer} missing: run scripts/bench/build_llamacpp.sh")
            print(f"{os.path.basename(model)}, {level} (llama.cpp built for {level}):\n")
            print("| test | kvserve t/s | llama.cpp t/s | kvserve / llama.cpp |")
            print("| --- | ---: | ---: | ---: |")
            share = None
            for name, n_prompt, n_gen, depth in tests:
                ours, theirs = [], []
                for _ in range(args.reps):
                    ours.append(kvserve_run(args.bin, model, args.threads, level, name))
                    theirs.append(llamacpp_run(peer, model, args.threads, n_prompt, n_gen, depth))
                a, b = statistics.median(ours), statistics.median(theirs)
                if name == "tg128":
                    share = a * wbytes / 1e9
                print(f"| {name} | {a:.1f} | {b:.1f} | {a / b:.2f} |", flush=True)
            if share is not None:
                print(f"\ntg128 streams {share:.1f} GB/s of weights ({wbytes / 1048576:.1f} MiB a "
                      f"token): {100 * share / bw:.0f}% of the {bw:.1f} GB/s read bandwidth")
            print()


if __name__ == "__main__":
    main()
