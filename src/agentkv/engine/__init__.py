"""The Engine and what its turns return."""

from .constraints import Constraint, GrammarError, ToolSpec
from .engine import AgentInfo, ChatStream, Engine
from .results import ChatResult, TurnStats

__all__ = [
    "AgentInfo",
    "ChatResult",
    "ChatStream",
    "Constraint",
    "Engine",
    "GrammarError",
    "ToolSpec",
    "TurnStats",
]
