"""What a turn returns: the generated text and how the agent's cache was used."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class TurnStats:
    """How one turn used (and rebuilt) the agent's cache.

    ``cache`` is where the reused tokens came from: ``hot`` (memory, no I/O),
    ``warm`` (some read from disk) or ``cold`` (nothing reused, full prefill).
    ``stored_tokens`` is what the stored state held, ``reused_tokens`` what this
    turn did not prefill: the agent's own tokens it kept, plus ``shared_tokens`` taken
    from blocks of the same prefix found by their content (a shared system prompt, or the
    agent's own earlier blocks). Whenever the agent's state is not reused in full, or a
    turn reuses nothing, ``reuse_note`` says why. ``draft_tokens``: tokens drafted from
    the context and checked in the decode steps (engine/drafts.py), ``accepted_draft_tokens``
    those kept: each saved one step.
    """

    cache: str
    match: str
    stored_tokens: int
    reused_tokens: int
    prefill_tokens: int
    prompt_tokens: int
    generated_tokens: int
    ttft_ms: float
    decode_tps: float
    load_ms: float
    prefill_ms: float
    total_ms: float
    kv_format: str
    reuse_note: str | None = None
    shared_tokens: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model (the log-softmax of the logits
    that chose it: a drafted token's are the verifying step's, the same as without drafts),
    its bytes in the text, and the ``top`` likeliest tokens there (each with no ``top``),
    likeliest first. A grammar or a temperature changes which token is drawn, not these."""

    token: int
    text: bytes
    logprob: float
    top: tuple[TokenLogprob, ...] = ()

    def to_dict(self) -> dict:
        out = {"token": self.token, "text": self.text.decode("utf-8", "replace")}
        return {**out, "logprob": self.logprob, "top": [t.to_dict() for t in self.top]}


@dataclass
class ChatResult:
    text: str
    tokens: list[int]
    finish_reason: str  # "stop" (EOS or a stop string), "length", or "cancelled"
    stats: TurnStats
    stop_sequence: str | None = None  # the stop string that ended the turn, if one did
    # each of ``tokens``' log-probabilities where the turn asked for them, else None
    logprobs: list[TokenLogprob] | None = None

    def to_dict(self) -> dict:
        logprobs = None if self.logprobs is None else [t.to_dict() for t in self.logprobs]
        return {
            "text": self.text,
            "tokens": self.tokens,
            "finish_reason": self.finish_reason,
            "stop_sequence": self.stop_sequence,
            "stats": self.stats.to_dict(),
            "logprobs": logprobs,
        }
