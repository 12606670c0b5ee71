"""Sampling parameters, prefill chunks and stop strings.

Prefill runs in chunks with ``mx.eval`` of the cache between them, so the
attention scores of one chunk over the whole context are the largest thing
alive at a time. Chunk sizes depend only on (tokens, context), so a turn
resumed from disk runs exactly the same computation as the same turn in a
process that never stopped. The final chunk is kept short (<= 64 tokens):
its logits are computed for every position, and only the last one is needed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

from ..errors import InvalidRequestError
from ..model.generation_config import MAX_TEMPERATURE

MAX_TOKENS_LIMIT = 1 << 20
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs
# The sampling bounds every API checks against (the server's APIs import these):
# temperature in [0, MAX_TEMPERATURE] (OpenAI's range; defined beside the models' own
# defaults, which it bounds too), top_p in (0, 1].
# The longest last chunk of a prompt whose model projects every position of the chunk onto
# the vocabulary (``mlx_adapter.projects_last_only`` false): the logits of the last alone
# are used, so a short last chunk bounds that waste. Others take their last chunk whole.
LAST_CHUNK_MAX = 64
SCORES_BUDGET_BYTES = 256 << 20


@dataclass(frozen=True)
class SamplingParams:
    """How to generate: validated once, then read by the decode loop."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    # None: no log-probs; n >= 0: each generated token's, with the n likeliest others
    logprobs: int | None = None

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or not 1 <= self.max_tokens <= MAX_TOKENS_LIMIT:
            raise InvalidRequestError(f"max_tokens must be an integer in [1, {MAX_TOKENS_LIMIT}]")
        check_sampling(self.temperature, self.top_p)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty strings")
        n = self.logprobs
        if n is not None and (
            isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_TOP_LOGPROBS
        ):
            raise InvalidRequestError(
                f"logprobs must be None or an integer in [0, {MAX_TOP_LOGPROBS}] (how many of "
                "the likeliest tokens to list beside each generated one)"
            )

    @classmethod
    def create(
        cls, max_tokens=256, temperature=0.0, top_p=1.0, stop=None, logprobs=None
    ) -> SamplingParams:
        if isinstance(stop, str):
            stop = (stop,)
        return cls(max_tokens, float(temperature), float(top_p), tuple(stop or ()), logprobs)

    def sampler(self) -> Callable[[mx.array], mx.array]:
        if self.temperature == 0.0:
            return lambda logits: mx.argmax(logits, axis=-1)
        from ..mlx_adapter import make_sampler

        sample = make_sampler(temp=self.temperature, top_p=self.top_p)
        return lambda logits: sample(logits - mx.logsumexp(logits, axis=-1, keepdims=True))

    def draft_sampler(self) -> Callable[[mx.array, int], mx.array]:
        """``sampler`` for a position whose draft token is ``wanted`` (engine/drafts.py): the
        sampler itself. The draft is one fixed token a position, so speculative sampling's
        rule (keep ``wanted`` with its probability p, else draw from the other tokens
        renormalized) gives exactly what drawing from the sampler and keeping the draft while
        the draws equal it gives: ``wanted`` with probability p, any other token t with
        p(t). So a drafted position is drawn as a one-token step draws (mlx-lm's sampler: the
        same distribution; the same draws for the same random state), in one evaluation."""
        sample = self.sampler()
        return lambda logits, wanted: sample(logits)


def check_sampling(temperature: float, top_p: float) -> None:
    """Raise ``InvalidRequestError`` unless temperature and top_p are within the bounds."""
    if not 0.0 <= float(temperature) <= MAX_TEMPERATURE:
        raise InvalidRequestError(f"temperature must be between 0 and {MAX_TEMPERATURE:g}")
    if not 0.0 < float(top_p) <= 1.0:
        raise InvalidRequestError("top_p must be in (0, 1]")


def plan_chunks(
    n: int,
    offset: int,
    *,
    max_chunk: int,
    query_heads: int,
    last_max: int = LAST_CHUNK_MAX,
    budget: int | None = SCORES_BUDGET_BYTES,
) -> list[int]:
    """Chunk sizes for prefilling ``n`` tokens after ``offset`` cached ones: each at most
    ``max_chunk`` and within the scores ``budget`` at its context (None: no budget), the last
    at most ``last_max`` (``LAST_CHUNK_MAX`` up to ``max_chunk``) and at least half of
    ``LAST_CHUNK_MAX`` unless the prompt is shorter."""

    def fits(context: int) -> int:
        if budget is None:
            return max_chunk
        return budget // max(1, query_heads * 4 * context)

    last_max = max(LAST_CHUNK_MAX, min(last_max, max_chunk, fits(offset + n)))
    sizes = []
    pos = 0
    while n - pos > last_max:
        chunk = max(LAST_CHUNK_MAX, min(max_chunk, fits(offset + pos + max_chunk)))
        chunk = min(chunk, n - pos - LAST_CHUNK_MAX // 2)
        sizes.append(chunk)
        pos += chunk
    if n - pos:
        sizes.append(n - pos)
    return sizes


def cache_arrays(caches) -> list[mx.array]:
    return [x for c in caches for x in c.components]


@dataclass
class StopScanner:
    """Finds stop strings in streamed text and holds back what could start one."""

    stops: tuple[str, ...]
    text: str = ""
    emitted: int = 0
    stopped: bool = field(default=False)
    matched: str | None = None  # the stop string found, once stopped

    def feed(self, piece: str) -> str:
        """Add generated text; return what is now safe to show."""
        if self.stopped:
            return ""
        search_from = max(0, len(self.text) - max((len(s) for s in self.stops), default=0))
        self.text += piece
        hits = [(i, s) for s in self.stops if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            at, self.matched = min(hits)
            self.text = self.text[:at]
            self.stopped = True
            return self._take(len(self.text))
        hold = max((len(s) - 1 for s in self.stops), default=0)
        return self._take(max(self.emitted, len(self.text) - hold))

    def flush(self) -> str:
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        out = self.text[self.emitted : upto]
        self.emitted = max(self.emitted, upto)
        return out


def prefill_chunk(model, caches, ids: list[int], *, last: bool) -> mx.array | None:
    """Feed one chunk into ``caches``; the logits after it if it is the prompt's last."""
    out = model(mx.array([ids]), cache=caches)
    if last:
        logits = out[:, -1, :]
        mx.eval(logits, cache_arrays(caches))
        return logits
    mx.eval(cache_arrays(caches))
    return None
