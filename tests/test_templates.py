"""Loss masks under the chat templates that instruct models ship (tests/chat_templates.py, verbatim), on the shared
messages/ records: the trained tokens are exactly each answer and its end-of-turn token, the documents are the
tokenizer's own apply_chat_template ids, and a record a template refuses or rewrites is a counted skip naming
file:line, never a crash of the run nor a silently shifted mask.

No Llama 3.2, Mistral, Gemma or Phi tokenizer is on disk: each folder is the shared Llama 3 (or Qwen2) tokenizer,
with the model's turn markers added as special tokens where it lacks them, and the template in tokenizer_config.json.
"""
import copy
import json
import shutil
import unicodedata

import numpy as np
import pytest

import chat_templates
from gapless.config import DataConfig, SourceConfig, from_dict
from gapless.data.formats import read_source
from gapless.data.pipeline import build_data
from gapless.data.tokenize import Encoder, load_tokenizer, tokenizer_template

MISTRAL_TOKENS = ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                  "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]
GEMMA_TOKENS = ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]
PHI_TOKENS = ["<s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
# Mistral's v3 (tekken) tokenizers of Nemo and Small 3 add the system prompt's markers
TEKKEN_TOKENS = MISTRAL_TOKENS + ["[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"]
ZEPHYR_TOKENS = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
# DeepSeek-R1's (fullwidth bars, U+2581 for spaces); <think> and </think> are plain added tokens there, left as text here
DEEPSEEK_TOKENS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                   "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                   "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
                   "<｜tool▁output▁end｜>"]
