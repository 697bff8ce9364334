"""The `gapless` command: one thin function per subcommand; the work lives in the modules."""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import warnings
from pathlib import Path

from gapless import __version__

# warnings' own display function when nothing records warnings (pytest.warns, and pytest around every test, replace
# it with a list's append): _warnings_as_lines forwards to the recorder then
_STOCK_SHOWWARNMSG = getattr(warnings, "_showwarnmsg_impl", None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gapless", description="Fast, correct, measured fine-tuning of "
                                     "Llama-family models. Start with `gapless demo`.")
    parser.add_argument("--version", action="version", version=f"gapless {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for register in COMMANDS:
        register(sub)
    return parser


# Each entry adds one subparser and sets `func`; subcommands join as the issues that make them work land.
COMMANDS: list = []


def register_data(sub) -> None:
    p = sub.add_parser(
        "data", help="read, tokenize and batch a run's data; show what the model will learn",
        description="Read, tokenize (cached) and batch the data exactly as a run would, then print the summary "
                    "(records read, kept, truncated, dropped by reason, tokens, packing efficiency), a length "
                    "histogram and one decoded example with the trained text between « ».")
    p.add_argument("inputs", nargs="+", metavar="CONFIG_OR_FILE",
                   help="a YAML config (its data: section, or the whole file) with dotted key=value overrides "
                        "as train takes them, or data files, one source each")
    p.add_argument("--tokenizer", metavar="DIR", help="HF tokenizer or model folder (overrides data.tokenizer)")
    p.add_argument("--format", default="auto",
                   choices=["auto", "messages", "sharegpt", "alpaca", "prompt_completion", "text", "oasst",
                            "oasst_top1", "capybara", "glaive", "segments"],
                   help="format of the data files given on the command line")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a data setting, e.g. --set max_seq_len=2048 --set on_error=skip")
    p.add_argument("--example", type=int, default=0, metavar="N", help="which document to decode (default 0)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object on the last line")
    p.set_defaults(func=run_data)


def run_data(args) -> int:
    from gapless.data.pipeline import inspect
    from gapless.data.summary import data_config_from_inputs

    if args.example < 0:
        raise ValueError(f"--example: {args.example}; give the number of a document, from 0")
    # --set's data settings as the converted config's dotted overrides, checked with it
    data_overrides = [f"data.{o.removeprefix('data.')}" for o in args.overrides]
    peer = _peer_config(args.inputs[0], [*args.inputs[1:], *data_overrides])
    if peer is not None:  # an Axolotl, TRL or LLaMA-Factory config: its data as converted, as train reads it
        from dataclasses import replace

        cfg = replace(peer.data, tokenizer=args.tokenizer or peer.data.tokenizer or peer.model.path)
    else:
        cfg = data_config_from_inputs(args.inputs, tokenizer=args.tokenizer, overrides=args.overrides,
                                      format=args.format)
    inspect(cfg, as_json=args.json, example=args.example)
    return 0


def _peer_config(path: str, overrides: list[str]):
    """The run config of an Axolotl, TRL or LLaMA-Factory YAML (converted, its mapping printed: gapless.convert),
    for the commands that take a config as train does; None for a gapless config or anything else."""
    from gapless.config import read_yaml
    from gapless.convert import detect, load_any

    if Path(path).suffix not in (".yaml", ".yml") or not Path(path).is_file():
        return None
    raw = read_yaml(path)
    return load_any(path, overrides) if isinstance(raw, dict) and detect(raw) != "gapless" else None


COMMANDS.append(register_data)


def register_train(sub) -> None:
    p = sub.add_parser("train", help="fine-tune from a YAML config",
                       description="Fine-tune a model from a YAML config, with dotted key=value overrides "
                                   "(e.g. train.steps=100 lora.r=8). Writes the run folder: config.yaml, "
                                   "metrics.jsonl, checkpoints/ and the adapter.")
    p.add_argument("config", help="the run's YAML config")
    p.add_argument("overrides", nargs="*", default=[], metavar="KEY=VALUE", help="dotted overrides, e.g. optim.lr=1e-4")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    p.add_argument("--dry-run", action="store_true", help="print the predicted peak memory, tokens per step, steps "
                   "and time, then stop (no weights are loaded)")
    p.add_argument("--gpu-gib", type=float, help="with --dry-run: the GPU's memory, to say whether it fits")
    p.add_argument("--tokens-per-s", type=float, help="with --dry-run: a measured rate for the time estimate")
    p.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="N processes on this machine (one per GPU) through torchrun: the same as "
                        "`torchrun --standalone --nproc-per-node N -m gapless.cli train CONFIG ...`")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the run the output folder holds (its checkpoints, metrics and final output)")
    p.set_defaults(func=run_train)


