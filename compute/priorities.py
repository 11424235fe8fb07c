"""Moving a job to another priority: urgent work ahead, a bulk run behind, without submitting it again.

A job submitted again is a new job with a new id: the first one's history
says nothing of the second, and a submitter's idempotency key now names the
wrong one. The move is recorded in the job's own stream
(``job.reprioritized``, naming who and the priority it replaced), so the
queue's order at any position of the log can be replayed.
"""

from __future__ import annotations

from uuid import UUID

import psycopg

from umbra.domain.jobs import decide_reprioritize
from umbra.errors import NotFound
from umbra.events import store
from umbra.projections import jobs as queue
from umbra.projections.jobs import Change, JobRow

from .jobs import record_and_settle


async def reprioritize(conn: psycopg.AsyncConnection, organization_id: UUID, job_id: UUID, priority: int, *,
                       actor: str | None, request_id: str | None = None) -> JobRow:  # fmt: skip
    """Give a waiting (queued or blocked) job ``priority``; the job as it then stands.

    Nothing is recorded when it already has that priority. Refused (409,
    nothing written) for a job running, ended or that made children
    (:func:`umbra.domain.jobs.decide_reprioritize`). A queued job due now
    is announced claimable: a claimer that looked while this transaction
    held its row skipped it, and would otherwise wait for its next poll.
    """
    async with conn.transaction():
        row = await queue.load(conn, job_id, organization_id, lock=True)
        if row is None:
            raise NotFound("job_not_found", f"No job {job_id}.")
        event = decide_reprioritize(status=row.status, priority=row.priority, new=priority,
                                    children_total=row.children_total, by=actor)  # fmt: skip
        if event is None:
            return row
        rows, position = await record_and_settle(conn, [Change(job_id, organization_id, row, [event])],
                                                 metadata=store.event_metadata(actor, request_id))  # fmt: skip
        moved = rows[0]  # its updated_at is the move's time: now, on the database's clock
        due = moved.status == "queued" and (moved.not_before is None or moved.not_before <= moved.updated_at)
        await store.publish(conn, [(organization_id, position, 1 if due else 0)])
        return moved
