"""Configs from the peers: an Axolotl YAML, a TRL SFTConfig-style YAML or a LLaMA-Factory training YAML as a gapless
config dict.

`detect(raw)` names the format of a parsed YAML mapping; `convert(raw, fmt)` returns the gapless dict and the
mapping it applied, one line per source key, or raises ValueError naming every key it cannot honour (a setting
that would change what trains, silently dropped, is a run that is not the one the user asked for). Keys whose
value is empty (`wandb_project:`), or that only say what gapless does anyway, are accepted and listed.

Axolotl's keys are those of its config reference (docs.axolotl.ai/docs/config-reference.html); TRL's are
SFTConfig's and TrainingArguments' fields as `trl sft --config FILE.yaml` reads them, plus the script arguments
`model_name_or_path` and `dataset_name` and the PEFT model arguments (`use_peft`, `lora_r`, ...). LLaMA-Factory's
are its ModelArguments, DataArguments, FinetuningArguments and TrainingArguments (src/llamafactory/hparams/ of
hiyouga/LLaMA-Factory), its datasets named in DATASET_DIR/dataset_info.json (data/README.md there).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gapless.config import ALL_LINEAR, DATA_FORMAT_OPTIONAL, DataConfig, RunConfig
from gapless.data.chat_templates import LLAMAFACTORY, LLAMAFACTORY_UNCUT, TEMPLATES
from gapless.data.formats import DEFAULT_ROLES, GZIPPED, SUFFIXES


# A Hugging Face hub id (`meta-llama/Llama-3.2-1B`): one slash, no leading `/`, `.` or `~`.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")

AXOLOTL_MARKERS = ("base_model", "datasets", "sequence_len", "micro_batch_size", "sample_packing", "adapter",
                   "num_epochs", "lora_target_linear")
TRL_MARKERS = ("model_name_or_path", "dataset_name", "per_device_train_batch_size", "num_train_epochs",
               "max_seq_length", "max_length", "dataset_text_field", "lr_scheduler_type", "use_peft")
# LLaMA-Factory's own keys (it shares model_name_or_path and TrainingArguments' keys with TRL)
LLAMAFACTORY_MARKERS = ("stage", "finetuning_type", "dataset", "template", "cutoff_len", "lora_target", "lora_rank",
                        "quantization_bit", "dataset_dir", "train_on_prompt", "neat_packing")


def detect(raw: dict) -> str:
    """'gapless', 'axolotl', 'trl' or 'llamafactory': gapless when every top-level key is a RunConfig field, or one
    of them is a RunConfig section."""
    import dataclasses

    fields = {f.name for f in dataclasses.fields(RunConfig)}
    # every key gapless's, or a section of gapless's (model: {path: ...}; no peer has such a mapping): a gapless
    # config, whose mistyped key (dataset:, template:) from_dict names, not a peer's that happens to share it
    if set(raw) <= fields or any(isinstance(raw.get(name), dict) for name in fields):
        return "gapless"
    axolotl = sum(k in raw for k in AXOLOTL_MARKERS)
    trl = sum(k in raw for k in TRL_MARKERS)
    llamafactory = sum(k in raw for k in LLAMAFACTORY_MARKERS)
    if llamafactory and llamafactory >= axolotl:  # TRL has none of its keys
        return "llamafactory"
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
                   "use_liger",  # SFTConfig's name before TrainingArguments' use_liger_kernel (open-r1's recipes)
                   # LLaMA-Factory's: flash_attn auto/fa2/sdpa/disabled picks the attention kernel (disabled: eager)
                   "flash_attn", "enable_liger_kernel", "use_unsloth", "use_unsloth_gc")
# switches that change nothing when off (the peers' default) and what trains when on: why gapless refuses them on
OFF_SWITCHES = {
    "s2_attention": "shifted sparse attention (LongLoRA) attends differently; gapless attends to the whole document",
    "lora_fan_in_fan_out": "for Conv1D layers (GPT-2); a Llama-family decoder's are nn.Linear",
    "gptq": "gapless trains unquantized or NF4 (qlora) bases, not GPTQ ones",
    "peft_use_dora": "gapless trains LoRA, not DoRA",
    "use_dora": "gapless trains LoRA, not DoRA",
    "load_best_model_at_end": "gapless's output is the last step's weights; its checkpoints stay in the run folder",
    "push_to_hub": "gapless does not upload; push RUN/adapter (or an export) with `hf upload`",
    # LLaMA-Factory's (hparams/finetuning_args.py, model_args.py, data_args.py)
    "shift_attn": "shifted sparse attention (LongLoRA) attends differently; gapless attends to the whole document",
    "pissa_init": "PiSSA starts the adapter from the weights' principal components (and changes the base weights); "
                  "gapless's LoRA starts at B = 0 on the base as it is",
    "pure_bf16": "bf16 weights updated in bf16; gapless keeps float32 copies of the trained weights (bf16: true)",
    "use_galore": "GaLore projects the gradients; gapless trains with AdamW on the full gradients",
    "use_apollo": "APOLLO is another optimizer; gapless trains with AdamW",
    "use_badam": "BAdam updates one block at a time; gapless updates every trainable weight each step",
    "use_adam_mini": "Adam-mini is another optimizer; gapless trains with AdamW",
    "use_llama_pro": "LLaMA Pro trains added blocks only; gapless trains LoRA adapters or every weight",
    "train_from_scratch": "gapless fine-tunes the checkpoint's weights",
    "resize_vocab": "gapless trains with the tokenizer's own tokens (new tokens need new embedding rows)",
    "streaming": "gapless reads the files whole (tokenized once into its cache)",
    "disable_shuffling": "gapless shuffles the training data (data.seed)",
    "use_swanlab": "gapless reports to tensorboard and wandb (train.report_to), not SwanLab",
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
    chats = [d.get("type") for key in ("datasets", "test_datasets") for d in raw.get(key) or []
             if isinstance(d, dict) and d.get("type") in ("chat_template", "sharegpt")]
    if c.get("train_on_inputs") and chats:
        # prompt_strategies/chat_template.py: train_on_inputs trains each turn's content and end-of-turn token
        # (find_turn), never the template's text between them (headers, role names); data.train_on all trains those
        c.refuse("train_on_inputs", "with chat_template datasets Axolotl trains every turn's text and end-of-turn "
                                    "token but not the template's headers between them, which gapless's "
                                    "data.train_on: all trains; remove it to train the assistant turns")
    elif "train_on_inputs" in raw:
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
        src, notes, bad = _axolotl_dataset(d, c.raw.get("chat_template"), bool(c.raw.get("train_on_inputs")))
        for k, why in bad:
            c.refused.append(f"{where}.{k}: {_show(d.get(k))}: {why}")
        sources.append(src)
        c.conv.applied.append((f"{where}: path {d['path']}, type {_show(d.get('type'))}",
                               f"{dotted}[{i}]: {src}" + (f"  ({'; '.join(notes)})" if notes else "")))
    _set(c.out, dotted, sources)


# Axolotl's default role names (src/axolotl/prompt_strategies/chat_template.py, ChatTemplatePrompter): a dataset's
# `roles` replaces them; roles_to_train's names are read through them
AXOLOTL_ROLES = {"human": "user", "user": "user", "assistant": "assistant", "gpt": "assistant", "system": "system",
                 "tool": "tool"}
# keys of a dataset entry that change nothing gapless reads from a local file, with why (utils/schemas/datasets.py)
AXOLOTL_DATASET_HARMLESS = {
    "preprocess_shards": "Axolotl tokenizes the dataset in that many sequential pieces to bound memory: the same "
                         "records",
    "trust_remote_code": "gapless reads data files and runs no dataset loading script",
    "ds_type": None, "split": None, "name": None, "revision": None,  # handled
}


def _axolotl_dataset(d: dict, top_template: Any = None,
                     train_on_inputs: bool = False) -> tuple[dict, list[str], list[tuple[str, str]]]:
    """One entry of Axolotl's `datasets:` as a gapless source: (source, notes, refused (key, why)); `top_template`
    is the top-level chat_template, which a dataset's own may repeat (Axolotl's instruct and Gemma examples do);
    `train_on_inputs` the top-level key. Axolotl drops a key set to null before reading it (utils/config
    validate_config: model_dump(exclude_none=True)), so null is the default here too."""
    d = {k: v for k, v in d.items() if v is not None}
    src: dict = {"path": str(d["path"])}
    notes, bad = [], []
    kind = d.get("type")
    chat = kind in ("sharegpt", "chat_template")
    known = {"path", "type", "ds_type", "split", "name", "revision", "data_files", "shards", "shards_idx",
             "preprocess_shards", "trust_remote_code", "drop_system_message", "field"}
    if chat:
        known |= {"field_messages", "message_property_mappings", "message_field_role", "message_field_content",
                  "roles", "roles_to_train", "train_on_eos", "train_on_eot", "conversation", "field_human",
                  "field_model", "field_system", "field_tools", "field_thinking", "template_thinking_key",
                  "split_thinking", "chat_template", "chat_template_jinja", "message_field_training",
                  "message_field_training_detail"}
    for k in d:
        if k not in known:
            bad.append((k, f"no gapless equivalent for this key of a {_show(kind)} dataset"))
    local = Path(src["path"]).expanduser().exists()
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
    # name and revision pick a Hub dataset's configuration and commit (datasets.load_dataset(path, name, revision));
    # Axolotl ignores them for a local file (utils/schemas/datasets.py: revision "is ignored for local datasets")
    for key, what in (("name", "configuration (subset)"), ("revision", "commit, tag or branch")):
        if d.get(key) and local:
            notes.append(f"{key} {d[key]}: a Hub dataset's {what}; a local path is read as it is")
        elif d.get(key):
            flag = f" --revision {d[key]}" if key == "revision" else ""
            bad.append((key, f"picks the Hub dataset's {what}: download that one (hf download {d['path']} "
                             f"--repo-type dataset{flag}) and give the files as path"))
    # Axolotl keeps the shards_idx-th of `shards` contiguous pieces (datasets' Dataset.shard): a part of the records
    if d.get("shards"):
        bad.append(("shards", "Axolotl trains one contiguous piece of the records (shard shards_idx of shards); "
                              "gapless reads whole files: write that piece to its own file"))
    elif "shards_idx" in d:
        notes.append("shards_idx: unused without shards")
    for key, why in AXOLOTL_DATASET_HARMLESS.items():
        if why and d.get(key) not in (None, False):
            notes.append(f"{key} {_show(d[key])}: {why}")
    if d.get("field") and kind not in ("completion", "pretrain"):
        # utils/schemas/datasets.py: "For `completion` datasets only"; chat_template reads field_messages
        notes.append(f"field {d['field']}: unused (Axolotl reads it for completion datasets only)")
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
    elif chat:
        _axolotl_chat(d, kind, src, notes, bad, top_template, train_on_inputs)
    elif kind in ("completion", "pretrain"):
        src["format"] = "text"
        if d.get("field"):
            src["columns"] = {"text": d["field"]}
    elif kind == "input_output":  # prompt_strategies/input_output.py: the same pieces, tokens and labels
        src["format"] = "segments"
    else:
        bad.append(("type", "gapless reads alpaca, sharegpt, chat_template, completion and input_output datasets"))
    if d.get("drop_system_message") and kind == "chat_template":
        src["drop_system_message"] = True
        notes.append("drop_system_message: each conversation's leading system turn is dropped")
    elif d.get("drop_system_message"):  # Axolotl's other dataset types do not read it: they train with the turn
        bad.append(("drop_system_message", "Axolotl drops the system turn for type: chat_template only; use "
                                           "that type, or remove the key"))
    return src, notes, bad


def _axolotl_chat(d: dict, kind: str, src: dict, notes: list[str], bad: list[tuple[str, str]], top_template: Any,
                  train_on_inputs: bool) -> None:
    """A chat_template (or sharegpt) dataset, as Axolotl's prompt_strategies/chat_template.py trains it: each turn
    whose role is in roles_to_train (default [assistant]) trains its content and the end-of-turn token after it
    (train_on_eos default turn), the template's text between turns never; with train_on_inputs every turn's."""
    src["format"] = "messages" if kind == "chat_template" else "sharegpt"
    if kind == "sharegpt":
        notes.append("Axolotl 0.5+ refuses type sharegpt (deprecated for chat_template); read as its migration guide "
                     "maps it: chat_template with field_messages conversations, role from, content value")
    mappings = dict(d.get("message_property_mappings") or {})
    role = mappings.pop("role", None) or d.get("message_field_role")
    content = mappings.pop("content", None) or d.get("message_field_content")
    columns = {}
    if kind == "sharegpt":
        for ours, value in (("conversations", d.get("field_messages")), ("from", role), ("value", content)):
            if value and value != ours:
                columns[ours] = value
        if d.get("field_system"):
            columns["system"] = d["field_system"]
    else:
        for ours, value in (("messages", d.get("field_messages")), ("role", role), ("content", content)):
            if value and value != ours:
                columns[ours] = value
        if d.get("field_system") not in (None, "system"):
            bad.append(("field_system", "gapless reads a conversation's system turn from its messages, not from "
                                        "another column"))
    if d.get("field_tools") not in (None, "tools"):
        columns["tools"] = d["field_tools"]
    if columns:
        src["columns"] = columns
    for k, v in mappings.items():  # other properties: a turn's key renamed for the template (tool_calls: calls)
        if k != v:
            bad.append(("message_property_mappings", f"{k}: {v}: gapless passes a turn's keys to the template "
                                                     "under their own names (it maps role and content only)"))
    # the reasoning: Axolotl renames a turn's field_thinking to template_thinking_key (where the mappings are
    # Axolotl's default); gapless passes the turn's keys as they are
    thinking, key = d.get("field_thinking", "reasoning_content"), d.get("template_thinking_key", "reasoning_content")
    if thinking != key and d.get("message_property_mappings"):
        notes.append("field_thinking/template_thinking_key: unused beside message_property_mappings (Axolotl then "
                     "passes a turn's keys as they are, as gapless does)")
    elif thinking != key:
        bad.append(("field_thinking", f"Axolotl renders a turn's {thinking} as {key}; gapless passes a turn's keys "
                                      f"to the template under their own names: rename {thinking} to {key} in the "
                                      "data"))
    if d.get("split_thinking"):
        bad.append(("split_thinking", "gapless does not move <think>...</think> out of an answer's text into its "
                                      "reasoning field"))
    given = {}
    for ours, theirs in (d.get("roles") or {}).items():
        for name in ([theirs] if isinstance(theirs, str) else theirs):
            given[name] = ours
    for k, ours in (("field_human", "user"), ("field_model", "assistant")):
        if d.get(k):
            given[d[k]] = ours
    if given:
        src["roles"] = given
    roles = {**({} if d.get("roles") else AXOLOTL_ROLES), **given}  # a dataset's roles replace Axolotl's defaults
    # which turns train: roles_to_train read through the role names; training flags per message override it
    trained = {roles.get(r, r) for r in d.get("roles_to_train", ["assistant"])}
    for key, why in (("message_field_training", "a turn's own train flag (any role) decides whether it trains"),
                     ("message_field_training_detail", "character ranges of a turn train or not")):
        if d.get(key):
            bad.append((key, f"{why}; gapless trains whole assistant turns (OpenAI's weight: 0 on an assistant "
                             "turn leaves it out)"))
    if not train_on_inputs and trained != {"assistant"}:  # train_on_inputs: refused by convert_axolotl
        other = sorted(trained - {"assistant"})
        bad.append(("roles_to_train", f"trains {', '.join(other)} turns too; gapless trains assistant turns only"
                    if other and "assistant" in trained else
                    "trains no assistant turn; gapless trains assistant turns (data.train_on: assistant, "
                    "last_assistant or all)"))
    for key in ("train_on_eos", "train_on_eot"):
        if d.get(key, "turn") != "turn":
            bad.append((key, "Axolotl trains the end-of-turn token "
                             + ("after every turn, user turns too" if d[key] == "all" else
                                "of the conversation's last turn only" if d[key] == "last" else "as it says")
                             + "; gapless trains each trained turn's own (Axolotl's turn)"))
    conversation = d.get("conversation")
    if conversation not in (None, "chatml"):
        bad.append(("conversation", f"{conversation!r}: gapless ships chatml; for others set "
                                    "data.chat_template to the Jinja"))
    elif conversation == "chatml":
        notes.append("conversation chatml: set top-level chat_template: chatml to render it as ChatML")
    # gapless renders every source with data.chat_template: a dataset's own template must be that one
    own, top = d.get("chat_template"), top_template or "tokenizer_default"
    if own == "jinja" or (own is None and d.get("chat_template_jinja")):
        bad.append(("chat_template_jinja", "a dataset's own Jinja template; gapless renders every dataset with "
                                           "one template: set chat_template_jinja at the top level"))
    elif own is not None and own == top:
        notes.append(f"chat_template {own}: the top-level one")
    elif own is not None:
        bad.append(("chat_template", f"differs from the top-level chat_template ({top}); gapless renders "
                                     "every dataset with one template: set it at the top level"))


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


# ---------------------------------------------------------------------------------------------
# LLaMA-Factory


LLAMAFACTORY_IGNORABLE = {
    **TRL_IGNORABLE,
    "trust_remote_code": AXOLOTL_IGNORABLE["trust_remote_code"],
    "plot_loss": "a PNG of the loss curve; gapless plots it in RUN/report.html",
    "overwrite_cache": "gapless's cache is keyed by the files and settings that made it",
    "save_only_model": "what a checkpoint holds, not what trains (gapless's hold the optimizer state, to resume)",
    "stage": None, "finetuning_type": None, "template": None, "dataset_dir": None, "mix_strategy": None,
    "tokenized_path": None, "packing": None, "neat_packing": None, "mask_history": None, "train_on_prompt": None,
}
# LLaMA-Factory's templates gapless cannot train as it does (src/llamafactory/data/template.py there): name -> why.
# gapless trains an answer through its end-of-turn token, never the separator a template writes after it, and cuts
# the text only where a trained answer starts (gapless.data.tokenize)
_TRAINS_NEWLINE = ("LLaMA-Factory trains the newline it writes after each {end} (format_assistant "
                   "'{{{{content}}}}{end}\\n'); gapless trains an answer through {end}: the loss masks differ by "
                   "one token a turn")
# LLaMA-Factory's templates whose token ids a gapless named template (gapless.data.chat_templates.TEMPLATES) gives
# exactly for records without tools, and whose loss mask differs in the one token _TRAINS_NEWLINE says
# (test_llamafactory_templates.py, on the Qwen2 tokenizer): trained as that template skipping the records with tools
# or tool turns (chat_templates.LLAMAFACTORY), with the difference said in the mapping, as an unset template is
LLAMAFACTORY_NEAR = {"qwen": "qwen_25", "chatml": "chatml", "qwen3_nothink": "chatml"}
# LLaMA-Factory's templates whose Jinja in chat_templates.LLAMAFACTORY gives its token ids, and whose loss mask
# differs in the one token _TRAINS_NEWLINE says, after this end-of-turn token (test_llamafactory_templates.py)
LLAMAFACTORY_SEPARATOR = {"gemma": "<end_of_turn>", "gemma3": "<end_of_turn>"}
LLAMAFACTORY_REFUSED = {
    **{name: _TRAINS_NEWLINE.format(end="<|im_end|>") for name in ("qwen2_vl", "yi")},
    "qwen3": _TRAINS_NEWLINE.format(end="<|im_end|>") + "; and it trains an empty <think></think> block it puts "
             "into answers without one (ReasoningTemplate with enable_thinking)",
    "gemma2": "efficient_eos: LLaMA-Factory trains the newline after each <end_of_turn>, an eos label at each next "
              "prompt's first token and an eos it appends to the conversation",
    "default": "gapless ships no template that writes its turns ('Human: {{content}}', eos, '\\nAssistant:', each slot "
               "tokenized on its own), and LLaMA-Factory trains the newline it writes after each answer's eos "
               "('{{content}}', eos, '\\n'); gapless trains an answer through its end-of-turn token",
    "empty": "LLaMA-Factory writes the turns back to back and tokenizes each on its own; gapless tokenizes an answer "
             "together with the turn after it, so the tokens where they join differ",
    "mistral": "LLaMA-Factory writes the system message into the first user turn and tokenizes ' ANSWER' apart with "
               "SentencePiece's leading-space rules; Mistral's own template writes it into the last user turn and "
               "gapless ships no template that reproduces LLaMA-Factory's pieces",
    "llama2": "LLaMA-Factory writes each answer right after ' [/INST]', tokenized apart by SentencePiece, then the "
              "eos; Llama-2-chat's own template writes ' ANSWER </s>' (stripped), and gapless ships none that "
              "reproduces LLaMA-Factory's",
}
# LoRA keys that only mean something with finetuning_type lora
LLAMAFACTORY_LORA_KEYS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_target", "use_rslora", "additional_target",
                          "loraplus_lr_ratio", "loraplus_lr_embedding", "pissa_iter", "pissa_convert",
                          "quantization_bit", "quantization_method", "quantization_type", "double_quantization")


def convert_llamafactory(raw: dict) -> Conversion:
    c = _Converter(raw, "llamafactory")
    stage = c.get("stage", "sft")
    if stage == "sft":
        c.note("stage", "supervised fine-tuning" if "stage" in raw else "(unset) LLaMA-Factory's default: sft")
    else:
        c.refuse("stage", "gapless trains supervised fine-tuning (stage: sft) only"
                 + ("; continued pre-training on raw text is a gapless config with a source of format text"
                    if stage == "pt" else "; reward modelling, PPO, DPO and KTO are not gapless methods"))
    seq = _model_and_length(c, "model_name_or_path", "cutoff_len", 2048, "LLaMA-Factory")
    # neat_packing: whole documents packed into rows, each attending only to itself (block-diagonal attention), as
    # gapless's packed batching; plain packing lets a document attend to the ones before it in its row
    neat, packing = bool(c.get("neat_packing")), c.get("packing")
    if neat:
        # data_args.py: packing shortens cutoff_len by one ("avoid pad_to_multiple_of"): rows and documents of seq - 1
        seq -= 1
        c.put("neat_packing", "data.batching", "packed", "each document attends only to itself")
        c.put("cutoff_len", "data.max_seq_len", seq, "cutoff_len - 1, as LLaMA-Factory packs")
        if "packing" in raw:
            c.note("packing", "neat_packing packs")
    elif packing:
        c.refuse("packing", "LLaMA-Factory's packing lets each document attend to the documents before it in its "
                            "row; gapless's packed rows keep every document to itself, which is LLaMA-Factory's "
                            "neat_packing: set neat_packing: true (or packing: false)")
    else:
        _set(c.out, "data.batching", "padded")
        c.conv.applied.append((f"packing: {_show(packing) if 'packing' in raw else '(unset)'}",
                               "data.batching: padded  (LLaMA-Factory packs only with packing or neat_packing in "
                               "supervised fine-tuning)"))
    if "neat_packing" in raw and not neat:
        c.note("neat_packing", "off")
    _set(c.out, "data.overlong", "truncate")
    c.conv.applied.append(("cutoff_len: (a longer record)", "data.overlong: truncate  (LLaMA-Factory truncates "
                                                            "too; it shortens prompt and response in proportion, "
                                                            "gapless cuts the end)"))
    _batch(c, "per_device_train_batch_size", seq, neat, 8, "TrainingArguments")
    finetuning = c.get("finetuning_type", "lora")
    eval_strategy = _trainer_arguments(c, 5e-5, "TrainingArguments", adapter=finetuning == "lora")
    for key in ("eval_strategy", "save_strategy"):
        if raw.get(key) == "steps":
            c.note(key, f"steps: every {'eval_steps' if key.startswith('eval') else 'save_steps'}")
    if c.has("dataset_dir"):
        c.note("dataset_dir", "the folder of dataset_info.json and the files it names")
    if c.has("preprocessing_num_workers"):
        c.put("preprocessing_num_workers", "data.num_workers", int(c.get("preprocessing_num_workers")))
    if c.raw.get("bf16") is True or c.raw.get("fp16") is True:
        _precision(c)
    else:
        c.refuse("bf16", "neither bf16 nor fp16 is on: LLaMA-Factory then computes in a dtype it infers from the "
                         "checkpoint and the GPU; say which: bf16: true or fp16: true")
    # LLaMA-Factory checkpoints every layer's activations unless disable_gradient_checkpointing (model_utils)
    if c.get("disable_gradient_checkpointing"):
        c.put("disable_gradient_checkpointing", "model.activation_checkpointing", 0, "off")
    elif "disable_gradient_checkpointing" in raw:
        c.put("disable_gradient_checkpointing", "model.activation_checkpointing", 1, "every layer")
    else:
        _default(c, "disable_gradient_checkpointing", "model.activation_checkpointing", 1, "LLaMA-Factory",
                 ": every layer checkpointed")
    if "gradient_checkpointing" in raw:
        c.note("gradient_checkpointing", "LLaMA-Factory checkpoints unless disable_gradient_checkpointing")
    _llamafactory_method(c, finetuning)
    # the loss: every response (train_on_prompt: the prompts too; mask_history: the last response only)
    if c.get("train_on_prompt") and c.get("mask_history"):
        c.refuse("mask_history", "mask_history and train_on_prompt are both on (LLaMA-Factory refuses that too)")
    elif c.get("train_on_prompt"):
        c.put("train_on_prompt", "data.train_on", "all")
    elif c.get("mask_history"):
        c.put("mask_history", "data.train_on", "last_assistant")
    else:
        _set(c.out, "data.train_on", "assistant")
        shown = _show(raw["train_on_prompt"]) if "train_on_prompt" in raw else "(unset)"
        c.conv.applied.append((f"train_on_prompt: {shown}",
                               "data.train_on: assistant  (every response trains, the prompts do not)"))
    for key in ("train_on_prompt", "mask_history"):
        if key in raw and not raw[key]:
            c.note(key, "off")
    template = c.get("template")
    if template is None:
        c.conv.applied.append(("template: (unset)", "data.chat_template unset: the tokenizer's own (LLaMA-Factory "
                                                    "reads the tokenizer's template when template is unset; it also "
                                                    "trains any text that template writes after an answer's "
                                                    "end-of-turn token, ChatML's newline, which gapless does not)"))
    elif template in LLAMAFACTORY_NEAR:
        # gapless.data.chat_templates.LLAMAFACTORY: gapless's template of its ids, skipping the records with tools;
        # when some answers do not train, also those gapless would tokenize otherwise
        name, every_answer = LLAMAFACTORY_NEAR[template], not (c.get("train_on_prompt") or c.get("mask_history"))
        c.put("template", "data.chat_template", (LLAMAFACTORY if every_answer else LLAMAFACTORY_UNCUT)[template],
              f"gapless's {name} template: LLaMA-Factory's {template} token ids"
              + (", its default system prompt too" if template == "qwen" else "")
              + "; " + _TRAINS_NEWLINE.format(end="<|im_end|>")
              + "; records with tools or tool turns (LLaMA-Factory writes them as its own text) are skipped and counted"
              + ("" if every_answer else ", and those with an untrained answer starting with a newline"))
    elif template in LLAMAFACTORY:
        # gapless.data.chat_templates: the Jinja whose ids and loss mask are LLaMA-Factory's; when some answers do not
        # train, the one that also skips the records gapless would tokenize otherwise
        every_answer = not (c.get("train_on_prompt") or c.get("mask_history"))
        end = LLAMAFACTORY_SEPARATOR.get(template)
        c.put("template", "data.chat_template", (LLAMAFACTORY if every_answer else LLAMAFACTORY_UNCUT)[template],
              f"LLaMA-Factory's {template} turns as Jinja: its token ids"
              + ("; " + _TRAINS_NEWLINE.format(end=end) + ";" if end else " and loss mask;")
              + " records with tools or tool turns are skipped and counted"
              + ("" if every_answer else ", and those with an untrained answer starting with a newline"))
    else:
        c.refuse("template", (LLAMAFACTORY_REFUSED[template] + "; " if template in LLAMAFACTORY_REFUSED else "")
                 + f"gapless trains LLaMA-Factory's {', '.join(LLAMAFACTORY)}; for another, "
                   "unset template (the tokenizer's own chat template) or set data.chat_template to its Jinja")
    if c.get("mix_strategy", "concat") != "concat":
        c.refuse("mix_strategy", "gapless concatenates its sources (mix_strategy: concat)")
    elif "mix_strategy" in raw:
        c.note("mix_strategy", "the datasets concatenated, as gapless's sources are")
    _llamafactory_data(c, eval_strategy)
    return c.finish({k: v for k, v in LLAMAFACTORY_IGNORABLE.items() if v})


def _llamafactory_method(c: _Converter, finetuning: str) -> None:
    """finetuning_type (its default lora), quantization_bit (QLoRA) and the LoRA keys, with LLaMA-Factory's
    defaults (hparams/finetuning_args.py: lora_rank 8, lora_alpha lora_rank * 2, lora_dropout 0, lora_target all)."""
    raw = c.raw
    bits = c.get("quantization_bit")
    if finetuning == "full":
        c.method("finetuning_type", "full")
        for key in [k for k in LLAMAFACTORY_LORA_KEYS if k in raw]:
            if key.startswith("quantization") or key == "double_quantization":
                c.refuse(key, "a quantized base trains LoRA only (LLaMA-Factory refuses it too)")
            else:
                c.note(key, "unused: finetuning_type full")
        return
    if finetuning != "lora":
        c.refuse("finetuning_type", "gapless trains lora (qlora with quantization_bit 4) or full, not freeze or oft")
        return
    if bits is None:
        if "finetuning_type" in raw:
            c.method("finetuning_type", "lora")
        else:
            _default(c, "finetuning_type", "method", "lora", "LLaMA-Factory")
    elif int(bits) == 4:
        c.method("quantization_bit", "qlora")
        c.note("finetuning_type", "lora on the 4-bit base: method qlora")
    else:
        c.refuse("quantization_bit", "gapless quantizes the base to 4 bits (NF4, method qlora) only")
    quantized = bits is not None
    for key, accepted, why in (
            ("quantization_method", ("bitsandbytes", "bnb"), "gapless's QLoRA is bitsandbytes' NF4"),
            ("quantization_type", ("nf4",), "gapless's QLoRA stores NF4, not FP4"),
            ("double_quantization", (True,), "gapless's QLoRA quantizes the NF4 scales too (double quantization)")):
        if key not in raw:
            continue
        if not quantized:
            c.note(key, "unused: no quantization_bit")
        elif c.get(key) in accepted:
            c.note(key, f"{_show(c.get(key))}, as gapless's QLoRA")
        else:
            c.refuse(key, why)
    if c.has("lora_rank"):
        c.put("lora_rank", "lora.r", int(c.get("lora_rank")))
    else:
        _default(c, "lora_rank", "lora.r", 8, "LLaMA-Factory")
    rank = int(raw.get("lora_rank") or 8)
    if not c.has("lora_alpha"):  # (lora_alpha and lora_dropout, when set, are SHARED_KEYS)
        _default(c, "lora_alpha", "lora.alpha", float(rank * 2), "LLaMA-Factory", ": lora_rank * 2")
    if not c.has("lora_dropout"):
        _default(c, "lora_dropout", "lora.dropout", 0.0, "LLaMA-Factory")
    target = c.get("lora_target", "all")
    names = [t.strip() for t in target.split(",")] if isinstance(target, str) else list(target)
    if names == ["all"]:  # every linear layer but lm_head (model_utils/misc.py find_all_linear_modules)
        if "lora_target" in raw:
            c.put("lora_target", "lora.target_modules", list(ALL_LINEAR))
        else:
            _default(c, "lora_target", "lora.target_modules", list(ALL_LINEAR), "LLaMA-Factory", ": all")
    elif names and set(names) <= set(ALL_LINEAR):
        c.put("lora_target", "lora.target_modules", names)
    else:
        c.refuse("lora_target", f"gapless adapts only the decoder's linear layers {list(ALL_LINEAR)}")
    if c.get("use_rslora"):
        c.put("use_rslora", "lora.use_rslora", True)
    elif "use_rslora" in raw:
        c.note("use_rslora", "off")
    if c.has("additional_target"):
        c.refuse("additional_target", REFUSED_HINTS["lora_modules_to_save"])
    if c.has("loraplus_lr_ratio"):
        c.refuse("loraplus_lr_ratio", "LoRA+ trains B at a higher learning rate than A; gapless trains both at "
                                      "optim.lr")
    for key in ("loraplus_lr_embedding", "pissa_iter", "pissa_convert"):
        if key in raw and key not in c.seen:
            c.note(key, "unused: " + ("no loraplus_lr_ratio" if key.startswith("lora") else "pissa_init is off"))


def _llamafactory_data(c: _Converter, eval_strategy: str) -> None:
    """dataset and eval_dataset (names in DATASET_DIR/dataset_info.json) as data.sources and data.eval_sources;
    val_size, max_samples and tokenized_path."""
    raw = c.raw
    if not c.has("dataset"):
        c.refused.append("dataset: missing; name the datasets of dataset_info.json to train on")
    else:
        _llamafactory_datasets(c, "dataset", "data.sources")
    val = c.get("val_size")
    if c.has("eval_dataset"):
        _llamafactory_datasets(c, "eval_dataset", "data.eval_sources")
        if val:
            c.refuse("val_size", "eval_dataset and val_size are both set (LLaMA-Factory refuses that too)")
    if val and not c.has("eval_dataset"):
        if 0 < float(val) < 1:
            c.put("val_size", "data.eval_fraction", float(val))
        else:
            c.refuse("val_size", "gapless holds out a fraction of the records (0 < val_size < 1), not a count")
    elif "val_size" in raw and not val:
        c.note("val_size", "0: no held-out split")
    if c.has("max_samples"):
        _max_samples(c, int(c.get("max_samples")))
    if c.has("tokenized_path"):
        path = Path(str(c.get("tokenized_path"))).expanduser()
        if path.exists():
            c.refuse("tokenized_path", f"{path} exists, so LLaMA-Factory trains on the data saved there, not on "
                                       "dataset; gapless tokenizes the datasets (into data.cache_dir): remove it")
        else:
            c.note("tokenized_path", "where LLaMA-Factory saves the tokenized data; gapless caches it in "
                                     "data.cache_dir")


def _llamafactory_datasets(c: _Converter, key: str, dotted: str) -> None:
    """A comma-separated list of dataset names, each a description in DATASET_DIR/dataset_info.json (dataset_dir
    ONLINE: each name a Hugging Face hub dataset)."""
    value = c.get(key)
    names = [n.strip() for n in value.split(",")] if isinstance(value, str) else [str(n) for n in value]
    folder = str(c.get("dataset_dir") or "data")
    info: dict | None = None
    if folder != "ONLINE":
        path = Path(folder).expanduser() / "dataset_info.json"
        try:
            info = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            c.refused.append(f"{key}: {value}: cannot read {path}, which describes the datasets (dataset_dir "
                             f"{folder}): {e}")
            return
    sources = []
    for i, name in enumerate(names):
        if info is None:
            src, notes, bad = {"path": name}, ["dataset_dir ONLINE: a Hugging Face hub dataset"], []
        elif name not in info:
            c.refused.append(f"{key}: {name!r} is not described in {folder}/dataset_info.json")
            continue
        else:
            src, notes, bad = _llamafactory_dataset(info[name], folder)
        entry = info[name] if info else {}
        for k, why in bad:
            c.refused.append(f"{key}: {name}: {k}" + (f": {_show(entry[k])}" if k in entry else "") + f": {why}")
        sources.append(src)
        c.conv.applied.append((f"{key}: {name}", f"{dotted}[{len(sources) - 1}]: {src}"
                               + (f"  ({'; '.join(notes)})" if notes else "")))
    _set(c.out, dotted, sources)


# dataset_info.json's columns (data/README.md) for each formatting, as gapless's canonical fields
LLAMAFACTORY_COLUMNS = {"alpaca": {"prompt": "instruction", "query": "input", "response": "output",
                                   "system": "system", "history": "history"},
                        "sharegpt": {"messages": "conversations", "system": "system", "tools": "tools"}}
# the columns LLaMA-Factory reads where an entry has no `columns` (data/parser.py DatasetAttr); an entry with
# `columns` reads those it names and no other (DatasetAttr.join sets every unnamed one to None)
LLAMAFACTORY_DEFAULT_COLUMNS = {"alpaca": {"prompt": "instruction", "query": "input", "response": "output"},
                                "sharegpt": {"messages": "conversations"}}
# its sharegpt tags: (tag, LLaMA-Factory's default role name, gapless's role)
LLAMAFACTORY_ROLE_TAGS = (("user_tag", "human", "user"), ("assistant_tag", "gpt", "assistant"),
                          ("observation_tag", "observation", "tool"), ("function_tag", "function_call", "tool_call"),
                          ("system_tag", "system", "system"))


def _llamafactory_dataset(entry: dict, folder: str) -> tuple[dict, list[str], list[tuple[str, str]]]:
    """One description of dataset_info.json as a gapless source: (source, notes, refused (key, why))."""
    notes, bad = [], []
    known = {"hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "file_name", "formatting", "ranking", "subset",
             "split", "folder", "num_samples", "columns", "tags"}
    bad += [(k, "no gapless equivalent for this dataset key") for k in entry if k not in known]
    if entry.get("hf_hub_url"):  # LLaMA-Factory takes the Hugging Face one unless USE_MODELSCOPE_HUB is set
        src: dict = {"path": str(entry["hf_hub_url"])}
    elif entry.get("ms_hub_url") or entry.get("om_hub_url"):
        key = "ms_hub_url" if entry.get("ms_hub_url") else "om_hub_url"
        src = {"path": str(entry[key])}
        bad.append((key, "a ModelScope or Modelers dataset; download its files into dataset_dir and name them "
                         "with file_name"))
    elif entry.get("script_url"):
        src = {"path": str(entry["script_url"])}
        bad.append(("script_url", "gapless runs no dataset loading script; give the data files with file_name"))
    elif entry.get("file_name"):
        src = {"path": str(Path(folder) / str(entry["file_name"]))}
    else:
        src = {"path": ""}
        bad.append(("file_name", "missing: no file_name nor hf_hub_url"))
    if entry.get("split", "train") != "train":
        bad.append(("split", "gapless reads whole files; give that split's files with file_name"))
    for key, why in (("subset", "gapless reads whole files; give the subset's files with file_name"),
                     ("folder", "give the folder's files with file_name"),
                     ("num_samples", "gapless reads every record (SourceConfig.epochs samples a seeded fraction)"),
                     ("ranking", "a preference dataset (chosen, rejected), for reward modelling and DPO; gapless "
                                 "trains supervised fine-tuning")):
        if entry.get(key):
            bad.append((key, why))
    fmt = entry.get("formatting", "alpaca")
    if fmt not in LLAMAFACTORY_COLUMNS:
        bad.append(("formatting", "gapless reads LLaMA-Factory's alpaca and sharegpt formats"))
        return src, notes, bad
    src["format"] = fmt
    theirs = ({k: v for k, v in (entry["columns"] or {}).items() if v is not None} if "columns" in entry
              else LLAMAFACTORY_DEFAULT_COLUMNS[fmt])
    columns: dict[str, str | None] = {}
    for name, column in theirs.items():
        ours = LLAMAFACTORY_COLUMNS[fmt].get(name)
        if ours is None:
            bad.append((f"columns.{name}", f"{column!r}: not a column of supervised {fmt} data gapless reads "
                                           f"({', '.join(LLAMAFACTORY_COLUMNS[fmt])})"))
        elif column != ours:
            columns[ours] = column
    # what LLaMA-Factory does not read: an optional field gapless would read where a record has it is mapped to null
    # (SourceConfig.columns), one every record needs is refused
    unread = []
    for name, ours in LLAMAFACTORY_COLUMNS[fmt].items():
        if name in theirs:
            continue
        if ours in DATA_FORMAT_OPTIONAL[fmt]:
            columns[ours] = None
            unread.append(ours)
        else:
            bad.append(("columns", f"no {name}, so LLaMA-Factory reads no {ours} column (it reads only the "
                                   f"columns an entry names); name it ({name}: {ours})"))
    if unread:
        notes.append(f"{', '.join(unread)}: null, not read where a record has it: LLaMA-Factory reads only the "
                     "columns dataset_info.json names" + ("" if "columns" in entry else " (or its defaults)"))
    tags = entry.get("tags") or {}
    if fmt == "alpaca":
        # gapless's alpaca joins them with a blank line, which no setting changes (gapless.data.formats.to_example);
        # LLaMA-Factory's AlpacaDatasetConverter with "\n".join
        if columns.get("input", "input") is not None:
            notes.append("the user turn is instruction, a blank line and input (LLaMA-Factory joins them with one "
                         "newline), rendered through the chat template")
        bad += [(f"tags.{k}", "tags are for the sharegpt format") for k in tags]
    else:
        for tag, ours in (("role_tag", "from"), ("content_tag", "value")):
            if tags.get(tag, ours) != ours:
                columns[ours] = tags[tag]
        roles = {}
        for tag, default, ours in LLAMAFACTORY_ROLE_TAGS:
            name = tags.get(tag, default)
            if DEFAULT_ROLES.get(name) != ours:
                roles[name] = ours
        if roles:
            src["roles"] = roles
        known_tags = {"role_tag", "content_tag"} | {t for t, _, _ in LLAMAFACTORY_ROLE_TAGS}
        bad += [(f"tags.{k}", "no gapless equivalent for this tag") for k in tags if k not in known_tags]
    if columns:
        src["columns"] = columns
    return src, notes, bad


def _max_samples(c: _Converter, limit: int) -> None:
    """max_samples: LLaMA-Factory trains the first `limit` records of each dataset. gapless reads every record, which
    is the same where no local dataset has more (LLaMA-Factory's demo datasets hold at most 1,000)."""
    from gapless.data.formats import read_rows, resolve_files

    counts = []
    for s in c.out.get("data", {}).get("sources", []) + c.out.get("data", {}).get("eval_sources", []):
        if is_hub_id(s["path"]):
            counts.append(None)
            continue
        try:
            counts.append(sum(1 for f in resolve_files(s["path"]) for _ in read_rows(f)))
        except (ValueError, OSError):
            counts.append(None)
    if counts and all(n is not None and n <= limit for n in counts):
        c.note("max_samples", f"no effect: each dataset holds at most {limit} records ({', '.join(map(str, counts))})")
    else:
        c.refuse("max_samples", f"LLaMA-Factory trains the first {limit} records of each dataset; gapless reads every "
                                "record: write the first ones to a file of their own (a hub dataset's records "
                                "cannot be counted here)")


def convert(raw: dict, fmt: str | None = None) -> Conversion:
    """The gapless config dict of an Axolotl, TRL or LLaMA-Factory mapping (fmt None: detected)."""
    fmt = fmt or detect(raw)
    if fmt == "axolotl":
        return convert_axolotl(raw)
    if fmt == "trl":
        return convert_trl(raw)
    if fmt == "llamafactory":
        return convert_llamafactory(raw)
    return Conversion(raw, "gapless")


def load_any(path: str | Path, overrides: list[str] = (), out=None) -> RunConfig:
    """The run config of a gapless, Axolotl, TRL or LLaMA-Factory YAML file, overrides applied (as gapless keys);
    prints the mapping a conversion applied to `out` (stderr by default)."""
    import sys

    from gapless.config import ConfigError, load_config, read_yaml, require_settings

    raw = read_yaml(path)
    require_settings(raw, path, overrides)
    fmt = detect(raw)
    if fmt == "gapless":
        return load_config(path, overrides)
    conv = convert(raw, fmt)
    print(conv.format(), file=out or sys.stderr)
    try:
        return load_config(data=conv.config, overrides=overrides)
    except ValueError as e:  # named in gapless's fields, which the mapping printed above ties to the file's keys
        raise ConfigError([f"{path} ({fmt} config, as converted above): {line.removeprefix('config.')}"
                           for line in (e.errors if isinstance(e, ConfigError) else [str(e)])]) from e


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
