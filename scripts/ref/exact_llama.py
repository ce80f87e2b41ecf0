"""The exact llama forward pass shared by the golden generators (make_logits_goldens.py,
make_tiny_models.py): float64 numpy over the weights as the PyPI `gguf` package dequantizes them,
no activation quantization.

It follows llama.cpp's llama graph: GGML "normal" RoPE (adjacent pairs, the first n_rot dims of a
head), GQA, SwiGLU, RMS norm, and output.weight when present (else the tied token_embd). RoPE
frequencies theta_i = pos * base^(-2i/n_rot) / d_i, where d_i is rope_freqs.weight[i] when the file
has that tensor (llama.cpp's freq_factors, written for Llama 3.1+), else the linear factor
(rope.scaling.type "linear" or rope.scale_linear), else Meta's llama3 band formula when
rope.scaling.type is "llama3", else 1. scaling=False ignores all of that (d_i = 1)."""
import math

import numpy as np
from gguf.quants import dequantize


def rope_divisors(reader, half, n_rot, base, scaling=True):
    """d_i of theta_i = pos * base^(-2i/n_rot) / d_i, i < half."""
    f = reader.fields
    val = lambda k, d=None: f[k].contents() if k in f else d
    get = {t.name: t for t in reader.tensors}
    if not scaling:
        return np.ones(half)
    if "rope_freqs.weight" in get:
        return np.asarray(get["rope_freqs.weight"].data, np.float64).reshape(-1)[:half]
    stype = val("llama.rope.scaling.type", "none")
    if stype == "linear":
        return np.full(half, float(val("llama.rope.scaling.factor", 1.0)))
    if stype == "none" and "llama.rope.scale_linear" in f:
        return np.full(half, float(val("llama.rope.scale_linear")))
    if stype == "llama3":
        return llama3_divisors(half, n_rot, base, float(val("llama.rope.scaling.factor", 8.0)),
                               float(val("llama.rope.scaling.low_freq_factor", 1.0)),
                               float(val("llama.rope.scaling.high_freq_factor", 4.0)),
                               float(val("llama.rope.scaling.original_context_length", 8192)))
    return np.ones(half)


def llama3_divisors(half, n_rot, base, factor, low, high, orig_ctx):
    """Meta's llama3 RoPE scaling (llama-models, apply_scaling) as per-frequency divisors: long
    wavelengths divided by factor, short ones kept, a smooth blend between."""
    out = np.ones(half)
    for i in range(half):
        freq = base ** (-2.0 * i / n_rot)
        wavelen = 2 * math.pi / freq
        if wavelen < orig_ctx / high:
            new = freq
        elif wavelen > orig_ctx / low:
            new = freq / factor
        else:
            smooth = (orig_ctx / wavelen - low) / (high - low)
            new = (1 - smooth) * freq / factor + smooth * freq
        out[i] = freq / new
    return out


def exact_forward(reader, ids, pos=None, scaling=True):
    """Logits [len(ids)][n_vocab] of one prompt at positions pos (default 0..n-1)."""
    get = {t.name: t for t in reader.tensors}
    W = lambda name: np.asarray(dequantize(get[name].data, get[name].tensor_type), np.float64)
    f = reader.fields
    val = lambda k, d=None: f[k].contents() if k in f else d
    n_layer, n_head = val("llama.block_count"), val("llama.attention.head_count")
    dim = val("llama.embedding_length")
    n_kv = val("llama.attention.head_count_kv", n_head)
    eps = val("llama.attention.layer_norm_rms_epsilon", 1e-5)
    base = float(val("llama.rope.freq_base", 10000.0))
    hd, n = dim // n_head, len(ids)
    n_rot = val("llama.rope.dimension_count", hd)
    pos = np.arange(n) if pos is None else np.asarray(pos)
    rms = lambda x, w: x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w
    half = n_rot // 2
    inv = base ** (-2.0 * np.arange(half) / n_rot) / rope_divisors(reader, half, n_rot, base,
                                                                   scaling)
    ang = pos[:, None].astype(np.float64) * inv[None, :]
    cs, sn = np.cos(ang)[:, None], np.sin(ang)[:, None]

    def rope(v):
        o = v.copy()
        a, b = v[..., 0:n_rot:2], v[..., 1:n_rot:2]
        o[..., 0:n_rot:2] = a * cs - b * sn
        o[..., 1:n_rot:2] = a * sn + b * cs
        return o

    mask = np.where(pos[None, :] > pos[:, None], -np.inf, 0.0)
    emb = W("token_embd.weight")
    x = emb[ids].copy()
    for l in range(n_layer):
        p = f"blk.{l}."
        h = rms(x, W(p + "attn_norm.weight"))
        q = rope((h @ W(p + "attn_q.weight").T).reshape(n, n_head, hd))
        k = rope((h @ W(p + "attn_k.weight").T).reshape(n, n_kv, hd))
        v = (h @ W(p + "attn_v.weight").T).reshape(n, n_kv, hd)
        o = np.zeros((n, n_head, hd))
        for hh in range(n_head):
            kv = hh // (n_head // n_kv)
            s = q[:, hh] @ k[:, kv].T / np.sqrt(hd) + mask
            s = np.exp(s - s.max(-1, keepdims=True))
            o[:, hh] = (s / s.sum(-1, keepdims=True)) @ v[:, kv]
        x = x + o.reshape(n, -1) @ W(p + "attn_output.weight").T
        h = rms(x, W(p + "ffn_norm.weight"))
        g = h @ W(p + "ffn_gate.weight").T
        x = x + (g / (1 + np.exp(-g)) * (h @ W(p + "ffn_up.weight").T)) @ W(p + "ffn_down.weight").T
    out = W("output.weight") if "output.weight" in get else emb
    return rms(x, W("output_norm.weight")) @ out.T
