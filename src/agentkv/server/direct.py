"""agentkv's own API: ``POST /v1/agents/{agent_id}/chat`` (the agent is named in the path)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from ..agent_id import validate_agent_id
from ..engine.results import ChatResult
from .common import (
    HEARTBEAT,
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
from .errors import openai_error_body
from .messages import from_openai
from .requests import TurnRequest


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: StrictStr
    content: StrictStr | list[dict] | None


class _DirectChat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    messages: Annotated[list[_Message], Field(min_length=1)]
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None  # greedy unless asked
    top_p: StrictFloat | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    cache_salt: StrictStr | None = None
    model: StrictStr | None = None  # default: the server's first model


class DirectDialect:
    name = "direct"
    error_body = staticmethod(openai_error_body)

    def __init__(self, limits: ServerLimits):
        self.limits = limits

    def parse(self, body, agent_id: str) -> TurnRequest:
        agent_id = validate_agent_id(agent_id)
        req: _DirectChat = parse_body(_DirectChat, body)
        temperature, top_p = sampling(req.temperature, req.top_p, default_t=0.0)
        model = self.limits.check_model(req.model) if req.model else self.limits.model_id
        return TurnRequest(
            agent_id=agent_id,
            messages=from_openai(req.messages),
            model=model,
            max_tokens=self.limits.check_max_tokens(req.max_tokens, "max_tokens", model),
            temperature=temperature,
            top_p=top_p,
            stop=stop_list(req.stop, "stop"),
            stream=req.stream,
            cache_salt=req.cache_salt,
        )

    def response(
        self, req: TurnRequest, result: ChatResult, counts: dict, agentkv: dict, parser=None
    ) -> dict:
        return {
            "agent_id": req.agent_id,
            "model": req.model,
            "text": result.text,
            "tokens": result.tokens,
            "finish_reason": result.finish_reason,
            "stop_sequence": result.stop_sequence,
            "stats": agentkv,
        }

    async def stream(
        self, req: TurnRequest, turn, counts: dict, finish, parser=None
    ) -> AsyncIterator[str]:
        r = turn.resumed
        start = {
            "agent_id": req.agent_id,
            "cache": r.tier,
            "match": r.match,
            "stored_tokens": r.stored_tokens,
            "reused_tokens": counts["reused"],
            "prefill_tokens": counts["prefill"],
            "reuse_note": r.note,
        }
        yield sse(start, "start")
        async for piece in turn.pieces():
            yield HEARTBEAT if piece is None else sse({"text": piece}, "delta")
        result, agentkv = await finish()
        yield sse(self.response(req, result, counts, agentkv), "end")
