"""`checkpoint.every: auto`: the checkpoint interval at which saving costs at most 1% of the training time.

What a save costs the loop is the time it blocks it: with `checkpoint.async_write` the copy of the checkpoint's
tensors to host memory (the write to disk runs in a background thread), without it the copy and the whole write.
Over an interval of `every` optimizer steps of `step_s` seconds that cost is save_s / (every * step_s), so

    every = max(ceil(save_s / (SHARE * step_s)),   the 1% rule
                ceil(write_s / step_s),            async only: the background write is done before the next save
                                                   (else the next save waits for it, a stall the rule did not count)
                MIN_EVERY)                         never more often than every MIN_EVERY steps

How the numbers are had, in the loop (gapless.train.loop):
  step_s   measured: the wall time of the MEASURE_STEPS optimizer steps after the first one, less any evaluation in
           them. The first step is start-up (it compiles kernels and fills the allocator: tens of seconds against
           well under one on a GPU) and is never in it. A resumed session measures its own steps again.
  save_s   predicted before the first save from the checkpoint's bytes (the tensors `save_checkpoint` hands the
           manager: trainable weights, the optimizer state, float32 masters) at the stated bandwidths below; after
           the first real save, re-resolved from the time that save blocked the loop (an upper bound of later
           saves: the first one also allocates the pinned host buffers).
  write_s  async only: predicted likewise; when a later save waits for the previous write long enough to take the
           cost over 1%, the write took at least the interval plus that wait, and the interval is re-resolved from
           that (a disk slower than the stated rate).
Until the interval is chosen (the warm-up step and MEASURE_STEPS more) no save happens, but the last step of the
run always saves, as with a fixed interval: a run shorter than that gets exactly one checkpoint, at its end.
Under torchrun every rank must save at the same steps (a save is collective): the numbers are the maximum over the
ranks (the slowest rank sets every rank's pace), so every rank computes the same interval.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

SHARE = 0.01  # what checkpoints may cost: 1% of the training time
# optimizer steps timed after the warm-up step before the interval is chosen: the time is settled on the GPU at both
# ends (the device's, not the host's queueing), so a few steps suffice, and a 100-step run has its interval at step 4
MEASURE_STEPS = 3
# never more often: a cheap (LoRA) checkpoint saved every step or two buys little (a crash loses at most 10 steps
# anyway) and keeps the disk and the writer thread busy all run
MIN_EVERY = 10
# Stated, not measured here. The loop's wait at an async save: the device-to-host copy, 10 GB/s (pageable copies
# run below PCIe 4.0/5.0's 32/64 GB/s per direction; a CPU tensor's memcpy is faster). The write: torch.save
# through sha256 and an fsync, 0.5 GB/s (a local NVMe writes 2-7 GB/s; network file systems and sha256's ~1 GB/s
# single-threaded rate less). The first save's measured blocking time replaces the first; a later save's wait for
# the previous write corrects the second.
HOST_COPY_GBS = 10.0
DISK_WRITE_GBS = 0.5


@dataclass
class Interval:
    """The chosen interval and why: what metrics.jsonl records and the console prints."""
    every: int
    step_s: float  # measured optimizer-step time, start-up excluded
    save_s: float  # what one save blocks the loop
    write_s: float | None  # async: the background write; None with async_write false (it is in save_s)
    nbytes: int  # the checkpoint's tensors, this rank's (the maximum over the ranks)
    source: str  # where save_s came from: predicted from the bytes, or measured at a save

    @property
    def share(self) -> float:
        """The predicted cost: save_s / (every * step_s)."""
        return self.save_s / (self.every * self.step_s)

    def formula(self) -> str:
        terms = [f"ceil({self.save_s:.4g} / ({SHARE} x {self.step_s:.4g}))"]
        if self.write_s is not None:
            terms.append(f"ceil({self.write_s:.4g} / {self.step_s:.4g})")
        return f"every = max({', '.join(terms)}, {MIN_EVERY}) = {self.every}"

    def message(self) -> str:
        share = f"{self.share:.2%}" if self.share >= 1e-4 else "under 0.01%"
        return (f"checkpoint.every auto: {self.every} steps ({self.step_s:.3g} s per step, start-up excluded; a save "
                f"blocks {self.save_s:.3g} s, {self.source}; {self.formula()}): {share} of the training time")

    def record(self, step: int) -> dict:
        """The metrics.jsonl record (`kind` checkpoint_interval): it applies from `step` on."""
        return {"kind": "checkpoint_interval", "step": step, **asdict(self), "share": self.share,
                "formula": self.formula()}


def choose_interval(step_s: float, save_s: float, write_s: float | None, nbytes: int, source: str) -> Interval:
    """The interval of the module doc for these numbers."""
    assert step_s > 0 and save_s >= 0, (step_s, save_s)
    need = [math.ceil(save_s / (SHARE * step_s)), MIN_EVERY]
    if write_s is not None:
        need.append(math.ceil(write_s / step_s))
    return Interval(max(need), step_s, save_s, write_s, nbytes, source)


def predicted_save(nbytes: int, async_write: bool) -> tuple[float, float | None, str]:
    """(save_s, write_s, source) of a checkpoint of `nbytes` at the stated bandwidths."""
    copy_s, write_s = nbytes / (HOST_COPY_GBS * 1e9), nbytes / (DISK_WRITE_GBS * 1e9)
    if async_write:
        return copy_s, write_s, (f"predicted: {nbytes / 1e6:,.1f} MB copied to host memory at {HOST_COPY_GBS:g} "
                                 f"GB/s, written in the background at {DISK_WRITE_GBS:g} GB/s")
    return copy_s + write_s, None, (f"predicted: {nbytes / 1e6:,.1f} MB copied at {HOST_COPY_GBS:g} GB/s and "
                                    f"written at {DISK_WRITE_GBS:g} GB/s (async_write false: the loop waits)")


def tensor_bytes(obj) -> int:
    """Bytes of the tensors in a nested dict/list, as this process holds them (a DTensor: its local shard)."""
    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") else obj
        return local.numel() * local.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


class CheckpointSchedule:
    """At which steps the loop saves: every `checkpoint.every` steps and at the last step, 0 never; "auto" once
    `choose` has run (until then only the last step)."""

    def __init__(self, every: int | str, async_write: bool, last_step: int):
        self.auto = every == "auto"
        self.every: int | None = None if self.auto else int(every)  # None: auto, not chosen yet
        self.async_write = async_write
        self.last_step = last_step
        self.chosen: Interval | None = None
        self.remeasured = False  # auto: the first real save's blocking time has been used

    @property
    def pending(self) -> bool:
        return self.auto and self.every is None

    def due(self, step: int) -> bool:
        if self.every == 0:
            return False
        return step == self.last_step or (self.every is not None and step % self.every == 0)

    def choose(self, step_s: float, nbytes: int) -> Interval:
        """The interval from the measured step time and the checkpoint's bytes (before any save)."""
        save_s, write_s, source = predicted_save(nbytes, self.async_write)
        return self._set(choose_interval(step_s, save_s, write_s, nbytes, source))

    def remeasure(self, step: int, blocked_s: float) -> Interval | None:
        """After the first save of an auto run: the interval from that save's measured blocking time; the new
        Interval when it changes the interval, else None."""
        assert self.chosen is not None and not self.remeasured
        self.remeasured = True
        c = self.chosen
        new = choose_interval(c.step_s, blocked_s, c.write_s, c.nbytes,
                              f"measured: the save of step {step} blocked the loop {blocked_s:.3g} s")
        if new.every == c.every:
            return None
        return self._set(new)

    def waited(self, step: int, waited_s: float) -> Interval | None:
        """After a later save of an auto run with async_write, which waited `waited_s` for the previous write: when
        that takes the cost over SHARE, the interval from a write of at least (every x step_s + waited_s)."""
        c = self.chosen
        assert c is not None and self.async_write
        if (c.save_s + waited_s) / (c.every * c.step_s) <= SHARE:
            return None
        return self._set(choose_interval(c.step_s, c.save_s, c.every * c.step_s + waited_s, c.nbytes,
                                         f"measured: the save of step {step} waited {waited_s:.3g} s for the "
                                         "previous write"))

    def _set(self, interval: Interval) -> Interval:
        self.chosen, self.every = interval, interval.every
        return interval
