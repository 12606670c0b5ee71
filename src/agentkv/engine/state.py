"""AgentState: one agent's hot state — its caches and the text they encode.

Invariant: ``caches`` hold exactly ``len(tokens)`` tokens, token ``i`` covers
bytes ``spans[i]`` of ``text``, and ``text`` is exactly what those tokens cover.
``durable`` leading tokens are identical to what is on disk (or queued to be).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..kv.cache import STEP, AgentKVCache, window_start
from ..kv.quant import KVQuant


@dataclass
class AgentState:
    agent_id: str
    quant: KVQuant
    caches: list[AgentKVCache]
    tokens: list[int] = field(default_factory=list)
    spans: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), dtype=np.int64))
    text: bytes = b""
    durable: int = 0
    messages: list | None = None
    last_used: float = field(default_factory=time.monotonic)

    @classmethod
    def empty(cls, agent_id: str, quant: KVQuant, layers) -> AgentState:
        caches = [AgentKVCache(quant, window=layer.window) for layer in layers]
        return cls(agent_id, quant, caches)

    @property
    def size(self) -> int:
        return len(self.tokens)

    @property
    def token_ends(self) -> np.ndarray:
        return self.spans[:, 1]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches)

    def trim(self, keep: int) -> None:
        """Forget every token after the first ``keep``."""
        drop = self.size - keep
        if drop > 0:
            for cache in self.caches:
                cache.trim(drop)
            self.tokens = self.tokens[:keep]
            self.spans = self.spans[:keep]
            self.text = self.text[: int(self.spans[-1, 1]) if keep else 0]
        self.durable = min(self.durable, keep)

    def cap_windows(self) -> None:
        """Free sliding-window rows no future token can see (never rows not yet on disk)."""
        durable_from = self.durable // STEP * STEP
        for cache in self.caches:
            if cache.window is not None:
                cache.drop_before(min(window_start(self.size, cache.window), durable_from))

    def append(self, ids: list[int], spans: np.ndarray, text: bytes) -> None:
        """Record tokens just fed into the caches and the text they cover."""
        self.tokens.extend(ids)
        self.spans = np.concatenate([self.spans, spans.astype(np.int64)])
        self.text = self.text + text
