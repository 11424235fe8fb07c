"""Job counts by status, read from ``job_counts`` instead of counting ``jobs``.

``jobs`` keeps every terminal job for ever, and a ``count(*) ... GROUP BY status``
over it grows with it: at 3 million jobs ``GET /metrics`` spent 0.8-0.9 s of its
1 s on it, at 6 million every scrape timed out (``umbra_database_up 0`` while the
database was well, the queue depth left at zeros); the queue view counted an
organization's jobs at each of its streams' reads. ``job_counts`` holds the same
numbers, kept by statement-level triggers on ``jobs`` in the transaction of every
write of its rows (migrations/0050 says why triggers, and why one row per
organization and status is no point of contention), so a ``REPEATABLE READ``
snapshot sees counts that agree with the rows it sees. :func:`differences`
compares the table with a real count, for ``verify``.
"""

from __future__ import annotations

from typing import Any
from uuid import UUID

import psycopg

from umbra.events.types import JOB_STATUSES

_OF_ORGANIZATION = "SELECT status, jobs FROM job_counts WHERE organization_id = %s"
#: Every organization's, by status: the jobs, those waiting for their dependencies, those waiting for a moment.
_TOTALS = """
SELECT status, sum(jobs)::bigint, sum(awaiting_dependencies)::bigint, sum(delayed)::bigint
FROM job_counts GROUP BY status
"""
#: The table's figures beside a real count of the rows, every (organization, status) either side has, where they differ.
_DIFFERENCES = """
WITH kept AS (
    SELECT organization_id, status, jobs, awaiting_dependencies AS awaiting, delayed
    FROM job_counts WHERE %(org)s::uuid IS NULL OR organization_id = %(org)s
), counted AS (
    SELECT organization_id, status, count(*) AS jobs, count(*) FILTER (WHERE awaiting_dependencies) AS awaiting,
           count(*) FILTER (WHERE waiting_until IS NOT NULL) AS delayed
    FROM jobs WHERE %(org)s::uuid IS NULL OR organization_id = %(org)s GROUP BY organization_id, status
)
SELECT organization_id, status, coalesce(counted.jobs, 0), coalesce(kept.jobs, 0),
       coalesce(counted.awaiting, 0), coalesce(kept.awaiting, 0), coalesce(counted.delayed, 0), coalesce(kept.delayed, 0)
FROM counted FULL JOIN kept USING (organization_id, status)
WHERE (counted.jobs, counted.awaiting, counted.delayed) IS DISTINCT FROM (kept.jobs, kept.awaiting, kept.delayed)
  AND NOT (counted.jobs IS NULL AND kept.jobs = 0 AND kept.awaiting = 0 AND kept.delayed = 0)
ORDER BY organization_id, status
"""


async def of_organization(conn: psycopg.AsyncConnection, organization_id: UUID) -> dict[str, int]:
    """Every status's count of one organization's jobs (0 for a status it has none of)."""
    counts = {status: 0 for status in JOB_STATUSES}
    counts.update(dict(await (await conn.execute(_OF_ORGANIZATION, (organization_id,))).fetchall()))
    return counts


async def totals(conn: psycopg.AsyncConnection) -> list[tuple[str, int, int, int]]:
    """Every organization's jobs by status: ``(status, jobs, awaiting dependencies, delayed)`` per status."""
    return await (await conn.execute(_TOTALS)).fetchall()


async def differences(conn: psycopg.AsyncConnection, organization_id: UUID | None = None) -> list[dict[str, Any]]:
    """Where the table disagrees with a count of the rows, in ``verify``'s format (call in its snapshot).

    One difference per (organization, status) and figure: ``id`` is the organization, ``field`` the status
    (``blocked.awaiting_dependencies``, ``blocked.delayed`` for the two figures within it), ``rebuilt`` the
    rows' count and ``live`` the table's. This counts every row of the organization once, as ``verify``
    reads them all anyway.
    """
    rows = await (await conn.execute(_DIFFERENCES, {"org": organization_id})).fetchall()
    out: list[dict[str, Any]] = []
    for org, status, counted, kept, counted_awaiting, kept_awaiting, counted_delayed, kept_delayed in rows:
        for field, rebuilt, live in ((status, counted, kept),
                                     (f"{status}.awaiting_dependencies", counted_awaiting, kept_awaiting),
                                     (f"{status}.delayed", counted_delayed, kept_delayed)):  # fmt: skip
            if rebuilt != live:
                out.append({"view": "job_counts", "id": str(org), "field": field, "rebuilt": repr(rebuilt), "live": repr(live)})
    return out
