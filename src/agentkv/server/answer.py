"""A chat turn from its request to its HTTP answer, for every dialect: the body parsed, the
model acquired, the tools prepared, the turn run, the answer sent whole (JSON) or streamed
(SSE), and the model released once the answer is complete.

Every answer carries ``x-agentkv-cache`` (hot, warm, cold: what the reused tokens came
from), ``x-agentkv-agent`` and the reused / prefilled token counts, and
``x-agentkv-reuse-note`` where the agent's cache was not reused in full (why). An answer
is complete only once its turn is on disk, so a client that got one can count on it
surviving a crash. A client that disconnects cancels its turn (no reply is saved).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Callable
from functools import partial

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..errors import AgentBusyError, AgentKVError
from .endpoint import AppState, endpoint, read_json
from .errors import API, APIError
from .identity import HEADER
from .metrics import Metrics
from .replies import Dialect, Reply, sse, usage_counts
from .tooling import prepare as prepare_tools
from .turns import AsyncTurn

log = logging.getLogger("agentkv.server")


def chat_route(
    state: AppState,
    path: str,
    dialect: Dialect,
    agent_of: Callable[[Request], str | None] = lambda request: request.headers.get(HEADER),
) -> Route:
    """``POST path``: one turn in ``dialect``, for the agent ``agent_of`` the request names
    (default: its ``x-agent-id`` header; None: the dialect derives one)."""

    async def chat(request: Request) -> Response:
        return await answer_chat(state, request, dialect, agent_of(request))

    return Route(path, endpoint(state, dialect.api, chat), methods=["POST"])


async def answer_chat(state: AppState, request: Request, dialect: Dialect, agent) -> Response:
    req = dialect.parse(await read_json(request, state.max_body_bytes), agent)
    if inspect.isawaitable(req):
        req = await req
    engine = await state.router.acquire(req.model)
    release = _once(partial(state.router.release, req.model))
    defaults = engine.loaded.generation
    req.with_defaults(defaults, state.limits.reply_tokens(defaults, req.model))
    try:
        response = await _answer_turn(state, request, dialect, req, engine, release)
    except BaseException:
        release()
        raise
    if not isinstance(response, StreamingResponse):
        release()  # a stream releases the model when it ends
    return response


async def _answer_turn(state, request, dialect, req, engine, release) -> Response:
    plan = await prepare_tools(engine, req.agent_id, req.messages, req.tools, req.tool_choice)
    options = {**req.sampling, **plan.options}
    if options["constraint"] is None:  # a forced tool call's grammar comes first
        options["constraint"] = getattr(req, "constraint", None)
    turn = AsyncTurn(engine, req.agent_id, plan.messages, options)
    # One watcher from here to the end of the response: a client that goes away at any
    # point (waiting for its turn, during prefill, mid-stream) cancels the turn.
    turn.watch(request.receive)
    streaming = False
    try:
        try:
            resumed = await turn.start()
        except RuntimeError as exc:
            raise APIError(503, "unavailable", str(exc)) from None
        counts = usage_counts(resumed)
        headers = {
            "x-agentkv-cache": resumed.tier,
            "x-agentkv-agent": req.agent_id,
            "x-agentkv-reused-tokens": str(counts["reused"]),
            "x-agentkv-prefill-tokens": str(counts["prefill"]),
        }
        if resumed.note:  # why the agent's cache was not reused in full (or at all)
            headers["x-agentkv-reuse-note"] = resumed.note.encode("ascii", "replace").decode()
        finish = partial(_finish, state.metrics, turn, req.agent_id)
        reply = Reply(req, turn, counts, plan.parser, finish)
        if req.stream:
            events = dialect.stream(reply)
            response = _event_stream(dialect.api, req.agent_id, turn, events, headers, release)
            streaming = True
            return response
        await reply.whole()
        body = dialect.response(reply)
        if inspect.isawaitable(body):
            body = await body
        return JSONResponse(body, headers=headers)
    except BaseException:
        turn.cancel()
        raise
    finally:
        if not streaming:
            await turn.unwatch()


async def _finish(metrics: Metrics, turn: AsyncTurn, agent_id: str):
    """The turn's result (on disk, counted) and the stats its response carries."""
    result = await turn.finish()
    metrics.turn(result)
    return result, {"agent_id": agent_id, **result.stats.to_dict()}


def _event_stream(
    api: API, agent_id: str, turn: AsyncTurn, events: AsyncIterator[str], headers: dict, release
) -> StreamingResponse:
    """``events`` as server-sent events; a failure once the headers are sent is reported as
    an ``error`` event; at the end the turn is cancelled (if it still runs), unwatched and
    its model released."""

    async def guarded() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except Exception as exc:  # headers are sent: report in the stream, then end
            if not isinstance(exc, AgentKVError):
                log.exception("agentkv: turn of %r failed", agent_id)
            error = APIError(500, "server", f"generation failed: {exc}")
            if isinstance(exc, AgentBusyError):  # the turn was streamed, then not kept
                error = APIError(409, "agent_busy", f"{exc}; this turn was not kept")
            yield sse(api.error_body(error), "error")
        finally:
            turn.cancel()  # no-op once the turn has ended
            await turn.unwatch()
            release()

    headers = {**headers, "cache-control": "no-cache"}
    return StreamingResponse(guarded(), media_type="text/event-stream", headers=headers)


def _once(fn: Callable[[], None]) -> Callable[[], None]:
    done = False

    def call() -> None:
        nonlocal done
        if not done:
            done = True
            fn()

    return call
