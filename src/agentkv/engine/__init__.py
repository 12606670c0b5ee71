"""The Engine and what its turns return."""

from .config import EngineConfig
from .constraints import Constraint, GrammarError, ToolSpec
from .engine import AgentInfo, ChatStream, Engine
from .results import ChatResult, TurnStats

__all__ = [
    "AgentInfo",
    "ChatResult",
    "ChatStream",
    "Constraint",
    "Engine",
    "EngineConfig",
    "GrammarError",
    "ToolSpec",
    "TurnStats",
]
