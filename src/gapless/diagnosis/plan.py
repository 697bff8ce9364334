"""`gapless plan CONFIG --gpus H100x8`: how long a run takes on which GPUs, and where more GPUs stop paying.

The prediction, for n GPUs of one kind (every number below is printed with the plan):

  single-GPU real tokens/s  T1 = MFU(model) x peak(GPU) / FLOPs per real token
      FLOPs per real token: gapless.meter.flops.step_flops over the run's own document lengths (attention grows
      with length, so the same model trains short chats faster than long stories).
      MFU(model): measured on one H200 by `gapless bench` (H200_RUNS below), interpolated in log(matmul weights)
      between the measured models and held at the nearest one outside them; or measured by the user (a run
      folder's metrics.jsonl, or --measured TOKS@GPU), scaled to another GPU by the ratio of peaks.
      peak(GPU): the dense bf16 matmul rate a GPU reaches. The H200 measured 776 TFLOP/s (78.5% of its 989
      datasheet figure); other GPUs get their datasheet figure x that same 78.5%, or their measured peak
      (gapless.meter.flops.measure_peak_flops) when the GPU is present.
  the global batch: data.tokens_per_batch is the micro-batch of ALL GPUs together: under torchrun its packed rows
      are dealt out, tokens_per_batch / n slots per GPU (gapless.data.sharding.rank_tokens), so an optimizer step
      trains tokens_per_batch x grad_accum slots at any n, and the steps do not change with n. (auto: each GPU's
      micro-batch is what the batch finder is predicted to pick on it, x n.)
  compute per optimizer step, per GPU  t_c = real tokens per step / n / T1
  traffic per optimizer step, per GPU, over the link's bandwidth B (nccl-tests' bus bandwidth):
      DDP     all-reduce of the trainable gradients once per step: 2(n-1)/n x trainable x grad bytes / B
      FSDP2   per micro-batch: all-gather the parameters for forward and again for backward, reduce-scatter the
              trainable gradients: (n-1)/n x (2 x params x param bytes + trainable x grad bytes) / B
      Assumed not overlapped with compute (DDP's bucketed all-reduce and FSDP2's prefetch do overlap in part),
      so the efficiency below is a lower bound; collective latency (~tens of us each) is left out.
  efficiency = t_c / (t_c + t_comm); time = start-up + steps x (t_c + t_comm); GPU-hours = n x time.

Memory per GPU: gapless.meter.memory's predicted peak at each GPU's micro-batch; DDP holds a full replica per GPU,
FSDP2 divides the weights, trainable copies, gradients and optimizer state by n (activations are per micro-batch).
Each GPU option is fits (<= 90% of its memory), tight (<= 100%) or does not fit, with the config lines that make
it fit: a smaller tokens_per_batch (more accumulation), activation checkpointing, qlora, more GPUs with FSDP2.

Where more GPUs stop paying, per rule, with its numbers: the training is shorter than the start-up at that count;
the scaling efficiency is under EFFICIENCY_FLOOR (80%); the run fits one GPU with room (then one GPU per run, and
several runs side by side, costs the fewest GPU-hours). `where_more_stop` checks 2, 4, 8 and the planned counts.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from gapless.meter.flops import lora_weights, matmul_weights, step_flops
from gapless.meter.monitor import load_samples
from gapless.model.decoder import ModelArgs


@dataclass(frozen=True)
class Gpu:
    name: str
    bf16_tflops: float  # dense (no sparsity), bf16 inputs with fp32 accumulation, as training runs
    memory_gb: float  # datasheet GB (1e9 bytes)
    memory_tbs: float  # memory bandwidth, TB/s
    link_gbs: float  # per GPU, per direction, GB/s: what an all-reduce's bus bandwidth can approach
    link: str
    unified: bool = False  # memory shared with the CPU (GB10): the OS and the data loader take part of it

    @property
    def memory_gib(self) -> float:
        return self.memory_gb * 1e9 / 2**30


GPUS = {g.name: g for g in [
    # DGX Spark datasheet (nvidia.com/dgx-spark): "1 PFLOP FP4 AI performance" (with 2:4 sparsity) -> 500 dense
    # FP4 -> 125 dense bf16 (FP4:FP8:BF16 = 4:2:1 on Blackwell tensor cores); 128 GB LPDDR5x unified, 273 GB/s;
    # ConnectX-7 200 Gb/s = 25 GB/s between two Sparks.
    Gpu("GB10", 125.0, 128, 0.273, 25, "ConnectX-7 200 Gb/s", unified=True),
    # A100 datasheet (nvidia.com/a100, SXM): bf16 312 dense, 40 GB HBM2 1,555 GB/s or 80 GB HBM2e 2,039 GB/s;
    # NVLink 3: 600 GB/s total = 300 GB/s per direction.
    Gpu("A100-40", 312.0, 40, 1.555, 300, "NVLink 3"),
    Gpu("A100-80", 312.0, 80, 2.039, 300, "NVLink 3"),
    # H100 datasheet (nvidia.com/h100, SXM5): bf16 1,979 with sparsity = 989 dense; 80 GB HBM3, 3.35 TB/s;
    # NVLink 4: 900 GB/s total = 450 per direction.
    Gpu("H100", 989.0, 80, 3.35, 450, "NVLink 4"),
    # H200 datasheet (nvidia.com/h200, SXM): bf16 989 dense; 141 GB HBM3e, 4.8 TB/s; NVLink 4 900 GB/s total.
    Gpu("H200", 989.0, 141, 4.8, 450, "NVLink 4"),
    # HGX B200 datasheet (nvidia.com/hgx): per GPU FP8 9 PFLOPS with sparsity -> 4.5 dense -> bf16 2,250 dense;
    # 180 GB HBM3e, 8 TB/s; NVLink 5: 1.8 TB/s total = 900 per direction.
    Gpu("B200", 2250.0, 180, 8.0, 900, "NVLink 5"),
    # L40S datasheet (nvidia.com/l40s): bf16 362.05 dense (733 with sparsity); 48 GB GDDR6, 864 GB/s; no NVLink,
    # PCIe Gen4 x16: 64 GB/s total = 32 per direction.
    Gpu("L40S", 362.0, 48, 0.864, 32, "PCIe 4.0 x16"),
    # Ada whitepaper (RTX 4090, appendix table): FP16/bf16 tensor with FP32 accumulate 165.2 dense; 24 GB GDDR6X,
    # 1,008 GB/s; PCIe Gen4 x16, 32 GB/s per direction, no peer-to-peer on GeForce.
    Gpu("RTX4090", 165.2, 24, 1.008, 32, "PCIe 4.0 x16"),
    # Blackwell GeForce whitepaper (RTX 5090): FP16/bf16 tensor with FP32 accumulate 209.5 dense; 32 GB GDDR7,
    # 1,792 GB/s; PCIe Gen5 x16: 64 GB/s per direction.
    Gpu("RTX5090", 209.5, 32, 1.792, 64, "PCIe 5.0 x16"),
]}
ALIASES = {"A100": "A100-80", "A100-80GB": "A100-80", "A100-40GB": "A100-40", "H100-SXM": "H100", "4090": "RTX4090",
           "5090": "RTX5090", "RTX-4090": "RTX4090", "RTX-5090": "RTX5090", "DGX-SPARK": "GB10", "SPARK": "GB10"}

# The H200 the stated figures were measured on: dense bf16 matmul 776.0 TFLOP/s (gapless.meter.flops, median
# over run 20261203T105024Z-h200's configurations: 735-781), 78.5% of the datasheet's 989.
H200_MEASURED_TFLOPS = 776.0
ACHIEVED_SHARE = H200_MEASURED_TFLOPS / GPUS["H200"].bf16_tflops

# Single-H200 LoRA r16 (all 7 projections) runs of `gapless bench --config best`, bf16, 16,384 slots per step,
# the shared mix's lengths capped at 4,096: bench/results.jsonl, run 20261203T105024Z-h200 (bench/RESULTS.md).
# (matmul weights, MFU against the peak measured in that run, real tok/s)
H200_RUNS = {
    "llama-3.2-1b": (1_235_746_816, 0.5367, 77_714),
    "llama-3.2-3b": (3_212_574_720, 0.5836, 32_947),
    "llama-3.1-8b": (7_504_658_432, 0.6541, 16_095),
}
# imports, loading, data, compile and the first step: the example 3B config from process start to the end of step 1
# with empty caches, 38.9 s on an H100 (25.5 s with warm caches; bench/RESULTS.md, ninth round, run s11-startup)
STARTUP_S = 39.0
EFFICIENCY_FLOOR = 0.8  # below this, an extra GPU buys less than 80% of a GPU's worth of speed
TIGHT = 0.9  # a predicted peak over 90% of the GPU's memory is tight: fragmentation and long batches can end the run


def parse_gpus(spec: str) -> list[tuple[Gpu, int]]:
    """"GB10,H100,H100x8" -> [(GB10, 1), (H100, 1), (H100, 8)]."""
    known = {k.upper(): g for k, g in GPUS.items()}

    def lookup(name: str) -> Gpu | None:
        name = name.upper().replace(" ", "-")
        return known.get(ALIASES.get(name, name))

    out = []
    for item in [s.strip() for s in spec.split(",") if s.strip()]:
        gpu, count = lookup(item), 1  # "RTX5090" is a name, not RT x 5090
        m = re.fullmatch(r"(.+)[xX*](\d+)", item)
        if gpu is None and m:
            gpu, count = lookup(m.group(1)), int(m.group(2))
        if gpu is None or count < 1:
            raise ValueError(f"--gpus: {item!r} is not a known GPU[xN]; known: {', '.join(GPUS)} "
                             f"(also {', '.join(ALIASES)}), e.g. H100x8")
        out.append((gpu, count))
    if not out:
        raise ValueError("--gpus: empty; give e.g. H100x8 or GB10,H100,H100x8")
    return out


def stated_mfu(weights: int) -> float:
    """MFU of gapless's fast path on the H200 for a model of `weights` matmul weights, from H200_RUNS."""
    points = sorted((math.log(w), mfu) for w, mfu, _ in H200_RUNS.values())
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    return float(np.interp(math.log(weights), xs, ys))


