"""Weights are mmapped, not copied: the peak resident set of a generate run stays near the model
file plus the KV pool (plus scratch), far below what a copy of the weights would add."""
import os
import subprocess

import pytest

from conftest import BIN, ROOT

KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 2  # SmolLM2-135M: layers x (K, V) x kv heads x dim x f16


def peak_rss_bytes(args):
    p = subprocess.Popen([BIN, *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(p.pid, 0)
    err = p.stderr.read()
    assert os.waitstatus_to_exitcode(status) == 0, err
    return usage.ru_maxrss * 1024, err


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
