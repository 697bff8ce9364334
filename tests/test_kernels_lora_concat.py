"""LoRA's "concat" kernel (the frozen projections and the A matrices of the layers reading one input as one GEMM,
gapless.kernels.lora.lora_linear_concat) against the per-layer reference formula.

Tolerances as in test_kernels_lora.py: float32 on the CPU computes the same sums in another order (~1e-7
relative), so atol = rtol = 1e-5; bf16 on CUDA against the float32 reference lands near 3e-3, bound 1e-2.
"""
import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import gapless
import gapless.model.lora
from gapless.config import ALL_LINEAR, LoraConfig
from gapless.kernels.lora import lora_linear_concat, lora_linear_reference
from gapless.model.lora import LoraLinear, apply_lora, load_adapter, merge_lora, save_adapter
from gapless.train.compile import compile_layers, frames_not_compiled

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TOL = dict(atol=1e-5, rtol=1e-5)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def lora_model(folder, kernel: str, targets=None, dropout: float = 0.0):
    """The tiny checkpoint with LoRA, A and B seeded the same for every kernel (B off zero, so A gets gradients)."""
    model = gapless.load_model(folder)
    apply_lora(model, LoraConfig(r=4, alpha=8, kernel=kernel, dropout=dropout,
                                 target_modules=targets or list(ALL_LINEAR)))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model.train()


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 96, (2, 2, 10), generator=g)


def logits_loss_grads(model, seed=0):
    ids, targets = batch(seed)
    logits = model(ids)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def assert_agrees_with_reference(ours, reference, n_grads: int) -> None:
    """One step of `ours` against the per-layer formula's model: the same logits and every A and B gradient
    (n_grads of them); the frozen weights get no gradient, and the state dict is the reference's, key for key and
    value for value."""
    logits, grads = logits_loss_grads(ours)
    ref_logits, ref_grads = logits_loss_grads(reference)
    assert_close(logits, ref_logits, **TOL)
    assert grads.keys() == ref_grads.keys() and len(grads) == n_grads
    for name in grads:
        assert_close(grads[name], ref_grads[name], **TOL, msg=lambda m: f"{name}: {m}")
    assert all(p.grad is None for p in ours.parameters() if not p.requires_grad)
    mine, theirs = ours.state_dict(), reference.state_dict()
    assert mine.keys() == theirs.keys()
    for key in mine:
        assert torch.equal(mine[key], theirs[key]), key


def assert_kernel_matches_formula(kernel, buffer_of) -> None:
    """A concat kernel alone, 3 layers (out 6, 4, 4; r 2, 3, 2; one bias None) over [2, 5, 8] with the third output
    unused: y, dx, dA and dB against the reference by autograd. `kernel(x, buffer, biases, As, Bs, scalings)`,
    `buffer_of(Ws, As, Bs, scalings)` its frozen buffer, which gets no gradient; the unused layer's B gets none
    either, and its A zeros at most (the group's one dA GEMM)."""
    g = torch.Generator().manual_seed(0)
    outs, ranks, scalings = (6, 4, 4), (2, 3, 2), (2.0, 0.5, 1.0)
    x = torch.randn(2, 5, 8, generator=g)
    ws = [torch.randn(o, 8, generator=g) for o in outs]
    bs = [torch.randn(6, generator=g), None, torch.randn(4, generator=g)]
    a_s = [torch.randn(r, 8, generator=g) for r in ranks]
    b_s = [torch.randn(o, r, generator=g) for o, r in zip(outs, ranks)]
    dys = [torch.randn(2, 5, o, generator=g) for o in outs]

    def run(fn):
        xx = x.clone().requires_grad_()
        aa = [a.clone().requires_grad_() for a in a_s]
        bb = [b.clone().requires_grad_() for b in b_s]
        ys = fn(xx, aa, bb)
        torch.autograd.backward(ys[:2], dys[:2])  # the third output unused: its gradient is None
        return [*ys, xx.grad, *(a.grad for a in aa), *(b.grad for b in bb)]

    buffer = buffer_of(ws, a_s, b_s, scalings)
    got = run(lambda xx, aa, bb: kernel(xx, buffer, bs, aa, bb, scalings))
    want = run(lambda xx, aa, bb: [lora_linear_reference(xx, *args) for args in zip(ws, bs, aa, bb, scalings)])
    for i, (g_, w_) in enumerate(zip(got, want)):
        if w_ is None:  # the unused layer's A and B: the group's one dA GEMM gives its A zeros
            assert g_ is None or not g_.any(), i
        else:
            assert_close(g_, w_, **TOL, msg=lambda m: f"output {i}: {m}")
    assert got[-1] is None and buffer.grad is None  # B of the unused layer, and the frozen buffer


