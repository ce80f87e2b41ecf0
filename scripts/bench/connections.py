#!/usr/bin/env python3
"""Many connections against `kvserve serve` (or any OpenAI-compatible server with --url):
idle connections held, memory per connection, and requests/s of GET /health and of 1-token
completions at several client counts. Prints a table.

1. Idle: opens --idle connections that each send half a request line and stop (a slowloris, or
   idle keep-alive clients behind a proxy), then times /health and a 4-token completion while
   they are held, counts how many the server still holds, and divides the server's RSS growth
   by that count. With --idle-timeout T (given to the server it starts), waits T + 3 s and
   counts the connections still open.
2. Throughput: for each level in --levels, that many clients on keep-alive connections send
   requests back to back for --seconds; requests/s is the answers (any status) over the time,
   with the count of non-200 answers and the median latency beside it. The clients are one
   Python process (asyncio), so at high rates the numbers bound the client as much as the server.

    python3 scripts/bench/connections.py [--bin build/kvserve] [--idle 10000] [--levels 1,64,1000]
    python3 scripts/bench/connections.py --url http://127.0.0.1:8080 --pid PID  # another server
    python3 scripts/bench/connections.py --llama-server build/llamacpp/avx512/bin/llama-server

--llama-server starts llama.cpp's server (scripts/bench/build_llamacpp.sh) on the same model,
threads and per-sequence context (16 slots of 512 tokens), its --timeout set to --idle-timeout,
everything else as it comes.
"""
import argparse
import asyncio
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def wait_up(url, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
                return json.loads(r.read())["data"][0]["id"]
        except OSError:
            time.sleep(0.1)
    sys.exit("the server did not come up")


def timed_post(url, path, body, timeout=30):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        status = e.code
    except OSError:  # no answer within the timeout, or the connection closed
        status = "no answer"
    return status, time.perf_counter() - t0


def timed_get(url, timeout=30):
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        status = e.code
    except OSError:
        status = "no answer"
    return status, time.perf_counter() - t0


def still_open(s):
    s.setblocking(False)
    try:
        return s.recv(4096) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def idle_phase(url, pid, model, n, idle_timeout):
    host, port = url.split("//")[1].split(":")
    rss0 = rss_kib(pid) if pid else 0
    socks, t_open = [], time.monotonic()
    for _ in range(n):
        try:
            s = socket.create_connection((host, int(port)), timeout=10)
            s.sendall(b"GET /health HTTP/1.1\r\nHo")
            socks.append(s)
        except OSError:
            break
    time.sleep(1.0)
    status_h, t_health = timed_get(url + "/health")
    status_c, t_comp = timed_post(url, "/v1/completions", {
        "model": model, "prompt": "Hello", "max_tokens": 4, "ignore_eos": True})
    held = sum(still_open(s) for s in socks)
    rss1 = rss_kib(pid) if pid else 0
    closed_after = None
    if idle_timeout:
        time.sleep(max(0.0, t_open + idle_timeout + 3 - time.monotonic()))
        closed_after = sum(not still_open(s) for s in socks)
    for s in socks:
        s.close()
    return {"opened": len(socks), "held": held, "health": (status_h, t_health),
            "completion": (status_c, t_comp), "rss0": rss0, "rss1": rss1,
            "closed_after": closed_after}


async def client(host, port, request, stop_at, lat, statuses):
    """One keep-alive client sending `request` back to back until stop_at, opening a new
    connection when the server closes one (llama-server closes after 100 requests)."""
    while time.perf_counter() < stop_at:
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:
            statuses["connect failed"] = statuses.get("connect failed", 0) + 1
            return
        try:
            while time.perf_counter() < stop_at:
                t0 = time.perf_counter()
                writer.write(request)
                status_line = await reader.readline()
                if not status_line:
                    statuses["closed"] = statuses.get("closed", 0) + 1
                    break
                status = int(status_line.split()[1])
                length, close = 0, False
                while True:
                    line = await reader.readline()
                    if line in (b"\r\n", b""):
                        break
                    k, _, v = line.decode().partition(":")
                    if k.lower() == "content-length":
                        length = int(v)
                    elif k.lower() == "connection" and v.strip().lower() == "close":
                        close = True
                await reader.readexactly(length)
                lat.append(time.perf_counter() - t0)
                statuses[status] = statuses.get(status, 0) + 1
                if close:
                    break
        except (OSError, asyncio.IncompleteReadError, ValueError):
            statuses["error"] = statuses.get("error", 0) + 1
            return
        finally:
            writer.close()


async def load(url, request, n_clients, seconds):
    host, port = url.split("//")[1].split(":")
    lat, statuses = [], {}
    t0 = time.perf_counter()
    stop_at = t0 + seconds
    # a client still waiting 30 s after the end is counted as unanswered (a server whose
    # threads are all held stops answering)
    done = await asyncio.gather(*(asyncio.wait_for(
        client(host, int(port), request, stop_at, lat, statuses), seconds + 30)
        for _ in range(n_clients)), return_exceptions=True)
    late = sum(isinstance(d, asyncio.TimeoutError) for d in done)
    if late:
        statuses["no answer in 30 s"] = late
    took = time.perf_counter() - t0
    return len(lat) / took, statuses, statistics.median(lat) if lat else float("nan")


def http_request(method, path, body=None):
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"  # a loopback name: others are refused
    if body is None:
        return (head + "\r\n").encode()
    data = json.dumps(body).encode()
    return (head + f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
            ).encode() + data


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "kvserve"))
    ap.add_argument("--model", default=os.path.join(ROOT, "models",
                                                    "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--url", help="measure a running server instead of starting kvserve")
    ap.add_argument("--llama-server", help="start this llama-server instead of kvserve")
    ap.add_argument("--pid", type=int, help="that server's process id (for its RSS)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--idle", type=int, default=10000, help="idle connections to open")
    ap.add_argument("--idle-timeout", type=int, default=5)
    ap.add_argument("--levels", default="1,64,1000")
    ap.add_argument("--seconds", type=float, default=10)
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    srv = None
    url, pid = args.url, args.pid
    name = url
    if not url and args.llama_server:
        port = free_port()
        url, name = f"http://127.0.0.1:{port}", "llama-server"
        srv = subprocess.Popen([
            args.llama_server, "-m", args.model, "--host", "127.0.0.1", "--port", str(port),
            "-t", str(args.threads), "-c", str(512 * 16), "-np", "16",
            "--timeout", str(args.idle_timeout), "--log-disable"], cwd=ROOT,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        pid = srv.pid
    elif not url:
        name = "kvserve"
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        srv = subprocess.Popen([
            args.bin, "serve", "-m", args.model, "--port", str(port), "-t", str(args.threads),
            "-c", "512", "--max-connections", str(args.idle + max(levels) + 100),
            "--max-queue", str(2 * max(levels)), "--idle-timeout", str(args.idle_timeout),
            "--cache-dir", "off", "--log-level", "warn"], cwd=ROOT)
        pid = srv.pid
    try:
        model = wait_up(url)
        idle = idle_phase(url, pid, model, args.idle, args.idle_timeout if srv else 0)
        health = http_request("GET", "/health")
        comp = http_request("POST", "/v1/completions",
                            {"model": model, "prompt": "Hello", "max_tokens": 1})
        rows = []
        for n in levels:
            for name, req in (("GET /health", health), ("1-token completion", comp)):
                rps, statuses, med = asyncio.run(load(url, req, n, args.seconds))
                rows.append((name, n, rps, med, statuses))
        rss_end = rss_kib(pid) if pid else 0
    finally:
        if srv:
            srv.terminate()
            srv.wait()

    print(f"\n{name}: {os.cpu_count()} CPUs, {args.threads} compute "
          f"threads\n")
    print("| idle connections | opened | held | /health while held | 4-token completion "
          "while held | server RSS growth | per connection | closed after idle timeout + 3 s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    grow = idle["rss1"] - idle["rss0"]
    per = grow / idle["held"] if idle["held"] else float("nan")
    closed = "-" if idle["closed_after"] is None else f"{idle['closed_after']}"
    print(f"| {args.idle} | {idle['opened']} | {idle['held']} | {idle['health'][0]} in "
          f"{idle['health'][1] * 1e3:.0f} ms | {idle['completion'][0]} in "
          f"{idle['completion'][1] * 1e3:.0f} ms | {grow / 1024:.1f} MiB | {per:.1f} KiB | "
          f"{closed} |")
    print("\n| request | clients | requests/s | median latency ms | answers |")
    print("|---|---:|---:|---:|---|")
    for name, n, rps, med, statuses in rows:
        answers = ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items(), key=str))
        print(f"| {name} | {n} | {rps:.0f} | {med * 1e3:.2f} | {answers} |")
    if pid:
        print(f"\nserver RSS at the end: {rss_end / 1024:.1f} MiB")


if __name__ == "__main__":
    main()
