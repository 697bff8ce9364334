"""Where every second of a run went: a host timeline of phases, corrected by CUDA events on the GPU.

Each second of wall time since the timeline started belongs to exactly one category:

    startup     load data and model, transforms, compile, the warm-up step
    compute     forward, backward, optimizer step (and, on CUDA, the GPU finishing them: see below)
    data_wait   the loop waiting for the next batch (the Prefetcher's queue was empty)
    h2d_copy    copying a batch to the device
    checkpoint  the loop stalled by a checkpoint: the snapshot and waiting for the previous write
    eval        evaluation on the held-out split
    logging     reading the metrics and writing them
    communication  several processes (torchrun): collectives not hidden under this rank's compute, and waiting
                in them for slower ranks (moved out of compute at each log point: gapless.train.parallel)
    other       everything not inside a phase

The host timeline is a list of phases on `time.perf_counter`. Time inside nested phases belongs to the
innermost one; time inside no phase is "other". Every interval between two consecutive clock readings
is added to exactly one category, so `summary()` sums to the wall time by construction (up to float
rounding; it is asserted to 1e-6).

The subtlety on CUDA. Kernels are launched asynchronously: host time inside "compute" is only the
time to *launch* the step's kernels, and the host runs ahead of the GPU until something blocks it.
The loop blocks only at its logging sync (`.item()` every `log_every` steps), and there the host
waits for all the queued steps to finish; charging that wait to "logging" would call most of the run
logging. So `settle()` is called right before the logging sync: it records a CUDA event on the
current stream and blocks on it inside a "compute" phase. The wait is the GPU finishing queued work,
and the `.item()` after it is then nearly free. This is not an extra sync in the hot path: it sits
where the loop already blocks, once per log step.

That alone would still be wrong the other way: while the host waits for data (or a checkpoint
write) the GPU may be busy with steps queued earlier, and that time is compute, not a stall. So each
"compute" phase also records a CUDA event at its start and end. At `settle()` the events are
complete; their times relative to the settle event (`Event.elapsed_time`, read without a sync)
place each step's GPU interval on the host clock, anchored at the moment the settle event completed
(the host leaves `synchronize()` within microseconds of it, and if the GPU was already idle the event
completed right after it was recorded, which is also right before the host returns). Where a GPU
interval overlaps a host phase, that time moves to "compute": a second in which the GPU was busy
with training steps is compute, whatever the host was doing meanwhile. What remains in data_wait
or checkpoint is time the GPU had nothing to run. Host "compute" time outside any GPU interval is
launch overhead (the GPU waited for the host), still compute. GPU work outside compute phases (an
H2D copy, the checkpoint's D2H copies) is brief and is charged to whatever the host was doing.

On the CPU every op is synchronous: host time is the real time, there are no events, and
`settle()` does nothing.

Records for metrics.jsonl (`record(step)`), cumulative since the timeline started:
    {"kind": "time", "step": 120, "started": 1764756178.512, "wall_s": 431.2, "final": false,
     "seconds": {"startup": 35.1, "compute": 380.0, "data_wait": 2.2, ..., "other": 0.4}}
`started` (unix time of the timeline's start) names the session: a resumed run starts a new timeline,
and a reader adds up the last record of each session (`session_totals`).

How the loop uses it (host cost: two perf_counter readings and a dict update per phase, about 1 us;
on CUDA two events per compute phase, a few us each, and no sync):

    timeline = Timeline(device); timeline.begin("startup") ... timeline.end("startup")
    with timeline.phase("data_wait"): micro = [batches.next() ...]     # the Prefetcher nests h2d_copy
    with timeline.phase("startup" if first_step else "compute"): forward, backward, optimizer step
    timeline.settle("startup")                                       # once, after the warm-up step
    timeline.settle(); with timeline.phase("logging"): loss.item(), write records, timeline.record(step)
    with timeline.phase("checkpoint"): checkpoints.save(...)        # and checkpoints.close()
    timeline.settle(); with timeline.phase("eval"): evaluate(...)
    at the end: write timeline.record(step, final=True)

The timeline is used from the training thread only (not thread-safe).
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

CATEGORIES = ("startup", "compute", "data_wait", "h2d_copy", "checkpoint", "eval", "logging", "communication",
              "other")
LABELS = {"startup": "startup", "compute": "compute", "data_wait": "waiting for data",
          "h2d_copy": "host-to-device copy", "checkpoint": "checkpoint stall", "eval": "evaluation",
          "logging": "logging", "communication": "communication and waiting for ranks", "other": "other"}
GPU_TIMED = "compute"  # the phase whose GPU intervals are measured with CUDA events


def process_start() -> float | None:
    """The `time.perf_counter` reading at which this process started (before Python's own imports), from Linux's
    /proc (start time in clock ticks since boot, 10 ms resolution) against /proc/uptime; None elsewhere.
    `gapless train` starts its timeline there, so the whole-run record includes the interpreter and the imports
    (about 3 s of torch and transformers on a CPU) and agrees with a clock outside the process."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the command name may hold spaces; fields after ")"
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        started_after_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat(5), 0-based 19 here
    except (OSError, ValueError, IndexError):
        return None
    age = uptime - started_after_boot
    return time.perf_counter() - age if 0 <= age < 86400 * 365 else None


