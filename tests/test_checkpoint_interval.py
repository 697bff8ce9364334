"""checkpoint.every auto (gapless.train.checkpoint_interval): the interval at which saves cost at most 1% of the
training time. The resolution for given numbers; then real runs of test_loop's tiny LoRA on the CPU (fp32): the
interval the formula gives for the measured numbers, recorded in metrics.jsonl and printed once; the warm-up step
kept out of the step time; a run shorter than the measurement saves once at its end; resume; every 0 saves none.
"""
import io
import json
import math
import time

import pytest

from gapless.meter.report import checkpoint_steps, read_run
from gapless.train import checkpoint, checkpoint_interval, loop
from gapless.train.checkpoint_interval import (MEASURE_STEPS, MIN_EVERY, SHARE, CheckpointSchedule, choose_interval,
                                               predicted_save)
from gapless.train.loop import train
from test_loop import base, run_config  # noqa: F401  (base: the module's fixture)


# ---------------------------------------------------------------------------------------------
# the resolution, for given numbers


def test_the_one_percent_rule():
    # a save that blocks 0.2 s, steps of 0.5 s: 0.2 / (0.01 x 0.5) = 40 steps, and at 40 the cost is exactly 1%
    i = choose_interval(0.5, 0.2, None, 1000, "given")
    assert i.every == 40 and i.share == pytest.approx(SHARE)
    assert choose_interval(0.5, 0.2001, None, 1000, "given").every == 41  # rounded up: never above 1%
    assert "ceil(0.2 / (0.01 x 0.5))" in i.formula() and i.formula().endswith("= 40")


def test_the_bounds():
    # a cheap save: never more often than every MIN_EVERY steps
    assert choose_interval(1.0, 0.001, None, 1000, "given").every == MIN_EVERY == 10
    # async: the background write (3 s) is done before the next save, else that save would wait for it
    assert choose_interval(0.1, 0.001, 3.0, 1000, "given").every == 30


def test_predicted_save_cost_from_the_bytes():
    save_s, write_s, source = predicted_save(10**9, async_write=True)  # 1 GB at 10 GB/s to host, 0.5 GB/s to disk
    assert (save_s, write_s) == pytest.approx((0.1, 2.0)) and "1,000.0 MB" in source
    save_s, write_s, _ = predicted_save(10**9, async_write=False)  # the loop waits for the whole write
    assert save_s == pytest.approx(2.1) and write_s is None


def test_schedule_fixed_off_and_auto():
    fixed = CheckpointSchedule(5, True, last_step=12)
    assert [s for s in range(1, 13) if fixed.due(s)] == [5, 10, 12]
    off = CheckpointSchedule(0, True, last_step=12)
    assert not any(off.due(s) for s in range(1, 13))  # 0: none, not even at the end
    auto = CheckpointSchedule("auto", False, last_step=40)
    assert auto.pending and [s for s in range(1, 41) if auto.due(s)] == [40]  # not chosen: only the last step
    chosen = auto.choose(0.5, 10**8)  # sync: 0.01 + 0.2 s per save -> ceil(0.21 / 0.005) = 42
    assert not auto.pending and chosen.every == 42 and "predicted" in chosen.source
    assert auto.remeasure(4, 0.21) is None  # the measured save agrees: nothing to record
    auto = CheckpointSchedule("auto", False, last_step=40)
    auto.choose(0.5, 10**8)
    changed = auto.remeasure(4, 0.05)  # measured: 0.05 / 0.005 = 10
    assert changed.every == auto.every == 10 and "measured" in changed.source and auto.remeasured
    assert [s for s in range(5, 41) if auto.due(s)] == [10, 20, 30, 40]


