"""``job_counts``: the counts by status the queue view, its stream and ``/metrics`` read instead of counting
``jobs`` (which keeps every terminal job). After every kind of write of job rows they must be the very numbers
a ``count(*)`` of the rows gives, and ``verify`` must say so when they are not."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta, timezone
from uuid import UUID

import psycopg
import pytest

from tests.helpers import bearer
from umbra.compute import claims, jobs
from umbra.compute.accounts import create_organization
from umbra.compute.sweeper import sweep_once
from umbra.events.types import JOB_STATUSES
from umbra.migrate import available_migrations, migrate
from umbra.projections import jobs as queue
from umbra.projections.verify import verify
from umbra.settings import load_settings

from .queue_support import CPU64, add_node, beat, http_pair, set_clock, spec, submit
from .test_outages import samples

pytestmark = pytest.mark.anyio

SETTINGS = load_settings({})

#: Both sides in one statement, so one snapshot: the table's figures (all-zero rows left out) and a real count.
_BOTH = """
SELECT 'kept', organization_id, status, jobs, awaiting_dependencies, delayed FROM job_counts
WHERE jobs <> 0 OR awaiting_dependencies <> 0 OR delayed <> 0
UNION ALL
SELECT 'counted', organization_id, status, count(*), count(*) FILTER (WHERE awaiting_dependencies),
       count(*) FILTER (WHERE waiting_until IS NOT NULL)
