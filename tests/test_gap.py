"""`gapless gap` on the demo's tiny Llama, CPU, float32, one torch thread.

- the amortisation of a stall over an interval, and the interval that makes it cheap, with numbers;
- a measurement of a config that differs from advertised conditions in every factor the CPU can measure:
  each appears, in order, with its own window's numbers; the waterfall's deltas sum to your run minus
  advertised; padding's cost is named with its fix;
- gap.json is what report.read_gap reads; gap.png, gap.html and a run's report.html show the waterfall;
- `gapless gap RUN` measures a run folder's config (factors equal to advertised are skipped) and updates the
  run's gap.json and report; `gapless gap` prints the table; a user's mistake is one line and exit code 2.
"""
import io
import json
import math
import re

import pytest
import torch
import yaml

from gapless import demo_task
from gapless.cli import main
from gapless.demo import write_base_model
from gapless.diagnosis.gap import (NOISE, Window, amortised_tokens_per_s, ceiling_tokens_per_s, format_table,
                                   interval_for, run_gap, waterfall)
from gapless.meter.report import plot_gap, read_gap, read_run, signed
from test_report import assert_png, images

STEPS = 6  # measured steps per window (plus the warm-up step): ~0.5 s a window here
FACTORS = ["real lengths", "gradient accumulation", "logging", "checkpoints", "evaluation", "data loading",
           "communication", "start-up", "precision"]


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread, as the demo: the model's matmuls are too small for more, and on shared cores a
    second thread makes windows slow and noisy."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> dict:
    """A config that differs from advertised conditions in every factor: documents padded to max_seq_len,
    grad_accum 2, a metrics read every 2 steps, checkpoints every 500 steps, evaluation every 100."""
    root = tmp_path_factory.mktemp("gap")
    model = write_base_model(root / "base", seed=0)
    data = demo_task.write_jsonl(demo_task.make_examples(300, seed=1), root / "data" / "train.jsonl")
    raw = {"model": {"path": str(model), "dtype": "float32", "device": "cpu"},
           "data": {"sources": [{"path": str(data), "format": "messages"}], "eval_fraction": 0.1, "max_seq_len": 64,
                    "tokens_per_batch": 256, "batching": "pad_to_max", "cache_dir": str(root / "cache"),
                    "num_workers": 0},
           "lora": {"r": 4, "alpha": 8},
           "checkpoint": {"every": 500},
           "train": {"steps": 1000, "grad_accum": 2, "log_every": 2, "eval_every": 100},
           "output_dir": str(root / "run")}
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return {"root": root, "path": path, "raw": raw}


@pytest.fixture(scope="module")
def measured(config, one_thread) -> dict:
    out = config["root"] / "gap"
    table = io.StringIO()
    gap = run_gap(config["path"], steps=STEPS, out=out, stream=table, log=lambda text: None)
    return {"gap": gap, "out": out, "table": table.getvalue()}


def test_amortised_with_numbers():
    # 16,384 tokens a step of 1.0 s, a 10 s checkpoint every 500 steps: 10 / 500 = 0.02 s more per step
    assert amortised_tokens_per_s(16384, 1.0, 10.0, 500) == pytest.approx(16384 / 1.02)
    assert amortised_tokens_per_s(16384, 1.0) == 16384
    # the smallest round interval at which the stall is at most 1% of the steps: 10 s / (0.01 * 1.0 s) = 1000
    assert interval_for(10.0, 1.0) == 1000
    assert interval_for(10.0, 1.0, share=0.05) == 200
    assert interval_for(0.3, 0.05) == 1000  # needs 600
    assert interval_for(0.001, 1.0) == 1
    assert NOISE == 0.01
    # a window's point leaves its stalls out; its stall per event is seconds / events
    seconds = {"startup": 0.0, "compute": 9.0, "data_wait": 0.4, "h2d_copy": 0.1, "checkpoint": 2.0, "eval": 3.0,
               "logging": 0.5, "other": 0.5}
    w = Window("w", "unused", steps=10, tokens=20480, seconds=seconds, checkpoints=2, evals=1)
    assert w.step_s == pytest.approx(1.0) and w.tokens_per_step == 2048
    assert w.checkpoint_stall_s == 1.0 and w.eval_s == 3.0 and w.wait_s == pytest.approx(0.5)
    steps = waterfall([{"factor": "a", "tokens_per_s": 900.0, "fix": "x"}, {"factor": "b", "skipped": "equal"},
                       {"factor": "c", "tokens_per_s": 950.0, "fix": "y"},
                       {"factor": "d", "tokens_per_s": 945.0, "fix": "z"}], 1000.0, threshold=0.02)
    assert [s.get("delta") for s in steps] == [-100.0, None, 50.0, -5.0]
    assert [s.get("fix") for s in steps] == ["x", None, "", ""]  # a gain, or a cost within the noise: no fix


