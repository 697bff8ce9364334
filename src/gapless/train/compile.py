"""torch.compile as a model transform: each decoder layer compiled in place, and the loss's per-chunk step made
fast (the Triton kernel on CUDA, torch.compile elsewhere)."""
from __future__ import annotations

import functools
import os
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from gapless.kernels.loss import resolve_step

# Inductor's FX-graph and AOTAutograd caches (on by default in torch >= 2.6) live in TORCHINDUCTOR_CACHE_DIR, else
# /tmp/torchinductor_USER, which a reboot empties. gapless keeps them beside its token cache, so a second run of the
# same model compiles from the cache: on the H200 the example 3B config's start-up fell from 70.8 to 63.6 s with
# the cache warm (bench/RESULTS.md, fourth round). A TORCHINDUCTOR_CACHE_DIR the user set wins.
COMPILE_CACHE = Path("~/.cache/gapless/compile")


def use_compile_cache(folder: Path = COMPILE_CACHE) -> Path:
    """Point inductor's caches at `folder` unless the user chose a folder; returns the folder in use."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
        torchs_own = os.path.abspath(default_cache_dir())
    except ImportError:  # a torch without it (pyproject allows 2.5) does not write the variable itself
        torchs_own = None
    # torch 2.13 writes its own default into the variable when torch._dynamo is imported (torch._dynamo.package's
    # DynamoCache; gapless's attention module imports it through torch.compiler.disable): that value is not a choice
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen is None or os.path.abspath(chosen) == torchs_own:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder.expanduser())
    return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])


def prefetch_torch_key() -> Callable[[], None]:
    """Start inductor's hash of torch's own sources (codecache.torch_key, part of every cache key) in the background,
    so it runs while the weights load instead of inside the first compile: a cold start-up of the example 3B config
    spent 5.4 s in it on a fresh H100 machine (run s19-startup2), 0.25 s on this repository's CPU box with torch's
    files in the page cache. Where torch has torch_key.prefetch (2.13 does) its own worker runs it and a caller waits
    for it; elsewhere a daemon thread fills torch_key's cache the same way.

    Returns what to call before the first compile: the thread's join. torch 2.11's torch_key cache has no lock, so a
    compile that asked while the thread still hashed would hash torch's sources a second time beside it."""
    from torch._inductor import codecache

    key = codecache.torch_key
    if hasattr(key, "prefetch"):
        key.prefetch()
        return lambda: None
    thread = threading.Thread(target=key, name="gapless-torch-key", daemon=True)
    thread.start()
    return thread.join


def after(first: Callable[[], None], fn: Callable) -> Callable:
    """`fn`, calling `first` once before its first call."""
    pending = [first]

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if pending:
            pending.pop()()
        return fn(*args, **kwargs)

    return call


def compile_layers(model: nn.Module, options: dict | None = None, **compile_kwargs) -> nn.Module:
    """torch.compile every decoder layer in place (nn.Module.compile keeps the HF parameter names).

    Layers share one code object and, with dynamo's inlining of nn.Modules, one compiled graph: compiling
    each block rather than the whole model (torchtitan's choice) compiles one layer, not 28, and keeps the
    embedding, the loss and the layer loop eager. One graph for training, not two: layer 0's input (the frozen
    embedding's output) would need no gradient where the others' do, a second forward and backward to compile;
    `layer_input_grad` makes it need one (CausalLM.hidden_states says what that costs). Evaluation (no autograd)
    compiles one more, when the first evaluation runs.

    dynamic=True (the default here): packed batches change cu_seqlens' length (documents + 1) and max_seqlen (a
    host int) every batch. Static shapes would compile once, then again for both once they change (dynamo's
    automatic dynamic shapes): two full compiles per variant. Symbolic from the start, it is one; the weights stay
    static (force_parameter_static_shapes), so the matmuls and the reductions over the hidden size keep fixed sizes.

    `options`: inductor's settings for the layers' graphs (torch.compile's options; the benchmarks' A/B of a
    setting, gapless.bench's Recipe.inductor), those this torch does not know left out with a warning (torch.compile
    would refuse them: torch 2.11 has no max_complex_pointwise_cat_inputs).
    """
    compile_kwargs.setdefault("dynamic", True)
    if options:
        import torch._inductor.config as inductor_config

        known = {k: v for k, v in options.items() if hasattr(inductor_config, k)}
        if len(known) < len(options):
            warnings.warn(f"inductor settings {sorted(options.keys() - known.keys())} are not known to torch "
                          f"{torch.__version__}; the layers compile without them")
        if known:
            compile_kwargs["options"] = known
    use_compile_cache()
    key_ready = prefetch_torch_key()  # compile_layers runs before the weights load (gapless.train.assemble)
    for layer in model.model.layers:
        layer.compile(**compile_kwargs)
        layer._compiled_call_impl = compile_settings(layer._compiled_call_impl)
    # the first compile happens inside layer 0's first call; evaluation's compiles come later still
    first = model.model.layers[0]
    first._compiled_call_impl = after(key_ready, first._compiled_call_impl)
    # the fused loss's per-chunk softmax/gradient step (gapless.kernels.loss): the Triton kernel on CUDA where triton
    # imports, torch.compile of the step elsewhere
    model.loss_step = "auto"
    model.layer_input_grad = True
    return model


def uncompiled_loss_step(device: torch.device) -> str:
    """The fused loss's per-chunk step where the layers run eager (model.compile false): the Triton kernel on CUDA
    where triton imports, which needs no torch.compile (the whole fused loss of 16,384 tokens against Llama 3's
    head: 42.1 ms against the eager step's 69.2 on an H100, bench/kernels_h100_s16.jsonl), else the eager step: a
    run told not to compile compiles nothing."""
    step = resolve_step("auto", device)  # the rule of where the Triton step runs, kept in gapless.kernels.loss
    return step if step == "triton" else "eager"


