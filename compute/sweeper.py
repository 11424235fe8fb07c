"""The sweeper: time-driven changes, appended as events.

Each tick, in separate command transactions:

* **expired leases** → ``job.lease_expired``: back to ``queued`` with
  ``not_before`` = now + ``lease_expired_delay_seconds`` (only the holder is
  known to be gone), or ``failed`` when attempts are spent; parents settle;
* **stale nodes** → ``compute.nodes.mark_stale_page`` appends
  ``node.went_offline``;
* **blocked past the schedule timeout** → ``job.failed`` (reason
  ``blocked_timeout``, error = the blocking reason), so parents still settle;
* **running past ``max_runtime_s``** by more than a lease, counted from the
  current claim → ``job.failed`` (reason ``runtime_exceeded``;
  :func:`umbra.domain.jobs.decide_overrun`), whatever the holder does;
* **jobs waiting for the jobs they depend on** → ``job.unblocked`` once all of
  them completed, ``job.failed`` (``dependency_failed``) once one ended
  otherwise (:mod:`umbra.compute.dependencies`); such a job never times out
  as blocked. Whenever the process's listener hears the log move
  (:class:`LogMoved`), the leader looks at once at the waiting jobs that
  depend on the jobs whose streams moved, so a pipeline's next step is
  released within milliseconds of the one before ending; the look at every
  waiting job then runs with the second look below, as a safety net;
* **jobs submitted to run later** (a ``not_before``) whose time has come →
  ``job.unblocked`` (``due``), judged against the fleet as a submission is
  (:mod:`umbra.compute.delayed`); such a job never times out as blocked while
  it waits;
* **delayed jobs now due** → one hint per organization, so long-polls waiting
  for work wake when a backoff or lease-expiry delay ends rather than at their
  next poll;
* **planner statistics** of the queue are refreshed when it has outgrown them
  (:mod:`umbra.compute.statistics`);
* every :data:`REEXAMINE_SECONDS`, **waiting jobs** get a second look (see
  :func:`sweep_once`): blocked ones something could now run are unblocked,
  queued ones nothing could ever run are blocked; and spent **pairing codes** and the rate limit's
  sources with no attempt left in its window are deleted (:func:`umbra.compute.pairing.prune`).

Each step (each organization's, for the second look) stands alone: one whose
lock wait runs out (the sweeper's connection bounds them as pooled ones do), or
that fails, is logged and left to the next tick while the others go on.

It runs inside the server from startup, in exactly one process at a time:
:func:`run` holds a session-level advisory lock on a dedicated connection
while it leads; the others retry every few seconds, so when the leader dies
(its session ends and the lock with it) another takes over.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Awaitable, Callable
from uuid import UUID

import anyio
import psycopg
from anyio.abc import TaskStatus

from umbra import jitter, metrics
from umbra.db import DATABASE_AWAY, assume_service_role, bound_waits, database_away, lock_wait_ended, own_connection
from umbra.domain.jobs import decide_overrun
from umbra.events import store
from umbra.events.types import JobFailed
from umbra.projections import jobs as queue
from umbra.projections.jobs import Change
from umbra.settings import Settings

from . import abandoned_claims, delayed, dependencies, pairing, statistics
from .blocked import reexamine_waiting_jobs
from .claims import end_leases
from .jobs import ancestors_held_elsewhere, record_and_settle
from .nodes import mark_stale_page

log = logging.getLogger(__name__)

#: Session advisory lock held by the leading sweeper ("umbraswp" in ASCII).
SWEEPER_LOCK_KEY = 0x756D627261737770
#: Rows handled per transaction; a larger backlog takes several.
SWEEP_BATCH = 500
_METADATA = {"actor": "sweeper"}
#: How often the loop re-examines blocked jobs on its own, in seconds.
REEXAMINE_SECONDS = 30.0

#: A page of expired leases, after ``(after_at, after_id)`` (none: from the first): the sweeper pages
#: on, past the rows it leaves (see :func:`~umbra.compute.claims.end_leases`), not from the first again.
_EXPIRED = f"""
SELECT {queue.SELECT_LIST}, umbra_now() FROM jobs
WHERE status = 'running' AND lease_expires_at < umbra_now()
  AND (%(after_at)s::timestamptz IS NULL OR (lease_expires_at, id) > (%(after_at)s, %(after_id)s::uuid))
