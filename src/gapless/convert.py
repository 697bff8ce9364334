"""Configs from the peers: an Axolotl YAML or a TRL SFTConfig-style YAML as a gapless config dict.

`detect(raw)` names the format of a parsed YAML mapping; `convert(raw, fmt)` returns the gapless dict and the
mapping it applied, one line per source key, or raises ValueError naming every key it cannot honour (a setting
that would change what trains, silently dropped, is a run that is not the one the user asked for). Keys whose
value is empty (`wandb_project:`), or that only say what gapless does anyway, are accepted and listed.

Axolotl's keys are those of its config reference (docs.axolotl.ai/docs/config-reference.html); TRL's are
SFTConfig's and TrainingArguments' fields as `trl sft --config FILE.yaml` reads them, plus the script arguments
`model_name_or_path` and `dataset_name` and the PEFT model arguments (`use_peft`, `lora_r`, ...).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gapless.config import ALL_LINEAR, DataConfig, RunConfig
from gapless.data.chat_templates import TEMPLATES
from gapless.data.formats import GZIPPED, SUFFIXES


# A Hugging Face hub id (`meta-llama/Llama-3.2-1B`): one slash, no leading `/`, `.` or `~`.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")

AXOLOTL_MARKERS = ("base_model", "datasets", "sequence_len", "micro_batch_size", "sample_packing", "adapter",
                   "num_epochs", "lora_target_linear")
TRL_MARKERS = ("model_name_or_path", "dataset_name", "per_device_train_batch_size", "num_train_epochs",
               "max_seq_length", "max_length", "dataset_text_field", "lr_scheduler_type", "use_peft")


def detect(raw: dict) -> str:
    """'gapless', 'axolotl' or 'trl': gapless when every top-level key is a RunConfig field."""
    import dataclasses

    fields = {f.name for f in dataclasses.fields(RunConfig)}
    if set(raw) <= fields:
        return "gapless"
    axolotl = sum(k in raw for k in AXOLOTL_MARKERS)
    trl = sum(k in raw for k in TRL_MARKERS)
    if axolotl == trl == 0:
        return "gapless"  # from_dict names the unknown keys
    return "axolotl" if axolotl >= trl else "trl"


@dataclass
class Conversion:
    config: dict
    fmt: str
    applied: list[tuple[str, str]] = field(default_factory=list)  # (source key = value, what it became)
    hub_paths: list[str] = field(default_factory=list)  # hub ids among its paths (write_gapless_yaml fills it)

    def format(self) -> str:
        width = max((len(s) for s, _ in self.applied), default=0)
        return "\n".join([f"{self.fmt} config -> gapless:"] + [f"  {s:<{width}}  ->  {t}" for s, t in self.applied])


def is_hub_id(path: str) -> bool:
    """A missing `data/train.jsonl` is a file not found, not a hub id: a data file's suffix says it is a path."""
    data_file = path.lower().endswith((*SUFFIXES, *GZIPPED))
    return bool(HUB_ID.fullmatch(path)) and not data_file and not Path(path).expanduser().exists()


def check_local(path: str | None, where: str, what: str) -> str | None:
    """An error line when `path` (the value of setting `where`) is a hub id rather than a local folder."""
    if path and is_hub_id(path):
        return (f"{where}: {path!r} looks like a Hugging Face hub id; gapless reads {what} from a local folder. "
                f"Download it first (e.g. `hf download {path} --local-dir /models/{path.split('/')[-1]}`) "
                f"and set {where} to that folder")
    return None


def hub_paths(cfg: RunConfig) -> list[str]:
    """A line (check_local's) for every hub id among the model, tokenizer and data paths, named by its field."""
    lines = [check_local(cfg.model.path, "model.path", "the model (config.json + *.safetensors)"),
             check_local(cfg.data.tokenizer, "data.tokenizer", "the tokenizer")]
    for key in ("sources", "eval_sources"):
        for i, s in enumerate(getattr(cfg.data, key)):
            lines.append(check_local(s.path, f"data.{key}[{i}].path", "data files (.jsonl, .json, .parquet, ...)"))
    return [line for line in lines if line]


def check_run_paths(cfg: RunConfig) -> None:
    """Every hub id among the model, tokenizer and data paths (hub_paths), in one ValueError."""
    errors = hub_paths(cfg)
    if errors:
        raise ValueError("\n".join(errors))


def _set(out: dict, dotted: str, value: Any) -> None:
    node = out
    parts = dotted.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value


def _method_accepted(name: str) -> bool:
    import typing

    return name in typing.get_args(typing.get_type_hints(RunConfig)["method"])


class _Converter:
    """Shared bookkeeping: what was applied, what is refused (all of it reported at once)."""

    def __init__(self, raw: dict, fmt: str):
        self.raw, self.out = raw, {}
        self.conv = Conversion(self.out, fmt)
        self.refused: list[str] = []
        self.seen: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.seen.add(key)
        return self.raw.get(key, default)

    def has(self, key: str) -> bool:
        return self.raw.get(key) not in (None, "")

    def put(self, key: str, dotted: str, value: Any, note: str = "") -> None:
        self.seen.add(key)
        _set(self.out, dotted, value)
        self.conv.applied.append((f"{key}: {_show(self.raw.get(key))}",
                                  f"{dotted}: {_show(value)}" + (f"  ({note})" if note else "")))

    def note(self, key: str, text: str) -> None:
        self.seen.add(key)
        self.conv.applied.append((f"{key}: {_show(self.raw.get(key))}", text))

    def refuse(self, key: str, why: str) -> None:
        self.seen.add(key)
        self.refused.append(f"{key}: {_show(self.raw.get(key))}: {why}")

    def method(self, key: str, name: str) -> None:
        if _method_accepted(name):
            self.put(key, "method", name)
        else:
            self.refuse(key, f"needs gapless method {name!r}, which this version does not have "
                             f"(RunConfig.method accepts {', '.join(_methods())})")

    def finish(self, ignorable: dict[str, str]) -> Conversion:
        for key in self.raw:
            if key in self.seen:
                continue
            if key in ignorable:
                self.note(key, ignorable[key])
            elif self.raw[key] in (None, "", [], {}):
                self.note(key, "empty: nothing to apply")
            else:
                self.refuse(key, REFUSED_HINTS.get(key, "no gapless equivalent; remove it to train without it"))
        if self.refused:
            raise ValueError(f"{self.conv.fmt} config: {len(self.refused)} setting(s) gapless cannot honour "
                             "(remove or change them; nothing is ignored silently):\n  "
                             + "\n  ".join(self.refused))
        return self.conv


# what to write instead of a key gapless cannot honour, where there is something
REFUSED_HINTS = {
    "deepspeed": "gapless shards with FSDP2 under torchrun (gapless train --nproc N; parallel.strategy), not "
                 "DeepSpeed: remove it",
    "hub_model_id": "gapless does not upload; push RUN/adapter (or an export) with `hf upload`, and remove it",
    "hub_strategy": "gapless does not upload; remove it",
    "resume_from_checkpoint": "gapless resumes its own checkpoints in output_dir (resume: true, or gapless train "
                              "--resume), not a Trainer checkpoint folder",
    "tokens": "gapless trains with the tokenizer's own tokens (new tokens need new embedding rows)",
    "lora_modules_to_save": "gapless trains LoRA adapters on linear layers only, no full embedding or lm_head copy",
    "pretraining_dataset": "give the files under datasets with type: completion (read whole, not streamed)",
    "fsdp": "gapless shards with FSDP2 under torchrun (gapless train --nproc N; parallel.strategy), not from this "
            "key: remove it",
    "fsdp_config": "gapless shards with FSDP2 under torchrun (parallel.strategy, parallel.reshard_after_forward): "
                   "remove it",
}


def _methods() -> tuple[str, ...]:
    import typing

    return typing.get_args(typing.get_type_hints(RunConfig)["method"])


