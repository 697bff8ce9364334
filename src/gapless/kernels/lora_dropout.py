"""LoRA's A matmul under dropout, fused: xa = dropout(x) A^T and its gradients without dropout(x) or its mask ever in
memory.

    xa = (keep * x / (1 - p)) A^T        x [N, in], A [R, in] (a group's A matrices stacked, R = their summed ranks)
    dA = dxa^T (keep * x) / (1 - p)      dx_lora = keep * (dxa A) / (1 - p)

Why: the torch path (lora_linear_grouped and lora_linear_reference with an nn.Dropout) materialises dropout(x) for
the A matmul and saves a bool mask per LoRA input for backward: one [N, in] mask per group (q/k/v; gate/up) and per
lone projection (o_proj, down_proj), 17,408 B per token per Llama-3.2-3B layer, ~285M elements per layer at 16,384
tokens. On the H200 that cost 4.7% of the step (31,615 against 33,182 real tokens/s) and 10 GiB of peak (56.8
against 46.8 GiB; issue 18). Here one Triton kernel reads x and A and applies the mask in registers (forward), and
one kernel draws the mask again from the same seed and gives dA (float32 partials over splits of N, summed) and
dx_lora together (backward): x is read once each way, the mask and dropout(x) are never written, and only x (which
the A gradient needs anyway) and an 8-byte seed are saved.

How the masks are drawn: each forward in training draws a seed, one int64 in [0, 2^62) from torch's generator on
x's device (torch.randint: no host sync; under torch.compile and CUDA graphs it is an ordinary device op), saved for
backward. Element (n, k) of x viewed as [N, in] is kept iff a 16-bit draw u(n, k) >= round(p * 2^16), where u(n, k)
is 16-bit half k % 2 (low half first) of 32-bit word (k % 8) // 2 of Philox-4x32-10 keyed by the seed at counter
n * ceil(in / 8) + k // 8 (Triton's tl.randint4x; lora_dropout_triton.keep_block). So the keep probability is
1 - round(p * 2^16) / 2^16 (0.05: 0.949997, 3e-6 from 1 - p) and kept elements are scaled by exactly 1 / (1 - p), as
nn.Dropout does; one Philox draw serves 8 elements, because the mask is drawn twice (forward and backward) where
torch draws it once and stores it. Masks are per group, as the torch path draws them: the projections that read the
same x share one mask (PEFT draws one per projection: the same distribution per element and the same expected
update, a different sample). torch's own dropout draws from its generator differently, so the two paths keep
different elements for the same torch seed; each is reproducible under torch.manual_seed. With activation
checkpointing the recomputed forward draws the same seed (checkpoint restores the generator's state).

Where it runs: for a FusedDropout (what LoraLinear holds under lora.fused_dropout: true, the default) in training,
on CUDA tensors with triton importable and torch >= 2.6 (torch.library.triton_op, so torch.compile traces the
kernels into its graph with no graph break); the kernels also run on CPU tensors under TRITON_INTERPRET=1 (the
tests). gapless.kernels.lora decides (fused_dropout_applies); everything else keeps the torch path. Measured on one
H100 (Llama-3.2-3B, `default`, 16,384 tokens, run s11-default2): dropout 0.05 fused 32,419 real tokens/s at 46.9
GiB, the torch path 31,534 at 56.9 GiB, no dropout 33,122 at 46.9 GiB (-2.1% against -4.8%).
"""
from __future__ import annotations

import importlib.util

import torch
from torch import Tensor, nn

