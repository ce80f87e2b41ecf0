#!/usr/bin/env python3
"""Why CacheBlend (cache/blend/blend.c's fusor) lands far from the quality floor: a float32 numpy study.

For each question of scripts/bench/blend.py's RAG set (its passages(), question_set(),
messages(); the same seed), it runs a llama forward pass (exact_llama.py's graph, float32, over
the GGUF weights as the PyPI `gguf` package dequantizes them, no activation quantization) over
each passage's precompute prompt (the passage alone, as blend.py precomputes it: "Document 1:\n"
+ passage, chat template with its default system prompt) and over the full prompt (the
reference: full prefill), keeping every layer's K (after RoPE) and V. Each passage's token run in
the full prompt (the longest common run of ids with its precompute prompt's passage tokens)
takes the precompute KV as the reused KV: rounded to f16 as the content store keeps it, K turned
by the position delta. Everything else (system prompt, headers, question, template tokens) is
always computed. It reports:

  a. per layer: how concentrated the reused tokens' KV deviation from the full prefill is (share
     of the top 15%), and how the top-15% sets of layers agree (with layer 1, with the layer
     before);
  b. the deviation by the token's index within its reused run, relative to the layer's mean;
  c. the blend itself, emulating blend.c exactly (layer 0 and 1 all rows; then
     blend_rows_at_layer's gradual filtering by HKVD, dropped rows keep the fresh KV of the
     layer they were dropped at and the reused KV above), against other selections at equal
     deep-layer budgets (hkvd-layer1, oracle, EPIC's LegoLink, hybrid): KL(full || blend) of the
     last token's next-token distribution over the whole vocabulary and top-1 agreement, with
     a floor (the same full prefill with its K and V rounded to f16 at every layer);
  d. other token classes (newlines, the passage's first token, K-norm outliers), the residual
     deviation of every token class after the blend, and whether the K re-rotation is exact.

Markdown tables go to stdout, raw numbers to /tmp/blend_study.json (--json).

    OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2 python3 scripts/ref/blend_study.py \
        [--questions 8] [--seed 1] [--bin build/kvserve]

Needs `pip install numpy gguf` and a built build/kvserve (for tokenization only: it starts one
on a free port with --cache-dir off and stops it at the end).
"""
import argparse
import difflib
import json
import math
import os
import random
import sys
import time

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "bench"))
sys.path.insert(0, HERE)
import benchlib  # noqa: E402
import blend as rag  # noqa: E402
from exact_llama import rope_divisors  # noqa: E402

RATIOS = [0.05, 0.15, 0.30, 0.50]
POS_BUCKETS = [(0, 1), (1, 2), (2, 3), (3, 4), (4, 8), (8, 16), (16, 32), (32, 1 << 30)]
POS_NAMES = ["0", "1", "2", "3", "4-7", "8-15", "16-31", "32+"]
POS_LAYERS = [1, 2, 5, 10, 20, 29]
F32 = np.float32


def blend_rows_at_layer(ratio, reused, layer):
    """cache/blend/blend.c's schedule."""
    if layer <= 1:
        return reused if ratio > 0 else 0
    d = float(layer - 1)
    r = ratio * (1.0 + 1.0 / (d * d))
    if r >= 1:
        return reused
    return max(0, int(math.ceil(r * reused - 1e-9)))


# ---------------------------------------------------------------- the model


