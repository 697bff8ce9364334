"""The safety of a run folder: one run at a time, no finished run overwritten by accident, and a resume that
continues the same run.

- `RunLock`: an exclusive flock on RUN/.lock for the whole `train` call. The kernel drops it when the process ends
  however it ends (kill -9 included), so a killed run never leaves a stale lock; the file holds the holder's pid,
  host and start time for the message a second run gets.
- `prepare_run_dir`: a folder that holds a run (metrics.jsonl or checkpoints) is refused unless the run resumes it
  or `overwrite` is set; overwriting removes the old run's checkpoints and final output first, so a later
  `--resume` can never continue from the old run's step.
- `check_resume`: `--resume` with a config whose data, model, method, LoRA, optimizer, schedule or batch settings
  differ from the run's config.yaml refuses, naming each field; the settings listed in RESUMABLE may change and are
  returned, for the loop to record.
- `default_output_dir`: runs/CONFIG-NAME-YYYYmmdd-HHMMSS when the config sets no output_dir (runs never collide by
  default); with --resume, the newest such folder.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import time
from pathlib import Path

import yaml

from gapless.config import RunConfig, read_yaml, to_dict

LOCK = ".lock"

# Dotted config fields a resume may change: how long the run goes on, how often it logs, evaluates and saves, where
# the metrics also go, and where or how fast it runs (attention backend and compile give the same numbers within
# rounding). Everything else would mix two runs in one set of weights: the data, model, method, rank, alpha,
# optimizer and batch settings.
RESUMABLE = ("train.steps", "train.epochs", "train.log_every", "train.eval_every", "train.evals_per_epoch",
             "checkpoint.every", "checkpoint.per_epoch", "checkpoint.keep", "checkpoint.async_write", "progress",
             "resume", "output_dir", "model.device", "model.attn_backend", "model.compile", "data.num_workers",
             "data.cache_dir", "train.report_to", "train.wandb")
# values of one field that compute the same numbers, so a resume may swap them: lora.kernel concat and concat_b run
# grouped's sums in one GEMM (and run grouped themselves under QLoRA and FSDP2), and runs before each became the
# default recorded grouped or concat
INTERCHANGEABLE = {"lora.kernel": {"concat", "concat_b", "grouped"}}
# fields whose "auto" resolves, on resume, to the number the run's config.yaml holds (loop.auto_tokens_per_batch):
# the config.yaml of a run started with auto records the number the batch finder chose
AUTO_ON_RESUME = ("data.tokens_per_batch",)


def launched_by_torchrun() -> bool:
    """Whether torchrun started this process as a rank (here, not in train.parallel, so `gapless train` asks before
    torch is imported)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


class RunLock:
    """`with RunLock(run_dir):` holds RUN/.lock exclusively; a second holder gets a ValueError naming the first."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOCK
        self._fd: int | None = None

    def __enter__(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ValueError(f"output_dir: {self.path.parent} is in use by another run ({holder}); wait for it to "
                             "end, or give this run another output_dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the flock; the file stays (unlinking it would race)
            self._fd = None


def existing_run(run_dir: str | Path) -> str | None:
    """What of a run `run_dir` holds (for messages), or None when it holds none."""
    run = Path(run_dir)
    found = []
    metrics = run / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size:
        found.append("metrics.jsonl")
    steps = sorted(p.name for p in (run / "checkpoints").glob("step-*")) if (run / "checkpoints").is_dir() else []
    if steps:
        found.append(f"checkpoints up to {steps[-1]}")
    finals = [p.name for p in run.iterdir() if _is_final(p)] if run.is_dir() else []
    if finals:
        found.append(f"the final {', '.join(sorted(finals))}/ (a finished run)")
    return ", ".join(found) or None


def prepare_run_dir(run_dir: str | Path, *, resume: bool, overwrite: bool) -> None:
    """Refuse a folder that holds a run unless resuming it or overwriting it; overwriting removes its checkpoints,
    final outputs and metrics first."""
    run = Path(run_dir)
    held = existing_run(run)
    if held is None or resume:
        return
    if not overwrite:
        raise ValueError(f"output_dir: {run} already holds a run ({held}); continue it with --resume, replace it "
                         "with --overwrite, or give this run another output_dir")
    # RUN/tensorboard's event files would mix with the new run's; RUN/wandb's runs are each a W&B run of its own: kept.
    # The attention warm-up's log (warm_attention.LOG, named here because the CLI imports this module before torch)
    # goes too: a new run that starts no warm-up process would otherwise show the old run's (session 22's logs)
    for name in ("checkpoints", "metrics.jsonl", "gpu.jsonl", "report.html", "tensorboard", "attention_warmup.log"):
        path = run / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    for p in run.iterdir():
        if _is_final(p):
            shutil.rmtree(p)


def _is_final(path: Path) -> bool:
    """A run's final output: a PEFT adapter folder or an HF model folder."""
    return path.is_dir() and ((path / "adapter_config.json").is_file() or (path / "config.json").is_file())


