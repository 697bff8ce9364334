"""Atomic, asynchronous checkpoints with a manifest of checksums, and resume from the newest good one.

On disk, under `root_dir`:

    step-00000200/            one complete checkpoint
      model.pt                one file per tensor group, torch.save of a nested dict/list structure
      optimizer.pt              of tensors, numbers and strings; read back with weights_only=True
      meta.json               the caller's JSON meta (step, scheduler, sampler, RNG, config hash ...)
      manifest.json           written last: format version, step, time, and every file's size + sha256
    .tmp-step-00000300/       a write in progress, or one that was killed: never read

A checkpoint is written into `.tmp-step-XXXXXXXX`, each file fsynced, the manifest written last,
and only then renamed to `step-XXXXXXXX` (rename is atomic on POSIX file systems). A crash at any
point leaves either a `.tmp-*` folder or a complete folder, and a folder whose files no longer
match the manifest (truncated, bit rot) fails its checksums: `latest_complete` skips all of these
with a warning and returns the newest checkpoint that verifies. `resume_point` is what a resume
calls: the same, but when checkpoints exist and none verifies it raises, naming each folder's
problem, so a run never silently starts over.

A write that fails (a full disk, an I/O error) removes its `.tmp-*` folder, leaves every earlier
checkpoint as it was, warns once in one line and counts itself in `failed_writes`; the run goes on
and the next checkpoint tries again.

One writer per `root_dir`: in a multi-process run only rank 0 saves. RNG states are per process;
`capture_rng_state` only captures the calling process's.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import re
import shutil
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from torch import Tensor

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
META = "meta.json"
_STEP_DIR = re.compile(r"step-(\d{8})")
_TMP_PREFIX = ".tmp-"


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


# ---------------------------------------------------------------------------------------------
# RNG state, as JSON-able values so it travels in meta.json


def capture_rng_state() -> dict:
    """Python `random`, numpy's global generator, torch CPU and every CUDA device, as JSON-able values."""
    version, mt, gauss = random.getstate()
    key, pos, has_gauss, cached = _np_state()
    state = {
        "python": [version, list(mt), gauss],
        "numpy": {"key": key.tolist(), "pos": pos, "has_gauss": has_gauss, "cached_gaussian": cached},
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: dict) -> None:
    """Set every generator `capture_rng_state` captured back to that state."""
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    np_state = state["numpy"]
    np.random.set_state(("MT19937", np.array(np_state["key"], dtype=np.uint32), np_state["pos"],
                         np_state["has_gauss"], np_state["cached_gaussian"]))
    torch.set_rng_state(_unb64(state["torch"]))
    saved = state.get("cuda", [])
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if len(saved) != have:
        warnings.warn(f"the checkpoint has RNG states for {len(saved)} CUDA devices, this machine has {have}; "
                      f"restoring the first {min(len(saved), have)}, so dropout may not match an "
                      "uninterrupted run", stacklevel=2)
    for i in range(min(len(saved), have)):
        torch.cuda.set_rng_state(_unb64(saved[i]), i)


def _np_state() -> tuple[np.ndarray, int, int, float]:
    name, key, pos, has_gauss, cached = np.random.get_state()
    assert name == "MT19937", name
    return key, int(pos), int(has_gauss), float(cached)


