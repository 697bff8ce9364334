"""The optimizer (AdamW), the learning-rate schedule and gradient clipping.

Weight decay goes to parameters with 2 or more dimensions (linear weights, embeddings, LoRA A and
B) and not to 1-D ones (RMSNorm weights, biases): decaying a norm's gain towards 0 shrinks the
activations instead of regularising, the usual practice since GPT-2 / nanoGPT.

The schedule is a multiplier m(s) of the peak lr for optimizer step s (0-based), with W warmup
steps and N total steps:

    s < W:   m = (s + 1) / W                     linear, from 0 (at s = -1) to 1 at s = W - 1
    s >= W:  p = (s - W) / (N - 1 - W)           0 at the first step after warmup, 1 at the last
             cosine:   m = min + (1 - min) * (1 + cos(pi p)) / 2
             linear:   m = min + (1 - min) * (1 - p)
             constant: m = 1

No step runs at lr 0 and the last step (s = N - 1) runs at exactly min_lr_ratio * peak. The loop
calls `optimizer.step()` then `scheduler.step()` once per optimizer step, so after k steps the
optimizer's lr is m(k), the lr of the next step; that is the state a checkpoint taken then holds.

Precision (`MasterWeights`). The optimizer always works in float32. LoRA's and QLoRA's adapters are float32
Parameters (the matmuls cast them to the activations' dtype), so they are their own master copy. Full fine-tuning
in bf16 or fp16 keeps, per trainable weight:

    the model's weight         bf16/fp16  2 B   what forward and backward read
    its gradient               bf16/fp16  -     transient: folded into the fp32 gradient as soon as backward
                                                 has accumulated it (a post-accumulate-grad hook), then freed
    master weight              float32    4 B   the optimizer's parameter; copied (rounded) into the model's
                                                 weight after every step
    master gradient            float32    4 B   summed over the micro-batches of a step in float32
    AdamW exp_avg, exp_avg_sq  float32    8 B
                                          18 B per weight (Llama-3.2-3B: 3.21e9 x 18 B = 53.8 GiB)

Why: a bf16 weight updated in place loses every update smaller than 2^-8 of itself (lr 2e-5 steps vanish), and
bf16 gradient sums over k micro-batches round k times; the fp32 master and gradient avoid both for 6 B per weight
more than bf16 weights + bf16 grads + fp32 moments (12 B).
"""
from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
from torch import Tensor

from gapless.config import OptimConfig, ScheduleConfig


def use_fused(fused: bool | None, device_type: str) -> bool:
    """Resolve `optim.fused`: None means the fused kernel on CUDA only (one launch for all params)."""
    return device_type == "cuda" if fused is None else fused


def build_optimizer(params: Iterable[Tensor], cfg: OptimConfig, device_type: str) -> torch.optim.AdamW:
    """AdamW over the trainable (requires_grad) tensors of `params`; frozen ones are left out, so
    `model.parameters()` can be passed as is. Group 0 is decayed (ndim >= 2), group 1 is not (ndim < 2);
    a group with no tensors is dropped. The grouping depends only on the model, so a resumed run
    builds the same groups and `load_state_dict` lines up."""
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        raise ValueError("no trainable parameters: the model transform froze everything; "
                         "check lora.target_modules or the fine-tuning method")
    decay = [p for p in trainable if p.ndim >= 2]
    no_decay = [p for p in trainable if p.ndim < 2]
    groups = [{"params": ps, "weight_decay": wd}
              for ps, wd in ((decay, cfg.weight_decay), (no_decay, 0.0)) if ps]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.betas[0], cfg.betas[1]), eps=cfg.eps,
                             fused=use_fused(cfg.fused, device_type))


def warmup_steps(cfg: ScheduleConfig, total_steps: int) -> int:
    """The number of warmup steps: `warmup_steps`, or `warmup_ratio` of the total rounded up."""
    return cfg.warmup_steps or math.ceil(cfg.warmup_ratio * total_steps)


