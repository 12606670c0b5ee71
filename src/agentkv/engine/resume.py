"""Resume planning: where a turn starts from — the agent's own state (memory, then disk),
the longest prefix other agents' blocks give it, and what is left to prefill.

Two steps, so the scheduler can admit turns by pool blocks: ``Resumer.plan`` decides
everything and counts the blocks the turn needs (blocks to read, a tail to copy, growth
for the prompt and the reply) without allocating; ``ResumePlan.apply`` then builds the
agent's state under the turn's reservation. ``ResumePlan.cancel`` puts a hot agent back
untouched when the turn must wait.

The text matcher decides the agent's *own* reuse (``text/matcher.py``); sharing
(``pool/sharing.py``) looks past it. A stored file that fails its checks while a plan is
applied raises ``ReloadNeeded`` after moving the file aside (a bad shared block file
alone, or the agent's whole directory): the scheduler plans the turn again, from what
is left.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..errors import CacheFormatError, InvalidRequestError
from ..format.geometry import BLOCK_TOKENS, blocks_for
from ..format.quant import KVQuant
from ..kv.cache import window_start
from ..pool import KVPool, Reservation
from ..pool.arena import WritePlan
from ..pool.hashing import BACKENDS, bits_identity, chain_seed, private_seed
from ..pool.sharing import SharePlan, Stored, apply_sharing, plan_sharing
from ..pool.tables import exact_keep
from ..store.agent_store import AgentStore, DurableState
from ..store.format import Manifest, is_shared_file, is_variant
from ..store.writer import BackgroundWriter
from ..text.matcher import Match, MatchKind, match_prefix
from ..text.tokens import TokenText
from .job import Resumed
from .residency import Residency
from .state import AgentState

# An agent's blocks are named under the salt its cache was built with; a turn under another
# salt must not continue (or share into) that namespace.
SALT_CHANGED = (
    "this turn's cache_salt differs from the one the agent's cache was built under; "
    "its context is prefilled again"
)


def _exact_of(manifest: Manifest) -> Callable[[int], int]:
    """``BlockTable.exact_keep`` of the table a stored agent loads into."""
    ct = manifest.quant.channel_tokens if manifest.quant.channel_keys else 0
    prev = manifest.prev_group if manifest.prev is not None else None
    return lambda keep: exact_keep(keep, manifest.token_count, ct, prev)


# An agent whose stored bytes are not the ones this engine computes for its tokens keeps
# them as its own (pool.hashing.private_seed); its note says why.
ELSEWHERE_NOTE = (
    "its KV was computed by an earlier agentkv or on another backend: it continues as its "
    "own (its blocks are not shared with other agents)"
)
VARIANT_NOTE = (
    "some of its blocks hold other bytes than the block files of the same tokens: it "
    "continues as its own (its blocks are not shared with other agents)"
)


class ReloadNeeded(Exception):
    """A stored file failed its checks while a plan was applied; plan the turn again."""


@dataclass
class ResumePlan:
    """A turn's starting point, decided but not applied (nothing allocated yet)."""

    agent_id: str
    tier: str  # hot | warm | cold
    match: Match | None
    stored_tokens: int
    note: str | None
    load_ms: float
    seed: bytes
    reuse: int  # own tokens kept
    own_spans: np.ndarray  # their spans
    prefill_ids: list[int]
    prefill_spans: np.ndarray
    prompt: bytes
    hot: AgentState | None = None  # the agent's state, taken out of residency
    manifest: Manifest | None = None
    share: SharePlan | None = None
    blocks_needed: int = 0
    # Pool blocks the plan counts on (shared, copied from, or the agent's own found by hash),
    # held from planning until the plan is applied or cancelled: nothing the turn does before
    # it takes them (releasing a diverged state, reclaiming idle agents) can free or reuse
    # them, and the cached ones among them are out of ``available()`` when it reserves.
    pinned: list[int] = field(default_factory=list)
    resumer: Resumer | None = field(default=None, repr=False)
    nonce: str | None = None  # the agent's bytes are its own (pool.hashing.private_seed)
    # Over the KVSwap budget: the turn streams (engine/swapping.py), holding at most this
    # many pool blocks at once; None: it holds its whole context
    streams: int | None = None

    def context(self) -> list[int]:
        """The turn's context: the own tokens it keeps, then the tokens to prefill."""
        if self.tier == "hot":
            own = self.hot.tokens[: self.reuse]
        elif self.tier == "warm":
            own = self.manifest.tokens[: self.reuse].tolist()
        else:
            own = []
        return own + self.prefill_ids

    @property
    def reused(self) -> int:
        """The context tokens the turn would not prefill: its own kept, and shared ones."""
        return max(self.reuse, self.share.reuse if self.share is not None else 0)

    def cancel(self) -> None:
        """The turn waits: give a hot agent back as it was."""
        self.unpin()
        if self.hot is not None:
            self.resumer.residency.put(self.hot)
            self.hot = None

    def unpin(self) -> None:
        pinned, self.pinned = self.pinned, []
        self.resumer.pool.blocks.release_all(pinned)

    def apply(self, reservation: Reservation) -> Resumed:
        return self.resumer.apply(self, reservation)


