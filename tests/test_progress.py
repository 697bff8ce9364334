"""The progress display: moves every step from host counts, names the start-up phase, ETA from the steps after
the first, loss only at the logging interval, warnings once through one channel."""
import io
import warnings

import pytest

from gapless.train import progress as progress_mod
from gapless.train.progress import Progress
from test_loop import base  # noqa: F401  (the demo's tiny Llama and data: test_loop's fixture)


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(progress_mod.time, "perf_counter", c)
    return c


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_log_lines_off_a_terminal(clock):
    out = io.StringIO()
    p = Progress(10, stream=out)
    p.phase("startup: first step")
    clock.t += 30.0  # the first step compiles
    p.advance(1, 1000)
    clock.t += 2.0
    p.advance(2, 2000)
    p.update(2, loss=1.5, tokens_per_s=1000.0, lr=2e-4)
    lines = out.getvalue().splitlines()
    assert lines[0] == "[00:00] startup: first step"
    # 2 s per step after the first step (its 30 s of compiling left out); 8 steps to go
    assert lines[1].startswith("step 2/10  2.0k tok  00:32 elapsed  2.00 s/step  ETA 00:16  loss 1.5000")
    assert len(lines) == 2  # advance() alone prints nothing off a terminal


def test_terminal_line_moves_every_step_without_a_log(clock):
    p = Progress(4, stream=Terminal())
    assert p.tty
    p.phase("startup: building and loading the model")
    assert "startup: building and loading the model" in p.status()
    p.advance(1, 10)
    assert "ETA after step 2" in p.status() and "loss" not in p.status()
    clock.t += 0.5
    p.advance(2, 20)
    assert p.status().startswith("step 2/4  20 tok") and "0.50 s/step  ETA 00:01" in p.status()
    p.update(2, loss=2.0, tokens_per_s=40.0, lr=1e-3, mfu=0.25)
    clock.t += 0.5
    p.advance(3, 30)
    assert "step 3/4" in p.status() and "loss 2.0000" in p.status() and "MFU 25%" in p.status()
    p.close()


def test_a_resumed_session_counts_from_its_own_first_step(clock):
    p = Progress(10, stream=Terminal())
    p.advance(6, 10)  # resumed after step 5
    assert "ETA after step 7" in p.status()
    clock.t += 0.5
    p.advance(7, 20)
    assert "0.50 s/step  ETA 00:01" in p.status()
    p.close()


def test_warnings_once_through_one_channel():
    out = io.StringIO()
    p = Progress(1, stream=out)
    with p.route_warnings():
        for _ in range(2):
            warnings.warn("lora.dropout > 0 keeps the grouped kernel out of training", UserWarning)
        warnings.warn("lora.dropout > 0 keeps the grouped kernel out of training", UserWarning, stacklevel=1)
        warnings.warn("another", RuntimeWarning)
    assert out.getvalue().splitlines() == ["warning: lora.dropout > 0 keeps the grouped kernel out of training",
                                           "warning: another"]


def test_an_error_filter_still_raises():
    p = Progress(1, stream=io.StringIO())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning):
            with p.route_warnings():
                warnings.warn("raised")


def test_routed_warnings_still_reach_a_recorder():
    p = Progress(1, stream=io.StringIO())
    with pytest.warns(UserWarning, match="seen by pytest"):
        with p.route_warnings():
            warnings.warn("seen by pytest")


def test_disabled_prints_nothing(clock):
    out = io.StringIO()
    p = Progress(3, stream=out, enabled=False)
    p.phase("x")
    p.advance(1, 1)
    p.update(1, 1.0, 1.0, 1.0)
    p.message("m")
    p.warn("w")
    p.close()
    assert out.getvalue() == ""


def test_elapsed_counts_from_the_runs_clock_start(clock):
    """`gapless train` starts the run's clock at the process start (the imports are start-up): the line's elapsed
    agrees with it, not with the moment the display was made (3 s less on the 2-core CPU box)."""
    out = io.StringIO()
    p = Progress(2, stream=out, t0=clock.t - 3.0)
    p.phase("startup: first step")
    clock.t += 1.0
    p.advance(1, 100)
    p.update(1, loss=1.0, tokens_per_s=100.0, lr=1e-3)
    assert out.getvalue().splitlines() == ["[00:03] startup: first step",
                                           "step 1/2  100 tok  00:04 elapsed  ETA after step 2  loss 1.0000  lr "
                                           "1.00e-03  100 tok/s"]


def test_train_passes_its_clock_start_to_the_line(base, tmp_path):
    import time

    from gapless.train.loop import train
    from test_loop import run_config

    out = io.StringIO()
    train(run_config(base, str(tmp_path / "run"), **{"train.steps": 2, "progress": "true"}), out=out,
          started=time.perf_counter() - 125.0)  # a process that started 2 min 5 s ago
    assert "[02:05] startup: building and loading the model" in out.getvalue().splitlines()
