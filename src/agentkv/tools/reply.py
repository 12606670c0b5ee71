"""Split a reply, as it streams, into answer text, reasoning and tool calls.

``ReplyParser.feed(piece)`` returns the events the new text completes; ``finish()`` the
rest. Text that could be the start of a marker (``<tool_ca``...) is held back until it is
known. A call is reported once it is complete (at its end marker, or at the end of the
reply for formats without one); text between call markers that does not parse as a call
of a declared tool is answer text. Reasoning is the text between the tokenizer's think
markers (Qwen3's ``<think>``), or GPT-OSS's ``analysis`` channel.

A *forced* reply (``tool_choice`` required or a named tool) starts with the format's call
prefix (already in the prompt): it always yields one call of a declared tool, whose
arguments are what the model wrote if they parse as a JSON object, else ``{}``.
"""

from __future__ import annotations

import difflib
import uuid
from collections.abc import Callable
from typing import NamedTuple

from .formats import ToolCall, ToolFormat, harmony_messages, loads_object, salvage_call


class Event(NamedTuple):
    kind: str  # "content" | "reasoning" | "call"
    text: str = ""
    call: ToolCall | None = None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _held(text: str, markers: list[str]) -> int:
    """How many trailing characters of ``text`` could begin one of ``markers``."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if marker.startswith(text[-n:]):
                best = n
                break
    return best


class ReplyParser:
    """One reply's splitter (see the module docstring)."""

    def __init__(
        self,
        fmt: ToolFormat,
        *,
        tools: list[dict] | None = None,
        think: tuple[str, str] | None = None,
        in_reasoning: bool = False,
        forced: str | None = None,
        forced_name: str | None = None,
        new_id: Callable[[], str] = new_call_id,
    ):
        """``tools``: the declared tools (OpenAI shape; None: calls are not looked for);
        ``think``: the reasoning markers; ``in_reasoning``: the prompt opened a think block;
        ``forced``: the call prefix the prompt ends with (``forced_name``: the call's name,
        None when the model names the tool)."""
        self.fmt = fmt
        self.tools = tools or []
        self.names = [t["function"]["name"] for t in self.tools]
        self.think = think
        self.new_id = new_id
        self.forced_name = forced_name
        self.whole = fmt.family == "gpt_oss" and bool(tools or forced)
        self.pending = forced or ""
        self.state = "reasoning" if in_reasoning else "content"
        self.call_text = ""
        self.forcing = forced is not None
        if self.forcing and not self.whole:
            self.state = "call"
            start = fmt.start or ""
            self.pending = ""
            self.call_text = forced[len(start) :] if forced.startswith(start) else forced
        self.content = ""
        self.blank = ""  # blank answer text not reported yet
        self.reasoning = ""
        self.calls: list[ToolCall] = []

    # -- feeding ------------------------------------------------------------------------

    def feed(self, piece: str) -> list[Event]:
        self.pending += piece
        return [] if self.whole else self._drain(final=False)

    def finish(self) -> list[Event]:
        events = self._finish()
        if self.blank and not self.calls:  # a reply of blank text is that text
            events.append(Event("content", self.blank))
            self.content += self.blank
        self.blank = ""
        return events

    def _finish(self) -> list[Event]:
        if self.whole:
            return self._record(self._harmony(self.pending))
        events = self._drain(final=True)
        if self.state == "call":
            events += self._close_call(self.call_text, closed=False)
            self.call_text = ""
        elif self.pending:
            kind = "reasoning" if self.state == "reasoning" else "content"
            events += self._record([Event(kind, self.pending)])
        self.pending = ""
        return events

    def _markers(self) -> list[tuple[str, str]]:
        found = []
        if self.think:
            found.append((self.think[0], "reasoning"))
        if self.tools and self.fmt.start:
            found.append((self.fmt.start, "call"))
        return found

    def _drain(self, *, final: bool) -> list[Event]:
        events: list[Event] = []
        while self.pending:
            if self.state == "content":
                if (
                    self.tools
                    and self.fmt.family == "llama3"
                    and not self.content
                    and self.pending.lstrip().startswith("{")
                ):
                    self.state, self.call_text, self.pending = "call", self.pending, ""
                    continue
                markers = self._markers()
                hits = [(i, m, s) for m, s in markers if (i := self.pending.find(m)) >= 0]
                if hits:
                    at, marker, state = min(hits)
                    events += self._record([Event("content", self.pending[:at])])
                    self.pending = self.pending[at + len(marker) :]
                    self.state = state
                    continue
                keep = 0 if final else _held(self.pending, [m for m, _ in markers])
                events += self._record([Event("content", self.pending[: len(self.pending) - keep])])
                self.pending = self.pending[len(self.pending) - keep :]
                break
            if self.state == "reasoning":
                end = self.think[1] if self.think else None
                at = self.pending.find(end) if end else -1
                if at >= 0:
                    events += self._record([Event("reasoning", self.pending[:at])])
                    self.pending = self.pending[at + len(end) :]
                    self.state = "content"
                    continue
                keep = 0 if final or not end else _held(self.pending, [end])
                events += self._record(
                    [Event("reasoning", self.pending[: len(self.pending) - keep])]
                )
                self.pending = self.pending[len(self.pending) - keep :]
                break
            # a call: up to its end marker
            end = self.fmt.end
            at = self.pending.find(end) if end else -1
            if at < 0:
                keep = 0 if final or not end else _held(self.pending, [end])
                self.call_text += self.pending[: len(self.pending) - keep]
                self.pending = self.pending[len(self.pending) - keep :]
                break
            self.call_text += self.pending[:at]
            self.pending = self.pending[at + len(end) :]
            events += self._close_call(self.call_text, closed=True)
            self.call_text = ""
            self.state = "content"
        return events

    # -- calls --------------------------------------------------------------------------

    def _close_call(self, text: str, *, closed: bool) -> list[Event]:
        forcing, self.forcing = self.forcing, False
        parsed = self.fmt.parse(text, self.tools) or []
        calls = [(n, a) for n, a in parsed if n in self.names]
        if forcing:
            return self._record([self._forced_call(text, calls)])
        if calls and len(calls) == len(parsed):
            return self._record(
                [Event("call", call=ToolCall(self.new_id(), n, a)) for n, a in calls]
            )
        raw = (self.fmt.start or "") + text + ((self.fmt.end or "") if closed else "")
        return self._record([Event("content", raw)])

    def _forced_call(self, text: str, calls: list[tuple[str, dict]]) -> Event:
        if calls and (self.forced_name is None or calls[0][0] == self.forced_name):
            name, args = calls[0]
        else:
            name, args = salvage_call(text)
            if self.forced_name is not None:
                name = self.forced_name
            elif name not in self.names and self.names:  # the closest declared name
                close = difflib.get_close_matches(name or "", self.names, n=1, cutoff=0.0)
                name = close[0] if close else self.names[0]
        return Event("call", call=ToolCall(self.new_id(), name or "", args or {}))

    def _harmony(self, text: str) -> list[Event]:
        """GPT-OSS: channels to reasoning / content; ``to=functions.X`` messages to calls."""
        messages = harmony_messages(text)
        events = []
        for channel, name, body in messages:
            if name is not None:
                args = loads_object(body)
                if name in self.names and args is not None:
                    events.append(Event("call", call=ToolCall(self.new_id(), name, args)))
            elif channel == "analysis":
                events.append(Event("reasoning", body))
            else:
                events.append(Event("content", body))
        if self.forcing and not any(e.kind == "call" for e in events):
            events.append(self._forced_call(text, []))
        return events if messages or self.forcing else [Event("content", text)]

    def _record(self, events: list[Event]) -> list[Event]:
        out = []
        for event in events:
            if event.kind == "call":
                self.calls.append(event.call)
            elif not event.text:
                continue
            elif event.kind == "reasoning":
                self.reasoning += event.text
            else:  # trailing blank text is held: it may only come before a call
                text = self.blank + event.text
                if self.reasoning and not self.content:  # the answer after the reasoning
                    text = text.lstrip("\n")
                shown = text.rstrip()
                self.blank = text[len(shown) :]
                if not shown:
                    continue
                event = Event("content", shown)
                self.content += shown
            out.append(event)
        return out
