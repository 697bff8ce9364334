"""Tokenization: chat template + loss mask, done once in worker processes and cached on disk.

Masking works for any chat template, with no template strings written here. For each assistant
turn i the template renders the conversation up to turn i with the generation prompt, and up to
and including turn i; in the full rendering, the text between those two lengths is what the model
produces for that turn at inference. The text is tokenized in pieces cut where each such span
starts (so the prompt is tokenized as at inference, and no token holds both prompt and answer
text), with offsets. A token is trained when it starts inside a span, up to the span's last special
token (the end-of-turn: `<|eot_id|>` for Llama 3, `<|im_end|>` for ChatML): the end-of-turn token
is trained, the separator a template writes after it (ChatML's newline) is not, nor text it writes only after a
conversation's last turn (Phi-3's eos_token): a turn ends where the renderings of the conversation ending there and
going on (the generation prompt after it) part.
This needs a template whose rendering of a prefix of the conversation, with or without the generation prompt, is a
prefix of the full rendering. Where it is not (Qwen3 writes an empty <think> block into the last turn only, Mistral
v0.3 the system message into a last user turn only), the turn is located by rendering the whole conversation with
its text replaced by a marker (Encoder._marked_span), or, where that fails (a tool call, not plain text), from its
prompt to the first end-of-turn token of the kind that closes the last turn located (Encoder._to_end_of_turn); a
turn that cannot be located so is reported, not guessed: a RecordError of reason template_not_prefix, which
data.on_error raises or skips and counts.
An assistant turn of OpenAI's `weight: 0` stays in the conversation and out of the loss.

The pipeline that reads, tokenizes, caches and mixes a run's sources is gapless.data.pipeline.
"""
from __future__ import annotations

import itertools
import json
import math
import multiprocessing
import os
import re
import time
from collections import Counter, deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gapless.data.chat_templates import TEMPLATES
from gapless.data.formats import Example, RecordError, Skipped, text_of

# Reasons a record yields no document (besides the reading errors of gapless.data.formats).
NOTHING_TO_TRAIN, TEMPLATE_ERROR = "nothing_to_train", "template_error"
WHITESPACE = re.compile(r"\s*")
MARKER = "\ue000gapless-answer\ue001"  # private-use characters: no template or record writes them
OVERLONG, TRUNCATED_AWAY = "overlong", "truncated_away"  # overlong=drop; truncation removed every trained token
NOT_A_PREFIX = "template_not_prefix"  # the template renders a turn differently within the whole conversation
UNENCODABLE = "unencodable"  # text the tokenizer refuses (a vocabulary with no unknown token nor byte fallback)
CALLS_NOT_RENDERED = "tool_calls_not_rendered"  # a turn's tool calls the template writes nothing of
EMPTY_ANSWER = "empty_answer"  # an assistant turn to train with no text and no tool call (an empty CSV cell)
# The names an assistant turn's reasoning goes by beside its answer (transformers' apply_chat_template passes each
# under all three: OpenAI-compatible servers' reasoning_content, gpt-oss's thinking)
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Files of an HF tokenizer folder that decide tokenization (model weights in the same folder are not read).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "vocab.txt", "chat_template.json",
                   "chat_template.jinja")
# A task for a worker process ends at CHUNK records or CHUNK_CHARS characters of text, whichever
# comes first: by count alone, the 250 long stories of squality (40% of the shared mix's tokens)
# were one task, and one worker tokenized them while the other sat idle.
CHUNK, CHUNK_CHARS = 512, 1 << 20


def load_tokenizer(path: str | Path):
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ValueError(f"data.tokenizer: {path} is not a folder; give an HF tokenizer or model folder")
    from transformers import AutoTokenizer

    try:
        # trust_remote_code=False: a folder whose auto_map names its own Python code is refused, never run and never
        # answered by transformers' interactive "run the custom code? [y/N]" prompt
        return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    except (OSError, ValueError, TypeError) as e:
        if "custom code" in str(e):
            raise ValueError(f"data.tokenizer: {path} asks to run its own Python code (auto_map in "
                             "tokenizer_config.json); gapless never runs code from a model or tokenizer folder: use "
                             "a tokenizer folder whose tokenizer_class is a transformers class") from None
        raise ValueError(f"data.tokenizer: cannot load a tokenizer from {path}: {e}") from None


def read_chat_template(setting: str | None) -> str | None:
    """data.chat_template: inline Jinja, the text of a .jinja file, or a template's name (chat_templates.TEMPLATES:
    a base model's tokenizer has none of its own); None when not set."""
    if setting is None or "{" in setting:
        return setting
    path = Path(setting).expanduser()
    if setting in TEMPLATES and not path.is_file():
        return TEMPLATES[setting]
    if not path.is_file():
        raise ValueError(f"data.chat_template: {setting!r} is neither a file, a Jinja template nor one of the names "
                         f"{sorted(TEMPLATES)}")
    return path.read_text()


