"""The sweeper: lease recovery, stale nodes, blocked timeouts, due wake-ups, one leader."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import anyio
import psycopg
import pytest

from umbra.compute import claims, dependencies, jobs, sweeper
from umbra.compute.accounts import create_organization
from umbra.compute.claims import ChildRequest
from umbra.compute.sweeper import SWEEPER_LOCK_KEY, sweep_once
from umbra.db import connect
from umbra.errors import Conflict
from umbra.events import store
from umbra.projections import jobs as queue
from umbra.settings import load_settings

from tests.helpers import eventually

from .queue_support import CPU64, add_node, set_clock, spec, submit

pytestmark = pytest.mark.anyio

SETTINGS = load_settings({})


async def claim(conn, org_id, node_id, lease_seconds=30):
    return await claims.claim(conn, node_id=node_id, organization_id=org_id, lease_seconds=lease_seconds)


async def test_an_expired_lease_requeues_after_a_short_delay_and_fails_when_attempts_are_spent(conn, org):
    org_id, _ = org
    node = await add_node(conn, org_id, "n", [CPU64])
    job = await submit(conn, org_id, max_attempts=2)
    await claim(conn, org_id, node)
    await set_clock(conn, 29)
    assert (await sweep_once(conn, SETTINGS)).leases_requeued == 0  # not yet expired
    await set_clock(conn, 31)
    report = await sweep_once(conn, SETTINGS)
    assert (report.leases_requeued, report.leases_failed) == (1, 0)
    [*_, expired] = await store.read_stream(conn, store.job_stream(job.id))
    row = await queue.load(conn, job.id, org_id)
    assert expired.type == "job.lease_expired" and expired.event.node_id == node and expired.event.requeued
    assert (row.status, row.lease_owner, row.attempt) == ("queued", None, 1)
    assert row.not_before == expired.recorded_at + timedelta(seconds=SETTINGS.lease_expired_delay_seconds)
    assert await claim(conn, org_id, node) is None  # held back for the delay
    await set_clock(conn, 31 + SETTINGS.lease_expired_delay_seconds)
    assert (await claim(conn, org_id, node)).attempt == 2
    await set_clock(conn, 31 + SETTINGS.lease_expired_delay_seconds + 31)
    report = await sweep_once(conn, SETTINGS)
    assert (report.leases_requeued, report.leases_failed) == (0, 1)
    row = await queue.load(conn, job.id, org_id)
    assert (row.status, row.error) == ("failed", "lease expired: the holding node stopped renewing")


async def test_a_lapsed_lease_is_still_the_holders_until_swept(conn, org):
    org_id, _ = org
    node = await add_node(conn, org_id, "n", [CPU64])
    job = await submit(conn, org_id)
    got = await claim(conn, org_id, node, lease_seconds=5)
    await set_clock(conn, 10)
    done = await claims.complete(conn, organization_id=org_id, node_id=node, job_id=job.id, attempt=got.attempt, result=1)
    assert done.status == "complete"
    assert (await sweep_once(conn, SETTINGS)).leases_requeued == 0


async def test_stale_nodes_are_marked_offline_in_the_log(conn, org):
    org_id, _ = org
    node = await add_node(conn, org_id, "n", [CPU64])
    await set_clock(conn, SETTINGS.heartbeat_stale_seconds + 1)
    assert (await sweep_once(conn, SETTINGS)).nodes_offline == 1
    types = [r.type for r in await store.read_stream(conn, store.node_stream(node))]
    assert types[-1] == "node.went_offline"
    assert (await sweep_once(conn, SETTINGS)).nodes_offline == 0


async def test_a_job_blocked_past_the_timeout_fails_with_its_reason(conn, org):
    org_id, _ = org
    await add_node(conn, org_id, "n", [CPU64])
    job = await submit(conn, org_id, requires={"accelerators": ["rocm"]})
    assert job.status == "blocked"
    settings = dataclasses.replace(SETTINGS, blocked_timeout_seconds=600)
    await set_clock(conn, 599)
    assert (await sweep_once(conn, settings)).blocked_failed == 0
    await set_clock(conn, 601)
    assert (await sweep_once(conn, settings)).blocked_failed == 1
    row = await queue.load(conn, job.id, org_id)
    assert (row.status, row.error) == ("failed", job.blocked_reason)


async def test_a_job_running_a_lease_past_its_max_runtime_fails_for_good_counted_from_its_current_claim(conn, org):
    """Whatever its holder does (here it keeps a long lease and says nothing), a job with ``max_runtime_s`` is
    failed one lease (the grace) after its current claim passed it; one without a limit runs on; one claimed
    again after a lost node has its whole time again. The old holder's report is refused after."""
    org_id, _ = org
    node = await add_node(conn, org_id, "n", [CPU64])
    limited = await submit(conn, org_id, requires={"max_runtime_s": 120})
    unlimited = await submit(conn, org_id)
    again = await submit(conn, org_id, requires={"max_runtime_s": 120})
    held = await claim(conn, org_id, node, lease_seconds=3600)
    await claim(conn, org_id, node, lease_seconds=3600)
    await claim(conn, org_id, node, lease_seconds=30)  # ``again``: its node is lost, the lease runs out
    await set_clock(conn, 31)
    assert (await sweep_once(conn, SETTINGS)).leases_requeued == 1
    reclaimed_at = 31 + SETTINGS.lease_expired_delay_seconds
    await set_clock(conn, reclaimed_at)
    assert (await claim(conn, org_id, node, lease_seconds=3600)).job_id == again.id
    grace = SETTINGS.lease_seconds
    await set_clock(conn, 120 + grace - 1)
    assert (await sweep_once(conn, SETTINGS)).runtime_failed == 0
    await set_clock(conn, 120 + grace + 1)
    assert (await sweep_once(conn, SETTINGS)).runtime_failed == 1
    [*_, failed] = await store.read_stream(conn, store.job_stream(limited.id))
    assert (failed.type, failed.event.reason, failed.metadata["actor"]) == ("job.failed", "runtime_exceeded", "sweeper")
    row = await queue.load(conn, limited.id, org_id)
    assert (row.status, row.lease_expires_at) == ("failed", None) and row.error.startswith("The job exceeded its max_runtime_s (120 s)")
    with pytest.raises(Conflict) as refused:
        await claims.complete(conn, organization_id=org_id, node_id=node, job_id=limited.id, attempt=held.attempt, result=1)
    assert refused.value.code == "job_not_claimed_by_this_node"
    assert (await queue.load(conn, again.id, org_id)).status == "running"  # its first claim is long past; its own is not
    await set_clock(conn, reclaimed_at + 120 + grace + 1)
    assert (await sweep_once(conn, SETTINGS)).runtime_failed == 1
    assert (await queue.load(conn, again.id, org_id)).status == "failed"
    await set_clock(conn, 3500)  # within its hour's lease
    assert (await sweep_once(conn, SETTINGS)).runtime_failed == 0
    assert (await queue.load(conn, unlimited.id, org_id)).status == "running"


