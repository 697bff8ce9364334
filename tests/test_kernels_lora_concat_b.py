"""LoRA's "concat_b" kernel (the B matrices inside the base GEMM, along its input:
gapless.kernels.lora.lora_linear_concat_b) against the per-layer reference formula, as test_kernels_lora_concat.py
holds "concat" to it. float32 on the CPU: the same sums in another order (~1e-7 relative), atol = rtol = 1e-5."""
import pytest
import torch
from torch.testing import assert_close

import gapless
from gapless.config import ALL_LINEAR, LoraConfig
from gapless.kernels.lora import lora_linear_concat_b
from gapless.model.lora import LoraLinear, apply_lora
from gapless.train.compile import compile_layers, frames_not_compiled
from test_kernels_lora_concat import (TOL, assert_agrees_with_reference, assert_kernel_matches_formula,
                                      logits_loss_grads, lora_model, storage_bytes)


@pytest.mark.parametrize("targets", [None, ["q_proj", "v_proj"], ["down_proj"]])
def test_concat_b_agrees_with_reference_on_a_tiny_model(hf_checkpoint, targets):
    """Logits and every A and B gradient equal the per-layer formula's, with biases on every projection; the state
    dict (the base weights are strided views of the buffers) is the reference's, key for key."""
    _, folder = hf_checkpoint("llama", attention_bias=True, mlp_bias=True)
    ours, reference = lora_model(folder, "concat_b", targets), lora_model(folder, "reference", targets)
    assert all(m.lora_concat is not None for m in ours.modules() if isinstance(m, LoraLinear))
    assert_agrees_with_reference(ours, reference, 2 * len(targets or ALL_LINEAR) * 2)


def test_kernel_gradients_against_the_formula():
    """lora_linear_concat_b alone against the reference by autograd (assert_kernel_matches_formula), its buffer
    [[W_1, s_1 B_1, 0, 0], [W_2, 0, s_2 B_2, 0], [W_3, 0, 0, s_3 B_3]]."""

    def buffer_of(ws, a_s, b_s, scalings):
        buffer = torch.zeros(sum(w.shape[0] for w in ws), ws[0].shape[1] + sum(b.shape[1] for b in b_s))
        row, col = 0, ws[0].shape[1]
        for w, b, s in zip(ws, b_s, scalings):
            buffer[row:row + w.shape[0], :w.shape[1]] = w
            buffer[row:row + w.shape[0], col:col + b.shape[1]] = b * s
            row, col = row + w.shape[0], col + b.shape[1]
        return buffer

    assert_kernel_matches_formula(lora_linear_concat_b, buffer_of)


def test_buffers_hold_the_weights_once_and_follow_the_optimizer(hf_checkpoint):
    """Each weight of a group is a strided view of its group's [W | s B] buffer, and o_proj's and down_proj's rows of
    concat's [W; A] (storage grows by the B blocks and those A rows only); writing a weight writes the buffer; after
    an optimizer step the buffer's B columns are scaling * the master B and a second step's loss and gradients
    equal the reference's."""
    _, folder = hf_checkpoint("llama", attention_bias=True)
    models = {k: lora_model(folder, k) for k in ("concat_b", "reference")}
    ours = models["concat_b"]
    attn = ours.model.layers[1].self_attn
    buffer = attn.q_proj.lora_concat
    assert buffer is attn.k_proj.lora_concat is attn.v_proj.lora_concat and buffer.shape == (64 + 32 + 32, 64 + 12)
    assert attn.k_proj.weight.stride() == (76, 1)

    mlp = ours.model.layers[1].mlp
    assert mlp.down_proj.lora_concat.shape == (64 + 4, 96) and mlp.down_proj.weight.stride() == (96, 1)
    assert attn.o_proj.lora_concat.shape == (64 + 4, 64)  # a layer alone: concat's [W; A] (model.lora._b_inside)
    buffers = {m.lora_concat.data_ptr(): m for m in ours.modules() if isinstance(m, LoraLinear)}
    added = sum((b.shape[1] - m.in_features) * b.shape[0] * 4 if b.shape[1] > m.in_features  # s B columns
                else (b.shape[0] - m.out_features) * m.in_features * 4  # A rows
                for m in buffers.values() for b in [m.lora_concat])
    assert len(buffers) == 4 * 2 and storage_bytes(ours) == storage_bytes(models["reference"]) + added
    grads = {}
    for kernel, model in models.items():
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        logits_loss_grads(model, seed=0)
        opt.step()
        opt.zero_grad()
        grads[kernel] = logits_loss_grads(model, seed=1)
    assert torch.equal(buffer[64:96, 64 + 4:64 + 8], attn.k_proj.lora_B.weight * attn.k_proj.scaling)
    assert not buffer[64:96, 64:64 + 4].any() and not buffer[64:96, 64 + 8:].any()
    assert_close(grads["concat_b"][0], grads["reference"][0], **TOL)
    for name, grad in grads["concat_b"][1].items():
        assert_close(grad, grads["reference"][1][name], **TOL, msg=lambda m: f"{name}: {m}")
    with torch.no_grad():
        attn.k_proj.weight.fill_(0.5)
    assert (buffer[64:96, :64] == 0.5).all() and not (buffer[64:96, 64:] == 0.5).any()