def test_every_factor_measured_and_bars_sum(measured):
    gap = measured["gap"]
    steps = gap["steps"]
    assert [s["factor"] for s in steps] == FACTORS
    skipped = {s["factor"]: s["skipped"] for s in steps if "skipped" in s}
    assert list(skipped) == ["communication", "precision"] and "on the CPU" in skipped["precision"]  # float32
    assert skipped["communication"].startswith("one process: no communication")
    bars = [s for s in steps if "skipped" not in s]
    base = gap["baseline"]["tokens_per_s"]
    assert math.isclose(sum(s["delta"] for s in bars), bars[-1]["tokens_per_s"] - base, rel_tol=1e-9)

    # every number comes from a window: advertised = full rows (4 x 64 tokens a step), stalls left out
    windows = {w["name"]: w for w in gap["measured"]["windows"]}
    assert list(windows) == ["advertised", "real-lengths", "grad-accum", "logging", "advertised-again"]
    ad = windows["advertised"]
    assert ad["tokens"] == STEPS * 256 and ad["padding"] == 0.0

    def point(w):
        s = w["seconds"]
        return w["tokens"] / w["steps"], (sum(s.values()) - s["checkpoint"] - s["eval"] - s["data_wait"]
                                          - s["h2d_copy"]) / w["steps"]

    tokens, step_s = point(ad)
    assert base == pytest.approx(tokens / step_s)
    by = {s["factor"]: s for s in bars}
    for factor, name in [("real lengths", "real-lengths"), ("gradient accumulation", "grad-accum"),
                         ("logging", "logging")]:
        assert by[factor]["tokens_per_s"] == pytest.approx(point(windows[name])[0] / point(windows[name])[1])
    # checkpoints, evaluation and data loading: the logging window's stalls added per step to the stage before
    log = windows["logging"]
    assert log["checkpoints"] == 2 and log["evals"] == 1 and log["seconds"]["checkpoint"] > 0
    tokens, step_s = point(log)
    step_s += log["seconds"]["checkpoint"] / 2 / 500
    assert by["checkpoints"]["tokens_per_s"] == pytest.approx(amortised_tokens_per_s(tokens, step_s))
    step_s += log["seconds"]["eval"] / 100
    assert by["evaluation"]["tokens_per_s"] == pytest.approx(tokens / step_s)
    step_s += (log["seconds"]["data_wait"] + log["seconds"]["h2d_copy"]) / STEPS
    assert by["data loading"]["tokens_per_s"] == pytest.approx(tokens / step_s)
    # start-up: the logging window's, from its start to the end of its first step, over the run's steps
    assert 0 < log["startup_s"] < sum(log["seconds"].values()) + 60
    run_steps = int(by["start-up"]["setting"].split()[0])
    step_s += log["startup_s"] / run_steps
    assert by["start-up"]["tokens_per_s"] == pytest.approx(tokens / step_s)
    assert "amortised" in by["checkpoints"]["note"] and "from 2 written" in by["checkpoints"]["note"]

    # noise: the advertised window again, last; a fix only for a cost beyond it
    again = point(windows["advertised-again"])
    noise = gap["measured"]["noise"]
    assert noise == pytest.approx(abs(again[0] / again[1] / base - 1))
    for s in bars:
        assert s["fix"] == "" or s["delta"] < -max(NOISE, noise) * base
    # padding every document to max_seq_len: two thirds of the slots are padding (~2.5x slower per real token
    # here), and its fix is named unless other load on the machine made the two advertised windows differ more
    real = by["real lengths"]
    assert windows["real-lengths"]["padding"] > 0.4 and real["delta"] < 0
    assert real["fix"] == ("data.batching: packed" if real["delta"] < -max(NOISE, noise) * base else "")


