"""Group commit: agents' claims, renewals and completions share transactions.

Every job transition appends to the log under one advisory lock held to
commit (see :mod:`umbra.events.store`), so one transaction per transition caps
a server at one commit flush per transition. :class:`GroupCommit` is a
per-process batcher in front of those commands: a command queues up while the
previous batch runs, and the next free worker (:data:`WORKERS` of them) takes
everything queued as one batch, one transaction (:mod:`umbra.compute.batch_commands` runs it: each
command still loads, decides, appends to its own stream, folds and writes its
own row; the statements and the commit are shared).

* A refusal (fencing: not the holder, a stale attempt, a cancelled job) is
  decided before anything is written and answers only its own command.
* Anything else that fails the batch (a :class:`ConcurrencyConflict`, a
  deadlock, a string PostgreSQL cannot store) rolls the whole batch back, and
  its commands are then run one by one through the ordinary single-command
  functions of :mod:`umbra.compute.claims`, each in its own transaction, so
  each gets exactly the answer it would have had alone.

Hints are not sent from the batch transaction. ``NOTIFY`` takes a cluster-wide
lock at commit and holds it across the commit flush, so notifying transactions
cannot share a flush (``docs/PERFORMANCE.md`` has the measurements).
:class:`HintNotifier` merges the hints of committed batches and sends them from
one small transaction at a time, after the data they point at is visible.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from typing import Any, Callable, Iterable
from uuid import UUID

import anyio
import psycopg
from anyio.abc import TaskStatus
from psycopg_pool import AsyncConnectionPool

from umbra import metrics
from umbra.errors import DatabaseUnavailable
from umbra.events import store
from umbra.events.types import Progress
from umbra.projections.jobs import JobRow

from . import batch_commands, claims
from .auth import live_node_credentials, revoked
from .batch_commands import Command

log = logging.getLogger(__name__)

#: Most commands one batch carries; more wait for the next batch.
MAX_BATCH = 256
#: Batches in flight at once. The log's ordering lock serialises batches from their append to
#: their commit; a second batch reads, locks and decides while the first one writes, so Python
#: and PostgreSQL work at the same time instead of in turn. 16 HTTP agents taking ten jobs at a
#: time: 3,655-3,990 jobs/s against 3,279-3,720 with one worker (five interleaved pairs, every
#: pair won), once each batch's claimers read past the rows the other batch holds (see
#: claims.lock_first_of_shape). With one job per request the batches are small and a second
#: one made no difference to jobs/s (1,180-1,309 against 1,193-1,260), for ~15 % more server
#: CPU per job: hence :data:`OVERLAP_MIN_COMMANDS`.
WORKERS = 2
#: Commands queued for a second batch to start while one runs. Below it they wait for the running
#: batch to end and go in the next one (as with one worker): with one job per request, 16 agents
#: then drain as fast (1,319-1,419 against 1,303-1,370 jobs/s) in batches of 8.0 commands instead
#: of 5.2, for 0.48-0.50 ms of server CPU per job against 0.55-0.59.
OVERLAP_MIN_COMMANDS = 16

#: Shortest time between two hint transactions: a batch's hints wait at most this long
#: for the next batches' to go out with them. These hints only tell log readers (SSE
#: streams, dashboards) that the log moved; 20 ms keeps them live while one fast agent's
#: two commands per job share one hint transaction instead of paying one each (+25-35 %
#: jobs/s for a single in-process agent, measured).
MIN_TICK_SECONDS = 0.02

_NOTIFY = "SELECT pg_notify(%s, %s)"


class HintNotifier:
    """Coalesces log hints and sends them from one small transaction per tick.

    A tick starts as soon as a hint arrives, unless the previous one was less
    than ``min_interval`` ago; hints that arrive in between go out together, merged per
    organization (:func:`umbra.events.store.merge_hints`), as
    :func:`umbra.events.store.publish` merges them within a transaction.
    """

    def __init__(self, pool: AsyncConnectionPool, *, min_interval: float = MIN_TICK_SECONDS) -> None:
        self._pool = pool
        self._min_interval = min_interval
        self._pending: dict[UUID, list[int]] = {}
        self._ready = anyio.Event()
        #: Transactions sent, for benchmarks and tests.
        self.ticks = 0

    def hint(self, hints: Iterable[tuple[UUID, int, int]]) -> None:
        store.merge_hints(self._pending, hints)
        if self._pending:
            self._ready.set()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await self._ready.wait()
            self._ready = anyio.Event()
            pending, self._pending = self._pending, {}
            fitted = store.first_hint_payload(pending)
            if fitted is None:
                continue
            payload, rest = fitted
            if rest:  # more organizations than one payload names: the rest go in the next tick, not in a second one
                store.merge_hints(self._pending, ((org, position, claimable) for org, (position, claimable) in rest.items()))
                self._ready.set()
            try:
                async with self._pool.connection() as conn:
                    await conn.execute(_NOTIFY, (store.LOG_CHANNEL, payload))
                self.ticks += 1
            except Exception as exc:  # hints are hints: listeners also poll
                log.warning("hints not sent", extra={"action": "hints_not_sent", "error": str(exc)[:200]})
            await anyio.sleep(self._min_interval)


#: How long the release of a broken batch's claims waits for a connection: the batch's worker waits
#: with it, and while the database is away those leases simply expire.
RELEASE_WAIT_SECONDS = 1.0


class GroupCommit:
    """The per-process batcher. Start :meth:`run` in the server's task group, then call the commands."""

    def __init__(self, pool: AsyncConnectionPool, notifier: HintNotifier, *, workers: int = WORKERS,
                 max_batch: int = MAX_BATCH, affinity_seconds: int = 0) -> None:  # fmt: skip
        self._pool = pool
        #: ``UMBRA_MODEL_AFFINITY_SECONDS``: how claims order the jobs they may take (``claims.claim_rank``).
        self._affinity_seconds = affinity_seconds
        self._notifier = notifier
        self._workers = workers
        self._max_batch = max_batch
        self._queue: deque[tuple[Command, anyio.Event]] = deque()
        self._ready = anyio.Event()
        #: Counters for benchmarks and tests: batches committed, commands in them, batches retried one by one.
        self.batches = 0
        self.commands = 0
        self.fallbacks = 0
        self._running = 0  # batches in flight
        #: Commands run alone beside the batches at once, each holding a pooled connection while it
        #: waits for a row held elsewhere: a quarter of the pool, so the batches always find one.
        self._beside_limit = anyio.CapacityLimiter(max(1, pool.max_size // 4))

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            self._beside = tg
            for _ in range(self._workers):
                tg.start_soon(self._worker)
            task_status.started()

    @property
    def queued(self) -> int:
        """Commands waiting for a batch."""
        return len(self._queue)

    @property
    def running(self) -> int:
        """Batches in flight."""
        return self._running

    # -- the commands (the same arguments and answers as umbra.compute.claims) ------------

    async def claim(self, *, node_id: UUID, organization_id: UUID, lease_seconds: int, stale_seconds: int,
                    empty: Any = None, busy: Any = None, later: Callable[[float], Any] | None = None,
                    credential_id: UUID | None = None, request_id: str | None = None,
                    kinds: frozenset[str] | None = None) -> Any:  # fmt: skip
        """A :class:`~umbra.compute.claims.ClaimResult`, or ``None`` when none this node may take.

        ``empty`` is answered instead of ``None`` when nothing but other
        claimers stood in the way: the organization had no claimable job, or
        every one this node could run was just taken. A long-poll then wakes
        nobody else for it; ``None`` means there is work this node cannot run.
        ``busy`` is answered when the claim took nothing because a change of
        its node or of the organization's registry, or another claim for the
        node holding its memory lock, was committing: looking again in a
        moment may find work, and no notification will say so. ``later(s)`` is
        answered when the claim took nothing but passed over jobs it leaves to
        nodes that hold their models (model affinity): in ``s`` seconds the
        first of them is this node's to take, and nothing will notify it.
        """
        claimed = await self.claim_many(node_id=node_id, organization_id=organization_id, count=1,
                                        lease_seconds=lease_seconds, stale_seconds=stale_seconds, empty=empty,
                                        busy=busy, later=later, credential_id=credential_id, request_id=request_id,
                                        kinds=kinds)  # fmt: skip
        return claimed[0] if isinstance(claimed, list) else claimed

    async def claim_many(self, *, node_id: UUID, organization_id: UUID, count: int, lease_seconds: int,
                         stale_seconds: int, empty: Any = None, busy: Any = None,
                         later: Callable[[float], Any] | None = None, credential_id: UUID | None = None,
                         request_id: str | None = None, kinds: frozenset[str] | None = None) -> Any:  # fmt: skip
        """Up to ``count`` jobs for one node in one claim: a non-empty list of
        :class:`~umbra.compute.claims.ClaimResult` in claim order, or ``None``
        (``empty`` when nothing but other claimers stood in the way, ``busy``
        when a change held the claim guard or another claim the node's memory lock,
        ``later(s)`` when it left jobs to nodes that hold their models), as :meth:`claim`."""
        command = Command("claim", organization_id, node_id, lease_seconds=lease_seconds, stale_seconds=stale_seconds,
                          credential_id=credential_id, count=count, request_id=request_id, kinds=kinds)  # fmt: skip
        await self._call(command)
        if command.claims:
            return list(command.claims)
        if command.nothing_left:
            return empty
        if command.guard_held:
            return busy
        if command.look_again_in is None:
            return None
        metrics.CLAIMS_LEFT_TO_HOLDERS.inc()
        return None if later is None else later(command.look_again_in)

    async def complete_many(self, *, organization_id: UUID, node_id: UUID, results: list[tuple[UUID, int, Any]],
                            claim_next: int = 0, lease_seconds: int = 60, stale_seconds: int = 45,
                            credential_id: UUID | None = None, request_id: str | None = None,
                            kinds: frozenset[str] | None = None) -> tuple[list[JobRow | BaseException], list[Any]]:  # fmt: skip
        """Several completions of one node, each its own command, and a claim of up to ``claim_next`` jobs.

        ``results`` holds (job id, attempt, result). Returns each completion's
        row or its refusal (in order), and the jobs claimed. The commands are
        queued together and the claim goes in its completions' batch. It is
        made whatever their answers (the agent's slots are free either way),
        with two exceptions (see ``Command.reporting``):

        - a report one of whose results repeats a recorded completion (the
          report sent again, its answer lost) claims nothing new: it is
          answered with the jobs its first request claimed, those still
          leased to the node untouched (:func:`umbra.compute.claims.claimed_with_report`).
          A new claim would leave those to wait out their leases, an attempt
          spent each;
        - a report one of whose completions ran alone (its row held by another
          transaction, or its batch rolled back) claims nothing: a claim of
          its own transaction could not be named by the report's events, so it
          could not be answered again. The agent long-polls as usual.
        """
        completions = [Command("complete", organization_id, node_id, job_id, attempt, result=result,
                               credential_id=credential_id, request_id=request_id)
                       for job_id, attempt, result in results]  # fmt: skip
        follow = Command("claim", organization_id, node_id, lease_seconds=lease_seconds, stale_seconds=stale_seconds,
                         credential_id=credential_id, count=claim_next, request_id=request_id, kinds=kinds,
                         reporting=tuple(completions)) if claim_next else None  # fmt: skip
        done = [self._enqueue(command) for command in (*completions, *([follow] if follow else []))]
        for event in done:
            if not event.is_set():  # a set anyio Event's wait() still yields to the loop: ten times per report
                await event.wait()
        answers = [c.error if c.error is not None else c.outcome for c in completions]
        if follow is None or follow.error is not None:
            return answers, []
        repeated = [c.outcome for c in completions if c.repeated]
        if repeated:  # answered with the claims of the first request: counted then
            async with self._pool.connection() as conn:
                return answers, await claims.claimed_with_report(conn, repeated, node_id)
        metrics.CLAIMS.labels(trigger="completion").inc(len(follow.claims))
        return answers, list(follow.claims)

    async def renew(self, *, organization_id: UUID, node_id: UUID, job_id: UUID, attempt: int, lease_seconds: int,
                    credential_id: UUID | None = None, request_id: str | None = None,
                    progress: Progress | None = None) -> JobRow:  # fmt: skip
        return await self._call(Command("renew", organization_id, node_id, job_id, attempt, lease_seconds=lease_seconds,
                                        credential_id=credential_id, request_id=request_id, progress=progress))  # fmt: skip

    async def complete(self, *, organization_id: UUID, node_id: UUID, job_id: UUID, attempt: int, result: Any,
                       credential_id: UUID | None = None, request_id: str | None = None) -> JobRow:  # fmt: skip
        """Complete a held job.

        A completion sent again without ``claim_next`` whose first request asked for the node's next job
        (its answer lost, and its agent now stopping, so it asks for none) gives that job back
        (``job.released``, not charged) while the claim stands untouched: its agent will never run it, and
        it waited out its lease, an attempt spent, and failed unrun when that was its last.
        """
        command = Command("complete", organization_id, node_id, job_id, attempt, result=result,
                          credential_id=credential_id, request_id=request_id)  # fmt: skip
        row = await self._call(command)
        if command.repeated:
            async with self._pool.connection() as conn:
                unheard = await claims.claimed_with(conn, row, node_id)
                if unheard is not None:
                    await claims.release(conn, unheard.row.id, node_id, unheard.row.attempt, request_id=request_id,
                                         claimed_at=unheard.row.updated_at, reason="not_asked_again")  # fmt: skip
        return row

    async def complete_and_claim(self, *, organization_id: UUID, node_id: UUID, job_id: UUID, attempt: int,
                                 result: Any, lease_seconds: int, stale_seconds: int,
                                 credential_id: UUID | None = None, request_id: str | None = None,
                                 kinds: frozenset[str] | None = None) -> tuple[JobRow, Any]:  # fmt: skip
        """Complete a held job and claim the node's next one in the same transaction.

        Returns the completed row and a :class:`~umbra.compute.claims.ClaimResult`, or ``None``
        when nothing this node may take is queued (the claim never waits). The claim is made only
        if the completion is accepted: a refused completion raises as :meth:`complete` does and
        claims nothing. A completion sent again (its answer lost) claims nothing either: it is
        answered with the job its first request claimed, while that claim stands untouched
        (:func:`umbra.compute.claims.claimed_with`), else ``None``. Nor does one that could not go
        in a batch (its row held elsewhere, or the batch rolled back): see :meth:`_run_beside`. An agent that reports a job
        and asks for the next one in one request costs one transaction, one commit flush and one
        request per job instead of two.
        """
        follow = Command("claim", organization_id, node_id, lease_seconds=lease_seconds, stale_seconds=stale_seconds,
                         credential_id=credential_id, request_id=request_id, kinds=kinds)  # fmt: skip
        completion = Command("complete", organization_id, node_id, job_id, attempt, result=result,
                             credential_id=credential_id, then=follow, request_id=request_id)  # fmt: skip
        row = await self._call(completion)
        if completion.repeated:  # answered with the claim of the first request: counted then
            async with self._pool.connection() as conn:
                return row, await claims.claimed_with(conn, row, node_id)
        claimed = follow.outcome if follow.error is None else None
        if claimed is not None:
            metrics.CLAIMS.labels(trigger="completion").inc()
        return row, claimed

    def _enqueue(self, command: Command) -> anyio.Event:
        command.asked_at = time.monotonic()
        if command.then is not None:
            command.then.asked_at = command.asked_at
        done = anyio.Event()
        self._queue.append((command, done))
        self._ready.set()
        return done

    async def _call(self, command: Command) -> Any:
        await self._enqueue(command).wait()
        if command.error is not None:
            raise command.error
        return command.outcome

    # -- batches ------------------------------------------------------------------------------

    async def _worker(self) -> None:
        while True:
            # While another batch runs, a second one starts only for a queue worth overlapping:
            # a few commands would wait less for the running batch than they cost as a batch.
            while not self._queue or (self._running and len(self._queue) < OVERLAP_MIN_COMMANDS):
                if self._ready.is_set():
                    self._ready = anyio.Event()
                await self._ready.wait()
            batch = [self._queue.popleft() for _ in range(min(self._max_batch, len(self._queue)))]
            self._rest_of_report(batch)
            self._running += 1
            try:
                with anyio.CancelScope(shield=True):
                    deferred = await self._execute(batch)
            finally:
                self._running -= 1
            for item in batch:
                if item in deferred:
                    self._queue.append(item)
                    self._ready.set()
                elif item[0].locked_elsewhere:
                    self._beside.start_soon(self._run_beside, item)
                else:
                    item[1].set()

    def _rest_of_report(self, batch: list[tuple[Command, anyio.Event]]) -> None:
        """Take into ``batch`` the rest of a report (``complete_many``) the batch size cut in two.

        A report's claim must be made in its completions' batch: the first of them recorded names the
        jobs it took (``next_claims``), so the report sent again is answered with them, and the claim is
        not made when one of them ran alone (``Command.reporting``). A report's commands are queued
        together, its claim last: when the batch ends on a completion, the queue's head up to the first
        command that is not a completion is the rest of that completion's report if that command is the
        report's claim.
        """
        last = batch[-1][0] if batch else None
        if last is None or last.kind != "complete":
            return
        for index, (command, _) in enumerate(self._queue):
            if command.kind != "complete":
                if any(reported is last for reported in command.reporting):
                    batch.extend(self._queue.popleft() for _ in range(index + 1))
                return

    async def _run_beside(self, item: tuple[Command, anyio.Event]) -> None:
        """A command whose row another transaction holds, run alone while the batches go on: it waits for
        that lock (for at most the pool's ``lock_timeout``, then fails ``database_unavailable``).

        A completion run alone (here, or in a batch that rolled back) makes no chained claim: the claim
        would be a transaction of its own, which its completion's event could not name, so the same
        request sent again could not be answered with it (``claims.claimed_with``) and the job would
        wait out its lease. ``next_claim`` is then ``null``, and the agent long-polls as usual.
        """
        command, done = item
        command.locked_elsewhere = False
        try:
            async with self._beside_limit:
                with anyio.CancelScope(shield=True):  # as a batch: a command is answered once it is done
                    await self._alone(command)
        finally:
            done.set()

    async def _execute(self, batch: list[tuple[Command, anyio.Event]]) -> list[tuple[Command, anyio.Event]]:
        commands = [command for command, _ in batch]
        started = time.perf_counter()
        connection: psycopg.AsyncConnection | None = None
        staged: list = []
        try:
            # Not in pipeline mode: it saved a few round trips per batch but cost more
            # client CPU than it saved, and on the agent path the server's CPU is the limit
            # (docs/PERFORMANCE.md).
            async with self._pool.connection() as conn:
                connection = conn
                try:
                    staged, deferred = await batch_commands.stage(conn, commands, affinity_seconds=self._affinity_seconds)  # sends BEGIN
                    hints = await batch_commands.write(conn, staged)  # sends COMMIT
                except BaseException:
                    if not conn.broken:
                        await conn.rollback()
                    raise
        except Exception as exc:
            if connection is None or connection.broken:
                self._database_away(commands, exc)
                await self._release_claims_if_committed(staged)
                return []
            log.warning("batch rolled back; its commands run one by one",
                        extra={"action": "group_commit_fallback", "commands": len(commands), "error": str(exc)[:200]})  # fmt: skip
            self.fallbacks += 1
            metrics.GROUP_COMMIT_FALLBACKS.inc()
            for command in commands:
                for each in (command, command.then):
                    if each is not None:
                        each.outcome, each.error, each.nothing_left, each.guard_held = None, None, False, False
                        each.repeated = each.locked_elsewhere = False
                        each.look_again_in = None
                        each.claims.clear()
                if not command.reporting:  # a completion alone claims nothing (see _run_beside), a report neither
                    await self._alone(command)
            return []
        batch_commands.answer(staged)
        answered = len(commands) - len(deferred) - sum(c.locked_elsewhere for c in commands)
        self.batches += 1
        self.commands += answered
        metrics.GROUP_COMMIT_BATCH_SECONDS.observe(time.perf_counter() - started)
        metrics.GROUP_COMMIT_BATCH_COMMANDS.observe(answered)
        self._notifier.hint(hints)
        return [item for item in batch if item[0] in deferred]

    def _database_away(self, commands: list[Command], exc: Exception) -> None:
        """No connection came in time, or the batch's died under it: every command fails with
        ``database_unavailable`` (answered 503, try again).

        Running them one by one, as for a batch that rolled back, would wait as long again per
        command while the database is away (and hold a stopping server that long). And a batch whose
        connection died during its ``COMMIT`` may have committed: run again, its claims could take
        a second job each, leased to agents that never hear of them.
        """
        log.warning("database unavailable; the batch's commands fail", extra={"action": "group_commit_database_away",
                    "commands": len(commands), "error": type(exc).__name__})  # fmt: skip
        for command in commands:
            for each in (command, command.then):
                if each is not None:
                    # One error each: one exception raised in every request's task would grow its traceback.
                    each.outcome, each.error = None, DatabaseUnavailable()
                    each.locked_elsewhere = False
                    each.claims.clear()

    async def _release_claims_if_committed(self, staged: list) -> None:
        """The batch's connection broke while it wrote: its ``COMMIT`` may have landed. Its claimers are
        answered an error, so a claim that did commit would hold its job, leased to an agent that never
        heard of it, until the lease ran out: each is released (``job.released``, as for a long-poll
        whose client left). A claim that did not commit is not found running under that attempt, and
        nothing is written for it. Repeated completions are answered as such
        (:func:`umbra.domain.jobs.repeats_completion`), so those commands can simply be sent again.
        """
        taken = [(s.command, s.state.id, s.event.attempt, s.at) for s in staged if s.command.kind == "claim"]
        if not taken:
            return
        try:
            # A claim of this batch is known by its time (the transaction's clock, every event's and row's
            # `updated_at`): if the batch did not commit, the same node may have taken the job at the same
            # attempt elsewhere (another process, another slot), and that claim was answered.
            async with self._pool.connection(timeout=RELEASE_WAIT_SECONDS) as conn:
                for command, job_id, attempt, at in taken:
                    await claims.release(conn, job_id, command.node_id, attempt, request_id=command.request_id, claimed_at=at)
        except Exception as exc:  # the database is still away: those leases expire as any unheard claim's
            log.warning("claims of a broken batch not released", extra={"action": "group_commit_release_failed",
                        "claims": len(taken), "error": type(exc).__name__})  # fmt: skip

    async def _alone(self, command: Command) -> None:
        """Run one command in its own transaction through the single-command path."""
        try:
            async with self._pool.connection() as conn:
                if command.credential_id is not None:
                    if not await live_node_credentials(conn, [command.credential_id]):
                        raise revoked()
                if command.kind == "claim":
                    while len(command.claims) < command.count:
                        try:
                            claimed = await claims.claim(
                                conn, node_id=command.node_id, organization_id=command.organization_id,
                                lease_seconds=command.lease_seconds, stale_seconds=command.stale_seconds,
                                request_id=command.request_id, kinds=command.kinds,
                                affinity_seconds=self._affinity_seconds,
                            )  # fmt: skip
                        except Exception:
                            if not command.claims:
                                raise
                            # The jobs claimed so far are committed: answered, not turned into an
                            # error that would leave them leased to an agent that never hears of them.
                            log.warning("claim stopped short", exc_info=True,
                                        extra={"action": "claim_short", "claimed": len(command.claims)})  # fmt: skip
                            break
                        if claimed is None:
                            break
                        command.claims.append(dataclasses.replace(claimed, asked_at=command.asked_at))
                    command.outcome = command.claims[0] if command.claims else None
                elif command.kind == "renew":
                    command.outcome = await claims.renew(
                        conn, organization_id=command.organization_id, node_id=command.node_id,
                        job_id=command.job_id, attempt=command.attempt, lease_seconds=command.lease_seconds,
                        request_id=command.request_id, progress=command.progress,
                    )  # fmt: skip
                else:
                    command.outcome, recorded = await claims.record_completion(
                        conn, organization_id=command.organization_id, node_id=command.node_id,
                        job_id=command.job_id, attempt=command.attempt, result=command.result,
                        request_id=command.request_id,
                    )  # fmt: skip
                    command.repeated = not recorded
        except Exception as exc:
            command.error = exc
