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
    monkeypatch.setattr(assemble, "compile_layers", lambda model: model)
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
