"""The GPU monitor: NVML samples of the run's GPU in a background thread, and plain rules that name a cause.

`GpuMonitor` reads, about twice a second, through NVML (the `pynvml` module of nvidia-ml-py):
utilisation, memory used/total, power draw and limit, SM clock, temperature and the clock-throttle
reasons, and appends one JSON object per sample to RUN/gpu.jsonl:

    {"t": 12.51, "gpu": "NVIDIA H200", "util": 98, "mem_used_mib": 60211.0, "mem_total_mib": 143771.0,
     "power_w": 612.3, "power_limit_w": 700.0, "sm_clock_mhz": 1980, "temp_c": 61, "throttle": ["sw_power_cap"]}

`t` is seconds since run start on the same clock as the timeline (pass `t0=timeline.t0`), so samples
line up with the time records and metrics' `elapsed_s`. A field the GPU does not report is null. A
resumed run appends a new session whose `t` restarts from 0. NVML utilisation is the share of the
last sample period (1/6 s to 1 s, by product) in which any kernel ran: it says the GPU was busy,
not that it was busy usefully.

Without NVML (a CPU run, nvidia-ml-py not installed, no driver) the monitor is "not available
(reason)" and samples nothing; it never raises. NVML calls release the GIL (ctypes), so the sampler
costs the training thread next to nothing.

`diagnose` applies the rules to a recorded run (the samples and the time summary), so it works the
same on a live run, on a finished run folder and on synthetic recordings in tests.

Under torchrun each rank samples its own GPU into its own file (rank 0 gpu.jsonl, rank r gpu.rank{r}.jsonl:
gapless.train.parallel's `per_rank`). Given every rank's samples, `diagnose` runs the GPU rules per rank
(`rank_findings`): a rule that fires on some ranks only names them, and a rank much less busy than the others is
named; `summarise` gives the numbers of the report's per-rank table.
"""
from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

# NVML clock-event ("throttle") reason bits, nvml.h nvmlClocksEventReason*
THROTTLE_BITS = {0x1: "gpu_idle", 0x2: "applications_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
                 0x10: "sync_boost", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake",
                 0x100: "display_clocks"}
THERMAL = ("sw_thermal", "hw_thermal", "hw_slowdown")  # hw_slowdown: too hot, or an external power brake
POWER = ("sw_power_cap", "hw_power_brake")

# Rule thresholds, as shares of training time (wall minus startup) or of busy samples
INPUT_BOUND_SHARE = 0.10   # waiting for data this long ...
INPUT_BOUND_UTIL = 85.0    # ... while the median utilisation is below this (%) means input-bound
IO_BOUND_SHARE = 0.05      # checkpoint stalls this long mean I/O-bound
THROTTLE_SHARE = 0.05      # a throttle reason in this share of busy samples is noted
BUSY_UTIL = 50.0           # a sample with at least this utilisation (%) is "busy"
UNDERUSED_UTIL = 50.0      # median utilisation below this, with no other cause found
RANK_UTIL_GAP = 15.0       # several processes: a rank's median utilisation this many points under the ranks' median


