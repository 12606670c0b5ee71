"""The step planner (engine/planner.py): how much of each row's draft a decode step feeds,
chosen from the measured step cost, so that a batch is never slower than its turns one
after another. Checked on the plan choice (expected tokens per second under a cost line),
not on timings."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.engine.planner import (
    EXPLORE,
    Plan,
    Planner,
    StepCosts,
    expected_tokens,
    plan_of,
    plan_step,
)


class Line:
    """A step cost line without fitting: ``base + per_token * tokens`` seconds."""

    def __init__(self, base: float, per_token: float):
        self.base, self.per_token = base, per_token

    def seconds(self, tokens: int) -> float:
        return self.base + self.per_token * tokens


def rate(takes, acceptance, costs) -> float:
    """Expected tokens per second of one step feeding ``takes[r]`` draft tokens a row."""
    return expected_tokens(takes, acceptance) / costs.seconds(len(takes) + sum(takes))


def sequential_rate(drafts, acceptance, costs) -> float:
    """The same turns one after another: each alone, feeding its whole draft."""
    tokens = sum(expected_tokens([d], [a]) for d, a in zip(drafts, acceptance))
    return tokens / sum(costs.seconds(1 + d) for d in drafts)


rows = st.lists(st.tuples(st.integers(0, 8), st.floats(0.0, 1.0)), min_size=1, max_size=16).map(
    lambda r: ([d for d, _ in r], [a for _, a in r])
)
lines = st.tuples(st.floats(0.001, 0.05), st.floats(0.0002, 0.01)).map(lambda c: Line(*c))


@settings(max_examples=300, deadline=None)
@given(rows, lines)
def test_a_batch_step_is_never_slower_than_its_turns_one_after_another(turns, costs):
    drafts, acceptance = turns
    takes = plan_step(drafts, acceptance, costs)
    assert all(0 <= t <= d for t, d in zip(takes, drafts))
    ours = rate(takes, acceptance, costs)
    assert ours >= sequential_rate(drafts, acceptance, costs) * (1 - 1e-9)
    if len(drafts) == 1:
        return  # one turn feeds its drafter's draft whole (the drafter sizes it)
    # nor slower than feeding every draft whole, or none
    assert ours >= rate(drafts, acceptance, costs) * (1 - 1e-9)
    assert ours >= rate([0] * len(drafts), acceptance, costs) * (1 - 1e-9)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 4), st.floats(0.0, 1.0)), min_size=2, max_size=3),
    lines,
)
def test_the_plan_is_the_best_of_every_choice_of_draft_prefixes(turns, costs):
    drafts, acceptance = [d for d, _ in turns], [a for _, a in turns]
    best = max(
        rate(list(takes), acceptance, costs)
        for takes in itertools.product(*(range(d + 1) for d in drafts))
    )
    assert rate(plan_step(drafts, acceptance, costs), acceptance, costs) >= best * (1 - 1e-9)


def test_drafts_shrink_as_the_batch_grows_and_as_they_fare_worse():
    costs = Line(0.012, 0.003)
    alone = plan_step([8], [0.3], costs)
    assert alone == [8]  # one turn feeds its drafter's draft whole (the drafter sizes it)
    pair = plan_step([8, 8], [0.9, 0.6], costs)
    assert pair[0] > pair[1] > 0  # the likelier draft goes further
    many = plan_step([8] * 16, [0.9] * 16, costs)
    assert sum(many) < sum(plan_step([8, 8], [0.9, 0.9], costs)) * 8  # less a row in a crowd
    assert plan_step([8] * 16, [0.3] * 16, costs) == [0] * 16  # a full batch drafts no guesses
    # a step that costs nothing more a token takes every draft token with a chance
    assert plan_step([5, 3], [0.5, 0.01], Line(0.02, 1e-9)) == [5, 3]


def test_plans_name_the_steps_by_what_their_rows_feed():
    assert plan_of([1]) is Plan.ONE
    assert plan_of([4]) is Plan.DRAFT
    assert plan_of([1, 1, 1]) is Plan.BATCH
    assert plan_of([1, 3, 1]) is Plan.BOTH


@pytest.mark.parametrize("base,per_token", [(0.010, 0.002), (0.030, 0.0005), (0.004, 0.006)])
def test_step_costs_follow_the_steps_timed(base, per_token):
    costs = StepCosts()
    for _ in range(300):
        for tokens in (1, 3, 6, 12):
            costs.record(tokens, base + per_token * tokens)
    for tokens in (1, 6, 12):  # the prior's two steps weigh a little for good
        assert costs.seconds(tokens) == pytest.approx(base + per_token * tokens, rel=0.05)
    # a machine that slows down is followed
    for _ in range(300):
        for tokens in (1, 5):
            costs.record(tokens, 2 * (base + per_token * tokens))
    assert costs.seconds(5) == pytest.approx(2 * (base + per_token * 5), rel=0.1)


def test_step_costs_start_from_their_prior_and_never_price_a_token_below_zero():
    costs = StepCosts(base=0.012, per_token=0.003)
    assert costs.seconds(1) == pytest.approx(0.015)
    for _ in range(50):
        costs.record(4, 0.02)  # one size only: the prior keeps the slope defined
    assert costs.per_token > 0
    for _ in range(200):  # bigger steps timed faster (noise): a token still costs something
        costs.record(1, 0.05)
        costs.record(9, 0.01)
    assert costs.per_token > 0 and costs.base >= 0


def plan_rate(plan, acceptance, planner) -> float:
    """Expected tokens per second of a ``Planner.plan`` under the planner's own lines."""
    rows = [(t, a) for t, a in zip(plan.takes, acceptance) if t is not None]
    takes, accepted = [t for t, _ in rows], [a for _, a in rows]
    if len(rows) == 1:
        seconds = planner.alone.seconds(1 + takes[0])
    elif plan.width:
        assert all(t <= plan.width - 1 for t in takes)
        seconds = planner.even.seconds(len(rows) * plan.width)
    else:
        seconds = planner.batch.seconds(len(takes) + sum(takes))
    return expected_tokens(takes, accepted) / seconds


