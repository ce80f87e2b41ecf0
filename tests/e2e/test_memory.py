"""Weights are mmapped, not copied: the peak resident set of a generate run stays near the model
file plus the KV pool (plus scratch), far below what a copy of the weights would add."""
import os
import subprocess
import sys

import pytest

from conftest import BIN, ROOT

KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 2  # SmolLM2-135M: layers x (K, V) x kv heads x dim x f16


# The run's peak RSS, measured by a small Python process that forks and execs it: a child forked
# from pytest itself would report pytest's resident set (the kernel keeps a process's high-water
# mark across exec), which grows with every test module imported before this one.
MEASURE = """import os, sys
pid = os.fork()
if pid == 0:
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    os.execv(sys.argv[1], sys.argv[1:])
_, status, usage = os.wait4(pid, 0)
print(os.waitstatus_to_exitcode(status), usage.ru_maxrss)
"""


def peak_rss_bytes(args):
    p = subprocess.run([sys.executable, "-c", MEASURE, BIN, *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    code, maxrss_kib = (int(v) for v in p.stdout.split())
    assert code == 0, p.stderr
    return maxrss_kib * 1024, p.stderr


@pytest.mark.skipif(os.environ.get("KVSERVE_SANITIZED") == "1",
                    reason="RSS under AddressSanitizer includes its shadow memory and quarantine")
def test_rss_is_model_file_plus_kv_pool(model_path):
    ctx = 2048
    rss, err = peak_rss_bytes(["generate", "-m", model_path, "-c", str(ctx), "-n", "8",
                               "--temp", "0", "--log-level", "info", "-p", "Hello there"])
    file_bytes = os.path.getsize(model_path)
    pool = ctx * KV_BYTES_PER_TOKEN
    mib = 1 << 20
    print(f"peak RSS {rss / mib:.1f} MiB = file {file_bytes / mib:.1f} MiB + KV pool "
          f"{pool / mib:.1f} MiB + {(rss - file_bytes - pool) / mib:.1f} MiB other")
    assert "KV pool 2048 tokens" in err, err
    # a copy of the weights would add another file size; scratch for 512-token slices is ~40 MiB
    assert rss < file_bytes + pool + 48 * mib
    assert rss > file_bytes * 0.9  # the mapped weights are resident while they are used
