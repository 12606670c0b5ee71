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

Format 2 (per-channel keys, ``quant.channel_keys``): a row's channel groups start at
its first token (``left_padding[b]``), as in its own cache; the group still filling is row
b of ``tails`` [B, heads, ct, key_dim] (float16), quantized when it completes. While
mlx-lm runs a right-padded prompt (``prepare(right_padding=...)`` .. ``finalize``), the
padding a row gets at its end never joins its groups: only a row's own tokens are written
to its keys, and each row attends alone over its own rows (the same computation as the
agent's cache alone). ``finalize`` rolls the padding to the left, groups and all.
"""

from __future__ import annotations

import mlx.core as mx

from .. import kernels
from ..format.geometry import BLOCK_TOKENS
from ..format.quant import KVQuant, hadamard
from ..kernels import RowSource
from ..kernels.attention import CacheBase, cache_attention
from ..kernels.masks import remember_mask
from .state import CacheState


def _stack_tails(parts: list[tuple[mx.array | None, int]]) -> mx.array | None:
    """(tails [rows, heads, ct, dim] or None, rows) pieces as one array (zeros where a piece
    has no tails yet); None if none has any."""
    shape = next((t.shape[1:] for t, _ in parts if t is not None), None)
    if shape is None:
        return None
    return mx.concatenate(
        [mx.zeros((rows, *shape), mx.float16) if t is None else t for t, rows in parts]
    )


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
        self.tails: mx.array | None = None  # channel keys: each row's filling group
        self._prompt: tuple[int, list[int]] | None = None  # right-padded: (first row, lengths)

    # -- building ---------------------------------------------------------------

    @classmethod
    def merge(cls, caches) -> BatchQuantizedKVCache:
        """One batch from per-agent ``AgentKVCache``s (the merge kernel, one pass)."""
        quant, window = caches[0].quant, caches[0].window
        if any(c.quant != quant for c in caches):
            raise ValueError("caches in one batch must share a storage format")
        if quant.channel_keys and any(c.start % quant.channel_tokens for c in caches):
            raise ValueError(
                "a per-channel cache whose first held token is not on a channel group cannot "
                "join a batch"
            )
        held = [c.held for c in caches]
        used = max(held)
        batch = cls(quant, [used - h for h in held], window=window)
        batch.offset = mx.array([c.offset for c in caches], dtype=mx.int32)
        if quant.channel_keys:
            batch.tails = _stack_tails([(c.tail, 1) for c in caches])
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
        q = self.quant
        keys, values = q.rotated(keys), q.rotated(values)  # attention reads H k, H v
        if q.channel_keys:
            return self._update_channels(keys, values)
        n = keys.shape[2]
        q_keys = self.quant.quantize(keys, self.quant.key_bits)
        q_values = self.quant.quantize(values, self.quant.value_bits)
        self._store(q_keys, q_values, n)
        return self.keys_and_values()

    def _store(self, q_keys: tuple, q_values: tuple, n: int) -> None:
        """Write n new rows of every component at ``_idx`` (growing the buffers)."""
        self._grow(n, lambda: (*q_keys, *q_values))
        lo, hi = self._idx, self._idx + n
        for dst, src in zip(self.components, (*q_keys, *q_values)):
            dst[..., lo:hi, :] = src
        self._idx = hi
        self.offset = self.offset + n

    def _grow(self, n: int, parts) -> None:
        """Room for n more rows; ``parts()``: one array per component (dtypes and widths),
        asked for only when the buffers grow."""
        if self.keys is not None and self._idx + n <= self.capacity:
            return
        parts = parts()
        capacity = _capacity(self._idx + n)

        def grow(old, new):
            grown = mx.zeros((*new.shape[:2], capacity, new.shape[-1]), dtype=new.dtype)
            if old is not None and self._idx:
                grown[..., : self._idx, :] = old[..., : self._idx, :]
            return grown

        old = self.components or [None] * len(parts)
        self._set(tuple(grow(o, x) for o, x in zip(old, parts)), self._idx)

    def _row_end(self, b: int, idx: int) -> int:
        """Where row b's own tokens end when the buffers hold ``idx`` rows (before the
        padding of a right-padded prompt)."""
        if self._prompt is None:
            return idx
        first, lengths = self._prompt
        return first + min(lengths[b], idx - first)

    def _update_channels(self, keys: mx.array, values: mx.array):
        """Format 2: values per token; each row's own new keys join its tail, and the
        groups they complete are quantized into its rows (as its cache alone would)."""
        q, ct = self.quant, self.quant.channel_tokens
        b_rows, heads, n, dim = keys.shape
        q_values = q.quantize(values, q.value_bits)

        def template():  # the key components' dtypes and widths
            shape = (b_rows, heads, ct, dim)
            return (*q.quantize_channels(mx.zeros(shape, mx.float16)), *q_values)

        self._grow(n, template)
        lo = self._idx
        for dst, src in zip(self.values, q_values):
            dst[..., lo : lo + n, :] = src
        if self.tails is None:
            self.tails = mx.zeros((b_rows, heads, ct, dim), mx.float16)
        new = keys.astype(mx.float16)
        pads = self.left_padding.tolist()
        for b in range(b_rows):
            start = self._row_end(b, lo)
            own = self._row_end(b, lo + n) - start
            if own == 0:
                continue
            r = (start - pads[b]) % ct
            row = new[b : b + 1, :, :own]
            full = (r + own) // ct * ct
            if not full:  # the group still fills (most decode steps): only the new rows
                self.tails[b : b + 1, :, r : r + own, :] = row
                continue
            source = mx.concatenate([self.tails[b : b + 1, :, :r], row], axis=2) if r else row
            first = start - r
            for dst, src in zip(self.keys, q.quantize_channels(source[..., :full, :])):
                dst[b : b + 1, :, first : first + full, :] = src
            if r + own > full:
                self.tails[b : b + 1, :, : r + own - full, :] = source[..., full:, :]
        self._idx = lo + n
        self.offset = self.offset + n
        return self.keys_and_values()

    def keys_and_values(self):
        idx = self._idx
        if idx == self.capacity:
            return self.keys, self.values
        return tuple(x[..., :idx, :] for x in self.keys), tuple(
            x[..., :idx, :] for x in self.values
        )

    def agentkv_attention(self, queries, keys, values, *, scale, mask, sinks=None, softcap=0.0):
        q = self.quant
        if not q.channel_keys:
            return cache_attention(
                queries,
                keys,
                values,
                scale=scale,
                mask=mask,
                quant=q,
                sinks=sinks,
                left_padding=self.left_padding,
                softcap=softcap,
            )
        queries = hadamard(queries) if q.rotate else queries  # q.(H k) == (H q).(H k)
        if self._prompt is None:
            out = cache_attention(
                queries, keys, values, scale=scale, mask=mask, quant=q, sinks=sinks,
                left_padding=self.left_padding, tail=self.tails, softcap=softcap,
            )  # fmt: skip
        else:
            out = self._rows_alone(queries, scale=scale, sinks=sinks, softcap=softcap)
        return hadamard(out) if q.rotate else out  # values are stored as H v

    def _rows_alone(self, queries, *, scale, sinks, softcap=0.0):
        """A right-padded prompt: each row's own queries over its own rows, as its cache
        alone computes them; the padding's queries get zeros (mlx-lm drops them)."""
        from ..mlx_adapter import create_causal_mask

        n = queries.shape[2]
        pads = self.left_padding.tolist()
        outs = []
        for b in range(queries.shape[0]):
            end = self._row_end(b, self._idx)
            own = end - (self._idx - n)
            out = None
            if own > 0:
                held = end - pads[b]
                mask = None if own == 1 else "causal"
                if self.window:
                    mask = remember_mask(
                        create_causal_mask(own, offset=held - own, window_size=self.window),
                        self.window,
                    )
                out = cache_attention(
                    queries[b : b + 1, :, :own],
                    tuple(x[b : b + 1, :, pads[b] : end] for x in self.keys),
                    tuple(x[b : b + 1, :, pads[b] : end] for x in self.values),
                    scale=scale, mask=mask, quant=self.quant, sinks=sinks,
                    tail=self.tails[b : b + 1], softcap=softcap,
                )  # fmt: skip
            if own < n:
                v0, bits = self.values[0], self.quant.value_bits
                dim_v = v0.shape[-1] if bits == 16 else v0.shape[-1] * 32 // bits
                rest = mx.zeros((1, queries.shape[1], n - max(own, 0), dim_v), mx.float32)
                out = rest if out is None else mx.concatenate([out, rest], axis=2)
            outs.append(out)
        return mx.concatenate(outs)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None, **_):
        from ..mlx_adapter import create_causal_mask

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
            if self.quant.channel_keys:
                if lengths is None:
                    lengths = [max(right_padding) - p for p in right_padding]
                self._prompt = (self._idx, [int(n) for n in lengths])

    def finalize(self):
        """After a right-padded prompt: roll each row so its padding is on the left."""
        if self._right_padding is None:
            return
        from ..mlx_adapter import dynamic_roll

        padding = self._right_padding
        self._set(
            tuple(dynamic_roll(x, padding[:, None], axis=2) for x in self.components), self._idx
        )
        self.offset = self.offset - padding
        self.left_padding = self.left_padding + padding
        self._right_padding = None
        self._prompt = None

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
        if self.tails is not None:
            self.tails = self.tails[mx.array(indices)] if indices else None

    def extend(self, other: BatchQuantizedKVCache) -> None:
        """Append the rows of ``other`` (in place)."""
        mine, theirs = self.left_padding.tolist(), other.left_padding.tolist()
        rows = [(self.components, i, p, self._idx - p) for i, p in enumerate(mine)]
        rows += [(other.components, i, p, other._idx - p) for i, p in enumerate(theirs)]
        used = max((n for *_, n in rows), default=0)
        self.offset = mx.concatenate([self.offset, other.offset])
        self.left_padding = mx.array([used - n for *_, n in rows], dtype=mx.int32)
        self._merge_rows(rows, used)
        if self.quant.channel_keys:
            self.tails = _stack_tails([(self.tails, len(mine)), (other.tails, len(theirs))])

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
        if self.quant.channel_keys and self.tails is not None:
            cache.tail = mx.array(self.tails[idx : idx + 1])
        return cache

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        q = self.quant
        if q.channel_keys and n and self.keys is not None:
            # A row cut inside a quantized group gets the group's kept keys back in its tail
            # (dequantized, as its own cache's trim does).
            ct, keep = q.channel_tokens, self._idx - n
            for b, pad in enumerate(self.left_padding.tolist()):
                done, kept = (self._idx - pad) // ct * ct, keep - pad
                if kept > 0 and kept < done and kept % ct:
                    first = pad + kept // ct * ct
                    group = tuple(x[b : b + 1, :, first : first + ct, :] for x in self.keys)
                    floats = q.dequantize_keys(group)[..., : kept % ct, :]
                    self.tails[b : b + 1, :, : kept % ct, :] = floats.astype(mx.float16)
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
    def state(self) -> CacheState:
        keys, values = self.keys_and_values() if self.keys is not None else (None, None)
        return CacheState.of(
            keys, values, self.offset, self.quant, window=self.window,
            tail=self.tails, left_padding=self.left_padding, idx=self._idx,
        )  # fmt: skip

    @state.setter
    def state(self, v):
        state = CacheState.from_batch_sequence(v)
        self.quant = state.quant()
        self.offset, self.left_padding, self._idx = state.offset, state.left_padding, state.idx
        self._idx = int(self._idx)
        self.window = int(state.window) or None
        self.tails = state.tail if self.quant.channel_keys else None
        self.keys = tuple(state.keys) if state.keys is not None else None
        self.values = tuple(state.values) if state.values is not None else None
        self._right_padding = None
        self._prompt = None

    @classmethod
    def from_state(cls, state) -> BatchQuantizedKVCache:
        obj = cls.__new__(cls)
        obj.state = state
        return obj
