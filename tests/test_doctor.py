"""`gapless doctor`: every check fires on a bad setting and stays quiet on a good one.

Environment checks read an environment record, so each test edits a copy of a clean record (a fake H200 machine
or this CPU) instead of the machine; config checks get a config and the facts the doctor would measure. The end
to end tests run the doctor on the demo's tiny model and data: a good config gives no warning or error, exit 0;
a broken one exits 1; `--json` is one object whose findings have ids; the quick checks `gapless train` calls run
without data.
"""
import copy
import json
import re
from types import SimpleNamespace

import pytest
import yaml

from gapless import demo_task
from gapless.cli import main
from gapless.config import load_config
from gapless.demo import write_base_model
from gapless.diagnosis import doctor as d
from gapless.diagnosis.environment import environment_record

H200 = {"index": 0, "name": "NVIDIA H200", "memory_gib": 139.8, "capability": "9.0", "sms": 132, "bf16": True,
        "memory_fraction": 1.0}


def gpu_env(**changes) -> dict:
    """A clean record of a one-H200 machine; `changes` are dotted keys, e.g. {"torch_flags.tf32_matmul": False}."""
    env = {"python": "3.11.7", "cpu_count": 16, "packages": {"torch": "2.11.0+cu130", "transformers": "4.57.0",
                                                              "peft": "0.17.0"},
           "kernels": {"flash-attn-4": "ok", "liger-kernel": "ok", "bitsandbytes": "ok"},
           "gpu": {"torch_cuda": "13.0", "cuda_available": True, "nvidia_smi": "/usr/bin/nvidia-smi", "cudnn": 91000,
                   "nccl": "2.27.7", "driver": "580.65", "gpus": [dict(H200)], "nvlinks_gpu0": 18},
           "torch_flags": {"tf32_matmul": True, "tf32_cudnn": True, "float32_matmul_precision": "high",
                           "cudnn_benchmark": False, "cudnn_deterministic": False, "deterministic_algorithms": False,
                           "threads": 16},
           "env": {}, "gapless": {"path": "/x", "commit": "a" * 40, "dirty": False, "install": "editable"}}
    for key, value in changes.items():
        node = env
        *parts, last = key.split(".")
        for p in parts:
            node = node[int(p)] if isinstance(node, list) else node[p]
        node[last] = value
    return env


def cpu_env() -> dict:
    env = gpu_env()
    env["gpu"] = {"torch_cuda": None, "cuda_available": False, "nvidia_smi": None, "cudnn": None, "nccl": None,
                  "driver": None, "gpus": []}
    return env


def severities(findings) -> dict[str, str]:
    return {f.id: f.severity for f in findings}


def bad(findings) -> list:
    return [f for f in findings if f.severity in ("warning", "error")]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo's tiny model and 300 examples; a good CPU config for it (packed, float32)."""
    root = tmp_path_factory.mktemp("doctor")
    model = write_base_model(root / "base", seed=0)
    data = demo_task.write_jsonl(demo_task.make_examples(300, seed=1), root / "data" / "train.jsonl")
    raw = {"model": {"path": str(model), "dtype": "float32", "device": "cpu"},
           "data": {"sources": [{"path": str(data), "format": "messages"}], "max_seq_len": 64,
                    "tokens_per_batch": 256, "batching": "packed", "cache_dir": str(root / "cache"), "num_workers": 0},
           "lora": {"r": 4, "alpha": 8}, "checkpoint": {"every": 50}, "train": {"steps": 100, "log_every": 10},
           "output_dir": str(root / "run")}
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return SimpleNamespace(root=root, path=path, raw=raw)


def cfg_of(demo, *overrides):
    return load_config(demo.path, list(overrides))


# ---------------------------------------------------------------------------------------------
# environment checks


def test_clean_gpu_machine_has_no_serious_environment_finding(demo):
    cfg = cfg_of(demo, "model.dtype=bfloat16", "model.device=auto")
    env = gpu_env()
    found = [f for check in d.ENV_CHECKS if check is not d.check_versions for f in check(env, cfg)]
    found += d.check_versions(env, ranges={"torch": ">=2.5,<2.15", "transformers": ">=4.45", "peft": ">=0.13"})
    assert bad(found) == [], d.format_findings(bad(found))


