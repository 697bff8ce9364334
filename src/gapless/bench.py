"""`gapless bench`: training throughput of LoRA fine-tuning, one optimisation at a time, on real training steps.

    gapless bench [--model bench/models/llama-3.2-3b] [--ladder | --config NAME[,NAME...]] [--steps 8]
                  [--warmup 3] [--lengths FILE | --data DIR --tokenizer DIR] [--peers] [--out bench/results.jsonl]

What one configuration measures
- The model: the architecture of `--model`'s config.json (no weights on disk), assembled as a run assembles its
  model (gapless.train.assemble: built on the meta device, LoRA r=16 on all seven projections of every layer with
  gapless's defaults: alpha 32, dropout 0, float32 adapter weights with bf16 matmuls; checkpointing and compile as
  the recipe says), its weights drawn on the device in bf16 with HF's init (normal, std 0.02; norms 1) in place of
  a checkpoint's. Random weights do the same work as trained ones.
- The step: the loop's step (gapless.train.step.train_step): the loss sum through the model's forward, backward
  of loss / trained tokens, gradient clipping (1.0) and fused AdamW over the LoRA weights. No learning-rate
  schedule (a host-side multiply). The loss is the chunked fused cross-entropy (gapless.kernels.loss) for
  "fused" (its per-chunk softmax/gradient step eager), the same with the step a compiled run uses for
  "fused_compiled" (step "auto": the Triton kernel on CUDA, torch.compile elsewhere), with the step through
  torch.compile for "fused_inductor", and a materialised [tokens, vocab] logits tensor, as transformers computes
  it, for "materialised" (CausalLM.loss_chunk_size None).
- The data: the real data path. Either the shared messages files tokenized by `data.build_data` with the Llama 3
  tokenizer (max_seq_len 4096, overlong truncated), or, where those are absent (the GPU machine), a token-length
  file (`--lengths`, e.g. peers/lengths_shared_mix.txt: the Llama 3 lengths of the same records): its lengths,
  capped at max_seq_len as tokenization truncates, become an in-memory TokenizedDataset of random token ids, every
  token trained, in a real Mixture. Either way the batches come from the same BatchSampler / Batch code a run
  uses; token values and the loss mask change no work (the LM head runs on every token).
- Batches are collated and copied to the device before the timed window (a run's Prefetcher overlaps that with
  the step), so the timed window is the step alone: `--steps` steps between two CUDA events, no host sync inside.
  Real tokens/s = non-pad tokens of those steps / that time. Peak GiB = torch.cuda.max_memory_allocated from the
  model's build to the end. The forward / backward / optimizer split comes from a separate profiling pass
  (`--profile-steps`, events and a sync around every phase), so its sum can differ a little from step_ms. The
  fused loss computes its gradient during the forward (gapless.kernels.loss), so its backward GEMMs count as fwd.
- MFU = the step's useful FLOPs (gapless.meter.flops: over the real document lengths only) / time / the dense
  bf16 peak measured here (median of 20 8192^3 matmuls; 789 TFLOP/s on the H200 of peers/README.md).

The ladder (`--ladder`, in this order; each rung is one named configuration):
  pad_to_max_ckpt       every document padded to 4096, 4 per batch; sdpa with a padding mask; materialised
                        logits; every layer checkpointed (what a default HF Trainer run does)
  dyn_pad               dynamic padding: as many documents as fit in tokens_per_batch slots padded to the longest
  packed                documents packed into 4 rows of 4096 (cu_seqlens), attention "varlen": the sdpa
                        reference loops over documents with a host sync each (33 ms/layer at 16k tokens on the
                        H200 against 2.8 for varlen, bench/kernels_h200.jsonl), so packing is measured with varlen
  packed_fused          + the fused, chunked linear cross-entropy (no [tokens, vocab] logits)
  packed_fused_flex     + FlexAttention instead of varlen (2.48 vs 2.81 ms/layer, but ~200 s of first compile)
  packed_fused_compile  + torch.compile of each decoder layer (varlen), and the loss's per-chunk step as a
                        compiled run has it (the Triton kernel on CUDA)
  best                  + LoRA's A matmuls grouped for q/k/v and for gate/up (lora.kernel "grouped"; the
                        rungs above run PEFT's per-layer formula; the trainer's default, "concat_b", is in
                        `default`)
Not in the ladder, as it needs flash-attn-4: best_fa4, best with fa4_op attention, the fastest measured.
Anywhere, the CPU included: packed_sdpa and packed_sdpa_fused (packed with the sdpa reference attention).

Compiled layers must not recompile per batch: cu_seqlens changes length with the number of documents and
max_seqlen (a host int) changes too, so layers are compiled with symbolic sizes from the start (compile_layers);
the first warm-up step compiles, and each row reports the graphs compiled during its timed window
(`new_graphs_timed`, 0 expected).

`--peers` runs shared/peers/hf_peft_bench.py (Hugging Face transformers + PEFT) configurations as subprocesses
with the same lengths file, steps and tokens per batch, and records them with system "hf+peft" in the same
run_id; their FLOPs come from the same formula over the same document lengths, replayed from the peer's seeded
length stream. Rows are appended to `--out` one by one (a later failure loses nothing), and the table between
the bench markers of RESULTS.md beside it is regenerated from all rows of the run_id.
A configuration that fails (out of memory, a compile error) is recorded with its error and the next one runs.
"""
from __future__ import annotations