def storage_bytes(model) -> int:
    """Bytes of the distinct storages behind the model's parameters and buffers."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*model.parameters(), *model.buffers()]}
    return sum(storages.values())


@pytest.mark.parametrize("targets", [None, ["q_proj", "v_proj"], ["k_proj", "v_proj"]])
def test_concat_agrees_with_reference_on_a_tiny_model(hf_checkpoint, monkeypatch, targets):
    """Logits and every A and B gradient equal the per-layer formula's, with biases on every projection; the
    groups are q/k/v, o, gate/up, down on every layer (one GEMM each), or q/v (k/v) alone."""
    _, folder = hf_checkpoint("llama", attention_bias=True, mlp_bias=True)
    concat, reference = lora_model(folder, "concat", targets), lora_model(folder, "reference", targets)
    sizes = []
    real = gapless.model.lora.lora_linear_concat
    monkeypatch.setattr(gapless.model.lora, "lora_linear_concat",
                        lambda x, buf, biases, *args: sizes.append(len(biases)) or real(x, buf, biases, *args))
    layers = len(concat.model.layers)
    assert_agrees_with_reference(concat, reference, 2 * len(targets or ALL_LINEAR) * layers)
    assert sizes == ([3, 1, 2, 1] if targets is None else [2]) * layers


def test_kernel_gradients_against_the_formula():
    """lora_linear_concat alone against the reference by autograd (assert_kernel_matches_formula), its buffer
    [W_1; W_2; W_3; A_1; A_2; A_3]."""
    assert_kernel_matches_formula(lora_linear_concat, lambda ws, a_s, b_s, scalings: torch.cat(ws + a_s))


def test_base_weights_live_once_in_the_buffer(hf_checkpoint):
    """Each layer's weight is a view into its group's buffer [W_1; ..; W_k; A_1; ..; A_k]: the model's storage grows by
    the A rows only, and writing a weight (as load_state_dict does) writes the buffer the GEMM reads."""
    _, folder = hf_checkpoint("llama")
    concat, reference = lora_model(folder, "concat"), lora_model(folder, "reference")

    attn = concat.model.layers[0].self_attn
    buffer = attn.q_proj.lora_concat
    assert buffer is attn.k_proj.lora_concat is attn.v_proj.lora_concat
    assert buffer.shape == (64 + 32 + 32 + 3 * 4, 64)
    for layer in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert layer.weight.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    a_rows = sum(m.lora_A.weight.numel() * 4 for m in concat.modules() if isinstance(m, LoraLinear))
    assert storage_bytes(concat) == storage_bytes(reference) + a_rows
    with torch.no_grad():
        attn.k_proj.weight.fill_(0.5)
    assert (buffer[64:96] == 0.5).all()


def test_optimizer_step_refreshes_the_a_rows(hf_checkpoint):
    """After an optimizer step the next forward sees the updated master A: the buffers' A rows equal it and a
    second step's loss and gradients equal the reference model's after the same step."""
    _, folder = hf_checkpoint("llama", attention_bias=True)
    models = {k: lora_model(folder, k) for k in ("concat", "reference")}
    grads = {}
    for kernel, model in models.items():
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        logits_loss_grads(model, seed=0)
        opt.step()
        opt.zero_grad()
        grads[kernel] = logits_loss_grads(model, seed=1)
    attn = models["concat"].model.layers[1].self_attn
    a_rows = attn.q_proj.lora_concat[64 + 32 + 32:]
    assert torch.equal(a_rows, torch.cat([attn.q_proj.lora_A.weight, attn.k_proj.lora_A.weight,
                                          attn.v_proj.lora_A.weight]))
    assert_close(grads["concat"][0], grads["reference"][0], **TOL)
    for name, grad in grads["concat"][1].items():
        assert_close(grad, grads["reference"][1][name], **TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("kernel", ["concat", "concat_b"])
def test_adapter_round_trip_and_merge(hf_checkpoint, tmp_path, kernel):
    """save_adapter of a concat (concat_b) model loads back (as grouped) with the same logits; merge_lora gives the
    same logits as plain linears (contiguous weights, where concat_b's were strided views) and drops the buffers
    and their refresh hook."""
    _, folder = hf_checkpoint("llama", attention_bias=True)
    model = lora_model(folder, kernel).eval()
    ids = batch()[0]
    with torch.no_grad():
        want = model(ids)
    save_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(folder))
    loaded, _ = load_adapter(gapless.load_model(folder), tmp_path / "adapter")
    with torch.no_grad():
        assert_close(loaded.eval()(ids), want, **TOL)
        merged = merge_lora(model)
        assert not any(isinstance(m, LoraLinear) for m in merged.modules())
        assert not hasattr(merged, "_lora_concat_hook") and not merged._forward_pre_hooks
        assert all(p.is_contiguous() for p in merged.parameters())
        assert_close(merged(ids), want, **TOL)


def test_dropout_runs_concat_b(hf_checkpoint):
    """concat runs concat_b under dropout (the same sums; its A rows cannot read dropout(x) beside the base rows'
    x), without a warning: the seed's recipe (dropout 0.05) would otherwise warn on every run. The groups keep
    concat_b's buffers; o_proj and down_proj run the formula."""
    import warnings

    _, folder = hf_checkpoint("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = apply_lora(gapless.load_model(folder), LoraConfig(r=4, dropout=0.1, kernel="concat"))
    layers = {name.rsplit(".", 1)[-1]: m for name, m in model.named_modules() if isinstance(m, LoraLinear)}
    assert all(m.kernel == "concat_b" for m in layers.values())
    assert all((m.lora_concat is None) == (name in ("o_proj", "down_proj")) for name, m in layers.items())


def test_assemble_builds_the_buffers_after_loading(hf_checkpoint):
    """gapless.train.assemble: LoRA on the meta device, the weights loaded, then Lora.initialise builds the buffers
    from the loaded weights, which equal the checkpoint's."""
    from gapless.config import RunConfig, from_dict
    from gapless.model.loading import build
    from gapless.model.method import method_of
    from gapless.train.assemble import assemble
    _, folder = hf_checkpoint("llama")
    cfg = from_dict(RunConfig, {"model": {"path": str(folder)}, "data": {"sources": [{"path": "d.jsonl"}]},
                                "lora": {"r": 4, "kernel": "concat"}})
    model = assemble(build(folder), method_of(cfg), torch.device("cpu"), torch.float32)
    plain = gapless.load_model(folder)
    layer = model.model.layers[0].mlp
    assert layer.gate_proj.lora_concat is layer.up_proj.lora_concat is not None
    assert torch.equal(layer.up_proj.weight, plain.model.layers[0].mlp.up_proj.weight)
    assert torch.equal(layer.up_proj.lora_concat[-4:], layer.up_proj.lora_A.weight)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_concat_layers_share_one_compiled_graph(dropout):
    """compile_layers over 4 decoder layers with the concat kernel: no more graphs than the reference kernel (one
    per layer signature), nothing left eager, and the compiled gradients equal the eager ones; under dropout too
    (concat then runs concat_b; inductor draws the masks with torch's generator, fallback_random)."""
    from torch._dynamo.utils import counters
    from torch._inductor import config as inductor_config

    from gapless.model.decoder import CausalLM, ModelArgs
    args = ModelArgs(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    graphs, grads = {}, {}
    ids = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(0))
    for kernel, compiled in (("reference", True), ("concat", True), ("concat", False)):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = apply_lora(CausalLM(args), LoraConfig(r=4, kernel=kernel, dropout=dropout))
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, LoraLinear):
                    m.lora_B.weight.normal_(0, 0.1)
        # under dropout the group keeps concat_b's buffer, and down_proj, alone, runs the formula
        assert (model.model.layers[0].mlp.gate_proj.lora_concat is not None) == (kernel == "concat")
        assert (model.model.layers[0].mlp.down_proj.lora_concat is not None) == (kernel == "concat" and not dropout)
        if compiled:
            model = compile_layers(model)
        torch.manual_seed(1)
        with inductor_config.patch(fallback_random=True):
            model(ids).sum().backward()
        graphs[kernel, compiled] = counters["stats"]["unique_graphs"]
        assert frames_not_compiled() == 0
        grads[kernel, compiled] = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert graphs["concat", True] == graphs["reference", True] <= 2, graphs
    # inductor fuses the dropout's scaling into other ops: float32 rounding up to ~2e-5 on a few elements
    tol = TOL if not dropout else dict(atol=1e-4, rtol=1e-4)
    for name, grad in grads["concat", False].items():
        assert_close(grads["concat", True][name], grad, **tol, msg=lambda m: f"{name}: {m}")


def tiny_decoder(kernel: str, device="cpu", dtype=torch.float32):
    """A 2-layer decoder with LoRA on every projection, B off zero; the same values for every kernel."""
    from gapless.model.decoder import CausalLM, ModelArgs
    args = ModelArgs(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    model = CausalLM(args).to(device, dtype)
    apply_lora(model, LoraConfig(r=4, kernel=kernel))
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoraLinear):
                m.lora_B.weight.normal_(0, 0.1)
    return model


def test_activation_checkpointing_recomputes_the_same():
    """With every layer checkpointed (the concat forward runs again in backward) the gradients are the
    un-checkpointed ones."""
    from gapless.train.ckpt_activations import checkpoint_activations
    ids = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(0))
    grads = []
    for every in (0, 1):
        model = tiny_decoder("concat")
        if every:
            checkpoint_activations(model, every=every)
        model(ids).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    for name, grad in grads[0].items():
        assert_close(grads[1][name], grad, **TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("kernel", ["concat", "concat_b"])
def test_cuda_bf16_tiny_model_after_a_step(kernel):
    """On CUDA in bf16, compiled: after an optimizer step of a float32 grouped model, its float32 masters A and B
    copied into a bf16 concat model (whose pre-forward hook must cast the moved A into its bf16 A rows) and a bf16
    grouped model: concat's logits and gradients are as close to the float32 model's as grouped's are (1e-2, or
    1.5x grouped's own bf16 error where that is larger); the step moved the logits by more than that, so a stale A
    would show.

    Against float32, not concat against grouped directly: the two bf16 paths round differently (one GEMM over
    [W; A] against separate ones), and after a step their gradients differed by 1.2% on the CPU; an AdamW step each
    (an earlier form of this test) moved near-zero-gradient elements by +lr in one model and -lr in the other."""
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0)).cuda()
    ref = compile_layers(tiny_decoder("grouped", "cuda", torch.float32))
    trainable = {n: p for n, p in ref.named_parameters() if p.requires_grad}
    opt = torch.optim.SGD(trainable.values(), lr=0.1)
    before = ref(ids)
    before.float().square().mean().backward()
    opt.step()
    opt.zero_grad()
    results = {}
    for name_, dtype in (("float32", torch.float32), ("grouped", torch.bfloat16), (kernel, torch.bfloat16)):
        model = ref if name_ == "float32" else compile_layers(tiny_decoder(name_, "cuda", dtype))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.requires_grad:
                    p.copy_(trainable[name])
        logits = model(ids)
        logits.float().square().mean().backward()
        results[name_] = [logits, *(p.grad for p in model.parameters() if p.requires_grad)]
    assert len(results[kernel]) == len(results["float32"]) == 1 + 2 * 7 * 2
    assert rel(results["float32"][0].detach(), before.detach()) > 5e-2
    for i, (got, base, want) in enumerate(zip(results[kernel], results["grouped"], results["float32"])):
        assert rel(got, want) < max(1e-2, 1.5 * rel(base, want)), (i, rel(got, want), rel(base, want))


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("inp, outs", [(3072, (3072, 1024, 1024)), (3072, (8192, 8192)), (8192, (3072,))],
                         ids=["qkv", "gate_up", "down"])
