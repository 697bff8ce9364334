"""The token budget per micro-batch, found instead of guessed, and a CUDA OOM survived instead of fatal.

`find_token_budget` does what users do by hand ("start at 1, grow until about 90% of GPU memory, then back off
10%") without the crashes: the memory model (gapless.meter.memory.max_tokens) proposes the budget whose
predicted peak is `fraction` (0.9) of the free memory; real trial steps then check it: from a measured peak the
next trial aims at that line along the model's bytes per token, and without one (an OOM, or no model) it grows
by `growth` (x1.25) until a trial goes over the line or runs out of memory, then bisects; the
largest good budget, less `backoff` (10%: room for the longest batches, fragmentation over a long run and the
evaluation's graphs), rounded down to `granularity`, is the choice. Every trial and the reason are kept
(BatchChoice) for the run folder and the report.

`run_with_oom_backoff` runs one step; on torch.OutOfMemoryError it frees what the failed attempt held, shrinks the
micro-batch by `shrink` and runs the same step again, so the run continues from that step. The step function must
start from zero gradients each call (the loop keeps the step's tokens, so with grad_accum the same global tokens
per step split into more, smaller micro-batches: the step's loss and gradient are unchanged).
"""
from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from gapless.data.batching import IGNORE, Batch
from gapless.kernels.attention import MAX_VARLEN_DOCUMENTS
from gapless.meter.memory import GIB, estimate_memory, max_tokens

T = TypeVar("T")


@dataclass
class BatchChoice:
    tokens: int  # the chosen tokens per micro-batch
    predicted: int  # what the memory model proposed
    limit_bytes: float  # fraction x free memory: the line a trial's peak must stay under
    trials: list[tuple[int, float | None]] = field(default_factory=list)  # (tokens, measured peak bytes or None: OOM)
    reason: str = ""

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "predicted": self.predicted, "limit_gib": self.limit_bytes / 2 ** 30,
                "trials": [{"tokens": t, "peak_gib": None if p is None else p / 2 ** 30} for t, p in self.trials],
                "reason": self.reason}


