"""The embedded demo task: a procedural string task with its own character tokenizer.

Task: "shift" a word of lowercase letters by one place in the alphabet (a->b, ..., z->a). The
answer's i-th character depends on the prompt's i-th character at a fixed distance back, which a
2-layer decoder with RoPE can learn in a few hundred LoRA steps; a random model scores 0%.
Words are 4-6 letters long: 26^4 + 26^5 + 26^6 ~ 321M possible words, so held-out examples are
new to the model.
"""
from __future__ import annotations

import json
import random
import string
from pathlib import Path

SPECIALS = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>"]
CHARS = string.ascii_lowercase + string.digits + " :"
# Llama-3-like turn structure: every assistant turn ends with the end-of-turn token </s>, which is trained.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}"
    "{% else %}<|assistant|>{{ m['content'] }}</s>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def shift(word: str) -> str:
    return "".join(chr((ord(c) - 97 + 1) % 26 + 97) for c in word)


def make_examples(n: int, seed: int, min_len: int = 4, max_len: int = 6) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(min_len, max_len)))
        out.append({"id": f"shift-{seed}-{i}", "messages": [
            {"role": "user", "content": f"shift: {word}"},
            {"role": "assistant", "content": shift(word)},
        ]})
    return out


def write_jsonl(records: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return path


def write_tokenizer(out_dir: Path) -> Path:
    """A character-level tokenizer saved as an HF tokenizer folder (tokenizer.json + chat template)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + list(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return out_dir


def vocab_size() -> int:
    return len(SPECIALS) + len(CHARS)
