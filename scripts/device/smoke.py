#!/usr/bin/env python3
"""The server end to end on a device: the same greedy requests to a CUDA server and a CPU server
over the same model (stdlib only: the device image has no openai package). Checks that each
answers, that a repeated long prompt is served from the cache with the same answer, that a
stream carries the same text, that batched decoding gives every request an answer, and reports
how many greedy tokens the CUDA answers share with the CPU's (rounding differs: not required).

  python3 scripts/device/smoke.py CUDA_URL CPU_URL
"""
import concurrent.futures
import json
import sys
import time
import urllib.request

PASSAGE = ("The river Elbe rises in the Krkonose mountains and flows north-west through Bohemia "
           "and Germany to the North Sea at Cuxhaven. Its basin covers parts of four countries. "
           "Hamburg, the largest port on the river, lies about a hundred kilometres upstream. ")


def post(base, path, body, timeout=120):
    req = urllib.request.Request(base + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read().decode()


def model_name(base):
    with urllib.request.urlopen(base + "/v1/models", timeout=10) as r:
        return json.loads(r.read())["data"][0]["id"]


def chat(base, content, n=24, **extra):
    body = {"model": model_name(base), "messages": [{"role": "user", "content": content}],
            "max_tokens": n, "temperature": 0, **extra}
    return json.loads(post(base, "/v1/chat/completions", body))


def wait_ready(base):
    for _ in range(600):
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if json.loads(r.read())["status"] == "ok":
                    return
        except Exception:
            pass
        time.sleep(0.1)
    sys.exit(f"FAIL: {base} never became ready")


def common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main():
    gpu, cpu = sys.argv[1], sys.argv[2]
    wait_ready(gpu)
    wait_ready(cpu)
    failures = []
    prompts = ["What is the capital of France?", "Write a haiku about rain.",
               PASSAGE * 6 + "\nWhere does the Elbe flow into the sea?"]
    for p in prompts:
        g, c = chat(gpu, p), chat(cpu, p)
        gt, ct = g["choices"][0]["message"]["content"], c["choices"][0]["message"]["content"]
        print(f"prompt {len(p)} chars, {g['usage']['prompt_tokens']} tokens: "
              f"{common_prefix(gt, ct)} of {len(ct)} chars shared with the CPU\n"
              f"  cuda: {gt!r}\n  cpu:  {ct!r}")
        if not g["usage"]["completion_tokens"]:
            failures.append(f"no tokens from CUDA for {p[:30]!r}")
    # the long prompt again: its prefix comes from the cache, and the answer is unchanged
    long_prompt = prompts[-1]
    first = chat(gpu, long_prompt)
    again = chat(gpu, long_prompt)
    cached = (again["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    same = first["choices"][0]["message"]["content"] == again["choices"][0]["message"]["content"]
    print(f"repeat: cached_tokens {cached} of {again['usage']['prompt_tokens']}, same answer {same}")
    if cached <= 0 or not same:
        failures.append("a repeated prompt was not served from the cache with the same answer")
    # a stream gives the same text as the plain request
    body = {"model": model_name(gpu), "messages": [{"role": "user", "content": prompts[0]}],
            "max_tokens": 24, "temperature": 0, "stream": True}
    text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                   for line in post(gpu, "/v1/chat/completions", body).splitlines()
                   if line.startswith("data: {") and json.loads(line[6:])["choices"])
    plain = chat(gpu, prompts[0])["choices"][0]["message"]["content"]
    print(f"stream equals plain: {text == plain}")
    if text != plain:
        failures.append(f"stream {text!r} != plain {plain!r}")
    # 16 requests at once: the engine decodes them as one batch on the device
    qs = [f"Count from {i} to {i + 5}." for i in range(16)]
    t0 = time.time()
    with concurrent.futures.ThreadPoolExecutor(16) as ex:
        outs = list(ex.map(lambda q: chat(gpu, q, n=32), qs))
    dt = time.time() - t0
    toks = sum(o["usage"]["completion_tokens"] for o in outs)
    print(f"16 concurrent: {toks} tokens in {dt:.2f} s ({toks / dt:.0f} tok/s)")
    if any(o["usage"]["completion_tokens"] == 0 for o in outs):
        failures.append("a concurrent request got no tokens")
    emb = json.loads(post(gpu, "/v1/embeddings", {"model": model_name(gpu), "input": ["a cat", "a dog"]}))
    print(f"embeddings: {len(emb['data'])} of dim {len(emb['data'][0]['embedding'])}")
    for f in failures:
        print("FAIL:", f)
    print("smoke:", "FAILED" if failures else "passed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
