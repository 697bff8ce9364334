"""The kernels' Gemma parts: attention soft-capping and windows in every backend that takes them, refusals naming
the backend that does, `auto`'s choice, and the fused loss with final-logit soft-capping (forward and gradient)
against the materialised float32 reference.

Tolerances: float32 on the CPU, as tests/test_kernels_attention.py and tests/test_kernels_loss.py state them
(1e-5 relative); bf16 on CUDA (marked gpu) as there: 1e-2 for outputs, 2e-2 for attention gradients.
"""
import pytest
import torch

from gapless.kernels import attention as attention_mod
from gapless.kernels.attention import FlexAttention, auto_backend, get_attention, op_attention, sdpa_reference
from gapless.kernels.loss import TRITON, linear_cross_entropy, reference_linear_cross_entropy

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
cuda_triton = pytest.mark.skipif(not (torch.cuda.is_available() and TRITON), reason="needs CUDA and triton")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def eager_attention(q, k, v, window, scale, softcap, key_mask=None):
    """transformers' eager_attention_forward for one row set [B, T, H, D]: scores, cap, additive mask, softmax."""
    B, T, Hq, D = q.shape
    k, v = (x.repeat_interleave(Hq // x.shape[2], dim=2) for x in (k, v))
    scores = q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2) * scale  # [B, H, T, T]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    i = torch.arange(T)
    allowed = (i[None, :] <= i[:, None]) & (window is None or (i[:, None] - i[None, :] < (window or 0)))
    allowed = allowed[None, None] & (True if key_mask is None else key_mask.bool()[:, None, None, :])
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    return (torch.softmax(scores, dim=-1) @ v.transpose(1, 2)).transpose(1, 2)


def rows(B=2, T=24, Hq=4, Hkv=2, D=16, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    # scaled up so that the scores reach well past the caps below: soft-capping changes the result
    return [torch.randn(B, T, h, D, generator=g) * scale ** 0.5 for h in (Hq, Hkv, Hkv)]


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_sdpa_reference_is_transformers_eager(window, softcap):
    q, k, v = rows()
    scale = 24 ** -0.5  # query_pre_attn_scalar 24, not head_dim 16
    expected = eager_attention(q, k, v, window, scale, softcap)
    assert_rel(sdpa_reference(q, k, v, sliding_window=window, scale=scale, softcap=softcap), expected)
    # packed: two documents of 10 and 14 tokens in one row, each as its own sequence
    cu = torch.tensor([0, 10, 24], dtype=torch.int32)
    packed = sdpa_reference(q[:1], k[:1], v[:1], cu_seqlens=cu, max_seqlen=14, sliding_window=window, scale=scale,
                            softcap=softcap)
    for s, e in ((0, 10), (10, 24)):
        alone = eager_attention(q[:1, s:e], k[:1, s:e], v[:1, s:e], window, scale, softcap)
        assert_rel(packed[:, s:e], alone)
    # padded: the second row's last 9 keys are padding; real queries match
    key_mask = torch.ones(2, 24, dtype=torch.long)
    key_mask[1, 15:] = 0
    padded = sdpa_reference(q, k, v, attention_mask=key_mask, sliding_window=window, scale=scale, softcap=softcap)
    assert_rel(padded[1, :15], eager_attention(q, k, v, window, scale, softcap, key_mask)[1, :15])
    if softcap is not None:  # the cap matters on these scores
        assert rel(sdpa_reference(q, k, v, sliding_window=window, scale=scale), expected) > 1e-2


def assert_rel(a, b, tol=1e-5):
    assert rel(a, b) < tol, rel(a, b)


@pytest.mark.parametrize("window", [None, 5])
def test_flex_softcap_forward_matches_reference_cpu(window):
    q, k, v = rows(B=1, T=32)
    cu = torch.tensor([0, 9, 32], dtype=torch.int32)
    kw = dict(cu_seqlens=cu, max_seqlen=23, sliding_window=window, scale=0.2, softcap=2.0)
    assert_rel(FlexAttention(compiled=False)(q, k, v, **kw), sdpa_reference(q, k, v, **kw))


def test_flex_keeps_one_block_mask_per_window():
    """Gemma's layers alternate window 4 and none: each batch builds two masks, not one per layer."""
    flex = FlexAttention(compiled=False)
    cu, dev = torch.tensor([0, 3, 16], dtype=torch.int32), torch.device("cpu")
    windowed, full = flex.block_mask(cu, 1, 16, 4, dev), flex.block_mask(cu, 1, 16, None, dev)
    assert windowed is not full
    assert flex.block_mask(cu, 1, 16, 4, dev) is windowed and flex.block_mask(cu, 1, 16, None, dev) is full


def test_backends_without_softcap_refuse_it_naming_flex(monkeypatch):
    q, k, v = rows(B=1, T=8)
    refusals = [op_attention("ref_op", lambda *a: None)]
    try:
        refusals.append(get_attention("varlen"))  # its import works on the CPU; the check comes before CUDA's
    except RuntimeError:
        pass
    for fn in refusals:
        with pytest.raises(RuntimeError, match="cannot soft-cap.*'flex'"):
            fn(q, k, v, cu_seqlens=torch.tensor([0, 8], dtype=torch.int32), max_seqlen=8, softcap=2.0,
               **({"scale": 0.1} if fn is refusals[0] else {}))


def test_auto_picks_flex_for_softcapping_models(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(attention_mod, "_varlen_backend", lambda: None)
    gpu = torch.device("cuda")
    assert auto_backend(gpu, torch.bfloat16, packed=True) == "varlen"
    assert auto_backend(gpu, torch.bfloat16, packed=True, softcap=True) == "flex"
    assert auto_backend(torch.device("cpu"), torch.float32, packed=True, softcap=True) == "sdpa"


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("name, window, softcap", [("flex", 64, 50.0), ("flex", None, 50.0), ("varlen", 64, None)])
@pytest.mark.parametrize("head_dim", [64, 256])
def test_gemma_attention_on_cuda_bf16(name, window, softcap, head_dim):
    """Gemma 2's layers (window 4096 scaled down to 64, cap 50) through flex, Gemma 3's sliding layers through
    varlen, forward and backward against the float32 reference, head_dim 256 as Gemma's and 64 as the model-level
    GPU tests' (tests/test_gemma.py)."""
    g = torch.Generator().manual_seed(1)
    cu = torch.tensor([0, 700, 737, 1024, 1029, 2048], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(2, 1024, h, head_dim, generator=g).mul(2).to("cuda", torch.bfloat16).requires_grad_()
               for h in (8, 4, 4))
    kw = dict(cu_seqlens=cu, max_seqlen=1019, sliding_window=window, scale=head_dim ** -0.5,
              **({} if softcap is None else {"softcap": softcap}))
    dout = torch.randn_like(q)
    out = get_attention(name)(q, k, v, **kw)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = sdpa_reference(qf, kf, vf, **kw)
    ref_grads = torch.autograd.grad(ref, (qf, kf, vf), dout.float())
    assert rel(out, ref) < 1e-2
    for a, b in zip(grads, ref_grads):
        assert rel(a, b) < 2e-2


# ---------------------------------------------------------------------------------------------
# the fused loss with final-logit soft-capping


def loss_problem(N=37, D=16, V=50, seed=0, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=g).to(device, dtype).requires_grad_()
    weight = (torch.randn(V, D, generator=g) * 2 / D ** 0.5).to(device, dtype).requires_grad_()  # logits ~ 2
    targets = torch.randint(0, V, (N,), generator=g)
    targets[[3, 4, 30]] = -100
    return hidden, weight, targets.to(device)


def loss_and_grads(fn, hidden, weight, targets, **kw):
    hidden.grad = weight.grad = None
    loss = fn(hidden, weight, targets, **kw)
    loss.backward()
    return loss.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("chunk_size", [1, 8, 4096])
def test_softcapped_loss_matches_reference_fp32(chunk_size):
    h, w, t = loss_problem()
    got = loss_and_grads(linear_cross_entropy, h, w, t, chunk_size=chunk_size, softcap=1.5)
    ref = loss_and_grads(reference_linear_cross_entropy, h, w, t, softcap=1.5)
    for a, b in zip(got, ref):
        assert_rel(a, b)
    # the reference is the cap transformers applies before its cross-entropy
    logits = h.detach() @ w.detach().t()
    hf = torch.nn.functional.cross_entropy(torch.tanh(logits / 1.5) * 1.5, t, reduction="sum")
    assert_rel(got[0], hf)
    uncapped = loss_and_grads(linear_cross_entropy, h, w, t, chunk_size=chunk_size)
    assert rel(uncapped[0], got[0]) > 1e-2 and rel(uncapped[1], got[1]) > 1e-2
    with torch.no_grad():  # the forward-only path caps too
        assert_rel(linear_cross_entropy(h, w, t, chunk_size=chunk_size, softcap=1.5), got[0])


@pytest.mark.slow  # torch.compile on the CPU
def test_softcapped_loss_compiled_matches_reference_cpu():
    h, w, t = loss_problem()
    got = loss_and_grads(linear_cross_entropy, h, w, t, chunk_size=8, softcap=1.5, step="compiled")
    ref = loss_and_grads(reference_linear_cross_entropy, h, w, t, softcap=1.5)
    for a, b in zip(got, ref):
        assert_rel(a, b)


def test_softcap_must_be_positive():
    h, w, t = loss_problem()
    with pytest.raises(ValueError, match="softcap must be a positive number"):
        linear_cross_entropy(h, w, t, softcap=0.0)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("step", ["eager", "compiled", pytest.param("triton", marks=cuda_triton)])
def test_softcapped_loss_cuda_bf16(step):
    h, w, t = loss_problem(N=2085, D=512, V=50257, device="cuda", dtype=torch.bfloat16, seed=3)
    got = loss_and_grads(linear_cross_entropy, h, w, t, chunk_size=1024, softcap=30.0, step=step)
    ref = loss_and_grads(reference_linear_cross_entropy, h, w, t, softcap=30.0)
    assert rel(got[0], ref[0]) < 1e-4 and rel(got[1], ref[1]) < 1e-2 and rel(got[2], ref[2]) < 1e-2