def run_train(args) -> int:
    from gapless.convert import check_run_paths, load_any  # the config first, without torch: its weights' readahead
    from gapless.readahead import read_ahead
    from gapless.train.runlock import launched_by_torchrun, output_dir_overrides

    for value, flag in ((args.gpu_gib, "--gpu-gib"), (args.tokens_per_s, "--tokens-per-s")):
        if value is not None and not value > 0:
            raise ValueError(f"{flag}: {value}; give a positive number")
        if value is not None and not args.dry_run:
            print(f"gapless train: warning: {flag} is read by --dry-run only; ignored", file=sys.stderr)
    overrides = list(args.overrides) + (["resume=true"] if args.resume else [])
    if not launched_by_torchrun():  # ranks get the launcher's output_dir (a time in its name would differ by rank)
        overrides += output_dir_overrides(args.config, overrides, resume=args.resume)  # runs/NAME-TIME by default
    # a gapless, Axolotl, TRL or LLaMA-Factory YAML (gapless.convert); a bad config fails here, once, not in every rank
    cfg = load_any(args.config, overrides)
    check_run_paths(cfg)
    if not args.dry_run:
        read_ahead(cfg.model.path)  # the weights read from disk while torch is imported (gapless.readahead)
    from gapless.diagnosis.doctor import startup_report
    from gapless.diagnosis.environment import write_environment
    from gapless.meter.timeline import process_start
    from gapless.train.loop import train

    started = process_start()  # from /proc: the process's start, whenever it is read
    cfg.check_output_dir()  # before environment.json is written into it
    if args.dry_run:
        from gapless.meter.memory import dry_run_report

        print(dry_run_report(cfg, gpu_gib=args.gpu_gib, tokens_per_s=args.tokens_per_s))
        return 0
    from gapless.meter.sinks import require

    require(cfg.train.report_to)  # a missing tensorboard or wandb package: now, before any rank starts
    if args.nproc is not None and not launched_by_torchrun():
        if args.nproc < 1:
            raise ValueError(f"--nproc: {args.nproc}; give the number of processes (GPUs) to run, e.g. 8")
        from torch.distributed.run import main as torchrun

        # torchrun's agent: it starts the ranks, ends them all when one fails, and exits non-zero with its error
        torchrun(["--standalone", "--nproc-per-node", str(args.nproc), "-m", "gapless.cli", "train", args.config,
                  *overrides, *(["--overwrite"] if args.overwrite else [])])
        return 0
    if os.environ.get("RANK", "0") == "0":  # several ranks: rank 0 alone checks, prints and writes
        report = startup_report(cfg)  # the doctor's quick checks (~40 ms): the warnings and errors, before any work
        if report:
            print(report, file=sys.stderr, flush=True)
        write_environment(cfg.output_dir)  # environment.json: `gapless doctor --compare RUN_A RUN_B` reads it
    if launched_by_torchrun():
        from torch.distributed.elastic.multiprocessing.errors import record

        train = record(train)  # the failing rank's traceback goes to torchrun's error file and summary
    result = train(cfg, started=started, overwrite=args.overwrite)
    if result.stopped in ("nonfinite", "final_write"):
        return 1
    if result.stopped is not None:  # a stop signal: checkpointed, ready for --resume, but not done
        # 128 + the signal, as a shell reports a process it ended: `gapless train && gapless export` stops at a
        # Ctrl-C, and a scheduler (a Kubernetes Job, a SLURM requeue script) sees a preempted run as unfinished
        code = 128 + (signal.SIGINT if result.stopped == "SIGINT" else signal.SIGTERM)
        print(f"gapless train: {result.stopped}: exit {code}; continue with --resume", file=sys.stderr)
        return code
    return 0


def register_convert(sub) -> None:
    p = sub.add_parser("convert-config",
                       help="write the gapless config equivalent to an Axolotl, TRL or LLaMA-Factory YAML",
                       description="Detect an Axolotl, TRL SFTConfig-style or LLaMA-Factory training YAML, print the "
                                   "mapping applied, and "
                                   "write the equivalent gapless YAML; every setting gapless cannot honour is "
                                   "named, and nothing is written. (`gapless train` accepts such a file directly.)")
    p.add_argument("source", metavar="IN", help="the Axolotl, TRL or LLaMA-Factory YAML")
    p.add_argument("--out", required=True, metavar="OUT", help="the gapless YAML to write")
    p.set_defaults(func=run_convert)


