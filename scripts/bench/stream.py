#!/usr/bin/env python3
"""KV over the network (issue 16): time to first token when a long context's KV is in a Redis
behind a link of a given bandwidth, for each way of getting it: recomputing it from its text,
fetching it lossless (f16), 8-bit per token, at each codec level, and adaptive (the server picks
each chunk's level to fit a TTFT budget); with the quality of each against exact KV.

The link. redis-server runs in a network namespace of its own, joined to the host by a veth
pair (a /30 in 10.77.0.0/16), without persistence, --maxmemory 2gb and no eviction (a write
that does not fit is refused, never an older key silently dropped). tc shapes the egress of
both ends with tbf at the rate (burst 2 ms of it, at least 16 KiB; queue 50 ms) and, with
--delay-ms, a netem delay under it on each side (the round trip gains twice that): the host's
end carries kvserve's requests and writes, the namespace's end Redis's replies, the direction
that matters. The script makes the namespace, the pair, the qdiscs and redis-server itself and
removes them on exit, SIGINT and SIGTERM included (names carry the script's pid). Without the
rights to (root, or CAP_NET_ADMIN and CAP_SYS_ADMIN) it says which step failed and exits 0 with
SKIPPED. Each rate's real throughput is measured first, one GET of a 20 MB value over a plain
socket (best of 2), so the table says what tc gave.

The method.
  1. Instance A (an empty cache directory, --redis to the namespace) computes the context with
     the link unshaped: a system prompt of about --context-tokens tokens of licence text (as
     bench-ttft's, not a multiple of the chunk) through the chat template, then one question;
     and a warm-up context of 600 tokens the same way. Their chunk records go to Redis in the
     background; A is stopped (which flushes what is still queued) once its Redis tier has
     written nothing more for 2 s.
  2. For each rate, the link is shaped, and for each repetition and each mode a fresh instance
     B is started (its own empty cache directory, the same Redis, no --ttft-budget-ms) and
     warmed up as an instance that has served requests is: the warm-up context without the
     cache (its compute speed measured), then, where the binary has levels, again with
     "ttft_budget_ms": 1 (the link's throughput and decode costs measured on the values it
     fetches). Then the context and a question never asked before, streamed ("blend": false:
     blend would find the context by content). TTFT is the time from sending it to the first
     streamed content. B is restarted for every request, so its pool, RAM and disk never hold
     the context: every chunk comes from Redis or from the text. The bytes B read from Redis
     and `usage.kv_chunks` (the tier and level of each chunk) are kept with each time. B is
     then killed, not stopped, so what it would still write to Redis is dropped and every B
     finds there just what A wrote.

  mode                  request fields
  text recompute        "kv_level": "text" (a binary without levels: "cache": false); the
                        chunks computed are stored again, as any computed chunk is
  recompute, cache off  "cache": false: nothing read or stored (with levels only; without,
                        it is the row above)
  lossless (f16)        "kv_level": "lossless" (a binary without levels: none; all it has)
  8-bit per token       "kv_level": "q8"
  codec level 0..3      "kv_level": "codec0" .. "codec3"
  adaptive, fastest     "ttft_budget_ms": 1 (no level fits: the fastest of the coarsest
                        level and recomputing each chunk)
  adaptive, budget      "ttft_budget_ms": --budget-ms

The binary has the levels when `kvserve serve --help` lists --ttft-budget-ms or B's first answer
(lossless) carries usage.kv_chunks; where it has not, the modes it lacks are listed as such and
not run (it would ignore their fields and serve lossless). Where it has --redis-codec, the
model's codec table is made first (`kvserve calibrate`, when missing or older than the binary):
every instance finds it beside the model.

Quality: `kvserve codec-eval` (after `kvserve calibrate` when the model's table is missing or
older than the binary) over the licence corpus of bench-codec, --eval-windows windows of 1024
context tokens: perplexity of the held-out text and greedy agreement against exact KV for fp16,
8-bit per token and each level. Text recompute is exact by construction (a token's KV does not
depend on what else was cached). Adaptive's quality is that of the levels it used. Then, where
the binary has levels, what the server serves (codec-eval codes the KV itself, not through the
Redis tier): --quality-questions questions, each asked of a fresh B per fixed level over the
unshaped link, 16 greedy tokens with the first token's top-20 logprobs; KL(text || level) of
that first distribution (blend.py's kl) and how many answers are text recompute's word for word.

The table: median TTFT of --reps per mode and rate, the levels adaptive used (c3x15: 15 chunks at
codec level 3; t: recomputed from text), the ratios the issue's targets name (adaptive against
the best of text and 8-bit at every rate, >= 2x faster than 8-bit at 200 Mbps; under a budget,
met wherever the coarsest level met it), then the megabytes read from Redis per request.

    python3 scripts/bench/stream.py [--bin build/kvserve] [--model MODEL] [--threads 2]
        [--rates 50,200,1000,3000] [--reps 2] [--context-tokens 4000] [--budget-ms 1500]
        [--delay-ms 0] [--eval-windows 2] [--quality-questions 3] [--redis-timeout-ms MS]
        [--modes text,lossless,...] [--link-only]
"""
import argparse
import collections
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import benchlib
import blend
import codec
import ttft
from benchlib import ROOT

