"""`gapless plan`: the GPU table, the single-GPU prediction against the H200 runs it is built from (within 10%),
traffic and efficiency on known inputs, the plain statement of where more GPUs stop paying, and the command."""
import json
import math
import re

import numpy as np
import pytest
import yaml

from gapless import demo_task
from gapless.cli import main
from gapless.demo import write_base_model
from gapless.diagnosis.plan import (GPUS, H200_RUNS, MemorySpec, Workload, comm_seconds, fit_of, flops_per_token,
                                    gpu_from_name, parse_gpus, predict, single_gpu_tokens_per_s, stated_mfu, verdicts,
                                    where_more_stop)
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


LLAMA_3B = read_model_args(BENCH_MODELS / "llama-3.2-3b")
LORA = {"dtype": "bfloat16", "lora_r": 16, "activation_checkpointing": 0, "compiled": True, "loss_chunk": 2048}


def workload(**changes) -> Workload:
    # Llama-3.2-3B-like LoRA r16: 24.3 M float32 trainable, 3.6 B parameters, 13.74 GFLOP per token (shared mix);
    # a global micro-batch of 16,384 slots (4 rows of 4,096) packed at 99.49%: 16,300 real tokens per step
    base = dict(tokens=4.5e6 * 3, tokens_per_batch=16_384, micro_batches=1, efficiency=16_300 / 16_384,
                max_seq_len=4096, flops_token=13.74e9, weights=3_212_574_720, params=3_606_752_256,
                trainable=24_313_856, param_bytes=2, grad_bytes=4, memory=MemorySpec(LLAMA_3B, "lora", LORA))
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
    assert p8.strategy == "ddp" and 0.99 < p8.efficiency < 1.0
    # an H100 has the H200's peak: the same rate; an L40S gets 362 / 989 of it
    assert predict(w, GPUS["H100"], 1).tokens_per_s_1 == pytest.approx(p1.tokens_per_s_1)
    assert predict(w, GPUS["L40S"], 1).tokens_per_s_1 == pytest.approx(p1.tokens_per_s_1 * 362 / 989)
    # a measured rate on the H200 carries to the B200 by the ratio of peaks
    toks, _ = single_gpu_tokens_per_s(GPUS["B200"], w.flops_token, w.weights, measured=(34_100, GPUS["H200"]))
    assert toks == pytest.approx(34_100 * 2250 / 989)


def test_global_batch_is_split_over_the_gpus_as_training_splits_it():
    """data.tokens_per_batch is the global micro-batch (gapless.data.sharding): 8 GPUs train the same tokens per
    optimizer step as one, in the same number of steps, each GPU an eighth of them."""
    w = workload(tokens_per_batch=32_768, micro_batches=2)  # 8 rows of 4,096, 2 micro-batches per step
    p1, p8 = (predict(w, GPUS["H200"], n, startup_s=86) for n in (1, 8))
    assert w.step_tokens(32_768) == pytest.approx(32_768 * 2 * 16_300 / 16_384)
    assert (p1.tokens_per_batch, p1.rank_tokens) == (32_768, 32_768)
    assert (p8.tokens_per_batch, p8.rank_tokens) == (32_768, 4096)
    assert p8.steps == p1.steps == math.ceil(13.5e6 / w.step_tokens(32_768))
    assert p8.compute_s == pytest.approx(p1.compute_s / 8)
    # the memory model sees each GPU's micro-batch: 4,096 slots, not 32,768
    assert p8.peak_ddp_gib == pytest.approx(w.memory.estimate(4096).total_gib)
    assert p8.peak_fsdp2_gib == pytest.approx(w.memory.estimate(4096, shards=8).total_gib)
    assert p8.peak_fsdp2_gib < p8.peak_ddp_gib
    # 3 rows cannot be dealt to 2 GPUs: the same refusal as the sampler's
    (p2,) = verdicts([predict(workload(tokens_per_batch=3 * 4096), GPUS["H200"], 2)], w)
    assert "cannot share equally" in p2.problems[0] and "multiple of 8192" in p2.verdict
    assert predict(workload(batching="padded", tokens_per_batch=16_384), GPUS["H200"], 2).problems[0].startswith(
        "data.batching: 'padded' with 2 processes")


