"""lora_linear (the update fused into the GEMMs, one autograd.Function) against lora_linear_reference.

Tolerances: on the CPU in float32 both compute the same sums in a different order (the update added inside
the GEMM instead of after it), which lands near 1e-7 relative; the tests ask for atol = rtol = 1e-5. bf16 on
CUDA, against the reference run in float32 on the same inputs upcast: each bf16 rounding is 2^-8 relative and
a few of them stack (xa, dy B, the GEMM outputs), so ‖x − ref‖ / ‖ref‖ lands near 3e-3; the bound is 1e-2.
"""
import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import gapless
import gapless.model.lora
from gapless.config import ALL_LINEAR, LoraConfig, RunConfig, from_dict
from gapless.kernels.lora import lora_linear, lora_linear_grouped, lora_linear_reference
from gapless.model.lora import LoraLinear, apply_lora
from gapless.train.compile import compile_layers

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TOL = dict(atol=1e-5, rtol=1e-5)
SCALING = 2.0


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def problem(shape=(3, 7), d_in=24, d_out=40, r=4, bias=True, device="cpu", dtype=torch.float32, seed=0):
    """x [*shape, d_in], frozen weight [d_out, d_in] and bias, float32 lora_a [r, d_in] and lora_b [d_out, r]
    (B not zero, so both adapter gradients are), dy [*shape, d_out]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, d_in, generator=g)
    weight = torch.randn(d_out, d_in, generator=g) / d_in**0.5
    b = torch.randn(d_out, generator=g) if bias else None
    lora_a = torch.randn(r, d_in, generator=g) / d_in**0.5
    lora_b = torch.randn(d_out, r, generator=g) / r**0.5
    dy = torch.randn(*shape, d_out, generator=g)
    to = dict(device=device)
    return (x.to(**to, dtype=dtype), weight.to(**to, dtype=dtype), None if b is None else b.to(**to, dtype=dtype),
            lora_a.to(**to), lora_b.to(**to), dy.to(**to, dtype=dtype))


def run(fn, x, weight, bias, lora_a, lora_b, dy, need_x=True, need_adapter=True):
    """fn's output and the gradients (dx, dA, dB) of sum(out * dy); None where not asked for."""
    x, lora_a, lora_b = (t.detach().clone().requires_grad_(need) for t, need in
                         ((x, need_x), (lora_a, need_adapter), (lora_b, need_adapter)))
    out = fn(x, weight, bias, lora_a, lora_b, SCALING)
    out.backward(dy)
    return out.detach(), x.grad, lora_a.grad, lora_b.grad


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("need_x, need_adapter", [(True, True), (False, True), (True, False)])
def test_matches_reference_fp32(bias, need_x, need_adapter):
    """3-D x; dx skipped when x needs no gradient (layer 0's q/k/v input), dA and dB when the adapter is frozen."""
    args = problem(bias=bias)
    fused = run(lora_linear, *args, need_x=need_x, need_adapter=need_adapter)
    ref = run(lora_linear_reference, *args, need_x=need_x, need_adapter=need_adapter)
    assert fused[0].shape == (3, 7, 40)
    for name, got, want in zip(("out", "dx", "dA", "dB"), fused, ref):
        if want is None:
            assert got is None, name
        else:
            assert_close(got, want, **TOL, msg=lambda m: f"{name}: {m}")


def test_mixed_precision_dtypes():
    """bf16 activations and base weight, float32 adapter: out and dx in bf16, dA and dB in float32."""
    x, w, b, a, bb, dy = problem(dtype=torch.bfloat16)
    out, dx, da, db = run(lora_linear, x, w, b, a, bb, dy)
    assert (out.dtype, dx.dtype, da.dtype, db.dtype) == (torch.bfloat16, torch.bfloat16, torch.float32, torch.float32)
    ref = run(lora_linear_reference, x, w, b, a, bb, dy)
    for got, want in zip((out, dx, da, db), ref):
        assert rel(got, want) < 1e-2


def test_refuses_a_trainable_base_weight():
    x, w, b, a, bb, _ = problem()
    with pytest.raises(ValueError, match="frozen"):
        lora_linear(x, w.requires_grad_(), b, a, bb, SCALING)


# ---------------------------------------------------------------------------------------------
# LoraLinear on a tiny model: kernel "fused" against "reference"


def tiny_lora_model(folder, kernel: str, dropout: float = 0.0):
    """The tiny checkpoint with LoRA on every projection, A and B seeded (B off zero, so A gets gradients)."""
    model = gapless.load_model(folder)
    apply_lora(model, LoraConfig(r=4, alpha=8, dropout=dropout, kernel=kernel))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model.train()


