"""What each configuration keeps for backward: activation bytes saved per decoder layer, and the step's peak.

    python bench/saved_bytes.py --model bench/models/llama-3.1-8b --tokens 8192 --config qlora_best,qlora_ckpt,best

The architecture truncated to --layers decoder layers (random weights, assembled as `gapless bench` assembles it,
compiled where the recipe compiles), one packed batch of --tokens tokens from --lengths. During the forward a
saved-tensors hook adds up every tensor autograd keeps that is not a parameter's or a buffer's own storage (those
cost nothing extra); divided by the layers, that is the per-layer activation cost the memory model
(gapless.meter.memory) predicts. On CUDA the step's max_memory_allocated above the model's own memory comes with
it. One JSON line per configuration. Written to find why a compiled QLoRA layer kept its dequantised weights
(the bf16 W saved: ~2 B per base weight per layer) and whether checkpointing takes effect under compile.
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from gapless.bench import CONFIGS, build_model, lengths_mixture, take_batches
from gapless.data.batching import BatchSampler
from gapless.model.loading import read_model_args
from gapless.train.step import loss_sum


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a folder with the architecture's config.json")
    p.add_argument("--config", default="best", help="comma-separated gapless bench configurations")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--layers", type=int, default=2, help="decoder layers kept (the per-layer cost is what matters)")
    p.add_argument("--lengths", default=None, help="document lengths file; default: 512-token documents")
    p.add_argument("--attn", default=None, help="override the recipe's attention backend (sdpa on the CPU)")
    opts = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    full = read_model_args(opts.model)
    args = dataclasses.replace(full, num_hidden_layers=opts.layers, sliding_window=full.sliding_window[:opts.layers])
    if opts.lengths:
        mix = lengths_mixture(opts.lengths, args.vocab_size, min(4096, opts.tokens))
    else:
        import tempfile
        from pathlib import Path
        f = Path(tempfile.mkdtemp()) / "lengths.txt"
        f.write_text(" ".join(["512"] * (4 * opts.tokens // 512)))
        mix = lengths_mixture(f, args.vocab_size, min(4096, opts.tokens))
    for name in opts.config.split(","):
        recipe = CONFIGS[name] if opts.attn is None else dataclasses.replace(CONFIGS[name], attn=opts.attn)
        sampler = BatchSampler(mix, strategy=recipe.batching, max_seq_len=min(4096, opts.tokens), tokens_per_batch=opts.tokens, seed=0)
        batch = take_batches(sampler, 1, device)[0][0]
        model, _ = build_model(args, recipe, device, dtype)
        owned = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        saved: list[int] = []

        def pack(t: torch.Tensor):
            if t.untyped_storage().data_ptr() not in owned:
                saved.append(t.numel() * t.element_size())
            return t

        for attempt in range(2):  # the first call compiles; the second is measured
            saved.clear()
            if device.type == "cuda":
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = loss_sum(model, batch)
            loss.backward()
            model.zero_grad(set_to_none=True)
        row = {"config": name, "model": opts.model, "layers": opts.layers, "tokens": batch.num_real_tokens,
               "saved_mib_per_layer": round(sum(saved) / opts.layers / 2**20, 2), "saved_tensors": len(saved)}
        if device.type == "cuda":
            row["step_peak_above_model_gib"] = round((torch.cuda.max_memory_allocated() - base) / 2**30, 3)
        print(json.dumps(row), flush=True)
        del model
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
