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
                 waits while its agent         one row: its      one row per
                 has a turn in flight          block table       agent (jagged)

Every step is one forward pass over block tables in the pool (``TurnRunner.forward``):
a decode batch is the list of its agents' tables, so agents join and leave it between
steps with no KV bytes copied. The linear layers and attention are batch-invariant on
CPU, so a turn gives the same tokens alone or batched. All MLX work happens on this
thread.

On a GPU the decode loop is pipelined (``_decode_pipelined``), as mlx-lm's is: step n+1 is
built and started, fed the tokens step n is still sampling, before step n's tokens are read,
so building a step's graph (Python) overlaps the device's work on the one before. A row
whose turn ends at step n's token (a stop, ``max_tokens``, a cancel) has its row of step n+1
cut from its table (``AgentState.fit_table``); a row under a grammar, swapped (KVSwap), or
whose next token would complete a channel group runs the step unpipelined. On the CPU the
decoder layers run fused, in place, so steps run one after another (and on a GPU with
``AGENTKV_GPU_PIPELINE=0``).

Admission: at most ``max_batch`` turns run at once (prefilling or decoding), and a turn
starts only when the pool can give it every block it may need (its context, prompt and
``max_tokens``): ``TurnRunner.admit`` reclaims idle agents' blocks if it must, reserves
them and builds the agent's state; otherwise the turn waits, so a running turn never
runs out of blocks. Waiting turns start in arrival order; at most ``max_queue`` wait,
beyond that ``submit`` raises ``EngineBusyError``. A turn whose context another turn is
still prefilling (agents that start at once with the same system prompt) waits for that
prefill and shares its blocks (``runner.Waits``): the prefix is computed once, not once an
agent, and later turns start meanwhile. ``policy="fcfs"`` runs one turn at a
time to completion (the baseline the interleaved scheduler is measured against).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter, deque

import mlx.core as mx

from ..errors import AgentKVError, EngineBusyError
from ..kernels import gpu as gpu_kernels
from ..pool import PoolExhaustedError
from .job import Job, Phase
from .planner import Plan, Planner, plan_of
from .runner import TurnRunner, Waits

log = logging.getLogger("agentkv.engine")

POLICIES = ("interleave", "fcfs")
PIPELINE_ENV = "AGENTKV_GPU_PIPELINE"  # "0": a GPU's decode steps one after another
STARVE_ROUNDS = 8


