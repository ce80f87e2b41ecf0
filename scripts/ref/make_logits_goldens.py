#!/usr/bin/env python3
"""Logit goldens for the forward pass, from two independent references reading the same GGUF.

1. llama-cpp-python (llama.cpp) on models/SmolLM2-135M-Instruct.Q4_1.gguf, 2 threads, every
   position's logits (logits_all). Like kvserve it quantizes activations to 8 bits, with its own
   rounding choices.
2. An exact forward pass in float64 numpy over the weights as the PyPI `gguf` package dequantizes
   them (no activation quantization, f64 attention): what both engines approximate.

For each prompt the file keeps the token ids (so the C test exercises the forward pass alone, not
the tokenizer) and, per position and reference, the top-32 token ids and logits.

Run (once; the output is committed):
    python3 -m venv /tmp/ref/venv && /tmp/ref/venv/bin/pip install llama-cpp-python gguf numpy
    /tmp/ref/venv/bin/python scripts/ref/make_logits_goldens.py
"""
import json
import sys

import numpy as np
from gguf import GGUFReader
from llama_cpp import Llama, __version__ as llama_cpp_version

from exact_llama import exact_forward

MODEL = "models/SmolLM2-135M-Instruct.Q4_1.gguf"
OUT = "tests/golden/logits/smollm2.json"
TOP = 32

PROMPTS = [
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWhat is the capital of France? Please answer in one sentence "
    "and then explain briefly why the city became the capital, mentioning the river that runs "
    "through it and one famous monument.<|im_end|>\n<|im_start|>assistant\nThe capital of France "
    "is",
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based inks and a wooden press adapted from those used for "
    "wine. Within fifty years, presses had spread to more than two hundred cities across Europe, "
    "and the number of books in circulation grew from thousands to millions.",
    "def fibonacci(n: int) -> list[int]:\n    \"\"\"Return the first n Fibonacci numbers.\"\"\"\n"
    "    seq = [0, 1]\n    while len(seq) < n:\n        seq.append(seq[-1] + seq[-2])\n"
    "    return seq[:n]\n\n\nif __name__ == \"__main__\":\n    for i, x in enumerate(fibonacci(20)):\n"
    "        print(f\"{i:3d} {x:8d}\")\n",
    "Table 3: results. 12.5, 13.75, 1024, 2048, 4096; 3.14159 26535 89793; 2026-11-21T09:44:07Z; "
    "version 0.3.36; 100% of 7 runs passed; mean 42.0 ms, p99 97.3 ms, max 120 ms. Items: "
    "(a) 17 (b) 256 (c) 65536 (d) 4294967296.",
    "Bonjour! Je m'appelle Marie et j'habite à Lyon. Hoy es sábado y hace sol. Привет, как дела? "
    "日本語のテキストも少し入れます。 Emoji: 🚀🔥👍🏽 — and back to English: the quick brown fox "
    "jumps over the lazy dog, again and again, until the sun goes down.",
    "<|im_start|>system\nYou are a patient art teacher who answers in short sentences.<|im_end|>\n"
    "<|im_start|>user\nList three primary colors.<|im_end|>\n<|im_start|>assistant\nThe three "
    "primary colors are red, blue and yellow.<|im_end|>\n<|im_start|>user\nAnd what do you get "
    "when you mix red and blue?<|im_end|>\n<|im_start|>assistant\nMixing red and blue gives",
]


def top(scores):
    ids = np.argsort(-scores, axis=1)[:, :TOP]
    return ids.tolist(), [[round(float(scores[p, t]), 5) for t in ids[p]] for p in range(len(ids))]


def main():
    llm = Llama(model_path=MODEL, n_ctx=1024, n_batch=512, logits_all=True, n_threads=2,
                verbose=False)
    reader = GGUFReader(MODEL)
    cases = []
    for text in PROMPTS:
        ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        if len(ids) < 64:
            sys.exit(f"prompt too short ({len(ids)} tokens): {text[:40]!r}")
        llm.reset()
        llm.eval(ids)
        scores = np.array(llm.scores[: len(ids)], dtype=np.float32)
        top_ids, top_logits = top(scores)
        ex_ids, ex_logits = top(exact_forward(reader, ids))
        cases.append({"text": text, "tokens": [int(t) for t in ids],
                      "top_ids": top_ids, "top_logits": top_logits,
                      "exact_top_ids": ex_ids, "exact_top_logits": ex_logits})
        print(f"{len(ids):4d} tokens  {text[:50]!r}")
    with open(OUT, "w") as f:
        json.dump({"generator": "scripts/ref/make_logits_goldens.py",
                   "reference": f"llama-cpp-python {llama_cpp_version}",
                   "exact_reference": "float64 numpy over gguf-dequantized weights", "model": MODEL,
                   "top": TOP, "cases": cases}, f)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