import datetime
import gc
import importlib.util
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
import traceback
import uuid
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from gapless.config import ALL_LINEAR, DataConfig, LoraConfig, OptimConfig, from_dict, resolve_device
from gapless.data.batching import Batch, BatchSampler, Mixture
from gapless.data.cache import TokenizedDataset
from gapless.kernels.attention import choose_backend
from gapless.kernels.loss import DEFAULT_CHUNK_SIZE
from gapless.meter.flops import measure_peak_flops, mfu, step_flops
from gapless.model.decoder import CausalLM, ModelArgs
from gapless.model.loading import DTYPES, model_args_from_config, read_config
from gapless.model.method import Full, Lora, Method, Qlora
from gapless.train.assemble import assemble, random_tensors
from gapless.train.compile import frames_not_compiled
from gapless.train.optim import MasterWeights, build_optimizer
from gapless.train.step import train_step

MD_START, MD_END = "<!-- bench:start -->", "<!-- bench:end -->"
GRAD_CLIP = 1.0  # the loop's default (optim.grad_clip)


@dataclass(frozen=True)
class Recipe:
    batching: str  # data.batching: pad_to_max | padded | packed
    attn: str  # attention backend (gapless.kernels.attention)
    # materialised | fused | fused_compiled | fused_inductor (the module docstring; LOSS_STEPS). Rows recorded
    # before the Triton step existed (through run s15) ran torch.compile's step under fused_compiled: what
    # fused_inductor runs now
    loss: str
    checkpoint: bool = False  # activation checkpointing of every decoder layer
    compile: bool = False  # torch.compile of every decoder layer
    # lora.kernel (gapless.config.LoraKernel): the rungs before `best` run PEFT's per-layer formula, `best` adds the
    # grouping (the trainer's default), so the ladder shows what each step is worth
    lora_kernel: str = "reference"
    loss_chunk: int = DEFAULT_CHUNK_SIZE  # tokens per chunk of the fused loss: its transient is chunk * vocab * 6 B
    lora_dropout: float = 0.0
    fused_dropout: bool = True  # lora.fused_dropout: the mask drawn in the A matmul's kernels (CUDA with triton)
    method: str = "lora"  # config.method: lora | qlora (NF4 base) | full (every weight, float32 masters)
    # inductor's settings for the compiled layers, (name, value) pairs (gapless.train.compile.compile_layers)
    inductor: tuple[tuple[str, object], ...] = ()

    def describe(self) -> str:
        parts = [self.batching, self.attn, f"{self.loss} loss"]
        return ", ".join(parts + (["ckpt"] if self.checkpoint else []) + (["compiled layers"] if self.compile else [])
                         + ([f"{self.lora_kernel} LoRA"] if self.lora_kernel != "reference" else [])
                         + ([f"loss chunk {self.loss_chunk}"] if self.loss_chunk != DEFAULT_CHUNK_SIZE else [])
                         + ([f"LoRA dropout {self.lora_dropout:g}" + ("" if self.fused_dropout else " (torch)")]
                            if self.lora_dropout else [])
                         + ([f"method {self.method}"] if self.method != "lora" else [])
                         + [f"inductor {name}={value}" for name, value in self.inductor])


