import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from gapless.config import CheckpointConfig, OptimConfig, ScheduleConfig, from_dict
from gapless.train import checkpoint
from gapless.train.checkpoint import (CheckpointManager, capture_rng_state, latest_complete, load,
                                      restore_rng_state)
from gapless.train.optim import build_optimizer, build_scheduler, clip_grad_norm


def tiny_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.2), nn.LayerNorm(16), nn.Linear(16, 1))


def trained_state(steps: int = 3) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = tiny_model(0)
    opt = build_optimizer(model.parameters(), OptimConfig(weight_decay=0.1), "cpu")
    for _ in range(steps):
        model(torch.randn(4, 6)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def assert_same(a, b):
    """Equal nested structures: same container types (any dict for a state_dict's OrderedDict) and
    keys, bit-equal tensors."""
    assert type(a) is type(b) or isinstance(a, dict) and isinstance(b, dict), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def draw() -> tuple:
    return random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist(), torch.randn(2).tolist()


def test_rng_state_round_trip_through_json():
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    draw()
    state = json.loads(json.dumps(capture_rng_state()))
    expected = draw()
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    assert draw() != expected
    restore_rng_state(state)
    assert draw() == expected


def test_round_trip_model_optimizer_rng_meta(tmp_path):
    model, opt = trained_state()
    groups = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    meta = {"scheduler": {"last_epoch": 3}, "sampler": {"epoch": 0, "index": 12}, "rng": capture_rng_state()}
    with CheckpointManager(tmp_path, keep=2) as manager:
        manager.save(3, groups, meta)
    path = latest_complete(tmp_path)
    assert path == tmp_path / "step-00000003"
    tensors, loaded_meta = load(path)
    assert_same(tensors["model"], groups["model"])
    assert_same(tensors["optimizer"], groups["optimizer"])  # int state keys, tuples, None and floats survive
    assert loaded_meta == {**meta, "step": 3}
    assert set(tensors["optimizer"]["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    fresh = build_optimizer(tiny_model(1).parameters(), OptimConfig(weight_decay=0.1), "cpu")
    fresh.load_state_dict(tensors["optimizer"])
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format_version"] == checkpoint.FORMAT_VERSION and manifest["step"] == 3
    assert set(manifest["files"]) == {"model.pt", "optimizer.pt", "meta.json"}
    for name, info in manifest["files"].items():
        assert (path / name).stat().st_size == info["size"] and len(info["sha256"]) == 64


def _save(root, step, value=0.0, keep=10):
    with CheckpointManager(root, keep=keep) as manager:
        manager.save(step, {"model": {"w": torch.full((64,), float(value))}}, {})


def test_latest_complete_skips_unfinished_and_corrupt(tmp_path):
    _save(tmp_path, 1, value=1)
    _save(tmp_path, 2, value=2)
    _save(tmp_path, 3)
    _save(tmp_path, 4)
    _save(tmp_path, 5)
    # 6: a write killed before its rename (a save prunes such leftovers, so this comes after the saves)
    (tmp_path / ".tmp-step-00000006").mkdir()
    (tmp_path / ".tmp-step-00000006" / "model.pt").write_bytes((tmp_path / "step-00000005" / "model.pt").read_bytes())
    # 5: a folder whose manifest never got written
    (tmp_path / "step-00000005" / "manifest.json").unlink()
    # 4: a truncated tensor file
    with open(tmp_path / "step-00000004" / "model.pt", "r+b") as f:
        f.truncate(100)
    # 3: same size, one byte flipped
    data = bytearray((tmp_path / "step-00000003" / "model.pt").read_bytes())
    data[-30] ^= 0xFF
    (tmp_path / "step-00000003" / "model.pt").write_bytes(bytes(data))

    with pytest.warns(UserWarning) as record:
        assert latest_complete(tmp_path) == tmp_path / "step-00000002"
    messages = "\n".join(str(w.message) for w in record)
    assert ".tmp-step-00000006: an unfinished checkpoint write" in messages
    assert "step-00000005: manifest.json is missing" in messages
    assert "step-00000004: model.pt has 100 bytes" in messages
    assert "step-00000003: model.pt does not match its sha256" in messages
    assert "step-00000002" not in messages
    with pytest.raises(ValueError, match=r"step-00000003: model.pt does not match its sha256"):
        load(tmp_path / "step-00000003")
    with pytest.raises(ValueError, match=r"step-00000005: manifest.json is missing"):
        load(tmp_path / "step-00000005")
    assert load(tmp_path / "step-00000002")[0]["model"]["w"][0].item() == 2.0


KILLED_WRITER = """
import sys, time, torch
from gapless.train import checkpoint
root = sys.argv[1]
manager = checkpoint.CheckpointManager(root, keep=5)
manager.save(1, {"model": {"w": torch.ones(1000)}}, {})
manager.wait()
def stuck_write(obj, path):
    with open(path, "wb") as f:
        f.write(b"PK-half-a-zip")
        f.flush()
    print("writing", flush=True)
    time.sleep(600)
checkpoint._write_torch = stuck_write
manager.save(2, {"model": {"w": torch.zeros(1000)}}, {})
time.sleep(600)
"""


def test_a_checkpoint_whose_write_was_killed_is_skipped_on_resume(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    assert (tmp_path / ".tmp-step-00000002" / "model.pt").is_file()
    with pytest.warns(UserWarning, match="tmp-step-00000002: an unfinished checkpoint write"):
        path = latest_complete(tmp_path)
    assert path == tmp_path / "step-00000001"
    assert torch.equal(load(path)[0]["model"]["w"], torch.ones(1000))
    # the resumed run writes step 2 again; the leftover is cleared
    _save(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001", "step-00000002"]


def test_keep_last_k_and_replace_same_step(tmp_path):
    with CheckpointManager(tmp_path, keep=2) as manager:
        for step in range(1, 6):
            manager.save(step, {"model": {"w": torch.full((4,), float(step))}}, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004", "step-00000005"]
    (tmp_path / "step-00000005" / "manifest.json").unlink()  # corrupt; a resumed run saves step 5 again
    with CheckpointManager(tmp_path, keep=2) as manager:
        manager.save(5, {"model": {"w": torch.full((4,), 50.0)}}, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004", "step-00000005"]
    assert load(tmp_path / "step-00000005")[0]["model"]["w"][0].item() == 50.0


@pytest.fixture
def gated_writer(monkeypatch):
    """Make the background write of tensor files block until the test sets the returned event."""
    gate = threading.Event()
    started = threading.Event()
    real = checkpoint._write_torch

    def gated(obj, path):
        started.set()
        assert gate.wait(timeout=10), "test never opened the gate"
        return real(obj, path)

    monkeypatch.setattr(checkpoint, "_write_torch", gated)
    return gate, started


def test_save_returns_before_the_write_and_snapshots_the_tensors(tmp_path, gated_writer):
    gate, started = gated_writer
    model, opt = trained_state()
    expected_model = {k: v.clone() for k, v in model.state_dict().items()}
    expected_avg = opt.state_dict()["state"][0]["exp_avg"].clone()
    manager = CheckpointManager(tmp_path, keep=2)
    manager.save(3, {"model": model.state_dict(), "optimizer": opt.state_dict()}, {})
    assert started.wait(timeout=10)
    assert not (tmp_path / "step-00000003").exists()  # save returned, the write is still blocked
    # the loop goes on: an optimizer step mutates weights and state in place
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    opt.state[model[0].weight]["exp_avg"].mul_(0)
    gate.set()
    manager.wait()
    tensors, _ = load(tmp_path / "step-00000003")
    assert_same(tensors["model"], expected_model)
    assert torch.equal(tensors["optimizer"]["state"][0]["exp_avg"], expected_avg)
    manager.close()


def test_second_save_waits_and_records_the_stall(tmp_path, gated_writer):
    gate, started = gated_writer
    manager = CheckpointManager(tmp_path, keep=5)
    manager.save(1, {"model": {"w": torch.ones(4)}}, {})
    assert manager.stall_seconds < 0.05  # nothing in flight yet
    threading.Timer(0.3, gate.set).start()
    manager.save(2, {"model": {"w": torch.ones(4)}}, {})
    assert (tmp_path / "step-00000001" / "manifest.json").is_file()  # the first write finished first
    assert 0.25 < manager.last_stall_seconds < 5
    assert manager.stall_seconds >= manager.last_stall_seconds
    manager.close()
    assert latest_complete(tmp_path) == tmp_path / "step-00000002"


def test_synchronous_write(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path, keep=2, async_write=False)
    manager.save(1, {"model": {"w": torch.ones(4)}}, {"note": "x"})
    assert (tmp_path / "step-00000001" / "manifest.json").is_file()  # on disk when save returns
    assert manager.stall_seconds > 0  # the loop waited for the disk
    monkeypatch.setattr(checkpoint, "_write_torch", lambda obj, path: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        manager.save(2, {"model": {"w": torch.ones(4)}}, {})
    manager.close()


def test_a_failing_write_warns_once_keeps_the_previous_checkpoint_and_the_next_one_retries(tmp_path, monkeypatch):
    real = checkpoint._write_torch
    with CheckpointManager(tmp_path, keep=2) as manager:
        manager.save(1, {"model": {"w": torch.ones(4)}}, {})
        manager.wait()

        def disk_full(obj, path):  # half a file written, then the disk is full
            path.write_bytes(b"x" * 100)
            raise OSError(28, "No space left on device", str(path))

        monkeypatch.setattr(checkpoint, "_write_torch", disk_full)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            manager.save(2, {"model": {"w": torch.ones(4)}}, {})
            manager.wait()  # no exception: the run goes on
        messages = [str(w.message) for w in caught]
        assert len(messages) == 1 and "step 2 not written" in messages[0] and "No space left" in messages[0] \
            and "step-00000001 is intact" in messages[0], messages
        assert manager.failed_writes == 1
        assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001"]  # no half-written folder
        monkeypatch.setattr(checkpoint, "_write_torch", real)
        manager.save(3, {"model": {"w": torch.full((4,), 3.0)}}, {})
    assert latest_complete(tmp_path) == tmp_path / "step-00000003"


def test_a_bug_in_the_writer_still_surfaces_at_the_next_call(tmp_path, monkeypatch):
    def bug(obj, path):
        raise TypeError("not an I/O error")

    manager = CheckpointManager(tmp_path, keep=2)
    monkeypatch.setattr(checkpoint, "_write_torch", bug)
    manager.save(1, {"model": {"w": torch.ones(4)}}, {})
    with pytest.raises(TypeError, match="not an I/O error"):
        manager.close()
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (needs root: skipped elsewhere)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root)")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_keeps_the_previous_checkpoint(small_disk):
    """A real ENOSPC: the first checkpoint (~400 KB) fits, the second does not."""
    with CheckpointManager(small_disk / "ckpt", keep=2) as manager:
        manager.save(1, {"model": {"w": torch.ones(100_000)}}, {})
        manager.wait()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            manager.save(2, {"model": {"w": torch.ones(200_000)}}, {})
            manager.wait()
    assert manager.failed_writes == 1 and "No space left on device" in str(caught[0].message)
    assert sorted(p.name for p in (small_disk / "ckpt").iterdir()) == ["step-00000001"]
    tensors, _ = load(latest_complete(small_disk / "ckpt"))
    assert torch.equal(tensors["model"]["w"], torch.ones(100_000))


def flip_first(path, old: bytes, new: bytes) -> None:
    data = path.read_bytes()
    assert old in data, (old, data[:200])
    path.write_bytes(data.replace(old, new, 1))


# Damage to the newest checkpoint's manifest: each must be detected, named, and the previous checkpoint used.
MANIFEST_DAMAGE = {
    "missing": (lambda m: m.unlink(), "manifest.json is missing"),
    "not_json": (lambda m: m.write_text("{not json"), "not valid JSON"),
    "empty_list": (lambda m: m.write_text("[]"), "is a JSON list, not an object"),
    "no_files": (lambda m: m.write_text(json.dumps({k: v for k, v in json.loads(m.read_text()).items()
                                                    if k != "files"})), "does not list the checkpoint's files"),
    "flipped_key": (lambda m: flip_first(m, b'"files"', b'"filez"'), "does not list the checkpoint's files"),
    "flipped_size": (lambda m: flip_first(m, b'"size": ', b'"size": 9'), "bytes, the manifest says"),
    "flipped_sha": (lambda m: m.write_text(m.read_text().replace('"sha256": "', '"sha256": "0', 1)), "sha256"),
    "flipped_step": (lambda m: flip_first(m, b'"step": 4', b'"step": 5'), "says step 5, the folder is"),
    "size_a_string": (lambda m: flip_first(m, b'"size": ', b'"size": "1"'), "not valid JSON|no size and sha256"),
    "path_outside": (lambda m: m.write_text(m.read_text().replace('"meta.json"', '"../meta.json"')),
                     "not a file of the checkpoint folder|does not list"),
    "version": (lambda m: flip_first(m, b'"format_version": 1', b'"format_version": 7'), "format_version 7"),
    "truncated": (lambda m: m.write_bytes(m.read_bytes()[:40]), "not valid JSON"),
    "binary": (lambda m: m.write_bytes(b"\xff\xfe\x00garbage"), "not valid JSON"),
}
FILE_DAMAGE = {
    "truncated_pt": (lambda d: (d / "model.pt").write_bytes((d / "model.pt").read_bytes()[:50]), "model.pt has 50 bytes"),
    "flipped_byte_pt": (lambda d: flip_byte(d / "optimizer.pt"), "optimizer.pt does not match its sha256"),
    "missing_meta": (lambda d: (d / "meta.json").unlink(), "meta.json is missing"),
    "flipped_meta": (lambda d: flip_byte(d / "meta.json"), "meta.json does not match"),
}


def flip_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def two_checkpoints(root):
    with CheckpointManager(root, keep=3) as manager:
        for step in (2, 4):
            manager.save(step, {"model": {"w": torch.full((8,), float(step))}, "optimizer": {"m": torch.ones(3)}},
                         {"sampler": step})
    return root / "step-00000002", root / "step-00000004"


@pytest.mark.parametrize("damage", sorted(MANIFEST_DAMAGE) + sorted(FILE_DAMAGE))
def test_a_damaged_checkpoint_is_named_and_the_previous_one_used(tmp_path, damage):
    older, newer = two_checkpoints(tmp_path)
    if damage in MANIFEST_DAMAGE:
        hurt, says = MANIFEST_DAMAGE[damage]
        hurt(newer / "manifest.json")
    else:
        hurt, says = FILE_DAMAGE[damage]
        hurt(newer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert checkpoint.resume_point(tmp_path) == older
    message = " ".join(str(w.message) for w in caught)
    assert "step-00000004" in message and re.search(says, message), message
    tensors, meta = load(older)
    assert meta["step"] == 2 and torch.equal(tensors["model"]["w"], torch.full((8,), 2.0))
    with pytest.raises(ValueError, match="step-00000004"):
        load(newer)


def test_no_usable_checkpoint_stops_the_resume_naming_each(tmp_path):
    older, newer = two_checkpoints(tmp_path)
    (older / "manifest.json").write_text("[]")
    flip_byte(newer / "model.pt")
    with pytest.raises(ValueError, match=r"no checkpoint verifies \(step-00000002: manifest.json is a JSON list.*"
                                         r"step-00000004: model.pt does not match"):
        checkpoint.resume_point(tmp_path)
    assert checkpoint.resume_point(tmp_path / "none") is None  # no checkpoints at all: a fresh start is honest
    (tmp_path / "empty").mkdir()
    assert checkpoint.resume_point(tmp_path / "empty") is None


def test_unsupported_values_are_refused_before_the_write(tmp_path):
    with CheckpointManager(tmp_path, keep=2) as manager:
        with pytest.raises(ValueError, match="optimizer/extra: a object cannot be saved"):
            manager.save(1, {"optimizer": {"extra": object()}}, {})
        with pytest.raises(TypeError):  # meta must be JSON-able
            manager.save(1, {"model": {}}, {"bad": object()})
    assert list(tmp_path.iterdir()) == []


def test_latest_complete_on_a_missing_or_empty_folder(tmp_path):
    assert latest_complete(tmp_path / "nothing") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert latest_complete(tmp_path) is None


def run_steps(model, opt, sched, steps):
    """A miniature of the loop: data and dropout both draw from the global RNGs."""
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 6)
        noise = float(np.random.rand()) + random.random()
        loss = (model(x).squeeze(-1) - noise).square().mean()
        loss.backward()
        clip_grad_norm(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_resume_equals_an_uninterrupted_run(tmp_path):
    def build(seed):
        model = tiny_model(seed)
        opt = build_optimizer(model.parameters(), OptimConfig(weight_decay=0.1), "cpu")
        return model, opt, build_scheduler(opt, ScheduleConfig(warmup_steps=2, min_lr_ratio=0.1), 8)

    random.seed(0), np.random.seed(0)
    model, opt, sched = build(0)
    uninterrupted = run_steps(model, opt, sched, 8)

    random.seed(0), np.random.seed(0)
    model, opt, sched = build(0)
    first = run_steps(model, opt, sched, 4)
    with CheckpointManager(tmp_path, keep=1) as manager:
        manager.save(4, {"model": model.state_dict(), "optimizer": opt.state_dict()},
                     {"scheduler": sched.state_dict(), "rng": capture_rng_state()})
        run_steps(model, opt, sched, 1)  # the crashed run went on a little; none of it may leak in

    random.seed(5), np.random.seed(5)
    model, opt, sched = build(1)  # a fresh process: other weights, other RNG
    tensors, meta = load(latest_complete(tmp_path))
    model.load_state_dict(tensors["model"])
    opt.load_state_dict(tensors["optimizer"])
    sched.load_state_dict(meta["scheduler"])
    restore_rng_state(meta["rng"])
    assert meta["step"] == 4
    assert first + run_steps(model, opt, sched, 4) == uninterrupted  # step for step, bit for bit


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_snapshot_is_taken_before_later_kernels(tmp_path):
    w = torch.randn(4096, 1024, device="cuda")
    expected = w.cpu()
    with CheckpointManager(tmp_path, keep=1) as manager:
        manager.save(1, {"model": {"w": w}}, {"rng": capture_rng_state()})
        for _ in range(20):  # queued on the same stream right after the non-blocking copy
            w.mul_(2.0).add_(1.0)
    assert torch.equal(load(tmp_path / "step-00000001")[0]["model"]["w"], expected)


def test_checkpoint_config_validation():
    assert from_dict(CheckpointConfig, {"every": 100, "keep": 3}, "checkpoint").async_write is True
    with pytest.raises(ValueError, match="checkpoint.keep: must be >= 1"):
        from_dict(CheckpointConfig, {"keep": 0}, "checkpoint")
    with pytest.raises(ValueError, match="checkpoint.every: must be auto or an integer >= 0"):
        from_dict(CheckpointConfig, {"every": -5}, "checkpoint")
    with pytest.raises(ValueError, match=re.escape("checkpoint.every: 'sometimes' matches none of int | 'auto'")):
        from_dict(CheckpointConfig, {"every": "sometimes"}, "checkpoint")
    assert CheckpointConfig().every == from_dict(CheckpointConfig, {"every": "auto"}, "checkpoint").every == "auto"
