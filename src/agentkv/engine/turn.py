"""One turn of one agent: resume its cache, prefill the new text, generate, record.

``Turn.run`` yields visible text pieces as tokens are generated; whatever ends
the turn (completion, a stop, the consumer walking away, an error), the
agent's state ends consistent: either the tokens fed into its cache are
recorded with the text they cover, or the hot state is dropped and the next
turn reloads the last durable state from disk.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from .generation import Decoder, SamplingParams, StopScanner, prefill
from .results import ChatResult, TurnStats
from .state import AgentState


@dataclass
class Resumed:
    """Where a turn starts from: the agent's state after matching, and how it got there."""

    state: AgentState
    tier: str  # hot | warm | cold
    match: str
    stored_tokens: int
    prefill_ids: list[int]
    prefill_spans: np.ndarray
    note: str | None
    load_ms: float


class Turn:
    def __init__(
        self,
        engine,
        resumed: Resumed,
        prompt: bytes,
        params: SamplingParams,
        messages: list | None,
        started: float,
    ):
        self.engine = engine
        self.resumed = resumed
        self.state = resumed.state
        self.prompt = prompt
        self.params = params
        self.messages = messages
        self.started = started
        self.generated: list[int] = []
        self.finish_reason = "length"
        self.result: ChatResult | None = None
        self._decoder: Decoder | None = None
        self._text = ""
        self._ttft = 0.0
        self._prefill_ms = 0.0
        self._first_at = 0.0
        self._last_at = 0.0

    def run(self) -> Iterator[str]:
        engine = self.engine
        model = engine.loaded.model
        reused = self.state.size
        t0 = time.perf_counter()
        logits = prefill(
            model,
            self.state.caches,
            self.resumed.prefill_ids,
            max_chunk=engine.prefill_chunk,
            query_heads=engine.query_heads,
            lock=engine.compute_lock,
        )
        self.state.append(
            self.resumed.prefill_ids,
            self.resumed.prefill_spans,
            self.prompt[len(self.state.text) :],
        )
        self._prefill_ms = (time.perf_counter() - t0) * 1000
        assert self.state.size == reused + len(self.resumed.prefill_ids)

        detok = engine.loaded.tokenizer.detokenizer
        detok.reset()
        eos = engine.eos_ids
        scanner = StopScanner(self.params.stop)
        self._decoder = Decoder(
            model, self.state.caches, logits, params=self.params, lock=engine.compute_lock
        )
        while self._decoder.remaining > 0:
            token = self._decoder.next()
            now = time.perf_counter()
            if not self.generated and not self._first_at:
                self._first_at = now
                self._ttft = (now - self.started) * 1000
            self._last_at = now
            if token in eos:
                self._record(token)
                self.finish_reason = "stop"
                break
            self._record(token)
            detok.add_token(token)
            piece = scanner.feed(detok.last_segment)
            if piece:
                self._text += piece
                yield piece
            if scanner.stopped:
                self.finish_reason = "stop"
                break
        if not scanner.stopped:
            detok.finalize()
            piece = scanner.feed(detok.last_segment) + scanner.flush()
            if piece:
                self._text += piece
                yield piece

    def _record(self, token: int) -> None:
        self.generated.append(token)

    def finish(self, failed: bool) -> ChatResult | None:
        """Record what the caches now hold; called once, whatever ended the turn."""
        if self._decoder is not None:
            self._decoder.finish()
        if failed:
            return None
        fed = self.generated[: self._decoder.fed] if self._decoder else []
        if fed:
            pieces = self.engine.token_text.generated_bytes(fed)
            lengths = [len(p) for p in pieces]
            ends = np.cumsum(lengths, dtype=np.int64) + len(self.state.text)
            spans = np.stack([ends - np.asarray(lengths, dtype=np.int64), ends], axis=1)
            self.state.append(fed, spans, b"".join(pieces))
        if self.messages is not None:
            self.state.messages = [*self.messages, {"role": "assistant", "content": self._text}]
        eos = self.engine.eos_ids
        visible = [t for t in self.generated if t not in eos]
        count = len(self.generated)
        decode_s = self._last_at - self._first_at
        r = self.resumed
        stats = TurnStats(
            cache=r.tier,
            match=r.match,
            stored_tokens=r.stored_tokens,
            reused_tokens=self.state.size - len(r.prefill_ids) - len(fed),
            prefill_tokens=len(r.prefill_ids),
            prompt_tokens=self.state.size - len(fed),
            generated_tokens=count,
            ttft_ms=self._ttft,
            decode_tps=(count - 1) / decode_s if count > 1 and decode_s > 0 else 0.0,
            load_ms=r.load_ms,
            prefill_ms=self._prefill_ms,
            total_ms=(time.perf_counter() - self.started) * 1000,
            kv_format=self.state.quant.label,
            reuse_note=r.note,
        )
        self.result = ChatResult(self._text, visible, self.finish_reason, stats)
        return self.result
