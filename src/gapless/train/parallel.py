"""Several processes, on torch.distributed only: the process group from torchrun's environment, and the model spread
over the ranks as a transform in gapless.train.assemble's order (build on meta -> method -> checkpointing -> compile
-> shard -> load -> initialise).

Strategies (config `parallel.strategy`):
  ddp    every rank holds the whole model; only the trainable gradients are all-reduced, in buckets of
         `parallel.bucket_mb` that start while backward still runs (torch's DistributedDataParallel, through its
         composable form `replicate`, as torchtitan applies DDP: the model keeps its class and HF parameter names,
         so checkpoints, export and the meter need no `module.` prefix). DDP broadcasts rank 0's parameters when
         it wraps, so it needs materialised ones: it is applied after load_weights and the method's initialise.
  fsdp   FSDP2 (`torch.distributed.fsdp.fully_shard`) on every decoder layer, then on the root (embedding, final
         norm, LM head): parameters, gradients and optimizer state sharded over the ranks, the frozen base too. It
         shards the model on the meta device, so no rank ever holds the whole model: the checkpoint's tensors
         stream through a load hook that keeps each rank's shard. Mixed precision (MixedPrecisionPolicy): the
         parameters are all-gathered in the model's dtype (`model.dtype`; LoRA's float32 A and B are cast to it,
         as LoRA's matmuls run in the activations' dtype anyway) and gradients are reduce-scattered in float32
         (a sum over 8 bf16 gradients would round each partial sum to 8 bits of mantissa).
  auto   fsdp for a method that trains the whole model, ddp for LoRA.

Gradients: DDP and FSDP2 both AVERAGE gradients over the ranks. One process divides the loss sum of a step by its
trained tokens N (gapless.train.step); with W ranks each rank divides its own loss sum by N / W, where N is the
trained tokens of the whole global step, counted on the host from the global plan (gapless.data.sharding): the
average over ranks of sum_rank(loss) * W / N is sum_all(loss) / N, the 1-process gradient. No collective counts N.

The meter, per rank and aggregated (`aggregate`, at log points only; nothing here adds a host sync to a step):
  tail_r     DDP, each optimizer step on rank r: from the moment its last gradient bucket is ready (the end of the
             rank's own backward compute for the gradients DDP reduces) to the moment the last bucket's all-reduce
             is done (the gradients are ready for the optimizer). `CommClock`, a comm hook that wraps torch's
             default all-reduce hook (same result), takes both marks: host clock readings on the CPU (gloo runs
             the all-reduce in its own threads), CUDA events on the GPU (the ready mark on the backward's stream,
             the done marks in the future's callbacks, whose streams wait for NCCL's kernels), read after the log
             point's settle.
  exposed    per step, min over ranks of tail_r: the all-reduce ends at one moment on every rank, so the rank whose
             backward finished last waited for no one, and its tail is communication that compute did not hide.
             comm_exposed_s is its sum over the window's steps.
  waiting    rank r waited for slower ranks for tail_r - exposed in each step (their backward still ran), plus its
             wait in the log point's barrier; collective_wait_s_max/mean are the max and mean over ranks.
  overlapped comm_total_s - comm_exposed_s (floored at 0), comm_total_s being the window's steps times what the
             step's traffic takes alone (`probe_allreduce`: Dist.comm_bytes at the bandwidth measured at the log
             point): the communication that ran while compute went on.
  slowest    the rank that waited the least over the window (every other rank waited for it), and its own compute
             (its compute seconds minus its tails). Under FSDP2 its waiting is the barrier's alone: the rank last at
             the log point.
FSDP2 all-gathers and reduce-scatters inside its own hooks, interleaved with compute, with no hook to time them:
there comm_exposed_s and comm_overlapped_s are null and `comm_measured` says so; the waiting counts the barrier only.
Tested with gloo on the CPU (tests/test_dist_comm.py). On a GPU: a standalone copy of this hook (NCCL, one H100,
world size 1, DDP over 8 Linear layers in 8 buckets: every step closed, tails of ~10 us), and the loop's CUDA path
through `pytest -m gpu tests/test_dist.py` (a real `gapless train` under torchrun on NCCL at world size 1, DDP and
FSDP2: 2 passed, bench/RESULTS.md seventh round). Several GPUs have not run it yet.

Failures: torchrun's agent ends every rank when one exits with an error (and `gapless.cli` is wrapped in its
`record`, so the failing rank's traceback is what torchrun reports); a rank stuck in a collective fails after
`parallel.timeout_s` (the process group's timeout), never hangs for ever.
"""
from __future__ import annotations

