"""Request parsing and response shapes of the two chat APIs agentkv speaks.

Both turn a JSON body into a ``TurnRequest`` (validated: wrong types, missing
fields, unsupported content, out-of-range values are ``APIError`` 4xx in the
API's own error shape) and render a finished turn, or a stream of SSE events,
the way the official SDKs expect.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..engine.results import ChatResult
from .errors import APIError, anthropic_error_body, bad_request, from_validation, openai_error_body
from .identity import first_texts, resolve_agent
from .requests import TurnRequest

StrictInt = Annotated[int, Field(strict=True)]
StrictFloat = Annotated[float, Field(strict=True)]
StrictStr = Annotated[str, Field(strict=True)]
StrictBool = Annotated[bool, Field(strict=True)]
MAX_STOPS = 16


@dataclass(frozen=True)
class ServerLimits:
    """The models served (id -> context length) and the reply length when none is asked."""

    models: dict
    default_max_tokens: int

    @property
    def model_id(self) -> str:
        """The default model (the first served)."""
        return next(iter(self.models))

    def check_model(self, name: str) -> str:
        """The served model's id for ``name`` (case-insensitive); 404 if none."""
        for known in self.models:
            if known.lower() == name.lower():
                return known
        served = ", ".join(repr(m) for m in self.models)
        raise APIError(
            404,
            "model_not_found",
            f"model {name!r} is not served here; this server serves {served}",
            param="model",
        )

    def check_max_tokens(self, value: int | None, param: str, model: str | None = None) -> int:
        limit = self.models.get(model or self.model_id) or 1 << 20
        if value is None:
            return min(self.default_max_tokens, limit)
        if not 1 <= value <= limit:
            raise bad_request(
                f"{param} must be between 1 and {limit} (the model's context), got {value}", param
            )
        return value


def parse_body(model: type[BaseModel], body: Any) -> BaseModel:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise from_validation(exc) from None


def stop_list(value, param: str) -> list[str]:
    stops = [value] if isinstance(value, str) else list(value or [])
    if len(stops) > MAX_STOPS:
        raise bad_request(f"{param}: at most {MAX_STOPS} stop sequences", param)
    if any(not s for s in stops):
        raise bad_request(f"{param}: stop sequences must be non-empty strings", param)
    return stops


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


def sampling(temperature: float | None, top_p: float | None, *, default_t: float, max_t: float):
    """(temperature, top_p) with the API's defaults, each checked against its range."""
    temperature = default_t if temperature is None else temperature
    if not 0.0 <= temperature <= max_t:
        raise bad_request(f"temperature must be between 0 and {max_t:g}", "temperature")
    top_p = 1.0 if top_p is None else top_p
    if not 0.0 < top_p <= 1.0:
        raise bad_request("top_p must be in (0, 1]", "top_p")
    return temperature, top_p


def chat_messages(messages) -> list[dict]:
    """OpenAI-style messages -> normalized ``{"role", "content"}`` (developer -> system)."""
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


def sse(data: dict | str, event: str | None = None) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return (f"event: {event}\n" if event else "") + f"data: {payload}\n\n"


HEARTBEAT = ": keep-alive\n\n"


def usage_counts(resumed) -> dict:
    """prompt / reused / prefilled token counts of a turn, as its start planned them."""
    return {
        "prompt": resumed.prompt_tokens,
        "reused": resumed.reused_tokens,
        "prefill": len(resumed.prefill_ids),
    }


# -- OpenAI ---------------------------------------------------------------------------------


class _OpenAIMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: StrictStr
    content: StrictStr | list[dict] | None = None


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
    functions: list | None = None
    logprobs: StrictBool | None = None
    response_format: dict | None = None
    cache_salt: StrictStr | None = None  # as vLLM: prompts share blocks only within a salt


