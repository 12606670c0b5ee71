"""Anthropic Messages: ``POST /v1/messages`` (stream or not)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..engine.results import ChatResult
from .common import (
    ServerLimits,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    parse_body,
    sampling,
    sse,
    stop_list,
)
from .errors import anthropic_error_body, bad_request
from .identity import first_texts, resolve_agent
from .messages import from_anthropic
from .requests import TurnRequest


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
    """Messages requests in, messages (or event streams) out."""

    name = "anthropic"
    error_body = staticmethod(anthropic_error_body)

    def __init__(self, limits: ServerLimits):
        self.limits = limits

    def parse(self, body, agent_header: str | None) -> TurnRequest:
        req: _AnthropicMessages = parse_body(_AnthropicMessages, body)
        model = self.limits.check_model(req.model)
        if req.tools:
            raise bad_request("tool use is not supported by this server", "tools")
        messages = from_anthropic(req.system, req.messages)
        temperature, top_p = sampling(req.temperature, req.top_p, default_t=1.0)
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