def compile_settings(compiled: Callable) -> Callable:
    """`compiled` with two of torch.compile's settings on while it runs, set and restored around each call (7 us on
    the 2-core CPU, once per layer per forward) rather than for the process: torch reads them only when it compiles
    a frame, which happens inside the call.

    dynamo's specialize_float: it traces the layers' Python floats (RMSNorm's eps, LoRA's scaling, the attention
    scale) as constants. With dynamic=True dynamo (torch >= 2.6, specialize_float False) makes every float a graph
    input, a float64 scalar tensor; the attention scale, an argument of the varlen custom op, cannot stay one, so
    dynamo restarts the first layer's analysis with it specialized: a second trace and an AOTAutograd cache miss
    (that first attempt's key is never saved) on every start, cold or warm. Measured on the CPU (bench/RESULTS.md,
    eighth round): the first step's compile 9.5 -> 5.0 s warm, 55.6 -> 41.5 s cold. The floats are the same in
    every layer, so specialising them adds no graph.

    AOTAutograd's autograd_cache_allow_custom_autograd_functions: without it a graph holding a custom
    autograd.Function (lora.kernel concat's and concat_b's, gapless.kernels.lora) bypasses AOTAutograd's cache, so
    every warm start traced the joint graph again (the H100's warm start: create_aot_dispatcher_function 4.8 s,
    compile caches {'autograd_cache_bypass': 1}, bench/RESULTS.md thirteenth round). torch leaves it off for
    Functions in general; the cache key is dynamo's graph, which holds these Functions' forward and backward as
    traced subgraphs, so a change to either changes the key. Measured on the 2-core CPU (`bench/startup_gpu.py
    --tiny --compile`, one run each): warm start 30.7 -> 28.3 s, its caches 4 hits and 3 bypasses -> 7 hits."""
    import torch._dynamo.config
    import torch._functorch.config

    settings = [(config, name) for config, name in ((torch._dynamo.config, "specialize_float"),
                                                     (torch._functorch.config,
                                                      "autograd_cache_allow_custom_autograd_functions"))
                if hasattr(config, name)]  # a torch without one of them does without it
    if not settings:
        return compiled

    @functools.wraps(compiled)
    def call(*args, **kwargs):
        before = [getattr(config, name) for config, name in settings]
        for config, name in settings:
            setattr(config, name, True)
        try:
            return compiled(*args, **kwargs)
        finally:
            for (config, name), value in zip(settings, before):
                setattr(config, name, value)

    return call


def frames_not_compiled() -> int:
    """Frames torch.compile has given up on in this process (dynamo's counters): each runs eager from then on.

    The usual cause is dynamo's recompile limit (torch._dynamo.config.recompile_limit, 8): code that guards on
    something that differs per layer (a module's id(), a per-layer Python attribute) compiles one graph per
    layer, and past the limit the remaining layers run eager, silently but for one log line. Measured on the
    H200: 20 of Llama-3.2-3B's 28 layers eager made the step 24% longer (586 vs 472 ms; bench/RESULTS.md, s3-grouped).
    """
    from torch._dynamo.utils import counters

    frames = counters["frames"]
    return int(frames["total"] - frames["ok"])


def not_compiled_message(count: int) -> str:
    return (f"torch.compile gave up on {count} frame(s), which run eager (a recompile limit or an error it fell "
            "back from): the compiled layers are partly eager. TORCH_LOGS=recompiles,graph_breaks shows why.")


def cache_counts() -> dict[str, int]:
    """How this process's compiles used torch's caches: inductor's FX-graph cache and AOTAutograd's cache, hits,
    misses and bypasses, and the kernels inductor built (dynamo's counters; empty where they are absent). A warm
    start whose compiles still take long reads here whether the caches were hit."""
    from torch._dynamo.utils import counters

    # async_compile: the generated kernels (Triton on a GPU) built in this process (miss) or found already built
    names = {"inductor": ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass",
                          "async_compile_cache_hit", "async_compile_cache_miss"),
             "aot_autograd": ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass")}
    return {name: int(counters[group][name]) for group, keys in names.items() for name in keys
            if counters[group][name]}


def compile_seconds() -> float:
    """Seconds torch.compile has spent compiling in this process: dynamo's own timer of each frame's compile
    (`_compile.compile_inner`: tracing, AOTAutograd, inductor's code generation or its cache load; the backward
    graph too, which torch 2.13 compiles with the forward). A backward compiled lazily at its first call would be
    missed; 0.0 where this private timer is absent."""
    from torch._dynamo.utils import compilation_time_metrics

    return float(sum(compilation_time_metrics.get("_compile.compile_inner", [])))


def compile_phases(top: int = 8) -> dict[str, float]:
    """Seconds by phase of this process's compiles, the `top` longest (dynamo's timers, summed over frames: tracing,
    AOTAutograd, inductor's code generation, its cache loads, the C++/Triton builds). Timers nest, so the phases
    overlap; they say where a slow compile, warm or cold, spends its time. Empty where the private timers are absent."""
    from torch._dynamo.utils import compilation_time_metrics

    totals = {name: round(sum(times), 3) for name, times in compilation_time_metrics.items()
              if name != "_compile.compile_inner"}  # the whole, compile_seconds
    return dict(sorted(totals.items(), key=lambda kv: -kv[1])[:top])