def planner_of(alone, batch, even=None) -> Planner:
    planner = Planner()
    planner.alone, planner.batch = Line(*alone), Line(*batch)
    planner.even = Line(*(even or batch))
    return planner


@settings(max_examples=300, deadline=None)
@given(rows, lines, lines, lines)
def test_a_step_is_never_slower_than_its_turns_one_after_another(turns, alone, batch, even):
    """With one-turn steps, jagged batch steps (a draft token a row of its own, reading the
    whole context again) and even ones costed apart, the plan is the fastest of a jagged
    batch, an even batch of each width and the best turn alone: never below the turns one
    after another under the one-turn line, nor below any of those batches."""
    drafts, acceptance = turns
    planner = planner_of(*((c.base, c.per_token) for c in (alone, batch, even)))
    plan = planner.plan(drafts, acceptance)
    assert len(plan.takes) == len(drafts)
    stepping = [(r, t) for r, t in enumerate(plan.takes) if t is not None]
    assert len(stepping) in (1, len(drafts))
    assert all(t <= drafts[r] for r, t in stepping)
    if len(stepping) == 1:  # alone: its whole draft
        ((r, take),) = stepping
        assert take == drafts[r] and plan.width == 0
    ours = plan_rate(plan, acceptance, planner)
    assert ours >= sequential_rate(drafts, acceptance, planner.alone) * (1 - 1e-9)
    if len(drafts) == 1:
        return  # one turn: its drafter's draft, whole
    jagged = plan_step(drafts, acceptance, planner.batch)
    assert ours >= rate(jagged, acceptance, planner.batch) * (1 - 1e-9)
    for width in range(1, min(drafts) + 2):
        padded = [min(width - 1, d) for d in drafts]
        seconds = planner.even.seconds(len(drafts) * width)
        assert ours >= expected_tokens(padded, acceptance) / seconds * (1 - 1e-9)


def test_drafting_turns_run_alone_when_a_batch_prices_draft_tokens_high():
    """2-core Xeon shapes: one turn's step 22 ms + 3 ms a token; a batch's tokens 6 ms (a
    long context read again by each). Drafts kept 9 in 10: a step runs the likeliest turn
    alone with its whole draft; turns that draft nothing run as a batch, as do drafting
    turns where a batch's tokens cost what they cost alone."""
    planner = planner_of((0.022, 0.003), (0.022, 0.006))
    assert planner.plan([8, 8], [0.9, 0.95]).takes == [None, 8]
    assert planner.plan([0, 0, 0], [0.0, 0.0, 0.0]).takes == [0, 0, 0]
    cheap = planner_of((0.022, 0.003), (0.022, 0.003))
    both = cheap.plan([8, 8], [0.9, 0.95]).takes
    assert None not in both and sum(both) > 0


def test_rows_with_alike_drafts_run_even_when_jagged_rows_cost_more():
    """A jagged step's draft tokens each read the context again (3.5 ms a token), an even
    step's rows read it once (2.5 ms, as alone): turns with long likely drafts feed them
    padded to one width; a turn with a short draft is padded with tokens never kept."""
    planner = planner_of((0.022, 0.0025), (0.022, 0.0035), (0.022, 0.0025))
    plan = planner.plan([8, 8], [0.95, 0.95])
    assert plan.width > 1 and plan.takes == [plan.width - 1] * 2
    plan = planner.plan([8, 5], [0.95, 0.95], [8, 8])
    assert plan.width > 1 and plan.takes == [min(plan.width - 1, d) for d in (8, 5)]
    # no wider than the turns may feed (a channel group, the tokens left)
    assert planner.plan([8, 8], [0.95, 0.95], [8, 3]).width <= 4


def test_a_batch_step_comes_back_to_measure_the_batch_line():
    planner = planner_of((0.022, 0.003), (0.022, 0.006))
    plans = [planner.plan([8, 8], [0.9, 0.95]) for _ in range(2 * (EXPLORE + 1))]
    batches = [i for i, p in enumerate(plans) if None not in p.takes]
    assert batches == [EXPLORE, 2 * EXPLORE + 1]  # one in EXPLORE + 1


def test_steps_are_timed_on_the_line_of_their_kind():
    """One-turn steps fit the line; jagged and even batch steps their extra a token, known
    even where every batch step fed as many tokens (a batch that drafts nothing): the trap a
    line of its own fell in, any slope fitting steps of one size."""
    planner = Planner()
    for _ in range(200):
        planner.record([9], 0.022 + 0.003 * 9)
        planner.record([1], 0.025)
        planner.record([1, 3], 0.022 + 0.004 * 4)  # a jagged token costs 1 ms more
        planner.record([1, 1, 1, 1], 0.022 + 0.0035 * 4)  # an even one 0.5 ms more
    assert planner.alone.seconds(9) == pytest.approx(0.049, rel=0.05)
    assert planner.batch.per_token == pytest.approx(0.004, rel=0.05)
    assert planner.even.per_token == pytest.approx(0.0035, rel=0.05)
    assert planner.batch.seconds(12) == pytest.approx(0.022 + 0.004 * 12, rel=0.05)
    # so a batch of turns whose drafts are kept 9 in 10 still drafts
    assert sum(plan_step([8] * 4, [0.9] * 4, planner.batch)) > 0
