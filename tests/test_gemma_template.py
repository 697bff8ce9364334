"""Assistant masking under Gemma's chat template (`<start_of_turn>model\\n ... <end_of_turn>\\n`).

No Gemma tokenizer is on disk, so the test tokenizer is the shared Llama 3 one with Gemma's two turn markers
added as special tokens, as they are in Gemma's own tokenizer (`<start_of_turn>` = 105, `<end_of_turn>` = 106).
The template is Gemma 3's (google/gemma-3-4b-it's chat_template, tests/chat_templates.py): a system prompt is folded into the
first user turn, the assistant's role is written "model", content is trimmed, and every turn ends with
"<end_of_turn>\\n". Trained: exactly each answer and its `<end_of_turn>`; never the generation prompt
`<start_of_turn>model\\n`, the user turns, or the newline after `<end_of_turn>`.
"""
import chat_templates
import numpy as np
import pytest

from gapless.config import SourceConfig
from gapless.data.formats import Example, read_source
from gapless.data.tokenize import Encoder, load_tokenizer

GEMMA_TEMPLATE = chat_templates.GEMMA3  # google/gemma-3-4b-it's, as tests/chat_templates.py holds it


@pytest.fixture(scope="module")
def gemma_like(shared):
    tok = load_tokenizer(shared / "tokenizers/llama3")
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    return tok


def trained_runs(tok, ids, mask) -> list[str]:
    edges = np.flatnonzero(np.diff(np.asarray(mask, np.int8))) + 1
    return [tok.decode(p.tolist(), skip_special_tokens=False)
            for p, m in zip(np.split(np.asarray(ids), edges), np.split(np.asarray(mask), edges)) if m[0]]


def test_gemma_template_trains_exactly_each_answer_and_its_end_of_turn(shared, gemma_like):
    examples = list(read_source(SourceConfig(path=str(shared / "data/messages/fastchat_dummy_conversation.jsonl"))))
    examples = examples[:30]
    for ex in examples[::3]:  # a system prompt on some: Gemma folds it into the first user turn
        ex.messages = [{"role": "system", "content": "You are terse."}] + ex.messages
    enc = Encoder(gemma_like, GEMMA_TEMPLATE, max_seq_len=10**6, train_on="assistant", overlong="truncate")
    chunk = enc.encode_chunk(examples)
    assert not chunk.errors and len(chunk.ids) == len(examples)
    end = gemma_like.convert_tokens_to_ids("<end_of_turn>")
    multi_turn = 0
    for ex, ids, mask in zip(examples, chunk.ids, chunk.mask):
        want = [m["content"].strip() + "<end_of_turn>" for m in ex.messages if m["role"] == "assistant"]
        assert trained_runs(gemma_like, ids, mask) == want, ex.where
        # every <end_of_turn> of an answer is trained, the newline after any <end_of_turn> never is
        ends = np.flatnonzero(ids == end)
        assert [bool(mask[i]) for i in ends] == [m["role"] == "assistant" for m in ex.messages if m["role"] != "system"]
        assert ends[-1] + 1 < len(ids) and not mask[ends + 1].any()
        text = gemma_like.decode(ids.tolist(), skip_special_tokens=False)
        assert text.count("<start_of_turn>model\n") == len(want)
        multi_turn += len(want) > 1
    assert multi_turn > 5


def test_generation_prompt_is_not_trained(gemma_like):
    ex = Example(where="x.jsonl:1", messages=[{"role": "user", "content": "Hi"},
                                              {"role": "assistant", "content": " Hello there. "}])
    chunk = Encoder(gemma_like, GEMMA_TEMPLATE, max_seq_len=10**6, train_on="assistant",
                    overlong="truncate").encode_chunk([ex])
    ids, mask = chunk.ids[0], chunk.mask[0]
    tokens = gemma_like.convert_ids_to_tokens(ids.tolist())
    first = int(np.flatnonzero(mask)[0])
    # the prompt up to the answer: bos, <start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n
    assert gemma_like.decode(ids[:first].tolist()) == \
        "<|begin_of_text|><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert trained_runs(gemma_like, ids, mask) == ["Hello there.<end_of_turn>"]
    assert tokens[-1] == "Ċ" and mask[-1] == 0  # the template's final newline (byte-level "\n") is not trained
