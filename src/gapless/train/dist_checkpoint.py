"""Checkpoints of a run of several processes, through torch.distributed.checkpoint (DCP).

A torchrun run (DDP or FSDP2, any world size) writes its checkpoints with DCP: every rank writes its own shards
(FSDP2) or rank 0's copy is deduplicated (DDP's replicated tensors), in the background (`dcp.async_save`, on a
gloo group of its own so its collectives never interleave with the training's), into `.tmp-step-XXXXXXXX`. When
every rank's write is done, rank 0 writes meta.json (step, scheduler, sampler, RNG) and the manifest last, with
every file's size and sha256, then renames the folder to `step-XXXXXXXX`: the same atomic layout as
gapless.train.checkpoint, so `latest_complete` and `check_checkpoint` verify both kinds.

The tensors are keyed by parameter name, the optimizer state too (torch.distributed.checkpoint.state_dict), and
DCP reshards on load: a checkpoint written by N ranks resumes on M ranks, under DDP or FSDP2, or in one process.
The sampler state is the global stream's position (gapless.data.sharding), so the data continues where it
stopped whatever the world size.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from gapless.config import CheckpointConfig
from gapless.train.checkpoint import (FORMAT_VERSION, MANIFEST, META, CheckpointManager, _fsync_dir, _sha256,
                                      _step_dirs, _write_bytes, step_dir_name)
from gapless.train.parallel import Dist

DCP_METADATA = ".metadata"  # DCP's own index of the shards, written by its coordinator (rank 0) last


def is_dcp(path: Path) -> bool:
    return (Path(path) / DCP_METADATA).is_file()


def checkpoint_manager(root: Path, cfg: CheckpointConfig, parallel: Dist, model, optimizer):
    """One process: gapless.train.checkpoint's manager. Several (torchrun): DCP."""
    if not parallel.active:
        return CheckpointManager(root, keep=cfg.keep, async_write=cfg.async_write)
    return DcpCheckpointManager(root, cfg.keep, cfg.async_write, parallel, model, optimizer)


class DcpCheckpointManager:
    """CheckpointManager's interface (save, wait, close, stall_seconds) on DCP; every rank calls it."""

    def __init__(self, root: Path, keep: int, async_write: bool, parallel: Dist, model, optimizer):
        self.root, self.keep, self.async_write, self.parallel = Path(root), keep, async_write, parallel
        self.model, self.optimizer = model, optimizer
        if parallel.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
        self.stall_seconds = self.last_stall_seconds = self.snapshot_seconds = 0.0
        # the checkpoint's collectives (planning, the final gather) on a group of their own: async_save runs them
        # in a background thread, while the training runs its collectives on the default group
        self.group = dist.new_group(backend="gloo")
        self._pending: Future | None = None
        self._finalise: Future | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gapless-dcp") if parallel.is_main \
            else None

    def save(self, step: int, tensors: dict[str, Any], meta: dict) -> None:
        """Write checkpoint `step`: tensors["model"] (the method's checkpoint state, by name) and the optimizer's
        state keyed by parameter name (in place of tensors["optimizer"], whose keys are indices, which do not
        reshard); every other group as given. Returns once the state is staged in host memory."""
        start = time.perf_counter()
        self._wait_pending()
        self.last_stall_seconds = time.perf_counter() - start
        self.stall_seconds += self.last_stall_seconds
        state = {**tensors, "optimizer": get_optimizer_state_dict(self.model, self.optimizer)}
        tmp = self.root / f".tmp-{step_dir_name(step)}"
        if self.parallel.is_main and tmp.exists():
            shutil.rmtree(tmp)
        dist.barrier(group=self.group)
        start = time.perf_counter()
        if self.async_write:
            self._pending = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.group)
        else:
            dcp.save(state, checkpoint_id=str(tmp), process_group=self.group)
        self.snapshot_seconds += time.perf_counter() - start
        if self.parallel.is_main:
            meta_bytes = json.dumps({**meta, "step": step}, indent=1).encode()
            self._finalise = self._executor.submit(self._publish, step, tmp, self._pending, meta_bytes)
        if not self.async_write:
            self._wait_pending()
            elapsed = time.perf_counter() - start
            self.last_stall_seconds += elapsed
            self.stall_seconds += elapsed

    def _publish(self, step: int, tmp: Path, pending: Future | None, meta_bytes: bytes) -> None:
        """Rank 0, once DCP's coordinator has every rank's write: meta.json, the manifest last, the rename."""
        if pending is not None:
            pending.result()
        files = {META: _write_bytes(meta_bytes, tmp / META)}
        for path in sorted(p for p in tmp.rglob("*") if p.is_file() and p.name not in (META, MANIFEST)):
            files[str(path.relative_to(tmp))] = {"size": path.stat().st_size, "sha256": _sha256(path)}
        manifest = {"format_version": FORMAT_VERSION, "step": step, "time": time.time(), "files": files,
                    "writer": "dcp", "world_size": self.parallel.world_size, "strategy": self.parallel.strategy}
        _write_bytes(json.dumps(manifest, indent=1).encode(), tmp / MANIFEST)
        _fsync_dir(tmp)
        final = self.root / step_dir_name(step)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(self.root)
        for _, path in [(s, p) for s, p in _step_dirs(self.root) if s <= step][:-self.keep]:
            shutil.rmtree(path)

    def _wait_pending(self) -> None:
        pending, self._pending = self._pending, None
        finalise, self._finalise = self._finalise, None
        if pending is not None:
            pending.result()  # this rank's shards are written (re-raises the writer's error)
        if finalise is not None:
            finalise.result()

    def wait(self) -> None:
        self._wait_pending()

    def close(self) -> None:
        try:
            self._wait_pending()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None


def load_sharded(path: Path, method, model, optimizer) -> dict:
    """Resume from the DCP checkpoint `path` (verified by the caller): the method's tensors loaded in place into
    this run's (sharded or whole) parameters, the optimizer state resharded; returns meta.json."""
    state = {"model": method.checkpoint_state(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())  # one process: no group
    with torch.no_grad():
        for name, p in method.checkpoint_state(model).items():
            if p is not state["model"][name]:  # DCP loaded into a copy (a non-contiguous or converted tensor)
                p.copy_(state["model"][name])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    return json.loads((Path(path) / META).read_text())
