#!/usr/bin/env python3
"""A multi-tenant RAG load against one instance and against two behind sglang-router
(round_robin, then cache_aware with the router's defaults and with its load balance engaged),
all sharing one Redis tier: which tier served the prompts' cached tokens, time to first token
and throughput (make bench-cluster; README, "Benchmarks").

The load: --docs documents of 1000-1500 tokens (passages of the licence texts in
/usr/share/common-licenses), each owned by one of --tenants tenants (its API key, so its KV
lives in that tenant's namespace); every request asks one short question (greedy,
--max-tokens) about one document, the document drawn by a Zipf law (exponent --zipf, ranks
shuffled over the documents), from --clients clients at once, streaming. The same request
sequence is sent to every setup: --warmup requests not measured (the instances' own tiers fill),
then --requests measured ones. Every request goes through the router, the single instance's
too.

Every setup is a scripts/cluster.py Cluster started afresh (empty pools, RAM and disk tiers),
its instances given the same shared tier: two redis-server shards behind nutcracker, started
once and filled before the first setup with every document's KV (one request per document on
one instance), as the shared store of a fleet that has served the corpus before. Each
instance's own tiers hold about half of the documents' KV (--kv-pool-tokens 16384, --cache-ram-bytes
512M, --cache-disk-bytes 512M), so the documents fit in two instances but not in one. The single
instance computes on --threads threads (2: the machine's cores), each of the two on one.

Per setup: the prompt tokens served from cache (share of all prompt tokens) and from which tier
(pool: cached_tokens less the chunks usage.kv_chunks lists; RAM, disk, Redis: those chunks by
tier), TTFT mean/p50/p99 (from sending to the first streamed content), requests/s and prompt
tokens/s over the measured span, each instance's share of the requests, and how often an
instance's Redis connection was lost meanwhile (a timeout: its lookups miss for a while); then
the requests by where most of their prompt came from, with their mean TTFT. Then the ratios the
targets name: cache_aware's mean TTFT over round_robin's, and its cached share against the
single instance's.

    python3 scripts/bench/cluster.py [--bin build/kvserve] [--model MODEL] [--threads 2]
                                     [--requests 200] [--warmup 50] [--clients 8] [--docs 32]
                                     [--tenants 4] [--zipf 1.0] [--max-tokens 8]
"""
import argparse
import http.client
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.parse

import benchlib
from benchlib import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import cluster  # noqa: E402  (scripts/cluster.py)

LICENCES = "/usr/share/common-licenses"
QUESTIONS = ["Who may copy this?", "What must a distributor include?", "Is there a warranty?",
             "What does it say about patents?", "Can I sell copies?", "What is required for "
             "modified versions?", "Which law applies?", "What happens on a violation?",
             "Does it cover documentation?", "Summarize it in one sentence."]
SYSTEM = "Answer the question about the document in a few words."
# Each instance's own tiers (README, "Benchmarks": half the documents' KV fits in them)
TIERS = ["-c", "2048", "--kv-pool-tokens", "16384", "--cache-ram-bytes", "512M",
         "--cache-disk-bytes", "512M"]


def setups(a):
    """(name, instances, policy, threads each, router options) of every setup, in order.
    sglang-router's cache_aware leaves a prompt's instance for the least loaded one only when
    the loads (its requests in flight) differ by more than --balance-abs-threshold (64) and by a
    factor over --balance-rel-threshold (1.5): never with 8 clients; --balance N adds a setup
    with the threshold at N."""
    out = [("1 instance", 1, "round_robin", a.threads, []),
           ("2, round_robin", 2, "round_robin", 1, []),
           ("2, cache_aware", 2, "cache_aware", 1, [])]
    if a.balance is not None:
        out.append((f"2, cache_aware, balance {a.balance}", 2, "cache_aware", 1,
                    ["--balance-abs-threshold", str(a.balance)]))
    return out


class Endpoint:
    """JSON requests to a base URL with one tenant's key."""

    def __init__(self, url, key):
        u = urllib.parse.urlsplit(url)
        self.host, self.port, self.key = u.hostname, u.port, key

    def _send(self, method, path, body):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=900)
        conn.request(method, path, json.dumps(body) if body is not None else None,
                     {"Content-Type": "application/json", "Authorization": f"Bearer {self.key}"})
        return conn.getresponse()

    def request(self, method, path, body=None):
        """(status, parsed JSON body or None): the shape benchlib.license_passages reads."""
        r = self._send(method, path, body)
        data = r.read()
        return r.status, json.loads(data) if data else None

    def chat(self, model, doc, question, max_tokens):
        """Streams one question about doc: (seconds to the first content, usage)."""
        t0 = time.perf_counter()
        r = self._send("POST", "/v1/chat/completions", {
            "model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": f"{doc}\n\nQuestion: {question}"}]})
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
        ttft = usage = None
        for ev in benchlib.sse_events(r):
            if "error" in ev:
                raise RuntimeError(f"error: {ev['error']}")
            if ttft is None and any(c.get("delta", {}).get("content")
                                    for c in ev.get("choices") or []):
                ttft = time.perf_counter() - t0
            usage = ev.get("usage") or usage
        return (ttft if ttft is not None else time.perf_counter() - t0), usage


