"""Job routes for submitters and readers (API keys): submit, batch, list, read, cancel, retry, priority."""

from __future__ import annotations

from uuid import UUID

import anyio
import msgspec
import psycopg
from starlette.requests import Request
from starlette.responses import Response

from umbra.compute import jobs, priorities, retries
from umbra.compute.jobs import BatchRequest, JobRequest, MaxAttempts, Priority
from umbra.errors import InvalidRequest, NotFound
from umbra.compute.auth import Principal
from umbra.events.types import JOB_STATUSES, TERMINAL_JOB_STATUSES
from umbra.projections import jobs as queue
from umbra.projections.jobs import JobOut, JobRow

from .agent import MAX_WAIT_SECONDS
from .http import acting_as, authenticated, authorized, json_response, path_uuid, read_json, request_id, watch_disconnect
from .params import query_bool, query_int, query_kinds, query_statuses, query_value
from .routing import endpoint

#: Page size bounds for ``GET /v1/jobs``.
DEFAULT_LIMIT = 100
MAX_LIMIT = 1000


class JobPage(msgspec.Struct, kw_only=True):
    """A page of ``GET /v1/jobs``; ``next`` is the cursor of the page after it, ``null`` at the end."""

    jobs: list[JobOut]
    next: str | None


class SubmittedJobs(msgspec.Struct, kw_only=True):
    """A batch's jobs, in request order."""

    jobs: list[JobOut]


class RetryRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``POST /v1/jobs/{id}/retry``'s body, which may be left out."""

    #: Runs the retry grants; by default as many as the job was submitted with.
    max_attempts: MaxAttempts | None = None


class PriorityRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``POST /v1/jobs/{id}/priority``'s body."""

    #: The job's priority from now on (lower runs first), in the range a submission takes.
    priority: Priority


#: A submission naming a project this organization does not have.
#: A submission's refusals for what it names: its project, the jobs it depends on.
SUBMISSION_REFUSED = {
    404: "No such project in this organization (`project_not_found`), or no such job to depend on (`job_not_found`); "
         "nothing is submitted.",
    409: "A job it would depend on already failed, was cancelled or settled `partial` (`dependency_failed`, with "
         "`dependency` and its `status`): it would only fail; nothing is submitted.",
}


async def submit_job(request: Request) -> Response:
    who = await authorized(request, "jobs:write")
    spec = await read_json(request, JobRequest)  # read with no connection held
    async with acting_as(request, who) as conn:  # not revoked while the body arrived
        rows, created = await jobs.submit(conn, who.organization_id, [spec], actor=who.actor, batch=False,
                                          request_id=request_id(request))  # fmt: skip
    return json_response(queue.job_out(rows[0]), status=201 if created else 200)


async def submit_batch(request: Request) -> Response:
    who = await authorized(request, "jobs:write")
    batch = await read_json(request, BatchRequest, items="jobs")  # read with no connection held
    async with acting_as(request, who) as conn:  # not revoked while the body arrived
        rows, _ = await jobs.submit(conn, who.organization_id, batch.jobs, actor=who.actor, batch=True,
                                    request_id=request_id(request))  # fmt: skip
    # 201 even when every key was known: only the single submission answers a repeat with 200 (API.md).
    return json_response({"jobs": [queue.job_out(row) for row in rows]}, status=201)


async def list_jobs(request: Request) -> Response:
    async with authenticated(request, "jobs:read") as (who, conn):
        statuses = query_statuses(request, JOB_STATUSES)
        kinds = query_kinds(request)
        limit = query_int(request, "limit", default=DEFAULT_LIMIT, minimum=1, maximum=MAX_LIMIT)
        after = query_int(request, "after", default=0, minimum=0, maximum=2**63 - 1)
        rows, cursor = await jobs.list_jobs(conn, who.organization_id, statuses=statuses, kinds=kinds, limit=limit, after=after)
    return json_response({"jobs": [queue.job_out(row) for row in rows], "next": str(cursor) if cursor else None})


#: Longest ``?wait=`` of a job read: a claim's long-poll's.
MAX_JOB_WAIT_SECONDS = MAX_WAIT_SECONDS


async def get_job(request: Request) -> Response:
    async with authenticated(request, "jobs:read", "compute:read") as (who, conn):
        job_id = path_uuid(request, code="job_not_found")
        as_of = query_value(request, "as_of")
        if as_of is not None and not as_of.strip():
            raise InvalidRequest("as_of must be a log position (an integer >= 0).", field="as_of")
        position = None if as_of is None else query_int(request, "as_of", default=0, minimum=0, maximum=2**63 - 1)
        wait = query_int(request, "wait", default=0, minimum=0, maximum=MAX_JOB_WAIT_SECONDS)
        if wait and as_of is not None:
            raise InvalidRequest("wait reads a job until it ends; a job as it stood at a position never changes.",
                                 field="wait")  # fmt: skip
        row = await _visible_job(conn, who, job_id, position)
    if wait and row.status not in TERMINAL_JOB_STATUSES:
        # No connection is held while the request waits; the job is read again, by a credential checked again.
        gone = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch_disconnect, request, gone, tg.cancel_scope)
            await request.app.state.job_waits.until_ended(who.organization_id, job_id, wait)
            tg.cancel_scope.cancel()
        if gone.is_set():  # nobody will read the answer: it is not read again
            return json_response(queue.job_out(row))
        async with authenticated(request, "jobs:read", "compute:read") as (who, conn):
            row = await _visible_job(conn, who, job_id, None)
    return json_response(queue.job_out(row))


