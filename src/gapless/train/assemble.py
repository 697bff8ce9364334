"""Model assembly, in the one order every method and every number of GPUs needs (gapless ARCHITECTURE.md):

    build on the meta device (no memory)  ->  the method's transform (LoRA / QLoRA / full)
    ->  activation checkpointing  ->  compile (per decoder layer)  ->  shard (FSDP2; gapless.train.parallel)
    ->  load weights: stream the safetensors through the method's per-tensor hook (QLoRA quantises there)
    ->  the method initialises what the checkpoint does not hold (LoRA's A and B)  ->  DDP (needs materialised
        parameters: it broadcasts rank 0's)

Transforms run before any weight exists, so none of them copies a weight: QLoRA never holds a bf16 model, and
a sharded model never holds an unsharded one. `gapless bench` assembles its random-weight models through the
same function (`tensors`: random values in place of the checkpoint's).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from gapless.model.decoder import CausalLM
from gapless.model.loading import load_weights, resolve_dtype
from gapless.model.method import Method
from gapless.train.ckpt_activations import checkpoint_activations
from gapless.train.compile import compile_layers, uncompiled_loss_step
from gapless.train.parallel import Dist, parallelize


def assemble(model: CausalLM, method: Method, device: torch.device, dtype: torch.dtype | str, *,
             activation_checkpointing: int = 0, compile: bool = False, compile_options: dict | None = None,
             tensors: Iterable[tuple[str, torch.Tensor]] | None = None, parallel: Dist | None = None) -> CausalLM:
    """The model built on meta (gapless.model.loading.build), transformed, then loaded; in training mode.
    `parallel`: this rank's place in a torchrun run (gapless.train.parallel.init_distributed); None: one process.
    `compile_options`: inductor's settings for the compiled layers (compile_layers)."""
    assert all(p.is_meta for p in model.parameters()), "assemble takes the model as built, on the meta device"
    model = method.transform(model)
    if activation_checkpointing:
        model = checkpoint_activations(model, every=activation_checkpointing)
    if compile:
        model = compile_layers(model, compile_options)
    else:
        model.loss_step = uncompiled_loss_step(device)
    placement = parallelize(model, method, parallel, device, resolve_dtype(dtype, model.config_dict))  # FSDP2 here
    model = load_weights(model, dtype, device, hook=placement.load_hook, tensors=tensors)
    model = placement.initialise(model)
    unloaded = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not unloaded, f"tensors neither loaded nor initialised: {unloaded[:5]}"
    return placement.finish(model).train()  # DDP here


def random_tensors(model: CausalLM, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """(key, tensor) for every checkpoint tensor with transformers' init (normal, std 0.02; norms 1; biases 0),
    drawn on `device`: what a benchmark loads in place of weights on disk (random weights do the same work)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    for key, shape in model.checkpoint_shapes.items():
        tensor = torch.empty(shape, device=device, dtype=dtype)
        if key.endswith("norm.weight"):
            tensor.fill_(1.0)
        elif key.endswith(".bias"):
            tensor.zero_()
        else:
            tensor.normal_(0.0, 0.02, generator=gen)  # transformers' initializer_range
        yield key, tensor