@pytest.mark.parametrize("check, change, fid, severity", [
    (d.check_python, {"python": "3.9.18"}, "env.python", "error"),
    (d.check_gpu, {"gpu.cuda_available": False, "gpu.gpus": [], "env": {"CUDA_VISIBLE_DEVICES": ""}}, "env.cuda",
     "info"),  # hidden on purpose
    (d.check_gpu, {"gpu.cuda_available": False, "gpu.gpus": []}, "env.cuda", "error"),  # nvidia-smi, no CUDA
    (d.check_bf16, {"gpu.gpus.0.capability": "7.5"}, "env.bf16", "error"),
    (d.check_determinism, {"torch_flags.deterministic_algorithms": True}, "env.determinism", "warning"),
    (d.check_nccl, {"gpu.nccl": None}, "env.nccl", "warning"),
    (d.check_workers, {"cpu_count": 2}, "env.workers", "warning"),
    (d.check_launch_blocking, {"env": {"CUDA_LAUNCH_BLOCKING": "1"}}, "env.launch_blocking", "error"),
    (d.check_memory_fraction, {"gpu.gpus.0.memory_fraction": 0.5}, "env.memory_fraction", "warning"),
    (d.check_alloc_conf, {"env": {"PYTORCH_CUDA_ALLOC_CONF": "per_process_memory_fraction:0.8"}},
     "env.alloc_conf", "warning"),
    (d.check_debug_vars, {"env": {"TORCH_COMPILE_DISABLE": "1"}}, "env.debug", "warning"),
    (d.check_compile_caches, {"env": {"TORCHINDUCTOR_FX_GRAPH_CACHE": "0"}}, "env.compile_caches", "warning"),
    (d.check_compile_caches, {"env": {"FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED": "0"}}, "env.compile_caches",
     "warning"),
    (d.check_nccl_vars, {"env": {"NCCL_P2P_DISABLE": "1"}}, "env.nccl_var.NCCL_P2P_DISABLE", "warning"),
    (d.check_kernels, {"kernels.flash-attn-4": "ModuleNotFoundError: flash_attn"}, "env.kernel.flash-attn-4", "error"),
    (d.check_install, {"gapless.dirty": True}, "env.install", "info"),
    (d.check_hf_offline, {"env": {"HF_HUB_OFFLINE": "1"}}, "env.hf_offline", "info"),
])
def test_each_environment_check_fires(demo, check, change, fid, severity):
    cfg = cfg_of(demo, "model.dtype=bfloat16", "model.device=auto", "model.attn_backend=fa4_op",
                 "data.num_workers=8")
    clean = severities(check(gpu_env(), cfg))
    assert clean.get(fid, "ok") in ("ok", "info"), clean
    found = severities(check(gpu_env(**change), cfg))
    assert found[fid] == severity, found


def test_workers_within_the_cores_is_clean(demo):
    assert severities(d.check_workers(gpu_env(), cfg_of(demo, "data.num_workers=8")))["env.workers"] == "ok"


def test_workers_name_a_containers_cpu_quota():
    """A cgroup CPU quota (a container's limit) that caps the cores is said beside the count; none, nothing."""
    capped = d.check_workers(gpu_env(**{"cpu_count": 4, "cpu_quota": 3.5}))
    assert "cgroup CPU quota of 3.5" in capped[0].detail and "4 CPU cores" in capped[0].detail
    assert "quota" not in d.check_workers(gpu_env(**{"cpu_quota": None}))[0].detail


def test_tf32_off_matters_only_for_a_float32_model(demo):
    off = gpu_env(**{"torch_flags.tf32_matmul": False, "torch_flags.float32_matmul_precision": "highest"})
    f32 = cfg_of(demo, "model.device=auto")
    (finding,) = d.check_tf32(off, f32)
    assert finding.severity == "warning" and "12.5%" in finding.cost and "bfloat16" in finding.fix
    assert d.check_tf32(off, cfg_of(demo, "model.dtype=bfloat16", "model.device=auto"))[0].severity == "ok"
    assert d.check_tf32(gpu_env(), f32)[0].severity == "info"


