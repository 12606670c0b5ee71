"""OpenAI Chat Completions: ``POST /v1/chat/completions`` (stream or not), with tools.

Tool calls come back as ``message.tool_calls`` (arguments a JSON string) with
``finish_reason: "tool_calls"``; streamed, each call is one ``delta.tool_calls`` chunk with
its index, id and name (arguments ``""``), then chunks of its arguments, as the OpenAI SDK
assembles them. A call is streamed once the model has written all of it. Reasoning
(thinking models) is ``reasoning_content``, apart from ``content``.

``response_format`` ``json_object`` / ``json_schema`` (``strict`` or not) constrains the
reply with a grammar (``agentkv.Constraint``): JSON that parses, valid against the schema.
A forced tool call (``tool_choice`` required / named) takes precedence over it.

``logprobs: true`` (and ``top_logprobs``, 0-20) returns each generated token's log-prob
under the model (``agentkv.engine.results.TokenLogprob``) in ``choices[0].logprobs.content``;
streamed, all of them come with the last chunk (the one with ``finish_reason``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field
from starlette.routing import Route

from ..engine.constraints import Constraint
from ..engine.results import ChatResult
from ..errors import InvalidRequestError
from ..tools import ToolCall
from .answer import chat_route
from .common import (
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    parse_body,
    requested_logprobs,
    sampling,
    stop_list,
)
from .endpoint import AppState
from .errors import OPENAI, bad_request
from .identity import first_texts, resolve_agent
from .messages import from_openai
from .replies import Dialect, Reply, in_pieces, openai_logprobs, sse
from .requests import TurnRequest
from .tooling import ToolChoice, check_function, check_unique, openai_tool_choice


class _OpenAIMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: StrictStr
    content: StrictStr | list[dict] | None = None
    tool_calls: list | None = None
    tool_call_id: StrictStr | None = None


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool = False


class _OpenAIChat(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: StrictStr
    messages: Annotated[list[_OpenAIMessage], Field(min_length=1)]
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool | None = False
    stream_options: _StreamOptions | None = None
    user: StrictStr | None = None
    n: StrictInt | None = 1
    tools: list | None = None
    tool_choice: StrictStr | dict | None = None
    parallel_tool_calls: StrictBool | None = None
    functions: list | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    response_format: dict | None = None
    cache_salt: StrictStr | None = None  # as vLLM: prompts share blocks only within a salt


@dataclass
class ChatRequest(TurnRequest):
    """A Chat Completions turn, plus its ``response_format`` as a grammar."""

    constraint: Constraint | None = None  # response_format, unless a tool call is forced


def _response_format(value: dict | None) -> Constraint | None:
    """``response_format`` -> the reply's constraint (None: free text)."""
    kind = None if value is None else value.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return Constraint.json_object()
    if kind != "json_schema":
        raise bad_request(
            "response_format.type must be text, json_object or json_schema", "response_format"
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request(
            "response_format.json_schema must be an object with a name and a schema",
            "response_format.json_schema",
        )
    name, strict = spec.get("name"), spec.get("strict")
    if not isinstance(name, str) or not name:
        raise bad_request(
            "response_format.json_schema.name is required", "response_format.json_schema.name"
        )
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(
            "response_format.json_schema.strict must be a boolean",
            "response_format.json_schema.strict",
        )
    schema = spec.get("schema", {"type": "object"})
    if not isinstance(schema, dict):
        raise bad_request(
            "response_format.json_schema.schema must be a JSON schema object",
            "response_format.json_schema.schema",
        )
    try:
        return Constraint.json_schema(schema, strict=bool(strict))
    except InvalidRequestError as exc:
        raise bad_request(str(exc), "response_format.json_schema.schema") from None


def _tools(req: _OpenAIChat) -> tuple[list[dict] | None, ToolChoice | None]:
    if req.functions:
        raise bad_request("'functions' is deprecated and not supported; use 'tools'", "functions")
    tools = None
    if req.tools:
        tools = []
        for i, tool in enumerate(req.tools):
            where = f"tools[{i}]"
            function = tool.get("function") if isinstance(tool, dict) else None
            if tool.get("type") != "function" or not isinstance(function, dict):
                raise bad_request(f"{where}: only tools of type 'function' are supported", where)
            tools.append(
                check_function(
                    function.get("name"),
                    function.get("description"),
                    function.get("parameters"),
                    where,
                    "function.parameters",
                )
            )
        check_unique(tools, "tools")
    choice = openai_tool_choice(
        req.tool_choice,
        tools,
        req.parallel_tool_calls,
        name_of=lambda c: (
            c["function"].get("name") if isinstance(c.get("function"), dict) else None
        ),
        form="{'type': 'function', 'function': {'name': ...}}",
    )
    return tools, choice


def _call_json(call: ToolCall, index: int | None = None) -> dict:
    out = {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments_json},
    }
    return out if index is None else {"index": index, **out}