class Model:
    def __init__(self, path):
        reader = GGUFReader(path)
        f = reader.fields
        val = lambda k, d=None: f[k].contents() if k in f else d
        get = {t.name: t for t in reader.tensors}
        W = lambda name: np.ascontiguousarray(
            np.asarray(dequantize(get[name].data, get[name].tensor_type), F32))
        self.n_layer = val("llama.block_count")
        self.n_head = val("llama.attention.head_count")
        self.dim = val("llama.embedding_length")
        self.n_kv = val("llama.attention.head_count_kv", self.n_head)
        self.eps = float(val("llama.attention.layer_norm_rms_epsilon", 1e-5))
        base = float(val("llama.rope.freq_base", 10000.0))
        self.hd = self.dim // self.n_head
        self.n_rot = val("llama.rope.dimension_count", self.hd)
        half = self.n_rot // 2
        self.inv = (base ** (-2.0 * np.arange(half) / self.n_rot)
                    / rope_divisors(reader, half, self.n_rot, base)).astype(np.float64)
        self.kvd = self.n_kv * self.hd
        self.emb = W("token_embd.weight")
        self.out = W("output.weight").T.copy() if "output.weight" in get else self.emb.T.copy()
        self.out_norm = W("output_norm.weight")
        self.L = []
        for l in range(self.n_layer):
            p = f"blk.{l}."
            self.L.append({
                "an": W(p + "attn_norm.weight"), "fn": W(p + "ffn_norm.weight"),
                "wq": W(p + "attn_q.weight").T.copy(),
                "wkv": np.concatenate([W(p + "attn_k.weight"), W(p + "attn_v.weight")]).T.copy(),
                "wo": W(p + "attn_output.weight").T.copy(),
                "wgu": np.concatenate([W(p + "ffn_gate.weight"), W(p + "ffn_up.weight")]).T.copy(),
                "wd": W(p + "ffn_down.weight").T.copy()})
        self.n_ff = self.L[0]["wd"].shape[0]
        self.vocab = [str(t) for t in f["tokenizer.ggml.tokens"].contents()]

    def rms(self, x, w):
        return (x / np.sqrt((x * x).mean(-1, keepdims=True) + F32(self.eps))) * w

    def cs(self, pos):
        ang = np.asarray(pos, np.float64)[:, None] * self.inv[None, :]
        return np.cos(ang).astype(F32)[:, None, :], np.sin(ang).astype(F32)[:, None, :]

    def rope(self, v, pos):
        """v [m][heads][hd], GGML normal RoPE (adjacent pairs) by angle pos * inv (pos may be a
        delta)."""
        c, s = self.cs(pos)
        o = v.copy()
        a, b = v[..., 0:self.n_rot:2], v[..., 1:self.n_rot:2]
        o[..., 0:self.n_rot:2] = a * c - b * s
        o[..., 1:self.n_rot:2] = a * s + b * c
        return o

    def kv(self, l, x, pos):
        """K (rotated) and V [m][kvd] of hidden rows x at positions pos; and their normed h."""
        h = self.rms(x, self.L[l]["an"])
        kv = h @ self.L[l]["wkv"]
        k = self.rope(kv[:, :self.kvd].reshape(-1, self.n_kv, self.hd), pos).reshape(-1, self.kvd)
        return k, np.ascontiguousarray(kv[:, self.kvd:]), h

    def attend_ffn(self, l, x, h, qpos, K, V):
        """The rest of layer l for query rows (hidden x, normed h, ascending positions qpos) over
        the pool's keys K, V [n][kvd] at positions 0..n-1 (causal)."""
        m, nh, nkv, hd = len(x), self.n_head, self.n_kv, self.hd
        qpos = np.asarray(qpos)
        q = self.rope((h @ self.L[l]["wq"]).reshape(m, nh, hd), qpos) * F32(1.0 / math.sqrt(hd))
        g = nh // nkv
        Kh = K.reshape(-1, nkv, hd)
        Vh = V.reshape(-1, nkv, hd)
        o = np.empty((m, nh, hd), F32)
        B = 256
        for b0 in range(0, m, B):
            qp = qpos[b0:b0 + B]
            kend = int(qp.max()) + 1
            mask = np.where(np.arange(kend)[None, :] > qp[:, None], F32(-np.inf), F32(0))
            for j in range(nkv):
                qq = q[b0:b0 + B, j * g:(j + 1) * g].transpose(1, 0, 2)  # [g][b][hd]
                s = qq @ Kh[:kend, j].T
                s += mask
                s -= s.max(-1, keepdims=True)
                np.exp(s, out=s)
                z = s.sum(-1, keepdims=True)
                o[b0:b0 + B, j * g:(j + 1) * g] = ((s @ Vh[:kend, j]) / z).transpose(1, 0, 2)
        x = x + o.reshape(m, -1) @ self.L[l]["wo"]
        h = self.rms(x, self.L[l]["fn"])
        gu = h @ self.L[l]["wgu"]
        gt, up = gu[:, :self.n_ff], gu[:, self.n_ff:]
        return x + ((gt / (1 + np.exp(-gt))) * up) @ self.L[l]["wd"]

    def logits(self, x_last):
        return (self.rms(x_last[None], self.out_norm) @ self.out)[0].astype(np.float64)

    def forward(self, ids, round_kv=False, all_logits=False):
        """Full prefill at positions 0..n-1: (K [L][n][kvd], V [L][n][kvd], None, the last
        token's logits (or every token's))."""
        n = len(ids)
        pos = np.arange(n)
        x = self.emb[np.asarray(ids)].copy()
        Ks, Vs = [], []
        for l in range(self.n_layer):
            k, v, h = self.kv(l, x, pos)
            if round_kv:
                k, v = f16(k), f16(v)
            Ks.append(k)
            Vs.append(v)
            x = self.attend_ffn(l, x, h, pos, k, v)
        lg = (self.rms(x, self.out_norm) @ self.out) if all_logits else self.logits(x[-1])
        return np.stack(Ks), np.stack(Vs), None, lg


def f16(a):
    return a.astype(np.float16).astype(F32)


def log_softmax(z):
    z = z - z.max()
    return z - math.log(np.exp(z).sum())


def kl(p_logits, q_logits):
    lp, lq = log_softmax(p_logits), log_softmax(q_logits)
    return float((np.exp(lp) * (lp - lq)).sum())


# ---------------------------------------------------------------- the blend emulation


def blend_sim(M, ids, is_reused, ridx, Kr, Vr, Kfull, Vfull, policy, init):
    """cache/blend/blend.c's pass. is_reused [n] bool; ridx [n]: the reused index of a token or -1;
    Kr/Vr [L][n_reused][kvd]: the reused KV (rotated); policy(l, cand, dev) -> the reused
    indices (a subset of cand) computed at layer l + 1, where cand are the reused indices
    computed at layer l and dev their fresh-vs-reused deviation; init: the reused indices
    computed at layer 0. Returns (last token logits, rows computed per layer, the final pool's
    deviation from the full prefill per layer and token [L][n])."""
    n = len(ids)
    pos = np.arange(n)
    reused_tok = np.nonzero(is_reused)[0]
    nonreused = np.nonzero(~is_reused)[0]
    x = M.emb[np.asarray(ids)].copy()
    C = np.asarray(sorted(init), dtype=np.int64)
    counts = []
    pooldev = np.zeros((M.n_layer, n), F32)
    for l in range(M.n_layer):
        A = np.sort(np.concatenate([nonreused, reused_tok[C]]))
        k, v, h = M.kv(l, x[A], pos[A])
        K = np.empty((n, M.kvd), F32)
        V = np.empty((n, M.kvd), F32)
        K[reused_tok] = Kr[l]
        V[reused_tok] = Vr[l]
        K[A] = k
        V[A] = v
        pooldev[l] = ((K - Kfull[l]) ** 2).sum(1) + ((V - Vfull[l]) ** 2).sum(1)
        counts.append(len(C))
        if l + 1 < M.n_layer:
            # the fresh-vs-reused deviation of the candidates (rows of A that are reused)
            rowpos = np.searchsorted(A, reused_tok[C])
            dev = (((k[rowpos] - Kr[l][C]) ** 2).sum(1) + ((v[rowpos] - Vr[l][C]) ** 2).sum(1))
            Cn = np.asarray(sorted(policy(l, C, dev)), dtype=np.int64)
            assert np.isin(Cn, C).all()
            Q = np.sort(np.concatenate([nonreused, reused_tok[Cn]]))
            C = Cn
        else:
            Q = np.array([n - 1])
        qi = np.searchsorted(A, Q)
        x[Q] = M.attend_ffn(l, x[Q], h[qi], pos[Q], K, V)
    return M.logits(x[n - 1]), counts, pooldev


