"""Where the fused LoRA dropout kernels' time goes (issue 18: dropout 0.05 costs 4.2-4.6% of a Llama-3.2-3B step on an
H100, the target is 3%): the forward and the backward of gapless.kernels.lora_dropout_triton timed at the library's
blocks and warps with three masks, on Llama-3.2-3B's four LoRA A shapes at 16,384 tokens (not yet run on a GPU).

    PYTHONPATH=src python3 bench/dropout_probe.py [--tokens 16384] [--out FILE]
    TRITON_INTERPRET=1 PYTHONPATH=src python bench/dropout_probe.py --smoke    # CPU: tiny shapes, checks only

Masks:
- philox: the library's (lora_dropout_triton.keep_block: Philox-4x32, 16-bit halves laid out by joins);
- hash: one 32-bit multiply per element of (row * in + column) + seed, in the tile's own layout (no joins, no
  Philox): a mask as cheap as a mask can be, not one to train with;
- none: every element kept (the compiler drops the select): the kernels' structure alone, the loads and the dots.
Beside them, the traffic floors (x read once; x read and dx written) from a copy of x.

How to read it: philox against hash is what the Philox draws and their unpacking cost; hash against none is what any
mask costs by standing between the loads and the dots (x through registers instead of straight to the dot); none
against the floor is the kernels' structure (the grid, the blocks, the small-R dots). The largest gap is where a
redesign pays.

--smoke checks, under Triton's interpreter, that the philox variant equals the library's launches bit for bit, and
that `none` equals x A^T (forward) and dxa A with dA = dxa^T x (backward) within float32 tolerance.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from gapless.kernels import lora_dropout  # noqa: E402
from gapless.kernels import lora_dropout_triton as kernels  # noqa: E402
from gapless.kernels.lora_dropout import _block_r, _cdiv, keep_threshold  # noqa: E402

SHAPES = [("q/k/v", 3072, 48), ("gate/up", 3072, 32), ("o_proj", 3072, 16), ("down_proj", 8192, 16)]  # name, in, R
SMOKE_SHAPES = [("q/k/v", 80, 48), ("down_proj", 136, 16)]
MASKS = {"philox": 0, "hash": 1, "none": 2}


@triton.jit
def probe_keep(seed, rows, k0, K, threshold, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, N_ROUNDS: tl.constexpr,
               MASK: tl.constexpr):
    """The keep mask [BLOCK_M, BLOCK_K] of rows `rows` and columns k0 .. k0 + BLOCK_K - 1 under MASK (docstring)."""
    if MASK == 0:
        keep = kernels.keep_block(seed, rows, k0, tl.cdiv(K, 8), threshold, BLOCK_M, BLOCK_K, N_ROUNDS)
    elif MASK == 1:
        cols = k0 + tl.arange(0, BLOCK_K)
        h = ((rows[:, None] * K + cols[None, :]).to(tl.uint32) + seed.to(tl.uint32)) * 2654435761
        keep = (h >> 16).to(tl.int32) >= threshold
    else:
        keep = tl.full((BLOCK_M, BLOCK_K), 1, tl.int1)
    return keep


@triton.jit
def probe_forward_kernel(x_ptr, a_ptr, out_ptr, seed_ptr, N, K, R, threshold, scale, BLOCK_M: tl.constexpr,
                         BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, IEEE: tl.constexpr, N_ROUNDS: tl.constexpr,
                         MASK: tl.constexpr):
    """lora_dropout_triton.dropout_xa_kernel unsplit (FWD_SPLIT_K 1, the library's), its mask chosen by MASK."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rs = tl.arange(0, BLOCK_R)
    seed = tl.load(seed_ptr)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=(rows[:, None] < N) & (cols[None, :] < K),
                    other=0.0)
        keep = probe_keep(seed, rows, k0, K, threshold, BLOCK_M, BLOCK_K, N_ROUNDS, MASK)
        x = tl.where(keep, x, tl.zeros_like(x))
        a = tl.load(a_ptr + rs[None, :] * K + cols[:, None], mask=(rs[None, :] < R) & (cols[:, None] < K),
                    other=0.0).to(x.dtype)  # [BLOCK_K, BLOCK_R], A^T
        if IEEE:
            acc = tl.dot(x, a, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, a, acc)
    tl.store(out_ptr + rows[:, None] * R + rs[None, :], (acc * scale).to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < N) & (rs[None, :] < R))