DEEPSEEK = {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"}
# name -> (shared tokenizer, template, special tokens to add, tokenizer_config.json settings). Llama 3's tokenizer
# takes 4 s to load on the CPU box, Qwen2's 1 s: the templates of other families use Qwen2's.
FOLDERS = {
    "llama32": ("llama3", chat_templates.LLAMA32, [], {}),
    "qwen25": ("qwen2", chat_templates.QWEN25, [], {"eos_token": "<|im_end|>"}),
    "qwen3": ("qwen2", chat_templates.QWEN3, [], {"eos_token": "<|im_end|>"}),
    "mistral": ("qwen2", chat_templates.MISTRAL, MISTRAL_TOKENS, {"bos_token": "<s>", "eos_token": "</s>"}),
    "gemma2": ("qwen2", chat_templates.GEMMA2, GEMMA_TOKENS, {"bos_token": "<bos>", "eos_token": "<eos>"}),
    "gemma3": ("qwen2", chat_templates.GEMMA3, GEMMA_TOKENS, {"bos_token": "<bos>", "eos_token": "<eos>"}),
    "phi35": ("qwen2", chat_templates.PHI35, PHI_TOKENS, {"bos_token": "<s>", "eos_token": "<|endoftext|>"}),
    "llama33": ("llama3", chat_templates.LLAMA33, [], {}),
    "deepseek_r1_qwen": ("qwen2", chat_templates.DEEPSEEK_R1_QWEN, DEEPSEEK_TOKENS, DEEPSEEK),
    "deepseek_r1_llama": ("qwen2", chat_templates.DEEPSEEK_R1_LLAMA, DEEPSEEK_TOKENS, DEEPSEEK),
    "qwq": ("qwen2", chat_templates.QWQ, [], {"eos_token": "<|im_end|>"}),
    "smollm2": ("qwen2", chat_templates.SMOLLM2, [], {"eos_token": "<|im_end|>"}),
    # Hermes 3 ships named sets, `tool_use` for a conversation with tools (tokenizer_config.json's list form)
    "hermes3": ("qwen2", [{"name": "default", "template": chat_templates.HERMES3},
                          {"name": "tool_use", "template": chat_templates.HERMES3_TOOL_USE}], [],
                {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}),
    "mistral_nemo": ("qwen2", chat_templates.MISTRAL_NEMO, TEKKEN_TOKENS, {"bos_token": "<s>", "eos_token": "</s>"}),
    "mistral_small3": ("qwen2", chat_templates.MISTRAL_SMALL3, TEKKEN_TOKENS,
                       {"bos_token": "<s>", "eos_token": "</s>"}),
    "zephyr": ("qwen2", chat_templates.ZEPHYR, ZEPHYR_TOKENS, {"bos_token": "<s>", "eos_token": "</s>"}),
}
# name -> how the template writes an assistant turn's text and end-of-turn (what is trained)
ANSWERS = {
    "llama32": lambda content: content.strip() + "<|eot_id|>",
    "qwen25": lambda content: content + "<|im_end|>",
    "mistral": lambda content: " " + content.strip() + "</s>",  # the space after [/INST] is the answer's
    "gemma3": lambda content: content.strip() + "<end_of_turn>",
    "phi35": lambda content: content + "<|end|>",  # not the newline nor the eos_token written after the last turn
    "llama33": lambda content: content.strip() + "<|eot_id|>",
    "deepseek_r1_qwen": lambda content: content + "<｜end▁of▁sentence｜>",
    "deepseek_r1_llama": lambda content: content + "<｜end▁of▁sentence｜>",
    "qwq": lambda content: content + "<|im_end|>",
    "smollm2": lambda content: content + "<|im_end|>",
    "hermes3": lambda content: content + "<|im_end|>",
    "mistral_nemo": lambda content: content + "</s>",  # no space after [/INST], no trim: unlike v0.3
    "mistral_small3": lambda content: content + "</s>",
    "zephyr": lambda content: content + "</s>",  # not the newline after it
}

GLAIVE = "glaive_toolcall_en_demo.jsonl:4"  # the sample's record of tool calls
REFUSED = {  # name -> the sample's records the template refuses: (reason, file:line)
    "gemma3": [("template_error", GLAIVE)],
    "mistral_nemo": [("template_error", GLAIVE)],
    "mistral_small3": [("template_error", GLAIVE)],
    "deepseek_r1_llama": [("tool_calls_not_rendered", GLAIVE)],
}


def tokenizer_folder(shared, folder, name):
    """The shared tokenizer's files, with the template and its turn markers (as special tokens) set in
    tokenizer_config.json."""
    base, template, specials, settings = FOLDERS[name]
    folder.mkdir()
    for f in (shared / "tokenizers" / base).iterdir():
        if f.name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
            shutil.copy(f, folder / f.name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    if specials:
        config["additional_special_tokens"] = config.get("additional_special_tokens", []) + specials
    config.update(settings, chat_template=template)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def folders(shared, tmp_path_factory):
    root = tmp_path_factory.mktemp("templates")
    return {name: tokenizer_folder(shared, root / name, name) for name in FOLDERS}


@pytest.fixture(scope="module")
def tokenizers(folders):
    """name -> the folder's tokenizer, loaded on first use."""
    class Tokenizers(dict):
        def __missing__(self, name):
            base, template, specials, settings = FOLDERS[name]
            # a folder that differs from one loaded only in its template: that tokenizer, given this template (Llama
            # 3's tokenizer takes 4 s to load on the CPU box)
            same = next((n for n in self if FOLDERS[n][0] == base and FOLDERS[n][2:] == (specials, settings)), None)
            if same is None:
                self[name] = load_tokenizer(folders[name])
            else:
                self[name] = copy.copy(self[same])
                # named sets, as transformers reads tokenizer_config.json's list form
                self[name].chat_template = (template if isinstance(template, str) else
                                            {t["name"]: t["template"] for t in template})
            return self[name]

    return Tokenizers()


def sample(shared, per_file: int = 4, system_every: int = 3) -> list:
    """A few records of each messages/ file (squality's long stories left out), multi-turn ones first, every
    `system_every`-th given a system prompt."""
    out = []
    for path in sorted((shared / "data/messages").glob("*.jsonl")):
        if "squality" not in path.name:
            records = list(read_source(SourceConfig(path=str(path))))[:200]
            out += sorted(records, key=lambda e: -len(e.messages))[:per_file]
    for ex in out[::system_every]:
        ex.messages = [{"role": "system", "content": "You are terse."}] + ex.messages
    return out


def trained_runs(tok, ids, mask) -> list[str]:
    """The decoded maximal runs of trained tokens."""
    edges = np.flatnonzero(np.diff(np.asarray(mask, np.int8))) + 1
    return [tok.decode(p.tolist(), skip_special_tokens=False)
            for p, m in zip(np.split(np.asarray(ids), edges), np.split(np.asarray(mask), edges)) if m[0]]


def own_ids(tok, enc, ex) -> list[int]:
    """The tokenizer's own apply_chat_template ids of the whole conversation, as the Encoder hands it over."""
    enc = enc.tool_use if ex.tools and enc.tool_use is not None else enc  # named sets: tool_use for tools
    tools = ex.tools if ex.tools and enc.renders_tools else None
    out = tok.apply_chat_template(enc.template_messages(ex.messages, tools), tools=tools, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def plain(ex) -> bool:
    return not ex.tools and all(m["role"] in ("system", "user", "assistant") and not m.get("is_tool_call")
                                for m in ex.messages)


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_trained_tokens_are_each_answer_and_the_documents_the_templates_own_ids(shared, tokenizers, name):
    tok = tokenizers[name]
    enc = Encoder(tok, tokenizer_template(tok), max_seq_len=10**6, train_on="assistant", overlong="truncate")
    # Mistral's template refuses glaive's tool turns after a system message (roles must alternate): its system
    # prompts have their own test below
    examples = [ex for ex in sample(shared) if name != "mistral" or ex.messages[0]["role"] != "system"]
    chunk = enc.encode_chunk(examples)
    # glaive's tool turns, refused by Gemma 3 and Mistral Small 3 (roles), Mistral Nemo (a call's id), and not
    # rendered by DeepSeek-R1-Distill-Llama (calls where content is none only): counted, named
    refused = {e.where for e in chunk.errors}
    assert sorted({(e.reason, e.where.rsplit("/", 1)[1]) for e in chunk.errors}) == REFUSED.get(name, [])
    kept = [ex for ex in examples if ex.where not in refused]
    assert len(chunk.ids) == len(kept) > 20
    turns = 0
    for ex, ids, mask in zip(kept, chunk.ids, chunk.mask):
        if name == "deepseek_r1_qwen" and not plain(ex):
            # its later calls follow the question with no <｜Assistant｜> (ns.is_first is never reset): the turn is
            # tokenized on its own, where the template's ids merge "?\n"; the same text
            assert tok.decode(ids.tolist()) == tok.decode(own_ids(tok, enc, ex)), ex.where
        else:
            assert ids.tolist() == own_ids(tok, enc, ex), ex.where
        runs = trained_runs(tok, ids, mask)
        assert len(runs) == sum(m["role"] == "assistant" for m in ex.messages), ex.where
        if plain(ex):
            want = [ANSWERS[name](m["content"]) for m in ex.messages if m["role"] == "assistant"]
            assert [unicodedata.normalize("NFC", r) for r in runs] == [unicodedata.normalize("NFC", w) for w in want], \
                ex.where  # Qwen2's normalizer is NFC
            turns += len(want)
    assert turns > 40


def test_llama32_tool_calls_train_the_call_and_the_system_header_is_the_prompt(shared, tokenizers):
    """Llama 3.2's template: the Cutting Knowledge/Today Date header and the tool definitions (in the first user
    turn) are prompt; a glaive call is trained as the JSON the template writes, {"name", "parameters"}."""
    tok = tokenizers["llama32"]
    enc = Encoder(tok, tokenizer_template(tok), max_seq_len=10**6, train_on="assistant", overlong="truncate")
    examples = list(read_source(SourceConfig(path=str(shared / "data/messages/glaive_toolcall_en_demo.jsonl"))))[:30]
    chunk = enc.encode_chunk(examples)
    assert not chunk.errors and len(chunk.ids) == 30
    calls = 0
    for ex, ids, mask in zip(examples, chunk.ids, chunk.mask):
        assert ids.tolist() == own_ids(tok, enc, ex), ex.where
        text = tok.decode(ids.tolist(), skip_special_tokens=False)
        assert "Cutting Knowledge Date: December 2023\nToday Date: " in text
        want = []
        for m in ex.messages:
            if m.get("is_tool_call"):
                call = json.loads(m["content"])
                want.append(f'{{"name": "{call["name"]}", "parameters": '
                            f'{json.dumps(call["arguments"], ensure_ascii=False)}}}<|eot_id|>')
                calls += 1
            elif m["role"] == "assistant":
                want.append(m["content"].strip() + "<|eot_id|>")
        assert trained_runs(tok, ids, mask) == want, ex.where
    assert calls > 15


def config(tmp_path, tokenizer, path, **options) -> DataConfig:
    return from_dict(DataConfig, {"sources": [{"path": str(path)}], "tokenizer": str(tokenizer), "num_workers": 0,
                                  "cache_dir": str(tmp_path / "cache"), "max_seq_len": 8192,
                                  "tokens_per_batch": 8192, **options}, "data")


def write_jsonl(path, examples) -> list[str]:
    """The examples as a messages file; their file:line."""
    path.write_text("".join(json.dumps({"messages": ex.messages}) + "\n" for ex in examples))
    return [f"{path}:{n}" for n in range(1, len(examples) + 1)]


def test_qwen3_trains_every_turn_of_a_multi_turn_conversation(shared, folders, tokenizers, tmp_path):
    """Qwen3's template writes an empty <think> block into the last turn only, so no earlier turn renders as a prefix
    of the whole conversation. Each earlier answer is found as its own text right after its prompt, through
    <|im_end|>, and each earlier tool call (glaive's) from its prompt to the first <|im_end|>, the end-of-turn token
    of the last turn; the last keeps its empty block, as Qwen3 writes it. (Every multi-turn record was skipped as
    template_not_prefix.) Qwen2.5 renders the same turns the same way, without the block, as prefixes: the
    trained text of each turn is Qwen2.5's."""
    examples = sample(shared)
    wheres = write_jsonl(tmp_path / "chats.jsonl", examples)
    multi = {w for w, ex in zip(wheres, examples) if sum(m["role"] == "assistant" for m in ex.messages) > 1}
    calls = {w for w, ex in zip(wheres, examples) if w in multi and not plain(ex)}
    assert len(multi - calls) > 8 and calls
    qwen3, qwen25 = (build_data(config(tmp_path, folders[name], tmp_path / "chats.jsonl"))
                     for name in ("qwen3", "qwen25"))
    (mix, _, summary), (mix25, _, _) = qwen3, qwen25
    assert summary.dropped == {} and len(mix) == len(mix25) == len(examples)
    tok = tokenizers["qwen3"]
    trained_turns = 0
    for i, (where, ex) in enumerate(zip(wheres, examples)):
        runs, runs25 = trained_runs(tok, *mix.doc(i)), trained_runs(tok, *mix25.doc(i))
        assert runs[:-1] == runs25[:-1] and runs[-1] == "<think>\n\n</think>\n\n" + runs25[-1], ex.where
        if where in calls:
            assert sum(r.startswith("<tool_call>") for r in runs) > 1, ex.where
        if plain(ex):
            answers = [m["content"] for m in ex.messages if m["role"] == "assistant"]
            want = [a + "<|im_end|>" for a in answers[:-1]] + [f"<think>\n\n</think>\n\n{answers[-1]}<|im_end|>"]
            assert [unicodedata.normalize("NFC", r) for r in runs] == [unicodedata.normalize("NFC", w) for w in want]
        trained_turns += len(runs)
    assert trained_turns > len(examples) + 20  # the earlier turns of the multi-turn records are trained


def test_qwen3_reasoning_of_the_last_turn_is_trained(shared, tokenizers):
    tok = tokenizers["qwen3"]
    enc = Encoder(tok, tokenizer_template(tok), max_seq_len=10**6, train_on="last_assistant", overlong="truncate")
    examples = [ex for ex in sample(shared, system_every=2) if plain(ex)][:12]
    for ex in examples:  # the answer's reasoning, as Qwen3's data has it: in <think> or in reasoning_content
        ex.messages[-1] = {**ex.messages[-1], "content": f"<think>\nWhy {ex.where[-3:]}?\n</think>\n\n"
                                                         + ex.messages[-1]["content"].lstrip()}
    examples[0].messages[-1] = {"role": "assistant", "reasoning_content": "Think.",
                                "content": examples[0].messages[-1]["content"].split("</think>\n\n")[1]}
    chunk = enc.encode_chunk(examples)
    assert not chunk.errors
    for ex, ids, mask in zip(examples, chunk.ids, chunk.mask):
        assert ids.tolist() == own_ids(tok, enc, ex), ex.where
        last = ex.messages[-1]
        want = (f"<think>\nThink.\n</think>\n\n{last['content']}<|im_end|>" if "reasoning_content" in last
                else last["content"] + "<|im_end|>")
        assert trained_runs(tok, ids, mask) == [want], ex.where


@pytest.mark.parametrize("name", ["deepseek_r1_qwen", "qwq"])
def test_reasoning_written_into_answers_trains_as_the_template_renders_it(shared, tokenizers, name):
    """Reasoning in the answers' content ("<think>...</think>", as R1 distillation data has it): DeepSeek-R1-Distill's
    template drops it from every turn, the last too, and trains the text after </think> ("\n\n" and the answer)
    with its end-of-turn, counted reasoning_not_rendered (it went uncounted); QwQ's drops it from the earlier turns
    only and trains the last as written, after the "<think>\n" its generation prompt ends in. Each earlier turn is located in the whole conversation, as the template writes it."""
    tok = tokenizers[name]
    enc = Encoder(tok, tokenizer_template(tok), max_seq_len=10**6, train_on="assistant", overlong="truncate")
    examples = [ex for ex in sample(shared) if plain(ex) and sum(m["role"] == "assistant" for m in ex.messages) > 1]
    assert len(examples) > 5
    for ex in examples:
        ex.messages = [{**m, "content": f"<think>\nWhy {k}?\n</think>\n\n{m['content']}"} if m["role"] == "assistant"
                       else m for k, m in enumerate(ex.messages)]
    chunk = enc.encode_chunk(examples)
    assert not chunk.errors and len(chunk.ids) == len(examples)
    assert chunk.counts["reasoning_not_rendered"] == (len(examples) if name == "deepseek_r1_qwen" else 0)
    for ex, ids, mask in zip(examples, chunk.ids, chunk.mask):
        assert ids.tolist() == own_ids(tok, enc, ex), ex.where
        answers = [m["content"] for m in ex.messages if m["role"] == "assistant"]
        if name == "deepseek_r1_qwen":
            want = [a.split("</think>")[-1] + "<｜end▁of▁sentence｜>" for a in answers]
        else:
            # the last after "<think>\n", which QwQ's generation prompt writes: the model is prompted with it
            want = [a.split("</think>")[-1].lstrip("\n") + "<|im_end|>" for a in answers[:-1]] + [
                answers[-1].removeprefix("<think>\n") + "<|im_end|>"]
        got = trained_runs(tok, ids, mask)
        assert [unicodedata.normalize("NFC", r) for r in got] == [unicodedata.normalize("NFC", w) for w in want], \
            ex.where


def test_gemma3_content_parts_train_the_text_as_a_string_does(shared, folders, tokenizers, tmp_path):
    """OpenAI's content parts ([{"type": "text", "text": ...}]) under Gemma 3's template: read as their text, the
    documents and masks of the string form."""
    examples = [ex for ex in sample(shared, system_every=10**6) if plain(ex)][:8]
    as_parts = tmp_path / "parts.jsonl"
    as_parts.write_text("".join(json.dumps({"messages": [{**m, "content": [{"type": "text", "text": m["content"]}]}
                                                         for m in ex.messages]}) + "\n" for ex in examples))
    write_jsonl(tmp_path / "strings.jsonl", examples)
    (parts, _, summary), (strings, _, _) = (build_data(config(tmp_path, folders["gemma3"], tmp_path / f))
                                            for f in ("parts.jsonl", "strings.jsonl"))
    assert summary.dropped == {} and len(parts) == len(strings) == len(examples)
    tok = tokenizers["gemma3"]
    for i, ex in enumerate(examples):
        assert [a.tolist() for a in parts.doc(i)] == [a.tolist() for a in strings.doc(i)], ex.where
        assert trained_runs(tok, *parts.doc(i)) == [ANSWERS["gemma3"](m["content"]) for m in ex.messages
                                                    if m["role"] == "assistant"], ex.where


def test_mistral_system_prompt_is_left_out_as_its_template_does_and_said(shared, folders, tokenizers, tmp_path):
    """Mistral v0.3 writes the system message only into a last user turn (when prompting), so a conversation that
    ends in an answer renders without it, and no answer's prompt is a prefix of the whole: the mask cut at the
    prompt's length once skipped each answer's first characters (16 here: "You are terse.\\n\\n"), then every such
    record was skipped. Each answer is now located in the whole conversation and trained, the document is the
    tokenizer's own rendering, and the summary says how many records lost their system message."""
    examples = [ex for ex in sample(shared, per_file=8, system_every=2) if plain(ex)]
    wheres = write_jsonl(tmp_path / "chats.jsonl", examples)
    system = {w for w, ex in zip(wheres, examples) if ex.messages[0]["role"] == "system"}
    assert len(system) > 5 and any(len(ex.messages) > 3 for ex in examples)
    with pytest.warns(UserWarning, match=f"{len(system)} records have a system message"):
        mix, _, summary = build_data(config(tmp_path, folders["mistral"], tmp_path / "chats.jsonl"))
    assert summary.dropped == {} and len(mix) == len(examples)
    assert any(f"{len(system)} records have a system message that the chat template leaves out" in w
               for w in summary.warnings), summary.warnings
    tok = tokenizers["mistral"]
    for i, ex in enumerate(examples):
        ids, mask = mix.doc(i)
        assert ids.tolist() == list(tok.apply_chat_template(ex.messages, tokenize=True)["input_ids"]), ex.where
        assert trained_runs(tok, ids, mask) == [ANSWERS["mistral"](m["content"]) for m in ex.messages
                                                if m["role"] == "assistant"], ex.where


def test_template_errors_are_counted_skips_naming_the_record(shared, folders, tmp_path):
    """Gemma 2 refuses a system message, Mistral non-alternating roles: each a skip under on_error: skip, the run's
    error under raise, naming file:line."""
    examples = [ex for ex in sample(shared, system_every=2) if plain(ex)]
    wheres = write_jsonl(tmp_path / "chats.jsonl", examples)
    system = {w for w, ex in zip(wheres, examples) if ex.messages[0]["role"] == "system"}
    with pytest.raises(ValueError, match=r"chats.jsonl:1: messages: the chat template failed: System role not "
                                         r"supported \(set data.on_error: skip"):
        build_data(config(tmp_path, folders["gemma2"], tmp_path / "chats.jsonl"))
    mix, _, summary = build_data(config(tmp_path, folders["gemma2"], tmp_path / "chats.jsonl", on_error="skip"))
    assert summary.dropped == {"template_error": len(system)} and len(mix) == len(examples) - len(system)
    assert summary.sources[0].first_errors[0] == f"{wheres[0]}: messages: the chat template failed: System role " \
                                                 "not supported"
    two_users = tmp_path / "two_users.jsonl"
    two_users.write_text(json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                                                  {"role": "assistant", "content": "c"}]}) + "\n")
    with pytest.raises(ValueError, match=r"two_users.jsonl:1: messages: the chat template failed: After the optional "
                                         "system message, conversation roles must alternate"):
        build_data(config(tmp_path, folders["mistral"], two_users))