def top_by(values, cand, m):
    """The m entries of cand with the largest values (values aligned with cand)."""
    if m >= len(cand):
        return list(cand)
    if m <= 0:
        return []
    order = np.lexsort((np.arange(len(cand)), -values))  # descending, ties by index
    return list(np.asarray(cand)[order[:m]])


def make_policy(name, ratio, n_r, true_dev, forced):
    """policy(l, cand, dev) for blend_sim; true_dev [L][n_r]: reused vs full-prefill deviation;
    forced: reused indices always computed (legolink, hybrid)."""
    forced = np.asarray(sorted(forced), dtype=np.int64)
    deep = blend_rows_at_layer(ratio, n_r, 1 << 20)

    if name == "hkvd":
        return lambda l, cand, dev: top_by(dev, cand, blend_rows_at_layer(ratio, n_r, l + 1))
    if name == "oracle":
        # blend.c's gradual filtering, ranked by the true deviation of the layer's reused KV
        # from the full prefill's instead of from the fresh KV
        return lambda l, cand, dev: top_by(true_dev[l][cand], cand,
                                           blend_rows_at_layer(ratio, n_r, l + 1))
    if name == "hkvd-layer1":
        def p(l, cand, dev):
            if l == 0:
                return list(cand)
            if l == 1:
                return top_by(dev, cand, deep)
            return list(cand)
        return p
    if name == "legolink":
        return lambda l, cand, dev: list(cand)  # init = forced, kept at every layer
    if name == "hybrid":
        fset = set(forced.tolist())

        def p(l, cand, dev):
            want = blend_rows_at_layer(ratio, n_r, l + 1)
            if want >= len(cand):
                return list(cand)
            rest = np.asarray([c for c in cand if c not in fset], dtype=np.int64)
            rdev = np.asarray([d for c, d in zip(cand, dev) if c not in fset])
            return list(forced) + top_by(rdev, rest, want - len(forced))
        return p
    raise ValueError(name)


# ---------------------------------------------------------------- prompts and alignment


def longest_common_run(a, b):
    """(i, j, length) of the longest common contiguous run of lists a and b."""
    m = difflib.SequenceMatcher(None, a, b, autojunk=False).find_longest_match(
        0, len(a), 0, len(b))
    return m.a, m.b, m.size


def find_sub(hay, needle, start=0):
    for i in range(start, len(hay) - len(needle) + 1):
        if hay[i:i + len(needle)] == needle:
            return i
    return -1


# ---------------------------------------------------------------- what the server reuses


M64 = (1 << 64) - 1


def gear(i):
    z = (i + 0x9e3779b97f4a7c15) & M64
    z = ((z ^ (z >> 30)) * 0xbf58476d1ce4e5b9) & M64
    z = ((z ^ (z >> 27)) * 0x94d049bb133111eb) & M64
    return z ^ (z >> 31)


def cdc_cut(ids, kinds, bounds, avg=48, mn=1, mx=256):
    """cache/blend/cdc.c's cache_cdc_cut with plan.c's PLAN_CDC: chunk ends. kinds: id -> 0 plain,
    1 soft (a line break), 2 hard (a control token)."""
    gap, bits = avg - mn, 0
    while bits < 32 and (1 << (bits + 1)) <= gap:
        bits += 1
    ends, start, h, bset = [], 0, 0, set(bounds)
    for i, t in enumerate(ids):
        if i in bset:
            if i > start:
                ends.append(i)
                start = i
            h = 0
        k = kinds.get(t, 0)
        if k == 2:
            if i > start:
                ends.append(i)
            ends.append(i + 1)
            start, h = i + 1, 0
            continue
        h = ((h << 4) + gear(t)) & M64
        ln = i + 1 - start
        cut = ln >= mx
        if ln >= mn:
            cut = cut or k == 1 or (bits > 0 and (h >> (64 - bits)) == 0)
        if cut:
            ends.append(i + 1)
            start = i + 1
    if start < len(ids):
        ends.append(len(ids))
    return ends


def content_bounds(ids, im_start, im_end):
    """Where the messages' contents begin and end: after "<|im_start|>role\n", at <|im_end|>."""
    b = []
    for i, t in enumerate(ids):
        if t == im_start:
            j = i + 1
            while j < len(ids) and ids[j] != im_end and "\u010a" not in ids_text[ids[j]]:
                j += 1
            b.append(j + 1)
        elif t == im_end:
            b.append(i)
    return sorted(set(x for x in b if 0 < x < len(ids)))


ids_text = []


def plan_spans(ids, cuts, store):
    """plan.c's plan_blend: the chunks found in the store (the last token's excluded), kept in
    runs of 32 tokens or more: [(a, b, source)]."""
    found, a = [], 0
    for b in cuts:
        if b <= len(ids) - 1 and tuple(ids[a:b]) in store:
            found.append((a, b, store[tuple(ids[a:b])]))
        a = b
    out, i = [], 0
    while i < len(found):
        j, run = i + 1, found[i][1] - found[i][0]
        while j < len(found) and found[j][0] == found[j - 1][1]:
            run += found[j][1] - found[j][0]
            j += 1
        if run >= 32:
            out += found[i:j]
        i = j
    return out


def store_prompt(ids, cuts, spans, store, label):
    """plan_store_content: every chunk outside the spans whose key is not held yet."""
    covered = set()
    for a, b, _ in spans:
        covered.update(range(a, b))
    a = 0
    for b in cuts:
        if not covered.intersection(range(a, b)) and tuple(ids[a:b]) not in store:
            store[tuple(ids[a:b])] = (label, a)
        a = b


