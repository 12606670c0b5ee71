"""What the kernels take: row sources and extract rows (merge/extract), paged queries."""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import mlx.core as mx

from ..format.quant import V1, V2, KVQuant


class PagedQuery(NamedTuple):
    """What paged attention reads besides the queries: the pool's arenas of one layer and
    the batch's block tables (see kernels/paged_attention.metal)."""

    keys: tuple[mx.array, ...]  # words, scales, biases: [blocks * kv_heads * 256, ...]
    values: tuple[mx.array, ...]
    tables: mx.array  # int32 [B, max blocks]
    lengths: mx.array  # int32 [B], the queries included
    kv_heads: int
    block_tokens: int
    key_bits: int
    value_bits: int
    group: int
    window: int  # 0: none
    sinks: mx.array | None
    # KV format 2: per-channel keys over groups of this many tokens (0: per-token keys), the
    # groups still filling in float16 tails [slots * kv_heads * channel_tokens, D], slot
    # tail_slots[b] for row b
    channel_tokens: int = 0
    tail: mx.array | None = None
    tail_slots: mx.array | None = None

    def quant(self) -> KVQuant:
        """The KV format these arenas hold."""
        return _paged_quant(self.key_bits, self.value_bits, self.group, self.channel_tokens)

    def dims(self, queries: mx.array) -> tuple[int, ...]:
        """The kernel's dims, in the order paged_attention.metal reads them."""
        B, q_heads, L, dim = queries.shape
        dim_v = self.values[0].shape[-1] * 32 // self.value_bits
        return (
            B,
            q_heads,
            self.kv_heads,
            L,
            dim,
            dim_v,
            self.tables.shape[1],
            self.block_tokens,
            self.key_bits,
            self.value_bits,
            self.group,
            self.window,
            int(self.sinks is not None),
            self.channel_tokens,
        )


@lru_cache(maxsize=64)
def _paged_quant(key_bits: int, value_bits: int, group: int, channel_tokens: int) -> KVQuant:
    if channel_tokens:
        return KVQuant(key_bits, value_bits, group, **V2, channel_tokens=channel_tokens)
    return KVQuant(key_bits, value_bits, group, **V1)


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
