"""How each model family writes tool calls, picked from its chat template and tokenizer.

Families (``tool_format`` picks one):

* ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen2.5, Qwen3,
  SmolLM3, Hermes; mlx-lm's ``json_tools``). It is also the **fallback** for templates that
  know nothing of tools (the embedded SmolLM2's plain ChatML): the tool schemas go into the
  system message, the assistant's calls are rendered as ``<tool_call>`` blocks in its text
  and tool results as a user turn of ``<tool_response>`` blocks, which any template renders.
* ``llama3``: a bare JSON object ``{"name": ..., "parameters": {...}}``, optionally after
  ``<|python_tag|>`` (Llama 3.1 - 3.3).
* ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": ...}]`` or
  ``[TOOL_CALLS]name[ARGS]{...}`` (parsed by mlx-lm's ``mistral`` parser).
* ``gpt_oss``: the harmony format, ``<|channel|>commentary to=functions.NAME <|constrain|>json
  <|message|>{...}<|call|>``; its ``analysis`` channel is reasoning.
* ``mlx_lm``: any other family mlx-lm's tokenizer knows (its ``tool_parser`` with its
  markers); no forced call prefix, so ``tool_choice`` required / named is refused for it.

Arguments are always JSON objects. A call the model wrote is kept as the text it wrote
(the server re-renders the agent's last reply from that text, so the cache stays hot); a
call sent back by a client is rendered by the template from its structured form.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import NamedTuple

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
_NAME_RE = re.compile(r'"name"\s*:\s*"([^"\\]*)"')
_ARGS_KEY_RE = re.compile(r'"(?:arguments|parameters)"\s*:\s*')
_HARMONY_END_RE = re.compile(r"<\|end\|>|<\|call\|>|<\|return\|>")
_HARMONY_CHANNEL_RE = re.compile(r"<\|channel\|>(\w+)")
_HARMONY_TO_RE = re.compile(r"to=functions\.([\w.-]+)")


def harmony_messages(text: str) -> list[tuple[str, str | None, str]]:
    """GPT-OSS's messages in ``text``: (channel, function called or None, body)."""
    out = []
    for chunk in text.split("<|start|>"):
        if "<|message|>" not in chunk:
            continue
        head, body = chunk.split("<|message|>", 1)
        channel = _HARMONY_CHANNEL_RE.search(head)
        to = _HARMONY_TO_RE.search(head)
        out.append(
            (
                channel.group(1) if channel else "final",
                to.group(1) if to else None,
                _HARMONY_END_RE.split(body, maxsplit=1)[0],
            )
        )
    return out


class ToolCall(NamedTuple):
    """One call: an id (``call_...``), the function's name and its arguments (an object)."""

    id: str
    name: str
    arguments: dict

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


def loads_object(text: str) -> dict | None:
    """The JSON object at the start of ``text`` (what follows it is ignored), or None."""
    try:
        value, _ = json.JSONDecoder().raw_decode(text.lstrip())
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _call(obj) -> tuple[str, dict] | None:
    """(name, arguments) of ``{"name", "arguments" | "parameters"}``, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        args = loads_object(args)
    return (obj["name"], args) if isinstance(args, dict) else None


def salvage_call(text: str) -> tuple[str | None, dict | None]:
    """What can be read of a damaged call: the name, and the arguments object if one
    starts after ``"arguments":`` and is complete."""
    name = _NAME_RE.search(text)
    args = _ARGS_KEY_RE.search(text)
    return (
        name.group(1) if name else None,
        loads_object(text[args.end() :]) if args else None,
    )


@dataclass(frozen=True)
class ToolFormat:
    """A family's tool-call syntax: markers, parsing, forced prefixes and rendering."""

    family: str
    native: bool  # the chat template renders tools and calls itself
    start: str | None  # what opens a call in a reply (None: no marker, see ``parse``)
    end: str | None  # what closes one (None: the call runs to the end of the reply)
    mistral_args: bool = False  # mistral's newer ``name[ARGS]{...}`` syntax
    parser: object = field(default=None, compare=False, repr=False)  # mlx-lm's, for mlx_lm

    def parse(self, text: str, tools=None) -> list[tuple[str, dict]] | None:
        """The calls in ``text`` (a call's text between the markers, without them), or None
        if it does not parse as calls of this family."""
        text = text.strip()
        if self.family == "hermes":
            call = _call(loads_object(text))
            return [call] if call else None
        if self.family == "llama3":
            calls = [_call(loads_object(part)) for part in text.split(";") if part.strip()]
            return calls if calls and all(calls) else None
        if self.family == "gpt_oss":
            calls = []
            for _, name, body in harmony_messages(text):
                if name is not None:
                    args = loads_object(body)
                    if args is None:
                        return None
                    calls.append((name, args))
            return calls or None
        try:
            parsed = self.parser(text, tools)
        except (ValueError, SyntaxError, AttributeError, TypeError):
            return None
        parsed = parsed if isinstance(parsed, list) else [parsed]
        calls = [_call(p) for p in parsed]
        return calls if calls and all(calls) else None

    def forced_prefix(self, name: str | None) -> str | None:
        """Text that makes the reply a call: of ``name``, or (None) of a tool the model
        names itself. None: this family cannot be forced this way."""
        if self.family == "hermes":
            head = HERMES_START + '\n{"name": "'
            return head if name is None else f'{head}{name}", "arguments": '
        if self.family == "llama3":
            return '{"name": "' if name is None else f'{{"name": "{name}", "parameters": '
        if self.family == "mistral":
            if self.mistral_args:
                return None if name is None else f"[TOOL_CALLS]{name}[ARGS]"
            head = '[TOOL_CALLS][{"name": "'
            return head if name is None else f'{head}{name}", "arguments": '
        if self.family == "gpt_oss":
            if name is None:
                return None
            return f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"
        return None

    def render_call(self, name: str, arguments: dict) -> str:
        """The fallback's text of one call in an assistant message."""
        body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"{HERMES_START}\n{body}\n{HERMES_END}"


FALLBACK_INSTRUCTIONS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def _template_text(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    return template if isinstance(template, str) else ""


def tool_format(tokenizer) -> ToolFormat:
    """The tool-call format of the model behind ``tokenizer`` (an mlx-lm TokenizerWrapper)."""
    template = _template_text(tokenizer)
    knows_tools = "tools" in template
    if "<|channel|>" in template and "to=functions" in template:
        return ToolFormat("gpt_oss", knows_tools, "to=functions.", None)
    if "<|start_header_id|>" in template and (
        "<|python_tag|>" in template or '"parameters"' in template
    ):
        return ToolFormat("llama3", knows_tools, "<|python_tag|>", None)
    if getattr(tokenizer, "has_tool_calling", False):
        start, end = tokenizer.tool_call_start, tokenizer.tool_call_end
        module = getattr(tokenizer.tool_parser, "__module__", "")
        if module.endswith(".json_tools"):
            return ToolFormat("hermes", knows_tools, start, end)
        if start == "[TOOL_CALLS]":
            return ToolFormat(
                "mistral",
                knows_tools,
                start,
                None,
                mistral_args="[ARGS]" in template,
                parser=tokenizer.tool_parser,
            )
        return ToolFormat("mlx_lm", knows_tools, start, end or None, parser=tokenizer.tool_parser)
    return ToolFormat("hermes", False, HERMES_START, HERMES_END)