def test_ceiling_with_numbers():
    # 2e9 FLOPs per real token (1 TFLOP/s at 500 tokens/s) against a 4 TFLOP/s peak: 2,000 tokens/s = 500 / MFU 0.25
    one = {"real_tokens": 1000, "tokens_per_s": 500.0, "tflops": 1.0, "peak_tflops": 4.0, "mfu": 0.25}
    assert ceiling_tokens_per_s([one]) == pytest.approx(2000.0)
    # a window of longer documents costs 4e9 FLOPs per token: weighted by real tokens, 3,000 tokens in 1.5 + 1 s
    longer = {"real_tokens": 2000, "tokens_per_s": 250.0, "tflops": 1.0, "peak_tflops": 4.0, "mfu": 0.25}
    assert ceiling_tokens_per_s([one, longer]) == pytest.approx(3000 / (1000 * 2e9 / 4e12 + 2000 * 4e9 / 4e12))
    assert ceiling_tokens_per_s([{"real_tokens": 10, "tokens_per_s": 5.0}]) == 0.0  # no MFU fields: no ceiling


def test_signed_changes():
    assert [signed(v) for v in (-0.04, 0.04, -0.4, 3.25, -12.4, 1234.4)] == ["0.0", "0.0", "-0.4", "+3.2", "-12",
                                                                            "+1,234"]


def test_ceiling_in_the_measurement(measured):
    gap = measured["gap"]
    window = next(w for w in gap["measured"]["windows"] if w["name"] == "real-lengths")
    records = [json.loads(line) for line in open(f"{window['folder']}/metrics.jsonl") if '"loss"' in line]
    assert ceiling_tokens_per_s(records) > 0
    assert gap["ceiling"]["tokens_per_s"] == pytest.approx(ceiling_tokens_per_s(records))
    assert gap["ceiling"]["tokens_per_s"] == pytest.approx(window["ceiling_tokens_per_s"])
    assert f"{window['peak_tflops']:.3g} TFLOP/s" in gap["ceiling"]["note"]
    line = next(line for line in measured["table"].splitlines() if line.startswith("ceiling, your lengths"))
    assert f"{gap['ceiling']['tokens_per_s']:,.0f}" in line
    assert "of the ceiling)" in next(line for line in measured["table"].splitlines() if line.startswith("your run"))
    assert "ceiling, your lengths" in (measured["out"] / "gap.html").read_text()


def test_checkpoint_auto_is_amortised_at_the_interval_auto_chooses(config, one_thread, tmp_path):
    """checkpoint.every auto: the window saves at a fixed interval to measure the stall, and the stall is amortised
    over the interval auto chooses from that stall and the stage's step time (gapless.train.checkpoint_interval)."""
    from gapless.train.checkpoint_interval import MIN_EVERY

    raw = {**config["raw"], "checkpoint": {"every": "auto"}, "output_dir": str(tmp_path / "run")}
    path = tmp_path / "auto.yaml"
    path.write_text(yaml.safe_dump(raw))
    gap = run_gap(path, steps=4, out=tmp_path / "gap", stream=io.StringIO(), log=lambda text: None)
    by = {s["factor"]: s for s in gap["steps"]}
    row = by["checkpoints"]
    every = int(re.fullmatch(r"checkpoint.every: auto \((\d+) steps here\)", row["setting"]).group(1))
    assert every >= MIN_EVERY and row["note"].endswith(f"over {every} steps") and row["fix"] == ""
    # stall / (every x step_s) <= 1% of the stage before's step time: tokens/s falls by at most 1 / 1.01
    assert by["logging"]["tokens_per_s"] / 1.01 <= row["tokens_per_s"] <= by["logging"]["tokens_per_s"]


def test_gap_files_and_report(measured):
    out = measured["out"]
    gap = read_gap(out / "gap.json")
    assert gap["final"] == {"label": "your run"} and gap["baseline"]["label"] == "advertised conditions"
    assert [s["factor"] for s in gap["steps"]] == FACTORS
    assert_png((out / "gap.png").read_bytes())
    page = (out / "gap.html").read_text()
    assert len(images(page)) == 1 and "skipped: on the CPU" in page and "your run" in page
    assert f"differ by {100 * gap['measured']['noise']:.1f}%" in page
    # the table: one line per factor, your run last with the sum of the changes, the noise in the header
    table = measured["table"]
    assert f"differs by {100 * gap['measured']['noise']:.1f}%" in table.splitlines()[1]
    lines = table.splitlines()
    for factor in ["advertised conditions", *FACTORS, "your run"]:
        assert any(line.startswith(factor) for line in lines), factor
    final = measured["gap"]["steps"][-2]["tokens_per_s"]
    base = measured["gap"]["baseline"]["tokens_per_s"]
    assert re.search(rf"^your run .* {re.escape(f'{final:,.0f}')} +{re.escape(f'{final - base:+,.0f}')} ", table, re.M)
    assert "how each was measured:" in table
    assert format_table(gap) in table