def _round_down(tokens: float, granularity: int) -> int:
    return int(tokens // granularity) * granularity


def find_token_budget(predicted: int, try_step: Callable[[int], float | None], free_bytes: float, *,
                      fraction: float = 0.9, backoff: float = 0.1, growth: float = 1.25, granularity: int = 256,
                      minimum: int = 256, maximum: int | None = None, max_trials: int = 8,
                      per_token_bytes: float | None = None) -> BatchChoice:
    """The tokens per micro-batch to train with (module docstring).

    predicted: the memory model's budget for fraction x free_bytes; try_step(tokens): the peak bytes of a real
    step with that many tokens, or None when it ran out of memory; per_token_bytes: the memory model's slope
    (MemoryEstimate.per_token_bytes), to aim each next trial at the line from the last measured peak.
    """
    if not (0 < fraction <= 1 and 0 <= backoff < 1 and growth > 1 and granularity >= 1 and minimum >= granularity):
        raise ValueError(f"batch finder: need 0 < fraction <= 1, 0 <= backoff < 1, growth > 1 and minimum >= "
                         f"granularity >= 1; got {fraction}, {backoff}, {growth}, {minimum}, {granularity}")
    limit = fraction * free_bytes
    top = maximum if maximum is not None else float("inf")
    choice = BatchChoice(tokens=0, predicted=predicted, limit_bytes=limit)
    good, bad = 0, None  # the largest budget under the line so far, the smallest over it (or OOM)
    tokens = max(minimum, min(_round_down(predicted, granularity), top))
    for _ in range(max_trials):
        peak = try_step(tokens)
        choice.trials.append((tokens, peak))
        if peak is not None and peak <= limit:
            good = tokens
        else:
            bad = tokens
        if peak is not None and per_token_bytes:
            # aim at the line from the measured peak along the memory model's slope (right to ~1 trial when the
            # model's fixed part was off, a few when its slope was)
            nxt = _round_down(tokens + (limit - peak) / per_token_bytes, granularity)
        elif bad is None:
            nxt = _round_down(tokens * growth, granularity)
        else:
            nxt = _round_down((good + bad) / 2, granularity) if good else _round_down(bad * 0.75, granularity)
        nxt = min(nxt, top, bad - granularity if bad is not None else nxt)
        if nxt <= good or nxt < minimum:
            break
        tokens = nxt
    if not good:
        raise ValueError(f"data.tokens_per_batch: auto found no budget of at least {minimum} tokens under "
                         f"{limit / 2 ** 30:.1f} GiB ({fraction:.0%} of the free memory); trials: "
                         f"{[(t, 'OOM' if p is None else f'{p / 2 ** 30:.1f} GiB') for t, p in choice.trials]}; "
                         "turn on model.activation_checkpointing, lower data.max_seq_len or use method qlora")
    choice.tokens = max(minimum, _round_down(good * (1 - backoff), granularity))
    over = f"; {bad:,} went over" if bad is not None else (f"; {top:,} is the most asked for" if good >= top else "")
    choice.reason = (f"{good:,} tokens peaked under {fraction:.0%} of the free memory "
                     f"({limit / 2 ** 30:.1f} GiB){over}; backed off {backoff:.0%} to {choice.tokens:,} "
                     f"(memory model proposed {predicted:,}; {len(choice.trials)} trial steps)")
    return choice


def most_for_rows(rows: int, max_seq_len: int, backoff: float = 0.1) -> int:
    """The largest budget worth a trial for batches of at most `rows` documents (data.rows_per_batch): the fewest
    rows of max_seq_len that back off (find_token_budget's arithmetic) to `rows` of them, the most such a batch
    fills. Without it the finder would try, and back off from, budgets no batch of the run ever fills."""
    most = rows
    while _round_down(most * max_seq_len * (1 - backoff), max_seq_len) < rows * max_seq_len:
        most += 1
    return most * max_seq_len


def drop_gradients(model, params: list[torch.Tensor]) -> None:
    """A trial step's gradients dropped: the model's, and those of the optimizer's tensors (the float32 masters hold
    the folded gradients of bf16/fp16 trainable weights)."""
    model.zero_grad(set_to_none=True)
    for p in params:
        p.grad = None


def free_memory(device: torch.device) -> None:
    """Give back what a failed attempt held: collect its tensors, then the caching allocator's free blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_with_oom_backoff(step: Callable[[int], T], tokens: int, device: torch.device, *, shrink: float = 0.9,
                         granularity: int = 256, minimum: int = 256, max_retries: int = 5,
                         on_oom: Callable[[int, int], None] | None = None) -> tuple[T, int]:
    """step(tokens), retried with fewer tokens after torch.OutOfMemoryError; returns (its result, the tokens it
    ran with), the budget the rest of the run keeps. on_oom(old, new) is told each back-off (for metrics.jsonl)."""
    for attempt in range(max_retries + 1):
        try:
            return step(tokens), tokens
        except torch.OutOfMemoryError:
            pass  # freed outside the handler: the exception's traceback still references the attempt's tensors
        free_memory(device)
        smaller = _round_down(tokens * shrink, granularity)
        if attempt == max_retries or smaller < minimum:
            break
        if on_oom is not None:
            on_oom(tokens, smaller)
        tokens = smaller
    raise torch.OutOfMemoryError(f"out of memory with {tokens:,} tokens per micro-batch after {attempt} back-offs "
                                 f"of {1 - shrink:.0%} (at most {max_retries}, minimum {minimum:,}); set "
                                 "data.tokens_per_batch lower or turn on model.activation_checkpointing")


def split_rows(batch: Batch, rows: int) -> list[Batch]:
    """The batch as pieces of at most `rows` rows each (a step retried after an OOM, with the same tokens). Their
    token counts sum to the batch's, so a step over the pieces has the batch's loss and gradient (gapless.train.step).
    Used only after an OOM back-off: it reads cu_seqlens and the targets on the host (SYNC, once per piece)."""
    B, T = batch.input_ids.shape
    if rows >= B:
        return [batch]
    cu = batch.cu_seqlens.tolist() if batch.cu_seqlens is not None else None  # SYNC: after an OOM only
    pieces = []
    for r0 in range(0, B, rows):
        r1 = min(B, r0 + rows)
        sl = slice(r0, r1)
        cu_piece = None
        if cu is not None:  # every row ends a segment (a packed row's padding tail is its own), so rows split cleanly
            offsets = [c - r0 * T for c in cu if r0 * T <= c <= r1 * T]
            cu_piece = torch.tensor(offsets, dtype=torch.int32, device=batch.cu_seqlens.device)
        mask = batch.attention_mask[sl] if batch.attention_mask is not None else None
        # real tokens: the step reads only the trained-token counts; the loop counts real tokens on the whole batch,
        # so a packed piece's padding tail is not told apart here
        real = int(mask.sum()) if mask is not None else (r1 - r0) * T  # SYNC (padded)
        pieces.append(Batch(batch.input_ids[sl], batch.targets[sl], batch.position_ids[sl], cu_piece, batch.max_seqlen,
                            mask, real, int((batch.targets[sl] != IGNORE).sum()), (r1 - r0) * T))  # SYNC
    return pieces


def full_rows(rows: int, seq_len: int, vocab_size: int, device: torch.device) -> Batch:
    """`rows` packed rows, each one document of seq_len random tokens, every token but the last trained: a trial
    step's batch. Memory depends on the slots, not on the documents' boundaries or token values (padding runs
    through every layer too), so the trials need no data."""
    ids = torch.randint(0, vocab_size, (rows, seq_len), device=device)
    targets = ids.roll(-1, dims=1)
    targets[:, -1] = IGNORE
    positions = torch.arange(seq_len, device=device).expand(rows, seq_len)
    cu_seqlens = torch.arange(0, rows * seq_len + 1, seq_len, dtype=torch.int32, device=device)
    n = rows * seq_len
    return Batch(ids, targets, positions, cu_seqlens, seq_len, None, n, n - rows, n, (seq_len,) * rows)


def choose_tokens_per_batch(model, params: list[torch.Tensor], device: torch.device, method: str, *, max_seq_len: int,
                            estimate: dict, fraction: float = 0.9, backoff: float = 0.1,
                            maximum: int | None = None, rows_per_batch: int | None = None) -> BatchChoice:
    """`data.tokens_per_batch: auto` for an assembled model: the memory model's proposal for `fraction` of the memory
    this process can use (free now + what it already holds: the weights), then trial steps (forward and backward
    of full packed rows; the optimizer's state, allocated at the first real step, added as 8 B per trainable
    element), in whole rows of max_seq_len. `estimate`: estimate_memory's keyword arguments for this run. The trials
    draw random numbers under a forked RNG, so the run's own stream is as without them. rows_per_batch: the
    run's data.rows_per_batch; its batches fill at most that many rows, so the choice is at most them
    (most_for_rows), and less where they do not fit."""
    if device.type != "cuda":
        raise ValueError(f"data.tokens_per_batch: auto measures the GPU's memory, and this run is on {device.type}; "
                         "give a number of tokens")
    from gapless.train.step import loss_sum

    # each trial row is one document: no more than one varlen attention call takes (a tiny model at a short
    # max_seq_len could otherwise fill a big GPU with more)
    cap = MAX_VARLEN_DOCUMENTS * max_seq_len
    if rows_per_batch is not None:
        cap = min(cap, most_for_rows(rows_per_batch, max_seq_len, backoff))
    maximum = cap if maximum is None else min(maximum, cap)
    free, _ = torch.cuda.mem_get_info(device)
    capacity = free + torch.cuda.memory_allocated(device)
    slope = estimate_memory(model.args, method, tokens=max_seq_len, **estimate).per_token_bytes
    predicted = max_tokens(model.args, method, fraction * capacity / GIB, **estimate)
    optimizer_bytes = 8 * sum(p.numel() for p in params)

    def try_step(tokens: int) -> float | None:
        batch = full_rows(tokens // max_seq_len, max_seq_len, model.args.vocab_size, device)
        torch.cuda.reset_peak_memory_stats(device)
        peak = None
        try:
            loss_sum(model, batch).backward()
            peak = torch.cuda.max_memory_allocated(device) + optimizer_bytes
        except torch.OutOfMemoryError:
            pass  # freed below, outside the handler
        del batch
        drop_gradients(model, params)
        free_memory(device)
        return peak

    with torch.random.fork_rng(devices=[device]):
        return find_token_budget(predicted, try_step, capacity, fraction=fraction, backoff=backoff,
                                 granularity=max_seq_len, minimum=max_seq_len, maximum=maximum,
                                 per_token_bytes=slope)
