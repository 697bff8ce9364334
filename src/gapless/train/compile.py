"""torch.compile as a model transform: each decoder layer compiled in place."""
from __future__ import annotations

from torch import nn


def compile_layers(model: nn.Module, **compile_kwargs) -> nn.Module:
    """torch.compile every decoder layer in place (nn.Module.compile keeps the HF parameter names).

    Layers share one code object and, with dynamo's inlining of nn.Modules, one compiled graph: compiling
    each block rather than the whole model (torchtitan's choice) compiles one layer, not 28, and keeps the
    embedding, the loss and the layer loop eager. Two variants in fact: layer 0's input (the frozen embedding's
    output) needs no gradient, the others' do.

    dynamic=True (the default here): packed batches change cu_seqlens' length (documents + 1) and max_seqlen (a
    host int) every batch. Static shapes would compile once, then again for both once they change (dynamo's
    automatic dynamic shapes): two full compiles per variant. Symbolic from the start, it is one; the weights stay
    static (force_parameter_static_shapes), so the matmuls and the reductions over the hidden size keep fixed sizes.
    """
    compile_kwargs.setdefault("dynamic", True)
    for layer in model.model.layers:
        layer.compile(**compile_kwargs)
    return model
