"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

from __future__ import annotations

from fastapi.responses import JSONResponse
from pydantic import ValidationError

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    422: "unprocessable_entity_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}
"""OpenAI's error types; any other 4xx (405, 413, ...) is an invalid_request_error, any other 5xx an internal one."""


class FieldError(ValueError):
    """A validation failure that knows the request field it is about (pydantic keeps it as the error's ctx)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class APIError(Exception):
    """Any failure a route turns into an OpenAI-shaped error response."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    @property
    def type(self) -> str:
        if self.status in _TYPES:
            return _TYPES[self.status]
        return "invalid_request_error" if 400 <= self.status < 500 else "internal_server_error"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {**self.headers, **({"WWW-Authenticate": "Bearer"} if self.status == 401 else {})}
        return JSONResponse(self.body(), status_code=self.status, headers=headers or None)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code="invalid_value" if param else None)


def from_validation_error(exc: ValidationError) -> APIError:
    """The first pydantic error, with its field path as `param` (e.g. "messages.0.role")."""
    first = exc.errors()[0]
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, FieldError):
        return bad_request(str(cause), cause.param)
    param = ".".join(str(part) for part in first["loc"]) or None
    # pydantic prefixes custom messages with "Value error, "; users do not need it.
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] not in ("value_error", "assertion_error"):
        # pydantic's own error type, as its str() ends (and vLLM's messages carry it): a client can match
        # "greater_than_equal" without parsing the words
        message += f" [type={first['type']}]"
    return bad_request(f"{param}: {message}" if param else message, param)


def param_of(message: str, fields: frozenset[str]) -> str | None:
    """The field an engine ValueError starts with ("max_tokens must be ..." -> "max_tokens"), if it is one."""
    word = message.split(" ", 1)[0].strip(":=,")
    return word if word in fields else None
