"""Agent routes for a job the node holds: renew, complete, fail, give back, decompose.

Each names the attempt it holds (the fencing token). Renewals and completions
from many agents share transactions (:mod:`umbra.compute.group_commit`); each
is still decided on its own locked row. Not the holder, or a
stale attempt, is 409 ``job_not_claimed_by_this_node``; a cancelled job is 409
``job_cancelled``; neither changes anything. A completion, failure or
decomposition sent again by the node that reported it, for the same attempt
(it did not hear the answer), is answered as the first was and records
nothing (:mod:`umbra.domain.jobs`). The organization and the node come from
the credential, never from the request.
"""

from __future__ import annotations

import time
from typing import Annotated, Any
from uuid import UUID

import msgspec
from msgspec import Meta
from starlette.requests import Request
from starlette.responses import Response

from umbra.compute import claims
from umbra.compute.claims import ChildRequest
from umbra.compute.jobs import check_document
from umbra.errors import InvalidRequest, Unauthenticated, UmbraError
from umbra.events.types import Progress, Timestamp
from umbra.projections import jobs as queue
from umbra.projections.jobs import JobOut

from .agent import MAX_JOBS_PER_REQUEST, Claim, lease_left_header, release_unheard
from .http import acting_as, authorized, batch_principal, json_response, path_uuid, read_json, request_id
from .params import KIND_QUERY, query_bool, query_int, query_kinds
from .routing import endpoint

Attempt = Annotated[int, Meta(ge=1, le=2**31 - 1)]


class ProgressRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """How far the job is, sent with a renewal: either field may be left out."""

    #: The fraction done, 0 to 1.
    fraction: Annotated[float, Meta(ge=0, le=1)] | None = None
    #: A line for people ("epoch 4 of 10").
    message: Annotated[str, Meta(max_length=500)] | None = None


class RenewRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    attempt: Attempt
    #: An addition: recorded with the renewal (``job.lease_renewed``) and shown on the Job until the next.
    progress: ProgressRequest | None = None


class CompleteRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    attempt: Attempt
    result: Any = None

    def __post_init__(self) -> None:
        check_document(self.result, "result")


