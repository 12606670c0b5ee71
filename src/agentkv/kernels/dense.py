"""Prefill chunks on a GPU: the keys and values a chunk sees, dequantized once, through MLX's
fused attention (docs/gpu-attention.md).

A prefill chunk of ``L`` queries reads every key it sees ``L`` times; MLX's
``mx.fast.scaled_dot_product_attention`` does that arithmetic on the GPU's matrix units
(tensor cores, Apple's simdgroup matrices), which the paged kernel's per-lane arithmetic
cannot match. So a chunk of at least ``DENSE_QUERIES`` queries gathers each row's visible
rows from the arenas once (the host's copy of the tables says which: no synchronisation),
dequantizes them to the queries' dtype, and runs the fused attention over them: the cost of
reading the KV once more per chunk, for the matrix units' speed on the ``L`` reads.
"""

from __future__ import annotations

import math
import os

import mlx.core as mx
import numpy as np

from ..format.quant import FLOAT_BITS, dequantize_channels, dequantize_tokens
from . import reference
from .types import PagedQuery

DENSE_QUERIES = 16
ENV = "AGENTKV_GPU_PREFILL"  # "kernel": prefill chunks through the paged kernel too


def takes(queries: mx.array, paged: PagedQuery) -> bool:
    """Whether a chunk of these queries runs here (on a GPU, see ``attention``)."""
    return (
        paged.host is not None
        and queries.shape[2] >= DENSE_QUERIES
        and os.environ.get(ENV) != "kernel"
    )


def paged_attention(queries: mx.array, paged: PagedQuery, *, scale: float) -> mx.array:
    """Attention of each row's ``L`` queries over its keys (from its window's start),
    gathered and dequantized once, in the queries' dtype."""
    host = paged.host
    B, _, L, _ = queries.shape
    outs = []
    for b in range(B):
        n = int(host.lengths[b])
        first = max(0, n - L - paged.window + 1) if paged.window else 0
        if paged.channel_tokens:  # whole channel groups: their scales cover them
            first = first // paged.channel_tokens * paged.channel_tokens
        keys = _keys(paged, b, first, n).astype(queries.dtype)
        values = _dequantized(paged.values, _rows(paged, b, first, n), paged, paged.value_bits)
        mask = "causal"
        own = _own_groups(paged, b, n, L)
        if own is not None:  # format 2: the groups the chunk completes, again in float16
            done_from, complete, done_keys = own
            keys = mx.concatenate([keys, done_keys.astype(queries.dtype)], axis=2)
            values = mx.concatenate(
                [values, values[:, :, done_from - first : complete - first]], axis=2
            )
        if first or paged.window or own is not None:
            mask = _mask(paged, b, first, n, L, own, queries.dtype)
        outs.append(
            reference.float_attention(
                queries[b : b + 1],
                keys,
                values.astype(queries.dtype),
                scale=scale,
                mask=mask,
                sinks=paged.sinks.astype(queries.dtype) if paged.sinks is not None else None,
                softcap=paged.softcap,
            )
        )
    return outs[0] if B == 1 else mx.concatenate(outs, axis=0)


def _own_groups(paged: PagedQuery, b: int, n: int, L: int):
    """Format 2: the channel groups row ``b``'s chunk completes (positions ``done_from`` to
    ``complete``) and their keys in float16 [1, kv_heads, complete - done_from, D], which a
    query inside one reads until the group's last token (as one token at a time would read
    it from its tail); None where the chunk completes none."""
    ct = paged.channel_tokens
    if not ct or paged.done is None:
        return None
    firsts = paged.host.done_first
    if firsts is None:
        if paged.done_first is None:
            return None
        firsts = np.array(paged.done_first)  # no host copy: read the device's
    entry = int(firsts[b])
    done_from, complete = (n - L) // ct * ct, n // ct * ct
    if entry < 0 or complete <= done_from:
        return None
    groups, heads = (complete - done_from) // ct, paged.kv_heads
    rows = paged.done[entry * ct : (entry + groups * heads) * ct]
    rows = rows.reshape(groups, heads, ct, -1).transpose(1, 0, 2, 3)
    return done_from, complete, rows.reshape(1, heads, groups * ct, -1)