def tokenizer_template(tokenizer) -> str | dict[str, str] | None:
    """The tokenizer folder's own chat template (chat_template.jinja or tokenizer_config.json), if any: one Jinja
    text, or named sets ({"default": ..., "tool_use": ...}: Command-R, Hermes), which Encoder chooses from."""
    return tokenizer.chat_template


@dataclass
class Chunk:
    """The documents made from a run of records, concatenated, and what happened to each record."""
    num_records: int
    ids: list[np.ndarray] = field(default_factory=list)  # int32, per document
    mask: list[np.ndarray] = field(default_factory=list)  # uint8, per document
    records: list[int] = field(default_factory=list)  # per document: index of its record in the chunk
    # kept, truncated, split, dropped:<reason>, tools_not_rendered, tool_calls_as_text, system_not_rendered,
    # reasoning_not_rendered
    counts: Counter = field(default_factory=Counter)
    errors: list[RecordError] = field(default_factory=list)  # bad records, in order
    groups: dict[int, str] = field(default_factory=dict)  # a record's index in the chunk -> its Example.group, if any

    def add(self, ids: np.ndarray, mask: np.ndarray, record: int) -> None:
        self.ids.append(ids)
        self.mask.append(mask)
        self.records.append(record)


def _name_and_arguments(call) -> dict:
    """An OpenAI-style tool call ({"type": "function", "function": {"name", "arguments"}}, arguments maybe a JSON
    string) as {"name", "arguments"}; any other value as it is."""
    function = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(function, dict) or "name" not in function:
        return call
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass  # kept as the string it is
    return {"name": function["name"], "arguments": arguments}


def _reasoning(message: dict) -> str | None:
    """The reasoning an assistant turn carries beside its answer (REASONING_FIELDS), stripped; None if it has none."""
    text = next((message[k] for k in REASONING_FIELDS if isinstance(message.get(k), str) and message[k].strip()), None)
    return text.strip() if text else None


def _inline_reasoning(message: dict) -> str | None:
    """The reasoning an answer writes before "</think>" in its content (after any "<think>"), stripped; None if
    none."""
    content = message.get("content")
    if not isinstance(content, str) or "</think>" not in content:
        return None
    return content.split("</think>")[0].split("<think>")[-1].strip() or None


def _arguments_as_text(call):
    """An OpenAI-style tool call with its `arguments` object as JSON text (the form OpenAI writes); any other call
    as it is."""
    function = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(function, dict) or isinstance(function.get("arguments", ""), str):
        return call
    function = {**function, "arguments": json.dumps(function["arguments"], ensure_ascii=False)}
    return {**call, "function": function} if "function" in call else function


def _arguments_parsed(call):
    """An OpenAI-style tool call whose `arguments` is a JSON string, with the object the string holds: templates
    write arguments with tojson (transformers' chat templates take them as a dict), which quotes a string
    ("parameters": "{\\"a\\": 1}" under Llama 3.1's, Qwen2.5's). Any other call as it is."""
    function = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        function = {**function, "arguments": json.loads(function["arguments"])}
    except ValueError:
        return call  # kept as the string it is
    return {**call, "function": function} if "function" in call else function