class ReportedResult(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    job_id: UUID
    attempt: Attempt
    result: Any = None

    def __post_init__(self) -> None:
        check_document(self.result, "result")


class CompleteManyRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    results: Annotated[list[ReportedResult], Meta(min_length=1, max_length=MAX_JOBS_PER_REQUEST)]


class FailRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    attempt: Attempt
    error: Annotated[str, Meta(max_length=10_000)]
    #: Retry after the backoff while attempts remain (the default), or fail now.
    retry: bool = True


class GiveBackRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    attempt: Attempt


class ChildrenRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    attempt: Attempt
    children: Annotated[list[ChildRequest], Meta(min_length=1, max_length=10_000)]


class RenewOut(msgspec.Struct, kw_only=True):
    """A renewal's answer: the lease's new end, for the attempt that holds it."""

    lease_expires_at: Timestamp
    attempt: int


class CompletedJob(JobOut, kw_only=True):
    """A completion's answer: the Job, and with ``claim_next`` the node's next claim (``null``: none)."""

    next_claim: Claim | None = None


class ResultAnswer(msgspec.Struct, kw_only=True):
    """One result of ``POST /v1/agent/complete``: ``status`` 200 with the ``job``, or a refusal's."""

    job_id: UUID
    status: int
    job: JobOut | None = None
    error: str | None = None
    message: str | None = None


class CompleteManyOut(msgspec.Struct, kw_only=True):
    results: list[ResultAnswer]
    next_claims: list[Claim]


class ChildrenOut(msgspec.Struct, kw_only=True):
    children: list[JobOut]


async def renew(request: Request) -> Response:
    services = request.app.state.services
    who = await batch_principal(request, "compute:claim", "compute:complete")
    job_id = path_uuid(request, code="job_not_found")
    body = await read_json(request, RenewRequest)
    asked_at = time.monotonic()  # before the renewal's transaction: the lease left is measured from here
    said = body.progress
    # An empty object says nothing: as if left out, what was said last stands.
    progress = None
    if said is not None and said != ProgressRequest():
        progress = Progress(fraction=said.fraction, message=said.message)
    row = await request.app.state.group_commit.renew(
        organization_id=who.organization_id, node_id=who.node_id, job_id=job_id, attempt=body.attempt,
        lease_seconds=services.settings.lease_seconds, credential_id=who.credential_id, request_id=request_id(request),
        progress=progress,
    )  # fmt: skip
    return json_response({"lease_expires_at": queue.timestamp(row.lease_expires_at), "attempt": row.attempt},
                         headers=lease_left_header(request, row, asked_at))


async def complete(request: Request) -> Response:
    """Report a result; with ``claim_next=true``, also claim this node's next job in the same transaction.

    The next claim never waits: ``next_claim`` is the claim (as the long-poll
    answers it) or ``null`` when nothing this node may take is queued, and the
    agent then long-polls as usual. It needs the ``compute:claim`` scope too.
    If the agent hung up while the batch ran, the claim is released at once
    (``job.released``), as a long-poll's is; the completion stands.
    """
    who = await batch_principal(request, "compute:complete")
    job_id = path_uuid(request, code="job_not_found")
    claim_next = query_bool(request, "claim_next", default=False)
    if claim_next:
        who.require("compute:claim")
    kinds = query_kinds(request)
    body = await read_json(request, CompleteRequest)
    group = request.app.state.group_commit
    if not claim_next:
        row = await group.complete(
            organization_id=who.organization_id, node_id=who.node_id, job_id=job_id, attempt=body.attempt,
            result=body.result, credential_id=who.credential_id, request_id=request_id(request),
        )  # fmt: skip
        return json_response(queue.job_out(row))
    settings = request.app.state.services.settings
    row, claimed = await group.complete_and_claim(
        organization_id=who.organization_id, node_id=who.node_id, job_id=job_id, attempt=body.attempt,
        result=body.result, lease_seconds=settings.lease_seconds, stale_seconds=settings.heartbeat_stale_seconds,
        credential_id=who.credential_id, request_id=request_id(request), kinds=kinds,
    )  # fmt: skip
    if claimed is not None:
        if await request.is_disconnected():  # the agent left while its batch ran: nobody would run the job
            await release_unheard(request.app.state.services, [claimed], who.node_id, request_id(request))
            claimed = None
    return json_response({**queue.to_json(row), "next_claim": claimed.to_json() if claimed is not None else None},
                         headers=lease_left_header(request, claimed.row, claimed.asked_at) if claimed is not None else None)


async def complete_many(request: Request) -> Response:
    """``POST /v1/agent/complete``: several results in one request, and the node's next jobs with them.

    For an agent that runs several jobs at once. Each result is its own
    completion, fenced by its own attempt, and answers on its own: ``results``
    holds, in order, ``{"job_id", "status": 200, "job": Job}`` or ``{"job_id",
    "status": 404|409|422, "error", "message"}``; a refused one changes
    nothing, and the others still land. ``claim_next=N`` also claims up to N
    jobs for the node (never waiting), returned in ``next_claims``. A revoked
    credential refuses the whole request (401).
    """
    who = await batch_principal(request, "compute:complete")
    claim_next = query_int(request, "claim_next", default=0, minimum=0, maximum=MAX_JOBS_PER_REQUEST)
    if claim_next:
        who.require("compute:claim")
    kinds = query_kinds(request)
    body = await read_json(request, CompleteManyRequest, items="results")
    seen: set[UUID] = set()
    for index, item in enumerate(body.results):
        if item.job_id in seen:
            raise InvalidRequest(f"results[{index}] repeats job {item.job_id}.", field=f"results[{index}].job_id", index=index)
        seen.add(item.job_id)
    settings = request.app.state.services.settings
    answers, claimed = await request.app.state.group_commit.complete_many(
        organization_id=who.organization_id, node_id=who.node_id,
        results=[(item.job_id, item.attempt, item.result) for item in body.results], claim_next=claim_next,
        lease_seconds=settings.lease_seconds, stale_seconds=settings.heartbeat_stale_seconds,
        credential_id=who.credential_id, request_id=request_id(request), kinds=kinds,
    )  # fmt: skip
    failure = next((a for a in answers if isinstance(a, Unauthenticated) or _unexpected(a)), None)
    if claimed and (failure is not None or await request.is_disconnected()):
        # The agent will not hear of these claims (it left, or gets an error): give them back now.
        await release_unheard(request.app.state.services, claimed, who.node_id, request_id(request))
        claimed = []
    if failure is not None:
        raise failure
    return json_response({"results": [_reported(item.job_id, answer) for item, answer in zip(body.results, answers)],
                          "next_claims": [claim.to_json() for claim in claimed]},
                         headers=lease_left_header(request, claimed[0].row, claimed[0].asked_at) if claimed else None)  # fmt: skip


def _unexpected(answer: Any) -> bool:
    """An error that is not a refusal of this one result (it answers the whole request with 5xx:
    the database away included, so the agent sends the whole report again)."""
    return isinstance(answer, BaseException) and (not isinstance(answer, UmbraError) or answer.status >= 500)


def _reported(job_id: UUID, answer: Any) -> dict[str, Any]:
    if isinstance(answer, UmbraError):
        return {"job_id": str(job_id), "status": answer.status, **answer.to_json()}
    return {"job_id": str(job_id), "status": 200, "job": queue.job_out(answer)}


async def _held_job_report(request: Request, body_type: type[Any], **read: Any) -> tuple[Any, UUID, Any]:
    """The node, the job and the body of a report about a job it holds that runs on its own transaction
    (fail, give back, decompose); the body is read with no connection held, and the caller acts within
    :func:`acting_as` (not revoked while the body arrived)."""
    who = await authorized(request, "compute:complete")
    job_id = path_uuid(request, code="job_not_found")
    return who, job_id, await read_json(request, body_type, **read)


async def fail(request: Request) -> Response:
    who, job_id, body = await _held_job_report(request, FailRequest)
    async with acting_as(request, who) as conn:
        row = await claims.fail(conn, organization_id=who.organization_id, node_id=who.node_id, job_id=job_id,
                                attempt=body.attempt, error=body.error, retry=body.retry,
                                request_id=request_id(request))  # fmt: skip
    return json_response(queue.job_out(row))


async def give_back(request: Request) -> Response:
    """A stopping agent gives back a job it could not finish in its grace (:func:`claims.give_back`)."""
    who, job_id, body = await _held_job_report(request, GiveBackRequest)
    async with acting_as(request, who) as conn:
        row = await claims.give_back(conn, organization_id=who.organization_id, node_id=who.node_id, job_id=job_id,
                                     attempt=body.attempt, request_id=request_id(request))  # fmt: skip
    return json_response(queue.job_out(row))


async def children(request: Request) -> Response:
    who, job_id, body = await _held_job_report(request, ChildrenRequest, items="children")
    async with acting_as(request, who) as conn:
        rows = await claims.add_children(conn, organization_id=who.organization_id, node_id=who.node_id, job_id=job_id,
                                         attempt=body.attempt, children=body.children,
                                         request_id=request_id(request))  # fmt: skip
    return json_response({"children": [queue.job_out(row) for row in rows]}, status=201)


#: The refusal of a report about a job the node does not hold (API.md "Agent protocol").
NOT_HELD = {409: "Not the holder, or a stale attempt (`job_not_claimed_by_this_node`); the job was cancelled "
                 "(`job_cancelled`). Nothing changes."}

routes = [
    endpoint("POST", "/v1/agent/jobs/{id}/renew", renew, summary="Extend the lease on a held job.",
             auth="node", scopes=("compute:claim", "compute:complete"), body=RenewRequest, response=RenewOut,
             errors=NOT_HELD),
    endpoint("POST", "/v1/agent/jobs/{id}/complete", complete, summary="Report a held job's result.",
             auth="node", scopes=("compute:complete",), body=CompleteRequest, response=CompletedJob, errors=NOT_HELD,
             query={"claim_next": (bool, False, "Also claim this node's next job in the same transaction (needs "
                                               "`compute:claim`); the answer's `next_claim` is that claim or null. "
                                               "Never waits."), "kind": KIND_QUERY}),
    endpoint("POST", "/v1/agent/complete", complete_many,
             summary="Report several held jobs' results at once, each fenced and answered on its own.",
             auth="node", scopes=("compute:complete",), body=CompleteManyRequest, response=CompleteManyOut,
             query={"claim_next": (int, False, f"Also claim up to this many jobs for the node, 0..{MAX_JOBS_PER_REQUEST} "
                                               "(needs `compute:claim`), returned in `next_claims`. Never waits."),
                    "kind": KIND_QUERY}),
    endpoint("POST", "/v1/agent/jobs/{id}/fail", fail,
             summary="Report a failure: retryable ones requeue with exponential backoff until max_attempts.",
             auth="node", scopes=("compute:complete",), body=FailRequest, response=JobOut, errors=NOT_HELD),
    endpoint("POST", "/v1/agent/jobs/{id}/release", give_back,
             summary="Give back a held job the agent is stopping before it finished: queued again at once, in its "
                     "place, not charged while the job's interruptions are fewer than its max_attempts.",
             auth="node", scopes=("compute:complete",), body=GiveBackRequest, response=JobOut, errors=NOT_HELD),
    endpoint("POST", "/v1/agent/jobs/{id}/children", children,
             summary="Split a held job into children; the parent becomes a container that settles with them.",
             auth="node", scopes=("compute:complete",), body=ChildrenRequest, success=(201,), response=ChildrenOut,
             errors=NOT_HELD),
]  # fmt: skip
