"""The memory model (gapless.meter.memory) on shapes counted by hand, against the built model, and against the
H200 peaks it was fitted to (bench/results.jsonl)."""
import re
from pathlib import Path

import pytest
import torch
import yaml

from gapless.config import LoraConfig
from gapless.meter.memory import (GIB, auto_tokens, dropout_mask_bytes, estimate_memory, format_table, max_tokens,
                                  parameter_count)
from gapless.model.decoder import CausalLM, ModelArgs
from gapless.model.loading import read_model_args
from gapless.model.lora import apply_lora

MODELS = Path(__file__).resolve().parents[1] / "bench" / "models"
TINY = ModelArgs(model_type="llama", vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def test_parameter_counts_by_hand_and_against_the_model():
    # per layer: q 64x64 + k, v 64x32 + o 64x64 + gate, up, down 64x128 = 36,864; + 2 norms of 64 = 36,992;
    # x 2 layers + embeddings and lm_head 100 x 64 each + the final norm 64 = 86,848
    assert parameter_count(TINY) == (86_848, 2 * 36_864)
    with torch.device("meta"):
        model = CausalLM(TINY)
    assert sum(p.numel() for p in model.parameters()) == 86_848
    apply_lora(model, LoraConfig(r=4))
    # LoRA r=4: 4 x (in + out) per projection: 512 + 384 + 384 + 512 + 3 x 768 = 4,096 per layer
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == 8_192


def _rows(est):
    return {name: b for name, b, _ in est.rows}


def test_lora_components_by_hand():
    est = estimate_memory(TINY, "lora", tokens=1000, lora_r=4, loss_chunk=256)
    rows = _rows(est)
    assert rows["weights"] == 86_848 * 2
    assert rows["trainable fp32 copies"] == 8_192 * 4
    assert rows["gradients"] == 8_192 * 4
    assert rows["optimizer state"] == 8_192 * 8
    # 2 layers x (14.66 x 64 + 5.60 x 128) B per token
    assert rows["activations"] == pytest.approx(1000 * 2 * (14.66 * 64 + 5.60 * 128))
    assert rows["loss working set"] == 256 * 100 * 6 + 1000 * 64 * 2
    assert rows["allocator reserve"] == pytest.approx(0.05 * (est.total_bytes - rows["allocator reserve"]))
    assert est.fixed_bytes + 1000 * est.per_token_bytes == pytest.approx(est.total_bytes)


def test_full_and_qlora_components_by_hand():
    full = _rows(estimate_memory(TINY, "full", tokens=512, loss_chunk=256))
    assert full["weights"] == 86_848 * 2
    assert full["trainable fp32 copies"] == 86_848 * 4  # fp32 masters
    assert full["gradients"] == 86_848 * 4 + 64 * 128 * 2  # + the largest bf16 gradient (an MLP weight)
    assert full["optimizer state"] == 86_848 * 8
    full32 = _rows(estimate_memory(TINY, "full", tokens=512, dtype="float32"))
    assert full32["trainable fp32 copies"] == 0 and full32["gradients"] == 86_848 * 4  # trains in place

    q = _rows(estimate_memory(TINY, "qlora", tokens=512, lora_r=4, lora_targets=["q_proj", "down_proj"]))
    targeted = 2 * (64 * 64 + 128 * 64)
    assert q["weights"] == pytest.approx(targeted * (0.5 + 1 / 64 + 4 / 16384) + (86_848 - targeted) * 2)
    assert q["trainable fp32 copies"] == 2 * 4 * (128 + 192) * 4
    assert q["dequantised weights"] == targeted / 2 * 2


def test_activation_checkpointing_keeps_layer_inputs():
    off = _rows(estimate_memory(TINY, "lora", tokens=100))["activations"]
    on = _rows(estimate_memory(TINY, "lora", tokens=100, activation_checkpointing=1))["activations"]
    layer = 14.66 * 64 + 5.60 * 128
    assert off == pytest.approx(100 * 2 * layer)
    assert on == pytest.approx(100 * (2 * 64 * 2 + layer))  # two inputs kept, one layer recomputed at a time
    eager = _rows(estimate_memory(TINY, "lora", tokens=100, compiled=False))["activations"]
    assert eager == pytest.approx(1.34 * off)


def test_lora_dropout_masks_by_hand():
    # grouped: one mask for q/k/v (64) and one for gate/up (64), o_proj's (64 = 4 heads x 16) and down_proj's (128)
    assert dropout_mask_bytes(TINY) == 64 + 64 + 64 + 128
    assert dropout_mask_bytes(TINY, kernel="concat") == 320  # concat runs grouped under dropout
    assert dropout_mask_bytes(TINY, kernel="reference") == 6 * 64 + 128  # one per projection
    assert dropout_mask_bytes(TINY, ["q_proj", "v_proj", "down_proj"]) == 64 + 128
    off = _rows(estimate_memory(TINY, "lora", tokens=100))["activations"]
    on = _rows(estimate_memory(TINY, "lora", tokens=100, lora_dropout=0.05))["activations"]
    assert on - off == pytest.approx(100 * 2 * 320)
    assert _rows(estimate_memory(TINY, "full", tokens=100, lora_dropout=0.05))["activations"] == \
        _rows(estimate_memory(TINY, "full", tokens=100))["activations"]  # full fine-tuning has no LoRA dropout
    # the H200 row it was checked against (run 20261204T172451Z-h200, 3B best_dropout, 56.79 GiB): within 5%
    est = estimate_memory(read_model_args(MODELS / "llama-3.2-3b"), "lora", tokens=16_384, lora_dropout=0.05)
    assert est.allocated_gib == pytest.approx(56.79, rel=0.05)


def test_lora_dropout_fused_keeps_no_masks():
    """Fused LoRA dropout (method lora on CUDA with triton, gapless.kernels.lora_dropout) keeps a seed, not a mask;
    QLoRA's layers keep the torch path and their masks."""
    def activations(method, **kw):
        return _rows(estimate_memory(TINY, method, tokens=100, **kw))["activations"]

    off = activations("lora")
    assert activations("lora", lora_dropout=0.05, lora_dropout_fused=True) == off
    assert activations("lora", lora_dropout=0.05) - off == pytest.approx(100 * 2 * 320)
    assert activations("qlora", lora_dropout=0.05, lora_dropout_fused=True) - activations("qlora") == \
        pytest.approx(100 * 2 * 320)


def test_estimate_kwargs_counts_no_masks_for_fused_dropout_on_a_gpu():
    """A GPU run (the default: plans for GPUs made anywhere) with lora.fused_dropout keeps no masks; a CPU run or
    lora.fused_dropout false counts them."""
    from gapless.config import DataConfig, ModelConfig, RunConfig
    from gapless.meter.memory import estimate_kwargs

    def cfg(fused):
        return RunConfig(ModelConfig(path="m"), DataConfig(), lora=LoraConfig(dropout=0.05, fused_dropout=fused))

    assert estimate_kwargs(cfg(True))["lora_dropout_fused"]
    assert not estimate_kwargs(cfg(True), compiled=False, gpu=False)["lora_dropout_fused"]
    assert not estimate_kwargs(cfg(False))["lora_dropout_fused"]


@pytest.mark.parametrize("model, chunk, measured", [
    ("llama-3.2-1b", 4096, 24.23), ("llama-3.2-3b", 4096, 48.24), ("llama-3.2-3b", 2048, 46.78),
    ("llama-3.1-8b", 4096, 87.07),
])
def test_fitted_h200_rows(model, chunk, measured):
    # bench/results.jsonl: compiled, varlen, LoRA r16 on all 7 projections, bf16, 16,384 tokens, no checkpointing
    est = estimate_memory(read_model_args(MODELS / model), "lora", tokens=16_384, loss_chunk=chunk)
    assert est.allocated_gib == pytest.approx(measured, rel=0.015)


def test_qlora_8b_on_a_24_gib_card():
    # the target: Llama-3.1-8B QLoRA, 8,192 tokens per micro-batch, checkpointing every layer: <= 22 GiB
    args = read_model_args(MODELS / "llama-3.1-8b")
    est = estimate_memory(args, "qlora", tokens=8_192, activation_checkpointing=1)
    rows = _rows(est)
    # 6.98B projection weights x 0.516 B + 1.05B embedding/head/norm weights x 2 B = 5.70e9 B = 5.31 GiB
    assert rows["weights"] / GIB == pytest.approx(5.31, abs=0.05)
    assert est.total_gib < 22, format_table(est)
    assert estimate_memory(args, "qlora", tokens=8_192).total_gib > 22  # without checkpointing it does not fit


def test_max_tokens_inverts_the_estimate():
    args = read_model_args(MODELS / "llama-3.2-3b")
    n = max_tokens(args, "lora", 60.0)
    assert estimate_memory(args, "lora", tokens=n).total_gib <= 60.0 < estimate_memory(args, "lora", tokens=n + 1).total_gib
    assert max_tokens(args, "full", 40.0) == 0  # 3.2B x 18 B = 54 GiB before any token


def test_fsdp2_shards_state_not_activations():
    """FSDP2 over 4 GPUs: weights, fp32 copies, gradients and AdamW state / 4; activations and the loss per GPU as
    on one; two layers all-gathered in bf16 (36,864 projection weights + 2 norms of 64, per layer, by hand)."""
    one = _rows(estimate_memory(TINY, "full", tokens=512, loss_chunk=256))
    four = estimate_memory(TINY, "full", tokens=512, loss_chunk=256, shards=4)
    rows = _rows(four)
    for name in ("weights", "trainable fp32 copies", "gradients", "optimizer state"):
        assert rows[name] == pytest.approx(one[name] / 4)
    assert rows["activations"] == one["activations"] and rows["loss working set"] == one["loss working set"]
    assert rows["un-sharded layers"] == 2 * (36_864 + 2 * 64) * 2
    assert four.fixed_bytes + 512 * four.per_token_bytes == pytest.approx(four.total_bytes)
    with pytest.raises(ValueError, match="shards"):
        estimate_memory(TINY, "lora", tokens=1, shards=0)


def test_auto_tokens_is_the_finders_proposal_in_whole_rows():
    args = read_model_args(MODELS / "llama-3.2-3b")
    best = max_tokens(args, "lora", 0.9 * 80)
    n = auto_tokens(args, "lora", 80, 4096)
    assert n % 4096 == 0 and n <= 0.9 * best < n + 4096
    assert auto_tokens(args, "full", 40, 4096) == 0  # not one row fits


def test_table_and_errors():
    text = format_table(estimate_memory(TINY, "qlora", tokens=64))
    for name in ("weights", "optimizer state", "activations", "loss working set", "dequantised weights", "total"):
        assert name in text
    with pytest.raises(ValueError, match="method: 'dora'"):
        estimate_memory(TINY, "dora", tokens=1)
    with pytest.raises(ValueError, match=r"lora targets: \['lm_head'\]"):
        estimate_memory(TINY, "lora", tokens=1, lora_targets=["lm_head"])


def test_dry_run_prints_memory_steps_and_time(shared, tmp_path, capsys):
    import json

    from gapless import cli

    data = tmp_path / "train.jsonl"
    with open(data, "w") as f:
        for i in range(40):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"question {i} " * 30},
                                             {"role": "assistant", "content": f"answer {i} " * 60}]}) + "\n")
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({
        "model": {"path": str(MODELS / "llama-3.1-8b"), "dtype": "bfloat16", "activation_checkpointing": 1},
        "data": {"sources": [{"path": str(data)}], "tokenizer": str(shared / "tokenizers" / "llama3"),
                 "max_seq_len": 4096, "tokens_per_batch": 8192, "cache_dir": str(tmp_path / "cache"),
                 "num_workers": 0},
        "method": "qlora", "train": {"epochs": 2, "grad_accum": 2}, "output_dir": str(tmp_path / "run")}))
    assert cli.main(["train", str(config), "--dry-run", "--gpu-gib", "24", "--tokens-per-s", "4000"]) == 0
    out = capsys.readouterr().out
    assert "predicted peak memory, qlora, bfloat16 (8,192 tokens per micro-batch)" in out
    assert "fits a 24 GiB GPU" in out and "tokens per step: 16,384 slots (2 x 8,192)" in out
    assert "at 4,000 real tokens/s (given)" in out
    assert not (tmp_path / "run").exists()  # nothing ran
    # padded, 2 documents per batch: 20 batches of the 40 an epoch, 2 epochs, 2 per step; the real tokens per step are
    # the 4 documents', not 16,384 x efficiency
    assert cli.main(["train", str(config), "data.batching=padded", "data.rows_per_batch=2", "--dry-run",
                     "--gpu-gib", "24", "--tokens-per-s", "4000"]) == 0
    out = capsys.readouterr().out
    real = re.search(r"tokens per step: 16,384 slots \(2 x 8,192\), at most 4 documents, ~([\d,]+) real at "
                     r"[\d.]+% packing; steps: 20\n", out)
    assert real and int(real[1].replace(",", "")) < 4 * 1000, out

    assert cli.main(["train", str(config), "data.tokens_per_batch=auto", "method=full",
                     "model.activation_checkpointing=0", "--dry-run", "--gpu-gib", "80"]) == 0
    out = capsys.readouterr().out
    assert "data.tokens_per_batch auto: ~" in out and "on a 80 GiB GPU" in out and "stated: 780 TFLOP/s" in out


