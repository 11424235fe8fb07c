"""The sweeper's passes under adversarial conditions.

Each tick must reach every row it is meant to handle that nothing holds up, however many rows another
transaction holds, ties on the paging key, rows changing while it pages, a leader change mid-pass, and
one organization's held or failing rows; and no lock held elsewhere may stall the tick (and with it every
organization's lease recovery). Bounds are generous (seconds): a failure is a stall or a skipped row.
"""

from __future__ import annotations

import dataclasses
import time

import anyio
import anyio.lowlevel
import psycopg
import pytest
from umbra.compute import blocked, claims, jobs, sweeper
from umbra.compute import nodes as node_commands
from umbra.compute.accounts import create_organization
from umbra.compute.claims import ChildRequest
from umbra.compute.sweeper import SWEEP_BATCH, SWEEPER_LOCK_KEY, sweep_once
from umbra.events import store
from umbra.projections import jobs as queue

from tests.helpers import eventually, waiting_on_a_lock
from umbra import db as umbra_db
from umbra.db import connect, organization_lock_key
from umbra.settings import load_settings

from .queue_support import CPU8, CPU64, add_node, beat, set_clock, spec, submit

pytestmark = pytest.mark.anyio

SETTINGS = load_settings({})


async def claim(conn, org_id, node_id, lease_seconds=30):
    return await claims.claim(conn, node_id=node_id, organization_id=org_id, lease_seconds=lease_seconds)


async def _running(conn, org_id, node_id, count: int, *, kind: str = "r", lease_seconds: int = 5) -> list:
    """``count`` jobs of ``org_id`` submitted and claimed by ``node_id``; returns their ids."""
    await jobs.submit(conn, org_id, [spec(kind) for _ in range(count)], actor="t", batch=True)
    ids = []
    for _ in range(count):
        got = await claim(conn, org_id, node_id, lease_seconds=lease_seconds)
        assert got is not None
        ids.append(got.job_id)
    return ids


_CLONE_NODES = """
WITH ids AS (
    SELECT i, (%(prefix)s || '-0000-4000-8000-' || lpad(to_hex(i), 12, '0'))::uuid AS id
    FROM generate_series(1, %(count)s) AS i
), copied_events AS (
    INSERT INTO events (stream, version, type, organization_id, data, metadata, recorded_at)
    SELECT 'node:' || ids.id, e.version, e.type, e.organization_id, e.data, e.metadata, e.recorded_at
    FROM events e, ids WHERE e.stream = 'node:' || %(node)s::text ORDER BY ids.i, e.version
    RETURNING 1
), copied_nodes AS (
    INSERT INTO nodes (id, organization_id, name, status, trust_domain, locality, transport, agent_version,
                       agent_started_at, last_heartbeat_at, devices, version, position, created_at, updated_at, kinds)
    SELECT ids.id, n.organization_id, n.name || '-c' || ids.i, n.status, n.trust_domain, n.locality, n.transport,
           n.agent_version, n.agent_started_at, n.last_heartbeat_at, n.devices, n.version, n.position, n.created_at,
           n.updated_at, n.kinds
    FROM nodes n, ids WHERE n.id = %(node)s
    RETURNING id
)
INSERT INTO node_liveness (node_id, last_seen_at, devices, reported_at)
SELECT c.id, l.last_seen_at, l.devices, l.reported_at FROM copied_nodes c, node_liveness l WHERE l.node_id = %(node)s
"""


async def _clone_nodes(conn, node_id, count: int, prefix: str = "00000000") -> list:
    """``count`` copies of ``node_id`` (its row, its stream, its liveness) with ids that sort before any random
    one (``prefix``-0000-4000-8000-<i>): a fleet of hundreds without pairing each (argon2id per pairing)."""
    await conn.execute(_CLONE_NODES, {"prefix": prefix, "count": count, "node": node_id})
    rows = await (await conn.execute(
        "SELECT id FROM nodes WHERE id::text LIKE %s ORDER BY id", (prefix + "-0000-4000-8000-%",))).fetchall()  # fmt: skip
    assert len(rows) == count
    return [r[0] for r in rows]


async def _status_of_node(conn, node_id) -> str:
    return (await (await conn.execute("SELECT status FROM nodes WHERE id = %s", (node_id,))).fetchone())[0]


