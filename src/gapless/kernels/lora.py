"""LoRA's linear layer in two forms (LoraConfig.kernel picks one; gapless.config says what each measured):
lora_linear_reference, the plain formula, one layer at a time; and lora_linear_grouped, the same formula for the
layers that read the same input (q/k/v; gate/up) with their A matrices as one matmul (the default).

    y = x W^T + b + scaling * (dropout(x) A^T) B^T        x [N, in], W [out, in], A [r, in], B [out, r]

Mixed precision: A and B are stored in float32 (the optimizer's master copy, as PEFT keeps them) but the matmuls
run in x's dtype, as under autocast; casting A and B (~0.1 MB each) is cheap, while casting x to float32 would
move 3x the activation bytes and lose bf16 tensor cores. dA and dB come back in the adapter's dtype.

A third form, one autograd.Function adding the update inside the base GEMMs' epilogues (addmm into the base
output, forward and backward), measured slower in a compiled Llama-3.2-3B step on the H200 (518.7 against 501.2
ms for the reference, bench/RESULTS.md run 20261203T144848Z-9d4119: torch.compile cannot fuse through it) and was
removed (issue shape); its measurement stays in bench/RESULTS.md.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


def lora_linear_reference(x: Tensor, weight: Tensor, bias: Tensor | None, lora_a: Tensor, lora_b: Tensor,
                          scaling: float, dropout: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """The plain-PyTorch formula, x W^T + b + scaling * B A dropout(x), differentiated by autograd.

    The reference that the grouped form is tested against, and the path of the layers that run alone.
    """
    xd = x if dropout is None else dropout(x)
    update = F.linear(F.linear(xd, lora_a.to(x.dtype)), lora_b.to(x.dtype))  # [..., r] then [..., out]
    return F.linear(x, weight, bias) + update * scaling


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
    different sample). Each layer's output equals lora_linear_reference under that same mask exactly.
    """
    xd = x if dropout is None else dropout(x)
    a = torch.cat([lora_a.to(x.dtype) for lora_a in lora_as])  # [sum r, in]
    xas = F.linear(xd, a).split([lora_a.shape[0] for lora_a in lora_as], dim=-1)  # each [..., r]
    return [F.linear(x, w, b) + F.linear(xa, lora_b.to(x.dtype)) * scaling
            for w, b, xa, lora_b, scaling in zip(weights, biases, xas, lora_bs, scalings)]