@triton.jit
def probe_backward_kernel(x_ptr, a_ptr, dxa_ptr, dx_ptr, da_ptr, seed_ptr, N, K, R, rows_per_split, threshold, scale,
                          BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, IEEE: tl.constexpr,
                          N_ROUNDS: tl.constexpr, MASK: tl.constexpr):
    """lora_dropout_triton.dropout_xa_backward_kernel with NEED_DX, its mask chosen by MASK. A mirror, not an import:
    the library's kernels take no mask choice (a constexpr callable would have to pass through torch's wrap_triton);
    --smoke holds the philox mirror to the library's op bit for bit, so a change there that is not made here fails."""
    cols = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    split = tl.program_id(1)
    rs = tl.arange(0, BLOCK_R)
    seed = tl.load(seed_ptr)
    col_ok = cols < K
    a = tl.load(a_ptr + rs[:, None] * K + cols[None, :], mask=(rs[:, None] < R) & col_ok[None, :],
                other=0.0).to(x_ptr.dtype.element_ty)  # [BLOCK_R, BLOCK_K]
    acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
    start = split * rows_per_split
    for m0 in range(start, tl.minimum(start + rows_per_split, N), BLOCK_M):
        rows = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        ok = (rows[:, None] < N) & col_ok[None, :]
        x = tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=ok, other=0.0)
        keep = probe_keep(seed, rows, tl.program_id(0) * BLOCK_K, K, threshold, BLOCK_M, BLOCK_K, N_ROUNDS, MASK)
        dxa = tl.load(dxa_ptr + rows[:, None] * R + rs[None, :], mask=(rows[:, None] < N) & (rs[None, :] < R),
                      other=0.0)  # [BLOCK_M, BLOCK_R]
        x = tl.where(keep, x, tl.zeros_like(x))
        if IEEE:
            acc = tl.dot(tl.trans(dxa), x, acc, input_precision="ieee")
            dx = tl.dot(dxa, a, input_precision="ieee")
        else:
            acc = tl.dot(tl.trans(dxa), x, acc)
            dx = tl.dot(dxa, a)  # [BLOCK_M, BLOCK_K] float32
        tl.store(dx_ptr + rows[:, None] * K + cols[None, :], tl.where(keep, dx * scale, 0.0)
                 .to(dx_ptr.dtype.element_ty), mask=ok)
    tl.store(da_ptr + split * R * K + rs[:, None] * K + cols[None, :], acc * scale,
             mask=(rs[:, None] < R) & col_ok[None, :])


def forward(x, a, seed, p, mask: str):
    (n, k), r = x.shape, a.shape[0]
    out = x.new_empty(n, r)
    probe_forward_kernel[(_cdiv(n, lora_dropout.FWD_BLOCK_M),)](
        x, a, out, seed, n, k, r, keep_threshold(p), 1.0 / (1.0 - p), BLOCK_M=lora_dropout.FWD_BLOCK_M,
        BLOCK_K=lora_dropout.FWD_BLOCK_K, BLOCK_R=_block_r(r), IEEE=x.dtype == torch.float32,
        N_ROUNDS=kernels.PHILOX_ROUNDS, MASK=MASKS[mask], num_warps=lora_dropout.FWD_WARPS)
    return out


def backward(dxa, x, a, seed, p, mask: str, programs: int):
    (n, k), r = x.shape, a.shape[0]
    bm, bk = lora_dropout.BWD_BLOCK_M, lora_dropout.BWD_BLOCK_K
    splits, rows_per_split = lora_dropout._backward_splits(n, k, bm, bk, programs)
    dx = torch.empty_like(x)
    partials = x.new_empty(splits, r, k, dtype=torch.float32)
    probe_backward_kernel[(_cdiv(k, bk), splits)](
        x, a, dxa, dx, partials, seed, n, k, r, rows_per_split, keep_threshold(p), 1.0 / (1.0 - p), BLOCK_M=bm,
        BLOCK_K=bk, BLOCK_R=_block_r(r), IEEE=x.dtype == torch.float32, N_ROUNDS=kernels.PHILOX_ROUNDS,
        MASK=MASKS[mask], num_warps=lora_dropout.BWD_WARPS)
    return dx, partials.sum(0)


