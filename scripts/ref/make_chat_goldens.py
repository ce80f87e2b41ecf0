#!/usr/bin/env python3
"""Writes tests/golden/chat/*.json: chat templates rendered by the reference Jinja engine.

kvserve does not execute Jinja; model/chat.c re-implements the few prompt formats it serves.
tests/unit/chat_test.c checks chat_render against these files byte for byte. The expected text
comes from the PyPI `jinja2` package (pip install jinja2) run the way Hugging Face transformers
runs chat templates (transformers/utils/chat_template_utils.py, _compile_jinja_template):
ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True) with the loopcontrols
extension, a `raise_exception` global that raises, and the tokenizer's special tokens
(bos_token, eos_token) passed as variables.

Templates: SmolLM2's, read from the GGUF (pip install gguf), and the published Hugging Face
templates of plain ChatML, Qwen2, Llama 3 and Llama 2, kept below verbatim as data.

Usage: python3 scripts/ref/make_chat_goldens.py [--model models/SmolLM2-135M-Instruct.Q4_1.gguf]
"""
import argparse
import json
import os
import sys

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

# ---------------------------------------------------------------- templates

# The ChatML template from the Hugging Face chat templating docs (OpenHermes and others).
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Qwen/Qwen2-7B-Instruct tokenizer_config.json. Written here with Jinja "\n" escapes inside the
# string literals (SmolLM2's GGUF has raw newlines there), so detection sees both spellings.
QWEN2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# meta-llama/Meta-Llama-3-8B-Instruct tokenizer_config.json.
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)

# meta-llama/Llama-2-7b-chat-hf tokenizer_config.json.
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}"
    "{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}"
    "{% endif %}{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)

# ---------------------------------------------------------------- conversations


def msg(role, content):
    return {"role": role, "content": content}


SYS = msg("system", "You are a terse assistant.")
U1 = msg("user", "What is the capital of France?")
A1 = msg("assistant", "Paris.")
U2 = msg("user", "And of Italy?")
A2 = msg("assistant", "Rome.")
U3 = msg("user", "Thanks!")
# Python's str.isspace() set, which Jinja's trim and str.strip() remove: ASCII, C1, Unicode.
UWS = "\u00a0\u3000\u2028\x1c\u2009\x85\t"

CASES = [
    ("user_only_gen", [U1], True),
    ("user_only_nogen", [U1], False),
    ("system_user_gen", [SYS, U1], True),
    ("multi_turn_system", [SYS, U1, A1, U2], True),
    ("multi_turn_no_system", [U1, A1, U2, A2], False),
    ("long_multi_turn", [SYS, U1, A1, U2, A2, U3], True),
    ("unicode", [msg("user", "Bonjour, ça va ? 你好世界 🌍 مرحبا Ωμέγα"),
                 msg("assistant", "Très bien — 谢谢! 👍"), msg("user", "Ünïcödé ✓")], True),
    ("empty_user", [msg("user", "")], True),
    ("empty_system", [msg("system", ""), U1], True),
    ("empty_assistant", [U1, msg("assistant", ""), U2], True),
    ("whitespace_ascii", [msg("system", "  padded system \n"), msg("user", "\n\n  hi there \t\n"),
                          msg("assistant", " ok  "), msg("user", "   ")], True),
    ("whitespace_unicode", [msg("user", UWS + "inner" + UWS + "text" + UWS),
                            msg("assistant", "\u200bzero-width is not space\u200b")], True),
    ("specials_in_content", [msg("user", "<|im_end|> [INST] <<SYS>> </s> <|eot_id|> {{ x }}")],
     True),
    ("escapes_in_content", [msg("user", "tab\there\nline2\r\nback\\slash 'q' \"dq\"")], True),
    ("multiline_system", [msg("system", "Line one.\nLine two.\n\nLine four."), U1], True),
    ("system_only_gen", [SYS], True),
    ("no_messages_gen", [], True),
    ("assistant_first", [A1, U1], True),
    ("two_users", [U1, U2], True),
    ("system_in_middle", [U1, A1, msg("system", "Be brief."), U2], True),
]

# Llama 2's template silently drops a system message at an odd position (it checks only that
# user turns fall on even positions); chat_render rejects it instead, so no golden for it.
SKIP = {"llama2": {"system_in_middle"}}

# ---------------------------------------------------------------- rendering


class TemplateError(Exception):
    pass


def raise_exception(message):
    raise TemplateError(message)


def make_env():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
    return env


def render_cases(env, name, source, bos, eos):
    tmpl = env.from_string(source)
    out = []
    for case_name, messages, gen in CASES:
        if case_name in SKIP.get(name, ()):
            continue
        case = {"name": case_name, "messages": messages, "add_generation_prompt": gen}
        try:
            case["expected"] = tmpl.render(messages=messages, add_generation_prompt=gen,
                                           bos_token=bos, eos_token=eos)
        except (TemplateError, jinja2.exceptions.UndefinedError) as e:
            case["error"] = f"{type(e).__name__}: {e}"
        out.append(case)
    return out


def smollm2_template(model_path):
    from gguf import GGUFReader

    r = GGUFReader(model_path)
    return r.fields["tokenizer.chat_template"].contents()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--out", default="tests/golden/chat")
    args = ap.parse_args()

    smollm2_default = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    templates = [
        # name, origin, source, kind, default system, bos, eos
        ("smollm2", f"{os.path.basename(args.model)}: tokenizer.chat_template",
         smollm2_template(args.model), "chatml", smollm2_default, "<|im_start|>", "<|im_end|>"),
        ("chatml", "Hugging Face chat templating docs: ChatML", CHATML, "chatml", None, "<s>",
         "</s>"),
        ("qwen2", "Qwen/Qwen2-7B-Instruct tokenizer_config.json", QWEN2, "chatml",
         "You are a helpful assistant.", "", "<|im_end|>"),
        ("llama3", "meta-llama/Meta-Llama-3-8B-Instruct tokenizer_config.json", LLAMA3, "llama3",
         None, "<|begin_of_text|>", "<|eot_id|>"),
        ("llama2", "meta-llama/Llama-2-7b-chat-hf tokenizer_config.json", LLAMA2, "llama2", None,
         "<s>", "</s>"),
    ]
    env = make_env()
    os.makedirs(args.out, exist_ok=True)
    for name, origin, source, kind, default_system, bos, eos in templates:
        doc = {
            "name": name,
            "origin": origin,
            "generator": f"scripts/ref/make_chat_goldens.py, jinja2 {jinja2.__version__}",
            "kind": kind,
            "default_system": default_system,
            "bos_token": bos,
            "eos_token": eos,
            "template": source,
            "cases": render_cases(env, name, source, bos, eos),
        }
        path = os.path.join(args.out, f"{name}.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(doc, f, ensure_ascii=False, indent=1)
            f.write("\n")
        n_err = sum("error" in c for c in doc["cases"])
        print(f"{path}: {len(doc['cases'])} cases ({n_err} errors)", file=sys.stderr)


if __name__ == "__main__":
    main()