class Scheduler:
    def __init__(
        self,
        runner: TurnRunner,
        *,
        max_batch: int = 8,
        max_queue: int = 64,
        policy: str = "interleave",
    ):
        self.runner = runner  # (the Engine checks the options before it loads the model)
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.policy = policy
        self._cond = threading.Condition()
        self._pending: deque[Job] = deque()
        self._prefilling: deque[Job] = deque()
        self._decoding: list[Job] = []
        # the decode step in flight (pipelined: its jobs and each one's sampled token, still
        # being computed) and whether decode steps are pipelined (a GPU's; tests set it)
        self._pipe: tuple[list[Job], list[mx.array], list[mx.array]] | None = None
        self.pipeline = mx.default_device() != mx.cpu and os.environ.get(PIPELINE_ENV) != "0"
        self.ahead_steps = 0  # steps started before the tokens they were fed were read
        self._calls: deque = deque()  # work for this thread, between steps (see call)
        self._stopping = False
        self._running = {"running": 0, "reserved_blocks": 0}  # as of the last step
        self.planner = Planner()  # which turns a decode step runs (engine/planner.py)
        self.plans: Counter[Plan] = Counter()  # decode steps run, by plan
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

    def wake(self) -> None:
        """Look at the pending turns again now (one became ready: Fleet.prefetch)."""
        with self._cond:
            self._cond.notify_all()

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

    def call(self, fn):
        """Run ``fn()`` on the scheduler's thread between two steps and return its result
        (or raise its exception): whatever touches the pool runs there, never beside a step.
        """
        if threading.current_thread() is self._thread or not self._thread.is_alive():
            return fn()
        done = threading.Event()
        box: dict = {}

        def task():
            try:
                box["value"] = fn()
            except BaseException as exc:  # handed to the caller
                box["error"] = exc
            finally:
                done.set()

        with self._cond:
            self._calls.append(task)
            self._cond.notify_all()
        while not done.wait(0.1):
            if not self._thread.is_alive():  # stopped meanwhile: nothing runs beside us now
                with self._cond:
                    if task in self._calls:
                        self._calls.remove(task)
                        task()
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def _run_calls(self) -> None:
        while True:
            with self._cond:
                if not self._calls:
                    return
                task = self._calls.popleft()
            task()

    @property
    def busy(self) -> bool:
        with self._cond:
            return bool(self._pending or self._prefilling or self._decoding)

    def load(self) -> dict:
        """Turns waiting and running, and the pool blocks still reserved for the running."""
        with self._cond:
            return {"waiting": len(self._pending), **self._running}

    def _note_load(self) -> None:
        active = self._active()
        self._running = {
            "running": len(active),
            "reserved_blocks": sum(j.reservation.left for j in active if j.reservation),
        }

    def _active(self) -> list[Job]:
        return [*self._prefilling, *self._decoding]

    def _retry_after(self) -> float:
        """Seconds until a queue slot is likely free: a rough turn time per waiting batch."""
        return float(min(60, 1 + len(self._pending) // max(1, self.max_batch)))

    # -- the scheduling thread ----------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopping or self._has_work() or self._calls)
                if self._stopping and not self._has_work() and not self._calls:
                    return
            try:
                self._run_calls()
                if not self._has_work():
                    continue
                self._admit()
                self._note_load()
                if not (self._prefilling or self._decoding):
                    # Turns wait, but none could start (their agents are held by a caller
                    # such as delete or evict): look again shortly instead of spinning.
                    with self._cond:
                        self._cond.wait(0.02)
                    continue
                self._prefill_one()
                self._decode_all()
                self._note_load()
            except Exception as exc:  # a bug here must not kill the engine's only thread
                log.exception("agentkv: scheduler step failed")
                self._fail_running(exc)

    def _fail_running(self, exc: Exception) -> None:
        """End every running turn with ``exc``: a step failed outside any one turn's
        handling, so running it again would likely fail again, and the turns' callers would
        wait forever. Their agents reload from disk (``runner.finish``); waiting turns stay."""
        running = self._active()
        if self._pipe is not None:
            running += [j for j in self._pipe[0] if j not in running]
        self._pipe = None
        self._prefilling, self._decoding = [], []
        for job in running:
            try:
                self._fail(job, exc)
            except Exception:  # the caller hears of the failure whatever the turn's state
                log.exception("agentkv: could not end the turn of %r cleanly", job.agent_id)
                job.close(exc)
                self._release(job)

    def _has_work(self) -> bool:
        return bool(self._pending or self._prefilling or self._decoding)

    def _admit(self) -> None:
        """Start pending jobs whose agents are free (one turn per agent at a time), in
        arrival order, within ``max_batch`` and the blocks the pool can give."""
        with self._cond:
            waiting = list(self._pending)
        active = self._active()
        busy = {j.agent_id for j in active}
        running = len(active)
        for job in waiting:
            if job.agent_id in busy:
                continue
            if job.store_check is not None and not job.store_check.done():
                continue  # the fleet is still looking at the store for its agent
            if job.waits_for is not None:
                if job.waits_for.pending():
                    continue  # another turn's prefill is writing a part of its context
                job.waits_for = None
            if running and (self.policy == "fcfs" or running >= self.max_batch):
                break  # in order: a later turn does not overtake one that does not fit
            lock = self.runner.agent_lock(job.agent_id)
            if not lock.acquire(blocking=False):
                continue  # a caller (evict, delete...) holds the agent right now
            with self._cond:
                if job not in self._pending:  # cancelled meanwhile
                    lock.release()
                    continue
            try:
                resumed = self.runner.admit(job, busy, self._prefilling)
            except Exception as exc:
                self._drop_pending(job)
                job.lock = lock
                self._fail(job, exc)
                continue
            if isinstance(resumed, Waits):  # it shares that prefill's blocks once written
                lock.release()
                job.waits_for = resumed
                continue
            if resumed is None:  # the pool cannot give its blocks yet: it waits, in order
                lock.release()
                break
            self._drop_pending(job)
            busy.add(job.agent_id)
            running += 1
            job.lock = lock
            try:
                job.start(
                    resumed,
                    tokenizer=self.runner.tokenizer,
                    eos_ids=self.runner.eos_ids,
                    max_chunk=self.runner.prefill_chunk,
                    last_chunk=self.runner.last_chunk,
                    scores_budget=self.runner.scores_budget,
                    query_heads=self.runner.query_heads,
                    context_limit=self.runner.context_limit,
                )
            except Exception as exc:
                self._fail(job, exc)
                continue
            self._prefilling.append(job)

    def _drop_pending(self, job: Job) -> None:
        with self._cond:
            if job in self._pending:
                self._pending.remove(job)

    def _prefill_one(self) -> None:
        if not self._prefilling:
            return
        job = self._next_prefill()
        if job.cancelled:
            self._finish(job)
            return
        try:
            ids, last = job.next_chunk()
            logits = self.runner.prefill(job, ids, last)
            job.chunk_done()
            if not last:
                self._prefilling.append(job)
                return
            job.prefill_finished()
            over = job.take(job.sample(logits).item(), logits)
            if not over:
                self.runner.start_decode(job)
        except Exception as exc:
            self._fail(job, exc)
            return
        if over:
            self._finish(job)
            return
        job.phase = Phase.DECODE
        self._decoding.append(job)

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
        """One decode step: the planner (engine/planner.py) picks the decoding turns it runs
        (all of them, or the one that runs fastest alone) and the part of each one's draft
        it feeds; one forward pass over their block tables, then each row sampled on its own
        (a constrained row masks its logits with its own grammar first), so a row whose
        grammar fails ends only its own turn. A cancelled turn ends here."""
        if self._pipe is not None or (
            self.pipeline
            and self.runner.swapper is None  # (KVSwap runs on the CPU only)
            and self._decoding
            and all(j.grammar is None and j.state.swap is None for j in self._decoding)
        ):
            self._decode_pipelined(self._decoding)
            return
        jobs, ended = [], []
        for job in self._decoding:
            if job.cancelled:  # ends now, whether or not the plan would step it
                ended.append((job, None))
                continue
            try:
                job.draft = self.runner.draft_for(job)
                jobs.append(job)
            except Exception as exc:  # the turn's own failure, as a step's would be
                ended.append((job, exc))
        if jobs:
            plan = self.planner.plan(
                [len(j.draft) for j in jobs],
                [j.drafter.acceptance if j.drafter is not None else 0.0 for j in jobs],
                [self.runner.draft_limit(j) for j in jobs],
            )
            stepping = []
            for job, take in zip(jobs, plan.takes):
                if take is not None:  # None: the turn waits this step
                    job.draft = job.draft[:take]
                    stepping.append(job)
            ended += self._step(stepping, plan.width)
        self._end(ended)

    def _decode_pipelined(self, jobs: list[Job]) -> None:
        """One decode step, pipelined (module docstring): start the next step on the tokens
        the one in flight is sampling, then read those tokens."""
        runner = self.runner
        if self._pipe is None:  # a step fed the tokens already sampled, started
            try:
                logits = runner.launch(
                    [j.state.table for j in jobs],
                    [j.last_token for j in jobs],
                    [j.reservation for j in jobs],
                )
                rows = [logits[i : i + 1] for i in range(len(jobs))]
                tokens = [j.sample(row) for j, row in zip(jobs, rows)]
                runner.run_ahead(tokens)
            except Exception as exc:
                self._decoding = []
                for job in jobs:
                    self._fail(job, exc)
                return
            self._pipe = (jobs, tokens, rows)
        jobs, tokens, rows = self._pipe
        self._pipe = None
        self.plans[plan_of([1] * len(jobs))] += 1
        ahead = None
        if jobs == self._decoding and all(self._may_run_ahead(j) for j in jobs):
            try:
                logits = runner.launch(
                    [j.state.table for j in jobs], tokens, [j.reservation for j in jobs]
                )
                ahead_rows = [logits[i : i + 1] for i in range(len(jobs))]
                ahead = [j.sample(row) for j, row in zip(jobs, ahead_rows)]
                runner.run_ahead(ahead)
                self.ahead_steps += 1
            except PoolExhaustedError:  # the tables as they were: this step, unpipelined
                ahead = None
            except Exception as exc:
                self._decoding = [j for j in self._decoding if j not in jobs]
                for job in jobs:
                    self._fail(job, exc)
                return
        ended, going = [], []
        for i, (job, token) in enumerate(zip(jobs, tokens)):
            try:
                if job.take(token.item(), rows[i]):
                    ended.append((job, None))
                    continue
                if ahead is not None:  # the token the step ahead was fed
                    job.state.table.written([job.last_token])
                going.append(i)
            except Exception as exc:
                ended.append((job, exc))
        if ahead is not None and going:
            self._pipe = (
                [jobs[i] for i in going],
                [ahead[i] for i in going],
                [ahead_rows[i] for i in going],
            )
        self._end(ended)

    @staticmethod
    def _may_run_ahead(job: Job) -> bool:
        """Whether the next step may be fed ``job``'s token before it is read: a turn that
        may go on, under no grammar, not swapped, whose token would not complete a channel
        group (``TurnRunner.launch``)."""
        table = job.state.table
        ct = table.tails.ct if table.tail is not None else 0
        return (
            job.grammar is None
            and job.state.swap is None
            and not job.cancelled
            and len(job.generated) + 1 < job.max_new
            and not (ct and (table.length + 1) % ct == 0)
        )

    def _step(self, jobs: list[Job], width: int = 0) -> list[tuple[Job, BaseException | None]]:
        """Run one decode step of ``jobs``, each feeding its last token and ``job.draft``,
        then (``width``: an even step, ``planner.StepPlan``) copies of its last token up to
        ``width`` tokens, never kept; the turns it ended (with their error or None)."""
        ids = [[j.last_token, *j.draft] for j in jobs]
        if width:
            ids = [row + [row[-1]] * (width - len(row)) for row in ids]
        drafted = any(len(row) > 1 for row in ids)
        began = time.perf_counter()
        try:
            logits = self.runner.forward(
                [j.state.table for j in jobs],
                ids,
                reservations=[j.reservation for j in jobs],
                swaps=[j.state.swap for j in jobs],
                logits="every" if drafted else True,
            )
        except Exception as exc:
            return [(job, exc) for job in jobs]
        sampled, rows, ended = {}, {}, []
        for i, job in enumerate(jobs):
            try:
                if len(ids[i]) > 1:
                    over = self._verify(job, logits[i], len(ids[i]))
                    self.runner.check_swap(job)
                    if over:
                        ended.append((job, None))
                else:
                    self.runner.check_swap(job)  # a failed KVSwap read ends its own turn only
                    rows[job] = logits[i] if drafted else logits[i : i + 1]
                    sampled[job] = job.sample(rows[job])
            except Exception as exc:
                ended.append((job, exc))
        mx.eval(list(sampled.values()))
        for job, token in sampled.items():
            try:
                if job.take(token.item(), rows[job]):
                    ended.append((job, None))
            except Exception as exc:
                ended.append((job, exc))
        fed = [len(row) for row in ids]
        self.planner.record(fed, time.perf_counter() - began)
        self.plans[plan_of(fed)] += 1
        return ended

    @staticmethod
    def _verify(job: Job, logits: mx.array, fed: int) -> bool:
        """A row that fed ``fed`` tokens: the positions of its last token and its draft
        sampled (``Job.verify``), the rows of the tokens not kept cut from its table (draft
        tokens not kept, an even step's padding); whether the turn is over."""
        draft, table = job.draft, job.state.table
        start = table.length - fed
        kept, over = job.verify(logits[: len(draft) + 1], draft)
        if draft:
            job.drafter.observe(len(draft), kept)
        table.trim(start + kept + 1)
        return over

    # -- ends ---------------------------------------------------------------------

    def _end(self, ended: list[tuple[Job, BaseException | None]]) -> None:
        """Take turns that ended in a decode step out of the batch: finished (None) or
        failed (their error)."""
        if not ended:
            return
        gone = {job for job, _ in ended}
        self._decoding = [j for j in self._decoding if j not in gone]
        for job, exc in ended:
            if exc is None:
                self._finish(job)
            else:
                self._fail(job, exc)

    def _finish(self, job: Job) -> None:
        try:
            job.record_fed(self.runner.token_text)
            stats = job.finish(self.runner.eos_ids, self.runner.token_text).stats
            self.runner.finish(job, failed=False)
            log.info(  # before close: a caller that waited on the turn finds it logged
                "turn of %s: %s, %d tokens reused, %d prefilled; load %.1f ms, prefill %.1f ms, "
                "first token %.1f ms; %d generated at %.1f tokens/s; %d of %d drafted kept",
                job.agent_id, stats.cache, stats.reused_tokens, stats.prefill_tokens,
                stats.load_ms, stats.prefill_ms, stats.ttft_ms, stats.generated_tokens,
                stats.decode_tps, stats.accepted_draft_tokens, stats.draft_tokens,
            )  # fmt: skip
            job.close()
        except Exception as exc:
            self._fail(job, exc)
        finally:
            self._release(job)

    def _fail(self, job: Job, exc: BaseException) -> None:
        if (refused := gpu_kernels.compile_failure(exc)) is not None:
            # a kernel shape the warm-up did not compile, refused (kernels/gpu.py)
            refusal, exc = exc, AgentKVError(refused)
            exc.__cause__ = refusal
        self.runner.finish(job, failed=True)
        if job in self._prefilling:
            self._prefilling.remove(job)
        job.close(exc)
        self._release(job)

    @staticmethod
    def _release(job: Job) -> None:
        if job.lock is not None:
            job.lock.release()
            job.lock = None
