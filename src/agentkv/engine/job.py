"""Job: one chat turn on its way through the scheduler.

A job owns its agent for the whole turn (the agent's lock), resumes the
agent's state, prefills the new text chunk by chunk, then takes a row in a
decode batch until it stops. Every generated token but the last is fed to the
model, so when the job ends the agent's caches hold the prompt and all the
reply except its final token, and the agent's text is exactly what they hold.

A cancelled job (its caller went away) saves no reply: the agent keeps the
part of the prompt already prefilled (a valid prefix of the conversation, so
a retry does not redo it) and drops every generated token.

A constrained job (``grammar``, see ``constraints.py``) masks its own row of logits before
sampling and stops when its grammar is complete; other rows of the same batch are untouched.

A job reports to an optional ``listener(event, value)``, called on the
scheduler's thread: ``("start", Resumed)`` once the agent's state is found,
``("piece", str)`` for each piece of text, ``("end", None)`` when it is over
(then ``result`` or ``error`` is set).
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from enum import Enum

import mlx.core as mx
import numpy as np

from .generation import (
    LAST_CHUNK_MAX,
    SCORES_BUDGET_BYTES,
    SamplingParams,
    StopScanner,
    plan_chunks,
)
from .results import ChatResult, TokenLogprob, TurnStats

DONE = object()  # the end of a job's piece stream


@dataclass
class Resumed:
    """Where a turn starts from: the agent's state after matching, and how it got there."""

    state: object  # AgentState
    tier: str  # hot | warm | cold
    match: str
    stored_tokens: int
    prefill_ids: list[int]
    prefill_spans: np.ndarray
    note: str | None
    load_ms: float
    reused_tokens: int = 0  # the state's size once matched and shared
    shared_tokens: int = 0  # of those, taken from other agents' blocks

    @property
    def prompt_tokens(self) -> int:
        return self.reused_tokens + len(self.prefill_ids)


class Phase(Enum):
    PENDING = "pending"
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