def run_convert(args) -> int:
    from gapless.convert import write_gapless_yaml

    conv = write_gapless_yaml(args.source, args.out)
    print(conv.format())
    print(f"wrote {args.out}")
    if conv.hub_paths:  # what `gapless train` would refuse: say it now, while the file is being edited
        print(f"before `gapless train {args.out}`, set these to local folders (gapless downloads nothing):")
        print("\n".join(f"  {line}" for line in conv.hub_paths))
    return 0


def register_export(sub) -> None:
    p = sub.add_parser("export", help="write a run's PEFT adapter or a merged HF model folder",
                       description="Export the adapter of a run folder, its final adapter folder or one of its "
                                   "checkpoints: as a PEFT adapter, or with --merge as a merged HF model folder "
                                   "that transformers and vLLM load.")
    p.add_argument("source", metavar="RUN_OR_CHECKPOINT", help="a run folder, its adapter/ or a checkpoints/step-N")
    p.add_argument("--out", required=True, metavar="DIR", help="the folder to write")
    p.add_argument("--merge", action="store_true", help="merge LoRA into the base weights (a full HF folder)")
    p.add_argument("--dtype", default=None, help="dtype of the merged weights (default: the base's)")
    p.set_defaults(func=run_export)


def run_export(args) -> int:
    from gapless.train.export import export

    out = export(args.source, args.out, merge=args.merge, dtype=args.dtype)
    # a full fine-tuning run exports its model (every weight trained) with or without --merge
    wrote = "PEFT adapter" if (out / "adapter_config.json").is_file() else "merged model" if args.merge else "model"
    print(f"wrote {wrote} to {out}")
    return 0


def register_demo(sub) -> None:
    p = sub.add_parser("demo", help="a complete fine-tuning run on the CPU, no downloads (about a minute)",
                       description="Build a tiny Llama as an HF folder and a procedural task, fine-tune it with "
                                   "LoRA through the real code path, and show accuracy before and after.")
    p.add_argument("--out", default="runs/demo", metavar="DIR", help="where the demo writes (default runs/demo)")
    p.add_argument("--steps", type=int, default=400, help="optimizer steps (default 400)")
    p.set_defaults(func=run_demo)


def run_demo(args) -> int:
    from gapless.demo import run_demo as demo
    from gapless.diagnosis.environment import write_environment

    if args.steps < 1:  # train.steps 0 would mean a pass over the data, not no training
        raise ValueError(f"--steps: {args.steps}; give the optimizer steps to train, e.g. 400")
    write_environment(Path(args.out) / "run")  # as `gapless train` does: `gapless doctor --compare` reads it
    summary = demo(args.out, steps=args.steps)
    return 0 if summary["accuracy_after"] > summary["accuracy_before"] else 1


COMMANDS += [register_train, register_convert, register_export, register_demo]


