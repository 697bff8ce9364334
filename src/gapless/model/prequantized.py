"""Checkpoints saved in 4 bits by bitsandbytes: what transformers' save_pretrained writes for a model loaded with
BitsAndBytesConfig(load_in_4bit=True), the "-bnb-4bit" folders many QLoRA users start from.

config.json carries quantization_config {"quant_method": "bitsandbytes", "load_in_4bit": true, ...}, and each
quantised linear weight X.weight of n elements is stored as (transformers 5.25 + bitsandbytes 0.50, checked by
tests/test_prequantized.py where bitsandbytes imports):

    X.weight                                 uint8 [ceil(n / 2), 1]: two 4-bit codes a byte, element 2i in the high
                                             nibble (bnb_4bit_quant_storage another dtype: the same bytes, viewed)
    X.weight.absmax                          uint8 [ceil(n / bs)] (double quantisation), else float32: each block's scale
    X.weight.quant_map                       float32 [16]: the 4-bit values (NF4's, or FP4's)
    X.weight.nested_absmax                   float32 [ceil(n / bs / nbs)]  } double quantisation only: absmax is
    X.weight.nested_quant_map                float32 [256]                 } 8-bit codes of (absmax - offset)
    X.weight.quant_state.bitsandbytes__nf4   uint8: the JSON {"quant_type", "blocksize": bs, "dtype", "shape",
                                             "nested_blocksize": nbs, "nested_offset": offset} (__fp4 for FP4)

    W[i] = quant_map[code_i] * absmax[i // bs],  absmax[b] = nested_quant_map[absmax_u8[b]] * nested_absmax[b // nbs]
                                                            + offset   (double quantisation)

The weights that are not quantised (embeddings, norms, lm_head, llm_int8_skip_modules) are plain tensors beside them.
`fold` gives the checkpoint's keys with each quantised weight under its own name and logical shape, so `build`
checks them against config.json like any other; `read` gives a StoredNF4 that the loader dequantises, or that QLoRA
takes as it is (QLoraLinear.load_stored_: the run trains on the codes the file holds, bit for bit).
"""
from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from gapless.kernels.nf4 import (BLOCKSIZE, DYNAMIC_VALUES, NF4_VALUES, SCALE_BLOCKSIZE, NF4Weight, double_quantize)

# the parts of a quantised weight beside X.weight, by the suffix after "X.weight"
QUANT_STATE = ".quant_state.bitsandbytes__"
PARTS = (".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map")
QUANT_TYPES = ("nf4", "fp4")
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def check_quantization_config(config: dict, where: str) -> None:
    """config.json's quantization_config, if any, is bitsandbytes' 4-bit (what `fold` reads); else an error naming
    the method and what to load instead."""
    q = config.get("quantization_config")
    if not q:
        return
    if not isinstance(q, dict):
        raise ValueError(f"{where}: quantization_config: expected an object, got {q!r}")
    method = q.get("quant_method")
    base = "load the unquantised (bf16/fp16/fp32) base model instead"
    if method is None and "group_size" in q:  # mlx_lm's convert writes {"group_size": 64, "bits": 4} and no method
        raise ValueError(f"{where}: quantization_config: an MLX-quantised checkpoint ({q.get('bits')}-bit, group size "
                         f"{q['group_size']}: Apple's mlx_lm format) is not supported; {base}")
    if method != "bitsandbytes":
        raise ValueError(f"{where}: quantization_config: quant_method {method!r} checkpoints are not supported "
                         f"(gapless reads bitsandbytes' 4-bit ones); {base}")
    if q.get("load_in_8bit") or not q.get("load_in_4bit", q.get("_load_in_4bit")):
        raise ValueError(f"{where}: quantization_config: bitsandbytes 8-bit (LLM.int8) checkpoints are not "
                         f"supported (gapless reads its 4-bit ones, load_in_4bit); {base}")
    kind = q.get("bnb_4bit_quant_type", "fp4")
    if kind not in QUANT_TYPES:
        raise ValueError(f"{where}: quantization_config: bnb_4bit_quant_type {kind!r} is not one of "
                         f"{', '.join(QUANT_TYPES)}")


