#!/usr/bin/env python3
"""Writes a GGUF model again at another quantization, for `--draft-model` tests and benchmarks:
the same weights and vocabulary, so as a draft model for the original its greedy tokens agree
almost always (the acceptance rate must be near 100%) while its logits are not bit for bit the
original's (the drafting path is exercised as with a real small model).

Every Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 matrix is dequantized (gguf.quants) and quantized again as
--type (Q8_0 by default, or F16); the norms stay F32; every metadata key is copied, except
general.file_type, which names the new type. The output depends only on the input: running it
twice writes the same bytes.

--swap-tokens A,B writes a copy whose tokens A and B trade texts (the same set of texts, so its
merges still load, but two ids mean other tokens): the server must refuse it as a draft model of
the original.

    python3 scripts/make_draft_model.py models/SmolLM2-135M-Instruct.Q4_1.gguf \
        models/SmolLM2-135M-Instruct.Q8_0.gguf [--type q8_0|f16]

Needs the `gguf` and `numpy` packages (pip install gguf numpy).
"""
import argparse
import os
import sys

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter, quants
from gguf.constants import GGMLQuantizationType as T

REQUANT = {T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0}
# llama.cpp's llama_ftype: MOSTLY_F16 = 1, MOSTLY_Q8_0 = 7
FILE_TYPES = {"q8_0": (T.Q8_0, 7), "f16": (T.F16, 1)}
SKIP_KEYS = {"general.file_type", "general.architecture"}


def copy_metadata(w, reader, file_type, swap):
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in SKIP_KEYS:
            continue
        vtype = field.types[0]
        val = field.contents()
        if key == "tokenizer.ggml.tokens" and swap is not None:
            a, b = swap
            if not (0 <= a < len(val) and 0 <= b < len(val)):
                sys.exit(f"make_draft_model: tokens {a}, {b}: outside the vocabulary")
            val = list(val)
            val[a], val[b] = val[b], val[a]
        if vtype == GGUFValueType.ARRAY:
            w.add_key_value(key, val, vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(key, val, vtype)
    w.add_uint32("general.file_type", file_type)


def convert(t, qtype):
    """The tensor's data as qtype when it is a quantized matrix, else as stored."""
    if t.tensor_type not in REQUANT:
        return t.data, t.tensor_type
    rows = quants.dequantize(t.data, t.tensor_type).astype(np.float32)
    if qtype == T.F16:
        return rows.astype(np.float16), T.F16
    return quants.quantize(rows, qtype), qtype


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--type", choices=sorted(FILE_TYPES), default="q8_0")
    ap.add_argument("--swap-tokens", metavar="A,B",
                    help="two tokens trade texts (a vocabulary that must be refused)")
    args = ap.parse_args()
    swap = tuple(int(x) for x in args.swap_tokens.split(",")) if args.swap_tokens else None
    qtype, file_type = FILE_TYPES[args.type]
    reader = GGUFReader(args.src)
    arch = reader.fields["general.architecture"].contents()
    tmp = args.dst + ".tmp"
    w = GGUFWriter(tmp, arch)
    copy_metadata(w, reader, file_type, swap)
    for t in reader.tensors:
        data, ttype = convert(t, qtype) if swap is None else (t.data, t.tensor_type)
        w.add_tensor(t.name, data, raw_dtype=ttype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, args.dst)  # a partial file never takes the name a test looks for


if __name__ == "__main__":
    main()
