"""Training throughput on several GPUs: the run's own step (gapless.train.step), model assembly (with its DDP or FSDP2
transform) and per-rank sharding (gapless.data.sharding), random weights of --arch, documents of --lengths.

    python bench/dist_gpu.py --strategy none ...                                   # one GPU, no process group
    torchrun --standalone --nproc-per-node N bench/dist_gpu.py --strategy ddp ...  # N GPUs (1 = the wrapping alone)

Each GPU gets --tokens-per-gpu slots a step (the global batch is N times that, so the work per GPU is the same at
every N). Timed: --steps steps after --warmup, from a barrier to a barrier after the last step's CUDA work; real
tokens counted on the host from the global batches. One row per call in --out, written by rank 0:
  real_tok_s            real tokens of all GPUs / time
  real_tok_s_per_gpu    real_tok_s / gpus
  gpus, strategy, method
  scaling_efficiency    real_tok_s_per_gpu / that of the row of the same --run-id, config and strategy at 1 GPU
                        (null for the 1-GPU row itself, or when that row is missing)
  rank_imbalance        busiest rank's real tokens over the even share, minus 1, over the timed steps
  step_ms, peak_gib (the largest of the ranks), comm_serial_ms (gapless.train.parallel.probe_allreduce)
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from gapless.bench import append_row, device_name, lengths_mixture, read_rows
from gapless.config import ParallelConfig, load_config
from gapless.data.batching import BatchSampler
from gapless.data.sharding import ShardedSampler
from gapless.model.decoder import CausalLM
from gapless.model.loading import model_args_from_config, read_config
from gapless.model.method import method_of
from gapless.train.assemble import assemble, random_tensors
from gapless.train.optim import build_optimizer
from gapless.train.parallel import init_distributed, loss_divisor, probe_allreduce
from gapless.train.step import train_step


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--arch", default="bench/models/llama-3.2-3b", help="a folder with the architecture's config.json")
    p.add_argument("--lengths", required=True, help="token lengths of documents (e.g. lengths_shared_mix.txt)")
    p.add_argument("--strategy", choices=["none", "ddp", "fsdp"], required=True,
                   help="none: one process without torchrun; ddp or fsdp under torchrun")
    p.add_argument("--method", default="lora", help="the config's method (lora; full once it exists)")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--attn", default="varlen")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--activation-checkpointing", type=int, default=0)
    p.add_argument("--tokens-per-gpu", type=int, default=16384)
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default="bench/results.jsonl")
    p.add_argument("--run-id", default=datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ"))
    opts = p.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    run, device = init_distributed(ParallelConfig(strategy="auto" if opts.strategy == "none" else opts.strategy),
                                   device, opts.method)
    if opts.strategy != "none" and not run.active:
        raise SystemExit(f"--strategy {opts.strategy}: start this script with torchrun")
    world = run.world_size
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = load_config(data={"model": {"path": opts.arch}, "data": {"sources": [{"path": opts.lengths}]},
                            "method": opts.method,
                            "lora": {"r": opts.lora_r}})
    args = model_args_from_config(read_config(opts.arch))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = CausalLM(args, attn_backend=opts.attn)
    method = method_of(cfg)
    model = assemble(model, method, device, dtype, activation_checkpointing=opts.activation_checkpointing,
                     compile=not opts.no_compile, tensors=random_tensors(model, device, dtype), parallel=run)
    params = list(method.trainable(model).values())
    optimizer = build_optimizer(params, cfg.optim, device.type)

    mix = lengths_mixture(opts.lengths, args.vocab_size, opts.max_seq_len)
    sampler = BatchSampler(mix, max_seq_len=opts.max_seq_len, tokens_per_batch=opts.tokens_per_gpu * world)
    if run.active:
        sampler = ShardedSampler.of(sampler, run.rank, world)
    stream = iter(sampler)
    batches = [next(stream).to(device) for _ in range(opts.warmup + opts.steps)]

    def step(b):
        train_step(model, [b], params, optimizer, cfg.optim.grad_clip, n_step=loss_divisor([b], run))

    for b in batches[:opts.warmup]:
        step(b)
    torch.cuda.synchronize(device) if device.type == "cuda" else None
    run.barrier()
    torch.cuda.reset_peak_memory_stats(device) if device.type == "cuda" else None
    start = time.perf_counter()
    for b in batches[opts.warmup:]:
        step(b)
    torch.cuda.synchronize(device) if device.type == "cuda" else None
    run.barrier()
    seconds = time.perf_counter() - start
    timed = batches[opts.warmup:]
    real = sum(getattr(b, "global_real_tokens", b.num_real_tokens) for b in timed)
    per_rank = [sum(b.rank_real_tokens[r] for b in timed) for r in range(world)] if run.active else [real]
    peak = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0],
                        device=device)
    if run.active:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    comm = probe_allreduce(run, device) if run.active else 0.0
    config = f"dist_{opts.method}_{opts.strategy}"
    if run.is_main:
        per_gpu = real / seconds / world
        one = [r for r in read_rows(Path(opts.out)) if r.get("run_id") == opts.run_id and r.get("gpus") == 1
               and r.get("config") == config]
        row = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "gpu": device_name(device), "system": "gapless", "config": config, "model": Path(opts.arch).name,
               "gpus": world, "strategy": opts.strategy, "method": opts.method, "real_tok_s": round(real / seconds, 1),
               "real_tok_s_per_gpu": round(per_gpu, 1),
               "scaling_efficiency": round(per_gpu / one[-1]["real_tok_s_per_gpu"], 4) if one and world > 1 else None,
               "rank_imbalance": round(max(per_rank) / (sum(per_rank) / world) - 1, 4),
               "step_ms": round(seconds / opts.steps * 1e3, 2), "peak_gib": round(peak.item(), 2),
               "comm_bytes_per_step": run.comm_bytes, "comm_serial_ms": round(comm * 1e3, 2),
               "tokens_per_gpu": opts.tokens_per_gpu, "max_seq_len": opts.max_seq_len, "steps": opts.steps,
               "warmup": opts.warmup, "attn": opts.attn, "compile": not opts.no_compile, "dtype": str(dtype),
               "data": f"lengths {opts.lengths}", "run_id": opts.run_id, "torch": torch.__version__,
               "command": " ".join(sys.argv)}
        append_row(Path(opts.out), row)
        print(json.dumps(row))
    run.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
