import json
import time

import pytest
import torch

from gapless.meter import timeline as tl
from gapless.meter.timeline import CATEGORIES, Timeline, format_summary, move_overlaps, session_totals


class Clock:
    """A host clock the test moves by hand."""

    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def assert_sums_to_wall(summary: dict) -> None:
    assert set(summary) == {*CATEGORIES, "wall"}
    assert sum(summary[c] for c in CATEGORIES) == pytest.approx(summary["wall"], rel=1e-9, abs=1e-9)


def test_phases_nested_and_other_exact():
    clock = Clock()
    t = Timeline(clock=clock)
    clock.t += 1.0                      # before any phase: other
    with t.phase("startup"):
        clock.t += 2.0
    with t.phase("compute"):
        clock.t += 3.0
        with t.phase("data_wait"):      # nested: the innermost phase gets the time
            clock.t += 0.5
            with t.phase("h2d_copy"):
                clock.t += 0.25
            clock.t += 0.5
        clock.t += 1.0
    clock.t += 0.75                     # between phases: other
    t.begin("logging")
    clock.t += 0.125
    s = t.summary()                     # an open phase counts up to now
    assert s == {"startup": 2.0, "compute": 4.0, "data_wait": 1.0, "h2d_copy": 0.25, "checkpoint": 0.0,
                 "eval": 0.0, "logging": 0.125, "communication": 0.0, "other": 1.75, "wall": 9.125}
    assert_sums_to_wall(s)
    t.end("logging")
    clock.t += 1.0
    assert t.summary()["other"] == 2.75 and t.summary()["wall"] == 10.125


def test_move_charges_measured_seconds_elsewhere():
    """The exposed communication inside compute steps, measured apart, moves to "communication": the sum stays the
    wall time, and no more than the source holds moves."""
    clock = Clock()
    t = Timeline(clock=clock)
    with t.phase("compute"):
        clock.t += 3.0
    t.move("compute", "communication", 0.5)
    s = t.summary()
    assert s["compute"] == 2.5 and s["communication"] == 0.5
    assert_sums_to_wall(s)
    t.move("compute", "communication", 10.0)
    assert t.summary()["compute"] == 0.0 and t.summary()["communication"] == 3.0


def test_mismatched_end_and_unknown_phase_are_caught():
    t = Timeline()
    t.begin("compute")
    with pytest.raises(AssertionError):
        t.end("eval")
    with pytest.raises(AssertionError):
        t.begin("gradients")


def test_real_clock_sums_to_wall_within_one_percent():
    start = time.perf_counter()
    t = Timeline()
    with t.phase("startup"):
        time.sleep(0.03)
    for _ in range(3):
        with t.phase("data_wait"):
            time.sleep(0.01)
        with t.phase("compute"):
            torch.randn(64, 64) @ torch.randn(64, 64)
            time.sleep(0.02)
        time.sleep(0.005)  # other
    with t.phase("checkpoint"):
        time.sleep(0.01)
    s = t.summary()
    wall = time.perf_counter() - start
    assert_sums_to_wall(s)
    assert s["wall"] == pytest.approx(wall, rel=0.01)
    assert s["startup"] >= 0.03 and s["data_wait"] >= 0.03 and s["compute"] >= 0.06 and s["checkpoint"] >= 0.01
    assert s["other"] >= 0.015
    t.settle()  # a no-op on the CPU
    assert_sums_to_wall(t.summary())


def test_records_are_json_and_sessions_add_up():
    clock = Clock()
    t = Timeline(clock=clock)
    with t.phase("startup"):
        clock.t += 10
    with t.phase("compute"):
        clock.t += 30
    r1 = json.loads(json.dumps(t.record(5)))
    assert r1["kind"] == "time" and r1["step"] == 5 and r1["final"] is False and r1["wall_s"] == 40
    assert r1["seconds"]["compute"] == 30 and set(r1["seconds"]) == set(CATEGORIES)
    with t.phase("compute"):
        clock.t += 20
    r2 = t.record(8, final=True)
    resumed = Timeline(clock=clock)  # a resumed run: a new session
    resumed.started = t.started + 1
    with resumed.phase("startup"):
        clock.t += 7
    r3 = resumed.record(8)
    totals = session_totals([r1, r2, r3])
    assert totals["wall"] == 67 and totals["startup"] == 17 and totals["compute"] == 50
    assert session_totals([]) is None
    assert format_summary({**r2["seconds"], "wall": r2["wall_s"]}) == "wall 60.0 s: compute 83.3%, startup 16.7%"


