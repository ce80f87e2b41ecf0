import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("KVSERVE_BIN", os.path.join(ROOT, "build", "kvserve"))
MODEL = os.environ.get("KVSERVE_TEST_MODEL",
                       os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))


def run_kvserve(*args, timeout=300):
    """Runs the kvserve binary from the repo root; returns the CompletedProcess."""
    return subprocess.run([BIN, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="session")
def model_path():
    assert os.path.exists(MODEL), f"{MODEL} missing: run `make model`"
    return MODEL
