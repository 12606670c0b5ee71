"""TurnRunner: what the scheduler drives — admitting turns by pool blocks, forward passes
over jagged batches of block tables, and the end of a turn (residency, saving).

The scheduler (``scheduler.py``) decides *when*; this decides *how*, and owns nothing but
references to the model, the pool, residency, resume planning and the writer. Everything
here runs on the scheduler's thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from .. import mlx_adapter
from ..errors import InvalidRequestError
from ..format.geometry import BLOCK_TOKENS, GROUP_TOKENS
from ..kv.cache import window_start
from ..model.load import LoadedModel
from ..pool import KVPool, PoolExhaustedError
from ..pool.step import PagedStep, token_rows
from ..store.agent_store import build_save_job
from ..store.writer import BackgroundWriter
from ..text.tokens import TokenText
from .drafts import DEFAULT_DRAFT_TOKENS, ContextDrafter, room
from .generation import LAST_CHUNK_MAX, SCORES_BUDGET_BYTES
from .job import Job, Phase, Resumed
from .residency import Residency
from .resume import ReloadNeeded, Resumer
from .state import AgentState
from .swapping import Swapper

log = logging.getLogger("agentkv.engine")

RELOAD_ATTEMPTS = 3
# A turn waits for another turn's prefill when that prefill computes at least this many
# tokens of its context that it would otherwise compute itself (``Waits``)
WAIT_FOR_PREFIX = 2 * GROUP_TOKENS
PREFILL_CHUNK = 512
GPU_PREFILL_CHUNK = 2048  # mlx-lm's prefill step too


class Waits(NamedTuple):
    """A turn that waits, unadmitted, for ``job``'s prefill to write the first ``tokens``
    tokens of its own context, then shares those blocks instead of computing them again
    (agents that start at once with the same system prompt compute it once)."""

    job: Job
    tokens: int

    def pending(self) -> bool:
        job = self.job
        return (
            job.phase is Phase.PREFILL
            and not job.done.is_set()
            and job.state.table.length < self.tokens
        )


class TurnRunner:
    def __init__(
        self,
        *,
        loaded: LoadedModel,
        resumer: Resumer,
        eos_ids: frozenset,
        prefill_chunk: int | None,
        agent_lock: Callable[[str], threading.Lock],
        swapper: Swapper | None = None,
        draft_tokens: int = DEFAULT_DRAFT_TOKENS,
    ):
        self.loaded = loaded
        # Drafted steps give one-token steps' bits where every matmul reduces each row alone:
        # agentkv's CPU path. MLX's GPU matmuls take other kernels by row count.
        self.draft_tokens = draft_tokens if mx.default_device() == mx.cpu else 0
        self.swapper = swapper
        self.resumer = resumer
        self.eos_ids = eos_ids
        on_gpu = mx.default_device() != mx.cpu
        # On a GPU prefill chunks run through MLX's fused attention (kernels/dense.py): no
        # scores are materialized, so chunks stay whole as the context grows.
        self.prefill_chunk = prefill_chunk or (GPU_PREFILL_CHUNK if on_gpu else PREFILL_CHUNK)
        self.scores_budget = None if on_gpu else SCORES_BUDGET_BYTES
        self.agent_lock = agent_lock
        # The pool, residency, writer and text the turns' resume planning works on.
        self.pool: KVPool = resumer.pool
        self.residency: Residency = resumer.residency
        self.writer: BackgroundWriter = resumer.writer
        self.token_text: TokenText = resumer.token_text
        self.model = loaded.model
        # a prompt's last chunk: whole where the head projects its last position alone
        self.last_chunk = (
            self.prefill_chunk if mlx_adapter.projects_last_only(self.model) else LAST_CHUNK_MAX
        )
        self.tokenizer = loaded.tokenizer
        self.query_heads = loaded.query_heads
        self.context_limit = loaded.context_limit

    # -- admission --------------------------------------------------------------------------

    def admit(self, job: Job, busy: set[str], prefilling=()) -> Resumed | Waits | None:
        """Plan the turn, make room in the pool and reserve its blocks, then build its
        state; None if the blocks are not there now (the turn waits, nothing changed);
        ``Waits`` if one of the turns ``prefilling`` is computing a long part of its context
        (the turn waits for it, nothing changed)."""
        max_new = job.params.max_tokens
        if self.context_limit is not None:
            max_new = min(max_new, self.context_limit)
        rejected = None  # what a stored file that failed its checks left to say
        # the fleet's look at the store, made before admission (Fleet.prefetch): its note
        checked = False if job.store_check is None else (job.store_check.result() or True)
        for _ in range(RELOAD_ATTEMPTS):
            plan = self.resumer.plan(
                job.agent_id, job.prompt, max_new=max_new, salt=job.salt, checked=checked
            )
            if (waits := _shares_in_flight(plan, prefilling)) is not None:
                plan.cancel()
                return waits
            need = plan.blocks_needed
            if need > self.pool.capacity:
                plan.cancel()
                raise InvalidRequestError(
                    f"this turn needs {need} KV blocks ({need * BLOCK_TOKENS} tokens of context "
                    f"and reply) but the pool holds {self.pool.capacity}; give the engine more "
                    "pool memory (pool_bytes / --pool-memory) or lower max_tokens"
                )
            if not self.residency.reclaim(need, busy=busy, lock_of=self.agent_lock):
                plan.cancel()
                return None
            reservation = self.pool.reserve(need)
            try:
                resumed = plan.apply(reservation)
            except ReloadNeeded as exc:
                reservation.close()
                rejected = str(exc)
                log.warning("agentkv: agent %r: %s; planning its turn again", job.agent_id, exc)
                continue
            except BaseException:
                reservation.close()
                plan.cancel()
                raise
            job.reservation = reservation
            if rejected is not None:
                resumed.note = rejected + (f"; {resumed.note}" if resumed.note else "")
            return resumed
        raise RuntimeError(f"agent {job.agent_id!r}: stored files kept failing their checks")

    # -- forward passes ---------------------------------------------------------------------

    def forward(
        self,
        tables,
        ids: list[list[int]],
        *,
        reservations=None,
        logits: bool | str = True,
        swaps=None,
        before=None,
    ):
        """Feed ``ids`` through the model on these block tables, growing each from its
        reservation; the logits after each row's last token, or None (``logits=False``: a
        prefill chunk that is not the last, whose output projection is then never
        computed), or ``logits="every"``: after each token, one [n, vocab] array a row (a
        drafted step). Rows may feed different numbers of tokens only with ``"every"`` (a
        jagged step: ``pool.step.token_rows``). ``swaps``: each row's KVSwap state or None.
        A row whose reads failed gets NaN logits and its state's ``error`` (``check_swap``),
        and nothing of the step is recorded for it: no token, no block sealed (its turn must
        fail). ``before(tables)``: called once the tables are grown, before the step (a
        streamed prefill evicts its filled blocks there); it returns the swaps, and a
        streamed prefill step is one whose only row is swapped."""
        counts = [len(row) for row in ids]
        jagged = len(set(counts)) > 1
        if jagged and (logits != "every" or before is not None):
            raise ValueError("a jagged step takes every row's logits, and no streamed prefill")
        arena = self.pool.arena
        for table, count, reservation in zip(tables, counts, reservations or [None] * len(ids)):
            table.grow(count, arena.copy_rows, reservation)
        stream = False
        if before is not None:
            swaps = before(tables)
            stream = swaps is not None and counts[0] > 1
        rows, count, feed = tables, counts[0], ids
        if jagged:  # one-token rows; a swapped row feeds one token, as its own table
            rows, count = token_rows(tables, counts, arena.ct), 1
            feed = [[token] for row in ids for token in row]
            if swaps is not None:
                swaps = [x for s, n in zip(swaps, counts) for x in [s, *[None] * (n - 1)]]
        step = PagedStep(arena, self.loaded.spec, rows, count, swaps=swaps, stream=stream)
        last = None
        try:
            if logits == "every":
                last = self.model(mx.array(feed), cache=step.caches)
                mx.eval(last)
                if jagged:
                    last = mx.split(last.reshape(-1, last.shape[-1]), _ends(counts)[:-1])
            elif logits:
                last = mlx_adapter.last_logits(self.model, mx.array(feed), step.caches)
                mx.eval(last)
            else:  # the graph's KV writes run at settle; its logits are never computed
                self.model(mx.array(feed), cache=step.caches)
        except BaseException:
            arena.discard_writes()
            raise
        arena.settle()
        for table, row, swap in zip(tables, ids, _rows_swaps(swaps, counts, jagged)):
            if swap is None or not swap.error:  # a failed row keeps nothing of the step
                table.written(row)
        return last

    # -- the pipelined decode step (a GPU's; scheduler._decode_pipelined) --------------------

    def launch(self, tables, tokens: list, reservations) -> mx.array:
        """A decode step built, not waited for: each row fed one token, an int or an array
        an earlier step is still computing; the rows' logits [B, vocab], unevaluated. A row
        fed an int is recorded now (its write is in the graph); one fed an array is recorded
        by ``written`` once its token is read, or cut by ``fit_table`` if its turn ends
        there. The scheduler never feeds an array to a row whose token completes a channel
        group (a trim inside one would lose exact keys). Raises PoolExhaustedError with every
        table as it was if the pool cannot give a row its block."""
        arena = self.pool.arena
        grown = []
        try:
            for table, reservation in zip(tables, reservations):
                table.grow(1, arena.copy_rows, reservation)
                grown.append(table)
        except PoolExhaustedError:
            for table in grown:
                table.trim(table.length)
            raise
        step = PagedStep(arena, self.loaded.spec, tables, 1, fused=False)
        ids = mx.concatenate(
            [
                mx.array([[t]], dtype=mx.int32)
                if isinstance(t, int)
                else t.reshape(1, 1).astype(mx.int32)
                for t in tokens
            ]
        )
        try:
            logits = mlx_adapter.last_logits(self.model, ids, step.caches)
        except BaseException:
            arena.discard_writes()
            raise
        for table, t in zip(tables, tokens):
            if isinstance(t, int):
                table.written([t])
        return logits

    def run_ahead(self, values: list[mx.array]) -> None:
        """Start computing ``values`` and the step's writes into the arenas: on a GPU without
        waiting (the next step is built meanwhile); on the CPU now (its host I/O writes into
        the arenas in place, so nothing may be left running)."""
        if mx.default_device() == mx.cpu:
            self.pool.arena.settle()
            mx.eval(values)
            return
        arena = self.pool.arena
        mx.async_eval(values, arena.arrays, arena.tails, arena.prevs)

    def prefill(self, job: Job, ids: list[int], logits: bool):
        """One prefill chunk of ``job``'s turn (``forward``'s logits); a turn over the
        KVSwap budget streams: its filled blocks evicted first, its attention reading them
        back (engine/swapping.py). Raises the turn's error if a read failed."""
        state, reservation = job.state, job.reservation
        before = None
        if self.swapper is not None and self.swapper.streaming(state, len(ids)):

            def before(tables):
                self.swapper.evict_filled(state, reservation)
                return [state.swap] if state.swap is not None else None

        out = self.forward(
            [state.table], [ids], reservations=[reservation], logits=logits, before=before
        )
        if self.swapper is not None:
            self.swapper.check(state)
        return out

    def draft_limit(self, job: Job) -> int:
        """The most tokens the decoding ``job``'s next step may feed after its last one
        (engine/drafts.py): 0 with KVSwap or drafts off, else within its channel group and
        its tokens."""
        if self.draft_tokens < 1 or job.state.swap is not None:
            return 0
        return max(
            0,
            min(self.draft_tokens, room(job.state.table), job.max_new - len(job.generated) - 1),
        )

    def draft_for(self, job: Job) -> list[int]:
        """A draft for the decoding ``job``'s next step, [] where it takes none
        (engine/drafts.py): up to ``draft_limit``."""
        limit = self.draft_limit(job)
        if limit < 1:
            return []
        if job.drafter is None:
            job.drafter = ContextDrafter(job.state.tokens, self.draft_tokens)
        return job.drafter.propose(job.generated, limit)

    # -- KVSwap -------------------------------------------------------------------------------

    def start_decode(self, job: Job) -> None:
        """A turn's prefill is done: swap the agent's leading blocks out if it is over the
        engine's KVSwap budget (engine/swapping.py)."""
        if self.swapper is not None and job.state is not None:
            self.swapper.start(job.state, job.reservation)

    def check_swap(self, job: Job) -> None:
        """Raise the agent's error if its KVSwap reads failed in the last step; else evict
        a block it filled (engine/swapping.py)."""
        if self.swapper is not None and job.state is not None:
            self.swapper.check(job.state)
            self.swapper.keep_to_budget(job.state, job.reservation)

    # -- the end of a turn --------------------------------------------------------------------

    def finish(self, job: Job, *, failed: bool) -> None:
        """Put the agent back (hot) and queue its save; a failed turn's agent is dropped
        (its blocks may hold a partial step) and reloads from disk next time."""
        if job.reservation is not None:
            job.reservation.close()
            job.reservation = None
        state: AgentState | None = job.state
        job.state = None  # handled once
        if state is None:
            return
        if failed:
            state.release()
            return
        try:
            state.fit_table()  # the last sampled token was never fed
            self.save(state)
            self._cap_window(state)
        except BaseException:  # e.g. no memory to pack the save: drop it, reload from disk
            state.release()
            raise
        if state.swap is not None:  # saved; its next turn resumes from disk (and the pool)
            state.release()
            return
        self.residency.put(state)

    def save(self, state: AgentState) -> None:
        """Queue the blocks that changed since the last save (packed now: one copy)."""
        if state.size == 0 or state.durable == state.size:
            return
        agent_id = state.agent_id
        if self.writer.take_failure(agent_id) is not None:
            state.saved_blocks = []  # what is on disk is unknown: write every block again
        keep = state.kept_blocks()
        job = build_save_job(
            self.pool.arena,
            state.table,
            agent_id=agent_id,
            keep=keep,
            tokens=state.tokens,
            spans=state.spans,
            text=state.text,
            messages=state.messages,
            evicted=state.swap.records if state.swap is not None else None,
            evicted_files=state.swap.files if state.swap is not None else None,
        )
        job.hold, state.swap_hold = state.swap_hold, None  # released once it is written
        try:
            self.writer.submit(job)
        except BaseException:
            if job.hold is not None:
                job.hold.close()
            raise
        full = state.table.length // BLOCK_TOKENS  # a partial last block is saved as the agent's
        state.saved_blocks = [state.block_hash(i) for i in range(full)]
        state.durable = state.size

    def _cap_window(self, state: AgentState) -> None:
        """Give back the sliding layers' rows no future token sees (never unsaved ones)."""
        if self.pool.window is None:
            return
        upto = min(window_start(state.size, self.pool.window), state.durable) // BLOCK_TOKENS
        state.table.release_window(upto)