async def _finishes_before_release(work, release, *, grace: float) -> tuple[float, object]:
    """Run ``work()``; if it has not finished after ``grace`` seconds, call ``release()`` (the holder lets go)
    and let it finish. Returns (seconds it took, its result or the exception it raised)."""
    outcome: dict = {}

    async def run() -> None:
        started = time.monotonic()
        try:
            outcome["result"] = await work()
        except Exception as exc:  # noqa: BLE001 - reported to the test
            outcome["result"] = exc
        outcome["took"] = time.monotonic() - started

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        with anyio.move_on_after(grace):
            while "took" not in outcome:
                await anyio.sleep(0.02)
        if "took" not in outcome:
            await release()
    return outcome["took"], outcome["result"]


async def _tick_while_held(conn, own, operator, reexamine: bool) -> tuple[float, object, list]:
    """A tick on ``own`` while ``operator`` holds what it holds (let go after 6 s if the tick still waits):
    how long it took, its result (or exception), and what it was waiting in when let go, if it was."""
    waited_in: list = []

    async def release() -> None:
        waited_in.extend(await (await conn.execute(
            "SELECT query FROM pg_stat_activity WHERE pid = %s AND wait_event_type = 'Lock'",
            (own.info.backend_pid,))).fetchall())  # fmt: skip
        await operator.rollback()

    took, result = await _finishes_before_release(lambda: sweep_once(own, SETTINGS, reexamine=reexamine), release, grace=6)
    await operator.rollback()
    return took, result, waited_in


# -- the re-examination pass: one organization's capacity lock -------------------------------------------------


async def test_reexamination_does_not_wait_behind_one_organizations_fleet_change_held_up(db_url, conn, org):
    """A tick that re-examines waiting jobs finishes within seconds even while organization A's fleet change
    is held up: an operator's open transaction holds A's node row, and A's agent's heartbeat that changes its
    devices holds A's capacity lock while it waits for that row (a pooled connection's 5 s bound).

    The sweeper's second look waited for every organization's capacity lock in turn (bounded only at 30 s),
    and the whole tick, and so every organization's next lease recovery, stalled behind one organization's
    held row; it now only tries the lock and leaves that organization to the change's own re-examination."""
    org_a, _ = org
    a = await add_node(conn, org_a, "a", [CPU64])
    await submit(conn, org_a, "x")  # A has waiting work: the pass looks at A
    org_b, _ = await create_organization(conn, "other")
    await add_node(conn, org_b, "b", [CPU64])
    await submit(conn, org_b, "y")
    async with await psycopg.AsyncConnection.connect(db_url) as operator, await connect(db_url) as agent, \
            await connect(db_url) as own:  # fmt: skip
        await agent.execute("SET lock_timeout = '5s'")  # as a pooled connection has it
        await operator.execute("SELECT 1 FROM nodes WHERE id = %s FOR UPDATE", (a,))  # left open

        async def heartbeat() -> None:
            try:
                await beat(agent, org_a, a, [CPU8])  # the device set changes: capacity lock, then the row
            except psycopg.errors.LockNotAvailable:
                pass

        async with anyio.create_task_group() as tg:
            tg.start_soon(heartbeat)
            await eventually(lambda: waiting_on_a_lock(conn), timeout=5)
            started = time.monotonic()
            await sweep_once(own, SETTINGS, reexamine=True)
            took = time.monotonic() - started
        await operator.rollback()
    assert took < 2.5, f"a sweeper tick waited {took:.2f}s behind organization A's held-up fleet change"