class GpuMonitor:
    """Samples the GPU of `device` every `interval_s` seconds into `path` (JSON lines, appended) until
    `close()`. Check `available` / `status`: on a CPU run, or without NVML, it does nothing."""

    def __init__(self, path: str | Path, device: torch.device | str, t0: float | None = None,
                 interval_s: float = 0.5, on_sample: Callable[[dict], None] | None = None):
        self.path = Path(path)
        self.on_sample = on_sample  # also given each sample, in the sampling thread (the live TensorBoard sink)
        self.interval_s = interval_s
        self.t0 = time.perf_counter() if t0 is None else t0
        self.available = False
        self.reason = ""
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        device = torch.device(device)
        if device.type != "cuda":
            self.reason = "the run is on the CPU"
            return
        try:
            import pynvml
        except ImportError:
            self.reason = "nvidia-ml-py is not installed: pip install nvidia-ml-py"
            return
        self._nvml = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            self.reason = f"NVML did not start: {e}"
            return
        try:
            self._handle = pynvml.nvmlDeviceGetHandleByUUID(_nvml_uuid(device))
            self.name = pynvml.nvmlDeviceGetName(self._handle)
        except (pynvml.NVMLError, RuntimeError) as e:
            pynvml.nvmlShutdown()
            self.reason = f"NVML has no handle for {device}: {e}"
            return
        self.available = True
        self._thread = threading.Thread(target=self._run, daemon=True, name="gapless-gpu-monitor")
        self._thread.start()

    @property
    def status(self) -> str:
        if not self.available:
            return f"GPU monitor: not available ({self.reason})"
        return f"GPU monitor: sampling {self.name} every {self.interval_s:g} s into {self.path}"

    def _run(self) -> None:
        with open(self.path, "a") as f:
            while not self._stop.is_set():
                try:
                    sample = read_sample(self._nvml, self._handle)
                except self._nvml.NVMLError as e:  # the GPU went away: stop sampling, keep the run
                    self.reason = f"NVML failed during the run: {e}"
                    return
                sample = {"t": round(time.perf_counter() - self.t0, 3), "gpu": self.name, **sample}
                f.write(json.dumps(sample) + "\n")
                f.flush()
                if self.on_sample is not None:
                    self.on_sample(sample)
                self.samples += 1
                self._stop.wait(self.interval_s)

    def close(self) -> None:
        """Stop sampling (the file holds every sample taken)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            self._thread = None
            self._nvml.nvmlShutdown()

    def __enter__(self) -> GpuMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _nvml_uuid(device: torch.device) -> str:
    # NVML numbers GPUs ignoring CUDA_VISIBLE_DEVICES; the UUID names the same GPU in both
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


def read_sample(nvml, handle) -> dict:
    """One reading; a quantity this GPU does not report is None (NVMLError_NotSupported)."""
    def read(fn, *args):
        try:
            return fn(handle, *args)
        except nvml.NVMLError_NotSupported:
            return None

    util = read(nvml.nvmlDeviceGetUtilizationRates)
    mem = read(nvml.nvmlDeviceGetMemoryInfo)
    power = read(nvml.nvmlDeviceGetPowerUsage)  # mW
    limit = read(nvml.nvmlDeviceGetEnforcedPowerLimit)  # mW
    reasons = read(nvml.nvmlDeviceGetCurrentClocksThrottleReasons)
    return {
        "util": None if util is None else util.gpu,
        "mem_used_mib": None if mem is None else round(mem.used / 2**20, 1),
        "mem_total_mib": None if mem is None else round(mem.total / 2**20, 1),
        "power_w": None if power is None else power / 1000,
        "power_limit_w": None if limit is None else limit / 1000,
        "sm_clock_mhz": read(nvml.nvmlDeviceGetClockInfo, nvml.NVML_CLOCK_SM),
        "temp_c": read(nvml.nvmlDeviceGetTemperature, nvml.NVML_TEMPERATURE_GPU),
        "throttle": None if reasons is None else throttle_names(reasons),
    }


def throttle_names(bits: int) -> list[str]:
    return [name for bit, name in THROTTLE_BITS.items() if bits & bit]


def load_samples(path: str | Path) -> list[dict]:
    """The samples of a gpu.jsonl; a torn last line (the run was killed mid-write) is left out."""
    lines = Path(path).read_text().splitlines()
    samples = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            samples.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines):
                break
            raise ValueError(f"{path}:{i}: not JSON ({e})") from None
    return samples


# ---------------------------------------------------------------------------------------------
# the rules


@dataclass(frozen=True)
class Finding:
    cause: str     # what limits the run, in a few words
    evidence: str  # the numbers that show it
    fix: str       # what to change


def diagnose(gpu_samples: Sequence[dict], time_summary: dict[str, float] | None,
             checkpoint_steps: Sequence[int] = (), step_times: dict[int, float] | None = None,
             ranks: dict[int, Sequence[dict]] | None = None) -> list[Finding]:
    """Name what limits a recorded run; a healthy run gives no findings.

    `gpu_samples`: gpu.jsonl records (may be empty: a CPU run). `time_summary`: seconds per timeline
    category plus "wall" (the run's final time record), or None. `checkpoint_steps`: the steps at which
    checkpoints were saved; `step_times`: step -> elapsed seconds at the end of that step (from
    metrics.jsonl), used to look at the GPU around checkpoints. `ranks`: a run of several processes, every
    rank's samples (rank 0's being `gpu_samples`): the GPU rules then run per rank (`rank_findings`).
    """
    findings = []
    startup = time_summary.get("startup", 0.0) if time_summary else 0.0
    train_samples = [s for s in gpu_samples if s.get("t", 0.0) >= startup]  # training, not loading
    utils = [s["util"] for s in train_samples if s.get("util") is not None]
    util_median = statistics.median(utils) if utils else None
    util_text = f"; GPU utilisation median {util_median:.0f}%" if util_median is not None else ""

    if time_summary:
        train_s = max(time_summary["wall"] - startup, 1e-9)
        wait = time_summary.get("data_wait", 0.0)
        if wait / train_s >= INPUT_BOUND_SHARE and (util_median is None or util_median < INPUT_BOUND_UTIL):
            findings.append(Finding(
                "input-bound: the GPU waits for batches",
                f"waiting for data {wait / train_s:.0%} of training time ({wait:.1f} s of {train_s:.1f} s){util_text}",
                "the batch thread cannot keep up: keep the tokenized cache (data.cache_dir; batches are read from "
                "its memory map) on a fast local disk, prefetch more batches or collate them in more workers, and "
                "pack larger batches (data.tokens_per_batch) so the host work per token shrinks"))

        stall = time_summary.get("checkpoint", 0.0)
        if stall / train_s >= IO_BOUND_SHARE:
            n = len(checkpoint_steps)
            per = f", {stall / n:.1f} s each over {n} checkpoints" if n else ""
            around = _util_around(train_samples, checkpoint_steps, step_times, stall / max(n, 1))
            findings.append(Finding(
                "I/O-bound: the loop stalls at checkpoint steps",
                f"checkpoint stalls {stall / train_s:.0%} of training time ({stall:.1f} s{per}){around}",
                "checkpoint less often (checkpoint.every), keep checkpoint.async_write: true so writes overlap "
                "training, write checkpoints to a fast local disk"))

    explained = any(f.cause.startswith(("input-bound", "I/O-bound")) for f in findings)
    if ranks is not None and len(ranks) > 1:
        return findings + rank_findings(ranks, startup, explained)
    return findings + _gpu_rules(gpu_samples, startup, explained)


def _gpu_rules(samples: Sequence[dict], startup: float, explained: bool) -> list[Finding]:
    """The rules on one GPU's samples: throttling, and an under-used GPU (unless `explained` by data or checkpoints)."""
    findings = []
    busy = [s for s in samples if (s.get("util") or 0) >= BUSY_UTIL and s.get("throttle") is not None]
    for kind, names in (("thermal", THERMAL), ("power", POWER)):
        hit = [s for s in busy if set(s["throttle"]) & set(names)]
        if busy and len(hit) / len(busy) >= THROTTLE_SHARE:
            seen = sorted({r for s in hit for r in s["throttle"] if r in names})
            clocks = [s["sm_clock_mhz"] for s in busy if s.get("sm_clock_mhz") is not None]
            clock_text = (f"; SM clock median {statistics.median(clocks):.0f} MHz, max {max(clocks)} MHz"
                          if clocks else "")
            if kind == "thermal":
                temps = [s["temp_c"] for s in hit if s.get("temp_c") is not None]
                extra = f"; temperature up to {max(temps)} °C" if temps else ""
                fix = ("the machine limits the run, not gapless: check cooling and airflow "
                       "(nvidia-smi -q -d TEMPERATURE,PERFORMANCE); throughput from this run understates the GPU")
            else:
                power = [s["power_w"] for s in hit if s.get("power_w") is not None]
                limits = [s["power_limit_w"] for s in hit if s.get("power_limit_w") is not None]
                extra = (f"; power median {statistics.median(power):.0f} W of a {max(limits):.0f} W limit"
                         if power and limits else "")
                fix = ("the GPU runs at its power limit, common at full load; raise the limit (nvidia-smi -pl) "
                       "if the machine allows, and compare throughput only between runs at the same limit")
            findings.append(Finding(f"{kind} throttling", f"{', '.join(seen)} in {len(hit) / len(busy):.0%} of "
                                    f"busy samples{extra}{clock_text}", fix))

    utils = [s["util"] for s in samples if s.get("t", 0.0) >= startup and s.get("util") is not None]
    if utils and statistics.median(utils) < UNDERUSED_UTIL and not explained:
        findings.append(Finding(
            "GPU under-used, not by data or checkpoints",
            f"GPU utilisation median {statistics.median(utils):.0f}% over {len(utils)} samples after startup",
            "the GPU waits for the host between kernels: larger batches (data.tokens_per_batch), fewer "
            "micro-batches, compiled kernels; check the time breakdown for evaluation or logging"))
    return findings


