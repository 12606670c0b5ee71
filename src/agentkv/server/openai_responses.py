"""OpenAI Responses: ``POST /v1/responses`` (stream or not), ``GET`` / ``DELETE
/v1/responses/{id}``.

Input is a string or a list of input items: messages (roles user, system, developer,
assistant; text, ``input_text`` or ``output_text`` parts), ``function_call`` items (the
calls an earlier response made) and ``function_call_output`` items (their results).
``instructions`` is the system message. Function tools are flat
(``{type: "function", name, description, parameters, strict}``); ``tool_choice`` is none /
auto / required / ``{type: "function", name}``, as in Chat Completions. ``text.format``
``json_object`` / ``json_schema`` constrains the reply to JSON (``agentkv.Constraint``):
valid against the schema, even from the 135M model (a forced tool call takes precedence).
Output items: a ``message`` with ``output_text`` content, ``function_call`` items
(``call_id``, ``name``, ``arguments`` a JSON string), a ``reasoning`` item for thinking
models. ``status`` is ``incomplete`` (``incomplete_details.reason: "max_output_tokens"``)
when ``max_output_tokens`` cut the reply.

A chain of responses is an agent. The first response of a chain names it (the
``x-agent-id`` header, else ``user``, else ``auto-<hash>`` of the instructions and the first
user message, as for the other APIs); a response with ``previous_response_id`` continues
the agent of the response it names, whose conversation (stored with the response) comes
before the new input items. So a client sends only what is new, and the turn is rendered
as the agent's cache holds it: nothing is prefilled again (hot, or warm after a restart).
Instructions are not carried over (as OpenAI's API does): each request gives its own.
Responses are stored (``store``, default true) under ``<cache dir>/responses/`` and survive
a restart; ``GET`` returns one, ``DELETE`` forgets it (the agent's cache stays).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio
from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from ..engine.constraints import Constraint
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
)
from .endpoint import AppState, endpoint
from .errors import RESPONSES, APIError, bad_request
from .identity import first_texts, resolve_agent
from .messages import check_results, tool_call, tool_result
from .replies import Dialect, Reply, in_pieces, openai_logprobs, sse
from .requests import TurnRequest
from .response_store import ResponseStore, valid_id
from .tooling import (
    ToolChoice,
    check_function,
    check_unique,
    openai_tool_choice,
    parse_arguments,
)

MAX_METADATA = 16
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text", "text")
LOGPROBS = "message.output_text.logprobs"  # the ``include`` value that asks for them
SKIPPED_ITEMS = ("reasoning",)  # the reply's own text is replayed from the agent's history


class _Responses(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: StrictStr | None = None
    input: object = None  # a string or a list of items: checked in parse
    instructions: StrictStr | None = None
    tools: list | None = None
    tool_choice: StrictStr | dict | None = None
    parallel_tool_calls: StrictBool | None = None
    max_output_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    text: dict | None = None
    store: StrictBool | None = True
    metadata: dict | None = None
    stream: StrictBool | None = False
    previous_response_id: StrictStr | None = None
    user: StrictStr | None = None
    background: StrictBool | None = None
    conversation: StrictStr | dict | None = None
    cache_salt: StrictStr | None = None
    include: list[StrictStr] | None = None
    top_logprobs: StrictInt | None = None


@dataclass
class ResponsesRequest(TurnRequest):
    """A Responses request: the turn, plus what its response and record repeat."""

    constraint: Constraint | None = None  # text.format, unless a tool call is forced
    conversation: list[dict] = field(default_factory=list)  # messages, instructions apart
    echo: dict = field(default_factory=dict)  # request fields the response object repeats
    store: bool = True


# -- request ------------------------------------------------------------------------------------


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text parts", where)
    parts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(
                f"{where}[{i}]: content of type {kind!r} is not supported; only text "
                "(input_text, output_text)",
                f"{where}[{i}]",
            )
        parts.append(part["text"])
    return "".join(parts)


def _items(value) -> list[dict]:
    """Input items -> normalized messages (a function_call joins the assistant message
    before it; function_call_output items are tool results)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    out: list[dict] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = ROLES.get(item.get("role"))
            if role is None:
                raise bad_request(
                    f"{where}.role must be user, system, developer or assistant", f"{where}.role"
                )
            out.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call_id, name = item.get("call_id"), item.get("name")
            if not isinstance(call_id, str) or not call_id or not isinstance(name, str):
                raise bad_request(f"{where}: a function_call needs a call_id and a name", where)
            arguments = parse_arguments(item.get("arguments"), f"{where}.arguments")
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                out.append(last)
            last.setdefault("tool_calls", []).append(tool_call(call_id, name, arguments))
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise bad_request(f"{where}.call_id is required", f"{where}.call_id")
            output = _text(item.get("output"), f"{where}.output")
            out.append(tool_result(call_id, "", output))
        elif kind in SKIPPED_ITEMS:
            continue
        else:
            raise bad_request(
                f"{where}: input items of type {kind!r} are not supported (message, "
                "function_call, function_call_output)",
                f"{where}.type",
            )
    return out


