"""Weights & Biases as an option: a run folder's metrics replayed into a W&B run, offline by default.

metrics.jsonl stays the source of truth; this only reads the run folder (as report.html and the TensorBoard
files do), so it works after the fact, for a finished or an interrupted run, and never slows the loop.
Offline mode writes RUN/wandb/offline-run-* with no network and no account; `wandb sync RUN/wandb/offline-run-*`
uploads it later. Needs the `wandb` package (pip install wandb).

Logged: train/{loss, lr, grad_norm, tokens_per_s, compute_tokens_per_s, mfu, padding_fraction} and eval/loss at
their optimizer step; time/<category>_s (the cumulative time accounting) at the step of each time record;
gpu/<field> against gpu/t_s (seconds of run time), since GPU samples are not tied to steps.
"""
from __future__ import annotations

from pathlib import Path

from gapless.meter.report import GPU_KEYS, joined_sessions, read_run

TRAIN_KEYS = ("loss", "lr", "grad_norm", "tokens_per_s", "compute_tokens_per_s", "mfu", "padding_fraction")
MODES = ("offline", "online")


def export_wandb(run_dir: str | Path, project: str = "gapless", mode: str = "offline") -> Path:
    """Replay RUN's metrics into a W&B run (its files under RUN/wandb) and return that folder."""
    if mode not in MODES:
        raise ValueError(f"--wandb-mode: {mode!r} is not one of {list(MODES)}")
    try:
        import wandb
    except ImportError:
        raise ValueError("W&B export needs the wandb package: pip install wandb "
                         "(report.html needs nothing more)") from None
    run = read_run(run_dir)
    out = run.path / "wandb"
    out.mkdir(exist_ok=True)
    wb = wandb.init(project=project, name=run.path.name, dir=str(run.path), mode=mode, config=run.config)
    try:
        wb.define_metric("gpu/t_s")
        wb.define_metric("gpu/*", step_metric="gpu/t_s")
        events: dict[int, dict] = {}  # one log call per step: W&B steps must increase
        for r in run.train:
            events.setdefault(r["step"], {}).update(
                {f"train/{k}": r[k] for k in TRAIN_KEYS if r.get(k) is not None})
        for r in run.eval:
            events.setdefault(r["step"], {})["eval/loss"] = r["eval_loss"]
        for r in run.time:
            events.setdefault(r["step"], {}).update({f"time/{c}_s": v for c, v in r["seconds"].items()})
        for step in sorted(events):
            wb.log(events[step], step=step)
        for s in joined_sessions(run.gpu):
            wb.log({"gpu/t_s": s["t"], **{f"gpu/{k}": s[k] for k in GPU_KEYS if s.get(k) is not None}},
                   commit=True)
    finally:
        wb.finish()
    return out
