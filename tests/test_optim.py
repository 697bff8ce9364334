import copy
import json
import math

import pytest
import torch
from torch import nn

from gapless.config import OptimConfig, ScheduleConfig, from_dict
from gapless.train.optim import (build_optimizer, build_scheduler, clip_grad_norm, lr_multiplier,
                                 use_fused, warmup_steps)


def lrs_by_step(cfg: ScheduleConfig, total: int, peak: float = 1.0) -> list[float]:
    """The lr each optimizer step runs at, read from the optimizer as the loop would."""
    opt = torch.optim.AdamW([nn.Parameter(torch.zeros(2, 2))], lr=peak)
    sched = build_scheduler(opt, cfg, total)
    out = []
    for _ in range(total):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("kind", ["cosine", "linear"])
def test_schedule_key_steps(kind):
    # W = 10, N = 111: the decay runs over steps 10..110, so step 60 is its middle
    lrs = lrs_by_step(ScheduleConfig(kind=kind, warmup_steps=10, min_lr_ratio=0.1), 111, peak=2.0)
    assert lrs[0] == pytest.approx(2.0 * 1 / 10)       # warmup start: no step runs at lr 0
    assert lrs[4] == pytest.approx(2.0 * 5 / 10)       # linear ramp
    assert lrs[9] == pytest.approx(2.0)                # warmup end reaches the peak
    assert lrs[10] == pytest.approx(2.0)               # decay starts from the peak
    assert lrs[60] == pytest.approx(2.0 * 0.55)        # middle: min + (1 - min) / 2 for both shapes
    assert lrs[110] == pytest.approx(2.0 * 0.1)        # the last step runs at min_lr_ratio * peak
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    quarter = lrs[35] / 2.0  # p = 0.25
    expected = 0.1 + 0.9 * (0.5 * (1 + math.cos(math.pi / 4)) if kind == "cosine" else 0.75)
    assert quarter == pytest.approx(expected)


def test_schedule_constant_and_ratio():
    lrs = lrs_by_step(ScheduleConfig(kind="constant", warmup_ratio=0.25), 20)
    assert warmup_steps(ScheduleConfig(warmup_ratio=0.25), 20) == 5
    assert warmup_steps(ScheduleConfig(warmup_ratio=0.21), 20) == 5  # rounded up
    assert lrs[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert lrs[5:] == pytest.approx([1.0] * 15)
    assert lrs_by_step(ScheduleConfig(kind="cosine"), 5)[0] == 1.0  # no warmup: step 0 at the peak
    assert lr_multiplier(1000, ScheduleConfig(min_lr_ratio=0.3), 10) == pytest.approx(0.3)  # past the end


def test_schedule_rejects_warmup_longer_than_run():
    opt = torch.optim.AdamW([nn.Parameter(torch.zeros(1))])
    with pytest.raises(ValueError, match="schedule.warmup_steps"):
        build_scheduler(opt, ScheduleConfig(warmup_steps=10), 10)


def test_weight_decay_groups_and_frozen_params():
    model = nn.ModuleDict({
        "proj": nn.Linear(4, 8),          # weight 2-D: decay; bias 1-D: none
        "norm": nn.LayerNorm(8),          # weight and bias 1-D: none
        "lora_A": nn.Linear(4, 2, bias=False),
        "frozen": nn.Linear(8, 8),
    })
    model["frozen"].requires_grad_(False)
    opt = build_optimizer(model.parameters(), OptimConfig(weight_decay=0.1), "cpu")
    decay, no_decay = opt.param_groups
    assert {id(p) for p in decay["params"]} == {id(model["proj"].weight), id(model["lora_A"].weight)}
    assert {id(p) for p in no_decay["params"]} == {id(model["proj"].bias), id(model["norm"].weight),
                                                   id(model["norm"].bias)}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    # LoRA-only: no 1-D trainable params, so a single (decayed) group
    lora_only = build_optimizer([model["lora_A"].weight], OptimConfig(weight_decay=0.1), "cpu")
    assert len(lora_only.param_groups) == 1
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_optimizer(model["frozen"].parameters(), OptimConfig(), "cpu")


def test_fused_choice():
    assert use_fused(None, "cuda") is True
    assert use_fused(None, "cpu") is False
    assert use_fused(False, "cuda") is False
    assert use_fused(True, "cpu") is True
    p = nn.Parameter(torch.zeros(2, 2))
    assert build_optimizer([p], OptimConfig(), "cpu").defaults["fused"] is False
    cfg = OptimConfig(lr=1e-3, betas=[0.8, 0.9], eps=1e-6)
    opt = build_optimizer([p], cfg, "cpu")
    assert opt.defaults["betas"] == (0.8, 0.9) and opt.defaults["eps"] == 1e-6 and opt.defaults["lr"] == 1e-3


def _train(model, opt, sched, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        loss = model(torch.randn(4, 6, generator=g)).square().mean()
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()


def test_optimizer_and_scheduler_state_round_trip():
    cfg, sched_cfg = OptimConfig(weight_decay=0.1), ScheduleConfig(warmup_steps=3, min_lr_ratio=0.1)

    def build(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6), nn.Linear(6, 1))
        opt = build_optimizer(model.parameters(), cfg, "cpu")
        return model, opt, build_scheduler(opt, sched_cfg, 12)

    ref_model, ref_opt, ref_sched = build(0)
    _train(ref_model, ref_opt, ref_sched, 5, seed=1)
    # a copy: load_state_dict would share the tensors of a live state dict with the reference run
    opt_state = copy.deepcopy(ref_opt.state_dict())
    sched_state = json.loads(json.dumps(ref_sched.state_dict()))  # it travels in meta.json
    model, opt, sched = build(99)
    model.load_state_dict(ref_model.state_dict())
    opt.load_state_dict(opt_state)
    sched.load_state_dict(sched_state)
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    _train(ref_model, ref_opt, ref_sched, 5, seed=2)
    _train(model, opt, sched, 5, seed=2)
    assert sched.last_epoch == ref_sched.last_epoch == 10
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)