def _what_was_reused(plan: ResumePlan, reused: int, shared: int) -> tuple[str, str | None]:
    """The turn's tier as what it reused tells it, and its note: ``cold`` when it reused
    nothing; ``warm`` when any of it was read from disk (its own stored state, or shared
    block files); else ``hot``. A turn whose own state gave nothing, but that found blocks of
    the same prefix by their content, says so."""
    if not reused:
        return "cold", plan.note
    share = plan.share
    read = bool(shared) and any(isinstance(b, Stored) for b in (*share.whole, share.copy_from))
    tier = "warm" if read else "hot" if plan.tier == "cold" else plan.tier
    if plan.tier != "cold":
        return tier, plan.note
    found = f"{shared} tokens from blocks of the same prefix, found by their content"
    return tier, found + (f"; {plan.note}" if plan.note else "")


class Resumer:
    def __init__(
        self,
        *,
        pool: KVPool,
        store: AgentStore,
        writer: BackgroundWriter,
        residency: Residency,
        token_text: TokenText,
        bos_id: int | None,
        min_reuse: int,
        context_limit: int | None,
    ):
        self.pool = pool
        self.store = store
        self.writer = writer
        self.residency = residency
        self.token_text = token_text
        self.bos_id = bos_id
        self.min_reuse = min_reuse
        self.context_limit = context_limit
        self.default_seed = pool.seed()
        self.swapper = None  # KVSwap (engine/swapping.py): turns over its budget stream
        self.fleet = None  # a fleet's object store (engine/fleet.py): checked before each plan

    # -- planning -------------------------------------------------------------------------

    def plan(
        self, agent_id: str, prompt: bytes, *, max_new: int, salt: str | None, checked=False
    ) -> ResumePlan:
        """Match the agent's state (memory, then disk) with ``prompt``; count the blocks.
        Nothing changes if it raises (a hot agent stays hot). A fleet's store is looked at
        first, unless ``checked`` says it was (``Fleet.prefetch``: True, or its note)."""
        if checked is False:
            store_note = self.fleet.check(agent_id) if self.fleet is not None else None
        else:
            store_note = None if checked is True else checked
        held = [self.residency.take(agent_id)]  # emptied once the state is given up
        try:
            plan = self._plan_from(agent_id, prompt, max_new, salt, held)
        except BaseException:
            if held[0] is not None:
                self.residency.put(held[0])
            raise
        if store_note is not None:
            plan.note = store_note + (f"; {plan.note}" if plan.note else "")
        return plan

    def _plan_from(self, agent_id, prompt, max_new, salt, held: list) -> ResumePlan:
        fresh_seed = self.pool.seed(salt) if salt else self.default_seed
        state = held[0]
        if state is not None:
            m = match_prefix(state.text, state.token_ends, state.tokens, prompt, min_reuse=1)
            m = self._exact_or_enough(m, self._exact_from(state.size, state.table.prev_group))
            if m.kind is MatchKind.DIVERGE:
                plan = self._plan(agent_id, "cold", m, state.size, prompt, fresh_seed)
            elif state.table.seed != self._salt_seed(salt, state.table.nonce):
                plan = self._plan(
                    agent_id, "cold", m, state.size, prompt, fresh_seed, note=SALT_CHANGED
                )
            elif self._window_rows_held(state, m.reuse):
                plan = self._plan(
                    agent_id, "hot", m, state.size, prompt, state.table.seed, spans=state.spans,
                    tokens=state.tokens, exact=state.table.exact_keep,
                )  # fmt: skip
            else:  # the sliding layers' rows of its window are gone: read them again
                held[0] = None
                self.residency.put(state)
                self.residency.drop(agent_id)
                return self._count(self._plan_from_disk(agent_id, prompt, salt), max_new)
            plan.hot = state
            plan = self._count(plan, max_new)
            held[0] = None  # the plan holds it now (apply or cancel)
            return plan
        return self._count(self._plan_from_disk(agent_id, prompt, salt), max_new)

    def _window_rows_held(self, state: AgentState, reuse: int) -> bool:
        if self.pool.window is None:
            return True
        first = window_start(reuse, self.pool.window) // BLOCK_TOKENS
        records = self.pool.blocks.records
        return all(records[b].window_rows for b in state.table.blocks[first : blocks_for(reuse)])

    def _plan_from_disk(self, agent_id: str, prompt: bytes, salt: str | None) -> ResumePlan:
        fresh_seed = self.pool.seed(salt) if salt else self.default_seed
        self.writer.flush(agent_id)
        t0 = time.perf_counter()
        try:
            manifest, durable = self.store.read_manifest(agent_id)
        except CacheFormatError as exc:
            moved = self.store.quarantine(agent_id, str(exc))
            self.writer.set_durable(agent_id, DurableState())
            note = self._in_store(f"stored state rejected ({exc.reason}); kept at {moved}")
            return self._plan(agent_id, "cold", None, 0, prompt, fresh_seed, note=note)
        self.writer.set_durable(agent_id, durable)
        if manifest is None:
            others = self.store.other_fingerprints(agent_id)
            note = (
                f"no stored state for this model; the agent has one for another model "
                f"({', '.join(others)}), which this model cannot use"
                if others
                else "a new agent: nothing stored for it yet"
            )
            return self._plan(agent_id, "cold", None, 0, prompt, fresh_seed, note=note)
        stored = manifest.token_count
        load_ms = (time.perf_counter() - t0) * 1000
        convert = manifest.quant != self.pool.quant
        if convert and self.pool.window is not None:
            note = (
                f"stored in the {manifest.quant.label} KV format; this engine keeps "
                f"{self.pool.quant.label}, so the context is prefilled again"
            )
            return self._plan(agent_id, "cold", None, stored, prompt, fresh_seed, note=note)
        m = match_prefix(manifest.text, manifest.spans[:, 1], manifest.tokens, prompt, min_reuse=1)
        prev = manifest.prev_group if manifest.prev is not None else None
        m = self._exact_or_enough(m, self._exact_from(stored, prev, manifest.quant))
        namespace = self._stored_namespace(manifest, salt)
        if namespace is None:
            return self._plan(agent_id, "cold", m, stored, prompt, fresh_seed, note=SALT_CHANGED)
        seed, nonce, own_note = namespace
        if convert:  # its bytes are converted: its own from now on
            nonce = secrets.token_hex(8)
            seed, own_note = self.pool.private_seed(salt, nonce), None
        m = self._readable_prefix(manifest, m)
        if m.kind is MatchKind.DIVERGE or m.reuse == 0:
            plan = self._plan(agent_id, "cold", m, stored, prompt, fresh_seed)
        else:
            plan = self._plan(
                agent_id, "warm", m, stored, prompt, seed, spans=manifest.spans,
                tokens=manifest.tokens, exact=None if convert else _exact_of(manifest),
            )  # fmt: skip
            plan.manifest = manifest
            plan.nonce = nonce
            if own_note is not None:
                plan.note = own_note + (f"; {plan.note}" if plan.note else "")
            if convert:
                plan.note = (
                    f"converted from the stored {manifest.quant.label} KV format to "
                    f"{self.pool.quant.label} (once: it is saved as {self.pool.quant.label})"
                    + (f"; {plan.note}" if plan.note else "")
                )
        plan.load_ms = load_ms
        return plan

    def _salt_seed(self, salt: str | None, nonce: str | None) -> bytes:
        """The chain seed of an agent under ``salt``, private where it has a ``nonce``."""
        if nonce is not None:
            return self.pool.private_seed(salt, nonce)
        return self.pool.seed(salt) if salt else self.default_seed

    def _stored_namespace(self, manifest: Manifest, salt: str | None):
        """Where a stored agent's blocks are named: (seed, nonce, note), or None where it was
        built under another salt. An agent whose bytes were computed elsewhere (an earlier
        agentkv, another backend) is given a private seed of its own (a note says so): its
        bytes stay its own, never taken for the ones this engine computes."""
        fingerprint, kind = self.pool.spec.fingerprint, manifest.quant.identity
        if manifest.chain_seed is None:  # store version 1: no salt, no hashes
            return self._own_namespace(salt)
        stored = bytes.fromhex(manifest.chain_seed)
        if manifest.nonce is not None:  # its own already: under this salt?
            if stored == private_seed(
                chain_seed(fingerprint, kind, salt, self.pool.bits), manifest.nonce
            ):
                return stored, manifest.nonce, None
            salts = [chain_seed(fingerprint, kind, salt, bits_identity(b)) for b in BACKENDS]
            found = any(stored == private_seed(s, manifest.nonce) for s in salts)
            return self._own_namespace(salt) if found else None
        if stored == chain_seed(fingerprint, kind, salt, self.pool.bits):
            if any(is_variant(name) for name in manifest.segments):
                return self._own_namespace(salt, VARIANT_NOTE)
            return stored, None, None
        elsewhere = [chain_seed(fingerprint, kind, salt)] + [
            chain_seed(fingerprint, kind, salt, bits_identity(b)) for b in BACKENDS
        ]
        return self._own_namespace(salt) if stored in elsewhere else None

    def _own_namespace(self, salt: str | None, note: str = ELSEWHERE_NOTE):
        nonce = secrets.token_hex(8)
        return self.pool.private_seed(salt, nonce), nonce, note

    def _exact_from(self, size: int, prev_group: int | None, quant: KVQuant | None = None) -> int:
        """The first token from which a cut of a ``size``-token state keeps its keys as they
        are: KV format 2 quantizes keys per 64-token channel group, and a cut inside a
        quantized group goes back to the group's start and feeds its kept tokens again
        (``BlockTable.exact_keep``), unless the group is the one still filling (float16) or
        the last full one (``prev_group``: its float16 keys are kept)."""
        quant = quant or self.pool.quant
        if not quant.channel_keys:
            return 0  # every token quantized on its own: any cut is exact
        ct = quant.channel_tokens
        exact = size // ct * ct
        return min(exact, prev_group) if prev_group is not None else exact

    def _exact_or_enough(self, m: Match, exact_from: int) -> Match:
        """A partial match is reused where the cut keeps the kept keys as they are, or where
        it keeps at least ``min_reuse`` tokens (worth feeding the cut group's kept tokens
        again); otherwise the turn starts fresh, and the note says why."""
        if m.kind is not MatchKind.PARTIAL or m.reuse >= min(self.min_reuse, exact_from):
            return m
        note = (
            f"text diverged at byte {m.common}: {m.reuse} cached tokens in common, inside a "
            f"channel group already quantized; a partial match is reused from "
            f"{self.min_reuse} tokens (or where its keys are still exact)"
        )
        return Match(MatchKind.DIVERGE, 0, None, 0, m.common, note)

    def _in_store(self, note: str) -> str:
        """``note`` with the cache directory's own paths relative to it (a note reaches the
        HTTP client: it names no server path)."""
        return note.replace(f"{self.store.root}/", "")

    def _readable_prefix(self, manifest: Manifest, m: Match) -> Match:
        """Cut the reuse before the first shared block file that is gone (collected or
        quarantined): what precedes it is still good."""
        if m.kind is MatchKind.DIVERGE:
            return m
        for i, b in enumerate(manifest.blocks[: blocks_for(m.reuse)]):
            if not is_shared_file(b.segment) or self.pool.blocks.lookup(bytes.fromhex(b.hash)):
                continue
            if (self.store.model_dir / b.segment).exists():
                continue
            keep = i * BLOCK_TOKENS
            note = f"stored block {i} is missing; resumed from token {keep}"
            if keep == 0:
                return Match(MatchKind.DIVERGE, 0, None, 0, m.common, note)
            resume = int(manifest.spans[keep - 1, 1])
            return Match(MatchKind.PARTIAL, keep, None, resume, m.common, note)
        return m

    def _plan(
        self,
        agent_id: str,
        tier: str,
        m: Match | None,
        stored: int,
        prompt: bytes,
        seed: bytes,
        *,
        spans: np.ndarray | None = None,
        note: str | None = None,
        tokens=None,
        exact: Callable[[int], int] | None = None,
    ) -> ResumePlan:
        """Tokenize what the own state does not cover (with the refeed and BOS rules).
        ``exact``: how many of the kept tokens keep exact keys (``BlockTable.exact_keep``):
        the others are fed again, from the own ``tokens`` and ``spans``."""
        reusing = tier != "cold" and m is not None
        reuse = m.reuse if reusing else 0
        resume = m.resume_at if reusing else 0
        encoded = self.token_text.encode(prompt[resume:].decode("utf-8"))
        ids, new_spans = list(encoded.ids), encoded.spans + resume
        if reusing and m.refeed is not None:
            ids.insert(0, m.refeed)
            new_spans = np.concatenate([np.asarray(spans[m.reuse], np.int64)[None], new_spans])
        elif reuse == 0 and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids.insert(0, self.bos_id)
            new_spans = np.concatenate([np.zeros((1, 2), dtype=np.int64), new_spans])
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        if reusing and exact is not None and (kept := exact(reuse)) < reuse:
            ids = [int(t) for t in tokens[kept:reuse]] + ids
            new_spans = np.concatenate([np.asarray(spans[kept:reuse], np.int64), new_spans])
            reuse = kept
        total = reuse + len(ids)
        if self.context_limit is not None and total >= self.context_limit:
            raise InvalidRequestError(
                f"the conversation is {total} tokens; this model's context is "
                f"{self.context_limit} tokens (including the reply)"
            )
        if (
            note is None
            and m is not None
            and m.kind is not MatchKind.EXTEND
            and (reusing or stored)
        ):
            note = m.note
        own_spans = spans[:reuse].astype(np.int64) if reusing else np.zeros((0, 2), np.int64)
        plan = ResumePlan(
            agent_id, tier, m, stored, note, 0.0, seed, reuse, own_spans, ids, new_spans, prompt
        )
        plan.resumer = self
        return plan

    def _count(self, plan: ResumePlan, max_new: int) -> ResumePlan:
        """Find what sharing adds past the own reuse, and count the blocks the turn takes."""
        context = plan.context()
        if self.swapper is not None:
            plan.streams = self.swapper.bounded_blocks(len(context) + max_new)
        if plan.streams is not None:  # it holds a few blocks at a time: read, never shared
            plan.share = None
            plan.blocks_needed = plan.streams
            self._pin(plan)
            return plan
        plan.share = plan_sharing(self.pool, self.store, plan.seed, context, own=plan.reuse)
        reused = plan.share.reuse if plan.share is not None else plan.reuse
        reads = 0
        if plan.manifest is not None:
            kept = blocks_for(plan.reuse)
            if plan.share is not None:
                kept = min(kept, plan.share.first_block)
            if plan.manifest.quant != self.pool.quant:
                reads = kept
            else:
                reads = sum(1 for b in plan.manifest.blocks[:kept] if not self._in_pool(b.hash))
        taken = plan.share.blocks_to_take if plan.share is not None else 0
        growth = blocks_for(len(context) + max_new) - blocks_for(reused) + 1  # +1: a copied tail
        plan.blocks_needed = reads + taken + growth
        self._pin(plan)
        return plan

    def _pin(self, plan: ResumePlan) -> None:
        pool = self.pool.blocks
        pins = []
        if plan.share is not None:
            pins += [b for b in (*plan.share.whole, plan.share.copy_from) if isinstance(b, int)]
        if plan.manifest is not None and plan.manifest.quant == self.pool.quant:
            for stored in plan.manifest.blocks[: blocks_for(plan.reuse)]:
                held = pool.lookup(bytes.fromhex(stored.hash)) if stored.hash else None
                if held is not None:
                    pins.append(held)
        for block in pins:
            pool.acquire(block)
        plan.pinned = pins

    def _in_pool(self, digest: str | None) -> bool:
        """Whether the pool holds a stored block ready to adopt (with its sliding rows)."""
        held = self.pool.blocks.lookup(bytes.fromhex(digest)) if digest is not None else None
        return held is not None and self._has_window_rows(held)

    def _has_window_rows(self, block: int) -> bool:
        return self.pool.window is None or self.pool.blocks.records[block].window_rows

    # -- applying ---------------------------------------------------------------------------

    def apply(self, plan: ResumePlan, reservation: Reservation) -> Resumed:
        """Build the agent's state as planned, reading and sharing under ``reservation``. If
        it raises, the blocks it took are back in the pool (the agent resumes from disk)."""
        taken = []
        try:
            return self._apply(plan, reservation, taken)
        except BaseException:
            for state in taken:
                state.release()
            raise
        finally:
            plan.unpin()  # what the state took, it holds by its own references

    def _apply(self, plan: ResumePlan, reservation: Reservation, taken: list) -> Resumed:
        if plan.tier == "hot":
            state, plan.hot = plan.hot, None
            taken.append(state)
            state.trim(plan.reuse)
            if self.pool.window is not None:
                first = window_start(plan.reuse, self.pool.window) // BLOCK_TOKENS
                if not state.table.rehold_window(first):  # handed back since the plan
                    raise ReloadNeeded("the sliding rows of its window are gone; reloading it")
        else:
            if plan.hot is not None:  # its text diverged: the old state goes
                plan.hot.release()
                plan.hot = None
            table = self.pool.new_table(plan.seed, nonce=plan.nonce)
            state = AgentState(plan.agent_id, self.pool.quant, table)
            taken.append(state)
            if plan.tier == "warm" and plan.manifest.quant != self.pool.quant:
                self._convert_own(plan, state, reservation)
            elif plan.tier == "warm" and plan.streams is not None:
                self._stream_own(plan, state, reservation)
            elif plan.tier == "warm":
                self._read_own(plan, state, reservation)
        shared = 0
        if plan.share is not None and plan.share.reuse > state.size:
            before = state.size
            context = state.tokens + plan.prefill_ids
            try:
                apply_sharing(self.pool, self.store, state.table, plan.share, reservation)
            except CacheFormatError as exc:
                raise ReloadNeeded(self._reject_file(plan.agent_id, exc)) from None
            shared = state.table.length - before
            spans = plan.prefill_spans[:shared]
            state.append(
                context[before : before + shared],
                spans,
                plan.prompt[len(state.text) : int(spans[-1, 1])],
            )
            plan.prefill_ids = plan.prefill_ids[shared:]
            plan.prefill_spans = plan.prefill_spans[shared:]
        tier, note = _what_was_reused(plan, state.size, shared)
        return Resumed(
            state,
            tier,
            plan.match.kind.value if plan.match is not None else "none",
            plan.stored_tokens,
            plan.prefill_ids,
            plan.prefill_spans,
            note,
            plan.load_ms,
            state.size,
            shared_tokens=shared,
        )

    def _read_own(self, plan: ResumePlan, state: AgentState, reservation: Reservation) -> None:
        """Warm: take the agent's blocks the pool already holds (by hash), read the others."""
        t0 = time.perf_counter()
        manifest, reuse = plan.manifest, plan.reuse
        count = blocks_for(reuse)
        if plan.share is not None:
            count = min(count, plan.share.first_block + 1)
        pool = self.pool.blocks
        table = state.table
        sources = self.store.block_sources(manifest, plan.agent_id, count)
        held = [pool.lookup(s.hash) if s.hash is not None else None for s in sources]
        for block in held:  # pinned before any allocation can evict them
            if block is not None:
                pool.acquire(block)
        reads = []
        try:
            for i, (src, block) in enumerate(zip(sources, held)):
                ids = manifest.tokens[i * BLOCK_TOKENS : i * BLOCK_TOKENS + src.tokens].tolist()
                if (
                    block is not None
                    and pool.records[block].tokens == ids
                    and self._has_window_rows(block)  # else read: sealing restores its rows
                ):
                    table.adopt(block)
                    continue
                fresh = pool.allocate(reserved=reservation.take())
                table.attach(fresh, ids)
                reads.append((src, fresh))
            self.store.read_into(self.pool.arena, plan.agent_id, reads)
        except CacheFormatError as exc:
            raise ReloadNeeded(self._reject_file(plan.agent_id, exc)) from None
        finally:
            for block in held:
                if block is not None:
                    pool.release(block)
        table.seal_full()
        self._own_state(plan, state)
        plan.load_ms += (time.perf_counter() - t0) * 1000

    def _stream_own(self, plan: ResumePlan, state: AgentState, reservation: Reservation) -> None:
        """Warm, over the KVSwap budget: the agent's blocks read one after another (from the
        pool where it holds them), each evicted as the next comes in, so the turn holds a few
        blocks whatever its context (engine/swapping.py)."""
        t0 = time.perf_counter()
        manifest, reuse = plan.manifest, plan.reuse
        pool = self.pool.blocks
        table = state.table
        sources = self.store.block_sources(manifest, plan.agent_id, blocks_for(reuse))
        try:
            for i, src in enumerate(sources):
                ids = manifest.tokens[i * BLOCK_TOKENS : i * BLOCK_TOKENS + src.tokens].tolist()
                held = pool.lookup(src.hash) if src.hash is not None else None
                if held is not None and pool.records[held].tokens == ids:
                    table.adopt(held)
                else:
                    fresh = pool.allocate(reserved=reservation.take())
                    table.attach(fresh, ids)
                    self.store.read_into(self.pool.arena, plan.agent_id, [(src, fresh)])
                    table.seal_full()
                self.swapper.evict_filled(state, reservation)
        except CacheFormatError as exc:
            raise ReloadNeeded(self._reject_file(plan.agent_id, exc)) from None
        self._own_state(plan, state)
        plan.load_ms += (time.perf_counter() - t0) * 1000

    def _own_state(self, plan: ResumePlan, state: AgentState) -> None:
        """The read agent's tail, last group's keys and text, cut to the plan's reuse."""
        manifest, reuse, table = plan.manifest, plan.reuse, state.table
        if manifest.tail is not None:  # KV format 2: the keys of the group still filling
            self.pool.arena.write_tail(table.take_tail(), manifest.tail)
            if manifest.prev is not None:  # and the last full group's, as computed
                self.pool.arena.write_prev(table.tail, manifest.prev)
                table.prev_group = manifest.prev_group
        table.trim(reuse)
        state.tokens = manifest.tokens[:reuse].tolist()
        state.spans = plan.own_spans
        state.text = manifest.text[: int(manifest.spans[reuse - 1, 1])]
        state.durable = reuse
        state.messages = manifest.messages
        state.saved_blocks = [
            bytes.fromhex(b.hash) if b.hash else None
            for b in manifest.blocks[: reuse // BLOCK_TOKENS]
        ]

    def _convert_own(self, plan: ResumePlan, state: AgentState, reservation: Reservation) -> None:
        """Warm, from another KV format: read the stored blocks, dequantize them and store
        them in this engine's KV format (once; the next save writes the new one)."""
        t0 = time.perf_counter()
        manifest, reuse = plan.manifest, plan.reuse
        try:
            caches = self.store.load_caches(manifest, plan.agent_id, reuse)
        except CacheFormatError as exc:
            raise ReloadNeeded(self._reject_file(plan.agent_id, exc)) from None
        arena = self.pool.arena
        table = state.table
        table.grow(reuse, arena.copy_rows, reservation)
        plan_rows = WritePlan(arena, [table], [0], reuse)
        for layer, cache in enumerate(caches):
            k, v = cache.dequantized()
            arena.append(layer, k, v, plan_rows)
        arena.settle()
        table.written(manifest.tokens[:reuse].tolist())
        state.tokens = manifest.tokens[:reuse].tolist()
        state.spans = plan.own_spans
        state.text = manifest.text[: int(manifest.spans[reuse - 1, 1])]
        state.messages = manifest.messages
        state.durable = 0  # saved again, in this engine's KV format
        plan.load_ms += (time.perf_counter() - t0) * 1000

    def _reject_file(self, agent_id: str, exc: CacheFormatError) -> str:
        """Move the file at fault aside: a shared block file alone (agents naming it resume
        from the blocks before it), else the agent's whole directory. Returns the note."""
        model_dir = str(self.store.model_dir)
        path = str(exc.path)
        name = path[len(model_dir) + 1 :] if path.startswith(model_dir + "/") else path
        if is_shared_file(name):
            moved = self.store.shared.quarantine(name, exc.reason)
        else:
            moved = self.store.quarantine(agent_id, str(exc))
            self.writer.set_durable(agent_id, DurableState())
        return self._in_store(f"stored state rejected ({exc.reason}); kept at {moved}")