def lr_multiplier(step: int, cfg: ScheduleConfig, total_steps: int) -> float:
    """m(step), the fraction of the peak lr used by optimizer step `step` (see the module docstring)."""
    warmup = warmup_steps(cfg, total_steps)
    if step < warmup:
        return (step + 1) / warmup
    if cfg.kind == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - 1 - warmup))
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if cfg.kind == "cosine" else 1.0 - progress
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: ScheduleConfig,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR applying `lr_multiplier` to every group's lr. Its state_dict() holds only numbers
    (the schedule itself is rebuilt from the config), so it can go in a checkpoint's JSON meta."""
    assert total_steps >= 1, total_steps
    warmup = warmup_steps(cfg, total_steps)
    if warmup >= total_steps:
        field = "warmup_steps" if cfg.warmup_steps else "warmup_ratio"
        raise ValueError(f"schedule.{field}: {warmup} warmup steps leave nothing of a {total_steps}-step run; "
                         f"use fewer than {total_steps}")

    def multiplier(step: int) -> float:  # a plain function: LambdaLR keeps it out of state_dict()
        return lr_multiplier(step, cfg, total_steps)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)


def clip_grad_norm(params: Iterable[Tensor], max_norm: float) -> Tensor:
    """Scale the gradients so their global L2 norm is at most `max_norm` (0 = don't clip) and return
    the norm before clipping, a 0-d tensor on the gradients' device. No host sync: the loop reads it
    when it logs. Parameters without a gradient are skipped."""
    with_grad = [p for p in params if p.grad is not None]
    if not with_grad:
        return torch.zeros(())
    if max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(with_grad, max_norm)  # foreach on CUDA by default
    else:
        grads = [p.grad for p in with_grad]
        # the same norm clip_grad_norm_ computes (per-tensor norms, then the norm of those), without the
        # rescale; torch.nn.utils.get_total_norm does this but needs torch >= 2.6
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, 2.0) for g in grads]), 2.0)
    # FSDP2's sharded gradients give a DTensor norm; its full value as a plain tensor, for every reader (the NaN
    # guard, the loss scaler, the logged grad_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


class MasterWeights:
    """float32 master copies of the low-precision trainable parameters (the module docstring's precision table).

    `masters` are what the optimizer, clip_grad_norm and the loss scaler work on: a float32 parameter is its own
    master (LoRA's adapters: nothing is copied or hooked), a bf16/fp16 one gets a float32 copy, and backward
    folds its gradient into that copy's float32 .grad and frees it. `attach(optimizer)` copies the updated masters
    into the model after every optimizer step.
    """

    def __init__(self, named_params: Iterable[tuple[str, Tensor]]):
        named = [(n, p) for n, p in named_params if p.requires_grad]
        self.masters = [p if p.dtype == torch.float32 else torch.nn.Parameter(p.detach().float().clone())
                        for _, p in named]
        # (name, model parameter, its float32 master) of the low-precision ones
        self._copies = [(n, p, m) for (n, p), m in zip(named, self.masters) if m is not p]
        self._hooks = [p.register_post_accumulate_grad_hook(self._fold_into(m)) for _, p, m in self._copies]

    @property
    def active(self) -> bool:
        """Whether any trainable parameter has a float32 copy (full fine-tuning in bf16/fp16)."""
        return bool(self._copies)

    @staticmethod
    def _fold_into(master: Tensor) -> Callable[[Tensor], None]:
        def hook(param: Tensor) -> None:
            with torch.no_grad():
                if master.grad is None:
                    master.grad = param.grad.float()
                else:
                    master.grad.add_(param.grad)  # float32 += bf16, upcast per element
            param.grad = None  # the low-precision gradient lives only while backward produces it

        return hook

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """After each optimizer.step(), round the updated masters into the model (nothing to do when none is
        active). A step the loss scaler skips leaves the masters as they were, so the copy changes nothing."""
        if self.active:
            optimizer.register_step_post_hook(lambda *_: self.copy_to_model())

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Round the masters into the model's weights (round to nearest even, as .to(bf16) does)."""
        for _, p, m in self._copies:
            p.copy_(m)

    def state_dict(self) -> dict[str, Tensor]:
        """The float32 masters by parameter name: with the optimizer's state, what bit-exact resume needs."""
        return {n: m for n, _, m in self._copies}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Tensor], where: str = "checkpoint") -> None:
        missing = sorted({n for n, _, _ in self._copies} - set(state))
        if missing:
            raise ValueError(f"{where}: lacks the float32 master weights {missing[:5]} ({len(missing)} in all); "
                             "was it written by a run with another method or dtype?")
        for n, _, m in self._copies:
            m.copy_(state[n])
        self.copy_to_model()
