"""linear_cross_entropy against the materialised float32 reference, forward and backward, and its per-chunk steps
against each other.

Tolerances: float32 on the CPU lands near 1e-7 relative (chunked logsumexp vs F.cross_entropy); the tests
ask for 1e-5. bf16 on CUDA: the loss keeps fp32 logits (1e-4), the gradients go through bf16 softmax - onehot
and a bf16 GEMM output (2^-8 relative rounding twice: 1e-2). The Triton step against _step_functional on the same
float32 logits: the loss within 1e-5 relative (an online logsumexp and the GPU's approximate exp and log, ~1e-7);
the float32 gradient within 1e-5 relative per element plus 1e-6 absolute (softmax entries are ~1/V, and with
softcap 30 the factor 1 - tanh^2 of a saturated logit carries tanh's ~1e-7 absolute error); in bf16, one rounding
step apart at most where the float32 values straddle a rounding boundary: 2^-7 relative.
"""
import pytest
import torch
from torch.testing import assert_close

from gapless.kernels import loss as loss_mod
from gapless.kernels.loss import linear_cross_entropy, reference_linear_cross_entropy, resolve_step

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
cuda_triton = pytest.mark.skipif(not (torch.cuda.is_available() and loss_mod.TRITON), reason="needs CUDA and triton")
CPU, GPU = torch.device("cpu"), torch.device("cuda")


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
    loss, gh, gw = run(linear_cross_entropy, h, w, t, chunk_size=8, step="compiled")
    ref, rgh, rgw = run(reference_linear_cross_entropy, h, w, t)
    assert rel(loss, ref) < 1e-5 and rel(gh, rgh) < 1e-5 and rel(gw, rgw) < 1e-5


def test_step_names_and_auto():
    """auto is the Triton kernel on CUDA where triton imports, torch.compile anywhere else; a named step runs as
    named; an unknown name is a ValueError naming the choices."""
    assert resolve_step("auto", CPU) == "compiled"
    for step in ("eager", "compiled"):
        assert resolve_step(step, CPU) == step and resolve_step(step, GPU) == step
    assert resolve_step("auto", GPU) == ("triton" if loss_mod.TRITON else "compiled")
    h, w, t = problem()
    with pytest.raises(ValueError, match="step must be one of 'eager', 'compiled', 'triton', 'auto', got 'fast'"):
        linear_cross_entropy(h, w, t, step="fast")


def test_auto_runs_the_compiled_step_on_cpu(monkeypatch):
    """step="auto" on CPU tensors runs _compiled_step's function (here the uncompiled _step_functional, so the test
    needs no inductor build), once per chunk."""
    calls = []

    def spy(*args):
        calls.append(args[0].shape)
        return loss_mod._step_functional(*args)

    monkeypatch.setattr(loss_mod, "_compiled_step", lambda: spy)
    h, w, t = problem(ignored=(3,))
    loss, gh, gw = run(linear_cross_entropy, h, w, t, chunk_size=10, step="auto")
    ref, rgh, rgw = run(reference_linear_cross_entropy, h, w, t)
    assert calls == [(10, 50)] * 3 + [(7, 50)]
    assert rel(loss, ref) < 1e-5 and rel(gh, rgh) < 1e-5 and rel(gw, rgw) < 1e-5


def test_triton_step_where_it_cannot_run_is_a_value_error(monkeypatch):
    h, w, t = problem()
    with pytest.raises(ValueError, match="step 'triton' is a CUDA kernel, but hidden is on cpu"):
        linear_cross_entropy(h, w, t, step="triton")
    monkeypatch.setattr(loss_mod, "TRITON", False)
    with pytest.raises(ValueError, match="step 'triton' needs the triton package"):
        resolve_step("triton", GPU)
    assert resolve_step("auto", GPU) == "compiled"


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("step", ["eager", "compiled", pytest.param("triton", marks=cuda_triton)])
@pytest.mark.parametrize("train_weight", [False, True])
def test_cuda_bf16_matches_reference(step, train_weight):
    # 2085 tokens: 1024 + 1024 + 37, so the last chunk is short; a vocabulary that is not a power of two
    h, w, t = problem(N=2085, D=512, V=50257, ignored=range(100, 400), device="cuda", dtype=torch.bfloat16,
                      train_weight=train_weight, seed=3)
    loss, gh, gw = run(linear_cross_entropy, h, w, t, chunk_size=1024, step=step)
    ref, rgh, rgw = run(reference_linear_cross_entropy, h, w, t)
    assert torch.isfinite(loss) and torch.isfinite(gh).all()
    assert rel(loss, ref) < 1e-4
    assert rel(gh, rgh) < 1e-2
    assert torch.count_nonzero(gh[100:400]) == 0
    if train_weight:
        assert gw.dtype == torch.bfloat16 and rel(gw, rgw) < 1e-2
    else:
        assert gw is None


