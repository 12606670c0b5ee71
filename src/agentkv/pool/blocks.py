"""BlockPool: the records of a fixed number of KV blocks — who holds each, what it holds.

Pure bookkeeping (no MLX, no memory): ``pool.arena`` holds the bytes, block ``i`` of the
records is slot ``i`` of every arena. A block is in exactly one state::

    free ──allocate──► in use (refs > 0) ──release──► cached (complete + indexed, refs 0)
     ▲                     │   ▲                            │
     └──── release (unindexed) │   └──────── acquire ───────┘
     └──────────────────────── evict (least recently used) ◄┘

Invariants (``check()`` asserts them; the property tests run it after every operation):

* free, cached and in-use blocks partition ``range(capacity)``; ``refs > 0`` exactly for
  in-use blocks; a free block has no tokens, parent or hash.
* ``refs`` equals the number of block-table entries naming the block (tables call
  ``acquire``/``release``; the tests count).
* an indexed block (``hash`` set) holds exactly ``BLOCK_TOKENS`` tokens, its ``hash`` is
  ``block_hash(parent, tokens)`` and ``by_hash[hash]`` is that block; it is never written
  again (writers copy first: ``writable``). Cached blocks are exactly the indexed ones with
  ``refs == 0``.
* ``children[p]`` holds exactly the non-free blocks whose parent is ``p`` (complete or still
  filling), so partial matches can be found at 64-token resolution.
* reservations never exceed what could be handed out: ``reserved <= free + cached``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum

from ..errors import AgentKVError
from ..format.geometry import BLOCK_TOKENS
from .hashing import block_hash


class PoolExhaustedError(AgentKVError):
    """No free or cached block is left (the caller should reclaim agents or wait)."""


class Reservation:
    """Blocks promised to one turn: it draws on them as it grows, and gives back the rest."""

    def __init__(self, pool: BlockPool, blocks: int):
        pool.reserve(blocks)
        self.pool = pool
        self.left = blocks

    def take(self) -> bool:
        """Use one reserved block (False once the reservation is spent)."""
        if self.left == 0:
            return False
        self.left -= 1
        return True

    def refill(self, blocks: int) -> None:
        """Promise the turn ``blocks`` more (blocks it just gave back: KVSwap's evictions,
        so a prefill into block files draws on a reservation of its budget's size)."""
        self.pool.reserve(blocks)
        self.left += blocks

    def close(self) -> None:
        self.pool.unreserve(self.left)
        self.left = 0


class BlockState(str, Enum):
    FREE = "free"
    CACHED = "cached"
    IN_USE = "in use"


@dataclass(slots=True)
class BlockRecord:
    """One block's bookkeeping (its bytes live in the arenas, slot ``id``)."""

    id: int
    refs: int = 0
    tokens: list[int] = field(default_factory=list)
    parent: bytes | None = None  # hash of the blocks before it (None: not findable)
    hash: bytes | None = None  # set once complete and indexed
    last_use: int = 0
    window_holders: int = 0  # tables whose sliding window still reaches this block
    window_rows: bool = False  # whether the sliding layers' rows of it hold data

    @property
    def full(self) -> bool:
        return len(self.tokens) == BLOCK_TOKENS


class BlockPool:
    """Records, free list, LRU of cached blocks, the hash index and reservations."""

    def __init__(
        self,
        capacity: int,
        *,
        on_free: Callable[[int], None] | None = None,
        on_window_free: Callable[[int], None] | None = None,
        on_window_restore: Callable[[int, int], None] | None = None,
        keep_committed: int = 0,
    ):
        if capacity < 1:
            raise ValueError("a pool needs at least one block")
        self.capacity = capacity
        self.records = [BlockRecord(i) for i in range(capacity)]
        self._free: list[int] = list(range(capacity - 1, -1, -1))  # a stack: block 0 first
        self._cached: OrderedDict[int, None] = OrderedDict()  # least recently used first
        # Free blocks whose pages are still committed, most recently freed last: the newest
        # ``keep_committed`` are kept for reuse (the free list is a stack, so they are taken
        # first), older ones are handed to ``on_free`` (their pages go back to the OS).
        self._committed_free: OrderedDict[int, None] = OrderedDict()
        self.keep_committed = keep_committed
        self.by_hash: dict[bytes, int] = {}
        self.children: dict[bytes, set[int]] = {}
        self.reserved = 0
        self._tick = 0
        self._on_free = on_free or (lambda block: None)
        self._on_window_free = on_window_free or (lambda block: None)
        self._on_window_restore = on_window_restore or (lambda src, dst: None)
        self.evictions = 0  # cached blocks given up to make room (stat)

    # -- counts -------------------------------------------------------------------------

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def cached_count(self) -> int:
        return len(self._cached)

    @property
    def in_use_count(self) -> int:
        return self.capacity - self.free_count - self.cached_count

    def available(self) -> int:
        """Blocks that could be handed out now beyond the reservations."""
        return self.free_count + self.cached_count - self.reserved

    def state(self, block: int) -> BlockState:
        record = self.records[block]
        if record.refs:
            return BlockState.IN_USE
        return BlockState.CACHED if block in self._cached else BlockState.FREE

    def shared_count(self) -> int:
        """In-use blocks held by more than one table."""
        return sum(1 for r in self.records if r.refs > 1)

    # -- reservations ------------------------------------------------------------------

    def reserve(self, blocks: int) -> None:
        """Promise ``blocks`` future allocations to a turn (PoolExhaustedError if they do
        not fit)."""
        if blocks < 0:
            raise ValueError("cannot reserve a negative number of blocks")
        if blocks > self.available():
            raise PoolExhaustedError(
                f"{blocks} blocks asked for, {self.available()} available "
                f"({self.free_count} free + {self.cached_count} cached - {self.reserved} reserved)"
            )
        self.reserved += blocks

    def unreserve(self, blocks: int) -> None:
        if not 0 <= blocks <= self.reserved:
            raise ValueError(f"cannot return {blocks} of {self.reserved} reserved blocks")
        self.reserved -= blocks

    # -- allocation ------------------------------------------------------------------------

    def allocate(self, *, reserved: bool = False) -> int:
        """A block for new tokens, ``refs == 1``: a free one, else the least recently used
        cached one (unindexed first). ``reserved``: it draws on a reservation."""
        if reserved:
            self.unreserve(1)
        elif self.available() < 1:
            raise PoolExhaustedError(
                f"no block left ({self.capacity} blocks: {self.in_use_count} in use, "
                f"{self.reserved} reserved)"
            )
        if self._free:
            block = self._free.pop()
            self._committed_free.pop(block, None)
        else:  # its pages are about to be written again: no need to hand them back
            block, _ = self._cached.popitem(last=False)
            self._forget(self.records[block])
            self.evictions += 1
        record = self.records[block]
        record.refs = 1
        record.window_rows = True
        self._touch(record)
        return block

    def acquire(self, block: int) -> None:
        """One more table holds ``block`` (a cached block comes back into use)."""
        record = self.records[block]
        if record.refs == 0:
            if block not in self._cached:
                raise ValueError(f"block {block} is free: it holds nothing to share")
            del self._cached[block]
        record.refs += 1
        self._touch(record)

    def release(self, block: int, *, keep: bool = True) -> bool:
        """One table fewer holds ``block``; at zero it is cached (if indexed) or freed.
        ``keep=False`` (KVSwap's evictions: the block's bytes are in its block file): at
        zero it is freed whatever it holds, its pages handed back at once. Returns whether
        the block went free."""
        record = self.records[block]
        if record.refs < 1:
            raise ValueError(f"block {block} is not held")
        record.refs -= 1
        self._touch(record)
        if record.refs:
            return False
        if record.hash is not None and keep:
            self._cached[block] = None
            return False
        self._forget(record)
        self._free.append(block)
        if not keep:
            self._on_free(block)
            return True
        self._committed_free[block] = None
        while len(self._committed_free) > self.keep_committed:
            oldest, _ = self._committed_free.popitem(last=False)
            self._on_free(oldest)
        return True

    def release_all(self, blocks: Iterable[int]) -> None:
        for block in reversed(list(blocks)):  # tails first, so they are evicted first
            self.release(block)

    def drop_cached(self) -> int:
        """Free every cached block (their pages go back); returns how many."""
        dropped = 0
        while self._cached:
            block, _ = self._cached.popitem(last=False)
            self._forget(self.records[block])
            self._free.append(block)
            self._on_free(block)
            dropped += 1
        return dropped

    # -- contents ------------------------------------------------------------------------

    def writable(self, block: int) -> bool:
        """Whether new tokens may be written into ``block`` by the one table holding it."""
        record = self.records[block]
        return record.refs == 1 and record.hash is None and not record.full

    def set_parent(self, block: int, parent: bytes | None) -> None:
        """Name what precedes ``block`` (None: not findable by other agents)."""
        record = self.records[block]
        if record.hash is not None:
            raise ValueError(f"block {block} is indexed; its parent is fixed")
        self._unlink(record)
        record.parent = parent
        if parent is not None:
            self.children.setdefault(parent, set()).add(block)

    def append_tokens(self, block: int, ids: Iterable[int]) -> None:
        """Record tokens just written into ``block`` (which must be writable)."""
        if not self.writable(block):
            raise ValueError(f"block {block} is shared or sealed: copy it before writing")
        record = self.records[block]
        record.tokens.extend(int(i) for i in ids)
        if len(record.tokens) > BLOCK_TOKENS:
            raise ValueError(f"block {block} would hold more than {BLOCK_TOKENS} tokens")

    def truncate(self, block: int, keep: int) -> None:
        """Forget all but the first ``keep`` tokens of a private, unsealed block."""
        record = self.records[block]
        if record.refs != 1 or record.hash is not None:
            raise ValueError(f"block {block} is shared or sealed: it cannot shrink")
        del record.tokens[keep:]

    def seal(self, block: int) -> int:
        """Index a complete block under its chain hash; returns the block that holds it.

        If another block already holds the same tokens after the same parent, that one
        is returned (acquired) and ``block`` released: the caller swaps its table entry.
        A block without a parent (not findable) is returned as it is.
        """
        record = self.records[block]
        if not record.full:
            raise ValueError(f"block {block} holds {len(record.tokens)} tokens, not a full block")
        if record.hash is not None or record.parent is None:
            return block
        digest = block_hash(record.parent, record.tokens)
        twin = self.by_hash.get(digest)
        if twin is not None:
            if record.window_rows and not self.records[twin].window_rows:
                # The kept copy handed its sliding-window rows back; this one has them (the
                # same tokens after the same prefix): they go back into it before it serves.
                self._on_window_restore(block, twin)
                self.records[twin].window_rows = True
            self.acquire(twin)
            self.release(block)
            return twin
        record.hash = digest
        self.by_hash[digest] = block
        return block

    def lookup(self, digest: bytes) -> int | None:
        return self.by_hash.get(digest)

    def candidates(self, parent: bytes) -> list[int]:
        """Blocks (complete or filling) that follow ``parent``."""
        return sorted(self.children.get(parent, ()))

    # -- sliding windows -------------------------------------------------------------------

    def hold_window(self, block: int) -> None:
        self.records[block].window_holders += 1

    def drop_window(self, block: int) -> None:
        record = self.records[block]
        if record.window_holders < 1:
            raise ValueError(f"block {block} has no window holder")
        record.window_holders -= 1
        if record.window_holders == 0 and record.window_rows:
            record.window_rows = False
            self._on_window_free(block)

    # -- internals -----------------------------------------------------------------------

    def _touch(self, record: BlockRecord) -> None:
        self._tick += 1
        record.last_use = self._tick

    def _unlink(self, record: BlockRecord) -> None:
        if record.parent is not None:
            siblings = self.children.get(record.parent)
            if siblings is not None:
                siblings.discard(record.id)
                if not siblings:
                    del self.children[record.parent]

    def _forget(self, record: BlockRecord) -> None:
        """Back to an empty record (its block is about to be free or reused)."""
        self._unlink(record)
        if record.hash is not None:
            del self.by_hash[record.hash]
        record.hash = None
        record.parent = None
        record.tokens = []
        record.window_holders = 0
        record.window_rows = False

    def check(self) -> None:
        """Assert every invariant of the class docstring (for tests; O(capacity))."""
        free, cached = set(self._free), set(self._cached)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert not free & cached, "a block is both free and cached"
        for r in self.records:
            in_use = r.refs > 0
            assert in_use + (r.id in free) + (r.id in cached) == 1, f"block {r.id}: no one state"
            if r.id in free:
                assert not r.tokens and r.parent is None and r.hash is None, f"free {r.id} dirty"
            if r.hash is not None:
                assert r.full and r.parent is not None, f"indexed block {r.id} incomplete"
                assert block_hash(r.parent, r.tokens) == r.hash, f"block {r.id}: wrong hash"
                assert self.by_hash.get(r.hash) == r.id, f"block {r.id} missing from the index"
            if r.id in cached:
                assert r.hash is not None, f"cached block {r.id} is not indexed"
            if r.parent is not None:
                assert r.id in self.children.get(r.parent, ()), f"block {r.id} not a child"
            assert len(r.tokens) <= BLOCK_TOKENS
        assert len(self.by_hash) == sum(1 for r in self.records if r.hash is not None)
        for parent, kids in self.children.items():
            for kid in kids:
                assert self.records[kid].parent == parent, f"block {kid} under a wrong parent"
        assert 0 <= self.reserved <= len(free) + len(cached), "reservations exceed the pool"