ORDER BY lease_expires_at, id LIMIT %(limit)s
FOR UPDATE SKIP LOCKED
"""
_BLOCKED_TOO_LONG = f"""
SELECT {queue.SELECT_LIST} FROM jobs
WHERE status = 'blocked' AND blocked_at <= umbra_now() - make_interval(secs => %(timeout)s) AND NOT awaiting_dependencies
  AND waiting_until IS NULL
  AND (%(after_at)s::timestamptz IS NULL OR (blocked_at, id) > (%(after_at)s, %(after_id)s::uuid))
ORDER BY blocked_at, id LIMIT %(limit)s
FOR UPDATE SKIP LOCKED
"""
#: A page of held jobs with a ``max_runtime_s`` whose current claim is older than it and the grace, after
#: ``(after_at, after_id)`` (their first claim's time and id), with that claim's time. ``started_at`` (the
#: first claim's) narrows them before the log is read. Only jobs with a limit, which the other jobs' rows
#: answer from the leases' index. Compared in seconds, as numbers: a limit of any size (a submission takes
#: any) never overflows a timestamp or an interval, which stopped the pass, for every organization, while
#: such a job ran.
_OVERRUN = f"""
SELECT {queue.SELECT_LIST}, claimed.recorded_at, umbra_now() FROM jobs
CROSS JOIN LATERAL (
    SELECT e.recorded_at FROM events e
    WHERE e.stream = 'job:' || jobs.id::text AND e.type = 'job.claimed' ORDER BY e.version DESC LIMIT 1
) AS claimed
WHERE status = 'running' AND lease_expires_at IS NOT NULL AND requires ? 'max_runtime_s'
  AND extract(epoch FROM umbra_now() - started_at) >= (requires ->> 'max_runtime_s')::numeric + %(grace)s
  AND extract(epoch FROM umbra_now() - claimed.recorded_at) >= (requires ->> 'max_runtime_s')::numeric + %(grace)s
  AND (%(after_at)s::timestamptz IS NULL OR (started_at, id) > (%(after_at)s, %(after_id)s::uuid))
ORDER BY started_at, id LIMIT %(limit)s
FOR UPDATE OF jobs SKIP LOCKED
"""
_WAITING_ORGS = """
SELECT o.id FROM organizations o
WHERE EXISTS (SELECT 1 FROM jobs j WHERE j.organization_id = o.id AND j.status = 'queued')
   OR EXISTS (SELECT 1 FROM jobs j WHERE j.organization_id = o.id AND j.status = 'blocked')
