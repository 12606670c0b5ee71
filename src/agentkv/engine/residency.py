"""Residency: which agents are in memory (hot), least recently used first, and giving their
blocks back when the pool runs short.

An agent is *hot* while its state (block table, text) is here; a turn takes the state out
(``take``) and puts it back when it ends (``put``), so an agent running a turn is never
evicted. ``reclaim`` frees pool blocks in the order the design asks for: cached blocks
nobody holds (the pool hands those out by itself, least recently used first), then idle
agents whose last turn is already packed for the writer (no I/O: their state is safe),
then idle agents with unsaved tokens, after queueing their save.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from ..pool import KVPool
from .state import AgentState


class Residency:
    def __init__(self, pool: KVPool, save: Callable[[AgentState], None] | None = None):
        self.pool = pool
        self.save = save  # queues an agent's unsaved tokens (set by the engine)
        self._hot: OrderedDict[str, AgentState] = OrderedDict()
        self._lock = threading.Lock()
        self.last_used: dict[str, float] = {}
        self.evicted = 0  # agents dropped to free blocks (stat)

    def __contains__(self, agent_id: str) -> bool:
        return agent_id in self._hot

    def get(self, agent_id: str) -> AgentState | None:
        return self._hot.get(agent_id)

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._hot)

    def states(self) -> list[AgentState]:
        with self._lock:
            return list(self._hot.values())

    def take(self, agent_id: str) -> AgentState | None:
        """Remove the agent's state for a turn (None if it is not hot)."""
        with self._lock:
            return self._hot.pop(agent_id, None)

    def put(self, state: AgentState) -> None:
        """The agent is hot again, most recently used."""
        with self._lock:
            self._hot[state.agent_id] = state
            self._hot.move_to_end(state.agent_id)
        self.last_used[state.agent_id] = time.time()

    def drop(self, agent_id: str) -> bool:
        """Forget the agent in memory (saving what is not saved yet); True if it was hot."""
        state = self.take(agent_id)
        if state is None:
            return False
        if state.durable < state.size and self.save is not None:
            self.save(state)
        state.release()
        return True

    def reclaim(self, blocks: int, *, busy=(), lock_of=None) -> bool:
        """Drop idle agents, least recently used first (those already saved before those
        that are not), until the pool has ``blocks`` available; False if it cannot.

        ``lock_of(agent)`` gives the agent's lock: an agent a caller holds is skipped."""
        pool = self.pool.blocks
        if pool.available() >= blocks:
            return True
        candidates = [s for s in self.states() if s.agent_id not in busy]
        candidates.sort(key=lambda s: s.durable < s.size)  # saved first; stable: LRU order
        for state in candidates:
            if pool.available() >= blocks:
                break
            lock = lock_of(state.agent_id) if lock_of else None
            if lock is not None and not lock.acquire(blocking=False):
                continue
            try:
                if self.drop(state.agent_id):
                    self.evicted += 1
            finally:
                if lock is not None:
                    lock.release()
        return pool.available() >= blocks