def server_chunks(tok, vocab, types, pool, qs_all, prompts):
    """Emulates what the server reuses in bench-blend (its chunking, its content store filled by
    the precompute, then by the questions in order) and compares it with the runs this study
    reuses (each passage's own precompute, by the longest common run). Returns (per question:
    a row of counts, and {token: (source, offset)} of the server's reused tokens; the source
    prompts' ids)."""
    global ids_text
    ids_text = vocab
    soft = lambda t: "\u010a" in vocab[t]
    kinds = {i: (2 if types[i] == 3 else 1) for i in range(len(vocab))
             if types[i] == 3 or soft(i)}
    im_start, im_end = vocab.index("<|im_start|>"), vocab.index("<|im_end|>")
    store = {}
    used = sorted({d for docs, _ in qs_all for d in docs})
    src_ids = {}
    pre_spans = {}
    for d in used:
        ids = tok({"messages": [{"role": "user", "content": "Document 1:\n" + pool[d]}]})
        cuts = cdc_cut(ids, kinds, content_bounds(ids, im_start, im_end))
        spans = plan_spans(ids, cuts, store)
        store_prompt(ids, cuts, spans, store, ("pre", d))
        src_ids[("pre", d)] = ids
        pre_spans[d] = spans
    rows, maps = [], []
    classes = ["lone line-break chunk", "other chunk of another passage's precompute",
               "chunk of an earlier question's prompt", "own precompute, other offset",
               "outside the study's runs (template, headers)"]
    for qi, (docs, q, full, pre_runs) in enumerate(prompts):
        cuts = cdc_cut(full, kinds, content_bounds(full, im_start, im_end))
        spans = plan_spans(full, cuts, store)
        own = {}
        for d, (ids, a, b) in zip(docs, pre_runs):
            i, j, c = longest_common_run(ids[a:b], full)
            for t in range(c):
                own[j + t] = (("pre", d), i + a + t)
        srv_tok = {}
        cls = dict.fromkeys(classes, 0)
        ex = []
        for a, b, (label, off) in spans:
            for t in range(a, b):
                srv_tok[t] = (label, off + t - a)
            if all(own.get(t) == (label, off + t - a) for t in range(a, b)):
                continue
            if a not in own:
                k = classes[4]
            elif b - a == 1 and soft(full[a]):
                k = classes[0]
            elif label[0] == "q":
                k = classes[2]
            elif label == own[a][0]:
                k = classes[3]
            else:
                k = classes[1]
            cls[k] += b - a
            if k != classes[0] and k != classes[4]:
                ex.append((f"{label[0]}{label[1]}", "".join(vocab[x] for x in full[a:b])
                           .replace("\u0120", " ").replace("\u010a", "\\n")[:40]))
        same = sum(1 for t, v in srv_tok.items() if own.get(t) == v)
        rows.append({"n": len(full), "study_reused": len(own), "server_reused": len(srv_tok),
                     "same_context": same, "other_context": len(srv_tok) - same,
                     "other_by_class": cls,
                     "study_only": sum(1 for t in own if t not in srv_tok),
                     "precompute_tokens_blended": sum(b - a for d in docs
                                                      for a, b, _ in pre_spans[d]),
                     "n_spans": len(spans), "examples": ex[:8]})
        maps.append(srv_tok)
        store_prompt(full, cuts, spans, store, ("q", qi))
        src_ids[("q", qi)] = full
    print("\n## e. What the server reuses (its chunking and content store emulated)\n")
    print("Reused tokens per question: the study's (each passage's own precompute, by the "
          "longest common run) against the server's (line chunks found in the content store, "
          "runs of 32+), and whose context the server's KV came from.\n")
    print("| q | tokens | study reused | server reused | same KV as the study | other context: "
          + " / ".join(classes) + " | study-reused, server computes | precompute tokens "
          "themselves blended |")
    print("| ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |")
    for qi, r in enumerate(rows):
        print(f"| {qi + 1} | {r['n']} | {r['study_reused']} | {r['server_reused']} | "
              f"{r['same_context']} | " + " / ".join(str(r["other_by_class"][c]) for c in classes)
              + f" | {r['study_only']} | {r['precompute_tokens_blended']} |")
    ex = [e for r in rows for e in r["examples"]][:12]
    if ex:
        print("\nExamples of chunks reused from another context (pre<d>: passage d's precompute, "
              "q<k>: question k's prompt): " + "; ".join(f"{a}: {b!r}" for a, b in ex))
    # where the lone line-break chunks take their KV from: the token before it in its source
    lone = {}
    for (docs, q, full, pre_runs), m in zip(prompts, maps):
        for t, (lab, off) in m.items():
            if soft(full[t]) and (t - 1 not in m or m[t - 1][0] != lab or m[t - 1][1] != off - 1):
                prev = vocab[src_ids[lab][off - 1]] if off > 0 else "(start)"
                key = f"{lab[0]}{lab[1]} offset {off} (after {prev!r})"
                lone[key] = lone.get(key, 0) + 1
    top = sorted(lone.items(), key=lambda kv: -kv[1])[:4]
    print("\nLine-break tokens reused as chunks of their own, by their KV's source: "
          + "; ".join(f"{k}: {v}" for k, v in top))
    return rows, maps, src_ids


