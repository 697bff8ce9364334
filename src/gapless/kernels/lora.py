"""LoRA's linear layer in three forms (LoraConfig.kernel picks one; gapless.config says what each measured):
lora_linear_reference, the plain formula, one layer at a time; lora_linear_grouped, the same formula for the
layers that read the same input (q/k/v; gate/up) with their A matrices as one matmul (the default); and
lora_linear_concat, the frozen projections and the A matrices of those layers as one GEMM over a buffer
[W_1; ..; W_k; A_1; ..; A_k], forward and for dx, so each activation is read once.

    y = x W^T + b + scaling * (dropout(x) A^T) B^T        x [N, in], W [out, in], A [r, in], B [out, r]

Mixed precision: A and B are stored in float32 (the optimizer's master copy, as PEFT keeps them) but the matmuls
run in x's dtype, as under autocast; casting A and B (~0.1 MB each) is cheap, while casting x to float32 would
move 3x the activation bytes and lose bf16 tensor cores. dA and dB come back in the adapter's dtype.

A third form, one autograd.Function adding the update inside the base GEMMs' epilogues (addmm into the base
output, forward and backward), measured slower in a compiled Llama-3.2-3B step on the H200 (518.7 against 501.2
ms for the reference, bench/RESULTS.md run 20261203T144848Z-9d4119: torch.compile cannot fuse through it) and was
removed (issue shape); its measurement stays in bench/RESULTS.md. lora_linear_concat differs from it: the B
matmuls, the scaling and the bias stay outside the autograd.Function, as ops torch.compile fuses with their
neighbours; only the two big GEMMs (forward, dx) and the group's dA GEMM are inside.

Under dropout, concat runs grouped. A fourth form stacked only the frozen q/k/v (gate/up) weights for one base GEMM
beside grouped's dropout A matmul: 33,361 against grouped's 33,991 real tokens/s for Llama-3.2-3B at dropout 0.05
on the H200 (run s14-default, one call, fa4_op), so it was removed.

Dropout: `dropout` is what LoraLinear holds (a FusedDropout, an nn.Dropout under lora.fused_dropout: false, or
nn.Identity at p = 0) or any callable on x. A FusedDropout in training on a CUDA tensor with triton importable runs
the A matmul fused (gapless.kernels.lora_dropout: the mask drawn in registers from a seed, never stored; its
docstring says exactly how masks are drawn); anything else runs dropout(x) and the A matmul in torch.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from gapless.kernels.lora_dropout import fused_dropout_applies, lora_dropout_a


def lora_linear_reference(x: Tensor, weight: Tensor, bias: Tensor | None, lora_a: Tensor, lora_b: Tensor,
                          scaling: float, dropout: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """The plain-PyTorch formula, x W^T + b + scaling * B A dropout(x), differentiated by autograd.

    The reference that the grouped form is tested against, and the path of the layers that run alone (o_proj,
    down_proj), where an nn.Dropout in training on CUDA can run fused (module docstring) and save no mask.
    """
    if fused_dropout_applies(x, dropout):
        xa = lora_dropout_a(x, [lora_a], dropout.p)  # [..., r]
    else:
        xd = x if dropout is None else dropout(x)
        xa = F.linear(xd, lora_a.to(x.dtype))  # [..., r]
    return F.linear(x, weight, bias) + F.linear(xa, lora_b.to(x.dtype)) * scaling  # update [..., out]


def lora_linear_grouped(x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor | None],
                        lora_as: Sequence[Tensor], lora_bs: Sequence[Tensor], scalings: Sequence[float],
                        dropout: Callable[[Tensor], Tensor] | None = None) -> list[Tensor]:
    """lora_linear_reference for layers that read the same x (q/k/v; gate/up), their A matrices as one matmul.

    dropout(x) [A_q; A_k; A_v]^T is one [N, r_q + r_k + r_v] GEMM, split into each layer's x A^T; autograd then
    gives dx from all the A matrices as one GEMM and all their gradients as one GEMM over x. Each rank-r GEMM is
    bound by reading or writing x ([N, in]), so a group of k layers moves x 3 times per step instead of 3k. The
    base GEMMs and the B matrices stay per layer. Same sums as the reference (in float32 on the CPU, ~1e-7).

    Dropout: ONE mask for the group, drawn once on x and shared by its layers' A matmuls (PEFT draws one per
    projection: the same keep probability and scaling for every element, so the same expected update, but a
    different sample). Each layer's output equals lora_linear_reference under that same mask exactly. An
    nn.Dropout in training on CUDA can run fused: the same one mask per group, drawn in the kernel (module docstring).
    """
    ranks = [lora_a.shape[0] for lora_a in lora_as]
    if fused_dropout_applies(x, dropout):
        xas = lora_dropout_a(x, list(lora_as), dropout.p).split(ranks, dim=-1)  # each [..., r]
    else:
        xd = x if dropout is None else dropout(x)
        a = torch.cat([lora_a.to(x.dtype) for lora_a in lora_as])  # [sum r, in]
        xas = F.linear(xd, a).split(ranks, dim=-1)  # each [..., r]
    return [F.linear(x, w, b) + F.linear(xa, lora_b.to(x.dtype)) * scaling
            for w, b, xa, lora_b, scaling in zip(weights, biases, xas, lora_bs, scalings)]


class _ConcatLinear(torch.autograd.Function):
    """x [N, in] @ concat^T with concat = [W_1; ...; W_k; A_1; ...; A_k] [O + R, in] (frozen W and the A rows, in
    x's dtype), returned split into the k base outputs [N, o_i] and the k products x A_i^T [N, r_i] (views of one
    [N, O + R] GEMM output). Backward: dx = [dy_1 .. dy_k, dxa_1 .. dxa_k] @ concat as ONE GEMM, and the A
    gradients (dxa_1 .. dxa_k)^T x as ONE [R, in] GEMM; the frozen W gets none. `lora_as` (the float32 masters)
    enter only so that their gradients have somewhere to go: their values are the concat's A rows, which the caller
    keeps current (gapless.model.lora refreshes them before every forward)."""

    @staticmethod
    def forward(ctx, x: Tensor, concat: Tensor, sizes: tuple[int, ...], *lora_as: Tensor):
        ctx.save_for_backward(x, concat)
        k = ctx.k = len(lora_as)
        ctx.sizes, ctx.a_dtypes = sizes, [a.dtype for a in lora_as]
        parts = F.linear(x, concat).split(sizes, dim=-1)  # [..., O + R] -> k base outputs, k products x A^T
        # the base outputs stay views (the bias and update adds read them once and the [..., O + R] output is then
        # freed); each x A^T is copied out ([N, r], 0.5 MB at 16,384 tokens, r=16, bf16) because the B matmul
        # saves it for dB, and a saved view would keep the whole output alive: 537 MB per layer for gate/up in
        # Llama-3.2-3B, 15 GB over its 28 layers
        return (*parts[:k], *(p.contiguous() for p in parts[k:]))

    @staticmethod
    def backward(ctx, *grads: Tensor):
        x, concat = ctx.saved_tensors
        # an output nobody used gets None: its slice of the gradient is zeros
        grads = [torch.zeros(*x.shape[:-1], size, dtype=x.dtype, device=x.device) if g is None else g
                 for g, size in zip(grads, ctx.sizes)]
        dz = torch.cat(grads, dim=-1)  # [..., O + R]
        dx = dz @ concat if ctx.needs_input_grad[0] else None  # [..., in], one GEMM over [W; A]
        dxa = dz[..., sum(ctx.sizes[:ctx.k]):].flatten(0, -2)  # [N, R], a strided view
        da = (dxa.t() @ x.flatten(0, -2)).split(ctx.sizes[ctx.k:])  # [R, in], one GEMM for the group
        return (dx, None, None, *(d.to(dtype) for d, dtype in zip(da, ctx.a_dtypes)))


def lora_linear_concat(x: Tensor, concat: Tensor, biases: Sequence[Tensor | None], lora_as: Sequence[Tensor],
                       lora_bs: Sequence[Tensor], scalings: Sequence[float]) -> list[Tensor]:
    """lora_linear_reference for the k layers that read the same x (q/k/v; gate/up; or one layer alone), the frozen
    projections and the A matrices as ONE GEMM: x [W_1; ..; W_k; A_1; ..; A_k]^T gives every base output and every
    x A_i^T, so x is read once forward and dx is one GEMM backward (_ConcatLinear). Then the rank-r B matmuls, the
    scaling and the bias, which torch.compile fuses with what follows where it can.

    `concat` [sum out + sum r, in] holds the frozen weights, then the A rows, in x's dtype; its A rows must equal
    `lora_as` (cast to x's dtype) when this runs: gapless.model.lora keeps them current. No dropout: dropout(x) for
    the A rows cannot share the GEMM with the base's un-dropped x (the caller runs lora_linear_grouped instead).
    Same sums as the reference (float32 on the CPU, ~1e-7).
    """
    outs = [b.shape[0] for b in lora_bs]
    ranks = [a.shape[0] for a in lora_as]
    assert concat.shape[0] == sum(outs) + sum(ranks) and concat.dtype == x.dtype, (
        f"concat buffer {tuple(concat.shape)} {concat.dtype} does not hold outputs {outs} and ranks {ranks} in "
        f"{x.dtype}")
    if torch.is_grad_enabled():
        parts = _ConcatLinear.apply(x, concat, (*outs, *ranks), *lora_as)
    else:  # evaluation, generation: the GEMM alone (dynamo cannot trace the Function's forward without autograd)
        parts = F.linear(x, concat).split((*outs, *ranks), dim=-1)
    k = len(outs)
    return [(y if b is None else y + b) + F.linear(xa, lora_b.to(x.dtype)) * scaling
            for y, b, xa, lora_b, scaling in zip(parts[:k], biases, parts[k:], lora_bs, scalings)]
