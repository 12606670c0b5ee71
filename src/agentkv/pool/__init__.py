"""The block pool: every agent's in-memory KV in fixed 256-token blocks under one budget.

``KVPool`` ties the records (``blocks.BlockPool``), the bytes (``arena.KVArena``) and the
chain seeds together for one loaded model. See docs/pool.md for the whole picture.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import mlx.core as mx

from ..errors import InvalidRequestError
from ..format.geometry import BLOCK_TOKENS
from ..format.quant import KVQuant
from ..format.spec import LayerKind, ModelCacheSpec
from ..kernels import gpu
from .arena import KVArena
from .blocks import BlockPool, BlockRecord, BlockState, PoolExhaustedError, Reservation
from .hashing import bits_identity, chain_seed, private_seed
from .tables import BlockTable

__all__ = [
    "BlockPool",
    "BlockRecord",
    "BlockState",
    "BlockTable",
    "KVPool",
    "PoolExhaustedError",
    "PoolStats",
    "Reservation",
    "default_pool_bytes",
]

MIN_DEFAULT_BYTES = 256 << 20
MAX_DEFAULT_BYTES = 16 << 30
# Freed blocks whose pages stay committed for reuse (like an allocator's cache): beyond this,
# a freed block's pages go back to the OS. Reusing committed pages spares the page faults.
RELEASE_SLACK_BYTES = 64 << 20


def default_pool_bytes() -> int:
    """A quarter of the machine's memory, between 256 MiB and 16 GiB (pages are committed
    only as blocks fill, so an unused budget costs nothing)."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        total = 4 << 30  # unknown: assume a 4 GiB machine
    return max(MIN_DEFAULT_BYTES, min(MAX_DEFAULT_BYTES, total // 4))


def device_backend() -> str:
    """The backend the default device computes on: "cpu", "metal" or "cuda"."""
    if mx.default_device() == mx.cpu:
        return "cpu"
    return "metal" if gpu.metal_available() else "cuda"


@dataclass(frozen=True)
class PoolStats:
    """What ``Engine.pool_stats()`` reports."""

    capacity_blocks: int
    used_blocks: int  # held by at least one agent
    shared_blocks: int  # held by more than one agent
    cached_blocks: int  # held by none, kept findable by hash (reclaimed first)
    free_blocks: int
    reserved_blocks: int  # promised to running turns
    block_bytes: int  # one block, every layer
    block_tokens: int
    budget_bytes: int
    resident_bytes: int  # blocks in use or cached, each counted once
    evictions: int  # cached blocks reused for new ones
    arena_copies: int  # arena writes that were not in place (should stay 0)
    # KVSwap: blocks of swapped agents held only in their block files (their pages went back
    # to the system when they were evicted), and their bytes
    swapped_blocks: int = 0
    swapped_bytes: int = 0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class KVPool:
    def __init__(
        self,
        spec: ModelCacheSpec,
        quant: KVQuant,
        *,
        pool_bytes: int,
        release_slack_bytes: int = RELEASE_SLACK_BYTES,
    ):
        self.spec = spec
        self.quant = quant
        self.block_bytes = spec.bytes_per_token(quant) * BLOCK_TOKENS
        capacity = pool_bytes // self.block_bytes
        if capacity < 2:
            raise InvalidRequestError(
                f"a pool of {pool_bytes} bytes holds {capacity} blocks of {self.block_bytes} "
                f"bytes ({BLOCK_TOKENS} tokens of this model); give it at least 2"
            )
        self.budget_bytes = pool_bytes
        self.arena = KVArena(spec, quant, capacity)
        self.blocks = BlockPool(
            capacity,
            on_free=self.arena.release,
            on_window_free=self.arena.release_window,
            on_window_restore=self.arena.copy_window_rows,
            keep_committed=release_slack_bytes // self.block_bytes,
        )
        windows = [layer.window for layer in spec.layers if layer.kind is LayerKind.SLIDING]
        self.window = max(windows) if windows else None
        self.bits = bits_identity(device_backend())  # what computes the bytes its blocks hold
        self.swapped_blocks = 0  # KVSwap's evicted blocks, out of memory (pool/swap.py)

    @property
    def capacity(self) -> int:
        return self.blocks.capacity

    def seed(self, salt: str | None = None) -> bytes:
        """The chain seed of agents under ``salt`` whose bytes this pool computes."""
        return chain_seed(self.spec.fingerprint, self.quant.identity, salt, self.bits)

    def private_seed(self, salt: str | None, nonce: str) -> bytes:
        """The chain seed of an agent whose bytes are its own (``pool.hashing``)."""
        return private_seed(self.seed(salt), nonce)

    def new_table(self, seed: bytes, *, nonce: str | None = None) -> BlockTable:
        """An empty table under ``seed`` (``nonce``: the one of a ``private_seed``)."""
        tails = self.arena if self.arena.ct else None
        return BlockTable(self.blocks, seed, window=self.window, tails=tails, nonce=nonce)

    def reserve(self, blocks: int) -> Reservation:
        return Reservation(self.blocks, blocks)

    def resident_bytes(self) -> int:
        """Bytes of blocks that hold data (in use or cached), each block counted once; the
        sliding layers' rows of blocks past every window are not counted."""
        held = self.blocks.in_use_count + self.blocks.cached_count
        dropped = sum(
            1 for r in self.blocks.records if (r.refs or r.hash is not None) and not r.window_rows
        )
        return held * self.block_bytes - dropped * self.arena.sliding_block_bytes()

    def stats(self) -> PoolStats:
        b = self.blocks
        return PoolStats(
            capacity_blocks=b.capacity,
            used_blocks=b.in_use_count,
            shared_blocks=b.shared_count(),
            cached_blocks=b.cached_count,
            free_blocks=b.free_count,
            reserved_blocks=b.reserved,
            block_bytes=self.block_bytes,
            block_tokens=BLOCK_TOKENS,
            budget_bytes=self.budget_bytes,
            resident_bytes=self.resident_bytes(),
            evictions=b.evictions,
            arena_copies=self.arena.copies,
            swapped_blocks=self.swapped_blocks,
            swapped_bytes=self.swapped_blocks * self.block_bytes,
        )