def test_memory_verdicts_and_fixes():
    """3B LoRA at 16,384 tokens: ~49 GiB fits an H200 (131 GiB) and an H100 (74.5) with room, not a 24 GB RTX
    4090, whose fixes are a smaller micro-batch (the same tokens per step), checkpointing and 4 GPUs."""
    w = workload()
    h200, h100, rtx = (predict(w, GPUS[g], 1) for g in ("H200", "H100", "RTX4090"))
    assert h200.fit == "fits" and h200.peak_gib == pytest.approx(w.memory.estimate(16_384).total_gib)
    assert 40 < h200.peak_gib < 50 and h200.fixes == [] and h100.fit == "fits"
    assert rtx.fit == "does not fit"
    fixes = "\n".join(rtx.fixes)
    assert "data.tokens_per_batch: 4,096  train.grad_accum: 4" in fixes  # one row of 4,096 fits 90% of 22.4 GiB
    assert "model.activation_checkpointing: 1 (costs 33% of throughput" in fixes
    assert "method: qlora" not in fixes  # QLoRA shrinks the weights (6 GiB), not 16,384 tokens of activations
    assert "RTX4090x4 (DDP; 18.4 GiB per GPU at 4,096 slots each)" in fixes  # x2: 8,192 do not fit
    # tight: between 90% and 100% of the memory
    assert fit_of(0.95 * 80, 80) == "tight" and fit_of(0.9 * 80, 80) == "fits" and fit_of(81, 80) == "does not fit"
    # Llama-3.1-8B full fine-tuning (~18 B per weight) does not fit one H200; FSDP2 over more H200s does
    big = read_model_args(BENCH_MODELS / "llama-3.1-8b")
    full = workload(method="full", memory=MemorySpec(big, "full", LORA), trainable=8_030_261_248,
                    params=8_030_261_248, grad_bytes=2)
    one = predict(full, GPUS["H200"], 1)
    assert one.fit == "does not fit" and any(f.startswith("H200x2 (FSDP2, parallel.strategy: fsdp;") for f in one.fixes)
    two = predict(full, GPUS["H200"], 2)  # auto: full fine-tuning shards
    assert two.strategy == "fsdp2" and two.fit == "fits" and two.peak_fsdp2_gib < two.peak_ddp_gib
    assert predict(workload(method="qlora"), GPUS["H200"], 2, strategy="fsdp2").problems[0].startswith(
        "method qlora: FSDP2 cannot shard")


def test_auto_tokens_per_batch_is_resolved_per_gpu():
    from gapless.meter.memory import auto_tokens

    w = workload(tokens_per_batch="auto")
    p = predict(w, GPUS["H100"], 1)
    assert p.rank_tokens == auto_tokens(LLAMA_3B, "lora", GPUS["H100"].memory_gib, 4096, **LORA) > 16_384
    assert p.fit == "fits" and not p.problems
    p4 = predict(w, GPUS["H100"], 4)  # auto does not run under torchrun: the plan names the number to set
    assert p4.tokens_per_batch == 4 * p.rank_tokens
    assert f"data.tokens_per_batch: {4 * p.rank_tokens:,}" in p4.problems[0]


def test_rows_per_batch_sets_the_tokens_of_a_step():
    """Padded batches of at most 2 documents of 300 tokens hold 600 real tokens, not 16,384 slots x efficiency: the
    steps are as many as the documents take, 2 a batch; pad_to_max rows are the fewer; auto picks at most 2 rows."""
    padded = workload(batching="padded", efficiency=0.9, rows_per_batch=2, doc_tokens=300.0, micro_batches=2)
    assert padded.step_tokens(16_384) == pytest.approx(2 * 2 * 300)
    assert predict(padded, GPUS["H200"], 1).steps == math.ceil(13.5e6 / 1200)
    assert workload(batching="padded", efficiency=0.9).step_tokens(16_384) == pytest.approx(16_384 * 0.9)
    long_docs = workload(batching="padded", efficiency=0.9, rows_per_batch=8, doc_tokens=4000.0)
    assert long_docs.step_tokens(16_384) == pytest.approx(16_384 * 0.9)  # 4 of them fill the slots first
    to_max = workload(batching="pad_to_max", efficiency=0.1, rows_per_batch=2)
    assert to_max.step_tokens(16_384) == pytest.approx(2 * 4096 * 0.1)
    p = predict(workload(batching="padded", tokens_per_batch="auto", rows_per_batch=2, doc_tokens=300.0),
                GPUS["H100"], 1)
    assert p.rank_tokens == 2 * 4096