def register_bench(sub) -> None:
    p = sub.add_parser("bench", help="training throughput of the optimisation ladder (real LoRA steps)",
                       description="Time real LoRA training steps (random weights of --model's architecture, "
                                   "batches from the real data path) for each configuration of the ladder; append "
                                   "one JSON row per configuration to --out and regenerate the table in "
                                   "RESULTS.md beside it. See gapless/bench.py for what is measured.")
    p.add_argument("--model", default="bench/models/llama-3.2-3b", metavar="DIR",
                   help="a folder with the architecture's config.json (no weights needed)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--ladder", action="store_true", help="every rung of the ladder, in order (the default)")
    which.add_argument("--config", metavar="NAME[,NAME]",
                       help="configurations to run, e.g. best or packed_sdpa (CPU); a wrong name lists them all")
    which.add_argument("--show", action="store_true", help="print the table of a run in --out (--run-id or the last)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per configuration (default 8)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compiles, allocator; default 3)")
    p.add_argument("--profile-steps", type=int, default=2,
                   help="steps of the separate forward/backward/optimizer profiling pass (default 2)")
    p.add_argument("--lengths", metavar="FILE", help="token lengths of documents (random token ids); "
                                                     "replaces --data/--tokenizer")
    p.add_argument("--data", default="../shared/data/messages", metavar="PATH", help="the messages data")
    p.add_argument("--tokenizer", default="../shared/tokenizers/llama3", metavar="DIR", help="its tokenizer")
    p.add_argument("--max-seq-len", type=int, default=4096, help="row length and document cap (default 4096)")
    p.add_argument("--tokens-per-batch", type=int, default=16384, help="slots per step (default 16384)")
    p.add_argument("--lora-r", type=int, default=16, help="LoRA rank on all 7 projections (default 16)")
    p.add_argument("--dtype", default=None, help="model dtype (default bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--peers", action="store_true", help="also run the HF+PEFT peer (needs --lengths)")
    p.add_argument("--peers-dir", default="../shared/peers", metavar="DIR", help="folder of hf_peft_bench.py")
    p.add_argument("--peers-configs", default="packed_sdpa,pad_max4096_ckpt", metavar="NAME[,NAME]",
                   help="the peer's configurations (default packed_sdpa,pad_max4096_ckpt)")
    p.add_argument("--peers-args", default="", metavar="ARGS",
                   help="extra arguments for the peer, e.g. --peers-args=--tiny")
    p.add_argument("--out", default="bench/results.jsonl", metavar="FILE", help="rows are appended here")
    p.add_argument("--results-md", default=None, metavar="FILE",
                   help="the Markdown table (default: RESULTS.md beside --out)")
    p.add_argument("--run-id", default=None, help="shared by every row of one invocation (default: time + random)")
    p.add_argument("--time-limit-s", type=float, default=None,
                   help="skip configurations that would not finish within this many seconds of the start")
    p.set_defaults(func=run_bench)


def run_bench(args) -> int:
    from gapless.bench import main as bench

    return bench(args)


COMMANDS.append(register_bench)


def register_report(sub) -> None:
    p = sub.add_parser("report", help="write RUN/report.html: plots, time accounting, GPU findings",
                       description="Read a run folder (config.yaml, metrics.jsonl, gpu.jsonl, gap.json) and write "
                                   "RUN/report.html, one self-contained page with the plots embedded.")
    p.add_argument("runs", nargs="+", metavar="RUN",
                   help="the run folder (its output_dir); several: a compare page with their curves overlaid and "
                        "their config and environment differences")
    p.add_argument("--out", default="compare.html", metavar="FILE",
                   help="the compare page of several runs (default compare.html)")
    p.add_argument("--tensorboard", action="store_true", help="also write TensorBoard event files to RUN/tensorboard")
    p.add_argument("--wandb", action="store_true",
                   help="also replay the metrics into a Weights & Biases run (files in RUN/wandb; needs wandb)")
    p.add_argument("--wandb-project", default="gapless", help="the W&B project (default gapless)")
    p.add_argument("--wandb-mode", default="offline", choices=["offline", "online"],
                   help="offline (default): no network; upload later with `wandb sync RUN/wandb/offline-run-*`")
    p.set_defaults(func=run_report)


def run_report(args) -> int:
    from gapless.meter.report import write_compare, write_report
    from gapless.meter.sinks import export_wandb, write_tensorboard

    if len(args.runs) > 1:
        if args.tensorboard or args.wandb:
            raise ValueError("--tensorboard and --wandb export one run; give one RUN")
        print(f"wrote {write_compare(args.runs, args.out)}")
        return 0
    args.run = args.runs[0]
    print(f"wrote {write_report(args.run)}")
    if args.tensorboard:
        print(f"wrote {write_tensorboard(args.run)}")
    if args.wandb:
        print(f"wrote {export_wandb(args.run, project=args.wandb_project, mode=args.wandb_mode)}")
    return 0


COMMANDS.append(register_report)


