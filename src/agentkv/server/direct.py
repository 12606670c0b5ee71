"""agentkv's own API: ``POST /v1/agents/{agent_id}/chat`` (the agent is named in the path)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from ..agent_id import validate_agent_id
from ..engine.results import ChatResult
from .dialects import (
    HEARTBEAT,
    OPENAI_ROLES,
    ServerLimits,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    _parse,
    _stops,
    _text_of,
    sse,
)
from .errors import bad_request, openai_error_body
from .requests import TurnRequest


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: StrictStr
    content: StrictStr | list[dict]


class _DirectChat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    messages: Annotated[list[_Message], Field(min_length=1)]
    max_tokens: StrictInt | None = None
    temperature: StrictFloat = 0.0
    top_p: StrictFloat = 1.0
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False


class DirectDialect:
    name = "direct"
    error_body = staticmethod(openai_error_body)

    def __init__(self, limits: ServerLimits):
        self.limits = limits

    def parse(self, body, agent_id: str) -> TurnRequest:
        agent_id = validate_agent_id(agent_id)
        req: _DirectChat = _parse(_DirectChat, body)
        messages = []
        for i, m in enumerate(req.messages):
            role = OPENAI_ROLES.get(m.role)
            if role is None:
                raise bad_request(
                    f"messages[{i}].role {m.role!r} is not supported (system, user, assistant)",
                    f"messages[{i}].role",
                )
            messages.append(
                {"role": role, "content": _text_of(m.content, f"messages[{i}].content")}
            )
        if not 0.0 <= req.temperature <= 2.0:
            raise bad_request("temperature must be between 0 and 2", "temperature")
        if not 0.0 < req.top_p <= 1.0:
            raise bad_request("top_p must be in (0, 1]", "top_p")
        return TurnRequest(
            agent_id=agent_id,
            messages=messages,
            model=self.limits.model_id,
            max_tokens=self.limits.check_max_tokens(req.max_tokens, "max_tokens"),
            temperature=req.temperature,
            top_p=req.top_p,
            stop=_stops(req.stop, "stop"),
            stream=req.stream,
        )

    def response(self, req: TurnRequest, result: ChatResult, counts: dict, agentkv: dict) -> dict:
        return {
            "agent_id": req.agent_id,
            "model": req.model,
            "text": result.text,
            "tokens": result.tokens,
            "finish_reason": result.finish_reason,
            "stop_sequence": result.stop_sequence,
            "stats": agentkv,
        }

    async def stream(self, req: TurnRequest, turn, counts: dict, finish) -> AsyncIterator[str]:
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
