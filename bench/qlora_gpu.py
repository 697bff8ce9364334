"""QLoRA's 4-bit GEMMs on the GPU: dequantise-then-GEMM variants against the bf16 GEMM they replace.

    python bench/qlora_gpu.py [--tokens 16384] [--model bench/models/llama-3.2-3b] [--out bench/qlora_h200.jsonl]

For each distinct projection shape of the model ([out, in] of q/k/v/o/gate/up/down), at `--tokens` tokens, bf16,
the median of `--reps` timed calls (CUDA events, after warm-up) of:

    gemm_bf16          x @ W^T with a bf16 W: the LoRA path's base GEMM, what QLoRA must not undo
    dequant_compiled   gapless.kernels.nf4.dequantize_nf4 alone (torch.compile: the fast path)
    dequant_eager      dequantize_nf4_reference alone, uncompiled
    dq_gemm_compiled   compiled dequantisation into a transient bf16 W, then cuBLAS x @ W^T (QLoraLinear's forward)
    dq_gemm_fused      dequantisation and GEMM in one torch.compile'd function (mode max-autotune: Inductor may
                       pick a Triton GEMM with the dequantisation in its prologue)
    bnb_matmul_4bit    bitsandbytes.matmul_4bit on bitsandbytes' own quantised state (the HF+PEFT+bnb QLoRA path),
                       where bitsandbytes imports
    qlora_fwd_bwd      QLoraLinear forward + backward (dx, dA, dB; W dequantised twice) against
    lora_fwd_bwd       LoraLinear (bf16 base) forward + backward, the same r=16 adapter

and one line per variant summed over the 7 projections of a layer x the layers: the per-step cost of each.
The dequantisation is estimated at ~64 us per Llama-3.2-3B layer from bandwidth (kernels/nf4.py); this measures it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from gapless.kernels.nf4 import dequantize_nf4, dequantize_nf4_reference, nf4_codes, quantize_nf4
from gapless.model.loading import read_model_args
from gapless.model.lora import LoraLinear
from gapless.model.qlora import QLoraLinear
from gapless.meter.memory import projection_shapes


def timed(fn, reps: int, warmup: int = 3) -> float:
    """Median milliseconds of fn() over `reps` calls, each between two CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def variants(out_f: int, in_f: int, tokens: int) -> dict:
    dev, dt = torch.device("cuda"), torch.bfloat16
    w = (torch.randn(out_f, in_f, device=dev) * 0.02).to(dt)
    x = torch.randn(tokens, in_f, device=dev, dtype=dt)
    q = quantize_nf4(w)
    args = (q.packed, q.absmax_q, q.absmax_scale, q.offset, q.shape, dt, nf4_codes(dev))  # code tables made once
    fns = {
        "gemm_bf16": lambda: F.linear(x, w),
        "dequant_compiled": lambda: dequantize_nf4(*args),
        "dequant_eager": lambda: dequantize_nf4_reference(*args),
        "dq_gemm_compiled": lambda: F.linear(x, dequantize_nf4(*args)),
    }
    fused = torch.compile(lambda x_: F.linear(x_, dequantize_nf4_reference(*args)), mode="max-autotune")
    fns["dq_gemm_fused"] = lambda: fused(x)
    try:
        import bitsandbytes as bnb
        import bitsandbytes.functional as bnbf

        bq, state = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
        fns["bnb_matmul_4bit"] = lambda: bnb.matmul_4bit(x, bq.t(), quant_state=state)
    except ImportError:
        pass

    base = nn.Linear(in_f, out_f, bias=False, device=dev, dtype=dt)
    with torch.no_grad():
        base.weight.copy_(w)
    base.weight.requires_grad_(False)
    lora = LoraLinear(base, 16, 2.0, 0.0, torch.float32, kernel="reference")
    qlora = QLoraLinear(LoraLinear(base, 16, 2.0, 0.0, torch.float32, kernel="reference"), dt)
    xg = x.clone().requires_grad_()
    dy = torch.randn(tokens, out_f, device=dev, dtype=dt)
    fns["lora_fwd_bwd"] = lambda: lora(xg).backward(dy)
    fns["qlora_fwd_bwd"] = lambda: qlora(xg).backward(dy)
    return fns


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="bench/models/llama-3.2-3b")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None, help="append one JSON row per shape and variant")
    opts = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("qlora_gpu.py: needs CUDA", file=sys.stderr)
        return 2
    args = read_model_args(opts.model)
    shapes = projection_shapes(args)
    per_layer: dict[str, float] = {}
    rows = []
    for (in_f, out_f), names in _distinct(shapes).items():
        for variant, fn in variants(out_f, in_f, opts.tokens).items():
            ms = timed(fn, opts.reps)
            per_layer[variant] = per_layer.get(variant, 0.0) + ms * len(names)
            rows.append({"model": Path(opts.model).name, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                         "shape": [out_f, in_f], "projections": names, "tokens": opts.tokens, "variant": variant,
                         "ms": round(ms, 4)})
            print(f"{'/'.join(names):>20} [{out_f}, {in_f}]  {variant:<17} {ms:8.3f} ms", flush=True)
        torch.cuda.empty_cache()
    print(f"per step ({args.num_hidden_layers} layers x 7 projections):")
    for variant, ms in per_layer.items():
        print(f"  {variant:<17} {ms * args.num_hidden_layers:9.1f} ms")
        rows.append({"model": Path(opts.model).name, "tokens": opts.tokens, "variant": variant, "per_step_ms":
                     round(ms * args.num_hidden_layers, 2)})
    if opts.out:
        with open(opts.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return 0


def _distinct(shapes: dict[str, tuple[int, int]]) -> dict[tuple[int, int], list[str]]:
    out: dict[tuple[int, int], list[str]] = {}
    for name, shape in shapes.items():
        out.setdefault(shape, []).append(name)
    return out


if __name__ == "__main__":
    sys.exit(main())
