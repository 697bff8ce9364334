"""QLoRA (gapless.model.qlora): the layer against the dequantised-weight LoraLinear reference, its 4-bit memory in
backward, the adapter in PEFT on transformers' model with the dequantised base, and the merged export."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import gapless
from gapless.config import LoraConfig
from gapless.kernels.nf4 import quantize_nf4
from gapless.model.export import save_pretrained
from gapless.model.lora import LoraLinear, apply_lora, lora_state_dict, merge_lora, save_adapter
from gapless.model.qlora import QLoraLinear, apply_qlora, QloraLoadHook, to_qlora

# float32 on the CPU: the QLoRA layer runs the same matmuls on the same dequantised weight as the reference, so
# forward and gradients agree to float32 rounding of a different summation order (the bias, dx's two terms)
TOL = dict(atol=1e-5, rtol=1e-5)
IDS = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(7))


def _pair(kernel="reference", dropout=0.0, bias=True, seed=0):
    """A QLoRA layer and the LoraLinear reference whose base weight is the QLoRA layer's dequantised weight."""
    torch.manual_seed(seed)
    base = nn.Linear(128, 192, bias=bias)
    lora = LoraLinear(base, r=4, scaling=2.0, dropout=dropout, dtype=torch.float32, kernel=kernel)
    nn.init.normal_(lora.lora_B.weight, std=0.1)  # B off zero so the update (and dA) is tested
    ref_base = nn.Linear(128, 192, bias=bias)
    with torch.no_grad():
        ref_base.weight.copy_(quantize_nf4(base.weight).dequantize())
        if bias:
            ref_base.bias.copy_(base.bias)
    ref = LoraLinear(ref_base, r=4, scaling=2.0, dropout=dropout, dtype=torch.float32, kernel=kernel)
    ref.load_state_dict(lora.state_dict() | {"weight": ref_base.weight}, strict=False)
    q = QLoraLinear(lora, torch.float32)
    for m in (q, ref):
        for n, p in m.named_parameters():
            p.requires_grad = "lora_" in n
    return q, ref


@pytest.mark.parametrize("bias", [True, False])
def test_forward_and_gradients_equal_dequantised_reference(bias):
    q, ref = _pair(bias=bias)
    assert not any(n == "weight" for n, _ in q.named_parameters())  # the bf16/fp32 base is gone
    assert_close(q.weight, ref.weight, atol=0, rtol=0)  # the dequantised weight, as a read-only attribute
    x = torch.randn(3, 5, 128, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    y, yr = q(x), ref(xr)
    assert_close(y, yr, **TOL)
    dy = torch.randn_like(y)
    y.backward(dy)
    yr.backward(dy)
    assert_close(x.grad, xr.grad, **TOL)
    assert_close(q.lora_A.weight.grad, ref.lora_A.weight.grad, **TOL)
    assert_close(q.lora_B.weight.grad, ref.lora_B.weight.grad, **TOL)


def test_backward_saves_no_dequantised_weight():
    q, ref = _pair()
    x = torch.randn(4, 128, requires_grad=True)
    saved = {}
    for name, layer in (("qlora", q), ("reference", ref)):
        shapes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append((t.numel(), t.dtype)) or t,
                                                      lambda t: t):
            layer(x)
        saved[name] = shapes
    assert (192 * 128, torch.float32) in saved["reference"]  # F.linear saves the fp32 weight (W^T) for dx...
    assert (192 * 128, torch.float32) not in saved["qlora"]  # ...the QLoRA layer keeps the 4-bit storage instead
    assert (192 * 128 // 2, torch.uint8) in saved["qlora"]


def test_grouped_equals_per_layer_on_a_model(hf_checkpoint):
    _, folder = hf_checkpoint("qwen2")  # q/k/v biases
    out = {}
    for kernel in ("grouped", "reference"):
        torch.manual_seed(0)
        model = apply_qlora(gapless.load_model(folder), LoraConfig(r=4, alpha=8, kernel=kernel), torch.float32)
        for layer in model.modules():
            if isinstance(layer, QLoraLinear):
                nn.init.normal_(layer.lora_B.weight, std=0.1)
        loss = model(IDS).logsumexp(-1).mean()
        loss.backward()
        out[kernel] = (loss.detach(), model.model.layers[0].self_attn.k_proj.lora_A.weight.grad)
    assert_close(out["grouped"][0], out["reference"][0], **TOL)
    assert_close(out["grouped"][1], out["reference"][1], **TOL)


def _trained_qlora(folder, cfg, seed=0):
    torch.manual_seed(seed)
    model = apply_qlora(gapless.load_model(folder), cfg, torch.float32)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.2)
    g = torch.Generator().manual_seed(seed)
    for _ in range(4):
        ids, targets = torch.randint(0, 96, (2, 2, 10), generator=g)
        F.cross_entropy(model(ids).flatten(0, 1), targets.flatten()).backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


