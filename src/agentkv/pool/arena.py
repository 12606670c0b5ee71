"""KVArena: the bytes of every pool block, one MLX array per layer and stored component.

::

    arrays[layer][comp]   [capacity * heads * 256, width]      comp: k.w k.s k.b v.w v.s v.b
    row of (block, head, token t of the block) = (block * heads + head) * 256 + t

On CPU each array is allocated once and left untouched, so a block's pages are committed
when it is first written; ``release`` hands a freed block's pages back to the OS. New
tokens land by MLX scatters, which run in place because the arena owns the only reference
to each array: **never keep an arena array anywhere else** (``copies`` counts writes whose
buffer moved; the tests require 0). Between forward passes the arrays are evaluated, and
the block I/O here (``read_regions``, ``pack``, ``copy_rows``) works on their memory
directly through the extension.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .. import _ext
from ..kv.blocks import BLOCK_TOKENS
from ..kv.quant import KVQuant
from ..model.spec import LayerKind, ModelCacheSpec

IO_THREADS = 2


class KVArena:
    def __init__(self, spec: ModelCacheSpec, quant: KVQuant, capacity: int):
        self.spec = spec
        self.quant = quant
        self.capacity = capacity
        self.components = spec.components(quant)
        self.key_parts = quant.key_parts
        self.heads = spec.kv_heads
        self.rows = capacity * self.heads * BLOCK_TOKENS
        self._layout = (
            spec.num_layers,
            BLOCK_TOKENS,
            [(c.heads, c.width, c.dtype) for c in self.components],
        )
        lazy = mx.default_device() == mx.cpu
        self.arrays = [
            [self._allocate(c.width, c.dtype, lazy) for c in self.components]
            for _ in range(spec.num_layers)
        ]
        self._addresses = self._data_addresses() if lazy else None
        self._sliding = [layer.kind is LayerKind.SLIDING for layer in spec.layers]
        self.copies = 0
        self.released_bytes = 0

    def _allocate(self, width: int, dtype: str, lazy: bool) -> mx.array:
        if lazy:
            return _ext.uninitialized(self.rows, width, dtype)
        return mx.zeros((self.rows, width), dtype=getattr(mx, dtype))

    @property
    def block_bytes(self) -> int:
        """Bytes of one block, every layer."""
        return self.spec.bytes_per_token(self.quant) * BLOCK_TOKENS

    def sliding_block_bytes(self) -> int:
        """Bytes of one block in the sliding-window layers only."""
        per_layer = self.block_bytes // self.spec.num_layers
        return per_layer * sum(self._sliding)

    # -- the forward pass ------------------------------------------------------------------

    def write(self, layer: int, parts: tuple[mx.array, ...], rows: mx.array) -> None:
        """Scatter new token rows (``parts``: each stored component, [B, heads, L, width],
        keys' first) into ``rows`` (ordered batch, head, token)."""
        for target, part in zip(self.arrays[layer], parts):
            target[rows] = part.reshape(-1, part.shape[-1])

    def keys(self, layer: int) -> tuple[mx.array, ...]:
        return tuple(self.arrays[layer][: self.key_parts])

    def values(self, layer: int) -> tuple[mx.array, ...]:
        return tuple(self.arrays[layer][self.key_parts :])

    def write_rows(self, tables: list[list[int]], starts: list[int], count: int) -> np.ndarray:
        """Rows of ``count`` new tokens after ``starts[b]`` of each table, ordered (b, h, t)."""
        out = np.empty((len(tables), self.heads, count), dtype=np.int32)
        t = np.arange(count)
        heads = np.arange(self.heads)[:, None]
        for b, (table, start) in enumerate(zip(tables, starts)):
            pos = start + t
            blocks = np.asarray(table, dtype=np.int64)[pos // BLOCK_TOKENS]
            out[b] = (blocks[None, :] * self.heads + heads) * BLOCK_TOKENS + pos % BLOCK_TOKENS
        return out.reshape(-1)

    def settle(self) -> None:
        """Evaluate every arena (after a step) and count any write that was not in place."""
        flat = [a for layer in self.arrays for a in layer]
        mx.eval(flat)
        if self._addresses is not None:
            now = self._data_addresses()
            self.copies += sum(a != b for a, b in zip(now, self._addresses))
            self._addresses = now

    def _data_addresses(self) -> list[int]:
        return [_ext.data_address(a) for layer in self.arrays for a in layer]

    # -- block I/O between steps -------------------------------------------------------------

    def _flat(self) -> list[mx.array]:
        return [a for layer in self.arrays for a in layer]

    def read_regions(self, files, regions) -> None:
        """Copy stored block regions into their slots (verifying each; CacheFormatError)."""
        _ext.read_regions(self._flat(), *self._layout, self.capacity, files, regions, IO_THREADS)

    def pack(self, slots: list[int], tokens: list[int]):
        """The blocks as checksummed regions: (bytes, [(0, offset, length, crc, tokens)])."""
        return _ext.pack_regions(self._flat(), *self._layout, self.capacity, slots, tokens, 2)

    def copy_rows(self, src: int, dst: int, tokens: int) -> None:
        _ext.copy_slot_rows(self._flat(), *self._layout, self.capacity, src, dst, tokens)

    def copy_window_rows(self, src: int, dst: int) -> None:
        """Copy a block's rows in the sliding-window layers into another block (whose rows
        there were handed back), in place."""
        sliding = [a for layer, s in zip(self.arrays, self._sliding) if s for a in layer]
        if self._addresses is None or not sliding:
            return
        _, block_tokens, components = self._layout
        layers = sum(self._sliding)
        _ext.copy_slot_rows(
            sliding, layers, block_tokens, components, self.capacity, src, dst, BLOCK_TOKENS
        )

    def release(self, block: int) -> None:
        """Hand a free block's pages back (CPU)."""
        self._release(block, [1] * self.spec.num_layers)

    def release_window(self, block: int) -> None:
        """Hand back a block's rows in the sliding-window layers only."""
        self._release(block, [int(s) for s in self._sliding])

    def _release(self, block: int, layers: list[int]) -> None:
        if self._addresses is None or not any(layers):
            return
        self.released_bytes += _ext.release_slot(
            self._flat(), *self._layout, self.capacity, block, layers
        )