async def test_a_lock_wait_that_runs_out_in_one_organizations_reexamination_does_not_stop_the_others(db_url, conn, org, monkeypatch):
    """When organization A's re-examination cannot have A's capacity lock (its wait runs out), the pass still
    re-examines the other organizations (B's blocked job that B's node can run is unblocked) and the tick
    completes (pairing rows pruned, ``since`` advanced by the caller).

    The ``LockNotAvailable`` once ended the tick: every organization after A was skipped, pruning never
    ran, and every later tick failed the same way. Each organization's look is now a step of its own. The
    wait is shortened to 1 s here (the same statement, bound 1 s instead of 30 s)."""
    monkeypatch.setattr(umbra_db, "SERVICE_LOCK_WAIT_SECONDS", 1)
    monkeypatch.setattr(blocked, "_SHARE_CAPACITY", umbra_db.service_lock_wait("SELECT pg_advisory_xact_lock_shared(%s, %s)"))
    org_a, _ = org
    await add_node(conn, org_a, "a", [CPU64])
    await submit(conn, org_a, "x")
    org_b, _ = await create_organization(conn, "other")
    theirs = await submit(conn, org_b, "y")
    assert theirs.status == "blocked"  # B has no node yet
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as other:
        async with other.transaction():
            await other.execute("SELECT 1 FROM jobs WHERE id = %s FOR UPDATE", (theirs.id,))
            await add_node(conn, org_b, "b", [CPU64])  # its re-examination skips the held row: left for the sweeper
    assert (await queue.load(conn, theirs.id, org_b)).status == "blocked"
    async with await psycopg.AsyncConnection.connect(db_url) as fleet_change, await connect(db_url) as own:
        await fleet_change.execute("SELECT pg_advisory_xact_lock(%s, %s)",
                                   (blocked.CAPACITY_LOCK_CLASS, organization_lock_key(org_a, b"capacity")))  # left open
        try:
            with anyio.fail_after(10):
                report = await sweep_once(own, SETTINGS, reexamine=True)
            error = None
        except psycopg.Error as exc:
            report, error = None, exc
        await fleet_change.rollback()
    assert error is None, f"one organization's capacity lock stopped the whole re-examination pass: {error!r}"
    assert report.jobs_unblocked >= 1
    assert (await queue.load(conn, theirs.id, org_b)).status == "queued"


async def test_a_pairing_row_held_elsewhere_does_not_stall_the_sweeper(db_url, conn, org):
    """A tick finishes within seconds while an operator's open transaction holds a pairing rate-limit row
    that pruning would delete (a source whose attempts all left the window).

    Pruning deleted without SKIP LOCKED on a connection with no lock timeout: the tick, and every
    organization's lease recovery after it, waited for as long as the operator's transaction stayed open."""
    from umbra.compute import pairing

    org_id, _ = org
    await add_node(conn, org_id, "n", [CPU64])  # a redemption: a source row in pairing_attempt_times
    async with await psycopg.AsyncConnection.connect(db_url) as operator, await connect(db_url) as own:
        await set_clock(own, pairing.WINDOW_SECONDS + 60)
        held = await (await operator.execute("SELECT source FROM pairing_attempt_times FOR UPDATE")).fetchall()
        assert held  # left open
        took, result, waited_in = await _tick_while_held(conn, own, operator, reexamine=True)
    assert not isinstance(result, Exception), repr(result)
    assert took < 5, f"a sweeper tick waited {took:.2f}s for a pairing row an operator held (waiting in {waited_in})"


# -- the stale-node pass -----------------------------------------------------------------------------------------


class _BeatBetweenReads:
    """The sweeper's connection, but a heartbeat of ``node_id`` commits between ``mark_stale_page``'s
    read of stale nodes and its second read of liveness (the race that second read exists for)."""

    def __init__(self, conn, beating, node_id) -> None:
        self._conn, self._beating, self._node_id, self.raced = conn, beating, node_id, 0

    def __getattr__(self, name):
        return getattr(self._conn, name)

    async def execute(self, query, params=None, **kwargs):
        if query is node_commands._BEAT_SINCE and not self.raced:
            self.raced += 1
            await self._beating.execute("UPDATE node_liveness SET last_seen_at = umbra_now() WHERE node_id = %s",
                                        (self._node_id,))  # the beat's one statement, committed
        return await self._conn.execute(query, params, **kwargs)


