#!/usr/bin/env python3
"""A mixed soak of `kvserve serve`: --clients clients for --minutes, each looping over chat and
completion requests, streamed and not, some cancelled mid-stream (the client closes after a few
chunks), some sharing a long prefix (the context cache), a few malformed. Prints a table per
interval (requests, statuses, stream errors, the server's RSS) and a summary: 5xx answers,
stream error events and whether each is explained in the server's log (a line with its request
id), and the RSS growth after warm-up.

    python3 scripts/bench/soak.py [--bin build/kvserve] [--clients 48] [--minutes 10]
"""
import argparse
import http.client
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TOPICS = ["the sea", "a lighthouse", "bread", "volcanoes", "chess", "autumn", "bees", "trains",
          "the moon", "a market", "rivers", "owls", "glaciers", "the printing press"]
PREFIX = ("You are a helpful assistant. Answer briefly and precisely. The following notes are "
          "background for every question. " + "Notes: the valley had farms and mills. " * 20)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_kib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts = {}
        self.stream_errors = []  # (request id, error message)

    def add(self, key, n=1):
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + n

    def take(self):
        with self.lock:
            c, self.counts = self.counts, {}
            return c


def one_request(port, model, rng, stats, seq):
    kind = rng.random()
    rid = f"soak-{seq}"
    chat = rng.random() < 0.6
    stream = kind < 0.55
    cancel = stream and rng.random() < 0.2
    malformed = kind > 0.97
    topic = rng.choice(TOPICS)
    text = (PREFIX if rng.random() < 0.3 else "") + f"Write about {topic}."
    body = {"model": model, "max_tokens": rng.choice([8, 16, 32, 64, 128]),
            "temperature": rng.choice([0, 0.7]), "stream": stream}
    if chat:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": text}]
    else:
        path = "/v1/completions"
        body["prompt"] = text
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    data = json.dumps(body).encode()
    if malformed:
        data = data[:-3]
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json",
                                                        "X-Request-Id": rid})
        resp = conn.getresponse()
        stats.add(f"{resp.status}")
        if resp.status != 200 or not stream:
            resp.read()
            return
        stats.add("streams")
        chunks, done = 0, False
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            payload = line[6:]
            if payload == b"[DONE]":
                done = True
                break
            ev = json.loads(payload)
            if "error" in ev:
                stats.add("stream errors")
                with stats.lock:
                    stats.stream_errors.append((rid, ev["error"]["message"]))
                continue
            chunks += 1
            if cancel and chunks == 3:
                stats.add("cancelled")
                return
        if not done:
            stats.add("streams without [DONE]")
    except (OSError, http.client.HTTPException, ValueError) as e:
        stats.add(f"client error {type(e).__name__}")
    finally:
        conn.close()


def client_loop(port, model, stats, stop_at, seed, counter):
    rng = random.Random(seed)
    while time.monotonic() < stop_at:
        with counter["lock"]:
            counter["n"] += 1
            seq = counter["n"]
        one_request(port, model, rng, stats, seq)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "kvserve"))
    ap.add_argument("--model", default=os.path.join(ROOT, "models",
                                                    "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--clients", type=int, default=48)
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--interval", type=float, default=60, help="seconds per table row")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="kvserve-soak-", suffix=".log", delete=False)
    cache_dir = tempfile.mkdtemp(prefix="kvserve-soak-cache-")
    srv = subprocess.Popen([
        args.bin, "serve", "-m", args.model, "--port", str(port), "-t", str(args.threads),
        "-c", "2048", "--max-queue", str(4 * args.clients), "--cache-dir", cache_dir,
        "--cache-ram-bytes", "256M", "--cache-disk-bytes", "1G"],
        cwd=ROOT, stderr=log, stdout=subprocess.DEVNULL)
    model = None
    for _ in range(600):
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/v1/models")
            r = c.getresponse()
            if r.status == 200:
                model = json.loads(r.read())["data"][0]["id"]
                break
        except OSError:
            pass
        time.sleep(0.1)
    if model is None:
        srv.kill()
        sys.exit("the server did not come up")

    stats, counter = Stats(), {"n": 0, "lock": threading.Lock()}
    t0 = time.monotonic()
    stop_at = t0 + args.minutes * 60
    threads = [threading.Thread(target=client_loop, args=(port, model, stats, stop_at, i, counter),
                                daemon=True) for i in range(args.clients)]
    for t in threads:
        t.start()
    rows, total = [], {}

    def row():
        c = stats.take()
        for k, v in c.items():
            total[k] = total.get(k, 0) + v
        rows.append((time.monotonic() - t0, c, rss_kib(srv.pid)))

    while time.monotonic() < stop_at:
        time.sleep(max(0.0, min(args.interval, stop_at - time.monotonic())))
        row()
    for t in threads:  # requests under way when the time ran out
        t.join(timeout=300)
    row()
    srv.terminate()
    rc = srv.wait(timeout=120)
    log.close()
    with open(log.name) as f:
        text = f.read()

    keys = sorted({k for _, c, _ in rows for k in c}, key=str)
    print(f"\nsoak: {args.clients} clients, {args.minutes:g} min, server exit code {rc}\n")
    print("| t s | " + " | ".join(keys) + " | RSS MiB |")
    print("|---:|" + "---:|" * len(keys) + "---:|")
    for t, c, rss in rows:
        print(f"| {t:.0f} | " + " | ".join(str(c.get(k, 0)) for k in keys) +
              f" | {rss / 1024:.1f} |")
    fivexx = sum(v for k, v in total.items() if k.isdigit() and int(k) >= 500)
    unexplained = [(rid, m) for rid, m in stats.stream_errors
                   if f"id={rid}: the stream ended with an error event" not in text]
    warm = [rss for t, _, rss in rows if t >= min(120, args.minutes * 30)]
    growth = (warm[-1] - warm[0]) / 1024 if len(warm) >= 2 else float("nan")
    print(f"\nrequests {sum(v for k, v in total.items() if k.isdigit())}, 5xx {fivexx}, "
          f"stream error events {len(stats.stream_errors)} ({len(unexplained)} not in the log), "
          f"RSS after warm-up {warm[0] / 1024 if warm else float('nan'):.1f} -> "
          f"{warm[-1] / 1024 if warm else float('nan'):.1f} MiB ({growth:+.1f})")
    for rid, m in stats.stream_errors[:10]:
        print(f"  stream error {rid}: {m}")
    print(f"server log: {log.name}")
    subprocess.run(["rm", "-rf", cache_dir])


if __name__ == "__main__":
    main()
