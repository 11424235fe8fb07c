"""Claiming and holding jobs: claim, release, renew, complete, fail, decompose.

**Claim.** One transaction. It reads the claiming node (effective status by
the database clock, devices, resident models) and the organization's model
registry, then scans the organization's claimable jobs in (priority, seq) order
*without* locking, judging each distinct requirement shape once with the pure
eligibility rules. Among the eligible candidates of a page it locks exactly one
with ``FOR UPDATE SKIP LOCKED``, re-checking in the same statement that the row
is still queued and due, so two claimers never hold the same job and a node
never takes a job of another organization or one it cannot run: eligibility is
decided before the lock, not after the claim. The scan is bounded: pages of
:data:`SCAN_PAGE` rows, at most :data:`MAX_SCAN_PAGES` of them, and every page
after the first excludes (in SQL) the requirement shapes already found
ineligible, so a deep queue of work this node cannot run stays cheap.

The job's state then changes only through the fold: ``job.claimed`` (attempt
incremented, lease set from the database clock, the placement recorded) is
appended and folded onto the locked row.

**Fencing.** Renew, complete, fail and decompose name the attempt they hold.
Anyone else, or a holder whose job was claimed again, gets 409
``job_not_claimed_by_this_node``; a holder whose job was cancelled gets 409
``job_cancelled``. Either refusal happens before any append.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Sequence
from uuid import UUID, uuid4

import msgspec
import psycopg

from umbra.domain.eligibility import is_busy
from umbra.domain.jobs import check_holder, decide_failure
from umbra.domain.node_status import DEFAULT_STALE_SECONDS
from umbra.domain.placement import best_placement
from umbra.errors import InvalidRequest, NotFound
from umbra.events import store
from umbra.events.types import JobClaimed, JobCompleted, JobDecomposed, JobLeaseRenewed, JobReleased, Placement, Requirements
from umbra.projections import jobs as queue
from umbra.projections.jobs import Change, JobRow

from .blocked import BlockingJudge, ModelRegistry, read_nodes
from .jobs import (
    IdempotencyKey, MaxAttempts, Name, Priority, RequiresRequest, jobs_by_idempotency_key, record_and_settle, refusing_nul,
    submitted_events,
)  # fmt: skip

log = logging.getLogger(__name__)

#: Candidate rows fetched per scan page.
SCAN_PAGE = 100
#: Pages scanned per claim before giving up (the next claim scans afresh).
MAX_SCAN_PAGES = 20

#: One page of the organization's claimable jobs in claim order, skipping requirement
#: shapes already judged ineligible; the single-command claim and the group commit share it.
CLAIMABLE_SCAN = """
SELECT id, priority, seq, requires::text FROM jobs
WHERE organization_id = %(org)s AND status = 'queued'
  AND (not_before IS NULL OR not_before <= umbra_now())
  AND (priority, seq) > (%(priority)s, %(seq)s)
  AND NOT (requires = ANY(%(skip)s::text[]::jsonb[]))
ORDER BY priority, seq
LIMIT %(limit)s
"""
_LOCK_ONE = f"""
SELECT {queue.SELECT_LIST}, umbra_now() FROM jobs
WHERE id = ANY(%(ids)s) AND organization_id = %(org)s AND status = 'queued'
  AND (not_before IS NULL OR not_before <= umbra_now())
