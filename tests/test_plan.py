"""`gapless plan`: the GPU table, the single-GPU prediction against the H200 runs it is built from (within 10%),
traffic and efficiency on known inputs, the plain statement of where more GPUs stop paying, and the command."""
import json
import math

import numpy as np
import pytest
import yaml

from gapless import demo_task
from gapless.cli import main
from gapless.demo import write_base_model
from gapless.diagnosis.plan import (GPUS, H200_RUNS, Workload, comm_seconds, flops_per_token, gpu_from_name,
                                    parse_gpus, predict, single_gpu_tokens_per_s, stated_mfu, verdicts)
from gapless.meter.flops import matmul_weights
from gapless.model.loading import read_model_args
from pathlib import Path

BENCH_MODELS = Path(__file__).resolve().parents[1] / "bench" / "models"


def test_gpu_table_and_names():
    assert [(g.name, n) for g, n in parse_gpus("GB10, h100,H100x8,a100-40x2,4090,RTX5090,rtx5090x2")] == \
        [("GB10", 1), ("H100", 1), ("H100", 8), ("A100-40", 2), ("RTX4090", 1), ("RTX5090", 1), ("RTX5090", 2)]
    assert set(GPUS) == {"GB10", "A100-40", "A100-80", "H100", "H200", "B200", "L40S", "RTX4090", "RTX5090"}
    with pytest.raises(ValueError, match="not a known GPU"):
        parse_gpus("V100x8")
    assert gpu_from_name("NVIDIA H200").name == "H200" and gpu_from_name("NVIDIA A100-SXM4-40GB").name == "A100-40"
    assert GPUS["GB10"].unified and GPUS["H200"].memory_gib == pytest.approx(131.3, abs=0.1)


def test_stated_mfu_interpolates_in_log_weights():
    for weights, mfu, _ in H200_RUNS.values():
        assert stated_mfu(weights) == pytest.approx(mfu)
    assert stated_mfu(100_000_000) == pytest.approx(0.5367)  # held at the nearest measured model
    w1, w8 = H200_RUNS["llama-3.2-1b"][0], H200_RUNS["llama-3.1-8b"][0]
    mid = int(math.sqrt(w1 * H200_RUNS["llama-3.2-3b"][0]))
    assert 0.5367 < stated_mfu(mid) < 0.5836 and stated_mfu(w8 * 4) == pytest.approx(0.6541)


@pytest.mark.parametrize("model", sorted(H200_RUNS))
def test_single_h200_prediction_within_10_percent_of_the_measured_runs(shared, model):
    """The chain from a config's model and lengths to tokens/s reproduces each `gapless bench` row on the H200,
    and the 3B predicted from the 1B and 8B runs alone (leave one out) is within 10% too."""
    lengths = np.minimum(np.loadtxt(shared / "peers" / "lengths_shared_mix.txt", dtype=np.int64), 4096)
    args = read_model_args(BENCH_MODELS / model)
    weights, mfu, measured = H200_RUNS[model]
    assert matmul_weights(args) == weights
    toks, source = single_gpu_tokens_per_s(GPUS["H200"], flops_per_token(args, lengths), weights)
    assert abs(toks / measured - 1) < 0.10, (toks, measured, source)
    if model == "llama-3.2-3b":
        others = [(w, m) for k, (w, m, _) in H200_RUNS.items() if k != model]
        loo_mfu = float(np.interp(math.log(weights), [math.log(w) for w, _ in others], [m for _, m in others]))
        assert abs(toks * loo_mfu / mfu / measured - 1) < 0.10


def workload(**changes) -> Workload:
    # Llama-3.2-3B-like LoRA r16: 24.3 M float32 trainable, 3.6 B parameters, 13.74 GFLOP per token (shared mix)
    base = dict(tokens=4.5e6 * 3, tokens_per_gpu_step=16_300, micro_batches=1, flops_token=13.74e9,
                weights=3_212_574_720, params=3_606_752_256, trainable=24_313_856, param_bytes=2, grad_bytes=4)
    return Workload(**{**base, **changes})


def test_traffic_formulas():
    w = workload()
    # DDP: 2 (n-1)/n x 24.3 M x 4 bytes / 450 GB/s
    assert comm_seconds(w, 8, "ddp", 450) == pytest.approx(2 * 7 / 8 * 24_313_856 * 4 / 450e9)
    # FSDP2, 2 micro-batches: 2 x (n-1)/n x (2 x 3.6 B x 2 bytes + 24.3 M x 4 bytes) / 450 GB/s
    w2 = workload(micro_batches=2)
    assert comm_seconds(w2, 8, "fsdp2", 450) == pytest.approx(2 * 7 / 8 * (2 * 3_606_752_256 * 2 + 24_313_856 * 4)
                                                              / 450e9)
    assert comm_seconds(w, 1, "ddp", 450) == 0.0


