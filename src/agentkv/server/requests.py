"""What a chat request asks for, whichever API it came through."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TurnRequest:
    agent_id: str
    messages: list[dict]  # normalized: {"role": system|user|assistant, "content": str}
    model: str
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    cache_salt: str | None = None  # only prompts under the same salt share blocks

    @property
    def sampling(self) -> dict:
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stop": self.stop,
            "cache_salt": self.cache_salt,
        }
