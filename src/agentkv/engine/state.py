"""AgentState: one agent in memory — its block table in the pool and the text it encodes.

Invariant: ``table`` holds exactly ``len(tokens)`` tokens, token ``i`` covers bytes
``spans[i]`` of ``text``, and ``text`` is exactly what those tokens cover. ``durable``
leading tokens are identical to what is on disk (or queued to be), and ``saved_blocks``
are the chain hashes of the leading blocks the agent's manifest names once its queued
saves land (None for a private, partial block): a save keeps the leading blocks whose
hashes still match and writes the rest. While the agent decodes under a KVSwap budget,
``swap`` holds its evicted leading blocks (``table.blocks`` is -1 there; pool/swap.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..format.geometry import BLOCK_TOKENS
from ..format.quant import KVQuant
from ..pool import BlockTable
from ..pool.swap import SwapState


@dataclass
class AgentState:
    agent_id: str
    quant: KVQuant
    table: BlockTable
    tokens: list[int] = field(default_factory=list)
    spans: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), dtype=np.int64))
    text: bytes = b""
    durable: int = 0
    saved_blocks: list[bytes | None] = field(default_factory=list)
    messages: list | None = None
    last_used: float = field(default_factory=time.monotonic)
    swap: SwapState | None = None
    # While swapped: the block files' lock, held until the save naming its new block files
    # is written (``SharedBlocks.hold``; the save's job takes it over).
    swap_hold: object | None = None

    @property
    def size(self) -> int:
        return len(self.tokens)

    @property
    def token_ends(self) -> np.ndarray:
        return self.spans[:, 1]

    @property
    def blocks(self) -> int:
        return len(self.table.blocks)

    def trim(self, keep: int) -> None:
        """Forget every token after the first ``keep`` (which ``BlockTable.exact_keep``
        must allow)."""
        if self.size > keep:
            self.table.trim(keep)
            self.tokens = self.tokens[:keep]
            self.spans = self.spans[:keep]
            self.text = self.text[: int(self.spans[-1, 1]) if keep else 0]
        self.durable = min(self.durable, keep)
        del self.saved_blocks[keep // BLOCK_TOKENS :]

    def fit_table(self) -> None:
        """Cut the table back to the agent's tokens (it may hold more: the last sampled token
        of a turn, a cancelled reply), or to fewer where a cut inside a complete channel
        group would not keep exact keys (``BlockTable.exact_keep``): the agent's tokens then
        go with it, and its next turn feeds them again."""
        keep = self.table.exact_keep(min(self.size, self.table.length))
        self.table.trim(keep)
        self.trim(keep)

    def append(self, ids: list[int], spans: np.ndarray, text: bytes) -> None:
        """Record tokens already written into the table and the text they cover."""
        self.tokens.extend(ids)
        self.spans = np.concatenate([self.spans, spans.astype(np.int64)])
        self.text = self.text + text

    def block_hash(self, index: int) -> bytes | None:
        """The chain hash of the table's block ``index`` (an evicted one's too)."""
        block = self.table.blocks[index]
        if block < 0:
            return self.swap.records[index][0]
        return self.table.pool.records[block].hash

    def kept_blocks(self) -> int:
        """Leading blocks a save need not write again (their hashes are on disk already)."""
        keep = 0
        for index, saved in enumerate(self.saved_blocks[: len(self.table.blocks)]):
            if saved is None or self.block_hash(index) != saved:
                break
            keep += 1
        return keep

    def release(self) -> None:
        """Give the agent's blocks back to the pool (the state is unusable afterwards)."""
        hold, self.swap_hold = self.swap_hold, None
        if hold is not None:  # no save took it over (a failed turn): nothing names the files
            hold.close()
        if self.swap is not None:
            self.swap.release()  # the staging blocks, and the table
            self.swap = None
            return
        self.table.release()
