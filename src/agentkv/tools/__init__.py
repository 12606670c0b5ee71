"""Tool calling: how a model family writes tool calls, how tools and calls are rendered
into its prompt, and how a reply is split into answer, reasoning and calls (streamed)."""

from .formats import ToolCall, ToolFormat, tool_format
from .reply import ReplyParser

__all__ = ["ReplyParser", "ToolCall", "ToolFormat", "tool_format"]
