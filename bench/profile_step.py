"""Where one training step's GPU time goes: torch.profiler over a few steps of a `gapless bench` configuration,
device time grouped by kind of kernel and by the aten op (with shapes) that launched it.

    PYTHONPATH=src python3 bench/profile_step.py --model bench/models/llama-3.2-3b --config best \
        --lengths .carry/lengths_shared_mix.txt [--steps 2] [--warmup 3] [--json OUT.json]

Kernel kinds, by name (the names cuBLAS, CUTLASS, triton and torch give their kernels on Hopper):
    gemm        nvjet*/sm90_xmma*/cutlass*/*gemm* (cuBLAS and CUTLASS matmuls)
    attention   *flash*/*fmha*/*attn* (varlen flash attention, FlexAttention's triton kernel, flash-attn-4)
    triton      triton_* (torch.compile's fused elementwise/reduction kernels)
    gapless     gapless's own Triton kernels (kernels/lora_dropout_triton.py, kernels/loss.py): dropout_xa*,
                cross_entropy_grad*
    elementwise *elementwise*/*vectorized*/*reduce* (eager torch kernels)
    optimizer   *multi_tensor*/*adam*/*foreach* (fused AdamW, grad-norm)
    copy        memcpy/memset/*copy*
LoRA's matmuls are the `aten::mm`/`aten::addmm` rows with a 16 (the rank) among their shapes.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import defaultdict
from dataclasses import replace

import torch
from torch.profiler import ProfilerActivity, profile

from gapless.bench import CONFIGS, build_model, lengths_mixture, take_batches
from gapless.config import OptimConfig
from gapless.data.batching import BatchSampler
from gapless.model.loading import model_args_from_config, read_config
from gapless.train.optim import build_optimizer
from gapless.train.step import train_step

KINDS = [("attention", r"flash|fmha|attn|flex"), ("gemm", r"nvjet|xmma|cutlass|gemm|sm90_|cublas"),
         ("triton", r"^triton_"), ("gapless", r"^(dropout_xa|cross_entropy_grad)"),
         ("optimizer", r"multi_tensor|adam|foreach"), ("copy", r"memcpy|memset|copy"),
         ("elementwise", r"elementwise|vectorized|reduce|kernel")]


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, pattern in KINDS:
        if re.search(pattern, low):
            return kind
    return "other"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--config", default="best", choices=sorted(CONFIGS))
    p.add_argument("--lengths", required=True)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--lora-kernel", default=None, help="lora.kernel (default: the config's)")
    p.add_argument("--json", default=None)
    p.add_argument("--device", default="cuda", help="cuda; cpu only to smoke-test this script (float32)")
    opts = p.parse_args()

    device = torch.device(opts.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    args = model_args_from_config(read_config(opts.model))
    recipe = CONFIGS[opts.config]
    mix = lengths_mixture(opts.lengths, args.vocab_size, 4096)
    sampler = BatchSampler(mix, strategy=recipe.batching, max_seq_len=4096, tokens_per_batch=16384, seed=0)
    batches = take_batches(sampler, opts.warmup + opts.steps, device)
    recipe = replace(recipe, lora_kernel=opts.lora_kernel or recipe.lora_kernel)
    model, method = build_model(args, recipe, device, dtype)
    params = list(method.trainable(model).values())
    optimizer = build_optimizer(params, OptimConfig(), device.type)
    for b, _ in batches[:opts.warmup]:
        train_step(model, [b], params, optimizer, OptimConfig().grad_clip)
    sync()
    started = time.perf_counter()  # the same steps unprofiled: wall time against the kernels' sum is the gaps
    for b, _ in batches[opts.warmup:]:
        train_step(model, [b], params, optimizer, OptimConfig().grad_clip)
    sync()
    wall_ms = (time.perf_counter() - started) * 1e3 / opts.steps

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for b, _ in batches[opts.warmup:]:
            train_step(model, [b], params, optimizer, OptimConfig().grad_clip)
        sync()

    steps = opts.steps
    by_kind: dict[str, float] = defaultdict(float)
    kernels: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.name.startswith("## "):  # "## Call CompiledFxGraph ... ##": a range over kernels listed on their own
            continue
        if e.device_type == torch.autograd.DeviceType.CUDA or (device.type == "cpu" and e.name.startswith("aten::")
                                                               and not e.cpu_children):
            us = e.device_time_total if device.type == "cuda" else e.cpu_time_total
            by_kind[kind_of(e.name)] += us / 1e3 / steps
            kernels[e.name] += us / 1e3 / steps
    total = sum(by_kind.values())
    print(f"== {opts.config} on {opts.model}: {total:.1f} ms of GPU kernels per step, {wall_ms:.1f} ms wall "
          f"unprofiled (gaps {wall_ms - total:.1f} ms)")
    for kind, ms in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:12s} {ms:8.1f} ms  {100 * ms / total:5.1f}%")
    print("== top kernels (ms per step)")
    for name, ms in sorted(kernels.items(), key=lambda kv: -kv[1])[:30]:
        print(f"  {ms:8.2f}  {name[:150]}")

    ops = prof.key_averages(group_by_input_shape=True)
    rows = []
    for e in ops:
        dev = e.self_device_time_total if device.type == "cuda" else e.self_cpu_time_total
        if dev > 0 and e.key.startswith("aten::"):
            rows.append((dev / 1e3 / steps, e.key, str(e.input_shapes)[:120], e.count // steps))
    rows.sort(reverse=True)
    lora_ms = sum(ms for ms, key, shapes, _ in rows if key in ("aten::mm", "aten::addmm", "aten::bmm")
                  and re.search(r"\b16\b", shapes))
    print(f"== aten ops by self device time (ms per step); rank-16 (LoRA) matmuls: {lora_ms:.1f} ms")
    for ms, key, shapes, count in rows[:40]:
        print(f"  {ms:8.2f}  x{count:<4d} {key:28s} {shapes}")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"config": opts.config, "model": opts.model, "kernel_ms": total, "wall_ms": wall_ms, "by_kind": by_kind,
                       "lora_mm_ms": lora_ms, "top_kernels": sorted(kernels.items(), key=lambda kv: -kv[1])[:60],
                       "top_ops": rows[:80]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
