#!/usr/bin/env python3
"""Calibrates approximate reuse on a model (cache/quality.h, DESIGN.md "Reuse quality").

Measures, against a full prefill of the same prompts, in first-token KL, top-1 agreement and
identical greedy answers, with the TTFT speed-up:
  - the noise floor: the same full prefill on a server with --precise (rounding only);
  - blend under every selection policy (hkvd, legolink, hybrid) over a sweep of ratios;
  - full reuse (ratio 0), for scale;
  - q8 and every codec level of the model's codec table (MODEL.kvcodec, made first when missing),
    as exact-prefix KV read back from a disk tier that holds every encoding (kv_level forced);
  - Prompt Cache's schemas: plain (modules' KV as precomputed, "fix-up 0%") and the cross-module
    fix-up over the sweep of ratios, on a RAG schema of the same texts (scripts/bench/schema.py's
    quality set: 3-4 of up to 20 document modules imported per prompt, the question in a turn);
and writes MODEL.kvquality.json beside the model (bound to its identity, as the codec table is),
which `kvserve serve` reads at start: --reuse-quality picks from it, per method, the cheapest
setting within budget, and turns off a method with none. Prints the table.

Prompts: the RAG set bench-blend uses (passages of the licence texts in
/usr/share/common-licenses, 4-6 per question, shuffled; --questions), or your own with
--prompts FILE.jsonl: one JSON object per line,
    {"messages": [...chat messages...], "passages": ["...", ...]}
where the passages (optional) are the documents the prompt holds, sent alone first as a RAG
frontend's precompute would; without them the prompts are sent in the file's order, so that a
later prompt reuses what earlier ones computed.

    python3 scripts/calibrate_reuse.py [--model MODEL] [--questions 24] [--prompts FILE.jsonl]
                                       [--ratios 0.05,0.15,0.3,0.5,0.8] [--out PATH]
                                       [--measure blend,levels,fixup]

--measure names what to measure (default all); measuring less updates those methods' points in an
existing calibration of the same model and keeps the rest. About 30 minutes on 2 cores for the
default model with everything; `make calibrate-reuse`.
"""
import argparse
import datetime
import glob
import json
import os
import random
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench"))
import benchlib  # noqa: E402
import blend  # noqa: E402
import codec  # noqa: E402
import schema  # noqa: E402
from levels import wait_steady  # noqa: E402


def load_prompts(path):
    items = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            o = json.loads(line)
            msgs, ps = o.get("messages"), o.get("passages", [])
            if not isinstance(msgs, list) or not msgs:
                sys.exit(f"{path}:{i}: 'messages' must be a non-empty list")
            if not isinstance(ps, list) or not all(isinstance(p, str) for p in ps):
                sys.exit(f"{path}:{i}: 'passages' must be a list of strings")
            items.append((msgs, ps))
    if not items:
        sys.exit(f"{path}: no prompts")
    return items


