"""Wire error codes, the exception that carries one, and the map from engine exceptions to codes.

Every failure that crosses a service boundary becomes one :class:`ErrorCode`. A code fixes the
HTTP-like status a front end answers with and whether the client may retry the same request.
Engine exceptions are mapped by class *name* (walking the exception's MRO), so this module never
imports ``engine`` (DESIGN §2: protocol imports neither torch, ray nor the engine).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "ErrorCode",
    "ProtocolError",
    "code_for_exception",
    "code_for_exception_name",
    "EXCEPTION_CODES",
]


class ErrorCode(enum.StrEnum):
    """What went wrong, as seen by the caller. The value is what travels on the wire."""

    INVALID_REQUEST = "invalid_request"  # the request itself is bad; fix it, do not retry
    BUSY = "busy"  # queue full / back-pressure; retry later
    NOT_FOUND = "not_found"  # unknown request id, model or expert
    PROTOCOL = "protocol"  # bad frame: not msgpack, oversized, wrong version, unknown type
    ENGINE_DEAD = "engine_dead"  # the decode engine died; Ray restarts it, then retry
    EXPERT_LOAD = "expert_load"  # an expert could not be loaded or failed its checksum
    CAPACITY = "capacity"  # can never fit this deployment (KV cache / expert cache too small)
    CANCELLED = "cancelled"  # the client cancelled or disconnected
    TIMEOUT = "timeout"  # a deadline passed
    INTERNAL = "internal"  # a bug or a broken deployment (bad model files, bad config)

    @property
    def http_status(self) -> int:
        """The HTTP status a front end should answer with."""
        return _HTTP_STATUS[self]

    @property
    def retryable(self) -> bool:
        """True when sending the same request again later may succeed."""
        return self in _RETRYABLE


_HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.BUSY: 503,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.PROTOCOL: 400,
    ErrorCode.ENGINE_DEAD: 503,
    ErrorCode.EXPERT_LOAD: 502,
    ErrorCode.CAPACITY: 413,
    ErrorCode.CANCELLED: 499,  # nginx's "client closed request"
    ErrorCode.TIMEOUT: 504,
    ErrorCode.INTERNAL: 500,
}

# BUSY, ENGINE_DEAD (the actor is restarted), EXPERT_LOAD (loader restarted / blob re-read) and
# TIMEOUT are transient; everything else fails the same way on a retry.
_RETRYABLE = frozenset(
    {ErrorCode.BUSY, ErrorCode.ENGINE_DEAD, ErrorCode.EXPERT_LOAD, ErrorCode.TIMEOUT}
)

# Exception class name -> code. Names, not classes: protocol must not import engine or ray.
# The lookup walks the MRO, so the most specific listed ancestor wins; MoestreamError catches
# engine errors added later and not listed here (tests/protocol checks every current one is).
EXCEPTION_CODES: Mapping[str, ErrorCode] = {
    # engine/errors.py
    "RequestValidationError": ErrorCode.INVALID_REQUEST,
    "CapacityError": ErrorCode.CAPACITY,
    "CacheCapacityError": ErrorCode.CAPACITY,
    "DeviceBudgetError": ErrorCode.CAPACITY,  # the --vram-budget cap: out of device memory
    "HostMemoryError": ErrorCode.CAPACITY,  # the process's memory (cgroup limit) cannot hold the run
    "ChecksumError": ErrorCode.EXPERT_LOAD,
    "ExpertLoadError": ErrorCode.EXPERT_LOAD,
    "ModelFormatError": ErrorCode.INTERNAL,  # the deployment's model files are broken
    "UnsupportedArchitectureError": ErrorCode.INTERNAL,
    "TokenizerNotFoundError": ErrorCode.INTERNAL,
    "ConfigError": ErrorCode.INTERNAL,  # deploy config out of range: not the client's fault
    "EngineDeadError": ErrorCode.ENGINE_DEAD,
    "RequestNotFoundError": ErrorCode.NOT_FOUND,
    "MoestreamError": ErrorCode.INTERNAL,
    # pydantic (request models built at ingress)
    "ValidationError": ErrorCode.INVALID_REQUEST,
    # Ray and Ray Serve, by name
    "BackPressureError": ErrorCode.BUSY,
    "GetTimeoutError": ErrorCode.TIMEOUT,
    "ActorDiedError": ErrorCode.ENGINE_DEAD,
    "ActorUnavailableError": ErrorCode.ENGINE_DEAD,
    "RayActorError": ErrorCode.ENGINE_DEAD,
    "TaskCancelledError": ErrorCode.CANCELLED,
    # builtins / asyncio
    "QueueFull": ErrorCode.BUSY,
    "CancelledError": ErrorCode.CANCELLED,
    "TimeoutError": ErrorCode.TIMEOUT,
}


class ProtocolError(Exception):
    """An error with a wire code: raised by the codec, and the way services report failures.

    ``field_errors`` holds ``(location, message)`` pairs when the failure is a validation error,
    e.g. ``("sampling.temperature", "Input should be a finite number")``.
    """

    def __init__(
        self,
        message: str,
        code: ErrorCode = ErrorCode.PROTOCOL,
        *,
        field_errors: Iterable[tuple[str, str]] = (),
    ) -> None:
        self.code = ErrorCode(code)
        self.message = message
        self.field_errors: tuple[tuple[str, str], ...] = tuple(field_errors)
        super().__init__(message)

    @property
    def retryable(self) -> bool:
        return self.code.retryable

    @property
    def http_status(self) -> int:
        return self.code.http_status

    def __repr__(self) -> str:
        return f"ProtocolError(code={self.code.name}, message={self.message!r})"

    @classmethod
    def from_validation_error(
        cls, exc: Any, what: str, code: ErrorCode = ErrorCode.INVALID_REQUEST, limit: int = 8
    ) -> ProtocolError:
        """Wrap a pydantic ``ValidationError`` (duck-typed) into a readable, bounded message.

        Input values are left out on purpose: they may be megabytes long (a 10^5-item stop list).
        """
        field_errors = _field_errors(exc)
        shown = "; ".join(f"{loc}: {msg}" for loc, msg in field_errors[:limit])
        more = len(field_errors) - limit
        if more > 0:
            shown += f"; ... and {more} more"
        return cls(f"invalid {what}: {shown}", code, field_errors=field_errors)


def _field_errors(exc: Any) -> list[tuple[str, str]]:
    out = []
    for err in exc.errors(include_url=False, include_input=False, include_context=False):
        loc = "".join(
            f"[{part}]" if isinstance(part, int) else (f".{part}" if i else str(part))
            for i, part in enumerate(err.get("loc", ()))
        )
        out.append((loc or "<message>", str(err.get("msg", "invalid"))[:512]))
    return out


def code_for_exception_name(exc: str | BaseException | type[BaseException]) -> ErrorCode:
    """Map an exception to a wire code without importing the module that defines it.

    ``exc`` is a class name (``"ChecksumError"`` or ``"engine.errors.ChecksumError"``), an
    exception class, or an exception instance. For classes and instances the names along
    ``type(exc).__mro__`` are tried most-specific first; a :class:`ProtocolError` keeps its own
    code. Anything unknown is ``INTERNAL``.
    """
    if isinstance(exc, ProtocolError):
        return exc.code
    if isinstance(exc, str):
        names: Iterable[str] = (exc.rsplit(".", 1)[-1],)
    else:
        cls = exc if isinstance(exc, type) else type(exc)
        if issubclass(cls, ProtocolError):
            return ErrorCode.PROTOCOL
        names = (c.__name__ for c in cls.__mro__)
    for name in names:
        code = EXCEPTION_CODES.get(name)
        if code is not None:
            return code
    return ErrorCode.INTERNAL


code_for_exception = code_for_exception_name
