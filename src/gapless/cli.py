"""The `gapless` command: one thin function per subcommand; the work lives in the modules."""
from __future__ import annotations

import argparse
import sys

from gapless import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gapless", description=__doc__)
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


if __name__ == "__main__":
    sys.exit(main())