@dataclass(frozen=True)
class StoredParts:
    """Where a quantised weight's tensors are: part suffix ("" for the codes) -> (file, key), and its quant state."""
    files: dict[str, tuple[Path, str]]
    state: dict

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.state["shape"])


def fold(headers: dict[str, tuple[Path, tuple[int, ...]]]
         ) -> tuple[dict[str, tuple[Path, tuple[int, ...]]], dict[str, StoredParts]]:
    """(headers with each quantised weight under its own key and logical shape, its parts' keys gone;
    key -> StoredParts of the quantised ones). Reads only the small quant-state tensors. Headers of a checkpoint
    without quantised weights come back as they are."""
    states = [key for key in headers if QUANT_STATE in key]
    if not states:
        return headers, {}
    stored: dict[str, StoredParts] = {}
    with contextlib.ExitStack() as stack:
        opened: dict[Path, Any] = {}  # each shard opened once (a 3B checkpoint holds 196 quant states)
        for state_key in states:
            key, _, kind = state_key.partition(QUANT_STATE)
            path = headers[state_key][0]
            if kind not in QUANT_TYPES:
                raise ValueError(f"{path}: {state_key}: bitsandbytes quant type {kind!r} is not one of "
                                 f"{', '.join(QUANT_TYPES)}")
            if key not in headers:
                raise ValueError(f"{path}: {state_key} has no quantised weight {key} beside it")
            try:
                if path not in opened:
                    opened[path] = stack.enter_context(safe_open(path, framework="pt"))
                state = json.loads(bytes(opened[path].get_tensor(state_key).tolist()))
            except (SafetensorError, OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"{path}: {state_key}: not a readable bitsandbytes quant state: {e}") from None
            stored[key] = _parts(key, kind, state, headers, path, state_key)
    dropped = set(states) | {k + p for k in stored for p in PARTS}
    logical = {key: ((path, stored[key].shape) if key in stored else (path, shape))
               for key, (path, shape) in headers.items() if key not in dropped}
    return logical, stored


def _parts(key: str, kind: str, state: Any, headers: dict[str, tuple[Path, tuple[int, ...]]], path: Path,
           state_key: str) -> StoredParts:
    """The StoredParts of the weight `key` from its quant state (read from `state_key` in `path`), checked."""
    shape = state.get("shape") if isinstance(state, dict) else None
    if not (isinstance(shape, list) and all(isinstance(d, int) and d > 0 for d in shape)
            and isinstance(state.get("blocksize"), int) and state.get("dtype") in _DTYPES):
        raise ValueError(f"{path}: {state_key}: expected a JSON object with a shape (a list of sizes), an "
                         f"integer blocksize and a dtype ({', '.join(_DTYPES)}); got {state!r}")
    parts = [".absmax", ".quant_map"] + ([".nested_absmax", ".nested_quant_map"] if "nested_blocksize" in state
                                         else [])
    missing = [key + p for p in parts if key + p not in headers]
    if missing:
        raise ValueError(f"{path}: the 4-bit weight {key} lacks {', '.join(missing)} (a bitsandbytes "
                         "checkpoint saves them beside it)")
    return StoredParts({"": (headers[key][0], key), **{p: (headers[key + p][0], key + p) for p in parts}},
                       {**state, "quant_type": kind})