async def test_a_heartbeat_racing_one_node_of_a_full_page_does_not_end_the_stale_node_pass(db_url, conn, org):
    """One tick marks every stale node offline, another organization's too, even when more than a page
    (500) of organization A's nodes are stale and one of the first page beats while the pass reads it.

    The pass paged on only while a page *marked* a full page of nodes: a node saved by its beat made the
    page short (499) and ended the pass there, and every stale node after it (B's here) waited a tick. It
    now pages by the nodes it read."""
    org_a, _ = org
    a = await add_node(conn, org_a, "a", [CPU64])
    clones = await _clone_nodes(conn, a, SWEEP_BATCH + 40)
    org_b, _ = await create_organization(conn, "other")
    b = await add_node(conn, org_b, "b", [CPU64])
    assert str(b) > str(clones[-1])
    async with await connect(db_url) as own, await connect(db_url) as beating:
        offset = SETTINGS.heartbeat_stale_seconds + 5
        await set_clock(own, offset)
        await set_clock(beating, offset)
        racing = _BeatBetweenReads(own, beating, clones[0])
        with anyio.fail_after(15):
            report = await sweep_once(racing, SETTINGS, reexamine=False)
    assert racing.raced == 1
    assert await _status_of_node(conn, clones[0]) == "online"  # saved by its beat
    assert await _status_of_node(conn, b) == "offline", (
        f"B's stale node was not marked offline in the tick (marked {report.nodes_offline} of {len(clones) + 1})")


async def test_more_than_a_page_of_stale_nodes_held_elsewhere_does_not_hide_another_organizations(db_url, conn, org):
    """One tick marks organization B's stale node offline even while another transaction holds more than a
    page of organization A's stale nodes, all first in the pass's order; once let go, A's are marked too."""
    org_a, _ = org
    a = await add_node(conn, org_a, "a", [CPU64])
    clones = await _clone_nodes(conn, a, SWEEP_BATCH + 40)
    org_b, _ = await create_organization(conn, "other")
    b = await add_node(conn, org_b, "b", [CPU64])
    async with await psycopg.AsyncConnection.connect(db_url) as operator, await connect(db_url) as own:
        await operator.execute("SELECT 1 FROM nodes WHERE organization_id = %s FOR UPDATE", (org_a,))  # left open
        await set_clock(own, SETTINGS.heartbeat_stale_seconds + 5)
        with anyio.fail_after(10):
            held = await sweep_once(own, SETTINGS, reexamine=False)
        assert held.nodes_offline == 1
        assert await _status_of_node(conn, b) == "offline"
        await operator.rollback()
        with anyio.fail_after(10):
            released = await sweep_once(own, SETTINGS, reexamine=False)
    assert released.nodes_offline == len(clones) + 1


# -- the lease and blocked passes --------------------------------------------------------------------------------


async def test_more_than_a_page_of_expired_leases_held_elsewhere_does_not_hide_another_organizations(db_url, conn, org):
    """Organization B's expired lease is recovered in the same tick while another transaction holds more than
    a page of organization A's expired leases (rows locked: SKIP LOCKED), all expiring first."""
    org_a, _ = org
    a = await add_node(conn, org_a, "a", [CPU64])
    held_ids = await _running(conn, org_a, a, SWEEP_BATCH + 20, lease_seconds=5)
    org_b, _ = await create_organization(conn, "other")
    b = await add_node(conn, org_b, "b", [CPU64])
    theirs = await submit(conn, org_b, "u")
    assert (await claim(conn, org_b, b, lease_seconds=6)).job_id == theirs.id
    async with await psycopg.AsyncConnection.connect(db_url) as operator, await connect(db_url) as own:
        await operator.execute("SELECT 1 FROM jobs WHERE id = ANY(%s) FOR UPDATE", (held_ids,))  # left open
        await set_clock(own, 30)
        with anyio.fail_after(10):
            report = await sweep_once(own, SETTINGS, reexamine=False)
        assert report.leases_requeued == 1
        assert (await queue.load(conn, theirs.id, org_b)).status == "queued"
        await operator.rollback()
        with anyio.fail_after(10):
            released = await sweep_once(own, SETTINGS, reexamine=False)
    assert released.leases_requeued == len(held_ids)


