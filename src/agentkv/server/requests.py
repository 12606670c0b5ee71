"""What a chat request asks for, whichever API it came through."""

from __future__ import annotations

from dataclasses import dataclass, field

from .tooling import ToolChoice

SAMPLING = ("max_tokens", "temperature", "top_p", "stop", "cache_salt")


@dataclass
class TurnRequest:
    agent_id: str
    messages: list[dict]  # normalized (see messages.py)
    model: str
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    cache_salt: str | None = None  # only prompts under the same salt share blocks
    tools: list[dict] | None = None  # function tools, OpenAI's shape
    tool_choice: ToolChoice | None = None  # None: no tools

    @property
    def sampling(self) -> dict:
        """The engine's ``submit_chat`` options this request sets (``SAMPLING``)."""
        return {name: getattr(self, name) for name in SAMPLING}
