"""The throughput of one logged window of a run: what a metrics.jsonl training record says about speed.

Tokens are counted three ways, all host integers from the data pipeline (never a device read): real tokens
(documents' tokens, never padding), trained tokens (loss-bearing) and slot tokens (B * T of every batch, padding
included). Throughput is always real tokens: over the window's wall time (`tokens_per_s`) and over its compute
time (`compute_tokens_per_s`, the timeline's compute seconds). A window's rates leave out the run's first step
(it compiles kernels and fills the allocator: startup), except in a window of that step alone, which reports
that step over its own time, compile included.
MFU: gapless.meter.flops.step_flops over the real document lengths / the window's wall time / the dense matmul
peak measured at startup on this device in the model's dtype (formula in flops.py).
"""
from __future__ import annotations

import time
from collections.abc import Callable


class ThroughputWindow:
    def __init__(self, peak_flops: float, clock: Callable[[], float] = time.perf_counter):
        self.peak_flops = peak_flops
        self.clock = clock
        self.start(0.0)

    def start(self, compute_s: float) -> None:
        """A new window from now; `compute_s`: the timeline's compute seconds so far."""
        self.real = self.trained = self.slots = self.steps = 0
        self.flops = 0.0
        self.timed_real, self.timed_flops = 0, 0.0  # the steps after the warm-up step
        self.t_window = self.t_timed = self.clock()
        self.compute_mark = compute_s

    def add(self, real: int, trained: int, slots: int, flops: float, warmup: bool) -> None:
        self.steps += 1  # optimizer steps
        self.real += real
        self.trained += trained
        self.slots += slots
        self.flops += flops
        if not warmup:
            self.timed_real += real
            self.timed_flops += flops

    def warmup_done(self, compute_s: float) -> None:
        """The warm-up step has finished on the device: the timed part of the window starts now."""
        self.t_timed = self.clock()
        self.compute_mark = compute_s

    def record(self, compute_s: float) -> dict:
        """The window's token counts and rates (metrics.jsonl fields)."""
        now = self.clock()
        if self.timed_real:
            tokens, flops, seconds = self.timed_real, self.timed_flops, max(now - self.t_timed, 1e-9)
        else:  # the warm-up step alone
            tokens, flops, seconds = self.real, self.flops, max(now - self.t_window, 1e-9)
        compute = compute_s - self.compute_mark
        return {"real_tokens": self.real, "trained_tokens": self.trained, "slot_tokens": self.slots,
                "padding_fraction": 1 - self.real / max(self.slots, 1), "tokens_per_s": tokens / seconds,
                "compute_tokens_per_s": self.timed_real / compute if self.timed_real and compute > 0 else None,
                "mfu": flops / seconds / self.peak_flops, "tflops": flops / seconds / 1e12,
                "peak_tflops": self.peak_flops / 1e12}
