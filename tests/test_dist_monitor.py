"""The GPU monitor of several processes (gloo, 2 ranks, the demo's tiny Llama on the CPU): each rank's loop samples
its own GPU into its own file, here through the monitor's stand-in NVML (test_monitor.fake_nvml) with rank 1's GPU
power-capped; rank 0's report.html at the end of the run shows both GPUs and names rank 1, and so does `gapless
doctor RUN`'s evidence."""
import json
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

from test_dist import free_port, raw_config
from test_loop import base  # noqa: F401  (the demo's tiny Llama and 200 records)


def _worker(rank: int, world: int, spec: dict, port: int) -> None:
    import os

    from gapless.config import load_config
    from gapless.meter import monitor
    from gapless.train import loop
    from test_monitor import fake_nvml

    torch.set_num_threads(1)
    nvml = fake_nvml()
    nvml.nvmlDeviceGetCurrentClocksThrottleReasons = lambda h: 0x4 if rank == 1 else 0x0  # rank 1: sw_power_cap
    sys.modules["pynvml"] = nvml
    monitor._nvml_uuid = lambda device: f"GPU-{rank}"
    # the run is on the CPU; its monitor samples the stand-in "GPU" every 20 ms, to the file the loop names
    loop.GpuMonitor = lambda path, device, **kw: monitor.GpuMonitor(path, "cuda", interval_s=0.02, **kw)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    loop.train(load_config(data=spec["raw"], overrides=spec["overrides"]))


def test_each_rank_samples_its_gpu_and_the_report_names_the_throttled_one(base):
    spec = raw_config(base, "monitor-ddp", **{"parallel.strategy": "ddp", "checkpoint.every": 0})
    mp.spawn(_worker, args=(2, spec, free_port()), nprocs=2, join=True)
    run = Path(spec["raw"]["output_dir"])
    from gapless.diagnosis.doctor import run_findings
    from gapless.meter.monitor import load_samples

    for name, reasons in (("gpu.jsonl", []), ("gpu.rank1.jsonl", ["sw_power_cap"])):
        samples = load_samples(run / name)
        assert samples and all(s["throttle"] == reasons and s["util"] == 93 for s in samples)
    assert not list(run.glob("gpu.rank0*"))
    page = (run / "report.html").read_text()  # rank 0's, at the end of the run
    assert "<h3>GPUs per rank</h3>" in page and "<td>slowest rank</td>" in page
    assert "<tr><td>0</td><td>NVIDIA H200</td>" in page and "<tr><td>1</td><td>NVIDIA H200</td>" in page
    assert "power throttling on rank 1" in page and "most throttled</td><td>rank 1" in page
    assert "run.power_throttling_on_rank_1" in [f.id for f in run_findings(run)]
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])  # the run ended with its last record
