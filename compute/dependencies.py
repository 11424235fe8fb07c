"""Jobs that run after others: releasing a waiting job when the jobs it depends on complete, failing it
when one of them ends otherwise.

A job submitted with ``depends_on`` whose dependencies have not all completed
is ``blocked`` (``job.blocked`` with ``waiting_on``, ``awaiting_dependencies``
on its row). The sweeper's leader looks at waiting jobs: one whose
dependencies all completed is ``job.unblocked`` (``dependencies_complete``)
and judged against the fleet as a submission is, so it is queued, or blocked
again if nothing could ever run it; one with a dependency that failed, was
cancelled or settled ``partial`` is ``job.failed`` (``dependency_failed``),
and its own dependents fail at the next look in turn (a look goes again while
it fails any, up to :data:`MAX_ROUNDS` links of a chain). One released before
the ``not_before`` it was submitted with waits on, blocked, for that moment
(:mod:`umbra.compute.delayed`). A child (whose
siblings it may depend on) is failed only when no other transaction holds its
container, as the sweeper's other passes do; a release settles nothing and
waits for no one.

It looks twice over. :func:`release_moved`, whenever the leader's process
hears the log move, looks only at the waiting jobs that depend on a job whose
stream moved since its last look (the log read from that position, gap-free;
index ``jobs_waiting_on``), or that are one: a pipeline's next step is
released tens of milliseconds after the step before it ends.
:func:`release_ready` looks at every waiting job, and catches what a prompt
look passed over: a row another transaction held without writing it, an
organization whose fleet was changing. The sweeper runs it with its second
look at waiting jobs (every ``REEXAMINE_SECONDS``), at the tick after a
prompt look that passed a job over, or every tick in a process without prompt
looks; each tick also takes a prompt look, from where the last one stopped,
so a lost hint or a look that failed delays a release by a tick at most.

Why the sweeper rather than the transaction that ends the dependency: a job
ends on many paths, the group commit's among them, which must never wait for a
row another transaction holds; locking dependents there would put a lock
wait, and a read of the dependents, on every completion of every job. A queue
with no waiting job pays one probe of an empty partial index per look.

Nothing is missed: each look reads the dependencies' statuses afresh, so a
dependency that ended while its dependent was being submitted (the submission
read it still running) is seen by the next look: the dependent's own stream
moved after the dependency's did.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping, Sequence
from uuid import UUID

import msgspec
import psycopg

from umbra.domain.jobs import decide_dependencies
from umbra.events import store
from umbra.events.types import Event, JobBlocked, JobFailed, JobUnblocked
from umbra.projections import jobs as queue
from umbra.projections.jobs import Change

from .blocked import BlockingJudge, try_share_capacity
from .jobs import ancestors_held_elsewhere, record_and_settle

log = logging.getLogger(__name__)

#: A page of waiting jobs, after ``after_id`` (none: from the first), whose dependencies have all completed or
#: one of which ended otherwise, each with its dependencies' statuses (JSON ``{id: status}``) and the clock. The others
#: are read and passed over. Those another transaction holds (a cancel in flight) are left to the next page
#: or tick. ``{among}`` narrows the look to some waiting jobs (:data:`_AMONG_MOVED`), or not at all.
_READY = f"""
SELECT {queue.SELECT_LIST}, dependencies.statuses::text, umbra_now() FROM jobs
CROSS JOIN LATERAL (
    SELECT json_object_agg(d.id, d.status) AS statuses,
           bool_and(d.status = 'complete') AS complete,
           bool_or(d.status IN ('failed', 'cancelled', 'partial')) AS unsuccessful
    FROM jobs d WHERE d.id = ANY(jobs.depends_on)
) AS dependencies
WHERE awaiting_dependencies AND status = 'blocked' AND (dependencies.complete OR dependencies.unsuccessful){{among}}
  AND (%(after_id)s::uuid IS NULL OR id > %(after_id)s::uuid)
