"""``python -m qil_worker {serve,generate}``."""

from __future__ import annotations

import argparse
import sys

from qil_worker.cli_generate import add_generate_parser
from qil_worker.service.cli import add_serve_parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qil_worker", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    add_generate_parser(sub)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
