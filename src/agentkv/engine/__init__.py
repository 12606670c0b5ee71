"""The Engine and what its turns return."""

from .engine import AgentInfo, ChatStream, Engine
from .results import ChatResult, TurnStats

__all__ = ["AgentInfo", "ChatResult", "ChatStream", "Engine", "TurnStats"]