def schedule(n_docs, n, zipf, seed):
    """n (document, question) pairs: documents by a Zipf law over ranks shuffled by seed."""
    rng = random.Random(seed)
    ranks = list(range(n_docs))
    rng.shuffle(ranks)  # ranks[r]: the document of rank r
    weights = [1 / (r + 1) ** zipf for r in range(n_docs)]
    docs = rng.choices(ranks, weights, k=n)
    return [(d, rng.randrange(len(QUESTIONS))) for d in docs]


def run_load(url, model, docs, keys, plan, clients, max_tokens):
    """Sends plan from `clients` threads at once; returns ([(ttft, usage)], seconds)."""
    out, lock, it = [], threading.Lock(), iter(plan)
    errors = []

    def client():
        while True:
            with lock:
                nxt = next(it, None)
            if nxt is None or errors:
                return
            d, q = nxt
            try:
                res = Endpoint(url, keys[d % len(keys)]).chat(model, docs[d], QUESTIONS[q],
                                                             max_tokens)
            except Exception as e:  # ends the load; reported below
                errors.append(e)
                return
            with lock:
                out.append(res)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out, time.perf_counter() - t0


def served(inst):
    """Chat completions an instance answered (its /metrics)."""
    _, text = cluster.http_get(inst.url + "/metrics")
    key = 'kvserve_requests_total{endpoint="/v1/chat/completions",status="200"}'
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(key))


def tier_tokens(u):
    """A request's prompt tokens by where they came from: pool (cached_tokens less the chunks
    usage.kv_chunks lists), ram, disk, redis, "found" (chunks a tier held that the request
    computed anyway: level "text", Redis held it and the fetch chose to compute; or listed past
    cached_tokens) and computed (the others)."""
    cached = u["prompt_tokens_details"]["cached_tokens"]
    n = {"pool": cached, "ram": 0, "disk": 0, "redis": 0, "found": 0,
         "computed": u["prompt_tokens"] - cached}
    used = 0
    for c in u.get("kv_chunks", []):
        if c["level"] == "text" or used + c["tokens"] > cached:
            n["found"] += c["tokens"]
        else:
            n[c["tier"]] += c["tokens"]
            n["pool"] -= c["tokens"]
            used += c["tokens"]
    return n


def source(u):
    """Where most of a request's prompt came from: pool, ram, disk, redis or computed."""
    n = tier_tokens(u)
    return max(("pool", "ram", "disk", "redis", "computed"), key=n.get)


def by_source(results):
    """{source: (requests, mean TTFT)} of the requests by where most of their prompt came from."""
    groups = {}
    for t, u in results:
        groups.setdefault(source(u), []).append(t)
    return {k: (len(v), statistics.fmean(v)) for k, v in groups.items()}


def lost(inst):
    """Times the instance's Redis tier lost its connection (a timeout under load, say): its
    lookups miss until it is back (README, "Redis tier")."""
    return sum("cache: redis" in line and " lost: " in line for line in inst.log().splitlines())


def summarize(results, seconds):
    """The table row's figures from the measured requests."""
    tiers = {"pool": 0, "ram": 0, "disk": 0, "redis": 0, "found": 0}
    prompt = cached = 0
    for _, u in results:
        prompt += u["prompt_tokens"]
        cached += u["prompt_tokens_details"]["cached_tokens"]
        for k, v in tier_tokens(u).items():
            if k in tiers:
                tiers[k] += v
    ttft = sorted(t for t, _ in results)
    return {"prompt": prompt, "cached": cached, "tiers": tiers, "by_source": by_source(results),
            "ttft_mean": statistics.fmean(ttft), "ttft_p50": ttft[len(ttft) // 2],
            "ttft_p99": ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))],
            "rps": len(results) / seconds, "prompt_tps": prompt / seconds}


def start_cluster(a, n, policy, threads, redis_url, keys, router_args=()):
    args = [*TIERS, "--redis", redis_url, "--redis-codec", "off",
            *[x for k in keys for x in ("--api-key", k)]]
    # no router key: sglang-router admits only its own --api-key's requests (README)
    return cluster.Cluster(a.bin, a.model, n_instances=n, n_shards=0, policy=policy,
                           instance_args=args, threads=threads, drain_grace=0,
                           router_args=router_args)