def test_where_more_gpus_stop_paying():
    w = workload()
    preds = verdicts([predict(w, GPUS["H200"], n, startup_s=86) for n in (1, 8)], w)
    assert preds[0].verdict.startswith("fits:")
    # 13.5 M tokens / (8 x 32,960 tok/s x 99.4% efficiency): 52 s of training, under the 86 s start-up
    assert any(s.startswith("start-up: training takes 52 s, less than the 86 s start-up") for s in preds[1].stops)
    assert any(s.startswith("one GPU: the run fits one H200 with room") for s in preds[1].stops)
    lines = "\n".join(where_more_stop(w, GPUS["H200"], [8], startup_s=86))
    assert "start-up:   from x8 training takes 52 s, less than the 86 s start-up" in lines  # x4: 103 s
    assert "efficiency: 99% at x8 (ddp), not under 80%" in lines
    assert "=> more H200s stop paying at x8; use x1 to x4 (one GPU per run when there are several runs)" in lines
    # a long run: nothing stops up to x8, and fitting one GPU says "several runs: one GPU each"
    long = "\n".join(where_more_stop(workload(tokens=1e10), GPUS["H200"], startup_s=86))
    assert "=> more H200s pay up to x8 for one run's time; with several runs, one GPU each" in long
    # full fine-tuning of an 8B model over PCIe: FSDP2's traffic (2 x 3/4 x 16 GB of bf16 weights per step at
    # 32 GB/s: 0.75 s) against the L40S's compute of 16,300 tokens / 4 at ~1,300 tok/s: efficiency under 80%
    big = read_model_args(BENCH_MODELS / "llama-3.1-8b")
    full = workload(method="full", memory=MemorySpec(big, "full", LORA), trainable=8_030_261_248,
                    params=8_030_261_248, grad_bytes=2, flops_token=48e9, weights=6_979_321_856, tokens=1e9)
    (p4,) = verdicts([predict(full, GPUS["L40S"], 4)], full)
    assert p4.strategy == "fsdp2" and p4.efficiency < 0.8
    assert any(s.startswith("efficiency") and "PCIe 4.0 x16" in s for s in p4.stops)
    text = "\n".join(where_more_stop(full, GPUS["L40S"], [4]))
    assert re.search(r"efficiency: under 80% from x2 \(\d+%", text) and "does not fit on one L40S" in text
    assert re.search(r"x(\d) is the fewest that fits.*\n.*=> x\1 is the fewest L40Ss that fit and scales at", text)


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
    assert "global batch: data.tokens_per_batch 256 slots is the micro-batch of all GPUs together" in out
    assert "cannot share equally" in out  # 4 rows of 64 over 8 GPUs
    assert "where more H100s stop paying" in out and "start-up" in out and "fits:" in out
    # auto must not crash: resolved per GPU by the memory model
    assert main(["plan", str(tmp_path / "c.yaml"), "data.tokens_per_batch=auto", "--gpus", "H100,H100x2",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["workload"]["tokens_per_batch"] == "auto"
    one, two = result["predictions"]
    assert one["rank_tokens"] % 64 == 0 and one["rank_tokens"] > 256 and "auto does not run" in two["problems"][0]
    assert result["where_more_gpus_stop_paying"][0].startswith("where more H100s stop paying")
    # --strategy takes the config's spelling (parallel.strategy: fsdp) as well as fsdp2
    assert main(["plan", str(tmp_path / "c.yaml"), "--gpus", "H100x2", "--strategy", "fsdp", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["predictions"][0]["strategy"] == "fsdp2"


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


def test_measured_rate_leaves_out_a_torn_last_line(tmp_path):
    """A run killed mid-write (`plan --run`, doctor's step time): the torn last record is left out, as the report
    does; a broken line before the last is an error at file:line, not json's bare message."""
    from gapless.diagnosis.plan import measured_from_run

    lines = [json.dumps({"step": s, "loss": 2.0, "tokens_per_s": 30_000.0}) for s in (10, 20, 30)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 40, "loss": 1.9, "tok')
    assert measured_from_run(tmp_path) == (30_000.0, None)
    (tmp_path / "metrics.jsonl").write_text(lines[0] + '\n{"step": 20, "lo\n' + lines[2] + "\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not JSON"):
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
    (p,), _, _ = plan(cfg, here.name)
    assert "measured peak" in p.source