def register_gap(sub) -> None:
    p = sub.add_parser("gap", help="measure what each of a config's settings costs against advertised conditions",
                       description="Start from advertised conditions (full rows of random tokens, packed, no "
                                   "checkpoints, evaluation or logging, data ready, bfloat16 on a GPU) and switch "
                                   "on the config's real settings one at a time (lengths and batching, gradient "
                                   "accumulation, logging, checkpoints, evaluation, data loading, precision), each "
                                   "in a short measured training window; print the waterfall as a table, write "
                                   "gap.json, gap.png and gap.html. See gapless/diagnosis/gap.py for what is measured.")
    p.add_argument("target", metavar="CONFIG_OR_RUN",
                   help="a YAML config, or a run folder (its config.yaml; its gap.json and report.html are updated)")
    p.add_argument("overrides", nargs="*", default=[], metavar="KEY=VALUE",
                   help="dotted overrides, e.g. data.batching=padded")
    p.add_argument("--steps", type=int, default=None, metavar="N",
                   help="measured steps per window, after 1 warm-up step (default 20)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="where the windows and gap.json go (default RUN/gap for a run folder, else runs/gap)")
    p.set_defaults(func=run_gap)


def run_gap(args) -> int:
    from gapless.diagnosis.gap import DEFAULT_STEPS, run_gap as gap

    gap(args.target, args.overrides, steps=DEFAULT_STEPS if args.steps is None else args.steps, out=args.out)
    return 0


COMMANDS.append(register_gap)


def register_doctor(sub) -> None:
    p = sub.add_parser("doctor", help="pre-flight checks of the machine and a config, each with its cost and fix",
                       description="Check the environment (Python, torch, CUDA, driver, GPU, bf16, TF32, NCCL, fast "
                                   "kernels, CPU cores, disk, HF and CUDA variables, tested versions) and, given a "
                                   "config, the run (padding on your data, tokens per step, accumulation, checkpoint "
                                   "and logging intervals, token cache, memory, precision, activation checkpointing, "
                                   "compile). Exit code 1 when a finding is an error. See gapless/diagnosis/doctor.py.")
    p.add_argument("config", nargs="?", metavar="CONFIG_OR_RUN",
                   help="the run's YAML config, or a run folder (its config.yaml, plus what its metrics and GPU "
                        "samples show); without it, the environment only")
    p.add_argument("overrides", nargs="*", default=[], metavar="KEY=VALUE",
                   help="dotted overrides, e.g. data.batching=padded")
    p.add_argument("--json", action="store_true", help="print one JSON object (findings with ids) instead of the table")
    p.add_argument("--nproc", type=int, default=None, metavar="N", help="the GPUs (processes) the run will use, as "
                   "`gapless train --nproc N` (default WORLD_SIZE under torchrun, else 1)")
    p.add_argument("--compare", nargs=2, metavar=("RUN_A", "RUN_B"),
                   help="what differs between two run folders' environment.json and config.yaml")
    p.add_argument("--nccl", action="store_true", help="all-reduce bandwidth across the visible GPUs, 1 MiB to 1 GiB "
                   "(under torchrun, or spawning one process per GPU)")
    p.add_argument("--backend", default="nccl", choices=["nccl", "gloo"], help="--nccl's backend (gloo: CPU processes)")
    p.add_argument("--procs", type=int, default=None, help="--nccl: processes to spawn (default: one per GPU; gloo 2)")
    p.add_argument("--max-mib", type=int, default=1024, help="--nccl: the largest message in MiB (default 1024)")
    p.set_defaults(func=run_doctor)


def run_doctor(args) -> int:
    import json

    if args.compare:
        from gapless.diagnosis.environment import compare_runs, format_comparison

        cmp = compare_runs(*args.compare)
        print(json.dumps(cmp, default=str) if args.json else format_comparison(cmp, *args.compare))
        return 0
    if args.nccl:
        from gapless.diagnosis.nccl import MIB, expected_link, format_allreduce, run_allreduce

        sizes = [MIB << i for i in range(12) if MIB << i <= args.max_mib * MIB]
        result = run_allreduce(args.backend, args.procs, sizes)
        if result.get("rank", 0) == 0:
            link = expected_link() if args.backend == "nccl" else None
            print(json.dumps(result) if args.json else format_allreduce(result, link))
        return 0
    from gapless.diagnosis.doctor import diagnose_target, format_findings, to_json

    result = diagnose_target(args.config, args.overrides, gpus=args.nproc)
    print(to_json(result) if args.json else format_findings(result["findings"]))
    if not args.json and result["facts"].get("step_source"):
        print(f"step time: {result['facts']['step_source']}")
    return 1 if any(f.severity == "error" for f in result["findings"]) else 0


def register_plan(sub) -> None:
    p = sub.add_parser("plan", help="predict time, GPU-hours and scaling of a config on named GPUs",
                       description="Predict the run's time to train, memory per GPU (DDP replica or FSDP2 "
                                   "shards; fits / tight / does not fit, with the fix), scaling efficiency (DDP "
                                   "gradient or FSDP2 parameter traffic over the link) and GPU-hours on each GPU "
                                   "choice, and say where more GPUs stop paying. See gapless/diagnosis/plan.py.")
    p.add_argument("config", help="the run's YAML config (its data are read through the token cache)")
    p.add_argument("overrides", nargs="*", default=[], metavar="KEY=VALUE", help="dotted overrides")
    p.add_argument("--gpus", default="H100x8", help="GPU[xN], comma-separated, e.g. GB10,H100,H100x8 (default H100x8)")
    p.add_argument("--strategy", default=None, choices=["auto", "ddp", "fsdp", "fsdp2"],
                   help="default: the config's parallel.strategy (auto: FSDP2 for full fine-tuning, DDP for LoRA; "
                        "fsdp is FSDP2)")
    p.add_argument("--run", metavar="RUN", help="a run folder whose measured tokens/s replaces the stated figure")
    p.add_argument("--measured", metavar="TOKS@GPU", help="a measured single-GPU rate, e.g. 34100@H200")
    p.add_argument("--startup-s", type=float, default=None, help="start-up seconds (default 39, the example 3B config's cold start on an H100)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run_plan)


def run_plan(args) -> int:
    import json

    from gapless.convert import load_any
    from gapless.diagnosis.plan import format_plan, plan, plan_json

    preds, workload, stops = plan(load_any(args.config, args.overrides), args.gpus, strategy=args.strategy,
                                  run=args.run, measured=args.measured, startup_s=args.startup_s)
    print(json.dumps(plan_json(preds, workload, stops)) if args.json else format_plan(preds, workload, stops))
    return 0


def register_compare_precision(sub) -> None:
    p = sub.add_parser("compare-precision", help="the same steps under fp32, TF32, bf16 and fp16: loss and speed",
                       description="Run the config for --steps optimizer steps with the same seeds and batches under "
                                   "fp32 (TF32 off, the reference), TF32 on, bf16 and fp16 (with the dynamic loss "
                                   "scaler); print the loss differences and tokens/s; write precision.html with the "
                                   "curves. See gapless/diagnosis/precision.py.")
    p.add_argument("config", help="the run's YAML config")
    p.add_argument("overrides", nargs="*", default=[], metavar="KEY=VALUE", help="dotted overrides")
    p.add_argument("--steps", type=int, default=50, help="optimizer steps per variant (default 50)")
    p.add_argument("--out", default="runs/compare-precision", metavar="DIR", help="where the runs and the page go")
    p.add_argument("--variants", default="fp32,tf32,bf16,fp16", help="comma-separated subset of fp32,tf32,bf16,fp16")
    p.set_defaults(func=run_compare_precision)


def run_compare_precision(args) -> int:
    from gapless.diagnosis.precision import VARIANTS, compare_precision, format_comparison

    if args.steps < 1:
        raise ValueError(f"--steps: {args.steps}; give the optimizer steps of each variant, e.g. 50")
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"--variants: {unknown} not among {list(VARIANTS)}")
    result = compare_precision(args.config, args.overrides, steps=args.steps, out=args.out, variants=variants,
                               log=lambda line: print(line, flush=True))
    print(format_comparison(result))
    print(f"wrote {args.out}/precision.html")
    return 0


COMMANDS += [register_doctor, register_plan, register_compare_precision]


def _generation_args(p) -> None:
    p.add_argument("source", metavar="RUN_OR_MODEL",
                   help="a run folder (its adapter on its base), an adapter folder, or a model folder (base or merged)")
    p.add_argument("--base", metavar="DIR", help="the base model under an adapter (default: the one it names)")
    p.add_argument("--max-new-tokens", type=int, default=256, metavar="N", help="default 256")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sampled")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1: off)")
    p.add_argument("--seed", type=int, default=None, help="the sampling seed (default: random)")
    p.add_argument("--system", default=None, help="a system message before the user's")
    p.add_argument("--device", default="auto", help="auto (CUDA when available) | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default=None,
                   help="the dtype computed in (default: on CUDA the run's model.dtype, else bfloat16; float32 on "
                        "the CPU)")
    _unquantised_base_arg(p)