CONFIGS = {
    "pad_to_max_ckpt": Recipe("pad_to_max", "sdpa", "materialised", checkpoint=True),
    "dyn_pad": Recipe("padded", "sdpa", "materialised"),
    "packed": Recipe("packed", "varlen", "materialised"),
    "packed_fused": Recipe("packed", "varlen", "fused"),
    "packed_fused_flex": Recipe("packed", "flex", "fused"),
    "packed_fused_compile": Recipe("packed", "varlen", "fused_compiled", compile=True),
    "best": Recipe("packed", "varlen", "fused_compiled", compile=True, lora_kernel="grouped"),
    # best with LoRA dropout 0.05 (the seed's recipe): one mask per group (gapless.kernels.lora), drawn in the fused
    # kernels since lora.fused_dropout (its rows before run s11-default2 ran torch's dropout and saved the masks)
    "best_dropout": Recipe("packed", "varlen", "fused_compiled", compile=True, lora_kernel="grouped",
                           lora_dropout=0.05),
    # the loss chunk before it was halved (kernels/loss.py): 1.4 GiB more at the step's peak, the same speed
    "best_loss_chunk4096": Recipe("packed", "varlen", "fused_compiled", compile=True, lora_kernel="grouped",
                                  loss_chunk=4096),
    # best with flash-attn-4 behind torch custom ops, so the compiled layer keeps one graph (kernels/attention.py,
    # fa4_op): the fastest measured (36,436 tok/s for Llama-3.2-3B on the H200, run s3-grouped2)
    "best_fa4": Recipe("packed", "fa4_op", "fused_compiled", compile=True, lora_kernel="grouped"),
    # the other methods on best's path (issue 14): QLoRA (NF4 base, r16 on all 7), full fine-tuning (bf16 weights,
    # float32 masters and AdamW state); qlora_ckpt checkpoints every layer (Llama-3.1-8B's 24 GiB-card setting)
    "qlora_best": Recipe("packed", "varlen", "fused_compiled", compile=True, lora_kernel="grouped", method="qlora"),
    "qlora_ckpt": Recipe("packed", "varlen", "fused_compiled", checkpoint=True, compile=True, lora_kernel="grouped",
                         method="qlora"),
    "full_best": Recipe("packed", "varlen", "fused_compiled", compile=True, method="full"),
    # best with every layer checkpointed: qlora_ckpt's LoRA twin, so checkpointing's memory under compile is seen
    # apart from QLoRA's
    "best_ckpt": Recipe("packed", "varlen", "fused_compiled", checkpoint=True, compile=True, lora_kernel="grouped"),
    # best and best_fa4 with LoRA inside the base GEMMs (lora.kernel "concat", gapless.kernels.lora): one GEMM of x
    # with [W; A] per group of projections, forward and for dx (the trainer's default since run s12-default)
    "best_concat": Recipe("packed", "varlen", "fused_compiled", compile=True, lora_kernel="concat"),
    "best_fa4_concat": Recipe("packed", "fa4_op", "fused_compiled", compile=True, lora_kernel="concat"),
    # exactly what a default config (gapless.config.RunConfig()) resolves to on this machine: packed rows, the
    # attention backend `attn_backend: auto` picks (fa4_op where flash-attn-4 imports, i.e. with gapless[gpu], varlen
    # otherwise; the row says which), the fused loss with compile_layers' step (the Triton kernel on CUDA), compiled
    # layers, LoRA inside the base GEMMs (lora.kernel concat_b). tests/test_bench.py holds this recipe to the config's
    # defaults; default_dropout is the seed's recipe (lora.dropout 0.05) on it
    "default": Recipe("packed", "auto", "fused_compiled", compile=True, lora_kernel="concat_b"),
    "default_dropout": Recipe("packed", "auto", "fused_compiled", compile=True, lora_kernel="concat_b",
                              lora_dropout=0.05),
    # the A/B for the Triton loss step: default with the loss's per-chunk step through torch.compile (inductor's
    # reduction and pointwise kernels), what fused_compiled ran before the Triton step
    "default_loss_inductor": Recipe("packed", "auto", "fused_inductor", compile=True, lora_kernel="concat_b"),
    # the default before run s12-default (lora.kernel grouped; rows before it named `default` ran this): 33,142
    # against concat's 33,683 tok/s on an H100 in one call (then named default and default_concat)
    "default_grouped": Recipe("packed", "auto", "fused_compiled", compile=True, lora_kernel="grouped"),
    # the default from run s12-default to s17 (lora.kernel concat: the A rows inside the base GEMM; rows named
    # `default` in those runs ran this, and `default_concat_b` ran what `default` is now), and under dropout 0.05,
    # which concat ran as grouped until s17 and runs as concat_b since
    "default_concat": Recipe("packed", "auto", "fused_compiled", compile=True, lora_kernel="concat"),
    # default with every concatenation in the layers' graphs a ConcatKernel, whose parts' producers write into it,
    # not inductor's pointwise cat with masked loads, so that SwiGLU's backward into concat_b's gate|up gradient
    # might read dh and gate once, not once per half (bench/cat_probe.py). Measured equal to default on an H100
    # (34,777 against 34,791 real tok/s, run s20-drop; torch 2.11 knows only the first setting)
    "default_concat_kernel": Recipe("packed", "auto", "fused_compiled", compile=True, lora_kernel="concat_b",
                                    inductor=(("max_pointwise_cat_inputs", 0),
                                              ("max_complex_pointwise_cat_inputs", 0))),
    # default with inductor's coordinate-descent tuning of its Triton kernels' blocks (its elementwise and reduction
    # kernels: about 64 ms of a 471 ms step on an H100, run s19-prof). Measured equal on an H100 (varlen, run s22-cdt:
    # 33,668 against 33,722 real tok/s, -0.2%): the heuristics' blocks already do as well; kept for the A/B only
    "default_cdt": Recipe("packed", "auto", "fused_compiled", compile=True, lora_kernel="concat_b",
                          inductor=(("coordinate_descent_tuning", True),)),
    "default_dropout_grouped": Recipe("packed", "auto", "fused_compiled", compile=True, lora_kernel="grouped",
                                      lora_dropout=0.05),
    # default_dropout with torch's nn.Dropout (lora.fused_dropout: false): a bool mask per group saved for backward
    "default_dropout_torch": Recipe("packed", "auto", "fused_compiled", compile=True, lora_kernel="concat_b",
                                    lora_dropout=0.05, fused_dropout=False),
    # anywhere, the CPU included: the sdpa reference attention (a per-document loop on packed rows)
    "packed_sdpa": Recipe("packed", "sdpa", "materialised"),
    "packed_sdpa_fused": Recipe("packed", "sdpa", "fused"),
}
LADDER = ("pad_to_max_ckpt", "dyn_pad", "packed", "packed_fused", "packed_fused_flex", "packed_fused_compile", "best")
# the fused loss's per-chunk step (gapless.kernels.loss) of each recipe loss; "materialised" has no chunks
LOSS_STEPS = {"fused": "eager", "fused_compiled": "auto", "fused_inductor": "compiled"}
# Seconds a configuration's first steps may take beyond its timed steps, for --time-limit-s: flex's first call
# compiled for 201 s on the H200 (bench/kernels_h200.jsonl); a compiled decoder layer, forward and backward,
# is budgeted at 90 s.
FIRST_CALL_S = {"flex": 220.0, "fa4_op": 30.0, "auto": 30.0, "compile": 90.0}
PEER_MAX_SEQ = 4096  # hf_peft_bench.py caps every document at 4096 tokens
PEER_FIRST_CALL_S = 30.0  # imports and building the model


# ---------------------------------------------------------------------------------------------
# transforms and the model


