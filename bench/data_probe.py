"""Why cold data takes 9.5-14 s on the GPU machines (issue 18, start-up): the tokenizing workers fork from a process
with or without a CUDA context.

    python bench/data_probe.py [--data DIR] [--tokenizer DIR] [--workers N] [--modes plain,cuda] [--cprofile]

On the 2-core CPU box a cProfile of build_data (shared messages, 2 workers, 9.1 s) put about 3 s in the parent and
5.7 s waiting on the workers, so 16 cores should take about 4 s; the GPU machines' cold starts took 9.5-14 s
(bench/RESULTS.md, eleventh and twelfth rounds). `gapless train` builds the data after the model is loaded, so its
workers fork from a process holding a CUDA context and the weights. This runs, each in a fresh process over an
empty token cache:
  plain   build_data in a process that imported torch and nothing more;
  cuda    the same after a CUDA context and a 6 GiB tensor on the GPU (a 3B model's bf16 weights);
and, in each, how long forking the worker pool alone takes (N trivial tasks through a fork ProcessPoolExecutor).
--cprofile: build_data under cProfile, the parent's 25 functions of most time of their own printed after the line.
Measured on an H100 machine (session 16): 16 workers 18.6 s (plain) and 17.0 s (cuda), the pool's fork 0.2 s;
4 workers 21.6 s. So the CUDA context is not the cause, and 4x the workers saved 3-4 s: the parent's share is large.
Prints one line per mode. DATA and the tokenizer default to ../shared (else .carry/) as bench/startup_gpu.py's do.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import multiprocessing
import os
import pstats
import resource
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


def child(mode: str, data: Path, tokenizer: Path, workers: int, profile: bool) -> dict:
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
        profiler = cProfile.Profile() if profile else None
        own0, workers0 = (resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
        t0 = time.perf_counter()
        if profiler:
            profiler.enable()
        mix, _, summary = build_data(cfg, tokenizer, num_workers=workers)
        data_s = time.perf_counter() - t0
        own1, workers1 = (resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
        if profiler:
            profiler.disable()
            pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(25)
    from gapless.data.tokenize import available_cpus, cgroup_cpu_quota

    return {"mode": mode, "workers": workers, "affinity": len(os.sched_getaffinity(0)),
            "cgroup_cpu_quota": cgroup_cpu_quota(), "available_cpus": available_cpus(), "fork_pool_s": round(fork_s, 3),
            "build_data_s": round(data_s, 3),
            # CPU seconds (user + system) of this process and of its ended workers during build_data
            "parent_cpu_s": round(own1.ru_utime + own1.ru_stime - own0.ru_utime - own0.ru_stime, 2),
            "workers_cpu_s": round(workers1.ru_utime + workers1.ru_stime - workers0.ru_utime - workers0.ru_stime, 2),
            "documents": len(mix)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=first_dir(ROOT.parent / "shared" / "data" / "messages",
                                                          ROOT / ".carry" / "messages"))
    p.add_argument("--tokenizer", type=Path, default=first_dir(ROOT.parent / "shared" / "tokenizers" / "llama3",
                                                               ROOT / ".carry" / "tokenizers" / "llama3"))
    p.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                   help="tokenizer processes (default: the affinity mask's CPUs, not capped by a cgroup quota)")
    p.add_argument("--modes", default="plain,cuda")
    p.add_argument("--cprofile", action="store_true", help="the parent's own time by function, under cProfile")
    p.add_argument("--child", help=argparse.SUPPRESS)
    opts = p.parse_args()
    for what, folder in (("--data", opts.data), ("--tokenizer", opts.tokenizer)):
        if not folder.is_dir():  # on the GPU machine: `tar -xJf .carry/carry.tar.xz -C .carry` first (run_gpu.sh does)
            p.error(f"{what} {folder} is not a folder (carried as .carry/carry.tar.xz? unpack it into .carry/ first)")
    if opts.child:
        print(json.dumps(child(opts.child, opts.data, opts.tokenizer, opts.workers, opts.cprofile)))
        return 0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    for mode in opts.modes.split(","):
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, __file__, "--child", mode, "--data", str(opts.data), "--tokenizer",
                              str(opts.tokenizer), "--workers", str(opts.workers), *(["--cprofile"] * opts.cprofile)],
                             env=env, capture_output=True, text=True)
        lines = out.stdout.strip().splitlines()
        if out.returncode or not lines:
            print(f"[data_probe] {mode}: failed ({out.returncode}): {out.stderr.strip()[-600:]}", flush=True)
            continue
        print(f"[data_probe] {lines[-1]} process {time.perf_counter() - t0:.1f} s", flush=True)
        if opts.cprofile:
            print(out.stderr[out.stderr.find("   Ordered by"):], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
