"""W&B export: what reaches wandb is the run folder's metrics, step for step; no wandb installed is a clear error.

A stand-in `wandb` module records the calls (the real package is an optional extra, not installed in CI)."""
import sys
import types

import pytest

from gapless.meter.report import read_run
from gapless.meter.sinks import export_wandb
from test_report import make_run


class FakeRun:
    def __init__(self, **kwargs):
        self.init = kwargs
        self.logged: list[tuple[dict, int | None]] = []
        self.metrics: dict[str, str | None] = {}
        self.finished = False

    def define_metric(self, name, step_metric=None):
        self.metrics[name] = step_metric

    def log(self, data, step=None, commit=None):
        self.logged.append((dict(data), step))

    def finish(self, exit_code=0):
        self.finished = True
        self.exit_code = exit_code


@pytest.fixture
def fake_wandb(monkeypatch):
    module = types.ModuleType("wandb")
    runs = []

    def init(**kwargs):
        runs.append(FakeRun(**kwargs))
        return runs[-1]

    module.init = init
    monkeypatch.setitem(sys.modules, "wandb", module)
    return runs


def test_export_logs_every_record_at_its_step(tmp_path, fake_wandb):
    run_dir = make_run(tmp_path / "run", steps=60)
    out = export_wandb(run_dir)
    (wb,) = fake_wandb
    assert out == run_dir / "wandb" and out.is_dir() and wb.finished
    assert wb.init["mode"] == "offline" and wb.init["name"] == "run" and wb.init["config"]["train"]["steps"] == 60
    run = read_run(run_dir)
    by_step: dict[int, dict] = {}  # W&B merges the logs of one step into its row
    for data, step in wb.logged:
        if step is not None:
            by_step.setdefault(step, {}).update(data)
    steps = [step for _, step in wb.logged if step is not None]
    assert steps == sorted(steps)  # W&B drops a step lower than the last one
    for r in run.train:
        assert by_step[r["step"]]["train/loss"] == r["loss"]
        assert by_step[r["step"]]["train/tokens_per_s"] == r["tokens_per_s"]
        assert by_step[r["step"]]["train/mfu"] == r["mfu"]
    for r in run.eval:
        assert by_step[r["step"]]["eval/loss"] == r["eval_loss"]
    last = run.time[-1]
    assert by_step[last["step"]]["time/compute_s"] == last["seconds"]["compute"]
    gpu = [data for data, step in wb.logged if step is None]
    assert len(gpu) == len(run.gpu) and all("gpu/t_s" in g for g in gpu)
    assert wb.metrics["gpu/*"] == "gpu/t_s"


def test_export_errors(tmp_path, monkeypatch):
    run_dir = make_run(tmp_path / "run", steps=20, gpu=False)
    with pytest.raises(ValueError, match="one of"):
        export_wandb(run_dir, mode="cloud")
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ValueError, match=r"--wandb: .*pip install 'gapless\[wandb\]'"):
        export_wandb(run_dir)


def test_report_cli_exports_to_wandb(tmp_path, fake_wandb):
    from gapless.cli import main

    run_dir = make_run(tmp_path / "run", steps=20, gpu=False)
    assert main(["report", str(run_dir), "--wandb", "--wandb-project", "p1"]) == 0
    (wb,) = fake_wandb
    assert wb.init["project"] == "p1" and wb.init["mode"] == "offline" and wb.finished
    assert (run_dir / "report.html").is_file()
