"""Rebuild every projection from the log and compare it with the live tables.

Each projection module folds the log with the same ``fold`` its commands use
(``rebuild``) and reads its table (``live``); a difference means a row was
written some other way, or a fold is not pure. Both reads run in one
``REPEATABLE READ`` snapshot, so a command committing mid-verify cannot show
up as a false difference.

Differences are plain dicts ``{"view", "id", "field", "rebuilt", "live"}``
(``field`` None when the row exists on one side only), the same shape
:func:`umbra.projections.jobs.diff` reports, so operators read one format.
The job counts the queue view and ``/metrics`` read (``job_counts``, kept by
triggers) are compared in the same snapshot with a count of the live rows
(:func:`umbra.projections.job_counts.differences`: view ``job_counts``).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence
from uuid import UUID

import psycopg

from . import job_counts, jobs, nodes
from .long_folds import FOLD_PAGE, long_fold


def diff_rows(view: str, rebuilt: Sequence[Mapping[str, Any]], live: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Compare two row lists keyed by ``id``, column by column."""
    a = {row["id"]: row for row in rebuilt}
    b = {row["id"]: row for row in live}
    out: list[dict[str, Any]] = []
    for row_id in sorted(set(a) | set(b), key=str):
        left, right = a.get(row_id), b.get(row_id)
        if left is None or right is None:
            out.append({"view": view, "id": str(row_id), "field": None, "rebuilt": left is not None, "live": right is not None})
            continue
        for name in sorted(set(left) | set(right)):
            if not jobs.same_value(left.get(name), right.get(name)):
                out.append({"view": view, "id": str(row_id), "field": name,
                            "rebuilt": repr(left.get(name)), "live": repr(right.get(name))})  # fmt: skip
    return out


async def verify(
    conn: psycopg.AsyncConnection, organization_id: UUID | None = None, *, page: int = FOLD_PAGE
) -> list[dict[str, Any]]:
    """Every difference between rebuilt and live projections (empty when they agree).

    Opens its own transaction on ``conn`` (read only, one snapshot); the
    connection must not be inside another transaction. ``page``: events, and
    rows, read and held at a time.
    """
    # The queue is compared a page at a time, in job id order (:func:`jobs.compare`): an organization's
    # millions of jobs are never all held at once. Nodes are few: rebuilt and read whole, as a long fold.
    with long_fold():
        async with conn.transaction():
            # Read only and holding no lock a writer waits for, while the server folds between its reads
            # (minutes on a large organization): not ended as a stopped process's would be (db.IDLE_IN_TRANSACTION_SECONDS).
            await conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY; "
                               "SET LOCAL idle_in_transaction_session_timeout = 0")  # fmt: skip
            queue = await jobs.compare(conn, organization_id, page=page)
            rebuilt_nodes, live_nodes = await nodes.rebuild(conn, organization_id), await nodes.live(conn, organization_id)
            counts = await job_counts.differences(conn, organization_id)
    return queue + diff_rows("nodes", rebuilt_nodes, live_nodes) + counts
