"""Between ticks the sweeper's leader wakes when the first waiting delayed job falls due (``sweeper._next_due``,
``delayed.next_times``). Each test runs the real ``sweeper.run`` (a real LISTEN connection feeding its
``LogMoved``, as the server wires it) with a tick interval far longer than the lateness a test accepts, so a
job released at its time is told apart from one released at the next tick: a due job a release had to leave
(its row held elsewhere, its organization's fleet changing, a release that failed) holds back no later one,
jobs falling due close together or during a tick are each released at their time, and the leader never
spins. No job is ever released before its time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from datetime import datetime, timedelta, timezone
from typing import Any, Awaitable, Callable

import anyio
import psycopg
import pytest

from tests.helpers import eventually
from umbra import metrics
from umbra.compute import delayed, sweeper
from umbra.compute import jobs as submission
from umbra.domain.jobs import DUE
from umbra.events import store
from umbra.events.listener import LogListener
from umbra.projections.verify import verify
from umbra.settings import load_settings

from .queue_support import CPU64, add_node, spec, submit
from .test_delayed_jobs import now_of, text
from .test_dependencies import row

pytestmark = pytest.mark.anyio

SETTINGS = load_settings({})
#: How late (after its not_before) a job may be released and still count as released "at its time". Every
#: test that uses it runs ticks at least twice as far apart.
ON_TIME = 2.0
#: The ticks' interval in the tests that tell a release at its time from one at the next tick.
TICKS = 5.0


# -- probes -----------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Probe:
    """Counts of the leader's reads of the next due time and of its releases (ticks' and between ticks'), the
    ticks' end times, and knobs: releases that fail, a release that is slow, a hook run at the end of a tick."""

    ticks: list[float] = dataclasses.field(default_factory=list)
    next_reads: int = 0
    releases: int = 0
    fail_releases: int = 0
    slow_release_seconds: float = 0.0
    after_tick: Callable[[int], Awaitable[None]] | None = None

    def counts(self, since: tuple[int, int] = (0, 0)) -> tuple[int, int]:
        """(reads of the next time, releases) so far, less ``since`` (an earlier call's answer)."""
        return self.next_reads - since[0], self.releases - since[1]


@pytest.fixture
def probe(monkeypatch) -> Probe:
    found = Probe()
    real_next, real_release, real_sweep = delayed.next_times, delayed.release_due, sweeper.sweep_once

    async def counted_next(conn, **kw):
        found.next_reads += 1
        return await real_next(conn, **kw)

    async def counted_release(conn, **kw):
        found.releases += 1
        if found.fail_releases:
            found.fail_releases -= 1
            raise RuntimeError("a release that fails once")
        released = await real_release(conn, **kw)
        if found.slow_release_seconds:
            await anyio.sleep(found.slow_release_seconds)
        return released

    async def counted_sweep(conn, settings, **kw):
        report = await real_sweep(conn, settings, **kw)
        if found.after_tick is not None:
            await found.after_tick(len(found.ticks) + 1)
        found.ticks.append(time.monotonic())
        return report

    monkeypatch.setattr(delayed, "next_times", counted_next)
    monkeypatch.setattr(delayed, "release_due", counted_release)
    monkeypatch.setattr(sweeper, "sweep_once", counted_sweep)
    return found


@contextlib.asynccontextmanager
async def sweeping(db_url: str, probe: Probe, interval: float):
    """A sweeper whose hints come from a real LISTEN connection, as the server wires them; entered once the
    first tick is behind the leader."""
    listener = LogListener(db_url)
    moved = sweeper.LogMoved()
    listener.on_hint(moved.on_hint)
    listener.on_reconnect(moved.on_reconnect)
    listener.on_everything(moved.on_reconnect)
    settings = dataclasses.replace(SETTINGS, sweep_interval_seconds=interval)
    async with anyio.create_task_group() as tg:
        await tg.start(listener.run)
        tg.start_soon(functools.partial(sweeper.run, settings, db_url, retry_seconds=0.2, log_moved=moved))
        try:
            await eventually(lambda: _ready(len(probe.ticks) >= 1), timeout=15)
            yield
        finally:
            tg.cancel_scope.cancel()