"""
_DUE = """
SELECT organization_id, count(*), max(position) FROM jobs
WHERE status = 'queued' AND not_before > %s AND not_before <= %s
GROUP BY organization_id
"""


@dataclass
class SweepReport:
    """What one tick did. ``now`` is the database time the tick started at."""

    now: datetime | None = None
    leases_requeued: int = 0
    leases_failed: int = 0
    nodes_offline: int = 0
    blocked_failed: int = 0
    runtime_failed: int = 0
    dependencies_released: int = 0
    dependencies_failed: int = 0
    #: Waiting jobs the whole look passed over for now (a fleet change in flight, a container held).
    dependencies_passed_over: int = 0
    delayed_released: int = 0
    jobs_woken: int = 0
    jobs_unblocked: int = 0
    jobs_blocked: int = 0
    pairing_rows_pruned: int = 0
    abandoned_claims_pruned: int = 0
    #: Whether the tick analysed ``jobs`` (its planner statistics had been outgrown).
    statistics_refreshed: bool = False

    @property
    def actions(self) -> int:
        return (self.leases_requeued + self.leases_failed + self.nodes_offline + self.blocked_failed + self.runtime_failed
                + self.dependencies_released + self.dependencies_failed + self.delayed_released)


async def sweep_once(
    conn: psycopg.AsyncConnection, settings: Settings, *, since: datetime | None = None, reexamine: bool = True,
    all_dependents: bool = True,
) -> SweepReport:
    """One tick. ``since`` is the previous tick's ``now``: jobs due after it are announced.

    ``reexamine`` also gives every organization's waiting (blocked and queued)
    jobs a second look, and prunes the pairing tables and the abandoned claim
    requests. ``all_dependents`` looks at every job waiting for its
    dependencies (the whole look of
    :mod:`umbra.compute.dependencies`); a leader whose prompt looks run
    takes it with the second look only (see :func:`_lead`).
    Node changes re-examine in their own transaction, but a job submitted
    concurrently (judged against a fleet snapshot that had not seen the
    change), held by another transaction at that moment, or returned to the
    queue after the change (a failure to retry, an expired lease) would
    otherwise wait as it was until the next change; the loop does this every
    :data:`REEXAMINE_SECONDS`.
    """
    report = SweepReport(now=(await (await conn.execute("SELECT umbra_now()")).fetchone())[0])

    async def expire_leases() -> None:
        after: _Page = None
        while (after := await _expire_leases(conn, settings, report, after)) is not None:
            pass

    async def fail_blocked() -> None:
        after: _Page = None
        while (after := await _fail_blocked(conn, settings, report, after)) is not None:
            pass

    async def fail_overrun() -> None:
        after: _Page = None
        while (after := await _fail_overrun(conn, settings, report, after)) is not None:
            pass

    async def release_dependents() -> None:
        released = await dependencies.release_ready(conn, metadata=_METADATA)
        report.dependencies_released, report.dependencies_failed = released.released, released.failed
        report.dependencies_passed_over = released.passed_over

    async def release_delayed() -> None:
        released = await delayed.release_due(conn, metadata=_METADATA)
        report.delayed_released = released.released

    async def mark_stale_nodes() -> None:
        report.nodes_offline = await _mark_stale_nodes(conn, settings)

    async def refresh_statistics() -> None:
        report.statistics_refreshed = await statistics.refresh_if_outgrown(conn)

    async def prune_pairing() -> None:
        report.pairing_rows_pruned = await pairing.prune(conn)

    async def prune_abandoned_claims() -> None:
        report.abandoned_claims_pruned = await abandoned_claims.prune(conn)

    await _step("expire_leases", expire_leases)
    await _step("mark_stale_nodes", mark_stale_nodes)
    await _step("fail_blocked", fail_blocked)
    await _step("fail_overrun", fail_overrun)
    if all_dependents:
        await _step("release_dependents", release_dependents)
    await _step("release_delayed", release_delayed)
    if since is not None:
        await _step("announce_due", lambda: _announce_due(conn, since, report))
    await _step("refresh_statistics", refresh_statistics)
    if reexamine:
        for (organization_id,) in await (await conn.execute(_WAITING_ORGS)).fetchall():
            async def reexamine_one(organization_id: UUID = organization_id) -> None:
                reexamined = await reexamine_waiting_jobs(conn, organization_id, metadata=_METADATA, wait=False)
                report.jobs_unblocked += reexamined.unblocked
                report.jobs_blocked += reexamined.blocked

            await _step("reexamine", reexamine_one, organization_id=str(organization_id))
        await _step("prune_pairing", prune_pairing)
        await _step("prune_abandoned_claims", prune_abandoned_claims)
    for action, count in (("lease_requeued", report.leases_requeued), ("lease_failed", report.leases_failed),
                          ("node_went_offline", report.nodes_offline), ("blocked_timeout", report.blocked_failed),
                          ("runtime_exceeded", report.runtime_failed),
                          ("dependencies_released", report.dependencies_released),
                          ("dependency_failed", report.dependencies_failed),
                          ("delayed_released", report.delayed_released),
                          ("job_unblocked", report.jobs_unblocked), ("job_blocked", report.jobs_blocked),
                          ("pairing_pruned", report.pairing_rows_pruned),
                          ("abandoned_claims_pruned", report.abandoned_claims_pruned),
                          ("jobs_analysed", int(report.statistics_refreshed))):
        metrics.count_sweeper_action(action, count)
    if report.actions:
        log.info("sweep", extra={"action": "sweep", "leases_requeued": report.leases_requeued,
                                 "leases_failed": report.leases_failed, "nodes_offline": report.nodes_offline,
                                 "blocked_failed": report.blocked_failed, "runtime_failed": report.runtime_failed,
                                 "dependencies_released": report.dependencies_released,
                                 "dependencies_failed": report.dependencies_failed,
                                 "delayed_released": report.delayed_released})  # fmt: skip
    return report


#: Where the next page of a pass starts: the (time, id) of the last row of the page before; None when
#: the pass is done.
_Page = tuple[datetime, UUID] | None


def _next_page(found: list[Any], column: int) -> _Page:
    """After a full page, where the next starts; None after a short one (nothing more to look at)."""
    return (found[-1][column], found[-1][0]) if len(found) == SWEEP_BATCH else None


def _after(page: _Page) -> dict[str, Any]:
    return {"after_at": page[0] if page else None, "after_id": page[1] if page else None, "limit": SWEEP_BATCH}


_LEASE_EXPIRES_AT = queue.COLUMNS.index("lease_expires_at")
_BLOCKED_AT = queue.COLUMNS.index("blocked_at")
_STARTED_AT = queue.COLUMNS.index("started_at")


async def _step(name: str, run: Callable[[], Awaitable[None]], **fields: str) -> None:
    """Run one step of a tick (one organization's, for the re-examination). A lock wait that ran out (the
    sweeper's connection bounds them as pooled ones do), or a failure of the step's own, is logged and
    leaves that step to the next tick: the tick goes on with the others. One organization's fleet change
    held up, or a manual ``VACUUM`` holding ``jobs``' statistics, stopped every organization's lease
    recovery behind it. Losing the database ends the tick (and the leadership) as before."""
    try:
        await run()
    except Exception as exc:  # noqa: BLE001 - the other steps must go on
        if database_away(exc):
            raise
        if lock_wait_ended(exc):
            log.warning("sweep step waited too long for a lock; trying again next tick",
                        extra={"action": "sweep_step_skipped", "step": name, **fields})  # fmt: skip
        else:
            log.exception("sweep step failed", extra={"action": "sweep_step_failed", "step": name, **fields})


async def _expire_leases(conn: psycopg.AsyncConnection, settings: Settings, report: SweepReport, after: _Page) -> _Page:
    """End one page of expired leases; returns where the next page starts (None: the pass is done).

    A pass pages on past the rows it leaves (a child whose end would settle a container another
    transaction holds; one whose lease end requeues it settles nothing and is not left) rather
    than starting from the first again: more than a page of those, all expiring first, hid every other
    organization's expired lease from every tick for as long as that transaction stayed open.
    """
    rows: list[queue.JobRow] = []
    async with conn.transaction():
        found = await (await conn.execute(_EXPIRED, _after(after))).fetchall()
        if found:
            # A child whose end would settle a container another transaction holds is left for a later tick.
            rows = await end_leases(conn, found, delay_seconds=settings.lease_expired_delay_seconds,
                                    node_revoked=False, metadata=_METADATA, leave_held=True)  # fmt: skip
            requeued = [r for r in rows if r.status == "queued"]
            report.leases_requeued += len(requeued)
            report.leases_failed += len(rows) - len(requeued)
            claimable_now = settings.lease_expired_delay_seconds == 0
            await store.publish(conn, _hints(rows, lambda r: claimable_now and r.status == "queued"))
    for row in rows:
        log.info("lease expired", extra={"action": "lease_swept", "job_id": str(row.id), "status": row.status})
    return _next_page(found, _LEASE_EXPIRES_AT)


async def _fail_blocked(conn: psycopg.AsyncConnection, settings: Settings, report: SweepReport, after: _Page) -> _Page:
    """Fail one page of jobs blocked past the timeout; returns where the next page starts (None: done).

    Pages on past the rows it leaves, as :func:`_expire_leases` does.
    """
    async with conn.transaction():
        found = await (await conn.execute(_BLOCKED_TOO_LONG, {"timeout": settings.blocked_timeout_seconds,
                                                              **_after(after)})).fetchall()  # fmt: skip
        records = await _settling_free(conn, found)
        if records:
            changes = []
            for row in map(queue.from_db, records):
                event = JobFailed(attempt=row.attempt, error=row.blocked_reason or "blocked", reason="blocked_timeout")
                changes.append(Change(row.id, row.organization_id, row, [event]))
            rows, _ = await record_and_settle(conn, changes, metadata=_METADATA)
            report.blocked_failed += len(rows)
            await store.publish(conn, _hints(rows, lambda r: False))
    return _next_page(found, _BLOCKED_AT)


async def _fail_overrun(conn: psycopg.AsyncConnection, settings: Settings, report: SweepReport, after: _Page) -> _Page:
    """Fail one page of jobs running past their ``max_runtime_s`` by more than a lease; returns where the
    next page starts (None: done). The grace is the lease a well-behaved agent would end the job within.
    Pages on past the rows it leaves, as :func:`_expire_leases` does."""
    width = len(queue.COLUMNS)
    async with conn.transaction():
        found = await (await conn.execute(_OVERRUN, {"grace": settings.lease_seconds, **_after(after)})).fetchall()
        records = await _settling_free(conn, found)
        changes = []
        for record in records:
            row, claimed_at, now = queue.from_db(record[:width]), record[width], record[width + 1]
            event = decide_overrun(attempt=row.attempt, max_runtime_s=row.requires.max_runtime_s, claimed_at=claimed_at,
                                   now=now, grace_seconds=settings.lease_seconds)  # fmt: skip
            if event is not None:
                changes.append(Change(row.id, row.organization_id, row, [event]))
        rows, _ = await record_and_settle(conn, changes, metadata=_METADATA) if changes else ([], None)
        report.runtime_failed += len(rows)
        await store.publish(conn, _hints(rows, lambda r: False))
    for change in changes:  # each was recorded, or the transaction failed and nothing reaches here
        log.warning("job ran past its max_runtime_s; failed", extra={"action": "runtime_exceeded", "job_id": str(change.job_id),
                    "node_id": str(change.state.lease_owner)})  # fmt: skip
    return _next_page(found, _STARTED_AT)


_PARENT = queue.COLUMNS.index("parent_job_id")


async def _settling_free(conn: psycopg.AsyncConnection, records: list[Any]) -> list[Any]:
    """The records (jobs' rows, locked) to end this tick: those of a child whose ancestor another transaction
    holds (an operator's open transaction) are left for a later tick, when it has let go. Waiting for that
    row, the sweeper held every other organization's expired leases and timeouts, and the nodes going
    offline, behind it."""
    children = [record[0] for record in records if record[_PARENT] is not None]
    held = await ancestors_held_elsewhere(conn, children)
    return [record for record in records if record[0] not in held]


def _hints(rows: list[queue.JobRow], claimable: Callable[[queue.JobRow], bool]) -> list[tuple[UUID, int, int]]:
    return [(r.organization_id, r.position, 1 if claimable(r) else 0) for r in rows]


async def _announce_due(conn: psycopg.AsyncConnection, since: datetime, report: SweepReport) -> None:
    """Hint for jobs whose ``not_before`` fell in (since, now]: each window is announced once."""
    async with conn.transaction():
        due = await (await conn.execute(_DUE, (since, report.now))).fetchall()
        if due:
            await store.publish(conn, [(org, position, count) for org, count, position in due])
            report.jobs_woken += sum(count for _, count, _ in due)


async def _mark_stale_nodes(conn: psycopg.AsyncConnection, settings: Settings) -> int:
    total, after = 0, None
    while True:
        marked, after = await mark_stale_page(conn, stale_seconds=settings.heartbeat_stale_seconds, limit=SWEEP_BATCH, after=after)
        total += len(marked)
        if after is None:
            return total


#: Shortest time between two prompt looks at waiting jobs: the log's moves in between are looked at together.
PROMPT_LOOK_SECONDS = 0.02
#: The same after a look that found no job waiting: a busy queue without dependencies (a drain) then costs
#: the sweeper one query every 0.1 s, not one per hint. A job that begins to wait ends that pause at once
#: (:meth:`LogMoved.on_waiting`): its dependency may end within it.
IDLE_LOOK_SECONDS = 0.1


class LogMoved:
    """Wakes the sweeper's leader between ticks when the log moves.

    The server's one listener calls :meth:`on_hint` for every hint,
    :meth:`on_waiting` when jobs began waiting for others, and
    :meth:`on_reconnect` after a reconnect (hints may have been lost); the
    leader's :meth:`wait` returns True once one came since it last returned,
    and its :meth:`pause` after a look that found no job waiting ends early
    when jobs began to wait.
    """

    def __init__(self) -> None:
        self._moved = anyio.Event()
        self._waiting = anyio.Event()

    def on_hint(self, organization_id: UUID, position: int, claimable: int) -> None:
        self._moved.set()

    def on_waiting(self, organization_id: UUID) -> None:
        self._waiting.set()
        self._moved.set()

    def on_reconnect(self) -> None:
        self._waiting.set()
        self._moved.set()

    async def pause(self, seconds: float) -> None:
        """Wait ``seconds`` before the next look, or until jobs began waiting (at once, when they did since the
        last pause: perhaps during the look that found none)."""
        with anyio.move_on_after(seconds):
            await self._waiting.wait()
        self._waiting = anyio.Event()

    async def wait(self, seconds: float) -> bool:
        """Whether the log moved within ``seconds`` (at once, when it moved since the last call)."""
        with anyio.move_on_after(seconds):
            await self._moved.wait()
            self._moved = anyio.Event()
            return True
        return False


async def run(
    settings: Settings,
    database_url: str,
    *,
    retry_seconds: float = 5.0,
    log_moved: LogMoved | None = None,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Lead the sweep when no other process does; retry leadership every ``retry_seconds``.

    A lost connection is replaced, whatever ended it (:data:`~umbra.db.DATABASE_AWAY`): the session
    PostgreSQL ends under a transaction left idle too long (the process stopped running inside it)
    answers ``IdleInTransactionSessionTimeout``, not an ``OperationalError``, and it stopped the
    sweeper, and the server with it.
    """
    task_status.started()
    delay = 0.5
    while True:
        try:
            async with own_connection(database_url) as conn:
                delay = 0.5
                await _lead(conn, settings, retry_seconds, log_moved)
        except DATABASE_AWAY as exc:
            log.warning("sweeper connection lost", extra={"action": "sweeper_lost", "error": str(exc)[:200]})
            await anyio.sleep(delay + jitter.uniform(0, delay))
            delay = min(delay * 2, retry_seconds)


async def first_since(conn: psycopg.AsyncConnection, settings: Settings, retry_seconds: float) -> datetime:
    """Where a new leader's first tick starts announcing due jobs: a while before now.

    The jobs that fell due between the previous leader's last tick and this
    one's first (or while the server started) are announced too: a hint sent
    twice costs a look, one never sent a long-poll's wait until its next
    safety poll.
    """
    [(now,)] = await (await conn.execute("SELECT umbra_now()")).fetchall()
    return now - timedelta(seconds=2 * (settings.sweep_interval_seconds + retry_seconds))


async def _lead(conn: psycopg.AsyncConnection, settings: Settings, retry_seconds: float, log_moved: LogMoved | None) -> None:
    """Wait for leadership on ``conn``, then sweep every interval until the connection fails; between ticks,
    look at the dependents of what moved each time ``log_moved`` says the log did.

    With those prompt looks, the whole look at the jobs waiting for their
    dependencies runs with the second look, every :data:`REEXAMINE_SECONDS`
    (and at the first tick, which covers the log before the prompt looks'
    position), not every tick: it reads every waiting job (21-40 ms a tick
    with 20,000 of them), and the prompt looks' position leaves nothing out
    (the log is read from it, gap-free). Each tick also takes a prompt look
    from that position (one query when nothing moved), so a hint that was
    never sent, or a look that failed, delays a release by a tick at most.
    What the whole look still catches is what a prompt look passed over: an
    organization whose fleet was changing, a child whose container another
    transaction held (the tick after such a look takes the whole look), a
    row another transaction held without writing it (unseen: the next second
    look). Without prompt looks it runs every tick."""
    await assume_service_role(conn)
    await bound_waits(conn)  # as a pooled connection's: no wait unbounded
    while not (await (await conn.execute("SELECT pg_try_advisory_lock(%s)", (SWEEPER_LOCK_KEY,))).fetchone())[0]:
        await anyio.sleep(retry_seconds)
    log.info("sweeper leading", extra={"action": "sweeper_leading", "backend_pid": conn.info.backend_pid})
    since: datetime | None = await first_since(conn, settings, retry_seconds)
    moved_after = await dependencies.log_head(conn)  # the first tick's whole look covers everything before
    last_reexamined = -REEXAMINE_SECONDS
    catch_up = False  # a prompt look passed a job over: the next tick looks at every waiting job
    tick: delayed.Look | None = None  # the last tick's start: what its release of delayed jobs could see
    while True:
        try:
            reexamine = time.monotonic() - last_reexamined >= REEXAMINE_SECONDS
            before = await store.head_position(conn)
            report = await sweep_once(conn, settings, since=since, reexamine=reexamine,
                                      all_dependents=reexamine or catch_up or log_moved is None)  # fmt: skip
            since, catch_up = report.now, report.dependencies_passed_over > 0
            tick = delayed.Look(report.now, before)
            if reexamine:
                last_reexamined = time.monotonic()
        except DATABASE_AWAY:
            raise
        except Exception:  # a bad tick must not stop recovery for good
            log.exception("sweep failed", extra={"action": "sweep_failed"})
        if log_moved is not None:  # from where the last prompt look stopped: a hint lost, a look that failed
            moved_after, _, passed_over = await _release_moved(conn, moved_after)
            catch_up = catch_up or passed_over
        next_tick = time.monotonic() + settings.sweep_interval_seconds
        # The tick released what was due at its start; what fell due since, or was written since, is due now.
        due_at, looked = await _next_due(conn, after=tick)
        while (left := next_tick - time.monotonic()) > 0:
            if due_at is not None and due_at <= time.monotonic():
                await _release_due(conn)
                due_at, looked = await _next_due(conn, after=looked)
                continue
            wait = left if due_at is None else min(left, due_at - time.monotonic())
            if log_moved is None:
                await anyio.sleep(wait)
            elif await log_moved.wait(wait):
                moved_after, waiting, passed_over = await _release_moved(conn, moved_after)
                catch_up = catch_up or passed_over
                # The move may be a job submitted to run before the next tick.
                due_at, looked = await _next_due(conn, after=looked)
                if waiting:
                    await anyio.sleep(PROMPT_LOOK_SECONDS)
                else:
                    await log_moved.pause(IDLE_LOOK_SECONDS)


async def _next_due(conn: psycopg.AsyncConnection, *, after: delayed.Look | None) -> tuple[float | None, delayed.Look | None]:
    """When (``time.monotonic``) to release the jobs waiting for their time next, ``None`` when none waits; and
    this look, for the next one's ``after``.

    A job that fell due after ``after`` (the last look, or the tick's start:
    a release has run since, which took every job due then that it could),
    or was written after it, is due now. One due before it was left by that
    release, its row held by another transaction or its organization's fleet
    changing: it waits for the next tick rather than being looked at again
    and again, and the next job still to come is woken for all the same.
    """
    times: list[tuple[bool, float | None, delayed.Look | None]] = [(False, None, None)]

    async def look() -> None:
        times[0] = await delayed.next_times(conn, after=after)

    await _step("next_due", look)
    due, seconds, now = times[0]
    if due:
        return time.monotonic(), now
    return (None if seconds is None else time.monotonic() + seconds), now


async def _release_due(conn: psycopg.AsyncConnection) -> None:
    """Release the jobs whose time came between ticks, a step as a tick's are, counted and logged as theirs are."""
    released = dependencies.Released()

    async def release() -> None:
        released.add(await delayed.release_due(conn, metadata=_METADATA))

    await _step("release_delayed", release)
    metrics.count_sweeper_action("delayed_released", released.released)
    if released.released:
        log.info("sweep", extra={"action": "sweep", "delayed_released": released.released})


async def _release_moved(conn: psycopg.AsyncConnection, after: int) -> tuple[int, bool, bool]:
    """A prompt look (:func:`umbra.compute.dependencies.release_moved`), a step as a tick's are, counted and
    logged as theirs are; returns where the next one starts (where it was, when the look failed: the next
    tick's prompt look goes again from there), whether any job waited, and whether it passed one over."""
    moved = dependencies.Released()

    async def look() -> None:
        nonlocal after
        released, after = await dependencies.release_moved(conn, after, metadata=_METADATA)
        moved.add(released)
        moved.waiting = released.waiting

    await _step("release_moved", look)
    metrics.count_sweeper_action("dependencies_released", moved.released)
    metrics.count_sweeper_action("dependency_failed", moved.failed)
    if moved.released or moved.failed:
        log.info("sweep", extra={"action": "sweep", "dependencies_released": moved.released,
                                 "dependencies_failed": moved.failed})  # fmt: skip
    return after, moved.waiting, moved.passed_over > 0
