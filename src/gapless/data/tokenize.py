"""Tokenization: chat template + loss mask, done once in worker processes and cached on disk.

Masking works for any chat template, with no template strings written here. For each assistant
turn i the template renders the conversation up to turn i with the generation prompt, and up to
and including turn i; in the full rendering, the text between those two lengths is what the model
produces for that turn at inference. The text is tokenized in pieces cut where each such span
starts (so the prompt is tokenized as at inference, and no token holds both prompt and answer
text), with offsets. A token is trained when it starts inside a span, up to the span's last special
token (the end-of-turn: `<|eot_id|>` for Llama 3, `<|im_end|>` for ChatML): the end-of-turn token
is trained, the separator a template writes after it (ChatML's newline) is not.
This needs a template whose rendering of a prefix of the conversation is a prefix of the full
rendering; one that is not (e.g. one that drops earlier turns' reasoning) is reported, not guessed.

`build_data` is what a run calls: read every source, tokenize what the cache lacks, split off
eval data, mix the sources, and summarize it all.
"""
from __future__ import annotations

import importlib.metadata
import itertools
import json
import multiprocessing
import os
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gapless.config import DataConfig, SourceConfig
from gapless.data.cache import CacheWriter, FileHashes, TokenizedDataset, cache_key, lookup
from gapless.data.formats import DEFAULT_ROLES, Example, RecordError, read_source, resolve_files

# Reasons a record yields no document (besides the reading errors of gapless.data.formats).
NOTHING_TO_TRAIN, TEMPLATE_ERROR = "nothing_to_train", "template_error"
OVERLONG, TRUNCATED_AWAY = "overlong", "truncated_away"  # overlong=drop; truncation removed every trained token
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
        return AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"data.tokenizer: cannot load a tokenizer from {path}: {e}") from None


def read_chat_template(setting: str | None) -> str | None:
    """data.chat_template: inline Jinja, or the text of a .jinja file; None when not set."""
    if setting is None or "{" in setting:
        return setting
    path = Path(setting).expanduser()
    if not path.is_file():
        raise ValueError(f"data.chat_template: {setting!r} is neither a file nor a Jinja template")
    return path.read_text()


def tokenizer_template(tokenizer) -> str | None:
    """The tokenizer folder's own chat template (chat_template.jinja or tokenizer_config.json), if any."""
    template = tokenizer.chat_template
    return template.get("default") if isinstance(template, dict) else template


@dataclass
class Chunk:
    """The documents made from a run of records, concatenated, and what happened to each record."""
    num_records: int
    ids: list[np.ndarray] = field(default_factory=list)  # int32, per document
    mask: list[np.ndarray] = field(default_factory=list)  # uint8, per document
    records: list[int] = field(default_factory=list)  # per document: index of its record in the chunk
    counts: Counter = field(default_factory=Counter)  # kept, truncated, split, dropped:<reason>, tools_not_rendered
    errors: list[RecordError] = field(default_factory=list)  # bad records, in order

    def add(self, ids: np.ndarray, mask: np.ndarray, record: int) -> None:
        self.ids.append(ids)
        self.mask.append(mask)
        self.records.append(record)


