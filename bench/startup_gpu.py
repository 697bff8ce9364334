"""Start-up of the example config, cold and warm: from process start to the end of step 1 (issue 18, item 5).

    python bench/startup_gpu.py [--work /tmp/gapless-startup] [--out bench/results.jsonl] [--run-id ID]
    python bench/startup_gpu.py --tiny [--work DIR]    # a 2-layer Llama on the CPU: the same steps in seconds
    python bench/startup_gpu.py --tiny --compile        # ... compiled as on a GPU (minutes on the CPU)

1. Writes random Llama-3.2-3B weights (bench/models/llama-3.2-3b/config.json; bf16, transformers' init: normal with
   std 0.02, norms 1) as safetensors shards of at most --shard-gb with model.safetensors.index.json, as
   save_pretrained writes them, and the Llama 3 tokenizer, into WORK/model (kept and reused while its config.json is
   the same).
2. Runs `gapless train examples/llama-3.2-3b-lora.yaml model.path=WORK/model data.sources.0.path=DATA
   train.steps=1 ...` in a subprocess three times:
     cold: the compile caches (TORCHINDUCTOR_CACHE_DIR; flash-attn-4's kernels, FLASH_ATTENTION_CUTE_DSL_CACHE_DIR,
           gapless.kernels.attention.fa4_disk_cache), the token cache (data.cache_dir) and gapless's bytecode
           cache (~/.cache/gapless/pycache, used where torch has no .pyc: gapless.bytecode) empty, and the weights'
           pages dropped from the OS page cache (fsync, then posix_fadvise DONTNEED: advisory, no root needed);
     warm: the same caches, now full, and the weights in the page cache;
     cold_pyc: cold again, but with the imports' bytecode kept: what a first run after `pip install` meets (pip
           writes every package's .pyc at install; the GPU machine's torch has none, so `cold` compiles its
           thousands of modules from source, about 8 s of run s19-startup2's 12.6 s of imports).
3. Each time, two clocks to the end of step 1: outside, from just before the subprocess is started to the moment its
   "step 1 done" line arrives (`cold_s`, `warm_s`); inside, the run's own first_step_s from the process start
   (metrics.jsonl {"kind": "startup"}), with its parts: imports_config, load (build, transform, load the weights),
   data, other, first_step (its batch, compile, forward, backward, update), compile_s (torch.compile's own timer,
   within first_step), the data's own seconds beside the load, flash-attn-4's compile in a second process
   (gapless.train.warm_attention) and the peak memory.
4. Appends one row to --out in the schema of bench/results.jsonl's rows (config "startup"; "startup_tiny" for
   --tiny, whose rows go to WORK/results.jsonl unless --out is given). --runs picks the starts (a two-start A/B
   fits a call that three would overrun); a start that fails leaves its fields null and its error in the row's
   `error`, the others are kept, and the script exits 1.

The issue's targets on one H200: cold_s <= 30, warm_s <= 12. DATA: --data, default ../shared/data/messages, else
.carry/messages (the GPU machine has no ../shared: carry the folder); the tokenizer likewise (--tokenizer, default
../shared/tokenizers/llama3, else .carry/tokenizers/llama3 or .carry/llama3). --tiny writes its own small data set.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from gapless.bench import append_row, device_name
from gapless.bytecode import PYCACHE
from gapless.model.decoder import CausalLM
from gapless.model.loading import model_args_from_config
from gapless.train.assemble import random_tensors

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "llama-3.2-3b-lora.yaml"
MODEL_CONFIG = ROOT / "bench" / "models" / "llama-3.2-3b" / "config.json"
TARGETS = {"cold_s": 30.0, "warm_s": 12.0}  # issue 18, one H200
RUNS = ("cold", "warm", "cold_pyc")  # the starts (module docstring), in the default order
# --tiny: the 3B config's family and vocabulary (the Llama 3 tokenizer's ids), 2 small layers
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16}
# --tiny on the CPU: rows short enough that a step of a 128,256-token vocabulary takes a second, not minutes
TINY_OVERRIDES = ["data.max_seq_len=256", "data.tokens_per_batch=1024"]
STEP1_LINE = "step 1 done"  # gapless.train.loop's message at the end of the first step


def first_existing(*paths: Path) -> Path | None:
    return next((p for p in paths if p.exists()), None)


def write_model(folder: Path, config: dict, tokenizer: Path, shard_bytes: int) -> dict:
    """Random weights of `config` as safetensors shards + index into `folder`, with the tokenizer's files; reused
    when the folder already holds this config. Returns {"weights_gib", "shards", "written_s"}."""
    index = folder / "model.safetensors.index.json"
    if (folder / "config.json").is_file() and json.loads((folder / "config.json").read_text()) == config \
            and index.is_file():
        files = sorted(folder.glob("model-*.safetensors"))
        return {"weights_gib": sum(f.stat().st_size for f in files) / 2**30, "shards": len(files), "written_s": 0.0}
    t0 = time.perf_counter()
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    with torch.device("meta"):
        skeleton = CausalLM(model_args_from_config(config))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # drawn on the GPU where there is one
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in random_tensors(skeleton, device, torch.bfloat16):
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor.cpu()
        size += nbytes
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, folder / name, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, name)
        total += sum(t.numel() * t.element_size() for t in shard.values())
    index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for f in tokenizer.iterdir():
        if f.is_file():
            shutil.copy(f, folder / f.name)
    return {"weights_gib": total / 2**30, "shards": len(shards), "written_s": time.perf_counter() - t0}


def drop_page_cache(folder: Path) -> bool:
    """Ask the kernel to drop the weights' pages from the page cache (written back first); False where
    posix_fadvise is missing. Advisory: pages another process maps stay."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in folder.glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def run_once(name: str, command: list[str], env: dict, run_dir: Path, log: Path) -> dict:
    """One `gapless train` subprocess: the outside clock to its "step 1 done" line, its own startup record, its
    exit. Every line of its output goes to `log`."""
    t0 = time.perf_counter()
    outside = None
    with open(log, "w") as f:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                cwd=ROOT)
        for line in proc.stdout:
            if outside is None and STEP1_LINE in line:
                outside = time.perf_counter() - t0
            f.write(line)
        code = proc.wait()
    wall = time.perf_counter() - t0
    metrics = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    startup = next((r for r in records if r.get("kind") == "startup"), None)
    if code != 0 or outside is None or startup is None:
        tail = log.read_text().splitlines()[-5:]
        raise RuntimeError(f"{name} run failed (exit {code}; see {log}): {' | '.join(tail)}")
    parts = startup["seconds"]
    return {"outside_s": round(outside, 3), "inside_s": round(startup["first_step_s"], 3),
            "breakdown": {"imports_config": parts["imports_config"], "load": parts["model"], "data": parts["data"],
                          "other": parts["other"], "warmup": parts.get("warmup"), "first_step": parts["first_step"],
                          "compile": startup["compile_s"],
                          # the data's own seconds, read beside the model's load ("data" is the wait after it)
                          "data_beside": startup.get("overlapped", {}).get("data"),
                          # flash-attn-4's first compile in a second process (gapless.train.warm_attention)
                          "attention_beside": startup.get("overlapped", {}).get("attention")},
            "compile_caches": startup.get("compile_caches", {}), "compile_phases": startup.get("compile_phases", {}),
            "peak_gib": startup["peak_gib"], "host_peak_gib": round(startup["host_peak_gib"], 3),
            "process_s": round(wall, 3)}


