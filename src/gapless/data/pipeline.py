"""The data pipeline of a run: read every source, tokenize what the cache lacks (gapless.data.tokenize, in
worker processes), split off eval data, mix the sources (gapless.data.batching) and summarize it all
(gapless.data.summary). `build_data` is what a run calls; `inspect` is the body of `gapless data`.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import time
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gapless.config import DataConfig, SourceConfig
from gapless.data.batching import BatchSampler, Mixture
from gapless.data.cache import CacheWriter, FileHashes, TokenizedDataset, cache_key, clean_stale, lookup
from gapless.data.formats import DEFAULT_ROLES, read_source, resolve_files
from gapless.data.summary import MARK_CLOSE, MARK_OPEN, DataSummary, format_example, length_histogram
from gapless.data.tokenize import (OVERLONG, TOKENIZER_FILES, TRUNCATED_AWAY, Tokenizing, available_cpus, chunked,
                                   load_tokenizer, read_chat_template)


def tokenizer_fingerprint(folder: Path, hashes: FileHashes) -> dict:
    return {name: hashes(folder / name) for name in sorted(os.listdir(folder))
            if name in TOKENIZER_FILES or name.endswith(".jinja")}


def tokenize_source(src: SourceConfig, files: list[Path], tokenizing: Tokenizing, writer: CacheWriter,
                    on_error: str) -> dict:
    """Read and tokenize one source into the cache writer; returns its counts (stored in the cache's meta)."""
    counts: Counter = Counter()
    first_errors: list[str] = []
    base = tokens = target_tokens = 0
    first: dict[str, int] = {}  # a group key (Example.group) -> its first record, whose index names the group
    for chunk in tokenizing.map(chunked(read_source(src, files))):
        for e in chunk.errors:
            if on_error == "raise":
                raise ValueError(f"{e} (set data.on_error: skip to skip and count such records)")
            counts[f"dropped:{e.reason}"] += 1
            if len(first_errors) < 5:
                first_errors.append(str(e))
        counts.update(chunk.counts)
        records = base + np.asarray(chunk.records, np.int64)
        leads = {r: first.setdefault(key, base + r) for r, key in chunk.groups.items()}  # a tree may span chunks
        groups = np.asarray([leads.get(r, base + r) for r in chunk.records], np.int64)
        writer.add(chunk.ids, chunk.mask, records, groups)
        base += chunk.num_records
        tokens += sum(len(x) for x in chunk.ids)
        target_tokens += sum(int(m[1:].sum()) for m in chunk.mask)  # a document's first token is never a target
    return {"records": base, "counts": dict(counts), "first_errors": first_errors, "tokens": tokens,
            "target_tokens": target_tokens}


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
                root: Path, vocab_size: int | None = None) -> SourceData:
    """One source from the cache or tokenized into it. A hit loads no tokenizer: importing transformers and
    parsing the tokenizer took 4.9 of a warm start's 5.1 s of data on the CPU (the shared messages, Llama 3's
    tokenizer); the tokenizer's size, which check_vocab needs, is kept in the cache's meta.json."""
    t0 = time.perf_counter()
    files = resolve_files(src.path)
    key = cache_key({
        "files": [hashes(f) for f in files],
        "format": src.format, "columns": src.columns, "roles": {**DEFAULT_ROLES, **src.roles},
        "drop_system_message": src.drop_system_message,
        "tokenizer": tok_fp, "template": tokenizing.chat_template, "max_seq_len": cfg.max_seq_len,
        "train_on": cfg.train_on, "overlong": cfg.overlong, "on_error": cfg.on_error, "versions": _library_versions(),
    })
    dataset = lookup(root, key)
    if dataset is not None:
        # caches written before the size was kept load the tokenizer for it
        check_vocab(dataset.meta.get("tokenizer_tokens") or len(tokenizing.local.tok), vocab_size, tokenizing.folder)
        return SourceData(src, dataset, "hit", time.perf_counter() - t0)
    check_vocab(len(tokenizing.local.tok), vocab_size, tokenizing.folder)  # before anything is tokenized
    writer = CacheWriter(root, key)
    try:
        stats = tokenize_source(src, files, tokenizing, writer, cfg.on_error)
    except BaseException:
        writer.abort()
        raise
    meta = {"source": src.path, "files": [str(f) for f in files], "pad_id": _pad_id(tokenizing.local.tok),
            "tokenizer_tokens": len(tokenizing.local.tok), "seconds": time.perf_counter() - t0, **stats}
    return SourceData(src, writer.commit(meta), "miss", time.perf_counter() - t0)


def check_vocab(tokens: int, vocab_size: int | None, folder: Path) -> None:
    """A tokenizer with more tokens than the model's embedding rows is refused: its ids from vocab_size up would
    index past the embedding."""
    if vocab_size is not None and tokens > vocab_size:
        raise ValueError(f"data.tokenizer: the tokenizer in {folder} has {tokens:,} tokens, the model's embedding "
                         f"has {vocab_size:,} rows (config.json vocab_size): ids from {vocab_size:,} up would index "
                         "past it; use the model's own tokenizer")


def _pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


def _library_versions() -> dict:
    return {name: importlib.metadata.version(name) for name in ("transformers", "tokenizers")}


