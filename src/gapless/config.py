"""The one config schema: typed dataclasses that YAML maps onto one to one.

`load_config(path, overrides)` reads a YAML file, applies dotted `key=value` overrides and builds
the dataclasses; an unknown key, a wrong type or an impossible combination raises ValueError that
names the field (`data.sources[1].format`) and says what to do.
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

# The seven linear projections of a Llama-family decoder layer (HF names).
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoraConfig:
    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(ALL_LINEAR))
    # rsLoRA scales by alpha / sqrt(r) instead of alpha / r (Kalajdzievski 2023)
    use_rslora: bool = False

    def validate(self, where: str = "lora") -> None:
        if self.r <= 0:
            raise ValueError(f"{where}.r: must be a positive integer, got {self.r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"{where}.dropout: must be in [0, 1), got {self.dropout}")
        unknown = sorted(set(self.target_modules) - set(ALL_LINEAR))
        if unknown or not self.target_modules:
            raise ValueError(f"{where}.target_modules: {unknown or 'empty list'} not supported; "
                             f"choose among {list(ALL_LINEAR)}")

    @property
    def scaling(self) -> float:
        return self.alpha / (self.r ** 0.5 if self.use_rslora else self.r)


# ---------------------------------------------------------------------------------------------
# optimizer, learning-rate schedule, checkpoints (used by train/optim.py and train/checkpoint.py)


@dataclass
class OptimConfig:
    """AdamW. Weight decay applies to 2-D and larger parameters only (LoRA A/B included)."""
    lr: float = 2e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    # None: the fused kernel on CUDA, torch's default (foreach) elsewhere; true/false forces it
    fused: bool | None = None
    # max global L2 norm of the gradients; 0 = no clipping (the norm is still computed and logged)
    grad_clip: float = 1.0

    def validate(self, where: str = "optim") -> None:
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
    kind: Literal["cosine", "linear", "constant"] = "cosine"
    # set at most one of the two; warmup_ratio is a fraction of the run's total optimizer steps
    warmup_steps: int = 0
    warmup_ratio: float = 0.0
    min_lr_ratio: float = 0.0

    def validate(self, where: str = "schedule") -> None:
        if self.warmup_steps < 0:
            raise ValueError(f"{where}.warmup_steps: must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError(f"{where}.warmup_ratio: must be in [0, 1), got {self.warmup_ratio}")
        if self.warmup_steps and self.warmup_ratio:
            raise ValueError(f"{where}: warmup_steps={self.warmup_steps} and warmup_ratio={self.warmup_ratio} "
                             "are both set; keep one and set the other to 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"{where}.min_lr_ratio: must be in [0, 1], got {self.min_lr_ratio}")
        if self.kind == "constant" and self.min_lr_ratio:
            warnings.warn(f"{where}.min_lr_ratio={self.min_lr_ratio} is ignored with kind 'constant'; "
                          "use kind 'cosine' or 'linear' to decay", stacklevel=2)


@dataclass
class CheckpointConfig:
    # save every this many optimizer steps (and at the end); 0 = no checkpoints, so no resume
    every: int = 0
    # keep the newest `keep` complete checkpoints, delete older ones
    keep: int = 2
    # write in a background thread; the loop waits only for the copy to host memory
    async_write: bool = True

    def validate(self, where: str = "checkpoint") -> None:
        if self.every < 0:
            raise ValueError(f"{where}.every: must be >= 0 (0 turns checkpoints off), got {self.every}")
        if self.keep < 1:
            raise ValueError(f"{where}.keep: must be >= 1 (the newest checkpoint is what resume needs), "
                             f"got {self.keep}")


# ---------------------------------------------------------------------------------------------
# dict -> dataclass, with errors that name the field


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


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
        return [_convert(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
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
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ValueError(f"{where}: expected a string, got {type(value).__name__} {value!r}")
        return value
    raise AssertionError(f"unsupported config type {tp} at {where}")


def from_dict(cls: type, data: Any, where: str = "config") -> Any:
    """Build dataclass `cls` from a plain mapping; every error names the dotted field."""
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping of {cls.__name__} fields, got {type(data).__name__} {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in data if k not in fields]
    if unknown:
        k = unknown[0]
        hint = difflib.get_close_matches(str(k), list(fields), n=1)
        raise ValueError(f"{where}.{k}: unknown key" + (f"; did you mean {hint[0]!r}?" if hint else "")
                         + f" ({cls.__name__} has: {', '.join(fields)})")
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _convert(data[name], hints[name], f"{where}.{name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ValueError(f"{where}.{name}: required field is missing")
    obj = cls(**kwargs)
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
            raise ValueError(f"override {item!r}: expected key=value, e.g. train.lr=2e-4")
        key, raw = item.split("=", 1)
        value = yaml.safe_load(raw) if raw else ""
        node = data
        parts = key.strip().split(".")
        for i, part in enumerate(parts[:-1]):
            if isinstance(node, list):
                node = node[int(part)]
                continue
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, (dict, list)):
                raise ValueError(f"override {item!r}: {'.'.join(parts[:i + 1])} is not a section")
            node = nxt
        if isinstance(node, list):
            node[int(parts[-1])] = value
        else:
            node[parts[-1]] = value
    return data


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: config file not found")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {e}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return data
