#!/usr/bin/env python3
"""Tiny random-weight llama GGUFs for the architecture variants kvserve claims beyond SmolLM2
(tied output, no RoPE scaling, GQA 9/3, Q4_1/Q8_0), and their logit goldens, for
tests/unit/arch_test.c. Written into tests/golden/arch/:

  linear_kq.gguf   separate output.weight, rope.scaling linear x4, no GQA (4/4), Q4_K/Q5_K/Q6_K
                   (a Q4_K_M-like mix)
  llama3_q.gguf    Llama 3.1 style: rope_freqs.weight (Meta's llama3 scaling: factor 8, low 1,
                   high 4, base 500000, but original context 64, see below) plus
                   rope.scaling.type "llama3" and its keys; GQA 4/2; Q8_0/Q4_0/Q5_0/Q5_1; tied
  llama3_meta.gguf the same weights without rope_freqs.weight: the engine must derive the same
                   frequencies from the llama3 metadata alone
  f16_bf16.gguf    F16 and BF16 matrices, F32 norms, tied output, MQA (2/1)

Tokenizer metadata is copied from tests/golden/tokenizer/spm_tiny.gguf (n_vocab = its 1000
tokens). Weights: gaussian, quantized by gguf.quants where it can; K-quant blocks are random but
valid bytes with small positive fp16 d/dmin scaled so the weights' std is what we ask for (as in
make_quant_goldens.py). Deterministic (fixed seed).

<name>.json holds, for each of 2 prompts (56 random token ids at positions 0..55), per position
the top-16 ids and logits of (i) the exact float64 forward (exact_llama.py), (ii) llama-cpp-python
where it accepts the file, and (iii) for the scaled variants the exact forward with RoPE scaling
switched off, which a correct engine must disagree with.

Why original context 64 for llama3: attention sees only relative positions, at most 55 here, and
with Meta's 8192 only wavelengths over 2048 positions change, which moves these logits by ~0.004
(measured): no test could tell scaling applied from not. With 64 the three bands (kept, blended,
divided by 8) all fall inside head_dim 64 at base 500000, and the logits move by ~1.

Run (once; the output is committed):
    /tmp/ref/venv/bin/python scripts/ref/make_tiny_models.py
"""
import json
import os
import subprocess
import sys

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import quantize

from exact_llama import exact_forward, llama3_divisors

SEED = 20251121
OUT_DIR = "tests/golden/arch"
SPM = "tests/golden/tokenizer/spm_tiny.gguf"
TOP = 16
N_PROMPT = 56

# name: hyperparameters and the type of each matrix
VARIANTS = {
    "linear_kq": dict(dim=256, n_head=4, n_kv=4, ffn=512, n_layer=2, base=10000.0, ctx=2048,
                      scaling=("linear", 4.0), freqs=False, tied=False,
                      types=dict(token_embd=T.Q4_K, output=T.Q6_K, attn_q=T.Q4_K,
                                 attn_k=T.Q4_K, attn_v=T.Q6_K, attn_output=T.Q4_K,
                                 ffn_gate=T.Q4_K, ffn_up=T.Q4_K, ffn_down=T.Q5_K)),
    "llama3_q": dict(dim=256, n_head=4, n_kv=2, ffn=512, n_layer=2, base=500000.0, ctx=131072,
                     scaling=("llama3", 8.0), orig_ctx=64, freqs=True, tied=True,
                     types=dict(token_embd=T.Q8_0, attn_q=T.Q4_0, attn_k=T.Q5_0, attn_v=T.Q8_0,
                                attn_output=T.Q5_1, ffn_gate=T.Q4_0, ffn_up=T.Q5_1,
                                ffn_down=T.Q5_0)),
    "f16_bf16": dict(dim=128, n_head=2, n_kv=1, ffn=256, n_layer=2, base=10000.0, ctx=4096,
                     scaling=None, freqs=False, tied=True,
                     types=dict(token_embd=T.BF16, attn_q=T.F16, attn_k=T.F16, attn_v=T.BF16,
                                attn_output=T.BF16, ffn_gate=T.F16, ffn_up=T.BF16,
                                ffn_down=T.F16)),
}
# llama3_meta: llama3_q's file without rope_freqs.weight (same rng draws, so same weights)
VARIANTS["llama3_meta"] = dict(VARIANTS["llama3_q"], freqs=False)

STD = dict(token_embd=0.1, output=0.1, attn_q=0.06, attn_k=0.06, attn_v=0.04, attn_output=0.04,
           ffn_gate=0.04, ffn_up=0.04, ffn_down=0.03)
K_QUANTS = (T.Q4_K, T.Q5_K, T.Q6_K)


