"""What the server benchmarks share: a `kvserve serve` process on a free port, waited for until
healthy, and JSON requests to it."""
import http.client
import json
import os
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """kvserve serve -m MODEL -t THREADS --port P plus `extra` arguments; exits the script when it
    does not become healthy within two minutes."""

    def __init__(self, binary, model, threads, extra):
        self.model = os.path.basename(model)[:-len(".gguf")]
        self.port = free_port()
        self.proc = subprocess.Popen(
            [binary, "serve", "-m", model, "-t", str(threads), "--port", str(self.port),
             "--log-level", "warn", *extra], cwd=ROOT, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if self.request("GET", "/health")[0] == 200:
                    return
            except OSError:
                pass
            if self.proc.poll() is not None:
                sys.exit(f"kvserve exited with {self.proc.returncode}")
            time.sleep(0.05)
        sys.exit("kvserve did not become healthy")

    def request(self, method, path, body=None):
        """(status, parsed JSON body or None)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=900)
        conn.request(method, path, json.dumps(body) if body is not None else None,
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        data = r.read()
        return r.status, json.loads(data) if data else None

    def stream(self, path, body):
        """Sends a streamed request; returns (the send time, the response) to read SSE from."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=900)
        t0 = time.perf_counter()
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            sys.exit(f"HTTP {resp.status}: {resp.read()[:300]!r}")
        return t0, resp

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=120)


def sse_events(resp):
    """The parsed `data:` events of a streamed response, without the final [DONE]."""
    for raw in resp:
        line = raw.strip()
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            yield json.loads(line[6:])
