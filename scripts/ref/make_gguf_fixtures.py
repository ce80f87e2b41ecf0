#!/usr/bin/env python3
"""Writes the GGUF fixtures of tests/unit/gguf_test.c with the reference writer (PyPI `gguf`).

    python3 scripts/ref/make_gguf_fixtures.py [out_dir]      (default tests/golden/gguf)

Deterministic: the same gguf package version writes the same bytes. The values here are the ones
gguf_test.c asserts; change both together.

  all_types.gguf    every metadata value type, every array element type (strings too), tensors of
                    F32 (1-D, 2-D, 4-D), F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K
                    with a few rows each, and general.alignment = 64
  small.gguf        default alignment (no general.alignment), two tensors: a small fuzz seed
  nested_array.gguf a key holding an array of arrays (kvserve rejects these, as llama.cpp does)

Quantized tensors hold a byte pattern, not real quantized data: the reader never looks inside a
block, and a pattern lets the C test check every byte without a sidecar file.
"""
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from gguf import GGUFWriter


def pattern(n_bytes: int, seed: int) -> np.ndarray:
    """Byte k of tensor `seed`: (k * 31 + seed * 7 + 3) & 0xff (gguf_test.c's pattern_byte)."""
    k = np.arange(n_bytes, dtype=np.uint32)
    return ((k * 31 + seed * 7 + 3) & 0xFF).astype(np.uint8)


# name, ggml type, numpy shape (rows, ..., row length), bytes per block, elements per block
QUANT_TENSORS = [
    ("w.bf16", Q.BF16, (2, 8), 2, 1),
    ("w.q4_0", Q.Q4_0, (2, 32), 18, 32),
    ("w.q4_1", Q.Q4_1, (3, 64), 20, 32),
    ("w.q5_0", Q.Q5_0, (1, 32), 22, 32),
    ("w.q5_1", Q.Q5_1, (2, 32), 24, 32),
    ("w.q8_0", Q.Q8_0, (4, 64), 34, 32),
    ("w.q4_k", Q.Q4_K, (2, 256), 144, 256),
    ("w.q5_k", Q.Q5_K, (1, 256), 176, 256),
    ("w.q6_k", Q.Q6_K, (1, 256), 210, 256),
]


def write(w: GGUFWriter, path: Path) -> None:
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def make_all_types(path: Path) -> None:
    w = GGUFWriter(path, "testarch")  # writes general.architecture = "testarch" first
    w.add_custom_alignment(64)
    w.add_uint8("test.u8", 200)
    w.add_int8("test.i8", -100)
    w.add_uint16("test.u16", 60000)
    w.add_int16("test.i16", -30000)
    w.add_uint32("test.u32", 4000000000)
    w.add_int32("test.i32", -2000000000)
    w.add_float32("test.f32", 1.5)
    w.add_bool("test.bool_t", True)
    w.add_bool("test.bool_f", False)
    w.add_string("test.str", "hello, gguf")
    w.add_string("test.str_utf8", "h\u00e9llo \u2603")
    # add_string skips empty strings; an empty value is legal GGUF, so write it directly.
    w.add_key_value("test.str_empty", "", V.STRING)
    w.add_uint64("test.u64_max", 2**64 - 1)
    w.add_uint64("test.u64", 12345678901234)
    w.add_int64("test.i64", -9000000000000000000)
    w.add_float64("test.f64", 3.141592653589793)
    arrays = [
        ("test.arr_u8", V.UINT8, [1, 2, 255]),
        ("test.arr_i8", V.INT8, [-1, 2, -128]),
        ("test.arr_u16", V.UINT16, [0, 65535]),
        ("test.arr_i16", V.INT16, [-32768, 7]),
        ("test.arr_u32", V.UINT32, [1, 4000000000, 3]),
        ("test.arr_i32", V.INT32, [-5, 0, 5, 2147483647]),
        ("test.arr_u64", V.UINT64, [0, 2**64 - 1]),
        ("test.arr_i64", V.INT64, [-(2**63), 42]),
        ("test.arr_f32", V.FLOAT32, [0.5, -1.25, 3.0]),
        ("test.arr_f64", V.FLOAT64, [1e300, -2.5]),
        ("test.arr_bool", V.BOOL, [True, False, True]),
        ("test.arr_str", V.STRING, ["a", "", "<|im_start|>", "h\u00e9llo"]),
    ]
    for key, sub, val in arrays:
        w.add_key_value(key, val, V.ARRAY, sub_type=sub)

    w.add_tensor("w.f32_1d", (np.arange(8, dtype=np.float32) * 0.5 - 1.0))
    rows, cols = np.meshgrid(np.arange(3), np.arange(8), indexing="ij")
    w.add_tensor("w.f32_2d", (rows * 10 + cols).astype(np.float32))  # ne = {8, 3}
    w.add_tensor("w.f32_4d", np.arange(120, dtype=np.float32).reshape(5, 4, 3, 2))  # {2,3,4,5}
    w.add_tensor("w.f16", ((np.arange(32) - 8) * 0.25).astype(np.float16).reshape(2, 16))
    for seed, (name, qtype, shape, type_size, block) in enumerate(QUANT_TENSORS):
        rows_n = int(np.prod(shape[:-1]))
        row_bytes = shape[-1] // block * type_size
        data = pattern(rows_n * row_bytes, seed).reshape(*shape[:-1], row_bytes)
        w.add_tensor(name, data, raw_dtype=qtype)  # byte shape -> element shape
    write(w, path)


def make_small(path: Path) -> None:
    w = GGUFWriter(path, "llama")
    w.add_uint32("llama.block_count", 1)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_key_value("tokenizer.ggml.tokens", ["<s>", "</s>", "hi"], V.ARRAY, sub_type=V.STRING)
    w.add_tensor("a", np.arange(4, dtype=np.float32))
    w.add_tensor("b", pattern(2 * 34, 1).reshape(2, 34), raw_dtype=Q.Q8_0)  # ne = {32, 2}
    write(w, path)


def make_nested_array(path: Path) -> None:
    w = GGUFWriter(path, "testarch")
    w.add_key_value("test.nested", [[1, 2], [3]], V.ARRAY, sub_type=V.ARRAY)
    write(w, path)


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("tests/golden/gguf")
    out.mkdir(parents=True, exist_ok=True)
    make_all_types(out / "all_types.gguf")
    make_small(out / "small.gguf")
    make_nested_array(out / "nested_array.gguf")


if __name__ == "__main__":
    main()
