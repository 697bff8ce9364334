"""The one config schema: typed dataclasses that YAML maps onto one to one.

`load_config(path, overrides)` reads a YAML file, applies dotted `key=value` overrides and builds
the dataclasses; an unknown key, a wrong type or an impossible combination raises ValueError that
names the field (`data.sources[1].format`) and says what to do.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

# The linear projections a decoder layer of a supported family can hold (HF names), and LoRA's choices; which of
# them each family has is its entry's `projections` in gapless.model.families (all seven for every family so far:
# Llama, Mistral, Qwen and Gemma alike). Kept here because the config sits below model/ and validates
# lora.target_modules without building a model.
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# model.attn_backend's values besides auto: gapless.kernels.attention's backends (its backend_names(), held equal by
# tests/test_kernels_attention.py), named here so a config is checked without importing torch
ATTN_BACKENDS = ("fa4_op", "flex", "sdpa", "varlen")


# How a LoRA layer runs (gapless.kernels.lora, bench/RESULTS.md), each measured on the H200 in a compiled
# Llama-3.2-3B step at 16,384 tokens:
#   "grouped"    the plain formula with one A matmul for the layers that read the same input (q/k/v, gate/up):
#                each rank-r GEMM over the activations runs 4 times per layer instead of 7, forward and backward.
#                479.9 ms per step against 497.3 for "reference" (varlen attention), 449.7 against 471.9 with
#                flash-attn-4 (runs s3-grouped, s3-grouped2). With dropout, one mask per group (on CUDA with
#                triton drawn inside the fused A-matmul kernels, gapless.kernels.lora_dropout).
#   "reference"  the plain formula autograd differentiates, one layer at a time (PEFT's: a mask per projection).
# ("fused", the update inside the base GEMMs as one autograd.Function, measured slower, 518.7 ms against 501.2,
# and was removed.)
#   "concat"     the frozen projections and the A matrices of the layers that read the same input as ONE GEMM over
#                [W_1; ..; W_k; A_1; ..; A_k] (forward; dx likewise), so each activation is read once (the default from
#                run s12-default to s17).
#                33,683 against grouped's 33,142 real tok/s with flash-attn-4 on an H100, in one call (run
#                s12-default; 33,619 against 33,122 in s11's two calls); with varlen 498.8 against 506.6 ms of
#                kernels a step (run s12-prof). On an H200 (more bandwidth) the two are equal: 34,943 against
#                35,002 in one call (run s14-default). With its B matmuls moved inside its autograd.Function (so
#                backward writes each output gradient once): 34,734 against grouped's 33,306 on an H100 (run
#                s15-default, +4.3%). Where it cannot apply it runs another form with the same sums: under
#                dropout concat_b (the A rows would read dropout(x), the base rows x), under QLoRA (an NF4 base has
#                no rows to append to) and FSDP2 (each rank holds shards, not the whole projections) grouped.
#   "concat_b"   the default: for the layers that read the same input (q/k/v, gate/up), the B matrices inside the
#                base GEMM instead, along its input: x A^T as one rank-R GEMM, then [x, x A^T] [[W_1, s_1 B_1, 0 ..],
#                [W_2, 0, s_2 B_2 ..] ..]^T as ONE GEMM whose output is each layer's whole output (no rank-r B GEMM
#                writes an [N, out] product, no consumer reads one); o_proj and down_proj run concat. 35,172
#                against concat's 34,753 real tok/s on an H100 in one process (run s17-ab, +1.2%: forward 221 against
#                232 ms). It keeps dropout (only its rank-R GEMM reads dropout(x), one mask per group as grouped draws
#                it; the layers alone run the formula under it): 33,774 against grouped's 32,665 at dropout 0.05 in
#                one call (run s17, +3.4%). With the B matrices inside every layer too it ran 0.84% slower than
#                concat (run s16-ab: model.lora._b_inside says why). The same sums; QLoRA and FSDP2 run grouped.
LoraKernel = Literal["grouped", "reference", "concat", "concat_b"]
CONCAT_KERNELS = ("concat", "concat_b")  # the kernels over a concatenated buffer (gapless.model.lora)
# The metadata of a field that holds a filesystem path: from_dict expands a leading `~` in its value (YAML and a
# dotted override do not, as a shell would), once, so every reader of the config (the loader, the tokenizer, the run
# folder, its config.yaml) sees the same path. (chat_template is not one: inline Jinja, a path or a name, read where used.)
PATH = {"path": True}


@dataclass
class LoraConfig:
    r: int = 16  # the rank of each adapter (A: r x in, B: out x r)
    alpha: float = 32.0  # the update is scaled by alpha / r (alpha / sqrt(r) with use_rslora)
    dropout: float = 0.0  # dropout on the adapter's input in training, one mask per group (q/k/v, gate/up)
    # dropout drawn inside Triton kernels that store no mask (CUDA with triton; elsewhere torch's dropout): 32,419
    # against 31,534 real tokens/s and 46.9 against 56.9 GiB for Llama-3.2-3B at dropout 0.05 on an H100 (issue 18);
    # false = torch's nn.Dropout, which saves a bool mask per group for backward
    fused_dropout: bool = True
    target_modules: list[str] = field(default_factory=lambda: list(ALL_LINEAR))  # projections that get an adapter
    # rsLoRA scales by alpha / sqrt(r) instead of alpha / r (Kalajdzievski 2023)
    use_rslora: bool = False
    kernel: LoraKernel = "concat_b"  # how a LoRA layer runs: concat_b, concat, grouped or reference (LoraKernel)

    def validate(self, where: str = "lora") -> None:
        if self.r <= 0:
            raise ValueError(f"{where}.r: must be a positive integer, got {self.r}")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"{where}.alpha: must be a positive number, got {self.alpha}; the update is scaled by "
                             f"alpha / r (typical: alpha = 2 * r = {2 * self.r})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"{where}.dropout: must be in [0, 1), got {self.dropout}")
        unknown = sorted(set(self.target_modules) - set(ALL_LINEAR))
        if unknown or not self.target_modules:
            raise ValueError(f"{where}.target_modules: {unknown or 'empty list'} not supported; "
                             f"choose among {list(ALL_LINEAR)}")
        if self.kernel not in typing.get_args(LoraKernel):
            raise ValueError(f"{where}.kernel: {self.kernel!r} is not one of {list(typing.get_args(LoraKernel))}")

    @property
    def scaling(self) -> float:
        return self.alpha / (self.r ** 0.5 if self.use_rslora else self.r)


# ---------------------------------------------------------------------------------------------
# optimizer, learning-rate schedule, checkpoints (used by train/optim.py and train/checkpoint.py)


@dataclass
class OptimConfig:
    """AdamW. Weight decay applies to 2-D and larger parameters only (LoRA A/B included)."""
    lr: float = 2e-4  # the peak learning rate (after warmup)
    weight_decay: float = 0.0  # decoupled (AdamW) weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # Adam's (beta1, beta2)
    eps: float = 1e-8  # Adam's epsilon
    # None: the fused kernel on CUDA, torch's default (foreach) elsewhere; true/false forces it
    fused: bool | None = None
    # max global L2 norm of the gradients; 0 = no clipping (the norm is still computed and logged)
    grad_clip: float = 1.0

    def validate(self, where: str = "optim") -> None:
        for key in ("lr", "weight_decay", "eps", "grad_clip"):  # nan passes every comparison below unnoticed
            if not math.isfinite(getattr(self, key)):
                raise ValueError(f"{where}.{key}: must be a finite number, got {getattr(self, key)}")
        if not self.lr > 0:
            raise ValueError(f"{where}.lr: must be positive, got {self.lr}; typical: 2e-4 for LoRA, 2e-5 for full")
        if self.weight_decay < 0:
            raise ValueError(f"{where}.weight_decay: must be >= 0, got {self.weight_decay}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"{where}.betas: expected two numbers in [0, 1), e.g. [0.9, 0.999], got {self.betas}")
        if not self.eps > 0:
            raise ValueError(f"{where}.eps: must be positive, got {self.eps}; typical: 1e-8")
        if self.grad_clip < 0:
            raise ValueError(f"{where}.grad_clip: must be >= 0 (0 turns clipping off), got {self.grad_clip}")


@dataclass
class ScheduleConfig:
    """Linear warmup to the peak lr, then `kind` decay to min_lr_ratio * peak at the last step."""
    kind: Literal["cosine", "linear", "constant"] = "cosine"  # the decay after warmup
    # set at most one of the two; warmup_ratio is a fraction of the run's total optimizer steps
    warmup_steps: int = 0
    warmup_ratio: float = 0.0  # warmup as a fraction of the run's optimizer steps (see warmup_steps)
    # the lr at the last step, as a fraction of the peak
    min_lr_ratio: float = 0.0

    def validate(self, where: str = "schedule") -> None:
        if self.warmup_steps < 0:
            raise ValueError(f"{where}.warmup_steps: must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError(f"{where}.warmup_ratio: must be in [0, 1), got {self.warmup_ratio}")
        if self.warmup_steps and self.warmup_ratio:
            raise ValueError(f"{where}: warmup_steps={self.warmup_steps} and warmup_ratio={self.warmup_ratio} "
                             "are both set; keep one and set the other to 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:  # (nan fails it too)
            raise ValueError(f"{where}.min_lr_ratio: must be in [0, 1], got {self.min_lr_ratio}")
        if self.kind == "constant" and self.min_lr_ratio:
            warnings.warn(f"{where}.min_lr_ratio={self.min_lr_ratio} is ignored with kind 'constant'; "
                          "use kind 'cosine' or 'linear' to decay", stacklevel=2)


@dataclass
class CheckpointConfig:
    # save every this many optimizer steps (and at the last step); 0 = no checkpoints, so no resume; auto: the
    # interval at which saves cost at most 1% of the training time, from the step time measured after the first
    # step and what a save blocks the loop, at least 10 (gapless.train.checkpoint_interval; metrics.jsonl records it)
    every: int | Literal["auto"] = "auto"
    # saves per pass over the training data instead of `every` (which stays auto): resolved once the data is read to
    # every = max(1, optimizer steps per epoch // per_epoch), printed and recorded in the run's config.yaml
    per_epoch: int | None = None
    # keep the newest `keep` complete checkpoints, delete older ones
    keep: int = 2
    # write in a background thread; the loop waits only for the copy to host memory
    async_write: bool = True

    def validate(self, where: str = "checkpoint") -> None:
        if self.every != "auto" and self.every < 0:
            raise ValueError(f"{where}.every: must be auto or an integer >= 0 (0 turns checkpoints off), "
                             f"got {self.every}")
        if self.per_epoch is not None and self.per_epoch < 1:
            raise ValueError(f"{where}.per_epoch: must be an integer >= 1 (saves per epoch), got {self.per_epoch}")
        if self.per_epoch is not None and self.every != "auto":
            raise ValueError(f"{where}: every={self.every} and per_epoch={self.per_epoch} are both set; keep one "
                             "(every: steps between saves; per_epoch: saves per pass over the data)")
        if self.keep < 1:
            raise ValueError(f"{where}.keep: must be >= 1 (the newest checkpoint is what resume needs), "
                             f"got {self.keep}")


# ---------------------------------------------------------------------------------------------
# dict -> dataclass, with errors that name the field


class ConfigError(ValueError):
    """Every error of a config at once, each a line that names its field."""

    def __init__(self, errors: list[str]):
        self.errors = errors
        super().__init__(errors[0] if len(errors) == 1 else
                         f"{len(errors)} errors:\n" + "\n".join(f"  {e}" for e in errors))


def _collect(errors: list[str], e: ValueError) -> None:
    errors.extend(e.errors if isinstance(e, ConfigError) else [str(e)])


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if tp is bool:
        return "true | false"
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _convert(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, where)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(errors[0] if len(errors) == 1 else
                         f"{where}: {value!r} matches none of {' | '.join(_type_name(a) for a in args)}")
    if origin is Literal:
        if value not in args:
            hint = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
            raise ValueError(f"{where}: {value!r} is not one of {list(args)}"
                             + (f"; did you mean {hint[0]!r}?" if hint else ""))
        return value
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where}: expected a list, got {type(value).__name__} {value!r}")
        item = args[0] if args else Any
        out, errors = [], []
        for i, v in enumerate(value):
            try:
                out.append(_convert(v, item, f"{where}[{i}]"))
            except ValueError as e:
                _collect(errors, e)
        if errors:
            raise ConfigError(errors)
        return out
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected a mapping, got {type(value).__name__} {value!r}")
        kt, vt = args or (Any, Any)
        return {_convert(k, kt, f"{where}.{k}"): _convert(v, vt, f"{where}.{k}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is int:
        # what the user meant: `16.0`, and `1e3` or `"100"` (strings to YAML 1.1), name whole numbers
        number = float(value) if isinstance(value, str) and _FLOAT.fullmatch(value.strip()) else value
        if isinstance(number, float) and number.is_integer():
            return int(value) if isinstance(value, str) and value.strip().lstrip("+-").isdigit() else int(number)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        # YAML 1.1 (PyYAML) reads `2e-4`, without a dot, as a string; it is the number the user meant
        if isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
            return float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ValueError(f"{where}: expected a string, got {type(value).__name__} {value!r}")
        return value
    raise AssertionError(f"unsupported config type {tp} at {where}")


# Other tools' names for fields (PEFT, transformers' TrainingArguments), too far from ours for difflib to suggest
KEY_ALIASES = {"rank": "r", "lora_r": "r", "lora_alpha": "alpha", "lora_dropout": "dropout",
               "lora_target_modules": "target_modules", "learning_rate": "lr", "max_grad_norm": "grad_clip",
               "max_steps": "steps", "num_train_epochs": "epochs", "gradient_accumulation_steps": "grad_accum",
               "logging_steps": "log_every", "eval_steps": "eval_every", "save_steps": "every",
               "save_total_limit": "keep", "max_length": "max_seq_len", "sequence_len": "max_seq_len",
               "model_name_or_path": "path", "torch_dtype": "dtype", "lr_scheduler_type": "kind",
               "gradient_checkpointing": "activation_checkpointing"}


def from_dict(cls: type, data: Any, where: str = "config") -> Any:
    """Build dataclass `cls` from a plain mapping; every error names the dotted field."""
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping of {cls.__name__} fields, got {type(data).__name__} {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    errors: list[str] = []  # all of them, so one run of the command shows every mistake
    for k in data:
        if k not in fields:
            alias = KEY_ALIASES.get(str(k))
            hint = [alias] if alias in fields else difflib.get_close_matches(str(k), list(fields), n=1)
            errors.append(f"{where}.{k}: unknown key" + (f"; did you mean {hint[0]!r}?" if hint else "")
                          + f" ({cls.__name__} has: {', '.join(fields)})")
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            try:
                kwargs[name] = _convert(data[name], hints[name], f"{where}.{name}")
            except ValueError as e:
                _collect(errors, e)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            errors.append(f"{where}.{name}: required field is missing")
    if errors:
        raise ConfigError(errors)
    obj = cls(**kwargs)
    for name, f in fields.items():  # PATH fields, a default included (data.cache_dir's), so a round trip is equal
        value = getattr(obj, name)
        if f.metadata.get("path") and isinstance(value, str):
            setattr(obj, name, os.path.expanduser(value))
    validate = getattr(obj, "validate", None)
    if validate is not None:
        validate(where)
    return obj


def to_dict(obj: Any) -> Any:
    """Dataclasses -> plain YAML-able values (the resolved config written into the run folder)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `a.b.c=value` overrides (values parsed as YAML: `3`, `true`, `[q_proj, v_proj]`)."""
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r}: expected key=value, e.g. optim.lr=2e-4")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError as e:
            raise ValueError(f"override {item!r}: the value is not valid YAML ({getattr(e, 'problem', e)}); "
                             "quote it, e.g. key='{{ ... }}'") from None
        node = data
        parts = key.strip().split(".")
        if not all(parts):
            raise ValueError(f"override {item!r}: the key has an empty part; write the dotted field, e.g. lora.r=16")

        def index(i: int) -> int:  # node is a list: parts[i] must name one of its entries
            if not parts[i].isdigit() or int(parts[i]) >= len(node):
                raise ValueError(f"override {item!r}: {'.'.join(parts[:i])} is a list of {len(node)} entries; "
                                 f"{parts[i]!r} is not an index into it")
            return int(parts[i])

        for i, part in enumerate(parts[:-1]):
            if isinstance(node, list):
                node = node[index(i)]
                continue
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, (dict, list)):
                raise ValueError(f"override {item!r}: {'.'.join(parts[:i + 1])} is not a section")
            node = nxt
        if isinstance(node, list):
            node[index(len(parts) - 1)] = value
        else:
            node[parts[-1]] = value
    return data


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, except that a key given twice in one mapping is an error: PyYAML keeps the last one
    silently, so a second `lora:` section would replace the whole first one."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: its keys may be overridden
                    continue
                key = self.construct_object(key_node, deep=deep)
                line = key_node.start_mark.line + 1
                if isinstance(key, typing.Hashable) and key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"{key!r} is given twice in one mapping (lines {seen[key]} and {line}); "
                                    "keep one", key_node.start_mark)
                if isinstance(key, typing.Hashable):
                    seen[key] = line
        return super().construct_mapping(node, deep)


DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def check_device(name: str, setting: str) -> None:
    """A device gapless runs on, by name (`cudax` or `gpu` would otherwise fail in torch.device)."""
    if not DEVICE.fullmatch(name):
        raise ValueError(f"{setting}: {name!r} is not one of auto, cpu, cuda, cuda:N")


def resolve_device(name: str, setting: str = "model.device"):
    """The torch.device a name gives: `auto` is CUDA when available; `setting` names where the user chose it, for
    the error. torch is imported here, not at the top: the CLI reads configs before it needs torch."""
    import torch

    check_device(name, setting)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{setting}: {name!r} asked for, but CUDA is not available here; use 'cpu' or 'auto'")
    return device


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if path.is_dir():
        inside = path / "config.yaml"
        raise ValueError(f"{path}: a folder, not a config file; give the YAML config"
                         + (f" (a run folder's is {inside})" if inside.is_file() else ""))
    if not path.is_file():
        raise ValueError(f"{path}: config file not found")
    try:
        data = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as e:
        tab = "'\\t'" in str(e)  # PyYAML: "found character '\t' that cannot start any token"
        hint = "\nYAML indents with spaces, not tabs; replace the tab with spaces" if tab else ""
        raise ValueError(f"{path}: not valid YAML: {e}{hint}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not a text file (byte 0x{e.object[e.start]:02x} at {e.start} is not UTF-8); "
                         "give the run's YAML config") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return data


# ---------------------------------------------------------------------------------------------
# data: the sources of a run, tokenization and batching (gapless.data)

# The canonical fields of each record format. SourceConfig.columns maps a canonical name to the
# file's own column (or message key) name, e.g. {prompt: question, completion: answer} for gsm8k.
DATA_FORMAT_FIELDS = {
    "messages": ("messages", "tools", "role", "content"),
    "sharegpt": ("conversations", "tools", "system", "from", "value"),
    "alpaca": ("instruction", "input", "output", "system", "history", "instances"),
    "prompt_completion": ("prompt", "completion", "system", "tools"),
    "text": ("text",),
    "oasst": ("prompt",),
    "oasst_top1": ("prompt",),
    "capybara": ("conversation", "input", "output"),
    "glaive": ("system", "chat"),
    "segments": ("segments",),
}
# The fields a format reads when a record has them, which SourceConfig.columns may map to null: not read (LLaMA-Factory
# reads a dataset's system, tools and history columns only where dataset_info.json names them)
DATA_FORMAT_OPTIONAL = {"messages": ("tools",), "sharegpt": ("tools", "system"),
                        "alpaca": ("input", "system", "history"), "prompt_completion": ("system", "tools")}
# What a source's role names may map to; `tool_call` is an assistant turn that calls a tool
# (ShareGPT's function_call), kept as {"role": "assistant", "is_tool_call": true}.
CHAT_ROLES = ("system", "user", "assistant", "tool", "tool_call")


@dataclass
class SourceConfig:
    # a file, a glob (`data/*.jsonl`, `**` allowed), a folder of data files (not of a dataset's splits, train.jsonl
    # beside test.jsonl: give the training files) or a folder written by datasets' save_to_disk;
    # .jsonl/.json/.parquet/.csv/.arrow (.jsonl.gz, .json.gz); relative paths are from the cwd
    path: str = field(metadata=PATH)
    # the records' format (DATA_FORMAT_FIELDS); auto: detected per file from the first record's keys. OpenAssistant's
    # message trees: oasst = every root-to-leaf thread (what auto detects), oasst_top1 = one thread per tree, the
    # reply of lowest rank at each step (gapless.data.formats says more). capybara: LDJnr/Capybara's
    # conversation of {input, output} pairs, each a user turn and its answer. glaive: glaive-function-calling-v2's
    # system text and chat string, read into tools, tool calls and their results. segments: template-free text,
    # {"segments": [{"label": bool, "text": str}, ...]} (Axolotl's input_output): the texts tokenized one by one
    # and concatenated, nothing added (no bos, eos nor template), the tokens of label true trained
    format: Literal["auto", "messages", "sharegpt", "alpaca", "prompt_completion", "text", "oasst",
                    "oasst_top1", "capybara", "glaive", "segments"] = "auto"
    # canonical field -> the file's name for it; null: an optional field (DATA_FORMAT_OPTIONAL: a system, tools, an
    # alpaca input or history) not read, even where a record has it
    columns: dict[str, str | None] = field(default_factory=dict)
    roles: dict[str, str] = field(default_factory=dict)  # the file's role name -> one of CHAT_ROLES, over the defaults
    # drop each conversation's leading system turn (its first turn when that is a system one, the format's system
    # field included) before the chat template renders it, as Axolotl's drop_system_message; a default system
    # prompt the template writes itself (Qwen 2.5's) stays. Conversations only, not format text
    drop_system_message: bool = False
    # Mixing (set at most one): `epochs` = how often each document appears in one pass over the mix
    # (0.5 = a seeded half, 2 = twice); `weight` = this source's share of the documents of all weighted
    # sources, whose total count is kept. Neither = epochs 1.
    weight: float | None = None
    epochs: float | None = None  # passes over this source per pass over the mix (see above)
    name: str | None = None  # shown in the summary; defaults to the path

    def validate(self, where: str = "source") -> None:
        if not self.path.strip():
            raise ValueError(f"{where}.path: empty; give a file, a glob or a folder")
        if self.weight is not None and self.epochs is not None:
            raise ValueError(f"{where}: set weight or epochs, not both")
        if self.drop_system_message and self.format in ("text", "segments"):
            raise ValueError(f"{where}.drop_system_message: format {self.format} has no system turn to drop; "
                             "unset it")
        for key in ("weight", "epochs"):
            value = getattr(self, key)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{where}.{key}: must be positive (and finite), got {value}")
        known = (DATA_FORMAT_FIELDS[self.format] if self.format != "auto"
                 else sorted({f for fields in DATA_FORMAT_FIELDS.values() for f in fields}))
        for key in self.columns:
            if key not in known:
                hint = difflib.get_close_matches(key, known, n=1)
                raise ValueError(f"{where}.columns.{key}: not a field of format {self.format!r}"
                                 + (f"; did you mean {hint[0]!r}?" if hint else f"; fields: {list(known)}"))
        optional = (DATA_FORMAT_OPTIONAL.get(self.format, ()) if self.format != "auto"
                    else sorted({f for fields in DATA_FORMAT_OPTIONAL.values() for f in fields}))
        for key in [k for k, v in self.columns.items() if v is None and k in known and k not in optional]:
            raise ValueError(f"{where}.columns.{key}: null (not read) is for the fields a record may leave out "
                             f"({', '.join(optional) or 'none in format ' + repr(self.format)}); give the column "
                             "that holds it")
        for name, role in self.roles.items():
            if role not in CHAT_ROLES:
                raise ValueError(f"{where}.roles.{name}: {role!r} is not one of {list(CHAT_ROLES)}")


@dataclass
class DataConfig:
    sources: list[SourceConfig] = field(default_factory=list)
    # held-out data: either separate sources or a seeded fraction of every source's records
    eval_sources: list[SourceConfig] = field(default_factory=list)
    # the seeded fraction of every source's records held out (0 = none); an OpenAssistant tree's threads, which share
    # their prefix, are held out together, and the fraction counts trees (so do a Self-Instruct row's instances)
    eval_fraction: float = 0.0
    tokenizer: str | None = field(default=None, metadata=PATH)  # an HF tokenizer folder; defaults to the model folder
    # inline Jinja, a path to a .jinja file or a name (chatml, llama3, qwen_25, gemma, gemma3, mistral_v1); defaults
    # to the tokenizer's
    chat_template: str | None = None
    max_seq_len: int = 4096  # tokens per document at most (see overlong), and the packed row length
    train_on: Literal["assistant", "all", "last_assistant"] = "assistant"  # which tokens the loss counts
    overlong: Literal["truncate", "drop", "split"] = "truncate"  # split: plain text only
    on_error: Literal["raise", "skip"] = "raise"  # a bad record: stop with file:line, or skip and count it
    # packed: documents share rows, isolated by cu_seqlens; padded: one per row, padded to the batch's longest;
    # length_grouped: padded, in batches of similar lengths; pad_to_max: padded to max_seq_len
    batching: Literal["packed", "padded", "length_grouped", "pad_to_max"] = "packed"
    pack_algorithm: Literal["best_fit", "first_fit"] = "best_fit"  # how documents are placed into packed rows
    # packed: tokens_per_batch // max_seq_len rows of max_seq_len slots each;
    # padded strategies: as many documents as fit in tokens_per_batch slots after padding (at most rows_per_batch);
    # auto (gapless train on a GPU): the batch finder's choice, ~90% of free memory less 10% (train/batch_finder.py)
    tokens_per_batch: int | Literal["auto"] = 16384
    # documents per batch at most (a padded row each), still within tokens_per_batch slots after padding, so memory
    # stays bounded: a peer's per-device batch size (TRL's per_device_train_batch_size, Axolotl's micro_batch_size)
    # unpacked. None: as many as fit. pad_to_max: min(rows_per_batch, tokens_per_batch // max_seq_len) rows;
    # tokens_per_batch auto: at most rows_per_batch rows of max_seq_len. Not with packed: its rows of max_seq_len
    # hold many documents each, and tokens_per_batch already counts them
    rows_per_batch: int | None = None
    pad_to_multiple_of: int = 8  # padded rows' length is rounded up to this (tensor-core friendly shapes)
    # tokenized data, keyed by the files and settings that made it
    cache_dir: str = field(default="~/.cache/gapless/data", metadata=PATH)
    # tokenizer processes; None = the CPUs this process can use (its affinity, capped by a container's cgroup CPU
    # quota), 0 = in this process
    num_workers: int | None = None
    seed: int = 0  # the shuffle, the eval_fraction split and the epochs/weight sampling

    def validate(self, where: str = "data") -> None:
        if not self.sources:
            raise ValueError(f"{where}.sources: at least one source is required, e.g. [{{path: train.jsonl}}]")
        if self.max_seq_len < 2:
            raise ValueError(f"{where}.max_seq_len: must be at least 2, got {self.max_seq_len}")
        if self.tokens_per_batch != "auto" and self.tokens_per_batch < self.max_seq_len:
            raise ValueError(f"{where}.tokens_per_batch: {self.tokens_per_batch} is less than "
                             f"max_seq_len {self.max_seq_len}; raise it or lower max_seq_len")
        if self.rows_per_batch is not None and self.rows_per_batch < 1:
            raise ValueError(f"{where}.rows_per_batch: must be at least 1, got {self.rows_per_batch}; or unset it "
                             "(as many documents as fit in tokens_per_batch)")
        if self.rows_per_batch is not None and self.batching == "packed":
            raise ValueError(f"{where}.rows_per_batch: {self.rows_per_batch} caps the documents of a padded batch; "
                             f"{where}.batching packed fills tokens_per_batch // max_seq_len rows with many documents "
                             f"each: unset rows_per_batch (for N packed rows: tokens_per_batch: N x max_seq_len) or "
                             "use batching: padded")
        if self.pad_to_multiple_of < 1:
            raise ValueError(f"{where}.pad_to_multiple_of: must be at least 1, got {self.pad_to_multiple_of}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"{where}.eval_fraction: must be in [0, 1), got {self.eval_fraction}")
        if self.eval_fraction > 0 and self.eval_sources:
            raise ValueError(f"{where}.eval_fraction: set eval_fraction or eval_sources, not both")
        if self.num_workers is not None and self.num_workers < 0:
            raise ValueError(f"{where}.num_workers: must be >= 0 (0 = no worker processes), got {self.num_workers}")
        template = self.chat_template
        if template and template.endswith(".jinja") and "{" not in template and not Path(template).expanduser().is_file():
            raise ValueError(f"{where}.chat_template: file {template} not found")


# ---------------------------------------------------------------------------------------------
# the run: model, method, loop settings; `gapless train CONFIG.yaml key=value ...`


@dataclass
class ModelConfig:
    path: str = field(metadata=PATH)  # an HF checkpoint folder: config.json + safetensors (sharded or not)
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"  # the base weights' and activations' dtype
    device: str = "auto"  # auto (CUDA when available) | cpu | cuda | cuda:N
    # attention backend: auto (varlen on a CUDA GPU of compute capability 8.0+ in bf16/fp16 with packed rows,
    # sdpa elsewhere: kernels.attention.auto_backend), sdpa (plain PyTorch, runs anywhere), varlen (torch
    # varlen_attn), flex (FlexAttention), fa4 (flash-attn-4), fa4_op (flash-attn-4 as torch custom ops: no graph
    # break in compiled layers, the fastest measured). A named backend that cannot run here is an error, never
    # swapped for another; the run prints what auto chose and config.yaml in the run folder records it.
    attn_backend: str = "auto"
    # torch.compile each decoder layer (the first step compiles) and run the loss's per-chunk step fast (a Triton
    # kernel on CUDA, torch.compile elsewhere); auto: on with CUDA, off on the CPU (inductor's CPU build of a layer
    # takes longer than the short runs a CPU is for)
    compile: bool | Literal["auto"] = "auto"
    # activation checkpointing of every N-th decoder layer, only when memory requires it; 0 = off
    activation_checkpointing: int = 0

    def validate(self, where: str = "model") -> None:
        if self.activation_checkpointing < 0:
            raise ValueError(f"{where}.activation_checkpointing: must be >= 0 (0 = off, 1 = every layer), "
                             f"got {self.activation_checkpointing}")
        if not self.path.strip():
            raise ValueError(f"{where}.path: empty; give the folder of an HF checkpoint (config.json + *.safetensors)")
        check_device(self.device, f"{where}.device")
        if self.attn_backend not in ["auto", *ATTN_BACKENDS]:
            hint = difflib.get_close_matches(self.attn_backend, ATTN_BACKENDS, n=1)
            raise ValueError(f"{where}.attn_backend: {self.attn_backend!r} is not one of "
                             f"{['auto', *ATTN_BACKENDS]}" + (f"; did you mean {hint[0]!r}?" if hint else ""))


@dataclass
class WandbConfig:
    project: str = "gapless"  # the W&B project
    name: str | None = None  # the W&B run's name; null = the run folder's name
    entity: str | None = None  # the W&B team or user the run goes to (online); null = your default
    # offline: files under RUN/wandb, no network and no account (`wandb sync RUN/wandb/offline-run-*` uploads them
    # later); online: streamed to the W&B server as the run goes (needs `wandb login`)
    mode: Literal["offline", "online"] = "offline"

    def validate(self, where: str = "wandb") -> None:
        if not self.project.strip():
            raise ValueError(f"{where}.project: empty; give a W&B project name, e.g. gapless")


@dataclass
class TrainConfig:
    # length of the run in optimizer steps; 0 = `epochs` passes over the training data
    steps: int = 0
    epochs: float = 1.0  # passes over the training data when steps is 0
    grad_accum: int = 1  # micro-batches per optimizer step
    log_every: int = 10  # optimizer steps between metric reads (the only host sync of the loop)
    eval_every: int = 0  # optimizer steps between evaluations on the held-out split; 0 = only at the end
    # evaluations per pass over the training data instead of eval_every: resolved once the data is read to
    # eval_every = max(1, optimizer steps per epoch // evals_per_epoch), printed and recorded in the run's config.yaml
    evals_per_epoch: int | None = None
    seed: int = 0  # the model's initialisation of adapters and dropout masks
    # also send every metric record, as it is written to metrics.jsonl, to these (rank 0): tensorboard (event files
    # in RUN/tensorboard; pip install 'gapless[tensorboard]'), wandb (a W&B run as train.wandb says; pip install
    # 'gapless[wandb]'). Empty: metrics.jsonl only (`gapless report RUN --tensorboard --wandb` exports it later)
    report_to: list[Literal["tensorboard", "wandb"]] = field(default_factory=list)
    # the W&B run when report_to lists wandb (each training session, a resume included, is a W&B run of its own)
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def validate(self, where: str = "train") -> None:
        if self.steps < 0:
            raise ValueError(f"{where}.steps: must be >= 0 (0 = run `epochs` passes), got {self.steps}")
        if self.steps == 0 and not (math.isfinite(self.epochs) and self.epochs > 0):
            raise ValueError(f"{where}: steps is 0 and epochs is {self.epochs}; set steps > 0 or epochs > 0 (finite)")
        for key in ("grad_accum", "log_every"):
            if getattr(self, key) < 1:
                raise ValueError(f"{where}.{key}: must be >= 1, got {getattr(self, key)}")
        if self.eval_every < 0:
            raise ValueError(f"{where}.eval_every: must be >= 0, got {self.eval_every}")
        if self.evals_per_epoch is not None and self.evals_per_epoch < 1:
            raise ValueError(f"{where}.evals_per_epoch: must be an integer >= 1 (evaluations per epoch), "
                             f"got {self.evals_per_epoch}")
        if self.evals_per_epoch is not None and self.eval_every:
            raise ValueError(f"{where}: eval_every={self.eval_every} and evals_per_epoch={self.evals_per_epoch} are "
                             "both set; keep one (eval_every: steps between evaluations; evals_per_epoch: "
                             "evaluations per pass over the data)")
        twice = sorted({s for s in self.report_to if self.report_to.count(s) > 1})
        if twice:
            raise ValueError(f"{where}.report_to: {twice} listed more than once; list each sink once")
        if "wandb" not in self.report_to and self.wandb != WandbConfig():
            warnings.warn(f"{where}.wandb is set but {where}.report_to does not list wandb: it is ignored; "
                          f"add wandb to {where}.report_to to log to W&B", stacklevel=2)


@dataclass
class ParallelConfig:
    """Several processes (torchrun): how the model is spread over them (gapless.train.parallel). Used only when
    the run is launched by torchrun (or `gapless train --nproc N`); a single process ignores it."""
    # auto: FSDP2 for a method that trains the full model, DDP for LoRA. ddp: every rank holds the model, only the
    # trainable gradients are all-reduced. fsdp: parameters, gradients and optimizer state sharded per decoder layer
    strategy: Literal["auto", "ddp", "fsdp"] = "auto"
    # seconds a collective may wait before the process group fails the run (a dead or stuck rank)
    timeout_s: int = 600
    # DDP's gradient bucket (torch's default 25 MB)
    bucket_mb: int = 25
    # FSDP2: free the un-sharded parameters after each layer's forward (memory) or keep them for backward (speed)
    reshard_after_forward: bool = True

    def validate(self, where: str = "parallel") -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"{where}.timeout_s: must be positive, got {self.timeout_s}; typical: 600")
        if self.bucket_mb <= 0:
            raise ValueError(f"{where}.bucket_mb: must be positive, got {self.bucket_mb}; torch's default is 25")


@dataclass
class RunConfig:
    model: ModelConfig
    data: DataConfig
    # lora: LoRA on the base in model.dtype; qlora: the same LoRA (lora.*) on a base stored as NF4 with double
    # quantisation; full: every weight trains (float32 master weights under bf16/fp16: gapless.train.optim)
    method: Literal["lora", "qlora", "full"] = "lora"
    lora: LoraConfig = field(default_factory=LoraConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # the run folder: config.yaml, metrics.jsonl, checkpoints/, report.html, adapter/
    output_dir: str = field(default="runs/run", metadata=PATH)
    resume: bool = False  # continue from the newest complete checkpoint in output_dir
    progress: bool = True  # a progress bar on a terminal, log lines otherwise

    def validate(self, where: str = "config") -> None:
        for key in ("eval_every", "evals_per_epoch"):
            if getattr(self.train, key) and not (self.data.eval_fraction or self.data.eval_sources):
                raise ValueError(f"{where}.train.{key}: {getattr(self.train, key)} asks for evaluation but there "
                                 "is no held-out data; set data.eval_fraction (e.g. 0.02) or data.eval_sources")
        if self.train.steps and self.schedule.warmup_steps >= self.train.steps:  # (epochs: known once data is read)
            raise ValueError(f"{where}.schedule.warmup_steps: {self.schedule.warmup_steps} warmup steps leave nothing "
                             f"of a {self.train.steps}-step run (train.steps); use fewer than {self.train.steps}")
        if self.resume and not self.checkpoint.every:
            warnings.warn(f"{where}.resume is true but checkpoint.every is 0: this run writes no checkpoints "
                          "to resume from later", stacklevel=2)

    def check_output_dir(self, where: str = "config") -> None:
        """output_dir is a folder this process can write, or can be created in one. Called by `train` before any
        work, not by validate: a run folder's config.yaml read on another machine (export, report) names a folder
        that need not exist there."""
        out = Path(self.output_dir).expanduser()
        if out.exists() and not out.is_dir():
            raise ValueError(f"{where}.output_dir: {out} is a file; give a folder for the run")
        existing = out
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if not existing.is_dir():
            raise ValueError(f"{where}.output_dir: {out} cannot be created: {existing} is a file")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise ValueError(f"{where}.output_dir: {out} is not writable ({existing} is read-only for this user); "
                             "choose another output_dir")

    def check_model(self, limit: int | None, rope_type: str = "default", where: str = "config") -> None:
        """The settings that need the model's config.json (called once it is read, before any data is tokenized):
        `limit`, its max_position_embeddings, and the rope_type of its RoPE scaling."""
        if limit and self.data.max_seq_len > limit and rope_type == "dynamic":
            # transformers grows a dynamic NTK RoPE's base past this length; gapless runs the plain RoPE it equals
            # below it (gapless.model.decoder.rope_frequencies), so a longer row would not be the model's
            raise ValueError(f"{where}.data.max_seq_len: {self.data.max_seq_len:,} is above the model's "
                             f"max_position_embeddings {limit:,} (config.json of {self.model.path}), whose RoPE "
                             "scaling is rope_type 'dynamic': transformers rescales RoPE for longer sequences, "
                             f"which gapless does not implement; lower data.max_seq_len to {limit:,} or less")
        if limit and self.data.max_seq_len > limit:
            warnings.warn(f"{where}.data.max_seq_len: {self.data.max_seq_len:,} is above the model's "
                          f"max_position_embeddings {limit:,} (config.json of {self.model.path}): positions past it "
                          "were never trained; lower max_seq_len unless the model is meant to extrapolate",
                          stacklevel=2)


def require_settings(raw: dict, path: str | Path, overrides: list[str] | tuple[str, ...]) -> None:
    """An empty config file (or one of comments only), its model and data not given as overrides either: said as
    such, not as two missing fields."""
    if not raw and not any(o.split("=", 1)[0].strip().startswith(("model", "data")) for o in overrides):
        raise ValueError(f"{path}: holds no settings (empty, or comments only); a run needs at least model.path and "
                         "data.sources, as in examples/llama-3.2-3b-lora.yaml of gapless's repository")


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                data: dict | None = None) -> RunConfig:
    """The run config from a YAML file (or a dict) with dotted `key=value` overrides applied."""
    raw = read_yaml(path) if path is not None else dict(data or {})
    if path is not None:
        require_settings(raw, path, overrides)
    raw = apply_overrides(raw, list(overrides))
    where = str(path) if path is not None else "config"
    try:
        return from_dict(RunConfig, raw, where)
    except ConfigError as e:
        if path is None:
            raise
        raise ConfigError([_named_by_override(line, where, overrides) for line in e.errors]) from e


def _named_by_override(error: str, where: str, overrides: list[str] | tuple[str, ...]) -> str:
    """`override lora.r: ...`, not `c.yaml.lora.r: ...`, for a value an override gave: the file does not hold it."""
    for item in overrides:
        field = re.sub(r"\.(\d+)(?=\.|$)", r"[\1]", item.split("=", 1)[0].strip())  # data.sources.0 -> sources[0]
        if re.match(re.escape(f"{where}.{field}") + r"[:.\[]", error):
            return "override " + error[len(where) + 1:]
    return error