def measure_levels(args, items):
    """{level: summary} of the KV encodings: each prompt computed once into a disk tier that
    keeps every encoding (no RAM tier, no blend), then, per prompt, a full prefill (the
    reference) and the prompt again with each encoding forced (kv_level), the pool cleared
    before each, so its prefix comes from disk in that encoding."""
    codec.calibrate_if_stale(args.bin, args.model, args.threads)
    work = tempfile.mkdtemp(prefix="kvserve-calibrate-")
    srv = None
    try:
        srv = blend.Server(args, ["--reuse-quality", "none", "--no-blend", "--cache-ram-bytes",
                                  "0", "--cache-disk-encoded"], cache_dir=work)
        # one prompt at a time, its encodings made before the next (the encoder's queue is short:
        # a record beyond it stays lossless only)
        for msgs, _ in items:
            srv.chat(msgs, 1, {})
            wait_steady(lambda: len(glob.glob(os.path.join(work, "*", "*.kvc"))))
        names = {"e1": "q8", **{f"e{2 + i}": f"codec{i}" for i in range(8)}}
        found = {os.path.basename(p)[64:][1:].split(".")[0].split("-")[0]
                 for p in glob.glob(os.path.join(work, "*", "*.e*.kvc"))}
        levels = sorted((names[e] for e in found if e in names),
                        key=lambda n: (n != "q8", n))
        rows = {lv: [] for lv in levels}
        rows["full prefill"] = []
        for qi, (msgs, _) in enumerate(items):
            srv.request("POST", "/v1/cache/clear", {"tiers": ["pool"]})
            t0, ref_text, ref_lp, _, ref_toks = srv.chat(msgs, args.max_tokens, {"cache": False})
            rows["full prefill"].append({"t": t0, "n": 1, "blended": 0, "same": True,
                                         "same8": True, "top1": True, "f1": 1.0, "kl": 0.0})
            for lv in levels:
                srv.request("POST", "/v1/cache/clear", {"tiers": ["pool"]})
                t, text, lp, usage, toks = srv.chat(msgs, args.max_tokens, {"kv_level": lv})
                got = {c["level"] for c in usage.get("kv_chunks", [])}
                if got != {lv}:  # some chunk lacks the encoding: this prompt does not count
                    print(f"prompt {qi + 1}: asked for {lv}, the chunks came as {got}; skipped",
                          file=sys.stderr)
                    continue
                rows[lv].append({"t": t, "n": 1, "blended": 0, "same": text == ref_text,
                                 "same8": toks[:8] == ref_toks[:8],
                                 "top1": toks[:1] == ref_toks[:1],
                                 "f1": blend.f1(text, ref_text), "kl": blend.kl(ref_lp, lp)})
            print(f"levels: prompt {qi + 1}/{len(items)}", file=sys.stderr)
    finally:
        if srv:
            srv.stop()
        shutil.rmtree(work, ignore_errors=True)
    full_t = statistics.mean(r["t"] for r in rows.pop("full prefill"))
    return {lv: blend.summary(r, full_t) for lv, r in rows.items() if r}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    benchlib.add_server_args(ap)
    ap.add_argument("--questions", type=int, default=24)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--prompts", default="", help="your prompts (JSONL), instead of the RAG set")
    ap.add_argument("--policies", default=",".join(blend.POLICIES))
    ap.add_argument("--ratios", default="0.05,0.15,0.3,0.5,0.8")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--out", default="", help="default: MODEL.kvquality.json")
    ap.add_argument("--plot", default="", help="draw the blend frontier here (PNG)")
    ap.add_argument("--replot", default="",
                    help="draw the frontier of this calibration file, measuring nothing")
    ap.add_argument("--level-prompts", type=int, default=8,
                    help="prompts the KV encodings are measured on (0: not measured)")
    ap.add_argument("--fixup-prompts", type=int, default=24,
                    help="schema prompts the fix-up is measured on (0: not measured)")
    ap.add_argument("--measure", default="blend,levels,fixup",
                    help="what to measure; the rest is kept from --out's calibration")
    args = ap.parse_args()
    measure = set(args.measure.split(","))
    if not measure or not measure <= {"blend", "levels", "fixup"}:
        sys.exit("--measure: a comma-separated subset of blend, levels, fixup")
    if args.replot:
        with open(args.replot, encoding="utf-8") as f:
            doc = json.load(f)
        draw(doc, args.plot or args.replot[:-len(".json")] + ".png")
        return
    out = args.out or args.model + ".kvquality.json"
    ratios = [float(r) for r in args.ratios.split(",")]
    if "blend" not in measure:
        update(args, out, measure, ratios)
        return
    methods = [m for m in blend.methods_for(args.policies.split(","), ratios)
               if m[0] != "server default" and not m[0].endswith(" 100%")]

    srv = blend.Server(args, ["--reuse-quality", "none"])
    precise = None
    try:
        st, stats = srv.request("GET", "/v1/cache/stats")
        if st != 200 or "model_identity" not in stats:
            sys.exit(f"cannot read the model's identity: {st} {stats}")
        identity = stats["model_identity"]
        if args.prompts:
            items = load_prompts(args.prompts)
        else:
            pool = blend.passages(srv)
            qs = blend.question_set(pool, args.questions, random.Random(args.seed))
            items = [(blend.messages(pool, docs, q), [pool[d] for d in docs]) for docs, q in qs]
        print(f"{len(items)} prompts; {len(methods)} methods", file=sys.stderr)
        precise = blend.Server(args, ["--precise"])
        res = blend.measure(srv, precise, items, methods, args.max_tokens)
    finally:
        srv.stop()
        if precise:
            precise.stop()

    full_t = statistics.mean(r["t"] for r in res["full prefill"])
    table = {name: blend.summary(rows, full_t) for name, rows in res.items()}
    floor = table["full prefill, f32"]
    points = []
    for name, extra in methods:
        if "blend_policy" not in extra:
            continue
        v = table[name]
        points.append({"method": "blend", "policy": extra["blend_policy"],
                       "ratio": extra["blend_ratio"], "kl": round(v["kl"], 6),
                       "top1": round(v["top1"], 4), "same": round(v["same"], 4),
                       "same8": round(v["same8"], 4), "speedup": round(v["speedup"], 3)})
    doc = {"format": "kvserve-kvquality", "version": 1, "model_identity": identity,
           "model": os.path.basename(args.model),
           "made": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
           "made_by": "scripts/calibrate_reuse.py " + " ".join(sys.argv[1:]),
           "prompts": len(items), "level_prompts": min(args.level_prompts, len(items)),
           "max_tokens": args.max_tokens,
           "set": args.prompts or f"licence RAG set, seed {args.seed}",
           "floor": {"kl": round(floor["kl"], 6), "top1": round(floor["top1"], 4),
                     "same": round(floor["same"], 4), "same8": round(floor["same8"], 4)},
           "full_reuse": {"kl": round(table["full reuse (0%)"]["kl"], 6),
                          "top1": round(table["full reuse (0%)"]["top1"], 4)},
           "points": points}
    keep_unmeasured(doc, out, measure)
    write(doc, out)  # the blend figures first: the levels' measure is long
    levels = fixups = {}
    if "levels" in measure and args.level_prompts:
        levels = add_levels(doc, args, items)
        write(doc, out)
    if "fixup" in measure and args.fixup_prompts:
        fixups = add_fixups(doc, args, ratios)
        write(doc, out)

    print(f"\n{len(items)} prompts, {args.max_tokens} greedy tokens; against a full prefill:\n")
    print("| method | identical answer | first 8 tokens | top-1 | KL first token | speed-up |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name in ["full prefill, f32"] + [m[0] for m in methods[1:]]:
        v = table[name]
        print(f"| {name} | {100 * v['same']:.0f}% | {100 * v['same8']:.0f}% | "
              f"{100 * v['top1']:.0f}% | {v['kl']:.4f} | {v['speedup']:.2f}x |")
    print_rows(levels, fixups)
    print(f"\nwritten: {out}")
    if args.plot:
        draw(doc, args.plot)


def point(method, v, **key):
    return {"method": method, **key, "kl": round(v["kl"], 6), "top1": round(v["top1"], 4),
            "same": round(v["same"], 4), "same8": round(v["same8"], 4),
            "speedup": round(v["speedup"], 3)}


def add_levels(doc, args, items):
    """Measures the KV encodings into doc's points (replacing earlier level points)."""
    levels = measure_levels(args, items[:args.level_prompts])
    doc["points"] = [p for p in doc["points"] if p["method"] != "level"]
    doc["points"] += [point("level", v, level=lv) for lv, v in levels.items()]
    doc["level_prompts"] = min(args.level_prompts, len(items)) if levels else 0
    return levels


def add_fixups(doc, args, ratios):
    """Measures Prompt Cache plain (ratio 0) and with the fix-up at each ratio into doc's points
    (replacing earlier fix-up points); {name: summary}."""
    methods = ([("full prefill", {"cache": False}), ("fix-up 0%", {"fixup": False})] +
               [(f"fix-up {100 * r:.0f}%", {"fixup": True, "fixup_ratio": r}) for r in ratios])
    srv = schema.Server(args)
    try:
        pool = blend.passages(srv)
        res, _ = schema.quality_measure(srv, pool, 20, args.fixup_prompts, args.max_tokens,
                                        random.Random(args.seed), False, methods)
    finally:
        srv.stop()
    full_t = statistics.mean(r["t"] for r in res.pop("full prefill"))
    for rows in res.values():
        for r in rows:
            r["n"], r["blended"] = 1, 0
    table = {name: blend.summary(rows, full_t) for name, rows in res.items()}
    doc["points"] = [p for p in doc["points"] if p["method"] != "fixup"]
    doc["points"] += [point("fixup", table[name], ratio=extra.get("fixup_ratio", 0.0))
                      for name, extra in methods[1:]]
    doc["fixup_prompts"] = args.fixup_prompts
    return table


def print_rows(levels, fixups):
    for lv, v in levels.items():
        print(f"| {lv} (exact prefix from disk) | {100 * v['same']:.0f}% | {100 * v['same8']:.0f}% | "
              f"{100 * v['top1']:.0f}% | {v['kl']:.4f} | {v['speedup']:.2f}x |")
    for name, v in fixups.items():
        print(f"| schema, {name} | {100 * v['same']:.0f}% | {100 * v['same8']:.0f}% | "
              f"{100 * v['top1']:.0f}% | {v['kl']:.4f} | {v['speedup']:.2f}x |")


def update(args, out, measure, ratios):
    """Measures only `measure` (no blend) into the existing calibration at out."""
    try:
        with open(out, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as e:
        sys.exit(f"{out}: {e} (measuring a part needs a calibration to update: run without "
                 f"--measure first)")
    items = []
    if "levels" in measure and args.level_prompts:
        if args.prompts:
            items = load_prompts(args.prompts)
        else:
            srv = blend.Server(args, ["--reuse-quality", "none"])
            try:
                pool = blend.passages(srv)
            finally:
                srv.stop()
            qs = blend.question_set(pool, args.questions, random.Random(args.seed))
            items = [(blend.messages(pool, docs, q), [pool[d] for d in docs]) for docs, q in qs]
    levels = add_levels(doc, args, items) if items else {}
    fixups = add_fixups(doc, args, ratios) if "fixup" in measure and args.fixup_prompts else {}
    doc["made_by"] += " + " + " ".join(sys.argv[1:])
    write(doc, out)
    print("| method | identical answer | first 8 tokens | top-1 | KL first token | speed-up |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    print_rows(levels, fixups)
    print(f"\nupdated: {out}")


def keep_unmeasured(doc, out, measure):
    """Carries into doc the level and fix-up points of the calibration at out (same model) that
    this run does not measure again, with the prompt counts they were measured on."""
    try:
        with open(out, encoding="utf-8") as f:
            prior = json.load(f)
    except (OSError, ValueError):
        return
    if prior.get("model_identity") != doc["model_identity"]:
        return
    for part, method, count in (("levels", "level", "level_prompts"),
                                ("fixup", "fixup", "fixup_prompts")):
        if part in measure:
            continue
        doc["points"] += [p for p in prior.get("points", []) if p["method"] == method]
        if count in prior:
            doc[count] = prior[count]
    if measure != {"blend", "levels", "fixup"}:
        doc["made_by"] = prior.get("made_by", "") + " + " + doc["made_by"]


def write(doc, path):
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)


def draw(doc, path):
    blend.plot_points([p for p in doc["points"] if p["method"] == "blend"], doc["floor"]["kl"],
                      path, title=f"{doc['model']}: blend against full prefill "
                                  f"({doc['prompts']} prompts)")
    print(f"frontier drawn in {path}")


if __name__ == "__main__":
    main()