def test_versions_outside_the_tested_range():
    ranges = {"torch": ">=2.5,<2.15", "transformers": ">=4.45", "peft": ">=0.13"}
    assert bad(d.check_versions(gpu_env(), ranges=ranges)) == []
    old = gpu_env(**{"packages.torch": "2.3.1+cu121", "packages.transformers": "4.40.0"})
    found = severities(d.check_versions(old, ranges=ranges))
    assert found["env.version.torch"] == "warning" and found["env.version.transformers"] == "warning"
    missing = gpu_env(packages={"torch": "2.11.0", "transformers": "4.57.0"})
    assert severities(d.check_versions(missing, ranges=ranges))["env.version.peft"] == "info"


def test_cpu_machine_says_no_gpu_and_runs_the_rest(demo):
    cfg = cfg_of(demo)
    found = [f for check in d.ENV_CHECKS for f in check(cpu_env(), cfg)]
    by_id = {f.id: f for f in found}
    for fid in ("env.cuda", "env.bf16", "env.tf32", "env.nccl", "env.memory_fraction"):
        assert by_id[fid].severity == "info" and d.NO_GPU in by_id[fid].detail, by_id[fid]
    assert by_id["env.python"].severity == "ok" and "env.launch_blocking" in by_id


def test_disk_too_small_is_an_error(tmp_path):
    assert d.check_disk(tmp_path, 1 << 20, 5e8)[0].severity == "ok"
    (f,) = d.check_disk(tmp_path, 1 << 62, 5e8)
    assert f.severity == "error" and "output_dir" in f.fix
    assert d.measure_write_speed(tmp_path, 2 << 20) > 0 and not list(tmp_path.iterdir())  # the probe cleans up


def test_alloc_conf_is_explained():
    (f,) = d.check_alloc_conf(gpu_env(env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}))
    assert f.severity == "info" and "fragmentation" in f.detail


# ---------------------------------------------------------------------------------------------
# config checks


def test_batching_padding_predicted_and_priced(demo):
    cfg = cfg_of(demo, "data.batching=pad_to_max")
    (f,) = d.check_batching(cfg, {"pad_to_max": 0.40, "packed": 0.98})
    assert f.severity == "warning" and f.cost.startswith("59%") and f.fix == "data.batching: packed"
    assert d.check_batching(cfg_of(demo), {"packed": 0.98})[0].severity == "ok"


def test_tokens_per_step_math_and_a_wasted_budget(demo):
    # data.tokens_per_batch is the global micro-batch (gapless.data.sharding): 4 rows of 64 dealt to 4 GPUs
    (f,) = d.check_tokens_per_step(cfg_of(demo, "train.grad_accum=4"), 0.9, gpus=4)
    assert f.severity == "info" and "64 slots per GPU x 4 accumulation x 4 GPU(s) = 1,024 slots" in f.detail
    (one,) = d.check_tokens_per_step(cfg_of(demo, "train.grad_accum=4"), 0.9)
    assert "256 slots per GPU x 4 accumulation x 1 GPU(s) = 1,024 slots" in one.detail  # the same step
    # 4 rows cannot be dealt to 8 GPUs: the sampler would refuse, so the doctor says so first
    (f,) = d.check_tokens_per_step(cfg_of(demo), 0.9, gpus=8)
    assert f.severity == "error" and "cannot share equally" in f.detail and f.fix == "data.tokens_per_batch: 512"
    (f,) = d.check_tokens_per_step(cfg_of(demo, "data.batching=padded"), 0.9, gpus=2)
    assert f.severity == "error" and f.fix == "data.batching: packed"
    (f,) = d.check_tokens_per_step(cfg_of(demo, "data.tokens_per_batch=300"), 0.9)
    assert f.severity == "warning" and "256 slots" in f.detail and f.cost.startswith("15%")


def test_accumulation_over_single_rows(demo):
    (f,) = d.check_accumulation(cfg_of(demo, "data.tokens_per_batch=64", "train.grad_accum=16"))
    assert f.severity == "warning" and "data.tokens_per_batch: 1024" in f.fix
    assert d.check_accumulation(cfg_of(demo, "train.grad_accum=2"))[0].severity == "ok"


