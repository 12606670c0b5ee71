"""Tools and tool turns into a prompt, through the model's chat template.

A template that knows tools gets them as Hugging Face templates take them
(``apply_chat_template(messages, tools=...)``, assistant ``tool_calls`` with object
arguments, ``role: "tool"`` results). One that does not (the embedded SmolLM2's ChatML)
gets the Hermes fallback in plain messages: the schemas in the system message, each call
as a ``<tool_call>`` block in the assistant's text, and each run of tool results as one
user turn of ``<tool_response>`` blocks.
"""

from __future__ import annotations

import json

from .formats import FALLBACK_INSTRUCTIONS, ToolFormat


def has_tool_turns(messages: list[dict]) -> bool:
    return any(m.get("tool_calls") or m["role"] == "tool" for m in messages)


def fallback_messages(messages: list[dict], tools: list[dict] | None, fmt: ToolFormat):
    """``messages`` with tools, calls and results written out as plain text turns."""
    out: list[dict] = []
    if tools:
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        block = FALLBACK_INSTRUCTIONS.format(tools=listed)
        if messages[0]["role"] == "system":
            first = messages[0]["content"]
            out.append({"role": "system", "content": f"{first}\n\n{block}" if first else block})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": block})
    for m in messages:
        if m["role"] == "tool":
            response = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "tool_results": True})
        elif m.get("tool_calls"):
            calls = [
                fmt.render_call(c["function"]["name"], c["function"]["arguments"])
                for c in m["tool_calls"]
            ]
            text = "\n".join(calls)
            out.append(
                {
                    "role": "assistant",
                    "content": f"{m['content']}\n{text}" if m["content"] else text,
                }
            )
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return [{"role": m["role"], "content": m["content"]} for m in out]


def render_prompt(tokenizer, fmt: ToolFormat, messages: list[dict], tools=None) -> str:
    """The prompt for ``messages`` (normalized) with ``tools`` (OpenAI shape, or None)."""
    if (tools or has_tool_turns(messages)) and not fmt.native:
        messages = fallback_messages(messages, tools, fmt)
        tools = None
    kwargs = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **kwargs
    )
