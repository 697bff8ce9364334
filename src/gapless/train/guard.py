"""What guards a run while it steps: non-finite steps are skipped and counted, and SIGTERM/SIGINT stop it cleanly.

Non-finite steps. A step whose gradient norm (computed for clipping anyway; a nan or inf loss makes it nan) is not
finite updates nothing:
- with the fused AdamW (the default on CUDA, `optim.fused: true` elsewhere) through the optimizer's `found_inf`
  tensor, the mechanism torch.amp.GradScaler uses: the kernel reads it on the device and leaves the parameters, the
  moments and the step count as they were. No host sync.
- with the foreach or per-tensor AdamW (the CPU default), which take no such tensor, by reading the norm on the
  host before the update: one sync per step (marked SYNC below). On a CPU that costs nothing measurable, the work is
  already done when the read happens (bench/RELIABILITY.md); on a GPU use the fused kernel.
`NonFinite` keeps the counts on the device (skipped steps in the logging window, consecutive skipped steps) for the
loop to read with its logged metrics: a run of `limit` consecutive skipped steps stops the run with a report of
where it began, found at the first logged step after it.

Stop signals. `StopSignals` turns the first SIGTERM or SIGINT (preemption, Ctrl-C) into a flag the loop reads after
each step (a host bool: no sync): it writes a checkpoint, waits for it, and ends the run ready for --resume;
`gapless train` then exits 128 + the signal (130 for SIGINT, 143 for SIGTERM), not 0: the run is not done. A second
signal ends the process at once (exit status 130).
"""
from __future__ import annotations

import os
import signal
import sys
import threading

import torch

# Consecutive skipped steps after which the run stops: one or two bad batches are noise the skip absorbs; five in a
# row (lr=1e30 from step 5 on, NaN base weights from step 1) do not recover on their own.
NONFINITE_LIMIT = 5


def step_unless_nonfinite(optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor) -> None:
    """optimizer.step(), unless `grad_norm` is nan or inf (then nothing changes)."""
    if optimizer.defaults.get("fused"):
        optimizer.found_inf = (~torch.isfinite(grad_norm)).to(torch.float32)  # read by the fused kernel, on device
        optimizer.grad_scale = None
        optimizer.step()
    elif torch.isfinite(grad_norm):  # SYNC: once per step, unfused optimizers only (see the module doc)
        optimizer.step()


def finite(params: list[torch.Tensor]) -> bool:
    """Whether every parameter is finite: one host read (the caller marks it), for checkpoints and the final save."""
    return bool(torch.stack([torch.isfinite(p).all() for p in params]).all()) if params else True


class NonFinite:
    """Device counters of skipped steps: `add(grad_norm)` per step, `read()` at the logging sync."""

    def __init__(self, device: torch.device, limit: int = NONFINITE_LIMIT):
        self.limit = limit
        self.window = torch.zeros((), dtype=torch.int64, device=device)  # skipped steps since the last read
        self.consecutive = torch.zeros((), dtype=torch.int64, device=device)
        self.total = 0  # host: skipped steps of this call, as read

    def add(self, grad_norm: torch.Tensor) -> torch.Tensor:
        """Count this step; returns its device bool `bad` for the caller's own sums."""
        bad = ~torch.isfinite(grad_norm)
        self.window += bad
        self.consecutive.mul_(bad).add_(bad)  # +1 on a bad step, back to 0 on a good one
        return bad

    def read(self) -> tuple[int, int]:
        """(skipped steps since the last read, consecutive skipped steps up to now); called where the loop already
        syncs, so these reads wait for nothing more."""
        window, consecutive = int(self.window.item()), int(self.consecutive.item())
        self.window.zero_()
        self.total += window
        return window, consecutive


class StopSignals:
    """`with StopSignals() as stop:` ... `if stop.requested:`; installs handlers for SIGTERM and SIGINT in the main
    thread (elsewhere it does nothing: Python delivers signals to the main thread only)."""

    def __init__(self, progress=None):
        self.requested: str | None = None  # the signal's name once one arrived
        self._previous: dict = {}
        self._progress = progress

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested is not None:
            print(f"\n{name} again: exiting now, without a checkpoint", file=sys.stderr, flush=True)
            os._exit(130)
        self.requested = name
        print(f"\n{name}: stopping after this step with a checkpoint (again to exit at once)", file=sys.stderr,
              flush=True)

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