def test_dropout_runs_in_concat_b_with_grouped_masks(hf_checkpoint):
    """Under dropout concat_b keeps its buffers (only its rank-R GEMM reads dropout(x)) and draws one mask per group,
    as grouped does: under the same seed the logits and every A and B gradient equal grouped's (torch's dropout on
    the CPU); the run resolves to concat_b, and so does concat's."""
    from gapless.config import RunConfig, from_dict
    from gapless.train.loop import resolve_lora_kernel

    _, folder = hf_checkpoint("llama", attention_bias=True)
    ours, grouped = lora_model(folder, "concat_b", dropout=0.1), lora_model(folder, "grouped", dropout=0.1)
    layers = {name.rsplit(".", 1)[-1]: m for name, m in ours.named_modules() if isinstance(m, LoraLinear)}
    assert all(m.kernel == "concat_b" for m in layers.values())
    # the groups keep their buffers; o_proj and down_proj, which would run concat's A rows, run the formula
    assert all((m.lora_concat is not None) == (name not in ("o_proj", "down_proj")) for name, m in layers.items())
    results = []
    for model in (ours, grouped):
        torch.manual_seed(5)
        results.append(logits_loss_grads(model))
    assert_close(results[0][0], results[1][0], **TOL)
    for name, grad in results[0][1].items():
        assert_close(grad, results[1][1][name], **TOL, msg=lambda m: f"{name}: {m}")
    torch.manual_seed(6)  # another mask: other logits (the masks are drawn, not skipped)
    assert not torch.allclose(logits_loss_grads(ours)[0], results[0][0])
    for kernel in ("concat_b", "concat"):
        cfg = from_dict(RunConfig, {"model": {"path": str(folder)}, "data": {"sources": [{"path": "d.jsonl"}]},
                                    "lora": {"r": 4, "kernel": kernel, "dropout": 0.05}})
        assert resolve_lora_kernel(cfg, "single")[0].lora.kernel == "concat_b"


