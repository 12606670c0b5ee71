"""Decide how much of an agent's cached state fits a new prompt, by text.

BPE is not compositional: "Hello wor" + "ld" re-tokenizes differently from
"Hello wor" alone, so comparing token ids throws valid caches away. agentkv
compares the agent's cached text with the new prompt byte for byte, keeps
every cached token whose span ends inside the common prefix (and on a
character boundary of the prompt, so the rest decodes), and tokenizes only
the remaining text.

Outcomes:

* ``exact``   the prompt is the cached text: reuse all but the last token and
  feed that token again, since its logits are needed to sample.
* ``extend``  the prompt continues the cached text: reuse every token.
* ``partial`` they share a prefix of at least ``min_reuse`` tokens: trim to it.
* ``diverge`` too little in common: start from nothing.
"""

from __future__ import annotations

from bisect import bisect_right
from enum import Enum
from typing import NamedTuple

import numpy as np

DEFAULT_MIN_REUSE = 256  # one block


class MatchKind(str, Enum):
    EXACT = "exact"
    EXTEND = "extend"
    PARTIAL = "partial"
    DIVERGE = "diverge"


class Match(NamedTuple):
    """What to keep of a cache for a new prompt.

    ``reuse`` cached tokens stay; then ``refeed`` (the id of cached token
    ``reuse``, or None) is fed again; then the prompt's bytes from ``resume_at``
    are tokenized and prefilled. ``common`` is the common prefix in bytes.
    """

    kind: MatchKind
    reuse: int
    refeed: int | None
    resume_at: int
    common: int
    note: str | None


def common_prefix(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = np.frombuffer(a, dtype=np.uint8, count=n)
    y = np.frombuffer(b, dtype=np.uint8, count=n)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n


def _is_char_boundary(text: bytes, pos: int) -> bool:
    return pos == 0 or pos >= len(text) or (text[pos] & 0xC0) != 0x80


def match_prefix(
    cached: bytes,
    token_ends: list[int] | np.ndarray,
    token_ids: list[int] | np.ndarray,
    prompt: bytes,
    *,
    min_reuse: int = DEFAULT_MIN_REUSE,
) -> Match:
    """Match ``prompt`` against ``cached`` text whose tokens end at ``token_ends``."""
    n = len(token_ends)
    common = common_prefix(cached, prompt)
    ends = [int(e) for e in token_ends]
    keep = bisect_right(ends, common)
    while keep > 0 and not _is_char_boundary(prompt, ends[keep - 1]):
        keep -= 1
    resume = ends[keep - 1] if keep else 0

    if n == 0:
        return Match(MatchKind.DIVERGE, 0, None, 0, common, "no cached tokens")
    whole_cache = common == len(cached) and keep == n
    if keep < min_reuse and not whole_cache:
        note = f"text diverged at byte {common} of {len(cached)}: " + (
            f"only {keep} of {n} cached tokens in common (partial reuse starts at {min_reuse})"
            if keep
            else "no cached token in common"
        )
        return Match(MatchKind.DIVERGE, 0, None, 0, common, note)

    refeed = None
    if resume == len(prompt):
        # Nothing left to prefill: feed the last kept token again for its logits.
        keep -= 1
        refeed = int(token_ids[keep])
        resume = ends[keep]
    if whole_cache and common == len(prompt):
        return Match(
            MatchKind.EXACT,
            keep,
            refeed,
            resume,
            common,
            "exact match: the last cached token is fed again for its logits",
        )
    if whole_cache:
        return Match(MatchKind.EXTEND, keep, refeed, resume, common, None)
    dropped = n - keep - (refeed is not None)
    note = f"text diverged at byte {common} of {len(cached)}: {dropped} cached tokens dropped"
    if refeed is not None:
        note += "; the last kept token is fed again for its logits"
    return Match(MatchKind.PARTIAL, keep, refeed, resume, common, note)
