"""``GET /v1/jobs/{id}/explain``: why a job is (not) running, per node and device."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from umbra.compute.explain import explain
from umbra.domain.explain import Explanation

from .http import authenticated, json_response, path_uuid
from .routing import endpoint


async def explain_job(request: Request) -> Response:
    settings = request.app.state.services.settings
    async with authenticated(request, "jobs:read") as (who, conn):
        job_id = path_uuid(request, code="job_not_found")
        answer = await explain(
            conn,
            who.organization_id,
            job_id,
            stale_seconds=settings.heartbeat_stale_seconds,
            blocked_timeout_seconds=settings.blocked_timeout_seconds,
            affinity_seconds=settings.model_affinity_seconds,
        )
    return json_response(answer)


routes = [
    endpoint("GET", "/v1/jobs/{id}/explain", explain_job,
             summary="Why a job is or is not running: eligible devices best first, the first rule every other "
                     "device fails, and one sentence to act on.",
             auth="api_key", scopes=("jobs:read",), response=Explanation),
]  # fmt: skip
