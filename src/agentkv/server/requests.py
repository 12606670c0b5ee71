"""What a chat request asks for, whichever API it came through."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..model.generation_config import GenerationDefaults
from .tooling import ToolChoice

SAMPLING = ("max_tokens", "temperature", "top_p", "stop", "cache_salt", "logprobs")


@dataclass
class TurnRequest:
    """A turn as parsed and checked. The sampling it does not name (None) is the served
    model's (``with_defaults``), known once the request has its model."""

    agent_id: str
    messages: list[dict]  # normalized (see messages.py)
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    cache_salt: str | None = None  # only prompts under the same salt share blocks
    tools: list[dict] | None = None  # function tools, OpenAI's shape
    tool_choice: ToolChoice | None = None  # None: no tools
    logprobs: int | None = None  # None: none; n: each token's, with the n likeliest beside it

    def with_defaults(self, defaults: GenerationDefaults, max_tokens: int) -> None:
        """Fill the sampling the request left to the model: ``defaults`` (the model's
        generation config), and ``max_tokens`` (the server's reply limit for it)."""
        if self.temperature is None:
            self.temperature = defaults.temperature
        if self.top_p is None:
            self.top_p = defaults.top_p
        if self.max_tokens is None:
            self.max_tokens = max_tokens

    @property
    def sampling(self) -> dict:
        """The engine's ``submit_chat`` options this request sets (``SAMPLING``)."""
        return {name: getattr(self, name) for name in SAMPLING}
