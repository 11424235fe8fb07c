"""The queue view's reads, which every dashboard and each projections stream makes whenever the organization's
jobs move: the same answer as one ordering of every open job, read by index and bounded by the listing's limit
(or by the jobs that moved), however many jobs the organization has ended and however deep its backlog.

The bounds are read from the plans PostgreSQL ran (``EXPLAIN (ANALYZE, FORMAT JSON)``): no node of the plan
handles more rows than the answer may need, under a plan made for the call's values and under a generic one
(a pooled connection's prepared statement)."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from typing import Any
from uuid import UUID, uuid4

import psycopg
import pytest

from umbra import paging
from umbra.api import projections
from umbra.compute.accounts import create_organization
from umbra.projections import jobs as job_rows

pytestmark = pytest.mark.anyio

OPEN = ("running", "blocked", "queued")
#: The listing before it was read by index: one scan of the organization's jobs, every open one sorted.
ONE_ORDERING = f"""
SELECT {job_rows.SELECT_LIST} FROM jobs
WHERE organization_id = %s AND status IN ('queued', 'running', 'blocked')
ORDER BY status = 'running' DESC, status = 'blocked' DESC, priority, seq
LIMIT %s
"""
_INSERT = """
INSERT INTO jobs (id, organization_id, kind, status, requested_by, priority, max_attempts, attempt, seq, version, position,
                  lease_owner, lease_expires_at, placement, blocked_reason, blocked_at, created_at, updated_at, started_at,
                  finished_at)
SELECT gen_random_uuid(), %(org)s, 'noop', status, 't', priority, 3, (status NOT IN ('queued', 'blocked'))::int, seq, 1,
       position, CASE WHEN status = 'running' THEN %(node)s::uuid END,
       CASE WHEN status = 'running' THEN now() + interval '1 hour' END,
       CASE WHEN status NOT IN ('queued', 'blocked') THEN %(placement)s::jsonb END,
       CASE WHEN status = 'blocked' THEN 'no node can run it' END, CASE WHEN status = 'blocked' THEN now() END,
       now(), now(), CASE WHEN status NOT IN ('queued', 'blocked') THEN now() END,
       CASE WHEN status NOT IN ('queued', 'blocked', 'running') THEN now() END
FROM unnest(%(statuses)s::text[], %(priorities)s::int[], %(seqs)s::bigint[], %(positions)s::bigint[])
     AS t(status, priority, seq, position)