class Encoder:
    """Example -> documents of (token ids, loss mask) under one tokenizer, template and settings."""

    def __init__(self, tokenizer, chat_template: str | None, *, max_seq_len: int, train_on: str, overlong: str):
        self.tok, self.template = tokenizer, chat_template
        self.max_seq_len, self.train_on, self.overlong = max_seq_len, train_on, overlong
        self.special = np.zeros(len(tokenizer), bool)  # token id -> is a special (added) token
        self.special[[i for i, t in tokenizer.added_tokens_decoder.items() if t.special and i < len(tokenizer)]] = True
        self.special[[i for i in tokenizer.all_special_ids if i is not None and i < len(tokenizer)]] = True
        template = chat_template or ""
        self.renders_tools = "tools" in template
        self.renders_tool_calls = "tool_calls" in template

    def render(self, messages: list[dict], tools: list | None, add_generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(messages, tools=tools, chat_template=self.template, tokenize=False,
                                            add_generation_prompt=add_generation_prompt)

    def _for_template(self, m: dict) -> dict:
        """A tool call as the template expects it: OpenAI-style `tool_calls` when it renders those."""
        if not (m.get("is_tool_call") and self.renders_tool_calls and "tool_calls" not in m):
            return m
        try:
            call = json.loads(m["content"])
        except (TypeError, ValueError):
            return m
        if not isinstance(call, dict) or "name" not in call:
            return m
        function = {"name": call["name"], "arguments": call.get("arguments", call.get("parameters", {}))}
        return {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": function}]}

    def chat_text(self, ex: Example, counts: Counter) -> tuple[str, list[tuple[int, int]] | None]:
        """The rendered conversation and the character spans of the assistant turns to train
        (None: train on every token)."""
        if self.template is None:
            raise ValueError(f"{ex.where}: the tokenizer has no chat template; set data.chat_template "
                             "(inline Jinja or a .jinja file)")
        messages = [self._for_template(m) for m in ex.messages]
        tools = ex.tools or None
        if tools and not self.renders_tools:
            counts["tools_not_rendered"] += 1
            tools = None
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if self.train_on != "all" and not turns:
            raise RecordError(ex.where, "messages", NOTHING_TO_TRAIN, "no assistant turn to train on")
        full = self._render(ex, messages, tools, False)
        if self.train_on == "all":
            return full, None
        spans = []
        for i in turns[-1:] if self.train_on == "last_assistant" else turns:
            start = len(self._render(ex, messages[:i], tools, True))
            upto = full if i == len(messages) - 1 else self._render(ex, messages[: i + 1], tools, False)
            if not (full.startswith(upto) and start <= len(upto) and full[:start] == upto[:start]):
                raise ValueError(f"{ex.where}: the chat template does not render messages[:{i + 1}] as a prefix "
                                 "of the whole conversation, so its assistant turns cannot be located; use a "
                                 "template whose rendering does not depend on later turns")
            spans.append((start, len(upto)))
        return full, spans

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
        chats, texts = [], []
        for r, item in enumerate(items):
            if isinstance(item, RecordError):
                errors.append((r, item))
            elif item.text is not None:
                texts.append((r, item))
            else:
                try:
                    chats.append((r, item, *self.chat_text(item, counts)))
                except RecordError as e:
                    errors.append((r, e))
        out = Chunk(len(items), counts=counts)
        for r, ex, ids, mask in sorted(self._tokenize_chats(chats) + self._tokenize_texts(texts), key=lambda d: d[0]):
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

_WORKER_ENCODER: Encoder | None = None  # set once per worker process by _init_worker


def _init_worker(encoder: Encoder | tuple) -> None:
    """Forked workers inherit the parent's Encoder; spawned ones build theirs from (folder, template, settings)."""
    global _WORKER_ENCODER
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
    """

    def __init__(self, tokenizer_dir: Path, chat_template: str | None, settings: dict, num_workers: int):
        self.folder, self.chat_template, self.settings = tokenizer_dir, chat_template, settings
        self.num_workers = num_workers
        self.pool = None
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
            args = self.local if fork else (str(self.folder), self.local.template, self.settings)
            self.pool = context.Pool(self.num_workers, _init_worker, (args,))
        return self.pool.imap(_encode_in_worker, itertools.chain(head, chunks))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()


def chunked(records: Iterator[Example | RecordError]) -> Iterator[list]:
    chunk, chars = [], 0
    for item in records:
        chunk.append(item)
        if isinstance(item, Example):
            chars += len(item.text) if item.text is not None else sum(len(m.get("content") or "") for m in item.messages)
        if len(chunk) == CHUNK or chars >= CHUNK_CHARS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def tokenizer_fingerprint(folder: Path, hashes: FileHashes) -> dict:
    return {name: hashes(folder / name) for name in sorted(os.listdir(folder))
            if name in TOKENIZER_FILES or name.endswith(".jinja")}


def tokenize_source(src: SourceConfig, files: list[Path], tokenizing: Tokenizing, writer: CacheWriter,
                    on_error: str) -> dict:
    """Read and tokenize one source into the cache writer; returns its counts (stored in the cache's meta)."""
    counts: Counter = Counter()
    first_errors: list[str] = []
    base = tokens = target_tokens = 0
    for chunk in tokenizing.map(chunked(read_source(src, files))):
        for e in chunk.errors:
            if on_error == "raise":
                raise ValueError(f"{e} (set data.on_error: skip to skip and count such records)")
            counts[f"dropped:{e.reason}"] += 1
            if len(first_errors) < 5:
                first_errors.append(str(e))
        counts.update(chunk.counts)
        writer.add(chunk.ids, chunk.mask, base + np.asarray(chunk.records, np.int64))
        base += chunk.num_records
        tokens += sum(len(x) for x in chunk.ids)
        target_tokens += sum(int(m[1:].sum()) for m in chunk.mask)  # a document's first token is never a target
    return {"records": base, "counts": dict(counts), "first_errors": first_errors, "tokens": tokens,
            "target_tokens": target_tokens}


# ---------------------------------------------------------------------------------------------
# the entry point of a run


@dataclass
class SourceData:
    """One source's tokenized documents and how they were made."""
    config: SourceConfig
    dataset: TokenizedDataset
    cache: str  # "hit" or "miss"
    seconds: float  # reading + tokenizing (miss) or opening (hit)

    @property
    def name(self) -> str:
        return self.config.name or self.config.path


def load_source(src: SourceConfig, cfg: DataConfig, tokenizing: Tokenizing, tok_fp: dict, hashes: FileHashes,
                root: Path) -> SourceData:
    t0 = time.perf_counter()
    files = resolve_files(src.path)
    key = cache_key({
        "files": [hashes(f) for f in files],
        "format": src.format, "columns": src.columns, "roles": {**DEFAULT_ROLES, **src.roles},
        "tokenizer": tok_fp, "template": tokenizing.chat_template, "max_seq_len": cfg.max_seq_len,
        "train_on": cfg.train_on, "overlong": cfg.overlong, "on_error": cfg.on_error, "versions": _library_versions(),
    })
    dataset = lookup(root, key)
    if dataset is not None:
        return SourceData(src, dataset, "hit", time.perf_counter() - t0)
    writer = CacheWriter(root, key)
    try:
        stats = tokenize_source(src, files, tokenizing, writer, cfg.on_error)
    except BaseException:
        writer.abort()
        raise
    meta = {"source": src.path, "files": [str(f) for f in files], "pad_id": _pad_id(tokenizing.local.tok),
            "seconds": time.perf_counter() - t0, **stats}
    return SourceData(src, writer.commit(meta), "miss", time.perf_counter() - t0)


def _pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


def _library_versions() -> dict:
    return {name: importlib.metadata.version(name) for name in ("transformers", "tokenizers")}


def split_eval(data: SourceData, fraction: float, seed: int) -> tuple[TokenizedDataset, TokenizedDataset]:
    """A seeded `fraction` of the source's records (all documents of a record go the same way)."""
    ds = data.dataset
    records = ds.records[ds.docs]
    unique = np.unique(records)
    rng = np.random.default_rng([seed, len(unique), 0xE7A1])
    held = rng.choice(unique, size=int(round(fraction * len(unique))), replace=False)
    is_eval = np.isin(records, held)
    return ds.subset(np.flatnonzero(~is_eval)), ds.subset(np.flatnonzero(is_eval))


def build_data(cfg: DataConfig, tokenizer_dir: str | Path | None = None, *, num_workers: int | None = None):
    """Read, tokenize (or load from the cache) and mix the data of a run.

    Returns (train Mixture, eval Mixture or None, DataSummary). The tokenizer is data.tokenizer,
    else `tokenizer_dir` (the training loop passes the model folder).
    """
    from gapless.data.batching import BatchSampler, Mixture
    from gapless.data.summary import DataSummary

    folder = cfg.tokenizer or tokenizer_dir
    if folder is None:
        raise ValueError("data.tokenizer: not set, and no model folder to take the tokenizer from")
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise ValueError(f"data.tokenizer: {folder} is not a folder; give an HF tokenizer or model folder")
    root = Path(cfg.cache_dir).expanduser()
    hashes = FileHashes(root)
    # the folder's own template is covered by the fingerprint of its files; a configured one by its text
    tok_fp = tokenizer_fingerprint(folder, hashes)
    settings = dict(max_seq_len=cfg.max_seq_len, train_on=cfg.train_on, overlong=cfg.overlong)
    workers = num_workers if num_workers is not None else cfg.num_workers
    if workers is None:
        workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    tokenizing = Tokenizing(folder, read_chat_template(cfg.chat_template), settings, workers)
    try:
        train = [load_source(s, cfg, tokenizing, tok_fp, hashes, root) for s in cfg.sources]
        evals = [load_source(s, cfg, tokenizing, tok_fp, hashes, root) for s in cfg.eval_sources]
    finally:
        tokenizing.close()
        hashes.save()
    train_sets = [d.dataset for d in train]
    eval_sets = [d.dataset for d in evals]
    if cfg.eval_fraction > 0:
        pairs = [split_eval(d, cfg.eval_fraction, cfg.seed) for d in train]
        train_sets, eval_sets = [p[0] for p in pairs], [p[1] for p in pairs]
    names = [d.name for d in train]
    mix = Mixture.from_config(train_sets, cfg.sources, names)
    eval_mix = Mixture(eval_sets, [len(d) for d in eval_sets], names if cfg.eval_fraction > 0
                       else [d.name for d in evals]) if eval_sets else None
    sampler = BatchSampler.from_config(cfg, mix)
    summary = DataSummary.build(cfg, train, evals, mix, eval_mix, sampler)
    for message in summary.warnings:
        warnings.warn(message, stacklevel=2)
    return mix, eval_mix, summary

