"""`logdiff` command line: one module per command, each with `add(subparsers)`. User mistakes end in one
line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import argparse
import sys

import torch

from logdiff import devices
from logdiff.cli import analyze, bench, bisect, capture, check, list_stacks, run, train
from logdiff.cli.options import EXIT_CODES, Parser, apply_pair_args, threads_from_args
from logdiff.errors import UserError

COMMANDS = (run, list_stacks, analyze, bisect, capture, check, bench, train)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="logdiff", description="Bitwise rollout-vs-trainer log-prob conformance (logdiff = 0).")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for command in COMMANDS:
        command.add(sub)
    for p in (parser, *sub.choices.values()):
        p.epilog, p.formatter_class = EXIT_CODES, argparse.RawDescriptionHelpFormatter
    return parser


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if hasattr(args, "rollout"):
            apply_pair_args(args)
        if not hasattr(args, "threads"):
            return args.func(args)
        before = torch.get_num_threads()
        torch.set_num_threads(threads_from_args(args))
        try:
            with devices.using(devices.resolve(getattr(args, "device", "cpu"))):
                return args.func(args)
        finally:
            torch.set_num_threads(before)  # in-process callers (tests) keep their own setting
    except UserError as e:
        print(f"logdiff: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("logdiff: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