@dataclass
class StoredNF4:
    """A bitsandbytes 4-bit weight as read, on the device the loader reads to (the module docstring's parts)."""
    codes: Tensor  # uint8 [ceil(n / 2)]
    absmax: Tensor  # uint8 (double quantisation) or float32 [ceil(n / blocksize)]
    quant_map: Tensor  # float32 [16]
    nested_absmax: Tensor | None  # float32 [ceil(n / blocksize / nested_blocksize)]
    nested_quant_map: Tensor | None  # float32 [256]
    offset: float
    blocksize: int
    nested_blocksize: int
    quant_type: str
    shape: tuple[int, ...]
    dtype: torch.dtype  # the dtype the weight was quantised from (its quant state's)

    def block_absmax(self) -> Tensor:
        """Each block's scale, float32 [ceil(n / blocksize)], as bitsandbytes computes it."""
        if self.nested_absmax is None:
            return self.absmax
        scale = self.nested_absmax.repeat_interleave(self.nested_blocksize)[:self.absmax.numel()]
        return self.nested_quant_map[self.absmax.long()] * scale + self.offset

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        """The weight [*shape] in `dtype` (None: the quant state's): float32 math in bitsandbytes' order (its
        dequantize_4bit's values, bit for bit), cast last."""
        n = math.prod(self.shape)  # an odd n leaves the last byte's low nibble unused
        nib = torch.stack((self.codes >> 4, self.codes & 0xF), dim=-1).view(-1)[:n].long()  # [n]: high nibble first
        blocks = -(-n // self.blocksize)
        w = torch.nn.functional.pad(self.quant_map[nib], (0, blocks * self.blocksize - n)).view(blocks, -1)
        w = (w * self.block_absmax()[:, None]).view(-1)[:n]
        return w.view(self.shape).to(dtype or self.dtype)

    def nf4(self) -> NF4Weight | None:
        """The same weight as gapless' NF4 storage (kernels/nf4.py): the file's codes and, with double quantisation,
        its scale codes, exactly; without it, its float32 scales double-quantised as QLoRA does. None where the
        storage cannot hold it (FP4 values, another blocksize or second-level map): quantise the dequantised weight."""
        code_table = torch.tensor(NF4_VALUES, dtype=torch.float32, device=self.quant_map.device)
        if (self.quant_type != "nf4" or self.blocksize != BLOCKSIZE or math.prod(self.shape) % BLOCKSIZE
                or not torch.equal(self.quant_map, code_table)):
            return None
        if self.nested_absmax is None:
            absmax_q, absmax_scale, offset = double_quantize(self.absmax.float())
        else:
            dyn = torch.tensor(DYNAMIC_VALUES, dtype=torch.float32, device=self.absmax.device)
            if self.nested_blocksize != SCALE_BLOCKSIZE or not torch.equal(self.nested_quant_map, dyn):
                return None
            absmax_q, absmax_scale = self.absmax, self.nested_absmax
            offset = torch.tensor(self.offset, dtype=torch.float32, device=self.absmax.device)
        return NF4Weight(self.codes, absmax_q, absmax_scale, offset, self.shape, self.dtype)


def read(key: str, parts: StoredParts, get: Callable[[Path, str], Tensor]) -> StoredNF4:
    """The weight `key` from its parts, each read by get(file, key) (on the loader's device, as stored); the sizes
    are checked against the quant state, an error naming the file and tensor."""
    s = parts.state
    t = {suffix: get(*where) for suffix, where in parts.files.items()}
    n = math.prod(parts.shape)
    path = parts.files[""][0]
    codes = t[""].contiguous().view(-1).view(torch.uint8)  # another quant_storage dtype: the same bytes
    blocks = -(-n // s["blocksize"])
    nested = ".nested_absmax" in t
    sizes = {"": (codes.numel(), -(-n // 2)), ".absmax": (t[".absmax"].numel(), blocks),
             ".quant_map": (t[".quant_map"].numel(), 16)}
    if nested:
        sizes[".nested_absmax"] = (t[".nested_absmax"].numel(), -(-blocks // s["nested_blocksize"]))
        sizes[".nested_quant_map"] = (t[".nested_quant_map"].numel(), 256)
    wrong = [f"{key}{suffix} holds {got:,} elements (bytes for the codes), not {want:,}"
             for suffix, (got, want) in sizes.items() if got != want]
    if wrong:
        raise ValueError(f"{path}: the 4-bit weight {key} of shape {list(parts.shape)} (its quant state) does not "
                         f"match its parts: {'; '.join(wrong)}")
    if (t[".absmax"].dtype == torch.uint8) != nested:
        raise ValueError(f"{path}: the 4-bit weight {key}: absmax of {t['.absmax'].dtype} with"
                         f"{'' if nested else 'out'} double quantisation (its quant state's nested_blocksize); "
                         "bitsandbytes saves uint8 scales exactly when they are double-quantised")
    return StoredNF4(codes, t[".absmax"] if nested else t[".absmax"].float(), t[".quant_map"].float(),
                     t[".nested_absmax"].float() if nested else None,
                     t[".nested_quant_map"].float() if nested else None, float(s.get("nested_offset", 0.0)),
                     s["blocksize"], s.get("nested_blocksize", 0), s["quant_type"], parts.shape, _DTYPES[s["dtype"]])
