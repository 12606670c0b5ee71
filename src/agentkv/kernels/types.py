"""What the kernels take: row sources and extract rows (merge/extract), paged queries."""

from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from ..format.quant import FLOAT_BITS, V1, V2, KVQuant


def store_dims(
    rows: int,
    dim: int,
    value_bits: int,
    group: int,
    *,
    prologue: tuple[int, int, int] | None = None,
    rope_mode: int = 0,
    norm: bool = False,
) -> tuple[int, ...]:
    """kernels/store_rows.metal's ``dims``. Without ``prologue``: ``rows`` new keys and
    values, each its own array of rows ``[rows, dim]``. With ``prologue`` = (L, Hkv, Hq): the
    rows of one joint q/k/v projection ``[B, L, (Hq + 2 Hkv) dim]`` (``rows`` = B Hkv L),
    its queries among them, roped by ``rope_mode`` (1: channel c with c + dim / 2; 2:
    traditional), each query and key head RMS-normed first where ``norm`` (Qwen3's)."""
    if prologue is None:
        return (rows, dim, value_bits, group, 0, 1, 1, 0, dim, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    seq, kv_heads, q_heads = prologue
    width = (q_heads + 2 * kv_heads) * dim
    batch = rows // (seq * kv_heads)
    return (
        rows, dim, value_bits, group, batch * q_heads * seq, seq, kv_heads, q_heads,
        seq * width, dim, width, q_heads * dim, (q_heads + kv_heads) * dim,
        seq * width, dim, width, 0, rope_mode, int(norm),
    )  # fmt: skip


class HostIndex(NamedTuple):
    """A step's block tables, lengths and tail slots as the host built them."""

    tables: np.ndarray  # int32 [B, max blocks]
    lengths: np.ndarray  # int32 [B]
    tail_slots: np.ndarray | None = None  # int32 [B]
    # what the layers of one step derive from these alike, made by the first (kernels/dense.py)
    memo: dict | None = None
    # PagedQuery.done_first (None: no row completes a channel group)
    done_first: np.ndarray | None = None


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
    # the same tables, lengths and tail slots on the host where the caller has them (a pool
    # step does): the GPU paths then plan without reading the device (no synchronisation)
    host: HostIndex | None = None
    # KV format 2 in a pool step: the groups the step completed, float16 [entries * ct, D],
    # row b's from entry done_first[b] (-1: none; pool.arena.WritePlan), which a query inside
    # one reads until its last token (csrc/core/attention.h, kernels/paged_attention.metal,
    # kernels/dense.py)
    done: mx.array | None = None
    done_first: mx.array | None = None
    # KV format 2's rotation: keys and values are stored times H. True: the caller hands in
    # queries as they are and takes the output as it is, and the path rotates both (the
    # paged kernel inside itself where the shape allows: ``rotates_inside``)
    rotate: bool = False
    # the scores' soft cap c (Gemma 2's attn_logit_softcapping; 0: none): each score s
    # becomes c * tanh(s / c) before the softmax
    softcap: float = 0.0

    def quant(self) -> KVQuant:
        """The KV format these arenas hold."""
        return _paged_quant(self.key_bits, self.value_bits, self.group, self.channel_tokens)

    def dims(self, queries: mx.array, launch: Launch) -> tuple[int, ...]:
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
            launch.splits,
            launch.split_keys,
            int(self.rotate),
        )

    def dense_rows_dims(self) -> tuple[int, ...]:
        """kernels/dense_rows.metal's dims (its rows' count is in its ``src``); it rotates
        the rows back where ``rotate`` says so (``rotates_inside``: the shapes it can)."""
        dim, dim_v = self.key_dim, self.value_dim
        return (
            dim, dim_v, self.key_bits, self.value_bits, self.group, self.channel_tokens,
            max(dim, dim_v) // 8, int(self.rotate),
        )  # fmt: skip

    def rotates_inside(self, queries: mx.array, launch: Launch | None = None) -> bool:
        """Whether the paged kernel rotates these queries and their output itself: a
        rotating format whose key and value dims are equal, a power of two, 8 channels a lane
        (kernels/paged_attention.metal)."""
        dim = queries.shape[-1]
        if not self.rotate or dim != self.value_dim:
            return False
        if launch is not None:
            return dim == 8 * launch.lanes_per_key
        return dim in (32, 64, 128, 256)  # what ``launch`` gives 8 channels a lane

    def kernel_scales(self, scale: float, queries: mx.array) -> tuple[float, float, float]:
        """The kernel's ``scale`` input: the queries' (times 1 / sqrt(D) where it rotates
        them), the output's rotation (1 / sqrt(Dv)) and the scores' soft cap."""
        if not self.rotate:
            return (scale, 1.0, float(self.softcap))
        return (
            scale / math.sqrt(queries.shape[-1]),
            1 / math.sqrt(self.value_dim),
            float(self.softcap),
        )

    @property
    def key_dim(self) -> int:
        words = self.keys[0].shape[-1]
        return words if self.key_bits == FLOAT_BITS else words * 32 // self.key_bits

    @property
    def value_dim(self) -> int:
        words = self.values[0].shape[-1]
        return words if self.value_bits == FLOAT_BITS else words * 32 // self.value_bits

    def launch(self, queries: mx.array, *, splits: int = 0, keys_in_flight: int = 0) -> Launch:
        """How paged_attention.metal covers these queries (docs/gpu-attention.md): NQ query
        vectors a threadgroup, KL lanes a key, KU keys a team loads at once
        (``KEYS_IN_FLIGHT`` where NQ <= 4, else 1: registers), each row's keys in parts of
        about ``SPLIT_KEYS`` (at most ``MAX_SPLITS``: a row's parts depend on it alone, so it
        gives the same bits alone or batched). ``splits`` > 0 cuts the longest row into that
        many parts instead, ``keys_in_flight`` > 0 sets KU (tests, experiments); KU never
        changes the bits."""
        B, q_heads, L, dim = queries.shape
        vectors = L * (q_heads // self.kv_heads)
        nq = min(MAX_VECTORS, 1 << max(0, vectors - 1).bit_length())
        widest = max(dim, self.value_dim)
        kl = min(32, max(4, 1 << max(0, -(-widest // 8) - 1).bit_length()))
        longest = self.longest()
        if self.window:  # what a tile's queries see at most
            longest = min(longest, self.window + L - 1)
        ku = keys_in_flight or (KEYS_IN_FLIGHT if nq <= 4 else 1)
        if splits:
            return Launch(nq, kl, splits, max(1, -(-longest // splits)), ku)
        parts = max(1, min(MAX_SPLITS, -(-longest // SPLIT_KEYS)))
        return Launch(nq, kl, parts, SPLIT_KEYS, ku)

    def longest(self) -> int:
        """The longest row's length (from the host's copy where there is one)."""
        if self.host is not None:
            return int(self.host.lengths.max())
        return int(mx.max(self.lengths).item())

    def kernel_parts(self) -> tuple[mx.array, ...]:
        """Keys then values as (words, scales, biases) for the kernel: a 16-bit kind's float16
        rows viewed as uint32 words, with placeholder scales and biases it never reads."""
        return (*_kernel_kind(self.keys), *_kernel_kind(self.values))


# The GPU kernel's grid (docs/gpu-attention.md): threadgroups of THREADGROUP threads holding
# up to MAX_VECTORS query vectors, each over a part of a row's keys: SPLIT_KEYS keys a part,
# at most MAX_SPLITS parts (a 32K-token context: 128 parts of 256 keys a KV head); a team of
# lanes loads KEYS_IN_FLIGHT keys at once where a threadgroup holds at most 4 query vectors
# (decode), so that their loads overlap (not measured on a GPU yet: tests/scripts/gpu_lab.py).
THREADGROUP = 128
MAX_VECTORS = 8
SPLIT_KEYS = 64
MAX_SPLITS = 128
KEYS_IN_FLIGHT = 2


class Launch(NamedTuple):
    """paged_attention.metal's compile-time shape and its parts of the keys."""

    vectors: int  # NQ: query vectors a threadgroup holds
    lanes_per_key: int  # KL
    splits: int  # threadgroups a (tile, KV head, row) has: the most parts a row takes
    split_keys: int  # keys a part holds (about): a row takes ceil(its keys / this) parts
    keys_in_flight: int = 1  # KU: keys a team loads before it scores the first (1, 2 or 4)


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