async def _ready(value: Any) -> Any:
    return value


# -- reading what happened ------------------------------------------------------------------------------------


async def unblocked(conn, job_id) -> list[tuple[datetime, str]]:
    """The job's ``job.unblocked`` events: (recorded_at, reason)."""
    cursor = await conn.execute("SELECT recorded_at, data->>'reason' FROM events WHERE stream = %s AND type = 'job.unblocked' "
                                "ORDER BY version", (f"job:{job_id}",))  # fmt: skip
    return [(at, reason) for at, reason in await cursor.fetchall()]


async def released_at(conn, job_id, *, timeout: float) -> datetime:
    """When the job was released for its time (waiting up to ``timeout`` for it)."""

    async def look():
        found = await unblocked(conn, job_id)
        return found[0] if found else None

    at, reason = await eventually(look, timeout=timeout, interval=0.05)
    assert reason == DUE
    return at


async def lateness(conn, job, *, timeout: float) -> float:
    """Seconds from the job's not_before to its release (never negative: asserted)."""
    at = await released_at(conn, job.id, timeout=timeout)
    late = (at - job.not_before).total_seconds()
    assert late >= 0, f"released {-late:.3f} s before its not_before"
    return late


async def never_early(conn) -> None:
    """No job of the database was released (``due``) before the not_before it was submitted with."""
    cursor = await conn.execute("""
        SELECT u.stream, u.recorded_at, (s.data->>'not_before')::timestamptz FROM events u
        JOIN events s ON s.stream = u.stream AND s.type = 'job.submitted'
        WHERE u.type = 'job.unblocked' AND u.data->>'reason' = 'due'
          AND u.recorded_at < (s.data->>'not_before')::timestamptz""")  # fmt: skip
    assert await cursor.fetchall() == []


def delayed_released() -> float:
    return metrics.SWEEPER_ACTIONS.labels(action="delayed_released")._value.get()


@contextlib.asynccontextmanager
async def held_elsewhere(db_url: str, job_id):
    """The job's row locked by another transaction (a cancel in flight, an operator's open one) while inside."""
    async with await psycopg.AsyncConnection.connect(db_url) as other, other.transaction():
        await other.execute("SELECT 1 FROM jobs WHERE id = %s FOR UPDATE", (job_id,))
        yield


async def delayed_job(conn, org_id, seconds: float, base: datetime | None = None, **fields):
    base = base if base is not None else await now_of(conn)
    return await submit(conn, org_id, "later", not_before=text(base + timedelta(seconds=seconds)), **fields)


# -- jobs due close together ---------------------------------------------------------------------------------


async def test_jobs_due_a_few_milliseconds_apart_are_each_released_at_their_time(db_url, conn, org, probe):
    """A schedule of 30 jobs due 4 ms apart, 2 s from now, ticks 5 s apart. The leader wakes for the first;
    the release takes some milliseconds, during which the next ones fall due; every one must still be released
    at its time, not at the next tick."""
    org_id, _ = org
    await add_node(conn, org_id, "box", [CPU64])
    async with sweeping(db_url, probe, TICKS):
        base = await now_of(conn) + timedelta(seconds=2)
        specs = [spec("later", not_before=text(base + timedelta(milliseconds=4 * i))) for i in range(30)]
        rows, _ = await submission.submit(conn, org_id, specs, actor="test", batch=True)
        assert {r.status for r in rows} == {"blocked"}
        late = [await lateness(conn, r, timeout=20) for r in rows]
    await never_early(conn)
    worst = max(late)
    assert worst < ON_TIME, (f"{sum(1 for x in late if x >= ON_TIME)} of 30 jobs released {worst:.1f} s after their "
                             f"time (at the next tick, 5 s apart), not at it; lateness: {[round(x, 2) for x in late]}")


