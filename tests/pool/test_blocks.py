"""The pool's records and block tables under random operation sequences (hypothesis):
every invariant of BlockPool and BlockTable holds after every step, and every table
holds exactly the tokens it was given."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from agentkv.format.geometry import BLOCK_TOKENS, blocks_for
from agentkv.pool import BlockPool, BlockTable, PoolExhaustedError
from agentkv.pool.hashing import block_hash, chain, chain_seed

SEED = chain_seed("fingerprint", "q4")
OTHER_SEED = chain_seed("fingerprint", "q4", "tenant-b")


class Copies:
    """Stands in for the arena: records the copies a table asks for."""

    def __init__(self):
        self.calls = []

    def __call__(self, src: int, dst: int, tokens: int) -> None:
        self.calls.append((src, dst, tokens))


class PoolMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.freed, self.window_freed = [], []
        self.pool = BlockPool(
            12, on_free=self.freed.append, on_window_free=self.window_freed.append
        )
        self.tables: list[BlockTable] = []
        self.expected: list[list[int]] = []
        self.copies = Copies()
        self.window = None

    # Tokens from a tiny vocabulary with long shared runs, so prefixes repeat across tables.
    tokens = st.lists(st.sampled_from([1, 2, 3]), min_size=1, max_size=3).map(
        lambda pattern: (pattern * (2 * BLOCK_TOKENS))[: 2 * BLOCK_TOKENS]
    )

    @rule(salted=st.booleans(), windowed=st.booleans())
    def new_table(self, salted, windowed):
        window = 300 if windowed else None
        self.tables.append(BlockTable(self.pool, OTHER_SEED if salted else SEED, window=window))
        self.expected.append([])

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), ids=tokens, count=st.integers(1, 2 * BLOCK_TOKENS))
    def append(self, data, ids, count):
        i = data.draw(st.integers(0, len(self.tables) - 1))
        table, ids = self.tables[i], ids[:count]
        try:
            table.grow(len(ids), self.copies)
        except PoolExhaustedError:
            assert len(table.blocks) == blocks_for(table.length)  # unchanged
            return
        table.written(ids)
        self.expected[i] += ids

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def share_prefix(self, data):
        """A new table takes every complete block of another's prefix found by hash."""
        i = data.draw(st.integers(0, len(self.tables) - 1))
        source = self.expected[i]
        table = BlockTable(self.pool, self.tables[i].seed, window=self.tables[i].window)
        for digest, start in zip(chain(table.seed, source), range(0, len(source), BLOCK_TOKENS)):
            block = self.pool.lookup(digest)
            if (
                block is None
                or self.pool.records[block].tokens != source[start : start + BLOCK_TOKENS]
            ):
                break
            table.adopt(block)
        self.tables.append(table)
        self.expected.append(source[: table.length])

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def fork(self, data):
        i = data.draw(st.integers(0, len(self.tables) - 1))
        self.tables.append(self.tables[i].fork())
        self.expected.append(list(self.expected[i]))

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def trim(self, data):
        i = data.draw(st.integers(0, len(self.tables) - 1))
        keep = data.draw(st.integers(0, self.tables[i].length))
        self.tables[i].trim(keep)
        del self.expected[i][keep:]

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def release(self, data):
        i = data.draw(st.integers(0, len(self.tables) - 1))
        self.tables.pop(i).release()
        self.expected.pop(i)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def window_passes(self, data):
        i = data.draw(st.integers(0, len(self.tables) - 1))
        table = self.tables[i]
        if table.window is not None:
            table.release_window(max(0, table.length - table.window) // BLOCK_TOKENS)

    @rule(blocks=st.integers(0, 4))
    def reserve_and_return(self, blocks):
        try:
            self.pool.reserve(blocks)
        except PoolExhaustedError:
            assert blocks > self.pool.available()
            return
        self.pool.unreserve(blocks)

    @invariant()
    def records_are_consistent(self):
        self.pool.check()

    @invariant()
    def refs_count_table_entries(self):
        held = [0] * self.pool.capacity
        window = [0] * self.pool.capacity
        for table in self.tables:
            for index, block in enumerate(table.blocks):
                held[block] += 1
                if table.window is not None and index >= table.window_from:
                    window[block] += 1
        assert [r.refs for r in self.pool.records] == held
        assert [r.window_holders for r in self.pool.records] == window

    @invariant()
    def tables_hold_their_tokens(self):
        for table, ids in zip(self.tables, self.expected):
            assert table.length == len(ids)
            assert len(table.blocks) == blocks_for(table.length)
            assert table.token_ids()[: table.length] == ids
            hashes = chain(table.seed, ids)
            for index, block in enumerate(table.blocks[: len(hashes)]):
                record = self.pool.records[block]
                if record.hash is not None:  # sealed: certifies everything before it
                    assert record.hash == hashes[index]

    @invariant()
    def freed_blocks_are_free(self):
        if self.freed:
            assert self.pool.state(self.freed[-1]).value in ("free", "in use", "cached")


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_sealing_the_same_tokens_twice_keeps_one_block():
    pool = BlockPool(4)
    a, b = BlockTable(pool, SEED), BlockTable(pool, SEED)
    ids = list(range(BLOCK_TOKENS))
    for table in (a, b):
        table.grow(BLOCK_TOKENS, Copies())
        table.written(ids)
    assert a.blocks == b.blocks and pool.records[a.blocks[0]].refs == 2
    assert pool.free_count == 3  # the second copy went back at once
    assert pool.records[a.blocks[0]].hash == block_hash(SEED, ids)


def test_a_shared_tail_is_copied_before_it_is_written():
    pool = BlockPool(4)
    copies = Copies()
    a = BlockTable(pool, SEED)
    a.grow(100, copies)
    a.written(list(range(100)))
    b = a.fork()
    b.grow(1, copies)
    b.written([7])
    assert copies.calls == [(a.blocks[0], b.blocks[0], 100)]
    assert a.token_ids() == list(range(100)) and b.token_ids() == list(range(100)) + [7]


def test_a_tail_trimmed_while_shared_is_cut_before_its_last_holder_writes():
    """(Found by the state machine.) A trim keeps a shared tail's tokens; once the other
    table lets go, the trimmed one writes into it, after the tokens it kept."""
    pool = BlockPool(4)
    copies = Copies()
    a = BlockTable(pool, SEED)
    a.grow(2, copies)
    a.written([2, 2])
    b = a.fork()
    a.trim(1)  # shared: the block keeps both tokens
    b.release()
    a.grow(1, copies)
    a.written([1])
    assert a.token_ids() == [2, 1] and copies.calls == []  # its own now: no copy


def test_a_salt_keeps_prefixes_apart():
    pool = BlockPool(4)
    ids = [5] * BLOCK_TOKENS
    a, b = BlockTable(pool, SEED), BlockTable(pool, OTHER_SEED)
    for table in (a, b):
        table.grow(BLOCK_TOKENS, Copies())
        table.written(ids)
    assert a.blocks != b.blocks  # same tokens, different tenants: never shared


def test_exhaustion_is_reported_and_changes_nothing():
    pool = BlockPool(2)
    table = BlockTable(pool, SEED)
    with pytest.raises(PoolExhaustedError):
        table.grow(3 * BLOCK_TOKENS, Copies())
    assert table.blocks == [] and pool.free_count == 2
    pool.reserve(2)
    with pytest.raises(PoolExhaustedError):
        pool.allocate()
