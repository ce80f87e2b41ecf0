#!/usr/bin/env python3
"""Writes the golden files of tests/unit/quant_test.c into tests/golden/quant/.

The reference is the PyPI `gguf` package (gguf.quants), independent of kvserve's C code:
  - for every weight type, rows of blocks (quantized from random floats by gguf where gguf can
    quantize the type; random but valid bytes for the K-quants, with small finite fp16 d/dmin),
    gguf's dequantization of them, an f32 activation matrix, and float64 dot products of the
    dequantized rows with the activation rows;
  - fp16 -> f32 for all 65536 halves, and f32 -> fp16 (round to nearest even, numpy) for edge and
    random values.
Deterministic: a fixed seed, and re-running rewrites identical files.

File <TYPE>.bin (little endian):
  char magic[4] = "KVQG"; u32 version = 1; u32 type (GGML id); u32 n; u32 rows; u32 nx;
  u8  w[rows][row_bytes]      the blocks
  f32 deq[rows][n]            gguf.quants.dequantize(w)
  f32 x[nx][n]                activations
  f64 dot[nx][rows]           sum_e deq[i][e] * x[j][e] in float64
File conv.bin:
  char magic[4] = "KVQC"; u32 version = 1; u32 m;
  u32 f16_to_f32[65536]       f32 bits of half h (numpy)
  u32 f32_in[m]; u16 f16_out[m]   f32 bits and numpy's float16 of them

Usage: python3 scripts/ref/make_quant_goldens.py [out_dir]
"""
import os
import struct
import sys

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

SEED = 20240613
ROWS = 5  # weight rows: tiles use up to 4, the fifth checks row strides
NX = 4  # activation rows
# 31 blocks of 32 cover every act32 group size (16, 8, 4, 2, 1); 3 super-blocks for K-quants;
# an odd length for the float types exercises the SIMD remainders.
N_BY_TYPE = {
    T.F32: 203,
    T.F16: 203,
    T.BF16: 203,
    T.Q4_0: 992,
    T.Q4_1: 992,
    T.Q5_0: 992,
    T.Q5_1: 992,
    T.Q8_0: 992,
    T.Q4_K: 768,
    T.Q5_K: 768,
    T.Q6_K: 768,
}


def random_weights(rng, n_rows, n):
    """Gaussian rows whose blocks of 32 have scales spread over two decades, some with an
    offset so that Q4_1/Q5_1's minimum is positive or negative."""
    w = rng.standard_normal((n_rows, n)).astype(np.float32)
    nb = (n + 31) // 32
    scale = np.exp(rng.uniform(np.log(0.01), np.log(1.0), (n_rows, nb))).astype(np.float32)
    shift = np.where(rng.random((n_rows, nb)) < 0.3, rng.normal(0, 2, (n_rows, nb)), 0)
    shift = shift.astype(np.float32)
    w *= np.repeat(scale, 32, axis=1)[:, :n]
    w += np.repeat(shift * scale, 32, axis=1)[:, :n]
    return w


def random_f16_bits(rng, shape, lo, hi, signed):
    mag = np.exp(rng.uniform(np.log(lo), np.log(hi), shape)).astype(np.float16)
    if signed:
        mag = np.where(rng.random(shape) < 0.5, -mag, mag).astype(np.float16)
    return mag.view(np.uint8).reshape(shape + (2,))


def k_quant_blocks(rng, qtype, n_rows, n):
    """Random bytes for every field, with fp16 d / dmin replaced by small finite values."""
    nblk = n // 256
    size = GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, (n_rows, nblk, size), dtype=np.uint8)
    if qtype == T.Q6_K:
        raw[..., 208:210] = random_f16_bits(rng, (n_rows, nblk), 1e-4, 2e-2, True)
    else:  # Q4_K, Q5_K: d at 0, dmin at 2
        raw[..., 0:2] = random_f16_bits(rng, (n_rows, nblk), 1e-4, 2e-2, True)
        raw[..., 2:4] = random_f16_bits(rng, (n_rows, nblk), 1e-5, 1e-2, True)
    return raw.reshape(n_rows, nblk * size)


