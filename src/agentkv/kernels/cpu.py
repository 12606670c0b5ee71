"""The kernels on CPU.

merge, extract and ``paged_attention`` are the shared bodies kernels/*.metal compiled into
the extension through kernels/shim.h. Attention in production runs the fused kernels
(``fused_paged_attention``, ``fused_cache_attention``: csrc/core/attention*), written for the
CPU's caches and vector units; they and the shared body are held to the same reference in
tests; kernels/README.md gives their measured difference (11-54x at decode).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import mlx.core as mx

from .. import _ext
from ..format.quant import KVQuant
from .types import ExtractRow, Launch, PagedQuery, RowSource, as_units, from_units, store_dims

THREADS = max(1, min(4, os.cpu_count() or 1))


def paged_attention(
    queries: mx.array, paged: PagedQuery, *, scale: float, launch: Launch | None = None
) -> mx.array:
    """The GPU body on the host, each threadgroup's lanes as a loop (csrc/simt.h), in the
    launch shape the GPU would take (or ``launch``'s)."""
    launch = launch or paged.launch(queries)
    parts = paged.kernel_parts()
    return _ext.kernel_paged_attention(
        queries,
        list(parts[:3]),
        list(parts[3:]),
        paged.tables,
        paged.lengths,
        paged.dims(queries, launch),
        paged.sinks,
        scale,
        THREADS,
        paged.tail,
        paged.tail_slots,
        launch.vectors,
        launch.lanes_per_key,
        paged.done,
        paged.done_first,
        paged.softcap,
        launch.keys_in_flight,
    )


def store_rows(
    keys: mx.array, values: mx.array, value_bits: int, group: int
) -> tuple[mx.array, ...]:
    """kernels/store_rows.metal on the host (csrc/simt.h), as a GPU runs it."""
    dim = keys.shape[-1]
    dims = store_dims(keys.size // dim, dim, value_bits, group)
    none = mx.zeros((1,))
    out = _ext.kernel_store_rows(keys, values, none, list(dims), none, none, none, 0.0, THREADS)
    return tuple(out[:4])


def dense_rows(
    paged: PagedQuery, src: mx.array, count: int, dtype: mx.Dtype
) -> tuple[mx.array, mx.array]:
    """kernels/dense_rows.metal on the host, as a GPU runs it (``gpu.dense_rows``)."""
    parts = paged.kernel_parts()
    none = mx.zeros((1,), dtype=mx.float16)
    keys, values = _ext.kernel_dense_rows(  # count: src[0]
        list(parts[:3]), list(parts[3:]),
        paged.tail if paged.tail is not None else none,
        paged.done if paged.done is not None else none,
        src, paged.dense_rows_dims(), 1 / math.sqrt(paged.key_dim), THREADS,
    )  # fmt: skip
    return keys.astype(dtype), values.astype(dtype)


def quantize_groups(groups: mx.array, bits: int) -> tuple[mx.array, ...]:
    """kernels/quantize_groups.metal on the host, as a GPU runs it (``gpu.quantize_groups``):
    [G, channel_tokens, D] -> words, scales, biases [G * channel_tokens, ...]."""
    return tuple(_ext.kernel_quantize_groups(groups, bits, groups.shape[1]))


def fused_paged_attention(queries: mx.array, paged: PagedQuery, *, scale: float) -> mx.array:
    return _ext.paged_attention(
        queries,
        list(paged.keys),
        list(paged.values),
        paged.tables,
        paged.lengths,
        paged.kv_heads,
        paged.block_tokens,
        scale,
        paged.key_bits,
        paged.value_bits,
        paged.group,
        paged.window,
        paged.sinks,
        paged.channel_tokens,
        paged.tail,
        paged.tail_slots,
        paged.done if paged.done_first is not None else None,
        paged.done_first if paged.done is not None else None,
        paged.softcap,
    )


def fused_cache_attention(
    queries: mx.array,
    keys: tuple,
    values: tuple,
    *,
    scale: float,
    quant: KVQuant,
    window: int,
    left_padding: mx.array | None,
    sinks: mx.array | None,
    tail: mx.array | None,
    softcap: float = 0.0,
) -> mx.array:
    return _ext.quantized_attention(
        queries,
        list(keys),
        list(values),
        scale,
        quant.key_bits,
        quant.value_bits,
        quant.group_size,
        window,
        left_padding,
        sinks,
        quant.channel_tokens if quant.channel_keys else 0,
        tail,
        softcap,
    )


def merge(sources: Sequence[RowSource], *, used: int, capacity: int) -> tuple[mx.array, ...]:
    arrays = [s.arrays for s in sources]
    unique: list[tuple] = []
    index_of: dict[int, int] = {}
    for a in arrays:
        key = id(a[0])
        if key not in index_of:
            index_of[key] = len(unique)
            unique.append(a)
    rows = mx.array(
        [
            [index_of[id(s.arrays[0])], s.row, s.first, s.length, s.arrays[0].shape[2]]
            for s in sources
        ],
        dtype=mx.int32,
    )
    per_output = []
    dims = []
    for k in range(len(sources[0].arrays)):
        per_output.append([as_units(a[k]) for a in unique])
        units = per_output[-1][0]
        dims.append((units.shape[1], units.shape[3], used, capacity, 0))
    out = _ext.kernel_merge(per_output, rows, dims, THREADS)
    return tuple(from_units(o, a.dtype) for o, a in zip(out, sources[0].arrays))


def extract_rows(batch: Sequence[mx.array], rows: Sequence[ExtractRow]) -> list[tuple]:
    units = [as_units(a) for a in batch]
    inputs, metas = [], []
    for r in rows:
        for u in units:
            inputs.append(u)
            metas.append((r.row, r.first, r.length, u.shape[1], u.shape[3], u.shape[2], r.capacity))
    out = _ext.kernel_extract(inputs, metas, THREADS)
    n = len(batch)
    return [
        tuple(from_units(o, a.dtype) for o, a in zip(out[i * n : (i + 1) * n], batch))
        for i in range(len(rows))
    ]