def test_cuda_bf16_concat_matches_fp32_reference(compiled, inp, outs):
    """Llama-3.2-3B's groups (q/k/v, gate/up, down alone) over 2 x 1000 tokens, r = 16, biases, in bf16 against
    the per-layer reference in float32: outputs, dx, dA and dB within the 1e-2 bound (module docstring)."""
    g = torch.Generator().manual_seed(3)
    k = len(outs)
    weights = {"x": [torch.randn(2, 1000, inp, generator=g)],
               "w": [torch.randn(o, inp, generator=g) / inp**0.5 for o in outs],
               "b": [torch.randn(o, generator=g) for o in outs],
               "a": [torch.randn(16, inp, generator=g) / inp**0.5 for _ in outs],
               "B": [torch.randn(o, 16, generator=g) / 4 for o in outs],
               "dy": [torch.randn(2, 1000, o, generator=g) for o in outs]}

    def step(fn, dtype):
        dev = {n: [t.to("cuda", dtype if n != "a" and n != "B" else torch.float32) for t in ts]
               for n, ts in weights.items()}
        for t in dev["x"] + dev["a"] + dev["B"]:
            t.requires_grad_()
        ys = fn(dev["x"][0], dev["w"], dev["b"], dev["a"], dev["B"])
        torch.autograd.backward(ys, dev["dy"])
        return [*ys, *(t.grad for t in dev["x"] + dev["a"] + dev["B"])]

    def concat(x, ws, bs, aa, bb):
        buffer = torch.cat(ws + [a.detach().to(x.dtype) for a in aa])
        return lora_linear_concat(x, buffer, bs, aa, bb, [2.0] * k)

    def per_layer(x, ws, bs, aa, bb):
        return [lora_linear_reference(x, *args, 2.0) for args in zip(ws, bs, aa, bb)]

    got = step(torch.compile(concat) if compiled else concat, torch.bfloat16)
    want = step(per_layer, torch.float32)
    assert len(got) == 3 * k + 1
    for i, (g_, w_) in enumerate(zip(got, want)):
        assert torch.isfinite(g_).all(), i
        assert rel(g_, w_) < 1e-2, (i, rel(g_, w_))
