"""The one training loop. LoRA, QLoRA and full fine-tuning differ only in the model transform and in
which parameters are trainable; everything else below is shared and reads top to bottom.

The loss of an optimizer step is the mean over ALL trained tokens of its k micro-batches:
    loss = sum_{micro} sum_{t trained} CE_t / N_step,   N_step = trained tokens of the whole step
Each micro-batch contributes `loss_sum / N_step` to the gradient, so k micro-batches of ragged
lengths give exactly the gradient of one batch holding the same tokens (not a mean of means).
N_step is a host integer the data pipeline counted while building the batches: no device sync.

Host syncs: the hot path has none. Loss sums and grad norms stay on the device and are read
once per `train.log_every` steps (marked SYNC below).

Tokens are counted three ways, all host integers from the data pipeline (never a device read):
real tokens (documents' tokens, never padding), trained tokens (loss-bearing) and slot tokens (B * T
of every batch, padding included). Throughput is always real tokens: per logged window over its wall
time (`tokens_per_s`) and over its compute time (`compute_tokens_per_s`), and for the whole run in the
last record (the final time record: real tokens / wall time from the start of `train` to its end). A
window's rates leave out the run's first step (it compiles; startup), except in a window of that step alone.
MFU per window: gapless.meter.flops.step_flops over the real document lengths / window wall time /
the dense matmul peak measured at startup on this device in the model's dtype (formula in flops.py).
"""
from __future__ import annotations

import json
import math
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import yaml

from gapless.config import RunConfig, to_dict
from gapless.data.batching import Batch
from gapless.kernels.loss import DEFAULT_CHUNK_SIZE, linear_cross_entropy
from gapless.meter.flops import measure_peak_flops, step_flops
from gapless.meter.monitor import GpuMonitor
from gapless.meter.report import write_report
from gapless.meter.timeline import CATEGORIES, Timeline, format_summary
from gapless.train.ckpt_activations import checkpoint_activations
from gapless.train.compile import compile_layers, frames_not_compiled, not_compiled_message
from gapless.train.checkpoint import CheckpointManager, capture_rng_state, latest_complete, load, restore_rng_state
from gapless.train.optim import build_optimizer, build_scheduler, clip_grad_norm
from gapless.train.prefetch import Prefetcher
from gapless.train.progress import Progress


def batch_loss_sum(model, batch: Batch, compiled: bool = False,
                   chunk_size: int = DEFAULT_CHUNK_SIZE) -> torch.Tensor:
    """Sum of the cross-entropy over the batch's trained tokens; full logits never exist.
    `compiled`: the loss's per-chunk softmax/gradient step through torch.compile (GPU fast path);
    `chunk_size`: tokens per chunk of the loss (its transient memory: gapless.kernels.loss)."""
    hidden = model.hidden_states(batch.input_ids, batch.position_ids, batch.cu_seqlens,
                                 batch.attention_mask, batch.max_seqlen)  # [B, T, D]
    return linear_cross_entropy(hidden.flatten(0, 1), model.lm_head.weight, batch.targets.flatten(),
                                chunk_size=chunk_size, compiled=compiled)


def resolve_device(name: str, setting: str = "model.device") -> torch.device:
    """`auto` is CUDA when available; `setting` names where the user chose it, for the error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{setting}: {name!r} asked for, but CUDA is not available here; use 'cpu' or 'auto'")
    return device


def resolve_auto(cfg: RunConfig, device: torch.device) -> tuple[RunConfig, str | None]:
    """cfg with model.attn_backend and model.compile "auto" replaced by what runs on `device`, and a line saying
    what was chosen (None when nothing was "auto")."""
    from gapless.kernels.attention import auto_backend
    from gapless.model.loading import DTYPES

    m = cfg.model
    if m.attn_backend != "auto" and m.compile != "auto":
        return cfg, None
    attn = m.attn_backend if m.attn_backend != "auto" else auto_backend(device, DTYPES[m.dtype],
                                                                        cfg.data.batching == "packed")
    compile_ = m.compile if m.compile != "auto" else device.type == "cuda"
    cfg = replace(cfg, model=replace(m, attn_backend=attn, compile=compile_))
    chosen = [f"{key} {value}" for key, value, given in (("attn_backend", attn, m.attn_backend),
                                                        ("compile", str(compile_).lower(), m.compile))
              if given == "auto"]
    return cfg, f"model: {', '.join(chosen)} (auto on {device.type}, {m.dtype}, {cfg.data.batching} rows)"


@torch.no_grad()
def evaluate(model, batches: list[Batch], device: torch.device) -> dict:
    """Mean loss over all trained tokens of the eval batches (one sync at the end)."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float32, device=device)
    tokens = 0
    for b in batches:
        total += batch_loss_sum(model, b.to(device))
        tokens += b.num_target_tokens
    model.train(was_training)
    return {"eval_loss": total.item() / max(tokens, 1), "eval_tokens": tokens}  # SYNC: once per eval


