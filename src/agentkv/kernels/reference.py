"""The kernels' operations in plain MLX ops: the twin every backend is checked against.

Attention reads stored keys and values through ``mx.quantized_matmul`` with the queries in
their dtype (never dequantizing the cache; float16 kinds are cast to the query dtype), takes
different bits for keys and values and attention sinks, and never scales the caller's
``queries`` in place. It is also the production path wherever no kernel applies (a GPU with
float16 KV, a mask agentkv did not make, other bit widths).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import mlx.core as mx

from ..format.quant import FLOAT_BITS, KVQuant
from .types import ExtractRow, PagedQuery, RowSource, as_units, from_units


def _pad_rows(x: mx.array, before: int, after: int) -> mx.array:
    if before == 0 and after == 0:
        return x
    return mx.pad(x, [(0, 0), (0, 0), (before, after), (0, 0)])


def paged_attention(queries: mx.array, paged: PagedQuery, *, scale: float) -> mx.array:
    """Each row's blocks gathered (``mx.take``) into a contiguous cache, then
    ``quantized_attention``."""
    quant = paged.quant()
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
            softcap=paged.softcap,
        )
        if paged.done is not None and int(paged.done_first[b].item()) >= 0:
            out = _inside_done_groups(queries, paged, b, n, keys, values, mask, out, scale)
        outs.append(out)
    return mx.concatenate(outs, axis=0)


def _inside_done_groups(queries, paged: PagedQuery, b, n, keys, values, mask, out, scale):
    """Row ``b``'s queries inside a channel group its step completed, before the group's last
    token, read that group in float16 (``paged.done``), as they would one token at a time."""
    ct, heads = paged.channel_tokens, paged.kv_heads
    L = queries.shape[2]
    done_from, tail_from = (n - L) // ct * ct, n // ct * ct
    first = int(paged.done_first[b].item())
    parts, at = [], 0
    for group in range(done_from, tail_from, ct):
        lo, hi = max(group, n - L), group + ct - 1  # positions inside it, its last excluded
        if lo >= hi:
            continue
        entry = first + (group - done_from) // ct * heads
        rows = paged.done[entry * ct : (entry + heads) * ct].reshape(1, heads, ct, -1)
        own = mx.concatenate([keys[0][:, :, :group], rows, keys[0][:, :, group + ct :]], axis=2)
        i0, i1 = lo - (n - L), hi - (n - L)
        inside = quantized_attention(
            queries[b : b + 1, :, i0:i1],
            (own,),
            values,
            scale=scale,
            mask=mask[i0:i1],
            quant=replace(paged.quant(), key_bits=FLOAT_BITS, key_scheme="token"),
            sinks=paged.sinks,
            softcap=paged.softcap,
        )
        parts += [out[:, :, at:i0], inside]
        at = i1
    return mx.concatenate([*parts, out[:, :, at:]], axis=2)


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


def channel_keys_as_float(keys: tuple, tail: mx.array, quant: KVQuant, left_padding):
    """Format-2 keys of a contiguous cache as float16 (the reference path): complete groups
    dequantized, the filling one from the tail. Returns (keys, the format to read them as)."""
    if left_padding is not None:
        raise NotImplementedError(
            "KV format 2 in a left-padded batch runs on the CPU fused kernel only, so far"
        )
    ct = quant.channel_tokens
    held = keys[0].shape[2]
    full = held // ct * ct
    parts = [quant.dequantize_keys(tuple(x[..., :full, :] for x in keys))] if full else []
    if held > full:
        parts.append(tail[..., : held - full, :].astype(mx.float32))
    floats = mx.concatenate(parts, axis=2) if len(parts) > 1 else parts[0]
    return (floats.astype(mx.float16),), replace(quant, key_bits=FLOAT_BITS, key_scheme="token")


def _scores(q: mx.array, keys: tuple, bits: int, group_size: int) -> mx.array:
    if bits == FLOAT_BITS:
        return q @ keys[0].astype(q.dtype).swapaxes(-1, -2)
    return mx.quantized_matmul(q, *keys, transpose=True, group_size=group_size, bits=bits)


def _weighted(p: mx.array, values: tuple, bits: int, group_size: int) -> mx.array:
    if bits == FLOAT_BITS:
        return p @ values[0].astype(p.dtype)
    return mx.quantized_matmul(p, *values, transpose=False, group_size=group_size, bits=bits)


def float_attention(queries, keys, values, *, scale, mask, sinks=None, softcap: float = 0.0):
    """Attention over float keys and values [B, Hkv, n, D]: MLX's fused kernel, or, with a
    soft cap (which it does not take), ``quantized_attention`` over them as float16 kinds."""
    if not softcap:
        return mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=scale, mask=mask, sinks=sinks
        )
    return quantized_attention(
        queries, (keys,), (values,), scale=scale, mask=mask, quant=KVQuant(FLOAT_BITS, FLOAT_BITS),
        sinks=sinks, softcap=softcap,
    )  # fmt: skip


def causal_mask(q_len: int, k_len: int) -> mx.array:
    """Boolean [q_len, k_len]: the queries are the last ``q_len`` of ``k_len`` positions."""
    q_idx = mx.arange(k_len - q_len, k_len)
    return q_idx[:, None] >= mx.arange(k_len)[None]


def quantized_attention(
    queries: mx.array,
    keys: tuple,
    values: tuple,
    *,
    scale: float,
    mask,
    quant: KVQuant,
    sinks: mx.array | None = None,
    softcap: float = 0.0,
) -> mx.array:
    """Scaled dot-product attention of ``queries`` [B, Hq, L, D] over stored keys/values;
    ``softcap`` c > 0: each score s becomes c * tanh(s / c) before the mask (Gemma 2)."""
    B, n_q_heads, L, D = queries.shape
    n_kv_heads = keys[0].shape[1]
    repeats = n_q_heads // n_kv_heads
    q = queries * scale
    if repeats > 1:
        q = q.reshape(B, n_kv_heads, repeats, L, D)
        keys = tuple(mx.expand_dims(x, 2) for x in keys)
        values = tuple(mx.expand_dims(x, 2) for x in values)

    scores = _scores(q, keys, quant.key_bits, quant.group_size)
    if softcap:
        scores = mx.tanh(scores / softcap) * softcap
    if mask is not None:
        if isinstance(mask, str):
            mask = causal_mask(scores.shape[-2], scores.shape[-1])
        if repeats > 1 and mask.ndim > 3:
            mask = mx.expand_dims(mask, 2)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    if sinks is not None:
        sink = sinks.astype(scores.dtype).reshape(scores.shape[1:-2] if repeats > 1 else (-1,))
        sink = mx.broadcast_to(sink.reshape(*sink.shape, 1, 1), (*scores.shape[:-1], 1))
        probs = mx.softmax(mx.concatenate([sink, scores], axis=-1), axis=-1, precise=True)[..., 1:]
    else:
        probs = mx.softmax(scores, axis=-1, precise=True)
    out = _weighted(probs, values, quant.value_bits, quant.group_size)
    if repeats > 1:
        out = out.reshape(B, n_q_heads, L, -1)
    return out