def rank_findings(ranks: dict[int, Sequence[dict]], startup: float = 0.0, explained: bool = False) -> list[Finding]:
    """The GPU rules of a run of several processes, per rank (`ranks`: rank -> its samples, [] for a rank whose
    monitor recorded nothing). A rule that fires on every rank is one finding, as for one GPU; one that fires on
    some ranks only names them, since each step waits for the slowest rank: a throttled GPU sets every rank's pace.
    A rank whose median utilisation is RANK_UTIL_GAP points below the ranks' median is named too: it idles while
    the others compute."""
    recorded = {r: s for r, s in sorted(ranks.items()) if s}
    per = {r: {f.cause: f for f in _gpu_rules(s, startup, explained)} for r, s in recorded.items()}
    findings = []
    for cause in dict.fromkeys(c for found in per.values() for c in found):  # in rule order, each once
        hit = [r for r in per if cause in per[r]]
        first = per[hit[0]][cause]
        if len(hit) == len(per):
            every = (f"on every rank ({len(hit)})" if len(per) == len(ranks) else
                     f"on every rank with samples ({len(hit)} of {len(ranks)})")
            findings.append(Finding(cause, f"{every}; rank {hit[0]}: {first.evidence}", first.fix))
            continue
        others = [r for r in per if r not in hit]
        pace = ("each step waits for the slowest rank, so the throttled GPU sets the pace of all ranks: "
                if cause.endswith("throttling") else "")
        findings.append(Finding(
            f"{cause} on {_ranks_text(hit)}",
            "; ".join(f"rank {r}: {per[r][cause].evidence}" for r in hit) + f"; not on {_ranks_text(others)}",
            pace + first.fix))
    medians = {r: statistics.median(u) for r, s in recorded.items()
               if (u := [x["util"] for x in s if x.get("t", 0.0) >= startup and x.get("util") is not None])}
    if len(medians) > 1:
        middle = statistics.median(medians.values())
        under = "GPU under-used, not by data or checkpoints"
        low = [r for r, m in medians.items() if middle - m >= RANK_UTIL_GAP and under not in per[r]]
        if low:
            findings.append(Finding(
                f"{_ranks_text(low)} less busy than the others",
                "GPU utilisation median " + ", ".join(f"{medians[r]:.0f}% on rank {r}" for r in low)
                + f", against {middle:.0f}% over the ranks",
                "its GPU idles while the others compute: it has less work per step (real tokens per rank in the "
                "Ranks section) or waits on its host (data, CPU contention, a slower PCIe/NUMA placement)"))
    return findings