def test_a_folder_without_a_template_names_data_chat_template(shared, folders, tmp_path):
    folder = tmp_path / "no_template"
    shutil.copytree(folders["qwen25"], folder)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    del settings["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    path = tmp_path / "chats.jsonl"
    write_jsonl(path, sample(shared)[:2])
    for on_error in ("raise", "skip"):  # a setting to fix, not a record to skip
        with pytest.raises(ValueError, match=r"chats.jsonl:1: the tokenizer has no chat template \(a base model's\); "
                                             r"set data.chat_template to the one the model is to learn"):
            build_data(config(tmp_path, folder, path, on_error=on_error))
    mix, _, _ = build_data(config(tmp_path, folder, path, chat_template=chat_templates.QWEN25))
    assert len(mix) == 2


@pytest.mark.parametrize("name", ["llama32", "qwen25", "qwen3"])
def test_openai_tool_calls_with_json_string_arguments_train_the_arguments_as_json(shared, tokenizers, name):
    """OpenAI's tool_calls carry `arguments` as a JSON string; Llama 3.x's and Qwen2.5's templates write them with
    tojson, which made the string a quoted one ("parameters": "{\\"a\\": 1}"), trained as the call. Given to the
    template as the object the string holds, the document equals the one of the same call in glaive's form. Their
    content is null, as OpenAI writes it: Qwen3's template failed on it (`'</think>' in content`), a template_error
    for every such record."""
    tok = tokenizers[name]
    enc = Encoder(tok, tokenizer_template(tok), max_seq_len=10**6, train_on="assistant", overlong="truncate")
    glaive = [ex for ex in read_source(SourceConfig(path=str(shared / "data/messages/glaive_toolcall_en_demo.jsonl")))
              if any(m.get("is_tool_call") for m in ex.messages)][:12]
    openai = []
    for ex in glaive:
        messages = []
        for m in ex.messages:
            if m.get("is_tool_call"):
                call = json.loads(m["content"])
                function = {"name": call["name"], "arguments": json.dumps(call["arguments"])}
                m = {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": function}]}
            messages.append(m)
        openai.append(type(ex)(ex.where, messages=messages, tools=ex.tools))
    a, b = enc.encode_chunk(glaive), enc.encode_chunk(openai)
    assert not a.errors and not b.errors and len(a.ids) == len(b.ids) == 12
    for ex, ids, mask, ids2, mask2 in zip(glaive, a.ids, a.mask, b.ids, b.mask):
        assert trained_runs(tok, ids2, mask2) == trained_runs(tok, ids, mask), ex.where
        assert ids2.tolist() == ids.tolist() and mask2.tolist() == mask.tolist(), ex.where


def test_named_template_sets_render_records_with_tools_with_tool_use(shared, tmp_path):
    """A tokenizer with named template sets (tokenizer_config.json's chat_template as [{name, template}], as
    Command-R and Hermes ship): apply_chat_template picks `tool_use` for a call with tools and `default` otherwise.
    gapless used `default` for every record, so the tools of a record were dropped (counted tools_not_rendered) and
    its document was not the tokenizer's own."""
    folder = tokenizer_folder(shared, tmp_path / "sets", "qwen25")
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    default = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' }}"
               "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    settings["chat_template"] = [{"name": "default", "template": default},
                                 {"name": "tool_use", "template": chat_templates.QWEN25}]
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    tok = load_tokenizer(folder)
    enc = Encoder(tok, tokenizer_template(tok), max_seq_len=10**6, train_on="assistant", overlong="truncate")
    records = list(read_source(SourceConfig(path=str(shared / "data/messages/glaive_toolcall_en_demo.jsonl"))))[:40]
    with_tools = [ex for ex in records if ex.tools][:6]
    without = [ex for ex in sample(shared) if plain(ex)][:6]
    assert len(with_tools) == len(without) == 6
    chunk = enc.encode_chunk(with_tools + without)
    assert not chunk.errors and "tools_not_rendered" not in chunk.counts and len(chunk.ids) == 12
    for ex, ids in zip(with_tools + without, chunk.ids):
        chosen = enc.tool_use if ex.tools else enc
        messages = chosen.template_messages(ex.messages, ex.tools or None)
        own = tok.apply_chat_template(messages, tools=ex.tools or None, tokenize=True)
        assert ids.tolist() == list(own["input_ids"] if hasattr(own, "keys") else own), ex.where
    assert "<tools>" in tok.decode(chunk.ids[0].tolist()) and "<tools>" not in tok.decode(chunk.ids[-1].tolist())


def test_named_template_sets_without_default_are_refused(shared, tokenizers):
    tok = tokenizers["qwen25"]
    with pytest.raises(ValueError, match=r"chat templates are named \['rag', 'tool_use'\], none of them 'default'"):
        Encoder(tok, {"tool_use": "x", "rag": "y"}, max_seq_len=64, train_on="assistant", overlong="truncate")


def test_openai_weight_0_leaves_an_answer_out_of_the_loss(shared, tokenizers, tmp_path):
    """OpenAI's fine-tuning format: an assistant message of `weight: 0` is in the conversation but not trained; a
    record whose every answer has weight 0 has nothing to train; a weight other than 0 or 1 names its field."""
    tok = tokenizers["qwen25"]
    examples = [ex for ex in sample(shared) if plain(ex) and sum(m["role"] == "assistant" for m in ex.messages) > 1]
    assert len(examples) >= 5
    rows = []
    for ex in examples:  # the first answer weighted out
        first = next(i for i, m in enumerate(ex.messages) if m["role"] == "assistant")
        rows.append([{**m, "weight": 0} if i == first else m for i, m in enumerate(ex.messages)])
    rows.append([{**m, "weight": 0} if m["role"] == "assistant" else m for m in examples[0].messages])
    rows.append([{**m, "weight": 2} if m["role"] == "assistant" else m for m in examples[0].messages])
    path = tmp_path / "weighted.jsonl"
    path.write_text("".join(json.dumps({"messages": r}) + "\n" for r in rows))
    folder = tmp_path / "qwen25"
    tokenizer_folder(shared, folder, "qwen25")
    mix, _, summary = build_data(config(tmp_path, folder, path, on_error="skip"))
    assert summary.dropped == {"nothing_to_train": 1, "bad_value": 1} and len(mix) == len(examples)
    assert any(f"{path}:{len(rows)}: messages[" in e and "].weight: expected 0 or 1" in e
               for e in summary.sources[0].first_errors), summary.sources[0].first_errors
    for i, ex in enumerate(examples):
        ids, mask = mix.doc(i)
        answers = [m["content"] + "<|im_end|>" for m in ex.messages if m["role"] == "assistant"]
        assert trained_runs(tok, ids, mask) == answers[1:], ex.where
        assert answers[0][:-len("<|im_end|>")] in tok.decode(ids.tolist())  # still in the conversation
    mix, _, _ = build_data(config(tmp_path, folder, path, on_error="skip", train_on="last_assistant"))
    assert [trained_runs(tok, *mix.doc(i)) for i in range(len(examples))] == [
        [[m["content"] for m in ex.messages if m["role"] == "assistant"][-1] + "<|im_end|>"] for ex in examples]
