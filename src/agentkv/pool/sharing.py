"""Prefix sharing: the longest prefix of a turn's context that other agents' blocks hold.

The context (the agent's own kept tokens + the new prompt's ids) is hashed block by block
from the agent's chain seed. Past the agent's own reuse, each complete block is taken from
the pool index by hash, else read from a block file another agent stored (a hit by hash
is always confirmed by comparing the 256 token ids). At the first block neither has, the
pool blocks that follow the same prefix — complete, or another agent's tail still
filling — are compared token by token, and the longest common run, rounded down to
``GROUP_TOKENS``, is copied into a private block. Either way the agent gets the very bytes
it would have computed: the bytes a block stores are a function of its tokens and those
before it (docs/kv-format-v2.md), and the chain seed names the arithmetic that computed
them (``pool.hashing``). At least one token is left to prefill (its logits are sampled).

Only identical token prefixes are ever shared: a block is reached only through the chain
of hashes of everything before it, and every token of it is compared.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from ..format.geometry import BLOCK_TOKENS, GROUP_TOKENS
from .hashing import chain


class Stored(NamedTuple):
    """A block file to read (a ``BlockSource``) and the token ids it holds."""

    source: object
    ids: list[int]


@dataclass
class SharePlan:
    """Blocks ``first_block``, ``first_block + 1``... from ``whole`` (a pool block id, or a
    ``Stored`` block file), then ``copy_tokens`` tokens copied from ``copy_from``."""

    first_block: int  # the agent's own blocks before it stay as they are
    whole: list[int | Stored] = field(default_factory=list)
    copy_from: int | Stored | None = None
    copy_tokens: int = 0
    reuse: int = 0  # context tokens reused in all

    @property
    def blocks_to_take(self) -> int:
        """Fresh pool blocks applying the plan allocates."""
        reads = sum(isinstance(w, Stored) for w in self.whole)
        return reads + isinstance(self.copy_from, Stored) + (self.copy_tokens > 0)


def plan_sharing(pool, store, seed: bytes, context: list[int], *, own: int) -> SharePlan | None:
    """How much of ``context`` the pool (or the block files on disk) gives past the ``own``
    tokens the agent keeps; None if nothing beyond them."""
    cap = (len(context) - 1) // GROUP_TOKENS * GROUP_TOKENS  # leave a token to prefill
    if cap <= own:
        return None
    records = pool.blocks.records
    first = own // BLOCK_TOKENS
    hashes = chain(seed, context[: (cap // BLOCK_TOKENS + 1) * BLOCK_TOKENS])
    plan = SharePlan(first_block=first)

    def ids_of(i: int) -> list[int]:
        return context[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS]

    def find(i: int) -> int | Stored | None:
        """Complete block ``i`` of the context, from the pool or a block file."""
        if i >= len(hashes):
            return None
        held = pool.blocks.lookup(hashes[i])
        if held is not None and records[held].tokens == ids_of(i) and _usable(pool, held):
            return held
        found = store.find_shared(hashes[i]) if store is not None else None
        if found is not None and list(found[1]) == ids_of(i):
            return Stored(found[0], ids_of(i))
        return None

    index = first
    while (index + 1) * BLOCK_TOKENS <= cap and (hit := find(index)) is not None:
        plan.whole.append(hit)
        index += 1
    rest = context[index * BLOCK_TOKENS : cap]
    if rest:
        parent = seed if index == 0 else hashes[index - 1]
        best, source = 0, None
        for candidate in pool.blocks.candidates(parent):
            common = _common_run(records[candidate].tokens, rest)
            if common > best and _usable(pool, candidate):
                best, source = common, candidate
        if best < len(rest) and (hit := find(index)) is not None:
            best, source = len(rest), hit
        plan.copy_tokens = best // GROUP_TOKENS * GROUP_TOKENS
        plan.copy_from = source if plan.copy_tokens else None
    plan.reuse = index * BLOCK_TOKENS + plan.copy_tokens
    return plan if plan.reuse > own else None


def _usable(pool, block: int) -> bool:
    """A block whose sliding-window rows are gone cannot seed another agent's window."""
    return pool.window is None or pool.blocks.records[block].window_rows


def _common_run(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def apply_sharing(pool, store, table, plan: SharePlan, reservation) -> None:
    """Extend ``table`` (holding its own blocks before ``plan.first_block``) as planned."""
    blocks = pool.blocks
    pinned = [b for b in (*plan.whole, plan.copy_from) if isinstance(b, int)]
    for block in pinned:  # held before anything is allocated, so none is evicted meanwhile
        blocks.acquire(block)
    try:
        _apply(pool, store, table, plan, reservation)
    finally:
        for block in pinned:
            blocks.release(block)


def _apply(pool, store, table, plan: SharePlan, reservation) -> None:
    blocks = pool.blocks
    table.trim(plan.first_block * BLOCK_TOKENS)
    for whole in plan.whole:
        block = whole
        if isinstance(whole, Stored):
            block = read_block(pool, store, table.parent_of(len(table.blocks)), whole, reservation)
        table.adopt(block)
        if isinstance(whole, Stored):
            blocks.release(block)  # the table holds it now
    if not plan.copy_tokens:
        return
    source = plan.copy_from
    if isinstance(source, Stored):
        source = read_block(pool, store, table.parent_of(len(table.blocks)), source, reservation)
    fresh = blocks.allocate(reserved=reservation.take())
    pool.arena.copy_rows(source, fresh, plan.copy_tokens)
    blocks.set_parent(fresh, table.parent_of(len(table.blocks)))
    blocks.append_tokens(fresh, blocks.records[source].tokens[: plan.copy_tokens])
    table.blocks.append(fresh)
    table.length += plan.copy_tokens
    if table.window is not None:
        blocks.hold_window(fresh)
    if isinstance(plan.copy_from, Stored):
        blocks.release(source)  # stays cached: findable by the next agent


def read_block(pool, store, parent: bytes, stored: Stored, reservation) -> int:
    """Read a complete block file into a fresh block sealed under ``parent`` (refs 1)."""
    blocks = pool.blocks
    block = blocks.allocate(reserved=reservation.take())
    try:
        store.read_into(pool.arena, None, [(stored.source, block)])
    except Exception:
        blocks.release(block)
        raise
    blocks.set_parent(block, parent)
    blocks.append_tokens(block, stored.ids)
    return blocks.seal(block)
