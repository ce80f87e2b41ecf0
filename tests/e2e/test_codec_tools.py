"""`kvserve calibrate` and `kvserve codec-eval` on the real model: the table file is written
beside the model (or where -o says), refused when corrupt or for another model, and codec-eval
reports every level and baseline, with the fp16 baseline exactly reproducing the model's own KV
(the KV round trip through the pool is exact) and sizes shrinking level by level."""
import os
import re
import shutil
import tempfile

from conftest import ROOT, run_kvserve

SMALL = ["--chunk", "64"]


def calibrate(model_path, out):
    r = run_kvserve("calibrate", "-m", model_path, "-o", out, "--text",
                    os.path.join(ROOT, "README.md"), "-n", "512", *SMALL)
    assert r.returncode == 0, r.stderr
    assert os.path.getsize(out) > 0
    return r


def test_calibrate_and_codec_eval(model_path):
    d = tempfile.mkdtemp(prefix="kvserve-codec-")
    try:
        table = os.path.join(d, "t.kvcodec")
        r = calibrate(model_path, table)
        assert "calibrated 8 chunks of 64 tokens (30 layers, 192 KV channels, 4 levels)" \
            in r.stdout, r.stdout
        r = run_kvserve("codec-eval", "-m", model_path, "--table", table, "--text",
                        os.path.join(ROOT, "README.md"), "--ctx", "256", "--heldout", "64",
                        "--windows", "2", *SMALL)
        assert r.returncode == 0, r.stderr
        assert "2 window(s) of 256 context tokens" in r.stdout, r.stdout
        rows = {}
        for line in r.stdout.splitlines():
            m = re.match(r"\| (fp16|8-bit per token|4-bit per token|level \d) \| (\d+) \|"
                         r".*\| ([+-]\d+\.\d+)% \| (\d+\.\d)% \| (\d+\.\d)/64 \|$", line)
            if m:
                rows[m.group(1)] = (int(m.group(2)), float(m.group(3)), float(m.group(4)))
        assert set(rows) == {"fp16", "8-bit per token", "4-bit per token", "level 0", "level 1",
                             "level 2", "level 3"}, r.stdout
        assert rows["fp16"] == (23040, 0.0, 100.0), r.stdout
        sizes = [rows[f"level {k}"][0] for k in range(4)]
        assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == 4, r.stdout
        assert rows["level 3"][0] < rows["8-bit per token"][0], r.stdout
        # the level options: sd units, bins of one's own, CacheGen's anchor groups
        sd_table = os.path.join(d, "sd.kvcodec")
        r = run_kvserve("calibrate", "-m", model_path, "-o", sd_table, "--text",
                        os.path.join(ROOT, "README.md"), "-n", "512", "--units", "sd",
                        "--bins", "0.5,1,1.5", "--group", "10", "--margin", "0", *SMALL)
        assert r.returncode == 0 and "3 levels" in r.stdout, r.stderr

        # bad level options are refused before the model is read
        for args, msg in ((["--bins", "1,0.5"], "fine to coarse"), (["--bins", "0"], "bins"),
                          (["--units", "bits"], "units"), (["--group", "-1"], "group"),
                          (["--margin", "-1"], "margin")):
            r = run_kvserve("calibrate", "-m", model_path, "-o", sd_table, *args)
            assert r.returncode != 0 and msg in r.stderr, (args, r.stderr)

        # a text too short for the windows asked for
        r = run_kvserve("codec-eval", "-m", model_path, "--table", table, "--text",
                        os.path.join(ROOT, "README.md"), "--windows", "1000", *SMALL)
        assert r.returncode != 0 and "windows" in r.stderr, r.stderr
        # a corrupt table is refused, naming the file
        with open(table, "r+b") as f:
            f.seek(100)
            b = f.read(1)
            f.seek(100)
            f.write(bytes([b[0] ^ 1]))
        r = run_kvserve("codec-eval", "-m", model_path, "--table", table, "--text",
                        os.path.join(ROOT, "README.md"), "--ctx", "256", *SMALL)
        assert r.returncode != 0 and "t.kvcodec" in r.stderr, r.stderr
        # and so is a missing one
        r = run_kvserve("codec-eval", "-m", model_path, "--table", table + ".none", "--text",
                        os.path.join(ROOT, "README.md"), *SMALL)
        assert r.returncode != 0 and "calibrate" in r.stderr, r.stderr
    finally:
        shutil.rmtree(d, ignore_errors=True)
