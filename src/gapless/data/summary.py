"""What a run's data is: the summary every run prints, a length histogram, and a decoded example
with the trained tokens marked, so a user sees what the model will learn before spending GPU hours.
`gapless data` prints them (gapless.data.pipeline.inspect).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from gapless.config import DataConfig, apply_overrides, from_dict, read_yaml

MARK_OPEN, MARK_CLOSE = "«", "»"  # around trained text in a decoded example


@dataclass
class SourceSummary:
    name: str
    files: int
    cache: str  # hit or miss
    seconds: float
    records: int  # read, bad ones included
    kept: int  # records that gave at least one document
    truncated: int
    split: int
    dropped: dict[str, int]  # by reason: reading errors, nothing_to_train, overlong, ...
    docs: int
    tokens: int
    target_tokens: int  # tokens with a loss (the next-token targets of trained tokens)
    first_errors: list[str]  # the first few skipped records, file:line and why
    tools_not_rendered: int  # records whose tool definitions the chat template leaves out
    tool_calls_as_text: int  # records whose OpenAI-style tool_calls are trained as JSON text (the template has none)
    system_not_rendered: int = 0  # records whose system message the chat template leaves out of the conversation
    reasoning_not_rendered: int = 0  # records whose assistant reasoning (reasoning_content) the template leaves out


@dataclass
class DataSummary:
    sources: list[SourceSummary]
    records: int
    kept: int
    truncated: int
    dropped: dict[str, int]
    tokens: int
    target_tokens: int
    train_docs: int  # per epoch, after mixing (repeats counted)
    train_tokens: int
    eval_docs: int
    eval_tokens: int
    batching: str
    max_seq_len: int
    tokens_per_batch: int
    rows_per_batch: int | None  # documents per batch at most (padded strategies); None: as many as fit
    batches_per_epoch: int
    packing_efficiency: float  # real tokens / slots over epoch 0
    tokenize_seconds: float
    warnings: list[str] = field(default_factory=list)

    @classmethod
    def build(cls, cfg: DataConfig, train: list, evals: list, mix, eval_mix, sampler) -> DataSummary:
        """From the SourceData of the train and eval sources, the mixtures and the train sampler."""
        rows = []
        for s, is_eval in [(s, False) for s in train] + [(s, True) for s in evals]:
            meta = s.dataset.meta
            counts = meta["counts"]
            dropped = {k.split(":", 1)[1]: v for k, v in counts.items() if k.startswith("dropped:")}
            rows.append(SourceSummary(
                name=f"eval: {s.name}" if is_eval else s.name, files=len(meta["files"]), cache=s.cache,
                seconds=round(s.seconds, 3), records=meta["records"],
                kept=counts.get("kept", 0) + counts.get("truncated", 0) + counts.get("split", 0),
                truncated=counts.get("truncated", 0), split=counts.get("split", 0), dropped=dropped,
                docs=len(s.dataset), tokens=meta["tokens"], target_tokens=meta["target_tokens"],
                first_errors=meta["first_errors"], tools_not_rendered=counts.get("tools_not_rendered", 0),
                tool_calls_as_text=counts.get("tool_calls_as_text", 0),
                system_not_rendered=counts.get("system_not_rendered", 0),
                reasoning_not_rendered=counts.get("reasoning_not_rendered", 0)))
        dropped: dict[str, int] = {}
        for r in rows:
            for k, v in r.dropped.items():
                dropped[k] = dropped.get(k, 0) + v
        epoch = mix.epoch_docs(cfg.seed, 0)
        warnings = []
        for r in rows:
            if r.tools_not_rendered:
                warnings.append(f"{r.name}: {r.tools_not_rendered} records have tool definitions that the chat "
                                "template does not render (it never mentions `tools`); they are left out")
            if r.tool_calls_as_text:
                warnings.append(f"{r.name}: {r.tool_calls_as_text} records have tool_calls that the chat template "
                                "does not render (it never mentions `tool_calls`); each call is trained as a JSON "
                                'line {"name", "arguments"} in its assistant turn')
            if r.system_not_rendered:
                warnings.append(f"{r.name}: {r.system_not_rendered} records have a system message that the chat "
                                "template leaves out of a conversation ending in an answer (Mistral v0.3 writes it "
                                "only into a last user turn, when prompting); they are trained without it")
            if r.reasoning_not_rendered:
                warnings.append(f"{r.name}: {r.reasoning_not_rendered} records have assistant reasoning "
                                "(reasoning_content, thinking or reasoning beside the answer) that the chat template "
                                "does not render; their answers are trained without it (set data.chat_template to one "
                                "that writes it, or put it into the answer's content)")
            if cfg.overlong == "split" and r.truncated:
                warnings.append(f"{r.name}: overlong=split applies to plain text; {r.truncated} longer "
                                "conversations were truncated")
        for name, n, k in zip(mix.names, [len(d) for d in mix.datasets], mix.counts):
            if n and not k:
                warnings.append(f"{name}: its weight gives it no documents per epoch; it is not trained on")
        return cls(
            sources=rows, records=sum(r.records for r in rows), kept=sum(r.kept for r in rows),
            truncated=sum(r.truncated for r in rows), dropped=dropped, tokens=sum(r.tokens for r in rows),
            target_tokens=sum(r.target_tokens for r in rows), train_docs=len(epoch),
            train_tokens=int(mix.lengths[epoch].sum()), eval_docs=len(eval_mix) if eval_mix else 0,
            eval_tokens=int(eval_mix.lengths.sum()) if eval_mix else 0, batching=cfg.batching,
            max_seq_len=cfg.max_seq_len, tokens_per_batch=cfg.tokens_per_batch, rows_per_batch=cfg.rows_per_batch,
            batches_per_epoch=sampler.batches_per_epoch(0) if len(mix) else 0,
            packing_efficiency=round(sampler.efficiency(0), 5) if len(mix) else 0.0,
            tokenize_seconds=round(sum(r.seconds for r in rows if r.cache == "miss"), 3), warnings=warnings)

    def to_dict(self) -> dict:
        return asdict(self)

    def format(self) -> str:
        head = f"{'source':<40} {'records':>8} {'kept':>8} {'trunc':>6} {'dropped':>7} {'docs':>8} " \
               f"{'tokens':>11} {'trained':>11}  cache"
        lines = [head]
        for r in self.sources:
            name = r.name if len(r.name) <= 40 else "..." + r.name[-37:]
            lines.append(f"{name:<40} {r.records:>8,} {r.kept:>8,} {r.truncated:>6,} {sum(r.dropped.values()):>7,} "
                         f"{r.docs:>8,} {r.tokens:>11,} {r.target_tokens:>11,}  {r.cache} {r.seconds:.1f}s")
        lines.append(f"{'total':<40} {self.records:>8,} {self.kept:>8,} {self.truncated:>6,} "
                     f"{sum(self.dropped.values()):>7,} {sum(r.docs for r in self.sources):>8,} "
                     f"{self.tokens:>11,} {self.target_tokens:>11,}")
        if self.dropped:
            lines.append("dropped by reason: " + ", ".join(f"{k} {v:,}" for k, v in sorted(self.dropped.items())))
        errors = [e for r in self.sources for e in r.first_errors][:5]
        if errors:
            lines.append("first skipped records:")
            lines += [f"  {e}" for e in errors]
        lines.append(f"train: {self.train_docs:,} documents, {self.train_tokens:,} tokens per epoch; "
                     f"{self.batches_per_epoch:,} batches of {'' if self.batching == 'packed' else 'up to '}"
                     + (f"{self.rows_per_batch:,} documents in up to " if self.rows_per_batch else "")
                     + f"{self.tokens_per_batch:,} slots ({self.batching}, "
                     f"max_seq_len {self.max_seq_len:,})")
        lines.append(f"packing efficiency: {100 * self.packing_efficiency:.2f}% (real tokens / slots)")
        if self.eval_docs:
            lines.append(f"eval: {self.eval_docs:,} documents, {self.eval_tokens:,} tokens")
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def length_histogram(lengths: np.ndarray, width: int = 40) -> str:
    """Document lengths in power-of-two bins, one line each."""
    if len(lengths) == 0:
        return "(no documents)"
    top = max(4, math.ceil(math.log2(int(lengths.max()) + 1)))
    edges = np.array([0] + [2 ** k for k in range(4, top + 1)])  # the last edge exceeds the longest document
    counts = np.bincount(np.searchsorted(edges, lengths, side="right") - 1, minlength=len(edges) - 1)
    peak = int(counts.max())
    lines = ["document length (tokens)   documents"]
    for lo, hi, n in zip(edges, edges[1:], counts):
        lines.append(f"{lo:>6,} - {hi - 1:>6,}  {int(n):>9,}  {'#' * math.ceil(width * int(n) / peak)}")
    return "\n".join(lines)


def format_example(ids: np.ndarray, mask: np.ndarray, tokenizer, max_prompt_chars: int = 600) -> str:
    """The document decoded, trained text «marked»; long untrained stretches are shortened."""
    out = []
    edges = np.flatnonzero(np.diff(mask.astype(np.int8))) + 1
    for part_ids, part_mask in zip(np.split(ids, edges), np.split(mask, edges)):
        text = tokenizer.decode(part_ids.tolist(), skip_special_tokens=False)
        if part_mask[0]:
            out.append(f"{MARK_OPEN}{text}{MARK_CLOSE}")
        elif len(text) > max_prompt_chars:
            half = max_prompt_chars // 2
            out.append(f"{text[:half]}[... {len(text) - 2 * half:,} characters ...]{text[-half:]}")
        else:
            out.append(text)
    return "".join(out)


def data_config_from_inputs(inputs: list[str], *, tokenizer: str | None = None, overrides: list[str] = (),
                            format: str = "auto") -> DataConfig:
    """`gapless data` arguments -> DataConfig: one YAML config (its `data:` section, or the whole
    file when it has none) with dotted key=value overrides as `gapless train` takes them, or data files that
    become one source each."""
    model_path = None
    if inputs and Path(inputs[0]).suffix in (".yaml", ".yml"):
        for item in inputs[1:]:
            if "=" not in item:
                raise ValueError(f"{item}: not a key=value override of the config {inputs[0]}; give either a "
                                 "config (and overrides, e.g. data.max_seq_len=2048) or data files")
        raw = read_yaml(inputs[0])
        raw = apply_overrides(raw, inputs[1:])
        section = raw.get("data", raw)
        model = raw.get("model")
        if not section.get("tokenizer") and isinstance(model, dict) and isinstance(model.get("path"), str):
            section["tokenizer"] = model_path = model["path"]  # the tokenizer defaults to the model folder
    else:
        section = {"sources": [{"path": p, "format": format} for p in inputs]}
    if tokenizer:
        section["tokenizer"] = tokenizer
    apply_overrides(section, [o.removeprefix("data.") for o in overrides])
    cfg = from_dict(DataConfig, section, "data")
    if cfg.tokenizer is None:
        raise ValueError("data.tokenizer: not set; give --tokenizer DIR (an HF tokenizer or model folder)")
    if model_path and Path(cfg.tokenizer) == Path(model_path).expanduser() and not Path(cfg.tokenizer).is_dir():
        raise ValueError(f"model.path: {model_path} is not a folder, and the tokenizer defaults to the model folder; "
                         "give --tokenizer DIR (an HF tokenizer or model folder)")
    return cfg
