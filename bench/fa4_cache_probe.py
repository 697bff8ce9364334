"""Whether a second process takes flash-attn-4's kernels from gapless's disk cache (issue 18, start-up).

    python bench/fa4_cache_probe.py [--cache DIR] [--runs 2]

Session 15's warm start-up, under cProfile, still spent 12.9 s in the CuTe DSL compiler (5 compiles)
with FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 (gapless.kernels.attention.fa4_disk_cache). This runs the fa4_op
backend's forward and backward on Llama-3.2-3B's attention shapes (24 query heads, 8 key/value heads, head dim 128,
bf16, packed causal documents) in --runs fresh processes over one empty cache folder, with flash-attn-4's host log
on (FA_LOG_LEVEL=1: "Cache miss on disk", "Loading compiled function from disk", "Exporting ..."), and prints per
process the seconds of its first forward + backward and those log lines, then the files the cache holds. Needs a
CUDA GPU and flash-attn-4 importable.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CACHE_WORDS = ("cache", "Cache", "export", "Export", "Loading", "Unloadable")


def child() -> None:
    t0 = time.perf_counter()
    import torch

    from gapless.kernels.attention import get_attention

    attention = get_attention("fa4_op")
    imported = time.perf_counter() - t0
    torch.manual_seed(0)
    lengths = [700, 37, 1290, 2048, 12309]  # 16,384 tokens in 5 documents
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    shape = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(1, sum(lengths), 24, 128, **shape, requires_grad=True)
    k, v = (torch.randn(1, sum(lengths), 8, 128, **shape, requires_grad=True) for _ in range(2))
    times = []
    for _ in range(2):
        t = time.perf_counter()
        attention(q, k, v, cu_seqlens=cu, max_seqlen=max(lengths)).sum().backward()
        torch.cuda.synchronize()
        times.append(round(time.perf_counter() - t, 3))
    print(json.dumps({"imports_s": round(imported, 2), "first_s": times[0], "second_s": times[1]}), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", type=Path, default=None, help="the cache folder (default: a new empty one)")
    p.add_argument("--runs", type=int, default=2)
    opts = p.parse_args()
    cache = opts.cache or Path(tempfile.mkdtemp(prefix="fa4-cache-"))
    if opts.cache is not None:
        shutil.rmtree(cache, ignore_errors=True)
    env = {**os.environ, "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED": "1", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR":
           str(cache), "FA_LOG_LEVEL": "1"}
    for run in range(opts.runs):
        t = time.perf_counter()
        done = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True)
        lines = (done.stdout + done.stderr).splitlines()
        print(f"== process {run + 1}: rc {done.returncode}, {time.perf_counter() - t:.1f} s")
        for line in lines:
            if line.startswith("{") or any(w in line for w in CACHE_WORDS) or done.returncode:
                print("  " + line[:300])
    print("== cache files")
    for f in sorted(cache.rglob("*")):
        if f.is_file():
            print(f"  {f.stat().st_size:>10,}  {f.relative_to(cache)}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--child"]:
        child()
    else:
        sys.exit(main())