async def test_a_job_falling_due_while_the_previous_one_is_released_is_not_left_to_the_next_tick(db_url, conn, org, probe):
    """Two jobs due 0.15 s apart, and a release that takes 0.4 s (a big page, a busy database): the second falls
    due while the first is released. The leader's look after that release counts it due (it fell due after
    the look before), so it is released at once, not left to the tick as a job the release had to leave."""
    org_id, _ = org
    await add_node(conn, org_id, "box", [CPU64])
    async with sweeping(db_url, probe, TICKS):
        probe.slow_release_seconds = 0.4
        base = await now_of(conn)
        first = await delayed_job(conn, org_id, 1.5, base)
        second = await delayed_job(conn, org_id, 1.65, base)
        late_first = await lateness(conn, first, timeout=20)
        late_second = await lateness(conn, second, timeout=20)
    await never_early(conn)
    assert late_first < ON_TIME
    assert late_second < ON_TIME, f"the second job was released {late_second:.1f} s after its time (the tick), not at it"


async def test_a_job_whose_time_came_while_its_submission_committed_is_released_at_its_commit(db_url, conn, org, probe):
    """A submission's transaction began before its job's not_before and committed after it, and the leader
    looked in between (the job not there yet, its time already past that look's clock). Its commit is a
    move of the log, and the look after it counts the job due because it was written after the look before,
    whatever its time: released at once, not at the next tick, 5 s on."""
    org_id, _ = org
    await add_node(conn, org_id, "box", [CPU64])
    async with sweeping(db_url, probe, TICKS):
        ticks = len(probe.ticks)
        await eventually(lambda: _ready(len(probe.ticks) > ticks), timeout=15)  # the steps below end before the next
        async with await psycopg.AsyncConnection.connect(db_url) as other, other.transaction():
            began = await now_of(other)  # the transaction's clock, which judges the submission
            await anyio.sleep(0.6)  # its not_before, 0.3 s after that, has passed
            reads = probe.next_reads
            await store.publish(conn, [(org_id, await store.head_position(conn), 1)])  # a move of the log
            await eventually(lambda: _ready(probe.next_reads > reads), timeout=5)  # the leader looked, after it
            job = await delayed_job(other, org_id, 0.3, began)
            assert job.status == "blocked"
        committed = time.monotonic()
        await released_at(conn, job.id, timeout=15)
        took = time.monotonic() - committed
    await never_early(conn)
    assert took < ON_TIME, f"released {took:.1f} s after its submission committed (at the next tick), not at once"


async def test_a_job_falling_due_during_a_tick_is_released_after_the_tick_not_at_the_next(db_url, conn, org, probe):
    """A tick that takes 1.5 s after its release of delayed jobs (the first tick and every 30 s one take the
    whole look over every organization, and prune; a step may wait out its lock wait): a job submitted during
    it, due 0.5 s later, falls due before the tick ends. It fell due after the tick began, so the look after the
    tick counts it due: released when the tick ends, not at the next one, 5 s on."""
    org_id, _ = org
    await add_node(conn, org_id, "box", [CPU64])
    submitted: list[Any] = []

    async def slow_first_tick(tick: int) -> None:
        if tick == 1:
            async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as other:
                submitted.append(await delayed_job(other, org_id, 0.5))
            await anyio.sleep(1.5)

    probe.after_tick = slow_first_tick
    async with sweeping(db_url, probe, TICKS):
        late = await lateness(conn, submitted[0], timeout=20)
    await never_early(conn)
    # Falling due at 0.5 s into a tick that still had 1 s to go, it cannot be released before the tick ends.
    assert late < 1.0 + ON_TIME, f"released {late:.1f} s after its time: at the next tick, not when the tick ended"


# -- a due job another transaction holds, or whose organization's fleet is changing ------------------------------


async def test_a_due_job_held_elsewhere_does_not_make_the_leader_spin_and_is_released_once_free(db_url, conn, org, probe):
    """Due in 1 s, its row held FOR UPDATE by another transaction until 3 s: the leader reads the next time and
    releases a handful of times (ticks 3 s apart, its own hints), not in a loop; once the hold ends a tick
    releases it."""
    org_id, _ = org
    await add_node(conn, org_id, "box", [CPU64])
    async with sweeping(db_url, probe, 3.0):
        job = await delayed_job(conn, org_id, 1.0)
        async with held_elsewhere(db_url, job.id):
            await anyio.sleep(1.0)
            before = probe.counts()
            await anyio.sleep(2.0)
            reads, releases = probe.counts(before)
            assert (await row(conn, org_id, job.id)).status == "blocked"
        freed = datetime.now(timezone.utc)
        at = await released_at(conn, job.id, timeout=10)
    await never_early(conn)
    assert reads < 15 and releases < 15, (reads, releases)
    assert (at - freed).total_seconds() < 3.0 + ON_TIME
    assert await verify(conn) == []


async def test_a_due_job_held_elsewhere_under_a_stream_of_hints_costs_at_most_a_release_per_look(db_url, conn, org, probe):
    """Due in 0.5 s, its row held by another transaction for 2 s while the log moves every 50 ms (a busy
    queue: 30 submissions, a hint each): each move may make the leader try the held job again, but no more
    often than its looks (one per 0.1 s), never in a loop."""
    org_id, _ = org
    await add_node(conn, org_id, "box", [CPU64])
    async with sweeping(db_url, probe, 30.0):
        job = await delayed_job(conn, org_id, 0.5)
        async with held_elsewhere(db_url, job.id):
            await anyio.sleep(0.7)
            before = probe.counts()
            for _ in range(30):
                await submit(conn, org_id, "busy")
                await anyio.sleep(0.05)
            reads, releases = probe.counts(before)
            assert (await row(conn, org_id, job.id)).status == "blocked"
    await never_early(conn)
    assert releases <= 20 and reads <= 40, (reads, releases)


async def test_a_due_job_held_elsewhere_does_not_hold_back_a_later_job(db_url, conn, org, probe):
    """J1 due in 1 s, its row held by another transaction (a cancel in flight, an operator's open transaction);
    J2 due in 2.5 s. J1 waits for the hold; J2, free, is still released at its time: the leader's look tells a
    job a release had to leave from the next time still to come."""
    org_id, _ = org
    await add_node(conn, org_id, "box", [CPU64])
    async with sweeping(db_url, probe, TICKS):
        base = await now_of(conn)
        j1 = await delayed_job(conn, org_id, 1.0, base)
        j2 = await delayed_job(conn, org_id, 2.5, base)
        async with held_elsewhere(db_url, j1.id):
            late_j2 = await lateness(conn, j2, timeout=20)
    await never_early(conn)
    assert late_j2 < ON_TIME, f"J2 was released {late_j2:.1f} s after its time (at the next tick), held back by J1's hold"


async def test_a_fleet_change_in_one_organization_does_not_hold_back_another_organizations_delayed_job(
    db_url, conn, org, probe
):
    """Organization A's job due in 1 s while a change of A's fleet holds A's capacity lock (the release passes
    it over); organization B's job due in 2.5 s is released at its time: A's passed-over job, its time past,
    does not hide B's from the leader until the next tick."""
    from umbra.compute.accounts import create_organization
    from umbra.compute.blocked import hold_capacity

    org_a, _ = org
    org_b, _ = await create_organization(conn, "other")
    await add_node(conn, org_a, "a-box", [CPU64])
    await add_node(conn, org_b, "b-box", [CPU64])
    async with sweeping(db_url, probe, TICKS):
        base = await now_of(conn)
        ja = await delayed_job(conn, org_a, 1.0, base)
        jb = await delayed_job(conn, org_b, 2.5, base)
        async with await psycopg.AsyncConnection.connect(db_url) as other:
            async with other.transaction():
                await hold_capacity(other, org_a, exclusive=True)
                late_b = await lateness(conn, jb, timeout=20)
                assert (await row(conn, org_a, ja.id)).status == "blocked"
    await never_early(conn)
    assert late_b < ON_TIME, f"B's job was released {late_b:.1f} s after its time (the next tick), held back by A's"


# -- failures -----------------------------------------------------------------------------------------------