@dataclass
class RunResult:
    run_dir: Path
    steps: int
    losses: dict[int, float] = field(default_factory=dict)  # step -> mean loss of that logged step
    final_dir: Path | None = None
    real_tokens: int = 0  # of every step this call ran
    wall_s: float = 0.0  # from the start of `train` to its end, the report included
    tokens_per_s: float = 0.0  # real_tokens / wall_s
    # the steady part: the steps after the warm-up step (which compiles), from its end to the end of the loop
    # (the GPU settled, the last checkpoint write waited for); what `gapless gap` compares
    steady_tokens: int = 0
    steady_s: float = 0.0
    steady_seconds: dict[str, float] = field(default_factory=dict)  # the timeline's categories in steady_s
    seconds: dict[str, float] = field(default_factory=dict)  # the timeline's categories at the end

    @property
    def steady_tokens_per_s(self) -> float:
        return self.steady_tokens / self.steady_s if self.steady_s > 0 else 0.0


def apply_method(model, cfg: RunConfig):
    """The fine-tuning method as a model transform; the loop below never branches on it."""
    from gapless.model.lora import apply_lora

    assert cfg.method == "lora", cfg.method
    if cfg.lora.dropout > 0 and cfg.lora.kernel != "reference":
        # each layer draws its own dropout mask on its input in training (as PEFT's do), which the grouped and
        # fused kernels cannot share: those layers train on the per-layer formula (gapless.model.lora)
        warnings.warn(f"lora.kernel={cfg.lora.kernel!r} applies in evaluation only: with lora.dropout="
                      f"{cfg.lora.dropout:g} training runs the per-layer formula ('reference'); set lora.dropout "
                      f"to 0 to train with {cfg.lora.kernel!r}", stacklevel=2)
    return apply_lora(model, cfg.lora)