def check(x, a, dxa, seed, p, programs) -> list[str]:
    """The smoke run's checks (module docstring); the failures' descriptions, empty when all pass."""
    failures = []
    library = torch.ops.gapless.lora_dropout_xa(x, a, seed, p)
    if not torch.equal(forward(x, a, seed, p, "philox"), library):
        failures.append("forward philox differs from the library's op")
    dx_lib, _ = torch.ops.gapless.lora_dropout_xa_backward(dxa, x, a, seed, p, True)
    if not torch.equal(backward(dxa, x, a, seed, p, "philox", programs)[0], dx_lib):
        failures.append("backward philox dx differs from the library's op")
    scale = 1.0 / (1.0 - p)
    tol = 1e-4 if x.dtype == torch.float32 else 2e-2  # bf16's x, dxa and outputs on a GPU
    xf, af, dxaf = x.float(), a.to(x.dtype).float(), dxa.float()

    def close(got, want):
        return torch.allclose(got.float(), want, rtol=tol, atol=tol * want.abs().max().item())

    if not close(forward(x, a, seed, p, "none"), xf @ af.T * scale):
        failures.append("forward none differs from x A^T / (1 - p)")
    dx, da = backward(dxa, x, a, seed, p, "none", programs)
    if not (close(dx, dxaf @ af * scale) and close(da, dxaf.T @ xf * scale)):
        failures.append("backward none differs from dxa A and dxa^T x over (1 - p)")
    return failures


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, the checks only (CPU: TRITON_INTERPRET=1)")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--p", type=float, default=0.05)
    ap.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) / "dropout_probe.jsonl"
                    if os.environ.get("OUT") else None)
    args = ap.parse_args(argv)
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    if not args.smoke and (interpreting or not torch.cuda.is_available()):
        raise SystemExit("needs a CUDA device; on the CPU: TRITON_INTERPRET=1 python bench/dropout_probe.py --smoke")
    device = "cpu" if interpreting else "cuda"
    dtype = torch.float32 if interpreting else torch.bfloat16  # the interpreter has no bf16 dots
    n = 100 if args.smoke else args.tokens
    programs = 4 if args.smoke else lora_dropout.BACKWARD_PROGRAMS
    seed = torch.tensor([7], dtype=torch.int64, device=device)
    rows, failures = [], []
    from triton.testing import do_bench
    for name, k, r in SMOKE_SHAPES if args.smoke else SHAPES:
        g = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(n, k, generator=g).to(device, dtype)
        a = (torch.randn(r, k, generator=g) * 0.02).to(device)
        dxa = torch.randn(n, r, generator=g).to(device, dtype)
        failures += [f"{name}: {f}" for f in check(x, a, dxa, seed, args.p, programs)]
        if args.smoke:
            continue
        row = dict(shape=name, tokens=n, in_features=k, R=r,
                   floor_read_ms=do_bench(lambda: torch.empty_like(x).copy_(x), warmup=5, rep=20,
                                          return_mode="median") / 2)
        row["floor_read_write_ms"] = 2 * row["floor_read_ms"]
        for mask in MASKS:
            row[f"forward_{mask}_ms"] = do_bench(lambda: forward(x, a, seed, args.p, mask), warmup=5, rep=20,
                                                 return_mode="median")
            row[f"backward_{mask}_ms"] = do_bench(lambda: backward(dxa, x, a, seed, args.p, mask, programs),
                                                  warmup=5, rep=20, return_mode="median")
        rows.append(row)
    print("checks: " + ("; ".join(failures) if failures else "all pass"))
    if rows:
        total = {key: sum(row[key] for row in rows) for key in rows[0] if key.endswith("_ms")}
        print(f"{torch.cuda.get_device_name()}, {n} tokens, ms summed over the {len(rows)} shapes (one layer):")
        print(f"  forward  (floor, x read once {total['floor_read_ms']:.3f}): "
              + ", ".join(f"{m} {total[f'forward_{m}_ms']:.3f}" for m in MASKS))
        print(f"  backward (floor, x read and dx written {total['floor_read_write_ms']:.3f}): "
              + ", ".join(f"{m} {total[f'backward_{m}_ms']:.3f}" for m in MASKS))
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text("".join(json.dumps(dict(row, device=torch.cuda.get_device_name())) + "\n"
                                        for row in rows))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
