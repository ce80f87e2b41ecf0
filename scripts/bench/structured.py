#!/usr/bin/env python3
"""Time per generated token of `kvserve serve` under a JSON schema vs free text.

One chat prompt, greedy, streamed; the time from the first content to the end divided by the
completion tokens after the first. Four runs per case, alternated (noise hits all alike),
median reported:
  - free text (the same prompt, no constraint, max_tokens as long as the schema's answer)
  - the schema with jump-forward off (every token sampled under the mask)
  - the schema with jump-forward on (forced text computed as one prefill step)
for a person schema (short keys) and a record with long fixed keys, where most of the answer
is forced.

    python3 scripts/bench/structured.py [--bin build/kvserve] [--model MODEL] [--threads 2]
"""
import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import benchlib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PERSON = {"type": "object", "additionalProperties": False,
          "properties": {"name": {"type": "string", "maxLength": 30},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"type": "string", "maxLength": 30},
                         "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                     "minItems": 2, "maxItems": 3}},
          "required": ["name", "age", "city", "hobbies"]}
LONG_KEYS = {"type": "object", "additionalProperties": False,
             "properties": {k: {"type": "integer", "minimum": 0, "maximum": 9} for k in [
                 "customer_account_identifier_number", "number_of_items_in_the_shopping_cart",
                 "total_count_of_previous_orders_placed", "loyalty_program_membership_tier",
                 "preferred_delivery_window_in_hours", "count_of_support_tickets_opened"]},
             "required": ["customer_account_identifier_number",
                          "number_of_items_in_the_shopping_cart",
                          "total_count_of_previous_orders_placed",
                          "loyalty_program_membership_tier",
                          "preferred_delivery_window_in_hours",
                          "count_of_support_tickets_opened"]}
PROMPT = "Describe a customer of an online shop. Answer in JSON."


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(port, model, extra, max_tokens):
    """(seconds per token after the first, completion tokens) of one streamed chat."""
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    first = last = None
    usage = None
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        ev = json.loads(line[6:])
        if ev.get("usage"):
            usage = ev["usage"]
        if ev.get("choices") and ev["choices"][0]["delta"].get("content"):
            last = time.perf_counter()
            first = first or last
    conn.close()
    n = usage["completion_tokens"]
    return (last - first) / max(n - 1, 1), n


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    benchlib.add_server_args(ap)
    ap.add_argument("--reps", type=int, default=4)
    args = ap.parse_args()
    port = free_port()
    srv = subprocess.Popen([args.bin, "serve", "-m", args.model, "--port", str(port), "-t",
                            str(args.threads), "--ctx-size", "2048", "--log-level", "warn",
                            "--no-cache"], cwd=ROOT)
    try:
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
            sys.exit("the server did not come up")
        print(f"\nkvserve serve, {args.threads} threads, greedy, median of {args.reps}\n")
        print("| schema | tokens | free text ms/tok | schema ms/tok | vs free | "
              "schema + jump-forward ms/tok | vs free |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for name, schema in (("person (short keys)", PERSON), ("long fixed keys", LONG_KEYS)):
            fmt = {"response_format": {"type": "json_schema",
                                       "json_schema": {"name": "x", "schema": schema}}}
            _, n = run(port, model, dict(fmt, jump_forward=False), 400)
            rows = {"free": [], "schema": [], "jf": []}
            for _ in range(args.reps):
                rows["free"].append(run(port, model, {"ignore_eos": True}, n)[0])
                rows["schema"].append(run(port, model, dict(fmt, jump_forward=False), 400)[0])
                rows["jf"].append(run(port, model, fmt, 400)[0])
            med = {k: statistics.median(v) * 1e3 for k, v in rows.items()}
            print(f"| {name} | {n} | {med['free']:.1f} | {med['schema']:.1f} | "
                  f"{med['schema'] / med['free']:.2f}x | {med['jf']:.1f} | "
                  f"{med['jf'] / med['free']:.2f}x |")
    finally:
        srv.terminate()
        srv.wait()


if __name__ == "__main__":
    main()
