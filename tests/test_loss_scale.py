"""The dynamic loss scaler (gapless.train.loss_scale): skip on inf/nan, back off, grow, count, resume."""
import pytest
import torch

from gapless.train.loss_scale import DynamicLossScaler


def _setup(fused: bool):
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([p], lr=0.1, fused=fused)
    return p, opt


def _backward(p, scaler, grad):
    p.grad = None
    scaler.scale_loss((p * grad).sum()).backward()


@pytest.mark.parametrize("fused", [True, False])
def test_overflow_skips_the_step_and_halves_the_scale(fused):
    p, opt = _setup(fused)
    scaler = DynamicLossScaler("cpu", init_scale=1024.0, growth_interval=3)
    _backward(p, scaler, torch.tensor([1.0, float("inf"), 0.0, 0.0]))
    scaler.unscale_([p])
    assert scaler.found_inf.item() == 1.0
    scaler.step(opt)
    assert torch.equal(p.detach(), torch.ones(4))  # untouched
    assert not opt.state or opt.state[p]["step"].item() == 0  # AdamW's bias correction does not advance
    assert scaler.scale.item() == 512.0 and scaler.skipped.item() == 1

    _backward(p, scaler, torch.tensor([1.0, 2.0, 3.0, float("nan")]))  # nan too
    scaler.unscale_([p])
    scaler.step(opt)
    assert scaler.scale.item() == 256.0 and scaler.skipped.item() == 2
    assert torch.equal(p.detach(), torch.ones(4))


@pytest.mark.parametrize("fused", [True, False])
def test_good_steps_unscale_update_and_grow(fused):
    p, opt = _setup(fused)
    ref = torch.nn.Parameter(torch.ones(4))
    ref_opt = torch.optim.AdamW([ref], lr=0.1)
    scaler = DynamicLossScaler("cpu", init_scale=1024.0, growth_interval=3)
    grad = torch.tensor([1e-3, -2e-3, 3.0, 0.5])
    for i in range(4):
        _backward(p, scaler, grad)
        assert torch.equal(p.grad, grad * 1024.0 * (2.0 if i == 3 else 1.0))
        scaler.unscale_([p])
        assert torch.allclose(p.grad, grad)
        scaler.step(opt)
        ref.grad = grad.clone()
        ref_opt.step()
        # after 3 good steps the scale doubles; the 4th step ran at 2048
        assert scaler.scale.item() == (2048.0 if i >= 2 else 1024.0)
    assert torch.allclose(p.detach(), ref.detach(), atol=1e-6)  # the same updates as unscaled AdamW
    assert scaler.skipped.item() == 0 and scaler.growth_tracker.item() == 1


def test_overflow_resets_the_growth_count_and_state_round_trips():
    p, opt = _setup(True)
    scaler = DynamicLossScaler("cpu", init_scale=8.0, growth_interval=2)
    for grad in (1.0, float("inf"), 1.0, 1.0):
        _backward(p, scaler, torch.full((4,), grad))
        scaler.unscale_([p])
        scaler.step(opt)
    # 8 -> (1 good) 8 -> (inf) 4, tracker 0 -> (2 good) 8
    assert scaler.scale.item() == 8.0 and scaler.skipped.item() == 1 and opt.state[p]["step"].item() == 3
    state = scaler.state_dict()
    assert state == {"scale": 8.0, "growth_tracker": 0, "skipped": 1}
    again = DynamicLossScaler("cpu")
    again.load_state_dict(state)
    assert again.state_dict() == state


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="backoff_factor"):
        DynamicLossScaler("cpu", backoff_factor=2.0)


def test_fp16_gradients_that_underflow_unscaled_survive_scaled():
    # a gradient of 1e-8 is below fp16's smallest subnormal (6e-8): zero without scaling; with S = 2^16 the fp16
    # gradient holds 6.6e-4, and unscaled in float32 (the master weights' or LoRA's fp32 gradients) it is 1e-8
    w = torch.nn.Parameter(torch.ones(1, dtype=torch.float16))
    x = torch.tensor([1e-8])
    (w.float() * x).sum().backward()  # the gradient reaches w through the cast back to fp16
    assert w.grad.item() == 0.0
    w.grad = None
    scaler = DynamicLossScaler("cpu")
    scaler.scale_loss((w.float() * x).sum()).backward()
    master = torch.nn.Parameter(w.detach().float())
    master.grad = w.grad.float()
    scaler.unscale_([master])
    assert scaler.found_inf.item() == 0
    torch.testing.assert_close(master.grad, torch.tensor([1e-8]), rtol=1e-3, atol=0)  # fp16's 10-bit mantissa