def flops_per_token(args: ModelArgs, lengths, flops: dict | None = None) -> float:
    """Useful training FLOPs per real token over documents of these lengths; `flops`: the method's step_flops
    arguments (gapless.model.method.Method.flops; default LoRA r16 on all 7 projections)."""
    lengths = [int(n) for n in lengths]
    return step_flops(args, lengths, **(flops or {})) / max(sum(lengths), 1)


def trainable_params(args: ModelArgs, flops: dict) -> int:
    """Parameters the method trains, from its step_flops arguments: LoRA's A and B, else every parameter."""
    if flops["method"] == "lora":
        return lora_weights(args, flops["lora_r"], flops["lora_targets"])
    return model_params(args)


def single_gpu_tokens_per_s(gpu: Gpu, flops_token: float, weights: int, *, measured: tuple[float, Gpu] | None = None,
                            peak_tflops: float | None = None) -> tuple[float, str]:
    """T1 on `gpu` and where it comes from. `measured`: (real tok/s, the GPU it was measured on) for this run's
    model and data; `peak_tflops`: the measured dense bf16 peak when `gpu` is present."""
    peak = peak_tflops if peak_tflops is not None else gpu.bf16_tflops * ACHIEVED_SHARE
    source_peak = (f"measured peak {peak:.0f} TFLOP/s" if peak_tflops is not None
                   else f"{gpu.bf16_tflops:g} TFLOP/s datasheet x {ACHIEVED_SHARE:.3f}")
    if measured is not None:
        toks, on = measured
        scale = peak / (on.bf16_tflops * ACHIEVED_SHARE)
        return toks * scale, f"measured {toks:,.0f} tok/s on {on.name} x peak ratio {scale:.3f} ({source_peak})"
    mfu = stated_mfu(weights)
    return (mfu * peak * 1e12 / flops_token,
            f"MFU {mfu:.3f} (H200 runs of gapless bench) x {source_peak} / {flops_token / 1e9:.2f} GFLOP per token")


