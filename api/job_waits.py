"""Waiting for a job to end: ``GET /v1/jobs/{id}?wait=S``, with no database connection per waiter.

A submitter that wants a job's result (an inference request behind a web
page) would otherwise poll the job. :class:`JobWaits` parks such requests in
memory, keyed by organization and job. The process's one LISTEN connection
says which organizations' logs moved (:meth:`JobWaits.on_hint`); the hub's
task then asks, in one query for every organization that moved, which of
their waited-for jobs have ended, and wakes those waiters alone. The cost is
one query per round for the organizations with waiters whose logs moved, not
one per waiter per hint: a thousand requests waiting on a busy organization's
jobs cost one indexed read of a thousand ids every :data:`MIN_ROUND_SECONDS`
at most.

Nothing is missed: a new waiter marks its organization as moved, so the job
is looked at once the waiter is registered (a job that ended between the
route's read and the registration is seen then); a reconnect of the listener
marks every organization; and every ``poll_seconds`` every organization with
waiters is looked at, for hints that never came.
"""

from __future__ import annotations

import logging
import time
from uuid import UUID

import anyio
from anyio.abc import TaskStatus
from psycopg_pool import AsyncConnectionPool

from umbra import jitter, metrics
from umbra.events.types import TERMINAL_JOB_STATUSES

log = logging.getLogger(__name__)

#: Shortest time between two rounds: the hints that arrive in between are answered together.
MIN_ROUND_SECONDS = 0.02

#: Of the jobs named, those that ended.
_ENDED = "SELECT id FROM jobs WHERE id = ANY(%s) AND status = ANY(%s)"
_TERMINAL = sorted(TERMINAL_JOB_STATUSES)


class JobWaits:
    """The process's parked ``?wait=`` reads of jobs. Start :meth:`run`; routes call :meth:`until_ended`."""

    def __init__(self, *, poll_seconds: float) -> None:
        self._poll_seconds = poll_seconds
        #: organization -> job -> the events of the requests waiting for it
        self._waiting: dict[UUID, dict[UUID, list[anyio.Event]]] = {}
        self._moved: set[UUID] = set()
        self._ready = anyio.Event()
        self.stopped = False

    def waiting(self) -> int:
        """Requests parked on this process."""
        return sum(len(events) for jobs in self._waiting.values() for events in jobs.values())

    async def until_ended(self, organization_id: UUID, job_id: UUID, timeout: float) -> None:
        """Return once the job has ended, ``timeout`` seconds have passed, or the server is stopping; the
        caller then reads the job (it may have ended a moment after)."""
        if self.stopped:
            return
        ended = anyio.Event()
        self._waiting.setdefault(organization_id, {}).setdefault(job_id, []).append(ended)
        self._mark(organization_id)  # looked at once registered: it may have ended since the caller read it
        metrics.JOB_READS_WAITING.inc()
        try:
            with anyio.move_on_after(timeout):
                await ended.wait()
        finally:
            metrics.JOB_READS_WAITING.dec()
            self._leave(organization_id, job_id, ended)

    def on_hint(self, organization_id: UUID, position: int, claimable: int) -> None:
        if organization_id in self._waiting:
            self._mark(organization_id)

    def on_reconnect(self) -> None:
        """Hints may have been lost: every organization with waiters is looked at."""
        for organization_id in self._waiting:
            self._mark(organization_id)

    def stop(self) -> None:
        """The server is stopping: every waiter answers now, with the job as it is."""
        self.stopped = True
        for jobs in self._waiting.values():
            for events in jobs.values():
                for event in events:
                    event.set()

    async def run(self, pool: AsyncConnectionPool, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Answer the waiters whose jobs ended, a round each time organizations with waiters move."""
        task_status.started()
        next_poll = time.monotonic() + jitter.uniform(0.8, 1.2) * self._poll_seconds
        while True:
            with anyio.move_on_after(max(0.0, next_poll - time.monotonic())):
                await self._ready.wait()
            self._ready = anyio.Event()
            if time.monotonic() >= next_poll:  # every organization with waiters, however busy the others
                moved, self._moved = set(self._waiting), set()
                next_poll = time.monotonic() + jitter.uniform(0.8, 1.2) * self._poll_seconds
            else:
                moved, self._moved = self._moved, set()
            jobs = [job_id for organization_id in moved for job_id in self._waiting.get(organization_id, ())]
            if jobs:
                try:
                    async with pool.connection() as conn:
                        ended = await (await conn.execute(_ENDED, (jobs, _TERMINAL))).fetchall()
                except Exception as exc:  # a lost round: the next hint or poll looks again
                    log.warning("job waits not checked", extra={"action": "job_waits_unchecked", "error": str(exc)[:200]})
                    self._moved |= moved
                    await anyio.sleep(MIN_ROUND_SECONDS)
                    continue
                self._wake({job_id for (job_id,) in ended}, moved)
            await anyio.sleep(MIN_ROUND_SECONDS)

    def _wake(self, ended: set[UUID], organizations: set[UUID]) -> None:
        for organization_id in organizations:
            for job_id, events in self._waiting.get(organization_id, {}).items():
                if job_id in ended:
                    for event in events:
                        event.set()

    def _mark(self, organization_id: UUID) -> None:
        self._moved.add(organization_id)
        self._ready.set()

    def _leave(self, organization_id: UUID, job_id: UUID, ended: anyio.Event) -> None:
        jobs = self._waiting[organization_id]
        events = jobs[job_id]
        events.remove(ended)
        if not events:
            del jobs[job_id]
            if not jobs:
                del self._waiting[organization_id]
