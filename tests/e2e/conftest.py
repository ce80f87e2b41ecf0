import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

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


# ---------------------------------------------------------------- `kvserve serve` fixtures

SANITIZED = os.environ.get("KVSERVE_SANITIZED") == "1"
# Timeouts scale with this under AddressSanitizer (3-5x slower).
SLOW = 5 if SANITIZED else 1
SANITIZER_MARKERS = ("ERROR: AddressSanitizer", "runtime error:", "LeakSanitizer")
# The default server's context: room for the ~1500-token prompt of the concurrency tests.
DEFAULT_CTX = 2048


def server_env(extra=None):
    """The environment for kvserve: this one without the KVSERVE_* option variables (a
    developer's KVSERVE_API_KEY must not leak into the tests), plus `extra`. The server computes
    on the CPU backend, whose answers the tests expect, also where a GPU is present (the CUDA
    backend is compared with it by the unit tests and make test-gpu)."""
    keep = ("KVSERVE_BIN", "KVSERVE_TEST_MODEL", "KVSERVE_SANITIZED")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSERVE_") or k in keep}
    env["KVSERVE_DEVICE"] = "cpu"
    env.update(extra or {})
    return env


# free_port() and http_get(url, timeout=5), as scripts/cluster.py (which the cluster tests
# import) defines them
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from cluster import free_port, http_get  # noqa: E402,F401