def test_dry_run_of_a_cpu_run_says_the_stated_rate_does_not_apply(tmp_path, capsys):
    """The demo's config (model.device cpu) without --tokens-per-s: the H200's stated rate (~2e8 tokens/s for this
    model) gave 0.00 h as if it applied; the demo trains ~6,500 tokens/s on the CPU box."""
    from gapless import cli, demo_task
    from gapless.demo import write_base_model

    base = write_base_model(tmp_path / "base", seed=0)
    data = demo_task.write_jsonl(demo_task.make_examples(50, seed=1), tmp_path / "train.jsonl")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"path": str(base), "dtype": "float32", "device": "cpu"},
        "data": {"sources": [{"path": str(data), "format": "messages"}], "max_seq_len": 64, "tokens_per_batch": 1024,
                 "cache_dir": str(tmp_path / "cache"), "num_workers": 0},
        "train": {"steps": 10}, "output_dir": str(tmp_path / "run")}))
    assert cli.main(["train", str(config), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "stated: 780 TFLOP/s" in out and "this run trains on the CPU (model.device cpu)" in out
    assert cli.main(["train", str(config), "--dry-run", "--tokens-per-s", "6500"]) == 0
    assert "trains on the CPU" not in capsys.readouterr().out  # a measured rate: nothing to warn of
