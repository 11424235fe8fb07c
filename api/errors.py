"""The one exception handler: every refusal becomes ``{"error", "message"}``."""

from __future__ import annotations

import logging

import psycopg
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Match

from umbra.db import DATABASE_AWAY, LOCK_WAIT_SECONDS, SERVICE_LOCK_WAIT_SECONDS, database_away, lock_wait_ended
from umbra.errors import DatabaseUnavailable, UmbraError

from .http import json_response, refusal_after_deferred_revocation, request_id

log = logging.getLogger(__name__)


async def umbra_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, UmbraError)
    if getattr(request.state, "revocation_deferred", False):
        exc = await refusal_after_deferred_revocation(request, exc)
    headers = {}
    if exc.retry_after is not None:
        headers["Retry-After"] = str(exc.retry_after)
    if exc.status == 401 and exc.code == "unauthenticated":  # a credential would do (not a wrong pairing code)
        headers["WWW-Authenticate"] = "Bearer"  # HTTP's 401 names the scheme to authenticate with
    return json_response(exc.to_json(), status=exc.status, headers=headers)


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 400: "invalid_request", 413: "payload_too_large"}


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = _HTTP_CODES.get(exc.status_code, "http_error")
    headers = exc.headers
    if exc.status_code == 405:
        headers = {**(headers or {}), "Allow": ", ".join(_allowed_methods(request))}
    return json_response({"error": code, "message": str(exc.detail)}, status=exc.status_code, headers=headers)


def _allowed_methods(request: Request) -> list[str]:
    """The methods of every route whose path matches the request's: Starlette's 405 names those of the first
    alone, and ``GET`` and ``POST /v1/jobs`` (``PUT`` and ``DELETE /v1/models/{slug}``) are two routes each."""
    routes = request.app.router.routes
    return sorted({method for route in routes if getattr(route, "methods", None)
                   and route.matches(request.scope)[0] is not Match.NONE for method in route.methods})  # fmt: skip


#: Logged for a request whose client hung up before sending its whole body (nginx's code for it).
CLIENT_CLOSED_REQUEST = 499


async def client_gone(request: Request, exc: Exception) -> Response:
    """The client left mid-request (an agent killed while sending): nobody reads an answer and
    nothing was done, so it is neither a server error nor worth a traceback."""
    return Response(status_code=CLIENT_CLOSED_REQUEST)


async def data_error(request: Request, exc: Exception) -> Response:
    """A value PostgreSQL refused to store (SQLSTATE class 22: NUL in text, out of range...).

    It comes from the request's data, so it is the caller's 422, not a 500; the
    command's transaction has rolled back, so nothing was written.
    """
    log.warning("value refused by the database", extra={"action": "data_error", "path": request.url.path,
                                                         "error": type(exc).__name__, "request_id": request_id(request)})  # fmt: skip
    return json_response(
        {"error": "invalid_request", "message": "A value in the request cannot be stored (for example a NUL character)."},
        status=422,
    )


LOCKED_MESSAGE = (f"A row this request needs was held by another transaction for more than {LOCK_WAIT_SECONDS} s, "
                  f"or one of the server's own locks was queued for more than {SERVICE_LOCK_WAIT_SECONDS} s; "
                  "nothing was changed; try again shortly.")


async def database_unavailable(request: Request, exc: Exception) -> Response:
    """The database could not be reached or ended the connection (a restart, a failover, a pool
    with no free connection in time): the caller should try again. Any other operational error (a
    deadlock, a statement PostgreSQL refused) is a server error, answered 500 with its traceback.

    A 503 with ``Retry-After`` tells clients to try again; a 500 would say the request itself is at
    fault, and an EventSource gives up on it for good. Whether the command committed is unknown
    when the connection broke during its ``COMMIT``: a completion, a failure or a decomposition
    sent again by its node is answered as the repeat it is (:mod:`umbra.domain.jobs`), and a claim
    that did commit is released.

    A lock waited for past its bound (``LOCK_WAIT_SECONDS`` for a row, ``SERVICE_LOCK_WAIT_SECONDS``
    for the server's own locks) is answered so too: its holder will let go.
    """
    if lock_wait_ended(exc):
        log.warning("lock wait ended", extra={"action": "lock_wait_ended", "path": request.url.path,
                                              "request_id": request_id(request)})  # fmt: skip
        return await umbra_error(request, DatabaseUnavailable(LOCKED_MESSAGE))
    if not database_away(exc):
        return await unexpected_error(request, exc)
    log.warning("database unavailable", extra={"action": "database_unavailable", "path": request.url.path,
                                                "error": type(exc).__name__, "request_id": request_id(request)})  # fmt: skip
    return await umbra_error(request, DatabaseUnavailable())


async def unexpected_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error", extra={"action": "unhandled_error", "path": request.url.path, "request_id": request_id(request)})
    return json_response({"error": "internal", "message": "Internal error; see the server log."}, status=500)


HANDLERS = {
    UmbraError: umbra_error,
    HTTPException: http_error,
    ClientDisconnect: client_gone,
    psycopg.DataError: data_error,
    **{away: database_unavailable for away in DATABASE_AWAY},
    Exception: unexpected_error,
}
