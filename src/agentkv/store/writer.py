"""BackgroundWriter: persists finished turns off the request path.

One daemon thread drains a FIFO of SaveJobs, so an agent's saves land in
order and generation never waits on disk. Pending jobs are bounded in bytes:
``submit`` blocks only when more than ``max_pending_bytes`` are already waiting
(the disk is that far behind). ``flush`` waits for everything queued (or one
agent's jobs); ``close`` flushes and stops. Every Engine's writer is flushed at
normal interpreter exit.

The writer also remembers, per agent, what is durable (``DurableState``): the
next job for that agent builds on it. A failed save (disk full, another
process changed the agent) is logged and leaves the disk as it was; the
agent's next save starts from what is durable, so nothing half-written is
ever referenced by a manifest.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from collections import deque
from collections.abc import Callable

from .agent_store import AgentStore, DurableState, SaveJob, SaveReport

log = logging.getLogger("agentkv.store")

DEFAULT_MAX_PENDING_BYTES = 512 << 20
_LIVE: weakref.WeakSet = weakref.WeakSet()


class BackgroundWriter:
    def __init__(self, store: AgentStore, *, max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES):
        self.store = store
        self.max_pending_bytes = max_pending_bytes
        # called on the writer's thread with the agent's id after each save (a fleet's upload)
        self.on_saved: Callable[[str], None] | None = None
        self._queue: deque[SaveJob] = deque()
        self._pending_bytes = 0
        self._busy: SaveJob | None = None
        self._durable: dict[str, DurableState] = {}
        self._failures: dict[str, str] = {}
        self._reports: deque[SaveReport] = deque(maxlen=256)
        self.bytes_written = 0  # by every save since the writer started
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="agentkv-writer", daemon=True)
        self._thread.start()
        _LIVE.add(self)

    # -- producer side ----------------------------------------------------------

    def set_durable(self, agent_id: str, state: DurableState) -> None:
        """Record what is on disk for ``agent_id`` (after loading it, or starting it fresh)."""
        with self._cond:
            self._durable[agent_id] = state
            self._failures.pop(agent_id, None)

    def take_failure(self, agent_id: str) -> str | None:
        """The reason the agent's last save failed, once; its next save must rewrite all."""
        with self._cond:
            return self._failures.pop(agent_id, None)

    def submit(self, job: SaveJob) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("the writer is closed")
            while self._pending_bytes > self.max_pending_bytes and self._queue:
                self._cond.wait()
            self._queue.append(job)
            self._pending_bytes += job.nbytes
            self._cond.notify_all()

    def flush(self, agent_id: str | None = None, timeout: float | None = None) -> bool:
        """Wait until every queued job (or every job of ``agent_id``) is written."""

        def done():
            if agent_id is None:
                return not self._queue and self._busy is None
            busy = self._busy is not None and self._busy.agent_id == agent_id
            return not busy and all(j.agent_id != agent_id for j in self._queue)

        with self._cond:
            return self._cond.wait_for(done, timeout)

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        _LIVE.discard(self)

    def reports(self) -> list[SaveReport]:
        with self._cond:
            return list(self._reports)

    # -- writer thread ----------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                job = self._queue.popleft()
                self._busy = job
                durable = self._durable.get(job.agent_id, DurableState())
            try:
                report, new_state = self.store.write(job, durable)
            except Exception as exc:  # keep serving; the disk still holds `durable`
                log.warning("agentkv: could not save agent %r: %s", job.agent_id, exc)
                with self._cond:
                    self._failures[job.agent_id] = str(exc)
            else:
                with self._cond:
                    self._durable[job.agent_id] = new_state
                    self._reports.append(report)
                    self.bytes_written += report.bytes_written
                if self.on_saved is not None:
                    self.on_saved(job.agent_id)
            finally:
                if job.hold is not None:
                    job.hold.close()
                with self._cond:
                    self._pending_bytes -= job.nbytes
                    self._busy = None
                    self._cond.notify_all()


@atexit.register
def _flush_all_at_exit() -> None:
    for writer in list(_LIVE):
        writer.close()
