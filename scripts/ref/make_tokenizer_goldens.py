#!/usr/bin/env python3
"""Writes the tokenizer goldens of tests/unit/tokenizer_test.c, with llama.cpp as the reference.

    python scripts/ref/make_tokenizer_goldens.py [out_dir]     (default tests/golden/tokenizer)

Needs llama-cpp-python (the reference: llama.cpp's llama-vocab.cpp through its C API), gguf
(GGUFWriter) and sentencepiece; the checked-in files were made with llama-cpp-python 0.3.36,
gguf 0.19.0, sentencepiece 0.2.3, numpy 2.4.6, Python 3.11.7 (versions are also written into
every *_meta.json). Run from the repository root: it reads models/SmolLM2-135M-Instruct.Q4_1.gguf.
Deterministic: the strings come from fixed lists and seeded generators; the same package
versions write the same files.

Outputs (JSONL lines are {"text": str, "special": bool, "ids": [int], "decoded": str}: ids from
Llama.tokenize(text.encode(), add_bos=False, special=special); decoded is the ids' pieces
(llama_token_to_piece, special on) joined, for SentencePiece without the first piece's leading
space, invalid UTF-8 as U+FFFD; it differs from text where the vocabulary lacks a byte, e.g.
SmolLM2 has no token for 0x1D, which llama.cpp then drops):

  smollm2.jsonl        ~330 strings on the real SmolLM2 vocabulary (byte-level BPE, pre-tokenizer
                       "smollm"): prose, code, numbers, whitespace, scripts, emoji, contractions,
                       special-token texts (with special on and off), long and random strings
  smollm2_meta.json    n_vocab, bos, eos, add_bos, the end-of-generation ids, and an FNV-1a hash of
                       every token's piece (llama_token_to_piece, special on and off)
  spm_tiny.gguf        a vocab-only SentencePiece ("llama") GGUF: a 1000-piece BPE model trained
                       here with sentencepiece (byte_fallback) on generated text
  spm_tiny.jsonl       ~260 strings on it, many with chars outside the vocabulary (byte fallback)
  spm_tiny_meta.json   as smollm2_meta.json, plus the sentencepiece cross-check (below)
  bpe_<pre>.gguf       the SmolLM2 vocabulary cut to its first 1500 merges, with tokenizer.ggml.pre
                       = llama-bpe, default, gpt-2: the other pre-tokenizers; the llama-bpe one has
                       two user-defined tokens (matched even without special)
  bpe_<pre>.jsonl      ~150 strings each
  bad_*.gguf           corrupt tokenizer metadata the loader must reject (see bad_fixtures)

and the seeds of tests/fuzz/tokenizer_fuzz.c in tests/fuzz/corpus/tokenizer_fuzz/: text samples
behind each mode byte, and the bad fixtures plus two small valid GGUFs behind the byte 0x80.

The sentencepiece cross-check encodes every spm_tiny string with sentencepiece itself (no BOS)
and counts agreement with llama.cpp; known differences: llama.cpp adds "▁" before the text after
every special token, and lets merges form control / byte tokens ("<s>" typed in as text).
"""
import ctypes
import importlib.metadata as md
import json
import os
import platform
import random
import sys
import tempfile
from pathlib import Path

import llama_cpp
import numpy as np
import sentencepiece as spm
from gguf import GGUFReader, GGUFWriter

MODEL = "models/SmolLM2-135M-Instruct.Q4_1.gguf"

# ---------------------------------------------------------------- string corpus

PROSE = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France?",
    "It was the best of times, it was the worst of times, it was the age of wisdom.",
    "In 1969, Neil Armstrong became the first person to walk on the Moon.",
    "Please summarize the following document in three bullet points.",
    "She sells sea shells by the sea shore; the shells she sells are surely seashells.",
    "Dr. Smith (Ph.D.) arrived at 10:30 a.m. on Jan. 5th -- late, as usual!",
    "E-mail me at john.doe@example.com or visit https://example.org/path?q=1&r=two#frag.",
    "  Leading spaces and trailing spaces   ",
    "ALL CAPS SENTENCE WITH SOME WORDS IN IT",
    "mIxEd CaSe WoRdS aNd PuNcTuAtIoN!?",
    "The model's output wasn't what we'd expected; they'll retry.",
    "Once upon a time, in a land far, far away, there lived a tokenizer.",
    "Q: Why did the chicken cross the road?\nA: To get to the other side.",
    "Step 1: preheat the oven.\nStep 2: mix flour, sugar, and eggs.\nStep 3: bake for 25 minutes.",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor incididunt.",
    "\"Quoted text,\" he said, 'and single quotes too.'",
    "A sentence ending with an ellipsis...",
    "Semicolons; colons: dashes - and em-dashes \u2014 all together.",
]