import contextlib
import copy
import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from gapless.config import ParallelConfig
from gapless.train.runlock import launched_by_torchrun

# methods whose every parameter trains: `auto` shards them (their optimizer state alone is 12 bytes a parameter)
FULL_METHODS = ("full",)


@dataclass
class Dist:
    """This process's place in the run. world_size 1 without a process group is a plain single-process run."""
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    strategy: str = "none"  # none | ddp | fsdp, resolved
    cfg: ParallelConfig | None = None
    # FSDP2: the model as built and transformed, before sharding, on the meta device (no memory): what the final
    # save assigns the gathered parameters to (full_parameters)
    skeleton: nn.Module | None = None
    # bytes of one step's gradient and parameter traffic, as the size of the one all-reduce that moves as much
    # (ring algorithms: an all-reduce of X moves 2(W-1)/W X per rank, an all-gather or reduce-scatter (W-1)/W X).
    # DDP: the trainable gradients. FSDP2: two all-gathers of the parameters (forward, and backward after the
    # forward resharded) and a float32 reduce-scatter of the trainable gradients: (2 params + grads) / 2
    comm_bytes: int = 0
    comm_clock: CommClock | None = None  # DDP: the all-reduce tail of each step (module docstring); None otherwise

    @property
    def active(self) -> bool:
        """A process group exists (torchrun launched the run), even at world size 1."""
        return self.strategy != "none"

    @property
    def is_main(self) -> bool:
        """Rank 0 alone logs, writes metrics.jsonl, config.yaml, the report and the final save."""
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        return self.strategy == "fsdp"

    def per_rank(self, name: str) -> str:
        """A file each rank writes for itself (its GPU's monitor): rank 0's keeps `name`, the report's input;
        rank r writes `name` with `.rank{r}` before the suffix (gpu.rank3.jsonl)."""
        if self.rank == 0:
            return name
        stem, dot, suffix = name.rpartition(".")
        return f"{stem}.rank{self.rank}{dot}{suffix}"

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    def close(self) -> None:
        if self.active and dist.is_initialized():
            dist.destroy_process_group()


def init_distributed(cfg: ParallelConfig, device: torch.device, method_name: str) -> tuple[Dist, torch.device]:
    """The process group when torchrun launched this process (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT in
    the environment): NCCL on CUDA, gloo on the CPU; each rank on GPU LOCAL_RANK. Returns (Dist, this rank's
    device). Without torchrun: Dist() and `device` unchanged."""
    if not launched_by_torchrun():
        return Dist(), device
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    if device.type == "cuda":
        if local >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK {local}: this machine has {torch.cuda.device_count()} GPUs; start at most "
                             f"that many processes per node (torchrun --nproc-per-node)")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    strategy = cfg.strategy if cfg.strategy != "auto" else ("fsdp" if method_name in FULL_METHODS else "ddp")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=cfg.timeout_s),
                                **({"device_id": device} if device.type == "cuda" else {}))
    return Dist(rank, world, local, strategy, cfg), device


# ---------------------------------------------------------------------------------------------
# the model transform


class Placement:
    """How the model's tensors land when there is no process group: the method's own hook and initialise."""

    def __init__(self, method, device: torch.device):
        self.method, self.device = method, device

    @property
    def load_hook(self):
        return self.method.load_hook

    def initialise(self, model: nn.Module) -> nn.Module:
        return self.method.initialise(model, self.device)

    def finish(self, model: nn.Module) -> nn.Module:
        return model


class Replicated(Placement):
    """DDP: loaded and initialised as one process is, then replicated (DDP needs materialised parameters)."""

    def __init__(self, method, device: torch.device, run: Dist):
        super().__init__(method, device)
        self.run, self.cfg = run, run.cfg

    def finish(self, model: nn.Module) -> nn.Module:
        from torch.distributed._composable.replicate import replicate

        self.run.comm_clock = CommClock(self.device)
        # bucketed all-reduce of the parameters that require grad (DDP skips frozen ones), overlapped with backward;
        # every trainable parameter gets a gradient every step, so find_unused_parameters stays off (it would walk
        # the autograd graph after every forward); gradient_as_bucket_view: the grads live in the buckets (no copy)
        self.run.comm_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        replicate(model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                  bucket_cap_mb=self.cfg.bucket_mb, find_unused_parameters=False, gradient_as_bucket_view=True)
        model.register_comm_hook(None, self.run.comm_clock.hook)  # torch's all-reduce, timed (module docstring)
        return model


