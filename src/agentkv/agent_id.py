"""Agent ids name directories on disk, so they are checked before anything touches one."""

from __future__ import annotations

import re

from .errors import InvalidAgentIdError

_AGENT_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")


def validate_agent_id(agent_id: object) -> str:
    """Return ``agent_id`` if it is 1-128 characters of [A-Za-z0-9._-] and not '.' or '..'."""
    if not isinstance(agent_id, str):
        raise InvalidAgentIdError(f"agent id must be a string, not {type(agent_id).__name__}")
    if not _AGENT_ID.fullmatch(agent_id) or agent_id in (".", ".."):
        shown = agent_id if len(agent_id) <= 40 else agent_id[:37] + "..."
        raise InvalidAgentIdError(
            f"invalid agent id {shown!r}: use 1-128 characters of letters, digits, '.', '_' "
            "and '-' (not '.' or '..')"
        )
    return agent_id
