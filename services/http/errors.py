"""The error every refusal of the OpenAI-compatible endpoints becomes, and pydantic's validation
errors as one of them (a 400 naming the field)."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError


class OpenAIError(Exception):
    """An HTTP error answered as ``{"error": {"message", "type", "param", "code"}}``."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "invalid_request_error", 429: "rate_limit_error", 499: "cancelled",
             500: "server_error", 502: "server_error", 503: "service_unavailable",
             504: "timeout"}

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}


def _loc(loc: tuple) -> str:
    """pydantic's ('messages', 0, 'content') -> 'messages[0].content'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "list[str]", "list[int]", "int", "function-after[...]") or "[" in str(part):
            continue  # union member names pydantic adds to the location
        else:
            out += ("." if out else "") + str(part)
    return out


def invalid(e: ValidationError) -> OpenAIError:
    """The first validation error as a 400 naming its field."""
    err = e.errors(include_url=False)[0]
    param = _loc(err["loc"]) or None
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        msg = "unknown field; this server does not accept it"
    return OpenAIError(400, f"{param}: {msg}" if param else msg, param=param,
                       code="invalid_value" if err["type"] != "missing" else "missing_required_parameter")
