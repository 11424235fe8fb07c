"""Delayed submissions: a job submitted with a ``not_before`` still to come waits for it, ``blocked``, and the
sweeper releases it when that moment has come.

A job submitted to run later (``"not_before"`` in a submission) is recorded
``job.submitted`` with its ``not_before`` and ``job.blocked`` with ``until``
(:func:`umbra.domain.jobs.wait_for_time`): the row is ``blocked``, its
``waiting_until`` set. Each tick the sweeper's leader reads the jobs whose time
has come (index ``jobs_waiting_until``, empty without delayed jobs) and
releases them (``job.unblocked``, reason ``due``), each judged against the
fleet as a submission is, so it is queued, or blocked for good reason if
nothing could run it now; long-polls waiting for work are hinted. Between
ticks the leader also wakes when the first waiting job's time comes
(:func:`next_times`, read again after every tick and every move of the
log, which a new delayed submission is), so a job falls due at its time, not
up to a sweep interval (``UMBRA_SWEEP_INTERVAL_SECONDS``) after it.

Why blocked, not queued with a later ``not_before`` as a retry's back-off is:
a claim walks its organization's queue in order, and jobs scheduled for
tomorrow ahead of today's work would be walked over, and filtered out, by every
claim until then. A back-off delays the few jobs that failed by seconds; a
schedule may hold a million jobs for a day.

While it waits for its time the job neither times out as blocked
(``UMBRA_BLOCKED_TIMEOUT_SECONDS`` counts from its release) nor is released by a
fleet change; it can be cancelled, and moved to another priority. One that
also depends on other jobs waits for them first, then for its time.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Mapping, NamedTuple
from uuid import UUID

import psycopg

from umbra.domain.jobs import decide_due
from umbra.events.types import Event
from umbra.projections import jobs as queue

from .dependencies import Released, settle_waiting

#: A page of the jobs whose time has come, in the order they fell due, after ``(after_at, after_id)`` (none:
#: from the first), with the clock; those another transaction holds (a cancel in flight) are left to the next
#: tick.
_DUE = f"""
SELECT {queue.SELECT_LIST}, umbra_now() FROM jobs
WHERE status = 'blocked' AND waiting_until IS NOT NULL AND waiting_until <= umbra_now()
  AND (%(after_at)s::timestamptz IS NULL OR (waiting_until, id) > (%(after_at)s, %(after_id)s::uuid))
ORDER BY waiting_until, id LIMIT %(limit)s
FOR UPDATE SKIP LOCKED
"""
#: Whether a waiting job has fallen due since the look ``%(after)s`` names (by its clock, or by the log's
#: position then: see :class:`Look`), the seconds to the first time still to come, the clock and the log's
#: position: two probes of index ``jobs_waiting_until`` (a min over the rows past now would read every one of
#: them), the due part of it only as long as its jobs wait for a release, and one of the log's last position.
_NEXT = """
SELECT EXISTS (SELECT 1 FROM jobs WHERE status = 'blocked' AND waiting_until IS NOT NULL AND waiting_until <= umbra_now()
               AND (%(after)s::timestamptz IS NULL OR waiting_until > %(after)s OR position > %(after_position)s)),
       extract(epoch FROM (SELECT waiting_until FROM jobs WHERE status = 'blocked' AND waiting_until > umbra_now()
                           ORDER BY waiting_until LIMIT 1) - umbra_now()),
       umbra_now(),
       (SELECT coalesce(max(position), 0) FROM events)
"""
#: Jobs released per transaction.
PAGE = 500
_WIDTH = len(queue.COLUMNS)
_WAITING_UNTIL = queue.COLUMNS.index("waiting_until")


async def release_due(conn: psycopg.AsyncConnection, *, metadata: Mapping[str, Any]) -> Released:
    """Release every job whose ``not_before`` has come, page by page, each page its own transaction."""
    done = Released()
    after: tuple[Any, UUID] | None = None
    while True:
        async with conn.transaction():
            params = {"after_at": after[0] if after else None, "after_id": after[1] if after else None, "limit": PAGE}
            found = await (await conn.execute(_DUE, params)).fetchall()
            verdicts: list[tuple[queue.JobRow, Event]] = []
            for record in found:
                row = queue.from_db(record[:_WIDTH])
                if (verdict := decide_due(status=row.status, waiting_until=row.waiting_until, now=record[_WIDTH])) is not None:
                    verdicts.append((row, verdict))
            await settle_waiting(conn, verdicts, done, metadata=metadata)
        if len(found) < PAGE:
            return done
        after = (found[-1][_WAITING_UNTIL], found[-1][0])


class Look(NamedTuple):
    """When a look at the waiting jobs saw them: the database's clock and the log's last position then.

    A job falls due after a look when its time comes after the look's clock,
    or when it was written after the look, whatever its time: a submission
    whose ``not_before`` came while it committed (its transaction began before
    that time, it committed after it) was not there to be seen by a look in
    between, and its time is before that look's clock. Positions are visible
    in the order they were taken (see :mod:`umbra.events.store`), so one the
    look did not see is after the look's position.
    """

    clock: datetime
    position: int


async def next_times(conn: psycopg.AsyncConnection, *, after: Look | None = None) -> tuple[bool, float | None, Look]:
    """Whether a job waiting for its time has fallen due (since the look ``after``, when given), the seconds
    until the next one falls due (``None``: none is still to come), and this look.

    Apart, so that a due job a release had to leave waiting (its row held
    elsewhere) never hides a later one's time; ``after`` leaves out the jobs
    that fell due before a release that has run since, and were there for it.
    """
    params = {"after": after.clock if after else None, "after_position": after.position if after else None}
    [(due, seconds, now, position)] = await (await conn.execute(_NEXT, params)).fetchall()
    return bool(due), None if seconds is None else float(seconds), Look(now, position)
