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
