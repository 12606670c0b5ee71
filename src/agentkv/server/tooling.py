"""Tool calling for both chat APIs: the declared tools and ``tool_choice``, validated; the
turn's prompt options (a forced call prefix); the reply parser; and the replay of the
agent's own earlier replies, so the cache stays hot across tool turns.

``tool_choice``:

* ``none``: the tools are in the prompt, no call is looked for in the reply.
* ``auto`` (the default with tools): calls the model writes in its family's format are
  returned as calls; text that does not parse as a call of a declared tool stays text. For
  the Hermes format a lazy grammar leaves the text free but makes a call, once the model
  opens one (``<tool_call>``), a valid call of a declared tool.
* ``required`` / a named tool: the reply is *forced* to open a call (the format's call
  prefix is appended to the prompt: ``<tool_call>\\n{"name": "NAME", "arguments": `` for a
  named tool, up to ``{"name": "`` for required), so it always returns exactly one call of a
  declared tool. For the Hermes format (and the fallback) and Llama 3's, a grammar
  (``agentkv.Constraint``, constrained decoding) then makes the model finish the call: a
  declared name and arguments valid against the tool's schema, written as ``json.dumps``
  writes JSON. Other families get the prefix alone: their arguments are what the model
  wrote when they parse as a JSON object, else ``{}``, and for required a name that is not
  declared becomes the closest declared one. A call cut short by ``max_tokens`` also gets
  ``{}``.

The cache: the agent's history keeps each reply as the text the model wrote (call prefix
included). A later request sends the calls back in structured form; each assistant message
that is one of those replies (same calls, same text) is rendered as the model's own text
again, so the new prompt extends what the cache holds, byte for byte.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import anyio

from ..engine.constraints import Constraint, json_schema_problem
from ..engine.messages import validate_messages
from ..tools import ReplyParser, ToolFormat
from .errors import bad_request

TOOL_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
# Families whose forced calls a grammar finishes: how ``Constraint.tool_calls`` writes one.
# (Mistral's and GPT-OSS's calls open with special tokens, which a grammar over text does
# not take here: they get the prefix alone.)
CALL_GRAMMARS = {
    "hermes": {},
    "llama3": {"begin": "", "end": "", "arguments_key": "parameters"},
}
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # none | auto | required | named
    name: str | None = None  # for named
    parallel: bool = True


def check_function(name, description, parameters, where: str, field: str = "parameters") -> dict:
    """One function tool, in the shape chat templates take (OpenAI's); its ``field`` (the
    API's name of the parameters) must be a JSON schema a call's arguments can follow."""
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise bad_request(
            f"{where}: a tool's name must be 1-64 letters, digits, '_', '.' or '-'", where
        )
    if description is not None and not isinstance(description, str):
        raise bad_request(f"{where}: description must be a string", where)
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise bad_request(f"{where}: the parameters schema must be a JSON object", where)
    problem = json_schema_problem(parameters, strict=False)  # as tool calls are followed
    if problem:
        raise bad_request(
            f"{where}.{field} is not a JSON schema calls can follow: {problem}", where
        )
    function = {"name": name, "description": description or "", "parameters": parameters}
    return {"type": "function", "function": function}


def check_unique(tools: list[dict], param: str) -> list[dict]:
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tool names must be unique", param)
    return tools


def openai_tool_choice(choice, tools: list[dict], parallel_tool_calls, *, name_of, form: str):
    """OpenAI's ``tool_choice`` (none / auto / required / a function), checked against
    ``tools``. Chat Completions and Responses spell the named form apart: ``name_of`` reads
    its name, ``form`` is what the error says it must be."""
    if choice is None:
        mode, name = ("auto" if tools else "none"), None
    elif isinstance(choice, str):
        if choice not in CHOICES:
            raise bad_request(f"tool_choice must be one of {CHOICES} or a function", "tool_choice")
        mode, name = choice, None
    else:
        name = name_of(choice)
        if choice.get("type") != "function" or not isinstance(name, str):
            raise bad_request(f"tool_choice must be {form}", "tool_choice")
        mode = "named"
    parallel = parallel_tool_calls is not False
    return check_choice(ToolChoice(mode, name, parallel), tools, "tool_choice")


def check_choice(choice: ToolChoice, tools: list[dict] | None, param: str) -> ToolChoice:
    if not tools and choice.mode in ("required", "named"):
        raise bad_request(f"{param} {choice.mode!r} needs tools", param)
    if choice.mode == "named" and choice.name not in [t["function"]["name"] for t in tools]:
        raise bad_request(f"{param}: no tool named {choice.name!r} is declared", param)
    return choice


def parse_arguments(text, where: str) -> dict:
    """A call's arguments as clients send them back (a JSON string) -> an object."""
    if isinstance(text, dict):
        return text
    try:
        value = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise bad_request(f"{where} must be a JSON object (as a string)", where)
    return value


@dataclass
class TurnTools:
    """What a turn's tools change: its messages (replayed), tools, reply prefix, grammar
    and parser."""

    messages: list[dict]
    tools: list[dict] | None
    reply_prefix: str
    constraint: Constraint | None
    parser: ReplyParser

    @property
    def options(self) -> dict:
        """The engine's ``submit_chat`` options for them: tools, reply prefix, constraint."""
        return {name: getattr(self, name) for name in ("tools", "reply_prefix", "constraint")}


def _think(tokenizer) -> tuple[str, str] | None:
    if getattr(tokenizer, "has_thinking", False):
        return tokenizer.think_start, tokenizer.think_end
    return None


def _calls_of(message: dict) -> list[tuple[str, dict]]:
    return [
        (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []
    ]


def _reads_as(raw: str, sent: dict, fmt: ToolFormat, tools, think) -> bool:
    """Whether the model's text ``raw`` is the reply ``sent`` (same calls, same text)."""
    names = [t["function"]["name"] for t in tools or []]
    names += [name for name, _ in _calls_of(sent) if name not in names]
    tools = [{"type": "function", "function": {"name": name}} for name in names]
    openings = [(fmt.forced_prefix(None), None)] + [(fmt.forced_prefix(n), n) for n in names]
    forced = [(p, n) for p, n in openings if p and raw.startswith(p)]
    tries = [max(forced, key=lambda o: len(o[0]))] if forced else []
    for prefix, name in [*tries, (None, None)]:
        parser = ReplyParser(fmt, tools=tools, think=think, forced=prefix, forced_name=name)
        parser.feed(raw[len(prefix or "") :])
        parser.finish()
        calls = [(c.name, c.arguments) for c in parser.calls]
        if calls == _calls_of(sent) and parser.content.strip() == sent["content"].strip():
            return True
    return False


def replay(messages: list[dict], history, fmt: ToolFormat, tools, think) -> list[dict]:
    """``messages`` with each assistant message that is one of the agent's stored replies
    written as the model's own text (up to the first message that differs)."""
    if not history:
        return messages
    out = list(messages)
    for i, (stored, sent) in enumerate(zip(history, messages)):
        if stored == sent:
            continue
        if (
            stored.get("role") == sent["role"] == "assistant"
            and isinstance(stored.get("content"), str)
            and not stored.get("tool_calls")
            and _reads_as(stored["content"], sent, fmt, tools, think)
        ):
            out[i] = {"role": "assistant", "content": stored["content"]}
            continue
        break
    return out


def _params(tools: list[dict]) -> dict:
    return {t["function"]["name"]: t["function"]["parameters"] for t in tools}


async def prepare(
    engine, agent_id: str, messages: list[dict], tools, choice: ToolChoice | None
) -> TurnTools:
    """The turn's messages, tools, reply prefix and parser on ``engine``'s model."""
    fmt: ToolFormat = engine.tool_format
    think = _think(engine.loaded.tokenizer)
    messages = validate_messages(messages)  # the shape the agent's history keeps
    if think or any(m.get("tool_calls") for m in messages):
        history = await anyio.to_thread.run_sync(engine.history, agent_id)
        messages = replay(messages, history, fmt, tools, think)
    prefix, forced_name, constraint = "", None, None
    if choice is not None and choice.mode in ("required", "named"):
        forced_name = choice.name
        if choice.mode == "required" and len(tools) == 1:
            forced_name = tools[0]["function"]["name"]
        prefix = fmt.forced_prefix(forced_name)
        if prefix is None:
            raise bad_request(
                f"tool_choice {choice.mode!r} is not supported for this model's tool format "
                f"({fmt.family}); use 'auto'",
                "tool_choice",
            )
        shape = CALL_GRAMMARS.get(fmt.family)
        if shape is not None:
            allowed = [t for t in tools if forced_name in (None, t["function"]["name"])]
            constraint = Constraint.tool_calls(_params(allowed), strict=False, **shape)
    elif choice is not None and choice.mode == "auto" and fmt.family == "hermes":
        # free text, but a call once begun must be a valid call of a declared tool
        constraint = Constraint.tool_calls(_params(tools), strict=False, required=False)
    in_reasoning = False
    if think and not prefix:
        prompt = engine.render_chat(messages, tools=tools)
        in_reasoning = prompt.rfind(think[0]) > prompt.rfind(think[1])
    parser = ReplyParser(
        fmt,
        tools=tools if choice is not None and choice.mode != "none" else None,
        think=think,
        in_reasoning=in_reasoning,
        forced=prefix or None,
        forced_name=forced_name,
    )
    return TurnTools(messages, tools, prefix, constraint, parser)
