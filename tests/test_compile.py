"""torch.compile giving up on frames is seen, not silent: the counter, the loop's warning and metrics record, the
report's finding. On the H200 a per-layer guard put 20 of 28 compiled layers on eager and made the step 24% longer
(bench/RESULTS.md, run s3-grouped) with nothing in the run's output but one log line of dynamo's."""
import json

import pytest
import torch
from torch import nn

import gapless.train.assemble as assemble
import gapless.train.loop as loop
from gapless import demo_task
from gapless.config import load_config
from gapless.demo import write_base_model
from gapless.meter.report import findings, read_run
from gapless.train.compile import frames_not_compiled

SCALES: dict[int, float] = {}


class PerInstance(nn.Module):
    """A layer whose forward reads a value keyed by its own id(): dynamo guards on it, one graph per instance."""

    def __init__(self, scale: float, keyed: bool):
        super().__init__()
        SCALES[id(self)] = scale
        self.scale, self.keyed = scale, keyed

    def forward(self, x):
        return x * (SCALES[id(self)] if self.keyed else 2.0)


@pytest.mark.parametrize("keyed", [True, False])
def test_frames_not_compiled_counts_a_recompile_limit_hit(keyed):
    torch._dynamo.reset()
    layers = [PerInstance(2.0, keyed) for _ in range(4)]
    for layer in layers:
        layer.compile(backend="eager")
    before = frames_not_compiled()
    with torch._dynamo.config.patch(recompile_limit=2):
        outs = [layer(torch.ones(3)) for layer in layers]
    assert all(torch.equal(out, torch.full((3,), 2.0)) for out in outs)  # eager or not, the same numbers
    assert (frames_not_compiled() - before > 0) == keyed


def test_the_loop_warns_and_records_eager_frames(tmp_path, monkeypatch):
    """compile: true with a dynamo that gives up on 3 frames in the first step (the counter faked, the layers
    left eager): a warning, a {"kind": "compile"} record in metrics.jsonl, and a finding in the report."""
    write_base_model(tmp_path / "base", seed=0)
    demo_task.write_jsonl(demo_task.make_examples(40, seed=1), tmp_path / "train.jsonl")
    counts = iter([0, 3])
    monkeypatch.setattr(loop, "frames_not_compiled", lambda: next(counts, 3))
    monkeypatch.setattr(assemble, "compile_layers", lambda model, options=None: model)
    cfg = load_config(data={
        "model": {"path": str(tmp_path / "base"), "dtype": "float32", "device": "cpu", "compile": True},
        "data": {"sources": [{"path": str(tmp_path / "train.jsonl")}], "max_seq_len": 64, "tokens_per_batch": 128,
                 "cache_dir": str(tmp_path / "cache"), "num_workers": 0},
        "lora": {"r": 4, "alpha": 8}, "train": {"steps": 2, "log_every": 1},
        "output_dir": str(tmp_path / "run"), "progress": False})
    with pytest.warns(UserWarning, match="torch.compile gave up on 3 frame"):
        loop.train(cfg)
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    compile_records = [r for r in records if r.get("kind") == "compile"]
    assert [(r["step"], r["frames_not_compiled"]) for r in compile_records] == [(1, 3)]
    causes = [f.cause for f in findings(read_run(tmp_path / "run"))]
    assert "compiled layers partly eager" in causes


def test_compile_layers_keeps_inductor_caches_in_gaplesss_cache_folder(monkeypatch, tmp_path):
    from gapless.train.compile import COMPILE_CACHE, use_compile_cache

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert use_compile_cache() == COMPILE_CACHE.expanduser()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # the user's choice wins
    assert use_compile_cache() == tmp_path
    # importing torch._dynamo (gapless's attention module does, through torch.compiler.disable) writes torch's own
    # default, /tmp/torchinductor_USER, into the variable on torch 2.13: that is not the user's choice
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    assert use_compile_cache() == COMPILE_CACHE.expanduser()


