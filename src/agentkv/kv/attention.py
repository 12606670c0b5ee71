"""Attention over agentkv caches, keys and values each in their own format.

On CPU the fused kernel of the extension runs (csrc/core/attention.h): keys
and values are dequantized 64 tokens at a time in L1 and every query's result
is computed in one fixed order, whether it runs alone or in a padded batch row
(~4x faster than ``mx.quantized_matmul`` at decode over 4K tokens, ~12x for a
256-token prefill chunk). It needs the mask to be one agentkv's caches made
(causal, left padding, sliding window), which it recomputes from the cache.

Elsewhere (GPU, other bit widths, a model's own masks) keys and values go
through ``mx.quantized_matmul`` with the queries in their dtype, never
dequantizing the cache; float16 kinds are cast to the query dtype. Either way
this handles different bits for keys and values and attention sinks, and never
scales the caller's ``queries`` in place.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import replace

import mlx.core as mx

from .quant import FLOAT_BITS, KVQuant

FUSED_BITS = (2, 4, 8, 16)
ENV = "AGENTKV_ATTENTION"  # "reference" forces the mx.quantized_matmul path
_OUR_MASKS: OrderedDict[int, tuple[mx.array, int]] = OrderedDict()
NOT_OURS = -1
FUSED, KERNEL, REFERENCE = "fused_cpu", "gpu_kernel", "quantized_matmul"
_PATHS = {FUSED: 0, KERNEL: 0, REFERENCE: 0}


def paths_used() -> dict[str, int]:
    """How many attention calls over agentkv caches took each path, in this process."""
    return dict(_PATHS)


def remember_mask(mask, window: int | None):
    """Record a mask array an agentkv cache made (causal, its left padding, ``window``)."""
    if isinstance(mask, mx.array):
        _OUR_MASKS[id(mask)] = (mask, window or 0)
        while len(_OUR_MASKS) > 16:
            _OUR_MASKS.popitem(last=False)
    return mask


def mask_window(mask, n_queries: int) -> int:
    """The sliding window ``mask`` stands for (0: none), or NOT_OURS."""
    if mask is None:
        return 0 if n_queries == 1 else NOT_OURS
    if isinstance(mask, str):
        return 0 if mask == "causal" else NOT_OURS
    held = _OUR_MASKS.get(id(mask))
    return held[1] if held is not None and held[0] is mask else NOT_OURS


def fused_available(quant: KVQuant, queries: mx.array, mask) -> bool:
    return paged_fused_available(quant, queries) and (
        mask_window(mask, queries.shape[-2]) != NOT_OURS
    )


def cache_attention(
    queries,
    keys,
    values,
    *,
    scale,
    mask,
    quant: KVQuant,
    sinks=None,
    left_padding: mx.array | None = None,
    tail: mx.array | None = None,
) -> mx.array:
    """Attention for an agentkv cache: the fused CPU kernel where it applies.

    ``mask`` must come from the cache's ``make_mask`` (or be None/"causal") for the
    fused kernel, which recomputes it from the window recorded with it. Format 2
    (per-channel keys) also reads ``tail`` [B, heads, ct, dim], each row's filling group;
    rotation is the caller's.
    """
    if quant.channel_keys and not fused_available(quant, queries, mask):
        keys, quant = channel_keys_as_float(keys, tail, quant, left_padding)
    if fused_available(quant, queries, mask):
        from .. import _ext

        _PATHS[FUSED] += 1
        return _ext.quantized_attention(
            queries,
            list(keys),
            list(values),
            scale,
            quant.key_bits,
            quant.value_bits,
            quant.group_size,
            mask_window(mask, queries.shape[-2]),
            left_padding,
            sinks,
            quant.channel_tokens if quant.channel_keys else 0,
            tail,
        )
    _PATHS[REFERENCE] += 1
    return quantized_attention(
        queries, keys, values, scale=scale, mask=mask, quant=quant, sinks=sinks
    )


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


def paged_fused_available(quant: KVQuant, queries: mx.array) -> bool:
    return (
        os.environ.get(ENV) != "reference"
        and mx.default_device() == mx.cpu
        and queries.dtype == mx.float32
        and quant.key_bits in FUSED_BITS
        and quant.value_bits in FUSED_BITS
        and queries.shape[-1] % 8 == 0
        and queries.shape[-1] <= 256
    )


def paged_attention(
    queries: mx.array,
    keys: tuple,
    values: tuple,
    *,
    tables: mx.array,
    lengths: mx.array,
    kv_heads: int,
    block_tokens: int,
    scale: float,
    quant: KVQuant,
    window: int | None = None,
    sinks: mx.array | None = None,
    tail: mx.array | None = None,
    tail_slots: mx.array | None = None,
) -> mx.array:
    """Attention of a jagged batch over the pool's arenas, read through block tables.

    Per-channel keys (format 2) also read each row's float16 ``tail`` slot
    (``tail_slots[b]``), on every path. Rotation is the caller's (queries in, output out,
    both in the stored space).

    Row ``b`` holds ``lengths[b]`` tokens in blocks ``tables[b]``; its ``L`` queries are its
    last ``L`` tokens and see keys from 0 (or their sliding window's start) to themselves.
    On CPU the fused kernel (``csrc/core/attention*``); on Metal and CUDA the kernel body
    ``kernels/paged_attention.metal``; otherwise (float16 KV on a GPU, or
    ``AGENTKV_ATTENTION=reference``) the pure-MLX reference. They agree within float
    rounding (tests/kernels).
    """
    if paged_fused_available(quant, queries):
        from .. import _ext

        _PATHS[FUSED] += 1
        return _ext.paged_attention(
            queries,
            list(keys),
            list(values),
            tables,
            lengths,
            kv_heads,
            block_tokens,
            scale,
            quant.key_bits,
            quant.value_bits,
            quant.group_size,
            window or 0,
            sinks,
            quant.channel_tokens if quant.channel_keys else 0,
            tail,
            tail_slots,
        )
    from .. import kernels

    paged = kernels.PagedQuery(
        tuple(keys),
        tuple(values),
        tables,
        lengths,
        kv_heads,
        block_tokens,
        quant.key_bits,
        quant.value_bits,
        quant.group_size,
        window or 0,
        sinks,
        quant.channel_tokens if quant.channel_keys else 0,
        tail,
        tail_slots,
    )
    quantized = FLOAT_BITS not in (quant.key_bits, quant.value_bits)
    if quantized and os.environ.get(ENV) != "reference" and kernels.backend() in ("metal", "cuda"):
        _PATHS[KERNEL] += 1
        return kernels.paged_attention(queries, paged, scale=scale)
    _PATHS[REFERENCE] += 1
    return kernels.reference.paged_attention(queries, paged, scale=scale)


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