ORDER BY id LIMIT %(limit)s
FOR UPDATE OF jobs SKIP LOCKED
"""
#: The waiting jobs that depend on one of ``moved`` (index ``jobs_waiting_on``), or are one of them (a job that
#: began to wait after its dependency ended: the submission read it still running).
_AMONG_MOVED = "\n  AND (depends_on && %(moved)s::uuid[] OR id = ANY(%(moved)s::uuid[]))"
_READY_ALL = _READY.format(among="")
_READY_AMONG = _READY.format(among=_AMONG_MOVED)
_statuses = msgspec.json.Decoder(dict[UUID, str])
_WIDTH = len(queue.COLUMNS)
#: Waiting jobs handled per transaction.
PAGE = 500
#: Looks one tick takes at most while each fails jobs (whose dependents it then looks at again): a chain
#: longer than this fails over several ticks.
MAX_ROUNDS = 16


@dataclass
class Released:
    """What a look did, how many jobs it passed over for now (their rows' settlement held by another
    transaction, or their organization's fleet changing), and (a prompt look's) whether any job waited when
    it last looked."""

    released: int = 0
    failed: int = 0
    passed_over: int = 0
    waiting: bool = False

    def add(self, other: Released) -> None:
        self.released += other.released
        self.failed += other.failed
        self.passed_over += other.passed_over


async def release_ready(conn: psycopg.AsyncConnection, *, metadata: Mapping[str, Any]) -> Released:
    """Release or fail every waiting job whose dependencies have settled it, page by page, each its own
    transaction; again while a round fails any (their dependents may now fail too)."""
    total = Released()
    for _ in range(MAX_ROUNDS):
        done = await _look(conn, metadata)
        total.add(done)
        if not done.failed:
            break
    return total


#: Whether any job waits for its dependencies, and the log's last position, read in one snapshot: a job that
#: has begun to wait is seen waiting whenever its submission's events are below the position read.
_WAITING_AND_HEAD = """
SELECT EXISTS (SELECT 1 FROM jobs WHERE awaiting_dependencies AND status = 'blocked'),
       (SELECT coalesce(max(position), 0) FROM events)
"""
#: The jobs whose streams moved after one log position, up to another (positions are visible in their
#: order: see :mod:`umbra.events.store`), a page at a time.
_MOVED = """
SELECT position, substr(stream, 5)::uuid FROM events
WHERE position > %(after)s AND position <= %(head)s AND stream LIKE 'job:%%'
ORDER BY position LIMIT %(limit)s
"""
#: Events read per page of :data:`_MOVED`.
MOVED_PAGE = 5000


async def log_head(conn: psycopg.AsyncConnection) -> int:
    """Where a first prompt look starts: the log's last position now."""
    [(_, head)] = await (await conn.execute(_WAITING_AND_HEAD)).fetchall()
    return head


async def release_moved(conn: psycopg.AsyncConnection, after: int, *, metadata: Mapping[str, Any]) -> tuple[Released, int]:
    """The prompt look, run when the log moves: :func:`release_ready` for only the waiting jobs that depend
    on a job whose stream moved after position ``after``, or are such a job.

    Returns what it did and the position it read to, where the next prompt
    look starts. In a queue where no job waits it reads nothing but that
    position. A job it passes over (held by another transaction, or its
    organization's fleet changing) is not looked at again until its
    dependencies move again: the whole look (:func:`release_ready`) is what
    catches it; the count of those it knows of is in ``passed_over`` (a row
    another transaction held, ``SKIP LOCKED``, is not seen to be passed over).
    """
    total = Released()
    for _ in range(MAX_ROUNDS):
        [(waiting, head)] = await (await conn.execute(_WAITING_AND_HEAD)).fetchall()
        total.waiting = waiting
        if not waiting:
            return total, max(after, head)
        done = Released()
        while after < head:
            page = await (await conn.execute(_MOVED, {"after": after, "head": head, "limit": MOVED_PAGE})).fetchall()
            if page:
                done.add(await _look(conn, metadata, moved=list({job_id for _, job_id in page})))
            after = page[-1][0] if len(page) == MOVED_PAGE else head
        total.add(done)
        if not done.failed:  # the failures' own events moved their streams: the next round looks at their dependents
            break
    return total, after


async def _look(conn: psycopg.AsyncConnection, metadata: Mapping[str, Any], *, moved: list[UUID] | None = None) -> Released:
    """One look at the waiting jobs (those among ``moved`` only, when given), page by page."""
    done = Released()
    after: UUID | None = None
    while True:
        after = await _release_page(conn, after, done, metadata, moved)
        if after is None:
            return done


