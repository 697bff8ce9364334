"""Several processes on the CPU (gloo), through the real `train`: DDP and FSDP2 give the losses and the updates of one
process over the same global batches; a checkpoint written at one world size resumes at another with the same loss
curve; ragged rows are dealt to ranks balanced by real tokens; an error on one rank ends every rank with it.

Processes are started with torch.multiprocessing.spawn, each with torchrun's environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT), and the failure test through torchrun itself. The demo's tiny Llama, float32,
LoRA without dropout (each rank draws its own dropout masks, so dropout cannot match one process's draws).
"""
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from gapless.config import load_config
from gapless.data.batching import BatchSampler, Mixture
from gapless.data.sharding import ShardedSampler, split_rows, spread
from test_loop import base  # noqa: F401  (the demo's tiny Llama and 200 records: one fixture for both)

STEPS = 4
# float32: the sum over ranks reorders one process's additions (gradients differ by ~1e-7); Adam divides by
# sqrt(v), so an element whose gradient is near 0 moves by up to lr=1e-2 per step whatever its size: after 4 steps
# the worst element measured 3.4e-6 apart (of updates up to 4e-2)
TOL = dict(rtol=1e-4, atol=1e-5)


def raw_config(base: dict, out: str, **overrides) -> dict:
    """6 packed rows of 64 slots per micro-batch (2 or 3 ranks share them), grad_accum 2."""
    raw = {
        "model": {"path": str(base["model"]), "dtype": "float32", "device": "cpu", "compile": False,
                  "attn_backend": "sdpa"},
        "data": {"sources": [{"path": str(base["data"]), "format": "messages"}], "max_seq_len": 64,
                 "tokens_per_batch": 384, "cache_dir": str(base["cache"]), "num_workers": 0},
        "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
        "optim": {"lr": 1e-2},
        "schedule": {"kind": "cosine", "warmup_steps": 1},
        "checkpoint": {"every": 2, "keep": 2},
        "train": {"steps": STEPS, "grad_accum": 2, "log_every": 1, "seed": 3},
        "output_dir": str(base["root"] / out),
        "progress": False,
    }
    return {"raw": raw, "overrides": [f"{k}={v}" for k, v in overrides.items()]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, jobs: list[tuple[str, dict, int | None, int]]) -> None:
    """One spawned rank: the runs of `jobs` (tag, spec, stop_after, port) one after the other, in one process (each
    `train` opens and closes its process group), so the ~6 s import of torch is paid once per rank."""
    torch.set_num_threads(1)
    from gapless.train.loop import train

    for tag, spec, stop_after, port in jobs:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
        result = train(load_config(data=spec["raw"], overrides=spec["overrides"]), stop_after=stop_after)
        if rank == 0:
            Path(spec["raw"]["output_dir"], f"losses-{tag}.json").write_text(json.dumps(result.losses))


def run_ranks(world: int, jobs: list[tuple[str, dict, int | None]]) -> None:
    jobs = [(tag, spec, stop, free_port()) for tag, spec, stop in jobs]
    if world == 1:  # in this process: a process group of one, as `torchrun --nproc-per-node 1` makes
        with mock.patch.dict(os.environ):
            _worker(0, 1, jobs)
    else:
        mp.spawn(_worker, args=(world, jobs), nprocs=world, join=True)


def losses(spec: dict, tag: str) -> dict[int, float]:
    return {int(k): v for k, v in json.loads(Path(spec["raw"]["output_dir"], f"losses-{tag}.json").read_text()).items()}


def resumed(base: dict, saved: dict, name: str, strategy: str = "fsdp") -> dict:
    """A copy of the stopped run `saved`, to resume from its step-2 checkpoint."""
    shutil.copytree(saved["raw"]["output_dir"], base["root"] / name)
    return raw_config(base, name, **{"parallel.strategy": strategy, "resume": "true"})


