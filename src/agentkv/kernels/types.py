"""What the kernels take: row sources and extract rows (merge/extract), paged queries."""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from ..format.quant import FLOAT_BITS, V1, V2, KVQuant


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
    # the longest row's length where the host knows it (a step does), else 0: the GPU kernel's
    # split of the keys then reads it from ``lengths`` (a host synchronisation)
    span: int = 0

    def quant(self) -> KVQuant:
        """The KV format these arenas hold."""
        return _paged_quant(self.key_bits, self.value_bits, self.group, self.channel_tokens)

    def dims(self, queries: mx.array, splits: int = 1) -> tuple[int, ...]:
        """The kernel's dims, in the order paged_attention.metal reads them."""
        B, q_heads, L, dim = queries.shape
        return (
            B,
            q_heads,
            self.kv_heads,
            L,
            dim,
            self.value_dim,
            self.tables.shape[1],
            self.block_tokens,
            self.key_bits,
            self.value_bits,
            self.group,
            self.window,
            int(self.sinks is not None),
            self.channel_tokens,
            splits,
        )

    @property
    def value_dim(self) -> int:
        words = self.values[0].shape[-1]
        return words if self.value_bits == FLOAT_BITS else words * 32 // self.value_bits

    def launch(self, queries: mx.array, *, groups: int = 0, splits: int = 0) -> Launch:
        """How paged_attention.metal covers these queries (docs/gpu-attention.md): NQ query
        vectors a threadgroup, KL lanes a key, and ``splits`` parts of the keys, enough that
        the grid has about ``groups`` (default ``TARGET_GROUPS``) threadgroups without giving a
        part fewer than ``MIN_SPLIT_KEYS`` keys. ``splits`` > 0 forces it."""
        B, q_heads, L, dim = queries.shape
        vectors = L * (q_heads // self.kv_heads)
        nq = min(MAX_VECTORS, 1 << max(0, vectors - 1).bit_length())
        widest = max(dim, self.value_dim)
        kl = min(32, max(4, 1 << max(0, -(-widest // 8) - 1).bit_length()))
        if not splits:
            tiles = -(-vectors // nq)
            span = self.span or int(mx.max(self.lengths).item())
            want = -(-(groups or TARGET_GROUPS) // (B * self.kv_heads * tiles))
            splits = max(1, min(want, -(-span // MIN_SPLIT_KEYS), MAX_SPLITS))
        return Launch(nq, kl, splits)

    def kernel_parts(self) -> tuple[mx.array, ...]:
        """Keys then values as (words, scales, biases) for the kernel: a 16-bit kind's float16
        rows viewed as uint32 words, with placeholder scales and biases it never reads."""
        return (*_kernel_kind(self.keys), *_kernel_kind(self.values))


# The GPU kernel's grid (docs/gpu-attention.md): threadgroups of THREADGROUP threads holding
# up to MAX_VECTORS query vectors; a grid of about TARGET_GROUPS threadgroups fills a large
# GPU (an H100 has 132 multiprocessors, an M-series Max 40 cores).
THREADGROUP = 128
MAX_VECTORS = 8
TARGET_GROUPS = 512
MIN_SPLIT_KEYS = 64
MAX_SPLITS = 128


class Launch(NamedTuple):
    """paged_attention.metal's compile-time shape and its split of the keys."""

    vectors: int  # NQ: query vectors a threadgroup holds
    lanes_per_key: int  # KL
    splits: int


_PLACEHOLDER: dict[str, mx.array] = {}


def _kernel_kind(parts: tuple[mx.array, ...]) -> tuple[mx.array, mx.array, mx.array]:
    if len(parts) == 3:
        return parts
    if "half" not in _PLACEHOLDER:
        _PLACEHOLDER["half"] = mx.array(np.zeros(1, np.float16))
    words = mx.view(parts[0], mx.uint32)
    return words, _PLACEHOLDER["half"], _PLACEHOLDER["half"]


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