class Job:
    def __init__(
        self,
        agent_id: str,
        prompt: bytes,
        params: SamplingParams,
        messages: list | None,
        *,
        stream: bool,
        listener=None,
        grammar=None,
    ):
        self.agent_id = agent_id
        self.prompt = prompt
        self.params = params
        self.messages = messages
        self.submitted = time.perf_counter()
        self.phase = Phase.PENDING
        self.pieces: queue.SimpleQueue | None = queue.SimpleQueue() if stream else None
        self.listener = listener
        self.grammar = grammar  # a TokenGrammar for a constrained turn, else None
        self.salt: str | None = None  # tenant salt for shared prefixes (None: default)
        self.reply_prefix = ""  # the reply's opening, already in the prompt (history keeps it)
        self.reservation = None  # the pool blocks promised to this turn (once started)
        self.done = threading.Event()
        self.cancelled = False
        self.scheduler = None  # set by Scheduler.submit
        self.result: ChatResult | None = None
        self.error: BaseException | None = None
        # set by the scheduler as the job runs
        self.lock: threading.Lock | None = None
        # a fleet's look at the object store for this agent, run off the scheduler's thread
        # before the turn may start (engine/fleet.py, Fleet.prefetch): its note, or None
        self.store_check: Future | None = None
        # another turn's prefill this one waits for, to share its blocks (runner.Waits)
        self.waits_for = None
        self.resumed = None
        self.state = None
        self.chunks: list[int] = []
        self.passed_over = 0  # prefill rounds other turns went first
        self.fed_prompt = 0
        self.generated: list[int] = []
        self.last_token: int | None = None
        self.drafter = None  # a ContextDrafter (engine/drafts.py), made at its first draft
        self.draft: list[int] = []  # the draft tokens the current decode step feeds
        # (token, log-prob, [(token, log-prob)] likeliest first) of each token taken, where
        # the turn asked for log-probs
        self.logprobs: list[tuple] | None = [] if params.logprobs is not None else None
        self.finish_reason = "length"
        self.max_new = params.max_tokens
        self.text = ""
        self.first_at = 0.0
        self.last_at = 0.0
        self.prefill_ms = 0.0
        self.prompt_recorded = False
        self._prefill_started = 0.0
        self._scanner = StopScanner(params.stop)
        self._detok = None
        self._sample = None
        self._sample_drafted = None
        self._eos: frozenset = frozenset()

    # -- setup ------------------------------------------------------------------

    def start(
        self,
        resumed,
        *,
        tokenizer,
        eos_ids,
        max_chunk: int,
        query_heads: int,
        context_limit: int | None = None,
        last_chunk: int = LAST_CHUNK_MAX,
        scores_budget: int | None = SCORES_BUDGET_BYTES,
    ) -> None:
        self.resumed = resumed
        self.state = resumed.state
        self._detok = tokenizer.detokenizer
        self._detok.reset()
        self._eos = eos_ids
        self._sample = self.params.sampler()
        self._sample_drafted = self.params.draft_sampler()
        self.chunks = plan_chunks(
            len(resumed.prefill_ids),
            self.state.size,
            max_chunk=max_chunk,
            query_heads=query_heads,
            last_max=last_chunk,
            budget=scores_budget,
        )
        if context_limit is not None:
            room = context_limit - self.state.size - len(resumed.prefill_ids)
            self.max_new = max(1, min(self.max_new, room))
        self.phase = Phase.PREFILL
        self._prefill_started = time.perf_counter()
        self._notify("start", resumed)

    def next_chunk(self) -> tuple[list[int], bool]:
        """The next prefill chunk, and whether it is the last."""
        size = self.chunks[0]
        ids = self.resumed.prefill_ids[self.fed_prompt : self.fed_prompt + size]
        return ids, len(self.chunks) == 1

    def chunk_done(self) -> None:
        self.fed_prompt += self.chunks.pop(0)

    def prefill_finished(self) -> None:
        self.record_prompt()
        self.prompt_recorded = True
        self.prefill_ms = (time.perf_counter() - self._prefill_started) * 1000

    def record_prompt(self) -> None:
        """Append the prompt tokens fed so far (all, or the chunks done before a cancel)."""
        r = self.resumed
        n = self.fed_prompt
        if n:
            end = int(r.prefill_spans[n - 1, 1])
            self.state.append(
                r.prefill_ids[:n], r.prefill_spans[:n], self.prompt[len(self.state.text) : end]
            )

    # -- tokens -----------------------------------------------------------------

    def sample(self, logits: mx.array) -> mx.array:
        if self.grammar is not None:
            if self.params.temperature == 0.0:  # greedy: the same token, mostly unmasked
                return self.grammar.argmax(logits)
            logits = self.grammar.mask(logits)
        return self._sample(logits)

    def sample_drafted(self, logits: mx.array, wanted: int | None) -> mx.array:
        """``sample`` at a drafted step's position, whose draft token is ``wanted`` (None: the
        position after the draft): drawn as ``sample`` draws (``SamplingParams.draft_sampler``:
        the same distribution, and the same draws for the same random state)."""
        if wanted is None or self.params.temperature == 0.0:
            return self.sample(logits)
        if self.grammar is not None:
            logits = self.grammar.mask(logits)
        return self._sample_drafted(logits, wanted)

    def verify(self, logits: mx.array, draft: list[int]) -> tuple[int, bool]:
        """Sample a drafted step's positions ([1 + len(draft), vocab] logits: after the
        turn's last token, then after each draft token) as steps would (``sample_drafted``),
        taking each token sampled: the draft is kept while the sampled token is the draft's,
        and the token sampled after the last kept one is the step's own. How many draft
        tokens were kept, and whether the turn is over."""
        if self.params.temperature == 0.0 and self.grammar is None:
            chosen = np.array(mx.argmax(logits, axis=-1)).tolist()  # sample's argmax, each row

            def draw(at: int, wanted: int | None) -> int:
                return chosen[at]
        else:

            def draw(at: int, wanted: int | None) -> int:
                return self.sample_drafted(logits[at : at + 1], wanted).item()

        kept, over = 0, False
        for wanted in [*draft, None]:
            token = draw(kept, wanted)
            over = self.take(token, logits[kept : kept + 1])
            if token != wanted:
                break
            kept += 1
            if over:
                break
        return kept, over

    def take(self, token: int, logits: mx.array | None = None) -> bool:
        """Record a generated token and stream its text; True when the turn is over.
        ``logits`` ([1, vocab]): the model's at the position that chose it, for its log-prob
        where the turn asked for them."""
        now = time.perf_counter()
        if not self.generated:
            self.first_at = now
        self.last_at = now
        self.generated.append(token)
        if token in self._eos:
            self.finish_reason = "stop"
            return True
        if self.logprobs is not None:
            self._note_logprob(token, logits)
        if self.grammar is not None:
            self.grammar.advance(token)
        self._detok.add_token(token)
        self._emit(self._scanner.feed(self._detok.last_segment))
        if self._scanner.stopped or (self.grammar is not None and self.grammar.done):
            self.finish_reason = "stop"
            return True
        if self.cancelled:
            return True
        if len(self.generated) >= self.max_new:
            self.finish_reason = "length"
            return True
        self.last_token = token
        return False

    def _note_logprob(self, token: int, logits: mx.array | None) -> None:
        if logits is None:
            raise ValueError("a turn that asked for log-probs takes each token with its logits")
        row = logits.reshape(-1).astype(mx.float32)
        row = row - mx.logsumexp(row)  # the model's log-probs, as mlx-lm's generate gives them
        n = self.params.logprobs
        top = mx.argsort(-row)[:n] if n else mx.array([], dtype=mx.int32)
        values = np.array(row[mx.concatenate([mx.array([token]), top.astype(mx.int32)])])
        ids = [token, *np.array(top).tolist()]
        self.logprobs.append(
            (token, float(values[0]), list(zip(ids[1:], values[1:].tolist(), strict=True)))
        )

    def _emit(self, piece: str) -> None:
        if piece:
            self.text += piece
            if self.pieces is not None:
                self.pieces.put(piece)
            self._notify("piece", piece)

    def _notify(self, event: str, value) -> None:
        if self.listener is not None:
            try:
                self.listener(event, value)
            except Exception:  # a listener's bug must not break the turn
                pass

    # -- the end ----------------------------------------------------------------

    def record_fed(self, token_text) -> None:
        """Append the fed generated tokens (all but the last) to the agent's text.

        A cancelled turn drops them instead (its reply is not saved)."""
        if self.cancelled:
            if not self.prompt_recorded:
                self.record_prompt()  # only the chunks done
                self.prompt_recorded = True
            self.state.fit_table()  # no generated token stays
            self.finish_reason = "cancelled"
            return
        if not self._scanner.stopped and self.generated and self.generated[-1] not in self._eos:
            self._detok.finalize()
            self._emit(self._scanner.feed(self._detok.last_segment) + self._scanner.flush())
        fed = self.generated[:-1]
        if fed:
            pieces = token_text.generated_bytes(fed)
            lengths = np.asarray([len(p) for p in pieces], dtype=np.int64)
            ends = np.cumsum(lengths) + len(self.state.text)
            self.state.append(fed, np.stack([ends - lengths, ends], axis=1), b"".join(pieces))
        if self.messages is not None:
            reply = self.reply_prefix + self.text
            self.state.messages = [*self.messages, {"role": "assistant", "content": reply}]

    def finish(self, eos_ids, token_text=None) -> ChatResult:
        """The turn's result (``token_text``: the model's ``TokenText``, for the bytes of the
        tokens of its log-probs)."""
        r = self.resumed
        count = len(self.generated)
        decode_s = self.last_at - self.first_at
        stats = TurnStats(
            cache=r.tier,
            match=r.match,
            stored_tokens=r.stored_tokens,
            reused_tokens=r.reused_tokens,
            prefill_tokens=len(r.prefill_ids),
            prompt_tokens=r.prompt_tokens,
            generated_tokens=count,
            ttft_ms=(self.first_at - self.submitted) * 1000 if count else 0.0,
            decode_tps=(count - 1) / decode_s if count > 1 and decode_s > 0 else 0.0,
            load_ms=r.load_ms,
            prefill_ms=self.prefill_ms,
            total_ms=(time.perf_counter() - self.submitted) * 1000,
            kv_format=self.state.quant.label,
            reuse_note=r.note,
            shared_tokens=r.shared_tokens,
            draft_tokens=self.drafter.drafted if self.drafter else 0,
            accepted_draft_tokens=self.drafter.kept if self.drafter else 0,
        )
        visible = [t for t in self.generated if t not in eos_ids]
        self.result = ChatResult(
            self.text,
            visible,
            self.finish_reason,
            stats,
            stop_sequence=self._scanner.matched,
            logprobs=_token_logprobs(self.logprobs, token_text),
        )
        return self.result

    def close(self, error: BaseException | None = None) -> None:
        self.error = error
        self.phase = Phase.DONE
        if self.pieces is not None:
            self.pieces.put(DONE)
        self.done.set()
        self._notify("end", None)

    def cancel(self) -> None:
        """Stop at the next token (or before starting); the turn saves no reply."""
        if self.scheduler is not None:
            self.scheduler.cancel(self)
        else:
            self.cancelled = True

    def wait(self, timeout: float | None = None) -> ChatResult:
        """The turn's result once it has finished (``TimeoutError`` after ``timeout`` seconds,
        the turn still running)."""
        if not self.done.wait(timeout):
            raise TimeoutError(f"the turn did not finish within {timeout} s")
        if self.error is not None:
            raise self.error
        return self.result


def _token_logprobs(noted: list[tuple] | None, token_text) -> list[TokenLogprob] | None:
    """``Job.logprobs`` as ``TokenLogprob`` s, each token with its bytes."""
    if noted is None:
        return None
    if not noted:
        return []

    def text(token: int) -> bytes:
        return token_text.generated_bytes([token])[0]

    chosen = token_text.generated_bytes([token for token, _, _ in noted])
    return [
        TokenLogprob(token, chosen[i], lp, tuple(TokenLogprob(t, text(t), v) for t, v in top))
        for i, (token, lp, top) in enumerate(noted)
    ]
