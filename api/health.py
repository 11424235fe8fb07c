"""Liveness and readiness.

Declared like every other route, so the OpenAPI document describes the probes a
monitor or load balancer is configured with.
"""

from __future__ import annotations

import logging

import anyio
import msgspec
from starlette.requests import Request

from umbra.migrate import pending_migrations

from .http import json_response
from .routing import endpoint

log = logging.getLogger(__name__)

#: How long ``/readyz`` waits for the database in all (a connection, then its reads) before it answers 503:
#: a database that takes the query and never answers (a stalled server, a network dropping packets silently)
#: is not ready, and a probe left waiting with it answers nothing for as long as the operating system's TCP
#: timeout.
READY_DATABASE_SECONDS = 2.0


class HealthStatus(msgspec.Struct, kw_only=True):
    """What both probes answer; a 503's ``error`` and ``message`` say why, as any error does."""

    #: "ok" or "ready"; "failed" or "unavailable" with a 503.
    status: str
    error: str | None = None
    message: str | None = None
    #: ``/readyz`` when ready: whether the log listener is connected (events reach waiters at once).
    listener_connected: bool | None = None


async def healthz(request: Request):
    """200 while the process can serve; 503 once a background task it needs has failed (it is stopping)."""
    failure = getattr(request.app.state, "failure", None)
    if failure:
        return json_response({"status": "failed", "error": "background_task_failed", "message": failure}, status=503)
    return json_response({"status": "ok"})


async def readyz(request: Request):
    """200 only when the database answers, no migration is pending and no background task has failed
    (the process is then stopping: a load balancer should stop sending it requests at once)."""
    failure = getattr(request.app.state, "failure", None)
    if failure:
        return json_response({"status": "failed", "error": "background_task_failed", "message": failure}, status=503)
    services = request.app.state.services
    try:
        with anyio.fail_after(READY_DATABASE_SECONDS):
            async with services.pool.connection(timeout=READY_DATABASE_SECONDS) as conn:
                pending = await pending_migrations(conn)
    except Exception as exc:  # any failure to reach the database means "not ready"
        # The driver's text stays in the log: it may carry hosts, roles or SQL, and this route needs no credential.
        log.warning("not ready: database unavailable", extra={"action": "not_ready", "error": type(exc).__name__, "detail": str(exc)[:200]})
        return json_response({"status": "unavailable", "error": "database_unavailable",
                              "message": "The database does not answer."}, status=503)  # fmt: skip
    if pending:
        return json_response(
            {"status": "unavailable", "error": "migrations_pending", "message": f"Pending migrations: {', '.join(pending)}"},
            status=503,
        )
    return json_response({"status": "ready", "listener_connected": services.listener.connected.is_set()})


routes = [
    endpoint("GET", "/healthz", healthz, summary="Liveness: 200 while the process can serve.", auth="none",
             response=HealthStatus, error_body=HealthStatus,
             errors={503: "A background task the process needs has failed; it is stopping (`background_task_failed`)."}),
    endpoint("GET", "/readyz", readyz,
             summary="Readiness: 200 only when the database answers and no migration is pending.", auth="none",
             response=HealthStatus, error_body=HealthStatus,
             errors={503: "The database does not answer (`database_unavailable`), a migration is pending "
                          "(`migrations_pending`), or a background task failed (`background_task_failed`)."}),
]  # fmt: skip