class StartupParts:
    """Where start-up's seconds went, from the run's clock start (t0) to the end of step 1: `mark(part)` closes the
    part running since the previous mark, so the parts add up to the first step's wall time by construction. The
    parts `gapless train` marks: imports_config (the interpreter, the imports, the config, the run folder), model
    (build, transform, load the weights), data (read and tokenize, or the token cache), other (optimizer, peak FLOPs,
    checkpoints, the GPU monitor), warmup (where the data is still being read after the model: the layers compiled
    on a made-up batch), first_step (its batch, the compile, forward, backward, update, settled).
    `overlapped`: the seconds of work that ran beside the parts rather than in one (gapless train reads its data
    while the model loads: "data" is then the wait for it after the model, overlapped["data"] its whole time)."""

    def __init__(self, t0: float, clock: Callable[[], float] = time.perf_counter):
        self.clock, self._t = clock, t0
        self.seconds: dict[str, float] = {}
        self.overlapped: dict[str, float] = {}

    def mark(self, part: str) -> None:
        now = self.clock()
        self.seconds[part] = self.seconds.get(part, 0.0) + now - self._t
        self._t = now


class Timeline:
    def __init__(self, device: torch.device | str = "cpu", clock: Callable[[], float] = time.perf_counter,
                 t0: float | None = None):
        """`t0`: the clock reading at which the run began (default now), e.g. `process_start()`; the time before
        the timeline was made is startup."""
        self.clock = clock
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        now = clock()
        self.t0 = now if t0 is None or t0 > now else t0
        # names this session in the records (a resumed run starts another)
        self.started = round(time.time() - (now - self.t0), 3)
        self.totals = dict.fromkeys(CATEGORIES, 0.0)
        self._stack: list[str] = []
        self.totals["startup"] = now - self.t0  # the process starting and importing, before the timeline existed
        self._mark = now  # clock time up to which every second is already in `totals`
        # CUDA only, since the last settle: host segments (category, start, end) and the GPU
        # intervals of compute phases as (start event, end event)
        self._segments: list[tuple[str, float, float]] = []
        self._gpu: list[tuple] = []
        self._open_event = None

    # -- host phases

    def begin(self, name: str) -> None:
        assert name in CATEGORIES and name != "other", f"timeline phase {name!r}: not one of {CATEGORIES[:-1]}"
        self._advance(self.clock())
        self._stack.append(name)
        if self.cuda and name == GPU_TIMED and self._open_event is None:
            self._open_event = _event(self.device)

    def end(self, name: str) -> None:
        assert self._stack and self._stack[-1] == name, f"end({name!r}) but the open phases are {self._stack}"
        if self.cuda and name == GPU_TIMED and self._open_event is not None and GPU_TIMED not in self._stack[:-1]:
            self._gpu.append((self._open_event, _event(self.device)))
            self._open_event = None
        self._advance(self.clock())
        self._stack.pop()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.begin(name)
        try:
            yield
        finally:
            self.end(name)

    def _advance(self, now: float) -> None:
        category = self._stack[-1] if self._stack else "other"
        self.totals[category] += now - self._mark
        if self.cuda:
            self._segments.append((category, self._mark, now))
        self._mark = now

    # -- the GPU side

    def settle(self, category: str = "compute") -> None:
        """Wait for the GPU to finish the work queued so far and charge the wait to `category`;
        then move the time the GPU spent in compute phases from whatever the host was doing to
        "compute". Call it right before each host sync outside the hot path (the logging `.item()`,
        an evaluation, the end of the run). SYNC (CUDA). A no-op on the CPU."""
        if not self.cuda:
            return
        assert GPU_TIMED not in self._stack, "settle() inside a compute phase"
        with self.phase(category):
            anchor = _event(self.device)
            anchor.synchronize()  # SYNC: the GPU finishes the queued steps; charged to `category`
            t_anchor = self.clock()
        # each event's host time: the anchor's minus the GPU time between them (ms)
        busy = [(t_anchor - a.elapsed_time(anchor) / 1e3, t_anchor - b.elapsed_time(anchor) / 1e3)
                for a, b in self._gpu]
        for category, seconds in move_overlaps(self._segments, busy, GPU_TIMED).items():
            self.totals[category] += seconds
        self._segments, self._gpu = [], []

    def move(self, source: str, to: str, seconds: float) -> None:
        """Charge `seconds` already counted in `source` to `to` instead: time that a phase held but that was spent
        otherwise, measured apart (the exposed communication inside compute steps). Call it after settle(), where
        the GPU's seconds are in place; at most what `source` holds moves."""
        seconds = min(max(seconds, 0.0), self.totals[source])
        self.totals[source] -= seconds
        self.totals[to] += seconds

    # -- reading

    def summary(self) -> dict[str, float]:
        """Seconds per category up to now, plus "wall"; the categories sum to wall."""
        now = self.clock()
        totals = dict(self.totals)
        totals[self._stack[-1] if self._stack else "other"] += now - self._mark
        wall = now - self.t0
        assert abs(sum(totals.values()) - wall) <= 1e-6 * max(wall, 1.0), (totals, wall)
        return {**totals, "wall": wall}

    def record(self, step: int, final: bool = False) -> dict:
        """The metrics.jsonl record of the time so far (see the module doc)."""
        s = self.summary()
        return {"kind": "time", "step": step, "started": self.started, "wall_s": s.pop("wall"), "final": final,
                "seconds": s}