"""


async def add_jobs(conn, org_id: UUID, counts: dict[str, int], *, seed: int, priorities=(-5, 0, 0, 7, 100, 100)) -> None:
    """Jobs of each status, written as rows (their logs play no part in these reads): priorities drawn from a
    few values (many ties), submission order (``seq``) and positions shuffled against the order of insertion."""
    rng = random.Random(seed)
    statuses = [status for status, n in counts.items() for _ in range(n)]
    rng.shuffle(statuses)
    total = len(statuses)
    base = (await (await conn.execute("SELECT coalesce(max(greatest(seq, position)), 0) FROM jobs")).fetchone())[0]
    node = uuid4()
    placement = json.dumps({"node_id": str(node), "device_id": "cpu", "device_kind": "cpu", "reason": "fits", "via": "ram"})
    await conn.execute(_INSERT, {
        "org": org_id, "node": node, "placement": placement, "statuses": statuses,
        "priorities": [rng.choice(priorities) for _ in range(total)],
        "seqs": [base + s for s in rng.sample(range(1, 4 * total + 1), total)],
        "positions": [base + 4 * total + p for p in rng.sample(range(1, 4 * total + 1), total)],
    })  # fmt: skip


def nodes_of(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", ()):
        yield from nodes_of(child)


def most_rows_handled(plan: dict[str, Any]) -> int:
    """The most rows any node of a plan that ran returned or read and set aside (all its loops)."""
    return max(round((node["Actual Rows"] + node.get("Rows Removed by Filter", 0) + node.get("Rows Removed by Index Recheck", 0))
                     * node["Actual Loops"]) for node in nodes_of(plan))  # fmt: skip


def numbered(query: str) -> str:
    """A psycopg query's placeholders as ``$n``, for ``PREPARE``: each ``%(name)s`` by its first appearance,
    each ``%s`` in turn."""
    names: dict[str, int] = {}
    count = iter(range(1, 100))

    def number(match: re.Match) -> str:
        if match.group(1) is None:
            return f"${next(count)}"
        if match.group(1) not in names:
            names[match.group(1)] = next(count)
        return f"${names[match.group(1)]}"

    return re.sub(r"%(?:\((\w+)\))?s", number, query)


async def plans_run(conn, query: str, params: list) -> list[dict[str, Any]]:
    """The plans the query ran with: one made for these values, and a generic one (a prepared statement's, as
    a pooled connection's is after a few calls). ``params`` in the order the placeholders first appear."""
    names = list(dict.fromkeys(re.findall(r"%\((\w+)\)s", query)))
    bound = dict(zip(names, params)) if names else params
    [[[custom]]] = await (await conn.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {query}", bound)).fetchall()
    await conn.execute(f"PREPARE reading AS {numbered(query)}")
    try:
        await conn.execute("SET plan_cache_mode = force_generic_plan")
        cursor = psycopg.AsyncClientCursor(conn)  # EXECUTE takes its values written in, not bound
        await cursor.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE reading({', '.join(['%s'] * len(params))})", params)
        [[[generic]]] = await cursor.fetchall()
        assert "$1" in json.dumps(generic)  # planned for no value in particular
    finally:
        await conn.execute("RESET plan_cache_mode")
        await conn.execute("DEALLOCATE reading")
    return [custom["Plan"], generic["Plan"]]


async def view(conn, org_id: UUID, limit: int) -> dict[str, Any]:
    async with conn.transaction():
        await conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        return await projections.read_queue(conn, org_id, limit)


@pytest.mark.parametrize("counts", [
    {"running": 7, "blocked": 250, "queued": 1200, "complete": 400, "failed": 60, "cancelled": 40, "partial": 5},
    {"running": 1100, "blocked": 3, "queued": 40, "complete": 10},
    {"queued": 1001, "blocked": 1, "running": 1},
    {"blocked": 1500, "queued": 2},
    {"queued": 5, "complete": 3},
    {"complete": 20},
    {},
], ids=["deep-queue", "many-running", "queued-at-the-limit", "many-blocked", "short", "all-ended", "empty"])
async def test_the_queue_view_lists_exactly_the_first_open_jobs_of_one_ordering_of_them_all(conn, org, counts):
    """Running, then blocked, then queued jobs, each by priority and submission, up to the limit, and
    ``truncated`` when more are open: as one ordering of every open job gives them, at every limit the view
    takes and at each edge between statuses. Another organization's open jobs, listed before and among
    these, are never listed."""
    org_id, _ = org
    other, _ = await create_organization(conn, "other")
    await add_jobs(conn, other, {"running": 3, "blocked": 3, "queued": 3}, seed=1, priorities=(-10,))
    await add_jobs(conn, org_id, counts, seed=len(counts) * 7 + sum(counts.values()))
    await add_jobs(conn, other, {"running": 2, "blocked": 2, "queued": 2}, seed=2)
    await conn.execute("ANALYZE jobs")
    rows = await (await conn.execute(f"SELECT id, status, priority, seq FROM jobs WHERE organization_id = %s AND status IN {OPEN}",
                                     (org_id,))).fetchall()  # fmt: skip
    everything = [str(job_id) for job_id, *_ in sorted(rows, key=lambda r: (OPEN.index(r[1]), r[2], r[3]))]
    running, blocked = counts.get("running", 0), counts.get("blocked", 0)
    edges = {running, running + blocked, len(everything)}
    limits = sorted({0, 1, 2, 200, 1000} | {n for edge in edges for n in (edge - 1, edge, edge + 1) if 0 <= n <= 1000})
    for limit in limits:
        got = await view(conn, org_id, limit)
        before = await (await conn.execute(ONE_ORDERING, (org_id, limit + 1))).fetchall()
        assert got["jobs"] == [job_rows.to_json(job_rows.from_db(row)) for row in before[:limit]], limit
        assert got["truncated"] == (len(before) > limit) == (len(everything) > limit), limit
        assert [job["id"] for job in got["jobs"]] == everything[:limit], limit
        assert got["counts"]["queued"] == counts.get("queued", 0) and got["counts"]["blocked"] == blocked


async def test_the_queue_view_reads_no_more_jobs_than_it_lists_however_many_ended_or_wait(conn, org):
    """Thirty thousand ended jobs, six thousand queued, two thousand blocked, six hundred running: a view of
    200 reads the first 201 of each status by index and orders those 603, not every open job."""
    org_id, _ = org
    await add_jobs(conn, org_id, {"complete": 24_000, "failed": 3_000, "cancelled": 3_000, "queued": 6_000,
                                  "blocked": 2_000, "running": 600}, seed=3)  # fmt: skip
    other, _ = await create_organization(conn, "other")
    await add_jobs(conn, other, {"queued": 2_000, "blocked": 500, "complete": 5_000}, seed=4)
    await conn.execute("ANALYZE jobs")
    for limit in (0, 200, 1000):
        for plan in await plans_run(conn, projections._LISTED_JOBS, [org_id, limit + 1, paging.PAGE_BYTES]):
            assert most_rows_handled(plan) <= 3 * (limit + 1), (limit, plan)
            assert not any(node["Node Type"] == "Seq Scan" for node in nodes_of(plan)), plan


async def test_the_jobs_that_moved_are_read_from_the_end_of_the_organizations_positions(conn, org):
    """A stream's read of the jobs that moved since its last one reads those jobs, not the organization's
    history: five moved among forty thousand."""
    org_id, _ = org
    await add_jobs(conn, org_id, {"complete": 36_000, "queued": 4_000}, seed=5)
    other, _ = await create_organization(conn, "other")
    await add_jobs(conn, other, {"queued": 3_000}, seed=6)
    await conn.execute("ANALYZE jobs")
    last = (await (await conn.execute("SELECT max(position) FROM jobs")).fetchone())[0]
    moved = [job_id for (job_id,) in await (await conn.execute(
        "SELECT id FROM jobs WHERE organization_id = %s AND status = 'queued' ORDER BY seq DESC LIMIT 5", (org_id,))).fetchall()]  # fmt: skip
    for offset, job_id in enumerate(reversed(moved), start=1):
        await conn.execute("UPDATE jobs SET position = %s WHERE id = %s", (last + offset, job_id))
    await conn.execute("UPDATE jobs SET position = %s WHERE organization_id = %s AND position = (SELECT max(position) FROM jobs"
                       " WHERE organization_id = %s)", (last + 10, other, other))  # fmt: skip
    assert [job_id for (job_id,) in await (await conn.execute(projections._MOVED_JOBS, (org_id, last))).fetchall()] == moved[::-1]
    for plan in await plans_run(conn, projections._MOVED_JOBS, [org_id, last]):
        assert most_rows_handled(plan) <= len(moved), plan
