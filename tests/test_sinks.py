"""train.report_to: TensorBoard and W&B get every record the loop writes to metrics.jsonl, while the run goes on.

- a short CPU run's TensorBoard scalars equal metrics.jsonl's loss and tokens/s per step, and are in the event
  file after step 3 of 6, read by TensorBoard's own reader from inside the run (through the progress stream);
- the live scalars are the replayed ones (`gapless report RUN --tensorboard`): one mapping serves both;
- W&B (a stand-in module) is logged each record at the moment metrics.jsonl gets it, and finished however the run
  ends: a signal's stop, or an error (marked failed); the real package, offline, when installed;
- config errors name the field; a missing package is an error at start-up, naming train.report_to and the pip
  command, before anything is written.
"""
import glob
import io
import json
import shutil
import signal
import struct
import sys
import time
import types

import pytest

from gapless.cli import main
from gapless.config import ConfigError, load_config
from gapless.meter.sinks import open_sinks, scalars, write_tensorboard
from gapless.train.loop import train
from conftest import training_records
from test_loop import STEPS, base, run_config  # noqa: F401 (base: the fixture)
from test_wandb_export import FakeRun


def tb_scalars(folder) -> dict[str, dict[int, float]]:
    """tag -> step -> value, as TensorBoard reads the event files of `folder`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: every value, none sampled away
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


class AtStep(io.StringIO):
    """The run's progress stream: calls `action` once, when the status line of `step` is printed, which the loop
    does right after it wrote that step's record (so inside the run, with steps still to go)."""

    def __init__(self, step: int, action):
        super().__init__()
        self.marker, self.action, self.result = f"step {step}/{STEPS}", action, None

    def write(self, text: str) -> int:
        if self.marker in text and self.result is None:
            self.result = self.action()
        return super().write(text)


def test_tensorboard_streams_the_records_during_the_run(base, tmp_path):  # noqa: F811
    pytest.importorskip("tensorboard")
    cfg = run_config(base, "tb", **{"train.report_to": "[tensorboard]", "progress": "true"})
    run_dir = base["root"] / "tb"
    watch = AtStep(3, lambda: (tb_scalars(run_dir / "tensorboard"), training_records(run_dir / "metrics.jsonl")))
    result = train(cfg, out=watch)
    assert result.steps == STEPS and result.stopped is None
    seen, written = watch.result
    assert [r["step"] for r in written] == [1, 2, 3]  # the run was at step 3 of 6
    assert sorted(seen["train/loss"]) == [1, 2, 3]
    for r in written:
        assert seen["train/loss"][r["step"]] == pytest.approx(r["loss"], rel=1e-6)  # float32 in the event file

    final = tb_scalars(run_dir / "tensorboard")
    records = training_records(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for key in ("loss", "tokens_per_s", "lr", "grad_norm"):
        assert final[f"train/{key}"] == pytest.approx({r["step"]: r[key] for r in records}, rel=1e-6), key
    last = [json.loads(line) for line in open(run_dir / "metrics.jsonl")][-1]
    assert last["kind"] == "time" and final["time/compute_s"][STEPS] == pytest.approx(last["seconds"]["compute"])

    # the replay of the finished run's folder writes the same scalars: one mapping, live and after the fact
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("tensorboard"))
    assert tb_scalars(write_tensorboard(copy)) == final


def test_scalars_of_each_kind_of_record():
    assert scalars({"step": 3, "loss": 1.5, "lr": 1e-3, "grad_norm": float("nan"), "tokens_per_s": 10.0,
                    "mfu": None, "real_tokens": 100}) == {"train/loss": 1.5, "train/lr": 1e-3,
                                                          "train/tokens_per_s": 10.0}
    assert scalars({"step": 3, "loss": None, "lr": 1e-3}) == {"train/lr": 1e-3}  # a diverged step: no loss point
    assert scalars({"step": 4, "eval_loss": 2.0, "eval_tokens": 9}) == {"eval/loss": 2.0}
    assert scalars({"kind": "time", "step": 4, "seconds": {"compute": 1.0, "eval": 0.5}}) == \
        {"time/compute_s": 1.0, "time/eval_s": 0.5}
    assert scalars({"kind": "stopped", "step": 4, "reason": "SIGTERM"}) == {}


