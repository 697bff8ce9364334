"""The Triton kernels behind gapless.kernels.lora_dropout: LoRA's A matmul under dropout with the keep mask drawn in
registers, forward and backward. Imported only where triton imports (gapless.kernels.lora_dropout says when they run
and how the mask is drawn: keep_block is that rule, written once for both kernels).

Shapes: x [N, K] and dx [N, K] row-major in the compute dtype, A [R, K] in any float dtype (cast to x's dtype in
registers, as F.linear(x, A.to(x.dtype)) would), xa and dxa [N, R] row-major, dA partials [S, R, K] float32.
BLOCK_K must be a multiple of 8 (one Philox draw covers 8 consecutive columns of a row) and BLOCK_R a power of two
>= 16 (tl.dot's smallest tile), rows R..BLOCK_R masked to zero.
"""
from __future__ import annotations

import triton
import triton.language as tl

# Philox-4x32 rounds: 10, Triton's and cuRAND's default (Salmon et al. 2011, "Parallel random numbers: as easy as
# 1, 2, 3", Table 2: 7 rounds already pass BigCrush; 10 is their recommended margin)
PHILOX_ROUNDS = 10
# keep iff a 16-bit draw >= round(p * 2^16): p is resolved to 2^-16 (0.05 keeps 1 - 3277/65536 = 0.949997)
KEEP_BITS = 16


@triton.jit
def keep_block(seed, rows, k0, words_per_row, threshold, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
               N_ROUNDS: tl.constexpr):
    """The keep mask [BLOCK_M, BLOCK_K] of rows `rows` [BLOCK_M] (int64) and columns k0 .. k0 + BLOCK_K - 1 (k0 a
    multiple of 8): element (n, k) is kept iff bits >= threshold, where bits is 16-bit half k % 2 (low half first)
    of 32-bit word (k % 8) // 2 of Philox-4x32(key = seed, counter = n * ceil(K / 8) + k // 8)."""
    words = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    counter = rows[:, None] * words_per_row + words[None, :]  # [BLOCK_M, BLOCK_K / 8], int64
    r0, r1, r2, r3 = tl.randint4x(seed, counter, N_ROUNDS)  # each [BLOCK_M, BLOCK_K / 8] uint32
    # join(join(r0, r2), join(r1, r3)) [BLOCK_M, BLOCK_K / 8, 2, 2]: element [.., i, j] is word 2 i + j, so the last
    # two dims flatten to r0 r1 r2 r3; then each word's halves, low first. Joins, not a tl.where per word: the same
    # mask bit for bit, 0.39 against 1.20 ms for the masks of one Llama-3.2-3B layer alone on the H100
    # (bench/dropout_gpu.py, run s19-drop)
    r = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), (BLOCK_M, BLOCK_K // 8, 4))
    bits = tl.join(r & 0xFFFF, r >> 16)  # [BLOCK_M, BLOCK_K / 8, 4, 2]
    return tl.reshape(bits.to(tl.int32), (BLOCK_M, BLOCK_K)) >= threshold


@triton.jit
def dropout_xa_kernel(x_ptr, a_ptr, out_ptr, seed_ptr, N, K, R, k_per_split, threshold, scale, BLOCK_M: tl.constexpr,
                      BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, IEEE: tl.constexpr, N_ROUNDS: tl.constexpr):
    """xa [N, R] = (keep * x / (1 - p)) A^T for one block of BLOCK_M rows (program_id(0)) over columns split
    program_id(1) (k_per_split columns, a multiple of BLOCK_K): x is read once, the mask never leaves registers, and
    1 / (1 - p) (`scale`) is applied to the float32 sum. Split s writes out[s] of out [splits, N, R] (one split: out
    is xa itself, in its dtype)."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    split = tl.program_id(1)
    rs = tl.arange(0, BLOCK_R)
    seed = tl.load(seed_ptr)
    words_per_row = tl.cdiv(K, 8)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    k_start = split * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=(rows[:, None] < N) & (cols[None, :] < K),
                    other=0.0)
        keep = keep_block(seed, rows, k0, words_per_row, threshold, BLOCK_M, BLOCK_K, N_ROUNDS)
        x = tl.where(keep, x, tl.zeros_like(x))
        a = tl.load(a_ptr + rs[None, :] * K + cols[:, None], mask=(rs[None, :] < R) & (cols[:, None] < K),
                    other=0.0).to(x.dtype)  # [BLOCK_K, BLOCK_R], A^T
        if IEEE:
            acc = tl.dot(x, a, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, a, acc)
    out_ptr += split.to(tl.int64) * N * R
    tl.store(out_ptr + rows[:, None] * R + rs[None, :], (acc * scale).to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < N) & (rs[None, :] < R))


@triton.jit
def dropout_xa_backward_kernel(x_ptr, a_ptr, dxa_ptr, dx_ptr, da_ptr, seed_ptr, N, K, R, rows_per_split, threshold,
                               scale, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                               NEED_DX: tl.constexpr, IEEE: tl.constexpr, N_ROUNDS: tl.constexpr):
    """For columns block program_id(0) and rows split program_id(1) (rows_per_split rows, a multiple of BLOCK_M):
    the split's partial dA [R, BLOCK_K] = dxa^T (keep * x) / (1 - p) into da_ptr[split] (float32), and, with
    NEED_DX, dx = keep * (dxa A) / (1 - p) for the same rows and columns. One mask draw serves both: x and the mask
    are read and drawn once for the whole backward."""
    cols = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    split = tl.program_id(1)
    rs = tl.arange(0, BLOCK_R)
    seed = tl.load(seed_ptr)
    words_per_row = tl.cdiv(K, 8)
    col_ok = cols < K
    a = tl.load(a_ptr + rs[:, None] * K + cols[None, :], mask=(rs[:, None] < R) & col_ok[None, :],
                other=0.0).to(x_ptr.dtype.element_ty)  # [BLOCK_R, BLOCK_K]
    acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
    start = split * rows_per_split
    for m0 in range(start, tl.minimum(start + rows_per_split, N), BLOCK_M):
        rows = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        ok = (rows[:, None] < N) & col_ok[None, :]
        x = tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=ok, other=0.0)
        keep = keep_block(seed, rows, tl.program_id(0) * BLOCK_K, words_per_row, threshold, BLOCK_M, BLOCK_K,
                          N_ROUNDS)
        dxa = tl.load(dxa_ptr + rows[:, None] * R + rs[None, :], mask=(rows[:, None] < N) & (rs[None, :] < R),
                      other=0.0)  # [BLOCK_M, BLOCK_R]
        x = tl.where(keep, x, tl.zeros_like(x))
        if IEEE:
            acc = tl.dot(tl.trans(dxa), x, acc, input_precision="ieee")
        else:
            acc = tl.dot(tl.trans(dxa), x, acc)
        if NEED_DX:
            if IEEE:
                dx = tl.dot(dxa, a, input_precision="ieee")
            else:
                dx = tl.dot(dxa, a)  # [BLOCK_M, BLOCK_K] float32
            tl.store(dx_ptr + rows[:, None] * K + cols[None, :],
                     tl.where(keep, dx * scale, 0.0).to(dx_ptr.dtype.element_ty), mask=ok)
    tl.store(da_ptr + split * R * K + rs[:, None] * K + cols[None, :], acc * scale,
             mask=(rs[:, None] < R) & col_ok[None, :])
