"""Faults injected into training runs (issue robust:), the demo's tiny Llama on the CPU, fp32:

- a nan loss in one step: the step updates nothing and is counted; lr=1e30 and NaN base weights: the run stops
  after NONFINITE_LIMIT bad steps in a row, says where it began, writes no adapter; metrics.jsonl stays strict JSON;
- SIGTERM mid-run: a checkpoint within one step, exit 143, and --resume finishes the run; a second SIGINT exits at once;
- a second run on a locked folder, a finished run without --overwrite, --resume with a changed rank, every
  checkpoint corrupt: each refused before anything is overwritten;
- a full disk at the final adapter write: one message naming the checkpoint that holds the weights.
The kill -9 stress test (@pytest.mark.slow; bench/RELIABILITY.md has the command) runs >= 20 trials.
"""
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from gapless.config import to_dict
from gapless.data import batching, cache
from gapless.model import lora
from gapless.train import checkpoint, guard, step as step_module
from gapless.train.loop import train
from gapless.train.runlock import RunLock
from test_loop import base, run_config  # noqa: F401  (base: the module's fixture)

SRC = str(Path(step_module.__file__).parents[2])


def config(base, out, *extra):
    """test_loop's small LoRA run (grad_accum 2, dropout, checkpoints every 2 steps) into folder `out`."""
    return run_config(base, str(out), **dict(x.split("=", 1) for x in extra))


def config_file(base, out: Path, *extra) -> Path:
    """The same run as a YAML file for the CLI, with progress lines on (the messages these tests read)."""
    path = out.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(to_dict(config(base, out, "progress=true", *extra)), sort_keys=False))
    return path


