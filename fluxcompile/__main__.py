"""``python -m fluxcompile <command> [options]``; the one command is ``demo``."""

from __future__ import annotations

import argparse
import sys

DESCRIPTION = "fluxcompile's command line: a torch.compile backend that fuses tensor-parallel collectives with matmuls."
DEMO_HELP = "compile a tensor-parallel Llama block with fluxcompile on several ranks and check it against eager"


def parser() -> argparse.ArgumentParser:
    """The top-level command line: each command parses its own options."""
    p = argparse.ArgumentParser(
        prog="python -m fluxcompile",
        description=DESCRIPTION,
        epilog="Run 'python -m fluxcompile demo --help' for the demo's options.",
    )
    commands = p.add_subparsers(title="commands", dest="command", metavar="COMMAND", help="the command to run")
    commands.add_parser("demo", help=DEMO_HELP, add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["demo"]:
        from .demo import main as demo_main

        return demo_main(argv[1:])
    p = parser()
    p.parse_args(argv)  # prints the help for -h, or an error naming the unknown command, and exits
    p.print_usage(sys.stderr)
    print("python -m fluxcompile: a command is required (try: python -m fluxcompile demo)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