def server_like(M, prompts, maps, src_ids, n_q, ratios=(0.0, 0.15, 0.30)):
    """Section f: the blend (hkvd, as blend.c) on the first n_q questions whose server-reused
    KV all comes from precomputes, with the server's reuse (which tokens, from which context)
    against the study's (each passage's own precompute) and the server's less its tokens from
    other contexts."""
    L = M.n_layer
    picks = [qi for qi, m in enumerate(maps) if all(v[0][0] == "pre" for v in m.values())][:n_q]
    cache = {}

    def src_kv(label):
        if label not in cache:
            K, V, _, _ = M.forward(src_ids[label])
            cache[label] = (f16(K), f16(V))
        return cache[label]

    out = {}
    for qi in picks:
        docs, q, full, pre_runs = prompts[qi]
        Kf, Vf, _, lg_full = M.forward(full)
        own = {}
        for d, (ids, a, b) in zip(docs, pre_runs):
            i, j, c = longest_common_run(ids[a:b], full)
            for t in range(c):
                own[j + t] = (("pre", d), i + a + t)
        srv = maps[qi]
        variants = {"study (own precompute, whole runs)": own,
                    "server chunks": srv,
                    "server chunks, other-context tokens computed":
                        {t: v for t, v in srv.items() if own.get(t) == v}}
        for name, m in variants.items():
            toks = np.asarray(sorted(m), dtype=np.int64)
            n_r = len(toks)
            is_reused = np.zeros(len(full), bool)
            is_reused[toks] = True
            ridx = -np.ones(len(full), np.int64)
            ridx[toks] = np.arange(n_r)
            Kr = np.empty((L, n_r, M.kvd), F32)
            Vr = np.empty((L, n_r, M.kvd), F32)
            for r, t in enumerate(toks):
                Ks, Vs = src_kv(m[t][0])
                off = m[t][1]
                Kr[:, r] = M.rope(Ks[:, off].reshape(L, M.n_kv, M.hd),
                                  np.full(L, t - off)).reshape(L, M.kvd)
                Vr[:, r] = Vs[:, off]
            for ratio in ratios:
                pol = make_policy("hkvd", ratio, n_r, None, [])
                init = list(range(n_r)) if ratio > 0 else []
                lg, _, _ = blend_sim(M, full, is_reused, ridx, Kr, Vr, Kf, Vf, pol, init)
                r = (kl(lg_full, lg), int(np.argmax(lg) == np.argmax(lg_full)))
                out.setdefault(f"{name}@{ratio}", []).append(r + (qi + 1, n_r))
                print(f"  f: q{qi + 1} {name} {ratio}: KL {r[0]:.4f} ({n_r} reused)",
                      file=sys.stderr)
    print("\n## f. The server's reuse against the study's (hkvd as blend.c, questions "
          + ", ".join(str(q + 1) for q in picks) + ")\n")
    print("| reuse | ratio | " + " | ".join(f"q{q + 1} KL" for q in picks)
          + " | mean KL | top-1 agree |")
    print("| --- | ---: |" + " ---: |" * len(picks) + " ---: | ---: |")
    for k, v in out.items():
        name, ratio = k.rsplit("@", 1)
        print(f"| {name} | {float(ratio):.2f} | " + " | ".join(f"{x[0]:.4f}" for x in v)
              + f" | {np.mean([x[0] for x in v]):.4f} | "
              f"{100 * np.mean([x[1] for x in v]):.0f}% |")
    return out


# ---------------------------------------------------------------- the study


