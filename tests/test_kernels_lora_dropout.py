"""LoRA dropout fused in Triton (gapless.kernels.lora_dropout) against the reference formula under the mask the kernel
drew, and the torch path it leaves everywhere else.

Three tiers:
- CPU, always: without CUDA the LoRA paths keep torch's dropout exactly, and a compiled decoder layer with dropout has
  no graph break.
- Triton's interpreter (TRITON_INTERPRET=1), where triton imports: the kernels on CPU tensors in float32 (the
  `interpreted` fixture reloads gapless.kernels.lora_dropout_triton under the interpreter). Skipped without triton.
- CUDA (`pytest -m gpu`): the compiled kernels in bf16, inside torch.compile with fullgraph (a graph break fails).

The mask the kernels drew is materialised by keep_mask below, a kernel that calls the package's keep_block (the one
rule both kernels use) over blocks of other sizes than theirs, so its agreement also checks that a mask does not
depend on the tiling. Tolerances: float32 under the interpreter sums in another order than torch (dA over splits of
N), ~1e-6 relative; asked 1e-5 of each element plus 1e-5 of the tensor's largest (dA's sums of ~100 terms of ~20
cancel to ~0.5 in places, where 1e-5 of the element alone is below float32's rounding of the terms). bf16 against
the float32 formula as in tests/test_kernels_lora.py: ~3e-3, bound 1e-2.
"""
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import gapless.kernels.lora
from gapless.kernels import lora_dropout
from gapless.kernels.lora import lora_linear_grouped, lora_linear_reference
from gapless.kernels.lora_dropout import FUSED_DROPOUT, FusedDropout, fused_dropout_applies, keep_threshold

