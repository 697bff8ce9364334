"""`gapless gap`: how far a run's throughput is from advertised conditions, factor by factor, measured.

Throughput slides are measured under advertised conditions; a real run differs from them in a handful of
settings. gap runs real training windows with the user's model, method, LoRA, attention and compile settings
on the config's device (a small model on the CPU is enough to exercise it; the tests do), starting from
advertised conditions and switching on the user's settings one at a time, cumulatively:

  stage / factor   what its window changes, and how its throughput is measured
  advertised       every row full: max_seq_len real tokens of random ids below vocab_size, all trained;
                   packed, the user's tokens_per_batch, grad_accum 1, no checkpoints, no evaluation, one
                   metrics read in the window (at its end), the data ready (the loop's data waits left
                   out), bfloat16 on CUDA
  real lengths     the user's documents (their sources through build_data) with their data.batching
  accumulation     the user's train.grad_accum (the same tokens per micro-batch)
  logging          the user's train.log_every (each log is a host sync)
  checkpoints      amortised, see below
  evaluation       amortised, see below (train.eval_every 0: one evaluation at the end, spread over the
                   run's steps)
  start-up         amortised: the seconds from a window's start to the end of its first step (data from the
                   token cache, the model, compile, the first step) spread over the run's steps; for a run folder
                   given without overrides, the run's own (its startup records, from its process start)
  data loading     the seconds the loop waited for its next batch (data_wait: the prefetch thread's
                   collation fell behind) plus the host-to-device copies (h2d_copy), per step; the stages
                   before leave them out
  communication    several processes: from a torchrun run's metrics.jsonl (`gapless gap RUN`), the share f of
                   each rank's step time spent in exposed communication and waiting for slower ranks
                   (`communication_share`); the stage's tokens/s times (1 - f). The windows run in one process:
                   with none of those records ("one process: no communication") the factor is skipped.
  precision        CUDA only: the user's model.dtype instead of bfloat16. On the CPU every window runs in
                   the user's dtype (the advertised bfloat16 is a GPU setting) and the table says so.

A window is one `train(cfg, stop_after=1 + steps)` call in its own folder under OUT/windows/: one warm-up step
(compiles, fills the allocator; not measured) and `steps` measured optimizer steps (RunResult.steady_seconds:
to the end of the loop, the GPU settled, the checkpoint write in flight waited for). A window's point is
(real tokens per step, seconds per step) with its checkpoint, evaluation and data-wait seconds taken out.

Stalls are amortised, because a short window cannot hold a checkpoint every 500 steps. The logging window
(the "intervals" window when logging is skipped) also checkpoints twice (or at the user's interval if that is
shorter) and evaluates once, at its end (or at the user's interval), on the real data path. From its timeline:
stall per checkpoint = checkpoint seconds / checkpoints written (the write in flight at the window's end is
waited for and counted: for async writes an upper bound), likewise per evaluation, and data waits per step.
Each stall factor adds its seconds per step to the stage before it:

    tokens/s = tokens_per_step / (step_s + stall_per_event / every)        (amortised_tokens_per_s)

so its bar is the measured stall, not the noise between two windows. What a stall does outside its own
timeline category (a background checkpoint write slowing the CPU's steps) stays in that window's step time,
the logging factor's. The precision window runs the whole config (at the window's intervals) and is amortised
the same way from its own timeline. Windows are short: on a shared CPU two windows of one config differ by a
few percent; more --steps narrow it.

A factor whose setting equals the advertised one is skipped, with the reason. A factor's delta is its
stage's tokens/s minus the previous stage's; the last stage is "your run", so the bars sum to your run
minus advertised by construction. The advertised window runs once more at the end: the two differ by the
noise and drift of the whole measurement, and a fix is named only for a factor that costs more than that
(at least NOISE) of the advertised throughput. Beside "advertised" stands the ceiling for the user's own lengths:
the real-lengths window's documents at 100% MFU (ceiling_tokens_per_s), so a run faster than advertised still shows
how far it is from the limit. Output: the table (stdout), OUT/gap.json (format: gapless.meter.report), OUT/gap.png
and OUT/gap.html (the waterfall), and for `gapless gap RUN` also RUN/gap.json and RUN/report.html.
"""
from __future__ import annotations

