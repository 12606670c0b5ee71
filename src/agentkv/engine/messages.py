"""Chat messages and prompt text as the engine accepts them (validated once, at the edge)."""

from __future__ import annotations

from ..errors import InvalidRequestError


def validate_messages(messages) -> list[dict]:
    """Check chat messages; text content blocks are joined into one string.

    Besides ``{"role", "content"}``, an assistant message may carry ``tool_calls``
    (``[{"id", "type": "function", "function": {"name", "arguments": {...}}}]``, its
    content then may be None) and a ``role: "tool"`` message a ``tool_call_id`` and
    ``name``: the shape Hugging Face chat templates take.
    """
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequestError(f"messages[{i}] must be an object")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise InvalidRequestError(f"messages[{i}].role must be a non-empty string")
        calls = message.get("tool_calls")
        if calls is not None and content is None:
            content = ""
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
        clean = {"role": role, "content": content}
        if calls is not None:
            clean["tool_calls"] = _check_calls(calls, f"messages[{i}].tool_calls")
        for key in ("tool_call_id", "name"):
            if role == "tool" and message.get(key) is not None:
                if not isinstance(message[key], str):
                    raise InvalidRequestError(f"messages[{i}].{key} must be a string")
                clean[key] = check_text(message[key], f"messages[{i}].{key}")
        out.append(clean)
    return out


def _check_calls(calls, where: str) -> list[dict]:
    if not isinstance(calls, list) or not calls:
        raise InvalidRequestError(f"{where} must be a non-empty list")
    out = []
    for k, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(function, dict)
            or not isinstance(call.get("id"), str)
            or not isinstance(function.get("name"), str)
            or not isinstance(function.get("arguments"), dict)
        ):
            raise InvalidRequestError(
                f"{where}[{k}] must be {{id, type: function, function: {{name, arguments: "
                "object}}}}"
            )
        out.append(
            {
                "id": call["id"],
                "type": "function",
                "function": {"name": function["name"], "arguments": function["arguments"]},
            }
        )
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
