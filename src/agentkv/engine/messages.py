"""Chat messages and prompt text as the engine accepts them (validated once, at the edge)."""

from __future__ import annotations

from ..errors import InvalidRequestError


def validate_messages(messages) -> list[dict]:
    """Check chat messages; text content blocks are joined into one string."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequestError(f"messages[{i}] must be an object")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise InvalidRequestError(f"messages[{i}].role must be a non-empty string")
        if isinstance(content, list):
            parts = []
            for j, block in enumerate(content):
                if (
                    not isinstance(block, dict)
                    or block.get("type") != "text"
                    or not isinstance(block.get("text"), str)
                ):
                    raise InvalidRequestError(f"messages[{i}].content[{j}] must be a text block")
                parts.append(block["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise InvalidRequestError(f"messages[{i}].content must be a string or text blocks")
        check_text(content, f"messages[{i}].content")
        out.append({"role": role, "content": content})
    return out


def check_text(text: str, what: str) -> str:
    """Text must be valid Unicode (no lone surrogates, which UTF-8 cannot encode)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(f"{what} is not valid Unicode: {exc.reason}") from None
    return text


def check_salt(salt) -> str | None:
    """A tenant salt for shared prefixes: None, or a non-empty string of at most 256 chars."""
    if salt is None:
        return None
    if not isinstance(salt, str) or not 1 <= len(salt) <= 256:
        raise InvalidRequestError("cache_salt must be a string of 1-256 characters")
    return check_text(salt, "cache_salt")
