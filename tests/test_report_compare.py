"""`gapless report A B`: curves overlaid, config and environment differences; the gap page's title and fixes;
the report, the console and metrics.jsonl print the same numbers for a real run."""
import io
import json
import re

import pytest
import yaml

from gapless import demo_task
from gapless.cli import main
from gapless.config import load_config
from gapless.demo import write_base_model
from gapless.meter.report import differences, flatten, gap_title, proposed_fix, read_run, write_compare
from gapless.train.loop import train
from test_report import images, make_run


def with_environment(run, **env):
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"kind": "environment", "step": 0, "device": "cuda", "device_name": "NVIDIA H200",
                            "torch": "2.13.0", **env}) + "\n")
    return run


def test_compare_lists_differences_and_overlays(tmp_path, capsys):
    a = with_environment(make_run(tmp_path / "a", steps=60, seed=0))
    b = with_environment(make_run(tmp_path / "b", steps=60, seed=1), torch="2.12.0")
    config = yaml.safe_load((b / "config.yaml").read_text())
    config["lora"]["r"] = 8
    (b / "config.yaml").write_text(yaml.safe_dump(config))
    out = tmp_path / "cmp.html"
    assert main(["report", str(a), str(b), "--out", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    page = out.read_text()
    text = re.sub(r"<img [^>]*>", "", page)
    assert len(images(page)) == 5  # loss, grad norm, tokens/s, lr, eval loss: each run a line
    config_section = text.split("<h2>Config differences</h2>")[1].split("<h2>")[0]
    # output_dir differs too; nothing equal is listed
    assert "<td>lora.r</td>" in config_section and "<td>output_dir</td>" in config_section
    assert "lora.alpha" not in config_section
    env_section = text.split("<h2>Environment differences</h2>")[1].split("<h2>")[0]
    assert "<td>torch</td>" in env_section and "2.12.0" in env_section and "device_name" not in env_section


def test_differences():
    assert flatten({"a": {"b": 1, "c": [1]}, "d": 2}) == {"a.b": 1, "a.c": [1], "d": 2}
    assert differences([{"x": 1, "y": 2}, {"x": 1, "y": 3, "z": 0}]) == [("y", [2, 3]), ("z", [None, 0])]


def test_compare_needs_two(tmp_path):
    with pytest.raises(ValueError, match="at least two"):
        write_compare([tmp_path], tmp_path / "x.html")


def test_fix_never_the_value_already_set():
    assert proposed_fix({"setting": "checkpoint.every: 500", "fix": "checkpoint.every: 500"}) \
        == "none: the proposed value is already set"
    assert proposed_fix({"setting": "checkpoint.every: 500", "fix": "checkpoint.every: 500 or "
                         "checkpoint.async_write: true"}) == "checkpoint.async_write: true"
    assert proposed_fix({"setting": "checkpoint.every: 50", "fix": "checkpoint.every: 500"}) == "checkpoint.every: 500"
    assert proposed_fix({"setting": "data.batching: packed",
                         "fix": "none in the config: packed already"}) == "none in the config: packed already"
    assert proposed_fix({"setting": "x: 1", "fix": ""}) == ""


def test_gap_title_carries_model_gpu_date_config():
    gap = {"baseline": {"label": "advertised conditions"}, "final": {"label": "your run"},
           "config": "examples/llama-3.2-3b-lora.yaml",
           "measured": {"model": "/models/Llama-3.2-3B-Instruct", "device": "cuda", "device_name": "NVIDIA H200",
                        "dtype": "bfloat16", "date": "2026-12-04 16:00 UTC"}}
    assert gap_title(gap) == ("gapless gap: Llama-3.2-3B-Instruct, NVIDIA H200, bfloat16, 2026-12-04 16:00 UTC, "
                              "llama-3.2-3b-lora.yaml")


def test_report_console_and_metrics_agree(tmp_path):
    base = write_base_model(tmp_path / "base", seed=0)
    data = demo_task.write_jsonl(demo_task.make_examples(80, seed=1), tmp_path / "train.jsonl")
    cfg = load_config(data={
        "model": {"path": str(base), "dtype": "float32", "device": "cpu"},
        "data": {"sources": [{"path": str(data)}], "max_seq_len": 64, "tokens_per_batch": 128,
                 "cache_dir": str(tmp_path / "cache"), "num_workers": 0},
        "lora": {"r": 4}, "train": {"steps": 4, "log_every": 2}, "output_dir": str(tmp_path / "run")})
    console = io.StringIO()
    result = train(cfg, out=console)
    last = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["final"] and last["tokens_per_s"] == result.tokens_per_s and last["wall_s"] == result.wall_s
    said = re.search(r"throughput: ([\d,]+) real tokens in ([\d.]+) s = ([\d,]+) real tokens/s", console.getvalue())
    assert said.groups() == (f"{last['real_tokens']:,}", f"{last['wall_s']:.1f}", f"{last['tokens_per_s']:,.0f}")
    page = (tmp_path / "run" / "report.html").read_text()
    card = re.search(r'<div class="v">([\d,]+)</div><div class="k">real tokens/s, end to end', page)
    assert card.group(1) == f"{last['tokens_per_s']:,.0f}"
    # the device that ran, by name, not `auto`
    run = read_run(tmp_path / "run")
    assert run.environment[-1]["device"] == "cpu" and "ran on" in page
    # the live channel showed the start-up phases and the first step as such
    text = console.getvalue()
    assert "startup: reading and tokenizing the data" in text and "startup: first step" in text
    assert re.search(r"step 4/4 .* s/step", text)