class Sharded(Placement):
    """FSDP2 on the meta model; the load hook keeps each rank's shard of every checkpoint tensor; what the
    checkpoint does not hold is initialised as one process would (same values on every rank), then sharded."""

    def __init__(self, model: nn.Module, method, device: torch.device, dtype: torch.dtype, run: Dist):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        super().__init__(method, device)
        if method.load_hook is not None:
            raise ValueError(f"parallel.strategy: fsdp cannot shard {method.describe()}: its weights are quantised "
                             "while they load; use parallel.strategy: ddp")
        # a meta copy: method.initialise materialises on it exactly what one process would (LoRA's A and B, with
        # the same random draws), never the base, which stays on meta (no memory)
        self.plain = copy.deepcopy(model)
        run.skeleton = copy.deepcopy(model)
        mp, cfg = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32), run.cfg
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp, reshard_after_forward=cfg.reshard_after_forward)
        fully_shard(model, mp_policy=mp, reshard_after_forward=cfg.reshard_after_forward)
        model.to_empty(device=device)  # each rank's shards, uninitialised: the load hook fills them
        self.params = dict(model.named_parameters())
        size = dtype.itemsize if dtype is not None else 4
        run.comm_bytes = (2 * sum(p.numel() for p in self.params.values()) * size
                          + sum(p.numel() for p in self.params.values() if p.requires_grad) * 4) // 2
        self.loaded: set[str] = set()

    @torch.no_grad()
    def _place(self, name: str, full: torch.Tensor) -> None:
        from torch.distributed.tensor import distribute_tensor

        param = self.params[name]
        # every rank read the same full tensor: each keeps its chunk, no communication (src_data_rank=None)
        shard = distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(shard.to_local())
        self.loaded.add(name)

    @property
    def load_hook(self):
        def hook(key: str, tensor: torch.Tensor) -> bool:
            if key not in self.params:
                return False  # a buffer: assigned whole
            self._place(key, tensor)
            return True

        return hook

    def initialise(self, model: nn.Module) -> nn.Module:
        self.method.initialise(self.plain, self.device)
        for name, tensor in self.plain.named_parameters():
            if name not in self.loaded and not tensor.is_meta:
                self._place(name, tensor)
        missing = sorted(set(self.params) - self.loaded)
        assert not missing, f"tensors neither loaded nor initialised: {missing[:5]}"
        del self.plain
        return model


def parallelize(model: nn.Module, method, run: Dist | None, device: torch.device, dtype: torch.dtype) -> Placement:
    """The strategy of `run` applied to the built (meta), transformed and compiled model; the returned Placement
    loads (its load_hook), initialises and finishes (DDP) it. No process group: the method's own placement."""
    if run is None or not run.active:
        return Placement(method, device)
    if run.strategy == "ddp":
        return Replicated(method, device, run)
    assert run.strategy == "fsdp", run.strategy
    return Sharded(model, method, device, dtype, run)


@contextlib.contextmanager
def full_parameters(model: nn.Module, run: Dist):
    """Inside: the model with its parameters whole, on rank 0 (the final save); None on the other ranks under
    FSDP2. Every rank must enter: FSDP2 all-gathers the shards (torch.distributed.checkpoint.state_dict) into rank
    0's host memory, where they are assigned to an unsharded copy of the model (state_dict() of a sharded model
    gives its shards)."""
    if not run.sharded:
        yield model
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not run.is_main:
        yield None
        return
    whole = copy.deepcopy(run.skeleton)
    whole.load_state_dict(full, assign=True)
    whole.tie_weights()
    yield whole


# ---------------------------------------------------------------------------------------------
# the step and the meter


def sync_gradients(model: nn.Module, now: bool) -> None:
    """DDP: all-reduce the gradients in the step's last micro-batch only; the others accumulate locally (k - 1
    fewer all-reduces per step). FSDP2 reduce-scatters every micro-batch, its default: skipping would keep
    unsharded gradients on every rank (2 bytes a parameter in bf16, the memory sharding saves). One process: no-op."""
    from torch.distributed.fsdp import FSDPModule

    if hasattr(model, "set_requires_gradient_sync") and not isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(now)


