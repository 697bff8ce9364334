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
  compute per optimizer step, per GPU  t_c = real tokens per GPU per step / T1
  traffic per optimizer step, per GPU, over the link's bandwidth B (nccl-tests' bus bandwidth):
      DDP     all-reduce of the trainable gradients once per step: 2(n-1)/n x trainable x grad bytes / B
      FSDP2   per micro-batch: all-gather the parameters for forward and again for backward, reduce-scatter the
              trainable gradients: (n-1)/n x (2 x params x param bytes + trainable x grad bytes) / B
      Assumed not overlapped with compute (DDP's bucketed all-reduce and FSDP2's prefetch do overlap in part),
      so the efficiency below is a lower bound; collective latency (~tens of us each) is left out.
  efficiency = t_c / (t_c + t_comm); time = start-up + steps x (t_c + t_comm); GPU-hours = n x time.

Memory per GPU: the weights are exact (parameters x bytes, divided by n under FSDP2); activations, the loss and
optimizer state need the memory model of issue 14 (methods:), which is not in yet: the plan says so.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from gapless.meter.flops import lora_weights, matmul_weights, step_flops
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
STARTUP_S = 86.0  # loading, compile, first step: 85.8 s in the 1B real run on the H200 (bench/RESULTS.md, pipeline)
EFFICIENCY_FLOOR = 0.8  # below this, an extra GPU buys less than 80% of a GPU's worth of speed


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
class Workload:
    """What the run trains, in the numbers the plan needs."""
    tokens: float  # real tokens over the whole run (every epoch)
    tokens_per_gpu_step: float  # real tokens per GPU per optimizer step (slots x accumulation x packing efficiency)
    micro_batches: int  # per optimizer step (grad_accum)
    flops_token: float
    weights: int  # matmul weights (MFU lookup)
    params: int  # every parameter of the model
    trainable: int
    param_bytes: int = 2  # bf16
    grad_bytes: int = 2  # gradients in the trainable parameters' dtype

    @property
    def weights_gib(self) -> float:
        return self.params * self.param_bytes / 2**30


@dataclass
class Prediction:
    gpu: str
    n: int
    strategy: str
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
    memory_gib: float
    memory_note: str
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


def predict(w: Workload, gpu: Gpu, n: int, *, strategy: str = "auto", startup_s: float = STARTUP_S,
            measured: tuple[float, Gpu] | None = None, peak_tflops: float | None = None) -> Prediction:
    if n == 1:
        strategy = "single"
    elif strategy == "auto":  # shard only when the weights alone would take most of one GPU
        strategy = "fsdp2" if w.weights_gib > 0.5 * gpu.memory_gib else "ddp"
    t1, source = single_gpu_tokens_per_s(gpu, w.flops_token, w.weights, measured=measured, peak_tflops=peak_tflops)
    compute = w.tokens_per_gpu_step / t1
    comm = comm_seconds(w, n, strategy, gpu.link_gbs)
    steps = max(1, math.ceil(w.tokens / (w.tokens_per_gpu_step * n)))
    train_s = steps * (compute + comm)
    total = startup_s + train_s
    weights = w.weights_gib / (n if strategy == "fsdp2" else 1)
    return Prediction(gpu.name, n, strategy, t1, source, compute, comm, compute / (compute + comm), steps, train_s,
                      startup_s, total, n * total / 3600, weights, gpu.memory_gib,
                      "activations, loss and optimizer state not predicted: needs methods: (the memory model)")