def test_move_overlaps():
    segments = [("data_wait", 0.0, 2.0), ("compute", 2.0, 2.1), ("checkpoint", 2.1, 4.0), ("other", 4.0, 5.0)]
    busy = [(1.0, 2.5), (2.4, 3.0), (4.5, 4.6)]  # the first two overlap: merged, nothing moves twice
    delta = move_overlaps(segments, busy, "compute")
    assert delta == pytest.approx({"data_wait": -1.0, "checkpoint": -0.9, "other": -0.1, "compute": 2.0})
    assert sum(delta.values()) == pytest.approx(0.0)
    assert move_overlaps(segments, [], "compute") == {}


class FakeGpu:
    """One CUDA stream on the fake host clock: work runs in order, as soon as it is queued and the
    stream is free; an event completes when the stream reaches it."""

    def __init__(self, clock: Clock):
        self.clock = clock
        self.free_at = clock.t

    def launch(self, seconds: float) -> None:
        self.free_at = max(self.free_at, self.clock.t) + seconds

    def event_class(self):
        gpu = self

        class Event:
            def __init__(self, enable_timing: bool = False):
                assert enable_timing
                self.done = None

            def record(self, stream):
                assert stream == "stream"
                gpu.free_at = max(gpu.free_at, gpu.clock.t)
                self.done = gpu.free_at

            def synchronize(self):
                gpu.clock.t = max(gpu.clock.t, self.done)

            def elapsed_time(self, other) -> float:  # ms, like torch.cuda.Event
                return (other.done - self.done) * 1e3

        return Event


@pytest.fixture
def fake_cuda(monkeypatch):
    clock = Clock()
    gpu = FakeGpu(clock)
    monkeypatch.setattr(tl.torch.cuda, "Event", gpu.event_class())
    monkeypatch.setattr(tl.torch.cuda, "current_stream", lambda device: "stream")
    return clock, gpu


def test_cuda_input_bound_gpu_time_is_compute_the_rest_is_data_wait(fake_cuda):
    clock, gpu = fake_cuda
    t = Timeline("cuda", clock=clock)
    for _ in range(5):
        with t.phase("data_wait"):
            clock.t += 1.5          # the host waits 1.5 s per batch ...
        with t.phase("compute"):
            gpu.launch(1.0)         # ... for a step the GPU runs in 1.0 s
            clock.t += 0.01         # launching it takes the host 10 ms
    t.settle()
    with t.phase("logging"):
        clock.t += 0.002
    s = t.summary()
    assert_sums_to_wall(s)
    # host phases alone would say data_wait 7.5 s, compute 0.05 s; the GPU was busy 5 x 1.0 s
    assert s["compute"] == pytest.approx(5.0)
    assert s["data_wait"] == pytest.approx(1.5 + 4 * 0.51)  # the first wait, then 0.51 s per step with the GPU idle
    assert s["logging"] == pytest.approx(0.002)
    assert s["wall"] == pytest.approx(1.51 * 4 + 1.5 + 1.0 + 0.002)


def test_cuda_gpu_bound_the_logging_wait_is_compute(fake_cuda):
    clock, gpu = fake_cuda
    t = Timeline("cuda", clock=clock)
    for _ in range(5):
        with t.phase("data_wait"):
            clock.t += 0.001
        with t.phase("compute"):
            gpu.launch(1.0)
            clock.t += 0.01        # the host runs ahead of the GPU
    with t.phase("checkpoint"):
        clock.t += 0.2             # a stall while the GPU is still busy: hidden, so compute
    t.settle()                     # the wait for the 5 queued steps
    with t.phase("logging"):
        clock.t += 0.003           # the .item() itself
    s = t.summary()
    assert_sums_to_wall(s)
    assert s["compute"] == pytest.approx(5.0)  # the first step starts after 1 ms; the GPU is busy from then on
    assert s["data_wait"] == pytest.approx(0.001)  # only the first wait, before any GPU work
    assert s["checkpoint"] == 0.0 and s["logging"] == pytest.approx(0.003)
    # a second window starts clean: nothing queued, the host's phases are the truth
    with t.phase("checkpoint"):
        clock.t += 0.5
    t.settle()
    assert t.summary()["checkpoint"] == pytest.approx(0.5)
    assert_sums_to_wall(t.summary())


def test_cuda_warmup_settled_as_startup(fake_cuda):
    clock, gpu = fake_cuda
    t = Timeline("cuda", clock=clock)
    with t.phase("startup"):       # load, compile and the first step, launched
        clock.t += 3.0
        gpu.launch(2.0)
    t.settle("startup")            # the GPU finishing the warm-up step is startup too
    s = t.summary()
    assert s["startup"] == pytest.approx(5.0) and s["compute"] == 0.0
    assert_sums_to_wall(s)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_cuda_events():
    t = Timeline("cuda")
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(10):
        with t.phase("data_wait"):
            time.sleep(0.01)
        with t.phase("compute"):
            for _ in range(20):
                x = torch.tanh(x @ x)
    t.settle()
    s = t.summary()
    assert_sums_to_wall(s)
    assert s["compute"] > s["data_wait"] > 0