# torch.library.triton_op arrived in torch 2.6; pyproject allows torch >= 2.5
FUSED_DROPOUT = importlib.util.find_spec("triton") is not None and hasattr(torch.library, "triton_op")
SEED_HIGH = 2 ** 62  # seeds are drawn in [0, SEED_HIGH): any int64 Philox accepts, far from birthday collisions
# Blocks and warps of each kernel, set apart because the keep mask depends only on (seed, row, column), not on the
# blocking: forward and backward may tile differently (bench/dropout_gpu.py times the choices and rewrites these).
# forward: rows of x per program; 64 keeps 256 programs busy at 16,384 tokens (132 SMs on the H100/H200), each
# walking `in` in BLOCK_K columns (a multiple of 8: one Philox draw covers 8 columns), Triton's default 4 warps
FWD_BLOCK_M = 64
FWD_BLOCK_K = 64
FWD_WARPS = 4
# forward: splits of `in` (split-K): FWD_SPLIT_K programs per row block, each summing its share of the columns into
# a float32 partial [N, R], summed after. 1 (no split): over a Llama-3.2-3B layer's four shapes at 16,384 tokens on
# an H100, 2 splits took 0.349 ms and 4 0.359 against 0.348 unsplit (bench/dropout_gpu.py, run s20-drop); only
# down_proj's `in` of 8,192 gained (0.140 against 0.148 ms), q/k/v's lost as much. The forward is bound by its
# Philox draws more than by the loads' latency: 7 rounds took 0.321 ms. The count depends on `in` alone, so a
# symbolic N adds no guard
FWD_SPLIT_K = 1
# backward: each program owns BWD_BLOCK_K columns (its [R, BLOCK_K] slice of dA in registers) over a split of N,
# BWD_BLOCK_M rows at a time; the same 64 x 64 as the forward and 4 warps until measured otherwise
BWD_BLOCK_M = 64
BWD_BLOCK_K = 64
BWD_WARPS = 4
# the backward's grid: ceil(in / BWD_BLOCK_K) column blocks x enough splits of N for about this many programs (~4
# per SM on 132 SMs); each split writes an [R, in] float32 partial of dA, ~0.6 MB per split for R = 48, in = 3072
BACKWARD_PROGRAMS = 512


class FusedDropout(nn.Dropout):
    """An nn.Dropout that asks LoRA's A matmul to draw its mask inside the fused kernels (lora_dropout_a) where they
    run; anywhere else (the CPU, no triton, QLoRA's layers) it is nn.Dropout itself."""


def fused_dropout_applies(x: Tensor, dropout: object) -> bool:
    """Whether lora_dropout_a runs for `dropout` on x: a FusedDropout in training with p > 0, on a CUDA tensor, with
    triton and torch.library.triton_op available. Any other callable (a plain nn.Dropout, nn.Identity, a test's
    fixed mask), eval mode, a CPU tensor or a missing triton keep the torch path."""
    return (FUSED_DROPOUT and x.is_cuda and isinstance(dropout, FusedDropout) and dropout.training
            and dropout.p > 0)


def keep_threshold(p: float) -> int:
    """The 16-bit threshold a draw must reach to keep its element (module docstring)."""
    threshold = round(p * 2 ** 16)
    assert 0 < threshold < 2 ** 16, f"dropout p={p} rounds to {threshold}/65536: outside (0, 1) at 16 bits"
    return threshold


def draw_seed(device: torch.device) -> Tensor:
    """One int64 seed [1] on `device` from torch's generator (no host sync)."""
    return torch.randint(SEED_HIGH, (1,), device=device, dtype=torch.int64)


