#!/usr/bin/env python3
"""A local kvserve cluster: N instances behind a router (sglang-router or vllm-router), sharing
one Redis tier made of S redis-server shards behind twemproxy (nutcracker), every process a child
of this one, started together and stopped together (README, "A local cluster and a fleet").

As a command (`make cluster` runs it):

    python3 scripts/cluster.py --instances 2 --shards 2 --policy cache_aware --port 8080

prints the router's endpoint and runs until Ctrl-C or SIGTERM. As a module (the e2e tests and
the cluster benchmark import it):

    with Cluster(bin_path, model, n_instances=2, n_shards=2) as c:
        c.url              # the router's base URL
        c.redis_url        # the proxy's URL, what every instance has as --redis
        c.instances[0].kill(signal.SIGKILL); c.instances[0].restart()
        c.shards[1].stop(); c.shards[1].start()

Every port is a free one unless given; every file (the proxy's configuration, the instances'
disk tiers, the logs) is in one temporary directory, removed at the end. Shards keep nothing on
disk (no RDB, no AOF): a restarted shard is empty, as a replaced one would be."""
import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUTCRACKER = shutil.which("nutcracker") or "/usr/sbin/nutcracker"
REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
ROUTERS = {"sglang": "sglang_router.launch_router", "vllm": "vllm_router.launch_router"}
POLICIES = ("cache_aware", "round_robin", "power_of_two")
# The routers check health every second, take an instance out after one failed check and back
# after one good one (both default to a minute and 3 failures); the startup check too.
ROUTER_HEALTH_FLAGS = ["--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                       "--health-success-threshold", "1", "--worker-startup-check-interval", "1"]
# twemproxy's configuration for a fleet (README, "A local cluster and a fleet", says why each
# value), run here with the cluster's own listen address, shards and timings
PROXY_CONFIG = os.path.join(ROOT, "deploy", "nutcracker.yml")


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url, timeout=5):
    """(status, body text) of a GET; HTTP errors are returned, not raised."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def redis_ping(port, timeout=1.0):
    """True when whatever listens on 127.0.0.1:port answers PING with PONG."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")  # RESP: nutcracker takes no inline commands
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def wait_until(ready, proc, what, timeout, log=None):
    """Polls ready() every 50 ms until it is true; raises when proc exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} at start"
                               + (f":\n{log()}" if log else ""))
        if ready():
            return
        time.sleep(0.05)
    raise RuntimeError(f"{what} not ready within {timeout} s" + (f":\n{log()}" if log else ""))


class Child:
    """A child process with its output in a log file; start() runs argv again (same ports)."""

    def __init__(self, name, argv, log_path, env=None):
        self.name, self.argv, self.log_path, self.env = name, argv, log_path, env
        self.proc = None

    @property
    def pid(self):
        return self.proc.pid if self.proc else None

    def running(self):
        return self.proc is not None and self.proc.poll() is None

    def spawn(self):
        with open(self.log_path, "a") as log:
            # a session of its own: Ctrl-C reaches the launcher only, which stops each in turn
            self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=self.env,
                                         stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def log(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def kill(self, sig=signal.SIGKILL):
        """Sends sig; with SIGKILL, also waits for the exit."""
        if self.running():
            self.proc.send_signal(sig)
            if sig == signal.SIGKILL:
                self.proc.wait()

    def stop(self, timeout=20):
        """SIGTERM, then SIGKILL after timeout s; returns the exit code (None: never started)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


class Shard(Child):
    """One redis-server on 127.0.0.1:port without persistence; `url` its redis:// URL."""

    def __init__(self, index, directory, maxmemory=None):
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}"
        d = os.path.join(directory, f"shard{index}")
        os.makedirs(d, exist_ok=True)
        argv = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--daemonize", "no", "--dir", d]
        if maxmemory:
            argv += ["--maxmemory", str(maxmemory), "--maxmemory-policy", "allkeys-lru"]
        super().__init__(f"shard{index}", argv, os.path.join(directory, f"shard{index}.log"))

    def start(self, timeout=10):
        self.spawn()
        wait_until(lambda: redis_ping(self.port), self.proc, self.name, timeout, self.log)
        return self


def proxy_config(port, shards, timeout_ms=None, retry_ms=None):
    """PROXY_CONFIG listening on 127.0.0.1:port in front of shards (timeout and
    server_retry_timeout replaced when given)."""
    with open(PROXY_CONFIG) as f:
        text = f.read().split("\n  servers:\n")[0]
    text = re.sub(r"(?m)^  listen: .*$", f"  listen: 127.0.0.1:{port}", text)
    for key, value in (("timeout", timeout_ms), ("server_retry_timeout", retry_ms)):
        if value is not None:
            text = re.sub(rf"(?m)^  {key}: .*$", f"  {key}: {value}", text)
    return text + "\n  servers:\n" + "".join(f"   - 127.0.0.1:{s.port}:1 {s.name}\n"
                                              for s in shards)


