"""Where a run's scalars go besides metrics.jsonl: TensorBoard event files and a Weights & Biases run.

One mapping from records to scalar tags (`scalars`, `gpu_scalars`) and one writer per sink serve both ways there:

- live, `train.report_to: [tensorboard, wandb]`: the loop hands each record to `Sinks.write` at the moment it writes
  it to metrics.jsonl (rank 0 only). The records are host values already, so the sinks add no device read.
  TensorBoard's file is flushed after each record, so a TensorBoard watching RUN/tensorboard shows the run as it
  goes; GPU monitor samples go to TensorBoard as the monitor takes them (flushed every FLUSH_S seconds).
- after the fact, `gapless report RUN --tensorboard / --wandb` (`write_tensorboard`, `export_wandb`): the run
  folder's records replayed through the same writers, for a run trained without report_to, finished or interrupted.

Tags: train/{TRAIN_KEYS} and eval/loss at the record's optimizer step; time/<category>_s (the cumulative time
accounting, gapless.meter.timeline) at the step of each time record; gpu/{GPU_KEYS} against run time (TensorBoard:
x = milliseconds since the run's start, a resumed run's sessions one after the other; W&B: against gpu/t_s, in
seconds). A value that is null or not finite (a diverged step's loss) is left out, as metrics.jsonl writes it null.
Under torchrun, gpu/* is rank 0's GPU (the live sinks are rank 0's); the replay adds rank r's samples
(gpu.rank{r}.jsonl) as gpu/rank{r}/{GPU_KEYS} on the same time axis.

W&B: offline by default (files under RUN/wandb/offline-run-*, no network, no account; `wandb sync
RUN/wandb/offline-run-*` uploads them later); online only when asked. W&B steps must increase and a GPU sample has
no step, so a live W&B run leaves the GPU to W&B's own system metrics (system/gpu.*), and the replay logs gpu/*
after the last step. Each training session (a resume included) is a W&B run of its own, named after the folder.
"""
from __future__ import annotations

import importlib
import math
from pathlib import Path

from gapless.meter.monitor import load_samples
from gapless.meter.report import Run, joined_sessions, read_run