import copy
import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from gapless.config import RunConfig
from gapless.convert import load_any
from gapless.model.loading import read_model_args

DEFAULT_STEPS = 20  # measured steps per window (plus 1 warm-up step); 1-2 s a window for the demo model on a CPU
NOISE = 0.01  # a factor costing less than this share of the advertised throughput (or the measured noise) gets no fix
ADVERTISED_DTYPE = "bfloat16"  # what throughput slides use on a GPU


# ---------------------------------------------------------------------------------------------
# numbers


def amortised_tokens_per_s(tokens_per_step: float, step_s: float, stall_s: float = 0.0, every: float = 1.0) -> float:
    """Throughput when a stall of `stall_s` seconds happens every `every` steps of `step_s` seconds each."""
    return tokens_per_step / (step_s + stall_s / every)


def interval_for(stall_s: float, step_s: float, share: float = NOISE) -> int:
    """The smallest round interval (1, 2, 5, 10, 20, 50, ...) at which a stall of `stall_s` seconds costs at
    most `share` of the step time: stall_s / (interval * step_s) <= share."""
    need = stall_s / (share * step_s)
    k = 0
    while True:
        for m in (1, 2, 5):
            if m * 10 ** k >= need:
                return m * 10 ** k
        k += 1


@dataclass
class Window:
    """The steady part of one train() call (after its warm-up step)."""
    name: str
    folder: str  # the window's run folder (config.yaml, metrics.jsonl, report.html)
    steps: int
    tokens: int  # real tokens of those steps
    seconds: dict[str, float]  # RunResult.steady_seconds: the timeline's categories
    checkpoints: int = 0  # checkpoints written inside the steady part
    evals: int = 0
    padding: float = 0.0  # padding fraction of the slots (from the window's metrics record)
    startup_s: float = 0.0  # from train()'s start to the end of its first step: data, model, compile, step 1
    # the window's lengths at 100% MFU: its tokens/s over its MFU = peak FLOP/s / FLOPs per real token, the
    # peak measured at the window's start and the FLOPs counted on its own documents (gapless/meter/flops.py)
    ceiling_tokens_per_s: float = 0.0
    peak_tflops: float = 0.0  # the matmul peak train() measured at the window's start

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps

    @property
    def wait_s(self) -> float:
        return self.seconds["data_wait"] + self.seconds["h2d_copy"]

    @property
    def step_s(self) -> float:
        """Seconds per step, checkpoint stalls, evaluations and data waits left out."""
        stalls = self.seconds["checkpoint"] + self.seconds["eval"] + self.wait_s
        return (sum(self.seconds.values()) - stalls) / self.steps

    @property
    def checkpoint_stall_s(self) -> float:
        return self.seconds["checkpoint"] / self.checkpoints if self.checkpoints else 0.0

    @property
    def eval_s(self) -> float:
        return self.seconds["eval"] / self.evals if self.evals else 0.0


def waterfall(stages: list[dict], advertised: float, threshold: float = NOISE) -> list[dict]:
    """gap.json's steps from the stages after the advertised one, in order: each measured stage
    ({"factor", "tokens_per_s", "fix", ...}) gets its delta from the previous measured value and keeps its fix
    only if it costs more than `threshold` of the advertised throughput; a skipped one ({"factor", "skipped"})
    passes through."""
    out, previous = [], advertised
    for s in stages:
        if "skipped" in s:
            out.append(s)
            continue
        delta = s["tokens_per_s"] - previous
        out.append({**s, "delta": delta, "fix": s["fix"] if delta < -threshold * advertised else ""})
        previous = s["tokens_per_s"]
    return out


