"""The numpy study behind the CacheGen codec's design choices (issue 5): an independent Llama
forward pass over the GGUF (gguf's dequantizer, numpy), the context's KV quantized in different
ways, and the held-out continuation scored over it. It estimates size by the empirical entropy
of the symbols (per channel, or pooled), so its bytes run a few percent under the C codec's;
quality is the KL divergence from the exact KV's next-token distribution, the held-out
perplexity change and teacher-forced top-1 agreement. `kvserve codec-eval` gives the real
figures for what was chosen.

    python scripts/ref/codec_study.py --model models/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --text /usr/share/common-licenses/GPL-3 [--windows 5]

needs: pip install numpy gguf llama-cpp-python (the last only to tokenize). Prints one line per
variant: group 10 anchors vs none, sd vs importance units, the sink at position 0 kept exact or
not (every other variant keeps it), heavy hitters (the mean query's logit above the chunk
median by a margin) kept or not, and K coded after RoPE (as the pool holds it) or before.
"""
import argparse

import numpy as np


class Llama:
    def __init__(self, path):
        import gguf
        r = gguf.GGUFReader(path)
        f = lambda k: r.fields[k].parts[r.fields[k].data[0]][0]
        self.nl = int(f("llama.block_count"))
        self.dim = int(f("llama.embedding_length"))
        self.nh = int(f("llama.attention.head_count"))
        self.nkv = int(f("llama.attention.head_count_kv"))
        self.hd = self.dim // self.nh
        self.eps = float(f("llama.attention.layer_norm_rms_epsilon"))
        base = float(f("llama.rope.freq_base"))
        self.inv = base ** (-np.arange(0, self.hd, 2, dtype=np.float64) / self.hd)
        self.w = {t.name: gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
                  for t in r.tensors}

    def rms(self, x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * g

    def rope(self, x, pos, sign=1.0):
        ang = np.outer(pos, self.inv) * sign
        c, s = np.cos(ang)[:, None, :].astype(np.float32), np.sin(ang)[:, None, :].astype(np.float32)
        out = np.empty_like(x)
        out[..., 0::2] = x[..., 0::2] * c - x[..., 1::2] * s
        out[..., 1::2] = x[..., 0::2] * s + x[..., 1::2] * c
        return out

    def forward(self, toks, pos0=0, past=None):
        """logits, per-layer (K rotated, V) of toks, per-layer q before RoPE."""
        W, n = self.w, len(toks)
        pos = np.arange(pos0, pos0 + n)
        x = W["token_embd.weight"][toks].copy()
        kvs, qs = [], []
        g = self.nh // self.nkv
        for l in range(self.nl):
            p = f"blk.{l}."
            xn = self.rms(x, W[p + "attn_norm.weight"])
            q = (xn @ W[p + "attn_q.weight"].T).reshape(n, self.nh, self.hd)
            k = (xn @ W[p + "attn_k.weight"].T).reshape(n, self.nkv, self.hd)
            v = (xn @ W[p + "attn_v.weight"].T).reshape(n, self.nkv, self.hd)
            qs.append(q)
            q, k = self.rope(q, pos), self.rope(k, pos)
            kvs.append((k, v))
            K = k if past is None else np.concatenate([past[l][0], k])
            V = v if past is None else np.concatenate([past[l][1], v])
            n_past = K.shape[0] - n
            s = np.matmul(q.transpose(1, 0, 2), np.repeat(K, g, 1).transpose(1, 2, 0))
            s = s / np.float32(np.sqrt(self.hd))
            s[:, np.arange(K.shape[0])[None, :] > (n_past + np.arange(n))[:, None]] = -np.inf
            e = np.exp(s - s.max(-1, keepdims=True))
            e /= e.sum(-1, keepdims=True)
            o = np.matmul(e, np.repeat(V, g, 1).transpose(1, 0, 2)).transpose(1, 0, 2)
            x = x + o.reshape(n, self.dim) @ W[p + "attn_output.weight"].T
            xn = self.rms(x, W[p + "ffn_norm.weight"])
            gt, up = xn @ W[p + "ffn_gate.weight"].T, xn @ W[p + "ffn_up.weight"].T
            x = x + ((gt / (1 + np.exp(-gt))) * up) @ W[p + "ffn_down.weight"].T
        out = self.w.get("output.weight", self.w["token_embd.weight"])
        return self.rms(x, W["output_norm.weight"]) @ out.T, kvs, qs


def log_softmax(lg):
    lg = lg - lg.max(-1, keepdims=True)
    return lg - np.log(np.exp(lg).sum(-1, keepdims=True))


def entropy_bits(sym):
    _, c = np.unique(sym, return_counts=True)
    return -(c * np.log2(c / c.sum())).sum()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--text", required=True)
    ap.add_argument("--windows", type=int, default=5)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--heldout", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=256)
    a = ap.parse_args()
    import llama_cpp
    tok = llama_cpp.Llama(a.model, vocab_only=True, verbose=False)
    toks = np.array(tok.tokenize(open(a.text, "rb").read(), add_bos=False))
    m = Llama(a.model)
    CTX, HO, nc = a.ctx, a.heldout, m.nkv * m.hd
    wins = []
    for i in range(a.windows):
        w = toks[i * (CTX + HO):(i + 1) * (CTX + HO)]
        _, kvs, qs = m.forward(w[:CTX])
        lg, _, _ = m.forward(w[CTX:], CTX, kvs)
        wins.append(dict(w=w, kvs=kvs, qs=qs, lp=log_softmax(lg)))
    # per-channel statistics and importance (as kvserve calibrate computes them)
    g = m.nh // m.nkv
    pos = np.arange(CTX)
    sd, imp, imp_pre, qmean = {}, {}, {}, []
    for l in range(m.nl):
        Q = np.concatenate([w["qs"][l] for w in wins])
        qmean.append(Q.mean(0))
        qe = (Q ** 2).mean(0).reshape(m.nkv, g, m.hd // 2, 2).sum(1).mean(-1)
        wk = np.repeat(qe, 2, -1).reshape(nc)
        Wo = m.w[f"blk.{l}.attn_output.weight"]
        wv = (Wo ** 2).sum(0).reshape(m.nkv, g, m.hd).sum(1).reshape(nc)
        for kv, wt in ((0, wk), (1, wv)):
            s = np.concatenate([w["kvs"][l][kv] for w in wins]).reshape(-1, nc).std(0)
            sd[l, kv] = s
            imp[l, kv] = imp_pre[l, kv] = np.exp(np.log(s * np.sqrt(wt)).mean()) / np.sqrt(wt)
            if kv == 0:  # the same keys before RoPE
                s = np.concatenate([m.rope(w["kvs"][l][0], pos, -1.0)
                                    for w in wins]).reshape(-1, nc).std(0)
                imp_pre[l, 0] = np.exp(np.log(s * np.sqrt(wt)).mean()) / np.sqrt(wt)
    reach = np.arange(1, 1025)
    cb, sb = np.cos(np.outer(reach, m.inv)).mean(0), np.sin(np.outer(reach, m.inv)).mean(0)

    def hitters(w, l, margin):
        k = m.rope(w["kvs"][l][0], pos, -1.0)  # keys before RoPE
        ka = np.empty_like(k)
        ka[..., 0::2] = cb * k[..., 0::2] + sb * k[..., 1::2]
        ka[..., 1::2] = -sb * k[..., 0::2] + cb * k[..., 1::2]
        sc = np.einsum("ngd,jnd->jng", qmean[l].reshape(m.nkv, g, m.hd), ka) / np.sqrt(m.hd)
        sc = sc.max(-1).max(-1)
        out = [c0 + np.nonzero(sc[c0:c0 + a.chunk] > np.median(sc[c0:c0 + a.chunk]) + margin)[0]
               for c0 in range(0, CTX, a.chunk)]
        return np.concatenate(out).astype(int)

    def run(name, units, b, group=0, sink=True, margin=None, kpre=False):
        syms, nll, agree, kl, n_exact = {}, [], 0, 0.0, 0
        for w in wins:
            past = []
            for l in range(m.nl):
                exact = np.zeros(CTX, bool)
                exact[0] = sink
                if margin is not None:
                    exact[hitters(w, l, margin)] = True
                n_exact += exact.sum()
                out = []
                for kv in (0, 1):
                    x = w["kvs"][l][kv]
                    if kv == 0 and kpre:
                        x = m.rope(x, pos, -1.0)
                    x = x.reshape(CTX, nc)
                    st = b * units[l, kv]
                    r = x.copy()
                    if group:  # anchors at the same bin: the same values, other symbols
                        q = np.rint(x / st)
                        anc = np.repeat(q[::group], group, 0)[:CTX]
                        d = (q - anc)[np.arange(CTX) % group != 0]
                        syms.setdefault((l, kv, "a"), []).append(q[::group].ravel())
                        syms.setdefault((l, kv, "d"), []).append(d)
                    else:
                        q = np.rint(x / st)
                        syms.setdefault((l, kv, "d"), []).append(q[~exact])
                    r[~exact] = (q * st)[~exact]
                    r = r.reshape(CTX, m.nkv, m.hd)
                    out.append(m.rope(r, pos, 1.0) if kv == 0 and kpre else r)
                past.append(tuple(out))
            lp = log_softmax(m.forward(w["w"][CTX:], CTX, past)[0])
            nll.append(-lp[np.arange(HO - 1), w["w"][CTX + 1:]].mean())
            agree += (lp.argmax(-1) == w["lp"].argmax(-1)).sum()
            kl += (np.exp(w["lp"]) * (w["lp"] - lp)).sum()
        bits = n_exact * 2 * nc * 20  # f16 and an escape symbol
        for key, arr in syms.items():
            arr = np.concatenate(arr) if key[2] == "a" else np.concatenate(arr)
            bits += entropy_bits(arr) if key[2] == "a" else sum(
                entropy_bits(arr[:, c]) for c in range(nc))
        n = len(wins)
        ref = np.mean([-w["lp"][np.arange(HO - 1), w["w"][CTX + 1:]].mean() for w in wins])
        print(f"{name:34s} bytes/token {bits / 8 / (n * CTX):7.0f}  KL {kl / (n * HO):.4f}  "
              f"ppl {100 * (np.exp(np.mean(nll) - ref) - 1):+.2f}%  "
              f"agreement {100 * agree / (n * HO):.1f}%", flush=True)

    for b in (0.5, 1.0):
        run(f"sd units, group 10, bin {b}", sd, b, group=10)
        run(f"importance, group 10, bin {b}", imp, b, group=10)
        run(f"importance, no anchors, no sink, bin {b}", imp, b, sink=False)
        run(f"importance, no anchors, bin {b}", imp, b)
        run(f"importance, hitters margin 4, bin {b}", imp, b, margin=4.0)
        run(f"same, K before RoPE, bin {b}", imp_pre, b, margin=4.0, kpre=True)


if __name__ == "__main__":
    main()
