"""The meter: real tokens never include padding, the run's tokens/s agrees with an outside clock and a
token count taken from the data itself, and MFU is the flops formula over the real documents."""
import json
import time

import pytest

from gapless import demo_task
from gapless.config import load_config
from gapless.data.batching import BatchSampler
from gapless.data.pipeline import build_data
from gapless.demo import write_base_model
from gapless.meter.flops import step_flops
from gapless.model.loading import read_model_args
from gapless.train.loop import train
from conftest import training_records


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("meter")
    model_dir = write_base_model(root / "base", seed=0)
    records = demo_task.make_examples(120, seed=5)
    data = demo_task.write_jsonl(records, root / "train.jsonl")
    return {"root": root, "model": model_dir, "data": data, "records": records}


def one_epoch(base: dict, out: str, **overrides):
    raw = {
        "model": {"path": str(base["model"]), "dtype": "float32", "device": "cpu"},
        "data": {"sources": [{"path": str(base["data"]), "format": "messages"}], "max_seq_len": 64,
                 "tokens_per_batch": 256, "cache_dir": str(base["root"] / "cache"), "num_workers": 0},
        "lora": {"r": 4, "alpha": 8},
        "train": {"epochs": 1, "log_every": 1},
        "output_dir": str(base["root"] / out),
        "progress": False,
    }
    return load_config(data=raw, overrides=[f"{k}={v}" for k, v in overrides.items()])


