"""Batches made ahead of the step that uses them, in a background thread, copied to the device early.

The sampler collates numpy rows into tensors (host work); on CUDA the batch is pinned so its copy to
the device runs asynchronously. A bounded queue of `depth` batches keeps the host ahead of the GPU
without reading the whole epoch.

The sampler runs ahead of the loop, so its own state is not what a checkpoint needs: each batch
travels with the sampler state taken right after it was drawn, and `state` is that of the last
batch the loop took, so a resumed run continues with exactly the next one.
"""
from __future__ import annotations

import contextlib
import queue
import threading

import torch

from gapless.data.batching import Batch, BatchSampler

_DONE = object()


class Prefetcher:
    def __init__(self, sampler: BatchSampler, device: torch.device, depth: int = 2, timeline=None):
        self.device = device
        self.timeline = timeline
        self.state = sampler.state_dict()
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._produce, args=(sampler,), daemon=True, name="gapless-prefetch")
        self._thread.start()

    def _produce(self, sampler: BatchSampler) -> None:
        pin = self.device.type == "cuda"
        try:
            for batch in sampler:
                if pin:
                    batch = batch.pin_memory()
                item = (batch, sampler.state_dict())
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
        except BaseException as e:  # surfaced in next(): a data error must stop the run, not hang it
            self._error = e
            self._queue.put(_DONE)

    def next(self) -> Batch:
        item = self._queue.get()  # the caller's timeline counts this wait as data_wait
        if item is _DONE:
            raise self._error
        batch, self.state = item
        with self.timeline.phase("h2d_copy") if self.timeline else contextlib.nullcontext():
            return batch.to(self.device, non_blocking=True)

    def close(self) -> None:
        self._stop.set()
        # free a slot: a producer blocked on the full queue puts, sees the stop and returns now, not after its
        # 0.1 s timeout (which counted in a run's steady time: 4% of a 20-step window of the CPU demo model)
        with contextlib.suppress(queue.Empty):
            self._queue.get_nowait()
        self._thread.join(timeout=5)
