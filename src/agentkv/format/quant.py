"""How KV tensors are stored: bits per kind (keys, values), group size, key scheme.

A quantized kind is stored as MLX affine quantization: packed uint32 words plus
a float16 scale and bias per group of ``group_size`` values along the head
dimension. 16 bits means plain float16. Each (kind, part) is a *component*: one
array per layer, laid out like an mlx-lm cache array ``[1, heads, tokens, width]``.

Format version 2 (``key_scheme="channel"``, ``rotate=True``; docs/kv-format-v2.md)
changes what the same bytes mean, not their size:

* keys are quantized **per channel** over each run of ``channel_tokens`` tokens (a
  *channel group*, aligned to multiples of ``channel_tokens`` from token 0): one float16
  scale and bias per channel per group. The words stay one row per token (packed along
  the head dim, as in version 1); the group's ``dim`` scales are spread over its
  ``channel_tokens`` rows, ``dim / channel_tokens`` per row, so ``k.s``/``k.b`` keep
  ``[tokens, width]`` arrays and every block, file and copy works on rows as before.
  A group still filling is kept in float16 apart (the pool's per-agent tail) and
  quantized when it completes.
* with ``rotate``, keys and values are stored multiplied by the orthonormal
  Walsh-Hadamard matrix ``H`` of the head dim (per head). Attention rotates the queries
  by ``H`` (``q.k`` is unchanged) and the output back (``H`` is its own inverse).

Bytes per token for the embedded model (30 layers, 3 KV heads, head dim 64):
float16 23,040; 4-bit group 64 (either scheme): 0.5 + 4/64 bytes per value = 6,480.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import NamedTuple

import mlx.core as mx

from .. import _ext
from ..errors import InvalidRequestError

QUANTIZED_BITS = (2, 3, 4, 5, 6, 8)
FLOAT_BITS = 16
GROUP_SIZES = (32, 64, 128)
KEY_SCHEMES = ("token", "channel")
CHANNEL_BITS = (2, 4, 8)  # key bits the channel scheme packs (whole values per uint32 word)
CHANNEL_TOKENS = (32, 64)  # divide the pool's 64-token sharing groups and 256-token blocks


class Component(NamedTuple):
    """One stored array of a layer: e.g. ``k.w`` (key words), ``v.s`` (value scales)."""

    name: str
    heads: int
    width: int
    dtype: str  # numpy/MLX dtype name

    @property
    def itemsize(self) -> int:
        return 4 if self.dtype in ("uint32", "float32") else 2 if "16" in self.dtype else 1

    @property
    def row_bytes(self) -> int:
        return self.width * self.itemsize


@dataclass(frozen=True)
class KVQuant:
    """Storage format of keys and values. Defaults: both 4-bit, group size 64, and format 2
    where the key bits allow it (2, 4 or 8: keys rotated and quantized per channel over
    groups of ``min(group_size, 64)`` tokens); other key bits are format 1 (per-token keys).
    ``KVQuant(..., **V1)`` asks for format 1, ``KVQuant(..., **V2)`` for format 2."""

    key_bits: int = 4
    value_bits: int = 4
    group_size: int = 64
    key_scheme: str | None = None  # None: "channel" for 2/4/8-bit keys, else "token"
    rotate: bool | None = None  # None: with the channel scheme
    channel_tokens: int | None = None  # None: the group size, at most 64
    wide_layers: tuple[int, ...] = ()  # layers whose keys are 8-bit (format 2; ``layer(i)``)

    def __post_init__(self):
        for kind, bits in (("key", self.key_bits), ("value", self.value_bits)):
            if bits not in QUANTIZED_BITS and bits != FLOAT_BITS:
                raise InvalidRequestError(
                    f"{kind} bits must be one of {QUANTIZED_BITS} or 16 (float16), not {bits}"
                )
        if self.group_size not in GROUP_SIZES:
            raise InvalidRequestError(
                f"group size must be one of {GROUP_SIZES}, not {self.group_size}"
            )
        if self.key_scheme is None:
            scheme = "channel" if self.key_bits in CHANNEL_BITS else "token"
            object.__setattr__(self, "key_scheme", scheme)
        if self.rotate is None:
            object.__setattr__(self, "rotate", self.key_scheme == "channel")
        if self.channel_tokens is None:
            object.__setattr__(self, "channel_tokens", min(self.group_size, 64))
        if self.key_scheme not in KEY_SCHEMES:
            raise InvalidRequestError(
                f"key scheme must be one of {KEY_SCHEMES}, not {self.key_scheme!r}"
            )
        if self.channel_tokens not in CHANNEL_TOKENS:
            raise InvalidRequestError(
                f"channel tokens must be one of {CHANNEL_TOKENS}, not {self.channel_tokens}"
            )
        if self.key_scheme == "channel" and self.key_bits not in CHANNEL_BITS:
            raise InvalidRequestError(f"per-channel keys take 2, 4 or 8 bits, not {self.key_bits}")
        if not isinstance(self.rotate, bool):
            raise InvalidRequestError(f"rotate must be true or false, not {self.rotate!r}")
        wide = self.wide_layers
        if not isinstance(wide, (tuple, list)) or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in wide
        ):
            raise InvalidRequestError(f"wide layers must be layer indices, not {wide!r}")
        object.__setattr__(self, "wide_layers", tuple(sorted(set(wide))))
        if self.wide_layers and not (self.channel_keys and self.key_bits < 8):
            raise InvalidRequestError(
                "wide layers (8-bit keys in chosen layers) need per-channel keys under 8 bits"
            )

    @classmethod
    def from_dict(cls, record: dict) -> KVQuant:
        """A format from its stored record; fields a version-1 record lacks mean format 1."""
        if not isinstance(record, dict):
            raise InvalidRequestError("a KV format record must be an object")
        known = {
            "key_bits",
            "value_bits",
            "group_size",
            "key_scheme",
            "rotate",
            "channel_tokens",
            "wide_layers",
        }
        unknown = set(record) - known
        if unknown:
            raise InvalidRequestError(f"unknown KV format fields {sorted(unknown)}")
        return cls(**{**V1, "channel_tokens": 64, **record})

    def layer(self, i: int) -> KVQuant:
        """The plain format of layer ``i`` (no wide layers of its own): 8-bit keys in a wide
        layer, else this format. Every per-layer reader and writer works on ``layer(i)``."""
        return _layer_format(self, i)

    @property
    def version(self) -> int:
        """1: per-token keys, unrotated (agentkv < 0.2); 2: per-channel keys and/or rotation."""
        return 2 if self.key_scheme == "channel" or self.rotate else 1

    @property
    def channel_keys(self) -> bool:
        return self.key_scheme == "channel"

    @classmethod
    def from_bits(cls, bits: int, *, key_bits=None, value_bits=None, group_size=64) -> KVQuant:
        """Format 1 at these bits (the bits the caller asked for; ``choose_kv_quant`` picks
        the format for a model)."""
        return cls(
            key_bits=bits if key_bits is None else key_bits,
            value_bits=bits if value_bits is None else value_bits,
            group_size=group_size,
            **V1,
        )

    @property
    def key_parts(self) -> int:
        """Components of the keys: 1 (float16) or 3 (words, scales, biases)."""
        return 1 if self.key_bits == FLOAT_BITS else 3

    @property
    def label(self) -> str:
        """Short name: ``q4``, ``q8``, ``fp16``, ``k8v4``...; format 2 adds ``.v2``."""
        if self.key_bits == self.value_bits:
            name = "fp16" if self.key_bits == FLOAT_BITS else f"q{self.key_bits}"
        else:
            name = f"k{self.key_bits}v{self.value_bits}"
        name = name if self.version == 1 else f"{name}.v2"
        if self.wide_layers:
            name += "+k8@" + ",".join(map(str, self.wide_layers))
        return name

    @property
    def identity(self) -> str:
        """The label plus every field that changes the stored bytes' meaning beyond it (the
        group size, channel tokens): what chain hashes of stored blocks are seeded with.
        Equal to ``label`` for the default group of 64, so existing stores keep their hashes."""
        name = self.label
        if self.group_size != 64:
            name += f"/g{self.group_size}"
        if self.channel_keys and self.channel_tokens != 64:
            name += f"/c{self.channel_tokens}"
        return name

    def fits(self, key_dim: int, value_dim: int) -> bool:
        """Whether this format can store keys of ``key_dim`` and values of ``value_dim``."""
        try:
            self.check_head_dims(key_dim, value_dim)
        except InvalidRequestError:
            return False
        return True

    def check_head_dims(self, key_dim: int, value_dim: int) -> None:
        for kind, bits, dim in (
            ("key", self.key_bits, key_dim),
            ("value", self.value_bits, value_dim),
        ):
            if bits == FLOAT_BITS:
                continue
            if dim % self.group_size or (dim * bits) % 32:
                raise InvalidRequestError(
                    f"{kind} head dim {dim} does not split into groups of {self.group_size} "
                    f"at {bits} bits; choose another group size"
                )
        if self.channel_keys and key_dim % self.channel_tokens:
            raise InvalidRequestError(
                f"key head dim {key_dim} does not spread over {self.channel_tokens}-token "
                "channel groups; choose channel_tokens 32 or the token key scheme"
            )
        if self.rotate:
            for kind, dim in (("key", key_dim), ("value", value_dim)):
                if dim & (dim - 1):
                    raise InvalidRequestError(
                        f"{kind} head dim {dim} is not a power of two: cannot rotate it"
                    )

    def kind_components(self, prefix: str, bits: int, heads: int, dim: int) -> list[Component]:
        if bits == FLOAT_BITS:
            return [Component(prefix, heads, dim, "float16")]
        groups = dim // self.group_size
        if prefix == "k" and self.channel_keys:
            groups = dim // self.channel_tokens  # a channel group's scales, spread over its rows
        return [
            Component(f"{prefix}.w", heads, dim * bits // 32, "uint32"),
            Component(f"{prefix}.s", heads, groups, "float16"),
            Component(f"{prefix}.b", heads, groups, "float16"),
        ]

    def components(self, heads: int, key_dim: int, value_dim: int) -> list[Component]:
        """One layer's components in storage order: keys first, then values (a format with
        wide layers has no single answer: ask ``layer(i)`` or use ``layer_components``)."""
        if self.wide_layers:
            raise ValueError("a format with wide layers has components per layer")
        self.check_head_dims(key_dim, value_dim)
        return self.kind_components("k", self.key_bits, heads, key_dim) + self.kind_components(
            "v", self.value_bits, heads, value_dim
        )

    def layer_components(
        self, layers: int, heads: int, key_dim: int, value_dim: int
    ) -> list[list[Component]]:
        """Every layer's components (``components`` of ``layer(i)``)."""
        return [list(c) for c in _layer_components(self, layers, heads, key_dim, value_dim)]

    def bytes_per_token(self, layers: int, heads: int, key_dim: int, value_dim: int) -> int:
        return _bytes_per_token(self, layers, heads, key_dim, value_dim)

    def quantize(self, x: mx.array, bits: int) -> tuple[mx.array, ...]:
        """Store ``x`` [B, heads, tokens, dim] as this format's per-token components of one
        kind (values, or keys of the token scheme; rotate first: ``rotated``)."""
        if bits == FLOAT_BITS:
            return (x.astype(mx.float16),)
        w, scales, biases = mx.quantize(x, group_size=self.group_size, bits=bits)
        return w, scales.astype(mx.float16), biases.astype(mx.float16)

    def rotated(self, x: mx.array) -> mx.array:
        """``x`` times H (per head) if this format rotates, else ``x``."""
        return hadamard(x) if self.rotate else x

    def quantize_channels(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """Keys ``x`` [..., tokens, dim] (whole channel groups, already rotated) -> per-channel
        components laid out per token row: words [..., tokens, dim*bits/32], scales and
        biases [..., tokens, dim/channel_tokens] (float16)."""
        return quantize_channels(x, self.key_bits, self.channel_tokens)

    def dequantize_keys(self, parts: tuple) -> mx.array:
        """Stored keys (one kind's components, [..., tokens, width]) -> float32, still
        rotated if the format rotates. Channel keys need whole channel groups."""
        if self.channel_keys:
            return dequantize_channels(*parts, self.key_bits, self.channel_tokens)
        return dequantize_tokens(parts, self.key_bits, self.group_size)

    def to_dict(self) -> dict:
        return {
            "key_bits": self.key_bits,
            "value_bits": self.value_bits,
            "group_size": self.group_size,
            "key_scheme": self.key_scheme,
            "rotate": self.rotate,
            "channel_tokens": self.channel_tokens,
            **({"wide_layers": list(self.wide_layers)} if self.wide_layers else {}),
        }


@lru_cache(maxsize=64)
def _layer_components(
    quant: KVQuant, layers: int, heads: int, key_dim: int, value_dim: int
) -> tuple[tuple[Component, ...], ...]:
    """``KVQuant.layer_components``, computed once per format and geometry (every manifest
    read checks its blocks against it)."""
    if quant.wide_layers and quant.wide_layers[-1] >= layers:
        raise InvalidRequestError(
            f"wide layer {quant.wide_layers[-1]} is past the model's {layers} layers"
        )
    return tuple(tuple(quant.layer(i).components(heads, key_dim, value_dim)) for i in range(layers))


@lru_cache(maxsize=64)
def _bytes_per_token(quant: KVQuant, layers: int, heads: int, key_dim: int, value_dim: int) -> int:
    return sum(
        c.heads * c.row_bytes
        for comps in _layer_components(quant, layers, heads, key_dim, value_dim)
        for c in comps
    )


@lru_cache(maxsize=256)
def _layer_format(quant: KVQuant, i: int) -> KVQuant:
    if not quant.wide_layers:
        return quant
    return replace(quant, key_bits=8 if i in quant.wide_layers else quant.key_bits, wide_layers=())


V1 = {"key_scheme": "token", "rotate": False}  # KVQuant(**V1): format 1 (per-token keys)
V2 = {"key_scheme": "channel", "rotate": True}  # KVQuant(**V2): format 2 (the default)


def hadamard(x: mx.array) -> mx.array:
    """``x`` times the orthonormal Walsh-Hadamard matrix of its last axis (fast transform;
    H is symmetric and its own inverse). Float32 on CPU: agentkv's operation, the same bits
    as MLX's transform (which runs on one thread there)."""
    if x.size == 0:  # no tokens: MLX's transform refuses empty arrays
        return x
    scale = 1 / math.sqrt(x.shape[-1])
    if x.dtype == mx.float32 and mx.default_device() == mx.cpu:
        return _ext.hadamard_rows(x, scale)
    return mx.hadamard_transform(x, scale=scale)


def dequantize_tokens(parts: tuple, bits: int, group: int) -> mx.array:
    if bits == FLOAT_BITS:
        return parts[0].astype(mx.float32)
    w, scales, biases = parts
    return mx.dequantize(
        w, scales.astype(mx.float32), biases.astype(mx.float32), group_size=group, bits=bits
    )


def _shifts(bits: int) -> mx.array:
    return mx.arange(0, 32, bits, dtype=mx.uint32)[: 32 // bits]


def quantize_channels(x: mx.array, bits: int, tokens: int):
    """Affine quantization of ``x`` [..., T, D] per channel over each run of ``tokens`` rows
    (T a multiple of it): q = round((x - bias) / scale), scale = (max - min) / (2^bits - 1)
    and bias = min in float16, q packed along D into uint32 words like ``mx.quantize``'s."""
    *lead, t, d = x.shape
    if t % tokens or 32 % bits or d % tokens:
        raise ValueError(f"cannot quantize [{t}, {d}] per channel over {tokens} tokens")
    levels = (1 << bits) - 1
    y = x.astype(mx.float32).reshape(*lead, t // tokens, tokens, d)
    lo = y.min(axis=-2, keepdims=True).astype(mx.float16)
    scale = ((y.max(axis=-2, keepdims=True) - lo) / levels).astype(mx.float16)
    s32 = scale.astype(mx.float32)
    q = mx.round((y - lo.astype(mx.float32)) / mx.where(s32 == 0, 1, s32))
    q = mx.clip(q, 0, levels).astype(mx.uint32).reshape(*lead, t, d)
    per = 32 // bits
    words = (q.reshape(*lead, t, d // per, per) << _shifts(bits)).sum(axis=-1).astype(mx.uint32)
    w = d // tokens
    return (
        words,
        scale.reshape(*lead, t, w),
        lo.reshape(*lead, t, w),
    )


def dequantize_channels(words, scales, biases, bits: int, tokens: int) -> mx.array:
    """The inverse of ``quantize_channels`` (float32)."""
    *lead, t, _ = words.shape
    per = 32 // bits
    d = words.shape[-1] * per
    q = (words[..., None] >> _shifts(bits)) & ((1 << bits) - 1)
    q = q.reshape(*lead, t // tokens, tokens, d).astype(mx.float32)
    s = scales.reshape(*lead, t // tokens, 1, d).astype(mx.float32)
    b = biases.reshape(*lead, t // tokens, 1, d).astype(mx.float32)
    return (q * s + b).reshape(*lead, t, d)


def native_layout(per_layer: list[list[Component]]) -> list[list[tuple[int, int, str]]]:
    """Every layer's components as the extension's block I/O takes them."""
    return [[(c.heads, c.width, c.dtype) for c in comps] for comps in per_layer]