def test_a_save_that_waits_for_the_previous_write_widens_the_interval():
    auto = CheckpointSchedule("auto", True, last_step=100)
    assert auto.choose(0.5, 10**6).every == 10  # 1 MB: 0.1 ms to host, 2 ms to disk: the floor
    assert auto.waited(20, 0.01) is None  # (0.1 ms + 10 ms) / (10 x 0.5 s) = 0.2%: within 1%
    # a disk far slower than stated: the write took at least 10 x 0.5 + 1 = 6 s, so every 12 steps lets it finish
    slower = auto.waited(20, 1.0)
    assert slower.every == auto.every == 12 and slower.write_s == pytest.approx(6.0) and "waited" in slower.source


# ---------------------------------------------------------------------------------------------
# real runs


@pytest.fixture
def timed(monkeypatch):
    """The loop's step with a known floor: the first step of each session sleeps `first` s (start-up), every other
    `each` s; MIN_EVERY 2, so that the 1% rule, not the floor, decides in a short run."""
    monkeypatch.setattr(checkpoint_interval, "MIN_EVERY", 2)
    real = loop.train_step
    calls = {"n": 0, "first": 0.0, "each": 0.0, "seconds": []}

    def slow_step(*args, **kwargs):
        start = time.perf_counter()
        calls["n"] += 1
        time.sleep(calls["first"] if calls["n"] == 1 else calls["each"])
        out = real(*args, **kwargs)
        calls["seconds"].append(time.perf_counter() - start)  # each step's own time, however loaded the CPU is
        return out

    monkeypatch.setattr(loop, "train_step", slow_step)
    return calls


def intervals(run_dir) -> list[dict]:
    return [r for r in map(json.loads, open(run_dir / "metrics.jsonl")) if r.get("kind") == "checkpoint_interval"]


def saved_steps(run_dir) -> list[int]:
    return sorted(int(p.name.removeprefix("step-")) for p in (run_dir / "checkpoints").glob("step-*"))