def pct(a, q):
    return float(np.percentile(a, q)) if len(a) else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default=os.path.join(benchlib.ROOT, "build", "kvserve"))
    ap.add_argument("--model", default=benchlib.MODEL)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--pool-questions", type=int, default=50,
                    help="blend.py's --questions: the study takes the first --questions of the "
                         "set it draws (the same rng sequence as bench-blend)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", default="/tmp/blend_study.json")
    ap.add_argument("--ratios", default=",".join(str(r) for r in RATIOS))
    ap.add_argument("--policies", default="hkvd,hkvd-layer1,oracle,legolink,hybrid")
    ap.add_argument("--hybrid-k0", default="4,8")
    ap.add_argument("--floor", type=int, default=1, help="0: skip the f16 floor's forward")
    ap.add_argument("--max-passages", type=int, default=0,
                    help="keep only questions with at most this many passages (0: all); the "
                         "first --questions of those are taken")
    ap.add_argument("--server-chunks", type=int, default=1,
                    help="1: also emulate what the server reuses (section e; text only, cheap)")
    ap.add_argument("--only-server-chunks", action="store_true",
                    help="sections e and f alone")
    ap.add_argument("--server-like", type=int, default=2,
                    help="section f: on this many questions (0: skip)")
    ap.add_argument("--check", action="store_true",
                    help="also check the forward pass against the server and the goldens")
    args = ap.parse_args()
    t_start = time.time()

    srv = benchlib.Server(args.bin, args.model, 1, ["--cache-dir", "off"])
    try:
        tok = lambda body: srv.request("POST", "/tokenize", body)[1]["tokens"]
        pool = rag.passages(srv)
        rng = random.Random(args.seed)
        qs_all = qs = rag.question_set(pool, args.pool_questions, rng)
        if args.max_passages:
            qs = [q for q in qs if len(q[0]) <= args.max_passages]
        qs = qs[:args.questions]
        hdr = tok({"content": "Document 1:\n", "add_special": False})
        im_end = tok({"content": "<|im_end|>", "add_special": False})
        prompts = []
        for docs, q in qs:
            full = tok({"messages": rag.messages(pool, docs, q)})
            pre = []
            for d in docs:
                ids = tok({"messages": [{"role": "user", "content": "Document 1:\n" + pool[d]}]})
                a = find_sub(ids, hdr)
                assert a >= 0, "no header in the precompute prompt"
                b = find_sub(ids, im_end, a)
                pre.append((ids, a + len(hdr), b))
            prompts.append((docs, q, full, pre))
        chunk_rows = None
        if args.server_chunks or args.only_server_chunks:
            rd = GGUFReader(args.model)
            chunk_rows, chunk_maps, src_ids = server_chunks(tok, [str(t) for t in
                                             rd.fields["tokenizer.ggml.tokens"].contents()],
                                       list(rd.fields["tokenizer.ggml.token_type"].contents()),
                                       pool, qs_all, prompts)
            sys.stdout.flush()
        M = Model(args.model)
        if args.check:
            check_forward(M, srv, tok)
    finally:
        srv.stop()
    print(f"model loaded; {len(prompts)} questions; {time.time() - t_start:.0f}s",
          file=sys.stderr)

    if args.only_server_chunks:
        if args.server_like:
            f_out = server_like(M, prompts, chunk_maps, src_ids, args.server_like)
            with open(args.json, "w") as f:
                json.dump({"server_chunks": chunk_rows, "server_like": f_out}, f, indent=1,
                          default=float)
        return
    L = M.n_layer
    raw = {"questions": [], "args": vars(args), "server_chunks": chunk_rows}
    # accumulators
    acc_top = {l: [] for l in range(L)}          # share of deviation in top 15%
    acc_j1 = {l: [] for l in range(L)}           # jaccard with layer 1
    acc_jp = {l: [] for l in range(L)}           # jaccard with layer l-1
    acc_pos = {l: [[] for _ in POS_BUCKETS] for l in range(L)}
    acc_ord = {}                                  # passage ordinal -> layer -> rel dev
    results = {}                                  # (policy, ratio) -> list of (kl, top1)
    classes = {}                                  # class -> layer -> list of rel dev
    resid = {}                                    # (policy, ratio) -> class -> [L] lists
    rot = []
    floor = []
    kfrac = []

    ratios = [float(r) for r in args.ratios.split(",") if r]
    pols = args.policies.split(",")
    k0s = [int(k) for k in args.hybrid_k0.split(",")] if "hybrid" in pols else []
    for qi, (docs, q, full, pre) in enumerate(prompts):
        t0 = time.time()
        n = len(full)
        print(f"question {qi + 1}: {n} tokens, {len(docs)} passages", file=sys.stderr)
        Kf, Vf, Hf, lg_full = M.forward(full)
        if args.floor:
            _, _, _, lg_f16 = M.forward(full, round_kv=True)
            floor.append((kl(lg_full, lg_f16), int(np.argmax(lg_full) == np.argmax(lg_f16))))
        is_reused = np.zeros(n, bool)
        ridx = -np.ones(n, np.int64)
        Kr = np.zeros((L, 0, M.kvd), F32)
        Vr = np.zeros((L, 0, M.kvd), F32)
        runs = []  # (start in full, length, passage's first token index in the run)
        Kr_l, Vr_l = [], []
        rot_q = []
        for (ids, a, b) in pre:
            Kp, Vp, _, _ = M.forward(ids)
            i, j, c = longest_common_run(ids[a:b], full)
            i += a
            # the run in the precompute prompt: ids[i:i+c]; in the full prompt: full[j:j+c]
            delta = j - i
            assert not is_reused[j:j + c].any()
            is_reused[j:j + c] = True
            runs.append((j, c, i - a))
            kr = np.stack([M.rope(f16(Kp[l, i:i + c]).reshape(c, M.n_kv, M.hd),
                                  np.full(c, delta)).reshape(c, M.kvd) for l in range(L)])
            vr = f16(Vp[:, i:i + c])
            # rotation exactness at layer 0, without f16
            k32 = M.rope(Kp[0, i:i + c].reshape(c, M.n_kv, M.hd), np.full(c, delta)).reshape(c, -1)
            rot_q.append((float(np.abs(k32 - Kf[0, j:j + c]).max()),
                          float(np.abs(kr[0] - Kf[0, j:j + c]).max()),
                          float(np.abs(Kf[0, j:j + c]).max()),
                          float(np.abs(vr[0] - Vf[0, j:j + c]).max()),
                          float(np.abs(Vp[0, i:i + c] - Vf[0, j:j + c]).max())))
            Kr_l.append((j, kr))
            Vr_l.append((j, vr))
        order = sorted(range(len(Kr_l)), key=lambda t: Kr_l[t][0])
        Kr = np.concatenate([Kr_l[t][1] for t in order], axis=1)
        Vr = np.concatenate([Vr_l[t][1] for t in order], axis=1)
        runs = [runs[t] for t in order]
        reused_tok = np.nonzero(is_reused)[0]
        ridx[reused_tok] = np.arange(len(reused_tok))
        n_r = len(reused_tok)
        rot.append(rot_q)

        # a/b: deviation of the reused KV from the full prefill's
        dev = np.stack([((Kr[l] - Kf[l][reused_tok]) ** 2).sum(1)
                        + ((Vr[l] - Vf[l][reused_tok]) ** 2).sum(1) for l in range(L)])
        k_top = max(1, int(round(0.15 * n_r)))
        tops = [set(np.argsort(-dev[l])[:k_top].tolist()) for l in range(L)]
        for l in range(L):
            srt = np.sort(dev[l])[::-1]
            acc_top[l].append(float(srt[:k_top].sum() / max(srt.sum(), 1e-30)))
            jac = lambda s, t: len(s & t) / len(s | t)
            acc_j1[l].append(jac(tops[l], tops[1]))
            if l > 0:
                acc_jp[l].append(jac(tops[l], tops[l - 1]))
        idx_in_run = np.zeros(n_r, np.int64)
        run_of = np.zeros(n_r, np.int64)
        for ri, (j, c, _) in enumerate(runs):
            idx_in_run[ridx[j:j + c]] = np.arange(c)
            run_of[ridx[j:j + c]] = ri
        for ri in range(len(runs)):
            d = acc_ord.setdefault(ri + 1, {l: [] for l in range(L)})
            for l in range(L):
                d[l].append(float(dev[l][run_of == ri].mean() / dev[l].mean()))
        for l in range(L):
            mu = dev[l].mean()
            for bi, (lo, hi) in enumerate(POS_BUCKETS):
                sel = (idx_in_run >= lo) & (idx_in_run < hi)
                if sel.any():
                    acc_pos[l][bi].append(float(dev[l][sel].mean() / mu))

        # d: token classes among the reused tokens
        texts = {}
        ids_r = [full[t] for t in reused_tok]
        knorm_r = np.stack([np.linalg.norm(Kr[l], axis=1) for l in range(L)])
        knorm_f = np.stack([np.linalg.norm(Kf[l][reused_tok], axis=1) for l in range(L)])
        kratio = np.abs(np.log(knorm_r / np.maximum(knorm_f, 1e-30)))
        cls = {
            "run index 0": idx_in_run == 0,
            "run index 1-3": (idx_in_run >= 1) & (idx_in_run < 4),
            "after a newline token": np.zeros(n_r, bool),
            "newline tokens": np.zeros(n_r, bool),
            "punctuation . , ; :": np.zeros(n_r, bool),
            "last 4 of a run": np.zeros(n_r, bool),
            "the rest": np.ones(n_r, bool),
        }
        for r, t in enumerate(reused_tok):
            tt = M.vocab[full[t]]
            if "\n" in tt or "Ċ" in tt:
                cls["newline tokens"][r] = True
            if t > 0 and ("\n" in M.vocab[full[t - 1]] or "Ċ" in M.vocab[full[t - 1]]):
                cls["after a newline token"][r] = True
            if tt.strip("Ġ ") in (".", ",", ";", ":"):
                cls["punctuation . , ; :"][r] = True
        for ri, (j, c, _) in enumerate(runs):
            cls["last 4 of a run"][ridx[j + max(0, c - 4):j + c]] = True
        for name in list(cls):
            if name != "the rest":
                cls["the rest"] &= ~cls[name]
        for name, sel in cls.items():
            d = classes.setdefault(name, {l: [] for l in range(L)})
            for l in range(L):
                if sel.any():
                    d[l].append(float(dev[l][sel].mean() / dev[l].mean()))
        # K-norm outliers: share of the top-15% deviation set among the 15% largest |log norm
        # ratio|
        for l in (1, 2, 5, 10, 20, 29):
            kt = set(np.argsort(-kratio[l])[:k_top].tolist())
            kfrac.append((l, len(kt & tops[l]) / k_top))

        # c: the blend
        qrec = {"docs": docs, "question": q, "n": n, "n_reused": n_r,
                "runs": [(int(j), int(c), int(o)) for j, c, o in runs],
                "policies": {}, "floor": floor[-1] if floor else None}
        firsts = lambda k: [ridx[j + t] for (j, c, _) in runs for t in range(min(k, c))]
        sims = [("full reuse", 0.0, "hkvd", [], None)]
        for ratio in ratios:
            budget = blend_rows_at_layer(ratio, n_r, 1 << 20)
            k_ll = min(32, max(1, int(round(budget / len(runs)))))
            for pol in ("hkvd", "hkvd-layer1", "oracle"):
                if pol in pols:
                    sims.append((pol, ratio, pol, list(range(n_r)), None))
            if "legolink" in pols:
                sims.append(("legolink", ratio, "legolink", firsts(k_ll), k_ll))
            for k0 in k0s:
                if k0 * len(runs) < budget:
                    sims.append((f"hybrid k0={k0}", ratio, "hybrid", list(range(n_r)),
                                 firsts(k0)))
        if qi == 0 and "hkvd" in pols:
            sims.append(("check: all rows (100%)", 1.0, "hkvd", list(range(n_r)), None))
        print(f"  full, floor, precompute: {time.time() - t0:.0f}s", file=sys.stderr)
        for label, ratio, pol, init, extra in sims:
            ts = time.time()
            forced = extra if pol == "hybrid" else (init if pol == "legolink" else [])
            policy = make_policy(pol, ratio, n_r, dev, forced)
            lg, counts, pooldev = blend_sim(M, full, is_reused, ridx, Kr, Vr, Kf, Vf, policy, init)
            key = (label, ratio)
            r = (kl(lg_full, lg), int(np.argmax(lg) == np.argmax(lg_full)))
            results.setdefault(key, []).append(r)
            info = {"kl": r[0], "top1": r[1], "rows_per_layer": counts}
            if pol == "legolink":
                info["k"] = extra
            qrec["policies"][f"{label}@{ratio}"] = info
            print(f"  {label} {ratio}: KL {r[0]:.4f} top1 {r[1]} ({time.time() - ts:.0f}s)",
                  file=sys.stderr)
            # residual deviation of the final pool by token class, relative to full reuse's mean
            # over reused tokens
            rc = resid.setdefault(key, {})
            groups = {"reused: run index 0-3": reused_tok[idx_in_run < 4],
                      "reused: index 4+": reused_tok[idx_in_run >= 4],
                      "computed: passage-adjacent (2 after each run)":
                          np.asarray([j + c + t for (j, c, _) in runs for t in range(2)
                                      if j + c + t < n and not is_reused[j + c + t]]),
                      "computed: question and the rest after the last passage":
                          np.arange(max(j + c for j, c, _ in runs) + 2, n)}
            for gname, toks in groups.items():
                rc.setdefault(gname, []).append(pooldev[:, toks].sum(1).tolist() if len(toks)
                                                else [0.0] * L)
        raw["questions"].append(qrec)
        print(f"question {qi + 1}/{len(prompts)}: {n} tokens, {n_r} reused in {len(runs)} runs, "
              f"{time.time() - t0:.0f}s (total {time.time() - t_start:.0f}s)", file=sys.stderr)

    report(L, prompts, raw, acc_top, acc_j1, acc_jp, acc_pos, results, classes, resid, rot,
           floor, kfrac, acc_ord)
    if chunk_rows is not None and args.server_like:
        raw["server_like"] = server_like(M, prompts, chunk_maps, src_ids, args.server_like)
    raw["results"] = {f"{k[0]}@{k[1]}": v for k, v in results.items()}
    raw["rotation"] = rot
    with open(args.json, "w") as f:
        json.dump(raw, f, indent=1, default=float)
    print(f"\n(raw numbers in {args.json}; {time.time() - t_start:.0f}s)", file=sys.stderr)