@pytest.mark.parametrize("has_prefetch", [True, False])
def test_compile_layers_starts_torchs_source_hash_in_the_background(monkeypatch, has_prefetch):
    """compile_layers (before the weights load) starts inductor's torch_key: through its prefetch where torch has
    one, else in a thread of its own; the layers are compiled lazily, so nothing else has run it yet."""
    import threading

    from torch._inductor import codecache

    from gapless.model.decoder import CausalLM
    from gapless.model.loading import model_args_from_config
    from gapless.train.compile import compile_layers

    ran = threading.Event()
    started = []

    def key():
        started.append(threading.current_thread().name)
        ran.set()
        return b"key"

    if has_prefetch:
        key.prefetch = lambda: started.append("prefetch")
    monkeypatch.setattr(codecache, "torch_key", key)
    args = model_args_from_config(dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))
    compile_layers(CausalLM(args), backend="eager")
    if has_prefetch:
        assert started == ["prefetch"]
    else:
        assert ran.wait(10) and started == ["gapless-torch-key"]


def test_the_first_layer_call_waits_for_the_background_source_hash(monkeypatch):
    """Without torch_key.prefetch (torch 2.11) the hash runs in a thread and torch's cache has no lock: the first
    layer call, which compiles, waits for the thread rather than hashing a second time beside it."""
    import threading

    from torch._inductor import codecache

    import gapless.train.compile as compile_module
    from gapless.model.decoder import CausalLM
    from gapless.model.loading import model_args_from_config

    order = []
    release = threading.Event()

    def key():
        release.wait(10)
        order.append("key")
        return b"key"

    def settings(compiled):
        return lambda *args, **kwargs: order.append("layer")

    monkeypatch.setattr(codecache, "torch_key", key)
    monkeypatch.setattr(compile_module, "compile_settings", settings)
    args = model_args_from_config(dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    model = compile_module.compile_layers(CausalLM(args), backend="eager")
    threading.Timer(0.2, release.set).start()
    model.model.layers[0]._compiled_call_impl()
    model.model.layers[0]._compiled_call_impl()
    assert order == ["key", "layer", "layer"]


def test_compile_layers_passes_inductors_options_this_torch_knows(monkeypatch):
    """compile_layers' `options` (the bench's Recipe.inductor) reach torch.compile for every layer, without the
    names this torch's inductor does not have (torch.compile would refuse them), which a warning names; none given:
    no options."""
    from torch import nn

    from gapless.model.decoder import CausalLM
    from gapless.model.loading import model_args_from_config
    from gapless.train.compile import compile_layers

    seen = []
    monkeypatch.setattr(nn.Module, "compile", lambda self, **kwargs: seen.append(kwargs))
    args = model_args_from_config(dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    with pytest.warns(UserWarning, match=r"\['no_such_inductor_option'\] are not known to torch"):
        compile_layers(CausalLM(args), {"max_pointwise_cat_inputs": 0, "no_such_inductor_option": 1})
    assert seen == [{"dynamic": True, "options": {"max_pointwise_cat_inputs": 0}}] * 2
    seen.clear()
    compile_layers(CausalLM(args))
    assert seen == [{"dynamic": True}] * 2


def test_cache_counts_tell_a_cold_compile_from_a_warm_one(monkeypatch, tmp_path):
    """The startup record's compile_caches: misses the first time a graph compiles into an empty cache folder, hits
    when the same graph compiles again (a second run, here after dynamo's reset)."""
    from torch._dynamo.utils import counters

    from gapless.train.compile import cache_counts

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))

    def compile_once() -> dict:
        torch._dynamo.reset()
        counters.clear()
        f = torch.compile(lambda x: (x.cos() * 3).sum())
        f(torch.randn(8, requires_grad=True)).backward()
        return cache_counts()

    cold, warm = compile_once(), compile_once()
    assert cold.get("fxgraph_cache_miss", 0) > 0 and "fxgraph_cache_hit" not in cold
    assert warm.get("fxgraph_cache_hit", 0) > 0 and "fxgraph_cache_miss" not in warm
    assert warm.get("autograd_cache_hit", 0) > 0
    torch._dynamo.reset()