FROM jobs GROUP BY organization_id, status
"""


def in_an_hour() -> str:
    return (datetime.now(timezone.utc) + timedelta(hours=1)).isoformat()


async def counted(conn) -> dict[tuple[UUID, str], tuple[int, int, int]]:
    """The real counts, ``(jobs, awaiting dependencies, delayed)`` by (organization, status); asserts the table
    holds the same."""
    sides: dict[str, dict] = {"kept": {}, "counted": {}}
    for side, org_id, status, *figures in await (await conn.execute(_BOTH)).fetchall():
        sides[side][(org_id, status)] = tuple(figures)
    assert sides["kept"] == sides["counted"]
    return sides["counted"]


async def by_status(conn, org_id: UUID) -> dict[str, int]:
    counts = {status: 0 for status in JOB_STATUSES}
    counts.update({status: figures[0] for (org, status), figures in (await counted(conn)).items() if org == org_id})
    return counts


async def test_every_write_of_the_service_keeps_the_counts_exact_and_the_readers_read_them(conn, org, client):
    """Through the server, as the service role: one submit, an idempotent one twice, a batch large enough for
    COPY and a small one, claims and completions through the group commit, failures with and without a
    retry, a cancel and a retry of it, a job split into children that settle it, blocked, delayed and
    dependent jobs. After each, the table holds a real count's numbers; at the end the queue view and
    ``/metrics`` give them, and verify finds nothing."""
    org_id, key = org
    _, other_key = await create_organization(conn, "other")
    auth = bearer(key)

    async def post(path: str, body: dict | None = None, *, headers=auth, status: int = 200) -> dict:
        answer = await client.post(path, json=body, headers=headers)
        assert answer.status_code == status, answer.text
        return answer.json()

    async def claim(credential: str, kind: str) -> dict:
        answer = await client.post("/v1/agent/claim", params={"wait": 0, "kind": kind}, headers=bearer(credential))
        assert answer.status_code == 200, answer.text
        return answer.json()["job"]

    _, credential = await http_pair(client, key)
    agent = bearer(credential)
    await post("/v1/jobs", {"kind": "a"}, status=201)
    await counted(conn)
    await post("/v1/jobs", {"kind": "a", "idempotency_key": "k1", "max_attempts": 3}, status=201)
    again = await post("/v1/jobs", {"kind": "a", "idempotency_key": "k1", "max_attempts": 3}, status=200)
    assert (await by_status(conn, org_id))["queued"] == 2
    await post("/v1/jobs/batch", {"jobs": [{"kind": "b"} for _ in range(300)]}, status=201)  # by COPY
    await post("/v1/jobs/batch", {"jobs": [{"kind": "f", "max_attempts": 1}, {"kind": "p"}, {"kind": "x"}]}, status=201)
    await post("/v1/jobs", {"kind": "o"}, headers=bearer(other_key), status=201)  # blocked: the other has no node
    assert (await by_status(conn, org_id))["queued"] == 305
    first = await claim(credential, "a")  # the group commit's claim
    assert (await by_status(conn, org_id))["running"] == 1
    await post(f"/v1/agent/jobs/{first['id']}/complete", {"attempt": first["attempt"], "result": {}}, headers=agent)
    assert (await by_status(conn, org_id))["complete"] == 1

    retried = await claim(credential, "a")
    assert retried["id"] == again["id"]
    requeued = await post(f"/v1/agent/jobs/{retried['id']}/fail", {"attempt": retried["attempt"], "error": "x", "retry": True},
                          headers=agent)  # fmt: skip
    assert requeued["status"] == "queued"
    await counted(conn)
    failing = await claim(credential, "f")
    await post(f"/v1/agent/jobs/{failing['id']}/fail", {"attempt": failing["attempt"], "error": "x", "retry": False}, headers=agent)
    assert (await by_status(conn, org_id))["failed"] == 1
    await post(f"/v1/jobs/{failing['id']}/retry", {})
    assert (await by_status(conn, org_id))["failed"] == 0
    await post(f"/v1/jobs/{failing['id']}/cancel")
    assert (await by_status(conn, org_id))["cancelled"] == 1

    container = await claim(credential, "p")
    made = await post(f"/v1/agent/jobs/{container['id']}/children",
                      {"attempt": container["attempt"], "children": [{"kind": "c"}, {"kind": "c"}]}, headers=agent, status=201)  # fmt: skip
    assert len(made["children"]) == 2
    await counted(conn)
    for _ in made["children"]:
        child = await claim(credential, "c")
        await post(f"/v1/agent/jobs/{child['id']}/complete", {"attempt": child["attempt"], "result": {}}, headers=agent)
    assert (await client.get(f"/v1/jobs/{container['id']}", headers=auth)).json()["status"] == "complete"
    assert (await by_status(conn, org_id))["complete"] == 4

    in_batch = (await (await conn.execute("SELECT id FROM jobs WHERE kind = 'b' LIMIT 1")).fetchone())[0]
    await post(f"/v1/jobs/{in_batch}/cancel")
    await post("/v1/jobs", {"kind": "gpu", "requires": {"accelerators": ["rocm"]}}, status=201)  # no node can: blocked
    await post("/v1/jobs", {"kind": "later", "not_before": in_an_hour()}, status=201)
    await post("/v1/jobs", {"kind": "after", "depends_on": [str(again["id"])]}, status=201)  # waits for it
    figures = await counted(conn)
    assert figures[(org_id, "blocked")][1:] == (1, 1)  # one waiting for its dependencies, one for its time

    queue_view = (await client.get("/v1/projections/queue", params={"limit": 0}, headers=auth)).json()
    assert queue_view["counts"] == await by_status(conn, org_id)
    other_view = (await client.get("/v1/projections/queue", params={"limit": 0}, headers=bearer(other_key))).json()
    assert other_view["counts"] == {**{status: 0 for status in JOB_STATUSES}, "blocked": 1}
    scraped = samples((await client.get("/metrics")).text)
    totals = await counted(conn)
    for status in JOB_STATUSES:
        assert scraped[("umbra_queue_depth", (("status", status),))] == sum(
            figures[0] for (_, s), figures in totals.items() if s == status)
    assert scraped[("umbra_jobs_waiting_for_dependencies", ())] == totals[(org_id, "blocked")][1]
    assert scraped[("umbra_jobs_delayed", ())] == totals[(org_id, "blocked")][2]
    assert scraped[("umbra_database_up", ())] == 1
    verified = await post("/v1/projections/verify", headers=bearer(key))
    assert verified == {"ok": True, "differences": []}


async def test_the_sweeper_s_expiries_blocked_timeouts_releases_and_unblocks_keep_the_counts_exact(conn, org):
    """An ended lease requeued, then failed; a blocked job timed out; a delayed job released at its time; a
    dependent job released when its dependency completes, and one failed when its dependency fails; a blocked
    job unblocked by a node that can run it."""
    org_id, _ = org
    settings = dataclasses.replace(SETTINGS, blocked_timeout_seconds=600)
    expiring = await submit(conn, org_id, "e", max_attempts=2)
    gpu = await submit(conn, org_id, "gpu", requires={"accelerators": ["rocm"]})
    stuck = await submit(conn, org_id, "cpu")  # blocked: no node at all yet
    assert (gpu.status, stuck.status) == ("blocked", "blocked")
    await counted(conn)
    node = await add_node(conn, org_id, "n", [CPU64])  # unblocks the CPU jobs
    assert (await by_status(conn, org_id))["blocked"] == 1
    assert (await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=30, kinds=frozenset({"e"}))).job_id == expiring.id
    await set_clock(conn, 31)
    assert (await sweep_once(conn, settings)).leases_requeued == 1
    await counted(conn)
    await set_clock(conn, 31 + settings.lease_expired_delay_seconds)
    await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=30, kinds=frozenset({"e"}))
    await set_clock(conn, 31 + settings.lease_expired_delay_seconds + 31)
    assert (await sweep_once(conn, settings)).leases_failed == 1
    await counted(conn)
    await set_clock(conn, 700)
    assert (await sweep_once(conn, settings)).blocked_failed == 1  # the GPU job, blocked past the timeout
    assert (await by_status(conn, org_id))["failed"] == 2

    now = (await (await conn.execute("SELECT umbra_now()")).fetchone())[0]
    later = await submit(conn, org_id, "later", not_before=(now + timedelta(seconds=10)).isoformat())
    dependency, doomed = await submit(conn, org_id, "dep"), await submit(conn, org_id, "doomed")
    waiting = await submit(conn, org_id, "w", depends_on=[str(dependency.id)])
    failing = await submit(conn, org_id, "wf", depends_on=[str(doomed.id)])
    assert (later.status, waiting.status, failing.status) == ("blocked", "blocked", "blocked")
    assert (await counted(conn))[(org_id, "blocked")] == (3, 2, 1)
    await set_clock(conn, 711)
    assert (await sweep_once(conn, settings)).delayed_released == 1
    await beat(conn, org_id, node, [CPU64])  # online again: its last beat was 711 s ago
    assert (await counted(conn))[(org_id, "blocked")] == (2, 2, 0)
    for kind, outcome in (("dep", "complete"), ("doomed", "fail")):
        got = await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=30, kinds=frozenset({kind}))
        if outcome == "complete":
            await claims.complete(conn, organization_id=org_id, node_id=node, job_id=got.job_id, attempt=got.attempt, result=1)
        else:
            await claims.fail(conn, organization_id=org_id, node_id=node, job_id=got.job_id, attempt=got.attempt,
                              error="no", retry=False)  # fmt: skip
    await sweep_once(conn, settings)
    assert (await queue.load(conn, waiting.id, org_id)).status == "queued"
    assert (await queue.load(conn, failing.id, org_id)).status == "failed"
    assert (await by_status(conn, org_id))["blocked"] == 0
    assert await verify(conn, org_id) == []


async def test_rows_written_outside_the_commands_are_counted_too(conn, org):
    """An upsert of a row that exists (its ON CONFLICT update), an operator's UPDATE and DELETE: the triggers
    count every write of the table, whoever sends it."""
    org_id, _ = org
    await add_node(conn, org_id, "n", [CPU64])
    rows, _ = await jobs.submit(conn, org_id, [spec("u"), spec("u"), spec("u")], actor="t", batch=True)
    await queue.write_rows(conn, [queue.replace(rows[0], status="running")])
    assert (await by_status(conn, org_id))["running"] == 1
    await conn.execute("UPDATE jobs SET awaiting_dependencies = true, status = 'blocked' WHERE id = %s", (rows[1].id,))
    assert (await counted(conn))[(org_id, "blocked")] == (1, 1, 0)
    await conn.execute("DELETE FROM jobs WHERE id = %s", (rows[2].id,))
    assert await by_status(conn, org_id) == {**{status: 0 for status in JOB_STATUSES}, "running": 1, "blocked": 1}


async def test_verify_reports_counts_that_drifted_from_the_rows(conn, org, client):
    """A count changed behind the triggers' back is a difference, in verify's format: the organization, the
    status (or a figure within it), the rows' count as rebuilt and the table's as live."""
    org_id, key = org
    await add_node(conn, org_id, "n", [CPU64])
    await submit(conn, org_id, "a")
    await conn.execute("UPDATE job_counts SET jobs = jobs + 2 WHERE organization_id = %s AND status = 'queued'", (org_id,))
    await conn.execute("INSERT INTO job_counts (organization_id, status, delayed) VALUES (%s, 'blocked', 1)", (org_id,))
    expected = [
        {"view": "job_counts", "id": str(org_id), "field": "blocked.delayed", "rebuilt": "0", "live": "1"},
        {"view": "job_counts", "id": str(org_id), "field": "queued", "rebuilt": "1", "live": "3"},
    ]
    assert await verify(conn, org_id) == expected
    assert await verify(conn) == expected
    answer = await client.post("/v1/projections/verify", headers=bearer(key))
    assert answer.json() == {"ok": False, "differences": expected}
    other_id, _ = await create_organization(conn, "other")
    assert await verify(conn, other_id) == []


async def test_the_migration_counts_the_jobs_already_there(conn, db_url, org):
    """A database whose jobs were written before 0050: migrating it fills the table with their counts, and the
    triggers count from there on."""
    org_id, _ = org
    node = await add_node(conn, org_id, "n", [CPU64])
    await jobs.submit(conn, org_id, [spec("old") for _ in range(5)], actor="t", batch=True)
    await submit(conn, org_id, "later", not_before=in_an_hour())
    got = await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=30)
    await claims.complete(conn, organization_id=org_id, node_id=node, job_id=got.job_id, attempt=got.attempt, result=1)
    [migration] = [m for m in available_migrations() if m.name.endswith("_job_counts.sql")]
    await conn.execute("DROP TABLE job_counts; DROP FUNCTION umbra_count_jobs() CASCADE")
    await conn.execute("DELETE FROM schema_migrations WHERE version = %s", (migration.version,))
    assert await migrate(db_url) == [migration.name]
    assert (await counted(conn))[(org_id, "queued")] == (4, 0, 0)
    assert await by_status(conn, org_id) == {**{status: 0 for status in JOB_STATUSES}, "queued": 4, "complete": 1, "blocked": 1}
    await submit(conn, org_id, "new")
    assert (await by_status(conn, org_id))["queued"] == 5


async def test_the_service_role_writes_the_counts_and_reads_them(db_url, org):
    """Granted as the other projection tables are: a write of jobs as ``umbra_service`` (its triggers run
    with the writer's rights) counts, and the role reads the table."""
    org_id, _ = org
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as service:
        await service.execute("SET ROLE umbra_service")
        await submit(service, org_id, "s")
        rows = await (await service.execute("SELECT status, jobs FROM job_counts WHERE organization_id = %s", (org_id,))).fetchall()
    assert rows == [("blocked", 1)]  # no node yet


async def test_migrating_while_the_service_writes_counts_every_job(conn, db_url, org):
    """A rolling upgrade: 0050 (its table lock and backfill) and the concurrent index builds after it applied
    while servers of the previous release go on submitting, claiming and completing as the service role. No
    writer fails or deadlocks, the counts equal the rows afterwards, verify finds nothing, and migrating again
    applies nothing."""
    import anyio

    from umbra.db import _configure

    org_id, _ = org
    node = await add_node(conn, org_id, "n", [CPU64])
    shipped = available_migrations()
    [counts_migration] = [m for m in shipped if m.name.endswith("_job_counts.sql")]
    later = [m.name for m in shipped if m.version >= counts_migration.version]
    await conn.execute("DROP TABLE job_counts; DROP FUNCTION umbra_count_jobs() CASCADE; "
                       "DROP INDEX jobs_running_and_blocked_listed, jobs_by_position, jobs_open_by_seq, nodes_accepting")  # fmt: skip
    await conn.execute("DELETE FROM schema_migrations WHERE version >= %s", (counts_migration.version,))
    await jobs.submit(conn, org_id, [spec("before") for _ in range(20)], actor="t", batch=True)
    migrated = anyio.Event()
    rounds: list[int] = []

    async def writer(index: int) -> None:
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as service:
            await _configure(service)  # as a server's pooled connection: the service role, bounded lock waits
            done = 0
            while done < 3:  # until three rounds after the migration
                [first, _] = (await jobs.submit(service, org_id, [spec("w"), spec("w", depends_on=[0])], actor="t", batch=True))[0]
                await submit(service, org_id, "w", not_before=in_an_hour())
                if (got := await claims.claim(service, node_id=node, organization_id=org_id, lease_seconds=30)) is not None:
                    await claims.complete(service, organization_id=org_id, node_id=node, job_id=got.job_id,
                                          attempt=got.attempt, result=index)  # fmt: skip
                await service.execute("SELECT 1")
                done += migrated.is_set()
                rounds.append(index)

    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            for index in range(3):
                tg.start_soon(writer, index)
            assert await migrate(db_url) == later
            during = len(rounds)
            migrated.set()
    assert during > 0 and len(rounds) >= during + 9  # writes went on during the migration and after it
    await counted(conn)  # asserts the table equals a count of the rows
    assert await verify(conn) == []
    assert await migrate(db_url) == []
