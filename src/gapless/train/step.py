"""The one training step, shared by `gapless train`, `gapless bench` and bench/pipeline.py.

The loss of an optimizer step is the mean over ALL trained tokens of its k micro-batches:
    loss = sum_{micro} sum_{t trained} CE_t / N_step,   N_step = trained tokens of the whole step
Each micro-batch contributes `loss_sum / N_step` to the gradient, so k micro-batches of ragged lengths give
exactly the gradient of one batch holding the same tokens (not a mean of means). N_step is a host integer the
data pipeline counted while building the batches: no device sync. The loss runs through the module call
(`model(..., targets=...)`), so the hooks DDP and FSDP2 put there run.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from gapless.data.batching import Batch
from gapless.train.loss_scale import DynamicLossScaler
from gapless.train.guard import step_unless_nonfinite
from gapless.train.optim import clip_grad_norm
from gapless.train.parallel import sync_gradients


def loss_sum(model, batch: Batch) -> torch.Tensor:
    """The float32 sum of the cross-entropy over the batch's trained tokens, through the model's forward."""
    return model(batch.input_ids, batch.position_ids, batch.cu_seqlens, batch.attention_mask, batch.max_seqlen,
                 targets=batch.targets)


def train_step(model, micro: Sequence[Batch], params: list[torch.Tensor], optimizer: torch.optim.Optimizer,
               grad_clip: float, mark: Callable[[], None] | None = None,
               scaler: DynamicLossScaler | None = None, zero_first: bool = False,
               n_step: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward of each micro-batch, clipping, the update. Returns (the step's loss sum, the grad norm
    before clipping), both on the device: nothing here reads them. `mark` (a benchmark's profiling pass) is called
    after the forwards, the backwards and the update of a single micro-batch. `scaler` (fp16): the loss is scaled
    before backward, the gradients unscaled before clipping, and a step with inf/nan gradients skipped, all on the
    device (gapless.train.loss_scale). `zero_first`: drop gradients left by an attempt that ran out of memory
    (gapless.train.batch_finder.run_with_oom_backoff) before the first backward. `n_step`: what the loss sums are
    divided by when not this step's own trained tokens (several ranks: gapless.train.parallel.loss_divisor)."""
    if zero_first:
        optimizer.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
    if n_step is None:
        n_step = max(sum(b.num_target_tokens for b in micro), 1)  # host ints counted by the data pipeline
    total = None
    for i, b in enumerate(micro):
        sync_gradients(model, i == len(micro) - 1)  # several ranks (DDP): reduce once per step
        loss = loss_sum(model, b)
        if mark is not None:
            mark()
        scaled = loss / n_step
        (scaled if scaler is None else scaler.scale_loss(scaled)).backward()
        if mark is not None:
            mark()
        total = loss.detach() if total is None else total + loss.detach()
    if scaler is not None:
        scaler.unscale_(params)
    grad_norm = clip_grad_norm(params, grad_clip)
    if scaler is None:
        step_unless_nonfinite(optimizer, grad_norm)  # a nan/inf loss or gradient updates nothing (train/guard.py)
    else:
        scaler.step(optimizer)  # skipped when found_inf; the scale backs off or grows
    optimizer.zero_grad(set_to_none=True)
    if mark is not None:
        mark()
    return total, grad_norm
