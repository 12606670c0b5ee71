"""BatchQuantizedKVCache: several agents' caches as one left-padded batch, still quantized.

mlx-lm batches plain caches (``BatchKVCache``) and refuses quantized ones; this
class speaks the same protocol (``update_and_fetch``, ``make_mask`` with left
padding, ``prepare``/``finalize`` for right-padded prompts, ``filter``,
``extend``, ``extract``, ``trim``, ``state``) over the stored format, so
mlx-lm's ``BatchGenerator`` batches agentkv caches as they are. Rows move
between agents and batches through the merge/extract kernels::

    row b:  | zeros (left_padding[b]) | row b's tokens ........ |  spare  |
            0                         left_padding[b]         _idx    capacity

``offset[b]`` is the absolute position of row b's next token (agents differ),
and masks work in buffer rows, where every row's distances are its own.
"""

from __future__ import annotations

import mlx.core as mx

from .. import kernels
from ..kernels import RowSource
from .attention import cache_attention, remember_mask
from .base import CacheBase
from .blocks import BLOCK_TOKENS
from .quant import KVQuant


def _capacity(rows: int) -> int:
    return (rows + BLOCK_TOKENS - 1) // BLOCK_TOKENS * BLOCK_TOKENS + BLOCK_TOKENS


class BatchQuantizedKVCache(CacheBase):
    step = BLOCK_TOKENS

    def __init__(self, quant: KVQuant, left_padding: list[int], *, window: int | None = None):
        self.quant = quant
        self.window = window
        self.keys: tuple | None = None
        self.values: tuple | None = None
        self.left_padding = mx.array(left_padding, dtype=mx.int32)
        self.offset = mx.array([-p for p in left_padding], dtype=mx.int32)
        self._idx = 0
        self._right_padding = None

    # -- building ---------------------------------------------------------------

    @classmethod
    def merge(cls, caches) -> BatchQuantizedKVCache:
        """One batch from per-agent ``AgentKVCache``s (the merge kernel, one pass)."""
        quant, window = caches[0].quant, caches[0].window
        if any(c.quant != quant for c in caches):
            raise ValueError("caches in one batch must share a storage format")
        if quant.channel_keys:
            raise NotImplementedError(
                "mlx-lm's batch generation over KV format 2 (per-channel keys) is not supported "
                "yet; use format 1 caches (AgentKVCache(KVQuant(4, 4))) or agentkv's Engine, "
                "whose block pool batches format 2"
            )
        held = [c.held for c in caches]
        used = max(held)
        batch = cls(quant, [used - h for h in held], window=window)
        batch.offset = mx.array([c.offset for c in caches], dtype=mx.int32)
        if used == 0:
            return batch
        rows = [(c.components, 0, 0, h) for c, h in zip(caches, held)]
        batch._merge_rows(rows, used)
        return batch

    def _merge_rows(self, rows, used: int) -> None:
        """Rebuild the buffers from (components, row, first, length) rows, right-aligned to used."""
        if used == 0:
            self.keys = self.values = None
            self._idx = 0
            return
        template = next(comps for comps, *_ in rows if comps)
        blank = tuple(mx.zeros((1, x.shape[1], 1, x.shape[-1]), dtype=x.dtype) for x in template)
        sources = [
            RowSource(tuple(comps) if comps else blank, r, first, n) for comps, r, first, n in rows
        ]
        self._set(kernels.merge(sources, used=used, capacity=_capacity(used)), used)

    def _set(self, components: tuple, idx: int) -> None:
        n = self.quant.key_parts
        self.keys, self.values = tuple(components[:n]), tuple(components[n:])
        self._idx = idx

    @property
    def components(self) -> list[mx.array]:
        return [] if self.keys is None else [*self.keys, *self.values]

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys[0].shape[2]

    # -- the cache protocol -------------------------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        n = keys.shape[2]
        q_keys = self.quant.quantize(keys, self.quant.key_bits)
        q_values = self.quant.quantize(values, self.quant.value_bits)
        if self.keys is None or self._idx + n > self.capacity:
            capacity = _capacity(self._idx + n)

            def grow(old, new):
                grown = mx.zeros((*new.shape[:2], capacity, new.shape[-1]), dtype=new.dtype)
                if old is not None and self._idx:
                    grown[..., : self._idx, :] = old[..., : self._idx, :]
                return grown

            old = self.components or [None] * (len(q_keys) + len(q_values))
            self._set(tuple(grow(o, x) for o, x in zip(old, (*q_keys, *q_values))), self._idx)
        lo, hi = self._idx, self._idx + n
        for dst, src in zip(self.components, (*q_keys, *q_values)):
            dst[..., lo:hi, :] = src
        self._idx = hi
        self.offset = self.offset + n
        return self.keys_and_values()

    def keys_and_values(self):
        idx = self._idx
        if idx == self.capacity:
            return self.keys, self.values
        return tuple(x[..., :idx, :] for x in self.keys), tuple(
            x[..., :idx, :] for x in self.values
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
            left_padding=self.left_padding,
        )

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None, **_):
        from mlx_lm.models.base import create_causal_mask

        window = window_size or self.window
        mask = create_causal_mask(
            N, offset=self._idx, left_padding=self.left_padding, window_size=window
        )
        return remember_mask(mask, window)

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError("left padding can only be added to an empty batch")
            extra = mx.array(left_padding, dtype=mx.int32)
            self.left_padding = self.left_padding + extra
            self.offset = self.offset - extra
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = mx.array(right_padding, dtype=mx.int32)

    def finalize(self):
        """After a right-padded prompt: roll each row so its padding is on the left."""
        if self._right_padding is None:
            return
        from mlx_lm.models.cache import dynamic_roll

        padding = self._right_padding
        self._set(
            tuple(dynamic_roll(x, padding[:, None], axis=2) for x in self.components), self._idx
        )
        self.offset = self.offset - padding
        self.left_padding = self.left_padding + padding
        self._right_padding = None

    def filter(self, batch_indices) -> None:
        """Keep only these rows (in place), dropping padding no row needs any more."""
        indices = [
            int(i)
            for i in (
                batch_indices.tolist() if isinstance(batch_indices, mx.array) else batch_indices
            )
        ]
        pads = self.left_padding.tolist()
        self.offset = self.offset[mx.array(indices)]
        lengths = [self._idx - pads[i] for i in indices]
        used = max(lengths, default=0)
        self.left_padding = mx.array([used - n for n in lengths], dtype=mx.int32)
        self._merge_rows([(self.components, i, pads[i], n) for i, n in zip(indices, lengths)], used)

    def extend(self, other: BatchQuantizedKVCache) -> None:
        """Append the rows of ``other`` (in place)."""
        mine, theirs = self.left_padding.tolist(), other.left_padding.tolist()
        rows = [(self.components, i, p, self._idx - p) for i, p in enumerate(mine)]
        rows += [(other.components, i, p, other._idx - p) for i, p in enumerate(theirs)]
        used = max((n for *_, n in rows), default=0)
        self.offset = mx.concatenate([self.offset, other.offset])
        self.left_padding = mx.array([used - n for *_, n in rows], dtype=mx.int32)
        self._merge_rows(rows, used)

    def extract(self, idx: int):
        """Row ``idx`` as that agent's ``AgentKVCache`` (the extract kernel, one pass)."""
        from .cache import AgentKVCache

        pad = int(self.left_padding[idx].item())
        offset = int(self.offset[idx].item())
        length = self._idx - pad
        cache = AgentKVCache(self.quant, window=self.window)
        cache.offset, cache.start = offset, offset - length
        if self.keys is not None:
            arrays = kernels.extract(
                self.components, row=idx, first=pad, length=length, capacity=_capacity(length)
            )
            cache.keys, cache.values = (
                tuple(arrays[: len(self.keys)]),
                tuple(arrays[len(self.keys) :]),
            )
        return cache

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        return n

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.components)

    @property
    def state(self):
        keys, values = self.keys_and_values() if self.keys is not None else (None, None)
        q = self.quant
        return (
            keys,
            values,
            self.offset,
            self.left_padding,
            self._idx,
            self.window or 0,
            q.key_bits,
            q.value_bits,
            q.group_size,
        )

    @state.setter
    def state(self, v):
        keys, values, self.offset, self.left_padding, self._idx, window, *bits = v
        self.quant = KVQuant(*bits)
        self.window = window or None
        self.keys = tuple(keys) if keys is not None else None
        self.values = tuple(values) if values is not None else None
        self._right_padding = None

    @classmethod
    def from_state(cls, state) -> BatchQuantizedKVCache:
        obj = cls.__new__(cls)
        obj.state = state
        return obj
