"""The ASGI app (Starlette) behind ``agentkv serve``.

Routes::

    POST /v1/chat/completions        OpenAI chat (stream or not)
    GET  /v1/models[/{id}]           OpenAI model list
    POST /v1/messages                Anthropic messages (stream or not)
    POST /v1/responses               OpenAI Responses (stream or not; previous_response_id)
    GET|DELETE /v1/responses/{id}    a stored response
    POST /v1/agents/{id}/chat        direct: the agent named in the path
    GET  /v1/agents[/{id}]           stored and in-memory agents
    DELETE /v1/agents/{id}           forget an agent (memory and disk)
    GET  /health, GET /metrics

Every response that generated tokens carries ``x-agentkv-cache`` (hot, warm,
cold), ``x-agentkv-agent`` and the reused / prefilled token counts. A
response is complete only once its turn is on disk, so a client that got an
answer can count on it surviving a crash. A client that disconnects cancels
its turn (no reply is saved).
"""

from __future__ import annotations

import contextlib
import hmac
import inspect
import json
import logging
import time
from pathlib import Path

import anyio
from jinja2.exceptions import TemplateError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..agent_id import validate_agent_id
from ..errors import AgentKVError, EngineBusyError, InvalidAgentIdError, InvalidRequestError
from ..paths import kv_dir
from .anthropic_messages import AnthropicDialect
from .common import ServerLimits, usage_counts
from .direct import DirectDialect
from .errors import APIError, bad_request
from .identity import HEADER
from .metrics import CONTENT_TYPE, Metrics
from .models import ModelRouter
from .openai_chat import OpenAIDialect
from .openai_responses import ResponsesDialect
from .response_store import ResponseStore
from .tooling import prepare as prepare_tools
from .turns import AsyncTurn

log = logging.getLogger("agentkv.server")

DEFAULT_MAX_BODY = 16 << 20
# A client that writes its whole body before reading (urllib, many SDKs) sees a
# connection reset instead of the 413 if the server closes with the body unread:
# the rest is read and dropped, up to this much (or 4x the limit) and this long.
DRAIN_MIN_BYTES = 256 << 20
DRAIN_SECONDS = 30.0
DEFAULT_MAX_TOKENS = 512


async def _discard_body(request: Request, *, limit: int) -> None:
    """Read and drop what is left of the body, within ``limit`` bytes and DRAIN_SECONDS."""
    read = 0
    with anyio.move_on_after(DRAIN_SECONDS):
        while read <= limit:
            message = await request.receive()
            if message["type"] != "http.request":
                return  # the client hung up
            read += len(message.get("body", b""))
            if not message.get("more_body", False):
                return


