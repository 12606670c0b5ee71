"""Mask recognition: which attention masks an agentkv cache made.

The fused CPU kernels never read a mask array; they recompute causality, left padding and a
sliding window from the cache itself. So they may run only when the mask mlx-lm's model code
hands to attention is one an agentkv cache made (``make_mask``), or ``None``/``"causal"``. A
cache records each mask array it returns here, with its window; the registry holds the array
itself (not only its ``id``), so an id can never be reused by another array while recorded.
"""

from __future__ import annotations

from collections import OrderedDict

import mlx.core as mx

NOT_OURS = -1
_OUR_MASKS: OrderedDict[int, tuple[mx.array, int]] = OrderedDict()
_REMEMBERED = 16  # masks of the last few forward passes; one per layer kind in flight


def remember_mask(mask, window: int | None):
    """Record a mask array an agentkv cache made (causal, its left padding, ``window``)."""
    if isinstance(mask, mx.array):
        _OUR_MASKS[id(mask)] = (mask, window or 0)
        while len(_OUR_MASKS) > _REMEMBERED:
            _OUR_MASKS.popitem(last=False)
    return mask


def mask_window(mask, n_queries: int) -> int:
    """The sliding window ``mask`` stands for (0: none), or ``NOT_OURS``."""
    if mask is None:
        return 0 if n_queries == 1 else NOT_OURS
    if isinstance(mask, str):
        return 0 if mask == "causal" else NOT_OURS
    held = _OUR_MASKS.get(id(mask))
    return held[1] if held is not None and held[0] is mask else NOT_OURS