def chunk_logits(rows: int, V: int, scale: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 logits [rows, V] ~ scale * N(0, 1) and int64 targets [rows] on CUDA: row 0 targets class 0, row 1
    class V - 1, rows 5..19 are ignored (-100), the rest random."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, V, generator=g) * scale
    targets = torch.randint(0, V, (rows,), generator=g)
    targets[0], targets[1] = 0, V - 1
    targets[5:20] = -100
    return logits.cuda(), targets.cuda()


@pytest.mark.gpu
@cuda_triton
@pytest.mark.parametrize("V", [128256, 50257])  # Llama 3's; GPT-2's, odd: rows not 16-byte aligned, a partial block
@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_step_equals_functional_step(V, softcap, dtype):
    """The kernel's loss and gradient against _step_functional (what step "compiled" compiles) on the same logits,
    scaled with softcap so that the cap bends the largest well away from linear (|z| up to ~5.5 * 12 = 66:
    tanh(66 / 30) = 0.976, 1 - tanh^2 = 0.05)."""
    logits, targets = chunk_logits(300, V, scale=12.0 if softcap else 4.0)
    ref_loss, ref_g = loss_mod._step_functional(logits.clone(), targets, -100, dtype, softcap)
    buffer = logits.clone()
    loss, g = loss_mod._step_triton(buffer, targets, -100, dtype, softcap)
    assert loss.dtype == torch.float32 and loss.shape == () and g.dtype == dtype and g.shape == (300, V)
    assert rel(loss, ref_loss) < 1e-5
    if dtype == torch.float32:
        assert g.data_ptr() == buffer.data_ptr()  # written over the logits, as _step_eager does
        assert_close(g, ref_g, rtol=1e-5, atol=1e-6)
    else:
        assert_close(g.float(), ref_g.float(), rtol=2 ** -7, atol=1e-6)
    assert torch.count_nonzero(g[5:20]) == 0  # ignored rows: exactly zero
    # the one-hot entries (rows 0 and 1: classes 0 and V - 1, the first block's first column and the last block's
    # last) are p - 1 < 0, times 1 - tanh^2 > 0 with softcap: the subtraction landed on the target column
    rows = torch.arange(300, device="cuda")[targets != -100]
    assert (g[rows, targets[rows]] < 0).all()


@pytest.mark.gpu
@cuda_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_step_all_ignored_chunk(dtype):
    logits, _ = chunk_logits(64, 50257, scale=4.0)
    targets = torch.full((64,), -100, device="cuda")
    loss, g = loss_mod._step_triton(logits, targets, -100, dtype)
    assert loss.item() == 0.0 and torch.count_nonzero(g) == 0


@pytest.mark.gpu
@cuda_triton
def test_triton_step_past_2_to_31_elements():
    """A chunk of more than 2^31 logits (42,734 x 50,257: 8.6 GB of float32, the gradient written over them): the
    last rows' offsets need int64, and their gradient and loss equal _step_functional's on a copy."""
    V = 50257
    rows = 2 ** 31 // V + 3
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(rows, V, device="cuda", generator=g).mul_(4.0)
    targets = torch.randint(0, V, (rows,), device="cuda", generator=g)
    targets[-2] = -100
    _, tail_g = loss_mod._step_functional(logits[-8:].clone(), targets[-8:], -100, torch.float32)
    ref_loss = sum(loss_mod._chunk_loss(logits[s:s + 4096], targets[s:s + 4096], -100) for s in range(0, rows, 4096))
    loss, grad = loss_mod._step_triton(logits, targets, -100, torch.float32)
    assert_close(grad[-8:], tail_g, rtol=1e-5, atol=1e-6)
    assert torch.count_nonzero(grad[-2]) == 0
    assert rel(loss, ref_loss) < 1e-5