def report(L, prompts, raw, acc_top, acc_j1, acc_jp, acc_pos, results, classes, resid, rot,
           floor, kfrac, acc_ord):
    nq = len(prompts)
    qs = raw["questions"]
    print(f"## Setup\n\n{nq} questions (blend.py's set), mean prompt "
          f"{np.mean([q['n'] for q in qs]):.0f} tokens, mean reused "
          f"{np.mean([q['n_reused'] for q in qs]):.0f} tokens in "
          f"{np.mean([len(q['runs']) for q in qs]):.1f} runs. float32 numpy forward; reused KV "
          f"rounded to f16 (as the content store keeps it).\n")
    print("## a. Concentration and stability of the reused KV's deviation, per layer\n")
    print("| layer | share of deviation in top 15% | Jaccard(top15, layer 1) | "
          "Jaccard(top15, layer l-1) |")
    print("| ---: | ---: | ---: | ---: |")
    for l in range(L):
        jp = f"{np.mean(acc_jp[l]):.2f}" if acc_jp[l] else "-"
        print(f"| {l} | {np.mean(acc_top[l]):.2f} | {np.mean(acc_j1[l]):.2f} | {jp} |")
    raw["a"] = {"top15_share": [np.mean(acc_top[l]) for l in range(L)],
                "jaccard_l1": [np.mean(acc_j1[l]) for l in range(L)],
                "jaccard_prev": [np.mean(acc_jp[l]) if acc_jp[l] else None for l in range(L)]}

    print("\n## b. Mean deviation by index within the reused run, relative to the layer's mean\n")
    print("| layer | " + " | ".join(POS_NAMES) + " |")
    print("| ---: |" + " ---: |" * len(POS_NAMES))
    raw["b"] = {}
    for l in POS_LAYERS:
        vals = [np.mean(v) if v else float("nan") for v in acc_pos[l]]
        raw["b"][l] = vals
        print(f"| {l} | " + " | ".join(f"{v:.2f}" for v in vals) + " |")

    print("\nBy the passage's place in the prompt (1: the first passage, right after the system "
          "prompt): its tokens' mean deviation relative to the layer's mean (questions)\n")
    print("| passage | " + " | ".join(f"layer {l}" for l in POS_LAYERS) + " |")
    print("| ---: |" + " ---: |" * len(POS_LAYERS))
    raw["b_passage"] = {}
    for o in sorted(acc_ord):
        vals = [np.mean(acc_ord[o][l]) for l in POS_LAYERS]
        raw["b_passage"][o] = vals
        print(f"| {o} | " + " | ".join(f"{v:.2f}" for v in vals)
              + f" ({len(acc_ord[o][POS_LAYERS[0]])}) |")

    print("\n## c. Blend: last token's next-token distribution against the full prefill\n")
    fl = np.asarray(floor) if floor else np.full((1, 2), np.nan)
    print(f"Floor (the same full prefill with K and V rounded to f16 at every layer, vs f32): "
          f"mean KL {fl[:, 0].mean():.2e}, max {fl[:, 0].max():.2e}, top-1 agree "
          f"{100 * fl[:, 1].mean():.0f}%\n")
    print("| policy | ratio | mean KL | median KL | max KL | top-1 agree |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    keys = sorted(results, key=lambda k: (k[1], k[0]))
    raw["c"] = {}
    for k in keys:
        v = np.asarray(results[k])
        extra = ""
        if k[0] == "legolink":
            ks = [q["policies"][f"legolink@{k[1]}"]["k"] for q in qs]
            extra = f" (k {min(ks)}-{max(ks)})"
        raw["c"][f"{k[0]}@{k[1]}"] = {"mean_kl": v[:, 0].mean(), "median_kl":
                                      float(np.median(v[:, 0])), "top1": v[:, 1].mean(),
                                      "n": len(v)}
        print(f"| {k[0]}{extra} | {k[1]:.2f} | {v[:, 0].mean():.4f} | {np.median(v[:, 0]):.4f} "
              f"| {v[:, 0].max():.4f} | {100 * v[:, 1].mean():.0f}% ({len(v)}) |")

    print("\n## d. Token classes (reused tokens): mean deviation relative to the layer's mean\n")
    print("| class | " + " | ".join(f"layer {l}" for l in POS_LAYERS) + " |")
    print("| --- |" + " ---: |" * len(POS_LAYERS))
    raw["d_classes"] = {}
    for name, d in classes.items():
        vals = [np.mean(d[l]) if d[l] else float("nan") for l in POS_LAYERS]
        raw["d_classes"][name] = vals
        print(f"| {name} | " + " | ".join(f"{v:.2f}" for v in vals) + " |")
    kf = {}
    for l, v in kfrac:
        kf.setdefault(l, []).append(v)
    print("\nShare of the top-15% deviation set that is also in the top 15% by |log(|K_reused| / "
          "|K_full|)|: " + ", ".join(f"layer {l} {np.mean(v):.2f}" for l, v in kf.items()))
    raw["d_knorm_overlap"] = {l: np.mean(v) for l, v in kf.items()}

    print("\nResidual deviation of the blended pool from the full prefill's KV, summed over "
          "layers, by token group, relative to full reuse's total over the reused tokens:\n")
    groups = list(next(iter(resid.values())).keys())
    print("| policy | ratio | " + " | ".join(groups) + " |")
    print("| --- | ---: |" + " ---: |" * len(groups))
    base = np.asarray(resid[("full reuse", 0.0)]["reused: run index 0-3"]).sum(1) + \
        np.asarray(resid[("full reuse", 0.0)]["reused: index 4+"]).sum(1)
    raw["d_resid"] = {}
    for k in keys:
        vals = [float(np.mean(np.asarray(resid[k][g]).sum(1) / base)) for g in groups]
        raw["d_resid"][f"{k[0]}@{k[1]}"] = vals
        print(f"| {k[0]} | {k[1]:.2f} | " + " | ".join(f"{v:.3f}" for v in vals) + " |")

    r = np.asarray([x for q in rot for x in q])
    print(f"\nK re-rotation at layer 0 (precompute K turned by the delta vs the full prefill's "
          f"layer-0 K, max |diff| over {len(r)} runs): f32 {r[:, 0].max():.2e}, after the f16 "
          f"store {r[:, 1].max():.2e} (max |K| {r[:, 2].max():.1f}); V layer 0 after f16 "
          f"{r[:, 3].max():.2e}, f32 {r[:, 4].max():.2e}")


def check_forward(M, srv, tok):
    """The numpy forward against the float64 goldens (exact_top_ids) and the server's greedy
    token."""
    gold = json.load(open(os.path.join(benchlib.ROOT, "tests", "golden", "logits",
                                       "smollm2.json")))
    for c in gold["cases"][:3]:
        ids = c["tokens"]
        _, _, _, lg = M.forward(ids, all_logits=True)
        agree = np.mean([int(np.argmax(lg[p]) == c["exact_top_ids"][p][0])
                         for p in range(len(ids))])
        err = max(abs(float(lg[p][t]) - v) for p in range(len(ids))
                  for t, v in zip(c["exact_top_ids"][p][:5], c["exact_top_logits"][p][:5]))
        st, body = srv.request("POST", "/v1/completions", {
            "model": srv.model, "prompt": ids, "max_tokens": 1, "temperature": 0,
            "logprobs": 5})
        print(f"check: {len(ids)} tokens: top-1 agree with f64 golden {100 * agree:.0f}%, "
              f"max |logit diff| (top 5) {err:.2e}; server: {st} "
              f"{json.dumps(body.get('choices', [{}])[0])[:300]}; numpy top-5 "
              f"{[M.vocab[t] for t in np.argsort(-lg[-1])[:5]]}", file=sys.stderr)


if __name__ == "__main__":
    main()
