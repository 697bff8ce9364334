"""The Triton kernel behind gapless.kernels.loss's "triton" step: a chunk's loss and d loss / d logits in one kernel.
Imported only where triton imports (gapless.kernels.loss._step_triton imports it when the step first runs).

Shapes: logits [rows, V] float32, contiguous; targets [rows] int64; loss [rows] float32; grad [rows, V] contiguous in
the output dtype (bf16, fp16 or fp32). grad may be the logits buffer itself: each element is read, then written, by
the same program, and the second pass reads a block before it writes it.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tanh(x):
    """tanh in float32 from exp: 1 - 2 / (exp(2x) + 1). Triton has no tl.tanh, and libdevice's tanh moved between
    versions (tl.math.tanh in 2.x, triton.language.extra.libdevice from 3.0); exp is in every version and in the
    interpreter. exp(2x) overflows to inf above x = 44 (tanh exactly 1) and underflows to 0 below -52 (exactly -1),
    so no NaN; near 0 the subtraction leaves an absolute error of about 1e-7 (float32's epsilon), what the softmax
    sees: 3e-6 of a logit at Gemma 2's cap of 30."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def cross_entropy_grad_kernel(logits_ptr, targets_ptr, loss_ptr, grad_ptr, n_cols, ignore_index, softcap,
                              SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr):
    """For row r = program_id(0), with y the row's logits z (or softcap * tanh(z / softcap) with SOFTCAP):
    loss[r] = logsumexp(y) - y[target] and grad[r] = softmax(y) - onehot(target) (times 1 - tanh(z / softcap)^2 with
    SOFTCAP: the chain rule through the cap), cast to grad's dtype; loss 0 and grad exactly 0 where target is
    ignore_index (the row is not read). Two passes over the row in blocks of BLOCK_V: the first keeps an online max
    m and sum s of exp(y - m) (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"), the second
    writes the gradient from lse = m + log(s). A target outside [0, V) other than ignore_index is not checked (the
    eager step's gather asserts on it), except under TRITON_DEBUG=1."""
    row = tl.program_id(0).to(tl.int64)
    # int64 offsets: rows * V passes 2^31 at 16,744 rows of Llama 3's V = 128,256
    logits_ptr += row * n_cols
    grad_ptr += row * n_cols
    target = tl.load(targets_ptr + row)
    cols = tl.arange(0, BLOCK_V)
    if target == ignore_index:
        zeros = tl.zeros((BLOCK_V,), dtype=grad_ptr.dtype.element_ty)
        for v0 in range(0, n_cols, BLOCK_V):
            tl.store(grad_ptr + v0 + cols, zeros, mask=v0 + cols < n_cols)
        tl.store(loss_ptr + row, 0.0)
    else:
        tl.device_assert((target >= 0) & (target < n_cols), "target outside [0, V) and not ignore_index")
        # read before the first pass, whose block reductions synchronise the warps: when grad is the logits buffer,
        # another warp writes this element's gradient in the second pass
        y_target = tl.load(logits_ptr + target)
        if SOFTCAP:
            y_target = softcap * tanh(y_target / softcap)  # the same float ops as the blocks', so the same value
        m = float("-inf")  # the running max of y
        s = 0.0  # the running sum of exp(y - m)
        for v0 in range(0, n_cols, BLOCK_V):
            ok = v0 + cols < n_cols
            y = tl.load(logits_ptr + v0 + cols, mask=ok, other=0.0)
            if SOFTCAP:
                y = softcap * tanh(y / softcap)
            y = tl.where(ok, y, float("-inf"))  # after the cap: tanh would turn a -inf fill into -softcap
            m_new = tl.maximum(m, tl.max(y, axis=0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(y - m_new), axis=0)  # exp(-inf) = 0 on the first block
            m = m_new
        lse = m + tl.log(s)
        tl.store(loss_ptr + row, lse - y_target)
        for v0 in range(0, n_cols, BLOCK_V):
            ok = v0 + cols < n_cols
            z = tl.load(logits_ptr + v0 + cols, mask=ok, other=0.0)
            if SOFTCAP:
                t = tanh(z / softcap)
                p = tl.exp(softcap * t - lse)
                g = tl.where(v0 + cols == target, p - 1.0, p) * (1.0 - t * t)
            else:
                p = tl.exp(z - lse)
                g = tl.where(v0 + cols == target, p - 1.0, p)
            tl.store(grad_ptr + v0 + cols, g.to(grad_ptr.dtype.element_ty), mask=ok)
