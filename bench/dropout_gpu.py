"""Tune the fused LoRA dropout kernels (gapless.kernels.lora_dropout_triton) on one GPU: forward and backward over
Philox rounds, blocks, warps and backward programs, on Llama-3.2-3B's LoRA A shapes at 16,384 tokens, against the
floor of reading x once (meant to take about 1 minute on an H100; not yet measured).

    PYTHONPATH=src PYTHONUNBUFFERED=1 python3 bench/dropout_gpu.py [--apply] [--out FILE] [--tokens 16384]
    TRITON_INTERPRET=1 python bench/dropout_gpu.py --smoke [--apply]    # CPU: tiny shapes, one repetition

Shapes, each once per layer (so each weighs 1 in the sums): q/k/v (in 3072, R = 48), gate/up (3072, 32), o_proj
(3072, 16), down_proj (8192, 16); x bf16 (float32 under the interpreter, which multiplies bf16's raw bits), A
float32 [R, in], the backward with dx (NEED_DX), p = 0.05.

Variants: N_ROUNDS 10, 7 x BLOCK_M 32, 64, 128 x BLOCK_K 64, 128, 256 x num_warps 4, 8, for the forward also
the splits of `in` 1, 2, 4 (108; lora_dropout.FWD_SPLIT_K), for the backward the programs target 256, 512, 1024
(108; splits as lora_dropout._backward_splits, here per variant). None is pruned: the 72 compiles per kernel and
BLOCK_R (programs and splits past 2 only change the grid) run first in a
pool of processes, one per core, that fill Triton's on-disk cache, and the timing pass loads them. A variant that
fails to compile or run is recorded with the first line of its error. Times are triton.testing.do_bench medians, 5 ms
warm-up and 20 ms of repetitions, L2 flushed before each call (x, 96-256 MiB, is never in the 50 MiB L2 in a step
either).

Checks, every variant against the current defaults (lora_dropout's FWD_*, BWD_*, BACKWARD_PROGRAMS and
lora_dropout_triton.PHILOX_ROUNDS), same seed:
- random x, A, dxa: xa, dx, dA within 1e-2 of the defaults' (norm of the difference over the norm, bf16's
  tolerance) at the same rounds; at other rounds only the relative difference of the norms is reported (`rel`).
- the mask itself. Forward: x = 1 and A[r, k] = 1 on columns k = r (mod R) spread so each r sums <= 64 of them,
  so xa = scale * (kept count) is exact in bf16. Backward: x, dxa and A all 1, so dx != 0 is the mask. At the
  same rounds both must equal the defaults' bit for bit; at any rounds the kept fraction must lie within 6
  standard deviations of 1 - round(p 2^16) / 2^16 (`sd` is the deviation in those units).
- the defaults' launches here equal torch.ops.gapless.lora_dropout_xa and _backward bit for bit (printed).
Floor: x @ A^T as a bf16 cuBLAS matmul, and torch.empty_like(x).copy_(x) (x read and written once). "floor x" is a
forward's summed time over half the copy's (x read once) and a backward's over the whole copy's (x read, dx
written): how far each kernel is from the traffic it cannot avoid.

For information only: what the mask alone costs, and what unpacking it by joins saved. keep_block_where is
kernels.keep_block with the four Philox words unpacked by a tl.where chain (the kernels' way until session 19) instead
of tl.join/tl.reshape, checked bit for bit against kernels.keep_block's mask at both rounds; mask_cost_kernel draws
the mask of each shape as the forward kernel walks it (the default forward blocks and warps) and only counts the
kept elements, without reading x, with either unpacking: its time beside the forward kernel's says how much of that
is the mask.

--apply (after timing) rewrites FWD_BLOCK_M, FWD_BLOCK_K, FWD_WARPS, FWD_SPLIT_K, BWD_BLOCK_M, BWD_BLOCK_K,
BWD_WARPS and BACKWARD_PROGRAMS in src/gapless/kernels/lora_dropout.py to the fastest checked configurations at
PHILOX_ROUNDS (the rounds are never changed: 7 rounds are reported only) and prints the diff; the comments above
the constants still describe the old values, for a person to update. Under --smoke it prints the diff without
writing.
JSON lines, one per kernel, variant and shape (plus the floors and the choices), go to --out (default
$OUT/dropout_gpu.jsonl where OUT is set).
"""
from __future__ import annotations

