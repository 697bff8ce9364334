"""Check and time gapless's GPU kernels on one H200 in a single call (about 3-5 minutes).

    PYTHONUNBUFFERED=1 python3 bench/kernels_gpu.py [--lengths FILE] [--T 16384] [--only attention|loss]

(a) Every attention backend (varlen, flex, fa4_op when flash-attn-4 imports, and a cuDNN nested-tensor probe
    that is not a registered backend) against sdpa_reference run in float32 on the same inputs upcast,
    forward and backward, bf16, Llama-3.2-3B shapes (24 query heads, 8 KV heads, head dim 128), one packed
    row of T tokens cut from real document lengths (--lengths: whitespace-separated token counts, capped at
    4096; default: synthetic lognormal, median 140, capped at 4096). Errors are ‖x − ref‖ / ‖ref‖ with fresh
    random inputs per check; bf16 should land between 1e-3 and 1e-2. Sliding window (64) is checked too.
(b) Times each backend forward and forward+backward (median of triton.testing.do_bench) and prints TFLOP/s.
(c) linear_cross_entropy against the float32 reference (N=16384 bf16 hidden, V=128256, D=3072, frozen and
    trainable LM head), timed against the materialised bf16-logits loss, with the peak memory of each.
(d) The per-chunk step through torch.compile (step="compiled") and as the Triton kernel (step="triton"), and
    whole-function torch.compile as a probe.
(e) The per-chunk step alone on one chunk of float32 logits [2048, V] with a bf16 gradient: torch.compile's against
    the Triton kernel at several block sizes and warp counts, each with its effective bandwidth at the Triton
    kernel's 10 bytes per logit (read twice, written once in bf16) and its error against _step_functional run
    eagerly.

A short table comes last; JSON lines go to $OUT/kernels.jsonl when OUT is set. One failing case prints its
error and the script goes on.
"""
from __future__ import annotations

import argparse
import inspect
import itertools
import json
import math
import os
import random
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from gapless.kernels.attention import FlexAttention, get_attention, sdpa_reference  # noqa: E402
from gapless.kernels.loss import linear_cross_entropy, reference_linear_cross_entropy  # noqa: E402

HQ, HKV, HD = 24, 8, 128  # Llama-3.2-3B attention
VOCAB, DMODEL = 128256, 3072  # Llama-3.2-3B LM head
WINDOW = 64  # sliding window used for the correctness check
DEVICE = "cuda"
ROWS: list[dict] = []


def record(**row) -> None:
    ROWS.append(row)
    print("RESULT", json.dumps(row), flush=True)