@pytest.fixture(scope="module")
def runs(base):
    """Every run the tests compare, in as few process launches as the order allows (2 spawns):
    one process without a process group (the reference); world size 1: DDP stopped after step 2; world size 2:
    DDP, FSDP2, FSDP2 stopped after step 2; world size 3: DDP, FSDP2, the resumes of the stopped runs of world
    sizes 2 (FSDP2) and 1 (DDP); world size 1: the resume of world size 2's; one process without a process group:
    the same."""
    from gapless.train.loop import train

    torch.set_num_threads(1)
    spec = {(s, w): raw_config(base, f"{s}{w}", **{"parallel.strategy": s}) for s in ("ddp", "fsdp") for w in (2, 3)}
    stopped = {w: raw_config(base, f"stopped{w}", **{"parallel.strategy": s}) for w, s in ((1, "ddp"), (2, "fsdp"))}
    single = raw_config(base, "single")
    ref = train(load_config(data=single["raw"], overrides=single["overrides"]))
    full = {w: raw_config(base, f"full{w}", method="full", **{"optim.lr": 1e-3}) for w in (0, 2)}  # 0: no torchrun
    auto = raw_config(base, "auto2", **{"checkpoint.every": "auto", "train.steps": 12})
    full_ref = train(load_config(data=full[0]["raw"], overrides=full[0]["overrides"]))
    run_ranks(1, [("run", stopped[1], 2)])
    run_ranks(2, [("run", spec["ddp", 2], None), ("run", spec["fsdp", 2], None), ("run", stopped[2], 2),
                  ("run", full[2], None), ("run", auto, None)])
    resume = {(2, 3): resumed(base, stopped[2], "2to3"), (1, 3): resumed(base, stopped[1], "1to3", "ddp"),
              (2, 1): resumed(base, stopped[2], "2to1"), (2, 0): resumed(base, stopped[2], "2to0")}
    run_ranks(3, [("run", spec["ddp", 3], None), ("run", spec["fsdp", 3], None),
                  ("run", resume[2, 3], None), ("run", resume[1, 3], None)])
    run_ranks(1, [("run", resume[2, 1], None)])
    plain = resume[2, 0]  # no torchrun: DCP reads the shards back into one unsharded model
    Path(plain["raw"]["output_dir"], "losses-run.json").write_text(json.dumps(
        train(load_config(data=plain["raw"], overrides=plain["overrides"])).losses))
    return {"single": ref, "spec": spec, "stopped": stopped, "resume": resume, "full": full, "full_ref": full_ref,
            "auto": auto}


def adapter(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(Path(run_dir) / "adapter" / "adapter_model.safetensors")


@pytest.mark.parametrize("strategy,world", [("ddp", 2), ("ddp", 3), ("fsdp", 2), ("fsdp", 3)])
def test_ranks_equal_one_process(runs, strategy, world):
    single, spec = runs["single"], runs["spec"][strategy, world]
    got = losses(spec, "run")
    assert sorted(got) == sorted(single.losses) == list(range(1, STEPS + 1))
    for step in single.losses:
        assert got[step] == pytest.approx(single.losses[step], rel=1e-5), (step, got, single.losses)
    mine, ref = adapter(spec["raw"]["output_dir"]), adapter(single.run_dir)
    assert mine.keys() == ref.keys()
    for k in ref:  # the updates: the adapter after STEPS optimizer steps
        torch.testing.assert_close(mine[k], ref[k], **TOL)
    records = [json.loads(line) for line in open(Path(spec["raw"]["output_dir"]) / "metrics.jsonl")]
    step_records = [r for r in records if "loss" in r]
    assert all(r["world_size"] == world and r["strategy"] == strategy for r in step_records)
    assert all(0 <= r["rank_imbalance"] < 1 and r["rank_real_tokens_min"] > 0 for r in step_records)
    assert all(r["collective_wait_s_max"] >= 0 and r["rank_compute_s_max"] >= r["rank_compute_s_min"]
               for r in step_records)
    # the run's totals: every rank's real tokens, the one process's (the same global batches), which the console's
    # throughput line prints; the record's own real_tokens is rank 0's share
    final = records[-1]
    assert final["global_real_tokens"] == single.real_tokens == sum(r["global_real_tokens"] for r in step_records)
    assert final["real_tokens"] < single.real_tokens
    assert final["global_tokens_per_s"] == pytest.approx(final["global_real_tokens"] / final["wall_s"])


def test_full_fine_tuning_shards_by_default(runs):
    """method: full under torchrun: `auto` picks FSDP2 (parameters, gradients and AdamW state sharded), and 2 ranks
    log the losses of one process."""
    got, ref = losses(runs["full"][2], "run"), runs["full_ref"].losses
    records = [json.loads(line) for line in open(Path(runs["full"][2]["raw"]["output_dir"]) / "metrics.jsonl")]
    assert {r["strategy"] for r in records if "loss" in r} == {"fsdp"}
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-5), (step, got, ref)


