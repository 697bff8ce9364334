"""Chat templates by name: the Jinja of the names Axolotl's `chat_template: NAME` takes, written to render the same
text as Axolotl's own templates (axolotl/utils/chat_templates/templates/NAME.jinja) for what gapless renders: turns
whose content is a string (gapless.data.formats joins OpenAI content parts into one string before any template
sees them), OpenAI-style `tool_calls` and `tools` (qwen_25). tests/test_chat_templates.py checks the text.

A config names one as data.chat_template (for a base model's tokenizer, which has no template of its own) or
through the Axolotl converter (gapless.convert), which writes the Jinja itself.

LLAMAFACTORY holds the Jinja of LLaMA-Factory's template names whose token ids gapless writes as LLaMA-Factory does
(its src/llamafactory/data/template.py and data/processor/supervised.py), and whose loss mask is its own but for
the separator gemma's writes after each end-of-turn token (gapless.convert.LLAMAFACTORY_SEPARATOR; qwen's, chatml's
and qwen3_nothink's newline after <|im_end|>, gapless.convert.LLAMAFACTORY_NEAR); the LLaMA-Factory converter writes
it. tests/test_llamafactory_templates.py checks ids and loss mask against
LLaMA-Factory's encoding.
"""
from __future__ import annotations

# ChatML: every turn `<|im_start|>ROLE\nCONTENT<|im_end|>\n`, untrimmed; no system prompt of its own
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# Llama 3 (Meta-Llama-3-Instruct's format, without Llama 3.1's "Cutting Knowledge Date" system header): the BOS
# before the first turn (none when there is no turn), each turn's content trimmed, every turn ends with <|eot_id|>
LLAMA3 = ("{% for m in messages %}{% if loop.first %}{{ bos_token }}{% endif %}"
          "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' }}"
          "{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

# Qwen 2.5 (Qwen2.5-Instruct's format): ChatML with a default system prompt when the conversation has none, the
# tools listed in the system turn, tool calls as <tool_call> JSON, consecutive tool results in one user turn
QWEN_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
QWEN_25 = (
    "{%- set first = messages[0] %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\n' }}"
    "{{- first['content'] if first['role'] == 'system' else '" + QWEN_DEFAULT_SYSTEM + "' }}"
    "{{- '\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' + tool | tojson }}{%- endfor %}"
    "{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n' }}"
    "{%- elif first['role'] == 'system' %}"
    "{{- '<|im_start|>system\n' + first['content'] + '<|im_end|>\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\n" + QWEN_DEFAULT_SYSTEM + "<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first) or (m.role == 'assistant' and not m.tool_calls) %}"
    "{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}"
    "{%- elif m.role == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if m.content %}{{- '\n' + m.content }}{%- endif %}"
    "{%- for call in m.tool_calls %}"
    "{%- set call = call.function if call.function is defined else call %}"
    "{{- '\n<tool_call>\n{\"name\": \"' + call.name + '\", \"arguments\": ' + call.arguments | tojson + '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' + m.content + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")

# Gemma (1 and 2): the BOS, no system turn, user and assistant alternating from a user turn, the assistant written
# `model`, content trimmed, every turn ends with `<end_of_turn>\n`
GEMMA = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for m in messages %}"
    "{% if (m['role'] == 'user') != loop.index0 is even %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' + m['content'] | trim"
    " + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")

# Gemma 3: Gemma's turns, with a leading system turn's text (untrimmed) and a blank line put at the start of the
# first user turn
GEMMA3 = (
    "{{ bos_token }}"
    "{% set system = messages[0]['role'] == 'system' %}"
    "{% set turns = messages[1:] if system else messages %}"
    "{% for m in turns %}"
    "{% if (m['role'] == 'user') != loop.index0 is even %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' }}"
    "{% if loop.first and system %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ m['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")

# Mistral v1 (Mistral-7B-Instruct-v0.1's format): the BOS, user turns ` [INST] ... [/INST]`, assistant turns
# ` ...` and the EOS; user and assistant alternate from a user turn; no system or tool turns
MISTRAL_V1 = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if (m['role'] == 'user') != loop.index0 is even %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if m['role'] == 'user' %}{{ ' [INST] ' + m['content'] + ' [/INST]' }}"
    "{% elif m['role'] == 'assistant' %}{{ ' ' + m['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}"
    "{% endfor %}")