def _check_outputs(messages: list[dict], first_new: int) -> None:
    """Each function_call_output answers a function_call before it (in this input or in
    the chain it continues); ``first_new``: where this request's input items begin."""
    calls: set[str] = set()
    for i, m in enumerate(messages):
        if m["role"] != "tool":
            calls = {c["id"] for c in m.get("tool_calls") or []}
        elif m["tool_call_id"] not in calls:
            where = "input" if i >= first_new else "previous_response_id"
            raise bad_request(
                f"{where}: function_call_output {m['tool_call_id']!r} answers no function_call "
                "of the assistant turn before it",
                where,
            )


def _tools(req: _Responses) -> tuple[list[dict] | None, list[dict], ToolChoice | None]:
    """(tools in the chat templates' shape, as the response repeats them, the choice)."""
    tools, echo = None, []
    if req.tools:
        tools = []
        for i, tool in enumerate(req.tools):
            where = f"tools[{i}]"
            if not isinstance(tool, dict) or tool.get("type") != "function":
                raise bad_request(f"{where}: only tools of type 'function' are supported", where)
            strict = tool.get("strict")
            if strict is not None and not isinstance(strict, bool):
                raise bad_request(f"{where}.strict must be a boolean", f"{where}.strict")
            checked = check_function(
                tool.get("name"), tool.get("description"), tool.get("parameters"), where
            )
            tools.append(checked)
            function = checked["function"]
            echo.append({"type": "function", **function, "strict": strict})
        check_unique(tools, "tools")
    choice = openai_tool_choice(
        req.tool_choice,
        tools,
        req.parallel_tool_calls,
        name_of=lambda c: c.get("name"),
        form="none, auto, required or {'type': 'function', 'name': ...}",
    )
    return tools, echo, choice