def test_auto_checkpoint_interval_is_agreed_by_every_rank(runs):
    """checkpoint.every auto at 2 ranks: chosen at step 4 from numbers every rank shares (the maximum over them), so
    both save at the same steps (a save is collective: ranks that disagreed would hang); a tiny LoRA's save is
    predicted cheap: the floor of 10 steps, then the save of step 10 is timed (collectively) and may widen the
    interval (on a busy 2-core box it blocked long enough to make it 11: saves at 10, 11 and 12), and the last step
    saves; the 2 newest are kept, the same on both ranks (one checkpoint folder, written by both)."""
    from gapless.meter.report import checkpoint_steps, read_run
    from gapless.train.checkpoint_interval import MIN_EVERY

    out = Path(runs["auto"]["raw"]["output_dir"])
    chosen = [r for r in map(json.loads, open(out / "metrics.jsonl")) if r.get("kind") == "checkpoint_interval"]
    assert chosen[0]["step"] == 4 and chosen[0]["every"] == MIN_EVERY == 10, chosen
    # re-chosen only after a save (step 10's measured block, or a later save's wait for the previous write)
    assert all(r["step"] >= 10 and r["every"] >= MIN_EVERY for r in chosen[1:]), chosen
    every, saved = None, []
    for step in range(1, 13):  # the saves the recorded intervals make; each record follows its step's save
        if step == 12 or (every and step % every == 0):
            saved.append(step)
        every = next((r["every"] for r in chosen if r["step"] == step), every)
    steps = sorted(int(p.name.removeprefix("step-")) for p in (out / "checkpoints").glob("step-*"))
    # the report marks every save made; the folder keeps the 2 newest (the two differ when step 10's widened to 11)
    assert saved[0] == 10 and steps == saved[-2:] and checkpoint_steps(read_run(out)) == saved, (saved, steps)
    for step in steps:
        manifest = json.loads((out / "checkpoints" / f"step-{step:08d}" / "manifest.json").read_text())
        assert manifest["writer"] == "dcp" and manifest["world_size"] == 2
    assert sorted(losses(runs["auto"], "run")) == list(range(1, 13)) and (out / "adapter").is_dir()


@pytest.mark.parametrize("saved,resumed_at", [(2, 3), (2, 1), (1, 3), (2, 0)])
def test_resume_at_another_world_size(runs, saved, resumed_at):
    """Stopped after step 2's checkpoint (DCP) at `saved` ranks, resumed at `resumed_at` (0: one process without
    torchrun): the loss curve of the uninterrupted single process, step for step."""
    single, stopped = runs["single"], runs["stopped"][saved]
    ckpt = Path(stopped["raw"]["output_dir"]) / "checkpoints" / "step-00000002"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["world_size"] == saved and manifest["writer"] == "dcp"
    first, second = losses(stopped, "run"), losses(runs["resume"][saved, resumed_at], "run")
    assert sorted(first) == [1, 2] and sorted(second) == [3, 4]
    for step, loss in {**first, **second}.items():
        assert loss == pytest.approx(single.losses[step], rel=1e-5), (step, first, second, single.losses)


