"""Which agent a request belongs to.

In order: the ``x-agent-id`` header (must be a valid agent id, else the request
is rejected); the API's own user field (OpenAI ``user``, Anthropic
``metadata.user_id``: used as it is when it is a valid agent id, otherwise
mapped to ``user-<sha256 prefix>``); otherwise an id derived from the content,
``auto-<sha256 prefix>`` of the system prompt and the first user message, so an
unmodified client that resends its growing history lands on the same agent
every turn.
"""

from __future__ import annotations

import hashlib

from ..agent_id import validate_agent_id
from ..errors import InvalidAgentIdError

HEADER = "x-agent-id"


def _digest(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        data = part.encode("utf-8")
        h.update(len(data).to_bytes(8, "little") + data)
    return h.hexdigest()[:32]


def resolve_agent(header: str | None, user: str | None, system: str, first_user: str) -> str:
    if header is not None:
        return validate_agent_id(header)
    if user:
        try:
            return validate_agent_id(user)
        except InvalidAgentIdError:
            return f"user-{_digest(user)}"
    return f"auto-{_digest(system, first_user)}"


def first_texts(messages: list[dict]) -> tuple[str, str]:
    """(system prompt, first user message) of normalized chat messages."""
    system = "\n".join(m["content"] for m in messages if m["role"] == "system")
    first_user = next((m["content"] for m in messages if m["role"] == "user"), "")
    return system, first_user