def test_tensorboard_gpu_samples_follow_the_earlier_sessions(tmp_path):
    pytest.importorskip("tensorboard")
    samples = [{"t": t, "util": 90} for t in (0.5, 1.0, 0.5, 2.0)]  # two sessions: 1.0 s, then 2.0 s
    (tmp_path / "gpu.jsonl").write_text("".join(json.dumps(sample) + "\n" for sample in samples))
    sinks = open_sinks(["tensorboard"], tmp_path)  # a third session: its samples start at 3.0 s
    sinks.gpu({"t": 0.25, "util": 97, "power_w": None, "temp_c": 60})
    sinks.write({"step": 7, "loss": 0.5})
    sinks.close()
    assert tb_scalars(tmp_path / "tensorboard") == {"gpu/util": {3250: 97.0}, "gpu/temp_c": {3250: 60.0},
                                                    "train/loss": {7: 0.5}}


def test_replay_tags_each_rank_gpu(tmp_path):
    """Under torchrun, gpu/* is rank 0's GPU as live; the replay adds rank r's samples as gpu/rank{r}/*, each rank's
    sessions joined on the run's time axis."""
    pytest.importorskip("tensorboard")
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.5, "world_size": 2}) + "\n")
    (tmp_path / "gpu.jsonl").write_text(json.dumps({"t": 0.5, "util": 90}) + "\n")
    (tmp_path / "gpu.rank1.jsonl").write_text("".join(json.dumps(s) + "\n" for s in (
        {"t": 0.5, "util": 40, "temp_c": 70}, {"t": 1.0, "util": 41}, {"t": 0.5, "util": 42}))  # resumed
        + '{"t": 1.0, "ut')  # torn last line
    assert tb_scalars(write_tensorboard(tmp_path)) == {
        "train/loss": {1: 0.5}, "gpu/util": {500: 90.0},
        "gpu/rank1/util": {500: 40.0, 1000: 41.0, 1500: 42.0}, "gpu/rank1/temp_c": {500: 70.0}}


@pytest.fixture
def live_wandb(monkeypatch):
    """A stand-in wandb whose log() also notes the last line of metrics.jsonl at the moment it is called."""
    runs = []

    class LiveRun(FakeRun):
        def log(self, data, step=None, commit=None):
            super().log(data, step, commit)
            lines = open(f"{self.init['dir']}/metrics.jsonl").read().splitlines()
            self.logged[-1] += (json.loads(lines[-1]),)

    def init(**kwargs):
        runs.append(LiveRun(**kwargs))
        return runs[-1]

    module = types.ModuleType("wandb")
    module.init = init
    monkeypatch.setitem(sys.modules, "wandb", module)
    return runs


