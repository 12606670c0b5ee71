"""What the server serves and how it stands: ``GET /v1/models[/{id}]`` (OpenAI's model
list), ``GET /health`` (a probe: no API key, not counted as a request) and ``GET /metrics``
(Prometheus)."""

from __future__ import annotations

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .endpoint import AppState, endpoint
from .errors import DIRECT, OPENAI
from .metrics import CONTENT_TYPE, turn_load


def routes(state: AppState) -> list[Route]:
    router = state.router

    def model_card(name: str) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": int(state.started),
            "owned_by": "agentkv",
            "loaded": router.loaded == name,
        }

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card(m) for m in router.models]})

    async def model(request: Request) -> JSONResponse:
        return JSONResponse(model_card(state.limits.check_model(request.path_params["model"])))

    async def health(request: Request) -> JSONResponse:
        load = turn_load(router)
        return JSONResponse(
            {"status": "ok", "model": router.loaded, "models": list(router.models), **load}
        )

    async def metrics(request: Request) -> Response:
        body = await anyio.to_thread.run_sync(state.metrics.render)
        return Response(body, media_type=CONTENT_TYPE)

    return [
        Route("/v1/models", endpoint(state, OPENAI, models), methods=["GET"]),
        Route("/v1/models/{model:path}", endpoint(state, OPENAI, model), methods=["GET"]),
        Route("/health", endpoint(state, DIRECT, health, probe=True), methods=["GET"]),
        Route("/metrics", endpoint(state, DIRECT, metrics), methods=["GET"]),
    ]
