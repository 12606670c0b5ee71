"""BlockTable: one agent's KV cache as a list of pool blocks and a length.

::

    blocks  [ 17 | 4 | 230 | 9 ]      length 812: blocks 17, 4, 230 full, 9 holds 44 tokens
              shared    private tail

Appending fills the tail block, then takes fresh blocks: nothing already written moves.
A tail held by another table (after ``fork``) or sealed is copied first (copy on write:
at most one block). A block that fills up is sealed: indexed under its chain hash so
other agents can share it; if the pool already had it, the table switches to that copy.

Invariants: ``len(blocks) == blocks_for(length)`` (between ``grow`` and ``written`` it
may hold the blocks for the tokens being written too); block ``i`` holds tokens
``[256 i, 256 (i + 1))`` of the agent, so every block but the last is full; the table
holds one reference on each of its blocks (``refs`` counts tables); on a model with
sliding-window layers it also holds a window reference on ``blocks[window_from:]``.
Per-channel keys (KV format 2): from its first ``grow`` until ``release`` the table owns a
tail slot of the arena (``tail``), holding the keys of its channel group still filling:
tokens ``[length // ct * ct, length)``, and the float16 keys of its last complete group
(``prev_group``); ``fork`` copies them. A ``trim`` back into that group refills the tail
from them, exactly; a trim into an earlier complete group cannot keep exact keys (only its
quantized ones are left), so it is refused: ``exact_keep`` says how far to cut instead,
and the caller feeds the rest of that group again. So the bytes a table holds are always
those its tokens give (docs/kv-format-v2.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..format.geometry import BLOCK_TOKENS, blocks_for
from .blocks import BlockPool, PoolExhaustedError, Reservation

CopyRows = Callable[[int, int, int], None]  # (src block, dst block, tokens)


def exact_keep(keep: int, length: int, ct: int, prev_group: int | None) -> int:
    """How many of a table's first ``keep`` tokens (of ``length``; channel groups of ``ct``
    tokens, 0: none) a trim keeps with their exact keys: ``keep``, unless it cuts into a
    complete group other than the one whose float16 keys are held (``prev_group``, its first
    token): then that group's start, the rest to be fed again."""
    if not ct or keep >= length // ct * ct:
        return keep
    first = keep // ct * ct
    return keep if keep == first or prev_group == first else first


