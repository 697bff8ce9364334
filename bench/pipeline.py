"""The overlapped pipeline, measured: a real `gapless train` run against the pure steps of the same configuration.

    PYTHONPATH=src python3 bench/pipeline.py --arch bench/models/llama-3.2-1b --tokenizer TOKENIZER_DIR \
        --data MESSAGES_DIR [--steps 1010] [--out bench/results.jsonl]

1. Writes the architecture with random weights as an HF folder (weights cannot be downloaded here).
2. The real run: `train()` on the messages data through the whole data path (readers, chat template, token
   cache, packing, prefetch), LoRA r16, bf16, varlen attention, compiled layers, 16,384 tokens per step, a 1%
   held-out split, checkpoint every 500 steps, log every 10, eval every 1,000 (issue #8's settings). Its steady
   throughput: real tokens of steps 2..N over the time from the end of step 1 (which compiles) to the end of
   the loop, every log sync, checkpoint stall and evaluation inside.
3. The pure steps: the same batches (the sampler's same seeded order, its first --pure-steps of them (one call
   of the GPU machine cannot hold two 1,000-step runs; 400 steps are 1.5 epochs of the shared mix, so the same
   mix of document lengths), all copied to the GPU first), the same
   model transform and optimizer, forward + backward + clip + AdamW + scheduler back to back, no logging, no
   checkpoint, no eval, no data loading; timed with CUDA events from the end of step 1 to the end of step N.
4. Agreement: the run's own tokens/s over its whole call (its last metrics record) against a wall clock
   around `train()` here and a token count taken from the batches' documents (`Mixture.lengths`).

Efficiency = steady real tokens/s of the run / pure-step real tokens/s. Rows go to --out (results.jsonl).
"""
from __future__ import annotations

import argparse
import datetime
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from gapless.bench import append_row, device_name
from gapless.config import load_config
from gapless.data.batching import BatchSampler
from gapless.data.pipeline import build_data
from gapless.model.decoder import CausalLM
from gapless.model.export import copy_tokenizer_files, save_pretrained
from gapless.model.loading import build, load_weights, model_args_from_config, read_config
from gapless.model.method import method_of
from gapless.train.assemble import assemble, random_tensors
from gapless.train.loop import train
from gapless.train.optim import build_optimizer, build_scheduler
from gapless.train.step import train_step


# --smoke: the same flow on the CPU in a minute (float32, sdpa, no compile, small batches and intervals), to test
# this script before spending GPU time; its numbers mean nothing
SMOKE = ["model.device=cpu", "model.dtype=float32", "model.attn_backend=sdpa", "model.compile=false",
         "data.max_seq_len=256", "data.tokens_per_batch=512", "checkpoint.every=6", "train.eval_every=10",
         "train.log_every=2", "data.eval_fraction=0.05"]


def write_random_checkpoint(arch: Path, tokenizer: Path, folder: Path, device: torch.device) -> Path:
    config = read_config(arch)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device("meta"):
        model = CausalLM(model_args_from_config(config))
    model = load_weights(model, dtype, device, tensors=random_tensors(model, device, dtype))
    model.config_dict = config
    save_pretrained(model, folder, source_dir=arch)
    copy_tokenizer_files(tokenizer, folder)
    del model
    return folder


def run_config(model_dir: Path, data: Path, out: Path, steps: int, overrides: list[str]):
    return load_config(overrides=overrides, data={
        "model": {"path": str(model_dir), "dtype": "bfloat16", "device": "cuda", "attn_backend": "varlen",
                  "compile": True},
        "data": {"sources": [{"path": str(data)}], "eval_fraction": 0.01, "max_seq_len": 4096,
                 "tokens_per_batch": 16384, "cache_dir": str(out / "cache")},
        "lora": {"r": 16, "alpha": 32},
        "checkpoint": {"every": 500, "keep": 2},
        "train": {"steps": steps, "log_every": 10, "eval_every": 1000},
        "output_dir": str(out / "run"),
        "progress": False,
    })


