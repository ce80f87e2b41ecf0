#!/usr/bin/env python3
"""Synthesizes a Llama-architecture GGUF of a production shape with random weights, for
benchmarks only (its text is noise): by default ~1.1B parameters shaped like Llama 3.2 1B / TinyLlama
(dim 2048, 16 layers, 32 heads, 8 KV heads, FFN 8192), Q4_1 matrices, Q8_0 tied embeddings, and
SmolLM2's tokenizer (copied from the default model, so prompts tokenize normally).

Quantized blocks are written directly (random 4-bit codes, fixed small scales): quantizing 1B
random floats with numpy would take minutes and the values do not matter for speed.

    python3 scripts/bench/make_bench_model.py [--out models/bench-1b.Q4_1.gguf] [--layers 16]

--llama3-8b: Llama 3 8B's shape instead (dim 4096, 32 layers, 32/8 heads, FFN 14336, vocabulary
128256: SmolLM2's tokens padded with unused ones), Q4_K matrices and token embeddings and a Q6_K
output, as make bench-gpu's gpu_bench synthesizes in memory: the file scripts/device/check.sh's
`peer` step gives kvserve and llama.cpp on a GPU (4.3 GiB; the device tool cannot carry it).

Needs the `gguf` and `numpy` packages (pip install gguf numpy).
"""
import argparse
import os

import sys

import numpy as np
from gguf import GGUFReader, GGUFWriter
from gguf.constants import GGMLQuantizationType as T

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts", "ref"))
from make_tiny_models import copy_tokenizer  # noqa: E402  (the tokenizer.ggml.* keys)
TOKENIZER_FROM = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")


def q4_1(rng, n_out, n_in):
    """Q4_1 blocks of 32: fp16 d, fp16 m, 16 bytes of codes (20 bytes)."""
    nb = n_out * n_in // 32
    blk = np.empty((nb, 20), dtype=np.uint8)
    blk[:, 0:2] = np.frombuffer(np.float16(0.004).tobytes(), dtype=np.uint8)
    blk[:, 2:4] = np.frombuffer(np.float16(-0.03).tobytes(), dtype=np.uint8)
    blk[:, 4:] = rng.integers(0, 256, size=(nb, 16), dtype=np.uint8)
    return blk.reshape(n_out, n_in // 32 * 20)


def q8_0(rng, n_out, n_in):
    """Q8_0 blocks of 32: fp16 d, 32 signed codes (34 bytes)."""
    nb = n_out * n_in // 32
    blk = np.empty((nb, 34), dtype=np.uint8)
    blk[:, 0:2] = np.frombuffer(np.float16(0.0005).tobytes(), dtype=np.uint8)
    blk[:, 2:] = rng.integers(0, 256, size=(nb, 32), dtype=np.uint8)
    return blk.reshape(n_out, n_in // 32 * 34)


def q4_k(rng, n_out, n_in):
    """Q4_K super-blocks of 256 (144 bytes): fp16 d and dmin, 12 bytes of 6-bit scales and mins
    (every scale 1, every min 8: a weight is d (code - 8), centred), 128 bytes of codes."""
    nb = n_out * n_in // 256
    blk = np.empty((nb, 144), dtype=np.uint8)
    blk[:, 0:4] = np.frombuffer(np.float16([0.002, 0.002]).tobytes(), dtype=np.uint8)
    blk[:, 4:16] = [1] * 4 + [8] * 4 + [0x81] * 4
    blk[:, 16:] = np.frombuffer(rng.bytes(nb * 128), dtype=np.uint8).reshape(nb, 128)
    return blk.reshape(n_out, n_in // 256 * 144)


def q6_k(rng, n_out, n_in):
    """Q6_K super-blocks of 256 (210 bytes): 192 bytes of 6-bit codes, 16 int8 scales (1: a
    weight is d (code - 32)), fp16 d."""
    nb = n_out * n_in // 256
    blk = np.empty((nb, 210), dtype=np.uint8)
    blk[:, :192] = np.frombuffer(rng.bytes(nb * 192), dtype=np.uint8).reshape(nb, 192)
    blk[:, 192:208] = 1
    blk[:, 208:] = np.frombuffer(np.float16(0.002).tobytes(), dtype=np.uint8)
    return blk.reshape(n_out, n_in // 256 * 210)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "models", "bench-1b.Q4_1.gguf"))
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--layers", type=int, help="default 16 (32 with --llama3-8b)")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--llama3-8b", action="store_true", help="Llama 3 8B's shape, Q4_K (above)")
    ap.add_argument("--tokenizer-from", default=TOKENIZER_FROM,
                    help="a GGUF whose tokenizer.ggml.* keys to copy")
    args = ap.parse_args()
    vocab, mat, embd, out = 0, (q4_1, T.Q4_1), (q8_0, T.Q8_0), None
    if args.llama3_8b:
        args.dim, args.heads, args.kv_heads, args.ffn = 4096, 32, 8, 14336
        vocab, mat, embd, out = 128256, (q4_k, T.Q4_K), (q4_k, T.Q4_K), (q6_k, T.Q6_K)
    args.layers = args.layers or (32 if args.llama3_8b else 16)
    rng = np.random.default_rng(1)
    dim, hd = args.dim, args.dim // args.heads
    kvd = args.kv_heads * hd

    w = GGUFWriter(args.out, "llama")
    w.add_name(f"kvserve-bench-{args.layers}x{dim}")
    w.add_block_count(args.layers)
    w.add_context_length(8192)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(args.ffn)
    w.add_head_count(args.heads)
    w.add_head_count_kv(args.kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(500000.0)
    w.add_rope_dimension_count(hd)
    n_vocab = copy_tokenizer(w, GGUFReader(args.tokenizer_from), pad_to=vocab)

    w.add_tensor("token_embd.weight", embd[0](rng, n_vocab, dim), raw_dtype=embd[1])
    w.add_tensor("output_norm.weight", np.ones(dim, dtype=np.float32))
    if out:
        w.add_tensor("output.weight", out[0](rng, n_vocab, dim), raw_dtype=out[1])
    for i in range(args.layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(dim, dtype=np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(dim, dtype=np.float32))
        for name, n_out, n_in in [("attn_q", dim, dim), ("attn_k", kvd, dim),
                                  ("attn_v", kvd, dim), ("attn_output", dim, dim),
                                  ("ffn_gate", args.ffn, dim), ("ffn_up", args.ffn, dim),
                                  ("ffn_down", dim, args.ffn)]:
            w.add_tensor(p + name + ".weight", mat[0](rng, n_out, n_in), raw_dtype=mat[1])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {args.out} ({os.path.getsize(args.out) / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