def communication_share(records: list[dict]) -> dict | None:
    """What communication cost a run of several processes, from its training records (metrics.jsonl; the fields
    are gapless.train.parallel's): over its logged windows after the warm-up step,

        f = sum(comm_exposed_s + collective_wait_s_mean) / sum(rank_step_s_max)

    the share of a rank's time in collectives that compute did not hide plus the mean rank's time waiting for the
    slowest. Under FSDP2 comm_exposed_s is null (not measured): f holds the waiting only, and `measured` says so.
    None for a run of one process (no such records)."""
    ranks = [r for r in records if r.get("world_size", 1) > 1 and r.get("rank_step_s_max")]
    steady = [r for r in ranks if r.get("compute_tokens_per_s") is not None] or ranks  # the warm-up's window out
    if not steady:
        return None
    exposed = sum(r.get("comm_exposed_s") or 0.0 for r in steady)
    wait = sum(r["collective_wait_s_mean"] for r in steady)
    seconds = sum(r["rank_step_s_max"] for r in steady)
    return {"share": (exposed + wait) / seconds, "exposed_s": exposed, "wait_s": wait, "seconds": seconds,
            "steps": sum(r.get("window_steps", 0) for r in steady), "world_size": steady[-1]["world_size"],
            "strategy": steady[-1]["strategy"], "measured": steady[-1].get("comm_measured", "")}


# ---------------------------------------------------------------------------------------------
# the windows


@dataclass
class SyntheticSummary:
    """What train() prints about its data, for the synthetic rows."""
    docs: int
    max_seq_len: int

    def format(self) -> str:
        return f"synthetic data: {self.docs} full rows of {self.max_seq_len} random tokens, all trained"


def full_rows(rows: int, max_seq_len: int, vocab_size: int, seed: int = 0):
    """A Mixture of `rows` documents of exactly max_seq_len random token ids, every token trained."""
    from gapless.data.batching import Mixture
    from gapless.data.cache import TokenizedDataset

    n = rows * max_seq_len
    ids = np.random.default_rng(seed).integers(0, vocab_size, n, dtype=np.int32)
    offsets = np.arange(0, n + 1, max_seq_len, dtype=np.int64)
    ds = TokenizedDataset(ids, np.ones(n, np.uint8), offsets, np.arange(rows, dtype=np.int32), {"pad_id": 0})
    return Mixture([ds], [rows], ["synthetic full rows"])


def ceiling_tokens_per_s(records: list[dict]) -> float:
    """The real tokens/s of `records`' documents at 100% MFU, peak FLOP/s over model FLOPs per real token. A record
    gives its FLOPs per real token as tflops / tokens_per_s (both over its timed seconds) and the peak that train()
    measured at its start (peak_tflops); records are weighted by their real tokens. 0 without such records."""
    timed = [r for r in records if r.get("tflops") and r.get("tokens_per_s") and r.get("peak_tflops")]
    seconds_at_peak = sum(r["real_tokens"] * r["tflops"] / (r["tokens_per_s"] * r["peak_tflops"]) for r in timed)
    return sum(r["real_tokens"] for r in timed) / seconds_at_peak if seconds_at_peak else 0.0


class Runner:
    """Runs the windows of one gap measurement into OUT/windows/NN-name and reports each on `log`."""

    def __init__(self, out: Path, steps: int, log):
        self.out, self.steps, self.log = out, steps, log
        self.windows: list[Window] = []

    def window(self, name: str, cfg: RunConfig, data) -> Window:
        from gapless.train.loop import train

        folder = self.out / "windows" / f"{len(self.windows) + 1}-{name}"
        if folder.exists():
            shutil.rmtree(folder)  # a fresh window: no checkpoints or metrics of an earlier gap run
        cfg = copy.deepcopy(cfg)
        cfg.output_dir, cfg.resume, cfg.progress = str(folder), False, False
        # one warm-up step + the window; steps_total stays beyond it, so no final evaluation or adapter
        cfg.train.steps = self.steps + 2
        cfg.schedule.warmup_steps, cfg.schedule.warmup_ratio = 0, 0.0  # the lr's shape costs no time
        if cfg.model.compile:
            import torch

            torch._dynamo.reset()  # the last window's compiled layers refer to its model
        result = train(cfg, stop_after=self.steps + 1, data=data)
        assert result.steady_seconds, "the window ended before its warm-up step"
        records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        train_records = [r for r in records if "loss" in r]
        slots = sum(r["slot_tokens"] for r in train_records)
        last = self.steps + 1  # the last step of the window; steps 1..last follow the warm-up's end
        w = Window(name, str(folder), self.steps, result.steady_tokens, result.steady_seconds,
                   checkpoints=last // cfg.checkpoint.every if cfg.checkpoint.every else 0,
                   evals=sum("eval_loss" in r for r in records),
                   padding=1 - sum(r["real_tokens"] for r in train_records) / slots if slots else 0.0,
                   startup_s=result.first_step_s or 0.0,
                   ceiling_tokens_per_s=ceiling_tokens_per_s(train_records),
                   peak_tflops=max((r.get("peak_tflops") or 0.0 for r in train_records), default=0.0))
        self.windows.append(w)
        self.log(f"gap: window {len(self.windows)} ({name}): {w.tokens_per_step / w.step_s:,.0f} real tokens/s over "
                 f"{self.steps} steps of {w.step_s * 1e3:.1f} ms (stalls left out) in {folder}")
        return w