def _format(text: dict | None) -> tuple[dict, Constraint | None]:
    """``text.format`` -> (the format the response repeats, its constraint)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return {"type": "text"}, None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return {"type": "text"}, None
    if kind == "json_object":
        return {"type": "json_object"}, Constraint.json_object()
    if kind == "json_schema":
        schema, strict = fmt.get("schema"), fmt.get("strict")
        if not isinstance(schema, dict):
            raise bad_request("text.format.schema must be a JSON schema object", "text.format")
        if strict is not None and not isinstance(strict, bool):
            raise bad_request("text.format.strict must be a boolean", "text.format.strict")
        name = fmt.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request("text.format.name is required", "text.format.name")
        constraint = Constraint.json_schema(schema, strict=bool(strict))
        return {**fmt, "strict": bool(strict)}, constraint
    raise bad_request("text.format.type must be text, json_object or json_schema", "text.format")


def _metadata(value) -> dict | None:
    if value is None:
        return None
    if len(value) > MAX_METADATA or not all(
        isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
        for k, v in value.items()
    ):
        raise bad_request(
            f"metadata: at most {MAX_METADATA} string values (keys up to 64 characters, "
            "values up to 512)",
            "metadata",
        )
    return value


def _logprobs(req: _Responses) -> int | None:
    """The engine's ``logprobs`` from ``include`` (``LOGPROBS`` in it) and ``top_logprobs``;
    other ``include`` values name output this server does not make, and change nothing."""
    wanted = LOGPROBS in (req.include or [])
    if wanted and req.stream:
        raise bad_request(
            f"include {LOGPROBS!r} is served without streaming only (stream: false)", "include"
        )
    return requested_logprobs(wanted, req.top_logprobs, needs=f"include [{LOGPROBS!r}]")


# -- response -----------------------------------------------------------------------------------


def _hex() -> str:
    return uuid.uuid4().hex


def _function_call(call: ToolCall, item_id: str, arguments: str | None = None) -> dict:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments_json if arguments is None else arguments,
        "status": "completed" if arguments is None else "in_progress",
    }


def _message(item_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [_output_text(text)]
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": content,
    }


def _output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning(item_id: str, text: str | None) -> dict:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content}


def routes(state: AppState, store: ResponseStore) -> list[Route]:
    dialect = ResponsesDialect(state.limits, store)

    async def get_response(request: Request) -> JSONResponse:
        record = await dialect.load(request.path_params["response_id"])
        return JSONResponse(record["response"])

    async def delete_response(request: Request) -> JSONResponse:
        return JSONResponse(await dialect.delete(request.path_params["response_id"]))

    one = "/v1/responses/{response_id}"
    return [
        chat_route(state, "/v1/responses", dialect),
        Route(one, endpoint(state, RESPONSES, get_response), methods=["GET"]),
        Route(one, endpoint(state, RESPONSES, delete_response), methods=["DELETE"]),
    ]


@dataclass
class ResponsesDialect(Dialect):
    """Responses requests in, response objects (or event streams) out; stored responses."""

    api = RESPONSES
    store: ResponseStore

    async def parse(self, body, agent_header: str | None) -> ResponsesRequest:
        req: _Responses = parse_body(_Responses, body)
        if req.background:
            raise bad_request("background responses are not supported", "background")
        if req.conversation is not None:
            raise bad_request(
                "conversations are not supported; chain responses with previous_response_id",
                "conversation",
            )
        if not isinstance(req.input, (str, list)) or not req.input:
            raise bad_request("input is required: a string or a list of input items", "input")
        previous = None
        if req.previous_response_id is not None:
            previous = await self.load(req.previous_response_id, "previous_response_id")
        model = req.model or (previous["model"] if previous else self.limits.model_id)
        model = self.limits.check_model(model)
        tools, tools_echo, choice = _tools(req)
        text_format, constraint = _format(req.text)
        earlier = previous["conversation"] if previous else []
        conversation = [*earlier, *_items(req.input)]
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        _check_outputs(conversation, len(earlier))
        messages = check_results([*system, *conversation])
        if previous is not None and agent_header is None:
            agent_id = previous["agent_id"]
        else:
            agent_id = resolve_agent(agent_header, req.user, *first_texts(messages))
        temperature, top_p = sampling(req.temperature, req.top_p)
        max_tokens = self.limits.check_max_tokens(req.max_output_tokens, "max_output_tokens", model)
        logprobs = _logprobs(req)
        echo = {
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": _metadata(req.metadata) or {},
            "parallel_tool_calls": choice.parallel,
            "previous_response_id": req.previous_response_id,
            "text": {"format": text_format},
            "tool_choice": (
                {"type": "function", "name": choice.name} if choice.mode == "named" else choice.mode
            ),
            "tools": tools_echo,
            "truncation": "disabled",
            "user": req.user,
            "store": req.store is not False,
        }
        return ResponsesRequest(
            agent_id=agent_id,
            messages=messages,
            model=model,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            stream=bool(req.stream),
            cache_salt=req.cache_salt,
            tools=tools,
            tool_choice=choice,
            constraint=constraint,
            conversation=conversation,
            echo=echo,
            store=req.store is not False,
            logprobs=logprobs,
        )

    async def load(self, response_id: str, param: str | None = None) -> dict:
        """The stored record of ``response_id``: 400 for a malformed id, 404 for none."""
        if not valid_id(response_id):
            raise bad_request(f"{response_id!r} is not a response id (resp_<32 hex>)", param)
        record = await anyio.to_thread.run_sync(self.store.get, response_id)
        if record is None:
            raise APIError(404, "not_found", f"no stored response {response_id!r}", param=param)
        return record

    async def delete(self, response_id: str) -> dict:
        if not valid_id(response_id):
            raise bad_request(f"{response_id!r} is not a response id (resp_<32 hex>)")
        if not await anyio.to_thread.run_sync(self.store.delete, response_id):
            raise APIError(404, "not_found", f"no stored response {response_id!r}")
        return {"id": response_id, "object": "response", "deleted": True}

    # -- the response object --------------------------------------------------------------------

    @staticmethod
    def _usage(counts: dict, generated: int) -> dict:
        return {
            "input_tokens": counts["prompt"],
            "input_tokens_details": {"cached_tokens": counts["reused"]},
            "output_tokens": generated,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": counts["prompt"] + generated,
        }

    def _object(self, req: ResponsesRequest, response_id: str, created: int, **state) -> dict:
        return {
            "id": response_id,
            "object": "response",
            "created_at": created,
            "status": "in_progress",
            "error": None,
            "incomplete_details": None,
            "model": req.model,
            "output": [],
            "usage": None,
            **req.echo,
            "temperature": req.temperature,  # the model's default where the request named none
            "top_p": req.top_p,
            **state,
        }

    @staticmethod
    def _status(reply: Reply) -> dict:
        if reply.result.finish_reason == "length" and not reply.calls:
            return {"status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"}}
        return {"status": "completed", "incomplete_details": None}

    @staticmethod
    def _kept_message(reply: Reply) -> dict:
        """The assistant message the conversation keeps (calls structured: the agent's own
        text is replayed from its history; a plain reply as the model wrote it)."""
        if not reply.calls:
            return {"role": "assistant", "content": reply.result.text}
        return {
            "role": "assistant",
            "content": reply.parser.content.strip(),
            "tool_calls": [tool_call(c.id, c.name, c.arguments) for c in reply.calls],
        }

    async def _save(self, reply: Reply, response: dict) -> None:
        req = reply.req
        if not req.store:
            return
        record = {
            "id": response["id"],
            "agent_id": req.agent_id,
            "model": req.model,
            "conversation": [*req.conversation, self._kept_message(reply)],
            "response": response,
        }
        await anyio.to_thread.run_sync(self.store.put, record)

    async def response(self, reply: Reply) -> dict:
        parser, calls = reply.parser, reply.calls
        status = self._status(reply)
        output = []
        if parser.reasoning:
            output.append(_reasoning(f"rs_{_hex()}", parser.reasoning))
        if parser.content.strip() or not calls:
            message_status = "incomplete" if status["status"] == "incomplete" else "completed"
            message = _message(f"msg_{_hex()}", parser.content, message_status)
            if reply.result.logprobs is not None:
                message["content"][0]["logprobs"] = openai_logprobs(reply.result)
            output.append(message)
        output += [_function_call(c, f"fc_{_hex()}") for c in calls]
        body = self._object(
            reply.req,
            f"resp_{_hex()}",
            int(time.time()),
            output=output,
            usage=self._usage(reply.counts, reply.generated),
            **status,
        )
        await self._save(reply, body)
        return {**body, "agentkv": reply.agentkv}

    async def stream(self, reply: Reply) -> AsyncIterator[str]:
        events = _Events(self._object(reply.req, f"resp_{_hex()}", int(time.time())))
        yield events.emit("response.created", response=events.snapshot())
        yield events.emit("response.in_progress", response=events.snapshot())
        async for line in reply.written(events):
            yield line
        status = self._status(reply)
        for line in events.close(empty_message=not reply.calls, status=status["status"]):
            yield line
        body = events.snapshot(usage=self._usage(reply.counts, reply.generated), **status)
        await self._save(reply, body)
        kind = "response.completed" if status["status"] == "completed" else "response.incomplete"
        yield events.emit(kind, response={**body, "agentkv": reply.agentkv})


class _Events:
    """The events of a streamed response, numbered, with the output items as they stand."""

    def __init__(self, response: dict):
        self.response = response
        self.output: list[dict] = []
        self.sequence = 0
        self.open: dict | None = None  # the message or reasoning item being written

    def snapshot(self, **state) -> dict:
        return {**self.response, "output": [dict(item) for item in self.output], **state}

    def emit(self, kind: str, **fields) -> str:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return sse(event, kind)

    def _add(self, item: dict) -> str:
        self.output.append(item)
        return self.emit("response.output_item.added", output_index=len(self.output) - 1, item=item)

    def _done(self, item: dict) -> str:
        index = self.output.index(item)
        return self.emit("response.output_item.done", output_index=index, item=item)

    def text(self, kind: str, text: str) -> list[str]:
        out = []
        item_kind = "reasoning" if kind == "reasoning" else "message"
        if self.open is None or self.open["type"] != item_kind:
            out += self._close("completed")
            if item_kind == "message":
                item = _message(f"msg_{_hex()}", None, "in_progress")
            else:
                item = _reasoning(f"rs_{_hex()}", None)
            out.append(self._add(item))
            self.open = {"type": item_kind, "item": item, "text": ""}
            if item_kind == "message":
                out.append(self._part("response.content_part.added", _output_text("")))
        self.open["text"] += text
        where = self._where()
        if item_kind == "message":
            out.append(self.emit("response.output_text.delta", **where, delta=text, logprobs=[]))
        else:
            out.append(self.emit("response.reasoning_text.delta", **where, delta=text))
        return out

    def _where(self) -> dict:
        item = self.open["item"]
        return {"item_id": item["id"], "output_index": self.output.index(item), "content_index": 0}

    def _part(self, kind: str, part: dict) -> str:
        return self.emit(kind, **self._where(), part=part)

    def _close(self, status: str) -> list[str]:
        if self.open is None:
            return []
        where = self._where()
        opened, self.open = self.open, None
        item, text = opened["item"], opened["text"]
        out = []
        if opened["type"] == "message":
            part = _output_text(text)
            out.append(self.emit("response.output_text.done", **where, text=text, logprobs=[]))
            out.append(self.emit("response.content_part.done", **where, part=part))
            done = _message(item["id"], text, status)
        else:
            out.append(self.emit("response.reasoning_text.done", **where, text=text))
            done = _reasoning(item["id"], text)
        self.output[where["output_index"]] = done
        out.append(self._done(done))
        return out

    def call(self, call: ToolCall) -> list[str]:
        out = self._close("completed")
        item_id = f"fc_{_hex()}"
        out.append(self._add(_function_call(call, item_id, "")))
        index = len(self.output) - 1
        where = {"item_id": item_id, "output_index": index}
        for piece in in_pieces(call.arguments_json):
            out.append(self.emit("response.function_call_arguments.delta", **where, delta=piece))
        out.append(
            self.emit(
                "response.function_call_arguments.done",
                **where,
                name=call.name,
                arguments=call.arguments_json,
            )
        )
        self.output[index] = _function_call(call, item_id)
        out.append(self._done(self.output[index]))
        return out

    def close(self, *, empty_message: bool, status: str) -> list[str]:
        """Finish the open item; a reply with no item at all gets an empty message."""
        message_status = "incomplete" if status == "incomplete" else "completed"
        out = []
        if not self.output and empty_message:
            out += self.text("content", "")
        return out + self._close(message_status)
