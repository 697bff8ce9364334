"""LLaMA-Factory's `template:` names that the converter maps train the token ids and loss mask LLaMA-Factory trains,
and the ones it refuses differ as the refusal says. `llamafactory_encode` re-implements, from its source
(hiyouga/LLaMA-Factory src/llamafactory/data/template.py: register_template, Template._encode,
_convert_elements_to_ids; data/processor/supervised.py: _encode_data_example), how LLaMA-Factory encodes a
conversation: each message's slots filled in and tokenized on their own (`tokenizer.encode(text,
add_special_tokens=False)`, {"bos_token"} / {"eos_token"} as the ids), the system message (or the template's
default_system) written once before the first user turn (Llama2Template's, gemma's: at the start of its content),
every assistant message trained, nothing else (no cutoff
here: every conversation fits). gapless's side is its Encoder with the Jinja the converter writes.
"""
import json

import pytest

import chat_templates
from test_templates import tokenizer_folder
from gapless.data.chat_templates import LLAMAFACTORY, LLAMAFACTORY_UNCUT, TEMPLATES
from gapless.data.formats import Example, SourceConfig, read_source
from gapless.data.tokenize import Encoder, load_tokenizer

BOS, EOS = {"bos_token"}, {"eos_token"}
# register_template's slots (format_prefix, format_system, format_user, format_assistant) and default_system, as
# data/template.py writes them
SPECS = {
    "llama3": {"prefix": [BOS],
               "system": ["<|start_header_id|>system<|end_header_id|>\n\n{{content}}<|eot_id|>"],
               "user": ["<|start_header_id|>user<|end_header_id|>\n\n{{content}}<|eot_id|>"
                        "<|start_header_id|>assistant<|end_header_id|>\n\n"],
               "assistant": ["{{content}}<|eot_id|>"]},
    "qwen": {"system": ["<|im_start|>system\n{{content}}<|im_end|>\n"],
             "user": ["<|im_start|>user\n{{content}}<|im_end|>\n<|im_start|>assistant\n"],
             "assistant": ["{{content}}<|im_end|>\n"],
             "default_system": "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."},
    # gemma and gemma3 (Llama2Template: the system slot filled in at the start of the first user turn's content)
    "gemma": {"prefix": [BOS], "system": ["{{content}}\n\n"], "system_in_user": True,
              "user": ["<start_of_turn>user\n{{content}}<end_of_turn>\n<start_of_turn>model\n"],
              "assistant": ["{{content}}<end_of_turn>\n"]},
}
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "It is 6."}],
    # untrimmed content: LLaMA-Factory writes it as it is
    [{"role": "system", "content": "You answer briefly. "}, {"role": "user", "content": " What is 2+2?\n"},
     {"role": "assistant", "content": "\n4"}, {"role": "user", "content": "And 3+3?"},
     {"role": "assistant", "content": "6 \n"}],
    # an empty system message writes no system turn
    [{"role": "system", "content": ""}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
]


def llamafactory_encode(tok, spec: dict, messages: list[dict], last_only: bool = False) -> tuple[list, list]:
    """LLaMA-Factory's input_ids and loss mask (1 where labels is not IGNORE_INDEX) of a conversation (an optional
    system message, then user and assistant alternating); last_only: mask_history, the last answer alone trained."""
    system = messages[0]["content"] if messages[0]["role"] == "system" else ""
    turns = messages[1:] if messages[0]["role"] == "system" else messages
    system = system or spec.get("default_system", "")

    def encode(slots, content=""):
        ids = []
        for slot in slots:
            if isinstance(slot, set):
                ids += [tok.bos_token_id if "bos_token" in slot else tok.eos_token_id]
            elif slot.replace("{{content}}", content):
                ids += tok.encode(slot.replace("{{content}}", content), add_special_tokens=False)
        return ids

    ids, mask = [], []
    last = max(i for i, m in enumerate(turns) if m["role"] == "assistant")
    for i, m in enumerate(turns):
        piece = encode(spec.get("prefix", [])) if i == 0 else []
        fused = i == 0 and system and spec.get("system_in_user")  # Llama2Template's
        if i == 0 and system and not fused:
            piece += encode(spec["system"], system)
        if m["role"] == "user":
            piece += encode(spec["user"], (spec["system"][0].replace("{{content}}", system) if fused else "")
                            + m["content"])
            mask += [0] * len(piece)
        else:
            piece += encode(spec["assistant"], m["content"])
            mask += [int(not last_only or i == last)] * len(piece)
        ids += piece
    return ids, mask