class Encoder:
    """Example -> documents of (token ids, loss mask) under one tokenizer, template and settings."""

    def __init__(self, tokenizer, chat_template: str | dict[str, str] | None, *, max_seq_len: int, train_on: str,
                 overlong: str):
        self.sets = chat_template  # as given, for the workers that build their own (_init_worker)
        self.tool_use: Encoder | None = None
        if isinstance(chat_template, dict):
            # named template sets: as transformers' apply_chat_template picks, `tool_use` renders the records that
            # have tools (this encoder hands them to self.tool_use), `default` the others
            if "default" not in chat_template:
                raise ValueError(f"the tokenizer's chat templates are named {sorted(chat_template)}, none of them "
                                 "'default'; set data.chat_template to the one to train with")
            if "tool_use" in chat_template:
                self.tool_use = Encoder(tokenizer, chat_template["tool_use"], max_seq_len=max_seq_len,
                                        train_on=train_on, overlong=overlong)
            chat_template = chat_template["default"]
        self.tok, self.template = tokenizer, chat_template
        self.max_seq_len, self.train_on, self.overlong = max_seq_len, train_on, overlong
        self.special = np.zeros(len(tokenizer), bool)  # token id -> is a special (added) token
        self.special[[i for i, t in tokenizer.added_tokens_decoder.items() if t.special and i < len(tokenizer)]] = True
        self.special[[i for i in tokenizer.all_special_ids if i is not None and i < len(tokenizer)]] = True
        texts = sorted(set(tokenizer.all_special_tokens) | {t.content for t in tokenizer.added_tokens_decoder.values()
                                                           if t.special}, key=len, reverse=True)
        self.special_text = re.compile("|".join(map(re.escape, texts)) or "(?!)")  # (?!) matches nothing
        self.longest_special = max(map(len, texts), default=0)
        template = chat_template or ""
        self.renders_tools = "tools" in template
        self.renders_tool_calls = "tool_calls" in template

    def render(self, messages: list[dict], tools: list | None, add_generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(messages, tools=tools, chat_template=self.template, tokenize=False,
                                            add_generation_prompt=add_generation_prompt)

    def _for_template(self, m: dict) -> dict:
        """A tool call as the template expects it: OpenAI-style `tool_calls` (arguments as an object) when it renders
        those, else the turn's text. A template that never mentions `tool_calls` drops them: an assistant turn of calls alone would train an
        empty answer, so its calls become its content, one JSON object {"name", "arguments"} a line (the form of
        the is_tool_call turns of ShareGPT/glaive data), after any text it has. Calls the template renders keep
        their place, with a null content as "" and JSON-string arguments parsed."""
        if m.get("tool_calls") and not self.renders_tool_calls:
            calls = [json.dumps(_name_and_arguments(call), ensure_ascii=False) for call in m["tool_calls"]]
            text = "\n".join(([m["content"]] if m.get("content") else []) + calls)
            return {**{k: v for k, v in m.items() if k != "tool_calls"}, "content": text}
        if m.get("tool_calls") and self.renders_tool_calls and isinstance(m["tool_calls"], list):
            # content null beside calls as OpenAI writes it, or "" where the template needs text (template_messages)
            return {**m, "tool_calls": [_arguments_parsed(call) for call in m["tool_calls"]]}
        if not (m.get("is_tool_call") and self.renders_tool_calls and "tool_calls" not in m):
            return m
        try:
            call = json.loads(m["content"])
        except (TypeError, ValueError):
            return m
        if not isinstance(call, dict) or "name" not in call:
            return m
        function = {"name": call["name"], "arguments": call.get("arguments", call.get("parameters", {}))}
        return {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": function}]}

    def template_messages(self, messages: list[dict], tools: list | None) -> list[dict]:
        """The messages as this template renders them (_for_template), tool calls in the first form it renders
        without failing: a call's content null (OpenAI's) or "" (Qwen3's template reads `'</think>' in content`),
        its arguments an object (written with tojson: Llama 3.1, Qwen2.5) or JSON text (concatenated:
        DeepSeek-R1's `+ tool['function']['arguments'] +`). Null before "": DeepSeek-R1-Distill-Llama's renders a
        call only where content is none, and an empty answer in its place for "". Where every form fails, the
        first, whose error the record's template_error gives."""
        messages = [self._for_template(m) for m in messages]
        calls = [i for i, m in enumerate(messages) if m.get("tool_calls") and isinstance(m["tool_calls"], list)]
        if not calls or not self.renders_tool_calls:
            return messages
        forms = [(text, empty) for empty in (False, True) for text in (False, True)]
        for text, empty in forms:
            form = list(messages)
            for i in calls:
                m = form[i]
                if empty:
                    m = {**m, "content": m.get("content") or ""}
                if text:
                    m = {**m, "tool_calls": [_arguments_as_text(call) for call in m["tool_calls"]]}
                form[i] = m
            try:
                self.render(form, tools, False)
            except Exception:
                continue
            return form
        return messages

    def chat_text(self, ex: Example, counts: Counter) -> tuple[str, list[tuple[int, int]] | None]:
        """The rendered conversation and the character spans of the assistant turns to train
        (None: train on every token)."""
        if self.template is None:
            raise ValueError(f"{ex.where}: the tokenizer has no chat template (a base model's); set data.chat_template "
                             f"to the one the model is to learn: one of {sorted(TEMPLATES)}, inline Jinja or a .jinja "
                             "file (format text needs none)")
        if ex.tools and self.tool_use is not None:
            return self.tool_use.chat_text(ex, counts)
        tools = ex.tools or None
        if tools and not self.renders_tools:
            counts["tools_not_rendered"] += 1
            tools = None
        messages = self.template_messages(ex.messages, tools)
        if not self.renders_tool_calls and any(m.get("tool_calls") for m in ex.messages):
            counts["tool_calls_as_text"] += 1
        answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        # OpenAI's weight 0: an answer left out of the loss (still in the conversation); last_assistant: the last
        # answer, when its weight lets it train
        turns = [i for i in (answers[-1:] if self.train_on == "last_assistant" else answers)
                 if messages[i].get("weight", 1) != 0]
        if self.train_on != "all" and not turns:
            raise RecordError(ex.where, "messages", NOTHING_TO_TRAIN,
                              "no assistant turn to train on" if not answers else
                              "every assistant turn to train has weight 0")
        # an empty answer trains its end-of-turn token alone: the model learns to answer with nothing
        empty = [i for i in turns if not (messages[i].get("content") or "").strip()
                 and not messages[i].get("tool_calls")]
        if empty and self.train_on != "all":
            raise RecordError(ex.where, f"messages[{empty[0]}].content", EMPTY_ANSWER,
                              "an empty assistant answer; training on it teaches the model to answer with nothing: "
                              "fill it in or remove the record")
        full = self._render(ex, messages, tools, False)
        # Mistral v0.3 writes the system message only into a last user turn, when prompting: not into a conversation
        # that ends in an answer
        system_lost = any(m["role"] == "system" and m.get("content") and m["content"].strip() not in full
                          for m in messages)
        # the last reasoning given: a template that renders any writes that one (Qwen3 leaves out the reasoning of
        # the turns before the last user turn, by design); Llama 3's and Mistral's write none
        # (or written into the answer, "<think>...</think>": DeepSeek-R1's templates drop it from every turn)
        reasoning = [r for m in messages if m["role"] == "assistant" for r in [_reasoning(m) or _inline_reasoning(m)]
                     if r]
        if reasoning and reasoning[-1] not in full:
            counts["reasoning_not_rendered"] += 1
        if self.train_on == "all":
            if system_lost:
                counts["system_not_rendered"] += 1
            return full, None
        prompts = {i: self._render(ex, messages[:i], tools, True) for i in turns}  # each turn's, rendered once
        located = {i: self._locate(ex, messages, tools, full, i, prompts[i]) for i in turns}
        unlocated = [(i, what) for i, what in located.items() if isinstance(what, str)]
        if unlocated and len(unlocated) < len(turns):
            # a turn not plain text (a tool call) whose prompt is in place: it ends at the first end-of-turn token
            # after its prompt, that token read off the last turn located (Qwen3's tool calls: <|im_end|>)
            last = max(i for i, span in located.items() if not isinstance(span, str))
            end_of_turn = self._end_of_turn(full, *located[last])
            for i, _ in unlocated:
                later = [span[0] for j, span in located.items() if j > i and not isinstance(span, str)]
                start = self._turn_start(ex, messages, tools, full, i, prompts[i])
                located[i] = self._to_end_of_turn(full, start, end_of_turn, min(later, default=len(full))) or located[i]
            unlocated = [(i, what) for i, what in located.items() if isinstance(what, str)]
        spans = [located[i] for i in turns]
        if unlocated:
            i, what = unlocated[0]
            fix = ("set data.chat_template" if unlocated[-1][0] == answers[-1] else "set train_on: last_assistant "
                   "to train the last answer only (this template renders it as a prefix), or set data.chat_template")
            raise RecordError(ex.where, "messages", NOT_A_PREFIX, (
                f"the chat template renders {what} as text that does not start the whole conversation's rendering, "
                f"so assistant turn messages[{i}] cannot be located (the template writes a turn differently once "
                "the conversation goes on, and neither the turn's text nor an end-of-turn token after its prompt "
                f"places it); {fix} to a template that renders each turn the same whatever follows"))
        for i, (s, e) in zip(turns, spans):
            # a template that takes no call in the form given writes an empty answer in its place (DeepSeek-R1-
            # Distill-Llama's renders calls only where content is none, a key transformers drops): never trained
            names = [c.get("function", c).get("name") for c in messages[i].get("tool_calls") or []
                     if isinstance(c, dict) and isinstance(c.get("function", c), dict)]
            if any(isinstance(n, str) and n not in full[s:e] for n in names):
                raise RecordError(ex.where, f"messages[{i}].tool_calls", CALLS_NOT_RENDERED,
                                  "the chat template writes nothing of this assistant turn's tool calls (it would "
                                  "train an empty answer in their place); set data.chat_template to one that "
                                  "renders tool calls, or remove the record")
        if system_lost:
            counts["system_not_rendered"] += 1
        return full, spans

    def _locate(self, ex: Example, messages: list[dict], tools: list | None, full: str, i: int,
                prompt: str) -> tuple[int, int] | str:
        """The character span of assistant turn i in `full`: from the end of its prompt (messages[:i] and the
        generation prompt) to the end of messages[:i + 1], less any text the template writes only at a
        conversation's end (Phi-3's eos_token after the last turn: later turns follow a turn without it, and the
        model ends its answer at <|end|>); where `full` does not start with either rendering, which one. `prompt`:
        messages[:i] rendered with the generation prompt."""
        if not full.startswith(prompt):
            return (self._marked_span(ex, messages, tools, full, i)
                    or f"the prompt of messages[{i}] (messages[:{i}] and the generation prompt)")
        last = i == len(messages) - 1
        upto = full if last else self._render(ex, messages[: i + 1], tools, False)
        end = len(upto)
        if last or not full.startswith(upto):
            try:  # the same conversation going on: the text it shares with `upto` is the turn's
                going_on = self.render(messages[: i + 1], tools, True)
            except Exception:  # a template that refuses a generation prompt after an answer: nothing is end-only
                going_on = upto
            if not going_on.startswith(upto):
                end = self._shared_prefix(upto, going_on)
        if end < len(prompt) or not full.startswith(upto[:end]):
            return self._marked_span(ex, messages, tools, full, i) or f"messages[:{i + 1}]"
        return len(prompt), end

    def _end_of_turn(self, full: str, start: int, end: int) -> str | None:
        """The text of the last special token in full[start:end], a located turn's end-of-turn token."""
        last = None
        for last in self.special_text.finditer(full, start, end):
            pass
        return last.group() if last else None

    def _turn_start(self, ex: Example, messages: list[dict], tools: list | None, full: str, i: int,
                    prompt: str) -> int | None:
        """Where turn i starts in `full`: the end of its `prompt` (messages[:i] and the generation prompt) where that
        is a prefix of `full`; else, where messages[:i] without it is, the end of the part of the generation prompt
        that `full` writes too, cut back to a special token's end or whitespace (QwQ's and DeepSeek-R1's generation
        prompts end in "<think>\n", which a conversation's turn has not: "<|im_start|>assistant\n" starts QwQ's
        tool call "<tool_call>", not its "<" alone); None where neither is."""
        if full.startswith(prompt):
            return len(prompt)
        before = self._render(ex, messages[:i], tools, False)
        if not (full.startswith(before) and prompt.startswith(before)):
            return None
        k = self._shared_prefix(full, prompt)
        while k > len(before) and not (full[k - 1].isspace() or any(
                m.end() == k for m in self.special_text.finditer(full, max(k - self.longest_special, 0), k))):
            k -= 1
        return k

    def _to_end_of_turn(self, full: str, start: int | None, end_of_turn: str | None,
                        before: int) -> tuple[int, int] | None:
        """A turn's span from `start` (_turn_start) to the end of the first `end_of_turn` after it, which must come
        before `before` (the next located turn's start)."""
        if not end_of_turn or start is None:
            return None
        at = full.find(end_of_turn, start)
        if at < 0 or at + len(end_of_turn) > before:
            return None
        return start, at + len(end_of_turn)

    def _marked_span(self, ex: Example, messages: list[dict], tools: list | None, full: str,
                     i: int) -> tuple[int, int] | None:
        """The span of assistant turn i in `full` where its prefixes do not render as prefixes of the whole (Qwen3
        writes an empty <think> block into the last turn only; Mistral v0.3 writes the system message into a last
        user turn only): the whole conversation rendered again with the turn's text replaced by a marker, whose
        text before and after the marker must start and end `full`; what lies between them is the turn's text as
        the template wrote it, and the span runs through the special token that closes the turn (after whitespace
        only). A space just before the text belongs to its first token (SentencePiece's "▁word": Mistral's
        "[/INST] "). None for a turn that is not plain text (tool calls: what follows its text is the call, not
        the end of the turn) or where the marker does not locate it."""
        message = messages[i]
        if message.get("tool_calls") or not isinstance(message.get("content"), str) or not message["content"]:
            return None
        try:
            marked = self.render([*messages[:i], {**message, "content": MARKER}, *messages[i + 1:]], tools, False)
        except Exception:  # the template refuses the marker where it took the text: not located
            return None
        head, found, tail = marked.partition(MARKER)
        if not found or MARKER in tail or not (full.startswith(head) and full.endswith(tail)) \
                or len(head) + len(tail) > len(full):
            return None
        end_of_turn = self.special_text.match(full, WHITESPACE.match(full, len(full) - len(tail)).end())
        if end_of_turn is None:
            return None
        return len(head) - head.endswith(" "), end_of_turn.end()

    def _shared_prefix(self, a: str, b: str) -> int:
        """The length of the longest common prefix of a and b, moved back to the start of a special token's text
        it would end inside (Phi-3's end-only "<|endoftext|>" and its generation prompt "<|assistant|>" share "<|")."""
        n = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        for m in self.special_text.finditer(a, max(n - self.longest_special, 0), n + self.longest_special):
            if m.start() < n < m.end():
                return m.start()
        return n

    def _render(self, ex: Example, messages: list[dict], tools: list | None, add_generation_prompt: bool) -> str:
        try:
            return self.render(messages, tools, add_generation_prompt)
        except Exception as e:  # jinja errors, the template's raise_exception() (e.g. roles must alternate)
            raise RecordError(ex.where, "messages", TEMPLATE_ERROR, f"the chat template failed: {e}") from None

    def mask_spans(self, ids: np.ndarray, starts: np.ndarray, spans: list[tuple[int, int]] | None) -> np.ndarray:
        """1 for the tokens that start inside a span, up to its last special token; None = all tokens."""
        if spans is None:
            return np.ones(len(ids), np.uint8)
        mask = np.zeros(len(ids), np.uint8)
        for s, e in spans:
            inside = np.flatnonzero((starts >= s) & (starts < e))
            if len(inside) == 0:
                continue
            special = np.flatnonzero(self.special[ids[inside]])
            end = inside[special[-1]] + 1 if len(special) else inside[-1] + 1  # through the end-of-turn token
            mask[inside[0]:end] = 1
        return mask

    def encode_chunk(self, items: list[Example | RecordError]) -> Chunk:
        errors: list[tuple[int, RecordError]] = []
        counts: Counter = Counter()
        groups: dict[int, str] = {}
        chats, texts, pieces = [], [], []
        for r, item in enumerate(items):
            if isinstance(item, Example) and item.group is not None:
                groups[r] = item.group
            if isinstance(item, Skipped):  # left out by the format itself: counted, never raised
                counts[f"dropped:{item.reason}"] += 1
            elif isinstance(item, RecordError):
                errors.append((r, item))
            elif item.text is not None:
                texts.append((r, item))
            elif item.segments is not None:
                pieces.append((r, item))
            else:
                try:
                    chats.append((r, item, *self.chat_text(item, counts)))
                except RecordError as e:
                    errors.append((r, e))
        out = Chunk(len(items), counts=counts, groups=groups)
        try:
            docs = self._tokenize_chats(chats) + self._tokenize_texts(texts) + self._tokenize_segments(pieces)
        except Exception:  # the Rust tokenizer refused some text, for the whole batch: find which record
            docs = []
            for one, tokenize_ in ([([c], self._tokenize_chats) for c in chats]
                                   + [([t], self._tokenize_texts) for t in texts]
                                   + [([p], self._tokenize_segments) for p in pieces]):
                try:
                    docs += tokenize_(one)
                except Exception as e:  # e.g. "WordLevel error: Missing [UNK] token from the vocabulary"
                    r, ex = one[0][0], one[0][1]
                    errors.append((r, RecordError(ex.where, None, UNENCODABLE, self._unencodable(ex, e))))
        for r, ex, ids, mask in sorted(docs, key=lambda d: d[0]):
            if not mask[1:].any():  # position 0 is never predicted
                errors.append((r, RecordError(ex.where, "messages", NOTHING_TO_TRAIN,
                                              "no token left to train on after masking")))
                continue
            pieces, status = self.fit(ids, mask, is_text=ex.text is not None)
            counts[status] += 1
            for piece_ids, piece_mask in pieces:
                out.add(piece_ids, piece_mask, r)
        out.errors = [e for _, e in sorted(errors, key=lambda x: x[0])]
        return out

    def _unencodable(self, ex: Example, error: Exception) -> str:
        """What the tokenizer cannot encode in `ex`: the first few characters it refuses on their own."""
        text = text_of(ex)
        bad = []
        for c in sorted(set(text)):
            try:
                self.tok(c, add_special_tokens=False)
            except Exception:
                bad.append(c)
                if len(bad) == 5:
                    break
        chars = ", ".join(f"{c!r} (U+{ord(c):04X})" for c in bad) or "a character sequence"
        return (f"the tokenizer cannot encode {chars} ({error}); remove or replace them, or use a tokenizer "
                "with an unknown token or byte fallback")

    def _tokenize_chats(self, chats: list[tuple]) -> list[tuple]:
        """(record, example, text, spans) -> (record, example, ids, mask), in one batched tokenizer call
        (the Rust tokenizer's per-call overhead is paid once per chunk)."""
        if not chats:
            return []
        # Each conversation is tokenized in pieces cut where a trained span starts, as inference
        # sees it: the prompt up to the generation prompt on its own, the answer's tokens after it.
        # So no token holds both prompt and answer text (in one piece, ChatML's "assistant\n"
        # followed by an answer that starts with "\n" would merge into a single "\n\n" token).
        pieces, owners = [], []
        for c, (_, _, text, spans) in enumerate(chats):
            cuts = sorted({0, *(start for start, _ in spans or [])}) + [len(text)]
            for a, b in zip(cuts, cuts[1:]):
                if b > a:
                    pieces.append(text[a:b])
                    owners.append((c, a))
        enc = self.tok(pieces, add_special_tokens=False, return_offsets_mapping=True)
        parts: list[tuple[list, list]] = [([], []) for _ in chats]
        for (c, a), ids, offsets in zip(owners, enc["input_ids"], enc["offset_mapping"]):
            parts[c][0].append(np.asarray(ids, np.int32))
            parts[c][1].append(a + np.asarray(offsets, np.int64).reshape(-1, 2)[:, 0])
        docs = []
        for (r, ex, _, spans), (ids, starts) in zip(chats, parts):
            ids = np.concatenate(ids) if ids else np.zeros(0, np.int32)
            starts = np.concatenate(starts) if starts else np.zeros(0, np.int64)
            docs.append((r, ex, ids, self.mask_spans(ids, starts, spans)))
        return docs

    def _tokenize_texts(self, texts: list[tuple]) -> list[tuple]:
        """(record, example) -> (record, example, ids, mask): bos, the text, eos; every token trained."""
        if not texts:
            return []
        enc = self.tok([ex.text for _, ex in texts], add_special_tokens=False)
        bos = [self.tok.bos_token_id] if self.tok.bos_token_id is not None else []
        eos = [self.tok.eos_token_id] if self.tok.eos_token_id is not None else []
        return [(r, ex, np.asarray(bos + ids + eos, np.int32), np.ones(len(ids) + len(bos) + len(eos), np.uint8))
                for (r, ex), ids in zip(texts, enc["input_ids"])]

    def _tokenize_segments(self, pieces: list[tuple]) -> list[tuple]:
        """(record, example) -> (record, example, ids, mask) for format segments, as Axolotl's input_output
        (prompt_strategies/input_output.py) tokenizes them: each piece's text on its own, without special tokens
        added, the pieces' ids concatenated; trained where the piece's label is (every token under train_on all)."""
        if not pieces:
            return []
        flat = [(text, trained) for _, ex in pieces for text, trained in ex.segments]
        enc = self.tok([text for text, _ in flat], add_special_tokens=False)["input_ids"] if flat else []
        docs, k = [], 0
        for r, ex in pieces:
            ids, mask = [], []
            for (_, trained), piece in zip(ex.segments, enc[k:k + len(ex.segments)]):
                ids += piece
                mask += [int(trained or self.train_on == "all")] * len(piece)
            k += len(ex.segments)
            docs.append((r, ex, np.asarray(ids, np.int32), np.asarray(mask, np.uint8)))
        return docs

    def fit(self, ids: np.ndarray, mask: np.ndarray, is_text: bool) -> tuple[list, str]:
        """Apply data.overlong: the documents to keep and the record's status."""
        n, cap = len(ids), self.max_seq_len
        if n <= cap:
            return [(ids, mask)], "kept"
        if self.overlong == "drop":
            return [], f"dropped:{OVERLONG}"
        if self.overlong == "split" and is_text:
            return [(ids[i:i + cap], mask[i:i + cap]) for i in range(0, n, cap)], "split"
        if not mask[1:cap].any():
            return [], f"dropped:{TRUNCATED_AWAY}"
        return [(ids[:cap], mask[:cap])], "truncated"


# ---------------------------------------------------------------------------------------------
# worker processes

CGROUP = Path("/sys/fs/cgroup")


def available_cpus(cgroup: Path = CGROUP) -> int:
    """The CPUs this process can keep busy, the default count of tokenizer workers: its affinity mask, capped by
    its cgroup's CPU quota rounded up. A container's CPU limit (Kubernetes' resources.limits.cpu, docker --cpus) is
    such a quota, and neither os.cpu_count() nor the affinity sees it: 16 workers under a 4-CPU quota share 4 CPUs'
    time and each runs a quarter of the time."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup)
    return max(1, min(cpus, math.ceil(quota))) if quota else cpus


def cgroup_cpu_quota(cgroup: Path = CGROUP) -> float | None:
    """CPUs' worth of time per period this process's cgroup allows (quota / period), or None where there is no
    limit or none can be read. cgroup v2: cpu.max ("max 100000" unlimited, "400000 100000" 4 CPUs) of the group
    /proc/self/cgroup names ("0::/PATH"), else of the mount's root (a container's own group); v1:
    cpu/cpu.cfs_quota_us over cpu/cpu.cfs_period_us (quota -1 unlimited)."""
    try:
        groups = [line.split(":", 2)[2].strip() for line in Path("/proc/self/cgroup").read_text().splitlines()
                  if line.startswith("0::")]
    except OSError:
        groups = []
    for folder in [cgroup / g.lstrip("/") for g in groups] + [cgroup]:
        try:
            quota, period = (folder / "cpu.max").read_text().split()[:2]
        except (OSError, ValueError):
            continue
        return None if quota == "max" or int(period) <= 0 else int(quota) / int(period)
    try:
        quota = int((cgroup / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((cgroup / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None

_WORKER_ENCODER: Encoder | None = None  # set once per worker process by _init_worker
# The workers' CPU priority, added to the parent's (nice +10: about a tenth of a CPU's share against a process at
# the parent's priority, Linux CFS weights 110 against 1,024). gapless train tokenizes beside the model's loading
# and the layers' first compile (gapless.train.loop.DataBeside), which are on start-up's critical path where the
# data is not: on a 16-core H100 machine 16 workers took 21-56 s of cold data beside a 10-24 s load that reads alone
# in 4-5 s (runs s19-startup2, s20-startup2). With the CPUs to themselves they run as fast as at the parent's.
WORKER_NICE = 10


def _init_worker(encoder: Encoder | tuple) -> None:
    """Forked workers inherit the parent's Encoder; spawned ones build theirs from (folder, template, settings).
    Each lowers its CPU priority by WORKER_NICE first (where the OS has nice)."""
    global _WORKER_ENCODER
    if hasattr(os, "nice"):
        os.nice(WORKER_NICE)
    if isinstance(encoder, tuple):
        folder, template, settings = encoder
        encoder = Encoder(load_tokenizer(folder), template, **settings)
    _WORKER_ENCODER = encoder


def _encode_in_worker(items: list) -> Chunk:
    return _WORKER_ENCODER.encode_chunk(items)


class Tokenizing:
    """Runs Encoder.encode_chunk over chunks, in this process or a pool of worker processes.

    The tokenizer loads on the first cache miss (a run whose sources are all cached never loads it).
    The pool starts on the first source of two chunks or more and serves every later source of the
    run. Workers are forked where the OS can (as torch's DataLoader does), so they start at once
    with the tokenizer already loaded; spawning instead costs ~5 s per worker to import transformers.

    The pool is concurrent.futures' ProcessPoolExecutor, fed at most 2 chunks per worker ahead of the
    reader (memory stays bounded whatever the source's size). An exception in a worker comes back with
    its chunk's result and ends the pool; a worker that dies (killed, out of memory) breaks the pool
    at once (BrokenProcessPool), where multiprocessing.Pool's imap waits forever for the lost result.
    (Pool.terminate after a worker raised also hung, once in 20 tries, for over 10 minutes at 0% CPU:
    its shutdown takes the task queue's read lock, which an idle worker blocked in recv() holds.)
    """

    def __init__(self, tokenizer_dir: Path, chat_template: str | dict[str, str] | None, settings: dict,
                 num_workers: int):
        self.folder, self.chat_template, self.settings = tokenizer_dir, chat_template, settings
        self.num_workers = num_workers
        self.pool: ProcessPoolExecutor | None = None
        self._local: Encoder | None = None

    @property
    def local(self) -> Encoder:
        if self._local is None:
            tokenizer = load_tokenizer(self.folder)
            template = self.chat_template if self.chat_template is not None else tokenizer_template(tokenizer)
            self._local = Encoder(tokenizer, template, **self.settings)
        return self._local

    def map(self, chunks: Iterator[list]) -> Iterator[Chunk]:
        head = list(itertools.islice(chunks, 2))
        if self.num_workers <= 1 or len(head) < 2:
            return map(self.local.encode_chunk, itertools.chain(head, chunks))
        if self.pool is None:
            fork = "fork" in multiprocessing.get_all_start_methods()
            # The processes are the parallelism: keep the Rust tokenizer single-threaded in each, and
            # setting the variable before forking also silences its "forked after parallelism" notice.
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
            context = multiprocessing.get_context("fork" if fork else "spawn")
            args = self.local if fork else (str(self.folder), self.local.sets, self.settings)
            self.pool = ProcessPoolExecutor(self.num_workers, mp_context=context, initializer=_init_worker,
                                            initargs=(args,))
        return self._in_order(itertools.chain(head, chunks))

    def _in_order(self, chunks: Iterator[list]) -> Iterator[Chunk]:
        ahead: deque[Future] = deque()
        try:
            for chunk in chunks:
                ahead.append(self.pool.submit(_encode_in_worker, chunk))
                if len(ahead) >= 2 * self.num_workers:
                    yield ahead.popleft().result()
            while ahead:
                yield ahead.popleft().result()
        except BrokenProcessPool:
            raise RuntimeError(f"a tokenizer worker process died (killed, or out of memory) while tokenizing "
                               f"with the tokenizer in {self.folder}; set data.num_workers: 0 to tokenize in "
                               "this process and see the error") from None
        finally:
            for future in ahead:
                future.cancel()

    def close(self) -> None:
        """End the pool: the chunks in flight are dropped, the workers ended (killed after 5 s)."""
        if self.pool is None:
            return
        processes = list(getattr(self.pool, "_processes", {}).values())  # to end them when the pool did not
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.pool = None
        deadline = time.monotonic() + 5.0
        for p in processes:
            p.join(timeout=max(deadline - time.monotonic(), 0.0))
            if p.is_alive():
                p.kill()
                p.join()


def chunked(records: Iterator[Example | RecordError]) -> Iterator[list]:
    chunk, chars = [], 0
    for item in records:
        chunk.append(item)
        if isinstance(item, Example):
            chars += len(text_of(item))
        if len(chunk) == CHUNK or chars >= CHUNK_CHARS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk
