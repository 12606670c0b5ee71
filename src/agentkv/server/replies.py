"""What every API's replies share: the dialect's shape, SSE framing, usage counts, and a
reply's tool calls, read whole or as it streams."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import ClassVar, Protocol

from ..engine.results import ChatResult
from ..tools import ReplyParser, ToolCall
from ..tools.reply import Event
from .common import ServerLimits
from .errors import API
from .requests import TurnRequest
from .tooling import ToolChoice

HEARTBEAT = ": keep-alive\n\n"
ARGUMENT_PIECE = 16  # characters of a tool call's arguments per streamed event


@dataclass
class Dialect:
    """One wire protocol of chat turns: ``parse`` a body into a ``TurnRequest``, answer a
    ``Reply`` with ``response`` (read whole) or ``stream`` (its SSE events); ``api`` names
    it and shapes its errors."""

    api: ClassVar[API]
    limits: ServerLimits


def sse(data: dict | str, event: str | None = None) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return (f"event: {event}\n" if event else "") + f"data: {payload}\n\n"


def openai_logprobs(result: ChatResult) -> list[dict] | None:
    """A reply's token log-probs as OpenAI's APIs list them (None: not asked): each token's
    text, log-prob, UTF-8 bytes and ``top_logprobs``, likeliest first."""
    if result.logprobs is None:
        return None

    def entry(t) -> dict:
        return {
            "token": t.text.decode("utf-8", "replace"),
            "logprob": t.logprob,
            "bytes": list(t.text),
        }

    return [{**entry(t), "top_logprobs": [entry(o) for o in t.top]} for t in result.logprobs]


def usage_counts(resumed) -> dict:
    """prompt / reused / prefilled token counts of a turn, as its start planned them."""
    return {
        "prompt": resumed.prompt_tokens,
        "reused": resumed.reused_tokens,
        "prefill": len(resumed.prefill_ids),
    }


def in_pieces(text: str) -> Iterator[str]:
    """A tool call's arguments as they are streamed: ``ARGUMENT_PIECE`` characters each."""
    for at in range(0, len(text), ARGUMENT_PIECE):
        yield text[at : at + ARGUMENT_PIECE]


def kept_calls(calls: list[ToolCall], choice: ToolChoice | None) -> list[ToolCall]:
    """The calls a reply returns: all of them, or the first unless parallel calls are allowed."""
    return calls if _parallel(choice) else calls[:1]


def _parallel(choice: ToolChoice | None) -> bool:
    return choice is None or choice.parallel


Finish = Callable[[], Awaitable[tuple[ChatResult, dict]]]


class EventWriter(Protocol):
    """How an API writes a streamed reply: each piece of text or reasoning, each call."""

    def text(self, kind: str, text: str) -> list[str]: ...

    def call(self, call: ToolCall) -> list[str]: ...


class Reply:
    """One turn's reply as a dialect answers it: the request, the usage counts its start
    planned, the running turn and the parser that splits its text from its tool calls
    (a call past the first is dropped unless parallel calls are allowed).

    Read it ``whole()``, or stream it ``written()`` by an API's ``EventWriter``; either way
    ``result``, ``agentkv`` (the stats a response carries) and ``calls`` (those returned)
    are then set."""

    def __init__(self, req: TurnRequest, turn, counts: dict, parser: ReplyParser, finish: Finish):
        self.req = req
        self.turn = turn
        self.counts = counts
        self.parser = parser
        self._finish = finish
        self.calls: list[ToolCall] = []
        self.result: ChatResult | None = None
        self.agentkv: dict = {}

    @property
    def generated(self) -> int:
        return self.result.stats.generated_tokens

    async def finish(self) -> ChatResult:
        """The turn's result, once it has ended and is on disk."""
        self.result, self.agentkv = await self._finish()
        return self.result

    async def whole(self) -> None:
        """Wait for the whole reply and parse it."""
        await self.finish()
        self.parser.feed(self.result.text)
        self.parser.finish()
        self.calls = kept_calls(self.parser.calls, self.req.tool_choice)

    async def written(self, writer: EventWriter, heartbeat: str = HEARTBEAT) -> AsyncIterator[str]:
        """The reply's events as ``writer`` writes them; ``heartbeat`` in its silences."""
        async for event in self._events():
            if event is None:
                out = [heartbeat]
            elif event.kind == "call":
                out = writer.call(event.call)
            else:
                out = writer.text(event.kind, event.text)
            for line in out:
                yield line

    async def _events(self) -> AsyncIterator[Event | None]:
        async for piece in self.turn.pieces():
            if piece is None:
                yield None
                continue
            for event in self._kept(self.parser.feed(piece)):
                yield event
        await self.finish()
        for event in self._kept(self.parser.finish()):
            yield event

    def _kept(self, events: Iterable[Event]) -> Iterator[Event]:
        for event in events:
            if event.kind == "call":
                if self.calls and not _parallel(self.req.tool_choice):
                    continue
                self.calls.append(event.call)
            yield event