def gapless_encode(tok, template: str, messages: list[dict], train_on: str = "assistant") -> tuple[list, list]:
    chunk = Encoder(tok, template, max_seq_len=10**6, train_on=train_on, overlong="truncate").encode_chunk(
        [Example("x.jsonl:1", messages=messages)])
    assert not chunk.errors, chunk.errors
    return chunk.ids[0].tolist(), chunk.mask[0].tolist()


def shared_conversations(shared, tools: bool = False) -> list[list[dict]]:
    """Multi-turn records of the shared messages/ files (user and assistant alternating after an optional system
    message, as LLaMA-Factory's sharegpt reader requires), every other one given a system message."""
    out = []
    for name in ("oasst_en100_threads", "fastchat_dummy_conversation", "gpteacher_roleplay", "gsm8k_train"):
        records = list(read_source(SourceConfig(path=str(shared / f"data/messages/{name}.jsonl"))))[:200]
        for ex in sorted(records, key=lambda e: -len(e.messages))[:6]:
            roles = [m["role"] for m in ex.messages if m["role"] != "system"]
            if roles == ["user", "assistant"] * (len(roles) // 2) and roles:
                out.append(ex.messages)
    for messages in out[::2]:
        if messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": "You are terse."})
    return out


@pytest.fixture(scope="module")
def llama3(shared):
    return load_tokenizer(shared / "tokenizers/llama3")


@pytest.fixture(scope="module")
def qwen2(shared):
    return load_tokenizer(shared / "tokenizers/qwen2")


def test_llama3_trains_llamafactorys_ids_and_mask(shared, llama3):
    """template: llama3, on the shared Llama 3 tokenizer: the same ids and trained tokens as LLaMA-Factory for every
    conversation, untrimmed content and empty system messages included. gapless's Axolotl llama3 (which trims each
    turn, as Meta's template does) is not it."""
    conversations = CONVERSATIONS + shared_conversations(shared)
    assert len(conversations) > 12 and sum(len(c) > 4 for c in conversations) > 4
    for messages in conversations:
        assert gapless_encode(llama3, LLAMAFACTORY["llama3"], messages) == \
            llamafactory_encode(llama3, SPECS["llama3"], messages), messages
    assert gapless_encode(llama3, TEMPLATES["llama3"], CONVERSATIONS[1])[0] != \
        llamafactory_encode(llama3, SPECS["llama3"], CONVERSATIONS[1])[0]


def test_llama3_under_mask_history_and_train_on_prompt(shared, llama3):
    """mask_history (train_on last_assistant) and train_on_prompt (all) train LLaMA-Factory's ids and mask; a record
    whose untrained answer starts with a newline (which gapless tokenizes together with the header before it) is a
    template error, and gapless's ids for it would indeed differ."""
    conversations = [c for c in CONVERSATIONS + shared_conversations(shared)
                     if not any(m["role"] == "assistant" and m["content"][:1] == "\n" for m in c)]
    assert len(conversations) > 12
    for messages in conversations:
        ids, mask = llamafactory_encode(llama3, SPECS["llama3"], messages, last_only=True)
        assert gapless_encode(llama3, LLAMAFACTORY_UNCUT["llama3"], messages, "last_assistant") == (ids, mask)
        assert gapless_encode(llama3, LLAMAFACTORY_UNCUT["llama3"], messages, "all") == (ids, [1] * len(ids))
    newline = CONVERSATIONS[1]  # its first answer is "\n4"
    assert gapless_encode(llama3, LLAMAFACTORY["llama3"], newline, "last_assistant")[0] != \
        llamafactory_encode(llama3, SPECS["llama3"], newline)[0]
    chunk = Encoder(llama3, LLAMAFACTORY_UNCUT["llama3"], max_seq_len=10**6, train_on="last_assistant",
                    overlong="truncate").encode_chunk([Example("x.jsonl:1", messages=newline)])
    assert [e.reason for e in chunk.errors] == ["template_error"] and "starts with a newline" in str(chunk.errors[0])


def test_llama3_tool_turns_are_counted_template_errors(shared, llama3):
    """LLaMA-Factory writes glaive's tools into the system turn, and its function_call and observation turns as
    ipython turns, as its own text: such a record is skipped as a template error, never trained as something
    else."""
    examples = list(read_source(SourceConfig(path=str(shared / "data/messages/glaive_toolcall_en_demo.jsonl"))))[:20]
    enc = Encoder(llama3, LLAMAFACTORY["llama3"], max_seq_len=10**6, train_on="assistant", overlong="truncate")
    chunk = enc.encode_chunk(examples)
    calls = {ex.where for ex in examples if any(m["role"] == "tool" or m.get("is_tool_call") for m in ex.messages)}
    tools = {ex.where for ex in examples if ex.tools}
    assert len(calls) > 5 and tools >= calls
    assert {e.where for e in chunk.errors} == tools | calls and len(chunk.ids) == len(examples) - len(tools | calls)
    assert all(e.reason == "template_error" and "LLaMA-Factory writes" in str(e) for e in chunk.errors)


@pytest.mark.parametrize("default_system", [True, False])
def test_qwen_ids_match_but_llamafactory_trains_the_newline_after_im_end(shared, qwen2, default_system):
    """What qwen, qwen3_nothink and chatml map to (convert.LLAMAFACTORY_NEAR): gapless's qwen_25 template (Qwen2.5's
    own, with the same default system prompt) and chatml (without one) render LLaMA-Factory's ids, on the shared Qwen2
    tokenizer, but LLaMA-Factory's labels also hold the newline after each <|im_end|>, which gapless never trains: one
    token a turn, which the mapping says."""
    spec = SPECS["qwen"] if default_system else {**SPECS["qwen"], "default_system": ""}
    template = TEMPLATES["qwen_25"] if default_system else TEMPLATES["chatml"]
    newline = qwen2.encode("\n", add_special_tokens=False)
    for messages in CONVERSATIONS[:2] + shared_conversations(shared)[:6]:
        ids, mask = llamafactory_encode(qwen2, spec, messages)
        got_ids, got_mask = gapless_encode(qwen2, template, messages)
        assert got_ids == ids, messages
        differ = [k for k, (a, b) in enumerate(zip(mask, got_mask)) if a != b]
        answers = sum(m["role"] == "assistant" for m in messages)
        assert len(differ) == answers and all(mask[k] == 1 and [ids[k]] == newline
                                              and qwen2.decode(ids[k - 1]) == "<|im_end|>" for k in differ)


def test_empty_tokenizes_where_turns_join_unlike_llamafactory(qwen2):
    """Why empty is refused: LLaMA-Factory tokenizes each turn on its own; gapless cuts only where an answer starts,
    so an answer and the user turn after it that join inside a word tokenize as one."""
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    spec = {"system": ["{{content}}"], "user": ["{{content}}"], "assistant": ["{{content}}"]}
    messages = [{"role": "user", "content": "Say foot"}, {"role": "assistant", "content": "foot"},
                {"role": "user", "content": "ball"}, {"role": "assistant", "content": "ok"}]
    ids = llamafactory_encode(qwen2, spec, messages)[0]
    assert gapless_encode(qwen2, template, messages)[0] != ids
    assert gapless_encode(qwen2, template, messages[:2]) == llamafactory_encode(qwen2, spec, messages[:2])


@pytest.fixture(scope="module")
def gemma(shared, tmp_path_factory):
    """The shared Qwen2 tokenizer with Gemma's <bos>, <eos>, <start_of_turn> and <end_of_turn> as special tokens."""
    return load_tokenizer(tokenizer_folder(shared, tmp_path_factory.mktemp("lf") / "gemma3", "gemma3"))


def newline_after(tok, end: str, ids: list, mask: list, got_mask: list, answers: int) -> bool:
    """Whether the masks differ exactly in the newline after `end`, once for each of `answers` answers, trained by
    LLaMA-Factory alone."""
    differ = [k for k, (a, b) in enumerate(zip(mask, got_mask)) if a != b]
    return len(differ) == answers and all(mask[k] == 1 and [ids[k]] == tok.encode("\n", add_special_tokens=False)
                                          and tok.decode(ids[k - 1]) == end for k in differ)


def test_gemma_ids_match_but_llamafactory_trains_the_newline_after_end_of_turn(shared, gemma):
    """gemma and gemma3 (convert.LLAMAFACTORY_SEPARATOR): LLAMAFACTORY["gemma"] writes LLaMA-Factory's ids for every
    conversation, untrimmed content and empty system messages included, on the Qwen2 tokenizer with Gemma's turn
    markers; its labels also hold the newline after each <end_of_turn>, one token an answer, which gapless does not
    train. Gemma 3's own template (gapless's gemma3 too) trims each turn and writes an empty system message's blank
    line, so its ids differ; Gemma's (gapless's gemma) refuses a system message."""
    conversations = CONVERSATIONS + shared_conversations(shared)
    for messages in conversations:
        ids, mask = llamafactory_encode(gemma, SPECS["gemma"], messages)
        got_ids, got_mask = gapless_encode(gemma, LLAMAFACTORY["gemma3"], messages)
        assert got_ids == ids, messages
        assert newline_after(gemma, "<end_of_turn>", ids, mask, got_mask,
                             sum(m["role"] == "assistant" for m in messages))
    assert LLAMAFACTORY["gemma"] == LLAMAFACTORY["gemma3"]
    for messages in CONVERSATIONS[1:3]:
        for template in (TEMPLATES["gemma3"], chat_templates.GEMMA3):
            assert gapless_encode(gemma, template, messages)[0] != llamafactory_encode(gemma, SPECS["gemma"],
                                                                                         messages)[0]
    chunk = Encoder(gemma, TEMPLATES["gemma"], max_seq_len=10**6, train_on="assistant",
                    overlong="truncate").encode_chunk([Example("x.jsonl:1", messages=CONVERSATIONS[1])])
    assert "System role not supported" in str(chunk.errors[0])


@pytest.mark.parametrize("lead", ["\n", " \n", "\t\n"])
def test_gemma_under_mask_history_and_train_on_prompt(shared, gemma, lead):
    """mask_history and train_on_prompt: LLAMAFACTORY_UNCUT["gemma"] writes LLaMA-Factory's ids (train_on_prompt: its
    mask too; mask_history: but for the last answer's newline). An untrained answer whose leading whitespace holds a
    newline would tokenize together with the `model\n` before it, unlike LLaMA-Factory: a template error."""
    conversations = [c for c in CONVERSATIONS + shared_conversations(shared)
                     if not any(m["role"] == "assistant" and "\n" in m["content"][:len(m["content"])
                                                                      - len(m["content"].lstrip())] for m in c)]
    assert len(conversations) > 12
    for messages in conversations:
        ids, mask = llamafactory_encode(gemma, SPECS["gemma"], messages, last_only=True)
        got_ids, got_mask = gapless_encode(gemma, LLAMAFACTORY_UNCUT["gemma"], messages, "last_assistant")
        assert got_ids == ids and newline_after(gemma, "<end_of_turn>", ids, mask, got_mask, 1)
        assert gapless_encode(gemma, LLAMAFACTORY_UNCUT["gemma"], messages, "all") == (ids, [1] * len(ids))
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": lead + "4"},
                {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6"}]
    assert gapless_encode(gemma, LLAMAFACTORY["gemma"], messages, "last_assistant")[0] != \
        llamafactory_encode(gemma, SPECS["gemma"], messages)[0]
    chunk = Encoder(gemma, LLAMAFACTORY_UNCUT["gemma"], max_seq_len=10**6, train_on="last_assistant",
                    overlong="truncate").encode_chunk([Example("x.jsonl:1", messages=messages)])
    assert [e.reason for e in chunk.errors] == ["template_error"] and "starts with a newline" in str(chunk.errors[0])
    spaces = [messages[0], {"role": "assistant", "content": " \t 4"}, *messages[2:]]  # tokenize alike: no error
    assert gapless_encode(gemma, LLAMAFACTORY_UNCUT["gemma"], spaces, "all")[0] == \
        llamafactory_encode(gemma, SPECS["gemma"], spaces)[0]


def test_gemma_tool_turns_and_stray_roles_are_counted_template_errors(shared, gemma):
    """LLaMA-Factory writes glaive's tools into the first user turn and its calls and results as its own text; it
    skips a conversation whose roles do not alternate from a user turn: template errors in gapless."""
    examples = list(read_source(SourceConfig(path=str(shared / "data/messages/glaive_toolcall_en_demo.jsonl"))))[:20]
    chunk = Encoder(gemma, LLAMAFACTORY["gemma"], max_seq_len=10**6, train_on="assistant",
                    overlong="truncate").encode_chunk(examples)
    tools = {ex.where for ex in examples if ex.tools or any(m["role"] == "tool" or m.get("is_tool_call")
                                                            for m in ex.messages)}
    assert len(tools) > 5 and {e.where for e in chunk.errors} == tools
    assert all(e.reason == "template_error" and "LLaMA-Factory writes" in str(e) for e in chunk.errors)
    stray = [{"role": "user", "content": "a"}, {"role": "system", "content": "b"},
             {"role": "assistant", "content": "c"}]
    chunk = Encoder(gemma, LLAMAFACTORY["gemma"], max_seq_len=10**6, train_on="assistant",
                    overlong="truncate").encode_chunk([Example("x.jsonl:1", messages=stray)])
    assert "roles must alternate" in str(chunk.errors[0])


@pytest.mark.parametrize("template", ["qwen", "chatml", "qwen3_nothink"])
@pytest.mark.parametrize("lead", ["\n", " \n", "\t\n"])
def test_qwen_under_mask_history_and_train_on_prompt(shared, qwen2, template, lead):
    """mask_history and train_on_prompt under qwen, chatml and qwen3_nothink: LLAMAFACTORY_UNCUT[template] (gapless's
    qwen_25 or chatml, refusing one kind of record) writes LLaMA-Factory's ids (train_on_prompt: its mask too;
    mask_history: but for the last answer's newline after <|im_end|>). An untrained answer whose leading whitespace
    holds a newline would tokenize together with the `assistant\\n` before it (Qwen2's pre-tokenizer: "\\n\\n" one
    piece), unlike LLaMA-Factory, which tokenizes the answer on its own: a template error. (Empty system messages
    left out, as in the test above: gapless's templates write an empty system turn, LLaMA-Factory none or its
    default.)"""
    spec = SPECS["qwen"] if template == "qwen" else {**SPECS["qwen"], "default_system": ""}
    near = TEMPLATES["qwen_25" if template == "qwen" else "chatml"]
    conversations = [c for c in CONVERSATIONS + shared_conversations(shared) if c[0]["content"]
                     and not any(m["role"] == "assistant" and "\n" in m["content"][:len(m["content"])
                                                                      - len(m["content"].lstrip())] for m in c)]
    assert len(conversations) > 12
    for messages in conversations:
        ids, mask = llamafactory_encode(qwen2, spec, messages, last_only=True)
        got_ids, got_mask = gapless_encode(qwen2, LLAMAFACTORY_UNCUT[template], messages, "last_assistant")
        assert got_ids == ids and newline_after(qwen2, "<|im_end|>", ids, mask, got_mask, 1), messages
        assert gapless_encode(qwen2, LLAMAFACTORY_UNCUT[template], messages, "all") == (ids, [1] * len(ids))
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": lead + "4"},
                {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6"}]
    for train_on in ("last_assistant", "all"):
        assert gapless_encode(qwen2, near, messages, train_on)[0] != llamafactory_encode(qwen2, spec, messages)[0]
    chunk = Encoder(qwen2, LLAMAFACTORY_UNCUT[template], max_seq_len=10**6, train_on="last_assistant",
                    overlong="truncate").encode_chunk([Example("x.jsonl:1", messages=messages)])
    assert [e.reason for e in chunk.errors] == ["template_error"] and "starts with a newline" in str(chunk.errors[0])
    spaces = [messages[0], {"role": "assistant", "content": " \t 4"}, *messages[2:]]  # tokenize alike: no error
    assert gapless_encode(qwen2, LLAMAFACTORY_UNCUT[template], spaces, "all")[0] == \
        llamafactory_encode(qwen2, spec, spaces)[0]


def qwen_tool_text(messages: list[dict], tools: list[dict], default_system: str) -> str:
    """LLaMA-Factory's qwen text (qwen3_nothink's: no default system) of a conversation with tools, tool calls (its
    function turns: the is_tool_call turns' {"name", "arguments"} JSON) and results (observation turns), from its
    register_template("qwen") slots and tool_utils.QwenToolUtils: the tools in the system turn, each wrapped as
    {"type": "function", "function": TOOL}; a call `<tool_call>\\n{JSON}\\n</tool_call><|im_end|>\\n`; a result
    its own `<|im_start|>user\\n<tool_response>\\n...\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n`."""
    tool_text = "".join("\n" + json.dumps(t if t.get("type") == "function" else {"type": "function", "function": t},
                                           ensure_ascii=False) for t in tools)
    system = (messages[0]["content"] if messages[0]["role"] == "system" else "") or default_system
    text = ("<|im_start|>system\n" + system + "\n\n# Tools\n\nYou may call one or more functions to assist with the "
            "user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>"
            + tool_text + "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
            'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
            "<args-json-object>}\n</tool_call><|im_end|>\n")
    for m in messages[1:] if messages[0]["role"] == "system" else messages:
        if m["role"] == "user":
            text += "<|im_start|>user\n" + m["content"] + "<|im_end|>\n<|im_start|>assistant\n"
        elif m["role"] == "tool":
            text += ("<|im_start|>user\n<tool_response>\n" + m["content"]
                     + "\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
        elif m.get("is_tool_call"):
            calls = json.loads(m["content"])
            text += "\n".join("<tool_call>\n" + json.dumps({"name": c["name"], "arguments": c["arguments"]},
                                                           ensure_ascii=False) + "\n</tool_call>"
                              for c in (calls if isinstance(calls, list) else [calls])) + "<|im_end|>\n"
        else:
            text += m["content"] + "<|im_end|>\n"
    return text


@pytest.mark.parametrize("template", ["qwen", "chatml", "qwen3_nothink"])
def test_qwen_tool_records_are_counted_template_errors(shared, qwen2, template):
    """Records with tools under qwen and qwen3_nothink: LLaMA-Factory's text (qwen_tool_text, tokenized here whole)
    differs from gapless's qwen_25 text, token for token, in the tools alone: LLaMA-Factory wraps each as
    {"type": "function", "function": TOOL}, Qwen2.5's template writes it as the record gives it (with the tools given
    wrapped, the ids agree). chatml writes tools and calls in LLaMA-Factory's default "Action:" text. So
    LLAMAFACTORY[template] skips each record with tools, tool calls or results as a template error, and trains the
    others as gapless's template does."""
    examples = list(read_source(SourceConfig(path=str(shared / "data/messages/glaive_toolcall_en_demo.jsonl"))))[:20]
    tools = {ex.where for ex in examples if ex.tools or any(m["role"] == "tool" or m.get("is_tool_call")
                                                            for m in ex.messages)}
    assert len(tools) > 5 and all(any(m.get("is_tool_call") for m in ex.messages) and any(
        m["role"] == "tool" for m in ex.messages) for ex in examples if ex.where in tools)
    if template == "qwen":
        for ex in (ex for ex in examples if ex.where in tools):
            ids = qwen2.encode(qwen_tool_text(ex.messages, ex.tools, SPECS["qwen"]["default_system"]),
                               add_special_tokens=False)
            assert gapless_encode_tools(qwen2, TEMPLATES["qwen_25"], ex.messages, ex.tools)[0] != ids
            wrapped = [{"type": "function", "function": t} for t in ex.tools]
            assert gapless_encode_tools(qwen2, TEMPLATES["qwen_25"], ex.messages, wrapped)[0] == ids
    chunk = Encoder(qwen2, LLAMAFACTORY[template], max_seq_len=10**6, train_on="assistant",
                    overlong="truncate").encode_chunk(examples)
    assert {e.where for e in chunk.errors} == tools and len(chunk.ids) == len(examples) - len(tools)
    assert all(e.reason == "template_error" and "LLaMA-Factory writes" in str(e) for e in chunk.errors)
    near = Encoder(qwen2, TEMPLATES["qwen_25" if template == "qwen" else "chatml"], max_seq_len=10**6,
                   train_on="assistant", overlong="truncate").encode_chunk([ex for ex in examples
                                                                           if ex.where not in tools])
    assert [i.tolist() for i in chunk.ids] == [i.tolist() for i in near.ids]
    assert [m.tolist() for m in chunk.mask] == [m.tolist() for m in near.mask]


def gapless_encode_tools(tok, template: str, messages: list[dict], tools: list[dict]) -> tuple[list, list]:
    chunk = Encoder(tok, template, max_seq_len=10**6, train_on="assistant", overlong="truncate").encode_chunk(
        [Example("x.jsonl:1", messages=messages, tools=tools)])
    assert not chunk.errors, chunk.errors
    return chunk.ids[0].tolist(), chunk.mask[0].tolist()