async def test_ties_on_the_expiry_time_across_pages_skip_no_lease_and_end_none_twice(db_url, conn, org):
    """Leases that expire at the same instant (a claim batch is one transaction, one clock) are all ended in
    one tick across several pages, with more than a page of left rows (children of a held container) mixed
    among them: the (lease_expires_at, id) key neither skips nor repeats a row at a page boundary."""
    org_a, _ = org
    a = await add_node(conn, org_a, "a", [CPU64])
    parent = await submit(conn, org_a, "p")
    got = await claim(conn, org_a, a)
    # One attempt each: their lease's end fails them and would settle the held container, so they are left.
    kids = await claims.add_children(conn, organization_id=org_a, node_id=a, job_id=parent.id, attempt=got.attempt,
                                     children=[ChildRequest(kind="part", max_attempts=1) for _ in range(SWEEP_BATCH + 30)])  # fmt: skip
    for _ in kids:
        assert await claim(conn, org_a, a, lease_seconds=5) is not None
    org_b, _ = await create_organization(conn, "other")
    b = await add_node(conn, org_b, "b", [CPU64])
    theirs = await _running(conn, org_b, b, SWEEP_BATCH + 170, lease_seconds=5)
    everyone = [k.id for k in kids] + theirs
    await conn.execute("UPDATE jobs SET lease_expires_at = (SELECT max(lease_expires_at) FROM jobs WHERE id = ANY(%(ids)s)) "
                       "WHERE id = ANY(%(ids)s)", {"ids": everyone})  # fmt: skip
    async with await psycopg.AsyncConnection.connect(db_url) as operator, await connect(db_url) as own:
        await operator.execute("SELECT 1 FROM jobs WHERE id = %s FOR UPDATE", (parent.id,))  # left open
        await set_clock(own, 30)
        with anyio.fail_after(15):
            report = await sweep_once(own, SETTINGS, reexamine=False)
        await operator.rollback()
    assert (report.leases_requeued, report.leases_failed) == (len(theirs), 0)
    statuses = await (await conn.execute("SELECT status, count(*) FROM jobs WHERE id = ANY(%s) GROUP BY status",
                                         (theirs,))).fetchall()  # fmt: skip
    assert dict(statuses) == {"queued": len(theirs)}
    twice = await (await conn.execute(
        "SELECT count(*) FROM (SELECT stream FROM events WHERE type = 'job.lease_expired' GROUP BY stream "
        "HAVING count(*) > 1) t")).fetchone()  # fmt: skip
    assert twice[0] == 0


async def test_an_expired_child_that_only_requeues_is_recovered_while_its_container_is_held(db_url, conn, org):
    """A child's lease end that requeues it settles nothing, so it waits for no container: recovered in the
    tick while an operator's open transaction holds its container. Its sibling on its last attempt, whose
    end would settle that container, is left until the operator lets go, then failed."""
    org_id, _ = org
    node = await add_node(conn, org_id, "a", [CPU64])
    parent = await submit(conn, org_id, "p")
    got = await claim(conn, org_id, node)
    retrying, last = await claims.add_children(conn, organization_id=org_id, node_id=node, job_id=parent.id,
                                                attempt=got.attempt, children=[ChildRequest(kind="part", max_attempts=3),
                                                                               ChildRequest(kind="part", max_attempts=1)])  # fmt: skip
    for _ in range(2):
        assert await claim(conn, org_id, node, lease_seconds=5) is not None
    async with await psycopg.AsyncConnection.connect(db_url) as operator, await connect(db_url) as own:
        await operator.execute("SELECT 1 FROM jobs WHERE id = %s FOR UPDATE", (parent.id,))  # left open
        await set_clock(own, 30)
        with anyio.fail_after(10):
            report = await sweep_once(own, SETTINGS, reexamine=False)
        assert (report.leases_requeued, report.leases_failed) == (1, 0)
        assert [(await queue.load(conn, kid.id, org_id)).status for kid in (retrying, last)] == ["queued", "running"]
        await operator.rollback()
        with anyio.fail_after(10):
            later = await sweep_once(own, SETTINGS, reexamine=False)
    assert later.leases_failed == 1
    assert (await queue.load(conn, last.id, org_id)).status == "failed"


async def test_more_than_a_page_of_blocked_timeouts_held_elsewhere_does_not_hide_another_organizations(db_url, conn, org):
    """Organization B's job blocked past the timeout fails in the same tick while another transaction holds
    more than a page of organization A's timed-out blocked jobs (rows locked), all blocked first."""
    org_a, _ = org
    await add_node(conn, org_a, "a", [CPU64])
    rows, _ = await jobs.submit(conn, org_a, [spec("x", requires={"ram_min_mb": 10_000_000}) for _ in range(SWEEP_BATCH + 20)],
                                actor="t", batch=True)  # fmt: skip
    assert {r.status for r in rows} == {"blocked"}
    org_b, _ = await create_organization(conn, "other")
    await add_node(conn, org_b, "b", [CPU64])
    await anyio.sleep(0.05)
    theirs = await submit(conn, org_b, "u", requires={"ram_min_mb": 10_000_000})
    async with await psycopg.AsyncConnection.connect(db_url) as operator, await connect(db_url) as own:
        await operator.execute("SELECT 1 FROM jobs WHERE id = ANY(%s) FOR UPDATE", ([r.id for r in rows],))  # left open
        await set_clock(own, SETTINGS.blocked_timeout_seconds + 60)
        with anyio.fail_after(10):
            report = await sweep_once(own, SETTINGS, reexamine=False)
        await operator.rollback()
    assert report.blocked_failed == 1
    assert (await queue.load(conn, theirs.id, org_b)).status == "failed"