def weight_rows(rng, qtype, n):
    if qtype in (T.Q4_K, T.Q5_K, T.Q6_K):
        return k_quant_blocks(rng, qtype, ROWS, n)
    w = random_weights(rng, ROWS, n)
    if qtype == T.F32:
        return w.view(np.uint8).reshape(ROWS, -1)
    if qtype == T.F16:
        # Include fp16 subnormals (|x| < 6.1e-5) and values near the fp16 maximum.
        tiny = rng.random((ROWS, n)) < 0.1
        w = np.where(tiny, w * 1e-5, w)
        w[:, 7] = 65504.0
        w[:, 8] = -6e-8
        return w.astype(np.float16).view(np.uint8).reshape(ROWS, -1)
    return np.asarray(quantize(w, qtype)).view(np.uint8).reshape(ROWS, -1)


def write_type(out_dir, rng, qtype):
    n = N_BY_TYPE[qtype]
    w = weight_rows(rng, qtype, n)
    deq = np.asarray(dequantize(w, qtype), dtype=np.float32).reshape(ROWS, n)
    assert np.all(np.isfinite(deq)), qtype.name
    x = rng.standard_normal((NX, n)).astype(np.float32)
    x[:, ::17] *= 8.0  # a few outliers, as activations have
    dot = x.astype(np.float64) @ deq.astype(np.float64).T  # [nx][rows]
    path = os.path.join(out_dir, f"{qtype.name}.bin")
    with open(path, "wb") as f:
        f.write(b"KVQG" + struct.pack("<5I", 1, int(qtype), n, ROWS, NX))
        f.write(np.ascontiguousarray(w, dtype=np.uint8).tobytes())
        f.write(deq.astype("<f4").tobytes())
        f.write(x.astype("<f4").tobytes())
        f.write(dot.astype("<f8").tobytes())
    return path


def write_conv(out_dir, rng):
    halves = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    f16_to_f32 = halves.view(np.float16).astype(np.float32).view(np.uint32)

    vals = []
    # Exact midpoints between neighbouring finite halves (ties: round to even) and points just
    # around them, over the whole range including subnormals.
    h = rng.integers(0, 0x7BFF, 1024).astype(np.uint16)
    lo = h.view(np.float16).astype(np.float64)
    hi = (h + 1).astype(np.uint16).view(np.float16).astype(np.float64)
    mid = ((lo + hi) / 2).astype(np.float32)
    vals += [mid, np.nextafter(mid, np.float32(np.inf)), np.nextafter(mid, np.float32(0))]
    vals.append(np.exp(rng.uniform(np.log(1e-9), np.log(7e4), 1024)).astype(np.float32))
    edge = [0.0, -0.0, 65504.0, 65519.996, 65520.0, 65536.0, 1e10, np.inf, -np.inf, np.nan,
            6.103515625e-05, 6.0975552e-05, 5.9604645e-08, 2.9802322e-08, 2.9802326e-08,
            8.940697e-08, 1e-45, -1e-30, 1.0, -2.5]
    vals.append(np.array(edge, dtype=np.float32))
    f32 = np.concatenate(vals).astype(np.float32)
    f32 = np.concatenate([f32, -f32])
    with np.errstate(over="ignore"):
        f16 = f32.astype(np.float16).view(np.uint16)
    path = os.path.join(out_dir, "conv.bin")
    with open(path, "wb") as f:
        f.write(b"KVQC" + struct.pack("<2I", 1, len(f32)))
        f.write(f16_to_f32.astype("<u4").tobytes())
        f.write(f32.view(np.uint32).astype("<u4").tobytes())
        f.write(f16.astype("<u2").tobytes())
    return path


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(__file__), "..", "..", "tests", "golden", "quant")
    os.makedirs(out_dir, exist_ok=True)
    rng = np.random.default_rng(SEED)
    total = 0
    for qtype in N_BY_TYPE:
        total += os.path.getsize(write_type(out_dir, rng, qtype))
    total += os.path.getsize(write_conv(out_dir, rng))
    print(f"make_quant_goldens: wrote {len(N_BY_TYPE) + 1} files, {total} bytes, to {out_dir}")


if __name__ == "__main__":
    main()
