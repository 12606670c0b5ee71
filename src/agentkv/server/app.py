"""The ASGI app (Starlette) behind ``agentkv serve``: the routes of each API, assembled.

Routes, each API's built by the ``routes`` of its module::

    openai_chat         POST /v1/chat/completions      stream or not
    anthropic_messages  POST /v1/messages              stream or not
    openai_responses    POST /v1/responses             stream or not; previous_response_id
                        GET|DELETE /v1/responses/{id}  a stored response
    direct              POST /v1/agents/{id}/chat      the agent named in the path
                        GET /v1/agents[/{id}]          stored and in-memory agents
                        DELETE /v1/agents/{id}         forget an agent (memory and disk)
    status              GET /v1/models[/{id}]          OpenAI's model list
                        GET /health, GET /metrics      a probe (not counted); Prometheus

How a chat turn becomes an answer (headers, streaming, cancellation) is ``answer.py``;
what every route shares (the state record, the API key, error shapes, the body limit) is
``endpoint.py``.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request

from ..paths import kv_dir
from . import anthropic_messages, direct, openai_chat, openai_responses, status
from .common import ServerLimits
from .endpoint import AppState, error_response
from .errors import ANTHROPIC, OPENAI, APIError
from .metrics import Metrics
from .models import ModelRouter
from .response_store import ResponseStore

DEFAULT_MAX_BODY = 16 << 20


def create_app(
    engine=None,
    *,
    router: ModelRouter | None = None,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY,
    default_max_tokens: int | None = None,
    close_engine: bool = False,
    responses_dir: str | Path | None = None,
) -> Starlette:
    """An app serving ``engine`` (one model), or the models of ``router`` (one loaded at a
    time); ``close_engine``: close the engine(s) when the app shuts down. Stored Responses
    go to ``responses_dir`` (default: ``responses/`` beside the engine's agents, in its cache
    directory). A request that names no temperature, top_p or reply length gets its model's
    (``model.generation_config``); ``default_max_tokens`` overrides the model's reply
    length for every model."""
    if responses_dir is None:
        root = engine.store.root if engine is not None else kv_dir()
        responses_dir = Path(root) / "responses"
    if router is None:
        router = ModelRouter.around(engine)
    limits = ServerLimits(
        models={m.name: m.context_limit or 1 << 20 for m in router.models.values()},
        default_max_tokens=default_max_tokens,
    )
    state = AppState(router, limits, Metrics(router), api_key, max_body_bytes, time.time())
    routes = [
        *openai_chat.routes(state),
        *anthropic_messages.routes(state),
        *openai_responses.routes(state, ResponseStore(Path(responses_dir))),
        *direct.routes(state),
        *status.routes(state),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await router.start()
        yield
        if close_engine:  # drained: finish what the engine holds and save every agent
            await router.close()

    app = Starlette(routes=routes, exception_handlers={HTTPException: _no_route}, lifespan=lifespan)
    app.state.router = router
    app.state.metrics = state.metrics
    return app


async def _no_route(request: Request, exc: HTTPException):
    """An unknown path or method, answered in the shape of the API the path belongs to."""
    api = ANTHROPIC if request.url.path.startswith("/v1/messages") else OPENAI
    kind = "not_found" if exc.status_code in (404, 405) else "invalid_request"
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return error_response(api, APIError(exc.status_code, kind, message))