def chat_logprobs(result: ChatResult) -> dict | None:
    """A choice's ``logprobs``: its tokens' (``content``), or None where none were asked."""
    content = openai_logprobs(result)
    return None if content is None else {"content": content, "refusal": None}


def _finish(result: ChatResult, calls: list[ToolCall]) -> str:
    if calls:
        return "tool_calls"
    return "length" if result.finish_reason == "length" else "stop"


class OpenAIDialect(Dialect):
    """Chat Completions requests in, completions (or chunk streams) out."""

    api = OPENAI

    def parse(self, body, agent_header: str | None) -> TurnRequest:
        req: _OpenAIChat = parse_body(_OpenAIChat, body)
        model = self.limits.check_model(req.model)
        if req.n not in (None, 1):
            raise bad_request("only n=1 is supported", "n")
        tools, choice = _tools(req)
        logprobs = requested_logprobs(bool(req.logprobs), req.top_logprobs)
        constraint = _response_format(req.response_format)
        messages = from_openai(req.messages)
        if req.max_tokens is not None and req.max_completion_tokens is not None:
            max_tokens = min(req.max_tokens, req.max_completion_tokens)
            param = "max_tokens"
        elif req.max_completion_tokens is not None:
            max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, param = req.max_tokens, "max_tokens"
        temperature, top_p = sampling(req.temperature, req.top_p)
        return ChatRequest(
            agent_id=resolve_agent(agent_header, req.user, *first_texts(messages)),
            messages=messages,
            model=model,
            max_tokens=self.limits.check_max_tokens(max_tokens, param, model),
            temperature=temperature,
            top_p=top_p,
            stop=stop_list(req.stop, "stop"),
            stream=bool(req.stream),
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            cache_salt=req.cache_salt,
            tools=tools,
            tool_choice=choice,
            constraint=constraint,
            logprobs=logprobs,
        )

    @staticmethod
    def _usage(counts: dict, generated: int) -> dict:
        return {
            "prompt_tokens": counts["prompt"],
            "completion_tokens": generated,
            "total_tokens": counts["prompt"] + generated,
            "prompt_tokens_details": {"cached_tokens": counts["reused"]},
        }

    def response(self, reply: Reply) -> dict:
        parser, calls = reply.parser, reply.calls
        message = {"role": "assistant", "content": parser.content}
        if calls:
            message["content"] = parser.content.strip() or None
            message["tool_calls"] = [_call_json(c) for c in calls]
        if parser.reasoning:
            message["reasoning_content"] = parser.reasoning
        choice = {
            "index": 0,
            "message": message,
            "finish_reason": _finish(reply.result, calls),
            "logprobs": chat_logprobs(reply.result),
        }
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": reply.req.model,
            "choices": [choice],
            "usage": self._usage(reply.counts, reply.generated),
            "agentkv": reply.agentkv,
        }

    async def stream(self, reply: Reply) -> AsyncIterator[str]:
        chunks = _Chunks(reply.req)
        yield chunks.chunk({"role": "assistant", "content": ""})
        async for line in reply.written(chunks):
            yield line
        # the tokens' log-probs come whole with the last chunk (the text is streamed in
        # pieces that a stop string or a tool call may hold back, not token by token)
        yield chunks.chunk({}, _finish(reply.result, reply.calls), chat_logprobs(reply.result))
        if reply.req.include_usage:
            usage = self._usage(reply.counts, reply.generated)
            yield sse({**chunks.base, "choices": [], "usage": usage, "agentkv": reply.agentkv})
        yield sse("[DONE]")


class _Chunks:
    """The chunks of a streamed completion (one choice); its calls indexed in order."""

    def __init__(self, req: TurnRequest):
        self.base = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": req.model,
        }
        self.extra = {"usage": None} if req.include_usage else {}
        self.calls = 0

    def chunk(
        self, delta: dict, finish_reason: str | None = None, logprobs: dict | None = None
    ) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        choice["logprobs"] = logprobs
        return sse({**self.base, "choices": [choice], **self.extra})

    def text(self, kind: str, text: str) -> list[str]:
        key = "reasoning_content" if kind == "reasoning" else "content"
        return [self.chunk({key: text})]

    def call(self, call: ToolCall) -> list[str]:
        """A call: its index, id and name (arguments ""), then its arguments in pieces."""
        index, self.calls = self.calls, self.calls + 1
        head = _call_json(call, index)
        head["function"]["arguments"] = ""
        deltas = [head] + [
            {"index": index, "function": {"arguments": piece}}
            for piece in in_pieces(call.arguments_json)
        ]
        return [self.chunk({"tool_calls": [delta]}) for delta in deltas]


def routes(state: AppState) -> list[Route]:
    return [chat_route(state, "/v1/chat/completions", OpenAIDialect(state.limits))]
