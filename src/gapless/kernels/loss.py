"""Cross-entropy fused with the LM head: the [tokens, vocab] logits never exist all at once.

    linear_cross_entropy(hidden [N, D], weight [V, D], targets [N]) -> sum over non-ignored tokens of
        logsumexp(y) - y[target],   y = hidden @ weight.T   (or softcap * tanh(hidden @ weight.T / softcap))

`softcap` (Gemma 2's final_logit_softcapping, 30): the logits z are squashed to y = c * tanh(z / c) before the
softmax, as transformers' Gemma2ForCausalLM does; the gradient through it is dL/dz = (softmax(y) - onehot) *
(1 - tanh(z / c)^2). The eager and compiled steps keep the tanh for that factor, one more float32 [chunk, V]
buffer per chunk: 2 GiB at 2048 tokens and Gemma's V = 262,144 (the Triton step computes it again instead).

The loss is a SUM: the training loop divides by the real-token count of the whole optimizer step, so the
sums of its micro-batches add up to the step's loss (a mean per micro-batch would weight them wrongly).

How: an autograd.Function walks the tokens in chunks of `chunk_size`. For each chunk it computes the logits
[c, V] in float32 (a bf16 GEMM with fp32 output on CUDA), the loss, and at once the gradient of the loss with
respect to the logits, softmax - onehot, cast back to the input dtype; two more GEMMs turn that into the
chunk's rows of grad_hidden (g @ W) and its share of grad_weight (g.T @ h, accumulated in float32). Only
grad_hidden [N, D] and grad_weight [V, D] are kept; backward just scales them by grad_output. When the weight
is frozen (LoRA: the LM head never trains) the grad_weight GEMM is skipped: 2 GEMMs instead of 3.

Memory: the transient per chunk is the fp32 logits plus their gradient in the input dtype,
chunk * V * (4 + 2) bytes for bf16: 1.5 GiB at the default 2048 tokens and V = 128256 (Llama 3), against
N * V * (2 + 4 + 4) bytes = 20 GiB for materialised bf16 logits, their fp32 copy and its gradient at
N = 16384. The transient sits on top of every saved activation at the end of the forward, where a step peaks:
on the H200 (Llama-3.2-3B LoRA, 16,384 tokens a step, bench/RESULTS.md run s3-fa4op) chunks of 2048 peaked at
46.8 GiB against 48.2 for 4096, at the same speed (34,591 vs 34,626 tokens/s; 473.6 vs 473.1 ms a step).
Plus grad_hidden (N * D in the input dtype) and, when the weight trains, grad_weight in fp32 (V * D * 4 bytes =
1.5 GiB for Llama-3.2-3B).

FLOPs: 2 * N * V * D per GEMM, so 4 * N * V * D with a frozen head and 6 * N * V * D when it trains (the
softmax work is memory-bound: a few passes over chunk * V floats).

The per-chunk softmax/gradient step (`step`; the GEMMs are cuBLAS whichever runs) is memory-bound: chunk * V
float32 logits, 1 GiB per chunk of 2048 at V = 128,256, read and turned into a bf16 gradient; a step of 16,384
tokens has 8.4 GB of them, one read of which takes 2.5 ms at the H100's 3.35 TB/s.
- "eager": in-place torch ops, a kernel each for the logsumexp, the gather, the subtraction, exp, the one-hot
  scatter and the cast: about 30 bytes per logit.
- "compiled": the same step (_step_functional) through torch.compile, which fuses it into one reduction and one
  pointwise kernel. Profiled on the H100 (Llama-3.2-3B, 16,384 tokens a step): the pointwise kernel took 3.8 ms a
  step, at bandwidth (a read of 4 and a write of 2 bytes per logit), but the reduction 9.7 ms, the time of about
  four reads.
- "triton": one hand-written kernel per chunk (gapless.kernels.loss_triton), one program per row: a first pass
  over the row keeps an online max and sum of exp (the logsumexp; the target logit is read alone), a second pass
  writes softmax - onehot in the input dtype. 4 + 4 + 2 = 10 bytes per logit for bf16, its floor 6.3 ms a step
  against the compiled step's 13.5. Measured on an H100 (bench/RESULTS.md, thirteenth round): 0.698 ms a chunk
  of [2048, 128,256] against the compiled step's 1.218, 3,764 GB/s counted at 10 bytes a logit, above the card's
  3.35 TB/s, so part of the second read hits L2; a Llama-3.2-3B step 3.5 ms shorter in one process (34,787
  against 34,526 real tok/s, run s16-ab). Block sizes 2,048-32,768 and 4-32 warps all took 0.675-0.719 ms. One
  kernel rather than a reduction and a pointwise kernel: the
  logsumexp stays in registers between the passes, and a row's second read follows its first within one
  program, so whatever of the row L2 still holds is read from there; two kernels move at least the same 10 bytes
  with no chance of that. The row count only sizes the grid, so the shorter last chunk compiles nothing new.
  With softcap it computes tanh again in the second pass rather than keep it. CUDA only (triton); a float32
  gradient is written over the logits, as the eager step does.
- "auto": "triton" where the logits are on CUDA and triton imports, else "compiled"
  (gapless.train.compile.compile_layers sets it).
"""
from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F
from torch import Tensor

