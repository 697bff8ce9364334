"""linear_cross_entropy against the materialised float32 reference, forward and backward.

Tolerances: float32 on the CPU lands near 1e-7 relative (chunked logsumexp vs F.cross_entropy); the tests
ask for 1e-5. bf16 on CUDA: the loss keeps fp32 logits (1e-4), the gradients go through bf16 softmax - onehot
and a bf16 GEMM output (2^-8 relative rounding twice: 1e-2).
"""
import pytest
import torch

from gapless.kernels import loss as loss_mod
from gapless.kernels.loss import linear_cross_entropy, reference_linear_cross_entropy

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def problem(N=37, D=16, V=50, ignored=(), device="cpu", dtype=torch.float32, seed=0, train_weight=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=g).to(device, dtype).requires_grad_()
    weight = (torch.randn(V, D, generator=g) / D**0.5).to(device, dtype).requires_grad_(train_weight)
    targets = torch.randint(0, V, (N,), generator=g)
    targets[list(ignored)] = -100
    return hidden, weight, targets.to(device)


def run(fn, hidden, weight, targets, **kw):
    hidden.grad = None
    weight.grad = None
    loss = fn(hidden, weight, targets, **kw)
    loss.backward()
    return loss.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("chunk_size", [1, 8, 10, 37, 4096])  # 8 and 10 leave a short last chunk of 37
def test_matches_reference_fp32(chunk_size):
    h, w, t = problem(ignored=(3, 4, 30))
    loss, gh, gw = run(linear_cross_entropy, h, w, t, chunk_size=chunk_size)
    ref, rgh, rgw = run(reference_linear_cross_entropy, h, w, t)
    assert rel(loss, ref) < 1e-5
    assert rel(gh, rgh) < 1e-5
    assert rel(gw, rgw) < 1e-5


def test_ignored_targets_contribute_nothing():
    h, w, t = problem(ignored=range(0, 37, 2))
    loss, gh, gw = run(linear_cross_entropy, h, w, t, chunk_size=8)
    assert torch.equal(gh[t == -100], torch.zeros_like(gh[t == -100]))  # exactly zero, not just small
    # dropping the ignored rows altogether gives the same loss and weight gradient
    keep = t != -100
    h2 = h.detach()[keep].clone().requires_grad_()
    w2 = w.detach().clone().requires_grad_()
    loss2, gh2, gw2 = run(linear_cross_entropy, h2, w2, t[keep], chunk_size=8)
    assert rel(loss, loss2) < 1e-6
    assert rel(gh[keep], gh2) < 1e-6
    assert rel(gw, gw2) < 1e-6


def test_all_ignored_chunk_and_all_ignored_input():
    h, w, t = problem(ignored=range(8, 16))  # the whole second chunk of 8 is ignored
    loss, gh, gw = run(linear_cross_entropy, h, w, t, chunk_size=8)
    ref, rgh, rgw = run(reference_linear_cross_entropy, h, w, t)
    assert rel(loss, ref) < 1e-5 and rel(gh, rgh) < 1e-5 and rel(gw, rgw) < 1e-5
    assert torch.count_nonzero(gh[8:16]) == 0

    h, w, t = problem(ignored=range(37))
    loss, gh, gw = run(linear_cross_entropy, h, w, t, chunk_size=8)
    assert loss.item() == 0.0
    assert torch.count_nonzero(gh) == 0 and torch.count_nonzero(gw) == 0


def test_frozen_weight_gets_no_gradient_and_skips_its_gemm(monkeypatch):
    h, w, t = problem(train_weight=False)
    calls = []
    real = loss_mod._mm_f32
    monkeypatch.setattr(loss_mod, "_mm_f32", lambda a, b: calls.append(a.shape) or real(a, b))
    loss, gh, gw = run(linear_cross_entropy, h, w, t, chunk_size=10)
    ref, rgh, _ = run(reference_linear_cross_entropy, h, w, t)
    assert gw is None
    assert rel(loss, ref) < 1e-5 and rel(gh, rgh) < 1e-5
    assert len(calls) == 4  # one logits GEMM per chunk (37 = 10+10+10+7), no grad_weight GEMM


