"""Scheduler: every model step of the engine, on one thread, interleaving agents.

Each iteration runs **one prefill chunk** of one agent that is starting a turn
(the one with the least prefill left, so a short prompt does not wait behind a
long one; no turn is passed over more than ``STARVE_ROUNDS`` times), then **one
batched decode step** for every agent that is generating. So an agent's long
prefill delays the others by at most one chunk per step, a new agent joins the
running batch as soon as its prefill is done, and every token is streamed the
moment it is sampled.

::

    submit ─► pending (per agent, FIFO) ─► prefill chunks ─► decode batch ─► done
                 waits while its agent         solo, on the     one row per
                 has a turn in flight          agent's caches   agent (Q4)

Prefill runs on the agent's own caches, decode in ``BatchQuantizedKVCache``
rows; the linear layers are batch-invariant on CPU, so a turn gives the same
tokens alone or batched. All MLX work happens on this thread.

Admission: at most ``max_batch`` turns run at once (prefilling or decoding),
and their reserved KV bytes (context + ``max_tokens``, estimated when the turn
is submitted) stay within ``kv_budget`` (a turn that alone exceeds it still
runs, by itself). Waiting turns start in arrival order; at most ``max_queue``
wait, beyond that ``submit`` raises ``EngineBusyError``. ``policy="fcfs"``
runs one turn at a time to completion (the baseline the interleaved
scheduler is measured against).
"""

from __future__ import annotations

import logging
import threading
from collections import deque

import mlx.core as mx

from ..errors import EngineBusyError
from ..kv.batch import BatchQuantizedKVCache
from .generation import prefill_chunk
from .job import Job, Phase

log = logging.getLogger("agentkv.engine")


class _Batch:
    """The agents decoding together in one storage format: per-layer batch caches."""

    def __init__(self):
        self.jobs: list[Job] = []
        self.caches: list[BatchQuantizedKVCache] = []

    def join(self, joining: list[Job]) -> None:
        layers = len(joining[0].state.caches)
        incoming = [
            BatchQuantizedKVCache.merge([j.state.caches[layer] for j in joining])
            for layer in range(layers)
        ]
        if self.jobs:
            for mine, theirs in zip(self.caches, incoming):
                mine.extend(theirs)
        else:
            self.caches = incoming
        self.jobs.extend(joining)

    def leave(self, rows: list[int]) -> None:
        """Hand the rows' caches back to their agents and drop them from the batch."""
        for row in rows:
            self.jobs[row].state.caches = [c.extract(row) for c in self.caches]
        keep = [i for i in range(len(self.jobs)) if i not in set(rows)]
        self.jobs = [self.jobs[i] for i in keep]
        if keep:
            for c in self.caches:
                c.filter(keep)
        else:
            self.caches = []


POLICIES = ("interleave", "fcfs")
STARVE_ROUNDS = 8


