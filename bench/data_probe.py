"""Why cold data takes 9.5-14 s on the GPU machines (issue 18, start-up): the tokenizing workers fork from a process
with or without a CUDA context.

    python bench/data_probe.py [--data DIR] [--tokenizer DIR] [--workers N]

On the 2-core CPU box a cProfile of build_data (shared messages, 2 workers, 9.1 s) put about 3 s in the parent and
5.7 s waiting on the workers, so 16 cores should take about 4 s; the GPU machines' cold starts took 9.5-14 s
(bench/RESULTS.md, eleventh and twelfth rounds). `gapless train` builds the data after the model is loaded, so its
workers fork from a process holding a CUDA context and the weights. This runs, each in a fresh process over an
empty token cache:
  plain   build_data in a process that imported torch and nothing more;
  cuda    the same after a CUDA context and a 6 GiB tensor on the GPU (a 3B model's bf16 weights);
and, in each, how long forking the worker pool alone takes (N trivial tasks through a fork ProcessPoolExecutor).
Prints one line per mode. DATA and the tokenizer default to ../shared (else .carry/) as bench/startup_gpu.py's do.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def first_dir(*candidates: Path) -> Path:
    return next((c for c in candidates if c.is_dir()), candidates[-1])


def _nothing(i: int) -> int:
    return i


def child(mode: str, data: Path, tokenizer: Path, workers: int) -> dict:
    import torch

    from gapless.config import DataConfig, SourceConfig
    from gapless.data.pipeline import build_data

    if mode == "cuda":
        torch.cuda.init()
        weights = torch.empty(3 * 2**30, dtype=torch.bfloat16, device="cuda")  # 6 GiB held, as a loaded model's
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        list(pool.map(_nothing, range(workers)))
    fork_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as cache:
        cfg = DataConfig(sources=[SourceConfig(path=str(data))], cache_dir=cache, max_seq_len=4096,
                         tokens_per_batch=16384)
        t0 = time.perf_counter()
        mix, _, summary = build_data(cfg, tokenizer, num_workers=workers)
        data_s = time.perf_counter() - t0
    return {"mode": mode, "workers": workers, "fork_pool_s": round(fork_s, 3), "build_data_s": round(data_s, 3),
            "documents": len(mix)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=first_dir(ROOT.parent / "shared" / "data" / "messages",
                                                          ROOT / ".carry" / "messages"))
    p.add_argument("--tokenizer", type=Path, default=first_dir(ROOT.parent / "shared" / "tokenizers" / "llama3",
                                                               ROOT / ".carry" / "tokenizers" / "llama3"))
    p.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--modes", default="plain,cuda")
    p.add_argument("--child", help=argparse.SUPPRESS)
    opts = p.parse_args()
    if opts.child:
        print(json.dumps(child(opts.child, opts.data, opts.tokenizer, opts.workers)))
        return 0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    for mode in opts.modes.split(","):
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, __file__, "--child", mode, "--data", str(opts.data), "--tokenizer",
                              str(opts.tokenizer), "--workers", str(opts.workers)], env=env, capture_output=True,
                             text=True)
        lines = out.stdout.strip().splitlines()
        if out.returncode or not lines:
            print(f"[data_probe] {mode}: failed ({out.returncode}): {out.stderr.strip()[-600:]}", flush=True)
            continue
        print(f"[data_probe] {lines[-1]} process {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