def test_adapter_loads_in_peft_on_the_dequantised_base(hf_checkpoint, tmp_path):
    import peft

    hf, folder = hf_checkpoint("llama", tie_word_embeddings=True)
    cfg = LoraConfig(r=4, alpha=8, dropout=0.05)
    ours = _trained_qlora(folder, cfg)
    with torch.no_grad():
        adapted = ours(IDS)
    lora_keys = set(lora_state_dict(apply_lora(gapless.load_model(folder), cfg)))
    assert set(lora_state_dict(ours)) == lora_keys  # the same adapter keys as LoRA's
    save_adapter(ours, tmp_path / "adapter", base_model_name_or_path=str(folder))

    # transformers' model with each adapted base weight replaced by the QLoRA layer's dequantised weight
    with torch.no_grad():
        for name, layer in ours.named_modules():
            if isinstance(layer, QLoraLinear):
                hf.get_submodule(name).weight.copy_(layer.weight)
        plain = hf(IDS).logits
    assert (plain - adapted).abs().max() > 1e-2  # the adapter matters, so the parity below means something
    reference = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    with torch.no_grad():
        assert_close(reference(IDS).logits, adapted, atol=1e-4, rtol=0)


def test_merge_dequantises_into_an_hf_folder(hf_checkpoint, tmp_path):
    import transformers

    _, folder = hf_checkpoint("qwen2")
    ours = _trained_qlora(folder, LoraConfig(r=4, alpha=8))
    with torch.no_grad():
        adapted = ours(IDS)
    merge_lora(ours)  # LoRA's own merge: reads the dequantised weight
    assert not any(isinstance(m, LoraLinear) for m in ours.modules())
    assert not any("lora" in k or "weight_packed" in k for k in ours.state_dict())
    out = save_pretrained(ours, tmp_path / "merged")
    with torch.no_grad():
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        assert_close(reloaded(IDS).logits, adapted, atol=1e-4, rtol=0)
    bf16 = save_pretrained(ours.to(torch.bfloat16), tmp_path / "merged-bf16")
    assert transformers.AutoConfig.from_pretrained(bf16).torch_dtype == torch.bfloat16


def test_meta_model_is_filled_by_the_load_hook(hf_checkpoint):
    from safetensors import safe_open

    _, folder = hf_checkpoint("llama")
    loaded = apply_qlora(gapless.load_model(folder), LoraConfig(r=4, alpha=8), torch.float32)
    meta = gapless.load_model(folder).to("meta")  # built without storage, as the model assembly does
    apply_qlora(meta, LoraConfig(r=4, alpha=8), torch.float32)
    layer = meta.model.layers[1].mlp.down_proj
    assert layer.weight_packed.is_meta
    hook = QloraLoadHook(meta)
    with safe_open(folder / "model.safetensors", "pt") as st:
        consumed = {k for k in st.keys() if hook(k, st.get_tensor(k))}
    assert len(consumed) == 2 * 7 and not hook("model.norm.weight", torch.ones(64))
    assert torch.equal(layer.weight_packed, loaded.model.layers[1].mlp.down_proj.weight_packed)
    assert torch.equal(layer.weight, loaded.model.layers[1].mlp.down_proj.weight)


