"""Full fine-tuning pieces: every weight trains and the loss falls; bf16 weights with float32 master weights and
gradients (gapless.train.optim.MasterWeights) resume bit-exactly; the result is an HF folder transformers loads."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import gapless
from gapless.config import OptimConfig
from gapless.model.export import save_pretrained
from gapless.train.optim import MasterWeights, build_optimizer, clip_grad_norm

G = torch.Generator().manual_seed(3)
IDS, TARGETS = torch.randint(0, 96, (2, 4, 12), generator=G)  # 4 rows: 2 micro-batches of 2


def _loss(model, ids, targets):
    return F.cross_entropy(model(ids).float().flatten(0, 1), targets.flatten())


def _setup(folder, dtype):
    model = gapless.load_model(folder, dtype=dtype).train()
    model.requires_grad_(True)  # full fine-tuning: every weight trains
    if dtype == torch.float32:
        return model, None, build_optimizer(model.parameters(), OptimConfig(lr=1e-3), "cpu")
    masters = MasterWeights(model.named_parameters())
    opt = build_optimizer(masters.masters, OptimConfig(lr=1e-3), "cpu")
    masters.attach(opt)
    return model, masters, opt


def _step(model, masters, opt):
    for i in range(2):  # two micro-batches, each half of the step's tokens: mean of the two means
        (_loss(model, IDS[i * 2:(i + 1) * 2], TARGETS[i * 2:(i + 1) * 2]) / 2).backward()
    clip_grad_norm(masters.masters if masters else model.parameters(), 1.0)
    opt.step()  # the masters' step hook rounds them into the model
    opt.zero_grad(set_to_none=True)


def test_full_fine_tuning_lowers_the_loss(hf_checkpoint):
    _, folder = hf_checkpoint("llama")
    for dtype in (torch.float32, torch.bfloat16):
        model, masters, opt = _setup(folder, dtype)
        assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == \
            sum(p.numel() for p in model.parameters())
        with torch.no_grad():
            before = _loss(model, IDS, TARGETS).item()
        for _ in range(15):
            _step(model, masters, opt)
        with torch.no_grad():
            after = _loss(model, IDS, TARGETS).item()
        assert after < 0.7 * before, (dtype, before, after)  # memorising 48 tokens: ~4.6 -> well under 3


def test_master_weights_hold_float32_gradients_and_free_the_bf16_ones(hf_checkpoint):
    _, folder = hf_checkpoint("qwen2")
    model, masters, _ = _setup(folder, torch.bfloat16)
    assert all(m.dtype == torch.float32 for m in masters.masters)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    grads = []
    for i in range(2):
        ref = copy.deepcopy(model)  # deepcopy drops hooks: plain bf16 autograd, one micro-batch at a time
        _loss(ref, IDS[i * 2:(i + 1) * 2], TARGETS[i * 2:(i + 1) * 2]).backward()
        grads.append({n: p.grad.float() for n, p in ref.named_parameters()})
    for i in range(2):
        _loss(model, IDS[i * 2:(i + 1) * 2], TARGETS[i * 2:(i + 1) * 2]).backward()
    assert all(p.grad is None for p in model.parameters())  # folded into the masters and freed
    assert masters.active and MasterWeights(
        (n, p.float().requires_grad_()) for n, p in model.named_parameters()).active is False
    for name, m in masters.state_dict().items():
        # the float32 sum of the two bf16 micro-batch gradients, exactly (bf16 -> fp32 is exact, one fp32 add)
        assert torch.equal(m.grad, grads[0][name] + grads[1][name]), name


def test_small_updates_survive_in_the_master(hf_checkpoint):
    # an update of 1e-4 of a weight near 1 is below bf16's resolution (2^-8 = 0.4%): applied to bf16 weights it
    # vanishes, in the float32 master it accumulates until the rounded weight moves
    _, folder = hf_checkpoint("llama")
    model, masters, _ = _setup(folder, torch.bfloat16)
    norm = model.model.norm.weight
    master = masters.state_dict()["model.norm.weight"]
    start = norm.detach().clone()
    lost = start.clone()
    for _ in range(60):
        with torch.no_grad():
            master += 1e-4
        masters.copy_to_model()
        lost += 1e-4  # the same update on a bf16 copy of the weight
    assert torch.equal(lost, start)  # 1e-4 added to bf16 values near 1 rounds back, 60 times
    assert (norm.float() - start.float()).abs().max() > 3e-3  # 60 x 1e-4 = 6e-3 reached the model


def test_resume_is_bit_exact(hf_checkpoint):
    _, folder = hf_checkpoint("llama", tie_word_embeddings=True)
    model, masters, opt = _setup(folder, torch.bfloat16)
    for _ in range(2):
        _step(model, masters, opt)
    saved = copy.deepcopy({"masters": masters.state_dict(), "optimizer": opt.state_dict()})  # a checkpoint
    for _ in range(2):
        _step(model, masters, opt)

    resumed, resumed_masters, resumed_opt = _setup(folder, torch.bfloat16)
    resumed_masters.load_state_dict(saved["masters"])
    resumed_opt.load_state_dict(saved["optimizer"])
    for _ in range(2):
        _step(resumed, resumed_masters, resumed_opt)
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    for name, m in masters.state_dict().items():
        assert torch.equal(m, resumed_masters.state_dict()[name]), name


def test_final_save_is_an_hf_folder(hf_checkpoint, tmp_path):
    import transformers

    _, folder = hf_checkpoint("qwen2")
    model, masters, opt = _setup(folder, torch.bfloat16)
    for _ in range(3):
        _step(model, masters, opt)
    out = save_pretrained(model, tmp_path / "final")
    ours = gapless.load_model(out, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(ours.model.layers[1].mlp.up_proj.weight, model.model.layers[1].mlp.up_proj.weight.float())
        hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        assert_close(hf(IDS).logits, ours(IDS), atol=1e-4, rtol=0)


# -- the same loop (gapless.train.loop.train) with method full, on the demo's tiny Llama

@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> dict:
    from gapless import demo_task
    from gapless.demo import write_base_model

    root = tmp_path_factory.mktemp("full")
    return {"root": root, "model": write_base_model(root / "base", seed=0),
            "data": demo_task.write_jsonl(demo_task.make_examples(200, seed=1), root / "data" / "train.jsonl")}


def loop_config(demo: dict, out: str, **overrides):
    from gapless.config import load_config

    raw = {
        "model": {"path": str(demo["model"]), "dtype": "bfloat16", "device": "cpu"},
        "data": {"sources": [{"path": str(demo["data"]), "format": "messages"}], "max_seq_len": 64,
                 "tokens_per_batch": 128, "cache_dir": str(demo["root"] / "cache"), "num_workers": 0},
        "method": "full",
        "optim": {"lr": 1e-3},
        "schedule": {"kind": "constant", "warmup_steps": 1},
        "checkpoint": {"every": 2, "keep": 2},
        "train": {"steps": 6, "grad_accum": 2, "log_every": 1, "seed": 3},
        "output_dir": str(demo["root"] / out),
        "progress": False,
    }
    return load_config(data=raw, overrides=[f"{k}={v}" for k, v in overrides.items()])


def test_full_run_through_the_loop_lowers_the_loss_and_resumes_bit_exactly(demo):
    import io

    from gapless.train.checkpoint import latest_complete, load
    from gapless.train.loop import train

    whole = train(loop_config(demo, "whole"), out=io.StringIO())
    losses = [whole.losses[s] for s in sorted(whole.losses)]
    assert sum(losses[-2:]) / 2 < 0.9 * losses[0], losses  # each step has other batches: ~4.07 -> ~3.35
    tensors, _ = load(latest_complete(whole.run_dir / "checkpoints"))
    assert tensors["master"]["model.layers.0.mlp.up_proj.weight"].dtype == torch.float32  # the fp32 masters
    assert tensors["model"]["model.layers.0.mlp.up_proj.weight"].dtype == torch.bfloat16
    assert whole.final_dir.name == "model" and (whole.final_dir / "model.safetensors").is_file()

    train(loop_config(demo, "split"), stop_after=4, out=io.StringIO())  # "killed" after the step-4 checkpoint
    resumed = train(loop_config(demo, "split", resume="true"), out=io.StringIO())
    assert resumed.losses == {s: v for s, v in whole.losses.items() if s > 4}  # bit-exact: equal floats
    final = gapless.load_model(whole.final_dir, dtype=torch.bfloat16)
    again = gapless.load_model(resumed.final_dir, dtype=torch.bfloat16)
    for (name, a), b in zip(final.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name

    from gapless.train.export import export

    exported = gapless.load_model(export(whole.run_dir, demo["root"] / "exported"), dtype=torch.bfloat16)
    for (name, a), b in zip(final.state_dict().items(), exported.state_dict().values()):
        assert torch.equal(a, b), name  # the last checkpoint's float32 masters, rounded as the run rounded them


def test_fp16_run_counts_its_skipped_steps(demo):
    import io
    import json

    from gapless.train.loop import train

    result = train(loop_config(demo, "fp16", **{"model.dtype": "float16", "train.steps": 4}), out=io.StringIO())
    records = [r for r in map(json.loads, open(result.run_dir / "metrics.jsonl")) if "loss" in r]
    assert all("loss_scale" in r and "skipped_steps" in r for r in records)
    assert all(math.isfinite(r["loss"]) for r in records)
    # steps run at 2^16 unless an overflow halved it; every halving is one counted skip
    assert records[-1]["loss_scale"] * 2 ** records[-1]["skipped_steps"] == 2.0 ** 16


def test_export_of_a_full_run_without_checkpoints_writes_its_model(demo, tmp_path, capsys):
    """checkpoint.every: 0 leaves a full run only its model/: `gapless export RUN` writes it (in --dtype), where it
    said the run held no adapter or checkpoint; and the CLI says it wrote a model, not a PEFT adapter."""
    import io
    import json

    import transformers

    from gapless import cli, demo_task
    from gapless.train.loop import train

    run = train(loop_config(demo, "no-checkpoints", **{"checkpoint.every": 0, "train.steps": 2}), out=io.StringIO())
    assert not (run.run_dir / "checkpoints").exists() or not any((run.run_dir / "checkpoints").iterdir())
    assert cli.main(["export", str(run.run_dir), "--out", str(tmp_path / "fp32"), "--dtype", "float32"]) == 0
    assert capsys.readouterr().out.strip() == f"wrote model to {tmp_path / 'fp32'}"
    assert json.loads((tmp_path / "fp32" / "config.json").read_text())["dtype"] == "float32"
    final = gapless.load_model(run.final_dir, dtype=torch.float32)
    exported = gapless.load_model(tmp_path / "fp32", dtype=torch.float32)
    for (name, a), b in zip(final.state_dict().items(), exported.state_dict().values()):
        assert torch.equal(a, b), name  # the run's bf16 weights, exactly
    assert (tmp_path / "fp32" / "tokenizer.json").is_file()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp32").eval()
    ids = torch.randint(5, demo_task.vocab_size(), (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_close(hf(ids).logits, exported(ids), atol=1e-4, rtol=0)