async def test_a_release_between_ticks_that_fails_once_does_not_stop_the_leader(db_url, conn, org, probe):
    """The leader's first release between ticks raises (J1's, due in 1 s): the loop goes on, J1 is released
    later (a tick), and J2, due in 2.5 s, is released at its time."""
    org_id, _ = org
    await add_node(conn, org_id, "box", [CPU64])
    async with sweeping(db_url, probe, TICKS):
        base = await now_of(conn)
        j1 = await delayed_job(conn, org_id, 1.0, base)
        j2 = await delayed_job(conn, org_id, 2.5, base)
        probe.fail_releases = 1
        late_j1 = await lateness(conn, j1, timeout=20)
        late_j2 = await lateness(conn, j2, timeout=20)
    await never_early(conn)
    assert probe.fail_releases == 0  # the failing release ran
    assert late_j1 < TICKS + ON_TIME  # released later: at the tick after the failure
    assert late_j2 < ON_TIME, f"J2 was released {late_j2:.1f} s after its time (the next tick): J1's failed release hid it"


# -- many at once, metrics --------------------------------------------------------------------------------------


async def test_many_jobs_due_at_one_instant_are_released_once_each_and_counted_once(db_url, conn, org, probe):
    """600 jobs due at one instant (two pages of the release), ticks 30 s apart: all released at their
    time, each exactly once, ``umbra_sweeper_actions{action="delayed_released"}`` up by 600."""
    org_id, _ = org
    await add_node(conn, org_id, "box", [CPU64])
    async with sweeping(db_url, probe, 30.0):
        before = delayed_released()
        at = await now_of(conn) + timedelta(seconds=2.5)
        rows, created = await submission.submit(conn, org_id, [spec("later", not_before=text(at))] * 600, actor="test",
                                                batch=True)  # fmt: skip
        assert created == 600

        async def all_released():
            [(n,)] = await (await conn.execute("SELECT count(*) FROM jobs WHERE status = 'queued'")).fetchall()
            return n == 600

        await eventually(all_released, timeout=20, interval=0.1)
        done = time.monotonic()
        await anyio.sleep(0.5)
        counted = delayed_released() - before
    await never_early(conn)
    [(latest,)] = await (await conn.execute(
        "SELECT max(recorded_at) FROM events WHERE type = 'job.unblocked'")).fetchall()  # fmt: skip
    assert (latest - at).total_seconds() < ON_TIME + 2.0
    per_job = await (await conn.execute(
        "SELECT count(*) FROM events WHERE type = 'job.unblocked' GROUP BY stream")).fetchall()  # fmt: skip
    assert len(per_job) == 600 and {n for (n,) in per_job} == {1}
    assert counted == 600, counted
    assert done - probe.ticks[-1] > 0  # released between ticks
    assert await verify(conn) == []


# -- times very close to now ------------------------------------------------------------------------------------


async def test_not_befores_milliseconds_away_are_released_promptly_without_a_busy_loop(db_url, conn, org, probe):
    """Ten jobs, each submitted on its own (a hint each), due 20-200 ms from the moment read before the first:
    some are past by their submission (queued at once), the others released within moments (ticks 5 s apart),
    never before their time; the leader reads and releases a few dozen times at most."""
    org_id, _ = org
    await add_node(conn, org_id, "box", [CPU64])
    async with sweeping(db_url, probe, TICKS):
        before = probe.counts()
        base = await now_of(conn)
        made = [await delayed_job(conn, org_id, 0.02 * (i + 1), base) for i in range(10)]

        async def all_queued():
            rows_ = [await row(conn, org_id, j.id) for j in made]
            return all(r.status == "queued" for r in rows_)

        started = time.monotonic()
        with contextlib.suppress(AssertionError):
            await eventually(all_queued, timeout=12)
        took = time.monotonic() - started
        await anyio.sleep(0.5)
        reads, releases = probe.counts(before)
    await never_early(conn)
    assert took < ON_TIME, f"the last of them was queued {took:.1f} s later (at the tick, 5 s apart), not at its time"
    assert reads < 200 and releases < 100, (reads, releases)