ORDER BY priority, seq
LIMIT 1
FOR UPDATE SKIP LOCKED
"""
_LOCK_BY_ID = f"SELECT {queue.SELECT_LIST}, umbra_now() FROM jobs WHERE id = %s AND organization_id = %s FOR UPDATE"

_requirements = msgspec.json.Decoder(Requirements)


@dataclass(frozen=True, slots=True)
class ClaimResult:
    """A claimed job: the API's claim response plus what a caller needs to release it.

    ``job`` is the API Job object, ``placement`` the Placement object (device,
    reason, residency, eviction, estimate), ``lease_expires_at`` RFC 3339 UTC.
    """

    job_id: UUID
    attempt: int
    job: dict[str, Any]
    placement: dict[str, Any]
    lease_expires_at: str

    def to_json(self) -> dict[str, Any]:
        return {"job": self.job, "placement": self.placement, "lease_expires_at": self.lease_expires_at}


async def claim(
    conn: psycopg.AsyncConnection,
    *,
    node_id: UUID,
    organization_id: UUID,
    lease_seconds: int,
    stale_seconds: int = DEFAULT_STALE_SECONDS,
) -> ClaimResult | None:
    """Claim the first queued job of the organization this node is eligible for, or ``None``."""
    async with conn.transaction():
        nodes = await read_nodes(conn, organization_id, node_id=node_id, stale_seconds=stale_seconds)
        if not nodes or nodes[0].status != "online" or all(is_busy(d) for d in nodes[0].devices):
            return None
        node = nodes[0]
        registry = ModelRegistry(organization_id)
        judged: dict[str, Placement | None] = {}
        skip: list[str] = []
        after = (-(2**31), 0)
        for _ in range(MAX_SCAN_PAGES):
            params = {"org": organization_id, "priority": after[0], "seq": after[1], "skip": skip, "limit": SCAN_PAGE}
            page = await (await conn.execute(CLAIMABLE_SCAN, params)).fetchall()
            candidates: list[UUID] = []
            placements: dict[UUID, Placement] = {}
            for job_id, _priority, _seq, requires in page:
                if requires not in judged:
                    decoded = _requirements.decode(requires)
                    judged[requires] = best_placement(node, decoded, await registry.for_job(conn, decoded))
                    if judged[requires] is None:
                        skip.append(requires)
                placement = judged[requires]
                if placement is not None:
                    candidates.append(job_id)
                    placements[job_id] = placement
            if candidates:
                locked = await (await conn.execute(_LOCK_ONE, {"ids": candidates, "org": organization_id})).fetchone()
                if locked is not None:
                    return await _take(conn, locked, node_id, placements[locked[0]], lease_seconds)
            if len(page) < SCAN_PAGE:
                return None
            after = (page[-1][1], page[-1][2])
        return None


async def _take(
    conn: psycopg.AsyncConnection, locked: Sequence[Any], node_id: UUID, placement: Placement, lease_seconds: int
) -> ClaimResult:
    row, now = queue.from_db(locked), locked[-1]
    event = JobClaimed(
        attempt=row.attempt + 1, node_id=node_id, placement=placement,
        lease_expires_at=now + timedelta(seconds=lease_seconds),
    )  # fmt: skip
    [claimed] = await queue.record(conn, [Change(row.id, row.organization_id, row, [event])], metadata={"actor": f"node:{node_id}"})
    await store.publish(conn, [(row.organization_id, claimed.position, 0)])
    log.debug("job claimed", extra={"action": "job_claimed", "job_id": str(row.id), "node_id": str(node_id)})
    return ClaimResult(
        job_id=claimed.id,
        attempt=claimed.attempt,
        job=queue.to_json(claimed),
        placement=queue.placement_json(placement) or {},
        lease_expires_at=queue.timestamp(claimed.lease_expires_at) or "",
    )


_LOCK_FOR_RELEASE = f"SELECT {queue.SELECT_LIST} FROM jobs WHERE id = %s FOR UPDATE"


async def release(conn: psycopg.AsyncConnection, job_id: UUID, node_id: UUID, attempt: int) -> bool:
    """Give a just-claimed job back to the queue (``job.released``); False if this node no longer holds it.

    For a long-poll whose client went away before it received its claim. The
    attempt stays counted: it is the fencing token and never goes back, and a
    job that keeps losing its claimer's connection still has a bound.
    """
    async with conn.transaction():
        record = await (await conn.execute(_LOCK_FOR_RELEASE, (job_id,))).fetchone()
        if record is None:
            return False
        row = queue.from_db(record)
        if row.status != "running" or row.lease_owner != node_id or row.attempt != attempt:
            return False
        [released] = await queue.record(
            conn, [Change(row.id, row.organization_id, row, [JobReleased(attempt=attempt, reason="client_gone")])],
            metadata={"actor": f"node:{node_id}"},
        )
        await store.publish(conn, [(row.organization_id, released.position, 1)])
    return True


async def _held(
    conn: psycopg.AsyncConnection, organization_id: UUID, job_id: UUID, node_id: UUID, attempt: int
) -> tuple[JobRow, datetime]:
    record = await (await conn.execute(_LOCK_BY_ID, (job_id, organization_id))).fetchone()
    if record is None:
        raise NotFound("job_not_found", f"No job {job_id}.")
    row = queue.from_db(record)
    check_holder(status=row.status, lease_owner=row.lease_owner, attempt=row.attempt, node_id=node_id, claimed_attempt=attempt)
    return row, record[-1]


async def renew(
    conn: psycopg.AsyncConnection, *, organization_id: UUID, node_id: UUID, job_id: UUID, attempt: int, lease_seconds: int
) -> JobRow:
    """Extend the holder's lease to ``now + lease_seconds`` (database clock)."""
    async with conn.transaction():
        row, now = await _held(conn, organization_id, job_id, node_id, attempt)
        event = JobLeaseRenewed(attempt=attempt, lease_expires_at=now + timedelta(seconds=lease_seconds))
        [renewed] = await queue.record(conn, [Change(row.id, organization_id, row, [event])], metadata={"actor": f"node:{node_id}"})
        await store.publish(conn, [(organization_id, renewed.position, 0)])
    return renewed