CODE = [
    "int main(void) {\n    printf(\"hello, world\\n\");\n    return 0;\n}\n",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "for (let i = 0; i < arr.length; i++) { console.log(arr[i]); }",
    "fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * x).collect();\n    println!(\"{:?}\", v);\n}",
    "func add(a, b int) int {\n\treturn a + b\n}",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC LIMIT 10;",
    "<html><body><div class=\"main\">Hi &amp; bye</div></body></html>",
    "#!/bin/bash\nset -euo pipefail\nfor f in *.txt; do echo \"$f\"; done",
    "{\"key\": [1, 2.5, true, null], \"nested\": {\"a\": \"b\"}}",
    "x = [i**2 for i in range(100) if i % 3 == 0]  # squares",
    "public static void Main(string[] args) => Console.WriteLine($\"{args.Length}\");",
    "if (a != b && c <= d || e >= f) { x += 1; y -= 2; z *= 3; w /= 4; }",
    "    indented_with_spaces = True\n\tindented_with_tab = False\n",
    "template <typename T> struct Box { T value; };",
    "@decorator\nclass Foo(Bar, metaclass=Meta):\n    pass\n",
    "const re = /^[a-z0-9_\\-]+@[a-z]+\\.[a-z]{2,}$/i;",
    "print(f\"{x=:>10.3f}\")",
    "a->b->c; p = &q; **pp = *p; arr[i][j] = 0;",
    "```python\nimport os\nprint(os.getcwd())\n```",
    "// TODO(alice): fix this\n/* block\n   comment */",
]

NUMBERS = [
    "0", "7", "42", "123", "1234", "12345", "123456", "1234567", "1234567890",
    "3.14159265358979", "1,000,000", "0x1F2E3D", "2024-01-15T10:30:00Z", "+1 (555) 123-4567",
    "v1.2.3-beta.4", "1e-10", "99.9%", "$1,234.56", "10^6", "3/4", "-273.15",
    "\u0661\u0662\u0663 \u0967\u0968\u0969",  # Arabic-Indic and Devanagari digits
    "\u00bd \u00bc \u00b2 \u00b3 \u2167 \u216b",  # fractions, superscripts, Roman numerals (N)
    "a1b2c3", "abc123def456", "12abc", "1 2 3 4 5", "007", "0000000000000000",
]

WHITESPACE = [
    " ", "  ", "   ", "\n", "\n\n", "\n\n\n", "\t", "\t\t", "\r\n", "\r\n\r\n", " \n ",
    "a b", "a  b", "a   b", "a\tb", "a\nb", "a \n b", "a\n\n\nb", " a", "  a", "a ", "a  ",
    "trailing newline\n", "\n leading newline", "mixed \t \n \r\n whitespace",
    "tabs\t\tand  spaces", "   \t\n", "word\u00a0nbsp", "ideographic\u3000space",
    "line\u2028separator", "en\u2002space em\u2003space", "x \u00a0 y", "  \n  \n  x",
    "end with spaces   ", "\t leading tab", "a \t\t b", "1 \n 2", "\u0085next line",
]

