"""Attention kernels compiled in a second process while the weights load (gapless.train.warm_attention): the child
process makes the model's attention calls, the registered op waits for it once before its first call, a failed or
overlong warm-up costs only its time, and a run with one trains as without it. CPU: the child runs the reference."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gapless.data.batching import made_up_packed_batch
from gapless.kernels.attention import (compiles_at_first_call, get_attention, op_attention, sdpa_reference,
                                       varlen_attention_op, wait_before_first_call, warm_kernels)
from gapless.train import warm_attention
from gapless.train.loop import train
from gapless.train.warm_attention import WarmUp
from test_kernels_attention import _backend_or_skip, cuda, packed, reference_backward, reference_forward
from test_loop import base, run_config, uninterrupted  # noqa: F401 (fixtures)

SPEC = {"backend": "sdpa", "rows": 2, "seq_len": 16, "dtype": "float32", "device": "cpu", "head_dim": 8,
        "heads": 4, "kv_heads": 2, "layers": [[None, 0.35], [4, 0.35], [None, 0.35]]}


def test_warm_kernels_calls_each_distinct_window_once_forward_and_backward():
    """warm_kernels makes one forward and backward per distinct (window, scale) of the layers, in their first
    order, and leaves the global RNG as it was."""
    seen = []

    def recorded(q, k, v, *, sliding_window, scale, **kwargs):
        seen.append((sliding_window, scale, q.requires_grad))
        out = sdpa_reference(q, k, v, sliding_window=sliding_window, scale=scale, **kwargs)
        out.register_hook(lambda grad: seen.append("backward"))
        return out

    assert not compiles_at_first_call(recorded) and not compiles_at_first_call(get_attention("sdpa"))
    q, k = torch.randn(2, 16, 4, 8), torch.randn(2, 16, 2, 8)
    cu = torch.tensor([0, 8, 16, 24, 32], dtype=torch.int32)
    state = torch.get_rng_state()
    calls = warm_kernels(recorded, q, k, k, cu, 8, [(4, 0.5), (None, 0.5), (4, 0.5), (None, 0.5)],
                         generator=torch.Generator().manual_seed(0))
    assert calls == 2 and seen == [(4, 0.5, True), "backward", (None, 0.5, True), "backward"]
    assert torch.equal(torch.get_rng_state(), state)


def test_the_op_runs_each_wait_once_before_its_next_call():
    """wait_before_first_call's waits run inside the registered op, once each, before the call that comes first
    (here the forward), and not again; the op's result is unchanged."""
    fn = op_attention("ref_op", varlen_attention_op("test_reference", reference_forward, reference_backward))
    order = []
    wait_before_first_call(fn, lambda: order.append("wait 1"))
    wait_before_first_call(fn, lambda: order.append("wait 2"))
    q, k, v, cu, m = packed([[5, 11], [16]], 16, 4, 2, 8, seed=0)
    for _ in range(2):
        out = fn(q, k, v, cu_seqlens=cu, max_seqlen=m, scale=0.35)
        order.append("call")
    assert order == ["wait 1", "wait 2", "call", "call"]
    torch.testing.assert_close(out, sdpa_reference(q, k, v, cu_seqlens=cu, max_seqlen=m, scale=0.35))