LEVELS = ["lossless", "q8", "codec0", "codec1", "codec2", "codec3"]
# (key, name in the table, request fields); the budget mode's fields are filled in by main
MODES = [("lossless", "lossless (f16)", {"kv_level": "lossless"}),
         ("text", "text recompute", {"kv_level": "text"}),
         ("nocache", "recompute, cache off", {"cache": False}),
         ("q8", "8-bit per token", {"kv_level": "q8"}),
         *[(f"codec{i}", f"codec level {i}", {"kv_level": f"codec{i}"}) for i in range(4)],
         ("adaptive", "adaptive, fastest", {"ttft_budget_ms": 1}),
         ("budget", "adaptive, budget", None)]
# what a binary without levels gets for the two modes it has
NO_LEVELS = {"lossless": {}, "text": {"cache": False}}
# codec-eval's method names
EVAL_NAMES = {"fp16": "lossless", "8-bit per token": "q8", **{f"level {i}": f"codec{i}"
                                                           for i in range(4)}}
SHORT = {"lossless": "L", "q8": "q8", "text": "t", **{f"codec{i}": f"c{i}" for i in range(4)}}
MAX_TOKENS = 4
WARM_TOKENS = 600  # the warm-up context: two chunks and a part
PROBE_KEY, PROBE_BYTES = "kvserve-bench:probe", 20_000_000


class Skip(Exception):
    """The machine cannot run this benchmark; the message says why."""


def sh(cmd, what=None):
    """Runs cmd; on failure raises Skip (when `what` names the step, the rights it needs) or
    RuntimeError, with the command's own message."""
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        msg = f"{' '.join(cmd)}: {(r.stderr or r.stdout).strip() or f'exit {r.returncode}'}"
        if what:
            raise Skip(f"{what} failed ({msg})")
        raise RuntimeError(msg)
    return r.stdout


class Resp:
    """A minimal Redis client (RESP2) over one TCP connection: enough for PING, SET, GET, DBSIZE
    and INFO, and to time a GET."""

    def __init__(self, host, port, timeout=600):
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.f = self.sock.makefile("rb")

    def command(self, *args):
        out = [b"*%d\r\n" % len(args)]
        for a in args:
            a = a if isinstance(a, bytes) else str(a).encode()
            out += [b"$%d\r\n" % len(a), a, b"\r\n"]
        self.sock.sendall(b"".join(out))
        return self.reply()

    def reply(self):
        line = self.f.readline()
        if not line.endswith(b"\r\n"):
            raise ConnectionError("Redis closed the connection")
        kind, rest = line[:1], line[1:-2]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            raise RuntimeError(f"Redis: {rest.decode()}")
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            data = self.f.read(n + 2)
            if len(data) != n + 2:
                raise ConnectionError("Redis closed the connection inside a reply")
            return data[:-2]
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self.reply() for _ in range(n)]
        raise RuntimeError(f"unexpected Redis reply {line[:40]!r}")

    def close(self):
        self.f.close()
        self.sock.close()