def _ranks_text(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def summarise(samples: Sequence[dict], startup: float = 0.0) -> dict:
    """One GPU's recording in numbers (a report's per-rank table): utilisation after `startup` (mean, median), memory
    used over the run (mean, peak, of total), power (mean of the limit), SM clock and the shares of busy samples
    power- or thermal-throttled. A quantity no sample has is None; {"samples": 0} for no samples."""
    def values(key: str, rows=samples) -> list:
        return [s[key] for s in rows if s.get(key) is not None]

    def mean(xs: list) -> float | None:
        return sum(xs) / len(xs) if xs else None

    if not samples:
        return {"samples": 0}
    utils = values("util", [s for s in samples if s.get("t", 0.0) >= startup])
    busy = [s for s in samples if (s.get("util") or 0) >= BUSY_UTIL]
    reasons = [set(s["throttle"]) for s in busy if s.get("throttle") is not None]
    mem, totals, limits = values("mem_used_mib"), values("mem_total_mib"), values("power_limit_w")
    return {"samples": len(samples), "gpu": next((s["gpu"] for s in samples if s.get("gpu")), None),
            "util_mean": mean(utils), "util_median": statistics.median(utils) if utils else None,
            "mem_mean_mib": mean(mem), "mem_peak_mib": max(mem, default=None),
            "mem_total_mib": max(totals, default=None), "power_mean_w": mean(values("power_w")),
            "power_limit_w": max(limits, default=None), "sm_clock_mean_mhz": mean(values("sm_clock_mhz", busy)),
            "temp_max_c": max(values("temp_c"), default=None),
            **{f"{kind}_share": sum(bool(r & set(names)) for r in reasons) / len(reasons) if reasons else None
               for kind, names in (("power", POWER), ("thermal", THERMAL))}}


def _util_around(samples: Sequence[dict], steps: Sequence[int], step_times: dict[int, float] | None,
                 stall_s: float) -> str:
    """'; GPU utilisation 4% during checkpoints, 97% otherwise' when the samples show it."""
    if not samples or not steps or not step_times:
        return ""
    known = sorted(step_times.items())
    windows = []
    for step in steps:
        t = _interpolate(known, step)
        if t is not None:
            windows.append((t, t + max(stall_s, 1.0)))
    inside, outside = [], []
    for s in samples:
        if s.get("util") is not None:
            (inside if any(a <= s["t"] <= b for a, b in windows) else outside).append(s["util"])
    if not inside or not outside:
        return ""
    return (f"; GPU utilisation {statistics.median(inside):.0f}% during checkpoints, "
            f"{statistics.median(outside):.0f}% otherwise")


def _interpolate(known: list[tuple[int, float]], step: int) -> float | None:
    for (s0, t0), (s1, t1) in zip(known, known[1:]):
        if s0 <= step <= s1:
            return t0 + (t1 - t0) * (step - s0) / max(s1 - s0, 1)
    if known and step == known[-1][0]:
        return known[-1][1]
    return None