def split_eval(data: SourceData, fraction: float, seed: int) -> tuple[TokenizedDataset, TokenizedDataset]:
    """(train, eval): a seeded `fraction` of the source's groups held out, each group with all its documents.

    A group is a record, or the records a reader groups (Example.group: an OpenAssistant tree's threads, which share
    its prompt and earlier turns and would otherwise train on what the eval loss measures; a Self-Instruct row's
    instances, which share its instruction). The fraction counts groups, not records or documents: 0.3 of
    oasst_en100's 100 trees holds out 30, 154 to 178 of its 564 threads (27-32%) over seeds 0-4.
    A source without groups has groups == records, so its split is the one made by record before groups existed."""
    ds = data.dataset
    groups = ds.groups[ds.docs]
    unique = np.unique(groups)
    rng = np.random.default_rng([seed, len(unique), 0xE7A1])
    held = rng.choice(unique, size=int(round(fraction * len(unique))), replace=False)
    is_eval = np.isin(groups, held)
    return ds.subset(np.flatnonzero(~is_eval)), ds.subset(np.flatnonzero(is_eval))


def build_data(cfg: DataConfig, tokenizer_dir: str | Path | None = None, *, num_workers: int | None = None,
               vocab_size: int | None = None, allow_empty: bool = False):
    """Read, tokenize (or load from the cache) and mix the data of a run.

    Returns (train Mixture, eval Mixture or None, DataSummary). The tokenizer is data.tokenizer,
    else `tokenizer_dir` (the training loop passes the model folder). `vocab_size`: the model's embedding
    rows; a tokenizer with more tokens is refused before anything is tokenized (check_vocab). No training
    documents is an error (no_documents), unless `allow_empty` (`gapless data` prints the summary first).
    """
    folder = cfg.tokenizer or tokenizer_dir
    if folder is None:
        raise ValueError("data.tokenizer: not set, and no model folder to take the tokenizer from")
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise ValueError(f"data.tokenizer: {folder} is not a folder; give an HF tokenizer or model folder")
    root = Path(cfg.cache_dir).expanduser()
    clean_stale(root)  # the temporary folders of killed runs
    hashes = FileHashes(root)
    # the folder's own template is covered by the fingerprint of its files; a configured one by its text
    tok_fp = tokenizer_fingerprint(folder, hashes)
    settings = dict(max_seq_len=cfg.max_seq_len, train_on=cfg.train_on, overlong=cfg.overlong)
    workers = num_workers if num_workers is not None else cfg.num_workers
    if workers is None:
        workers = available_cpus()
    tokenizing = Tokenizing(folder, read_chat_template(cfg.chat_template), settings, workers)
    try:
        train = [load_source(s, cfg, tokenizing, tok_fp, hashes, root, vocab_size) for s in cfg.sources]
        evals = [load_source(s, cfg, tokenizing, tok_fp, hashes, root, vocab_size) for s in cfg.eval_sources]
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
    if not len(mix) and not allow_empty:
        raise ValueError(no_documents(summary))
    for message in summary.warnings:
        warnings.warn(message, stacklevel=2)
    return mix, eval_mix, summary


def no_documents(summary: DataSummary) -> str:
    """Why a run has no training documents, from its summary."""
    why = "; ".join(f"{r.name}: {r.records:,} records" + (f", dropped {r.dropped}" if r.dropped else "")
                    for r in summary.sources if not r.name.startswith("eval: "))
    too_long = sum(summary.dropped.get(k, 0) for k in (OVERLONG, TRUNCATED_AWAY))
    hint = (f"{too_long:,} records did not fit data.max_seq_len {summary.max_seq_len:,} (truncated_away: their "
            "answers lay past it), raise it" if too_long else "an empty file or folder gives no records")
    return f"data.sources: no training documents ({why}); {hint}, and `gapless data` shows what each source holds"


def inspect(cfg: DataConfig, *, as_json: bool = False, example: int = 0, histogram: bool = True) -> dict:
    """Build the data as a run would and print the summary, the histogram and one decoded example;
    with `as_json`, the last line printed is the summary as one JSON object."""
    with warnings.catch_warnings(record=True) as caught:  # shown once, below, not also as Python warnings
        warnings.simplefilter("always")
        mix, _, summary = build_data(cfg, allow_empty=True)  # the summary says why, before the error
    summary.warnings += [str(w.message) for w in caught if str(w.message) not in summary.warnings]
    print(summary.format())
    if histogram:
        print()
        print(length_histogram(mix.lengths))
    if not len(mix):
        raise ValueError(no_documents(summary))
    if not 0 <= example < len(mix):
        raise ValueError(f"--example: {example}; the data has {len(mix):,} documents, give 0 to {len(mix) - 1}")
    i = example
    ids, mask = mix.doc(i)
    tokenizer = load_tokenizer(cfg.tokenizer)
    print(f"\nexample {i} ({len(ids):,} tokens, {int(mask[1:].sum()):,} trained, "
          f"trained text between {MARK_OPEN} {MARK_CLOSE}):")
    print(format_example(np.asarray(ids), np.asarray(mask), tokenizer))
    out = summary.to_dict()
    if as_json:
        print(json.dumps(out))
    return out