import argparse
import difflib
import itertools
import json
import math
import multiprocessing
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from gapless.kernels import lora_dropout  # noqa: E402
from gapless.kernels import lora_dropout_triton as kernels  # noqa: E402
from gapless.kernels.lora_dropout import _block_r, _cdiv, keep_threshold  # noqa: E402

LIBRARY = ROOT / "src" / "gapless" / "kernels" / "lora_dropout.py"
SHAPES = [("q/k/v", 3072, 48), ("gate/up", 3072, 32), ("o_proj", 3072, 16), ("down_proj", 8192, 16)]  # name, in, R
# smoke: N = 100 and `in` not multiples of the blocks (masked edges), programs scaled down with N (the interpreter
# runs programs one after another)
SMOKE_SHAPES = [("q/k/v", 80, 48), ("gate/up", 80, 32), ("o_proj", 80, 16), ("down_proj", 136, 16)]
# BLOCK_K 256: the backward re-reads dxa [N, R] once per column block (48 at 64 for in 3072), a quarter as often
ROUNDS, BLOCKS_M, BLOCKS_K, WARPS = (10, 7), (32, 64, 128), (64, 128, 256), (4, 8)
PROGRAMS, SMOKE_PROGRAMS = (256, 512, 1024), (2, 4, 8)
SPLITS_K = (1, 2, 4)  # the forward's splits of `in` (lora_dropout.FWD_SPLIT_K)
TOL = 1e-2  # bf16
MAX_SD = 6


# ---------------------------------------------------------------------------------------------
# For information: the Philox words unpacked with a tl.where chain (kernels.keep_block unpacks them by joins)


@triton.jit
def keep_block_where(seed, rows, k0, words_per_row, threshold, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                     N_ROUNDS: tl.constexpr):
    """kernels.keep_block's mask, the 16-bit halves picked by a tl.where per word instead of laid out by joins."""
    words = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    counter = rows[:, None] * words_per_row + words[None, :]  # [BLOCK_M, BLOCK_K / 8], int64
    r0, r1, r2, r3 = tl.randint4x(seed, counter, N_ROUNDS)
    lane = tl.arange(0, 8)[None, None, :]  # the column within the 8 a draw covers
    word = lane // 2
    r = tl.where(word == 0, r0[:, :, None], tl.where(word == 1, r1[:, :, None],
                                                     tl.where(word == 2, r2[:, :, None], r3[:, :, None])))
    bits = (r >> ((lane % 2) * 16).to(tl.uint32)) & 0xFFFF  # [BLOCK_M, BLOCK_K / 8, 8]
    return tl.reshape(bits.to(tl.int32), (BLOCK_M, BLOCK_K)) >= threshold