def loss_and_grads(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids, targets = torch.randint(0, 96, (2, 2, 10), generator=g)
    loss = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads


def assert_same_training_step(model, reference):
    loss, grads = loss_and_grads(model)
    ref_loss, ref_grads = loss_and_grads(reference)
    assert_close(loss, ref_loss, **TOL)
    assert grads.keys() == ref_grads.keys() and len(grads) == 2 * 7 * len(model.model.layers)
    for name in grads:
        assert_close(grads[name], ref_grads[name], **TOL, msg=lambda m: f"{name}: {m}")


def test_lora_linear_kernels_agree_on_a_tiny_model(hf_checkpoint):
    _, folder = hf_checkpoint("llama", attention_bias=True, mlp_bias=True)  # biases: the addmm path too
    fused, reference = tiny_lora_model(folder, "fused"), tiny_lora_model(folder, "reference")
    q = fused.model.layers[0].self_attn.q_proj
    assert isinstance(q, LoraLinear) and q.kernel == "fused" and q.bias is not None
    assert_same_training_step(fused, reference)


@pytest.mark.parametrize("targets", [None, ["q_proj", "v_proj", "o_proj", "up_proj"], ["k_proj", "v_proj"]])
def test_grouped_kernel_agrees_on_a_tiny_model(hf_checkpoint, monkeypatch, targets):
    """kernel "grouped": the reference's loss and gradients, with one A matmul per group of layers that read the
    same input: q/k/v and gate/up on every layer (2 groups), or q/v (k/v) alone when the others carry no LoRA."""
    _, folder = hf_checkpoint("llama", attention_bias=True, mlp_bias=True)
    models = {}
    for kernel in ("grouped", "reference"):
        models[kernel] = model = gapless.load_model(folder)
        apply_lora(model, LoraConfig(r=4, alpha=8, kernel=kernel, target_modules=targets or list(ALL_LINEAR)))
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    sizes = []
    real = gapless.model.lora.lora_linear_grouped
    monkeypatch.setattr(gapless.model.lora, "lora_linear_grouped",
                        lambda x, *args: sizes.append(len(args[0])) or real(x, *args))
    loss, grads = loss_and_grads(models["grouped"])
    ref_loss, ref_grads = loss_and_grads(models["reference"])
    layers = len(models["grouped"].model.layers)
    assert sizes == ([3, 2] if targets is None else [2]) * layers
    assert_close(loss, ref_loss, **TOL)
    assert grads.keys() == ref_grads.keys() and len(grads) == 2 * len(targets or ALL_LINEAR) * layers
    for name in grads:
        assert_close(grads[name], ref_grads[name], **TOL, msg=lambda m: f"{name}: {m}")


def set_kernel(model, kernel: str) -> None:
    for m in model.modules():
        if isinstance(m, LoraLinear):
            m.kernel = kernel


@torch.no_grad()
def test_dropout_trains_on_the_reference_path_and_evaluates_fused(hf_checkpoint):
    _, folder = hf_checkpoint("llama")
    model = tiny_lora_model(folder, "fused", dropout=0.1)
    ids = torch.arange(20).view(2, 10)
    fused_eval = model.eval()(ids)
    set_kernel(model, "reference")
    assert_close(fused_eval, model(ids), **TOL)  # eval: dropout is the identity, the fused path is exact
    outs = {}
    for kernel in ("reference", "fused"):
        set_kernel(model, kernel)
        torch.manual_seed(0)
        outs[kernel] = model.train()(ids)
    assert torch.equal(outs["fused"], outs["reference"])  # training: the same path draws the same masks
    assert not torch.allclose(outs["fused"], fused_eval)  # ... and they do drop


@torch.no_grad()
def test_grouped_with_dropout_draws_a_mask_per_layer(hf_checkpoint):
    """In training each LoRA layer drops its own elements of x (as PEFT's do), so the grouped kernel runs the
    layers one by one: the same masks as the reference path; in eval it groups and equals it to rounding."""
    _, folder = hf_checkpoint("llama")
    model = tiny_lora_model(folder, "grouped", dropout=0.1)
    ids = torch.arange(20).view(2, 10)
    outs = {}
    for kernel in ("reference", "grouped"):
        set_kernel(model, kernel)
        torch.manual_seed(0)
        outs[kernel] = model.train()(ids), model.eval()(ids)
    assert torch.equal(outs["grouped"][0], outs["reference"][0])
    assert_close(outs["grouped"][1], outs["reference"][1], **TOL)


def test_kernel_is_validated():
    with pytest.raises(ValueError, match=r"lora.kernel: 'triton' is not one of \['fused', 'grouped', 'reference'\]"):
        LoraConfig(kernel="triton").validate()
    with pytest.raises(ValueError, match=r"config.lora.kernel: 'triton' is not one of"):
        from_dict(RunConfig, {"model": {"path": "m"}, "data": {"sources": [{"path": "d.jsonl"}]},
                              "lora": {"kernel": "triton"}})


def test_fused_under_torch_compile_cpu():
    """Two LoraLinear layers compiled with inductor (dynamic shapes, as compile_layers asks): the first's input
    needs no gradient (dx skipped inside the graph), the second's does. About 12 s of CPU compile, cold."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    layers = torch.nn.Sequential(*(LoraLinear(torch.nn.Linear(d_in, d_out, bias=bias), r=4, scaling=SCALING,
                                              dropout=0.0, dtype=torch.float32, kernel="reference")
                                   for d_in, d_out, bias in ((24, 40, True), (40, 16, False))))
    for name, p in layers.named_parameters():
        p.requires_grad_("lora_" in name)
        if "lora_B" in name:
            torch.nn.init.normal_(p)
    x, dy = torch.randn(3, 7, 24), torch.randn(3, 7, 16)
    results = []
    for kernel, model in (("reference", layers), ("fused", torch.compile(layers, dynamic=True))):
        set_kernel(layers, kernel)
        out = model(x)
        out.backward(dy)
        results.append({"out": out.detach(), **{n: p.grad for n, p in layers.named_parameters() if p.requires_grad}})
        layers.zero_grad(set_to_none=True)
    for name, want in results[0].items():
        assert_close(results[1][name], want, **TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow  # inductor on the CPU compiles a whole decoder layer's forward and backward: ~35 s cold
def test_fused_under_compile_layers_cpu(hf_checkpoint):
    """compile_layers, as the GPU fast path runs it, over fused LoRA layers: the eager reference's loss and grads."""
    torch._dynamo.reset()
    _, folder = hf_checkpoint("llama", num_hidden_layers=1)
    compiled = compile_layers(tiny_lora_model(folder, "fused"))
    assert_same_training_step(compiled, tiny_lora_model(folder, "reference"))


# ---------------------------------------------------------------------------------------------
# CUDA: bf16 against the float32 reference


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_cuda_bf16_matches_fp32_reference(compiled, bias):
    # 2 x 1000 tokens (N not a multiple of 128), 1024 -> 3072 as Llama's k/v projections turned around, r = 16
    x, w, b, a, bb, dy = problem(shape=(2, 1000), d_in=1024, d_out=3072, r=16, bias=bias, device="cuda",
                                 dtype=torch.bfloat16, seed=2)
    fn = torch.compile(lora_linear) if compiled else lora_linear
    got = run(fn, x, w, b, a, bb, dy)
    want = run(lora_linear_reference, *(t if t is None else t.float() for t in (x, w, b, a, bb, dy)))
    assert (got[0].dtype, got[1].dtype, got[2].dtype) == (torch.bfloat16, torch.bfloat16, torch.float32)
    for name, g, r in zip(("out", "dx", "dA", "dB"), got, want):
        assert torch.isfinite(g).all(), name
        assert rel(g, r) < 1e-2, (name, rel(g, r))


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("compiled", [False, True])
def test_cuda_bf16_grouped_matches_fp32_reference(compiled):
    """Llama-3.2-3B's q/k/v shapes (3072 -> 3072, 1024, 1024) over 2 x 1000 tokens, r = 16, bf16 against
    the per-layer reference in float32; same 1e-2 bound as above."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 1000, 3072, generator=g)
    outs = (3072, 1024, 1024)
    ws = [torch.randn(o, 3072, generator=g) / 3072**0.5 for o in outs]
    bs = [torch.randn(o, generator=g) for o in outs]
    a_s = [torch.randn(16, 3072, generator=g) / 3072**0.5 for _ in outs]
    b_s = [torch.randn(o, 16, generator=g) / 4 for o in outs]
    dys = [torch.randn(2, 1000, o, generator=g) for o in outs]

    def step(fn, dtype):
        xx = x.to("cuda", dtype).requires_grad_()
        aa = [a.cuda().requires_grad_() for a in a_s]
        bb = [b.cuda().requires_grad_() for b in b_s]
        ys = fn(xx, [w.to("cuda", dtype) for w in ws], [b.to("cuda", dtype) for b in bs], aa, bb, [SCALING] * 3)
        torch.autograd.backward(ys, [dy.to("cuda", dtype) for dy in dys])
        return [*ys, xx.grad, *(a.grad for a in aa), *(b.grad for b in bb)]

    def per_layer(x, ws, bs, aa, bb, scalings):
        return [lora_linear_reference(x, *args) for args in zip(ws, bs, aa, bb, scalings)]

    got = step(torch.compile(lora_linear_grouped) if compiled else lora_linear_grouped, torch.bfloat16)
    want = step(per_layer, torch.float32)
    for i, (g_, w_) in enumerate(zip(got, want)):
        assert torch.isfinite(g_).all(), i
        assert rel(g_, w_) < 1e-2, (i, rel(g_, w_))


def test_grouped_layers_share_one_compiled_graph():
    """compile_layers over 4 decoder layers with grouped LoRA compiles no more graphs than with the reference
    kernel (one per layer signature: layer 0's input needs no gradient, the others' do). A group_forward that
    keyed modules by id() compiled one graph per layer, and past dynamo's recompile limit (8) the H200's 28-layer
    model ran 20 layers eager (27,970 instead of 34,716 tok/s, bench/RESULTS.md)."""
    from torch._dynamo.utils import counters

    from gapless.model.decoder import CausalLM, ModelArgs
    args = ModelArgs(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    graphs = {}
    for kernel in ("reference", "grouped"):
        torch._dynamo.reset()
        counters.clear()
        model = compile_layers(apply_lora(CausalLM(args), LoraConfig(r=4, kernel=kernel)))
        model(torch.randint(0, 64, (1, 10))).sum().backward()
        graphs[kernel] = counters["stats"]["unique_graphs"]
    assert graphs["grouped"] == graphs["reference"] <= 2, graphs