def test_rows_are_dealt_balanced_by_real_tokens():
    # 8 rows of ragged fill dealt to 4 ranks of 2 rows: longest first to the least loaded rank
    tokens = [60, 10, 55, 20, 64, 5, 30, 40]
    parts = split_rows(tokens, 4, 2)
    assert sorted(i for p in parts for i in p) == list(range(8)) and all(len(p) == 2 for p in parts)
    loads = [sum(tokens[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= 15, loads  # 64+5, 60+10, 55+20, 40+30: 69, 70, 75, 70
    # the naive split (consecutive rows) of the same batch: 70, 75, 69, 70 by luck here; a sorted batch is worst
    worst = [64, 60, 55, 40, 30, 20, 10, 5]
    naive = [sum(worst[i:i + 2]) for i in range(0, 8, 2)]
    dealt = [sum(worst[i] for i in p) for p in split_rows(worst, 4, 2)]
    assert max(naive) - min(naive) == 109 and max(dealt) - min(dealt) <= 10, (naive, dealt)


def test_sharded_stream_is_the_global_stream(base):
    """Every rank's rows of each global batch are disjoint, together the 1-process batch; the spread is reported;
    the sampler state is the global one at every world size."""
    from gapless.data.pipeline import build_data

    cfg = load_config(data=raw_config(base, "x")["raw"])
    mix, _, _ = build_data(cfg.data, Path(cfg.model.path))
    ref = BatchSampler.from_config(cfg.data, mix)
    ref_batches = [next(iter(ref)) for _ in range(5)]
    for world in (2, 3):
        shards = [ShardedSampler.of(BatchSampler.from_config(cfg.data, mix), r, world) for r in range(world)]
        streams = [iter(s) for s in shards]
        for ref_batch in ref_batches:
            parts = [next(s) for s in streams]
            assert sum(p.num_real_tokens for p in parts) == ref_batch.num_real_tokens == parts[0].global_real_tokens
            assert sum(p.num_target_tokens for p in parts) == ref_batch.num_target_tokens \
                == parts[0].global_target_tokens
            assert sorted(x for p in parts for x in p.doc_lengths) == sorted(ref_batch.doc_lengths)
            assert [p.num_real_tokens for p in parts] == list(parts[0].rank_real_tokens)
        assert all(s.state_dict() == ref.state_dict() for s in shards)
        s = spread([next(streams[0]) for _ in range(20)])
        assert 0 <= s["imbalance"] < 0.1 and s["min"] > 0, s  # ragged demo rows, dealt: within 10% of even
    with pytest.raises(ValueError, match="tokens_per_batch"):
        ShardedSampler.of(BatchSampler.from_config(cfg.data, mix), 0, 4)  # 6 rows cannot go to 4 ranks


FAIL_SCRIPT = """
import sys, os, torch
from gapless.config import load_config
import gapless.train.loop as loop
spec = __import__("json").loads(open(sys.argv[1]).read())
if os.environ["RANK"] == "1":
    real = loop.train_step
    calls = []
    def failing(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("rank 1 fails at its second step")
        return real(*a, **k)
    loop.train_step = failing
loop.train(load_config(data=spec["raw"], overrides=spec["overrides"]))
"""


def test_an_error_on_one_rank_ends_all_ranks(base, tmp_path):
    """torchrun starts 2 ranks; rank 1 raises at step 2 while rank 0 waits in a collective: torchrun ends both and
    exits non-zero with rank 1's error, in seconds, not after the process group's timeout."""
    spec = raw_config(base, "fail", **{"parallel.timeout_s": 120, "checkpoint.every": 0})
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    (tmp_path / "fail.py").write_text(FAIL_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), str(tmp_path / "fail.py"), str(tmp_path / "spec.json")],
                          capture_output=True, text=True, timeout=100, env=env)
    assert proc.returncode != 0
    assert "rank 1 fails at its second step" in proc.stderr + proc.stdout, proc.stderr[-3000:]


SIGNAL_SCRIPT = """
import sys, os, signal
from gapless.config import load_config
import gapless.train.loop as loop
spec = __import__("json").loads(open(sys.argv[1]).read())
if os.environ["RANK"] == "1":  # a SIGTERM reaches rank 1 alone, during its third step
    real = loop.train_step
    calls = []
    def signalled(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            signal.raise_signal(signal.SIGTERM)
        return real(*a, **k)
    loop.train_step = signalled
result = loop.train(load_config(data=spec["raw"], overrides=spec["overrides"]))
print(f"rank {os.environ['RANK']} stopped: {result.stopped}", flush=True)
"""


def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step(base, tmp_path):
    """Rank 1 alone gets SIGTERM during step 3 (log_every 2): both ranks stop after step 4, the next log point, whose
    gather carries the flag, with one checkpoint; neither waits for the other in a collective (the process group's
    timeout would end the test)."""
    spec = raw_config(base, "signal", **{"parallel.timeout_s": 60, "train.steps": 6, "train.log_every": 2,
                                         "checkpoint.every": 0})
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    (tmp_path / "one_rank_stops.py").write_text(SIGNAL_SCRIPT)  # not signal.py: it would shadow the module
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), str(tmp_path / "one_rank_stops.py"),
                           str(tmp_path / "spec.json")],
                          capture_output=True, text=True, timeout=150, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "rank 0 stopped: a signal to another rank" in out and "rank 1 stopped: SIGTERM" in out, out[-3000:]
    records = [json.loads(line) for line in Path(spec["raw"]["output_dir"], "metrics.jsonl").read_text().splitlines()]
    (stopped,) = [r for r in records if r.get("kind") == "stopped"]
    assert stopped["step"] == 4 and stopped["checkpoint"]
    assert [r["ranks_stopping"] for r in records if "loss" in r and "step" in r and "ranks_stopping" in r] == [0, 1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_nccl_gapless_train_nproc_equals_one_gpu(base, tmp_path, strategy):
    """`gapless train CONFIG --nproc N` (torchrun, NCCL, N = the machine's GPUs up to 3; 1 on the one-GPU machine)
    logs the losses of one process on one GPU without a process group, float32."""
    import yaml

    from gapless.train.loop import train

    n = min(torch.cuda.device_count(), 3)
    gpu = {"model.device": "cuda", "model.attn_backend": "sdpa", "model.compile": "false"}
    ref = train(load_config(data=raw_config(base, f"gpu-single-{strategy}")["raw"],
                            overrides=[f"{k}={v}" for k, v in gpu.items()]))
    spec = raw_config(base, f"gpu-{strategy}{n}")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(spec["raw"]))
    proc = subprocess.run([sys.executable, "-m", "gapless.cli", "train", str(tmp_path / "run.yaml"), "--nproc", str(n),
                           f"parallel.strategy={strategy}", *[f"{k}={v}" for k, v in gpu.items()]],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in open(Path(spec["raw"]["output_dir"]) / "metrics.jsonl")]
    got = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert all(r["world_size"] == n for r in records if "loss" in r)
    for step, loss in ref.losses.items():
        assert got[step] == pytest.approx(loss, rel=1e-4), (step, got, ref.losses)


def test_per_rank_file_names():
    from gapless.train.parallel import Dist

    assert Dist(rank=0, world_size=4).per_rank("gpu.jsonl") == "gpu.jsonl"  # the report reads rank 0's
    assert Dist(rank=3, world_size=4).per_rank("gpu.jsonl") == "gpu.rank3.jsonl"