def _show(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _precision(c: _Converter) -> None:
    # Axolotl's bf16 is true, auto (bf16 where the GPU has it) or full (bf16 evaluation too): each trains in bf16
    bf16, fp16 = c.get("bf16") in (True, "auto", "full"), c.get("fp16") is True
    present = [k for k in ("bf16", "fp16") if k in c.raw]
    if bf16 and fp16:
        c.refuse("fp16", "bf16 and fp16 are both on; keep one")
    elif bf16 or fp16:
        on = "bf16" if bf16 else "fp16"
        c.put(on, "model.dtype", "bfloat16" if bf16 else "float16")
        for key in present:
            if key != on:
                c.note(key, "off")
    elif present:
        c.put(present[0], "model.dtype", "float32", "neither bf16 nor fp16 is on")
        for key in present[1:]:
            c.note(key, "off")
    # Axolotl's bfloat16 / float16 ("for non-AMP cases"): the weights load in that dtype, and without bf16 / fp16
    # autocast the run computes in it too (phi/lora-3.5.yaml sets bfloat16 beside bf16)
    for key in ("bfloat16", "float16"):
        autocast = "bfloat16" if bf16 else "float16" if fp16 else None
        if c.get(key) is True and autocast in (None, key):
            c.put(key, "model.dtype", key)
        elif c.get(key) is True:
            c.refuse(key, f"{'bf16' if bf16 else 'fp16'} computes in {autocast}; keep one of the two")
        elif key in c.raw:
            c.note(key, "off")
    tf32 = c.get("tf32")
    if tf32 is True:
        # TF32 only changes float32 matmuls; gapless leaves torch's default (TF32 off) and has no switch for it
        if c.out.get("model", {}).get("dtype") in ("bfloat16", "float16"):
            c.note("tf32", "no effect: the model's matmuls run in half precision")
        else:
            c.refuse("tf32", "gapless has no TF32 switch for float32 matmuls; train in bf16 (bf16: true)")
    elif "tf32" in c.raw:
        c.note("tf32", "off, as gapless runs float32 matmuls")


def _schedule(c: _Converter, key: str) -> None:
    kind = c.get(key)
    kwargs = c.get("lr_scheduler_kwargs")
    if kind is not None:
        known = {"cosine": "cosine", "linear": "linear", "constant": "constant", "constant_with_warmup": "constant",
                 "cosine_with_min_lr": "cosine"}
        if kind in known:
            c.put(key, "schedule.kind", known[kind])
        else:
            c.refuse(key, f"gapless schedules are {sorted(known)}")
    # transformers' cosine_with_min_lr decays to min_lr_rate x the peak (or to min_lr): schedule.min_lr_ratio
    if kind == "cosine_with_min_lr":
        kwargs = kwargs if isinstance(kwargs, dict) else {}
        if set(kwargs) - {"min_lr_rate", "min_lr", "num_cycles"} or kwargs.get("num_cycles", 0.5) != 0.5:
            c.refuse("lr_scheduler_kwargs", "gapless's cosine takes min_lr_rate or min_lr (one half-cycle)")
        elif "min_lr_rate" in kwargs and "min_lr" not in kwargs:
            c.put("lr_scheduler_kwargs", "schedule.min_lr_ratio", float(kwargs["min_lr_rate"]))
        elif "min_lr" in kwargs and "min_lr_rate" not in kwargs:
            lr = float(c.raw.get("learning_rate") or 0) or None
            if lr:
                c.put("lr_scheduler_kwargs", "schedule.min_lr_ratio", float(kwargs["min_lr"]) / lr,
                      f"min_lr / learning_rate {lr}")
            else:
                c.refuse("lr_scheduler_kwargs", "min_lr needs learning_rate set; or give min_lr_rate")
        else:
            c.refuse("lr_scheduler_kwargs", "cosine_with_min_lr needs one of min_lr_rate and min_lr")
    elif kwargs and set(kwargs) == {"num_cycles"} and kwargs["num_cycles"] == 0.5 and kind in (None, "cosine"):
        c.note("lr_scheduler_kwargs", "num_cycles 0.5: cosine's one half-cycle, as gapless's")
    elif kwargs:
        c.refuse("lr_scheduler_kwargs", "gapless's schedules take no arguments but cosine_with_min_lr's min_lr_rate")
    # Axolotl's cosine_min_lr_ratio: its cosine decays to that fraction of the peak (read with lr_scheduler: cosine)
    ratio = c.get("cosine_min_lr_ratio")
    if ratio is not None and kind in (None, "cosine"):
        c.put("cosine_min_lr_ratio", "schedule.min_lr_ratio", float(ratio))
    elif ratio is not None:
        c.note("cosine_min_lr_ratio", f"unused: Axolotl reads it with lr_scheduler: cosine, not {kind}")


# bitsandbytes' AdamW variants (TrainingArguments' names): 8-bit moments, or moments paged to the host under memory
# pressure. For an adapter the float32 moments are small (Llama-3.2-3B LoRA r16: 24.3 M trainable, 0.18 GiB of
# moments), so plain AdamW takes their place; full fine-tuning, where they are 2 x 4 bytes per weight, refuses them
LOW_MEMORY_ADAMW = ("adamw_8bit", "adamw_bnb_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "adamw_torch_8bit")


def _optimizer(c: _Converter, key: str, adapter: bool) -> None:
    """`adapter`: the config trains LoRA or QLoRA (not every weight)."""
    name = c.get(key)
    if name is None:
        return
    # gapless runs torch's AdamW (decoupled weight decay), fused on CUDA by default
    adamw = {"adamw_torch": None, "adamw_hf": None, "adamw": None, "adamw_torch_fused": True}
    if name in adamw:
        if adamw[name] is None:
            c.note(key, "AdamW (torch.optim.AdamW; fused on CUDA)")
        else:
            c.put(key, "optim.fused", True)
    elif name in LOW_MEMORY_ADAMW and adapter:
        c.note(key, "AdamW with float32 moments (torch.optim.AdamW): an adapter's moments are small (0.18 GiB for "
                    "Llama-3.2-3B r16), so 8-bit or paged ones save little")
    elif name in LOW_MEMORY_ADAMW:
        c.refuse(key, "full fine-tuning keeps float32 AdamW moments (8 bytes per weight, sharded by FSDP2 over "
                      "GPUs); gapless has no 8-bit or paged optimizer: adamw_torch, or an adapter (lora, qlora)")
    else:
        c.refuse(key, "gapless trains with torch's AdamW only (adamw_torch, adamw_torch_fused)")


def _steps(c: _Converter, key: str, dotted: str) -> None:
    """A step interval (save_steps, eval_steps, logging_steps). TrainingArguments, which Axolotl and TRL pass
    these to, reads a value in (0, 1) as a ratio of the run's total steps: int() would make it 0 (for save_steps,
    no checkpoints at all)."""
    value = float(c.get(key))
    if 0 < value < 1:
        c.refuse(key, f"a ratio of the run's steps (values below 1 are one in TrainingArguments); gapless takes "
                      f"a number of optimizer steps: set {key} to an integer (or {dotted} in a gapless config)")
    elif value != int(value):
        c.refuse(key, "expected a whole number of steps")
    else:
        c.put(key, dotted, int(value))


def _warmup(c: _Converter, schedule_key: str) -> None:
    steps, ratio = c.get("warmup_steps"), c.get("warmup_ratio")
    if c.raw.get(schedule_key) == "constant":
        # transformers' get_scheduler returns get_constant_schedule(optimizer) for constant, before it reads the
        # warmup: the peers warm up only with constant_with_warmup
        for key in ("warmup_steps", "warmup_ratio"):
            if key in c.raw:
                c.note(key, f"no effect: {schedule_key} constant has no warmup in transformers (constant_with_warmup "
                            "has)")
        return
    if steps and 0 < float(steps) < 1:
        # transformers 5 dropped warmup_ratio: warmup_steps in (0, 1) is the ratio of the run's steps
        if ratio:
            c.refuse("warmup_steps", "a ratio (below 1) and warmup_ratio are both set; keep one")
        else:
            c.put("warmup_steps", "schedule.warmup_ratio", float(steps),
                  "below 1: a ratio of the run's steps, as TrainingArguments reads it")
    elif steps:
        if float(steps) != int(float(steps)):
            c.refuse("warmup_steps", "expected a whole number of steps, or a ratio below 1")
        else:
            c.put("warmup_steps", "schedule.warmup_steps", int(float(steps)))
    elif "warmup_steps" in c.raw:
        c.note("warmup_steps", "0: no warmup")
    if ratio:
        c.put("warmup_ratio", "schedule.warmup_ratio", float(ratio))
    elif "warmup_ratio" in c.raw:
        c.note("warmup_ratio", "0: no warmup")


# keys that Axolotl and TRL name alike and that map one to one: (key, gapless field, type)
SHARED_KEYS = [("gradient_accumulation_steps", "train.grad_accum", int), ("learning_rate", "optim.lr", float),
               ("weight_decay", "optim.weight_decay", float), ("max_grad_norm", "optim.grad_clip", float),
               ("adam_epsilon", "optim.eps", float), ("save_total_limit", "checkpoint.keep", int),
               ("seed", "train.seed", int), ("ddp_timeout", "parallel.timeout_s", int),
               ("output_dir", "output_dir", str), ("lora_r", "lora.r", int), ("lora_alpha", "lora.alpha", float),
               ("lora_dropout", "lora.dropout", float)]


def _harmless(c: _Converter) -> None:
    """Keys that change nothing in gapless for some values (noted) and would for others (refused)."""
    kwargs = c.get("gradient_checkpointing_kwargs")
    if isinstance(kwargs, dict) and set(kwargs) <= {"use_reentrant"}:
        c.note("gradient_checkpointing_kwargs", "gapless's activation checkpointing is torch's non-reentrant form")
    elif kwargs:
        c.refuse("gradient_checkpointing_kwargs", "gapless's activation checkpointing takes no arguments")
    tokens = c.get("special_tokens")
    if isinstance(tokens, dict) and set(tokens) == {"pad_token"}:
        c.note("special_tokens", "pad_token: padding is masked out of the loss and attention, so its id does not "
                                 "change training")
    elif tokens:
        c.refuse("special_tokens", "gapless trains with the tokenizer's own special tokens (new or changed tokens "
                                   "need new embedding rows); only pad_token may be set")
    for key in [k for k in c.raw if k in KERNEL_SWITCHES and k not in c.seen]:
        c.note(key, "a kernel choice (the same sums, faster or leaner); gapless runs its own fused kernels")
    for key in [k for k in c.raw if k in OFF_SWITCHES and k not in c.seen]:
        if c.raw[key] in (False, None, "", 0):
            c.note(key, "off")
        else:
            c.refuse(key, OFF_SWITCHES[key])
    compile_ = c.get("torch_compile")
    if compile_ in (True, False, "auto"):
        c.put("torch_compile", "model.compile", compile_)
    elif compile_ is not None:
        c.refuse("torch_compile", "expected true, false or auto")
    if c.get("torch_compile_backend") not in (None, "inductor"):
        c.refuse("torch_compile_backend", "gapless compiles with inductor")
    elif "torch_compile_backend" in c.raw:
        c.note("torch_compile_backend", "inductor, as gapless compiles")
    if "torch_compile_mode" in c.raw:
        c.note("torch_compile_mode", "gapless compiles each decoder layer its own way (the same sums)")


# Axolotl's and TRL's switches for fused kernels (Liger's, Cut Cross-Entropy, flash-attn's, Unsloth's and Axolotl's
# own fused LoRA layers, other attention kernels): on or off, the model computes the same function, as gapless's
# kernels do
KERNEL_SWITCHES = ("use_liger_kernel", "liger_kernel_config", "liger_rope", "liger_rms_norm", "liger_glu_activation",
                   "liger_swiglu", "liger_layer_norm", "liger_cross_entropy", "liger_fused_linear_cross_entropy",
                   "cut_cross_entropy", "flash_attn_cross_entropy", "flash_attn_rms_norm", "flash_attn_fuse_qkv",
                   "flash_attn_fuse_mlp", "xformers_attention", "eager_attention", "unsloth_cross_entropy_loss",
                   "unsloth_lora_mlp", "unsloth_lora_qkv", "unsloth_lora_o", "unsloth_rms_norm", "unsloth_rope",
                   "lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel", "fused_attn_kernel",
                   "use_liger")  # SFTConfig's name before TrainingArguments' use_liger_kernel (open-r1's recipes)
# switches that change nothing when off (the peers' default) and what trains when on: why gapless refuses them on
OFF_SWITCHES = {
    "s2_attention": "shifted sparse attention (LongLoRA) attends differently; gapless attends to the whole document",
    "lora_fan_in_fan_out": "for Conv1D layers (GPT-2); a Llama-family decoder's are nn.Linear",
    "gptq": "gapless trains unquantized or NF4 (qlora) bases, not GPTQ ones",
    "peft_use_dora": "gapless trains LoRA, not DoRA",
    "use_dora": "gapless trains LoRA, not DoRA",
    "load_best_model_at_end": "gapless's output is the last step's weights; its checkpoints stay in the run folder",
    "push_to_hub": "gapless does not upload; push RUN/adapter (or an export) with `hf upload`",
}


def _one_to_one(c: _Converter, table: list[tuple[str, str, type]]) -> None:
    for key, dotted, cast in table:
        if c.has(key):
            c.put(key, dotted, cast(c.get(key)))
    if c.has("logging_steps"):
        _steps(c, "logging_steps", "train.log_every")
    betas = [float(c.raw.get("adam_beta1", 0.9)), float(c.raw.get("adam_beta2", 0.999))]
    for key in ("adam_beta1", "adam_beta2"):
        if c.has(key):
            c.put(key, "optim.betas", betas)


def _model_and_length(c: _Converter, model_key: str, seq_key: str, default: int, who: str) -> int:
    """model.path and data.max_seq_len (the peer's default when unset); returns the length."""
    if c.get(model_key) is None:
        c.refused.append(f"{model_key}: missing; give the model's local folder")
    else:
        c.put(model_key, "model.path", str(c.get(model_key)))
    seq = int(c.get(seq_key) or default)
    if seq_key in c.raw:
        c.put(seq_key, "data.max_seq_len", seq)
    else:
        _set(c.out, "data.max_seq_len", seq)
        c.conv.applied.append((f"{seq_key}: (unset)", f"data.max_seq_len: {default}  ({who}'s default)"))
    return seq


def _lora_targets(c: _Converter, key: str) -> None:
    targets = c.get(key)
    if targets is None:
        return
    if targets == "all-linear":
        c.put(key, "lora.target_modules", list(ALL_LINEAR))
    elif isinstance(targets, list) and set(targets) <= set(ALL_LINEAR) and targets:
        c.put(key, "lora.target_modules", list(targets))
    else:
        c.refuse(key, f"gapless adapts only the decoder's linear layers {list(ALL_LINEAR)}")


def _default(c: _Converter, key: str, dotted: str, value: Any, who: str, note: str = "") -> None:
    """`key` is unset in the source: the peer's own default for it, not gapless's, and the mapping says so."""
    _set(c.out, dotted, value)
    c.conv.applied.append((f"{key}: (unset)", f"{dotted}: {_show(value)}  ({who}'s default{note})"))


def _batch(c: _Converter, batch_key: str, seq: int, packing: bool, default: int, who: str) -> None:
    """The peer's per-device batch size: packed, that many rows of seq slots; unpacked, that many documents per batch
    (data.rows_per_batch), each padded to the batch's longest, within as many rows of seq slots. Without the rows
    cap gapless would fill those slots with as many documents as fit (39 of 100 tokens, padded to 104, in 2 x 2048):
    other examples per optimizer step than the peer trains."""
    micro = c.get(batch_key)
    rows = default if micro is None else int(micro)
    # unpacked rows are padded up to a multiple of data.pad_to_multiple_of (8): N documents of a max_length of 2,047
    # fill N x 2,048 slots, and N x 2,047 would hold N - 1 of them
    multiple = DataConfig.pad_to_multiple_of
    width = seq if packing else -(-seq // multiple) * multiple
    targets = [("data.tokens_per_batch", rows * width, f"{rows} rows of {seq} slots, packed" if packing else
                f"{rows} x {width} slots at most, each document padded to its batch's longest")]
    if not packing:
        targets.append(("data.rows_per_batch", rows, f"{rows} documents per batch, not as many as fit in the slots"))
    for dotted, value, how in targets:
        if micro is None:
            _default(c, batch_key, dotted, value, who, f": {how}")
        else:
            c.put(batch_key, dotted, value, how)


def _trainer_arguments(c: _Converter, lr: float, who: str, adapter: bool) -> str:
    """TrainingArguments' keys as TRL's SFTConfig and LLaMA-Factory take them (`lr`: the peer's default learning rate,
    `who` names it; `adapter`: the config trains LoRA or QLoRA); returns the evaluation strategy."""
    raw = c.raw
    _one_to_one(c, SHARED_KEYS)
    _harmless(c)
    if not c.has("learning_rate"):
        _default(c, "learning_rate", "optim.lr", lr, who)
    _schedule(c, "lr_scheduler_type")
    if "lr_scheduler_type" not in raw:
        _default(c, "lr_scheduler_type", "schedule.kind", "linear", "TrainingArguments")
    _warmup(c, "lr_scheduler_type")
    if c.has("num_train_epochs"):
        c.put("num_train_epochs", "train.epochs", float(c.get("num_train_epochs")))
    else:
        _default(c, "num_train_epochs", "train.epochs", 3.0, "TrainingArguments")
    if c.has("max_steps"):
        if int(c.get("max_steps")) > 0:
            c.put("max_steps", "train.steps", int(c.get("max_steps")))
        else:
            c.note("max_steps", "-1: the epochs decide")
    _optimizer(c, "optim", adapter=adapter)
    strategy = c.get("save_strategy", "steps")
    if strategy == "steps" and c.has("save_steps"):
        _steps(c, "save_steps", "checkpoint.every")
    elif strategy == "no":
        c.put("save_strategy", "checkpoint.every", 0)
    elif strategy == "epoch":
        c.put("save_strategy", "checkpoint.per_epoch", 1, "a checkpoint per pass over the data")
    elif strategy not in ("steps",):
        c.refuse("save_strategy", "gapless saves every N steps or N times per epoch (save_strategy: steps or epoch)")
    if strategy in ("no", "epoch") and c.has("save_steps"):
        c.note("save_steps", f"unused: save_strategy is {strategy}")
    eval_key = "eval_strategy" if "eval_strategy" in c.raw else "evaluation_strategy"  # the name before 4.46
    eval_strategy = c.get(eval_key, "no")
    if eval_strategy == "steps" and c.has("eval_steps"):
        _steps(c, "eval_steps", "train.eval_every")
    elif eval_strategy == "epoch":
        # gapless evaluates held-out data only: an override (data.eval_fraction, data.eval_sources) gives it
        c.put(eval_key, "train.evals_per_epoch", 1, "an evaluation per pass over the data")
    elif eval_strategy not in ("no", "steps"):
        c.refuse(eval_key, "gapless evaluates every N steps or N times per epoch (eval_strategy: steps or epoch)")
    if c.has("eval_steps") and eval_strategy in ("no", "epoch"):
        c.note("eval_steps", f"unused: {eval_key} is {eval_strategy}")
    if c.get("logging_strategy", "steps") != "steps":
        c.refuse("logging_strategy", "gapless logs every N steps (logging_steps)")
    _trl_report_to(c)
    return eval_strategy


# ---------------------------------------------------------------------------------------------
# Axolotl


# keys of both peers that change nothing gapless does: how the Trainer loads batches and what it logs or saves
SHARED_IGNORABLE = {
    "dataloader_num_workers": "how batches are loaded, not what they hold (data.num_workers sets the tokenizer's)",
    "dataloader_pin_memory": "how batches are loaded, not what they hold",
    "dataloader_prefetch_factor": "how batches are loaded, not what they hold",
    "dataloader_persistent_workers": "how batches are loaded, not what they hold",
    "remove_unused_columns": "gapless reads only the fields of the records' format",
    "ddp_find_unused_parameters": "no effect on what trains",
    "include_tokens_per_second": "gapless logs tokens/s",
    "save_safetensors": "gapless writes safetensors",
}

# keys that change nothing gapless does, with why
AXOLOTL_IGNORABLE = {
    **SHARED_IGNORABLE,
    "model_type": "read from the checkpoint's config.json",
    "tokenizer_type": "the checkpoint's tokenizer (HF fast tokenizer)",
    "base_model_config": "read from the checkpoint's config.json",
    "strict": "gapless refuses unknown keys always",
    "flash_attention": None,  # handled
    "sdp_attention": "model.attn_backend auto: sdpa where varlen cannot run",
    "pad_to_sequence_len": "packed rows are full length; padded batches pad to the longest",
    "eval_sample_packing": "evaluation batches use the training batching",
    "dataset_prepared_path": "gapless caches tokenized data in data.cache_dir",
    "group_by_length": None,
    "train_on_inputs": None,
    "local_rank": "set by the launcher",
    "debug": "no effect on what trains",
    "use_tensorboard": None,
    "wandb_mode": None, "wandb_project": None, "wandb_entity": None, "wandb_watch": None, "wandb_name": None,
    "wandb_log_model": None,
    "attn_implementation": "model.attn_backend auto picks the fastest that runs",
    "trust_remote_code": "gapless builds the model with its own decoder from config.json; no remote code runs",
    "eval_max_new_tokens": "gapless's evaluation measures the loss; it generates no samples",
    "eval_table_size": "a table of generated samples logged at evaluation; gapless's evaluation measures the loss",
    "eval_table_max_new_tokens": "see eval_table_size",
    "loss_watchdog_threshold": "gapless does not stop a run whose finite loss stays high (a step whose loss is not "
                               "finite updates nothing, 5 in a row stop the run): a run that trains is the same",
    "loss_watchdog_patience": "see loss_watchdog_threshold",
    "is_llama_derived_model": "read from the checkpoint's config.json",
    "is_mistral_derived_model": "read from the checkpoint's config.json",
    "is_qwen_derived_model": "read from the checkpoint's config.json",
    "auto_resume_from_checkpoints": None,  # handled
    "eval_batch_size": "evaluation batches use the training batching (the loss per token is the same)",
    "plugins": None,  # handled
}


def convert_axolotl(raw: dict) -> Conversion:
    c = _Converter(raw, "axolotl")
    seq = _model_and_length(c, "base_model", "sequence_len", 2048, "Axolotl")
    if c.has("tokenizer_config"):
        c.put("tokenizer_config", "data.tokenizer", str(c.get("tokenizer_config")))
    packing = bool(c.get("sample_packing"))
    if "sample_packing" in raw:
        c.put("sample_packing", "data.batching", "packed" if packing else "padded")
    else:
        _set(c.out, "data.batching", "padded")
        c.conv.applied.append(("sample_packing: (unset)", "data.batching: padded  (Axolotl's default: no packing)"))
    _batch(c, "micro_batch_size", seq, packing, 1, "Axolotl")
    _one_to_one(c, SHARED_KEYS)
    _harmless(c)
    if c.has("dataset_processes"):
        c.put("dataset_processes", "data.num_workers", int(c.get("dataset_processes")))
    if not c.has("learning_rate"):
        c.refused.append("learning_rate: missing; Axolotl requires it (gapless would train at its own 2e-4)")
    _schedule(c, "lr_scheduler")
    _warmup(c, "lr_scheduler")
    if c.raw.get("warmup_steps") is None and c.raw.get("warmup_ratio") is None \
            and c.raw.get("lr_scheduler") != "constant":
        # Axolotl's trainer builder warms up min(int(0.03 x total steps), 100) steps when neither is set
        _default(c, "warmup_ratio", "schedule.warmup_ratio", 0.03, "Axolotl",
                 ": 3% of the steps, at most 100 there, so a run over 3,333 steps warms up longer here")
    if c.has("num_epochs"):
        c.put("num_epochs", "train.epochs", float(c.get("num_epochs")))
    if c.has("max_steps") and int(c.get("max_steps")) > 0:
        c.put("max_steps", "train.steps", int(c.get("max_steps")))
    elif c.has("max_steps"):
        c.note("max_steps", f"{c.get('max_steps')}: the epochs decide")
    _optimizer(c, "optimizer", adapter=c.has("adapter"))
    _precision(c)
    if c.has("gradient_checkpointing"):
        gc = c.get("gradient_checkpointing")
        if gc is True:
            c.put("gradient_checkpointing", "model.activation_checkpointing", 1, "every layer")
        elif gc in ("offload", "offload_disk"):
            c.put("gradient_checkpointing", "model.activation_checkpointing", 1,
                  "every layer; the checkpointed activations stay on the GPU (gapless does not offload them)")
        elif gc is False:
            c.note("gradient_checkpointing", "off")
        else:
            c.refuse("gradient_checkpointing", "expected true, false, offload or offload_disk")
    if c.has("save_steps"):
        _steps(c, "save_steps", "checkpoint.every")
    # Axolotl evaluates only with held-out data (its trainer sets eval_strategy no without it); its examples keep
    # evals_per_epoch beside val_set_size: 0
    held_out = bool(c.raw.get("val_set_size")) or c.has("test_datasets")
    if not held_out:
        for key in ("eval_steps", "evals_per_epoch"):
            if c.has(key):
                c.note(key, "unused: no held-out data (val_set_size 0, no test_datasets), so Axolotl does not "
                            "evaluate")
    elif c.has("eval_steps"):
        _steps(c, "eval_steps", "train.eval_every")
    if held_out:
        _per_epoch(c, "evals_per_epoch", "eval_steps", "train.evals_per_epoch", "train.eval_every")
    _per_epoch(c, "saves_per_epoch", "save_steps", "checkpoint.per_epoch", "checkpoint.every")
    val = c.get("val_set_size")
    if val:
        if 0 < float(val) < 1:
            c.put("val_set_size", "data.eval_fraction", float(val))
        else:
            c.refuse("val_set_size", "gapless holds out a fraction of the records (0 < val_set_size < 1), "
                                     "not a count")
    elif "val_set_size" in raw:
        c.note("val_set_size", "0: no held-out split")
    if "train_on_inputs" in raw:
        c.put("train_on_inputs", "data.train_on", "all" if c.get("train_on_inputs") else "assistant")
    if c.get("group_by_length"):
        c.put("group_by_length", "data.batching", "length_grouped")
    elif "group_by_length" in raw:
        c.note("group_by_length", "off")
    # the method: lora, qlora, or full fine-tuning (no adapter)
    adapter = c.get("adapter")
    if adapter == "lora":
        c.method("adapter", "lora")
        if c.get("load_in_8bit") or c.get("load_in_4bit"):
            c.refuse("load_in_8bit" if c.get("load_in_8bit") else "load_in_4bit",
                     "a quantized base is adapter: qlora (4-bit) in gapless; 8-bit bases are not supported")
    elif adapter == "qlora":
        c.method("adapter", "qlora")
        if c.get("load_in_8bit"):
            c.refuse("load_in_8bit", "qlora quantizes the base to 4 bits (NF4), not 8")
        if c.get("load_in_4bit"):
            c.note("load_in_4bit", "QLoRA: the base in 4 bits (NF4, double quantisation)")
    elif adapter in (None, ""):  # no adapter: Axolotl fine-tunes every weight
        c.method("adapter", "full")
        if c.get("load_in_8bit") or c.get("load_in_4bit"):
            c.refuse("load_in_8bit" if c.get("load_in_8bit") else "load_in_4bit",
                     "a quantized base needs adapter: qlora")
    else:
        c.refuse("adapter", "gapless methods are lora, qlora and full fine-tuning (no adapter key)")
    for key in ("load_in_8bit", "load_in_4bit"):
        if key in raw and not raw[key]:
            c.note(key, "off")
    if c.get("lora_target_linear"):
        c.put("lora_target_linear", "lora.target_modules", list(ALL_LINEAR))
        if c.has("lora_target_modules"):
            c.note("lora_target_modules", "lora_target_linear: true adds every linear layer")
    elif "lora_target_linear" in raw:
        c.note("lora_target_linear", "off")
    if not c.get("lora_target_linear"):
        _lora_targets(c, "lora_target_modules")
    if c.get("peft_use_rslora"):
        c.put("peft_use_rslora", "lora.use_rslora", True)
    if c.has("chat_template"):
        _chat_template(c, "chat_template", c.get("chat_template"), "data.chat_template")
    if c.get("flash_attention") is False:
        c.put("flash_attention", "model.attn_backend", "sdpa")
    elif c.get("flash_attention"):
        c.note("flash_attention", "model.attn_backend auto: varlen flash attention on a CUDA GPU")
    _wandb(c)
    if c.get("auto_resume_from_checkpoints"):
        c.put("auto_resume_from_checkpoints", "resume", True, "from the newest checkpoint in output_dir, if any")
    elif "auto_resume_from_checkpoints" in raw:
        c.note("auto_resume_from_checkpoints", "off")
    plugins = c.get("plugins") or []
    unknown = [p for p in plugins if p not in KERNEL_PLUGINS]
    if unknown:
        c.refuse("plugins", f"{unknown}: gapless runs Axolotl's kernel plugins' work with its own kernels "
                            f"({', '.join(KERNEL_PLUGINS)}); the others have no gapless equivalent")
    elif plugins:
        c.note("plugins", "kernel plugins (the same sums); gapless runs its own fused kernels")
    _axolotl_datasets(c, "datasets", "data.sources")
    if c.has("test_datasets"):
        _axolotl_datasets(c, "test_datasets", "data.eval_sources")
    _overlong(c)
    ignorable = {k: v for k, v in AXOLOTL_IGNORABLE.items() if v}
    return c.finish(ignorable)


def _overlong(c: _Converter) -> None:
    """data.overlong as Axolotl treats a record longer than sequence_len: its completion type cuts the text into
    sequence_len pieces (split); the other types' rows are dropped (excess_length_strategy, default drop)."""
    types = [d.get("type") for d in c.raw.get("datasets") or [] if isinstance(d, dict)]
    strategy = c.get("excess_length_strategy")
    if strategy in ("drop", "truncate"):
        c.put("excess_length_strategy", "data.overlong", strategy)
    elif strategy is not None:
        c.refuse("excess_length_strategy", "gapless drops or truncates an over-long record (drop, truncate)")
    if any(t in ("completion", "pretrain") for t in types):
        how = "completion text is cut into sequence_len pieces, as Axolotl's completion type does"
        if strategy != "truncate" and any(t not in ("completion", "pretrain") for t in types):
            how += "; an over-long conversation is truncated (Axolotl drops it)"
        _set(c.out, "data.overlong", "split")
        c.conv.applied.append(("datasets: type completion", f"data.overlong: split  ({how})"))
    elif strategy is None:
        _set(c.out, "data.overlong", "drop")
        c.conv.applied.append(("excess_length_strategy: (unset)", "data.overlong: drop  (Axolotl's default: a row "
                                                                   "longer than sequence_len is dropped)"))


# Axolotl's plugins that only swap kernels (their liger_* and cut_cross_entropy switches are KERNEL_SWITCHES)
KERNEL_PLUGINS = ("axolotl.integrations.liger.LigerPlugin",
                  "axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin")


def _per_epoch(c: _Converter, key: str, steps_key: str, dotted: str, every: str) -> None:
    """Axolotl's evals_per_epoch / saves_per_epoch: N per pass over the data. Axolotl hands TrainingArguments the
    ratio 1 / (N x num_epochs) of the run's steps; gapless resolves N once the data is read, to every
    max(1, optimizer steps per epoch // N) steps (config.py)."""
    value = c.get(key)
    if value in (None, "", 0):
        if key in c.raw:
            c.note(key, "unset: not per epoch")
    elif c.has(steps_key):
        c.refuse(key, f"{steps_key} and {key} are both set (Axolotl refuses that too); keep one")
    elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
        c.refuse(key, "expected a whole number of times per epoch, at least 1")
    else:
        c.put(key, dotted, value, f"{every} = max(1, optimizer steps per epoch // {value}), once the data is read")


# W&B keys that only change what W&B itself uploads besides the scalars: off is fine, on is refused
WANDB_EXTRAS = {"wandb_watch": "gradient and parameter histograms", "wandb_log_model": "model files as artifacts"}


def _report_to(c: _Converter, key: str, sinks: list[str]) -> None:
    """train.report_to gains `sinks`, because of the source's `key`."""
    report = c.out.setdefault("train", {}).setdefault("report_to", [])
    report += [s for s in sinks if s not in report]
    c.note(key, f"train.report_to: [{', '.join(report)}]")


def _wandb_offline(c: _Converter, source: str, who: str) -> None:
    """train.wandb.mode offline, said on the mapping's line for `source` (the peer would upload)."""
    _set(c.out, "train.wandb.mode", "offline")
    c.conv.applied.append((source, f"train.wandb.mode: offline  (gapless's default, no network; {who} uploads as it "
                                   "goes: train.wandb.mode=online does that)"))


def _wandb(c: _Converter) -> None:
    """Axolotl logs to W&B when wandb_project is set (unless wandb_mode is disabled), to TensorBoard with
    use_tensorboard: train.report_to and train.wandb."""
    if c.get("use_tensorboard"):
        _report_to(c, "use_tensorboard", ["tensorboard"])
    elif "use_tensorboard" in c.raw:
        c.note("use_tensorboard", "off")
    mode = c.get("wandb_mode")
    on = c.has("wandb_project") and mode != "disabled"
    if on:
        _report_to(c, "wandb_project", ["wandb"])
        c.put("wandb_project", "train.wandb.project", str(c.get("wandb_project")))
        if mode in ("online", "offline"):
            c.put("wandb_mode", "train.wandb.mode", mode)
        elif mode in (None, ""):
            _wandb_offline(c, "wandb_mode: (unset)", "Axolotl")
        else:
            c.refuse("wandb_mode", "expected online, offline or disabled")
        for key, name in (("wandb_name", "name"), ("wandb_entity", "entity")):
            if c.has(key):
                c.put(key, f"train.wandb.{name}", str(c.get(key)))
    for key in [k for k in c.raw if k.startswith("wandb_") and k not in c.seen]:
        value = c.get(key)
        if not c.has(key) or (key in WANDB_EXTRAS and value in (False, "false")):
            c.note(key, "empty: no W&B" if not c.has(key) else "off")
        elif not on:
            c.note(key, "unused: no W&B (wandb_mode: disabled)" if c.has("wandb_project") else
                   "unused: no W&B without wandb_project")
        elif key in WANDB_EXTRAS:
            c.refuse(key, f"gapless logs scalars to W&B (train.report_to: [wandb]), not {WANDB_EXTRAS[key]}")
        else:
            c.refuse(key, "no gapless equivalent (train.wandb has project, name, entity and mode)")


def _chat_template(c: _Converter, key: str, value: Any, dotted: str) -> None:
    if value in ("tokenizer_default", "tokenizer_default_fallback_chatml"):
        c.note(key, "the tokenizer's chat template (data.chat_template unset)")
    elif value in TEMPLATES:  # Axolotl's named templates that gapless ships, as Jinja (gapless.data.chat_templates)
        c.put(key, dotted, TEMPLATES[value], f"Axolotl's {value} template as Jinja")
    elif value == "jinja":
        tpl = c.get("chat_template_jinja")
        if tpl:
            c.put("chat_template_jinja", dotted, tpl)
            c.note(key, "the template in chat_template_jinja")
        else:
            c.refuse(key, "jinja without chat_template_jinja")
    else:
        c.refuse(key, f"{value!r} is a template name gapless does not ship; it ships {', '.join(TEMPLATES)}, "
                      "takes the tokenizer's own (tokenizer_default) or Jinja (chat_template: jinja with "
                      "chat_template_jinja; data.chat_template)")


def _axolotl_datasets(c: _Converter, key: str, dotted: str) -> None:
    entries = c.get(key)
    if not isinstance(entries, list) or not entries:
        c.refuse(key, "expected a list of {path, type} entries")
        return
    sources = []
    for i, d in enumerate(entries):
        where = f"{key}[{i}]"
        if not isinstance(d, dict) or "path" not in d:
            c.refused.append(f"{where}: expected a mapping with path and type")
            continue
        src, notes, bad = _axolotl_dataset(d, c.raw.get("chat_template"))
        for k, why in bad:
            c.refused.append(f"{where}.{k}: {_show(d.get(k))}: {why}")
        sources.append(src)
        c.conv.applied.append((f"{where}: path {d['path']}, type {_show(d.get('type'))}",
                               f"{dotted}[{i}]: {src}" + (f"  ({'; '.join(notes)})" if notes else "")))
    _set(c.out, dotted, sources)


def _axolotl_dataset(d: dict, top_template: Any = None) -> tuple[dict, list[str], list[tuple[str, str]]]:
    """One entry of Axolotl's `datasets:` as a gapless source: (source, notes, refused (key, why)); `top_template`
    is the top-level chat_template, which a dataset's own may repeat (Axolotl's instruct and Gemma examples do)."""
    src: dict = {"path": str(d["path"])}
    notes, bad = [], []
    kind = d.get("type")
    known = {"path", "type", "ds_type", "split", "field_messages", "message_property_mappings",
             "message_field_role", "message_field_content", "roles", "roles_to_train", "train_on_eos",
             "conversation", "field_human", "field_model", "field_system", "chat_template", "name",
             "data_files", "train_on_split", "shards", "field", "drop_system_message"}
    for k in d:
        if k not in known:
            bad.append((k, "no gapless equivalent for this dataset key"))
    splits, split = _dataset_splits(src["path"]), d.get("split") or "train"
    if split in splits:  # a folder of a dataset's splits (train.jsonl beside test.jsonl): that split's files
        src["path"] = _split_path(splits[split])
        notes.append(f"the {split!r} split's files of {d['path']}")
    elif splits:
        bad.append(("split", f"no {split!r} split in {d['path']} (its files name the splits: {', '.join(splits)})"))
    elif split != "train":
        bad.append(("split", "gapless reads the whole file; split it into its own file"))
    if d.get("data_files"):
        bad.append(("data_files", "give the file itself as path"))
    if d.get("ds_type") not in (None, "json", "jsonl", "parquet", "csv", "arrow"):
        bad.append(("ds_type", "gapless reads .jsonl/.json/.parquet/.csv/.arrow files"))
    if d.get("name"):
        src["name"] = str(d["name"])
    if isinstance(kind, dict):  # a custom alpaca-style mapping: {field_instruction, field_input, field_output, ...}
        src["format"] = "alpaca"
        columns = {}
        for ours, theirs in (("instruction", "field_instruction"), ("input", "field_input"),
                             ("output", "field_output"), ("system", "field_system")):
            if kind.get(theirs):
                columns[ours] = kind[theirs]
        for k in kind:
            if k not in ("field_instruction", "field_input", "field_output", "field_system"):
                bad.append((f"type.{k}", "custom prompt formats are not supported; the chat template renders "
                                         "instruction (+ input) as the user turn"))
        src["columns"] = columns
        notes.append("rendered through the chat template, not a custom prompt format")
    elif kind in ("alpaca", "alpaca_chat"):
        src["format"] = "alpaca"
        notes.append("the user turn is instruction (+ input), through the chat template rather than "
                     "Alpaca's 'Below is an instruction' prompt")
    elif kind in ("sharegpt", "chat_template"):
        src["format"] = "messages" if kind == "chat_template" else "sharegpt"
        field_messages = d.get("field_messages") or d.get("field")
        role, content = None, None
        mappings = d.get("message_property_mappings") or {}
        role = mappings.get("role") or d.get("message_field_role")
        content = mappings.get("content") or d.get("message_field_content")
        columns = {}
        if kind == "sharegpt":
            if field_messages and field_messages != "conversations":
                columns["conversations"] = field_messages
            if role and role != "from":
                columns["from"] = role
            if content and content != "value":
                columns["value"] = content
            if d.get("field_system"):
                columns["system"] = d["field_system"]
        else:
            if field_messages and field_messages != "messages":
                columns["messages"] = field_messages
            if role and role != "role":
                columns["role"] = role
            if content and content != "content":
                columns["content"] = content
        if columns:
            src["columns"] = columns
        roles = {}
        for ours, theirs in (d.get("roles") or {}).items():
            for name in ([theirs] if isinstance(theirs, str) else theirs):
                roles[name] = ours
        for k, ours in (("field_human", "user"), ("field_model", "assistant")):
            if d.get(k):
                roles[d[k]] = ours
        if roles:
            src["roles"] = roles
        if d.get("roles_to_train") not in (None, ["assistant"], ["gpt"], ["assistant", "gpt"]):
            bad.append(("roles_to_train", "gapless trains assistant turns (data.train_on: assistant | "
                                          "last_assistant | all)"))
        if d.get("train_on_eos") not in (None, "turn"):
            bad.append(("train_on_eos", "gapless trains each assistant turn's end token (Axolotl's 'turn')"))
        conversation = d.get("conversation")
        if conversation not in (None, "chatml"):
            bad.append(("conversation", f"{conversation!r}: gapless ships chatml; for others set "
                                        "data.chat_template to the Jinja"))
        elif conversation == "chatml":
            notes.append("conversation chatml: set top-level chat_template: chatml to render it as ChatML")
        # gapless renders every source with data.chat_template: a dataset's own template must be that one
        own, top = d.get("chat_template"), top_template or "tokenizer_default"
        if own is not None and own == top:
            notes.append(f"chat_template {own}: the top-level one")
        elif own is not None:
            bad.append(("chat_template", f"differs from the top-level chat_template ({top}); gapless renders "
                                         "every dataset with one template: set it at the top level"))
    elif kind in ("completion", "pretrain"):
        src["format"] = "text"
        if d.get("field"):
            src["columns"] = {"text": d["field"]}
    else:
        bad.append(("type", "gapless reads alpaca, sharegpt, chat_template and completion datasets"))
    if d.get("drop_system_message") and kind == "chat_template":
        src["drop_system_message"] = True
        notes.append("drop_system_message: each conversation's leading system turn is dropped")
    elif d.get("drop_system_message"):  # Axolotl's other dataset types do not read it: they train with the turn
        bad.append(("drop_system_message", "Axolotl drops the system turn for type: chat_template only; use "
                                           "that type, or remove the key"))
    return src, notes, bad


# ---------------------------------------------------------------------------------------------
# TRL


TRL_IGNORABLE = {
    **SHARED_IGNORABLE,
    "logging_dir": "gapless logs to RUN/metrics.jsonl (and TensorBoard to RUN/tensorboard)",
    "overwrite_output_dir": "gapless writes into output_dir",
    "do_train": "gapless train trains",
    "save_strategy": None, "eval_strategy": None, "evaluation_strategy": None, "logging_strategy": None,
    "torch_dtype": None, "dtype": None,
    "attn_implementation": "model.attn_backend auto picks the fastest that runs",
    "use_flash_attention_2": "model.attn_backend auto picks the fastest that runs",  # attn_implementation's forerunner
    "dataset_train_split": None,
    "model_init_kwargs": None,
    "model_revision": "gapless reads the local model folder as it is",
    "log_level": "no effect on what trains",
    "do_eval": "eval_strategy decides when the Trainer evaluates (do_eval is not read by it)",
    "per_device_eval_batch_size": "evaluation batches use the training batching (the loss per token is the same)",
}


def convert_trl(raw: dict) -> Conversion:
    c = _Converter(raw, "trl")
    # max_seq_length: SFTConfig's name for max_length before TRL 0.20
    seq = _model_and_length(c, "model_name_or_path", "max_seq_length" if "max_seq_length" in raw else "max_length",
                            1024, "SFTConfig")
    packing = bool(c.get("packing"))
    _set(c.out, "data.batching", "packed" if packing else "padded")
    if "packing" in raw:
        c.put("packing", "data.batching", "packed" if packing else "padded")
    # packing_strategy (TRL 0.19+): bfd places whole documents best-fit, each attending to itself, as gapless's
    # packed batching does; wrapped cuts a stream of documents into rows, across their boundaries
    packing_strategy = c.get("packing_strategy")
    if packing_strategy == "bfd" or (packing_strategy is not None and not packing):
        c.note("packing_strategy", "best-fit rows of whole documents, each attending to itself (data.batching "
                                   "packed)" if packing else "unused: packing is off")
    elif packing_strategy is not None:
        c.refuse("packing_strategy", "gapless packs whole documents best-fit (bfd), each attending only to itself")
    if c.get("padding_free"):
        c.note("padding_free", "packed rows hold no padding" if packing else
               "documents without padding: the same loss as gapless's padded batches (padding is masked)")
    elif "padding_free" in raw:
        c.note("padding_free", "off")
    _batch(c, "per_device_train_batch_size", seq, packing, 8, "TrainingArguments")
    eval_strategy = _trainer_arguments(c, 2e-5, "SFTConfig", adapter=bool(c.raw.get("use_peft")))
    # preprocessing_num_workers: the alignment-handbook's name for it before TRL's dataset_num_proc
    for key in ("dataset_num_proc", "preprocessing_num_workers"):
        if c.has(key):
            c.put(key, "data.num_workers", int(c.get(key)))
    _precision(c)
    # torch_dtype is the dtype the weights load in; bf16 / fp16 train under that autocast whatever it is (the
    # handbook's zephyr LoRA recipe: float16 weights, bfloat16 matmuls). gapless computes in model.dtype and keeps
    # float32 copies of the trained weights, so the autocast dtype is the one it takes
    autocast = "bfloat16" if raw.get("bf16") is True else "float16" if raw.get("fp16") is True else None
    for key in ("torch_dtype", "dtype"):
        value = c.get(key)
        if value not in (None, "auto") and value not in ("bfloat16", "float16", "float32"):
            c.refuse(key, "expected bfloat16, float16 or float32")
        elif value in ("bfloat16", "float16", "float32") and autocast not in (None, value):
            c.note(key, f"the weights load in {value} and {'bf16' if autocast == 'bfloat16' else 'fp16'} autocast "
                        f"computes in {autocast}: model.dtype {autocast}, float32 copies of the trained weights")
        elif value in ("bfloat16", "float16", "float32"):
            c.put(key, "model.dtype", value)
    if c.has("gradient_checkpointing"):
        if c.get("gradient_checkpointing"):
            c.put("gradient_checkpointing", "model.activation_checkpointing", 1, "every layer")
        else:
            c.note("gradient_checkpointing", "off")
    # the data: one local source
    dataset = c.get("dataset_name")
    source: dict = {}
    if dataset is None:
        c.refused.append("dataset_name: missing; give the local data file or folder")
    else:
        source["path"] = _trl_splits(c, str(dataset), eval_strategy)
    # TRL reads dataset_text_field of plain-text records only: conversations and prompt-completion records go
    # through the chat template or their own fields whatever it says (its default is "text", often written out)
    text_field = c.has("dataset_text_field")
    if text_field and source and _first_format(source) in STRUCTURED_FORMATS:
        text_field = False
        c.note("dataset_text_field", f"unused: the records are {_first_format(source)}, which TRL does not read "
                                     "as one text field")
    elif text_field:
        source.update(format="text", columns={"text": c.get("dataset_text_field")})
        for held in c.out.get("data", {}).get("eval_sources", []):  # the test split's records are read alike
            held.update(format="text", columns={"text": c.get("dataset_text_field")})
    if source:
        _set(c.out, "data.sources", [source])
        c.conv.applied.append((f"dataset_name: {dataset}", f"data.sources[0]: {source}"))
    # the loss mask: TRL trains everything of a conversation unless assistant_only_loss, and only the completion of
    # prompt-completion data unless completion_only_loss is false (None = True there). gapless's train_on is one
    # setting for the run, so it follows the data's format, read from its first record.
    prompt_completion = not text_field and _first_format(source) == "prompt_completion"
    completion_only = c.get("completion_only_loss")
    if prompt_completion:
        train_on = "all" if completion_only is False else "assistant"
        how = ("completion_only_loss false: the prompt trains too" if completion_only is False else
               "prompt-completion data: TRL trains the completion only (completion_only_loss unset or true)")
        c.conv.applied.append((f"completion_only_loss: {_show(completion_only)}",
                               f"data.train_on: {train_on}  ({how})"))
        _set(c.out, "data.train_on", train_on)
        if "assistant_only_loss" in raw:
            c.note("assistant_only_loss", "for conversational data; this data is prompt-completion")
    elif c.get("assistant_only_loss"):
        c.put("assistant_only_loss", "data.train_on", "assistant")
    else:
        c.conv.applied.append(("assistant_only_loss: " + _show(raw.get("assistant_only_loss", False)),
                               "data.train_on: all  (TRL trains every token of a conversation by default)"))
        _set(c.out, "data.train_on", "all")
    if not prompt_completion and "completion_only_loss" in raw:
        c.note("completion_only_loss", "for prompt-completion data; this data is not")
    # the method: use_peft (PEFT's LoRA), load_in_4bit (QLoRA), else full fine-tuning
    if c.get("use_peft"):
        c.method("use_peft", "qlora" if c.get("load_in_4bit") else "lora")
        if c.get("load_in_4bit"):
            c.note("load_in_4bit", "QLoRA: the base in 4 bits")
    else:
        c.method("use_peft", "full")  # TRL without PEFT fine-tunes every weight
    if c.get("load_in_8bit"):
        c.refuse("load_in_8bit", "8-bit bases are not supported")
    for key in ("load_in_4bit", "load_in_8bit"):
        if key in raw and not raw[key]:
            c.note(key, "off")
    _lora_targets(c, "lora_target_modules")
    if c.get("use_peft"):  # TRL's ModelConfig defaults, and PEFT's targets for Llama, Mistral, Qwen2 and Gemma
        for key, dotted, value in (("lora_r", "lora.r", 16), ("lora_alpha", "lora.alpha", 32.0),
                                   ("lora_dropout", "lora.dropout", 0.05)):
            if not c.has(key):
                _default(c, key, dotted, value, "TRL")
        if not c.has("lora_target_modules"):
            _default(c, "lora_target_modules", "lora.target_modules", ["q_proj", "v_proj"], "PEFT",
                     " for these model types")
    if c.get("use_rslora"):
        c.put("use_rslora", "lora.use_rslora", True)
    if c.has("chat_template_path"):
        c.put("chat_template_path", "data.chat_template", str(c.get("chat_template_path")))
    # alignment-handbook's and open-r1's SFTConfig: chat_template, Jinja their sft.py sets as the tokenizer's template
    template = c.get("chat_template")
    if isinstance(template, str) and "{" in template:
        c.put("chat_template", "data.chat_template", template)
    elif template is not None:
        c.refuse("chat_template", "expected the Jinja text that becomes the tokenizer's chat template (a .jinja "
                                  "file: chat_template_path)")
    ignorable = {k: v for k, v in TRL_IGNORABLE.items() if v}
    return c.finish(ignorable)


def _trl_splits(c: _Converter, dataset: str, eval_strategy: str) -> str:
    """The training data's path for dataset_name. A folder of a dataset's splits (train.jsonl beside test.jsonl, or
    a Hub dataset's data/train-*.parquet, named as `datasets` names them: data.formats.folder_splits) gives
    dataset_train_split's files (TRL's default "train"), and dataset_test_split's (its default "test") become
    data.eval_sources where TRL would evaluate; anything else is the path as it is, read whole."""
    splits = _dataset_splits(dataset)
    train, test = c.get("dataset_train_split") or "train", c.get("dataset_test_split") or "test"
    if not splits:
        if train != "train":
            c.refuse("dataset_train_split", "gapless reads the whole file; split it into its own file")
        return dataset
    if train not in splits:
        c.refuse("dataset_train_split", f"no {train!r} split in {dataset} (its files name the splits: "
                                        f"{', '.join(splits)})")
        return dataset
    path = _split_path(splits[train])
    c.note("dataset_train_split", f"data.sources[0].path: {path}  (the {train!r} split of {dataset})")
    if test in splits and eval_strategy == "no":
        c.note("dataset_test_split", f"the {test!r} split is not read: TRL evaluates nothing with eval_strategy no")
    elif eval_strategy != "no" and test in splits:
        _set(c.out, "data.eval_sources", [{"path": _split_path(splits[test])}])
        c.note("dataset_test_split", f"data.eval_sources[0].path: {_split_path(splits[test])}  (the {test!r} split)")
    elif eval_strategy != "no":
        c.refuse("dataset_test_split", f"no {test!r} split in {dataset} to evaluate on (its files name the splits: "
                                       f"{', '.join(splits)})")
    return path


def _dataset_splits(path: str) -> dict[str, list[Path]]:
    """A folder's data files by the split their names give (data.formats.folder_splits), or its data/ folder's (a Hub
    dataset's layout); {} for a file, a glob or a folder of other names."""
    from gapless.data.formats import folder_splits

    folder = Path(path).expanduser()
    for root in (folder, folder / "data"):
        if root.is_dir() and (splits := folder_splits(sorted(root.iterdir()))):
            return splits
    return {}


def _split_path(files: list[Path]) -> str:
    """One source path for a split's files: the file, or a glob of their names' common beginning and end (the shards
    train-00000-of-00002.parquet and train-00001-of-00002.parquet: train-0000*.parquet)."""
    if len(files) == 1:
        return str(files[0])
    names = [f.name for f in files]
    end = os.path.commonprefix([n[::-1] for n in names])[::-1]
    return str(files[0].parent / (os.path.commonprefix(names) + "*" + end))


# formats whose records TRL does not read through dataset_text_field
STRUCTURED_FORMATS = ("messages", "sharegpt", "prompt_completion", "oasst", "oasst_top1")


def _first_format(source: dict) -> str | None:
    """The format of the first record of a source's files (None when they cannot be read: the data pipeline says
    why when the run starts)."""
    from gapless.config import SourceConfig
    from gapless.data.formats import detect_format, read_rows, resolve_files

    if "path" not in source or source.get("format"):
        return source.get("format")
    try:
        for where, row in read_rows(resolve_files(source["path"])[0]):
            return None if isinstance(row, ValueError) else detect_format(row, SourceConfig(**source).columns, where)
    except (ValueError, OSError):
        return None
    return None


def _trl_report_to(c: _Converter) -> None:
    """TrainingArguments.report_to (a name or a list; "none"), and run_name, which names the W&B run."""
    value = c.get("report_to")
    names = [value] if isinstance(value, str) else list(value or [])
    sinks = [n for n in names if n != "none"]
    unknown = [n for n in sinks if n not in ("tensorboard", "wandb")]
    if not sinks:
        if "report_to" in c.raw:
            c.note("report_to", "none")
    elif unknown:
        c.refuse("report_to", f"gapless reports to tensorboard and wandb (train.report_to), not {unknown}"
                 + ("; name them instead of all" if "all" in unknown else ""))
    else:
        _report_to(c, "report_to", sinks)
        if "wandb" in sinks:
            _wandb_offline(c, "report_to: wandb", "TRL")
    if c.has("run_name"):
        if "wandb" in sinks and not unknown:
            c.put("run_name", "train.wandb.name", str(c.get("run_name")))
        else:
            c.note("run_name", "unused: it names the W&B run, and report_to has no wandb")


def convert(raw: dict, fmt: str | None = None) -> Conversion:
    """The gapless config dict of an Axolotl or TRL mapping (fmt None: detected)."""
    fmt = fmt or detect(raw)
    if fmt == "axolotl":
        return convert_axolotl(raw)
    if fmt == "trl":
        return convert_trl(raw)
    return Conversion(raw, "gapless")


def load_any(path: str | Path, overrides: list[str] = (), out=None) -> RunConfig:
    """The run config of a gapless, Axolotl or TRL YAML file, overrides applied (as gapless keys); prints the
    mapping a conversion applied to `out` (stderr by default)."""
    import sys

    from gapless.config import load_config, read_yaml, require_settings

    raw = read_yaml(path)
    require_settings(raw, path, overrides)
    fmt = detect(raw)
    if fmt == "gapless":
        return load_config(path, overrides)
    conv = convert(raw, fmt)
    print(conv.format(), file=out or sys.stderr)
    return load_config(data=conv.config, overrides=overrides)


def write_gapless_yaml(src: str | Path, out: str | Path) -> Conversion:
    """`gapless convert-config IN --out OUT`: the converted config, checked by building it, written as YAML."""
    import yaml

    from gapless.config import from_dict, read_yaml

    raw = read_yaml(src)
    fmt = detect(raw)
    if fmt == "gapless":
        raise ValueError(f"{src}: already a gapless config (every top-level key is a gapless field)")
    conv = convert(raw, fmt)
    conv.hub_paths = hub_paths(from_dict(RunConfig, conv.config, str(src)))  # the result must be a valid config
    header = f"# converted by `gapless convert-config` from {src} ({fmt})\n"
    Path(out).write_text(header + yaml.safe_dump(conv.config, sort_keys=False))
    return conv
