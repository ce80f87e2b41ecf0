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

--device cuda (or cpu): `kvserve bench --device DEV` against one llama-bench binary (--peer, e.g.
build_llamacpp.sh's cuda level; -ngl 99 -fa on on cuda, -ngl 0 on cpu), each engine once per
model with -r REPS (on a GPU the loads cost more than the noise they would average out; the
tests are llama-bench's, as above), with README's earlier kvserve figures for that model and
device beside them where there are any (PREVIOUS). scripts/device/check.sh's `peer` step runs it.
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


# README's earlier kvserve figures on a GPU (H200), by model file and test, with where they are
# from: `kvserve bench` on the 4-layer SmolLM2 cut (pack.sh's), and make bench-gpu's gpu_bench on
# the Llama 3 8B shape (prefill of 2048 tokens; decode at batch 1 from context 512, for tg128).
PREVIOUS = {
    "SmolLM2-135M-Instruct.Q4_1.gguf": {"pp512": (361000, "kvserve bench"),
                                        "tg128": (2366, "kvserve bench"),
                                        "tg64@4096": (1303, "kvserve bench")},
    "llama3-8b-shape.Q4_K.gguf": {"pp2048": (5188, "gpu_bench prefill 2048"),
                                  "tg128": (115.2, "gpu_bench decode b1 @512")},
}


def run_or_exit(cmd):
    """cmd's stdout; exits the script with its stderr's end when it fails."""
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)}: exit {p.returncode}\n{p.stderr[-2000:]}")
    return p.stdout


def kvserve_device_run(binary, model, threads, device, reps):
    """{test: t/s} of one `kvserve bench --device DEV` with its default tests, and the weights'
    bytes."""
    out = run_or_exit([binary, "bench", "-m", model, "-t", str(threads), "-r", str(reps),
                       "--device", device])
    res, wbytes = {}, 0
    for row in out.splitlines():
        cols = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cols) == 8 and cols[6] in dict((t[0], 0) for t in TESTS):
            if cols[3] != device:
                raise SystemExit(f"kvserve ran on {cols[3]}, not {device}: {row}")
            res[cols[6]] = float(cols[7].split()[0])
            wbytes = float(cols[1].split()[0]) * 1048576
    return res, wbytes


def llamacpp_device_run(binary, model, threads, device, reps, tests):
    """{test: t/s} of llama-bench on DEV: the depth-0 tests in one process, each other depth in
    its own (llama-bench crosses every depth with every test)."""
    res = {}
    for depth in sorted({t[3] for t in tests}):
        at = [t for t in tests if t[3] == depth]
        pp = ",".join(str(t[1]) for t in at if t[1]) or "0"
        tg = ",".join(str(t[2]) for t in at if t[2]) or "0"
        cmd = [binary, "-m", model, "-t", str(threads), "-r", str(reps), "-o", "json", "-p", pp,
               "-n", tg, "-d", str(depth)]
        cmd += ["-ngl", "99", "-fa", "on"] if device == "cuda" else ["-ngl", "0"]
        for r in json.loads(run_or_exit(cmd)):
            for name, n_prompt, n_gen, d in at:
                if (r["n_prompt"], r["n_gen"], r["n_depth"]) == (n_prompt, n_gen, d):
                    res[name] = float(r["avg_ts"])
    return res


def device_main(args, models, tests):
    if not os.access(args.peer or "", os.X_OK):
        raise SystemExit(f"--peer {args.peer}: no llama-bench there (build_llamacpp.sh cuda)")
    print(f"kvserve bench --device {args.device} vs llama-bench ({args.peer}), {args.threads} "
          f"threads, -r {args.reps} each\n")
    for model in models:
        name = os.path.basename(model)
        ours, wbytes = kvserve_device_run(args.bin, model, args.threads, args.device, args.reps)
        theirs = llamacpp_device_run(args.peer, model, args.threads, args.device, args.reps,
                                     tests)
        prev = PREVIOUS.get(name, {}) if args.device == "cuda" else {}
        print(f"{name} ({wbytes / 1048576:.0f} MiB of weights), {args.device}:\n")
        print("| test | kvserve t/s | llama.cpp t/s | kvserve / llama.cpp | kvserve before |")
        print("| --- | ---: | ---: | ---: | --- |")
        for t in tests:
            a, b = ours.get(t[0]), theirs.get(t[0])
            ratio = f"{a / b:.2f}" if a and b else "-"
            before = f"{prev[t[0]][0]:g} ({prev[t[0]][1]})" if t[0] in prev else "-"
            print(f"| {t[0]} | {a or float('nan'):.1f} | {b or float('nan'):.1f} | {ratio} "
                  f"| {before} |", flush=True)
        if ours.get("tg128") and theirs.get("tg128"):
            print(f"\ntg128 streams {ours['tg128'] * wbytes / 1e9:.0f} GB/s of weights (kvserve) "
                  f"and {theirs['tg128'] * wbytes / 1e9:.0f} GB/s (llama.cpp)")
        print()


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
    ap.add_argument("--device", choices=("cuda", "cpu"), help="device mode (above)")
    ap.add_argument("--peer", help="device mode: the llama-bench binary")
    args = ap.parse_args()
    models = args.model or ["models/SmolLM2-135M-Instruct.Q4_1.gguf"]
    tests = [t for t in TESTS if t[0] in args.tests.split(",")]
    if args.device:
        return device_main(args, models, tests)
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