async def test_jobs_that_became_due_since_the_last_tick_are_announced_once(db_url, conn, org):
    org_id, _ = org
    node = await add_node(conn, org_id, "n", [CPU64])
    job = await submit(conn, org_id)
    got = await claim(conn, org_id, node)
    await claims.fail(conn, organization_id=org_id, node_id=node, job_id=job.id, attempt=got.attempt, error="x", retry=True)
    first = await sweep_once(conn, SETTINGS)  # not due yet: backoff is 5 s
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as listener:
        await listener.execute(f"LISTEN {store.LOG_CHANNEL}")
        await set_clock(conn, 6)
        second = await sweep_once(conn, SETTINGS, since=first.now)
        third = await sweep_once(conn, SETTINGS, since=second.now)
        notes = [hint for n in [n async for n in listener.notifies(timeout=0.5)] for hint in store.parse_hints(n.payload)]
    assert (second.jobs_woken, third.jobs_woken) == (1, 0)
    row = await queue.load(conn, job.id, org_id)
    assert notes == [(org_id, row.position, 1)]


async def _lock_holder(conn) -> int | None:
    row = await (await conn.execute(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted "
        "AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
        "AND ((classid::bigint << 32) | objid::bigint) = %s", (SWEEPER_LOCK_KEY,))).fetchone()
    return row[0] if row else None


