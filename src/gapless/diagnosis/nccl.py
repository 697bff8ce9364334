"""`gapless doctor --nccl`: all-reduce bandwidth across the visible GPUs, as nccl-tests measures it.

For each message size (float32 elements, 1 MiB to 1 GiB by default) every rank all-reduces a tensor of that
size `iters` times after warm-ups; the time of one all-reduce is the slowest rank's mean. Then, as nccl-tests
defines them (github.com/NVIDIA/nccl-tests, doc/PERFORMANCE.md):
    algbw = bytes / time
    busbw = algbw x 2 (n - 1) / n   (a ring all-reduce moves 2 (n-1)/n of the data over each link, so busbw is
                                     comparable to the link's own bandwidth whatever n is)
The largest sizes' busbw is compared with the link figure of gapless.diagnosis.plan's GPU table.

Launch: under torchrun (`torchrun --nproc-per-node 8 -m gapless.cli doctor --nccl`) each process is a rank;
otherwise the doctor spawns one process per GPU itself. `backend="gloo"` runs the same measurement on CPU
processes (the test path).
"""
from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

MIB = 1 << 20
DEFAULT_SIZES = [MIB << i for i in range(11)]  # 1 MiB .. 1 GiB


def bus_factor(n: int) -> float:
    return 2 * (n - 1) / n


def _iters(nbytes: int) -> int:
    # ~20 iterations for small messages, fewer for large ones (1 GiB at ~400 GB/s busbw is ~5 ms per call)
    return max(5, min(20, (256 * MIB) // nbytes * 5))


def measure_allreduce(sizes: list[int], device: torch.device, warmup: int = 2) -> list[dict]:
    """Inside an initialised process group: one row per size (bytes, time_s, algbw_GBps, busbw_GBps)."""
    n = dist.get_world_size()
    rows = []
    for nbytes in sizes:
        x = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
        iters = _iters(nbytes)
        for _ in range(warmup):
            dist.all_reduce(x)
        _sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        _sync(device)
        elapsed = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank decides
        t = float(elapsed.item())
        # ones summed over n ranks (warm-ups included) stay exact in float32 for these counts: a check that the
        # reduction ran, not just the clock
        expected = float(n ** (warmup + iters))
        assert x[0].item() == expected or expected > 2 ** 24, (x[0].item(), expected)
        algbw = x.numel() * 4 / t / 1e9
        rows.append({"bytes": x.numel() * 4, "iters": iters, "time_s": t, "algbw_GBps": algbw,
                     "busbw_GBps": algbw * bus_factor(n)})
    return rows


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _worker(rank: int, world: int, backend: str, port: int, sizes: list[int], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world, device_id=device if backend == "nccl" else None)
    try:
        rows = measure_allreduce(sizes, device)
        if rank == 0:
            Path(out).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_allreduce(backend: str = "nccl", nprocs: int | None = None, sizes: list[int] | None = None) -> dict:
    """Measure all-reduce over `nprocs` processes (GPUs for nccl; spawned here, or the torchrun ranks when this
    process was started by torchrun). Returns {"backend", "ranks", "rows", ...}; with fewer than two GPUs,
    {"ranks": 1, "note": ...} and no rows."""
    sizes = DEFAULT_SIZES if sizes is None else sizes
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:  # started by torchrun
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else \
            torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend)
        try:
            rows = measure_allreduce(sizes, device)
        finally:
            dist.destroy_process_group()
        return {"backend": backend, "ranks": world, "rank": rank, "rows": rows}
    if backend == "nccl":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        nprocs = gpus if nprocs is None else nprocs
        if nprocs < 2:
            return {"backend": backend, "ranks": nprocs, "rows": [],
                    "note": f"{'one GPU' if gpus == 1 else 'no GPU'}: an all-reduce needs two or more GPUs; "
                            "nothing to measure here"}
    nprocs = 2 if nprocs is None else nprocs
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows.json")
        mp.spawn(_worker, args=(nprocs, backend, free_port(), sizes, out), nprocs=nprocs, join=True)
        rows = json.loads(Path(out).read_text())
    return {"backend": backend, "ranks": nprocs, "rows": rows}


def expected_link(env: dict | None = None) -> tuple[float, str] | None:
    """(GB/s per direction, link name) of the GPUs here, from the plan's table; None when unknown."""
    from gapless.diagnosis.plan import gpu_from_name

    if env is None:
        if not torch.cuda.is_available():
            return None
        name, nvlinks = torch.cuda.get_device_name(0), None
    else:
        gpus = env["gpu"]["gpus"]
        if not gpus:
            return None
        name, nvlinks = gpus[0]["name"], env["gpu"].get("nvlinks_gpu0")
    try:
        gpu = gpu_from_name(name)
    except ValueError:
        return None
    if nvlinks == 0 and gpu.link.startswith("NVLink"):  # a PCIe card of an NVLink GPU (H100 PCIe, A100 PCIe)
        return 32.0, "PCIe (no active NVLink found)"
    return gpu.link_gbs, gpu.link


def format_allreduce(result: dict, link: tuple[float, str] | None = None) -> str:
    if not result["rows"]:
        return result.get("note", "nothing measured")
    lines = [f"all-reduce, {result['backend']}, {result['ranks']} ranks (float32; busbw = algbw x 2(n-1)/n, "
             "as nccl-tests)", f"{'size':>10} {'time':>10} {'algbw GB/s':>11} {'busbw GB/s':>11}"]
    for r in result["rows"]:
        size = f"{r['bytes'] / MIB:g} MiB" if r["bytes"] >= MIB else f"{r['bytes'] / 1024:g} KiB"
        lines.append(f"{size:>10} {r['time_s'] * 1e3:>8.3f} ms {r['algbw_GBps']:>11.2f} {r['busbw_GBps']:>11.2f}")
    peak = max(r["busbw_GBps"] for r in result["rows"])
    if link:
        lines.append(f"peak busbw {peak:.1f} GB/s against {link[0]:g} GB/s per direction for {link[1]}: "
                     f"{peak / link[0]:.0%}" + ("; below 70%: check NCCL_P2P_DISABLE, NCCL_IB_DISABLE, the topology "
                                                 "(nvidia-smi topo -m)" if peak < 0.7 * link[0] else ""))
    else:
        lines.append(f"peak busbw {peak:.2f} GB/s (no link figure for this device)")
    return "\n".join(lines)