@dataclass
class MemorySpec:
    """The memory model's inputs for the run: gapless.meter.memory.estimate_memory(args, method, **kwargs)."""
    args: ModelArgs
    method: str
    kwargs: dict  # gapless.meter.memory.estimate_kwargs(cfg): dtype, LoRA, checkpointing, compile, loss chunk

    def estimate(self, tokens: int, shards: int = 1, **changes):
        """The peak per GPU with `tokens` slots in its micro-batch, sharded over `shards` GPUs (FSDP2; 1: one GPU or
        DDP); `changes`: other estimate arguments (method, activation_checkpointing) for a what-if."""
        from gapless.meter.memory import estimate_memory

        kwargs = {**self.kwargs, **changes}
        method = kwargs.pop("method", self.method)
        return estimate_memory(self.args, method, tokens=max(int(tokens), 1), shards=shards, **kwargs)

    def max_tokens(self, budget_gib: float, shards: int = 1) -> int:
        from gapless.meter.memory import max_tokens

        return max_tokens(self.args, self.method, budget_gib, shards=shards, **self.kwargs)

    def auto_tokens(self, gpu_gib: float, max_seq_len: int, shards: int = 1, rows_per_batch: int | None = None) -> int:
        from gapless.meter.memory import auto_tokens

        return auto_tokens(self.args, self.method, gpu_gib, max_seq_len, rows_per_batch, shards=shards,
                           **self.kwargs)


@dataclass
class Workload:
    """What the run trains, in the numbers the plan needs."""
    tokens: float  # real tokens over the whole run (every epoch)
    # data.tokens_per_batch: the GLOBAL micro-batch in slots, its packed rows dealt out over the GPUs
    # (gapless.data.sharding.rank_tokens), so an optimizer step trains the same tokens at any GPU count; or "auto"
    tokens_per_batch: int | str
    micro_batches: int  # per optimizer step (train.grad_accum)
    efficiency: float  # real tokens / slots on the run's own data (packing)
    max_seq_len: int
    flops_token: float
    weights: int  # matmul weights (MFU lookup)
    params: int  # every parameter of the model
    trainable: int
    param_bytes: int = 2  # bf16
    grad_bytes: int = 2  # gradients in the trainable parameters' dtype
    method: str = "lora"
    batching: str = "packed"
    memory: MemorySpec | None = None  # None: memory not predicted (weights only)
    rows_per_batch: int | None = None  # data.rows_per_batch: documents per micro-batch at most (padded strategies)
    doc_tokens: float = 0.0  # real tokens of the mean document (what a batch capped at rows_per_batch holds of each)

    @property
    def weights_gib(self) -> float:
        return self.params * self.param_bytes / 2**30

    def step_tokens(self, tokens_per_batch: int) -> float:
        """Real tokens per optimizer step over all GPUs together: the global micro-batch's slots (whole rows when
        packed or pad_to_max, at most rows_per_batch of them) x accumulation x packing efficiency; padded batches
        capped at rows_per_batch documents hold at most that many of the mean length (2 documents of 100 tokens in
        2 x 2,048 slots are 200 real tokens, not 4,096 x efficiency)."""
        from gapless.data.batching import batch_slots

        real = batch_slots(self.batching, tokens_per_batch, self.max_seq_len, self.rows_per_batch) * self.efficiency
        if self.batching in ("padded", "length_grouped") and self.rows_per_batch:
            real = min(real, self.rows_per_batch * self.doc_tokens)
        return real * self.micro_batches


