"""Run folder safety (gapless.train.runlock): the lock, the refusal to overwrite a run, the resume config check and
the per-run default output folder."""
import copy
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gapless.config import load_config, to_dict
from gapless.train import runlock, warm_attention
from gapless.train.runlock import RunLock, check_resume, default_output_dir, existing_run, prepare_run_dir

MINIMAL = {"model": {"path": "models/tiny"}, "data": {"sources": [{"path": "train.jsonl"}]}}


def test_a_second_lock_on_the_same_folder_is_refused_naming_the_holder(tmp_path):
    with RunLock(tmp_path):
        with pytest.raises(ValueError, match=rf"in use by another run \(pid {os.getpid()} on"):
            with RunLock(tmp_path):
                pass
    with RunLock(tmp_path):  # released at exit
        pass


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    code = ("import sys, time; from gapless.train.runlock import RunLock; "
            "l = RunLock(sys.argv[1]).__enter__(); print('locked', flush=True); time.sleep(60)")
    env = {**os.environ, "PYTHONPATH": str(Path(runlock.__file__).parents[2])}
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, env=env, text=True)
    assert proc.stdout.readline().strip() == "locked"
    with pytest.raises(ValueError, match=f"pid {proc.pid}"):
        RunLock(tmp_path).__enter__()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with RunLock(tmp_path):  # the kernel dropped the dead process's lock
        pass


def test_a_folder_holding_a_run_is_refused_without_resume_or_overwrite(tmp_path):
    prepare_run_dir(tmp_path / "new", resume=False, overwrite=False)  # nothing there: fine
    run = tmp_path / "run"
    (run / "checkpoints" / "step-00000004").mkdir(parents=True)
    (run / "adapter").mkdir()
    (run / "adapter" / "adapter_config.json").write_text("{}")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "notes.txt").write_text("mine")
    (run / warm_attention.LOG).write_text("warmed 1 forward and backward call(s) in 10.3 s\n")
    assert existing_run(run) == "metrics.jsonl, checkpoints up to step-00000004, the final adapter/ (a finished run)"
    with pytest.raises(ValueError, match="already holds a run .*--resume.*--overwrite"):
        prepare_run_dir(run, resume=False, overwrite=False)
    prepare_run_dir(run, resume=True, overwrite=False)  # resuming it is what it is for
    assert (run / "checkpoints").is_dir()
    prepare_run_dir(run, resume=False, overwrite=True)
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"] and existing_run(run) is None


def saved_and_new(*overrides):
    saved = to_dict(load_config(data=copy.deepcopy(MINIMAL)))  # overrides edit the dict in place
    return saved, to_dict(load_config(data=copy.deepcopy(MINIMAL), overrides=list(overrides)))


@pytest.mark.parametrize("override,field", [
    ("data.sources.0.path=other.jsonl", "data.sources.0.path"), ("model.path=models/other", "model.path"),
    ("lora.r=8", "lora.r"), ("lora.alpha=3", "lora.alpha"), ("optim.lr=1e-3", "optim.lr"),
    ("train.grad_accum=4", "train.grad_accum"), ("data.tokens_per_batch=8192", "data.tokens_per_batch"),
    ("data.max_seq_len=1024", "data.max_seq_len"), ("model.dtype=float32", "model.dtype"),
    ("train.seed=5", "train.seed"), ("schedule.kind=linear", "schedule.kind"),
])
def test_resume_with_a_changed_setting_is_refused_naming_it(override, field):
    saved, new = saved_and_new(override)
    with pytest.raises(ValueError, match=rf"differs from the run's config.yaml in {field} "):
        check_resume(saved, new)


def test_resume_names_every_changed_field():
    saved, new = saved_and_new("lora.r=8", "optim.lr=1e-3", "train.steps=100")
    with pytest.raises(ValueError, match=r"in lora.r, optim.lr \(lora.r: 16 -> 8; optim.lr: 0.0002 -> 0.001\)"):
        check_resume(saved, new)


def test_resume_may_change_length_logging_and_evaluation():
    saved, new = saved_and_new("train.steps=500", "train.log_every=5", "checkpoint.every=50", "resume=true")
    assert check_resume(saved, new) == {"checkpoint.every": ("auto", 50), "resume": (False, True),
                                        "train.log_every": (10, 5), "train.steps": (0, 500)}


def test_resume_may_swap_lora_kernel_concat_and_grouped_only():
    """concat and grouped compute the same sums (a run recorded grouped before concat became the default, or
    resolved to grouped under dropout); reference draws a mask per projection, so it stays refused."""
    saved, new = saved_and_new("lora.kernel=concat")
    saved["lora"]["kernel"] = "grouped"
    assert check_resume(saved, new) == {"lora.kernel": ("grouped", "concat")}
    saved, new = saved_and_new("lora.kernel=reference")
    with pytest.raises(ValueError, match=r"differs from the run's config.yaml in lora.kernel "):
        check_resume(saved, new)


def test_resume_with_auto_tokens_per_batch_accepts_the_recorded_number():
    """A run started with data.tokens_per_batch auto records the batch finder's number in config.yaml; resuming
    with the same config (auto) is no change (it found the GPU run refused, session 15). Another number is."""
    saved, new = saved_and_new("data.tokens_per_batch=auto")
    saved["data"]["tokens_per_batch"] = 3774784
    assert check_resume(saved, new) == {}
    saved, new = saved_and_new("data.tokens_per_batch=8192")
    saved["data"]["tokens_per_batch"] = 3774784
    with pytest.raises(ValueError, match=r"in data.tokens_per_batch \(data.tokens_per_batch: 3774784 -> 8192\)"):
        check_resume(saved, new)


def test_default_output_dir_is_per_run_and_resume_finds_the_newest(tmp_path):
    a = default_output_dir("examples/my-run.yaml", resume=False, root=tmp_path, now=0)
    b = default_output_dir("examples/my-run.yaml", resume=False, root=tmp_path, now=3600)
    assert a != b and Path(a).name.startswith("my-run-") and Path(a).parent == tmp_path
    with pytest.raises(ValueError, match="no run of examples/my-run.yaml"):
        default_output_dir("examples/my-run.yaml", resume=True, root=tmp_path)
    for d in (a, b):
        Path(d).mkdir()
    (tmp_path / "my-run-notes").mkdir()  # not a run folder name: ignored
    assert default_output_dir("examples/my-run.yaml", resume=True, root=tmp_path) == b


def test_output_dir_overrides_only_when_none_is_set(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {path: m}\n")
    assert runlock.output_dir_overrides(cfg, ["output_dir=x"], resume=False) == []
    assert runlock.output_dir_overrides(cfg, [], resume=False)[0].startswith("output_dir=runs/c-")
    cfg.write_text("output_dir: runs/mine\n")
    assert runlock.output_dir_overrides(cfg, [], resume=False) == []
