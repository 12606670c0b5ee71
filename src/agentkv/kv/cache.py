"""AgentKVCache: one layer of one agent's KV cache, kept in its stored format.

It speaks mlx-lm's cache protocol (``offset``, ``update_and_fetch``,
``make_mask``, ``trim``, ``state``...), so mlx-lm models run on it unchanged;
attention over it goes through ``agentkv_attention`` (see ``mlx_adapter``).

Layout: each component is an array ``[1, heads, capacity, width]`` whose row
``r`` holds token ``start + r``. ``start`` is 0 except for a sliding-window
layer loaded from disk, which holds only the blocks its window reaches::

    token:  start ........ offset ............ start + capacity
    rows:   |### stored ###|...... spare ......|

Capacity grows in 256-token steps and a loaded cache gets one spare block, so
the first decode steps after a reload never copy the cache.
"""

from __future__ import annotations

import mlx.core as mx

from .attention import cache_attention, remember_mask
from .base import CacheBase
from .blocks import BLOCK_TOKENS
from .quant import KVQuant


def _round_up(n: int, step: int = BLOCK_TOKENS) -> int:
    return (n + step - 1) // step * step


def window_start(tokens: int, window: int | None) -> int:
    """First token a sliding-window layer keeps at ``tokens``: the block its window reaches.

    The same rule decides what a reload reads and what a live cache keeps, so a
    resumed agent attends over exactly the keys the running one would.
    """
    if window is None or tokens <= window:
        return 0
    return (tokens - window) // BLOCK_TOKENS * BLOCK_TOKENS


class AgentKVCache(CacheBase):
    """One layer's KV cache in a ``KVQuant`` format (default: 4-bit, group 64)."""

    step = BLOCK_TOKENS

    def __init__(self, quant: KVQuant | None = None, *, window: int | None = None):
        self.quant = quant or KVQuant()
        self.window = window
        self.keys: tuple | None = None
        self.values: tuple | None = None
        self.offset = 0
        self.start = 0

    @classmethod
    def from_components(
        cls,
        quant: KVQuant,
        components: list[mx.array],
        *,
        offset: int,
        start: int = 0,
        window: int | None = None,
    ) -> AgentKVCache:
        """Wrap loaded component arrays (keys' components first, then values')."""
        cache = cls(quant, window=window)
        cache.keys = tuple(components[: quant.key_parts])
        cache.values = tuple(components[quant.key_parts :])
        cache.offset = offset
        cache.start = start
        return cache

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys[0].shape[2]

    @property
    def held(self) -> int:
        """Rows in use: tokens ``start`` to ``offset``."""
        return self.offset - self.start

    def _grow(self, rows: int, keys: tuple, values: tuple) -> None:
        capacity = _round_up(rows) + self.step

        def expand(old, new):
            shape = (*new.shape[:2], capacity, new.shape[-1])
            grown = mx.zeros(shape, dtype=new.dtype)
            if old is not None and self.held:
                grown[..., : self.held, :] = old[..., : self.held, :]
            return grown

        self.keys = tuple(expand(o, n) for o, n in zip(self.keys or (None,) * len(keys), keys))
        self.values = tuple(
            expand(o, n) for o, n in zip(self.values or (None,) * len(values), values)
        )

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Store new keys/values [B, heads, n, dim]; return all stored ones."""
        n = keys.shape[2]
        q_keys = self.quant.quantize(keys, self.quant.key_bits)
        q_values = self.quant.quantize(values, self.quant.value_bits)
        if self.keys is None or self.held + n > self.capacity:
            self._grow(self.held + n, q_keys, q_values)
        lo, hi = self.held, self.held + n
        for dst, src in zip(self.keys, q_keys):
            dst[..., lo:hi, :] = src
        for dst, src in zip(self.values, q_values):
            dst[..., lo:hi, :] = src
        self.offset += n
        return self.keys_and_values()

    def keys_and_values(self):
        held = self.held
        if held == self.capacity:
            return self.keys, self.values
        return (
            tuple(x[..., :held, :] for x in self.keys),
            tuple(x[..., :held, :] for x in self.values),
        )

    def agentkv_attention(self, queries, keys, values, *, scale, mask, sinks=None):
        return cache_attention(
            queries,
            keys,
            values,
            scale=scale,
            mask=mask,
            quant=self.quant,
            sinks=sinks,
        )

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """Mask for N new queries at positions [offset, offset + N) over held keys."""
        window = window_size or self.window
        if self.start == 0 and window is None and not return_array:
            return None if N == 1 else "causal"
        q_pos = mx.arange(self.offset, self.offset + N)[:, None]
        k_pos = mx.arange(self.start, self.offset + N)[None]
        mask = k_pos <= q_pos
        if window is not None:
            mask = mask & (q_pos - k_pos < window)
        return remember_mask(mask, window)

    def drop_before(self, token: int) -> None:
        """Free the rows of tokens before ``token`` (a block boundary; sliding windows only)."""
        if token <= self.start or self.keys is None:
            return
        if token % BLOCK_TOKENS or token > self.offset:
            raise ValueError(
                f"cannot drop to token {token} (start {self.start}, offset {self.offset})"
            )
        cut = token - self.start
        capacity = max(_round_up(self.offset - token) + self.step, self.step)

        def shift(x):
            kept = mx.zeros((*x.shape[:2], capacity, x.shape[-1]), dtype=x.dtype)
            kept[..., : self.offset - token, :] = x[..., cut : self.held, :]
            return kept

        self.keys = tuple(shift(x) for x in self.keys)
        self.values = tuple(shift(x) for x in self.values)
        self.start = token

    def trim(self, n: int) -> int:
        """Forget the last ``n`` tokens (never below ``start``); returns how many."""
        n = max(0, min(self.held, n))
        self.offset -= n
        return n

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return sum(x.nbytes for x in (*self.keys, *self.values))

    @property
    def components(self) -> list[mx.array]:
        """The component arrays at full capacity, keys' first (storage order)."""
        return [] if self.keys is None else [*self.keys, *self.values]

    @classmethod
    def merge(cls, caches):
        """One left-padded batch of these caches (mlx-lm calls this to batch a layer)."""
        from .batch import BatchQuantizedKVCache

        return BatchQuantizedKVCache.merge(caches)

    @property
    def state(self):
        """mlx-lm 0.32.2's convention: arrays and scalars in one tuple (see mlx_adapter)."""
        keys, values = self.keys_and_values() if self.keys is not None else (None, None)
        q = self.quant
        return (
            keys,
            values,
            self.offset,
            self.start,
            self.window or 0,
            q.key_bits,
            q.value_bits,
            q.group_size,
        )

    @state.setter
    def state(self, v):
        keys, values, self.offset, self.start, window, *bits = v
        self.quant = KVQuant(*bits)
        self.window = window or None
        self.keys = tuple(keys) if keys is not None else None
        self.values = tuple(values) if values is not None else None

    @classmethod
    def from_state(cls, state) -> AgentKVCache:
        obj = cls.__new__(cls)
        obj.state = state
        return obj
