"""Attention over agentkv caches, keys and values each in their own format.

Keys and values arrive as tuples of components (see ``quant.py``): quantized
kinds go through ``mx.quantized_matmul`` with float32 queries (on MLX's CPU
backend this is ~2x fp32 SDPA at decode, and it never dequantizes the cache);
float16 kinds are cast to the query dtype. Unlike mlx-lm's quantized SDPA this
handles different bits for keys and values and attention sinks, and never
scales the caller's ``queries`` in place.
"""

from __future__ import annotations

import mlx.core as mx

from .quant import FLOAT_BITS, KVQuant


def _scores(q: mx.array, keys: tuple, bits: int, group_size: int) -> mx.array:
    if bits == FLOAT_BITS:
        return q @ keys[0].astype(q.dtype).swapaxes(-1, -2)
    return mx.quantized_matmul(q, *keys, transpose=True, group_size=group_size, bits=bits)


def _weighted(p: mx.array, values: tuple, bits: int, group_size: int) -> mx.array:
    if bits == FLOAT_BITS:
        return p @ values[0].astype(p.dtype)
    return mx.quantized_matmul(p, *values, transpose=False, group_size=group_size, bits=bits)


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
) -> mx.array:
    """Scaled dot-product attention of ``queries`` [B, Hq, L, D] over stored keys/values."""
    B, n_q_heads, L, D = queries.shape
    n_kv_heads = keys[0].shape[1]
    repeats = n_q_heads // n_kv_heads
    q = queries * scale
    if repeats > 1:
        q = q.reshape(B, n_kv_heads, repeats, L, D)
        keys = tuple(mx.expand_dims(x, 2) for x in keys)
        values = tuple(mx.expand_dims(x, 2) for x in values)

    scores = _scores(q, keys, quant.key_bits, quant.group_size)
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
