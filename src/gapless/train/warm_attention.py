"""Attention kernels that compile at their first call (flash-attn-4's CuTe DSL kernels), compiled in a second process
while this one loads the weights and compiles its layers.

Why: a cold start-up of the example 3B config spent about 10 s of its first step compiling flash-attn-4's forward
and backward (30.5 s of warm-up, 20.4 of it inductor's, run s19-startup2 on an H100). The same compile in a thread
beside the load took those seconds off the first step but the load grew by as much (runs s20-startup and
s20-startup2; flash-attn-4's compile is mostly Python, which a thread runs under the interpreter lock the loading
threads need). A second process has its own interpreter. It writes the kernels to flash-attn-4's disk cache
(kernels.attention.fa4_disk_cache, on in both processes), and this process's first call loads them from there.

    start(...)  in gapless train's setup, after the model is built on meta and before its weights load: launches
                `python -m gapless.train.warm_attention SPEC`, one forward and backward per distinct (sliding
                window, scale) of the layers on random q, k, v of the made-up packed batch's layout (the run's rows
                of data.max_seq_len slots; kernels.attention.warm_kernels), and has the backend's first real call
                wait for it (kernels.attention.wait_before_first_call): the two processes never compile the same
                kernel at once.

Only for a single process with such a backend (kernels.attention.compiles_at_first_call: flash-attn-4 with its disk
cache on, so a CUDA device); under torchrun each rank would start one. Not where that cache already holds compiled
kernels (a machine's later runs: a warm start loads them in about 1 s, run s21-startup, while the child would
keep the first call waiting for its own imports and CUDA start); a new model's shapes after another's then compile
at the first step, as without the warm-up. GAPLESS_WARM_ATTENTION=0 turns it off. A warm-up that fails or runs
past WAIT_S costs nothing but its time: the run's own first call compiles, as without it, and the error is in the
run folder's attention_warmup.log.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

OFF = "GAPLESS_WARM_ATTENTION"  # "0": no warm-up process
LOG = "attention_warmup.log"  # in the run folder
WAIT_S = 300.0  # the longest the first attention call waits for it; a cold flash-attn-4 compile takes about 10 s


class WarmUp:
    """The warm-up process, and its wall time once waited for (`seconds`)."""

    def __init__(self, process: subprocess.Popen, log: Path, on_done=None):
        self.process, self.log, self.on_done = process, log, on_done
        self.started = time.perf_counter()
        self.seconds: float | None = None
        self.waited: float | None = None  # what the first call waited for it
        self.ok: bool | None = None

    def wait(self) -> None:
        """Wait for the process (at most WAIT_S from its start, then end it); a failure is a warning."""
        begin = time.perf_counter()
        try:
            code = self.process.wait(timeout=max(0.0, WAIT_S - (begin - self.started)))
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
            print(f"gapless: the attention kernels' warm-up ran past {WAIT_S:.0f} s and was ended; the first "
                  f"step compiles them (see {self.log})", file=sys.stderr)
        else:
            if code != 0:
                print(f"gapless: the attention kernels' warm-up failed (exit {code}); the first step compiles "
                      f"them (see {self.log})", file=sys.stderr)
        now = time.perf_counter()
        self.ok, self.seconds, self.waited = code == 0, now - self.started, now - begin
        if self.on_done is not None:
            self.on_done(self)


def spec(model, rows: int, seq_len: int, dtype: torch.dtype, device: torch.device) -> dict:
    """What the warm-up process needs to make the model's attention calls (JSON)."""
    args = model.args
    return {"backend": model.attn_backend, "rows": rows, "seq_len": seq_len, "dtype": str(dtype).split(".")[-1],
            "device": str(device), "head_dim": args.head_dim, "heads": args.num_attention_heads,
            "kv_heads": args.num_key_value_heads,
            "layers": [[layer.self_attn.sliding_window, layer.self_attn.scale] for layer in model.model.layers]}


def kernels_cached(attn_fn) -> bool:
    """Whether the kernel cache of a backend that compiles at its first call already holds compiled kernels (*.o)."""
    folder = Path(attn_fn.kernel_cache)
    return folder.is_dir() and next(folder.rglob("*.o"), None) is not None


def start(model, data, dtype: torch.dtype, device: torch.device, run_dir: Path, on_done=None) -> WarmUp | None:
    """The warm-up process for `model`'s attention (module docstring), or None where its backend compiles nothing
    at a first call, its kernel cache already holds kernels, or GAPLESS_WARM_ATTENTION=0. `data`: the DataConfig
    (rows of max_seq_len slots; 1 row where tokens_per_batch is still "auto"). on_done(warm_up) runs once it was
    waited for."""
    from gapless.kernels.attention import compiles_at_first_call, wait_before_first_call

    if os.environ.get(OFF) == "0" or not compiles_at_first_call(model.attn_fn) or kernels_cached(model.attn_fn):
        return None
    rows = data.tokens_per_batch // data.max_seq_len if isinstance(data.tokens_per_batch, int) else 1
    log = run_dir / LOG
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-m", "gapless.train.warm_attention",
                                    json.dumps(spec(model, rows, data.max_seq_len, dtype, device))],
                                   stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    warm_up = WarmUp(process, log, on_done)
    wait_before_first_call(model.attn_fn, warm_up.wait)
    return warm_up


def run(spec: dict) -> int:
    """The warm-up itself (the child process): returns the number of forward and backward calls made."""
    from gapless.data.batching import made_up_packed_batch
    from gapless.kernels.attention import get_attention, warm_kernels

    device, dtype = torch.device(spec["device"]), getattr(torch, spec["dtype"])
    attn_fn = get_attention(spec["backend"])
    layout = made_up_packed_batch(spec["rows"], spec["seq_len"], 2)
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(spec["rows"], spec["seq_len"], heads, spec["head_dim"], device=device, dtype=dtype,
                           generator=gen) for heads in (spec["heads"], spec["kv_heads"], spec["kv_heads"]))
    return warm_kernels(attn_fn, q, k, v, layout.cu_seqlens.to(device), layout.max_seqlen,
                        [tuple(layer) for layer in spec["layers"]], generator=gen)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    begin = time.perf_counter()
    calls = run(json.loads(argv[0]))
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the kernels ran, not only queued
    print(f"warmed {calls} forward and backward call(s) in {time.perf_counter() - begin:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
