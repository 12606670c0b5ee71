"""CacheBase: what every agentkv cache is, for mlx-lm's model code and agentkv's attention.

mlx-lm's models drive a cache through ``offset``, ``update_and_fetch`` and ``make_mask``;
``mlx_adapter.install_attention_dispatch`` then hands attention to the cache's
``agentkv_attention`` (different bits for keys and values, sinks, the fused kernels). Three
caches speak it:

* ``AgentKVCache`` — one agent's layer, contiguous (the mlx-lm drop-in; prompt-cache files);
* ``BatchQuantizedKVCache`` — several of those as one left-padded batch (mlx-lm's
  ``BatchGenerator``);
* ``PagedLayerCache`` — one layer of a forward pass over the block pool (the engine).
"""

from __future__ import annotations

from typing import ClassVar

import mlx.core as mx

from .quant import KVQuant


class CacheBase:
    quant: KVQuant
    window: int | None = None
    trimmable: ClassVar[bool] = True

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Store new keys and values [B, kv_heads, L, dim]; what attention will read."""
        raise NotImplementedError

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        raise NotImplementedError

    def agentkv_attention(self, queries, keys, values, *, scale, mask, sinks=None) -> mx.array:
        """Attention of ``queries`` over this cache (called by mlx-lm's model code through
        the dispatch ``mlx_adapter`` installs)."""
        raise NotImplementedError

    def is_trimmable(self) -> bool:
        return self.trimmable
