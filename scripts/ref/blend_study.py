#!/usr/bin/env python3
"""Why CacheBlend (cache/blend.c's fusor) lands far from the quality floor: a float32 numpy study.

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
    """cache/blend.c's schedule."""
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

    def attend_ffn(self, l, x, h, qpos, K, V, kpos):
        """The rest of layer l for query rows (hidden x, normed h, positions qpos) over the
        pool's keys K, V [n][kvd] at positions kpos (causal by position)."""
        m, nh, nkv, hd = len(x), self.n_head, self.n_kv, self.hd
        q = self.rope((h @ self.L[l]["wq"]).reshape(m, nh, hd), qpos)
        g = nh // nkv
        scale = F32(1.0 / math.sqrt(hd))
        Kh = K.reshape(-1, nkv, hd)
        Vh = V.reshape(-1, nkv, hd)
        mask = np.where(np.asarray(kpos)[None, :] > np.asarray(qpos)[:, None], F32(-np.inf),
                        F32(0))
        o = np.empty((m, nh, hd), F32)
        for j in range(nkv):
            qq = q[:, j * g:(j + 1) * g].transpose(1, 0, 2)  # [g][m][hd]
            s = (qq @ Kh[:, j].T) * scale + mask[None]
            s -= s.max(-1, keepdims=True)
            np.exp(s, out=s)
            s /= s.sum(-1, keepdims=True)
            o[:, j * g:(j + 1) * g] = (s @ Vh[:, j]).transpose(1, 0, 2)
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
            x = self.attend_ffn(l, x, h, pos, k, v, pos)
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
    """cache/blend.c's pass. is_reused [n] bool; ridx [n]: the reused index of a token or -1;
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
        x[Q] = M.attend_ffn(l, x[Q], h[qi], pos[Q], K, V, pos)
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
    ap.add_argument("--check", action="store_true",
                    help="also check the forward pass against the server and the goldens")
    args = ap.parse_args()
    t_start = time.time()

    srv = benchlib.Server(args.bin, args.model, 1, ["--cache-dir", "off"])
    try:
        tok = lambda body: srv.request("POST", "/tokenize", body)[1]["tokens"]
        pool = rag.passages(srv)
        rng = random.Random(args.seed)
        qs = rag.question_set(pool, args.pool_questions, rng)[:args.questions]
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
        M = Model(args.model)
        if args.check:
            check_forward(M, srv, tok)
    finally:
        srv.stop()
    print(f"model loaded; {len(prompts)} questions; {time.time() - t_start:.0f}s",
          file=sys.stderr)

    L = M.n_layer
    raw = {"questions": [], "args": vars(args)}
    # accumulators
    acc_top = {l: [] for l in range(L)}          # share of deviation in top 15%
    acc_j1 = {l: [] for l in range(L)}           # jaccard with layer 1
    acc_jp = {l: [] for l in range(L)}           # jaccard with layer l-1
    acc_pos = {l: [[] for _ in POS_BUCKETS] for l in range(L)}
    results = {}                                  # (policy, ratio) -> list of (kl, top1)
    classes = {}                                  # class -> layer -> list of rel dev
    resid = {}                                    # (policy, ratio) -> class -> [L] lists
    rot = []
    floor = []
    kfrac = []

    for qi, (docs, q, full, pre) in enumerate(prompts):
        t0 = time.time()
        n = len(full)
        Kf, Vf, Hf, lg_full = M.forward(full)
        Kf16, Vf16, _, lg_f16 = M.forward(full, round_kv=True)
        floor.append((kl(lg_full, lg_f16), int(np.argmax(lg_full) == np.argmax(lg_f16))))
        del Kf16, Vf16
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
                "runs": [(int(j), int(c), int(o)) for j, c, o in runs], "floor": floor[-1],
                "policies": {}}
        firsts = lambda k: [ridx[j + t] for (j, c, _) in runs for t in range(min(k, c))]
        sims = [("full reuse", 0.0, "hkvd", [], None)]
        for ratio in RATIOS:
            budget = blend_rows_at_layer(ratio, n_r, 1 << 20)
            k_ll = min(32, max(1, int(round(budget / len(runs)))))
            sims.append(("hkvd", ratio, "hkvd", list(range(n_r)), None))
            sims.append(("hkvd-layer1", ratio, "hkvd-layer1", list(range(n_r)), None))
            sims.append(("oracle", ratio, "oracle", list(range(n_r)), None))
            sims.append(("legolink", ratio, "legolink", firsts(k_ll), k_ll))
            for k0 in (4, 8):
                if k0 * len(runs) < budget:
                    sims.append((f"hybrid k0={k0}", ratio, "hybrid", list(range(n_r)),
                                 firsts(k0)))
        if qi == 0:
            sims.append(("check: all rows (100%)", 1.0, "hkvd", list(range(n_r)), None))
        for label, ratio, pol, init, extra in sims:
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
           floor, kfrac)
    raw["results"] = {f"{k[0]}@{k[1]}": v for k, v in results.items()}
    raw["rotation"] = rot
    with open(args.json, "w") as f:
        json.dump(raw, f, indent=1, default=float)
    print(f"\n(raw numbers in {args.json}; {time.time() - t_start:.0f}s)", file=sys.stderr)


def report(L, prompts, raw, acc_top, acc_j1, acc_jp, acc_pos, results, classes, resid, rot,
           floor, kfrac):
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

    print("\n## c. Blend: last token's next-token distribution against the full prefill\n")
    fl = np.asarray(floor)
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