async def test_one_sweeper_leads_and_another_takes_over_when_it_dies(db_url, conn):
    settings = dataclasses.replace(SETTINGS, sweep_interval_seconds=0.05)
    async with anyio.create_task_group() as tg:
        for _ in range(2):
            tg.start_soon(lambda: sweeper.run(settings, db_url, retry_seconds=0.1))
        leader = await eventually(lambda: _lock_holder(conn))

        async def follower_connected():
            row = await (await conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> %s "
                "AND pid <> pg_backend_pid() AND backend_type = 'client backend'", (leader,))).fetchone()
            return row[0] >= 1

        await eventually(follower_connected)  # it retries leadership without holding the lock
        assert await _lock_holder(conn) == leader
        await conn.execute("SELECT pg_terminate_backend(%s)", (leader,))

        async def new_leader():
            holder = await _lock_holder(conn)
            return holder if holder not in (None, leader) else None

        await eventually(new_leader)
        tg.cancel_scope.cancel()


async def test_a_leader_whose_session_was_ended_inside_a_transaction_reconnects_and_leads_again(db_url, conn, monkeypatch):
    """PostgreSQL ends the session of a transaction left idle past its bound (a process that stopped running
    inside it: paused, frozen with its virtual machine) with ``IdleInTransactionSessionTimeout``, which is not
    an ``OperationalError``: met in a prompt look between ticks, it stopped the sweeper, and the server with it."""
    settings = dataclasses.replace(SETTINGS, sweep_interval_seconds=0.05)
    release_moved = dependencies.release_moved
    stalled: list[int] = []

    async def stalls_once(c, after, *, metadata):
        if stalled:
            return await release_moved(c, after, metadata=metadata)
        stalled.append(c.info.backend_pid)
        async with c.transaction():
            await c.execute("SET LOCAL idle_in_transaction_session_timeout = '100ms'")  # 20 s in a server
            await anyio.sleep(0.5)  # the process stopped running inside its transaction
            return await release_moved(c, after, metadata=metadata)

    monkeypatch.setattr(dependencies, "release_moved", stalls_once)

    async def new_leader():
        holder = await _lock_holder(conn)
        return holder if stalled and holder not in (None, stalled[0]) else None

    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: sweeper.run(settings, db_url, retry_seconds=0.1, log_moved=sweeper.LogMoved()))
        await eventually(new_leader)
        tg.cancel_scope.cancel()


async def test_the_server_sweeps_from_startup(live_server, db_url, org):
    org_id, _ = org
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as c:
        node = await add_node(c, org_id, "n", [CPU64])
        job = await submit(c, org_id)
        await claims.claim(c, node_id=node, organization_id=org_id, lease_seconds=1)

        async def requeued():
            return (await queue.load(c, job.id, org_id)).status == "queued"

        await eventually(requeued)
        assert [r.metadata.get("actor") for r in await store.read_stream(c, store.job_stream(job.id))][-1] == "sweeper"


async def test_a_batch_of_expired_leases_is_swept_in_one_tick(conn, org):
    org_id, _ = org
    node = await add_node(conn, org_id, "n", [CPU64])
    await jobs.submit(conn, org_id, [spec() for _ in range(30)], actor="t", batch=True)
    for _ in range(30):
        await claim(conn, org_id, node)
    await set_clock(conn, 31)
    assert (await sweep_once(conn, SETTINGS)).leases_requeued == 30


