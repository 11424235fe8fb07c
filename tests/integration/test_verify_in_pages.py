"""``verify`` compares the queue a page at a time, in job id order: the same differences as a comparison of the
whole organization's rows, and never all of an organization's rows held at once (an organization keeps every
job for ever: at a million jobs, the whole comparison held 5 GB)."""

from __future__ import annotations

import gc

import psycopg
import pytest

from umbra.compute import claims, jobs
from umbra.compute.accounts import create_organization
from umbra.projections import job_counts, nodes
from umbra.projections import jobs as queue
from umbra.projections.verify import diff_rows, verify

from .queue_support import CPU64, add_node, spec

pytestmark = pytest.mark.anyio


async def _jobs(conn, org_id, count: int, node_id=None) -> list:
    rows, _ = await jobs.submit(conn, org_id, [spec(payload={"i": i}) for i in range(count)], actor="t", batch=True)
    for _ in range(count // 3 if node_id else 0):  # some streams longer than one event, some of them ended
        got = await claims.claim(conn, node_id=node_id, organization_id=org_id, lease_seconds=60)
        await claims.complete(conn, organization_id=org_id, node_id=node_id, job_id=got.job_id, attempt=got.attempt,
                              result={"ok": True})  # fmt: skip
    return sorted(row.id for row in rows)


async def _whole(conn, org_id) -> list[dict]:
    """The differences as verify found them before: every row of both sides held, then compared."""
    async with conn.transaction():
        await conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        queue_differences = queue.diff(await queue.rebuild(conn, org_id), await queue.live(conn, org_id))
        node_differences = diff_rows("nodes", await nodes.rebuild(conn, org_id), await nodes.live(conn, org_id))
        return queue_differences + node_differences + await job_counts.differences(conn, org_id)


async def test_the_differences_are_those_of_the_whole_comparison_in_the_same_order(conn, org):
    org_id, _ = org
    node_id = await add_node(conn, org_id, "cpu", [CPU64])
    ids = await _jobs(conn, org_id, 40, node_id)
    other_org, _ = await create_organization(conn, "other")
    other_ids = await _jobs(conn, other_org, 12)
    # Drift in several ranges of ids: rows gone from the table, rows the log never wrote, changed columns.
    gone, changed, moved = ids[1::9], ids[3::7], ids[5::11]
    await conn.execute("DELETE FROM jobs WHERE id = ANY(%s)", (gone + other_ids[:1],))
    await conn.execute("UPDATE jobs SET priority = priority + 1, payload = '{\"i\": true}' WHERE id = ANY(%s)", (changed,))
    await conn.execute("UPDATE jobs SET status = 'failed', error = 'written by hand' WHERE id = ANY(%s)", (moved,))
    for source, new_id in ((ids[0], "00000000-0000-4000-8000-000000000000"), (ids[20], "ffffffff-ffff-4fff-bfff-ffffffffffff"),
                           (ids[30], str(ids[30])[:-1] + ("0" if str(ids[30])[-1] != "0" else "1"))):  # fmt: skip
        await conn.execute(
            f"INSERT INTO jobs ({', '.join(queue.COLUMNS)}) SELECT %s, {', '.join(queue.COLUMNS[1:23])},"
            f" seq + 1000000, {', '.join(queue.COLUMNS[24:])} FROM jobs WHERE id = %s",
            (new_id, source),
        )  # fmt: skip

    for scope in (org_id, None):
        whole = await _whole(conn, scope)
        assert {d["field"] for d in whole} >= {None, "priority", "payload", "status", "error"}
        assert len([d for d in whole if d["field"] is None]) >= len(gone) + 3
        for page in (1, 2, 7, 1000):
            assert await verify(conn, scope, page=page) == whole, (scope, page)


def _job_rows_alive() -> int:
    """Job rows alive in this process, those a fold has set aside from the collector too."""
    frozen = gc.get_freeze_count()
    gc.unfreeze()
    try:
        return sum(type(o) is queue.JobRow for o in gc.get_objects())
    finally:
        if frozen:
            gc.freeze()


async def test_a_verify_holds_a_page_of_rows_at_a_time_not_the_organization(conn, org, monkeypatch):
    org_id, _ = org
    node_id = await add_node(conn, org_id, "cpu", [CPU64])
    await _jobs(conn, org_id, 90, node_id)
    alive: list[int] = []

    def sampled(fetch):
        async def fetching(self, *args, **kwargs):
            alive.append(_job_rows_alive())
            return await fetch(self, *args, **kwargs)

        return fetching

    # Counted each time a page is read from the database, whichever cursor reads it.
    for cursor in (psycopg.AsyncCursor, psycopg.AsyncServerCursor):
        for name in ("fetchmany", "fetchall"):
            monkeypatch.setattr(cursor, name, sampled(getattr(cursor, name)))
    before = _job_rows_alive()
    assert await verify(conn, org_id, page=5) == []
    assert alive and max(alive) - before <= 3 * 5, (before, max(alive))