def test_the_warm_up_process_makes_the_models_attention_calls():
    """`python -m gapless.train.warm_attention SPEC` runs the spec's backend on the made-up layout, one forward and
    backward per distinct window, and exits 0; run() in this process says the same count."""
    assert warm_attention.run(SPEC) == 2
    done = subprocess.run([sys.executable, "-m", "gapless.train.warm_attention", json.dumps(SPEC)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "warmed 2 forward and backward call(s)" in done.stdout


def test_a_failed_or_overlong_warm_up_only_warns(tmp_path, monkeypatch, capsys):
    """A warm-up that exits non-zero is reported with its log and marked not ok; one past WAIT_S is ended; both
    hand on_done their seconds and return, so the run's own first call compiles as without one."""
    done = []
    failing = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    WarmUp(failing, tmp_path / "a.log", done.append).wait()
    assert "failed (exit 3)" in capsys.readouterr().err and done[0].ok is False and done[0].seconds >= 0

    monkeypatch.setattr(warm_attention, "WAIT_S", 0.5)
    sleeping = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    start = time.perf_counter()
    WarmUp(sleeping, tmp_path / "b.log", done.append).wait()
    assert time.perf_counter() - start < 30 and sleeping.poll() is not None
    assert "ran past" in capsys.readouterr().err and done[1].ok is False


def test_a_run_starts_the_warm_up_before_the_load_and_waits_for_it(base, uninterrupted, monkeypatch):
    """A backend whose kernels compile at their first call (flash-attn-4; here a stand-in over the reference that
    runs its waits as the registered op does) gets a warm-up process, started before the weights load and waited
    for at the model's first attention call, where it has ended (exit 0); its log and seconds are in the run folder
    and the startup record, and the losses equal the uninterrupted run's (the run's random stream is its own).
    None is started where the backend's kernel cache already holds compiled kernels, or with
    GAPLESS_WARM_ATTENTION=0."""
    import gapless.model.decoder as decoder
    import gapless.train.assemble as assemble_mod

    calls, waits, ended, times = [], [], [], {}

    def first_call_compiles(q, k, v, **kwargs):
        while waits:
            waits.pop(0)()
        calls.append(time.perf_counter())
        return sdpa_reference(q, k, v, **kwargs)

    first_call_compiles.kernel_cache = base["root"] / "no_kernels"  # compiles at its first call, nothing cached yet
    first_call_compiles.first_call_waits = waits
    wait, assemble = WarmUp.wait, assemble_mod.assemble

    def recorded_wait(self):
        wait(self)
        ended.append((self.started, self.process.returncode))

    def timed_assemble(*args, **kwargs):
        model = assemble(*args, **kwargs)
        times["model_end"] = time.perf_counter()
        return model

    monkeypatch.setattr(decoder, "get_attention", lambda backend: first_call_compiles)
    monkeypatch.setattr(WarmUp, "wait", recorded_wait)
    monkeypatch.setattr(assemble_mod, "assemble", timed_assemble)
    result = train(run_config(base, "warm_attention"))
    assert len(ended) == 1 and ended[0][1] == 0 and ended[0][0] < times["model_end"] < calls[0]
    assert "warmed 1 forward and backward call(s)" in (result.run_dir / warm_attention.LOG).read_text()
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert next(r for r in records if r.get("kind") == "startup")["overlapped"]["attention"] > 0
    assert result.losses == uninterrupted.losses

    # a kernel cache that already holds compiled kernels (a machine's later runs): no warm-up
    first_call_compiles.kernel_cache = base["root"] / "kernels"
    (first_call_compiles.kernel_cache / "fwd").mkdir(parents=True)
    (first_call_compiles.kernel_cache / "fwd" / "key.o").write_bytes(b"")
    cached = train(run_config(base, "warm_attention_cached"))
    assert not (cached.run_dir / warm_attention.LOG).exists() and len(ended) == 1 and not waits

    first_call_compiles.kernel_cache = base["root"] / "no_kernels"
    monkeypatch.setenv(warm_attention.OFF, "0")
    off = train(run_config(base, "warm_attention_off"))
    assert not (off.run_dir / warm_attention.LOG).exists() and len(ended) == 1 and not waits


FA4_SECOND_PROCESS = """
import os, sys, torch
from test_kernels_attention import packed
from gapless.kernels.attention import get_attention
cached = lambda: sum(len(files) for _, _, files in os.walk(sys.argv[1]))
before = cached()
attn = get_attention("fa4_op")
q, k, v, cu, m = packed([[1, 700, 37, 129, 300, 2], [1024, 5, 900]], 2048, 8, 2, 128, device="cuda",
                        dtype=torch.bfloat16, seed=1)
leaves = [t.detach().requires_grad_() for t in (q, k, v)]
attn(*leaves, cu_seqlens=cu, max_seqlen=m, scale=0.088).backward(torch.randn_like(q))
torch.cuda.synchronize()
print("cached", before, cached())
"""


@pytest.mark.gpu
@cuda
def test_fa4_kernels_warmed_in_a_second_process_are_the_ones_a_run_loads(tmp_path):
    """What the warm-up process compiles (fa4_op on the made-up packed layout, flash-attn-4's disk cache on) is what
    a real batch's forward and backward need in another process: that one finds every kernel in the disk cache and
    compiles (exports) none."""
    _backend_or_skip("fa4_op")
    env = {**os.environ, "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": str(tmp_path / "fa4"),
           "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    spec = {"backend": "fa4_op", "rows": 2, "seq_len": 2048, "dtype": "bfloat16", "device": "cuda",
            "head_dim": 128, "heads": 8, "kv_heads": 2, "layers": [[None, 0.088]] * 3}
    done = subprocess.run([sys.executable, "-m", "gapless.train.warm_attention", json.dumps(spec)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    second = subprocess.run([sys.executable, "-c", FA4_SECOND_PROCESS, str(tmp_path / "fa4")],
                            capture_output=True, text=True, timeout=600, env=env)
    assert second.returncode == 0, second.stderr[-2000:]
    before, after = map(int, second.stdout.split("cached", 1)[1].split())
    assert before > 0 and after == before, second.stdout


def test_made_up_layout_is_the_spec_rows():
    """The child's layout: the run's rows of seq_len slots, cu_seqlens over all of them."""
    layout = made_up_packed_batch(SPEC["rows"], SPEC["seq_len"], 2)
    assert int(layout.cu_seqlens[-1]) == SPEC["rows"] * SPEC["seq_len"]