def autotuned_kernels(log: Path) -> list[str]:
    """The kernels inductor's runtime autotuner benchmarked in one run (its "Best config for NAME: ..." debug line,
    which TORCH_LOGS=+torch._inductor.runtime.triton_heuristics turns on), in order."""
    words = "Best config for "
    return [line.split(words, 1)[1].split(":", 1)[0] for line in log.read_text(errors="replace").splitlines()
            if words in line]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="a 2-layer Llama and a small data set (CPU, seconds)")
    p.add_argument("--compile", action="store_true", help="model.compile=true (auto compiles on CUDA only): the CPU "
                                                          "times compiling too")
    p.add_argument("--work", type=Path, default=Path("/tmp/gapless-startup"), help="weights, caches, runs, logs")
    p.add_argument("--config", type=Path, default=CONFIG)
    p.add_argument("--model-config", type=Path, default=MODEL_CONFIG, help="the config.json the weights follow")
    p.add_argument("--data", type=Path, default=None, help="the training data (a file or a folder)")
    p.add_argument("--tokenizer", type=Path, default=None, help="a folder of Llama 3 tokenizer files")
    p.add_argument("--shard-gb", type=float, default=5.0, help="the largest shard, as save_pretrained's default")
    p.add_argument("--out", type=Path, default=None, help="results.jsonl to append to (default bench/results.jsonl; "
                                                           "--tiny: WORK/results.jsonl)")
    p.add_argument("--run-id", default=None)
    p.add_argument("--cprofile", type=Path, default=None, help="after the row: one more warm run under cProfile, its "
                                                               "stats written here (pstats; not timed for the row)")
    p.add_argument("--runs", default=",".join(RUNS), help="the starts to time, in this order (default: all three; "
                                                          "warm finds the caches the run before it left)")
    opts = p.parse_args(argv)
    runs = opts.runs.split(",")
    if set(runs) - set(RUNS):
        p.error(f"--runs: {opts.runs!r}; a comma-separated list of {', '.join(RUNS)}")

    work = opts.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = opts.tokenizer or first_existing(ROOT.parent / "shared" / "tokenizers" / "llama3",
                                                 ROOT / ".carry" / "tokenizers" / "llama3", ROOT / ".carry" / "llama3")
    if tokenizer is None or not tokenizer.is_dir():
        p.error("--tokenizer: no Llama 3 tokenizer folder (../shared/tokenizers/llama3, .carry/tokenizers/llama3 "
                "or .carry/llama3, as bench/doctor_gpu.sh carries it)")
    config = json.loads(opts.model_config.read_text())
    # one step: no room for the config's warm-up ratio (a 1-step run is refused with one), which start-up never reaches
    overrides: list[str] = ["schedule.warmup_ratio=0", *(["model.compile=true"] if opts.compile else [])]
    if opts.tiny:
        from gapless import demo_task

        config = {**config, **TINY}
        data = opts.data or demo_task.write_jsonl(demo_task.make_examples(400, seed=0), work / "data" / "train.jsonl")
        overrides += TINY_OVERRIDES
        shard_bytes = 8 * 2**20  # 8 MiB: the tiny weights in several shards, as a real checkpoint is
    else:
        data = opts.data or first_existing(ROOT.parent / "shared" / "data" / "messages", ROOT / ".carry" / "messages")
        if data is None:
            p.error("--data: no data (../shared/data/messages or .carry/messages)")
        shard_bytes = int(opts.shard_gb * 2**30)
    out = opts.out or (work / "results.jsonl" if opts.tiny else ROOT / "bench" / "results.jsonl")
    model = write_model(work / "model", config, tokenizer, shard_bytes)
    print(f"[startup] weights: {model['weights_gib']:.2f} GiB in {model['shards']} shards in {work / 'model'}"
          + (f" (written in {model['written_s']:.1f} s)" if model["written_s"] else " (reused)"), flush=True)

    caches = work / "cache"
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(caches / "compile"), "PYTHONUNBUFFERED": "1",
           "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": str(caches / "flash_attn_cute"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])),
           # inductor's runtime autotuner logs "Best config for KERNEL" each time it benchmarks a kernel's configs:
           # session 15's warm start still benchmarked 2 kernels (6.5 s profiled), which its cache should have held
           "TORCH_LOGS": os.environ.get("TORCH_LOGS", "+torch._inductor.runtime.triton_heuristics")}
    results, page_cache_dropped = {}, False
    def train_command(run_dir: Path) -> list[str]:
        return ["-m", "gapless.cli", "train", str(opts.config), f"model.path={work / 'model'}",
                f"data.sources.0.path={data}", f"data.cache_dir={caches / 'tokens'}", "train.steps=1",
                f"output_dir={run_dir}", *overrides, "--overwrite"]

    errors = {}
    for name in runs:
        if name != "warm":  # nothing compiled, nothing tokenized, the weights read from the disk
            page_cache_dropped = drop_page_cache(work / "model")
            shutil.rmtree(caches, ignore_errors=True)
        if name == "cold":  # and the imports' bytecode (gapless.bytecode); cold_pyc keeps it, as `pip install` does
            shutil.rmtree(PYCACHE.expanduser(), ignore_errors=True)
        run_dir = work / "runs" / name
        try:
            results[name] = run_once(name, [sys.executable, *train_command(run_dir)], env, run_dir,
                                     work / f"{name}.log")
        except RuntimeError as e:  # the row keeps the other starts (s20-startup lost all three to one failure)
            errors[name] = str(e)
            print(f"[startup] {e}", flush=True)
            continue
        r = results[name]
        print(f"[startup] {name}: {r['outside_s']:.1f} s to the end of step 1 (outside clock; inside "
              f"{r['inside_s']:.1f} s): " + ", ".join(f"{k} {v:.1f}" for k, v in r["breakdown"].items()
                                                                          if v is not None)
              + f"; compile caches {r['compile_caches'] or 'unused'}; longest compile phases "
              + ", ".join(f"{k} {v:.1f}" for k, v in r["compile_phases"].items()), flush=True)

    def of(name: str, key: str):
        return results[name][key] if name in results else None

    autotuned = {name: autotuned_kernels(work / f"{name}.log") for name in results}
    best_configs = len(list((caches / "compile").rglob("*.best_config")))
    print("[startup] kernels autotuned at run time: " + ", ".join(f"{k} {len(v)}" for k, v in autotuned.items())
          + (f" (warm: {', '.join(autotuned['warm'])}; in the cold run too: "
             f"{sorted(set(autotuned['warm']) & set(autotuned.get('cold', [])))})" if autotuned.get("warm") else "")
          + f"; {best_configs} .best_config files in the compile cache", flush=True)
    peaks = [r["peak_gib"] for r in results.values() if r["peak_gib"] is not None]
    timed = ", ".join(f"{name} {results[name]['outside_s']:.1f} s" for name in runs if name in results)
    row = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "gpu": device_name(torch.device("cuda" if torch.cuda.is_available() else "cpu")), "system": "gapless",
           "config": "startup_tiny" if opts.tiny else "startup",
           "model": "llama-3.2-3b-shape-tiny" if opts.tiny else opts.model_config.parent.name,
           "real_tok_s": None, "peak_gib": round(max(peaks), 2) if peaks else None, "mfu": None,
           "padding_fraction": None, "step_ms": None, "fwd_ms": None, "bwd_ms": None, "opt_ms": None,
           "command": shlex.join(["python", "bench/startup_gpu.py", *(argv if argv is not None else sys.argv[1:])]),
           "run_id": opts.run_id or datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ-startup"),
           "torch": torch.__version__,
           "error": "; ".join(f"{name}: {e}" for name, e in errors.items()) or None,
           "cold_s": of("cold", "outside_s"), "warm_s": of("warm", "outside_s"),
           "cold_pyc_s": of("cold_pyc", "outside_s"),
           "cold_inside_s": of("cold", "inside_s"), "warm_inside_s": of("warm", "inside_s"),
           "cold_breakdown": of("cold", "breakdown"), "warm_breakdown": of("warm", "breakdown"),
           "cold_pyc_breakdown": of("cold_pyc", "breakdown"),
           "cold_peak_gib": of("cold", "peak_gib"), "warm_peak_gib": of("warm", "peak_gib"),
           "autotuned_cold": len(autotuned["cold"]) if "cold" in autotuned else None,
           "autotuned_warm": autotuned.get("warm"),
           "host_peak_gib": max((r["host_peak_gib"] for r in results.values()), default=None),
           "describe": f"start-up of {opts.config.name}, process start to the end of step 1: {timed or 'no start'} "
                       f"(targets cold {TARGETS['cold_s']:g} / warm {TARGETS['warm_s']:g} s; cold_pyc: cold with "
                       "the bytecode that pip install writes)",
           "targets": TARGETS, "page_cache_dropped": page_cache_dropped, "weights_gib": round(model["weights_gib"], 3),
           "shards": model["shards"], "train_command": "gapless train " + shlex.join(
               [str(opts.config.relative_to(ROOT) if opts.config.is_relative_to(ROOT) else opts.config),
                "model.path=WORK/model", f"data.sources.0.path={data}", "train.steps=1", *overrides])}
    append_row(out, row)
    print(f"[startup] {timed or 'no start finished'} (targets cold {TARGETS['cold_s']:.0f} and warm "
          f"{TARGETS['warm_s']:.0f} s on one H200); row appended to {out}", flush=True)
    if opts.cprofile:  # where a warm start's seconds go, function by function (python -m pstats FILE)
        run_dir = work / "runs" / "profiled"
        # main() under cProfile.run, not `python -m cProfile`: the command's entry() ends the process with
        # os._exit, before cProfile would write its file. entry()'s bytecode cache first, as the command has it:
        # without it session 15's profiled warm start compiled 2,803 modules from source (12.4 s profiled), which
        # the unprofiled warm runs (4.3 s of imports) did not
        script = (f"import cProfile, sys; sys.argv = ['gapless', *sys.argv[1:]]; "
                  f"import gapless.bytecode; gapless.bytecode.cache_bytecode(); "
                  f"cProfile.run('import gapless.cli; gapless.cli.main()', {str(opts.cprofile.resolve())!r})")
        r = run_once("profiled", [sys.executable, "-c", script, *train_command(run_dir)[2:]], env, run_dir,
                     work / "profiled.log")
        print(f"[startup] warm under cProfile: {r['outside_s']:.1f} s to the end of step 1; stats in {opts.cprofile}",
              flush=True)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