def test_report_format_generalised(tmp_path, measured):
    gap = json.loads((measured["out"] / "gap.json").read_text())
    del gap["final"]  # a file without it: the final bar is "reachable", as before
    (tmp_path / "gap.json").write_text(json.dumps(gap))
    assert read_gap(tmp_path / "gap.json")["final"]["label"] == "reachable"
    assert_png(plot_gap(read_gap(tmp_path / "gap.json")))
    gap["ceiling"] = {"label": "ceiling", "tokens_per_s": -1}
    (tmp_path / "gap.json").write_text(json.dumps(gap))
    with pytest.raises(ValueError, match="ceiling must be"):
        read_gap(tmp_path / "gap.json")
    del gap["ceiling"]
    gap["steps"][1] = {"skipped": "no factor name"}
    (tmp_path / "gap.json").write_text(json.dumps(gap))
    with pytest.raises(ValueError, match=r"steps\[1\] lacks \['factor'\]"):
        read_gap(tmp_path / "gap.json")


def test_cli_gap_run_folder(measured, one_thread, capsys):
    """A window of the measurement above is a run folder: `gapless gap RUN` measures its config (grad_accum 1,
    one metrics read per window, no checkpoints: those factors are skipped; its held-out split evaluated once at
    the end, measured in an "intervals" window) and adds the waterfall to its report."""
    run = measured["out"] / "windows" / "2-real-lengths"
    assert main(["gap", str(run), "data.batching=packed", "--steps", str(STEPS)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("throughput gap, real tokens/s: advertised conditions -> your run (cpu, float32; 4 windows")
    gap = read_gap(run / "gap.json")
    assert [w["name"] for w in gap["measured"]["windows"]] == ["advertised", "real-lengths", "intervals", "advertised-again"]
    steps = gap["steps"]
    assert {s["factor"] for s in steps if "skipped" in s} == {"gradient accumulation", "logging", "checkpoints",
                                                              "communication", "precision"}
    evaluation = next(s for s in steps if s["factor"] == "evaluation")  # eval_every 0: once, after the run's steps
    assert evaluation["setting"] == f"train.eval_every: 0 (once, after {STEPS + 2} steps)"
    assert (run / "gap" / "gap.json").is_file() and read_run(run).gap is not None
    page = (run / "report.html").read_text()
    assert "<figcaption>Throughput gap, factor by factor</figcaption>" in page and "your run" in page


def test_gap_of_a_run_folder_amortises_the_runs_own_startup(measured, one_thread, tmp_path):
    """`gapless gap RUN` with no overrides: start-up is the run's own first_step_s (from its process start: the
    imports, its caches as it found them), not a window's (warm caches, imports done: 0.1 s against the demo run's
    1.9 s), so the bar named "your run" is the run's; with overrides the windows' config is not the run's: a window's."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(measured["out"] / "windows" / "2-real-lengths", run)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert sum(r.get("kind") == "startup" for r in records) == 1
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({**r, "first_step_s": 40.0} if r.get("kind") == "startup" else r) + "\n" for r in records))
    gap = run_gap(run, steps=STEPS, stream=io.StringIO(), log=lambda text: None)
    startup = next(s for s in gap["steps"] if s["factor"] == "start-up")
    assert "40.0 s measured in the run" in startup["note"]
    before = [s for s in gap["steps"] if "skipped" not in s and s["factor"] != "start-up"][-1]["tokens_per_s"]
    tokens = gap["measured"]["windows"][-2]["tokens"] / STEPS  # the intervals window's tokens per step
    run_steps = int(startup["setting"].split()[0])
    assert startup["tokens_per_s"] == pytest.approx(tokens / (tokens / before + 40.0 / run_steps))


def test_cli_errors(tmp_path, config, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    for argv, message in [(["gap", str(tmp_path / "nowhere.yaml")], "config file not found"),
                          (["gap", str(tmp_path)], "no config.yaml in this folder"),
                          (["gap", str(config["path"]), "--steps", "1"], "a window needs at least 2 measured steps"),
                          (["gap", str(config["path"]), "model.path=/nowhere", "--out", str(tmp_path / "o")],
                           "/nowhere: not a folder"),
                          (["gap", str(config["path"]), f"data.sources.0.path={empty}", "--out", str(tmp_path / "o")],
                           "no training documents")]:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("gapless gap: error: ") and message in err and err.count("\n") == 1, err