def test_prediction_on_known_inputs():
    w = workload()
    p1 = predict(w, GPUS["H200"], 1, startup_s=86)
    # MFU 0.5836 x 776 TFLOP/s / 13.74 GFLOP = 32,960 tok/s; 16,300 tokens per step -> 0.4945 s
    assert p1.tokens_per_s_1 == pytest.approx(0.5836 * 776e12 / 13.74e9, rel=1e-3)
    assert p1.steps == math.ceil(13.5e6 / 16_300) and p1.efficiency == 1.0
    assert p1.total_s == pytest.approx(86 + p1.steps * 16_300 / p1.tokens_per_s_1)
    assert p1.gpu_hours == pytest.approx(p1.total_s / 3600)
    p8 = predict(w, GPUS["H200"], 8, startup_s=86)
    assert p8.strategy == "ddp" and 0.99 < p8.efficiency < 1.0 and p8.steps == math.ceil(p1.steps / 8)
    # an H100 has the H200's peak: the same rate; an L40S gets 362 / 989 of it
    assert predict(w, GPUS["H100"], 1).tokens_per_s_1 == pytest.approx(p1.tokens_per_s_1)
    assert predict(w, GPUS["L40S"], 1).tokens_per_s_1 == pytest.approx(p1.tokens_per_s_1 * 362 / 989)
    # a measured rate on the H200 carries to the B200 by the ratio of peaks
    toks, _ = single_gpu_tokens_per_s(GPUS["B200"], w.flops_token, w.weights, measured=(34_100, GPUS["H200"]))
    assert toks == pytest.approx(34_100 * 2250 / 989)


def test_where_more_gpus_stop_paying():
    w = workload()
    preds = verdicts([predict(w, GPUS["H200"], n, startup_s=86) for n in (1, 8)])
    assert "the model fits one GPU with room" in preds[1].verdict
    assert "less than the start-up" in preds[1].verdict  # 13.5 M tokens / 8 GPUs: ~51 s of training
    # full fine-tuning of a 14 B model over PCIe: 26 GiB of bf16 weights do not fit one 24 GB card, and FSDP2's
    # traffic (3/4 x 84 GB per 4,096-token step at 32 GB/s: 2.0 s) against 4.1 s of compute: 67%
    full = workload(params=14_000_000_000, trainable=14_000_000_000, grad_bytes=2, weights=13_000_000_000,
                    flops_token=84e9, tokens=1e9, tokens_per_gpu_step=4096)
    preds = verdicts([predict(full, GPUS["RTX4090"], n) for n in (1, 4)])
    assert preds[0].verdict.startswith("does not fit")
    assert preds[1].strategy == "fsdp2" and preds[1].efficiency < 0.8 and "stop: efficiency" in preds[1].verdict


def test_plan_command_on_the_demo(tmp_path, capsys):
    model = write_base_model(tmp_path / "base", seed=0)
    data = demo_task.write_jsonl(demo_task.make_examples(200, seed=1), tmp_path / "train.jsonl")
    raw = {"model": {"path": str(model)}, "data": {"sources": [{"path": str(data)}], "max_seq_len": 64,
                                                   "tokens_per_batch": 256, "cache_dir": str(tmp_path / "cache"),
                                                   "num_workers": 0},
           "train": {"epochs": 3}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    assert main(["plan", str(tmp_path / "c.yaml"), "--gpus", "GB10,H100,H100x8", "--measured", "20000@H200"]) == 0
    out = capsys.readouterr().out
    assert "H100x8" in out and "GB10x1" in out and "measured 20,000 tok/s on H200" in out
    assert "needs methods:" in out and "start-up" in out


def test_measured_rate_from_a_run_folder(tmp_path):
    from gapless.diagnosis.plan import measured_from_run

    run = tmp_path / "run"
    run.mkdir()
    lines = [{"step": 10, "loss": 2.0, "tokens_per_s": 5_000.0},  # the window with the compile: left out
             {"step": 10, "kind": "time"}, {"step": 20, "loss": 1.9, "tokens_per_s": 30_000.0},
             {"step": 30, "loss": 1.8, "tokens_per_s": 32_000.0}, {"step": 40, "loss": 1.7, "tokens_per_s": 31_000.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert measured_from_run(run) == (31_000.0, None)
    (run / "environment.json").write_text(json.dumps({"gpu": {"gpus": [{"name": "NVIDIA H100 80GB HBM3"}]}}))
    assert measured_from_run(run) == (31_000.0, "NVIDIA H100 80GB HBM3")
    with pytest.raises(ValueError, match="metrics.jsonl not found"):
        measured_from_run(tmp_path)


@pytest.mark.gpu
def test_plan_uses_the_measured_peak_of_the_gpu_here(tmp_path):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from gapless.config import load_config
    from gapless.diagnosis.plan import plan

    here = gpu_from_name(torch.cuda.get_device_name(0))
    model = write_base_model(tmp_path / "base", seed=0)
    data = demo_task.write_jsonl(demo_task.make_examples(200, seed=1), tmp_path / "train.jsonl")
    cfg = load_config(data={"model": {"path": str(model)}, "data": {"sources": [{"path": str(data)}], "max_seq_len": 64,
                                                                     "tokens_per_batch": 256, "num_workers": 0,
                                                                     "cache_dir": str(tmp_path / "cache")}})
    (p,), _ = plan(cfg, here.name)
    assert "measured peak" in p.source