async def _release_page(
    conn: psycopg.AsyncConnection, after: UUID | None, done: Released, metadata: Mapping[str, Any],
    moved: list[UUID] | None,
) -> UUID | None:
    """One page of :data:`_READY`; returns where the next starts (None: the look is done)."""
    async with conn.transaction():
        query, params = (_READY_ALL, {}) if moved is None else (_READY_AMONG, {"moved": moved})
        found = await (await conn.execute(query, {"after_id": after, "limit": PAGE, **params})).fetchall()
        verdicts: list[tuple[queue.JobRow, Event]] = []
        for record in found:
            row = queue.from_db(record[:_WIDTH])
            verdict = decide_dependencies(status=row.status, attempt=row.attempt, depends_on=row.depends_on or (),
                                          statuses=_statuses.decode(record[_WIDTH]), not_before=row.not_before,
                                          now=record[_WIDTH + 1])  # fmt: skip
            if verdict is not None:
                verdicts.append((row, verdict))
        changes = await settle_waiting(conn, verdicts, done, metadata=metadata)
    for change in changes:
        if isinstance(change.events[0], JobFailed):
            log.info("a job it depends on ended otherwise; failed", extra={"action": "dependency_failed",
                     "job_id": str(change.job_id), "organization_id": str(change.organization_id)})  # fmt: skip
    return found[-1][0] if len(found) == PAGE else None


async def settle_waiting(
    conn: psycopg.AsyncConnection, verdicts: Sequence[tuple[queue.JobRow, Event]], done: Released, *,
    metadata: Mapping[str, Any],
) -> list[Change]:
    """Record what the sweeper decided for waiting jobs (their rows locked in the caller's transaction), each
    verdict a job's next event: a release (``job.unblocked``) is judged against the fleet as a submission
    is (queued, or blocked if nothing could ever run it), a failure (``job.failed``) settles the job's
    parents, a wait for its time (``job.blocked``) is recorded as it is. Counts them into ``done``; returns
    what it recorded.

    A child whose failure would settle a container another transaction holds waits for the next look (the
    sweeper waits for no one's row: see ``ancestors_held_elsewhere``), and so does a release in an
    organization whose fleet is changing; a release settles nothing, and goes.
    """
    held = await ancestors_held_elsewhere(conn, [row.id for row, verdict in verdicts
                                                 if row.parent_job_id is not None and isinstance(verdict, JobFailed)])  # fmt: skip
    judges: dict[UUID, BlockingJudge | None] = {}
    changes: list[Change] = []
    claimable: set[UUID] = set()
    for row, verdict in verdicts:
        if row.id in held:
            done.passed_over += 1
            continue
        events: list[Event] = [verdict]
        if isinstance(verdict, JobUnblocked):
            judge = await _judge(conn, row.organization_id, judges)
            if judge is None:  # a change of the organization's fleet is in flight: the next look
                done.passed_over += 1
                continue
            if (reason := judge.reason(row.requires)) is not None:
                events.append(JobBlocked(reason=reason))
            else:
                claimable.add(row.id)
        changes.append(Change(row.id, row.organization_id, row, events))
    if changes:
        written, _ = await record_and_settle(conn, changes, metadata=metadata)
        await store.publish(conn, [(r.organization_id, r.position, 1 if r.id in claimable else 0) for r in written])
        failed = sum(1 for c in changes if isinstance(c.events[0], JobFailed))
        done.failed += failed
        done.released += len(changes) - failed
    return changes


async def _judge(
    conn: psycopg.AsyncConnection, organization_id: UUID, judges: dict[UUID, BlockingJudge | None]
) -> BlockingJudge | None:
    """The organization's fleet judge for this page, or None while a change of its fleet holds the capacity
    lock (the sweeper waits for no one's lock: its jobs are left for the next tick)."""
    if organization_id not in judges:
        judges[organization_id] = (await BlockingJudge.load(conn, organization_id)
                                   if await try_share_capacity(conn, organization_id) else None)  # fmt: skip
    return judges[organization_id]