def test_wandb_gets_each_record_as_it_is_written_and_is_finished_on_a_signal(base, live_wandb):  # noqa: F811
    cfg = run_config(base, "wb", **{"train.report_to": "[wandb]", "train.wandb.project": "p1", "progress": "true"})
    # SIGTERM at step 3: the run stops after that step with a checkpoint, as for a preemption
    watch = AtStep(3, lambda: signal.raise_signal(signal.SIGTERM) or True)
    result = train(cfg, out=watch)
    assert result.stopped == "SIGTERM"
    (wb,) = live_wandb
    assert wb.finished and wb.exit_code == 0
    assert (wb.init["project"], wb.init["mode"], wb.init["name"]) == ("p1", "offline", "wb")
    assert wb.init["dir"] == str(result.run_dir) and wb.init["config"]["train"]["report_to"] == ["wandb"]
    for data, step, last_written in wb.logged:  # the record logged is the one metrics.jsonl just got
        assert step == last_written["step"] and data == scalars(last_written)
    records = training_records(result.run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    logged = {step: data for data, step, _ in wb.logged if "train/loss" in data}
    assert {s: d["train/loss"] for s, d in logged.items()} == {r["step"]: r["loss"] for r in records}


def test_sinks_are_closed_when_the_run_fails(base, live_wandb, monkeypatch):  # noqa: F811
    import gapless.train.loop as loop

    def fail(*args, **kwargs):
        raise RuntimeError("disk gone")

    monkeypatch.setattr(loop, "finish", fail)
    cfg = run_config(base, "wb_fail", **{"train.report_to": "[wandb]", "train.steps": 2, "checkpoint.every": 0})
    with pytest.raises(RuntimeError, match="disk gone"):
        train(cfg)
    (wb,) = live_wandb
    assert wb.finished and wb.exit_code == 1  # W&B shows the run as failed


def test_missing_package_stops_the_run_at_its_start(base, monkeypatch, tmp_path, capsys):  # noqa: F811
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were not installed
    monkeypatch.setitem(sys.modules, "wandb", None)
    cfg = run_config(base, "missing", **{"train.report_to": "[tensorboard, wandb]"})
    with pytest.raises(ValueError) as e:
        train(cfg)
    assert str(e.value).splitlines() == [
        "train.report_to: tensorboard needs the tensorboard package: pip install 'gapless[tensorboard]' "
        "(metrics.jsonl and report.html need nothing more)",
        "train.report_to: wandb needs the wandb package: pip install 'gapless[wandb]' "
        "(metrics.jsonl and report.html need nothing more)"]
    assert not (base["root"] / "missing").exists()  # nothing written, no model loaded
    path = tmp_path / "c.yaml"
    path.write_text(f"model: {{path: {base['model']}}}\ndata: {{sources: [{{path: {base['data']}}}]}}\n"
                    f"output_dir: {tmp_path / 'run'}\ntrain: {{report_to: [wandb]}}\n")
    assert main(["train", str(path)]) == 2
    assert "train.report_to: wandb needs the wandb package: pip install 'gapless[wandb]'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_config_errors_name_the_field():
    data = {"model": {"path": "m"}, "data": {"sources": [{"path": "t.jsonl"}]}}
    with pytest.raises(ConfigError) as e:
        load_config(data=data, overrides=["train.report_to=[tensorbord, mlflow]", "train.wandb.mode=cloud"])
    assert e.value.errors == [
        "config.train.report_to[0]: 'tensorbord' is not one of ['tensorboard', 'wandb']; did you mean 'tensorboard'?",
        "config.train.report_to[1]: 'mlflow' is not one of ['tensorboard', 'wandb']",
        "config.train.wandb.mode: 'cloud' is not one of ['offline', 'online']"]
    with pytest.raises(ValueError, match=r"train.report_to: \['wandb'\] listed more than once"):
        load_config(data=data, overrides=["train.report_to=[wandb, wandb]"])
    with pytest.raises(ValueError, match="train.report_to: expected a list"):
        load_config(data=data, overrides=["train.report_to=tensorboard"])
    with pytest.warns(UserWarning, match="train.wandb is set but config.train.report_to does not list wandb"):
        load_config(data=data, overrides=["train.wandb.project=mine"])
    cfg = load_config(data=data, overrides=["train.report_to=[tensorboard, wandb]", "train.wandb.name=first"])
    assert cfg.train.report_to == ["tensorboard", "wandb"] and cfg.train.wandb.mode == "offline"


def wandb_history(run_dir) -> list[dict]:
    """The history rows of RUN/wandb/offline-run-*/run-*.wandb: a LevelDB-style log of Record protobufs (7-byte
    W&B header, then 32 KiB blocks of records: crc32 4 bytes, length 2, type 1 (full 1, first 2, middle 3, last 4))."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for path in sorted(glob.glob(f"{run_dir}/wandb/offline-run-*/run-*.wandb")):
        data, pos, part = open(path, "rb").read(), 7, b""
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
                pos += 32768 - pos % 32768
                continue
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            if kind == 0:
                break
            part += data[pos + 7:pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):
                record = wandb_internal_pb2.Record()
                record.ParseFromString(part)
                part = b""
                if record.WhichOneof("record_type") == "history":
                    rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                                 for i in record.history.item})
    return rows


def test_wandb_offline_run_holds_the_metrics(base):  # noqa: F811
    pytest.importorskip("wandb")
    cfg = run_config(base, "wb_real", **{"train.report_to": "[wandb]"})
    result = train(cfg)
    assert list((result.run_dir / "wandb").glob("offline-run-*"))
    records = {r["step"]: r for r in training_records(result.run_dir / "metrics.jsonl")}
    deadline = time.monotonic() + 30  # wandb's service process writes the file after finish() returns
    while True:
        rows = {row["_step"]: row for row in wandb_history(result.run_dir) if "train/loss" in row}
        if len(rows) == len(records) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert {s: row["train/loss"] for s, row in rows.items()} == pytest.approx(
        {s: r["loss"] for s, r in records.items()})
    assert {s: row["train/tokens_per_s"] for s, row in rows.items()} == pytest.approx(
        {s: r["tokens_per_s"] for s, r in records.items()})