TRAIN_KEYS = ("loss", "lr", "grad_norm", "tokens_per_s", "compute_tokens_per_s", "mfu", "padding_fraction")
GPU_KEYS = ("util", "mem_used_mib", "power_w", "sm_clock_mhz", "temp_c")  # the GPU sample fields written as scalars
# sink -> (the module it imports, the pip extra that installs it)
PACKAGES = {"tensorboard": ("torch.utils.tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}
MODES = ("offline", "online")
FLUSH_S = 5  # TensorBoard writes pending GPU samples at least this often (records are flushed at once)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def scalars(record: dict) -> dict[str, float]:
    """The scalar tags of one metrics.jsonl record, at its "step"; {} for a record that has none."""
    kind = record.get("kind")
    if kind == "time":
        values = {f"time/{c}_s": v for c, v in record["seconds"].items()}
    elif kind is not None:  # resume, compile, stopped, environment, oom_backoff: events, not scalars
        values = {}
    elif "eval_loss" in record:
        values = {"eval/loss": record["eval_loss"]}
    elif "loss" in record:
        values = {f"train/{k}": record.get(k) for k in TRAIN_KEYS}
    else:
        values = {}
    return {tag: v for tag, v in values.items() if _number(v)}


def gpu_scalars(sample: dict, rank: int = 0) -> dict[str, float]:
    """gpu/<key> of rank 0's sample, gpu/rank<r>/<key> of rank r's."""
    prefix = "gpu/" if rank == 0 else f"gpu/rank{rank}/"
    return {f"{prefix}{k}": sample[k] for k in GPU_KEYS if _number(sample.get(k))}


def require(names, where: str = "train.report_to") -> None:
    """A ValueError naming `where` and the pip command for each sink in `names` whose package does not import.
    Called before the model loads, so a missing package stops the run at its start, not in its middle."""
    missing = []
    for name in names:
        module, extra = PACKAGES[name]
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(f"{where}: {name} needs the {extra} package: pip install 'gapless[{extra}]' "
                           "(metrics.jsonl and report.html need nothing more)")
    if missing:
        raise ValueError("\n".join(missing))


class TensorBoardSink:
    """Event files in `folder` (torch.utils.tensorboard)."""

    def __init__(self, folder: Path, gpu_offset_s: float = 0.0):
        from torch.utils.tensorboard import SummaryWriter

        self.folder = folder
        self.gpu_offset_s = gpu_offset_s  # where this session's GPU samples (t from 0) start on the run's time axis
        self.writer = SummaryWriter(str(folder), flush_secs=FLUSH_S)

    def write(self, record: dict) -> None:
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, record["step"])
        self.writer.flush()  # a TensorBoard reading the folder sees it now (a record every log_every steps)

    def gpu(self, sample: dict, rank: int = 0) -> None:
        """From the monitor's thread too: SummaryWriter queues events behind a lock."""
        for tag, value in gpu_scalars(sample, rank).items():
            self.writer.add_scalar(tag, value, int((sample["t"] + self.gpu_offset_s) * 1000))

    def close(self, failed: bool = False) -> None:
        self.writer.close()


class WandbSink:
    """A W&B run whose files go under `run_dir`/wandb. `live`: fed while training (GPU samples left to W&B's own
    system metrics); otherwise a replay, which logs gpu/* against gpu/t_s after the steps."""

    def __init__(self, run_dir: Path, *, project: str, name: str | None, mode: str, entity: str | None = None,
                 config: dict | None = None, live: bool = True):
        if mode not in MODES:
            raise ValueError(f"wandb mode: {mode!r} is not one of {list(MODES)}")
        import wandb

        (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
        self.folder = run_dir / "wandb"
        self.live = live
        self.run = wandb.init(project=project, name=name or run_dir.resolve().name, entity=entity, dir=str(run_dir),
                              mode=mode, config=config)
        if not live:
            self.run.define_metric("gpu/t_s")
            self.run.define_metric("gpu/*", step_metric="gpu/t_s")

    def write(self, record: dict) -> None:
        values = scalars(record)
        if values:  # the records of one step (train, eval, time) merge into its row; a later step commits it
            self.run.log(values, step=record["step"])

    def gpu(self, sample: dict, rank: int = 0) -> None:
        if not self.live:  # live, a sample without a step would move W&B's step past the next record's
            self.run.log({"gpu/t_s": sample["t"], **gpu_scalars(sample, rank)}, commit=True)

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)  # a failed run shows as failed in W&B


class Sinks:
    """The run's report_to sinks, each given every record as metrics.jsonl gets it; none on ranks other than 0."""

    def __init__(self, sinks: list | None = None):
        self.sinks = sinks or []

    def write(self, record: dict) -> None:
        for sink in self.sinks:
            sink.write(record)

    def gpu(self, sample: dict) -> None:
        for sink in self.sinks:
            sink.gpu(sample)

    def close(self, failed: bool = False) -> None:
        """Every sink is closed, also when one of them fails to (the first such error is raised after)."""
        sinks, self.sinks = self.sinks, []
        errors = []
        for sink in sinks:
            try:
                sink.close(failed)
            except Exception as e:  # the next sink is closed all the same
                errors.append(e)
        if errors:
            raise errors[0]

    def __bool__(self) -> bool:
        return bool(self.sinks)


def open_sinks(names, run_dir: Path, wandb_config=None, config: dict | None = None) -> Sinks:
    """The live sinks of `names` (train.report_to) for the run in `run_dir`; `wandb_config`: train.wandb; `config`:
    the run's config as a dict, which the W&B run records."""
    require(names)
    opened = Sinks()
    try:
        for name in names:
            if name == "tensorboard":
                gpu = load_samples(run_dir / "gpu.jsonl") if (run_dir / "gpu.jsonl").is_file() else []
                offset = joined_sessions(gpu)[-1]["t"] if gpu else 0.0  # the earlier sessions' samples come first
                opened.sinks.append(TensorBoardSink(run_dir / "tensorboard", offset))
            else:
                w = wandb_config
                opened.sinks.append(WandbSink(run_dir, project=w.project, name=w.name, mode=w.mode, entity=w.entity,
                                              config=config))
    except BaseException:
        opened.close(failed=True)
        raise
    return opened


def replay(run: Run, sink) -> None:
    """A run folder's records (read_run) through `sink`, in step order, then its GPU samples (rank 0's, then each
    other rank's); closes the sink."""
    try:
        # a stable sort: at one step the training record, then evaluation, then time (W&B steps must increase)
        for record in sorted([*run.train, *run.eval, *run.time], key=lambda r: r["step"]):
            sink.write(record)
        for rank, samples in run.gpu_ranks.items():
            for sample in joined_sessions(samples):
                sink.gpu(sample, rank)
    finally:
        sink.close()


def write_tensorboard(run_dir: str | Path) -> Path:
    """`gapless report RUN --tensorboard`: the run's scalars as event files in RUN/tensorboard; returns that folder."""
    run = read_run(run_dir)  # a folder without metrics.jsonl is refused before anything is written
    require(["tensorboard"], "--tensorboard")
    sink = TensorBoardSink(run.path / "tensorboard")
    replay(run, sink)
    return sink.folder


def export_wandb(run_dir: str | Path, project: str = "gapless", mode: str = "offline") -> Path:
    """`gapless report RUN --wandb`: the run's scalars replayed into a W&B run (files under RUN/wandb); returns
    that folder."""
    if mode not in MODES:
        raise ValueError(f"--wandb-mode: {mode!r} is not one of {list(MODES)}")
    run = read_run(run_dir)
    require(["wandb"], "--wandb")
    sink = WandbSink(run.path, project=project, name=run.path.name, mode=mode, config=run.config, live=False)
    replay(run, sink)
    return sink.folder