def test_checkpoint_interval_against_step_and_write_time(demo):
    # 50 MB per checkpoint written synchronously at 100 MB/s = 0.5 s, every 10 steps of 0.2 s: 25% of the run
    cfg = cfg_of(demo, "checkpoint.every=10", "checkpoint.async_write=false")
    (f,) = d.check_checkpoint(cfg, 0.2, 50_000_000, 100e6, 1000)
    assert f.severity == "warning" and f.cost == "25.0% of throughput"
    assert "checkpoint.every: 500" in f.fix  # 0.5 s / (500 x 0.2 s) = 0.5% <= 1%
    ok = cfg_of(demo, "checkpoint.every=500")
    assert d.check_checkpoint(ok, 0.2, 50_000_000, 100e6, 1000)[0].severity == "ok"
    # no checkpoints in a run predicted at 2.8 h
    (f,) = d.check_checkpoint(cfg_of(demo, "checkpoint.every=0"), 10.0, 0, 100e6, 1000)
    assert f.severity == "warning" and "2.8 h" in f.detail and f.fix == "checkpoint.every: 100"
    # without a step time the stall is not predicted, and says why
    assert "not predicted" in d.check_checkpoint(ok, None, 50_000_000, 100e6, 1000)[0].detail


def test_checkpoint_auto_is_described_not_flagged(demo):
    # auto, sync: 50 MB written at the measured 100 MB/s = 0.5 s per save over steps of 0.2 s:
    # ceil(0.5 / (0.01 x 0.2)) = 250 steps, 1.00% of the run; the doctor says so and flags nothing
    cfg = cfg_of(demo, "checkpoint.every=auto", "checkpoint.async_write=false")
    (f,) = d.check_checkpoint(cfg, 0.2, 50_000_000, 100e6, 1000)
    assert f.severity == "ok" and "checkpoint.every auto: predicted every 250 steps" in f.detail and not f.fix
    # async: the loop waits for the 5 ms copy; the 0.5 s write must end before the next save: max(3, 3, 10) = 10
    (f,) = d.check_checkpoint(cfg_of(demo, "checkpoint.every=auto"), 0.2, 50_000_000, 100e6, 1000)
    assert f.severity == "ok" and "every 10 steps" in f.detail
    (f,) = d.check_checkpoint(cfg, None, 50_000_000, 100e6, 1000)
    assert f.severity == "info" and "the run measures its step time" in f.detail


def test_logging_every_step(demo):
    (f,) = d.check_logging(cfg_of(demo, "train.log_every=1"))
    assert f.severity == "warning" and f.cost.startswith("1.0%") and f.fix == "train.log_every: 10"
    assert d.check_logging(cfg_of(demo))[0].severity == "ok"


def test_cold_cache_is_reported_with_its_time():
    src = lambda cache, s: SimpleNamespace(cache=cache, seconds=s)  # noqa: E731
    (f,) = d.check_cache(SimpleNamespace(sources=[src("miss", 42.0), src("hit", 0.1)]))
    assert f.severity == "info" and "42.0 s" in f.detail
    assert d.check_cache(SimpleNamespace(sources=[src("hit", 0.1)]))[0].severity == "ok"


def test_memory_predicted_against_the_gpu(demo):
    """The memory model's peak (gapless.meter.memory) against the GPU: Llama-3.1-8B full fine-tuning (18 B per
    weight before activations) does not fit one H200 and the fix is named; Llama-3.2-3B LoRA fits; no GPU: the
    prediction as information."""
    from gapless.model.loading import read_model_args

    big, small = read_model_args("bench/models/llama-3.1-8b"), read_model_args("bench/models/llama-3.2-3b")
    cfg = cfg_of(demo, "model.dtype=bfloat16", "model.device=auto", "method=full", "data.tokens_per_batch=4096",
                 "data.max_seq_len=4096")
    (f,) = d.check_memory(cfg, gpu_env(), big)
    assert f.severity == "error" and "does not fit" in f.cost and f.fix
    lora = cfg_of(demo, "model.dtype=bfloat16", "model.device=auto", "data.tokens_per_batch=16384",
                  "data.max_seq_len=4096")
    (f,) = d.check_memory(lora, gpu_env(), small)
    assert f.severity == "ok" and "predicted peak" in f.detail
    (f,) = d.check_memory(lora, cpu_env(), small)
    assert f.severity == "info" and "predicted peak" in f.detail


