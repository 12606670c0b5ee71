"""KVSwap in the engine: an agent whose context is over the swap budget keeps only the
budget in memory, while it prefills and while it decodes (docs/kvswap.md).

A turn over the budget *streams* where the model's blocks run fused on the CPU (the
default): before each prefill step its complete blocks but the one the step writes into
are written as block files (where missing) and evicted (``pool/swap.py``; their pages go
back to the system at once), and the step's attention reads the evicted blocks back whole,
chunk by chunk, into two staging blocks: exact, the same bits as all in memory. A warm
resume reads its blocks one after another and evicts them the same way
(``engine/resume.py``). So such a turn takes a bounded number of pool blocks
(``bounded_blocks``), whatever its context. Where the blocks do not run fused, a turn
prefills in memory and ``start`` swaps it when its prefill is done (its context must fit
the pool).

While it decodes, ``keep_to_budget`` evicts each block it fills. ``check`` turns a failed
read into the turn's error (``TurnFailedError``: nothing of the turn is kept, the file at
fault is set aside). A swapped agent's turn ends by saving it (its evicted blocks named
by their files) and dropping it from memory.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ..errors import TurnFailedError
from ..format.geometry import BLOCK_TOKENS, blocks_for
from ..kernels.attention import ENV as ATTENTION_ENV
from ..pool import KVPool
from ..pool.step import fuses
from ..pool.swap import SwapState, plan_blocks
from .state import AgentState

log = logging.getLogger("agentkv.engine")

# A streamed prefill's attention reads a key chunk (512 tokens: two blocks) at a time into
# the staging blocks, so it needs two of them: a budget of at least 768 tokens.
STREAM_STAGING = 2
# The most blocks a model context has (the low-rank keys' file is sized for it).
DEFAULT_CAPACITY = 1 << 12


class Swapper:
    def __init__(
        self,
        *,
        pool: KVPool,
        store,
        loaded,
        budget: int | None,
        read_ahead: bool = False,
        prefill_chunk: int = 512,
    ):
        self.pool = pool
        self.store = store
        self.loaded = loaded
        self.budget = budget
        self.read_ahead = read_ahead
        self.prefill_chunk = prefill_chunk
        self._projections = None
        self.swapped = 0  # agents swapped since the engine started
        self.filled_evicted = 0  # blocks agents filled while decoding, evicted since
        self.staging = budget // BLOCK_TOKENS - 1 if budget is not None else 0
        limit = loaded.context_limit
        self.capacity = blocks_for(limit) + 1 if limit else DEFAULT_CAPACITY
        # Whether a turn over the budget prefills into its block files (module docstring).
        self.streams = (
            budget is not None
            and self.staging >= STREAM_STAGING
            and fuses(pool.arena)
            and os.environ.get(ATTENTION_ENV) != "reference"
            and any(getattr(m, "agentkv_fused", None) for _, m in loaded.model.named_modules())
        )

    def projections(self):
        """The model's low-rank key projections (measured once per model and KV format)."""
        if self._projections is None:
            from ..model.kvswap import DEFAULT_RANK, projections

            self._projections = projections(
                self.loaded.model,
                self.loaded.tokenizer,
                self.loaded.spec,
                self.pool.quant,
                DEFAULT_RANK,
                read_ahead=self.read_ahead,
            )
        return self._projections

    # -- a turn over the budget -----------------------------------------------------------

    def bounded_blocks(self, tokens: int) -> int | None:
        """The most pool blocks a turn of ``tokens`` (context and reply) holds at once when
        it streams: its staging blocks, a prefill chunk's blocks, the block it fills and a
        block read on a warm resume; None where it does not stream (it holds its context)."""
        if not self.streams or tokens <= self.budget:
            return None
        return self.staging + blocks_for(self.prefill_chunk) + 3

    def streaming(self, state: AgentState, count: int) -> bool:
        """Whether ``count`` more tokens of the agent's prefill stream (it is swapped, or
        they take its context over the budget)."""
        if not self.streams:
            return False
        return state.swap is not None or state.table.length + count > self.budget

    def evict_filled(self, state: AgentState, reservation) -> None:
        """Swap out the agent's complete blocks but its last (written as block files where
        missing), the first time with its staging blocks: before a prefill step that
        streams (the table grown for it), or as a warm resume reads its blocks. Raises
        what the block files' writes raise (the turn fails)."""
        if state.swap is not None:
            self._evict_next(state, reservation)
            return
        table = state.table
        evicted = table.length // BLOCK_TOKENS
        if table.length % BLOCK_TOKENS == 0 and evicted == len(table.blocks):
            evicted -= 1  # the last block stays (the one written next, or the last read)
        if evicted < 1:
            return
        self._swap(state, evicted, reservation)

    def _swap(self, state: AgentState, evicted: int, reservation) -> None:
        table = state.table
        projections = self.projections()
        shared = self.store.shared
        hold = state.swap_hold or shared.hold()  # until the save naming the files is written
        try:
            files = shared.ensure_pool_blocks(self.pool, table.blocks[:evicted])
            state.swap = SwapState.evict(
                self.pool,
                table,
                files,
                projections,
                query_heads=self.loaded.query_heads,
                staging=self.staging,
                reservation=reservation,
                keys_dir=self.store.model_dir,
                capacity=self.capacity,
            )
        except BaseException:
            if state.swap_hold is None:
                hold.close()
            raise
        state.swap_hold = hold
        self.swapped += 1

    def _evict_next(self, state: AgentState, reservation) -> int:
        swap, done = state.swap, 0
        while (block := swap.next_evictable()) is not None:
            # under the hold the swap took: no collection until the turn's save
            (file,) = self.store.shared.ensure_pool_blocks(self.pool, [block])
            swap.evict_next(file, reservation)
            done += 1
        return done

    # -- decoding -----------------------------------------------------------------------

    def start(self, state: AgentState, reservation=None) -> bool:
        """A turn's prefill is done: swap the agent's leading blocks out if its context is
        over the budget (it may be already: a streamed prefill); whether it is swapped.
        Where a turn that prefilled in memory cannot swap, nothing changes (logged): it
        decodes in memory."""
        if self.budget is None:
            return False
        if state.swap is not None:
            self.keep_to_budget(state, reservation)
            return True
        table = state.table
        plan = plan_blocks(table.length, self.budget)
        if plan is None:
            return False
        evicted, staging = plan
        records = self.pool.blocks.records
        blocks = table.blocks[:evicted]
        if any(records[b].hash is None or not records[b].full for b in blocks):
            return False  # an unsealed block (never for a table grown in order)
        if self.pool.blocks.available() + SwapState.frees(self.pool, table, evicted) < staging:
            return False
        try:
            self._swap(state, evicted, reservation)
        except (OSError, RuntimeError, ValueError) as exc:
            log.warning(
                "agentkv: agent %r decodes in memory: KVSwap failed: %s", state.agent_id, exc
            )
            return False
        return True

    def keep_to_budget(self, state: AgentState, reservation=None) -> None:
        """Evict the blocks a swapped agent filled while decoding (written as block files
        first), so a long reply keeps its resident KV at the budget; an agent whose reply
        takes it over the budget swaps then."""
        if state.swap is None:
            if self.budget is not None and state.table.length > self.budget:
                self.start(state, reservation)
            return
        try:
            self.filled_evicted += self._evict_next(state, reservation)
        except (OSError, RuntimeError, ValueError) as exc:
            log.warning("agentkv: agent %r keeps a block in memory: %s", state.agent_id, exc)

    def check(self, state: AgentState) -> None:
        """Raise ``TurnFailedError`` (after setting the block file at fault aside) if one of
        the agent's reads failed in the last step. The error names no file: the log does."""
        swap = state.swap
        if swap is None or not swap.error:
            return
        failed = swap.failed_file()
        log.warning("agentkv: agent %r: a KVSwap read failed: %s", state.agent_id, swap.error)
        if failed is not None:
            try:
                name = str(Path(failed.path).relative_to(self.store.model_dir))
                self.store.shared.quarantine(name, swap.error)
            except (OSError, ValueError) as exc:
                log.warning("agentkv: could not quarantine %s: %s", failed.path, exc)
        raise TurnFailedError(
            f"this turn of agent {state.agent_id!r} failed: part of its context could not "
            "be read back from disk (a damaged block file, now set aside); nothing of the "
            "turn was kept, so it can be sent again"
        )