def bench_ms(fn, grad_to_none=None, rep=200) -> float:
    """Median milliseconds of fn (device events; L2 flushed between runs by do_bench)."""
    try:
        from triton.testing import do_bench
    except ImportError:
        do_bench = None
    if do_bench is not None:
        return float(do_bench(fn, warmup=25, rep=rep, grad_to_none=grad_to_none, return_mode="median"))
    for _ in range(3):
        fn()
    times = []
    for _ in range(10):
        if grad_to_none:
            for t in grad_to_none:
                t.grad = None
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return sorted(times)[len(times) // 2]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def maxabs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def short_error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"


# ------------------------------------------------------------------------------------------- lengths


def document_pool(path: str | None, seed: int) -> tuple[list[int], str]:
    if path:
        pool = [min(int(x), 4096) for x in Path(path).read_text().split() if int(x) > 0]
        return pool, f"{path} ({len(pool)} lengths, capped at 4096)"
    rng = random.Random(seed)
    # lognormal with median 140 tokens; sigma 1.1 gives a mean near 255, close to the real SFT mix (263)
    pool = [max(1, min(4096, round(rng.lognormvariate(math.log(140), 1.1)))) for _ in range(20000)]
    return pool, "synthetic lognormal (median 140, sigma 1.1, capped at 4096)"


def pack_row(pool: list[int], T: int, rng: random.Random) -> list[int]:
    """Documents drawn from the pool until T tokens; the last one is cut to fit (as peers/limit.py does)."""
    docs: list[int] = []
    while sum(docs) < T:
        docs.append(rng.choice(pool))
    docs[-1] -= sum(docs) - T
    return docs


def attention_flops(docs: list[int]) -> float:
    """Causal forward FLOPs of one packed row: per document of L tokens and per query head, QK^T and PV each
    cost 2*D FLOPs for every one of the L(L+1)/2 allowed (query, key) pairs, so
        fwd = sum_L 2 * 2 * D * L(L+1)/2 * Hq.
    The backward does 2.5x that (recomputed QK^T, dV, dP, dQ, dK: five matmuls against two), so
    fwd+bwd = 3.5 * fwd; FlashAttention's papers and peers/limit.py count the same way."""
    return sum(2 * 2 * HD * L * (L + 1) / 2 * HQ for L in docs)


# ----------------------------------------------------------------------------------------- attention


def make_qkvg(T: int, seed: int):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(1, T, HQ, HD, device=DEVICE, dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, T, HKV, HD, device=DEVICE, dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, T, HKV, HD, device=DEVICE, dtype=torch.bfloat16, generator=g)
    dout = torch.randn(1, T, HQ, HD, device=DEVICE, dtype=torch.bfloat16, generator=g)
    return q, k, v, dout


def fwd_bwd(fn, q, k, v, dout, **kw):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v, **kw)
    out.backward(dout)
    return [t.detach() for t in (out, q.grad, k.grad, v.grad)]


def reference_fp32(q, k, v, dout, **kw):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):  # plain float32 matmuls (TF32 is off by default for matmul)
        return fwd_bwd(sdpa_reference, q.float(), k.float(), v.float(), dout.float(), **kw)


def check_attention(name: str, fn, docs: list[int], T: int, seed: int, window: int | None) -> dict:
    cu = torch.tensor([0, *itertools.accumulate(docs)], dtype=torch.int32, device=DEVICE)
    kw = dict(cu_seqlens=cu, max_seqlen=max(docs), sliding_window=window)
    q, k, v, dout = make_qkvg(T, seed)  # fresh inputs for every check
    t0 = time.perf_counter()
    got = fwd_bwd(fn, q, k, v, dout, **kw)
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    ref = reference_fp32(q, k, v, dout, **kw)
    res: dict = {"first_call_s": round(first_s, 2)}
    for n, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        res[f"rel_{n}"] = rel(a, b)
        res[f"maxabs_{n}"] = maxabs(a, b)
        res[f"finite_{n}"] = bool(torch.isfinite(a).all())
    res["ok"] = all(res[f"finite_{n}"] for n in ("out", "dq", "dk", "dv")) and res["rel_out"] < 1e-2 and \
        max(res["rel_dq"], res["rel_dk"], res["rel_dv"]) < 2e-2
    return res


def time_attention(fn, docs: list[int], T: int, seed: int) -> dict:
    cu = torch.tensor([0, *itertools.accumulate(docs)], dtype=torch.int32, device=DEVICE)
    kw = dict(cu_seqlens=cu, max_seqlen=max(docs))
    q, k, v, dout = make_qkvg(T, seed)
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    def fb():
        fn(q, k, v, **kw).backward(dout)

    def fwd():
        with torch.no_grad():
            fn(q, k, v, **kw)

    fb_ms = bench_ms(fb, grad_to_none=[q, k, v])
    f_ms = bench_ms(fwd)
    flops = attention_flops(docs)
    return {"fwd_ms": f_ms, "fwd_bwd_ms": fb_ms, "fwd_tflops": flops / f_ms / 1e9,
            "fwd_bwd_tflops": 3.5 * flops / fb_ms / 1e9}


