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

from ..format.quant import FLOAT_BITS, dequantize_channels, dequantize_tokens, hadamard
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


def paged_attention(
    queries: mx.array, paged: PagedQuery, *, scale: float, rows_kernel=None
) -> mx.array:
    """Attention of each row's ``L`` queries over its keys (from its window's start),
    gathered and dequantized once, in the queries' dtype. ``rows_kernel`` (the backend's
    ``dense_rows``, kernels/dense_rows.metal) gathers and dequantizes a row's keys and
    values in one kernel where given; else MLX's operations do (the same values). With
    ``paged.rotate`` (KV format 2, stored times H) the rows are rotated back, so the queries
    and the output need no rotation (the kernel: where ``paged.rotates_inside``)."""
    host = paged.host
    B, _, L, _ = queries.shape
    outs = []
    for b in range(B):
        n = int(host.lengths[b])
        first = first_key(paged, n, L)
        own = _own_groups(paged, b, n, L)
        if rows_kernel is not None:
            src, count = _sources(paged, b, first, n, own)
            keys, values = rows_kernel(paged, src, count, queries.dtype)
            keys = keys.reshape(1, paged.kv_heads, -1, keys.shape[-1])
            values = values.reshape(1, paged.kv_heads, -1, values.shape[-1])
        else:
            keys, values = _gathered(paged, b, first, n, own, queries.dtype)
        mask = "causal"
        if first or paged.window or own is not None:
            mask = _mask(paged, b, first, n, L, own, queries.dtype)
        outs.append(
            reference.float_attention(
                queries[b : b + 1],
                keys,
                values,
                scale=scale,
                mask=mask,
                sinks=paged.sinks.astype(queries.dtype) if paged.sinks is not None else None,
                softcap=paged.softcap,
            )
        )
    return outs[0] if B == 1 else mx.concatenate(outs, axis=0)


def first_key(paged: PagedQuery, n: int, L: int) -> int:
    """The first key a row of ``n`` tokens' last ``L`` queries see: its window's start (0
    without one), and with per-channel keys the start of that key's group (their scales
    cover whole groups)."""
    first = max(0, n - L - paged.window + 1) if paged.window else 0
    if paged.channel_tokens:
        first = first // paged.channel_tokens * paged.channel_tokens
    return first


def _gathered(paged: PagedQuery, b: int, first: int, n: int, own, dtype) -> tuple:
    """Row ``b``'s keys and values [1, kv_heads, keys, D] in ``dtype`` by MLX's operations:
    tokens [first, n), then (format 2, ``own``) the groups the chunk completes again, their
    keys in float16 from the step's ``done``."""
    keys = _keys(paged, b, first, n)
    values = _dequantized(paged.values, _rows(paged, b, first, n), paged, paged.value_bits)
    if paged.rotate:  # H is its own inverse (in float32, as the kernel rotates)
        keys, values = hadamard(keys.astype(mx.float32)), hadamard(values.astype(mx.float32))
    keys = keys.astype(dtype)
    if own is not None:
        done_from, complete, entry = own
        ct, heads = paged.channel_tokens, paged.kv_heads
        groups = (complete - done_from) // ct
        rows = paged.done[entry * ct : (entry + groups * heads) * ct]
        rows = rows.reshape(groups, heads, ct, -1).transpose(1, 0, 2, 3)
        done_keys = rows.reshape(1, heads, groups * ct, -1)
        if paged.rotate:
            done_keys = hadamard(done_keys.astype(mx.float32))
        keys = mx.concatenate([keys, done_keys.astype(dtype)], axis=2)
        values = mx.concatenate(
            [values, values[:, :, done_from - first : complete - first]], axis=2
        )
    return keys, values.astype(dtype)


def _sources(paged: PagedQuery, b: int, first: int, n: int, own) -> tuple[mx.array, int]:
    """What kernels/dense_rows.metal reads for row ``b``: for each output row, head by head
    (tokens [first, n), then ``own``'s copies), where its key lies (0: the arena, 1: the
    row's tail, 2: the step's ``done``), that row and its value's arena row, after a
    first triple (count, 0, 0), as int32 [3 + count * 3]; and count. Made once a step
    (every layer reads the same rows), by MLX operations from the step's table on the
    device."""
    memo = paged.host.memo
    key = ("sources", b, first, n, own, paged.channel_tokens, paged.kv_heads)
    if memo is not None and key in memo:
        return memo[key]
    ct, heads = paged.channel_tokens, paged.kv_heads
    h = mx.arange(heads)[:, None]
    arena = _rows(paged, b, first, n).reshape(heads, n - first)
    kind = mx.zeros(arena.shape, dtype=mx.int32)
    rows = arena
    complete = n // ct * ct if ct else n
    if complete < n:  # the tail: tokens past the last complete group
        slot = int(paged.host.tail_slots[b])
        t = mx.arange(first, n)[None, :]
        in_tail = t >= complete
        kind = mx.where(in_tail, 1, kind)
        rows = mx.where(in_tail, (slot * heads + h) * ct + t - complete, rows)
    columns = [mx.stack([kind, rows, arena], axis=-1)]
    if own is not None:
        done_from, done_to, entry = own
        j = mx.arange(done_to - done_from)[None, :]
        done_rows = (entry + j // ct * heads + h) * ct + j % ct
        copies = [mx.full(done_rows.shape, 2, dtype=mx.int32), done_rows]
        copies.append(arena[:, done_from - first : done_to - first])
        columns.append(mx.stack(copies, axis=-1))
    src = columns[0] if len(columns) == 1 else mx.concatenate(columns, axis=1)
    count = src.shape[0] * src.shape[1]
    head = mx.where(mx.arange(3) == 0, count, 0)
    out = (mx.concatenate([head, src.astype(mx.int32).reshape(-1)]), count)
    if memo is not None:
        memo[key] = out
    return out


def _own_groups(paged: PagedQuery, b: int, n: int, L: int):
    """Format 2: the channel groups row ``b``'s chunk completes (positions ``done_from`` to
    ``complete``) and the first of their entries in the step's ``done`` (float16, group by
    group, head by head), which a query inside one reads until the group's last token (as
    one token at a time would read it from its tail): (done_from, complete, entry); None
    where the chunk completes none."""
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
    return done_from, complete, entry


def _mask(paged: PagedQuery, b: int, first: int, n: int, L: int, own, dtype) -> mx.array:
    """Which keys row ``b``'s queries see: causal, in their window, and (format 2, ``own``)
    a query inside a group the chunk completes, before its last token, sees that group's
    float16 copy (after the keys) in place of its quantized keys. Additive, in the queries'
    dtype (what MLX's CUDA attention takes; it would convert a boolean mask at every call),
    and the same for every layer of the step: made once, by MLX operations on the device
    (an ``L`` x keys mask from the host would be ~140 MB for a 2048-token chunk at 32K)."""
    memo = paged.host.memo
    # the window and the format's groups too: a model's sliding and global layers share a
    # step's memo, and the same ``first``
    key = ("mask", b, first, n, L, dtype, paged.window, paged.channel_tokens, own)
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
    key = ("rows", b, first, end, paged.kv_heads, paged.block_tokens)
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