SCRIPTS = [
    "caf\u00e9 na\u00efve r\u00e9sum\u00e9 fa\u00e7ade", "\u00c6r\u00f8sk\u00f8bing Stra\u00dfe",
    "\u00e9t\u00e9 \u00e0 l'\u00e9cole", "\u4f60\u597d\uff0c\u4e16\u754c\uff01",
    "\u3053\u3093\u306b\u3061\u306f\u4e16\u754c\u3001\u30ab\u30bf\u30ab\u30ca",
    "\uc548\ub155\ud558\uc138\uc694 \uc138\uacc4", "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645",
    "\u05e9\u05dc\u05d5\u05dd \u05e2\u05d5\u05dc\u05dd",
    "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e",
    "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35\u0e04\u0e23\u0e31\u0e1a",
    "\u039a\u03b1\u03bb\u03b7\u03bc\u03ad\u03c1\u03b1 \u03ba\u03cc\u03c3\u03bc\u03b5",
    "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440!",
    "\u10d2\u10d0\u10db\u10d0\u10e0\u10ef\u10dd\u10d1\u10d0", "\u0540\u0561\u0575\u0565\u0580\u0565\u0576",
    "\u1200\u1208\u121d", "\u13a0\u13a1\u13a2",  # Ethiopic, Cherokee
    "e\u0301 a\u0308 n\u0303 o\u0302",  # combining marks
    "Z\u0351\u036b\u0343\u036a\u0302\u036b\u033d\u034f\u0334\u0319a\u0300\u0301l\u0352g\u0308o",
    "\u2200x\u2208\u211d: x\u00b2 \u2265 0", "\u2122 \u00a9 \u00ae \u00b0C \u00b5s",
    "\u2500\u2502\u250c\u2510\u2514\u2518", "\u201cSmart quotes\u201d and \u2018apostrophes\u2019",
    "\u2026 \u2014 \u2013 \u2022 \u00b7", "\u00bfQu\u00e9? \u00a1S\u00ed!",
    "Mixed: English, \u65e5\u672c\u8a9e, \u0627\u0644\u0639\u0631\u0628\u064a\u0629, and \u0939\u093f\u0928\u094d\u0926\u0940.",
    "\U0001D400\U0001D401\U0001D402 math bold",
    "\u0130stanbul \u0131\u015f\u0131k", "\u1e9e \u00df \u017f",
]

EMOJI = [
    "\U0001F600", "\U0001F600\U0001F601\U0001F602", "I love it \U0001F60D!",
    "\U0001F44D\U0001F3FD", "\U0001F44B\U0001F3FB \U0001F44B\U0001F3FF",
    "\U0001F468\u200d\U0001F469\u200d\U0001F467\u200d\U0001F466",  # family ZWJ
    "\U0001F3F3\ufe0f\u200d\U0001F308", "\U0001F1EB\U0001F1F7 \U0001F1EF\U0001F1F5",
    "\u2764\ufe0f \u2764", "\U0001F9D1\U0001F3FE\u200d\U0001F4BB coding",
    "1\ufe0f\u20e3 2\ufe0f\u20e3", "text\U0001F525text", "\U0001F680 launch \U0001F319",
    "\U0001F937\u200d\u2642\ufe0f", "\U0001FAE0 \U0001FAE8",
]

CONTRACTIONS = [
    "don't", "I'M", "we've", "they'll", "she'd", "it's", "'s", "O'Reilly", "rock 'n' roll",
    "DON'T STOP", "you're", "Y'ALL", "'twas", "can't won't shouldn't", "I'd've",
    "the cat's toy", "'re 've 'll 'd 'm 't", "It'S", "WE'LL", "''", "'", "' s",
    "l'amour", "d'accord", "rock'n'roll", "ma'am", "90's", "'90s",
]

PUNCT = [
    "!!!", "???", "?!?!", "...", "....", "-----", "=====", "<<<>>>", "```", "~~~", "***",
    "___", "###", "@@@", "$$$", "%%%", "^^^", "&&&", "|||", "\\\\\\", "///", "(((", ")))",
    "[[]]", "{{}}", ";;;", "::", ",,,", "+-*/", "<=>", "a.b.c", "a,b,c", "end.", "(x)",
    "\u3002\u3001\uff01", "\u00ab\u00bb", "\u2018\u2019\u201c\u201d", "#1", "@user", "`code`",
]

SPECIAL_SMOLLM = [
    "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|im_start", "im_start|>", "<|im_start|><|im_end|>",
    "a<|im_end|>b", "<<|im_end|>>", " <|im_end|> ", "<|im_start|>  spaces  <|im_end|>",
    "<repo_name>kvserve<file_sep>main.c<gh_stars>100", "<reponame>x<filename>y.py",
    "<jupyter_start><jupyter_code>print(1)<jupyter_output>1<empty_output>",
    "<issue_start>bug<issue_comment>fixed<issue_closed>", "<|IM_END|>", "<|im_end|\n>",
    "text <|endoftext|> more text", "<|im_end|><|im_end|><|im_end|>", "<s></s><unk>",
]

