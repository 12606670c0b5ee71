"""The step planner: which decoding turns a decode step runs, and how much of each one's
draft it feeds.

Every decode step feeds a decoding turn's last token and, where the turn's drafter has one,
a draft of the tokens it may take next (engine/drafts.py). A step's time grows with the
tokens it feeds, by less than a token alone costs: the weights are read once a step whatever
it feeds (2-core Xeon VM, 1K context: one token ~25 ms, each more ~3 ms). A draft token pays
where it is kept often enough; in a batch, where the step already feeds many tokens and
another costs what any does, less often than alone.

``StepCosts`` is a step's time as a line in the tokens fed, fitted to the one-turn steps the
scheduler timed (its draft checked as one row of ``1 + k`` queries). A step of several turns
(a jagged batch: every token its own row, ``pool.step.token_rows``, so each draft token reads
the whole context again) costs that line plus a measured extra a token (``BatchCosts``); so
does an even step of several (every row ``w`` tokens, one row of ``w`` queries reading its
context once, as alone), with its own extra. A draft's i-th token is kept with probability
``a ** i``, ``a`` the turn's acceptance so far (``ContextDrafter.acceptance``).

Each step takes the plan with the most expected tokens per second (``Planner.plan``):

* *batch*: every turn a row, draft tokens taken likeliest first while each raises the step's
  expected tokens per second (``plan_step``; under a cost line that is the best choice of
  draft prefixes, and every turn's own token is worth its cost);
* *even*: every turn a row of ``w`` tokens, for each width ``w`` the turns may feed: its
  last token, its draft up to ``w - 1`` tokens, then copies never kept (padding, cut from
  its table after the step as a draft token not kept is);
* *alone*: the one turn with the best expected rate, feeding its whole draft, the others
  waiting a step, which is what serving them one after another does at best.

So under the measured costs a step is never slower than the same turns one after another
(each alone with its whole draft): that is one of the plans it compares. A batch's extra
cost is only measured by batch steps: after ``EXPLORE`` steps without one the planner runs
a batch step, so it follows the machine's load and the turns' contexts. A turn
decoding alone feeds its drafter's draft whole: the drafter's own sizing (docs/drafts.md)
is what was measured for one turn.

Greedy turns get the same tokens whatever the plan, sampled ones the same distribution
(docs/drafts.md): a plan changes only which rows a step checks and how many tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import NamedTuple

EXPLORE = 16  # the most steps of several waiting turns run alone in a row (module docstring)


class Plan(Enum):
    ONE = "one"  # one turn, one token
    DRAFT = "draft"  # one turn with a draft
    BATCH = "batch"  # several turns, one token each
    BOTH = "both"  # several turns, drafts among them


def plan_of(counts: Sequence[int]) -> Plan:
    """The plan of a step whose rows feed ``counts`` tokens."""
    drafted = sum(counts) > len(counts)
    if len(counts) == 1:
        return Plan.DRAFT if drafted else Plan.ONE
    return Plan.BOTH if drafted else Plan.BATCH


class StepCosts:
    """A decode step's seconds as a line in the tokens it feeds, ``base + per_token * n``,
    fitted by weighted least squares to the steps timed so far: each step weighs ``memory``
    times the one after it, so the line follows the machine's load and the turns' contexts.
    Two steps of the prior line, at 1 and 9 tokens, weigh ``prior_weight`` each for good:
    the line is defined before steps of different sizes have been timed."""

    def __init__(
        self,
        base: float = 0.012,
        per_token: float = 0.003,
        *,
        memory: float = 0.97,
        prior_weight: float = 0.5,
    ):
        self.memory = memory
        self._sums = [0.0] * 5  # weight, w n, w n^2, w t, w n t of the timed steps
        self._prior = [0.0] * 5
        for n in (1, 9):
            _add(self._prior, n, base + per_token * n, prior_weight)
        self._line = (base, per_token)

    def record(self, tokens: int, seconds: float) -> None:
        """One step timed: ``tokens`` fed in ``seconds``."""
        self._sums = [self.memory * s for s in self._sums]
        _add(self._sums, tokens, seconds, 1.0)
        w, wn, wnn, wt, wnt = (a + b for a, b in zip(self._sums, self._prior))
        det = w * wnn - wn * wn
        per_token = (w * wnt - wn * wt) / det if det > 0 else self._line[1]
        per_token = max(per_token, 1e-6)  # more tokens never cost less
        base = max((wt - per_token * wn) / w, 0.0)
        self._line = (base, per_token)

    @property
    def base(self) -> float:
        return self._line[0]

    @property
    def per_token(self) -> float:
        return self._line[1]

    def seconds(self, tokens: int) -> float:
        return self._line[0] + self._line[1] * tokens


class BatchCosts:
    """A several-turn step's seconds: the one-turn line ``alone`` plus ``extra`` a token,
    ``extra`` the weighted mean, per token fed, of what the batch steps timed took beyond
    ``alone`` (each step weighing ``memory`` times the one after it). One number, so it is
    known from batch steps that all feed as many tokens (a batch that drafts nothing), where
    a line of its own could not tell its base from its slope."""

    def __init__(self, alone: StepCosts, *, memory: float = 0.97):
        self.alone = alone
        self.memory = memory
        self._tokens = 0.0  # weighted tokens fed, and seconds beyond ``alone``, of the steps
        self._beyond = 0.0

    def record(self, tokens: int, seconds: float) -> None:
        self._tokens = self.memory * self._tokens + tokens
        self._beyond = self.memory * self._beyond + seconds - self.alone.seconds(tokens)

    @property
    def extra(self) -> float:
        return self._beyond / self._tokens if self._tokens else 0.0

    @property
    def base(self) -> float:
        return self.alone.base

    @property
    def per_token(self) -> float:
        return max(self.alone.per_token + self.extra, 1e-6)  # more tokens never cost less

    def seconds(self, tokens: int) -> float:
        return self.base + self.per_token * tokens


def _add(sums: list[float], n: int, t: float, w: float) -> None:
    for i, value in enumerate((w, w * n, w * n * n, w * t, w * n * t)):
        sums[i] += value


def plan_step(drafts: Sequence[int], acceptance: Sequence[float], costs) -> list[int]:
    """How many of each row's ``drafts[r]`` draft tokens to feed, each row's kept with
    ``acceptance[r]`` (its i-th token with ``acceptance[r] ** i``), for the most expected
    tokens per second under ``costs`` (``seconds(tokens fed)``). One row feeds its draft
    whole (module docstring)."""
    if len(drafts) == 1:
        return list(drafts)
    candidates = sorted(
        ((a**i, r) for r, (n, a) in enumerate(zip(drafts, acceptance)) for i in range(1, n + 1)),
        key=lambda c: -c[0],
    )
    take = [0] * len(drafts)
    fed = len(drafts)
    expected = float(fed)  # every row's own token is kept
    for gain, r in candidates:  # a row's tokens come in order: a ** i falls with i
        if (expected + gain) * costs.seconds(fed) <= expected * costs.seconds(fed + 1):
            break  # no less likely token raises the rate either
        expected += gain
        fed += 1
        take[r] += 1
    return take


def expected_tokens(takes: Sequence[int], acceptance: Sequence[float]) -> float:
    """The tokens a step feeding ``takes[r]`` draft tokens a row is expected to keep."""
    return sum(1 + sum(a**i for i in range(1, k + 1)) for k, a in zip(takes, acceptance))


class StepPlan(NamedTuple):
    """A decode step's plan: each turn's draft tokens fed (None: the turn waits this step),
    and ``width``: 0, each stepping row feeds its last token and its draft tokens (a jagged
    step where they differ); else every stepping row feeds ``width`` tokens, its draft
    followed by tokens that are never kept (an even step: each row one row of ``width``
    queries, its keys and values read once, as alone)."""

    takes: list[int | None]
    width: int = 0


class Planner:
    """Which turns step and how much of each draft they feed (module docstring), from the
    timed costs of one-turn steps (``alone``), of jagged steps of several (``batch``) and of
    even ones (``even``)."""

    def __init__(self):
        self.alone = StepCosts()
        self.batch = BatchCosts(self.alone)
        self.even = BatchCosts(self.alone)
        self._alone_steps = 0  # steps since the last batch step while several turns decoded

    def plan(
        self,
        drafts: Sequence[int],
        acceptance: Sequence[float],
        limits: Sequence[int] | None = None,
    ) -> StepPlan:
        """How many of each turn's ``drafts[r]`` tokens its row feeds this step, and whether
        rows are padded to one width; ``limits[r]``: the most tokens after its last one
        turn ``r`` may feed (its draft's bounds: channel group, tokens left; default its
        draft)."""
        n = len(drafts)
        if n == 1:
            return StepPlan(list(drafts))
        limits = list(drafts) if limits is None else list(limits)
        takes = plan_step(drafts, acceptance, self.batch)
        fed = n + sum(takes)
        options = [(expected_tokens(takes, acceptance) / self.batch.seconds(fed), 0, takes)]
        for width in range(1, min(limits) + 2):  # each row: its token, draft, padding
            even = [min(width - 1, d) for d in drafts]
            rate = expected_tokens(even, acceptance) / self.even.seconds(n * width)
            options.append((rate, width, even))
        batch_rate, width, takes = max(options, key=lambda o: o[0])
        if self._alone_steps >= EXPLORE:
            self._alone_steps = 0
            return StepPlan(takes, width)
        rates = [
            expected_tokens([d], [a]) / self.alone.seconds(1 + d)
            for d, a in zip(drafts, acceptance)
        ]
        best = max(range(n), key=rates.__getitem__)
        if rates[best] <= batch_rate:
            self._alone_steps = 0
            return StepPlan(takes, width)
        self._alone_steps += 1
        return StepPlan([drafts[r] if r == best else None for r in range(n)])

    def record(self, counts: Sequence[int], seconds: float) -> None:
        """A step timed: its rows fed ``counts`` tokens in ``seconds``."""
        line = self.alone if len(counts) == 1 else self.batch
        if len(counts) > 1 and len(set(counts)) == 1:
            line = self.even
        line.record(sum(counts), seconds)