def _b64(t: Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


# ---------------------------------------------------------------------------------------------
# writing


@dataclass
class _Job:
    step: int
    groups: dict[str, Any]          # the host snapshot: same structure, every tensor a CPU copy
    meta: bytes                     # meta.json, serialized in save() so later mutation can't leak in
    events: list = field(default_factory=list)          # CUDA events recorded after the D2H copies
    sources: list[Tensor] = field(default_factory=list)  # device tensors being read, kept alive until then


class CheckpointManager:
    """Writes checkpoints under `root_dir`, keeping the newest `keep`, in a background thread.

    How the snapshot is made consistent: `save` copies every tensor into host memory before it
    returns. A CPU tensor is copied synchronously. A CUDA tensor is copied with `non_blocking=True`
    into a pinned host buffer; the copy is enqueued on the current stream of the tensor's device
    before `save` returns, so any kernel the loop enqueues afterwards on that stream (the next
    backward, the optimizer step) runs after the copy has read the values: one CUDA stream executes
    in order. The writer thread waits on an event recorded after the copies before it reads the
    buffers, and holds references to the source tensors until then so the caching allocator cannot
    reuse their memory. (Only work on the *current* stream is ordered after the copies: code that
    updates checkpointed tensors on another stream must first make it wait on the current one.)

    At most one write is in flight; the pinned buffers (as large as the saved CUDA tensors) are
    kept from one save to the next, which is safe because a save first waits for the previous
    write to finish, and freed by `close`. The time `save` spends waiting for that is the
    *checkpoint stall*: `stall_seconds` (total) and `last_stall_seconds` (this save's); with
    `async_write=False` the whole write counts as stall. `snapshot_seconds` is the total host time
    spent issuing the copies. An exception in the writer is re-raised by the next `save`, `wait`
    or `close`.
    """

    def __init__(self, root_dir: str | Path, keep: int, async_write: bool = True):
        assert keep >= 1, keep
        self.root = Path(root_dir)
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self.async_write = async_write
        self.stall_seconds = 0.0
        self.last_stall_seconds = 0.0
        self.snapshot_seconds = 0.0
        self.failed_writes = 0  # writes that failed with an OSError (full disk, I/O error), each warned once
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gapless-checkpoint") \
            if async_write else None
        self._pending: Future | None = None
        self._buffers: dict[tuple, Tensor] = {}

    def save(self, step: int, tensors: dict[str, Any], meta: dict) -> None:
        """Snapshot `tensors` (group name -> nested dict/list of tensors and plain values, e.g.
        {"model": trainable state_dict, "optimizer": optimizer.state_dict()}) and `meta` (JSON-able),
        then write them as checkpoint `step`. Returns once the snapshot is taken (see the class doc)."""
        for name in tensors:
            assert re.fullmatch(r"[A-Za-z0-9_-]+", name), f"group name {name!r} must be usable as a file name"
        assert meta.get("step", step) == step, (meta.get("step"), step)
        meta_bytes = json.dumps({**meta, "step": step}, indent=1).encode()

        start = time.perf_counter()
        self._wait_pending()  # at most one write in flight, and the buffers are free again
        self.last_stall_seconds = time.perf_counter() - start
        self.stall_seconds += self.last_stall_seconds

        start = time.perf_counter()
        job = _Job(step, {}, meta_bytes)
        with torch.no_grad():
            job.groups = {name: self._snapshot(obj, (name,), job) for name, obj in tensors.items()}
        for device in {t.device for t in job.sources}:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            job.events.append(event)
        self.snapshot_seconds += time.perf_counter() - start

        if self._executor is None:
            start = time.perf_counter()
            self._write(job)
            elapsed = time.perf_counter() - start
            self.last_stall_seconds += elapsed
            self.stall_seconds += elapsed
        else:
            self._pending = self._executor.submit(self._write, job)

    def wait(self) -> None:
        """Block until the write in flight, if any, is on disk; re-raise its exception."""
        self._wait_pending()

    def close(self) -> None:
        """Finish the write in flight (re-raising its exception), stop the thread, free the buffers."""
        try:
            self._wait_pending()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            self._buffers.clear()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wait_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()  # re-raises the writer's exception here, in the training thread

    def _snapshot(self, obj: Any, key: tuple, job: _Job) -> Any:
        if isinstance(obj, Tensor):
            if not obj.is_cuda:  # a synchronous copy with its own storage (saving a view would save its base)
                return obj.detach().to("cpu", copy=True)
            # pinned buffers are slow to allocate (cudaHostAlloc), so they are kept from save to save
            buf = self._buffers.get(key)
            if buf is None or buf.shape != obj.shape or buf.dtype != obj.dtype:
                buf = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=True)
                self._buffers[key] = buf
            buf.copy_(obj, non_blocking=True)
            job.sources.append(obj)
            return buf
        if isinstance(obj, dict):
            return {k: self._snapshot(v, (*key, k), job) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._snapshot(v, (*key, i), job) for i, v in enumerate(obj))
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        raise ValueError(f"checkpoint group {'/'.join(map(str, key))}: a {type(obj).__name__} cannot be saved; "
                         "only tensors, numbers, strings, None, lists, tuples and dicts load back with "
                         "weights_only=True")

    def _write(self, job: _Job) -> None:
        for event in job.events:
            event.synchronize()  # the D2H copies into the pinned buffers are complete
        job.sources.clear()
        name = step_dir_name(job.step)
        tmp = self.root / f"{_TMP_PREFIX}{name}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        final = self.root / name
        trash = self.root / f".trash-{name}"
        try:
            files = {f"{group}.pt": _write_torch(obj, tmp / f"{group}.pt") for group, obj in job.groups.items()}
            files[META] = _write_bytes(job.meta, tmp / META)
            manifest = {"format_version": FORMAT_VERSION, "step": job.step, "time": time.time(), "files": files}
            _write_bytes(json.dumps(manifest, indent=1).encode(), tmp / MANIFEST)
            _fsync_dir(tmp)
            if final.exists():  # this step was saved before (e.g. a corrupt one a resume skipped)
                os.rename(final, trash)
            os.rename(tmp, final)
            _fsync_dir(self.root)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if trash.exists() and not final.exists():
                os.rename(trash, final)
            io_error = _io_error(e)
            if io_error is None:
                raise
            e = io_error
            self.failed_writes += 1
            previous = [p.name for _, p in _step_dirs(self.root)]
            warnings.warn(f"checkpoint step {job.step} not written to {self.root}: {e.strerror or e} "
                          f"({type(e).__name__}); "
                          + (f"{previous[-1]} is intact" if previous else "there is no earlier checkpoint")
                          + "; the next checkpoint tries again", stacklevel=2)
            return
        shutil.rmtree(trash, ignore_errors=True)
        self._prune(job.step)

    def _prune(self, newest: int) -> None:
        """Keep the `keep` newest checkpoints up to `newest`; remove leftovers of killed writes
        (`.tmp-*`, and `.trash-*` from a kill between the two renames of a replaced step).
        Folders of later steps (a run resumed from before them) are left to be replaced."""
        steps = [(s, p) for s, p in _step_dirs(self.root) if s <= newest]
        for _, path in steps[:-self.keep]:
            shutil.rmtree(path)
        for path in [*self.root.glob(f"{_TMP_PREFIX}*"), *self.root.glob(".trash-*")]:
            shutil.rmtree(path, ignore_errors=True)


