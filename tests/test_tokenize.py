"""Tokenization: exact loss masks for real templates (Llama 3, Qwen2 ChatML, a tool-calling ChatML),
over-long handling, bad-input policy, the cache, worker processes and the eval split."""
import json
import os
import string
import unicodedata

import numpy as np
import pytest

from gapless.config import DataConfig, SourceConfig, from_dict
from gapless.data import tokenize
from gapless.data.formats import Example, read_source
from gapless.data.pipeline import build_data
from gapless.data.tokenize import Encoder, load_tokenizer, tokenizer_template

# Qwen2.5's tool-calling ChatML template (the Qwen2 folder's own template has no tool support).
QWEN_TOOL_TEMPLATE = r"""{%- if tools %}{{- '<|im_start|>system\n' }}{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}{{- "\n\n# Tools\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}{%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}{{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags.<|im_end|>\n" }}{%- else %}{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}{%- else %}{{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{%- endif %}{%- endif %}
{%- for message in messages %}{%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}{%- elif message.role == "assistant" %}{{- '<|im_start|>' + message.role }}{%- if message.content %}{{- '\n' + message.content }}{%- endif %}{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}{{- '\n<tool_call>\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\n' }}{%- elif message.role == "tool" %}{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}{{- '\n<tool_response>\n' }}{{- message.content }}{{- '\n</tool_response>' }}{%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\n' }}{%- endif %}{%- endif %}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"""

# a char-level tokenizer folder like the product's CPU demo writes (PreTrainedTokenizerFast.save_pretrained)
DEMO_SPECIALS = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
DEMO_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
                 "{% if m['role'] == 'assistant' %}</s>{% endif %}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def demo_tokenizer(tmp_path_factory):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = string.ascii_letters + string.digits + string.punctuation + " \n"
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(DEMO_SPECIALS + list(chars))}, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(DEMO_SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = DEMO_TEMPLATE
    folder = tmp_path_factory.mktemp("demo_tokenizer")
    fast.save_pretrained(str(folder))
    return folder


def trained_runs(tok, ids, mask) -> list[str]:
    """The decoded maximal runs of trained tokens."""
    edges = np.flatnonzero(np.diff(np.asarray(mask, np.int8))) + 1
    return [tok.decode(p.tolist(), skip_special_tokens=False)
            for p, m in zip(np.split(np.asarray(ids), edges), np.split(np.asarray(mask), edges)) if m[0]]


def sample(shared, per_file: int = 40) -> list:
    """The first records of every messages/ file, the first few given a system prompt."""
    out = []
    for path in sorted((shared / "data/messages").glob("*.jsonl")):
        out += list(read_source(SourceConfig(path=str(path))))[:per_file]
    for ex in out[::7]:
        ex.messages = [{"role": "system", "content": "You are terse."}] + ex.messages
    return out


TEMPLATES = {  # tokenizer -> how its template writes an assistant turn's content and end-of-turn
    "llama3": lambda content: content.strip() + "<|eot_id|>",  # the template trims
    "qwen2": lambda content: unicodedata.normalize("NFC", content) + "<|im_end|>",  # its normalizer is NFC
}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_trained_tokens_are_exactly_the_assistant_turns(shared, name):
    tok = load_tokenizer(shared / "tokenizers" / name)
    enc = Encoder(tok, tokenizer_template(tok), max_seq_len=10**6, train_on="assistant", overlong="truncate")
    examples = sample(shared)
    chunk = enc.encode_chunk(examples)
    assert not chunk.errors and len(chunk.ids) == len(examples)
    multi_turn = 0
    for ex, ids, mask in zip(examples, chunk.ids, chunk.mask):
        want = [TEMPLATES[name](m["content"]) for m in ex.messages if m["role"] == "assistant"]
        got = [unicodedata.normalize("NFC", r) for r in trained_runs(tok, ids, mask)]
        assert got == want, ex.where
        multi_turn += len(want) > 1
    assert multi_turn > 50  # fastchat, oasst and glaive conversations


def test_tool_calls_with_a_tool_template_from_the_config(shared, tmp_path):
    (tmp_path / "tools.jinja").write_text(QWEN_TOOL_TEMPLATE)
    path = shared / "data/messages/glaive_toolcall_en_demo.jsonl"
    cfg = from_dict(DataConfig, {"sources": [{"path": str(path)}], "tokenizer": str(shared / "tokenizers/qwen2"),
                                 "chat_template": str(tmp_path / "tools.jinja"), "cache_dir": str(tmp_path / "c"),
                                 "max_seq_len": 32768, "tokens_per_batch": 32768,
                                 "num_workers": 0}, "data")
    mix, _, summary = build_data(cfg)
    tok = load_tokenizer(shared / "tokenizers/qwen2")
    examples = list(read_source(SourceConfig(path=str(path))))
    assert len(mix) == len(examples) == 300 and summary.warnings == []
    calls = 0
    for i, ex in enumerate(examples):
        want = []
        for m in ex.messages:
            if m.get("is_tool_call"):
                call = json.loads(m["content"])
                want.append(f'<tool_call>\n{{"name": "{call["name"]}", "arguments": '
                            f'{json.dumps(call["arguments"], ensure_ascii=False)}}}\n</tool_call><|im_end|>')
                calls += 1
            elif m["role"] == "assistant":
                want.append(m["content"] + "<|im_end|>")
        ids, mask = mix.doc(i)
        assert trained_runs(tok, ids, mask) == want, ex.where
        text = tok.decode(np.asarray(ids).tolist())
        for tool in ex.tools or []:  # the definitions are in the (untrained) system prompt
            assert json.dumps(tool, ensure_ascii=False) in text
    assert calls == 211


def test_without_a_tool_template_tools_are_counted_and_warned(shared, tmp_path):
    path = shared / "data/messages/glaive_toolcall_en_demo.jsonl"
    cfg = from_dict(DataConfig, {"sources": [{"path": str(path)}], "tokenizer": str(shared / "tokenizers/llama3"),
                                 "cache_dir": str(tmp_path), "num_workers": 0}, "data")
    with pytest.warns(UserWarning, match="191 records have tool definitions that the chat template does not render"):
        _, _, summary = build_data(cfg)
    assert summary.sources[0].tools_not_rendered == 191


def test_openai_tool_calls_without_a_tool_call_template_are_trained_as_json(shared, tmp_path):
    """Llama 3's template here never mentions tool_calls: rendered as they are, the calls vanish and the turn
    trains an empty answer; they are trained as JSON lines instead, counted and warned about."""
    call = {"type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    records = [{"messages": [{"role": "user", "content": "1+2?"},
                             {"role": "assistant", "content": None, "tool_calls": [call, call]},
                             {"role": "tool", "content": "3"}, {"role": "assistant", "content": "It is 3."}]},
               {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Let me add.",
                                                                 "tool_calls": [call]}]}]
    write_jsonl(tmp_path / "calls.jsonl", records)
    cfg = from_dict(DataConfig, {"sources": [{"path": str(tmp_path / "calls.jsonl")}], "num_workers": 0,
                                 "tokenizer": str(shared / "tokenizers/llama3"), "cache_dir": str(tmp_path / "c")},
                    "data")
    with pytest.warns(UserWarning, match="2 records have tool_calls that the chat template does not render"):
        mix, _, summary = build_data(cfg)
    assert summary.sources[0].tool_calls_as_text == 2
    tok = load_tokenizer(shared / "tokenizers/llama3")
    line = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
    runs = sorted(trained_runs(tok, *mix.doc(i)) for i in range(2))
    assert runs == [[f"Let me add.\n{line}<|eot_id|>"], [f"{line}\n{line}<|eot_id|>", "It is 3.<|eot_id|>"]]


