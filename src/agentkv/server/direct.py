"""agentkv's own API: ``POST /v1/agents/{agent_id}/chat`` (the agent is named in the path),
``GET /v1/agents[/{agent_id}]`` (stored and in-memory agents) and ``DELETE
/v1/agents/{agent_id}`` (forget an agent, in memory and on disk). ``?model=`` picks the
model whose agents are listed (default: the one loaded, else the first)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Annotated

import anyio
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from ..agent_id import validate_agent_id
from .answer import chat_route
from .common import StrictBool, StrictFloat, StrictInt, StrictStr, parse_body, sampling, stop_list
from .endpoint import AppState, endpoint
from .errors import DIRECT, APIError
from .messages import from_openai
from .replies import HEARTBEAT, Dialect, Reply, sse
from .requests import TurnRequest


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: StrictStr
    content: StrictStr | list[dict] | None


class _DirectChat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    messages: Annotated[list[_Message], Field(min_length=1)]
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None  # None: the model's default
    top_p: StrictFloat | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    cache_salt: StrictStr | None = None
    model: StrictStr | None = None  # default: the server's first model


def routes(state: AppState) -> list[Route]:
    async def agents(request: Request) -> JSONResponse:
        infos = await _with_engine(state, request, lambda e: e.agents())
        return JSONResponse({"object": "list", "data": [_agent_json(i) for i in infos]})

    async def agent(request: Request) -> JSONResponse:
        agent_id = validate_agent_id(request.path_params["agent_id"])
        info = await _with_engine(state, request, lambda e: e.agent_info(agent_id))
        if info is None:
            raise APIError(404, "not_found", f"no agent {agent_id!r}")
        return JSONResponse(_agent_json(info))

    async def delete_agent(request: Request) -> JSONResponse:
        agent_id = validate_agent_id(request.path_params["agent_id"])
        if not await _with_engine(state, request, lambda e: e.delete_agent(agent_id)):
            raise APIError(404, "not_found", f"no agent {agent_id!r}")
        return JSONResponse({"id": agent_id, "deleted": True})

    return [
        Route("/v1/agents", endpoint(state, DIRECT, agents), methods=["GET"]),
        Route("/v1/agents/{agent_id}", endpoint(state, DIRECT, agent), methods=["GET"]),
        Route("/v1/agents/{agent_id}", endpoint(state, DIRECT, delete_agent), methods=["DELETE"]),
        chat_route(
            state,
            "/v1/agents/{agent_id}/chat",
            DirectDialect(state.limits),
            agent_of=lambda request: request.path_params["agent_id"],
        ),
    ]


async def _with_engine(state: AppState, request: Request, work):
    """``work(engine)`` in a thread, on the engine of ``?model=`` (default: the one loaded,
    else the first)."""
    asked = request.query_params.get("model")
    router = state.router
    name = state.limits.check_model(asked) if asked else router.loaded or router.default
    engine = await router.acquire(name)
    try:
        return await anyio.to_thread.run_sync(work, engine)
    finally:
        router.release(name)


def _agent_json(info) -> dict:
    """An ``AgentInfo`` as the API shows it (its ``agent_id`` is the ``id``)."""
    fields = dataclasses.asdict(info)
    return {"id": fields.pop("agent_id"), **fields}


class DirectDialect(Dialect):
    """Direct chat requests in (the agent named in the path), replies or events out."""

    api = DIRECT

    def parse(self, body, agent_id: str) -> TurnRequest:
        agent_id = validate_agent_id(agent_id)
        req: _DirectChat = parse_body(_DirectChat, body)
        temperature, top_p = sampling(req.temperature, req.top_p)
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

    def response(self, reply: Reply) -> dict:
        result = reply.result
        return {
            "agent_id": reply.req.agent_id,
            "model": reply.req.model,
            "text": result.text,
            "tokens": result.tokens,
            "finish_reason": result.finish_reason,
            "stop_sequence": result.stop_sequence,
            "stats": reply.agentkv,
        }

    async def stream(self, reply: Reply) -> AsyncIterator[str]:
        """The raw text as it is generated (no tools here: nothing to parse)."""
        r, counts = reply.turn.resumed, reply.counts
        start = {
            "agent_id": reply.req.agent_id,
            "cache": r.tier,
            "match": r.match,
            "stored_tokens": r.stored_tokens,
            "reused_tokens": counts["reused"],
            "prefill_tokens": counts["prefill"],
            "reuse_note": r.note,
        }
        yield sse(start, "start")
        async for piece in reply.turn.pieces():
            yield HEARTBEAT if piece is None else sse({"text": piece}, "delta")
        await reply.finish()
        yield sse(self.response(reply), "end")
