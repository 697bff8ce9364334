"""The memory model (gapless.meter.memory) against the peaks `gapless bench` measured: predicted vs measured.

    python bench/memory_check.py [--results bench/results.jsonl] [--run-id ID]

For every gapless row with a measured peak (torch.cuda.max_memory_allocated) and a fused loss, the prediction for
its model (bench/models/<model>/config.json), method, LoRA r and targets, dtype, tokens per batch, activation
checkpointing, compile and loss chunk, compared with `allocated_gib` (the prediction without the allocator
reserve, which max_memory_allocated does not count). Rows from before the loss chunk was recorded ran at 4096.
The issue's target: within 10% for 1B/3B/8B x LoRA/QLoRA/full. Known outliers: run s3-grouped's best_grouped and
fa4op_grouped ran 20 of 28 layers eager (bench/RESULTS.md), which the all-compiled prediction here reads as -15.8%
(meter/memory.py's docstring predicts them as partly eager: +1.2%).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gapless.config import ALL_LINEAR
from gapless.meter.memory import estimate_memory
from gapless.model.loading import read_model_args

MODELS = Path(__file__).resolve().parent / "models"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", default=str(Path(__file__).resolve().parent / "results.jsonl"))
    p.add_argument("--run-id", default=None)
    opts = p.parse_args(argv)
    print(f"{'run':<28} {'model':<14} {'config':<22} {'method':<6} {'tokens':>7} {'measured':>9} {'predicted':>9} "
          f"{'error':>7}")
    worst = 0.0
    for line in Path(opts.results).read_text().splitlines():
        row = json.loads(line)
        recipe = row.get("recipe") or {}
        if (row.get("system") != "gapless" or not row.get("peak_gib") or row.get("error")
                or (opts.run_id and row["run_id"] != opts.run_id) or not recipe.get("loss", "").startswith("fused")
                or not (MODELS / row["model"]).is_dir()):
            continue
        lora = row.get("lora") or {}
        method = row.get("method", "lora")
        est = estimate_memory(read_model_args(MODELS / row["model"]), method, tokens=row["tokens_per_batch"],
                              dtype=row.get("dtype", "bfloat16"), lora_r=lora.get("r", 16),
                              lora_targets=lora.get("targets", ALL_LINEAR),
                              activation_checkpointing=int(recipe.get("checkpoint", False)),
                              compiled=recipe.get("compile", False), loss_chunk=recipe.get("loss_chunk", 4096),
                              lora_dropout=lora.get("dropout") or 0.0, lora_kernel=recipe.get("lora_kernel", "concat"))
        error = est.allocated_gib / row["peak_gib"] - 1
        worst = max(worst, abs(error))
        print(f"{row['run_id']:<28} {row['model']:<14} {row['config']:<22} {method:<6} {row['tokens_per_batch']:>7} "
              f"{row['peak_gib']:>9.2f} {est.allocated_gib:>9.2f} {100 * error:>+6.1f}%")
    print(f"largest error: {100 * worst:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