async def _visible_job(conn: psycopg.AsyncConnection, who: Principal, job_id: UUID, position: int | None) -> JobRow:
    """The job, now or as of ``position``, as the credential may see it: a node sees only the jobs it holds
    or held; any other is as if missing."""
    row = await jobs.get_job(conn, who.organization_id, job_id, as_of=position)
    if who.kind == "node" and row.lease_owner != who.node_id and not await jobs.ever_held(conn, job_id, who.node_id):
        raise NotFound("job_not_found", f"No job {job_id}" + (f" at position {position}." if position is not None else "."))
    return row


async def cancel_job(request: Request) -> Response:
    async with authenticated(request, "jobs:write") as (who, conn):
        job_id = path_uuid(request, code="job_not_found")
        if query_value(request, "if_waiting") == "":  # a safety catch left blank is not taken as off
            raise InvalidRequest("if_waiting must be true or false, not empty.", field="if_waiting")
        if_waiting = query_bool(request, "if_waiting", default=False)
        row = await jobs.cancel(conn, who.organization_id, job_id, actor=who.actor, request_id=request_id(request),
                                if_waiting=if_waiting)  # fmt: skip
    return json_response(queue.job_out(row))


async def retry_job(request: Request) -> Response:
    who = await authorized(request, "jobs:write")
    job_id = path_uuid(request, code="job_not_found")
    body = await read_json(request, RetryRequest, empty_ok=True)  # read with no connection held
    async with acting_as(request, who) as conn:  # not revoked while the body arrived
        row = await retries.retry(conn, who.organization_id, job_id, actor=who.actor, max_attempts=body.max_attempts,
                                  request_id=request_id(request),
                                  stale_seconds=request.app.state.services.settings.heartbeat_stale_seconds)  # fmt: skip
    return json_response(queue.job_out(row))


async def reprioritize_job(request: Request) -> Response:
    who = await authorized(request, "jobs:write")
    job_id = path_uuid(request, code="job_not_found")
    body = await read_json(request, PriorityRequest)  # read with no connection held
    async with acting_as(request, who) as conn:  # not revoked while the body arrived
        row = await priorities.reprioritize(conn, who.organization_id, job_id, body.priority, actor=who.actor,
                                            request_id=request_id(request))  # fmt: skip
    return json_response(queue.job_out(row))


routes = [
    endpoint("POST", "/v1/jobs", submit_job, summary="Submit a job (an idempotency key already used returns its job, 200).",
             auth="api_key", scopes=("jobs:write",), body=JobRequest, success=(201, 200), response=JobOut,
             errors=SUBMISSION_REFUSED),
    endpoint("POST", "/v1/jobs/batch", submit_batch,
             summary="Submit up to 10,000 jobs, all or nothing; a refusal names the failing item's index.",
             auth="api_key", scopes=("jobs:write",), body=BatchRequest, success=(201,), response=SubmittedJobs,
             errors=SUBMISSION_REFUSED),
    endpoint("GET", "/v1/jobs", list_jobs, summary="List jobs in submission order, paged by cursor.",
             auth="api_key", scopes=("jobs:read",),
             query={"status": (str, False, "comma-separated statuses, e.g. queued,running"),
                    "kind": (list[str], False, "repeatable: only jobs of these kinds"),
                    "limit": (int, False, f"page size, 1..{MAX_LIMIT}, default {DEFAULT_LIMIT}"),
                    "after": (int, False, "the previous page's `next` cursor")}, response=JobPage),
    endpoint("GET", "/v1/jobs/{id}", get_job,
             summary="Read a job, or as it stood after log position as_of (a node reads only jobs it holds or held).",
             auth="api_key|node", scopes=("jobs:read", "compute:read"),
             query={"as_of": (int, False, "a log position: fold the job's events up to it"),
                    "wait": (int, False, f"seconds, 0..{MAX_JOB_WAIT_SECONDS} (default 0): wait, holding no database "
                                         "connection, until the job ends; the answer is the job then, ended or not")},
             response=JobOut),
    endpoint("POST", "/v1/jobs/{id}/cancel", cancel_job,
             summary="Cancel a job (a running holder learns on its next renew/complete); terminal → 409 job_terminal.",
             auth="api_key", scopes=("jobs:write",), response=JobOut,
             query={"if_waiting": (bool, False, "only while it waits (queued or blocked): running → 409 job_running")},
             errors={409: "The job already ended (`job_terminal`), or runs and `if_waiting` was asked (`job_running`); "
                          "nothing changes."}),
    endpoint("POST", "/v1/jobs/{id}/retry", retry_job,
             summary="Send a failed job back to the queue with more runs (job.retried); its history goes on.",
             auth="api_key", scopes=("jobs:write",), body=RetryRequest, response=JobOut,
             errors={409: "Not a failed job, one of a tree, or one that depends on a job which ended otherwise than "
                            "complete (`job_not_retryable`); nothing changes."}),
    endpoint("POST", "/v1/jobs/{id}/priority", reprioritize_job,
             summary="Move a waiting (queued or blocked) job to another priority (job.reprioritized); same priority: "
                     "nothing recorded.",
             auth="api_key", scopes=("jobs:write",), body=PriorityRequest, response=JobOut,
             errors={409: "The job ended (`job_terminal`), runs or made children (`job_not_reprioritizable`); nothing "
                          "changes."}),
]  # fmt: skip
