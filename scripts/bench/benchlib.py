"""What the server benchmarks share: a `kvserve serve` process on a free port, waited for until
healthy, and JSON requests to it."""
import http.client
import json
import os
import re
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")


def add_server_args(ap):
    """The options every benchmark that starts kvserve takes: its binary, the model and the
    compute threads."""
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "kvserve"))
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--threads", type=int, default=2)


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
        try:
            self.wait_healthy(120)
        except BaseException:  # not left running when it fails or the script is interrupted
            self.kill()
            raise

    NAME = "kvserve"

    def wait_healthy(self, seconds):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                if self.request("GET", "/health")[0] == 200:
                    return
            except OSError:
                pass
            if self.proc.poll() is not None:
                sys.exit(f"{self.NAME} exited with {self.proc.returncode}")
            time.sleep(0.05)
        sys.exit(f"{self.NAME} did not become healthy")

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

    def chat_stream(self, body):
        """Streams a chat completion (body gets "model" and "stream"): (seconds to the first
        content, or to the end when there was none; the text; the first token's top logprobs as
        {token: logprob}, or None; usage, when asked for; the tokens' texts, when logprobs were
        asked for). Exits the script on an error event."""
        t0, resp = self.stream("/v1/chat/completions",
                               {"model": self.model, "stream": True, **body})
        t_first, text, first_lp, usage, toks = None, "", None, None, []
        for ev in sse_events(resp):
            if "error" in ev:
                sys.exit(f"error: {ev['error']}")
            for ch in ev.get("choices") or []:
                piece = ch.get("delta", {}).get("content")
                if piece and t_first is None:
                    t_first = time.perf_counter() - t0
                text += piece or ""
                lps = (ch.get("logprobs") or {}).get("content") or []
                toks += [t["token"] for t in lps]
                if lps and first_lp is None:
                    first_lp = {t["token"]: t["logprob"] for t in lps[0]["top_logprobs"]}
            if ev.get("usage"):
                usage = ev["usage"]
        if t_first is None:
            t_first = time.perf_counter() - t0
        return t_first, text, first_lp, usage, toks

    def stop(self):
        """SIGTERM: running requests finish and the cache's queued writes are flushed; killed
        when that takes over two minutes."""
        self.proc.terminate()
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self):
        """At once, without draining (the script is failing or interrupted)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class LlamaServer(Server):
    """llama.cpp's llama-server (scripts/bench/build_llamacpp.sh builds it) -m MODEL -t THREADS
    --port P plus `extra` arguments (slots, context, speculation), the peer benchmarks compare
    kvserve with."""

    NAME = "llama-server"

    def __init__(self, binary, model, threads, extra):
        self.model = os.path.basename(model)[:-len(".gguf")]
        self.port = free_port()
        self.proc = subprocess.Popen(
            [binary, "-m", model, "-t", str(threads), "--port", str(self.port), *extra], cwd=ROOT,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            self.wait_healthy(300)
        except BaseException:
            self.kill()
            raise


def sse_events(resp):
    """The parsed `data:` events of a streamed response, without the final [DONE]."""
    for raw in resp:
        line = raw.strip()
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            yield json.loads(line[6:])


def license_passages(srv, texts, lo, hi):
    """Passages of lo-hi tokens (by srv's tokenizer): consecutive paragraphs of each licence text
    in /usr/share/common-licenses merged; a paragraph over hi tokens is skipped."""
    out = []
    for name in texts:
        path = os.path.join("/usr/share/common-licenses", name)
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            paras = [p.strip() for p in re.split(r"\n\s*\n", f.read()) if p.strip()]
        cur, n_cur = [], 0
        for p in paras:
            st, body = srv.request("POST", "/tokenize", {"content": p, "add_special": False})
            assert st == 200, body
            n = len(body["tokens"])
            if n > hi:
                continue
            if n_cur + n > hi:
                if n_cur >= lo:
                    out.append("\n\n".join(cur))
                cur, n_cur = [], 0
            cur.append(p)
            n_cur += n
        if n_cur >= lo:
            out.append("\n\n".join(cur))
    return out
