"""What the kernels take: a cache geometry, a block table, row sources."""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

from ..kv.quant import Component


class Geometry(NamedTuple):
    """Layers and per-layer components, in region order (see csrc/core/block_io.h)."""

    layers: int
    components: tuple[Component, ...]

    @property
    def units_per_layer_token(self) -> int:
        """uint16 units of one token of one layer, all components."""
        return sum(c.heads * c.row_bytes for c in self.components) // 2

    def plane_offset(self, layer: int, index: int) -> int:
        """uint16 units per block token before (layer, component) inside a region."""
        before = sum(c.heads * c.row_bytes for c in self.components[:index]) // 2
        return layer * self.units_per_layer_token + before


class BlockTable(NamedTuple):
    """Where each block's region starts in the regions buffer (bytes) and its tokens."""

    offsets: tuple[int, ...]
    tokens: tuple[int, ...]


class RowSource(NamedTuple):
    """``length`` token rows starting at ``first`` of row ``row`` of ``arrays``.

    ``arrays`` are one layer's components, each ``[rows, heads, capacity, width]``
    (an agent's cache has one row).
    """

    arrays: tuple[mx.array, ...]
    row: int
    first: int
    length: int


class ExtractRow(NamedTuple):
    """Row ``row`` of a batch: ``length`` tokens from row ``first``, into ``capacity`` rows."""

    row: int
    first: int
    length: int
    capacity: int


UNIT_DTYPES = {
    mx.uint32: mx.uint32,
    mx.float16: mx.uint16,
    mx.uint16: mx.uint16,
    mx.bfloat16: mx.uint16,
}


def as_units(a: mx.array) -> mx.array:
    """The same bits as uint32 or uint16 units (the kernels only move bits)."""
    unit = UNIT_DTYPES.get(a.dtype)
    if unit is None:
        raise TypeError(f"kernels move uint32 or 16-bit components, not {a.dtype}")
    return a if a.dtype == unit else mx.view(a, unit)


def from_units(a: mx.array, dtype: mx.Dtype) -> mx.array:
    return a if a.dtype == dtype else mx.view(a, dtype)
