import json
import sys
import time
import types

import pytest

from gapless.meter import monitor
from gapless.meter.monitor import GpuMonitor, diagnose, load_samples, throttle_names


def samples(seconds: float, util=97, throttle=(), t0: float = 0.0, **fields) -> list[dict]:
    """A recording at 2 Hz; `util` a number or a function of t."""
    out = []
    for i in range(int(seconds * 2)):
        t = t0 + i / 2
        out.append({"t": t, "gpu": "NVIDIA H200", "util": util(t) if callable(util) else util,
                    "mem_used_mib": 60000.0, "mem_total_mib": 143771.0, "power_w": 520.0, "power_limit_w": 700.0,
                    "sm_clock_mhz": 1980, "temp_c": 55, "throttle": list(throttle), **fields})
    return out


def summary(**seconds) -> dict:
    s = {"startup": 20.0, "compute": 0.0, "data_wait": 0.0, "h2d_copy": 0.5, "checkpoint": 0.0, "eval": 5.0,
         "logging": 0.5, "other": 1.0, **seconds}
    s["compute"] = s["compute"] or 300.0
    return {**s, "wall": sum(s.values())}


def causes(findings) -> list[str]:
    return [f.cause.split(":")[0] for f in findings]


def test_healthy_run_has_no_findings():
    assert diagnose(samples(330, util=lambda t: 0 if t < 20 else 97), summary()) == []
    assert diagnose([], summary()) == []  # a CPU run: the time accounting alone
    assert diagnose([], None) == []


def test_input_bound_low_utilisation_while_waiting_for_data():
    found = diagnose(samples(330, util=lambda t: 0 if t < 20 else 55), summary(compute=200.0, data_wait=100.0))
    assert causes(found) == ["input-bound"]
    assert "waiting for data 33%" in found[0].evidence and "utilisation median 55%" in found[0].evidence
    assert "workers" in found[0].fix and "cache" in found[0].fix
    # the same wait on a CPU run (no samples) is still input-bound
    assert causes(diagnose([], summary(compute=200.0, data_wait=100.0))) == ["input-bound"]
    # a small wait is not
    assert diagnose(samples(330, util=lambda t: 0 if t < 20 else 90), summary(data_wait=10.0)) == []


def test_io_bound_stalls_at_checkpoint_steps():
    # steps of 1 s after a 20 s startup; checkpoints at 100, 200, 300 stall 20 s each, the GPU idle then
    step_times, t = {}, 20.0
    for step in range(1, 301):
        t += 1.0
        step_times[step] = t
        if step % 100 == 0:
            t += 20.0
    stalls = [(step_times[s], step_times[s] + 20.0) for s in (100, 200, 300)]

    def util(t):
        return 2 if t < 20 or any(a <= t <= b for a, b in stalls) else 96

    found = diagnose(samples(t, util=util), summary(compute=300.0, checkpoint=60.0), checkpoint_steps=[100, 200, 300],
                     step_times=step_times)
    assert causes(found) == ["I/O-bound"]
    ev = found[0].evidence
    assert "checkpoint stalls 16%" in ev and "20.0 s each over 3 checkpoints" in ev
    assert "GPU utilisation 2% during checkpoints, 96% otherwise" in ev
    assert "checkpoint.every" in found[0].fix and "async_write" in found[0].fix


def test_thermal_and_power_throttling_are_noted():
    hot = samples(100, throttle=["hw_thermal"], temp_c=91, sm_clock_mhz=1410) + samples(100, t0=100)
    found = diagnose(hot, summary())
    assert causes(found) == ["thermal throttling"]
    assert "hw_thermal in 50% of busy samples" in found[0].evidence and "91 °C" in found[0].evidence
    capped = samples(100, throttle=["sw_power_cap"], power_w=699.0)
    found = diagnose(capped, summary())
    assert causes(found) == ["power throttling"] and "699 W of a 700 W limit" in found[0].evidence
    # an idle GPU reports gpu_idle / lowered clocks: not throttling, and idle samples are not "busy"
    idle = samples(100, util=0, throttle=["gpu_idle", "sw_thermal"]) + samples(300, t0=100)
    assert diagnose(idle, summary(startup=0.0)) == []


def test_under_used_gpu_without_another_cause():
    found = diagnose(samples(330, util=30), summary())
    assert causes(found) == ["GPU under-used, not by data or checkpoints"]


def test_throttle_bits_and_torn_sample_file(tmp_path):
    assert throttle_names(0x4 | 0x40) == ["sw_power_cap", "hw_thermal"]
    path = tmp_path / "gpu.jsonl"
    path.write_text(json.dumps({"t": 0.0, "util": 5}) + "\n" + '{"t": 0.5, "ut')  # killed mid-write
    assert load_samples(path) == [{"t": 0.0, "util": 5}]
    path.write_text('{"t": 0.5, "ut\n' + json.dumps({"t": 1.0}) + "\n")
    with pytest.raises(ValueError, match="gpu.jsonl:1"):
        load_samples(path)


def test_cpu_run_is_not_available(tmp_path):
    m = GpuMonitor(tmp_path / "gpu.jsonl", "cpu")
    assert not m.available and m.status == "GPU monitor: not available (the run is on the CPU)"
    m.close()
    assert not (tmp_path / "gpu.jsonl").exists()