def test_precision(demo):
    (f,) = d.check_precision(cfg_of(demo, "model.device=auto"), gpu_env())
    assert f.severity == "warning" and "bfloat16" in f.fix
    (f,) = d.check_precision(cfg_of(demo, "model.dtype=float16"), gpu_env())
    assert f.severity == "info" and "dynamic loss scaler" in f.detail  # gapless.train.loss_scale
    assert d.check_precision(cfg_of(demo, "model.dtype=bfloat16", "model.device=auto"), gpu_env())[0].severity == "ok"
    assert d.check_precision(cfg_of(demo), cpu_env())[0].severity == "ok"


def test_activation_checkpointing_costs_a_third(demo):
    (f,) = d.check_activation_checkpointing(cfg_of(demo, "model.activation_checkpointing=1"))
    assert f.severity == "warning" and f.cost.startswith("33%") and "not predicted" in f.detail
    assert d.check_activation_checkpointing(cfg_of(demo))[0].severity == "ok"


def test_activation_checkpointing_that_memory_does_not_require(demo):
    """Llama-3.2-3B LoRA on an H200 (139.8 GiB): at 16,384 tokens it fits without checkpointing (~49 GiB), so the
    recompute is a cost to remove; at 131,072 tokens it needs it (~330 GiB of activations without)."""
    from gapless.model.loading import read_model_args

    args = read_model_args("bench/models/llama-3.2-3b")
    base = ("model.dtype=bfloat16", "model.device=auto", "data.max_seq_len=4096")
    cfg = cfg_of(demo, *base, "data.tokens_per_batch=16384", "model.activation_checkpointing=1")
    (f,) = d.check_activation_checkpointing(cfg, gpu_env(), args)
    assert f.severity == "warning" and f.fix == "model.activation_checkpointing: 0"
    assert re.search(r"predicts 4\d\.\d GiB per GPU without it \(3\d% of NVIDIA H200's 140 GiB", f.detail)
    assert f.cost.startswith("33% of throughput (the forward of 28 of 28 layers runs twice)")
    (f,) = d.check_activation_checkpointing(replace_ckpt(cfg, 2), gpu_env(), args)
    assert f.cost.startswith("17%") and "14 of 28 layers" in f.cost  # every 2nd layer
    big = cfg_of(demo, *base, "data.tokens_per_batch=131072", "model.activation_checkpointing=1")
    (f,) = d.check_activation_checkpointing(big, gpu_env(), args)
    assert f.severity == "ok" and f.detail.startswith("model.activation_checkpointing 1: needed")
    # over 8 GPUs each holds 16,384 of the 131,072 tokens: fits without it again
    assert d.check_activation_checkpointing(big, gpu_env(), args, gpus=8)[0].severity == "warning"
    # auto: the batch finder would still get a full micro-batch without it
    auto = cfg_of(demo, *base, "data.tokens_per_batch=auto", "model.activation_checkpointing=1")
    (f,) = d.check_activation_checkpointing(auto, gpu_env(), args, auto=True)
    assert f.severity == "warning" and "batch finder is still predicted to pick" in f.detail
    # at most 2 documents of 4,096 slots a batch: auto gets the 8,192 the cap allows without checkpointing, all it can
    rows = cfg_of(demo, *base, "data.tokens_per_batch=auto", "model.activation_checkpointing=1", "data.batching=padded",
                  "data.rows_per_batch=2")
    (f,) = d.check_activation_checkpointing(rows, gpu_env(), args, auto=True)
    assert f.severity == "warning" and "pick ~8,192 tokens per micro-batch (the most data.rows_per_batch 2 needs)" \
        in f.detail
    (f,) = d.check_activation_checkpointing(cfg, cpu_env(), args)
    assert f.severity == "info" and "no GPU" in f.detail


def replace_ckpt(cfg, every):
    from dataclasses import replace

    return replace(cfg, model=replace(cfg.model, activation_checkpointing=every))


