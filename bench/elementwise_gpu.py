"""The elementwise work of a Llama-3.2-3B step, as torch.compile fuses it against Liger's Triton kernels (issue 18,
item 4): forward + backward of each piece at one step's shape, timed with CUDA events, beside its memory-bound floor.

    python3 bench/elementwise_gpu.py [--tokens 16384] [--out FILE.jsonl]     (needs a GPU; Liger where it imports)

Pieces, each in the decoder's own code where it has one (gapless.model.decoder, gapless.kernels.loss):
- add_rmsnorm: the residual add and the next RMSNorm, h = x + r, y = RMSNorm(h) (Liger: LigerFusedAddRMSNormFunction)
- rmsnorm: RMSNorm alone (Liger: LigerRMSNormFunction)
- swiglu: silu(gate) * up at the intermediate size (Liger: LigerSiLUMulFunction)
- rope: q and k rotated, [1, T, heads, head_dim] as the decoder holds them (Liger: LigerRopeFunction, which takes
  [1, heads, T, head_dim]: the transposed views it is given are what a model calling it would pass)
- loss: the LM head and cross-entropy over the vocabulary without the [T, V] logits (gapless.kernels.loss's chunked
  loss, with the per-chunk step a compiled run uses, step "auto": the Triton kernel; Liger:
  LigerFusedLinearCrossEntropyFunction); here the floor is the head's 3 GEMMs

The floor of an elementwise piece is the bytes it must move (inputs read and outputs written once, forward and
backward) over the copy bandwidth measured here (a device-to-device copy of 1 GiB); the loss's is its FLOPs over
the bf16 matmul peak measured here. Each piece runs 3 warm-up and 20 timed iterations; its gradients are checked
against the compiled form's (max abs difference printed), so a faster kernel that computes something else shows.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from gapless.kernels.loss import linear_cross_entropy  # noqa: E402
from gapless.model.decoder import RMSNorm, apply_rope  # noqa: E402

H, I, NH, KV, HD, V, EPS = 3072, 8192, 24, 8, 128, 128256, 1e-5  # Llama-3.2-3B (bench/models/llama-3.2-3b)


def timed(fn, inputs: list[torch.Tensor], grads, iters: int = 20) -> float:
    """ms per forward + backward of fn(*inputs), the output gradients `grads` given."""
    def once():
        for t in inputs:
            t.grad = None
        outs = fn(*inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        torch.autograd.backward(outs, grads)
    for _ in range(3):
        once()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        once()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def copy_bandwidth(device) -> float:
    """Bytes per second of a device-to-device copy of 1 GiB (read + write counted)."""
    a = torch.empty(2**30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    torch.cuda.synchronize()
    return 2 * 2**30 * 10 / (start.elapsed_time(end) / 1e3)


def matmul_peak(device) -> float:
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ a
    end.record()
    torch.cuda.synchronize()
    return 2 * 8192**3 * 10 / (start.elapsed_time(end) / 1e3)


def grads_of(fn, inputs, grads):
    for t in inputs:
        t.grad = None
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    torch.autograd.backward(outs, grads)
    return [o.detach().float() for o in outs] + [t.grad.float() for t in inputs if t.grad is not None]


def pieces(T: int, device, liger: bool):
    """(name, inputs, output grads, bytes or FLOPs floor kind, compiled fn, liger fn or None)."""
    bf = torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape, grad=True, scale=1.0):
        t = (torch.randn(*shape, device=device, dtype=bf, generator=g) * scale)
        return t.requires_grad_(grad)

    norm = RMSNorm(H, EPS).to(device)
    norm.weight.data = torch.rand(H, device=device, generator=g) + 0.5
    w_bf = norm.weight.detach().to(bf)
    norm_bf = RMSNorm(H, EPS).to(device=device, dtype=bf)
    norm_bf.weight.data.copy_(w_bf)
    norm_bf.weight.requires_grad_(False)  # frozen, as under LoRA

    def add_rmsnorm(x, r):
        h = x + r
        return norm_bf(h), h

    def rmsnorm(x):
        return norm_bf(x)

    def swiglu(gate, up):
        return F.silu(gate) * up

    pos = torch.arange(T, device=device) % 1024  # positions restart per document; the values do not change the cost
    inv = 1.0 / (500000.0 ** (torch.arange(0, HD, 2, device=device).float() / HD))
    freqs = pos[:, None].float() * inv
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos().to(bf)[None], emb.sin().to(bf)[None]  # [1, T, D]

    def rope(q, k):
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    head = torch.randn(V, H, device=device, dtype=bf, generator=g) * 0.02  # frozen LM head
    targets = torch.randint(0, V, (T,), device=device, generator=g)

    def loss_ours(hidden):
        return linear_cross_entropy(hidden, head, targets, step="auto")  # as compile_layers sets it

    x, r = rand(T, H), rand(T, H)
    gate, up = rand(T, I), rand(T, I)
    q, k = rand(1, T, NH, HD), rand(1, T, KV, HD)
    hidden = rand(T, H)
    e = 2  # bytes per bf16 element
    out = [
        # add_rmsnorm: fwd reads x, r, writes y, h; bwd reads dy, dh, h, writes dx (= dr): 7 [T, H] passes
        ("add_rmsnorm", [x, r], [rand(T, H, grad=False), rand(T, H, grad=False)], 7 * T * H * e,
         torch.compile(add_rmsnorm, dynamic=False), None),
        # rmsnorm: fwd reads x, writes y; bwd reads dy, x, writes dx: 5 passes
        ("rmsnorm", [x], [rand(T, H, grad=False)], 5 * T * H * e, torch.compile(rmsnorm, dynamic=False), None),
        # swiglu: fwd reads gate, up, writes h; bwd reads dh, gate, up, writes dgate, dup: 8 [T, I] passes
        ("swiglu", [gate, up], [rand(T, I, grad=False)], 8 * T * I * e, torch.compile(swiglu, dynamic=False), None),
        # rope: fwd reads q, k, writes both; bwd the same: 4 passes of q and k (cos/sin are [T, D], small)
        ("rope", [q, k], [rand(1, T, NH, HD, grad=False), rand(1, T, KV, HD, grad=False)],
         4 * T * (NH + KV) * HD * e, torch.compile(rope, dynamic=False), None),
        # loss: the head is frozen (LoRA): 2 GEMMs of T x V x H (the logits, then dhidden, both in the forward for
        # ours and Liger's alike: neither recomputes in backward); the floor counts those 2
        ("loss", [hidden], [torch.ones((), device=device)], 2 * 2 * T * V * H, loss_ours, None),
    ]
    if liger:
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.rope import LigerRopeFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction

        def rope_liger(q, k):
            qo, ko = LigerRopeFunction.apply(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            return qo.transpose(1, 2), ko.transpose(1, 2)

        def loss_liger(hidden):
            return LigerFusedLinearCrossEntropyFunction.apply(hidden, head, targets, None, None, -100, 0.0, 0.0,
                                                              "sum")[0]

        liger_fns = {
            "add_rmsnorm": lambda x, r: LigerFusedAddRMSNormFunction.apply(x, r, w_bf, EPS, 0.0, "llama", False),
            "rmsnorm": lambda x: LigerRMSNormFunction.apply(x, w_bf, EPS, 0.0, "llama", False),
            "swiglu": LigerSiLUMulFunction.apply, "rope": rope_liger, "loss": loss_liger}
        out = [(n, i, gr, fl, c, liger_fns[n]) for n, i, gr, fl, c, _ in out]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--out", type=Path, default=None, help="append one JSON line per piece")
    opts = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("elementwise_gpu.py: no CUDA device; this benchmark times GPU kernels")
        return 2
    device = torch.device("cuda")
    try:
        import liger_kernel  # noqa: F401
        liger = True
    except ImportError:
        liger = False
        print("liger-kernel does not import: only the compiled forms are timed")
    bw, peak = copy_bandwidth(device), matmul_peak(device)
    gpu = torch.cuda.get_device_name(device)
    print(f"{gpu}: copy {bw / 1e12:.2f} TB/s, bf16 matmul {peak / 1e12:.0f} TFLOP/s; T = {opts.tokens}")
    print(f"{'piece':<12} {'floor ms':>9} {'compiled ms':>12} {'liger ms':>9} {'liger/compiled':>15} {'max |diff|':>11}")
    rows = []
    for name, inputs, grads, floor, compiled, liger_fn in pieces(opts.tokens, device, liger):
        floor_ms = floor / (peak if name == "loss" else bw) * 1e3
        # Liger's SwiGLU backward writes its gradients into the saved inputs (gate and up) in place: after it has
        # run, `inputs` hold gradients, not activations. Each comparison gets fresh copies of the values as drawn
        # (the first H100 run compared on overwritten inputs and printed a max |diff| of 8,192 for swiglu)
        drawn = [t.detach().clone() for t in inputs]

        def fresh():
            return [d.clone().requires_grad_(t.requires_grad) for d, t in zip(drawn, inputs)]
        c_ms = timed(compiled, inputs, grads)
        l_ms = diff = None
        if liger_fn is not None:
            try:
                l_ms = timed(liger_fn, fresh(), grads)
                ref, got = grads_of(compiled, fresh(), grads), grads_of(liger_fn, fresh(), grads)
                diff = max((a - b).abs().max().item() for a, b in zip(ref, got))
            except Exception as e:  # a Liger version whose signature differs: say so, keep the compiled row
                print(f"  {name}: liger failed: {type(e).__name__}: {e}")
        print(f"{name:<12} {floor_ms:>9.3f} {c_ms:>12.3f} {l_ms if l_ms is not None else float('nan'):>9.3f} "
              f"{(l_ms / c_ms) if l_ms else float('nan'):>15.2f} {diff if diff is not None else float('nan'):>11.3g}")
        rows.append({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "gpu": gpu, "piece": name,
                     "tokens": opts.tokens, "floor_ms": round(floor_ms, 3), "compiled_ms": round(c_ms, 3),
                     "liger_ms": None if l_ms is None else round(l_ms, 3), "max_abs_diff": diff,
                     "copy_tb_s": round(bw / 1e12, 3), "matmul_tflop_s": round(peak / 1e12, 1),
                     "command": "python3 bench/elementwise_gpu.py " + " ".join(argv or sys.argv[1:])})
    if opts.out:
        with opts.out.open("a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