async def complete(
    conn: psycopg.AsyncConnection, *, organization_id: UUID, node_id: UUID, job_id: UUID, attempt: int, result: Any
) -> JobRow:
    """The holder finished: the job completes and, if it was the last open child, its parent settles."""
    with refusing_nul():
        return await _complete(conn, organization_id, node_id, job_id, attempt, result)


async def _complete(conn: psycopg.AsyncConnection, organization_id: UUID, node_id: UUID, job_id: UUID, attempt: int, result: Any) -> JobRow:
    async with conn.transaction():
        row, _ = await _held(conn, organization_id, job_id, node_id, attempt)
        changes = [Change(row.id, organization_id, row, [JobCompleted(attempt=attempt, result=result)])]
        [done], position = await record_and_settle(conn, changes, metadata={"actor": f"node:{node_id}"})
        await store.publish(conn, [(organization_id, position, 0)])
    return done


async def fail(
    conn: psycopg.AsyncConnection,
    *,
    organization_id: UUID,
    node_id: UUID,
    job_id: UUID,
    attempt: int,
    error: str,
    retry: bool,
) -> JobRow:
    """A retryable failure requeues with backoff while attempts remain; otherwise the job fails."""
    with refusing_nul():
        async with conn.transaction():
            row, now = await _held(conn, organization_id, job_id, node_id, attempt)
            event = decide_failure(attempt=attempt, max_attempts=row.max_attempts, error=error, retry=retry, now=now)
            [failed], position = await record_and_settle(conn, [Change(row.id, organization_id, row, [event])],
                                                         metadata={"actor": f"node:{node_id}"})  # fmt: skip
            await store.publish(conn, [(organization_id, position, 0)])
    return failed


class ChildRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One child of ``POST /v1/agent/jobs/{id}/children``; priority defaults to the parent's."""

    kind: Name
    payload: dict[str, Any] = {}
    requires: RequiresRequest = msgspec.field(default_factory=RequiresRequest)
    priority: Priority | None = None
    max_attempts: MaxAttempts = 3
    idempotency_key: IdempotencyKey | None = None


async def add_children(
    conn: psycopg.AsyncConnection,
    *,
    organization_id: UUID,
    node_id: UUID,
    job_id: UUID,
    attempt: int,
    children: Sequence[ChildRequest],
) -> list[JobRow]:
    """Decompose a held job: children are ordinary jobs; the parent becomes a container.

    Children inherit the parent's organization, project and lang, and its
    priority unless they give one. The parent is released and stays
    ``running`` (never claimable) until its children settle it.
    """
    if not children:
        raise InvalidRequest("children must name at least one child.", field="children")
    with refusing_nul():
        return await _add_children(conn, organization_id, node_id, job_id, attempt, children)


async def _add_children(
    conn: psycopg.AsyncConnection, organization_id: UUID, node_id: UUID, job_id: UUID, attempt: int,
    children: Sequence[ChildRequest],
) -> list[JobRow]:  # fmt: skip
    async with conn.transaction():
        parent, _ = await _held(conn, organization_id, job_id, node_id, attempt)
        keys = [c.idempotency_key for c in children if c.idempotency_key]
        taken = await jobs_by_idempotency_key(conn, organization_id, keys)
        for index, child in enumerate(children):
            key = child.idempotency_key
            if key is not None and key in taken:
                raise InvalidRequest(f"children[{index}].idempotency_key is already used by job {taken[key].id}.",
                                     field=f"children[{index}].idempotency_key", index=index)  # fmt: skip
        if len(set(keys)) != len(keys):
            raise InvalidRequest("children repeat an idempotency_key.", field="children")
        judge = await BlockingJudge.load(conn, organization_id)
        actor = f"node:{node_id}"
        child_changes = [
            Change(uuid4(), organization_id, None, submitted_events(
                kind=c.kind, payload=c.payload, requires=c.requires.to_requirements(),
                priority=parent.priority if c.priority is None else c.priority, max_attempts=c.max_attempts,
                project_id=parent.project_id, lang=parent.lang, idempotency_key=c.idempotency_key,
                requested_by=actor, judge=judge, parent_job_id=parent.id,
            ))
            for c in children
        ]  # fmt: skip
        decomposed = JobDecomposed(attempt=attempt, children=tuple(c.job_id for c in child_changes))
        rows = await queue.record(conn, [Change(parent.id, organization_id, parent, [decomposed]), *child_changes],
                                  metadata={"actor": actor})  # fmt: skip
        queued = sum(1 for row in rows[1:] if row.status == "queued")
        await store.publish(conn, [(organization_id, max(r.position for r in rows), queued)])
    return rows[1:]