def _event(device: torch.device):
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))  # completes when the device's current stream reaches it
    return event


def move_overlaps(segments: list[tuple[str, float, float]], busy: list[tuple[float, float]],
                  to: str) -> dict[str, float]:
    """How to change the totals so that the parts of host `segments` (category, start, end; in time
    order, not overlapping) covered by the `busy` intervals (start, end) count as `to`:
    category -> seconds to add (negative: remove).

    The busy intervals are those of one CUDA stream, in order; they are merged before use so that no
    second moves twice, and each moved second comes out of the category that held it: the sum of the
    changes is zero.
    """
    merged: list[list[float]] = []
    for a, b in sorted(busy):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        elif b > a:
            merged.append([a, b])
    delta: dict[str, float] = {}
    i = 0  # both lists are in time order: one sweep
    for category, s, e in segments:
        while i < len(merged) and merged[i][1] <= s:
            i += 1
        if category == to:
            continue
        overlap = 0.0
        j = i
        while j < len(merged) and merged[j][0] < e:
            overlap += min(e, merged[j][1]) - max(s, merged[j][0])
            j += 1
        if overlap > 0:
            delta[category] = delta.get(category, 0.0) - overlap
            delta[to] = delta.get(to, 0.0) + overlap
    return delta


def format_summary(summary: dict[str, float]) -> str:
    """One line for people: 'wall 431.2 s: compute 88.1%, startup 8.1%, ...' (largest first, zeros left out)."""
    wall = summary["wall"]
    parts = sorted(((summary[c], c) for c in CATEGORIES if summary.get(c, 0.0) > 0), reverse=True)
    return f"wall {wall:.1f} s: " + ", ".join(f"{LABELS[c]} {100 * s / max(wall, 1e-9):.1f}%" for s, c in parts)


def session_totals(records: list[dict]) -> dict[str, float] | None:
    """Seconds per category plus "wall" over all sessions of a run, from its time records (the last
    record of each session, told apart by `started`); None without records."""
    last: dict[float, dict] = {}
    for r in records:
        last[r["started"]] = r  # records of a session are in order: the last one holds its totals
    if not last:
        return None
    totals = dict.fromkeys(CATEGORIES, 0.0)
    for r in last.values():
        for c in CATEGORIES:
            totals[c] += r["seconds"].get(c, 0.0)
    return {**totals, "wall": sum(r["wall_s"] for r in last.values())}
