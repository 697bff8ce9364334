"""What a person watching a run sees: a one-line progress bar on a terminal, plain log lines otherwise.

Updated only at logging steps (the values come from the logging sync), so it costs the hot path nothing.
"""
from __future__ import annotations

import sys
import time
from typing import TextIO


def format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class Progress:
    def __init__(self, total_steps: int, stream: TextIO | None = None, enabled: bool = True):
        self.total = total_steps
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and self.stream.isatty()
        self.start = time.perf_counter()
        self.start_step: int | None = None

    def update(self, step: int, loss: float, tokens_per_s: float, lr: float, mfu: float | None = None) -> None:
        """`step` optimizer steps are done; tokens_per_s counts real tokens; mfu is a fraction of the peak."""
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.start_step is None:  # the first update after (re)start: ETA counts from here
            self.start_step, self.start = step, now
            eta = "?"
        else:
            rate = (step - self.start_step) / max(now - self.start, 1e-9)
            eta = format_duration((self.total - step) / rate) if rate > 0 else "?"
        text = (f"step {step}/{self.total}  loss {loss:.4f}  lr {lr:.2e}  "
                f"{tokens_per_s:,.0f} tok/s" + (f"  MFU {100 * mfu:.0f}%" if mfu is not None else "") + f"  ETA {eta}")
        if self.tty:
            width = 24
            filled = int(width * step / max(self.total, 1))
            self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {text}\x1b[K")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\r\x1b[K")
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()
