"""How KV tensors are stored: bits per kind (keys, values) and group size.

A quantized kind is stored as MLX affine quantization: packed uint32 words plus
a float16 scale and bias per group of ``group_size`` values along the head
dimension. 16 bits means plain float16. Each (kind, part) is a *component*: one
array per layer, laid out like an mlx-lm cache array ``[1, heads, tokens, width]``.

Bytes per token for the embedded model (30 layers, 3 KV heads, head dim 64):
float16 23,040; 4-bit group 64: 0.5 + 4/64 bytes per value = 6,480.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import mlx.core as mx

from ..errors import InvalidRequestError

QUANTIZED_BITS = (2, 3, 4, 5, 6, 8)
FLOAT_BITS = 16
GROUP_SIZES = (32, 64, 128)


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
    """Storage format of keys and values. Defaults: both 4-bit, group size 64."""

    key_bits: int = 4
    value_bits: int = 4
    group_size: int = 64

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

    @classmethod
    def from_bits(cls, bits: int, *, key_bits=None, value_bits=None, group_size=64) -> KVQuant:
        return cls(
            key_bits=bits if key_bits is None else key_bits,
            value_bits=bits if value_bits is None else value_bits,
            group_size=group_size,
        )

    @property
    def key_parts(self) -> int:
        """Components of the keys: 1 (float16) or 3 (words, scales, biases)."""
        return 1 if self.key_bits == FLOAT_BITS else 3

    @property
    def label(self) -> str:
        """Short name: ``q4``, ``q8``, ``fp16``, ``k8v4``..."""
        if self.key_bits == self.value_bits:
            return "fp16" if self.key_bits == FLOAT_BITS else f"q{self.key_bits}"
        return f"k{self.key_bits}v{self.value_bits}"

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

    def kind_components(self, prefix: str, bits: int, heads: int, dim: int) -> list[Component]:
        if bits == FLOAT_BITS:
            return [Component(prefix, heads, dim, "float16")]
        groups = dim // self.group_size
        return [
            Component(f"{prefix}.w", heads, dim * bits // 32, "uint32"),
            Component(f"{prefix}.s", heads, groups, "float16"),
            Component(f"{prefix}.b", heads, groups, "float16"),
        ]

    def components(self, heads: int, key_dim: int, value_dim: int) -> list[Component]:
        """Per-layer components in storage order: keys first, then values."""
        self.check_head_dims(key_dim, value_dim)
        return self.kind_components("k", self.key_bits, heads, key_dim) + self.kind_components(
            "v", self.value_bits, heads, value_dim
        )

    def bytes_per_token(self, layers: int, heads: int, key_dim: int, value_dim: int) -> int:
        per_layer = sum(c.heads * c.row_bytes for c in self.components(heads, key_dim, value_dim))
        return layers * per_layer

    def quantize(self, x: mx.array, bits: int) -> tuple[mx.array, ...]:
        """Store ``x`` [B, heads, tokens, dim] as this format's components of one kind."""
        if bits == FLOAT_BITS:
            return (x.astype(mx.float16),)
        w, scales, biases = mx.quantize(x, group_size=self.group_size, bits=bits)
        return w, scales.astype(mx.float16), biases.astype(mx.float16)

    def to_dict(self) -> dict:
        return {
            "key_bits": self.key_bits,
            "value_bits": self.value_bits,
            "group_size": self.group_size,
        }
