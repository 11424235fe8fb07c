"""Retrying a failed job: an operator's second chance, recorded in the job's own history.

A job fails for good when its runs are spent or its handler says retrying
will not help; the fault is often outside it (a bad driver on one node, a
model registry entry fixed since, a dependency that was down for an hour).
Submitting it again makes a new job with a new id, and the first one's
history says nothing of the second. A retry puts the same job back in its
place in the queue (``job.retried``), with more runs, so an auditor replaying
it sees the failure, who retried it, and what came after.
"""

from __future__ import annotations

from datetime import datetime
from uuid import UUID

import psycopg

from umbra.domain.jobs import UnchargedEnds, decide_retry, dependencies_of, wait_for_time
from umbra.domain.node_status import DEFAULT_STALE_SECONDS, effective_status
from umbra.errors import NotFound
from umbra.events import store
from umbra.events.types import JobBlocked, JobSubmitted
from umbra.projections import jobs as queue
from umbra.projections.jobs import Change, JobRow

from .blocked import BlockingJudge
from .claims import uncharged_claims
from .jobs import dependency_statuses_of, record_and_settle, waiting_reason


async def retry(conn: psycopg.AsyncConnection, organization_id: UUID, job_id: UUID, *, actor: str | None,
                max_attempts: int | None = None, request_id: str | None = None,
                stale_seconds: int = DEFAULT_STALE_SECONDS) -> JobRow:  # fmt: skip
    """Send a failed job back to the queue with ``max_attempts`` more runs (default: as many as it was
    submitted with), blocked at once if nothing in the fleet could run it now, as a submission is, or
    while it waits for the jobs it depends on or for the ``not_before`` it was submitted with.
    ``stale_seconds``: the heartbeat silence after which the holder's node counts as gone, as the claims
    judge it (the settings').

    Refused (409 ``job_not_retryable``, nothing written) unless the job failed
    and belongs to no tree (:func:`umbra.domain.jobs.decide_retry`).
    """
    async with conn.transaction():
        judge = await BlockingJudge.load(conn, organization_id)  # the capacity lock before the row, as a submission
        row = await queue.load(conn, job_id, organization_id, lock=True)
        if row is None:
            raise NotFound("job_not_found", f"No job {job_id}.")
        failed = row.status == "failed"  # else refused below: nothing more to read
        submitted = await _submitted(conn, row) if failed else None
        if max_attempts is not None:
            grant = max_attempts
        else:
            grant = (submitted.max_attempts if submitted else row.max_attempts) if failed else 1
        not_before = submitted.not_before if submitted else None
        ends = (await uncharged_claims(conn, [job_id])).get(job_id, UnchargedEnds()) if failed else UnchargedEnds()
        dependencies = (dependencies_of(row.depends_on, await dependency_statuses_of(conn, organization_id, row.depends_on))
                        if failed and row.depends_on else None)  # fmt: skip
        retried = decide_retry(status=row.status, attempt=row.attempt, max_attempts=row.max_attempts,
                               parent_job_id=row.parent_job_id, children_total=row.children_total, grant=grant, by=actor,
                               ends=ends, dependencies=dependencies, not_before=not_before,
                               last_run_may_run_on=failed and await _last_run_may_run_on(conn, row, stale_seconds))  # fmt: skip
        waiting = dependencies.open if dependencies is not None else ()
        blocked: JobBlocked | None
        if waiting:
            blocked = JobBlocked(reason=waiting_reason(len(waiting)), waiting_on=waiting)
        elif not_before is not None and not_before > await _now(conn):  # submitted to run later, still to come
            blocked = wait_for_time(not_before)
        else:
            reason = judge.reason(row.requires)
            blocked = None if reason is None else JobBlocked(reason=reason)
        events = [retried] if blocked is None else [retried, blocked]
        rows, position = await record_and_settle(conn, [Change(job_id, organization_id, row, events)],
                                                 metadata=store.event_metadata(actor, request_id))  # fmt: skip
        await store.publish(conn, [(organization_id, position, 1 if blocked is None else 0)])
        return rows[0]


#: The holder's node as the claims judge it: its stored status, when it was last seen and last reported its
#: devices, and the database's now.
_HOLDER = """
SELECT n.status, l.last_seen_at, coalesce(l.reported_at, l.last_seen_at), umbra_now()
FROM nodes n LEFT JOIN node_liveness l ON l.node_id = n.id WHERE n.id = %s
"""


async def _last_run_may_run_on(conn: psycopg.AsyncConnection, row: JobRow, stale_seconds: int) -> bool:
    """Whether a job that ended under its holder (``ended_under_holder``) may still be running there: its
    node is alive (online or draining, heard from lately) and has not reported its devices since the job
    ended. Its memory is counted as taken until then (``RUNNING_TAKING_MEMORY``), and a retry would stop
    that. A node gone silent, or retired, runs nothing the claims need to count."""
    if not row.ended_under_holder or row.lease_owner is None or row.finished_at is None:
        return False
    found = await (await conn.execute(_HOLDER, (row.lease_owner,))).fetchone()
    if found is None:
        return False
    status, last_seen, reported, now = found
    heard_lately = effective_status("online", last_seen, now, stale_seconds=stale_seconds) == "online"
    alive = status in ("online", "draining") and heard_lately
    return alive and (reported is None or reported <= row.finished_at)


async def _submitted(conn: psycopg.AsyncConnection, row: JobRow) -> JobSubmitted | None:
    """The job's submission: the runs it was submitted with (its row's ``max_attempts`` has grown by any
    earlier retry) and the ``not_before`` (its row's is a back-off's, or None after an earlier retry)."""
    submitted = await store.read_stream(conn, store.job_stream(row.id), types=["job.submitted"])
    first = submitted[0].event if submitted else None
    return first if isinstance(first, JobSubmitted) else None


async def _now(conn: psycopg.AsyncConnection) -> datetime:
    return (await (await conn.execute("SELECT umbra_now()")).fetchone())[0]  # type: ignore[index]