OPENAI_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class OpenAIDialect:
    name = "openai"
    error_body = staticmethod(openai_error_body)

    def __init__(self, limits: ServerLimits):
        self.limits = limits

    def parse(self, body, agent_header: str | None) -> TurnRequest:
        req: _OpenAIChat = parse_body(_OpenAIChat, body)
        model = self.limits.check_model(req.model)
        if req.n not in (None, 1):
            raise bad_request("only n=1 is supported", "n")
        if req.tools or req.functions:
            raise bad_request("tool calling is not supported by this server", "tools")
        if req.logprobs:
            raise bad_request("logprobs are not supported by this server", "logprobs")
        if req.response_format and req.response_format.get("type") not in (None, "text"):
            raise bad_request("only response_format type 'text' is supported", "response_format")
        messages = chat_messages(req.messages)
        if req.max_tokens is not None and req.max_completion_tokens is not None:
            max_tokens = min(req.max_tokens, req.max_completion_tokens)
            param = "max_tokens"
        elif req.max_completion_tokens is not None:
            max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, param = req.max_tokens, "max_tokens"
        temperature, top_p = sampling(req.temperature, req.top_p, default_t=1.0, max_t=2.0)
        return TurnRequest(
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
        )

    @staticmethod
    def _usage(counts: dict, generated: int) -> dict:
        return {
            "prompt_tokens": counts["prompt"],
            "completion_tokens": generated,
            "total_tokens": counts["prompt"] + generated,
            "prompt_tokens_details": {"cached_tokens": counts["reused"]},
        }

    def response(self, req: TurnRequest, result: ChatResult, counts: dict, agentkv: dict) -> dict:
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": req.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": result.text},
                    "finish_reason": _openai_finish(result.finish_reason),
                    "logprobs": None,
                }
            ],
            "usage": self._usage(counts, result.stats.generated_tokens),
            "agentkv": agentkv,
        }

    async def stream(self, req: TurnRequest, turn, counts: dict, finish) -> AsyncIterator[str]:
        base = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": req.model,
        }
        extra = {"usage": None} if req.include_usage else {}

        def chunk(delta: dict, finish_reason=None) -> str:
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
            return sse({**base, "choices": [choice], **extra})

        yield chunk({"role": "assistant", "content": ""})
        async for piece in turn.pieces():
            yield HEARTBEAT if piece is None else chunk({"content": piece})
        result, agentkv = await finish()
        yield chunk({}, _openai_finish(result.finish_reason))
        if req.include_usage:
            usage = self._usage(counts, result.stats.generated_tokens)
            yield sse({**base, "choices": [], "usage": usage, "agentkv": agentkv})
        yield sse("[DONE]")


def _openai_finish(reason: str) -> str:
    return "length" if reason == "length" else "stop"


# -- Anthropic ------------------------------------------------------------------------------


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
    cache_salt: StrictStr | None = None


class AnthropicDialect:
    name = "anthropic"
    error_body = staticmethod(anthropic_error_body)

    def __init__(self, limits: ServerLimits):
        self.limits = limits

    def parse(self, body, agent_header: str | None) -> TurnRequest:
        req: _AnthropicMessages = parse_body(_AnthropicMessages, body)
        model = self.limits.check_model(req.model)
        if req.tools:
            raise bad_request("tool use is not supported by this server", "tools")
        messages = []
        if req.system is not None:
            system = text_of(req.system, "system")
            if system:
                messages.append({"role": "system", "content": system})
        for i, m in enumerate(req.messages):
            messages.append(
                {"role": m.role, "content": text_of(m.content, f"messages[{i}].content")}
            )
        if messages[-1]["role"] != "user":
            raise bad_request("the last message must have role 'user'", "messages")
        temperature, top_p = sampling(req.temperature, req.top_p, default_t=1.0, max_t=1.0)
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
        )

    @staticmethod
    def _stop(result: ChatResult) -> tuple[str, str | None]:
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

    def response(self, req: TurnRequest, result: ChatResult, counts: dict, agentkv: dict) -> dict:
        reason, sequence = self._stop(result)
        return {
            "id": f"msg_{uuid.uuid4().hex}",
            "type": "message",
            "role": "assistant",
            "model": req.model,
            "content": [{"type": "text", "text": result.text}],
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": self._usage(counts, result.stats.generated_tokens),
            "agentkv": agentkv,
        }

    async def stream(self, req: TurnRequest, turn, counts: dict, finish) -> AsyncIterator[str]:
        message = {
            "id": f"msg_{uuid.uuid4().hex}",
            "type": "message",
            "role": "assistant",
            "model": req.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": self._usage(counts, 0),
        }
        yield sse({"type": "message_start", "message": message}, "message_start")
        block = {
            "type": "content_block_start",
            "index": 0,
            "content_block": {"type": "text", "text": ""},
        }
        yield sse(block, "content_block_start")
        async for piece in turn.pieces():
            if piece is None:
                yield sse({"type": "ping"}, "ping")
                continue
            delta = {"type": "content_block_delta", "index": 0}
            delta["delta"] = {"type": "text_delta", "text": piece}
            yield sse(delta, "content_block_delta")
        result, agentkv = await finish()
        yield sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
        reason, sequence = self._stop(result)
        yield sse(
            {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": {"output_tokens": result.stats.generated_tokens},
                "agentkv": agentkv,
            },
            "message_delta",
        )
        yield sse({"type": "message_stop"}, "message_stop")