def pure_steps(cfg, steps: int) -> tuple[int, float]:
    """(real tokens, seconds) of steps 2..N run back to back over the run's own batches (see the module doc)."""
    mix, _, _ = build_data(cfg.data, cfg.model.path)  # from the token cache the run wrote
    sampler = BatchSampler.from_config(cfg.data, mix)
    device = torch.device(cfg.model.device)
    cuda = device.type == "cuda"
    batches = [b.to(device) for _, b in zip(range(steps), sampler)]
    method = method_of(cfg)
    model = assemble(build(cfg.model.path, cfg.model.attn_backend), method, device, cfg.model.dtype,
                     compile=cfg.model.compile)
    params = list(method.trainable(model).values())
    optimizer = build_optimizer(params, cfg.optim, device.type)
    scheduler = build_scheduler(optimizer, cfg.schedule, steps)

    def step(b):
        train_step(model, [b], params, optimizer, cfg.optim.grad_clip)  # the loop's step: forward, backward, clip, AdamW
        scheduler.step()

    step(batches[0])  # compiles
    if not cuda:
        t0 = time.perf_counter()
        for b in batches[1:]:
            step(b)
        return sum(b.num_real_tokens for b in batches[1:]), time.perf_counter() - t0
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for b in batches[1:]:
        step(b)
    end.record()
    end.synchronize()
    return sum(b.num_real_tokens for b in batches[1:]), start.elapsed_time(end) / 1e3


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--arch", required=True, help="a folder with the architecture's config.json")
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--data", required=True, help="messages JSONL file or folder")
    p.add_argument("--steps", type=int, default=1001)
    p.add_argument("--pure-steps", type=int, default=400)
    p.add_argument("--work", default="/tmp/gapless-pipeline")
    p.add_argument("--out", default="bench/results.jsonl")
    p.add_argument("--run-id", default=datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ"))
    p.add_argument("--smoke", action="store_true", help="the same flow on the CPU, small (tests this script)")
    opts = p.parse_args()
    work = Path(opts.work)
    shutil.rmtree(work, ignore_errors=True)
    device = torch.device("cpu" if opts.smoke else "cuda")
    cuda = device.type == "cuda"
    model_dir = write_random_checkpoint(Path(opts.arch), Path(opts.tokenizer), work / "model", device)
    cfg = run_config(model_dir, Path(opts.data), work, opts.steps, SMOKE if opts.smoke else [])

    build_data(cfg.data, model_dir)  # the token cache first: tokenizing once is data preparation, not the run
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    result = train(cfg)
    wall = time.perf_counter() - t0
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    last = json.loads((result.run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    # the token count from the data: the documents of the run's first N batches, in the sampler's order
    mix, _, _ = build_data(cfg.data, model_dir)
    counted = sum(b.num_real_tokens for _, b in zip(range(opts.steps), BatchSampler.from_config(cfg.data, mix)))
    if cuda:
        torch.cuda.empty_cache()

    pure_tokens, pure_s = pure_steps(cfg, min(opts.pure_steps, opts.steps))
    pure = pure_tokens / pure_s
    steady = result.steady_tokens_per_s
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    common = {"date": now, "gpu": device_name(device), "system": "gapless",
              "model": Path(opts.arch).name, "command": "python3 bench/pipeline.py " + " ".join(sys.argv[1:]),
              "run_id": opts.run_id, "torch": torch.__version__, "steps": opts.steps, "tokens_per_batch": 16384,
              "mfu": None, "padding_fraction": None, "error": None}
    rows = [
        {**common, "config": "pipeline_real_run", "real_tok_s": round(steady, 1), "peak_gib": round(peak_gib, 2),
         "describe": "train(): data path + prefetch, log every 10, checkpoint every 500, eval every 1000 "
                     "(steps 2..N)",
         "efficiency": round(steady / pure, 4), "run_tok_s": round(last["tokens_per_s"], 1),
         "outside_tok_s": round(counted / wall, 1), "agreement": round(last["tokens_per_s"] / (counted / wall), 4),
         "run_real_tokens": last["real_tokens"], "counted_tokens": counted, "wall_s": round(wall, 2),
         "seconds": {k: round(v, 2) for k, v in last["seconds"].items()}},
        {**common, "config": "pipeline_pure_steps", "real_tok_s": round(pure, 1), "peak_gib": None,
         "describe": "the same first batches on the GPU, steps back to back, no log/checkpoint/eval/loader (steps 2..N)",
         "real_tokens": pure_tokens, "seconds_timed": round(pure_s, 2), "steps": min(opts.pure_steps, opts.steps)},
    ]
    for row in rows:
        append_row(Path(opts.out), row)
        print(json.dumps(row))
    print(f"[pipeline] run: {last['seconds']}")
    print(f"[pipeline] steady {steady:,.0f} tok/s vs pure {pure:,.0f}: {100 * steady / pure:.1f}%; "
          f"run's own {last['tokens_per_s']:,.0f} vs outside clock {counted / wall:,.0f} "
          f"({100 * (last['tokens_per_s'] / (counted / wall) - 1):+.2f}%), tokens {last['real_tokens']} vs {counted}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