# Axolotl's name -> the Jinja
TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3, "qwen_25": QWEN_25, "gemma": GEMMA, "gemma3": GEMMA3,
             "mistral_v1": MISTRAL_V1}

# LLaMA-Factory's llama3: Llama 3's turns as its register_template writes them, the BOS before the first turn, each
# content untrimmed (Meta's own template and LLAMA3 trim it), no system turn when the system message is empty
# (Template._encode writes one only `if system`). Its tools (in the system turn), tool calls and results (ipython
# turns, {"name", "parameters"} JSON) are its own text, which gapless does not write: a record with any is a template
# error, skipped and counted
LLAMAFACTORY_LLAMA3 = (
    "{% if tools %}{{ raise_exception('LLaMA-Factory writes the tools into the system turn as its own text, which "
    "gapless does not render') }}{% endif %}"
    "{% for m in messages %}{% if loop.first %}{{ bos_token }}{% endif %}"
    "{% if m['role'] == 'tool' or m['tool_calls'] %}"
    "{{ raise_exception('LLaMA-Factory writes tool calls and results as its own ipython turns, which gapless does "
    "not render') }}{% endif %}"
    "{% if m['role'] != 'system' or m['content'] %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] + '<|eot_id|>' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

# LLAMAFACTORY_LLAMA3 for train_on all or last_assistant (train_on_prompt, mask_history). LLaMA-Factory tokenizes each
# message on its own; gapless cuts the text only where a trained answer starts, so an untrained answer that starts
# with a newline merges it into the header's "\n\n" (Llama 3's BPE: "\n\n\n" one token, not "\n\n" and "\n").
# Such a record is a template error, skipped and counted; any other text tokenizes alike across that cut (the
# pre-tokenizer splits a header's "\n\n" from spaces or text after it)
LLAMAFACTORY_LLAMA3_UNCUT = LLAMAFACTORY_LLAMA3.replace(
    "{% if m['role'] != 'system' or m['content'] %}",
    "{% if m['role'] == 'assistant' and m['content'] and m['content'][:1] in '\r\n' %}"
    "{{ raise_exception('an answer that starts with a newline tokenizes unlike LLaMA-Factory when not every answer "
    "trains (mask_history, train_on_prompt)') }}{% endif %}"
    "{% if m['role'] != 'system' or m['content'] %}", 1)

# LLaMA-Factory's gemma and gemma3 (the same turns; gemma3 adds an image plugin): the BOS, each turn
# `<start_of_turn>ROLE\nCONTENT<end_of_turn>\n` with its content untrimmed (Gemma's own templates trim it), the
# assistant's role `model`, user and assistant alternating from a user turn (it skips other records), and a non-empty
# system message with a blank line at the start of the first user turn (its Llama2Template; an empty one writes
# nothing, where Gemma 3's own template writes the blank line). Its replace_eos (the eos becomes <end_of_turn>) changes
# no id: no slot writes the eos. Tools, tool calls and results are its own text: a template error, as for llama3.
# LLaMA-Factory also trains the newline after each <end_of_turn>, which gapless does not (gapless.convert says so)
LLAMAFACTORY_GEMMA = (
    "{% if tools %}{{ raise_exception('LLaMA-Factory writes the tools into the first user turn as its own text, "
    "which gapless does not render') }}{% endif %}"
    "{{ bos_token }}"
    "{% set system = messages[0]['content'] if messages[0]['role'] == 'system' else '' %}"
    "{% for m in (messages[1:] if messages[0]['role'] == 'system' else messages) %}"
    "{% if m['role'] == 'tool' or m['tool_calls'] %}"
    "{{ raise_exception('LLaMA-Factory writes tool calls and results as its own text, which gapless does not "
    "render') }}{% endif %}"
    "{% if (m['role'] == 'user') != loop.index0 is even or m['role'] not in ('user', 'assistant') %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else 'user') + '\n' }}"
    "{% if loop.first and system %}{{ system + '\n\n' }}{% endif %}"
    "{{ m['content'] + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")

# LLAMAFACTORY_GEMMA for train_on all or last_assistant: an untrained answer whose leading whitespace holds a newline
# merges it into the `model\n` before it (Qwen2's pre-tokenizer: "\n\n" and "\n \n" one piece each), which
# LLaMA-Factory tokenizes apart: a template error, skipped and counted
_NEWLINE_LEAD = (
    "{% set text = m['content'] or '' %}{% set lead = text[:(text | length) - (text.lstrip() | length)] %}"
    "{% if m['role'] == 'assistant' and ('\n' in lead or '\r' in lead) %}"
    "{{ raise_exception('an answer that starts with a newline tokenizes unlike LLaMA-Factory when not every answer "
    "trains (mask_history, train_on_prompt)') }}{% endif %}")
LLAMAFACTORY_GEMMA_UNCUT = LLAMAFACTORY_GEMMA.replace(
    "{{ m['content'] + '<end_of_turn>\n' }}", _NEWLINE_LEAD + "{{ m['content'] + '<end_of_turn>\n' }}", 1)

# LLaMA-Factory's qwen, chatml and qwen3_nothink: gapless's QWEN_25 (qwen) and CHATML write their ids
# (gapless.convert's LLAMAFACTORY_NEAR) for records without tools. Its qwen and qwen3_nothink write the tools as
# Qwen2.5 does but each wrapped as {"type": "function", "function": TOOL} (tool_utils.QwenToolUtils), and each tool
# result as its own user turn (Qwen2.5 joins consecutive ones); its chatml writes tools and calls in its default
# "Action: NAME\nAction Input: ARGS" text. A record with tools, tool calls or tool results is a template error,
# skipped and counted, as for llama3
_NO_TOOLS = (
    "{% if tools %}{{ raise_exception('LLaMA-Factory writes the tools into the system turn as its own text, which "
    "gapless does not render') }}{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'tool' or m['tool_calls'] %}"
    "{{ raise_exception('LLaMA-Factory writes tool calls and results as its own text, which gapless does not "
    "render') }}{% endif %}{% endfor %}")
LLAMAFACTORY_QWEN, LLAMAFACTORY_CHATML = _NO_TOOLS + QWEN_25, _NO_TOOLS + CHATML
# for train_on all or last_assistant, gemma's check too: an untrained answer whose leading whitespace holds a newline
# merges it into the `assistant\n` before it (Qwen2's pre-tokenizer: "\n\n" one piece), which LLaMA-Factory
# tokenizes apart (its answer slot on its own): a template error, skipped and counted. Leading spaces without a
# newline tokenize alike across that cut
QWEN_25_UNCUT = LLAMAFACTORY_QWEN.replace("{%- for m in messages %}", "{%- for m in messages %}" + _NEWLINE_LEAD, 1)
CHATML_UNCUT = LLAMAFACTORY_CHATML.replace("{% for m in messages %}{{ '<|im_start|>'",
                                           "{% for m in messages %}" + _NEWLINE_LEAD + "{{ '<|im_start|>'", 1)

# LLaMA-Factory's template name -> the Jinja gapless trains it with, when every answer trains and otherwise (the
# names it refuses, and why, are gapless.convert.LLAMAFACTORY_REFUSED)
LLAMAFACTORY = {"llama3": LLAMAFACTORY_LLAMA3, "gemma": LLAMAFACTORY_GEMMA, "gemma3": LLAMAFACTORY_GEMMA,
                "qwen": LLAMAFACTORY_QWEN, "chatml": LLAMAFACTORY_CHATML, "qwen3_nothink": LLAMAFACTORY_CHATML}
LLAMAFACTORY_UNCUT = {"llama3": LLAMAFACTORY_LLAMA3_UNCUT, "gemma": LLAMAFACTORY_GEMMA_UNCUT,
                      "gemma3": LLAMAFACTORY_GEMMA_UNCUT, "qwen": QWEN_25_UNCUT, "chatml": CHATML_UNCUT,
                      "qwen3_nothink": CHATML_UNCUT}