SPECIAL_SPM = [
    "<s>", "</s>", "<unk>", "<s>hello</s>", "a<s>b", " <s> ", "<s><s>", "<0x41>", "<0x0A>x",
    "hello <unk> world", "<s>[INST] question [/INST]", "</s></s>", "<s>  x",
]


def long_strings(rng: random.Random) -> list:
    words = " ".join(PROSE)
    letters = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(1500))
    return [
        "a" * 500, "supercalifragilisticexpialidocious" * 3, "ab" * 300, letters,
        "\U0001F600" * 40, "1234567890" * 20, " " * 100, "\n" * 50, "\t" * 30, "!?" * 100,
        (words + " ") * 3, "pneumonoultramicroscopicsilicovolcanoconiosis",
        "\u4e2d\u6587" * 150, "x" * 1000 + " y", "A" * 64 + "a" * 64,
    ]


def random_strings(rng: random.Random, n: int) -> list:
    pools = [
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
        "0123456789",
        " \t\n\r  ",
        "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
        "\u00e0\u00e9\u00ee\u00f5\u00fc\u00e7\u00f1\u00df\u00f8\u00e5\u0153\u00e6",
        "\u4e00\u4e8c\u4e09\u56db\u4f60\u597d\u4e16\u754c\u65e5\u672c\u8a9e",
        "\u0627\u0628\u062a\u062b\u0645\u0631\u062d",
        "\u0905\u0906\u0907\u0915\u0916\u094d\u093e",
        "\U0001F600\U0001F44D\U0001F3FD\u200d\U0001F525\u2764\ufe0f",
        "\u0301\u0308\u0303",
        "\u00a0\u3000\u2009",
        "\u0661\u0662\u00bd\u00b2",
    ]
    out = []
    for _ in range(n):
        length = rng.choice([1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144])
        weights = [rng.random() for _ in pools]
        s = "".join(rng.choice(rng.choices(pools, weights)[0]) for _ in range(length))
        out.append(s)
    return out


def misc_strings() -> list:
    return ["", "a", "A", "Z", "\x00", "a\x00b", "\x01\x02\x7f", "\x1c\x1d\x1e\x1f", "\u200b",
            "\ufeffBOM", "\ufffd", "\uffff", "\U0010FFFD", "\ue000 private use"]


def corpus(extra_special: list, seed: int, n_random: int) -> list:
    rng = random.Random(seed)
    strings = (PROSE + CODE + NUMBERS + WHITESPACE + SCRIPTS + EMOJI + CONTRACTIONS + PUNCT +
               extra_special + long_strings(rng) + misc_strings() + random_strings(rng, n_random))
    seen, out = set(), []
    for s in strings:
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


# ---------------------------------------------------------------- reference

def versions() -> dict:
    v = {"python": platform.python_version()}
    for p in ("llama_cpp_python", "gguf", "sentencepiece", "numpy"):
        try:
            v[p] = md.version(p)
        except md.PackageNotFoundError:
            v[p] = None
    return v


def load_ref(path: str) -> llama_cpp.Llama:
    return llama_cpp.Llama(path, vocab_only=True, verbose=False)


def piece(vocab, tok: int, special: bool) -> bytes:
    buf = (ctypes.c_char * 1024)()
    n = llama_cpp.llama_token_to_piece(vocab, tok, buf, 1024, 0, special)
    assert 0 <= n <= 1024
    return bytes(buf[:n])


def fnv1a64(chunks) -> str:
    """FNV-1a 64 over, for each token, its piece length (u32 LE) then its bytes."""
    h = 0xCBF29CE484222325
    for c in chunks:
        for b in len(c).to_bytes(4, "little") + c:
            h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return "%016x" % h