def build_model(args: ModelArgs, recipe: Recipe, device: torch.device, dtype: torch.dtype, lora_r: int = 16,
                seed: int = 0) -> tuple[CausalLM, Method]:
    """The architecture with random weights (no checkpoint on disk), assembled as a run assembles its model
    (gapless.train.assemble: built on meta, the method, checkpointing, compile, then the weights), and the recipe's
    loss."""
    lora = LoraConfig(r=lora_r, kernel=recipe.lora_kernel, dropout=recipe.lora_dropout,
                      fused_dropout=recipe.fused_dropout)
    recipe = replace(recipe, attn=resolve_attn(recipe, args, device, dtype)[0])
    method = {"lora": lambda: Lora(lora), "qlora": lambda: Qlora(lora, dtype), "full": Full}[recipe.method]()
    with torch.device("meta"):
        model = CausalLM(args, attn_backend=recipe.attn)
    model = assemble(model, method, device, dtype, activation_checkpointing=int(recipe.checkpoint),
                     compile=recipe.compile, compile_options=dict(recipe.inductor),
                     tensors=random_tensors(model, device, dtype, seed))
    model.loss_chunk_size = None if recipe.loss == "materialised" else recipe.loss_chunk
    model.loss_step = LOSS_STEPS.get(recipe.loss, "eager")
    return model, method


def resolve_attn(recipe: Recipe, args: ModelArgs, device: torch.device, dtype: torch.dtype) -> tuple[str, str]:
    """(backend, why): the recipe's attention, with "auto" chosen as a run chooses it (gapless.train.loop.resolve_auto
    through kernels.attention.choose_backend); why is "" for a named backend."""
    if recipe.attn != "auto":
        return recipe.attn, ""
    return choose_backend(device, dtype, recipe.batching == "packed", softcap=args.attn_softcap is not None,
                          head_dim=args.head_dim)


# ---------------------------------------------------------------------------------------------
# data


