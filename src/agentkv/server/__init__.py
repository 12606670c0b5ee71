"""``agentkv serve``: OpenAI, Anthropic and direct HTTP APIs over one Engine.

Every agent keeps its KV cache across turns and restarts; agents' turns run
together through the engine's scheduler. See ``app.create_app``.
"""

from .app import create_app

__all__ = ["create_app"]