def test_auto_writes_at_the_interval_the_formula_gives(base, timed, tmp_path):
    timed.update(first=3.0, each=0.05)
    out = io.StringIO()
    cfg = run_config(base, str(tmp_path / "auto"), **{"checkpoint.every": "auto", "checkpoint.keep": 50,
                                                      "train.steps": 14, "train.log_every": 5, "progress": "true"})
    result = train(cfg, out=out)
    records = intervals(result.run_dir)
    first = records[0]
    assert first["step"] == 1 + MEASURE_STEPS and "predicted" in first["source"]
    # start-up excluded: the warm-up step slept 3 s, which would add 1 s to each of the 3 measured steps; step_s is
    # their own time plus the loop's between them (data, logging: well under 0.5 s a step)
    measured = sum(timed["seconds"][1:1 + MEASURE_STEPS]) / MEASURE_STEPS
    assert timed["seconds"][0] >= 3.0 and measured <= first["step_s"] < measured + 0.5, (first, timed["seconds"])
    # the interval is the formula's for the recorded numbers, and costs at most 1%
    for r in records:
        want = max(math.ceil(r["save_s"] / (SHARE * r["step_s"])), 2,
                   *([math.ceil(r["write_s"] / r["step_s"])] if r["write_s"] is not None else []))
        assert r["every"] == want and r["share"] <= SHARE and r["formula"].endswith(f"= {want}"), r
    # the first real save re-resolves from its measured blocking time, recorded only when it changes the interval;
    # on a loaded machine a later save may wait for the previous write and widen it again (recorded as such)
    assert all("measured" in r["source"] for r in records[1:])
    assert sum("blocked the loop" in r["source"] for r in records[1:]) <= 1
    assert all("waited" in r["source"] for r in records[1:] if "blocked the loop" not in r["source"])
    # checkpoints at the multiples of the interval in force, and at the last step; the report finds the same steps
    expected = checkpoint_steps(read_run(result.run_dir))
    assert saved_steps(result.run_dir) == expected and expected[-1] == 14
    assert expected[0] == (first["step"] // first["every"] + 1) * first["every"] or expected == [14]
    # printed once per record, through the progress channel
    assert out.getvalue().count("checkpoint.every auto:") == len(records)
    assert "of the training time" in out.getvalue()


def test_a_run_shorter_than_the_measurement_saves_once_at_its_end(base, tmp_path):
    result = train(run_config(base, str(tmp_path / "short"), **{"checkpoint.every": "auto", "train.steps": 3}))
    (record,) = intervals(result.run_dir)
    assert record["every"] is None and "one checkpoint, at its end" in record["reason"]
    assert saved_steps(result.run_dir) == [3]
    assert checkpoint_steps(read_run(result.run_dir)) == [3]


def test_every_0_writes_no_checkpoint(base, tmp_path):
    result = train(run_config(base, str(tmp_path / "off"), **{"checkpoint.every": 0, "train.steps": 3}))
    assert saved_steps(result.run_dir) == [] and intervals(result.run_dir) == []
    assert result.final_dir is not None


def test_a_slow_disk_is_measured_at_the_save_that_waits(base, timed, tmp_path, monkeypatch):
    """Each file of a checkpoint takes 2.5 s to write (5 s a checkpoint), far slower than the stated rate: a later save
    waits for the previous write, and the interval widens so that the write ends before the next save."""
    timed.update(first=0.0, each=0.05)
    write = checkpoint._write_torch

    def slow_write(obj, path):
        time.sleep(2.5)
        return write(obj, path)

    monkeypatch.setattr(checkpoint, "_write_torch", slow_write)
    monkeypatch.setattr(checkpoint_interval, "predicted_save", lambda nbytes, async_write: (0.0, 0.0, "free"))
    result = train(run_config(base, str(tmp_path / "slow"), **{"checkpoint.every": "auto", "checkpoint.keep": 50,
                                                               "train.steps": 14}))
    waited = [r for r in intervals(result.run_dir) if "waited" in r["source"]]
    assert waited, intervals(result.run_dir)
    for r in waited:  # the write (at least the interval before plus the wait) ends within the new interval
        assert r["write_s"] > 2.5 and r["every"] * r["step_s"] >= r["write_s"] and r["every"] > 2, r
    assert saved_steps(result.run_dir) == checkpoint_steps(read_run(result.run_dir))


def test_resume_from_an_auto_run(base, timed, tmp_path):
    """Interval 2 (a save predicted free, MIN_EVERY 2), chosen at step 4: checkpoint 6, a crash after step 7;
    the resumed session measures its own steps again, and the losses are the uninterrupted run's."""
    timed.update(first=0.0, each=0.0)
    real_predicted = checkpoint_interval.predicted_save

    def free(nbytes, async_write):
        return 0.0, None, real_predicted(nbytes, async_write)[2]

    import unittest.mock as mock

    # the interval stays 2: the re-measured first save (real, ms) would choose another by the CPU's load, 7 under a
    # loaded CI box, whose save at step 7 left nothing to redo
    with mock.patch.object(checkpoint_interval, "predicted_save", free), \
            mock.patch.object(checkpoint_interval.CheckpointSchedule, "remeasure", lambda self, step, blocked_s: None):
        over = {"checkpoint.every": "auto", "train.steps": 12}
        whole = train(run_config(base, str(tmp_path / "whole"), **over))
        stopped = train(run_config(base, str(tmp_path / "stopped"), **over), stop_after=7)
        assert intervals(stopped.run_dir)[0]["every"] == 2 and 6 in saved_steps(stopped.run_dir)
        resumed = train(run_config(base, str(tmp_path / "stopped"), resume="true", **over))
    assert sorted(resumed.losses) == [7, 8, 9, 10, 11, 12]  # step 7 redone from the checkpoint of step 6
    assert {**stopped.losses, **resumed.losses} == whole.losses
    records = intervals(resumed.run_dir)  # the first session's (up to step 6) and the resumed session's own
    assert records[0]["step"] == 4 and any(r["step"] == 6 + 1 + MEASURE_STEPS and "predicted" in r["source"]
                                           for r in records)
    assert saved_steps(resumed.run_dir)[-1] == 12 and (resumed.run_dir / "adapter").is_dir()
