"""Liveness and readiness."""

from __future__ import annotations

import logging

from starlette.requests import Request
from starlette.routing import Route

from umbra.migrate import pending_migrations

from .http import json_response

log = logging.getLogger(__name__)


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
        async with services.pool.connection(timeout=2) as conn:
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


routes = [Route("/healthz", healthz, methods=["GET"]), Route("/readyz", readyz, methods=["GET"])]