def _unquantised_base_arg(p) -> None:
    p.add_argument("--unquantised-base", "--unquantized-base", action="store_true",
                   help="a QLoRA run's adapter on its base as the checkpoint holds it (in --dtype), not on the NF4 "
                        "base it trained on (the default); e.g. to see what the adapter does on the original weights")


def _load_generation(args):
    from gapless.convert import check_local
    from gapless.model.generate import load_for_generation, stop_ids

    # before the model is loaded (minutes for a large one), not after
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens: {args.max_new_tokens}; give the most tokens to generate, e.g. 256")
    if args.temperature < 0:
        raise ValueError(f"--temperature: {args.temperature}; give 0 (greedy) or more (sampled, e.g. 0.7)")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p: {args.top_p}; give the nucleus mass in (0, 1], e.g. 0.9 (1 turns it off)")
    for value, name in ((args.source, "RUN_OR_MODEL"), (args.base, "--base")):
        error = check_local(value, name, "the model")
        if error:
            raise ValueError(error)
    loaded = load_for_generation(args.source, device=args.device, dtype=args.dtype, base=args.base,
                                 unquantised_base=args.unquantised_base)
    print(f"loaded {loaded.what}", file=sys.stderr)
    return loaded, stop_ids(loaded)


def _reply(args, loaded, stop, messages: list[dict], raw: bool = False):
    from gapless.model.generate import decode, encode_chat, generate_ids

    prompt = encode_chat(loaded.tokenizer, messages, raw=raw)
    gen = generate_ids(loaded.model, prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       top_p=args.top_p, stop=stop, seed=args.seed)
    return decode(loaded.tokenizer, gen), gen


