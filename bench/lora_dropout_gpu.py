"""Time LoRA dropout on one GPU: the torch path, the fused Triton path (gapless.kernels.lora_dropout) and no dropout,
for one Llama-3.2-3B layer's LoRA groups at 16,384 tokens (about 1 minute).

    PYTHONUNBUFFERED=1 python3 bench/lora_dropout_gpu.py [--tokens 16384] [--p 0.05]

Groups (Llama-3.2-3B, r = 16): q/k/v (in 3072, R = 48, outs 3072/1024/1024), gate/up (in 3072, R = 32, outs
8192/8192) and down_proj alone (in 8192, R = 16, out 3072); o_proj is down_proj's path at in 3072. Each variant is
torch.compile'd as the decoder layer is, bf16, forward + backward, median of triton.testing.do_bench:
- "group": lora_linear_grouped (lora_linear_reference for down_proj) whole: base GEMMs, A and B matmuls, dropout;
  the row to compare against the 3% budget of issue 18.
- "A only": xa = dropout(x) A^T and its backward (dx, dA) alone. GB/s = 3 N in 2 B / time: x read forward, x read
  and dx written backward in bf16, the traffic any path that stores no mask must move (xa, dxa and A are < 2%).
- "saved MiB": what the forward leaves allocated for backward beyond its outputs (the torch path's masks).
"torch" is torch's dropout through the same function (a plain callable, which keeps the torch path); "fused" an
nn.Dropout in training (the fused kernels); "none" no dropout. JSON lines go to $OUT/lora_dropout.jsonl when OUT is
set. Timing only: tests/test_kernels_lora_dropout.py checks the values.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from gapless.kernels.lora import lora_linear_grouped, lora_linear_reference  # noqa: E402
from gapless.kernels.lora_dropout import lora_dropout_a  # noqa: E402

GROUPS = [("q/k/v", 3072, (16, 16, 16), (3072, 1024, 1024)), ("gate/up", 3072, (16, 16), (8192, 8192)),
          ("down_proj", 8192, (16,), (3072,))]


class TorchDropout(nn.Module):
    """torch's dropout as a plain callable: not an nn.Dropout, so gapless.kernels.lora keeps the torch path."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x):
        return F.dropout(x, self.p, True)


def group_fn(ranks):
    if len(ranks) > 1:
        return lora_linear_grouped
    return lambda x, ws, bs, a_s, b_s, scalings, dropout: [lora_linear_reference(x, ws[0], bs[0], a_s[0], b_s[0],
                                                                                 scalings[0], dropout=dropout)]


def a_only(x, a_s, dropout):
    if isinstance(dropout, nn.Dropout):
        return lora_dropout_a(x, a_s, dropout.p)
    xd = x if dropout is None else dropout(x)
    return F.linear(xd, torch.cat([a.to(x.dtype) for a in a_s]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--p", type=float, default=0.05)
    args = ap.parse_args(argv)
    n, dev, dtype = args.tokens, "cuda", torch.bfloat16
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, N={n}, p={args.p}", flush=True)
    out = Path(os.environ["OUT"]) / "lora_dropout.jsonl" if os.environ.get("OUT") else None
    rows = []
    for name, k, ranks, outs in GROUPS:
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(n, k, device=dev, dtype=dtype, generator=g).requires_grad_()
        ws = [torch.randn(o, k, device=dev, dtype=dtype, generator=g) / k ** 0.5 for o in outs]
        bs = [None] * len(outs)
        a_s = [(torch.randn(r, k, device=dev, generator=g) / k ** 0.5).requires_grad_() for r in ranks]
        b_s = [(torch.randn(o, r, device=dev, generator=g) / r ** 0.5).requires_grad_() for o, r in zip(outs, ranks)]
        dys = [torch.randn(n, o, device=dev, dtype=dtype, generator=g) for o in outs]
        dxa = torch.randn(n, sum(ranks), device=dev, dtype=dtype, generator=g)
        params = [x, *a_s, *b_s]
        for variant, dropout in (("none", None), ("torch", TorchDropout(args.p)), ("fused", nn.Dropout(args.p))):
            torch._dynamo.reset()
            fn = torch.compile(group_fn(ranks))
            a_fn = torch.compile(a_only)

            def group_step():
                ys = fn(x, ws, bs, a_s, b_s, [2.0] * len(ws), dropout=dropout)
                torch.autograd.backward(ys, dys)

            def a_step():
                a_fn(x, a_s, dropout).backward(dxa)

            group_step(), a_step()  # compile
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            ys = fn(x, ws, bs, a_s, b_s, [2.0] * len(ws), dropout=dropout)
            saved = torch.cuda.memory_allocated() - before - sum(y.numel() * y.element_size() for y in ys)
            del ys
            group_ms = do_bench(group_step, grad_to_none=params, return_mode="median")
            a_ms = do_bench(a_step, grad_to_none=params, return_mode="median")
            gbs = 3 * n * k * 2 / (a_ms * 1e-3) / 1e9
            row = dict(group=name, variant=variant, tokens=n, in_features=k, R=sum(ranks), p=args.p,
                       group_ms=round(group_ms, 4), a_only_ms=round(a_ms, 4), a_only_gbs=round(gbs, 1),
                       saved_mib=round(saved / 2 ** 20, 1), device=torch.cuda.get_device_name())
            rows.append(row)
            print(f"{name:9s} in={k} R={sum(ranks):2d}  {variant:5s}  group {group_ms:7.3f} ms   A only "
                  f"{a_ms:6.3f} ms {gbs:7.1f} GB/s   saved {saved / 2 ** 20:7.1f} MiB", flush=True)
    print("\nper layer (q/k/v + gate/up + down_proj; o_proj not timed), group ms:")
    for variant in ("none", "torch", "fused"):
        total = sum(r["group_ms"] for r in rows if r["variant"] == variant)
        print(f"  {variant:5s} {total:7.3f} ms")
    if out:
        out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