def verdicts(preds: list[Prediction], floor: float = EFFICIENCY_FLOOR) -> list[Prediction]:
    """Fill each prediction's plain statement; for each GPU kind, compare with the fewest GPUs of it planned."""
    for p in preds:
        notes = []
        if p.weights_gib_per_gpu > 0.9 * p.memory_gib:
            notes.append(f"does not fit: the weights alone take {p.weights_gib_per_gpu:.1f} of "
                         f"{p.memory_gib:.0f} GiB per GPU")
        base = min((q for q in preds if q.gpu == p.gpu), key=lambda q: q.n)
        if p.n > 1:
            if p.efficiency < floor:
                notes.append(f"stop: efficiency {p.efficiency:.0%} is under {floor:.0%}; the link "
                             f"({GPUS[p.gpu].link}) carries {p.comm_s * 1e3:.0f} ms per step against "
                             f"{p.compute_s * 1e3:.0f} ms of compute")
            if p.train_s < p.startup_s:
                notes.append(f"stop: training takes {_duration(p.train_s)}, less than the start-up "
                             f"({_duration(p.startup_s)}); more GPUs shorten only the part that is already short")
            if base is not p and base.n < p.n:
                saved = base.total_s - p.total_s
                notes.append(f"{p.n / base.n:g}x the GPUs of {base.gpu}x{base.n} saves {_duration(max(saved, 0))} "
                             f"for {p.gpu_hours - base.gpu_hours:+.2f} GPU-hours")
            if p.strategy == "ddp" and p.weights_gib_per_gpu < 0.5 * p.memory_gib:
                notes.append(f"the model fits one GPU with room (weights {p.weights_gib_per_gpu:.1f} of "
                             f"{p.memory_gib:.0f} GiB): more GPUs buy time only")
        if GPUS[p.gpu].unified:
            notes.append("its memory is shared with the CPU: the OS and the data loader use part of it")
        p.verdict = "; ".join(notes) or ("pays: near-linear scaling" if p.n > 1 else "fits (weights); the baseline")
    return preds


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def format_plan(preds: list[Prediction], w: Workload) -> str:
    lines = [f"run: {w.tokens:,.0f} real tokens, {w.tokens_per_gpu_step:,.0f} real tokens per GPU per step, "
             f"{w.flops_token / 1e9:.2f} GFLOP per token; {w.params / 1e9:.2f} B parameters "
             f"({w.weights_gib:.1f} GiB in bf16), {w.trainable / 1e6:.1f} M trainable",
             f"{'GPUs':<12} {'strategy':<8} {'tok/s':>10} {'effic.':>7} {'steps':>8} {'time':>8} "
             f"{'GPU-h':>7} {'weights GiB/GPU':>16}"]
    for p in preds:
        lines.append(f"{p.gpu + 'x' + str(p.n):<12} {p.strategy:<8} {p.tokens_per_s:>10,.0f} {p.efficiency:>7.1%} "
                     f"{p.steps:>8,} {_duration(p.total_s):>8} {p.gpu_hours:>7.2f} "
                     f"{p.weights_gib_per_gpu:>7.1f} of {p.memory_gib:<5.0f}")
    lines.append("")
    for p in preds:
        lines.append(f"{p.gpu}x{p.n}: {p.verdict}")
        lines.append(f"  one GPU: {p.tokens_per_s_1:,.0f} tok/s = {p.source}")
    lines.append(f"memory: weights only; {preds[0].memory_note}")
    lines.append(f"time includes {_duration(preds[0].startup_s)} of start-up; traffic is counted as not overlapped "
                 "with compute, so efficiency is a lower bound")
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
        raise ValueError(f"--run: {path} not found; give a run folder that has trained")
    rates = [r["tokens_per_s"] for r in map(json.loads, path.read_text().splitlines())
             if "loss" in r and r.get("tokens_per_s")]
    if len(rates) < 2:
        raise ValueError(f"--run: {path} has {len(rates)} logged training windows; need at least 2 (the first "
                         "holds the compile)")
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
    from gapless.model.loading import read_model_args
    from gapless.model.method import method_of

    args = read_model_args(cfg.model.path)
    mix, _, summary = build_run_data(cfg)
    sampler = BatchSampler.from_config(cfg.data, mix)
    lengths = mix.lengths[mix.epoch_docs(cfg.data.seed, 0)]
    efficiency = sampler.efficiency(0)
    per_step = cfg.data.tokens_per_batch * cfg.train.grad_accum * efficiency
    tokens = (cfg.train.steps * per_step) if cfg.train.steps else cfg.train.epochs * float(lengths.sum())
    flops = method_of(cfg).flops
    w = Workload(tokens=tokens, tokens_per_gpu_step=per_step, micro_batches=cfg.train.grad_accum,
                 flops_token=flops_per_token(args, lengths, flops), weights=matmul_weights(args),
                 params=model_params(args), trainable=trainable_params(args, flops),
                 param_bytes=4 if cfg.model.dtype == "float32" else 2,
                 # LoRA adapters are float32 whatever the base's dtype (gapless.model.method.Lora), and so their
                 # gradients
                 grad_bytes=4 if flops["method"] == "lora" or cfg.model.dtype == "float32" else 2)
    return w, {"documents": int(len(lengths)), "packing_efficiency": efficiency, "summary": summary.format()}


def plan(cfg, gpus: str, *, strategy: str = "auto", run: str | None = None, measured: str | None = None,
         startup_s: float | None = None, floor: float = EFFICIENCY_FLOOR) -> tuple[list[Prediction], Workload]:
    import torch

    w, _ = workload_from_config(cfg)
    measured_pair = None
    if run is not None:
        toks, name = measured_from_run(run)
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
    preds = [predict(w, g, n, strategy=strategy, startup_s=startup_s, measured=measured_pair,
                     peak_tflops=present[1] if present and present[0] == g.name else None)
             for g, n in parse_gpus(gpus)]
    return verdicts(preds, floor), w


def plan_json(preds: list[Prediction], w: Workload) -> dict:
    return {"workload": asdict(w), "predictions": [{**asdict(p), "tokens_per_s": p.tokens_per_s} for p in preds]}
