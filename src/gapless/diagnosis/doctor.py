"""`gapless doctor [CONFIG | RUN]`: the pre-flight checklist, automated, with numbers.

Every check returns Findings: an id (`env.tf32`, `cfg.checkpoint`), a severity (ok, info, warning, error), what
was found, the predicted cost (share of throughput or minutes of the run) and the fix as a config line or a
command. Environment checks read `environment_record()` (gapless.diagnosis.environment), so a test can hand
any machine's record to them; config checks read the typed config, the run's data and a predicted step time.
On a CPU-only machine the GPU checks say "no GPU" and the rest run. Exit code 1 when any finding is an error.

Costs quoted below come from measurements in bench/RESULTS.md (one H200) unless a formula is given.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

from gapless.config import RunConfig

SEVERITIES = ("ok", "info", "warning", "error")

# `gapless gap` on the H200 (bench/RESULTS.md, Llama-3.2-1B, 16,384 tokens per step): logging every step cost 583
# of 55,735 tok/s = 1.05%; each log is one host sync, so the cost falls as 1 / log_every.
LOG_SYNC_SHARE = 583 / 55_735
# bench/RESULTS.md run 20261203T105024Z-h200: packed_fused 23,823 tok/s eager vs packed_fused_compile 32,979
# compiled: without compile a run reaches 72% of the compiled rate.
EAGER_SHARE = 23_823 / 32_979
# flash-attn-4 behind torch custom ops against torch's varlen, README (Llama-3.2-3B, H200): 36,400 vs 34,100 tok/s.
FA4_GAIN = 36_400 / 34_100 - 1
# LoRA dropout 0.05 on Llama-3.2-3B, H100, run s11-default2 (bench/RESULTS.md, ninth round): torch's dropout 31,534
# tok/s at 56.9 GiB, the fused kernels (lora.fused_dropout) 32,419 at 46.9 GiB
TORCH_DROPOUT_COST = 1 - 31_534 / 32_419
TORCH_DROPOUT_GIB = 56.9 - 46.9
# activation checkpointing recomputes each layer's forward in backward. LoRA: forward 2 FLOPs per frozen weight per
# token, backward 2 more (gapless.meter.flops) -> 4 becomes 6: 1 - 4/6 = 33% of throughput. Full fine-tuning:
# 6 -> 8: 25%.
RECOMPUTE_COST = {"lora": 1 - 4 / 6, "qlora": 1 - 4 / 6, "full": 1 - 6 / 8}
# dense matmul rate of fp32 without TF32 against TF32 on Ampere/Hopper (A100 datasheet: 19.5 vs 156 TFLOP/s;
# H100 SXM: 67 vs 494): float32 matmuls run at 1/8 of the TF32 rate.
FP32_VS_TF32 = 19.5 / 156
# bf16 against TF32 dense (H100 SXM datasheet: 989 vs 494): a float32 model's matmuls run at half the bf16 rate
TF32_VS_BF16 = 494 / 989
PADDING_NOISE = 0.02  # a batching that pads 2 points more than packing would is worth a warning
CHECKPOINT_SHARE = 0.01  # a checkpoint interval whose stalls cost more than 1% of the run gets a fix
WRITE_PROBE_BYTES = 64 << 20  # bytes written (and fsynced) to measure the output folder's write speed
# What the loop waits for at an async checkpoint is the device-to-host copy, at the rate checkpoint.every auto
# assumes too (gapless.train.checkpoint_interval.HOST_COPY_GBS); the background write overlaps training. LoRA
# checkpoints are tens of MB (3B r16: 24.3 M float32 x 3 = 292 MB), so the figure matters little.

# NCCL variables a user sets, what each does; the ones that turn a fast path off are warnings
NCCL_VARS = {
    "NCCL_P2P_DISABLE": ("turns off peer-to-peer (NVLink/PCIe) transfers between GPUs: traffic goes through "
                         "host memory, several times slower", True),
    "NCCL_IB_DISABLE": ("turns off InfiniBand/RoCE: nodes talk over TCP sockets", True),
    "NCCL_SHM_DISABLE": ("turns off shared-memory transport between processes of one node", True),
    "NCCL_NVLS_ENABLE": ("NVLink SHARP (in-switch reduction on NVSwitch systems); 0 turns it off", False),
    "NCCL_DEBUG": ("logging level; INFO prints the topology NCCL found (useful once), TRACE slows every call", False),
    "NCCL_SOCKET_IFNAME": ("which network interface the bootstrap and socket transport use", False),
    "NCCL_ALGO": ("forces the all-reduce algorithm (Ring, Tree, NVLS...); NCCL's own choice is usually faster", False),
    "NCCL_PROTO": ("forces the protocol (LL, LL128, Simple); NCCL's own choice is usually faster", False),
    "NCCL_BUFFSIZE": ("per-channel buffer size; larger can help large messages on slow links", False),
    "NCCL_NET_GDR_LEVEL": ("when GPUDirect RDMA is used between NIC and GPU", False),
    "NCCL_CUMEM_ENABLE": ("NCCL's cuMem-based buffers", False),
    "NCCL_ASYNC_ERROR_HANDLING": ("old name of TORCH_NCCL_ASYNC_ERROR_HANDLING (tear down on a failed collective)",
                                  False),
}


@dataclass
class Finding:
    id: str
    severity: str  # ok | info | warning | error
    detail: str  # what was found, with numbers
    cost: str = ""  # predicted cost: share of throughput or minutes of the run; "" when none
    fix: str = ""  # a config line or a command

    def __post_init__(self):
        assert self.severity in SEVERITIES, self.severity


def _f(id: str, severity: str, detail: str, cost: str = "", fix: str = "") -> list[Finding]:
    return [Finding(id, severity, detail, cost, fix)]


def _gpus(env: dict) -> list[dict]:
    return env["gpu"]["gpus"]


NO_GPU = "no GPU"


# ---------------------------------------------------------------------------------------------
# environment checks: f(env record, cfg or None) -> findings


def check_python(env: dict, cfg=None) -> list[Finding]:
    major, minor = map(int, env["python"].split(".")[:2])
    if (major, minor) < (3, 10):
        return _f("env.python", "error", f"Python {env['python']}; gapless needs 3.10 or newer (pyproject.toml)",
                  fix="python3.12 -m venv .venv && . .venv/bin/activate && pip install -e .")
    return _f("env.python", "ok", f"Python {env['python']}")


def tested_ranges() -> dict[str, str]:
    """The version ranges gapless declares (pyproject.toml: dependencies and the test extra), by package."""
    import importlib.metadata

    try:
        reqs = importlib.metadata.requires("gapless") or []
    except importlib.metadata.PackageNotFoundError:
        return {}
    from packaging.requirements import Requirement

    out = {}
    for line in reqs:
        r = Requirement(line)
        if r.name in ("torch", "transformers", "peft") and str(r.specifier):
            out[r.name] = str(r.specifier)
    return out


def check_versions(env: dict, cfg=None, ranges: dict[str, str] | None = None) -> list[Finding]:
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    ranges = tested_ranges() if ranges is None else ranges
    if not ranges:
        return _f("env.versions", "info", "gapless is not installed as a package (PYTHONPATH): its tested version "
                  "ranges are unknown here", fix="pip install -e .")
    out = []
    for name, spec in sorted(ranges.items()):
        have = env["packages"].get(name)
        if have is None:
            severity = "info" if name == "peft" else "error"  # peft is only for loading adapters elsewhere
            out += _f(f"env.version.{name}", severity, f"{name} is not installed (gapless is tested with {spec})",
                      fix=f"pip install '{name}{spec}'")
            continue
        try:
            inside = Version(have.split("+")[0]) in SpecifierSet(spec)
        except InvalidVersion:
            inside = False
        out += _f(f"env.version.{name}", "ok" if inside else "warning",
                  f"{name} {have}" + ("" if inside else f", outside the range gapless is tested with ({spec})"),
                  "" if inside else "untested: results and speed may differ",
                  "" if inside else f"pip install '{name}{spec}'")
    return out


def check_gpu(env: dict, cfg=None) -> list[Finding]:
    g = env["gpu"]
    if not g["cuda_available"]:
        hidden = env["env"].get("CUDA_VISIBLE_DEVICES")
        if g.get("nvidia_smi") and hidden is not None and hidden.strip() in ("", "-1"):
            return _f("env.cuda", "info", f"{NO_GPU}: CUDA_VISIBLE_DEVICES={hidden!r} hides the GPUs; GPU checks are "
                      "skipped", fix="unset CUDA_VISIBLE_DEVICES to train on the GPUs")
        if g.get("nvidia_smi"):
            return _f("env.cuda", "error", f"nvidia-smi is present but torch {env['packages'].get('torch')} sees no "
                      "CUDA device (a CPU build of torch, or a driver older than its CUDA)",
                      "the run would train on the CPU", "install the torch build for the CUDA version nvidia-smi "
                      "shows (pytorch.org/get-started/locally), e.g. pip install torch --index-url "
                      "https://download.pytorch.org/whl/cu128")
        return _f("env.cuda", "info", f"{NO_GPU}: torch {env['packages'].get('torch')}, CUDA not available; "
                  "GPU checks are skipped and runs train on the CPU")
    names = ", ".join(f"{x['name']} ({x['memory_gib']:.0f} GiB, sm{x['capability']})" for x in _gpus(env))
    return _f("env.cuda", "ok", f"{len(_gpus(env))} GPU(s): {names}; torch CUDA {g['torch_cuda']}, driver "
              f"{g.get('driver') or 'unknown (no nvidia-ml-py)'}, cuDNN {g.get('cudnn')}, NCCL {g.get('nccl')}")


def check_bf16(env: dict, cfg: RunConfig | None = None) -> list[Finding]:
    if not env["gpu"]["cuda_available"]:
        return _f("env.bf16", "info", NO_GPU)
    gpu = _gpus(env)[0]
    major = int(gpu["capability"].split(".")[0])
    dtype = cfg.model.dtype if cfg else "bfloat16"
    if major < 8 and dtype == "bfloat16":
        return _f("env.bf16", "error", f"{gpu['name']} (sm{gpu['capability']}) has no bf16 tensor cores; "
                  "model.dtype is bfloat16", "bf16 matmuls emulated: several times slower",
                  "model.dtype: float16 (a GPU of compute capability 8.0+ runs bf16)")
    return _f("env.bf16", "ok", f"bf16 {'supported' if major >= 8 else 'not supported, not used'} "
              f"(sm{gpu['capability']})")


def check_tf32(env: dict, cfg: RunConfig | None = None) -> list[Finding]:
    if not env["gpu"]["cuda_available"]:
        return _f("env.tf32", "info", f"{NO_GPU}: TF32 applies to NVIDIA GPUs of compute capability 8.0+")
    flags = env["torch_flags"]
    on = flags["tf32_matmul"] or flags["float32_matmul_precision"] in ("high", "medium")
    dtype = cfg.model.dtype if cfg else "bfloat16"
    detail = (f"TF32 matmul {'on' if on else 'off'} (float32_matmul_precision {flags['float32_matmul_precision']}), "
              f"cuDNN TF32 {'on' if flags['tf32_cudnn'] else 'off'}")
    if dtype == "float32" and not on:
        return _f("env.tf32", "warning", detail + "; model.dtype is float32",
                  f"float32 matmuls run at {FP32_VS_TF32:.1%} of the TF32 rate (A100: 19.5 vs 156 TFLOP/s)",
                  "model.dtype: bfloat16 (or torch.set_float32_matmul_precision('high'); `gapless compare-precision` "
                  "shows what TF32 does to the loss)")
    return _f("env.tf32", "ok" if dtype != "float32" else "info",
              detail + ("" if dtype == "float32" else f"; model.dtype {dtype}: the matmuls do not use TF32"))


def check_determinism(env: dict, cfg=None) -> list[Finding]:
    flags = env["torch_flags"]
    if flags["deterministic_algorithms"] or flags["cudnn_deterministic"]:
        return _f("env.determinism", "warning", "deterministic algorithms are forced (torch.use_deterministic_"
                  "algorithms or cudnn.deterministic)", "not predicted: slower kernels where a deterministic one "
                  "exists, errors where none does", "remove torch.use_deterministic_algorithms(True) / "
                  "CUBLAS_WORKSPACE_CONFIG from the launch script")
    return _f("env.determinism", "ok", "no deterministic-algorithm flags")


def check_nccl(env: dict, cfg=None) -> list[Finding]:
    if not env["gpu"]["cuda_available"]:
        return _f("env.nccl", "info", f"{NO_GPU}: NCCL is for GPUs (multi-process CPU runs use gloo)")
    n = len(_gpus(env))
    return _f("env.nccl", "ok" if env["gpu"].get("nccl") else "warning",
              f"NCCL {env['gpu'].get('nccl') or 'not in this torch build'}; {n} GPU(s)"
              + (f"; measure the link: gapless doctor --nccl (torchrun --nproc-per-node {n})" if n > 1 else ""))


def check_kernels(env: dict, cfg: RunConfig | None = None) -> list[Finding]:
    out = []
    backend = cfg.model.attn_backend if cfg else "auto"
    for name, status in sorted(env["kernels"].items()):
        ok = status == "ok"
        if name == "flash-attn-4":
            if not ok and backend == "fa4_op":
                out += _f("env.kernel.flash-attn-4", "error", f"model.attn_backend is {backend} but flash-attn-4 "
                          f"does not import ({status})", "the run stops at the first layer",
                          "install flash-attn-4 (shared/peers/README.md) or model.attn_backend: auto")
            elif not ok and env["gpu"]["cuda_available"]:
                out += _f("env.kernel.flash-attn-4", "info", f"flash-attn-4 not importable ({status})",
                          f"{FA4_GAIN:.1%} of throughput (fa4_op vs varlen, Llama-3.2-3B on an H200)",
                          "pip install 'gapless[gpu]' (flash-attn-4); model.attn_backend: auto then runs fa4_op"
                          if backend == "auto" else "pip install 'gapless[gpu]' and set model.attn_backend: auto")
            else:
                out += _f("env.kernel.flash-attn-4", "ok" if ok else "info",
                          "flash-attn-4 imports" if ok else f"{NO_GPU}: flash-attn-4 not importable ({status})")
        elif name == "bitsandbytes":
            out += _f("env.kernel.bitsandbytes", "ok" if ok else "info",
                      "bitsandbytes imports" if ok else f"bitsandbytes not importable ({status}): gapless does not "
                      "need it for LoRA")
        else:
            out += _f(f"env.kernel.{name}", "ok" if ok else "info", f"{name} {'imports' if ok else 'not importable'}"
                      " (gapless's own kernels replace it; the HF+PEFT peer uses it)")
    return out


def check_workers(env: dict, cfg: RunConfig | None = None) -> list[Finding]:
    cpus = env["cpu_count"]
    workers = cfg.data.num_workers if cfg else None
    if workers is not None and workers > cpus:
        return _f("env.workers", "warning", f"data.num_workers {workers} tokenizer processes on {cpus} CPU cores",
                  "oversubscribed: tokenizing (a cold cache) runs slower than with one process per core",
                  f"data.num_workers: {cpus}")
    used = cpus if workers is None else workers
    quota = env.get("cpu_quota")
    capped = f" (a cgroup CPU quota of {quota:g} caps them)" if quota is not None and quota <= cpus else ""
    return _f("env.workers", "ok", f"{cpus} CPU cores{capped}, {used} tokenizer workers")


def measure_write_speed(folder: Path, nbytes: int = WRITE_PROBE_BYTES) -> float:
    """Bytes per second of writing and fsyncing `nbytes` into `folder` (a checkpoint's write, in miniature)."""
    folder.mkdir(parents=True, exist_ok=True)
    block = os.urandom(1 << 20)
    fd, name = tempfile.mkstemp(prefix=".doctor-write-", dir=folder)
    try:
        t0 = time.perf_counter()
        with os.fdopen(fd, "wb") as f:
            for _ in range(max(1, nbytes >> 20)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        return max(1, nbytes >> 20) * len(block) / (time.perf_counter() - t0)
    finally:
        os.unlink(name)


def checkpoint_bytes(cfg: RunConfig) -> int:
    """One checkpoint: the trainable tensors and AdamW's two moments, each in float32 (LoRA's adapters are float32:
    gapless.model.method.Lora), counted from the model's config.json."""
    from gapless.diagnosis.plan import trainable_params
    from gapless.model.loading import read_model_args
    from gapless.model.method import method_of

    return trainable_params(read_model_args(cfg.model.path), method_of(cfg).flops) * 4 * 3


def check_disk(folder: Path, need_bytes: int, write_bps: float | None) -> list[Finding]:
    usage = shutil.disk_usage(folder if folder.exists() else _existing_parent(folder))
    speed = f"; measured write {write_bps / 1e6:,.0f} MB/s (fsync)" if write_bps else ""
    need = f", the run needs about {_size(need_bytes)}" if need_bytes else ""
    detail = f"{folder}: {usage.free / 2**30:,.1f} GiB free{need}{speed}"
    if usage.free < need_bytes:
        return _f("env.disk", "error", detail, "the run fails when a checkpoint cannot be written",
                  "output_dir: a folder on a disk with room, or checkpoint.keep: 1")
    if usage.free < 2 * need_bytes:
        return _f("env.disk", "warning", detail, "less than twice what the run needs",
                  "free space or move output_dir")
    return _f("env.disk", "ok", detail)


def _existing_parent(path: Path) -> Path:
    path = path.resolve()
    while not path.exists():
        path = path.parent
    return path


def check_hf_offline(env: dict, cfg=None) -> list[Finding]:
    on = {k: v for k, v in env["env"].items() if k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")}
    if on:
        return _f("env.hf_offline", "info", f"{', '.join(f'{k}={v}' for k, v in on.items())}: gapless reads local "
                  "folders only, so this changes nothing for it (your own downloads fail while it is set)")
    return _f("env.hf_offline", "ok", "HF offline variables unset; gapless reads local folders and downloads "
              "nothing either way")


def parse_alloc_conf(text: str) -> dict[str, str]:
    out = {}
    for part in [p for p in text.split(",") if p.strip()]:
        key, _, value = part.partition(":")
        out[key.strip()] = value.strip()
    return out


def check_alloc_conf(env: dict, cfg=None) -> list[Finding]:
    text = env["env"].get("PYTORCH_CUDA_ALLOC_CONF") or env["env"].get("PYTORCH_ALLOC_CONF")
    if not text:
        return _f("env.alloc_conf", "ok" if env["gpu"]["cuda_available"] else "info",
                  ("PYTORCH_CUDA_ALLOC_CONF unset (the caching allocator's defaults)" if env["gpu"]["cuda_available"]
                   else f"{NO_GPU}: PYTORCH_CUDA_ALLOC_CONF unset"),
                  fix="" if not env["gpu"]["cuda_available"] else
                  "if memory is tight: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (less fragmentation)")
    conf = parse_alloc_conf(text)
    notes = []
    severity = "info"
    if conf.get("expandable_segments", "").lower() == "true":
        notes.append("expandable_segments on: fewer fragmentation OOMs")
    if "max_split_size_mb" in conf:
        notes.append(f"max_split_size_mb {conf['max_split_size_mb']}: blocks above it are never split (a "
                     "fragmentation workaround; expandable_segments is the newer fix)")
    if "garbage_collection_threshold" in conf:
        notes.append("garbage_collection_threshold: the allocator frees cached blocks early (extra cudaFree calls)")
    fraction = conf.get("per_process_memory_fraction")
    if fraction is not None and float(fraction) < 1:
        severity = "warning"
        notes.append(f"per_process_memory_fraction {fraction}: only that share of the GPU's memory is usable")
    return _f("env.alloc_conf", severity, f"PYTORCH_CUDA_ALLOC_CONF={text}: " + "; ".join(notes or ["set"]),
              f"{1 - float(fraction):.0%} of GPU memory unusable" if severity == "warning" else "",
              "unset per_process_memory_fraction" if severity == "warning" else "")


def check_launch_blocking(env: dict, cfg=None) -> list[Finding]:
    value = env["env"].get("CUDA_LAUNCH_BLOCKING", "")
    if value.strip() not in ("", "0"):
        gpu = env["gpu"]["cuda_available"]
        return _f("env.launch_blocking", "error" if gpu else "warning",
                  f"CUDA_LAUNCH_BLOCKING={value}: every kernel launch waits for the GPU to finish it (a debugging "
                  "setting)" + ("" if gpu else f"; {NO_GPU} here, but it carries over to a GPU launch"),
                  "the host can no longer queue work ahead: every launch gap is exposed (not predicted; "
                  "`gapless gap` measures it)", "unset CUDA_LAUNCH_BLOCKING")
    return _f("env.launch_blocking", "ok", "CUDA_LAUNCH_BLOCKING unset")


def check_memory_fraction(env: dict, cfg=None) -> list[Finding]:
    if not env["gpu"]["cuda_available"]:
        return _f("env.memory_fraction", "info", NO_GPU)
    low = [(g["index"], g["memory_fraction"]) for g in _gpus(env)
           if g.get("memory_fraction") is not None and g["memory_fraction"] < 1]
    if low:
        i, f = low[0]
        return _f("env.memory_fraction", "warning", f"GPU {i}: torch.cuda.set_per_process_memory_fraction({f:g})",
                  f"{1 - f:.0%} of its memory unusable: smaller batches or OOM",
                  "remove set_per_process_memory_fraction from the launch script")
    return _f("env.memory_fraction", "ok", "the whole GPU memory is usable")


def check_debug_vars(env: dict, cfg=None) -> list[Finding]:
    v = env["env"]
    found = []
    if v.get("TORCH_COMPILE_DISABLE", "") not in ("", "0") or v.get("TORCHDYNAMO_DISABLE", "") not in ("", "0"):
        found.append(("torch.compile disabled by the environment", f"{1 - EAGER_SHARE:.0%} of throughput "
                      "(compiled vs eager layers, H200)"))
    if v.get("TORCH_COMPILE_DEBUG", "") not in ("", "0"):
        found.append(("TORCH_COMPILE_DEBUG writes every graph to disk", "slower compiles"))
    if v.get("TORCH_LOGS"):
        found.append((f"TORCH_LOGS={v['TORCH_LOGS']}", "logging in compile and, for some artifacts, per step"))
    if v.get("NCCL_DEBUG", "").upper() == "TRACE":
        found.append(("NCCL_DEBUG=TRACE logs every collective", "every all-reduce is slowed by its logging"))
    if found:
        return _f("env.debug", "warning", "; ".join(d for d, _ in found), "; ".join(c for _, c in found),
                  "unset the debugging variables for a real run")
    return _f("env.debug", "ok", "no debugging variables set")


# The variables that turn a compile cache off, and what it then costs: the example 3B config's start-up on one H100
# (bench/RESULTS.md, sixteenth round): inductor 15.6-20.4 s cold against 2.5-2.7 s warm (s19-startup,
# s19-startup2); flash-attn-4's kernels ~8 s of a warm start-up without its disk cache (18.1 against 10.2 s)
CACHE_DISABLES = ("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "TORCH_COMPILE_FORCE_DISABLE_CACHES")  # off when "1"
CACHE_ENABLES = ("TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE",
                 "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED")  # set to anything but "1": off


def check_compile_caches(env: dict, cfg=None) -> list[Finding]:
    v = env["env"]
    off = ([k for k in CACHE_DISABLES if v.get(k, "").strip() == "1"]
           + [k for k in CACHE_ENABLES if k in v and v[k].strip() != "1"])
    if not off:
        return _f("env.compile_caches", "ok", "torch.compile's and flash-attn-4's caches on (gapless's defaults)")
    costs = []
    if any(k.startswith("TORCH") for k in off):
        costs.append("every start-up compiles from scratch: inductor 15.6-20.4 s cold against 2.5-2.7 s from the "
                     "cache (the example 3B config, one H100)")
    if "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED" in off:
        costs.append("flash-attn-4 compiles its kernels in every process: ~8 s of each start-up (18.1 against "
                     "10.2 s warm, the same config)")
    return _f("env.compile_caches", "warning", ", ".join(f"{k}={v[k]}" for k in off) + " turns a compile cache off",
              "; ".join(costs), "unset " + " ".join(off))


def check_nccl_vars(env: dict, cfg=None) -> list[Finding]:
    set_vars = {k: v for k, v in env["env"].items() if k.startswith("NCCL_") or k.startswith("TORCH_NCCL_")}
    if not set_vars:
        return _f("env.nccl_vars", "ok", "no NCCL variables set (NCCL's own tuning)")
    out = []
    for k, v in sorted(set_vars.items()):
        meaning, slows = NCCL_VARS.get(k, ("not one gapless knows; see NCCL's environment variable list", False))
        bad = slows and v.strip() not in ("0", "")
        out += _f(f"env.nccl_var.{k}", "warning" if bad else "info", f"{k}={v}: {meaning}",
                  "multi-GPU steps wait longer on gradient traffic (measure: gapless doctor --nccl)" if bad else "",
                  f"unset {k}" if bad else "")
    return out


def check_install(env: dict, cfg=None) -> list[Finding]:
    g = env["gapless"]
    commit = f"commit {g['commit'][:12]}{' with uncommitted changes' if g['dirty'] else ''}" if g["commit"] else \
        "no git commit (an installed package)"
    return _f("env.install", "info" if g["dirty"] else "ok", f"gapless {g['install']} from {g['path']}, {commit}")


ENV_CHECKS = (check_python, check_versions, check_gpu, check_bf16, check_tf32, check_determinism, check_nccl,
              check_kernels, check_workers, check_hf_offline, check_alloc_conf, check_launch_blocking,
              check_memory_fraction, check_debug_vars, check_compile_caches, check_nccl_vars, check_install)


# ---------------------------------------------------------------------------------------------
# config checks: f(cfg, facts) -> findings; facts are what the doctor measured or predicted


def _is_gpu(cfg: RunConfig, env: dict) -> bool:
    return env["gpu"]["cuda_available"] and cfg.model.device != "cpu"


def packing_fix(d) -> str:
    """The fix that packs `d` (a DataConfig), without data.rows_per_batch: packed rows hold many documents each and
    refuse it (the doctor's findings, gapless gap's waterfall)."""
    return "data.batching: packed" + ("  data.rows_per_batch: null" if d.rows_per_batch else "")


def check_batching(cfg: RunConfig, efficiencies: dict[str, float]) -> list[Finding]:
    """`efficiencies`: real tokens / slots of epoch 0 of the run's own data, per strategy (the configured one and
    packed at least)."""
    mine, packed = efficiencies[cfg.data.batching], efficiencies["packed"]
    pad = 1 - mine
    detail = f"data.batching {cfg.data.batching}: {pad:.1%} of the slots are padding on your data (packed: " \
             f"{1 - packed:.1%})"
    if cfg.data.batching != "packed" and packed - mine > PADDING_NOISE:
        return _f("cfg.batching", "warning", detail,
                  f"{1 - mine / packed:.0%} of throughput (compute spent on padding)", packing_fix(cfg.data))
    return _f("cfg.batching", "ok", detail)


def check_tokens_per_step(cfg: RunConfig, efficiency: float, gpus: int = 1) -> list[Finding]:
    """data.tokens_per_batch is the GLOBAL micro-batch: under torchrun its packed rows are dealt out over the GPUs
    (gapless.data.sharding.rank_tokens), so the global tokens per optimizer step = per-GPU slots x accumulation x
    GPUs = tokens_per_batch x accumulation, the same at any GPU count (and the same gradient, train/parallel.py)."""
    from gapless.data.batching import batch_slots
    from gapless.data.sharding import rank_tokens

    d = cfg.data
    slots = batch_slots(d.batching, d.tokens_per_batch, d.max_seq_len, d.rows_per_batch)
    k = cfg.train.grad_accum
    try:
        per_gpu = rank_tokens(d.batching, d.tokens_per_batch, d.max_seq_len, gpus)
    except ValueError as e:
        return _f("cfg.tokens_per_step", "error", f"{gpus} GPUs: {e}", "the run stops before its first step",
                  f"data.tokens_per_batch: {max(1, slots // (gpus * d.max_seq_len)) * gpus * d.max_seq_len:,}"
                  if d.batching == "packed" else packing_fix(d))
    per_gpu_slots = per_gpu if gpus > 1 else slots
    # padded batches of at most data.rows_per_batch documents fill tokens_per_batch only with long ones: their
    # tokens per step depend on the lengths, the documents do not
    capped = d.rows_per_batch and d.batching in ("padded", "length_grouped")
    per_step = (f"at most {per_gpu_slots * k * gpus:,} slots and {d.rows_per_batch * k * gpus:,} documents "
                f"(data.rows_per_batch {d.rows_per_batch:,} per micro-batch)" if capped else
                f"{per_gpu_slots * k * gpus:,} slots, about {per_gpu_slots * k * gpus * efficiency:,.0f} real tokens")
    detail = (f"global batch = {per_gpu_slots:,} slots per GPU x {k} accumulation x {gpus} GPU(s) = {per_step} "
              "per optimizer step" + (f" (data.tokens_per_batch {d.tokens_per_batch:,} is the global micro-batch, "
                                      f"split over the {gpus} GPUs)" if gpus > 1 else ""))
    if d.batching in ("packed", "pad_to_max") and d.tokens_per_batch % d.max_seq_len and \
            slots == d.tokens_per_batch // d.max_seq_len * d.max_seq_len:  # (no rows_per_batch below the budget)
        lost = 1 - slots / d.tokens_per_batch
        return _f("cfg.tokens_per_step", "warning", detail + f"; tokens_per_batch is not a multiple of max_seq_len "
                  f"{d.max_seq_len:,}: batches hold {slots:,} slots", f"{lost:.0%} of the batch budget unused",
                  f"data.tokens_per_batch: {max(d.max_seq_len, slots + d.max_seq_len):,}")
    return _f("cfg.tokens_per_step", "info", detail)


def resolve_auto_tokens(cfg: RunConfig, env: dict, args, gpus: int = 1) -> tuple[RunConfig, list[Finding]]:
    """cfg with data.tokens_per_batch "auto" replaced by a number the other checks can use, and a finding: on a
    GPU the batch finder's proposal by the memory model (gapless.meter.memory.auto_tokens); under torchrun (auto
    is refused there) and without a GPU (auto measures GPU memory) an error whose fix is the number assumed."""
    from dataclasses import replace

    d = cfg.data
    if d.tokens_per_batch != "auto":
        return cfg, []
    pick, where = 0, ""
    if _is_gpu(cfg, env) and args is not None:
        from gapless.meter.memory import auto_tokens, estimate_kwargs

        g = _gpus(env)[0]
        pick = auto_tokens(args, cfg.method, g["memory_gib"], d.max_seq_len, d.rows_per_batch,
                           **estimate_kwargs(cfg))
        where = f"{g['name']}'s {g['memory_gib']:.0f} GiB"
    if _is_gpu(cfg, env) and args is not None and not pick:
        resolved = d.max_seq_len
        found = _f("cfg.tokens_per_batch", "error", f"data.tokens_per_batch auto: not one row of "
                   f"{d.max_seq_len:,} tokens fits 90% of {where} by the memory model", "the run does not start",
                   "model.activation_checkpointing: 1, method: qlora, or FSDP2 over several GPUs (gapless plan)")
    elif pick and gpus == 1:
        resolved = pick
        found = _f("cfg.tokens_per_batch", "info", f"data.tokens_per_batch auto: the batch finder is predicted to "
                   f"pick ~{pick:,} tokens per micro-batch on {where} (90% of it by the memory model, less 10%); the "
                   "checks below use that number, the run measures its own")
    else:
        rows = min(16384 // d.max_seq_len, d.rows_per_batch or 16384)  # a batch of data.rows_per_batch needs no more
        resolved = pick * gpus if pick else max(d.max_seq_len, rows * d.max_seq_len) * gpus
        cpu_why = NO_GPU if not env["gpu"]["cuda_available"] else "model.device cpu"
        why = (f"does not run under torchrun yet ({gpus} GPUs: each rank would choose its own)" if gpus > 1 else
               f"measures the GPU's memory, and this run is on the CPU ({cpu_why})")
        found = _f("cfg.tokens_per_batch", "error", f"data.tokens_per_batch auto {why}; the checks below assume the "
                   f"fix's {resolved:,}", "the run stops before its first step",
                   f"data.tokens_per_batch: {resolved:,}" + (f" (the global batch: {resolved // gpus:,} per GPU"
                                                             + (", as auto would pick" if pick else "") + ")"
                                                             if gpus > 1 else ""))
    return replace(cfg, data=replace(d, tokens_per_batch=resolved)), found


def check_accumulation(cfg: RunConfig) -> list[Finding]:
    d, k = cfg.data, cfg.train.grad_accum
    if k > 1 and d.tokens_per_batch <= d.max_seq_len:
        return _f("cfg.accumulation", "warning", f"train.grad_accum {k} over micro-batches of one "
                  f"{d.max_seq_len:,}-token row (the seed's 'batch 1 x accumulation' habit)",
                  "small micro-batches leave the GPU under-filled (not predicted; `gapless gap` measures it, and "
                  "`gapless train CONFIG --dry-run` says whether the larger batch fits)", f"data.tokens_per_batch: {d.tokens_per_batch * k}  train.grad_accum: "
                  "1 (the same tokens per step, if memory allows)")
    return _f("cfg.accumulation", "ok", f"train.grad_accum {k}: accumulation itself costs little (measured 0.05% "
              "at 2 x 8,192 tokens on an H200, bench/RESULTS.md)")


def _size(nbytes: float) -> str:
    return (f"{nbytes / 2**30:,.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:,.1f} MiB" if nbytes >= 2**20
            else f"{nbytes / 2**10:,.0f} KiB")


def check_checkpoint(cfg: RunConfig, step_s: float | None, ckpt_bytes: int, write_bps: float | None,
                     steps: int | None, step_source: str = "no model config") -> list[Finding]:
    """step_source: where step_s came from, or why it is None (predicted_step_s)."""
    c = cfg.checkpoint
    run_s = step_s * steps if step_s and steps else None
    if not c.every:
        long = run_s is not None and run_s > 3600
        return _f("cfg.checkpoint", "warning" if long else "info",
                  "checkpoint.every 0: no checkpoints, so no resume" +
                  (f"; the run is predicted at {run_s / 3600:.1f} h" if run_s else ""),
                  "a crash loses the whole run" if long else "",
                  f"checkpoint.every: {max(1, steps // 10)}" if steps else "checkpoint.every: 500")
    from gapless.train.checkpoint_interval import HOST_COPY_GBS, MIN_EVERY, SHARE, choose_interval

    write_s = ckpt_bytes / write_bps if write_bps else None
    stall = ckpt_bytes / (HOST_COPY_GBS * 1e9) if c.async_write else write_s
    if step_s is None or stall is None:
        return _f("cfg.checkpoint", "info", f"checkpoint.every {c.every}: {_size(ckpt_bytes)} each; "
                  f"step time not predicted ({step_source}), so the "
                  + ("interval auto will choose is not predicted: the run measures its step time after its first "
                     f"step and picks the interval at which saves cost {SHARE:.0%}, at least {MIN_EVERY} steps"
                     if c.every == "auto" else "stall share is not predicted"))
    if c.every == "auto":
        chosen = choose_interval(step_s, stall, write_s if c.async_write else None, ckpt_bytes, "predicted")
        detail = (f"checkpoint.every auto: predicted every {chosen.every} steps ({chosen.formula()}; steps of "
                  f"{step_s:.2f} s, {_size(ckpt_bytes)} each, the loop waits {stall:.3f} s); the run measures its "
                  "own numbers after its first step and records its choice in metrics.jsonl")
        return _f("cfg.checkpoint", "ok", detail + f": {chosen.share:.2%} of the run")
    from gapless.diagnosis.gap import interval_for

    share = stall / (c.every * step_s)
    detail = (f"checkpoint.every {c.every} steps of {step_s:.2f} s; {_size(ckpt_bytes)} each"
              + (f", written in {write_s:.2f} s" if write_s else "")
              + (f", the loop waits {stall:.3f} s ({'host copy, async write' if c.async_write else 'sync write'})"))
    if share > CHECKPOINT_SHARE:
        return _f("cfg.checkpoint", "warning", detail, f"{share:.1%} of throughput",
                  f"checkpoint.every: {interval_for(stall, step_s, CHECKPOINT_SHARE)}"
                  + ("" if c.async_write else "  checkpoint.async_write: true"))
    if run_s is not None and c.every * step_s > 3600:
        return _f("cfg.checkpoint", "info", detail + f"; one every {c.every * step_s / 60:.0f} min",
                  f"a crash loses up to {c.every * step_s / 60:.0f} min", f"checkpoint.every: "
                  f"{max(1, int(3600 / step_s))}")
    return _f("cfg.checkpoint", "ok", detail + f": {share:.2%} of the run")


def check_logging(cfg: RunConfig) -> list[Finding]:
    k = cfg.train.log_every
    cost = LOG_SYNC_SHARE / k
    detail = f"train.log_every {k}: one host sync per {k} step(s)"
    if cost > 0.005:
        return _f("cfg.logging", "warning", detail, f"{cost:.1%} of throughput (a sync every step cost 1.05% on an "
                  "H200, `gapless gap`)", "train.log_every: 10")
    return _f("cfg.logging", "ok", detail + f": about {cost:.2%} of throughput")


def check_cache(summary) -> list[Finding]:
    cold = [s for s in summary.sources if s.cache == "miss"]
    if cold:
        seconds = sum(s.seconds for s in cold)
        return _f("cfg.cache", "info", f"the token cache was cold for {len(cold)} of {len(summary.sources)} "
                  f"source(s): tokenizing took {seconds:.1f} s; the doctor has now filled it",
                  f"{seconds / 60:.1f} min of start-up saved for the run")
    return _f("cfg.cache", "ok", f"the token cache is warm for all {len(summary.sources)} source(s)")


def memory_setting(cfg: RunConfig, env: dict, gpus: int = 1) -> tuple[int, int, str, dict]:
    """(tokens of each GPU's micro-batch, the GPUs FSDP2 shards over (1: one GPU or DDP), the strategy, the memory
    model's keyword arguments) for this run, as training places it (gapless.train.parallel, data.sharding)."""
    from gapless.diagnosis.plan import resolve_strategy
    from gapless.meter.memory import estimate_kwargs

    d = cfg.data
    strategy = resolve_strategy(cfg.parallel.strategy, cfg.method, gpus)
    rank = d.tokens_per_batch if gpus == 1 or d.tokens_per_batch == "auto" else \
        max(d.max_seq_len, d.tokens_per_batch // gpus // d.max_seq_len * d.max_seq_len)
    compiled = cfg.model.compile is True or (cfg.model.compile == "auto" and _is_gpu(cfg, env))
    return rank, gpus if strategy == "fsdp2" else 1, strategy, estimate_kwargs(cfg, compiled, _is_gpu(cfg, env))


def check_memory(cfg: RunConfig, env: dict, args, gpus: int = 1) -> list[Finding]:
    """The run's predicted peak per GPU (gapless.meter.memory: weights, trainable copies, gradients, optimizer state,
    activations of each GPU's micro-batch, the loss's chunk, the allocator's reserve; FSDP2 shards the state over
    the GPUs, DDP replicates it) against the GPU's memory, with the config lines that make it fit."""
    from gapless.diagnosis.plan import MemorySpec, gpu_from_name, memory_fixes
    from gapless.meter.memory import estimate_memory

    if args is None:
        return _f("cfg.memory", "info", "the model's config.json was not read: memory not predicted")
    rank, shards, strategy, kwargs = memory_setting(cfg, env, gpus)
    peak = estimate_memory(args, cfg.method, tokens=rank, shards=shards, **kwargs).total_gib
    what = (f"predicted peak {peak:.1f} GiB per GPU at {rank:,} tokens per micro-batch ({cfg.method}"
            + (f", {strategy} over {gpus} GPUs" if gpus > 1 else "") + ")")
    if not _is_gpu(cfg, env):
        return _f("cfg.memory", "info", f"{NO_GPU}; {what} (`gapless train CONFIG --dry-run` shows the table)")
    g = _gpus(env)[0]
    cap = g["memory_gib"]
    if peak > 0.9 * cap:
        try:
            name = gpu_from_name(g["name"]).name
        except ValueError:
            name = "GPU"
        fixes = memory_fixes(MemorySpec(args, cfg.method, kwargs), cfg.data.max_seq_len, cfg.train.grad_accum, name,
                             cap, gpus, strategy, rank * gpus)
        if peak > cap:
            return _f("cfg.memory", "error", f"{what} against {g['name']}'s {cap:.0f} GiB",
                      "the run does not fit: out of memory at the first step", " | ".join(fixes))
        return _f("cfg.memory", "warning", f"{what}: {peak / cap:.0%} of {g['name']}'s {cap:.0f} GiB (over 90%)",
                  "little headroom: fragmentation or a long batch can end the run out of memory", " | ".join(fixes))
    return _f("cfg.memory", "ok", f"{what}: {peak / cap:.0%} of {g['name']}'s {cap:.0f} GiB")


def check_precision(cfg: RunConfig, env: dict) -> list[Finding]:
    dtype = cfg.model.dtype
    if _is_gpu(cfg, env) and dtype == "float32":
        return _f("cfg.precision", "warning", "model.dtype float32 on a GPU",
                  f"matmuls at {TF32_VS_BF16:.0%} of the bf16 rate with TF32, {FP32_VS_TF32 * TF32_VS_BF16:.0%} "
                  "without (H100/A100 datasheets)", "model.dtype: bfloat16 (check the loss: gapless compare-precision)")
    if dtype == "float16":
        return _f("cfg.precision", "info", "model.dtype float16: trained with the dynamic loss scaler "
                  "(gapless.train.loss_scale; overflowing steps are skipped and counted in metrics.jsonl)",
                  "not predicted: skipped steps while the scale settles", "model.dtype: bfloat16 on GPUs of compute "
                  "capability 8.0+ (no scaler needed); `gapless compare-precision` compares them on your run")
    if not _is_gpu(cfg, env) and dtype != "float32":
        return _f("cfg.precision", "info", f"model.dtype {dtype} on the CPU: most CPUs have no fast {dtype} matmul",
                  "not predicted", "model.dtype: float32 for CPU runs")
    return _f("cfg.precision", "ok", f"model.dtype {dtype}")


def check_quantised_base(cfg: RunConfig) -> list[Finding]:
    """A model.path that bitsandbytes saved in 4 bits (gapless.model.prequantized): what each method makes of it."""
    from gapless.model.loading import read_config

    try:
        q = read_config(cfg.model.path).get("quantization_config")
    except ValueError:
        return []  # the run itself names what is wrong with model.path
    if not isinstance(q, dict) or not q.get("load_in_4bit", q.get("_load_in_4bit")):
        return []
    kind = q.get("bnb_4bit_quant_type", "fp4")
    held = f"model.path holds bitsandbytes {kind} 4-bit weights (config.json's quantization_config)"
    if cfg.method == "qlora" and kind == "nf4":
        return _f("cfg.quantised_base", "ok", f"{held}: QLoRA trains on its NF4 codes as stored")
    if cfg.method == "qlora":
        return _f("cfg.quantised_base", "warning", f"{held}: QLoRA dequantises them and quantises them again as NF4",
                  "the base the run trains on differs slightly from the file's (a second rounding)",
                  "model.path: the unquantised checkpoint, or one saved with bnb_4bit_quant_type nf4")
    dtype = cfg.model.dtype
    return _f("cfg.quantised_base", "warning", f"{held}: method {cfg.method} dequantises them to {dtype} and "
              + ("trains the LoRA adapter on that base" if cfg.method == "lora" else
                 "trains every weight from there: the quantisation error is in the starting point"),
              f"the base's memory of a {dtype} checkpoint, not of a 4-bit one",
              "method: qlora (keeps the 4-bit weights as stored), or model.path: the unquantised checkpoint")


# the micro-batch the H200 MFU figures were measured at (gapless.diagnosis.plan.H200_RUNS): a batch finder that
# still gets this many tokens per micro-batch without checkpointing keeps the GPU as busy
FULL_MICRO_BATCH = 16_384


def check_activation_checkpointing(cfg: RunConfig, env: dict | None = None, args=None, gpus: int = 1,
                                   auto: bool = False) -> list[Finding]:
    """Checkpointing costs recomputed forward FLOPs (RECOMPUTE_COST); it is a finding when the memory model says
    the run fits 90% of the GPU without it (auto: when the batch finder would still get FULL_MICRO_BATCH tokens)."""
    every = cfg.model.activation_checkpointing
    if not every:
        return _f("cfg.activation_checkpointing", "ok", "activation checkpointing off")
    L = args.num_hidden_layers if args is not None else None
    share = len(range(0, L, every)) / L if L else 1 / every
    cost = f"{RECOMPUTE_COST[cfg.method] * share:.0%} of throughput (the forward of " + \
        (f"{len(range(0, L, every))} of {L} layers" if L else f"1 in {every} layers") + " runs twice)"
    fix = "model.activation_checkpointing: 0"
    setting = f"model.activation_checkpointing {every}"
    if args is None or env is None:
        return _f("cfg.activation_checkpointing", "warning", f"{setting}: whether memory requires it is not predicted "
                  "(the model's config.json was not read)", cost, fix + " (if the run fits without it)")
    from gapless.meter.memory import auto_tokens, estimate_memory

    rank, shards, _, kwargs = memory_setting(cfg, env, gpus)
    off = {**kwargs, "activation_checkpointing": 0}
    auto = auto or rank == "auto"
    if not auto:
        without = estimate_memory(args, cfg.method, tokens=rank, shards=shards, **off).total_gib
        with_ = estimate_memory(args, cfg.method, tokens=rank, shards=shards, **kwargs).total_gib
    if not _is_gpu(cfg, env) and auto:
        return _f("cfg.activation_checkpointing", "info", f"{setting} with data.tokens_per_batch auto: {NO_GPU} to "
                  "size the batch on", cost)
    if not _is_gpu(cfg, env):
        return _f("cfg.activation_checkpointing", "info", f"{setting}: {NO_GPU} to compare with; predicted "
                  f"{without:.1f} GiB per GPU without it, {with_:.1f} with it, at {rank:,} tokens per micro-batch",
                  cost, fix + " (if the GPU has more than " f"{without / 0.9:.0f} GiB)")
    g = _gpus(env)[0]
    cap = g["memory_gib"]
    if auto:
        rows = cfg.data.rows_per_batch  # a batch of that many documents needs no more than rows x max_seq_len slots
        pick = auto_tokens(args, cfg.method, cap, cfg.data.max_seq_len, rows, shards=shards, **off)
        enough = min(FULL_MICRO_BATCH, rows * cfg.data.max_seq_len) if rows else FULL_MICRO_BATCH
        if pick >= enough:
            capped = f" (the most data.rows_per_batch {rows:,} needs)" if pick < FULL_MICRO_BATCH else ""
            return _f("cfg.activation_checkpointing", "warning", f"{setting} with data.tokens_per_batch auto: "
                      f"without it the batch finder is still predicted to pick ~{pick:,} tokens per micro-batch"
                      f"{capped} on {g['name']}'s {cap:.0f} GiB: memory does not require it", cost, fix)
        return _f("cfg.activation_checkpointing", "ok", f"{setting}: without it auto would get only {pick:,} tokens "
                  f"per micro-batch (under {FULL_MICRO_BATCH:,}) on {g['name']}'s {cap:.0f} GiB")
    if without <= 0.9 * cap:
        return _f("cfg.activation_checkpointing", "warning", f"{setting}: the memory model predicts {without:.1f} GiB "
                  f"per GPU without it ({without / cap:.0%} of {g['name']}'s {cap:.0f} GiB; {with_:.1f} with it) at "
                  f"{rank:,} tokens per micro-batch: memory does not require it", cost, fix)
    return _f("cfg.activation_checkpointing", "ok", f"{setting}: needed; without it {without:.1f} GiB per GPU, over "
              f"90% of {g['name']}'s {cap:.0f} GiB ({with_:.1f} with it)")


def check_compile(cfg: RunConfig, env: dict) -> list[Finding]:
    if _is_gpu(cfg, env) and cfg.model.compile is False:
        return _f("cfg.compile", "warning", "model.compile false on a GPU",
                  f"{1 - EAGER_SHARE:.0%} of throughput (eager 23,823 vs compiled 32,979 tok/s, Llama-3.2-3B, H200)",
                  "model.compile: auto")
    return _f("cfg.compile", "ok", f"model.compile {cfg.model.compile}"
              + ("" if _is_gpu(cfg, env) else f" ({NO_GPU}: compile auto is off on the CPU)"))


def check_lora_dropout(cfg: RunConfig, env: dict) -> list[Finding]:
    """LoRA dropout through torch's nn.Dropout (lora.fused_dropout: false) on a GPU: the masks it saves cost speed
    and memory that the fused kernels do not."""
    if cfg.method == "full":
        return _f("cfg.lora_dropout", "ok", "full fine-tuning: no LoRA")
    if cfg.lora.dropout == 0:
        return _f("cfg.lora_dropout", "ok", "no LoRA dropout")
    gpu = _is_gpu(cfg, env)
    if cfg.method == "qlora":
        where = "QLoRA's layers draw it with torch's dropout (masks saved)"
    elif not gpu:
        where = f"torch's dropout ({NO_GPU})"
    elif cfg.lora.fused_dropout:
        where = "drawn in the fused kernels, no mask saved"
    else:
        return _f("cfg.lora_dropout", "warning", f"lora.dropout {cfg.lora.dropout:g} through torch's dropout "
                  "(lora.fused_dropout false): a bool mask per group is saved for backward",
                  f"{TORCH_DROPOUT_COST:.1%} of throughput and {TORCH_DROPOUT_GIB:.0f} GiB of peak memory (Llama-3.2-3B "
                  "at 16,384 tokens, H100)", "lora.fused_dropout: true")
    return _f("cfg.lora_dropout", "ok", f"lora.dropout {cfg.lora.dropout:g}: {where}")


# ---------------------------------------------------------------------------------------------
# the doctor


def quick_checks(cfg: RunConfig, env: dict | None = None) -> list[Finding]:
    """The checks `gapless train` runs at startup: no data, no disk probe, no GPU work (well under a second)."""
    from gapless.diagnosis.environment import environment_record

    from gapless.model.loading import read_model_args

    env = environment_record(probe_kernels=False) if env is None else env
    gpus = world_size()
    try:
        args = read_model_args(cfg.model.path)  # config.json only
    except ValueError:
        args = None  # the run itself says what is wrong with model.path
    out = [f for check in ENV_CHECKS for f in check(env, cfg)]
    auto = cfg.data.tokens_per_batch == "auto"
    cfg, found = resolve_auto_tokens(cfg, env, args, gpus)
    out += found + check_tokens_per_step(cfg, 1.0, gpus) + check_accumulation(cfg) + check_logging(cfg) + \
        check_precision(cfg, env) + check_activation_checkpointing(cfg, env, args, gpus, auto) + \
        check_compile(cfg, env) + check_lora_dropout(cfg, env) + check_quantised_base(cfg)
    return out


def world_size() -> int:
    """The processes of a torchrun launch (WORLD_SIZE), else 1."""
    return int(os.environ.get("WORLD_SIZE", 1))


def serious(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity in ("warning", "error")]


def startup_report(cfg: RunConfig, env: dict | None = None) -> str:
    """What `gapless train` prints at startup: the warnings and errors of the quick checks, "" when there are none."""
    found = serious(quick_checks(cfg, env))
    return format_findings(found) if found else ""


def build_run_data(cfg: RunConfig):
    """(train mix, eval mix, summary) exactly as a run builds them (through the token cache)."""
    from gapless.data.pipeline import build_data
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the summary's warnings are in the summary
        return build_data(cfg.data, Path(cfg.data.tokenizer or cfg.model.path))


def predicted_step_s(cfg: RunConfig, env: dict, real_per_step: float, flops_token: float, weights: int,
                     gpus: int = 1, slots_per_step: float | None = None) -> tuple[float | None, str]:
    """Seconds per optimizer step: an earlier run in output_dir (its measured real tokens/s, all GPUs together),
    else the plan's single-GPU figure for the GPU here over each GPU's share of the step's slots (padding costs
    compute as a token does; traffic between GPUs left out: gapless plan), else None. slots_per_step: the step's
    slots measured on the data (None: tokens_per_batch x grad_accum, full batches)."""
    from gapless.diagnosis.plan import gpu_from_name, measured_from_run, single_gpu_tokens_per_s

    earlier = f"no earlier run in {cfg.output_dir}"
    try:
        toks, _ = measured_from_run(cfg.output_dir)
        return real_per_step / toks, f"measured in {cfg.output_dir}: {toks:,.0f} real tok/s"
    except ValueError as e:  # a run too short to time says so, rather than "no earlier run"
        if (Path(cfg.output_dir) / "metrics.jsonl").is_file():
            earlier = f"the run in {cfg.output_dir} cannot time a step: {e}"
    except (OSError, KeyError):
        pass
    if _is_gpu(cfg, env):
        try:
            gpu = gpu_from_name(_gpus(env)[0]["name"])
        except ValueError as e:
            return None, str(e)
        toks, source = single_gpu_tokens_per_s(gpu, flops_token, weights)
        slots = (cfg.data.tokens_per_batch * cfg.train.grad_accum if slots_per_step is None else slots_per_step) / gpus
        return slots / toks, (f"predicted for {slots:,.0f} slots per step" + (" per GPU" if gpus > 1 else "")
                              + f" at {toks:,.0f} tok/s = {source}")
    return None, f"{NO_GPU} and {earlier}"


def diagnose(cfg: RunConfig | None, env: dict | None = None, *, probe_disk: bool = True,
             gpus: int | None = None) -> dict:
    """Every check; returns {"findings": [...], "facts": {...}} (what the predictions used). gpus: the processes
    the run will be launched with (`gapless train --nproc N`, torchrun); default WORLD_SIZE, else 1."""
    from gapless.data.batching import BatchSampler
    from gapless.diagnosis.environment import environment_record

    env = environment_record() if env is None else env
    findings = [f for check in ENV_CHECKS for f in check(env, cfg)]
    facts: dict = {}
    out_dir = Path(cfg.output_dir if cfg else ".")
    write_bps = measure_write_speed(_existing_parent(out_dir)) if probe_disk else None
    facts["write_MBps"] = write_bps / 1e6 if write_bps else None
    if cfg is None:
        findings += check_disk(out_dir, 0, write_bps)
        return {"findings": findings, "facts": facts}

    from dataclasses import replace

    from gapless.diagnosis.plan import flops_per_token
    from gapless.meter.flops import matmul_weights
    from gapless.model.loading import read_model_args
    from gapless.model.method import method_of

    try:
        args = read_model_args(cfg.model.path)
    except ValueError as e:
        args = None
        findings += _f("cfg.model", "error", str(e), "the run cannot start", "model.path: an HF checkpoint folder")
    gpus = world_size() if gpus is None else gpus
    if gpus < 1:
        raise ValueError(f"--nproc: {gpus}; give the number of processes (GPUs) the run will use, e.g. 8")
    facts["gpus"] = gpus
    auto = cfg.data.tokens_per_batch == "auto"
    cfg, found = resolve_auto_tokens(cfg, env, args, gpus)
    findings += found
    facts["tokens_per_batch"] = cfg.data.tokens_per_batch
    try:
        mix, _, summary = build_run_data(cfg)
    except ValueError as e:
        findings += _f("cfg.data", "error", str(e), "the run cannot start", "fix the data (gapless data CONFIG)")
        return {"findings": findings, "facts": facts}
    findings += check_cache(summary)
    eff = {}
    for strategy in dict.fromkeys([cfg.data.batching, "packed"]):
        rows = cfg.data.rows_per_batch if strategy == cfg.data.batching else None  # (packed takes no rows cap)
        eff[strategy] = BatchSampler.from_config(replace(cfg.data, batching=strategy, rows_per_batch=rows),
                                                 mix).efficiency(0)
    facts["packing_efficiency"] = eff
    findings += check_batching(cfg, eff)
    findings += check_tokens_per_step(cfg, eff[cfg.data.batching], gpus)
    findings += check_accumulation(cfg)
    steps = cfg.train.steps or math.ceil(cfg.train.epochs * summary.batches_per_epoch / cfg.train.grad_accum)
    facts["steps"] = steps
    ckpt = checkpoint_bytes(cfg) if args else 0
    step_s, source = None, "the model's config.json was not read"
    if args:
        lengths = mix.lengths[mix.epoch_docs(cfg.data.seed, 0)]
        # the epoch's batches on average (as the dry-run's), not tokens_per_batch x efficiency: padded batches of at
        # most data.rows_per_batch short documents fill a small part of tokens_per_batch
        real_step = summary.train_tokens / max(summary.batches_per_epoch, 1) * cfg.train.grad_accum
        step_s, source = predicted_step_s(cfg, env, real_step,
                                          flops_per_token(args, lengths, method_of(cfg).flops), matmul_weights(args),
                                          gpus, slots_per_step=real_step / max(eff[cfg.data.batching], 1e-9))
        facts["step_s"], facts["step_source"] = step_s, source
    findings += check_checkpoint(cfg, step_s, ckpt, write_bps, steps, source)
    # the run's folder holds (keep + 1) checkpoints while the newest is written, plus the final adapter
    findings += check_disk(out_dir, ckpt * (cfg.checkpoint.keep + 2), write_bps)
    findings += check_logging(cfg)
    findings += check_memory(cfg, env, args, gpus)
    findings += check_precision(cfg, env) + check_activation_checkpointing(cfg, env, args, gpus, auto) + \
        check_compile(cfg, env) + check_lora_dropout(cfg, env) + check_quantised_base(cfg)
    return {"findings": findings, "facts": facts}


def run_findings(run_dir: str | Path) -> list[Finding]:
    """A finished or running run's own evidence (gapless.meter.report: input-bound, I/O-bound at checkpoints,
    throttling, an under-used GPU, layers compile gave up on; under torchrun the GPU rules per rank, a rank whose GPU
    alone throttles or idles named) as doctor findings: the seed's "still slow" checks."""
    import re

    from gapless.meter.report import findings, read_run

    out = []
    for f in findings(read_run(run_dir)):
        slug = re.sub(r"[^a-z0-9]+", "_", f.cause.split(":")[0].lower()).strip("_")
        out += _f(f"run.{slug}", "warning", f"{f.cause}: {f.evidence}", "the shares of the run's time above", f.fix)
    if not out:
        out += _f("run.evidence", "ok", f"{run_dir}: no input, checkpoint, throttling or utilisation finding in its "
                  "metrics.jsonl and gpu*.jsonl")
    return out


def diagnose_target(target: str | None, overrides: list[str] = (), env: dict | None = None,
                    gpus: int | None = None) -> dict:
    """`gapless doctor [CONFIG | RUN]`: a run folder is checked with its resolved config.yaml, plus its own evidence."""
    from gapless.config import load_config

    if target is None:
        return diagnose(None, env, gpus=gpus)
    run = Path(target)
    if run.is_dir():
        if not (run / "config.yaml").is_file():
            raise ValueError(f"{run}: a folder without config.yaml; give a config file or a run folder")
        result = diagnose(load_config(run / "config.yaml", [f"output_dir={run}", *overrides]), env, gpus=gpus)
        if (run / "metrics.jsonl").is_file():
            result["findings"] += run_findings(run)
        return result
    from gapless.convert import load_any

    return diagnose(load_any(target, overrides), env, gpus=gpus)  # a gapless, Axolotl, TRL or LLaMA-Factory config


def format_findings(findings: list[Finding], show_ok: bool = True) -> str:
    rows = [f for f in findings if show_ok or f.severity != "ok"]
    width = max((len(f.id) for f in rows), default=10)
    lines = [f"{'severity':<8}  {'check':<{width}}  finding"]
    for f in rows:
        lines.append(f"{f.severity.upper() if f.severity in ('warning', 'error') else f.severity:<8}  "
                     f"{f.id:<{width}}  {f.detail}")
        pad = " " * (10 + width + 2)
        if f.cost:
            lines.append(f"{pad}cost: {f.cost}")
        if f.fix:
            lines.append(f"{pad}fix:  {f.fix}")
    counts = {s: sum(f.severity == s for f in findings) for s in SEVERITIES}
    lines.append(f"{len(findings)} checks: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n))
    return "\n".join(lines)


def to_json(result: dict) -> str:
    return json.dumps({"findings": [asdict(f) for f in result["findings"]], "facts": result["facts"],
                       "errors": sum(f.severity == "error" for f in result["findings"])}, default=str)
