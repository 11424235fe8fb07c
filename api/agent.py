"""``POST /v1/agent/claim?wait=S``: the long-poll an idle agent parks on.

The request authenticates on a pooled connection and gives it back; it then
waits in the process's :class:`~umbra.api.longpoll.WaiterHub` holding no
connection at all, and each claim attempt joins the next group-commit batch
(:mod:`umbra.compute.group_commit`), which borrows one connection per batch. A thousand idle agents therefore cost a thousand small objects in
memory, not a thousand database connections.

A client that hangs up while waiting claims nothing: a task watches
``receive()`` for ``http.disconnect`` and cancels the wait. A claim attempt is
never cut in half (the hub shields it), so if one committed just as the client
left, the job is released at once (``job.released``) instead of sitting leased
to a node that will never hear of it.
"""

from __future__ import annotations

import logging
import time
from typing import Annotated, Any, Sequence
from uuid import UUID

import anyio
import msgspec
from msgspec import Meta
from starlette.requests import Request
from starlette.responses import Response

from umbra import metrics
from umbra.compute import claims
from umbra.compute.abandoned_claims import ClaimAbandoned, abandon
from umbra.compute.claims import SCAN_PAGE
from umbra.errors import Forbidden
from umbra.events.types import Placement, Timestamp
from umbra.projections.jobs import JobOut, JobRow

from .http import acting_as, authorized, batch_principal, json_response, read_json, received_at, request_id, watch_disconnect
from .longpoll import LOOK_AGAIN_SOON, NOTHING_QUEUED, LookAgainIn, WaiterHub
from .middleware import REQUEST_ID_PATTERN
from .params import KIND_QUERY, query_int, query_kinds
from .rates import RELEASE_BURST, RELEASES_PER_SECOND
from .routing import endpoint

log = logging.getLogger(__name__)

MAX_WAIT_SECONDS = 60
DEFAULT_WAIT_SECONDS = 30
#: Most jobs one claim may take (``max``), and one batch report may carry.
MAX_JOBS_PER_REQUEST = SCAN_PAGE
#: The header of a claim's or a renewal's answer saying how many seconds of lease it leaves, at least, when
#: it is sent (:func:`umbra.compute.claims.lease_left`): measured on the server's own clock, so the agent reads
#: it against none (``umbra.agent.client.lease_left``). A header, so that every answer's body stays the
#: contract's. The claims of one answer were made in one transaction: the first's is said for all.
LEASE_LEFT_HEADER = "Umbra-Lease-Seconds"
#: Beside it, the seconds between the request's arrival and that measurement. The agent's round trip less
#: this is the most the request and its answer can have spent on their way (a proxy holding the answer, a
#: congested link), which the agent takes off the lease too: an answer that arrived 40 s late left its agent
#: believing it held 60 s of a lease with 20 s left, and its first renewal came after the lease had ended.
HELD_HEADER = "Umbra-Held-Seconds"


def lease_left_header(request: Request, row: JobRow, asked_at: float | None) -> dict[str, str]:
    """:data:`LEASE_LEFT_HEADER` and :data:`HELD_HEADER` for an answer granting ``row``'s lease (none for a
    job holding no lease)."""
    left = claims.lease_left(row, asked_at)
    if left is None:
        return {}
    arrived = received_at(request)
    held = {} if arrived is None else {HELD_HEADER: f"{max(0.0, time.monotonic() - arrived):.3f}"}
    return {LEASE_LEFT_HEADER: f"{left:.3f}", **held}


class Claim(msgspec.Struct, kw_only=True):
    """A claimed job, its placement, and when the lease runs out unless renewed."""

    job: JobOut
    placement: Placement
    lease_expires_at: Timestamp


class ClaimOut(Claim, kw_only=True):
    """The claim's answer: the first job claimed, and with ``max`` above 1 every one."""

    #: With ``max`` above 1 only: every job taken, in claim order (the first is the fields above).
    claims: list[Claim] | None = None