class Proxy(Child):
    """nutcracker (twemproxy) on 127.0.0.1:port in front of shards, configured as a fleet's
    (PROXY_CONFIG); `url` is what the instances take as --redis."""

    def __init__(self, shards, directory, timeout_ms=None, retry_ms=None):
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}"
        self.config_path = os.path.join(directory, "nutcracker.yml")
        with open(self.config_path, "w") as f:
            f.write(proxy_config(self.port, shards, timeout_ms, retry_ms))
        log = os.path.join(directory, "nutcracker.log")
        argv = [NUTCRACKER, "-c", self.config_path, "-s", str(free_port()), "-o", log]
        super().__init__("nutcracker", argv, log)

    def start(self, timeout=10):
        self.spawn()
        wait_until(lambda: redis_ping(self.port), self.proc, self.name, timeout, self.log)
        return self


class Instance(Child):
    """One `kvserve serve` on 127.0.0.1:port; restart() starts it again on the same port (the
    router knows it by its URL) with the same disk tier."""

    def __init__(self, index, bin_path, model, directory, args, env=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cache_dir = os.path.join(directory, f"instance{index}-cache")
        os.makedirs(self.cache_dir, exist_ok=True)
        argv = [bin_path, "serve", "-m", model, "--host", "127.0.0.1", "--port", str(self.port),
                "--cache-dir", self.cache_dir, *args]
        super().__init__(f"instance{index}", argv,
                         os.path.join(directory, f"instance{index}.log"), env)

    def healthy(self):
        try:
            return http_get(self.url + "/health", timeout=2)[0] == 200
        except OSError:
            return False

    def start(self, timeout=120):
        self.spawn()
        wait_until(self.healthy, self.proc, self.name, timeout, self.log)
        return self

    def restart(self, timeout=120):
        """Stops it if it runs (SIGTERM: it drains), then starts it again."""
        self.stop()
        return self.start(timeout)


class Router(Child):
    """A router (kind 'sglang' or 'vllm') in front of workers with a policy, health checked
    every second (ROUTER_HEALTH_FLAGS); start() waits until every worker is healthy."""

    def __init__(self, kind, workers, policy, directory=None, port=None, extra=()):
        if kind not in ROUTERS:
            raise ValueError(f"router: {kind!r}, not one of {sorted(ROUTERS)}")
        self.kind, self.workers = kind, workers
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._own_dir = None if directory else tempfile.mkdtemp(prefix="kvserve-router-")
        argv = [sys.executable, "-m", ROUTERS[kind], "--worker-urls", *[w.url for w in workers],
                "--policy", policy, "--host", "127.0.0.1", "--port", str(self.port),
                "--prometheus-port", str(free_port()),
                "--log-level", "warn" if kind == "sglang" else "warning", *ROUTER_HEALTH_FLAGS,
                *extra]
        super().__init__(f"{kind}-router", argv,
                         os.path.join(directory or self._own_dir, f"{kind}-router.log"))

    def workers_state(self):
        """{worker url: healthy} as the router sees them."""
        status, body = http_get(self.url + "/workers")
        if status != 200:
            raise RuntimeError(f"{self.name}: /workers answered {status}: {body}")
        return {w["url"]: w["is_healthy"] for w in json.loads(body)["workers"]}

    def _all_healthy(self):
        try:
            state = self.workers_state()
        except (OSError, RuntimeError, ValueError):
            return False  # not listening yet, or still registering
        return set(state) == {w.url for w in self.workers} and all(state.values())

    def start(self, timeout=30):
        self.spawn()
        try:
            wait_until(self._all_healthy, self.proc, self.name, timeout, self.log)
        except RuntimeError:
            self.stop()
            raise
        return self

    def stop(self, timeout=10):
        rc = super().stop(timeout)
        if self._own_dir:
            shutil.rmtree(self._own_dir, ignore_errors=True)
        return rc


class Cluster:
    """n_instances of bin_path serving model behind a router of `router` kind with `policy`,
    sharing a Redis tier of n_shards redis-server shards behind nutcracker (n_shards 0: no Redis
    tier; proxy_retry_ms: how long the proxy leaves a failed shard out, 2 s by default). Each
    instance computes on `threads` threads and takes instance_args after the cluster's own
    (--threads, --redis, --cache-dir, --drain-grace; a later option wins); the router takes
    router_args (e.g. its --api-key, one of the instances' keys).
    A context manager: entering starts everything (shards, proxy, instances, router, in that
    order), leaving stops it all in the reverse order and removes the temporary directory."""

    def __init__(self, bin_path, model, n_instances=2, n_shards=2, policy="cache_aware",
                 router="sglang", instance_args=(), threads=1, port=None, env=None,
                 shard_maxmemory=None, drain_grace=3, proxy_retry_ms=None, router_args=()):
        if n_instances < 1 or n_shards < 0:
            raise ValueError("a cluster needs an instance at least, and shards >= 0")
        if policy not in POLICIES:
            raise ValueError(f"policy: {policy!r}, not one of {POLICIES}")
        self.bin_path, self.model = bin_path, model
        self.n_instances, self.n_shards = n_instances, n_shards
        self.policy, self.router_kind, self.port = policy, router, port
        self.instance_args, self.threads, self.env = list(instance_args), threads, env
        self.shard_maxmemory, self.proxy_retry_ms = shard_maxmemory, proxy_retry_ms
        self.drain_grace, self.router_args = drain_grace, list(router_args)
        self.dir = None
        self.shards, self.instances = [], []
        self.proxy = self.router = None

    @property
    def url(self):
        return self.router.url

    @property
    def redis_url(self):
        return self.proxy.url if self.proxy else None

    def __enter__(self):
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc):
        self.stop()

    def start(self):
        self.dir = tempfile.mkdtemp(prefix="kvserve-cluster-")
        # each is listed before it starts, so that a failed start stops what did start
        for i in range(self.n_shards):
            self.shards.append(Shard(i, self.dir, self.shard_maxmemory))
            self.shards[-1].start()
        if self.shards:
            self.proxy = Proxy(self.shards, self.dir, retry_ms=self.proxy_retry_ms)
            self.proxy.start()
        args = ["--threads", str(self.threads), "--drain-grace", str(self.drain_grace)]
        if self.proxy:
            args += ["--redis", self.proxy.url, *self.codec_args()]
        if self.router_kind == "vllm":
            args += ["--get-load-format", "vllm"]
        for i in range(self.n_instances):
            self.instances.append(Instance(i, self.bin_path, self.model, self.dir,
                                           [*args, *self.instance_args], self.env))
        for inst in self.instances:  # all loading at once, then each waited for
            inst.spawn()
        for inst in self.instances:
            wait_until(inst.healthy, inst.proc, inst.name, 120, inst.log)
        self.router = Router(self.router_kind, self.instances, self.policy, self.dir, self.port,
                             self.router_args)
        self.router.start()
        return self

    def stop(self):
        """Stops the router, the instances (SIGTERM: each drains, up to its grace), the proxy
        and the shards; returns {name: exit code} of the instances."""
        codes = {}
        if self.router:
            self.router.stop()
        for inst in self.instances:  # signalled together: their drains overlap
            inst.kill(signal.SIGTERM)
        for inst in self.instances:
            codes[inst.name] = inst.stop(timeout=self.drain_grace + 30)
        for p in [self.proxy, *self.shards]:
            if p:
                p.stop()
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
        return codes

    def codec_args(self):
        """The codec table every instance must share: MODEL.kvcodec where it exists (what
        --redis-codec auto finds), else none (lossless and q8 only), rather than each instance
        calibrating its own at every start; a --redis-codec in instance_args wins."""
        if any(a.startswith("--redis-codec") for a in self.instance_args) or \
                os.path.exists(self.model + ".kvcodec"):
            return []
        return ["--redis-codec", "off"]

    def describe(self):
        """Lines saying what runs where, for a person."""
        lines = [f"router ({self.router_kind}, {self.policy}): {self.url}"]
        lines += [f"  {i.name}: {i.url} (pid {i.pid})" for i in self.instances]
        if self.proxy:
            lines.append(f"redis tier (nutcracker): {self.redis_url}")
            lines += [f"  {s.name}: {s.url} (pid {s.pid})" for s in self.shards]
        lines.append(f"logs: {self.dir}")
        return lines


def interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Options after -- go to every instance "
                                        "(e.g. -- -c 4096 --cache-ram 512M).")
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "kvserve"))
    ap.add_argument("--model", default=os.path.join(ROOT, "models",
                                                    "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("-n", "--instances", type=int, default=2)
    ap.add_argument("--shards", type=int, default=2, help="redis-server shards (0: no Redis)")
    ap.add_argument("--policy", choices=POLICIES, default="cache_aware")
    ap.add_argument("--router", choices=sorted(ROUTERS), default="sglang")
    ap.add_argument("--threads", type=int, default=1, help="compute threads per instance")
    ap.add_argument("--port", type=int, default=8080, help="the router's port")
    ap.add_argument("--shard-maxmemory", help="each shard's maxmemory (allkeys-lru), e.g. 1gb")
    ap.add_argument("instance_args", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    extra = a.instance_args[1:] if a.instance_args[:1] == ["--"] else a.instance_args
    for path, what in ((a.bin, "kvserve binary (make)"), (a.model, "model (make model)")):
        if not os.path.exists(path):
            sys.exit(f"cluster: no {what} at {path}")
    if a.shards and not os.access(NUTCRACKER, os.X_OK):
        sys.exit("cluster: nutcracker is not installed (make setup installs it)")
    signal.signal(signal.SIGTERM, interrupt)  # as Ctrl-C: everything stops on the way out
    c = Cluster(a.bin, a.model, a.instances, a.shards, a.policy, a.router, extra, a.threads,
                a.port, shard_maxmemory=a.shard_maxmemory)
    try:
        with c:
            print("\n".join(c.describe()), flush=True)
            print(f"\nendpoint: {c.url}/v1  (OpenAI API; e.g. curl {c.url}/v1/models)\n"
                  "Ctrl-C (or SIGTERM to this process) stops everything.", flush=True)
            while c.router.running():
                time.sleep(1)
            print(f"cluster: the router exited:\n{c.router.log()}", flush=True)
    except KeyboardInterrupt:
        pass
    print("cluster: stopped", flush=True)


if __name__ == "__main__":
    main()