class Scheduler:
    def __init__(
        self,
        engine,
        *,
        max_batch: int = 8,
        max_queue: int = 64,
        kv_budget: int = 1 << 30,
        policy: str = "interleave",
    ):
        self.engine = engine  # (the Engine checks the options before it loads the model)
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.kv_budget = kv_budget
        self.policy = policy
        self._cond = threading.Condition()
        self._pending: deque[Job] = deque()
        self._prefilling: deque[Job] = deque()
        self._batches: dict = {}
        self._stopping = False
        self._running = {"running": 0, "reserved_bytes": 0}  # as of the last step
        self._thread = threading.Thread(target=self._run, name="agentkv-scheduler", daemon=True)
        self._thread.start()

    # -- callers' side ----------------------------------------------------------

    def submit(self, job: Job) -> Job:
        with self._cond:
            if self._stopping:
                raise RuntimeError("the engine is closed")
            if len(self._pending) >= self.max_queue:
                raise EngineBusyError(
                    f"{len(self._pending)} turns are already waiting (max_queue "
                    f"{self.max_queue}); try again shortly",
                    retry_after=self._retry_after(),
                )
            job.scheduler = self
            self._pending.append(job)
            self._cond.notify_all()
        return job

    def cancel(self, job: Job) -> None:
        """Stop a job at its next token (its agent's state stays consistent)."""
        job.cancelled = True
        with self._cond:
            if job.phase is Phase.PENDING and job in self._pending:
                self._pending.remove(job)
                job.close(RuntimeError("cancelled before it started"))

    def stop(self) -> None:
        """Finish every job already submitted, then stop the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join()

    @property
    def busy(self) -> bool:
        with self._cond:
            return bool(self._pending or self._prefilling or self._batches)

    def load(self) -> dict:
        """Turns waiting and running, and the KV bytes reserved by the running ones."""
        with self._cond:
            return {"waiting": len(self._pending), **self._running}

    def _note_load(self) -> None:
        active = self._active()
        self._running = {
            "running": len(active),
            "reserved_bytes": sum(j.footprint for j in active),
        }

    def _active(self) -> list[Job]:
        return [*self._prefilling, *(j for b in self._batches.values() for j in b.jobs)]

    def _retry_after(self) -> float:
        """Seconds until a queue slot is likely free: a rough turn time per waiting batch."""
        return float(min(60, 1 + len(self._pending) // max(1, self.max_batch)))

    # -- the scheduling thread ----------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopping or self._has_work())
                if self._stopping and not self._has_work():
                    return
            try:
                self._admit()
                self._note_load()
                if not (self._prefilling or self._batches):
                    # Turns wait, but none could start (their agents are held by a caller
                    # such as delete or evict): look again shortly instead of spinning.
                    with self._cond:
                        self._cond.wait(0.02)
                    continue
                self._prefill_one()
                self._decode_all()
                self._note_load()
            except Exception:  # a bug here must not kill the engine's only thread
                log.exception("agentkv: scheduler step failed")

    def _has_work(self) -> bool:
        return bool(self._pending or self._prefilling or self._batches)

    def _admit(self) -> None:
        """Start pending jobs whose agents are free (one turn per agent at a time),
        in arrival order, within ``max_batch`` and the KV budget."""
        with self._cond:
            waiting = list(self._pending)
            active = self._active()
        busy = {j.agent_id for j in active}
        running = len(active)
        reserved = sum(j.footprint for j in active)
        for job in waiting:
            if job.agent_id in busy:
                continue
            if running and (
                self.policy == "fcfs"
                or running >= self.max_batch
                or reserved + job.footprint > self.kv_budget
            ):
                break  # in order: a later turn does not overtake one that does not fit
            lock = self.engine._agent_lock(job.agent_id)
            if not lock.acquire(blocking=False):
                continue  # a caller (evict, delete...) holds the agent right now
            with self._cond:
                if job not in self._pending:  # cancelled meanwhile
                    lock.release()
                    continue
                self._pending.remove(job)
            busy.add(job.agent_id)
            running += 1
            reserved += job.footprint
            job.lock = lock
            try:
                resumed = self.engine._resume(job.agent_id, job.prompt)
                job.start(
                    resumed,
                    tokenizer=self.engine.loaded.tokenizer,
                    eos_ids=self.engine.eos_ids,
                    max_chunk=self.engine.prefill_chunk,
                    query_heads=self.engine.query_heads,
                    context_limit=self.engine.context_limit,
                )
            except Exception as exc:
                self._fail(job, exc)
                continue
            self._prefilling.append(job)

    def _prefill_one(self) -> None:
        if not self._prefilling:
            return
        job = self._next_prefill()
        if job.cancelled:
            self._finish(job)
            return
        try:
            ids, last = job.next_chunk()
            logits = prefill_chunk(self.engine.loaded.model, job.state.caches, ids, last=last)
            job.chunk_done()
            if not last:
                self._prefilling.append(job)
                return
            job.prefill_finished()
            token = job.sample(logits).item()
        except Exception as exc:
            self._fail(job, exc)
            return
        if job.take(token):
            self._finish(job)
            return
        job.phase = Phase.DECODE
        batch = self._batches.setdefault(job.state.quant, _Batch())
        batch.join([job])

    def _next_prefill(self) -> Job:
        """Shortest remaining prefill first, so a short prompt never waits behind a long
        one's every chunk; a turn passed over ``STARVE_ROUNDS`` times goes next."""
        starving = [j for j in self._prefilling if j.passed_over >= STARVE_ROUNDS]
        pick = starving[0] if starving else min(self._prefilling, key=lambda j: sum(j.chunks))
        self._prefilling.remove(pick)
        for job in self._prefilling:
            job.passed_over += 1
        pick.passed_over = 0
        return pick

    def _decode_all(self) -> None:
        for quant in list(self._batches):
            batch = self._batches[quant]
            try:
                tokens = mx.array([[j.last_token] for j in batch.jobs])
                logits = self.engine.loaded.model(tokens, cache=batch.caches)[:, -1, :]
                sampled = [j.sample(logits[i : i + 1]) for i, j in enumerate(batch.jobs)]
                mx.eval(sampled)
            except Exception as exc:
                for job in batch.jobs:
                    self._fail(job, exc)
                del self._batches[quant]
                continue
            done = [i for i, (j, t) in enumerate(zip(batch.jobs, sampled)) if j.take(t.item())]
            if done:
                finished = [batch.jobs[i] for i in done]
                batch.leave(done)
                for job in finished:
                    self._finish(job)
            if not batch.jobs:
                del self._batches[quant]

    # -- ends ---------------------------------------------------------------------

    def _finish(self, job: Job) -> None:
        try:
            job.record_fed(self.engine.token_text)
            job.finish(self.engine.eos_ids)
            self.engine._commit(job.state, failed=False)
            job.close()
        except Exception as exc:
            self._fail(job, exc)
        finally:
            self._release(job)

    def _fail(self, job: Job, exc: BaseException) -> None:
        if job.state is not None:
            self.engine._commit(job.state, failed=True)
        if job in self._prefilling:
            self._prefilling.remove(job)
        job.close(exc)
        self._release(job)

    @staticmethod
    def _release(job: Job) -> None:
        if job.lock is not None:
            job.lock.release()
            job.lock = None
