"""What a person watching a run sees: a live status line (rich) on a terminal, plain log lines otherwise.

On a terminal the line is redrawn 4 times a second and moves with every optimizer step: the step, real tokens,
elapsed time, seconds per step and the ETA come from host-side counts the loop already has (`advance`, no device
read); the loss, lr, tokens/s and MFU change only at the logging interval (`update`, values of the loop's one
logging sync). Until the first step is done the line names the start-up phase (reading data, building the model,
the first step that compiles), so a silent minute reads as what it is.

Seconds per step and the ETA count from the end of the first step of this session: that step compiles kernels and
fills the allocator's cache (tens of seconds on a GPU against well under one for the next). Host-side step times
measure how fast the loop queues work; once the CUDA queue is full (a few steps) the host waits for the device at
the same pace, so over several steps they are the device's rate.

Warnings raised inside the run go through `route_warnings()` to this one channel, formatted as
`warning: MESSAGE` and each distinct message once.
"""
from __future__ import annotations

import contextlib
import sys
import time
import warnings
from typing import TextIO

from rich.console import Console
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

# warnings' own display function when nothing records warnings (a test's pytest.warns replaces it with a list's
# append): route_warnings forwards to the recorder then, so the tests that expect a warning still see it
_STOCK_SHOWWARNMSG = getattr(warnings, "_showwarnmsg_impl", None)


def format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def format_tokens(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


class Progress:
    def __init__(self, total_steps: int, stream: TextIO | None = None, enabled: bool = True, t0: float | None = None):
        """`t0`: the time.perf_counter reading "elapsed" counts from, the run's clock start (the timeline's t0: for
        `gapless train` the process start, so the line agrees with "step 1 done N s after the start" and the last
        record's wall_s); default now."""
        self.total = total_steps
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.console = Console(file=self.stream, highlight=False, markup=False, emoji=False)
        self.tty = enabled and self.console.is_terminal
        self.t0 = time.perf_counter() if t0 is None else t0
        self.phase_text: str | None = "starting"
        self.step = 0
        self.tokens = 0
        self.first: tuple[int, float] | None = None  # (step, time) at the end of this session's first step
        self.logged: dict = {}  # the last logging interval's loss, lr, tokens/s, MFU
        self.warned: set[str] = set()
        self._live: Live | None = None

    # -- what the loop reports

    def phase(self, text: str) -> None:
        """A start-up phase (before the first step is done): shown instead of the rates."""
        self.phase_text = text
        if self.enabled and not self.tty:
            self._line(f"[{format_duration(self._elapsed())}] {text}")
        self._start_live()

    def advance(self, step: int, tokens: int) -> None:
        """`step` optimizer steps done, `tokens` real tokens trained in this session: host ints, every step."""
        now = time.perf_counter()
        if self.first is None:
            self.first = (step, now)
            self.phase_text = None
        self.step, self.tokens = step, tokens

    def update(self, step: int, loss: float, tokens_per_s: float, lr: float, mfu: float | None = None) -> None:
        """At the logging interval: the values of the loop's one sync. Off a terminal, one log line."""
        self.logged = {"loss": loss, "lr": lr, "tokens_per_s": tokens_per_s, "mfu": mfu}
        self.step = max(self.step, step)
        if self.enabled and not self.tty:
            self._line(self.status())

    def message(self, text: str) -> None:
        if self.enabled:
            self._line(text)

    def warn(self, text: str) -> None:
        """One formatted line per distinct warning."""
        if text in self.warned:
            return
        self.warned.add(text)
        if self.enabled:
            self._line(f"warning: {text}")

    @contextlib.contextmanager
    def route_warnings(self):
        """Python warnings raised inside go to `warn`."""
        with warnings.catch_warnings():
            # the filters stay the caller's (an "error" filter still raises); `warn` keeps each distinct message
            # once, also when two places raise the same text
            previous = warnings.showwarning

            def show(message, category, filename, lineno, file=None, line=None):
                self.warn(str(message))
                if getattr(warnings, "_showwarnmsg_impl", None) is not _STOCK_SHOWWARNMSG:  # being recorded
                    previous(message, category, filename, lineno, file, line)

            warnings.showwarning = show
            yield self

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    # -- what it shows

    def seconds_per_step(self) -> float | None:
        if self.first is None or self.step <= self.first[0]:
            return None
        return (time.perf_counter() - self.first[1]) / (self.step - self.first[0])

    def status(self) -> str:
        parts = ([f"step {self.step}/{self.total}", f"{format_tokens(self.tokens)} tok"] if self.total else []) + \
            [f"{format_duration(self._elapsed())} elapsed"]  # the run's length is known once its data is read
        if self.phase_text is not None:
            parts.append(self.phase_text)
        else:
            per_step = self.seconds_per_step()
            if per_step is None:
                # after this session's first step and one more: a resumed run's first step is not step 1
                parts.append(f"ETA after step {self.first[0] + 1}" if self.step < self.total else "done")
            else:
                parts += [f"{per_step:.2f} s/step", f"ETA {format_duration((self.total - self.step) * per_step)}"]
        if self.logged:
            log = self.logged
            parts += [f"loss {log['loss']:.4f}", f"lr {log['lr']:.2e}", f"{log['tokens_per_s']:,.0f} tok/s"]
            if log.get("mfu") is not None:
                parts.append(f"MFU {100 * log['mfu']:.0f}%")
        return "  ".join(parts)

    def _render(self):
        grid = Table.grid(padding=(0, 1))
        grid.add_row(ProgressBar(total=max(self.total, 1), completed=self.step, width=16),
                     Text(self.status(), no_wrap=True, overflow="ellipsis"))  # one line, cut on a narrow terminal
        return grid

    def _elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def _start_live(self) -> None:
        if self.tty and self._live is None:
            # redirect_stderr/stdout: anything printed while the line is live goes above it, not through it
            self._live = Live(get_renderable=self._render, console=self.console, refresh_per_second=4,
                              transient=False)
            self._live.start()

    def _line(self, text: str) -> None:
        self.console.print(text, soft_wrap=True)
