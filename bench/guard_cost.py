"""What the non-finite guard (gapless.train.guard.step_unless_nonfinite) costs per optimizer step on the CPU, with
the demo's tiny LoRA model: the guard's own time (isfinite of the grad norm, and the host read on the unfused path)
against the optimizer step it guards and the whole training step. bench/RELIABILITY.md records the output of
    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/guard_cost.py
"""
import tempfile
import time
from pathlib import Path

import torch

from gapless import demo_task
from gapless.config import LoraConfig
from gapless.demo import write_base_model
from gapless.model.loading import load_model
from gapless.model.lora import apply_lora
from gapless.train.guard import step_unless_nonfinite
from gapless.train.optim import build_optimizer, clip_grad_norm
from gapless.config import OptimConfig


def median_us(fn, n=2000) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[n // 2] * 1e6


def main():
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as root:
        model = load_model(write_base_model(Path(root) / "base", seed=0), dtype="float32")
    apply_lora(model, LoraConfig(r=4, alpha=8, kernel="reference"))
    params = [p for p in model.parameters() if p.requires_grad]
    ids = torch.randint(0, demo_task.vocab_size(), (2, 64))
    for fused in (False, True):
        opt = build_optimizer(params, OptimConfig(lr=1e-3, fused=fused), "cpu")
        model(ids, targets=ids).backward()
        norm = clip_grad_norm(params, 1.0)
        plain = median_us(opt.step)
        guarded = median_us(lambda: step_unless_nonfinite(opt, norm))
        check = median_us(lambda: bool(torch.isfinite(norm)))

        def whole():
            loss = model(ids, targets=ids)
            loss.backward()
            step_unless_nonfinite(opt, clip_grad_norm(params, 1.0))
            opt.zero_grad(set_to_none=True)
        step_us = median_us(whole, n=200)
        print(f"AdamW {'fused' if fused else 'foreach'}: optimizer.step {plain:.1f} us, guarded {guarded:.1f} us "
              f"(+{guarded - plain:.1f} us), isfinite + host read alone {check:.1f} us; whole training step "
              f"{step_us / 1000:.2f} ms: the guard is {100 * (guarded - plain) / step_us:.2f}% of it")


if __name__ == "__main__":
    main()