@pytest.mark.parametrize("train_on", ["all", "last_assistant"])
def test_train_on_all_and_last_assistant(shared, train_on):
    # ChatML ends every turn with "<|im_end|>\n": under `all` the newline is trained too
    tok = load_tokenizer(shared / "tokenizers" / ("qwen2" if train_on == "all" else "llama3"))
    enc = Encoder(tok, tokenizer_template(tok), max_seq_len=10**6, train_on=train_on, overlong="truncate")
    examples = list(read_source(SourceConfig(path=str(shared / "data/messages/fastchat_dummy_conversation.jsonl"))))
    examples = [e for e in examples if len(e.messages) > 2][:20]
    chunk = enc.encode_chunk(examples)
    for ex, ids, mask in zip(examples, chunk.ids, chunk.mask):
        if train_on == "all":
            assert mask.all()
        else:
            assert trained_runs(tok, ids, mask) == [ex.messages[-1]["content"].strip() + "<|eot_id|>"]


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def chat(user: str, assistant: str) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]}


def config(tmp_path, tokenizer, sources, **options) -> DataConfig:
    data = {"sources": sources, "tokenizer": str(tokenizer), "cache_dir": str(tmp_path / "cache"),
            "num_workers": 0, **options}
    data.setdefault("tokens_per_batch", data.get("max_seq_len", 4096))
    return from_dict(DataConfig, data, "data")


