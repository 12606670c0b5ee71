"""OpenAI Chat Completions: ``POST /v1/chat/completions`` (stream or not)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

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
from .errors import bad_request, openai_error_body
from .identity import first_texts, resolve_agent
from .messages import from_openai
from .requests import TurnRequest


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


class OpenAIDialect:
    """Chat Completions requests in, completions (or chunk streams) out."""

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
        messages = from_openai(req.messages)
        if req.max_tokens is not None and req.max_completion_tokens is not None:
            max_tokens = min(req.max_tokens, req.max_completion_tokens)
            param = "max_tokens"
        elif req.max_completion_tokens is not None:
            max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, param = req.max_tokens, "max_tokens"
        temperature, top_p = sampling(req.temperature, req.top_p, default_t=1.0)
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
