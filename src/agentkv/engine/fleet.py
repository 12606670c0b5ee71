"""Fleet: an engine's agents in an S3-compatible object store as well as on its disk
(``Engine(store_url="s3://bucket/prefix")``, ``agentkv serve --store``: docs/fleet.md).

The local store stays a write-through cache. Before a turn is planned (``check``), the
store's version of the agent is compared with the local one: where the store holds a state
the local one does not continue (another server ran turns of the agent), it is fetched,
checked and installed, and the turn resumes warm from it. The engine runs this look on a
small pool of threads as a turn is submitted (``prefetch``), under the agent's lock, so the
store's round trips never hold the scheduler's thread (and the other agents' decoding) up;
the turn is admitted once it is done. After a turn is saved, the agent
is committed (``commit``: by ``Engine.wait_saved``, which a server's request awaits, and by a
background thread for every save, with retries): the files the store lacks, then the
manifest, conditionally. Where the store cannot be reached, turns run from the local copy
(or cold) with a note, and commits wait in a bounded queue, retried with backoff.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from ..errors import AgentBusyError, CacheFormatError
from ..store.agent_store import AgentStore, DurableState
from ..store.objects import ObjectStore, StoreMisconfigured, StoreUnavailable
from ..store.remote import RemoteAgents, RemoteDamaged, local_record
from ..store.writer import BackgroundWriter
from .residency import Residency

log = logging.getLogger("agentkv.store")

MAX_PENDING = 4096  # agents waiting for an upload (each a name: the state is on disk)
LOOKERS = 4  # threads looking at the store for submitted turns (``prefetch``)
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0


class Fleet:
    def __init__(
        self,
        url: str,
        store: AgentStore,
        writer: BackgroundWriter,
        residency: Residency,
    ):
        self.objects = ObjectStore(url)
        try:
            self.objects.ping()
        except StoreMisconfigured:
            raise  # no bucket, or the credentials refused: a setup error, said at start
        except StoreUnavailable as exc:  # turns run without it until it answers
            log.warning("agentkv: %s; serving from the local cache meanwhile", exc)
        self.remote = RemoteAgents(self.objects, store.model_dir)
        self.store = store
        self.writer = writer
        self.residency = residency
        store.track_versions = True
        store.ensure_layout()
        self.counts: Counter = Counter()  # (what, outcome) -> count, for /metrics
        self._pending: OrderedDict[str, None] = OrderedDict()
        self._cond = threading.Condition()
        self._locks: dict[str, threading.Lock] = {}
        self._down_until = 0.0
        self._backoff = FIRST_BACKOFF_S
        self._closed = False
        self._thread = threading.Thread(target=self._upload_loop, name="agentkv-s3-up", daemon=True)
        self._thread.start()
        self._lookers = ThreadPoolExecutor(LOOKERS, thread_name_prefix="agentkv-s3-look")

    # -- before a turn: fetch what another server committed -------------------------------

    def prefetch(self, agent_id: str, agent_lock, call) -> Future:
        """``check`` on the fleet's threads, holding the agent's lock (``agent_lock``: the
        engine's; a turn of the agent holds it while it runs, so the look follows it), with
        whatever touches memory run on the scheduler's thread (``call``). The future's
        result is the note for the turn's ``reuse_note``, or None."""

        def look() -> str | None:
            with agent_lock(agent_id):
                return self.check(
                    agent_id, drop=lambda: call(lambda: self.residency.drop(agent_id))
                )

        return self._lookers.submit(look)

    def check(self, agent_id: str, *, drop=None) -> str | None:
        """Make the local copy of the agent the store's newest state where the store holds
        one it does not continue; called before the turn is planned, with the agent held (its
        turns run one at a time): by ``prefetch``, or on the scheduler's thread. ``drop``
        drops the agent's state in memory (default: here). Returns a note for the turn's
        ``reuse_note`` where the store could not help."""
        if self._is_down():
            self.counts["fetch", "unavailable"] += 1
            return self._down_note()
        self.writer.flush(agent_id)
        try:
            local = local_record(self.store.agent_dir(agent_id))
        except CacheFormatError:
            local = None  # the resumer quarantines it; the store's copy replaces it
        started = time.perf_counter()
        try:
            head = self.remote.head(agent_id)
            if head is None or (local is not None and local.continues(head.version)):
                return None
            looked = time.perf_counter()
            fetched = self.remote.fetch(agent_id)
        except StoreUnavailable as exc:
            self._went_down()
            self.counts["fetch", "unavailable"] += 1
            return str(exc)  # "the agent store s3://... could not be reached (...)"
        except RemoteDamaged as exc:
            self.counts["fetch", "damaged"] += 1
            log.warning("agentkv: agent %r: %s", agent_id, exc)
            return f"the agent store's copy of this agent is damaged ({exc.reason})"
        if fetched is None:
            return None
        note = None
        dropped = drop() if drop is not None else self.residency.drop(agent_id)
        if dropped:  # its state in memory was older than the store's
            self.writer.flush(agent_id)
            local = local_record(self.store.agent_dir(agent_id))
        if local is not None and not fetched.manifest.remote.continues(local.version):
            reason = "another server committed this agent; these turns were not"
            self.store.quarantine(agent_id, reason)
            self.counts["commit", "conflict"] += 1
            note = "another server ran turns of this agent; this server's own were kept aside"
        self.writer.set_durable(agent_id, DurableState())
        got = time.perf_counter()
        with self._lock_of(agent_id):  # not while a commit of the agent reads its files
            self.remote.install(fetched)
        ms = [round((t - started) * 1000) for t in (looked, got, time.perf_counter())]
        log.debug(
            "agentkv: agent %r fetched from the store: %d files, %.1f MB; %d ms to look, "
            "%d ms fetched and checked, %d ms installed", agent_id, len(fetched.files),
            fetched.nbytes / 1e6, ms[0], ms[1] - ms[0], ms[2] - ms[1],
        )  # fmt: skip
        self.counts["fetch", "ok"] += 1
        return note

    # -- after a turn: commit it ------------------------------------------------------------

    def commit(self, agent_id: str) -> bool:
        """Commit the agent's saved state to the store (its saves must be on disk). True if
        the store holds it now; False where the store could not be reached (queued: retried
        in the background). AgentBusyError: another server committed the agent since this
        server's turn started; this turn is not in the store, and the agent's next turn here
        starts from the store's state (this server's copy kept aside)."""
        with self._lock_of(agent_id):
            if self._is_down():
                self._queue(agent_id)
                return False
            try:
                self.remote.push(agent_id, adopt=False)  # the writer gives each save a record
            except AgentBusyError:
                self.counts["commit", "conflict"] += 1
                raise
            except StoreUnavailable as exc:
                log.warning("agentkv: agent %r not committed yet: %s", agent_id, exc)
                self._went_down()
                self._queue(agent_id)
                self.counts["commit", "unavailable"] += 1
                return False
            except (FileNotFoundError, CacheFormatError):  # a newer save replaced its files
                self._queue(agent_id)
                return False
        self.counts["commit", "ok"] += 1
        self._went_up()
        return True

    def saved(self, agent_id: str) -> None:
        """The writer saved a turn of the agent: commit it in the background."""
        self._queue(agent_id)

    def delete(self, agent_id: str) -> None:
        """Delete the agent's manifest from the store (its files stay: docs/fleet.md)."""
        try:
            self.objects.delete(self.remote.manifest_key(agent_id))
        except StoreUnavailable as exc:
            log.warning("agentkv: agent %r is still in the store: %s", agent_id, exc)

    # -- the background uploads ---------------------------------------------------------------

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._pending)

    def _queue(self, agent_id: str) -> None:
        with self._cond:
            self._pending[agent_id] = None
            self._pending.move_to_end(agent_id)
            while len(self._pending) > MAX_PENDING:  # committed by its next turn's save
                dropped, _ = self._pending.popitem(last=False)
                self.counts["commit", "dropped"] += 1
                log.warning("agentkv: upload queue full; agent %r waits for its next turn", dropped)
            self._cond.notify_all()

    def _upload_loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (not self._pending or self._is_down()):
                    wait = max(self._down_until - time.monotonic(), 0.0) if self._pending else None
                    self._cond.wait(wait)
                if self._closed:
                    return
                agent_id, _ = self._pending.popitem(last=False)
            try:
                self.writer.flush(agent_id)
                self.commit(agent_id)
            except AgentBusyError as exc:  # settled by the agent's next turn here
                log.warning("agentkv: %s", exc)
            except Exception as exc:  # keep uploading the others
                log.warning("agentkv: could not commit agent %r: %s", agent_id, exc)

    def _lock_of(self, agent_id: str) -> threading.Lock:
        with self._cond:
            return self._locks.setdefault(agent_id, threading.Lock())

    def _is_down(self) -> bool:
        return time.monotonic() < self._down_until

    def _down_note(self) -> str:
        return f"the agent store {self.objects.url} could not be reached (retrying)"

    def _went_down(self) -> None:
        with self._cond:
            self._down_until = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, MAX_BACKOFF_S)

    def _went_up(self) -> None:
        with self._cond:
            self._down_until = 0.0
            self._backoff = FIRST_BACKOFF_S

    def close(self, timeout: float = 10.0) -> None:
        """Commit what is queued (for up to ``timeout`` seconds), then stop."""
        deadline = time.monotonic() + timeout
        while self.pending and not self._is_down() and time.monotonic() < deadline:
            time.sleep(0.05)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=max(deadline - time.monotonic(), 1.0))
        self._lookers.shutdown(wait=True, cancel_futures=True)
        self.remote.close()
