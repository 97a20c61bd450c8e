"""The ``ppd-router`` command: one subcommand per module, each registering itself."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Optional

from ppd_router import PpdError, __version__

# Modules under ppd_router that provide ``register(subparsers)``.
COMMANDS = [
    "table_cli",
    "serve",
    "bench.command",
    "bench.build_table",
    "emulate",
    "simulate",
    "launch",
    "tinymodel",
    "report",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ppd-router",
        description="PPD router for multi-turn LLM serving over disaggregated vLLM.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"ppd-router {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(f"ppd_router.{name}").register(sub)
    for p in subparsers_of(parser):
        # A prefix of a long flag must not silently pick it (`--session-t 5` once set session_ttl).
        p.allow_abbrev = False
    return parser


def subparsers_of(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """Every parser below ``parser`` (subcommands and their subcommands), each once."""
    found: list[argparse.ArgumentParser] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):  # aliases share one parser
                found += [child, *subparsers_of(child)]
    return found


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:
        # The reader (e.g. `head`) went away; that is not an error of ours.
        sys.stderr.close()
        return 0
    except (PpdError, ValueError, OSError, RuntimeError) as e:
        print(f"ppd-router {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
