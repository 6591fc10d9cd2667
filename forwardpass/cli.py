"""The ``forwardpass`` command.

Each subcommand lives in ``forwardpass/commands/<name>.py`` and exposes ``register(subparsers)``, which
adds its parser and sets ``func`` to a callable taking the parsed args. Command modules import heavy
dependencies (torch, the engine) inside their handlers so ``forwardpass --help`` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import sys

# Order is the order shown in --help. A module that does not exist (yet) is skipped.
COMMANDS = ["generate", "chat", "serve", "bench", "roofline", "image", "explain"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="forwardpass", description="Inference engine for generative models.")
    parser.add_argument("--log-level", default="WARNING", help="logging level (DEBUG, INFO, WARNING, ...)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        module_name = f"forwardpass.commands.{name}"
        if importlib.util.find_spec(module_name) is None:
            continue
        importlib.import_module(module_name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from forwardpass.errors import ForwardpassError

    try:
        return int(args.func(args) or 0)
    except ForwardpassError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
