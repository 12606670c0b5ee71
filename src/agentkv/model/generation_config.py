"""How a model asks to be sampled when a request says nothing: its ``generation_config.json``.

A model directory (mlx-lm's, a hub copy, an imported GGUF: the import writes the file from
the GGUF's ``general.sampling.*`` metadata) may hold ``generation_config.json``; its fields
mean what they mean to Hugging Face's ``generate``: the model samples only when
``do_sample`` is true, then at ``temperature`` with nucleus ``top_p`` (1.0 each when not
given), and is greedy otherwise; ``max_new_tokens`` bounds a reply. A model that says none
of these gets agentkv's default: greedy, and ``DEFAULT_MAX_TOKENS`` tokens, sized for a chat
reply (mlx_lm.server's defaults too). Other fields (``top_k``, ``repetition_penalty``...)
are not applied: agentkv samples with temperature and top_p only.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("agentkv.model")

GENERATION_CONFIG = "generation_config.json"
DEFAULT_MAX_TOKENS = 512
# The sampling every API accepts (OpenAI's range); the engine's sampler checks it too.
MAX_TEMPERATURE = 2.0
_SAYS = ("do_sample", "temperature", "top_p", "max_new_tokens")


@dataclass(frozen=True)
class GenerationDefaults:
    """The sampling of a request that names none; ``source`` says where it comes from:
    ``"generation_config.json"`` or ``"agentkv"`` (the model says nothing)."""

    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = DEFAULT_MAX_TOKENS
    source: str = "agentkv"


def read_generation_defaults(model_dir: Path) -> GenerationDefaults:
    """The defaults ``model_dir``'s ``generation_config.json`` gives (agentkv's where it has
    none, says nothing of sampling, or cannot be read: that is logged)."""
    path = Path(model_dir) / GENERATION_CONFIG
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        return GenerationDefaults()
    except (OSError, ValueError) as exc:
        log.warning("agentkv: ignoring %s (%s): greedy sampling by default", path, exc)
        return GenerationDefaults()
    return defaults_from(config) if isinstance(config, dict) else GenerationDefaults()


def defaults_from(config: dict) -> GenerationDefaults:
    """The defaults a generation config's fields give (Hugging Face's meaning of them); a
    field out of range is ignored (logged), as if it were not there."""
    if not any(key in config for key in _SAYS):
        return GenerationDefaults()
    sample = config.get("do_sample") is True
    temperature = (
        _number(config, "temperature", lambda t: 0 <= t <= MAX_TEMPERATURE) if sample else 0.0
    )
    top_p = _number(config, "top_p", lambda p: 0 < p <= 1) if sample else 1.0
    max_tokens = config.get("max_new_tokens", DEFAULT_MAX_TOKENS)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        log.warning("agentkv: ignoring max_new_tokens %r of a generation config", max_tokens)
        max_tokens = DEFAULT_MAX_TOKENS
    return GenerationDefaults(temperature, top_p, max_tokens, GENERATION_CONFIG)


def _number(config: dict, key: str, valid: Callable[[float], bool]) -> float:
    """``config[key]`` where it is a number ``valid`` takes; else 1.0 (Hugging Face's default
    of temperature and top_p alike)."""
    value = config.get(key, 1.0)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or not valid(value):
        log.warning("agentkv: ignoring %s %r of a generation config", key, value)
        return 1.0
    return float(value)


def gguf_generation_config(temperature: float | None, top_p: float | None) -> dict | None:
    """The ``generation_config.json`` of a GGUF's sampling metadata (``general.sampling.temp``
    and ``.top_p``, as llama.cpp reads them), or None where it names no temperature."""
    if temperature is None:
        return None
    config = {"do_sample": temperature > 0, "temperature": float(temperature)}
    if top_p is not None:
        config["top_p"] = float(top_p)
    return config