def _mask(paged: PagedQuery, b: int, first: int, n: int, L: int, own, dtype) -> mx.array:
    """Which keys row ``b``'s queries see: causal, in their window, and (format 2, ``own``)
    a query inside a group the chunk completes, before its last token, sees that group's
    float16 copy (after the keys) in place of its quantized keys. Additive, in the queries'
    dtype (what MLX's CUDA attention takes; it would convert a boolean mask at every call),
    and the same for every layer of the step: made once, by MLX operations on the device
    (an ``L`` x keys mask from the host would be ~140 MB for a 2048-token chunk at 32K)."""
    memo = paged.host.memo
    key = ("mask", b, first, n, L, dtype)
    if memo is not None and key in memo:
        return memo[key]
    p = mx.arange(n - L, n)[:, None]
    t = mx.arange(first, n)[None, :]
    pick = None
    if own is not None:
        ct, (done_from, complete, _) = paged.channel_tokens, own
        t = mx.concatenate([t, mx.arange(done_from, complete)[None, :]], axis=1)
        group = p // ct * ct
        inside = (group >= done_from) & (group < complete) & (p < group + ct - 1)
        copy = mx.arange(t.shape[1])[None, :] >= n - first  # the float16 copies
        in_own = (t // ct * ct == group) & inside
        # a query inside one reads its own group's copies alone; every other query, and
        # every other group, the stored keys
        pick = mx.where(in_own, copy, mx.logical_not(copy))
    visible = t <= p
    if pick is not None:
        visible = visible & pick
    if paged.window:
        visible = visible & (p - t < paged.window)
    mask = mx.where(visible, 0.0, -math.inf).astype(dtype)
    if memo is not None:
        memo[key] = mask
    return mask


def _rows(paged: PagedQuery, b: int, first: int, end: int) -> mx.array:
    """Arena rows of tokens [first, end) of row ``b``, head by head (once a step: every
    layer reads the same rows), from the step's table on the device (no host data: at 32K
    they were 393 KB a step from the host)."""
    memo = paged.host.memo
    key = ("rows", b, first, end)
    if memo is not None and key in memo:
        return memo[key]
    bt = paged.block_tokens
    t = mx.arange(first, end)
    blocks = mx.take(paged.tables[b], t // bt)
    heads = mx.arange(paged.kv_heads)[:, None]
    rows = ((blocks[None, :] * paged.kv_heads + heads) * bt + t[None, :] % bt).reshape(-1)
    if memo is not None:
        memo[key] = rows
    return rows


def _dequantized(parts, rows: mx.array, paged: PagedQuery, bits: int) -> mx.array:
    taken = tuple(mx.take(p, rows, axis=0) for p in parts)
    taken = tuple(p.reshape(1, paged.kv_heads, -1, p.shape[-1]) for p in taken)
    if bits == FLOAT_BITS:
        return taken[0]
    return dequantize_tokens(taken, bits, paged.group)


def _keys(paged: PagedQuery, b: int, first: int, n: int) -> mx.array:
    """Keys of tokens [first, n) of row ``b``: per-token groups dequantized, or (format 2)
    complete channel groups dequantized and the filling group's float16 tail."""
    ct = paged.channel_tokens
    if not ct:
        return _dequantized(paged.keys, _rows(paged, b, first, n), paged, paged.key_bits)
    complete = n // ct * ct
    parts = []
    if complete > first:
        taken = tuple(mx.take(p, _rows(paged, b, first, complete), axis=0) for p in paged.keys)
        taken = tuple(p.reshape(1, paged.kv_heads, -1, p.shape[-1]) for p in taken)
        parts.append(dequantize_channels(*taken, paged.key_bits, ct))
    if n > complete:
        slot = int(paged.host.tail_slots[b])
        heads = mx.arange(paged.kv_heads)[:, None]
        rows = (slot * paged.kv_heads + heads) * ct + mx.arange(n - complete)[None, :]
        tail = mx.take(paged.tail, rows.reshape(-1), axis=0)
        parts.append(tail.reshape(1, paged.kv_heads, n - complete, -1).astype(mx.float32))
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)