def fill(a, redis_url, keys, model):
    """The documents, each of its KV put into the shared tier: one request each on one
    instance, whose clean stop finishes the queued writes."""
    with start_cluster(a, 1, "round_robin", a.threads, redis_url, keys) as c:
        names = sorted(n for n in os.listdir(LICENCES)
                       if not os.path.islink(os.path.join(LICENCES, n)))
        docs = benchlib.license_passages(Endpoint(c.instances[0].url, keys[0]), names, 1000,
                                         1500)[:a.docs]
        if len(docs) < a.docs:
            sys.exit(f"only {len(docs)} passages of 1000-1500 tokens in {LICENCES}")
        res, _ = run_load(c.url, model, docs, keys, [(d, 0) for d in range(len(docs))], 2, 1)
    return docs, sum(u["prompt_tokens"] for _, u in res)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    benchlib.add_server_args(ap)  # --threads: the single instance's (each of two: 1)
    ap.add_argument("--docs", type=int, default=32)
    ap.add_argument("--tenants", type=int, default=4)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--balance", type=int, help="also cache_aware with this "
                    "--balance-abs-threshold (the router's default: 64)")
    a = ap.parse_args()
    keys = [f"tenant-{i}-key" for i in range(a.tenants)]
    model = os.path.basename(a.model)[:-len(".gguf")]
    tmp = tempfile.mkdtemp(prefix="kvserve-bench-cluster-")
    shards = [cluster.Shard(i, tmp) for i in range(2)]
    proxy = None
    try:
        for s in shards:
            s.start()
        proxy = cluster.Proxy(shards, tmp).start()
        t0 = time.perf_counter()
        docs, n_tokens = fill(a, proxy.url, keys, model)
        print(f"shared tier filled with {len(docs)} documents in "
              f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)
        plan = schedule(len(docs), a.warmup + a.requests, a.zipf, a.seed)
        rows = {}
        for name, n, policy, threads, router_args in setups(a):
            with start_cluster(a, n, policy, threads, proxy.url, keys, router_args) as c:
                run_load(c.url, model, docs, keys, plan[:a.warmup], a.clients, a.max_tokens)
                before = [(served(i), lost(i)) for i in c.instances]
                res, secs = run_load(c.url, model, docs, keys, plan[a.warmup:], a.clients,
                                     a.max_tokens)
                split = [served(i) - b[0] for i, b in zip(c.instances, before)]
                n_lost = sum(lost(i) - b[1] for i, b in zip(c.instances, before))
            rows[name] = summarize(res, secs)
            rows[name]["lost"] = n_lost
            rows[name]["split"] = "/".join(f"{100 * s / sum(split):.0f}" for s in split)
            print(f"{name}: done", file=sys.stderr)
    finally:
        if proxy:
            proxy.stop()
        for s in shards:
            s.stop()

    print(f"\n{len(docs)} documents ({n_tokens} tokens with the system prompt and a "
          f"question), {a.tenants} tenants, Zipf {a.zipf}, {a.clients} clients, {a.requests} "
          f"requests measured after {a.warmup}, {a.max_tokens} tokens each\n")
    print("| setup | requests per instance (%) | cached | pool | RAM | disk | Redis | "
          "found, computed | Redis lost | TTFT mean | p50 | p99 | req/s | prompt tok/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        share = [f"{100 * r['tiers'][t] / r['prompt']:.1f}%" for t in
                 ("pool", "ram", "disk", "redis", "found")]
        print(f"| {name} | {r['split']} | {100 * r['cached'] / r['prompt']:.1f}% | "
              f"{' | '.join(share)} | {r['lost']} | {1000 * r['ttft_mean']:.0f} ms | "
              f"{1000 * r['ttft_p50']:.0f} ms | {1000 * r['ttft_p99']:.0f} ms | "
              f"{r['rps']:.1f} | {r['prompt_tps']:.0f} |")
    sources = ("pool", "ram", "disk", "redis", "computed")
    print("\nRequests (and their mean TTFT) by where most of the prompt came from:\n")
    print(f"| setup | {' | '.join(sources)} |")
    print("|---|" + "---:|" * len(sources))
    for name, r in rows.items():
        cells = [f"{r['by_source'][k][0]} ({1000 * r['by_source'][k][1]:.0f} ms)"
                 if k in r["by_source"] else "0" for k in sources]
        print(f"| {name} | {' | '.join(cells)} |")
    rr, one = rows["2, round_robin"], rows["1 instance"]
    print()
    for name in [n for n in rows if "cache_aware" in n]:
        ca = rows[name]
        print(f"{name}: mean TTFT {ca['ttft_mean'] / rr['ttft_mean']:.2f}x round_robin's "
              f"(target <= 0.7x); cached share "
              f"{(ca['cached'] / ca['prompt']) / (one['cached'] / one['prompt']):.2f}x "
              f"the single instance's (target within 10%)")


if __name__ == "__main__":
    main()