def test_load_hook_quantises_what_the_run_quantised(hf_checkpoint):
    """A bfloat16 run quantises each weight as bfloat16; its model rebuilt in float32 (gapless eval on the CPU) rounds
    the checkpoint's float32 weights to bfloat16 first (the hook's dtype), so it holds the run's NF4 codes, which
    quantising the float32 weights would not give."""
    from safetensors import safe_open

    _, folder = hf_checkpoint("llama")  # float32 weights
    models = {}
    for name, dtype, hook_dtype in (("run", torch.bfloat16, None), ("float32", torch.float32, torch.bfloat16),
                                    ("unrounded", torch.float32, None)):
        meta = apply_qlora(gapless.load_model(folder).to("meta"), LoraConfig(r=4, alpha=8), dtype)
        hook = QloraLoadHook(meta, hook_dtype)
        with safe_open(folder / "model.safetensors", "pt") as st:
            for k in st.keys():
                hook(k, st.get_tensor(k).to(dtype))
        models[name] = meta
    packed = {name: torch.cat([m.weight_packed for m in model.modules() if isinstance(m, QLoraLinear)])
              for name, model in models.items()}
    assert torch.equal(packed["float32"], packed["run"])
    assert not torch.equal(packed["unrounded"], packed["run"])


def test_errors_name_the_shape():
    with pytest.raises(ValueError, match="multiple of the NF4 block size"):
        QLoraLinear(LoraLinear(nn.Linear(10, 10), 2, 1.0, 0.0, torch.float32, kernel="reference"), torch.float32)
    q, _ = _pair()
    with pytest.raises(ValueError, match=r"weight of shape \[3, 64\] for a layer of \[192, 128\]"):
        q.quantize_(torch.zeros(3, 64))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_bf16_layer_equals_eager_on_cuda():
    q, ref = _pair(bias=False)  # a bias stays in the model's dtype in a run; this layer's would be float32
    q, ref = q.cuda(), ref.cuda()
    q.compute_dtype = torch.bfloat16
    x = torch.randn(2, 512, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    eager = q(x)
    eager.float().square().sum().backward()
    grads = x.grad.clone(), q.lora_A.weight.grad.clone()
    x.grad = None
    q.lora_A.weight.grad = q.lora_B.weight.grad = None
    compiled = torch.compile(q)
    out = compiled(x)
    out.float().square().sum().backward()
    # bf16: one rounding of the output (2^-8 relative) between Inductor's and eager's kernels
    assert_close(out, eager, atol=2e-2, rtol=2e-2)
    assert_close(x.grad, grads[0], atol=2e-2, rtol=2e-2)
    assert_close(q.lora_A.weight.grad, grads[1], atol=2e-2, rtol=2e-2)


def test_qlora_run_through_the_loop(tmp_path):
    import io

    from safetensors import safe_open

    from gapless import demo_task
    from gapless.config import load_config
    from gapless.demo import write_base_model
    from gapless.train.loop import train

    model_dir = write_base_model(tmp_path / "base", seed=0)
    data = demo_task.write_jsonl(demo_task.make_examples(200, seed=1), tmp_path / "train.jsonl")

    def config(out, **overrides):
        raw = {"model": {"path": str(model_dir), "dtype": "float32", "device": "cpu"},
               "data": {"sources": [{"path": str(data), "format": "messages"}], "max_seq_len": 64,
                        "tokens_per_batch": 128, "cache_dir": str(tmp_path / "cache"), "num_workers": 0},
               "method": "qlora", "lora": {"r": 4, "alpha": 8}, "optim": {"lr": 1e-2},
               "checkpoint": {"every": 2}, "train": {"steps": 6, "log_every": 1, "seed": 3},
               "output_dir": str(tmp_path / out), "progress": False}
        return load_config(data=raw, overrides=[f"{k}={v}" for k, v in overrides.items()])

    whole = train(config("whole"), out=io.StringIO())
    losses = [whole.losses[s] for s in sorted(whole.losses)]
    assert sum(losses[-2:]) / 2 < 0.9 * losses[0], losses
    with safe_open(whole.final_dir / "adapter_model.safetensors", "pt") as st:
        keys = set(st.keys())
    assert keys and all(k.startswith("base_model.model.model.layers.") and ".lora_" in k for k in keys)
    assert len(keys) == 2 * 7 * 2  # A and B of 7 projections in 2 layers: LoRA's adapter, key for key
    train(config("split"), stop_after=4, out=io.StringIO())
    resumed = train(config("split", resume="true"), out=io.StringIO())
    assert resumed.losses == {s: v for s, v in whole.losses.items() if s > 4}

    # `gapless export --merge`: the adapter merged into the dequantised NF4 base, from the adapter or a checkpoint
    from gapless.model.lora import load_adapter
    from gapless.train.export import export

    ids = torch.randint(0, 20, (1, 16), generator=torch.Generator().manual_seed(0))
    qlora_model, _ = load_adapter(gapless.load_model(model_dir), whole.final_dir)
    with torch.no_grad():
        plain = qlora_model.eval()(ids)  # the adapter on the unquantised base
        expected = to_qlora(qlora_model, torch.float32).eval()(ids)
    assert (plain - expected).abs().max() > 1e-3  # so the parity below shows the merge used the NF4 base
    for source in (whole.run_dir, whole.run_dir / "checkpoints" / "step-00000006"):
        merged = export(source, tmp_path / f"merged-{source.name}", merge=True, dtype="float32")
        with torch.no_grad():
            assert_close(gapless.load_model(merged).eval()(ids), expected, atol=1e-5, rtol=0)


def test_bench_rows_for_qlora_and_full(tmp_path, monkeypatch):
    # `gapless bench` with the methods on the CPU (the sdpa path; the GPU configs qlora_best, full_best use varlen)
    import json

    import numpy as np

    from gapless import bench, cli

    tiny = {"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text(json.dumps(tiny))
    (tmp_path / "lengths.txt").write_text(" ".join(map(str, np.random.default_rng(0).integers(5, 60, 100))))
    monkeypatch.setitem(bench.CONFIGS, "q_cpu", bench.Recipe("packed", "sdpa", "fused", method="qlora"))
    monkeypatch.setitem(bench.CONFIGS, "f_cpu", bench.Recipe("packed", "sdpa", "fused", method="full"))
    assert cli.main(["bench", "--model", str(tmp_path / "tiny"), "--lengths", str(tmp_path / "lengths.txt"),
                     "--max-seq-len", "64", "--tokens-per-batch", "128", "--steps", "2", "--warmup", "1",
                     "--profile-steps", "1", "--out", str(tmp_path / "results.jsonl"), "--config", "q_cpu,f_cpu",
                     "--dtype", "float32"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [(r["method"], r["error"]) for r in rows] == [("qlora", None), ("full", None)]
    assert rows[0]["lora"]["r"] == 16 and rows[1]["lora"] is None and all(r["real_tok_s"] > 0 for r in rows)


def test_adapter_loads_in_peft_on_a_bitsandbytes_model(tmp_path):
    # the seed's stack: transformers + bitsandbytes NF4 (double quantisation) + PEFT, on bitsandbytes' CPU backend
    pytest.importorskip("bitsandbytes")
    import peft
    import transformers

    from gapless.demo import write_base_model

    folder = write_base_model(tmp_path / "base", seed=0)  # float32 weights: both sides quantise the same values
    cfg = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                          bnb_4bit_compute_dtype=torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, quantization_config=cfg, dtype=torch.float32,
                                                           device_map="cpu").eval()
    ours = apply_qlora(gapless.load_model(folder), LoraConfig(r=4, alpha=8), torch.float32).eval()
    differ = total = 0
    for name, layer in ours.named_modules():
        if isinstance(layer, QLoraLinear):
            w = hf.get_submodule(name).weight
            state = w.quant_state
            assert torch.equal(w.data.view(-1), layer.weight_packed), name  # the same NF4 codes and packing
            assert torch.equal(state.state2.absmax, layer.weight_absmax_scale) and torch.equal(state.offset,
                                                                                             layer.weight_offset)
            differ += int((state.absmax != layer.weight_absmax_q).sum())
            total += state.absmax.numel()
            # bitsandbytes' CPU library rounds a few 8-bit scale codes the other way (kernels/nf4.py; on CUDA they
            # are equal): take its codes so both sides hold the same state
            layer.weight_absmax_q.copy_(state.absmax)
            assert torch.equal(layer.weight, bnb_dequantize(w)), name  # then the same weights, bit for bit
    assert differ <= 0.005 * total, (differ, total)  # 12 of 6,144 for this model
    ids = torch.randint(0, 40, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        # bitsandbytes' CPU 4-bit matmul is not a float32 matmul (up to ~2e-3 per layer on these weights): its
        # distance from ours without an adapter is the yardstick the adapter's parity is held to
        before = ours(ids)
        yardstick = (hf(ids).logits - before).abs().max()
        for layer in ours.modules():
            if isinstance(layer, QLoraLinear):
                nn.init.normal_(layer.lora_B.weight, std=0.05)
        expected = ours(ids)
    save_adapter(ours, tmp_path / "adapter", base_model_name_or_path=str(folder))
    reference = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    with torch.no_grad():
        got = reference(ids).logits
    assert yardstick < 0.05 and (expected - before).abs().max() > 10 * yardstick  # the adapter matters
    assert (got - expected).abs().max() <= 2 * yardstick + 1e-4


def bnb_dequantize(weight):
    import bitsandbytes.functional as bnbf

    return bnbf.dequantize_4bit(weight.data, weight.quant_state)


@pytest.mark.parametrize("kernel, dropout", [("reference", 0.0), ("grouped", 0.05)])
def test_decoder_layers_trace_as_one_graph(tmp_path, kernel, dropout):
    # dynamo over each decoder layer as compile_layers compiles it (dynamic shapes), forward and backward, with no
    # graph break (fullgraph) and exactly the eager result: in a compiled layer the dequantisation is in the graph
    from gapless.demo import write_base_model

    folder = write_base_model(tmp_path / "base", seed=0)
    model = apply_qlora(gapless.load_model(folder), LoraConfig(r=4, alpha=8, dropout=dropout, kernel=kernel),
                        torch.float32).train()
    ids = torch.randint(0, 20, (2, 16), generator=torch.Generator().manual_seed(0))
    grad = lambda: model.model.layers[0].mlp.up_proj.lora_A.weight.grad  # noqa: E731
    torch.manual_seed(1)
    eager = model(ids).square().mean()
    eager.backward()
    eager_grad = grad().clone()
    model.zero_grad()
    torch._dynamo.reset()
    for layer in model.model.layers:
        layer.compile(backend="eager", fullgraph=True, dynamic=True)
    torch.manual_seed(1)
    traced = model(ids).square().mean()
    traced.backward()
    assert torch.equal(traced, eager) and torch.equal(grad(), eager_grad)
def test_merged_export_of_a_bf16_qlora_run_quantises_what_the_run_quantised(tmp_path):
    """A bfloat16 QLoRA run from a float32 checkpoint quantised its bf16-rounded weights: `gapless export --merge`
    (which loads in float32) merges into those NF4 codes, the model the run trained, not into the float32 weights'
    codes, a few of which differ."""
    import io

    from gapless import demo_task
    from gapless.config import load_config
    from gapless.demo import write_base_model
    from gapless.model.lora import merge_lora
    from gapless.model.method import method_of
    from gapless.train.export import export
    from gapless.train.loop import train

    model_dir = write_base_model(tmp_path / "base", seed=0)
    assert gapless.load_model(model_dir).model.embed_tokens.weight.dtype == torch.float32
    data = demo_task.write_jsonl(demo_task.make_examples(40, seed=1), tmp_path / "train.jsonl")
    raw = {"model": {"path": str(model_dir), "dtype": "bfloat16", "device": "cpu", "compile": False},
           "data": {"sources": [{"path": str(data), "format": "messages"}], "max_seq_len": 64,
                    "tokens_per_batch": 128, "cache_dir": str(tmp_path / "cache"), "num_workers": 0},
           "method": "qlora", "lora": {"r": 4, "alpha": 8}, "optim": {"lr": 1e-2}, "checkpoint": {"every": 2},
           "train": {"steps": 2, "log_every": 1}, "output_dir": str(tmp_path / "run"), "progress": False}
    cfg = load_config(data=raw)
    run = train(cfg, out=io.StringIO())
    trained, _ = method_of(cfg).load_final(run.final_dir, model_dir, torch.float32, "cpu")
    want = merge_lora(trained).state_dict()
    name = "model.layers.0.self_attn.q_proj.weight"
    for source in (run.run_dir, run.run_dir / "checkpoints" / "step-00000002"):  # the adapter; the checkpoint
        merged = export(source, tmp_path / f"merged-{source.name}", merge=True, dtype="float32")
        assert_close(gapless.load_model(merged).state_dict()[name], want[name], atol=1e-6, rtol=0)
    # without the rounding: the float32 weights' own NF4 codes, which differ
    plain, _ = method_of(cfg).load_final(run.final_dir, model_dir, torch.float32, "cpu", unquantised_base=True)
    assert (merge_lora(to_qlora(plain, torch.float32)).state_dict()[name] - want[name]).abs().max() > 1e-6
