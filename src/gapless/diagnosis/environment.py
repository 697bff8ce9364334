"""The run's environment record: what software and hardware a run ran on, so "it was faster last week" has an
answer. `environment_record()` gathers it (no GPU work beyond reading properties); `write_environment(run_dir)`
writes RUN/environment.json; `compare_runs(a, b)` lists what differs between two run folders' environments and
config.yaml files (`gapless doctor --compare RUN_A RUN_B`).
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import urllib.parse
from pathlib import Path

import torch

from gapless.config import read_yaml

# The distributions whose version changes what a run computes or how fast (module name -> distribution name).
PACKAGES = ("torch", "transformers", "peft", "accelerate", "tokenizers", "safetensors", "numpy", "triton",
            "flash-attn-4", "flash_attn", "liger-kernel", "bitsandbytes", "nvidia-ml-py", "nvidia-nccl-cu12",
            "nvidia-nccl-cu13", "nvidia-cudnn-cu12", "nvidia-cudnn-cu13", "gapless")
# Environment variables that change speed, memory, networking or what is downloaded. Prefixes end in "_".
ENV_PREFIXES = ("CUDA_", "NCCL_", "PYTORCH_", "TORCH_", "TORCHINDUCTOR_", "HF_", "TRANSFORMERS_", "NVIDIA_",
                "FLASH_ATTENTION_")
ENV_NAMES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TOKENIZERS_PARALLELISM", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
             "MASTER_ADDR", "MASTER_PORT")
# The fast kernels gapless can use, by the module a run imports (config.py and kernels/ say where each is used).
KERNEL_MODULES = {"flash-attn-4": "flash_attn.cute", "liger-kernel": "liger_kernel", "bitsandbytes": "bitsandbytes"}


def package_versions() -> dict[str, str]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    out["torch"] = torch.__version__  # the build tag (+cu130, +cpu) is part of the answer
    return out


def kernel_imports(probe: bool = True) -> dict[str, str]:
    """Which fast kernels import here: 'ok' or the import error's first line. probe=False only looks them up
    (bitsandbytes alone takes ~3.6 s to import on the 2-core dev box: too slow for every `gapless train`)."""
    out = {}
    if probe:
        # flash-attn-4 reads its disk-cache switch once, when imported: turned on before this probe imports it
        # (run s19-startup: `gapless train` writes environment.json first, and every warm start-up recompiled
        # flash-attn-4's kernels, ~11 s of a 18.1 s start-up; 10.2 s with the cache, run s19-startup2)
        from gapless.kernels.attention import fa4_disk_cache

        fa4_disk_cache()
    for name, module in KERNEL_MODULES.items():
        if not probe:
            found = importlib.util.find_spec(module.split(".")[0]) is not None
            out[name] = "ok" if found else f"ModuleNotFoundError: No module named '{module.split('.')[0]}'"
            continue
        try:
            importlib.import_module(module)
            out[name] = "ok"
        except Exception as e:  # a broken install raises more than ImportError (CUDA libraries, ABI)
            out[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return out


def gpu_record() -> dict:
    """torch's view of the GPUs (empty list without CUDA) plus the driver and per-GPU link facts from NVML."""
    cuda = torch.cuda.is_available()
    record = {"torch_cuda": torch.version.cuda, "cuda_available": cuda, "nvidia_smi": shutil.which("nvidia-smi"),
              "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
              "nccl": None, "driver": None, "gpus": []}
    if not cuda:
        return record
    try:
        record["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except (AttributeError, RuntimeError):
        pass
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        record["gpus"].append({"index": i, "name": p.name, "memory_gib": round(p.total_memory / 2**30, 2),
                               "capability": f"{p.major}.{p.minor}", "sms": p.multi_processor_count,
                               "bf16": torch.cuda.is_bf16_supported() if i == 0 else None,
                               "memory_fraction": _memory_fraction(i)})
    try:
        import pynvml

        pynvml.nvmlInit()
        record["driver"] = pynvml.nvmlSystemGetDriverVersion()
        links = []
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        for link in range(18):  # NVML_NVLINK_MAX_LINKS is 18 on Hopper
            try:
                if pynvml.nvmlDeviceGetNvLinkState(h, link):
                    links.append(link)
            except pynvml.NVMLError:
                break
        record["nvlinks_gpu0"] = len(links)
        pynvml.nvmlShutdown()
    except Exception:  # no nvidia-ml-py, or NVML not loadable: the driver stays unknown
        pass
    return record


def _memory_fraction(index: int) -> float | None:
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.6
    try:
        return float(getter(index)) if getter else None
    except RuntimeError:
        return None


def torch_flags() -> dict:
    return {"tf32_matmul": torch.backends.cuda.matmul.allow_tf32, "tf32_cudnn": torch.backends.cudnn.allow_tf32,
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "cudnn_benchmark": torch.backends.cudnn.benchmark, "cudnn_deterministic": torch.backends.cudnn.deterministic,
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "threads": torch.get_num_threads()}


# names that hold credentials (HF_TOKEN, HUGGING_FACE_HUB_TOKEN, WANDB_API_KEY...): recorded as set, never copied
SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "CREDENTIAL")