DEFAULT_CHUNK_SIZE = 2048
STEPS = ("eager", "compiled", "triton", "auto")  # the per-chunk step (module docstring)
TRITON = importlib.util.find_spec("triton") is not None
# the triton step's launch: 4096 float32 logits (16 KiB) per block, 8 warps, so 16 per thread, four 16-byte loads
# each; 32 registers a thread for bf16 output without softcap (ptxas -v of triton 3.6's sm_90 build), so 8 programs
# of 256 threads fit an SM. Llama 3's row of 128,256 is 31.3 blocks.
TRITON_BLOCK_V = 4096
TRITON_NUM_WARPS = 8


def reference_linear_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, *, reduction: str = "sum",
                                   ignore_index: int = -100, softcap: float | None = None) -> Tensor:
    """The plain-PyTorch reference: full float32 logits (soft-capped when asked), then F.cross_entropy."""
    logits = hidden.float() @ weight.float().t()  # [N, V], materialised
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits, targets.long(), ignore_index=ignore_index, reduction=reduction)


def linear_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, *, chunk_size: int = DEFAULT_CHUNK_SIZE,
                         reduction: str = "sum", ignore_index: int = -100, step: str = "eager",
                         softcap: float | None = None) -> Tensor:
    """Cross-entropy of (hidden @ weight.T) against targets, chunked over tokens; a float32 scalar.

    reduction: "sum" over non-ignored targets (what the training loop wants), or "mean" over them (NaN when
    every target is ignored, like F.cross_entropy). step: how each chunk's softmax and gradient run, "eager",
    "compiled", "triton" or "auto" (module docstring).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden must be [N, D] and weight [V, D], got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be [N] = [{hidden.shape[0]}], got {tuple(targets.shape)}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden and weight must share a dtype, got {hidden.dtype} and {weight.dtype}")
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be a positive number (the logits' bound) or None, got {softcap}")
    step = resolve_step(step, hidden.device)
    grad_on = torch.is_grad_enabled()
    loss = _LinearCrossEntropy.apply(hidden, weight, targets.long(), chunk_size, ignore_index, step,
                                     grad_on and hidden.requires_grad, grad_on and weight.requires_grad,
                                     None if softcap is None else float(softcap))
    if reduction == "mean":
        return loss / (targets != ignore_index).sum()
    return loss


def resolve_step(step: str, device: torch.device) -> str:
    """The per-chunk step that runs for `step` on `device`: "auto" is "triton" on CUDA where triton imports, else
    "compiled"; a named step runs as named, and "triton" where it cannot is an error."""
    if step not in STEPS:
        raise ValueError(f"step must be one of {', '.join(map(repr, STEPS))}, got {step!r}")
    if step == "auto":
        return "triton" if device.type == "cuda" and TRITON else "compiled"
    if step == "triton" and device.type != "cuda":
        raise ValueError(f"step 'triton' is a CUDA kernel, but hidden is on {device}: use step 'auto' (torch.compile "
                         "off CUDA), 'compiled' or 'eager'")
    if step == "triton" and not TRITON:
        raise ValueError("step 'triton' needs the triton package, which is not installed here (torch's CUDA wheels "
                         "bring it): install it, or use step 'auto', 'compiled' or 'eager'")
    return step


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, chunk_size: int, ignore_index: int,
                step: str, need_hidden: bool, need_weight: bool, softcap: float | None) -> Tensor:
        N, D = hidden.shape
        V = weight.shape[0]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight: Tensor | None = None  # float32 [V, D], created by the first chunk's GEMM
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        step_fn = _compiled_step() if step == "compiled" else {"eager": _step_eager, "triton": _step_triton}[step]
        for s in range(0, N, chunk_size):
            h, t = hidden[s:s + chunk_size], targets[s:s + chunk_size]  # [c, D], [c]
            logits = _mm_f32(h, weight.t())  # [c, V] float32
            if not (need_hidden or need_weight):
                loss += _chunk_loss(logits if softcap is None else torch.tanh(logits / softcap) * softcap, t,
                                    ignore_index)
                continue
            chunk_loss, g = step_fn(logits, t, ignore_index, hidden.dtype, softcap)  # g: [c, V] in the input dtype
            loss += chunk_loss
            if grad_hidden is not None:
                torch.mm(g, weight, out=grad_hidden[s:s + chunk_size])  # [c, V] @ [V, D] -> [c, D]
            if need_weight:
                gw = _mm_f32(g.t(), h)  # [V, c] @ [c, D] -> [V, D] float32
                grad_weight = gw if grad_weight is None else grad_weight.add_(gw)
            del logits, g
        if need_weight and grad_weight is None:  # N == 0
            grad_weight = torch.zeros(V, D, dtype=torch.float32, device=weight.device)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        gh = None if grad_hidden is None else grad_hidden * grad_output.to(grad_hidden.dtype)
        gw = None if grad_weight is None else (grad_weight * grad_output).to(ctx.weight_dtype)
        return gh, gw, None, None, None, None, None, None, None


def _mm_f32(a: Tensor, b: Tensor) -> Tensor:
    """a @ b as float32, accumulated in float32."""
    if a.dtype == torch.float32:
        return torch.mm(a, b)
    if a.is_cuda:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)  # cuBLAS writes fp32 directly (torch >= 2.8)
        except TypeError:  # an older torch without the mm.dtype overload
            pass
    # the CPU has no mm.dtype kernel (torch 2.13): round the fp32-accumulated product to the input dtype
    return torch.mm(a, b).float()


def _chunk_loss(logits: Tensor, targets: Tensor, ignore_index: int) -> Tensor:
    valid = targets != ignore_index
    t = torch.where(valid, targets, 0)
    target_logit = logits.gather(1, t[:, None]).squeeze(1)
    return torch.where(valid, torch.logsumexp(logits, dim=-1) - target_logit, 0.0).sum()


def _step_eager(logits: Tensor, targets: Tensor, ignore_index: int, dtype: torch.dtype,
                softcap: float | None = None) -> tuple[Tensor, Tensor]:
    """(loss sum, d loss / d logits in `dtype`) for one chunk; overwrites `logits` to keep one [c, V] buffer (two
    with softcap: the tanh is kept for the gradient's factor 1 - tanh^2)."""
    tanh = None
    if softcap is not None:
        tanh = torch.tanh(logits / softcap)
        torch.mul(tanh, softcap, out=logits)  # the capped logits y, in place of z
    valid = targets != ignore_index
    t = torch.where(valid, targets, 0)  # [c]; ignored rows point at class 0 with weight 0
    lse = torch.logsumexp(logits, dim=-1)  # [c]
    target_logit = logits.gather(1, t[:, None]).squeeze(1)
    loss = torch.where(valid, lse - target_logit, 0.0).sum()
    # softmax in place; an ignored row subtracts +inf, so exp gives exactly 0 there: no gradient, no extra pass
    logits.sub_(torch.where(valid, lse, torch.inf)[:, None]).exp_()
    rows = torch.arange(logits.shape[0], device=logits.device)
    logits.index_put_((rows, t), -valid.to(logits.dtype), accumulate=True)  # softmax - onehot
    if tanh is not None:  # chain rule through y = c * tanh(z / c): dy/dz = 1 - tanh^2
        logits.mul_(tanh.mul_(tanh).neg_().add_(1))
    return loss, logits.to(dtype)


def _step_functional(logits: Tensor, targets: Tensor, ignore_index: int, dtype: torch.dtype,
                     softcap: float | None = None) -> tuple[Tensor, Tensor]:
    """The same step without in-place ops, for torch.compile: one reduction kernel, one pointwise kernel."""
    tanh = None
    if softcap is not None:
        tanh = torch.tanh(logits / softcap)
        logits = tanh * softcap
    valid = targets != ignore_index
    t = torch.where(valid, targets, 0)
    lse = torch.logsumexp(logits, dim=-1)
    target_logit = logits.gather(1, t[:, None]).squeeze(1)
    loss = torch.where(valid, lse - target_logit, 0.0).sum()
    probs = torch.exp(logits - torch.where(valid, lse, torch.inf)[:, None])
    onehot = (torch.arange(logits.shape[1], device=logits.device)[None, :] == t[:, None]) & valid[:, None]
    g = probs - onehot.to(probs.dtype)
    if tanh is not None:
        g = g * (1 - tanh * tanh)
    return loss, g.to(dtype)


def _step_triton(logits: Tensor, targets: Tensor, ignore_index: int, dtype: torch.dtype,
                 softcap: float | None = None, *, block_v: int = TRITON_BLOCK_V,
                 num_warps: int = TRITON_NUM_WARPS) -> tuple[Tensor, Tensor]:
    """The same step as one Triton kernel on CUDA tensors (module docstring; gapless.kernels.loss_triton): each row's
    loss into a float32 [c] buffer, summed here, and the gradient into a new [c, V] buffer in `dtype`, or over
    `logits` when `dtype` is float32, as _step_eager does.

    A plain launch, not a torch.library.triton_op as gapless.kernels.lora_dropout's kernels are: this step runs
    inside _LinearCrossEntropy.forward, which no torch.compile traces (compile_layers compiles the decoder layers,
    and the loss runs eagerly after them), so an op registration would only add dispatch; dynamo traces a plain
    launch of a user-defined Triton kernel as well (torch >= 2.3), if the loss is ever compiled. It runs on the
    current CUDA device's current stream, where the logits' GEMM ran (gapless.train.parallel sets each rank's
    device). block_v (a power of two) and num_warps: the launch, for bench/kernels_gpu.py to sweep."""
    from gapless.kernels import loss_triton

    assert logits.dtype == torch.float32 and logits.is_contiguous(), (logits.dtype, logits.stride())
    assert targets.dtype == torch.int64 and targets.is_contiguous() and targets.shape == logits.shape[:1]
    rows, V = logits.shape
    grad = logits if dtype == torch.float32 else torch.empty_like(logits, dtype=dtype)
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    loss_triton.cross_entropy_grad_kernel[(rows,)](
        logits, targets, loss, grad, V, ignore_index, 1.0 if softcap is None else softcap,
        SOFTCAP=softcap is not None, BLOCK_V=block_v, num_warps=num_warps)
    return loss.sum(), grad


@functools.cache
def _compiled_step():
    # compiled once per process; the last, shorter chunk of a step compiles a second shape (dynamic=False)
    return torch.compile(_step_functional, dynamic=False)
