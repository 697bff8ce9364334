"""fp16's dynamic loss scaling, kept on the device: skipped steps are counted, not synced.

fp16 has 5 exponent bits: gradients below 2^-24 flush to zero and activations' gradients of a 3B model are
often ~1e-6..1e-8, so the loss is multiplied by a scale S before backward (the gradients by S, by linearity)
and the gradients divided by S before the optimizer sees them. S is chosen dynamically (Micikevicius et al.
2018, torch.amp.GradScaler's rule):

    a step whose gradients hold an inf or a nan is skipped (no parameter or optimizer-state change), S *= 0.5
    after `growth_interval` consecutive good steps, S *= 2

Host syncs: none on the fused AdamW path (the default on CUDA): the inf check, the skip (AdamW's fused kernel
reads `found_inf` and leaves parameters, moments and its step count untouched) and the scale update all run on
the device. The non-fused optimizer path reads `found_inf` once per step (marked SYNC). The scale, the growth
tracker and the count of skipped steps are device tensors the loop reads when it logs.

The lr schedule advances on a skipped step too (the loop calls scheduler.step() regardless, as with GradScaler):
a skip costs that step's update, not a shift of the schedule.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor


class DynamicLossScaler:
    def __init__(self, device: torch.device | str, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        if not (init_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1):
            raise ValueError(f"loss scaler: init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 and "
                             f"growth_interval >= 1 are required, got {init_scale}, {growth_factor}, "
                             f"{backoff_factor}, {growth_interval}")
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.scale = torch.full((), init_scale, dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=device)  # good steps since the last change
        self.found_inf = torch.zeros((), dtype=torch.float32, device=device)  # 1.0 when this step's grads overflowed
        self.skipped = torch.zeros((), dtype=torch.int64, device=device)  # steps skipped so far

    def scale_loss(self, loss: Tensor) -> Tensor:
        # in float32: an fp16 loss times 2^16 would overflow fp16 (max 65,504) before backward starts
        return loss.float() * self.scale

    @torch.no_grad()
    def unscale_(self, params: Iterable[Tensor]) -> None:
        """Divide the gradients by the scale in place and set found_inf (1.0 if any is inf or nan). Pass float32
        gradients (LoRA's fp32 adapters, the master weights of full fine-tuning): unscaled in fp16 they would
        flush to zero again."""
        self.found_inf.zero_()
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for p in params:
            if p.grad is not None:
                by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        inv_scale = self.scale.double().reciprocal().float()  # as GradScaler: 1/S rounded once
        for grads in by_dtype.values():  # the fused check wants one dtype per call
            torch._amp_foreach_non_finite_check_and_unscale_(grads, self.found_inf, inv_scale)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """optimizer.step() unless found_inf, then update the scale. Call after unscale_ (and any clipping)."""
        if optimizer.defaults.get("fused"):
            # fused Adam/AdamW skip the update on the device when found_inf is 1 (torch.optim._fused_adamw)
            optimizer.found_inf, optimizer.grad_scale = self.found_inf, None
            try:
                optimizer.step()
            finally:
                del optimizer.found_inf, optimizer.grad_scale
        elif not self.found_inf.item():  # SYNC: the non-fused optimizers cannot skip on the device
            optimizer.step()
        self.update()

    @torch.no_grad()
    def update(self) -> None:
        self.skipped += self.found_inf.to(torch.int64)
        # S *= backoff on overflow (tracker reset); else tracker += 1 and S *= growth when it reaches the interval
        torch._amp_update_scale_(self.scale, self.growth_tracker, self.found_inf, self.growth_factor,
                                 self.backoff_factor, self.growth_interval)

    def state_dict(self) -> dict:
        """Plain numbers for a checkpoint's JSON meta (a sync: checkpoint time only)."""
        return {"scale": self.scale.item(), "growth_tracker": int(self.growth_tracker.item()),
                "skipped": int(self.skipped.item())}

    def load_state_dict(self, state: dict) -> None:
        self.scale.fill_(state["scale"])
        self.growth_tracker.fill_(state["growth_tracker"])
        self.skipped.fill_(state["skipped"])
