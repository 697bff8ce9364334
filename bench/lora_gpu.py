"""Time LoRA's fused kernel against the reference on one Llama-3.2-3B decoder layer (one H200, ~2-3 minutes).

    PYTHONPATH=src python3 bench/lora_gpu.py [--tokens 16384] [--rank 16] [--reps 25] [--device cuda]

The seven projections of one layer, as LoraLinear modules (the training path's own code), bf16 activations and
base weights, float32 adapter weights, r = 16, alpha = 32 (scaling 2): q 3072->3072, k and v 3072->1024,
o 3072->3072, gate and up 3072->8192, down 8192->3072, on N = 16,384 tokens. Every input needs its gradient
(a middle layer), the base weights are frozen.

(a) Check: each projection's output, dx, dA and dB from the fused kernel (eager and torch.compile'd) and from the
    bf16 reference, each against the reference run in float32 on the same inputs and weights upcast
    (‖x − ref‖ / ‖ref‖). bf16 lands near 3e-3; a row is ok when every error is below 1e-2 and the fused kernel's
    is at most 1.5x the bf16 reference's plus 1e-3. Fused against the bf16 reference directly is printed too.
(b) Time: forward and forward+backward of the seven projections for reference and fused, eager and compiled
    (torch.compile of one function that runs all seven, dynamic=True as compile_layers does), median of --reps
    CUDA-event timings after warm-up, and the peak memory the step allocates above its inputs and weights.

One JSON object per line on stdout ("section": "check" or "time"); the last line is a summary. Exit status 1 when
a check fails. --device cpu (with a few --tokens) runs the same code as a smoke test, timed on the host clock.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from torch import nn

from gapless.kernels.lora import lora_linear_reference
from gapless.model.lora import LoraLinear

HIDDEN, KV, INTERMEDIATE, LAYERS = 3072, 1024, 8192, 28  # Llama-3.2-3B (24 query heads, 8 KV heads of 128)
# name -> (input, in_features, out_features); inputs: the attention block's normed input, attention's output,
# the MLP block's normed input, and act(gate) * up
PROJECTIONS = {
    "q_proj": ("x_attn", HIDDEN, HIDDEN), "k_proj": ("x_attn", HIDDEN, KV), "v_proj": ("x_attn", HIDDEN, KV),
    "o_proj": ("attn_out", HIDDEN, HIDDEN),
    "gate_proj": ("x_mlp", HIDDEN, INTERMEDIATE), "up_proj": ("x_mlp", HIDDEN, INTERMEDIATE),
    "down_proj": ("mlp_act", INTERMEDIATE, HIDDEN),
}
INPUT_FEATURES = {"x_attn": HIDDEN, "attn_out": HIDDEN, "x_mlp": HIDDEN, "mlp_act": INTERMEDIATE}


def emit(**row) -> None:
    print(json.dumps(row), flush=True)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def build_layer(kernel: str, rank: int, alpha: float, device: str, seed: int = 0) -> nn.ModuleDict:
    """The seven LoraLinear projections; the same seed gives the same weights for either kernel. B is drawn
    off zero (std 0.02, about a trained adapter's size relative to W) so the update is checked and timed."""
    torch.manual_seed(seed)
    layer = nn.ModuleDict()
    for name, (_, d_in, d_out) in PROJECTIONS.items():
        base = nn.Linear(d_in, d_out, bias=False, device=device, dtype=torch.bfloat16)
        nn.init.normal_(base.weight, std=d_in ** -0.5)
        layer[name] = LoraLinear(base, rank, alpha / rank, 0.0, torch.float32, kernel=kernel)
        nn.init.normal_(layer[name].lora_B.weight, std=0.02)
    for pname, p in layer.named_parameters():
        p.requires_grad_(".lora_" in pname)
    return layer


def make_inputs(tokens: int, device: str, seed: int = 1) -> tuple[dict, dict]:
    """bf16 inputs [N, in] that need their gradient, and the gradients of the seven outputs [N, out]."""
    g = torch.Generator(device=device).manual_seed(seed)
    xs = {k: torch.randn(tokens, d, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
          for k, d in INPUT_FEATURES.items()}
    dys = {name: torch.randn(tokens, d_out, device=device, dtype=torch.bfloat16, generator=g)
           for name, (_, _, d_out) in PROJECTIONS.items()}
    return xs, dys


def projections(layer: nn.ModuleDict, x_attn, attn_out, x_mlp, mlp_act) -> tuple[torch.Tensor, ...]:
    inputs = {"x_attn": x_attn, "attn_out": attn_out, "x_mlp": x_mlp, "mlp_act": mlp_act}
    return tuple(layer[name](inputs[src]) for name, (src, _, _) in PROJECTIONS.items())


def clear_grads(layer: nn.ModuleDict, xs: dict) -> None:
    for t in [*layer.parameters(), *xs.values()]:
        t.grad = None


def fwd_bwd(fn, layer, xs, dys) -> None:
    outs = fn(layer, *xs.values())
    torch.autograd.backward(outs, list(dys.values()))


def results(fn, layer, xs, dys) -> dict[str, dict[str, torch.Tensor]]:
    """projection -> {out, dx, dA, dB} of one forward+backward. dx is the projection's own share of its input's
    gradient: q, k and v (and gate and up) share an input, so each is run alone with fresh input leaves."""
    found = {}
    for name, (src, _, _) in PROJECTIONS.items():
        x = xs[src].detach().clone().requires_grad_()
        clear_grads(layer, {})
        out = fn(layer[name], x)
        out.backward(dys[name])
        found[name] = {"out": out.detach(), "dx": x.grad, "dA": layer[name].lora_A.weight.grad,
                       "dB": layer[name].lora_B.weight.grad}
    clear_grads(layer, {})
    return found


def float32_reference(layer, xs, dys) -> dict[str, dict[str, torch.Tensor]]:
    """The plain formula in float32 on the same bf16 inputs and weights upcast."""
    found = {}
    for name, (src, _, _) in PROJECTIONS.items():
        m = layer[name]
        x = xs[src].detach().float().requires_grad_()
        a, b = (w.detach().clone().requires_grad_() for w in (m.lora_A.weight, m.lora_B.weight))
        out = lora_linear_reference(x, m.weight.float(), None, a, b, m.scaling)
        out.backward(dys[name].float())
        found[name] = {"out": out.detach(), "dx": x.grad, "dA": a.grad, "dB": b.grad}
    return found


def check(variants: dict, layer_of: dict, xs, dys) -> bool:
    ref32 = float32_reference(layer_of["reference"], xs, dys)
    got = {label: results(fn, layer_of[label.split("/")[0]], xs, dys) for label, fn in variants.items()}
    ok_all = True
    for name in PROJECTIONS:
        for quantity in ("out", "dx", "dA", "dB"):
            want = ref32[name][quantity]
            errors = {label: rel(got[label][name][quantity], want) for label in got}
            finite = all(bool(torch.isfinite(got[label][name][quantity]).all()) for label in got)
            bf16_ref = errors["reference/eager"]
            ok = finite and all(e < 1e-2 for e in errors.values()) and all(
                e <= 1.5 * bf16_ref + 1e-3 for label, e in errors.items() if label.startswith("fused"))
            ok_all &= ok
            emit(section="check", projection=name, quantity=quantity, ok=ok, finite=finite,
                 rel_vs_fp32={k: round(v, 6) for k, v in errors.items()},
                 fused_vs_bf16_reference=round(rel(got["fused/eager"][name][quantity],
                                                   got["reference/eager"][name][quantity]), 6),
                 dtype=str(got["fused/eager"][name][quantity].dtype).removeprefix("torch."))
    return ok_all


class Clock:
    """CUDA events on the GPU (no host sync between them), the host clock on the CPU."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")

    def time_ms(self, fn) -> float:
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)


def time_variant(label: str, fn, layer, xs, dys, clock: Clock, warmup: int, reps: int, tokens: int) -> dict:
    def step():
        fwd_bwd(fn, layer, xs, dys)

    def forward():
        fn(layer, *xs.values())  # with autograd recording, as in training; the saved tensors are dropped

    t0 = time.perf_counter()
    clear_grads(layer, xs)
    step()  # the compiled variants compile here
    if clock.cuda:
        torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    for _ in range(warmup):
        clear_grads(layer, xs)
        step()
    samples = []
    for _ in range(reps):
        clear_grads(layer, xs)  # host-side only: .grad = None
        samples.append(clock.time_ms(step))
    fwd_samples = [clock.time_ms(forward) for _ in range(reps)]
    peak_mib = None
    if clock.cuda:
        clear_grads(layer, xs)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak_mib = round((torch.cuda.max_memory_allocated() - before) / 2**20, 1)
    ms = statistics.median(samples)
    return {"section": "time", "variant": label, "tokens": tokens, "fwd_bwd_ms_per_layer": round(ms, 3),
            "fwd_ms_per_layer": round(statistics.median(fwd_samples), 3),
            "fwd_bwd_ms_min": round(min(samples), 3), f"fwd_bwd_ms_x{LAYERS}_layers": round(ms * LAYERS, 1),
            "peak_mib_above_inputs": peak_mib, "first_step_s": round(first_s, 2), "reps": reps}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--reps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--no-compile", action="store_true", help="eager variants only")
    args = parser.parse_args()

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench/lora_gpu.py: no CUDA device; pass --device cpu --tokens 64 for a smoke test", file=sys.stderr)
        return 2
    layer_of = {k: build_layer(k, args.rank, args.alpha, args.device) for k in ("reference", "fused")}
    xs, dys = make_inputs(args.tokens, args.device)
    emit(section="setup", torch=torch.__version__, device=(torch.cuda.get_device_name() if args.device != "cpu"
                                                            else "cpu"),
         tokens=args.tokens, rank=args.rank, scaling=args.alpha / args.rank,
         projections={k: [d_in, d_out] for k, (_, d_in, d_out) in PROJECTIONS.items()})

    def run_one(module, x):  # one projection, for the check
        return module(x)

    variants = {f"{k}/eager": projections for k in ("reference", "fused")}
    check_fns = {f"{k}/eager": run_one for k in ("reference", "fused")}
    if not args.no_compile:
        for k in ("reference", "fused"):
            variants[f"{k}/compiled"] = torch.compile(projections, dynamic=True)
        check_fns["fused/compiled"] = torch.compile(run_one, dynamic=True)

    ok = check(check_fns, layer_of, xs, dys)
    clock = Clock(args.device)
    rows = {}
    for label, fn in variants.items():
        rows[label] = time_variant(label, fn, layer_of[label.split("/")[0]], xs, dys, clock, args.warmup,
                                   args.reps, args.tokens)
        emit(**rows[label])
    summary = {"section": "summary", "checks_ok": ok}
    for mode in ("eager", "compiled"):
        if f"fused/{mode}" in rows:
            ref, fused = rows[f"reference/{mode}"], rows[f"fused/{mode}"]
            saved = ref["fwd_bwd_ms_per_layer"] - fused["fwd_bwd_ms_per_layer"]
            summary[mode] = {"saved_ms_per_layer": round(saved, 3), f"saved_ms_x{LAYERS}_layers": round(saved * LAYERS, 1),
                             "speedup": round(ref["fwd_bwd_ms_per_layer"] / fused["fwd_bwd_ms_per_layer"], 3),
                             "peak_mib_reference": ref["peak_mib_above_inputs"],
                             "peak_mib_fused": fused["peak_mib_above_inputs"]}
    emit(**summary)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
