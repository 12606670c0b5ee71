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

Format 2 (``quant.channel_keys``; docs/kv-format-v2.md): keys and values are stored
rotated by H; a channel group of keys is quantized when it completes, until then its
keys are float16 rows of ``tail`` ``[1, heads, ct, dim]`` (the rows it will take in the
key components exist and are ignored until then).
"""

from __future__ import annotations

import mlx.core as mx

from ..format.geometry import BLOCK_TOKENS
from ..format.quant import KVQuant, hadamard
from ..kernels.attention import CacheBase, cache_attention
from ..kernels.masks import remember_mask
from .state import CacheState


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
    """One layer's KV cache in a ``KVQuant`` format (default ``KVQuant()``: format 2 at 4 bits,
    keys rotated and quantized per channel; ``KVQuant(**V1)`` for per-token keys)."""

    step = BLOCK_TOKENS

    def __init__(self, quant: KVQuant | None = None, *, window: int | None = None):
        self.quant = quant or KVQuant()
        self.window = window
        self.keys: tuple | None = None
        self.values: tuple | None = None
        self.offset = 0
        self.start = 0
        self.tail: mx.array | None = None  # format 2: keys of the channel group still filling

    @classmethod
    def from_components(
        cls,
        quant: KVQuant,
        components: list[mx.array],
        *,
        offset: int,
        start: int = 0,
        window: int | None = None,
        tail: mx.array | None = None,
    ) -> AgentKVCache:
        """Wrap loaded component arrays (keys' components first, then values'); format 2
        also takes the float16 ``tail`` [1, heads, offset % ct, dim] of the filling group."""
        cache = cls(quant, window=window)
        cache.keys = tuple(components[: quant.key_parts])
        cache.values = tuple(components[quant.key_parts :])
        cache.offset = offset
        cache.start = start
        if quant.channel_keys:
            cache._set_tail(tail, components[0].shape[1], quant)
        return cache

    def _set_tail(self, rows, heads: int, quant: KVQuant) -> None:
        ct = quant.channel_tokens
        dim = self.keys[0].shape[-1] * 32 // quant.key_bits
        count = self.offset % ct
        if rows is None or tuple(rows.shape) != (1, heads, count, dim):
            raise ValueError(f"format 2: the tail must hold the last {count} keys")
        self.tail = mx.zeros((1, heads, ct, dim), mx.float16)
        if count:
            self.tail[..., :count, :] = rows.astype(mx.float16)

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
        q = self.quant
        keys, values = q.rotated(keys), q.rotated(values)  # attention reads H k, H v
        if q.channel_keys:
            return self._update_channels(keys, values)
        n = keys.shape[2]
        q_keys = q.quantize(keys, q.key_bits)
        q_values = q.quantize(values, q.value_bits)
        if self.keys is None or self.held + n > self.capacity:
            self._grow(self.held + n, q_keys, q_values)
        lo, hi = self.held, self.held + n
        for dst, src in zip(self.keys, q_keys):
            dst[..., lo:hi, :] = src
        for dst, src in zip(self.values, q_values):
            dst[..., lo:hi, :] = src
        self.offset += n
        return self.keys_and_values()

    def _update_channels(self, keys: mx.array, values: mx.array):
        """Format 2: values per token; keys joined to the tail, whole groups quantized."""
        q, ct = self.quant, self.quant.channel_tokens
        b, heads, n, dim = keys.shape
        q_values = q.quantize(values, q.value_bits)
        if self.keys is None or self.held + n > self.capacity:
            template = q.quantize_channels(mx.zeros((b, heads, ct, dim), mx.float16))
            self._grow(self.held + n, template, q_values)
        if self.tail is None:
            self.tail = mx.zeros((b, heads, ct, dim), mx.float16)
        lo = self.held
        for dst, src in zip(self.values, q_values):
            dst[..., lo : lo + n, :] = src
        r = self.offset % ct
        new = keys.astype(mx.float16)
        source = mx.concatenate([self.tail[..., :r, :], new], axis=2) if r else new
        full = (r + n) // ct * ct
        if full:
            first = lo - r
            for dst, src in zip(self.keys, q.quantize_channels(source[..., :full, :])):
                dst[..., first : first + full, :] = src
        if r + n > full:
            self.tail[..., : r + n - full, :] = source[..., full:, :]
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

    def dequantized(self) -> tuple[mx.array, mx.array]:
        """The held keys and values as float32 [1, heads, held, dim], in the model's space
        (format 2: per-channel groups and the tail read, the rotation undone)."""
        from ..format.quant import dequantize_tokens
        from ..kernels.reference import channel_keys_as_float

        q = self.quant
        keys, values = self.keys_and_values()
        if q.channel_keys:
            (k,), _ = channel_keys_as_float(keys, self.tail, q, None)
            k = k.astype(mx.float32)
        else:
            k = dequantize_tokens(keys, q.key_bits, q.group_size)
        v = dequantize_tokens(values, q.value_bits, q.group_size)
        return (hadamard(k), hadamard(v)) if q.rotate else (k, v)

    def agentkv_attention(self, queries, keys, values, *, scale, mask, sinks=None, softcap=0.0):
        rotate = self.quant.rotate
        out = cache_attention(
            hadamard(queries) if rotate else queries,  # q.(H k) == (H q).(H k)
            keys,
            values,
            scale=scale,
            mask=mask,
            quant=self.quant,
            sinks=sinks,
            tail=self.tail,
            softcap=softcap,
        )
        return hadamard(out) if rotate else out  # values are stored as H v

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

    def trim(self, n: int) -> int:
        """Forget the last ``n`` tokens (never below ``start``); returns how many."""
        n = max(0, min(self.held, n))
        q = self.quant
        if q.channel_keys and n:
            ct = q.channel_tokens
            keep = self.offset - n
            if keep < self.offset // ct * ct and keep % ct:
                # Cut inside a quantized group: its kept keys go back to the tail (dequantized;
                # quantized again when the group completes).
                first = keep // ct * ct - self.start
                group = tuple(x[..., first : first + ct, :] for x in self.keys)
                self.tail[..., : keep % ct, :] = q.dequantize_keys(group)[
                    ..., : keep % ct, :
                ].astype(mx.float16)
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
    def state(self) -> CacheState:
        """mlx-lm's convention: arrays and scalars in one tuple, here a ``CacheState``.
        Format 2 also keeps the tail's filled rows."""
        keys, values = self.keys_and_values() if self.keys is not None else (None, None)
        q = self.quant
        tail = None
        if self.tail is not None:
            tail = self.tail[..., : self.offset % q.channel_tokens, :]
        return CacheState.of(
            keys, values, self.offset, q, window=self.window, start=self.start, tail=tail
        )

    @state.setter
    def state(self, v):
        state = CacheState.from_sequence(v)
        self.quant = state.quant()
        self.offset, self.start = int(state.offset), int(state.start)
        self.window = int(state.window) or None
        self.keys = tuple(state.keys) if state.keys is not None else None
        self.values = tuple(state.values) if state.values is not None else None
        self.tail = None
        if self.quant.channel_keys and self.keys is not None:
            self._set_tail(state.tail, self.keys[0].shape[1], self.quant)

    @classmethod
    def from_state(cls, state) -> AgentKVCache:
        obj = cls.__new__(cls)
        obj.state = state
        return obj
