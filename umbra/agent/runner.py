"""The agent loop: heartbeat, long-poll for a job, run it, repeat.

Two tasks share one HTTP client. The heartbeat task reports the devices every
interval (the server's, when it names one) with the process start time, so the
server sees a restart as a restart. The work task polls ``claim?wait=30``; an
error backs off exponentially with jitter so a fleet does not return in step
after an outage. A claimed job is run by :class:`~umbra.agent.jobrun.JobRun`
(handler, lease renewal, report); ``concurrency`` work loops run that many
jobs at once (one by default). A completion claims the loop's next job in the
same request, so a busy agent long-polls only when the queue has nothing left
for it.

Stopping (SIGTERM/SIGINT/SIGHUP, or the node being retired): polling stops at
once (a long-poll abandoned mid-wait claims nothing); the current job gets
``grace_seconds`` to finish and is reported as usual; past that it is cancelled
and given back, so another node picks it up at once. A credential the server
rejects (401) stops the agent at once with that error: retrying cannot fix it.
Nor can it fix a heartbeat or a claim the server refuses for what it says (422
devices it does not accept, 403 a credential without the scope): the agent
stops as for a signal, then ends with that error, instead of being refused
every few seconds for as long as it runs.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable, Iterator, Sequence

import anyio
import httpx
import psutil

from umbra.events.types import Device

from .client import AgentClient, Claim, ServiceError, claim_kinds
from .devices import steady
from .handlers import HandlerRegistry
from .jobrun import JobRun, Outcome, backoff_delay, describe, give_back_unread, refused_for_good, retry_delay

log = logging.getLogger(__name__)

#: Shortest time between two claim requests of a slot that found nothing.
MIN_POLL_SECONDS = 1.0

__all__ = ["Agent", "AgentConfig", "Outcome", "backoff_delay"]


def answer_maybe_unread(error: Exception | None) -> bool:
    """Whether a claim request that failed with ``error`` may have claimed a job the agent did not hear of.

    Not when it never reached the server (no connection) or the server refused it (4xx: nothing
    claimed); yes when the answer was cut off or timed out, or a proxy answered 5xx in its place.
    """
    if isinstance(error, ServiceError):
        return error.status >= 500
    return isinstance(error, httpx.HTTPError) and not isinstance(error, (httpx.ConnectError, httpx.ConnectTimeout,
                                                                         httpx.PoolTimeout))  # fmt: skip


#: How many finished jobs' outcomes an agent keeps (:attr:`Agent.outcomes`).
OUTCOMES_KEPT = 100

#: How long a stopping agent lets a heartbeat already on its way finish before it signs off.
LAST_BEAT_SECONDS = 5.0


@dataclass(frozen=True)
class AgentConfig:
    """How the agent paces itself. ``umbra agent`` range-checks its flags; these checks only refuse what
    would break the loops (a heartbeat period of zero retries a failing server without pause)."""

    agent_version: str
    #: Heartbeat period until the server names one in its answer.
    heartbeat_seconds: float = 10.0
    #: Long-poll length asked of the server (API.md: 0..60).
    claim_wait_seconds: float = 30.0
    #: How long a running job may continue after a stop request.
    grace_seconds: float = 30.0
    #: Error back-off: ``base × 2^(failures−1)`` capped, then jittered.
    backoff_base_seconds: float = 0.5
    backoff_cap_seconds: float = 30.0
    #: Jobs run at once: one work loop each (claim, run, report, chain to the next).
    concurrency: int = 1
    #: How soon what a handler says of its progress is sent (with a renewal of the lease, sooner than the
    #: renewal was due), and so how often at most a job that keeps saying it renews.
    progress_seconds: float = 5.0

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_seconds < float("inf"):  # NaN fails every comparison
            raise ValueError(f"heartbeat_seconds must be a positive number of seconds, not {self.heartbeat_seconds!r}")
        if not 0 < self.progress_seconds < float("inf"):
            raise ValueError(f"progress_seconds must be a positive number of seconds, not {self.progress_seconds!r}")
        if not self.grace_seconds >= 0:
            raise ValueError(f"grace_seconds must be zero or more seconds, not {self.grace_seconds!r}")


def process_start_time() -> datetime:
    return datetime.fromtimestamp(psutil.Process().create_time(), tz=timezone.utc)


class Agent:
    def __init__(
        self,
        client: AgentClient,
        registry: HandlerRegistry,
        devices: Callable[[], Sequence[Device]],
        config: AgentConfig,
    ) -> None:
        self.client = client
        self.registry = registry
        #: The kinds its claims and heartbeats name (empty: every kind).
        self.kinds = claim_kinds(registry.kinds)
        self.config = config
        self.started_at = process_start_time()
        #: The last :data:`OUTCOMES_KEPT` jobs' outcomes (for logs and tests): each holds its Job, payload and
        #: result, and an agent runs for months.
        self.outcomes: list[Outcome] = []
        self.node_status: str | None = None
        self._devices = devices
        self._reported: list[Device] | None = None
        self._heartbeat_seconds = config.heartbeat_seconds
        self._online = anyio.Event()
        self._stopping = anyio.Event()
        self._work_done = anyio.Event()
        self._leave_now = False
        self._beats: anyio.CancelScope | None = None
        self._poll_scopes: set[anyio.CancelScope] = set()
        self._current: set[JobRun] = set()
        self._fatal: ServiceError | None = None

    # -- control ---------------------------------------------------------------

    def stop(self, *, immediately: bool = False) -> None:
        """Stop polling; let the running jobs run for the grace period (or not: then leave without waiting
        for a last heartbeat or signing off)."""
        self._stopping.set()
        if immediately:
            self._leave_now = True
            if self._work_done.is_set() and self._beats is not None:
                self._beats.cancel()
        for scope in self._poll_scopes:
            scope.cancel()
        for run in self._current:
            run.stop(0.0 if immediately else self.config.grace_seconds)

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    async def run(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        """Run until stopped. Raises :class:`ServiceError` if the credential is rejected."""
        async with anyio.create_task_group() as tg:
            self._beats = tg.cancel_scope
            tg.start_soon(self._heartbeat_loop)
            task_status.started()
            async with anyio.create_task_group() as work:
                for _ in range(max(1, self.config.concurrency)):
                    work.start_soon(self._work_loop)
            # A beat already on its way finishes first (for a few seconds at most): one the server
            # handled after the sign-off would bring the node back online until it went stale.
            self._work_done.set()
            if self._fatal is not None or self.node_status == "retired" or self._leave_now:
                tg.cancel_scope.cancel()
            else:
                tg.cancel_scope.deadline = anyio.current_time() + LAST_BEAT_SECONDS
        if self.node_status != "retired" and not self._leave_now:
            await self._sign_off()
        if self._fatal is not None:
            raise self._fatal

    async def _sign_off(self) -> None:
        """Tell the server this agent is stopping, so the node reads offline now, not after 45 s of silence.

        Best effort: a server that cannot be reached learns it from the silence.
        """
        with anyio.CancelScope(shield=True):
            try:
                await self.client.sign_off()
            except (ServiceError, httpx.HTTPError) as exc:
                log.warning("could not sign off", extra={"action": "agent_sign_off_failed", "error": type(exc).__name__})

    def _reject(self, exc: ServiceError) -> None:
        log.error("credential rejected; stopping", extra={"action": "agent_unauthenticated", "code": exc.code})
        self._fatal = exc
        self.stop(immediately=True)

    def _refused(self, exc: ServiceError, what: str) -> None:
        """The server refuses this agent's heartbeat or claim for what it says: stop as for a signal
        (running jobs get the grace period, the node signs off), then end with the server's error.

        Sent again, it is refused the same way for as long as the agent runs: the node never comes
        online (or goes stale), or never gets work, while the process looks healthy, and only a log
        line says why.
        """
        log.error(f"{what} refused; stopping", extra={"action": f"{what}_refused", "code": exc.code,
                                                      "status": exc.status, "reason": exc.message})
        self._fatal = exc
        self.stop()

    async def _pause(self, seconds: float) -> None:
        """Sleep, waking early when the agent is asked to stop."""
        with anyio.move_on_after(seconds):
            await self._stopping.wait()

    # -- heartbeat -------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        failures = 0
        while not self._work_done.is_set():
            try:
                await self.heartbeat()
                failures = 0
            except ServiceError as exc:
                if exc.status == 401:
                    self._reject(exc)
                    return
                if refused_for_good(exc):  # 422 devices the server does not accept, 403, 404 a removed node
                    self._refused(exc, "heartbeat")
                    return
                failures += 1
                log.warning("heartbeat refused", extra={"action": "heartbeat_failed", "code": exc.code})
            except httpx.HTTPError as exc:
                failures += 1
                log.warning("heartbeat failed", extra={"action": "heartbeat_failed", "error": type(exc).__name__})
            # Read after the beat: the interval its answer named applies from this wait on (the first
            # wait at --heartbeat, up to 300 s, would leave a node the server wants every 10 s stale).
            delay = self._heartbeat_seconds
            if failures:
                delay = min(delay, backoff_delay(failures, self.config.backoff_base_seconds, self.config.backoff_cap_seconds))
            with anyio.move_on_after(delay):
                await self._work_done.wait()

    async def heartbeat(self) -> dict[str, Any]:
        # Off the event loop: discovery runs nvidia-smi, which may take seconds, and renewals must not wait.
        devices = steady(self._reported, await anyio.to_thread.run_sync(self._devices))
        answer = await self.client.heartbeat(
            devices=devices, agent_version=self.config.agent_version, agent_started_at=self.started_at,
            kinds=self.kinds,
        )
        self._reported = devices
        interval = answer.get("heartbeat_interval_seconds")
        if isinstance(interval, (int, float)) and interval > 0:
            self._heartbeat_seconds = float(interval)
        self.node_status = answer.get("status")
        self._online.set()
        if self.node_status == "retired" and not self.stopping:
            log.info("node retired; stopping", extra={"action": "agent_node_retired"})
            self.stop()
        return answer

    # -- work --------------------------------------------------------------------

    async def _work_loop(self) -> None:
        """One slot: long-poll, run the job, report it (claiming the next), until stopped."""
        with self._poll_scope():
            await self._online.wait()
        failures = 0
        while not self.stopping:
            claim: Claim | None = None
            error: Exception | None = None
            asked = anyio.current_time()
            request_id = uuid.uuid4().hex
            with self._poll_scope() as scope:
                try:
                    claim = await self.client.claim(self.config.claim_wait_seconds, kinds=self.kinds, request_id=request_id)
                except ServiceError as exc:
                    if exc.status == 401:
                        self._reject(exc)
                        break
                    if refused_for_good(exc):  # a credential without compute:claim, say
                        self._refused(exc, "claim")
                        break
                    error = exc
                except httpx.HTTPError as exc:
                    error = exc
            if scope.cancelled_caught or answer_maybe_unread(error):
                await self._release_unread(request_id)
            if claim is not None:
                failures = 0
                while claim is not None:  # each completion may bring the next job
                    claim = (await self.execute(claim)).next_claim
            elif error is not None:
                failures += 1
                delay = retry_delay(error, failures, self.config.backoff_base_seconds, self.config.backoff_cap_seconds)
                log.warning("claim failed; backing off", extra={"action": "claim_failed", "error": describe(error), "delay_s": round(delay, 2)})
                await self._pause(delay)
            else:
                failures = 0
                # Nothing to do, answered at once (a short --claim-wait): poll again no sooner than
                # MIN_POLL_SECONDS after asking, not in a tight loop.
                await self._pause(MIN_POLL_SECONDS - (anyio.current_time() - asked))

    async def _release_unread(self, request_id: str) -> None:
        """Give back whatever the claim request sent as ``request_id`` took, its answer never read.

        A stop cancels a parked long-poll; an answer can be cut off or time out. If the server had
        already claimed a job and sent it, the agent never runs it, and without this the job would
        wait out its lease (the server releases a claim itself only when the client left before the
        answer was sent). Not on a second signal: the agent leaves at once.
        """
        if not self._leave_now:
            await give_back_unread(self.client, request_id)

    @contextlib.contextmanager
    def _poll_scope(self) -> Iterator[anyio.CancelScope]:
        """A cancel scope that :meth:`stop` cancels while this slot waits for work."""
        with anyio.CancelScope() as scope:
            if self.stopping:
                scope.cancel()
            self._poll_scopes.add(scope)
            try:
                yield scope
            finally:
                self._poll_scopes.discard(scope)

    async def execute(self, claim: Claim) -> Outcome:
        """Run one claimed job to a reported outcome.

        An error the run did not expect (a bug, or a report that could not even be sent) ends that
        job alone, as "unreported": it waits out its lease, and the agent goes on with its other jobs.
        """
        log.info("job claimed", extra={"action": "job_claimed", "job_id": claim.job_id, "kind": claim.kind, "attempt": claim.attempt})
        config = self.config
        run = JobRun(self.client, self.registry, claim, on_rejected=self._reject,
                     backoff=(config.backoff_base_seconds, config.backoff_cap_seconds),
                     claim_next=lambda: not self.stopping, kinds=self.kinds,
                     progress_seconds=config.progress_seconds)  # fmt: skip
        if self.stopping:
            run.stop(config.grace_seconds)
        self._current.add(run)
        try:
            outcome = await run.run()
        except Exception as exc:  # noqa: BLE001 - one job's mishap must not end the agent and its other jobs
            log.exception("job run failed unexpectedly; the job waits out its lease", extra={
                "action": "job_run_crashed", "job_id": claim.job_id, "error": type(exc).__name__})
            outcome = Outcome(claim.job_id, claim.kind, "unreported", type(exc).__name__)
        finally:
            self._current.discard(run)
        self.outcomes.append(outcome)
        del self.outcomes[:-OUTCOMES_KEPT]
        log.info("job finished", extra={"action": "job_finished", "job_id": claim.job_id, "outcome": outcome.status})
        if not self.stopping:
            with self._poll_scope():  # a stop need not wait for it: the process exits
                if await self.registry.returned(claim):
                    log.info("handler thread returned after its job ended", extra={"action": "handler_returned", "job_id": claim.job_id})
        return outcome