async def test_leases_reported_renewed_or_ended_while_the_pass_pages_are_each_handled_once(db_url, conn, org):
    """While a tick pages through two pages of expired leases, their holders complete some and renew others
    (a lapsed lease is still the holder's until swept): afterwards no expired lease is left running, a job
    completed is not also expired, and no lease is ended twice."""
    org_id, _ = org
    node = await add_node(conn, org_id, "n", [CPU64])
    ids = await _running(conn, org_id, node, SWEEP_BATCH + 250, lease_seconds=5)
    attempts = {r[0]: r[1] for r in await (await conn.execute("SELECT id, attempt FROM jobs WHERE id = ANY(%s)", (ids,))).fetchall()}
    async with await connect(db_url) as own, await connect(db_url) as agent:
        await set_clock(own, 30)
        await set_clock(agent, 30)
        await agent.execute("SET lock_timeout = '5s'")
        outcomes: dict = {}

        async def holder() -> None:
            for i, job_id in enumerate(reversed(ids)):  # from the far end, where the pass arrives last
                try:
                    if i % 2:
                        await claims.complete(agent, organization_id=org_id, node_id=node, job_id=job_id,
                                              attempt=attempts[job_id], result=1)  # fmt: skip
                        outcomes[job_id] = "complete"
                    else:
                        await claims.renew(agent, organization_id=org_id, node_id=node, job_id=job_id,
                                           attempt=attempts[job_id], lease_seconds=60)  # fmt: skip
                        outcomes[job_id] = "renewed"
                except Exception as exc:  # noqa: BLE001 - swept first: refused
                    outcomes[job_id] = type(exc).__name__
                await anyio.lowlevel.checkpoint()

        with anyio.fail_after(15):
            async with anyio.create_task_group() as tg:
                tg.start_soon(holder)
                await anyio.sleep(0.05)
                report = await sweep_once(own, SETTINGS, reexamine=False)
                tg.cancel_scope.cancel()
        left = await (await own.execute("SELECT count(*) FROM jobs WHERE id = ANY(%s) AND status = 'running' "
                                        "AND lease_expires_at < umbra_now()", (ids,))).fetchone()  # fmt: skip
    assert left[0] == 0, f"{left[0]} expired leases were left running after the tick"
    assert report.leases_requeued > 0 and outcomes, (report, len(outcomes))
    both = await (await conn.execute(
        "SELECT count(*) FROM (SELECT stream FROM events WHERE stream = ANY(%s) GROUP BY stream HAVING "
        "count(*) FILTER (WHERE type = 'job.lease_expired') > 1 OR (count(*) FILTER (WHERE type = 'job.lease_expired') > 0 "
        "AND count(*) FILTER (WHERE type = 'job.completed') > 0)) t", ([f"job:{i}" for i in ids],))).fetchone()  # fmt: skip
    assert both[0] == 0


async def _lock_holder(conn) -> int | None:
    row = await (await conn.execute(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted "
        "AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
        "AND ((classid::bigint << 32) | objid::bigint) = %s", (SWEEPER_LOCK_KEY,))).fetchone()  # fmt: skip
    return row[0] if row else None