def k_quant_matrix(rng, qtype, n_out, n_in, std):
    """Random valid K-quant rows: random bytes, then d (and dmin) set to small positive fp16
    values; dmin is chosen so each block's mean is about 0, then both are scaled to `std`."""
    nblk, size = n_in // 256, GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, (n_out, nblk, size), dtype=np.uint8)
    u = rng.uniform(0.5, 1.5, (n_out, nblk))
    # spread of the integer part d multiplies: Q4_K/Q5_K sc*q with sc,q uniform; Q6_K int8 sc*(q-32)
    if qtype == T.Q6_K:
        d = u * std / (74.0 * 18.5)
        raw[..., 208:210] = d.astype(np.float16).view(np.uint8).reshape(n_out, nblk, 2)
    else:
        qmax = 15 if qtype == T.Q4_K else 31
        spread = 36.4 * qmax / 2  # ~ std of sc*q over uniform sc in [0,63], q in [0,qmax]
        d = u * std / spread
        dmin = d * qmax / 2  # m averages 31.5, sc*q averages 31.5*qmax/2
        raw[..., 0:2] = d.astype(np.float16).view(np.uint8).reshape(n_out, nblk, 2)
        raw[..., 2:4] = dmin.astype(np.float16).view(np.uint8).reshape(n_out, nblk, 2)
    return raw.reshape(n_out, nblk * size)


def matrix(rng, qtype, n_out, n_in, std):
    if qtype in K_QUANTS:
        return k_quant_matrix(rng, qtype, n_out, n_in, std)
    w = (rng.standard_normal((n_out, n_in)) * std).astype(np.float32)
    if qtype == T.F32:
        return w
    if qtype == T.F16:
        return w.astype(np.float16)
    return np.asarray(quantize(w, qtype))


