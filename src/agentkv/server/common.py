"""What every API's requests share: the served models' limits, strict field types, body
validation, stop lists and sampling bounds (the engine's). (Replies: ``replies.py``.)"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, Field, ValidationError

from ..engine.generation import MAX_TEMPERATURE, MAX_TOP_LOGPROBS, check_sampling
from ..errors import InvalidRequestError
from ..model.generation_config import GenerationDefaults
from .errors import APIError, bad_request, from_validation

StrictInt = Annotated[int, Field(strict=True)]
StrictFloat = Annotated[float, Field(strict=True)]
StrictStr = Annotated[str, Field(strict=True)]
StrictBool = Annotated[bool, Field(strict=True)]
MAX_STOPS = 16


@dataclass(frozen=True)
class ServerLimits:
    """The models served (id -> context length) and the reply length when none is asked
    (None: the model's own, from its generation config)."""

    models: dict
    default_max_tokens: int | None = None

    @property
    def model_id(self) -> str:
        """The default model (the first served)."""
        return next(iter(self.models))

    def check_model(self, name: str) -> str:
        """The served model's id for ``name`` (case-insensitive); 404 if none."""
        for known in self.models:
            if known.lower() == name.lower():
                return known
        served = ", ".join(repr(m) for m in self.models)
        raise APIError(
            404,
            "model_not_found",
            f"model {name!r} is not served here; this server serves {served}",
            param="model",
        )

    def check_max_tokens(
        self, value: int | None, param: str, model: str | None = None
    ) -> int | None:
        """A request's reply limit, checked against the model's context (None: not asked)."""
        limit = self._context(model)
        if value is not None and not 1 <= value <= limit:
            raise bad_request(
                f"{param} must be between 1 and {limit} (the model's context), got {value}", param
            )
        return value

    def reply_tokens(self, defaults: GenerationDefaults, model: str) -> int:
        """The reply limit of a request that asks none: the server's, else the model's."""
        wanted = self.default_max_tokens or defaults.max_tokens
        return min(wanted, self._context(model))

    def _context(self, model: str | None) -> int:
        return self.models.get(model or self.model_id) or 1 << 20


def parse_body(model: type[BaseModel], body: Any) -> BaseModel:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise from_validation(exc) from None


def stop_list(value, param: str) -> list[str]:
    stops = [value] if isinstance(value, str) else list(value or [])
    if len(stops) > MAX_STOPS:
        raise bad_request(f"{param}: at most {MAX_STOPS} stop sequences", param)
    if any(not s for s in stops):
        raise bad_request(f"{param}: stop sequences must be non-empty strings", param)
    return stops


def sampling(temperature: float | None, top_p: float | None):
    """(temperature, top_p) as the request names them (None: the model's default, filled in
    once its model is known), checked against the engine's bounds (temperature 0 to
    ``MAX_TEMPERATURE``, top_p in (0, 1]) for every API alike."""
    t = 0.0 if temperature is None else temperature
    try:
        check_sampling(t, 1.0 if top_p is None else top_p)
    except InvalidRequestError as exc:
        param = "temperature" if not 0.0 <= t <= MAX_TEMPERATURE else "top_p"
        raise bad_request(str(exc), param) from None
    return temperature, top_p


def requested_logprobs(
    logprobs: bool, top_logprobs: int | None, *, needs: str = "logprobs: true"
) -> int | None:
    """The engine's ``logprobs`` option (None: none; n: each token's with the n likeliest)
    from whether a request asks for log-probs (``needs`` says how) and its
    ``top_logprobs``, which needs that."""
    param = "top_logprobs"
    if top_logprobs is None:
        return 0 if logprobs else None
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(
            f"{param} must be between 0 and {MAX_TOP_LOGPROBS}, got {top_logprobs}", param
        )
    if not logprobs:
        raise bad_request(f"{param} needs {needs}", param)
    return top_logprobs