def _stats(gen) -> str:
    return (f"[{gen.prompt_tokens} prompt tokens in {gen.prefill_s:.2f} s; {len(gen.tokens)} new tokens, "
            f"{gen.tokens_per_s:,.1f} tokens/s; stopped at {gen.stopped}]")


def register_generate(sub) -> None:
    p = sub.add_parser("generate", help="continue a prompt with a run's model (chat template, KV cache)",
                       description="Load a run's adapter on its base as the run trained it (a QLoRA run's on "
                                   "the NF4 base; or a base or merged model folder), put the prompt through the "
                                   "chat template and decode with a KV cache: greedy by default, sampled with "
                                   "--temperature/--top-p; stops at the end of the turn. Prints what it loaded (the "
                                   "base's precision with it), the reply, then the token counts and tokens/s on "
                                   "stderr.")
    _generation_args(p)
    p.add_argument("--prompt", required=True, action="append", help="the user's message (repeat for several)")
    p.add_argument("--raw", action="store_true", help="continue the text as is, without the chat template")
    p.set_defaults(func=run_generate)


def run_generate(args) -> int:
    loaded, stop = _load_generation(args)
    for prompt in args.prompt:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
            [{"role": "user", "content": prompt}]
        text, gen = _reply(args, loaded, stop, messages, raw=args.raw)
        print(text)
        print(_stats(gen), file=sys.stderr)
    return 0


def register_chat(sub) -> None:
    p = sub.add_parser("chat", help="talk to a run's model in the terminal",
                       description="An interactive chat with a run's model (as `gapless generate`, keeping the "
                                   "conversation). An empty line or /exit ends it, /reset starts over.")
    _generation_args(p)
    p.set_defaults(func=run_chat)


def run_chat(args) -> int:
    loaded, stop = _load_generation(args)
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(start)
    print("chat: an empty line or /exit ends, /reset starts over", file=sys.stderr)
    while True:
        try:
            line = input("you> ")
        except EOFError:
            break
        if line.strip() in ("", "/exit"):
            break
        if line.strip() == "/reset":
            messages = list(start)
            continue
        messages.append({"role": "user", "content": line})
        try:
            text, gen = _reply(args, loaded, stop, messages)
        except ValueError as e:  # e.g. a character the tokenizer cannot encode: say so, keep the conversation
            messages.pop()
            print(f"error: {e}", file=sys.stderr)
            continue
        messages.append({"role": "assistant", "content": text})
        print(f"model> {text}")
        print(_stats(gen), file=sys.stderr)
    return 0