def _io_error(e: BaseException) -> OSError | None:
    """The OSError behind `e`, if any: torch.save reports a full disk as a RuntimeError ("unexpected pos")
    raised while handling the OSError of the failed write."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, OSError):
            return e
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


class _HashingWriter:
    """A write-only file object that hashes and counts what passes through it."""

    def __init__(self, f: BinaryIO):
        self.f = f
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self.size += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def _write_torch(obj: Any, path: Path) -> dict:
    with open(path, "wb") as f:
        writer = _HashingWriter(f)
        torch.save(obj, writer)
        f.flush()
        os.fsync(f.fileno())
    return {"size": writer.size, "sha256": writer.sha256.hexdigest()}


def _write_bytes(data: bytes, path: Path) -> dict:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _fsync_dir(path: Path) -> None:
    """Make the folder's entries (new files, a rename) durable, not only the files' contents."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# reading


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every `step-XXXXXXXX` folder under root, oldest first."""
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.fullmatch(p.name))]
    return sorted(found)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def check_checkpoint(path: str | Path) -> str | None:
    """What is wrong with checkpoint folder `path`, or None when its manifest and every file verify."""
    path = Path(path)
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        return f"{MANIFEST} is missing (the write did not finish)"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (ValueError, UnicodeDecodeError):
        return f"{MANIFEST} is not valid JSON"
    problem = _manifest_problem(manifest, path)
    if problem is not None:
        return f"{MANIFEST} {problem}"
    for name, info in manifest["files"].items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        size = file.stat().st_size
        if size != info["size"]:
            return f"{name} has {size} bytes, the manifest says {info['size']} (truncated?)"
        if _sha256(file) != info["sha256"]:
            return f"{name} does not match its sha256 in the manifest (corrupt)"
    return None


def _manifest_problem(manifest: Any, path: Path) -> str | None:
    """What is wrong with the shape of a parsed manifest (a flipped character can leave valid JSON), or None."""
    if not isinstance(manifest, dict):
        return f"is a JSON {type(manifest).__name__}, not an object"
    if manifest.get("format_version") != FORMAT_VERSION:
        return f"has format_version {manifest.get('format_version')!r}, this gapless reads {FORMAT_VERSION}"
    m = _STEP_DIR.fullmatch(path.name)
    if m and manifest.get("step") != int(m.group(1)):
        return f"says step {manifest.get('step')!r}, the folder is {path.name}"
    files = manifest.get("files")
    # a torchrun run's checkpoint (gapless.train.dist_checkpoint) holds DCP's .distcp shards and .metadata instead
    tensors = (".distcp", ".metadata") if manifest.get("writer") == "dcp" else (".pt",)
    if not isinstance(files, dict) or META not in files or not any(n.endswith(tensors) for n in files):
        return f"does not list the checkpoint's files ({META} and the tensor files)"
    for name, info in files.items():
        # no separators and no "..": a name cannot leave the folder (DCP's own ".metadata" is a plain file name)
        if "/" in name or "\\" in name or name in (".", "..") or name == MANIFEST:
            return f"lists {name!r}, which is not a file of the checkpoint folder"
        if not (isinstance(info, dict) and type(info.get("size")) is int and isinstance(info.get("sha256"), str)):
            return f"has no size and sha256 for {name}"
    return None


def latest_complete(root_dir: str | Path) -> Path | None:
    """The newest checkpoint under `root_dir` that verifies, or None. Unfinished (`.tmp-*`) and
    corrupt folders are skipped with a warning naming the folder and the problem."""
    root = Path(root_dir)
    if not root.is_dir():
        return None
    for tmp in sorted(root.glob(f"{_TMP_PREFIX}*")):
        warnings.warn(f"{tmp}: an unfinished checkpoint write (killed or failed mid-way); skipped", stacklevel=2)
    for _, path in reversed(_step_dirs(root)):
        problem = check_checkpoint(path)
        if problem is None:
            return path
        warnings.warn(f"{path}: {problem}; skipped, trying an older checkpoint", stacklevel=2)
    return None


def resume_point(root_dir: str | Path) -> Path | None:
    """The newest checkpoint under `root_dir` that verifies; None when there is no checkpoint at all. When there
    are checkpoints and none verifies, a ValueError names each one and its problem: a resume must stop there,
    never start over from step 0 (and overwrite the run's history)."""
    root = Path(root_dir)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        latest = latest_complete(root)
    for w in caught:  # the skipped ones, re-warned from here
        warnings.warn(str(w.message), stacklevel=2)
    found = _step_dirs(root) if root.is_dir() else []
    if latest is None and found:
        problems = "; ".join(f"{p.name}: {check_checkpoint(p)}" for _, p in found)
        raise ValueError(f"{root}: no checkpoint verifies ({problems}); nothing to resume from. Restore a good "
                         "checkpoint, or start a new run without --resume (with another output_dir, or "
                         "--overwrite to replace this run)")
    return latest


def load(path: str | Path) -> tuple[dict[str, Any], dict]:
    """Verify checkpoint folder `path` and read it: (tensor groups on the CPU, meta). A folder that
    does not verify is a ValueError naming the file at fault."""
    path = Path(path)
    problem = check_checkpoint(path)
    if problem is not None:
        raise ValueError(f"checkpoint {path}: {problem}; resume from another one (see latest_complete)")
    manifest = json.loads((path / MANIFEST).read_text())
    tensors = {name.removesuffix(".pt"): torch.load(path / name, map_location="cpu", weights_only=True)
               for name in manifest["files"] if name.endswith(".pt")}
    meta = json.loads((path / META).read_text())
    return tensors, meta