def records(run: Path) -> list[dict]:
    """metrics.jsonl, parsed strictly: a bare NaN or Infinity fails."""
    def refuse(name):
        raise AssertionError(f"metrics.jsonl holds {name}: not strict JSON")
    return [json.loads(line, parse_constant=refuse) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("fused", [False, True])
def test_a_nan_step_updates_nothing_and_is_counted(base, tmp_path, monkeypatch, fused):
    real = step_module.loss_sum
    calls = []

    def nan_in_step_3(model, batch):  # the 3rd micro-batch (grad_accum 1: step 3) gives a nan loss
        calls.append(1)
        loss = real(model, batch)
        return loss * float("nan") if len(calls) == 3 else loss

    monkeypatch.setattr(step_module, "loss_sum", nan_in_step_3)
    result = train(config(base, tmp_path / "run", f"optim.fused={str(fused).lower()}", "train.grad_accum=1",
                          "train.steps=8", "checkpoint.every=1", "checkpoint.keep=10"))
    rec = [r for r in records(tmp_path / "run") if "loss" in r]
    assert [r["nonfinite_steps"] for r in rec] == [0, 0, 1, 0, 0, 0, 0, 0]
    assert rec[2]["grad_norm"] is None and rec[2]["loss"] is None  # nan written as null
    assert result.nonfinite_steps == 1 and result.stopped is None and result.final_dir is not None
    # step 3 changed nothing: its checkpoint's weights and optimizer moments equal step 2's
    ck = lambda s: torch.load(tmp_path / "run" / "checkpoints" / f"step-{s:08d}" / "model.pt", weights_only=True)
    opt = lambda s: torch.load(tmp_path / "run" / "checkpoints" / f"step-{s:08d}" / "optimizer.pt",
                               weights_only=True)
    for name in ck(2):
        assert torch.equal(ck(2)[name], ck(3)[name]), name
    assert all(torch.equal(a["exp_avg"], b["exp_avg"]) for a, b in zip(opt(2)["state"].values(),
                                                                          opt(3)["state"].values()))
    assert all(torch.isfinite(t).all() for t in load_file(result.final_dir / "adapter_model.safetensors").values())


def nan_base(base: dict, root: Path) -> Path:
    """A copy of the base model with one NaN in the first layer's q_proj."""
    folder = root / "nan_base"
    folder.mkdir(parents=True, exist_ok=True)
    for f in base["model"].iterdir():
        if f.is_file():
            (folder / f.name).write_bytes(f.read_bytes())
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.weight"][0, 0] = float("nan")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("fault", ["lr_1e30", "nan_base_weights"])
def test_a_diverged_run_stops_and_writes_no_nan_adapter(base, tmp_path, fault):
    if fault == "lr_1e30":
        cfg = config(base, tmp_path / "run", "optim.lr=1e30", "train.steps=30", "checkpoint.every=1")
    else:
        cfg = config(base, tmp_path / "run", f"model.path={nan_base(base, tmp_path)}", "train.steps=30",
                     f"data.tokenizer={base['model']}")
    result = train(cfg)
    assert result.stopped == "nonfinite" and result.final_dir is None
    assert not (tmp_path / "run" / "adapter").exists()
    stop = [r for r in records(tmp_path / "run") if r.get("kind") == "stopped"]
    assert len(stop) == 1 and stop[0]["reason"] == "nonfinite" and "from step" in stop[0]["message"]
    assert stop[0]["step"] - stop[0]["first_bad_step"] + 1 >= guard.NONFINITE_LIMIT
    for ck in (tmp_path / "run" / "checkpoints").glob("step-*"):  # every checkpoint written holds finite weights
        assert all(torch.isfinite(t).all() for t in torch.load(ck / "model.pt", weights_only=True).values())
    if fault == "nan_base_weights":
        assert stop[0]["first_bad_step"] == 1


def test_the_cli_exits_1_on_a_diverged_run(base, tmp_path):
    path = config_file(base, tmp_path / "run", "optim.lr=1e30", "train.steps=30")
    proc = subprocess.run([sys.executable, "-m", "gapless.cli", "train", str(path)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": SRC}, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "not finite for" in proc.stderr and "Traceback" not in proc.stderr


def start_cli(args: list[str], **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gapless.cli", "train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONPATH": SRC}, **kwargs)


def logged_step(run: Path) -> int:
    """The last training step metrics.jsonl holds (a line being written is left out)."""
    last = 0
    for line in (run / "metrics.jsonl").read_text().splitlines() if (run / "metrics.jsonl").is_file() else []:
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if "loss" in r:
            last = max(last, r["step"])
    return last


def wait_for_step(run: Path, step: int, proc, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if logged_step(run) >= step:
            return
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.05)
    raise AssertionError("the run did not reach the step in time")


def test_sigterm_checkpoints_exits_143_and_resume_finishes(base, tmp_path):
    run = tmp_path / "run"
    path = config_file(base, run, "train.steps=400", "checkpoint.every=0")
    proc = start_cli([str(path)])
    wait_for_step(run, 3, proc)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    stop_s = time.monotonic() - t0
    assert proc.returncode == 128 + signal.SIGTERM, out[-2000:]  # not done: `train && export` stops here
    assert "SIGTERM: stopped after step" in out and "Traceback" not in out
    assert "gapless train: SIGTERM: exit 143; continue with --resume" in out
    stop = [r for r in records(run) if r.get("kind") == "stopped"][0]
    assert stop["reason"] == "SIGTERM" and stop["checkpoint"]
    assert (run / "checkpoints" / f"step-{stop['step']:08d}" / "manifest.json").is_file()
    assert stop_s < 30, stop_s  # one step and one checkpoint write (both well under a second here)
    proc = start_cli([str(path), "train.steps=" + str(stop["step"] + 2), "--resume"])
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0 and f"continuing after step {stop['step']}" in out, out[-2000:]
    assert (run / "adapter" / "adapter_config.json").is_file()
    assert any(r.get("kind") == "resume" and "train.steps" in r["changed"] for r in records(run))


def test_a_stop_between_log_points_logs_the_last_steps(base, tmp_path, monkeypatch):
    """Ctrl-C after step 6 of a run logging every 4: the training records reach step 6, their real tokens add up to
    the last record's, and the report prints the last record's tokens/s (steps 5-6 were missing from both)."""
    from gapless.meter.report import read_run, throughput

    real = step_module.loss_sum
    calls = []

    def sigint_in_step_6(model, batch):  # grad_accum 2: the 12th micro-batch is step 6's last
        calls.append(1)
        if len(calls) == 12:
            signal.raise_signal(signal.SIGINT)  # StopSignals' handler: stop after this step
        return real(model, batch)

    monkeypatch.setattr(step_module, "loss_sum", sigint_in_step_6)
    result = train(config(base, tmp_path / "run", "train.steps=20", "train.log_every=4"))
    rec = records(tmp_path / "run")
    logged = [r for r in rec if "loss" in r]
    last = rec[-1]
    assert result.stopped == "SIGINT" and [r["step"] for r in logged] == [4, 6]
    assert sum(r["real_tokens"] for r in logged) == last["real_tokens"] == result.real_tokens
    assert throughput(read_run(tmp_path / "run"))["end_to_end"] == pytest.approx(last["tokens_per_s"])


def test_a_stop_during_the_last_step_finishes_the_run(base, tmp_path, monkeypatch):
    """Ctrl-C during the last step: every step ran, so the run finishes as complete (its adapter written), not as a
    stopped run without one."""
    real = step_module.loss_sum
    calls = []

    def sigint_in_the_last_step(model, batch):  # grad_accum 2, 4 steps: the 8th micro-batch is the last
        calls.append(1)
        if len(calls) == 8:
            signal.raise_signal(signal.SIGINT)
        return real(model, batch)

    monkeypatch.setattr(step_module, "loss_sum", sigint_in_the_last_step)
    result = train(config(base, tmp_path / "run", "train.steps=4", "train.log_every=2"))
    assert result.stopped is None and (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()
    assert not [r for r in records(tmp_path / "run") if r.get("kind") == "stopped"]


@pytest.mark.parametrize("when", ["last_step", "final_save"])
def test_a_stop_while_the_run_finishes_still_writes_the_adapter(base, tmp_path, monkeypatch, when):
    """A signal in the last step skips the final evaluation; one while the adapter is written is noted, not raised
    (it raised KeyboardInterrupt out of the save: every step ran and no adapter was written)."""
    from gapless.model import export
    from gapless.train import loop

    real_copy, real_loss, calls = export.copy_tokenizer_files, step_module.loss_sum, []

    def signal_in_the_last_step(model, batch):  # grad_accum 2, 4 steps: the 8th micro-batch is the last
        calls.append(1)
        if len(calls) == 8 and when == "last_step":
            signal.raise_signal(signal.SIGINT)
        return real_loss(model, batch)

    def signal_while_saving(*args):
        if when == "final_save":
            signal.raise_signal(signal.SIGTERM)
        return real_copy(*args)

    if when == "last_step":
        monkeypatch.setattr(loop, "evaluate", lambda *a: pytest.fail("the final evaluation ran after the signal"))
    monkeypatch.setattr(step_module, "loss_sum", signal_in_the_last_step)
    monkeypatch.setattr(export, "copy_tokenizer_files", signal_while_saving)
    run = tmp_path / "run"
    result = train(config(base, run, "train.steps=4", "train.log_every=2", "data.eval_fraction=0.2"))
    assert result.stopped is None and result.final_dir == run / "adapter"
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    evals = [r for r in records(run) if "eval_loss" in r and r["step"] == 4]
    assert len(evals) == (0 if when == "last_step" else 1)


def test_warmup_as_long_as_the_run_is_refused_when_the_config_is_read(base, tmp_path):
    with pytest.raises(ValueError, match=r"schedule.warmup_steps: 4 warmup steps leave nothing of a 4-step run"):
        config(base, tmp_path / "run", "train.steps=4", "schedule.warmup_steps=4")


def test_a_second_sigint_exits_at_once(tmp_path):
    code = ("import time; from gapless.train.guard import StopSignals\n"
            "with StopSignals() as stop:\n    print('ready', flush=True)\n"
            "    while True: time.sleep(0.01)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": SRC})
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    assert proc.poll() is None  # the first one only asks the loop to stop
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=10) == 130 and time.monotonic() - t0 < 5
    assert "again: exiting now" in proc.stderr.read()


def test_a_locked_folder_is_refused(base, tmp_path):
    with RunLock(tmp_path / "run"):
        with pytest.raises(ValueError, match="in use by another run"):
            train(config(base, tmp_path / "run"))
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_a_finished_run_is_not_overwritten_without_overwrite(base, tmp_path):
    train(config(base, tmp_path / "run", "train.steps=2"))
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text()
    with pytest.raises(ValueError, match="already holds a run .*the final adapter/"):
        train(config(base, tmp_path / "run", "train.steps=2"), overwrite=False)
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == metrics
    train(config(base, tmp_path / "run", "train.steps=3"), overwrite=True)
    assert max(r["step"] for r in records(tmp_path / "run") if "loss" in r) == 3


def test_resume_with_a_changed_rank_is_refused_before_anything_is_written(base, tmp_path):
    train(config(base, tmp_path / "run", "train.steps=4"), stop_after=2)
    saved = (tmp_path / "run" / "config.yaml").read_text()
    with pytest.raises(ValueError, match=r"differs from the run's config.yaml in lora.r \(lora.r: 4 -> 8\)"):
        train(config(base, tmp_path / "run", "train.steps=4", "lora.r=8", "resume=true"))
    assert (tmp_path / "run" / "config.yaml").read_text() == saved
    result = train(config(base, tmp_path / "run", "train.steps=4", "resume=true"))  # the same config resumes
    assert result.final_dir is not None


def test_resume_on_edited_data_is_refused(base, tmp_path, monkeypatch):
    """The same number of documents from edited files passed the sampler's checks and continued the batch order
    over other data; the mix's fingerprint (each source's cache key) now refuses it, and the original data resumes."""
    data = tmp_path / "train.jsonl"
    data.write_text(Path(base["data"]).read_text())
    args = ("train.steps=4", f"data.sources.0.path={data}")
    train(config(base, tmp_path / "run", *args), stop_after=2)
    original = data.read_text()
    first = json.loads(original.splitlines()[0])
    first["messages"][-1]["content"] += " edited"
    data.write_text(json.dumps(first) + "\n" + "".join(line + "\n" for line in original.splitlines()[1:]))
    with pytest.raises(ValueError, match="cannot resume: the training data differ from the checkpoint's"):
        train(config(base, tmp_path / "run", *args, "resume=true"))
    data.write_text(original)
    # a gapless that tokenizes otherwise (a cache version bump) says so, not that the files were edited
    monkeypatch.setattr(cache, "CACHE_VERSION", cache.CACHE_VERSION + 1)
    monkeypatch.setattr(batching, "CACHE_VERSION", cache.CACHE_VERSION)
    with pytest.raises(ValueError, match=rf"tokenized data as cache version {cache.CACHE_VERSION - 1}, this one as "
                                         rf"{cache.CACHE_VERSION} .*resume with that gapless version"):
        train(config(base, tmp_path / "run", *args, "resume=true"))
    monkeypatch.undo()
    assert train(config(base, tmp_path / "run", *args, "resume=true")).final_dir is not None


def test_every_checkpoint_corrupt_stops_the_resume_and_keeps_the_history(base, tmp_path):
    train(config(base, tmp_path / "run", "train.steps=6"), stop_after=4)
    for ck in (tmp_path / "run" / "checkpoints").glob("step-*"):
        (ck / "manifest.json").write_text("[]")
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text()
    with pytest.raises(ValueError, match=r"no checkpoint verifies \(step-00000002: manifest.json is a JSON list"):
        train(config(base, tmp_path / "run", "train.steps=6", "resume=true"))
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == metrics


def test_a_full_disk_at_the_final_write_names_the_checkpoint(base, tmp_path, monkeypatch, capsys):
    def disk_full(tensors, path, metadata=None):
        Path(path).write_bytes(b"\0" * 64)
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(lora, "save_file", disk_full)
    result = train(config(base, tmp_path / "run", "train.steps=4", "progress=true"))
    assert result.stopped == "final_write" and not (tmp_path / "run" / "adapter").exists()
    text = capsys.readouterr().err
    assert "adapter not written" in text and "No space left on device" in text and "step-00000004" in text
    assert [p.name for p in (tmp_path / "run").iterdir() if p.name.startswith(".")] == [".lock"]


# ---------------------------------------------------------------------------------------------
# kill -9 stress: PYTHONPATH=src python -m pytest -q -s -m slow tests/test_robust_loop.py


@pytest.mark.slow
def test_kill_9_at_random_moments_loses_nothing(base, tmp_path):
    """TRIALS runs, each killed (SIGKILL) once at a random moment (during steps or checkpoint writes: one every
    step), then resumed until it ends: every final adapter equals an uninterrupted run's, bit for bit, and every
    resume starts from the newest checkpoint that verifies. Each run is a forked child of this process (the imports
    done once: a fresh `gapless train` process costs ~10 s of start-up on this 2-core box, a fork milliseconds)."""
    trials = int(os.environ.get("GAPLESS_KILL_TRIALS", 20))
    steps = 10

    def run_in_child(name: str, resume: bool) -> int:
        pid = os.fork()
        if pid == 0:  # the child: one `train` call, then out without the parent's pytest teardown
            code = 1
            try:
                train(config(base, tmp_path / name, f"train.steps={steps}", "checkpoint.every=1",
                             "checkpoint.keep=3", f"resume={str(resume).lower()}"))
                code = 0
            finally:
                os._exit(code)
        return pid

    def wait(pid: int) -> int:
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

    torch.set_num_threads(1)  # the children inherit it: no OpenMP pool crossing the fork
    assert wait(run_in_child("reference", resume=False)) == 0
    want = load_file(tmp_path / "reference" / "adapter" / "adapter_model.safetensors")
    rng = random.Random(0)
    resumed_from, killed_mid_run, killed_in_write = [], 0, 0
    for t in range(trials):
        run = tmp_path / f"trial{t}"
        pid = run_in_child(run.name, resume=False)
        deadline = time.monotonic() + 120
        while logged_step(run) < 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.6))  # the rest of a 10-step run here: ~0.3-1 s
        os.kill(pid, signal.SIGKILL)
        code = wait(pid)
        killed_mid_run += code == -signal.SIGKILL
        killed_in_write += bool(list((run / "checkpoints").glob(".tmp-*")))
        newest_good = checkpoint.latest_complete(run / "checkpoints")
        before = checkpoint.resume_point(run / "checkpoints")
        assert before == newest_good
        assert wait(run_in_child(run.name, resume=True)) == 0, f"trial {t}: the resume failed"
        resumed_from.append(int(before.name.split("-")[1]) if before else 0)
        got = load_file(run / "adapter" / "adapter_model.safetensors")
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), f"trial {t}"
    print(f"kill -9 stress: {trials} trials, {killed_mid_run} killed mid-run ({killed_in_write} during a checkpoint "
          f"write), resumed from steps {resumed_from}; {trials} final adapters bit-identical to the uninterrupted run")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_fused_cuda_adamw_skips_a_nonfinite_step_on_the_device():
    """The CUDA path of step_unless_nonfinite: found_inf read by the fused kernel, no host sync, nothing updated."""
    p = torch.nn.Parameter(torch.ones(1024, device="cuda"))
    opt = torch.optim.AdamW([p], lr=0.1, fused=True)
    p.grad = torch.ones_like(p)
    guard.step_unless_nonfinite(opt, torch.tensor(1.0, device="cuda"))  # a good step
    after_good = p.detach().clone()
    moments = opt.state[p]["exp_avg"].clone()
    p.grad = torch.full_like(p, float("nan"))
    norm = torch.full((), float("nan"), device="cuda")  # made before the check: torch.tensor(x, device=) copies
    torch.cuda.set_sync_debug_mode("error")  # any host sync in the guarded step raises
    try:
        guard.step_unless_nonfinite(opt, norm)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(p.detach(), after_good) and torch.equal(opt.state[p]["exp_avg"], moments)
    assert int(opt.state[p]["step"]) == 1
