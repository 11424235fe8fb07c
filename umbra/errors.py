"""One error hierarchy with stable codes.

Domain code raises these; ``umbra.api`` maps each class to an HTTP status in one
exception handler. Codes are part of the API contract (API.md); messages tell
the reader what to do.
"""

from __future__ import annotations

from typing import Any


class UmbraError(Exception):
    """Base: a refused operation with a stable machine-readable code."""

    status = 400
    #: Seconds a client should wait before sending the request again (``Retry-After``), if it should.
    retry_after: int | None = None

    def __init__(self, code: str, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.extra = extra

    def to_json(self) -> dict[str, Any]:
        return {"error": self.code, "message": self.message, **self.extra}


class InvalidRequest(UmbraError):
    status = 422

    def __init__(self, message: str, **extra: Any) -> None:
        super().__init__("invalid_request", message, **extra)


class Unauthenticated(UmbraError):
    status = 401

    def __init__(self, message: str = "A valid bearer token is required.", code: str = "unauthenticated") -> None:
        super().__init__(code, message)


class Forbidden(UmbraError):
    status = 403

    def __init__(self, message: str) -> None:
        super().__init__("forbidden", message)


class NotFound(UmbraError):
    status = 404


class Conflict(UmbraError):
    status = 409


class RateLimited(UmbraError):
    status = 429

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__("rate_limited", message)
        self.retry_after = retry_after


class DatabaseUnavailable(UmbraError):
    """The database could not be reached or ended the connection: send the request again shortly."""

    status = 503
    retry_after = 1

    def __init__(self, message: str = "The database is unavailable; try again shortly.") -> None:
        super().__init__("database_unavailable", message)


class ConcurrencyConflict(Conflict):
    """An append found the stream at a different version than expected."""

    def __init__(self, stream: str, expected: int) -> None:
        super().__init__(
            "concurrency_conflict",
            f"Stream {stream} moved past version {expected}; reload and retry.",
        )
        self.stream = stream
        self.expected = expected
