"""What torch.compile compiles for a training run's first step, and how long it takes cold and warm, on the CPU.

    python bench/compile_probe.py [--layers 2] [--cache DIR]

A tiny Llama (hidden 64, LoRA r=4 on all 7 projections, float32) with its decoder layers compiled as `gapless
train` compiles them (gapless.train.compile.compile_layers: inductor, dynamic shapes), on packed rows through a
varlen custom op, so the graphs are the GPU's (the CPU's own "sdpa" backend reads cu_seqlens on the host: a graph
break in every layer, 16 frames for 2 layers). The op runs plain-PyTorch attention one document at a time. Two
training steps of different document layouts, then one evaluation forward (no autograd), in two processes: cold
(an empty TORCHINDUCTOR_CACHE_DIR) and warm (the same folder).
Prints one JSON line per process: step 1's seconds and torch.compile's part of them, dynamo's frames and graphs,
the caches' hits and misses, the longest compile phases, and the graphs the second step and the evaluation added.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

T0 = time.perf_counter()


def reference_op():
    """The varlen custom op over plain-PyTorch attention, one document at a time, forward and backward: the
    reference of tests/test_kernels_attention.py (as tests/test_compile.py uses it)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_kernels_attention import reference_backward, reference_forward

    from gapless.kernels.attention import op_attention, varlen_attention_op

    return op_attention("probe_ref", varlen_attention_op("probe_reference", reference_forward, reference_backward))


def probe(layers: int) -> dict:
    import torch
    from torch._dynamo.utils import counters

    from gapless.config import LoraConfig
    from gapless.model.decoder import CausalLM
    from gapless.model.loading import model_args_from_config
    from gapless.model.lora import apply_lora
    from gapless.train import compile as compiling
    from gapless.train.compile import cache_counts, compile_layers, compile_seconds

    imports = time.perf_counter() - T0
    args = model_args_from_config(dict(model_type="llama", vocab_size=1024, hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                       tie_word_embeddings=True))
    torch.manual_seed(0)
    model = compile_layers(apply_lora(CausalLM(args), LoraConfig(r=4)))
    model.attn_fn = reference_op()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    def forward(lengths: list[int]):
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        ids, targets = torch.randint(0, args.vocab_size, (2, 1, sum(lengths)))
        return model(ids, cu_seqlens=cu, max_seqlen=max(lengths), targets=targets) / sum(lengths)

    def train_step(lengths: list[int]) -> float:
        t = time.perf_counter()
        forward(lengths).backward()
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - t

    step1 = train_step([100, 60, 96])
    after1 = dict(frames=dict(counters["frames"]), graphs=counters["stats"]["unique_graphs"],
                  compile_s=round(compile_seconds(), 2), caches=cache_counts(),
                  phases=compiling.compile_phases() if hasattr(compiling, "compile_phases") else {})  # older trees
    train_step([30, 200, 20, 6])
    graphs2 = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        forward([40, 24])
    return {"imports_s": round(imports, 2), "step1_s": round(step1, 2), **after1,
            "graph_breaks": sum(counters["graph_break"].values()),
            "step2_new_graphs": graphs2 - after1["graphs"],
            "eval_new_graphs": counters["stats"]["unique_graphs"] - graphs2}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--cache", type=Path, default=None, help="the compile cache folder (emptied first; default a "
                                                            "temporary one)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.child:
        print(json.dumps(probe(opts.layers)), flush=True)
        return 0
    cache = opts.cache or Path(tempfile.mkdtemp(prefix="gapless-probe-"))
    shutil.rmtree(cache, ignore_errors=True)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1] / "src"),
                                                       os.environ.get("PYTHONPATH")]))}
    for run in ("cold", "warm"):
        t = time.perf_counter()
        out = subprocess.run([sys.executable, __file__, "--child", "--layers", str(opts.layers)], env=env,
                             capture_output=True, text=True, check=True).stdout
        row = {"run": run, "process_s": round(time.perf_counter() - t, 2), **json.loads(out.splitlines()[-1])}
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