triton_only = pytest.mark.skipif(not FUSED_DROPOUT, reason="needs triton and torch.library.triton_op (torch >= 2.6)")
cuda = pytest.mark.skipif(not (torch.cuda.is_available() and FUSED_DROPOUT), reason="needs CUDA and triton")
TOL = dict(atol=1e-5, rtol=1e-5)
P = 0.3


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def lora_group(n: int, k: int, ranks, outs, dtype=torch.float32, device="cpu", seed=0):
    """x [n, k], per layer W [o, k], b [o], A [r, k] and B [o, r] (float32 masters), and output gradients."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g)
    ws = [torch.randn(o, k, generator=g) / k ** 0.5 for o in outs]
    bs = [torch.randn(o, generator=g) for o in outs]
    a_s = [torch.randn(r, k, generator=g) / k ** 0.5 for r in ranks]
    b_s = [torch.randn(o, r, generator=g) / r ** 0.5 for o, r in zip(outs, ranks)]
    dys = [torch.randn(n, o, generator=g) for o in outs]
    to = dict(device=device, dtype=dtype)
    return (x.to(**to), [w.to(**to) for w in ws], [b.to(**to) for b in bs], [a.to(device) for a in a_s],
            [b.to(device) for b in b_s], [dy.to(**to) for dy in dys])


def run_group(fn, x, ws, bs, a_s, b_s, dys, dropout):
    """fn (lora_linear_grouped's signature) forward and backward: outputs, dx, dA, dB."""
    x = x.clone().requires_grad_()
    a_s = [a.clone().requires_grad_() for a in a_s]
    b_s = [b.clone().requires_grad_() for b in b_s]
    ys = fn(x, ws, bs, a_s, b_s, [2.0] * len(ws), dropout=dropout)
    torch.autograd.backward(ys, dys)
    return [*ys, x.grad, *(a.grad for a in a_s), *(b.grad for b in b_s)]


def per_layer(x, ws, bs, a_s, b_s, scalings, dropout):
    return [lora_linear_reference(x, *args, dropout=dropout) for args in zip(ws, bs, a_s, b_s, scalings)]


# ---------------------------------------------------------------------------------------------
# CPU, always: the torch path


def test_fused_path_applies_only_to_a_training_fused_dropout_on_cuda():
    """CPU tensors, eval mode, p = 0 (nn.Identity), a plain nn.Dropout (lora.fused_dropout: false) and other callables
    keep torch's dropout; on CUDA with triton a FusedDropout in training runs fused."""
    x = torch.zeros(2, 8)
    assert not fused_dropout_applies(x, FusedDropout(P).train())
    assert not fused_dropout_applies(x, nn.Identity())
    if FUSED_DROPOUT and torch.cuda.is_available():
        xc = x.cuda()
        assert fused_dropout_applies(xc, FusedDropout(P).train())
        assert not fused_dropout_applies(xc, FusedDropout(P).eval())
        assert not fused_dropout_applies(xc, nn.Dropout(P).train())
        assert not fused_dropout_applies(xc, nn.Identity())
        assert not fused_dropout_applies(xc, lambda t: t)


@pytest.mark.parametrize("fused", [True, False])
def test_lora_config_picks_the_dropout_module(fused):
    """lora.fused_dropout decides which dropout each LoRA layer holds."""
    from gapless.config import LoraConfig
    from gapless.model.decoder import CausalLM, ModelArgs
    from gapless.model.lora import LoraLinear, apply_lora

    args = ModelArgs(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = apply_lora(CausalLM(args), LoraConfig(r=4, dropout=0.1, fused_dropout=fused))
    drops = {type(m.lora_dropout) for m in model.modules() if isinstance(m, LoraLinear)}
    assert drops == ({FusedDropout} if fused else {nn.Dropout})


@pytest.mark.parametrize("training", [True, False])
def test_cpu_keeps_torchs_dropout(training):
    """On the CPU an nn.Dropout runs as torch's dropout, exactly as before the fused path: the grouped and the
    per-layer paths equal the formula under the mask torch draws from the same generator state (one mask per
    group; one per layer for the per-layer path), forward and backward; in eval no mask at all."""
    x, ws, bs, a_s, b_s, dys = lora_group(13, 24, ranks=(4, 3, 4), outs=(24, 8, 8))
    drop = nn.Dropout(P).train(training)
    torch.manual_seed(5)
    got = run_group(lora_linear_grouped, x, ws, bs, a_s, b_s, dys, drop)
    torch.manual_seed(5)
    mask = drop(x) != 0  # the group's one mask, drawn from the same generator state
    assert mask.all() != training
    scale = 1 / (1 - P) if training else 1.0
    want = run_group(per_layer, x, ws, bs, a_s, b_s, dys, lambda t: t * mask * scale)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_close(g, w, **TOL, msg=lambda m: f"output {i}: {m}")
    torch.manual_seed(5)
    single = lora_linear_reference(x, ws[0], bs[0], a_s[0], b_s[0], 2.0, dropout=drop)
    assert_close(single, want[0], **TOL)  # the per-layer path draws the same first mask


def compiled_lora_step(device: str, dtype: torch.dtype) -> tuple[dict, int]:
    """A tiny decoder with grouped LoRA and dropout 0.1, compiled per layer, one forward and backward in training:
    (dynamo's graph_break counter, calls of the fused path while tracing)."""
    from torch._dynamo.utils import counters

    from gapless.config import LoraConfig
    from gapless.model.decoder import CausalLM, ModelArgs
    from gapless.model.lora import apply_lora
    from gapless.train.compile import compile_layers

    args = ModelArgs(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch._dynamo.reset()
    counters.clear()
    model = apply_lora(CausalLM(args).to(device, dtype), LoraConfig(r=4, dropout=0.1, kernel="grouped"))
    model = compile_layers(model).train()
    model(torch.randint(0, 64, (1, 24), device=device)).float().sum().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_A" in n)
    return dict(counters["graph_break"]), counters["stats"]["unique_graphs"]


def test_compiled_layer_with_dropout_has_no_graph_break_on_cpu():
    """The torch path under torch.compile: no graph break (the CUDA test below checks the fused path)."""
    breaks, graphs = compiled_lora_step("cpu", torch.float32)
    assert breaks == {} and graphs >= 1, breaks


# ---------------------------------------------------------------------------------------------
# The kernels: the mask they drew, materialised; the interpreter on the CPU, or CUDA


if FUSED_DROPOUT:
    import triton
    import triton.language as tl

    from gapless.kernels import lora_dropout_triton as kernels

    @triton.jit
    def keep_mask_kernel(out_ptr, seed_ptr, N, K, threshold, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                         N_ROUNDS: tl.constexpr):
        """The keep mask [N, K] (int8) of a seed: keep_block over 16 x 32 blocks (the fused kernels use 64 x 64)."""
        rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        k0 = tl.program_id(1) * BLOCK_K
        cols = k0 + tl.arange(0, BLOCK_K)
        keep = kernels.keep_block(tl.load(seed_ptr), rows, k0, tl.cdiv(K, 8), threshold, BLOCK_M, BLOCK_K,
                                  N_ROUNDS)
        tl.store(out_ptr + rows[:, None] * K + cols[None, :], keep.to(tl.int8),
                 mask=(rows[:, None] < N) & (cols[None, :] < K))


def keep_mask(seed: torch.Tensor, n: int, k: int, p: float) -> torch.Tensor:
    """The mask [n, k] (bool) the fused kernels draw from `seed` [1] at dropout p, on the seed's device."""
    out = torch.empty(n, k, dtype=torch.int8, device=seed.device)
    keep_mask_kernel[(math.ceil(n / 16), math.ceil(k / 32))](out, seed, n, k, keep_threshold(p), BLOCK_M=16,
                                                             BLOCK_K=32, N_ROUNDS=kernels.PHILOX_ROUNDS)
    return out.bool()


INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
# a kernel that loops over an argument, as the fused kernels do, under the interpreter on the CPU
INTERPRETER_PROBE = """
import torch, triton, triton.language as tl
@triton.jit
def loop(out_ptr, n):
    acc = 0
    for i in range(0, n, 1):
        acc += i
    tl.store(out_ptr, acc)
out = torch.zeros(1, dtype=torch.int32)
loop[(1,)](out, 4)
assert int(out) == 6, out
"""


@pytest.fixture
def interpreted():
    """The kernels under Triton's interpreter on CPU tensors; yields the mask function. Triton reads
    TRITON_INTERPRET when it decorates a kernel, its own tl.randint4x included, and torch._dynamo imports triton, so
    the variable must be set when the process starts: test_kernels_under_the_interpreter runs these tests so."""
    if not (FUSED_DROPOUT and INTERPRETING):
        pytest.skip("needs triton and TRITON_INTERPRET=1 at start-up (test_kernels_under_the_interpreter sets it)")
    return keep_mask


@pytest.mark.skipif(not FUSED_DROPOUT or INTERPRETING, reason="needs triton; under the interpreter already")
def test_kernels_under_the_interpreter():
    """The interpreter tests below, in a fresh process with TRITON_INTERPRET=1 (the `interpreted` fixture says why)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    # triton 3.6's interpreter takes a kernel argument as a 1-element array and int()s it for range(), which numpy
    # 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars"); triton 3.9's squeezes it first
    probe = subprocess.run([sys.executable, "-c", INTERPRETER_PROBE], env=env, capture_output=True, text=True,
                           timeout=300)
    if "only 0-dimensional arrays" in probe.stderr:
        import numpy

        pytest.skip(f"triton {triton.__version__}'s interpreter cannot loop over a kernel argument with numpy "
                    f"{numpy.__version__} (int() of a 1-element array); the compiled kernels are unaffected")
    assert probe.returncode == 0, probe.stderr[-2000:]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                           "interpreted"], env=env, capture_output=True, text=True, timeout=900)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-2000:]
    assert done.returncode == 0 and "skipped" not in summary, done.stdout[-5000:] + done.stderr[-2000:]
    print(summary)


@pytest.fixture(scope="module")
def on_cuda():
    """The compiled kernels on CUDA; yields the mask function."""
    return keep_mask


def fused_on(monkeypatch, device: str, seed: int) -> torch.Tensor:
    """Make the LoRA paths run fused on `device` (on the CPU only under the interpreter) with a fixed seed; returns
    the seed tensor."""
    seed_t = torch.full((1,), seed, dtype=torch.int64, device=device)
    monkeypatch.setattr(lora_dropout, "draw_seed", lambda dev: seed_t.clone())
    if device == "cpu":
        monkeypatch.setattr(gapless.kernels.lora, "fused_dropout_applies",
                            lambda x, d: isinstance(d, nn.Dropout) and d.training and d.p > 0)
    return seed_t


# (N, in, ranks, outs): neither N nor in a multiple of the 64 x 64 blocks, in not a multiple of 8 (a draw's 8
# columns cross into the next row's counter range), one layer alone (o_proj/down_proj's path), a rank-1 layer
SHAPES = [(100, 200, (4, 8, 5), (200, 40, 40)), (70, 203, (3,), (50,)), (130, 72, (1, 16), (72, 24))]


@triton_only
@pytest.mark.parametrize("n, k, ranks, outs", SHAPES)
def test_interpreted_fused_equals_formula_under_its_mask(interpreted, monkeypatch, n, k, ranks, outs):
    """float32 on the CPU: every output, dx, dA and dB of the fused path equal the per-layer reference formula with
    dropout(x) = mask * x / (1 - p), the mask materialised from the same seed."""
    seed = fused_on(monkeypatch, "cpu", 1234)
    x, ws, bs, a_s, b_s, dys = lora_group(n, k, ranks, outs)
    drop = FusedDropout(P).train()
    fn = lora_linear_grouped if len(ranks) > 1 else per_layer
    got = run_group(fn, x, ws, bs, a_s, b_s, dys, drop)
    mask = interpreted(seed, n, k, P)
    want = run_group(per_layer, x, ws, bs, a_s, b_s, dys, lambda t: t * mask / (1 - P))
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype, i  # dA and dB in the masters' float32
        assert_close(g, w, rtol=1e-5, atol=1e-5 * w.abs().max().item(), msg=lambda m: f"output {i}: {m}")


@triton_only
@pytest.mark.parametrize("n, k, split_k, splits", [(100, 200, 3, 2), (70, 203, 4, 4), (130, 72, 8, 2)])
def test_interpreted_forward_split_k_equals_one_split(interpreted, monkeypatch, n, k, split_k, splits):
    """The forward with `in` split (FWD_SPLIT_K; `splits` is what 64-column blocks allow): the same xa as unsplit,
    up to the float32 sum's order, and the same gradients (the backward does not split)."""
    x, _, _, a_s, _, _ = lora_group(n, k, (4, 8), (8, 8))
    a = torch.cat(a_s)
    seed = torch.tensor([11])
    got = {}
    for s in (1, split_k):
        monkeypatch.setattr(lora_dropout, "FWD_SPLIT_K", s)
        assert lora_dropout._forward_splits(k, lora_dropout.FWD_BLOCK_K, s)[0] == (1 if s == 1 else splits)
        xx, aa = x.clone().requires_grad_(), a.clone().requires_grad_()
        out = torch.ops.gapless.lora_dropout_xa(xx, aa, seed, P)
        out.pow(2).sum().backward()
        got[s] = (out, xx.grad, aa.grad)
    for g, w in zip(got[split_k], got[1]):
        assert_close(g, w, rtol=1e-5, atol=1e-5 * w.abs().max().item())


@triton_only
def test_interpreted_input_without_gradient(interpreted):
    """x needing no gradient (layer 0's input): the backward skips dx, dA is unchanged."""
    x, _, _, (a,), _, _ = lora_group(90, 136, (6,), (8,))
    seed = torch.tensor([7])
    grads = []
    for needs in (True, False):
        xx = x.clone().requires_grad_(needs)
        aa = a.clone().requires_grad_()
        torch.ops.gapless.lora_dropout_xa(xx, aa, seed, P).sum().backward()
        grads.append(aa.grad)
    assert_close(grads[0], grads[1], atol=0, rtol=0)


@triton_only
def test_interpreted_mask_statistics(interpreted):
    """The keep fraction is 1 - p (within 5 standard deviations over 60,000 elements); a seed gives the same mask
    every time and different seeds different masks; the forward kernel applies exactly that mask."""
    n, k = 300, 200
    masks = {s: interpreted(torch.tensor([s]), n, k, P) for s in (1, 2)}
    sd = math.sqrt(P * (1 - P) / (n * k))
    for mask in masks.values():
        assert abs(mask.float().mean().item() - (1 - P)) < 5 * sd
    assert torch.equal(masks[1], interpreted(torch.tensor([1]), n, k, P))
    assert (masks[1] != masks[2]).float().mean() > 0.3  # 2 p (1 - p) = 0.42 of elements differ between seeds
    # the forward kernel's own mask, read through an identity: x = 1, A picking one column at a time per row block
    picks = torch.eye(k)[:64]  # [64, k]: rows 0..63 pick columns 0..63
    got = torch.ops.gapless.lora_dropout_xa(torch.ones(n, k), picks, torch.tensor([1]), P)  # [n, 64]
    assert torch.equal(got != 0, masks[1][:, :64])
    assert_close(got[got != 0], torch.full_like(got[got != 0], 1 / (1 - P)))


# ---------------------------------------------------------------------------------------------
# CUDA: the compiled kernels in bf16, inside torch.compile


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("n, k, ranks, outs", [
    (2000, 3072, (16, 16, 16), (3072, 1024, 1024)),  # Llama-3.2-3B's q/k/v, N not a multiple of 64
    (1000, 8192, (16,), (3072,)),  # its down_proj, alone
    (130, 72, (1, 16), (72, 24)),
])
def test_cuda_bf16_compiled_fused_equals_formula(on_cuda, monkeypatch, n, k, ranks, outs):
    """bf16 on CUDA inside torch.compile(fullgraph=True) (a graph break fails): every output and gradient against
    the float32 reference formula under the mask drawn from the same seed; bound 1e-2."""
    seed = fused_on(monkeypatch, "cuda", 99)
    x, ws, bs, a_s, b_s, dys = lora_group(n, k, ranks, outs, dtype=torch.bfloat16, device="cuda")
    fn = lora_linear_grouped if len(ranks) > 1 else per_layer
    torch._dynamo.reset()
    got = run_group(torch.compile(fn, fullgraph=True), x, ws, bs, a_s, b_s, dys, FusedDropout(P).train())
    mask = on_cuda(seed, n, k, P)
    want = run_group(per_layer, x.float(), [w.float() for w in ws], [b.float() for b in bs], a_s, b_s,
                     [dy.float() for dy in dys], lambda t: t * mask / (1 - P))
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.isfinite(g).all(), i
        assert rel(g, w) < 1e-2, (i, rel(g, w))


@pytest.mark.gpu
@cuda
def test_cuda_mask_statistics(on_cuda):
    """The keep fraction is 1 - p over 16M elements (5 standard deviations: 6e-4); seeds as on the CPU."""
    n, k, p = 4096, 4096, 0.05
    a, b = (on_cuda(torch.tensor([s], device="cuda"), n, k, p) for s in (3, 4))
    assert abs(a.float().mean().item() - (1 - p)) < 5 * math.sqrt(p * (1 - p) / (n * k))
    assert torch.equal(a, on_cuda(torch.tensor([3], device="cuda"), n, k, p)) and not torch.equal(a, b)


@pytest.mark.gpu
@cuda
def test_cuda_compiled_layer_runs_fused_without_graph_break(monkeypatch):
    """compile_layers on a bf16 CUDA decoder with LoRA dropout: no graph break, and the fused path is what runs."""
    calls = []
    real = gapless.kernels.lora.lora_dropout_a
    monkeypatch.setattr(gapless.kernels.lora, "lora_dropout_a", lambda *a: calls.append(1) or real(*a))
    breaks, graphs = compiled_lora_step("cuda", torch.bfloat16)
    assert breaks == {} and graphs >= 1, breaks
    assert calls  # traced: the grouped q/k/v and gate/up, o_proj and down_proj
