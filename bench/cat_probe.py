"""SwiGLU's backward on LoRA concat_b's [N, 2I] gate|up buffer, as inductor lowers the gradient's concatenation: one
pointwise kernel with masked loads (its default "pointwise cat", which reads dh and gate twice: once for each half it
writes) against a ConcatKernel, whose two halves' producers the scheduler can fuse into one kernel reading each input
once (inductor's max_pointwise_cat_inputs and max_complex_pointwise_cat_inputs at 0).

    python3 bench/cat_probe.py [--tokens 16384] [--out FILE.jsonl]     (needs a GPU)

The graph is the MLP's first half at Llama-3.2-3B's sizes: gu = x W^T (W [2I, H], frozen), h = silu(gate) * up, and
backward to x (dx = dgu W, the GEMM the concatenated gradient feeds). Each variant: 3 warm-up and 20 timed forward +
backward passes (CUDA events), one profiled pass (the kernels' own times), and its dx against the default's. The
floor is the bytes the backward's elementwise kernel must move (dh, gate, up read once; dgate, dup written once) over
the copy bandwidth measured here.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from elementwise_gpu import copy_bandwidth  # noqa: E402  (bench/ is not a package)

H, I = 3072, 8192  # Llama-3.2-3B
VARIANTS = {"pointwise_cat": {}, "concat_kernel": {"max_pointwise_cat_inputs": 0,
                                                   "max_complex_pointwise_cat_inputs": 0}}


def mlp_half(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, w).split(I, dim=-1)
    return F.silu(gate) * up


def run(name: str, options: dict, x: torch.Tensor, w: torch.Tensor, dh: torch.Tensor) -> dict:
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    # the settings this torch has (2.11 has no max_complex_pointwise_cat_inputs: torch.compile refused it, s20-drop)
    options = {k: v for k, v in options.items() if hasattr(inductor_config, k)}
    fn = torch.compile(mlp_half, dynamic=False, options=options)

    def once() -> torch.Tensor:
        leaf = x.detach().requires_grad_()
        fn(leaf, w).backward(dh)
        return leaf.grad

    for _ in range(3):
        dx = once()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        once()
    end.record()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        once()
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0:
            kernels[e.key[:90]] = round(e.device_time_total / 1e3, 4)
    elementwise = {k: v for k, v in kernels.items() if k.startswith("triton_")}
    return {"variant": name, "options": options, "fwd_bwd_ms": round(start.elapsed_time(end) / 20, 4),
            "triton_ms": round(sum(elementwise.values()), 4), "kernels": kernels, "dx": dx}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--out", default=None)
    opts = p.parse_args(argv)
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(opts.tokens, H, device=device, dtype=torch.bfloat16, generator=gen)
    w = torch.randn(2 * I, H, device=device, dtype=torch.bfloat16, generator=gen) * H ** -0.5
    dh = torch.randn(opts.tokens, I, device=device, dtype=torch.bfloat16, generator=gen)
    floor_ms = 5 * opts.tokens * I * 2 / copy_bandwidth(device) * 1e3  # dh, gate, up read; dgate, dup written
    rows = [run(name, options, x, w, dh) for name, options in VARIANTS.items()]
    for r in rows:
        r["dx_max_abs_diff"] = (r.pop("dx").float() - rows[0]["dx"].float()).abs().max().item() if r is not rows[0] \
            else 0.0
    rows[0].pop("dx")
    for r in rows:
        r |= {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__, "tokens": opts.tokens,
              "elementwise_floor_ms": round(floor_ms, 4)}
        print(f"{r['variant']:>14}: fwd+bwd {r['fwd_bwd_ms']:.3f} ms, inductor's kernels {r['triton_ms']:.3f} ms "
              f"(floor of the backward's {floor_ms:.3f}), dx max |diff| {r['dx_max_abs_diff']:.3g}")
        for k, v in sorted(r["kernels"].items(), key=lambda kv: -kv[1]):
            print(f"      {v:8.3f}  {k}")
    if opts.out:
        with open(opts.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
