"""Argument types and the option groups several ``agentkv`` subcommands share."""

from __future__ import annotations

import argparse
import inspect
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

VERBOSE_HELP = "log what agentkv does (-vv: debug, and other libraries' logs too)"
KV_BITS = (2, 3, 4, 5, 6, 8, 16)
_CHOICES_OF_BITS = "{" + ",".join(map(str, KV_BITS)) + "}"
JSON_OBJECT = "print one JSON object"
JSON_LIST = "print a JSON list"

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 10**6,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 10**9,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tib": 1 << 40,
}


class Parser(argparse.ArgumentParser):
    """argparse's parser, but a usage error is one line: what is wrong with which option,
    and where its help is (argparse prints the usage block first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)\n")


def _integer(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def positive_int(text: str) -> int:
    """An argument type: a whole number of at least 1 (one message for any other text)."""
    value = _integer(text)
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, not {text!r}")
    return value


def int_between(low: int, high: int, what: str = "a whole number") -> Callable[[str], int]:
    """An argument type: a whole number in [low, high] (one message for any other text)."""

    def parse(text: str) -> int:
        value = _integer(text)
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected {what} from {low} to {high}, not {text!r}")
        return value

    return parse


def int_at_least(low: int, what: str) -> Callable[[str], int]:
    """An argument type: a whole number of at least ``low`` ``what``."""

    def parse(text: str) -> int:
        value = _integer(text)
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"expected at least {low} {what}, not {text!r}")
        return value

    return parse


def float_between(low: float, high: float | None = None) -> Callable[[str], float]:
    """An argument type: a number in [low, high] (no upper bound: ``high`` None)."""
    bounds = f"from {low:g} to {high:g}" if high is not None else f"of at least {low:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (low <= value and (high is None or value <= high)):  # NaN fails both
            raise argparse.ArgumentTypeError(f"expected a number {bounds}, not {text!r}")
        return value

    return parse


def one_of(values: tuple[int, ...]) -> Callable[[str], int]:
    """An argument type: one of ``values`` (one message for any other text)."""

    def parse(text: str) -> int:
        value = _integer(text)
        if value not in values:
            listed = ", ".join(map(str, values))
            raise argparse.ArgumentTypeError(f"expected one of {listed}, not {text!r}")
        return value

    return parse


def byte_size(text: str) -> int:
    """``2GiB``, ``512MiB``, ``1.5G``, ``1000000``: a positive number of bytes."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    value = int(float(match.group(1)) * _UNITS[unit]) if unit in _UNITS else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a size such as 2GiB or 512MiB, not {text!r}")
    return value


def wide_layers(text: str) -> tuple[int, ...] | None:
    """``--kv-wide-layers``: None (auto), () (none) or layer indices."""
    if text == "auto":
        return None
    if text == "none":
        return ()
    layers = tuple(_integer(part) for part in text.split(","))
    if any(i is None or i < 0 for i in layers):
        raise argparse.ArgumentTypeError(
            f"expected auto, none or layer numbers from 0 such as 19,20, not {text!r}"
        )
    return layers


def add_count(parser: argparse.ArgumentParser, flag: str, default: int, help: str | None = None):
    """A positive integer option."""
    parser.add_argument(flag, type=positive_int, default=default, help=help)


def add_flag(parser: argparse.ArgumentParser, flag: str, help: str) -> None:
    """An on/off option, off by default."""
    parser.add_argument(flag, action="store_true", help=help)


def add_engine_options(parser: argparse.ArgumentParser, *, many: bool = False) -> None:
    """The model, where its agents live, and the KV format they are stored in."""
    if many:
        parser.add_argument(
            "--model",
            action="append",
            default=None,
            help="mlx-lm model directory, .gguf file, Hugging Face id, or `embedded` (default: "
            "the embedded SmolLM2-135M-Instruct); repeat it to serve several models, one "
            "loaded at a time: a request's `model` picks one, and a swap first saves every "
            "agent of the other",
        )
    else:
        parser.add_argument(
            "--model",
            default=None,
            help="mlx-lm model directory, .gguf file or Hugging Face id "
            "(default: the embedded SmolLM2-135M-Instruct)",
        )
    parser.add_argument(
        "--cache-dir", default=None, help="where agents' KV caches live (default: $AGENTKV_HOME/kv)"
    )
    parser.add_argument(
        "--weights",
        default=None,
        choices=("quantized", "float32"),
        help="quantized: run 4- and 8-bit weights as the model ships them (on CPU through "
        "agentkv's quantized matmul: 98 MB for the embedded model, faster decode; "
        "docs/compute.md); float32: dequantize them at load (538 MB). Default: quantized",
    )
    _add_kv_format_options(parser)