class Link:
    """redis-server in a network namespace behind a veth pair that tc shapes. Everything made is
    remembered and removed by close(), which is safe to call at any point of the set-up."""

    def __init__(self, delay_ms):
        pid = os.getpid()
        self.ns, self.host_if, self.ns_if = f"kvstream{pid}", f"kvs{pid}h", f"kvs{pid}n"
        self.delay_ms = delay_ms
        self.redis = None
        self.made_ns = self.made_if = False

    def open(self, workdir):
        """Makes the namespace, the pair and redis-server; Skip when this machine cannot."""
        pid = os.getpid()
        for tool in ("ip", "tc", "redis-server"):
            if not shutil.which(tool):
                raise Skip(f"{tool} is not installed")
        sh(["ip", "netns", "add", self.ns], "creating a network namespace (needs root or "
           "CAP_SYS_ADMIN)")
        self.made_ns = True
        sh(["ip", "netns", "exec", self.ns, "true"], "entering the namespace (needs root or "
           "CAP_SYS_ADMIN)")
        sh(["ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if,
            "netns", self.ns], "creating a veth pair (needs root or CAP_NET_ADMIN)")
        self.made_if = True
        self.host_ip, self.ns_ip = free_subnet(pid)
        sh(["ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_if])
        sh(["ip", "link", "set", self.host_if, "up"])
        sh(["ip", "-n", self.ns, "addr", "add", f"{self.ns_ip}/30", "dev", self.ns_if])
        sh(["ip", "-n", self.ns, "link", "set", self.ns_if, "up"])
        sh(["ip", "-n", self.ns, "link", "set", "lo", "up"])
        # the qdiscs once, to know tc can make them here, then off for A's writes
        self.shape(1000)
        self.shape(None)
        self.port = 6379
        self.url = f"redis://{self.ns_ip}:{self.port}"
        self.redis = subprocess.Popen(
            ["ip", "netns", "exec", self.ns, "redis-server", "--bind", self.ns_ip, "--port",
             str(self.port), "--protected-mode", "no", "--save", "", "--appendonly", "no",
             "--maxmemory", "2gb", "--maxmemory-policy", "noeviction", "--dir", workdir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                r = self.client(timeout=1)
                r.command("PING")
                break
            except OSError:
                if self.redis.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.redis.returncode} "
                                       f"at start in namespace {self.ns}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not answer on {self.url}")
                time.sleep(0.05)
        # the probe value for the throughput measurement, written while the link is unshaped
        r.command("SET", PROBE_KEY, os.urandom(PROBE_BYTES))
        r.close()

    def client(self, timeout=600):
        return Resp(self.ns_ip, self.port, timeout)

    def shape(self, mbps):
        """Both ends' egress at mbps (None: unshaped)."""
        for dev, ns in ((self.host_if, None), (self.ns_if, self.ns)):
            tc = ["tc", *(["-n", ns] if ns else []), "qdisc"]
            subprocess.run([*tc, "del", "dev", dev, "root"], capture_output=True)
            if mbps is None:
                continue
            burst = max(16384, int(mbps * 1e6 / 8 * 0.002))
            tbf = ["tbf", "rate", f"{int(mbps * 1000)}kbit", "burst", str(burst), "latency",
                   "50ms"]
            if self.delay_ms:
                sh([*tc, "add", "dev", dev, "root", "handle", "1:", "netem", "delay",
                    f"{self.delay_ms:g}ms", "limit", "100000"],
                   "adding a netem qdisc for --delay-ms (needs a kernel with sch_netem)")
                sh([*tc, "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf],
                   "adding a tbf qdisc (needs a kernel with sch_tbf)")
            else:
                sh([*tc, "add", "dev", dev, "root", *tbf],
                   "adding a tbf qdisc (needs a kernel with sch_tbf)")

    def throughput(self):
        """Bytes/s of a GET of the probe value (best of 2, each on a new connection)."""
        best = 0
        for _ in range(2):
            r = self.client()
            t0 = time.perf_counter()
            n = len(r.command("GET", PROBE_KEY))
            best = max(best, n / (time.perf_counter() - t0))
            r.close()
        return best

    def info(self):
        """(keys, MB of memory used) in Redis."""
        r = self.client()
        keys = r.command("DBSIZE")
        mem = r.command("INFO", "memory").decode()
        r.close()
        used = next(int(x.split(":")[1]) for x in mem.split() if x.startswith("used_memory:"))
        return keys, used / 1e6

    def close(self):
        if self.redis and self.redis.poll() is None:
            self.redis.kill()
        if self.redis:
            self.redis.wait()
        if self.made_ns:  # its end of the pair goes with it, and the pair with that end
            subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)
        if self.made_if:
            subprocess.run(["ip", "link", "del", self.host_if], capture_output=True)


def free_subnet(seed):
    """(host, namespace) addresses of a /30 in 10.77.0.0/16 that no interface here uses."""
    used = sh(["ip", "-o", "-4", "addr"]) + sh(["ip", "-4", "route"])
    for k in range(16384):
        base = 4 * ((seed + k) % 16384)
        net = f"10.77.{base // 256}.{base % 256}"
        hosts = [f"10.77.{base // 256}.{base % 256 + i}" for i in (1, 2)]
        if not any(f"{a}/" in used or f"{a} " in used for a in [net, *hosts]):
            return hosts
    raise RuntimeError("no free /30 in 10.77.0.0/16")


class Server(benchlib.Server):
    def __init__(self, args, cache_dir, redis_url):
        timeout = ["--redis-timeout-ms", str(args.redis_timeout_ms)] if args.redis_timeout_ms \
            else []
        super().__init__(args.bin, args.model, args.threads,
                         ["-c", str(args.context_tokens + 512), "--cache-dir", cache_dir,
                          "--redis", redis_url, *timeout])

    def redis_stats(self):
        st, body = self.request("GET", "/v1/cache/stats")
        assert st == 200, body
        return body["tiers"]["redis"]

    def wait_redis_writes(self, quiet_s=2.0, timeout_s=300):
        """Waits until the Redis tier has written something and then nothing for quiet_s."""
        deadline = time.monotonic() + timeout_s
        last, since = None, time.monotonic()
        while time.monotonic() < deadline:
            st = self.redis_stats()
            n = (st["bytes_in"], st["write_errors"], st["dropped_writes"])
            if n != last:
                last, since = n, time.monotonic()
            elif n[0] > 0 and time.monotonic() - since >= quiet_s:
                return st
            time.sleep(0.2)
        sys.exit(f"the Redis tier's writes did not settle in {timeout_s} s: {st}")


Run = collections.namedtuple("Run", "ttft usage redis text first_lp")


def ask(args, url, cache_dir, warm, sysmsg, question, fields, levels, max_tokens=MAX_TOKENS,
        extra=None):
    """One request on a fresh instance B, after the warm-up (none when warm is None): Run(TTFT
    in s, usage, B's Redis tier stats after less the warm-up's, the answer, its first token's
    top logprobs when asked for in extra)."""
    srv = Server(args, cache_dir, url)
    try:
        if warm:
            # the estimates adaptive chooses levels by, as an instance that has served requests
            # has them: compute per token (prefill steps of 64 tokens or more), then the link's
            # throughput and the decode costs (values of the warm-up context fetched at levels)
            srv.chat_stream({"messages": [warm, {"role": "user", "content": "Say hello."}],
                             "max_tokens": 1, "cache": False})
            if levels:
                srv.chat_stream({"messages": [warm, {"role": "user", "content": "Say hello."}],
                                 "max_tokens": 1, "blend": False, "ttft_budget_ms": 1})
        st0 = srv.redis_stats()
        t, text, first_lp, usage, _ = srv.chat_stream({
            "messages": [sysmsg, {"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": 0, "blend": False,
            "stream_options": {"include_usage": True}, **(extra or {}), **fields})
        st = {k: v - st0[k] if isinstance(v, int) and not isinstance(v, bool) else v
              for k, v in srv.redis_stats().items()}
    finally:
        # not stopped: what B would still write (its question's chunk; after a text recompute,
        # every chunk again) is dropped, so every B finds in Redis just what A wrote
        srv.kill()
        shutil.rmtree(cache_dir, ignore_errors=True)
    return Run(t, usage, st, text, first_lp)


def served_quality(args, link, workdir, sysmsg, modes):
    """The KV each fixed level serves against text recompute's (exact), end to end: for each of
    --quality-questions questions, the first token's top-20 distribution and a 16-token greedy
    answer per mode, a fresh B each, link unshaped. Lossy KV is never stored, so the lossy
    levels go first; lossless (which stores its question's chunk) and text follow.
    {mode: (mean KL(text || mode), answers identical to text's, questions)}."""
    order = [k for k in ("q8", "codec0", "codec1", "codec2", "codec3", "lossless", "text")
             if k in {m[0] for m in modes}]
    if args.quality_questions <= 0 or "text" not in order:
        return {}
    fields = dict((k, f) for k, _, f in modes)
    link.shape(None)
    got = collections.defaultdict(list)
    for i in range(args.quality_questions):
        q = f"Quality check {i}: {ttft.QUESTIONS[i % len(ttft.QUESTIONS)]}"
        for key in order:
            r = ask(args, link.url, os.path.join(workdir, f"q{i}{key}"), None, sysmsg, q,
                    fields[key], True, 16, {"logprobs": True, "top_logprobs": 20})
            got[key].append(r)
        print(f"quality check {i + 1}/{args.quality_questions} done", file=sys.stderr)
    out = {}
    for key in order:
        kls = [blend.kl(ref.first_lp, r.first_lp) for ref, r in zip(got["text"], got[key])]
        same = sum(ref.text == r.text for ref, r in zip(got["text"], got[key]))
        out[key] = (statistics.mean(kls), same, len(kls))
    return out


def eval_quality(args, workdir):
    """{mode: (bytes/token, ppl vs exact, agreement)} from codec-eval, or {} when it fails."""
    if args.eval_windows <= 0:
        return {}
    codec.calibrate_if_stale(args.bin, args.model, args.threads)
    text = os.path.join(workdir, "licenses.txt")
    codec.write_corpus(text)
    print(f"codec-eval over {args.eval_windows} windows ...", file=sys.stderr)
    r = subprocess.run([args.bin, "codec-eval", "-m", args.model, "--text", text, "--windows",
                        str(args.eval_windows), "-t", str(args.threads)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        print(f"codec-eval failed: {r.stderr.strip()[-300:]}: no quality column",
              file=sys.stderr)
        return {}
    out, head = {}, None
    for line in r.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == "method":
            head = cells
        elif head and len(cells) == len(head) and cells[0] in EVAL_NAMES:
            row = dict(zip(head, cells))
            out[EVAL_NAMES[cells[0]]] = (row["bytes/token"], row["ppl vs exact"],
                                         row["agreement"])
    return out


def rate_name(mbps):
    return f"{mbps / 1000:g} Gbps" if mbps >= 1000 else f"{mbps:g} Mbps"


def levels_used(usage):
    """'c3x15 tx1' from usage.kv_chunks (chunks per level), '' when there are none."""
    n = collections.Counter(c.get("level", "?") for c in (usage or {}).get("kv_chunks") or [])
    return " ".join(f"{SHORT.get(lv, lv)}x{k}" for lv, k in sorted(n.items()))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    benchlib.add_server_args(ap)
    ap.add_argument("--rates", default="50,200,1000,3000", help="link rates in Mbit/s")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--context-tokens", type=int, default=4000,
                    help="system prompt length in tokens (about)")
    ap.add_argument("--budget-ms", type=int, default=1500,
                    help="the TTFT budget of the 'adaptive, budget' mode")
    ap.add_argument("--delay-ms", type=float, default=0,
                    help="netem delay on each direction (0: none)")
    ap.add_argument("--eval-windows", type=int, default=2,
                    help="codec-eval windows for the quality columns (0: leave them out)")
    ap.add_argument("--quality-questions", type=int, default=3,
                    help="questions of the served-quality check (0: leave it out)")
    ap.add_argument("--redis-timeout-ms", type=int, default=0,
                    help="kvserve's --redis-timeout-ms (0: the server's default)")
    ap.add_argument("--modes", default=",".join(k for k, _, _ in MODES),
                    help="modes to run, of " + ", ".join(k for k, _, _ in MODES)
                    + " (lossless runs first whatever the order: it tells whether the binary "
                    "has levels)")
    ap.add_argument("--link-only", action="store_true",
                    help="only set up the link and measure each rate's throughput")
    args = ap.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    wanted = set(args.modes.split(","))
    if wanted - {k for k, _, _ in MODES}:
        sys.exit(f"unknown modes: {', '.join(sorted(wanted - {k for k, _, _ in MODES}))}")
    modes = [(k, f"adaptive, budget {args.budget_ms} ms", {"ttft_budget_ms": args.budget_ms})
             if k == "budget" else (k, name, f) for k, name, f in MODES
             if k in wanted or k == "lossless"]
    for path in (args.bin, args.model):
        if not os.path.exists(path):
            sys.exit(f"{path} not found (make {os.path.relpath(path, ROOT)})")

    # signals unwind, so the finally below removes what was made
    def on_signal(signum, _frame):
        print(f"bench-stream: signal {signum}: removing what it made", file=sys.stderr)
        raise SystemExit(128 + signum)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)

    workdir = tempfile.mkdtemp(prefix="kvserve-stream-")
    link = Link(args.delay_ms)
    try:
        link.open(workdir)
        print(f"link: {link.host_if} {link.host_ip} <-> {link.ns_if} {link.ns_ip} in "
              f"namespace {link.ns}; redis-server at {link.url}", file=sys.stderr)
        if args.link_only:
            print("| rate | measured |\n|---|---:|")
            for mbps in rates:
                link.shape(mbps)
                bps = link.throughput()
                print(f"| {rate_name(mbps)} | {bps / 1e6:.1f} MB/s ({bps * 8 / 1e6:.0f} "
                      f"Mbit/s) |")
            return
        quality = eval_quality(args, workdir)
        results, link_bps, levels, served = run(args, link, workdir, rates, modes)
    except Skip as e:
        print(f"bench-stream: SKIPPED: {e}")
        return
    except (RuntimeError, OSError) as e:
        sys.exit(f"bench-stream: {e}")
    finally:
        link.close()
        shutil.rmtree(workdir, ignore_errors=True)
    report(args, rates, modes, results, link_bps, levels, quality, served)


def run(args, link, workdir, rates, modes):
    """Instance A computes the context, then every rate x rep x mode on a fresh B:
    ({(mode, rate): [Run]}, {rate: link bytes/s}, whether the binary has levels)."""
    help_text = subprocess.run([args.bin, "serve", "--help"], capture_output=True,
                               text=True).stdout
    # with levels, B's first answer says so again (usage.kv_chunks); without, it lists none
    levels = True if "--ttft-budget-ms" in help_text else None
    if "--redis-codec" in help_text:
        # the table the levels are coded with (--redis-codec auto finds it beside the model);
        # without one, every fresh B would calibrate its own at start
        codec.calibrate_if_stale(args.bin, args.model, args.threads)
    srv = Server(args, os.path.join(workdir, "a"), link.url)
    ok = False
    try:
        tag = f"stream {os.getpid()}.{time.time_ns()}"
        text = ttft.licence_text()
        sysmsg = {"role": "system", "content": ttft.system_prompt(
            srv, text, args.context_tokens, tag)}
        warm = {"role": "system", "content": ttft.system_prompt(srv, text, WARM_TOKENS,
                                                                f"{tag} warm-up")}
        for m in (warm, sysmsg):
            _, _, _, usage, _ = srv.chat_stream({
                "messages": [m, {"role": "user", "content": ttft.QUESTIONS[0]}],
                "max_tokens": 1, "temperature": 0, "blend": False,
                "stream_options": {"include_usage": True}})
        st = srv.wait_redis_writes()
        ok = True
    finally:
        if ok:
            srv.stop()  # flushes what is still queued
        else:
            srv.kill()
    if st["write_errors"] or st["dropped_writes"]:
        sys.exit(f"instance A's Redis writes failed: {st}")
    keys, mb = link.info()
    print(f"A: {usage['prompt_tokens']} prompt tokens; {st['bytes_in'] / 1e6:.1f} MB written "
          f"to Redis ({keys} keys, {mb:.0f} MB used)", file=sys.stderr)

    results, link_bps, k = {}, {}, 0
    for mbps in rates:
        link.shape(mbps)
        link_bps[mbps] = link.throughput()
        print(f"{rate_name(mbps)}: measured {link_bps[mbps] / 1e6:.1f} MB/s", file=sys.stderr)
        for rep in range(args.reps):
            for key, name, fields in modes:
                if levels is False and key not in NO_LEVELS:
                    continue
                if levels is False:
                    fields = NO_LEVELS[key]
                k += 1
                q = f"Question {k}: {ttft.QUESTIONS[k % len(ttft.QUESTIONS)]}"
                r = ask(args, link.url, os.path.join(workdir, f"b{k}"), warm, sysmsg, q, fields,
                        levels)
                if k == 1 and "kv_chunks" not in r.usage:  # B's first answer, lossless
                    if levels:
                        print("warning: this kvserve has --ttft-budget-ms but its first answer "
                              "has no usage.kv_chunks", file=sys.stderr)
                    else:
                        levels = False
                        print("this kvserve has no KV levels (no --ttft-budget-ms, no "
                              "usage.kv_chunks): only text recompute and lossless are run",
                              file=sys.stderr)
                elif k == 1:
                    levels = True
                results.setdefault((key, mbps), []).append(r)
                print(f"  rep {rep + 1} {name}: {r.ttft * 1000:.0f} ms, "
                      f"{r.redis['bytes_out'] / 1e6:.1f} MB from Redis "
                      f"({r.redis['bytes_in'] / 1e6:.1f} MB written by then), "
                      f"{r.usage['prompt_tokens_details']['cached_tokens']} tokens reused "
                      f"{levels_used(r.usage)}", file=sys.stderr)
    served = served_quality(args, link, workdir, sysmsg, modes) if levels else {}
    return results, link_bps, levels, served


def report(args, rates, modes, results, link_bps, levels, quality, served):
    model = os.path.basename(args.model)[:-len(".gguf")]
    med = {km: statistics.median(r.ttft for r in runs) * 1000 for km, runs in results.items()}
    any_run = next(iter(results.values()))[0]
    print(f"TTFT in ms, median of {args.reps}, of a {any_run.usage['prompt_tokens']}-token "
          f"chat prompt whose {args.context_tokens}-token system prompt's KV is in Redis behind "
          f"the link (model {model}, {args.threads} threads, a fresh instance per request; "
          f"tbf on both directions"
          f"{f', netem {args.delay_ms:g} ms each way' if args.delay_ms else ''})")
    print(f"| mode | {' | '.join(rate_name(r) for r in rates)} | bytes/token | ppl vs exact "
          f"| agreement | served: KL vs text | served: same answer |")
    print(f"|---|{'---:|' * len(rates)}---:|---:|---:|---:|---:|")
    blank = " | " * 5
    print(f"| link measured (MB/s) | "
          f"{' | '.join(f'{link_bps[r] / 1e6:.1f}' for r in rates)}{blank}|")
    notes = []
    for key, name, _ in modes:
        if key == "nocache" and not levels:
            continue
        cells = []
        for r in rates:
            runs = results.get((key, r))
            if not runs:
                cells.append("n/s")
                continue
            cell = f"{med[(key, r)]:.0f}"
            if key in ("adaptive", "budget"):
                cell += " (" + " / ".join(sorted({levels_used(x.usage) for x in runs})) + ")"
            reused = min(x.usage["prompt_tokens_details"]["cached_tokens"] for x in runs)
            if key in LEVELS and reused < 0.9 * args.context_tokens:
                cell += " !"
                notes.append(f"{name} at {rate_name(r)}: only {reused} tokens reused: Redis "
                             f"read failed or fell short, the rest recomputed (B's log says)")
            cells.append(cell)
        if key in ("text", "nocache"):
            q = ("", "+0.00% (exact)", "100.0%")
        elif key in ("adaptive", "budget"):
            q = ("", "its levels'", "")
        else:
            q = quality.get(key, ("", "", ""))
        sq = served.get(key)
        sq = (f"{sq[0]:.4f}", f"{sq[1]}/{sq[2]}") if sq else ("", "")
        print(f"| {name} | {' | '.join(cells)} | {' | '.join(q)} | {' | '.join(sq)} |")

    def ratio(num_keys, den_key, r, cache_off=False):
        """The fastest of num_keys (text: the faster of its two rows) over den_key, at r."""
        nums = [med[(k, r)] for k in num_keys if (k, r) in med]
        if len(nums) < len(num_keys) or (den_key, r) not in med:
            return None
        if cache_off and ("nocache", r) in med:
            nums.append(med[("nocache", r)])
        return min(nums) / med[(den_key, r)]
    for label, num in (("best of (text, 8-bit) / adaptive", ["text", "q8"]),
                       ("8-bit / adaptive", ["q8"])):
        cells = [ratio(num, "adaptive", r, "text" in num) for r in rates]
        print(f"| {label} | {' | '.join(f'{c:.2f}x' if c else 'n/s' for c in cells)}{blank}|")
    budget_cells, budget_missed = [], []
    for r in rates:
        if ("budget", r) not in med or ("codec3", r) not in med:
            budget_cells.append("n/s")
            continue
        met = med[("budget", r)] <= args.budget_ms
        could = med[("codec3", r)] <= args.budget_ms
        if met:
            budget_cells.append("met" if could else "met (level 3 alone could not)")
        elif could:
            budget_cells.append("NOT met")
            budget_missed.append(rate_name(r))
        else:
            budget_cells.append("missed, as level 3 did")
    print(f"| budget {args.budget_ms} ms | {' | '.join(budget_cells)}{blank}|")

    if quality:
        print(f"\nQuality: kvserve codec-eval, {args.eval_windows} windows of 1024 context "
              f"tokens, {args.eval_windows * 256} held-out tokens for perplexity, agreement over "
              f"{args.eval_windows * 64} generated tokens (one token: "
              f"{100 / (args.eval_windows * 64):.1f}%).")
    if served:
        n = next(iter(served.values()))[2]
        print(f"Served: the same {n} questions asked of a fresh instance per level (link "
              f"unshaped): KL(text || level) of the first token's top-20 distribution, mean, "
              f"and 16-token greedy answers identical to text recompute's.")
    print("\nMB read from Redis per request (median), chunks fetched")
    print(f"| mode | {' | '.join(rate_name(r) for r in rates)} |")
    print(f"|---|{'---:|' * len(rates)}")
    for key, name, _ in modes:
        if key == "nocache" and not levels:
            continue
        cells = []
        for r in rates:
            runs = results.get((key, r))
            cells.append(f"{statistics.median(x.redis['bytes_out'] for x in runs) / 1e6:.1f} "
                         f"({runs[-1].redis['hits']})" if runs else "n/s")
        print(f"| {name} | {' | '.join(cells)} |")

    lacking = [name for key, name, _ in modes if key not in NO_LEVELS and key != "nocache"]
    if not levels:
        print("\nWithout levels in this binary (no --ttft-budget-ms, no usage.kv_chunks) text "
              "recompute ran with \"cache\": false and lossless with no field"
              + (f"; n/s, not supported: {', '.join(lacking)}." if lacking else "."))
    for n in notes:
        print(f"! {n}")
    print("\nTargets: ", end="")
    if not levels:
        print("not checkable without levels.")
        return
    slower = [rate_name(r) for r in rates
              if (ratio(["text", "q8"], "adaptive", r, True) or 0) < 1]
    print(f"adaptive never slower than the best of text and 8-bit: "
          f"{'met' if not slower else 'NOT met at ' + ', '.join(slower)}", end="")
    x = ratio(["q8"], "adaptive", 200) if 200 in rates else None
    if x:
        print(f"; >= 2x faster than 8-bit at 200 Mbps: {x:.2f}x, "
              f"{'met' if x >= 2 else 'NOT met'}", end="")
    print(f"; under {args.budget_ms} ms, met wherever level 3 met it: "
          f"{'yes' if not budget_missed else 'NO, at ' + ', '.join(budget_missed)}.")


if __name__ == "__main__":
    main()
