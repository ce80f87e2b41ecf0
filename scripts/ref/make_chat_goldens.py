#!/usr/bin/env python3
"""Writes tests/golden/chat/*.json: chat templates rendered by the reference Jinja engine.

kvserve does not execute Jinja; model/chat/chat.c re-implements the few prompt formats it serves.
tests/unit/chat_test.c checks chat_render against these files byte for byte. The expected text
comes from the PyPI `jinja2` package (pip install jinja2) run the way Hugging Face transformers
runs chat templates (transformers/utils/chat_template_utils.py, _compile_jinja_template):
ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True) with the loopcontrols
extension, a `raise_exception` global that raises, and the tokenizer's special tokens
(bos_token, eos_token) passed as variables.

Templates: SmolLM2's, read from the GGUF (pip install gguf), and the published Hugging Face
templates of plain ChatML, Qwen2, Llama 3, Llama 2, Llama 3.1 / 3.2, Qwen 2.5 and Mistral's
(7B v0.2's two, Nemo, Large 2407 and 2411, Small 3.2, Devstral as Unsloth's GGUFs carry it),
kept below verbatim as data, each with its source. A template that requires strftime_now (Mistral
Small 3.2's) is given one that returns a fixed date.

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

# meta-llama/Llama-3.1-8B-Instruct tokenizer_config.json (llama.cpp's copy: models/templates/
# meta-llama-Llama-3.1-8B-Instruct.jinja). meta-llama/Llama-3.3-70B-Instruct's template is
# byte-identical to this one.
LLAMA31 = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# meta-llama/Llama-3.2-3B-Instruct tokenizer_config.json (llama.cpp's copy: models/templates/
# meta-llama-Llama-3.2-3B-Instruct.jinja): 3.1's without builtin_tools, the date from
# strftime_now when the caller defines it.
LLAMA32 = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# Qwen/Qwen2.5-7B-Instruct tokenizer_config.json (llama.cpp's copy: models/templates/
# Qwen-Qwen2.5-7B-Instruct.jinja): ChatML with the Hermes tool format.
QWEN25 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# mistralai/Mistral-Nemo-Instruct-2407 tokenizer_config.json (llama.cpp's copy: models/templates/
# mistralai-Mistral-Nemo-Instruct-2407.jinja): Mistral's v3-tekken format with [TOOL_CALLS].
MISTRAL_NEMO = r"""{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}