def test_clip_grad_norm():
    a, b = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2, 2))
    no_grad = nn.Parameter(torch.zeros(5))
    a.grad, b.grad = torch.tensor([3.0, 0.0, 0.0]), torch.full((2, 2), 2.0)  # norm sqrt(9 + 16) = 5
    norm = clip_grad_norm([a, b, no_grad], max_norm=0)
    assert isinstance(norm, torch.Tensor) and norm.item() == pytest.approx(5.0)
    assert a.grad[0].item() == 3.0  # 0 = no clipping
    norm = clip_grad_norm([a, b, no_grad], max_norm=1.0)
    assert norm.item() == pytest.approx(5.0)  # the norm before clipping
    assert torch.linalg.vector_norm(torch.cat([a.grad, b.grad.flatten()])).item() == pytest.approx(1.0, rel=1e-5)
    assert clip_grad_norm([no_grad], 1.0).item() == 0.0


@pytest.mark.parametrize("data, message", [
    ({"lr": 0}, "optim.lr: must be positive"),
    ({"betas": [0.9]}, "optim.betas: expected two numbers"),
    ({"grad_clip": -1}, "optim.grad_clip"),
    ({"fused": "yes"}, "optim.fused"),
])
def test_optim_config_errors_name_the_field(data, message):
    with pytest.raises(ValueError, match=message):
        from_dict(OptimConfig, data, "optim")


def test_schedule_config_validation():
    with pytest.raises(ValueError, match="both set"):
        from_dict(ScheduleConfig, {"warmup_steps": 10, "warmup_ratio": 0.1}, "schedule")
    with pytest.raises(ValueError, match="did you mean 'cosine'"):
        from_dict(ScheduleConfig, {"kind": "cosin"}, "schedule")
    with pytest.raises(ValueError, match="schedule.min_lr_ratio"):
        from_dict(ScheduleConfig, {"min_lr_ratio": 2}, "schedule")
    with pytest.warns(UserWarning, match="min_lr_ratio=0.1 is ignored"):
        from_dict(ScheduleConfig, {"kind": "constant", "min_lr_ratio": 0.1}, "schedule")
    assert from_dict(OptimConfig, {"fused": None}, "optim").fused is None