def test_grad_output_scales_and_micro_batch_sums_add_up():
    h, w, t = problem(ignored=(5,))
    loss, gh, gw = run(linear_cross_entropy, h, w, t, chunk_size=8)
    h.grad = w.grad = None
    (3.0 * linear_cross_entropy(h, w, t, chunk_size=8)).backward()
    assert rel(h.grad, 3 * gh) < 1e-6 and rel(w.grad, 3 * gw) < 1e-6
    # two micro-batches: sums add up to the whole batch's sum
    a = linear_cross_entropy(h[:20], w, t[:20], chunk_size=8)
    b = linear_cross_entropy(h[20:], w, t[20:], chunk_size=8)
    assert rel(a + b, loss) < 1e-6


def test_mean_reduction_and_no_grad():
    h, w, t = problem(ignored=(1, 2))
    loss, gh, gw = run(linear_cross_entropy, h, w, t, chunk_size=8, reduction="mean")
    ref, rgh, rgw = run(reference_linear_cross_entropy, h, w, t, reduction="mean")
    assert rel(loss, ref) < 1e-5 and rel(gh, rgh) < 1e-5 and rel(gw, rgw) < 1e-5
    with torch.no_grad():
        assert rel(linear_cross_entropy(h, w, t, chunk_size=8), reference_linear_cross_entropy(h, w, t)) < 1e-5


def test_bad_arguments_are_value_errors():
    h, w, t = problem()
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(h, w, t, reduction="none")
    with pytest.raises(ValueError, match="targets"):
        linear_cross_entropy(h, w, t[:-1])
    with pytest.raises(ValueError, match="dtype"):
        linear_cross_entropy(h, w.double(), t)


def test_functional_step_equals_eager_step():
    """The torch.compile variant's function, run eagerly, gives the in-place step's loss and gradient."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(13, 50, generator=g) * 4
    t = torch.randint(0, 50, (13,), generator=g)
    t[[0, 7]] = -100
    l1, g1 = loss_mod._step_functional(logits.clone(), t, -100, torch.float32)
    l2, g2 = loss_mod._step_eager(logits.clone(), t, -100, torch.float32)
    assert rel(l1, l2) < 1e-6 and rel(g1, g2) < 1e-6
    assert torch.count_nonzero(g1[[0, 7]]) == 0
    assert g1.sum(1).abs().max() < 1e-5  # rows of softmax - onehot sum to 0 (valid rows) or are 0


def test_bf16_on_cpu_is_close():
    h, w, t = problem(N=64, D=32, V=100, ignored=(0,), dtype=torch.bfloat16)
    loss, gh, gw = run(linear_cross_entropy, h, w, t, chunk_size=16)
    ref, rgh, rgw = run(reference_linear_cross_entropy, h, w, t)
    assert gh.dtype == torch.bfloat16 and gw.dtype == torch.bfloat16
    assert rel(loss, ref) < 1e-2 and rel(gh, rgh) < 2e-2 and rel(gw, rgw) < 2e-2


@pytest.mark.slow  # torch.compile on the CPU: about 30 s
def test_compiled_matches_reference_cpu():
    h, w, t = problem(ignored=(3, 9))
    loss, gh, gw = run(linear_cross_entropy, h, w, t, chunk_size=8, compiled=True)
    ref, rgh, rgw = run(reference_linear_cross_entropy, h, w, t)
    assert rel(loss, ref) < 1e-5 and rel(gh, rgh) < 1e-5 and rel(gw, rgw) < 1e-5


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("train_weight", [False, True])
def test_cuda_bf16_matches_reference(compiled, train_weight):
    # 2085 tokens: 1024 + 1024 + 37, so the last chunk is short; a vocabulary that is not a power of two
    h, w, t = problem(N=2085, D=512, V=50257, ignored=range(100, 400), device="cuda", dtype=torch.bfloat16,
                      train_weight=train_weight, seed=3)
    loss, gh, gw = run(linear_cross_entropy, h, w, t, chunk_size=1024, compiled=compiled)
    ref, rgh, rgw = run(reference_linear_cross_entropy, h, w, t)
    assert torch.isfinite(loss) and torch.isfinite(gh).all()
    assert rel(loss, ref) < 1e-4
    assert rel(gh, rgh) < 1e-2
    assert torch.count_nonzero(gh[100:400]) == 0
    if train_weight:
        assert gw.dtype == torch.bfloat16 and rel(gw, rgw) < 1e-2
    else:
        assert gw is None