# ---------------------------------------------------------------------------------------------
# the measurement


class Stages:
    """The stages after the advertised one, each a point (real tokens per step, seconds per step)."""

    def __init__(self, advertised: tuple[float, float]):
        self.advertised = advertised[0] / advertised[1]
        self.point = advertised
        self.rows: list[dict] = []

    def measured(self, factor: str, setting: str, point: tuple[float, float], note: str, fix: str = "") -> None:
        """Switch `factor` on: the stage's point becomes `point`; `fix`: what recovers it if it costs."""
        self.point = point
        self.rows.append({"factor": factor, "setting": setting, "tokens_per_s": point[0] / point[1], "note": note,
                          "fix": fix})

    def stall(self, factor: str, setting: str, stall_s: float, every: float, note: str, fix: str = "") -> None:
        """Switch on a stall of `stall_s` seconds every `every` steps: the current stage's steps, amortised."""
        tokens, step_s = self.point
        self.measured(factor, setting, (tokens, tokens / amortised_tokens_per_s(tokens, step_s, stall_s, every)),
                      note, fix)

    def skipped(self, factor: str, reason: str) -> None:
        self.rows.append({"factor": factor, "skipped": reason})


def communication(stages: Stages, ranks: dict | None) -> None:
    """The communication factor: the stage's tokens/s times (1 - f), f = ranks["share"] (communication_share of a
    torchrun run's records), as a stall of step_s * f / (1 - f) per step; skipped for one process."""
    if ranks is None:
        stages.skipped("communication", "one process: no communication (a torchrun run's folder, `gapless gap RUN`, "
                                        "gives its measured cost)")
    else:
        f, n = ranks["share"], max(ranks["steps"], 1)
        exposed = ("not measured (FSDP2)" if ranks["strategy"] == "fsdp" else
                   f"{1e3 * ranks['exposed_s'] / n:.2f} ms per step exposed")
        stages.stall("communication", f"{ranks['world_size']} processes, parallel.strategy: {ranks['strategy']}",
                     stages.point[1] * f / (1 - f), 1,
                     f"measured in the run: {100 * f:.1f}% of each rank's time ({exposed}, "
                     f"{1e3 * ranks['wait_s'] / n:.2f} ms per step waiting for slower ranks, over {ranks['steps']} "
                     f"steps); tokens/s times (1 - {f:.3f})",
                     "more tokens per step (data.tokens_per_batch, train.grad_accum) spread each all-reduce over "
                     "more compute; waiting: the run's rank_imbalance and slowest_rank in metrics.jsonl")