def cudnn_nested_probe(min_len: int):
    """SDPA restricted to the cuDNN backend on nested jagged tensors: the only ragged route to cuDNN in torch.
    GQA is expanded (NJT SDPA refuses training with fewer KV heads). Not a registered backend; see the
    comment in kernels/attention.py."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def attn(q, k, v, *, cu_seqlens, max_seqlen, sliding_window=None, scale=None, attention_mask=None):
        if sliding_window is not None:
            raise RuntimeError("cuDNN SDPA has no sliding window")
        B, T, Hq, D = q.shape
        rep = Hq // k.shape[2]
        qf = q.reshape(B * T, Hq, D)
        kf = k.reshape(B * T, -1, D).repeat_interleave(rep, dim=1)
        vf = v.reshape(B * T, -1, D).repeat_interleave(rep, dim=1)
        offsets = cu_seqlens.long()

        def nested(x):  # [docs, j, H, D] -> [docs, H, j, D]
            return torch.nested.nested_tensor_from_jagged(x, offsets, min_seqlen=min_len,
                                                          max_seqlen=max_seqlen).transpose(1, 2)

        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            out = F.scaled_dot_product_attention(nested(qf), nested(kf), nested(vf), is_causal=True, scale=scale)
        return out.transpose(1, 2).values().view(B, T, Hq, D)

    return attn


def run_attention(args, pool: list[int]) -> None:
    rng = random.Random(args.seed)
    docs = pack_row(pool, args.T, rng)
    print(f"\n== attention: T={args.T}, {len(docs)} documents, mean {args.T / len(docs):.0f}, "
          f"max {max(docs)}, min {min(docs)}; fwd FLOPs {attention_flops(docs) / 1e12:.2f} T", flush=True)
    try:
        from torch.nn.attention.varlen import varlen_attn
        print(f"varlen_attn{inspect.signature(varlen_attn)}")
    except Exception as e:  # noqa: BLE001
        print(f"varlen_attn not importable: {short_error(e)}")

    backends: list[tuple[str, object]] = [("sdpa", None), ("varlen", None), ("flex", None), ("fa4_op", None),
                                          ("cudnn-nested (probe, not registered)", cudnn_nested_probe(min(docs)))]
    for i, (name, fn) in enumerate(backends):
        row: dict = {"section": "attention", "backend": name, "T": args.T, "docs": len(docs)}
        try:
            if fn is None:
                fn = get_attention(name)
        except Exception as e:  # noqa: BLE001
            record(**row, skipped=short_error(e))
            continue
        try:
            row.update(check_attention(name, fn, docs, args.T, seed=100 + i, window=None))
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            record(**row, error=short_error(e))
            torch.cuda.empty_cache()
            continue
        if name == "flex":
            row.update(flex_mask_cost(fn, docs, args.T))
        try:
            if name == "sdpa":
                row["note"] = "per-document loop with host sync: the reference, timed for scale only"
            row.update(time_attention(fn, docs, args.T, seed=200 + i))
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            row["time_error"] = short_error(e)
        record(**row)
        torch.cuda.empty_cache()

    if args.skip_window:
        return
    for i, name in enumerate(("varlen", "flex", "fa4_op")):
        row = {"section": "attention-window", "backend": name, "T": args.T, "window": WINDOW}
        try:
            fn = get_attention(name)
        except Exception as e:  # noqa: BLE001
            record(**row, skipped=short_error(e))
            continue
        try:
            row.update(check_attention(name, fn, docs, args.T, seed=300 + i, window=WINDOW))
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            row["error"] = short_error(e)
        record(**row)
        torch.cuda.empty_cache()


def flex_mask_cost(flex: FlexAttention, docs: list[int], T: int) -> dict:
    """Block-mask build per batch: a new cu_seqlens tensor each time, so the cache never hits."""
    rng = random.Random(7)
    cus = []
    for _ in range(8):
        d = [rng.choice(docs) for _ in range(len(docs))]
        d = pack_row(d, T, rng)
        cus.append(torch.tensor([0, *itertools.accumulate(d)], dtype=torch.int32, device=DEVICE))
    dev = torch.device(DEVICE)
    flex.block_mask(cus[0], 1, T, None, dev)  # warm: check_attention compiled the builder already
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for cu in cus[1:]:
        flex.block_mask(cu, 1, T, None, dev)
    torch.cuda.synchronize()
    build_ms = (time.perf_counter() - t0) * 1e3 / (len(cus) - 1)
    # a new batch must not recompile the kernels (past the recompile limit flex would fall back to eager)
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    q, k, v, dout = make_qkvg(T, 9)
    for cu in cus[1:4]:
        fwd_bwd(flex, q, k, v, dout, cu_seqlens=cu, max_seqlen=T)
    torch.cuda.synchronize()
    return {"mask_build_ms": build_ms, "new_graphs_over_3_batches": counters["stats"]["unique_graphs"] - before}


# ---------------------------------------------------------------------------------------------- loss


def loss_inputs(N: int, seed: int, train_weight: bool):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    hidden = torch.randn(N, DMODEL, device=DEVICE, dtype=torch.bfloat16, generator=g).requires_grad_()
    weight = (torch.randn(VOCAB, DMODEL, device=DEVICE, dtype=torch.bfloat16, generator=g) * 0.02)
    weight.requires_grad_(train_weight)
    targets = torch.randint(0, VOCAB, (N,), device=DEVICE, generator=g)
    targets[torch.rand(N, device=DEVICE, generator=g) < 0.3] = -100  # prompt tokens carry no loss
    return hidden, weight, targets


def materialised_bf16(hidden, weight, targets):
    """What an unfused model does: bf16 logits [N, V], upcast, F.cross_entropy."""
    logits = hidden @ weight.t()
    return F.cross_entropy(logits.float(), targets, ignore_index=-100, reduction="sum")


def peak_gib(fn, params) -> float:
    for p in params:
        p.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    for p in params:
        p.grad = None
    return peak / 2**30


def run_loss(args) -> None:
    N = args.loss_tokens
    print(f"\n== loss: N={N}, V={VOCAB}, D={DMODEL}, bf16; GEMM FLOPs 2*N*V*D = "
          f"{2 * N * VOCAB * DMODEL / 1e12:.1f} T each (2 with a frozen head, 3 when it trains)", flush=True)
    compiled_whole = torch.compile(lambda h, w, t: linear_cross_entropy(h, w, t, chunk_size=4096))
    variants = [
        ("fused eager", dict(chunk_size=2048)), ("fused eager", dict(chunk_size=4096)),
        ("fused eager", dict(chunk_size=8192)), ("fused compiled-step", dict(chunk_size=2048, step="compiled")),
        ("fused compiled-step", dict(chunk_size=4096, step="compiled")),
        ("fused triton-step", dict(chunk_size=2048, step="triton")),
        ("fused triton-step", dict(chunk_size=4096, step="triton")),
    ]
    for seed, train_weight in enumerate((False, True)):
        head = "trainable" if train_weight else "frozen"
        hidden, weight, targets = loss_inputs(N, 1000 + seed, train_weight)
        params = [hidden, weight] if train_weight else [hidden]
        gemms = 3 if train_weight else 2
        flops = gemms * 2 * N * VOCAB * DMODEL

        ref = None
        try:
            ref_loss = reference_linear_cross_entropy(hidden, weight, targets)
            ref_loss.backward()
            ref = (ref_loss.detach(), hidden.grad, weight.grad)
            hidden.grad = weight.grad = None
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            record(section="loss", variant="reference fp32", head=head, error=short_error(e))

        all_variants = [*variants, ("materialised bf16 logits", None), ("whole-function torch.compile (probe)", None)]
        for name, kw in all_variants:
            row: dict = {"section": "loss", "variant": name, "head": head, "N": N,
                         "chunk": (kw or {}).get("chunk_size", 4096 if "compile" in name else None)}
            if name.startswith("materialised"):
                def fn():
                    return materialised_bf16(hidden, weight, targets)
            elif name.startswith("whole-function"):
                def fn():
                    return compiled_whole(hidden, weight, targets)
            else:
                def fn(kw=kw):
                    return linear_cross_entropy(hidden, weight, targets, **kw)
            try:
                for p in params:
                    p.grad = None
                t0 = time.perf_counter()
                loss = fn()
                loss.backward()
                torch.cuda.synchronize()
                row["first_call_s"] = round(time.perf_counter() - t0, 2)
                if ref is not None:
                    row["rel_loss"] = rel(loss.detach(), ref[0])
                    row["rel_grad_hidden"] = rel(hidden.grad, ref[1])
                    if train_weight:
                        row["rel_grad_weight"] = rel(weight.grad, ref[2])
                row["ms"] = bench_ms(lambda: fn().backward(), grad_to_none=params, rep=400)
                row["gemm_tflops"] = flops / row["ms"] / 1e9
                row["peak_gib"] = peak_gib(lambda: fn().backward(), params)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                row["error"] = short_error(e)
            record(**row)
            torch.cuda.empty_cache()
        del hidden, weight, targets, ref
        torch.cuda.empty_cache()


def run_loss_step() -> None:
    from gapless.kernels import loss as loss_mod

    c = 2048
    print(f"\n== loss step alone: float32 logits [{c}, {VOCAB}] -> loss, bf16 gradient", flush=True)
    g = torch.Generator(device=DEVICE).manual_seed(7)
    logits = torch.randn(c, VOCAB, device=DEVICE, generator=g) * 4
    targets = torch.randint(0, VOCAB, (c,), device=DEVICE, generator=g)
    targets[torch.rand(c, device=DEVICE, generator=g) < 0.3] = -100
    ref_loss, ref_g = loss_mod._step_functional(logits, targets, -100, torch.bfloat16)
    compiled = loss_mod._compiled_step()
    variants = [("compiled", lambda: compiled(logits, targets, -100, torch.bfloat16))]
    for block_v, warps in ((2048, 4), (4096, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16), (32768, 32)):
        variants.append((f"triton {block_v}/{warps}w", lambda b=block_v, w=warps: loss_mod._step_triton(
            logits, targets, -100, torch.bfloat16, block_v=b, num_warps=w)))
    for name, fn in variants:
        row: dict = {"section": "loss-step", "variant": name, "rows": c}
        try:
            loss, grad = fn()
            row["rel_loss"], row["rel_grad"] = rel(loss, ref_loss), rel(grad.float(), ref_g.float())
            row["ms"] = bench_ms(fn, rep=200)
            row["gb_s_at_10b"] = c * VOCAB * 10 / row["ms"] / 1e6
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            row["error"] = short_error(e)
        record(**row)


# --------------------------------------------------------------------------------------------- table


def print_table() -> None:
    def f(x, spec):  # a number in `spec`, or "-" padded to the same width
        if isinstance(x, (int, float)) and not isinstance(x, bool):
            return format(x, spec)
        return "-".rjust(int("".join(itertools.takewhile(str.isdigit, spec)) or 1))

    print("\n== attention (bf16, fwd+bwd vs fp32 reference; TFLOP/s counts 3.5x the causal forward)")
    print(f"{'backend':38} {'fwd ms':>7} {'f+b ms':>7} {'TFLOP/s':>8} {'rel out':>8} {'rel dq':>8} "
          f"{'rel dk':>8} {'rel dv':>8} {'1st s':>6}  note")
    for r in ROWS:
        if r["section"] not in ("attention", "attention-window"):
            continue
        name = r["backend"] + (f" w={r['window']}" if r["section"] == "attention-window" else "")
        note = r.get("skipped") or r.get("error") or r.get("time_error") or ""
        if "mask_build_ms" in r:
            note = (f"mask build {r['mask_build_ms']:.2f} ms/batch, {r['new_graphs_over_3_batches']} new graphs "
                    "over 3 new batches ") + note
        if "ok" in r and not r["ok"]:
            note = "ERRORS TOO LARGE " + note
        print(f"{name[:38]:38} {f(r.get('fwd_ms'), '7.3f')} {f(r.get('fwd_bwd_ms'), '7.3f')} "
              f"{f(r.get('fwd_bwd_tflops'), '8.0f')} {f(r.get('rel_out'), '8.1e')} {f(r.get('rel_dq'), '8.1e')} "
              f"{f(r.get('rel_dk'), '8.1e')} {f(r.get('rel_dv'), '8.1e')} {f(r.get('first_call_s'), '6.1f')}  "
              f"{note[:90]}")
    print("\n== loss (bf16 hidden, fwd+bwd; TFLOP/s counts the LM-head GEMMs only)")
    print(f"{'variant':38} {'head':9} {'chunk':>6} {'ms':>7} {'TFLOP/s':>8} {'peak GiB':>9} {'rel loss':>9} "
          f"{'rel dh':>8} {'rel dW':>8} {'1st s':>6}  note")
    for r in ROWS:
        if r["section"] != "loss":
            continue
        print(f"{r['variant'][:38]:38} {r['head']:9} {f(r.get('chunk'), '6d')} {f(r.get('ms'), '7.2f')} "
              f"{f(r.get('gemm_tflops'), '8.0f')} {f(r.get('peak_gib'), '9.2f')} {f(r.get('rel_loss'), '9.1e')} "
              f"{f(r.get('rel_grad_hidden'), '8.1e')} {f(r.get('rel_grad_weight'), '8.1e')} "
              f"{f(r.get('first_call_s'), '6.1f')}  {(r.get('error') or '')[:90]}")
    print("\n== loss step alone (float32 logits [2048, V] -> bf16 gradient; GB/s at 10 bytes per logit)")
    print(f"{'variant':24} {'ms':>7} {'GB/s':>7} {'rel loss':>9} {'rel grad':>9}  note")
    for r in ROWS:
        if r["section"] == "loss-step":
            print(f"{r['variant']:24} {f(r.get('ms'), '7.3f')} {f(r.get('gb_s_at_10b'), '7.0f')} "
                  f"{f(r.get('rel_loss'), '9.1e')} {f(r.get('rel_grad'), '9.1e')}  {(r.get('error') or '')[:90]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", help="file of whitespace-separated document lengths (tokens)")
    p.add_argument("--T", type=int, default=16384, help="tokens in the packed row")
    p.add_argument("--loss-tokens", type=int, default=16384)
    p.add_argument("--only", choices=("attention", "loss"))
    p.add_argument("--skip-window", action="store_true", help="skip the sliding-window checks")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/kernels_gpu.py needs a CUDA GPU")
    torch.manual_seed(args.seed)
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    try:
        import flash_attn
        fa = getattr(flash_attn, "__version__", "installed")
    except ImportError:
        fa = None
    pool, pool_note = document_pool(args.lengths, args.seed)
    env = {"section": "env", "torch": torch.__version__, "cuda": torch.version.cuda,
           "cudnn": torch.backends.cudnn.version(), "triton": triton_version, "flash_attn": fa,
           "gpu": torch.cuda.get_device_name(), "lengths": pool_note}
    record(**env)
    if fa is None:
        print("note: flash-attn-4 is not installed here, so 'fa4_op' is skipped (see shared/peers/README.md)")
    t0 = time.perf_counter()
    if args.only in (None, "attention"):
        run_attention(args, pool)
    if args.only in (None, "loss"):
        run_loss(args)
        run_loss_step()
    print_table()
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    out = os.environ.get("OUT")
    if out:
        with open(Path(out) / "kernels.jsonl", "w") as fh:
            for r in ROWS:
                fh.write(json.dumps(r) + "\n")
        print(f"wrote {Path(out) / 'kernels.jsonl'}")


if __name__ == "__main__":
    main()