def test_auto_tokens_per_batch_does_not_crash_the_doctor(demo, capsys):
    """On a GPU auto resolves to the batch finder's proposal; on the CPU and under torchrun it is an error (the
    run would stop) whose fix is the number the remaining checks assume."""
    cfg = cfg_of(demo, "data.tokens_per_batch=auto")
    result = d.diagnose(cfg, cpu_env(), probe_disk=False)
    found = {f.id: f for f in result["findings"]}
    assert found["cfg.tokens_per_batch"].severity == "error" and "this run is on the CPU" in \
        found["cfg.tokens_per_batch"].detail
    assert found["cfg.tokens_per_batch"].fix == "data.tokens_per_batch: 16,384"
    assert "cfg.memory" in found and "cfg.checkpoint" in found  # the rest still ran
    # padded batches of at most 2 documents: 2 rows of max_seq_len are all such a batch fills
    capped = cfg_of(demo, "data.tokens_per_batch=auto", "data.batching=padded", "data.rows_per_batch=2")
    found = {f.id: f for f in d.diagnose(capped, cpu_env(), probe_disk=False)["findings"]}
    assert found["cfg.tokens_per_batch"].fix == f"data.tokens_per_batch: {2 * capped.data.max_seq_len:,}"
    on_gpu = cfg_of(demo, "data.tokens_per_batch=auto", "model.dtype=bfloat16", "model.device=auto")
    found = {f.id: f for f in d.diagnose(on_gpu, gpu_env(), probe_disk=False)["findings"]}
    assert found["cfg.tokens_per_batch"].severity == "info" and "predicted to pick ~" in \
        found["cfg.tokens_per_batch"].detail
    found = {f.id: f for f in d.diagnose(on_gpu, gpu_env(), probe_disk=False, gpus=2)["findings"]}
    assert found["cfg.tokens_per_batch"].severity == "error" and "does not run under torchrun" in \
        found["cfg.tokens_per_batch"].detail and "per GPU, as auto would pick" in found["cfg.tokens_per_batch"].fix
    assert d.quick_checks(cfg, cpu_env())  # `gapless train`'s startup checks
    assert main(["doctor", str(demo.path), "data.tokens_per_batch=auto"]) == 1
    assert "cfg.tokens_per_batch" in capsys.readouterr().out


def test_doctor_and_plan_state_the_same_global_batch(demo):
    """Tokens per optimizer step = per-GPU slots x accumulation x GPUs = data.tokens_per_batch x accumulation, in
    the doctor's finding and in the plan's workload, at 1 and 4 GPUs (gapless.data.sharding deals the rows)."""
    from gapless.diagnosis.plan import workload_from_config

    cfg = cfg_of(demo, "train.grad_accum=2")
    w, _ = workload_from_config(cfg)
    assert w.step_tokens(256) == pytest.approx(256 * 2 * w.efficiency)
    for gpus in (1, 4):
        (f,) = d.check_tokens_per_step(cfg, w.efficiency, gpus)
        assert f"x {gpus} GPU(s) = 512 slots, about {256 * 2 * w.efficiency:,.0f} real tokens" in f.detail


def test_compile_off_on_a_gpu(demo):
    (f,) = d.check_compile(cfg_of(demo, "model.compile=false", "model.device=auto"), gpu_env())
    assert f.severity == "warning" and f.cost.startswith("28%")
    assert d.check_compile(cfg_of(demo, "model.compile=false"), cpu_env())[0].severity == "ok"


def test_lora_dropout_through_torch_on_a_gpu(demo):
    """lora.fused_dropout false with dropout on a GPU costs the saved masks; the default (fused) is clean."""
    (f,) = d.check_lora_dropout(cfg_of(demo, "lora.dropout=0.05", "lora.fused_dropout=false", "model.device=auto"),
                                gpu_env())
    assert f.severity == "warning" and f.fix == "lora.fused_dropout: true" and f.cost.startswith("2.7%")
    (f,) = d.check_lora_dropout(cfg_of(demo, "lora.dropout=0.05", "model.device=auto"), gpu_env())
    assert f.severity == "ok" and "no mask saved" in f.detail
    assert d.check_lora_dropout(cfg_of(demo, "lora.dropout=0.05", "lora.fused_dropout=false"), cpu_env())[0] \
        .severity == "ok"
    assert d.check_lora_dropout(cfg_of(demo), gpu_env())[0].detail == "no LoRA dropout"