@triton.jit
def keep_masks_kernel(where_ptr, join_ptr, seed_ptr, N, K, threshold, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                      N_ROUNDS: tl.constexpr):
    """Both masks [N, K] (int8) of a seed: keep_block_where's and kernels.keep_block's (joins)."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    k0 = tl.program_id(1) * BLOCK_K
    cols = k0 + tl.arange(0, BLOCK_K)
    seed = tl.load(seed_ptr)
    ok = (rows[:, None] < N) & (cols[None, :] < K)
    offsets = rows[:, None] * K + cols[None, :]
    where = keep_block_where(seed, rows, k0, tl.cdiv(K, 8), threshold, BLOCK_M, BLOCK_K, N_ROUNDS)
    join = kernels.keep_block(seed, rows, k0, tl.cdiv(K, 8), threshold, BLOCK_M, BLOCK_K, N_ROUNDS)
    tl.store(where_ptr + offsets, where.to(tl.int8), mask=ok)
    tl.store(join_ptr + offsets, join.to(tl.int8), mask=ok)


@triton.jit
def mask_cost_kernel(count_ptr, seed_ptr, N, K, threshold, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                     N_ROUNDS: tl.constexpr, JOIN: tl.constexpr):
    """The kept count [N] of each row of the mask, drawn BLOCK_K columns at a time as dropout_xa_kernel draws it,
    with kernels.keep_block (JOIN) or keep_block_where: the mask's cost without x."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    seed = tl.load(seed_ptr)
    words_per_row = tl.cdiv(K, 8)
    count = tl.zeros((BLOCK_M,), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        if JOIN:
            keep = kernels.keep_block(seed, rows, k0, words_per_row, threshold, BLOCK_M, BLOCK_K, N_ROUNDS)
        else:
            keep = keep_block_where(seed, rows, k0, words_per_row, threshold, BLOCK_M, BLOCK_K, N_ROUNDS)
        cols = k0 + tl.arange(0, BLOCK_K)
        count += tl.sum((keep & (cols[None, :] < K)).to(tl.int32), axis=1)
    tl.store(count_ptr + rows, count, mask=rows < N)


def mask_counts(n: int, k: int, seed, p: float, v: dict, join: bool):
    counts = torch.empty(n, dtype=torch.int32, device=seed.device)
    mask_cost_kernel[(_cdiv(n, v["block_m"]),)](counts, seed, n, k, keep_threshold(p), BLOCK_M=v["block_m"],
                                                 BLOCK_K=v["block_k"], N_ROUNDS=v["rounds"], JOIN=join,
                                                 num_warps=v["warps"])
    return counts


# ---------------------------------------------------------------------------------------------
# Launches of one variant: {rounds, block_m, block_k, warps[, programs]}


def forward(x, a, seed, p, v):
    """xa [N, R] as lora_dropout.lora_dropout_xa launches it, under variant v (its `splits`: FWD_SPLIT_K)."""
    (n, k), r = x.shape, a.shape[0]
    splits, per_split = lora_dropout._forward_splits(k, v["block_k"], v["splits"])
    out = x.new_empty(n, r) if splits == 1 else x.new_empty(splits, n, r, dtype=torch.float32)
    kernels.dropout_xa_kernel[(_cdiv(n, v["block_m"]), splits)](
        x, a, out, seed, n, k, r, per_split, keep_threshold(p), 1.0 / (1.0 - p), BLOCK_M=v["block_m"],
        BLOCK_K=v["block_k"], BLOCK_R=_block_r(r), IEEE=x.dtype == torch.float32, N_ROUNDS=v["rounds"],
        num_warps=v["warps"])
    return out if splits == 1 else out.sum(0).to(x.dtype)


def backward(dxa, x, a, seed, p, v):
    """(dx [N, in], dA [R, in] float32) as lora_dropout.lora_dropout_xa_backward launches them, under variant v."""
    (n, k), r = x.shape, a.shape[0]
    splits, rows_per_split = lora_dropout._backward_splits(n, k, v["block_m"], v["block_k"], v["programs"])
    dx = torch.empty_like(x)
    partials = x.new_empty(splits, r, k, dtype=torch.float32)  # [S, R, in]
    kernels.dropout_xa_backward_kernel[(_cdiv(k, v["block_k"]), splits)](
        x, a, dxa, dx, partials, seed, n, k, r, rows_per_split, keep_threshold(p), 1.0 / (1.0 - p),
        BLOCK_M=v["block_m"], BLOCK_K=v["block_k"], BLOCK_R=_block_r(r), NEED_DX=True, IEEE=x.dtype == torch.float32,
        N_ROUNDS=v["rounds"], num_warps=v["warps"])
    return dx, partials.sum(0)


def variants(kernel: str, programs) -> list[dict]:
    grid = [dict(rounds=rr, block_m=m, block_k=k, warps=w)
            for rr, m, k, w in itertools.product(ROUNDS, BLOCKS_M, BLOCKS_K, WARPS)]
    if kernel == "forward":
        return [dict(v, splits=sk) for v in grid for sk in SPLITS_K]
    return [dict(v, programs=pr) for v in grid for pr in programs]


def defaults() -> dict[str, dict]:
    rounds = kernels.PHILOX_ROUNDS
    return dict(forward=dict(rounds=rounds, block_m=lora_dropout.FWD_BLOCK_M, block_k=lora_dropout.FWD_BLOCK_K,
                             warps=lora_dropout.FWD_WARPS, splits=lora_dropout.FWD_SPLIT_K),
                backward=dict(rounds=rounds, block_m=lora_dropout.BWD_BLOCK_M, block_k=lora_dropout.BWD_BLOCK_K,
                              warps=lora_dropout.BWD_WARPS, programs=lora_dropout.BACKWARD_PROGRAMS))


def short_error(e: Exception) -> str:
    lines = [line for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[0][:160] if lines else ''}"


# ---------------------------------------------------------------------------------------------
# Compiling in parallel: each job launches its variant once on small tensors with the same specialisation as the
# timed ones (every int a multiple of 16, pointers 16-aligned), so the timed launch finds Triton's on-disk cache


def compile_job(job):
    kernel, k, r, v = job
    try:
        g = torch.Generator(device="cuda").manual_seed(0)  # bf16 as timed: the pool runs on CUDA only
        x = torch.randn(256, k, device="cuda", dtype=torch.bfloat16, generator=g)
        a = torch.randn(r, k, device="cuda", generator=g)
        seed = torch.zeros(1, dtype=torch.int64, device="cuda")
        if kernel == "forward":
            forward(x, a, seed, 0.05, v)
        elif kernel == "mask":
            mask_counts(256, k, seed, 0.05, v, join=False)
            mask_counts(256, k, seed, 0.05, v, join=True)
        else:
            backward(torch.randn(256, r, device="cuda", dtype=torch.bfloat16, generator=g), x, a, seed, 0.05, v)
        torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001 - recorded; the timing pass meets it again
        return short_error(e)


def precompile(shapes, programs, mask_variant: dict, jobs: int) -> None:
    todo, seen = [], set()
    for kernel in ("forward", "backward", "mask"):
        # programs change only the grid; the mask alone is timed at the default forward variant
        # splits past 2 change only the grid (1 writes xa in x's dtype, more float32 partials: two compiles)
        vs = [v for v in variants(kernel, programs[:1]) if v.get("splits", 1) <= 2]
        for v in vs if kernel != "mask" else [mask_variant]:
            for _, k, r in shapes:
                key = (kernel, _block_r(r), tuple(v.values()))
                if key not in seen:
                    seen.add(key)
                    todo.append((kernel, k, r, v))
    start = time.perf_counter()
    try:
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            errors = [e for e in pool.map(compile_job, todo) if e]
    except Exception as e:  # noqa: BLE001 - the timing pass then compiles one at a time
        print(f"parallel compile failed ({short_error(e)}); compiling while timing", flush=True)
        return
    print(f"compiled {len(todo)} kernels in {time.perf_counter() - start:.1f} s on {jobs} processes "
          f"({len(errors)} failed)", flush=True)


# ---------------------------------------------------------------------------------------------
# Timing and checks


def timer(smoke: bool):
    if smoke:
        def once(fn):
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        return once
    from triton.testing import do_bench
    return lambda fn: do_bench(fn, warmup=5, rep=20, return_mode="median")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def rel_norms(a: torch.Tensor, b: torch.Tensor) -> float:
    """|‖a‖ − ‖b‖| / ‖b‖: for outputs under different masks."""
    na, nb = a.double().norm().item(), b.double().norm().item()
    return abs(na - nb) / nb


def pick_columns(r: int, k: int, device) -> torch.Tensor:
    """A [r, k] float32: row j is 1 on columns c = j (mod r), every stride-th of them, <= 64 per row, so with x = 1
    xa = scale * (kept count) <= 64 scale stays exact in bf16 (8 bits of mantissa)."""
    cols = torch.arange(k, device=device)
    stride = _cdiv(_cdiv(k, r), 64)
    picked = (cols // r) % stride == 0
    return ((cols[None, :] % r == torch.arange(r, device=device)[:, None]) & picked[None, :]).float()


def kept_sd(kept: float, count: int, p: float) -> float:
    """The kept fraction's deviation from its expectation, in standard deviations over `count` elements."""
    q = 1 - keep_threshold(p) / 2 ** 16
    return (kept - q) / math.sqrt(q * (1 - q) / count)


class Shape:
    """One shape's inputs (random and the mask probes) and the defaults' outputs to check variants against."""

    def __init__(self, name, n, k, r, p, device, dtype, default):
        g = torch.Generator(device=device).manual_seed(0)
        self.name, self.n, self.k, self.r, self.p = name, n, k, r, p
        self.x = torch.randn(n, k, device=device, dtype=dtype, generator=g)
        self.a = torch.randn(r, k, device=device, generator=g) / k ** 0.5
        self.dxa = torch.randn(n, r, device=device, dtype=dtype, generator=g)
        self.seed = torch.tensor([20240611], dtype=torch.int64, device=device)
        self.ones = torch.ones(n, k, device=device, dtype=dtype)
        self.picks = pick_columns(r, k, device)
        self.ones_r = torch.ones(n, r, device=device, dtype=dtype)
        self.ones_a = torch.ones(r, k, device=device)
        self.probed = n * int(self.picks.sum().item())  # elements the forward's mask probe counts
        self.fwd_ref = forward(self.x, self.a, self.seed, p, default["forward"])
        self.fwd_probe_ref = forward(self.ones, self.picks, self.seed, p, default["forward"])
        self.bwd_ref = backward(self.dxa, self.x, self.a, self.seed, p, default["backward"])
        self.bwd_mask_ref = self.bwd_probe(default["backward"])
        self.default_rounds = default["forward"]["rounds"]

    def bwd_probe(self, v) -> torch.Tensor:
        return backward(self.ones_r, self.ones, self.ones_a, self.seed, self.p, v)[0] != 0

    def check_forward(self, v) -> dict:
        out = forward(self.x, self.a, self.seed, self.p, v)
        probe = forward(self.ones, self.picks, self.seed, self.p, v)
        counts = torch.round(probe.float() * (1 - self.p))  # [N, R] kept elements per row and A row
        sd = kept_sd(counts.sum().item() / self.probed, self.probed, self.p)
        if v["rounds"] == self.default_rounds:
            row = dict(rel=rel(out, self.fwd_ref), mask_equal=torch.equal(probe, self.fwd_probe_ref))
            row["ok"] = row["rel"] < TOL and row["mask_equal"] and abs(sd) < MAX_SD
        else:
            row = dict(rel=rel_norms(out, self.fwd_ref), ok=abs(sd) < MAX_SD)
        return dict(row, sd=round(sd, 2))

    def check_backward(self, v) -> dict:
        dx, da = backward(self.dxa, self.x, self.a, self.seed, self.p, v)
        mask = self.bwd_probe(v)
        sd = kept_sd(mask.float().mean().item(), mask.numel(), self.p)
        if v["rounds"] == self.default_rounds:
            row = dict(rel=max(rel(dx, self.bwd_ref[0]), rel(da, self.bwd_ref[1])),
                       mask_equal=torch.equal(mask, self.bwd_mask_ref))
            row["ok"] = row["rel"] < TOL and row["mask_equal"] and abs(sd) < MAX_SD
        else:
            row = dict(rel=max(rel_norms(dx, self.bwd_ref[0]), rel_norms(da, self.bwd_ref[1])), ok=abs(sd) < MAX_SD)
        return dict(row, sd=round(sd, 2))


def measure(shape: Shape, kernel: str, v: dict, time_fn) -> dict:
    row = dict(kernel=kernel, shape=shape.name, tokens=shape.n, in_features=shape.k, R=shape.r, **v)
    try:
        if kernel == "forward":
            row.update(shape.check_forward(v))
            row["ms"] = time_fn(lambda: forward(shape.x, shape.a, shape.seed, shape.p, v))
        else:
            row.update(shape.check_backward(v))
            row["ms"] = time_fn(lambda: backward(shape.dxa, shape.x, shape.a, shape.seed, shape.p, v))
    except Exception as e:  # noqa: BLE001 - a variant that fails to compile or run is recorded, the rest go on
        row.update(ok=False, error=short_error(e))
    return row


def check_library(shape: Shape) -> bool:
    """The launches here are the library's: its ops equal the defaults' launches bit for bit."""
    xa = torch.ops.gapless.lora_dropout_xa(shape.x, shape.a, shape.seed, shape.p)
    dx, da = torch.ops.gapless.lora_dropout_xa_backward(shape.dxa, shape.x, shape.a, shape.seed, shape.p, True)
    return torch.equal(xa, shape.fwd_ref) and torch.equal(dx, shape.bwd_ref[0]) and torch.equal(da, shape.bwd_ref[1])


def check_join_mask(device, p: float, n: int, k: int) -> bool:
    """keep_block_where's mask equals kernels.keep_block's bit for bit, at both rounds."""
    seed = torch.tensor([77], dtype=torch.int64, device=device)
    same = True
    for rounds in ROUNDS:
        where = torch.empty(n, k, dtype=torch.int8, device=device)
        join = torch.empty_like(where)
        keep_masks_kernel[(_cdiv(n, 32), _cdiv(k, 64))](where, join, seed, n, k, keep_threshold(p), BLOCK_M=32,
                                                         BLOCK_K=64, N_ROUNDS=rounds)
        same = same and torch.equal(where, join)
    return same


# ---------------------------------------------------------------------------------------------
# Summary, table and --apply


VARIANT = ("rounds", "block_m", "block_k", "warps", "programs", "splits")


def key(row: dict) -> tuple:
    return tuple(row.get(name) for name in VARIANT)


def summarise(rows: list[dict], kernel: str, n_shapes: int) -> list[dict]:
    """One entry per variant of `kernel`: ms per shape, their sum (None unless every shape ran), ok on all."""
    by_variant: dict[tuple, dict] = {}
    for row in rows:
        if row["kernel"] != kernel:
            continue
        variant = {name: row[name] for name in VARIANT if name in row}
        entry = by_variant.setdefault(key(row), dict(v=key(row), variant=variant, ms={}, ok=True, errors=set(), sd=[],
                                                     rel=[]))
        entry["ok"] &= row["ok"]
        if "error" in row:
            entry["errors"].add(row["error"])
        else:
            entry["ms"][row["shape"]] = row["ms"]
            entry["sd"].append(row["sd"])
            entry["rel"].append(row["rel"])
    for entry in by_variant.values():
        entry["sum"] = sum(entry["ms"].values()) if len(entry["ms"]) == n_shapes else None
    return sorted(by_variant.values(), key=lambda e: (e["sum"] is None, e["sum"] or 0))


def print_table(title: str, entries: list[dict], shapes, floor_ms: float, default: tuple, limit: int) -> None:
    print(f"\n{title}   (floor {floor_ms:.3f} ms; * = current default)")
    names = [name for name, _, _ in shapes]
    print(f"  {'rounds':>6} {'BM':>4} {'BK':>4} {'warps':>5} {'progs':>5} {'split':>5} |"
          + "".join(f"{n:>10}" for n in names)
          + f" | {'sum ms':>8} {'floor x':>7}  check (max rel, max |sd|)")
    shown = [e for i, e in enumerate(entries) if i < limit or e["v"] == default]
    for e in shown:
        rounds, bm, bk, warps, programs, splits = e["v"]
        cells = "".join(f"{e['ms'][n]:10.4f}" if n in e["ms"] else f"{'-':>10}" for n in names)
        total = f"{e['sum']:8.3f} {e['sum'] / floor_ms:7.2f}" if e["sum"] is not None else f"{'-':>8} {'-':>7}"
        check = "ok" if e["ok"] else "FAIL"
        if e["rel"]:
            check += f" ({max(e['rel']):.1e}, {max(abs(s) for s in e['sd']):.1f})"
        if e["errors"]:
            check += " " + "; ".join(sorted(e["errors"]))[:120]
        star = "*" if e["v"] == default else " "
        print(f" {star}{rounds:>6} {bm:>4} {bk:>4} {warps:>5} {programs if programs else '':>5} "
              f"{splits if splits else '':>5} |{cells} | {total}"
              f"  {check}")
    if len(shown) < len(entries):
        print(f"  ... {len(entries) - len(shown)} more in the JSON lines")
    failed = [e for e in entries if not e["ok"]]
    if failed:
        errors = sorted({error for e in failed for error in e["errors"]})
        print(f"  {len(failed)} variants failed a check or to run" + (f"; errors: {' | '.join(errors)[:600]}"
                                                                      if errors else ""))


def best(entries: list[dict], rounds: int) -> dict | None:
    ok = [e for e in entries if e["ok"] and e["sum"] is not None and e["v"][0] == rounds]
    return min(ok, key=lambda e: e["sum"]) if ok else None


def rewrite_constants(text: str, values: dict[str, int]) -> str:
    """`NAME = <int>` lines of lora_dropout.py set to values; a name not found exactly once stops the run."""
    for name, value in values.items():
        text, count = re.subn(rf"^({name} = )\d+\b", rf"\g<1>{value}", text, flags=re.M)
        if count != 1:
            raise SystemExit(f"--apply: `{name} = <int>` found {count} times in {LIBRARY}, expected once")
    return text


def apply(fwd: dict, bwd: dict, write: bool) -> None:
    values = dict(FWD_BLOCK_M=fwd["block_m"], FWD_BLOCK_K=fwd["block_k"], FWD_WARPS=fwd["warps"],
                  FWD_SPLIT_K=fwd["splits"],
                  BWD_BLOCK_M=bwd["block_m"], BWD_BLOCK_K=bwd["block_k"], BWD_WARPS=bwd["warps"],
                  BACKWARD_PROGRAMS=bwd["programs"])
    old = LIBRARY.read_text()
    new = rewrite_constants(old, values)
    rel_path = LIBRARY.relative_to(ROOT)
    diff = "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{rel_path}", f"b/{rel_path}"))
    print(f"\n--apply: {values}")
    print(diff or "(no change: the defaults are already the fastest)")
    if diff and write:
        LIBRARY.write_text(new)
        print(f"written to {rel_path}; update the comments above the constants with the numbers above")
    elif diff:
        print("(smoke: not written)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, one repetition (CPU: TRITON_INTERPRET=1)")
    ap.add_argument("--apply", action="store_true", help="rewrite lora_dropout.py's blocks, warps and programs")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--p", type=float, default=0.05)
    ap.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) / "dropout_gpu.jsonl"
                    if os.environ.get("OUT") else None)
    ap.add_argument("--jobs", type=int, default=os.cpu_count(), help="processes compiling in parallel")
    args = ap.parse_args(argv)
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    device = "cuda" if torch.cuda.is_available() and not interpreting else "cpu"
    if device == "cpu" and not (interpreting and args.smoke):
        raise SystemExit("no CUDA device: run `TRITON_INTERPRET=1 python bench/dropout_gpu.py --smoke` on the CPU")
    if not lora_dropout.FUSED_DROPOUT:
        raise SystemExit("needs triton and torch.library.triton_op (torch >= 2.6)")
    start = time.perf_counter()
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    n = 100 if args.smoke else args.tokens
    programs = SMOKE_PROGRAMS if args.smoke else PROGRAMS
    # the interpreter computes bf16 dots on the raw bits (numpy has no bf16): float32 there, as the tests run it
    dtype = torch.float32 if interpreting else torch.bfloat16
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (triton interpreter)"
    print(f"{name}, torch {torch.__version__}, triton {triton.__version__}, N={n}, p={args.p}", flush=True)
    default = defaults()
    print(f"defaults: forward {default['forward']}, backward {default['backward']}", flush=True)
    if device == "cuda":
        precompile(shapes, programs, default["forward"], args.jobs)
    time_fn = timer(args.smoke)

    rows: list[dict] = []
    floors = dict(matmul=0.0, copy=0.0)
    join_equal = check_join_mask(device, args.p, 300 if args.smoke else 4096, 200 if args.smoke else 3072)
    for shape_name, k, r in shapes:
        shape = Shape(shape_name, n, k, r, args.p, device, dtype, default)
        same_as_library = check_library(shape)
        a_x = shape.a.to(dtype)
        for kernel, fn in (("matmul", lambda: shape.x @ a_x.T), ("copy", lambda: torch.empty_like(shape.x)
                                                                  .copy_(shape.x))):
            ms = time_fn(fn)
            floors[kernel] += ms
            rows.append(dict(kernel=f"floor_{kernel}", shape=shape_name, tokens=n, in_features=k, R=r, ms=ms))
        for kernel in ("forward", "backward"):
            vs = variants(kernel, programs)
            vs += [default[kernel]] if default[kernel] not in vs else []
            rows += [measure(shape, kernel, v, time_fn) for v in vs]
        print(f"{shape_name:9s} in={k} R={r}: {sum(1 for row in rows if row['shape'] == shape_name)} rows, the "
              f"defaults' launches {'equal' if same_as_library else 'DIFFER from'} the library's ops "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
        del shape

    summaries = {kernel: summarise(rows, kernel, len(shapes)) for kernel in ("forward", "backward")}
    print(f"\nfloors, summed over {len(shapes)} shapes: x @ A^T (bf16 matmul) {floors['matmul']:.3f} ms, "
          f"x copy {floors['copy']:.3f} ms")
    print_table("forward: xa = dropout(x) A^T", summaries["forward"], shapes, floors["copy"] / 2,
                key(default["forward"]), limit=len(summaries["forward"]))
    print_table("backward: dx and dA", summaries["backward"], shapes, floors["copy"], key(default["backward"]),
                limit=24)

    chosen = {}
    for kernel in ("forward", "backward"):
        was = next(e for e in summaries[kernel] if e["v"] == key(default[kernel]))
        for rounds in ROUNDS:
            b = best(summaries[kernel], rounds)
            if b is None:
                print(f"{kernel}: no variant at {rounds} rounds passed its checks on every shape")
                continue
            if rounds == default[kernel]["rounds"]:
                chosen[kernel] = b
            saved = was["sum"] - b["sum"] if was["sum"] is not None else float("nan")
            print(f"best {kernel} at {rounds} rounds: {b['variant']} {b['sum']:.3f} ms over the shapes, "
                  f"{saved:+.3f} ms against the default's, {28 * saved:+.2f} ms a step over 28 layers")
            rows.append(dict(kernel=f"best_{kernel}", **b["variant"], sum_ms=b["sum"],
                             default_sum_ms=was["sum"]))

    print(f"\nkeep_block_where's mask {'equals' if join_equal else 'DIFFERS from'} keep_block's (both rounds)")
    v = default["forward"]
    total = dict(where=0.0, join=0.0, forward=0.0)
    for shape_name, k, r in shapes:
        seed = torch.tensor([7], dtype=torch.int64, device=device)
        same = torch.equal(mask_counts(n, k, seed, args.p, v, join=False),
                           mask_counts(n, k, seed, args.p, v, join=True))
        row = dict(kernel="mask", shape=shape_name, tokens=n, in_features=k, R=r, **v, counts_equal=same)
        for unpack, join in (("where", False), ("join", True)):
            row[f"{unpack}_ms"] = time_fn(lambda join=join: mask_counts(n, k, seed, args.p, v, join))
            total[unpack] += row[f"{unpack}_ms"]
        total["forward"] += next(x["ms"] for x in rows if x["kernel"] == "forward" and x["shape"] == shape_name
                                 and key(x) == key(v) and "ms" in x)
        rows.append(row)
    print(f"  the mask alone at the default forward {v}, summed over the shapes: tl.where chain {total['where']:.3f} "
          f"ms, joins {total['join']:.3f} ms, against the whole forward kernel's {total['forward']:.3f} ms")

    device_name = name
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("".join(json.dumps(dict(row, device=device_name)) + "\n" for row in rows))
        print(f"\n{len(rows)} rows to {args.out}")
    print(f"total {time.perf_counter() - start:.0f} s")
    if args.apply:
        if "forward" not in chosen or "backward" not in chosen:
            raise SystemExit("--apply: no checked configuration for both kernels at the default rounds")
        apply(chosen["forward"]["variant"], chosen["backward"]["variant"], write=not args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