def _flatten(d: dict, prefix: str = "") -> dict:
    """{"a": {"b": [{"c": 1}]}} -> {"a.b.0.c": 1}: the dotted names of the config's overrides."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            v = {str(i): x for i, x in enumerate(v)}
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{key}."))
        else:
            out[key] = v
    return out


def check_resume(saved: dict, new: dict) -> dict[str, tuple]:
    """Compare the run's config.yaml (`saved`) with the resumed config (`new`), both as plain dicts. Returns the
    RESUMABLE fields that changed, {field: (old, new)}; any other change is a ValueError naming every such field."""
    old_flat, new_flat = _flatten(saved), _flatten(new)
    changed = {k: (old_flat.get(k), new_flat.get(k)) for k in sorted(old_flat.keys() | new_flat.keys())
               if old_flat.get(k) != new_flat.get(k) and not (k in AUTO_ON_RESUME and new_flat.get(k) == "auto")}
    refused = {k: v for k, v in changed.items()
               if not k.startswith(RESUMABLE) and not set(v) <= INTERCHANGEABLE.get(k, set())}
    if refused:
        listed = "; ".join(f"{k}: {json.dumps(a, default=str)} -> {json.dumps(b, default=str)}"
                           for k, (a, b) in refused.items())
        raise ValueError(f"--resume: the config differs from the run's config.yaml in {', '.join(refused)} "
                         f"({listed}); a resumed run must train the same model on the same data with the same "
                         f"settings. Only these may change on resume: {', '.join(RESUMABLE)} (and lora.kernel "
                         "among concat, concat_b and grouped). Start a new run for the new settings")
    return changed


def read_saved_config(run_dir: str | Path) -> dict | None:
    path = Path(run_dir) / "config.yaml"
    return read_yaml(path) if path.is_file() else None  # a hand-edited file that broke: its line


def write_run_config(run_dir: Path, cfg: RunConfig) -> None:
    """The run's config.yaml: the config as it runs (written at the start, then again as start-up resolves a
    setting: the batch finder's tokens, the per-epoch intervals)."""
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def default_output_dir(config_path: str | Path, *, resume: bool, root: str | Path = "runs",
                       now: float | None = None) -> str:
    """runs/NAME-YYYYmmdd-HHMMSS for config NAME.yaml; with `resume`, the newest existing runs/NAME-* folder."""
    name = Path(config_path).stem
    base = Path(root)
    if resume:
        runs = sorted(p for p in base.glob(f"{name}-*") if p.is_dir() and p.name[len(name) + 1:].replace("-", "")
                      .isdigit())
        if not runs:
            raise ValueError(f"--resume: no run of {config_path} in {base}/ ({name}-*); set output_dir to the run "
                             "folder to continue")
        return str(runs[-1])
    return str(base / f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(now))}")


def output_dir_overrides(config_path: str | Path, overrides: list[str], *, resume: bool) -> list[str]:
    """The override that sets the per-run default output folder when neither the config nor an override sets one."""
    if any(o.split("=", 1)[0].strip() == "output_dir" for o in overrides) or "output_dir" in read_yaml(config_path):
        return []
    return [f"output_dir={default_output_dir(config_path, resume=resume)}"]