def test_without_nvidia_ml_py_not_available(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    m = GpuMonitor(tmp_path / "gpu.jsonl", "cuda")
    assert not m.available and "nvidia-ml-py is not installed" in m.status
    m.close()


def fake_nvml(init_error: bool = False) -> types.ModuleType:
    nvml = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):
        pass

    def not_supported(handle):
        raise NVMLError_NotSupported("Not Supported")

    def init():
        if init_error:
            raise NVMLError("NVML Shared Library Not Found")

    nvml.NVMLError, nvml.NVMLError_NotSupported = NVMLError, NVMLError_NotSupported
    nvml.NVML_CLOCK_SM, nvml.NVML_TEMPERATURE_GPU = 1, 0
    nvml.nvmlInit = init
    nvml.nvmlShutdown = lambda: None
    nvml.nvmlDeviceGetHandleByUUID = lambda uuid: ("handle", uuid)
    nvml.nvmlDeviceGetName = lambda h: "NVIDIA H200"
    nvml.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=93, memory=40)
    nvml.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=3 * 2**30, total=141 * 2**30)
    nvml.nvmlDeviceGetPowerUsage = lambda h: 612_300  # mW
    nvml.nvmlDeviceGetEnforcedPowerLimit = not_supported
    nvml.nvmlDeviceGetClockInfo = lambda h, clock: 1980 if clock == 1 else 0
    nvml.nvmlDeviceGetTemperature = lambda h, sensor: 61
    nvml.nvmlDeviceGetCurrentClocksThrottleReasons = lambda h: 0x4
    return nvml


def test_nvml_that_fails_to_start_is_not_available(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(init_error=True))
    m = GpuMonitor(tmp_path / "gpu.jsonl", "cuda")
    assert not m.available
    assert m.status == "GPU monitor: not available (NVML did not start: NVML Shared Library Not Found)"
    m.close()


def test_real_nvml_here_is_not_available_or_samples(tmp_path):
    pytest.importorskip("pynvml")
    m = GpuMonitor(tmp_path / "gpu.jsonl", "cuda")  # no GPU here: NVML's library is missing; never raises
    m.close()
    assert m.status.startswith("GPU monitor: ")


def test_sampler_writes_json_lines(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml())
    monkeypatch.setattr(monitor, "_nvml_uuid", lambda device: "GPU-0000")
    t0 = time.perf_counter() - 5.0  # the run started 5 s ago
    given = []  # what the live TensorBoard sink gets (train.report_to)
    with GpuMonitor(tmp_path / "gpu.jsonl", "cuda", t0=t0, interval_s=0.02, on_sample=given.append) as m:
        assert m.available and m.status.startswith("GPU monitor: sampling NVIDIA H200 every 0.02 s")
        time.sleep(0.15)
    rows = load_samples(tmp_path / "gpu.jsonl")
    assert len(rows) >= 3 and len(rows) == m.samples and given == rows
    assert all(r["t"] >= 5.0 for r in rows) and rows == sorted(rows, key=lambda r: r["t"])
    assert rows[0] == {"t": rows[0]["t"], "gpu": "NVIDIA H200", "util": 93, "mem_used_mib": 3072.0,
                       "mem_total_mib": 144384.0, "power_w": 612.3, "power_limit_w": None, "sm_clock_mhz": 1980,
                       "temp_c": 61, "throttle": ["sw_power_cap"]}


def test_rules_per_rank_name_the_outlier():
    """Several processes: a rule that fires on one rank only names it; one that fires on every rank is one finding;
    a rank much less busy than the others is named; a rank without samples is left out of the rules."""
    even = samples(330, util=lambda t: 0 if t < 20 else 97)
    capped = samples(330, util=lambda t: 0 if t < 20 else 97, throttle=["sw_power_cap"], power_w=699.0,
                     sm_clock_mhz=1600)
    found = diagnose(even, summary(), ranks={0: even, 1: even, 2: capped, 3: []})
    assert causes(found) == ["power throttling on rank 2"]
    assert found[0].evidence.startswith("rank 2: sw_power_cap in 100% of busy samples; power median 699 W")
    assert found[0].evidence.endswith("not on ranks 0, 1") and "sets the pace of all ranks" in found[0].fix
    # on every rank: one finding, as for one GPU
    found = diagnose(capped, summary(), ranks={0: capped, 1: capped})
    assert causes(found) == ["power throttling"] and found[0].evidence.startswith("on every rank (2); rank 0: ")
    found = diagnose(capped, summary(), ranks={0: capped, 1: []})
    assert found[0].evidence.startswith("on every rank with samples (1 of 2); rank 0: ")
    # a rank that idles while the others compute
    idle = samples(330, util=lambda t: 0 if t < 20 else 70)
    found = diagnose(even, summary(), ranks={0: even, 1: idle, 2: even})
    assert causes(found) == ["rank 1 less busy than the others"]
    assert "70% on rank 1, against 97% over the ranks" in found[0].evidence
    # one process, or one rank's samples: the rules as before
    assert diagnose(capped, summary(), ranks={0: capped}) == diagnose(capped, summary())


def test_summarise_one_gpu():
    rows = samples(10, util=lambda t: 0 if t < 2 else 90, throttle=["sw_power_cap"]) + samples(10, t0=10)
    x = monitor.summarise(rows, startup=2.0)
    assert x["samples"] == 40 and x["gpu"] == "NVIDIA H200" and x["util_median"] == 97
    assert x["util_mean"] == pytest.approx((16 * 90 + 20 * 97) / 36)
    assert (x["mem_peak_mib"], x["power_limit_w"], x["sm_clock_mean_mhz"]) == (60000.0, 700.0, 1980)
    assert x["power_share"] == pytest.approx(16 / 36) and x["thermal_share"] == 0.0
    assert monitor.summarise([]) == {"samples": 0}
