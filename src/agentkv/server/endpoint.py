"""What every route shares: the app's state record, the API key, errors answered in the
shape of the API the client speaks (and counted), and a JSON body read within its limit."""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio
from jinja2.exceptions import TemplateError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..errors import (
    AgentBusyError,
    AgentKVError,
    EngineBusyError,
    InvalidAgentIdError,
    InvalidRequestError,
    TurnFailedError,
)
from .common import ServerLimits
from .errors import API, APIError, bad_request
from .metrics import Metrics
from .models import ModelRouter

log = logging.getLogger("agentkv.server")

# A client that writes its whole body before reading (urllib, many SDKs) sees a
# connection reset instead of the 413 if the server closes with the body unread:
# the rest is read and dropped, up to this much (or 4x the limit) and this long.
DRAIN_MIN_BYTES = 256 << 20
DRAIN_SECONDS = 30.0

Handler = Callable[[Request], Awaitable[Response]]


@dataclass(frozen=True)
class AppState:
    """What the routes of one app share: the models served (and their limits), the
    metrics, the API key (None: no key asked) and the largest body read."""

    router: ModelRouter
    limits: ServerLimits
    metrics: Metrics
    api_key: str | None
    max_body_bytes: int
    started: float  # time.time() when the app was made: the models' ``created``


def authorized(request: Request, api_key: str | None) -> bool:
    """Whether the request carries ``api_key`` (``Authorization: Bearer`` or ``x-api-key``)."""
    if api_key is None:
        return True
    given = request.headers.get("x-api-key")
    auth = request.headers.get("authorization", "")
    if given is None and auth[:7].lower() == "bearer ":
        given = auth[7:].strip()
    return given is not None and hmac.compare_digest(given.encode(), api_key.encode())


def error_response(api: API, error: APIError) -> JSONResponse:
    return JSONResponse(api.error_body(error), error.status, headers=error.headers)


def as_api_error(exc: Exception, request: Request) -> APIError:
    """The answer to a request that raised ``exc`` (a bug is logged and answered 500)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, (InvalidAgentIdError, InvalidRequestError)):
        return bad_request(str(exc))
    if isinstance(exc, TemplateError):
        return bad_request(f"the model's chat template rejected these messages: {exc}", "messages")
    if isinstance(exc, EngineBusyError):
        retry = str(max(1, round(exc.retry_after)))
        return APIError(429, "rate_limit", str(exc), headers={"retry-after": retry})
    if isinstance(exc, AgentBusyError):  # another server committed the agent (docs/fleet.md)
        return APIError(409, "agent_busy", f"{exc}; this turn was not kept, send it again")
    if isinstance(exc, TurnFailedError):  # this turn alone failed: it may be sent again
        return APIError(500, "server", str(exc))
    if isinstance(exc, AgentKVError):  # the engine is closed: shutting down
        return APIError(503, "unavailable", str(exc))
    log.error("agentkv: %s %s failed", request.method, request.url.path, exc_info=exc)
    return APIError(500, "server", "internal error (see the server's log)")


def endpoint(state: AppState, api: API, handler: Handler, *, probe: bool = False) -> Handler:
    """``handler`` behind the API key, its failures answered in ``api``'s error shape, every
    answer counted under ``api``; a ``probe`` (``/health``) needs no key and is not counted."""

    async def run(request: Request) -> Response:
        try:
            if not probe and not authorized(request, state.api_key):
                raise APIError(
                    401,
                    "authentication",
                    "missing or wrong API key (Authorization: Bearer KEY, or x-api-key)",
                )
            response = await handler(request)
        except Exception as exc:
            response = error_response(api, as_api_error(exc, request))
        if not probe:
            state.metrics.requests.labels(api.name, str(response.status_code)).inc()
        return response

    return run


async def read_json(request: Request, limit: int):
    """The request's JSON body: 413 past ``limit`` bytes (the rest read and dropped), 400 if
    it is not JSON that text can hold."""
    declared = request.headers.get("content-length")
    if declared is not None and not declared.isdigit():
        raise bad_request("invalid Content-Length header")
    chunks, size = [], 0
    if declared is None or int(declared) <= limit:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                break
            chunks.append(chunk)
    if declared is not None and int(declared) > limit or size > limit:
        chunks.clear()
        await _discard_body(request, limit=max(DRAIN_MIN_BYTES, 4 * limit))
        raise APIError(
            413, "too_large", f"request body over {limit} bytes", headers={"connection": "close"}
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