async def test_a_leader_that_dies_mid_pass_leaves_each_lease_ended_exactly_once(db_url, conn, org):
    """Two sweepers; the leader's session is ended while it pages through expired leases (its page in flight
    rolls back); the follower takes over and every expired lease ends, none twice."""
    org_id, _ = org
    node = await add_node(conn, org_id, "n", [CPU64])
    ids = await _running(conn, org_id, node, SWEEP_BATCH + 250, lease_seconds=1)
    await anyio.sleep(1.2)  # real time: run() uses the database's own clock
    settings = dataclasses.replace(SETTINGS, sweep_interval_seconds=0.05)

    async def ended() -> int:
        return (await (await conn.execute("SELECT count(*) FROM jobs WHERE id = ANY(%s) AND status <> 'running'",
                                          (ids,))).fetchone())[0]  # fmt: skip

    with anyio.fail_after(14):
        async with anyio.create_task_group() as tg:
            for _ in range(2):
                tg.start_soon(lambda: sweeper.run(settings, db_url, retry_seconds=0.1))
            leader = await eventually(lambda: _lock_holder(conn), interval=0.005)
            await eventually(lambda: ended(), interval=0.005)  # some of the pass has committed
            await conn.execute("SELECT pg_terminate_backend(%s)", (leader,))

            async def all_ended():
                return await ended() == len(ids)

            await eventually(all_ended, timeout=10)
            tg.cancel_scope.cancel()
    twice = await (await conn.execute(
        "SELECT count(*) FROM (SELECT stream FROM events WHERE type = 'job.lease_expired' GROUP BY stream "
        "HAVING count(*) > 1) t")).fetchone()  # fmt: skip
    assert twice[0] == 0


# -- due announcements ------------------------------------------------------------------------------------------


async def test_a_job_that_becomes_due_while_leadership_changes_hands_is_announced(db_url, conn, org):
    """A job whose delay ends between the old leader's last tick and the new leader's first is announced
    (long-polls waiting for work wake when it is due, not at their next poll).

    A leader started announcing from its first tick on, so what fell due in the hand-over (or while the
    server started) was announced by no tick at all; its first tick now looks back (``first_since``)."""
    org_id, _ = org
    node = await add_node(conn, org_id, "n", [CPU64])
    job = await submit(conn, org_id)
    got = await claim(conn, org_id, node)
    await claims.fail(conn, organization_id=org_id, node_id=node, job_id=job.id, attempt=got.attempt, error="x", retry=True)
    old_last = await sweep_once(conn, SETTINGS)  # the old leader's last tick: not due yet (backoff 5 s)
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as listener:
        await listener.execute(f"LISTEN {store.LOG_CHANNEL}")
        await set_clock(conn, 6)  # due now; the old leader died before its next tick
        first = await sweep_once(conn, SETTINGS, since=await sweeper.first_since(conn, SETTINGS, 1.0))  # the new leader's first
        await set_clock(conn, 7)
        second = await sweep_once(conn, SETTINGS, since=first.now)
        notes = [hint for n in [n async for n in listener.notifies(timeout=0.5)] for hint in store.parse_hints(n.payload)]
    assert old_last.now < (await queue.load(conn, job.id, org_id)).not_before <= first.now
    assert first.jobs_woken + second.jobs_woken == 1, "the job due during the hand-over was never announced"
    assert any(o == org_id for o, _, c in notes if c), notes


# -- planner statistics --------------------------------------------------------------------------------------------


async def test_a_maintenance_lock_on_the_jobs_table_does_not_stall_the_tick(db_url, conn, org):
    """A tick whose queue has outgrown its planner statistics finishes within seconds while an operator's
    maintenance holds ``jobs`` in SHARE UPDATE EXCLUSIVE mode (a manual ``VACUUM jobs``, a
    ``CREATE INDEX CONCURRENTLY`` on it: minutes on a large table), which blocks no claim or report.

    ``ANALYZE public.jobs`` waited for that lock, on a connection with no lock timeout, and every
    organization's lease recovery waited for the maintenance to end; the analysis now skips a locked table
    (``ANALYZE (SKIP_LOCKED)``, migration 0037) and is tried again at a later tick."""
    org_id, _ = org
    await conn.execute("ALTER TABLE jobs SET (autovacuum_enabled = false)")  # nothing else analyses it
    await add_node(conn, org_id, "box", [CPU64])
    await jobs.submit(conn, org_id, [spec(payload={"i": i}) for i in range(1_500)], actor="t", batch=True)
    await conn.execute("SELECT pg_stat_force_next_flush()")  # this session's inserts, counted now
    async with await psycopg.AsyncConnection.connect(db_url) as operator, await connect(db_url) as own:
        await operator.execute("LOCK TABLE jobs IN SHARE UPDATE EXCLUSIVE MODE")  # as VACUUM / CREATE INDEX CONCURRENTLY
        took, result, waited_in = await _tick_while_held(conn, own, operator, reexamine=False)
    assert not isinstance(result, Exception), repr(result)
    assert took < 5, f"a sweeper tick waited {took:.2f}s for the jobs table's maintenance lock (waiting in {waited_in})"


