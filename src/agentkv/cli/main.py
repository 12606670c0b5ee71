"""``agentkv`` — persistent per-agent KV caches on MLX.

Every subcommand's --help describes it; ``agentkv doctor`` checks the setup.
"""

from __future__ import annotations

import logging
import sys

from ..errors import AgentKVError
from .parser import build_parser

__all__ = ["build_parser", "configure_logging", "main"]


def configure_logging(verbose: int) -> None:
    """agentkv's log on stderr: warnings by default, -v info, -vv debug for every library."""
    handler = logging.StreamHandler(sys.stderr)
    if verbose >= 2:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logging.basicConfig(level=logging.DEBUG, handlers=[handler])
        return
    log = logging.getLogger("agentkv")
    log.addHandler(handler)
    log.setLevel(logging.INFO if verbose else logging.WARNING)
    log.propagate = False


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.verbose)
    try:
        if args.command == "demo":
            from .demo import run_demo

            return run_demo(args)
        if args.command == "chat":
            from .chat import run_chat

            return run_chat(args)
        if args.command == "serve":
            from .serve import run_serve

            return run_serve(args)
        if args.command == "bench":
            from ..benchmarks.cli import run_bench

            return run_bench(args)
        from . import commands

        command = "models" if args.command == "model" else args.command
        return getattr(commands, f"run_{command}")(args)
    except AgentKVError as exc:
        print(f"agentkv: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("agentkv: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of our output went away (| head)
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
