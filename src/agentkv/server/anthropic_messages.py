"""Anthropic Messages: ``POST /v1/messages`` (stream or not), with tool use.

Tools are ``{name, description, input_schema}``; calls come back as ``tool_use`` content
blocks with ``stop_reason: "tool_use"`` and results go in as ``tool_result`` blocks of a
user message. Streamed, a call is a ``tool_use`` ``content_block_start`` followed by
``input_json_delta`` pieces of its input, once the model has written all of it. Reasoning
(thinking models) is a ``thinking`` block before the text.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.routing import Route

from ..engine.results import ChatResult
from ..tools import ToolCall
from .answer import chat_route
from .common import StrictBool, StrictFloat, StrictInt, StrictStr, parse_body, sampling, stop_list
from .endpoint import AppState
from .errors import ANTHROPIC, bad_request
from .identity import first_texts, resolve_agent
from .messages import from_anthropic
from .replies import Dialect, Reply, in_pieces, sse
from .requests import TurnRequest
from .tooling import ToolChoice, check_choice, check_function, check_unique

CHOICE_MODES = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}


class _AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["user", "assistant"]
    content: StrictStr | list[dict]


class _Metadata(BaseModel):
    model_config = ConfigDict(extra="allow")
    user_id: StrictStr | None = None


class _AnthropicMessages(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: StrictStr
    max_tokens: StrictInt
    messages: Annotated[list[_AnthropicMessage], Field(min_length=1)]
    system: StrictStr | list[dict] | None = None
    stop_sequences: list[StrictStr] | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    stream: StrictBool | None = False
    metadata: _Metadata | None = None
    tools: list | None = None
    tool_choice: dict | None = None
    cache_salt: StrictStr | None = None


def _tools(req) -> tuple[list[dict] | None, ToolChoice | None]:
    tools = None
    if req.tools:
        tools = []
        for i, tool in enumerate(req.tools):
            where = f"tools[{i}]"
            if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
                raise bad_request(
                    f"{where}: only client tools ({{name, description, input_schema}}) are "
                    "supported",
                    where,
                )
            if not isinstance(tool.get("input_schema"), dict):
                raise bad_request(f"{where}.input_schema must be a JSON schema object", where)
            tools.append(
                check_function(
                    tool.get("name"),
                    tool.get("description"),
                    tool["input_schema"],
                    where,
                    "input_schema",
                )
            )
        check_unique(tools, "tools")
    choice = req.tool_choice
    if choice is None:
        return tools, check_choice(ToolChoice("auto" if tools else "none"), tools, "tool_choice")
    mode = CHOICE_MODES.get(choice.get("type"))
    if mode is None:
        raise bad_request("tool_choice.type must be auto, any, tool or none", "tool_choice")
    name = choice.get("name")
    if mode == "named" and not isinstance(name, str):
        raise bad_request("tool_choice of type 'tool' needs a name", "tool_choice.name")
    parallel = choice.get("disable_parallel_tool_use") is not True
    return tools, check_choice(ToolChoice(mode, name, parallel), tools, "tool_choice")


def _tool_use(call: ToolCall) -> dict:
    call_id = "toolu_" + call.id.removeprefix("call_")
    return {"type": "tool_use", "id": call_id, "name": call.name, "input": call.arguments}


class AnthropicDialect(Dialect):
    """Messages requests in, messages (or event streams) out."""

    api = ANTHROPIC

    def parse(self, body, agent_header: str | None) -> TurnRequest:
        req: _AnthropicMessages = parse_body(_AnthropicMessages, body)
        model = self.limits.check_model(req.model)
        tools, choice = _tools(req)
        messages = from_anthropic(req.system, req.messages)
        temperature, top_p = sampling(req.temperature, req.top_p)
        user = req.metadata.user_id if req.metadata else None
        return TurnRequest(
            agent_id=resolve_agent(agent_header, user, *first_texts(messages)),
            messages=messages,
            model=model,
            max_tokens=self.limits.check_max_tokens(req.max_tokens, "max_tokens", model),
            temperature=temperature,
            top_p=top_p,
            stop=stop_list(req.stop_sequences, "stop_sequences"),
            stream=bool(req.stream),
            cache_salt=req.cache_salt,
            tools=tools,
            tool_choice=choice,
        )

    @staticmethod
    def _stop(result: ChatResult, calls) -> tuple[str, str | None]:
        if calls:
            return "tool_use", None
        if result.stop_sequence is not None:
            return "stop_sequence", result.stop_sequence
        if result.finish_reason == "length":
            return "max_tokens", None
        return "end_turn", None

    @staticmethod
    def _usage(counts: dict, generated: int) -> dict:
        return {
            "input_tokens": counts["prefill"],
            "cache_read_input_tokens": counts["reused"],
            "cache_creation_input_tokens": 0,
            "output_tokens": generated,
        }

    def response(self, reply: Reply) -> dict:
        parser, calls = reply.parser, reply.calls
        content = []
        if parser.reasoning:
            content.append({"type": "thinking", "thinking": parser.reasoning, "signature": ""})
        if parser.content.strip() or not calls:
            content.append({"type": "text", "text": parser.content})
        content += [_tool_use(c) for c in calls]
        stop = self._stop(reply.result, calls)
        usage = self._usage(reply.counts, reply.generated)
        return {**_message(reply.req, content, stop, usage), "agentkv": reply.agentkv}

    async def stream(self, reply: Reply) -> AsyncIterator[str]:
        message = _message(reply.req, [], (None, None), self._usage(reply.counts, 0))
        yield sse({"type": "message_start", "message": message}, "message_start")
        blocks = _Blocks()
        async for line in reply.written(blocks, heartbeat=sse({"type": "ping"}, "ping")):
            yield line
        for line in blocks.close(empty_text=not reply.calls):
            yield line
        reason, sequence = self._stop(reply.result, reply.calls)
        yield sse(
            {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": {"output_tokens": reply.generated},
                "agentkv": reply.agentkv,
            },
            "message_delta",
        )
        yield sse({"type": "message_stop"}, "message_stop")


def _message(req: TurnRequest, content: list, stop: tuple, usage: dict) -> dict:
    """A message object; ``stop``: its (stop_reason, stop_sequence)."""
    return {
        "id": f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "model": req.model,
        "content": content,
        "stop_reason": stop[0],
        "stop_sequence": stop[1],
        "usage": usage,
    }


class _Blocks:
    """The content blocks of a streamed message: one open at a time, indexed in order."""

    def __init__(self):
        self.index = -1
        self.open: str | None = None  # the kind of the open block

    def _start(self, block: dict) -> list[str]:
        out = self._stop()
        self.index += 1
        self.open = block["type"]
        start = {"type": "content_block_start", "index": self.index, "content_block": block}
        return [*out, sse(start, "content_block_start")]

    def _stop(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [sse({"type": "content_block_stop", "index": self.index}, "content_block_stop")]

    def _delta(self, delta: dict) -> str:
        body = {"type": "content_block_delta", "index": self.index, "delta": delta}
        return sse(body, "content_block_delta")

    def text(self, kind: str, text: str) -> list[str]:
        out = []
        if kind == "reasoning":
            if self.open != "thinking":
                out += self._start({"type": "thinking", "thinking": "", "signature": ""})
            return [*out, self._delta({"type": "thinking_delta", "thinking": text})]
        if self.open != "text":
            out += self._start({"type": "text", "text": ""})
        return [*out, self._delta({"type": "text_delta", "text": text})]

    def call(self, call: ToolCall) -> list[str]:
        out = self._start({**_tool_use(call), "input": {}})
        for piece in in_pieces(call.arguments_json):
            out.append(self._delta({"type": "input_json_delta", "partial_json": piece}))
        return [*out, *self._stop()]

    def close(self, *, empty_text: bool) -> list[str]:
        """Stop the open block; a message with no block at all gets an empty text block."""
        out = []
        if self.index < 0 and empty_text:
            out += self._start({"type": "text", "text": ""})
        return out + self._stop()


def routes(state: AppState) -> list[Route]:
    return [chat_route(state, "/v1/messages", AnthropicDialect(state.limits))]