def loss_divisor(micro, run: Dist) -> float | None:
    """What each rank divides its loss sum by (module docstring): the global step's trained tokens / world size.
    None in a single process (gapless.train.step counts the step's own tokens)."""
    if not run.active:
        return None
    return max(sum(b.global_target_tokens for b in micro), 1) / run.world_size


class CommClock:
    """DDP's comm hook: torch's default all-reduce of each gradient bucket, with two marks per optimizer step (the
    module docstring's tail_r): when the step's last bucket is ready, and when the last all-reduce is done. Marks
    are host clock readings on the CPU, CUDA events on the GPU (no sync: read after the log point's settle). The
    hook runs once per bucket (a few per step for LoRA), its marks cost microseconds."""

    def __init__(self, device: torch.device):
        self.device = device
        self.phase = "compute"  # the timeline phase the loop runs the next step in ("startup" for the warm-up step)
        self._lock = threading.Lock()  # gloo runs the done callbacks on its own threads
        self._pending, self._ready, self._done = 0, None, []
        self._steps: list[tuple[str, object, list]] = []  # (phase, ready mark, done marks) of each finished step

    def _mark(self):
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def hook(self, process_group, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        with self._lock:
            self._pending += 1
            if bucket.is_last():  # DDP launches buckets in order: the last one is launched once every one is ready
                self._ready = self._mark()

        def done(fut):
            with self._lock:  # a step ends when its last bucket is launched and every bucket's all-reduce is done
                self._done.append(self._mark())
                self._pending -= 1
                if self._pending == 0 and self._ready is not None:
                    self._steps.append((self.phase, self._ready, self._done))
                    self._pending, self._ready, self._done = 0, None, []
            return fut.value()

        return allreduce_hook(process_group, bucket).then(done)

    def take(self) -> list[tuple[str, float]]:
        """(phase, tail seconds) of each step finished since the last take, in order."""
        with self._lock:
            steps, self._steps = self._steps, []
        if self.device.type == "cuda":  # the events are complete: the loop settled before its log point
            return [(phase, max(ready.elapsed_time(d) for d in done) / 1e3) for phase, ready, done in steps]
        return [(phase, max(done) - ready) for phase, ready, done in steps]


def aggregate(run: Dist, device: torch.device, loss_sum: torch.Tensor, trained: int, real: int, compute_s: float,
              t_window: float, steps: int, timeline, stop_signalled: bool = False) -> dict:
    """At a log point (not per step): every rank's window numbers gathered, as fields of the metrics record (the
    module docstring defines them). `compute_s`: this rank's compute seconds in the window; `t_window`: the
    perf_counter reading at its start; `steps`: its optimizer steps. `timeline`: this rank's; the barrier is
    charged to "communication", and so are this rank's per-step tails, out of the phase each step ran in
    (compute; the warm-up step's stay startup). Returns the global loss (the sum over ranks over the global
    trained tokens) and the spread per rank, and how many ranks got a stop signal (`stop_signalled`; the training
    loop stops every rank after this step when any did)."""
    if not run.active:
        return {}
    start = time.perf_counter()
    with timeline.phase("communication"):
        dist.barrier()  # SYNC: once per log point
    wait = time.perf_counter() - start
    step_s = time.perf_counter() - t_window
    comm = probe_allreduce(run, device)
    tails = run.comm_clock.take() if run.comm_clock is not None else None
    mine = torch.tensor([float(loss_sum), trained, real, compute_s, step_s, wait, comm,
                         -1 if tails is None else len(tails), float(stop_signalled)], dtype=torch.float64, device=device)
    ranks = _gather(run, mine)  # [world, 9]
    loss, trained_all, real_all = ranks[:, 0].sum().item(), ranks[:, 1].sum().item(), ranks[:, 2]
    compute, windows, waits = ranks[:, 3], ranks[:, 4], ranks[:, 5].clone()
    comm_total = ranks[:, 6].max().item() * steps
    exposed = own = None
    if tails is not None:
        assert (ranks[:, 7] == len(tails)).all(), f"ranks timed different numbers of steps: {ranks[:, 7].tolist()}"
        every = _gather(run, torch.tensor([t for _, t in tails], dtype=torch.float64, device=device))  # [world, n]
        per_step = every.min(dim=0).values  # [n]: the exposed communication of each step
        exposed = per_step.sum().item()
        waits += (every - per_step).sum(dim=1)
        in_compute = torch.tensor([phase == "compute" for phase, _ in tails], dtype=torch.float64)
        own = compute - (every * in_compute).sum(dim=1)  # compute_s holds the compute phases' tails only
        timeline.move("compute", "communication", sum(t for phase, t in tails if phase == "compute"))
    slowest = int(waits.argmin().item())  # the rank the others waited for: it waited the least
    return {
        "loss": loss / max(trained_all, 1),
        "world_size": run.world_size,
        "strategy": run.strategy,
        "window_steps": steps,
        "global_real_tokens": int(real_all.sum().item()),
        # the record's tokens_per_s is rank 0's; this is every rank's real tokens over the slowest rank's window
        "global_tokens_per_s": real_all.sum().item() / max(windows.max().item(), 1e-9),
        # real tokens per rank over the window: equal work needs equal tokens, not equal rows
        "rank_real_tokens_min": int(real_all.min().item()),
        "rank_real_tokens_max": int(real_all.max().item()),
        "rank_imbalance": (real_all.max() / real_all.clamp(min=1).mean()).item() - 1.0,
        "rank_compute_s_max": compute.max().item(),  # each rank's compute phases (DDP: its all-reduce tails in them)
        "rank_compute_s_min": compute.min().item(),
        "rank_step_s_max": windows.max().item(),  # the window's seconds, to the end of the log point's barrier
        # the rank every other waits for, and its own compute (without its tails; FSDP2: with them; 0 in the window
        # of the warm-up step alone, which is startup)
        "slowest_rank": slowest,
        "slowest_rank_compute_s": (own if own is not None else compute)[slowest].item(),
        # time ranks waited for slower ones: in each step's all-reduce (DDP) and in the log point's barrier
        "collective_wait_s_max": waits.max().item(),
        "collective_wait_s_mean": waits.mean().item(),
        # communication: exposed (not hidden under compute) and overlapped, over the window (module docstring)
        "comm_measured": ("ddp comm hook: the all-reduce tail after each rank's backward" if exposed is not None else
                          "not measured: FSDP2 runs its collectives inside its own hooks, untimed"),
        "comm_exposed_s": exposed,
        "comm_total_s": comm_total,
        "comm_overlapped_s": max(comm_total - exposed, 0.0) if exposed is not None else None,
        # what one step's communication would take alone, not overlapped with compute (an all-reduce probe scaled
        # to Dist.comm_bytes)
        "comm_bytes_per_step": run.comm_bytes,
        "comm_serial_s_per_step": ranks[:, 6].max().item(),
        "ranks_stopping": int(ranks[:, 8].sum().item()),  # ranks a stop signal (SIGTERM, Ctrl-C) reached
    }


def _gather(run: Dist, mine: torch.Tensor) -> torch.Tensor:
    """[world, *mine.shape]: every rank's `mine` (the same shape on each), on the host."""
    every = [torch.empty_like(mine) for _ in range(run.world_size)]
    dist.all_gather(every, mine)
    return torch.stack(every).cpu()


def max_over_ranks(run: Dist, device: torch.device, values: list[float]) -> list[float]:
    """Each of `values`, the maximum over the ranks: numbers every rank must agree on (the checkpoint interval: a
    save is collective). The values themselves in a single process."""
    if not run.active:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()  # SYNC: checkpoint.every auto calls it once per run and at its saves, never per step


PROBE_BYTES = 64 << 20  # large enough for the bus bandwidth plateau on NVLink (nccl-tests reach it past ~32 MB)


def probe_allreduce(run: Dist, device: torch.device) -> float:
    """Seconds an all-reduce of Dist.comm_bytes takes here, alone: one all-reduce of min(comm_bytes, 64 MB),
    timed after a warm-up one and scaled linearly (at these sizes the time is bandwidth-bound)."""
    if run.comm_bytes == 0 or run.world_size == 1:
        return 0.0
    size = min(run.comm_bytes, PROBE_BYTES)
    buf = torch.zeros(size // 4, dtype=torch.float32, device=device)
    dist.all_reduce(buf)  # warm-up: NCCL sets the ring up on first use
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    dist.all_reduce(buf)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # SYNC: once per log point
    return (time.perf_counter() - start) * run.comm_bytes / size