def env_vars(environ: dict | None = None) -> dict[str, str]:
    environ = os.environ if environ is None else environ
    return {k: "<set, not recorded>" if any(w in k.upper() for w in SECRET_WORDS) else v
            for k, v in sorted(environ.items()) if k.startswith(ENV_PREFIXES) or k in ENV_NAMES}


def gapless_source() -> dict:
    """Where gapless runs from: the git commit (and whether the tree has changes) and the install method."""
    here = Path(__file__).resolve().parents[1]
    out: dict = {"path": str(here), "commit": None, "dirty": None, "install": "not installed (PYTHONPATH)"}
    try:
        dist = importlib.metadata.distribution("gapless")
        direct = json.loads(dist.read_text("direct_url.json") or "{}")
        if direct.get("dir_info", {}).get("editable"):
            installed = Path(urllib.parse.urlparse(direct.get("url", "")).path)  # file:///path/to/checkout
        else:
            installed = Path(dist.locate_file("gapless"))
        # the install is what runs only where it holds this file: an editable install of another checkout (or a
        # wheel) shadowed by PYTHONPATH is not how this gapless was installed
        if here.is_relative_to(installed.resolve()):
            out["install"] = "editable" if direct.get("dir_info", {}).get("editable") else "package"
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        git = ["git", "-C", str(here)]
        out["commit"] = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True,
                                       timeout=10, check=True).stdout.strip()
        status = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True, timeout=10, check=True).stdout
        out["dirty"] = bool(status.strip())
    except (OSError, subprocess.SubprocessError):
        pass  # not a git checkout (an installed wheel): the version says what ran
    return out


def cpu_count() -> int:
    """The CPUs this process can keep busy (affinity, capped by a cgroup quota: gapless.data.tokenize)."""
    from gapless.data.tokenize import available_cpus

    return available_cpus()


def cpu_quota() -> float | None:
    """The cgroup's CPU quota in CPUs (a container's CPU limit), None where there is none."""
    from gapless.data.tokenize import cgroup_cpu_quota

    return cgroup_cpu_quota()


def environment_record(probe_kernels: bool = True) -> dict:
    """Everything about this machine and install that changes what a run computes or how fast it runs.
    probe_kernels=False: the fast kernels are looked up, not imported (see kernel_imports)."""
    return {"python": platform.python_version(), "executable": sys.executable, "platform": platform.platform(),
            "cpu_count": cpu_count(), "cpu_quota": cpu_quota(), "packages": package_versions(),
            "kernels": kernel_imports(probe_kernels),
            "gpu": gpu_record(), "torch_flags": torch_flags(), "env": env_vars(), "gapless": gapless_source()}


def write_environment(run_dir: str | Path, record: dict | None = None) -> Path:
    path = Path(run_dir) / "environment.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record or environment_record(), indent=2, sort_keys=True) + "\n")
    return path


# ---------------------------------------------------------------------------------------------
# two runs side by side


def flatten(value, prefix: str = "") -> dict[str, object]:
    """Nested dicts -> {"a.b.c": leaf}; lists stay leaves (a changed list of sources is one difference)."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: value}


def differences(a: dict, b: dict) -> list[tuple[str, object, object]]:
    """(dotted key, value in a, value in b) for every leaf that differs; a missing leaf is None."""
    fa, fb = flatten(a), flatten(b)
    return [(k, fa.get(k), fb.get(k)) for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)]


# keys that differ between any two runs and say nothing about speed
_NOISE = ("executable", "output_dir", "gapless.path")


def compare_runs(run_a: str | Path, run_b: str | Path) -> dict:
    """What differs between two run folders: their environment.json and their config.yaml."""
    for run in (run_a, run_b):
        if not Path(run).is_dir():
            raise ValueError(f"--compare: {run} is not a folder; give two run folders (their output_dir)")
    out = {}
    for name, read in (("environment", lambda p: json.loads(p.read_text())),
                       ("config", read_yaml)):
        file = "environment.json" if name == "environment" else "config.yaml"
        pa, pb = Path(run_a) / file, Path(run_b) / file
        missing = [str(p) for p in (pa, pb) if not p.is_file()]
        if missing:
            out[name] = {"missing": missing}
            continue
        out[name] = {"differences": [{"key": k, "a": va, "b": vb} for k, va, vb in differences(read(pa), read(pb))
                                     if k not in _NOISE]}
    return out


def format_comparison(cmp: dict, run_a: str, run_b: str) -> str:
    lines = [f"A = {run_a}", f"B = {run_b}"]
    for name in ("environment", "config"):
        part = cmp[name]
        if "missing" in part:
            lines.append(f"{name}: not compared, missing {', '.join(part['missing'])}"
                         + (" (runs before environment records were written have none)" if name == "environment"
                            else ""))
            continue
        diffs = part["differences"]
        lines.append(f"{name}: {'the same' if not diffs else f'{len(diffs)} differences'}")
        width = max((len(d["key"]) for d in diffs), default=0)
        lines += [f"  {d['key']:<{width}}  A: {d['a']!s:<24}  B: {d['b']}" for d in diffs]
    return "\n".join(lines)
