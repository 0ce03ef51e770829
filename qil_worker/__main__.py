"""``python -m qil_worker {serve,generate}``."""

from __future__ import annotations

import argparse
import sys

from qil_client.cli_help import DefaultsHelpFormatter
from qil_worker.cli_generate import add_generate_parser
from qil_worker.service.cli import add_serve_parser

DESCRIPTION = (
    "qil: a Qwen3 inference engine. 'serve' runs the gRPC server, 'generate' runs one prompt "
    "in this process. Without --model, both use the embedded demo model (random weights)."
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m qil_worker", description=DESCRIPTION, formatter_class=DefaultsHelpFormatter,
        epilog="'python -m qil_worker COMMAND --help' lists a command's flags.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_serve_parser(sub)
    add_generate_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
