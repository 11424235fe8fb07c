"""The agent loop: heartbeat, long-poll for a job, run it while renewing, report.

Two tasks share one HTTP client. The heartbeat task reports the devices every
interval (the server's, when it names one) with the process start time, so the
server sees a restart as a restart. The work task polls ``claim?wait=30``; an
error backs off exponentially with jitter so a fleet does not return in step
after an outage. A claimed job runs with a renewal task beside it (every third
of the lease); if the server says the job is no longer ours (cancelled, or the
lease was lost and the job re-claimed) the handler is cancelled and nothing is
reported, because the server would refuse it anyway.

Stopping (SIGTERM/SIGINT, or the node being retired): polling stops at once
(a long-poll abandoned mid-wait claims nothing); the current job gets
``grace_seconds`` to finish and is reported as usual; past that it is cancelled
and failed as retryable so another node picks it up. A credential the server
rejects (401) stops the agent with that error: retrying cannot fix it.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable, Sequence

import anyio
import httpx
import msgspec
import psutil

from umbra.events.types import Device

from .client import AgentClient, Claim, ServiceError
from .devices import steady
from .handlers import Decompose, HandlerRegistry, is_retryable

log = logging.getLogger(__name__)

#: Server answers meaning "this job is no longer yours": stop, report nothing.
LOST_CODES = frozenset({"job_cancelled", "job_not_claimed_by_this_node", "job_not_found", "not_found"})


@dataclass(frozen=True)
class AgentConfig:
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


def backoff_delay(failures: int, base: float, cap: float, rng: random.Random | None = None) -> float:
    """Delay before retry number ``failures`` (≥ 1): half fixed, half random.

    The random half spreads a fleet's retries; the fixed half keeps any single
    agent from hammering a server that is down.
    """
    ceiling = min(cap, base * 2 ** max(0, failures - 1))
    return ceiling / 2 + (rng or random).uniform(0, ceiling / 2)


def process_start_time() -> datetime:
    return datetime.fromtimestamp(psutil.Process().create_time(), tz=timezone.utc)


@dataclass(frozen=True)
class Outcome:
    """What happened to one job on this agent (kept for logs and tests)."""

    job_id: str
    kind: str
    status: str  # "complete", "failed", "retrying", "decomposed", "lost", "unreported"
    detail: Any = None


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
        self.config = config
        self.started_at = process_start_time()
        self.outcomes: list[Outcome] = []
        self.node_status: str | None = None
        self._devices = devices
        self._reported: list[Device] | None = None
        self._heartbeat_seconds = config.heartbeat_seconds
        self._online = anyio.Event()
        self._stopping = anyio.Event()
        self._poll_scope: anyio.CancelScope | None = None
        self._work_scope: anyio.CancelScope | None = None
        self._fatal: ServiceError | None = None

    # -- control ---------------------------------------------------------------

    def stop(self, *, immediately: bool = False) -> None:
        """Stop polling; let the current job run for the grace period (or not)."""
        first = not self._stopping.is_set()
        self._stopping.set()
        if self._poll_scope is not None:
            self._poll_scope.cancel()
        if self._work_scope is not None:
            grace = 0.0 if immediately else self.config.grace_seconds
            deadline = anyio.current_time() + grace
            if first or immediately:
                self._work_scope.deadline = min(self._work_scope.deadline, deadline)

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    async def run(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        """Run until stopped. Raises :class:`ServiceError` if the credential is rejected."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._heartbeat_loop)
            task_status.started()
            await self._work_loop()
            tg.cancel_scope.cancel()
        if self._fatal is not None:
            raise self._fatal

    def _reject(self, exc: ServiceError) -> None:
        log.error("credential rejected; stopping", extra={"action": "agent_unauthenticated", "code": exc.code})
        self._fatal = exc
        self.stop(immediately=True)

    async def _pause(self, seconds: float) -> None:
        """Sleep, waking early when the agent is asked to stop."""
        with anyio.move_on_after(seconds):
            await self._stopping.wait()

    # -- heartbeat -------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        failures = 0
        while True:
            delay = self._heartbeat_seconds
            try:
                await self.heartbeat()
                failures = 0
            except ServiceError as exc:
                if exc.status == 401:
                    self._reject(exc)
                    return
                failures += 1
                log.warning("heartbeat refused", extra={"action": "heartbeat_failed", "code": exc.code})
            except httpx.HTTPError as exc:
                failures += 1
                log.warning("heartbeat failed", extra={"action": "heartbeat_failed", "error": type(exc).__name__})
            if failures:
                delay = min(delay, backoff_delay(failures, self.config.backoff_base_seconds, self.config.backoff_cap_seconds))
            await anyio.sleep(delay)

    async def heartbeat(self) -> dict[str, Any]:
        devices = steady(self._reported, self._devices())
        answer = await self.client.heartbeat(
            devices=devices, agent_version=self.config.agent_version, agent_started_at=self.started_at
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
        with anyio.CancelScope() as self._poll_scope:
            await self._online.wait()
        failures = 0
        while not self.stopping:
            claim: Claim | None = None
            error: Exception | None = None
            with anyio.CancelScope() as self._poll_scope:
                try:
                    claim = await self.client.claim(self.config.claim_wait_seconds)
                except ServiceError as exc:
                    if exc.status == 401:
                        self._reject(exc)
                        break
                    error = exc
                except httpx.HTTPError as exc:
                    error = exc
            self._poll_scope = None
            if claim is not None:
                failures = 0
                await self.execute(claim)
            elif error is not None:
                failures += 1
                delay = backoff_delay(failures, self.config.backoff_base_seconds, self.config.backoff_cap_seconds)
                if isinstance(error, ServiceError) and error.retry_after:
                    delay = max(delay, error.retry_after)
                log.warning("claim failed; backing off", extra={"action": "claim_failed", "error": _describe(error), "delay_s": round(delay, 2)})
                await self._pause(delay)
            else:
                failures = 0

    async def execute(self, claim: Claim) -> Outcome:
        """Run one claimed job to a reported outcome."""
        log.info("job claimed", extra={"action": "job_claimed", "job_id": claim.job_id, "kind": claim.kind, "attempt": claim.attempt})
        lost: list[ServiceError] = []
        result: Any = None
        failure: BaseException | None = None
        async with anyio.create_task_group() as tg:
            with anyio.CancelScope() as work:
                self._work_scope = work
                max_runtime = (claim.job.get("requires") or {}).get("max_runtime_s")
                if isinstance(max_runtime, (int, float)) and max_runtime > 0:
                    work.deadline = anyio.current_time() + max_runtime
                if self.stopping:
                    work.deadline = min(work.deadline, anyio.current_time() + self.config.grace_seconds)
                tg.start_soon(self._renew_loop, claim, work, lost)
                try:
                    result = await self.registry.run(claim)
                    if not isinstance(result, Decompose):
                        msgspec.json.encode(result)
                except Exception as exc:  # the handler's failure is the job's failure
                    failure = exc
            self._work_scope = None
            tg.cancel_scope.cancel()
        if lost:
            outcome = Outcome(claim.job_id, claim.kind, "lost", lost[0].code)
        elif work.cancelled_caught and self.stopping:
            outcome = await self._report_failure(claim, "The agent stopped before the job finished.", retry=True)
        elif work.cancelled_caught:
            outcome = await self._report_failure(claim, "The job exceeded its max_runtime_s.", retry=False)
        elif failure is not None:
            message = str(failure) or type(failure).__name__
            outcome = await self._report_failure(claim, message, retry=is_retryable(failure))
        elif isinstance(result, Decompose):
            outcome = await self._report(claim, "decomposed", self.client.add_children, claim.job_id, claim.attempt, [c.to_json() for c in result.children])
        else:
            outcome = await self._report(claim, "complete", self.client.complete, claim.job_id, claim.attempt, result)
        self.outcomes.append(outcome)
        log.info("job finished", extra={"action": "job_finished", "job_id": claim.job_id, "outcome": outcome.status})
        return outcome

    async def _report_failure(self, claim: Claim, message: str, *, retry: bool) -> Outcome:
        status = "retrying" if retry else "failed"
        return await self._report(claim, status, self.client.fail, claim.job_id, claim.attempt, message, retry=retry)

    async def _report(self, claim: Claim, status: str, call, *args, **kwargs) -> Outcome:
        """Deliver an outcome, retrying transport errors while the lease could still hold."""
        deadline = anyio.current_time() + max(claim.lease_seconds, 1.0)
        failures = 0
        while True:
            try:
                answer = await call(*args, **kwargs)
                return Outcome(claim.job_id, claim.kind, status, answer)
            except ServiceError as exc:
                if exc.status == 401:
                    self._reject(exc)
                if exc.status < 500:
                    log.warning("outcome refused", extra={"action": "report_refused", "job_id": claim.job_id, "code": exc.code})
                    return Outcome(claim.job_id, claim.kind, "lost" if exc.code in LOST_CODES else "unreported", exc.code)
                error: Exception = exc
            except httpx.HTTPError as exc:
                error = exc
            failures += 1
            delay = backoff_delay(failures, self.config.backoff_base_seconds, self.config.backoff_cap_seconds)
            if anyio.current_time() + delay > deadline:
                log.error("outcome not delivered", extra={"action": "report_failed", "job_id": claim.job_id, "error": _describe(error)})
                return Outcome(claim.job_id, claim.kind, "unreported", _describe(error))
            await anyio.sleep(delay)

    async def _renew_loop(self, claim: Claim, work: anyio.CancelScope, lost: list[ServiceError]) -> None:
        interval = claim.lease_seconds / 3
        failures = 0
        while True:
            await anyio.sleep(max(0.2, interval))
            try:
                interval = await self.client.renew(claim.job_id, claim.attempt) / 3
                failures = 0
            except ServiceError as exc:
                if exc.status == 401:
                    self._reject(exc)
                if exc.status < 500:
                    log.warning("lease lost", extra={"action": "lease_lost", "job_id": claim.job_id, "code": exc.code})
                    lost.append(exc)
                    work.cancel()
                    return
                failures += 1
                interval = backoff_delay(failures, 0.2, claim.lease_seconds / 6)
            except (httpx.HTTPError, ValueError, KeyError):  # unreachable, or an answer we cannot read
                failures += 1
                interval = backoff_delay(failures, 0.2, claim.lease_seconds / 6)


def _describe(error: Exception) -> str:
    return error.code if isinstance(error, ServiceError) else type(error).__name__