def _add_kv_format_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kv-bits",
        type=one_of(KV_BITS),
        default=4,
        metavar=_CHOICES_OF_BITS,
        help="bits per stored key/value, 16 = float16 (default: 4)",
    )
    parser.add_argument(
        "--key-bits",
        type=one_of(KV_BITS),
        default=None,
        metavar=_CHOICES_OF_BITS,
        help="bits for keys only (default: --kv-bits); keys are the more sensitive: on the "
        "embedded model at 2K context --key-bits 8 with 4-bit values costs ~0.4%% perplexity "
        "where all-4-bit costs ~2.5%% (format 2; format 1: ~1%% and ~18%%; "
        "benchmarks/RESULTS.md)",
    )
    parser.add_argument(
        "--kv-format",
        type=one_of((1, 2)),
        default=None,
        metavar="{1,2}",
        help="stored KV layout (default 2): 2 keeps keys rotated and quantized per channel "
        "(the same bytes as 1; at 4 bits +2.5%% perplexity where 1, per-token keys, costs "
        "+18%% on the embedded model; docs/kv-format-v2.md); agents stored in the other "
        "convert once",
    )
    parser.add_argument(
        "--kv-wide-layers",
        type=wide_layers,
        default=None,
        metavar="auto|none|I,J,...",
        help="layers whose keys format 2 keeps at 8 bits (default auto: the layers whose "
        "4-bit keys cost the model most, measured once per model; 2 of the embedded model's "
        "30, +192 bytes a token)",
    )


def common_options() -> argparse.ArgumentParser:
    """What every subcommand (and sub-subcommand) takes besides its own options."""
    common = Parser(add_help=False)
    common.add_argument(
        "-v", "--verbose", action="count", default=argparse.SUPPRESS, help=VERBOSE_HELP
    )
    return common


def with_parents(add_parser, common: argparse.ArgumentParser):
    """Wrap a subparsers group's ``add_parser`` so that every parser it makes, and every
    subparsers group of those, takes ``common``'s options too."""

    def add(*args, **kwargs):
        kwargs.setdefault("parents", [common])
        parser = add_parser(*args, **kwargs)
        original = parser.add_subparsers

        def add_subparsers(**options):
            group = original(**options)
            group.add_parser = with_parents(group.add_parser, common)
            return group

        parser.add_subparsers = add_subparsers
        return parser

    return add


@dataclass(frozen=True)
class Command:
    """A subcommand: its name and one-line help; the function that adds its own options,
    whose docstring is the command's --help description; ``json``: the help of its
    ``--json`` flag, always its last option (None: no ``--json``); ``hidden_model``: a
    --model left out of --help (the embedded model unless a test names another)."""

    name: str
    help: str
    add_options: Callable[[argparse.ArgumentParser], None] | None = None
    aliases: tuple[str, ...] = ()
    json: str | None = None
    hidden_model: bool = False


def command(registry: list[Command], name: str, help: str, **options):
    """Decorator: register the options function below as subcommand ``name``."""

    def register(add_options):
        registry.append(Command(name, help, add_options, **options))
        return add_options

    return register


def add_commands(group, registry: list[Command]) -> None:
    """One parser per registered command, in the order they were registered."""
    for c in registry:
        parser = group.add_parser(
            c.name,
            aliases=list(c.aliases),
            help=c.help,
            description=inspect.getdoc(c.add_options) if c.add_options else None,
        )
        if c.add_options is not None:
            c.add_options(parser)
        if c.json is not None:
            parser.add_argument("--json", action="store_true", help=c.json)
        if c.hidden_model:
            parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