def lengths_mixture(path: str | Path, vocab_size: int, max_seq_len: int, seed: int = 0) -> Mixture:
    """A Mixture of documents with the file's token lengths (capped at max_seq_len) and random token ids."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--lengths: {path} not found; give a file of whitespace-separated token counts")
    try:
        lengths = np.array(path.read_text().split(), dtype=np.int64)
    except ValueError:
        raise ValueError(f"--lengths: {path} must hold whitespace-separated integers (token counts)") from None
    if not len(lengths) or lengths.min() < 1:
        raise ValueError(f"--lengths: {path} must hold at least one length, all >= 1")
    lengths = np.minimum(lengths, max_seq_len)  # tokenization truncates overlong records at max_seq_len
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    ids = np.random.default_rng(seed).integers(0, vocab_size, int(offsets[-1]), dtype=np.int32)
    mask = np.ones(int(offsets[-1]), np.uint8)  # every token trained: the LM head runs on every token anyway
    ds = TokenizedDataset(ids, mask, offsets, np.arange(len(lengths), dtype=np.int32), {"pad_id": 0})
    return Mixture([ds], [len(ds)], [f"lengths:{path.name}"])


def load_documents(opts, vocab_size: int) -> tuple[Mixture, str]:
    """(Mixture, description): the lengths file when given, else the messages data through build_data."""
    if opts.lengths:
        return lengths_mixture(opts.lengths, vocab_size, opts.max_seq_len), f"lengths {opts.lengths}"
    data, tokenizer = Path(opts.data), Path(opts.tokenizer)
    if not data.exists() or not tokenizer.is_dir():
        raise ValueError(f"--data {data} or --tokenizer {tokenizer} not found; pass both, or --lengths FILE "
                         "(a token-length file such as peers/lengths_shared_mix.txt)")
    from gapless.data.pipeline import build_data

    cfg = from_dict(DataConfig, {"sources": [{"path": str(data)}], "tokenizer": str(tokenizer),
                                 "max_seq_len": opts.max_seq_len, "tokens_per_batch": opts.tokens_per_batch}, "data")
    mix, _, _ = build_data(cfg)
    top = max((int(d.ids.max()) for d in mix.datasets if len(d.ids)), default=0)
    if top >= vocab_size:
        raise ValueError(f"--tokenizer {tokenizer} produces token id {top}, outside the model's vocab_size "
                         f"{vocab_size}; use the model's own tokenizer")
    return mix, f"{data} ({tokenizer.name} tokenizer, {len(mix)} documents)"


def take_batches(sampler: BatchSampler, n: int, device: torch.device) -> list[tuple[Batch, list[int]]]:
    """The sampler's first n batches (epochs continue as a run's would), on the device, with their documents'
    real lengths (for the FLOPs: cu_seqlens also holds each packed row's padding tail)."""
    out: list[tuple[Batch, list[int]]] = []
    epoch = 0
    while len(out) < n:
        plan = sampler.plan(epoch)
        if not plan:
            raise ValueError("no documents to batch")
        for item in plan[:n - len(out)]:
            docs = [d for row in item for d in row] if sampler.strategy == "packed" else list(item)
            out.append((sampler.collate(item).to(device), [int(x) for x in sampler.mix.lengths[docs]]))
        epoch += 1
    return out


# ---------------------------------------------------------------------------------------------
# timing


class Clock:
    """CUDA events on the GPU (read after a sync), the host clock on the CPU (where work is synchronous)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def ms(self, start, end) -> float:
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.machine()}, {os.cpu_count()} cores)"


def _graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


# ---------------------------------------------------------------------------------------------
# one configuration


@dataclass
class Context:
    """What every configuration of one invocation shares."""
    opts: object  # the parsed command line
    args: ModelArgs
    model_name: str
    device: torch.device
    dtype: torch.dtype
    mix: Mixture | None
    data: str
    peak_flops: float | None
    gpu: str
    run_id: str
    command: str
    started: float

    def time_left(self) -> float:
        limit = self.opts.time_limit_s
        return math.inf if limit is None else limit - (time.perf_counter() - self.started)


def base_row(ctx: Context, system: str, config: str) -> dict:
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "gpu": ctx.gpu,
            "system": system, "config": config, "model": ctx.model_name, "real_tok_s": None, "peak_gib": None,
            "mfu": None, "padding_fraction": None, "step_ms": None, "fwd_ms": None, "bwd_ms": None, "opt_ms": None,
            "command": ctx.command, "run_id": ctx.run_id, "torch": torch.__version__, "error": None}


def run_config(ctx: Context, name: str, recipe: Recipe) -> dict:
    """Build, warm up, time and profile one configuration; returns its row (raises on failure)."""

    opts, device = ctx.opts, ctx.device
    cuda = device.type == "cuda"
    clock = Clock(device)
    allocated_before = torch.cuda.memory_allocated(device) / 2**30 if cuda else None
    sampler = BatchSampler(ctx.mix, strategy=recipe.batching, max_seq_len=opts.max_seq_len,
                           tokens_per_batch=opts.tokens_per_batch, seed=0)
    batches = take_batches(sampler, opts.warmup + opts.steps + opts.profile_steps, device)
    warm, timed, profile = (batches[:opts.warmup], batches[opts.warmup:opts.warmup + opts.steps],
                            batches[opts.warmup + opts.steps:])

    attn, attn_why = resolve_attn(recipe, ctx.args, device, ctx.dtype)
    model, method = build_model(ctx.args, recipe, device, ctx.dtype, opts.lora_r)
    lora = getattr(method, "cfg", None)  # None for full fine-tuning
    frames_failed_before = frames_not_compiled()
    masters = MasterWeights(method.trainable(model).items())  # as the loop: float32 masters of bf16 trainables
    params = masters.masters
    optimizer = build_optimizer(params, OptimConfig(grad_clip=GRAD_CLIP), device.type)
    masters.attach(optimizer)

    def step(b: Batch, mark=None):  # the loop's step (gapless.train.step) without the scheduler
        return train_step(model, [b], params, optimizer, GRAD_CLIP, mark)[0]

    if cuda:
        torch.cuda.reset_peak_memory_stats(device)

    # warm-up: compiles, autotunes, allocator growth; timed on the host with a sync at each end
    clock.sync()
    t0 = time.perf_counter()
    for b, _ in warm:
        step(b)
    clock.sync()
    warmup_s = time.perf_counter() - t0

    # the timed window: no host sync between the two events
    graphs_before = _graphs_compiled()
    start = clock.mark()
    for b, _ in timed:
        loss = step(b)
    end = clock.mark()
    clock.sync()
    seconds = clock.ms(start, end) / 1e3
    new_graphs = _graphs_compiled() - graphs_before

    # the profiling pass: events after each phase, a sync per step
    phases = np.zeros(3)
    for b, _ in profile:
        clock.sync()
        marks = [clock.mark()]
        step(b, lambda: marks.append(clock.mark()))
        clock.sync()
        phases += [clock.ms(marks[i], marks[i + 1]) for i in range(3)]
    phases /= max(len(profile), 1)
    peak_gib = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
    final_loss = float(loss) / max(timed[-1][0].num_target_tokens, 1)  # SYNC: after timing

    real = sum(b.num_real_tokens for b, _ in timed)
    slots = sum(b.num_slots for b, _ in timed)
    flops = sum(step_flops(ctx.args, lengths, **method.flops) for _, lengths in timed)
    row = base_row(ctx, "gapless", name)
    row.update(
        real_tok_s=round(real / seconds, 1), peak_gib=None if peak_gib is None else round(peak_gib, 2),
        mfu=_sig(mfu(flops, seconds, ctx.peak_flops)), padding_fraction=round(1 - real / slots, 4),
        step_ms=round(seconds * 1e3 / len(timed), 2),
        fwd_ms=round(phases[0], 2) if profile else None, bwd_ms=round(phases[1], 2) if profile else None,
        opt_ms=round(phases[2], 2) if profile else None,
        recipe=asdict(recipe), describe=replace(recipe, attn=attn if attn == recipe.attn else f"auto: {attn}").describe(), attn=attn, attn_why=attn_why or None, data=ctx.data, dtype=str(ctx.dtype).replace("torch.", ""),
        steps=len(timed), warmup=len(warm), profile_steps=len(profile), tokens_per_batch=opts.tokens_per_batch,
        max_seq_len=opts.max_seq_len, method=recipe.method,
        lora=lora and {"r": lora.r, "alpha": lora.alpha, "dropout": lora.dropout, "targets": list(lora.target_modules)},
        real_tokens=real, slots=slots, tflops=_sig(flops / seconds / 1e12), peak_tflops=_sig(ctx.peak_flops / 1e12),
        warmup_s=round(warmup_s, 2), new_graphs_timed=new_graphs,
        frames_not_compiled=frames_not_compiled() - frames_failed_before,
        allocated_before_gib=None if allocated_before is None else round(allocated_before, 2),
        loss=round(final_loss, 4) if math.isfinite(final_loss) else str(final_loss))
    return row


def free_device_memory(device: torch.device) -> None:
    """Drop the last configuration's model, and dynamo's compiled code that may still refer to it. Compiling the
    same layer again costs only dynamo's trace: inductor's FX-graph and AOT-autograd caches keep the kernels."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def first_call_estimate(recipe: Recipe) -> float:
    return FIRST_CALL_S.get(recipe.attn, 0.0) + (FIRST_CALL_S["compile"] if recipe.compile else 0.0)


def run_configs(ctx: Context, names: list[str], out: Path, log) -> list[dict]:
    rows = []
    step_s = 2.0  # a guess for the first configuration's steps; then the last measured step time
    for name in names:
        recipe = CONFIGS[name]
        need = first_call_estimate(recipe) + (ctx.opts.warmup + ctx.opts.steps + ctx.opts.profile_steps) * step_s
        if need > ctx.time_left():
            row = base_row(ctx, "gapless", name)
            row.update(describe=recipe.describe(), error=f"skipped: needs ~{need:.0f} s, {ctx.time_left():.0f} s "
                                                         "left of --time-limit-s")
        else:
            print(f"[bench] {ctx.model_name} {name}: {recipe.describe()}", file=log, flush=True)
            try:
                row = run_config(ctx, name, recipe)
                step_s = row["step_ms"] / 1e3
            except Exception as e:  # OOM, a compile error...: recorded, and the ladder goes on
                traceback.print_exc(file=log)
                row = base_row(ctx, "gapless", name)
                row.update(describe=recipe.describe(), error=f"{type(e).__name__}: {_first_line(e)}")
            free_device_memory(ctx.device)
        append_row(out, row)
        print(f"[bench] {format_row(row)}", file=log, flush=True)
        rows.append(row)
    return rows


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else repr(e))[:400]


