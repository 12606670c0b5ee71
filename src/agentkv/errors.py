"""Exceptions raised by agentkv. Every caller-facing error derives from AgentKVError."""

from __future__ import annotations


class AgentKVError(Exception):
    """Base class of agentkv's errors."""


class InvalidAgentIdError(AgentKVError, ValueError):
    """An agent id that is not 1-128 characters of [A-Za-z0-9._-] (or is '.' / '..')."""


class InvalidRequestError(AgentKVError, ValueError):
    """A request argument (messages, sampling options...) that cannot be served."""


class ModelImportError(AgentKVError):
    """A model file or directory that agentkv cannot import or load."""


class CacheFormatError(AgentKVError):
    """A stored cache file that fails validation; names the file and the reason."""

    def __init__(self, path, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class TurnFailedError(AgentKVError):
    """A turn that failed on the engine's side (its agent's KV could not be read back):
    nothing of it was kept, and the agent's next turn runs as if it had not been sent."""


class EngineBusyError(AgentKVError):
    """The engine's queue of waiting turns is full; try again after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = retry_after


class AgentBusyError(AgentKVError):
    """A fleet's object store holds a version of the agent that this machine's state does
    not continue (another machine ran turns of it: docs/fleet.md); nothing was replaced."""