def meta(llm: llama_cpp.Llama, extra: dict) -> dict:
    vocab = llm._model.vocab
    n = llama_cpp.llama_vocab_n_tokens(vocab)
    m = {
        "generated_by": "scripts/ref/make_tokenizer_goldens.py",
        "versions": versions(),
        "n_vocab": n,
        "bos": llama_cpp.llama_vocab_bos(vocab),
        "eos": llama_cpp.llama_vocab_eos(vocab),
        "add_bos": bool(llama_cpp.llama_vocab_get_add_bos(vocab)),
        "eog": [i for i in range(n) if llama_cpp.llama_vocab_is_eog(vocab, i)],
        "pieces_fnv1a64_special": fnv1a64(piece(vocab, i, True) for i in range(n)),
        "pieces_fnv1a64_plain": fnv1a64(piece(vocab, i, False) for i in range(n)),
    }
    m.update(extra)
    return m


def decoded(llm: llama_cpp.Llama, ids: list) -> str:
    vocab = llm._model.vocab
    # spm_tiny.gguf has add_space_prefix = true (the llama.cpp API does not expose it)
    spm_prefix = llama_cpp.llama_vocab_type(vocab) == llama_cpp.LLAMA_VOCAB_TYPE_SPM
    out, first = b"", True
    for i in ids:
        p = piece(vocab, i, True)
        if p and first:
            if spm_prefix and p.startswith(b" "):
                p = p[1:]
            first = False
        out += p
    return out.decode("utf-8", errors="replace")


def write_goldens(llm: llama_cpp.Llama, strings: list, path: Path, both_when) -> int:
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for s in strings:
            modes = [False, True] if both_when(s) else [False]
            for special in modes:
                ids = llm.tokenize(s.encode("utf-8"), add_bos=False, special=special)
                f.write(json.dumps({"text": s, "special": special, "ids": ids,
                                    "decoded": decoded(llm, ids)}, ensure_ascii=True) + "\n")
                n += 1
    print("%s: %d lines" % (path, n), file=sys.stderr)
    return n


# ---------------------------------------------------------------- fixtures

