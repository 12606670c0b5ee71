"""The KV format an engine uses for one model: the caller's bits, and a group size that
splits the model's head dims.

MLX quantizes in groups of 32, 64 or 128 values along the head dimension, so a group
must divide the head dim: head dim 64 or 128 takes the default group of 64, head dim 32
only 32, head dim 96 only 32. A group size the caller names is used as given (or
refused); left unset, the first of ``AUTO_GROUP_SIZES`` that fits is chosen.
"""

from __future__ import annotations

import logging

from ..errors import InvalidRequestError
from .quant import V1, V2, KVQuant
from .spec import ModelCacheSpec

# The default first (the format agentkv is measured in); then the smaller group, which
# costs more scales but keeps precision; the larger last.
AUTO_GROUP_SIZES = (64, 32, 128)
CHANNEL_TOKENS_FIRST = (64, 32)
log = logging.getLogger(__name__)


def fits(quant: KVQuant, key_dim: int, value_dim: int) -> bool:
    """Whether ``quant``'s groups split keys of ``key_dim`` and values of ``value_dim``."""
    return quant.fits(key_dim, value_dim)


def choose_kv_quant(
    spec: ModelCacheSpec,
    *,
    key_bits: int,
    value_bits: int,
    group_size: int | None,
    kv_format: int = 2,
) -> KVQuant:
    """The KV format for ``spec``'s model: ``group_size`` if given (refused with the head
    dim named if it does not fit), else the first of ``AUTO_GROUP_SIZES`` that fits.

    ``kv_format=2`` (docs/kv-format-v2.md) takes rotated per-channel keys with channel
    groups of 64 tokens, or 32 for a head dim of 32; where format 2 cannot store the model's
    KV (16-bit keys, 3/5/6-bit keys, a head dim that is not a power of two) the format is 1,
    logged."""
    sizes = AUTO_GROUP_SIZES if group_size is None else (group_size,)
    if kv_format == 2:
        for size in sizes:
            for tokens in CHANNEL_TOKENS_FIRST:
                try:
                    quant = KVQuant(key_bits, value_bits, size, **V2, channel_tokens=tokens)
                except InvalidRequestError:
                    break  # the bits: no channel groups at all
                if quant.fits(spec.key_head_dim, spec.value_head_dim):
                    return quant
        log.info(
            "KV format 2 cannot store %s's KV at %d/%d bits (head dims %d/%d); using format 1",
            spec.model_type, key_bits, value_bits, spec.key_head_dim, spec.value_head_dim,
        )  # fmt: skip
    if group_size is not None:
        quant = KVQuant(key_bits, value_bits, group_size, **V1)
        quant.check_head_dims(spec.key_head_dim, spec.value_head_dim)
        return quant
    for size in AUTO_GROUP_SIZES:
        quant = KVQuant(key_bits, value_bits, size, **V1)
        if quant.fits(spec.key_head_dim, spec.value_head_dim):
            return quant
    dims = (
        f"head dim {spec.key_head_dim}"
        if spec.key_head_dim == spec.value_head_dim
        else f"key head dim {spec.key_head_dim} / value head dim {spec.value_head_dim}"
    )
    raise InvalidRequestError(
        f"model {spec.model_type!r}: {dims} splits into none of the KV group sizes "
        f"{', '.join(map(str, AUTO_GROUP_SIZES))} at {key_bits}/{value_bits} bits "
        "(keys/values); store the KV in float16 (kv_bits=16 / --kv-bits 16)"
    )