# ---------------------------------------------------------------------------------------------
# peers: Hugging Face transformers + PEFT, same lengths, same steps


def load_peer(peers_dir: Path):
    script = peers_dir / "hf_peft_bench.py"
    if not script.is_file():
        raise ValueError(f"--peers-dir: {script} not found; point --peers-dir at the folder of hf_peft_bench.py")
    spec = importlib.util.spec_from_file_location("hf_peft_bench", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return script, module


def peer_doc_lengths(peer, config: str, lengths_file: str, warmup: int, steps: int,
                     pack_tokens: int) -> list[list[int]]:
    """The documents of each timed step of the peer, replayed from its seeded length stream (its own code)."""
    mode, micro_batch = peer.CONFIGS[config][:2]
    stream = peer.lengths_stream(lengths_file)
    per_step = []
    for _ in range(warmup + steps):
        if mode == "packed":  # peer.packed_batch: whole documents until the row is full, the last one cut
            docs: list[int] = []
            while sum(docs) < pack_tokens:
                docs.append(min(next(stream), PEER_MAX_SEQ))
            docs[-1] -= sum(docs) - pack_tokens
            if docs[-1] == 0:
                docs.pop()
        elif mode == "fixed":
            docs = [PEER_MAX_SEQ] * micro_batch
        else:  # pad_max, dyn: micro_batch documents, padded
            docs = [min(next(stream), PEER_MAX_SEQ) for _ in range(micro_batch)]
        per_step.append(docs)
    return per_step[warmup:]


def _peer_architecture_matches(peer, args: ModelArgs, built: dict | None = None) -> bool:
    """`built`: the sizes the peer reports it built (bench/peers' copy, which takes --model-config); else the
    Llama-3.2-3B the shared script always builds."""
    a = built or peer.LLAMA32_3B
    return (a["hidden_size"], a["intermediate_size"], a["num_hidden_layers"], a["num_attention_heads"],
            a["num_key_value_heads"], a["head_dim"], a["vocab_size"]) == (
        args.hidden_size, args.intermediate_size, args.num_hidden_layers, args.num_attention_heads,
        args.num_key_value_heads, args.head_dim, args.vocab_size)


def run_peers(ctx: Context, names: list[str], log) -> list[dict]:
    """Rows of the peers' configurations; MFU is filled in by `finish_peer_row` once the peak is known."""
    opts = ctx.opts
    if not opts.lengths:
        raise ValueError("--peers needs --lengths: the peers' script reads a token-length file")
    script, peer = load_peer(Path(opts.peers_dir))
    extra = shlex.split(opts.peers_args or "")
    rows = []
    for name in names:
        row = base_row(ctx, "hf+peft", name)
        cmd = [sys.executable, str(script), name, "--lengths", str(opts.lengths), "--steps", str(opts.steps),
               "--warmup", str(opts.warmup), *extra]
        env = {**os.environ, "PACK_TOKENS": str(opts.tokens_per_batch), "PYTHONUNBUFFERED": "1"}
        row["command"] = f"PACK_TOKENS={opts.tokens_per_batch} {shlex.join(cmd)}"
        if name not in peer.CONFIGS:
            row["error"] = f"not a configuration of {script.name}; it has {sorted(peer.CONFIGS)}"
        elif PEER_FIRST_CALL_S + (opts.warmup + opts.steps) * 2.0 > ctx.time_left():
            row["error"] = f"skipped: {ctx.time_left():.0f} s left of --time-limit-s"
        else:
            print(f"[bench] peer {name}: {row['command']}", file=log, flush=True)
            row.update(_run_peer(ctx, peer, name, cmd, env, log))
        rows.append(row)
    return rows


def _run_peer(ctx: Context, peer, name: str, cmd: list[str], env: dict, log) -> dict:
    opts = ctx.opts
    timeout = None if math.isinf(ctx.time_left()) else max(ctx.time_left(), 1.0)
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s (--time-limit-s)"}
    found = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not found:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        log.write(proc.stderr[-4000:])
        return {"error": f"exit {proc.returncode}: {' | '.join(tail)[:400]}"}
    res = json.loads(found[-1][len("RESULT "):])
    update = {"real_tok_s": res["real_tok_s"], "peak_gib": res["peak_gib"], "padding_fraction": res["pad_frac"],
              "step_ms": round(res["step_s"] * 1e3, 2), "peer_result": res, "steps": opts.steps,
              "warmup": opts.warmup, "tokens_per_batch": opts.tokens_per_batch, "data": ctx.data,
              "describe": "transformers + PEFT: {}, micro-batch {}, grad ckpt {}, liger {}".format(*peer.CONFIGS[name])}
    # FLOPs of the same documents the peer trained on: replay its seeded stream, and check the replay by the
    # real-token count it implies (real_tok_s * step time * steps, both rounded by the peer)
    docs = peer_doc_lengths(peer, name, str(opts.lengths), opts.warmup, opts.steps, opts.tokens_per_batch)
    real = sum(sum(d) for d in docs)
    implied = res["real_tok_s"] * res["step_s"] * opts.steps
    update["real_tokens"] = real
    # the peer rounds step_s to the millisecond and real_tok_s to the token: on a 15 ms CPU step that alone is 3%
    rounding = (res["real_tok_s"] * 0.0005 + 0.5 * res["step_s"]) * opts.steps
    if abs(real - implied) > 0.01 * implied + rounding:
        update["mfu_note"] = f"no MFU: replayed {real} real tokens, the peer's numbers imply {implied:.0f}"
    elif not _peer_architecture_matches(peer, ctx.args, res.get("arch")):
        update["mfu_note"] = f"no MFU: the peer builds another architecture than --model {ctx.model_name}"
    else:
        update["flops"] = sum(step_flops(ctx.args, d, "lora", 16, ALL_LINEAR) for d in docs)
        update["seconds"] = real / res["real_tok_s"]
    return update


def finish_peer_row(ctx: Context, row: dict) -> dict:
    """The peer's row with the device name and, when its FLOPs are known, its MFU against the measured peak."""
    row = dict(row, gpu=ctx.gpu)
    flops, seconds = row.pop("flops", None), row.pop("seconds", None)
    if flops is not None:
        row["mfu"] = _sig(mfu(flops, seconds, ctx.peak_flops))
        row["tflops"] = _sig(flops / seconds / 1e12)
        row["peak_tflops"] = _sig(ctx.peak_flops / 1e12)
    return row


# ---------------------------------------------------------------------------------------------
# results: results.jsonl rows and the RESULTS.md table


def append_row(path: Path, row: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def read_rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def _num(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_row(row: dict) -> str:
    if row.get("error"):
        return f"{row['system']} {row['model']} {row['config']}: {row['error']}"
    return (f"{row['system']} {row['model']} {row['config']}: {_num(row['real_tok_s'], ',.0f')} real tok/s, "
            f"{_num(row['peak_gib'], '.1f')} GiB, MFU {_num(row['mfu'], '.3f')}, padding "
            f"{_num(row['padding_fraction'], '.3f')}, step {_num(row['step_ms'], '.1f')} ms")


def markdown_table(rows: list[dict]) -> str:
    if not rows:
        return "No benchmark rows yet."
    first = rows[0]
    peaks = sorted({r["peak_tflops"] for r in rows if r.get("peak_tflops")})
    lines = [f"Run `{first['run_id']}` on {first['gpu']}, {first['date'][:10]}, torch {first['torch']}; "
             f"MFU against the dense matmul peak measured in the run"
             + (f" ({', '.join(f'{p:g}' for p in peaks)} TFLOP/s)" if peaks else "")
             + ". LoRA r=16 on all 7 projections; real tok/s counts non-pad tokens.",
             "",
             "| system | model | config | real tok/s | peak GiB | MFU | padding | step ms | fwd / bwd / opt ms "
             "| notes |",
             "|---|---|---|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        split = " / ".join(_num(r.get(k), ".0f") for k in ("fwd_ms", "bwd_ms", "opt_ms"))
        note = r.get("error") or r.get("describe") or ""
        for key in ("mfu_note", "note"):  # note: added to a row by hand, after the run (what it measured wrongly)
            if r.get(key):
                note += f"; {r[key]}"
        if r.get("new_graphs_timed"):
            note += f"; {r['new_graphs_timed']} graphs compiled while timed"
        if r.get("frames_not_compiled"):
            note += f"; torch.compile gave up on {r['frames_not_compiled']} frames (eager)"
        lines.append(f"| {r['system']} | {r['model']} | {r['config']} | {_num(r['real_tok_s'], ',.0f')} | "
                     f"{_num(r['peak_gib'], '.1f')} | {_num(r['mfu'], '.3f')} | "
                     f"{_num(r['padding_fraction'], '.3f')} | {_num(r['step_ms'], '.0f')} | {split} | "
                     f"{note.replace('|', '/')} |")
    return "\n".join(lines)


def update_results_md(md_path: Path, rows: list[dict]) -> None:
    """Rewrite the table between the bench markers; everything outside them stays as it is."""
    section = f"{MD_START}\n{markdown_table(rows)}\n{MD_END}"
    text = md_path.read_text() if md_path.is_file() else "# gapless benchmark results\n"
    start, end = text.find(MD_START), text.find(MD_END)
    if start != -1 and end > start:
        text = text[:start] + section + text[end + len(MD_END):]
    else:
        text = (text.rstrip("\n") + "\n\n## Training throughput (`gapless bench`)\n\n"
                "Regenerated by `gapless bench` from the results.jsonl beside this file (the latest run); "
                "edits between the markers are overwritten.\n\n" + section + "\n")
    md_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = md_path.with_name(md_path.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, md_path)


def run_rows(path: Path, run_id: str | None = None) -> list[dict]:
    """The rows of `run_id` (default: the run of the last row) in file order."""
    rows = read_rows(path)
    if not rows:
        return []
    run_id = run_id or rows[-1]["run_id"]
    return [r for r in rows if r.get("run_id") == run_id]


# ---------------------------------------------------------------------------------------------
# the command


def command_line(opts, names: list[str]) -> str:
    """The gapless bench command that reproduces these rows (the effective settings, not the typed text)."""
    parts = ["gapless", "bench", "--model", opts.model]
    if names:
        parts += ["--config", ",".join(names)]
    parts += ["--steps", str(opts.steps), "--warmup", str(opts.warmup), "--profile-steps", str(opts.profile_steps),
              "--max-seq-len", str(opts.max_seq_len), "--tokens-per-batch", str(opts.tokens_per_batch),
              "--lora-r", str(opts.lora_r)]
    parts += ["--lengths", opts.lengths] if opts.lengths else ["--data", opts.data, "--tokenizer", opts.tokenizer]
    if opts.peers:
        parts += ["--peers", "--peers-dir", opts.peers_dir, "--peers-configs", opts.peers_configs]
        if opts.peers_args:
            parts.append(f"--peers-args={opts.peers_args}")
    if opts.dtype:
        parts += ["--dtype", opts.dtype]
    return shlex.join(parts)


def _split(names: str | None) -> list[str]:
    return [n.strip() for n in (names or "").split(",") if n.strip()]


def main(opts, log=sys.stderr) -> int:
    """Run what `opts` (the parsed `gapless bench` command line) asks for; 1 when a configuration failed."""
    out = Path(opts.out)
    md = Path(opts.results_md) if opts.results_md else out.with_name("RESULTS.md")
    if opts.show:
        rows = run_rows(out, opts.run_id)
        print(markdown_table(rows))
        return 0 if rows else 1
    names = list(LADDER) if opts.ladder or not (opts.config or opts.peers) else _split(opts.config)
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise ValueError(f"--config: {unknown} not known; choose among {list(CONFIGS)} (the ladder: {list(LADDER)})")
    peer_names = _split(opts.peers_configs) if opts.peers else []
    for key in ("steps", "warmup", "profile_steps"):
        if getattr(opts, key) < (1 if key == "steps" else 0):
            raise ValueError(f"--{key.replace('_', '-')}: must be >= {1 if key == 'steps' else 0}")
    device = resolve_device(opts.device, "--device")
    dtype_name = opts.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    if dtype_name not in DTYPES:
        raise ValueError(f"--dtype: {dtype_name!r} not known; choose bfloat16, float16 or float32")
    config_path = Path(opts.model) / "config.json"
    args = model_args_from_config(read_config(opts.model), where=str(config_path))
    if names:
        mix, data = load_documents(opts, args.vocab_size)
    else:
        mix, data = None, f"lengths {opts.lengths}"
    run_id = opts.run_id or (datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-"
                             + uuid.uuid4().hex[:6])
    ctx = Context(opts=opts, args=args, model_name=Path(opts.model).resolve().name, device=device,
                  dtype=DTYPES[dtype_name], mix=mix, data=data, peak_flops=None, gpu="", run_id=run_id,
                  command=command_line(opts, names), started=time.perf_counter())
    rows = []
    if names:
        # the peak first: the GPU is idle and cool
        ctx.peak_flops = measure_peak_flops(device, DTYPES["bfloat16"] if device.type == "cuda" else ctx.dtype)
        ctx.gpu = device_name(device)
        print(f"[bench] run {run_id} on {ctx.gpu}: dense matmul peak {ctx.peak_flops / 1e12:.4g} TFLOP/s; "
              f"data: {data}", file=log, flush=True)
        rows += run_configs(ctx, names, out, log)
    if peer_names:
        free_device_memory(device)
        # peers only: the peer gets the GPU before this process touches it (HF+PEFT packed peaks at 129 GiB),
        # and the peak is measured after it
        peer_rows = run_peers(ctx, peer_names, log)
        if ctx.peak_flops is None:
            ctx.peak_flops = measure_peak_flops(device, DTYPES["bfloat16"] if device.type == "cuda" else ctx.dtype)
            ctx.gpu = device_name(device)
        for row in peer_rows:
            row = finish_peer_row(ctx, row)
            append_row(out, row)
            print(f"[bench] {format_row(row)}", file=log, flush=True)
            rows.append(row)
    update_results_md(md, run_rows(out, run_id))
    print(markdown_table(rows))
    return 1 if any(r.get("error") for r in rows) else 0

