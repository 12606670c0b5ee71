"""A jagged step's rows as one-token rows (``pool.step.token_rows``): a row of ``n`` tokens
after ``start`` is ``n`` rows over its own blocks, of lengths ``start + 1`` .. ``start + n``;
no row of several tokens may complete a channel group. (That each token then gets the bits it
gets alone is checked on the real model: tests/engine/test_drafts.py.)"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from agentkv.pool.step import TokenRow, token_rows


@dataclass
class Table:  # what a step reads of a BlockTable, grown by the step's tokens
    length: int
    blocks: list[int] = field(default_factory=lambda: [3, 7])
    tail: int | None = 2
    prev_group: int | None = None


def test_each_token_is_a_row_over_its_table_read_up_to_it():
    one, three = Table(length=40), Table(length=10, blocks=[5], tail=4, prev_group=0)
    rows = token_rows([one, three], [1, 3], ct=32)
    assert rows[0] is one  # a one-token row is its table itself
    assert [type(r) for r in rows[1:]] == [TokenRow] * 3
    assert [r.length for r in rows[1:]] == [10, 11, 12]  # the step adds a token to each
    assert all(r.blocks is three.blocks and r.tail == 4 and r.prev_group == 0 for r in rows[1:])


@pytest.mark.parametrize("length, count, ct", [(29, 2, 32), (58, 5, 64), (250, 7, 0)])
def test_a_row_of_several_tokens_stays_inside_its_channel_group(length, count, ct):
    rows = token_rows([Table(length=length)], [count], ct=ct)
    assert [r.length for r in rows] == list(range(length, length + count))


@pytest.mark.parametrize("length, count, ct", [(30, 2, 32), (60, 4, 64), (0, 33, 32)])
def test_a_row_that_would_complete_a_group_is_refused(length, count, ct):
    with pytest.raises(ValueError, match="channel group"):
        token_rows([Table(length=length)], [count], ct=ct)
