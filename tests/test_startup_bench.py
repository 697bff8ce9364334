"""bench/startup_gpu.py, the start-up benchmark a GPU session runs: its random checkpoint loads as a real one, and
--tiny runs it end to end on the CPU (cold and warm `gapless train` subprocesses, one results.jsonl row)."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "startup_gpu.py"


@pytest.fixture(scope="module")
def startup():
    spec = importlib.util.spec_from_file_location("startup_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_random_checkpoint_is_sharded_with_an_index_and_loads(startup, shared, tmp_path):
    from gapless.model.loading import build, load_weights

    config = {**json.loads(startup.MODEL_CONFIG.read_text()), **startup.TINY}
    folder = tmp_path / "model"
    written = startup.write_model(folder, config, shared / "tokenizers" / "llama3", shard_bytes=8 * 2**20)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert written["shards"] == len(set(index["weight_map"].values())) >= 2 and written["written_s"] > 0
    assert (folder / "tokenizer.json").is_file()
    model = load_weights(build(folder), "bfloat16")
    embedding = model.model.embed_tokens.weight
    assert embedding.shape == (128256, 64) and model.lm_head.weight is embedding  # the 3B's vocabulary, tied
    std = model.model.layers[1].mlp.down_proj.weight.float().std().item()
    assert abs(std - 0.02) < 0.002 and torch.all(model.model.norm.weight == 1)  # transformers' init
    assert startup.write_model(folder, config, shared / "tokenizers" / "llama3", 8 * 2**20)["written_s"] == 0.0
    assert startup.drop_page_cache(folder)


@pytest.mark.slow
def test_tiny_cold_and_warm_end_to_end(startup, shared, tmp_path):
    """~100 s on a busy 2-core CPU: two `gapless train` processes (tokenizing the data and writing the token cache,
    then reading it) and the row."""
    out = tmp_path / "results.jsonl"
    assert startup.main(["--tiny", "--work", str(tmp_path / "work"), "--out", str(out)]) == 0
    [row] = [json.loads(line) for line in out.read_text().splitlines()]
    assert "startup" in row["config"] and row["error"] is None and row["system"] == "gapless"
    for run in ("cold", "warm"):
        parts = row[f"{run}_breakdown"]
        steps = {"imports_config", "load", "data", "other", "warmup", "first_step"}  # one after the other
        assert set(parts) == steps | {"compile", "data_beside", "attention_beside"}
        # the outside clock holds the inside one (which starts at the process start, read to 10 ms) and the time
        # this busy process takes to read the line
        assert row[f"{run}_inside_s"] - 0.1 <= row[f"{run}_s"] <= row[f"{run}_inside_s"] + 5.0
        assert sum(parts[k] or 0 for k in steps) == pytest.approx(row[f"{run}_inside_s"], abs=0.05)
    assert row["cold_pyc_s"] > 0 and set(row["cold_pyc_breakdown"]) == set(row["cold_breakdown"])
    # the token cache: empty for both cold runs, kept for the warm one (the data summary's cache column)
    logs = {run: (tmp_path / "work" / f"{run}.log").read_text() for run in ("cold", "warm", "cold_pyc")}
    assert "train.jsonl" in logs["cold"] and " miss " in logs["cold"] and " hit " in logs["warm"]
    assert " miss " in logs["cold_pyc"]
    assert row["page_cache_dropped"] and row["shards"] >= 2


def test_a_failed_start_keeps_the_others_in_the_row(startup, shared, tmp_path, monkeypatch):
    """--runs picks the starts; one that fails (s20-startup's cold_pyc: a tokenizer worker died) leaves its fields
    null and its error in the row, the others' numbers stay, and the script exits 1. An unknown start is refused."""
    def fake_run(name, command, env, run_dir, log):
        log.write_text("step 1 done\n")
        if name == "cold_pyc":
            raise RuntimeError("cold_pyc run failed (exit 1): a tokenizer worker process died")
        return {"outside_s": 2.0, "inside_s": 1.9, "breakdown": {"load": 1.0}, "compile_caches": {},
                "compile_phases": {}, "peak_gib": 1.5, "host_peak_gib": 2.5, "process_s": 2.1}

    monkeypatch.setattr(startup, "run_once", fake_run)
    out = tmp_path / "results.jsonl"
    args = ["--tiny", "--work", str(tmp_path / "work"), "--out", str(out), "--tokenizer",
            str(shared / "tokenizers" / "llama3")]
    assert startup.main([*args, "--runs", "warm,cold_pyc"]) == 1
    [row] = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["warm_s"] == 2.0 and row["cold_s"] is None and row["cold_pyc_s"] is None
    assert row["error"].startswith("cold_pyc: cold_pyc run failed") and "warm 2.0 s" in row["describe"]
    with pytest.raises(SystemExit):
        startup.main([*args, "--runs", "cold,hot"])


def test_load_time_script_times_serial_and_parallel(startup, shared, tmp_path, capsys):
    import sys

    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import load_time
    finally:
        sys.path.remove(str(SCRIPT.parent))
    config = {**json.loads(startup.MODEL_CONFIG.read_text()), **startup.TINY}
    startup.write_model(tmp_path / "tiny", config, shared / "tokenizers" / "llama3", 8 * 2**20)
    assert load_time.main([str(tmp_path / "tiny"), "--dtype", "float32", "--device", "cpu", "--threads", "1,4",
                           "--repeats", "1", "--cold"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["threads"], r["reader"], r["cold"]) for r in lines] == [
        (1, "staged", True), (1, "mmap", True), (4, "staged", True), (4, "mmap", True)]
    assert all(r["seconds"] > 0 for r in lines)


def test_autotuned_kernels_are_read_from_the_autotuners_debug_lines(startup, tmp_path):
    log = tmp_path / "warm.log"
    log.write_text("step 1 done\n"
                   "V1207 triton_heuristics.py:1595] Best config for triton_red_fused_add_0: XBLOCK: 1, num_warps: 8\n"
                   "other line: Best config\n"
                   "Best config for triton_per_fused_mul_1: XBLOCK: 32\n")
    assert startup.autotuned_kernels(log) == ["triton_red_fused_add_0", "triton_per_fused_mul_1"]
    log.write_text("nothing autotuned\n")
    assert startup.autotuned_kernels(log) == []