def test_one_graph_per_distinct_layer_whatever_the_depth():
    """A compiled Llama compiles one training graph for all its layers, at 2 layers as at 4: layer 0 too (its input,
    the frozen embedding's output, is made to need a gradient, as the others' do); evaluation (no autograd) adds one
    more, shared by every layer."""
    from torch._dynamo.utils import counters

    from gapless.config import LoraConfig
    from gapless.model.decoder import CausalLM
    from gapless.model.loading import model_args_from_config
    from gapless.model.lora import apply_lora
    from gapless.train.compile import compile_layers

    graphs = {}
    for layers in (2, 4):
        args = model_args_from_config(dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2))
        torch._dynamo.reset()
        counters.clear()
        model = compile_layers(apply_lora(CausalLM(args), LoraConfig(r=4)), backend="eager")
        assert model.loss_step == "auto"  # the Triton kernel on CUDA, the compiled step here (gapless.kernels.loss)
        model.loss_step = "eager"  # the loss's own compiled step is not a layer's
        ids, targets = torch.randint(0, 64, (2, 1, 10), generator=torch.Generator().manual_seed(0))
        model(ids, targets=targets).backward()
        train = counters["stats"]["unique_graphs"]
        with torch.no_grad():
            model(ids, targets=targets)
        graphs[layers] = (train, counters["stats"]["unique_graphs"] - train)
        assert frames_not_compiled() == 0
    assert graphs[2] == graphs[4] == (1, 1), graphs


def test_evaluation_graphs_compile_when_the_first_evaluation_needs_them(tmp_path, monkeypatch):
    """With compile on and held-out data, nothing is evaluated before step 1 (start-up): the evaluation graphs
    compile in the first evaluation, at train.eval_every."""
    write_base_model(tmp_path / "base", seed=0)
    demo_task.write_jsonl(demo_task.make_examples(80, seed=1), tmp_path / "train.jsonl")
    monkeypatch.setattr(assemble, "compile_layers", lambda model, options=None: model)  # the order of calls is what is tested
    steps_done, evaluated_after = [0], []
    step, evaluate = loop.train_step, loop.evaluate

    def counted_step(*args, **kwargs):
        steps_done[0] += 1
        return step(*args, **kwargs)

    def recorded_evaluate(*args):
        evaluated_after.append(steps_done[0])
        return evaluate(*args)

    monkeypatch.setattr(loop, "train_step", counted_step)
    monkeypatch.setattr(loop, "evaluate", recorded_evaluate)
    cfg = load_config(data={
        "model": {"path": str(tmp_path / "base"), "dtype": "float32", "device": "cpu", "compile": True},
        "data": {"sources": [{"path": str(tmp_path / "train.jsonl")}], "max_seq_len": 64, "tokens_per_batch": 128,
                 "cache_dir": str(tmp_path / "cache"), "num_workers": 0, "eval_fraction": 0.1},
        "lora": {"r": 4, "alpha": 8}, "train": {"steps": 3, "log_every": 1, "eval_every": 2},
        "output_dir": str(tmp_path / "run"), "progress": False})
    loop.train(cfg)
    assert evaluated_after == [2, 3]  # at eval_every, and the final evaluation