@dataclass
class Prediction:
    gpu: str
    n: int
    strategy: str
    tokens_per_batch: int  # the global micro-batch in slots (auto: resolved for this GPU, x n)
    rank_tokens: int  # slots of each GPU's micro-batch
    tokens_per_s_1: float  # one GPU
    source: str
    compute_s: float  # per optimizer step
    comm_s: float  # per optimizer step, not overlapped
    efficiency: float
    steps: int
    train_s: float  # steps x step time
    startup_s: float
    total_s: float
    gpu_hours: float
    weights_gib_per_gpu: float
    memory_gib: float  # the GPU's
    peak_gib: float | None = None  # predicted peak per GPU under `strategy`; None: not predicted
    peak_ddp_gib: float | None = None  # n > 1: a full replica per GPU
    peak_fsdp2_gib: float | None = None  # n > 1: weights, gradients and optimizer state / n; activations not
    fit: str = "not predicted"  # fits (<= 90%) | tight (> 90%) | does not fit (> 100%) | not predicted
    fixes: list[str] = field(default_factory=list)  # config lines that make it fit
    problems: list[str] = field(default_factory=list)  # why the run cannot start as configured at this count
    stops: list[str] = field(default_factory=list)  # the rules under which more GPUs stop paying that hold here
    verdict: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.n * self.tokens_per_s_1 * self.efficiency


def comm_seconds(w: Workload, n: int, strategy: str, link_gbs: float) -> float:
    """Seconds of collective traffic per optimizer step per GPU (formulas in the module docstring)."""
    if n == 1:
        return 0.0
    bw = link_gbs * 1e9
    if strategy == "ddp":
        return 2 * (n - 1) / n * w.trainable * w.grad_bytes / bw
    assert strategy == "fsdp2", strategy
    per_micro = (n - 1) / n * (2 * w.params * w.param_bytes + w.trainable * w.grad_bytes) / bw
    return w.micro_batches * per_micro


def resolve_strategy(strategy: str, method: str, n: int) -> str:
    """single | ddp | fsdp2, as gapless.train.parallel.init_distributed resolves parallel.strategy: auto shards a
    method that trains every weight (full) and replicates LoRA and QLoRA."""
    from gapless.train.parallel import FULL_METHODS

    if n == 1:
        return "single"
    if strategy == "auto":
        return "fsdp2" if method in FULL_METHODS else "ddp"
    return {"fsdp": "fsdp2"}.get(strategy, strategy)


def fit_of(peak_gib: float, memory_gib: float) -> str:
    return "fits" if peak_gib <= TIGHT * memory_gib else "tight" if peak_gib <= memory_gib else "does not fit"


