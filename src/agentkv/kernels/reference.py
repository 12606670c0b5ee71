"""The kernels' operations in plain MLX ops: the twin every backend is checked against."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from .types import ExtractRow, PagedQuery, RowSource, as_units, from_units


def _pad_rows(x: mx.array, before: int, after: int) -> mx.array:
    if before == 0 and after == 0:
        return x
    return mx.pad(x, [(0, 0), (0, 0), (before, after), (0, 0)])


def paged_attention(queries: mx.array, paged: PagedQuery, *, scale: float) -> mx.array:
    """Each row's blocks gathered (``mx.take``) into a contiguous cache, then the
    ``mx.quantized_matmul`` attention of ``kv/attention.py``."""
    from ..kv.attention import channel_keys_as_float, quantized_attention
    from ..kv.quant import V1, V2, KVQuant

    quant = KVQuant(paged.key_bits, paged.value_bits, paged.group, **V1)
    if paged.channel_tokens:
        quant = KVQuant(
            paged.key_bits, paged.value_bits, paged.group, **V2,
            channel_tokens=paged.channel_tokens,
        )  # fmt: skip
    B, _, L, _ = queries.shape
    heads, block = paged.kv_heads, paged.block_tokens
    outs = []
    for b in range(B):
        n = int(paged.lengths[b].item())
        t = mx.arange(n)
        blocks = paged.tables[b][t // block]
        rows = (blocks[None, :] * heads + mx.arange(heads)[:, None]) * block
        rows = (rows + (t % block)[None, :]).reshape(-1)
        keys = tuple(mx.take(p, rows, axis=0).reshape(1, heads, n, -1) for p in paged.keys)
        values = tuple(mx.take(p, rows, axis=0).reshape(1, heads, n, -1) for p in paged.values)
        row_quant = quant
        if paged.channel_tokens:  # the row's tail slot, then its keys as float16
            ct = paged.channel_tokens
            slot = int(paged.tail_slots[b].item())
            tail = paged.tail[slot * heads * ct : (slot + 1) * heads * ct]
            tail = tail.reshape(1, heads, ct, -1)
            keys, row_quant = channel_keys_as_float(keys, tail, quant, None)
        q_pos = mx.arange(n - L, n)[:, None]
        mask = t[None, :] <= q_pos
        if paged.window:
            mask = mask & (q_pos - t[None, :] < paged.window)
        out = quantized_attention(
            queries[b : b + 1],
            keys,
            values,
            scale=scale,
            mask=mask,
            quant=row_quant,
            sinks=paged.sinks,
        )
        outs.append(out)
    return mx.concatenate(outs, axis=0)


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