class KvServer:
    """One `kvserve serve` process on a free port of 127.0.0.1. `url` is its base URL
    (http://127.0.0.1:PORT, no trailing slash); `model_id` the id it serves."""

    def __init__(self, args=(), env=None, model_id=None):
        self.args = list(args)
        # The disk tier goes to a private directory unless the test names one: tests must not
        # share (or leave behind) a cache in the user's home.
        self._own_cache_dir = None
        if not any(a == "--cache-dir" or a.startswith("--cache-dir=") for a in self.args):
            self._own_cache_dir = tempfile.mkdtemp(prefix="kvserve-test-cache-")
            self.args += ["--cache-dir", self._own_cache_dir]
        self.env = env
        self.model_id = model_id or os.path.basename(MODEL)[:-len(".gguf")]
        self.proc = None
        self.url = None
        self._stderr = None
        self.saw_loading = False

    def start(self, timeout=60 * SLOW):
        try:
            return self._start(timeout)
        except BaseException:
            self._remove_own_cache_dir()
            raise

    def restart(self, timeout=60 * SLOW):
        """Starts the server again after it exited (kill9, or a drain's own exit), with its
        options and cache directory, on its port: a router in front knows it by that URL."""
        assert self.proc.poll() is not None, "restart of a running server"
        if not self._stderr.closed:
            self._close_stderr()
        self.killed = False
        return self._start(timeout, port=int(self.url.rsplit(":", 1)[1]))

    def _start(self, timeout, port=None):
        for attempt in range(3):  # the free port may be taken before kvserve binds it
            port = port or free_port()
            self.url = f"http://127.0.0.1:{port}"
            self._stderr = tempfile.TemporaryFile(mode="w+")
            env = server_env(self.env)
            self.proc = subprocess.Popen(
                [BIN, "serve", "-m", MODEL, "--host", "127.0.0.1", "--port", str(port),
                 *self.args], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=self._stderr)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                try:
                    status, body = http_get(self.url + "/health", timeout=2)
                except OSError:  # not listening yet
                    status = None
                if status == 200:
                    assert json.loads(body)["status"] == "ok", body
                    return self
                if status is not None:  # listening while the model loads
                    assert status == 503 and json.loads(body) == {"status": "loading"}, \
                        (status, body)
                    self.saw_loading = True
                time.sleep(0.05)
            else:
                self.proc.kill()
                self.proc.wait()
                self._close_stderr()
                raise AssertionError(f"kvserve not healthy within {timeout} s:\n{self.stderr()}")
            self._close_stderr()
            err = self.stderr()
            if "in use" in err.lower() and attempt < 2:
                continue
            raise AssertionError(f"kvserve exited with {self.proc.returncode} at start:\n{err}")
        raise AssertionError("no free port")

    def stderr(self):
        if self._stderr.closed:
            return self._stderr_text
        self._stderr.flush()
        self._stderr.seek(0)
        return self._stderr.read()

    def _close_stderr(self):
        self._stderr_text = self.stderr()
        self._stderr.close()

    def check_stderr(self):
        err = self.stderr()
        for marker in SANITIZER_MARKERS:
            assert marker not in err, f"sanitizer report in kvserve's stderr:\n{err}"

    def _remove_own_cache_dir(self):
        if self._own_cache_dir:
            shutil.rmtree(self._own_cache_dir, ignore_errors=True)

    def terminate(self, timeout=20):
        """SIGTERM; asserts a clean exit (code 0 within `timeout` s, no sanitizer report).
        Returns the seconds the exit took."""
        try:
            return self._terminate(timeout)
        finally:
            self._remove_own_cache_dir()

    def _terminate(self, timeout):
        if getattr(self, "killed", False):
            return 0.0
        if self.proc.poll() is None:
            t0 = time.monotonic()
            self.proc.send_signal(signal.SIGTERM)
            try:
                rc = self.proc.wait(timeout=timeout * max(1, SLOW // 2))
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"kvserve did not exit within {timeout} s of SIGTERM:\n"
                                     f"{self.stderr()}")
            took = time.monotonic() - t0
        else:
            rc, took = self.proc.returncode, 0.0
        self._close_stderr()
        self.check_stderr()
        assert rc == 0, f"kvserve exited with {rc}:\n{self.stderr()}"
        return took

    def kill9(self):
        """SIGKILL, as a crash would: no shutdown, no flush."""
        self.proc.kill()
        self.proc.wait()
        self.killed = True
        self._close_stderr()
        self.check_stderr()

    def get_json(self, path, api_key=None):
        req = urllib.request.Request(self.url + path)
        if api_key:
            req.add_header("Authorization", f"Bearer {api_key}")
        with urllib.request.urlopen(req, timeout=30 * SLOW) as r:
            return json.loads(r.read())

    def post_json(self, path, body, api_key=None, timeout=300):
        """(status, parsed JSON) of a POST; HTTP errors are returned, not raised."""
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        if api_key:
            req.add_header("Authorization", f"Bearer {api_key}")
        try:
            with urllib.request.urlopen(req, timeout=timeout * SLOW) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def metrics(self):
        """The /metrics samples as {'name{labels}': value}."""
        status, text = http_get(self.url + "/metrics")
        assert status == 200, text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                out[key] = float(value)
        return out

    def client(self, api_key="x", **kw):
        import openai
        kw.setdefault("timeout", 120 * SLOW)
        kw.setdefault("max_retries", 0)
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, **kw)


@pytest.fixture(scope="session")
def server(model_path):
    """The default server, shared by the tests (context 2048, 16 sequences)."""
    s = KvServer(["-c", str(DEFAULT_CTX)]).start()
    yield s
    s.terminate()


@pytest.fixture
def tmp_dir():
    """Factory for temporary directories: tmp_dir(prefix) makes one in the system's temporary
    directory. Each is removed with its contents when the test ends, pass or fail, after the
    servers of start_server have stopped (which depends on this fixture for that order), and
    unmounted first if the test mounted a file system there."""
    made = []

    def make(prefix):
        made.append(tempfile.mkdtemp(prefix=prefix))
        return made[-1]

    yield make
    for d in made:
        if os.path.ismount(d):
            subprocess.run(["umount", d])
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def start_server(model_path, tmp_dir):
    """Factory for short-lived servers with their own options: start_server(*args, env=...).
    Each is shut down (and checked for a clean exit) when the test ends."""
    started = []

    def start(*args, env=None, model_id=None):
        s = KvServer(args, env=env, model_id=model_id).start()
        started.append(s)
        return s

    yield start
    # every server is stopped (and its directories freed) even when one exits badly
    failures = []
    for s in started:
        try:
            s.terminate()
        except AssertionError as e:
            failures.append(e)
    if failures:
        raise failures[0]