def lora_dropout_a(x: Tensor, lora_as: list[Tensor], p: float) -> Tensor:
    """dropout(x) [A_1; ..; A_k]^T [..., sum r] in x's dtype, fused (module docstring), under a new seed: the
    group's A matrices stacked in their own dtype (the float32 masters, cast in the kernel), so their gradients come
    back from float32 sums in that dtype."""
    a = lora_as[0] if len(lora_as) == 1 else torch.cat(list(lora_as))  # [R, in]
    seed = draw_seed(x.device)
    return torch.ops.gapless.lora_dropout_xa(x.reshape(-1, x.shape[-1]), a, seed, p).view(*x.shape[:-1], -1)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _backward_splits(n: int, k: int, block_m: int, block_k: int, programs: int) -> tuple[int, int]:
    """(splits of N, rows per split, a multiple of block_m) for about `programs` programs (the library passes
    BWD_BLOCK_M, BWD_BLOCK_K and BACKWARD_PROGRAMS; bench/dropout_gpu.py its variants'). The count depends on `in`
    alone, so a symbolic N (torch.compile's dynamic shapes) adds no guard; a split past N writes zeros."""
    splits = max(1, programs // _cdiv(k, block_k))
    return splits, _cdiv(_cdiv(n, block_m), splits) * block_m


def _forward_splits(k: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(splits of `in`, columns per split, a multiple of block_k) for about split_k splits (the library passes
    FWD_BLOCK_K and FWD_SPLIT_K; bench/dropout_gpu.py its variants')."""
    per_split = _cdiv(_cdiv(k, block_k), split_k) * block_k
    return _cdiv(k, per_split), per_split


def _block_r(r: int) -> int:
    return max(16, 1 << (r - 1).bit_length())  # tl.dot's smallest tile is 16


if FUSED_DROPOUT:
    from torch.library import triton_op, wrap_triton

    from gapless.kernels import lora_dropout_triton as kernels

    @triton_op("gapless::lora_dropout_xa", mutates_args=())
    def lora_dropout_xa(x: Tensor, a: Tensor, seed: Tensor, p: float) -> Tensor:
        """xa [N, R] = (keep * x / (1 - p)) A^T for x [N, in], A [R, in], the mask drawn from seed [1] (int64)."""
        x = x.contiguous()
        a = a.contiguous()
        (n, k), r = x.shape, a.shape[0]
        splits, per_split = _forward_splits(k, FWD_BLOCK_K, FWD_SPLIT_K)
        out = x.new_empty(n, r) if splits == 1 else x.new_empty(splits, n, r, dtype=torch.float32)
        wrap_triton(kernels.dropout_xa_kernel)[(_cdiv(n, FWD_BLOCK_M), splits)](
            x, a, out, seed, n, k, r, per_split, keep_threshold(p), 1.0 / (1.0 - p), BLOCK_M=FWD_BLOCK_M,
            BLOCK_K=FWD_BLOCK_K, BLOCK_R=_block_r(r), IEEE=x.dtype == torch.float32, N_ROUNDS=kernels.PHILOX_ROUNDS,
            num_warps=FWD_WARPS)
        return out if splits == 1 else out.sum(0).to(x.dtype)

    @triton_op("gapless::lora_dropout_xa_backward", mutates_args=())
    def lora_dropout_xa_backward(dxa: Tensor, x: Tensor, a: Tensor, seed: Tensor, p: float,
                                 need_dx: bool) -> tuple[Tensor, Tensor]:
        """(dx_lora [N, in] in x's dtype, or an empty tensor without need_dx; dA [R, in] in A's dtype) for
        lora_dropout_xa, the mask drawn again from the same seed."""
        dxa, x, a = dxa.contiguous(), x.contiguous(), a.contiguous()
        (n, k), r = x.shape, a.shape[0]
        splits, rows_per_split = _backward_splits(n, k, BWD_BLOCK_M, BWD_BLOCK_K, BACKWARD_PROGRAMS)
        dx = torch.empty_like(x) if need_dx else x.new_empty(0)
        partials = x.new_empty(splits, r, k, dtype=torch.float32)  # [S, R, in]
        wrap_triton(kernels.dropout_xa_backward_kernel)[(_cdiv(k, BWD_BLOCK_K), splits)](
            x, a, dxa, dx, partials, seed, n, k, r, rows_per_split, keep_threshold(p), 1.0 / (1.0 - p),
            BLOCK_M=BWD_BLOCK_M, BLOCK_K=BWD_BLOCK_K, BLOCK_R=_block_r(r), NEED_DX=need_dx,
            IEEE=x.dtype == torch.float32, N_ROUNDS=kernels.PHILOX_ROUNDS, num_warps=BWD_WARPS)
        return dx, partials.sum(0).to(a.dtype)

    def _setup_context(ctx, inputs, output):
        x, a, seed, p = inputs
        ctx.save_for_backward(x, a, seed)
        ctx.p = p

    def _backward(ctx, dxa):
        x, a, seed = ctx.saved_tensors
        dx, da = lora_dropout_xa_backward(dxa, x, a, seed, ctx.p, ctx.needs_input_grad[0])
        return (dx if ctx.needs_input_grad[0] else None, da if ctx.needs_input_grad[1] else None, None, None)

    lora_dropout_xa.register_autograd(_backward, setup_context=_setup_context)
