"""The one training loop. LoRA, QLoRA and full fine-tuning differ only in the Method (gapless.model.method): its
model transform, its trainable parameters and what the run saves; everything here is shared.

`train(cfg)` reads top to bottom in four parts:
    setup       the device, the run folder, the data, the model (gapless.train.assemble), optimizer, checkpoints
    resume      the newest complete checkpoint, when asked
    run_loop    the steps (gapless.train.step), logging windows (gapless.meter.window), checkpoints, evaluation
    finish      the final evaluation, the method's final save, the report and the whole-run record

Around them (train/runlock.py, train/guard.py): the run folder is locked for the call; a folder holding a run is
refused unless resumed or overwritten; a resume whose config changed refuses, naming the fields; a step whose loss
or gradient norm is not finite updates nothing and is counted (`nonfinite_steps`; fp16's loss scaler does this
itself), and `NONFINITE_LIMIT` of them in a row stop the run; no checkpoint or final output is written from
non-finite weights; SIGTERM/SIGINT end the run after the current step with a checkpoint, ready for --resume.

Host syncs: the hot path has none. Loss sums and grad norms stay on the device and are read once per
`train.log_every` steps (marked SYNC below). Tokens are host integers from the data pipeline; the whole run's
throughput is the last record of metrics.jsonl: real tokens / wall time from the start of `train` to its end.
`train.report_to` sinks (TensorBoard, W&B: gapless.meter.sinks) get each record as metrics.jsonl does, on rank 0,
and are closed however the run ends (a W&B run that raised is marked failed).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from gapless.config import CONCAT_KERNELS, RunConfig, resolve_device, to_dict
from gapless.data.batching import Batch, BatchSampler
from gapless.kernels.attention import compiles_once
from gapless.meter.flops import measure_peak_flops, step_flops
from gapless.meter.monitor import GpuMonitor
from gapless.meter.report import plots_of, read_run, write_report
from gapless.meter.sinks import Sinks, open_sinks
from gapless.meter.sinks import require as require_sinks
from gapless.meter.timeline import CATEGORIES, StartupParts, Timeline, format_summary
from gapless.meter.window import ThroughputWindow
from gapless.model.method import Method, method_of
from gapless.train.batch_finder import drop_gradients, free_memory, run_with_oom_backoff, split_rows
from gapless.train.checkpoint import CheckpointManager, capture_rng_state, load, restore_rng_state, resume_point
from gapless.train.checkpoint_interval import MEASURE_STEPS, CheckpointSchedule, tensor_bytes
from gapless.train.dist_checkpoint import checkpoint_manager, is_dcp, load_sharded
from gapless.train.compile import (cache_counts, compile_phases, compile_seconds, frames_not_compiled,
                                  not_compiled_message)
from gapless.train.guard import NonFinite, StopSignals, finite
from gapless.train.loss_scale import DynamicLossScaler
from gapless.train.optim import MasterWeights, build_optimizer, build_scheduler
from gapless.train.parallel import Dist, aggregate, full_parameters, init_distributed, loss_divisor, max_over_ranks
from gapless.train.prefetch import Prefetcher
from gapless.train.progress import Progress
from gapless.train.runlock import RunLock, check_resume, prepare_run_dir, read_saved_config, write_run_config
from gapless.train.step import loss_sum, train_step


def resolve_auto(cfg: RunConfig, device: torch.device) -> tuple[RunConfig, str | None]:
    """cfg with model.attn_backend and model.compile "auto" replaced by what runs on `device`, and a line saying
    what was chosen and why (None when nothing was "auto")."""
    from gapless.kernels.attention import choose_backend
    from gapless.model.loading import DTYPES, read_model_args

    m = cfg.model
    if m.attn_backend != "auto" and m.compile != "auto":
        return cfg, None
    attn, why = m.attn_backend, ""
    if attn == "auto":
        args = read_model_args(m.path)
        attn, why = choose_backend(device, DTYPES[m.dtype], cfg.data.batching == "packed",
                                   softcap=args.attn_softcap is not None, head_dim=args.head_dim)
    compile_ = m.compile if m.compile != "auto" else device.type == "cuda"
    cfg = replace(cfg, model=replace(m, attn_backend=attn, compile=compile_))
    chosen = [f"{key} {value}" for key, value, given in (("attn_backend", attn, m.attn_backend),
                                                        ("compile", str(compile_).lower(), m.compile))
              if given == "auto"]
    return cfg, (f"model: {', '.join(chosen)} (auto on {device.type}, {m.dtype}, {cfg.data.batching} rows"
                 + (f"; {why}" if why else "") + ")")


def resolve_lora_kernel(cfg: RunConfig, strategy: str) -> tuple[RunConfig, str | None]:
    """cfg with lora.kernel "concat" or "concat_b" replaced where it cannot run by a form with the same sums, and a
    line saying why (None where nothing changed): LoRA dropout under concat runs concat_b (concat's A rows would read
    dropout(x), its base rows x; concat_b reads dropout(x) in its own rank-R GEMM); QLoRA (an NF4 base has no rows
    or columns to append to) and FSDP2 (each rank holds shards, not whole projections) run grouped."""
    lora = cfg.lora
    if cfg.method == "full" or lora.kernel not in CONCAT_KERNELS:
        return cfg, None
    if cfg.method == "qlora" or strategy == "fsdp":
        why = ("method qlora: an NF4 base has no rows or columns to append to" if cfg.method == "qlora"
               else "FSDP2 shards the projections")
        return (replace(cfg, lora=replace(lora, kernel="grouped")),
                f"lora.kernel: grouped, not {lora.kernel} ({why}; the same sums, one A matmul per group)")
    if lora.dropout > 0 and lora.kernel == "concat":
        return (replace(cfg, lora=replace(lora, kernel="concat_b")),
                f"lora.kernel: concat_b, not concat (lora.dropout {lora.dropout:g} reads dropout(x) for A, x for the "
                "base; the same sums, the B matrices inside the base GEMM)")
    return cfg, None


def resolve_per_epoch(cfg: RunConfig, batches_per_epoch: int) -> tuple[RunConfig, str | None]:
    """cfg with train.evals_per_epoch and checkpoint.per_epoch (N per pass over the training data) replaced by the
    step intervals they come to, train.eval_every and checkpoint.every = max(1, optimizer steps per epoch // N), and a
    line saying so (None where neither is set). The steps per epoch are known once the data is read."""
    train, ckpt = cfg.train, cfg.checkpoint
    if train.evals_per_epoch is None and ckpt.per_epoch is None:
        return cfg, None
    steps = batches_per_epoch // train.grad_accum
    said = []
    if train.evals_per_epoch is not None:
        every = max(1, steps // train.evals_per_epoch)
        train = replace(train, eval_every=every, evals_per_epoch=None)
        said.append(f"train.eval_every {every} (evals_per_epoch {cfg.train.evals_per_epoch})")
    if ckpt.per_epoch is not None:
        every = max(1, steps // ckpt.per_epoch)
        ckpt = replace(ckpt, every=every, per_epoch=None)
        said.append(f"checkpoint.every {every} (per_epoch {cfg.checkpoint.per_epoch})")
    return (replace(cfg, train=train, checkpoint=ckpt),
            f"{', '.join(said)}: {steps} optimizer steps per epoch ({batches_per_epoch} batches, grad_accum "
            f"{cfg.train.grad_accum}) // N, at least 1")


@torch.no_grad()
def evaluate(model, batches: list[Batch], device: torch.device) -> dict:
    """Mean loss over all trained tokens of the eval batches (one sync at the end)."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float32, device=device)
    tokens = 0
    for b in batches:
        total += loss_sum(model, b.to(device))
        tokens += b.num_target_tokens
    model.train(was_training)
    return {"eval_loss": total.item() / max(tokens, 1), "eval_tokens": tokens}  # SYNC: once per eval


@dataclass
class RunResult:
    run_dir: Path
    steps: int
    losses: dict[int, float] = field(default_factory=dict)  # step -> mean loss of that logged step
    final_dir: Path | None = None
    real_tokens: int = 0  # of every step this call ran (under torchrun: this rank's)
    # under torchrun: every rank's real tokens, summed at each log point (gapless.train.parallel.aggregate); None
    # in one process
    global_real_tokens: int | None = None
    wall_s: float = 0.0  # from the start of `train` to its last record (the report's plots in, its page after: ms)
    tokens_per_s: float = 0.0  # real_tokens / wall_s
    # the steady part: the steps after the warm-up step (which compiles), from its end to the end of the loop
    # (the GPU settled, the last checkpoint write waited for); what `gapless gap` compares
    steady_tokens: int = 0
    steady_s: float = 0.0
    steady_seconds: dict[str, float] = field(default_factory=dict)  # the timeline's categories in steady_s
    # from the start of the run's clock to the end of its first optimizer step (settled on the GPU): start-up
    first_step_s: float | None = None
    nonfinite_steps: int = 0  # steps whose loss or gradients were not finite: no update applied (bf16/fp32)
    stopped: str | None = None  # why the run ended before its last step: a signal's name, "nonfinite", "final_write"
    seconds: dict[str, float] = field(default_factory=dict)  # the timeline's categories at the end

    @property
    def steady_tokens_per_s(self) -> float:
        return self.steady_tokens / self.steady_s if self.steady_s > 0 else 0.0


def total_steps(cfg: RunConfig, batches_per_epoch: int) -> int:
    if cfg.train.steps:
        return cfg.train.steps
    steps = math.ceil(cfg.train.epochs * batches_per_epoch / cfg.train.grad_accum)
    if steps < 1:
        raise ValueError(f"train.epochs: {cfg.train.epochs} epochs of {batches_per_epoch} batches with "
                         f"grad_accum {cfg.train.grad_accum} is less than one optimizer step")
    return steps


class Metrics:
    """metrics.jsonl, and the train.report_to sinks (gapless.meter.sinks), which get each record at the moment it is
    written: the same host values, so no device read is added. Ranks other than 0 write to os.devnull, no sinks."""

    def __init__(self, file, sinks: Sinks | None = None):
        self.file, self.sinks = file, sinks or Sinks()

    def write(self, record: dict) -> None:
        """One strict JSON line: a nan or inf number (a diverged loss or grad norm) is written as null."""
        self.file.write(json.dumps(_strict(record), allow_nan=False) + "\n")
        self.file.flush()
        self.sinks.write(record)

    def close(self, failed: bool = False) -> None:
        """The file, then every sink (flushed; a W&B run marked failed when the run raised)."""
        try:
            self.file.close()
        finally:
            self.sinks.close(failed)


def _strict(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


def open_metrics(path: Path, resumed_step: int):
    """metrics.jsonl for appending. A resumed run redoes the steps after its checkpoint, so the records
    the interrupted run wrote for them (and a line cut short by the kill) are dropped, not duplicated."""
    if not resumed_step:
        return open(path, "w")
    lines = path.read_text().splitlines() if path.is_file() else []
    kept = []
    for line in lines:
        try:
            if json.loads(line)["step"] <= resumed_step:
                kept.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            pass
    path.write_text("".join(kept))
    return open(path, "a")


@dataclass
class Run:
    """What the parts of one `train` call share."""
    cfg: RunConfig
    device: torch.device
    timeline: Timeline
    progress: Progress
    run_dir: Path
    tokenizer_dir: Path
    method: Method
    model: torch.nn.Module
    params: list[torch.Tensor]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sampler: BatchSampler
    eval_batches: list[Batch]
    steps_total: int
    checkpoints: CheckpointManager
    peak_flops: float
    masters: MasterWeights  # float32 copies of bf16/fp16 trainable weights (full fine-tuning); `params` are these
    scaler: DynamicLossScaler | None  # fp16's loss scaler; None in bf16/fp32
    nonfinite: NonFinite  # the guard against NaN/inf steps (gapless.train.guard)
    startup: StartupParts  # where start-up's seconds went, up to the end of step 1
    parallel: Dist = field(default_factory=Dist)  # this rank's place in a torchrun run (gapless.train.parallel)


def setup(cfg: RunConfig, device: torch.device, timeline: Timeline, progress: Progress, data=None,
          parallel: Dist = Dist()) -> Run:
    """The run folder, the data, the model as the method makes it, the optimizer: everything before step 1."""
    from gapless.data.pipeline import build_data
    from gapless.model.loading import build, read_model_args, resolve_dtype
    from gapless.train import warm_attention
    from gapless.train.assemble import assemble

    startup = StartupParts(timeline.t0)
    startup.mark("imports_config")
    run_dir = Path(cfg.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if parallel.is_main:  # after train's checks
        write_run_config(run_dir, cfg)
    torch.manual_seed(cfg.train.seed)
    # the settings that need the model's config.json, before the model is built or any data is tokenized; its fields
    # as the model reads them (an image-text checkpoint, Gemma 3's, keeps them under text_config or leaves them out)
    model_args = read_model_args(cfg.model.path)
    cfg.check_model(model_args.max_position_embeddings, model_args.rope_scaling.rope_type)

    # -- data, started first in one process: tokenizing (worker processes, or the token cache) runs beside the
    # model's loading and is waited for after it (the example 3B config cold on an H100: data 16.5 s, load 7.5 s, one
    # after the other, run s17-startup-norblock). Under torchrun rank 0 fills the cache after the model, the others
    # then read it (below).
    tokenizer_dir = Path(cfg.data.tokenizer or cfg.model.path)
    vocab_size = model_args.vocab_size
    beside = None
    if data is None and not parallel.active:
        beside = DataBeside(cfg.data, tokenizer_dir, vocab_size)

    # -- model: built on meta, transformed by the method, then loaded (gapless.train.assemble)
    progress.phase("startup: building and loading the model")
    method = method_of(cfg)
    model = build(cfg.model.path, cfg.model.attn_backend)

    def attention_warmed(warm_up: warm_attention.WarmUp) -> None:  # at the model's first attention call
        startup.overlapped["attention"] = warm_up.seconds
        progress.message(f"startup: the attention kernels compiled in a second process in {warm_up.seconds:.1f} s"
                         f"{'' if warm_up.ok else ' (failed: ' + str(warm_up.log) + ')'}; the first call waited "
                         f"{warm_up.waited:.1f} s for it")

    if not parallel.active:  # flash-attn-4's kernels compiled by a second process meanwhile (warm_attention)
        warm_attention.start(model, cfg.data, resolve_dtype(cfg.model.dtype, model.config_dict), device, run_dir,
                             on_done=attention_warmed)
    model = assemble(model, method, device, cfg.model.dtype,
                     activation_checkpointing=cfg.model.activation_checkpointing, compile=cfg.model.compile,
                     parallel=parallel)
    startup.mark("model")
    dtype = next(model.parameters()).dtype
    peak_flops = measure_peak_flops(device, dtype)  # MFU's denominator, measured here (~0.2 s)
    # the optimizer updates float32 tensors: the trainable ones as they are, or float32 masters of bf16/fp16 ones
    masters = MasterWeights(method.trainable(model).items())
    params = masters.masters
    if parallel.active and masters.active:  # the optimizer's tensors are then not the model's: DCP cannot name them
        raise ValueError(f"model.dtype: {cfg.model.dtype} trainable weights keep float32 masters, which several "
                         "processes do not support yet; use model.dtype: float32 under torchrun")
    if cfg.data.tokens_per_batch == "auto" and parallel.active:  # each rank would measure, and might choose, its own
        raise ValueError("data.tokens_per_batch: auto is not supported under torchrun yet; give the global batch "
                         "in tokens (a multiple of max_seq_len times the number of processes)")
    if cfg.data.tokens_per_batch == "auto":
        cfg = auto_tokens_per_batch(cfg, model, method, params, device, run_dir, progress)
    elif (beside is not None and cfg.model.compile and cfg.data.batching == "packed" and compiles_once(model.attn_fn)
          and not beside.future.done()):
        # step 1's first compile (the layers, and whatever compiles at a first call: flash-attn-4's kernels, the
        # loss's Triton step, inductor's autotuning) on a made-up batch while the data is still being read; only
        # where the compiled layers take the real batches' layouts as they are (compiles_once)
        progress.phase("startup: compiling the layers while the data is read")
        startup.mark("other")
        if not compile_beside_data(model, params, cfg.data, device):
            progress.message("startup: the made-up batch ran out of memory; step 1 compiles the layers instead")
        startup.mark("warmup")

    # -- data: tokenized once (cached), then a seeded, resumable batch stream
    progress.phase("startup: reading and tokenizing the data")
    startup.mark("other")
    if beside is not None:
        mix, eval_mix, summary = beside.result()
        startup.overlapped["data"] = beside.seconds
    for tokenizing in (True, False):  # several ranks: rank 0 fills the cache, then the others read it
        if beside is None and tokenizing == parallel.is_main:
            mix, eval_mix, summary = data if data is not None else build_data(cfg.data, tokenizer_dir,
                                                                              vocab_size=vocab_size)
        parallel.barrier()
    progress.message(summary.format())
    sampler = BatchSampler.from_config(cfg.data, mix)
    if parallel.active:  # each rank's rows of the global batches (gapless.data.sharding)
        from gapless.data.sharding import ShardedSampler
        sampler = ShardedSampler.of(sampler, parallel.rank, parallel.world_size)
    eval_batches = list(BatchSampler.for_eval(cfg.data, eval_mix).epoch_batches(0)) if eval_mix else []
    steps_total = total_steps(cfg, sampler.batches_per_epoch())
    cfg, per_epoch_note = resolve_per_epoch(cfg, sampler.batches_per_epoch())
    if per_epoch_note:  # the intervals that run, in config.yaml as the loop reads them
        progress.message(per_epoch_note)
        if parallel.is_main:
            write_run_config(run_dir, cfg)
    startup.mark("data")

    optimizer = build_optimizer(params, cfg.optim, device.type)
    masters.attach(optimizer)
    scaler = DynamicLossScaler(device) if dtype == torch.float16 else None
    scheduler = build_scheduler(optimizer, cfg.schedule, steps_total)
    checkpoints = checkpoint_manager(run_dir / "checkpoints", cfg.checkpoint, parallel, model, optimizer)
    return Run(cfg, device, timeline, progress, run_dir, tokenizer_dir, method, model, params, optimizer, scheduler,
               sampler, eval_batches, steps_total, checkpoints, peak_flops, masters, scaler, NonFinite(device),
               startup, parallel)


class DataBeside:
    """gapless.data.pipeline.build_data in a thread, started now: its tokenizing runs in worker processes (or it
    reads the token cache) while this thread goes on (setup loads the model meanwhile). result() waits and returns
    build_data's value or raises its error; `seconds` is its own wall time. Its worker processes are forked from
    this thread while the model loads; they only tokenize, never touching the parent's CUDA state or its loading
    threads' files (the import lock is held across a fork by CPython, so no import is caught halfway). A model that
    fails to load still waits for the tokenizing at exit (concurrent.futures joins its threads), which
    leaves the token cache filled for the next run."""

    def __init__(self, cfg, tokenizer_dir: Path, vocab_size: int | None):
        from concurrent.futures import ThreadPoolExecutor

        from gapless.data.pipeline import build_data

        def timed():
            start = time.perf_counter()
            try:
                return build_data(cfg, tokenizer_dir, vocab_size=vocab_size)
            finally:
                self.seconds = time.perf_counter() - start

        self.seconds = 0.0
        executor = ThreadPoolExecutor(1, thread_name_prefix="gapless-data")
        self.future = executor.submit(timed)
        executor.shutdown(wait=False)  # the one task runs on; nothing more is submitted

    def result(self):
        return self.future.result()


def compile_beside_data(model, params: list[torch.Tensor], data, device: torch.device) -> bool:
    """One forward and backward of a made-up packed batch (gapless.data.batching.made_up_packed_batch: the run's
    rows of data.max_seq_len slots) under a forked RNG, its gradients dropped, so the run's random stream and
    parameters are as without it: what compiles at step 1 compiles here instead, while the data is read. The
    compiled layers take any document layout without compiling again (symbolic sizes: gapless.train.compile).
    False where it ran out of memory (its tensors freed; step 1 compiles as it would have)."""
    from gapless.data.batching import made_up_packed_batch
    from gapless.train.step import loss_sum

    batch = made_up_packed_batch(data.tokens_per_batch // data.max_seq_len, data.max_seq_len,
                                 model.args.vocab_size).to(device)
    ran = True
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        try:
            loss_sum(model, batch).backward()
        except torch.OutOfMemoryError:
            ran = False  # freed below, outside the handler
    del batch
    drop_gradients(model, params)
    if not ran:
        free_memory(device)  # a successful run's blocks stay cached: step 1 reuses them
    return ran


def auto_tokens_per_batch(cfg: RunConfig, model, method: Method, params: list[torch.Tensor], device: torch.device,
                          run_dir: Path, progress: Progress) -> RunConfig:
    """cfg with data.tokens_per_batch "auto" replaced by the batch finder's choice (gapless.train.batch_finder),
    recorded in the run folder (batch_finder.json: every trial and the reason; config.yaml: the number). A resumed
    run reuses the recorded choice, or the number of a run started without auto (its config.yaml): the sampler's
    position is only valid for the same batches."""
    from gapless.kernels.loss import DEFAULT_CHUNK_SIZE
    from gapless.train.batch_finder import choose_tokens_per_batch

    record = run_dir / "batch_finder.json"
    saved = (read_saved_config(run_dir) or {}).get("data", {}).get("tokens_per_batch") if cfg.resume else None
    if cfg.resume and record.is_file():
        tokens = int(json.loads(record.read_text())["tokens"])
        progress.message(f"data.tokens_per_batch auto: {tokens:,}, as chosen before ({record})")
    elif isinstance(saved, int) and not isinstance(saved, bool):  # a run started with a number, resumed with auto
        tokens = saved
        progress.message(f"data.tokens_per_batch auto: {tokens:,}, as the run used ({run_dir / 'config.yaml'})")
    else:
        estimate = {"dtype": cfg.model.dtype, "lora_r": cfg.lora.r, "lora_targets": cfg.lora.target_modules,
                    "activation_checkpointing": cfg.model.activation_checkpointing,
                    "compiled": bool(cfg.model.compile), "loss_chunk": model.loss_chunk_size or DEFAULT_CHUNK_SIZE}
        choice = choose_tokens_per_batch(model, params, device, method.name, max_seq_len=cfg.data.max_seq_len,
                                         estimate=estimate, rows_per_batch=cfg.data.rows_per_batch)
        record.write_text(json.dumps(choice.to_dict(), indent=1) + "\n")
        tokens = choice.tokens
        progress.message(f"data.tokens_per_batch auto: {choice.reason}")
    cfg = replace(cfg, data=replace(cfg.data, tokens_per_batch=tokens))
    write_run_config(run_dir, cfg)  # the number that runs
    return cfg


def resume(run: Run, latest: Path | None) -> int:
    """The step after which checkpoint `latest` (train's resume_point: the newest that verifies) continues; 0 when
    the run has no checkpoint at all."""
    if latest is None:
        run.progress.message(f"resume: no checkpoint in {run.run_dir / 'checkpoints'}; starting from step 0")
        return 0
    if is_dcp(latest):  # written by a torchrun run: resharded to this one (gapless.train.dist_checkpoint)
        meta = load_sharded(latest, run.method, run.model, run.optimizer)
    else:
        tensors, meta = load(latest)
        run.method.load_checkpoint_state(run.model, tensors["model"], str(latest))
        if run.masters.active:
            run.masters.load_state_dict(tensors.get("master", {}), str(latest))
        run.optimizer.load_state_dict(tensors["optimizer"])
    if run.scaler is not None and "loss_scale" in meta:
        run.scaler.load_state_dict(meta["loss_scale"])
    run.scheduler.load_state_dict(meta["scheduler"])
    run.sampler.load_state_dict(meta["sampler"])
    restore_rng_state(meta["rng"])  # last: nothing above may draw random numbers after it
    run.progress.message(f"resume: continuing after step {meta['step']} from {latest}")
    return int(meta["step"])


def save_checkpoint(run: Run, step: int, batches: Prefetcher) -> bool:
    """Checkpoint `step`, unless the trainable weights are not finite (then say so); True when saved."""
    # SYNC: once per checkpoint (a diverged run must not replace its good checkpoints). Under torchrun each rank
    # holds its own shards and the save is collective: a rank skipping alone would hang the others, so the check
    # waits for an all-reduced flag (not built yet)
    if not run.parallel.active and not finite(run.params):
        run.progress.message(f"checkpoint step {step} not written: the trainable weights are not finite")
        return False
    with run.timeline.phase("checkpoint"):
        meta = {"step": step, "scheduler": run.scheduler.state_dict(), "sampler": batches.state,
                "rng": capture_rng_state()}
        if run.scaler is not None:
            meta["loss_scale"] = run.scaler.state_dict()  # SYNC: at checkpoint time only
        run.checkpoints.save(step, checkpoint_tensors(run), meta)
    return True


def checkpoint_tensors(run: Run) -> dict:
    """The tensor groups of a checkpoint: the method's trainable state, the optimizer's, float32 masters."""
    tensors = {"model": run.method.checkpoint_state(run.model), "optimizer": run.optimizer.state_dict()}
    if run.masters.active:
        tensors["master"] = run.masters.state_dict()
    return tensors


def checkpoint_due(run: Run, schedule: CheckpointSchedule, step: int, batches: Prefetcher, metrics) -> bool:
    """Save `step` when the schedule says so; True when saved. checkpoint.every auto re-resolves its interval from
    what its first save blocked the loop, and from a later async save's wait for the previous write
    (gapless.train.checkpoint_interval)."""
    if not schedule.due(step):
        return False
    measure = schedule.chosen is not None and not schedule.remeasured
    if measure:
        run.timeline.settle()  # SYNC: once per run, so that the time below is the save's alone
    start = time.perf_counter()
    saved = save_checkpoint(run, step, batches)
    interval = None
    if measure and saved:
        run.timeline.settle("checkpoint")  # SYNC: once per run; an async save's device-to-host copies finish
        (blocked,) = max_over_ranks(run.parallel, run.device, [time.perf_counter() - start])
        interval = schedule.remeasure(step, blocked)
    elif schedule.chosen is not None and schedule.async_write and saved:
        # the host's wait for the previous write, measured by the manager; every rank's slowest (a collective
        # beside the save's own)
        (waited,) = max_over_ranks(run.parallel, run.device, [run.checkpoints.last_stall_seconds])
        interval = schedule.waited(step, waited)
    if interval is not None:
        metrics.write(interval.record(step))
        run.progress.message(interval.message())
    return saved


def choose_checkpoint_interval(run: Run, schedule: CheckpointSchedule, step: int, step_s: float, metrics) -> None:
    """checkpoint.every auto, after the measured steps: the interval from their step time and the checkpoint's
    bytes, the same on every rank (the maximum over them), recorded and printed once."""
    step_s, nbytes = max_over_ranks(run.parallel, run.device, [step_s, tensor_bytes(checkpoint_tensors(run))])
    interval = schedule.choose(step_s, int(nbytes))
    metrics.write(interval.record(step))
    run.progress.message(interval.message())


def run_loop(run: Run, step: int, result: RunResult, metrics, stop_after: int | None,
             stop: StopSignals | None = None) -> int:
    """Optimizer steps from `step` to the end of the run (or `stop_after` steps, or a stop signal); returns the last
    step done."""
    cfg, timeline, device = run.cfg, run.timeline, run.device
    batches = Prefetcher(run.sampler, device, timeline=timeline)
    monitor = GpuMonitor(run.run_dir / run.parallel.per_rank("gpu.jsonl"), device, t0=timeline.t0,  # each rank its GPU
                         on_sample=metrics.sinks.gpu if metrics.sinks else None)
    run.progress.message(monitor.status)
    k = cfg.train.grad_accum
    window_loss = torch.zeros((), dtype=torch.float32, device=device)  # read every log_every steps
    skipped_tokens = torch.zeros((), dtype=torch.int64, device=device)  # trained tokens of skipped steps, likewise
    window = ThroughputWindow(run.peak_flops)
    frames_failed_before = frames_not_compiled()
    steps_this_run = 0
    logged_real = 0  # this rank's real tokens at the last log point (the status line's count under torchrun)
    schedule = CheckpointSchedule(cfg.checkpoint.every, cfg.checkpoint.async_write, run.steps_total)
    if schedule.pending and run.steps_total - step <= 1 + MEASURE_STEPS:
        why = (f"checkpoint.every auto: the run ends at step {run.steps_total}, before the interval is measured (the "
               f"first step and {MEASURE_STEPS} more): one checkpoint, at its end")
        metrics.write({"kind": "checkpoint_interval", "step": step, "every": None, "reason": why})
        run.progress.message(why)
    # rows per micro-batch: the batches' rows until a CUDA OOM halves it (the same step then runs again in smaller
    # pieces with the same tokens, and the rest of the run keeps the smaller pieces: gapless.train.batch_finder)
    rows = 1 << 30  # no cap until an OOM
    t_steady = steady_mark = None
    # The compiled layers' graphs without autograd (evaluation) compile when the first evaluation needs them, in its
    # "eval" time: compiled here, before step 1, they cost every run's start-up (~20 s for a 1B model on an H200,
    # uncached) for an evaluation that may come hundreds of steps later or only at the end; warm, inductor's cache
    # serves them as it serves the training graphs.
    timeline.end("startup")
    run.startup.mark("other")
    run.progress.phase("startup: first step (compiles the layers, fills the allocator)" if cfg.model.compile
                       else "startup: first step")
    try:
        while step < run.steps_total:
            with timeline.phase("data_wait"):
                micro = [batches.next() for _ in range(k)]  # already on the device
            warmup = steps_this_run == 0  # the first step compiles kernels and fills the allocator's cache
            if run.parallel.comm_clock is not None:  # DDP: which timeline phase this step's all-reduce tail is in
                run.parallel.comm_clock.phase = "startup" if warmup else "compute"
            with timeline.phase("startup" if warmup else "compute"):
                start = min(rows, max(b.input_ids.shape[0] for b in micro))
                n_step = loss_divisor(micro, run.parallel)  # several ranks: the global step's tokens / ranks
                (loss, grad_norm), ran = run_with_oom_backoff(
                    lambda r: train_step(run.model, [p for b in micro for p in split_rows(b, r)], run.params,
                                         run.optimizer, cfg.optim.grad_clip, scaler=run.scaler, zero_first=True,
                                         n_step=n_step),
                    start, device, shrink=0.5, granularity=1, minimum=1,
                    on_oom=lambda old, new: metrics.write({"kind": "oom_backoff", "step": step + 1,
                                                           "rows_per_micro_batch": [old, new]}))
                rows = min(rows, ran)
                lr = run.scheduler.get_last_lr()[0]
                run.scheduler.step()
            bad = ~torch.isfinite(grad_norm) if run.scaler is not None else run.nonfinite.add(grad_norm)
            window_loss += torch.where(bad, 0.0, loss)  # bad: no update was applied (train/guard.py, loss_scale.py)
            skipped_tokens += bad * sum(b.num_target_tokens for b in micro)
            step += 1
            steps_this_run += 1
            real = sum(b.num_real_tokens for b in micro)
            window.add(real, sum(b.num_target_tokens for b in micro), sum(b.num_slots for b in micro),
                       sum(step_flops(run.model.args, b.doc_lengths, **run.method.flops) for b in micro), warmup)
            result.real_tokens += real
            # host ints: the line moves every step, no sync; under torchrun every rank's tokens to the last log point
            # (exact there) and this rank's since
            run.progress.advance(step, result.real_tokens + (result.global_real_tokens or 0) - logged_real)
            if warmup:
                timeline.settle("startup")  # SYNC: once per run; the GPU finishing the warm-up step is startup
                failed = frames_not_compiled() - frames_failed_before
                if cfg.model.compile and failed:  # the first step's graphs are all compiled
                    warnings.warn(not_compiled_message(failed), stacklevel=1)
                    metrics.write({"kind": "compile", "step": step, "frames_not_compiled": failed,
                                   "message": not_compiled_message(failed)})
                t_steady = time.perf_counter()
                steady_mark = timeline.summary()
                result.first_step_s = steady_mark["wall"]
                run.startup.mark("first_step")
                metrics.write(startup_record(run, step, result.first_step_s))
                run.progress.message(f"step {step} done {result.first_step_s:.1f} s after the start (start-up: "
                                     "imports, data, model, compile, the first step)")
                window.warmup_done(steady_mark["compute"])
            else:
                result.steady_tokens += real

            # a stop signal: the steps since the last log are logged before the run ends (else metrics.jsonl, and the
            # report, would miss them while the last record counts their tokens). One process stops after this step.
            # Several see a signal up to a step apart, and a rank stopping alone would leave the others waiting in a
            # collective: they stop together at the next log point, whose gather carries each rank's flag (aggregate)
            signalled = stop is not None and stop.requested is not None
            stopping = signalled and not run.parallel.active
            if step % cfg.train.log_every == 0 or step == run.steps_total or stopping:
                timeline.settle()  # SYNC: waits for the queued steps (compute), so the .item() below is logging
                timeline.begin("logging")
                # SYNC: once per log_every steps (these reads and NonFinite's)
                nonfinite, consecutive = run.nonfinite.read()
                trained_ok = window.trained - int(skipped_tokens.item())
                loss_mean = window_loss.item() / trained_ok if trained_ok else math.nan  # over the applied steps
                record = {"step": step, "loss": loss_mean, "lr": lr, "grad_norm": grad_norm.item(),
                          **window.record(timeline.summary()["compute"]),
                          "elapsed_s": time.perf_counter() - timeline.t0}
                if run.scaler is None:
                    record["nonfinite_steps"] = nonfinite
                if run.scaler is not None:  # SYNC: read with the loss, once per log_every steps
                    record |= {"loss_scale": run.scaler.scale.item(), "skipped_steps": int(run.scaler.skipped.item())}
                # several ranks: the loss over all of them, each rank's tokens and times (gapless.train.parallel)
                # and the communication: exposed, overlapped, waiting for ranks (moved to the timeline's category)
                record.update(aggregate(run.parallel, device, window_loss, window.trained, window.real,
                                        timeline.summary()["compute"] - window.compute_mark, window.t_window,
                                        window.steps, timeline, signalled))
                if run.parallel.active:
                    stopping = record["ranks_stopping"] > 0
                    result.global_real_tokens = (result.global_real_tokens or 0) + record["global_real_tokens"]
                    logged_real = result.real_tokens
                    run.progress.advance(step, result.global_real_tokens)  # the count, exact at the log point
                metrics.write(record)
                result.losses[step] = loss_mean = record["loss"]
                # the console's tokens/s: every rank's under torchrun (the record's tokens_per_s is rank 0's)
                run.progress.update(step, loss_mean, record.get("global_tokens_per_s", record["tokens_per_s"]), lr,
                                    record["mfu"])
                window_loss.zero_()
                skipped_tokens.zero_()
                metrics.write(timeline.record(step))
                timeline.end("logging")
                window.start(timeline.summary()["compute"])
                if nonfinite:
                    run.progress.message(f"step {step}: {nonfinite} of the last steps had a loss or gradient that is "
                                         "not finite; no update was applied for them")
                if consecutive >= run.nonfinite.limit:
                    first = step - consecutive + 1
                    message = (f"the loss or gradients were not finite for {consecutive} steps in a row, from step "
                               f"{first} to {step}: the run stops (no update was applied for them). Lower optim.lr, "
                               "check the base weights and the data, then resume from the last checkpoint")
                    run.progress.message(message)
                    metrics.write({"kind": "stopped", "step": step, "reason": "nonfinite",
                                   "first_bad_step": first, "message": message})
                    result.stopped = "nonfinite"
                    break

            saved = checkpoint_due(run, schedule, step, batches, metrics)
            if schedule.pending and steps_this_run == 1 + MEASURE_STEPS and step < run.steps_total:
                # checkpoint.every auto: the steps after the warm-up one, timed; saves from the next step on
                timeline.settle()  # SYNC: once per run; the measured steps finish on the GPU
                now = timeline.summary()
                busy = [now[c] - steady_mark[c] for c in ("wall", "eval", "checkpoint")]
                choose_checkpoint_interval(run, schedule, step, (busy[0] - busy[1] - busy[2]) / MEASURE_STEPS,
                                           metrics)

            if run.eval_batches and cfg.train.eval_every and step % cfg.train.eval_every == 0 \
                    and step < run.steps_total:
                timeline.settle()  # SYNC: queued training steps are compute, not evaluation
                with timeline.phase("eval"):
                    ev = evaluate(run.model, run.eval_batches, device)
                metrics.write({"step": step, **ev, "elapsed_s": time.perf_counter() - timeline.t0})
                run.progress.message(f"step {step}: eval loss {ev['eval_loss']:.4f}")

            if not run.parallel.active:  # one process: also a signal during this step's logging, eval or checkpoint
                stopping = stop is not None and stop.requested is not None
            # after the last step the run is complete: it finishes (final evaluation, adapter or model) instead
            if stopping and step < run.steps_total:
                # preemption or Ctrl-C: this step's checkpoint, on disk before the run ends (bounded: one step and
                # one checkpoint write)
                if not saved:
                    saved = save_checkpoint(run, step, batches)
                with timeline.phase("checkpoint"):
                    run.checkpoints.wait()
                where = f"checkpoint step {step} written" if saved else "no checkpoint written"
                reason = stop.requested or "a signal to another rank"
                run.progress.message(f"{reason}: stopped after step {step}, {where}; continue with --resume")
                metrics.write({"kind": "stopped", "step": step, "reason": reason, "checkpoint": saved})
                result.stopped = reason
                break

            if stop_after is not None and steps_this_run >= stop_after:
                break
    finally:
        result.nonfinite_steps = run.nonfinite.total
        batches.close()
        with timeline.phase("checkpoint"):
            run.checkpoints.close()  # the last write in flight
        monitor.close()
        run.progress.close()
    timeline.settle()  # SYNC: the loop's last steps finish on the GPU before the steady window ends
    if t_steady is not None:
        result.steady_s = time.perf_counter() - t_steady
        now = timeline.summary()
        result.steady_seconds = {c: now[c] - steady_mark[c] for c in CATEGORIES}
    return step


def finish(run: Run, step: int, result: RunResult, metrics, stop: StopSignals | None = None) -> None:
    """At the end of the run: the final evaluation and the method's final save. Then, whether the run ended or
    stopped early, the report and the last record, which covers every second of the call. A stop signal in the last
    step or here is noted, not raised: the final output is written (a bounded wait), and one process skips a final
    evaluation not yet begun."""
    timeline, progress = run.timeline, run.progress
    if step == run.steps_total and result.stopped is None:
        # (one process only: under torchrun every rank evaluates, as FSDP2's forward is collective)
        if run.eval_batches and stop is not None and stop.requested is not None and not run.parallel.active:
            progress.message(f"{stop.requested}: every step ran; final evaluation skipped, "
                             f"writing the {run.method.final_name}")
        elif run.eval_batches:
            timeline.settle()
            with timeline.phase("eval"):
                ev = evaluate(run.model, run.eval_batches, run.device)
            metrics.write({"step": step, **ev, "elapsed_s": time.perf_counter() - timeline.t0})
            progress.message(f"final eval loss {ev['eval_loss']:.4f}")
        from gapless.model.export import copy_tokenizer_files

        final = run.run_dir / run.method.final_name
        # SYNC: once per run; under torchrun left out, as in save_checkpoint (the final save gathers collectively)
        if not run.parallel.active and not finite(run.params):
            result.stopped = "nonfinite"
            progress.message(f"{run.method.final_name} not written: the trainable weights are not finite")
        else:
            try:
                with timeline.phase("checkpoint"), full_parameters(run.model, run.parallel) as whole:  # FSDP2: gathered
                    if run.parallel.is_main:
                        run.method.save_final(whole, final, Path(run.cfg.model.path))  # atomic: all or nothing
                        copy_tokenizer_files(run.tokenizer_dir, final)
                result.final_dir = final
                progress.message(f"{run.method.final_name} written to {final}")
            except OSError as e:  # a full disk: one message, and where the trained weights still are
                result.stopped = "final_write"
                latest = sorted((run.run_dir / "checkpoints").glob("step-*"))
                progress.message(f"{run.method.final_name} not written to {final}: {e.strerror or e}; " + (
                    f"the trained weights are in {latest[-1]}: free space, then `gapless export {latest[-1]} "
                    "--out DIR`" if latest else "no checkpoint holds the trained weights"
                    + (" (checkpoint.every is 0)" if run.cfg.checkpoint.every == 0 else "")))
    # The last record of metrics.jsonl is the run's: it is written once, and the console and the report print
    # its numbers (the report was written from one record and the console printed a later one: 20,464 vs 20,258
    # tok/s, 1.4 s apart). The report's plots, its slow part, are drawn before it, inside the run's clock; the
    # page around them is written after it in milliseconds.
    plots = None
    if run.parallel.is_main:
        with timeline.phase("logging"):
            metrics.write(environment_record(run.device, step))  # the session's device, by name
            plots = plots_of(read_run(run.run_dir))
    final_record = _run_record(timeline.record(step, final=True), result)
    metrics.write(final_record)
    result.wall_s, result.seconds = final_record["wall_s"], final_record["seconds"]
    result.tokens_per_s = final_record["tokens_per_s"]
    progress.message(f"time: {format_summary({**final_record['seconds'], 'wall': final_record['wall_s']})}")
    wall = final_record["wall_s"]
    if result.global_real_tokens is None:
        progress.message(f"throughput: {result.real_tokens:,} real tokens in {wall:.1f} s = "
                         f"{result.tokens_per_s:,.0f} real tokens/s over the whole run")
    else:
        progress.message(f"throughput: {result.global_real_tokens:,} real tokens on {run.parallel.world_size} "
                         f"processes in {wall:.1f} s = {final_record['global_tokens_per_s']:,.0f} real tokens/s over "
                         f"the whole run (this rank's {result.real_tokens:,}: {result.tokens_per_s:,.0f}/s)")
    if run.parallel.is_main:
        progress.message(f"report: {write_report(run.run_dir, plots=plots)}")


def train(cfg: RunConfig, *, stop_after: int | None = None, out=None, data=None,
          started: float | None = None, overwrite: bool = True) -> RunResult:
    """Run `cfg` to its end (or until `stop_after` optimizer steps are done: a simulated crash, or the
    short measured window of `gapless gap`).

    `out` receives the human-readable summary lines (stderr by default). `data`: (mix, eval_mix, summary)
    prepared by the caller instead of reading cfg.data's sources (`gapless gap`'s synthetic full rows);
    batching still follows cfg.data. `started`: the time.perf_counter reading the run's clock starts from
    (`gapless train`: the process start, gapless.meter.timeline.process_start); default now. `overwrite`: replace a
    run the output folder holds (`gapless train` passes its --overwrite; a finished run is refused without it).
    """
    device = resolve_device(cfg.model.device)
    parallel, device = init_distributed(cfg.parallel, device, cfg.method)  # torchrun's ranks (gapless.train.parallel)
    cfg, auto_note = resolve_auto(cfg, device)  # config.yaml records what runs
    cfg, kernel_note = resolve_lora_kernel(cfg, parallel.strategy)
    # every second from `started` on goes to one category (gapless.meter.timeline)
    timeline = Timeline(device, t0=started)
    timeline.begin("startup")
    progress = Progress(0, stream=out, enabled=cfg.progress and parallel.is_main,  # rank 0 alone speaks
                        t0=timeline.t0)  # "elapsed" on the run's clock, imports included
    with progress.route_warnings():  # one formatted line per distinct warning, above the live status line
        try:
            for note in (auto_note, kernel_note):
                if note:
                    progress.message(note)
            cfg.check_output_dir()
            require_sinks(cfg.train.report_to)  # a missing tensorboard/wandb package: said now, not after the model
            run_dir = Path(cfg.output_dir)
            # one run per folder (rank 0 holds the lock; the kernel releases it however this process ends)
            with RunLock(run_dir) if parallel.is_main else contextlib.nullcontext():
                if parallel.is_main:
                    prepare_run_dir(run_dir, resume=cfg.resume, overwrite=overwrite)
                parallel.barrier()
                changed, latest = {}, None
                if cfg.resume:  # checked before anything is written or built
                    saved = read_saved_config(run_dir)
                    changed = check_resume(saved, to_dict(cfg)) if saved is not None else {}
                    latest = resume_point(run_dir / "checkpoints")  # raises when checkpoints exist and none verifies
                run = setup(cfg, device, timeline, progress, data, parallel)
                step = resume(run, latest) if cfg.resume else 0
                result = RunResult(run_dir=run.run_dir, steps=run.steps_total)
                progress.total = run.steps_total
                metrics = Metrics(open_metrics(run.run_dir / "metrics.jsonl", step) if parallel.is_main
                                  else open(os.devnull, "w"))
                try:
                    if parallel.is_main:  # rank 0 alone reports, as it alone writes metrics.jsonl
                        metrics.sinks = open_sinks(cfg.train.report_to, run.run_dir, cfg.train.wandb, to_dict(run.cfg))
                    if changed:
                        metrics.write({"kind": "resume", "step": step,
                                       "changed": {k: list(v) for k, v in changed.items()}})
                    with StopSignals() as stop:  # held through finish: a signal there ends it without losing the output
                        step = run_loop(run, step, result, metrics, stop_after, stop)
                        finish(run, step, result, metrics, stop)
                except BaseException:
                    metrics.close(failed=True)
                    raise
                else:
                    metrics.close()
                finally:
                    parallel.close()  # torchrun: the process group (a rank that fails exits, and torchrun ends the others)
        finally:
            progress.close()
    return result


def startup_record(run: Run, step: int, first_step_s: float) -> dict:
    """{"kind": "startup"}: the seconds from the run's clock start to the end of its first step, by part
    (StartupParts; with the seconds that ran beside them, "overlapped"), of which torch.compile's (its cache hits
    and misses, compile.cache_counts, and its longest phases, compile.compile_phases); and the peak memory so far
    (the GPU's allocated bytes, the host's resident set), in GiB."""
    import resource

    cuda = run.device.type == "cuda"
    parts = {k: round(v, 4) for k, v in run.startup.seconds.items()}
    return {"kind": "startup", "step": step, "first_step_s": first_step_s, "seconds": parts,
            "overlapped": {k: round(v, 4) for k, v in run.startup.overlapped.items()},
            "compile_s": round(compile_seconds(), 4), "compile_caches": cache_counts(),
            "compile_phases": compile_phases(),
            "peak_gib": torch.cuda.max_memory_allocated(run.device) / 2**30 if cuda else None,
            "host_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}  # ru_maxrss: KiB on Linux


def environment_record(device: torch.device, step: int) -> dict:
    """What ran the session: the device by name (not `auto`) and the software versions (`gapless report A B`
    lists the differences between runs)."""
    import platform
    import socket

    from gapless import __version__

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu")
    return {"kind": "environment", "step": step, "device": str(device), "device_name": name,
            "device_count": torch.cuda.device_count() if device.type == "cuda" else 1,
            "gapless": __version__, "torch": torch.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _run_record(time_record: dict, result: RunResult) -> dict:
    """The final time record plus the run's totals: real tokens over the wall time of the whole call."""
    wall = max(time_record["wall_s"], 1e-9)
    record = {**time_record, "real_tokens": result.real_tokens, "tokens_per_s": result.real_tokens / wall,
              "first_step_s": result.first_step_s}
    if result.global_real_tokens is not None:  # under torchrun: every rank's, over this rank's wall time
        record |= {"global_real_tokens": result.global_real_tokens,
                   "global_tokens_per_s": result.global_real_tokens / wall}
    return record
