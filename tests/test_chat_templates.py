"""Axolotl's `chat_template: NAME` converts to the Jinja gapless ships (gapless.data.chat_templates), which renders,
through transformers' apply_chat_template with the shared Llama 3 tokenizer, the exact text of Axolotl's template
of that name (axolotl/utils/chat_templates/templates/NAME.jinja); a name gapless does not ship is refused, listing
those it does."""
import numpy as np
import pytest

from gapless.convert import convert
from gapless.data.chat_templates import TEMPLATES
from gapless.data.formats import Example
from gapless.data.tokenize import Encoder, load_tokenizer

CONVERSATION = [{"role": "system", "content": "You answer briefly. "},
                {"role": "user", "content": " What is 2+2?\n"},
                {"role": "assistant", "content": "4"},
                {"role": "user", "content": "And 3+3?"},
                {"role": "assistant", "content": "6 \n"}]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers",
                                           "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]


@pytest.fixture(scope="module")
def llama3(shared):
    return load_tokenizer(shared / "tokenizers/llama3")


def axolotl(template: str, **extra) -> dict:
    return {"base_model": "/models/x", "learning_rate": 1e-4, "adapter": "lora", "chat_template": template,
            "datasets": [{"path": "train.jsonl", "type": "chat_template"}], **extra}


def render(tok, template: str, messages: list[dict], generation_prompt: bool = False, tools=None) -> str:
    return tok.apply_chat_template(messages, chat_template=template, tools=tools, tokenize=False,
                                   add_generation_prompt=generation_prompt)


def test_llama3_renders_as_axolotl(llama3):
    conv = convert(axolotl("llama3"))
    template = conv.config["data"]["chat_template"]
    assert "chat_template: llama3" in conv.format() and "Axolotl's llama3 template" in conv.format()
    # the BOS once, each turn's content trimmed, <|eot_id|> after every turn; no date header (that is Llama 3.1's)
    assert render(llama3, template, CONVERSATION) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou answer briefly.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n4<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nAnd 3+3?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n6<|eot_id|>")
    assert render(llama3, template, CONVERSATION[:2], generation_prompt=True) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou answer briefly.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    # gapless's masking locates the answers under it: each answer and its <|eot_id|> train, nothing else
    chunk = Encoder(llama3, template, max_seq_len=512, train_on="assistant", overlong="truncate").encode_chunk(
        [Example("x.jsonl:1", messages=CONVERSATION)])
    ids, mask = chunk.ids[0], chunk.mask[0]
    edges = np.flatnonzero(np.diff(mask.astype(np.int8))) + 1
    trained = [llama3.decode(p.tolist()) for p, m in zip(np.split(ids, edges), np.split(mask, edges)) if m[0]]
    assert not chunk.errors and trained == ["4<|eot_id|>", "6<|eot_id|>"]


def test_other_shipped_templates_render_as_axolotl(llama3):
    """The text of each, with the Llama 3 tokenizer's BOS <|begin_of_text|> and EOS <|eot_id|> where it writes them."""
    qwen = render(llama3, TEMPLATES["qwen_25"], CONVERSATION[1:3])
    assert qwen == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
                    "<|im_start|>user\n What is 2+2?\n<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n")
    calls = [{"role": "user", "content": "Add 1 and 2"},
             {"role": "assistant", "content": None,
              "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
             {"role": "tool", "content": "3"}, {"role": "assistant", "content": "3"}]
    assert render(llama3, TEMPLATES["qwen_25"], [CONVERSATION[0], *calls], tools=TOOLS) == (
        "<|im_start|>system\nYou answer briefly. \n\n# Tools\n\nYou may call one or more functions to assist with the "
        "user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": '
        '{"type": "object", "properties": {"a": {"type": "integer"}}}}}\n</tools>\n\nFor each function call, return '
        "a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nAdd 1 and 2<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n3<|im_end|>\n")
    assert render(llama3, TEMPLATES["gemma"], CONVERSATION[1:3], generation_prompt=False) == (
        "<|begin_of_text|><start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n4<end_of_turn>\n")
    assert render(llama3, TEMPLATES["gemma3"], CONVERSATION[:2], generation_prompt=True) == (
        "<|begin_of_text|><start_of_turn>user\nYou answer briefly. \n\nWhat is 2+2?<end_of_turn>\n"
        "<start_of_turn>model\n")
    assert render(llama3, TEMPLATES["mistral_v1"], CONVERSATION[1:3]) == (
        "<|begin_of_text|> [INST]  What is 2+2?\n [/INST] 4<|eot_id|>")
    for name in ("gemma", "mistral_v1"):  # no system turn, as Axolotl's: the template raises
        with pytest.raises(Exception, match="System role not supported|roles must alternate"):
            render(llama3, TEMPLATES[name], CONVERSATION)


def test_a_name_gapless_does_not_ship_is_refused_with_the_names_it_does():
    with pytest.raises(ValueError, match=r"chat_template: phi_3: 'phi_3' is a template name gapless does not ship; "
                                         r"it ships chatml, llama3, qwen_25, gemma, gemma3, mistral_v1"):
        convert(axolotl("phi_3"))