{#- This block checks for alternating user/assistant messages, skipping tool calling messages #}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined and message.tool_calls is not none)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS][" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
            {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST]" + system_message + "\n\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST]" + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif (message.tool_calls is defined and message.tool_calls is not none) %}
        {{- "[TOOL_CALLS][" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- message["content"] + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS]{"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""

# mistralai/Mistral-7B-Instruct-v0.2's original template (also v0.1's), which most GGUFs of these
# models carry: no system message at all. Copied from llama.cpp's tests/test-chat-template.cpp,
# "mistralai/Mistral-7B-Instruct-v0.2 (NOTE: Old pre-v1 without a system prompt)".
MISTRAL_LEGACY = r"""{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"""

# mistralai/Mistral-7B-Instruct-v0.2's later template, Mistral's "v1" format with a system
# message before the first user message. llama.cpp's tests/test-chat-template.cpp,
# "mistralai/Mistral-7B-Instruct-v0.2 (mistralai 'v1' template with a system prompt)".
MISTRAL_V1 = r"""{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\n\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token}}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}
"""

# mistralai/Mistral-Large-Instruct-2407's template, Mistral's "v3" format (Mistral 7B v0.3's is
# the same): "[INST] ", the system message in the last user message, [AVAILABLE_TOOLS] [...],
# [TOOL_CALLS] [...], [TOOL_RESULTS] {...}. llama.cpp's tests/test-chat-template.cpp,
# "Mistral-Large-Instruct-2407 (mistralai 'v3' template; modified to have system prompt at
# start)": the test's name describes llama.cpp's own renderer; the template is Mistral's.
MISTRAL_V3 = r"""{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}

{#- This block checks for alternating user/assistant messages, skipping tool calling messages #}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined and message.tool_calls is not none)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
            {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\n\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""

# mistralai/Mistral-Large-Instruct-2411's template, Mistral's "v7" format: [SYSTEM_PROMPT] and
# [INST] each followed by a space. llama.cpp's tests/test-chat-template.cpp,
# "mistralai/Mistral-Large-Instruct-2411 (mistralai 'v7' template)".
MISTRAL_V7 = r"""{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + '[/INST]' }}{% elif message['role'] == 'system' %}{{ '[SYSTEM_PROMPT] ' + message['content'] + '[/SYSTEM_PROMPT]' }}{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + eos_token }}{% else %}{{ raise_exception('Only user, system and assistant roles are supported!') }}{% endif %}{% endfor %}"""

# mistralai/Mistral-Small-3.2-24B-Instruct-2506's template (llama.cpp's copy: models/templates/
# Mistral-Small-3.2-24B-Instruct-2506.jinja), Mistral's "v7-tekken" format (Mistral Small 3.x,
# Devstral): no spaces, roles checked, a default system message carrying today's date.
MISTRAL_SMALL32 = r"""{%- set today = strftime_now("%Y-%m-%d") %}
{%- set default_system_message = "You are Mistral Small 3, a Large Language Model (LLM) created by Mistral AI, a French startup headquartered in Paris.\nYour knowledge base was last updated on 2023-10-01. The current date is " + today + ".\n\nWhen you're not sure about some information or when the user's request requires up-to-date or specific data, you must use the available tools to fetch the information. Do not hesitate to use tools whenever they can provide a more accurate or complete response. If no relevant tools are available, then clearly state that you don't have the information and avoid making up anything.

If the user's question is not clear, ambiguous, or does not provide enough context for you to accurately answer the question, you do not try to answer it right away and you rather ask the user to clarify their request (e.g. \"What are some good restaurants around me?\" => \"Where are you?\" or \"When is the next flight to Tokyo\" => \"Where do you travel from?\").
You are always very attentive to dates, and when asked about information at specific dates, you discard information that is at another date.
You follow these instructions in all languages, and always respond to the user in the language they use or request.
Next sections describe the capabilities that you have.

# WEB BROWSING INSTRUCTIONS

You cannot perform any web search or access internet to open URLs, links etc. If it seems like the user is expecting you to do so, you clarify the situation and ask the user to copy paste the text directly in the chat.

# MULTI-MODAL INSTRUCTIONS

You have the ability to read images, but you cannot generate images. You also cannot transcribe audio files or videos.
You cannot read nor transcribe audio files or videos.

# TOOL CALLING INSTRUCTIONS

You may have access to tools that you can use to fetch information or perform actions. You must use these tools in the following situations:

1. When the request requires up-to-date information.
2. When the request requires specific data that you do not have in your knowledge base.
3. When the request involves actions that you cannot perform without tools.

Always prioritize using tools to provide the most accurate and helpful response. If tools are not available, inform the user that you cannot perform the requested action at the moment." %}

{{- bos_token }}

{%- set system_prompt = default_system_message %}
{%- set loop_messages = messages %}

{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{%- if messages|length > 0 and messages[0]['role'] == 'system' %}
    {%- if messages[0]['content'] is string %}
        {%- set system_prompt = messages[0]['content'] %}
    {%- else %}
        {%- set system_prompt = messages[0]['content'][0]['text'] %}
    {%- endif %}
    {%- set loop_messages = messages[1:] %}
{%- endif %}

{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}

{%- set ns = namespace(index=0) %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or (message.get('tool_calls'))) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}

{{- '[SYSTEM_PROMPT]' + system_prompt + '[/SYSTEM_PROMPT]' }}

{%- for message in loop_messages %}
    {%- if message['role'] == 'system' %}
        {%- if message['content'] is string %}
            {{- '[SYSTEM_PROMPT]' + message['content'] + '[/SYSTEM_PROMPT]' }}
        {%- else %}
            {{- '[SYSTEM_PROMPT]' + message['content'][0]['text'] + '[/SYSTEM_PROMPT]' }}
        {%- endif %}
    {%- elif message['role'] == 'user' %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- '[AVAILABLE_TOOLS]' + tools|tojson + '[/AVAILABLE_TOOLS]' }}
        {%- endif %}
        {{- '[INST]' }}
        {%- if message['content'] is string %}
            {{- message['content'] }}
        {%- else %}
            {%- for block in message['content'] %}
                {%- if block['type'] == 'text' %}
                    {{- block['text'] }}
                {%- elif block['type'] in ['image', 'image_url'] %}
                    {{- '[IMG]' }}
                {%- else %}
                    {{- raise_exception('Only text and image blocks are supported in message content!') }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '[/INST]' }}
    {%- elif message['role'] == 'assistant' %}
        {%- if message.get('tool_calls') %}
            {%- for tool_call in message.tool_calls %}
                {{- '[TOOL_CALLS]' + tool_call.function.name }}
                {%- if not tool_call.id is defined or tool_call.id is not string or tool_call.id|length != 9 %}
                    {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
                {%- endif %}
                {{- '[CALL_ID]' + tool_call.id }}
                {{- '[ARGS]' + tool_call['function']['arguments']|tojson }}
            {%- endfor %}
            {{- eos_token }}
        {%- elif message['content'] is string %}
            {{- message['content'] + eos_token }}
        {%- else %}
            {%- for block in message['content'] %}
                {%- if block['type'] == 'text' %}
                    {{- block['text'] }}
                {%- elif block['type'] in ['image', 'image_url'] %}
                    {{- '[IMG]' }}
                {%- else %}
                    {{- raise_exception('Only text and image blocks are supported in assistant content!') }}
                {%- endif %}
            {%- endfor %}
            {{- eos_token }}
        {%- endif %}
    {%- elif message['role'] == 'tool_results' or message['role'] == 'tool' %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {%- if not message.tool_call_id is defined or message.tool_call_id is not string or message['tool_call_id']|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '[TOOL_RESULTS]' + message.tool_call_id + '[TOOL_CONTENT]' + content|string + '[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception('Only system, user, assistant, and tool roles are supported!') }}
    {%- endif %}
{%- endfor %}
"""

# unsloth/Devstral-Small-2507-GGUF's template (llama.cpp's copy: models/templates/
# unsloth-mistral-Devstral-Small-2507.jinja), the one its GGUFs carry: "v7-tekken" as Mistral
# Small 3.2's, with a fixed default system message, no role order checked and its own tool
# layout.
DEVSTRAL = r"""{#- Copyright 2025-present the Unsloth team. All rights reserved. #}
{#- Licensed under the Apache License, Version 2.0 (the "License") #}
{#- Edits made by Unsloth #}
{%- set default_system_message = 'You are Devstral, a helpful agentic model trained by Mistral AI and using the OpenHands scaffold. You can interact with a computer to solve tasks.\n\n<ROLE>\nYour primary role is to assist users by executing commands, modifying code, and solving technical problems effectively. You should be thorough, methodical, and prioritize quality over speed.\n* If the user asks a question, like \"why is X happening\", don\'t try to fix the problem. Just give an answer to the question.\n</ROLE>\n\n<EFFICIENCY>\n* Each action you take is somewhat expensive. Wherever possible, combine multiple actions into a single action, e.g. combine multiple bash commands into one, using sed and grep to edit/view multiple files at once.\n* When exploring the codebase, use efficient tools like find, grep, and git commands with appropriate filters to minimize unnecessary operations.\n</EFFICIENCY>\n\n<FILE_SYSTEM_GUIDELINES>\n* When a user provides a file path, do NOT assume it\'s relative to the current working directory. First explore the file system to locate the file before working on it.\n* If asked to edit a file, edit the file directly, rather than creating a new file with a different filename.\n* For global search-and-replace operations, consider using `sed` instead of opening file editors multiple times.\n</FILE_SYSTEM_GUIDELINES>\n\n<CODE_QUALITY>\n* Write clean, efficient code with minimal comments. Avoid redundancy in comments: Do not repeat information that can be easily inferred from the code itself.\n* When implementing solutions, focus on making the minimal changes needed to solve the problem.\n* Before implementing any changes, first thoroughly understand the codebase through exploration.\n* If you are adding a lot of code to a function or file, consider splitting the function or file into smaller pieces when appropriate.\n</CODE_QUALITY>\n\n<VERSION_CONTROL>\n* When configuring git credentials, use \"openhands\" as the user.name and \"openhands@all-hands.dev\" as the user.email by default, unless explicitly instructed otherwise.\n* Exercise caution with git operations. Do NOT make potentially dangerous changes (e.g., pushing to main, deleting repositories) unless explicitly asked to do so.\n* When committing changes, use `git status` to see all modified files, and stage all files necessary for the commit. Use `git commit -a` whenever possible.\n* Do NOT commit files that typically shouldn\'t go into version control (e.g., node_modules/, .env files, build directories, cache files, large binaries) unless explicitly instructed by the user.\n* If unsure about committing certain files, check for the presence of .gitignore files or ask the user for clarification.\n</VERSION_CONTROL>\n\n<PULL_REQUESTS>\n* When creating pull requests, create only ONE per session/issue unless explicitly instructed otherwise.\n* When working with an existing PR, update it with new commits rather than creating additional PRs for the same issue.\n* When updating a PR, preserve the original PR title and purpose, updating description only when necessary.\n</PULL_REQUESTS>\n\n<PROBLEM_SOLVING_WORKFLOW>\n1. EXPLORATION: Thoroughly explore relevant files and understand the context before proposing solutions\n2. ANALYSIS: Consider multiple approaches and select the most promising one\n3. TESTING:\n   * For bug fixes: Create tests to verify issues before implementing fixes\n   * For new features: Consider test-driven development when appropriate\n   * If the repository lacks testing infrastructure and implementing tests would require extensive setup, consult with the user before investing time in building testing infrastructure\n   * If the environment is not set up to run tests, consult with the user first before investing time to install all dependencies\n4. IMPLEMENTATION: Make focused, minimal changes to address the problem\n5. VERIFICATION: If the environment is set up to run tests, test your implementation thoroughly, including edge cases. If the environment is not set up to run tests, consult with the user first before investing time to run tests.\n</PROBLEM_SOLVING_WORKFLOW>\n\n<SECURITY>\n* Only use GITHUB_TOKEN and other credentials in ways the user has explicitly requested and would expect.\n* Use APIs to work with GitHub or other platforms, unless the user asks otherwise or your task requires browsing.\n</SECURITY>\n\n<ENVIRONMENT_SETUP>\n* When user asks you to run an application, don\'t stop if the application is not installed. Instead, please install the application and run the command again.\n* If you encounter missing dependencies:\n  1. First, look around in the repository for existing dependency files (requirements.txt, pyproject.toml, package.json, Gemfile, etc.)\n  2. If dependency files exist, use them to install all dependencies at once (e.g., `pip install -r requirements.txt`, `npm install`, etc.)\n  3. Only install individual packages directly if no dependency files are found or if only specific packages are needed\n* Similarly, if you encounter missing dependencies for essential tools requested by the user, install them when possible.\n</ENVIRONMENT_SETUP>\n\n<TROUBLESHOOTING>\n* If you\'ve made repeated attempts to solve a problem but tests still fail or the user reports it\'s still broken:\n  1. Step back and reflect on 5-7 different possible sources of the problem\n  2. Assess the likelihood of each possible cause\n  3. Methodically address the most likely causes, starting with the highest probability\n  4. Document your reasoning process\n* When you run into any major issue while executing a plan from the user, please don\'t try to directly work around it. Instead, propose a new plan and confirm with the user before proceeding.\n</TROUBLESHOOTING>' %}

{{- bos_token }}

{%- if messages[0]['role'] == 'system' %}
    {%- if messages[0]['content'] is string %}
        {%- set system_message = messages[0]['content'] %}
    {%- else %}
        {%- set system_message = messages[0]['content'][0]['text'] %}
    {%- endif %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system_message = default_system_message %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- '[SYSTEM_PROMPT]' + system_message + '[/SYSTEM_PROMPT]' }}


{#- Tool description appended ONLY to last user message. Edits made by Unsloth #}
{#- Tool description appended also if last message is tool. Edits made by Unsloth #}
{%- set tools_description = "" %}
{%- set has_tools = false %}

{%- if tools is defined and tools is not none and tools|length > 0 %}

    {%- set has_tools = true %}
    {%- set tools_description = "[AVAILABLE_TOOLS]" + (tools | tojson) + "[/AVAILABLE_TOOLS]" %}

    {{- tools_description }}

{%- endif %}

{%- for message in loop_messages %}
    {%- if message['role'] == 'user' %}

        {%- if message['content'] is string %}
            {{- '[INST]' + message['content'] + '[/INST]' }}
        {%- else %}
            {{- '[INST]' }}
            {%- for block in message['content'] %}
                {%- if block['type'] == 'text' %}

                    {#- Original did not have content which is weird. Added by Un-sloth. #}
                    {%- if block['text'] is defined %}
                        {{- block['text'] }}
                    {%- else %}
                        {{- block['content'] }}
                    {%- endif %}

                {%- elif block['type'] in ['image', 'image_url'] %}
                    {{- '[IMG]' }}
                {%- else %}
                    {{- raise_exception('Only text and image blocks are supported in message content!') }}
                {%- endif %}
            {%- endfor %}
            {{- '[/INST]' }}
        {%- endif %}

    {%- elif message['role'] == 'system' %}
        {%- if message['content'] is string %}
            {{- '[SYSTEM_PROMPT]' + message['content'] + '[/SYSTEM_PROMPT]' }}
        {%- else %}
            {{- '[SYSTEM_PROMPT]' + message['content'][0]['text'] + '[/SYSTEM_PROMPT]' }}
        {%- endif %}
        

    {%- elif message['role'] == 'assistant' %}
        {%- if message['content'] is string %}
            {{- message['content'] }}
        {%- else %}
            {{- message['content'][0]['text'] }}
        {%- endif %}

        {#- If User,Assistant,Tool,Tool we also need to append tools_description. Edits made by Unsloth #}

        {%- if message['tool_calls'] is defined and message['tool_calls'] is not none %}
            {%- for tool in message['tool_calls'] %}
                {%- set arguments = tool['function']['arguments'] %}
                {%- if arguments is not string %}
                    {%- set arguments = arguments|tojson %}
                {%- endif %}
                {#- Must list tool calls AFTER assistant. Edits made by Un-sloth #}
                {{- "[TOOL_CALLS]" + tool['function']['name'] + "[ARGS]" + arguments }}
            {%- endfor %}
        {%- endif %}

        {{- eos_token }}

    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- "[TOOL_RESULTS]" + content|string + "[/TOOL_RESULTS]" }}

    {%- else %}
        {{- raise_exception('Only user, systemm assistant and tool roles are supported in the custom template made by Unsloth!') }}
    {%- endif %}
{%- endfor %}
{#- Copyright 2025-present the Unsloth team. All rights reserved. #}
{#- Licensed under the Apache License, Version 2.0 (the "License") #}"""

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
SKIP = {"llama2": {"system_in_middle"},
        # Mistral's original 7B template raises on any system message; kvserve opens the first
        # user message with a leading one, as the later template of the same models (v1) does
        # (tests/unit/chat_test.c checks that rendering)
        "mistral-legacy": {"system_user_gen", "multi_turn_system", "long_multi_turn",
                           "empty_system", "whitespace_ascii", "multiline_system",
                           "system_only_gen"},
        # Devstral's template checks no role order; kvserve's v7-tekken checks it as Mistral
        # Small 3.2's template does, so these are refused rather than rendered
        "devstral-small-2507": {"assistant_first+system", "two_users+system",
                                "system_in_middle+system"}}

# Mistral Small 3.x's template inserts a default system message that carries today's date
# (strftime_now). kvserve inserts none (a prompt's text, and its cached KV, would change at
# midnight), so its goldens give every conversation a system message of its own: the cases
# without one get SYS in front and "+system" in their name.


def with_own_system(cases):
    out = []
    for name, messages, gen, tools in cases:
        if not messages or messages[0]["role"] != "system":
            name, messages = name + "+system", [SYS] + messages
        out.append((name, messages, gen, tools))
    return out


# The date the goldens' strftime_now gives; with a system message it is never rendered.
def strftime_now(fmt):
    return "2025-01-01"


# ---------------------------------------------------------------- conversations with tools
#
# As an OpenAI request becomes template variables in vLLM and llama-server: `tools` is the
# request's list of {"type": "function", "function": {...}} dicts, and an assistant turn's call
# arguments, which OpenAI sends as JSON text, are parsed into a dict (Hugging Face's tool-use
# templates expect one). Mistral's template insists on 9-character alphanumeric call ids.


def tool(name, description, parameters):
    fn = {"name": name}
    if description is not None:
        fn["description"] = description
    if parameters is not None:
        fn["parameters"] = parameters
    return {"type": "function", "function": fn}


WEATHER = tool("get_weather", "Get the current weather in a city.", {
    "type": "object",
    "properties": {"city": {"type": "string", "description": "City name, e.g. \"Paris\""},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city"]})
# Non-ASCII, <>&' (jinja2's own tojson would escape them), numbers of every form Python writes.
SEARCH = tool("search_docs", "Search the docs \u2014 <b>naïve</b> & 'quoted', 日本語", {
    "type": "object",
    "properties": {"query": {"type": "string", "minLength": 1},
                   "limit": {"type": "integer", "minimum": 1, "maximum": 100, "default": 10},
                   "score": {"type": "number", "minimum": 0, "maximum": 1.0,
                             "examples": [1e-05, 0.0001, 1e16, 123456789012345.6, -0.0,
                                          2.5e-300, 1e300, 0.1, 100.0]},
                   "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
                   "opts": {"type": "object", "properties": {}},
                   "exact": {"type": ["boolean", "null"]},
                   "deep": {"type": "array"}},
    "required": ["query"], "additionalProperties": False})
PING = tool("ping", None, None)
TOOLS = [WEATHER, SEARCH, PING]


def call(id_, name, arguments):
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}


def calls(content, *tool_calls):
    return {"role": "assistant", "content": content, "tool_calls": list(tool_calls)}


def result(id_, content):
    return {"role": "tool", "tool_call_id": id_, "content": content}


UW = msg("user", "What is the weather in Paris?")
C_PARIS = call("a1B2c3D4e", "get_weather", {"city": "Paris", "unit": "celsius"})
C_SEARCH = call("Zz9Yy8Xx7", "search_docs", {
    "query": "naïve \"quotes\" <tag> & 'apostrophes'\nnew line\ttab \u2028 \x01",
    "limit": 3, "score": 0.25, "tags": ["a", "b"], "opts": {}, "exact": None,
    "deep": [[1, 2.5e-07], {"k": False}]})
C_PING = call("000000001", "ping", {})
R_PARIS = result("a1B2c3D4e", "18 degrees and sunny")
R_SEARCH = result("Zz9Yy8Xx7", '{"hits": ["intro.md"], "note": "ünï"}')
R_PING = result("000000001", "pong")

TOOL_CASES = [
    ("tools_listed", [UW], True, TOOLS),
    ("tools_listed_system", [SYS, UW], True, TOOLS),
    ("tools_one_tool", [SYS, U1, A1, UW], True, [WEATHER]),
    ("tools_call_turn", [UW, calls(None, C_PARIS)], False, TOOLS),
    ("tools_call_with_content", [UW, calls("Let me check.", C_PARIS)], False, TOOLS),
    ("tools_result", [SYS, UW, calls(None, C_PARIS), R_PARIS], True, TOOLS),
    ("tools_result_answered", [SYS, UW, calls(None, C_PARIS), R_PARIS,
                               msg("assistant", "It is 18 degrees and sunny."), U3], True, TOOLS),
    ("tools_arguments_escaped", [UW, calls(None, C_SEARCH), R_SEARCH], True, TOOLS),
    ("tools_parallel", [SYS, UW, calls(None, C_PARIS, C_PING), R_PARIS, R_PING], True, TOOLS),
    ("tools_three_parallel", [UW, calls("", C_PARIS, C_SEARCH, C_PING), R_PARIS, R_SEARCH,
                              R_PING], True, TOOLS),
    ("tools_two_rounds", [UW, calls(None, C_PARIS), R_PARIS, msg("assistant", "Sunny."), U2,
                          calls(None, C_PING), R_PING], True, TOOLS),
    ("tools_repeated_user", [UW, msg("assistant", "Which unit?"), UW], True, TOOLS),
    # tool_choice "none": no tools listed, earlier calls and results still rendered
    ("no_tools_call_history", [SYS, UW, calls(None, C_PARIS), R_PARIS], True, None),
    ("no_tools_two_rounds", [UW, calls(None, C_PARIS), R_PARIS, msg("assistant", "Sunny."), U2],
     True, None),
    ("tools_no_user", [SYS], True, TOOLS),
]

# ---------------------------------------------------------------- rendering


class TemplateError(Exception):
    pass


def raise_exception(message):
    raise TemplateError(message)


def make_env():
    """transformers' environment: its tojson filter is json.dumps(ensure_ascii=False) with the
    indent/separators/sort_keys options and no key sorting by default (jinja2's own tojson sorts
    keys and escapes <>&'). transformers also defines strftime_now (today's date, which
    Llama 3.2's template prefers to its fallback); kvserve renders the fallback date, so the
    goldens are made without it."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env.filters["tojson"] = tojson
    return env


def render_cases(env, name, source, bos, eos, cases):
    tmpl = env.from_string(source)
    out = []
    for case_name, messages, gen, tools in cases:
        if case_name in SKIP.get(name, ()):
            continue
        case = {"name": case_name, "messages": messages, "add_generation_prompt": gen}
        variables = {"messages": messages, "add_generation_prompt": gen, "bos_token": bos,
                     "eos_token": eos}
        if "strftime_now(" in source and "strftime_now is defined" not in source:
            variables["strftime_now"] = strftime_now  # a template that requires it
        if tools is not None:
            case["tools"] = tools
            variables["tools"] = tools
        try:
            case["expected"] = tmpl.render(**variables)
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
    plain = [(n, m, g, None) for n, m, g in CASES]
    with_tools = plain + TOOL_CASES
    llama3_bos, llama3_eos = "<|begin_of_text|>", "<|eot_id|>"
    templates = [
        # name, origin, source, kind, default system, bos, eos, cases
        ("smollm2", f"{os.path.basename(args.model)}: tokenizer.chat_template",
         smollm2_template(args.model), "chatml", smollm2_default, "<|im_start|>", "<|im_end|>",
         plain),
        ("chatml", "Hugging Face chat templating docs: ChatML", CHATML, "chatml", None, "<s>",
         "</s>", plain),
        ("qwen2", "Qwen/Qwen2-7B-Instruct tokenizer_config.json", QWEN2, "chatml",
         "You are a helpful assistant.", "", "<|im_end|>", plain),
        ("llama3", "meta-llama/Meta-Llama-3-8B-Instruct tokenizer_config.json", LLAMA3, "llama3",
         None, llama3_bos, llama3_eos, plain),
        ("llama2", "meta-llama/Llama-2-7b-chat-hf tokenizer_config.json", LLAMA2, "llama2", None,
         "<s>", "</s>", plain),
        ("llama3.1", "meta-llama/Llama-3.1-8B-Instruct tokenizer_config.json (also Llama 3.3)",
         LLAMA31, "llama3.1", None, llama3_bos, llama3_eos, with_tools),
        ("llama3.2", "meta-llama/Llama-3.2-3B-Instruct tokenizer_config.json", LLAMA32,
         "llama3.1", None, llama3_bos, llama3_eos, with_tools),
        ("qwen2.5", "Qwen/Qwen2.5-7B-Instruct tokenizer_config.json", QWEN25, "qwen2.5",
         "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.", "",
         "<|im_end|>", with_tools),
        ("mistral-nemo", "mistralai/Mistral-Nemo-Instruct-2407 tokenizer_config.json",
         MISTRAL_NEMO, "mistral-nemo", None, "<s>", "</s>", with_tools),
        ("mistral-legacy", "mistralai/Mistral-7B-Instruct-v0.2 tokenizer_config.json, the "
         "original (llama.cpp tests/test-chat-template.cpp)", MISTRAL_LEGACY, "mistral-legacy",
         None, "<s>", "</s>", plain),
        ("mistral-v1", "mistralai/Mistral-7B-Instruct-v0.2 tokenizer_config.json, 'v1' (llama.cpp "
         "tests/test-chat-template.cpp)", MISTRAL_V1, "mistral-v1", None, "<s>", "</s>", plain),
        ("mistral-large-2407", "mistralai/Mistral-Large-Instruct-2407 tokenizer_config.json, "
         "'v3' (llama.cpp tests/test-chat-template.cpp)", MISTRAL_V3, "mistral-v3", None, "<s>",
         "</s>", with_tools),
        ("mistral-large-2411", "mistralai/Mistral-Large-Instruct-2411 tokenizer_config.json, "
         "'v7' (llama.cpp tests/test-chat-template.cpp)", MISTRAL_V7, "mistral-v7", None, "<s>",
         "</s>", plain),
        ("mistral-small-3.2", "mistralai/Mistral-Small-3.2-24B-Instruct-2506 "
         "tokenizer_config.json (llama.cpp models/templates)", MISTRAL_SMALL32,
         "mistral-v7-tekken", None, "<s>", "</s>", with_own_system(with_tools)),
        ("devstral-small-2507", "unsloth/Devstral-Small-2507-GGUF: tokenizer.chat_template "
         "(llama.cpp models/templates)", DEVSTRAL, "devstral", None, "<s>", "</s>",
         with_own_system(plain)),
    ]
    env = make_env()
    os.makedirs(args.out, exist_ok=True)
    for name, origin, source, kind, default_system, bos, eos, cases in templates:
        doc = {
            "name": name,
            "origin": origin,
            "generator": f"scripts/ref/make_chat_goldens.py, jinja2 {jinja2.__version__}",
            "kind": kind,
            "default_system": default_system,
            "bos_token": bos,
            "eos_token": eos,
            "template": source,
            "cases": render_cases(env, name, source, bos, eos, cases),
        }
        path = os.path.join(args.out, f"{name}.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(doc, f, ensure_ascii=False, indent=1)
            f.write("\n")
        n_err = sum("error" in c for c in doc["cases"])
        print(f"{path}: {len(doc['cases'])} cases ({n_err} errors)", file=sys.stderr)


if __name__ == "__main__":
    main()
