"""The meter of several processes (gloo, 2 ranks, the demo's tiny Llama): every logged record carries the slowest
rank, the waiting in collectives and the communication exposed and overlapped (DDP, timed by its comm hook; FSDP2
says it is not measured); the timeline charges it to "communication"; report.html gains a per-rank section; `gapless
gap RUN` of such a run has a communication bar equal to its formula, and skips it for one process."""
import json
from pathlib import Path

import pytest
import torch

from gapless.diagnosis.gap import Stages, communication, communication_share, run_gap
from gapless.meter.report import read_run, render
from gapless.meter.timeline import CATEGORIES
from test_dist import raw_config, run_ranks
from test_loop import base  # noqa: F401  (the demo's tiny Llama and 200 records)

STEPS = 4


@pytest.fixture(scope="module")
def runs(base):
    """2 ranks, one spawn: DDP logging every step, FSDP2 logging every 2 steps (4 steps each, no checkpoints)."""
    torch.set_num_threads(1)
    common = {"train.steps": STEPS, "checkpoint.every": 0}
    spec = {"ddp": raw_config(base, "comm-ddp", **{"parallel.strategy": "ddp", "train.log_every": 1}, **common),
            "fsdp": raw_config(base, "comm-fsdp", **{"parallel.strategy": "fsdp", "train.log_every": 2}, **common)}
    run_ranks(2, [("run", spec["ddp"], None), ("run", spec["fsdp"], None)])
    return {k: Path(v["raw"]["output_dir"]) for k, v in spec.items()}


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_ddp_records_carry_ranks_and_communication(runs):
    train = [r for r in records(runs["ddp"]) if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    for r in train:
        assert r["world_size"] == 2 and r["window_steps"] == 1 and r["comm_measured"].startswith("ddp comm hook")
        assert r["slowest_rank"] in (0, 1) and 0 <= r["slowest_rank_compute_s"] <= r["rank_compute_s_max"]
        assert (r["slowest_rank_compute_s"] > 0) == (r["step"] > 1)  # step 1, the warm-up, is startup
        assert 0 <= r["collective_wait_s_mean"] <= r["collective_wait_s_max"] < r["rank_step_s_max"]
        # exposed: a part of the step's compute; overlapped: the rest of the probe's estimate of the traffic
        assert 0 <= r["comm_exposed_s"] <= r["rank_step_s_max"]
        assert r["step"] == 1 or r["comm_exposed_s"] <= r["rank_compute_s_max"] <= r["rank_step_s_max"]
        assert r["comm_total_s"] == pytest.approx(r["comm_serial_s_per_step"] * r["window_steps"])
        assert r["comm_overlapped_s"] == pytest.approx(max(r["comm_total_s"] - r["comm_exposed_s"], 0.0))
        assert r["comm_exposed_s"] + r["collective_wait_s_mean"] < r["rank_step_s_max"]
    # the timeline: every second once; communication (rank 0's tails and barrier waits) out of compute
    final = [r for r in records(runs["ddp"]) if r.get("kind") == "time"][-1]
    assert set(final["seconds"]) == set(CATEGORIES) and final["seconds"]["communication"] > 0
    assert sum(final["seconds"].values()) == pytest.approx(final["wall_s"], rel=1e-6)


def test_fsdp_says_communication_is_not_measured(runs):
    train = [r for r in records(runs["fsdp"]) if "loss" in r]
    assert [(r["step"], r["window_steps"]) for r in train] == [(2, 2), (4, 2)]
    for r in train:
        assert r["comm_exposed_s"] is None and r["comm_overlapped_s"] is None
        assert r["comm_measured"].startswith("not measured: FSDP2")
        assert r["slowest_rank"] in (0, 1) and r["collective_wait_s_max"] >= r["collective_wait_s_mean"] >= 0


def test_report_has_the_per_rank_section(runs, tmp_path):
    page = (runs["ddp"] / "report.html").read_text()  # written by rank 0 at the end of the run
    assert "<h2>Ranks and communication</h2>" in page and "slowest rank" in page
    assert "communication, exposed" in page and "ms per step" in page and "waiting for slower ranks" in page
    assert "Communication and waiting per step" in page and "communication and waiting for ranks" in page
    assert "not measured: FSDP2" in (runs["fsdp"] / "report.html").read_text()
    # the same records without the fields of several processes: no such section
    one = tmp_path / "one"
    one.mkdir()
    (one / "metrics.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items() if k != "world_size"}) + "\n"
                                               for r in records(runs["ddp"])))
    assert "Ranks and communication" not in render(read_run(one))


def test_gap_communication_factor_is_its_formula(runs):
    train = read_run(runs["ddp"]).train
    share = communication_share(train)
    steady = train[1:]  # step 1's window is the warm-up step alone
    f = sum(r["comm_exposed_s"] + r["collective_wait_s_mean"] for r in steady) / sum(r["rank_step_s_max"]
                                                                                      for r in steady)
    assert share["share"] == pytest.approx(f) and 0 < f < 1
    assert (share["world_size"], share["strategy"], share["steps"]) == (2, "ddp", STEPS - 1)
    stages = Stages((1000.0, 0.5))  # 2,000 tokens/s before it
    communication(stages, share)
    (row,) = stages.rows
    assert row["factor"] == "communication" and row["tokens_per_s"] == pytest.approx(2000 * (1 - f))
    assert "2 processes" in row["setting"]
    # FSDP2: the waiting only, and said
    fsdp = communication_share(read_run(runs["fsdp"]).train)
    assert fsdp["exposed_s"] == 0 and "not measured" in fsdp["measured"]
    # one process: skipped, with the reason
    one = Stages((1000.0, 0.5))
    communication(one, communication_share([{k: v for k, v in r.items() if k != "world_size"} for r in train]))
    assert one.rows == [{"factor": "communication", "skipped": one.rows[0]["skipped"]}]
    assert one.rows[0]["skipped"].startswith("one process: no communication")


def test_gap_of_a_torchrun_run_folder(runs, tmp_path):
    """`gapless gap RUN` of the DDP run: its windows run in one process; the communication bar is the stage before
    it times (1 - f), f from the run's metrics.jsonl."""
    gap = run_gap(runs["ddp"], steps=2, out=tmp_path / "gap", stream=open("/dev/null", "w"), log=lambda text: None)
    steps = gap["steps"]
    i = next(i for i, s in enumerate(steps) if s["factor"] == "communication")
    before = next(s for s in reversed(steps[:i]) if "skipped" not in s)
    f = communication_share(read_run(runs["ddp"]).train)["share"]
    assert steps[i]["tokens_per_s"] == pytest.approx(before["tokens_per_s"] * (1 - f))
    assert steps[i]["delta"] == pytest.approx(steps[i]["tokens_per_s"] - before["tokens_per_s"])