def test_a_compiled_llama_traces_its_one_layer_graph_once_with_floats_constant():
    """The first training step of a compiled Llama on packed rows through a varlen custom op (the GPU's graph: no
    graph break) traces the layers' one graph once: no restart of dynamo's analysis, whose first attempt costs every
    start a second trace and an AOTAutograd cache miss, and no Python float (eps, LoRA's scaling, the attention
    scale) turned into a graph input. A second batch with another document layout compiles nothing."""
    from test_kernels_attention import reference_backward, reference_forward

    from gapless.config import LoraConfig
    from gapless.kernels.attention import op_attention, varlen_attention_op
    from gapless.model.decoder import CausalLM
    from gapless.model.loading import model_args_from_config
    from gapless.model.lora import apply_lora
    from gapless.train.compile import compile_layers

    calls = []

    def recording(gm, example_inputs):
        calls.append([x for x in example_inputs if isinstance(x, torch.Tensor) and x.dtype == torch.float64])
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    args = model_args_from_config(dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2))
    torch._dynamo.reset()
    model = compile_layers(apply_lora(CausalLM(args), LoraConfig(r=4)), backend=recording)
    model.loss_step = "eager"  # the loss's own compiled step is not a layer's
    model.attn_fn = op_attention("ref_op", varlen_attention_op("test_reference", reference_forward, reference_backward))
    gen = torch.Generator().manual_seed(0)
    for lengths in ([7, 2, 11], [3, 14, 1, 2]):
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        ids, targets = torch.randint(0, 64, (2, 1, sum(lengths)), generator=gen)
        model(ids, cu_seqlens=cu, max_seqlen=max(lengths), targets=targets).backward()
    assert frames_not_compiled() == 0
    assert calls == [[]], calls  # one graph for every layer, traced once
    torch._dynamo.reset()


def test_graphs_with_our_autograd_functions_hit_aotautograds_cache(monkeypatch, tmp_path):
    """A compiled graph holding a custom autograd.Function (lora.kernel concat's) bypasses AOTAutograd's cache
    unless compile_settings is around the call: a warm start then traces the joint graph again. With it, the
    second compile of the same graph is a hit."""
    from torch._dynamo.utils import counters

    from gapless.train.compile import cache_counts, compile_settings

    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))

    def compile_twice(wrap) -> list[dict]:
        runs = []
        for _ in range(2):
            torch._dynamo.reset()
            counters.clear()
            f = wrap(torch.compile(lambda x: Double.apply(x.sin()).sum()))
            f(torch.randn(8, requires_grad=True)).backward()
            runs.append(cache_counts())
        return runs

    plain = compile_twice(lambda f: f)
    assert plain[1].get("autograd_cache_bypass", 0) > 0 and "autograd_cache_hit" not in plain[1]
    cold, warm = compile_twice(compile_settings)
    assert "autograd_cache_bypass" not in cold and cold.get("autograd_cache_miss", 0) > 0
    assert warm.get("autograd_cache_hit", 0) > 0 and "autograd_cache_bypass" not in warm
    torch._dynamo.reset()


def test_a_run_without_compile_keeps_the_triton_loss_step_on_cuda_only(monkeypatch):
    """model.compile false: the loss's Triton step (it needs no torch.compile) on CUDA where triton imports, the
    eager step elsewhere, never torch.compile's; assemble puts on the model what uncompiled_loss_step says for its
    device."""
    import gapless.kernels.loss as loss_mod
    import gapless.train.compile as compile_mod
    from gapless.config import LoraConfig
    from gapless.model.decoder import CausalLM, ModelArgs
    from gapless.model.method import Lora

    for triton, device, step in ((True, "cuda", "triton"), (False, "cuda", "eager"), (True, "cpu", "eager")):
        monkeypatch.setattr(loss_mod, "TRITON", triton)  # whether triton imports, as resolve_step reads it
        assert compile_mod.uncompiled_loss_step(torch.device(device)) == step
    asked = []
    monkeypatch.setattr(assemble, "uncompiled_loss_step", lambda device: asked.append(device) or "triton")
    args = ModelArgs(model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    with torch.device("meta"):
        model = CausalLM(args)
    tensors = assemble.random_tensors(model, torch.device("cpu"), torch.float32)
    model = assemble.assemble(model, Lora(LoraConfig(r=2)), torch.device("cpu"), torch.float32, tensors=tensors)
    assert model.loss_step == "triton" and asked == [torch.device("cpu")]