def write_gguf(path: Path, tokens, types, scores=None, merges=None, model="gpt2", pre=None,
               bos=None, eos=None, unk=None, add_bos=None, add_space_prefix=None, extra=None):
    w = GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    if types is not None:
        w.add_token_types(types)
    if scores is not None:
        w.add_token_scores(scores)
    if merges is not None:
        w.add_token_merges(merges)
    if bos is not None:
        w.add_bos_token_id(bos)
    if eos is not None:
        w.add_eos_token_id(eos)
    if unk is not None:
        w.add_unk_token_id(unk)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    for k, v in (extra or {}).items():
        w.add_uint32(k, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def smollm_vocab():
    r = GGUFReader(MODEL)
    f = r.fields

    def strs(k):
        return [bytes(f[k].parts[i]).decode("utf-8") for i in f[k].data]

    toks = strs("tokenizer.ggml.tokens")
    types = [int(f["tokenizer.ggml.token_type"].parts[i][0]) for i in f["tokenizer.ggml.token_type"].data]
    return toks, types, strs("tokenizer.ggml.merges")


def gpt2_byte_chars() -> list:
    """GPT-2's bytes_to_unicode: the char standing for each byte, in byte order."""
    printable = [b for b in range(256) if 0x21 <= b <= 0x7E or 0xA1 <= b <= 0xAC or b >= 0xAE]
    out, extra = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def cut_bpe(toks, types, merges, n_merges: int, user_defined=()):
    """The first n_merges merges whose parts are already tokens, and only the tokens they and
    the 256 byte chars make: a smaller but complete BPE vocabulary."""
    control = set(t for t, ty in zip(toks, types) if ty == 3)
    keep = [t for t in toks if t in control]
    keep += [c for c in gpt2_byte_chars() if c not in control]
    have = set(keep)
    out_merges = []
    for m in merges:
        if len(out_merges) == n_merges:
            break
        a, b = m.split(" ", 1)
        if a in have and b in have:
            out_merges.append(m)
            if a + b not in have:
                keep.append(a + b)
                have.add(a + b)
    out_types = [3 if t in control else 1 for t in keep]
    for u in user_defined:
        keep.append(u)
        out_types.append(4)
    return keep, out_types, out_merges


SPM_TRAIN_LINES = 4000


def spm_training_text(rng: random.Random) -> str:
    base = PROSE + CODE + CONTRACTIONS
    vocab_words = " ".join(base).split()
    extra = ["caf\u00e9", "na\u00efve", "\u00fcber", "stra\u00dfe", "\u4f60\u597d", "\u4e16\u754c",
             "\u043f\u0440\u0438\u0432\u0435\u0442", "\u043c\u0438\u0440", "10", "2024", "3.14"]
    lines = []
    for _ in range(SPM_TRAIN_LINES):
        n = rng.randint(3, 14)
        lines.append(" ".join(rng.choice(vocab_words + extra) for _ in range(n)))
    return "\n".join(lines) + "\n"


def make_spm(out: Path) -> tuple:
    rng = random.Random(7)
    with tempfile.TemporaryDirectory() as tmp:
        txt = Path(tmp) / "train.txt"
        txt.write_text(spm_training_text(rng), encoding="utf-8")
        prefix = str(Path(tmp) / "tiny")
        # Llama's own settings: no normalization, byte fallback, digits split, a leading "▁".
        spm.SentencePieceTrainer.train(
            input=str(txt), model_prefix=prefix, model_type="bpe", vocab_size=1000,
            byte_fallback=True, character_coverage=0.999, normalization_rule_name="identity",
            add_dummy_prefix=True, remove_extra_whitespaces=False, split_digits=True,
            allow_whitespace_only_pieces=True, num_threads=1, minloglevel=2,
            unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
        sp = spm.SentencePieceProcessor(model_file=prefix + ".model")
    toks, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        toks.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        # llama.cpp's convert_hf_to_gguf.py _create_vocab_sentencepiece mapping
        if sp.is_unknown(i):
            types.append(2)
        elif sp.is_control(i):
            types.append(3)
        elif sp.is_unused(i):
            types.append(5)
        elif sp.is_byte(i):
            types.append(6)
        else:
            types.append(1)
    write_gguf(out, toks, types, scores=scores, model="llama", bos=1, eos=2, unk=0, add_bos=True,
               add_space_prefix=True)
    return sp


def bad_fixtures(out: Path):
    """Corrupt tokenizer metadata; each must fail tokenizer_create with an error."""
    b = ["a", "b", "ab", "c"]
    t1 = [1, 1, 1, 1]
    cases = {
        "bad_merge_missing.gguf": dict(tokens=b, types=t1, merges=["a c"]),  # "ac" not a token
        "bad_merge_nospace.gguf": dict(tokens=b, types=t1, merges=["ab"]),
        "bad_merges_absent.gguf": dict(tokens=b, types=t1, merges=None),
        "bad_bos_range.gguf": dict(tokens=b, types=t1, merges=["a b"], bos=4),
        "bad_eos_range.gguf": dict(tokens=b, types=t1, merges=["a b"], eos=1000),
        "bad_types_len.gguf": dict(tokens=b, types=[1, 1, 1], merges=["a b"]),
        "bad_type_value.gguf": dict(tokens=b, types=[1, 9, 1, 1], merges=["a b"]),
        "bad_model.gguf": dict(tokens=b, types=t1, merges=["a b"], model="wordpiece-x"),
        "bad_spm_scores_len.gguf": dict(tokens=b, types=t1, scores=[0.0, 1.0], model="llama"),
        "bad_spm_byte.gguf": dict(tokens=["<unk>", "<s>", "</s>", "<0xZZ>"], types=[2, 3, 3, 6],
                                  scores=[0.0] * 4, model="llama"),
        "bad_eot_range.gguf": dict(tokens=b, types=t1, merges=["a b"],
                                   extra={"tokenizer.ggml.eot_token_id": 77}),
    }
    for name, kw in cases.items():
        write_gguf(out / name, kw.pop("tokens"), kw.pop("types"), **kw)
    # an empty vocabulary
    write_gguf(out / "bad_empty_vocab.gguf", [], [], merges=[])


def fuzz_seeds(golden: Path, corpus_dir: Path):
    corpus_dir.mkdir(parents=True, exist_ok=True)
    texts = ["Hello world", "<|im_start|>user\nHi<|im_end|>\n", "caf\u00e9 \U0001F468\u200d\U0001F469",
             "don't  stop\t\n123456", "<s>a</s> \u4f60\u597d", "x \x1d y"]
    for i, t in enumerate(texts):
        for mode in (0, 1, 2, 3, 4, 7):
            (corpus_dir / ("text_%d_%d" % (i, mode))).write_bytes(bytes([mode]) + t.encode("utf-8"))
    (corpus_dir / "text_invalid_utf8").write_bytes(b"\x00ab\xc3(\xff")
    with tempfile.TemporaryDirectory() as tmp:
        bpe = Path(tmp) / "tiny_bpe.gguf"
        b = gpt2_byte_chars()
        write_gguf(bpe, ["<|im_end|>"] + b + ["He", "ll", "Hell", "Hello"], [3] + [1] * 260,
                   merges=["H e", "l l", "He ll", "Hell o"], pre="smollm", bos=0, eos=0)
        spmf = Path(tmp) / "tiny_spm.gguf"
        bt = ["<0x%02X>" % i for i in range(256)]
        write_gguf(spmf, ["<unk>", "<s>", "</s>"] + bt + ["\u2581", "\u2581H", "el", "lo"],
                   [2, 3, 3] + [6] * 256 + [1] * 4, scores=[0.0] * 259 + [-1.0, -2.0, -3.0, -4.0],
                   model="llama", bos=1, eos=2, unk=0)
        for f in [bpe, spmf] + sorted(golden.glob("bad_*.gguf")):
            (corpus_dir / ("gguf_" + f.stem)).write_bytes(b"\x80" + f.read_bytes())


# ---------------------------------------------------------------- main

def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "tests/golden/tokenizer")
    out.mkdir(parents=True, exist_ok=True)

    # SmolLM2: the real model.
    llm = load_ref(MODEL)
    strings = corpus(SPECIAL_SMOLLM, seed=1234, n_random=100)
    n = write_goldens(llm, strings, out / "smollm2.jsonl", lambda s: "<" in s)
    (out / "smollm2_meta.json").write_text(json.dumps(meta(llm, {"model": MODEL}), indent=1) + "\n")

    # SentencePiece: a tiny trained model.
    sp = make_spm(out / "spm_tiny.gguf")
    llm = load_ref(str(out / "spm_tiny.gguf"))
    strings = corpus(SPECIAL_SPM, seed=99, n_random=60)
    write_goldens(llm, strings, out / "spm_tiny.jsonl", lambda s: "<" in s)
    agree, differ = 0, []
    for s in strings:
        ours = llm.tokenize(s.encode("utf-8"), add_bos=False, special=False)
        theirs = sp.encode(s)
        if ours == theirs:
            agree += 1
        else:
            differ.append(s)
    print("spm_tiny: sentencepiece agrees with llama.cpp on %d/%d strings" % (agree, len(strings)),
          file=sys.stderr)
    (out / "spm_tiny_meta.json").write_text(json.dumps(meta(llm, {
        "sentencepiece_agree": agree, "sentencepiece_total": len(strings),
        "sentencepiece_differ_examples": differ[:10]}), indent=1) + "\n")

    # The other BPE pre-tokenizers on a cut-down SmolLM2 vocabulary.
    toks, types, merges = smollm_vocab()
    for pre in ("llama-bpe", "default", "gpt-2"):
        ud = ("<|user_def|>", "xyzzy") if pre == "llama-bpe" else ()
        kt, ky, km = cut_bpe(toks, types, merges, 1500, ud)
        name = "bpe_" + pre.replace("-", "_")
        write_gguf(out / (name + ".gguf"), kt, ky, merges=km, pre=pre, bos=1, eos=2)
        llm = load_ref(str(out / (name + ".gguf")))
        strings = corpus(SPECIAL_SMOLLM[:8] + ["a<|user_def|>b", "plugh xyzzy xyzzyx"],
                         seed=len(pre), n_random=20)
        write_goldens(llm, strings, out / (name + ".jsonl"), lambda s: "<" in s)
        (out / (name + "_meta.json")).write_text(json.dumps(meta(llm, {"pre": pre}), indent=1) + "\n")

    bad_fixtures(out)
    fuzz_seeds(out, Path("tests/fuzz/corpus/tokenizer_fuzz"))
    return 0 if n >= 300 else 1


if __name__ == "__main__":
    sys.exit(main())