def test_demo_tokenizer_folder_and_overlong_rules(demo_tokenizer, tmp_path):
    tok = load_tokenizer(demo_tokenizer)
    chats = write_jsonl(tmp_path / "chat.jsonl", [chat("hi", "yo"), chat("x" * 10, "y" * 30), chat("z" * 60, "w")])
    text = write_jsonl(tmp_path / "text.jsonl", [{"text": "a" * 70}, {"text": "short"}])
    sources = [{"path": str(chats)}, {"path": str(text)}]
    mix, _, s = build_data(config(tmp_path, demo_tokenizer, sources, max_seq_len=32))
    # truncate: record 2 keeps 32 tokens with some answer left; record 3's answer is cut off entirely
    assert [r.truncated for r in s.sources] == [1, 1] and s.sources[0].dropped == {"truncated_away": 1}
    ids, mask = mix.doc(0)
    assert tok.decode(np.asarray(ids).tolist()) == "<s><|user|>hi<|assistant|>yo</s>"  # trim_blocks eats the newline
    assert trained_runs(tok, ids, mask) == ["yo</s>"]
    assert mix.datasets[0].pad_id == tok.pad_token_id
    # plain text: bos + text + eos, every token trained
    ids, mask = mix.doc(3)
    assert tok.decode(np.asarray(ids).tolist()) == "<s>short</s>" and mask.all()

    mix, _, s = build_data(config(tmp_path, demo_tokenizer, sources, max_seq_len=32, overlong="drop"))
    assert s.sources[0].dropped == {"overlong": 2} and s.sources[1].dropped == {"overlong": 1} and len(mix) == 2

    with pytest.warns(UserWarning, match="overlong=split applies to plain text"):
        mix, _, s = build_data(config(tmp_path, demo_tokenizer, sources, max_seq_len=32, overlong="split"))
    assert s.sources[1].split == 1 and list(mix.datasets[1].lengths) == [32, 32, 8, 7]  # 72 tokens in 3 pieces
    pieces = [tok.decode(np.asarray(mix.datasets[1][i][0]).tolist()) for i in range(3)]
    assert "".join(pieces) == "<s>" + "a" * 70 + "</s>"


def test_bad_input_raises_with_file_line_or_is_counted(demo_tokenizer, tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", [
        chat("hi", "yo"),
        '{"messages": [{"role": "user", "content": "broken"}',  # line 2: malformed JSON
        {"messages": [{"role": "user", "content": "no answer"}]},  # 3: nothing to train
        {"messages": [{"role": "narrator", "content": "x"}]},  # 4: unknown role
        {"messages": []},  # 5: empty conversation
        {"messages": [{"role": "user"}, {"role": "assistant", "content": "a"}]},  # 6: missing content
        chat("ok", "fine"),
    ])
    with pytest.raises(ValueError, match=rf"^{bad}:2: not valid JSON .*on_error: skip"):
        build_data(config(tmp_path, demo_tokenizer, [{"path": str(bad)}]))
    no_answer = write_jsonl(tmp_path / "no_answer.jsonl",
                            [chat("a", "b"), {"messages": [{"role": "user", "content": "q"}]}])
    with pytest.raises(ValueError, match=rf"^{no_answer}:2: messages: no assistant turn to train on"):
        build_data(config(tmp_path, demo_tokenizer, [{"path": str(no_answer)}]))

    mix, _, s = build_data(config(tmp_path, demo_tokenizer, [{"path": str(bad)}], on_error="skip"))
    assert (s.records, s.kept, len(mix)) == (7, 2, 2)
    assert s.dropped == {"malformed_json": 1, "nothing_to_train": 1, "unknown_role": 1, "empty_conversation": 1,
                         "missing_field": 1}
    assert s.sources[0].first_errors[0].startswith(f"{bad}:2: not valid JSON")
    assert s.sources[0].first_errors[4] == f"{bad}:6: messages[0].content: missing; the turn has ['role']"
    assert "first skipped records:" in s.format() and "unknown_role 1" in s.format()


def test_a_template_without_history_independence_is_refused(demo_tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": [{"role": "user", "content": "a"},
                                                            {"role": "assistant", "content": "b"},
                                                            {"role": "user", "content": "c"},
                                                            {"role": "assistant", "content": "d"}]},
                                              chat("e", "f")])
    # renders only the last assistant turn's content, so the first turn's text is not a prefix of the whole
    template = ("{% for m in messages %}<|{{ m['role'] }}|>{% if m['role'] != 'assistant' or loop.last %}"
                "{{ m['content'] }}{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    with pytest.raises(ValueError, match=r"d.jsonl:1: messages: the chat template renders messages\[:2\] as text "
                                         r"that does not start the whole conversation's rendering, so assistant turn "
                                         r"messages\[1\] cannot be located .* set train_on: last_assistant"):
        build_data(config(tmp_path, demo_tokenizer, [{"path": str(path)}], chat_template=template))
    # a skip under on_error: skip; the last answer alone is located
    _, _, summary = build_data(config(tmp_path, demo_tokenizer, [{"path": str(path)}], chat_template=template,
                                      on_error="skip"))
    assert summary.dropped == {"template_not_prefix": 1} and summary.kept == 1
    mix, _, summary = build_data(config(tmp_path, demo_tokenizer, [{"path": str(path)}], chat_template=template,
                                        train_on="last_assistant"))
    assert summary.dropped == {} and trained_runs(load_tokenizer(demo_tokenizer), *mix.doc(0)) == ["d"]


