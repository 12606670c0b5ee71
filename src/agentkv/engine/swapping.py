"""KVSwap in the engine: an agent that starts decoding with more KV than the swap budget
keeps only the budget in memory (docs/kvswap.md).

``Swapper.start`` runs when a turn's prefill is done (prefill stays exact: the whole
context was in the pool): the agent's complete blocks before its last are written as
block files where missing, then evicted (``pool/swap.py``); the pool gets them back as
cached blocks, so other turns can take the room. ``keep_to_budget`` does the same after
each decode step for a block the agent filled. ``check`` turns a failed read into the
agent's error (its block file quarantined). A swapped agent's turn ends by saving it
(its evicted blocks named by hash) and dropping it from memory; its next turn resumes from
disk, by hash from the pool's cached blocks where they are still there.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..errors import CacheFormatError
from ..pool import KVPool
from ..pool.swap import SwapState, plan_blocks
from .state import AgentState

log = logging.getLogger("agentkv.engine")


class Swapper:
    def __init__(
        self, *, pool: KVPool, store, loaded, budget: int | None, read_ahead: bool = False
    ):
        self.pool = pool
        self.store = store
        self.loaded = loaded
        self.budget = budget
        self.read_ahead = read_ahead
        self._projections = None
        self.swapped = 0  # agents swapped since the engine started
        self.filled_evicted = 0  # blocks agents filled while decoding, evicted since

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

    def start(self, state: AgentState) -> bool:
        """Swap the agent's leading blocks out if its context is over the budget; whether
        it did. Nothing changes where it cannot (logged): the turn decodes in memory."""
        if self.budget is None or state.swap is not None:
            return False
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
        projections = self.projections()
        hold = None
        try:
            shared = self.store.shared
            hold = shared.hold()  # until the save naming the block files is written
            files = shared.ensure_pool_blocks(self.pool, blocks)
            state.swap = SwapState.evict(
                self.pool,
                table,
                files,
                projections,
                query_heads=self.loaded.query_heads,
                staging=staging,
            )
        except (OSError, RuntimeError, ValueError) as exc:
            if hold is not None:
                hold.close()
            log.warning(
                "agentkv: agent %r decodes in memory: KVSwap failed: %s", state.agent_id, exc
            )
            return False
        state.swap_hold = hold
        self.swapped += 1
        return True

    def keep_to_budget(self, state: AgentState) -> None:
        """Evict the blocks a swapped agent filled while decoding (written as block files
        first), so a long reply keeps its resident KV at the budget."""
        swap = state.swap
        while swap is not None and (block := swap.next_evictable()) is not None:
            try:
                # under the hold ``start`` took: no collection until the turn's save
                (file,) = self.store.shared.ensure_pool_blocks(self.pool, [block])
                swap.evict_next(file)
                self.filled_evicted += 1
            except (OSError, RuntimeError, ValueError) as exc:
                log.warning("agentkv: agent %r keeps a block in memory: %s", state.agent_id, exc)
                return

    def check(self, state: AgentState) -> None:
        """Raise CacheFormatError (after quarantining the block file) if one of the
        agent's reads failed in the last step."""
        swap = state.swap
        if swap is None or not swap.error:
            return
        failed = swap.failed_file()
        if failed is not None:
            try:
                name = str(Path(failed.path).relative_to(self.store.model_dir))
                self.store.shared.quarantine(name, swap.error)
            except (OSError, ValueError) as exc:
                log.warning("agentkv: could not quarantine %s: %s", failed.path, exc)
        raise CacheFormatError(failed.path if failed else "a block file", swap.error)
