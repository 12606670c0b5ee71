"""One normaliser for the chat messages of every API.

Each wire protocol turns its messages into the same normalized list, which is what the
engine renders through the model's chat template: ``{"role": "system" | "user" |
"assistant", "content": str}``.
"""

from __future__ import annotations

from .errors import bad_request

OPENAI_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def text_of(content, where: str) -> str:
    """A message's text: a string, or a list of text blocks (anything else is unsupported)."""
    if isinstance(content, str):
        return content
    parts = []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text":
            raise bad_request(
                f"{where}[{i}]: content of type {kind!r} is not supported; only 'text'",
                f"{where}[{i}]",
            )
        text = block.get("text")
        if not isinstance(text, str):
            raise bad_request(f"{where}[{i}].text must be a string", f"{where}[{i}].text")
        parts.append(text)
    return "".join(parts)


def from_openai(messages) -> list[dict]:
    """OpenAI-style messages (developer -> system), normalized."""
    out = []
    for i, m in enumerate(messages):
        role = OPENAI_ROLES.get(m.role)
        if role is None:
            raise bad_request(
                f"messages[{i}].role {m.role!r} is not supported "
                "(system, developer, user, assistant)",
                f"messages[{i}].role",
            )
        if m.content is None:
            raise bad_request(f"messages[{i}].content is required", f"messages[{i}].content")
        out.append({"role": role, "content": text_of(m.content, f"messages[{i}].content")})
    return out


def from_anthropic(system, messages) -> list[dict]:
    """Anthropic's ``system`` and messages, normalized (the last must be the user's)."""
    out = []
    if system is not None:
        text = text_of(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    for i, m in enumerate(messages):
        out.append({"role": m.role, "content": text_of(m.content, f"messages[{i}].content")})
    if out[-1]["role"] != "user":
        raise bad_request("the last message must have role 'user'", "messages")
    return out
