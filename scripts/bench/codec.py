#!/usr/bin/env python3
"""The CacheGen codec's size, speed and quality table (issue 5): `kvserve calibrate` (when the
model has no table yet, or with --recalibrate) and `kvserve codec-eval` over a text corpus, all
methods in one run so they compare as ratios on a shared, noisy machine. The table is made
again when it is older than the binary.

The default corpus is six licence texts every Debian system carries in
/usr/share/common-licenses (GPL-2, LGPL-2.1, MPL-2.0, Apache-2.0, GFDL-1.3, MPL-1.1: about 27K
tokens), concatenated, so 20 windows of 1024 context + 256 held-out tokens fit: agreement is
then counted over 1280 generated tokens (one window's 64 swing by several percent).

    python3 scripts/bench/codec.py [--bin build/kvserve] [--model MODEL] [--text FILE]
                                   [--windows 20] [--threads 2] [--recalibrate]
"""
import argparse
import os
import subprocess
import sys
import tempfile

LICENSES = ["GPL-2", "LGPL-2.1", "MPL-2.0", "Apache-2.0", "GFDL-1.3", "MPL-1.1"]


def write_corpus(path):
    """The default corpus (LICENSES, concatenated) into path."""
    with open(path, "wb") as out:
        for name in LICENSES:
            with open(os.path.join("/usr/share/common-licenses", name), "rb") as f:
                out.write(f.read())


def calibrate_if_stale(binary, model, threads, force=False):
    """Runs `kvserve calibrate` when the model has no codec table, one older than the binary
    (it may be of an older format or calibration), or with force."""
    table = model + ".kvcodec"
    if (force or not os.path.exists(table)
            or os.path.getmtime(table) < os.path.getmtime(binary)):
        subprocess.run([binary, "calibrate", "-m", model, "-t", str(threads)], check=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="build/kvserve")
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--text")
    ap.add_argument("--windows", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--recalibrate", action="store_true")
    a = ap.parse_args()
    calibrate_if_stale(a.bin, a.model, a.threads, a.recalibrate)
    with tempfile.TemporaryDirectory() as d:
        text = a.text
        if not text:
            text = os.path.join(d, "licenses.txt")
            write_corpus(text)
        r = subprocess.run([a.bin, "codec-eval", "-m", a.model, "--text", text, "--windows",
                            str(a.windows), "-t", str(a.threads)])
    sys.exit(r.returncode)


if __name__ == "__main__":
    main()
