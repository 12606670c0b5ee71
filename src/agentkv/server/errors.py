"""HTTP errors, each rendered in the shape of the API the client speaks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pydantic import ValidationError


class APIError(Exception):
    """An error answer: HTTP status, a kind (mapped to each API's type names) and a message."""

    def __init__(
        self,
        status: int,
        kind: str,
        message: str,
        *,
        param: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message
        self.param = param
        self.headers = headers or {}


# kind -> (OpenAI type, OpenAI code), Anthropic type
OPENAI_TYPES = {
    "invalid_request": ("invalid_request_error", None),
    "authentication": ("invalid_request_error", "invalid_api_key"),
    "not_found": ("invalid_request_error", "not_found"),
    "model_not_found": ("invalid_request_error", "model_not_found"),
    "too_large": ("invalid_request_error", "request_too_large"),
    "rate_limit": ("rate_limit_error", "rate_limit_exceeded"),
    "agent_busy": ("invalid_request_error", "agent_busy"),
    "unavailable": ("server_error", "service_unavailable"),
    "server": ("server_error", None),
}
ANTHROPIC_TYPES = {
    "invalid_request": "invalid_request_error",
    "authentication": "authentication_error",
    "not_found": "not_found_error",
    "model_not_found": "not_found_error",
    "too_large": "request_too_large",
    "rate_limit": "rate_limit_error",
    "agent_busy": "invalid_request_error",
    "unavailable": "overloaded_error",
    "server": "api_error",
}


def openai_error_body(error: APIError) -> dict:
    kind, code = OPENAI_TYPES[error.kind]
    return {"error": {"message": error.message, "type": kind, "param": error.param, "code": code}}


def anthropic_error_body(error: APIError) -> dict:
    return {
        "type": "error",
        "error": {"type": ANTHROPIC_TYPES[error.kind], "message": error.message},
    }


@dataclass(frozen=True)
class API:
    """One API as the server answers it: its name (the ``api`` label of the request count)
    and the shape of its error bodies."""

    name: str
    error_body: Callable[[APIError], dict]


OPENAI = API("openai", openai_error_body)
ANTHROPIC = API("anthropic", anthropic_error_body)
RESPONSES = API("responses", openai_error_body)
DIRECT = API("direct", openai_error_body)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, "invalid_request", message, param=param)


def from_validation(exc: ValidationError) -> APIError:
    """The first problem pydantic found, as ``field.path: what is wrong``."""
    first = exc.errors(include_url=False)[0]
    where = ".".join(str(p) for p in first["loc"])
    message = first["msg"]
    if first["type"] == "missing":
        message = "field required"
    return bad_request(f"{where}: {message}" if where else message, param=where or None)