def test_compiled_layers_share_one_graph_and_match_eager():
    """compile_layers over 4 decoder layers: no more graphs than the reference kernel, nothing eager, and the
    compiled gradients equal the eager ones."""
    from torch._dynamo.utils import counters

    from gapless.model.decoder import CausalLM, ModelArgs
    args = ModelArgs(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    graphs, grads = {}, {}
    ids = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(0))
    for kernel, compiled in (("reference", True), ("concat_b", True), ("concat_b", False)):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = apply_lora(CausalLM(args), LoraConfig(r=4, kernel=kernel))
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, LoraLinear):
                    m.lora_B.weight.normal_(0, 0.1)
        if compiled:
            model = compile_layers(model)
        model(ids).sum().backward()
        graphs[kernel, compiled] = counters["stats"]["unique_graphs"]
        assert frames_not_compiled() == 0
        grads[kernel, compiled] = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        if kernel == "concat_b" and compiled:  # evaluation: no autograd, the plain GEMM, still compiled
            with torch.no_grad():
                model.eval()(ids)
            assert frames_not_compiled() == 0
    assert graphs["concat_b", True] == graphs["reference", True] <= 2, graphs
    # inductor's float32 sums in another order: up to ~2e-5 on a few elements of A's gradients (seen once in 128)
    tol = dict(atol=1e-4, rtol=1e-4)
    for name, grad in grads["concat_b", False].items():
        assert_close(grads["concat_b", True][name], grad, **tol, msg=lambda m: f"{name}: {m}")
        assert_close(grad, grads["reference", True][name], **tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fused_dropout_equals_grouped():
    """On CUDA (float32), dropout 0.1 through the fused kernel (gapless.kernels.lora_dropout, whose seed is drawn
    from torch's generator): concat_b and grouped draw the same mask per group under the same seed, so their logits
    and gradients agree to float32 rounding."""
    from gapless.kernels.lora_dropout import FusedDropout
    from test_kernels_lora_concat import tiny_decoder

    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0)).cuda()
    results = {}
    for kernel in ("grouped", "concat_b"):
        model = tiny_decoder(kernel, "cuda", torch.float32)
        for m in model.modules():
            if isinstance(m, LoraLinear):  # what apply_lora gives at lora.dropout 0.1 (and concat_b keeps)
                m.lora_dropout = FusedDropout(0.1)
        torch.manual_seed(3)
        logits = model.train()(ids)
        logits.square().mean().backward()
        results[kernel] = [logits, *(p.grad for p in model.parameters() if p.requires_grad)]
    for i, (got, want) in enumerate(zip(results["concat_b"], results["grouped"])):
        assert_close(got, want, atol=1e-4, rtol=1e-4, msg=lambda m: f"{i}: {m}")


def test_assemble_builds_the_buffers_after_loading(hf_checkpoint):
    """gapless.train.assemble: LoRA on the meta device, the weights loaded, then Lora.initialise builds concat_b's
    buffers from the loaded weights: each weight equals the checkpoint's, the B blocks are the (zero) B's."""
    from gapless.config import RunConfig, from_dict
    from gapless.model.loading import build
    from gapless.model.method import method_of
    from gapless.train.assemble import assemble
    _, folder = hf_checkpoint("llama")
    cfg = from_dict(RunConfig, {"model": {"path": str(folder)}, "data": {"sources": [{"path": "d.jsonl"}]},
                                "lora": {"r": 4, "kernel": "concat_b"}})
    model = assemble(build(folder), method_of(cfg), torch.device("cpu"), torch.float32)
    plain = gapless.load_model(folder)
    mlp = model.model.layers[0].mlp
    buffer = mlp.gate_proj.lora_concat
    assert buffer is mlp.up_proj.lora_concat and buffer.shape == (2 * mlp.up_proj.out_features, 64 + 8)
    assert torch.equal(mlp.up_proj.weight, plain.model.layers[0].mlp.up_proj.weight)
    assert torch.equal(buffer[mlp.gate_proj.out_features:, :64], plain.model.layers[0].mlp.up_proj.weight)
    assert not buffer[:, 64:].any()  # B starts at zero, PEFT's init


@pytest.mark.parametrize("kernel", ["concat", "concat_b"])
def test_generation_sees_the_current_adapters(kernel):
    """Generation runs hidden_states without forward: the buffers' adapter parts are refreshed there too. A and B
    changed after the buffers were built (as an optimizer step or a loaded adapter changes them): the model generates
    what the reference formula generates (the refresh used to hang on the model's forward, so concat generated with
    the old A rows and concat_b with its initial zero B blocks)."""
    from gapless.model.generate import generate_ids
    from test_kernels_lora_concat import tiny_decoder

    models = {k: tiny_decoder(k).eval() for k in ("reference", kernel)}
    for model in models.values():
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, LoraLinear):
                    m.lora_A.weight.mul_(3.0)
    want, got = (generate_ids(models[k], [1, 5, 7, 9], max_new_tokens=12).tokens for k in ("reference", kernel))
    assert got == want