def tokens_in_data(base: dict) -> list[int]:
    """Each record's length, counted from the JSONL with transformers' own tokenizer and chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base["model"])
    lines = base["data"].read_text().splitlines()
    return [len(tokenizer.apply_chat_template(json.loads(line)["messages"], tokenize=True, return_dict=False))
            for line in lines]


def test_padding_is_never_counted_as_real_tokens(base):
    """The same documents, packed and padded: the same real tokens (the data's own count), other slot counts."""
    expected = sum(tokens_in_data(base))
    totals = {}
    for batching in ("packed", "padded", "pad_to_max"):
        result = train(one_epoch(base, f"count_{batching}", **{"data.batching": batching}))
        records = training_records(result.run_dir / "metrics.jsonl")
        real = sum(r["real_tokens"] for r in records)
        slots = sum(r["slot_tokens"] for r in records)
        assert real == expected == result.real_tokens, batching
        for r in records:
            assert r["padding_fraction"] == pytest.approx(1 - r["real_tokens"] / r["slot_tokens"])
            assert r["tokens_per_s"] > 0
            if r["step"] > 1:  # step 1 alone (log_every 1) is the warm-up: no compute time of its own
                assert r["compute_tokens_per_s"] >= r["tokens_per_s"]
        totals[batching] = slots
    assert expected < min(totals.values()) and max(totals, key=totals.get) == "pad_to_max"
    assert totals["pad_to_max"] == 64 * len(base["records"])  # one 64-slot row per document


def test_run_tokens_per_s_agrees_with_an_outside_clock(base):
    """The run's reported tokens/s (its last record) against a wall clock around the whole call and a token
    count from the data itself: within 2% (the issue's bar)."""
    cfg = one_epoch(base, "agree", **{"train.epochs": 3, "train.log_every": 10, "checkpoint.every": 20})
    t0 = time.perf_counter()
    result = train(cfg)
    wall = time.perf_counter() - t0
    expected = 3 * sum(tokens_in_data(base))
    last = json.loads((result.run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["kind"] == "time" and last["final"] and last["real_tokens"] == expected
    assert sum(last["seconds"].values()) == pytest.approx(last["wall_s"], rel=1e-6)
    assert last["tokens_per_s"] == pytest.approx(expected / wall, rel=0.02)
    assert result.tokens_per_s == last["tokens_per_s"]


def test_mfu_is_the_flops_formula_over_the_real_documents(base):
    """One log window over the whole epoch: its rates count the steps after the first (which compiles), so
    tflops / tokens_per_s = step_flops over those steps' documents / their real tokens."""
    cfg = one_epoch(base, "mfu", **{"train.log_every": 1000})
    result = train(cfg)
    (record,) = training_records(result.run_dir / "metrics.jsonl")
    mix, _, _ = build_data(cfg.data, base["model"])
    timed = list(BatchSampler.from_config(cfg.data, mix).epoch_batches(0))[1:]
    lengths = [n for b in timed for n in b.doc_lengths]
    flops = step_flops(read_model_args(base["model"]), lengths, "lora", 4)
    assert record["real_tokens"] == sum(tokens_in_data(base)) > sum(lengths)
    assert record["tflops"] * 1e12 / record["tokens_per_s"] == pytest.approx(flops / sum(lengths), rel=1e-9)
    assert record["mfu"] == pytest.approx(record["tflops"] / record["peak_tflops"], rel=1e-9)
    assert 0 < record["mfu"] < 1


def test_first_window_rates_leave_out_the_warm_up_step(base, monkeypatch):
    """log_every 2: the first record's tokens/s counts step 2 over its time. Counting step 1's tokens too (over
    step 2's time) would double it against the later windows of two steps each. Each step sleeps 0.3 s, so
    the steps take nearly equal time even on a busy CPU."""
    import gapless.train.loop as loop

    plain = loop.train_step

    def slow(*args, **kwargs):
        time.sleep(0.3)
        return plain(*args, **kwargs)

    monkeypatch.setattr(loop, "train_step", slow)
    result = train(one_epoch(base, "warm", **{"train.log_every": 2, "train.steps": 10}))
    rates = [r["tokens_per_s"] for r in training_records(result.run_dir / "metrics.jsonl")]
    assert len(rates) == 5
    later = sorted(rates[1:])[1:3]  # the middle two of the four later windows
    assert 0.7 * min(later) < rates[0] < 1.4 * max(later), rates


def test_gapless_train_clock_starts_at_process_start(base, tmp_path):
    """`gapless train` as a user runs it, in its own process: the last record's wall time against a clock outside
    the process (from the spawn to the exit), within 2% (the issue's bar); the interpreter and the imports, before
    any gapless code ran, are start-up. The outside clock also holds the interpreter's exit, after the last record."""
    import subprocess
    import sys

    import yaml

    from gapless.config import to_dict

    cfg = one_epoch(base, "process", **{"train.epochs": 3, "train.log_every": 10})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(to_dict(cfg)))
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "gapless.cli", "train", str(path)], check=True, capture_output=True)
    outside = time.perf_counter() - t0
    last = json.loads((base["root"] / "process" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["final"] and last["seconds"]["startup"] > 0.5  # at least the imports of torch and transformers
    assert last["wall_s"] == pytest.approx(outside, rel=0.02), (last["wall_s"], outside)
    assert 0 < last["first_step_s"] < last["wall_s"]
    # the command also records the environment (gapless doctor --compare reads it)
    assert json.loads((base["root"] / "process" / "environment.json").read_text())["python"]


def test_startup_record_parts_add_up_to_the_first_step(base):
    """{"kind": "startup"} at step 1: imports_config, model, data, other and first_step add up to first_step_s (the
    wall time from the run's clock start to the end of step 1), and the peak memory so far is there."""
    result = train(one_epoch(base, "startup", **{"train.steps": 2}))
    records = [json.loads(line) for line in open(result.run_dir / "metrics.jsonl")]
    [startup] = [r for r in records if r.get("kind") == "startup"]
    assert startup["step"] == 1 and startup["first_step_s"] == pytest.approx(result.first_step_s)
    parts = startup["seconds"]
    assert list(parts) == ["imports_config", "model", "other", "data", "first_step"]
    assert all(v >= 0 for v in parts.values()) and parts["first_step"] > 0 and parts["model"] > 0
    assert sum(parts.values()) == pytest.approx(startup["first_step_s"], abs=5e-3)
    assert startup["compile_s"] >= 0 and startup["peak_gib"] is None and startup["host_peak_gib"] > 0.1  # CPU
