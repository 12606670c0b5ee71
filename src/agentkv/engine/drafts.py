"""Drafts from the context: a turn decoding alone checks several tokens a step.

Agents' replies copy their context: a tool's output quoted back, a file's lines, the tag that
opened the agent's earlier replies. When one turn decodes alone, the scheduler looks up the
reply's last few tokens earlier in the agent's context (its prompt and what it has
generated), takes the tokens that followed their latest occurrence as a draft, and feeds the
turn's last token and the draft in one forward pass. The draft is kept up to the first
position that samples another token, plus the token sampled there (greedy: the argmax; at a
temperature, the turn's sampler, whose draws kept while they equal the draft are speculative
sampling for a draft of one fixed token a position: ``SamplingParams.draft_sampler``); the
rows of the draft tokens not kept are cut from the agent's table.

Greedy, the tokens are those of decoding one step at a time, bit for bit (at a temperature,
their distribution is): agentkv's matmuls reduce each row alone, a query's attention does not
depend on the chunk it arrives in, and each position is sampled as a step would sample it (a
grammar advanced by the tokens before it).
One thing would differ: a cut inside a channel group whose keys were already quantized puts
them back dequantized (``BlockTable.trim``). So a drafted step never completes a channel group
(nor a block): ``room`` bounds the draft to the group the step starts in.

Where it runs and where not: on the CPU (on a GPU MLX's matmuls take other kernels by row
count), one decoding turn (a batch's rows would need drafts of one length), no KVSwap.
``Engine(draft_tokens=0)`` turns it off.
"""

from __future__ import annotations

import numpy as np

from ..format.geometry import BLOCK_TOKENS

DEFAULT_DRAFT_TOKENS = 8
MAX_DRAFT = 30  # a step's draft stays inside one channel group (32 or 64 tokens): at most 30
LONGEST_MATCH = 3  # the most trailing tokens looked up; then fewer, down to one
FIRST_DRAFT = 4  # a turn's first draft; then sized by how its drafts fared
MAX_PAUSE = 15  # the most steps drafting pauses after drafts that kept nothing
ACCEPT_MEMORY = 0.7  # how much a turn's acceptance keeps of each earlier step's drafts
ACCEPT_PRIOR = (1.5, 2.0)  # a turn's acceptance before its drafts are seen: 3 kept in 4


class ContextDrafter:
    """One turn's drafts from its agent's context (the prompt, then the reply), sized by how
    its drafts fared: a step's extra rows cost (measured on the 2-core Xeon: ~4 ms each
    against ~16 ms for a one-token step), so a draft kept whole doubles the next one, a draft
    cut short sizes the next to what was kept plus one, and drafts that keep nothing pause
    drafting for 1, 3, 7, 15 steps in a row."""

    def __init__(self, prompt: list[int], most: int):
        self._context = np.asarray(prompt, dtype=np.int64)  # room for the reply grows in it
        self._length = len(prompt)  # the context's tokens so far: the prompt, then the reply
        self._prompt = len(prompt)
        self.most = most
        self.size = min(FIRST_DRAFT, most)
        self._pause = 0
        self._misses = 0
        self.drafted = 0  # draft tokens fed this turn, and those kept (TurnStats)
        self.kept = 0
        self._hits = 0.0  # draft tokens kept, and tried (fed after kept ones), recent first
        self._tries = 0.0

    def propose(self, generated: list[int], limit: int) -> list[int]:
        """Up to ``limit`` (and this turn's current size) tokens that followed the latest
        earlier occurrence (it may overlap them) of the context's last ``LONGEST_MATCH``
        tokens (or fewer, down to one); [] where none, or while drafting pauses.
        ``generated`` is the turn's reply so far: it only grows from call to call. One pass
        over the context a step: the last token's earlier places, then the longer matches
        among them."""
        if self._pause:
            self._pause -= 1
            return []
        limit = min(limit, self.size)
        if limit < 1 or not generated:
            return []
        context = self._extend(generated)
        ends = np.flatnonzero(context[:-1] == context[-1])  # where the last token was before
        for n in range(min(LONGEST_MATCH, len(context) - 1), 1, -1):
            ends_n = ends[ends >= n - 1]
            match = np.ones(len(ends_n), dtype=bool)
            for back in range(1, n):
                match &= context[ends_n - back] == context[-1 - back]
            if match.any():
                ends = ends_n[match]
                break
        if not ends.size:
            return []
        start = int(ends[-1]) + 1
        return context[start : start + limit].tolist()

    def _extend(self, generated: list[int]) -> np.ndarray:
        """The context: the prompt, then ``generated`` (which only grows within a turn)."""
        length = self._prompt + len(generated)
        if length > len(self._context):
            grown = np.empty(max(length, 2 * len(self._context), 64), dtype=np.int64)
            grown[: self._length] = self._context[: self._length]
            self._context = grown
        new = generated[self._length - self._prompt :]
        self._context[self._length : length] = new
        self._length = length
        return self._context[:length]

    def observe(self, drafted: int, kept: int) -> None:
        """How a step's draft of ``drafted`` tokens fared: ``kept`` of them matched."""
        self.drafted += drafted
        self.kept += kept
        self._hits = ACCEPT_MEMORY * self._hits + kept
        self._tries = ACCEPT_MEMORY * self._tries + min(kept + 1, drafted)
        if kept == drafted:
            self.size = min(self.size * 2, self.most)
        else:
            self.size = max(1, kept + 1)
        if kept:
            self._misses = 0
        else:
            self._misses += 1
            self._pause = min(2**self._misses - 1, MAX_PAUSE)

    @property
    def acceptance(self) -> float:
        """The chance that the next draft token is kept, given the tokens before it were: of
        this turn's draft tokens so far, (kept + 1.5) / (tried + 2) (``ACCEPT_PRIOR``: hopeful,
        so that a turn's first drafts are tried in a big batch too, where a draft token must
        be likely to be worth its cost), each step's counts weighing ``ACCEPT_MEMORY`` times
        the next's; a draft token is tried if those before it were kept. The planner
        (engine/planner.py) weighs a draft's i-th token as this ** i."""
        kept, tried = ACCEPT_PRIOR
        return (self._hits + kept) / (self._tries + tried)


def room(table) -> int:
    """The most draft tokens a step on ``table`` may feed after the turn's last token without
    completing a channel group (or, without quantized groups, a block)."""
    unit = table.tails.ct if table.tails is not None else BLOCK_TOKENS
    return unit - table.length % unit - 2