async def claim(request: Request) -> Response:
    services = request.app.state.services
    hub: WaiterHub = request.app.state.waiters
    who = await batch_principal(request, "compute:claim")
    if who.node_id is None:
        raise Forbidden("Only a node credential can claim jobs.")
    wait = query_int(request, "wait", default=DEFAULT_WAIT_SECONDS, minimum=0, maximum=MAX_WAIT_SECONDS)
    most = query_int(request, "max", default=1, minimum=1, maximum=MAX_JOBS_PER_REQUEST)
    kinds = query_kinds(request)
    node_id: UUID = who.node_id
    settings = services.settings

    group = request.app.state.group_commit

    async def attempt() -> Any:
        # Claims from many agents share a transaction (umbra.compute.group_commit).
        return await group.claim_many(
            node_id=node_id,
            organization_id=who.organization_id,
            count=most,
            lease_seconds=settings.lease_seconds,
            stale_seconds=settings.heartbeat_stale_seconds,
            empty=NOTHING_QUEUED,
            busy=LOOK_AGAIN_SOON,
            later=LookAgainIn,
            credential_id=who.credential_id,
            request_id=request_id(request),
            kinds=kinds,
        )

    started = time.monotonic()
    gone = anyio.Event()
    result: list[claims.ClaimResult] | None = None
    refusal: Exception | None = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(watch_disconnect, request, gone, tg.cancel_scope)
        try:
            result = await hub.wait_for(who.organization_id, attempt, timeout=wait)
        except Exception as exc:  # e.g. the credential was revoked, or the database went away, while this poll waited
            refusal = exc  # raised outside the task group, so its handler sees it and not an exception group
        tg.cancel_scope.cancel()
    elapsed = time.monotonic() - started
    if isinstance(refusal, ClaimAbandoned):  # its agent gave it up (claim/release), here or in another process
        metrics.CLAIM_WAIT.labels(outcome="client_gone").observe(elapsed)
        return Response(status_code=204)
    if refusal is not None:
        raise refusal
    if result:
        metrics.CLAIMS.labels(trigger="same_claim").inc(len(result) - 1)  # the hub counted the first
    if gone.is_set():  # nobody will read the answer
        metrics.CLAIM_WAIT.labels(outcome="client_gone").observe(elapsed)
        if result:
            await release_unheard(services, result, node_id, request_id(request))
        return Response(status_code=204)
    if result is None:
        metrics.CLAIM_WAIT.labels(outcome="timeout").observe(elapsed)
        return Response(status_code=204)
    metrics.CLAIM_WAIT.labels(outcome="claimed").observe(elapsed)
    headers = lease_left_header(request, result[0].row, result[0].asked_at)
    if most == 1:
        return json_response(result[0].to_json(), headers=headers)
    return json_response({**result[0].to_json(), "claims": [claimed.to_json() for claimed in result]}, headers=headers)


async def release_unheard(services, results: Sequence[claims.ClaimResult], node_id: UUID, request_id: str | None) -> None:
    """Give back claims their agent will not hear of, because it left before the answer was sent
    (``job.released``, ``reason``: ``client_gone``), instead of leaving them leased.

    One connection for all of them; each release is its own transaction.
    """
    with anyio.CancelScope(shield=True):
        async with services.pool.connection() as conn:
            for result in results:
                released = await claims.release(conn, result.job_id, node_id, result.attempt, request_id=request_id)
                log.info("claim released: answer unheard", extra={"action": "claim_released_client_gone",
                         "job_id": str(result.job_id), "node_id": str(node_id), "released": released})  # fmt: skip


class UnreadClaimRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    #: The ``X-Request-ID`` the claim request was sent with (the form the server keeps: see
    #: :mod:`umbra.api.middleware`).
    request_id: Annotated[str, Meta(pattern=REQUEST_ID_PATTERN)]


class UnreadClaimOut(msgspec.Struct, kw_only=True):
    released: list[UUID]


async def release_unread(request: Request) -> Response:
    """The agent never read a claim request's answer: give back what that request took, if anything."""
    who = await authorized(request, "compute:claim")
    request.app.state.services.release_rates.take(who.node_id, "give-backs of unread claims")
    body = await read_json(request, UnreadClaimRequest)
    # Two transactions: the abandonment commits first, holding the node's claim guard only that long (the
    # nodes sharing it look again in a moment), then what the request took is given back.
    async with acting_as(request, who) as conn:
        await abandon(conn, who.organization_id, who.node_id, body.request_id)
    async with acting_as(request, who) as conn:
        released = await claims.release_unread_claim(conn, organization_id=who.organization_id, node_id=who.node_id,
                                                     claim_request_id=body.request_id, request_id=request_id(request))  # fmt: skip
    if released:
        log.info("claims released: answer unread", extra={"action": "claim_released_answer_unread",
                 "node_id": str(who.node_id), "count": len(released)})  # fmt: skip
    return json_response({"released": [str(job_id) for job_id in released]})


routes = [
    endpoint(
        "POST",
        "/v1/agent/claim",
        claim,
        summary="Long-poll for a job this node is eligible for; 204 when none arrives within `wait` seconds.",
        auth="node",
        scopes=("compute:claim",),
        query={"wait": (int, False, f"Seconds to wait, 0..{MAX_WAIT_SECONDS} (default {DEFAULT_WAIT_SECONDS})."),
               "max": (int, False, f"Jobs to take at most, 1..{MAX_JOBS_PER_REQUEST} (default 1). Above 1 the answer "
                                   "also lists every claim in `claims` (the first is also the answer's own fields); "
                                   "it comes as soon as one job is claimed."),
               "kind": KIND_QUERY},
        success=(200, 204),
        response=ClaimOut,
    ),
    endpoint("POST", "/v1/agent/claim/release", release_unread,
             summary="Give back what a claim request took when its answer was never read (the agent gave up on "
                     "it): each such job still leased to the node, untouched since, is released, uncharged.",
             auth="node", scopes=("compute:claim",), body=UnreadClaimRequest, response=UnreadClaimOut,
             errors={429: f"More than {RELEASE_BURST} at once or {RELEASES_PER_SECOND:g} a second after that from this "
                          "node (`rate_limited`, with `Retry-After`), checked before the body: each holds claims "
                          "of the nodes that share its claim guard for a moment."}),
]