def _ends(counts: list[int]) -> list[int]:
    """Where each row's tokens end among a jagged step's."""
    ends, total = [], 0
    for count in counts:
        total += count
        ends.append(total)
    return ends


def _rows_swaps(swaps, counts: list[int], jagged: bool) -> list:
    """Each row's KVSwap state (a jagged step's list has one entry per token)."""
    if swaps is None:
        return [None] * len(counts)
    if not jagged:
        return list(swaps)
    return [swaps[end - count] for end, count in zip(_ends(counts), counts)]


def _shares_in_flight(plan, prefilling: Sequence[Job]) -> Waits | None:
    """The turn among ``prefilling`` whose prefill is still writing the longest run of
    ``plan``'s context past what the plan reuses (at least ``WAIT_FOR_PREFIX`` tokens, under
    the same chain seed, so its blocks are the plan's own bytes), and the context tokens to
    wait for: whole channel groups, short of the context's last token, which the turn
    prefills itself (``pool.sharing.plan_sharing``)."""
    if plan.streams is not None or not prefilling:
        return None  # a turn streaming its context through a few blocks shares nothing
    context = np.asarray(plan.context(), dtype=np.int64)
    cap = (len(context) - 1) // GROUP_TOKENS * GROUP_TOKENS
    reused = plan.reused
    best = None
    for other in prefilling:
        state = other.state
        if other.phase is not Phase.PREFILL or state.swap is not None:
            continue
        if state.table.seed != plan.seed or state.table.length >= cap:
            continue
        theirs = np.asarray(state.tokens + other.resumed.prefill_ids, dtype=np.int64)
        n = min(cap, len(theirs))
        differ = np.flatnonzero(context[:n] != theirs[:n])
        common = (int(differ[0]) if differ.size else n) // GROUP_TOKENS * GROUP_TOKENS
        if common - reused >= WAIT_FOR_PREFIX and state.table.length < common:
            if best is None or common > best.tokens:
                best = Waits(other, common)
    return best