def test_a_tokenizer_without_a_chat_template_needs_one_in_the_config(demo_tokenizer, tmp_path):
    folder = tmp_path / "plain"
    tok = load_tokenizer(demo_tokenizer)
    tok.chat_template = None
    tok.save_pretrained(str(folder))
    if (folder / "chat_template.jinja").exists():
        os.remove(folder / "chat_template.jinja")
    path = write_jsonl(tmp_path / "d.jsonl", [chat("a", "b")])
    with pytest.raises(ValueError, match=r"d.jsonl:1: the tokenizer has no chat template \(a base model's\); set "
                                         r"data.chat_template to the one the model is to learn: one of \['chatml',"):
        build_data(config(tmp_path, folder, [{"path": str(path)}]))
    mix, _, _ = build_data(config(tmp_path, folder, [{"path": str(path)}], chat_template=DEMO_TEMPLATE))
    assert trained_runs(tok, *mix.doc(0)) == ["b</s>"]
    # a template by name; ChatML's <|im_end|> is plain text to this tokenizer, so no special token ends the turn and
    # the newline after it is trained too
    mix, _, _ = build_data(config(tmp_path, folder, [{"path": str(path)}], chat_template="chatml"))
    assert trained_runs(tok, *mix.doc(0)) == ["b<|im_end|>\n"]
    with pytest.raises(ValueError, match=r"data.chat_template: 'chatml2' is neither a file, a Jinja template nor one "
                                         r"of the names \['chatml',"):
        build_data(config(tmp_path, folder, [{"path": str(path)}], chat_template="chatml2"))


def test_the_cache_second_run_does_not_tokenize_and_a_change_invalidates(demo_tokenizer, tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "d.jsonl", [chat("hi", "yo"), chat("a", "b")])
    cfg = config(tmp_path, demo_tokenizer, [{"path": str(path)}])
    mix, _, s = build_data(cfg)
    assert [r.cache for r in s.sources] == ["miss"]
    first = [np.asarray(mix.doc(i)[0]).copy() for i in range(len(mix))]

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("tokenized although the cache holds this data")

    with monkeypatch.context() as m:
        m.setattr(tokenize.Encoder, "encode_chunk", no_tokenizing)
        m.setattr(tokenize, "load_tokenizer", no_tokenizing)
        mix, _, s = build_data(cfg)
        assert [r.cache for r in s.sources] == ["hit"] and s.tokenize_seconds == 0
        assert isinstance(mix.datasets[0].ids, np.memmap)
        assert all(np.array_equal(a, mix.doc(i)[0]) for i, a in enumerate(first))
        os.utime(path, (1, 1))  # touched, same content: the key is the content's hash
        assert build_data(cfg)[2].sources[0].cache == "hit"
    write_jsonl(path, [chat("hi", "yo"), chat("a", "c")])  # changed content
    assert build_data(cfg)[2].sources[0].cache == "miss"
    assert build_data(cfg)[2].sources[0].cache == "hit"
    for change in [{"max_seq_len": 64}, {"train_on": "all"}, {"chat_template": DEMO_TEMPLATE + "{# changed #}"},
                   {"on_error": "skip"}]:
        summary = build_data(config(tmp_path, demo_tokenizer, [{"path": str(path)}], **change))[2]
        assert summary.sources[0].cache == "miss", change
    assert build_data(config(tmp_path, demo_tokenizer, [{"path": str(path), "columns": {"messages": "messages"}}])
                      )[2].sources[0].cache == "miss"
    # only finished folders are ever found: nothing half-written is left behind
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".") and p.is_dir()]


def test_worker_processes_give_the_same_arrays(shared, tmp_path, monkeypatch):
    monkeypatch.setattr(tokenize, "CHUNK", 64)  # 500 records -> 8 chunks over 2 workers
    path = str(shared / "data/messages/fastchat_dummy_conversation.jsonl")
    tokenizer = shared / "tokenizers/llama3"
    one, _, _ = build_data(config(tmp_path / "a", tokenizer, [{"path": path}], num_workers=0))
    two, _, _ = build_data(config(tmp_path / "b", tokenizer, [{"path": path}], num_workers=2))
    a, b = one.datasets[0], two.datasets[0]
    assert len(a) == len(b) == 500
    assert np.array_equal(a.ids, b.ids) and np.array_equal(a.mask, b.mask) and np.array_equal(a.offsets, b.offsets)
    assert np.array_equal(a.records, b.records) and np.array_equal(a.groups, b.groups)


