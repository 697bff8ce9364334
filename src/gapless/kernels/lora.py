"""LoRA's linear layer in three forms (LoraConfig.kernel picks one; gapless.config says what each measured):
lora_linear_reference, the plain formula; lora_linear_grouped, the plain formula for layers that read the same
input with their A matrices as one matmul (the default); and lora_linear, one autograd.Function whose low-rank
update goes into the GEMMs' epilogues, which the rest of this docstring is about.

    y = x W^T + b + scaling * (x A^T) B^T        x [N, in], W [out, in], A [r, in], B [out, r]

Why: the plain formula (lora_linear_reference, what autograd differentiates) writes the update [N, out],
scales it into a second [N, out] tensor and adds that to the base output; its backward scales dy into a new
[N, out] tensor and sums two [N, in] input gradients. Counting bf16 bytes moved per element of those tensors:

    forward  [N, out]:  reference 14 (out 2, update 2, scale 2+2, add 4+2)  fused 6 (out 2, addmm 2+2)
    backward [N, out]:  reference 10 (scale 2+2, three GEMMs read 2 each)    fused 6 (three GEMMs read dy)
    backward [N, in]:   reference 10 (two GEMMs write 2 each, sum 4+2)       fused 6 (dx 2, addmm 2+2)

One Llama-3.2-3B layer has 27,648 output and 26,624 input features over its seven projections, so at
N = 16,384 the fused path moves 16,384 * (8 * 27,648 + 4 * 27,648 + 4 * 26,624) B = 7.2 GB less per layer,
about 2 ms at the H200's ~4 TB/s achievable bandwidth: ~50 ms of a ~490 ms step over 28 layers (an estimate
for eager; torch.compile already fuses the reference's scale and add into one pointwise kernel, so less is
left to win there; bench/lora_gpu.py measures both). Measured in a whole compiled Llama-3.2-3B step on the
H200 it lost: 518.7 ms against 501.2 with the reference (bench/RESULTS.md, run 20261203T144848Z-9d4119), so
LoraConfig.kernel defaults to "grouped" (lora_linear_grouped, below); this path stays an option (its eager
speed is not measured yet).

How: out = x W^T (+ b) is one GEMM; addmm(out, x A^T, B^T, alpha=scaling, out=out) adds the rank-r update in
the epilogue of a second, K = r GEMM that reads and writes `out` in place (cuBLAS's beta * C term). The
backward mirrors it: dx = dy W, then dx += scaling * (dy B) A the same way.

Saved for backward: x [N, in] (a view of the input, as F.linear saves it), xa = x A^T [N, r], W (the frozen
Parameter itself, no copy) and A, B cast to x's dtype (r * (in + out) elements, ~0.2 MB). That is what
autograd saves for the reference too; only the [N, out] and [N, in] temporaries go.

Mixed precision: A and B are stored in float32 (the optimizer's master copy, as PEFT keeps them) but the
matmuls run in x's dtype, as under autocast; casting A and B (~0.1 MB each) is cheap, while casting x to float32
would move 3x the activation bytes and lose bf16 tensor cores. dA and dB come back in the adapter's dtype.
W and the bias are frozen: no gradient is computed for them (lora_linear refuses ones that require grad).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


def lora_linear_reference(x: Tensor, weight: Tensor, bias: Tensor | None, lora_a: Tensor, lora_b: Tensor,
                          scaling: float, dropout: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """The plain-PyTorch formula, x W^T + b + scaling * B A dropout(x), differentiated by autograd.

    The path for LoRA dropout in training (the fused function would have to save the mask) and the reference
    that tests compare lora_linear against.
    """
    xd = x if dropout is None else dropout(x)
    update = F.linear(F.linear(xd, lora_a.to(x.dtype)), lora_b.to(x.dtype))  # [..., r] then [..., out]
    return F.linear(x, weight, bias) + update * scaling


def lora_linear_grouped(x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor | None],
                        lora_as: Sequence[Tensor], lora_bs: Sequence[Tensor],
                        scalings: Sequence[float]) -> list[Tensor]:
    """lora_linear_reference for layers that read the same x (q/k/v; gate/up), their A matrices as one matmul.

    x [A_q; A_k; A_v]^T is one [N, r_q + r_k + r_v] GEMM, split into each layer's x A^T; autograd then gives dx
    from all the A matrices as one GEMM and all their gradients as one GEMM over x. Each rank-r GEMM is bound by
    reading or writing x ([N, in]), so a group of k layers moves x 3 times per step instead of 3k. The base
    GEMMs and the B matrices stay per layer. Same sums as the reference (in float32 on the CPU, equal to ~1e-7).
    """
    a = torch.cat([lora_a.to(x.dtype) for lora_a in lora_as])  # [sum r, in]
    xas = F.linear(x, a).split([lora_a.shape[0] for lora_a in lora_as], dim=-1)  # each [..., r]
    return [F.linear(x, w, b) + F.linear(xa, lora_b.to(x.dtype)) * scaling
            for w, b, xa, lora_b, scaling in zip(weights, biases, xas, lora_bs, scalings)]


def lora_linear(x: Tensor, weight: Tensor, bias: Tensor | None, lora_a: Tensor, lora_b: Tensor,
                scaling: float) -> Tensor:
    """x W^T + b + scaling * (x A^T) B^T with the update fused into the GEMMs, forward and backward.

    x [..., in] in the activations' dtype; weight [out, in] and bias [out] frozen, in x's dtype; lora_a [r, in]
    and lora_b [out, r] in any float dtype (float32 master weights), cast to x's dtype for the matmuls.
    """
    if weight.requires_grad or (bias is not None and bias.requires_grad):
        raise ValueError("lora_linear: weight and bias must be frozen (requires_grad=False), it computes no "
                         "gradient for them; use lora_linear_reference to train the base layer too")
    return _LoraLinear.apply(x, weight, bias, lora_a, lora_b, scaling)


class _LoraLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, lora_a: Tensor, lora_b: Tensor,
                scaling: float) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # [..., in] -> [N, in]
        a, b = lora_a.to(x.dtype), lora_b.to(x.dtype)  # [r, in], [out, r]
        out = F.linear(x2, weight, bias)  # [N, out], the bias added by the same addmm
        xa = x2 @ a.t()  # [N, r]
        # out += scaling * xa B^T in the GEMM's epilogue, in place: no [N, out] temporary. The out= form of
        # addmm_ (the same kernel) because torch.utils.flop_counter counts addmm but not addmm_
        torch.addmm(out, xa, b.t(), alpha=scaling, out=out)
        ctx.save_for_backward(x2, xa, weight, a, b)
        # no shapes on ctx: under dynamic=True they are symbolic, and dynamo's autograd.Function capture has
        # failed on symbols carried from forward to backward (pytorch#111031); the backward reads dy's shape
        ctx.scaling, ctx.adapter_dtypes = scaling, (lora_a.dtype, lora_b.dtype)
        return out.view(*x.shape[:-1], out.shape[-1])  # [N, out] -> [..., out]

    @staticmethod
    def backward(ctx, dy: Tensor):
        x2, xa, weight, a, b = ctx.saved_tensors
        need_x, _, _, need_a, need_b, _ = ctx.needs_input_grad
        g = dy.reshape(-1, dy.shape[-1])  # [..., out] -> [N, out]
        dx = da = db = None
        if need_x or need_a:
            gb = g @ b  # [N, r]; scaling is applied by the GEMMs' alpha and to the small dA, never to [N, *]
        if need_x:
            dx = g @ weight  # [N, in]
            torch.addmm(dx, gb, a, alpha=ctx.scaling, out=dx)  # dx += scaling * gb A in the epilogue, in place
            dx = dx.view(*dy.shape[:-1], dx.shape[-1])  # [N, in] -> [..., in]
        if need_a:
            da = (gb.t() @ x2).to(ctx.adapter_dtypes[0]).mul_(ctx.scaling)  # [r, in]
        if need_b:
            db = (g.t() @ xa).to(ctx.adapter_dtypes[1]).mul_(ctx.scaling)  # [out, r]
        # no gradients for the frozen weight and bias, nor for scaling
        return dx, None, None, da, db, None
