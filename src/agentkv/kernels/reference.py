"""The kernels' operations in plain MLX ops: the twin every backend is checked against."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from .types import BlockTable, ExtractRow, Geometry, RowSource, as_units, from_units


def _pad_rows(x: mx.array, before: int, after: int) -> mx.array:
    if before == 0 and after == 0:
        return x
    return mx.pad(x, [(0, 0), (0, 0), (before, after), (0, 0)])


def gather(
    regions: mx.array, table: BlockTable, geometry: Geometry, *, length: int, capacity: int
) -> list[tuple[mx.array, ...]]:
    units = mx.view(regions, mx.uint16)
    out = []
    for layer in range(geometry.layers):
        arrays = []
        for index, comp in enumerate(geometry.components):
            width = comp.row_bytes // 2
            plane = geometry.plane_offset(layer, index)
            parts = []
            for b, (offset, tokens) in enumerate(zip(table.offsets, table.tokens)):
                keep = min(tokens, length - 256 * b)
                if keep <= 0:
                    break
                start = offset // 2 + tokens * plane
                block = units[start : start + comp.heads * tokens * width]
                parts.append(block.reshape(1, comp.heads, tokens, width)[:, :, :keep])
            rows = (
                mx.concatenate(parts, axis=2)
                if parts
                else mx.zeros((1, comp.heads, 0, width), dtype=mx.uint16)
            )
            rows = _pad_rows(rows, 0, capacity - length)
            arrays.append(
                from_units(rows, mx.uint32 if comp.dtype == "uint32" else getattr(mx, comp.dtype))
            )
        out.append(tuple(arrays))
    return out


def merge(sources: Sequence[RowSource], *, used: int, capacity: int) -> tuple[mx.array, ...]:
    outputs = []
    for index in range(len(sources[0].arrays)):
        rows = []
        for s in sources:
            a = s.arrays[index]
            part = a[s.row : s.row + 1, :, s.first : s.first + s.length]
            rows.append(_pad_rows(as_units(part), used - s.length, capacity - used))
        outputs.append(from_units(mx.concatenate(rows, axis=0), sources[0].arrays[index].dtype))
    return tuple(outputs)


def extract_rows(batch: Sequence[mx.array], rows: Sequence[ExtractRow]) -> list[tuple]:
    return [
        tuple(
            _pad_rows(
                a[r.row : r.row + 1, :, r.first : r.first + r.length], 0, r.capacity - r.length
            )
            for a in batch
        )
        for r in rows
    ]