# ---------------------------------------------------------------------------------------------
# the doctor end to end, on this machine


def test_good_config_is_clean_and_json_has_ids(demo, capsys):
    result = d.diagnose(cfg_of(demo))
    assert bad(result["findings"]) == [], d.format_findings(bad(result["findings"]))
    ids = {f.id for f in result["findings"]}
    assert {"cfg.batching", "cfg.cache", "cfg.checkpoint", "cfg.logging", "env.disk", "env.cuda"} <= ids
    assert 0.7 < result["facts"]["packing_efficiency"]["packed"] <= 1.0  # 300 short chats, a partial last batch
    assert main(["doctor", str(demo.path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["errors"] == 0 and all(f["id"] and f["severity"] in d.SEVERITIES for f in out["findings"])
    assert {"id", "severity", "detail", "cost", "fix"} == set(out["findings"][0])


def test_padding_predicted_on_the_users_data_and_error_exit(demo, capsys):
    result = d.diagnose(cfg_of(demo, "data.batching=pad_to_max"), probe_disk=False)
    (f,) = [f for f in result["findings"] if f.id == "cfg.batching"]
    eff = result["facts"]["packing_efficiency"]
    assert f.severity == "warning" and eff["pad_to_max"] < eff["packed"] - 0.3  # short chats in 64-token rows
    assert main(["doctor", str(demo.path), "model.path=" + str(demo.root / "missing")]) == 1
    assert "cfg.model" in capsys.readouterr().out


def test_rows_per_batch_is_diagnosed_on_the_users_data(demo):
    """Padded batches capped at 2 documents (a converted TRL per_device_train_batch_size 2): the packed comparison
    runs without the cap (packed refuses it), and the tokens per step say documents, not 256 x efficiency."""
    cfg = cfg_of(demo, "data.batching=padded", "data.rows_per_batch=2", "train.grad_accum=2", "train.epochs=1",
                 "train.steps=0")
    result = d.diagnose(cfg, probe_disk=False)
    eff = result["facts"]["packing_efficiency"]
    assert set(eff) == {"padded", "packed"} and result["facts"]["steps"] == 300 // 2 // 2
    (f,) = [f for f in result["findings"] if f.id == "cfg.tokens_per_step"]
    assert "= at most 512 slots and 4 documents (data.rows_per_batch 2 per micro-batch) per optimizer step" in f.detail
    (f,) = d.check_batching(cfg, {"padded": 0.40, "packed": 0.98})  # packing's fix unsets the cap it refuses
    assert f.severity == "warning" and f.fix == "data.batching: packed  data.rows_per_batch: null"


def test_unreadable_data_is_an_error(demo, tmp_path):
    bad_file = tmp_path / "bad.jsonl"
    bad_file.write_text('{"messages": [{"role": "user", "content": "hi"}]}\nnot json\n')
    result = d.diagnose(cfg_of(demo, f"data.sources.0.path={bad_file}", f"data.cache_dir={tmp_path / 'c'}"),
                        probe_disk=False)
    (f,) = [f for f in result["findings"] if f.id == "cfg.data"]
    assert f.severity == "error" and "bad.jsonl" in f.detail


def test_quick_checks_need_no_data(demo):
    cfg = cfg_of(demo, "train.log_every=1", "data.sources.0.path=/nonexistent.jsonl")  # never read
    found = d.quick_checks(cfg, cpu_env())
    assert [f.id for f in d.serious(found)] == ["cfg.logging"]
    assert not any(f.id.startswith("cfg.batching") for f in found)
    report = d.startup_report(cfg, cpu_env())
    assert "WARNING   cfg.logging" in report and "fix:  train.log_every: 10" in report
    assert d.startup_report(cfg_of(demo), cpu_env()) == ""


def test_real_environment_record_feeds_the_checks(demo):
    env = environment_record(probe_kernels=False)
    found = [f for check in d.ENV_CHECKS for f in check(env, cfg_of(demo))]
    assert {"env.python", "env.cuda", "env.versions" if not d.tested_ranges() else "env.version.torch"} <= \
        {f.id for f in found}
    assert copy.deepcopy(env) == json.loads(json.dumps(env))  # the record is plain JSON


@pytest.mark.gpu
def test_on_a_gpu_the_gpu_checks_run(demo):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    env = environment_record()
    found = {f.id: f for check in d.ENV_CHECKS for f in check(env, cfg_of(demo, "model.dtype=bfloat16",
                                                                          "model.device=auto"))}
    assert found["env.cuda"].severity == "ok" and d.NO_GPU not in found["env.bf16"].detail
    assert found["env.nccl"].severity == "ok"


def test_step_time_measured_or_predicted(demo, tmp_path):
    from gapless.diagnosis.plan import GPUS, single_gpu_tokens_per_s

    cfg = cfg_of(demo, "model.dtype=bfloat16", "model.device=auto", f"output_dir={tmp_path / 'run'}")
    step_s, source = d.predicted_step_s(cfg, gpu_env(), 200, 13.74e9, 3_212_574_720)
    toks, _ = single_gpu_tokens_per_s(GPUS["H200"], 13.74e9, 3_212_574_720)
    assert step_s == pytest.approx(256 / toks) and source.startswith("predicted for 256 slots")  # slots, not 200
    assert d.predicted_step_s(cfg, cpu_env(), 200, 13.74e9, 3_212_574_720) == \
        (None, f"{d.NO_GPU} and no earlier run in {tmp_path / 'run'}")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0, "tokens_per_s": 9.0}) + "\n")
    step_s, source = d.predicted_step_s(cfg, cpu_env(), 200, 13.74e9, 3_212_574_720)  # one window: the compile's
    assert step_s is None and f"the run in {tmp_path / 'run'} cannot time a step" in source
    assert "has 1 logged training window; need at least 2" in source and "--run" not in source
    (f,) = d.check_checkpoint(cfg, step_s, 50_000_000, 100e6, 1000, source)  # the reason, not "no earlier run"
    assert f"step time not predicted ({source})" in f.detail and "no earlier run" not in f.detail
    rates = [{"step": s, "loss": 1.0, "tokens_per_s": 1000.0 * s} for s in (1, 2, 3)]
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rates))
    step_s, source = d.predicted_step_s(cfg, cpu_env(), 200, 13.74e9, 3_212_574_720)
    assert step_s == pytest.approx(200 / 2500) and source.startswith("measured")  # median of 2000 and 3000


