"""The `gapless` command: one thin function per subcommand; the work lives in the modules."""
from __future__ import annotations

import argparse
import os
import sys

from gapless import __version__


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
                   help="a YAML config (its data: section, or the whole file) or data files, one source each")
    p.add_argument("--tokenizer", metavar="DIR", help="HF tokenizer or model folder (overrides data.tokenizer)")
    p.add_argument("--format", default="auto",
                   choices=["auto", "messages", "sharegpt", "alpaca", "prompt_completion", "text"],
                   help="format of the data files given on the command line")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a data setting, e.g. --set max_seq_len=2048 --set on_error=skip")
    p.add_argument("--example", type=int, default=0, metavar="N", help="which document to decode (default 0)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object on the last line")
    p.set_defaults(func=run_data)


def run_data(args) -> int:
    from gapless.data.summary import data_config_from_inputs, inspect

    cfg = data_config_from_inputs(args.inputs, tokenizer=args.tokenizer, overrides=args.overrides, format=args.format)
    inspect(cfg, as_json=args.json, example=args.example)
    return 0


COMMANDS.append(register_data)


def register_train(sub) -> None:
    p = sub.add_parser("train", help="fine-tune from a YAML config",
                       description="Fine-tune a model from a YAML config, with dotted key=value overrides "
                                   "(e.g. train.steps=100 lora.r=8). Writes the run folder: config.yaml, "
                                   "metrics.jsonl, checkpoints/ and the adapter.")
    p.add_argument("config", help="the run's YAML config")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. optim.lr=1e-4")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    p.set_defaults(func=run_train)


def run_train(args) -> int:
    from gapless.config import load_config
    from gapless.train.loop import train

    from gapless.meter.timeline import process_start

    overrides = list(args.overrides) + (["resume=true"] if args.resume else [])
    train(load_config(args.config, overrides), started=process_start())
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
    print(f"wrote {'merged model' if args.merge else 'PEFT adapter'} to {out}")
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

    summary = demo(args.out, steps=args.steps)
    return 0 if summary["accuracy_after"] > summary["accuracy_before"] else 1


COMMANDS += [register_train, register_export, register_demo]


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
    p.add_argument("run", metavar="RUN", help="the run folder (its output_dir)")
    p.add_argument("--tensorboard", action="store_true", help="also write TensorBoard event files to RUN/tensorboard")
    p.add_argument("--wandb", action="store_true",
                   help="also replay the metrics into a Weights & Biases run (files in RUN/wandb; needs wandb)")
    p.add_argument("--wandb-project", default="gapless", help="the W&B project (default gapless)")
    p.add_argument("--wandb-mode", default="offline", choices=["offline", "online"],
                   help="offline (default): no network; upload later with `wandb sync RUN/wandb/offline-run-*`")
    p.set_defaults(func=run_report)


def run_report(args) -> int:
    from gapless.meter.report import write_report, write_tensorboard
    from gapless.meter.wandb_export import export_wandb

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
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. data.batching=padded")
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except ValueError as e:  # the user's mistakes: one clear line, no traceback
        print(f"gapless {args.command}: error: {e}", file=sys.stderr)
        return 2


def entry() -> None:
    """The `gapless` command (and `python -m gapless.cli`): main(), then the process ends without the interpreter's
    teardown of torch's and transformers' modules, which took 1-3 s on a CPU after a run's last record was written
    (its clock would otherwise disagree with one outside the process by that much). Everything is written and
    closed by then; the standard streams are flushed here."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