@pytest.mark.skipif(not hasattr(os, "nice"), reason="no nice on this OS")
def test_workers_run_at_a_lower_cpu_priority(demo_tokenizer):
    """The tokenizer's worker processes run WORKER_NICE below this process's priority (capped at 19), so the
    model's load and compile beside them get the CPUs first."""
    working = tokenize.Tokenizing(demo_tokenizer, DEMO_TEMPLATE, {"max_seq_len": 64, "train_on": "assistant",
                                                                  "overlong": "truncate"}, num_workers=2)
    try:
        record = Example("t:1", messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
        chunks = [[record]] * 2
        list(working.map(iter(chunks)))
        assert working.pool.submit(os.nice, 0).result() == min(os.nice(0) + tokenize.WORKER_NICE, 19)
    finally:
        working.close()


def test_eval_split_by_record_and_eval_sources(demo_tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [chat(f"q{i}", f"a{i}") for i in range(100)])
    other = write_jsonl(tmp_path / "e.jsonl", [chat("eq", "ea")] * 3)
    train, evalm, s = build_data(config(tmp_path, demo_tokenizer, [{"path": str(path)}], eval_fraction=0.2))
    tr, ev = train.datasets[0], evalm.datasets[0]
    assert (len(tr), len(ev), s.eval_docs) == (80, 20, 20)
    assert not set(tr.records[tr.docs]) & set(ev.records[ev.docs])
    again = build_data(config(tmp_path, demo_tokenizer, [{"path": str(path)}], eval_fraction=0.2))[1]
    assert np.array_equal(again.datasets[0].docs, ev.docs)  # seeded
    train, evalm, s = build_data(config(tmp_path, demo_tokenizer, [{"path": str(path)}],
                                        eval_sources=[{"path": str(other)}]))
    assert (len(train), len(evalm), s.eval_docs) == (100, 3, 3)


def held_out_by_record(ds, fraction: float, seed: int) -> np.ndarray:
    """The documents the eval split held out before records could be grouped (split_eval as it was, verbatim)."""
    records = ds.records[ds.docs]
    unique = np.unique(records)
    rng = np.random.default_rng([seed, len(unique), 0xE7A1])
    held = rng.choice(unique, size=int(round(fraction * len(unique))), replace=False)
    return ds.docs[np.isin(records, held)]


def test_records_without_a_group_are_split_as_before(demo_tokenizer, tmp_path):
    """Records no reader groups (every format but oasst's trees and Self-Instruct's instances) are held out exactly as
    by record: the same documents, with records that give several documents (overlong: split) or none (skipped)."""
    texts = write_jsonl(tmp_path / "t.jsonl", [{"text": "x" * (5 + 13 * (i % 7))} if i % 11 else "{bad"
                                               for i in range(90)])
    chats = write_jsonl(tmp_path / "c.jsonl", [chat(f"q{i}", f"a{i}") for i in range(57)])
    sources = [{"path": str(texts)}, {"path": str(chats)}]
    settings = dict(max_seq_len=32, overlong="split", on_error="skip")
    whole = build_data(config(tmp_path, demo_tokenizer, sources, **settings))[0]
    assert max(np.bincount(whole.datasets[0].records)) > 1  # records of several documents
    for seed, fraction in [(0, 0.2), (3, 0.37)]:
        _, evalm, _ = build_data(config(tmp_path, demo_tokenizer, sources, eval_fraction=fraction, seed=seed,
                                        **settings))
        for ds, ev in zip(whole.datasets, evalm.datasets):
            assert np.array_equal(ev.docs, held_out_by_record(ds, fraction, seed))


def oasst_tree(i: int) -> dict:
    """Tree i: 4 threads sharing its prompt, 2 of them also its first answer and the follow-up's turns before theirs."""
    def m(role, text, *replies):
        return {"message_id": f"{i}-{text}", "role": role, "text": text, "replies": list(replies)}
    return {"message_tree_id": f"tree-{i}", "prompt": m(
        "prompter", f"tree {i} asks", m("assistant", "a", m("prompter", "b", m("assistant", "c"), m("assistant", "d"))),
        m("assistant", "e"), m("assistant", "f"))}


@pytest.mark.parametrize("workers", [0, 2])
def test_eval_split_keeps_an_oasst_trees_threads_together(demo_tokenizer, tmp_path, monkeypatch, workers):
    """The threads of one OpenAssistant tree share its prompt and earlier turns: held out by record, a tree's threads
    fell on both sides and the eval loss was measured on turns the model trained on. A tree is held out whole, and
    eval_fraction counts trees. Chunks of 3 records cut trees in two, over workers too."""
    monkeypatch.setattr(tokenize, "CHUNK", 3)
    path = write_jsonl(tmp_path / "trees.jsonl", [oasst_tree(i) for i in range(20)])
    tok = load_tokenizer(demo_tokenizer)

    def trees(ds) -> set[str]:
        return {tok.decode(ds[i][0].tolist()).split("<|user|>")[1].split(" asks")[0] for i in range(len(ds))}

    cfg = config(tmp_path, demo_tokenizer, [{"path": str(path)}], eval_fraction=0.3, num_workers=workers)
    train, evalm, s = build_data(cfg)
    tr, ev = train.datasets[0], evalm.datasets[0]
    assert not trees(tr) & trees(ev)
    assert (len(trees(tr)), len(trees(ev)), len(tr), len(ev), s.eval_docs) == (14, 6, 56, 24, 24)
    assert np.array_equal(build_data(cfg)[1].datasets[0].docs, ev.docs)  # seeded


def test_eval_split_keeps_a_self_instruct_rows_instances_together(demo_tokenizer, tmp_path):
    """A Self-Instruct row's instances share its instruction (trained under train_on: all): a task is held out whole."""
    rows = [{"instruction": f"task {i} says", "instances": [{"input": "", "output": f"out {k}"} for k in range(3)]}
            for i in range(20)]
    path = write_jsonl(tmp_path / "si.jsonl", rows)
    tok = load_tokenizer(demo_tokenizer)

    def tasks(ds) -> set[str]:
        return {tok.decode(ds[i][0].tolist()).split("<|user|>")[1].split(" says")[0] for i in range(len(ds))}

    train, evalm, _ = build_data(config(tmp_path, demo_tokenizer, [{"path": str(path)}], eval_fraction=0.3))
    tr, ev = train.datasets[0], evalm.datasets[0]
    assert not tasks(tr) & tasks(ev) and (len(tasks(ev)), len(ev)) == (6, 18)


def test_drop_system_message_changes_the_tokens_and_the_cache_key(demo_tokenizer, tmp_path):
    """A source's drop_system_message removes the system turn from what is tokenized, and is part of the cache key: the
    tokenization cached without it is not reused with it (nor the other way round)."""
    record = {"messages": [{"role": "system", "content": "Be brief."}, *chat("hi", "yo")["messages"]]}
    path = write_jsonl(tmp_path / "d.jsonl", [record])
    tok = load_tokenizer(demo_tokenizer)
    kept = build_data(config(tmp_path, demo_tokenizer, [{"path": str(path)}]))
    assert kept[2].sources[0].cache == "miss"
    assert tok.decode(kept[0].doc(0)[0].tolist()) == "<s><|system|>Be brief.<|user|>hi<|assistant|>yo</s>"
    dropped = build_data(config(tmp_path, demo_tokenizer, [{"path": str(path), "drop_system_message": True}]))
    assert dropped[2].sources[0].cache == "miss"
    assert tok.decode(dropped[0].doc(0)[0].tolist()) == "<s><|user|>hi<|assistant|>yo</s>"
    for drop in (False, True):  # each setting finds its own tokenization again
        summary = build_data(config(tmp_path, demo_tokenizer, [{"path": str(path), "drop_system_message": drop}]))[2]
        assert summary.sources[0].cache == "hit", drop


def test_available_cpus_keeps_to_a_containers_cgroup_quota(tmp_path):
    """The default count of tokenizer workers: the affinity mask capped by the cgroup's CPU quota, rounded up (v2's
    cpu.max, v1's cfs quota over period); unlimited or unreadable quotas leave the affinity."""
    from gapless.data.tokenize import available_cpus, cgroup_cpu_quota

    affinity = len(os.sched_getaffinity(0))
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(v2) is None and available_cpus(v2) == affinity
    (v2 / "cpu.max").write_text("50000 100000\n")  # half a CPU: one worker
    assert cgroup_cpu_quota(v2) == 0.5 and available_cpus(v2) == 1
    (v2 / "cpu.max").write_text(f"{100000 * (affinity + 3)} 100000\n")  # more than the affinity allows
    assert available_cpus(v2) == affinity
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_quota(v1) is None and available_cpus(v1) == affinity
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("150000\n")  # 1.5 CPUs: 2 workers where 2 cores are there
    assert cgroup_cpu_quota(v1) == 1.5 and available_cpus(v1) == min(affinity, 2)
    assert cgroup_cpu_quota(tmp_path / "none") is None  # no cgroup files at all


def test_an_empty_answer_is_refused_or_counted(demo_tokenizer, tmp_path):
    """An empty answer (an empty CSV cell, alpaca's `"output": ""`) was trained as its end-of-turn token alone."""
    chats = write_jsonl(tmp_path / "c.jsonl", [chat("a", "b"), chat("c", "  \n"), chat("e", "f")])
    alpaca = write_jsonl(tmp_path / "a.jsonl", [{"instruction": "q", "output": ""},
                                                {"instruction": "q", "output": "a"}])
    sources = [{"path": str(chats)}, {"path": str(alpaca)}]
    with pytest.raises(ValueError, match=rf"^{chats}:2: messages\[1\].content: an empty assistant answer"):
        build_data(config(tmp_path, demo_tokenizer, sources))
    mix, _, s = build_data(config(tmp_path, demo_tokenizer, sources, on_error="skip"))
    assert [r.dropped for r in s.sources] == [{"empty_answer": 1}] * 2 and len(mix) == 3
    # every token trained: nothing is an answer
    _, _, s = build_data(config(tmp_path, demo_tokenizer, sources, train_on="all"))
    assert s.dropped == {} and s.kept == 5


def test_reasoning_a_template_leaves_out_is_counted_and_warned(shared, tmp_path):
    """Assistant turns with their reasoning beside the answer (OrionLLM/OpenMedicalInstruct, jtl11/tool-calling-json:
    messages of role, content, reasoning_content; HuggingFaceH4/Multilingual-Thinking's `thinking`): Llama 3's
    template never writes it, and the answers trained without their reasoning without a word. Counted and warned,
    as tools the template leaves out; a template that renders it (Qwen3's) is not."""
    from chat_templates import QWEN3

    records = [{"messages": [{"role": "user", "content": "2+2?"},
                             {"role": "assistant", "content": "4", "reasoning_content": "Two and two make four."}]},
               {"messages": [{"role": "system", "content": "reasoning language: French", "thinking": None},
                             {"role": "user", "content": "Hi", "thinking": None},
                             {"role": "assistant", "content": "Hello!", "thinking": "L'utilisateur salue."}]},
               {"messages": [{"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6"}]}]
    write_jsonl(tmp_path / "reasoning.jsonl", records)
    settings = {"sources": [{"path": str(tmp_path / "reasoning.jsonl")}], "num_workers": 0,
                "tokenizer": str(shared / "tokenizers/llama3"), "cache_dir": str(tmp_path / "c")}
    with pytest.warns(UserWarning, match="2 records have assistant reasoning .* that the chat template does not "
                                         "render; their answers are trained without it"):
        _, _, summary = build_data(from_dict(DataConfig, settings, "data"))
    assert summary.sources[0].reasoning_not_rendered == 2
    qwen3 = {**settings, "tokenizer": str(shared / "tokenizers/qwen2"), "chat_template": QWEN3,
             "cache_dir": str(tmp_path / "q")}
    _, _, summary = build_data(from_dict(DataConfig, qwen3, "data"))
    assert summary.sources[0].reasoning_not_rendered == 0


def test_capybara_pairs_train_every_output_under_llama3(shared, tmp_path):
    """LDJnr/Capybara's {input, output} pairs: each input is a user turn (not trained), each output an assistant answer
    that trains, with its <|eot_id|>, under data.train_on: assistant."""
    rows = [{"source": "Know-Logic", "conversation": [{"input": "Capital of France?", "output": "Paris."},
                                                      {"input": "Population?", "output": "About 2.1 million."},
                                                      {"input": "Thanks!", "output": "You're welcome."}]},
            {"source": "Dove", "conversation": [{"input": "A haiku on rain?", "output": "Soft rain on the roof"}]}]
    path = write_jsonl(tmp_path / "capybara.jsonl", rows)
    mix, _, s = build_data(config(tmp_path, shared / "tokenizers/llama3", [{"path": str(path)}]))
    tok = load_tokenizer(shared / "tokenizers/llama3")
    assert len(mix) == 2 and s.sources[0].dropped == {}
    for i, row in enumerate(rows):
        ids, mask = mix.doc(i)
        assert trained_runs(tok, ids, mask) == [p["output"] + "<|eot_id|>" for p in row["conversation"]]
        text = tok.decode(np.asarray(ids).tolist())
        assert text.count("<|start_header_id|>user<|end_header_id|>") == len(row["conversation"])
        assert all(f"user<|end_header_id|>\n\n{p['input']}<|eot_id|>" in text for p in row["conversation"])


def test_glaive_rows_render_as_tool_calls_and_results_under_a_tool_template(shared, tmp_path):
    """glaive-function-calling-v2's rows under Qwen 2.5's tool template: the function definitions in the system
    prompt's <tools>, each <functioncall> trained as the template's <tool_call> (words before it too), each function
    response a <tool_response> that does not train, no <|endoftext|> left; a row that cannot be read is a counted
    skip under on_error: skip."""
    (tmp_path / "tools.jinja").write_text(QWEN_TOOL_TEMPLATE)
    weather = {"name": "get_weather", "description": "Get the weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
    system = ("SYSTEM: You are a helpful assistant with access to the following functions. Use them if required -\n"
              + json.dumps(weather, indent=4) + "\n\n")
    rows = [{"system": system, "chat": "USER: Weather in Paris?\n\n\nASSISTANT: Let me look.\n<functioncall> "
                                       "{\"name\": \"get_weather\", \"arguments\": '{\"city\": \"Paris\"}'} "
                                       "<|endoftext|>\n\n\nFUNCTION RESPONSE: {\"temp\": 18}\n\n\nASSISTANT: It's 18 "
                                       "degrees in Paris. <|endoftext|>\n\n\n"},
            {"system": "SYSTEM: You are a helpful assistant, with no access to external functions.\n\n",
             "chat": "USER: Hi!\n\n\nASSISTANT: Hello! How can I help? <|endoftext|>\n\n\n"},
            {"system": system, "chat": "USER: Weather?\n\n\nASSISTANT: <functioncall> {\"name\": \"get_forecast\", "
                                       "\"arguments\": '{}'} <|endoftext|>"}]
    path = write_jsonl(tmp_path / "glaive.jsonl", rows)
    cfg = config(tmp_path, shared / "tokenizers/qwen2", [{"path": str(path)}], on_error="skip",
                 chat_template=str(tmp_path / "tools.jinja"))
    mix, _, s = build_data(cfg)
    tok = load_tokenizer(shared / "tokenizers/qwen2")
    assert len(mix) == 2 and s.sources[0].dropped == {"bad_value": 1} and s.warnings == []
    ids, mask = mix.doc(0)
    assert trained_runs(tok, ids, mask) == [
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
        "It's 18 degrees in Paris.<|im_end|>"]
    text = tok.decode(np.asarray(ids).tolist())
    assert json.dumps({"type": "function", "function": weather}) in text
    assert '<|im_start|>user\n<tool_response>\n{"temp": 18}\n</tool_response><|im_end|>' in text
    assert "<|endoftext|>" not in text and "functioncall" not in text and "Use them if required" not in text
    ids, mask = mix.doc(1)
    assert trained_runs(tok, ids, mask) == ["Hello! How can I help?<|im_end|>"]
    assert "with no access to external functions.<|im_end|>" in tok.decode(np.asarray(ids).tolist())


# Axolotl's docs/dataset-formats/template_free.qmd example, with Llama 3's bos and eos written in the text
SEGMENTS = {"segments": [{"label": True, "text": "<|begin_of_text|>Hello\n"}, {"label": True, "text": "hi there!. "},
                         {"label": False, "text": "goodbye "}, {"label": True, "text": "farewell<|end_of_text|>"}]}


@pytest.mark.parametrize("train_on", ["assistant", "all"])
def test_segments_train_what_axolotls_input_output_trains(shared, tmp_path, train_on):
    """Format segments (Axolotl's input_output, prompt_strategies/input_output.py): each piece tokenized on its own
    without special tokens added, the ids concatenated, a piece of label false untrained (train_on_inputs: all)."""
    tok = load_tokenizer(shared / "tokenizers/llama3")
    path = write_jsonl(tmp_path / "io.jsonl", [SEGMENTS])
    mix, _, s = build_data(config(tmp_path, shared / "tokenizers/llama3", [{"path": str(path)}], train_on=train_on))
    assert s.sources[0].kept == 1
    ids, mask = mix.doc(0)
    pieces = [tok(p["text"], add_special_tokens=False)["input_ids"] for p in SEGMENTS["segments"]]
    assert np.asarray(ids).tolist() == [i for p in pieces for i in p]
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.convert_tokens_to_ids("<|end_of_text|>")  # nothing added
    if train_on == "all":
        assert mask.all()
    else:
        assert trained_runs(tok, ids, mask) == ["<|begin_of_text|>Hello\nhi there!. ", "farewell<|end_of_text|>"]


def test_segments_bad_pieces_are_located(demo_tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "io.jsonl", [SEGMENTS, {"segments": [{"label": "yes", "text": "a"}]},
                                               {"segments": [{"label": False, "text": "only input"}]}])
    with pytest.raises(ValueError, match=r"io.jsonl:2: segments\[0\]: expected \{\"label\": true\|false"):
        build_data(config(tmp_path, demo_tokenizer, [{"path": str(path), "format": "segments"}]))
    _, _, s = build_data(config(tmp_path, demo_tokenizer, [{"path": str(path)}], on_error="skip"))
    assert s.sources[0].kept == 1 and s.sources[0].dropped == {"bad_value": 1, "nothing_to_train": 1}
