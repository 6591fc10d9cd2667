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
COMMANDS = ["generate", "chat", "serve", "models", "bench", "roofline", "image", "video", "transcribe",
            "explain", "warmup"]


def build_parser() -> argparse.ArgumentParser:
    from forwardpass import __version__

    parser = argparse.ArgumentParser(prog="forwardpass",
                                     description="Inference engine for generative models.")
    parser.add_argument("--version", action="version", version=f"forwardpass {__version__}")
    parser.add_argument("--log-level", default=None, help=LOG_LEVEL_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        module_name = f"forwardpass.commands.{name}"
        if importlib.util.find_spec(module_name) is None:
            continue
        importlib.import_module(module_name).register(sub)
    _add_log_level(parser)
    _add_threads(parser)
    return parser


LOG_LEVEL_HELP = "logging level: DEBUG, INFO, WARNING (default), ERROR"


def _add_log_level(parser: argparse.ArgumentParser) -> None:
    """``--log-level`` is accepted after any (sub)command too: ``forwardpass serve --log-level INFO``."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                if "--log-level" not in child._option_string_actions:
                    child.add_argument("--log-level", default=argparse.SUPPRESS, help=LOG_LEVEL_HELP)
                _add_log_level(child)


THREADS_HELP = ("CPU threads to compute with (torch's pools and the compiled kernels; llama.cpp's -t); "
                "default: the cores this process may use (affinity mask, cgroup quota). On a machine with "
                "other work, fewer (even 1) is often faster")


def _add_threads(parser: argparse.ArgumentParser) -> None:
    """``--threads N`` on every (sub)command that does not define its own (``image`` and ``video`` do: their
    default is 1); ``forwardpass.threads`` resolves the default and applies the count in ``main``."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                if "--threads" not in child._option_string_actions:
                    child.add_argument("--threads", type=int, default=None, metavar="N", help=THREADS_HELP)
                _add_threads(child)


def main(argv: list[str] | None = None) -> int:
    # OpenMP's wait policy is already set: importing this module ran forwardpass/__init__.py (set_openmp_wait)
    parser = build_parser()
    args = parser.parse_args(argv)
    level = (args.log_level or "WARNING").upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        parser.error(f"--log-level {args.log_level!r}: choose DEBUG, INFO, WARNING, ERROR or CRITICAL")
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from forwardpass.errors import ForwardpassError

    try:
        if hasattr(args, "threads"):  # every command computes with one count, set before it starts
            from forwardpass.threads import apply_threads, check_threads

            args.threads = apply_threads(check_threads(args.threads, "--threads"))
        return int(args.func(args) or 0)
    except ForwardpassError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `forwardpass roofline --json | head`: the reader left; that is not an error
        import os

        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
