"""One normaliser for the chat messages of every API.

Each wire protocol turns its messages into the same normalized list, which is what the
engine renders through the model's chat template (the shape Hugging Face templates take):

* ``{"role": "system" | "user" | "assistant", "content": str}``
* an assistant message may add ``"tool_calls": [{"id", "type": "function",
  "function": {"name", "arguments": {...}}}]`` (its content may then be ``""``)
* ``{"role": "tool", "content": str, "tool_call_id": str, "name": str}``: a call's result;
  it must answer a call of the assistant message before it.
"""

from __future__ import annotations

from .errors import bad_request
from .tooling import parse_arguments

OPENAI_ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}


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


def tool_call(call_id, name, arguments) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def tool_result(call_id: str, name: str, content: str) -> dict:
    return {"role": "tool", "content": content, "tool_call_id": call_id, "name": name}


def check_results(messages: list[dict]) -> list[dict]:
    """Every tool result answers a call of the assistant message before its run of results."""
    calls: dict[str, str] = {}
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            if m["tool_call_id"] not in calls:
                raise bad_request(
                    f"messages[{i}]: a tool result must answer a tool call of the assistant "
                    f"message before it (no call has id {m['tool_call_id']!r})",
                    f"messages[{i}]",
                )
            m["name"] = calls[m["tool_call_id"]]
        else:
            calls = {c["id"]: c["function"]["name"] for c in m.get("tool_calls") or []}
    return messages


def _openai_calls(calls, where: str) -> list[dict]:
    out = []
    for k, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(function, dict)
            or not isinstance(call.get("id"), str)
            or not isinstance(function.get("name"), str)
            or call.get("type", "function") != "function"
        ):
            raise bad_request(
                f"{where}[{k}] must be {{id, type: 'function', function: {{name, arguments}}}}",
                f"{where}[{k}]",
            )
        arguments = parse_arguments(function.get("arguments"), f"{where}[{k}].function.arguments")
        out.append(tool_call(call["id"], function["name"], arguments))
    return out


def from_openai(messages) -> list[dict]:
    """OpenAI-style messages (developer -> system), normalized."""
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = OPENAI_ROLES.get(m.role)
        if role is None:
            raise bad_request(
                f"{where}.role {m.role!r} is not supported "
                "(system, developer, user, assistant, tool)",
                f"{where}.role",
            )
        calls = getattr(m, "tool_calls", None) if role == "assistant" else None
        if m.content is None and not calls:
            raise bad_request(f"{where}.content is required", f"{where}.content")
        message = {"role": role, "content": text_of(m.content or "", f"{where}.content")}
        if calls:
            message["tool_calls"] = _openai_calls(calls, f"{where}.tool_calls")
        if role == "tool":
            call_id = getattr(m, "tool_call_id", None)
            if not isinstance(call_id, str):
                raise bad_request(f"{where}.tool_call_id is required", f"{where}.tool_call_id")
            message = tool_result(call_id, "", message["content"])
        out.append(message)
    return check_results(out)


def _anthropic_result_text(block: dict, where: str) -> str:
    content = block.get("content", "")
    text = text_of(content, f"{where}.content") if isinstance(content, (str, list)) else None
    if text is None:
        raise bad_request(f"{where}.content must be a string or text blocks", f"{where}.content")
    return f"Error: {text}" if block.get("is_error") else text


def _anthropic_message(role: str, content, where: str) -> list[dict]:
    """One Anthropic message -> normalized messages (tool results come out as tool turns)."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    texts, calls, results = [], [], []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise bad_request(f"{at}: tool_use needs an id and a name", at)
            if not isinstance(block.get("input"), dict):
                raise bad_request(f"{at}.input must be an object", f"{at}.input")
            calls.append(tool_call(block["id"], block["name"], block["input"]))
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise bad_request(f"{at}.tool_use_id is required", f"{at}.tool_use_id")
            results.append(tool_result(block["tool_use_id"], "", _anthropic_result_text(block, at)))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # the reply's own text is replayed from the agent's history
        else:
            raise bad_request(
                f"{at}: content of type {kind!r} is not supported here "
                "(text; tool_use from the assistant; tool_result from the user)",
                at,
            )
    text = "".join(texts)
    if calls:
        return [{"role": role, "content": text, "tool_calls": calls}]
    if results:
        return results + ([{"role": role, "content": text}] if text else [])
    return [{"role": role, "content": text}]


def from_anthropic(system, messages) -> list[dict]:
    """Anthropic's ``system`` and messages, normalized (the last must be the user's)."""
    out = []
    if system is not None:
        text = text_of(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    for i, m in enumerate(messages):
        out.extend(_anthropic_message(m.role, m.content, f"messages[{i}]"))
    if messages[-1].role != "user":
        raise bad_request("the last message must have role 'user'", "messages")
    return check_results(out)