class BlockTable:
    def __init__(
        self,
        pool: BlockPool,
        seed: bytes,
        *,
        window: int | None = None,
        tails=None,
        nonce: str | None = None,
    ):
        self.pool = pool
        self.seed = seed
        self.nonce = nonce  # a private seed's (pool.hashing.private_seed): its bytes its own
        self.window = window
        self.tails = tails  # the arena, for per-channel keys (None: no tails)
        self.tail: int | None = None
        self.prev_group: int | None = None  # first token of the group in the slot's prevs
        self.blocks: list[int] = []
        self.length = 0
        self.window_from = 0
        # KVSwap: the chain hashes of the leading blocks it evicted (``blocks`` holds -1 for
        # them, pool/swap.py), so the blocks after them still chain to what precedes them
        self.evicted_hashes: list[bytes] = []

    # -- reading ------------------------------------------------------------------------

    def parent_of(self, index: int) -> bytes | None:
        """The chain hash before block ``index`` (None if a block before it is unsealed)."""
        if index == 0:
            return self.seed
        before = self.blocks[index - 1]
        if before < 0:  # evicted by KVSwap: its hash is kept
            return self.evicted_hashes[index - 1]
        return self.pool.records[before].hash

    def token_ids(self) -> list[int]:
        return [t for b in self.blocks for t in self.pool.records[b].tokens]

    def needs_copy(self) -> bool:
        """Whether the next append must copy the tail block first."""
        return (
            bool(self.blocks)
            and self.length % BLOCK_TOKENS != 0
            and not self.pool.writable(self.blocks[-1])
        )

    def exact_keep(self, keep: int) -> int:
        """``exact_keep`` for this table: the most of its first ``keep`` tokens ``trim``
        keeps with exact keys."""
        ct = self.tails.ct if self.tail is not None else 0
        return exact_keep(keep, self.length, ct, self.prev_group)

    def blocks_needed(self, tokens: int) -> int:
        """Blocks ``grow(tokens)`` would take from the pool."""
        return blocks_for(self.length + tokens) - len(self.blocks) + self.needs_copy()

    # -- growing ------------------------------------------------------------------------

    def take_tail(self) -> int | None:
        """The table's tail slot, taken on first need (per-channel keys only)."""
        if self.tails is not None and self.tail is None:
            self.tail = self.tails.take_tail()
        return self.tail

    def grow(
        self, tokens: int, copy_rows: CopyRows, reservation: Reservation | None = None
    ) -> None:
        """Make room for ``tokens`` more tokens (blocks taken, the tail copied if shared),
        drawing on ``reservation`` while it lasts. Raises PoolExhaustedError, with the
        table unchanged, if the pool cannot give them all."""
        need = self.blocks_needed(tokens)
        have = self.pool.available() + (reservation.left if reservation is not None else 0)
        if need > have:
            raise PoolExhaustedError(f"{need} blocks needed, {have} available")
        self.take_tail()
        if self.needs_copy():
            self._copy_tail(copy_rows, reservation)
        elif self.length % BLOCK_TOKENS:
            # A tail kept whole by a trim while it was shared may be this table's alone now,
            # still holding the other table's tokens past this one's: forget them first.
            tail, keep = self.blocks[-1], self.length % BLOCK_TOKENS
            if len(self.pool.records[tail].tokens) > keep:
                self.pool.truncate(tail, keep)
        while len(self.blocks) < blocks_for(self.length + tokens):
            block = self.pool.allocate(reserved=reservation is not None and reservation.take())
            self.pool.set_parent(block, self.parent_of(len(self.blocks)))
            self.blocks.append(block)
            if self.window is not None:
                self.pool.hold_window(block)

    def written(self, ids: Sequence[int]) -> None:
        """Record ``ids``, just written into the pool after ``length``; seal full blocks."""
        at = 0
        while at < len(ids):
            index = self.length // BLOCK_TOKENS
            block = self.blocks[index]
            take = min(len(ids) - at, BLOCK_TOKENS - self.length % BLOCK_TOKENS)
            self.pool.append_tokens(block, ids[at : at + take])
            self.length += take
            at += take
            if self.length % BLOCK_TOKENS == 0:
                self._seal(index)

    def _seal(self, index: int) -> None:
        block = self.blocks[index]
        if self.pool.records[block].parent is None:  # an unsealed block before it
            self.pool.set_parent(block, self.parent_of(index))
        kept = self.pool.seal(block)
        if kept != block:  # the pool already held these tokens: use that copy
            self.blocks[index] = kept
            if self.window is not None and index >= self.window_from:
                self.pool.hold_window(kept)  # the released block took its window ref along
        if index + 1 < len(self.blocks):
            self.pool.set_parent(self.blocks[index + 1], self.pool.records[kept].hash)

    def _copy_tail(self, copy_rows: CopyRows, reservation: Reservation | None) -> None:
        old = self.blocks[-1]
        keep = self.length % BLOCK_TOKENS
        fresh = self.pool.allocate(reserved=reservation is not None and reservation.take())
        copy_rows(old, fresh, keep)
        self.pool.set_parent(fresh, self.parent_of(len(self.blocks) - 1))
        self.pool.append_tokens(fresh, self.pool.records[old].tokens[:keep])
        self.blocks[-1] = fresh
        if self.window is not None and len(self.blocks) - 1 >= self.window_from:
            self.pool.hold_window(fresh)
            self.pool.drop_window(old)
        self.pool.release(old)

    # -- sharing ------------------------------------------------------------------------

    def adopt(self, block: int) -> None:
        """Append a complete, sealed block of the pool (a shared prefix) to a table whose
        length is a multiple of the block size."""
        record = self.pool.records[block]
        if self.length % BLOCK_TOKENS or record.hash is None:
            raise ValueError("only sealed blocks can be adopted, after full blocks")
        if record.parent != self.parent_of(len(self.blocks)):
            raise ValueError("the block does not follow this table's blocks")
        self.pool.acquire(block)
        self.blocks.append(block)
        self.length += BLOCK_TOKENS
        if self.window is not None:
            self.pool.hold_window(block)

    def attach(self, block: int, ids: Sequence[int]) -> None:
        """Append a block just allocated for ``ids`` (about to be read from disk; sealed by
        ``seal_full`` once its bytes are in)."""
        if self.length % BLOCK_TOKENS:
            raise ValueError("blocks attach after full blocks only")
        self.pool.set_parent(block, self.parent_of(len(self.blocks)))
        self.pool.append_tokens(block, ids)
        self.blocks.append(block)
        self.length += len(ids)
        if self.window is not None:
            self.pool.hold_window(block)

    def seal_full(self) -> None:
        """Seal every full block not sealed yet (after their bytes were read)."""
        for index, block in enumerate(self.blocks):
            record = self.pool.records[block]
            if record.hash is None and record.full:
                self._seal(index)

    def fork(self) -> BlockTable:
        """A second table over the same blocks (refcounts only; the tail is copied when
        either appends)."""
        twin = BlockTable(
            self.pool, self.seed, window=self.window, tails=self.tails, nonce=self.nonce
        )
        if self.tail is not None:
            twin.tail = self.tails.take_tail()
            prev = self.prev_group is not None
            self.tails.copy_tail(self.tail, twin.tail, self.length % self.tails.ct, prev=prev)
            twin.prev_group = self.prev_group
        twin.blocks = list(self.blocks)
        twin.length = self.length
        twin.window_from = self.window_from
        for i, block in enumerate(self.blocks):
            self.pool.acquire(block)
            if self.window is not None and i >= self.window_from:
                self.pool.hold_window(block)
        return twin

    # -- shrinking ----------------------------------------------------------------------

    def trim(self, keep: int) -> None:
        """Forget every token after the first ``keep`` (which ``exact_keep`` must allow)."""
        if not 0 <= keep <= self.length:
            raise ValueError(f"cannot keep {keep} of {self.length} tokens")
        if self.exact_keep(keep) != keep:
            raise ValueError(
                f"keeping {keep} tokens cuts into a complete channel group whose exact keys "
                f"are gone; keep {self.exact_keep(keep)} and feed the rest again"
            )
        if self.tail is not None and keep < self.length // self.tails.ct * self.tails.ct:
            # Cut inside the last complete channel group: its kept keys go back to the tail
            # from their float16 copy, as they were before the group completed.
            self.tails.refill_tail(self.tail, keep, self.prev_group)
            self.prev_group = None  # the group before it was never kept in float16
        count = blocks_for(keep)
        for index in range(len(self.blocks) - 1, count - 1, -1):
            self._drop(index)
        del self.blocks[count:]
        self.window_from = min(self.window_from, count)
        self.length = keep
        tail = keep % BLOCK_TOKENS
        if tail and self.pool.writable(self.blocks[-1]):
            self.pool.truncate(self.blocks[-1], tail)
        # A shared or sealed tail keeps its tokens: the next append copies what is kept.

    def rehold_window(self, first: int) -> bool:
        """Take window references again from block ``first`` on (after a trim moved the
        window back); False if a block's sliding rows are gone (reload it instead)."""
        first = max(0, min(first, len(self.blocks)))
        if first >= self.window_from:
            return True
        blocks = self.blocks[first : self.window_from]
        if not all(self.pool.records[b].window_rows for b in blocks):
            return False
        for block in blocks:
            self.pool.hold_window(block)
        self.window_from = first
        return True

    def release_window(self, upto: int) -> None:
        """Give up the sliding layers' rows of blocks before ``upto`` (their window passed)."""
        upto = min(upto, len(self.blocks))
        for index in range(self.window_from, upto):
            self.pool.drop_window(self.blocks[index])
        self.window_from = max(self.window_from, upto)

    def release(self) -> None:
        """Give every block back (the table is empty afterwards)."""
        for index in range(len(self.blocks) - 1, -1, -1):
            self._drop(index)
        self.blocks = []
        self.length = 0
        self.window_from = 0
        if self.tail is not None:
            self.tails.give_tail(self.tail)
            self.tail = None
            self.prev_group = None

    def _drop(self, index: int) -> None:
        block = self.blocks[index]
        if self.window is not None and index >= self.window_from:
            self.pool.drop_window(block)
        self.pool.release(block)
