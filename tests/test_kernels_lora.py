"""LoRA's grouped kernel (one A matmul, and one dropout mask, for the layers that read the same input) against the
per-layer reference formula.

Tolerances: on the CPU in float32 both compute the same sums in a different order, which lands near 1e-7
relative; the tests ask for atol = rtol = 1e-5. bf16 on CUDA, against the reference run in float32 on the same
inputs upcast: each bf16 rounding is 2^-8 relative and a few of them stack (xa, dy B, the GEMM outputs), so
‖x − ref‖ / ‖ref‖ lands near 3e-3; the bound is 1e-2.
"""
import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import gapless
import gapless.model.lora
from gapless.config import ALL_LINEAR, LoraConfig, RunConfig, from_dict
from gapless.kernels.lora import lora_linear_grouped, lora_linear_reference
from gapless.model.lora import LoraLinear, apply_lora
from gapless.train.compile import compile_layers

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TOL = dict(atol=1e-5, rtol=1e-5)
SCALING = 2.0


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


# ---------------------------------------------------------------------------------------------
# LoraLinear on a tiny model: kernel "grouped" against "reference"


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
                        lambda x, *args, **kw: sizes.append(len(args[0])) or real(x, *args, **kw))
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
def test_grouped_with_dropout_shares_one_mask_per_group(hf_checkpoint, monkeypatch):
    """In training with dropout the grouped kernel still groups: one mask drawn on x per group (q/k/v; gate/up),
    shared by the group's A matmuls. Each layer's output equals the reference formula under that same mask; in
    eval (no mask) the grouped and per-layer paths agree to rounding."""
    _, folder = hf_checkpoint("llama")
    model = tiny_lora_model(folder, "grouped", dropout=0.3)
    masks = []
    real = torch.nn.functional.dropout

    def recording(x, p=0.5, training=True, inplace=False):
        out = real(x, p, training, inplace)
        masks.append((x, out))
        return out

    monkeypatch.setattr(torch.nn.functional, "dropout", recording)
    ids = torch.arange(20).view(2, 10)
    model.train()(ids)
    layers = len(model.model.layers)
    # one draw per group (q/k/v; gate/up) and one each for o_proj and down_proj: 4 per layer, not 7 (one per projection)
    assert len(masks) == 4 * layers
    q, k, v = (getattr(model.model.layers[0].self_attn, n) for n in ("q_proj", "k_proj", "v_proj"))
    x, dropped = masks[0]
    for layer in (q, k, v):  # the reference formula with the group's mask gives each layer's grouped output
        want = lora_linear_reference(x, layer.weight, layer.bias, layer.lora_A.weight, layer.lora_B.weight,
                                     layer.scaling, dropout=lambda _: dropped)
        got = lora_linear_grouped(x, [layer.weight, q.weight], [layer.bias, q.bias],
                                  [layer.lora_A.weight, q.lora_A.weight], [layer.lora_B.weight, q.lora_B.weight],
                                  [layer.scaling, q.scaling], dropout=lambda _: dropped)[0]
        assert_close(got, want, **TOL)
    assert not torch.equal(dropped, x)  # p = 0.3 does drop
    monkeypatch.setattr(torch.nn.functional, "dropout", real)
    outs = {}
    for kernel in ("reference", "grouped"):
        set_kernel(model, kernel)
        outs[kernel] = model.eval()(ids)
    assert_close(outs["grouped"], outs["reference"], **TOL)


def test_kernel_is_validated():
    with pytest.raises(ValueError, match=r"lora.kernel: 'triton' is not one of "
                                         r"\['grouped', 'reference', 'concat', 'concat_b'\]"):
        LoraConfig(kernel="triton").validate()
    with pytest.raises(ValueError, match=r"config.lora.kernel: 'triton' is not one of"):
        from_dict(RunConfig, {"model": {"path": "m"}, "data": {"sources": [{"path": "d.jsonl"}]},
                              "lora": {"kernel": "triton"}})


# ---------------------------------------------------------------------------------------------
# CUDA: bf16 against the float32 reference


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