def memory_fixes(spec: MemorySpec, seq: int, accum: int, gpu: str, memory_gib: float, n: int, strategy: str,
                 tokens_per_batch: int) -> list[str]:
    """Config lines under which the run fits `TIGHT` of each GPU's memory (`memory_gib`), cheapest first: a smaller
    micro-batch (the same tokens per step through more accumulation), activation checkpointing, QLoRA, more GPUs
    with FSDP2. tokens_per_batch: the global micro-batch over `n` GPUs of kind `gpu`; seq: data.max_seq_len."""
    from gapless.diagnosis.doctor import RECOMPUTE_COST

    budget = TIGHT * memory_gib
    shards = n if strategy == "fsdp2" else 1
    rank = max(seq, tokens_per_batch // n)
    out = []
    fit = spec.max_tokens(budget, shards) // seq * seq
    if seq <= fit < rank:
        out.append(f"data.tokens_per_batch: {fit * n:,}  train.grad_accum: "
                   f"{math.ceil(tokens_per_batch * accum / (fit * n))} ({fit:,} slots per GPU, about the "
                   "same tokens per step)")
    if not spec.kwargs.get("activation_checkpointing") and \
            spec.estimate(rank, shards, activation_checkpointing=1).total_gib <= budget:
        out.append(f"model.activation_checkpointing: 1 (costs {RECOMPUTE_COST[spec.method]:.0%} of throughput: each "
                   "layer's forward runs again in backward)")
    if spec.method == "lora" and spec.estimate(rank, 1, method="qlora").total_gib <= budget:
        out.append(f"method: qlora ({spec.estimate(rank, 1, method='qlora').total_gib:.1f} GiB: NF4 base weights)")
    # more GPUs: each holds 1/m of the global micro-batch's rows (DDP, the cheaper traffic for adapters), and under
    # FSDP2 1/m of the state too; QLoRA's weights are quantised as they load: FSDP2 cannot shard them
    for m in (2, 4, 8, 16):
        if m < n:
            continue
        rank_m = max(seq, tokens_per_batch // m // seq * seq)
        options = [] if m == n else [(1, "DDP")]
        if spec.method != "qlora" and not (m == n and strategy == "fsdp2"):
            options.append((m, "FSDP2, parallel.strategy: fsdp"))
        found = next(((peak, how) for shards, how in options
                      if (peak := spec.estimate(rank_m, shards).total_gib) <= budget), None)
        if found:
            out.append(f"{gpu}x{m} ({found[1]}; {found[0]:.1f} GiB per GPU at {rank_m:,} slots each)")
            break
    return out or [f"none of a smaller micro-batch, activation checkpointing, qlora or up to 16 GPUs fits "
                   f"{TIGHT:.0%} of {memory_gib:.0f} GiB: a GPU with more memory"]


def predict(w: Workload, gpu: Gpu, n: int, *, strategy: str = "auto", startup_s: float = STARTUP_S,
            measured: tuple[float, Gpu] | None = None, peak_tflops: float | None = None) -> Prediction:
    from gapless.data.sharding import rank_tokens

    strategy = resolve_strategy(strategy, w.method, n)
    shards = n if strategy == "fsdp2" else 1
    seq, problems = w.max_seq_len, []
    if w.tokens_per_batch == "auto":
        rank = w.memory.auto_tokens(gpu.memory_gib, seq, shards, w.rows_per_batch) if w.memory else 0
        rank = rank or seq  # not even one row fits: the fit below says so; one row per GPU for the time figures
        if n > 1:
            problems.append(f"data.tokens_per_batch auto does not run under torchrun yet: data.tokens_per_batch: "
                            f"{rank * n:,} (the global batch: {rank:,} slots per GPU, as auto would pick)")
        tokens_per_batch = rank * n
    else:
        tokens_per_batch = w.tokens_per_batch
        try:
            rank = rank_tokens(w.batching, tokens_per_batch, seq, n)
        except ValueError as e:
            problems.append(str(e))
            rank = max(seq, tokens_per_batch // n // seq * seq)
    if strategy == "fsdp2" and w.method == "qlora":
        problems.append("method qlora: FSDP2 cannot shard weights quantised while they load; parallel.strategy: ddp")
    t1, source = single_gpu_tokens_per_s(gpu, w.flops_token, w.weights, measured=measured, peak_tflops=peak_tflops)
    step_real = w.step_tokens(tokens_per_batch)
    compute = step_real / n / t1
    comm = comm_seconds(w, n, strategy, gpu.link_gbs)
    steps = max(1, math.ceil(w.tokens / step_real))
    train_s = steps * (compute + comm)
    total = startup_s + train_s
    p = Prediction(gpu.name, n, strategy, tokens_per_batch, rank, t1, source, compute, comm,
                   compute / (compute + comm), steps, train_s, startup_s, total, n * total / 3600,
                   w.weights_gib / shards, gpu.memory_gib, problems=problems)
    if w.memory is not None:
        p.peak_gib = w.memory.estimate(rank, shards).total_gib
        if n > 1:
            p.peak_ddp_gib, p.peak_fsdp2_gib = (w.memory.estimate(rank, s).total_gib for s in (1, n))
        p.fit = fit_of(p.peak_gib, gpu.memory_gib)
        if p.fit != "fits":
            p.fixes = memory_fixes(w.memory, seq, w.micro_batches, gpu.name, gpu.memory_gib, n, strategy,
                                   tokens_per_batch)
    return p


def stop_rules(p: Prediction, single: Prediction, floor: float = EFFICIENCY_FLOOR) -> list[str]:
    """The rules under which `p`'s extra GPUs stop paying, each with its numbers (`single`: one GPU of the kind)."""
    if p.n == 1:
        return []
    out = []
    if p.train_s < p.startup_s:
        out.append(f"start-up: training takes {_duration(p.train_s)}, less than the {_duration(p.startup_s)} "
                   "start-up; more GPUs shorten only the part that is already short")
    if p.efficiency < floor:
        out.append(f"efficiency {p.efficiency:.0%} is under {floor:.0%}: the link ({GPUS[p.gpu].link}) carries "
                   f"{p.comm_s * 1e3:,.0f} ms per step against {p.compute_s * 1e3:,.0f} ms of compute")
    if single.fit == "fits":
        out.append(f"one GPU: the run fits one {p.gpu} with room ({single.peak_gib:.1f} of {single.memory_gib:.0f} "
                   f"GiB): {p.n} GPUs make one run {single.total_s / p.total_s:.1f}x faster for "
                   f"{p.gpu_hours / single.gpu_hours:.2f}x the GPU-hours; for several runs, one GPU each")
    return out


def verdicts(preds: list[Prediction], w: Workload, floor: float = EFFICIENCY_FLOOR,
             singles: dict[str, Prediction] | None = None) -> list[Prediction]:
    """Fill each prediction's stop rules and plain statement; `singles`: the one-GPU prediction of each kind (made
    with the stated figures when missing), against which the rules and the savings are stated."""
    singles = {**{p.gpu: p for p in preds if p.n == 1}, **(singles or {})}
    for p in preds:
        if p.gpu not in singles:
            singles[p.gpu] = predict(w, GPUS[p.gpu], 1, startup_s=p.startup_s)
    for p in preds:
        notes = [f"cannot run as configured: {x}" for x in p.problems]
        if p.fit != "not predicted":
            notes.append(f"{p.fit}: {p.peak_gib:.1f} of {p.memory_gib:.0f} GiB per GPU predicted")
        elif p.weights_gib_per_gpu > TIGHT * p.memory_gib:
            notes.append(f"does not fit: the weights alone take {p.weights_gib_per_gpu:.1f} of {p.memory_gib:.0f} "
                         "GiB per GPU")
        p.stops = stop_rules(p, singles[p.gpu], floor)
        notes += [f"stop: {s}" for s in p.stops]
        base = min((q for q in preds if q.gpu == p.gpu), key=lambda q: q.n)
        if p.n > 1 and base is not p and base.n < p.n:
            notes.append(f"{p.n / base.n:g}x the GPUs of {base.gpu}x{base.n} saves "
                         f"{_duration(max(base.total_s - p.total_s, 0))} for {p.gpu_hours - base.gpu_hours:+.2f} "
                         "GPU-hours")
        if GPUS[p.gpu].unified:
            notes.append("its memory is shared with the CPU: the OS and the data loader use part of it")
        if p.n > 1 and not p.stops and not p.problems:
            notes.append("pays: near-linear scaling")
        p.verdict = "; ".join(notes)
    return preds


SCAN = (2, 4, 8)  # GPU counts of one node, where the table's link figure holds


def where_more_stop(w: Workload, gpu: Gpu, counts: list[int] = (), floor: float = EFFICIENCY_FLOOR,
                    **predict_kwargs) -> list[str]:
    """For one GPU kind, at 2, 4, 8 and the planned counts: from which count each rule says more GPUs stop
    paying (start-up, efficiency under `floor`, the run fits one GPU with room), with numbers, and the sum of it."""
    ns = sorted(set(SCAN) | {n for n in counts if n > 1})
    single = predict(w, gpu, 1, **predict_kwargs)
    at = {1: single, **{n: predict(w, gpu, n, **predict_kwargs) for n in ns}}
    last = at[ns[-1]]
    lines = [f"where more {gpu.name}s stop paying (checked at {', '.join(f'x{n}' for n in ns)}):"]
    # the fewest GPUs the run fits on: the rules speak of counts from there up
    need = next((n for n in at if at[n].fit != "does not fit"), None)
    beyond = [n for n in ns if need is not None and n > need]
    startup = next((n for n in beyond if at[n].train_s < at[n].startup_s), None)
    if need is not None and at[need].train_s < at[need].startup_s:
        lines.append(f"  start-up:   x{need} already trains in {_duration(at[need].train_s)}, less than the "
                     f"{_duration(at[need].startup_s)} start-up: no extra GPU pays")
        startup = beyond[0] if beyond else None
    elif startup:
        lines.append(f"  start-up:   from x{startup} training takes {_duration(at[startup].train_s)}, less than the "
                     f"{_duration(at[startup].startup_s)} start-up")
    else:
        lines.append(f"  start-up:   training outlasts the {_duration(last.startup_s)} start-up up to x{last.n} "
                     f"({_duration(last.train_s)})")
    low = next((n for n in ns if at[n].efficiency < floor), None)
    if low:
        p = at[low]
        lines.append(f"  efficiency: under {floor:.0%} from x{low} ({p.efficiency:.0%}: {p.comm_s * 1e3:,.0f} ms of "
                     f"{p.strategy} traffic over {gpu.link} against {p.compute_s * 1e3:,.0f} ms of compute per step)")
    else:
        lines.append(f"  efficiency: {last.efficiency:.0%} at x{last.n} ({last.strategy}), not under {floor:.0%}")
    if single.fit == "fits":
        lines.append(f"  one GPU:    the run fits one {gpu.name} with room ({single.peak_gib:.1f} of "
                     f"{single.memory_gib:.0f} GiB): x{last.n} makes one run {single.total_s / last.total_s:.1f}x "
                     f"faster for {last.gpu_hours / single.gpu_hours:.2f}x the GPU-hours; several runs: one GPU each")
    elif single.fit != "not predicted":
        lines.append(f"  one GPU:    {single.fit} on one {gpu.name} ({single.peak_gib:.1f} of "
                     f"{single.memory_gib:.0f} GiB)" + (f": x{need} is the fewest that fits" if need else ""))
    several = " (one GPU per run when there are several runs)" if single.fit == "fits" else ""
    stop = min([n for n in (startup, low) if n and n in beyond], default=None)
    if need is None:
        lines.append(f"  => the run does not fit {gpu.name}s up to x{last.n}: see the fixes above")
    elif need > 1 and at[need].efficiency < floor:
        lines.append(f"  => x{need} is the fewest {gpu.name}s that fit and scales at {at[need].efficiency:.0%} there: "
                     "a GPU with more memory, or the fixes above, pays better than more of these")
    elif stop:
        below = [n for n in at if need <= n < stop]
        lines.append(f"  => more {gpu.name}s stop paying at x{stop}; use "
                     + (f"x{below[0]}" if len(below) == 1 else f"x{below[0]} to x{below[-1]}") + several)
    else:
        lines.append(f"  => more {gpu.name}s pay up to x{last.n} for one run's time"
                     + ("; with several runs, one GPU each costs fewer GPU-hours" if single.fit == "fits" else ""))
    return lines


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def global_batch_line(w: Workload) -> str:
    k = w.micro_batches
    if w.tokens_per_batch == "auto":
        return (f"global batch: data.tokens_per_batch auto = per GPU what the batch finder picks by the memory model "
                f"(column slots/GPU) x {k} accumulation x GPUs")
    tpb = w.tokens_per_batch
    return (f"global batch: data.tokens_per_batch {tpb:,} slots is the micro-batch of all GPUs together (its rows "
            f"dealt out: {tpb:,} / N slots per GPU) x {k} accumulation = {tpb * k:,} slots, "
            f"~{w.step_tokens(tpb):,.0f} real tokens per optimizer step at every GPU count")


def format_plan(preds: list[Prediction], w: Workload, stops: list[str] = ()) -> str:
    lines = [f"run: {w.tokens:,.0f} real tokens, {w.flops_token / 1e9:.2f} GFLOP per token; {w.params / 1e9:.2f} B "
             f"parameters ({w.weights_gib:.1f} GiB), {w.trainable / 1e6:.1f} M trainable ({w.method})",
             global_batch_line(w),
             f"{'GPUs':<11} {'strategy':<8} {'slots/GPU':>9} {'tok/s':>10} {'effic.':>7} {'steps':>7} {'time':>7} "
             f"{'GPU-h':>7} {'GiB/GPU':>13}  fit"]
    for p in preds:
        mem = f"{p.peak_gib:.1f}" if p.peak_gib is not None else f"w {p.weights_gib_per_gpu:.1f}"
        lines.append(f"{p.gpu + 'x' + str(p.n):<11} {p.strategy:<8} {p.rank_tokens:>9,} {p.tokens_per_s:>10,.0f} "
                     f"{p.efficiency:>7.1%} {p.steps:>7,} {_duration(p.total_s):>7} {p.gpu_hours:>7.2f} "
                     f"{mem:>5} of {p.memory_gib:<5.0f}  {p.fit}")
    lines.append("")
    for p in preds:
        lines.append(f"{p.gpu}x{p.n}: {p.verdict}")
        if p.peak_ddp_gib is not None:
            lines.append(f"  memory per GPU: DDP {p.peak_ddp_gib:.1f} GiB (a full replica), FSDP2 "
                         f"{p.peak_fsdp2_gib:.1f} GiB (weights, gradients, optimizer state / {p.n})")
        lines += [f"  fix: {f}" for f in p.fixes]
        lines.append(f"  one GPU: {p.tokens_per_s_1:,.0f} tok/s = {p.source}")
    if stops:
        lines += ["", *stops]
    lines.append("")
    lines.append("memory: gapless.meter.memory (compiled LoRA fitted within 1.2% of four H200 peaks; QLoRA, full and "
                 "checkpointing terms derived); fits <= 90% of the GPU, tight <= 100%" if preds[0].fit !=
                 "not predicted" else "memory: weights only (no model config given)")
    lines.append(f"time includes {_duration(preds[0].startup_s)} of start-up; traffic is counted as not overlapped "
                 "with compute, so efficiency is a lower bound; a smaller micro-batch per GPU at more GPUs can lower "
                 "MFU (not modelled)")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# from a config: the run's own data and model


def model_params(args: ModelArgs) -> int:
    """Every parameter: the matmul weights, the embedding unless tied to the head, and the norms."""
    embed = 0 if args.tie_word_embeddings else args.vocab_size * args.hidden_size
    norms = (2 * args.num_hidden_layers + 1) * args.hidden_size
    return matmul_weights(args) + embed + norms


def measured_from_run(run_dir: str | Path) -> tuple[float, str | None]:
    """(median real tokens/s of a run's logged training windows, its GPU name from environment.json or None)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{path} not found; give a run folder that has trained")
    # a run killed mid-write leaves a torn last line: left out, as the report does
    rates = [r["tokens_per_s"] for r in load_samples(path) if "loss" in r and r.get("tokens_per_s")]
    if len(rates) < 2:
        raise ValueError(f"{path} has {len(rates)} logged training window{'s' * (len(rates) != 1)}; need at least "
                         "2 (the first holds the compile)")
    env = Path(run_dir) / "environment.json"
    gpus = json.loads(env.read_text())["gpu"]["gpus"] if env.is_file() else []
    return float(np.median(rates[1:])), gpus[0]["name"] if gpus else None


def gpu_from_name(name: str) -> Gpu:
    """The table entry of a CUDA device name such as 'NVIDIA H200' or 'NVIDIA A100-SXM4-40GB'."""
    upper = name.upper()
    for key in ("GB10", "B200", "H200", "H100", "L40S", "4090", "5090"):
        if key in upper:
            return GPUS[ALIASES.get(key, key)]
    if "A100" in upper:
        return GPUS["A100-40" if "40GB" in upper else "A100-80"]
    raise ValueError(f"GPU {name!r} is not in the plan's table ({', '.join(GPUS)}); give --measured TOKS@GPU")


def workload_from_config(cfg, *, out=None) -> tuple[Workload, dict]:
    """Read the config's data (tokenized through the cache) and model config.json into a Workload."""
    from gapless.data.batching import BatchSampler
    from gapless.diagnosis.doctor import build_run_data
    from gapless.meter.memory import estimate_kwargs
    from gapless.model.loading import read_model_args
    from gapless.model.method import method_of

    args = read_model_args(cfg.model.path)
    d = cfg.data
    # the packing efficiency hardly depends on the batch's size; auto: measured at 16 rows
    sampling = d if d.tokens_per_batch != "auto" else replace(d, tokens_per_batch=16 * d.max_seq_len)
    mix, _, summary = build_run_data(replace(cfg, data=sampling))
    sampler = BatchSampler.from_config(sampling, mix)
    lengths = mix.lengths[mix.epoch_docs(d.seed, 0)]
    efficiency = sampler.efficiency(0)
    flops = method_of(cfg).flops
    w = Workload(tokens=0.0, tokens_per_batch=d.tokens_per_batch, micro_batches=cfg.train.grad_accum,
                 efficiency=efficiency, max_seq_len=d.max_seq_len, batching=d.batching,
                 rows_per_batch=d.rows_per_batch, doc_tokens=float(lengths.mean()) if len(lengths) else 0.0,
                 flops_token=flops_per_token(args, lengths, flops), weights=matmul_weights(args),
                 params=model_params(args), trainable=trainable_params(args, flops),
                 param_bytes=4 if cfg.model.dtype == "float32" else 2,
                 # LoRA adapters are float32 whatever the base's dtype (gapless.model.method.Lora), and so their
                 # gradients
                 grad_bytes=4 if flops["method"] == "lora" or cfg.model.dtype == "float32" else 2,
                 method=cfg.method, memory=MemorySpec(args, cfg.method, estimate_kwargs(cfg)))
    if cfg.train.steps and d.tokens_per_batch == "auto":
        raise ValueError("train.steps with data.tokens_per_batch auto: the run's tokens depend on the GPU; give "
                         "train.epochs or a number of tokens per batch to plan")
    w.tokens = cfg.train.steps * w.step_tokens(d.tokens_per_batch) if cfg.train.steps else \
        cfg.train.epochs * float(lengths.sum())
    return w, {"documents": int(len(lengths)), "packing_efficiency": efficiency, "summary": summary.format()}


def plan(cfg, gpus: str, *, strategy: str | None = None, run: str | None = None, measured: str | None = None,
         startup_s: float | None = None, floor: float = EFFICIENCY_FLOOR) -> tuple[list[Prediction], Workload,
                                                                                    list[str]]:
    """Predictions for each GPU choice in `gpus`, with verdicts, and for each GPU kind where more GPUs stop paying.
    strategy: None = the config's parallel.strategy (auto: FSDP2 for full fine-tuning, DDP for LoRA/QLoRA)."""
    import torch

    w, _ = workload_from_config(cfg)
    strategy = strategy or cfg.parallel.strategy
    measured_pair = None
    if run is not None:
        try:
            toks, name = measured_from_run(run)
        except ValueError as e:
            raise ValueError(f"--run: {e}") from None
        measured_pair = (toks, gpu_from_name(name) if name else GPUS["H200"])
    elif measured is not None:
        m = re.fullmatch(r"([\d_,.]+)@(.+)", measured.strip())
        if not m:
            raise ValueError(f"--measured: {measured!r}; expected TOKS@GPU, e.g. 34100@H200")
        measured_pair = (float(m.group(1).replace(",", "").replace("_", "")), parse_gpus(m.group(2))[0][0])
    present = None
    if torch.cuda.is_available():  # the measured peak of the GPU that is here replaces its datasheet figure
        from gapless.meter.flops import measure_peak_flops

        try:
            here = gpu_from_name(torch.cuda.get_device_name(0))
            present = (here.name, measure_peak_flops(torch.device("cuda"), torch.bfloat16) / 1e12)
        except ValueError:
            pass
    if startup_s is None:
        startup_s = STARTUP_S
    choices = parse_gpus(gpus)

    def kwargs(g: Gpu) -> dict:
        return dict(strategy=strategy, startup_s=startup_s, measured=measured_pair,
                    peak_tflops=present[1] if present and present[0] == g.name else None)

    preds = [predict(w, g, n, **kwargs(g)) for g, n in choices]
    kinds = list(dict.fromkeys(g.name for g, _ in choices))
    singles = {k: predict(w, GPUS[k], 1, **kwargs(GPUS[k])) for k in kinds}
    stops = [line for k in kinds
             for line in where_more_stop(w, GPUS[k], [n for g, n in choices if g.name == k], floor, **kwargs(GPUS[k]))]
    return verdicts(preds, w, floor, singles), w, stops


def plan_json(preds: list[Prediction], w: Workload, stops: list[str] = ()) -> dict:
    workload = {k: v for k, v in asdict(w).items() if k != "memory"}
    return {"workload": workload, "predictions": [{**asdict(p), "tokens_per_s": p.tokens_per_s} for p in preds],
            "where_more_gpus_stop_paying": list(stops)}