def register_eval(sub) -> None:
    p = sub.add_parser("eval", help="loss and perplexity on held-out data; GSM8K exact match",
                       description="Evaluate a run's model as the run built it (its adapter on its base, NF4 for a "
                                   "QLoRA run; a full run's model/): the mean loss and perplexity over the trained "
                                   "tokens of --data, read, templated, masked and batched exactly as the run's data "
                                   "config does (on the run's eval data, its own eval loss); and with --gsm8k, exact "
                                   "match of the `#### N` answer by greedy generation. Results go to RUN/eval.json "
                                   "and the console, with the model evaluated (the base's precision with it).")
    p.add_argument("run", metavar="RUN", help="the run folder")
    p.add_argument("--data", action="append", default=[], metavar="PATH",
                   help="held-out data (a file, glob or folder; repeat for several)")
    p.add_argument("--gsm8k", metavar="FILE", help="GSM8K-style records ({question, answer} with `#### N`)")
    p.add_argument("--limit", type=int, default=50, metavar="N", help="GSM8K problems to try (default 50)")
    p.add_argument("--max-new-tokens", type=int, default=320, metavar="N", help="per GSM8K answer (default 320)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    _unquantised_base_arg(p)
    p.set_defaults(func=run_eval)


def run_eval(args) -> int:
    from gapless.train.evaluate import evaluate_run

    if not args.data and not args.gsm8k:
        raise ValueError("eval: give --data PATH (loss, perplexity) and/or --gsm8k FILE (exact match)")
    if args.gsm8k and (args.limit < 1 or args.max_new_tokens < 1):
        raise ValueError(f"--limit {args.limit}, --max-new-tokens {args.max_new_tokens}: give at least 1 of each")
    results = evaluate_run(args.run, data=args.data, gsm8k=args.gsm8k, limit=args.limit,
                           max_new_tokens=args.max_new_tokens, device=args.device,
                           unquantised_base=args.unquantised_base)
    print(f"model: {results[0]['model']}")  # which base, for a QLoRA run: NF4 as trained, or unquantised
    for r in results:
        if r["kind"] == "loss":
            print(f"{r['data']}: loss {r['loss']:.4f}, perplexity {r['perplexity']:.2f} over "
                  f"{r['tokens']:,} trained tokens of {r['documents']:,} documents")
        else:
            print(f"{r['data']}: exact match {r['correct']}/{r['total']} = {r['exact_match']:.1%} "
                  f"({r['tokens_per_s']:,.1f} tokens/s)")
    print(f"wrote {Path(args.run) / 'eval.json'}")
    return 0


COMMANDS += [register_generate, register_chat, register_eval]


# GAPLESS_DEBUG=1: a user's mistake (ValueError) or a file error (OSError) raises with its traceback instead of the
# one line
DEBUG = "GAPLESS_DEBUG"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # options and KEY=VALUE overrides in any order (`train CONFIG --resume a=b`): argparse stops filling the
    # positional overrides at the first option, so the ones after it come back unparsed
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not (hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra)):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        with _warnings_as_lines(args.command):
            return int(args.func(args) or 0)
    except ValueError as e:  # the user's mistakes: one clear line, no traceback
        if os.environ.get(DEBUG):
            raise
        print(f"gapless {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a path that cannot be written or read (a missing parent, a full disk): it names the file
        if os.environ.get(DEBUG):
            raise
        where = f"{e.filename}: " if e.filename else ""
        print(f"gapless {args.command}: error: {where}{e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C outside the training loop (which stops cleanly on its own)
        print(f"gapless {args.command}: interrupted", file=sys.stderr)
        return 130


@contextlib.contextmanager
def _warnings_as_lines(command: str):
    """A Python warning raised by a command prints as `gapless COMMAND: warning: MESSAGE`, each distinct message once,
    not as Python's two lines naming gapless's source file (a training run routes its own: Progress.route_warnings)."""
    seen: set[str] = set()
    with warnings.catch_warnings():  # the filters stay the caller's: an "error" filter still raises
        previous = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if str(message) not in seen:
                seen.add(str(message))
                print(f"gapless {command}: warning: {message}", file=sys.stderr)
            if getattr(warnings, "_showwarnmsg_impl", None) is not _STOCK_SHOWWARNMSG:  # being recorded
                previous(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        yield


def entry() -> None:
    """The `gapless` command (and `python -m gapless.cli`): main(), then the process ends without the interpreter's
    teardown of torch's and transformers' modules, which took 1-3 s on a CPU after a run's last record was written
    (its clock would otherwise disagree with one outside the process by that much). Everything is written and
    closed by then; the standard streams are flushed here. Before anything heavy is imported, the imports' bytecode
    is kept in gapless's cache where Python would compile it again on every start (gapless.bytecode)."""
    try:
        from gapless.bytecode import cache_bytecode

        cache_bytecode()
        code = main()
    except KeyboardInterrupt:  # Ctrl-C before main's own handler is in place (imports, parsing the arguments)
        print("gapless: interrupted", file=sys.stderr)
        code = 130
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