async def test_a_blocked_job_missed_by_a_node_change_is_unblocked_by_the_sweeper(db_url, conn, org):
    org_id, _ = org
    job = await submit(conn, org_id)
    assert job.status == "blocked"  # nothing registered yet
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as other:
        async with other.transaction():
            await other.execute("SELECT 1 FROM jobs WHERE id = %s FOR UPDATE", (job.id,))
            await add_node(conn, org_id, "n", [CPU64])  # its re-examination skips the held row
    assert (await queue.load(conn, job.id, org_id)).status == "blocked"
    assert (await sweep_once(conn, SETTINGS, reexamine=False)).jobs_unblocked == 0
    assert (await sweep_once(conn, SETTINGS)).jobs_unblocked == 1
    assert (await queue.load(conn, job.id, org_id)).status == "queued"


async def test_spent_pairing_codes_and_sources_past_the_rate_limit_window_are_pruned(conn, org):
    from umbra.compute import pairing

    org_id, _ = org
    day, window = pairing.RETENTION_SECONDS, pairing.WINDOW_SECONDS
    codes = {  # name -> (expires this many seconds from now, redeemed)
        "long-expired": (-day - 60, False), "long-redeemed": (-day - 60, True),
        "just-expired": (-60, False), "just-redeemed": (-60, True), "live": (300, False),
    }  # fmt: skip
    for name, (expires_in, redeemed) in codes.items():
        await conn.execute(
            "INSERT INTO pairing_codes (id, organization_id, node_name, code_hash, expires_at, redeemed_at)"
            " VALUES (gen_random_uuid(), %s, %s, 'x', umbra_now() + make_interval(secs => %s),"
            " CASE WHEN %s THEN umbra_now() + make_interval(secs => %s) END)",
            (org_id, name, expires_in, redeemed, expires_in - 10),
        )  # fmt: skip
    # Each source's admitted attempts, by how long ago: only a source with one still in the window is kept.
    for source, ago in (("gone", [3 * window, 2 * window]), ("ended", [2 * window, window]),
                        ("current", [2 * window, window // 2])):  # fmt: skip
        await conn.execute("INSERT INTO pairing_attempt_times (source, attempted_at)"
                           " SELECT %s, array_agg(umbra_now() - make_interval(secs => s) ORDER BY s DESC) FROM unnest(%s::int[]) s",
                           (source, ago))  # fmt: skip
    report = await sweep_once(conn, SETTINGS, reexamine=False)
    assert report.pairing_rows_pruned == 0  # only with the periodic second look
    report = await sweep_once(conn, SETTINGS)
    assert report.pairing_rows_pruned == 4
    kept = await (await conn.execute("SELECT node_name FROM pairing_codes ORDER BY node_name")).fetchall()
    assert [name for (name,) in kept] == ["just-expired", "just-redeemed", "live"]
    sources = await (await conn.execute("SELECT source FROM pairing_attempt_times")).fetchall()
    assert [source for (source,) in sources] == ["current"]


async def test_a_tick_analyses_the_queue_once_it_has_outgrown_its_statistics(conn, org):
    org_id, _ = org
    await conn.execute("ALTER TABLE jobs SET (autovacuum_enabled = false)")  # nothing else analyses it
    await add_node(conn, org_id, "box", [CPU64])
    await jobs.submit(conn, org_id, [spec(payload={"i": i}) for i in range(1_500)], actor="t", batch=True)
    await conn.execute("SELECT pg_stat_force_next_flush()")  # this session's inserts, counted now
    assert (await sweep_once(conn, SETTINGS)).statistics_refreshed
    [(rows,)] = await (await conn.execute("SELECT reltuples FROM pg_class WHERE oid = 'jobs'::regclass")).fetchall()
    assert rows == 1_500  # counted by the analysis (a never-analysed table reads -1)
    assert not (await sweep_once(conn, SETTINGS)).statistics_refreshed


async def test_a_sweep_that_changes_several_organizations_sends_one_notification(db_url, conn, org):
    """At most one NOTIFY per channel per transaction: every organization's hint rides in it."""
    other, _ = await create_organization(conn, "globex")
    expected = {}
    for org_id, name in ((org[0], "a"), (other, "b")):
        node = await add_node(conn, org_id, name, [CPU64])
        job = await submit(conn, org_id)
        await claim(conn, org_id, node)
        expected[org_id] = job.id
    await set_clock(conn, 31)
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as listener:
        await listener.execute(f"LISTEN {store.LOG_CHANNEL}")
        report = await sweep_once(conn, SETTINGS, reexamine=False)
        notes = [n async for n in listener.notifies(timeout=0.5)]
    assert report.leases_requeued == 2
    assert len(notes) == 1
    hints = {org_id: position for org_id, position, _ in store.parse_hints(notes[0].payload)}
    rows = {org_id: await queue.load(conn, job_id, org_id) for org_id, job_id in expected.items()}
    assert hints == {org_id: row.position for org_id, row in rows.items()}


async def test_a_released_claim_is_not_charged_when_a_lease_expires(conn, org):
    """A claim given back unheard never ran: the expiry of the next one still finds an attempt left."""
    org_id, _ = org
    node = await add_node(conn, org_id, "n", [CPU64])
    job = await submit(conn, org_id, max_attempts=2)
    unheard = await claim(conn, org_id, node)
    assert await claims.release(conn, job.id, node, unheard.attempt)
    assert (await claim(conn, org_id, node)).attempt == 2  # the first run
    await set_clock(conn, 31)
    assert ((report := await sweep_once(conn, SETTINGS)).leases_requeued, report.leases_failed) == (1, 0)
    await set_clock(conn, 31 + SETTINGS.lease_expired_delay_seconds)
    assert (await claim(conn, org_id, node)).attempt == 3  # the second run, the last
    await set_clock(conn, 31 + SETTINGS.lease_expired_delay_seconds + 31)
    assert ((report := await sweep_once(conn, SETTINGS)).leases_requeued, report.leases_failed) == (0, 1)
    assert (await queue.load(conn, job.id, org_id)).status == "failed"


async def test_an_expired_child_whose_container_is_held_elsewhere_waits_for_a_later_tick(db_url, conn, org):
    """A row another session holds (an operator's open ``BEGIN; SELECT ... FOR UPDATE``) holds up only what
    needs it: an expired child on its last attempt, whose end would settle its held container, is left as it
    was for a later tick, and the same tick recovers every other expired lease (another organization's here)
    without waiting for that row. Once the holder lets go, the next tick ends the child."""
    org_id, _ = org
    a = await add_node(conn, org_id, "a", [CPU64])
    parent = await submit(conn, org_id, "p")
    got = await claim(conn, org_id, a)
    (k,) = await claims.add_children(conn, organization_id=org_id, node_id=a, job_id=parent.id, attempt=got.attempt,
                                     children=[ChildRequest(kind="part", max_attempts=1)])  # fmt: skip
    assert (await claim(conn, org_id, a, lease_seconds=5)).job_id == k.id
    other_org, _ = await create_organization(conn, "other")
    b = await add_node(conn, other_org, "b", [CPU64])
    unrelated = await submit(conn, other_org, "u")
    assert (await claim(conn, other_org, b, lease_seconds=6)).job_id == unrelated.id
    async with await psycopg.AsyncConnection.connect(db_url) as operator, await connect(db_url) as own:
        await operator.execute("SELECT 1 FROM jobs WHERE id = %s FOR UPDATE", (parent.id,))  # its transaction left open
        await set_clock(own, 30)  # the sweeper's own connection, as compute.sweeper.run has it
        with anyio.fail_after(8):
            held = await sweep_once(own, SETTINGS, reexamine=False)
        assert held.leases_requeued == 1
        assert (await queue.load(conn, unrelated.id, other_org)).status == "queued"
        child = await queue.load(conn, k.id, org_id)
        assert (child.status, child.lease_owner) == ("running", a)
        await operator.rollback()
        with anyio.fail_after(8):
            released = await sweep_once(own, SETTINGS, reexamine=False)
    assert released.leases_failed == 1
    child = await queue.load(conn, k.id, org_id)
    assert (child.status, child.lease_owner, child.attempt) == ("failed", None, 1)