def measure_gap(cfg: RunConfig, out: str | Path, steps: int = DEFAULT_STEPS, log=None,
                ranks: dict | None = None, startup_s: float | None = None) -> dict:
    """Measure the gap of `cfg` (windows of `steps` measured steps under `out`); gap.json's content. `ranks`:
    communication_share of the run's records when it ran on several processes. `startup_s`: the run's own start-up
    (run_startup_s) for the start-up factor, instead of a window's."""
    from gapless.data.batching import BatchSampler
    from gapless.data.pipeline import build_data
    from gapless.config import resolve_device
    from gapless.diagnosis.doctor import packing_fix
    from gapless.train.loop import resolve_auto, total_steps
    from gapless.train.checkpoint_interval import choose_interval

    if steps < 2:
        raise ValueError(f"--steps: {steps}; a window needs at least 2 measured steps (default {DEFAULT_STEPS})")
    log = log or (lambda text: print(text, file=sys.stderr, flush=True))
    out = Path(out)
    runner = Runner(out, steps, log)
    device = resolve_device(cfg.model.device)
    # "auto" settings resolved once, for the user's own conditions: every window then runs the same attention
    # backend and compile setting, so no bar can hide a change of kernel
    user, auto_note = resolve_auto(cfg, device)
    d = user.data
    last = steps + 1  # steps 1..last run after the warm-up step's end (step 1 is the warm-up itself)

    vocab = read_model_args(user.model.path).vocab_size  # the checkpoint's config.json, checked: fail fast
    mix, eval_mix, summary = build_data(d, Path(d.tokenizer or user.model.path))  # the user's, first: fail fast
    if not len(mix):
        raise ValueError("data: no training documents after reading and filtering; see `gapless data CONFIG`")
    if auto_note:
        log(auto_note)

    # -- advertised conditions
    base = copy.deepcopy(user)
    base.data.batching, base.train.grad_accum, base.train.log_every = "packed", 1, last
    base.data.rows_per_batch = None  # packed rows hold many documents: no cap on them
    base.checkpoint.every, base.train.eval_every = 0, 0
    base.model.dtype = ADVERTISED_DTYPE if device.type == "cuda" else user.model.dtype
    rows = (d.tokens_per_batch // d.max_seq_len) * (last + 1)  # one epoch covers the warm-up and the window
    synthetic = full_rows(rows, d.max_seq_len, vocab, seed=user.train.seed)
    w = runner.window("advertised", base, (synthetic, None, SyntheticSummary(rows, d.max_seq_len)))
    stages = Stages((w.tokens_per_step, w.step_s))

    # -- real lengths with the user's batching
    run = copy.deepcopy(base)
    run.data.batching, run.data.rows_per_batch = d.batching, d.rows_per_batch
    w = runner.window("real-lengths", run, (mix, None, summary))
    ceiling = {"label": "ceiling, your lengths", "tokens_per_s": w.ceiling_tokens_per_s,
               "note": f"your documents at 100% MFU: the matmul peak measured here "
                       f"({w.peak_tflops:.3g} TFLOP/s) over the model FLOPs per real token on your lengths "
                       "(gapless/meter/flops.py); no run reaches it"}
    fix = (packing_fix(d) if d.batching != "packed" else
           "data.pack_algorithm: best_fit" if d.pack_algorithm != "best_fit" else
           "none in the config: packed already; the rest is your documents' lengths (row tails)")
    stages.measured("real lengths", f"data.batching: {d.batching}", (w.tokens_per_step, w.step_s),
                    f"your {len(mix):,} documents; {100 * w.padding:.0f}% of the slots are padding", fix)

    # -- gradient accumulation
    k = user.train.grad_accum
    if k == 1:
        stages.skipped("gradient accumulation", "train.grad_accum is 1, as advertised")
    else:
        run.train.grad_accum = k
        w = runner.window("grad-accum", run, (mix, None, summary))
        stages.measured("gradient accumulation", f"train.grad_accum: {k}", (w.tokens_per_step, w.step_s),
                        f"{k} micro-batches of {d.tokens_per_batch} slots per optimizer step",
                        f"train.grad_accum: 1 with data.tokens_per_batch: {k * d.tokens_per_batch} (if it fits)")

    # -- logging, checkpoints, evaluation and the data path: one window at the window's intervals
    logs = user.train.log_every < last
    # auto: the window saves at a fixed interval to measure the stall; the user's interval is auto's choice from it
    auto_every = user.checkpoint.every == "auto"
    ckpt_every = (0 if not user.checkpoint.every else max(2, last // 2) if auto_every
                  else min(user.checkpoint.every, max(2, last // 2)))
    has_eval = eval_mix is not None and len(eval_mix) > 0
    run_steps = user.train.steps or total_steps(user, BatchSampler.from_config(d, mix).batches_per_epoch())
    if has_eval:  # the user's steps per evaluation: eval_every, or the whole run (one evaluation at its end)
        eval_interval = user.train.eval_every or run_steps
    eval_every = min(eval_interval, last) if has_eval else 0  # one evaluation in the window, at its end
    run.train.log_every = min(user.train.log_every, last)
    run.checkpoint.every, run.train.eval_every = ckpt_every, eval_every
    eval_data = eval_mix if has_eval else None
    if logs or ckpt_every or eval_every:
        w = runner.window("logging" if logs else "intervals", run, (mix, eval_data, summary))
    if not logs:
        stages.skipped("logging", f"train.log_every {user.train.log_every}: at most one metrics read per "
                                  f"{last}-step window, as advertised")
    else:
        reads = last // user.train.log_every
        per_read = (w.step_s - stages.point[1]) * w.steps / reads  # the same batches as the stage before
        each = f"{1e3 * per_read:.1f} ms each" if per_read > 0 else "no measurable cost"
        stages.measured("logging", f"train.log_every: {user.train.log_every}", (w.tokens_per_step, w.step_s),
                        f"{reads} metrics reads (host syncs) in the window: {each} against the stage before "
                        f"(the logging phase itself: {1e3 * w.seconds['logging'] / reads:.2f} ms each)",
                        f"train.log_every: {interval_for(per_read, w.step_s)}")

    every = 0
    if not user.checkpoint.every:
        stages.skipped("checkpoints", "checkpoint.every is 0: no checkpoints, as advertised")
    else:
        stall, every = w.checkpoint_stall_s, user.checkpoint.every
        fix = f"checkpoint.every: {interval_for(stall, stages.point[1])}"
        setting = f"checkpoint.every: {every}"
        if auto_every:  # what the run would choose from this step time and this stall (train/checkpoint_interval.py)
            every = choose_interval(stages.point[1], stall, None, 0, "measured").every
            setting, fix = f"checkpoint.every: auto ({every} steps here)", ""
        if not user.checkpoint.async_write:
            fix += (" or " if fix else "") + "checkpoint.async_write: true"
        stages.stall("checkpoints", setting, stall, every,
                     f"amortised: {stall:.3f} s stall per checkpoint (from {w.checkpoints} written every {ckpt_every} "
                     f"steps in the window, the last write waited for: an upper bound if async) over {every} steps",
                     fix)

    if not has_eval:
        stages.skipped("evaluation", "no held-out data: no evaluation, as advertised")
    else:
        stall = w.eval_s
        setting = (f"train.eval_every: {user.train.eval_every}" if user.train.eval_every
                   else f"train.eval_every: 0 (once, after {run_steps} steps)")
        stages.stall("evaluation", setting, stall, eval_interval,
                     f"amortised: {stall:.3f} s per evaluation of {len(eval_mix):,} documents (from {w.evals} in the "
                     f"window) over {eval_interval} steps",
                     f"train.eval_every: {interval_for(stall, stages.point[1])} or fewer held-out documents")

    # the latest window ran the real data path: its waits, per step
    stages.stall("data loading", "prefetch thread, host-to-device copies", w.wait_s, w.steps,
                 f"{1e3 * w.wait_s / w.steps:.2f} ms per step waiting for the next batch or copying it to "
                 f"{device.type} (data_wait {w.seconds['data_wait']:.3f} s + h2d_copy {w.seconds['h2d_copy']:.3f} s "
                 f"over {w.steps} steps)",
                 "no config setting: one prefetch thread collates the batches (gapless/train/prefetch.py) and fell "
                 "behind the steps")

    communication(stages, ranks)

    # start-up, once per run: a run folder's own (from its process start: the imports, its token cache and compile
    # caches as it found them; 1.9 s for the demo's run against 0.1 s in a window), else the latest window's, from
    # train()'s start to the end of its first step (the token cache warm, as a second run finds it; this process's
    # imports are not in it), over the run's steps
    if startup_s is not None:
        startup, source = startup_s, ("measured in the run (its startup records: the process start, imports, data, "
                                      f"model, {'compile, ' if user.model.compile else ''}step 1)")
    else:
        startup, source = w.startup_s, (f"from the start of the run to the end of its first step (data, model, "
                                        f"{'compile, ' if user.model.compile else ''}step 1)")
    stages.stall("start-up", f"{run_steps} steps in the run", startup, run_steps,
                 f"amortised: {startup:.1f} s {source} over the run's {run_steps} steps",
                 "a longer run amortises it; a second run reuses the token cache"
                 + (" and torch.compile's caches" if user.model.compile else ""))

    if user.model.dtype == base.model.dtype:
        stages.skipped("precision", f"model.dtype: {user.model.dtype}, as advertised" if device.type == "cuda"
                       or user.model.dtype == ADVERTISED_DTYPE else
                       f"on the CPU every window runs in {user.model.dtype} (the advertised {ADVERTISED_DTYPE} "
                       "is a GPU setting); measure on the GPU to see what your precision costs")
    else:
        run.model.dtype = user.model.dtype
        p = runner.window("precision", run, (mix, eval_data, summary))
        step_s = (p.step_s + p.wait_s / p.steps
                  + (p.checkpoint_stall_s / every if every else 0.0)
                  + (p.eval_s / eval_interval if has_eval else 0.0))
        stages.measured("precision", f"model.dtype: {user.model.dtype}", (p.tokens_per_step, step_s),
                        f"the whole config in {user.model.dtype} instead of {ADVERTISED_DTYPE}, its stalls "
                        "amortised as above", f"model.dtype: {ADVERTISED_DTYPE}")

    # noise: advertised conditions again, last; the two windows differ by the noise and drift of the whole measurement
    w = runner.window("advertised-again", base, (synthetic, None, SyntheticSummary(rows, d.max_seq_len)))
    noise = abs(w.tokens_per_step / w.step_s / stages.advertised - 1)
    return {"baseline": {"label": "advertised conditions", "tokens_per_s": stages.advertised,
                         "note": f"full rows of {d.max_seq_len} random tokens, packed, {d.tokens_per_batch} tokens "
                                 f"per step, no checkpoints, no evaluation, data ready, {base.model.dtype}"},
            "steps": waterfall(stages.rows, stages.advertised, max(NOISE, noise)), "final": {"label": "your run"},
            **({"ceiling": ceiling} if ceiling["tokens_per_s"] else {}),
            "measured": {"steps": steps, "warmup_steps": 1, "device": str(device), "dtype": base.model.dtype,
                         "model": user.model.path, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                         "device_name": _device_name(device),
                         "noise": noise,
                         "windows": [asdict(w) for w in runner.windows]}}


# ---------------------------------------------------------------------------------------------
# output


def _device_name(device) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def format_table(gap: dict) -> str:
    """The waterfall as a text table: factor, setting, tokens/s, change, share of the baseline, fix; then how
    each factor was measured."""
    from gapless.meter.report import proposed_fix, signed

    base = gap["baseline"]["tokens_per_s"]
    ceiling = gap.get("ceiling")
    rows = [("factor", "your setting", "tokens/s", "change", "% of adv.", "fix"),
            *([(ceiling["label"], "", f"{ceiling['tokens_per_s']:,.0f}", "",
                f"{100 * ceiling['tokens_per_s'] / base:.1f}%", "")] if ceiling else []),
            (gap["baseline"]["label"], "", f"{base:,.0f}", "", "100.0%", "")]
    value = base
    for s in gap["steps"]:
        if "skipped" in s:
            rows.append((s["factor"], "skipped", "", "", "", ""))
            continue
        value = s["tokens_per_s"]
        rows.append((s["factor"], s.get("setting", ""), f"{value:,.0f}", signed(s["delta"]),
                     f"{100 * value / base:.1f}%", proposed_fix(s)))
    rows.append((gap["final"]["label"], "", f"{value:,.0f}", signed(value - base), f"{100 * value / base:.1f}%",
                 f"({100 * value / ceiling['tokens_per_s']:.1f}% of the ceiling)" if ceiling else ""))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    right = (False, False, True, True, True)

    def line(r) -> str:
        cells = [c.rjust(w) if ri else c.ljust(w) for c, w, ri in zip(r, widths, right)]
        return ("  ".join(cells) + "  " + r[5]).rstrip()

    m = gap.get("measured")
    head = (f"throughput gap, real tokens/s: {gap['baseline']['label']} -> {gap['final']['label']}"
            + (f" ({m['device']}, {m['dtype']}; {len(m['windows'])} windows of {m['steps']} measured steps after "
               f"{m['warmup_steps']} warm-up step)" if m else ""))
    if m and "noise" in m:
        head += (f"\nnoise: the advertised window, run again last, differs by {100 * m['noise']:.1f}%; a fix is named "
                 f"only for a change costing more than {100 * max(NOISE, m['noise']):.1f}% of advertised")
    notes = [f"  {ceiling['label']}: {ceiling['note']}"] if ceiling and ceiling.get("note") else []
    notes += [f"  {gap['baseline']['label']}: {gap['baseline']['note']}"] if gap["baseline"].get("note") else []
    notes += [f"  {s['factor']}: {s['skipped'] if 'skipped' in s else s.get('note', '')}" for s in gap["steps"]]
    return "\n".join([head, *map(line, rows), "", "how each was measured:", *notes])


def write_gap(gap: dict, out: Path) -> Path:
    """OUT/gap.json, OUT/gap.png (the waterfall) and OUT/gap.html (waterfall and table); returns gap.json."""
    from gapless.meter.report import plot_gap, read_gap, write_gap_page

    out.mkdir(parents=True, exist_ok=True)
    path = out / "gap.json"
    path.write_text(json.dumps(gap, indent=1) + "\n")
    checked = read_gap(path)  # what a report will read
    (out / "gap.png").write_bytes(plot_gap(checked))
    write_gap_page(checked, out / "gap.html")
    return path


def run_startup_s(metrics: Path) -> float | None:
    """A run's start-up seconds from its metrics.jsonl: the first_step_s of its {"kind": "startup"} records, one per
    session (a resumed run starts up again), added up; None without one."""
    from gapless.meter.monitor import load_samples

    seconds = [r["first_step_s"] for r in load_samples(metrics) if r.get("kind") == "startup" and r.get("first_step_s")]
    return sum(seconds) if seconds else None


def run_gap(target: str | Path, overrides: list[str] | tuple[str, ...] = (), steps: int = DEFAULT_STEPS,
            out: str | Path | None = None, stream=None, log=None) -> dict:
    """`gapless gap TARGET`: TARGET is a YAML config, or a run folder whose config.yaml is measured (its
    gap.json and report.html are then updated too). Prints the table on `stream`; returns the gap."""
    from gapless.meter.report import write_report

    stream = stream or sys.stdout
    path, run_dir = Path(target), None
    if path.is_dir():
        if not (path / "config.yaml").is_file():
            raise ValueError(f"{path}: no config.yaml in this folder; give a YAML config or a run folder")
        run_dir, path = path, path / "config.yaml"
    cfg = load_any(path, list(overrides))  # a gapless, Axolotl, TRL or LLaMA-Factory config (gapless.convert)
    out = Path(out) if out is not None else (run_dir / "gap" if run_dir is not None else Path("runs/gap"))
    ranks = startup = None
    if run_dir is not None and (run_dir / "metrics.jsonl").is_file():  # a torchrun run: its communication, measured
        from gapless.meter.report import read_run

        ranks = communication_share(read_run(run_dir).train)
        if not overrides:  # the run's own start-up, when the windows measure its own config
            startup = run_startup_s(run_dir / "metrics.jsonl")
    gap = measure_gap(cfg, out, steps, log, ranks, startup)
    gap["config"] = str(path)
    written = [write_gap(gap, out)]
    if run_dir is not None:
        (run_dir / "gap.json").write_text(written[0].read_text())
        written.append(run_dir / "gap.json")
        if (run_dir / "metrics.jsonl").is_file():
            written.append(write_report(run_dir))
    print(format_table(gap), file=stream)
    print(f"\nwrote {', '.join(map(str, written))}, {out / 'gap.png'} and {out / 'gap.html'}", file=stream)
    return gap