def create_app(
    engine=None,
    *,
    router: ModelRouter | None = None,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    close_engine: bool = False,
    responses_dir: str | Path | None = None,
) -> Starlette:
    """An app serving ``engine`` (one model), or the models of ``router`` (one loaded at a
    time); ``close_engine``: close the engine(s) when the app shuts down. Stored Responses
    go to ``responses_dir`` (default: ``responses/`` beside the engine's agents, in its cache
    directory)."""
    if responses_dir is None:
        root = engine.store.root if engine is not None else kv_dir()
        responses_dir = Path(root) / "responses"
    if router is None:
        router = ModelRouter.around(engine)
    limits = ServerLimits(
        models={m.name: m.context_limit or 1 << 20 for m in router.models.values()},
        default_max_tokens=default_max_tokens,
    )
    openai, anthropic, direct = (
        OpenAIDialect(limits),
        AnthropicDialect(limits),
        DirectDialect(limits),
    )
    responses = ResponsesDialect(limits, ResponseStore(Path(responses_dir)))
    metrics = Metrics(router)
    started = time.time()

    def authorized(request: Request) -> bool:
        if api_key is None:
            return True
        given = request.headers.get("x-api-key")
        auth = request.headers.get("authorization", "")
        if given is None and auth[:7].lower() == "bearer ":
            given = auth[7:].strip()
        return given is not None and hmac.compare_digest(given.encode(), api_key.encode())

    def error_response(dialect, error: APIError) -> JSONResponse:
        return JSONResponse(dialect.error_body(error), error.status, headers=error.headers)

    def endpoint(dialect, handler, *, public: bool = False):
        """Auth, then the handler; every failure becomes an error in the dialect's shape."""

        async def run(request: Request) -> Response:
            try:
                if not public and not authorized(request):
                    raise APIError(
                        401,
                        "authentication",
                        "missing or wrong API key (Authorization: Bearer KEY, or x-api-key)",
                    )
                response = await handler(request)
            except APIError as exc:
                response = error_response(dialect, exc)
            except (InvalidAgentIdError, InvalidRequestError) as exc:
                response = error_response(dialect, bad_request(str(exc)))
            except TemplateError as exc:
                message = f"the model's chat template rejected these messages: {exc}"
                response = error_response(dialect, bad_request(message, "messages"))
            except EngineBusyError as exc:
                retry = str(max(1, round(exc.retry_after)))
                error = APIError(429, "rate_limit", str(exc), headers={"retry-after": retry})
                response = error_response(dialect, error)
            except AgentKVError as exc:  # the engine is closed: shutting down
                response = error_response(dialect, APIError(503, "unavailable", str(exc)))
            except Exception:
                log.exception("agentkv: %s %s failed", request.method, request.url.path)
                error = APIError(500, "server", "internal error (see the server's log)")
                response = error_response(dialect, error)
            metrics.requests.labels(dialect.name, str(response.status_code)).inc()
            return response

        return run

    async def read_json(request: Request):
        declared = request.headers.get("content-length")
        if declared is not None and not declared.isdigit():
            raise bad_request("invalid Content-Length header")
        chunks, size = [], 0
        if declared is None or int(declared) <= max_body_bytes:
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_body_bytes:
                    break
                chunks.append(chunk)
        if declared is not None and int(declared) > max_body_bytes or size > max_body_bytes:
            chunks.clear()
            await _discard_body(request, limit=max(DRAIN_MIN_BYTES, 4 * max_body_bytes))
            raise APIError(
                413,
                "too_large",
                f"request body over {max_body_bytes} bytes",
                headers={"connection": "close"},
            )
        try:
            body = json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError) as exc:
            raise bad_request(f"the body is not valid JSON: {exc}") from None
        except RecursionError:
            raise bad_request("the body is nested too deeply") from None
        try:  # JSON can spell lone surrogates (\ud800), which no text can hold
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise bad_request("the body holds invalid Unicode (a lone surrogate)") from None
        return body

    async def chat(request: Request, dialect, agent: str | None) -> Response:
        req = dialect.parse(await read_json(request), agent)
        if inspect.isawaitable(req):
            req = await req
        engine = await router.acquire(req.model)
        released = False

        def release():
            nonlocal released
            if not released:
                released = True
                router.release(req.model)

        try:
            return await run_turn(request, dialect, req, engine, release)
        finally:
            if not getattr(request.state, "streaming", False):
                release()

    async def run_turn(request: Request, dialect, req, engine, release) -> Response:
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

            async def finish():
                result = await turn.finish()
                metrics.turn(result)
                return result, {"agent_id": req.agent_id, **result.stats.to_dict()}

            if not req.stream:
                result, agentkv = await finish()
                body = dialect.response(req, result, counts, agentkv, plan.parser)
                if inspect.isawaitable(body):
                    body = await body
                return JSONResponse(body, headers=headers)

            async def events():
                try:
                    async for event in dialect.stream(req, turn, counts, finish, plan.parser):
                        yield event
                except Exception as exc:  # headers are sent: report in the stream, then end
                    if not isinstance(exc, AgentKVError):
                        log.exception("agentkv: turn of %r failed", req.agent_id)
                    error = APIError(500, "server", f"generation failed: {exc}")
                    yield f"event: error\ndata: {json.dumps(dialect.error_body(error))}\n\n"
                finally:
                    turn.cancel()  # no-op once the turn has ended
                    await turn.unwatch()
                    release()

            headers["cache-control"] = "no-cache"
            response = StreamingResponse(events(), media_type="text/event-stream", headers=headers)
            streaming = request.state.streaming = True
            return response
        except BaseException:
            turn.cancel()
            raise
        finally:
            if not streaming:
                await turn.unwatch()

    # -- routes -------------------------------------------------------------------------------

    async def chat_completions(request):
        return await chat(request, openai, request.headers.get(HEADER))

    async def messages(request):
        return await chat(request, anthropic, request.headers.get(HEADER))

    async def create_response(request):
        return await chat(request, responses, request.headers.get(HEADER))

    async def get_response(request):
        record = await responses.load(request.path_params["response_id"])
        return JSONResponse(record["response"])

    async def delete_response(request):
        return JSONResponse(await responses.delete(request.path_params["response_id"]))

    async def agent_chat(request):
        return await chat(request, direct, request.path_params["agent_id"])

    def model_card(name: str) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": int(started),
            "owned_by": "agentkv",
            "loaded": router.loaded == name,
        }

    async def models(request):
        return JSONResponse({"object": "list", "data": [model_card(m) for m in router.models]})

    async def model(request):
        return JSONResponse(model_card(limits.check_model(request.path_params["model"])))

    def agent_json(info) -> dict:
        return {
            "id": info.agent_id,
            "tokens": info.tokens,
            "tier": info.tier,
            "memory_bytes": info.memory_bytes,
            "shared_blocks": info.shared_blocks,
            "disk_bytes": info.disk_bytes,
            "last_used": info.last_used,
        }

    async def with_engine(request, work):
        """Run ``work(engine)`` in a thread on the engine of ``?model=`` (default: the one
        loaded, else the first)."""
        asked = request.query_params.get("model")
        name = limits.check_model(asked) if asked else router.loaded or router.default
        engine = await router.acquire(name)
        try:
            return await anyio.to_thread.run_sync(work, engine)
        finally:
            router.release(name)

    async def agents(request):
        infos = await with_engine(request, lambda e: e.agents())
        return JSONResponse({"object": "list", "data": [agent_json(i) for i in infos]})

    async def agent(request):
        agent_id = validate_agent_id(request.path_params["agent_id"])
        info = await with_engine(request, lambda e: e.agent_info(agent_id))
        if info is None:
            raise APIError(404, "not_found", f"no agent {agent_id!r}")
        return JSONResponse(agent_json(info))

    async def delete_agent(request):
        agent_id = validate_agent_id(request.path_params["agent_id"])
        if not await with_engine(request, lambda e: e.delete_agent(agent_id)):
            raise APIError(404, "not_found", f"no agent {agent_id!r}")
        return JSONResponse({"id": agent_id, "deleted": True})

    async def health(request):
        engine = router.engine
        load = engine.scheduler.load() if engine is not None else {"waiting": 0, "running": 0}
        return JSONResponse(
            {"status": "ok", "model": router.loaded, "models": list(router.models), **load}
        )

    async def metrics_text(request):
        body = await anyio.to_thread.run_sync(metrics.render)
        return Response(body, media_type=CONTENT_TYPE)

    routes = [
        Route("/v1/chat/completions", endpoint(openai, chat_completions), methods=["POST"]),
        Route("/v1/models", endpoint(openai, models), methods=["GET"]),
        Route("/v1/models/{model:path}", endpoint(openai, model), methods=["GET"]),
        Route("/v1/messages", endpoint(anthropic, messages), methods=["POST"]),
        Route("/v1/responses", endpoint(responses, create_response), methods=["POST"]),
        Route("/v1/responses/{response_id}", endpoint(responses, get_response), methods=["GET"]),
        Route(
            "/v1/responses/{response_id}",
            endpoint(responses, delete_response),
            methods=["DELETE"],
        ),
        Route("/v1/agents", endpoint(direct, agents), methods=["GET"]),
        Route("/v1/agents/{agent_id}", endpoint(direct, agent), methods=["GET"]),
        Route("/v1/agents/{agent_id}", endpoint(direct, delete_agent), methods=["DELETE"]),
        Route("/v1/agents/{agent_id}/chat", endpoint(direct, agent_chat), methods=["POST"]),
        Route("/health", endpoint(direct, health, public=True), methods=["GET"]),
        Route("/metrics", endpoint(direct, metrics_text), methods=["GET"]),
    ]

    async def not_found(request: Request, exc: HTTPException):
        dialect = anthropic if request.url.path.startswith("/v1/messages") else openai
        kind = "not_found" if exc.status_code in (404, 405) else "invalid_request"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(dialect, APIError(exc.status_code, kind, message))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await router.start()
        yield
        if close_engine:  # drained: finish what the engine holds and save every agent
            await router.close()

    app = Starlette(routes=routes, exception_handlers={HTTPException: not_found}, lifespan=lifespan)
    app.state.router = router
    app.state.metrics = metrics
    return app