def test_doctor_on_a_run_folder(demo, tmp_path, capsys, monkeypatch):
    """A run folder is checked with its own config.yaml, its measured step time and its own evidence."""
    import torch

    from gapless.meter import report
    from gapless.meter.monitor import Finding as RunFinding
    from gapless.train.loop import train

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(cfg_of(demo, "train.steps=4", "train.log_every=1", f"output_dir={tmp_path / 'run'}", "progress=false"))
    finally:
        torch.set_num_threads(previous)
    assert main(["doctor", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "step time: measured in" in out and "cfg.batching" in out
    # the run's own evidence is appended: none here, or what a loaded CPU gives (an input-bound loop, or 5% of a short
    # run stalled at its checkpoint: run.i_o_bound)
    assert re.search(r"^(ok|WARNING)\s+run\.(evidence|input_bound|i_o_bound)", out, flags=re.M), out
    monkeypatch.setattr(report, "findings", lambda run: [RunFinding(
        "input-bound: the GPU waits for batches", "waiting for data 40% of training time", "prefetch more")])
    (f,) = d.run_findings(tmp_path / "run")
    assert f.id == "run.input_bound" and f.severity == "warning" and "40%" in f.detail and f.fix == "prefetch more"
    assert main(["doctor", str(tmp_path)]) == 2  # a folder without config.yaml is the user's mistake


def test_compile_caches_turned_on_explicitly_are_clean():
    """The variables set to the values that keep a cache on are no finding; the message names what is off."""
    on = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "0",
          "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED": "1"}
    assert severities(d.check_compile_caches(gpu_env(env=on)))["env.compile_caches"] == "ok"
    off = d.check_compile_caches(gpu_env(env={**on, "TORCH_COMPILE_FORCE_DISABLE_CACHES": "1"}))[0]
    assert off.detail.startswith("TORCH_COMPILE_FORCE_DISABLE_CACHES=1") and off.fix.endswith(
        "TORCH_COMPILE_FORCE_DISABLE_CACHES")
