"""LoRA's linear layer in four forms (LoraConfig.kernel picks one; gapless.config says what each measured):
lora_linear_reference, the plain formula, one layer at a time; lora_linear_grouped, the same formula for the
layers that read the same input (q/k/v; gate/up) with their A matrices as one matmul; and lora_linear_concat, the
frozen projections and the A matrices of those layers as one GEMM over a buffer [W_1; ..; W_k; A_1; ..; A_k], so
each activation is read once; and lora_linear_concat_b (the default), the B
matrices inside the base GEMM instead, along its input (gapless.model.lora gives it the groups of layers that read
one input, and concat's form the layers alone: 1.2% over concat on an H100, run s17-ab; on every layer it ran 0.84%
slower than concat, run s16-ab).

    y = x W^T + b + scaling * (dropout(x) A^T) B^T        x [N, in], W [out, in], A [r, in], B [out, r]

Mixed precision: A and B are stored in float32 (the optimizer's master copy, as PEFT keeps them) but the matmuls
run in x's dtype, as under autocast; casting A and B (~0.1 MB each) is cheap, while casting x to float32 would
move 3x the activation bytes and lose bf16 tensor cores. dA and dB come back in the adapter's dtype.

A third form, one autograd.Function adding the update inside the base GEMMs' epilogues (addmm into the base
output, forward and backward), measured slower in a compiled Llama-3.2-3B step on the H200 (518.7 against 501.2
ms for the reference, bench/RESULTS.md run 20261203T144848Z-9d4119: torch.compile cannot fuse through it) and was
removed (issue shape); its measurement stays in bench/RESULTS.md. lora_linear_concat differs from it: its
autograd.Function is plain torch ops that torch.compile traces and fuses with their neighbours, not an opaque kernel.

Under dropout, concat runs concat_b (grouped until run s17). A fourth form stacked only the frozen q/k/v (gate/up)
weights for one base GEMM beside grouped's dropout A matmul: 33,361 against grouped's 33,991 real tokens/s for
Llama-3.2-3B at dropout 0.05 on the H200 (run s14-default, one call, fa4_op), so it was removed.

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


def _b_grads(grads: Sequence[Tensor | None], outs: tuple[int, ...], xas: Sequence[Tensor], bs: Sequence[Tensor],
             scalings: Sequence[float], b_dtypes: Sequence[torch.dtype]) -> tuple[Tensor, Tensor, list]:
    """Backward through the k layers' B matmuls, y_i += s_i xa_i B_i^T, shared by _ConcatLinear and _ConcatBLinear:
    (dz [N, O] = [dy_1 .. dy_k], the only consumer of the dy_i; dxa [N, R] = [s_i dy_i B_i]; dB_i = s_i dy_i^T xa_i
    in the masters' dtypes). An output nobody used gets None: its slice of dz is zeros and its B no gradient (as
    autograd gives the reference's); its A still gets the group GEMM's zeros."""
    lead = xas[0].shape[:-1]
    unused = [g is None for g in grads]
    grads = [torch.zeros(*lead, o, dtype=xas[0].dtype, device=xas[0].device) if g is None else g
             for g, o in zip(grads, outs)]
    dz = (torch.cat(grads, dim=-1) if len(grads) > 1 else grads[0]).flatten(0, -2)  # [N, O]
    dys = dz.split(outs, dim=-1)  # column slices of dz, which the GEMMs read strided
    dxa = torch.cat([(dy @ b) * s for dy, b, s in zip(dys, bs, scalings)], dim=-1)  # [N, R]
    dbs = [None if u else ((dy.t() @ xa.flatten(0, -2)) * s).to(t)  # each [o_i, r_i]
           for dy, xa, s, t, u in zip(dys, xas, scalings, b_dtypes, unused)]
    return dz, dxa, dbs


class _ConcatLinear(torch.autograd.Function):
    """The k layers of one group, with concat = [W_1; ...; W_k; A_1; ...; A_k] [O + R, in] (frozen W and the A
    rows, in x's dtype): x @ concat^T is ONE GEMM, split into the k base outputs [N, o_i] and the k products
    xa_i = x A_i^T [N, r_i], and each layer's output is base_i + scaling_i * xa_i B_i^T (no bias: the caller adds
    it). The B matmuls are inside so that backward reads each output's gradient dy_i from one place:

        dz = [dy_1 .. dy_k]                          [N, O], the only consumer of the dy_i
        dxa_i = scaling_i * dz[:, o_i] B_i           rank-r GEMMs over column slices of dz
        dB_i = scaling_i * dz[:, o_i]^T xa_i
        dx = dz [W_1; ..; W_k] + [dxa_1 .. dxa_k] [A_1; ..; A_k]
        dA = [dxa_1 .. dxa_k]^T x                    ONE [R, in] GEMM for the group

    With the B matmuls outside (autograd's own mm backward), each dy_i had two consumers, dxa/dB's GEMMs and the
    cat [dy_1 .. dy_k, dxa_1 .. dxa_k] of the one dx GEMM, and inductor wrote each dy_i twice: into the cat and
    contiguous for the GEMMs (537 MB per layer more for gate/up in Llama-3.2-3B at 16,384 tokens). dx as two GEMMs
    adds one [N, in] read where the add fuses into what follows. The frozen W get no gradient. `lora_as` (the
    float32 masters) enter only so that their gradients have somewhere to go: their values are the concat's A
    rows, which the caller keeps current (gapless.model.lora refreshes them before every forward)."""

    @staticmethod
    def forward(ctx, x: Tensor, concat: Tensor, outs: tuple[int, ...], scalings: tuple[float, ...], *adapters: Tensor):
        k = len(outs)
        lora_as, lora_bs = adapters[:k], adapters[k:]
        ranks = tuple(a.shape[0] for a in lora_as)
        parts = F.linear(x, concat).split((*outs, *ranks), dim=-1)  # k base outputs, k products x A^T
        # each x A^T is copied out ([N, r], 0.5 MB at 16,384 tokens, r=16, bf16) to be saved for dB: a saved view
        # would keep the whole [N, O + R] GEMM output alive (537 MB per layer for gate/up in Llama-3.2-3B)
        xas = [p.contiguous() for p in parts[k:]]
        bs = [b.to(x.dtype) for b in lora_bs]
        ctx.save_for_backward(x, concat, *xas, *bs)
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None (backward)
        ctx.outs, ctx.ranks, ctx.scalings = outs, ranks, scalings
        ctx.a_dtypes, ctx.b_dtypes = [a.dtype for a in lora_as], [b.dtype for b in lora_bs]
        return tuple(y + F.linear(xa, b) * s for y, xa, b, s in zip(parts[:k], xas, bs, scalings))

    @staticmethod
    def backward(ctx, *grads: Tensor):
        x, concat, *saved = ctx.saved_tensors
        k, width = len(ctx.outs), sum(ctx.outs)
        dz, dxa, dbs = _b_grads(grads, ctx.outs, saved[:k], saved[k:], ctx.scalings, ctx.b_dtypes)
        dx = None
        if ctx.needs_input_grad[0] and k == 1 and width <= x.shape[-1]:
            # one layer whose output is no wider than its input (o_proj; down_proj, 3,072 against 8,192): copying
            # dy into [dy, dxa] for one GEMM moves fewer bytes than adding a second [N, in] product
            dx = (torch.cat([dz, dxa], dim=-1) @ concat).view(x.shape)
        elif ctx.needs_input_grad[0]:
            dx = (dz @ concat[:width] + dxa @ concat[width:]).view(x.shape)  # [..., in]
        da = (dxa.t() @ x.flatten(0, -2)).split(ctx.ranks)  # [R, in], one GEMM for the group
        return (dx, None, None, None, *(d.to(t) for d, t in zip(da, ctx.a_dtypes)), *dbs)


def lora_linear_concat(x: Tensor, concat: Tensor, biases: Sequence[Tensor | None], lora_as: Sequence[Tensor],
                       lora_bs: Sequence[Tensor], scalings: Sequence[float]) -> list[Tensor]:
    """lora_linear_reference for the k layers that read the same x (q/k/v; gate/up; or one layer alone), the frozen
    projections and the A matrices as ONE GEMM: x [W_1; ..; W_k; A_1; ..; A_k]^T gives every base output and every
    x A_i^T, so x is read once forward (_ConcatLinear, which says how backward reads each output's gradient once).
    Then the rank-r B matmuls and the scaling, inside the Function, and the bias outside; torch.compile traces
    through both and fuses the adds with what follows.

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
        ys = _ConcatLinear.apply(x, concat, tuple(outs), tuple(scalings), *lora_as, *lora_bs)
    else:  # evaluation, generation: plain ops (dynamo cannot trace the Function's forward without autograd)
        parts = F.linear(x, concat).split((*outs, *ranks), dim=-1)
        k = len(outs)
        ys = [y + F.linear(xa, b.to(x.dtype)) * s for y, xa, b, s in zip(parts[:k], parts[k:], lora_bs, scalings)]
    return [y if b is None else y + b for y, b in zip(ys, biases)]


class _ConcatBLinear(torch.autograd.Function):
    """The k layers of one group with their B matrices inside the base GEMM, along its input:

        y = [x, xa_1 .. xa_k] @ buffer^T,   buffer = [[W_1, s_1 B_1, 0, ..], [W_2, 0, s_2 B_2, ..], ..]  [O, in + R]

    where xa_i = x A_i^T (dropout(x) A_i^T under dropout) is computed by the caller (an autograd op, so dA and the
    dx through A are autograd's). The GEMM's output is each layer's whole output: no rank-r B GEMM writes an
    [N, o] product and nothing reads one again, and the consumer of y (SwiGLU, RoPE, the residual add) reads one
    tensor. Backward, with dz = [dy_1 .. dy_k] (the only consumer of the dy_i, as in _ConcatLinear):

        dx = dz [W_1; ..; W_k]                  the buffer's first `in` columns, read strided
        dxa_i = s_i dz[:, o_i] B_i,  dB_i = s_i dz[:, o_i]^T xa_i

    The buffer's B columns hold s_i B_i in x's dtype and must equal the float32 masters `lora_bs` (times s_i) when
    this runs: gapless.model.lora keeps them current; `lora_bs` enter so that their gradients have somewhere to go."""

    @staticmethod
    def forward(ctx, x: Tensor, xa: Tensor, buffer: Tensor, outs: tuple[int, ...], scalings: tuple[float, ...],
                *lora_bs: Tensor):
        # the caller's x A^T is read again here and saved ([N, R]: 1.5 MB at 16,384 tokens and R = 48 in bf16)
        y = F.linear(torch.cat([x, xa], dim=-1), buffer)  # [..., O]
        bs = [b.to(x.dtype) for b in lora_bs]
        ctx.save_for_backward(xa, buffer, *bs)
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None
        ctx.outs, ctx.scalings, ctx.b_dtypes, ctx.width = outs, scalings, [b.dtype for b in lora_bs], x.shape[-1]
        return tuple(y.split(outs, dim=-1))

    @staticmethod
    def backward(ctx, *grads: Tensor):
        xa, buffer, *bs = ctx.saved_tensors
        xas = xa.split([b.shape[1] for b in bs], dim=-1)
        dz, dxa, dbs = _b_grads(grads, ctx.outs, xas, bs, ctx.scalings, ctx.b_dtypes)
        dx = (dz @ buffer[:, :ctx.width]).view(*xa.shape[:-1], ctx.width) if ctx.needs_input_grad[0] else None
        return (dx, dxa.view(xa.shape), None, None, None, *dbs)


def lora_linear_concat_b(x: Tensor, buffer: Tensor, biases: Sequence[Tensor | None], lora_as: Sequence[Tensor],
                         lora_bs: Sequence[Tensor], scalings: Sequence[float],
                         dropout: Callable[[Tensor], Tensor] | None = None) -> list[Tensor]:
    """lora_linear_reference for the k layers that read the same x, the B matrices inside the base GEMM (LoraKernel
    "concat_b"): dropout(x) [A_1; ..; A_k]^T as one rank-R GEMM, then ONE GEMM of [x, dropout(x) A^T] against
    `buffer` [sum out, in + sum r] = the frozen weights with the scaled B matrices appended as columns,
    block-diagonally (_ConcatBLinear), then the biases. Its B columns must equal scaling_i * lora_bs[i] (in x's
    dtype) when this runs: gapless.model.lora keeps them current. Same sums as the reference (float32 on the CPU,
    ~1e-7).

    Dropout fits here, where it cannot in lora_linear_concat: only the rank-R GEMM reads dropout(x), so the base
    GEMM still reads x. ONE mask for the group, as lora_linear_grouped draws it (its docstring; fused in the kernel
    where an nn.Dropout in training on CUDA allows, gapless.kernels.lora_dropout)."""
    outs = [b.shape[0] for b in lora_bs]
    ranks = [a.shape[0] for a in lora_as]
    assert buffer.shape == (sum(outs), x.shape[-1] + sum(ranks)) and buffer.dtype == x.dtype, (
        f"concat_b buffer {tuple(buffer.shape)} {buffer.dtype} does not hold outputs {outs}, input {x.shape[-1]} and "
        f"ranks {ranks} in {x.dtype}")
    if fused_dropout_applies(x, dropout):
        xa = lora_dropout_a(x, list(lora_as), dropout.p)  # [..., R]
    else:
        xd = x if dropout is None else dropout(x)
        xa = F.linear(xd, torch.cat([a.to(x.dtype) for a in lora_as]))  # [..., R]
    if torch.is_grad_enabled():
        ys = _ConcatBLinear.apply(x, xa, buffer, tuple(outs), tuple(scalings), *lora_bs)
    else:  # evaluation, generation: the GEMM alone (dynamo cannot trace the Function's forward without autograd)
        ys = F.linear(torch.cat([x, xa], dim=-1), buffer).split(outs, dim=-1)
    return [y if b is None else y + b for y, b in zip(ys, biases)]