def trainable_state(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def total_steps(cfg: RunConfig, batches_per_epoch: int) -> int:
    if cfg.train.steps:
        return cfg.train.steps
    steps = math.ceil(cfg.train.epochs * batches_per_epoch / cfg.train.grad_accum)
    if steps < 1:
        raise ValueError(f"train.epochs: {cfg.train.epochs} epochs of {batches_per_epoch} batches with "
                         f"grad_accum {cfg.train.grad_accum} is less than one optimizer step")
    return steps


def write_metrics(f, record: dict) -> None:
    f.write(json.dumps(record) + "\n")
    f.flush()


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


def train(cfg: RunConfig, *, stop_after: int | None = None, out=None, data=None) -> RunResult:
    """Run `cfg` to its end (or until `stop_after` optimizer steps are done: a simulated crash, or the
    short measured window of `gapless gap`).

    `out` receives the human-readable summary lines (stderr by default). `data`: (mix, eval_mix, summary)
    prepared by the caller instead of reading cfg.data's sources (`gapless gap`'s synthetic full rows);
    batching still follows cfg.data.
    """
    from gapless.data.batching import BatchSampler
    from gapless.data.tokenize import build_data
    from gapless.model.export import copy_tokenizer_files
    from gapless.model.loading import load_model
    from gapless.model.lora import save_adapter

    device = resolve_device(cfg.model.device)
    cfg, auto_note = resolve_auto(cfg, device)  # config.yaml below records what runs
    timeline = Timeline(device)  # every second from here on goes to one category (gapless.meter.timeline)
    timeline.begin("startup")
    t_start = timeline.t0
    run_dir = Path(cfg.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    torch.manual_seed(cfg.train.seed)
    progress = Progress(0, stream=out, enabled=cfg.progress)
    if auto_note:
        progress.message(auto_note)

    # -- data: tokenized once (cached), then a seeded, resumable batch stream
    tokenizer_dir = Path(cfg.data.tokenizer or cfg.model.path)
    mix, eval_mix, summary = data if data is not None else build_data(cfg.data, tokenizer_dir)
    progress.message(summary.format())
    sampler = BatchSampler.from_config(cfg.data, mix)
    eval_batches = list(BatchSampler.from_config(cfg.data, eval_mix, shuffle=False).epoch_batches(0)) if eval_mix else []
    steps_total = total_steps(cfg, sampler.batches_per_epoch())

    # -- model: the plain checkpoint model, then the method's transform
    model = load_model(cfg.model.path, dtype=cfg.model.dtype, device=device, attn_backend=cfg.model.attn_backend)
    model = apply_method(model, cfg)
    if cfg.model.activation_checkpointing:
        model = checkpoint_activations(model, every=cfg.model.activation_checkpointing)
    if cfg.model.compile:
        model = compile_layers(model)
    frames_failed_before = frames_not_compiled()
    model.train()
    dtype = next(model.parameters()).dtype
    peak_flops = measure_peak_flops(device, dtype)  # MFU's denominator, measured here (~0.2 s)
    params = list(trainable_state(model).values())
    optimizer = build_optimizer(params, cfg.optim, device.type)
    scheduler = build_scheduler(optimizer, cfg.schedule, steps_total)
    ckpt_root = run_dir / "checkpoints"
    checkpoints = CheckpointManager(ckpt_root, keep=cfg.checkpoint.keep, async_write=cfg.checkpoint.async_write)

    step = 0
    if cfg.resume:
        latest = latest_complete(ckpt_root)
        if latest is None:
            progress.message(f"resume: no complete checkpoint in {ckpt_root}; starting from step 0")
        else:
            tensors, meta = load(latest)
            missing = set(trainable_state(model)) - set(tensors["model"])
            if missing:
                raise ValueError(f"{latest}: the checkpoint lacks trainable tensors {sorted(missing)[:5]}; "
                                 "was it written by a run with other method/lora settings?")
            with torch.no_grad():
                for name, p in trainable_state(model).items():
                    p.copy_(tensors["model"][name])
            optimizer.load_state_dict(tensors["optimizer"])
            scheduler.load_state_dict(meta["scheduler"])
            sampler.load_state_dict(meta["sampler"])
            restore_rng_state(meta["rng"])  # last: nothing above may draw random numbers after it
            step = int(meta["step"])
            progress.message(f"resume: continuing after step {step} from {latest}")

    result = RunResult(run_dir=run_dir, steps=steps_total)
    progress.total = steps_total
    metrics = open_metrics(run_dir / "metrics.jsonl", step)
    batches = Prefetcher(sampler, device, timeline=timeline)
    monitor = GpuMonitor(run_dir / "gpu.jsonl", device, t0=timeline.t0)
    progress.message(monitor.status)
    k = cfg.train.grad_accum
    # device-side accumulators, read every log_every steps (the loop's only host sync)
    window_loss = torch.zeros((), dtype=torch.float32, device=device)
    window_tokens = window_real = window_slots = 0
    window_flops = 0.0
    # throughput counts the window's steps after the warm-up step (which compiles) over their time; a window
    # holding only the warm-up step reports that step over its own time, compile included
    timed_real, timed_flops = 0, 0.0
    t_window = t_timed = time.perf_counter()
    compute_mark = 0.0  # the timeline's compute seconds at the start of the window
    steps_this_run = 0
    t_steady = None
    if eval_batches and cfg.model.compile:
        # the compiled layers need other graphs without autograd: compile them now, in startup, rather than
        # stall the first evaluation mid-run (~20 s for a 1B model on an H200)
        evaluate(model, eval_batches[:1], device)
    timeline.end("startup")
    try:
        while step < steps_total:
            with timeline.phase("data_wait"):
                micro = [batches.next() for _ in range(k)]  # already on the device
            n_step = sum(b.num_target_tokens for b in micro)  # host ints counted by the data pipeline
            warmup = steps_this_run == 0  # the first step compiles kernels and fills the allocator's cache
            with timeline.phase("startup" if warmup else "compute"):
                for b in micro:
                    loss_sum = batch_loss_sum(model, b, compiled=cfg.model.compile)
                    (loss_sum / max(n_step, 1)).backward()
                    window_loss += loss_sum.detach()
                grad_norm = clip_grad_norm(params, cfg.optim.grad_clip)
                lr = scheduler.get_last_lr()[0]
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            step += 1
            steps_this_run += 1
            real = sum(b.num_real_tokens for b in micro)
            flops = sum(step_flops(model.args, b.doc_lengths, cfg.method, cfg.lora.r, cfg.lora.target_modules)
                        for b in micro)
            window_tokens += n_step
            window_real += real
            window_slots += sum(b.num_slots for b in micro)
            window_flops += flops
            result.real_tokens += real
            if warmup:
                timeline.settle("startup")  # SYNC: once per run; the GPU finishing the warm-up step is startup
                failed = frames_not_compiled() - frames_failed_before
                if cfg.model.compile and failed:  # the startup eval graphs and the first step's are all compiled
                    warnings.warn(not_compiled_message(failed), stacklevel=1)
                    write_metrics(metrics, {"kind": "compile", "step": step, "frames_not_compiled": failed,
                                            "message": not_compiled_message(failed)})
                t_steady = t_timed = time.perf_counter()
                steady_mark = timeline.summary()
                compute_mark = steady_mark["compute"]
            else:
                result.steady_tokens += real
                timed_real += real
                timed_flops += flops

            if step % cfg.train.log_every == 0 or step == steps_total:
                timeline.settle()  # SYNC: waits for the queued steps (compute), so the .item() below is logging
                timeline.begin("logging")
                loss = window_loss.item() / max(window_tokens, 1)  # SYNC: once per log_every steps
                now = time.perf_counter()
                if timed_real:
                    tokens, flops, seconds = timed_real, timed_flops, max(now - t_timed, 1e-9)
                else:  # the warm-up step alone
                    tokens, flops, seconds = window_real, window_flops, max(now - t_window, 1e-9)
                compute_s = timeline.summary()["compute"] - compute_mark
                tok_s = tokens / seconds
                record = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm.item(),
                          "real_tokens": window_real, "trained_tokens": window_tokens, "slot_tokens": window_slots,
                          "padding_fraction": 1 - window_real / max(window_slots, 1), "tokens_per_s": tok_s,
                          "compute_tokens_per_s": timed_real / compute_s if timed_real and compute_s > 0 else None,
                          "mfu": flops / seconds / peak_flops, "tflops": flops / seconds / 1e12,
                          "peak_tflops": peak_flops / 1e12, "elapsed_s": now - t_start}
                write_metrics(metrics, record)
                result.losses[step] = loss
                progress.update(step, loss, tok_s, lr, record["mfu"])
                window_loss.zero_()
                window_tokens = window_real = window_slots = timed_real = 0
                window_flops = timed_flops = 0.0
                write_metrics(metrics, timeline.record(step))
                timeline.end("logging")
                t_window = t_timed = time.perf_counter()
                compute_mark = timeline.summary()["compute"]

            if cfg.checkpoint.every and (step % cfg.checkpoint.every == 0 or step == steps_total):
                with timeline.phase("checkpoint"):
                    checkpoints.save(step, {"model": trainable_state(model), "optimizer": optimizer.state_dict()},
                                     {"step": step, "scheduler": scheduler.state_dict(), "sampler": batches.state,
                                      "rng": capture_rng_state()})

            if eval_batches and cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < steps_total:
                timeline.settle()  # SYNC: queued training steps are compute, not evaluation
                with timeline.phase("eval"):
                    ev = evaluate(model, eval_batches, device)
                write_metrics(metrics, {"step": step, **ev, "elapsed_s": time.perf_counter() - t_start})
                progress.message(f"step {step}: eval loss {ev['eval_loss']:.4f}")

            if stop_after is not None and steps_this_run >= stop_after:
                break
    finally:
        batches.close()
        with timeline.phase("checkpoint"):
            checkpoints.close()  # the last write in flight
        monitor.close()
        progress.close()
    timeline.settle()  # SYNC: the loop's last steps finish on the GPU before the steady window ends
    if t_steady is not None:
        result.steady_s = time.perf_counter() - t_steady
        now = timeline.summary()
        result.steady_seconds = {c: now[c] - steady_mark[c] for c in CATEGORIES}

    if step == steps_total:
        if eval_batches:
            timeline.settle()
            with timeline.phase("eval"):
                ev = evaluate(model, eval_batches, device)
            write_metrics(metrics, {"step": step, **ev, "elapsed_s": time.perf_counter() - t_start})
            progress.message(f"final eval loss {ev['eval_loss']:.4f}")
        final = run_dir / "adapter"
        with timeline.phase("checkpoint"):
            save_adapter(model, final, cfg.lora, base_model_name_or_path=str(Path(cfg.model.path).resolve()))
            copy_tokenizer_files(tokenizer_dir, final)
        result.final_dir = final
        progress.message(f"adapter written to {final}")
    # the report is part of the run: it is written inside the timeline, from metrics.jsonl plus the final
    # record that is written after it (so that record, the last line, covers every second of the call)
    with timeline.phase("logging"):
        report = write_report(run_dir, pending=[_run_record(timeline.record(step, final=True), result)])
    final = _run_record(timeline.record(step, final=True), result)
    write_metrics(metrics, final)
    metrics.close()
    result.wall_s, result.seconds = final["wall_s"], final["seconds"]
    result.tokens_per_s = final["tokens_per_s"]
    progress.message(f"time: {format_summary({**final['seconds'], 'wall': final['wall_s']})}")
    progress.message(f"throughput: {result.real_tokens:,} real tokens in {final['wall_s']:.1f} s = "
                     f"{result.tokens_per_s:,.0f} real tokens/s over the whole run; report: {report}")
    return result


def _run_record(time_record: dict, result: RunResult) -> dict:
    """The final time record plus the run's totals: real tokens over the wall time of the whole call."""
    return {**time_record, "real_tokens": result.real_tokens,
            "tokens_per_s": result.real_tokens / max(time_record["wall_s"], 1e-9)}
