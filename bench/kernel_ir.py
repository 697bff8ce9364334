"""What Triton makes of the fused LoRA dropout kernels, without a GPU: each kernel compiled for a CUDA target (sm_90
by default) on the CPU, and in its TTGIR the layout conversions inside the main loop (each a trip through shared
memory with barriers), the shared-memory copies, whether the loop's dots are waited for at once (no overlap with the
next tile's loads), and the Philox multiplies per thread in the PTX.

    PYTHONPATH=src python3 bench/kernel_ir.py [--arch 90] [--ttgir]

Needs a triton whose wheel carries ptxas (any Linux x86 wheel); the CPU-only torch is enough. The kernels at the
library's blocks and warps (gapless.kernels.lora_dropout), bf16 x, float32 A. Triton versions lay out differently:
the GPU machine's triton is 3.6, this box's may be newer; the counts say where conversions arise, the GPU says what
they cost (bench/dropout_probe.py).

Compiled as a launch specializes (launch_attrs: pointers aligned, integer arguments at Llama-3.2-3B's q/k/v shape
divisible by 16), session 23 on this box (triton 3.9, sm_90): the forward's loop converts no layout (x is loaded 8
bf16 to a thread, the mask is drawn in that layout and its joins stay in registers); the backward's converts 4 times a
tile: two of the joins' halves, because the mask is built in two layouts (one for x, one for dx), the mask into the
dots' accumulator layout for dx, and dx back for its store. Both loops wait for their dots at once. Session 22's
counts (4 and 8) came from a compile without those attributes: unvectorised loads, layouts no launch makes.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from gapless.kernels import lora_dropout  # noqa: E402
from gapless.kernels import lora_dropout_triton as kernels  # noqa: E402

FORWARD_SIGNATURE = {"x_ptr": "*bf16", "a_ptr": "*fp32", "out_ptr": "*bf16", "seed_ptr": "*i64", "N": "i32",
                     "K": "i32", "R": "i32", "k_per_split": "i32", "threshold": "i32", "scale": "fp32"}
BACKWARD_SIGNATURE = {"x_ptr": "*bf16", "a_ptr": "*fp32", "dxa_ptr": "*bf16", "dx_ptr": "*bf16", "da_ptr": "*fp32",
                      "seed_ptr": "*i64", "N": "i32", "K": "i32", "R": "i32", "rows_per_split": "i32",
                      "threshold": "i32", "scale": "fp32"}


def loop_lines(ttgir: str) -> list[str]:
    """The lines of the first scf.for's body (the kernels have one main loop), by brace depth."""
    lines, depth, inside = [], 0, False
    for line in ttgir.splitlines():
        if not inside and "scf.for" in line:
            inside = True
        if inside:
            lines.append(line)
            depth += line.count("{") - line.count("}")
            if depth <= 0 and len(lines) > 1:
                break
    return lines


def launch_attrs(signature: dict, values: dict) -> dict:
    """What a launch specializes on: pointers aligned to 16 bytes (torch's allocations are) and integer arguments
    divisible by 16 at Llama-3.2-3B's shapes, as Triton's launcher marks them ("tt.divisibility" 16). Without these
    the loads are not vectorised and the layouts differ from the GPU's."""
    return {(i,): [["tt.divisibility", 16]] for i, (name, kind) in enumerate(signature.items())
            if kind.startswith("*") or values.get(name, 1) % 16 == 0}


def summary(kernel) -> dict:
    ttgir, ptx = kernel.asm["ttgir"], kernel.asm["ptx"]
    body = loop_lines(ttgir)
    waits = [re.search(r"pendings = (\d+)", line) for line in body if "dot_wait" in line]
    return {"loop converts": sum("convert_layout" in line for line in body),
            "loop shared copies": sum("local_alloc" in line for line in body),
            "loop dots": sum("warp_group_dot " in line or "tt.dot " in line for line in body),
            "dots waited at once": sum(1 for w in waits if w and w.group(1) == "0"),
            "converts in all": ttgir.count("convert_layout"),
            "mul.hi.u32 (Philox)": len(re.findall(r"mul\.hi\.u32", ptx))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: Hopper)")
    ap.add_argument("--ttgir", action="store_true", help="print each kernel's loop, its conversions marked")
    args = ap.parse_args(argv)
    target = GPUTarget("cuda", args.arch, 32)
    rounds = kernels.PHILOX_ROUNDS
    n, k, r = 16384, 3072, 48  # Llama-3.2-3B's q/k/v A at 16,384 tokens
    _, k_per_split = lora_dropout._forward_splits(k, lora_dropout.FWD_BLOCK_K, lora_dropout.FWD_SPLIT_K)
    _, rows_per_split = lora_dropout._backward_splits(n, k, lora_dropout.BWD_BLOCK_M, lora_dropout.BWD_BLOCK_K,
                                                      lora_dropout.BACKWARD_PROGRAMS)
    values = dict(N=n, K=k, R=r, k_per_split=k_per_split, rows_per_split=rows_per_split,
                  threshold=lora_dropout.keep_threshold(0.05))
    jobs = {
        "forward": (kernels.dropout_xa_kernel, FORWARD_SIGNATURE,
                    dict(BLOCK_M=lora_dropout.FWD_BLOCK_M, BLOCK_K=lora_dropout.FWD_BLOCK_K, BLOCK_R=64, IEEE=False,
                         N_ROUNDS=rounds), lora_dropout.FWD_WARPS),
        "backward": (kernels.dropout_xa_backward_kernel, BACKWARD_SIGNATURE,
                     dict(BLOCK_M=lora_dropout.BWD_BLOCK_M, BLOCK_K=lora_dropout.BWD_BLOCK_K, BLOCK_R=64, NEED_DX=True,
                          IEEE=False, N_ROUNDS=rounds), lora_dropout.BWD_WARPS),
    }
    print(f"triton {triton.__version__}, sm_{args.arch}, BLOCK_R 64 (q/k/v's R 48), {rounds} Philox rounds")
    for name, (fn, signature, constants, warps) in jobs.items():
        source = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=launch_attrs(signature, values))
        compiled = triton.compile(source, target=target,
                                  options={"num_warps": warps})
        print(f"{name}: " + ", ".join(f"{k} {v}" for k, v in summary(compiled).items()))
        if args.ttgir:
            for line in loop_lines(compiled.asm["ttgir"]):
                mark = ">>" if "convert_layout" in line else "  "
                print(f"  {mark} {line.strip()[:200]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