async def test_a_leader_stalled_behind_a_lock_still_recovers_leases_or_hands_over(db_url, conn, org):
    """With two server processes' sweepers, another organization's lease that expires while the leader's
    tick waits for a lock held elsewhere (here the maintenance lock its ANALYZE needs) is recovered within
    seconds, by the leader or by the follower.

    Leadership is the leader's session: a leader waiting without bound kept it, so the follower never took
    over and no tick ran at all until the lock was let go."""
    org_a, _ = org
    await conn.execute("ALTER TABLE jobs SET (autovacuum_enabled = false)")
    await add_node(conn, org_a, "box", [CPU64])
    await jobs.submit(conn, org_a, [spec(payload={"i": i}) for i in range(1_500)], actor="t", batch=True)
    await conn.execute("SELECT pg_stat_force_next_flush()")
    org_b, _ = await create_organization(conn, "other")
    b = await add_node(conn, org_b, "b", [CPU64])
    theirs = await submit(conn, org_b, "u")
    settings = dataclasses.replace(SETTINGS, sweep_interval_seconds=0.1)
    async with await psycopg.AsyncConnection.connect(db_url) as operator:
        await operator.execute("LOCK TABLE jobs IN SHARE UPDATE EXCLUSIVE MODE")  # left open
        with anyio.fail_after(14):
            async with anyio.create_task_group() as tg:
                for _ in range(2):
                    tg.start_soon(lambda: sweeper.run(settings, db_url, retry_seconds=0.1))
                await eventually(lambda: _lock_holder(conn))
                assert (await claim(conn, org_b, b, lease_seconds=1)).job_id == theirs.id

                async def requeued():
                    return (await queue.load(conn, theirs.id, org_b)).status == "queued"

                try:
                    await eventually(requeued, timeout=6)
                    recovered = True
                except AssertionError:
                    recovered = False
                await operator.rollback()
                tg.cancel_scope.cancel()
    assert recovered, "B's expired lease was not recovered while the leading sweeper waited for a lock"


# -- clock steps -------------------------------------------------------------------------------------------------


class _ClockStepsBetweenPages:
    """The sweeper's connection, its clock (``umbra_now``) moved to ``to_seconds`` before the lease pass's second page."""

    def __init__(self, conn, to_seconds: float) -> None:
        self._conn, self._to, self.pages = conn, to_seconds, 0

    def __getattr__(self, name):
        return getattr(self._conn, name)

    async def execute(self, query, params=None, **kwargs):
        if query is sweeper._EXPIRED:
            self.pages += 1
            if self.pages == 2:
                await set_clock(self._conn, self._to)
        return await self._conn.execute(query, params, **kwargs)


async def test_a_clock_stepped_back_mid_pass_ends_only_what_the_new_clock_says_ran_out(db_url, conn, org):
    """When the database clock steps back between two pages of the lease pass, the pass still ends (no
    loop), ends every lease that has run out by the clock it now reads, and ends none that has not."""
    org_id, _ = org
    node = await add_node(conn, org_id, "n", [CPU64])
    short = await _running(conn, org_id, node, SWEEP_BATCH + 100, kind="s", lease_seconds=5)
    long = await _running(conn, org_id, node, 100, kind="l", lease_seconds=300)
    async with await connect(db_url) as own:
        await set_clock(own, 900)  # everything has run out...
        stepping = _ClockStepsBetweenPages(own, 60)  # ...until the clock steps back: only the short ones have
        with anyio.fail_after(10):
            report = await sweep_once(stepping, SETTINGS, reexamine=False)
    assert stepping.pages == 2
    assert report.leases_requeued == len(short)
    running = await (await conn.execute("SELECT count(*) FROM jobs WHERE id = ANY(%s) AND status = 'running'", (long,))).fetchone()
    assert running[0] == len(long)
