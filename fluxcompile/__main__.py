"""``python -m fluxcompile demo [options]`` (see ``python -m fluxcompile demo --help``)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: python -m fluxcompile demo [--help] [options]\n\n"
            "  demo   compile a tensor-parallel Llama block with fluxcompile on 2 ranks and check it against eager"
        )
        return 0 if argv else 2
    if argv[0] == "demo":
        from .demo import main as demo_main

        return demo_main(argv[1:])
    print(f"unknown command {argv[0]!r}; try: python -m fluxcompile demo", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