def copy_tokenizer(w, reader, pad_to=0):
    """Copies reader's tokenizer.ggml.* keys into w; returns the vocabulary's size. pad_to: a
    larger vocabulary, the tokens past the reader's named <|unused_ID|> with type UNUSED (5):
    never produced by the merges and not special, so text tokenizes as with the reader's."""
    n_vocab = 0
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer.ggml."):
            continue
        vtype = field.types[0]
        val = field.contents()
        if vtype == GGUFValueType.ARRAY:
            n = len(val)
            if key == "tokenizer.ggml.tokens":
                val = val + [f"<|unused_{i}|>" for i in range(n, pad_to)]
                n_vocab = len(val)
            elif key == "tokenizer.ggml.token_type":
                val = val + [5] * (pad_to - n)
            elif key == "tokenizer.ggml.scores":
                val = val + [0.0] * (pad_to - n)
            w.add_key_value(key, val, vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(key, val, vtype)
    return n_vocab


def write_model(name, v, n_vocab_ref, spm):
    path = os.path.join(OUT_DIR, f"{name}.gguf")
    rng = np.random.default_rng(SEED + sum(map(ord, name.replace("_meta", "_q"))))
    dim, hd = v["dim"], v["dim"] // v["n_head"]
    w = GGUFWriter(path, "llama")
    w.add_name(f"kvserve-tiny-{name}")
    w.add_block_count(v["n_layer"])
    w.add_context_length(v["ctx"])
    w.add_embedding_length(dim)
    w.add_feed_forward_length(v["ffn"])
    w.add_head_count(v["n_head"])
    w.add_head_count_kv(v["n_kv"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(v["base"])
    w.add_rope_dimension_count(hd)
    if v["scaling"]:
        w.add_string("llama.rope.scaling.type", v["scaling"][0])
        w.add_float32("llama.rope.scaling.factor", v["scaling"][1])
        if v["scaling"][0] == "llama3":
            w.add_float32("llama.rope.scaling.low_freq_factor", 1.0)
            w.add_float32("llama.rope.scaling.high_freq_factor", 4.0)
            w.add_uint32("llama.rope.scaling.original_context_length", v["orig_ctx"])
    n_vocab = copy_tokenizer(w, spm)
    assert n_vocab == n_vocab_ref
    types = v["types"]

    def add(tname, kind, n_out, n_in):
        qt = types[kind]
        data = matrix(rng, qt, n_out, n_in, STD[kind])
        if qt in (T.F32, T.F16):
            w.add_tensor(tname, data)
        else:
            w.add_tensor(tname, data.view(np.uint8), raw_dtype=qt)

    def norm(tname):
        w.add_tensor(tname, (1.0 + 0.1 * rng.standard_normal(dim)).astype(np.float32))

    add("token_embd.weight", "token_embd", n_vocab, dim)
    norm("output_norm.weight")
    if not v["tied"]:
        add("output.weight", "output", n_vocab, dim)
    if v["freqs"]:
        div = llama3_divisors(hd // 2, hd, v["base"], 8.0, 1.0, 4.0, v["orig_ctx"])
        div = div.astype(np.float32)
        w.add_tensor("rope_freqs.weight", div)
    for l in range(v["n_layer"]):
        p = f"blk.{l}."
        norm(p + "attn_norm.weight")
        add(p + "attn_q.weight", "attn_q", v["n_head"] * hd, dim)
        add(p + "attn_k.weight", "attn_k", v["n_kv"] * hd, dim)
        add(p + "attn_v.weight", "attn_v", v["n_kv"] * hd, dim)
        add(p + "attn_output.weight", "attn_output", dim, v["n_head"] * hd)
        norm(p + "ffn_norm.weight")
        add(p + "ffn_gate.weight", "ffn_gate", v["ffn"], dim)
        add(p + "ffn_up.weight", "ffn_up", v["ffn"], dim)
        add(p + "ffn_down.weight", "ffn_down", dim, v["ffn"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def top(scores):
    ids = np.argsort(-scores, axis=1)[:, :TOP]
    return ids.tolist(), [[round(float(scores[p, t]), 5) for t in ids[p]] for p in range(len(ids))]


LLAMA_CPP_CHILD = r"""
import json, sys
import numpy as np
from llama_cpp import Llama
path, ids = sys.argv[1], json.loads(sys.argv[2])
llm = Llama(model_path=path, logits_all=True, n_ctx=256, n_threads=2, verbose=False)
llm.eval(ids)
np.save(sys.argv[3], np.array(llm.scores[: len(ids)], dtype=np.float32))
"""


def llama_cpp_scores(path, ids):
    """llama.cpp's logits in a child process (its loader aborts on some metadata it rejects).
    Returns (scores, None) or (None, why)."""
    tmp = "/tmp/kvserve_arch_scores.npy"
    r = subprocess.run([sys.executable, "-c", LLAMA_CPP_CHILD, path, json.dumps(ids), tmp],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return None, (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1][-300:]
    return np.load(tmp), None


def strip_scaling_copy(path):
    """A copy of path without the llama.rope.scaling.* keys (tensors unchanged)."""
    reader = GGUFReader(path)
    out = "/tmp/kvserve_arch_noscale.gguf"
    w = GGUFWriter(out, "llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or \
                key.startswith("llama.rope.scaling."):
            continue
        vt = field.types[0]
        if vt == GGUFValueType.ARRAY:
            w.add_key_value(key, field.contents(), vt, sub_type=field.types[-1])
        else:
            w.add_key_value(key, field.contents(), vt)
    for t in reader.tensors:
        shape = [int(x) for x in reversed(t.shape)]
        if t.tensor_type in (T.F32, T.F16):
            w.add_tensor(t.name, np.asarray(t.data).reshape(shape))
        else:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def main():
    from llama_cpp import __version__ as llama_cpp_version
    os.makedirs(OUT_DIR, exist_ok=True)
    spm = GGUFReader(SPM)
    n_vocab = len(spm.fields["tokenizer.ggml.tokens"].contents())
    for name, v in VARIANTS.items():
        path = write_model(name, v, n_vocab, spm)
        reader = GGUFReader(path)
        rng = np.random.default_rng(SEED + 7)
        prompts = [rng.integers(3, n_vocab, N_PROMPT).tolist() for _ in range(2)]
        cases, notes = [], []
        for ids in prompts:
            pos = list(range(len(ids)))
            c = {"tokens": ids}
            c["exact_top_ids"], c["exact_top_logits"] = top(exact_forward(reader, ids, pos))
            if v["scaling"]:
                c["noscale_top_ids"], c["noscale_top_logits"] = top(
                    exact_forward(reader, ids, pos, scaling=False))
            sc, why = llama_cpp_scores(path, ids)
            if sc is None and v["scaling"]:
                # llama.cpp knows no scaling type "llama3" (real Llama 3.1 GGUFs carry
                # rope_freqs.weight alone) and would also divide by rope.scaling.factor
                # on top of rope_freqs: give it the same tensors without those keys.
                notes.append(f"llama.cpp aborts loading the file ({why}: GGML_ASSERT on the unknown "
                             "rope scaling type 'llama3'); its reference runs on a copy without "
                             "llama.rope.scaling.* (rope_freqs.weight carries the scaling)")
                sc, why = llama_cpp_scores(strip_scaling_copy(path), ids)
                if sc is not None and not v["freqs"]:
                    sc, why = None, "without rope_freqs the stripped copy is unscaled"
            if sc is None:
                notes.append(f"no llama.cpp reference: {why}")
            else:
                c["top_ids"], c["top_logits"] = top(sc)
            cases.append(c)
        notes = sorted(set(notes))
        with open(os.path.join(OUT_DIR, f"{name}.json"), "w") as f:
            json.dump({"generator": "scripts/ref/make_tiny_models.py", "model": path,
                       "reference": f"llama-cpp-python {llama_cpp_version}",
                       "exact_reference": "float64 numpy over gguf-dequantized weights "
                       "(scripts/ref/exact_llama.py)", "notes": notes, "top": TOP,
                       "cases": cases}, f)
        print(f"{name}: {os.path.getsize(path)} bytes, llama.cpp: "
              f"{sum('top_ids' in c for c in cases)}/{len(cases)} cases; {notes}")


if __name__ == "__main__":
    main()
