#!/usr/bin/env python3
"""Writes a GGUF holding a model's first N layers (block_count set to N), its embeddings, output
norm and head, and all its metadata: the default model cut down to what a device check can carry.
Its logits are not the model's, but it loads, tokenizes and serves like it, and its first layers
are bit for bit the model's (cuda_forward_test compares only the first 4).

  python3 scripts/device/truncate_gguf.py MODEL.gguf OUT.gguf N

N = vocab: the metadata alone, no tensors (the tokenizer that make_bench_model.py copies).
"""
import sys

import gguf


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    src, dst = sys.argv[1], sys.argv[2]
    n = -1 if sys.argv[3] == "vocab" else int(sys.argv[3])
    r = gguf.GGUFReader(src)
    arch = r.fields[gguf.Keys.General.ARCHITECTURE].contents()
    w = gguf.GGUFWriter(dst, arch)
    count_key = gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)
    for f in r.fields.values():
        if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
            continue
        t = f.types[0]
        sub = f.types[-1] if t == gguf.GGUFValueType.ARRAY else None
        value = max(n, 0) if f.name == count_key else f.contents()
        w.add_key_value(f.name, value, t, sub_type=sub)
    keep = [t for t in r.tensors
            if n >= 0 and (not t.name.startswith("blk.") or int(t.name.split(".")[1]) < n)]
    for t in keep:
        w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in keep:
        w.write_tensor_data(t.data, tensor_endianess=r.endianess)
    w.close()


if __name__ == "__main__":
    main()
